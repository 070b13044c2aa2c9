"""numba kernels of the oaken-plus online key transform (``oakenkv.calibrate.transforms``): a per-row shift and a
per-head fast Walsh-Hadamard transform, in place on float32 rows.

The butterflies run in one fixed order with plain float32 additions, subtractions and one final multiplication
(no fused multiply-add: compiled without fastmath), so every caller gets the same bits whatever the batch shape;
``tests/test_plus.py`` checks them against the matrix product.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def shift_rotate_rows(rows: np.ndarray, shift: np.ndarray, rotate: bool, width: int, scale: np.float32) -> None:
    """In place on float32 ``rows [N, D]``: subtract ``shift [D]`` (skipped when it is empty), then, when ``rotate``,
    transform each block of ``width`` values (one head) by the unnormalised Sylvester Hadamard matrix and multiply
    by ``scale`` (``1 / sqrt(width)``)."""
    n, d = rows.shape
    for r in range(n):
        x = rows[r]
        if shift.shape[0]:
            for j in range(d):
                x[j] -= shift[j]
        if rotate:
            for base in range(0, d, width):
                h = 1
                while h < width:
                    for i in range(base, base + width, 2 * h):
                        # the two halves as views of their own: LLVM then vectorizes the butterflies (each value
                        # still gets the same one addition or subtraction, so the bits do not change)
                        a = x[i : i + h]
                        b = x[i + h : i + 2 * h]
                        for j in range(h):
                            ta = a[j]
                            tb = b[j]
                            a[j] = ta + tb
                            b[j] = ta - tb
                    h *= 2
                for j in range(base, base + width):
                    x[j] *= scale
