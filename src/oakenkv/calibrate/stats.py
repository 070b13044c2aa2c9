"""The statistics of the paper's threshold profile: per run, exact quantiles and kurtosis; over runs, their average.

Thresholds of one run
---------------------
Over all values of one run (all tokens x KV heads x head_dim of one window, flattened), with outer ratio ``o`` and
inner ratio ``i``, exact order statistics (``np.partition`` + linear interpolation, the same definition as
``torch.quantile``; no sampling, so no sampling error; no 16M-element limit)::

    to_lo = q(o / 2)           to_hi = q(1 - o / 2)
    ti_lo = q(0.5 - i / 2)     ti_hi = q(0.5 + i / 2)      (inner_center="median", the default)

The inner group is the ``i`` of values around the median. The paper describes it as the values "near zero"; for
these activations the median of a layer's flattened values is close to 0 (default model, 4 x 256 Wikipedia tokens:
on average 0.02 and at most 0.08 standard deviations away, layer 4 keys), and centring on the median gives exactly
the requested fraction in every run, whereas a band symmetric around 0 is lopsided in an off-centre layer.
``inner_center="zero"`` gives that band instead: ``ti_hi = -ti_lo = q_|x|(i)``, the ``i`` of values of smallest
magnitude. Each of the four thresholds is then averaged over runs, and the standard deviation over runs is
recorded (:class:`~oakenkv.calibrate.thresholds.LayerStats.run_std`).

Kurtosis tuning (optional)
--------------------------
Heavy-tailed layers have more outliers than the nominal ratio. With ``kurtosis_tuning=True``, per layer and kind,
Pearson kurtosis (3 for a Gaussian; per run, averaged over runs) above ``KURTOSIS_HIGH`` = 20 raises the outer ratio by
0.5 points, and below ``KURTOSIS_LOW`` = 5 lowers the inner ratio by 0.3 points. The quantiles for both the nominal
and the adjusted ratios are collected in the same pass, so tuning costs no second pass; the ratios used and the
reason are recorded in the layer's :class:`~oakenkv.calibrate.thresholds.LayerStats`.

Every profiler uses these (``oakenkv.calibrate.profile.profile_thresholds``; the one-pass calibration of several
configs, ``oakenkv.calibrate.ranges.calibrate_all``; the oaken-plus search, ``oakenkv.calibrate.plus``), so that
they all give the same numbers for the same values: :func:`run_thresholds` per run, :func:`candidate_ratios` and
:class:`RunAccumulator` to average the runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from oakenkv.calibrate.thresholds import GroupThresholds, LayerStats
from oakenkv.format.config import OakenConfig

__all__ = [
    "INNER_DELTA",
    "KURTOSIS_HIGH",
    "KURTOSIS_LOW",
    "OUTER_DELTA",
    "InnerCenter",
    "RunAccumulator",
    "candidate_ratios",
    "exact_quantiles",
    "kurtosis",
    "order_statistics",
    "run_quantiles",
    "run_thresholds",
]

#: Kurtosis tuning: above this kurtosis the outer ratio is raised by OUTER_DELTA.
KURTOSIS_HIGH = 20.0
#: Kurtosis tuning: below this kurtosis the inner ratio is lowered by INNER_DELTA.
KURTOSIS_LOW = 5.0
#: Kurtosis tuning: +0.5 percentage points of outer ratio.
OUTER_DELTA = 0.005
#: Kurtosis tuning: -0.3 percentage points of inner ratio.
INNER_DELTA = 0.003

InnerCenter = Literal["median", "zero"]


def _as_numpy(x: torch.Tensor | np.ndarray) -> np.ndarray:
    """All elements of ``x`` as a flat float32 (or float64) numpy array on the CPU (bf16/fp16 widened exactly)."""
    if isinstance(x, torch.Tensor):
        x = x.detach()
        if x.dtype not in (torch.float32, torch.float64):
            x = x.to(torch.float32)
        x = x.cpu().numpy()
    return np.ascontiguousarray(x).reshape(-1)


# The statistics run in numpy on purpose: they are single-threaded there, and torch's multi-threaded sort of a
# 50k-element run costs far more CPU time than numpy's on a busy 2-core machine (OpenMP threads spin while they
# wait), which made the statistics cost as much as the model's forward pass (docs/notebook/perf-notes.md).


def exact_quantiles(x: torch.Tensor | np.ndarray, q: Sequence[float] | torch.Tensor) -> torch.Tensor:
    """Exact quantiles of all elements of ``x`` at levels ``q``, as ``torch.quantile(..., interpolation="linear")``.

    The needed order statistics are found by partitioning (:func:`order_statistics`: O(n), exact), so there is no
    element-count limit (``torch.quantile`` refuses more than 2^24 elements) and no sampling error.

    Args:
        x: float tensor or array of any shape (flattened).
        q: levels in [0, 1], ``[L]``.

    Returns:
        float64 tensor ``[L]``: ``s[lo] + (s[hi] - s[lo]) * (pos - lo)`` with ``pos = q * (n - 1)``, ``s`` sorted.
    """
    flat = _as_numpy(x)
    n = flat.size
    if n == 0:
        raise ValueError("cannot take quantiles of an empty tensor")
    qs = np.asarray(q.tolist() if isinstance(q, torch.Tensor) else q, dtype=np.float64)
    if qs.ndim != 1 or not ((qs >= 0) & (qs <= 1)).all():
        raise ValueError(f"quantile levels must be a 1-D sequence in [0, 1], got {qs!r}")
    pos = qs * (n - 1)
    lo = np.clip(np.floor(pos).astype(np.int64), 0, n - 1)
    hi = np.clip(np.ceil(pos).astype(np.int64), 0, n - 1)
    ranks = np.unique(np.concatenate([lo, hi]))
    values = order_statistics(flat, ranks)
    s_lo = values[np.searchsorted(ranks, lo)].astype(np.float64)
    s_hi = values[np.searchsorted(ranks, hi)].astype(np.float64)
    return torch.from_numpy(s_lo + (s_hi - s_lo) * (pos - lo))


#: Below this many values one ``np.partition`` of everything is about as fast as bracketing (:func:`order_statistics`).
BRACKET_MIN_VALUES = 1 << 15
#: Size of the random sample the brackets are read from, and how far (in standard deviations of a sample rank)
#: a bracket reaches beyond its ranks: a miss only costs time (the fallback), never a different value.
_SAMPLE, _REACH = 16384, 4.0
_SAMPLE_SEED = 0


def order_statistics(flat: np.ndarray, ranks: np.ndarray) -> np.ndarray:
    """The values at 0-based ``ranks`` (sorted, unique int64) of the 1-D array ``flat`` in sorted order: exactly
    ``np.partition(flat, ranks)[ranks]`` (NaN sorting last, as there).

    For a large array, ranks close together (a tail, the middle) share a bracket: two values read off a sorted
    random sample of ``flat`` (a fixed seed: the same every time) with some reach beyond. A loop counts the values
    below each bracket and inside it, another gathers those inside (``oakenkv.kernels.cpu.select``), and a rank's
    value is that of rank (rank - count) among those alone: a partition of a few % of the values instead of all of
    them. When the count shows a bracket does not hold its ranks (an unlucky sample), that bracket's ranks are
    taken from a partition of everything, so the
    result never depends on the sample.
    """
    n = flat.size
    out = np.empty(ranks.size, dtype=flat.dtype)
    if n < BRACKET_MIN_VALUES or flat.dtype not in (np.float32, np.float64):
        out[:] = np.partition(flat, ranks)[ranks]
        return out
    sample = np.sort(flat[np.random.default_rng(_SAMPLE_SEED).integers(0, n, _SAMPLE)])
    m, gap = sample.size, n // 16
    missed: list[int] = []
    groups: list[tuple[int, int]] = []  # (start, end) of the ranks of each bracket
    lows: list[float] = []
    highs: list[float] = []
    start = 0
    while start < ranks.size:
        end = start + 1
        while end < ranks.size and ranks[end] - ranks[end - 1] <= gap:
            end += 1
        k0, k1 = int(ranks[start]), int(ranks[end - 1])
        p0, p1 = k0 / n, k1 / n
        r0 = int(np.floor(p0 * m - _REACH * np.sqrt(m * p0 * (1 - p0)) - 2))
        r1 = int(np.ceil(p1 * m + _REACH * np.sqrt(m * p1 * (1 - p1)) + 2))
        if r0 < 0 and r1 >= m:
            missed.extend(range(start, end))
        else:
            groups.append((start, end))
            lows.append(sample[r0] if r0 >= 0 else -np.inf)
            highs.append(sample[r1] if r1 < m else np.inf)
        start = end
    if groups:
        from oakenkv.kernels.cpu.select import bracket_values

        below, inside = bracket_values(flat, np.array(lows, dtype=flat.dtype), np.array(highs, dtype=flat.dtype))
        for (start, end), b, values in zip(groups, below.tolist(), inside, strict=True):
            if b <= ranks[start] and ranks[end - 1] < b + values.size:
                local = ranks[start:end] - b
                out[start:end] = np.partition(values, local)[local]
            else:
                missed.extend(range(start, end))
    if missed:
        out[missed] = np.partition(flat, ranks[missed])[ranks[missed]]
    return out


def kurtosis(x: torch.Tensor | np.ndarray) -> float:
    """Pearson kurtosis E[(x-mu)^4] / var^2 of all elements of ``x`` (3 for a Gaussian), in float64.

    Raises ValueError for a constant tensor (kurtosis undefined): a layer whose values are all equal means the
    recording is broken, and silently returning a number would hide it.
    """
    # in place, one array: a fresh array per step (three more of 8 bytes a value) cost 6x the arithmetic in page
    # faults; the same operations in the same order, so the same number
    c = _as_numpy(x).astype(np.float64)
    np.subtract(c, c.mean(), out=c)
    np.multiply(c, c, out=c)
    var = c.mean()
    if not var > 0:
        raise ValueError("cannot compute kurtosis: all recorded values are equal (broken recording?)")
    np.multiply(c, c, out=c)
    return float(c.mean() / (var * var))


def run_thresholds(
    x: torch.Tensor,
    outer_ratios: tuple[float, ...],
    inner_ratios: tuple[float, ...],
    inner_center: InnerCenter = "median",
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The thresholds of one run for several candidate ratios (:func:`run_quantiles`), and the run's kurtosis."""
    outer, inner = run_quantiles(x, outer_ratios, inner_ratios, inner_center)
    return outer, inner, kurtosis(x)


def run_quantiles(
    x: torch.Tensor,
    outer_ratios: tuple[float, ...],
    inner_ratios: tuple[float, ...],
    inner_center: InnerCenter = "median",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The thresholds of one run for several candidate ratios (:func:`run_thresholds` without the kurtosis, which
    costs more than the quantiles: the oaken-plus search needs it of the chosen candidate only).

    Args:
        x: float tensor, all values of one layer's keys (or values) in one run, any shape (e.g. ``[H, S, D]``).
        outer_ratios: candidate outer ratios.
        inner_ratios: candidate inner ratios.
        inner_center: "median" (quantiles around the median) or "zero" (smallest magnitudes); see module doc.

    Returns:
        ``outer`` float64 ``[len(outer_ratios), 2]`` (to_lo, to_hi) per candidate and ``inner`` float64
        ``[len(inner_ratios), 2]`` (ti_lo, ti_hi) per candidate.

    Raises:
        ValueError: ``x`` holds NaN or Inf.
    """
    flat = _as_numpy(x)
    if not np.isfinite(flat).all():
        raise ValueError(f"{int((~np.isfinite(flat)).sum())} recorded values are NaN or infinite")
    outer_levels = [lv for o in outer_ratios for lv in (o / 2, 1 - o / 2)]
    if inner_center == "median":
        inner_levels = [lv for i in inner_ratios for lv in (0.5 - i / 2, 0.5 + i / 2)]
        q = exact_quantiles(flat, outer_levels + inner_levels)
        outer = q[: len(outer_levels)].reshape(-1, 2)
        inner = q[len(outer_levels) :].reshape(-1, 2)
    elif inner_center == "zero":
        outer = exact_quantiles(flat, outer_levels).reshape(-1, 2)
        t = exact_quantiles(np.abs(flat), list(inner_ratios))
        inner = torch.stack([-t, t], dim=1)
    else:
        raise ValueError(f"inner_center must be 'median' or 'zero', got {inner_center!r}")
    return outer, inner


def candidate_ratios(config: OakenConfig, tuning: bool) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The outer and inner ratios whose thresholds a run records: the config's, plus with kurtosis ``tuning`` the
    raised outer and lowered inner ratio (``OUTER_DELTA``, ``INNER_DELTA``), so tuning costs no second pass."""
    if not tuning:
        return (config.outer_ratio,), (config.inner_ratio,)
    raised = config.outer_ratio + OUTER_DELTA
    lowered = max(config.inner_ratio - INNER_DELTA, 0.0)
    if raised + config.inner_ratio >= 1.0:
        raise ValueError(f"kurtosis tuning would raise outer_ratio to {raised}, leaving no middle group")
    return (config.outer_ratio, raised), (config.inner_ratio, lowered)


@dataclass
class RunAccumulator:
    """The per-run results of one (layer, kind) over a profile, and the averaged thresholds they give.

    Feed it :func:`run_thresholds`' output for the ratios of :func:`candidate_ratios`, one run at a time
    (:meth:`add`), then :meth:`finish`. Any profiler that records K/V its own way (the evaluation's one-pass
    calibration of several configs) uses it to get exactly :func:`profile_thresholds`' numbers.
    """

    #: Each float64 ``[num_outer_candidates, 2]``: ``(to_lo, to_hi)`` per candidate ratio.
    outer: list[torch.Tensor] = field(default_factory=list)
    #: Each float64 ``[num_inner_candidates, 2]``: ``(ti_lo, ti_hi)`` per candidate ratio.
    inner: list[torch.Tensor] = field(default_factory=list)
    #: Pearson kurtosis of each run.
    kurt: list[float] = field(default_factory=list)
    #: Values recorded over all runs.
    num_samples: int = 0

    def add(self, outer: torch.Tensor, inner: torch.Tensor, kurt: float, num_values: int) -> None:
        """One run's candidate thresholds and kurtosis (:func:`run_thresholds`), over ``num_values`` values."""
        self.outer.append(outer)
        self.inner.append(inner)
        self.kurt.append(kurt)
        self.num_samples += num_values

    def finish(self, config: OakenConfig, tuning: bool, layer: int, kind: str) -> tuple[GroupThresholds, LayerStats]:
        """The thresholds averaged over runs (for the ratios kurtosis ``tuning`` picks) and their statistics."""
        runs = len(self.kurt)
        k = sum(self.kurt) / runs
        oi, ii, notes = 0, 0, []
        if tuning and k > KURTOSIS_HIGH:
            oi = 1
            notes.append(f"kurtosis {k:.2f} > {KURTOSIS_HIGH:g}: outer_ratio +{OUTER_DELTA:g}")
        if tuning and k < KURTOSIS_LOW:
            ii = 1
            notes.append(f"kurtosis {k:.2f} < {KURTOSIS_LOW:g}: inner_ratio -{INNER_DELTA:g}")
        outer_ratios, inner_ratios = candidate_ratios(config, tuning)
        per_run = torch.stack(
            [torch.stack([o[oi, 0], i[ii, 0], i[ii, 1], o[oi, 1]]) for o, i in zip(self.outer, self.inner, strict=True)]
        )  # [runs, 4]
        mean = per_run.mean(dim=0)
        std = per_run.std(dim=0, correction=0)
        try:
            thr = GroupThresholds(*(float(v) for v in mean))
        except ValueError as e:
            raise ValueError(
                f"layer {layer} {kind}: profiled thresholds are invalid ({e}); is the model degenerate?"
            ) from e
        stats = LayerStats(
            kurtosis=k,
            num_samples=self.num_samples,
            num_runs=runs,
            outer_ratio=outer_ratios[oi],
            inner_ratio=inner_ratios[ii],
            run_std=tuple(float(s) for s in std),
            adjustments=tuple(notes),
        )
        return thr, stats
