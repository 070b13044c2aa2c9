"""The page pool: Oaken's software MMU for the packed KV cache (paper Section 5.3, Figure 10).

Why one module (over 600 lines): the invariants below span the allocator, the stream tables and the record
writers, and every operation keeps all of them at once (ask-then-commit); split, each part would reach into the
others' private state, and :meth:`PagePool.check_invariants` checks them in one place.

The pool stores opaque per-token byte records and knows nothing of quantization. Every (sequence, stream)
pair owns two chains of fixed-size pages: a *stream* is one layer's keys or one layer's values of one
sequence (the cache uses ``stream = 2 * layer + kind``).

* **Dense records** have the same size ``rec`` for every token of a stream (the codec's nibbles plus the six
  per-token scales). They are written back to back, never straddle a page, so a page holds ``rpp = page_size
  // rec`` of them and token ``t`` lives at ``(dense_pages[t // rpp], (t % rpp) * rec)``. The dense table is
  therefore one page id per page, like a vLLM block table; the unused ``page_size - rpp * rec`` bytes at the
  end of each dense page are reported as fragmentation.
* **Sparse records** (the COO entries of one token) have variable length ``0 <= L <= page_size``. They are
  written back to back into the stream's sparse pages; a record that does not fit into the rest of the
  current page starts a new page. The sparse table holds, per token, its byte length (the paper's 16-bit
  per-token header, ``uint16``), and per sparse page its id and the first token stored in it; a token's
  offset is the sum of the lengths before it in its page. Readers walk a stream in token order, so offsets
  never need to be stored.

A sequence's data for one layer is thus a few contiguous runs: one per dense page (``rpp`` tokens each) and
one per sparse page, which is what the decode-attention kernel reads.

Invariants (checked by :meth:`PagePool.check_invariants`, exercised in ``tests/test_pages.py``)
-----------------------------------------------------------------------------------------------
I1. A page id is either free (reference count 0, on the free list exactly once) or in use (reference count
    equal to the number of table slots, over all live streams, that name it). Pages in use never exceed
    ``max_pages``.
I2. Dense: a stream with ``n`` tokens and record size ``rec`` has exactly ``ceil(n / rpp)`` dense pages; the
    last one holds ``n - (pages - 1) * rpp`` records (``last_page_len``, in ``1..rpp``), every other one
    ``rpp``.
I3. Sparse: page first-tokens are strictly increasing and each names a token with ``L > 0``; the records of
    page ``p`` are the tokens with ``L > 0`` in ``[first[p], first[p + 1])``; their lengths sum to at most
    ``page_size``; the stream's ``sparse_tail`` is the sum for its last page. A stream whose records are all
    empty has no sparse page.
I4. ``page_fill[p]`` (bytes written into page ``p``) equals what I2/I3 say every owner of ``p`` stores
    there; a page shared by several streams (after :meth:`PagePool.fork`) is never written: the first append
    into it copies it (copy on write), so every owner keeps seeing the bytes it wrote.
I5. A failed operation (budget exhausted, bad input) changes nothing: allocation is ask-then-commit
    (:meth:`PagePool.plan_append` returns ``None`` when the pages are not there;
    :meth:`PagePool.append_many` plans every item before writing any).
I6. Eviction (:meth:`PagePool.evict_before`, for sliding-window layers) releases only pages all of whose tokens
    lie below the stream's ``evicted_before`` watermark and replaces their table slots by ``EVICTED`` (-1): the
    tables keep their length and their indexing by absolute token number, evicted slots form a prefix of each
    page list, and the last dense and sparse pages (the ones appends write) are never evicted. Readers refuse
    tokens below the watermark; I1-I4 hold for the remaining slots.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from numba import njit

from oakenkv.format.layout import EVICTED
from oakenkv.store.records import copy_token_records, put_record

#: Largest sparse record (bytes): the per-token length is stored as uint16.
MAX_SPARSE_RECORD = 65535


class PoolExhaustedError(MemoryError):
    """The page pool's memory budget cannot hold an append; nothing was written."""


@dataclass(frozen=True)
class PoolConfig:
    """Size and budget of a :class:`PagePool`."""

    #: Bytes per page, dense and sparse alike (paper: 4 KiB). Must be a multiple of 64 in ``[256, 1 MiB]``.
    page_size: int = 4096
    #: Most bytes the pool may hold in pages; ``budget_bytes // page_size`` pages in all.
    budget_bytes: int = 1 << 30
    #: Pages allocated up front; storage then doubles on demand up to the budget (never preallocated whole).
    initial_pages: int = 64

    def __post_init__(self) -> None:
        if not isinstance(self.page_size, int) or not 256 <= self.page_size <= (1 << 20) or self.page_size % 64:
            raise ValueError(f"page_size must be a multiple of 64 in [256, 1048576], got {self.page_size!r}")
        if not isinstance(self.budget_bytes, int) or self.budget_bytes < self.page_size:
            raise ValueError(
                f"budget_bytes must be an int of at least one page ({self.page_size}), got {self.budget_bytes!r}"
            )
        if not isinstance(self.initial_pages, int) or self.initial_pages < 1:
            raise ValueError(f"initial_pages must be a positive int, got {self.initial_pages!r}")

    @property
    def max_pages(self) -> int:
        """Pages the budget allows."""
        return self.budget_bytes // self.page_size


class _Growable:
    """A 1-D numpy array with amortised O(1) append; ``.view`` is the live part."""

    __slots__ = ("buf", "n")

    def __init__(self, dtype: type, capacity: int = 16) -> None:
        self.buf = np.zeros(capacity, dtype=dtype)
        self.n = 0

    @property
    def view(self) -> np.ndarray:
        return self.buf[: self.n]

    def _reserve(self, need: int) -> None:
        if need > self.buf.size:
            new = np.zeros(max(need, 2 * self.buf.size), dtype=self.buf.dtype)
            new[: self.n] = self.buf[: self.n]
            self.buf = new

    def extend(self, values: np.ndarray | list[int]) -> None:
        values = np.asarray(values, dtype=self.buf.dtype)
        need = self.n + values.size
        self._reserve(need)
        self.buf[self.n : need] = values
        self.n = need

    def push(self, value: int) -> None:
        """Append one value (the decode step's path: no array conversion)."""
        self._reserve(self.n + 1)
        self.buf[self.n] = value
        self.n += 1

    def copy(self) -> _Growable:
        g = _Growable(self.buf.dtype.type, max(16, self.n))
        g.extend(self.view)
        return g

    def nbytes_used(self) -> int:
        return self.n * self.buf.itemsize


@dataclass
class StreamTable:
    """The management tables of one stream (one layer's K or V of one sequence); see the module docstring."""

    #: Tokens stored.
    num_tokens: int = 0
    #: Bytes per dense record; 0 until the first append fixes it.
    rec_size: int = 0
    #: int32 ``[ceil(num_tokens / rpp)]``: page id of each dense page, in token order.
    dense_pages: _Growable = field(default_factory=lambda: _Growable(np.int32))
    #: int32 ``[num_sparse_pages]``: page id of each sparse page, in token order.
    sparse_pages: _Growable = field(default_factory=lambda: _Growable(np.int32))
    #: int32 ``[num_sparse_pages]``: first token whose sparse record lives in that page.
    sparse_first: _Growable = field(default_factory=lambda: _Growable(np.int32))
    #: uint16 ``[num_tokens]``: sparse record length of each token (the per-token header).
    sparse_len: _Growable = field(default_factory=lambda: _Growable(np.uint16))
    #: Bytes used in the last sparse page.
    sparse_tail: int = 0
    #: Tokens below this one may have lost their pages (:meth:`PagePool.evict_before`); 0: nothing evicted.
    evicted_before: int = 0

    def copy(self) -> StreamTable:
        return StreamTable(
            self.num_tokens,
            self.rec_size,
            self.dense_pages.copy(),
            self.sparse_pages.copy(),
            self.sparse_first.copy(),
            self.sparse_len.copy(),
            self.sparse_tail,
            self.evicted_before,
        )

    def table_bytes(self) -> int:
        """Bytes of management table this stream stores (page ids, first tokens, per-token lengths)."""
        return (
            self.dense_pages.nbytes_used()
            + self.sparse_pages.nbytes_used()
            + self.sparse_first.nbytes_used()
            + self.sparse_len.nbytes_used()
        )


@dataclass(frozen=True)
class AppendPlan:
    """What one append needs, computed without touching the pool (ask); :meth:`PagePool.commit` does it."""

    seq: int
    stream: int
    #: Tokens to append.
    num_tokens: int
    #: Dense record size of the tokens.
    rec_size: int
    #: uint16 ``[num_tokens]``: sparse record lengths.
    sparse_lengths: np.ndarray
    #: New pages the append takes from the pool, copies on write included (an upper bound when streams share).
    pages_needed: int


@dataclass(frozen=True)
class PoolStats:
    """Memory accounting of a pool; every byte count is exact."""

    page_size: int
    #: Pages the budget allows.
    max_pages: int
    #: Pages held by at least one stream.
    pages_in_use: int
    #: Pages whose storage exists (in use + free-but-allocated).
    pages_allocated: int
    #: ``pages_in_use * page_size``: the memory the cache reserves.
    bytes_reserved: int
    #: Record bytes actually written into the pages in use (shared pages counted once).
    bytes_used: int
    #: Bytes of management tables (dense and sparse).
    table_bytes: int
    #: Live sequences.
    num_sequences: int
    #: Bytes kept beside the pages: an oaken-plus profile's sink tokens at 16 bits (``oakenkv.store.paged``).
    sink_bytes: int = 0
    #: Bytes kept beside the pages: the full-precision window's tokens (``oakenkv.store.paged``, ``residual``).
    window_bytes: int = 0

    @property
    def fragmentation(self) -> float:
        """Fraction of the reserved page bytes holding no record (page tails and partly filled last pages)."""
        return 0.0 if self.bytes_reserved == 0 else 1.0 - self.bytes_used / self.bytes_reserved

    @property
    def total_bytes(self) -> int:
        """What the cache costs in memory: reserved pages plus tables (plus sink tokens and the full-precision
        window, where a store keeps them)."""
        return self.bytes_reserved + self.table_bytes + self.sink_bytes + self.window_bytes


class TokenTargets:
    """The streams a decode step appends one record to, resolved to their tables once
    (:meth:`PagePool.token_targets`) instead of at every step; :meth:`PagePool.append_token` resolves them again
    if a sequence was freed since."""

    __slots__ = ("generation", "pairs", "tables")

    def __init__(self, pairs: list[tuple[int, int]], tables: list[StreamTable], generation: int) -> None:
        #: ``[(seq, stream), ...]``: distinct pairs.
        self.pairs = pairs
        #: Their live tables, in the same order.
        self.tables = tables
        #: The pool's count of freed sequences when the tables were looked up.
        self.generation = generation

    def __len__(self) -> int:
        return len(self.pairs)


class PagePool:
    """A budgeted pool of byte pages holding many sequences' dense and sparse records (module docstring).

    Not thread-safe: one owner (a cache) drives it.
    """

    def __init__(self, config: PoolConfig | None = None) -> None:
        self.config = config or PoolConfig()
        ps = self.config.page_size
        n0 = min(self.config.initial_pages, self.config.max_pages)
        #: uint8 ``[pages_allocated, page_size]``: the page storage. Re-allocated (doubled) on growth, so
        #: readers must fetch it again after any append.
        self.data = np.zeros((n0, ps), dtype=np.uint8)
        #: int32 ``[pages_allocated]``: owners of each page (0 = free).
        self.refcount = np.zeros(n0, dtype=np.int32)
        #: int32 ``[pages_allocated]``: bytes written into each page.
        self.page_fill = np.zeros(n0, dtype=np.int32)
        # Free pages; popped from the end, so low ids are reused first (keeps storage compact).
        self._free: list[int] = list(range(n0 - 1, -1, -1))
        self._seqs: dict[int, list[StreamTable]] = {}
        self._next_seq = 0
        self._pages_in_use = 0
        #: False while no page can be shared (no fork since the last check found none): append_token then skips
        #: the reference counts' copy-on-write checks.
        self._maybe_shared = False
        #: Sequences freed so far: a TokenTargets resolved before a free is looked up again.
        self._generation = 0

    # ---------------------------------------------------------------- sequences

    def new_sequence(self, num_streams: int) -> int:
        """Register an empty sequence with ``num_streams`` streams; returns its id (never reused)."""
        if not isinstance(num_streams, int) or num_streams < 1:
            raise ValueError(f"num_streams must be a positive int, got {num_streams!r}")
        sid = self._next_seq
        self._next_seq += 1
        self._seqs[sid] = [StreamTable() for _ in range(num_streams)]
        return sid

    def fork(self, seq: int) -> int:
        """A new sequence sharing every page of ``seq`` (reference counts, copy on write); for beam search."""
        streams = self._streams(seq)
        sid = self._next_seq
        self._next_seq += 1
        copies = [s.copy() for s in streams]
        for s in copies:
            for pages in (s.dense_pages.view, s.sparse_pages.view):
                np.add.at(self.refcount, pages[pages != EVICTED], 1)
        self._seqs[sid] = copies
        self._maybe_shared = True
        return sid

    def free(self, seq: int) -> None:
        """Release a sequence; pages no other sequence holds go back to the free list."""
        for s in self._streams(seq):
            for pages in (s.dense_pages.view, s.sparse_pages.view):
                for p in pages.tolist():
                    if p != EVICTED:
                        self._decref(p)
        del self._seqs[seq]
        self._generation += 1

    def reorder(self, seqs: list[int], index: list[int]) -> list[int]:
        """The sequences of rows reordered as ``new row i = old row index[i]`` (beam search, batch selection), for
        rows held as ``seqs``: a row taken again is forked (pages shared, copy on write), a row not taken is freed;
        no KV bytes are copied. IndexError (before any change) for an index out of range."""
        if any(not 0 <= j < len(seqs) for j in index):
            raise IndexError(f"reorder index {index} out of range for {len(seqs)} rows")
        used: set[int] = set()
        new = []
        for j in index:
            if j in used:
                new.append(self.fork(seqs[j]))
            else:
                used.add(j)
                new.append(seqs[j])
        for j, seq in enumerate(seqs):
            if j not in used:
                self.free(seq)
        return new

    def sequences(self) -> list[int]:
        return list(self._seqs)

    def num_streams(self, seq: int) -> int:
        return len(self._streams(seq))

    def table(self, seq: int, stream: int) -> StreamTable:
        """The live tables of one stream (read only: do not modify)."""
        streams = self._streams(seq)
        if not 0 <= stream < len(streams):
            raise IndexError(f"stream {stream} out of range for sequence {seq} ({len(streams)} streams)")
        return streams[stream]

    def num_tokens(self, seq: int, stream: int) -> int:
        return self.table(seq, stream).num_tokens

    def evict_before(self, seq: int, stream: int, token: int) -> int:
        """Release the pages of one stream that hold only tokens below ``token`` (a sliding window's past).

        Tokens below ``token`` can no longer be read (readers raise ``IndexError``; the attention kernel reports
        an error if a mask lets it reach one); the others are untouched. Whole pages only: a page that also
        holds a token at or above ``token`` stays. Shared pages (after :meth:`fork`) are only dereferenced.
        Returns the number of table slots released.
        """
        t = self.table(seq, stream)
        token = min(int(token), t.num_tokens)
        if token <= t.evicted_before:
            return 0
        t.evicted_before = token
        # Dense page k holds tokens [k rpp, (k + 1) rpp), sparse page i tokens [first[i], first[i + 1]); the last
        # page of each list is never released. Evicted slots are a prefix (I6), so only the slots between that
        # prefix and the new bound change: a decode step does not walk the whole history of a long context.
        dense_end = min(token // (self.config.page_size // t.rec_size), t.dense_pages.n - 1)
        sparse_end = int(np.searchsorted(t.sparse_first.view[1:], token, side="right"))
        released = 0
        for view, end in ((t.dense_pages.view, dense_end), (t.sparse_pages.view, sparse_end)):
            for k in range(int(np.count_nonzero(view[:end] == EVICTED)), end):
                self._decref(int(view[k]))
                view[k] = EVICTED
                released += 1
        return released

    # ---------------------------------------------------------------- ask then commit

    @property
    def free_pages(self) -> int:
        """Pages that can still be handed out (free list plus storage the budget still allows)."""
        return self.config.max_pages - self._pages_in_use

    def plan_append(self, seq: int, stream: int, rec_size: int, sparse_lengths: np.ndarray) -> AppendPlan | None:
        """Ask: the pages appending ``len(sparse_lengths)`` tokens takes, or ``None`` if the budget lacks them.

        Args:
            rec_size: bytes of each dense record (fixed per stream by its first append).
            sparse_lengths: ``[n]`` integer sparse record lengths, each in ``[0, page_size]``.
        """
        plan = self._plan(seq, stream, rec_size, sparse_lengths)
        return plan if plan.pages_needed <= self.free_pages else None

    def commit(self, plan: AppendPlan, dense: np.ndarray, sparse: np.ndarray, sparse_offsets: np.ndarray) -> None:
        """Commit: write the records of a plan made by :meth:`plan_append` on the current pool state.

        Args:
            dense: uint8 ``[n, rec_size]``: dense record of each token.
            sparse: uint8 ``[S]``: all tokens' sparse records, concatenated.
            sparse_offsets: int ``[n + 1]``: token ``i``'s sparse record is ``sparse[off[i]:off[i + 1]]``; its
                differences must equal the plan's lengths.
        """
        self._check_records(plan, dense, sparse, sparse_offsets)
        if plan.pages_needed > self.free_pages:
            raise PoolExhaustedError(
                f"page pool exhausted: the append needs {plan.pages_needed} pages, "
                f"{self.free_pages} are free "
                f"({self.config.max_pages} pages of {self.config.page_size} B in the budget)"
            )
        self._write(plan, dense, sparse, sparse_offsets)

    def append(self, seq: int, stream: int, dense: np.ndarray, sparse: np.ndarray, sparse_offsets: np.ndarray) -> None:
        """Append ``n`` tokens' records to one stream (plan + commit); raises :class:`PoolExhaustedError`."""
        self.append_many([(seq, stream, dense, sparse, sparse_offsets)])

    def append_many(self, items: list[tuple[int, int, np.ndarray, np.ndarray, np.ndarray]]) -> None:
        """Append to several distinct streams atomically: all of them, or (budget exhausted) none.

        Each item is ``(seq, stream, dense uint8 [n, rec], sparse uint8 [S], sparse_offsets int [n + 1])``.
        """
        plans = []
        seen = set()
        for seq, stream, dense, sparse, offs in items:
            if (seq, stream) in seen:
                raise ValueError(f"append_many got stream {stream} of sequence {seq} twice")
            seen.add((seq, stream))
            dense = np.asarray(dense)
            offs = np.asarray(offs)
            if dense.ndim != 2:
                raise ValueError(f"dense records must be uint8 [n, rec], got shape {tuple(dense.shape)}")
            if offs.ndim != 1 or offs.shape[0] != dense.shape[0] + 1:
                raise ValueError(
                    f"sparse_offsets must be [n + 1] = [{dense.shape[0] + 1}], got shape {tuple(offs.shape)}"
                )
            plan = self._plan(seq, stream, dense.shape[1], np.diff(offs))
            self._check_records(plan, dense, sparse, offs, lengths=False)
            plans.append(plan)
        need = sum(p.pages_needed for p in plans)
        if need > self.free_pages:
            raise PoolExhaustedError(
                f"page pool exhausted: appending to {len(plans)} stream(s) needs {need} pages, "
                f"{self.free_pages} are free ({self.config.max_pages} pages of {self.config.page_size} B = "
                f"{self.config.budget_bytes} B budget); no sequence was changed"
            )
        for plan, (_, _, dense, sparse, offs) in zip(plans, items, strict=True):
            self._write(plan, np.asarray(dense), np.asarray(sparse), np.asarray(offs))

    def token_targets(self, pairs: list[tuple[int, int]]) -> TokenTargets:
        """``pairs`` (distinct ``(seq, stream)``) resolved to their tables, for many :meth:`append_token` calls."""
        pairs = list(pairs)
        if len(set(pairs)) != len(pairs):
            raise ValueError("append_token got the same stream twice")
        return TokenTargets(pairs, [self.table(seq, stream) for seq, stream in pairs], self._generation)

    def append_token(
        self,
        targets: list[tuple[int, int]] | TokenTargets,
        dense: np.ndarray,
        sparse: np.ndarray,
        lengths: np.ndarray,
    ) -> list[int]:
        """Append one token's records to each of several distinct streams, atomically (the decode step).

        The same result as :meth:`append_many` with one-token items, without its per-item array work: a decode
        step appends ``2 * layers * batch`` single records, and the general path's planning costs more than
        the encoding itself. The tables are updated with scalar bookkeeping, then one numba call copies the
        records into the pages.

        Args:
            targets: ``[(seq, stream), ...]``, ``m`` distinct pairs, or the same resolved once by
                :meth:`token_targets` (what a cache does: no table look-ups per step).
            dense: uint8 ``[m, rec]``: the dense record for each target.
            sparse: uint8 ``[m, >= max(lengths)]``: row ``k`` starts with target ``k``'s sparse record.
            lengths: int ``[m]``: sparse record lengths.

        Returns:
            The indices of the targets whose page lists changed (a page added, or their last page copied on
            write), for readers that keep a copy of the tables (``oakenkv.store.paged``); usually empty.
        """
        ps = self.config.page_size
        m, rec = dense.shape
        if dense.dtype != np.uint8 or sparse.dtype != np.uint8 or len(targets) != m or lengths.shape != (m,):
            raise ValueError("append_token needs uint8 dense [m, rec], uint8 sparse [m, S] and lengths [m]")
        if not 1 <= rec <= ps:
            raise ValueError(f"dense record size must be in [1, page_size={ps}], got {rec}")
        lens = lengths.tolist()
        limit = min(ps, MAX_SPARSE_RECORD, sparse.shape[1])
        if not isinstance(targets, TokenTargets):
            targets = self.token_targets(targets)
        elif targets.generation != self._generation:  # a sequence was freed: look the tables up again
            fresh = self.token_targets(targets.pairs)
            targets.tables, targets.generation = fresh.tables, fresh.generation
        tables = targets.tables
        rpp = ps // rec
        # Copy on write needs a look at reference counts only while some page is shared (after a fork).
        shared = self._maybe_shared and bool((self.refcount > 1).any())
        self._maybe_shared = shared
        refcount = self.refcount
        need = 0
        for t, length in zip(tables, lens, strict=True):  # ask
            if t.num_tokens and t.rec_size != rec:
                raise ValueError(f"a stream holds {t.rec_size}-byte records, got {rec}")
            if not 0 <= length <= limit:
                raise ValueError(f"sparse record lengths must be in [0, {limit}] bytes, got {length}")
            if t.num_tokens % rpp == 0 or (shared and refcount[t.dense_pages.buf[t.dense_pages.n - 1]] > 1):
                need += 1
            if length and (
                not t.sparse_pages.n
                or length > ps - t.sparse_tail
                or (shared and refcount[t.sparse_pages.buf[t.sparse_pages.n - 1]] > 1)
            ):
                need += 1
        if need > self.free_pages:
            raise PoolExhaustedError(
                f"page pool exhausted: appending a token to {m} stream(s) needs {need} pages, {self.free_pages} "
                f"are free ({self.config.max_pages} pages of {ps} B = {self.config.budget_bytes} B budget); "
                "no sequence was changed"
            )
        # commit: the tables first, collecting where each record goes (flat byte offsets into the storage)
        dense_at = np.empty(m, np.int64)
        sparse_at = np.empty(m, np.int64)
        changed = []
        for k, (t, length) in enumerate(zip(tables, lens, strict=True)):
            t.rec_size = rec
            slot = t.num_tokens % rpp
            dp = t.dense_pages
            if slot == 0:
                dp.push(self._alloc())
                changed.append(k)
            elif shared and self.refcount[dp.buf[dp.n - 1]] > 1:
                dp.buf[dp.n - 1] = self._cow(int(dp.buf[dp.n - 1]))
                changed.append(k)
            pg = int(dp.buf[dp.n - 1])
            dense_at[k] = pg * ps + slot * rec
            self.page_fill[pg] = (slot + 1) * rec
            if length:
                sp = t.sparse_pages
                if not sp.n or length > ps - t.sparse_tail:
                    pg = self._alloc()
                    sp.push(pg)
                    t.sparse_first.push(t.num_tokens)
                    at = 0
                    if not changed or changed[-1] != k:
                        changed.append(k)
                else:
                    pg = int(sp.buf[sp.n - 1])
                    if shared and self.refcount[pg] > 1:
                        pg = self._cow(pg)
                        sp.buf[sp.n - 1] = pg
                        if not changed or changed[-1] != k:
                            changed.append(k)
                    at = t.sparse_tail
                sparse_at[k] = pg * ps + at
                t.sparse_tail = at + length
                self.page_fill[pg] = t.sparse_tail
            else:
                sparse_at[k] = -1
            t.sparse_len.push(length)
            t.num_tokens += 1
        # self.data is read after every _alloc: growing the pool replaces the array
        copy_token_records(self.data.reshape(-1), dense, dense_at, sparse, lengths, sparse_at)
        return changed

    # ---------------------------------------------------------------- reading (reference paths)

    def records_per_page(self, rec_size: int) -> int:
        """Dense records one page holds."""
        return self.config.page_size // rec_size

    def dense_runs(self, seq: int, stream: int) -> list[tuple[int, int, int]]:
        """The contiguous dense runs of a stream: ``(page, byte offset, tokens)`` in token order."""
        t = self.table(seq, stream)
        if t.num_tokens == 0:
            return []
        rpp = self.records_per_page(t.rec_size)
        pages = t.dense_pages.view.tolist()
        runs = [(p, 0, rpp) for p in pages]
        last = t.num_tokens - (len(pages) - 1) * rpp
        runs[-1] = (pages[-1], 0, last)
        return [r for r in runs if r[0] != EVICTED]

    def sparse_runs(self, seq: int, stream: int) -> list[tuple[int, int, int, int]]:
        """The contiguous sparse runs: ``(page, first token, end token, bytes)`` in token order."""
        t = self.table(seq, stream)
        pages = t.sparse_pages.view.tolist()
        first = [*t.sparse_first.view.tolist(), t.num_tokens]
        lens = t.sparse_len.view
        return [
            (p, first[i], first[i + 1], int(lens[first[i] : first[i + 1]].sum()))
            for i, p in enumerate(pages)
            if p != EVICTED
        ]

    def read_dense(self, seq: int, stream: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        """uint8 ``[stop - start, rec_size]``: copies of the dense records of tokens ``[start, stop)``."""
        t = self.table(seq, stream)
        stop = t.num_tokens if stop is None else stop
        if not 0 <= start <= stop <= t.num_tokens:
            raise IndexError(f"token range [{start}, {stop}) out of [0, {t.num_tokens}]")
        if start < t.evicted_before and stop > start:
            raise IndexError(f"tokens below {t.evicted_before} were evicted (sliding window); asked from {start}")
        if stop == start:
            return np.zeros((0, t.rec_size), dtype=np.uint8)
        rpp = self.records_per_page(t.rec_size)
        tok = np.arange(start, stop)
        pages = t.dense_pages.view[tok // rpp]
        offs = (tok % rpp) * t.rec_size
        idx = (pages.astype(np.int64) * self.config.page_size + offs)[:, None] + np.arange(t.rec_size)
        return self.data.reshape(-1)[idx]

    def read_sparse(self, seq: int, stream: int, start: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """The sparse records of tokens ``[start, n)``: ``(bytes uint8 [S], offsets int64 [n - start + 1])``, the
        codec's layout."""
        t = self.table(seq, stream)
        if not 0 <= start <= t.num_tokens:
            raise IndexError(f"start {start} out of [0, {t.num_tokens}]")
        if start < t.evicted_before and start < t.num_tokens:
            raise IndexError(f"tokens below {t.evicted_before} were evicted (sliding window); asked from {start}")
        lens = t.sparse_len.view.astype(np.int64)
        offsets = np.zeros(t.num_tokens + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])
        out = np.empty(int(offsets[-1] - offsets[start]), dtype=np.uint8)
        flat = self.data.reshape(-1)
        first = [*t.sparse_first.view.tolist(), t.num_tokens]
        for i, p in enumerate(t.sparse_pages.view.tolist()):
            a, b = max(first[i], start), first[i + 1]
            if b <= a:
                continue
            skip = int(offsets[a] - offsets[first[i]])  # bytes of this page's tokens before start
            nbytes = int(offsets[b] - offsets[a])
            base = p * self.config.page_size + skip
            out[offsets[a] - offsets[start] : offsets[b] - offsets[start]] = flat[base : base + nbytes]
        return out, offsets[start:] - offsets[start]

    # ---------------------------------------------------------------- accounting

    def stats(self) -> PoolStats:
        in_use = self.refcount > 0
        return PoolStats(
            page_size=self.config.page_size,
            max_pages=self.config.max_pages,
            pages_in_use=self._pages_in_use,
            pages_allocated=int(self.data.shape[0]),
            bytes_reserved=self._pages_in_use * self.config.page_size,
            bytes_used=int(self.page_fill[in_use].sum()),
            table_bytes=sum(s.table_bytes() for ss in self._seqs.values() for s in ss),
            num_sequences=len(self._seqs),
        )

    def sequence_bytes(self, seq: int) -> int:
        """Pages (whole, shared ones counted in full) plus tables that one sequence references."""
        streams = self._streams(seq)
        pages = sum(
            int((s.dense_pages.view != EVICTED).sum() + (s.sparse_pages.view != EVICTED).sum()) for s in streams
        )
        return pages * self.config.page_size + sum(s.table_bytes() for s in streams)

    def check_invariants(self) -> None:
        """Assert invariants I1-I4 (module docstring) over the whole pool; ``AssertionError`` on a violation."""
        ps = self.config.page_size
        counts = np.zeros(self.data.shape[0], dtype=np.int64)
        fill_seen: dict[int, int] = {}
        for sid, streams in self._seqs.items():
            for k, s in enumerate(streams):
                where = f"sequence {sid} stream {k}"
                dp = s.dense_pages.view
                np.add.at(counts, dp[dp != EVICTED], 1)
                if s.num_tokens == 0:
                    assert dp.size == 0 and s.sparse_pages.n == 0, f"{where}: empty stream holds pages"
                    continue
                rpp = ps // s.rec_size
                assert dp.size == math.ceil(s.num_tokens / rpp), f"{where}: {dp.size} dense pages"
                last = s.num_tokens - (dp.size - 1) * rpp
                assert 1 <= last <= rpp, f"{where}: last_page_len {last}"
                gone = int((dp == EVICTED).sum())
                assert np.all(dp[:gone] == EVICTED), f"{where}: evicted dense slots are not a prefix"
                assert gone < dp.size and gone * rpp <= s.evicted_before, f"{where}: a dense page above the watermark"
                for i, p in enumerate(dp.tolist()):
                    if p == EVICTED:
                        continue
                    fill = (rpp if i < dp.size - 1 else last) * s.rec_size
                    assert fill_seen.setdefault(p, fill) == fill, f"{where}: page {p} fill disagrees among owners"
                lens = s.sparse_len.view.astype(np.int64)
                assert lens.size == s.num_tokens, f"{where}: {lens.size} sparse lengths for {s.num_tokens} tokens"
                sp, first = s.sparse_pages.view, s.sparse_first.view
                np.add.at(counts, sp[sp != EVICTED], 1)
                assert sp.size == first.size, f"{where}: sparse table columns differ"
                assert np.all(np.diff(first) > 0), f"{where}: sparse first tokens not increasing"
                if sp.size == 0:
                    assert lens.sum() == 0 and s.sparse_tail == 0, f"{where}: sparse bytes without pages"
                    continue
                assert first[0] >= 0 and lens[first[0]] > 0 and lens[: first[0]].sum() == 0, f"{where}: sparse start"
                bounds = [*first.tolist(), s.num_tokens]
                gone = int((sp == EVICTED).sum())
                assert np.all(sp[:gone] == EVICTED), f"{where}: evicted sparse slots are not a prefix"
                assert (gone < sp.size and bounds[gone] <= s.evicted_before) or gone == 0, f"{where}: sparse eviction"
                for i, p in enumerate(sp.tolist()):
                    nbytes = int(lens[bounds[i] : bounds[i + 1]].sum())
                    assert lens[bounds[i]] > 0, f"{where}: sparse page {p} starts at an empty record"
                    assert nbytes <= ps, f"{where}: sparse page {p} overfull ({nbytes} B)"
                    if p != EVICTED:
                        assert fill_seen.setdefault(p, nbytes) == nbytes, f"{where}: page {p} fill disagrees"
                assert s.sparse_tail == int(lens[bounds[-2] :].sum()), f"{where}: sparse_tail"
        assert np.array_equal(counts, self.refcount.astype(np.int64)), "reference counts differ from table slots"
        for p, fill in fill_seen.items():
            assert self.page_fill[p] == fill, f"page {p}: page_fill {self.page_fill[p]} != {fill}"
        free = self._free
        assert len(free) == len(set(free)), "a page is on the free list twice"
        assert all(self.refcount[p] == 0 for p in free), "a page in use is on the free list"
        assert len(free) + int((self.refcount > 0).sum()) == self.data.shape[0], "a page is lost"
        assert self._pages_in_use == int((self.refcount > 0).sum()) <= self.config.max_pages, "in-use count"

    # ---------------------------------------------------------------- internals

    def _streams(self, seq: int) -> list[StreamTable]:
        try:
            return self._seqs[seq]
        except KeyError:
            raise KeyError(f"no live sequence {seq} in the page pool") from None

    def _plan(self, seq: int, stream: int, rec_size: int, sparse_lengths: np.ndarray) -> AppendPlan:
        t = self.table(seq, stream)
        ps = self.config.page_size
        lengths = np.asarray(sparse_lengths)
        if lengths.ndim != 1:
            raise ValueError(f"sparse_lengths must be 1-D [n], got shape {tuple(lengths.shape)}")
        if lengths.size and (lengths.min() < 0 or lengths.max() > min(ps, MAX_SPARSE_RECORD)):
            raise ValueError(f"sparse record lengths must be in [0, {min(ps, MAX_SPARSE_RECORD)}] bytes")
        if not isinstance(rec_size, (int, np.integer)) or not 1 <= rec_size <= ps:
            raise ValueError(f"dense record size must be in [1, page_size={ps}], got {rec_size!r}")
        if t.num_tokens and rec_size != t.rec_size:
            raise ValueError(f"stream {stream} of sequence {seq} holds {t.rec_size}-byte records, got {rec_size}")
        n = int(lengths.size)
        rpp = ps // rec_size
        need = 0
        # Dense: free slots in the last page, then whole pages.
        slots = (-t.num_tokens) % rpp if t.num_tokens else 0
        if n and slots and self.refcount[t.dense_pages.view[-1]] > 1:
            need += 1  # copy on write of the shared last page
        need += math.ceil(max(0, n - slots) / rpp)
        # Sparse: greedy placement, a record never straddles pages.
        space = ps - t.sparse_tail if t.sparse_pages.n else 0
        new_pages, writes_old_tail, _ = _place_sparse(lengths.astype(np.int64), space, ps)
        need += new_pages
        if writes_old_tail and self.refcount[t.sparse_pages.view[-1]] > 1:
            need += 1  # copy on write of the shared last sparse page
        return AppendPlan(seq, stream, n, int(rec_size), lengths.astype(np.uint16), need)

    def _check_records(
        self, plan: AppendPlan, dense: np.ndarray, sparse: np.ndarray, offs: np.ndarray, lengths: bool = True
    ) -> None:
        """Raise ValueError unless the records fit ``plan`` (``lengths=False``: the plan's lengths were computed
        from these ``offs``, so the record lengths match by construction: :meth:`append_many`)."""
        if dense.dtype != np.uint8 or dense.shape != (plan.num_tokens, plan.rec_size):
            raise ValueError(
                f"dense records must be uint8 [{plan.num_tokens}, {plan.rec_size}], got {dense.dtype} "
                f"{tuple(dense.shape)}"
            )
        if sparse.dtype != np.uint8 or sparse.ndim != 1:
            raise ValueError(f"sparse records must be a uint8 [S] array, got {sparse.dtype} {tuple(sparse.shape)}")
        if offs.shape != (plan.num_tokens + 1,) or (plan.num_tokens and (offs[0] != 0 or offs[-1] > sparse.size)):
            raise ValueError("sparse_offsets must be [n + 1], start at 0 and end within the sparse bytes")
        if lengths and not np.array_equal(np.diff(offs), plan.sparse_lengths.astype(offs.dtype)):
            raise ValueError("sparse_offsets do not match the planned record lengths")

    def _alloc(self) -> int:
        if self._pages_in_use >= self.config.max_pages:  # the plan guarantees this cannot happen
            raise PoolExhaustedError("page pool exhausted during a commit (plan/commit mismatch)")
        if not self._free:
            self._grow()
        p = self._free.pop()
        self.refcount[p] = 1
        self.page_fill[p] = 0
        self._pages_in_use += 1
        return p

    def _alloc_many(self, k: int) -> list[int]:
        """``k`` pages, the ones ``k`` calls of :meth:`_alloc` would return, in that order."""
        if self._pages_in_use + k > self.config.max_pages:  # the plan guarantees this cannot happen
            raise PoolExhaustedError("page pool exhausted during a commit (plan/commit mismatch)")
        pages: list[int] = []
        while len(pages) < k:
            if not self._free:
                self._grow()
            take = min(k - len(pages), len(self._free))
            pages += self._free[: -take - 1 : -1]
            del self._free[-take:]
        self.refcount[pages] = 1
        self.page_fill[pages] = 0
        self._pages_in_use += k
        return pages

    def _grow(self) -> None:
        old = self.data.shape[0]
        new = min(2 * old, self.config.max_pages)
        data = np.zeros((new, self.config.page_size), dtype=np.uint8)
        data[:old] = self.data
        self.data = data
        self.refcount = np.concatenate([self.refcount, np.zeros(new - old, dtype=np.int32)])
        self.page_fill = np.concatenate([self.page_fill, np.zeros(new - old, dtype=np.int32)])
        self._free.extend(range(new - 1, old - 1, -1))

    def _decref(self, p: int) -> None:
        self.refcount[p] -= 1
        if self.refcount[p] == 0:
            self.page_fill[p] = 0
            self._free.append(p)
            self._pages_in_use -= 1

    def _cow(self, p: int) -> int:
        """Copy a shared page for the one owner about to write into it; returns the private copy."""
        q = self._alloc()
        fill = int(self.page_fill[p])
        self.data[q, :fill] = self.data[p, :fill]
        self.page_fill[q] = fill
        self._decref(p)
        return q

    def _write(self, plan: AppendPlan, dense: np.ndarray, sparse: np.ndarray, offs: np.ndarray) -> None:
        """Write a plan's records: a shared last page is copied first (copy on write), the new pages are taken in
        token order (dense, then sparse), and one numba call copies the records (:func:`_write_records`)."""
        t = self.table(plan.seq, plan.stream)
        n, rec, ps = plan.num_tokens, plan.rec_size, self.config.page_size
        if n == 0:
            return
        rpp = ps // rec
        slot = t.num_tokens % rpp  # records already in the last dense page (0: it is full, or there is none)
        dp, sp = t.dense_pages, t.sparse_pages
        if slot and self.refcount[dp.buf[dp.n - 1]] > 1:
            dp.buf[dp.n - 1] = self._cow(int(dp.buf[dp.n - 1]))
        dense_ids = np.asarray(self._alloc_many(-(-(n - (min(n, rpp - slot) if slot else 0)) // rpp)), np.int32)
        lengths = plan.sparse_lengths.astype(np.int64)
        space = ps - t.sparse_tail if sp.n else 0
        new_sparse, writes_old_tail, _ = _place_sparse(lengths, space, ps)
        if writes_old_tail and self.refcount[sp.buf[sp.n - 1]] > 1:
            sp.buf[sp.n - 1] = self._cow(int(sp.buf[sp.n - 1]))
        sparse_ids = np.asarray(self._alloc_many(new_sparse), np.int32)
        first = np.empty(new_sparse, np.int64)
        tail, wrote = _write_records(
            self.data, self.page_fill, dense, rpp, slot, int(dp.buf[dp.n - 1]) if slot else -1, dense_ids, sparse,
            np.asarray(offs, dtype=np.int64), space, int(sp.buf[sp.n - 1]) if sp.n else -1, sparse_ids, first,
        )  # fmt: skip
        t.rec_size = rec
        dp.extend(dense_ids)
        if new_sparse:
            sp.extend(sparse_ids)
            t.sparse_first.extend(first + t.num_tokens)
        if wrote:
            t.sparse_tail = int(tail)
        t.num_tokens += n
        t.sparse_len.extend(plan.sparse_lengths)


@njit(cache=True, nogil=True)
def _place_sparse(lengths, space, page_size):
    """Greedy placement of sparse records (a record never straddles pages), counted: :func:`_write_records` places
    them the same way.

    Args:
        lengths: int64 ``[n]`` record lengths; space: bytes left in the stream's last sparse page (0: none).

    Returns:
        ``(new pages, whether the current last page is written, bytes used in the last page afterwards)``.
    """
    new = 0
    writes_old = False
    left = space
    for j in range(lengths.shape[0]):
        length = lengths[j]
        if length == 0:
            continue
        if length <= left:
            if new == 0:
                writes_old = True
        else:
            new += 1
            left = page_size
        left -= length
    return new, writes_old, page_size - left


@njit(cache=True, nogil=True)
def _write_records(
    data, page_fill, dense, rpp, slot, last_dense, dense_ids, sparse, offs, space, last_sparse, sparse_ids, first
):
    """One stream's records into its pages (:meth:`PagePool._write`, after any copy on write: every page written
    here belongs to this stream alone): each token's addresses computed here, its bytes copied by
    ``oakenkv.store.records.put_record`` (the one record writer, shared with the vLLM plugin's blocks).

    Dense records fill the ``rpp - slot`` free slots of page ``last_dense`` (when ``slot``), then the new pages
    ``dense_ids``; sparse records are placed greedily (as :func:`_place_sparse`) into the ``space`` bytes left in
    page ``last_sparse``, then the new pages ``sparse_ids``, whose first record's index goes to ``first``.
    Returns ``(bytes used in the last sparse page, whether any sparse record was written)``.
    """
    n, rec = dense.shape
    ps = data.shape[1]
    flat = data.reshape(-1)
    # dense: token j goes to slot (slot + j) of the pages [last_dense, dense_ids...]
    page = last_dense
    at = slot
    q = 0
    left = space
    cur = last_sparse
    new = 0
    wrote = False
    for j in range(n):
        if at == rpp or page < 0:
            if page >= 0:
                page_fill[page] = at * rec
            page = dense_ids[q]
            q += 1
            at = 0
        dense_at = page * ps + at * rec
        at += 1
        length = offs[j + 1] - offs[j]
        sparse_at = -1
        if length:
            if length > left:
                cur = sparse_ids[new]
                first[new] = j
                new += 1
                left = ps
            sparse_at = cur * ps + ps - left
            left -= length
            page_fill[cur] = ps - left
            wrote = True
        put_record(flat, dense, j, dense_at, sparse, offs[j], length, sparse_at)
    if n and page >= 0:
        page_fill[page] = at * rec
    return ps - left, wrote
