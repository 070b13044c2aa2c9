"""Hardware arithmetic: the Oaken quantizer and dequantizer in the integer fixed-point arithmetic of the engines.

The reference quantizer (:mod:`oakenkv.quant.quantizer`) works in float32 and divides by data-dependent numbers; the
quantization and dequantization engines of the accelerator (Kim et al., ISCA 2025, Section 5.3) do neither.
This module is the *definition* of what they compute, vectorised in int64 PyTorch; the cycle-level models
(:mod:`oakenkv.hw.engines`) and the Amaranth RTL (:mod:`oakenkv.hw.rtl`) are tested against it bit for bit.
Its output is an ordinary :class:`~oakenkv.quant.quantizer.QuantizedVectors` (fp16 scales, same grouping, shift and
half-step grid), so :func:`oakenkv.kernels.codec.pack` stores it and :func:`oakenkv.quant.quantizer.dequantize` decodes
it.

Number formats
--------------
* ``FX`` (Q16.24): a value ``v`` is the signed integer ``round(v * 2^24)``. Every finite fp16 number is exact in
  it (smallest subnormal ``2^-24``, largest ``65504 < 2^16``), so the engines take fp16 keys/values and fp16
  scales without rounding: 41 bits signed for inputs, 42 bits for shifted values and ranges.
* Inputs: ``x`` is rounded to fp16 (what the accelerator's vector unit hands over), then converted exactly.
  Thresholds are rounded to the nearest FX integer (ties to even) once.
* Step of a signed group: unsigned integer in units of ``2^-(24 + STEP_EXTRA)``; grid end points in half-step
  units ``2^-(24 + STEP_EXTRA + 1)`` (the zero point sits half-way between two codes).

Quantizer (per row; ``n = 2^bits``)
-----------------------------------
1. *Decomposer*: group by integer comparison with the four thresholds (Eq. 1); shift by the nearer threshold
   (Eq. 4). Shifted middle/outer values are non-zero integers, so their side is their sign.
2. *Min/max finders*: per group, ``min`` and ``max`` of the shifted members.
3. *Scale calculator*, inner (plain) group: end points ``min``, ``max`` (rounded to fp16 for storage); codes
   ``floor(((s - min) * (n - 1) * Y + 2^(sh - 1)) / 2^sh)`` where ``Y / 2^sh ~ 1 / (max - min)`` comes from the
   reciprocal unit. Signed (middle, outer) groups: with ``a = -min`` (0 if no lower member) and ``b = max``
   (0 if no upper member), the number of steps below zero ``j = k + 1`` of :mod:`oakenkv.quant.quantizer`'s search is
   found without division: ``j* = floor(n * a / (a + b))`` (a thermometer of ``n`` constant-multiple
   comparisons in hardware) is the last ``j`` where the lower side needs the larger step, so the smallest step
   is at ``j*`` or ``j* + 1``; ``j* + 1`` wins only if strictly smaller (``b * j* < a * (n - 1 - j*)``, exact
   integer test, same tie rule as the float search). The step is ``num / den`` of the dominating side
   (``a / j`` or ``b / (n - j)``), computed as ``num * ceil(2^16 / den) >> 8`` (a 32-entry ROM; rounding up so
   every value fits the grid). End points ``-(2j - 1) * step / 2`` and that plus ``(n - 1) * step``, rounded to
   fp16 (round to nearest, ties to even). Codes: ``code = j + floor(s / step)``, clamped to ``[0, n - 1]``:
   because zero sits at ``j - 1/2``, every upper value lands on a code ``>= j`` and every lower value on one
   ``<= j - 1`` by construction (``floor`` of a positive product is ``>= 0``, of a negative one ``<= -1``), so no
   side nudge is needed; ``1 / step`` comes from the reciprocal unit.
4. *Reciprocal unit* ``recip(d)`` for an integer ``d > 0``: ``L = bit_length(d)``, the top ``RECIP_BITS`` bits
   ``m`` of ``d`` (truncated), a 64-entry LUT on the 6 bits after the leading one, one Newton step
   ``Y1 = Y0 * (2 - m * Y0)``. ``1 / d ~ Y1 * 2^-(RECIP_BITS + L - 1)`` with relative error below ~2^-12.
   The differences from the float quantizer are therefore: inputs rounded to fp16, thresholds to 2^-24, the
   step rounded up by at most 2^-11 relative, codes off by one where a value sits within ~2^-12 of a code
   boundary, and no "plain grid" special case for one-sided signed groups (they use the half-step grid with
   ``j = 0`` or ``j = n``, which the format and the float decoder handle alike).

Dequantizer (per value)
-----------------------
``g0, g1`` = the group's fp16 end points in FX (exact); ``v = g0 + floor(code * (g1 - g0) * RD_n / 2^18)`` with the
ROM constant ``RD_n = round(2^18 / (n - 1))``; signed groups add ``hi`` threshold if ``v > 0`` else the ``lo`` one.
The result is an FX integer (:func:`dequantize_hw_fx`); :func:`dequantize_hw` converts it to float32.
"""

from __future__ import annotations

import torch

from oakenkv.format.config import OakenConfig
from oakenkv.quant.quantizer import (
    GROUP_INNER,
    GROUP_MIDDLE,
    GROUP_OUTER,
    NUM_GROUPS,
    QuantizedVectors,
    ThresholdsLike,
    group_bits,
    thresholds_tuple,
)

#: Fractional bits of the FX format (Q16.24): every fp16 value is exact.
FX_FRAC = 24
#: Extra fractional bits of a signed group's step (units ``2^-(FX_FRAC + STEP_EXTRA)``).
STEP_EXTRA = 8
#: Shift of the small-divisor ROM ``ceil(2^DIV_SHIFT / den)``, den in 1..32.
DIV_SHIFT = 16
#: Precision of the reciprocal unit (normalised mantissa bits) and its LUT index width.
RECIP_BITS = 14
LUT_BITS = 6
#: Shift of the dequantizer's ``1 / (n - 1)`` ROM constant.
DEQ_SHIFT = 18
#: Largest FX magnitude of an input (fp16 max 65504 < 2^16).
FX_INPUT_MAX = 65504 << FX_FRAC

#: Reciprocal LUT: ``round(2^RECIP_BITS / (1 + (i + 0.5) / 2^LUT_BITS))``, the midpoint of each mantissa bin.
RECIP_LUT: tuple[int, ...] = tuple(round(2**RECIP_BITS / (1.0 + (i + 0.5) / 2**LUT_BITS)) for i in range(2**LUT_BITS))
#: Small-divisor ROM, indexed by the divisor 0..32 (entry 0 unused): ``ceil(2^DIV_SHIFT / den)``.
SMALL_RECIP: tuple[int, ...] = (0, *(-(-(2**DIV_SHIFT) // d) for d in range(1, 33)))


def dequant_const(bits: int) -> int:
    """ROM constant ``round(2^DEQ_SHIFT / (2^bits - 1))`` of the dequantizer."""
    return round(2**DEQ_SHIFT / (2**bits - 1))


# --------------------------------------------------------------------------------------------------------------
# Format conversions
# --------------------------------------------------------------------------------------------------------------


def fp16_to_fx(h: torch.Tensor) -> torch.Tensor:
    """fp16 (any shape) -> int64 FX, exact."""
    if h.dtype != torch.float16:
        raise TypeError(f"fp16_to_fx expects float16, got {h.dtype}")
    return (h.to(torch.float64) * 2.0**FX_FRAC).to(torch.int64)


def fx_to_float(v: torch.Tensor) -> torch.Tensor:
    """int64 FX -> float32 (via float64; FX values below 2^53 convert exactly to float64)."""
    return (v.to(torch.float64) * 2.0**-FX_FRAC).to(torch.float32)


def threshold_fx(thr: ThresholdsLike) -> tuple[int, int, int, int]:
    """The thresholds ``(to_lo, ti_lo, ti_hi, to_hi)`` as FX integers (round to nearest, ties to even)."""
    t = thresholds_tuple(thr)
    if any(abs(v) > 65504.0 for v in t):
        raise ValueError(f"hardware arithmetic needs thresholds within the fp16 range, got {t}")
    out = tuple(round(v * 2.0**FX_FRAC) for v in t)  # float64 * power of two is exact; round() ties to even
    if not (out[0] < out[1] <= out[2] < out[3]):
        raise ValueError(f"thresholds collapse in FX (2^-{FX_FRAC} resolution): {t}")
    return out  # type: ignore[return-value]


def bit_length(m: torch.Tensor) -> torch.Tensor:
    """Elementwise bit length of a non-negative int64 tensor (0 for 0): the leading-zero counter."""
    bl = torch.zeros_like(m)
    for t in range(63):
        bl += (m >> t) > 0
    return bl


def fx_to_fp16(v: torch.Tensor, frac: int) -> torch.Tensor:
    """Round the fixed-point integers ``v * 2^-frac`` (int64, any shape) to fp16, to nearest, ties to even.

    This is the integer rounding the scale calculator's fp16 converter performs (no float intermediate, so no
    double rounding). Raises ``ValueError`` if a value overflows fp16.
    """
    neg = v < 0
    m = v.abs()
    e = bit_length(m) - 1 - frac  # value in [2^e, 2^(e+1))
    qe = torch.clamp(e - 10, min=-24)  # exponent of the fp16 quantum (subnormals: 2^-24)
    shift = qe + frac  # low bits of m to drop
    pos = torch.clamp(shift, min=0)
    q = m >> pos
    rem = m - (q << pos)
    half = torch.where(pos > 0, torch.ones_like(pos) << torch.clamp(pos - 1, min=0), torch.zeros_like(pos))
    up = (pos > 0) & ((rem > half) | ((rem == half) & ((q & 1) == 1)))
    q = q + up.to(torch.int64)
    q = torch.where(shift < 0, m << torch.clamp(-shift, min=0), q)
    mag = q.to(torch.float64) * torch.pow(2.0, qe.to(torch.float64))
    if bool((mag > 65504.0).any()):
        raise ValueError("a grid end point exceeds the fp16 maximum (65504); hardware arithmetic stores fp16 scales")
    return torch.where(neg, -mag, mag).to(torch.float16)


def reciprocal(d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reciprocal unit: ``(Y1, L)`` with ``1 / d ~ Y1 * 2^-(RECIP_BITS + L - 1)`` for int64 ``d > 0``.

    ``d <= 0`` lanes return garbage that callers mask out. ``Y1 <= 2^RECIP_BITS``.
    """
    p = RECIP_BITS
    d = torch.clamp(d, min=1)
    L = bit_length(d)
    m = torch.where(p >= L, d << torch.clamp(p - L, min=0), d >> torch.clamp(L - p, min=0))  # [2^(p-1), 2^p)
    idx = (m >> (p - 1 - LUT_BITS)) & (2**LUT_BITS - 1)
    y0 = torch.tensor(RECIP_LUT, dtype=torch.int64)[idx]
    t = (m * y0) >> (p - 1)  # m * y0 in Q.p, ~ 2^p
    y1 = (y0 * ((1 << (p + 1)) - t)) >> p
    return y1, L


# --------------------------------------------------------------------------------------------------------------
# Quantizer
# --------------------------------------------------------------------------------------------------------------


#: What the hardware model says to a static-grid config (``OakenConfig.static_grids``).
STATIC_GRIDS_REFUSED = (
    "the hardware engines (hw/) compute and store every row's six scales; static middle/inner grids "
    "(OakenConfig.static_grids) are not modelled there"
)


def _check_config(config: OakenConfig) -> None:
    if config.scale_dtype != "float16":
        raise ValueError("hardware arithmetic stores fp16 scales; use OakenConfig(scale_dtype='float16')")
    if config.static_grids:
        raise NotImplementedError(STATIC_GRIDS_REFUSED)
    if config.middle_bits != 4:  # (the step ROM has 32 entries: a wider grid got twice the step, silently)
        raise ValueError(
            f"hardware arithmetic models the paper's 4-bit dense slot; this config has {config.middle_bits}-bit slots"
        )


def input_fx(x: torch.Tensor) -> torch.Tensor:
    """float ``[..]`` -> int64 FX via fp16 (the engine's input format). Rejects NaN/Inf and fp16 overflow."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError("expected a floating-point torch.Tensor")
    x32 = x.detach().to(torch.float32)
    if not bool(torch.isfinite(x32).all()):
        raise ValueError("input contains NaN or infinite values; the KV cache cannot quantize them")
    h = x32.to(torch.float16)
    if not bool(torch.isfinite(h).all()):
        raise ValueError("input exceeds the fp16 range (65504); the hardware engines take fp16 keys/values")
    return fp16_to_fx(h)


def groups_fx(x: torch.Tensor, t: tuple[int, int, int, int]) -> torch.Tensor:
    """Decomposer, Eq. 1 on FX integers: uint8 group ids of ``x`` (int64, any shape)."""
    to_lo, ti_lo, ti_hi, to_hi = t
    g = torch.full(x.shape, GROUP_MIDDLE, dtype=torch.uint8)
    g[(x >= ti_lo) & (x <= ti_hi)] = GROUP_INNER
    g[(x > to_hi) | (x < to_lo)] = GROUP_OUTER
    return g


def shift_fx(x: torch.Tensor, g: torch.Tensor, t: tuple[int, int, int, int]) -> torch.Tensor:
    """Decomposer, Eq. 4 on FX integers: the shifted values (int64, x's shape)."""
    to_lo, ti_lo, ti_hi, to_hi = t
    outer, middle = g == GROUP_OUTER, g == GROUP_MIDDLE
    sh = torch.zeros_like(x)
    sh = torch.where(outer & (x > to_hi), to_hi, sh)
    sh = torch.where(outer & (x < to_lo), to_lo, sh)
    sh = torch.where(middle & (x > ti_hi), ti_hi, sh)
    sh = torch.where(middle & (x < ti_lo), ti_lo, sh)
    return x - sh


def signed_grid(lo: torch.Tensor, hi: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale calculator of a signed group: ``(j, step)`` (int64 ``[N]``) from the members' ``min``/``max``.

    ``lo``/``hi``: int64 ``[N]`` shifted min and max of the group (0 where the group is empty). ``j`` is the number
    of codes below zero, ``step`` in units of ``2^-(FX_FRAC + STEP_EXTRA)`` (0 for an empty group).
    """
    n = 2**bits
    a = torch.clamp(-lo, min=0)
    b = torch.clamp(hi, min=0)
    tot = a + b
    empty = tot == 0
    jstar = (n * a) // torch.clamp(tot, min=1)
    j = jstar + ((jstar < n) & (b * jstar < a * (n - 1 - jstar))).to(torch.int64)
    lo_dom = (j > 0) & (a * (n - j) >= b * j)
    num = torch.where(lo_dom, a, b)
    den = torch.where(lo_dom, j, n - j).clamp(1, 32)
    rom = torch.tensor(SMALL_RECIP, dtype=torch.int64)[den]
    step = torch.clamp((num * rom) >> (DIV_SHIFT - STEP_EXTRA), min=1)
    return torch.where(empty, 0, j), torch.where(empty, 0, step)


def quantize_hw_fx(
    x: torch.Tensor, t: tuple[int, int, int, int], config: OakenConfig | None = None
) -> QuantizedVectors:
    """Quantize FX rows with the engines' arithmetic.

    Args:
        x: int64 ``[N, D]`` FX values (``|x| <= FX_INPUT_MAX``).
        t: FX thresholds from :func:`threshold_fx`.
    """
    config = config or OakenConfig()
    _check_config(config)
    if x.dim() != 2 or x.dtype != torch.int64:
        raise ValueError(f"quantize_hw_fx expects int64 [N, D], got {x.dtype} {tuple(x.shape)}")
    if x.numel() and int(x.abs().max()) > FX_INPUT_MAX:
        raise ValueError("FX input outside the fp16 range")
    g = groups_fx(x, t)
    s = shift_fx(x, g, t)
    n_rows = x.shape[0]
    big = torch.tensor(1 << 62, dtype=torch.int64)
    codes = torch.zeros(x.shape, dtype=torch.int64)
    mins = torch.zeros((n_rows, NUM_GROUPS), dtype=torch.float16)
    maxs = torch.zeros_like(mins)
    bits = group_bits(config)
    for grp in (GROUP_MIDDLE, GROUP_INNER, GROUP_OUTER):
        n = 2 ** bits[grp]
        member = g == grp
        has = member.any(dim=1)
        if x.shape[1]:
            mn = torch.where(has, torch.where(member, s, big).amin(dim=1), 0)
            mx = torch.where(has, torch.where(member, s, -big).amax(dim=1), 0)
        else:
            mn = mx = torch.zeros(n_rows, dtype=torch.int64)
        if grp == GROUP_INNER:
            r = mx - mn
            y1, L = reciprocal(r)
            sh = (RECIP_BITS + L - 1)[:, None]
            q = ((s - mn[:, None]) * (n - 1) * y1[:, None] + (1 << (sh - 1))) >> sh
            q = torch.where((r > 0)[:, None], q.clamp(0, n - 1), 0)
            mins[:, grp], maxs[:, grp] = fx_to_fp16(mn, FX_FRAC), fx_to_fp16(mx, FX_FRAC)
        else:
            j, step = signed_grid(mn, mx, bits[grp])
            y1, L = reciprocal(step)
            sh = (RECIP_BITS + L - 1 - STEP_EXTRA)[:, None]  # >= 6: L >= 1
            q = (j[:, None] + ((s * y1[:, None]) >> sh)).clamp(0, n - 1)
            gmin2 = -(2 * j - 1) * step
            gmax2 = gmin2 + 2 * (n - 1) * step
            frac = FX_FRAC + STEP_EXTRA + 1
            mins[:, grp] = torch.where(has, fx_to_fp16(gmin2, frac), 0)
            maxs[:, grp] = torch.where(has, fx_to_fp16(gmax2, frac), 0)
        codes = torch.where(member, q, codes)
    return QuantizedVectors(codes=codes.to(torch.uint8), groups=g, mins=mins, maxs=maxs)


def quantize_hw(x: torch.Tensor, thr: ThresholdsLike, config: OakenConfig | None = None) -> QuantizedVectors:
    """Quantize float rows ``[N, D]`` with the engines' fixed-point arithmetic (inputs rounded to fp16 first).

    The result packs with :func:`oakenkv.kernels.codec.pack` and decodes with :func:`oakenkv.quant.quantizer.dequantize`
    or
    :func:`dequantize_hw`.
    """
    if x.dim() != 2:
        raise ValueError(f"quantize_hw expects x of shape [N, D] (one row per vector), got {tuple(x.shape)}")
    return quantize_hw_fx(input_fx(x), threshold_fx(thr), config)


# --------------------------------------------------------------------------------------------------------------
# Dequantizer
# --------------------------------------------------------------------------------------------------------------


def encode_hw(x: torch.Tensor, thr: ThresholdsLike, config: OakenConfig | None = None):
    """The codec's hardware-arithmetic mode: ``codec.pack(quantize_hw(x))``, an
    :class:`~oakenkv.kernels.codec.EncodedBatch`
    byte-identical to what the quantization engine writes (``x``: float ``[N, D]``)."""
    from oakenkv.kernels.codec import pack

    config = config or OakenConfig()
    return pack(quantize_hw(x, thr, config), config)


def decode_hw(enc, thr: ThresholdsLike, config: OakenConfig | None = None) -> torch.Tensor:
    """Decode an :class:`~oakenkv.kernels.codec.EncodedBatch` with the dequantization engine's arithmetic: float32 [N,
    D]."""
    from oakenkv.kernels.codec import unpack

    config = config or OakenConfig()
    return dequantize_hw(unpack(enc, config), thr, config)


def dequantize_hw_fx(
    q: QuantizedVectors, t: tuple[int, int, int, int], config: OakenConfig | None = None
) -> torch.Tensor:
    """The dequantization engine's output: int64 FX ``[N, D]``."""
    config = config or OakenConfig()
    _check_config(config)
    if q.mins.dtype != torch.float16 or q.maxs.dtype != torch.float16:
        raise ValueError("hardware dequantization reads fp16 scales")
    to_lo, ti_lo, ti_hi, to_hi = t
    bits = group_bits(config)
    codes = q.codes.to(torch.int64)
    out = torch.zeros(codes.shape, dtype=torch.int64)
    for grp in (GROUP_MIDDLE, GROUP_INNER, GROUP_OUTER):
        g0 = fp16_to_fx(q.mins[:, grp])[:, None]
        dr = (fp16_to_fx(q.maxs[:, grp])[:, None] - g0) * dequant_const(bits[grp])
        v = g0 + ((codes * dr) >> DEQ_SHIFT)
        if grp == GROUP_MIDDLE:
            v = v + torch.where(v > 0, ti_hi, ti_lo)
        elif grp == GROUP_OUTER:
            v = v + torch.where(v > 0, to_hi, to_lo)
        out = torch.where(q.groups == grp, v, out)
    return out


def dequantize_hw(q: QuantizedVectors, thr: ThresholdsLike, config: OakenConfig | None = None) -> torch.Tensor:
    """Dequantize with the engine's arithmetic: float32 ``[N, D]``."""
    return fx_to_float(dequantize_hw_fx(q, threshold_fx(thr), config))


def quantize_dequantize_hw(x: torch.Tensor, thr: ThresholdsLike, config: OakenConfig | None = None) -> torch.Tensor:
    """Fake quantization through both engines (any leading shape; last dim is the vector); x's shape and dtype."""
    if x.dim() < 1:
        raise ValueError("quantize_dequantize_hw expects at least one dimension (the vector)")
    flat = x.reshape(-1, x.shape[-1])
    out = dequantize_hw(quantize_hw(flat, thr, config), thr, config)
    return out.reshape(x.shape).to(x.dtype)


__all__ = [
    "FX_FRAC",
    "decode_hw",
    "dequantize_hw",
    "dequantize_hw_fx",
    "encode_hw",
    "fp16_to_fx",
    "fx_to_float",
    "fx_to_fp16",
    "input_fx",
    "quantize_dequantize_hw",
    "quantize_hw",
    "quantize_hw_fx",
    "reciprocal",
    "threshold_fx",
]
