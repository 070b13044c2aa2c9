"""Page pool: invariants, round trips, copy on write, budget exhaustion (src/oakenkv/store/pages.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oakenkv.store.pages import PagePool, PoolConfig, PoolExhaustedError


def _records(rng: np.random.Generator, n: int, rec: int, max_sparse: int):
    """Random dense [n, rec] records and sparse records (some empty) in the codec's layout."""
    dense = rng.integers(0, 256, size=(n, rec), dtype=np.uint8)
    lengths = rng.integers(0, max_sparse + 1, size=n)
    lengths[rng.random(n) < 0.3] = 0
    offs = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offs[1:])
    sparse = rng.integers(0, 256, size=int(offs[-1]), dtype=np.uint8)
    return dense, sparse, offs


class _Mirror:
    """What every stream should read back: the records appended so far, kept in plain numpy."""

    def __init__(self) -> None:
        self.dense: dict[tuple[int, int], list[np.ndarray]] = {}
        self.sparse: dict[tuple[int, int], list[bytes]] = {}
        #: tokens below this were evicted (PagePool.evict_before)
        self.watermark: dict[tuple[int, int], int] = {}

    def add(self, seq, stream, dense, sparse, offs):
        self.dense.setdefault((seq, stream), []).append(dense.copy())
        rows = [sparse[offs[i] : offs[i + 1]].tobytes() for i in range(len(offs) - 1)]
        self.sparse.setdefault((seq, stream), []).extend(rows)

    def check(self, pool: PagePool) -> None:
        pool.check_invariants()
        for (seq, stream), chunks in self.dense.items():
            want = np.concatenate(chunks)
            wm = self.watermark.get((seq, stream), 0)
            np.testing.assert_array_equal(pool.read_dense(seq, stream, wm), want[wm:])
            sparse, offs = pool.read_sparse(seq, stream, wm)
            got = [sparse[offs[i] : offs[i + 1]].tobytes() for i in range(len(offs) - 1)]
            assert got == self.sparse[(seq, stream)][wm:]
            if 0 < wm < len(want):
                with pytest.raises(IndexError, match="evicted"):
                    pool.read_dense(seq, stream, wm - 1)
                with pytest.raises(IndexError, match="evicted"):
                    pool.read_sparse(seq, stream, wm - 1)

    def fork(self, src, dst, streams):
        for k in range(streams):
            if (src, k) in self.dense:
                self.dense[(dst, k)] = list(self.dense[(src, k)])
                self.sparse[(dst, k)] = list(self.sparse[(src, k)])
                self.watermark[(dst, k)] = self.watermark.get((src, k), 0)

    def drop(self, seq):
        for key in [k for k in self.dense if k[0] == seq]:
            del self.dense[key], self.sparse[key]
            self.watermark.pop(key, None)


def test_config_validation():
    with pytest.raises(ValueError, match="page_size"):
        PoolConfig(page_size=1000)
    with pytest.raises(ValueError, match="budget_bytes"):
        PoolConfig(page_size=4096, budget_bytes=100)
    assert PoolConfig(page_size=4096, budget_bytes=10 * 4096 + 5).max_pages == 10


def test_dense_layout_follows_the_table():
    """Token t lives at (dense_pages[t // rpp], (t % rpp) * rec); the last page holds 1..rpp records."""
    pool = PagePool(PoolConfig(page_size=256, budget_bytes=256 * 64))
    seq = pool.new_sequence(2)
    rng = np.random.default_rng(0)
    dense, sparse, offs = _records(rng, 23, 50, 20)  # rpp = 5, 6 unused bytes per page
    pool.append(seq, 0, dense[:7], sparse[: offs[7]], offs[:8])
    pool.append(seq, 0, dense[7:], sparse[offs[7] :], offs[7:] - offs[7])
    t = pool.table(seq, 0)
    assert t.num_tokens == 23 and t.dense_pages.n == 5  # ceil(23 / 5)
    runs = pool.dense_runs(seq, 0)
    assert [r[2] for r in runs] == [5, 5, 5, 5, 3]
    flat = pool.data.reshape(-1)
    for tok in (0, 4, 5, 22):
        page = t.dense_pages.view[tok // 5]
        start = page * 256 + (tok % 5) * 50
        np.testing.assert_array_equal(flat[start : start + 50], dense[tok])
    # Sparse runs cover every token once, each within one page.
    sruns = pool.sparse_runs(seq, 0)
    assert sum(r[3] for r in sruns) == offs[-1]
    assert all(r[3] <= 256 for r in sruns)
    pool.check_invariants()
    s = pool.stats()
    assert s.pages_in_use == 5 + len(sruns)
    assert s.bytes_used == 23 * 50 + offs[-1]
    assert 0 < s.fragmentation < 1
    assert s.table_bytes == 5 * 4 + len(sruns) * 8 + 23 * 2


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), page_size=st.sampled_from([256, 512, 4096]))
def test_random_operations_keep_invariants_and_data(seed, page_size):
    """Appends, evictions, forks (copy on write), frees and exhaustion in random order never lose or mix up a
    byte that is still meant to be there."""
    rng = np.random.default_rng(seed)
    pool = PagePool(PoolConfig(page_size=page_size, budget_bytes=page_size * 40, initial_pages=2))
    mirror = _Mirror()
    streams = 3
    rec = int(rng.integers(1, min(page_size, 200)))
    live = [pool.new_sequence(streams)]
    for _ in range(30):
        op = rng.random()
        if op < 0.15:  # one token into every stream of a sequence: the decode step's fast path
            seq = live[int(rng.integers(len(live)))]
            dense, sparse, offs = _records(rng, streams, rec, min(page_size, 90))
            lengths = np.diff(offs)
            padded = np.zeros((streams, max(1, int(lengths.max()))), np.uint8)
            for k in range(streams):
                padded[k, : lengths[k]] = sparse[offs[k] : offs[k + 1]]
            before = pool.stats()
            try:
                pool.append_token([(seq, k) for k in range(streams)], dense, padded, lengths)
                for k in range(streams):
                    mirror.add(seq, k, dense[k : k + 1], sparse, offs[k : k + 2])
            except PoolExhaustedError:
                assert pool.stats() == before  # nothing changed
        elif op < 0.25:  # a sliding window moves on: release what lies below a random token
            seq = live[int(rng.integers(len(live)))]
            k = int(rng.integers(streams))
            n = pool.num_tokens(seq, k)
            token = int(rng.integers(0, n + 1))
            before = pool.stats().pages_in_use
            released = pool.evict_before(seq, k, token)
            assert pool.stats().pages_in_use <= before and (released > 0 or pool.stats().pages_in_use == before)
            if n:
                mirror.watermark[(seq, k)] = max(mirror.watermark.get((seq, k), 0), token)
        elif op < 0.6:
            seq = live[int(rng.integers(len(live)))]
            k = int(rng.integers(streams))
            n = int(rng.integers(1, 12))
            dense, sparse, offs = _records(rng, n, rec, min(page_size, 90))
            before = pool.stats()
            try:
                pool.append(seq, k, dense, sparse, offs)
                mirror.add(seq, k, dense, sparse, offs)
            except PoolExhaustedError:
                assert pool.stats() == before  # nothing changed
        elif op < 0.8:
            src = live[int(rng.integers(len(live)))]
            dst = pool.fork(src)
            mirror.fork(src, dst, streams)
            live.append(dst)
        elif len(live) > 1:
            seq = live.pop(int(rng.integers(len(live))))
            pool.free(seq)
            mirror.drop(seq)
        mirror.check(pool)


def test_fork_shares_pages_and_copies_on_write():
    pool = PagePool(PoolConfig(page_size=256, budget_bytes=256 * 32))
    rng = np.random.default_rng(1)
    a = pool.new_sequence(1)
    dense, sparse, offs = _records(rng, 7, 50, 10)
    pool.append(a, 0, dense, sparse, offs)
    used = pool.stats().pages_in_use
    b = pool.fork(a)
    assert pool.stats().pages_in_use == used  # shared, not copied
    # Appending to b copies only the partly filled tail pages; a keeps reading its own bytes.
    d2, s2, o2 = _records(rng, 1, 50, 10)
    pool.append(b, 0, d2, s2, o2)
    np.testing.assert_array_equal(pool.read_dense(a, 0), dense)
    np.testing.assert_array_equal(pool.read_dense(b, 0), np.concatenate([dense, d2]))
    assert pool.table(a, 0).dense_pages.view[0] == pool.table(b, 0).dense_pages.view[0]  # full page still shared
    assert pool.table(a, 0).dense_pages.view[1] != pool.table(b, 0).dense_pages.view[1]  # tail copied
    pool.check_invariants()
    pool.free(a)
    pool.free(b)
    assert pool.stats().pages_in_use == 0
    pool.check_invariants()


def test_evict_before_releases_whole_pages_below_the_watermark():
    pool = PagePool(PoolConfig(page_size=256, budget_bytes=256 * 64))
    rng = np.random.default_rng(3)
    a = pool.new_sequence(1)
    dense, sparse, offs = _records(rng, 40, 50, 30)  # 5 records per dense page: 8 dense pages
    pool.append(a, 0, dense, sparse, offs)
    b = pool.fork(a)  # shares every page
    used = pool.stats().pages_in_use
    assert pool.evict_before(a, 0, 12) >= 2  # dense pages 0 and 1 (tokens 0..9) go from a's table
    assert pool.stats().pages_in_use == used  # ... but b still holds them
    t = pool.table(a, 0)
    assert t.dense_pages.view[:2].tolist() == [-1, -1] and t.dense_pages.view[2] >= 0 and t.evicted_before == 12
    released_b = pool.evict_before(b, 0, 12)
    assert pool.stats().pages_in_use == used - released_b  # now they are free
    pool.check_invariants()
    np.testing.assert_array_equal(pool.read_dense(a, 0, 12), dense[12:])
    got, o = pool.read_sparse(a, 0, 12)
    assert got.tobytes() == sparse[offs[12] :].tobytes() and o.tolist() == (offs[12:] - offs[12]).tolist()
    assert pool.evict_before(a, 0, 5) == 0 and pool.table(a, 0).evicted_before == 12  # never moves back
    pool.evict_before(a, 0, 10_000)  # past the end: everything but the pages appends still write
    t = pool.table(a, 0)
    assert t.dense_pages.view[-1] >= 0 and (t.sparse_pages.n == 0 or t.sparse_pages.view[-1] >= 0)
    d2, s2, o2 = _records(rng, 7, 50, 30)
    pool.append(a, 0, d2, s2, o2)  # appends go on after eviction
    pool.check_invariants()
    np.testing.assert_array_equal(pool.read_dense(a, 0, 40), d2)
    pool.free(a)
    pool.free(b)
    assert pool.stats().pages_in_use == 0
    pool.check_invariants()


def test_free_reuses_pages():
    pool = PagePool(PoolConfig(page_size=256, budget_bytes=256 * 8, initial_pages=8))
    rng = np.random.default_rng(2)
    for _ in range(5):  # each round fills most of the budget; without reuse the third would fail
        seq = pool.new_sequence(1)
        dense, sparse, offs = _records(rng, 25, 50, 0)  # 5 pages, no sparse bytes
        pool.append(seq, 0, dense, sparse, offs)
        assert pool.stats().pages_in_use == 5
        pool.free(seq)
        assert pool.stats().pages_in_use == 0
    assert pool.stats().pages_allocated == 8
    pool.check_invariants()


def test_budget_exhaustion_is_clear_and_leaves_everything_intact():
    pool = PagePool(PoolConfig(page_size=256, budget_bytes=256 * 6))
    rng = np.random.default_rng(3)
    mirror = _Mirror()
    a, b = pool.new_sequence(2), pool.new_sequence(2)
    for seq in (a, b):
        dense, sparse, offs = _records(rng, 10, 100, 0)  # 2 records per page: 5 pages... too many for both
        if seq == a:
            pool.append(seq, 0, dense[:4], sparse, offs[:5])
            mirror.add(seq, 0, dense[:4], sparse, offs[:5])
    # Ask: the plan says no, and says nothing changed.
    assert pool.plan_append(b, 0, 100, np.zeros(10, dtype=np.int64)) is None
    plan = pool.plan_append(b, 0, 100, np.zeros(4, dtype=np.int64))
    assert plan is not None and plan.pages_needed == 2
    before = pool.stats()
    dense, sparse, offs = _records(rng, 10, 100, 0)
    with pytest.raises(PoolExhaustedError, match="needs 5 pages, 4 are free"):
        pool.append(b, 0, dense, sparse, offs)
    # All-or-nothing across streams: the first item would fit, the pair does not.
    items = [(b, 0, dense[:4], sparse, offs[:5]), (b, 1, dense[:6], sparse, offs[:7])]
    with pytest.raises(PoolExhaustedError, match="no sequence was changed"):
        pool.append_many(items)
    assert pool.stats() == before
    assert pool.num_tokens(b, 0) == 0 and pool.num_tokens(b, 1) == 0
    mirror.check(pool)
    # Freeing a sequence makes room again.
    pool.free(a)
    pool.append_many(items)
    pool.check_invariants()


def test_bad_input_is_rejected():
    pool = PagePool(PoolConfig(page_size=256, budget_bytes=256 * 8))
    seq = pool.new_sequence(1)
    ok = np.zeros((2, 10), dtype=np.uint8)
    offs = np.zeros(3, dtype=np.int64)
    with pytest.raises(ValueError, match="uint8"):
        pool.append(seq, 0, ok.astype(np.int32), np.zeros(0, np.uint8), offs)
    with pytest.raises(ValueError, match=r"\[n \+ 1\]"):
        pool.append(seq, 0, ok, np.zeros(0, np.uint8), offs[:2])
    with pytest.raises(ValueError, match="lengths"):
        pool.append(seq, 0, ok, np.zeros(600, np.uint8), np.array([0, 300, 600]))
    with pytest.raises(KeyError, match="no live sequence"):
        pool.append(seq + 7, 0, ok, np.zeros(0, np.uint8), offs)
    with pytest.raises(IndexError, match="stream"):
        pool.append(seq, 3, ok, np.zeros(0, np.uint8), offs)
    pool.append(seq, 0, ok, np.zeros(0, np.uint8), offs)
    with pytest.raises(ValueError, match="10-byte records"):
        pool.append(seq, 0, np.zeros((1, 12), np.uint8), np.zeros(0, np.uint8), offs[:2])
    pool.check_invariants()
