"""Oaken records inside vLLM's KV-cache blocks: the block layout, writing, reading and the decode-kernel tables.

No vLLM import: everything here works on a plain ``uint8`` array holding one layer's blocks, so it is tested
without vLLM (``tests/test_vllm_plugin.py``). ``docs/vllm.md`` has the diagram; in short, one block of ``B``
tokens of one layer, in units of ``rec = record_size(D)`` bytes (a dense record: six fp16 scales + nibbles)::

    unit 0           K dense records, token o at unit o
    unit B           V dense records, token o at unit B + o
    unit 2B          K sparse area (cS units): the block's K COO records back to back, in token order
    unit 2B + cS     V sparse area (cS units)
    unit 2B + 2cS    header: the sparse length of every token, K then V (``len_bytes`` each, little-endian)

A token's sparse record starts after those of the tokens before it in its block, so a reader walks a block in
token order; writes happen in token order too (vLLM fills a block front to back, and a rewritten slot is always
followed by rewrites of the later ones). Seen as a page pool of ``page_size = rec``, the layer's cache is
exactly what ``oakenkv.kernels.cpu.attention.packed_decode_attention`` reads: one dense page per token, one
sparse page per block and kind (:func:`decode_tables`).

Blocks need not be contiguous: block ``b`` starts at byte ``b * stride`` of the pool, ``stride`` a multiple of
``rec`` (``units_per_block = stride // rec``), so layouts that interleave layers work as well.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
from numba import njit

from oakenkv.integrations.vllm import _oaken

#: Default sparse capacity per token and kind, as a multiple of the expected COO bytes ``D x outlier ratio``.
DEFAULT_HEADROOM = 1.35


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
    #: Bytes of the six fp16 scales at the start of a dense record.
    scale_bytes: int
    inner_bits: int = 5
    outer_bits: int = 5

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.dim < 1 or self.sparse_units < 1:
            raise ValueError(f"invalid block layout {self}")

    @classmethod
    def make(
        cls, dim: int, block_size: int, config: _oaken.OakenConfig, sparse_bytes_per_token: float | None = None
    ) -> BlockLayout:
        """The layout for rows of ``dim`` values in blocks of ``block_size`` tokens.

        Args:
            config: the profile's config (needs fp16 scales; the ratios set the default sparse capacity).
            sparse_bytes_per_token: sparse capacity per token and kind (bytes), shared by the block's tokens;
                default ``DEFAULT_HEADROOM x dim x (outer_ratio + inner_ratio)``.
        """
        if config.scale_dtype != "float16":
            raise ValueError("the vLLM plugin stores fp16 scales; this profile uses scale_dtype='float32'")
        if not isinstance(dim, int) or not isinstance(block_size, int) or dim < 1 or block_size < 1:
            raise ValueError(f"dim and block_size must be positive ints, got {dim!r}, {block_size!r}")
        unit = _oaken.record_size(dim, config)
        if sparse_bytes_per_token is None:
            sparse_bytes_per_token = DEFAULT_HEADROOM * dim * config.outlier_ratio
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
        )

    @property
    def header_units(self) -> int:
        return -(-2 * self.block_size * self.len_bytes // self.unit)

    @property
    def header_unit(self) -> int:
        """First unit of the header."""
        return 2 * self.block_size + 2 * self.sparse_units

    @property
    def units(self) -> int:
        """Units of one block."""
        return self.header_unit + self.header_units

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
        }


# ------------------------------------------------------------------------------------------------ the pool


def pool_view(kv_cache: torch.Tensor, layout: BlockLayout) -> tuple[np.ndarray, int]:
    """``(pool, units_per_block)``: one layer's cache (a ``uint8`` tensor whose dim 0 is the block) as a flat
    numpy array from its first block on, and the block stride in units. Shares memory with ``kv_cache``."""
    if kv_cache.dtype != torch.uint8 or kv_cache.device.type != "cpu":
        raise ValueError(f"the Oaken KV cache must be a CPU uint8 tensor, got {kv_cache.dtype} on {kv_cache.device}")
    num_blocks = kv_cache.shape[0]
    stride = kv_cache.stride(0)
    if stride % layout.unit or stride < layout.block_bytes:
        raise ValueError(
            f"block stride {stride} bytes must be a multiple of the {layout.unit}-byte record and hold a "
            f"{layout.block_bytes}-byte block"
        )
    nbytes = (num_blocks - 1) * stride + layout.block_bytes
    flat = torch.as_strided(kv_cache, (nbytes,), (1,), kv_cache.storage_offset())
    return flat.numpy(), stride // layout.unit


# ------------------------------------------------------------------------------------------------ numba kernels


@njit(cache=True, nogil=True)
def _length(pool, h, o, w):
    if w == 1:
        return np.int64(pool[h + o])
    return np.int64(pool[h + 2 * o]) | (np.int64(pool[h + 2 * o + 1]) << 8)


@njit(cache=True, nogil=True)
def _write_records(pool, unit, upb, bs, cs, hdr, w, slots, order, records, sparse, counts, start, info):
    """Write rows ``kind * n + i`` (keys ``kind = 0``, values 1) of token ``i`` into slot ``slots[i]``, tokens in
    the order ``order``, pairs ``(j, kind)`` from flat index ``start = 2 j + kind`` on.

    Returns 0 when everything is written; 1 at the first record that does not fit in its block's sparse area
    (``info = (flat index, sparse bytes before it in its block)``; nothing of that record written).
    """
    n = slots.shape[0]
    cap = cs * unit
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
        d0 = base + (kind * bs + o) * unit
        for k in range(unit):
            pool[d0 + k] = records[r, k]
        s0 = base + (2 * bs + kind * cs) * unit + off
        for k in range(cnt):
            pool[s0 + k] = sparse[r, k]
        if w == 1:
            pool[h + o] = np.uint8(cnt)
        else:
            pool[h + 2 * o] = np.uint8(cnt & 0xFF)
            pool[h + 2 * o + 1] = np.uint8(cnt >> 8)
    return 0


@njit(cache=True, nogil=True)
def _encode_and_write(
    pool, unit, upb, bs, cs, hdr, w, num_slots, ib, ob, sb, thr2, slots, x, thr, records, sparse, counts, info
):
    """The decode step's write in one call: encode the ``2 n`` rows of ``x`` (keys of the ``n`` tokens, then their
    values) with the codec's ``encode_records``, then :func:`_write_records` in slot order.

    Returns 0 (done), 1 (a record overflowed: ``info`` as :func:`_write_records`, with ``info[2]`` = 1 when the
    tokens were not in slot order: the caller then goes on with ``argsort(slots)``), 2 (the codec refused row
    ``info[0]``: ``counts`` holds ``-ERR_*``) or 3 (slot of token ``info[0]`` is past the cache).
    """
    n = slots.shape[0]
    for i in range(n):
        if slots[i] >= num_slots:
            info[0] = i
            return 3
        for k in range(4):
            thr[i, k] = thr2[0, k]
            thr[n + i, k] = thr2[1, k]
    _oaken.encode_records(x, thr, ib, ob, True, sb, records, sparse, counts)
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
def _decode_tables(block_table, seq_lens, upb, bs, cs, dense_pages, sparse_pages, sparse_first, sparse_ptr, keep):
    """The page tables ``packed_decode_attention`` reads, for rows with block tables ``block_table`` and
    ``seq_lens`` tokens (``rec``-byte pages: one dense page per token, one sparse page per block and kind)."""
    num_rows = seq_lens.shape[0]
    t_max = dense_pages.shape[2]
    p = 0
    for r in range(num_rows):
        length = np.int64(seq_lens[r])
        nb = (length + bs - 1) // bs
        for kind in range(2):
            sparse_ptr[2 * r + kind] = p
            for j in range(nb):
                sparse_pages[p] = np.int64(block_table[r, j]) * upb + 2 * bs + kind * cs
                sparse_first[p] = j * bs
                p += 1
        for t in range(t_max):
            if t < length:
                u = np.int64(block_table[r, t // bs]) * upb + t % bs
                dense_pages[r, 0, t] = u
                dense_pages[r, 1, t] = u + bs
                keep[r, t] = 1
            else:
                dense_pages[r, 0, t] = 0
                dense_pages[r, 1, t] = 0
                keep[r, t] = 0
    sparse_ptr[2 * num_rows] = p


@njit(cache=True, nogil=True)
def _gather_lengths(pool, unit, upb, bs, cs, hdr, w, maxlen, block_table, seq_lens, out):
    """``out [rows, 2, T]``: every token's sparse length (0 past a row's end). Returns 0, or ``-(r + 1)`` when a
    length of row ``r`` is impossible (corrupt header)."""
    num_rows, _, t_max = out.shape
    cap = cs * unit
    for r in range(num_rows):
        length = np.int64(seq_lens[r])
        for kind in range(2):
            off = np.int64(0)
            for t in range(t_max):
                if t >= length:
                    out[r, kind, t] = 0
                    continue
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


class BlockWriter:
    """Encodes new tokens with the codec and writes them into their block slots (one instance per layer).

    Args:
        layout: the block layout.
        thresholds: float32 ``[2, 4]``: the layer's key and value thresholds.
        overflow: ``"clip"`` (default) or ``"error"`` (module docstring of ``oakenkv.integrations.vllm``).
    """

    def __init__(self, layout: BlockLayout, thresholds: np.ndarray, overflow: str = "clip") -> None:
        if overflow not in ("clip", "error"):
            raise ValueError(f"overflow policy must be 'clip' or 'error', got {overflow!r}")
        self.layout = layout
        self.thr = np.ascontiguousarray(thresholds, dtype=np.float32).reshape(2, 4)
        self.overflow = overflow
        self.stats = OverflowStats()
        self._scratch: tuple[np.ndarray, ...] | None = None

    def _buffers(self, n: int) -> tuple[np.ndarray, ...]:
        lay = self.layout
        s = self._scratch
        if s is None or s[0].shape[0] < 2 * n:
            m = max(2 * n, 64)
            s = (
                np.empty((m, lay.dim), np.float32),
                np.empty((m, lay.unit), np.uint8),
                np.empty((m, lay.max_record), np.uint8),
                np.empty(m, np.int64),
                np.empty((m, 4), np.float32),
            )
            self._scratch = s
        return tuple(a[: 2 * n] for a in s)

    def write(self, pool: np.ndarray, units_per_block: int, slots: np.ndarray, keys: Tensorish, values: Tensorish):
        """Encode and store ``n`` tokens: ``keys`` / ``values`` ``[n, D]`` (any float dtype, or ``[n, H, hd]``),
        token ``i`` into slot ``slots[i]`` (``block * block_size + offset``; negative = padding, skipped)."""
        lay = self.layout
        slots = np.ascontiguousarray(slots, dtype=np.int64)
        n = slots.shape[0]
        if n == 0:
            return
        num_blocks = (pool.shape[0] - lay.block_bytes) // (units_per_block * lay.unit) + 1
        x, records, sparse, counts, thr = self._buffers(n)
        x[:n] = _as_rows(keys, n, lay.dim)
        x[n:] = _as_rows(values, n, lay.dim)
        info = np.zeros(3, np.int64)
        status = _encode_and_write(
            pool, lay.unit, units_per_block, lay.block_size, lay.sparse_units, lay.header_unit, lay.len_bytes,
            num_blocks * lay.block_size, lay.inner_bits, lay.outer_bits, lay.scale_bytes, self.thr, slots, x, thr,
            records, sparse, counts, info,
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
                self._overflow(start, int(info[1]), n, slots, order, x, thr, records, sparse, counts)
                if not _write_records(
                    pool, lay.unit, units_per_block, lay.block_size, lay.sparse_units, lay.header_unit,
                    lay.len_bytes, slots, order, records, sparse, counts, start, info,
                ):  # fmt: skip
                    break
        self.stats.written += 2 * int(np.count_nonzero(slots >= 0))

    def _overflow(self, q: int, used: int, n: int, slots, order, x, thr, records, sparse, counts) -> None:
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
                records[r : r + 1], sparse[r : r + 1], counts[r : r + 1],
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
    pool: np.ndarray, units_per_block: int, layout: BlockLayout, blocks: np.ndarray, length: int, kind: int
) -> _oaken.EncodedBatch:
    """The stored rows of tokens ``0..length-1`` of one request (block ids ``blocks``), keys (``kind`` 0) or
    values (1), as an ``EncodedBatch`` (decode it with the codec)."""
    lay = layout
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
    config = _oaken.OakenConfig(inner_bits=lay.inner_bits, outer_bits=lay.outer_bits)
    return _oaken.from_records(dense, sparse[:total], offsets, lay.dim, config)


def dequantize(
    pool: np.ndarray,
    units_per_block: int,
    layout: BlockLayout,
    blocks: np.ndarray,
    length: int,
    thresholds: np.ndarray,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``[length, D]`` keys and values of one request, decoded by the codec from its blocks."""
    config = _oaken.OakenConfig(inner_bits=layout.inner_bits, outer_bits=layout.outer_bits)
    out = []
    for kind in (0, 1):
        enc = read_rows(pool, units_per_block, layout, blocks, length, kind)
        out.append(_oaken.decode(enc, tuple(float(v) for v in thresholds[kind]), config))
    return out[0], out[1]


@dataclass
class DecodeTables:
    """The page tables of :func:`packed_decode_attention` for a set of rows; the same for every layer."""

    dense_pages: np.ndarray
    sparse_pages: np.ndarray
    sparse_first: np.ndarray
    sparse_ptr: np.ndarray
    keep: np.ndarray
    block_table: np.ndarray
    seq_lens: np.ndarray


def decode_tables(
    block_table: np.ndarray, seq_lens: np.ndarray, layout: BlockLayout, units_per_block: int
) -> DecodeTables:
    """Tables for rows with ``block_table [rows, >= blocks]`` and ``seq_lens [rows]`` stored tokens."""
    seq_lens = np.ascontiguousarray(seq_lens, dtype=np.int64)
    block_table = np.ascontiguousarray(block_table, dtype=np.int32)
    rows = seq_lens.shape[0]
    t_max = int(seq_lens.max()) if rows else 0
    bs = layout.block_size
    nblocks = int(((seq_lens + bs - 1) // bs).sum())
    tables = DecodeTables(
        dense_pages=np.empty((rows, 2, t_max), np.int32),
        sparse_pages=np.empty(2 * nblocks, np.int32),
        sparse_first=np.empty(2 * nblocks, np.int32),
        sparse_ptr=np.empty(2 * rows + 1, np.int64),
        keep=np.empty((rows, t_max), np.uint8),
        block_table=block_table,
        seq_lens=seq_lens,
    )
    if rows:
        _decode_tables(
            block_table, seq_lens, units_per_block, bs, layout.sparse_units, tables.dense_pages,
            tables.sparse_pages, tables.sparse_first, tables.sparse_ptr, tables.keep,
        )  # fmt: skip
    return tables


class DecodeBatch:
    """One step's decode rows: the page tables and the buffers every layer reuses (the tables depend only on
    vLLM's block tables, the same for all layers; the sparse lengths are gathered per layer)."""

    def __init__(
        self,
        block_table: np.ndarray,
        seq_lens: np.ndarray,
        layout: BlockLayout,
        units_per_block: int,
        num_heads: int,
        head_size: int,
        threads: int = 1,
    ) -> None:
        self.layout = layout
        self.units_per_block = units_per_block
        self.tables = t = decode_tables(block_table, seq_lens, layout, units_per_block)
        rows, _, t_max = t.dense_pages.shape
        self.num_tokens = t_max
        # the format's LayerView takes each stream's sparse pages padded to [rows, 2, max count] with counts
        counts = np.diff(t.sparse_ptr).reshape(rows, 2) if rows else np.zeros((0, 2), np.int64)
        width = max(1, int(counts.max())) if rows else 1
        self.sparse_counts = np.ascontiguousarray(counts, dtype=np.int64)
        self.sparse_pages = np.zeros((rows, 2, width), np.int32)
        self.sparse_first = np.zeros((rows, 2, width), np.int32)
        if rows:
            stream = np.repeat(np.arange(2 * rows), counts.reshape(-1))
            slot = np.arange(t.sparse_ptr[-1]) - t.sparse_ptr[stream]
            self.sparse_pages.reshape(2 * rows, width)[stream, slot] = t.sparse_pages[: t.sparse_ptr[-1]]
            self.sparse_first.reshape(2 * rows, width)[stream, slot] = t.sparse_first[: t.sparse_ptr[-1]]
        self.lens = np.empty((rows, 2, t_max), np.uint16)
        self.out = np.empty((rows, num_heads, head_size), np.float32)
        #: the kernel's log-sum-exp per row and head (written, not read: the plugin stores no sink tokens)
        self.lse = np.empty((rows, num_heads), np.float32)
        import numba

        threads = min(threads, numba.config.NUMBA_NUM_THREADS)
        parallel, self.splits = _oaken.split_work(rows, t_max, threads)
        if parallel:
            self.threads, self.kernel = threads, _oaken.packed_decode_attention
        else:
            self.threads, self.kernel = 1, _oaken.packed_decode_attention_serial
        self.status = np.zeros(rows * self.splits, np.int64)

    def layer_view(self, pool: np.ndarray, thresholds: np.ndarray, num_kv_heads: int) -> _oaken.LayerView:
        """The rows' tokens in one layer's blocks (``pool``) as the format's ``LayerView``: what the decode kernels
        read (numba's ``packed_decode_attention``; the Triton kernels through ``from_layer_view``). Dense pages are
        single records (``page_size = record_size``); each block adds one sparse page per kind."""
        lay, t = self.layout, self.tables
        bad = _gather_lengths(
            pool, lay.unit, self.units_per_block, lay.block_size, lay.sparse_units, lay.header_unit, lay.len_bytes,
            lay.max_record, t.block_table, t.seq_lens, self.lens,
        )  # fmt: skip
        if bad < 0:
            raise _oaken.CorruptDataError(f"row {-bad - 1}: a stored sparse length does not fit its block")
        return _oaken.LayerView(
            pool, lay.unit, lay.unit, lay.scale_bytes, self.num_tokens, t.dense_pages, self.sparse_pages,
            self.sparse_first, self.sparse_counts, self.lens, thresholds, lay.inner_bits, lay.outer_bits, num_kv_heads,
        )  # fmt: skip

    def attend(
        self,
        query: np.ndarray,
        pool: np.ndarray,
        thresholds: np.ndarray,
        num_kv_heads: int,
        scale: float,
        softcap: float = 0.0,
    ) -> np.ndarray:
        """Attention of the rows' query tokens (float32 ``[rows, Hq, hd]``) over one layer's blocks (``pool``);
        returns float32 ``[rows, Hq, hd]`` (a buffer the next call overwrites)."""
        view = self.layer_view(pool, thresholds, num_kv_heads)
        if self.threads > 1:
            import numba

            if numba.get_num_threads() != self.threads:
                numba.set_num_threads(self.threads)
        self.status[:] = 0
        self.kernel(
            np.ascontiguousarray(query, dtype=np.float32), self.tables.keep, np.float32(scale), np.float32(softcap),
            self.splits, self.out, self.status, self.lse, *view,
        )  # fmt: skip
        if self.status.any():
            code = int(self.status[np.flatnonzero(self.status)[0]])
            raise _oaken.CorruptDataError(f"Oaken KV blocks: {_oaken.ERROR_MESSAGES[code]}")
        return self.out


def decode_attention(
    query: np.ndarray,
    pool: np.ndarray,
    units_per_block: int,
    layout: BlockLayout,
    tables: DecodeTables,
    thresholds: np.ndarray,
    num_kv_heads: int,
    scale: float,
    softcap: float = 0.0,
    threads: int = 1,
) -> np.ndarray:
    """Attention of one query token per row (``query`` float32 ``[rows, Hq, hd]``) over the rows' stored tokens:
    ``packed_decode_attention`` on the blocks. Returns float32 ``[rows, Hq, hd]``.

    ``threads > 1`` runs numba's parallel kernel (split over rows and token ranges) once there are at least
    ``PARALLEL_MIN_TOKENS`` (row, token) pairs (``oakenkv.kernels.cpu.attention.split_work``); the default is the
    serial kernel on the calling thread.
    """
    _, hq, hd = query.shape
    batch = DecodeBatch(tables.block_table, tables.seq_lens, layout, units_per_block, hq, hd, threads)
    thr = np.ascontiguousarray(thresholds, dtype=np.float32).reshape(2, 4)
    return batch.attend(query, pool, thr, num_kv_heads, scale, softcap).copy()
