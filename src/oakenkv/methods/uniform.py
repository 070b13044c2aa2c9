"""Asymmetric min/max integer quantization, and the per-token-per-head INT-n baseline (QServe / Atom style).

``minmax_fake_quant`` is the textbook asymmetric quantizer every group-wise baseline here is built from: per
group, ``step = (max - min) / (2**bits - 1)``, ``code = round((x - min) / step)``, ``x_hat = min + code * step``,
with min and max stored in fp16 (32 bits per group; storing an fp16 scale and zero point costs the same).
"""

from __future__ import annotations

import torch

from oakenkv.methods.base import FP16_BITS, Kind, KVFakeQuantizer, check_kv

#: Bits stored per quantization group for its two fp16 end points (min and max, or scale and zero point).
GROUP_SCALE_BITS = 2 * FP16_BITS


def minmax_fake_quant(x: torch.Tensor, bits: int, dim: int = -1) -> torch.Tensor:
    """Quantize-dequantize ``x`` with one asymmetric ``bits``-bit grid per slice along ``dim``.

    Args:
        x: float tensor of any shape; every slice along ``dim`` (e.g. one token's head vector) is a group.
        bits: code width, 2..8.
        dim: the axis the min and max are taken over.

    Returns:
        float tensor of x's shape and dtype. The grid end points are rounded to fp16 (what is stored); values
        beyond a rounded end point clamp to it, so the error is at most half a step plus that rounding.
    """
    if not 2 <= bits <= 8:
        raise ValueError(f"bits must be in 2..8, got {bits}")
    x32 = x.float()
    lo = x32.amin(dim=dim, keepdim=True).to(torch.float16).float()
    hi = x32.amax(dim=dim, keepdim=True).to(torch.float16).float()
    levels = 2**bits - 1
    step = (hi - lo) / levels
    safe = torch.where(step > 0, step, torch.ones_like(step))
    codes = torch.clamp(torch.floor((x32 - lo) / safe + 0.5), 0, levels)
    out = torch.where(step > 0, lo + codes * step, lo)
    return out.to(x.dtype)


def grouped_fake_quant(x: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """``minmax_fake_quant`` over consecutive groups of ``group`` elements of the last axis (``D % group == 0``)."""
    d = x.shape[-1]
    if group <= 0 or d % group:
        raise ValueError(f"group size {group} must divide the last dimension {d}")
    g = x.reshape(*x.shape[:-1], d // group, group)
    return minmax_fake_quant(g, bits, dim=-1).reshape(x.shape)


class PerTokenIntQuantizer(KVFakeQuantizer):
    """Per-token, per-head asymmetric INT-n for keys (post-RoPE) and values, as QServe and Atom store them.

    Each head's vector of one token (``head_dim`` values, or ``group`` consecutive channels of it when
    ``group`` is set, Atom's group quantization) gets its own min/max. QServe additionally uses SmoothAttention
    and 8-bit weights; those act on the model, not on the KV format, and are not reproduced here.
    Stored bits per group: ``bits * group + 32``.
    """

    def __init__(self, bits: int = 4, group: int | None = None) -> None:
        if not 2 <= bits <= 8:
            raise ValueError(f"bits must be in 2..8, got {bits}")
        if group is not None and group <= 0:
            raise ValueError(f"group must be positive, got {group}")
        self.bits = bits
        self.group = group

    def quantize(self, layer_idx: int, kind: Kind, x: torch.Tensor) -> tuple[torch.Tensor, float]:
        check_kv(x, kind)
        g = x.shape[-1] if self.group is None else min(self.group, x.shape[-1])
        x_hat = grouped_fake_quant(x, self.bits, g)
        n = x.numel()
        return x_hat, n * self.bits + (n // g) * GROUP_SCALE_BITS
