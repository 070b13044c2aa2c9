"""The paged K/V store: every layer's keys and values of a batch in one page pool, in the Oaken format.

:class:`PagedKVStore` owns what a cache needs below the transformers adapter (``oakenkv.cache``): the page pool
(``oakenkv.pages``: one sequence per batch row, ``stream = 2 * layer + kind`` with kind ``KEY`` = 0 and ``VALUE``
= 1), the codec (the fast numba pair or the plain PyTorch reference), the thresholds as kernels want them, the
policy for when numba runs on one thread, and the per-layer :class:`~oakenkv.format.LayerView` that a decode
kernel reads (:meth:`PagedKVStore.layer_view`). A token's row is all KV heads of the layer (``D = num_kv_heads *
head_dim``, granularity "token", the paper's); its bytes are the page records of ``oakenkv.format``.

Writes are atomic per layer: an append that the pool's budget cannot hold raises
:class:`~oakenkv.pages.PoolExhaustedError` and changes nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from oakenkv.config import OakenConfig
from oakenkv.format import (
    ERROR_MESSAGES,
    HEADER_BITS,
    EncodedBatch,
    LayerView,
    from_records,
    record_size,
    scale_bytes,
    sparse_capacity,
    to_records,
)
from oakenkv.kernels.cpu import encode_records
from oakenkv.pages import PagePool, PoolConfig, PoolStats
from oakenkv.thresholds import Thresholds
from oakenkv.transforms import fwht

KEY, VALUE = 0, 1
#: Names of the two kinds, indexed by ``KEY`` / ``VALUE`` (as ``Thresholds.layer`` spells them).
KINDS = ("key", "value")

#: Below this many rows a numba call runs on one thread: waking the thread pool costs more than the work
#: (measured in ``docs/perf-notes.md``).
SERIAL_BELOW_ROWS = 1024


@contextlib.contextmanager
def serial_numba(active: bool = True) -> Iterator[None]:
    """Run the numba kernels called inside the block on the calling thread only (when ``active``)."""
    if not active:
        yield
        return
    import numba

    previous = numba.get_num_threads()
    if previous == 1:
        yield
        return
    numba.set_num_threads(1)
    try:
        yield
    finally:
        numba.set_num_threads(previous)


Encoder = Callable[[torch.Tensor, Any, OakenConfig], EncodedBatch]
Decoder = Callable[[EncodedBatch, Any, OakenConfig], torch.Tensor]


def codec_functions(kind: str) -> tuple[Encoder, Decoder]:
    """``(encode, decode)``: the fast numba pair (``"auto"``, ``"fast"``: ``oakenkv.codec``) or the plain PyTorch
    reference pair (``"reference"``: ``oakenkv.reference``). Both give identical bytes and numbers."""
    if kind not in ("auto", "fast", "reference"):
        raise ValueError(f"codec must be 'auto', 'fast' or 'reference', got {kind!r}")
    if kind == "reference":
        from oakenkv import reference

        return reference.encode, reference.decode
    from oakenkv import codec

    return codec.encode, codec.decode


class PagedKVStore:
    """The state all layers of one :class:`OakenCache` share: the page pool, one sequence per batch row, the codec.

    Args:
        thresholds: the model's profile (per layer and kind).
        num_layers, num_kv_heads, head_dim: the decoder's KV shape.
        pool_config: page size and memory budget.
        codec: "auto" or "fast" (the numba kernels), or "reference" (plain PyTorch: slow, the same bytes).
        prefill_chunk: tokens encoded per chunk of a long update.
    """

    def __init__(
        self,
        thresholds: Thresholds,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        pool_config: PoolConfig | None = None,
        codec: str = "auto",
        prefill_chunk: int = 256,
    ) -> None:
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
        if not isinstance(prefill_chunk, int) or prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be a positive int, got {prefill_chunk!r}")
        self.thresholds = thresholds
        self.config = config
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dim = num_kv_heads * head_dim
        #: Bytes of one dense page record, and of the scales at its start (``oakenkv.format``).
        self.rec_size = record_size(self.dim, config)
        self.scale_bytes = scale_bytes(config)
        self.pool = PagePool(pool_config)
        self.encode, self.decode = codec_functions(codec)
        #: Whether the numba kernels are in use (then a decode step takes the fused single-token path).
        self.fast = codec != "reference"
        self._token_scratch: tuple[np.ndarray, ...] | None = None
        self.prefill_chunk = prefill_chunk
        #: Pool sequence id of each batch row.
        self.seqs: list[int] = []
        #: float32 ``[num_layers, 2, 4]``: ``(to_lo, ti_lo, ti_hi, to_hi)`` per layer and kind, for kernels.
        self.thr = np.array(
            [[thresholds.layer(i, k).as_tuple() for k in KINDS] for i in range(num_layers)], dtype=np.float32
        )
        #: The online part of an ``oaken-plus`` profile (``oakenkv.transforms``): None without one; else which
        #: layers transform their keys, and the float32 key shifts ``[num_layers, D]``.
        self.transforms = thresholds.transforms if thresholds.transforms and thresholds.transforms.online_keys else None
        if self.transforms is not None:
            t = self.transforms
            self._key_online = [lt.key_shift is not None or lt.key_rotation for lt in t.layers]
            self._key_shifts = t.key_shifts()

    def _transform_keys(self, layer: int, rows: np.ndarray) -> None:
        """The profile's online key transform (``Transforms.key_rows``), in place, on float32 key rows ``[N, D]``.
        No-op without an oaken-plus profile."""
        if self.transforms is not None and self._key_online[layer]:
            self.transforms.key_rows(layer, rows, self._key_shifts[layer], out=rows)

    def restore_keys(self, layer: int, keys: torch.Tensor) -> torch.Tensor:
        """Dequantized keys ``[..., hd]`` of ``layer`` as stock attention must see them next to the model's own
        queries: an oaken-plus rotation undone (its shift stays: softmax ignores it)."""
        return keys if self.transforms is None else self.transforms.keys_restore(layer, keys)

    def rotate_queries(self, layer: int, q: np.ndarray) -> np.ndarray:
        """Queries ``[..., hd]`` (float32) for a kernel that reads this layer's keys: rotated like them under an
        oaken-plus key rotation (``q . k`` is unchanged because the rotation is orthogonal)."""
        if self.transforms is None or not self.transforms.layers[layer].key_rotation:
            return q
        return fwht(q)

    @property
    def batch_size(self) -> int:
        return len(self.seqs)

    def ensure_batch(self, batch_size: int) -> None:
        if not self.seqs:
            self.seqs = [self.pool.new_sequence(2 * self.num_layers) for _ in range(batch_size)]
        elif batch_size != len(self.seqs):
            raise ValueError(f"the cache holds {len(self.seqs)} sequences but got a batch of {batch_size}")

    def num_tokens(self, layer: int) -> int:
        return self.pool.num_tokens(self.seqs[0], 2 * layer) if self.seqs else 0

    def append(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[EncodedBatch, EncodedBatch]:
        """Encode and store new tokens of one layer for every row, atomically for the layer.

        Args:
            keys, values: ``[B, H, S, hd]`` float (any float dtype; quantized in float32).

        Returns:
            The encoded keys and values, rows ordered ``(b, s)``: ``[B * S]`` rows of ``D`` values.
        """
        b, h, s, hd = keys.shape
        if (h, hd) != (self.num_kv_heads, self.head_dim) or values.shape != keys.shape:
            raise ValueError(
                f"expected keys and values [B, {self.num_kv_heads}, S, {self.head_dim}], got "
                f"{tuple(keys.shape)} and {tuple(values.shape)}"
            )
        self.ensure_batch(b)
        encoded = []
        items = []
        # One serial section for both kinds: switching numba's thread count costs time (docs/perf-notes.md).
        with serial_numba(b * s < SERIAL_BELOW_ROWS):
            for kind, x in ((KEY, keys), (VALUE, values)):
                # [B, H, S, hd] -> [B * S, H * hd]: one row per token, all heads of the layer (granularity
                # "token"). The copy is done by numpy on this thread: torch's multi-threaded copy of these small
                # tensors waits for thread wake-ups on a loaded machine (docs/perf-notes.md).
                x32 = x.detach().to(torch.float32).numpy()
                rows_np = np.ascontiguousarray(x32.transpose(0, 2, 1, 3)).reshape(b * s, self.dim)
                if kind == KEY:
                    self._transform_keys(layer, rows_np)
                rows = torch.from_numpy(rows_np)
                enc = self.encode(rows, self.thresholds.layer(layer, KINDS[kind]), self.config)
                encoded.append(enc)
                dense, sparse, offs = to_records(enc)
                for r in range(b):
                    o = offs[r * s : (r + 1) * s + 1]
                    items.append(
                        (self.seqs[r], 2 * layer + kind, dense[r * s : (r + 1) * s], sparse[o[0] : o[-1]], o - o[0])
                    )
        self.pool.append_many(items)
        return encoded[0], encoded[1]

    def append_token(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store one new token ``[B, H, 1, hd]`` of one layer for every row (a decode step), atomically.

        Same bytes as :meth:`append`; one serial numba call encodes the ``2 B`` rows straight into page records
        and the pool appends them with scalar bookkeeping (:meth:`PagePool.append_token`). Needs the fast codec.
        """
        b, h, s, hd = keys.shape
        if (h, s, hd) != (self.num_kv_heads, 1, self.head_dim) or values.shape != keys.shape:
            raise ValueError(
                f"append_token expects keys and values [B, {self.num_kv_heads}, 1, {self.head_dim}], got "
                f"{tuple(keys.shape)} and {tuple(values.shape)}"
            )
        self.ensure_batch(b)
        scratch = self._token_scratch
        if scratch is None or scratch[0].shape[0] != 2 * b:
            m = 2 * b
            scratch = (
                np.empty((m, self.dim), np.float32),
                np.empty((m, self.rec_size), np.uint8),
                np.empty((m, sparse_capacity(self.dim)), np.uint8),
                np.empty(m, np.int64),
                np.empty((m, 4), np.float32),
            )
            self._token_scratch = scratch
        rows, records, sparse, counts, thr = scratch
        # [B, H, 1, hd] -> [B, H * hd] rows (keys first, then values); numpy copies on this thread (see append).
        rows[:b] = keys.detach().to(torch.float32).numpy().reshape(b, self.dim)
        rows[b:] = values.detach().to(torch.float32).numpy().reshape(b, self.dim)
        self._transform_keys(layer, rows[:b])
        thr[:b] = self.thr[layer, KEY]
        thr[b:] = self.thr[layer, VALUE]
        cfg = self.config
        fp16 = cfg.scale_dtype == "float16"
        encode_records(rows, thr, cfg.inner_bits, cfg.outer_bits, fp16, self.scale_bytes, records, sparse, counts)
        bad = np.flatnonzero(counts < 0)
        if bad.size:
            r = int(bad[0])
            kind = "keys" if r < b else "values"
            raise ValueError(f"cannot encode the {kind} of row {r % b}: {ERROR_MESSAGES[int(-counts[r])]}")
        targets = [(seq, 2 * layer + KEY) for seq in self.seqs] + [(seq, 2 * layer + VALUE) for seq in self.seqs]
        self.pool.append_token(targets, records, sparse, counts)

    def layer_view(self, layer: int) -> LayerView:
        """Where ``layer``'s keys and values of every row lie in the pool: the :class:`LayerView` a decode kernel
        reads (page tables of all rows stacked; see its docstring for shapes and layout).

        Built from the pool's tables on each call, with as few numpy calls as possible (this runs for every layer
        of every decode step), so it is current until the next append, eviction or reorder.
        """
        pool = self.pool
        tables = [(pool.table(seq, 2 * layer + KEY), pool.table(seq, 2 * layer + VALUE)) for seq in self.seqs]
        b, t = len(tables), tables[0][0].sparse_len.n
        dense_pages = np.empty((b, 2, tables[0][0].dense_pages.n), dtype=np.int32)
        sparse_lengths = np.empty((b, 2, t), dtype=np.uint16)
        sizes = [0]
        for i, row in enumerate(tables):
            for kind, tt in enumerate(row):
                if tt.sparse_len.n != t:
                    raise RuntimeError(f"layer {layer}: page tables hold {tt.sparse_len.n} and {t} tokens")
                dense_pages[i, kind] = tt.dense_pages.view
                sparse_lengths[i, kind] = tt.sparse_len.view
                sizes.append(sizes[-1] + tt.sparse_pages.n)
        cfg = self.config
        return LayerView(
            pool=pool.data.reshape(-1),
            page_size=pool.config.page_size,
            record_size=self.rec_size,
            scale_bytes=self.scale_bytes,
            dense_pages=dense_pages,
            sparse_pages=np.concatenate([tt.sparse_pages.view for row in tables for tt in row]),
            sparse_first=np.concatenate([tt.sparse_first.view for row in tables for tt in row]),
            sparse_starts=np.array(sizes, dtype=np.int64),
            sparse_lengths=sparse_lengths,
            thresholds=self.thr[layer],
            inner_bits=cfg.inner_bits,
            outer_bits=cfg.outer_bits,
            num_kv_heads=self.num_kv_heads,
        )

    def bits_per_value(self) -> dict[str, float]:
        """Bits per stored value, from the pages: ``format``: what the Oaken format stores (dense records,
        sparse records and the 16-bit header per token); ``with_pages``: everything the store holds (whole pages
        in use + tables)."""
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
        return {
            "format": 8.0 * (dense + sparse + HEADER_BITS // 8 * tokens) / values,
            "with_pages": 8.0 * self.stats().total_bytes / values,
        }

    def read(self, layer: int, kind: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dequantize one layer's whole stored keys or values (the reference read path): ``[B, H, T, hd]``.

        Tokens a sliding window evicted (:meth:`evict_before`) read as zeros; the sliding mask hides them. Keys
        come back in the model's frame up to an oaken-plus shift (:meth:`restore_keys`).
        """
        out = []
        for seq in self.seqs:
            stream = 2 * layer + kind
            table = self.pool.table(seq, stream)
            start = table.evicted_before
            dense = self.pool.read_dense(seq, stream, start)
            sparse, offs = self.pool.read_sparse(seq, stream, start)
            enc = from_records(dense, sparse, offs, self.dim, self.config)
            thr = self.thresholds.layer(layer, KINDS[kind])
            with serial_numba(enc.num_rows < SERIAL_BELOW_ROWS):
                x = self.decode(enc, thr, self.config) if enc.num_rows else torch.zeros(0, self.dim)
            if start:
                x = torch.cat([torch.zeros(start, self.dim, dtype=x.dtype), x])
            out.append(x.reshape(-1, self.num_kv_heads, self.head_dim).permute(1, 0, 2))
        x = torch.stack(out)
        return (self.restore_keys(layer, x) if kind == KEY else x).to(dtype)

    def evict_before(self, layer: int, token: int) -> int:
        """Release the pages of one layer (keys and values, every row) that hold only tokens below ``token``;
        returns the table slots released. For sliding-window layers: no query will attend to those tokens."""
        released = 0
        for seq in self.seqs:
            for kind in (KEY, VALUE):
                released += self.pool.evict_before(seq, 2 * layer + kind, token)
        return released

    def reorder(self, index: list[int]) -> None:
        """New row ``i`` = old row ``index[i]`` (beam search, batch selection): forks and frees, no KV copies."""
        if not self.seqs:
            return
        if any(not 0 <= j < len(self.seqs) for j in index):
            raise IndexError(f"reorder index {index} out of range for {len(self.seqs)} rows")
        used: set[int] = set()
        new = []
        for j in index:
            if j in used:
                new.append(self.pool.fork(self.seqs[j]))
            else:
                used.add(j)
                new.append(self.seqs[j])
        for j, seq in enumerate(self.seqs):
            if j not in used:
                self.pool.free(seq)
        self.seqs = new

    def reset(self) -> None:
        for seq in self.seqs:
            self.pool.free(seq)
        self.seqs = []

    def stats(self) -> PoolStats:
        return self.pool.stats()
