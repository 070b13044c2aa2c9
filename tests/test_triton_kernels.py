"""The Triton kernels (oakenkv.kernels.triton) against the reference, on CPU tensors under the Triton interpreter.

Without a GPU the kernels run under ``TRITON_INTERPRET=1`` (numpy float32: the same IEEE operations a GPU runs
with ``div_rn`` and no FMA contraction); with one they run compiled on it. Skipped cleanly when triton is not
installed. Shapes are small: the interpreter runs each program in Python (about 0.05-0.2 s a program).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    # before triton is imported: @triton.jit reads it when the kernel modules are imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed (pip install 'oakenkv[triton]')")

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oakenkv.format.config import OakenConfig
from oakenkv.format.layout import CorruptDataError, EncodedBatch, record_size, scale_bytes, sparse_capacity
from oakenkv.kernels import codec
from oakenkv.kernels.triton import decode as tdecode
from oakenkv.kernels.triton import encode as tencode
from oakenkv.quant.quantizer import GROUP_INNER, GROUP_MIDDLE, GROUP_OUTER, dequantize, quantize

DEV = "cuda" if torch.cuda.is_available() else "cpu"
THR = (-2.0, -0.15, 0.15, 2.0)
THRESHOLDS = [
    THR,
    (-1.0, 0.0, 0.0, 1.0),  # degenerate inner interval: only exact zeros are inner
    (-0.5, -0.499, 3.0, 3.5),  # asymmetric
    (-300.0, -1.0, 1.0, 1000.0),  # outer group often empty
]


def _bits32(t: torch.Tensor) -> torch.Tensor:
    """float32 bit patterns with -0.0 folded into +0.0 (torch's min/max may return either zero)."""
    return (t.detach().cpu().to(torch.float32) + 0.0).view(torch.int32)


def _assert_same_bytes(got: EncodedBatch, ref: EncodedBatch) -> None:
    assert got.dim == ref.dim
    assert torch.equal(got.dense.cpu(), ref.dense)
    assert torch.equal(got.sparse_offsets.cpu(), ref.sparse_offsets)
    assert torch.equal(got.sparse.cpu(), ref.sparse)
    assert got.scales.dtype == ref.scales.dtype
    assert torch.equal(_bits32(got.scales), _bits32(ref.scales))


def _check_encode_and_decode(x: torch.Tensor, thr, cfg: OakenConfig) -> None:
    """Triton encode == pack(quantize(x)) byte for byte; Triton decode of the reference bytes == dequantize."""
    try:
        q = quantize(x, thr, cfg)
    except ValueError as e:  # fp16 scale overflow: the kernel must refuse the same input
        assert "fp16" in str(e)
        with pytest.raises(ValueError, match="fp16"):
            tencode.encode_batch(x.to(DEV), thr, cfg)
        return
    ref = codec.pack(q, cfg)
    _assert_same_bytes(tencode.encode_batch(x.to(DEV), thr, cfg), ref)
    want = dequantize(q, thr, cfg)
    got = tdecode.decode_batch(ref, thr, cfg, device=DEV)
    assert got.dtype == torch.float32 and tuple(got.shape) == tuple(x.shape)
    assert torch.equal(_bits32(got), _bits32(want))


def _sparse_row(d: int, outliers: dict[int, float], thr=THR) -> torch.Tensor:
    """One row of small middle values (0.5) with ``outliers`` {position: value} set."""
    x = torch.full((1, d), 0.5)
    for pos, v in outliers.items():
        x[0, pos] = v
    return x


# ----------------------------------------------------------------------------------------------------- encode


@pytest.mark.parametrize("d", [1, 7, 64, 65, 192, 200])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_encode_random_rows_bit_exact(d, dtype):
    g = torch.Generator().manual_seed(d)
    x = torch.randn(5, d, generator=g) * torch.tensor([[0.01], [1.0], [3.0], [1.0], [100.0]])
    x[3] = 0.0  # constant row: only the inner group
    _check_encode_and_decode(x.to(dtype), THR, OakenConfig())


@pytest.mark.parametrize(
    ("scale_dtype", "inner_bits", "outer_bits"), [("float32", 5, 5), ("float16", 4, 5), ("float32", 5, 4)]
)
@pytest.mark.parametrize("thr", THRESHOLDS)
def test_encode_configs_and_thresholds_bit_exact(scale_dtype, inner_bits, outer_bits, thr):
    cfg = OakenConfig(scale_dtype=scale_dtype, inner_bits=inner_bits, outer_bits=outer_bits)
    g = torch.Generator().manual_seed(int(abs(thr[3])) + inner_bits)
    x = torch.randn(4, 96, generator=g) * torch.tensor([[0.5], [2.0], [5.0], [200.0]])
    _check_encode_and_decode(x, thr, cfg)


def test_encode_values_on_and_next_to_the_thresholds():
    to_lo, ti_lo, ti_hi, to_hi = THR
    edge = [to_lo, ti_lo, ti_hi, to_hi, 0.0, -0.0, 1e-30, -1e-30]
    edge += [float(np.nextafter(np.float32(t), np.float32(s * 1e9))) for t, s in zip(THR, (-1, -1, 1, 1), strict=True)]
    g = np.random.default_rng(0)
    x = g.choice(np.array(edge, dtype=np.float32), size=(4, 80))
    x[1::2] = np.where(g.random((2, 80)) < 0.3, g.standard_normal((2, 80)), x[1::2])
    _check_encode_and_decode(torch.from_numpy(x.astype(np.float32)), THR, OakenConfig())


def test_encode_one_sided_groups():
    g = torch.Generator().manual_seed(1)
    x = torch.rand(4, 64, generator=g) * 0.1  # inner only ...
    x[0, :10] = 0.3 + torch.rand(10, generator=g)  # + middle above ti_hi only (plain grid)
    x[1, :10] = -0.3 - torch.rand(10, generator=g)  # + middle below ti_lo only
    x[2, :3] = 5.0 + torch.rand(3, generator=g)  # + outer above only
    x[3, :3] = -5.0 - torch.rand(3, generator=g)  # + outer below only
    _check_encode_and_decode(x, THR, OakenConfig())


@pytest.mark.parametrize(
    "outliers",
    [
        {},  # no outlier: empty stream
        {i: (3.0 if i % 3 else -4.0) for i in range(128)},  # every value an outlier
        {0: -0.15},  # the inner minimum at position 0: byte 0x00, escaped at the row start
        {5: 0.1, 70: 2.5, 130: 3.0},  # the example of docs/format.md: an escape to chunk 1
        {3: 5.0, 67: 5.0},  # the same byte one chunk later: escape
        {10: 0.05, 700: 0.05, 1023: -7.0},  # far apart: escapes over empty chunks
        {64 * c + 63: 9.0 for c in range(16)},  # index 63 in every chunk: natural advances only
    ],
)
def test_encode_adversarial_coo_streams(outliers):
    x = _sparse_row(1024, outliers)
    _check_encode_and_decode(x, THR, OakenConfig())
    if outliers == {0: -0.15}:
        assert codec.pack(quantize(x, THR)).sparse.tolist()[:3] == [0, 0, 0]


def test_encode_into_given_record_and_stream_offsets():
    """Records and streams written where the caller says (straight into pages), not only back to back."""
    cfg = OakenConfig()
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2)) * 2
    rec, cap = record_size(64, cfg), sparse_capacity(64)
    records = torch.zeros(1000, dtype=torch.uint8, device=DEV)
    sparse = torch.zeros(1000, dtype=torch.uint8, device=DEV)
    rec_at = torch.tensor([500, 0, 200], dtype=torch.int64, device=DEV)
    sp_at = torch.tensor([0, 700, 300], dtype=torch.int64, device=DEV)
    _, _, counts = tencode.encode_records(x.to(DEV), THR, cfg, records, rec_at, sparse, sp_at)
    want_rec, want_sp, want_counts = tencode.encode_records(x.to(DEV), THR, cfg)
    assert torch.equal(counts, want_counts) and int(counts.max()) < cap
    for r in range(3):
        a, s = int(rec_at[r]), int(sp_at[r])
        assert torch.equal(records[a : a + rec].cpu(), want_rec[r].cpu())
        assert torch.equal(sparse[s : s + int(counts[r])].cpu(), want_sp[r, : int(counts[r])].cpu())


def test_encode_per_row_thresholds():
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(3)) * 2
    thr = torch.tensor([THRESHOLDS[0], THRESHOLDS[2], THRESHOLDS[0], THRESHOLDS[3]], dtype=torch.float32)
    records, sparse, counts = tencode.encode_records(x.to(DEV), thr.to(DEV), OakenConfig())
    for r in range(4):
        ref = codec.pack(quantize(x[r : r + 1], tuple(thr[r].tolist())))
        assert torch.equal(records[r, scale_bytes(OakenConfig()) :].cpu(), ref.dense[0])
        assert torch.equal(sparse[r, : int(counts[r])].cpu(), ref.sparse)


def test_encode_per_row_grouping_thresholds_bit_exact():
    """Adaptive grouping (``oakenkv.quant.adapt``): per-row ``[N, 8]`` thresholds, shift then grouping ones, give
    ``pack(quantize(x, shift, group=grouping))`` byte for byte (values between the two outer thresholds are middle
    values shifted by the inner ones)."""
    from oakenkv.quant.adapt import scaled
    from oakenkv.quant.groups import GroupThresholds

    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(5)) * 1.5
    rows = []
    for r in range(6):
        t = THRESHOLDS[r % 2 * 3]  # (THR and the wide one)
        g = scaled(GroupThresholds(*t), 1.0 + 0.1 * r)
        rows.append(tuple(t) + tuple(g))
    thr = torch.tensor(rows, dtype=torch.float32)
    records, sparse, counts = tencode.encode_records(x.to(DEV), thr.to(DEV), OakenConfig())
    sb = scale_bytes(OakenConfig())
    for r in range(6):
        ref = codec.pack(quantize(x[r : r + 1], rows[r][:4], OakenConfig(), rows[r][4:]))
        assert torch.equal(records[r, sb:].cpu(), ref.dense[0])
        assert torch.equal(records[r, :sb].cpu().view(ref.scales.dtype), ref.scales[0])
        assert torch.equal(sparse[r, : int(counts[r])].cpu(), ref.sparse)
    changed = [not torch.equal(records[r].cpu(), tencode.encode_records(x[r : r + 1].to(DEV), thr[r, :4].to(DEV)[None],
               OakenConfig())[0][0].cpu()) for r in range(1, 6)]  # fmt: skip
    assert any(changed)  # (the grouping thresholds made a difference somewhere)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter, on the NaN row
def test_encode_several_rows_per_program_bit_exact():
    """``rows_per_program`` (the device store's choice under the interpreter): the bytes and counts of one row per
    program, for per-row shift and grouping thresholds, a last program only partly filled, every value an outlier,
    and a row that cannot be encoded (its code, the other rows' bytes)."""
    from oakenkv.quant.adapt import scaled
    from oakenkv.quant.groups import GroupThresholds

    x = torch.randn(7, 192, generator=torch.Generator().manual_seed(9)) * 1.5
    x[2] = 5.0  # every value an outlier: escapes at every chunk
    x[4, 7] = float("nan")
    rows = [tuple(THRESHOLDS[r % 2 * 3]) + tuple(scaled(GroupThresholds(*THRESHOLDS[r % 2 * 3]), 1.0 + 0.1 * r))
            for r in range(7)]  # fmt: skip
    thr = torch.tensor(rows, dtype=torch.float32).to(DEV)
    cfg = OakenConfig()
    want = tencode.encode_records(x.to(DEV), thr, cfg, check=False)
    got = tencode.encode_records(x.to(DEV), thr, cfg, check=False, rows_per_program=4)
    assert torch.equal(got[2].cpu(), want[2].cpu()) and int(got[2][4]) < 0
    for r in range(7):
        if r != 4:
            assert torch.equal(got[0][r].cpu(), want[0][r].cpu())
            assert torch.equal(got[1][r, : int(got[2][r])].cpu(), want[1][r, : int(want[2][r])].cpu())
            ref = codec.pack(quantize(x[r : r + 1], rows[r][:4], cfg, rows[r][4:]))
            assert torch.equal(got[1][r, : int(got[2][r])].cpu(), ref.sparse)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter, on NaN rows
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # and on fp16 scales past 65504
def test_encode_rejects_bad_input():
    x = torch.randn(4, 64)
    x[2, 5] = float("nan")
    with pytest.raises(ValueError, match=r"row 2.*NaN"):
        tencode.encode_batch(x.to(DEV), THR)
    x[2, 5] = float("-inf")
    with pytest.raises(ValueError, match=r"row 2.*NaN or infinite"):
        tencode.encode_batch(x.to(DEV), THR)
    with pytest.raises(ValueError, match="fp16"):
        tencode.encode_batch(torch.full((1, 64), 1e5, device=DEV), THR)
    with pytest.raises(ValueError, match=r"\[N, D\]"):
        tencode.encode_batch(torch.randn(64, device=DEV), THR)
    with pytest.raises(ValueError, match=r"1\.\.8192"):
        tencode.encode_batch(torch.randn(1, 8193, device=DEV), THR)
    with pytest.raises(TypeError):
        tencode.encode_batch(torch.ones(2, 64, dtype=torch.int32, device=DEV), THR)


@st.composite
def _rows(draw):
    thr = draw(st.sampled_from(THRESHOLDS))
    d = draw(st.sampled_from([2, 63, 64, 100, 192, 320]))
    g = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    kind = draw(st.sampled_from(["random", "edges", "outliers"]))
    scale = draw(st.sampled_from([0.01, 1.0, 3.0, 100.0]))
    x = g.standard_normal((2, d)) * scale
    if kind == "edges":
        x = np.where(g.random((2, d)) < 0.7, g.choice(np.array([*thr, 0.0, 6e4, -6e4]), size=(2, d)), x)
    elif kind == "outliers":
        x[:, : min(d, 64)] = (thr[3] + 1.0) * draw(st.sampled_from([1.0, -1.0])) * (1 + g.random((2, min(d, 64))))
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    cfg = OakenConfig(
        scale_dtype=draw(st.sampled_from(["float16", "float32"])),
        inner_bits=draw(st.sampled_from([5, 4])),
        outer_bits=draw(st.sampled_from([5, 4])),
    )
    return torch.from_numpy(x.astype(np.float32)).to(dtype), thr, cfg


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_rows())
def test_encode_decode_bit_exact_random_cases(case):
    _check_encode_and_decode(*case)


# ----------------------------------------------------------------------------------------------------- decode


@pytest.mark.parametrize(
    ("stream", "match"),
    [
        ([0x85, 0x85], "cut off"),
        ([0x85, 0x85, 0xFF], "cut off"),
        ([0x85, 0x85, 0x01], "not followed by an entry"),
        ([0x05, 0x05, 0x00, 0x06], "zero chunk advance"),
        ([0x00, 0x03, 0x01], "points past the end"),
        ([0x3F, 0x01, 0x00, 0x3F, 0x01], "points past the end"),
    ],
)
def test_decode_rejects_corrupt_streams(stream, match):
    enc = codec.pack(quantize(torch.zeros(1, 192), THR))
    enc.sparse = torch.tensor(stream, dtype=torch.uint8)
    enc.sparse_offsets = torch.tensor([0, len(stream)], dtype=torch.int64)
    with pytest.raises(CorruptDataError, match=match):
        tdecode.decode_batch(enc, THR, device=DEV)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter, on inf scales
def test_decode_rejects_fifth_bit_of_a_four_bit_group_and_nonfinite_scales():
    cfg = OakenConfig(inner_bits=4)
    enc = codec.pack(quantize(torch.zeros(1, 192), THR, cfg), cfg)
    enc.sparse = torch.tensor([0x85], dtype=torch.uint8)
    enc.sparse_offsets = torch.tensor([0, 1], dtype=torch.int64)
    with pytest.raises(CorruptDataError, match="fifth code bit"):
        tdecode.decode_batch(enc, THR, cfg, device=DEV)
    enc = codec.pack(quantize(torch.randn(2, 64), THR))
    enc.scales[1, 3] = float("inf")
    with pytest.raises(CorruptDataError, match="row 1: scales"):
        tdecode.decode_batch(enc, THR, device=DEV)


def test_decode_long_streams_cross_sparse_blocks():
    """Streams longer than one block of bytes (64): the walker's state and chunk carry across blocks, also when
    the block boundary falls on an escape, inside it (between escape and advance) or on the entry after it."""
    from oakenkv.quant.quantizer import QuantizedVectors

    cfg = OakenConfig()
    rows = []
    for k in (62, 63, 64):  # k entries (positions 1..k), then an escape at byte k, its advance at k + 1
        g = torch.full((1024,), GROUP_MIDDLE, dtype=torch.uint8)
        c = torch.zeros(1024, dtype=torch.uint8)
        for i, p in enumerate([*range(1, k + 1), 64 * 5 + 3, 64 * 5 + 4, *range(64 * 9, 64 * 9 + 50), 1023]):
            g[p] = GROUP_OUTER if i % 2 else GROUP_INNER
            c[p] = (7 * i) % 32
        rows.append((g, c))
    q = QuantizedVectors(
        codes=torch.stack([c for _, c in rows]), groups=torch.stack([g for g, _ in rows]),
        mins=torch.tensor([[-1.0, -0.1, -3.0]] * 3, dtype=torch.float16),
        maxs=torch.tensor([[1.0, 0.1, 3.0]] * 3, dtype=torch.float16),
    )  # fmt: skip
    enc = codec.pack(q, cfg)
    for r, k in enumerate((62, 63, 64)):
        stream = enc.row_sparse(r).tolist()
        assert stream[k] == stream[k - 1] and stream[k + 1] in (4, 5)  # the escape and its advance
    got = tdecode.decode_batch(enc, THR, cfg, device=DEV)
    assert torch.equal(_bits32(got), _bits32(dequantize(q, THR, cfg)))


def test_decode_fp16_output_rounds_the_float32_result_once():
    x = torch.randn(3, 80, generator=torch.Generator().manual_seed(4)) * 2
    q = quantize(x, THR)
    got = tdecode.decode_batch(codec.pack(q), THR, out_dtype=torch.float16, device=DEV)
    want = dequantize(q, THR).to(torch.float16)
    assert got.dtype == torch.float16 and torch.equal(got.cpu(), want)


# -------------------------------------------------------------------------------------------------- attention


def _attention_store(b, t, seed, page_size=4096, config=None, chunk=23, codec="auto", transforms=None):
    """A PagedKVStore holding ``t`` tokens of layer 1 for ``b`` rows (tests/test_attention.py's shapes: 3 KV
    heads x 64, 9 query heads), appended in chunks so that tokens spread over many pages."""
    from oakenkv.calibrate.thresholds import GroupThresholds, ModelFingerprint, Thresholds
    from oakenkv.hf.cache import PackedKV
    from oakenkv.store.paged import KEY, VALUE, PagedKVStore
    from oakenkv.store.pages import PoolConfig

    config = config or OakenConfig()
    fp = ModelFingerprint("llama", 2, 3, 64)
    keys = tuple(GroupThresholds(-2.0 - 0.1 * i, -0.15, 0.15, 2.0 + 0.1 * i) for i in range(2))
    values = tuple(GroupThresholds(-1.5 - 0.1 * i, -0.1, 0.1, 1.5 + 0.1 * i) for i in range(2))
    thr = Thresholds(config, fp, keys, values, transforms=transforms)
    store = PagedKVStore(thr, 2, 3, 64, PoolConfig(page_size=page_size), codec=codec)
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(b, 3, t, 64, generator=g)
    k[..., 5] *= 6.0  # an outlier channel, as real keys have
    v = torch.randn(b, 3, t, 64, generator=g) * 0.8
    for start in range(0, t, chunk):
        store.append(1, k[:, :, start : start + chunk], v[:, :, start : start + chunk])
    store.original = (k, v)  # the unquantized K/V, for the error check
    return store, (PackedKV(store, 1, KEY, t), PackedKV(store, 1, VALUE, t))


def _keep(b, t, pad, window=None):
    """bool [B, 1, 1, T]: left padding of pad[b] tokens, optional sliding window."""
    keep = torch.ones(b, 1, 1, t, dtype=torch.bool)
    for r, p in enumerate(pad):
        keep[r, ..., :p] = False
    if window is not None:
        keep[..., : t - window] = False
    return keep


@pytest.mark.parametrize(
    ("b", "t", "pad", "window", "page_size", "splits"),
    [
        (1, 1, [0], None, 4096, None),
        (2, 70, [0, 9], None, 512, 3),  # padding, many page boundaries, three token ranges combined
        (2, 45, [3, 0], 20, 4096, 2),  # a sliding window on top of padding
    ],
)
def test_attention_matches_float_attention_over_the_dequantized_cache(b, t, pad, window, page_size, splits):
    from oakenkv.hf.attention import float_attention, reference_packed_attention
    from oakenkv.kernels.triton import attention as tattn
    from oakenkv.kernels.triton.view import view_from_store

    store, (kh, vh) = _attention_store(b, t, seed=t, page_size=page_size)
    q = torch.randn(b, 9, 1, 64, generator=torch.Generator().manual_seed(1))
    mask = _keep(b, t, pad, window)
    view = view_from_store(store, 1, DEV)
    keep = tattn.keep_from_mask(mask, b, t, DEV)
    tile = 8 if splits == 2 else tattn.TILE_TOKENS  # the tuning variant too
    got, lse, status = tattn.paged_decode_attention_parts(
        q[:, :, 0].to(DEV), view, keep, 64**-0.5, num_splits=splits, tile_tokens=tile
    )
    tattn.raise_on_status(status)
    got = got.cpu()
    want = reference_packed_attention(q, kh, vh, mask, 64**-0.5)[:, 0]
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6)
    # the log-sum-exp of the kept scores (what merging sink tokens or other pages takes)
    scores = (q[:, :, 0, None] @ store.read(1, 0).repeat_interleave(3, dim=1).transpose(-1, -2))[:, :, 0] * 64**-0.5
    torch.testing.assert_close(lse.cpu(), torch.logsumexp(scores.masked_fill(~mask[:, 0], -torch.inf), -1))
    # against the original (unquantized) K/V: the quantization error, small but not zero
    exact = float_attention(q, *store.original, mask, 64**-0.5)[:, 0]
    assert 0 < ((got - exact).norm() / exact.norm()).item() < 0.1


def test_attention_with_the_interpreters_launch_options_matches_the_reference():
    """The options the device store uses under the interpreter (``interpret.store_blocks``): one 64-token tile,
    128-byte COO steps, all KV heads in one program (block-diagonal queries), 64 combine rows per program; with
    padding and a sliding window; and in 16-token tiles over three splits (the combine's rows of several splits)."""
    from oakenkv.hf.attention import reference_packed_attention
    from oakenkv.kernels.triton import attention as tattn
    from oakenkv.kernels.triton.view import view_from_store

    b, t = 2, 45
    store, (kh, vh) = _attention_store(b, t, seed=t)
    q = torch.randn(b, 9, 1, 64, generator=torch.Generator().manual_seed(2))
    mask = _keep(b, t, [3, 0], 20)
    view = view_from_store(store, 1, DEV)
    keep = tattn.keep_from_mask(mask, b, t, DEV)
    for tile, splits in ((64, 1), (16, 3)):
        got, lse, status = tattn.paged_decode_attention_parts(
            q[:, :, 0].to(DEV), view, keep, 64**-0.5, num_splits=splits, tile_tokens=tile, sparse_block_log=7,
            merge_heads=True, combine_rows=64,
        )  # fmt: skip
        tattn.raise_on_status(status)
        want = reference_packed_attention(q, kh, vh, mask, 64**-0.5)[:, 0]
        torch.testing.assert_close(got.cpu(), want, rtol=2e-5, atol=2e-6)
        scores = (q[:, :, 0, None] @ store.read(1, 0).repeat_interleave(3, dim=1).transpose(-1, -2))[:, :, 0]
        want_lse = torch.logsumexp((scores * 64**-0.5).masked_fill(~mask[:, 0], -torch.inf), -1)
        torch.testing.assert_close(lse.cpu(), want_lse)


def test_attention_softcap_additive_mask_and_fp32_scales_four_bit_groups():
    from oakenkv.hf.attention import reference_packed_attention
    from oakenkv.kernels.triton.attention import packed_decode_attention

    cfg = OakenConfig(scale_dtype="float32", inner_bits=4)
    # the reference codec: numba's decode would compile its fp32-scale variant (~20 s) for this one test
    _, (kh, vh) = _attention_store(1, 40, seed=4, config=cfg, codec="reference")
    q = torch.randn(1, 9, 1, 64, generator=torch.Generator().manual_seed(5)) * 3
    additive = torch.zeros(1, 1, 1, 40)
    additive[..., :10] = torch.finfo(torch.float32).min
    got = packed_decode_attention(q.to(DEV), kh, vh, additive.to(DEV), 0.125, softcap=5.0).cpu()
    want = reference_packed_attention(q, kh, vh, additive, 0.125, softcap=5.0)
    assert got.shape == (1, 1, 9, 64)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6)


def test_attention_rotates_the_queries_under_an_oaken_plus_key_rotation():
    """An oaken-plus profile stores layer 1's keys shifted and rotated per head (oakenkv.calibrate.transforms): the
    Triton
    path rotates the queries as the CPU kernel does, and both agree with float attention over the restored keys."""
    from oakenkv.calibrate.transforms import LayerTransforms, Transforms
    from oakenkv.hf.attention import packed_decode_attention as cpu_attention
    from oakenkv.hf.attention import reference_packed_attention
    from oakenkv.kernels.triton.attention import packed_decode_attention

    shift = tuple(float(v) for v in np.random.default_rng(13).standard_normal(3 * 64) * 0.3)
    plus = Transforms((LayerTransforms(), LayerTransforms(key_shift=shift, key_rotation=True)), 3, 64)
    _, (kh, vh) = _attention_store(2, 40, seed=13, transforms=plus)
    q = torch.randn(2, 9, 1, 64, generator=torch.Generator().manual_seed(14))
    mask = _keep(2, 40, [0, 6])
    got = packed_decode_attention(q.to(DEV), kh, vh, mask.to(DEV), 0.125).cpu()
    torch.testing.assert_close(got, cpu_attention(q, kh, vh, mask, 0.125), rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(got, reference_packed_attention(q, kh, vh, mask, 0.125), rtol=1e-4, atol=1e-5)


def test_attention_skips_evicted_pages_and_reports_an_unmasked_one():
    """A sliding window released the first pages (page ids -1): masked tokens are never read; a mask that lets
    the kernel reach an evicted token is an error, not a read of a released page."""
    from oakenkv.hf.attention import reference_packed_attention
    from oakenkv.kernels.triton import attention as tattn
    from oakenkv.kernels.triton.view import view_from_store

    store, (kh, vh) = _attention_store(1, 64, seed=6, page_size=512)
    assert store.evict_before(1, 40) > 0
    view = view_from_store(store, 1, DEV)
    assert int((view.dense_pages == -1).sum()) > 0 and int((view.sparse_addr == -1).sum()) > 0
    q = torch.randn(1, 9, 1, 64, generator=torch.Generator().manual_seed(7))
    mask = _keep(1, 64, [0], window=24)
    got = tattn.paged_decode_attention(q[:, :, 0].to(DEV), view, tattn.keep_from_mask(mask, 1, 64, DEV), 0.125)
    want = reference_packed_attention(q, kh, vh, mask, 0.125)[:, 0]
    torch.testing.assert_close(got.cpu(), want, rtol=2e-5, atol=2e-6)
    with pytest.raises(CorruptDataError, match="evicted"):
        tattn.paged_decode_attention(q[:, :, 0].to(DEV), view, None, 0.125)


def test_attention_fully_masked_rows_give_zeros_and_bad_shapes_are_refused():
    from oakenkv.kernels.triton import attention as tattn
    from oakenkv.kernels.triton.view import view_from_store

    store, _ = _attention_store(2, 20, seed=8)
    view = view_from_store(store, 1, DEV)
    q = torch.randn(2, 9, 64, device=DEV)
    keep = torch.ones(2, 20, dtype=torch.uint8, device=DEV)
    keep[1] = 0
    out = tattn.paged_decode_attention(q, view, keep, 0.125)
    assert torch.count_nonzero(out[1]) == 0 and torch.count_nonzero(out[0]) > 0
    with pytest.raises(ValueError, match="does not fit"):
        tattn.paged_decode_attention(torch.randn(2, 9, 32, device=DEV), view, None, 0.1)
    with pytest.raises(ValueError, match=r"keep must be \[B, T\]"):
        tattn.paged_decode_attention(q, view, keep[:, :5], 0.1)


def test_copy_spans_moves_each_span_and_nothing_else():
    src = torch.arange(300, dtype=torch.int64).to(torch.uint8).to(DEV)
    dst = torch.zeros(1000, dtype=torch.uint8, device=DEV)
    i64 = {"dtype": torch.int64, "device": DEV}
    tencode.copy_spans(
        src, torch.tensor([0, 10, 40], **i64), dst, torch.tensor([700, 0, 300], **i64),
        torch.tensor([5, 0, 260], dtype=torch.int32, device=DEV),
    )  # fmt: skip
    want = torch.zeros(1000, dtype=torch.uint8)
    want[700:705] = src[:5].cpu()
    want[300:560] = src[40:300].cpu()
    assert torch.equal(dst.cpu(), want)


def test_read_view_is_the_store_read_on_the_device():
    """The dequantize-tile read of a layer's pages (the prefill path over earlier pages) gives the floats of
    PagedKVStore.read for every token a query may see (from the eviction watermark on); tokens on released pages
    read as zeros (store.read zeroes everything below the watermark, also tokens whose page is still held)."""
    from oakenkv.kernels.triton.decode import read_view
    from oakenkv.kernels.triton.view import view_from_store

    store, _ = _attention_store(2, 50, seed=9, page_size=512)
    store.evict_before(1, 30)
    view = view_from_store(store, 1, DEV)
    for kind in (0, 1):
        got = read_view(view, kind).cpu()
        want = store.read(1, kind)
        assert got.shape == want.shape == (2, 3, 50, 64)
        assert torch.equal(_bits32(got[:, :, 30:]), _bits32(want[:, :, 30:]))
        gone = (view.dense_pages[:, kind].cpu() == -1).sum(dim=1)  # released dense pages per row
        assert int(gone.min()) > 0
        assert torch.count_nonzero(got[:, :, : int(gone.min()) * view.records_per_page]) == 0


# ----------------------------------------------------------------------------------------------- the view


def test_sparse_addresses_from_the_layer_view_are_where_the_pool_keeps_each_record():
    """The per-token sparse addresses derived from the store's LayerView point at each token's own COO bytes, as
    the pool's reader finds them: across page boundaries, rows that share pages after a fork, both kinds, and
    pages a sliding window released (address EVICTED, and only there)."""
    from oakenkv.format.layout import EVICTED
    from oakenkv.kernels.triton.view import sparse_addresses

    store, _ = _attention_store(2, 60, seed=10, page_size=256, chunk=7)
    store.reorder([0, 0, 1])  # rows 0 and 1 share every page so far
    g = torch.Generator().manual_seed(11)
    for _ in range(3):
        store.append(1, torch.randn(3, 3, 9, 64, generator=g) * 3, torch.randn(3, 3, 9, 64, generator=g))
    store.evict_before(1, 40)
    lv = store.layer_view(1)
    addr = sparse_addresses(lv)
    t_n = 87
    assert lv.num_tokens == t_n and lv.sparse_lengths.shape[:2] == (3, 2)  # the tables have capacity beyond T
    assert addr.shape == (3, 2, t_n) and addr.dtype == np.int64
    flat = store.pool.data.reshape(-1)
    for b, seq in enumerate(store.seqs):
        for kind in (0, 1):
            stream = 2 + kind
            table = store.pool.table(seq, stream)
            start = table.evicted_before
            assert start == 40
            sparse, offs = store.pool.read_sparse(seq, stream, start)
            lens = lv.sparse_lengths[b, kind]
            for t in range(start, t_n):
                a = int(addr[b, kind, t])
                assert a >= 0 and a + int(lens[t]) <= flat.size
                assert np.array_equal(flat[a : a + int(lens[t])], sparse[offs[t - start] : offs[t - start + 1]])
            released = np.flatnonzero(addr[b, kind] == EVICTED)
            assert released.size > 0 and released.max() < start  # only tokens below the window lose their address
    assert np.array_equal(addr[0, :, :60], addr[1, :, :60])  # the fork shares the pages of the first 60 tokens


def test_the_device_view_is_the_store_layer_view_on_the_device():
    from oakenkv.kernels.triton.view import from_layer_view, view_from_store

    store, _ = _attention_store(2, 30, seed=12, page_size=512)
    lv = store.layer_view(1)
    view = view_from_store(store, 1, DEV)
    assert (view.batch_size, view.num_tokens, view.num_kv_heads, view.head_dim) == (2, 30, 3, 64)
    assert (view.page_size, view.record_size, view.scale_bytes) == (lv.page_size, lv.record_size, lv.scale_bytes)
    assert (view.inner_bits, view.outer_bits) == (lv.inner_bits, lv.outer_bits)
    # the live part of the store's tables (they have capacity beyond it)
    assert np.array_equal(view.dense_pages.cpu().numpy(), lv.dense_pages[:, :, : -(-30 // view.records_per_page)])
    assert np.array_equal(view.sparse_lengths.cpu().numpy(), lv.sparse_lengths[:, :, :30])
    assert np.array_equal(view.thresholds.cpu().numpy(), lv.thresholds)
    assert view.dense_pool.device.type == torch.device(DEV).type
    with pytest.raises(ValueError, match="do not hold 3 heads x 32 values"):
        from_layer_view(lv, 32, DEV)
    with pytest.raises(ValueError, match="fp16 or fp32 scales"):
        from_layer_view(lv._replace(scale_bytes=lv.scale_bytes + 1, record_size=lv.record_size + 1), 64, DEV)


# ------------------------------------------------------------------------------------------ prefill, rotation


@pytest.mark.parametrize("masked", [False, True])
def test_prefill_attention_matches_float_attention_over_the_dequantized_cache(masked):
    """A chunk of 17 queries (two query blocks, one partial) over 26 tokens of pages, GQA 9q/3kv: causal from the
    chunk's position, or a 4-D mask with left padding, sink tokens left out (``skip``) and a soft cap; the output
    and the log-sum-exp against float32 attention over the store's read."""
    from oakenkv.hf.attention import float_attention
    from oakenkv.kernels.triton import prefill as tpre
    from oakenkv.kernels.triton.attention import raise_on_status
    from oakenkv.kernels.triton.view import view_from_store

    b, t, s = 1 + masked, 26, 17
    store, _ = _attention_store(b, t, seed=15, page_size=512)
    view = view_from_store(store, 1, DEV)
    q = torch.randn(b, 9, s, 64, generator=torch.Generator().manual_seed(16))
    mask = torch.ones(b, 1, s, t, dtype=torch.bool).tril(t - s)
    skip, softcap = (2, 4.0) if masked else (0, None)
    if masked:
        mask[1, ..., :5] = False  # left padding
    mask[..., :skip] = False
    dev_mask = tpre.prefill_mask(mask.to(DEV), b, s, t, DEV) if masked else None
    out, lse, status = tpre.paged_prefill_attention(q.to(DEV), view, t - s, dev_mask, 0.125, softcap, skip=skip)
    raise_on_status(status)
    k, v = store.read(1, 0), store.read(1, 1)
    want = float_attention(q, k, v, mask, 0.125, softcap)  # [B, S, Hq, hd]
    torch.testing.assert_close(out.cpu().transpose(1, 2), want, rtol=2e-5, atol=2e-6)
    x = (q @ k.repeat_interleave(3, dim=1).transpose(-1, -2)) * 0.125
    if softcap:
        x = torch.tanh(x / softcap) * softcap
    torch.testing.assert_close(lse.cpu(), torch.logsumexp(x.masked_fill(~mask, -torch.inf), -1), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="do not fit"):
        tpre.paged_prefill_attention(q.to(DEV), view, t - s + 1, None, 0.125)


@pytest.mark.parametrize(("n", "heads", "hd"), [(5, 3, 64), (1, 8, 16), (19, 1, 128)])
def test_rotation_is_the_cpu_kernels_bits(n, heads, hd):
    """The device key transform (shift, per-head Hadamard rotation) gives the numba kernel's float32 bits."""
    import math

    from oakenkv.kernels.cpu.rotate import shift_rotate_rows as cpu_rotate
    from oakenkv.kernels.triton.rotate import shift_rotate_rows

    g = np.random.default_rng(n)
    x = (g.standard_normal((n, heads * hd)) * 3).astype(np.float32)
    shift = g.standard_normal(heads * hd).astype(np.float32)
    for sh in (None, shift):
        want = x.copy()
        cpu_rotate(want, np.zeros(0, np.float32) if sh is None else sh, True, hd, np.float32(1 / math.sqrt(hd)))
        got = shift_rotate_rows(
            torch.from_numpy(x).to(DEV), None if sh is None else torch.from_numpy(sh).to(DEV), True, hd
        )
        assert np.array_equal(got.cpu().numpy().view(np.int32), want.view(np.int32))
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        shift_rotate_rows(torch.zeros(2, 96, device=DEV), None, True, 48)


def test_static_grids_are_refused_clearly():
    """Static grids (OakenConfig.static_grids): records of the outer scales alone, which these kernels do not read;
    every entry point refuses them with one NotImplementedError before any work (never a misread)."""
    from oakenkv.calibrate.thresholds import GroupThresholds, ModelFingerprint, Thresholds
    from oakenkv.kernels.triton.view import from_layer_view
    from oakenkv.store.paged import PagedKVStore
    from oakenkv.store.pages import PoolConfig

    cfg = OakenConfig(static_grids=True)
    x = torch.randn(3, 64, device=DEV)
    with pytest.raises(NotImplementedError, match="static middle/inner grids"):
        tencode.encode_batch(x, THR, cfg)
    enc = codec.encode(x.cpu(), THR, cfg)
    with pytest.raises(NotImplementedError, match="static middle/inner grids"):
        tdecode.decode_batch(enc, THR, cfg)
    fp = ModelFingerprint("llama", 1, 1, 64)
    thr = Thresholds(cfg, fp, (GroupThresholds(*THR),), (GroupThresholds(*THR),))
    store = PagedKVStore(thr, 1, 1, 64, PoolConfig(page_size=512))
    store.append(0, torch.randn(1, 1, 5, 64), torch.randn(1, 1, 5, 64))
    with pytest.raises(NotImplementedError, match="static middle/inner grids"):
        from_layer_view(store.layer_view(0), 64, DEV)
    view = store.layer_view(0)._replace(static_grid=np.zeros((2, 0), np.float32))  # a view that lost its grid
    with pytest.raises(NotImplementedError, match="static middle/inner grids"):
        from_layer_view(view, 64, DEV)
    from oakenkv.store.device import DeviceKVStore

    with pytest.raises(NotImplementedError, match="static middle/inner grids"):
        DeviceKVStore(thr, 1, 1, 64, PoolConfig(page_size=512), device=DEV)
