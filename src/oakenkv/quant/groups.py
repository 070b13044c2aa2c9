"""`GroupThresholds`: the four numbers the quantizer splits one layer's keys or values by.

Oaken (Kim et al., ISCA 2025, Section 4.2) splits every key and value vector into three groups with four
thresholds profiled offline once per model, per decoder layer and separately for keys and values::

    outer (lower)   middle (lower)   inner      middle (upper)   outer (upper)
    ------------ To_lo ---------- Ti_lo ---- Ti_hi ---------- To_hi ------------>  value

The quantizer (``oakenkv.quant.quantizer``) reads only these four numbers; a profile
(``oakenkv.calibrate.thresholds.Thresholds``) holds one set per layer and kind.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


def finite_float(name: str, v: Any) -> float:
    """``v`` as a finite float; ValueError naming ``name`` for anything else (bool included: it is an int subclass,
    and a True threshold is a bug, not 1.0)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{name} must be a number, got {v!r}")
    try:
        f = float(v)
    except OverflowError as e:  # an int beyond the float range (JSON allows 1e400 written as digits)
        raise ValueError(f"{name} must be finite, got an integer too large for a float") from e
    if not math.isfinite(f):
        raise ValueError(f"{name} must be finite, got {f!r}")
    return f


#: Largest finite float32.
FLOAT32_MAX = 3.4028234663852886e38


def as_float32(name: str, v: float) -> float:
    """``v`` rounded to float32 (to nearest, as the codec's ``torch.tensor(v, dtype=float32)`` and numpy do), as a
    Python float; ValueError when it rounds to infinity: the codec computes in float32, where it is no number."""
    try:
        return struct.unpack("<f", struct.pack("<f", v))[0]
    except OverflowError as e:
        raise ValueError(
            f"{name}={v!r} is beyond the float32 range (|x| <= {FLOAT32_MAX:.8g}) in which the codec computes"
        ) from e


@dataclass(frozen=True)
class GroupThresholds:
    """The four group boundaries of one layer's keys or values: ``to_lo < ti_lo <= ti_hi < to_hi``.

    A value ``x`` is outer if ``x < to_lo`` or ``x > to_hi``, inner if ``ti_lo <= x <= ti_hi``, middle
    otherwise (Eq. 1 of the paper; implemented by ``oakenkv.quant.quantizer.assign_groups``). ``ti_lo == ti_hi`` is
    allowed (an empty or single-point inner group, e.g. ``inner_ratio == 0``); the outer bounds must be
    strictly outside, else the middle group would have an empty side and the group shift would be ill-defined.
    """

    #: Lower outer threshold: values below it are lower outliers.
    to_lo: float
    #: Lower inner threshold.
    ti_lo: float
    #: Upper inner threshold.
    ti_hi: float
    #: Upper outer threshold: values above it are upper outliers.
    to_hi: float

    def __post_init__(self) -> None:
        names = ("to_lo", "ti_lo", "ti_hi", "to_hi")
        for name in names:
            object.__setattr__(self, name, finite_float(name, getattr(self, name)))
        if not (self.to_lo < self.ti_lo <= self.ti_hi < self.to_hi):
            raise ValueError(
                "thresholds must satisfy to_lo < ti_lo <= ti_hi < to_hi, got "
                f"to_lo={self.to_lo!r}, ti_lo={self.ti_lo!r}, ti_hi={self.ti_hi!r}, to_hi={self.to_hi!r}"
            )
        # The codec compares and shifts in float32: the order must hold there too (two thresholds 1e-9 apart
        # near 1.0 are one float32), and every threshold must be a float32 number (1e39 is not).
        f32 = [as_float32(n, getattr(self, n)) for n in names]
        if not (f32[0] < f32[1] <= f32[2] < f32[3]):
            raise ValueError(
                "thresholds are ordered in float64 but not in float32, the arithmetic the codec uses: "
                + ", ".join(f"{n}={getattr(self, n)!r} -> {v!r}" for n, v in zip(names, f32, strict=True))
                + "; the outer thresholds must stay strictly outside the inner ones after rounding to float32"
            )
        # validated once here; the codec asks for them at every encode and decode call (oakenkv.quant.quantizer)
        object.__setattr__(self, "_float32", tuple(f32))

    def float32_tuple(self) -> tuple[float, float, float, float]:
        """``(to_lo, ti_lo, ti_hi, to_hi)`` rounded to float32 (as Python floats): the numbers every codec path
        compares and shifts with; what ``oakenkv.quant.quantizer.thresholds_tuple`` returns for these thresholds."""
        return self._float32  # type: ignore[attr-defined]

    def as_tuple(self) -> tuple[float, float, float, float]:
        """``(to_lo, ti_lo, ti_hi, to_hi)``: the form ``oakenkv.quant.quantizer`` accepts."""
        return (self.to_lo, self.ti_lo, self.ti_hi, self.to_hi)

    @classmethod
    def from_sequence(cls, seq: Sequence[float]) -> GroupThresholds:
        """From ``[to_lo, ti_lo, ti_hi, to_hi]`` (a list, tuple, or anything with ``.as_tuple()``)."""
        if hasattr(seq, "as_tuple"):
            seq = seq.as_tuple()
        if isinstance(seq, (str, bytes)) or not isinstance(seq, Sequence) or len(seq) != 4:
            raise ValueError(f"thresholds must be a sequence of 4 numbers (to_lo, ti_lo, ti_hi, to_hi), got {seq!r}")
        return cls(*seq)
