"""The device store (src/oakenkv/store/device.py) and ``OakenCache(backend="triton")``, against the CPU store.

Without a GPU the Triton kernels run under ``TRITON_INTERPRET=1`` on CPU tensors (tests/conftest.py sets it): the
whole device store runs here, ``model.generate`` included. The interpreter runs each program in Python (tenths of
a second per program), so the shapes are tiny: 2 KV heads x 16 (``D = 32``), 256-byte pages (many page
boundaries), a few tokens; and the default model's greedy run (docs/gpu.md: its time, and where it goes).

The reference is the CPU store (``PagedKVStore``), itself tested against the plain-PyTorch quantizer: the device
store must hold the same bytes for every token (dense and sparse records, at the addresses its tables give), the
same tables as its host pool, read back the same floats, and attend to float32 rounding of the same numbers.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed (pip install 'oakenkv[triton]')")

from oakenkv.calibrate.thresholds import GroupThresholds, ModelFingerprint, Thresholds
from oakenkv.calibrate.transforms import LayerTransforms, Transforms
from oakenkv.format.config import OakenConfig
from oakenkv.hf.attention import float_attention
from oakenkv.hf.attention import packed_decode_attention as cpu_attention
from oakenkv.hf.cache import PackedKV
from oakenkv.store.device import DeviceKVStore, stream_addresses
from oakenkv.store.paged import KEY, VALUE, PagedKVStore
from oakenkv.store.pages import PoolConfig, PoolExhaustedError

DEV = "cuda" if torch.cuda.is_available() else "cpu"
H, HD, HQ = 2, 16, 4
D = H * HD


def _thresholds(transforms=None, layers=2):
    fp = ModelFingerprint("llama", layers, H, HD)
    keys = tuple(GroupThresholds(-1.5 - 0.1 * i, -0.2, 0.2, 1.5 + 0.1 * i) for i in range(layers))
    values = tuple(GroupThresholds(-1.2 - 0.1 * i, -0.15, 0.15, 1.2 + 0.1 * i) for i in range(layers))
    return Thresholds(OakenConfig(), fp, keys, values, transforms=transforms)


def _plus(sink_tokens=0):
    """An oaken-plus online part: layer 1 shifts and rotates its keys; sink tokens at 16 bits."""
    shift = tuple(float(v) for v in np.random.default_rng(3).standard_normal(D) * 0.3)
    return Transforms(
        (LayerTransforms(), LayerTransforms(key_shift=shift, key_rotation=True)), H, HD, sink_tokens=sink_tokens
    )


def _pair(transforms=None, budget=1 << 20, chunk=5):
    """A CPU store and a device store of the same profile (256-byte pages: a page holds 9 dense records)."""
    thr = _thresholds(transforms)
    pc = PoolConfig(page_size=256, budget_bytes=budget)
    return (
        PagedKVStore(thr, 2, H, HD, pc, prefill_chunk=chunk),
        DeviceKVStore(thr, 2, H, HD, pc, prefill_chunk=chunk, device=DEV),
    )


def _kv(b, s, seed):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(b, H, s, HD, generator=g) * 1.3
    k[..., 3] *= 4.0  # an outlier channel
    v = torch.randn(b, H, s, HD, generator=g)
    return k, v


def _both(stores, layer, k, v):
    cpu, dev = stores
    cpu.append(layer, k, v)
    dev.append(layer, k.to(DEV), v.to(DEV))


def _assert_same_records(cpu: PagedKVStore, dev: DeviceKVStore, layer: int) -> None:
    """Every stored token's dense and sparse record is the same bytes in both stores (from the watermark on)."""
    dev.settle()
    ps = dev.pool.config.page_size
    data = dev.bytes.cpu().numpy()
    rpp = dev.rpp
    for r in range(len(cpu.seqs)):
        for kind in (KEY, VALUE):
            stream = 2 * layer + kind
            ct, dt = cpu.pool.table(cpu.seqs[r], stream), dev.pool.table(dev.seqs[r], stream)
            assert ct.num_tokens == dt.num_tokens and ct.evicted_before == dt.evicted_before
            start = ct.evicted_before
            n = ct.num_tokens
            np.testing.assert_array_equal(dt.sparse_len.view, ct.sparse_len.view)
            dense = cpu.pool.read_dense(cpu.seqs[r], stream, start)
            sparse, offs = cpu.pool.read_sparse(cpu.seqs[r], stream, start)
            addr = stream_addresses(dt, ps, start, n)
            for t in range(start, n):
                a = int(dt.dense_pages.view[t // rpp]) * ps + (t % rpp) * dev.rec_size
                assert np.array_equal(data[a : a + dev.rec_size], dense[t - start]), (r, kind, t)
                length = int(dt.sparse_len.view[t])
                want = sparse[offs[t - start] : offs[t - start + 1]]
                assert np.array_equal(data[addr[t - start] : addr[t - start] + length], want), (r, kind, t)
    dev.check_tables()
    dev.pool.check_invariants()


def test_device_store_holds_the_cpu_stores_bytes_through_prefill_decode_fork_and_eviction():
    stores = _pair(_plus(sink_tokens=2))
    cpu, dev = stores
    k, v = _kv(1, 7, seed=1)
    _both(stores, 1, k, v)  # a prefill in two chunks (5 + 2)
    _assert_same_records(cpu, dev, 1)
    for step in range(3):  # decode steps: one token, sparse records at reserved tails
        k, v = _kv(1, 1, seed=10 + step)
        _both(stores, 1, k * 3, v * 3)  # (many outliers: the sparse pages fill up)
    _assert_same_records(cpu, dev, 1)
    for s in (cpu, dev):
        s.reorder([0, 0])  # beam search: row 1 forks row 0, every page shared
    for step in range(4):  # copy on write of the shared last pages, then private pages
        k, v = _kv(2, 1, seed=20 + step)
        _both(stores, 1, k * 3, v * 3)
    k, v = _kv(2, 6, seed=30)
    _both(stores, 1, k, v)  # a chunk on top of decoded tokens
    _assert_same_records(cpu, dev, 1)
    for kind in (KEY, VALUE):  # the floats read back: sink tokens at 16 bits, keys rotated back
        assert torch.equal(dev.read(1, kind).cpu(), cpu.read(1, kind))
    released = [s.evict_before(1, 12) for s in (cpu, dev)]
    assert released[0] == released[1] > 0
    _assert_same_records(cpu, dev, 1)
    assert torch.equal(dev.read(1, VALUE).cpu(), cpu.read(1, VALUE))
    assert dev.stats() == type(dev.stats())(**{**vars(cpu.stats()), "pages_allocated": dev.pool.config.max_pages})
    assert dev.bits_per_value() == cpu.bits_per_value()


def test_a_decode_step_reserves_the_largest_record_and_settles_once():
    """A decode step writes each stream's sparse record at its tail only when the largest record fits there, and
    the host learns the lengths at the next step (one copy for every layer): until then the pending tokens'
    lengths read 0 on the host and the tail has not moved."""
    _, dev = _pair()
    k, v = _kv(1, 3, seed=2)
    for layer in (0, 1):
        dev.append(layer, k.to(DEV), v.to(DEV))
    k, v = _kv(1, 1, seed=3)
    for layer in (0, 1):
        dev.append(layer, k.to(DEV), v.to(DEV))
    table = dev.pool.table(dev.seqs[0], 2)
    assert table.num_tokens == 4 and table.sparse_len.view[-1] == 0 and dev._pending_layers == {0, 1}
    dev.append(0, k.to(DEV), v.to(DEV))  # the next step's first layer: both layers settle
    assert table.sparse_len.view[-1] > 0 and dev._pending_layers == {0}
    dev.settle()
    assert table.sparse_tail <= dev.pool.config.page_size
    dev.check_tables()
    dev.pool.check_invariants()


def test_failed_writes_change_nothing_and_decode_errors_surface_at_settle():
    _, dev = _pair(budget=256 * 8, chunk=64)  # 8 pages; each chunk of an update is atomic
    k, v = _kv(1, 2, seed=4)
    dev.append(1, k.to(DEV), v.to(DEV))
    before = dev.pool.stats()
    k, v = _kv(1, 40, seed=5)
    with pytest.raises(PoolExhaustedError, match="no sequence was changed"):
        dev.append(1, k.to(DEV), v.to(DEV))
    assert dev.pool.stats() == before and dev.num_tokens(1) == 2
    bad = torch.full((1, H, 1, HD), float("nan"), device=DEV)
    with pytest.raises(ValueError, match="cannot encode the keys of row 0"):
        dev.append(1, bad.expand(1, H, 2, HD), bad.expand(1, H, 2, HD))  # a chunk: raised before any change
    assert dev.num_tokens(1) == 2
    dev.append(1, bad, bad)  # a decode step: the encoder's code is read at the next settle
    with pytest.raises(ValueError, match=r"layer 1: cannot encode the keys of row 0.*must be reset"):
        dev.settle()


def test_device_attention_matches_the_cpu_store_decode_and_prefill():
    """Decode (flash-decoding) and prefill (flash attention over pages) on the device store, with sink tokens and
    an oaken-plus key rotation, against the CPU store's kernel and float attention over its read."""
    cpu, dev = _pair(_plus(sink_tokens=2), chunk=64)
    g = torch.Generator().manual_seed(7)
    k, v = _kv(2, 11, seed=6)
    _both((cpu, dev), 1, k, v)
    q = torch.randn(2, HQ, 11, HD, generator=g)
    mask = torch.ones(2, 1, 11, 11, dtype=torch.bool).tril()
    mask[1, ..., :3] = False  # left padding of row 1
    mask[1, :, :3, 0] = True  # (its padded queries see one token, as transformers' fix of fully masked rows)
    got = dev.attention(q.to(DEV), 1, mask.to(DEV), 0.25).cpu()  # [B, S, Hq, hd]
    kr, vr = cpu.read(1, KEY), cpu.read(1, VALUE)
    want = float_attention(q, kr, vr, mask, 0.25)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)
    got = dev.attention(q.to(DEV), 1, None, 0.25, softcap=2.0).cpu()  # causal, soft cap
    causal = torch.ones(2, 1, 11, 11, dtype=torch.bool).tril()
    torch.testing.assert_close(got, float_attention(q, kr, vr, causal, 0.25, softcap=2.0), rtol=1e-5, atol=2e-6)
    k, v = _kv(2, 1, seed=8)  # a decode step
    _both((cpu, dev), 1, k, v)
    q = torch.randn(2, HQ, 1, HD, generator=g)
    keep = torch.ones(2, 1, 1, 12, dtype=torch.bool)
    keep[1, ..., :3] = False
    kh, vh = PackedKV(cpu, 1, KEY, 12), PackedKV(cpu, 1, VALUE, 12)
    got = dev.attention(q.to(DEV), 1, keep.to(DEV), 0.25).cpu()
    torch.testing.assert_close(got, cpu_attention(q, kh, vh, keep, 0.25), rtol=1e-5, atol=2e-6)
    dev.settle()  # no error code from the kernels


def test_backend_selection_and_refusals(monkeypatch):
    from transformers import LlamaConfig

    from oakenkv.hf.cache import OakenCache

    cfg = _tiny_config(layers=2)
    thr = _thresholds()
    assert type(OakenCache(thr, cfg).store) is PagedKVStore  # "auto": chosen at the first update
    assert type(OakenCache(thr, cfg, backend="triton").store) is DeviceKVStore
    with pytest.raises(ValueError, match="backend must be one of"):
        OakenCache(thr, cfg, backend="cuda")
    with pytest.raises(ValueError, match="no full-precision window"):
        OakenCache(thr, cfg, backend="triton", residual=4)
    with pytest.raises(ValueError, match="codec must be 'auto'"):
        OakenCache(thr, cfg, backend="triton", codec="reference")
    cache = OakenCache(thr, cfg)
    k, v = _kv(1, 2, seed=9)
    cache.update(k, v, 0)
    assert type(cache.store) is PagedKVStore and all(layer.store is cache.store for layer in cache.layers)
    meta = torch.zeros(1, H, 2, HD, device="meta")
    for backend in ("auto", "numba"):  # a device that is neither the CPU nor CUDA: the host store refuses it
        with pytest.raises(ValueError, match=r"host store .* got tensors on meta"):
            OakenCache(thr, cfg, backend=backend).update(meta, meta, 0)
    if not torch.cuda.is_available():
        monkeypatch.delenv("TRITON_INTERPRET")
        with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
            DeviceKVStore(thr, 2, H, HD, device="cpu")
    assert isinstance(cfg, LlamaConfig)


def _tiny_config(layers=2):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=HQ,
        num_key_value_heads=H, head_dim=HD, max_position_embeddings=128, eos_token_id=1, pad_token_id=0,
    )  # fmt: skip


def test_generate_with_the_triton_backend_gives_the_numba_backends_tokens():
    """``model.generate`` on a tiny random Llama (2 layers) with an oaken-plus profile (key shift and rotation in
    layer 1, a sink token): the float read path gives the CPU store's logits exactly (the same stored floats),
    the packed attention the same greedy tokens up to its summation order."""
    from transformers import LlamaForCausalLM

    from kv_helpers import assert_same_greedy
    from oakenkv.hf.attention import oaken_attention
    from oakenkv.hf.cache import OakenCache
    from oakenkv.util.compat import cache_kwargs

    torch.manual_seed(0)
    cfg = _tiny_config()
    model = LlamaForCausalLM(cfg).eval()
    thr = _thresholds(_plus(sink_tokens=1))
    ids = torch.tensor([[3, 4, 5, 17, 33, 2, 64], [7, 8, 9, 10, 11, 12, 13]])
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    kw = {"max_new_tokens": 5, "do_sample": False, "output_logits": True, "return_dict_in_generate": True}
    pc = PoolConfig(page_size=256, budget_bytes=1 << 20)

    def run(backend, packed):
        cache = OakenCache.from_profile(model, thr, backend=backend, pool_config=pc)
        with torch.no_grad():
            if packed:
                with oaken_attention(model):
                    return model.generate(**inputs, **cache_kwargs(model, cache), **kw), cache
            return model.generate(**inputs, **cache_kwargs(model, cache), **kw), cache

    want, _ = run("numba", False)
    got, cache = run("triton", False)
    assert torch.equal(got.sequences, want.sequences)
    assert all(torch.equal(a, b) for a, b in zip(want.logits, got.logits, strict=True))
    want, _ = run("numba", True)
    got, cache = run("triton", True)
    assert_same_greedy(want, got, first_atol=1e-4)
    assert type(cache.store) is DeviceKVStore and cache.get_seq_length() == ids.shape[1] + 4
    cache.store.check_tables()
    cache.store.pool.check_invariants()


def test_left_padded_rows_keep_their_own_sink_tokens_on_the_device():
    """Rows with their own starts (left padding, ``set_row_starts``): each row's sink tokens are its first real ones,
    as on the CPU store: the same bytes, the same floats read back, the same sink bytes; attention (prefill over
    pages and decode) masks each row's sink positions out of the pages' part and merges their 16-bit part."""
    cpu, dev = _pair(_plus(sink_tokens=2), chunk=4)
    for st in (cpu, dev):
        st.set_row_starts([0, 3])
    k, v = _kv(2, 9, seed=40)
    _both((cpu, dev), 1, k, v)  # chunks of 4: row 1's sinks (tokens 3, 4) across a chunk boundary
    for step in range(2):
        k, v = _kv(2, 1, seed=41 + step)
        _both((cpu, dev), 1, k, v)
    _assert_same_records(cpu, dev, 1)
    for kind in (KEY, VALUE):
        assert torch.equal(dev.read(1, kind).cpu(), cpu.read(1, kind))
    assert dev.sink_bytes() == cpu.sink_bytes() > 0
    g = torch.Generator().manual_seed(9)
    t = 11
    kr, vr = cpu.read(1, KEY), cpu.read(1, VALUE)
    q = torch.randn(2, HQ, 1, HD, generator=g)
    keep = torch.ones(2, 1, 1, t, dtype=torch.bool)
    keep[1, ..., :3] = False  # row 1's padding
    want = float_attention(q, kr, vr, keep, 0.25)
    torch.testing.assert_close(dev.attention(q.to(DEV), 1, keep.to(DEV), 0.25).cpu(), want, rtol=1e-5, atol=2e-6)
    kh, vh = PackedKV(cpu, 1, KEY, t), PackedKV(cpu, 1, VALUE, t)
    torch.testing.assert_close(cpu_attention(q, kh, vh, keep, 0.25), want, rtol=1e-5, atol=2e-6)
    # a prefill chunk's queries (the last 4 tokens), causal and with an explicit mask
    q = torch.randn(2, HQ, 4, HD, generator=g)
    mask = torch.ones(2, 1, t, t, dtype=torch.bool).tril()[:, :, -4:]
    mask[1, ..., :3] = False
    want = float_attention(q, kr, vr, mask, 0.25)
    torch.testing.assert_close(dev.attention(q.to(DEV), 1, mask.to(DEV), 0.25).cpu(), want, rtol=1e-5, atol=2e-6)
    causal = torch.ones(2, 1, t, t, dtype=torch.bool).tril()[:, :, -4:]
    torch.testing.assert_close(
        dev.attention(q.to(DEV), 1, None, 0.25).cpu(), float_attention(q, kr, vr, causal, 0.25), rtol=1e-5, atol=2e-6
    )
    for st in (cpu, dev):
        st.reorder([1, 1])  # the starts follow their rows
    assert dev.row_starts.tolist() == cpu.row_starts.tolist() == [3, 3]
    for kind in (KEY, VALUE):
        assert torch.equal(dev.read(1, kind).cpu(), cpu.read(1, kind))
    dev.settle()


def test_adaptive_grouping_on_the_device_moves_the_cpu_stores_thresholds():
    """``adapt=``: the device store feeds the adaptive state the CPU store's counts (prefill chunks split at epoch
    ends, decode steps at settle), so every epoch's grouping thresholds, and every token's bytes, are the CPU
    store's; the page view keeps the shift thresholds."""
    from oakenkv.quant.adapt import AdaptConfig

    ad = AdaptConfig(epoch=3, gain=1.0, low=1.0, high=3.0)
    thr = _thresholds()
    pc = PoolConfig(page_size=256, budget_bytes=1 << 20)
    cpu = PagedKVStore(thr, 2, H, HD, pc, prefill_chunk=5, adapt=ad)
    dev = DeviceKVStore(thr, 2, H, HD, pc, prefill_chunk=5, device=DEV, adapt=ad)
    k, v = _kv(1, 7, seed=50)
    for layer in (0, 1):
        _both((cpu, dev), layer, k * 2, v * 2)  # many outliers: the outer thresholds widen
    for step in range(5):
        k, v = _kv(1, 1, seed=51 + step)
        for layer in (0, 1):
            _both((cpu, dev), layer, k * (2 + step), v * 2)
    dev.settle()
    assert dev.adapt_state.scale == cpu.adapt_state.scale
    assert any(a != 1.0 for row in cpu.adapt_state.scale for a in row)
    assert np.array_equal(dev.thr, cpu.thr)
    for layer in (0, 1):
        _assert_same_records(cpu, dev, layer)
        for kind in (KEY, VALUE):
            assert torch.equal(dev.read(layer, kind).cpu(), cpu.read(layer, kind))
    dev.reset()
    assert dev.adapt_state.scale == [[1.0, 1.0], [1.0, 1.0]]


def test_generate_left_padded_under_sink_tokens_and_adaptive_grouping_gives_the_numba_tokens():
    """``model.generate`` with ``backend="triton"`` on a left-padded batch under an oaken-plus profile with sink
    tokens (each row's from its first real token, learned from the attention mask) and adaptive grouping (3-token
    epochs: the thresholds move during the run): the float path the numba backend's logits exactly, the packed
    attention its greedy tokens; both backend choices that reach the device store ("triton"; "auto" is the same
    store once it sees CUDA tensors)."""
    from transformers import LlamaForCausalLM

    from kv_helpers import assert_same_greedy
    from oakenkv.hf.attention import oaken_attention
    from oakenkv.hf.cache import OakenCache
    from oakenkv.quant.adapt import AdaptConfig
    from oakenkv.util.compat import cache_kwargs

    torch.manual_seed(0)
    model = LlamaForCausalLM(_tiny_config()).eval()
    thr = _thresholds(_plus(sink_tokens=1))
    ids = torch.tensor([[0, 0, 5, 17, 33, 2, 64], [7, 8, 9, 10, 11, 12, 13]])
    inputs = {"input_ids": ids, "attention_mask": (ids != 0).long()}
    kw = {"max_new_tokens": 5, "do_sample": False, "output_logits": True, "return_dict_in_generate": True}
    pc = PoolConfig(page_size=256, budget_bytes=1 << 20)
    ad = AdaptConfig(epoch=3, gain=1.0, high=3.0)

    def run(backend, packed):
        cache = OakenCache.from_profile(model, thr, backend=backend, pool_config=pc, adapt=ad)
        with torch.no_grad(), oaken_attention(model) if packed else contextlib.nullcontext():
            return model.generate(**inputs, **cache_kwargs(model, cache), **kw), cache

    want, cpu_cache = run("numba", False)
    got, cache = run("triton", False)
    assert cache.store.row_starts.tolist() == cpu_cache.store.row_starts.tolist() == [2, 0]
    assert cache.store.adapt_state.scale == cpu_cache.store.adapt_state.scale
    assert torch.equal(got.sequences, want.sequences)
    assert all(torch.equal(a, b) for a, b in zip(want.logits, got.logits, strict=True))
    want, _ = run("numba", True)
    got, cache = run("triton", True)
    assert_same_greedy(want, got, first_atol=1e-4)
    assert type(cache.store) is DeviceKVStore
    cache.store.check_tables()
    cache.store.pool.check_invariants()


#: How far the default model's logits may drift between the backends with the packed attention. Unlike the CPU
#: backend's packed path (SDPA at prefill, tests/kv_helpers.GREEDY_DRIFT), the device store's prefill attention sums
#: in another order too, so 4-bit codes next to a rounding boundary flip from the prompt's forward on, in every one of
#: the 30 layers: measured 0.33 at the prompt and up to 2.66 over 16 steps under the interpreter with the kernels' GPU
#: block sizes (the same tokens; with the interpreter's launch options of interpret.store_blocks 2.1e-5 and 3.6e-4).
DEVICE_DRIFT = 3.0


def test_default_model_generates_the_numba_backends_greedy_tokens(default_model):
    """The default model (30 layers) under the interpreter. The packed attention, 16 new tokens: the numba
    backend's greedy tokens, logits within ``DEVICE_DRIFT`` (``assert_same_greedy``). The float read path, 4 new
    tokens (the prompt's records and four decode steps' in every layer: each step of it reads a layer's whole history
    through the interpreter, so more steps cost a minute and test the same code again): both backends store and read
    back the same floats (the device store's bytes are the CPU store's), so identical logits at every step. Under the
    interpreter the store launches its kernels with larger blocks and fewer programs
    (``kernels.triton.interpret.store_blocks``; docs/gpu.md: the time of this test)."""
    from kv_helpers import assert_same_greedy, quick_thresholds
    from oakenkv.hf.attention import oaken_attention
    from oakenkv.hf.cache import OakenCache
    from oakenkv.util.compat import cache_kwargs

    model, tok = default_model.model, default_model.tokenizer
    thr = quick_thresholds(default_model)
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    kw = {"do_sample": False, "output_logits": True, "return_dict_in_generate": True}
    outs = {}
    for packed in (False, True):
        for backend in ("numba", "triton"):
            cache = OakenCache(thr, model.config, backend=backend, pool_config=PoolConfig(budget_bytes=64 << 20))
            with torch.no_grad(), oaken_attention(model) if packed else contextlib.nullcontext():
                outs[packed, backend] = model.generate(
                    input_ids=ids, max_new_tokens=16 if packed else 4, **cache_kwargs(model, cache), **kw
                )
    want, got = outs[False, "numba"], outs[False, "triton"]
    assert torch.equal(want.sequences, got.sequences)
    assert all(torch.equal(a, b) for a, b in zip(want.logits, got.logits, strict=True))
    assert len(got.logits) == 4
    assert_same_greedy(outs[True, "numba"], outs[True, "triton"], first_atol=DEVICE_DRIFT, drift=DEVICE_DRIFT)
    assert len(outs[True, "triton"].logits) == 16
