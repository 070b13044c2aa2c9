"""KVQuant-style 4-bit KV cache (Hooper et al., NeurIPS 2024) with 1% dense-and-sparse fp16 outliers.

What is kept from KVQuant: keys are quantized **pre-RoPE** and **per channel** with per-channel ranges
calibrated offline (the 0.5% and 99.5% quantiles of each channel, so ~1% of key values fall outside);
values are quantized **per token** with the outlier threshold found online per token vector (the
``outlier_ratio / 2`` largest and smallest values of each token's vector across heads); every outlier is
kept exactly in fp16 in a sparse matrix (dense-and-sparse), its dense slot is unused.

Simplified, said plainly: the dense part uses a **uniform** 4-bit grid between the calibrated (keys) or
per-token (values) ends, not KVQuant's sensitivity-weighted non-uniform (nuq4) datatype; no attention-sink
(first-token fp16) exception; no Q-Norm. Both simplifications make this baseline slightly weaker than the
paper's KVQuant.

Stored bits: 4 per value (dense slot, outliers included) + 32 per outlier (fp16 value + 16-bit index) + a
16-bit outlier count per token vector; values add 32 bits of per-token min/max per token vector. Key ranges
are per-layer constants.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from oakenkv.format.layout import HEADER_BITS
from oakenkv.methods.base import FP16_BITS, Kind, KVFakeQuantizer, check_kv
from oakenkv.methods.uniform import GROUP_SCALE_BITS

#: Bits of one sparse outlier entry: fp16 value + 16-bit index (KVQuant's CSR/CSC stores 16-bit values
#: with integer indices; we charge 16 bits, enough for any token vector up to 65536 values).
OUTLIER_ENTRY_BITS = 2 * FP16_BITS
#: Per-token-vector header: number of outliers, charged as Oaken's per-token sparse count (oakenkv.format.layout).
KVQUANT_HEADER_BITS = HEADER_BITS


def _uniform_codes(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bits: int) -> torch.Tensor:
    """Round ``x`` (already inside [lo, hi]) to the ``bits``-bit grid from ``lo`` to ``hi`` (broadcast)."""
    levels = 2**bits - 1
    step = (hi - lo) / levels
    safe = torch.where(step > 0, step, torch.ones_like(step))
    codes = torch.clamp(torch.floor((x - lo) / safe + 0.5), 0, levels)
    return torch.where(step > 0, lo + codes * step, lo)


def kvquant_keys(k: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bits: int = 4) -> tuple[torch.Tensor, int]:
    """Per-channel dense-and-sparse fake quantization of (pre-RoPE) keys with calibrated channel ranges.

    Args:
        k: ``[B, H, S, D]`` keys.
        lo, hi: ``[H, D]`` calibrated per-channel range; values outside it are fp16 outliers.

    Returns:
        ``(k_hat [B, H, S, D], number of outliers)``.
    """
    lo = lo.to(torch.float16).float()[None, :, None, :]
    hi = hi.to(torch.float16).float()[None, :, None, :]
    x = k.float()
    outlier = (x < lo) | (x > hi)
    dense = _uniform_codes(torch.clamp(x, lo, hi), lo, hi, bits)
    out = torch.where(outlier, x.to(torch.float16).float(), dense)
    return out.to(k.dtype), int(outlier.sum())


def kvquant_values(v: torch.Tensor, outlier_ratio: float = 0.01, bits: int = 4) -> tuple[torch.Tensor, int]:
    """Per-token dense-and-sparse fake quantization of values; outliers found online per token vector.

    Args:
        v: ``[B, H, S, D]`` values. One token vector is the token's values across all heads (``H * D``).

    Returns:
        ``(v_hat [B, H, S, D], number of outliers)``: per token, the ``max(1, round(outlier_ratio / 2 * H * D))``
        largest and as many smallest values are kept in fp16, the rest share one min/max grid.
    """
    b, h, s, d = v.shape
    x = v.float().permute(0, 2, 1, 3).reshape(b, s, h * d)  # [B, S, H*D]
    n_side = max(1, round(outlier_ratio / 2 * h * d))
    if 2 * n_side >= h * d:
        raise ValueError(f"outlier_ratio {outlier_ratio} leaves no inliers in vectors of {h * d}")
    srt = x.sort(dim=-1).values
    lo_thr = srt[..., n_side - 1 : n_side]  # largest value that is a low outlier
    hi_thr = srt[..., -n_side:][..., :1]  # smallest value that is a high outlier
    inl_lo = srt[..., n_side : n_side + 1].to(torch.float16).float()
    inl_hi = srt[..., -n_side - 1 : -n_side].to(torch.float16).float()
    outlier = (x <= lo_thr) | (x >= hi_thr)
    dense = _uniform_codes(torch.clamp(x, inl_lo, inl_hi), inl_lo, inl_hi, bits)
    out = torch.where(outlier, x.to(torch.float16).float(), dense)
    out = out.reshape(b, s, h, d).permute(0, 2, 1, 3)
    return out.to(v.dtype).contiguous(), int(outlier.sum())


class KVQuantQuantizer(KVFakeQuantizer):
    """KVQuant-style 4-bit + 1% fp16 outliers; keys pre-RoPE per channel (calibrated), values per token."""

    key_position = "pre_rope"

    def __init__(
        self,
        key_ranges: Sequence[tuple[torch.Tensor, torch.Tensor]],
        bits: int = 4,
        outlier_ratio: float = 0.01,
    ) -> None:
        """
        Args:
            key_ranges: per decoder layer, ``(lo, hi)`` each ``[H, D]``: the calibrated per-channel range of
                the pre-RoPE keys (quantiles ``outlier_ratio / 2`` and ``1 - outlier_ratio / 2``).
        """
        if not 0 < outlier_ratio < 0.5:
            raise ValueError(f"outlier_ratio must be in (0, 0.5), got {outlier_ratio}")
        for i, (lo, hi) in enumerate(key_ranges):
            if lo.shape != hi.shape or lo.dim() != 2 or not bool((lo <= hi).all()):
                raise ValueError(f"key_ranges[{i}] must be two [H, D] tensors with lo <= hi")
        self.key_ranges = list(key_ranges)
        self.bits = bits
        self.outlier_ratio = outlier_ratio

    def quantize(self, layer_idx: int, kind: Kind, x: torch.Tensor) -> tuple[torch.Tensor, float]:
        check_kv(x, kind)
        b, h, s, d = x.shape
        tokens = b * s
        if kind == "key":
            lo, hi = self.key_ranges[layer_idx]
            if lo.shape != (h, d):
                raise ValueError(f"layer {layer_idx}: key ranges are {tuple(lo.shape)}, keys have [H, D]=({h}, {d})")
            x_hat, n_out = kvquant_keys(x, lo, hi, self.bits)
            scale_bits = 0
        else:
            x_hat, n_out = kvquant_values(x, self.outlier_ratio, self.bits)
            scale_bits = tokens * GROUP_SCALE_BITS
        bits = x.numel() * self.bits + n_out * OUTLIER_ENTRY_BITS + tokens * KVQUANT_HEADER_BITS + scale_bits
        return x_hat, bits
