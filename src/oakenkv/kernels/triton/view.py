"""The per-layer kernel view: what the Triton attention kernel reads, as device tensors.

A layer's keys and values of ``B`` sequences live in pages (``oakenkv.pages``); the kernel needs, per sequence and
kind (0 keys, 1 values), the dense page ids and, for every token, where its sparse record starts and how long it
is. The pool's tables hold per-token lengths and per-page first tokens; the kernel cannot walk them (a program
starts mid-stream), so the view carries each token's absolute sparse address: the page's byte offset plus the
lengths of the earlier records of the same page (a prefix sum within each page, which never changes once written:
a store can append it per token, 8 bytes per token and stream, instead of rebuilding it per step).

:func:`view_from_store` builds it from today's host-side ``PagedKVStore`` (numpy tables, copied to the device per
call: the test and benchmark path). The paged store of the architecture issue keeps this view itself, updated on
append, and hands it to the kernel without a rebuild (``docs/gpu.md``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from oakenkv.kernels.triton import _format as F

#: Page id of an evicted page, and the sparse address of a token on one.
EVICTED = F.EVICTED


@dataclass
class DeviceLayerView:
    """One layer's pages as the attention kernel reads them (all tensors on one device).

    Attributes:
        dense_pool: uint8 ``[P_d * page_size]``: dense pages, flat (the pool's storage or a device copy of it).
        sparse_pool: uint8 ``[P_s * page_size]``: sparse pages, flat (may be the same tensor as ``dense_pool``).
        dense_pages: int32 ``[B, 2, ceil(T / rpp)]``: dense page id per sequence, kind (0 keys, 1 values) and
            page of records; ``EVICTED`` (-1) for released pages.
        sparse_addr: int64 ``[B, 2, T]``: byte offset in ``sparse_pool`` of each token's sparse record;
            ``EVICTED`` where its page was released (tokens with an empty record: any value).
        sparse_len: int32 ``[B, 2, T]``: sparse record lengths (the format's 16-bit header).
        thr: float32 ``[2, 4]``: the layer's key and value thresholds ``(to_lo, ti_lo, ti_hi, to_hi)``.
        page_size, rec_size: bytes per page and per dense record (``record_size(D)``).
        num_tokens, num_kv_heads, head_dim: ``T``, ``H`` and ``hd`` (``D = H * hd``).
        config: the codec configuration (scale dtype, group bits).
    """

    dense_pool: torch.Tensor
    sparse_pool: torch.Tensor
    dense_pages: torch.Tensor
    sparse_addr: torch.Tensor
    sparse_len: torch.Tensor
    thr: torch.Tensor
    page_size: int
    rec_size: int
    num_tokens: int
    num_kv_heads: int
    head_dim: int
    config: F.OakenConfig

    @property
    def batch_size(self) -> int:
        return int(self.dense_pages.shape[0])

    @property
    def dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def records_per_page(self) -> int:
        return self.page_size // self.rec_size


def sparse_addresses(lens: np.ndarray, pages: np.ndarray, first: np.ndarray, page_size: int) -> np.ndarray:
    """int64 ``[T]`` sparse record addresses of one stream from its tables (module docstring).

    Args:
        lens: ``[T]`` record lengths; pages, first: ``[S]`` sparse page ids (``EVICTED`` allowed) and first tokens.
    """
    t_n = lens.shape[0]
    out = np.full(t_n, EVICTED, dtype=np.int64)
    if t_n == 0 or pages.shape[0] == 0:
        return out
    cum = np.zeros(t_n + 1, dtype=np.int64)
    np.cumsum(lens.astype(np.int64), out=cum[1:])
    tok = np.arange(t_n)
    page_of = np.searchsorted(first, tok, side="right") - 1  # the page holding token t (-1: before the first)
    valid = page_of >= 0
    pi = np.where(valid, page_of, 0)
    pid = pages.astype(np.int64)[pi]
    addr = pid * page_size + (cum[tok] - cum[first.astype(np.int64)[pi]])
    return np.where(valid & (pid >= 0), addr, EVICTED)


def view_from_store(store, layer: int, device: torch.device | str) -> DeviceLayerView:
    """The :class:`DeviceLayerView` of one layer of an ``oakenkv.cache.PagedKVStore`` (its host tables and pool, copied
    to ``device``)."""
    pool = store.pool
    ps = pool.config.page_size
    tables = [[pool.table(seq, 2 * layer + kind) for kind in (0, 1)] for seq in store.seqs]
    t_n = tables[0][0].num_tokens if tables else 0
    b = len(tables)
    n_pages = max((tt.dense_pages.n for row in tables for tt in row), default=0)
    dense_pages = np.full((b, 2, max(n_pages, 1)), EVICTED, dtype=np.int32)
    sparse_addr = np.full((b, 2, max(t_n, 1)), EVICTED, dtype=np.int64)
    sparse_len = np.zeros((b, 2, max(t_n, 1)), dtype=np.int32)
    for i, row in enumerate(tables):
        for kind, tt in enumerate(row):
            if tt.num_tokens != t_n:
                raise RuntimeError(f"sequence {i} holds {tt.num_tokens} tokens of layer {layer}, sequence 0 {t_n}")
            dense_pages[i, kind, : tt.dense_pages.n] = tt.dense_pages.view
            sparse_len[i, kind, :t_n] = tt.sparse_len.view
            sparse_addr[i, kind, :t_n] = sparse_addresses(
                tt.sparse_len.view, tt.sparse_pages.view, tt.sparse_first.view, ps
            )
    flat = torch.from_numpy(pool.data.reshape(-1)).to(device)
    return DeviceLayerView(
        dense_pool=flat,
        sparse_pool=flat,
        dense_pages=torch.from_numpy(dense_pages).to(device),
        sparse_addr=torch.from_numpy(sparse_addr).to(device),
        sparse_len=torch.from_numpy(sparse_len).to(device),
        thr=torch.from_numpy(np.ascontiguousarray(store.thr[layer])).to(device),
        page_size=ps,
        rec_size=store.rec_size,
        num_tokens=t_n,
        num_kv_heads=store.num_kv_heads,
        head_dim=store.head_dim,
        config=store.config,
    )
