"""The one builder of the kernels' view of a layer: :class:`LayerTables`, and the
:class:`~oakenkv.format.layout.LayerView` it makes.

A decode kernel (``oakenkv.kernels.cpu.attention``, the Triton kernels through ``from_layer_view``) reads one layer's
keys and values of every batch row through a ``LayerView``: the pool's bytes plus page tables stacked per row and
kind. Two stores fill those tables:

- ``oakenkv.store.paged.PagedKVStore`` mirrors its page pool's stream tables (``oakenkv.store.pages``) into one
  :class:`LayerTables` per layer, updated by every write (:meth:`LayerTables.sync`);
- the vLLM plugin (``oakenkv.integrations.vllm``) fills them from vLLM's block tables (:meth:`LayerTables.fill_blocks`:
  a block of ``B`` tokens holds each kind's dense records back to back and one sparse page per kind), a row at a
  time and only from the first token that changed.

Both then call :meth:`LayerTables.view`; nothing else builds a ``LayerView``.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from oakenkv.format.layout import NO_STATIC_GRID, LayerView


def grown(a: np.ndarray, size: int, axis: int = -1) -> np.ndarray:
    """``a`` with axis ``axis`` at least ``size`` long (doubling), contents kept."""
    axis = axis % a.ndim
    if a.shape[axis] >= size:
        return a
    shape = list(a.shape)
    shape[axis] = max(size, 2 * a.shape[axis])
    new = np.zeros(shape, dtype=a.dtype)
    new[tuple(slice(0, n) for n in a.shape)] = a
    return new


class LayerTables:
    """One layer's page tables of every batch row, stacked the way a decode kernel reads them (the fields of
    :class:`~oakenkv.format.layout.LayerView`: ``B`` rows, kind 0 keys / 1 values).

    Kept current by the store that owns them, so a decode step hands the kernel these arrays as they are: no table
    is rebuilt or copied per step. Capacities double as the layer grows; entries past a stream's live part are
    meaningless. The arrays may be shared between layers whose pages are laid out alike (the vLLM plugin: every
    layer's blocks have the same page ids; only the sparse lengths differ per layer).
    """

    __slots__ = ("dense_pages", "num_tokens", "sparse_counts", "sparse_first", "sparse_lengths", "sparse_pages")

    def __init__(self, batch: int) -> None:
        #: Tokens stored in every stream of the layer (the longest row, where rows differ: a mask hides the rest).
        self.num_tokens = 0
        #: int32 ``[B, 2, >= ceil(T / rpp)]``: dense page ids in token order.
        self.dense_pages = np.zeros((batch, 2, 4), np.int32)
        #: int32 ``[B, 2, >= max sparse pages]``: sparse page ids, and the first token of each.
        self.sparse_pages = np.zeros((batch, 2, 4), np.int32)
        self.sparse_first = np.zeros((batch, 2, 4), np.int32)
        #: int64 ``[B, 2]``: sparse pages of each stream.
        self.sparse_counts = np.zeros((batch, 2), np.int64)
        #: uint16 ``[B, 2, >= T]``: sparse record length of every token.
        self.sparse_lengths = np.zeros((batch, 2, 64), np.uint16)

    @property
    def rows(self) -> int:
        return self.dense_pages.shape[0]

    def sync(self, b: int, kind: int, table, dense_from: int, sparse_from: int, token_from: int) -> None:
        """Copy stream ``(b, kind)``'s pool tables (an ``oakenkv.store.pages.StreamTable``) from dense page
        ``dense_from``, sparse page ``sparse_from`` and token ``token_from`` on (what a write may have changed); the
        rest is already current."""
        dp, sp, n = table.dense_pages, table.sparse_pages, table.num_tokens
        self.dense_pages = grown(self.dense_pages, dp.n)
        self.dense_pages[b, kind, dense_from : dp.n] = dp.buf[dense_from : dp.n]
        self.sparse_pages = grown(self.sparse_pages, sp.n)
        self.sparse_first = grown(self.sparse_first, sp.n)
        self.sparse_pages[b, kind, sparse_from : sp.n] = sp.buf[sparse_from : sp.n]
        self.sparse_first[b, kind, sparse_from : sp.n] = table.sparse_first.buf[sparse_from : sp.n]
        self.sparse_counts[b, kind] = sp.n
        self.sparse_lengths = grown(self.sparse_lengths, n)
        self.sparse_lengths[b, kind, token_from:n] = table.sparse_len.buf[token_from:n]

    def reserve(self, rows: int, tokens: int, pages: int) -> None:
        """Room for ``rows`` rows of ``tokens`` dense pages (and token lengths) and ``pages`` sparse pages per
        stream (contents kept)."""
        self.dense_pages = grown(grown(self.dense_pages, rows, 0), tokens)
        self.sparse_pages = grown(grown(self.sparse_pages, rows, 0), pages)
        self.sparse_first = grown(grown(self.sparse_first, rows, 0), pages)
        self.sparse_counts = grown(self.sparse_counts, rows, 0)
        self.sparse_lengths = grown(grown(self.sparse_lengths, rows, 0), tokens)

    def fill_blocks(
        self,
        block_table: np.ndarray,
        seq_lens: np.ndarray,
        from_tokens: np.ndarray,
        units_per_block: int,
        block_size: int,
        sparse_unit: tuple[int, int],
    ) -> None:
        """Fill the page tables (not the sparse lengths) of rows stored in blocks: page ``size = record`` bytes,
        block ``j`` of a row starts at page ``block_table[r, j] * units_per_block``, its tokens' dense records of
        kind ``k`` are pages ``k * block_size + offset`` after it, and its sparse records of kind ``k`` are one page
        at ``sparse_unit[k]`` after it, whose first token is the block's first.

        Args:
            block_table: int32 ``[R, >= blocks]``; seq_lens: int ``[R]`` tokens of each row.
            from_tokens: int ``[R]``: row ``r``'s entries before token ``from_tokens[r]`` are current (0: fill the
                whole row).
        """
        rows = seq_lens.shape[0]
        t_max = int(seq_lens.max()) if rows else 0
        self.reserve(rows, t_max, -(-t_max // block_size))
        _fill_blocks(
            np.ascontiguousarray(block_table, np.int32), np.ascontiguousarray(seq_lens, np.int64),
            np.ascontiguousarray(from_tokens, np.int64), units_per_block, block_size, sparse_unit[0], sparse_unit[1],
            self.dense_pages, self.sparse_pages, self.sparse_first, self.sparse_counts,
        )  # fmt: skip
        self.num_tokens = t_max

    def share_pages(self, other: LayerTables) -> None:
        """Take ``other``'s page tables (the same arrays, not copies); keep this layer's sparse lengths."""
        self.dense_pages, self.sparse_pages = other.dense_pages, other.sparse_pages
        self.sparse_first, self.sparse_counts = other.sparse_first, other.sparse_counts
        self.num_tokens = other.num_tokens
        self.sparse_lengths = grown(grown(self.sparse_lengths, other.rows, 0), other.dense_pages.shape[2])

    def view(
        self,
        pool: np.ndarray,
        page_size: int,
        record_size: int,
        scale_bytes: int,
        thresholds: np.ndarray,
        inner_bits: int,
        outer_bits: int,
        num_kv_heads: int,
        rows: int | None = None,
        middle_bits: int = 4,
        static_grid: np.ndarray = NO_STATIC_GRID,
    ) -> LayerView:
        """The :class:`LayerView` of these tables over ``pool`` (the storage, flat uint8), with the layer's
        ``thresholds`` (float32 ``[2, 4]``) and format (``middle_bits``: the dense slot width; ``static_grid``:
        float32 ``[2, 4]``, the static grids of records holding the outer scales only, ``[2, 4 L]`` the static
        levels' grids of records holding a level byte too, or ``[2, 0]``); the first
        ``rows`` rows only, when given (views, no copy). Valid until the tables' next write."""
        if rows is None:
            dp, sp, sf, sc, sl = (
                self.dense_pages, self.sparse_pages, self.sparse_first, self.sparse_counts, self.sparse_lengths,
            )  # fmt: skip
        else:
            dp, sp, sf = self.dense_pages[:rows], self.sparse_pages[:rows], self.sparse_first[:rows]
            sc, sl = self.sparse_counts[:rows], self.sparse_lengths[:rows]
        return LayerView(
            pool, page_size, record_size, scale_bytes, self.num_tokens, dp, sp, sf, sc, sl, thresholds, inner_bits,
            outer_bits, num_kv_heads, middle_bits, static_grid,
        )  # fmt: skip


@njit(cache=True, nogil=True)
def _fill_blocks(block_table, seq_lens, from_tokens, upb, bs, sparse_k, sparse_v, dense_pages, sparse_pages,
                 sparse_first, sparse_counts):  # fmt: skip
    """:meth:`LayerTables.fill_blocks` (its docstring)."""
    for r in range(seq_lens.shape[0]):
        length = seq_lens[r]
        t0 = min(from_tokens[r], length)
        nb = (length + bs - 1) // bs
        for j in range(t0 // bs, nb):
            base = np.int64(block_table[r, j]) * upb
            sparse_pages[r, 0, j] = base + sparse_k
            sparse_pages[r, 1, j] = base + sparse_v
            sparse_first[r, 0, j] = j * bs
            sparse_first[r, 1, j] = j * bs
        sparse_counts[r, 0] = nb
        sparse_counts[r, 1] = nb
        for t in range(t0, length):
            u = np.int64(block_table[r, t // bs]) * upb + t % bs
            dense_pages[r, 0, t] = u
            dense_pages[r, 1, t] = u + bs


__all__ = ["LayerTables", "grown"]
