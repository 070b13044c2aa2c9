"""Sink tokens of an ``oaken-plus`` profile (``Transforms.sink_tokens``; src/oakenkv/store/paged.py, hf/attention.py).

The first ``n`` real tokens of every row (after its left padding, learnt from the attention mask) are stored in the
pages like any other and also at 16 bits beside them; every read path takes them from there: the reference read,
the prefill's direct decode and the packed decode attention (the kernel over the other tokens, merged with the sink
part through the kernel's log-sum-exp). The bits count them. A profile without sink tokens keeps its old serialized
form and digest.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from oakenkv.calibrate.thresholds import GroupThresholds, ModelFingerprint, Thresholds
from oakenkv.calibrate.transforms import LayerTransforms, TransformError, Transforms
from oakenkv.format.config import OakenConfig
from oakenkv.hf.attention import float_attention, packed_decode_attention, reference_packed_attention
from oakenkv.hf.cache import KEY, VALUE, PackedKV, PagedKVStore
from oakenkv.store.pages import PoolConfig

H, HD, HQ = 3, 64, 9


def _profile(sink: int, shift: bool = True, rotate: bool = True) -> Thresholds:
    fp = ModelFingerprint("llama", 2, H, HD)
    keys = tuple(GroupThresholds(-2.0 - 0.1 * i, -0.15, 0.15, 2.0 + 0.1 * i) for i in range(2))
    values = tuple(GroupThresholds(-1.5 - 0.1 * i, -0.1, 0.1, 1.5 + 0.1 * i) for i in range(2))
    g = torch.Generator().manual_seed(7)
    layers = tuple(
        LayerTransforms(
            key_shift=tuple(torch.randn(H * HD, generator=g).mul(0.5).tolist()) if shift else None,
            key_rotation=rotate,
        )
        for _ in range(2)
    )
    return Thresholds(OakenConfig(), fp, keys, values, transforms=Transforms(layers, H, HD, sink_tokens=sink))


def _kv(b: int, t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(b, H, t, HD, generator=g)
    k[:, :, 0] *= 8.0  # an atypical first token, as an attention sink's key is
    v = torch.randn(b, H, t, HD, generator=g) * 0.8
    return k, v


def _stores(sink: int, b: int, t: int, prefill: int, seed: int = 0):
    """A store with ``sink`` sink tokens and one without, both fed the same tokens (a prefill, then one token at
    a time through the decode path)."""
    k, v = _kv(b, t, seed)
    stores = []
    for n in (sink, 0):
        store = PagedKVStore(_profile(n), 2, H, HD, PoolConfig(page_size=1024))
        store.append(1, k[:, :, :prefill], v[:, :, :prefill])
        for i in range(prefill, t):
            store.append_token(1, k[:, :, i : i + 1], v[:, :, i : i + 1])
        stores.append(store)
    return stores, k, v


@pytest.mark.parametrize(("sink", "prefill"), [(1, 40), (3, 1), (4, 2)])
def test_reads_take_the_sink_tokens_at_16_bits(sink, prefill):
    (with_sink, without), k, v = _stores(sink, 2, 50, prefill)
    tr = with_sink.transforms
    for kind, x in ((KEY, k), (VALUE, v)):
        got, plain = with_sink.read(1, kind), without.read(1, kind)
        # every other token reads exactly as without sink tokens
        torch.testing.assert_close(got[:, :, sink:], plain[:, :, sink:], rtol=0, atol=0)
        # keys: the pages' frame, rounded to float16, then the rotation undone (the shift stays)
        want = (
            x[:, :, :sink].half().float()
            if kind == VALUE
            else tr.keys_restore(1, tr.keys_forward(1, x[:, :, :sink]).half().float())
        )
        torch.testing.assert_close(got[:, :, :sink], want, rtol=0, atol=0)
        assert not torch.equal(plain[:, :, :sink], got[:, :, :sink])  # the pages alone would read them quantized
    # the bits: the format's bytes plus 16 bits per sink value
    stats = with_sink.stats()
    assert stats.sink_bytes == 2 * sink * H * HD * 2 * 2  # 2 kinds x sink tokens x D values x 2 bytes x 2 rows
    assert stats.total_bytes == without.stats().total_bytes + stats.sink_bytes
    extra = with_sink.bits_per_value()["format"] - without.bits_per_value()["format"]
    assert extra == pytest.approx(16 * sink / 50)


def test_the_prefills_direct_decode_takes_the_sink_tokens():
    """OakenCache's first update returns the decoded prefill itself (not a read of the pages): with the sinks."""
    from oakenkv.hf.cache import OakenLayer

    store = PagedKVStore(_profile(2), 2, H, HD, PoolConfig(page_size=1024))
    layer = OakenLayer(store, 1)
    k, v = _kv(1, 30, 3)
    got_k, got_v = layer.update(k, v)
    torch.testing.assert_close(got_k, store.read(1, KEY), rtol=0, atol=0)
    torch.testing.assert_close(got_v, store.read(1, VALUE), rtol=0, atol=0)


@pytest.mark.parametrize(("sink", "pad", "softcap"), [(1, [0, 0], None), (2, [0, 1], None), (3, [0, 40], 30.0)])
def test_packed_attention_merges_the_sink_tokens(sink, pad, softcap):
    """The kernel over the other tokens, merged with the 16-bit sink tokens, equals float attention over the
    store's reads (which hold the sinks); a row whose sinks are masked (left padding) ignores them."""
    t = 300
    (store, _), k, v = _stores(sink, 2, t, 100)
    kh, vh = PackedKV(store, 1, KEY, t), PackedKV(store, 1, VALUE, t)
    q = torch.randn(2, HQ, 1, HD, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 1, 1, t, dtype=torch.bool)
    for r, p in enumerate(pad):
        mask[r, ..., :p] = False
    got = packed_decode_attention(q, kh, vh, mask, HD**-0.5, softcap)
    want = reference_packed_attention(q, kh, vh, mask, HD**-0.5, softcap)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6)
    # closer to the unquantized attention than the same store's pages alone
    exact = float_attention(q, k, v, mask, HD**-0.5, softcap)
    store.sink_tokens = 0
    pages_only = packed_decode_attention(q, kh, vh, mask, HD**-0.5, softcap)
    assert (got - exact).norm() < (pages_only - exact).norm()


def test_only_sink_tokens_left_to_attend():
    """A row whose only visible tokens are sink tokens: the kernel part is empty (log-sum-exp -inf)."""
    (store, _), _, _ = _stores(2, 1, 6, 6)
    kh, vh = PackedKV(store, 1, KEY, 6), PackedKV(store, 1, VALUE, 6)
    q = torch.randn(1, HQ, 1, HD, generator=torch.Generator().manual_seed(4))
    mask = torch.zeros(1, 1, 1, 6, dtype=torch.bool)
    mask[..., :2] = True
    got = packed_decode_attention(q, kh, vh, mask, HD**-0.5)
    torch.testing.assert_close(got, reference_packed_attention(q, kh, vh, mask, HD**-0.5), rtol=2e-5, atol=2e-6)


def test_reorder_moves_the_sink_tokens_with_their_rows():
    (store, _), _, _ = _stores(2, 3, 20, 20)
    before = store.read(1, VALUE)
    store.reorder([2, 0, 0])
    torch.testing.assert_close(store.read(1, VALUE), before[[2, 0, 0]], rtol=0, atol=0)


def test_transforms_without_sink_tokens_keep_their_old_form():
    th = _profile(0)
    d = th.transforms.to_dict()
    assert d["version"] == 1 and "sink_tokens" not in d  # as written before sink tokens existed: same digest
    with_sink = dataclasses.replace(th.transforms, sink_tokens=2)
    d2 = with_sink.to_dict()
    assert d2["version"] == 2 and d2["sink_tokens"] == 2
    assert Transforms.from_dict(json.loads(json.dumps(d2))) == with_sink
    assert with_sink.digest() != th.transforms.digest()
    bad = dict(d, sink_tokens=2)  # version 1 cannot say it: an older reader would ignore it
    with pytest.raises(TransformError, match="version 1"):
        Transforms.from_dict(bad)
    for n in (-1, 65, 1.5, True):
        with pytest.raises(TransformError, match="sink_tokens"):
            dataclasses.replace(th.transforms, sink_tokens=n)


def test_the_method_spec_takes_a_sink_count():
    from oakenkv.methods.registry import parse_spec

    assert parse_spec("oaken-plus")[1]["sink"] == 1
    assert parse_spec("oaken-plus:sink=4")[1]["sink"] == 4
    with pytest.raises(ValueError, match="sink='65': must be >= 0 and <= 64"):
        parse_spec("oaken-plus:sink=65")


def test_the_evaluation_cache_counts_and_reads_the_sinks_as_the_store_does():
    """FakeQuantCache with oaken-plus's quantizer: the first tokens as OakenCache reads them, and 16 bits each
    on top of the codes."""
    from oakenkv.methods.oaken import PlusQuantizer

    th = _profile(2)
    q = PlusQuantizer(th)
    k, v = _kv(1, 30, 5)
    store = PagedKVStore(th, 2, H, HD, PoolConfig(page_size=1024))
    store.append(1, k, v)

    class _Cache:  # FakeQuantCache.quantize_kv's body needs only these
        quantizer, rope, row_starts = q, None, None

        def __init__(self):
            from oakenkv.methods.base import BitCounter

            self.counter = BitCounter()

    from oakenkv.methods.fakequant import FakeQuantCache

    c = _Cache()
    kq, vq = FakeQuantCache.quantize_kv(c, 1, k, v, 0)
    torch.testing.assert_close(kq, store.read(1, KEY), rtol=0, atol=1e-6)  # (the rotation's float rounding)
    torch.testing.assert_close(vq, store.read(1, VALUE), rtol=0, atol=0)
    c2 = _Cache()
    c2.quantizer = PlusQuantizer(dataclasses.replace(th, transforms=dataclasses.replace(th.transforms, sink_tokens=0)))
    FakeQuantCache.quantize_kv(c2, 1, k, v, 0)
    assert c.counter.bits - c2.counter.bits == 16 * 2 * 2 * H * HD
    # a later chunk (start past the sinks) is quantized as before
    k2, _ = FakeQuantCache.quantize_kv(_Cache(), 1, k, v, 5)
    assert not torch.equal(k2[:, :, :2], kq[:, :, :2])
    assert np.isfinite(k2.numpy()).all()


# ------------------------------------------------------------------------------------- left padding (issue 35)

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


def _feed(store: PagedKVStore, k: torch.Tensor, v: torch.Tensor, prefill: int, chunk: int) -> None:
    """A prefill of ``prefill`` tokens in chunks of ``chunk`` (through OakenLayer.update's paths), then the rest one
    token at a time (the decode path)."""
    from oakenkv.hf.cache import OakenLayer

    layer = OakenLayer(store, 1)
    for a in range(0, prefill, chunk):
        layer.update(k[:, :, a : min(prefill, a + chunk)], v[:, :, a : min(prefill, a + chunk)])
    for i in range(prefill, k.shape[2]):
        layer.update(k[:, :, i : i + 1], v[:, :, i : i + 1])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pads=st.lists(st.integers(0, 9), min_size=1, max_size=3),
    sink=st.integers(1, 3),
    real=st.integers(1, 12),
    prefill=st.integers(1, 30),
    chunk=st.integers(1, 30),
    seed=st.integers(0, 2**16),
)
def test_a_left_padded_row_is_stored_as_the_same_row_alone(pads, sink, real, prefill, chunk, seed):
    """Left padding changes nothing about a row's real tokens: with the rows' starts declared (the attention mask's
    first real token), every row reads back, from its first real token on, exactly what the same tokens alone read
    (its sink tokens are its first real tokens, at 16 bits); and the packed decode attention over the padded batch,
    the pads masked, equals each row's attention alone. Before, the sinks were every row's token 0: a pad."""
    b, t = len(pads), max(pads) + real
    k, v = _kv(b, t, seed)
    start = pads  # left padding: row r's first real token is token pads[r], every row ends at t
    prefill = min(prefill, t)
    store = PagedKVStore(_profile(sink), 2, H, HD, PoolConfig(page_size=1024))
    store.set_row_starts(start)
    _feed(store, k, v, prefill, chunk)
    q = torch.randn(b, HQ, 1, HD, generator=torch.Generator().manual_seed(seed + 1))
    mask = torch.ones(b, 1, 1, t, dtype=torch.bool)
    for r, p in enumerate(start):
        mask[r, ..., :p] = False
    packed = packed_decode_attention(q, PackedKV(store, 1, KEY, t), PackedKV(store, 1, VALUE, t), mask, HD**-0.5)
    for r, p in enumerate(start):
        alone = PagedKVStore(_profile(sink), 2, H, HD, PoolConfig(page_size=1024))
        _feed(alone, k[r : r + 1, :, p:], v[r : r + 1, :, p:], min(max(1, prefill - p), t - p), chunk)
        for kind in (KEY, VALUE):
            torch.testing.assert_close(store.read(1, kind)[r : r + 1, :, p:], alone.read(1, kind), rtol=0, atol=0)
        n = t - p
        want = packed_decode_attention(
            q[r : r + 1], PackedKV(alone, 1, KEY, n), PackedKV(alone, 1, VALUE, n), None, HD**-0.5
        )
        torch.testing.assert_close(packed[r : r + 1], want, rtol=2e-5, atol=2e-6)
    assert store.sink_bytes() == 2 * 2 * H * HD * sum(min(sink, t - p) for p in start)  # fp16, keys and values


def _tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(cfg).eval()


def test_the_caches_learn_each_rows_first_real_token_from_the_attention_mask():
    """OakenCache built with the model, and the evaluation's FakeQuantCache, read each forward's attention mask (a
    forward pre-hook): a left-padded row's sink is its first real token, in both, and both give the same logits."""
    from oakenkv.calibrate.thresholds import weights_digest
    from oakenkv.hf.cache import OakenCache
    from oakenkv.methods.fakequant import FakeQuantCache
    from oakenkv.methods.oaken import PlusQuantizer
    from oakenkv.util.compat import cache_kwargs

    model = _tiny_llama()
    fp = ModelFingerprint("llama", 2, 2, 8, weights=weights_digest(model))
    thr = tuple(GroupThresholds(-0.5 - i / 10, -0.02, 0.02, 0.5) for i in range(2))
    t = Transforms((LayerTransforms(), LayerTransforms()), 2, 8, sink_tokens=2)
    th = Thresholds(OakenConfig(), fp, thr, thr, transforms=t)
    ids = torch.randint(1, 64, (3, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[0, :4] = 0
    mask[2, :8] = 0  # one real token: its second sink token is the first generated one
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = OakenCache.from_profile(model, th)
    fq = FakeQuantCache(model, PlusQuantizer(th))
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask, position_ids=pos, **cache_kwargs(model, cache)).logits
        want = model(ids, mask, pos, **cache_kwargs(model, fq)).logits  # (the mask by position)
    assert cache.store.row_starts.tolist() == [4, 0, 8] and fq.row_starts.tolist() == [4, 0, 8]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    k = cache.store.read(0, KEY)
    for r, p in enumerate([4, 0, 8]):  # the sinks hold the row's first real key at 16 bits
        torch.testing.assert_close(k[r, :, p], k[r, :, p].half().float(), rtol=0, atol=0)
    # the next step (a new real token for every row) stores row 2's second sink token; nothing else moves
    nxt = torch.full((3, 1), 5)
    mask2 = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], dim=1)
    with torch.no_grad():
        model(input_ids=nxt, attention_mask=mask2, position_ids=pos[:, -1:] + 1, **cache_kwargs(model, cache))
    assert cache.store.row_starts.tolist() == [4, 0, 8]
    assert cache.store.sink_bytes() == 2 * 2 * 16 * (2 + 2 + 2) * 2  # fp16 x K,V x D x tokens x layers
