"""Exact types for what oakenkv reads from files and the environment.

JSON and environment strings are untrusted: Python's loose comparisons would take ``true`` for ``1`` (``True in (1,
2)``), ``5.0`` for ``5`` (``5.0 in (4, 5)``, which then fails deep inside numba's typing), and ``float("inf")`` or
``1e308`` for a size. Every loader checks with these helpers instead: a bool is not a number, a float is not an int,
a number read from the environment is finite and within its range. Standard library only.
"""

from __future__ import annotations

import math
import os
from typing import Any


def is_int(v: Any) -> bool:
    """Whether ``v`` is an int and not a bool (a bool is an int subclass)."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    """Whether ``v`` is an int or a float, not a bool."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def one_of(v: Any, allowed: tuple[Any, ...]) -> bool:
    """Whether ``v`` equals one of ``allowed`` with the same type (``1.0`` and ``True`` are not ``1``)."""
    return any(type(v) is type(a) and v == a for a in allowed)


def env_number(
    name: str, default: float | None, lo: float, hi: float, *, integer: bool = False, what: str = "a number"
) -> float | int | None:
    """The environment variable ``name`` as a finite number in ``[lo, hi]`` (an int when ``integer``), ``default``
    when unset or blank. ValueError naming the variable, its value and the range otherwise (``inf``, ``nan``,
    ``1e308``, a word, a float where an int belongs)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    bad = ValueError(f"{name} must be {what} in [{lo:g}, {hi:g}], got {raw[:40]!r}")
    try:
        v: float | int = int(raw) if integer else float(raw)
    except ValueError:
        raise bad from None
    if not math.isfinite(v) or not lo <= v <= hi:
        raise bad
    return v


__all__ = ["env_number", "is_int", "is_number", "one_of"]
