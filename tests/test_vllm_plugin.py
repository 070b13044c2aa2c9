"""The vLLM plugin (``oakenkv.integrations.vllm``, docs/vllm.md).

The first part needs no vLLM: the block layout, writing and reading blocks, the decode kernel on blocks, the overflow
policies and the settings, against the codec and float attention. It runs in CI.

The second part starts vLLM's CPU engine with the plugin on the default model and is skipped when vLLM is not
installed (CI does not install it; ``make test-vllm`` runs this file in a venv that has it): vLLM uses the Oaken
backend with Oaken's block size, the bytes in its blocks are exactly the codec's for the keys and values it computed,
greedy generation gives OakenCache's tokens, perplexity through vLLM's prompt logprobs equals ``eval ppl``'s, and
prefix-cache hits and chunked prefills change nothing.
"""

from __future__ import annotations

import dataclasses
import math
import os

import numpy as np
import pytest
import torch

from oakenkv.format.config import OakenConfig
from oakenkv.format.layout import record_size
from oakenkv.hf.attention import float_attention
from oakenkv.integrations.vllm import (
    ENV_CPUS,
    ENV_KERNELS,
    ENV_OVERFLOW,
    ENV_PROFILE,
    ENV_SPARSE_BYTES,
    ENV_THREADS,
    Settings,
    parse_cpus,
    register,
)
from oakenkv.integrations.vllm.layout import (
    BlockLayout,
    BlockOverflowError,
    BlockWriter,
    clip_outliers,
    decode_attention,
    dequantize,
    pool_view,
    read_rows,
    read_sinks,
)
from oakenkv.kernels.codec import decode, encode
from oakenkv.quant.quantizer import GROUP_MIDDLE, assign_groups

CFG = OakenConfig()


def _thresholds(rng: np.random.Generator, x: np.ndarray) -> np.ndarray:
    """Per-kind thresholds at the config's quantiles of ``x`` ([2, N, D]): ~10% outliers, like a profile."""
    o, i = CFG.outer_ratio / 2, CFG.inner_ratio / 2
    return np.array([np.quantile(x[k], [o, 0.5 - i, 0.5 + i, 1 - o]) for k in range(2)], dtype=np.float32)


def _kv(rng: np.random.Generator, n: int, dim: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Keys and values with heavy-ish tails (a t distribution), and their thresholds."""
    k = rng.standard_t(5, size=(n, dim)).astype(np.float32)
    v = (0.5 * rng.standard_t(8, size=(n, dim))).astype(np.float32)
    return k, v, _thresholds(rng, np.stack([k, v]))


def _pool(layout: BlockLayout, num_blocks: int, stride_blocks: int = 1) -> tuple[torch.Tensor, np.ndarray, int]:
    """A layer cache of ``num_blocks`` blocks, ``stride_blocks`` blocks apart (2: another layer interleaved)."""
    raw = torch.zeros(num_blocks * stride_blocks * layout.block_bytes, dtype=torch.uint8)
    view = raw.view(num_blocks, stride_blocks * layout.block_bytes)[:, : layout.block_bytes]
    pool, upb = pool_view(view, layout)
    return raw, pool, upb


# ------------------------------------------------------------------------------------------------ layout


def test_default_model_block_layout():
    """D = 192 (3 KV heads x 64), blocks of 128: the numbers docs/vllm.md gives, and the issue's capacity goals."""
    lay = BlockLayout.make(192, 128, CFG)
    assert (lay.unit, lay.sparse_units, lay.header_units, lay.units, lay.len_bytes) == (108, 31, 3, 321, 1)
    assert lay.block_bytes == 321 * 108 == 34668
    assert lay.sparse_area_bytes / 128 == pytest.approx(26.16, abs=0.01)
    bf16, fp8 = 2 * 192 * 2, 2 * 192  # K and V bytes per token and layer
    assert bf16 / lay.bytes_per_token >= 2.8 and fp8 / lay.bytes_per_token >= 1.4


def test_layout_sizes_follow_the_row_width_and_capacity():
    wide = BlockLayout.make(1024, 16, CFG)
    assert wide.len_bytes == 2 and wide.unit == 12 + 512  # a 1024-value row's COO stream can exceed 255 bytes
    assert BlockLayout.make(192, 128, CFG, sparse_bytes_per_token=40).sparse_units == math.ceil(128 * 40 / 108)
    with pytest.raises(ValueError, match="fp16 scales"):
        BlockLayout.make(192, 128, OakenConfig(scale_dtype="float32"))
    with pytest.raises(ValueError, match="sparse_bytes_per_token"):
        BlockLayout.make(192, 128, CFG, sparse_bytes_per_token=0)


def test_the_sparse_area_is_sized_by_the_profiles_largest_layer_share():
    """A profile whose layers take different sparse shares (an oaken-plus search at another share, or alloc=1 at up
    to twice its average) sizes every block's sparse area for its largest: vLLM's pages are one size. A profile at
    the paper's 10% everywhere keeps the layout it had."""
    from oakenkv.calibrate.thresholds import GroupThresholds, LayerStats, ModelFingerprint, Thresholds
    from oakenkv.integrations.vllm.layout import profile_outlier_share

    def stats(outer, inner):
        return LayerStats(3.0, 100, 2, outer, inner, (0.0,) * 4)

    fp = ModelFingerprint("LlamaForCausalLM", 2, 3, 64)
    g = (GroupThresholds(-2.0, -0.1, 0.1, 2.0), GroupThresholds(-2.5, -0.1, 0.1, 2.5))
    plain = Thresholds(CFG, fp, g, g)
    assert profile_outlier_share(plain) == pytest.approx(0.1)
    alloc = Thresholds(CFG, fp, g, g, (stats(0.04, 0.06), stats(0.16, 0.04)), (stats(0.05, 0.0), stats(0.1, 0.0)))
    assert profile_outlier_share(alloc) == pytest.approx(0.2)
    ten = BlockLayout.make(192, 128, CFG, outlier_share=profile_outlier_share(plain))
    assert ten == BlockLayout.make(192, 128, CFG)  # the layout of every profile at 10%, unchanged
    twenty = BlockLayout.make(192, 128, CFG, outlier_share=0.2)
    assert twenty.sparse_units == math.ceil(128 * 1.35 * 192 * 0.2 / twenty.unit) > ten.sparse_units
    with pytest.raises(ValueError, match="outlier_share"):
        BlockLayout.make(192, 128, CFG, outlier_share=0.0)


def test_static_levels_are_refused_by_the_plugin(tmp_path):
    """Static levels (OakenConfig.static_levels): a level byte per record, which the plugin's blocks and kernels do
    not read; its profile check, its block layout and the export refuse them with one NotImplementedError, before
    any work (the export leaves nothing behind)."""
    from oakenkv.calibrate.thresholds import GroupThresholds, ModelFingerprint, Thresholds
    from oakenkv.integrations.vllm import check_profile
    from oakenkv.integrations.vllm.export import export_model

    cfg = OakenConfig(static_grids=True, static_levels=(0.5, 0.7, 0.85, 1.0))
    with pytest.raises(NotImplementedError, match="not static levels"):
        BlockLayout.make(192, 128, cfg)
    g = (GroupThresholds(-2.0, -0.1, 0.1, 2.0),)
    thr = Thresholds(cfg, ModelFingerprint("llama", 1, 1, 64), g, g)
    with pytest.raises(NotImplementedError, match=r"profile\.json: the vLLM plugin .* not static levels"):
        check_profile(thr, "profile.json")
    check_profile(dataclasses.replace(thr, config=cfg.replace(static_levels=())), "profile.json")  # one grid: served
    with pytest.raises(NotImplementedError, match="not static levels"):
        export_model(None, None, tmp_path / "out", "oaken", profile=thr, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_pool_view_refuses_strides_off_the_record_grid():
    lay = BlockLayout.make(64, 8, CFG)
    bad = torch.zeros(4, lay.block_bytes + 1, dtype=torch.uint8)
    with pytest.raises(ValueError, match="multiple"):
        pool_view(bad, lay)
    with pytest.raises(ValueError, match="uint8"):
        pool_view(torch.zeros(4, lay.block_bytes, dtype=torch.int8), lay)


@pytest.mark.parametrize(
    ("dim", "block_size", "stride_blocks", "static"),
    [(192, 16, 1, False), (200, 8, 2, False), (64, 32, 1, False), (511, 4, 1, False), (192, 16, 2, True),
     (511, 4, 1, True)],
)  # fmt: skip
def test_blocks_hold_the_codec_bytes(dim, block_size, stride_blocks, static):
    """Tokens written in chunks, out of order and with padding slots read back as exactly ``codec.encode``'s rows
    (with static grids too: records of the outer scales alone, the layer's grids restored from its thresholds)."""
    rng = np.random.default_rng(dim + block_size)
    n = 3 * block_size + 5
    k, v, thr = _kv(rng, n, dim)
    cfg = CFG.replace(static_grids=static)
    lay = BlockLayout.make(dim, block_size, cfg, sparse_bytes_per_token=0.5 * dim)  # no overflow here
    assert lay.unit == record_size(dim, cfg)
    blocks = rng.permutation(12)[: -(-n // block_size)]
    slots = blocks[np.arange(n) // block_size] * block_size + np.arange(n) % block_size
    _, pool, upb = _pool(lay, 12, stride_blocks)
    writer = BlockWriter(lay, thr, overflow="error")
    cut = block_size + 3
    writer.write(pool, upb, slots[:cut], torch.from_numpy(k[:cut]), torch.from_numpy(v[:cut]))
    # the rest in reverse order with two padding tokens mixed in (slot -1): the writer sorts them
    rest = np.arange(cut, n)[::-1]
    pad = np.full(2, -1)
    writer.write(
        pool,
        upb,
        np.concatenate([slots[rest], pad]),
        np.concatenate([k[rest], np.zeros((2, dim), np.float32)]),
        np.concatenate([v[rest], np.zeros((2, dim), np.float32)]),
    )
    assert writer.stats.written == 2 * n and sum(writer.stats.tokens) == 0
    for kind, x in enumerate((k, v)):
        got = read_rows(pool, upb, lay, blocks, n, kind, writer.static_grid)
        want = encode(torch.from_numpy(x), tuple(thr[kind]), cfg)
        for name in ("dense", "scales", "sparse", "sparse_offsets", "stored_scales"):
            assert np.array_equal(getattr(got, name), getattr(want, name)), name
    kd, vd = dequantize(pool, upb, lay, blocks, n, thr)
    assert torch.equal(kd, decode(encode(torch.from_numpy(k), tuple(thr[0]), cfg), tuple(thr[0]), cfg))
    assert torch.equal(vd, decode(encode(torch.from_numpy(v), tuple(thr[1]), cfg), tuple(thr[1]), cfg))


def test_writers_of_every_layer_and_thread_share_working_rows_without_mixing_them():
    """The layers' writers share one set of working rows per thread (grown once, not once per layer): writers of
    two layouts, interleaved, in two threads at once, still store exactly the codec's rows."""
    import threading

    from oakenkv.integrations.vllm import layout as layout_mod

    def run(dim: int, static: bool, seed: int, out: dict) -> None:
        rng = np.random.default_rng(seed)
        cfg = CFG.replace(static_grids=static)
        lay = BlockLayout.make(dim, 8, cfg, sparse_bytes_per_token=0.5 * dim)
        layers = []
        for _ in range(2):
            k, v, thr = _kv(rng, 40, dim)
            _, pool, upb = _pool(lay, 5)
            layers.append((BlockWriter(lay, thr, overflow="error"), pool, upb, k, v, thr))
        for n0, n1 in ((0, 3), (3, 40)):  # a short write grows the rows, a long one grows them again
            for w, pool, upb, k, v, _ in layers:
                w.write(pool, upb, np.arange(n0, n1), torch.from_numpy(k[n0:n1]), torch.from_numpy(v[n0:n1]))
        for w, pool, upb, k, v, thr in layers:
            for kind, x in enumerate((k, v)):
                got = read_rows(pool, upb, lay, np.arange(5), 40, kind, w.static_grid)
                want = encode(torch.from_numpy(x), tuple(thr[kind]), cfg)
                out[(dim, seed, kind)] = all(
                    np.array_equal(getattr(got, a), getattr(want, a)) for a in ("dense", "scales", "sparse")
                )
        out[(dim, seed, "sets")] = len(layout_mod._WRITE_SCRATCH.sets)

    out: dict = {}
    cases = [(64, False), (96, True)]
    threads = [threading.Thread(target=run, args=(d, st, i, out)) for i, (d, st) in enumerate(cases)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(out) == 6 and all(out[k] is True for k in out if k[2] != "sets")
    assert out[(64, 0, "sets")] == 1 and out[(96, 1, "sets")] == 1  # one set per thread and shape: not per layer


def test_writer_accepts_bf16_and_head_shaped_inputs():
    rng = np.random.default_rng(1)
    k, v, thr = _kv(rng, 10, 128)
    lay = BlockLayout.make(128, 16, CFG)
    _, pool, upb = _pool(lay, 2)
    kb, vb = torch.from_numpy(k).bfloat16().view(10, 2, 64), torch.from_numpy(v).bfloat16().view(10, 2, 64)
    BlockWriter(lay, thr).write(pool, upb, np.arange(10), kb, vb)
    got = read_rows(pool, upb, lay, np.array([0]), 10, 0)
    want = encode(kb.reshape(10, 128), tuple(thr[0]), CFG)  # the codec widens bf16 exactly
    assert torch.equal(got.dense, want.dense) and torch.equal(got.sparse, want.sparse)
    with pytest.raises(IndexError, match="past the cache"):
        BlockWriter(lay, thr).write(pool, upb, np.array([40]), k[:1], v[:1])
    bad = k[:1].copy()
    bad[0, 3] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        BlockWriter(lay, thr).write(pool, upb, np.array([0]), bad, v[:1])


# ------------------------------------------------------------------------------------------------ attention


@pytest.mark.parametrize(
    ("lengths", "softcap", "static"),
    [((1, 37, 16, 90), 0.0, False), ((300,), 0.0, False), ((50, 20), 30.0, False), ((1, 37, 90), 0.0, True)],
)
def test_decode_attention_on_blocks_is_attention_over_the_stored_values(lengths, softcap, static):
    """The packed-page kernel on vLLM blocks = float attention over the codec's dequantized K/V (GQA 9:3), static
    grids included."""
    rng = np.random.default_rng(sum(lengths))
    hq, hkv, hd, bs = 9, 3, 64, 16
    dim = hkv * hd
    lay = BlockLayout.make(dim, bs, CFG.replace(static_grids=static), sparse_bytes_per_token=60)
    nblocks = sum(-(-t // bs) for t in lengths) + 3
    _, pool, upb = _pool(lay, nblocks)
    order = rng.permutation(nblocks)
    table = np.zeros((len(lengths), max(-(-t // bs) for t in lengths)), np.int32)
    used = 0
    data = []
    thr = None
    for r, t in enumerate(lengths):
        nb = -(-t // bs)
        table[r, :nb] = order[used : used + nb]
        used += nb
        k, v, thr_r = _kv(rng, t, dim)
        thr = thr_r if thr is None else thr  # one layer: the same thresholds for every row
        slots = table[r][np.arange(t) // bs].astype(np.int64) * bs + np.arange(t) % bs
        BlockWriter(lay, thr, "error").write(pool, upb, slots, k, v)
        data.append(dequantize(pool, upb, lay, table[r], t, thr))
    q = rng.standard_normal((len(lengths), hq, hd)).astype(np.float32)
    out = decode_attention(q, pool, upb, lay, table, np.array(lengths), thr, hkv, 0.125, softcap)
    for r, (kd, vd) in enumerate(data):
        t = lengths[r]
        ref = float_attention(
            torch.from_numpy(q[r : r + 1, :, None]),
            kd.view(t, hkv, hd).permute(1, 0, 2)[None],
            vd.view(t, hkv, hd).permute(1, 0, 2)[None],
            None,
            0.125,
            softcap or None,
        )[0, 0]
        np.testing.assert_allclose(out[r], ref.numpy(), rtol=2e-5, atol=2e-6)


def test_triton_attention_reads_the_plugins_blocks_like_the_numba_kernel():
    """The blocks' LayerView is what the GPU backend's Triton kernels read too: ``from_layer_view`` of the plugin's
    view and ``paged_decode_attention`` (under the Triton interpreter without a GPU) give the numba kernel's output."""
    pytest.importorskip("triton", reason="triton is not installed (pip install 'oakenkv[triton]')")
    from oakenkv.integrations.vllm.layout import BlockTables, LayerParams, decode_attention_rows
    from oakenkv.kernels.triton import attention as tattn
    from oakenkv.kernels.triton.view import from_layer_view

    rng = np.random.default_rng(11)
    hq, hkv, hd, bs, lengths = 9, 3, 64, 16, (37, 5, 20)
    dim = hkv * hd
    lay = BlockLayout.make(dim, bs, CFG, sparse_bytes_per_token=60)
    nblocks = sum(-(-t // bs) for t in lengths) + 2
    _, pool, upb = _pool(lay, nblocks, stride_blocks=2)  # another layer's blocks interleaved
    order = rng.permutation(nblocks)
    table = np.zeros((len(lengths), max(-(-t // bs) for t in lengths)), np.int32)
    k0, v0, thr = _kv(rng, sum(lengths), dim)
    used = start = 0
    for r, t in enumerate(lengths):
        nb = -(-t // bs)
        table[r, :nb] = order[used : used + nb]
        used += nb
        slots = table[r][np.arange(t) // bs].astype(np.int64) * bs + np.arange(t) % bs
        BlockWriter(lay, thr, "error").write(pool, upb, slots, k0[start : start + t], v0[start : start + t])
        start += t
    q = rng.standard_normal((len(lengths), hq, hd)).astype(np.float32)
    tables = BlockTables(lay, upb)
    tables.update(0, table, np.array(lengths), np.ones(len(lengths), np.int64))
    want = decode_attention_rows(tables, 0, pool, q, LayerParams(thr, hkv, 0.125))
    lt = tables.layer(0, pool)
    view = from_layer_view(lt.view(pool, lay.unit, lay.unit, lay.scale_bytes, thr, 5, 5, hkv), hd, "cpu")
    keep = torch.from_numpy(tables.keep[:, : max(lengths)].copy())
    got = tattn.paged_decode_attention(torch.from_numpy(q), view, keep, 0.125)
    np.testing.assert_allclose(got.numpy(), want, rtol=2e-5, atol=2e-6)


def test_decode_attention_parallel_split_matches_serial():
    from oakenkv.kernels.cpu.attention import PARALLEL_MIN_TOKENS

    rng = np.random.default_rng(7)
    hkv, hd, bs, t = 3, 64, 128, 2100
    assert 3 * t >= PARALLEL_MIN_TOKENS  # the parallel kernel's threshold (split_work): three rows of t
    lay = BlockLayout.make(hkv * hd, bs, CFG)
    nb = -(-t // bs)
    _, pool, upb = _pool(lay, 3 * nb)
    table = np.stack([np.arange(nb), np.arange(nb, 2 * nb), np.arange(2 * nb, 3 * nb)]).astype(np.int32)
    k, v, thr = _kv(rng, t, hkv * hd)
    for r in range(3):
        BlockWriter(lay, thr).write(pool, upb, table[r][np.arange(t) // bs] * bs + np.arange(t) % bs, k, v)
    q = np.repeat(rng.standard_normal((1, 9, hd)).astype(np.float32), 3, axis=0)  # three rows, same data
    both = decode_attention(q, pool, upb, lay, table, np.array([t, t, t]), thr, hkv, 0.125, threads=2)
    one = decode_attention(q[:1], pool, upb, lay, table[:1], np.array([t]), thr, hkv, 0.125)
    for r in range(3):  # 3 x 2100 tokens split over two threads, 2100 serially
        np.testing.assert_allclose(both[r], one[0], rtol=1e-5, atol=1e-6)


def _rows_case(rng: np.random.Generator, lengths: tuple[int, ...], hkv: int = 3, hd: int = 64, bs: int = 32):
    """Rows of ``lengths`` tokens written into shuffled blocks: (tables, pool, queries, params)."""
    from oakenkv.integrations.vllm.layout import BlockTables, LayerParams

    lay = BlockLayout.make(hkv * hd, bs, CFG)
    nbs = [-(-t // bs) for t in lengths]
    _, pool, upb = _pool(lay, sum(nbs))
    order = rng.permutation(sum(nbs)).astype(np.int32)
    table = np.zeros((len(lengths), max(nbs)), np.int32)
    k, v, thr = _kv(rng, sum(lengths), hkv * hd)
    used = start = 0
    for r, (t, nb) in enumerate(zip(lengths, nbs, strict=True)):
        table[r, :nb] = order[used : used + nb]
        slots = table[r][np.arange(t) // bs].astype(np.int64) * bs + np.arange(t) % bs
        BlockWriter(lay, thr).write(pool, upb, slots, k[start : start + t], v[start : start + t])
        used, start = used + nb, start + t
    tables = BlockTables(lay, upb)
    tables.update(0, table, np.array(lengths), np.ones(len(lengths), np.int64))
    q = rng.standard_normal((len(lengths), 3 * hkv, hd)).astype(np.float32)
    return tables, pool, q, LayerParams(thr, hkv, 0.125)


def test_decode_rows_shared_with_the_plugins_threads_give_the_serial_kernels_numbers():
    """``RowThreads`` (the plugin's own threads, ``OAKENKV_VLLM_ATTENTION_CPUS``): each thread attends a range of
    rows with ``packed_decode_attention_rows``; the result is the serial kernel's, row for row, for one and for two
    threads of its own, with rows of unequal lengths; a step below ``ROW_THREADS_MIN_TOKENS`` stays on the caller's
    thread."""
    from oakenkv.integrations.vllm import layout as lay_mod

    tables, pool, q, params = _rows_case(np.random.default_rng(5), (200, 40, 333, 7, 120, 260, 90))
    assert lay_mod.ROW_THREADS_MIN_TOKENS <= 7 * 333

    class Counted(lay_mod.RowThreads):
        def run(self, jobs, own):
            self.calls.append(len(jobs))
            super().run(jobs, own)

    want = lay_mod.decode_attention_rows(tables, 0, pool, q, params).copy()
    cpu = sorted(os.sched_getaffinity(0))[0]
    for n in (1, 2):
        rt = Counted([cpu] * n)
        try:
            rt.calls = []
            got = lay_mod.decode_attention_rows(tables, 0, pool, q, params, 1, lay_mod.DecodeScratch(), rt)
            assert rt.calls == [n]  # the rows were shared out
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
            rt.calls.clear()
            one = lay_mod.decode_attention_rows(tables, 0, pool, q[:1], params, 1, None, rt)  # one row: no share
            assert rt.calls == []
            np.testing.assert_allclose(one, want[:1], rtol=1e-6, atol=1e-7)
        finally:
            rt.close()


def test_row_shares_split_rows_by_their_tokens():
    from oakenkv.integrations.vllm.layout import row_shares

    lens = np.array([300, 10, 10, 10, 300, 290, 5, 300])
    for parts in range(1, len(lens) + 1):
        b = row_shares(lens, parts)
        assert b[0] == 0 and b[-1] == len(lens) and (np.diff(b) >= 1).all()
    b = row_shares(lens, 2)
    first, second = lens[: b[1]].sum(), lens[b[1] :].sum()
    assert abs(int(first) - int(second)) <= lens.max()  # within one row of an even split
    assert list(row_shares(np.zeros(4, np.int64), 2)) == [0, 2, 4]


def test_row_threads_hand_errors_to_the_caller_and_refuse_cpus_they_cannot_bind():
    from oakenkv.integrations.vllm.layout import RowThreads

    rt = RowThreads([sorted(os.sched_getaffinity(0))[0]])
    try:

        def boom() -> None:
            raise RuntimeError("kernel failed")

        ran = []
        with pytest.raises(RuntimeError, match="kernel failed"):
            rt.run([boom], lambda: ran.append(1))
        assert ran == [1]
        rt.run([lambda: ran.append(2)], lambda: None)  # the thread serves the next step
        assert ran == [1, 2]
    finally:
        rt.close()
    with pytest.raises(ValueError, match="cannot bind an attention thread to CPU 100000"):
        RowThreads([100000])


def test_attention_cpus_setting_is_parsed_and_checked(monkeypatch, tmp_path):
    n = os.cpu_count() or 1
    assert parse_cpus("") == () and parse_cpus(" 0 ") == (0,)
    assert parse_cpus("0,0-0") == (0,)
    if n >= 2:
        assert parse_cpus("1,0") == (0, 1) and parse_cpus("0-1") == (0, 1)
    for bad, match in (("one", "CPU ids such as"), ("2-1", "increasing range"), ("-1", "CPU ids such as"),
                       (str(n), f"CPU {n} does not exist")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            parse_cpus(bad, ENV_CPUS)
    monkeypatch.setenv(ENV_PROFILE, str(tmp_path / "thr.json"))
    monkeypatch.setenv(ENV_CPUS, "0")
    assert Settings.from_env().attention_cpus == (0,)
    monkeypatch.setenv(ENV_CPUS, "x")
    with pytest.raises(ValueError, match=ENV_CPUS):
        Settings.from_env()


def _plus_profile(thr: np.ndarray, hkv: int, hd: int, rotation: bool, sink: int, seed: int = 0):
    """A one-layer oaken-plus ``Thresholds`` (synthetic: a key shift, an optional key rotation, ``sink`` sink
    tokens) with key and value thresholds ``thr [2, 4]``."""
    from oakenkv.calibrate.thresholds import GroupThresholds, ModelFingerprint, Thresholds
    from oakenkv.calibrate.transforms import LayerTransforms, Transforms

    shift = np.random.default_rng(seed).standard_normal(hkv * hd).astype(np.float32)
    t = Transforms(
        (LayerTransforms(key_shift=tuple(shift.tolist()), key_rotation=rotation),), hkv, hd, sink_tokens=sink
    )
    fp = ModelFingerprint("llama", 1, hkv, hd)
    return Thresholds(
        config=CFG,
        fingerprint=fp,
        keys=(GroupThresholds(*map(float, thr[0])),),
        values=(GroupThresholds(*map(float, thr[1])),),
        transforms=t,
    )


def _plus_blocks(rotation: bool, lengths=(37, 130), bs: int = 16, seed: int = 0, static: bool = False):
    """Rows written through the plugin's writer with an oaken-plus profile's online parts, beside a ``PagedKVStore``
    per row holding the same keys and values (OakenCache's path); ``static``: both with static grids."""
    import dataclasses

    from oakenkv.integrations.vllm.layout import BlockTables
    from oakenkv.store.paged import PagedKVStore

    rng = np.random.default_rng(seed)
    hkv, hd = 3, 64
    dim = hkv * hd
    k_all, v_all, _ = _kv(rng, sum(lengths), dim)
    k_all += 0.7  # an offset the key shift removes
    thr = _thresholds(rng, np.stack([k_all - 0.7, v_all]))
    profile = _plus_profile(thr, hkv, hd, rotation, sink=1, seed=seed)
    profile = dataclasses.replace(profile, config=profile.config.replace(static_grids=static))
    lay = BlockLayout.make(dim, bs, profile.config, sparse_bytes_per_token=60, sink_tokens=1)
    nblocks = sum(-(-t // bs) for t in lengths) + 2
    _, pool, upb = _pool(lay, nblocks)
    order = rng.permutation(nblocks)
    table = np.zeros((len(lengths), max(-(-t // bs) for t in lengths)), np.int32)
    lt = profile.transforms.layers[0]
    shift = np.asarray(lt.key_shift, np.float32)
    writer = BlockWriter(lay, thr, "error", key_shift=shift, key_rotation=rotation, head_dim=hd)
    stores, rows = [], []
    used = start = 0
    for r, t in enumerate(lengths):
        nb = -(-t // bs)
        table[r, :nb] = order[used : used + nb]
        used += nb
        k, v = k_all[start : start + t], v_all[start : start + t]
        start += t
        slots = table[r][np.arange(t) // bs].astype(np.int64) * bs + np.arange(t) % bs
        writer.write(pool, upb, slots, k, v)
        store = PagedKVStore(profile, 1, hkv, hd)
        shape = (1, t, hkv, hd)
        store.append(
            0, torch.from_numpy(k).view(shape).transpose(1, 2), torch.from_numpy(v).view(shape).transpose(1, 2)
        )
        stores.append(store)
        rows.append((k, v))
    tables = BlockTables(lay, upb)
    tables.update(0, table, np.array(lengths), np.array(lengths))
    from types import SimpleNamespace

    return SimpleNamespace(
        profile=profile, lay=lay, pool=pool, upb=upb, table=table, tables=tables, stores=stores, rows=rows, thr=thr,
        grid=writer.static_grid,
    )  # fmt: skip


@pytest.mark.parametrize("rotation", [False, True])
def test_plus_blocks_hold_the_transformed_keys_and_16_bit_sink_tokens(rotation):
    """With an oaken-plus profile the blocks hold exactly the codec's records of the keys after the profile's online
    transform (``Transforms.key_rows``: the shift, then the rotation) and of the values, and each sequence's first
    block keeps its sink token's key and value rows at 16 bits: the bytes ``PagedKVStore`` holds for OakenCache."""
    from oakenkv.format.layout import to_records

    b = _plus_blocks(rotation)
    profile, lay, pool, upb, table, stores, rows, thr = (
        b.profile,
        b.lay,
        b.pool,
        b.upb,
        b.table,
        b.stores,
        b.rows,
        b.thr,
    )
    t = profile.transforms
    for r, (k, v) in enumerate(rows):
        n = len(k)
        kt = t.key_rows(0, k)
        for kind, x in enumerate((kt, v)):
            got = read_rows(pool, upb, lay, table[r], n, kind)
            want = encode(torch.from_numpy(x), tuple(thr[kind]), CFG)
            assert torch.equal(got.dense, want.dense) and torch.equal(got.sparse, want.sparse)
            # the store's pages hold the same records
            dense, sparse, _ = to_records(want)
            seq = stores[r].seqs[0]
            assert np.array_equal(stores[r].pool.read_dense(seq, kind), dense)
            assert np.array_equal(stores[r].pool.read_sparse(seq, kind)[0], sparse)
        sinks = read_sinks(pool, upb, lay, int(table[r, 0]))
        assert np.array_equal(sinks[0, 0], kt[0].astype(np.float16))
        assert np.array_equal(sinks[1, 0], v[0].astype(np.float16))
        assert np.array_equal(sinks.view(np.uint16)[:, 0], stores[r].sinks[0][0, :, 0].view(np.uint16))


@pytest.mark.parametrize(("rotation", "static"), [(False, False), (True, False), (True, True)])
def test_plus_decode_attention_on_blocks_equals_oaken_cache(rotation, static):
    """Decode attention on the blocks (queries rotated like the keys, the sink token merged at 16 bits) gives
    OakenCache's packed decode attention over a store holding the same keys and values (to float rounding)."""
    from oakenkv.hf.attention import packed_decode_attention
    from oakenkv.hf.cache import PackedKV
    from oakenkv.integrations.vllm.layout import LayerParams, decode_attention_rows
    from oakenkv.store.paged import KEY, VALUE

    b = _plus_blocks(rotation, seed=3, static=static)
    tables, pool, stores, rows, thr = b.tables, b.pool, b.stores, b.rows, b.thr
    q = np.random.default_rng(5).standard_normal((len(rows), 9, 64)).astype(np.float32)
    out = decode_attention_rows(tables, 0, pool, q, LayerParams(thr, 3, 0.125, 0.0, rotation, b.grid))
    for r, store in enumerate(stores):
        n = len(rows[r][0])
        want = packed_decode_attention(
            torch.from_numpy(q[r : r + 1, :, None]), PackedKV(store, 0, KEY, n), PackedKV(store, 0, VALUE, n), None,
            0.125,
        )[0, 0]  # fmt: skip
        np.testing.assert_allclose(out[r], want.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("rotation", "tile", "softcap", "static"),
    [(False, 512, 0.0, False), (True, 24, 0.0, False), (False, 24, 30.0, False), (True, 24, 0.0, True)],
)
def test_plus_prefill_attention_over_tiles_equals_attention_over_the_stored_values(rotation, tile, softcap, static):
    """A chunk of queries over the history and itself, tiles dequantized from the blocks (torch's flash attention
    per tile merged by log-sum-exp; with a soft cap, the plain online-softmax loop), equals float attention over
    what OakenCache reads back (``PagedKVStore.read``: decoded rows, the sink token at 16 bits, the
    rotation undone), causal from the chunk's first position."""
    from oakenkv.integrations.vllm.layout import LayerParams, prefill_attention
    from oakenkv.store.paged import KEY, VALUE

    b = _plus_blocks(rotation, seed=7, static=static)
    tables, pool, stores, rows, thr = b.tables, b.pool, b.stores, b.rows, b.thr
    for r, store in enumerate(stores):
        n = len(rows[r][0])
        s = min(n, 40)
        q = torch.from_numpy(np.random.default_rng(r).standard_normal((s, 9, 64)).astype(np.float32))
        params = LayerParams(thr, 3, 0.125, softcap, rotation, b.grid)
        got = prefill_attention(tables, 0, pool, r, q, params, tile=tile)
        k, v = store.read(0, KEY), store.read(0, VALUE)  # [1, H, n, hd]
        mask = (torch.arange(n)[None, :] <= torch.arange(n - s, n)[:, None])[None, None]
        want = float_attention(q.transpose(0, 1)[None], k, v, mask, 0.125, softcap or None)[0]
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize(
    ("rotation", "softcap", "static"), [(False, 0.0, False), (True, 30.0, False), (True, 0.0, True)]
)
def test_plus_first_chunk_by_vllms_kernel_equals_attention_over_the_stored_values(rotation, softcap, static):
    """A prompt's first chunk (no history) attended by vLLM's own CPU kernel over its dequantized rows
    (``chunk.ChunkAttention``, float32) equals float attention over what OakenCache reads back, and the tiled flash
    path; the scratch cache, reused for a shorter chunk after a longer one, gives the same."""
    chunk = pytest.importorskip("oakenkv.integrations.vllm.chunk")
    from oakenkv.integrations.vllm.layout import LayerParams, prefill_attention
    from oakenkv.store.paged import KEY, VALUE

    own = chunk.make(9, 3, 64)
    if own is None:
        pytest.skip("vLLM's CPU attention ops are not available here")
    b = _plus_blocks(rotation, seed=11, static=static)
    tables, pool, stores, rows, thr = b.tables, b.pool, b.stores, b.rows, b.thr
    params = LayerParams(thr, 3, 0.125, softcap, rotation, b.grid)
    order = sorted(range(len(stores)), key=lambda r: -len(rows[r][0]))  # longest first: the scratch is reused
    for r in order:
        n = len(rows[r][0])
        q = torch.from_numpy(np.random.default_rng(r).standard_normal((n, 9, 64)).astype(np.float32))
        got = prefill_attention(tables, 0, pool, r, q, params, own=own)
        tiled = prefill_attention(tables, 0, pool, r, q, params)
        k, v = stores[r].read(0, KEY), stores[r].read(0, VALUE)  # [1, H, n, hd]
        mask = (torch.arange(n)[None, :] <= torch.arange(n)[:, None])[None, None]
        want = float_attention(q.transpose(0, 1)[None], k, v, mask, 0.125, softcap or None)[0]
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(got.numpy(), tiled.numpy(), rtol=2e-5, atol=2e-5)


def test_chunk_attention_from_two_threads_at_once_gives_each_its_own_result():
    """The plugin's row threads take a step's prompts in turn: two first chunks attended at the same time, from two
    threads, each get what one call alone gives (vLLM's kernel, unguarded, gave wrong rows: its working memory is
    the process's)."""
    import threading

    from oakenkv.integrations.vllm import chunk

    own = chunk.make(9, 3, 64)
    if own is None:
        pytest.skip("vLLM's CPU attention ops are not available here")
    rng = np.random.default_rng(4)
    cases = []
    for s in (256, 200):
        q = torch.from_numpy(rng.standard_normal((s, 9, 64)).astype(np.float32))
        k, v = (rng.standard_normal((s, 192)).astype(np.float32) for _ in range(2))
        cases.append((q, k, v, own(q, k, v, 0.125, 0.0).clone()))
    wrong = []

    def run(case):
        q, k, v, alone = case
        for _ in range(20):
            if not torch.equal(own(q, k, v, 0.125, 0.0), alone):
                wrong.append(len(q))

    threads = [threading.Thread(target=run, args=(c,)) for c in cases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong


def test_block_tables_kept_across_steps_equal_tables_built_afresh():
    """The tables the builder keeps across steps (refilled from the first token that can have changed) equal a
    fresh fill at every step: rows growing by a token, a row taking other blocks (a preempted request recomputed),
    rows reordered, a row finishing, a chunked prefill going on."""
    from oakenkv.integrations.vllm.layout import BlockTables

    rng = np.random.default_rng(9)
    dim, bs = 64, 8
    lay = BlockLayout.make(dim, bs, CFG, sparse_bytes_per_token=40, sink_tokens=1)
    nblocks = 40
    _, pool, upb = _pool(lay, nblocks)
    k, v, thr = _kv(rng, 400, dim)
    writer = BlockWriter(lay, thr)
    # three requests: block lists and lengths
    blocks = {0: [3, 7], 1: [10, 11, 12], 2: [20]}
    lens = {0: 9, 1: 17, 2: 5}

    def write(req, a, b):
        t = np.arange(a, b)
        slots = np.array(blocks[req])[t // bs] * bs + t % bs
        writer.write(pool, upb, slots, k[t + 50 * req], v[t + 50 * req])

    for req in blocks:
        write(req, 0, lens[req])
    kept = BlockTables(lay, upb)
    order = [0, 1, 2]
    step = 0

    def check(qlens):
        nonlocal step
        step += 1
        width = max(len(blocks[r]) for r in order)
        bt = np.zeros((len(order), width), np.int32)
        for i, req in enumerate(order):
            bt[i, : len(blocks[req])] = blocks[req]
        sl = np.array([lens[req] for req in order])
        kept.update(step, bt, sl, np.array(qlens))
        fresh = BlockTables(lay, upb)
        fresh.update(0, bt, sl, np.array(qlens))
        a, b = kept.layer(0, pool), fresh.layer(0, pool)
        for i, req in enumerate(order):
            n = lens[req]
            for kind in (0, 1):
                assert np.array_equal(a.dense_pages[i, kind, :n], b.dense_pages[i, kind, :n])
                c = int(b.sparse_counts[i, kind])
                assert int(a.sparse_counts[i, kind]) == c
                assert np.array_equal(a.sparse_pages[i, kind, :c], b.sparse_pages[i, kind, :c])
                assert np.array_equal(a.sparse_first[i, kind, :c], b.sparse_first[i, kind, :c])
                assert np.array_equal(a.sparse_lengths[i, kind, :n], b.sparse_lengths[i, kind, :n])
            assert np.array_equal(kept.keep[i, : b.num_tokens], fresh.keep[i, : b.num_tokens])

    check([9, 17, 5])
    for _ in range(3):  # decode steps: one token each
        for req in order:
            if lens[req] % bs == 0:
                blocks[req].append(30 + len(blocks[req]) + 3 * req)
            write(req, lens[req], lens[req] + 1)
            lens[req] += 1
        check([1, 1, 1])
    # request 1 is preempted and recomputed in other blocks; request 2 goes first; request 0 ends
    blocks[1] = [13, 14, 15]
    write(1, 0, lens[1])
    order = [2, 1]
    check([1, lens[1]])
    # a chunked prefill goes on: request 2 gets 6 more tokens, into a new block too
    blocks[2].append(25)
    write(2, lens[2], lens[2] + 6)
    lens[2] += 6
    check([6, 1])


# ------------------------------------------------------------------------------------------------ overflow


def test_overflow_error_policy_names_the_block_and_keeps_it_consistent():
    rng = np.random.default_rng(3)
    k, v, thr = _kv(rng, 8, 192)
    lay = BlockLayout.make(192, 8, CFG, sparse_bytes_per_token=1)  # one 108-byte unit for 8 tokens
    _, pool, upb = _pool(lay, 2)
    w = BlockWriter(lay, thr, overflow="error")
    with pytest.raises(BlockOverflowError, match=r"block 1\b"):
        w.write(pool, upb, np.arange(8, 16), k, v)
    assert sum(w.stats.tokens) == 1
    # what was written before the overflowing record reads back as the codec's bytes
    written = 0
    ref = encode(torch.from_numpy(k), tuple(thr[0]), CFG)
    while written < 8 and int(ref.sparse_offsets[written + 1]) <= lay.sparse_area_bytes:
        written += 1
    got = read_rows(pool, upb, lay, np.array([1]), written, 0)
    assert torch.equal(got.sparse, ref.sparse[: int(ref.sparse_offsets[written])])


def test_overflow_clip_policy_fits_every_token_and_stays_close():
    rng = np.random.default_rng(4)
    n, dim = 64, 192
    k, v, thr = _kv(rng, n, dim)
    lay = BlockLayout.make(dim, 16, CFG, sparse_bytes_per_token=8)  # far below the ~19 bytes a token needs
    _, pool, upb = _pool(lay, 4)
    w = BlockWriter(lay, thr, overflow="clip")
    w.write(pool, upb, np.arange(n), k, v)
    assert w.stats.tokens[0] > 0 and w.stats.tokens[1] > 0 and w.stats.values_moved > 0
    kd, vd = dequantize(pool, upb, lay, np.arange(4), n, thr)  # every block still decodes
    for kind, (x, stored) in enumerate(((k, kd), (v, vd))):
        exact = decode(encode(torch.from_numpy(x), tuple(thr[kind]), CFG), tuple(thr[kind]), CFG)
        err_exact = float(((exact - torch.from_numpy(x)) ** 2).mean())
        err = float(((stored - torch.from_numpy(x)) ** 2).mean())
        assert err_exact < err < 20 * err_exact  # lossier than the codec alone, but not garbage
        # tokens before the first overflow of a block are stored exactly
        assert torch.equal(stored[0], exact[0])


def test_clip_outliers_keeps_the_largest_outer_values():
    rng = np.random.default_rng(5)
    x = rng.standard_t(3, size=256).astype(np.float32)
    thr = np.array([-1.5, -0.05, 0.05, 1.5], np.float32)
    groups = assign_groups(torch.from_numpy(x), tuple(thr)).numpy()
    outer = np.flatnonzero(groups == 2)
    for keep in (0, 3, len(outer), 1000):
        y, moved = clip_outliers(x, thr, keep)
        g = assign_groups(torch.from_numpy(y), tuple(thr)).numpy()
        kept = np.flatnonzero(g != GROUP_MIDDLE)
        assert len(kept) == min(keep, int((groups != GROUP_MIDDLE).sum())) and moved == int(
            (groups != GROUP_MIDDLE).sum()
        ) - len(kept)
        assert np.array_equal(y[kept], x[kept])  # kept values unchanged, moved ones are middle values now
        if 0 < keep <= len(outer):
            excess = np.maximum(x[outer] - thr[3], thr[0] - x[outer])
            assert set(kept) == set(outer[np.argsort(-excess, kind="stable")[:keep]])
    y, _ = clip_outliers(x, thr, 0)
    assert np.all(np.abs(y - x)[groups == 1] <= 0.1 + 1e-6)  # inner values moved to the nearer inner threshold


# ------------------------------------------------------------------------------------------------ settings


def test_settings_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV_PROFILE, raising=False)
    assert Settings.from_env() is None
    found = Settings.from_env(tmp_path / "found.json")  # a profile found in the served directory
    assert found is not None and found.profile == tmp_path / "found.json" and found.attention_threads is None
    monkeypatch.setenv(ENV_PROFILE, str(tmp_path / "thr.json"))  # the environment's profile wins
    monkeypatch.setenv(ENV_SPARSE_BYTES, "30")
    monkeypatch.setenv(ENV_OVERFLOW, "error")
    monkeypatch.setenv(ENV_THREADS, "2")
    s = Settings.from_env(tmp_path / "found.json")
    assert (s.profile, s.sparse_bytes_per_token, s.overflow, s.attention_threads) == (
        tmp_path / "thr.json",
        30.0,
        "error",
        2,
    )
    with pytest.raises(FileNotFoundError, match="no such profile file"):
        register()
    monkeypatch.setenv(ENV_OVERFLOW, "drop")
    with pytest.raises(ValueError, match="'clip' or 'error'"):
        Settings.from_env()
    monkeypatch.setenv(ENV_OVERFLOW, "clip")
    monkeypatch.setenv(ENV_SPARSE_BYTES, "lots")
    with pytest.raises(ValueError, match="number of bytes"):
        Settings.from_env()
    monkeypatch.setenv(ENV_SPARSE_BYTES, "30")
    monkeypatch.setenv(ENV_THREADS, "0")
    with pytest.raises(ValueError, match="number of threads"):
        Settings.from_env()
    monkeypatch.setenv(ENV_THREADS, "2")
    assert Settings.from_env().kernels == "numba"
    monkeypatch.setenv(ENV_KERNELS, "triton")
    assert Settings.from_env().kernels == "triton"
    monkeypatch.setenv(ENV_KERNELS, "cuda")
    with pytest.raises(ValueError, match="'numba' or 'triton'"):
        Settings.from_env()


def test_profiles_the_plugin_cannot_serve_are_refused_with_their_reason(default_model, tmp_path):
    """Profiles of another granularity or scale dtype fail at load, naming why; an oaken-plus profile loads, and is
    refused for a served model whose weights do not carry its folded transforms (the config's fold mark), as a
    paper profile is for weights that carry some."""
    import copy
    import dataclasses

    from kv_helpers import quick_thresholds
    from oakenkv.calibrate.transforms import identity
    from oakenkv.integrations.vllm import check_served, load_profile

    thr = quick_thresholds(default_model)
    good = tmp_path / "paper.json"
    thr.save(good)
    assert load_profile(good) is not None
    fp = thr.fingerprint
    plus = dataclasses.replace(thr, transforms=identity(fp.num_layers, fp.num_kv_heads, fp.head_dim))
    plus.save(tmp_path / "plus.json")
    assert load_profile(tmp_path / "plus.json").transforms is not None
    cases = {
        "head.json": (dataclasses.replace(thr, config=dataclasses.replace(thr.config, granularity="head")), "'token'"),
        "fp32.json": (dataclasses.replace(thr, config=dataclasses.replace(thr.config, scale_dtype="float32")), "fp16"),
    }
    for name, (bad, reason) in cases.items():
        bad.save(tmp_path / name)
        with pytest.raises(ValueError, match=reason):
            load_profile(tmp_path / name)
    # static grids (records of the outer scales alone): served, in blocks of smaller records
    static = dataclasses.replace(thr, config=thr.config.replace(static_grids=True))
    static.save(tmp_path / "static.json")
    assert load_profile(tmp_path / "static.json").config.static_grids
    assert BlockLayout.make(192, 128, static.config).unit == BlockLayout.make(192, 128, thr.config).unit - 8
    config = copy.deepcopy(default_model.model.config)
    check_served(thr, good, None, config)  # the paper's profile, plain weights
    with pytest.raises(ValueError, match="must be folded into the served weights"):
        check_served(plus, "plus.json", None, config)
    config.oakenkv_transforms = plus.transforms.digest()
    check_served(plus, "plus.json", None, config)  # weights folded with these transforms
    with pytest.raises(ValueError, match="carry oaken-plus transforms"):
        check_served(thr, good, None, config)
    config.oakenkv_transforms = "0" * 64
    with pytest.raises(ValueError, match="other transforms"):
        check_served(plus, "plus.json", None, config)


def test_an_edited_profile_is_read_again(default_model, tmp_path):
    """The plugin parses a profile once per content, not per path: a file changed on disk is never served from the
    copy of its old content."""
    import dataclasses

    from kv_helpers import quick_thresholds
    from oakenkv.calibrate.thresholds import GroupThresholds
    from oakenkv.integrations.vllm import load_profile

    thr = quick_thresholds(default_model)
    path = tmp_path / "thr.json"
    thr.save(path)
    first = load_profile(path)
    assert load_profile(path) is first  # same bytes: the parsed copy
    wider = GroupThresholds(*(1.5 * v for v in thr.keys[0].as_tuple()))
    edited = dataclasses.replace(thr, keys=(wider, *thr.keys[1:]))
    edited.save(path)
    again = load_profile(path)
    assert again is not first and again.layer(0, "key") == wider


def test_served_weights_digest_is_by_content(tmp_path):
    """The digest of a directory's safetensors weights depends on the tensors only (names, dtypes, shapes, bytes),
    not on how they are split over files or the files' metadata; one changed value changes it, and an exported
    profile is refused for other weights."""
    from safetensors.torch import save_file

    from oakenkv.integrations.vllm.served import ServedWeightsError, check_weights, weights_digest

    a = {"w": torch.arange(12, dtype=torch.float32).view(3, 4), "b": torch.ones(5, dtype=torch.bfloat16)}
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    save_file(a, one / "model.safetensors", metadata={"format": "pt"})
    save_file({"w": a["w"]}, two / "model-00001.safetensors")
    save_file({"b": a["b"]}, two / "model-00002.safetensors", metadata={"note": "other"})
    digest = weights_digest(one)
    assert digest.startswith("sha256:") and weights_digest(two) == digest
    b = dict(a, w=a["w"].clone())
    b["w"][1, 2] += 1
    save_file(b, one / "model.safetensors")
    assert weights_digest(one) != digest
    meta = {"export": {"weights": digest}}
    assert check_weights(meta, two, "p.json") == digest
    with pytest.raises(ServedWeightsError, match="other weights"):
        check_weights(meta, one, "p.json")
    with pytest.raises(ServedWeightsError, match="no exported weights"):
        check_weights({}, two, "p.json")
    with pytest.raises(ServedWeightsError, match=r"no \*\.safetensors"):
        weights_digest(tmp_path)


def test_export_refuses_an_output_that_is_not_an_export(tmp_path):
    from oakenkv.cli import run

    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    assert run(["export", "--out", str(tmp_path / "taken")]) == 2
    assert run(["export", "--out", str(tmp_path / "new"), "--preset", "kivi"]) == 2
    assert (tmp_path / "taken" / "notes.txt").read_text() == "mine" and not (tmp_path / "new").exists()


def test_export_refuses_a_symbolic_link_before_work(tmp_path):
    """An --out that is a link to a previous export was loaded, folded and written, then failed on rmtree."""
    from oakenkv.integrations.vllm import PROFILE_FILE
    from oakenkv.integrations.vllm.export import check_export_dir

    (tmp_path / "old").mkdir()
    (tmp_path / "old" / PROFILE_FILE).write_text("{}")
    (tmp_path / "link").symlink_to(tmp_path / "old")
    with pytest.raises(ValueError, match="is a symbolic link"):
        check_export_dir(tmp_path / "link")
    check_export_dir(tmp_path / "old")  # the export itself is replaced as before


def test_a_profile_name_that_is_not_a_file_is_refused_not_ignored(tmp_path):
    """``oakenkv-profile.json`` in a served directory that is a directory or a broken link made vLLM serve its own
    cache without a word; a missing one still means "not an Oaken model"."""
    from oakenkv.integrations.vllm import PROFILE_FILE, discover

    assert discover(tmp_path) is None
    (tmp_path / PROFILE_FILE).mkdir()
    with pytest.raises(ValueError, match="is not a regular profile file"):
        discover(tmp_path)
    (tmp_path / PROFILE_FILE).rmdir()
    (tmp_path / PROFILE_FILE).symlink_to(tmp_path / "gone.json")
    with pytest.raises(ValueError, match="is not a regular profile file"):
        discover(tmp_path)
    (tmp_path / "gone.json").write_text("{}")
    assert discover(tmp_path) == (tmp_path / "gone.json").resolve()


def test_a_second_engine_of_the_process_is_decided_for_its_own_model(monkeypatch, tmp_path):
    """vLLM caches the attention backend class per process (by head size and dtype, not model): a second in-process
    engine got the Oaken backend chosen for the first and served its model with the first one's profile (the
    shape check passed). The backend now decides again for the model it is built for, and refuses one with none."""
    import oakenkv.integrations.vllm as plugin

    a = Settings(profile=tmp_path / "a.json")
    decided = []

    def activate(model_dir, hf_config):  # (the real one checks the profile against the served model)
        decided.append(model_dir)
        plugin._ACTIVE_FOR = model_dir
        plugin._ACTIVE = a if model_dir == "A" else None
        return plugin._ACTIVE

    for key in (ENV_PROFILE, ENV_KERNELS, ENV_THREADS, ENV_CPUS, ENV_SPARSE_BYTES, ENV_OVERFLOW):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(plugin, "activate", activate)
    monkeypatch.setattr(plugin, "_ACTIVE_FOR", None)
    monkeypatch.setattr(plugin, "_ACTIVE", None)
    assert plugin.settings_for("A", None) is a and plugin.settings_for("A", None) is a
    assert decided == ["A"]  # an engine's layers: decided once
    with pytest.raises(RuntimeError, match="earlier engine of this process and reuses it for B"):
        plugin.settings_for("B", None)


def test_triton_kernels_on_the_cpu_engine_need_the_interpreter(monkeypatch, tmp_path):
    """``OAKENKV_VLLM_KERNELS=triton`` on the CPU engine without Triton's interpreter (or a GPU) started, then
    killed the engine at its first request ("0 active drivers"); it is refused while the engine starts."""
    _skip_without_vllm()
    import oakenkv.integrations.vllm as plugin
    from oakenkv.integrations.vllm import select

    settings = Settings(profile=tmp_path / "p.json", kernels="triton")
    monkeypatch.setattr(plugin, "activate", lambda model_dir, hf_config: settings)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="needs Triton's interpreter"):
        select.backend_class("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert select.backend_class("cpu").__name__ == "OakenCudaAttentionBackend"


# ================================================================================================ with vLLM

PROMPTS = ("The capital of France is",)
GREEDY_TOKENS = 32
#: vLLM's greedy tokens may leave OakenCache's only where its two best logits are this close (a near tie that a
#: one-step difference of a quantized cache flips; test_vllm_greedy_tokens_equal_oaken_cache's docstring), and
#: never within the first tokens. On the machine of session 13 (no AVX-512 VBMI2) the test prompt flipped at
#: token 14.
NEAR_TIE = 0.5
GREEDY_EQUAL_AT_LEAST = 8
#: Perplexity through vLLM vs ``eval ppl`` on the tests' 2 windows of 256 tokens. Not bit-equal: vLLM's float32 model
#: computes keys and values ~1e-6 away from transformers', and a value next to a 4-bit rounding boundary then takes
#: the other code; each attention sum order (SDPA over the whole history before, the tile loop now) reshuffles which
#: values flip. On these 2 windows that moved vLLM's perplexity by -0.98% (the tree before issue 32, dequantize +
#: SDPA) and -0.39% (this tree) from eval ppl's with the same profile. The benchmark measures the 0.5% goal on 8
#: windows of 512 tokens (docs/vllm.md).
PPL_TOLERANCE = 0.015
#: Sparse bytes per token and kind of the oaken-plus engine's blocks (see the plus_engine fixture).
PLUS_SPARSE_BYTES = 48.0


def _skip_without_vllm():
    return pytest.importorskip("vllm", reason="vLLM is not installed (make test-vllm runs these tests)")


@pytest.fixture(scope="module")
def profile_path(default_model, tmp_path_factory):
    """A quick profile of the default model (one forward pass; tests/kv_helpers.py), saved for the plugin."""
    _skip_without_vllm()
    from kv_helpers import quick_thresholds

    path = tmp_path_factory.mktemp("vllm") / "thr.json"
    quick_thresholds(default_model).save(path)
    return path


@pytest.fixture(scope="module")
def engine(profile_path, default_model):
    """vLLM's CPU engine with the plugin, float32, chunked prefill in chunks of 64 tokens, prefix caching on."""
    _skip_without_vllm()
    import sys

    import cloudpickle
    from vllm import LLM

    from oakenkv.integrations.vllm import disable, enable

    # collective_rpc with functions (worker_stats, the recorder below): vLLM sends them with cloudpickle when
    # allowed, and this module is not importable in its processes, so its functions travel by value.
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    enable(profile_path, overflow="error")
    llm = LLM(
        model=default_model.source,
        dtype="float32",
        max_model_len=512,
        max_num_batched_tokens=64,
        enable_chunked_prefill=True,
        enable_prefix_caching=True,
        enforce_eager=True,
        kv_cache_memory_bytes=32 << 20,
        seed=0,
    )
    yield llm
    disable()
    llm.llm_engine.engine_core.shutdown()


def _recorder_install(worker):
    """Runs in the worker: log every KV write (layer, slots, keys, values) and every decode attention call
    (layer, the rows' block tables and lengths, queries, outputs), in order."""
    from oakenkv.integrations.vllm.backend import OakenAttentionImpl

    if getattr(OakenAttentionImpl, "_test_log", None) is not None:
        OakenAttentionImpl._test_log.clear()
        return
    log = OakenAttentionImpl._test_log = []
    orig_update, orig_forward = OakenAttentionImpl.do_kv_cache_update, OakenAttentionImpl.forward

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        orig_update(self, layer, key, value, kv_cache, slot_mapping)
        n = slot_mapping.shape[0]
        log.append(("write", self, slot_mapping.numpy().copy(), key[:n].float().clone(), value[:n].float().clone()))

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        out = orig_forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        md = attn_metadata
        if md is not None and md.num_decodes:
            nd = md.num_decodes
            log.append(
                ("decode", self, md.block_table[:nd].copy(), md.seq_lens[:nd].copy(), query[:nd].float(), out[:nd])
            )
        return out

    OakenAttentionImpl.do_kv_cache_update = do_kv_cache_update
    OakenAttentionImpl.forward = forward


def _recorder_check(worker):
    """Runs in the worker, over the log of ``_recorder_install``:

    - every written token's stored records (of its slot's last write), read with the test's own reading of the
      layout, are exactly ``codec.encode``'s page records of the keys (after an oaken-plus profile's online transform,
      ``Transforms.key_rows``) and values vLLM computed, and a block's first tokens are in its sink area at 16 bits;
    - every decode attention output equals oakenkv's own ``OakenCache`` path (a ``PagedKVStore`` holding the same
      keys and values, and ``oakenkv.hf.attention.packed_decode_attention``) to float rounding: the kernel sums with
      fast-math reassociation, and a row shorter than the batch's longest has its last block of tokens padded
      with masked ones in vLLM, not in the reference, so the sums associate differently (~1e-7).

    Returns (records checked, record mismatches, decode rows checked, decode mismatches, largest difference).
    """
    from oakenkv.format.layout import to_records
    from oakenkv.hf.attention import packed_decode_attention
    from oakenkv.hf.cache import PackedKV
    from oakenkv.integrations.vllm.backend import OakenAttentionImpl
    from oakenkv.integrations.vllm.layout import read_sinks
    from oakenkv.kernels.codec import encode as enc_fn
    from oakenkv.store.paged import KEY, VALUE, PagedKVStore

    records = bad_records = rows = bad_rows = 0
    worst = 0.0
    history: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    # a slot written again (its block freed and given to another request, or a preempted request recomputed) holds
    # its last write: only that one is compared with the blocks' bytes
    last: dict[tuple[int, int], int] = {}
    for e, event in enumerate(OakenAttentionImpl._test_log):
        if event[0] == "write":
            for s in event[2]:
                last[event[1]._state.layer_index, int(s)] = e
    for e, event in enumerate(OakenAttentionImpl._test_log):
        impl = event[1]
        st = impl._state
        lay, pool, upb, index = st.layout, st.pool, st.units_per_block, st.layer_index
        thresholds = st.params.thresholds
        u, bs = lay.unit, lay.block_size
        transforms = impl.profile.transforms
        if event[0] == "write":
            _, _, slots, keys, values = event
            n = len(slots)
            rows_k = keys.reshape(n, -1).numpy()
            if transforms is not None:
                rows_k = transforms.key_rows(index, rows_k)
            for kind, x in enumerate((rows_k, values.reshape(n, -1).numpy())):
                enc = enc_fn(torch.from_numpy(x), tuple(thresholds[kind]), impl.profile.config)
                dense, sparse, offs = to_records(enc)
                for i, s in enumerate(slots):
                    if s < 0 or last[index, int(s)] != e:
                        continue
                    base, o = (s // bs) * upb * u, s % bs
                    rec = pool[base + (kind * bs + o) * u : base + (kind * bs + o + 1) * u]
                    hdr = base + lay.header_unit * u + kind * bs
                    lens = pool[hdr : hdr + bs].astype(np.int64)
                    start = base + (2 * bs + kind * lay.sparse_units) * u + int(lens[:o].sum())
                    ok = np.array_equal(rec, dense[i]) and np.array_equal(
                        pool[start : start + int(lens[o])], sparse[offs[i] : offs[i + 1]]
                    )
                    if o < lay.sink_tokens:
                        ok = ok and np.array_equal(
                            read_sinks(pool, upb, lay, s // bs)[kind, o], x[i].astype(np.float16)
                        )
                    records += 1
                    bad_records += not ok
            layer_hist = history.setdefault(index, {})
            for i, s in enumerate(slots):
                if s >= 0:
                    layer_hist[int(s)] = (keys[i].reshape(-1), values[i].reshape(-1))
            continue
        _, _, tables, lengths, q, out = event
        for r in range(len(lengths)):
            length = int(lengths[r])
            slots = tables[r][np.arange(length) // bs].astype(np.int64) * bs + np.arange(length) % bs
            k = torch.stack([history[index][int(s)][0] for s in slots])
            v = torch.stack([history[index][int(s)][1] for s in slots])
            store = PagedKVStore(impl.profile, impl.profile.num_layers, impl.num_kv_heads, impl.head_size)
            shape = (1, length, impl.num_kv_heads, impl.head_size)
            store.append(index, k.view(shape).transpose(1, 2), v.view(shape).transpose(1, 2))
            want = packed_decode_attention(
                q[r].view(1, impl.num_heads, 1, impl.head_size),
                PackedKV(store, index, KEY, length),
                PackedKV(store, index, VALUE, length),
                None,
                impl.scale,
            ).reshape(impl.num_heads, impl.head_size)
            rows += 1
            # equal up to float reassociation: the kernel's fast-math sums (issue 22) group a row's last block
            # differently when vLLM pads the batch to its longest row
            bad_rows += not torch.allclose(want, out[r].view_as(want), rtol=1e-5, atol=1e-6)
            worst = max(worst, float((want - out[r].view_as(want)).abs().max()))
    OakenAttentionImpl._test_log.clear()
    return records, bad_records, rows, bad_rows, worst


def _hf_greedy(model, tok, thr_path, prompts, n):
    """Greedy continuations with transformers and ``OakenCache`` (decode steps in the packed-page kernel), with
    each step's margin between the two best logits."""
    from oakenkv.calibrate.thresholds import Thresholds
    from oakenkv.hf.attention import oaken_attention
    from oakenkv.hf.cache import OakenCache
    from oakenkv.util.compat import cache_kwargs

    thr = Thresholds.load(thr_path)
    out = []
    with torch.inference_mode(), oaken_attention(model):
        for p in prompts:
            ids = tok(p, return_tensors="pt").input_ids
            cache = OakenCache(thr, model)
            gen = model.generate(
                ids,
                max_new_tokens=n,
                do_sample=False,
                min_new_tokens=n,
                output_scores=True,
                return_dict_in_generate=True,
                **cache_kwargs(model, cache),
            )
            top2 = torch.stack(gen.scores)[:, 0].topk(2, dim=-1).values  # [n, 2]: each step's two best logits
            margins = (top2[:, 0] - top2[:, 1]).tolist()
            out.append((ids[0].tolist(), gen.sequences[0, ids.shape[1] :].tolist(), margins))
    return out


def test_vllm_runs_the_oaken_backend_with_oaken_blocks(engine):
    from vllm import SamplingParams

    from oakenkv.integrations.vllm.backend import worker_stats

    engine.generate(["Hello"], SamplingParams(max_tokens=2, temperature=0))
    (stats,) = engine.collective_rpc(worker_stats)
    assert stats["backend"] == "OAKEN" and len(stats["layers"]) == 30
    lay = BlockLayout.make(192, 128, CFG)
    assert stats["layout"] == lay.describe()
    # vLLM's block count comes from Oaken's block size: 32 MiB over 30 layers of 34,668-byte blocks
    assert stats["num_blocks"] == (32 << 20) // (30 * lay.block_bytes)
    assert stats["totals"]["key_overflows"] == stats["totals"]["value_overflows"] == 0


def test_vllm_stores_the_codec_bytes_and_attends_like_oaken_cache(engine):
    """Inside the running engine: the bytes in vLLM's blocks are the codec's for the keys and values vLLM
    computed (bit for bit), and every decode attention output is OakenCache's given those keys and values (to
    float rounding: see _recorder_check)."""
    from vllm import SamplingParams

    engine.collective_rpc(_recorder_install)
    text = "The Eiffel Tower was built for the 1889 World's Fair. " * 12  # > 64 tokens: a chunked prefill
    engine.generate([text, "Short prompt"], SamplingParams(max_tokens=6, temperature=0))
    (result,) = engine.collective_rpc(_recorder_check)
    records, bad_records, rows, bad_rows, worst = result
    assert records >= 2 * 30 * 150 and bad_records == 0
    assert rows >= 30 * 2 * 5 and bad_rows == 0, worst


def test_vllm_greedy_tokens_equal_oaken_cache(engine, default_model, profile_path):
    """End to end: vLLM with the plugin generates OakenCache's greedy tokens (transformers, the same profile), up
    to a near tie of OakenCache's logits after the first GREEDY_EQUAL_AT_LEAST tokens.

    Exact only as far as vLLM's float32 model matches transformers': their keys and values differ by ~1e-6,
    which now and then moves a group's min or max across an fp16 rounding boundary of its scale; the quantized
    caches then differ by a step and a near-tied token can flip later on. On other prompts this happens after a
    few tokens (docs/vllm.md, benchmarks/bench_vllm.py greedy); the test above checks the plugin itself given
    identical keys and values, bit for bit.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    ref = _hf_greedy(default_model.model, default_model.tokenizer, profile_path, PROMPTS, GREEDY_TOKENS)
    outs = engine.generate(
        [TokensPrompt(prompt_token_ids=ids) for ids, _, _ in ref],
        SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0, ignore_eos=True),
    )
    for (_, want, margins), o in zip(ref, outs, strict=True):
        got = list(o.outputs[0].token_ids)
        assert len(got) == len(want)
        first = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
        if first is not None:
            # allowed only at a near tie of OakenCache's own logits, after the first tokens agree
            assert first >= GREEDY_EQUAL_AT_LEAST and margins[first] < NEAR_TIE, (first, margins[first], got, want)


def test_vllm_prefix_cache_hit_gives_the_same_tokens(engine):
    from vllm import SamplingParams

    prompt = "A long shared system prompt about the history of Paris and its monuments. " * 20  # > 2 blocks
    params = SamplingParams(max_tokens=12, temperature=0)
    first = engine.generate([prompt], params)[0]
    second = engine.generate([prompt], params)[0]
    assert (second.num_cached_tokens or 0) >= 128  # at least one whole block came from the prefix cache
    assert list(second.outputs[0].token_ids) == list(first.outputs[0].token_ids)


def test_vllm_perplexity_equals_eval_ppl(engine, profile_path):
    """Prompt logprobs through vLLM (chunked prefill over the Oaken blocks) vs ``eval ppl --method oaken``."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from oakenkv.assets.data import load_text, token_windows
    from oakenkv.eval.ppl import run_ppl

    res = run_ppl("default", "oaken", thresholds=str(profile_path), window=256, max_windows=2)
    ids = token_windows(engine.get_tokenizer(), load_text("wikitext2"), window=256, max_windows=2)
    outs = engine.generate(
        [TokensPrompt(prompt_token_ids=w.tolist()) for w in ids],
        SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0),
    )
    nll = 0.0
    for w, o in zip(ids, outs, strict=True):
        nll -= sum(lp[t].logprob for t, lp in zip(w.tolist()[1:], o.prompt_logprobs[1:], strict=True))
    ppl = math.exp(nll / res.tokens)
    assert abs(ppl / res.ppl - 1) < PPL_TOLERANCE, (ppl, res.ppl)


def test_impl_refuses_what_it_does_not_support():
    _skip_without_vllm()
    from oakenkv.integrations.vllm.backend import OakenAttentionImpl

    with pytest.raises(NotImplementedError, match="kv_cache_dtype='fp8'"):
        OakenAttentionImpl(9, 64, 0.125, 3, None, None, "fp8")
    with pytest.raises(NotImplementedError, match="sliding-window"):
        OakenAttentionImpl(9, 64, 0.125, 3, None, 512, "auto")
    with pytest.raises(NotImplementedError, match="ALiBi"):
        OakenAttentionImpl(9, 64, 0.125, 3, [0.5] * 9, None, "auto")


@pytest.mark.parametrize(
    ("total", "tp", "want"),
    [
        (2, 1, [(None, None)]),
        (2, 2, [(0, 64), (64, 128)]),  # each rank its own head (Qwen2.5-Coder-0.5B at tensor_parallel_size=2)
        (4, 2, [(0, 128), (128, 256)]),  # two heads each
        (2, 4, [(0, 64), (0, 64), (64, 128), (64, 128)]),  # vLLM replicates a head over tp / total ranks
        (1, 2, [(0, 64), (0, 64)]),  # one KV head (MQA): every rank holds a copy
    ],
)
def test_each_tensor_parallel_rank_takes_its_own_heads_of_the_profiles_row(monkeypatch, total, tp, want):
    """The key shift (an oaken-plus profile's, per channel of the whole row) is sliced to the KV heads this rank
    stores, as vLLM assigns them: ``total // tp`` consecutive heads per rank, or, with more ranks than heads, head
    ``rank * total // tp`` replicated."""
    _skip_without_vllm()
    from types import SimpleNamespace

    import vllm.distributed

    from oakenkv.integrations.vllm.backend import OakenAttentionImpl

    got = []
    for rank in range(tp):
        monkeypatch.setattr(vllm.distributed, "get_tensor_model_parallel_rank", lambda r=rank: r)
        impl = SimpleNamespace(
            tp_size=tp, num_kv_heads=max(total // tp, 1), head_size=64,
            profile=SimpleNamespace(fingerprint=SimpleNamespace(num_kv_heads=total)),
        )  # fmt: skip
        s = OakenAttentionImpl._rank_slice(impl)  # type: ignore[arg-type]
        got.append((s.start, s.stop))
    assert got == want


# ------------------------------------------------------------------------------------------------ oaken-plus, exported


@pytest.fixture(scope="module")
def plus_dir(default_model, tmp_path_factory):
    """``oakenkv export --model default --preset oaken-plus --out DIR`` (the profile shipped for the default model)."""
    _skip_without_vllm()
    from oakenkv.cli import run
    from oakenkv.integrations.vllm import PROFILE_FILE

    out = tmp_path_factory.mktemp("export") / "smollm2-oaken-plus"
    assert run(["export", "--model", "default", "--preset", "oaken-plus", "--out", str(out)]) == 0
    assert {p.name for p in out.iterdir()} >= {
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", PROFILE_FILE
    }  # fmt: skip
    return out


def _export_engine(model_dir, **settings):
    """vLLM's CPU engine on an exported directory, no profile named: the plugin finds it there. float32, chunked
    prefill in chunks of 64 tokens, prefix caching on. The environment is cleared first (an engine built before
    must not lend its profile), then the plugin configured with ``settings`` and exact bytes everywhere (the
    codec's, no record clipped): room for the test prompts' densest blocks. With the default capacity (1.35 x the
    expected COO bytes) oaken-plus clips a few records of WikiText (docs/vllm.md) and many of this file's repetitive
    prompt (38.6 COO bytes per token in one block of layer 20's keys)."""
    import sys

    import cloudpickle
    from vllm import LLM

    from oakenkv.integrations.vllm import configure, disable

    disable()
    configure(overflow="error", sparse_bytes_per_token=PLUS_SPARSE_BYTES, **settings)
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    return LLM(
        model=str(model_dir),
        dtype="float32",
        max_model_len=512,
        max_num_batched_tokens=64,
        enable_chunked_prefill=True,
        enable_prefix_caching=True,
        enforce_eager=True,
        kv_cache_memory_bytes=32 << 20,
        seed=0,
    )


@pytest.fixture(scope="module")
def plus_engine(plus_dir, engine):
    """The engine on the exported oaken-plus directory (built after the paper engine), with the plugin's own decode
    threads on (OAKENKV_VLLM_ATTENTION_CPUS; CPU 0, which every machine has): this engine's tests cover steps
    shared with them, the paper engine's the worker's thread alone."""
    llm = _export_engine(plus_dir, attention_cpus="0")
    yield llm
    llm.llm_engine.engine_core.shutdown()


def test_vllm_serves_the_exported_directory_with_its_profile(plus_engine, plus_dir):
    """The plugin found the directory's profile by itself: Oaken blocks with a sink area; with the default sparse
    capacity an oaken-plus block holds >= 2.7x bf16's tokens, the sink area included."""
    from vllm import SamplingParams

    from oakenkv.integrations.vllm import PROFILE_FILE
    from oakenkv.integrations.vllm.backend import worker_stats

    plus_engine.generate(["Hello"], SamplingParams(max_tokens=2, temperature=0))
    (stats,) = plus_engine.collective_rpc(worker_stats)
    assert stats["backend"] == "OAKEN" and stats["profile"] == str((plus_dir / PROFILE_FILE).resolve())
    lay = BlockLayout.make(192, 128, CFG, PLUS_SPARSE_BYTES, sink_tokens=1)
    assert stats["layout"] == lay.describe() and lay.sink_tokens == 1
    assert stats["num_blocks"] == (32 << 20) // (30 * lay.block_bytes)
    default = BlockLayout.make(192, 128, CFG, sink_tokens=1)
    assert 2 * 192 * 2 / default.bytes_per_token >= 2.7  # bf16 K and V per token and layer, against Oaken's block


def test_vllm_plus_stores_the_codec_bytes_and_attends_like_oaken_cache(plus_engine):
    """As for the paper's profile, with the oaken-plus online parts: transformed keys' records, sink tokens at 16
    bits in each sequence's first block, decode outputs equal to OakenCache's over the same keys and values."""
    from vllm import SamplingParams

    plus_engine.collective_rpc(_recorder_install)
    text = "The Eiffel Tower was built for the 1889 World's Fair. " * 12  # > 64 tokens: a chunked prefill
    plus_engine.generate([text, "Short prompt"], SamplingParams(max_tokens=6, temperature=0))
    (result,) = plus_engine.collective_rpc(_recorder_check)
    records, bad_records, rows, bad_rows, worst = result
    assert records >= 2 * 30 * 150 and bad_records == 0
    assert rows >= 30 * 2 * 5 and bad_rows == 0, worst


def test_vllm_steps_shared_with_the_plugins_threads_attend_like_oaken_cache(plus_engine):
    """With ``OAKENKV_VLLM_ATTENTION_CPUS`` (the plus engine's), decode steps of many rows are shared with the
    plugin's own thread and prefills of several requests taken in turn: the records are the codec's and every
    decode output still equals OakenCache's. The token budget of 64 per step admits the requests a few at a time, so
    later ones reuse the blocks of finished ones, and a prompt's last chunk can be one token behind another
    request's longer chunk (the builder once refused that step: "one-token queries first")."""
    from vllm import SamplingParams

    from oakenkv.integrations.vllm.backend import worker_stats
    from oakenkv.integrations.vllm.layout import ROW_THREADS_MIN_TOKENS

    plus_engine.collective_rpc(_recorder_install)
    (before,) = plus_engine.collective_rpc(worker_stats)
    texts = [f"Item {i}: the river rises in the hills and runs {i} miles to the sea. " * 10 for i in range(8)]
    plus_engine.generate(texts, SamplingParams(max_tokens=4, temperature=0))
    (stats,) = plus_engine.collective_rpc(worker_stats)
    assert stats["attention_cpus"] == [0]
    assert ROW_THREADS_MIN_TOKENS <= 8 * 150 and (stats["row_thread_runs"] > before["row_thread_runs"] + 30)
    (result,) = plus_engine.collective_rpc(_recorder_check)
    records, bad_records, rows, bad_rows, worst = result
    assert records >= 2 * 30 * 8 * 120 and bad_records == 0
    assert rows >= 30 * 8 * 3 and bad_rows == 0, worst


def test_vllm_plus_greedy_tokens_equal_oaken_cache_on_the_same_folded_model(plus_engine, plus_dir):
    """vLLM on the exported directory generates the greedy tokens of transformers + ``OakenCache`` on the same
    directory (the folded weights, its profile), up to a near tie after the first GREEDY_EQUAL_AT_LEAST tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from oakenkv.integrations.vllm import PROFILE_FILE

    model = AutoModelForCausalLM.from_pretrained(plus_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(plus_dir)
    ref = _hf_greedy(model, tok, plus_dir / PROFILE_FILE, PROMPTS, GREEDY_TOKENS)
    outs = plus_engine.generate(
        [TokensPrompt(prompt_token_ids=ids) for ids, _, _ in ref],
        SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0, ignore_eos=True),
    )
    for (_, want, margins), o in zip(ref, outs, strict=True):
        got = list(o.outputs[0].token_ids)
        first = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
        if first is not None:
            assert first >= GREEDY_EQUAL_AT_LEAST and margins[first] < NEAR_TIE, (first, margins[first], got, want)


def _tiny_family(family: str, vocab: int):
    """A small random model of ``family`` whose oaken-plus transforms fold in a way the default model's do not."""
    import transformers as tf

    torch.manual_seed(0)
    common = dict(
        vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=4096,
    )  # fmt: skip
    if family == "olmo2":  # q/k norms over the whole projection: per-head key scales in their weights
        return tf.Olmo2ForCausalLM(tf.Olmo2Config(**common, num_key_value_heads=2, pad_token_id=0))
    if family == "phi3":  # one fused qkv_proj [q | k | v]
        return tf.Phi3ForCausalLM(tf.Phi3Config(**common, num_key_value_heads=2, pad_token_id=0))
    if family == "gpt2":  # Conv1D c_attn [q | k | v] and c_proj; learned positions
        return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=vocab, n_embd=128, n_layer=2, n_head=4, n_positions=1024))
    if family == "opt":  # out_proj; learned positions
        return tf.OPTForCausalLM(tf.OPTConfig(vocab_size=vocab, hidden_size=128, ffn_dim=256, num_hidden_layers=2,
                                              num_attention_heads=4, max_position_embeddings=1024,
                                              word_embed_proj_dim=128))  # fmt: skip
    return tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(**common))  # query_key_value per head, partial rotary


@pytest.mark.parametrize("family", ["olmo2", "phi3", "gpt-neox", "gpt2", "opt"])
def test_vllm_serves_other_families_exported_with_oaken_plus(family, default_model, tmp_path):
    """``oakenkv export`` of a random OLMo 2, Phi-3, GPT-NeoX, GPT-2 and OPT (the folds of docs/plus.md, "Which
    models"): vLLM on the directory generates the greedy tokens of transformers + ``OakenCache`` on it."""
    _skip_without_vllm()
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from oakenkv.cli import run
    from oakenkv.integrations.vllm import PROFILE_FILE

    tok = default_model.tokenizer
    src, out = tmp_path / family, tmp_path / f"{family}-oaken-plus"
    _tiny_family(family, len(tok)).save_pretrained(src)
    tok.save_pretrained(src)
    assert run(["export", "--model", str(src), "--preset", "oaken-plus", "--out", str(out)]) == 0
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ref = _hf_greedy(model, tok, out / PROFILE_FILE, PROMPTS, 12)
    llm = _export_engine(out)
    try:
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=ids) for ids, _, _ in ref],
            SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
        )
    finally:
        llm.llm_engine.engine_core.shutdown()
    for (_, want, margins), o in zip(ref, outs, strict=True):
        got = list(o.outputs[0].token_ids)
        first = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
        if first is not None:  # (a random model's logits: allow a near tie, never before the fourth token)
            assert first >= 4 and margins[first] < NEAR_TIE, (first, margins[first], got, want)


def test_vllm_device_backend_under_the_interpreter_serves_oaken_cache_tokens(default_model, tmp_path, monkeypatch):
    """The CUDA backend (``OAKEN_CUDA``: the Triton kernels over the same blocks, ``device.py``), selected on the CPU
    engine by ``OAKENKV_VLLM_KERNELS=triton`` and run under the Triton interpreter, serves a random Llama exported
    with oaken-plus (key shift, rotations, a sink token): chunked prefill, prefix-cache hits and decode steps give
    the greedy tokens of transformers + ``OakenCache`` on the directory, and the CPU backend's."""
    _skip_without_vllm()
    pytest.importorskip("triton")
    import transformers as tf
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from oakenkv.cli import run
    from oakenkv.integrations.vllm import CUDA_BACKEND_NAME, PROFILE_FILE
    from oakenkv.integrations.vllm.backend import worker_stats

    tok = default_model.tokenizer
    src, out = tmp_path / "llama", tmp_path / "llama-oaken-plus"
    torch.manual_seed(0)
    config = tf.LlamaConfig(
        vocab_size=len(tok), hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096,
    )  # fmt: skip
    tf.LlamaForCausalLM(config).save_pretrained(src)
    tok.save_pretrained(src)
    assert run(["export", "--model", str(src), "--preset", "oaken-plus", "--out", str(out)]) == 0
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    prompts = (*PROMPTS, "A prompt long enough to be prefilled in two chunks of sixty-four tokens: " * 5)
    assert len(tok(prompts[1]).input_ids) > 64
    ref = _hf_greedy(model, tok, out / PROFILE_FILE, prompts, 8)
    got = {}
    for kernels in ("triton", "numba"):
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # (worker_stats, a callable RPC)
        llm = _export_engine(out, kernels=kernels)
        assert os.environ[ENV_KERNELS] == kernels
        try:
            outs = llm.generate(
                [TokensPrompt(prompt_token_ids=ids) for ids, _, _ in ref] * 2,  # the second time: prefix-cache hits
                SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
            )
            (stats,) = llm.collective_rpc(worker_stats)
        finally:
            llm.llm_engine.engine_core.shutdown()
        assert stats["backend"] == (CUDA_BACKEND_NAME if kernels == "triton" else "OAKEN"), stats
        assert stats["times_s"]["decode_calls"] > 0 and stats["times_s"]["prefill_calls"] > 0, stats
        got[kernels] = [list(o.outputs[0].token_ids) for o in outs]
    for i, (_, want, margins) in enumerate(ref * 2):
        for kernels in got:
            g = got[kernels][i]
            first = next((j for j, (a, b) in enumerate(zip(g, want, strict=True)) if a != b), None)
            if first is not None:  # (a random model's logits: allow a near tie, never before the fourth token)
                assert first >= 4 and margins[first] < NEAR_TIE, (kernels, first, margins[first], g, want)


def test_cuda_backend_is_registered_and_validates_as_vllms_cuda_platform_asks(monkeypatch, tmp_path, caplog):
    """``register()`` adds ``OAKEN_CUDA`` and points ``FLASH_ATTN`` (CUDA's first choice) at the selector;
    ``disable()`` takes that back. ``validate_configuration`` (what the CUDA platform calls, here with a stubbed
    device capability) passes fp16/bf16 on sm_80+ and names what it refuses, with a warning that vLLM will fall back
    to its own KV cache."""
    _skip_without_vllm()
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from oakenkv.integrations.vllm import CUDA_BACKEND_NAME, SELECT_CUDA_PATH, disable
    from oakenkv.integrations.vllm.cuda import OakenCudaAttentionBackend as B

    monkeypatch.delenv(ENV_PROFILE, raising=False)
    register()
    assert AttentionBackendEnum[CUDA_BACKEND_NAME].get_path().endswith("cuda.OakenCudaAttentionBackend")
    assert AttentionBackendEnum.FLASH_ATTN.get_path() == SELECT_CUDA_PATH
    disable()
    assert not AttentionBackendEnum.FLASH_ATTN.is_overridden()
    kw = dict(
        head_size=64, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=16, use_mla=False, has_sink=False,
        use_sparse=False, use_mm_prefix=False, use_per_head_quant_scales=False, attn_type="decoder",
    )  # fmt: skip
    assert B.validate_configuration(device_capability=DeviceCapability(9, 0), **kw) == []
    assert B.validate_configuration(device_capability=DeviceCapability(8, 0), **{**kw, "dtype": torch.float16}) == []
    with caplog.at_level("WARNING"):
        assert B.validate_configuration(device_capability=DeviceCapability(7, 5), **kw) == [
            "compute capability not supported"
        ]
    assert "falls back" in caplog.text
    assert "head_size not supported" in B.validate_configuration(
        device_capability=DeviceCapability(9, 0), **{**kw, "head_size": 8}
    )
    assert "kv_cache_dtype not supported" in B.validate_configuration(
        device_capability=DeviceCapability(9, 0), **{**kw, "kv_cache_dtype": "fp8"}
    )


def test_vllm_plus_perplexity_equals_eval_ppl(plus_engine, plus_dir):
    """Prompt logprobs through vLLM on the exported directory (chunked prefill over the blocks, sink tokens at 16
    bits) vs ``eval ppl --method oaken-plus`` with the same profile on the same windows: within 0.5%."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from oakenkv.assets.data import load_text, token_windows
    from oakenkv.eval.ppl import run_ppl
    from oakenkv.integrations.vllm import PROFILE_FILE

    res = run_ppl("default", "oaken-plus", thresholds=str(plus_dir / PROFILE_FILE), window=256, max_windows=2)
    ids = token_windows(plus_engine.get_tokenizer(), load_text("wikitext2"), window=256, max_windows=2)
    outs = plus_engine.generate(
        [TokensPrompt(prompt_token_ids=w.tolist()) for w in ids],
        SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0),
    )
    nll = 0.0
    for w, o in zip(ids, outs, strict=True):
        nll -= sum(lp[t].logprob for t, lp in zip(w.tolist()[1:], o.prompt_logprobs[1:], strict=True))
    ppl = math.exp(nll / res.tokens)
    assert abs(ppl / res.ppl - 1) < PPL_TOLERANCE, (ppl, res.ppl)


@pytest.fixture(scope="module")
def static_dir(plus_dir, tmp_path_factory):
    """``oakenkv export --preset oaken-plus --static-grids``: the plus export's weights and profile, its config with
    static middle/inner grids (each token's records hold the outer scales alone)."""
    from oakenkv.cli import run

    out = tmp_path_factory.mktemp("export") / "smollm2-oaken-plus-static"
    assert run(["export", "--model", "default", "--preset", "oaken-plus", "--static-grids", "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def static_engine(static_dir, plus_engine):
    """The engine on the static-grid export (no plugin threads)."""
    llm = _export_engine(static_dir)
    yield llm
    llm.llm_engine.engine_core.shutdown()


def test_vllm_static_grids_store_the_codec_bytes_and_attend_like_oaken_cache(static_engine, static_dir):
    """With static grids the blocks hold records of the outer scales alone (8 bytes smaller than the plus export's,
    so more blocks in the same memory), exactly the codec's records, and decode outputs equal OakenCache's."""
    from vllm import SamplingParams

    from oakenkv.integrations.vllm import PROFILE_FILE
    from oakenkv.integrations.vllm.backend import worker_stats

    static_engine.collective_rpc(_recorder_install)
    text = "The Eiffel Tower was built for the 1889 World's Fair. " * 12  # > 64 tokens: a chunked prefill
    static_engine.generate([text, "Short prompt"], SamplingParams(max_tokens=6, temperature=0))
    (stats,) = static_engine.collective_rpc(worker_stats)
    assert stats["profile"] == str((static_dir / PROFILE_FILE).resolve())
    lay = BlockLayout.make(192, 128, CFG.replace(static_grids=True), PLUS_SPARSE_BYTES, sink_tokens=1)
    plus = BlockLayout.make(192, 128, CFG, PLUS_SPARSE_BYTES, sink_tokens=1)
    assert stats["layout"] == lay.describe() and lay.unit == plus.unit - 8
    assert stats["num_blocks"] == (32 << 20) // (30 * lay.block_bytes) > (32 << 20) // (30 * plus.block_bytes)
    (result,) = static_engine.collective_rpc(_recorder_check)
    records, bad_records, rows, bad_rows, worst = result
    assert records >= 2 * 30 * 150 and bad_records == 0
    assert rows >= 30 * 2 * 5 and bad_rows == 0, worst


def test_vllm_static_perplexity_equals_eval_ppl(static_engine, static_dir):
    """Prompt logprobs through vLLM with static grids vs ``eval ppl`` with the same (static-grid) profile: within
    the same tolerance as per-row grids."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from oakenkv.assets.data import load_text, token_windows
    from oakenkv.eval.ppl import run_ppl
    from oakenkv.integrations.vllm import PROFILE_FILE

    res = run_ppl("default", "oaken-plus", thresholds=str(static_dir / PROFILE_FILE), window=256, max_windows=2)
    # the profile's static grids ran: 2 stored scales per row, not 6 (per-row oaken-plus stores ~5.4 bits)
    assert res.effective_bits < 5.25, (res.method, res.effective_bits)
    ids = token_windows(static_engine.get_tokenizer(), load_text("wikitext2"), window=256, max_windows=2)
    outs = static_engine.generate(
        [TokensPrompt(prompt_token_ids=w.tolist()) for w in ids],
        SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0),
    )
    nll = 0.0
    for w, o in zip(ids, outs, strict=True):
        nll -= sum(lp[t].logprob for t, lp in zip(w.tolist()[1:], o.prompt_logprobs[1:], strict=True))
    ppl = math.exp(nll / res.tokens)
    assert abs(ppl / res.ppl - 1) < PPL_TOLERANCE, (ppl, res.ppl)


def test_a_profile_for_other_weights_is_refused_at_start(plus_dir, tmp_path):
    """The check the worker makes before building the model (``activate``): the exported profile beside other
    weights of the same shape is refused by their content, whatever the path; beside its own weights (a copy of
    the directory elsewhere) it is served."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    from oakenkv.integrations.vllm import PROFILE_FILE, activate, disable

    disable()
    hf_config = AutoConfig.from_pretrained(plus_dir)
    other = tmp_path / "other"
    shutil.copytree(plus_dir, other)
    assert activate(str(other), hf_config).profile == (other / PROFILE_FILE).resolve()  # moved: still served
    weights = load_file(other / "model.safetensors")
    name = sorted(weights)[0]
    weights[name] = weights[name].clone()
    weights[name].view(-1)[0] += 1.0
    save_file(weights, other / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="exported with other weights"):
        activate(str(other), hf_config)
    assert activate(str(tmp_path), hf_config) is None  # no profile there, none named: vLLM's own cache


def test_openai_server_answers_with_the_exported_directory(plus_dir, tmp_path):
    """``python -m vllm.entrypoints.openai.api_server --model DIR`` (no other setting) serves the exported
    directory with the Oaken backend, and the ``openai`` client gets a completion, a streamed chat and an ``n = 4``
    completion."""
    import socket
    import subprocess
    import sys
    import time

    from openai import OpenAI

    from oakenkv.integrations.vllm import ENV_PROFILE

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != ENV_PROFILE}
    log_path = tmp_path / "server.log"
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(plus_dir), "--dtype", "bfloat16",
        "--max-model-len", "512", "--enforce-eager", "--kv-cache-memory-bytes", str(24 << 20), "--port", str(port),
    ]  # fmt: skip
    with open(log_path, "w") as log:
        server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=300)
            deadline = time.time() + 600
            while True:
                assert server.poll() is None, log_path.read_text()[-3000:]
                try:
                    client.models.list()
                    break
                except Exception:
                    assert time.time() < deadline, "the server did not come up"
                    time.sleep(2)
            model = str(plus_dir)
            one = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
            assert one.choices[0].text.strip() and one.usage.completion_tokens == 8
            chunks = client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "Name a color."}],
                max_tokens=8,
                temperature=0,
                stream=True,
            )
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert text.strip()
            four = client.completions.create(model=model, prompt="Once upon a time", max_tokens=6, n=4, seed=1)
            assert len(four.choices) == 4 and all(c.text for c in four.choices)
        finally:
            server.terminate()
            server.wait(timeout=120)
    logged = log_path.read_text()
    assert "Oaken KV cache: profile" in logged and "Oaken KV: kernels ready" in logged
