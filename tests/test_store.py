"""The paged K/V store (src/oakenkv/store/paged.py): the kernel's tables it keeps current on every write.

Random sequences of prefill appends, decode-step appends, sliding-window evictions and reorders (forks, frees,
copy on write) keep every layer's ``LayerTables`` equal to the pool's tables, and the decode kernel reading them
gives the reference attention.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from oakenkv.calibrate.thresholds import GroupThresholds, ModelFingerprint, Thresholds
from oakenkv.format.config import DEFAULT_STATIC_LEVELS, OakenConfig
from oakenkv.hf.attention import packed_decode_attention, reference_packed_attention
from oakenkv.hf.cache import KEY, VALUE, PackedKV
from oakenkv.store.paged import PagedKVStore
from oakenkv.store.pages import EVICTED, PoolConfig

H, HD, HQ = 3, 64, 9


def _store(layers: int = 2, page_size: int = 512, config: OakenConfig | None = None) -> PagedKVStore:
    fp = ModelFingerprint("llama", layers, H, HD)
    keys = tuple(GroupThresholds(-2.0 - 0.1 * i, -0.15, 0.15, 2.0 + 0.1 * i) for i in range(layers))
    values = tuple(GroupThresholds(-1.5 - 0.1 * i, -0.1, 0.1, 1.5 + 0.1 * i) for i in range(layers))
    thresholds = Thresholds(config or OakenConfig(), fp, keys, values)
    return PagedKVStore(thresholds, layers, H, HD, PoolConfig(page_size=page_size))


def _attend(store: PagedKVStore, layer: int, seed: int, window: int | None = None) -> None:
    b, t = store.batch_size, store.num_tokens(layer)
    q = torch.randn(b, HQ, 1, HD, generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(b, 1, 1, t, dtype=torch.bool)
    if window is not None:
        mask[..., : t - window] = False
    kh, vh = PackedKV(store, layer, KEY, t), PackedKV(store, layer, VALUE, t)
    got = packed_decode_attention(q, kh, vh, mask, HD**-0.5)
    want = reference_packed_attention(q, kh, vh, mask, HD**-0.5)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("seed", range(6))
def test_tables_follow_appends_evictions_and_reorders(seed):
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    store = _store()
    b = int(rng.integers(1, 4))
    window = None  # layer 1 becomes a sliding layer of this window at its first eviction
    for step in range(40):
        op = rng.random()
        n = store.num_tokens(1)
        if n == 0 or op < 0.15:  # a prefill chunk into both layers
            s = int(rng.integers(1, 60))
            for layer in (0, 1):
                store.append(layer, torch.randn(b, H, s, HD, generator=g), torch.randn(b, H, s, HD, generator=g))
        elif op < 0.75:  # decode steps: one token per layer
            for layer in (0, 1):
                k = torch.randn(b, H, 1, HD, generator=g) * 1.5
                store.append_token(layer, k, torch.randn(b, H, 1, HD, generator=g))
        elif op < 0.85:  # layer 1 is a sliding layer: release what left a window
            window = window or int(rng.integers(8, 64))
            store.evict_before(1, n - window)
        else:  # beam search / batch selection: forks (shared pages, copied on write) and frees
            index = [int(i) for i in rng.integers(0, b, size=int(rng.integers(1, 4)))]
            store.reorder(index)
            b = len(index)
        store.check_tables()
        store.pool.check_invariants()
        if step % 8 == 7:
            _attend(store, 0, step)
            _attend(store, 1, step, window)
    _attend(store, 0, 99)
    _attend(store, 1, 99, window)


def test_the_view_copies_nothing_and_grows_by_doubling():
    store = _store(page_size=256)
    g = torch.Generator().manual_seed(0)
    store.append(0, torch.randn(2, H, 5, HD, generator=g), torch.randn(2, H, 5, HD, generator=g))
    view = store.layer_view(0)
    assert view.num_tokens == 5
    step_arrays = []
    for _ in range(200):
        store.append_token(0, torch.randn(2, H, 1, HD, generator=g), torch.randn(2, H, 1, HD, generator=g))
        v = store.layer_view(0)
        step_arrays.append(id(v.sparse_lengths))
        assert np.shares_memory(v.sparse_lengths, store.tables[0].sparse_lengths)
    # the tables are reallocated only when they double, not every step
    assert len(set(step_arrays)) <= 4
    store.check_tables()
    lt = store.tables[0]
    rpp = 256 // store.rec_size
    assert (lt.dense_pages[:, :, : -(-205 // rpp)] != EVICTED).all()
    _attend(store, 0, 1)


def test_a_failed_decode_append_leaves_the_tables_as_they_were():
    store = _store()
    g = torch.Generator().manual_seed(1)
    store.append(0, torch.randn(2, H, 30, HD, generator=g), torch.randn(2, H, 30, HD, generator=g))
    before = store.layer_view(0)
    lengths = before.sparse_lengths[:, :, :30].copy()
    bad = torch.randn(2, H, 1, HD, generator=g)
    bad[1, 0, 0, 3] = float("inf")
    with pytest.raises(ValueError, match="values of row 1"):
        store.append_token(0, torch.randn(2, H, 1, HD, generator=g), bad)
    after = store.layer_view(0)
    assert after.num_tokens == 30
    np.testing.assert_array_equal(after.sparse_lengths[:, :, :30], lengths)
    store.check_tables()


@pytest.mark.parametrize(
    ("b", "s", "scale_dtype", "static"),
    [
        (1, 1, "float16", False),
        (1, 37, "float16", False),
        (3, 50, "float32", False),
        (2, 600, "float16", False),  # 2 x 600: the batched path
        (1, 37, "float16", True),  # static grids: records of the outer scales alone
        (3, 50, "float32", True),
        (1, 37, "float16", "levels"),  # static levels: the outer scales and a level byte
        (3, 50, "float32", "levels"),
    ],
)
def test_append_decoded_stores_what_append_stores_and_returns_its_decode(b, s, scale_dtype, static):
    from oakenkv.kernels import codec

    g = torch.Generator().manual_seed(s)
    levels = DEFAULT_STATIC_LEVELS if static == "levels" else ()
    cfg = OakenConfig(scale_dtype=scale_dtype, static_grids=bool(static), static_levels=levels)
    fused, plain = (_store(config=cfg) for _ in range(2))
    for _ in range(2):  # a first update, then one onto a history
        k = torch.randn(b, H, s, HD, generator=g) * 1.5
        v = torch.randn(b, H, s, HD, generator=g)
        got = fused.append_decoded(1, k, v)
        encoded = plain.append(1, k, v)
        for kind in (KEY, VALUE):
            want = codec.decode(encoded[kind], plain.thresholds.layer(1, ("key", "value")[kind]), plain.config)
            assert got[kind].shape == (b, s, H * HD)
            assert torch.equal(torch.from_numpy(got[kind]).reshape(b * s, H * HD), want)
        np.testing.assert_array_equal(fused.pool.data, plain.pool.data)
        for kind in (KEY, VALUE):
            assert torch.equal(fused.read(1, kind), plain.read(1, kind))
        fused.check_tables()
        fused.pool.check_invariants()
    _attend(fused, 1, 3)


def test_a_failed_append_decoded_leaves_the_store_as_it_was():
    store = _store()
    g = torch.Generator().manual_seed(2)
    store.append_decoded(0, torch.randn(2, H, 10, HD, generator=g), torch.randn(2, H, 10, HD, generator=g))
    data = store.pool.data.copy()
    bad = torch.randn(2, H, 4, HD, generator=g)
    bad[1, 2, 3, 7] = float("nan")
    with pytest.raises(ValueError, match="values of row 1, token 3"):
        store.append_decoded(0, torch.randn(2, H, 4, HD, generator=g), bad)
    assert store.num_tokens(0) == 10
    np.testing.assert_array_equal(store.pool.data, data)
    store.check_tables()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_first_update_returns_what_read_returns(dtype):
    from oakenkv.hf.cache import OakenLayer

    store = _store()
    g = torch.Generator().manual_seed(3)
    k = (torch.randn(2, H, 40, HD, generator=g) * 1.5).to(dtype)
    v = torch.randn(2, H, 40, HD, generator=g).to(dtype)
    keys, values = OakenLayer(store, 1).update(k, v)  # the prefill's direct decode (append_decoded)
    assert keys.dtype == dtype and keys.shape == k.shape
    assert torch.equal(keys, store.read(1, KEY, dtype))
    assert torch.equal(values, store.read(1, VALUE, dtype))
