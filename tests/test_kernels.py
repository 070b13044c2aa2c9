"""The numba CPU kernels (oakenkv.kernels.cpu.codec) against the reference quant/quantizer.py + kernels/codec.py, bit
for bit, and fuzzing of the decoder with corrupted and random bytes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numba
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from oakenkv.calibrate.thresholds import GroupThresholds
from oakenkv.format.config import DEFAULT_STATIC_LEVELS, OakenConfig
from oakenkv.format.layout import record_size, scale_bytes, sparse_capacity, to_records
from oakenkv.kernels import codec
from oakenkv.kernels.codec import CorruptDataError, EncodedBatch
from oakenkv.kernels.cpu import codec as cpu
from oakenkv.quant.quantizer import dequantize, quantize, thresholds_tuple

SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])

THRESHOLDS = [
    (-2.0, -0.15, 0.15, 2.0),
    (-1.0, 0.0, 0.0, 1.0),  # degenerate inner interval: only exact zeros are inner
    (-0.5, -0.499, 3.0, 3.5),  # asymmetric
    (-300.0, -1.0, 1.0, 1000.0),  # outer group often empty
]


def _bits32(t: torch.Tensor) -> torch.Tensor:
    """float32 bit patterns with -0.0 folded into +0.0 (torch's min/max may return either zero)."""
    return (t.to(torch.float32) + 0.0).view(torch.int32)


def _assert_same_bytes(a: EncodedBatch, b: EncodedBatch):
    assert a.dim == b.dim
    assert torch.equal(a.dense, b.dense)
    assert torch.equal(a.sparse_offsets, b.sparse_offsets)
    assert torch.equal(a.sparse, b.sparse)
    assert a.scales.dtype == b.scales.dtype
    assert torch.equal(_bits32(a.scales), _bits32(b.scales))


@st.composite
def rows(draw, slots=(4,), static=(False,)):
    """Rows, thresholds and a config with a dense slot of one of ``slots`` bits (OakenConfig.middle_bits) and
    static grids one of ``static`` (False, True, or "levels": static grids with DEFAULT_STATIC_LEVELS)."""
    thr = draw(st.sampled_from(THRESHOLDS))
    d = draw(st.sampled_from([1, 2, 7, 63, 64, 65, 80, 96, 128, 192, 256, 513, 1024]))
    n = draw(st.integers(1, 5))
    to_lo, ti_lo, ti_hi, to_hi = thr
    edge = [
        to_lo, ti_lo, ti_hi, to_hi, 0.0, -0.0,
        float(np.nextafter(np.float32(to_hi), np.float32(1e9))),
        float(np.nextafter(np.float32(to_lo), np.float32(-1e9))),
        float(np.nextafter(np.float32(ti_hi), np.float32(1e9))),
        float(np.nextafter(np.float32(ti_lo), np.float32(-1e9))),
        1e-30, -1e-30, 6e4, -6e4,
    ]  # fmt: skip
    kind = draw(st.sampled_from(["random", "edges", "constant", "outliers"]))
    seed = draw(st.integers(0, 2**31 - 1))
    g = np.random.default_rng(seed)
    scale = draw(st.sampled_from([0.01, 1.0, 3.0, 100.0]))
    if kind == "random":
        x = g.standard_normal((n, d)) * scale
    elif kind == "edges":
        x = g.choice(np.array(edge), size=(n, d))
        mask = g.random((n, d)) < 0.3
        x = np.where(mask, g.standard_normal((n, d)) * scale, x)
    elif kind == "constant":
        x = np.full((n, d), draw(st.sampled_from(edge)))
    else:  # every value of whole chunks an outlier, on both sides or one
        x = g.standard_normal((n, d)) * 0.5
        x[:, : min(d, 64)] = (to_hi + 1.0) * draw(st.sampled_from([1.0, -1.0])) * (1 + g.random((n, min(d, 64))))
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    mb = draw(st.sampled_from(slots))
    cfg = OakenConfig(
        scale_dtype=draw(st.sampled_from(["float16", "float32"])),
        inner_bits=draw(st.sampled_from([mb + 1, mb + 1, mb])),
        outer_bits=draw(st.sampled_from([mb + 1, mb + 1, mb])),
        middle_bits=mb,
        static_grids=bool(grids := draw(st.sampled_from(static))),
        static_levels=DEFAULT_STATIC_LEVELS if grids == "levels" else (),
    )
    return torch.from_numpy(x.astype(np.float32)).to(dtype), thr, cfg


@SETTINGS
@given(rows())
def test_encode_decode_bit_exact_with_reference(case):
    _check_bit_exact(case)


@SETTINGS
@given(rows(slots=(3, 2, 5, 6, 7)))
def test_other_slot_widths_encode_decode_bit_exact_with_reference(case):
    """Dense slots of 2, 3 (oaken-plus-2, -3) and 5..7 bits (oaken-plus-5, -6: the encoder's wide scratch, the
    groups in a byte array of their own): every fast entry point, byte and bit for bit."""
    _check_bit_exact(case)


@SETTINGS
@given(rows(slots=(2, 3, 4, 5, 6, 7), static=(True,)))
def test_static_grids_encode_decode_bit_exact_with_reference(case):
    """Static grids (OakenConfig.static_grids, issue #36): the layer's middle and inner grids, values beyond them
    on their end codes, the outer scales alone in a record: every fast entry point, byte and bit for bit."""
    _check_bit_exact(case)


@SETTINGS
@given(rows(slots=(2, 3, 4, 5, 6, 7), static=("levels",)))
def test_static_levels_encode_decode_bit_exact_with_reference(case):
    """Static levels (OakenConfig.static_levels): each row's level chosen as the reference chooses it, its index in
    the batch and in the record's level byte: every fast entry point, byte and bit for bit."""
    _check_bit_exact(case)


@SETTINGS
@given(
    rows(slots=(4, 3, 6), static=(False, True, "levels")),
    st.lists(st.sampled_from([0.0, 0.0, 1e-3, 0.05, 0.4]), min_size=4, max_size=4),
)
def test_grouping_thresholds_apart_from_the_shift_bit_exact_with_reference(case, widen):
    """Adaptive grouping's encoder (oakenkv.quant.adapt): values grouped by thresholds on or beyond the ones that
    shift and decode them, through every fast entry point, byte and bit for bit the reference's."""
    x, thr, cfg = case
    to_lo, ti_lo, ti_hi, to_hi = thr
    group = (to_lo - widen[0], ti_lo - widen[1] * (ti_lo - to_lo), ti_hi + widen[2] * (to_hi - ti_hi), to_hi + widen[3])
    try:
        q = quantize(x, thr, cfg, group)
    except ValueError:
        with pytest.raises(ValueError):
            codec.encode(x, thr, cfg, group)
        return
    ref = codec.pack(q, cfg, thr)
    _assert_same_bytes(codec.encode(x, thr, cfg, group), ref)
    want = dequantize(q, thr, cfg)
    assert torch.equal(_bits32(codec.decode(ref, thr, cfg)), _bits32(want))  # the decoder knows only thr
    g8 = np.asarray(thresholds_tuple(thr) + thresholds_tuple(group), np.float32)
    if x.dtype == torch.float32:
        _assert_same_bytes(cpu.encode_trusted(x.numpy(), g8, cfg), ref)
        n, d = x.shape
        fp16, sb = cfg.scale_dtype == "float16", scale_bytes(cfg)
        records = np.empty((n, record_size(d, cfg)), np.uint8)
        sparse = np.empty((n, sparse_capacity(d)), np.uint8)
        counts = np.empty(n, np.int64)
        thr_rows = np.repeat(g8[None], n, axis=0)
        cpu.encode_records(
            x.numpy().copy(), thr_rows, cfg.inner_bits, cfg.outer_bits, fp16, sb, records, sparse, counts,
            cfg.middle_bits, _static_rows(thr, cfg, n), _levels(cfg),
        )  # fmt: skip
        dense, flat, offs = to_records(ref)
        assert np.array_equal(records[:, sb:], dense[:, sb:])
        assert all(np.array_equal(sparse[r, : counts[r]], flat[offs[r] : offs[r + 1]]) for r in range(n))
    # grouping by thr itself is the plain encoder
    _assert_same_bytes(codec.encode(x, thr, cfg, thr), codec.encode(x, thr, cfg))


def test_grouping_thresholds_inside_the_shift_ones_are_refused():
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="on or beyond"):
        codec.encode(x, (-2.0, -0.15, 0.15, 2.0), OakenConfig(), (-1.9, -0.15, 0.15, 2.0))
    with pytest.raises(ValueError, match="on or beyond"):
        quantize(x, (-2.0, -0.15, 0.15, 2.0), OakenConfig(), (-2.0, -0.1, 0.15, 2.0))


def _static_rows(thr, cfg, n):
    """The record kernels' ``static`` argument: each row's static grid, or None (per-row grids)."""
    if not cfg.static_grids:
        return None
    return np.repeat(cpu.static_grid_array(np.asarray(thresholds_tuple(thr), np.float32), cfg)[None], n, axis=0)


def _levels(cfg):
    """The record encoder's ``levels`` argument: the static levels' clip factors, or None."""
    return cpu.levels_array(cfg) if cfg.static_levels else None


def _check_bit_exact(case):
    x, thr, cfg = case
    try:
        q = quantize(x, thr, cfg)
    except ValueError as e:  # fp16 scale overflow: the kernel must refuse the same input
        with pytest.raises(ValueError, match="fp16"):
            codec.encode(x, thr, cfg)
        assert "fp16" in str(e)
        return
    ref = codec.pack(q, cfg, thr)
    enc = codec.encode(x, thr, cfg)
    _assert_same_bytes(enc, ref)
    assert enc.stored_scales == ref.stored_scales == (2 if cfg.static_grids else 6)
    assert enc.nbytes() == ref.nbytes()
    if cfg.static_levels:
        assert torch.equal(enc.level, ref.level) and torch.equal(enc.level, q.level)
    else:
        assert enc.level is None and ref.level is None
    want = dequantize(q, thr, cfg)
    got = codec.decode(enc, thr, cfg)
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert torch.equal(_bits32(got), _bits32(want))
    got16 = cpu.decode_batch(enc, thr, cfg, out_dtype=torch.float16)
    assert torch.equal(
        (got16.float() + 0.0).view(torch.int32), (want.to(torch.float16).float() + 0.0).view(torch.int32)
    )
    # the paged store's entry points (float32 rows, validated float32 thresholds, no structural checks)
    thr32 = np.asarray(thresholds_tuple(thr), np.float32)
    if x.dtype == torch.float32:
        _assert_same_bytes(cpu.encode_trusted(x.numpy(), thr32, cfg), ref)
        # ... and a short prefill's, through page records (encode_records, decode_records)
        n, d = x.shape
        fp16, sb = cfg.scale_dtype == "float16", scale_bytes(cfg)
        thr_rows = np.repeat(thr32[None], n, axis=0)
        records = np.empty((n, record_size(d, cfg)), np.uint8)
        sparse = np.empty((n, sparse_capacity(d)), np.uint8)
        counts = np.empty(n, np.int64)
        ib, ob, mb = cfg.inner_bits, cfg.outer_bits, cfg.middle_bits
        static = _static_rows(thr, cfg, n)
        if cfg.static_levels:
            cpu.encode_records(
                x.numpy().copy(), thr_rows, ib, ob, fp16, sb, records, sparse, counts, mb, static, _levels(cfg)
            )
        elif static is not None:
            cpu.encode_records(x.numpy().copy(), thr_rows, ib, ob, fp16, sb, records, sparse, counts, mb, static)
        elif mb == 4:  # the paper's slot is the trailing argument's default
            cpu.encode_records(x.numpy().copy(), thr_rows, ib, ob, fp16, sb, records, sparse, counts)
        else:
            cpu.encode_records(x.numpy().copy(), thr_rows, ib, ob, fp16, sb, records, sparse, counts, mb)
        dense, flat, offs = to_records(ref)
        ns = 2 if cfg.static_grids else 6
        assert dense.shape[1] == record_size(d, cfg) and sb == ns * cfg.scale_itemsize + bool(cfg.static_levels)
        assert np.array_equal(records[:, sb:], dense[:, sb:])  # the slots; the scales up to the sign of a zero:
        got_sc = torch.from_numpy(records[:, : ns * cfg.scale_itemsize].copy().view(cfg.scale_np_dtype))
        assert torch.equal(_bits32(got_sc), _bits32(ref.scales[:, 6 - ns :].reshape(n, -1)))
        if cfg.static_levels:  # the level byte
            assert np.array_equal(records[:, sb - 1], ref.level.numpy()) and np.array_equal(
                dense[:, sb - 1], records[:, sb - 1]
            )
        assert all(np.array_equal(sparse[r, : counts[r]], flat[offs[r] : offs[r + 1]]) for r in range(n))
        out = np.empty((n, d), np.float32)
        status = np.ones(n, np.int64)
        if static is not None:
            cpu.decode_records(records, sparse, counts, thr_rows, ib, ob, fp16, sb, out, status, mb, static)
        else:
            cpu.decode_records(records, sparse, counts, thr_rows, ib, ob, fp16, sb, out, status, mb)
        assert (status == 0).all()
        assert torch.equal(_bits32(torch.from_numpy(out)), _bits32(want))
        # the single-row decoder other kernels call
        lut = np.empty(cpu.LUT_SIZE, np.float32)
        row = np.empty(d, np.float32)
        sc = ref.scales.float().numpy()
        for r in range(n):
            stream = flat[offs[r] : offs[r + 1]]
            assert cpu.decode_row_into_lut(dense[r, sb:], stream, sc[r], thr32, row, ib, ob, lut, mb) == 0
            assert torch.equal(_bits32(torch.from_numpy(row)), _bits32(want[r]))
    assert torch.equal(_bits32(cpu.decode_trusted(enc, thr32, cfg)), _bits32(want))


def test_store_entry_points_refuse_what_the_checked_ones_refuse():
    thr32 = np.asarray(THRESHOLDS[0], np.float32)
    x = np.ones((3, 64), np.float32)
    x[2, 5] = np.nan
    with pytest.raises(ValueError, match="cannot encode row 2"):
        cpu.encode_trusted(x, thr32, OakenConfig())
    enc = codec.encode(torch.from_numpy(np.full((2, 64), 3.0, np.float32)), THRESHOLDS[0], OakenConfig())
    enc.scales[1, 0] = float("inf")  # the kernel checks every row's scales, as decode_batch's does
    with pytest.raises(CorruptDataError, match="row 1"):
        cpu.decode_trusted(enc, thr32, OakenConfig())


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(-1e6, 1e6, allow_nan=False, width=64), min_size=4, max_size=4, unique=True))
def test_group_thresholds_carry_the_codecs_float32_numbers(values):
    values = sorted(values)
    try:
        gt = GroupThresholds(*values)
    except ValueError:  # ordered in float64 but not in float32: the generic path refuses them as well
        with pytest.raises(ValueError):
            thresholds_tuple(values)
        return
    assert thresholds_tuple(gt) == thresholds_tuple(tuple(values)) == gt.float32_tuple()


@st.composite
def fp16_rows_near_thresholds(draw):
    """fp16 rows made of the fp16 values around each threshold (the statistics of fp16 input run on 16-bit keys,
    with each float32 threshold turned into the nearest fp16 key on its side: these rows probe that rounding)."""
    kind = draw(st.sampled_from(["exact", "between", "tiny", "zeros", "random"]))
    if kind == "zeros":
        thr = draw(st.sampled_from([(-1.0, 0.0, 0.0, 1.0), (-1.0, -0.0, 0.0, 1.0), (-3e-5, -0.0, 1e-8, 2.0)]))
    else:
        g = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
        scale = {"exact": 4.0, "between": 4.0, "tiny": 1e-6, "random": 100.0}[kind]
        t = np.sort(g.standard_normal(4) * scale).astype(np.float16 if kind == "exact" else np.float32)
        if kind == "between":  # halfway between two fp16 neighbours: not representable in fp16
            t = t.astype(np.float16).astype(np.float32) + np.float32(2.0**-12)
        thr = tuple(float(v) for v in np.sort(t.astype(np.float32)))
        assume(thr[0] < thr[1] <= thr[2] < thr[3])  # fp16 rounding can make two draws equal
    g = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    near = []
    for t in thr:
        h = int(np.float16(t).view(np.uint16))
        for dh in range(-3, 4):
            near.append(np.uint16((h + dh) & 0xFFFF))
    pool = np.array([*near, 0x0000, 0x8000, 0x0001, 0x8001, 0x7BFF, 0xFBFF], dtype=np.uint16)
    pool = pool[(pool & 0x7C00) != 0x7C00]
    d = draw(st.sampled_from([5, 64, 100]))
    x = g.choice(pool, size=(draw(st.integers(1, 4)), d)).view(np.float16)
    return torch.from_numpy(x.copy()), thr


@SETTINGS
@given(fp16_rows_near_thresholds())
def test_fp16_input_statistics_match_reference(case):
    x, thr = case
    cfg = OakenConfig(scale_dtype="float32")  # no fp16 scale overflow for rows with +-65504
    _assert_same_bytes(codec.encode(x, thr, cfg), codec.pack(quantize(x, thr, cfg), cfg))


def test_encode_many_rows_is_thread_independent():
    # several parallel blocks of rows; the result must not depend on the thread count
    x = torch.randn(300, 192, generator=torch.Generator().manual_seed(0)) * 2
    thr = THRESHOLDS[0]
    ref = codec.pack(quantize(x, thr))
    before = numba.get_num_threads()
    try:
        for t in sorted({1, before}):
            numba.set_num_threads(t)
            _assert_same_bytes(codec.encode(x, thr), ref)
            assert torch.equal(codec.decode(ref, thr), dequantize(quantize(x, thr), thr))
    finally:
        numba.set_num_threads(before)


def test_encode_rejects_bad_input():
    thr = THRESHOLDS[0]
    x = torch.randn(4, 64)
    x[2, 5] = float("nan")
    with pytest.raises(ValueError, match=r"row 2.*NaN"):
        codec.encode(x, thr)
    with pytest.raises(ValueError, match="fp16"):
        codec.encode(torch.full((1, 64), 1e5), thr)
    assert codec.encode(torch.full((1, 64), 1e5), thr, OakenConfig(scale_dtype="float32")).dim == 64
    with pytest.raises(ValueError, match=r"\[N, D\]"):
        codec.encode(torch.randn(64), thr)
    with pytest.raises(TypeError):
        codec.encode(torch.ones(2, 64, dtype=torch.int32), thr)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_encode_rejects_every_nonfinite_value_and_keeps_the_largest_finite(dtype):
    """Non-finite values are found from the row's extreme keys (no separate test per value): every kind of NaN and
    inf, at either end of the row's order, is rejected; the largest finite values of the dtype are not."""
    thr = THRESHOLDS[0]
    f32 = OakenConfig(scale_dtype="float32")
    big = torch.finfo(dtype).max
    ok = torch.randn(3, 80).to(dtype)
    ok[0, 7], ok[1, 0], ok[2, 79] = big, -big, torch.finfo(dtype).tiny
    if dtype != torch.float32:  # a float32 max would overflow the float32 range computations themselves
        enc = cpu.encode_batch(ok, thr, f32)
        _assert_same_bytes(enc, codec.pack(quantize(ok.float(), thr, f32), f32))
    nan_bits = [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF]  # +-quiet, signalling, all-ones
    bad = [float("inf"), float("-inf")] + [np.uint32(b).view(np.float32).item() for b in nan_bits]
    for v in bad:
        for col in (0, 41, 79):
            x = torch.randn(3, 80)
            x[1, col] = v
            with pytest.raises(ValueError, match=r"row 1.*NaN or infinite"):
                cpu.encode_batch(x.to(dtype), thr, f32)


def _coo_inputs(comb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each value's COO entry byte and each chunk's outlier mask, from the format's definition (codec): an outlier
    is a byte >= 32 (group bit 32 inner / 64 outer); its entry is index | group bit | fifth code bit << 3."""
    idx = np.arange(comb.size) % 64
    ent = (idx | (comb & 0x40) | ((comb & 0x10) << 3)).astype(np.uint8)
    bits = (comb >= 32).astype(np.uint64).reshape(-1, 64) << np.arange(64, dtype=np.uint64)
    return ent, np.bitwise_or.reduce(bits, axis=1)


@pytest.mark.skipif(not cpu.HW_COMPRESS, reason="this host has no AVX-512 VBMI2 (vpcompressb)")
@pytest.mark.parametrize("d", [64, 80, 192, 4096, 64 * 300])
def test_coo_compress_writes_the_bit_loops_bytes(d):
    """The vpcompressb emission against the per-outlier loop: every outlier share (all-outlier chunks too),
    escapes (repeated bytes, chunk advances past 255 chunks), and buffers too short for a whole 64-byte store,
    where it must fall back without writing past the end."""
    rng = np.random.default_rng(d)
    nch = -(-d // 64)
    for share in (0.0, 0.01, 0.1, 0.5, 1.0, "far"):
        comb = np.zeros(nch * 64, np.uint8)
        if share == "far":  # one outlier in the first and one in the last chunk (an advance of nch - 1 chunks)
            comb[[0, d - 1]] = [64 + 7, 32 + 7]
        else:
            u = rng.random(d)
            group = np.where(u < share * 0.4, 64, np.where(u < share, 32, 0))
            comb[:d] = group + np.where(group > 0, rng.integers(0, 32, d), rng.integers(0, 16, d))
        ent, cmask = _coo_inputs(comb)
        cap = cpu.sparse_capacity(d)
        ref = np.zeros(cap, np.uint8)
        n = cpu._coo_bits(ent, cmask, ref)
        outliers = int((comb >= 32).sum())
        assert outliers <= n <= cap and (n == 0) == (outliers == 0)  # one entry per outlier, plus escapes
        for room in (cap, n):  # the usual buffer, and one that ends right after the stream
            buf = np.full(room + 64, 0xAB, np.uint8)
            got = cpu._coo_compress(ent, cmask, buf[:room])
            assert got == n
            np.testing.assert_array_equal(buf[:n], ref[:n])
            assert (buf[room:] == 0xAB).all()  # nothing written past the buffer


@pytest.mark.parametrize("seed", range(4))
def test_nearest_zero_of_a_one_sided_group(seed):
    """_min_above / _min_below (the plain grid's end nearest zero) from integer keys equal the float32 minimum of
    the shifted values, on fp16 and float32 rows with values on and next to the bounds, signed zeros, infinities
    as bounds, and empty selections."""
    g = np.random.default_rng(seed)
    for _ in range(300):
        d = int(g.choice([1, 5, 64, 192]))
        x = (g.standard_normal(d) * 10.0 ** g.uniform(-4, 3)).astype(np.float32)
        bounds = [*x[:3], 0.0, -0.0, np.inf, -np.inf, g.standard_normal()]
        lo, hi = np.sort(np.array(g.choice(bounds, 2), np.float32))
        x[g.random(d) < 0.2] = g.choice(np.array([lo, hi, -0.0, 0.0], np.float32))
        for row in (x, x.astype(np.float16).view(np.uint16)):
            v = row.view(np.float16).astype(np.float32) if row.dtype == np.uint16 else row
            above, below = v[(v > lo) & (v <= hi)], v[(v >= lo) & (v < hi)]
            want_a = np.min(above - lo) if above.size and lo < np.inf else np.float32(np.inf)
            want_b = np.min(hi - below) if below.size else np.float32(np.inf)
            if lo < np.inf:
                assert cpu._min_above(row, lo, hi, lo) == want_a
            assert cpu._min_below(row, lo, hi, hi) == want_b


# Test helpers that call kernels are not cached: numba's cache keys a function on its own source file only, so a
# cached helper would keep running the kernel it was first compiled with after the kernel changes.
@numba.njit
def _decode_all_via_row_helper(dense, sparse, offsets, scales, thr, out):
    # how another numba kernel (decode attention) calls the single-row helper
    for r in range(dense.shape[0]):
        err = cpu.decode_row_into(dense[r], sparse[offsets[r] : offsets[r + 1]], scales[r], thr, out[r])
        if err != 0:
            return err
    return 0


def test_single_row_helper_callable_from_numba():
    x = torch.randn(9, 80, generator=torch.Generator().manual_seed(2)) * 2
    thr = THRESHOLDS[0]
    enc = codec.encode(x, thr)
    out = np.empty((9, 80), np.float32)
    err = _decode_all_via_row_helper(
        enc.dense.numpy(),
        enc.sparse.numpy(),
        enc.sparse_offsets.numpy(),
        enc.scales.float().numpy(),
        np.float32(thr),
        out,
    )
    assert err == 0
    assert torch.equal(torch.from_numpy(out), codec.decode(enc, thr))


# ---------------------------------------------------------------------------------------------------------------
# Fuzzing the decoder: corrupted and random bytes raise CorruptDataError or decode exactly as the reference
# ---------------------------------------------------------------------------------------------------------------


def _reference_or_error(enc, thr, cfg):
    try:
        return dequantize(codec.unpack(enc, cfg), thr, cfg)
    except CorruptDataError:
        return None


def _kernel_or_error(enc, thr, cfg):
    try:
        return codec.decode(enc, thr, cfg)
    except CorruptDataError:
        return None


@st.composite
def corrupted(draw):
    d = draw(st.sampled_from([64, 80, 192, 200, 600]))
    n = draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**31 - 1))
    g = np.random.default_rng(seed)
    mb = draw(st.sampled_from([4, 4, 3, 2, 5, 7]))  # the dense slot width
    cfg = OakenConfig(middle_bits=mb, inner_bits=draw(st.sampled_from([mb, mb + 1])))
    x = torch.from_numpy((g.standard_normal((n, d)) * 1.5).astype(np.float32))
    enc = codec.encode(x, THRESHOLDS[0], cfg)
    sparse = enc.sparse.numpy().copy()
    offsets = enc.sparse_offsets.numpy().copy()
    how = draw(st.sampled_from(["flip", "truncate_row", "random_row", "insert", "offsets"]))
    if how == "flip" and sparse.size:
        for _ in range(draw(st.integers(1, 4))):
            sparse[g.integers(sparse.size)] ^= np.uint8(1 << g.integers(8))
    elif how == "truncate_row":
        r = int(g.integers(n))
        cut = int(g.integers(offsets[r], offsets[r + 1] + 1))
        sparse = np.delete(sparse, np.arange(cut, offsets[r + 1]))
        offsets[r + 1 :] -= offsets[r + 1] - cut
    elif how == "random_row":
        r = int(g.integers(n))
        new = g.integers(0, 256, int(g.integers(0, 40)), dtype=np.uint8)
        sparse = np.concatenate([sparse[: offsets[r]], new, sparse[offsets[r + 1] :]])
        offsets[r + 1 :] += new.size - (offsets[r + 1] - offsets[r])
    elif how == "insert":
        at = int(g.integers(sparse.size + 1))
        sparse = np.insert(sparse, at, np.uint8(g.integers(256)))
        offsets[np.searchsorted(offsets, at, side="right") :] += 1
        offsets[-1] = sparse.size
    else:
        offsets[int(g.integers(1, n + 1))] += int(g.integers(-5, 6))
    enc.sparse = torch.from_numpy(sparse)
    enc.sparse_offsets = torch.from_numpy(offsets)
    return enc, cfg


@SETTINGS
@given(corrupted())
def test_fuzz_decoder_agrees_with_reference_on_corrupt_streams(case):
    enc, cfg = case
    want = _reference_or_error(enc, THRESHOLDS[0], cfg)
    got = _kernel_or_error(enc, THRESHOLDS[0], cfg)
    assert (want is None) == (got is None)
    if want is not None:
        assert torch.equal(_bits32(got), _bits32(want))


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([1, 63, 64, 130, 515]), st.integers(0, 3))
def test_fuzz_random_bytes_never_crash(seed, d, n):
    g = np.random.default_rng(seed)
    counts = g.integers(0, 3 * d, n)
    # random streams biased towards escape-heavy bytes
    sparse = g.choice(np.array([0, 1, 0xFF, 0x3F, 0x40, 0x80, g.integers(256)], dtype=np.uint8), int(counts.sum()))
    enc = EncodedBatch(
        dense=torch.from_numpy(g.integers(0, 256, (n, (d + 1) // 2), dtype=np.uint8)),
        scales=torch.from_numpy(g.standard_normal((n, 6)).astype(np.float16)),
        sparse=torch.from_numpy(sparse),
        sparse_offsets=torch.from_numpy(np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)),
        dim=d,
    )
    want = _reference_or_error(enc, THRESHOLDS[0], OakenConfig())
    got = _kernel_or_error(enc, THRESHOLDS[0], OakenConfig())
    assert (want is None) == (got is None)
    if want is not None:
        assert torch.equal(_bits32(got), _bits32(want))


@pytest.mark.parametrize("scale_dtype", ["float16", "float32"])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_decode_rejects_nonfinite_scales(scale_dtype, bad):
    cfg = OakenConfig(scale_dtype=scale_dtype)
    for d in (64, 600):  # both outlier paths (computed and table)
        enc = codec.encode(torch.randn(5, d, generator=torch.Generator().manual_seed(d)), THRESHOLDS[0], cfg)
        enc.scales[3, 4] = bad
        for out_dtype in (torch.float32, torch.float16):
            with pytest.raises(CorruptDataError, match=r"row 3: scales contain NaN or infinite"):
                cpu.decode_batch(enc, THRESHOLDS[0], cfg, out_dtype)
        with pytest.raises(CorruptDataError, match="scales contain NaN or infinite"):
            codec.unpack(enc, cfg)


def test_decode_rejects_wrong_shapes_before_reading():
    enc = codec.encode(torch.randn(3, 64), THRESHOLDS[0])
    bad = EncodedBatch(**{**enc.__dict__, "dim": 200})
    with pytest.raises(CorruptDataError, match="dense"):
        codec.decode(bad, THRESHOLDS[0])
    off = enc.sparse_offsets.clone()
    off[-1] += 10
    with pytest.raises(CorruptDataError, match="len"):
        codec.decode(EncodedBatch(**{**enc.__dict__, "sparse_offsets": off}), THRESHOLDS[0])


# ---------------------------------------------------------------------------------------------------------------
# Storage-comparison formats (oakenkv.bench.formats)
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("d", [7, 192, 200, 640])
def test_pure_formats_decode_like_the_fused_format(d):
    from oakenkv.bench import formats

    cfg = OakenConfig()
    thr = THRESHOLDS[0]
    x = torch.randn(70, d, generator=torch.Generator().manual_seed(d)) * 1.3
    q = quantize(x, thr, cfg)
    deq = dequantize(q, thr, cfg)
    want = cpu.decode_batch(codec.pack(q, cfg), thr, cfg, torch.float16)
    pdn = formats.pack_pure_dense(q)
    got = formats.decode_pure_dense(pdn, thr, cfg, torch.empty(70, d, dtype=torch.float16))
    assert torch.equal(got, want)
    psp = formats.pack_pure_sparse(q, deq)
    got = formats.decode_pure_sparse(psp, thr, cfg, torch.empty(70, d, dtype=torch.float16))
    assert torch.equal(got, want)
    # accounting: 5-bit slots + 2-bit map; 4-bit dense + 24 stored (23 counted) bits per outlier (+ markers)
    outliers = int((q.groups != 0).sum())
    assert pdn.bits()["slots"] == pytest.approx(8 * 5 * -(-d // 8) / d)
    assert psp.num_outliers == outliers
    assert psp.bits()["bits_paper"] == pytest.approx(
        8 * ((d + 1) // 2) / d + 23 * outliers / x.numel() + 96 / d + 16 / d
    )
    assert psp.records.shape[0] >= outliers
    if d == 192:  # they store six per-row scales: a static-grid config is refused, never compared unlike for like
        static = cfg.replace(static_grids=True)
        for decode_pure, packed in ((formats.decode_pure_dense, pdn), (formats.decode_pure_sparse, psp)):
            with pytest.raises(NotImplementedError, match="static middle/inner grids"):
                decode_pure(packed, thr, static, torch.empty(70, d, dtype=torch.float16))


@numba.njit  # not cached (see _decode_all_via_row_helper)
def _grids(lo, hi, n, out):
    for r in range(lo.shape[0]):
        has_lo, has_hi = lo[r] > 0, hi[r] > 0
        out[r, 0], out[r, 1] = cpu._signed_grid(lo[r], lo[r], has_lo, hi[r], hi[r], has_hi, n, True)


@pytest.mark.parametrize("bits", [4, 5])
def test_signed_grid_two_candidates_equal_the_full_scan(bits):
    # The kernel evaluates the zero slot k only on both sides of the continuous optimum (and scans only on the
    # FLOOR); quant._signed_grid scans all k. Rows [-L, U] with magnitudes over 30 decades, ties on the FLOOR,
    # optima on an integer k (ties between neighbouring k), one side empty (0).
    from oakenkv.quant.quantizer import _signed_grid

    g = np.random.default_rng(bits)
    m = 20000
    lo = (10.0 ** g.uniform(-9, 4, m)).astype(np.float32)
    hi = (10.0 ** g.uniform(-9, 4, m)).astype(np.float32)
    hi[: m // 10] = lo[: m // 10] * g.integers(1, 40, m // 10)  # exact ratios: ties between neighbouring k
    k = g.integers(0, 2**bits - 1, m // 10)  # kc = n L / (L + U) - 1 = k (up to rounding)
    sl = slice(3 * m // 10, 4 * m // 10)
    hi[sl] = (lo[sl].astype(np.float64) * (2**bits - 1 - k) / (k + 1)).astype(np.float32)
    # exact ties of step(k) = L / (k + 1) and step(k + 1) = U / (n - 2 - k) = c (a power of two): the first wins
    c = 2.0 ** g.integers(-12, 8, m // 10)
    sl = slice(4 * m // 10, 5 * m // 10)
    lo[sl], hi[sl] = (k + 1) * c, (2**bits - 2 - k) * c
    lo[m // 10 : m // 5] = 0  # upper side only
    hi[m // 5 : 3 * m // 10] = 0  # lower side only
    s = torch.from_numpy(np.stack([-lo, hi], axis=1))
    member = s != 0
    want_min, want_max = _signed_grid(s, member, bits, torch.float16)
    got = np.empty((m, 2), np.float32)
    _grids(lo, hi, 2**bits, got)
    assert np.array_equal(got[:, 0], want_min.numpy()) and np.array_equal(got[:, 1], want_max.numpy())


def test_numba_threads_leave_torchs_thread_count_alone():
    """numba's first parallel launch set the process's OpenMP thread count (torch's) to numba's: torch's sums then
    changed with it (oakenkv.kernels.cpu._launch_threads_keeping_torch)."""
    code = textwrap.dedent(
        """
        import torch
        from oakenkv.calibrate.thresholds import GroupThresholds
        from oakenkv.format.config import OakenConfig
        from oakenkv.kernels.codec import decode, encode
        import numba
        thr, cfg = GroupThresholds(-2.0, -0.1, 0.1, 2.0), OakenConfig()
        decode(encode(torch.randn(64, 64), thr, cfg), thr, cfg)
        print(torch.get_num_threads(), numba.get_num_threads())
        """
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["1", "2"]


def test_record_decoder_refuses_records_of_the_other_scale_layout():
    """decode_records: records of the outer scales alone (static grids) need the static grid, records of six scales
    take none; either mismatch is ERR_SHAPE for every row, never a misread."""
    from oakenkv.format.layout import ERR_SHAPE

    thr = np.asarray(THRESHOLDS[0], np.float32)
    x = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
    thr_rows = np.repeat(thr[None], 3, axis=0)
    for static_grids in (False, True):
        cfg = OakenConfig(static_grids=static_grids)
        sb, ib, ob = scale_bytes(cfg), cfg.inner_bits, cfg.outer_bits
        records = np.empty((3, record_size(64, cfg)), np.uint8)
        sparse = np.empty((3, sparse_capacity(64)), np.uint8)
        counts = np.empty(3, np.int64)
        static = np.repeat(cpu.static_grid_array(thr, OakenConfig(static_grids=True))[None], 3, axis=0)
        cpu.encode_records(
            x.copy(), thr_rows, ib, ob, True, sb, records, sparse, counts, 4, static if static_grids else None
        )
        assert (counts >= 0).all()
        out, status = np.empty((3, 64), np.float32), np.zeros(3, np.int64)
        wrong = None if static_grids else static  # the other layout's argument
        cpu.decode_records(records, sparse, counts, thr_rows, ib, ob, True, sb, out, status, 4, wrong)
        assert (status == ERR_SHAPE).all()
        cpu.decode_records(
            records, sparse, counts, thr_rows, ib, ob, True, sb, out, status, 4, static if static_grids else None
        )
        assert (status == 0).all()
        assert np.array_equal(
            out, codec.decode(codec.encode(torch.from_numpy(x), THRESHOLDS[0], cfg), THRESHOLDS[0], cfg).numpy()
        )


def test_record_decoder_reads_level_bytes_and_refuses_corrupt_ones():
    """decode_records of static-level records (two scales and a level byte): the levels' grids needed, an index
    beyond them ERR_LEVEL for its row alone (fuzzed over every byte value), the one-grid argument ERR_SHAPE; the
    batch decoder refuses a corrupt level (CorruptDataError) before reading."""
    from oakenkv.format.layout import ERR_LEVEL, ERR_SHAPE, ERROR_MESSAGES

    cfg = OakenConfig(static_grids=True, static_levels=DEFAULT_STATIC_LEVELS)
    thr = np.asarray(THRESHOLDS[0], np.float32)
    g = np.random.default_rng(1)
    x = (g.standard_normal((6, 64)) * g.uniform(0.05, 1.5, (6, 1)) * thr[3]).astype(np.float32)
    n = x.shape[0]
    thr_rows = np.repeat(thr[None], n, axis=0)
    sb, ib, ob = scale_bytes(cfg), cfg.inner_bits, cfg.outer_bits
    records = np.empty((n, record_size(64, cfg)), np.uint8)
    sparse = np.empty((n, sparse_capacity(64)), np.uint8)
    counts = np.empty(n, np.int64)
    static = _static_rows(THRESHOLDS[0], cfg, n)
    assert static.shape == (n, 16)
    cpu.encode_records(x.copy(), thr_rows, ib, ob, True, sb, records, sparse, counts, 4, static, _levels(cfg))
    enc = codec.encode(torch.from_numpy(x), THRESHOLDS[0], cfg)
    assert len(set(enc.level.tolist())) > 1 and np.array_equal(records[:, 4], enc.level.numpy())
    want = codec.decode(enc, THRESHOLDS[0], cfg).numpy()
    out, status = np.empty((n, 64), np.float32), np.ones(n, np.int64)
    cpu.decode_records(records, sparse, counts, thr_rows, ib, ob, True, sb, out, status, 4, static)
    assert (status == 0).all() and np.array_equal(out, want)
    one = _static_rows(THRESHOLDS[0], cfg.replace(static_levels=()), n)  # one grid: the other layout
    cpu.decode_records(records, sparse, counts, thr_rows, ib, ob, True, sb, out, status, 4, one)
    assert (status == ERR_SHAPE).all()
    for byte in range(256):
        bad = records.copy()
        bad[2, 4] = byte
        cpu.decode_records(bad, sparse, counts, thr_rows, ib, ob, True, sb, out, status, 4, static)
        if byte >= len(DEFAULT_STATIC_LEVELS):
            assert status[2] == ERR_LEVEL and (np.delete(status, 2) == 0).all()
        else:
            assert (status == 0).all()
    assert "static level" in ERROR_MESSAGES[ERR_LEVEL]
    hit = codec.EncodedBatch(**{**enc.__dict__, "level": enc.level.clone()})
    hit.level[1] = 4
    with pytest.raises(codec.CorruptDataError, match=r"row 1: .*static level index"):
        codec.decode(hit, THRESHOLDS[0], cfg)
    moved = codec.EncodedBatch(**{**enc.__dict__, "level": (enc.level + 1) % 4})  # another level than its scales
    with pytest.raises(codec.CorruptDataError, match="static grid"):
        codec.decode(moved, THRESHOLDS[0], cfg)
