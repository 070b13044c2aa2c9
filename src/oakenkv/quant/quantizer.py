"""The reference Oaken quantizer, in plain PyTorch: the numbers every fast path is tested against.

One *row* is one quantization vector: by default one token's keys (or values) for one decoder layer, all KV heads
together (``granularity="token"``, the paper); for ``granularity="head"`` call with ``x.reshape(-1, head_dim)``.

Per row, with the layer's thresholds ``(to_lo, ti_lo, ti_hi, to_hi)`` (Kim et al., ISCA 2025, Section 4):

1. **Grouping (Eq. 1).** ``outer``: ``x > to_hi`` or ``x < to_lo``; ``inner``: ``ti_lo <= x <= ti_hi``; ``middle``:
   the rest. A value exactly on an outer threshold is middle, one exactly on an inner threshold is inner.
2. **Group shift (Eq. 4).** Outer values minus ``to_hi`` (upper side) or ``to_lo`` (lower side); middle values
   minus ``ti_hi`` or ``ti_lo``; inner values unshifted. Shifted outer and middle values are never 0: the upper side
   is strictly positive and the lower side strictly negative.
3. **Per-group min/max uniform quantization (Eq. 2/3).** Middle to 4 bits, inner and outer to 5 bits (the paper's;
   ``OakenConfig.middle_bits`` sets the middle code to 2-7 bits, the outliers' to one more by default).

Why the grid of the middle and outer groups is not the plain ``[min, max]`` one
----------------------------------------------------------------------------------
After the shift, the two sides of the middle group (and of the outer group) share one code range. With the
plain grid ``sigma = (2^b - 1) / (max - min)`` a small positive and a small negative shifted value can round to the
same code, and the decoder cannot tell on which side to add the threshold back: restoring on the wrong side adds
an error of ``ti_hi - ti_lo`` (or ``to_hi - to_lo``). The paper's COO sign bit only covers outliers, not the 90%
middle group. So for these *signed* groups we place zero exactly half-way between two codes, ``k`` and ``k + 1``:
codes ``<= k`` are the lower side and ``>= k + 1`` the upper side, and the side is simply the sign of the
dequantized shifted value, which is at least half a step away from zero. Rounding the stored min/max to fp16 moves
that zero point by at most ``(2^b) * 2^-11`` of a step, far less than the half-step margin, so no stored side bit
is needed and a value can never be restored on the wrong side. ``k`` is chosen to minimise the step: because the
end codes may also absorb values up to half a step beyond their centre, this grid spans ``2^b`` steps instead of
``2^b - 1`` and its step is never much larger than the plain grid's. A group with values on one side only keeps
the plain ``[min, max]`` grid, whose codes all decode to that side's sign (see ``_signed_grid``).

Static grids (``OakenConfig.static_grids``, issue #36): the middle and inner groups take the layer's fixed grid
(:func:`static_grid` of the thresholds, clip 1) instead of each row's, values beyond it clamped to its end codes;
the outer group keeps its per-row grid. The format then stores only the outer end points per row
(``oakenkv.format.layout``); :func:`quantize` is its reference too. With static levels (``OakenConfig.static_levels``)
the layer has a few static middle grids (:func:`level_grids`, one per clip factor) and each row takes the smallest
that covers its middle values (:func:`pick_levels`, the choice ``benchmarks/static_scales.py --levels`` simulates);
the inner grid stays the clip-1 one. The row's level index is stored with it.

All arithmetic is float32, in a fixed order, so that numba kernels can reproduce it bit for bit.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from oakenkv.format.config import OakenConfig
from oakenkv.format.layout import ERR_SCALE_RANGE, ERROR_MESSAGES
from oakenkv.quant.groups import GroupThresholds

#: Group ids, stored in ``QuantizedVectors.groups`` and used to index ``mins``/``maxs``.
GROUP_MIDDLE = 0
GROUP_INNER = 1
GROUP_OUTER = 2
NUM_GROUPS = 3

#: Smallest quantization step of a signed group. It keeps fp16-stored grid end points normal numbers (and the zero
#: point away from an integer) even for degenerate rows whose shifted values are all ~0.
STEP_FLOOR = 2.0**-20

_FP16_MAX = 65504.0


class _HasTuple(Protocol):
    def as_tuple(self) -> tuple[float, float, float, float]: ...


ThresholdsLike = _HasTuple | Sequence[float] | torch.Tensor


@dataclass
class QuantizedVectors:
    """The output of :func:`quantize`: everything a decoder needs, one row per quantization vector.

    Attributes:
        codes: uint8 ``[N, D]``; each value's code in ``0..2^b-1``, ``b`` its group's bits (``group_bits``).
        groups: uint8 ``[N, D]``; ``GROUP_MIDDLE``, ``GROUP_INNER`` or ``GROUP_OUTER`` per value.
        mins: ``[N, 3]`` in the config's scale dtype; per group (indexed by group id) the value of code 0.
        maxs: ``[N, 3]`` in the config's scale dtype; per group the value of the top code ``2^b - 1``.
            An empty group has ``mins == maxs == 0``.
        level: uint8 ``[N]``, each row's static level index (``OakenConfig.static_levels``: its middle and inner
            end points are level ``level[r]``'s grid, :func:`level_grids`), or None without static levels.
    """

    codes: torch.Tensor
    groups: torch.Tensor
    mins: torch.Tensor
    maxs: torch.Tensor
    level: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape


def thresholds_tuple(thr: ThresholdsLike) -> tuple[float, float, float, float]:
    """Normalise and validate ``(to_lo, ti_lo, ti_hi, to_hi)``: finite and ``to_lo < ti_lo <= ti_hi < to_hi``."""
    if isinstance(thr, GroupThresholds):  # validated and rounded when it was made
        return thr.float32_tuple()
    if hasattr(thr, "as_tuple"):
        t = tuple(float(v) for v in thr.as_tuple())
    elif isinstance(thr, torch.Tensor):
        t = tuple(float(v) for v in thr.flatten().tolist())
    else:
        t = tuple(float(v) for v in thr)
    if len(t) != 4:
        raise ValueError(f"thresholds must be 4 values (to_lo, ti_lo, ti_hi, to_hi), got {len(t)}")
    if not all(math.isfinite(v) for v in t):
        raise ValueError(f"thresholds must be finite, got {t}")
    # Every fast path compares and shifts in float32: round once here so all paths use the same numbers, and
    # validate the rounded values (1e39 is finite in float64 and infinite in float32).
    # (numpy's cast rounds to nearest even, as torch's does; one array, not four tensors: this runs per encode and
    # decode call, twice per layer of a prefill)
    with np.errstate(over="ignore"):
        t32 = tuple(np.asarray(t, dtype=np.float64).astype(np.float32).tolist())
    if not all(math.isfinite(v) for v in t32):
        raise ValueError(f"thresholds must be finite in float32 (|x| <= 3.4028235e38), got {t}")
    t = t32
    to_lo, ti_lo, ti_hi, to_hi = t
    if not (to_lo < ti_lo <= ti_hi < to_hi):
        raise ValueError(f"thresholds must satisfy to_lo < ti_lo <= ti_hi < to_hi (in float32), got {t}")
    return t  # type: ignore[return-value]


def grouping_tuple(thr: ThresholdsLike, group: ThresholdsLike | None) -> tuple[float, ...]:
    """The thresholds an encoder takes: ``thresholds_tuple(thr)`` (4 numbers), or with ``group`` (the thresholds
    the values are grouped by, Eq. 1, while ``thr`` shifts them, Eq. 4, and decodes them) those 4 then ``group``'s
    (8 numbers). ``group`` must lie on or beyond ``thr`` away from the inner interval (``to_lo' <= to_lo``,
    ``ti_lo' <= ti_lo``, ``ti_hi' >= ti_hi``, ``to_hi' >= to_hi``), so that every shifted middle or outer value keeps
    its side's sign (``oakenkv.quant.adapt``); ValueError otherwise."""
    t = thresholds_tuple(thr)
    if group is None:
        return t
    g = thresholds_tuple(group)
    if not (g[0] <= t[0] and g[1] <= t[1] and g[2] >= t[2] and g[3] >= t[3]):
        raise ValueError(
            f"grouping thresholds {g} must lie on or beyond the shift thresholds {t}, away from the inner interval"
        )
    return t + g


def group_bits(config: OakenConfig) -> tuple[int, int, int]:
    """Bits per code, indexed by group id (the middle group's code fills the format's dense slot)."""
    return (config.middle_bits, config.inner_bits, config.outer_bits)


def _check_input(x: torch.Tensor) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"expected a floating-point tensor, got {x.dtype}")
    x32 = x.detach().to(torch.float32)
    if not torch.isfinite(x32).all():
        bad = (~torch.isfinite(x32)).sum().item()
        raise ValueError(f"input contains {bad} NaN or infinite value(s); the KV cache cannot quantize them")
    return x32


def assign_groups(x: torch.Tensor, thr: ThresholdsLike) -> torch.Tensor:
    """Eq. 1: the group id of every value (uint8, same shape as ``x``)."""
    to_lo, ti_lo, ti_hi, to_hi = thresholds_tuple(thr)
    x32 = _check_input(x)
    groups = torch.full(x32.shape, GROUP_MIDDLE, dtype=torch.uint8, device=x32.device)
    groups[(x32 >= ti_lo) & (x32 <= ti_hi)] = GROUP_INNER
    groups[(x32 > to_hi) | (x32 < to_lo)] = GROUP_OUTER
    return groups


def group_shift(x32: torch.Tensor, groups: torch.Tensor, thr: ThresholdsLike) -> torch.Tensor:
    """Eq. 4: subtract the nearer threshold of its group from every middle and outer value (float32)."""
    to_lo, ti_lo, ti_hi, to_hi = thresholds_tuple(thr)
    f32 = torch.float32
    shift = torch.zeros_like(x32)
    outer, middle = groups == GROUP_OUTER, groups == GROUP_MIDDLE
    shift[outer & (x32 > to_hi)] = torch.tensor(to_hi, dtype=f32)
    shift[outer & (x32 < to_lo)] = torch.tensor(to_lo, dtype=f32)
    # Middle values are either > ti_hi or < ti_lo; the comparison picks the side (ti_lo <= ti_hi).
    shift[middle & (x32 > ti_hi)] = torch.tensor(ti_hi, dtype=f32)
    shift[middle & (x32 < ti_lo)] = torch.tensor(ti_lo, dtype=f32)
    return x32 - shift


def _signed_grid(
    s: torch.Tensor, member: torch.Tensor, bits: int, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Grid end points ``(gmin, gmax)`` (float32 ``[N]``) of a signed group, before rounding to the scale dtype.

    ``s``: float32 ``[N, D]`` shifted values; ``member``: bool ``[N, D]``. With ``L`` the most negative and ``U``
    the most positive member:

    * both sides present: zero sits at position ``k + 0.5`` and the step is
      ``max(-L / (k + 1), U / (n - 1 - k), STEP_FLOOR)``, minimised over ``k in [0, n - 2]`` (first minimum wins);
    * one side only: the plain grid ``[min, max]`` of the members, whose every code has that side's sign, as long
      as its code nearest zero still decodes to that sign once the end points are rounded to the scale dtype
      (decoder arithmetic); otherwise the half-step grid with
      ``k = -1`` (upper only) or ``k = n - 1`` (lower only).
    """
    n = 2**bits
    f32 = torch.float32
    n_rows = s.shape[0]
    inf = torch.tensor(float("inf"), dtype=f32)
    zero = torch.zeros((), dtype=f32)
    if s.shape[1] == 0:
        z = torch.zeros(n_rows, dtype=f32)
        return z, z
    neg = member & (s < 0)
    pos = member & (s > 0)
    has_lo = neg.any(dim=1)  # [N]
    has_hi = pos.any(dim=1)
    lo_mag = torch.where(neg, -s, zero).amax(dim=1)  # -L
    hi_mag = torch.where(pos, s, zero).amax(dim=1)  # U
    k = torch.arange(-1, n, dtype=f32)  # [n + 1] candidates
    below = k + 1.0  # steps available below zero
    above = (n - 1.0) - k  # steps available above zero
    # [N, n + 1] step needed by each candidate; inf where a side is present but has no room.
    need_lo = torch.where(below > 0, lo_mag[:, None] / torch.clamp(below, min=1.0), inf)
    need_lo = torch.where(has_lo[:, None], need_lo, zero)
    need_hi = torch.where(above > 0, hi_mag[:, None] / torch.clamp(above, min=1.0), inf)
    need_hi = torch.where(has_hi[:, None], need_hi, zero)
    step = torch.maximum(torch.maximum(need_lo, need_hi), torch.tensor(STEP_FLOOR, dtype=f32))
    best = torch.argmin(step, dim=1)  # first minimum
    step_b = step.gather(1, best[:, None]).squeeze(1)
    k_b = k[best]
    gmin = -(k_b + 0.5) * step_b
    gmax = gmin + (n - 1.0) * step_b
    # One-sided rows: the plain [min, max] grid when its end nearest zero keeps its sign once rounded.
    pmin = torch.where(member, s, inf).amin(dim=1)
    pmax = torch.where(member, s, -inf).amax(dim=1)
    # The sign test uses the decoder's arithmetic on the rounded end points: v(code) = gmin + code * step.
    g0, g1 = pmin.to(scale_dtype).to(f32), pmax.to(scale_dtype).to(f32)
    v_top = g0 + (n - 1.0) * _grid_step(g0, g1, bits)
    upper_only = has_hi & ~has_lo & (g0 > 0)
    lower_only = has_lo & ~has_hi & (v_top < 0)
    plain = upper_only | lower_only
    gmin = torch.where(plain, pmin, gmin)
    gmax = torch.where(plain, pmax, gmax)
    empty = ~(has_lo | has_hi)
    return torch.where(empty, zero, gmin), torch.where(empty, zero, gmax)


def _plain_grid(s: torch.Tensor, member: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Grid end points of the inner group: its min and max (float32 ``[N]``; 0 for an empty group)."""
    f32 = torch.float32
    if s.shape[1] == 0:
        z = torch.zeros(s.shape[0], dtype=f32)
        return z, z
    inf = torch.tensor(float("inf"), dtype=f32)
    gmin = torch.where(member, s, inf).amin(dim=1)
    gmax = torch.where(member, s, -inf).amax(dim=1)
    has = member.any(dim=1)
    zero = torch.zeros((), dtype=f32)
    return torch.where(has, gmin, zero), torch.where(has, gmax, zero)


def _round_scales(v: torch.Tensor, config: OakenConfig) -> torch.Tensor:
    if config.scale_dtype == "float16" and bool((v.abs() > _FP16_MAX).any()):
        raise ValueError(
            "a group's range exceeds the fp16 maximum (65504); use OakenConfig(scale_dtype='float32') for this data"
        )
    return v.to(config.scale_torch_dtype)


def _grid_step(gmin: torch.Tensor, gmax: torch.Tensor, bits: int) -> torch.Tensor:
    """float32 step of a grid from its stored end points (same formula in encoder and decoder)."""
    return (gmax.to(torch.float32) - gmin.to(torch.float32)) / torch.tensor(2.0**bits - 1.0, dtype=torch.float32)


def static_grid(
    thr: ThresholdsLike,
    config: OakenConfig | None = None,
    group: ThresholdsLike | None = None,
    clip: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Grid end points of the middle and inner groups fixed by the layer's thresholds instead of each row's values
    (issue #36): with ``clip`` 1 and no ``group``, the grid of the static-grid format (``OakenConfig.static_grids``,
    :func:`format_static_grid`); other clips and grouping thresholds are what ``quantize``'s ``static_scales``
    simulates (``benchmarks/static_scales.py``). Returns ``(mins, maxs)``, ``[3]`` in the config's scale dtype
    indexed by group id, the outer group's entries 0 (it keeps its per-row grid).

    The grouping thresholds (``group`` or ``thr``) bound what each group can hold: a middle value shifted by
    ``thr`` lies in ``[g_to_lo - ti_lo, 0)`` or ``(0, g_to_hi - ti_hi]``, an inner value in ``[g_ti_lo, g_ti_hi]``.
    The middle grid is the signed grid (:func:`_signed_grid`, zero between two codes) of those two magnitudes each
    times ``clip`` (1: it covers every middle value; below 1 the rarer values near the outer thresholds are clipped
    to the end codes for a finer step); the inner grid is the plain one of ``[g_ti_lo, g_ti_hi]`` (a narrow range,
    one bit more than the slot: never clipped).
    """
    config = config or OakenConfig()
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not 0.0 < clip <= 1.0:
        raise ValueError(f"clip must be a number in (0, 1], got {clip!r}")
    t = grouping_tuple(thr, group)
    ti_lo, ti_hi = t[1], t[2]  # the shift's inner thresholds
    g_to_lo, g_ti_lo, g_ti_hi, g_to_hi = t[4:] if group is not None else t
    f32 = torch.float32
    bits = group_bits(config)
    c = torch.tensor(clip, dtype=f32)
    # the two extreme shifted middle values, as float32 differences of float32 thresholds (as group_shift makes them)
    lo = (torch.tensor(g_to_lo, dtype=f32) - torch.tensor(ti_lo, dtype=f32)) * c
    hi = (torch.tensor(g_to_hi, dtype=f32) - torch.tensor(ti_hi, dtype=f32)) * c
    ends = torch.stack([lo, hi])[None]  # [1, 2]: both sides present (strict thresholds: lo < 0 < hi)
    everything = torch.ones_like(ends, dtype=torch.bool)
    m_lo, m_hi = _signed_grid(ends, everything, bits[GROUP_MIDDLE], config.scale_torch_dtype)
    inner = torch.tensor([[g_ti_lo, g_ti_hi]], dtype=f32)
    i_lo, i_hi = _plain_grid(inner, torch.ones_like(inner, dtype=torch.bool))
    mins = torch.zeros(NUM_GROUPS, dtype=f32)
    maxs = torch.zeros(NUM_GROUPS, dtype=f32)
    mins[GROUP_MIDDLE], maxs[GROUP_MIDDLE] = m_lo[0], m_hi[0]
    mins[GROUP_INNER], maxs[GROUP_INNER] = i_lo[0], i_hi[0]
    return _round_scales(mins, config), _round_scales(maxs, config)


def format_static_grid(thr: ThresholdsLike, config: OakenConfig) -> tuple[float, float, float, float]:
    """The static grid of the static-grid format (``OakenConfig.static_grids``) for thresholds ``thr``: ``(mid_min,
    mid_max, inner_min, inner_max)``, values of the scale dtype (as floats, exact): :func:`static_grid` with clip 1
    of the shift thresholds, the only ones a decoder has (an adaptive encoder's grouping thresholds do not move
    it). What every row's first four scale columns hold in memory and what a reader restores from the thresholds
    (``oakenkv.format.layout.from_records``). Cached: encoders ask per call."""
    return _format_static_grid(thresholds_tuple(thr), config)


@functools.lru_cache(maxsize=1024)
def _format_static_grid(t: tuple[float, float, float, float], config: OakenConfig) -> tuple[float, ...]:
    mins, maxs = static_grid(t, config)
    m = mins.to(torch.float32).tolist()
    x = maxs.to(torch.float32).tolist()
    return (m[GROUP_MIDDLE], x[GROUP_MIDDLE], m[GROUP_INNER], x[GROUP_INNER])


def level_grids(thr: ThresholdsLike, config: OakenConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The static levels' grids (``config.static_levels``) for thresholds ``thr``: ``(mins, maxs)``, ``[L, 3]`` in
    the scale dtype, row ``j`` :func:`static_grid` with clip ``static_levels[j]`` (the shift thresholds, as the
    decoder has them; the last level, clip 1, is :func:`format_static_grid`'s grid). ValueError without levels."""
    if not config.static_levels:
        raise ValueError("level_grids needs a config with static levels (OakenConfig.static_levels)")
    grids = [static_grid(thr, config, clip=c) for c in config.static_levels]
    return torch.stack([g[0] for g in grids]), torch.stack([g[1] for g in grids])


def format_level_grids(thr: ThresholdsLike, config: OakenConfig) -> tuple[tuple[float, float, float, float], ...]:
    """:func:`level_grids` as the scale columns they fill: one ``(mid_min, mid_max, inner_min, inner_max)`` per
    level, values of the scale dtype (as floats, exact); what a reader restores from the thresholds and the levels
    (``oakenkv.format.layout.from_records``). Cached: encoders ask per call."""
    return _format_level_grids(thresholds_tuple(thr), config)


@functools.lru_cache(maxsize=1024)
def _format_level_grids(t: tuple[float, float, float, float], config: OakenConfig) -> tuple[tuple[float, ...], ...]:
    mins, maxs = level_grids(t, config)
    m = mins.to(torch.float32).tolist()
    x = maxs.to(torch.float32).tolist()
    return tuple((a[GROUP_MIDDLE], b[GROUP_MIDDLE], a[GROUP_INNER], b[GROUP_INNER]) for a, b in zip(m, x, strict=True))


def pick_levels(s: torch.Tensor, groups: torch.Tensor, thr: ThresholdsLike, config: OakenConfig) -> torch.Tensor:
    """Each row's static level (``config.static_levels``), int64 ``[N]``: the smallest whose clip factor covers
    the row's shifted middle values ``s`` (float32 ``[N, D]``, :func:`group_shift`; ``groups`` uint8 ``[N, D]``).
    ``need`` is the larger of the row's largest negative-side magnitude over ``ti_lo - to_lo`` and its largest
    positive-side one over ``to_hi - ti_hi`` (float32, true divisions), the level the first whose float32 clip
    factor is ``>= need``, the last where none is (adaptive grouping's middle values may reach beyond the
    thresholds). Exactly ``benchmarks/static_scales.py``'s ``_quantize_levels``: the simulation and the format
    choose alike."""
    to_lo, ti_lo, ti_hi, to_hi = thresholds_tuple(thr)
    mid = groups == GROUP_MIDDLE
    zero = torch.zeros((), dtype=torch.float32)
    lo = torch.where(mid & (s < 0), -s, zero).amax(dim=1) / (ti_lo - to_lo)
    hi = torch.where(mid & (s > 0), s, zero).amax(dim=1) / (to_hi - ti_hi)
    need = torch.maximum(lo, hi)
    levels = torch.tensor(config.static_levels, dtype=torch.float32)
    return torch.searchsorted(levels, need.contiguous()).clamp(max=len(config.static_levels) - 1)


def quantize(
    x: torch.Tensor,
    thr: ThresholdsLike,
    config: OakenConfig | None = None,
    group: ThresholdsLike | None = None,
    *,
    static_scales: float | None = None,
) -> QuantizedVectors:
    """Quantize rows of ``x``.

    Args:
        x: float ``[N, D]`` (fp32, fp16 or bf16); one row per quantization vector.
        thr: the layer's ``(to_lo, ti_lo, ti_hi, to_hi)`` for this kind (key or value).
        config: the method's configuration (default: the paper's).
        group: thresholds to group the values by instead of ``thr``, which then only shifts them (and decodes
            them): adaptive grouping (``oakenkv.quant.adapt``; :func:`grouping_tuple` says which are allowed).
        static_scales: a simulation (issue #36; ``benchmarks/static_scales.py``): None (the default: the
            config's grids) or a clip factor in (0, 1]: every row's middle and inner groups use the fixed grid of
            :func:`static_grid` (of ``group`` where given; ``mins``/``maxs`` hold it in every row, whether or not
            the group has members), values beyond it clamped to its end codes; the outer group keeps its per-row
            grid. :func:`dequantize` decodes the result as it is. The format's static grids are
            ``config.static_grids`` (clip 1, of ``thr``: :func:`format_static_grid`), which refuses this.

    Returns:
        The codes, group of each value and the per-row grid end points (see :class:`QuantizedVectors`).
    """
    config = _check_config(config)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"quantize expects a torch.Tensor, got {type(x).__name__} (torch.as_tensor converts it)")
    if x.dim() != 2:
        raise ValueError(f"quantize expects x of shape [N, D] (one row per vector), got {tuple(x.shape)}")
    x32 = _check_input(x)
    if config.static_grids and static_scales is not None:
        raise ValueError("static_scales simulates static grids; a static_grids config has the format's already")
    if config.static_levels:
        fixed = level_grids(thr, config)  # [L, 3]: each level's, the row's picked below
    elif config.static_grids:
        fixed = static_grid(thr, config)  # the decoder's: of the shift thresholds, clip 1 (format_static_grid)
    else:
        fixed = None if static_scales is None else static_grid(thr, config, group, static_scales)
    g = grouping_tuple(thr, group)
    groups = assign_groups(x32, g[4:] if group is not None else thr)
    s = group_shift(x32, groups, thr)
    bits = group_bits(config)
    n_rows = x32.shape[0]
    level = None
    if config.static_levels:
        pick = pick_levels(s, groups, thr, config)
        level = pick.to(torch.uint8)
        fixed = (fixed[0][pick], fixed[1][pick])  # [N, 3]: each row's level's grid
    codes = torch.zeros(x32.shape, dtype=torch.uint8)
    mins = torch.zeros((n_rows, NUM_GROUPS), dtype=config.scale_torch_dtype)
    maxs = torch.zeros_like(mins)
    f32 = torch.float32
    half = torch.tensor(0.5, dtype=f32)
    for g in (GROUP_MIDDLE, GROUP_INNER, GROUP_OUTER):
        member = groups == g
        signed = g != GROUP_INNER
        if fixed is not None and g != GROUP_OUTER:
            if level is not None:
                gmin_q, gmax_q = fixed[0][:, g], fixed[1][:, g]
            else:
                gmin_q, gmax_q = fixed[0][g].expand(n_rows), fixed[1][g].expand(n_rows)
        else:
            scale_dtype = config.scale_torch_dtype
            gmin, gmax = _signed_grid(s, member, bits[g], scale_dtype) if signed else _plain_grid(s, member)
            gmin_q, gmax_q = _round_scales(gmin, config), _round_scales(gmax, config)
        mins[:, g], maxs[:, g] = gmin_q, gmax_q
        lo, step = gmin_q.to(f32)[:, None], _grid_step(gmin_q, gmax_q, bits[g])[:, None]
        safe_step = torch.where(step > 0, step, torch.ones_like(step))
        q = torch.floor((s - lo) / safe_step + half)
        q = torch.where(step > 0, q, torch.zeros_like(q)).clamp(0, 2 ** bits[g] - 1)
        if signed:
            # Make sure each code decodes on its own side, with exactly the decoder's arithmetic (side = sign of
            # gmin + code * step). The grid leaves at least half a step of margin around zero, so one nudge at most
            # is ever needed, and only when rounding lands a code exactly on the boundary.
            v = lo + q * step
            q = torch.where((s > 0) & (v <= 0), q + 1.0, q)
            q = torch.where((s < 0) & (v >= 0), q - 1.0, q)
            q = torch.where(step > 0, q, torch.zeros_like(q)).clamp(0, 2 ** bits[g] - 1)
        codes[member] = q[member].to(torch.uint8)
    bad = torch.nonzero(~decodes_finite(mins, maxs, thr, config))
    if bad.numel():
        raise ValueError(f"cannot encode row {int(bad[0, 0])}: {ERROR_MESSAGES[ERR_SCALE_RANGE]}")
    return QuantizedVectors(codes=codes, groups=groups, mins=mins, maxs=maxs, level=level)


def decodes_finite(
    mins: torch.Tensor, maxs: torch.Tensor, thr: ThresholdsLike, config: OakenConfig | None = None
) -> torch.Tensor:
    """bool ``[N]``: whether every code of each row's three groups dequantizes to a finite value (the format's rule
    on scales, ``oakenkv.format.layout``): the lowest and highest code of each group, threshold shift included, in
    :func:`dequantize`'s float32 operations; every other code's value lies between those two. :func:`quantize`
    refuses a row that breaks it and the decoders refuse such bytes."""
    config = config or OakenConfig()
    to_lo, ti_lo, ti_hi, to_hi = thresholds_tuple(thr)
    f32 = torch.float32
    bits = group_bits(config)
    ok = torch.ones(mins.shape[0], dtype=torch.bool)
    for g, (s_lo, s_hi) in ((GROUP_MIDDLE, (ti_lo, ti_hi)), (GROUP_INNER, (0.0, 0.0)), (GROUP_OUTER, (to_lo, to_hi))):
        lo = mins[:, g].to(f32)
        step = _grid_step(mins[:, g], maxs[:, g], bits[g])
        for code in (0.0, 2.0 ** bits[g] - 1.0):
            v = lo + torch.tensor(code, dtype=f32) * step
            w = v + torch.where(v > 0, torch.tensor(s_hi, dtype=f32), torch.tensor(s_lo, dtype=f32))
            ok &= torch.isfinite(w)
    return ok


def dequantize(q: QuantizedVectors, thr: ThresholdsLike, config: OakenConfig | None = None) -> torch.Tensor:
    """The exact inverse of :func:`quantize`'s encoding: float32 ``[N, D]``."""
    config = config or OakenConfig()
    to_lo, ti_lo, ti_hi, to_hi = thresholds_tuple(thr)
    f32 = torch.float32
    bits = group_bits(config)
    out = torch.zeros(q.codes.shape, dtype=f32)
    codes = q.codes.to(f32)
    for g in (GROUP_MIDDLE, GROUP_INNER, GROUP_OUTER):
        member = q.groups == g
        lo = q.mins[:, g].to(f32)[:, None]
        step = _grid_step(q.mins[:, g], q.maxs[:, g], bits[g])[:, None]
        v = lo + codes * step
        if g == GROUP_MIDDLE:
            v = v + torch.where(v > 0, torch.tensor(ti_hi, dtype=f32), torch.tensor(ti_lo, dtype=f32))
        elif g == GROUP_OUTER:
            v = v + torch.where(v > 0, torch.tensor(to_hi, dtype=f32), torch.tensor(to_lo, dtype=f32))
        out = torch.where(member, v, out)
    return out


def _check_config(config: Any) -> OakenConfig:
    """``config``, or the default when None; TypeError for anything but an :class:`OakenConfig`."""
    if config is None:
        return OakenConfig()
    if not isinstance(config, OakenConfig):
        raise TypeError(
            f"config must be an OakenConfig, got {type(config).__name__} (from a dict: OakenConfig.from_dict(d))"
        )
    return config


def quantize_dequantize(x: torch.Tensor, thr: ThresholdsLike, config: OakenConfig | None = None) -> torch.Tensor:
    """Fake quantization: ``dequantize(quantize(x))`` for any leading shape; the last dim is the vector.

    Returns a tensor of ``x``'s shape and dtype.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(
            f"quantize_dequantize expects a torch.Tensor, got {type(x).__name__} (torch.as_tensor converts it)"
        )
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(
            f"quantize_dequantize expects vectors of at least one value in the last dimension, got {tuple(x.shape)}"
        )
    if x.numel() == 0:  # no vector: nothing to quantize
        return x.clone()
    flat = x.reshape(-1, x.shape[-1])
    out = dequantize(quantize(flat, thr, config), thr, config)
    return out.reshape(x.shape).to(x.dtype)


def group_fractions(x: torch.Tensor, thr: ThresholdsLike) -> dict[str, float]:
    """Fractions of values in each group (keys ``outer``, ``middle``, ``inner``)."""
    groups = assign_groups(x, thr)
    total = max(groups.numel(), 1)
    return {
        "outer": (groups == GROUP_OUTER).sum().item() / total,
        "middle": (groups == GROUP_MIDDLE).sum().item() / total,
        "inner": (groups == GROUP_INNER).sum().item() / total,
    }


def error_bound(q: QuantizedVectors, config: OakenConfig | None = None) -> torch.Tensor:
    """Per-value bound on ``|dequantize(q) - x|``: half the group's step, float32 ``[N, D]``.

    The stored end points are already rounded to the scale dtype, so this bound includes that rounding except for
    the values at the very ends of a grid (see ``tests/test_quant.py`` for the slack used there).
    """
    config = config or OakenConfig()
    bits = group_bits(config)
    out = torch.zeros(q.codes.shape, dtype=torch.float32)
    for g in range(NUM_GROUPS):
        step = _grid_step(q.mins[:, g], q.maxs[:, g], bits[g])[:, None]
        out = torch.where(q.groups == g, 0.5 * step.expand_as(out), out)
    return out
