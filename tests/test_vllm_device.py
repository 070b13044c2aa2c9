"""The vLLM plugin's device path (``oakenkv.integrations.vllm.device``, the CUDA backend's writer, view and
attention) against the CPU plugin's (``layout.py``), on CPU tensors under the Triton interpreter (tests/conftest.py
sets ``TRITON_INTERPRET=1``; no vLLM needed): the same bytes in the blocks, every step, overflow included, and the
same attention to float32 rounding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install 'oakenkv[triton]')")

from oakenkv.format.config import OakenConfig
from oakenkv.integrations.vllm import device
from oakenkv.integrations.vllm.layout import (
    BlockLayout,
    BlockOverflowError,
    BlockTables,
    BlockWriter,
    LayerParams,
    decode_attention_rows,
    pool_view,
    prefill_attention,
)

CFG = OakenConfig()
HKV, HD, HQ = 3, 64, 9
DIM = HKV * HD


def _kv(rng: np.random.Generator, n: int, offset: float = 0.0):
    k = (rng.standard_t(5, size=(n, DIM)) + offset).astype(np.float32)
    v = (0.5 * rng.standard_t(8, size=(n, DIM))).astype(np.float32)
    return k, v


def _thresholds(k: np.ndarray, v: np.ndarray) -> np.ndarray:
    o, i = CFG.outer_ratio / 2, CFG.inner_ratio / 2
    return np.array([np.quantile(x, [o, 0.5 - i, 0.5 + i, 1 - o]) for x in (k, v)], dtype=np.float32)


def _cache(lay: BlockLayout, num_blocks: int, stride_blocks: int = 2) -> torch.Tensor:
    """A layer's cache as vLLM hands it: ``[num_blocks, block_bytes]`` rows ``stride_blocks`` blocks apart."""
    raw = torch.zeros(num_blocks * stride_blocks * lay.block_bytes, dtype=torch.uint8)
    return raw.view(num_blocks, stride_blocks * lay.block_bytes)[:, : lay.block_bytes]


class _Twins:
    """The same steps written by the CPU writer into one cache and by the device writer into another."""

    def __init__(self, lay, thr, overflow="clip", shift=None, rotation=False, num_blocks=12):
        self.lay = lay
        self.cpu_cache, self.dev_cache = _cache(lay, num_blocks), _cache(lay, num_blocks)
        self.pool, self.upb = pool_view(self.cpu_cache, lay)
        self.dpool, dupb = device.pool_tensor(self.dev_cache, lay)
        assert dupb == self.upb
        kw = {"key_shift": shift, "key_rotation": rotation, "head_dim": HD}
        self.cpu = BlockWriter(lay, thr, overflow, **kw)
        self.dev = device.DeviceBlockWriter(lay, thr, overflow, **kw)

    def write(self, slots, k, v, dtype=torch.float32):
        kt, vt = torch.from_numpy(k).to(dtype), torch.from_numpy(v).to(dtype)
        self.cpu.write(self.pool, self.upb, np.asarray(slots), kt, vt)
        self.dev.write(self.dpool, self.upb, torch.as_tensor(slots), kt.view(-1, HKV, HD), vt.view(-1, HKV, HD))

    def assert_same(self):
        assert torch.equal(self.cpu_cache, self.dev_cache)
        assert self.cpu.stats.to_dict() == self.dev.stats.to_dict()


def _steps(rng, table, lengths, bs):
    """A chunked prefill of each row (chunks of 0.6 x its length) then decode steps, as slot lists per step."""
    rows = []
    for r, t in enumerate(lengths):
        slots = table[r][np.arange(t) // bs].astype(np.int64) * bs + np.arange(t) % bs
        rows.append(slots)
    steps = []
    cut = [max(1, int(0.6 * t)) for t in lengths]
    steps.append(np.concatenate([s[:c] for s, c in zip(rows, cut, strict=True)]))  # first chunks
    steps.append(np.concatenate([s[c : c + 5] for s, c in zip(rows, cut, strict=True)]))
    pos = [c + 5 for c in cut]
    while any(p < len(s) for p, s in zip(pos, rows, strict=True)):  # decodes: one token per unfinished row
        steps.append(np.array([s[p] for p, s in zip(pos, rows, strict=True) if p < len(s)], np.int64))
        pos = [p + 1 for p in pos]
    return steps


@pytest.mark.parametrize(
    ("shift", "rotation", "sink", "dtype"),
    [(False, False, 0, torch.float32), (True, True, 1, torch.bfloat16), (True, False, 2, torch.float16)],
)
def test_device_writer_fills_blocks_with_the_cpu_writers_bytes(shift, rotation, sink, dtype):
    """A chunked prefill then decode steps of three rows in shuffled blocks (another layer's interleaved), written by
    the device writer, leave every byte of the cache as the CPU writer leaves it: dense records, headers, sparse
    areas, 16-bit sink copies of the transformed keys, with the key shift and rotation or not, any input dtype."""
    rng = np.random.default_rng(1)
    bs, lengths = 16, (37, 5, 50)
    k, v = _kv(rng, sum(lengths), 0.7 if shift else 0.0)
    thr = _thresholds(k - (0.7 if shift else 0.0), v)
    lay = BlockLayout.make(DIM, bs, CFG, sparse_bytes_per_token=60, sink_tokens=sink)
    nblocks = sum(-(-t // bs) for t in lengths) + 2
    order = rng.permutation(nblocks)
    table = np.zeros((3, 4), np.int32)
    used = 0
    for r, t in enumerate(lengths):
        table[r, : -(-t // bs)] = order[used : used + -(-t // bs)]
        used += -(-t // bs)
    key_shift = rng.standard_normal(DIM).astype(np.float32) * 0.1 + 0.7 if shift else None
    tw = _Twins(lay, thr, shift=key_shift, rotation=rotation, num_blocks=nblocks)
    starts = np.cumsum((0, *lengths))
    where = {}
    for r, t in enumerate(lengths):
        slots = table[r][np.arange(t) // bs].astype(np.int64) * bs + np.arange(t) % bs
        for i, s in enumerate(slots):
            where[int(s)] = starts[r] + i
    for step in _steps(rng, table, lengths, bs):
        idx = np.array([where[int(s)] for s in step])
        tw.write(step, k[idx], v[idx], dtype)
    tw.assert_same()
    assert tw.dev.stats.written == 2 * sum(lengths)


def test_device_writer_skips_padding_and_refuses_slots_past_the_cache():
    rng = np.random.default_rng(2)
    lay = BlockLayout.make(DIM, 8, CFG)
    k, v = _kv(rng, 6)
    tw = _Twins(lay, _thresholds(k, v), num_blocks=2)
    tw.write(np.array([0, -1, 1, 2, -1, 3]), k, v)
    tw.assert_same()
    with pytest.raises(IndexError, match="past the cache"):
        tw.dev.write(tw.dpool, tw.upb, torch.tensor([16]), torch.from_numpy(k[:1]), torch.from_numpy(v[:1]))
    bad = k[:2].copy()
    bad[1, 5] = np.nan
    with pytest.raises(ValueError, match="cannot encode the keys of token 1"):
        tw.dev.write(tw.dpool, tw.upb, torch.tensor([4, 5]), torch.from_numpy(bad), torch.from_numpy(v[:2]))


def test_device_writer_overflow_clip_gives_the_cpu_policys_bytes():
    """Blocks whose sparse area is far too small: the rows of the blocks that overflow go through the CPU writer's
    clip policy, on a host copy of those blocks; the cache and the overflow counts end as the CPU writer's."""
    rng = np.random.default_rng(4)
    n = 64
    k, v = _kv(rng, n)
    lay = BlockLayout.make(DIM, 16, CFG, sparse_bytes_per_token=8)  # far below the ~19 bytes a token needs
    tw = _Twins(lay, _thresholds(k, v), num_blocks=5)
    slots = np.concatenate([np.arange(16, 40), np.arange(48, 64), np.arange(0, 16), np.arange(64, 72)])
    tw.write(slots[:40], k[:40], v[:40])
    tw.write(slots[40:], k[40:], v[40:])
    tw.assert_same()
    assert tw.dev.stats.tokens[0] > 0 and tw.dev.stats.values_moved > 0


def test_device_writer_overflow_error_names_the_real_block():
    rng = np.random.default_rng(3)
    k, v = _kv(rng, 8)
    lay = BlockLayout.make(DIM, 8, CFG, sparse_bytes_per_token=1)
    tw = _Twins(lay, _thresholds(k, v), overflow="error", num_blocks=3)
    for w, pool in ((tw.cpu, tw.pool), (tw.dev, tw.dpool)):
        slots = np.arange(16, 24)
        with pytest.raises(BlockOverflowError, match=r"slot \d+ \(block 2\)"):
            w.write(pool, tw.upb, slots if w is tw.cpu else torch.from_numpy(slots), torch.from_numpy(k),
                    torch.from_numpy(v))  # fmt: skip
    tw.assert_same()  # what was written before the overflowing record, on both


def _written_case(seed: int, rotation: bool, sink: int, lengths=(37, 5, 70), bs: int = 16):
    """Rows written by the device writer into shuffled blocks, with their tables: the CPU side's ``BlockTables``
    over the same bytes, and the device side's ``StepPages``."""
    rng = np.random.default_rng(seed)
    k, v = _kv(rng, sum(lengths), 0.5)
    thr = _thresholds(k - 0.5, v)
    lay = BlockLayout.make(DIM, bs, CFG, sparse_bytes_per_token=60, sink_tokens=sink)
    nblocks = sum(-(-t // bs) for t in lengths) + 1
    order = rng.permutation(nblocks)
    table = np.zeros((len(lengths), 6), np.int32)
    cache = _cache(lay, nblocks)
    dpool, upb = device.pool_tensor(cache, lay)
    shift = np.full(DIM, 0.5, np.float32)
    w = device.DeviceBlockWriter(lay, thr, key_shift=shift, key_rotation=rotation, head_dim=HD)
    used = start = 0
    for r, t in enumerate(lengths):
        nb = -(-t // bs)
        table[r, :nb] = order[used : used + nb]
        used += nb
        slots = table[r][np.arange(t) // bs].astype(np.int64) * bs + np.arange(t) % bs
        w.write(dpool, upb, torch.from_numpy(slots), torch.from_numpy(k[start : start + t]),
                torch.from_numpy(v[start : start + t]))  # fmt: skip
        start += t
    pool, _ = pool_view(cache, lay)
    tables = BlockTables(lay, upb)
    tables.update(0, table, np.array(lengths), np.array(lengths))
    pages = device.step_pages(lay, upb, torch.from_numpy(table), np.array(lengths))
    view = device.layer_view(dpool, lay, upb, pages, torch.from_numpy(thr), HKV, HD)
    sinks = device.layer_sinks(dpool, lay, upb, torch.from_numpy(table[:, 0])) if sink else None
    return lay, thr, pool, tables, pages, view, sinks, lengths


def test_device_view_holds_the_cpu_tables_lengths():
    lay, _, pool, tables, pages, view, _, lengths = _written_case(5, False, 0)
    lt = tables.layer(0, pool)
    for r, t in enumerate(lengths):
        assert np.array_equal(view.sparse_lengths[r, :, :t].numpy(), lt.sparse_lengths[r, :, :t])
        assert not view.sparse_lengths[r, :, t:].any()
    # a corrupt header is refused, not read
    dpool = view.dense_pool
    first = int(pages.blocks[0, 0])
    dpool[first * tables.units_per_block * lay.unit + lay.header_unit * lay.unit] = 255
    with pytest.raises(Exception, match="does not fit its block"):
        device.layer_view(dpool, lay, tables.units_per_block, pages, view.thresholds, HKV, HD)


@pytest.mark.parametrize(("rotation", "sink", "softcap"), [(False, 0, 0.0), (True, 1, 0.0), (True, 2, 30.0)])
def test_device_decode_attention_gives_the_cpu_plugins_numbers(rotation, sink, softcap):
    _, thr, pool, tables, pages, view, sinks, lengths = _written_case(6, rotation, sink)
    q = np.random.default_rng(8).standard_normal((len(lengths), HQ, HD)).astype(np.float32)
    params = LayerParams(thr, HKV, 0.125, softcap, rotation)
    want = decode_attention_rows(tables, 0, pool, q.copy(), params)
    got = device.decode_attention(torch.from_numpy(q), view, pages, sinks, 0.125, softcap, rotation)
    np.testing.assert_allclose(got.numpy(), want, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize(("rotation", "sink", "softcap"), [(False, 0, 0.0), (True, 1, 0.0), (True, 2, 30.0)])
def test_device_prefill_attention_gives_the_cpu_plugins_numbers(rotation, sink, softcap):
    """A chunk at the end of each row (the whole row for the shortest), causal, over its pages."""
    _, thr, pool, tables, _, view, sinks, lengths = _written_case(9, rotation, sink)
    params = LayerParams(thr, HKV, 0.125, softcap, rotation)
    for r, t in enumerate(lengths):
        s = min(t, 21)
        q = torch.from_numpy(np.random.default_rng(r).standard_normal((s, HQ, HD)).astype(np.float32))
        want = prefill_attention(tables, 0, pool, r, q, params)
        rs = sinks[r : r + 1] if sinks is not None else None
        got = device.prefill_attention(q, device.row_view(view, r, t), rs, 0.125, softcap, rotation)
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=2e-5, atol=2e-5)


def test_device_writer_refuses_static_grid_records():
    lay = BlockLayout.make(DIM, 8, OakenConfig(static_grids=True))
    with pytest.raises(NotImplementedError, match="static grids"):
        device.DeviceBlockWriter(lay, np.array([[-2, -0.1, 0.1, 2]] * 2, np.float32))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_device_attention_takes_16_bit_queries(dtype):
    """vLLM on a GPU hands queries in the model's 16-bit dtype: decode and prefill give the CPU plugin's numbers for
    the same (rounded) queries, within the 16-bit products' rounding. (Under the interpreter bfloat16 products are
    taken in float32: its bfloat16 ``tl.dot`` is wrong, ``prefill.dot_kind``.)"""
    _, thr, pool, tables, pages, view, sinks, lengths = _written_case(12, True, 1)
    params = LayerParams(thr, HKV, 0.125, 0.0, True)
    q = torch.from_numpy(np.random.default_rng(3).standard_normal((len(lengths), HQ, HD)).astype(np.float32))
    q16 = q.to(dtype)
    want = decode_attention_rows(tables, 0, pool, q16.float().numpy().copy(), params)
    got = device.decode_attention(q16, view, pages, sinks, 0.125, 0.0, True)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-5)  # (decode: float32 products)
    r, t = 2, lengths[2]
    q = torch.from_numpy(np.random.default_rng(4).standard_normal((17, HQ, HD)).astype(np.float32)).to(dtype)
    want = prefill_attention(tables, 0, pool, r, q.float(), params)
    got = device.prefill_attention(q, device.row_view(view, r, t), sinks[r : r + 1], 0.125, 0.0, True)
    assert got.dtype == torch.float32
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=0, atol=2e-2 if dtype == torch.bfloat16 else 4e-3)
