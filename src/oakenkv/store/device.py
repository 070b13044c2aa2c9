"""The device store: every layer's keys and values of a batch in pages on the model's device (CUDA, or the CPU under
``TRITON_INTERPRET=1``), written and read by the Triton kernels (``oakenkv.kernels.triton``).

Why one module (over 600 lines): :class:`DevicePagePool`, :class:`DeviceTables` and :class:`DeviceKVStore` keep
one set of host tables and device tensors consistent through one protocol per step (reserve, encode, settle),
which reads best, and is checked best, in one file.

:class:`DeviceKVStore` is :class:`~oakenkv.store.paged.PagedKVStore`'s counterpart for GPU models (``docs/gpu.md``):
the same bytes (the Triton encoder is bit-exact with the reference), the same page tables and policies, with

* **one preallocated page tensor** (``uint8 [max_pages * page_size]``, sized from ``PoolConfig.budget_bytes`` when
  the store first sees its device, as vLLM allocates its KV blocks) holding dense and sparse pages alike: one id
  space and one budget for both kinds, so no split of the budget has to be guessed. Page ids, reference counts,
  free lists and every stream's table stay on the host (:class:`DevicePagePool`, a ``PagePool`` whose pages hold
  no host bytes): allocation is ask-then-commit, copy on write copies a page on the device, fork, free and
  eviction are table operations, as on the CPU;
* **the kernel view on the device** (:class:`DeviceTables`, one per layer): dense page ids, and per token its sparse
  record's absolute address and length, appended by every write (never rebuilt per call; capacities double);
  a decode step hands the kernels these tensors as they are;
* **a decode step without a device-to-host copy per layer.** Dense slots depend on nothing the kernel computes, but
  sparse records never straddle pages and their lengths are known only after encoding. So the host reserves, for
  every stream, the worst case (``format.sparse_capacity(D)``) at its sparse tail (a new page when the tail has less
  room), the encoder writes every row's record straight to its dense slot and sparse tail (``encode_records`` at
  given offsets), and the lengths go to the device tables. The host learns the lengths from one copy per step, of
  all layers at once (:meth:`DeviceKVStore.settle`, before the next step plans, or before anything reads the host
  tables), with the step's attention error codes. A tail is thereby never filled past ``page_size - capacity``
  while a decode step writes into it (up to ``capacity`` bytes of a sparse page stay unused: fragmentation
  the stats report; bigger pages waste less);
* **prefill and chunked prefill** per chunk and layer: the rows encoded into scratch, their lengths copied to the
  host once (prefill is not latency-bound), placed by the pool exactly as on the CPU, and the bytes moved into the
  pages by ``copy_spans`` (one program per record); attention then reads the pages only
  (:mod:`oakenkv.kernels.triton.prefill`: tiles dequantized inside a flash-attention loop), so a long history is
  never materialized in floats;
* the ``oaken-plus`` online key transform (shift, per-head Hadamard rotation) and the query rotation by a Triton
  kernel (:mod:`oakenkv.kernels.triton.rotate`: the CPU kernel's bits), and the sink tokens at 16 bits on the
  device, merged into attention through its log-sum-exp. A row's sink tokens are its first real tokens, as on the
  CPU (:meth:`DeviceKVStore.set_row_starts`, from the attention mask: a left-padded row's start after its padding);
  attention then masks each row's sink positions out of the pages' part and gathers their mask for the 16-bit part;
* adaptive grouping (``adapt=``, ``oakenkv.quant.adapt``): the state the CPU store keeps, fed the same counts (sparse
  bytes per epoch), so every epoch's grouping thresholds are the CPU store's; the encoder takes per-row shift and
  grouping thresholds (``[2B, 8]``), the view the fixed shift thresholds. A prefill chunk is split at epoch ends
  (its counts reach the host anyway); a decode step's counts reach the state at :meth:`DeviceKVStore.settle`, which
  runs before the next step's first encode, so the next token is grouped as on the CPU.

Not supported on the device yet: the full-precision window (``residual > 0``) and ``codec="reference"`` (the
reference is the CPU store's); both are refused at construction. Errors the encoder reports in a decode step (a
NaN in the model's keys, an fp16 scale overflow) surface at the next :meth:`DeviceKVStore.settle` (the next step),
which raises; as after any failed write, the cache must then be reset.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from numba import njit

from oakenkv.calibrate.thresholds import Thresholds
from oakenkv.format.layout import ERROR_MESSAGES, EVICTED, CorruptDataError, record_size, scale_bytes, sparse_capacity
from oakenkv.quant.adapt import AdaptConfig, new_state
from oakenkv.store.paged import (
    KEY,
    KINDS,
    PREFILL_CHUNK,
    VALUE,
    _check_encoded_rows,
    checked_row_starts,
    encode_thresholds,
    sink_slices,
)
from oakenkv.store.pages import (
    AppendPlan,
    PagePool,
    PoolConfig,
    PoolExhaustedError,
    PoolStats,
    TokenTargets,
    _place_sparse,
)

__all__ = ["DeviceKVStore", "DevicePagePool", "DeviceTables"]


# ------------------------------------------------------------------------------------------------ the host tables


@njit(cache=True, nogil=True)
def _place_sparse_records(lengths, space, page_size, last_sparse, sparse_ids, first, page_fill, sparse_at):
    """Greedy placement of one stream's sparse records (``pages._write_records``' rule: a record that does not fit
    the rest of the current page starts a new one), as flat byte offsets ``sparse_at`` (0 for empty records).

    Args:
        lengths: int64 ``[n]``; space: bytes left in page ``last_sparse`` (0: none); sparse_ids: the new pages in
            order; first: int64 out, the index of each new page's first record; page_fill: the pool's, updated.

    Returns:
        ``(bytes used in the last sparse page, whether any record was placed)``.
    """
    left = space
    cur = last_sparse
    new = 0
    wrote = False
    for j in range(lengths.shape[0]):
        length = lengths[j]
        if length == 0:
            sparse_at[j] = 0
            continue
        if length > left:
            cur = sparse_ids[new]
            first[new] = j
            new += 1
            left = page_size
        sparse_at[j] = cur * page_size + (page_size - left)
        left -= length
        page_fill[cur] = page_size - left
        wrote = True
    return page_size - left, wrote


class DevicePagePool(PagePool):
    """A :class:`~oakenkv.store.pages.PagePool` whose pages live in a device tensor: the host keeps the tables (page
    ids, reference counts, free list, every stream's :class:`~oakenkv.store.pages.StreamTable`) and plans every
    write; the store moves the bytes. ``data`` has no columns (``[pages, 0]``): the host arrays keep their
    indexing by page id and the invariant checks run unchanged.

    Writes are placements, not copies: :meth:`place_many` (a prefill chunk: lengths known, the CPU pool's exact
    placement) and :meth:`reserve_tokens` + :meth:`settle_tokens` (a decode step: lengths learned afterwards).
    """

    def __init__(self, config: PoolConfig | None = None) -> None:
        super().__init__(config)
        self.data = np.zeros((self.data.shape[0], 0), dtype=np.uint8)
        #: The device page tensor (uint8 ``[max_pages * page_size]``), set by the store when it binds a device:
        #: copy on write copies a page there.
        self.bytes: torch.Tensor | None = None

    def _grow(self) -> None:
        old = self.data.shape[0]
        new = min(2 * old, self.config.max_pages)
        self.data = np.zeros((new, 0), dtype=np.uint8)
        self.refcount = np.concatenate([self.refcount, np.zeros(new - old, dtype=np.int32)])
        self.page_fill = np.concatenate([self.page_fill, np.zeros(new - old, dtype=np.int32)])
        self._free.extend(range(new - 1, old - 1, -1))

    def _cow(self, p: int) -> int:
        q = super()._cow(p)  # tables and counts (no host bytes)
        fill = int(self.page_fill[q])
        if fill:
            ps = self.config.page_size
            self.bytes[q * ps : q * ps + fill].copy_(self.bytes[p * ps : p * ps + fill])
        return q

    def read_dense(self, *args, **kwargs):
        raise NotImplementedError("a device pool's bytes live on the device: read them with the Triton kernels")

    read_sparse = read_dense

    def stats(self) -> PoolStats:
        # the device tensor is allocated whole, at the budget
        return dataclasses.replace(super().stats(), pages_allocated=self.config.max_pages)

    # -------------------------------------------------------------------------- prefill: lengths known

    def place_many(self, items: list[tuple[int, int, int, np.ndarray]]) -> list[tuple[np.ndarray, np.ndarray, int]]:
        """Append records to several distinct streams atomically (all of them, or, budget exhausted, none) and
        return where their bytes go: the CPU pool's :meth:`append_many` without the copies.

        Args:
            items: ``(seq, stream, rec_size, sparse_lengths int [n])``.

        Returns:
            Per item ``(dense_at, sparse_at, cow_from)``: int64 ``[n]`` flat byte offsets of each token's dense and
            sparse record (0 for empty sparse records), and the first token whose sparse address changed because
            the stream's last sparse page was copied on write (``num_tokens`` before the append when none was).
        """
        plans: list[AppendPlan] = []
        seen = set()
        for seq, stream, rec, lengths in items:
            if (seq, stream) in seen:
                raise ValueError(f"place_many got stream {stream} of sequence {seq} twice")
            seen.add((seq, stream))
            plans.append(self._plan(seq, stream, rec, np.asarray(lengths)))
        need = sum(p.pages_needed for p in plans)
        if need > self.free_pages:
            raise PoolExhaustedError(
                f"page pool exhausted: appending to {len(plans)} stream(s) needs {need} pages, "
                f"{self.free_pages} are free ({self.config.max_pages} pages of {self.config.page_size} B = "
                f"{self.config.budget_bytes} B budget); no sequence was changed"
            )
        return [self._place(plan) for plan in plans]

    def _place(self, plan: AppendPlan) -> tuple[np.ndarray, np.ndarray, int]:
        """:meth:`PagePool._write`'s table work for one plan, returning the records' offsets instead of copying."""
        t = self.table(plan.seq, plan.stream)
        n, rec, ps = plan.num_tokens, plan.rec_size, self.config.page_size
        t0 = t.num_tokens
        if n == 0:
            return np.zeros(0, np.int64), np.zeros(0, np.int64), t0
        rpp = ps // rec
        slot = t0 % rpp
        dp, sp = t.dense_pages, t.sparse_pages
        if slot and self.refcount[dp.buf[dp.n - 1]] > 1:
            dp.buf[dp.n - 1] = self._cow(int(dp.buf[dp.n - 1]))
        dense_ids = np.asarray(self._alloc_many(-(-(n - (min(n, rpp - slot) if slot else 0)) // rpp)), np.int32)
        # dense: token t0 + j in page (t0 + j) // rpp of the stream, slot (t0 + j) % rpp
        pages = np.concatenate([dp.buf[t0 // rpp : dp.n], dense_ids]).astype(np.int64) if slot else dense_ids
        tok = np.arange(t0, t0 + n, dtype=np.int64)
        first_page = t0 // rpp
        dense_at = pages.astype(np.int64)[tok // rpp - first_page] * ps + (tok % rpp) * rec
        fills = np.bincount(tok // rpp - first_page, minlength=pages.size) * rec
        if slot:
            fills[0] += slot * rec
        self.page_fill[pages] = fills
        lengths = plan.sparse_lengths.astype(np.int64)
        space = ps - t.sparse_tail if sp.n else 0
        new_sparse, writes_old_tail, _ = _place_sparse(lengths, space, ps)
        cow_from = t0
        if writes_old_tail and self.refcount[sp.buf[sp.n - 1]] > 1:
            sp.buf[sp.n - 1] = self._cow(int(sp.buf[sp.n - 1]))
            cow_from = int(t.sparse_first.buf[sp.n - 1])
        sparse_ids = np.asarray(self._alloc_many(new_sparse), np.int32)
        first = np.empty(new_sparse, np.int64)
        sparse_at = np.empty(n, np.int64)
        tail, wrote = _place_sparse_records(
            lengths, space, ps, int(sp.buf[sp.n - 1]) if sp.n else -1, sparse_ids, first, self.page_fill, sparse_at
        )
        t.rec_size = rec
        dp.extend(dense_ids)
        if new_sparse:
            sp.extend(sparse_ids)
            t.sparse_first.extend(first + t0)
        if wrote:
            t.sparse_tail = int(tail)
        t.num_tokens += n
        t.sparse_len.extend(plan.sparse_lengths)
        return dense_at, sparse_at, cow_from

    # -------------------------------------------------------------------------- decode: lengths learned later

    def reserve_tokens(
        self, targets: TokenTargets, rec: int, capacity: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[tuple[int, int]]]:
        """Append one token to each of several distinct streams, atomically, before its sparse length is known (a
        decode step on the device; module doc of ``oakenkv.store.device``).

        Each stream's dense record takes its next slot (a new page, or a copy of a shared last page, as
        :meth:`append_token`); its sparse record goes at its sparse tail if ``capacity`` bytes (the largest record)
        are left there, else at the start of a new page. The token is counted and its length recorded as 0 until
        :meth:`settle_tokens`; the tail does not move. Raises :class:`PoolExhaustedError`, changing nothing.

        Returns:
            ``(dense_at, sparse_at, new_page, cows)``: int64 ``[m]`` flat offsets of each record, bool ``[m]``
            whether its sparse page is new (:meth:`settle_tokens` gives it back if the record turns out empty), and
            ``(target, first token)`` for each stream whose last sparse page was copied on write (the sparse
            addresses of its tokens from there on moved).
        """
        ps = self.config.page_size
        if targets.generation != self._generation:  # a sequence was freed: look the tables up again
            fresh = self.token_targets(targets.pairs)
            targets.tables, targets.generation = fresh.tables, fresh.generation
        tables = targets.tables
        m = len(tables)
        rpp = ps // rec
        shared = self._maybe_shared and bool((self.refcount > 1).any())
        self._maybe_shared = shared
        refcount = self.refcount
        need = 0
        for t in tables:  # ask
            if t.num_tokens and t.rec_size != rec:
                raise ValueError(f"a stream holds {t.rec_size}-byte records, got {rec}")
            if t.num_tokens % rpp == 0 or (shared and refcount[t.dense_pages.buf[t.dense_pages.n - 1]] > 1):
                need += 1
            if (
                not t.sparse_pages.n
                or capacity > ps - t.sparse_tail
                or (shared and refcount[t.sparse_pages.buf[t.sparse_pages.n - 1]] > 1)
            ):
                need += 1
        if need > self.free_pages:
            raise PoolExhaustedError(
                f"page pool exhausted: appending a token to {m} stream(s) needs {need} pages, {self.free_pages} "
                f"are free ({self.config.max_pages} pages of {ps} B = {self.config.budget_bytes} B budget); "
                "no sequence was changed"
            )
        dense_at = np.empty(m, np.int64)
        sparse_at = np.empty(m, np.int64)
        new_page = np.zeros(m, np.bool_)
        cows: list[tuple[int, int]] = []
        for k, t in enumerate(tables):  # commit
            t.rec_size = rec
            slot = t.num_tokens % rpp
            dp = t.dense_pages
            if slot == 0:
                dp.push(self._alloc())
            elif shared and self.refcount[dp.buf[dp.n - 1]] > 1:
                dp.buf[dp.n - 1] = self._cow(int(dp.buf[dp.n - 1]))
            pg = int(dp.buf[dp.n - 1])
            dense_at[k] = pg * ps + slot * rec
            self.page_fill[pg] = (slot + 1) * rec
            sp = t.sparse_pages
            if not sp.n or capacity > ps - t.sparse_tail:
                pg = self._alloc()
                sp.push(pg)
                t.sparse_first.push(t.num_tokens)
                new_page[k] = True
                at = 0
            else:
                pg = int(sp.buf[sp.n - 1])
                if shared and self.refcount[pg] > 1:
                    pg = self._cow(pg)
                    sp.buf[sp.n - 1] = pg
                    cows.append((k, int(t.sparse_first.buf[sp.n - 1])))
                at = t.sparse_tail
            sparse_at[k] = pg * ps + at
            t.sparse_len.push(0)
            t.num_tokens += 1
        return dense_at, sparse_at, new_page, cows

    def settle_tokens(
        self, targets: TokenTargets, lengths: np.ndarray, sparse_at: np.ndarray, new_page: np.ndarray
    ) -> None:
        """The sparse lengths of the tokens :meth:`reserve_tokens` placed (the arrays it returned): each stream's
        last token takes its length and the tail moves past it; a page reserved for a record that came out empty is
        given back (a sparse page always starts with a record, invariant I3)."""
        ps = self.config.page_size
        for k, t in enumerate(targets.tables):
            length = int(lengths[k])
            t.sparse_len.buf[t.num_tokens - 1] = length
            if length:
                pg, at = divmod(int(sparse_at[k]), ps)
                t.sparse_tail = at + length
                self.page_fill[pg] = t.sparse_tail
            elif new_page[k]:
                sp = t.sparse_pages
                pg = int(sp.buf[sp.n - 1])
                sp.n -= 1
                t.sparse_first.n -= 1
                self._decref(pg)


def stream_addresses(table, page_size: int, start: int, stop: int) -> np.ndarray:
    """int64 ``[stop - start]``: the flat byte offset of the sparse record of tokens ``[start, stop)`` of one
    stream, from its host tables (page of the token, plus the lengths of the page's earlier records); ``EVICTED``
    for tokens on released pages or before the stream's first sparse page (those have empty records)."""
    first = table.sparse_first.view.astype(np.int64)
    pages = table.sparse_pages.view.astype(np.int64)
    lens = table.sparse_len.buf[:stop].astype(np.int64)
    cum = np.zeros(stop + 1, np.int64)
    np.cumsum(lens, out=cum[1:])
    tok = np.arange(start, stop, dtype=np.int64)
    pi = np.searchsorted(first, tok, side="right") - 1
    pic = np.maximum(pi, 0)
    if pages.size == 0:
        return np.full(tok.size, EVICTED, np.int64)
    pg = pages[pic]
    addr = pg * page_size + cum[tok] - cum[first[pic]]
    return np.where((pi >= 0) & (pg >= 0), addr, EVICTED)


# ------------------------------------------------------------------------------------------------ the device view


class DeviceTables:
    """One layer's page tables of every batch row on the device, as the Triton kernels read them
    (``kernels.triton.view.DeviceLayerView``); kept current by every write of :class:`DeviceKVStore`.

    Shapes ``[B, 2, capacity]`` (kind 0 keys, 1 values); capacities double as the layer grows, entries past the
    live part are meaningless. ``sparse_addr`` and ``sparse_lengths`` always share their capacity (the kernels
    read them with one set of strides).
    """

    __slots__ = ("dense_pages", "num_tokens", "sparse_addr", "sparse_lengths")

    def __init__(self, batch: int, device: torch.device) -> None:
        #: Tokens stored in every stream of the layer (host-side: the tables are sliced by it).
        self.num_tokens = 0
        #: int32 ``[B, 2, >= ceil(T / rpp)]``: dense page ids.
        self.dense_pages = torch.full((batch, 2, 4), EVICTED, dtype=torch.int32, device=device)
        #: int64 ``[B, 2, >= T]``: flat byte offset of each token's sparse record (``EVICTED``: page released).
        self.sparse_addr = torch.zeros((batch, 2, 64), dtype=torch.int64, device=device)
        #: int32 ``[B, 2, >= T]``: sparse record lengths.
        self.sparse_lengths = torch.zeros((batch, 2, 64), dtype=torch.int32, device=device)

    @staticmethod
    def _grown(x: torch.Tensor, size: int, fill: int) -> torch.Tensor:
        if x.shape[2] >= size:
            return x
        new = torch.full((*x.shape[:2], max(size, 2 * x.shape[2])), fill, dtype=x.dtype, device=x.device)
        new[:, :, : x.shape[2]] = x
        return new

    def ensure(self, tokens: int, rpp: int) -> None:
        """Capacity for ``tokens`` tokens (doubling)."""
        self.dense_pages = self._grown(self.dense_pages, -(-tokens // rpp), EVICTED)
        self.sparse_addr = self._grown(self.sparse_addr, tokens, 0)
        self.sparse_lengths = self._grown(self.sparse_lengths, tokens, 0)

    def select(self, index: torch.Tensor) -> None:
        """Rows ``index`` (a reorder: forked rows share their source's pages, so their tables are its tables)."""
        self.dense_pages = self.dense_pages[index]
        self.sparse_addr = self.sparse_addr[index]
        self.sparse_lengths = self.sparse_lengths[index]


# ------------------------------------------------------------------------------------------------ the store


class DeviceKVStore:
    """The state all layers of one ``OakenCache`` share on a device: the page tensor, the host tables, the device
    tables, the sink tokens (module doc). The same constructor arguments as
    :class:`~oakenkv.store.paged.PagedKVStore`, plus ``device`` (default: that of the first tensors appended).
    """

    #: What ``oakenkv.hf`` dispatches on: this store's attention runs on the device (:meth:`attention`).
    on_device = True

    def __init__(
        self,
        thresholds: Thresholds,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        pool_config: PoolConfig | None = None,
        codec: str = "auto",
        prefill_chunk: int = PREFILL_CHUNK,
        residual: int = 0,
        device: torch.device | str | None = None,
        adapt: AdaptConfig | None = None,
    ) -> None:
        if adapt is not None and not isinstance(adapt, AdaptConfig):
            raise TypeError(f"adapt must be an AdaptConfig or None, got {type(adapt).__name__}")
        if thresholds.num_layers != num_layers:
            raise ValueError(f"thresholds hold {thresholds.num_layers} layers, the model has {num_layers}")
        config = thresholds.config
        if config.granularity != "token":
            raise ValueError("OakenCache stores one vector per token and layer: it needs granularity='token'")
        if config.key_position != "post_rope":
            raise ValueError(
                "OakenCache stores keys after RoPE, but these thresholds were profiled before RoPE "
                "(key_position='pre_rope'); profile with key_position='post_rope'"
            )
        if codec not in ("auto", "fast"):
            raise ValueError(f"the device store encodes with the Triton kernels: codec must be 'auto', got {codec!r}")
        if not isinstance(prefill_chunk, int) or prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be a positive int, got {prefill_chunk!r}")
        if residual:
            raise ValueError(
                "the device store has no full-precision window yet: use residual=0 on a GPU (or the CPU store)"
            )
        from oakenkv.kernels.triton._oaken import check_static_grids
        from oakenkv.kernels.triton.encode import MAX_TRITON_DIM

        check_static_grids(config.static_grids)  # (the Triton kernels read records of six scales)
        dim = num_kv_heads * head_dim
        if dim > MAX_TRITON_DIM:
            raise ValueError(f"the Triton encoder takes rows of up to {MAX_TRITON_DIM} values; this model's are {dim}")
        self.thresholds = thresholds
        self.config = config
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dim = dim
        self.rec_size = record_size(dim, config)
        self.scale_bytes = scale_bytes(config)
        #: Largest sparse record: what a decode step reserves at each stream's tail (module doc).
        self.capacity = sparse_capacity(dim)
        self.pool = DevicePagePool(pool_config)
        ps = self.pool.config.page_size
        if self.rec_size > ps or self.capacity > ps:
            raise ValueError(
                f"pages of {ps} B cannot hold a record of this model's rows ({self.rec_size} B dense, up to "
                f"{self.capacity} B sparse): use a larger PoolConfig.page_size"
            )
        self.rpp = ps // self.rec_size
        self.prefill_chunk = prefill_chunk
        from oakenkv.kernels.triton.interpret import store_blocks

        #: Block sizes of the attention and read kernels: theirs on a GPU, larger under the interpreter.
        self._blocks = store_blocks()
        #: The Triton kernels are the fast path here; ``OakenLayer`` reads this as the CPU store's flag.
        self.fast = True
        self.residual = 0
        self.window_len: list[int] = [0] * num_layers
        #: Adaptive grouping's state (``oakenkv.quant.adapt``; the CPU store's), or None.
        self.adapt_state = None if adapt is None else new_state(thresholds, adapt)
        #: float32 ``[num_layers, 2, 4]`` on the host: ``(to_lo, ti_lo, ti_hi, to_hi)`` per layer and kind, what
        #: every token is decoded with (under adaptive grouping the fixed shift thresholds).
        self.thr = np.array(
            [
                [
                    (thresholds.layer(i, k) if adapt is None else self.adapt_state.shift(i, kind)).as_tuple()
                    for kind, k in enumerate(KINDS)
                ]
                for i in range(num_layers)
            ],
            dtype=np.float32,
        )
        t = thresholds.transforms
        self.transforms = t if t is not None and t.online_keys else None
        self.sink_tokens = t.sink_tokens if t is not None else 0
        #: int64 ``[B]``: each row's first real token, its first sink token (None: 0 for every row;
        #: :meth:`set_row_starts`), and its copy on the device (None with it).
        self.row_starts: np.ndarray | None = None
        #: Whether some row's sinks are not at tokens 0.. (set with the starts).
        self._own_starts = False
        self._starts_device: torch.Tensor | None = None
        #: No row has a sink token at or after this position (``max(row_starts) + sink_tokens``).
        self._sink_end = self.sink_tokens
        self.device: torch.device | None = None
        self.seqs: list[int] = []
        self.tables: list[DeviceTables] = []
        self.sinks: list[torch.Tensor] = []
        self._targets: list[TokenTargets] = []
        #: Decode steps whose lengths the host has not seen yet: ``(layer, sparse_at, new_page)``.
        self._pending: list[tuple[int, np.ndarray, np.ndarray]] = []
        self._pending_layers: set[int] = set()
        if device is not None:
            self.bind(device)

    # ---------------------------------------------------------------------------------------- device, batch

    def bind(self, device: torch.device | str) -> None:
        """Allocate the page tensor and the per-layer constants on ``device`` (once)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if self.device is not None:
            if device != self.device:
                raise ValueError(f"this cache's pages are on {self.device}, got tensors on {device}")
            return
        from oakenkv.kernels.triton import available

        if not available():
            raise RuntimeError("the device store needs triton (pip install 'oakenkv[triton]')")
        if device.type == "cpu":
            import os

            if os.environ.get("TRITON_INTERPRET") != "1":
                raise ValueError(
                    "backend='triton' on CPU tensors runs the kernels under the Triton interpreter: set "
                    "TRITON_INTERPRET=1 before importing oakenkv (or use the CPU store, backend='numba')"
                )
        cfg = self.pool.config
        self.device = device
        # zeroed, so that the bytes of a page are defined beyond what was written (one memset at creation)
        self.bytes = torch.zeros(cfg.max_pages * cfg.page_size, dtype=torch.uint8, device=device)
        self.pool.bytes = self.bytes
        self.thr_device = torch.from_numpy(self.thr).to(device)
        self._key_online = [False] * self.num_layers
        self._key_rotation = [False] * self.num_layers
        if self.transforms is not None:
            t = self.transforms
            self._key_online = [lt.key_shift is not None or lt.key_rotation for lt in t.layers]
            self._key_rotation = [lt.key_rotation for lt in t.layers]
            self._key_shifts = [
                torch.tensor(lt.key_shift, dtype=torch.float32, device=device) if lt.key_shift is not None else None
                for lt in t.layers
            ]

    @property
    def batch_size(self) -> int:
        return len(self.seqs)

    def ensure_batch(self, batch_size: int) -> None:
        if not self.seqs:
            n = self.sink_tokens
            self.sinks = [
                torch.zeros((batch_size, 2, n, self.dim), dtype=torch.float16, device=self.device)
                for _ in range(self.num_layers)
            ]
            self._set_rows([self.pool.new_sequence(2 * self.num_layers) for _ in range(batch_size)], None)
        elif batch_size != len(self.seqs):
            raise ValueError(f"the cache holds {len(self.seqs)} sequences but got a batch of {batch_size}")

    def _set_rows(self, seqs: list[int], index: list[int] | None) -> None:
        """Make ``seqs`` the batch rows: fresh device tables (``index`` None), or the old rows ``index`` gathered
        (a reorder); the per-step buffers for the batch size."""
        self.seqs = seqs
        self._targets = [
            self.pool.token_targets([(s, 2 * layer + KEY) for s in seqs] + [(s, 2 * layer + VALUE) for s in seqs])
            for layer in range(self.num_layers)
        ]
        b, dev = len(seqs), self.device
        if index is None:
            self.tables = [DeviceTables(b, dev) for _ in range(self.num_layers)]
        else:
            idx = torch.tensor(index, dtype=torch.int64, device=dev)
            for lt in self.tables:
                lt.select(idx)
            self.sinks = [s[idx] for s in self.sinks]
        m = 2 * b
        # one token per stream and layer: keys' rows, then values'
        self._rows = torch.empty((m, self.dim), dtype=torch.float32, device=dev)
        self._thr_rows = self._encode_thr_rows(b)  # [L, 2B, 4] (8 under adaptive grouping)
        pin = dev.type == "cuda"
        self._stage = torch.empty((self.num_layers, 2, m), dtype=torch.int64, pin_memory=pin)
        self._offsets = torch.empty((self.num_layers, 2, m), dtype=torch.int64, device=dev)
        # every layer's counts of the step, then the attention's error code: read by settle() in one copy
        self._sync = torch.zeros(self.num_layers * m + 1, dtype=torch.int32, device=dev)
        self._status = self._sync[-1:]

    def _encode_thr(self, layer: int) -> np.ndarray:
        """float32 ``[2, 4]`` (``[2, 8]`` under adaptive grouping: the shift thresholds, then the current epoch's
        grouping ones): what the encoder takes for ``layer``'s keys and values (``paged.encode_thresholds``)."""
        return encode_thresholds(self.thr[layer], self.adapt_state, layer)

    def _encode_thr_rows(self, b: int) -> torch.Tensor:
        """float32 ``[L, 2B, 4 or 8]`` on the device: every layer's encoder thresholds per row of a decode step."""
        if self.adapt_state is None:
            return self.thr_device.repeat_interleave(b, dim=1).contiguous()
        thr = np.stack([self._encode_thr(layer) for layer in range(self.num_layers)])  # [L, 2, 8]
        return torch.from_numpy(np.repeat(thr, b, axis=1)).to(self.device)

    def num_tokens(self, layer: int) -> int:
        return self.tables[layer].num_tokens if self.seqs else 0

    def window_tokens(self, layer: int) -> int:
        return 0

    def _check_kv(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        _, h, _, hd = keys.shape
        if (h, hd) != (self.num_kv_heads, self.head_dim) or values.shape != keys.shape:
            raise ValueError(
                f"expected keys and values [B, {self.num_kv_heads}, S, {self.head_dim}], got "
                f"{tuple(keys.shape)} and {tuple(values.shape)}"
            )
        if keys.device != values.device:
            raise ValueError(f"keys on {keys.device}, values on {values.device}")

    # ---------------------------------------------------------------------------------------------- writes

    def append(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Encode and store new tokens ``[B, H, S, hd]`` of one layer for every row: a decode step's single token
        (no device-to-host copy) or a prefill, chunk by chunk (each chunk atomic)."""
        self._check_kv(keys, values)
        self.bind(keys.device)
        self.ensure_batch(keys.shape[0])
        s = keys.shape[2]
        if s == 1 and self.tables[layer].num_tokens:
            self._append_token(layer, keys, values)
            return
        self.settle()  # (the adaptive state takes pending decode steps' counts before it splits the update)
        state = self.adapt_state
        for a in range(0, s, self.prefill_chunk):
            e = min(s, a + self.prefill_chunk)
            while a < e:  # under adaptive grouping, one epoch at a time (PagedKVStore._append_rows)
                m = e if state is None else a + state.segment(layer, KEY, e - a)
                self._append_chunk(layer, keys[:, :, a:m], values[:, :, a:m])
                a = m

    def _transform_keys(self, layer: int, rows: torch.Tensor) -> None:
        """The online key transform (``Transforms.key_rows``' bits), in place on float32 key rows ``[N, D]``."""
        if self._key_online[layer]:
            from oakenkv.kernels.triton.rotate import shift_rotate_rows

            shift_rotate_rows(rows, self._key_shifts[layer], self._key_rotation[layer], self.head_dim)

    def _append_token(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        from oakenkv.kernels.triton.encode import encode_records

        if layer in self._pending_layers:  # a new step: the host learns the last one's lengths (one copy)
            self.settle()
        b = len(self.seqs)
        m = 2 * b
        lt = self.tables[layer]
        t = lt.num_tokens
        placed = self.pool.reserve_tokens(self._targets[layer], self.rec_size, self.capacity)
        dense_at, sparse_at, new_page, cows = placed
        stage = self._stage[layer]
        stage_np = stage.numpy()
        stage_np[0] = dense_at
        stage_np[1] = sparse_at
        off = self._offsets[layer]
        off.copy_(stage, non_blocking=True)  # pinned on CUDA: no sync (settle() syncs before the stage is reused)
        rows = self._rows
        rows[:b].copy_(keys.reshape(b, self.dim))
        rows[b:].copy_(values.reshape(b, self.dim))
        self._transform_keys(layer, rows[:b])
        if t < self._sink_end:
            if not self._own_starts:
                self.sinks[layer][:, :, t] = rows.view(2, b, self.dim).transpose(0, 1).to(torch.float16)
            else:
                for r, _, _, j in self._sink_slices(t, 1):
                    self.sinks[layer][r, :, j] = rows.view(2, b, self.dim)[:, r].to(torch.float16)
        counts = self._sync[layer * m : (layer + 1) * m]
        encode_records(
            rows, self._thr_rows[layer], self.config, records=self.bytes, record_offsets=off[0], sparse=self.bytes,
            sparse_offsets=off[1], counts=counts, check=False, **self._blocks["encode"],
        )  # fmt: skip
        lt.ensure(t + 1, self.rpp)
        ps = self.pool.config.page_size
        lt.dense_pages[:, :, t // self.rpp] = torch.div(off[0], ps, rounding_mode="floor").to(torch.int32).view(2, b).T
        lt.sparse_addr[:, :, t] = off[1].view(2, b).T
        lt.sparse_lengths[:, :, t] = counts.view(2, b).T
        lt.num_tokens = t + 1
        self._pending.append((layer, sparse_at, new_page))
        self._pending_layers.add(layer)
        for k, first in cows:  # a shared last sparse page copied on write: its earlier tokens moved (rare)
            self._resync_addresses(layer, k % b, k // b, first, t)

    def _resync_addresses(self, layer: int, row: int, kind: int, start: int, stop: int) -> None:
        """Rewrite the device sparse addresses of tokens ``[start, stop)`` of one stream from the host tables."""
        if stop <= start:
            return
        table = self.pool.table(self.seqs[row], 2 * layer + kind)
        addr = stream_addresses(table, self.pool.config.page_size, start, stop)
        self.tables[layer].sparse_addr[row, kind, start:stop] = torch.from_numpy(addr).to(self.device)

    def _append_chunk(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store a chunk of tokens ``[B, H, S, hd]`` of one layer, atomically: encode on the device into scratch,
        one copy of the lengths to the host, placement by the pool (the CPU store's), the bytes copied into place."""
        from oakenkv.kernels.triton.encode import copy_spans, encode_records

        self.settle()
        b, _, s, _ = keys.shape
        n, d, dev = b * s, self.dim, self.device
        rows = torch.empty((2, b, s, d), dtype=torch.float32, device=dev)
        rows[0].copy_(keys.transpose(1, 2).reshape(b, s, d))
        rows[1].copy_(values.transpose(1, 2).reshape(b, s, d))
        flat = rows.view(2 * n, d)
        self._transform_keys(layer, flat[:n])
        lt = self.tables[layer]
        past = lt.num_tokens
        sink_at = self._sink_slices(past, s)
        # [2n, 4] (8 under adaptive grouping): keys' rows, then values'
        thr = torch.from_numpy(self._encode_thr(layer)).to(dev).repeat_interleave(n, dim=0)
        records, sparse, counts = encode_records(flat, thr, self.config, check=False, **self._blocks["encode"])
        counts_h = counts.cpu().numpy().astype(np.int64)  # the chunk's one device-to-host copy
        _check_encoded_rows(counts_h, s)
        items = []
        for kind in (KEY, VALUE):
            for r, seq in enumerate(self.seqs):
                a = (kind * b + r) * s
                items.append((seq, 2 * layer + kind, self.rec_size, counts_h[a : a + s]))
        placed = self.pool.place_many(items)  # atomic: raises PoolExhaustedError before any change
        dense_at = torch.from_numpy(np.concatenate([p[0] for p in placed])).to(dev)
        sparse_at = torch.from_numpy(np.concatenate([p[1] for p in placed])).to(dev)
        # the records and the streams into their pages: one program per record (copy_spans)
        rec, cap = self.rec_size, sparse.shape[1]
        src = torch.arange(2 * n, dtype=torch.int64, device=dev)
        copy_spans(records.view(-1), src * rec, self.bytes, dense_at, torch.full_like(counts, rec))
        copy_spans(sparse.view(-1), src * cap, self.bytes, sparse_at, counts)
        lt.ensure(past + s, self.rpp)
        lt.sparse_addr[:, :, past : past + s] = sparse_at.view(2, b, s).transpose(0, 1)
        lt.sparse_lengths[:, :, past : past + s] = counts.view(2, b, s).transpose(0, 1)
        p0, p1 = past // self.rpp, -(-(past + s) // self.rpp)
        pages = np.empty((b, 2, p1 - p0), np.int32)
        for kind in (KEY, VALUE):
            for r, seq in enumerate(self.seqs):
                pages[r, kind] = self.pool.table(seq, 2 * layer + kind).dense_pages.buf[p0:p1]
        lt.dense_pages[:, :, p0:p1] = torch.from_numpy(pages).to(dev)
        lt.num_tokens = past + s
        for i, (_, _, cow_from) in enumerate(placed):
            if cow_from < past:  # the last sparse page was copied on write: its earlier tokens moved
                self._resync_addresses(layer, i % b, i // b, cow_from, past)
        for r, a, e, j in sink_at:  # (after the pages took the tokens: the append stays atomic)
            self.sinks[layer][r, :, j : j + e - a] = rows[:, r, a:e].to(torch.float16)
        if self.adapt_state is not None:
            self._adapt_record(layer, s, counts_h)

    def settle(self) -> None:
        """Bring the host tables up to the device after decode steps: one device-to-host copy of every pending
        layer's sparse lengths and of the attention's error codes; then raise for an error the kernels reported
        (module doc)."""
        if not self._pending:
            return
        host = self._sync.cpu().numpy()
        pending, self._pending = self._pending, []
        self._pending_layers.clear()
        m = 2 * len(self.seqs)
        errors = []
        for layer, sparse_at, new_page in pending:
            counts = host[layer * m : (layer + 1) * m].astype(np.int64)
            bad = counts < 0
            if bad.any():
                errors.append((layer, counts.copy()))
                counts[bad] = 0
            self.pool.settle_tokens(self._targets[layer], counts, sparse_at, new_page)
            if self.adapt_state is not None:  # the step's counts; at an epoch's end the layer's grouping moves
                self._adapt_record(layer, 1, counts)
        status = int(host[-1])
        if status:
            self._status.zero_()
            raise CorruptDataError(f"{ERROR_MESSAGES[status]} (packed KV pages, device attention)")
        if errors:
            layer, counts = errors[0]
            try:
                _check_encoded_rows(counts, 1)
            except ValueError as e:
                raise ValueError(f"layer {layer}: {e} (the cache must be reset)") from None

    def _adapt_record(self, layer: int, tokens: int, counts: np.ndarray) -> None:
        """Feed ``tokens`` new tokens' sparse bytes of ``layer`` (int64 ``[2 B tokens]``: keys' rows, then values')
        to the adaptive state; where an epoch ended, the layer's decode-step thresholds on the device follow."""
        b = len(self.seqs)
        n = b * tokens
        state = self.adapt_state
        moved = [state.record(layer, kind, tokens, int(counts[kind * n : (kind + 1) * n].sum()), n * self.dim)
                 for kind in (KEY, VALUE)]  # fmt: skip
        if any(moved):
            g = torch.from_numpy(self._encode_thr(layer)).to(self.device)
            self._thr_rows[layer] = g.repeat_interleave(b, dim=0)

    # ---------------------------------------------------------------------------------------------- reads

    def view(self, layer: int):
        """The layer's :class:`~oakenkv.kernels.triton.view.DeviceLayerView`: the device tables, sliced (no copy)."""
        from oakenkv.kernels.triton.view import DeviceLayerView

        lt = self.tables[layer]
        t = lt.num_tokens
        cfg = self.config
        return DeviceLayerView(
            dense_pool=self.bytes,
            sparse_pool=self.bytes,
            page_size=self.pool.config.page_size,
            record_size=self.rec_size,
            scale_bytes=self.scale_bytes,
            dense_pages=lt.dense_pages[:, :, : -(-t // self.rpp)],
            sparse_addr=lt.sparse_addr[:, :, :t],
            sparse_lengths=lt.sparse_lengths[:, :, :t],
            thresholds=self.thr_device[layer],
            inner_bits=cfg.inner_bits,
            outer_bits=cfg.outer_bits,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
        )

    def _watermark(self, layer: int, kind: int) -> int:
        return self.pool.table(self.seqs[0], 2 * layer + kind).evicted_before if self.seqs else 0

    def read(self, layer: int, kind: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dequantize one layer's stored keys or values on the device: ``[B, H, T, hd]``, the floats of
        ``PagedKVStore.read`` (tokens below a sliding window's watermark as zeros, sink tokens at 16 bits, keys
        rotated back under an oaken-plus rotation)."""
        from oakenkv.kernels.triton.decode import read_view

        if not self.seqs or self.tables[layer].num_tokens == 0:
            b = len(self.seqs)
            return torch.zeros((b, self.num_kv_heads, 0, self.head_dim), dtype=dtype, device=self.device)
        x = read_view(self.view(layer), kind, **self._blocks["read"])
        wm = self._watermark(layer, kind)
        if wm:
            x[:, :, :wm] = 0.0
        x = self.apply_sinks(layer, kind, x, wm)
        if kind == KEY:
            x = self.restore_keys(layer, x)
        return x.to(dtype)

    def apply_sinks(self, layer: int, kind: int, x: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Put the layer's sink tokens into ``x`` (``[B, H, T, hd]``, in the pages' frame) from token ``start`` on."""
        t = x.shape[2]
        if not self._own_starts:
            n = min(self.sink_tokens, t)
            if n <= start:
                return x
            sink = self.sinks[layer][:, kind, start:n].to(x.dtype)  # [B, n', D]
            x[:, :, start:n] = sink.view(x.shape[0], n - start, self.num_kv_heads, self.head_dim).transpose(1, 2)
            return x
        for r, a, e, j in self._sink_slices(start, t - start):
            sink = self.sinks[layer][r, kind, j : j + e - a].to(x.dtype)  # [n', D]
            x[r, :, start + a : start + e] = sink.view(e - a, self.num_kv_heads, self.head_dim).transpose(0, 1)
        return x

    def set_row_starts(self, starts: np.ndarray | list[int]) -> None:
        """Declare where each batch row's real tokens begin (its first sink token): int ``[B]``, from the attention
        mask (``oakenkv.hf.cache``); ``PagedKVStore.set_row_starts``' rule: a row whose first sink token is already
        stored keeps the start it was stored with."""
        held = self.num_tokens(0) if self.seqs else 0
        self._use_starts(checked_row_starts(starts, len(self.seqs), held, self.row_starts))

    def _use_starts(self, starts: np.ndarray | None) -> None:
        """Take ``starts`` (None: every row's sinks at tokens 0..) as the rows' starts."""
        self.row_starts = starts
        self._own_starts = starts is not None and bool(starts.any())
        self._starts_device = None  # (made on the first attention that needs it)
        self._sink_end = (0 if starts is None else int(starts.max(initial=0))) + self.sink_tokens

    def _sink_slices(self, past: int, s: int) -> list[tuple[int, int, int, int]]:
        """Where the sink tokens fall in tokens ``[past, past + s)`` of every row: ``(row, a, e, j)`` for tokens
        ``[past + a, past + e)`` of ``row``, its sink tokens ``j, j + 1, ...`` (``paged.sink_slices``)."""
        return sink_slices(self.row_starts, len(self.seqs), self.sink_tokens, self._sink_end, past, s)

    def _split_sinks(self, keep: torch.Tensor, t_n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows with their own starts: ``keep`` (uint8 ``[B, S, T]``, 1 = attend) as ``(keep with every row's sink
        positions cleared, uint8 [B, S, sink_tokens]: the mask of each row's sink tokens ``j`` (0 for sink tokens
        not stored yet))``, on the device."""
        n = self.sink_tokens
        if self._starts_device is None:
            self._starts_device = torch.from_numpy(self.row_starts).to(keep.device)
        p = self._starts_device[:, None]  # [B, 1]
        pos = torch.arange(t_n, device=keep.device)[None, :]
        at_sink = (pos >= p) & (pos < p + n)  # [B, T]
        idx = p + torch.arange(n, device=keep.device)[None, :]  # [B, n]
        stored = (idx < t_n)[:, None, :]
        sink_keep = keep.gather(2, idx.clamp(max=t_n - 1)[:, None, :].expand(-1, keep.shape[1], -1)) * stored
        return keep * at_sink.logical_not()[:, None, :].to(keep.dtype), sink_keep.to(torch.uint8)

    def restore_keys(self, layer: int, keys: torch.Tensor) -> torch.Tensor:
        """Keys ``[..., hd]`` (float32) in the model's frame: an oaken-plus rotation undone (its own inverse)."""
        return self.rotate(layer, keys)

    def rotate(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """``x [..., hd]`` rotated per head like this layer's stored keys (queries before attention; keys back to
        the model's frame: the rotation is its own inverse); ``x`` itself without a key rotation."""
        if self.transforms is None or not self._key_rotation[layer]:
            return x
        from oakenkv.kernels.triton.rotate import shift_rotate_rows

        rows = x.to(torch.float32).reshape(-1, self.head_dim).contiguous()
        if rows.data_ptr() == x.data_ptr():
            rows = rows.clone()
        return shift_rotate_rows(rows, None, True, self.head_dim).view(x.shape)

    # ---------------------------------------------------------------------------------------------- attention

    def attention(
        self,
        query: torch.Tensor,
        layer: int,
        attention_mask: torch.Tensor | None,
        scaling: float,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Attention of queries ``[B, Hq, S, hd]`` (post-RoPE) over the layer's pages, every stored token included
        (the last ``S`` are the queries' own): decode (``S == 1``, flash-decoding) or prefill (the flash-attention
        kernel over pages). Mask as transformers hands it (``[B, 1, S, T]`` bool or additive, or None: causal).
        Returns ``[B, S, Hq, hd]`` in the query's dtype. Error codes are read at the next :meth:`settle`."""
        from oakenkv.kernels.triton import attention as tattn
        from oakenkv.kernels.triton import prefill as tpre

        b, hq, s, hd = query.shape
        if b != len(self.seqs) or hd != self.head_dim or hq % self.num_kv_heads:
            raise ValueError(
                f"query [B={b}, Hq={hq}, S={s}, hd={hd}] does not fit the cache (batch {len(self.seqs)}, "
                f"{self.num_kv_heads} KV heads, head_dim {self.head_dim})"
            )
        t_n = self.tables[layer].num_tokens
        if s > t_n:
            raise ValueError(f"{s} queries but the layer holds {t_n} tokens: append the chunk first")
        q = self.rotate(layer, query.to(torch.float32))
        view = self.view(layer)
        n_sink = min(self.sink_tokens, t_n)
        if n_sink and self._own_starts:
            return self._attention_own_starts(q, layer, view, attention_mask, scaling, softcap).to(query.dtype)
        if s == 1:
            keep = tattn.keep_from_mask(attention_mask, b, t_n, query.device)
            if keep is None:
                keep = torch.ones((b, t_n), dtype=torch.uint8, device=query.device)
            sink_keep = None
            if n_sink:
                sink_keep = keep[:, :n_sink].clone()
                keep = keep.clone()
                keep[:, :n_sink] = 0
            out, lse, _ = tattn.paged_decode_attention_parts(
                q[:, :, 0], view, keep, scaling, softcap, status=self._status, **self._blocks["attention"]
            )
            if n_sink:
                out, lse = self._merge_sinks(layer, q, out[:, :, None], lse[:, :, None], sink_keep[:, None, :],
                                             scaling, softcap)  # fmt: skip
                out = out[:, :, 0]
            return out[:, None].to(query.dtype)
        past = t_n - s
        mask = tpre.prefill_mask(attention_mask, b, s, t_n, query.device)
        dot = tpre.dot_kind(query.dtype)
        out, lse, _ = tpre.paged_prefill_attention(
            q, view, past, mask, scaling, softcap, skip=n_sink, dot=dot, status=self._status, **self._blocks["prefill"]
        )
        if n_sink:
            if mask is not None:
                sink_keep = mask[:, :, :n_sink]
            else:
                pos = past + torch.arange(s, device=query.device)
                sink_keep = (torch.arange(n_sink, device=query.device)[None, :] <= pos[:, None]).expand(b, s, n_sink)
            out, lse = self._merge_sinks(layer, q, out, lse, sink_keep, scaling, softcap)
        return out.transpose(1, 2).to(query.dtype)

    def _attention_own_starts(self, q, layer, view, attention_mask, scaling, softcap) -> torch.Tensor:
        """:meth:`attention` when rows have their own sink positions (:meth:`set_row_starts`): an explicit mask
        with every row's sink positions cleared for the pages' part, their mask gathered for the 16-bit part.
        Returns float32 ``[B, S, Hq, hd]``."""
        from oakenkv.kernels.triton import attention as tattn
        from oakenkv.kernels.triton import prefill as tpre

        b, _, s, _ = q.shape
        t_n = self.tables[layer].num_tokens
        past = t_n - s
        dev = q.device
        if s == 1:
            keep = tattn.keep_from_mask(attention_mask, b, t_n, dev)
            keep = torch.ones((b, 1, t_n), dtype=torch.uint8, device=dev) if keep is None else keep[:, None]
        else:
            keep = tpre.prefill_mask(attention_mask, b, s, t_n, dev)
            if keep is None:  # causal, the chunk at positions past ..
                pos = past + torch.arange(s, device=dev)
                keep = (torch.arange(t_n, device=dev)[None, :] <= pos[:, None]).to(torch.uint8)
                keep = keep[None].expand(b, s, t_n)
        page_keep, sink_keep = self._split_sinks(keep, t_n)
        if s == 1:
            out, lse, _ = tattn.paged_decode_attention_parts(
                q[:, :, 0],
                view,
                page_keep[:, 0].contiguous(),
                scaling,
                softcap,
                status=self._status,
                **self._blocks["attention"],
            )
            out, lse = out[:, :, None], lse[:, :, None]
        else:
            dot = tpre.dot_kind(q.dtype)
            out, lse, _ = tpre.paged_prefill_attention(
                q,
                view,
                past,
                page_keep.contiguous(),
                scaling,
                softcap,
                dot=dot,
                status=self._status,
                **self._blocks["prefill"],
            )
        out, _ = self._merge_sinks(layer, q, out, lse, sink_keep, scaling, softcap)
        return out.transpose(1, 2)

    def _merge_sinks(self, layer, q, out, lse, keep, scaling, softcap):
        """Merge the sink tokens' part (16-bit keys and values, ``keep [B, S, n]``) into attention ``out [B, Hq, S,
        hd]`` with log-sum-exp ``lse [B, Hq, S]``: float32, on the device."""
        from oakenkv.kernels.triton.prefill import merge_lse, sink_attention

        b, _, _, hd = q.shape
        n = keep.shape[-1]
        h = self.num_kv_heads
        sk = self.sinks[layer][:, KEY, :n].to(torch.float32).view(b, n, h, hd).transpose(1, 2)  # [B, H, n, hd]
        sv = self.sinks[layer][:, VALUE, :n].to(torch.float32).view(b, n, h, hd).transpose(1, 2)
        out_s, lse_s = sink_attention(q, sk, sv, keep, scaling, softcap)
        return merge_lse(out, lse, out_s, lse_s)

    # ---------------------------------------------------------------------------------------------- policies

    def evict_before(self, layer: int, token: int) -> int:
        """Release the pages of one layer (keys and values, every row) that hold only tokens below ``token``; the
        device tables mark their slots and addresses ``EVICTED``. Returns the table slots released."""
        released = 0
        lt = self.tables[layer] if self.seqs else None
        if layer in self._pending_layers:
            # the pending token's sparse page may be given back at settle (an empty record): the page before it
            # must then stay, as the stream's last
            token = min(token, lt.num_tokens - 1)
        for r, seq in enumerate(self.seqs):
            for kind in (KEY, VALUE):
                stream = 2 * layer + kind
                n = self.pool.evict_before(seq, stream, token)
                if n:
                    table = self.pool.table(seq, stream)
                    gone = int(np.count_nonzero(table.dense_pages.view == EVICTED))
                    lt.dense_pages[r, kind, :gone] = EVICTED
                    gone = int(np.count_nonzero(table.sparse_pages.view == EVICTED))
                    if gone:  # the tokens before the first live sparse page (the last page is never released)
                        lt.sparse_addr[r, kind, : int(table.sparse_first.buf[gone])] = EVICTED
                released += n
        return released

    def reorder(self, index: list[int]) -> None:
        """New row ``i`` = old row ``index[i]`` (beam search, batch selection): forks and frees, the device tables
        gathered, no KV bytes copied."""
        if not self.seqs:
            return
        if any(not 0 <= j < len(self.seqs) for j in index):
            raise IndexError(f"reorder index {index} out of range for {len(self.seqs)} rows")
        self.settle()
        new = self.pool.reorder(self.seqs, index)
        self._set_rows(new, list(index))
        if self.row_starts is not None:
            self._use_starts(self.row_starts[index])

    def reset(self) -> None:
        for seq in self.seqs:
            self.pool.free(seq)
        self.seqs = []
        self.tables = []
        self._targets = []
        self.sinks = []
        self._pending = []
        self._pending_layers.clear()
        self._use_starts(None)
        if self.adapt_state is not None:
            self.adapt_state.reset()

    # ---------------------------------------------------------------------------------------------- accounting

    def sink_bytes(self) -> int:
        if not self.sink_tokens or not self.seqs:
            return 0
        held = sum(e - a for lt in self.tables for _, a, e, _ in self._sink_slices(0, lt.num_tokens))
        return 2 * held * self.dim * 2

    def window_bytes(self) -> int:
        return 0

    def stats(self) -> PoolStats:
        self.settle()
        stats = self.pool.stats()
        if self.sink_tokens:
            stats = dataclasses.replace(stats, sink_bytes=self.sink_bytes())
        return stats

    def bits_per_value(self) -> dict[str, float]:
        """:meth:`PagedKVStore.bits_per_value`: the format's bits, and everything held (pages in use, tables)."""
        self.settle()
        pool = self.pool
        tokens = dense = sparse = 0
        for seq in self.seqs:
            for stream in range(pool.num_streams(seq)):
                t = pool.table(seq, stream)
                tokens += t.num_tokens
                dense += t.num_tokens * t.rec_size
                sparse += int(t.sparse_len.view.sum())
        values = tokens * self.dim
        if values == 0:
            return {"format": float("nan"), "with_pages": float("nan")}
        header = 2 * tokens  # the 16-bit length of every record
        return {
            "format": 8.0 * (dense + sparse + header + self.sink_bytes()) / values,
            "with_pages": 8.0 * self.stats().total_bytes / values,
        }

    def check_tables(self) -> None:
        """Assert that every layer's device tables equal the host tables (for tests)."""
        self.settle()
        ps = self.pool.config.page_size
        for layer, lt in enumerate(self.tables):
            dense = lt.dense_pages.cpu().numpy()
            addr = lt.sparse_addr.cpu().numpy()
            lens = lt.sparse_lengths.cpu().numpy()
            for r, seq in enumerate(self.seqs):
                for kind in (KEY, VALUE):
                    t = self.pool.table(seq, 2 * layer + kind)
                    where = f"layer {layer} row {r} kind {kind}"
                    n = t.num_tokens
                    assert lt.num_tokens == n, f"{where}: {lt.num_tokens} != {n} tokens"
                    assert np.array_equal(dense[r, kind, : t.dense_pages.n], t.dense_pages.view), where
                    assert np.array_equal(lens[r, kind, :n], t.sparse_len.view.astype(np.int32)), where
                    want = stream_addresses(t, ps, 0, n)
                    stored = t.sparse_len.view > 0  # (an empty record's address is never read)
                    assert np.array_equal(addr[r, kind, :n][stored], want[stored]), f"{where}: sparse addresses"
