"""Rotary position embedding, undone and redone: for pre-RoPE key recording (``oakenkv.calibrate.profile``) and the
evaluated methods that quantize keys before RoPE (``oakenkv.eval``).

transformers (5.x) calls ``cache.update`` with keys that are already rotated and no longer passes ``cos`` /
``sin`` along, so the cache recomputes them from the model's own rotary module for the positions it is
storing (``start .. start + S - 1``: caches are filled left to right from position 0, which holds for
perplexity windows and right-padded zero-shot requests).

RoPE as transformers applies it (``apply_rotary_pos_emb``): ``k_rot = k * cos + rotate_half(k) * sin`` where
``rotate_half`` maps ``(x1, x2)`` to ``(-x2, x1)`` (R, with R @ R = -I) and cos/sin repeat over the two halves,
so ``k_rot = (cos + sin R) k``. Its inverse is ``k = (cos - sin R) k_rot / (cos**2 + sin**2)`` (the
denominator is 1 unless the rope type scales cos and sin by an attention factor).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``(x1, x2) -> (-x2, x1)`` over the two halves of the last axis (transformers' convention)."""
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def apply_rope(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``k`` ``[B, H, S, D]`` with ``cos``/``sin`` broadcastable to it (``[1|B, 1, S, D]``)."""
    return k * cos + rotate_half(k) * sin


def invert_rope(k_rot: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Undo :func:`apply_rope`: ``(k_rot * cos - rotate_half(k_rot) * sin) / (cos**2 + sin**2)``."""
    return (k_rot * cos - rotate_half(k_rot) * sin) / (cos * cos + sin * sin)


def has_rope(model: Any) -> bool:
    """Whether ``model`` has a rotary embedding module. A model without one (GPT-2, OPT: learned or no positions)
    caches keys that are already what a pre-RoPE method quantizes."""
    return any("rotary" in type(m).__name__.lower() for m in model.modules())


class RopeTable:
    """cos/sin of a model's rotary embedding per layer and position, computed on demand and memoized.

    Works with models whose decoder exposes ``rotary_emb(x, position_ids[, layer_type])`` (Llama, Gemma-3,
    Mistral, Qwen2, ...) and rotates the whole head dimension.
    """

    def __init__(self, model: Any) -> None:
        decoder = getattr(model, "model", None) or model.base_model
        rotary = getattr(decoder, "rotary_emb", None)
        if rotary is None:
            raise ValueError(
                f"{type(model).__name__} has no decoder.rotary_emb; pre-RoPE key quantization is not supported"
            )
        self.rotary = rotary
        cfg = model.config.get_text_config(decoder=True)
        self.layer_types = list(getattr(cfg, "layer_types", None) or [])
        self.takes_layer_type = "layer_type" in inspect.signature(rotary.forward).parameters
        self._cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def cos_sin(self, layer_idx: int, start: int, length: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[1, 1, length, D]`` (``like``'s dtype) for positions ``start .. start + length - 1``."""
        layer_type = self.layer_types[layer_idx] if self.takes_layer_type and self.layer_types else ""
        end = start + length
        have = self._cache.get(layer_type)
        if have is None or have[0].shape[-2] < end:
            n = max(end, 2 * (have[0].shape[-2] if have else 0), 256)
            pos = torch.arange(n, device=like.device)[None]
            dummy = torch.zeros(1, dtype=torch.float32, device=like.device)
            with torch.no_grad():
                args = (dummy, pos, layer_type) if layer_type else (dummy, pos)
                cos, sin = self.rotary(*args)
            if cos.shape[-1] != like.shape[-1]:
                raise ValueError(f"rotary dim {cos.shape[-1]} != head_dim {like.shape[-1]}: partial RoPE unsupported")
            have = (cos[:, None].float(), sin[:, None].float())  # [1, 1, n, D]
            self._cache[layer_type] = have
        cos, sin = have
        return cos[..., start:end, :].to(like.dtype), sin[..., start:end, :].to(like.dtype)
