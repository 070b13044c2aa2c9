"""The full-precision window (``OakenCache(residual=R)``; src/oakenkv/store/paged.py, hf/cache.py, hf/attention.py).

Each layer keeps its newest tokens unquantized (float32 rows, keys after the online key transform) beside the
pages; once an update leaves ``2 R`` or more there, the oldest are encoded with the bytes they would have had on
arrival, and ``R`` stay. Every read path (the reference read, the float results of ``OakenLayer.update``, the
packed decode attention: pages, sinks and window merged through log-sum-exps) sees the pages' tokens followed by
the window's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from oakenkv.hf.attention import float_attention, packed_decode_attention, reference_packed_attention
from oakenkv.hf.cache import KEY, VALUE, OakenLayer, PackedKV, PagedKVStore
from oakenkv.store.pages import PoolConfig
from test_attention import _mask
from test_sinks import HD, HQ, H, _kv, _profile


def _store(residual: int, sink: int = 0, page_size: int = 1024) -> PagedKVStore:
    return PagedKVStore(_profile(sink), 2, H, HD, PoolConfig(page_size=page_size), residual=residual)


def _feed(store: PagedKVStore, k: torch.Tensor, v: torch.Tensor, prefill: int) -> list[tuple[int, int]]:
    """A prefill, then one token at a time (the window path, or the plain one for ``residual=0``); returns the
    (pages, window) token counts after each update."""
    counts = []
    for a, e in [(0, prefill), *((i, i + 1) for i in range(prefill, k.shape[2]))]:
        ks, vs = k[:, :, a:e], v[:, :, a:e]
        if store.residual:
            store.window_update(1, ks, vs)
        elif a == 0:
            store.append(1, ks, vs)
        else:
            store.append_token(1, ks, vs)
        counts.append((store.num_tokens(1), store.window_tokens(1)))
    return counts


def _expected_counts(residual: int, prefill: int, t: int) -> list[tuple[int, int]]:
    paged, win, out = 0, 0, []
    for s in [prefill] + [1] * (t - prefill):
        win += s
        if win >= 2 * residual:
            paged, win = paged + win - residual, residual
        out.append((paged, win))
    return out


@pytest.mark.parametrize(("residual", "prefill", "sink"), [(4, 5, 0), (4, 20, 2), (16, 3, 0), (16, 40, 1)])
def test_the_window_encodes_its_oldest_tokens_with_the_bytes_they_had_on_arrival(residual, prefill, sink):
    t = 70
    k, v = _kv(2, t, 11)
    windowed, plain = _store(residual, sink), _store(0, sink)
    counts = _feed(windowed, k, v, prefill)
    _feed(plain, k, v, prefill)
    assert counts == _expected_counts(residual, prefill, t)
    paged, n = counts[-1]
    assert paged > 0 and residual <= n < 2 * residual
    # the pages hold the first `paged` tokens, record for record as the store without a window holds them
    for r, (sa, sb) in enumerate(zip(windowed.seqs, plain.seqs, strict=True)):
        for kind in (KEY, VALUE):
            da = windowed.pool.read_dense(sa, 2 + kind, 0)
            db = plain.pool.read_dense(sb, 2 + kind, 0)
            assert np.array_equal(da, db[:paged]), f"row {r} kind {kind}"
            (spa, _), (spb, ob) = windowed.pool.read_sparse(sa, 2 + kind, 0), plain.pool.read_sparse(sb, 2 + kind, 0)
            assert np.array_equal(spa, spb[: ob[paged]])
    windowed.check_tables()
    windowed.pool.check_invariants()
    # reads: the pages' tokens as the plain store reads them, then the window's exactly (keys: transformed and
    # restored, as the pages' keys read: an oaken-plus shift stays)
    tr = windowed.transforms
    for kind, x in ((KEY, k), (VALUE, v)):
        pages = windowed.read(1, kind)
        torch.testing.assert_close(pages, plain.read(1, kind)[:, :, :paged], rtol=0, atol=0)
        want = x[:, :, paged:] if kind == VALUE else tr.keys_restore(1, tr.keys_forward(1, x[:, :, paged:]))
        torch.testing.assert_close(windowed.window(1, kind), want, rtol=0, atol=2e-6)
    # the bits: 32 per window value on top of the pages'
    stats = windowed.stats()
    assert stats.window_bytes == 4 * 2 * n * H * HD * 2  # float32 x kinds x tokens x D values x rows
    assert stats.total_bytes == windowed.pool.stats().total_bytes + stats.sink_bytes + stats.window_bytes


@pytest.mark.parametrize(
    ("residual", "prefill", "t", "sink", "pad", "softcap"),
    [
        (8, 40, 45, 0, [0, 0], None),  # pages and window
        (64, 50, 60, 0, [0, 3], None),  # everything in the window
        (8, 100, 300, 2, [0, 1], None),  # sinks, pages and window; a row's sinks masked
        (16, 200, 230, 1, [0, 220], 30.0),  # the second row sees only window tokens; soft cap
        (4, 6, 4200, 0, [0, 0], None),  # B x pages' tokens >= PARALLEL_MIN_TOKENS: the threaded kernel
        (2100, 4150, 4160, 0, [0, 5], None),  # a window long enough for the threaded merge, no pages
    ],
)
def test_packed_attention_merges_the_window(residual, prefill, t, sink, pad, softcap):
    k, v = _kv(2, t, 5)
    store = _store(residual, sink)
    _feed(store, k, v, prefill)
    kh, vh = PackedKV(store, 1, KEY, t), PackedKV(store, 1, VALUE, t)
    q = torch.randn(2, HQ, 1, HD, generator=torch.Generator().manual_seed(2))
    mask = _mask(2, t, pad)
    got = packed_decode_attention(q, kh, vh, mask, HD**-0.5, softcap)
    want = reference_packed_attention(q, kh, vh, mask, HD**-0.5, softcap)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6)
    if store.window_tokens(1) * 10 < t:
        return
    # with a tenth of the tokens or more in the window: closer to the unquantized attention than without one
    plain = _store(0, sink)
    _feed(plain, k, v, prefill)
    without = packed_decode_attention(
        q, PackedKV(plain, 1, KEY, t), PackedKV(plain, 1, VALUE, t), mask, HD**-0.5, softcap
    )
    exact = float_attention(q, k, v, mask, HD**-0.5, softcap)
    assert (got - exact).norm() < (without - exact).norm()


def test_both_threaded_parts_with_a_sink():
    """Four rows: the pages (4 x 4400 tokens) and the window (4 x 2110) both past ``PARALLEL_MIN_TOKENS``."""
    from oakenkv.kernels.cpu import attention as attention_cpu

    b, t = 4, 6510
    k, v = _kv(b, t, 6)
    store = _store(2100, sink=1, page_size=4096)
    _feed(store, k, v, 6500)
    assert min(b * store.num_tokens(1), b * store.window_tokens(1)) >= attention_cpu.PARALLEL_MIN_TOKENS
    kh, vh = PackedKV(store, 1, KEY, t), PackedKV(store, 1, VALUE, t)
    q = torch.randn(b, HQ, 1, HD, generator=torch.Generator().manual_seed(3))
    mask = _mask(b, t, [0, 7, 0, 0])
    got = packed_decode_attention(q, kh, vh, mask, HD**-0.5, 30.0)
    torch.testing.assert_close(got, reference_packed_attention(q, kh, vh, mask, HD**-0.5, 30.0), rtol=2e-5, atol=2e-6)


def test_the_handle_must_count_the_window_too():
    k, v = _kv(1, 20, 1)
    store = _store(8)
    _feed(store, k, v, 20)
    q = torch.randn(1, HQ, 1, HD)
    with pytest.raises(RuntimeError, match="pages \\+ window"):
        packed_decode_attention(
            q, PackedKV(store, 1, KEY, store.num_tokens(1)), PackedKV(store, 1, VALUE, 12), None, 1.0
        )


def test_layer_updates_return_the_pages_then_the_window():
    """OakenLayer's float results (prefill, and decode without the packed attention) are the dequantized pages
    followed by the window, whether the pages were just encoded (the prefill's direct decode) or read back."""
    k, v = _kv(2, 40, 3)
    store = _store(6, sink=2)
    layer = OakenLayer(store, 1)
    got_k, got_v = layer.update(k[:, :, :30], v[:, :, :30])
    assert (store.num_tokens(1), store.window_tokens(1)) == (24, 6)
    for got, kind in ((got_k, KEY), (got_v, VALUE)):
        want = torch.cat([store.read(1, kind), store.window(1, kind)], dim=2)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    for i in range(30, 40):
        got_k, got_v = layer.update(k[:, :, i : i + 1], v[:, :, i : i + 1])
        assert got_k.shape[2] == i + 1 == layer.get_seq_length()
    torch.testing.assert_close(got_v[:, :, -store.window_tokens(1) :], v[:, :, 40 - store.window_tokens(1) :])
    torch.testing.assert_close(got_v, torch.cat([store.read(1, VALUE), store.window(1, VALUE)], dim=2))


def test_reorder_and_reset_carry_the_window():
    k, v = _kv(3, 30, 4)
    store = _store(8)
    _feed(store, k, v, 10)
    before = store.window(1, VALUE)
    store.reorder([2, 0, 0])
    torch.testing.assert_close(store.window(1, VALUE), before[[2, 0, 0]], rtol=0, atol=0)
    store.reset()
    assert store.window_tokens(1) == 0 and store.window_bytes() == 0
    assert _feed(store, k[:1], v[:1], 3) == _expected_counts(8, 3, 30)  # a new batch size after the reset
    torch.testing.assert_close(store.window(1, VALUE), v[:1, :, 30 - store.window_tokens(1) :], rtol=0, atol=0)


@pytest.mark.parametrize("residual", [-1, 1.5, True, "8"])
def test_a_bad_window_is_refused(residual):
    with pytest.raises(ValueError, match="residual must be an int >= 0"):
        _store(residual)


def test_window_update_needs_a_window():
    k, v = _kv(1, 2, 0)
    with pytest.raises(RuntimeError, match="residual > 0"):
        _store(0).window_update(1, k, v)


@pytest.mark.parametrize("sink", [0, 2])
def test_the_evaluation_cache_reads_what_the_store_holds(sink):
    """``eval ppl``'s ``oaken-plus:residual=R`` (FakeQuantCache, src/oakenkv/methods/fakequant.py) and the store's
    window return the same keys and values at every step: a prefill, then single tokens across several flushes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from oakenkv.methods.fakequant import FakeQuantCache
    from oakenkv.methods.oaken import PlusQuantizer

    config = LlamaConfig(
        num_hidden_layers=2, num_attention_heads=HQ, num_key_value_heads=H, hidden_size=HQ * HD, head_dim=HD,
        intermediate_size=32, vocab_size=16,
    )  # fmt: skip
    th = _profile(sink)
    evaluated = FakeQuantCache(LlamaForCausalLM(config), PlusQuantizer(th), residual=4)
    layer = OakenLayer(PagedKVStore(th, 2, H, HD, PoolConfig(page_size=1024), residual=4), 1)
    k, v = _kv(2, 30, 8)
    for a, e in [(0, 11), *((i, i + 1) for i in range(11, 30))]:
        want_k, want_v = evaluated.update(k[:, :, a:e], v[:, :, a:e], 1)
        got_k, got_v = layer.update(k[:, :, a:e], v[:, :, a:e])
        torch.testing.assert_close(got_k, want_k, rtol=0, atol=1e-6)  # (the rotation's float rounding)
        torch.testing.assert_close(got_v, want_v, rtol=0, atol=0)
    assert (layer.store.num_tokens(1), layer.store.window_tokens(1)) == (23, 7)


@pytest.mark.parametrize("residual", [0, 4])
def test_the_callers_tensors_are_never_written(residual):
    """An oaken-plus profile transforms key rows in place and the encoder works in its rows: always in the store's
    own copies, also where the row layout needs none (one row, one token)."""
    store = PagedKVStore(_profile(1), 2, H, HD, PoolConfig(page_size=1024), residual=residual)
    layer = OakenLayer(store, 1)
    k, v = _kv(1, 12, 2)
    for i in range(12):  # a first update of one token, then single tokens (a flush at 8 with the window)
        ks, vs = k[:, :, i : i + 1].clone(), v[:, :, i : i + 1].clone()  # contiguous: [B, 1, H, hd] is a view
        layer.update(ks, vs)
        assert torch.equal(ks, k[:, :, i : i + 1]) and torch.equal(vs, v[:, :, i : i + 1]), f"token {i}"
