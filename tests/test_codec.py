"""Tests of the fused dense-and-sparse format's reference pack/unpack (oakenkv.kernels.codec)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oakenkv.format.config import OakenConfig
from oakenkv.kernels import codec
from oakenkv.kernels.codec import CorruptDataError, EncodedBatch
from oakenkv.quant.quantizer import GROUP_INNER, GROUP_MIDDLE, GROUP_OUTER, QuantizedVectors, dequantize, quantize

THR = (-2.0, -0.15, 0.15, 2.0)


def _qv(codes, groups, n=None):
    """QuantizedVectors from lists, with arbitrary distinct fp16 scales."""
    codes = torch.tensor(codes, dtype=torch.uint8).reshape(n or 1, -1)
    groups = torch.tensor(groups, dtype=torch.uint8).reshape(codes.shape)
    rows = codes.shape[0]
    mins = torch.tensor([[-1.0, -0.1, -3.0]] * rows, dtype=torch.float16)
    maxs = torch.tensor([[1.0, 0.1, 3.0]] * rows, dtype=torch.float16)
    return QuantizedVectors(codes=codes, groups=groups, mins=mins, maxs=maxs)


def _sparse_qv(d, outliers):
    """One row of width d, all middle code 0 except ``outliers``: {position: (group, code)}."""
    codes, groups = [0] * d, [GROUP_MIDDLE] * d
    for pos, (g, c) in outliers.items():
        codes[pos], groups[pos] = c, g
    return _qv(codes, groups)


def _assert_same_q(a: QuantizedVectors, b: QuantizedVectors):
    assert torch.equal(a.codes, b.codes)
    assert torch.equal(a.groups, b.groups)
    assert torch.equal(a.mins, b.mins) and a.mins.dtype == b.mins.dtype
    assert torch.equal(a.maxs, b.maxs) and a.maxs.dtype == b.maxs.dtype


def test_layout_constants():
    # The byte layout, asserted like ggml's static_asserts.
    assert codec.CHUNK_SIZE == 64 and codec.COO_INDEX_MASK == 0x3F
    assert codec.COO_GROUP_BIT == 0x40 and codec.COO_CODE_BIT4 == 0x80
    assert codec.NUM_SCALES == 6 and codec.HEADER_BITS == 16
    assert codec.SCALE_NAMES == ("mid_min", "mid_max", "inner_min", "inner_max", "outer_min", "outer_max")
    assert [codec.dense_bytes(d) for d in (1, 2, 63, 64, 80, 96, 192, 4096)] == [1, 1, 32, 32, 40, 48, 96, 2048]
    assert [codec.num_chunks(d) for d in (1, 64, 65, 80, 192, 4096)] == [1, 1, 2, 2, 3, 64]


@pytest.mark.parametrize("d", [1, 7, 64, 80, 96, 128, 192, 256, 320])
def test_sizes_of_packed_rows(d):
    torch.manual_seed(d)
    x = torch.randn(5, d)
    enc = codec.pack(quantize(x, THR))
    assert enc.dense.shape == (5, (d + 1) // 2) and enc.dense.dtype == torch.uint8
    assert enc.scales.shape == (5, 6) and enc.scales.dtype == torch.float16
    assert enc.sparse_offsets.shape == (6,) and enc.sparse_offsets.dtype == torch.int64
    assert enc.sparse.dtype == torch.uint8 and int(enc.sparse_offsets[-1]) == enc.sparse.numel()
    assert enc.nbytes() == 5 * ((d + 1) // 2 + 12 + 2) + enc.sparse.numel()


def test_nibble_order_low_first_and_odd_padding():
    enc = codec.pack(_qv([1, 2, 3], [0, 0, 0]))
    assert enc.dense.tolist() == [[0x21, 0x03]]


def test_scales_order():
    q = _qv([0, 0], [0, 0])
    q.mins = torch.tensor([[1.0, 3.0, 5.0]], dtype=torch.float16)
    q.maxs = torch.tensor([[2.0, 4.0, 6.0]], dtype=torch.float16)
    assert codec.pack(q).scales.tolist() == [[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]]


def test_coo_example_from_format_doc():
    # docs/format.md: inner code 19 at 5, outer code 4 at 70, outer code 1 at 130 (D = 192).
    q = _sparse_qv(192, {5: (GROUP_INNER, 19), 70: (GROUP_OUTER, 4), 130: (GROUP_OUTER, 1)})
    enc = codec.pack(q)
    assert enc.sparse.tolist() == [0x85, 0x85, 0x01, 0x46, 0x42]
    assert enc.dense[0, 2] == 0x03 << 4  # value 5: high nibble of byte 2 = low 4 bits of 19
    _assert_same_q(codec.unpack(enc), q)


@pytest.mark.parametrize(
    ("outliers", "stream"),
    [
        # natural advance: index 1 <= 60 moves to chunk 1
        ({60: (GROUP_INNER, 0), 65: (GROUP_INNER, 0)}, [60, 1]),
        # same byte as the previous entry one chunk later: escape
        ({5: (GROUP_OUTER, 0), 69: (GROUP_OUTER, 0)}, [0x45, 0x45, 1, 0x45]),
        # first entry is the byte 0x00 (= the virtual previous byte): escape with advance 0
        ({0: (GROUP_INNER, 0)}, [0x00, 0x00, 0x00]),
        # first entry in chunk 2: escape with advance 2 from the virtual 0x00
        ({130: (GROUP_INNER, 3)}, [0x00, 2, 2]),
        # an empty chunk in between: escape
        ({10: (GROUP_INNER, 0), 140: (GROUP_INNER, 0)}, [10, 10, 2, 12]),
        # no outliers: empty stream
        ({}, []),
    ],
)
def test_coo_streams(outliers, stream):
    q = _sparse_qv(192, outliers)
    enc = codec.pack(q)
    assert enc.sparse.tolist() == stream
    _assert_same_q(codec.unpack(enc), q)


def test_all_outlier_chunk_is_64_increasing_indices():
    q = _sparse_qv(128, {64 + i: (GROUP_OUTER, 16 + i % 16) for i in range(64)})
    enc = codec.pack(q)
    # escape to chunk 1 from the virtual 0x00, then 64 entries with no further escapes
    assert enc.sparse.tolist()[:2] == [0x00, 1]
    assert enc.sparse.numel() == 2 + 64
    _assert_same_q(codec.unpack(enc), q)


def test_every_value_an_outlier_with_odd_width():
    d = 97
    q = _sparse_qv(d, {i: (GROUP_INNER if i % 3 else GROUP_OUTER, i % 32) for i in range(d)})
    enc = codec.pack(q)
    assert enc.sparse.numel() <= d + 2 * codec.num_chunks(d)
    _assert_same_q(codec.unpack(enc), q)


def test_long_advance_chains_ff_bytes():
    # D = 32768 (512 chunks): one outlier in the last chunk needs an advance of 511 = 255 + 255 + 1.
    d = codec.MAX_DIM
    q = _sparse_qv(d, {d - 1: (GROUP_INNER, 1)})
    enc = codec.pack(q)
    assert enc.sparse.tolist() == [0x00, 0xFF, 0xFF, 1, 63]
    _assert_same_q(codec.unpack(enc), q)


@pytest.mark.parametrize("d", [64, 80, 96, 128, 192, 256, 320, 33])
@pytest.mark.parametrize("scale_dtype", ["float16", "float32"])
def test_round_trip_of_quantized_rows(d, scale_dtype):
    cfg = OakenConfig(scale_dtype=scale_dtype)
    torch.manual_seed(1000 + d)
    x = torch.randn(16, d) * torch.rand(16, 1) * 3
    x[0] = 0.0  # constant row: only the inner group is non-empty
    q = quantize(x, THR, cfg)
    enc = codec.pack(q, cfg)
    q2 = codec.unpack(enc, cfg)
    _assert_same_q(q, q2)
    assert torch.equal(dequantize(q2, THR, cfg), dequantize(q, THR, cfg))


def test_four_bit_outlier_groups_round_trip():
    cfg = OakenConfig(inner_bits=4, outer_bits=4)
    x = torch.randn(8, 128, generator=torch.Generator().manual_seed(3)) * 2
    q = quantize(x, THR, cfg)
    enc = codec.pack(q, cfg)
    assert not bool((enc.sparse & 0x80).any())  # no fifth bits
    _assert_same_q(codec.unpack(enc, cfg), q)


def test_pack_rejects_codes_that_do_not_fit():
    with pytest.raises(ValueError, match="does not fit"):
        codec.pack(_qv([16, 0], [GROUP_MIDDLE, GROUP_MIDDLE]))
    with pytest.raises(ValueError, match="uint8"):
        q = _qv([1, 0], [0, 0])
        q.codes = q.codes.to(torch.int32)
        codec.pack(q)


def test_effective_bits_counts_the_bytes():
    torch.manual_seed(7)
    x = torch.randn(32, 4096)
    # thresholds at the 2/98% and 47/53% quantiles: ~10% outliers, as the paper's 4/90/6 split
    qs = torch.quantile(x.flatten()[:100000], torch.tensor([0.02, 0.47, 0.53, 0.98])).tolist()
    enc = codec.pack(quantize(x, qs))
    b = codec.effective_bits(enc)
    assert b.total == pytest.approx(enc.nbytes() * 8 / x.numel())
    assert b.dense == 4.0 and b.scales == pytest.approx(96 / 4096) and b.header == pytest.approx(16 / 4096)
    assert b.num_entries == int((quantize(x, qs).groups != GROUP_MIDDLE).sum())
    assert b.sparse == pytest.approx(8 * (b.num_entries + b.num_escape_bytes) / x.numel())
    assert 0.09 < b.num_entries / x.numel() < 0.11
    assert b.total < 4.84


# ---------------------------------------------------------------------------------------------------------------
# Other dense slot widths (OakenConfig.middle_bits 2, 3 and 5..7)
# ---------------------------------------------------------------------------------------------------------------


def test_slot_sizes():
    assert [codec.dense_bytes(d, 3) for d in (1, 2, 3, 8, 9, 64, 192, 4096)] == [1, 1, 2, 3, 4, 24, 72, 1536]
    assert [codec.dense_bytes(d, 2) for d in (1, 4, 5, 64, 192, 4096)] == [1, 1, 2, 16, 48, 1024]
    assert [codec.dense_bytes(d, 4) for d in (1, 2, 192)] == [codec.dense_bytes(d) for d in (1, 2, 192)]
    # 192 values, 10% outliers, fp16 scales: b + 0.8 + 112 / 192 bits per value
    assert [codec.dense_bytes(d, 6) for d in (1, 4, 5, 64, 192)] == [1, 3, 4, 48, 144]
    for b in (4, 3, 2, 5, 6, 7):
        assert codec.expected_bits(192, 0.1, bits=b) == pytest.approx(b + 0.8 + 112 / 192)


def test_three_bit_slots_are_a_little_endian_bit_stream():
    # codes v0..v8 = 1, 2, 3, 4, 5, 6, 7, 0, 5 (format/layout.py's b = 3 diagram, bits listed high to low):
    cfg = OakenConfig(middle_bits=3)
    enc = codec.pack(_qv([1, 2, 3, 4, 5, 6, 7, 0, 5], [0] * 9), cfg)
    byte0 = 0b11_010_001  # v2[1:0] = 11 | v1 = 010 | v0 = 001
    byte1 = 0b0_101_100_0  # v5[0] = 0 | v4 = 101 | v3 = 100 | v2[2] = 0
    byte2 = 0b000_111_11  # v7 = 000 | v6 = 111 | v5[2:1] = 11
    byte3 = 0b00000_101  # padding | v8 = 101
    assert enc.dense.tolist() == [[byte0, byte1, byte2, byte3]]
    _assert_same_q(codec.unpack(enc, cfg), _qv([1, 2, 3, 4, 5, 6, 7, 0, 5], [0] * 9))


def test_two_bit_slots_and_the_code_bit_of_narrow_outliers():
    cfg = OakenConfig(middle_bits=2)
    # an inner value with the 3-bit code 6 (slot 0b10, code bit 1) at 1, an outer 0b011 at 4
    q = _qv([1, 6, 3, 0, 3, 2], [GROUP_MIDDLE, GROUP_INNER, GROUP_MIDDLE, GROUP_MIDDLE, GROUP_OUTER, GROUP_MIDDLE])
    enc = codec.pack(q, cfg)
    assert enc.dense.tolist() == [[0b00_11_10_01, 0b10_11]]
    assert enc.sparse.tolist() == [0x80 | 1, 0x40 | 4]  # the code bit (bit 2 of the code) in bit 7
    _assert_same_q(codec.unpack(enc, cfg), q)
    with pytest.raises(ValueError, match="does not fit"):  # a middle code of 3 bits in a 2-bit slot
        codec.pack(_qv([4], [GROUP_MIDDLE]), cfg)


def test_seven_bit_slots_and_the_eighth_code_bit_of_their_outliers():
    # 7-bit slots: value j's slot at stream bits 7j..; an outlier's 8-bit code keeps its bit 7 in the entry's bit 7
    cfg = OakenConfig(middle_bits=7)
    q = _qv([0x7F, 0xFF, 0x01, 0x80], [GROUP_MIDDLE, GROUP_OUTER, GROUP_MIDDLE, GROUP_INNER])
    enc = codec.pack(q, cfg)
    stream = 0x7F | (0x7F << 7) | (0x01 << 14) | (0x00 << 21)  # the slots: the codes' low 7 bits
    assert enc.dense.tolist() == [[(stream >> (8 * i)) & 0xFF for i in range(4)]]
    assert enc.sparse.tolist() == [0x80 | 0x40 | 1, 0x80 | 3]
    _assert_same_q(codec.unpack(enc, cfg), q)
    x = torch.randn(3, 70, generator=torch.Generator().manual_seed(7)) * 2
    got = codec.decode(codec.encode(x, THR, cfg), THR, cfg)
    assert torch.equal(got, codec.decode(codec.pack(quantize(x, THR, cfg), cfg), THR, cfg))


@pytest.mark.parametrize("mb", [3, 2, 5, 6, 7])
@pytest.mark.parametrize("d", [1, 5, 64, 80, 192, 257])
def test_other_slot_widths_round_trip(mb, d):
    for ib, ob in ((mb + 1, mb + 1), (mb, mb + 1), (mb, mb)):
        cfg = OakenConfig(middle_bits=mb, inner_bits=ib, outer_bits=ob)
        x = torch.randn(6, d, generator=torch.Generator().manual_seed(d)) * 2
        q = quantize(x, THR, cfg)
        assert int(q.codes.max()) < 2 ** max(mb, ib, ob)
        enc = codec.pack(q, cfg)
        assert enc.dense.shape == (6, codec.dense_bytes(d, mb))
        if ib == ob == mb:
            assert not bool((enc.sparse & 0x80).any())  # no code bits
        _assert_same_q(codec.unpack(enc, cfg), q)


def test_narrow_slots_refuse_padding_and_code_bits_they_cannot_hold():
    cfg = OakenConfig(middle_bits=3, inner_bits=3)
    enc = codec.pack(_qv([1, 2, 3], [0, 0, 0]), cfg)  # 9 stream bits: 7 padding bits in byte 1
    enc.dense[0, 1] |= 0x80
    with pytest.raises(CorruptDataError, match="padding"):
        codec.unpack(enc, cfg)
    with pytest.raises(CorruptDataError, match="top code bit"):
        codec.unpack(_enc_with_stream([0x85], cfg=cfg), cfg)
    # 4-bit bytes read as 3-bit ones have the wrong size
    with pytest.raises(CorruptDataError, match="3-bit slots"):
        codec.unpack(codec.pack(_qv([1] * 64, [0] * 64)), cfg)


# ---------------------------------------------------------------------------------------------------------------
# Corrupt input
# ---------------------------------------------------------------------------------------------------------------


def _enc_with_stream(stream, d=192, cfg=None):
    enc = codec.pack(_sparse_qv(d, {}), cfg)
    enc.sparse = torch.tensor(stream, dtype=torch.uint8)
    enc.sparse_offsets = torch.tensor([0, len(stream)], dtype=torch.int64)
    return enc


@pytest.mark.parametrize(
    ("stream", "match"),
    [
        ([0x85, 0x85], "cut off"),  # escape without its advance
        ([0x85, 0x85, 0xFF], "cut off"),  # advance continues past the end
        ([0x85, 0x85, 0x01], "not followed by an entry"),
        ([0x05, 0x05, 0x00, 0x06], "zero chunk advance"),
        ([0x00, 0x03, 0x01], "points at value"),  # advance to chunk 3 of a 3-chunk row
        ([0x3F, 0x01, 0x00, 0x3F, 0x01], "points at value"),  # natural advances past the last chunk
    ],
)
def test_unpack_rejects_corrupt_streams(stream, match):
    with pytest.raises(CorruptDataError, match=match):
        codec.unpack(_enc_with_stream(stream))


def test_unpack_rejects_fifth_bit_of_four_bit_group():
    cfg = OakenConfig(inner_bits=4)
    with pytest.raises(CorruptDataError, match="fifth code bit"):
        codec.unpack(_enc_with_stream([0x85], cfg=cfg), cfg)


def test_unpack_rejects_bad_structure():
    enc = codec.pack(quantize(torch.randn(3, 64), THR))

    def mutated(**kw):
        return EncodedBatch(**{**enc.__dict__, **kw})

    with pytest.raises(CorruptDataError, match="dense"):
        codec.unpack(mutated(dense=enc.dense[:, :-1]))
    with pytest.raises(CorruptDataError, match="scales"):
        codec.unpack(mutated(scales=enc.scales.float()))
    with pytest.raises(CorruptDataError, match="NaN"):
        codec.unpack(mutated(scales=torch.full_like(enc.scales, float("nan"))))
    with pytest.raises(CorruptDataError, match="end at len"):
        codec.unpack(mutated(sparse=enc.sparse[:-1]))
    with pytest.raises(CorruptDataError, match="non-decreasing"):
        off = enc.sparse_offsets.clone()
        off[1] = off[2] + 1
        codec.unpack(mutated(sparse_offsets=off, sparse=torch.zeros(int(off[-1]), dtype=torch.uint8)))
    with pytest.raises(CorruptDataError, match="row width"):
        codec.unpack(mutated(dim=0))


def test_codec_benchmark_reports_the_required_keys(tmp_path):
    from oakenkv.bench.codec import run_codec_bench

    out = tmp_path / "bench.json"
    r = run_codec_bench(shapes=(("tiny", 128, 256),), reps=1, quanto=False, real_kv=False, json_out=out)
    for k in ("encode_gbps", "decode_gbps", "memcpy_gbps", "effective_bits"):
        assert k in r
    assert r["encode_gbps"] > 0 and r["decode_gbps"] > 0 and r["memcpy_gbps"] > 0
    assert {"total", "dense", "sparse", "scales", "header"} <= set(r["effective_bits"])
    assert out.exists() and '"encode_gbps"' in out.read_text()


# ---------------------------------------------------------------------------------------------------------------
# Static grids (OakenConfig.static_grids, issue #36): the outer scales alone are stored
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale_dtype", ["float16", "float32"])
@pytest.mark.parametrize("mb", [2, 4, 7])
def test_static_grid_rows_store_two_scales_and_read_back(scale_dtype, mb):
    from oakenkv.format.layout import from_records, record_size, scale_bytes, static_columns, to_records
    from oakenkv.quant.quantizer import format_static_grid, static_grid

    cfg = OakenConfig(middle_bits=mb, scale_dtype=scale_dtype, static_grids=True)
    per_row = cfg.replace(static_grids=False)
    torch.manual_seed(3)
    x = torch.randn(9, 192) * 0.8
    q = quantize(x, THR, cfg)
    mins, maxs = static_grid(THR, cfg)
    grid = format_static_grid(THR, cfg)
    assert grid == (float(mins[0]), float(maxs[0]), float(mins[1]), float(maxs[1]))
    assert (q.mins[:, :2] == mins[:2]).all() and (q.maxs[:, :2] == maxs[:2]).all()  # every row, member or not
    enc = codec.pack(q, cfg, THR)
    assert enc.stored_scales == 2 and enc.scales.shape == (9, 6)
    # the stored form: 2 scales per row, 4 * itemsize bytes fewer than the per-row format's
    item = cfg.scale_itemsize
    assert scale_bytes(cfg) == 2 * item and record_size(192, cfg) == record_size(192, per_row) - 4 * item
    assert enc.nbytes() == enc.dense.numel() + enc.sparse.numel() + 9 * (2 * item + 2)
    b = codec.effective_bits(enc)
    assert b.scales == pytest.approx(2 * 8 * item / 192) and b.total == pytest.approx(8 * enc.nbytes() / x.numel())
    dense, sparse, offs = to_records(enc)
    assert dense.shape == (9, record_size(192, cfg))
    assert np.array_equal(dense[:, : 2 * item].copy().view(cfg.scale_np_dtype), enc.scales[:, 4:].numpy())
    back = from_records(dense, sparse, offs, 192, cfg, static=grid)
    for name in ("dense", "scales", "sparse", "sparse_offsets"):
        assert torch.equal(getattr(back, name), getattr(enc, name))
    assert back.stored_scales == 2
    _assert_same_q(codec.unpack(back, cfg, THR), q)
    assert torch.equal(codec.decode(back, THR, cfg), dequantize(q, THR, cfg))
    assert np.array_equal(static_columns(grid, cfg).astype(np.float64), np.asarray(grid))
    with pytest.raises(ValueError, match="needs the layer's static grid"):
        from_records(dense, sparse, offs, 192, cfg)
    with pytest.raises(ValueError, match="takes none otherwise"):
        from_records(dense, sparse, offs, 192, per_row, static=grid)
    with pytest.raises(ValueError, match="4 numbers"):
        from_records(dense, sparse, offs, 192, cfg, static=grid[:3])
    with pytest.raises(CorruptDataError, match=r"must be .* bytes"):  # static records read as per-row ones
        from_records(dense, sparse, offs, 192, per_row)


def test_static_grid_batches_are_checked_against_their_thresholds_and_config():
    cfg = OakenConfig(static_grids=True)
    torch.manual_seed(4)
    x = torch.randn(4, 128)
    q = quantize(x, THR, cfg)
    with pytest.raises(ValueError, match="needs the thresholds"):
        codec.pack(q, cfg)
    moved = (-2.5, -0.15, 0.15, 2.0)  # another layer's thresholds: another static grid
    with pytest.raises(ValueError, match="not the static grid"):
        codec.pack(q, cfg, moved)
    with pytest.raises(ValueError, match="static_scales simulates"):
        quantize(x, THR, cfg, static_scales=1.0)
    enc = codec.encode(x, THR, cfg)
    _assert_same_q(codec.unpack(enc, cfg, THR), q)
    for bad in (codec.unpack, codec.decode):  # a corrupt static column, or the wrong layer's thresholds
        with pytest.raises(CorruptDataError, match="static grid"):
            bad(enc, moved, cfg) if bad is codec.decode else bad(enc, cfg, moved)
    hit = EncodedBatch(**{**enc.__dict__, "scales": enc.scales.clone()})
    hit.scales[2, 3] = hit.scales[2, 3] * 2 + 1
    for bad in (lambda e: codec.unpack(e, cfg, THR), lambda e: codec.decode(e, THR, cfg)):
        with pytest.raises(CorruptDataError, match=r"row 2: .*static grid"):
            bad(hit)
    # a static batch read with a per-row config, and the other way round: refused, never misread
    with pytest.raises(CorruptDataError, match="stores 2 scales per row, its config 6"):
        codec.decode(enc, THR, OakenConfig())
    with pytest.raises(CorruptDataError, match="stores 6 scales per row, its config 2"):
        codec.decode(codec.encode(x, THR), THR, cfg)


def test_static_grids_bits_formulas():
    from oakenkv.format.layout import format_bits, stored_scales

    cfg = OakenConfig(static_grids=True)
    assert stored_scales(cfg) == 2 and stored_scales(OakenConfig()) == 6
    # 192 values, fp16 scales: 64 bits per row fewer, 1/3 bit per value
    full = codec.expected_bits(192, 0.1)
    assert codec.expected_bits(192, 0.1, num_scales=2) == pytest.approx(full - 64 / 192)
    assert format_bits(10, 192, 50) - format_bits(10, 192, 50, num_scales=2) == 10 * 64


# ---------------------------------------------------------------------------------------------------------------
# Static levels (OakenConfig.static_levels): the outer scales and a level byte are stored
# ---------------------------------------------------------------------------------------------------------------

LEVELS = (0.5, 0.7, 0.85, 1.0)


def _level_rows(n=12, d=192, seed=5):
    """Rows whose middle values reach different shares of the static range (so that every level is taken)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g) * 0.1
    x[:, :4] = torch.linspace(0.3, 1.95, n)[:, None] * torch.tensor([1.0, -1.0, 0.5, -0.5])  # middle reach
    x[:, 4:6] = torch.tensor([2.5, -3.0])  # outer values
    return x


@pytest.mark.parametrize("scale_dtype", ["float16", "float32"])
@pytest.mark.parametrize("mb", [2, 4, 7])
def test_static_level_rows_store_a_level_byte_and_read_back(scale_dtype, mb):
    from oakenkv.format.layout import from_records, level_bits, level_columns, record_size, scale_bytes, to_records
    from oakenkv.quant import reference
    from oakenkv.quant.quantizer import format_level_grids

    cfg = OakenConfig(middle_bits=mb, scale_dtype=scale_dtype, static_grids=True, static_levels=LEVELS)
    one = cfg.replace(static_levels=())
    x = _level_rows()
    q = quantize(x, THR, cfg)
    assert set(q.level.tolist()) == {0, 1, 2, 3}
    enc = reference.pack(q, cfg, THR)
    assert enc.stored_scales == 2 and torch.equal(enc.level, q.level) and enc.scales.shape == (12, 6)
    item = cfg.scale_itemsize
    assert level_bits(cfg) == 8 and level_bits(one) == 0
    assert scale_bytes(cfg) == 2 * item + 1 and record_size(192, cfg) == record_size(192, one) + 1
    assert enc.stored_scale_bytes() == 2 * item + 1
    assert enc.nbytes() == enc.dense.numel() + enc.sparse.numel() + 12 * (2 * item + 1 + 2)
    b = codec.effective_bits(enc)
    assert b.scales == pytest.approx((2 * 8 * item + 8) / 192) and b.total == pytest.approx(
        8 * enc.nbytes() / x.numel()
    )
    dense, sparse, offs = to_records(enc)
    assert dense.shape == (12, record_size(192, cfg))
    assert np.array_equal(dense[:, : 2 * item].copy().view(cfg.scale_np_dtype), enc.scales[:, 4:].numpy())
    assert np.array_equal(dense[:, 2 * item], q.level.numpy())  # the level byte after the outer scales
    grids = format_level_grids(THR, cfg)
    back = from_records(dense, sparse, offs, 192, cfg, static=grids)
    for name in ("dense", "scales", "sparse", "sparse_offsets", "level"):
        assert torch.equal(getattr(back, name), getattr(enc, name)), name
    _assert_same_q(reference.unpack(back, cfg, THR), q)
    assert torch.equal(reference.unpack(back, cfg, THR).level, q.level)
    assert torch.equal(reference.decode(back, THR, cfg), dequantize(q, THR, cfg))
    assert level_columns(grids, cfg).shape == (4, 4)
    with pytest.raises(ValueError, match="4 x 4 numbers"):
        from_records(dense, sparse, offs, 192, cfg, static=grids[-1])  # one grid for a levels config
    with pytest.raises(ValueError, match="needs the layer's static grid"):
        from_records(dense, sparse, offs, 192, cfg)
    with pytest.raises(CorruptDataError, match=r"must be .* bytes"):  # level records read as one-grid ones
        from_records(dense, sparse, offs, 192, one, static=grids[-1])


def test_static_level_batches_are_checked():
    from oakenkv.quant import reference

    cfg = OakenConfig(static_grids=True, static_levels=LEVELS)
    x = _level_rows(6, 128)
    q = quantize(x, THR, cfg)
    with pytest.raises(ValueError, match="needs the thresholds"):
        reference.pack(q, cfg)
    with pytest.raises(ValueError, match=r"needs q\.level"):
        reference.pack(QuantizedVectors(q.codes, q.groups, q.mins, q.maxs), cfg, THR)
    with pytest.raises(ValueError, match="its config no static levels"):
        reference.pack(q, cfg.replace(static_levels=()), THR)
    moved = QuantizedVectors(q.codes, q.groups, q.mins, q.maxs, (q.level + 1) % 4)  # another level's grid
    with pytest.raises(ValueError, match="not the static grid"):
        reference.pack(moved, cfg, THR)
    enc = reference.pack(q, cfg, THR)
    # a level byte that points at another valid level: its grid is not the row's scales (in memory)
    wrong = EncodedBatch(**{**enc.__dict__, "level": (enc.level + 1) % 4})
    with pytest.raises(CorruptDataError, match="static grid"):
        reference.unpack(wrong, cfg, THR)
    # an index beyond the levels: refused by the structural check, whatever reads it
    for bad in (4, 5, 255):
        hit = EncodedBatch(**{**enc.__dict__, "level": enc.level.clone()})
        hit.level[3] = bad
        for read in (lambda e: reference.unpack(e, cfg, THR), lambda e: codec.check_encoded(e, cfg)):
            with pytest.raises(CorruptDataError, match=r"row 3: .*static level index"):
                read(hit)
    for level, match in ((None, "uint8 \\[6\\]"), (enc.level.to(torch.int64), "uint8"), (enc.level[:5], "uint8")):
        with pytest.raises(CorruptDataError, match=match):
            codec.check_encoded(EncodedBatch(**{**enc.__dict__, "level": level}), cfg)
    with pytest.raises(CorruptDataError, match="no static levels"):
        codec.check_encoded(enc, cfg.replace(static_levels=()))


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_static_level_records_fuzz(data):
    """Random bytes in the level position of records: an index beyond the levels is refused (CorruptDataError),
    any other reads back as that level's grid, and nothing else is misread."""
    from oakenkv.format.layout import from_records, to_records
    from oakenkv.quant import reference
    from oakenkv.quant.quantizer import format_level_grids

    cfg = OakenConfig(static_grids=True, static_levels=LEVELS)
    x = _level_rows(5, 96, seed=data.draw(st.integers(0, 50)))
    enc = reference.encode(x, THR, cfg)
    dense, sparse, offs = to_records(enc)
    row = data.draw(st.integers(0, 4))
    byte = data.draw(st.integers(0, 255))
    dense = dense.copy()
    dense[row, 4] = byte
    grids = format_level_grids(THR, cfg)
    if byte >= len(LEVELS):
        with pytest.raises(CorruptDataError, match=f"record {row}: .*static level index"):
            from_records(dense, sparse, offs, 96, cfg, static=grids)
        return
    back = from_records(dense, sparse, offs, 96, cfg, static=grids)
    assert int(back.level[row]) == byte
    assert back.scales[row, :4].to(torch.float32).tolist() == list(grids[byte])
    y = reference.decode(back, THR, cfg)
    assert torch.isfinite(y).all()


def test_static_levels_bits_formulas():
    from oakenkv.format.layout import LEVEL_BITS, format_bits

    assert LEVEL_BITS == 8
    one = codec.expected_bits(192, 0.1, num_scales=2)
    assert codec.expected_bits(192, 0.1, num_scales=2, level=8) == pytest.approx(one + 8 / 192)
    assert format_bits(10, 192, 50, num_scales=2, level=8) - format_bits(10, 192, 50, num_scales=2) == 10 * 8
