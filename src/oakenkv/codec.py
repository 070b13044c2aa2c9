"""The fused dense-and-sparse bit format of Oaken (Kim et al., ISCA 2025, Section 5.2): layout, reference pack and
unpack in plain PyTorch, and effective-bit accounting from the bytes actually produced.

One *row* is one quantization vector of ``D`` values (one token's keys or values of one layer; see
``oakenkv.quant``). Its stored form, in the order a page holds it (``docs/format.md`` has the full diagram)::

    header  u16 little-endian     S = number of sparse bytes of this row                      16 bits
    scales  6 x fp16 (or fp32)    mid_min mid_max inner_min inner_max outer_min outer_max     96 (192) bits
    dense   ceil(D/2) bytes       byte j = code[2j] & 0xF | (code[2j+1] & 0xF) << 4            4 bits / value
    sparse  S bytes               one COO entry byte per inner/outer value (+ rare escapes)   8 bits / outlier

Dense slots, nibble order: value ``2j`` is the LOW nibble of byte ``j``, value ``2j+1`` the HIGH nibble. A middle
value stores its whole 4-bit code there; an inner or outer value stores the low 4 bits of its 5-bit code. For odd
``D`` the high nibble of the last byte is padding and is written as 0.

COO entry byte (one per inner or outer value, sorted by position)::

    bit   7      6      5 4 3 2 1 0
        +------+------+-------------+
        | c[4] | grp  |  index i    |     position = 64 * chunk + i,  grp: 0 inner, 1 outer
        +------+------+-------------+     c[4]: bit 4 of the 5-bit code (0 for a 4-bit group)

The side (upper/lower) of an outer or middle value is not stored: it is the sign of the dequantized shifted value
(see ``oakenkv.quant``), so the paper's "sign" bit is the fifth code bit here.

The chunk of an entry is implicit (the lead's design, chosen over per-chunk counts because 64 chunks x 7 bits of
counts would cost 0.11 bit/value at D = 4096, more than the whole 4.83-bit budget leaves). Decoder state: chunk
``c = 0``, last index ``p = -1``, previous byte ``prev = 0x00`` (virtual). For each byte ``e``:

* ``e == prev``: an ESCAPE. The next bytes are a chunk advance ``k``: a run of ``0xFF`` bytes (each adds 255)
  closed by one byte ``< 0xFF`` (added too). Then ``c += k``, ``p = -1``, ``prev = None`` (no byte equals it, so
  the byte after an advance is always an entry).
* otherwise ``i = e & 63``; if ``i <= p`` then ``c += 1`` (natural advance to the next chunk); the entry is at
  ``64 * c + i``; ``p = i``; ``prev = e``.

The encoder writes an escape (a copy of ``prev``, ``0x00`` at the row start) only where the natural rule would
decode wrongly: the entry is more than one chunk ahead, one chunk ahead with ``i > p``, or its byte equals
``prev``. Within a chunk indices strictly increase, so a chunk of 64 outliers is just 64 increasing bytes. After
any entry the state is ``(its chunk, its index, its byte)`` whether or not an escape preceded it, so whether an
entry needs an escape depends only on the entry before it. An advance of 0 only ever occurs at the row start.

Decoding untrusted bytes validates everything it reads and raises :class:`CorruptDataError` (never reads out of
bounds): an escape must be followed by its advance and an entry, an advance of 0 is only legal before the first
entry, every position must be ``< D`` (so positions strictly increase and there are at most ``D`` entries), a
fifth code bit is only legal for a 5-bit group, and offsets, shapes and scales must be consistent and finite.
Corruption of the dense nibbles is undetectable (every nibble is a valid code); the format has no checksum.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from oakenkv.config import OakenConfig
from oakenkv.quant import GROUP_INNER, GROUP_MIDDLE, GROUP_OUTER, QuantizedVectors, ThresholdsLike, group_bits

#: Values addressed by one 6-bit COO index.
CHUNK_SIZE = 64
#: Dense slot width: one nibble per value.
DENSE_BITS = 4
#: Bits of one COO entry (6 index + 1 group + 1 fifth code bit).
COO_ENTRY_BITS = 8
#: Bit masks of the COO entry byte.
COO_INDEX_MASK = 0x3F
COO_GROUP_BIT = 0x40
COO_CODE_BIT4 = 0x80
#: Escape advance bytes: ``ADVANCE_CONTINUE`` adds 255 and another advance byte follows.
ADVANCE_CONTINUE = 0xFF
#: Scales stored per row, in this order (index = 2 * group id + {0: min, 1: max}).
SCALE_NAMES = ("mid_min", "mid_max", "inner_min", "inner_max", "outer_min", "outer_max")
NUM_SCALES = len(SCALE_NAMES)
#: Width of the per-row header: the row's sparse byte count.
HEADER_BITS = 16
#: Largest sparse byte count a 16-bit header can hold.
MAX_ROW_SPARSE_BYTES = 2**HEADER_BITS - 1
#: Largest supported row width. Worst case a row holds D entry bytes plus one escape (2 bytes + 1 per 255 chunks of
#: advance) per chunk: 32768 + 2 * 512 + 3 < 65535, so the 16-bit header can never overflow.
MAX_DIM = 32768

# The header bound above, checked at import like ggml's static_asserts.
assert MAX_DIM + 2 * (MAX_DIM // CHUNK_SIZE) + MAX_DIM // CHUNK_SIZE // 255 + 1 <= MAX_ROW_SPARSE_BYTES
assert CHUNK_SIZE - 1 == COO_INDEX_MASK and COO_INDEX_MASK | COO_GROUP_BIT | COO_CODE_BIT4 == 0xFF


class CorruptDataError(ValueError):
    """Encoded bytes that are not a valid Oaken stream (truncated, corrupted or of another shape)."""


@dataclass
class EncodedBatch:
    """Rows in the fused dense-and-sparse format.

    Attributes:
        dense: uint8 ``[N, ceil(D/2)]``; nibble ``j % 2`` (low first) of byte ``j // 2`` is value ``j``'s slot.
        scales: ``[N, 6]`` float16 (or float32): ``mid_min, mid_max, inner_min, inner_max, outer_min, outer_max``.
        sparse: uint8 ``[S]``; the COO byte streams of all rows, concatenated.
        sparse_offsets: int64 ``[N + 1]``; row ``r``'s stream is ``sparse[off[r]:off[r + 1]]``. The stored per-row
            cost of this is the 16-bit header (the count ``off[r + 1] - off[r]``).
        dim: ``D``, the number of values per row.
    """

    dense: torch.Tensor
    scales: torch.Tensor
    sparse: torch.Tensor
    sparse_offsets: torch.Tensor
    dim: int

    @property
    def num_rows(self) -> int:
        return int(self.dense.shape[0])

    def row_sparse(self, r: int) -> torch.Tensor:
        """uint8 ``[S_r]``: the COO stream of row ``r``."""
        return self.sparse[int(self.sparse_offsets[r]) : int(self.sparse_offsets[r + 1])]

    def nbytes(self) -> int:
        """Bytes of the stored form: dense + sparse + scales + the 2-byte header of every row."""
        n = self.num_rows
        return (
            self.dense.numel()
            + self.sparse.numel()
            + self.scales.numel() * self.scales.element_size()
            + n * HEADER_BITS // 8
        )


@dataclass(frozen=True)
class BitBreakdown:
    """Effective bits per value of an :class:`EncodedBatch`, from its bytes. ``total`` is the sum of the parts."""

    dense: float
    sparse: float
    scales: float
    header: float
    total: float
    #: Number of rows and values the figures are averaged over.
    num_rows: int
    num_values: int
    #: COO entries (= inner + outer values) and escape bytes (escape + advance bytes) inside ``sparse``.
    num_entries: int
    num_escape_bytes: int

    @property
    def sparse_escape(self) -> float:
        """Bits per value spent on escapes (part of ``sparse``)."""
        return 8.0 * self.num_escape_bytes / max(self.num_values, 1)

    def to_dict(self) -> dict[str, float | int]:
        return {
            "total": self.total,
            "dense": self.dense,
            "sparse": self.sparse,
            "sparse_escape": self.sparse_escape,
            "scales": self.scales,
            "header": self.header,
            "scales_share": self.scales / self.total if self.total else 0.0,
            "outlier_fraction": self.num_entries / max(self.num_values, 1),
            "escape_bytes_per_row": self.num_escape_bytes / max(self.num_rows, 1),
            "num_rows": self.num_rows,
            "num_values": self.num_values,
            "num_entries": self.num_entries,
            "num_escape_bytes": self.num_escape_bytes,
        }


def dense_bytes(dim: int) -> int:
    """Bytes of the dense part of one row of ``dim`` values."""
    return (dim + 1) // 2


def num_chunks(dim: int) -> int:
    """64-value chunks of one row (the last one may be partial)."""
    return (dim + CHUNK_SIZE - 1) // CHUNK_SIZE


def scale_torch_dtype(config: OakenConfig) -> torch.dtype:
    return torch.float16 if config.scale_dtype == "float16" else torch.float32


def _check_dim(dim: int) -> None:
    if not isinstance(dim, int) or not 1 <= dim <= MAX_DIM:
        raise ValueError(f"row width D must be an int in [1, {MAX_DIM}], got {dim!r}")


# --------------------------------------------------------------------------------------------------------------
# Reference pack / unpack (plain PyTorch + Python loops over the COO stream: slow and obvious)
# --------------------------------------------------------------------------------------------------------------


def _encode_coo_row(positions: list[int], entry_bytes: list[int]) -> list[int]:
    """The COO byte stream of one row from its outliers' positions (increasing) and entry bytes."""
    out: list[int] = []
    c, p, prev = 0, -1, 0x00
    for pos, e in zip(positions, entry_bytes, strict=True):
        cc, i = divmod(pos, CHUNK_SIZE)
        natural = e != prev and ((cc == c and i > p) or (cc == c + 1 and i <= p))
        if not natural:
            out.append(prev)  # escape: a copy of the previous byte
            k = cc - c
            while k >= ADVANCE_CONTINUE:
                out.append(ADVANCE_CONTINUE)
                k -= ADVANCE_CONTINUE
            out.append(k)
        out.append(e)
        c, p, prev = cc, i, e
    return out


def _decode_coo_row(stream: list[int], dim: int, row: int) -> tuple[list[int], list[int]]:
    """Positions and entry bytes of one row's COO stream; raises CorruptDataError on any invalid byte."""
    positions: list[int] = []
    entries: list[int] = []
    c, p, prev = 0, -1, 0x00
    j, n = 0, len(stream)
    while j < n:
        e = stream[j]
        j += 1
        if prev is not None and e == prev:
            k = 0
            while True:
                if j >= n:
                    raise CorruptDataError(f"row {row}: escape at sparse byte {j - 1} is cut off before its advance")
                a = stream[j]
                j += 1
                k += a
                if a != ADVANCE_CONTINUE:
                    break
            if k == 0 and p != -1:
                raise CorruptDataError(f"row {row}: zero chunk advance after an entry (sparse byte {j - 1})")
            if j >= n:
                raise CorruptDataError(f"row {row}: escape ending at sparse byte {j - 1} is not followed by an entry")
            c += k
            p, prev = -1, None
            continue
        i = e & COO_INDEX_MASK
        if i <= p:
            c += 1
        pos = c * CHUNK_SIZE + i
        if pos >= dim:
            raise CorruptDataError(f"row {row}: COO entry at sparse byte {j - 1} points at value {pos} >= D = {dim}")
        positions.append(pos)
        entries.append(e)
        p, prev = i, e
    return positions, entries


def _check_quantized(q: QuantizedVectors, config: OakenConfig) -> None:
    if q.codes.dim() != 2 or q.codes.shape != q.groups.shape:
        raise ValueError(f"codes and groups must both be [N, D], got {tuple(q.codes.shape)}, {tuple(q.groups.shape)}")
    if q.codes.dtype != torch.uint8 or q.groups.dtype != torch.uint8:
        raise ValueError(f"codes and groups must be uint8, got {q.codes.dtype}, {q.groups.dtype}")
    n, d = q.codes.shape
    _check_dim(int(d))
    if q.mins.shape != (n, 3) or q.maxs.shape != (n, 3):
        raise ValueError(f"mins and maxs must be [N, 3] = [{n}, 3], got {tuple(q.mins.shape)}, {tuple(q.maxs.shape)}")
    if q.groups.numel() and int(q.groups.max()) > GROUP_OUTER:
        raise ValueError("groups must be GROUP_MIDDLE, GROUP_INNER or GROUP_OUTER")
    for g, b in enumerate(group_bits(config)):
        member = q.groups == g
        if member.any() and int(q.codes[member].max()) >= 2**b:
            raise ValueError(f"a code of group {g} does not fit in its {b} bits")


def pack(q: QuantizedVectors, config: OakenConfig | None = None) -> EncodedBatch:
    """Reference packer: the quantizer's codes and scales as an :class:`EncodedBatch` (bit-exact, lossless).

    Args:
        q: output of :func:`oakenkv.quant.quantize` (codes/groups uint8 ``[N, D]``, mins/maxs ``[N, 3]``).
        config: the config ``q`` was quantized with (only the group bits are used; default: the paper's).
    """
    config = config or OakenConfig()
    _check_quantized(q, config)
    n, d = q.codes.shape
    codes = q.codes.to(torch.uint8)
    # dense: pad odd D with one 0 nibble, then low nibble = even value, high nibble = odd value.
    nib = codes & 0xF
    if d % 2:
        nib = torch.cat([nib, torch.zeros((n, 1), dtype=torch.uint8)], dim=1)
    dense = (nib[:, 0::2] | (nib[:, 1::2] << 4)).contiguous()
    # scales: [mid_min, mid_max, inner_min, inner_max, outer_min, outer_max]
    scales = torch.stack([q.mins, q.maxs], dim=2).reshape(n, 6).to(scale_torch_dtype(config)).contiguous()
    # sparse: one entry byte per outlier, then the per-row stream with escapes.
    outlier = q.groups != GROUP_MIDDLE
    col = torch.arange(d, dtype=torch.int64).expand(n, d)
    entry = (
        (col % CHUNK_SIZE).to(torch.int64)
        | torch.where(q.groups == GROUP_OUTER, COO_GROUP_BIT, 0)
        | (((codes.to(torch.int64) >> 4) & 1) << 7)
    )
    streams: list[int] = []
    offsets = [0]
    for r in range(n):
        m = outlier[r]
        row = _encode_coo_row(col[r][m].tolist(), entry[r][m].tolist())
        if len(row) > MAX_ROW_SPARSE_BYTES:  # unreachable for D <= MAX_DIM; kept as the format's invariant
            raise ValueError(f"row {r} needs {len(row)} sparse bytes, more than the 16-bit header allows")
        streams.extend(row)
        offsets.append(len(streams))
    return EncodedBatch(
        dense=dense,
        scales=scales,
        sparse=torch.tensor(streams, dtype=torch.uint8),
        sparse_offsets=torch.tensor(offsets, dtype=torch.int64),
        dim=int(d),
    )


def check_encoded(enc: EncodedBatch, config: OakenConfig | None = None, check_scales: bool = True) -> None:
    """Validate the structure of an :class:`EncodedBatch` (shapes, dtypes, offsets, finite scales).

    The COO streams themselves are validated while decoding. ``check_scales=False`` skips the finiteness check of
    the scales, for a decoder that checks each row's itself. Raises :class:`CorruptDataError`.
    """
    config = config or OakenConfig()
    if not isinstance(enc.dim, int) or not 1 <= enc.dim <= MAX_DIM:
        raise CorruptDataError(f"row width D must be an int in [1, {MAX_DIM}], got {enc.dim!r}")
    for name in ("dense", "scales", "sparse", "sparse_offsets"):
        if not isinstance(getattr(enc, name), torch.Tensor):
            raise CorruptDataError(f"EncodedBatch.{name} must be a torch.Tensor")
    if enc.dense.dtype != torch.uint8 or enc.dense.dim() != 2 or enc.dense.shape[1] != dense_bytes(enc.dim):
        raise CorruptDataError(
            f"dense must be uint8 [N, {dense_bytes(enc.dim)}] for D = {enc.dim}, got {enc.dense.dtype} "
            f"{tuple(enc.dense.shape)}"
        )
    n = enc.dense.shape[0]
    want = scale_torch_dtype(config)
    if enc.scales.dtype != want or tuple(enc.scales.shape) != (n, NUM_SCALES):
        raise CorruptDataError(
            f"scales must be {want} [{n}, {NUM_SCALES}], got {enc.scales.dtype} {tuple(enc.scales.shape)}"
        )
    # numpy, not torch, for these whole-array checks: torch's intra-op thread pool makes every small op wait for
    # a time slice on a busy machine (16 ms each measured), numpy stays on the calling thread.
    if check_scales and not np.isfinite(enc.scales.detach().cpu().numpy()).all():
        raise CorruptDataError("scales contain NaN or infinite values")
    if enc.sparse.dtype != torch.uint8 or enc.sparse.dim() != 1:
        raise CorruptDataError(f"sparse must be a 1-D uint8 tensor, got {enc.sparse.dtype} {tuple(enc.sparse.shape)}")
    off = enc.sparse_offsets
    if off.dtype != torch.int64 or tuple(off.shape) != (n + 1,):
        raise CorruptDataError(f"sparse_offsets must be int64 [{n + 1}], got {off.dtype} {tuple(off.shape)}")
    if int(off[0]) != 0 or int(off[-1]) != enc.sparse.numel():
        raise CorruptDataError(
            f"sparse_offsets must start at 0 and end at len(sparse) = {enc.sparse.numel()}, "
            f"got {int(off[0])} .. {int(off[-1])}"
        )
    off_np = off.detach().cpu().numpy()
    counts = off_np[1:] - off_np[:-1]
    if n and (bool((counts < 0).any()) or int(counts.max()) > MAX_ROW_SPARSE_BYTES):
        raise CorruptDataError(f"sparse_offsets must be non-decreasing with row counts <= {MAX_ROW_SPARSE_BYTES}")


def unpack(enc: EncodedBatch, config: OakenConfig | None = None) -> QuantizedVectors:
    """Reference unpacker: the exact inverse of :func:`pack`. Raises :class:`CorruptDataError` on invalid input."""
    config = config or OakenConfig()
    check_encoded(enc, config)
    n, d = enc.num_rows, enc.dim
    nib = torch.stack([enc.dense & 0xF, enc.dense >> 4], dim=2).reshape(n, 2 * dense_bytes(d))[:, :d]
    codes = nib.clone()
    groups = torch.zeros((n, d), dtype=torch.uint8)
    bits = group_bits(config)
    sparse = enc.sparse.tolist()
    off = enc.sparse_offsets.tolist()
    for r in range(n):
        positions, entries = _decode_coo_row(sparse[off[r] : off[r + 1]], d, r)
        for pos, e in zip(positions, entries, strict=True):
            g = GROUP_OUTER if e & COO_GROUP_BIT else GROUP_INNER
            b4 = (e >> 7) & 1
            if b4 and bits[g] < 5:
                raise CorruptDataError(f"row {r}: value {pos} has a fifth code bit but its group has {bits[g]} bits")
            groups[r, pos] = g
            codes[r, pos] = int(codes[r, pos]) | (b4 << 4)
    scales = enc.scales.reshape(n, 3, 2)
    return QuantizedVectors(
        codes=codes, groups=groups, mins=scales[:, :, 0].contiguous(), maxs=scales[:, :, 1].contiguous()
    )


# --------------------------------------------------------------------------------------------------------------
# Accounting
# --------------------------------------------------------------------------------------------------------------


def effective_bits(enc: EncodedBatch) -> BitBreakdown:
    """Bits per value of ``enc`` counted from its bytes: dense nibbles, COO bytes (escapes included), scales and
    the 16-bit per-row header. Page-table and fragmentation overhead are not part of the format and not counted.
    """
    from oakenkv.kernels.cpu import sparse_stream_stats

    n, d = enc.num_rows, enc.dim
    values = n * d
    if values == 0:
        raise ValueError("effective_bits of an empty batch is undefined")
    entries, escapes = sparse_stream_stats(enc)
    dense = 8.0 * enc.dense.numel() / values
    sparse = 8.0 * enc.sparse.numel() / values
    scales = 8.0 * enc.scales.numel() * enc.scales.element_size() / values
    header = HEADER_BITS * n / values
    return BitBreakdown(
        dense=dense,
        sparse=sparse,
        scales=scales,
        header=header,
        total=dense + sparse + scales + header,
        num_rows=n,
        num_values=values,
        num_entries=entries,
        num_escape_bytes=escapes,
    )


def expected_bits(dim: int, outlier_fraction: float, scale_bits: int = 16) -> float:
    """Bits per value of the format without escapes: ``4 + 8 f + (6 * scale_bits + 16) / D`` (the paper's formula
    plus our header); for odd ``D`` the dense padding nibble is included."""
    _check_dim(dim)
    return (
        8 * dense_bytes(dim) / dim + COO_ENTRY_BITS * outlier_fraction + (NUM_SCALES * scale_bits + HEADER_BITS) / dim
    )


# --------------------------------------------------------------------------------------------------------------
# Fast paths (numba, oakenkv.kernels.cpu)
# --------------------------------------------------------------------------------------------------------------


def encode(x: torch.Tensor, thr: ThresholdsLike, config: OakenConfig | None = None) -> EncodedBatch:
    """Quantize and pack rows in one fast pass: equal to ``pack(quantize(x, thr, config))`` byte for byte.

    Args:
        x: float ``[N, D]`` (fp32, fp16 or bf16), one row per quantization vector; finite.
        thr: the layer's ``(to_lo, ti_lo, ti_hi, to_hi)``.
    """
    from oakenkv.kernels.cpu import encode_batch

    return encode_batch(x, thr, config or OakenConfig())


def decode(enc: EncodedBatch, thr: ThresholdsLike, config: OakenConfig | None = None) -> torch.Tensor:
    """Unpack and dequantize in one fast pass: float32 ``[N, D]`` equal to ``dequantize(unpack(enc))`` bit for bit.

    Raises :class:`CorruptDataError` for truncated or corrupted input; never reads out of bounds.
    """
    from oakenkv.kernels.cpu import decode_batch

    return decode_batch(enc, thr, config or OakenConfig())


__all__ = [
    "CHUNK_SIZE",
    "MAX_DIM",
    "BitBreakdown",
    "CorruptDataError",
    "EncodedBatch",
    "check_encoded",
    "decode",
    "effective_bits",
    "encode",
    "expected_bits",
    "pack",
    "unpack",
]
