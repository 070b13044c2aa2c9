"""Adaptive grouping: the outer thresholds follow the outlier share a sequence really has (one definition, used by
the cache's store and by the evaluation's fake-quantizer alike).

Offline, a profile fixes each layer's thresholds so that calibration text puts a chosen share of its keys (values)
in the sparse groups (about 10%). Text unlike the calibration text can have more or fewer values beyond them: the
bits and the split between the dense and the sparse groups drift. Online, per layer and kind, this keeps a scale
``a`` of the outer thresholds' distance from the inner interval,

    grouping thresholds G(a) = (ti_lo - a (ti_lo - to_lo), ti_lo, ti_hi, ti_hi + a (to_hi - ti_hi)),

starting at ``a = 1`` (the profile's thresholds) and, after every ``epoch`` tokens of a sequence, multiplied by
``(observed share / target share) ** gain`` and clipped to ``[low, high]``: more outliers than the profile's share
widen the outer thresholds, fewer narrow them (down to ``low``). The observed share is the epoch's sparse bytes
(one per outlier, plus the rare escape bytes: what the format stores) over its values, whatever the batch, so the
store and the evaluation count the same thing; the target is the profile's share for that layer and kind.

The decoders never see ``a``: every token is decoded with the fixed *shift* thresholds ``S = G(low)`` (what a
store's page view and every reader use), and only the encoder groups with ``G(a)``. That is sound because
``G(a)``'s outer thresholds lie on or beyond ``S``'s (``a >= low``): an outer value beyond ``G``'s threshold is
beyond ``S``'s too, so its shifted value keeps its side's sign (``oakenkv.quant.quantizer``, "group shift"), and a
middle value between ``S``'s and ``G``'s outer threshold is simply a middle value. What it costs: the outer grid of
a token spans from ``S``'s threshold, not ``G``'s, and that is not free: at ``low = 0.8`` with the scale held at 1,
the default model's Python-source perplexity rose by 0.068 (4 windows of 1024). So the default is
``low = 1``: the shift thresholds are the profile's own, a sequence only ever widens its outer thresholds (fewer
outliers where the text has more than the profile's share: the bits stay at the budget), and where nothing moves
the numbers are exactly the non-adaptive ones.

What it is for, measured (docs/results.md, "Out of domain"; ``benchmarks/ood_gap.py``, three models on Python
source): it keeps the bits at the profile's budget on text with more outliers than the calibration text (the
default model: 5.38 bits against 5.48), not the loss, which it lowered on none of them (default model +0.088
against +0.072 over FP, 16 windows). A whole profile made on the Python source itself did not measurably lose less
than the Wikipedia one on any of them (gap ratios 0.98, 1.12, 0.88): the out-of-domain loss is the quantization's
own, not a threshold mismatch this controller (or any calibration) could remove.

Everything here is float64 Python arithmetic on integers and the profile's numbers, rounded to float32 once:
deterministic, so two paths that feed it the same counts reach the same thresholds bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from oakenkv.quant.groups import GroupThresholds


@dataclass(frozen=True)
class AdaptConfig:
    """How the outer thresholds adapt (module doc)."""

    #: Tokens per epoch: the scale changes only between epochs, after each ``epoch`` tokens of a sequence.
    epoch: int = 64
    #: Exponent of the multiplicative update (a share of the correction per epoch; about 1/3 corrects a Gaussian
    #: tail's share in one step).
    gain: float = 0.25
    #: Bounds of the scale. ``low`` also places the shift thresholds the decoders use (module doc): below 1 the
    #: outer thresholds may narrow too, at a cost in the outer grid's resolution.
    low: float = 1.0
    high: float = 1.25

    def __post_init__(self) -> None:
        if isinstance(self.epoch, bool) or not isinstance(self.epoch, int) or self.epoch < 1:
            raise ValueError(f"AdaptConfig.epoch must be an int >= 1 (tokens), got {self.epoch!r}")
        for name in ("gain", "low", "high"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"AdaptConfig.{name} must be a finite number >= 0, got {v!r}")
        if self.low <= 0:
            raise ValueError(f"AdaptConfig.low must be positive (the shift thresholds sit there), got {self.low!r}")
        if not self.low <= 1.0 <= self.high:
            raise ValueError(
                f"AdaptConfig needs low <= 1 <= high (a sequence starts at 1), got {self.low}, {self.high}"
            )


def scaled(thr: GroupThresholds, a: float) -> tuple[float, float, float, float]:
    """``G(a)`` (module doc) as float32 numbers (Python floats); ``G(1)`` is ``thr`` itself."""
    to_lo, ti_lo, ti_hi, to_hi = thr.float32_tuple()
    if a == 1.0:
        return (to_lo, ti_lo, ti_hi, to_hi)
    lo = ti_lo - a * (ti_lo - to_lo)
    hi = ti_hi + a * (to_hi - ti_hi)
    return tuple(np.asarray((lo, ti_lo, ti_hi, hi), dtype=np.float64).astype(np.float32).tolist())  # type: ignore[return-value]


def shift_thresholds(thr: GroupThresholds, config: AdaptConfig) -> GroupThresholds:
    """The thresholds the decoders use under adaptation: ``G(config.low)``. ValueError when they collapse in
    float32 (an outer threshold on the inner one)."""
    return GroupThresholds(*scaled(thr, config.low))


def next_scale(a: float, sparse_bytes: int, values: int, target: float, config: AdaptConfig) -> float:
    """The scale after an epoch that stored ``sparse_bytes`` sparse bytes for ``values`` values (module doc)."""
    if values <= 0 or target <= 0:
        return a
    observed = max(sparse_bytes, 1) / values  # (no outlier at all: as if one, a finite step down)
    return min(config.high, max(config.low, a * (observed / target) ** config.gain))


@dataclass
class AdaptState:
    """One sequence's (batch's) adaptation: per layer and kind, the scale, the tokens quantized so far and the
    current epoch's sparse bytes and values. The store and the fake-quantizer each keep one and feed it the same
    counts (:meth:`record`)."""

    config: AdaptConfig
    #: Per layer and kind (``[L][2]``, kind 0 keys, 1 values): the profile's thresholds and target share.
    base: list[list[GroupThresholds]]
    target: list[list[float]]

    def __post_init__(self) -> None:
        n = len(self.base)
        self.scale = [[1.0, 1.0] for _ in range(n)]
        self.tokens = [[0, 0] for _ in range(n)]
        self._bytes = [[0, 0] for _ in range(n)]
        self._values = [[0, 0] for _ in range(n)]

    def reset(self) -> None:
        self.__post_init__()

    def grouping(self, layer: int, kind: int) -> tuple[float, float, float, float]:
        """The grouping thresholds now (float32 numbers)."""
        return scaled(self.base[layer][kind], self.scale[layer][kind])

    def shift(self, layer: int, kind: int) -> GroupThresholds:
        """The decoders' thresholds of ``layer`` and ``kind`` (fixed: :func:`shift_thresholds`)."""
        return shift_thresholds(self.base[layer][kind], self.config)

    def segment(self, layer: int, kind: int, tokens: int) -> int:
        """How many of ``tokens`` new tokens still belong to the current epoch (encode them with
        :meth:`grouping`, then :meth:`record` them before the rest)."""
        e = self.config.epoch
        return min(tokens, e - self.tokens[layer][kind] % e)

    def record(self, layer: int, kind: int, tokens: int, sparse_bytes: int, values: int) -> bool:
        """Count ``tokens`` tokens (of every batch row) just encoded, within one epoch, holding ``values`` values
        and ``sparse_bytes`` sparse bytes; at the epoch's end the scale moves (returns True then)."""
        e = self.config.epoch
        t = self.tokens[layer][kind]
        if tokens > e - t % e:
            raise ValueError(f"{tokens} tokens cross an epoch boundary (at token {t}, epochs of {e}): split them")
        self.tokens[layer][kind] = t + tokens
        self._bytes[layer][kind] += int(sparse_bytes)
        self._values[layer][kind] += int(values)
        if self.tokens[layer][kind] % e:
            return False
        self.scale[layer][kind] = next_scale(
            self.scale[layer][kind], self._bytes[layer][kind], self._values[layer][kind], self.target[layer][kind],
            self.config,
        )  # fmt: skip
        self._bytes[layer][kind] = self._values[layer][kind] = 0
        return True


def new_state(thresholds: Any, config: AdaptConfig) -> AdaptState:
    """A fresh :class:`AdaptState` of a profile (a ``oakenkv.calibrate.thresholds.Thresholds``): its thresholds, and as
    targets each layer's and kind's profiled sparse share (its statistics' ratios; the config's where it has none)."""
    base, target = [], []
    for i in range(thresholds.num_layers):
        row_b, row_t = [], []
        for kind in ("key", "value"):
            row_b.append(thresholds.layer(i, kind))
            st = thresholds.stats(i, kind)
            c = thresholds.config
            row_t.append((st.outer_ratio + st.inner_ratio) if st is not None else (c.outer_ratio + c.inner_ratio))
        base.append(row_b)
        target.append(row_t)
    return AdaptState(config, base, target)


__all__ = ["AdaptConfig", "AdaptState", "new_state", "next_scale", "scaled", "shift_thresholds"]
