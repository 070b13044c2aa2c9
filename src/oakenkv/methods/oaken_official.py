"""Oaken as the authors' evaluation harness computes it: calibrated global min/max, pre-RoPE keys.

The paper's method (and :mod:`oakenkv.quant.quantizer`) takes a min and max **per token** for each of the three groups
and quantizes keys **after RoPE**, which is what a KV cache stores. The official harness instead fake-quantizes
with one min/max per group **per layer** fixed offline (here: the global min/max of the calibration data) and
quantizes keys **before RoPE**. This variant reproduces that, to measure how much it flatters the method.

Per layer and group (thresholds ``to_lo < ti_lo <= ti_hi < to_hi``, calibration extremes ``xmin``, ``xmax``):
- outer (x > to_hi or x < to_lo): shifted ``s = x - to_hi`` or ``x - to_lo``, grid over
  ``[xmin - to_lo, xmax - to_hi]`` with ``outer_bits``;
- middle: ``s = x - ti_hi`` or ``x - ti_lo``, grid over ``[to_lo - ti_lo, to_hi - ti_hi]`` with 4 bits;
- inner (ti_lo <= x <= ti_hi): ``s = x``, grid over ``[ti_lo, ti_hi]`` with ``inner_bits``;
then ``x_hat = s_hat + threshold of x's side``. The side is taken from the unquantized x, as a fake-quant
harness does (Oaken's real format recovers it from the sign of the dequantized value).

Stored bits: 4 per value + 8 per inner/outer value (COO entry) + a 16-bit count per token vector; no per-token
scales (they are per-layer constants).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from oakenkv.format.layout import format_bits
from oakenkv.methods.base import Kind, KVFakeQuantizer, check_kv


def _grid(s: torch.Tensor, lo: float, hi: float, bits: int) -> torch.Tensor:
    """Round ``s`` to the ``bits``-bit uniform grid from ``lo`` to ``hi`` (fp16-rounded ends), clamping."""
    lo16 = float(torch.tensor(lo, dtype=torch.float16))
    hi16 = float(torch.tensor(hi, dtype=torch.float16))
    levels = 2**bits - 1
    step = (hi16 - lo16) / levels
    if step <= 0:
        return torch.full_like(s, lo16)
    codes = torch.clamp(torch.floor((s - lo16) / step + 0.5), 0, levels)
    return lo16 + codes * step


def official_fake_quant(
    x: torch.Tensor,
    thr: Sequence[float],
    xmin: float,
    xmax: float,
    middle_bits: int = 4,
    inner_bits: int = 5,
    outer_bits: int = 5,
) -> tuple[torch.Tensor, int]:
    """Fake-quantize ``x`` (any shape, float) with fixed per-layer group grids; returns ``(x_hat, n_outliers)``."""
    to_lo, ti_lo, ti_hi, to_hi = (float(t) for t in thr)
    if not to_lo < ti_lo <= ti_hi < to_hi:
        raise ValueError(f"thresholds must satisfy to_lo < ti_lo <= ti_hi < to_hi, got {thr}")
    xmin, xmax = min(xmin, to_lo), max(xmax, to_hi)
    v = x.float()
    up_out, lo_out = v > to_hi, v < to_lo
    inner = (v >= ti_lo) & (v <= ti_hi)
    middle = ~(up_out | lo_out | inner)
    up_mid = middle & (v > ti_hi)

    s_out = torch.where(up_out, v - to_hi, v - to_lo)
    q_out = _grid(s_out, xmin - to_lo, xmax - to_hi, outer_bits)
    # A code may round to the other side of zero; the side (and so the threshold added back) is x's.
    out_hat = torch.where(up_out, to_hi + q_out.clamp(min=0), to_lo + q_out.clamp(max=0))

    s_mid = torch.where(up_mid, v - ti_hi, v - ti_lo)
    q_mid = _grid(s_mid, to_lo - ti_lo, to_hi - ti_hi, middle_bits)
    mid_hat = torch.where(up_mid, ti_hi + q_mid.clamp(min=0), ti_lo + q_mid.clamp(max=0))

    in_hat = _grid(v, ti_lo, ti_hi, inner_bits)

    x_hat = torch.where(up_out | lo_out, out_hat, torch.where(inner, in_hat, mid_hat))
    n_out = int((up_out | lo_out | inner).sum())
    return x_hat.to(x.dtype), n_out


class OakenOfficialQuantizer(KVFakeQuantizer):
    """The official harness's Oaken: per-layer thresholds and calibrated global min/max, pre-RoPE keys."""

    key_position = "pre_rope"

    def __init__(
        self,
        thresholds: dict[Kind, Sequence[Sequence[float]]],
        extremes: dict[Kind, Sequence[tuple[float, float]]],
        inner_bits: int = 5,
        outer_bits: int = 5,
    ) -> None:
        """
        Args:
            thresholds: per kind, per layer ``(to_lo, ti_lo, ti_hi, to_hi)`` of the pre-RoPE keys / values.
            extremes: per kind, per layer ``(xmin, xmax)`` of the calibration data.
        """
        for kind in ("key", "value"):
            if len(thresholds[kind]) != len(extremes[kind]):
                raise ValueError(f"{kind}: {len(thresholds[kind])} threshold layers vs {len(extremes[kind])} extremes")
        self.thresholds = thresholds
        self.extremes = extremes
        self.inner_bits, self.outer_bits = inner_bits, outer_bits

    def quantize(self, layer_idx: int, kind: Kind, x: torch.Tensor) -> tuple[torch.Tensor, float]:
        check_kv(x, kind)
        thr = self.thresholds[kind][layer_idx]
        thr = thr.as_tuple() if hasattr(thr, "as_tuple") else tuple(thr)
        xmin, xmax = self.extremes[kind][layer_idx]
        x_hat, n_out = official_fake_quant(x, thr, xmin, xmax, inner_bits=self.inner_bits, outer_bits=self.outer_bits)
        b, h, s, d = x.shape
        # Oaken's fused format with one global grid per layer: no per-token scales
        return x_hat, format_bits(b * s, h * d, n_out, scale_bits=0)
