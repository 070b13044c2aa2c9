"""Oaken records inside vLLM's KV-cache blocks: the block layout, writing, the kernels' tables, and attention.

Why one module (over 600 lines): the block layout's offsets are computed by the writer, the table builder and
the attention readers alike; one file keeps one definition of them, free of vLLM imports.

No vLLM import: everything here works on a plain ``uint8`` array holding one layer's blocks, so it is tested
without vLLM (``tests/test_vllm_plugin.py``). ``docs/vllm.md`` has the diagram; in short, one block of ``B``
tokens of one layer, in units of ``rec = record_size(D)`` bytes (a dense record: six fp16 scales + nibbles, or
with static grids the two outer scales + nibbles)::

    unit 0           K dense records, token o at unit o
    unit B           V dense records, token o at unit B + o
    unit 2B          K sparse area (cS units): the block's K COO records back to back, in token order
    unit 2B + cS     V sparse area (cS units)
    unit 2B + 2cS    header: the sparse length of every token, K then V (``len_bytes`` each, little-endian)
    then             sink area (oaken-plus profiles with ``n`` sink tokens): the block's first ``n`` tokens' K and
                     V rows at 16 bits (fp16 ``[2, n, D]``, keys after the online transform); read only in a
                     sequence's first block, whose first ``n`` tokens are the sequence's sink tokens

A token's sparse record starts after those of the tokens before it in its block, so a reader walks a block in
token order; writes happen in token order too (vLLM fills a block front to back, and a rewritten slot is always
followed by rewrites of the later ones). Seen as a page pool of ``page_size = rec``, the layer's cache is
exactly what ``oakenkv.kernels.cpu.attention.packed_decode_attention`` reads: one dense page per token, one
sparse page per block and kind. The tables are ``oakenkv.store.view.LayerTables``, filled from vLLM's block tables
(:class:`BlockTables`), and the bytes are copied by ``oakenkv.store.records.put_record``: the store's writer and
view builder, not copies of them.

Blocks need not be contiguous: block ``b`` starts at byte ``b * stride`` of the pool, ``stride`` a multiple of
``rec`` (``units_per_block = stride // rec``), so layouts that interleave layers work as well.
"""

from __future__ import annotations

import itertools
import math
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from numba import njit

from oakenkv.integrations.vllm import _oaken

#: Default sparse capacity per token and kind, as a multiple of the expected COO bytes ``D x outlier ratio``.
DEFAULT_HEADROOM = 1.35
#: Tokens of history a prefill dequantizes at a time (a tile of keys and one of values, float32, per layer).
PREFILL_TILE = 512
#: From this many (row, token) pairs a decode step shares its rows with :class:`RowThreads` (waking a thread and
#: waiting for it costs tens of microseconds; a row of 64 tokens about as much).
ROW_THREADS_MIN_TOKENS = 1024
#: Chunks of rows per thread a shared decode step is cut into, taken by whichever thread is free: a thread whose
#: core is busy with something else takes fewer, instead of every step waiting for it.
ROW_CHUNKS_PER_THREAD = 3


class BlockOverflowError(RuntimeError):
    """A token's COO record does not fit in its block's sparse area and the overflow policy is ``error``."""


@dataclass(frozen=True)
class BlockLayout:
    """Where the parts of ``block_size`` tokens' K and V live inside one block of one layer (module docstring).

    All offsets are in units of ``unit`` bytes (one dense record).
    """

    dim: int
    block_size: int
    #: Bytes of one dense record (fp16 scales + ``ceil(dim / 2)`` nibble bytes): the unit of the layout.
    unit: int
    #: Units of each kind's sparse area.
    sparse_units: int
    #: Bytes per stored sparse length: 1 when a row's COO stream cannot exceed 255 bytes, else 2.
    len_bytes: int
    #: Longest COO record one row can have (all values outliers, one escape per chunk).
    max_record: int
    #: Bytes of the fp16 scales at the start of a dense record: six, or the outer two with static grids.
    scale_bytes: int
    inner_bits: int = 5
    outer_bits: int = 5
    #: Tokens at the start of a sequence also kept at 16 bits (an oaken-plus profile's ``sink_tokens``); 0: none.
    sink_tokens: int = 0
    #: Records of static middle/inner grids (``OakenConfig.static_grids``): the outer scales alone, the layer's grids
    #: derived from its thresholds (:func:`layer_static_grid`).
    static_grids: bool = False

    def config(self) -> _oaken.OakenConfig:
        """The codec config of these records (fp16 scales, 4-bit slots; the ratios are not the layout's)."""
        return _oaken.OakenConfig(
            inner_bits=self.inner_bits, outer_bits=self.outer_bits, static_grids=self.static_grids
        )

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.dim < 1 or self.sparse_units < 1:
            raise ValueError(f"invalid block layout {self}")
        if not 0 <= self.sink_tokens <= self.block_size:
            raise ValueError(f"{self.sink_tokens} sink tokens do not fit in a block of {self.block_size} tokens")

    @classmethod
    def make(
        cls,
        dim: int,
        block_size: int,
        config: _oaken.OakenConfig,
        sparse_bytes_per_token: float | None = None,
        sink_tokens: int = 0,
        outlier_share: float | None = None,
    ) -> BlockLayout:
        """The layout for rows of ``dim`` values in blocks of ``block_size`` tokens.

        Args:
            config: the profile's config (needs fp16 scales; the ratios set the default sparse capacity).
            sparse_bytes_per_token: sparse capacity per token and kind (bytes), shared by the block's tokens;
                default ``DEFAULT_HEADROOM x dim x outlier_share``.
            sink_tokens: the profile's sink tokens (16-bit copies kept in every block's sink area).
            outlier_share: the largest sparse (inner + outer) share of any layer and kind
                (:func:`profile_outlier_share`); default the config's ``outer_ratio + inner_ratio``.
        """
        if config.scale_dtype != "float16":
            raise ValueError("the vLLM plugin stores fp16 scales; this profile uses scale_dtype='float32'")
        if config.static_levels:  # (check_profile refuses these profiles at start; this guards the bytes too)
            from oakenkv.integrations.vllm import LEVELS_REFUSED

            raise NotImplementedError(LEVELS_REFUSED)
        if not isinstance(dim, int) or not isinstance(block_size, int) or dim < 1 or block_size < 1:
            raise ValueError(f"dim and block_size must be positive ints, got {dim!r}, {block_size!r}")
        unit = _oaken.record_size(dim, config)
        if sparse_bytes_per_token is None:
            share = config.outlier_ratio if outlier_share is None else outlier_share
            if not 0.0 < share < 1.0:
                raise ValueError(f"outlier_share must be a fraction in (0, 1), got {share!r}")
            sparse_bytes_per_token = DEFAULT_HEADROOM * dim * share
        if not sparse_bytes_per_token > 0:
            raise ValueError(f"sparse_bytes_per_token must be > 0, got {sparse_bytes_per_token!r}")
        max_record = _oaken.sparse_capacity(dim)
        return cls(
            dim=dim,
            block_size=block_size,
            unit=unit,
            sparse_units=max(1, math.ceil(block_size * sparse_bytes_per_token / unit)),
            len_bytes=1 if max_record <= 255 else 2,
            max_record=max_record,
            scale_bytes=_oaken.scale_bytes(config),
            inner_bits=config.inner_bits,
            outer_bits=config.outer_bits,
            sink_tokens=int(sink_tokens),
            static_grids=config.static_grids,
        )

    @property
    def header_units(self) -> int:
        return -(-2 * self.block_size * self.len_bytes // self.unit)

    @property
    def header_unit(self) -> int:
        """First unit of the header."""
        return 2 * self.block_size + 2 * self.sparse_units

    @property
    def sink_unit(self) -> int:
        """First unit of the sink area."""
        return self.header_unit + self.header_units

    @property
    def sink_units(self) -> int:
        """Units of the sink area: fp16 ``[2, sink_tokens, dim]``."""
        return -(-4 * self.sink_tokens * self.dim // self.unit)

    @property
    def units(self) -> int:
        """Units of one block."""
        return self.sink_unit + self.sink_units

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer: what vLLM's page size is set to."""
        return self.units * self.unit

    @property
    def sparse_area_bytes(self) -> int:
        """Bytes of one kind's sparse area in a block."""
        return self.sparse_units * self.unit

    @property
    def bytes_per_token(self) -> float:
        """Block bytes per token (K and V of one layer, everything included)."""
        return self.block_bytes / self.block_size

    def describe(self) -> dict[str, float | int]:
        return {
            "dim": self.dim,
            "block_size": self.block_size,
            "unit_bytes": self.unit,
            "units": self.units,
            "block_bytes": self.block_bytes,
            "bytes_per_token": self.bytes_per_token,
            "dense_bytes_per_token": 2 * self.unit,
            "sparse_capacity_per_token_and_kind": self.sparse_area_bytes / self.block_size,
            "len_bytes": self.len_bytes,
            "sink_tokens": self.sink_tokens,
            "sink_bytes_per_block": self.sink_units * self.unit,
            "static_grids": self.static_grids,
        }


def profile_outlier_share(thr: Any) -> float:
    """The largest sparse (inner + outer) share any layer and kind of profile ``thr`` (a ``Thresholds``) was profiled
    for, from its statistics (an oaken-plus search sets them per layer; ``alloc=1`` up to twice its average), or its
    config's ratios when it has none: what every block's sparse area is sized for (vLLM's pages are one size)."""
    stats = [*(thr.key_stats or ()), *(thr.value_stats or ())]
    if not stats:
        return float(thr.config.outlier_ratio)
    return max(float(s.outer_ratio) + float(s.inner_ratio) for s in stats)


def layer_static_grid(layout: BlockLayout, thresholds: np.ndarray) -> np.ndarray:
    """float32 ``[2, 4]``: the key and value static grids ``(mid_min, mid_max, inner_min, inner_max)`` of a layer
    with ``thresholds`` (float32 ``[2, 4]``) when its records have static grids, else ``[2, 0]`` (``NO_STATIC_GRID``:
    every record holds its six scales). What the writer encodes with and every reader restores."""
    if not layout.static_grids:
        return _oaken.NO_STATIC_GRID
    config = layout.config()
    thr = np.asarray(thresholds, np.float32).reshape(2, 4)
    return np.stack([_oaken.static_grid_array(thr[k], config) for k in range(2)])  # as the paged store's


# ------------------------------------------------------------------------------------------------ the pool


def pool_tensor(kv_cache: torch.Tensor, layout: BlockLayout) -> tuple[torch.Tensor, int]:
    """``(pool, units_per_block)``: one layer's cache (``uint8``, dim 0 the block, on any device) as a flat tensor
    from its first block on, sharing its memory, and the block stride in units."""
    if kv_cache.dtype != torch.uint8:
        raise ValueError(f"the Oaken KV cache must be a uint8 tensor, got {kv_cache.dtype}")
    num_blocks = kv_cache.shape[0]
    stride = kv_cache.stride(0)
    if stride % layout.unit or stride < layout.block_bytes:
        raise ValueError(
            f"block stride {stride} bytes must be a multiple of the {layout.unit}-byte record and hold a "
            f"{layout.block_bytes}-byte block"
        )
    nbytes = (num_blocks - 1) * stride + layout.block_bytes
    return torch.as_strided(kv_cache, (nbytes,), (1,), kv_cache.storage_offset()), stride // layout.unit


def pool_view(kv_cache: torch.Tensor, layout: BlockLayout) -> tuple[np.ndarray, int]:
    """:func:`pool_tensor` of a CPU cache as a numpy array (what the numba kernels take). Shares memory with
    ``kv_cache``."""
    if kv_cache.dtype != torch.uint8 or kv_cache.device.type != "cpu":
        raise ValueError(f"the Oaken KV cache must be a CPU uint8 tensor, got {kv_cache.dtype} on {kv_cache.device}")
    flat, units_per_block = pool_tensor(kv_cache, layout)
    return flat.numpy(), units_per_block


# ------------------------------------------------------------------------------------------------ numba kernels


@njit(cache=True, nogil=True)
def _length(pool, h, o, w):
    if w == 1:
        return np.int64(pool[h + o])
    return np.int64(pool[h + 2 * o]) | (np.int64(pool[h + 2 * o + 1]) << 8)


@njit(cache=True, nogil=True)
def _write_records(pool, unit, upb, bs, cs, hdr, w, slots, order, records, sparse, counts, start, info):
    """Write rows ``kind * n + i`` (keys ``kind = 0``, values 1) of token ``i`` into slot ``slots[i]``, tokens in
    the order ``order``, pairs ``(j, kind)`` from flat index ``start = 2 j + kind`` on: the addresses from the block
    layout, the bytes by the store's record writer (``put_record``), the length into the block's header.

    Returns 0 when everything is written; 1 at the first record that does not fit in its block's sparse area
    (``info = (flat index, sparse bytes before it in its block)``; nothing of that record written).
    """
    n = slots.shape[0]
    cap = cs * unit
    width = sparse.shape[1]
    rows = sparse.reshape(-1)
    for q in range(start, 2 * order.shape[0]):
        j = q >> 1
        kind = q & 1
        i = order[j]
        s = np.int64(slots[i])
        if s < 0:  # padding token
            continue
        blk = s // bs
        o = s - blk * bs
        base = blk * upb * unit
        h = base + hdr * unit + kind * bs * w
        off = np.int64(0)
        for t in range(o):
            off += _length(pool, h, t, w)
        r = kind * n + i
        cnt = counts[r]
        if off + cnt > cap:
            info[0] = q
            info[1] = off
            return 1
        _oaken.put_record(
            pool, records, r, base + (kind * bs + o) * unit, rows, r * width, cnt,
            base + (2 * bs + kind * cs) * unit + off,
        )  # fmt: skip
        if w == 1:
            pool[h + o] = np.uint8(cnt)
        else:
            pool[h + 2 * o] = np.uint8(cnt & 0xFF)
            pool[h + 2 * o + 1] = np.uint8(cnt >> 8)
    return 0


@njit(cache=True, nogil=True)
def _encode_and_write(
    pool, unit, upb, bs, cs, hdr, w, num_slots, ib, ob, sb, thr2, slots, x, thr, records, sparse, counts, info,
    shift, rotate, head_dim, rscale, n_sink, sink_unit, static2, static,
):  # fmt: skip
    """The step's write of one layer in one call: the online key transform of the ``n`` key rows of ``x`` (keys of
    the ``n`` tokens, then their values; ``shift`` float32 ``[D]`` or empty, ``rotate``: per-head Hadamard), the
    16-bit copies of tokens in a block's first ``n_sink`` slots, then the codec's ``encode_records`` of the ``2 n``
    rows and :func:`_write_records` in slot order. ``static2``: float32 ``[2, 4]``, the layer's key and value static
    grids (:func:`layer_static_grid`), or ``[2, 0]``; ``static`` the rows' buffer for them (``[2 n, 4]`` or
    ``[2 n, 0]``), filled here as ``thr`` is.

    Returns 0 (done), 1 (a record overflowed: ``info`` as :func:`_write_records`, with ``info[2]`` = 1 when the
    tokens were not in slot order: the caller then goes on with ``argsort(slots)``), 2 (the codec refused row
    ``info[0]``: ``counts`` holds ``-ERR_*``) or 3 (slot of token ``info[0]`` is past the cache).
    """
    n = slots.shape[0]
    d = x.shape[1]
    for i in range(n):
        if slots[i] >= num_slots:
            info[0] = i
            return 3
        for k in range(4):
            thr[i, k] = thr2[0, k]
            thr[n + i, k] = thr2[1, k]
        for k in range(static2.shape[1]):
            static[i, k] = static2[0, k]
            static[n + i, k] = static2[1, k]
    if shift.shape[0] or rotate:
        _oaken.shift_rotate_rows(x[:n], shift, rotate, head_dim, rscale)
    if n_sink:
        for i in range(n):
            s = np.int64(slots[i])
            if s < 0:
                continue
            blk = s // bs
            o = s - blk * bs
            if o >= n_sink:
                continue
            base = blk * upb * unit + sink_unit * unit
            for kind in range(2):
                at = base + (kind * n_sink + o) * d * 2
                for j in range(d):
                    bits = np.int64(_oaken.f32_to_f16_bits(x[kind * n + i, j]))
                    pool[at + 2 * j] = np.uint8(bits & 0xFF)
                    pool[at + 2 * j + 1] = np.uint8((bits >> 8) & 0xFF)
    _oaken.encode_records(x, thr, ib, ob, True, sb, records, sparse, counts, 4, static)
    for r in range(2 * n):
        if counts[r] < 0:
            info[0] = r
            return 2
    ordered = True
    last = np.int64(-1)
    for i in range(n):
        if slots[i] >= 0:
            if slots[i] <= last:
                ordered = False
            last = slots[i]
    info[2] = 0 if ordered else 1
    order = np.arange(n) if ordered else np.argsort(slots, kind="mergesort")
    return _write_records(pool, unit, upb, bs, cs, hdr, w, slots, order, records, sparse, counts, 0, info)


@njit(cache=True, nogil=True)
def _gather_rows(pool, unit, upb, bs, cs, hdr, w, maxlen, blocks, length, kind, dense, sparse, offsets):
    """Copy one kind's records of tokens ``0..length-1`` of a request (block ids ``blocks``) into page records:
    ``dense [length, unit]``, ``sparse`` (back to back), ``offsets [length + 1]``. Returns the sparse bytes, or
    ``-(t + 1)`` when token ``t``'s stored length is impossible (corrupt header)."""
    cap = cs * unit
    total = np.int64(0)
    off = np.int64(0)
    offsets[0] = 0
    for t in range(length):
        j = t // bs
        o = t - j * bs
        base = np.int64(blocks[j]) * upb * unit
        if o == 0:
            off = 0
        d0 = base + (kind * bs + o) * unit
        for k in range(unit):
            dense[t, k] = pool[d0 + k]
        ln = _length(pool, base + hdr * unit + kind * bs * w, o, w)
        if ln > maxlen or off + ln > cap:
            return -(t + 1)
        s0 = base + (2 * bs + kind * cs) * unit + off
        for k in range(ln):
            sparse[total + k] = pool[s0 + k]
        total += ln
        off += ln
        offsets[t + 1] = total
    return total


@njit(cache=True, nogil=True)
def _from_tokens(block_table, seq_lens, query_lens, prev_table, prev_lens, bs, out):
    """``out[r]``: the first token of row ``r`` whose tables may differ from the previous step's row ``r``: its
    previous length when the row kept every block that held those tokens and writes no token before that length
    (the same request going on, or one sharing its full prefix blocks: the same bytes either way), else 0."""
    prev_rows = prev_lens.shape[0]
    for r in range(seq_lens.shape[0]):
        f = np.int64(0)
        if r < prev_rows:
            p = np.int64(prev_lens[r])
            if 0 < p <= seq_lens[r] - query_lens[r]:
                same = True
                for j in range((p + bs - 1) // bs):
                    if block_table[r, j] != prev_table[r, j]:
                        same = False
                        break
                if same:
                    f = p
        out[r] = f


@njit(cache=True, nogil=True)
def _fill_keep(seq_lens, from_tokens, n_sink, keep):
    """``keep[r, t]`` = 1 for ``n_sink <= t < seq_lens[r]`` (the tokens a decode query reads from the pages; sink
    tokens are merged at 16 bits), from ``from_tokens[r]`` on; a row filled from 0 is cleared past its length."""
    width = keep.shape[1]
    for r in range(seq_lens.shape[0]):
        length = seq_lens[r]
        t0 = min(from_tokens[r], length)
        for t in range(t0, length):
            keep[r, t] = 1 if t >= n_sink else 0
        if t0 == 0:
            for t in range(length, width):
                keep[r, t] = 0


@njit(cache=True, nogil=True)
def _gather_lengths(pool, unit, upb, bs, cs, hdr, w, maxlen, block_table, seq_lens, from_tokens, out):
    """``out[r, kind, t]``: every token's sparse length, from ``from_tokens[r]`` on (the earlier ones are current).
    Returns 0, or ``-(r + 1)`` when a length of row ``r`` is impossible (corrupt header)."""
    cap = cs * unit
    for r in range(seq_lens.shape[0]):
        length = np.int64(seq_lens[r])
        t0 = min(np.int64(from_tokens[r]), length)
        for kind in range(2):
            off = np.int64(0)
            for t in range(t0 - t0 % bs, length):
                j = t // bs
                o = t - j * bs
                if o == 0:
                    off = 0
                h = np.int64(block_table[r, j]) * upb * unit + hdr * unit + kind * bs * w
                ln = _length(pool, h, o, w)
                off += ln
                if ln > maxlen or off > cap:
                    return -(r + 1)
                out[r, kind, t] = ln
    return 0


@njit(cache=True, nogil=True)
def _gather_sinks(pool, unit, upb, sink_unit, n_sink, block_table, rows, out):
    """``out [rows, 2, n_sink, D]`` (uint16 fp16 bits): the sink tokens of each row, from its first block."""
    d = out.shape[3]
    for r in range(rows):
        base = np.int64(block_table[r, 0]) * upb * unit + sink_unit * unit
        for kind in range(2):
            for o in range(n_sink):
                at = base + (kind * n_sink + o) * d * 2
                for j in range(d):
                    out[r, kind, o, j] = np.uint16(pool[at + 2 * j]) | (np.uint16(pool[at + 2 * j + 1]) << 8)


@njit(cache=True, nogil=True)
def _decode_span(pool, unit, sb, dense_pages, sparse_pages, sparse_first, sparse_count, lens, thr, ib, ob, ones,
                 sinks, n_sink, kind, t0, out, static):  # fmt: skip
    """Decode tokens ``t0 .. t0 + len(out)`` of one stream (one row and kind of a ``LayerView`` over blocks) into the
    float32 rows ``out``, with the attention kernel's block decoder (the codec's numbers); tokens below ``n_sink``
    are the 16-bit sink rows (``sinks [2, n_sink, D]`` uint16) instead. ``static``: float32 ``[4]``, the stream's
    static grid (records of the outer scales alone), or ``[0]``. Returns ``ERR_OK`` or an ``ERR_*`` code."""
    sp, off = _oaken.sparse_start(sparse_first, sparse_count, lens, t0)
    # (4: the plugin's blocks hold 4-bit slots: check_profile refuses profiles of other widths)
    st, sp, off = _oaken.decode_rows(
        pool, unit, unit, sb, dense_pages, sparse_pages, sparse_first, sparse_count, lens, thr, 4, ib, ob, ones, t0,
        sp, off, out, static,
    )  # fmt: skip
    for t in range(t0, min(n_sink, t0 + out.shape[0])):
        for j in range(out.shape[1]):
            out[t - t0, j] = _oaken.f16_widen(sinks[kind, t, j])
    return st


# ------------------------------------------------------------------------------------------------ writing


def clip_outliers(x: np.ndarray, thr: np.ndarray, keep: int) -> tuple[np.ndarray, int]:
    """A copy of row ``x`` (float32 ``[D]``) with at most ``keep`` values left in the inner and outer groups of
    thresholds ``thr = (to_lo, ti_lo, ti_hi, to_hi)``; returns it and the number of values moved.

    The outer values with the largest excess over their threshold are kept, then inner values; the others move
    to the edge of the middle group: outer values to their outer threshold (which is in the middle group), inner
    values just outside the nearer inner threshold. The overflow policy ``clip`` encodes this row instead.
    """
    to_lo, ti_lo, ti_hi, to_hi = (np.float32(v) for v in thr)
    x = np.array(x, dtype=np.float32, copy=True)
    inner = np.flatnonzero((x >= ti_lo) & (x <= ti_hi))
    upper, lower = x > to_hi, x < to_lo
    outer = np.flatnonzero(upper | lower)
    excess = np.where(upper, x - to_hi, to_lo - x)[outer]
    ranked = np.concatenate([outer[np.argsort(-excess, kind="stable")], inner])
    moved = ranked[max(keep, 0) :]
    v = x[moved]
    below, above = np.nextafter(ti_lo, np.float32(-np.inf)), np.nextafter(ti_hi, np.float32(np.inf))
    inner_to = np.where(v - ti_lo <= ti_hi - v, below, above)
    x[moved] = np.where(v > to_hi, to_hi, np.where(v < to_lo, to_lo, inner_to))
    return x, int(moved.size)


@dataclass
class OverflowStats:
    """Tokens whose COO record did not fit in their block (per kind), and the values the ``clip`` policy moved."""

    tokens: list[int] = field(default_factory=lambda: [0, 0])
    values_moved: int = 0
    written: int = 0

    def to_dict(self) -> dict[str, int]:
        return {
            "rows_written": self.written,
            "key_overflows": self.tokens[0],
            "value_overflows": self.tokens[1],
            "values_moved": self.values_moved,
        }


_NO_SHIFT = np.zeros(0, np.float32)


#: The writers' working rows, one set per thread and record shape: a step writes its layers one after another, so
#: they share one set instead of each holding its own (30 layers held 30 copies of a long prompt's rows), and a set
#: grown once (the engine's warm-up, the first long prompt) serves every layer after it.
_WRITE_SCRATCH = threading.local()


class BlockWriter:
    """Encodes new tokens with the codec and writes them into their block slots (one instance per layer).

    Args:
        layout: the block layout (its ``sink_tokens``: 16-bit copies of each block's first tokens).
        thresholds: float32 ``[2, 4]``: the layer's key and value thresholds.
        overflow: ``"clip"`` (default) or ``"error"`` (module docstring of ``oakenkv.integrations.vllm``).
        key_shift: float32 ``[D]`` subtracted from every key row before it is encoded (an oaken-plus profile's
            online shift), or None.
        key_rotation: rotate each key head by the normalised Hadamard matrix after the shift (``head_dim`` values).
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
    ) -> None:
        if overflow not in ("clip", "error"):
            raise ValueError(f"overflow policy must be 'clip' or 'error', got {overflow!r}")
        self.layout = layout
        self.thr = np.ascontiguousarray(thresholds, dtype=np.float32).reshape(2, 4)
        self.overflow = overflow
        self.stats = OverflowStats()
        self.shift = _NO_SHIFT if key_shift is None else np.ascontiguousarray(key_shift, np.float32).reshape(-1)
        if self.shift.size not in (0, layout.dim):
            raise ValueError(f"key_shift must hold {layout.dim} values, got {self.shift.size}")
        self.rotate = bool(key_rotation)
        self.head_dim = int(head_dim or layout.dim)
        if self.rotate and (self.head_dim & (self.head_dim - 1) or layout.dim % self.head_dim):
            raise ValueError(f"a key rotation needs a power-of-two head_dim dividing {layout.dim}, got {head_dim}")
        self.rscale = np.float32(1.0 / math.sqrt(self.head_dim))
        #: float32 ``[2, 4]`` (static grids) or ``[2, 0]``: the key and value grids the records are encoded with.
        self.static_grid = layer_static_grid(layout, self.thr)

    def _buffers(self, n: int) -> tuple[np.ndarray, ...]:
        """Working rows for ``n`` tokens' keys and values, from the calling thread's set for this record shape
        (:data:`_WRITE_SCRATCH`), grown when too small."""
        lay = self.layout
        key = (lay.dim, lay.unit, lay.max_record, self.static_grid.shape[1])
        sets = getattr(_WRITE_SCRATCH, "sets", None)
        if sets is None:
            sets = _WRITE_SCRATCH.sets = {}
        s = sets.get(key)
        if s is None or s[0].shape[0] < 2 * n:
            m = max(2 * n, 64, 2 * s[0].shape[0] if s is not None else 0)
            s = sets[key] = (
                np.empty((m, lay.dim), np.float32),
                np.empty((m, lay.unit), np.uint8),
                np.empty((m, lay.max_record), np.uint8),
                np.empty(m, np.int64),
                np.empty((m, 4), np.float32),
                np.empty((m, self.static_grid.shape[1]), np.float32),
            )
        return tuple(a[: 2 * n] for a in s)

    def write(
        self,
        pool: np.ndarray,
        units_per_block: int,
        slots: np.ndarray,
        keys: Tensorish,
        values: Tensorish,
        slot_names: np.ndarray | None = None,
    ):
        """Encode and store ``n`` tokens: ``keys`` / ``values`` ``[n, D]`` (any float dtype, or ``[n, H, hd]``),
        token ``i`` into slot ``slots[i]`` (``block * block_size + offset``; negative = padding, skipped).
        ``slot_names``: the slots an overflow message names instead (a caller writing a copy of some blocks: the
        device writer, ``device.DeviceBlockWriter``)."""
        lay = self.layout
        slots = np.ascontiguousarray(slots, dtype=np.int64)
        n = slots.shape[0]
        if n == 0:
            return
        num_blocks = (pool.shape[0] - lay.block_bytes) // (units_per_block * lay.unit) + 1
        x, records, sparse, counts, thr, static = self._buffers(n)
        x[:n] = _as_rows(keys, n, lay.dim)
        x[n:] = _as_rows(values, n, lay.dim)
        info = np.zeros(3, np.int64)
        status = _encode_and_write(
            pool, lay.unit, units_per_block, lay.block_size, lay.sparse_units, lay.header_unit, lay.len_bytes,
            num_blocks * lay.block_size, lay.inner_bits, lay.outer_bits, lay.scale_bytes, self.thr, slots, x, thr,
            records, sparse, counts, info, self.shift, self.rotate, self.head_dim, self.rscale, lay.sink_tokens,
            lay.sink_unit, self.static_grid, static,
        )  # fmt: skip
        if status == 3:
            raise IndexError(f"slot {int(slots[info[0]])} is past the cache's {num_blocks} blocks")
        if status == 2:
            r = int(info[0])
            kind = "keys" if r < n else "values"
            raise ValueError(f"cannot encode the {kind} of token {r % n}: {_oaken.ERROR_MESSAGES[int(-counts[r])]}")
        if status == 1:
            order = np.argsort(slots, kind="stable") if info[2] else np.arange(n)
            while True:
                start = int(info[0])
                self._overflow(
                    start, int(info[1]), n, slots if slot_names is None else slot_names, order, x, thr, static,
                    records, sparse, counts,
                )  # fmt: skip
                if not _write_records(
                    pool, lay.unit, units_per_block, lay.block_size, lay.sparse_units, lay.header_unit,
                    lay.len_bytes, slots, order, records, sparse, counts, start, info,
                ):  # fmt: skip
                    break
        self.stats.written += 2 * int(np.count_nonzero(slots >= 0))

    def _overflow(self, q: int, used: int, n: int, slots, order, x, thr, static, records, sparse, counts) -> None:
        lay = self.layout
        kind = q & 1
        i = int(order[q >> 1])
        r = kind * n + i
        room = lay.sparse_area_bytes - used
        slot = int(slots[i])
        self.stats.tokens[kind] += 1
        what = f"the {('key', 'value')[kind]} record of slot {slot} (block {slot // lay.block_size})"
        if self.overflow == "error":
            raise BlockOverflowError(
                f"{what} needs {int(counts[r])} sparse bytes, its block has {room} left of {lay.sparse_area_bytes} "
                "(overflow policy 'error'; raise OAKENKV_VLLM_SPARSE_BYTES or use 'clip')"
            )
        # Worst case a row of k outliers needs k entry bytes plus two escape bytes per chunk and one: keep k so
        # that it always fits, then encode the clipped row with the codec.
        chunks = -(-lay.dim // 64)
        keep = room - 2 * chunks - 1
        while True:
            row, moved = clip_outliers(x[r], thr[r], keep)
            _oaken.encode_records(
                row[None], thr[r : r + 1], lay.inner_bits, lay.outer_bits, True, lay.scale_bytes,
                records[r : r + 1], sparse[r : r + 1], counts[r : r + 1], 4, static[r : r + 1],
            )  # fmt: skip
            if 0 <= counts[r] <= room:
                break
            if keep <= 0:
                raise BlockOverflowError(f"{what}: no clipping of its outliers fits in {room} bytes")
            keep = 0
        self.stats.values_moved += moved


Tensorish = torch.Tensor | np.ndarray


def _as_rows(a: Tensorish, n: int, dim: int) -> np.ndarray:
    if isinstance(a, torch.Tensor):
        a = a.detach()
        a = a.numpy() if a.dtype == torch.float32 else a.to(torch.float32).numpy()
    a = np.asarray(a)[:n]
    if a.size != n * dim:
        raise ValueError(f"expected {n} rows of {dim} values, got shape {a.shape}")
    return a.reshape(n, dim)


# ------------------------------------------------------------------------------------------------ reading


def read_rows(
    pool: np.ndarray,
    units_per_block: int,
    layout: BlockLayout,
    blocks: np.ndarray,
    length: int,
    kind: int,
    static_grid: np.ndarray | None = None,
) -> _oaken.EncodedBatch:
    """The stored rows of tokens ``0..length-1`` of one request (block ids ``blocks``), keys (``kind`` 0) or
    values (1), as an ``EncodedBatch`` (decode it with the codec). Records of static grids need the layer's
    (``static_grid``, float32 ``[2, 4]``: :func:`layer_static_grid`) to restore the in-memory scales."""
    lay = layout
    if lay.static_grids and static_grid is None:
        raise ValueError("records of static grids are read with the layer's static grid (static_grid=)")
    nblk = -(-length // lay.block_size)
    blocks = np.ascontiguousarray(blocks[:nblk], dtype=np.int64)
    dense = np.empty((length, lay.unit), np.uint8)
    sparse = np.empty(nblk * lay.sparse_area_bytes, np.uint8)
    offsets = np.empty(length + 1, np.int64)
    total = _gather_rows(
        pool, lay.unit, units_per_block, lay.block_size, lay.sparse_units, lay.header_unit, lay.len_bytes,
        lay.max_record, blocks, length, kind, dense, sparse, offsets,
    )  # fmt: skip
    if total < 0:
        raise _oaken.CorruptDataError(f"token {-total - 1}: its stored sparse length does not fit its block")
    static = static_grid[kind] if lay.static_grids else None
    return _oaken.from_records(dense, sparse[:total], offsets, lay.dim, lay.config(), static)


def read_sinks(pool: np.ndarray, units_per_block: int, layout: BlockLayout, block: int) -> np.ndarray:
    """float16 ``[2, sink_tokens, D]``: the 16-bit key and value rows kept in block ``block``'s sink area."""
    out = np.empty((1, 2, layout.sink_tokens, layout.dim), np.uint16)
    _gather_sinks(
        pool, layout.unit, units_per_block, layout.sink_unit, layout.sink_tokens, np.array([[block]], np.int32), 1,
        out,
    )  # fmt: skip
    return out[0].view(np.float16)


def dequantize(
    pool: np.ndarray,
    units_per_block: int,
    layout: BlockLayout,
    blocks: np.ndarray,
    length: int,
    thresholds: np.ndarray,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``[length, D]`` keys and values of one request, decoded by the codec from its blocks (the Oaken
    rows: the sink area is not read)."""
    config = layout.config()
    grid = layer_static_grid(layout, thresholds)
    out = []
    for kind in (0, 1):
        enc = read_rows(pool, units_per_block, layout, blocks, length, kind, grid)
        out.append(_oaken.decode(enc, tuple(float(v) for v in thresholds[kind]), config))
    return out[0], out[1]


# ------------------------------------------------------------------------------------------------ the step's tables


class BlockTables:
    """Every request's page tables over vLLM's blocks, for the decode kernel and the prefill tiles: one
    ``LayerTables`` whose page ids all layers share (a layer's blocks sit at the same ids in its own pool) and one
    per layer for its sparse lengths (read from its blocks' headers).

    Kept across steps by the metadata builder: :meth:`update` refills a row only from the first token that can have
    changed (``_from_tokens``: a decode step adds one token per row), and a layer's lengths are read from the same
    token on when that layer was synced at the previous update; a row whose blocks changed is filled again whole.
    Rows are the step's requests in vLLM's order.
    """

    def __init__(self, layout: BlockLayout, units_per_block: int) -> None:
        self.layout = layout
        self.units_per_block = units_per_block
        self.shared = _oaken.LayerTables(0)
        self.keep = np.zeros((0, 64), np.uint8)
        self.step = -1
        self.prev_step = -2
        self._table = np.zeros((0, 1), np.int32)
        self.block_table = self._table
        self.seq_lens = np.zeros(0, np.int64)
        self.from_tokens = np.zeros(0, np.int64)
        self._layers: dict[int, tuple[_oaken.LayerTables, int]] = {}

    @property
    def rows(self) -> int:
        return self.seq_lens.shape[0]

    def update(self, step: int, block_table: np.ndarray, seq_lens: np.ndarray, query_lens: np.ndarray) -> None:
        """The tables of step ``step`` (``block_table`` int32 ``[R, >= blocks]``, ``seq_lens`` stored tokens after
        the step, ``query_lens`` tokens the step writes); a second call for the same step does nothing."""
        if step == self.step:
            return
        lay = self.layout
        bs = lay.block_size
        block_table = np.ascontiguousarray(block_table, np.int32)
        seq_lens = np.ascontiguousarray(seq_lens, np.int64)
        rows = seq_lens.shape[0]
        from_tokens = np.zeros(rows, np.int64)
        if self.seq_lens.shape[0]:
            _from_tokens(
                block_table, seq_lens, np.ascontiguousarray(query_lens, np.int64), self._table, self.seq_lens, bs,
                from_tokens,
            )  # fmt: skip
        self.shared.fill_blocks(
            block_table, seq_lens, from_tokens, self.units_per_block, bs, (2 * bs, 2 * bs + lay.sparse_units)
        )
        t_max = int(seq_lens.max()) if rows else 0
        self.keep = _oaken.grown(_oaken.grown(self.keep, rows, 0), t_max)
        _fill_keep(seq_lens, from_tokens, lay.sink_tokens, self.keep)
        # the previous step's block table, kept whole: the next update compares its rows
        self._table = block_table = block_table.copy()
        self.block_table = block_table
        self.seq_lens = seq_lens
        self.from_tokens = from_tokens
        self.prev_step, self.step = self.step, step

    def layer(self, layer: int, pool: np.ndarray) -> _oaken.LayerTables:
        """Layer ``layer``'s tables (over its blocks ``pool``) for this step: its sparse lengths brought up to date."""
        lt, synced = self._layers.get(layer, (None, -3))
        if lt is None:
            lt = _oaken.LayerTables(0)
        if synced == self.step:
            return lt
        lt.share_pages(self.shared)
        lay = self.layout
        start = self.from_tokens if synced == self.prev_step else np.zeros_like(self.from_tokens)
        bad = _gather_lengths(
            pool, lay.unit, self.units_per_block, lay.block_size, lay.sparse_units, lay.header_unit, lay.len_bytes,
            lay.max_record, self.block_table, self.seq_lens, start, lt.sparse_lengths,
        )  # fmt: skip
        if bad < 0:
            raise _oaken.CorruptDataError(f"row {-bad - 1}: a stored sparse length does not fit its block")
        self._layers[layer] = (lt, self.step)
        return lt

    def sinks(self, pool: np.ndarray, rows: int, start: int = 0, scratch: DecodeScratch | None = None) -> np.ndarray:
        """uint16 ``[rows, 2, sink_tokens, D]``: the sink tokens (fp16 bits) of rows ``start .. start + rows - 1``
        in this layer, from each row's first block (in a buffer of ``scratch`` when one is given)."""
        lay = self.layout
        shape = (rows, 2, lay.sink_tokens, lay.dim)
        out = scratch.get("sinks", shape, np.uint16) if scratch is not None else np.empty(shape, np.uint16)
        _gather_sinks(
            pool, lay.unit, self.units_per_block, lay.sink_unit, lay.sink_tokens, self.block_table[start:], rows, out
        )
        return out


@dataclass
class LayerParams:
    """What attention needs of one layer besides its blocks."""

    #: float32 ``[2, 4]``: key and value thresholds.
    thresholds: np.ndarray
    num_kv_heads: int
    scale: float
    softcap: float = 0.0
    #: Keys are rotated per head in the blocks (an oaken-plus key rotation): queries are rotated alike.
    key_rotation: bool = False
    #: float32 ``[2, 4]``: the key and value static grids of records with static grids (:func:`layer_static_grid`),
    #: ``[2, 0]`` otherwise.
    static_grid: np.ndarray = field(default_factory=lambda: _oaken.NO_STATIC_GRID)


def _rotate(q: np.ndarray, params: LayerParams) -> np.ndarray:
    return _oaken.fwht(q) if params.key_rotation else q


_NO_SHIFT = np.zeros(0, np.float32)


class DecodeScratch:
    """The decode step's buffers (rotated query, output, log-sum-exp, status), kept by a caller across steps and
    grown when a step has more rows or splits: a layer's decode then allocates nothing."""

    def __init__(self) -> None:
        self._bufs: dict[str, np.ndarray] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: type) -> np.ndarray:
        """A C-contiguous ``shape`` view of buffer ``name`` (its contents are whatever the last step left)."""
        n = math.prod(shape)
        a = self._bufs.get(name)
        if a is None or a.size < n or a.dtype != dtype:
            a = self._bufs[name] = np.empty(max(n, 2 * (a.size if a is not None else 0)), dtype)
        return a[:n].reshape(shape)


class RowThreads:
    """Threads of the plugin's own, one bound to each of ``cpus``, that attend a share of a decode step's rows
    (``packed_decode_attention_rows`` releases the GIL) while the worker's thread attends the rest.

    Why not numba's pool: vLLM's CPU worker binds its thread and its OpenMP threads to the cores it was given, and
    the threads of numba's pool (which shares the OpenMP runtime with torch) inherit that binding; on a machine
    where vLLM gives the worker fewer cores than it has (2 cores: one for the worker, one reserved for the engine
    process), a parallel kernel gets no core of its own. These threads are bound explicitly, to CPUs a deployer
    names (``OAKENKV_VLLM_ATTENTION_CPUS``). Each waits on an event between steps (no spinning)."""

    def __init__(self, cpus: Sequence[int]) -> None:
        self.cpus = tuple(int(c) for c in cpus)
        if not self.cpus:
            raise ValueError("RowThreads needs at least one CPU")
        if not hasattr(os, "sched_setaffinity"):
            raise ValueError("binding attention threads to CPUs needs os.sched_setaffinity (Linux)")
        n = len(self.cpus)
        self._go = [threading.Event() for _ in range(n)]
        self._done = [threading.Event() for _ in range(n)]
        self._jobs: list[Callable[[], None] | None] = [None] * n
        self._errors: list[BaseException | None] = [None] * n
        #: Calls of :meth:`run` so far (how often a step was shared).
        self.runs = 0
        #: Work taken so far (chunks of rows, prefill requests) by the caller's thread (0) and each of these.
        self.taken = [0] * (n + 1)
        self._index: dict[int, int] = {}
        self._threads = [
            threading.Thread(target=self._loop, args=(i,), name=f"oakenkv-attention-{c}", daemon=True)
            for i, c in enumerate(self.cpus)
        ]
        for t in self._threads:
            t.start()
        for i, done in enumerate(self._done):  # each thread reports its binding before serving a job
            done.wait()
            done.clear()
            if self._errors[i] is not None:
                err, self._errors[i] = self._errors[i], None
                self.close()
                raise ValueError(f"cannot bind an attention thread to CPU {self.cpus[i]}: {err}") from err

    def __len__(self) -> int:
        return len(self.cpus)

    def _loop(self, i: int) -> None:
        self._index[threading.get_ident()] = i + 1
        try:
            os.sched_setaffinity(0, {self.cpus[i]})  # pid 0: this thread (Linux binds threads, not processes)
        except Exception as e:  # reported by __init__, which waits for every thread's binding
            self._errors[i] = e
        self._done[i].set()
        if self._errors[i] is not None:
            return
        while True:
            self._go[i].wait()
            self._go[i].clear()
            job = self._jobs[i]
            if job is None:
                return
            try:
                job()
            except BaseException as e:  # handed to the caller's thread by run()
                self._errors[i] = e
            self._jobs[i] = None
            self._done[i].set()

    def run(self, jobs: Sequence[Callable[[], None]], own: Callable[[], None]) -> None:
        """Run ``jobs[i]`` on thread ``i`` and ``own`` on the calling thread; return when all are done, raising the
        first error any of them raised."""
        if len(jobs) > len(self._threads):
            raise ValueError(f"{len(jobs)} jobs for {len(self._threads)} threads")
        self.runs += 1
        for i, job in enumerate(jobs):
            self._jobs[i] = job
            self._done[i].clear()
            self._go[i].set()
        try:
            own()
        finally:
            for i in range(len(jobs)):
                self._done[i].wait()
        for i in range(len(jobs)):
            if self._errors[i] is not None:
                err, self._errors[i] = self._errors[i], None
                raise err

    def share(self, count: int, fn: Callable[[int], None]) -> None:
        """Call ``fn(i)`` for ``i`` in ``range(count)``, each on whichever thread (the caller's or one of these) is
        free next: ``next()`` of one ``itertools.count`` is atomic under the GIL. Counts each call in ``taken``."""
        items = itertools.count()

        def take() -> None:
            k = self._index.get(threading.get_ident(), 0)
            while (i := next(items)) < count:
                fn(i)
                self.taken[k] += 1

        self.run([take] * min(len(self._threads), count - 1), take)

    def close(self) -> None:
        """Stop the threads (they are daemons: a process may also just exit)."""
        for i, t in enumerate(self._threads):
            if t.is_alive():
                self._jobs[i] = None
                self._go[i].set()
                t.join()


def row_shares(seq_lens: np.ndarray, parts: int) -> np.ndarray:
    """Boundaries ``[0, b_1, ..., rows]`` of ``parts`` consecutive row ranges with about equal numbers of stored
    tokens (``seq_lens``: int ``[rows]``), each range at least one row (``parts <= rows``)."""
    rows = len(seq_lens)
    cum = np.cumsum(np.asarray(seq_lens, np.int64))
    total = int(cum[-1]) if rows else 0
    bounds = np.zeros(parts + 1, np.int64)
    bounds[parts] = rows
    for k in range(1, parts):
        b = int(np.searchsorted(cum, k * total / parts)) + 1 if total else k * rows // parts
        bounds[k] = min(max(b, bounds[k - 1] + 1), rows - (parts - k))
    return bounds


def decode_attention_rows(
    tables: BlockTables,
    layer: int,
    pool: np.ndarray,
    query: np.ndarray,
    params: LayerParams,
    threads: int = 1,
    scratch: DecodeScratch | None = None,
    row_threads: RowThreads | None = None,
) -> np.ndarray:
    """Attention of one query token for each of the first ``rows = len(query)`` rows (float32 ``[rows, Hq, hd]``)
    over their stored tokens in one layer's blocks: ``packed_decode_attention`` on the blocks' ``LayerView`` (split
    over threads from ``PARALLEL_MIN_TOKENS`` (row, token) pairs: ``split_work``), sink tokens merged at 16 bits.
    With ``row_threads`` (and as many rows as threads, counting the caller's), the rows are cut into ranges of about
    equal tokens instead (``row_shares``, ``ROW_CHUNKS_PER_THREAD`` per thread), which the threads take in turn
    and attend with ``packed_decode_attention_rows``: the serial kernel's numbers. Returns float32
    ``[rows, Hq, hd]``: a buffer of ``scratch`` when one is given (valid until its next use), else a new array."""
    lay = tables.layout
    rows, hq, hd = query.shape
    sc = scratch or DecodeScratch()
    lt = tables.layer(layer, pool)
    t_max = int(tables.seq_lens[:rows].max()) if rows else 0
    view = lt.view(
        pool, lay.unit, lay.unit, lay.scale_bytes, params.thresholds, lay.inner_bits, lay.outer_bits,
        params.num_kv_heads, rows=rows, static_grid=params.static_grid,
    )._replace(num_tokens=t_max)  # fmt: skip
    q = sc.get("q", (rows, hq, hd), np.float32)
    q[...] = query
    if params.key_rotation:  # fwht's arithmetic (calibrate.transforms), in place on the buffer
        _oaken.shift_rotate_rows(q.reshape(-1, hd), _NO_SHIFT, True, hd, np.float32(1.0 / math.sqrt(hd)))
    parts = len(row_threads) + 1 if row_threads is not None else 1
    share = parts > 1 and rows >= parts and rows * t_max >= ROW_THREADS_MIN_TOKENS
    parallel, splits = (False, 1) if share else _oaken.split_work(rows, t_max, threads)
    kernel = _oaken.packed_decode_attention if parallel else _oaken.packed_decode_attention_serial
    out = sc.get("out", (rows, hq, hd), np.float32) if scratch is not None else np.empty((rows, hq, hd), np.float32)
    lse = sc.get("lse", (rows, hq), np.float32)
    status = sc.get("status", (rows * splits,), np.int64)
    status[:] = 0
    scale, softcap = np.float32(params.scale), np.float32(params.softcap)
    keep = tables.keep[:rows]
    if share:
        assert row_threads is not None
        bounds = row_shares(tables.seq_lens[:rows], min(rows, parts * ROW_CHUNKS_PER_THREAD)).tolist()
        rk = _oaken.packed_decode_attention_rows
        row_threads.share(
            len(bounds) - 1, lambda c: rk(q, keep, scale, softcap, 1, bounds[c], bounds[c + 1], out, status, lse, *view)
        )
    else:
        kernel(q, keep, scale, softcap, splits, out, status, lse, *view)
    if status.any():
        code = int(status[np.flatnonzero(status)[0]])
        raise _oaken.CorruptDataError(f"Oaken KV blocks: {_oaken.ERROR_MESSAGES[code]}")
    n = lay.sink_tokens
    if n:
        sink_keep = sc.get("sink_keep", (rows, n), np.uint8)
        _sink_keep(tables.seq_lens, sink_keep)
        _oaken.merge_sinks(q, sink_keep, tables.sinks(pool, rows, scratch=sc), scale, softcap, out, lse)
    return out


@njit(cache=True, nogil=True)
def _sink_keep(seq_lens, keep):
    """``keep[r, j]`` = 1 where row ``r`` holds sink token ``j`` (``j < seq_lens[r]``)."""
    for r in range(keep.shape[0]):
        for j in range(keep.shape[1]):
            keep[r, j] = 1 if j < seq_lens[r] else 0


def _flash_with_lse():
    """torch's CPU flash attention that also returns each query's log-sum-exp (``aten::
    _scaled_dot_product_flash_attention_for_cpu``), or None where this torch lacks it."""
    return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def prefill_attention(
    tables: BlockTables,
    layer: int,
    pool: np.ndarray,
    row: int,
    query: torch.Tensor,
    params: LayerParams,
    tile: int = PREFILL_TILE,
    own: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    """Causal attention of row ``row``'s ``S`` query tokens (``query`` ``[S, Hq, hd]``, the last ``S`` positions of
    its ``L`` stored tokens) over its stored tokens, the chunk's own included. Returns float32 ``[S, Hq, hd]``.

    The tokens are dequantized from the blocks (the attention kernel's block decoder: the codec's numbers; sink
    tokens from their 16-bit copies) into small float32 buffers: the history ``tile`` tokens at a time, each tile
    attended without a mask, then the chunk's own ``S`` tokens, attended causally; the parts are merged by their
    log-sum-exp (torch's CPU flash attention returns it), so the history is never held in floats as a whole. With a
    logit soft cap (or a torch without that kernel) the same tiles go through a plain online-softmax loop.

    ``own``: for a chunk with no history (a prompt's first chunk), a causal float32 attention of the chunk over its
    own rows, ``own(q [S, Hq, hd], keys [S, D], values [S, D], scale, softcap) -> [S, Hq, hd]`` (the backend passes
    vLLM's own CPU kernel, ``chunk.ChunkAttention``: about twice torch's flash attention's speed); the tiles
    otherwise."""
    lay = tables.layout
    lt = tables.layer(layer, pool)
    length = int(tables.seq_lens[row])
    s, hq, hd = query.shape
    hkv = params.num_kv_heads
    group = hq // hkv
    history = length - s
    q = torch.from_numpy(_rotate(query.detach().to(torch.float32).numpy(), params))
    n_sink = min(lay.sink_tokens, length)
    sinks = tables.sinks(pool, 1, row)[0] if n_sink else np.zeros((2, 0, lay.dim), np.uint16)
    ones = np.ones(length, np.uint8)
    width = max(1, min(tile, history), s)
    kbuf = np.empty((width, lay.dim), np.float32)
    vbuf = np.empty((width, lay.dim), np.float32)

    def load_rows(t0: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens ``t0 .. t0 + n - 1``: float32 key and value rows ``[n, D]`` (views of the buffers)."""
        for kind, buf in ((0, kbuf), (1, vbuf)):
            st = _decode_span(
                pool, lay.unit, lay.scale_bytes, lt.dense_pages[row, kind], lt.sparse_pages[row, kind],
                lt.sparse_first[row, kind], lt.sparse_counts[row, kind], lt.sparse_lengths[row, kind],
                params.thresholds[kind], lay.inner_bits, lay.outer_bits, ones, sinks, n_sink, kind, t0, buf[:n],
                params.static_grid[kind],
            )  # fmt: skip
            if st:
                raise _oaken.CorruptDataError(f"Oaken KV blocks: {_oaken.ERROR_MESSAGES[int(st)]}")
        return kbuf[:n], vbuf[:n]

    def load(t0: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens ``t0 .. t0 + n - 1`` as float32 keys and values ``[1, Hq, n, hd]`` (KV heads repeated for GQA)."""
        load_rows(t0, n)
        k = torch.from_numpy(kbuf[:n]).view(1, n, hkv, 1, hd).expand(1, n, hkv, group, hd).reshape(1, n, hq, hd)
        v = torch.from_numpy(vbuf[:n]).view(1, n, hkv, 1, hd).expand(1, n, hkv, group, hd).reshape(1, n, hq, hd)
        return k.transpose(1, 2), v.transpose(1, 2)

    if own is not None and history == 0:
        k_rows, v_rows = load_rows(0, s)
        return own(q, k_rows, v_rows, params.scale, params.softcap)
    spans = [(t0, min(tile, history - t0), False) for t0 in range(0, history, tile)] + [(history, s, True)]
    qh = q.transpose(0, 1)[None].contiguous()  # [1, Hq, S, hd]
    flash = _flash_with_lse() if not params.softcap else None
    if flash is not None:
        outs, lses = [], []
        for t0, n, causal in spans:
            k, v = load(t0, n)
            o, lse = flash(qh, k, v, 0.0, causal, scale=params.scale)  # causal: queries and keys start together
            outs.append(o[0])
            lses.append(lse[0])
        if len(outs) == 1:
            out = outs[0]
        else:
            lse_all = torch.logsumexp(torch.stack(lses), dim=0)
            out = sum(o * torch.exp(lse - lse_all)[..., None] for o, lse in zip(outs, lses, strict=True))
        return out.transpose(0, 1)  # [S, Hq, hd]
    # the plain loop: a running max, sum and accumulator per query and head
    qpos = torch.arange(history, length)
    m = torch.full((hq, s), float("-inf"))
    ell = torch.zeros(hq, s)
    acc = torch.zeros(hq, s, hd)
    for t0, n, causal in spans:
        k, v = load(t0, n)
        sc = torch.matmul(qh[0], k[0].transpose(1, 2)) * params.scale
        if params.softcap:
            sc = torch.tanh(sc / params.softcap) * params.softcap
        if causal:
            sc.masked_fill_(~(torch.arange(t0, t0 + n)[None, :] <= qpos[:, None]), float("-inf"))
        m_new = torch.maximum(m, sc.amax(-1))
        corr = torch.exp(m - m_new)
        p = torch.exp(sc - m_new[..., None])
        ell = ell * corr + p.sum(-1)
        acc = acc * corr[..., None] + torch.matmul(p, v[0])
        m = m_new
    return (acc / ell[..., None]).transpose(0, 1)


def decode_attention(
    query: np.ndarray,
    pool: np.ndarray,
    units_per_block: int,
    layout: BlockLayout,
    block_table: np.ndarray,
    seq_lens: np.ndarray,
    thresholds: np.ndarray,
    num_kv_heads: int,
    scale: float,
    softcap: float = 0.0,
    threads: int = 1,
) -> np.ndarray:
    """Attention of one query token per row (``query`` float32 ``[rows, Hq, hd]``) over the rows' stored tokens
    (``block_table`` / ``seq_lens``): :func:`decode_attention_rows` on fresh tables. Returns float32
    ``[rows, Hq, hd]``."""
    tables = BlockTables(layout, units_per_block)
    tables.update(0, block_table, seq_lens, np.ones(len(seq_lens), np.int64))
    thr = np.ascontiguousarray(thresholds, dtype=np.float32).reshape(2, 4)
    params = LayerParams(thr, num_kv_heads, scale, softcap, static_grid=layer_static_grid(layout, thr))
    return decode_attention_rows(tables, 0, pool, query, params, threads)
