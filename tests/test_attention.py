"""Decode attention over packed pages (src/oakenkv/hf/attention.py, src/oakenkv/kernels/cpu/attention.py).

The kernel is checked against float attention over the dequantized cache (tight tolerance: same numbers, only
the summation order differs) and against float attention over the original, unquantized K/V (the quantization
error, bounded loosely and reported).
"""

from __future__ import annotations

import numba
import numpy as np
import pytest
import torch

from oakenkv.calibrate.thresholds import GroupThresholds, ModelFingerprint, Thresholds
from oakenkv.format.config import DEFAULT_STATIC_LEVELS, OakenConfig
from oakenkv.hf.attention import (
    float_attention,
    packed_decode_attention,
    reference_packed_attention,
)
from oakenkv.hf.cache import KEY, VALUE, PackedKV, PagedKVStore
from oakenkv.store.pages import PoolConfig

H, HD, HQ = 3, 64, 9  # the default model's attention shape: GQA, 3 query heads per KV head


def _thresholds(num_layers: int = 2, config: OakenConfig | None = None) -> Thresholds:
    fp = ModelFingerprint("llama", num_layers, H, HD)
    keys = tuple(GroupThresholds(-2.0 - 0.1 * i, -0.15, 0.15, 2.0 + 0.1 * i) for i in range(num_layers))
    values = tuple(GroupThresholds(-1.5 - 0.1 * i, -0.1, 0.1, 1.5 + 0.1 * i) for i in range(num_layers))
    return Thresholds(config or OakenConfig(), fp, keys, values)


def _kv(b: int, t: int, seed: int, spread: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(b, H, t, HD, generator=g)
    k[..., 5] *= 6.0  # an outlier channel, as real keys have
    v = torch.randn(b, H, t, HD, generator=g) * 0.8
    if spread:  # tokens of smaller and larger magnitudes (their middle values reach different static levels)
        f = torch.tensor([0.2, 0.4, 0.6, 1.0]).repeat(t // 4 + 1)[:t].reshape(1, 1, t, 1)
        k, v = k * f, v * f
    return k, v


def _store(
    b: int, t: int, seed: int = 0, page_size: int = 4096, chunk: int = 97, config: OakenConfig | None = None,
    codec: str = "auto", spread: bool = False,
):  # fmt: skip
    th = _thresholds(config=config)
    store = PagedKVStore(th, 2, H, HD, PoolConfig(page_size=page_size), codec=codec, prefill_chunk=chunk)
    k, v = _kv(b, t, seed, spread)
    for start in range(0, t, chunk):  # several appends: tokens spread over many dense and sparse pages
        store.append(1, k[:, :, start : start + chunk], v[:, :, start : start + chunk])
    handles = PackedKV(store, 1, KEY, t), PackedKV(store, 1, VALUE, t)
    return store, k, v, handles


def _mask(b: int, t: int, pad: list[int], window: int | None = None) -> torch.Tensor:
    """bool [B, 1, 1, T]: left padding of ``pad[b]`` tokens, optional sliding window."""
    keep = torch.ones(b, 1, 1, t, dtype=torch.bool)
    for r, p in enumerate(pad):
        keep[r, ..., :p] = False
    if window is not None:
        keep[..., : t - window] = False
    return keep


@pytest.mark.parametrize(
    ("b", "t", "pad", "window", "page_size"),
    [
        (1, 1, [0], None, 4096),
        (1, 300, [0], None, 4096),
        (2, 517, [0, 37], None, 512),  # padding; small pages: many page boundaries
        (3, 260, [5, 0, 100], 64, 4096),  # sliding window on top of padding
    ],
)
def test_kernel_matches_float_attention_over_the_dequantized_cache(b, t, pad, window, page_size):
    _, k, v, (kh, vh) = _store(b, t, seed=t, page_size=page_size)
    q = torch.randn(b, HQ, 1, HD, generator=torch.Generator().manual_seed(1))
    mask = _mask(b, t, pad, window)
    got = packed_decode_attention(q, kh, vh, mask, HD**-0.5)
    want = reference_packed_attention(q, kh, vh, mask, HD**-0.5)
    assert got.shape == (b, 1, HQ, HD)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6)
    # Against the original (unquantized) K/V: the quantization error, small but not zero.
    exact = float_attention(q, k, v, mask, HD**-0.5)
    rel = ((got - exact).norm() / exact.norm()).item()
    print(f"B={b} T={t}: relative error vs the unquantized cache {rel:.4f}")
    assert 0 < rel < 0.1


@pytest.mark.parametrize(
    ("mb", "static"),
    [(4, False), (3, False), (2, False), (6, False), (4, True), (2, True), (6, True), (4, "levels"), (3, "levels")],
)
def test_slot_widths_pages_and_kernel_are_the_references(mb, static):
    """4-, 3-, 2- and 6-bit dense slots (OakenConfig.middle_bits; 6 runs the one copy 5..7 share) through the store
    and the packed attention kernel: the pages are byte for byte what the reference codec writes, the kernel's row
    decoder gives the reference's floats bit for bit, and the attention matches float attention over them (only the
    summation order differs). A decode step's single-token appends (encode_records) and a prefill's appends both
    write pages. With static grids (OakenConfig.static_grids) the records hold the outer scales alone and the
    kernel takes the middle and inner grids from the view; with static levels (OakenConfig.static_levels) the
    records hold a level byte too, which picks the row's grid among the view's."""
    from oakenkv.kernels.cpu import attention as attention_cpu

    # numba compiles a callee without its own fastmath option with its caller's (the fast-math kernel) and caches
    # that code: the row decoder must say fastmath=False itself to stay bit-exact inside the kernel
    for f in (attention_cpu._decode_rows, attention_cpu._coo_walk, attention_cpu._unpack_slots, attention_cpu._f16_at):
        assert f.targetoptions.get("fastmath") is False, f
    levels = DEFAULT_STATIC_LEVELS if static == "levels" else ()
    cfg = OakenConfig(middle_bits=mb, static_grids=bool(static), static_levels=levels)
    b, t = 2, 230
    spread = bool(levels)
    fast, k, v, (kh, vh) = _store(b, t, seed=mb, page_size=1024, config=cfg, spread=spread)
    ref, _, _, _ = _store(b, t, seed=mb, page_size=1024, config=cfg, codec="reference", spread=spread)
    for i in range(3):  # decode steps: the fused single-token path
        kt, vt = _kv(b, 1, seed=100 + i)
        fast.append_token(1, kt, vt)
        ref.append(1, kt, vt)
        k, v = torch.cat([k, kt], dim=2), torch.cat([v, vt], dim=2)
    t += 3
    kh, vh = PackedKV(fast, 1, KEY, t), PackedKV(fast, 1, VALUE, t)
    view, rview = fast.layer_view(1), ref.layer_view(1)
    sb = (4 if static else 12) + bool(levels)
    assert view.middle_bits == mb and view.scale_bytes == sb and view.record_size == sb + (mb * H * HD + 7) // 8
    assert view.static_grid.shape == (2, 4 * len(levels) if levels else 4 if static else 0)
    for kind in (KEY, VALUE):
        want = ref.read(1, kind)
        assert torch.equal(fast.read(1, kind), want)
        for r in range(b):  # the same records and streams in both pools
            for stream in (fast.pool.table(fast.seqs[r], 2 + kind), ref.pool.table(ref.seqs[r], 2 + kind)):
                assert stream.num_tokens == t
            dense = fast.pool.read_dense(fast.seqs[r], 2 + kind, 0)
            assert np.array_equal(dense, ref.pool.read_dense(ref.seqs[r], 2 + kind, 0))
            if levels:  # the rows take several levels (the test reads each one's grid)
                assert len(np.unique(dense[:, 4])) > 1 and dense[:, 4].max() < len(levels)
            got_sp, got_off = fast.pool.read_sparse(fast.seqs[r], 2 + kind, 0)
            want_sp, want_off = ref.pool.read_sparse(ref.seqs[r], 2 + kind, 0)
            assert np.array_equal(got_sp, want_sp) and np.array_equal(got_off, want_off)
            # the kernel's own row decoder, every token of the stream
            out = np.empty((t, H * HD), np.float32)
            keep = np.ones(t, np.uint8)
            st, _, _ = attention_cpu._decode_rows(
                view.pool, view.page_size, view.record_size, view.scale_bytes, view.dense_pages[r, kind],
                view.sparse_pages[r, kind], view.sparse_first[r, kind], view.sparse_counts[r, kind],
                view.sparse_lengths[r, kind], view.thresholds[kind], mb, view.inner_bits, view.outer_bits, keep, 0,
                *attention_cpu._sparse_start(
                    view.sparse_first[r, kind], view.sparse_counts[r, kind], view.sparse_lengths[r, kind], 0
                ),
                out, view.static_grid[kind],
            )  # fmt: skip
            assert st == 0
            rows = want[r].permute(1, 0, 2).reshape(t, H * HD)
            assert torch.equal(torch.from_numpy(out).view(torch.int32), rows.contiguous().view(torch.int32))
    assert rview.record_size == view.record_size
    q = torch.randn(b, HQ, 1, HD, generator=torch.Generator().manual_seed(mb))
    mask = _mask(b, t, [0, 17])
    got = packed_decode_attention(q, kh, vh, mask, HD**-0.5)
    torch.testing.assert_close(got, reference_packed_attention(q, kh, vh, mask, HD**-0.5), rtol=2e-5, atol=2e-6)
    rel = ((got - float_attention(q, k, v, mask, HD**-0.5)).norm() / got.norm()).item()
    assert 0 < rel < {3: 0.2, 2: 0.4}.get(mb, 0.1)  # a narrower slot costs accuracy, but stays attention


def test_parallel_splits_match_serial():
    """The multi-threaded kernel (token ranges combined at the end) gives the serial kernel's result."""
    _, _, _, (kh, vh) = _store(2, 4200, seed=3)  # B * T >= attention_cpu.PARALLEL_MIN_TOKENS: the parallel kernel
    q = torch.randn(2, HQ, 1, HD, generator=torch.Generator().manual_seed(2))
    mask = _mask(2, 4200, [0, 11])
    parallel = packed_decode_attention(q, kh, vh, mask, 0.125)
    previous = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        serial = packed_decode_attention(q, kh, vh, mask, 0.125)
    finally:
        numba.set_num_threads(previous)
    torch.testing.assert_close(parallel, serial, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(parallel, reference_packed_attention(q, kh, vh, mask, 0.125), rtol=2e-5, atol=2e-6)


def test_no_two_cached_kernels_share_one_python_function():
    """numba's on-disk cache keys an entry by the Python function's source location and the signature, not by the
    compile options: two ``njit`` dispatchers of one function (say parallel and serial) share one cache entry and
    both run whichever was compiled first. This happened to the decode-attention kernel (its parallel version ran
    on one thread); keep every cached kernel its own function."""
    import importlib
    import importlib.util
    import pkgutil

    from numba.core.registry import CPUDispatcher

    import oakenkv

    seen: dict[int, tuple[int, str]] = {}  # id(py_func) -> (id(dispatcher), its name)
    for info in pkgutil.walk_packages(oakenkv.__path__, "oakenkv."):
        if info.name.startswith(("oakenkv.eval", "oakenkv.bench")):
            continue  # heavy optional imports; they define no kernels
        if info.name.startswith("oakenkv.kernels.triton") and importlib.util.find_spec("triton") is None:
            continue  # the optional Triton backend (extra "triton"); its kernels are not numba's
        vllm_api = ("oakenkv.integrations.vllm.backend", "oakenkv.integrations.vllm.cuda")
        if info.name in vllm_api and importlib.util.find_spec("vllm") is None:
            continue  # the vLLM plugin's backends import vLLM (extra "vllm"); its numba kernels are in layout.py
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if isinstance(obj, CPUDispatcher):
                first = seen.setdefault(id(obj.py_func), (id(obj), f"{info.name}.{name}"))
                assert first[0] == id(obj), f"{first[1]} and {info.name}.{name} compile one Python function"


def test_softcap_and_additive_mask():
    _, _, _, (kh, vh) = _store(1, 70, seed=4)
    q = torch.randn(1, HQ, 1, HD, generator=torch.Generator().manual_seed(5)) * 3
    additive = torch.zeros(1, 1, 1, 70)
    additive[..., :10] = torch.finfo(torch.float32).min
    got = packed_decode_attention(q, kh, vh, additive, 0.125, softcap=5.0)
    want = reference_packed_attention(q, kh, vh, additive, 0.125, softcap=5.0)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6)


def test_bad_input_is_rejected():
    _, _, _, (kh, vh) = _store(1, 10, seed=6)
    with pytest.raises(ValueError, match="one query token"):
        packed_decode_attention(torch.zeros(1, HQ, 2, HD), kh, vh, None, 0.1)
    with pytest.raises(ValueError, match="does not fit"):
        packed_decode_attention(torch.zeros(1, HQ, 1, 32), kh, vh, None, 0.1)
    with pytest.raises(ValueError, match="one layer"):
        packed_decode_attention(torch.zeros(1, HQ, 1, HD), kh, kh, None, 0.1)
    with pytest.raises(ValueError, match="covers 9 tokens"):
        packed_decode_attention(torch.zeros(1, HQ, 1, HD), kh, vh, torch.ones(1, 1, 1, 9, dtype=torch.bool), 0.1)


@pytest.mark.parametrize("scale_dtype", ["float16", "float32"])
def test_decode_step_append_writes_the_same_pages_as_the_general_path(scale_dtype):
    """PagedKVStore.append_token (one serial kernel, scalar page bookkeeping) == append, byte for byte."""
    base = _thresholds()
    thr = Thresholds(OakenConfig(scale_dtype=scale_dtype), base.fingerprint, base.keys, base.values)
    b, t0, steps = 2, 50, 40
    k, v = _kv(b, t0 + steps, seed=3)
    fast = PagedKVStore(thr, 2, H, HD, PoolConfig(page_size=512))
    slow = PagedKVStore(thr, 2, H, HD, PoolConfig(page_size=512))
    for store in (fast, slow):
        store.append(1, k[:, :, :t0], v[:, :, :t0])
    for s in range(t0, t0 + steps):  # crosses dense and sparse page boundaries (512-byte pages)
        # a transposed (non-contiguous) view, as the model's value states are
        vt = v[:, :, s : s + 1].transpose(1, 2).contiguous().transpose(1, 2)
        fast.append_token(1, k[:, :, s : s + 1], vt)
        slow.append(1, k[:, :, s : s + 1], v[:, :, s : s + 1])
    for stream in (2, 3):
        for sf, ss in zip(fast.seqs, slow.seqs, strict=True):
            np.testing.assert_array_equal(fast.pool.read_dense(sf, stream), slow.pool.read_dense(ss, stream))
            for a, c in zip(fast.pool.read_sparse(sf, stream), slow.pool.read_sparse(ss, stream), strict=True):
                np.testing.assert_array_equal(a, c)
    fast.pool.check_invariants()
    assert fast.stats() == slow.stats()
    # A NaN is a clear error that leaves the store as it was.
    before = fast.stats()
    bad = k[:, :, :1].clone()
    bad[1, 2, 0, 7] = float("nan")
    with pytest.raises(ValueError, match="keys of row 1: input contains a NaN"):
        fast.append_token(1, bad, v[:, :, :1])
    assert fast.stats() == before and fast.num_tokens(1) == t0 + steps


def test_mask_conversion_is_cached_per_tensor_and_sees_in_place_changes():
    from oakenkv.hf.attention import _keep_mask

    mask = _mask(2, 40, [0, 7])
    first = _keep_mask(mask, 2, 40)
    assert _keep_mask(mask, 2, 40) is first  # the same tensor: converted once
    assert first[1, :7].sum() == 0 and first[1, 7:].all() and first[0].all()
    mask[0, 0, 0, :3] = False  # edited in place: converted again
    again = _keep_mask(mask, 2, 40)
    assert again is not first and again[0, :3].sum() == 0
    other = mask.clone()  # an equal but different tensor is converted on its own
    assert _keep_mask(other, 2, 40) is not again
    with torch.inference_mode():
        inf = _mask(1, 5, [2])
        assert _keep_mask(inf, 1, 5).tolist() == [[0, 0, 1, 1, 1]]


def test_threads_decoding_at_once_never_get_each_others_mask():
    """The memo of the last converted mask was a module-global list checked in one statement and returned in
    another: two threads decoding with different masks of one shape (two generate calls in a threaded server)
    got each other's mask, about once in 2,000 calls with a short switch interval. It is a tuple replaced whole."""
    import sys
    import threading

    from oakenkv.hf.attention import _keep_mask

    before = sys.getswitchinterval()
    masks = [_mask(2, 40, [3, 3]), _mask(2, 40, [17, 17])]
    wrong = [0, 0]

    def work(i: int) -> None:
        want = masks[i][:, 0, 0, :].numpy().astype(np.uint8)
        for _ in range(40_000):
            if not np.array_equal(_keep_mask(masks[i], 2, 40), want):
                wrong[i] += 1

    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=work, args=(i,)) for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(before)
    assert wrong == [0, 0]


def _sparse_outlier_kv(b: int, t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V whose rows hold only 0-5 outliers each (inner and outer, both signs) at random positions: most rows need
    COO escapes (an entry two chunks ahead, or the same index and group one chunk ahead), which real rows rarely
    do, and runs of one, two and more entries exercise every branch of the kernel's walk."""
    g = np.random.default_rng(seed)
    out = []
    for _ in range(2):
        x = g.uniform(0.4, 1.6, size=(b, t, H * HD)) * g.choice([-1.0, 1.0], size=(b, t, H * HD))
        for r in range(b):
            for s in range(t):
                n = g.integers(0, 6)
                pos = g.choice(H * HD, size=n, replace=False)
                if n >= 2 and g.random() < 0.3:  # the same index one chunk apart: equal COO bytes
                    pos[1] = (pos[0] + 64) % (H * HD)
                x[r, s, pos] = g.choice([-4.0, -3.0, -0.02, 0.01, 0.03, 3.5, 5.0], size=n)
        out.append(torch.from_numpy(x.astype(np.float32)).reshape(b, t, H, HD).transpose(1, 2).contiguous())
    return out[0], out[1]


def test_kernel_walks_escapes_like_the_reference():
    b, t = 2, 200
    store = PagedKVStore(_thresholds(), 2, H, HD, PoolConfig(page_size=512))
    k, v = _sparse_outlier_kv(b, t, seed=11)
    store.append(1, k, v)
    lens = store.layer_view(1).sparse_lengths[:, :, :t]
    assert (lens == 0).any() and (lens > 8).any()  # rows without outliers and rows with escapes
    kh, vh = PackedKV(store, 1, KEY, t), PackedKV(store, 1, VALUE, t)
    q = torch.randn(b, HQ, 1, HD, generator=torch.Generator().manual_seed(3))
    mask = _mask(b, t, [0, 3])
    got = packed_decode_attention(q, kh, vh, mask, HD**-0.5)
    torch.testing.assert_close(got, reference_packed_attention(q, kh, vh, mask, HD**-0.5), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize(
    ("record", "message"),
    [
        (lambda n: [0x00, 0x03, 0x05] + [0] * (n - 3), "past the end"),  # an escape three chunks ahead
        (lambda n: [0x05, 0x04, 0x03, 0x02] + [0] * (n - 4), "past the end"),  # natural advances, in pairs
        (lambda n: [0x00, 0x03, 0x01, 0x01] + [0] * (n - 4), "past the end"),  # a single entry before an escape
        (lambda n: [*range(1, n), n - 1], "cut off"),  # the last byte is an escape with no advance after it
    ],
)
def test_kernel_reports_a_corrupt_sparse_record(record, message):
    """A COO record that would place a value outside its row stops the kernel with the codec's error, whichever
    branch of the walk meets it (single entries, pairs, escapes); nothing outside the row's buffer is written."""
    from oakenkv.format.layout import CorruptDataError

    store, _, _, (kh, vh) = _store(1, 40, seed=7, chunk=40)
    view = store.layer_view(1)
    assert view.sparse_counts[0, KEY] == 1  # one sparse page: token t's record starts at the sum of those before
    lens = view.sparse_lengths[0, KEY, :40].astype(np.int64)
    token = int(np.flatnonzero((lens >= 4) & (lens < 60))[0])
    at = int(view.sparse_pages[0, KEY, 0]) * view.page_size + int(lens[:token].sum())
    n = int(lens[token])
    view.pool[at : at + n] = np.array(record(n), np.uint8)
    q = torch.randn(1, HQ, 1, HD, generator=torch.Generator().manual_seed(3))
    with pytest.raises(CorruptDataError, match=message):
        packed_decode_attention(q, kh, vh, None, HD**-0.5)


def test_rows_alone_are_split_over_threads(monkeypatch):
    """Eight rows of 1024 tokens on two threads run the parallel kernel, one row per work item (a rule that tied
    the parallel kernel to splitting each row ran them serially); one thread or a short step stays serial."""
    from oakenkv.kernels.cpu import attention as attention_cpu

    assert 4096 < attention_cpu.PARALLEL_MIN_TOKENS <= 8 * 1024  # (the points below sit on both sides of it)
    assert attention_cpu.split_work(8, 1024, 2) == (True, 1)
    assert attention_cpu.split_work(1, 16384, 2) == (True, 4)
    assert attention_cpu.split_work(8, 16384, 1) == (False, 1)
    assert attention_cpu.split_work(8, 128, 2) == (False, 1)
    assert attention_cpu.split_work(1, 4096, 2) == (False, 1)
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("numba has one thread here")
    called = []
    parallel = attention_cpu.packed_decode_attention
    monkeypatch.setattr(attention_cpu, "packed_decode_attention", lambda *a: called.append(a[4]) or parallel(*a))
    _, _, _, (kh, vh) = _store(8, 1024, seed=9)
    q = torch.randn(8, HQ, 1, HD, generator=torch.Generator().manual_seed(4))
    previous = numba.get_num_threads()
    numba.set_num_threads(2)
    try:
        got = packed_decode_attention(q, kh, vh, None, HD**-0.5)
    finally:
        numba.set_num_threads(previous)
    assert called == [1]  # the parallel kernel, one split per row
    torch.testing.assert_close(got, reference_packed_attention(q, kh, vh, None, HD**-0.5), rtol=2e-5, atol=2e-6)
