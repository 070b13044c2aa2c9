"""Oaken records in vLLM's blocks on the pool's device: the writer, the kernels' view and the attention of the
plugin's CUDA backend (``cuda.py``), by the Triton kernels.

The blocks are :mod:`~oakenkv.integrations.vllm.layout`'s byte for byte (the CPU plugin's ``BlockLayout``), so
everything here is checked against ``layout.py``'s writer and attention. No vLLM import: the functions take one
layer's blocks as a flat ``uint8`` tensor on any device, CUDA, or CPU tensors under the Triton interpreter
(``TRITON_INTERPRET=1``), which is how the tests run them without a GPU (``tests/test_vllm_device.py``).

- :class:`DeviceBlockWriter`: a step's keys (through the online key transform) and values encoded by one Triton
  launch over all ``2 N`` rows; the 16-bit sink copies; each record's offset in its block's sparse area from a sum
  over the block's header with the step's lengths put in; dense records scattered to their slots, lengths into the
  headers, COO streams copied to their offsets. The rows of a block where a record does not fit its sparse area
  (rare: the areas are sized with headroom) are written by the CPU writer instead, on a host copy of the block (so
  the overflow policy's bytes are the CPU plugin's), and the block copied back.
- :func:`step_pages` (once per step: the dense record ids every layer shares, the keep mask) and :func:`layer_view`
  (per layer: its lengths gathered from its headers, its sparse addresses by a prefix sum within each block): vLLM's
  block table as the kernels' ``DeviceLayerView``, built on the device. ``O(rows x tokens)`` per layer and step;
  ``docs/gpu.md`` says how to keep them across steps instead.
- :func:`decode_attention` and :func:`prefill_attention`: the Triton kernels over that view, the sink tokens read
  at 16 bits and merged through the log-sum-exp.

Device-to-host syncs per layer and step (each a small read): padding and range of the slots, the encoder's error
codes, whether any record overflowed, the view's length check and the kernels' status. Fine for correctness;
``docs/gpu.md`` lists them among the costs to measure and remove.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from oakenkv.integrations.vllm import _oaken
from oakenkv.integrations.vllm.layout import BlockLayout, BlockWriter
from oakenkv.integrations.vllm.layout import pool_tensor as pool_tensor  # (the flat pool on any device, re-exported)

STATIC_GRIDS_REFUSED = (
    "the plugin's device path (Triton kernels) does not read records of static grids (oaken-plus:static=1) yet; "
    "serve this profile with the CPU engine, or one without static grids"
)


def _kernels() -> Any:
    return _oaken.triton_kernels()


def _launch(kind: str) -> dict[str, Any]:
    """The launch options of the device store for kernel ``kind`` (larger blocks under the interpreter)."""
    return _kernels().interpret.store_blocks()[kind]


def _header_lengths(pool: torch.Tensor, at: torch.Tensor, len_bytes: int) -> torch.Tensor:
    """int64 lengths stored little-endian at byte offsets ``at`` (any shape)."""
    v = pool[at].to(torch.int64)
    if len_bytes == 2:
        v |= pool[at + 1].to(torch.int64) << 8
    return v


class DeviceBlockWriter:
    """``layout.BlockWriter``'s bytes on the pool's device (module docstring); one per layer.

    Args: as ``BlockWriter``'s (``layout``, ``thresholds`` float32 ``[2, 4]``, ``overflow``, ``key_shift``,
    ``key_rotation``, ``head_dim``) and the ``device`` its pools live on.
    """

    def __init__(
        self,
        layout: BlockLayout,
        thresholds: np.ndarray,
        overflow: str = "clip",
        *,
        key_shift: np.ndarray | None = None,
        key_rotation: bool = False,
        head_dim: int | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        if layout.static_grids:
            raise NotImplementedError(STATIC_GRIDS_REFUSED)
        #: The CPU writer of the same layer: it checks the arguments, and writes the blocks a record overflowed.
        self.host = BlockWriter(
            layout, thresholds, overflow, key_shift=key_shift, key_rotation=key_rotation, head_dim=head_dim
        )
        self.layout = layout
        self.overflow = overflow
        self.stats = self.host.stats
        self.device = torch.device(device)
        self.thr = torch.from_numpy(self.host.thr).to(self.device)
        self.shift = torch.from_numpy(self.host.shift).to(self.device) if self.host.shift.size else None
        self.rotate = self.host.rotate
        self.head_dim = self.host.head_dim
        self.config = layout.config()

    def write(
        self,
        pool: torch.Tensor,
        units_per_block: int,
        slots: torch.Tensor | np.ndarray,
        keys: torch.Tensor,
        values: torch.Tensor,
    ) -> None:
        """Encode and store ``n`` tokens: ``keys`` / ``values`` ``[n, D]`` or ``[n, H, hd]`` (float, on the pool's
        device), token ``i`` into slot ``slots[i]`` (``block * block_size + offset``; negative: padding, skipped)."""
        lay = self.layout
        k = _kernels()
        dev = pool.device
        slots = torch.as_tensor(slots).to(device=dev, dtype=torch.int64).reshape(-1)
        n = slots.numel()
        if n == 0:
            return
        bs, unit = lay.block_size, lay.unit
        stride = units_per_block * unit
        num_blocks = (pool.numel() - lay.block_bytes) // stride + 1
        keys = keys.reshape(keys.shape[0], -1)[:n]
        values = values.reshape(values.shape[0], -1)[:n]
        if keys.shape != (n, lay.dim) or values.shape != (n, lay.dim):
            raise ValueError(f"expected {n} rows of {lay.dim} keys and values, got {tuple(keys.shape)}")
        lo, hi = (int(v) for v in torch.aminmax(slots))
        if hi >= num_blocks * bs:
            raise IndexError(f"slot {hi} is past the cache's {num_blocks} blocks")
        if lo < 0:  # padding tokens: not stored
            kept = torch.nonzero(slots >= 0).squeeze(1)
            slots, keys, values = slots[kept], keys[kept], values[kept]
            n = slots.numel()
            if n == 0:
                return
        x = torch.empty((2 * n, lay.dim), dtype=torch.float32, device=dev)
        x[:n] = keys
        x[n:] = values
        if self.shift is not None or self.rotate:
            k.rotate.shift_rotate_rows(x[:n], self.shift, self.rotate, self.head_dim)
        blk = slots // bs
        o = (slots - blk * bs).repeat(2)
        blk = blk.repeat(2)
        kind = torch.arange(2, device=dev).repeat_interleave(n)
        base = blk * stride
        if lay.sink_tokens:  # 16-bit copies of a block's first tokens (the transformed keys, as the CPU writer)
            sel = torch.nonzero(o < lay.sink_tokens).squeeze(1)
            if sel.numel():
                at = base[sel] + lay.sink_unit * unit + (kind[sel] * lay.sink_tokens + o[sel]) * (2 * lay.dim)
                pool[at[:, None] + torch.arange(2 * lay.dim, device=dev)] = x[sel].to(torch.float16).view(torch.uint8)
        thr = self.thr.repeat_interleave(n, dim=0)  # [2n, 4]: the keys' thresholds, then the values'
        records, sparse, counts = k.encode.encode_records(x, thr, self.config, check=False, **_launch("encode"))
        if bool((counts < 0).any()):
            r = int(torch.nonzero(counts < 0)[0, 0])
            what = "keys" if r < n else "values"
            raise ValueError(f"cannot encode the {what} of token {r % n}: {_oaken.ERROR_MESSAGES[-int(counts[r])]}")
        cnt = counts.to(torch.int64)
        w = lay.len_bytes
        # Each record's offset in its block's sparse area: the lengths of the block's earlier tokens, from its header
        # with this step's lengths put in (on a copy: nothing is written before the overflow check).
        groups, g = torch.unique(blk * 2 + kind, return_inverse=True)
        cols = torch.arange(bs, device=dev)
        header = (groups // 2) * stride + lay.header_unit * unit + (groups % 2) * (bs * w)
        lengths = _header_lengths(pool, header[:, None] + cols * w, w)  # [G, bs]
        lengths[g, o] = cnt
        off = (lengths[g] * (cols[None, :] < o[:, None])).sum(1)
        over = off + cnt > lay.sparse_area_bytes
        rows = overflowed = None
        if bool(over.any()):  # those blocks' rows go to the CPU writer; the others are written here
            overflowed = torch.unique(blk[over])
            rows = torch.nonzero(~torch.isin(blk, overflowed)).squeeze(1)
            blk, kind, o, off, cnt, base = blk[rows], kind[rows], o[rows], off[rows], cnt[rows], base[rows]
            records, src = records[rows], rows * sparse.shape[1]
        else:
            src = torch.arange(2 * n, device=dev, dtype=torch.int64) * sparse.shape[1]
        pool.view(-1, unit)[blk * units_per_block + kind * bs + o] = records
        at = base + lay.header_unit * unit + kind * (bs * w) + o * w
        pool[at] = (cnt & 0xFF).to(torch.uint8)
        if w == 2:
            pool[at + 1] = (cnt >> 8).to(torch.uint8)
        dst = base + (2 * bs + kind * lay.sparse_units) * unit + off
        k.encode.copy_spans(sparse.view(-1), src, pool, dst, cnt)
        if overflowed is not None:
            self._host_blocks(pool, units_per_block, overflowed.cpu().numpy(), slots, keys, values)
        self.stats.written += 2 * n

    def _host_blocks(self, pool, units_per_block, blocks, slots, keys, values) -> None:
        """The step's rows of ``blocks`` written by the CPU writer (its overflow policy) on a host copy of those
        blocks (only their sink copies were written here), and the blocks copied back (also when the policy raises:
        what it wrote stays, as on the CPU)."""
        lay = self.layout
        dev = pool.device
        stride = units_per_block * lay.unit
        blocks = np.sort(blocks)
        idx = torch.from_numpy(blocks).to(dev)[:, None] * stride + torch.arange(lay.block_bytes, device=dev)
        mini = pool[idx].cpu().numpy().reshape(-1)
        s = slots.cpu().numpy()
        blk = s // lay.block_size
        sel = np.isin(blk, blocks)
        mini_slots = np.searchsorted(blocks, blk[sel]) * lay.block_size + s[sel] % lay.block_size
        rows = torch.from_numpy(np.flatnonzero(sel)).to(dev)
        written = self.stats.written
        try:
            self.host.write(mini, lay.units, mini_slots, keys[rows].cpu(), values[rows].cpu(), slot_names=s[sel])
        finally:
            self.stats.written = written
            pool[idx] = torch.from_numpy(mini.reshape(len(blocks), lay.block_bytes)).to(dev)


@dataclass(frozen=True)
class StepPages:
    """One step's tables over vLLM's block table, shared by every layer (their blocks sit at the same ids)."""

    #: Stored tokens per row (host).
    seq_lens: np.ndarray
    #: int64 ``[R, T]``: the block of each row's token ``t`` (``T`` the longest row rounded up to whole blocks; 0 past
    #: a row's length).
    blocks: torch.Tensor
    #: bool ``[R, T]``: ``t < seq_lens[r]``.
    valid: torch.Tensor
    #: int32 ``[R, 2, T]``: each token's dense record as a page id of one record (``page_size = unit``).
    dense_pages: torch.Tensor
    #: uint8 ``[R, T]``: the tokens a decode query reads from the pages (stored, past the sink tokens).
    keep: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.blocks.shape[1])


def step_pages(layout: BlockLayout, units_per_block: int, block_table: torch.Tensor, seq_lens: np.ndarray) -> StepPages:
    """The step's :class:`StepPages` from vLLM's ``block_table`` (int ``[R, >= blocks]``, on the pools' device) and
    ``seq_lens`` (host ints ``[R]``, tokens stored after the step's writes)."""
    dev = block_table.device
    seq_lens = np.ascontiguousarray(seq_lens, np.int64)
    bs = layout.block_size
    nblk = -(-int(seq_lens.max()) // bs) if seq_lens.size else 0
    if nblk > block_table.shape[1]:
        raise ValueError(f"rows of {int(seq_lens.max())} tokens need {nblk} blocks, the table {block_table.shape[1]}")
    t = torch.arange(nblk * bs, device=dev)
    valid = t[None, :] < torch.from_numpy(seq_lens).to(dev)[:, None]
    blocks = torch.where(valid, block_table[:, :nblk].to(torch.int64).repeat_interleave(bs, dim=1), 0)
    kinds = torch.arange(2, device=dev)[None, :, None]
    dense = blocks[:, None, :] * units_per_block + kinds * bs + (t % bs)
    if dense.numel() and int(dense.max()) >= 2**31:
        raise ValueError("the layer's pool has more records than int32 page ids address")
    keep = (valid & (t >= layout.sink_tokens)[None, :]).to(torch.uint8)
    return StepPages(seq_lens, blocks, valid, dense.to(torch.int32), keep)


def layer_view(
    pool: torch.Tensor,
    layout: BlockLayout,
    units_per_block: int,
    pages: StepPages,
    thresholds: torch.Tensor,
    num_kv_heads: int,
    head_dim: int,
    check: bool = True,
) -> Any:
    """One layer's ``DeviceLayerView`` for the step: its lengths from its blocks' headers, each token's sparse address
    its block's area plus the lengths of the block's earlier tokens. ``check``: raise ``CorruptDataError`` for a
    stored length that does not fit its block (a device-to-host read)."""
    lay = layout
    dev = pool.device
    bs, unit, w = lay.block_size, lay.unit, lay.len_bytes
    r, t_n = pages.blocks.shape
    base = (pages.blocks * (units_per_block * unit))[:, None, :]
    kinds = torch.arange(2, device=dev)[None, :, None]
    o = (torch.arange(t_n, device=dev) % bs)[None, None, :]
    lens = _header_lengths(pool, base + lay.header_unit * unit + kinds * (bs * w) + o * w, w)
    lens = torch.where(pages.valid[:, None, :], lens, 0)
    blocked = lens.view(r, 2, t_n // bs, bs)
    off = (blocked.cumsum(-1) - blocked).view(r, 2, t_n)
    if check and lens.numel():
        bad = (lens > lay.max_record) | (off + lens > lay.sparse_area_bytes)
        if bool(bad.any()):
            row = int(torch.nonzero(bad)[0, 0])
            raise _oaken.CorruptDataError(f"row {row}: a stored sparse length does not fit its block")
    addr = base + (2 * bs + kinds * lay.sparse_units) * unit + off
    return _kernels().view.DeviceLayerView(
        dense_pool=pool, sparse_pool=pool, page_size=unit, record_size=unit, scale_bytes=lay.scale_bytes,
        dense_pages=pages.dense_pages, sparse_addr=addr.contiguous(), sparse_lengths=lens.to(torch.int32),
        thresholds=thresholds, inner_bits=lay.inner_bits, outer_bits=lay.outer_bits, num_kv_heads=num_kv_heads,
        head_dim=head_dim,
    )  # fmt: skip


def row_view(view: Any, rows: int | slice, tokens: int) -> Any:
    """Rows ``rows`` of a ``DeviceLayerView`` (one row: a prefill request's own view), their first ``tokens``
    tokens."""
    rows = slice(rows, rows + 1) if isinstance(rows, int) else rows
    return dataclasses.replace(
        view,
        dense_pages=view.dense_pages[rows, :, :tokens],
        sparse_addr=view.sparse_addr[rows, :, :tokens],
        sparse_lengths=view.sparse_lengths[rows, :, :tokens],
    )


def head_rows(pages: StepPages, rows: int) -> StepPages:
    """The step's first ``rows`` rows (the decodes, which vLLM puts first)."""
    return StepPages(
        pages.seq_lens[:rows], pages.blocks[:rows], pages.valid[:rows], pages.dense_pages[:rows], pages.keep[:rows]
    )


def layer_sinks(pool: torch.Tensor, layout: BlockLayout, units_per_block: int, first_blocks: torch.Tensor):
    """float32 ``[R, 2, sink_tokens, D]``: each row's sink tokens (keys after the online transform, values), read
    at 16 bits from the sink area of its first block (``first_blocks`` int ``[R]``)."""
    lay = layout
    dev = pool.device
    at = first_blocks.to(torch.int64) * (units_per_block * lay.unit) + lay.sink_unit * lay.unit
    raw = pool[at[:, None] + torch.arange(4 * lay.sink_tokens * lay.dim, device=dev)]
    return raw.view(torch.float16).view(-1, 2, lay.sink_tokens, lay.dim).to(torch.float32)


def _rotated(q: torch.Tensor, rotate: bool, head_dim: int) -> torch.Tensor:
    """float32 copy of queries ``[..., hd]``, rotated per head like the stored keys when ``rotate``."""
    q32 = q.to(torch.float32).clone().contiguous()
    if rotate:
        _kernels().rotate.shift_rotate_rows(q32.view(-1, head_dim), None, True, head_dim)
    return q32


def _with_sinks(q, out, lse, sinks, keep, num_kv_heads, scale, softcap) -> torch.Tensor:
    """``out`` (``[B, Hq, S, hd]``, log-sum-exp ``lse``) merged with the sink tokens' attention (``q [B, Hq, S, hd]``
    float32, ``sinks [B, 2, n, D]``, ``keep [B, S, n]``)."""
    k = _kernels()
    b, n = sinks.shape[0], sinks.shape[2]
    hd = q.shape[-1]
    sk = sinks[:, 0].reshape(b, n, num_kv_heads, hd).transpose(1, 2)
    sv = sinks[:, 1].reshape(b, n, num_kv_heads, hd).transpose(1, 2)
    out_s, lse_s = k.prefill.sink_attention(q, sk, sv, keep, scale, softcap)
    return k.prefill.merge_lse(out, lse, out_s, lse_s)[0]


def decode_attention(
    query: torch.Tensor,
    view: Any,
    pages: StepPages,
    sinks: torch.Tensor | None,
    scale: float,
    softcap: float = 0.0,
    rotate: bool = False,
) -> torch.Tensor:
    """One query token per row (``[R, Hq, hd]``, the view's rows) over the pages, the sink tokens (``sinks``:
    :func:`layer_sinks` of the rows, or None) merged in. Returns float32 ``[R, Hq, hd]``."""
    k = _kernels()
    hd = view.head_dim
    q = _rotated(query, rotate, hd)
    out, lse, status = k.attention.paged_decode_attention_parts(
        q, view, pages.keep, scale, softcap or None, **_launch("attention")
    )
    k.attention.raise_on_status(status)
    if sinks is not None:
        n = sinks.shape[2]
        dev = q.device
        stored = torch.arange(n, device=dev)[None, :] < torch.from_numpy(pages.seq_lens).to(dev)[:, None]
        out = _with_sinks(
            q[:, :, None], out[:, :, None], lse[:, :, None], sinks, stored[:, None, :], view.num_kv_heads, scale,
            softcap,
        )[:, :, 0]  # fmt: skip
    return out


def prefill_attention(
    query: torch.Tensor,
    view: Any,
    sinks: torch.Tensor | None,
    scale: float,
    softcap: float = 0.0,
    rotate: bool = False,
) -> torch.Tensor:
    """The ``S`` query tokens of one request (``[S, Hq, hd]``, the last ``S`` of its ``T`` stored tokens: ``view``
    is its :func:`row_view`), causal, over the pages; its sink tokens (``sinks [1, 2, n, D]`` or None) merged in.
    Returns float32 ``[S, Hq, hd]``."""
    k = _kernels()
    s = query.shape[0]
    t_n = view.num_tokens
    past = t_n - s
    n_sink = 0 if sinks is None else min(sinks.shape[2], t_n)
    q = _rotated(query, rotate, view.head_dim).permute(1, 0, 2)[None]  # [1, Hq, S, hd]
    out, lse, status = k.prefill.paged_prefill_attention(
        q, view, past, None, scale, softcap or None, skip=n_sink, dot=k.prefill.dot_kind(query.dtype),
        **_launch("prefill"),
    )  # fmt: skip
    k.attention.raise_on_status(status)
    if n_sink:
        dev = q.device
        pos = past + torch.arange(s, device=dev)
        keep = (torch.arange(n_sink, device=dev)[None, :] <= pos[:, None])[None]  # [1, S, n]
        out = _with_sinks(q, out, lse, sinks[:, :, :n_sink], keep, view.num_kv_heads, scale, softcap)
    return out[0].transpose(0, 1)
