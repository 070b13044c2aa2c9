"""Time the parts of a step or a pass inside the model by wrapping functions: shared by
``bench_step_parts.py`` and ``bench_prefill_parts.py`` (wall time, ~1 us of wrapper per call)."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any


def part_timer() -> tuple[dict[str, float], Callable[[Any, str, str], None]]:
    """``(spent, timed)``: ``timed(owner, name, key)`` replaces ``owner.name`` by a wrapper that adds its calls'
    seconds to ``spent[key]``; an attribute ``owner`` lacks is skipped (an older tree, compared before/after)."""
    spent: dict[str, float] = collections.defaultdict(float)

    def timed(owner: Any, name: str, key: str) -> None:
        f = getattr(owner, name, None)
        if f is None:
            return

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return f(*args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - t

        setattr(owner, name, wrapper)

    return spent, timed
