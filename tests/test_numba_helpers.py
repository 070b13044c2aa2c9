"""The numba / LLVM helpers the kernels share (src/oakenkv/kernels/cpu/helpers.py): borrowed views and fp16
conversions, against numpy and torch."""

from __future__ import annotations

import numba
import numpy as np
import torch

from oakenkv.kernels.cpu import helpers as nh


def test_borrowed_row_and_span_views():
    """The reference-free views the batch kernels use: the same elements as a[r] / a[i:j], writable in place."""

    @numba.njit
    def views(a, b, r, i, j):
        row, span = nh.row_view(a, r), nh.span_view(b, i, j)
        row[0] += 100
        return row.copy(), span.copy(), span.shape[0]

    a = np.arange(35, dtype=np.uint16).reshape(7, 5)
    b = np.arange(50, dtype=np.uint8)
    for r, i, j in ((0, 0, 0), (3, 7, 19), (6, 49, 50)):
        before = a[r].copy()
        row, span, n = views(a, b, r, i, j)
        np.testing.assert_array_equal(row, before + np.array([100, 0, 0, 0, 0], np.uint16))
        np.testing.assert_array_equal(a[r], row)  # a view: the write went to a
        np.testing.assert_array_equal(span, b[i:j])
        assert n == j - i


def test_fp16_rounding_helpers_match_torch():
    g = np.random.default_rng(0)
    bits = g.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    v = bits.view(np.float32)
    v = v[np.isfinite(v)]
    # plus every fp16 value and the midpoints between neighbours (ties to even)
    h = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16).float().numpy()
    h = np.sort(h[np.isfinite(h)])
    mids = ((h[1:].astype(np.float64) + h[:-1]) / 2).astype(np.float32)
    v = np.concatenate([v, h, mids, np.float32([0.0, -0.0, 65504, 65519.99, 65520, -65520, 2**-25, 2**-24])])
    want16 = torch.from_numpy(v).to(torch.float16)
    want_bits = want16.view(torch.int16).numpy().view(np.uint16)
    got_bits = np.array([nh.f32_to_f16_bits(np.float32(a)) for a in v], dtype=np.uint16)
    assert np.array_equal(got_bits, want_bits)
    arr = np.empty(v.size, np.uint16)
    nh.f32_to_f16_bits_array(np.ascontiguousarray(v), arr)
    assert np.array_equal(arr, want_bits)
    small = np.abs(v) <= 65504
    got = np.array([nh.round_to_f16(np.float32(a)) for a in v[small]], dtype=np.float32)
    assert np.array_equal(got.view(np.uint32), want16.float().numpy()[small].view(np.uint32))
    # the conversions the decoder uses (one instruction each where the CPU has them) and their integer fallbacks
    every = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    every = every[(every & 0x7C00) != 0x7C00]  # finite fp16 patterns
    want_w = torch.from_numpy(every.view(np.int16)).view(torch.float16).float().numpy()
    for integer in (False, True):
        out_bits, out_w = np.empty(v.size, np.uint16), np.empty(every.size, np.float32)
        _convert_all(np.ascontiguousarray(v), out_bits, every, out_w, integer)
        assert np.array_equal(out_bits, want_bits)
        assert np.array_equal(out_w.view(np.uint32), want_w.view(np.uint32))


@numba.njit
def _convert_all(v, out_bits, h, out_w, integer):
    for i in range(v.shape[0]):
        out_bits[i] = nh.f16_bits_int(v[i]) if integer else nh.f16_bits(v[i])
    for i in range(h.shape[0]):
        out_w[i] = nh.f16_widen_int(h[i]) if integer else nh.f16_widen(h[i])
