"""`OakenCache` with transformers' ``generate`` (src/oakenkv/hf/cache.py).

The reference is a fake-quantizing ``DynamicLayer`` cache: it stores ``quantize_dequantize(K/V)`` in float, which
is by construction what ``OakenCache`` stores in bits. Greedy generation through both must give the same tokens
with the float read path; the packed-page decode attention sums in another order than SDPA, and agrees up to that
(``kv_helpers.assert_same_greedy``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.cache_utils import Cache, DynamicLayer

from kv_helpers import assert_same_greedy, quick_thresholds
from oakenkv.hf.attention import oaken_attention
from oakenkv.hf.cache import KEY, OakenCache, PackedKV, serial_numba
from oakenkv.kernels.codec import decode, encode
from oakenkv.quant.quantizer import quantize_dequantize
from oakenkv.store.pages import PoolConfig, PoolExhaustedError
from oakenkv.util.compat import cache_kwargs

PROMPTS = ["The capital of France is", "Once upon a time, in a small village by the sea, there lived"]


class _FakeQuantLayer(DynamicLayer):
    """A float layer that stores what Oaken would store: the quantized-dequantized K/V (token granularity).

    It uses the codec's fast encode/decode, which ``tests/test_codec.py`` proves bit-identical to
    ``quant.quantize_dequantize`` (the reference itself is used in the prefill test below); the reference's many
    small torch ops per layer and step made these generation tests take minutes on the shared 2-core machine.
    """

    def __init__(self, thresholds, layer_idx):
        super().__init__()
        self.thr = thresholds
        self.layer_idx = layer_idx

    def update(self, key_states, value_states, *args, **kwargs):
        def qdq(x, kind):
            b, h, s, d = x.shape
            rows = x.permute(0, 2, 1, 3).reshape(b * s, h * d).contiguous()
            thr, cfg = self.thr.layer(self.layer_idx, kind), self.thr.config
            y = decode(encode(rows, thr, cfg), thr, cfg)
            return y.reshape(b, s, h, d).permute(0, 2, 1, 3).to(x.dtype)

        return super().update(qdq(key_states, "key"), qdq(value_states, "value"))


def _fake_quant_cache(thresholds, n_layers):
    return Cache(layers=[_FakeQuantLayer(thresholds, i) for i in range(n_layers)])


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Single-threaded torch and numba: these tests run tiny ops, where waking a thread pool on the shared, loaded
    machine costs far more than the work (measured: minutes instead of seconds)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    with serial_numba():
        yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def thresholds(default_model):
    return quick_thresholds(default_model)


@pytest.fixture(scope="module")
def batch(default_tokenizer):
    default_tokenizer.padding_side = "left"
    return default_tokenizer(PROMPTS, return_tensors="pt", padding=True)


def _generate(model, inputs, cache, **kw):
    """Greedy tokens ``[B, prompt + 8]`` (``logits=True``: the whole ``generate`` output, with each step's logits)."""
    if kw.pop("logits", False):
        kw.update(output_logits=True, return_dict_in_generate=True)
    kw = {"max_new_tokens": 8, "do_sample": False, **kw}
    with torch.no_grad():
        return model.generate(**inputs, **cache_kwargs(model, cache), pad_token_id=model.config.eos_token_id, **kw)


def test_prefill_stores_exactly_the_quantized_kv(default_model, thresholds, default_tokenizer):
    """Layer 0 sees the same input with any cache: the pages must hold quantize_dequantize(K/V) bit for bit."""
    from transformers import DynamicCache

    model = default_model.model
    ids = default_tokenizer(PROMPTS[1], return_tensors="pt").input_ids
    ref = DynamicCache(config=model.config)
    cache = OakenCache(thresholds, model, prefill_chunk=5)  # several chunks
    with torch.no_grad():
        model(input_ids=ids, **cache_kwargs(model, ref))
        model(input_ids=ids, **cache_kwargs(model, cache))
    for kind, name, x in ((0, "key", ref.layers[0].keys), (1, "value", ref.layers[0].values)):
        b, h, s, d = x.shape
        rows = x.permute(0, 2, 1, 3).reshape(b * s, h * d)
        want = quantize_dequantize(rows, thresholds.layer(0, name), thresholds.config)
        want = want.reshape(b, s, h, d).permute(0, 2, 1, 3)
        torch.testing.assert_close(cache.store.read(0, kind), want, rtol=0, atol=0)
    assert cache.get_seq_length() == ids.shape[1]
    cache.store.pool.check_invariants()


def test_greedy_batch_with_padding_matches_fake_quant(default_model, thresholds, batch):
    model = default_model.model
    n = model.config.num_hidden_layers
    want = _generate(model, batch, _fake_quant_cache(thresholds, n), logits=True)
    got_float = _generate(model, batch, OakenCache(thresholds, model))
    with oaken_attention(model):
        cache = OakenCache(thresholds, model)
        got_packed = _generate(model, batch, cache, logits=True)
    assert model.config._attn_implementation != "oaken"  # restored
    assert torch.equal(got_float, want.sequences)
    assert_same_greedy(want, got_packed)
    assert cache.get_seq_length() == want.sequences.shape[1] - 1  # the last token is sampled, never stored
    cache.store.pool.check_invariants()


class _WindowFakeQuantLayer(_FakeQuantLayer):
    """What ``OakenCache(residual=R)`` stores, in float: the newest tokens exact, the oldest quantized-dequantized
    in place once ``2 R`` or more are unquantized (``R`` stay)."""

    def __init__(self, thresholds, layer_idx, residual):
        super().__init__(thresholds, layer_idx)
        self.residual = residual
        self.exact = 0  # tokens at the end still unquantized

    def update(self, key_states, value_states, *args, **kwargs):
        keys, values = DynamicLayer.update(self, key_states, value_states)
        self.exact += key_states.shape[2]
        if self.exact >= 2 * self.residual:
            n = keys.shape[2]
            a, e = n - self.exact, n - self.residual
            for x, kind in ((keys, "key"), (values, "value")):
                b, h, s, d = x[:, :, a:e].shape
                rows = x[:, :, a:e].permute(0, 2, 1, 3).reshape(b * s, h * d).contiguous()
                thr, cfg = self.thr.layer(self.layer_idx, kind), self.thr.config
                x[:, :, a:e] = decode(encode(rows, thr, cfg), thr, cfg).reshape(b, s, h, d).permute(0, 2, 1, 3)
            self.exact = self.residual
        return keys, values


def test_greedy_with_a_full_precision_window_matches_fake_quant(default_model, thresholds, batch):
    """``residual=4``: the padded prompts (15 tokens) leave 4 in the window and later steps encode 4 at a time;
    the float read path and the packed attention (pages and window merged) give the reference's tokens."""
    model = default_model.model
    n = model.config.num_hidden_layers
    layers = [_WindowFakeQuantLayer(thresholds, i, 4) for i in range(n)]
    want = _generate(model, batch, Cache(layers=layers), logits=True)
    got_float = _generate(model, batch, OakenCache(thresholds, model, residual=4))
    with oaken_attention(model):
        cache = OakenCache(thresholds, model, residual=4)
        got_packed = _generate(model, batch, cache, logits=True)
    assert torch.equal(got_float, want.sequences)
    assert_same_greedy(want, got_packed)
    assert cache.get_seq_length() == want.sequences.shape[1] - 1
    assert 4 <= cache.store.window_tokens(0) < 8
    assert cache.kv_bytes() == cache.store.pool.stats().total_bytes + cache.store.window_bytes()


def test_sampling_runs_and_is_reproducible(default_model, thresholds, batch):
    model = default_model.model
    outs = []
    for _ in range(2):
        torch.manual_seed(0)
        with oaken_attention(model):
            cache = OakenCache(thresholds, model)
            outs.append(_generate(model, batch, cache, do_sample=True, top_k=20, max_new_tokens=5))
    assert outs[0].shape == (2, batch.input_ids.shape[1] + 5)
    assert torch.equal(outs[0], outs[1])


def test_beam_search_matches_fake_quant_and_shares_pages(default_model, thresholds, batch):
    model = default_model.model
    n = model.config.num_hidden_layers
    kw = {"num_beams": 3, "num_return_sequences": 2, "max_new_tokens": 5}
    want = _generate(model, batch, _fake_quant_cache(thresholds, n), **kw)
    with oaken_attention(model):
        cache = OakenCache(thresholds, model)
        got = _generate(model, batch, cache, **kw)
    assert torch.equal(got, want)
    pool = cache.store.pool
    pool.check_invariants()
    # Beams forked from one another share their full pages (reference counts > 1), not copies.
    assert (pool.refcount > 1).any()
    assert len(pool.sequences()) == 2 * 3


def test_reorder_is_a_table_operation(default_model, thresholds, batch):
    model = default_model.model
    cache = OakenCache(thresholds, model)
    with torch.no_grad():
        model(**batch, **cache_kwargs(model, cache))
    before = [cache.store.read(3, KEY)[i] for i in range(2)]
    pages = cache.stats().pages_in_use
    cache.reorder_cache(torch.tensor([1, 1, 0]))
    assert cache.stats().pages_in_use == pages  # forks share pages
    after = cache.store.read(3, KEY)
    for i, j in enumerate([1, 1, 0]):
        assert torch.equal(after[i], before[j])
    cache.batch_select_indices(torch.tensor([2]))
    assert torch.equal(cache.store.read(3, KEY)[0], before[0])
    cache.store.pool.check_invariants()


def test_a_copied_cache_continues_as_the_original_would(default_model, thresholds, default_tokenizer):
    """transformers' prefix reuse: prefill a shared prompt once, ``copy.deepcopy`` the cache per request. A copy
    (or a pickled one) decodes exactly as a cache prefilled afresh, and writes to its own pool, not the original's.
    (The store's flat view of its pool was copied apart from the pool: the copy's kernels read stale bytes.)"""
    import copy
    import pickle

    model = default_model.model
    prompt = default_tokenizer(PROMPTS[1], return_tensors="pt").input_ids
    steps = torch.tensor([[5], [17], [300]])

    def prefilled():  # the prompt and a first decode step (which brings the store's view of its pool up to date)
        cache = OakenCache(thresholds, model)
        model(input_ids=prompt, **cache_kwargs(model, cache))
        model(input_ids=torch.tensor([[7]]), **cache_kwargs(model, cache))
        return cache

    def decode(cache):
        return torch.cat([model(input_ids=s[None], **cache_kwargs(model, cache)).logits for s in steps])

    with torch.no_grad(), oaken_attention(model):
        want = decode(prefilled())
        shared = prefilled()
        before = shared.store.read(3, KEY).clone()
        for copied in (copy.deepcopy(shared), pickle.loads(pickle.dumps(shared))):
            torch.testing.assert_close(decode(copied), want, rtol=0, atol=0)
            assert copied.get_seq_length() == prompt.shape[1] + 4
        assert shared.get_seq_length() == prompt.shape[1] + 1
        assert torch.equal(shared.store.read(3, KEY), before)
        torch.testing.assert_close(decode(shared), want, rtol=0, atol=0)


def test_a_first_update_in_chunks_returns_what_the_pages_hold(default_model, thresholds):
    """A first update longer than ``prefill_chunk`` is decoded from its encoded chunks, not read back from the
    pages: the same numbers as the read path and as one chunk; a later update reads the pages."""
    cfg = default_model.model.config
    g = torch.Generator().manual_seed(5)
    k, v = torch.randn(2, 3, 13, 64, generator=g), torch.randn(2, 3, 13, 64, generator=g)
    chunked = OakenCache(thresholds, cfg, prefill_chunk=5)  # chunks of 5, 5 and 3 tokens
    whole = OakenCache(thresholds, cfg)
    got = chunked.layers[4].update(k, v)
    want = whole.layers[4].update(k, v)
    for kind in (0, 1):
        torch.testing.assert_close(got[kind], chunked.store.read(4, kind), rtol=0, atol=0)
        torch.testing.assert_close(got[kind], want[kind], rtol=0, atol=0)
    assert got[0].shape == (2, 3, 13, 64)
    more = chunked.layers[4].update(k[:, :, :4], v[:, :, :4])  # past > 0: the read path
    assert more[0].shape == (2, 3, 17, 64)
    torch.testing.assert_close(more[0][:, :, :13], got[0], rtol=0, atol=0)


def test_kv_bytes_are_small(default_model, thresholds):
    """At a few hundred tokens, pages included, the cache is > 4x smaller than fp32 (~5.7x at long contexts)."""
    model = default_model.model
    cfg = model.config
    cache = OakenCache(thresholds, cfg)
    ids = torch.randint(100, 5000, (1, 400), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids=ids, **cache_kwargs(model, cache))
    fp32 = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4 * ids.shape[1]
    stats = cache.stats()
    print(
        f"400 tokens: fp32 {fp32} B, Oaken {cache.kv_bytes()} B ({fp32 / cache.kv_bytes():.2f}x), "
        f"fragmentation {stats.fragmentation:.3f}"
    )
    assert fp32 / cache.kv_bytes() > 4.0
    assert stats.bytes_used <= stats.bytes_reserved


def test_budget_exhaustion_is_a_clear_error(default_model, thresholds, batch):
    model = default_model.model
    cache = OakenCache(thresholds, model, pool_config=PoolConfig(budget_bytes=64 * 4096))
    with pytest.raises(PoolExhaustedError, match="page pool exhausted"), torch.no_grad():
        model(**batch, **cache_kwargs(model, cache))
    cache.store.pool.check_invariants()


def test_decode_returns_handles_only_with_oaken_attention(default_model, thresholds, default_tokenizer):
    model = default_model.model
    ids = default_tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    cache = OakenCache(thresholds, model)
    with torch.no_grad():
        model(input_ids=ids, **cache_kwargs(model, cache))
        k = torch.zeros(1, 3, 1, 64)
        out = cache.update(k, k, 0)
        assert isinstance(out[0], torch.Tensor) and out[0].shape == (1, 3, ids.shape[1] + 1, 64)
        with oaken_attention(model):
            out = cache.update(k, k, 1)
        assert isinstance(out[0], PackedKV) and out[0].shape == (1, 3, ids.shape[1] + 1, 64)
    assert np.all(cache.store.pool.refcount >= 0)


def test_rejects_thresholds_of_another_model(default_model, thresholds):
    from oakenkv.calibrate.thresholds import ModelMismatchError

    cfg = default_model.model.config.__class__(**{**default_model.model.config.to_dict(), "num_hidden_layers": 4})
    with pytest.raises((ModelMismatchError, ValueError)):
        OakenCache(thresholds, cfg)


@pytest.fixture(scope="module")
def gemma():
    """Gemma-3-270m (head_dim 256, one KV head, 5 of 6 layers sliding with a 512-token window)."""
    from oakenkv.assets.models import MissingModelError, load_model

    try:
        return load_model("gemma3-270m")
    except MissingModelError as e:
        pytest.skip(f"Gemma-3-270m is not installed: {e}")


def test_gemma3_sliding_window_layers_beyond_the_window(gemma):
    """A prompt longer than the 512-token window: sliding layers must hide what left it, in the float path and in
    the packed kernel, exactly like a full-history fake-quant cache under transformers' sliding masks."""
    model, tok = gemma.model, gemma.tokenizer
    thr = quick_thresholds(gemma)
    text = " ".join(f"Item {i} is a {['red', 'green', 'blue'][i % 3]} box." for i in range(120))
    ids = tok(text, return_tensors="pt")
    assert ids.input_ids.shape[1] > model.config.sliding_window
    n = model.config.num_hidden_layers
    kw = {"max_new_tokens": 4}
    want = _generate(model, ids, _fake_quant_cache(thr, n), **kw)
    with oaken_attention(model):
        cache = OakenCache(thr, model)
        got = _generate(model, ids, cache, **kw)
    assert torch.equal(got, want)
    assert [layer.is_sliding for layer in cache.layers] == [t == "sliding_attention" for t in model.config.layer_types]
    cache.store.pool.check_invariants()
    # Sliding layers released the pages of tokens that left the window (whole pages); full layers kept all.
    store, seq = cache.store, cache.store.seqs[0]
    window = model.config.sliding_window
    total = store.num_tokens(0)
    for i, layer in enumerate(cache.layers):
        table = store.pool.table(seq, 2 * i + KEY)
        if layer.is_sliding:
            assert table.evicted_before == total - 1 - window + 1  # the last step's query position - window + 1
            rpp = store.pool.records_per_page(table.rec_size)
            assert (table.dense_pages.view == -1).sum() == table.evicted_before // rpp
        else:
            assert table.evicted_before == 0 and (table.dense_pages.view >= 0).all()
    with oaken_attention(model):
        keep = OakenCache(thr, model, evict_sliding=False)
        assert torch.equal(_generate(model, ids, keep, **kw), want)
    assert cache.kv_bytes() < 0.6 * keep.kv_bytes()
    # A mask that does not hide an evicted token is an error, never a read of a released page.
    from oakenkv.hf.attention import packed_decode_attention
    from oakenkv.hf.cache import VALUE
    from oakenkv.kernels.codec import CorruptDataError

    sliding = next(i for i, layer in enumerate(cache.layers) if layer.is_sliding)
    q = torch.randn(1, model.config.num_attention_heads, 1, store.head_dim)
    k, v = PackedKV(store, sliding, KEY, total), PackedKV(store, sliding, VALUE, total)
    with pytest.raises(CorruptDataError, match="evicted"):
        packed_decode_attention(q, k, v, None, 0.0625)


def test_greedy_with_static_grids_matches_fake_quant(default_model, thresholds, batch):
    """Static grids (OakenConfig.static_grids): the pages hold the outer scales alone; generation through the float
    read path and the packed attention kernel agrees with the fake-quant cache of the same config."""
    import dataclasses

    from oakenkv.format.layout import record_size

    static = dataclasses.replace(thresholds, config=thresholds.config.replace(static_grids=True))
    model = default_model.model
    n = model.config.num_hidden_layers
    want = _generate(model, batch, _fake_quant_cache(static, n), logits=True)
    cache = OakenCache(static, model)
    got_float = _generate(model, batch, cache)
    assert cache.store.rec_size == record_size(cache.store.dim, static.config) == 4 + cache.store.dim // 2
    with oaken_attention(model):
        got_packed = _generate(model, batch, OakenCache(static, model), logits=True)
    assert torch.equal(got_float, want.sequences)
    assert_same_greedy(want, got_packed)
    cache.store.pool.check_invariants()


def test_greedy_with_static_levels_matches_fake_quant(default_model, thresholds, batch):
    """Static levels (OakenConfig.static_levels): the pages hold the outer scales and a level byte; generation
    through the float read path and the packed attention kernel agrees with the fake-quant cache of the same
    config (the codec's round trip, bit for bit the reference)."""
    import dataclasses

    from oakenkv.format.config import DEFAULT_STATIC_LEVELS
    from oakenkv.format.layout import record_size

    cfg = thresholds.config.replace(static_grids=True, static_levels=DEFAULT_STATIC_LEVELS)
    levels = dataclasses.replace(thresholds, config=cfg)
    model = default_model.model
    n = model.config.num_hidden_layers
    want = _generate(model, batch, _fake_quant_cache(levels, n), logits=True)
    cache = OakenCache(levels, model)
    got_float = _generate(model, batch, cache)
    assert cache.store.rec_size == record_size(cache.store.dim, cfg) == 5 + cache.store.dim // 2
    with oaken_attention(model):
        got_packed = _generate(model, batch, OakenCache(levels, model), logits=True)
    assert torch.equal(got_float, want.sequences)
    assert_same_greedy(want, got_packed)
    cache.store.pool.check_invariants()
