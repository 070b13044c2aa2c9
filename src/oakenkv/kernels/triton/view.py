"""The store's per-layer kernel view (``oakenkv.format.layout.LayerView``) in the form the Triton kernels read.

A :class:`~oakenkv.format.layout.LayerView` (built by ``oakenkv.store.paged.PagedKVStore.layer_view``) holds, per
sequence and
kind (0 keys, 1 values), the dense page ids, and for the sparse records each stream's pages with their first
tokens and every token's record length: a reader finds a token's sparse record by walking its stream in token
order (the CPU kernel does). A Triton program starts mid-stream and cannot walk, so
:class:`DeviceLayerView` carries each token's absolute sparse address instead: its page's byte offset plus the
lengths of the earlier records of the same page (a prefix sum within each page, which never changes once
written: a store can append it per token, 8 bytes per token and stream, instead of recomputing it per step).

:func:`from_layer_view` derives those addresses from the view's fields on the host (numpy) and copies the view to
a device (on the CPU, the pool is shared, not copied); :func:`view_from_store` is the adapter from a
``PagedKVStore``. Until the store keeps its tables on the device (``docs/gpu.md``), this runs per layer and call.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from oakenkv.kernels.triton import _oaken as F


@dataclass(frozen=True)
class DeviceLayerView:
    """One layer's pages as the Triton kernels read them (all tensors on one device).

    The fields of :class:`~oakenkv.format.layout.LayerView` that the kernels read, under its names, with the sparse
    tables replaced by per-token addresses, and the pool split by page kind:

    Attributes:
        dense_pool: uint8 ``[P_d * page_size]``: dense pages, flat (the pool's storage or a device copy of it).
        sparse_pool: uint8 ``[P_s * page_size]``: sparse pages, flat (may be the same tensor as ``dense_pool``).
        page_size, record_size, scale_bytes: bytes per page, per dense record, and of the scales that start one.
        dense_pages: int32 ``[B, 2, ceil(T / rpp)]``: dense page id per sequence, kind (0 keys, 1 values) and
            page of records; ``EVICTED`` (-1) for released pages.
        sparse_addr: int64 ``[B, 2, T]``: byte offset in ``sparse_pool`` of each token's sparse record;
            ``EVICTED`` where its page was released (tokens with an empty record: any value).
        sparse_lengths: int32 ``[B, 2, T]``: sparse record lengths (the format's 16-bit header).
        thresholds: float32 ``[2, 4]``: the layer's key and value thresholds ``(to_lo, ti_lo, ti_hi, to_hi)``.
        inner_bits, outer_bits: bits of the inner and outer codes (4 or 5).
        num_kv_heads, head_dim: ``H`` and ``hd`` (``D = H * hd``; a ``LayerView`` does not carry ``hd``).
    """

    dense_pool: torch.Tensor
    sparse_pool: torch.Tensor
    page_size: int
    record_size: int
    scale_bytes: int
    dense_pages: torch.Tensor
    sparse_addr: torch.Tensor
    sparse_lengths: torch.Tensor
    thresholds: torch.Tensor
    inner_bits: int
    outer_bits: int
    num_kv_heads: int
    head_dim: int

    @property
    def batch_size(self) -> int:
        return int(self.dense_pages.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.sparse_lengths.shape[2])

    @property
    def dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def records_per_page(self) -> int:
        return self.page_size // self.record_size


def sparse_addresses(view: F.LayerView) -> np.ndarray:
    """int64 ``[B, 2, T]``: the absolute byte offset in ``view.pool`` of every token's sparse record, ``EVICTED``
    for tokens whose sparse page was released (module docstring).

    Token ``t`` of stream ``i = 2 b + k`` lies in the last of the stream's pages whose first token is ``<= t``, at
    the page's offset plus the lengths of the tokens from that first token to ``t`` (``format.LayerView``). All
    streams at once: the streams' live pages (``sparse_counts`` of them; the tables have capacity beyond) are
    concatenated in stream order, so ``(stream, first token)`` keys are sorted and one ``searchsorted`` finds
    every token's page.
    """
    t_n = int(view.num_tokens)
    lens = np.asarray(view.sparse_lengths)[:, :, :t_n]
    b, kinds, _ = lens.shape
    n_streams = b * kinds
    out = np.full((n_streams, t_n), F.EVICTED, dtype=np.int64)
    counts = np.asarray(view.sparse_counts, dtype=np.int64)
    cap = view.sparse_pages.shape[2]
    if counts.shape != (b, kinds) or (counts.size and (counts.min() < 0 or counts.max() > cap)):
        raise ValueError(f"sparse tables of capacity {cap} do not fit page counts {counts.tolist()}")
    # The streams' live pages concatenated in stream order (the tables have capacity beyond them).
    live = np.arange(cap)[None, None, :] < counts[:, :, None]
    pages = np.asarray(view.sparse_pages, dtype=np.int64)[live]
    if t_n == 0 or pages.size == 0:
        return out.reshape(lens.shape)
    first = np.asarray(view.sparse_first, dtype=np.int64)[live]
    starts = np.zeros(n_streams + 1, dtype=np.int64)
    np.cumsum(counts.reshape(-1), out=starts[1:])
    stream_of_page = np.repeat(np.arange(n_streams, dtype=np.int64), np.diff(starts))
    span = max(t_n, int(first.max()) + 1) + 1  # keys stream * span + token never collide across streams
    page_keys = stream_of_page * span + first
    tok = np.arange(t_n, dtype=np.int64)
    tok_keys = np.arange(n_streams, dtype=np.int64)[:, None] * span + tok[None, :]
    g = np.searchsorted(page_keys, tok_keys, side="right") - 1  # [streams, T]: global page index
    gi = np.maximum(g, 0)
    mine = (g >= 0) & (stream_of_page[gi] == np.arange(n_streams)[:, None])  # a page of this stream holds t
    cum = np.zeros((n_streams, t_n + 1), dtype=np.int64)
    np.cumsum(lens.reshape(n_streams, t_n), axis=1, dtype=np.int64, out=cum[:, 1:])
    pid = pages[gi]
    page_first = np.minimum(first[gi], t_n)
    addr = pid * view.page_size + (cum[:, :t_n] - np.take_along_axis(cum, page_first, axis=1))
    out = np.where(mine & (pid >= 0), addr, F.EVICTED)
    return out.reshape(lens.shape)


def from_layer_view(view: F.LayerView, head_dim: int, device: torch.device | str) -> DeviceLayerView:
    """The :class:`DeviceLayerView` of a store's :class:`~oakenkv.format.layout.LayerView` on ``device``.

    Args:
        view: the layer's view (``PagedKVStore.layer_view``); its arrays are read, not kept.
        head_dim: ``hd`` of the rows (``D = view.num_kv_heads * hd``).
        device: where the kernels run; on the CPU (the interpreter) the pool is shared with the store.
    """
    F.check_slot_bits(view.middle_bits)
    F.check_static_grids(view.static_grid.shape[-1] != 0)
    if F.dense_bytes(view.num_kv_heads * head_dim) != view.record_size - view.scale_bytes:
        raise ValueError(
            f"records of {view.record_size} bytes ({view.scale_bytes} of scales) do not hold {view.num_kv_heads} "
            f"heads x {head_dim} values"
        )
    F.fp16_scales(view.scale_bytes)  # fp16 or fp32 scales, nothing else

    def dev(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)

    pool = dev(view.pool)
    # The live part of the store's tables (they have capacity beyond it: format.LayerView).
    t_n = int(view.num_tokens)
    n_dense = -(-t_n // (view.page_size // view.record_size))
    return DeviceLayerView(
        dense_pool=pool,
        sparse_pool=pool,
        page_size=int(view.page_size),
        record_size=int(view.record_size),
        scale_bytes=int(view.scale_bytes),
        dense_pages=dev(np.asarray(view.dense_pages[:, :, :n_dense], dtype=np.int32)),
        sparse_addr=dev(sparse_addresses(view)),
        sparse_lengths=dev(np.asarray(view.sparse_lengths[:, :, :t_n], dtype=np.int32)),
        thresholds=dev(np.asarray(view.thresholds, dtype=np.float32)),
        inner_bits=int(view.inner_bits),
        outer_bits=int(view.outer_bits),
        num_kv_heads=int(view.num_kv_heads),
        head_dim=int(head_dim),
    )


def view_from_store(store, layer: int, device: torch.device | str) -> DeviceLayerView:
    """The :class:`DeviceLayerView` of one layer of an ``oakenkv.store.paged.PagedKVStore``: ``store.layer_view(layer)``
    on ``device`` (:func:`from_layer_view`)."""
    return from_layer_view(store.layer_view(layer), store.head_dim, device)
