"""numba loops of exact order statistics (``oakenkv.calibrate.stats.order_statistics``): the values of a 1-D
array that fall below or inside each of a few brackets, counted and gathered by branch-free loops that LLVM
vectorizes (numpy takes four passes and a boolean mask per bracket: about 2x the time).

A bracket ``b`` is ``lows[b] <= x <= highs[b]`` (``-inf`` / ``+inf`` for an open end); NaN is in none and below
none, as numpy's comparisons put it. The arrays are float32 or float64 and the bounds of the same dtype.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def bracket_counts(flat, lows, highs, below, inside):
    """Per bracket ``b``: ``below[b]`` = the values ``< lows[b]``, ``inside[b]`` = those in the bracket (int64
    ``[B]`` each, overwritten). Branch-free sums, one loop per bracket: they vectorize."""
    for b in range(lows.size):
        lo, hi = lows[b], highs[b]
        nb, ni = 0, 0
        for j in range(flat.size):
            x = flat[j]
            nb += x < lo
            ni += (x >= lo) & (x <= hi)
        below[b] = nb
        inside[b] = ni


@njit(cache=True, nogil=True)
def bracket_gather(flat, lows, highs, offsets, out):
    """The values of bracket ``b``, in their order in ``flat``, into ``out[offsets[b] : offsets[b + 1]]``
    (``offsets``: int64 ``[B + 1]``, the running sum of :func:`bracket_counts`' ``inside``; ``out`` one longer than
    ``offsets[-1]``). Branch-free: every value is stored at the next free slot, which moves on only when it is in
    the bracket (a bracket's last store lands on the next one's first slot, filled after it)."""
    for b in range(lows.size):
        lo, hi = lows[b], highs[b]
        at = offsets[b]
        for j in range(flat.size):
            x = flat[j]
            out[at] = x
            at += (x >= lo) & (x <= hi)


def bracket_values(flat: np.ndarray, lows: np.ndarray, highs: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """The count of values below each bracket (int64 ``[B]``) and the values inside each (a list of ``B`` arrays):
    ``flat`` float32/float64 ``[n]`` contiguous, ``lows``/``highs`` ``[B]`` of its dtype."""
    below = np.empty(lows.size, dtype=np.int64)
    inside = np.empty(lows.size, dtype=np.int64)
    bracket_counts(flat, lows, highs, below, inside)
    offsets = np.zeros(lows.size + 1, dtype=np.int64)
    np.cumsum(inside, out=offsets[1:])
    out = np.empty(int(offsets[-1]) + 1, dtype=flat.dtype)
    bracket_gather(flat, lows, highs, offsets, out)
    return below, [out[offsets[b] : offsets[b + 1]] for b in range(lows.size)]
