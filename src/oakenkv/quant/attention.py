"""Plain float attention, the reference every attention over the packed pages is checked against, and what the
cache's float read path and the calibration's recording compute where SDPA cannot (a soft cap)."""

from __future__ import annotations

import torch


def float_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    softcap: float | None = None,
    is_causal: bool = False,
) -> torch.Tensor:
    """Plain float32 attention with GQA: query ``[B, Hq, S, hd]``, keys/values ``[B, H, T, hd]``, mask
    ``[B, 1, S, T]`` (bool or additive) -> ``[B, S, Hq, hd]``.

    No mask with ``is_causal`` and more than one query is SDPA's ``is_causal=True`` (query ``i`` attends keys
    ``0..i``: the upper-left alignment transformers relies on when its mask functions return None for a plain
    causal prompt); no mask otherwise attends everything."""
    if attention_mask is None and is_causal and query.shape[-2] > 1:
        attention_mask = torch.ones(query.shape[-2], keys.shape[-2], dtype=torch.bool, device=query.device).tril()
    q = query.to(torch.float32)
    group = q.shape[1] // keys.shape[1]
    k = keys.to(torch.float32).repeat_interleave(group, dim=1)
    v = values.to(torch.float32).repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-1, -2)) * scaling
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, float("-inf"))
        else:
            scores = scores + attention_mask
    p = torch.softmax(scores, dim=-1)
    if attention_mask is not None:
        # a query that may attend to nothing (a left-padded row's padding) outputs zeros, as SDPA and the packed
        # kernels do, not softmax's NaN over all -inf (its NaN would reach the next layer's keys)
        p = p.masked_fill((scores == float("-inf")).all(dim=-1, keepdim=True), 0.0)
    return (p @ v).transpose(1, 2).to(query.dtype)


def module_is_causal(module: torch.nn.Module, kwargs: dict) -> bool:
    """Whether an attention call without a mask is causal, as transformers' SDPA function decides it (its mask
    functions return None for an unpadded causal prompt and leave causality to SDPA's ``is_causal``)."""
    causal = kwargs.get("is_causal")
    return bool(getattr(module, "is_causal", True) if causal is None else causal)
