"""The Oaken bytes, defined once: the row format, the page-record format and the paged view a kernel reads.

Every reader and writer of the bytes imports this module (the reference pack/unpack in ``oakenkv.quant.reference``,
the numba kernels in ``oakenkv.kernels``, the paged store in ``oakenkv.store.paged``, a future GPU backend); it imports
no implementation, in the spirit of ggml's ``ggml-common.h``. The fused dense-and-sparse format is the paper's
(Kim et al., ISCA 2025, Section 5.2) with an implicit-chunk COO stream; ``docs/format.md`` explains the choices.

Row format
----------
One *row* is one quantization vector of ``D`` values (``1 <= D <= MAX_DIM``): one token's keys (or values) of
one layer, all KV heads together (granularity "token", the paper's) or one head ("head"). Its stored form::

    field   size                      content
    header  2 bytes (u16 LE)          S = number of sparse bytes of this row                        16 bits
    scales  6 x fp16 | 6 x fp32 (LE)  mid_min mid_max inner_min inner_max outer_min outer_max       96 | 192 bits
            (static grids: 2 x fp16 | 2 x fp32, outer_min outer_max only                           32 | 64 bits)
    level   1 byte (u8)               static levels only: the row's level index                      8 bits
    dense   ceil(b D / 8) bytes       one b-bit slot per value (b = middle_bits: 2 to 7)            b bits/value
    sparse  S bytes                   one COO entry byte per inner/outer value (+ rare escapes)    8 bits/outlier

Scales: index ``2 * group + {0: min, 1: max}`` (group ids: middle 0, inner 1, outer 2), the quantizer's grid end
points already rounded to the scale dtype (``OakenConfig.scale_dtype``); the decoder computes
``step = (max - min) / (2**bits - 1)`` and ``v = min + code * step`` in float32. An empty group stores ``0, 0``.

Static grids (``OakenConfig.static_grids``, issue #36): the middle and inner groups' end points are not per row but
the layer's, fixed by its thresholds (``oakenkv.quant.quantizer.static_grid``: computed from the thresholds the
decoder has, rounded to the scale dtype), so a row stores only ``outer_min, outer_max``
(:func:`stored_scale_names`); every other rule is unchanged. Like the slot width, this is not recorded in the bytes:
the config decoding them must be the one that wrote them. In memory (:class:`EncodedBatch`) the scales stay
``[N, 6]``, the static columns holding the layer's grid in every row (redundant, never stored).

Static levels (``OakenConfig.static_levels``, with static grids): the layer has ``L`` static grids (2 to 16), grid
``j`` the static grid of clip factor ``static_levels[j]`` (``oakenkv.quant.quantizer.level_grids``; the inner grid is
the clip-1 one in all), and each row takes one of them, the smallest that covers its middle values
(``oakenkv.quant.quantizer.pick_levels``). The row stores its index ``j`` in one byte after its two outer scales
(``level``: ``LEVEL_BITS``); the decoder never recomputes the choice, and an index ``>= L`` is corrupt
(``ERR_LEVEL``). In memory the static columns hold the row's chosen grid and :attr:`EncodedBatch.level` the index.

Dense slots: a little-endian bit stream of ``b``-bit slots (``b = OakenConfig.middle_bits``), value ``j``'s slot at
bits ``b j .. b j + b - 1`` (bit ``i`` of the stream is bit ``i % 8`` of byte ``i // 8``); the bits after the last
slot, up to the byte's end, are padding, written 0. For the paper's ``b = 4`` this is nibble order, low first (for
odd ``D`` the last high nibble is padding)::

    b = 4, byte j:          bit 7 6 5 4 | 3 2 1 0
                            value 2j+1  | value 2j

    b = 3, 8 values (v0..v7 = values 8j..8j+7) in 3 bytes:
                            byte 3j:     bit 7 6 | 5 4 3 | 2 1 0       = v2[1:0] | v1    | v0
                            byte 3j+1:   bit 7 | 6 5 4 | 3 2 1 | 0     = v5[0]   | v4    | v3 | v2[2]
                            byte 3j+2:   bit 7 6 5 | 4 3 2 | 1 0       = v7      | v6    | v5[2:1]

    b = 2, byte j:          bit 7 6 | 5 4 | 3 2 | 1 0
                            v 4j+3  | 4j+2| 4j+1| 4j

A middle value stores its whole ``b``-bit code there; an inner or outer value stores the low ``b`` bits of its code
(``b + 1`` bits, or ``b`` when its group has no COO code bit).

COO entry byte (one per inner or outer value, sorted by position)::

    bit   7      6      5 4 3 2 1 0
        +------+------+-------------+
        | c[b] | grp  |  index i    |     position = CHUNK_SIZE * chunk + i,  grp: 0 inner, 1 outer
        +------+------+-------------+     c[b]: bit b of the (b + 1)-bit code (0 for a b-bit group)

The side (upper/lower) of an outer or middle value is not stored: it is the sign of the dequantized shifted value
(``oakenkv.quant.quantizer``), so the paper's "sign" bit is the top code bit here (the "fifth" bit of the 4-bit
format; the code and the constants keep that name).

The chunk of an entry is implicit. Decoder state: chunk ``c = 0``, last index ``p = -1``, previous byte
``prev = 0x00`` (virtual). For each byte ``e``:

* ``e == prev``: an ESCAPE. The next bytes are a chunk advance ``k``: a run of ``ADVANCE_CONTINUE`` (0xFF) bytes
  (each adds 255) closed by one byte ``< 0xFF`` (added too). Then ``c += k``, ``p = -1``, ``prev = None`` (no byte
  equals it, so the byte after an advance is always an entry).
* otherwise ``i = e & COO_INDEX_MASK``; if ``i <= p`` then ``c += 1`` (natural advance to the next chunk); the
  entry is at ``CHUNK_SIZE * c + i``; ``p = i``; ``prev = e``.

The encoder writes an escape (a copy of ``prev``, ``0x00`` at the row start) only where the natural rule would
decode wrongly: the entry is more than one chunk ahead, one chunk ahead with ``i > p``, or its byte equals
``prev``. After any entry the state is ``(its chunk, its index, its byte)`` whether or not an escape preceded it,
so whether an entry needs an escape depends only on the entry before it. An advance of 0 only occurs at the row
start.

Decoding untrusted bytes validates everything it reads and raises :class:`CorruptDataError`: an escape must be
followed by its advance and an entry, an advance of 0 is only legal before the first entry, every position must
be ``< D`` (so positions strictly increase), a top (``b``-th) code bit is only legal for a ``b + 1``-bit group,
the padding bits after the last slot must be 0, offsets and shapes must be consistent, and the scales must be finite and
decode to finite values: for each group the values of its lowest and highest code, threshold shift included,
computed in the decoder's float32 arithmetic (every other code's value lies between them). The encoder refuses
any row that would break the last rule, so it never writes a row the decoder refuses. Dense nibbles carry no
redundancy and there is no checksum: a bit flip that keeps the stream valid decodes to other numbers, and
``D`` is not stored (a row read with a width one less than written is only caught by non-zero padding bits or
an entry beyond the end), nor is the slot width ``b``: the config decoding the bytes must be the one that wrote them
(profiles record it). docs/robustness.md says what is and is not guaranteed.

In memory (:class:`EncodedBatch`) the fields of many rows are separate arrays; the header is what
``sparse_offsets[r + 1] - sparse_offsets[r]`` costs when stored per row.

Page-record format
------------------
A paged store (``oakenkv.store.paged`` over ``oakenkv.store.pages``) keeps a row as two records::

    dense record (fixed size, record_size(D, config) bytes, in the stream's dense pages)
      offset 0                 scales   stored scales x itemsize, little-endian, in stored_scale_names(config)
                                        order (SCALE_NAMES, or its outer two); with static levels then the
                                        level byte: scale_bytes(config) bytes in all (2 x itemsize + 1)
      offset scale_bytes       dense    dense_bytes(D, middle_bits) bytes, the row's slots as above
    sparse record (S bytes, in the stream's sparse pages): the row's COO bytes
    header: S, kept in the page table as the token's uint16 sparse length (pages.StreamTable.sparse_len)

:func:`to_records` / :func:`from_records` convert an :class:`EncodedBatch` to and from these records
(:func:`from_records` of static-grid records needs the layer's static grid back: :func:`static_columns`; of
static-level records the layer's ``L`` grids, :func:`level_columns`). Records of static levels are an odd number of
bytes long for even dense bytes: readers read their scales bytewise (no alignment is assumed).

Status codes
------------
Kernels never raise: they return ``ERR_OK`` or an ``ERR_*`` code per row, and the Python side raises with
``ERROR_MESSAGES[code]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from oakenkv.format.config import V1_FIXED_FIELDS, OakenConfig

# ------------------------------------------------------------------------------------------------ row format

#: Values addressed by one 6-bit COO index.
CHUNK_SIZE = 64
#: The paper's dense slot width (one nibble per value), the default of ``OakenConfig.middle_bits``: a config's
#: ``middle_bits`` (2 to 7, ``format.config.MIDDLE_BITS_CHOICES``) is the slot width of its bytes.
DENSE_BITS = 4
#: Bits of a middle-group code in the paper's format: the whole dense slot.
MIDDLE_BITS = DENSE_BITS
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
#: Scales a static-grid row stores (``OakenConfig.static_grids``): the outer group's, the last two of SCALE_NAMES;
#: the first ``STATIC_COLUMNS`` are the layer's static grid.
STATIC_SCALE_NAMES = SCALE_NAMES[4:]
STATIC_COLUMNS = NUM_SCALES - len(STATIC_SCALE_NAMES)
#: Bits of a static-level row's level index (``OakenConfig.static_levels``): one byte after the stored scales.
LEVEL_BITS = 8
#: Width of the per-row header: the row's sparse byte count.
HEADER_BITS = 16
#: Largest sparse byte count a 16-bit header can hold.
MAX_ROW_SPARSE_BYTES = 2**HEADER_BITS - 1
#: Largest supported row width: its worst-case sparse bytes (:func:`sparse_capacity`) fit the 16-bit header.
MAX_DIM = 32768


def dense_bytes(dim: int, bits: int = DENSE_BITS) -> int:
    """Bytes of the dense part of one row of ``dim`` values in ``bits``-bit slots (``OakenConfig.middle_bits``)."""
    return (bits * dim + 7) // 8


def padding_bits(dim: int, bits: int = DENSE_BITS) -> int:
    """Padding bits at the end of the dense part of a row (the last byte's bits after its last slot): written 0."""
    return 8 * dense_bytes(dim, bits) - bits * dim


def num_chunks(dim: int) -> int:
    """CHUNK_SIZE-value chunks of one row (the last one may be partial)."""
    return (dim + CHUNK_SIZE - 1) // CHUNK_SIZE


def sparse_capacity(dim: int) -> int:
    """Upper bound on one row's sparse bytes: every value an outlier, one escape (two bytes, plus one per 255
    chunks of advance) per chunk, and the row-start escape."""
    ch = num_chunks(dim)
    return dim + 2 * ch + ch // 255 + 1


def check_dim(dim: int) -> None:
    """Raise ValueError unless ``dim`` is a supported row width."""
    if isinstance(dim, bool) or not isinstance(dim, int) or not 1 <= dim <= MAX_DIM:
        raise ValueError(f"row width D must be an int in [1, {MAX_DIM}], got {dim!r}")


def check_dim_corrupt(dim: int) -> None:
    """:func:`check_dim` for a width that comes with bytes to decode: raises :class:`CorruptDataError`."""
    try:
        check_dim(dim)
    except ValueError as e:
        raise CorruptDataError(str(e)) from None


def _describe(a: object) -> str:
    return f"{a.dtype} {tuple(a.shape)}" if hasattr(a, "dtype") and hasattr(a, "shape") else type(a).__name__


def stored_scale_names(config: OakenConfig) -> tuple[str, ...]:
    """The scales a row of ``config`` stores, in order: all of SCALE_NAMES, or with static grids the outer two."""
    return STATIC_SCALE_NAMES if config.static_grids else SCALE_NAMES


def stored_scales(config: OakenConfig) -> int:
    """How many scales a row of ``config`` stores: 6, or 2 with static grids."""
    return len(stored_scale_names(config))


def level_bits(config: OakenConfig) -> int:
    """Bits of the level index a row of ``config`` stores: ``LEVEL_BITS`` with static levels, else 0."""
    return LEVEL_BITS if config.static_levels else 0


def format_bits(
    num_rows: int,
    dim: int,
    num_entries: int,
    scale_bits: int = 16,
    bits: int = DENSE_BITS,
    num_scales: int = NUM_SCALES,
    level: int = 0,
) -> int:
    """Bits the format stores for ``num_rows`` rows of ``dim`` values in ``bits``-bit slots holding ``num_entries``
    COO entries in all (one per inner or outer value), escape bytes not counted: header, ``num_scales`` scales
    (:func:`stored_scales`), the ``level`` bits of a static level index (:func:`level_bits`) and dense bytes per
    row, plus the entries."""
    dense = 8 * dense_bytes(dim, bits)
    return num_rows * (HEADER_BITS + num_scales * scale_bits + level + dense) + COO_ENTRY_BITS * num_entries


def expected_bits(
    dim: int,
    outlier_fraction: float,
    scale_bits: int = 16,
    bits: int = DENSE_BITS,
    num_scales: int = NUM_SCALES,
    level: int = 0,
) -> float:
    """Bits per value of the format without escapes: ``b + 8 f + (s * scale_bits + l + 16) / D`` for ``b``-bit
    slots, ``s`` stored scales (:func:`stored_scales`: 6, the paper's formula with ``b = 4``, plus our header; 2 with
    static grids) and ``l`` level bits (:func:`level_bits`: 8 with static levels); the dense padding bits are
    included."""
    check_dim(dim)
    return (
        8 * dense_bytes(dim, bits) / dim
        + COO_ENTRY_BITS * outlier_fraction
        + (num_scales * scale_bits + level + HEADER_BITS) / dim
    )


# The layout's sizes, checked at import like ggml's static_asserts.
assert sparse_capacity(MAX_DIM) <= MAX_ROW_SPARSE_BYTES  # the 16-bit header never overflows
assert CHUNK_SIZE - 1 == COO_INDEX_MASK and COO_INDEX_MASK | COO_GROUP_BIT | COO_CODE_BIT4 == 0xFF
# Version-1 config files record these two format constants next to the knobs (oakenkv.format.config).
assert V1_FIXED_FIELDS == {"middle_bits": MIDDLE_BITS, "chunk_size": CHUNK_SIZE}


# ------------------------------------------------------------------------------------------------ status codes

# Row status codes returned by the kernels (0 = fine).
ERR_OK = 0
ERR_NONFINITE = 1
ERR_SCALE_OVERFLOW = 2
ERR_ESCAPE_TRUNCATED = 3
ERR_ZERO_ADVANCE = 4
ERR_ESCAPE_NO_ENTRY = 5
ERR_POSITION_RANGE = 6
ERR_FIFTH_BIT = 7
ERR_SHAPE = 8
ERR_EVICTED = 9
ERR_SCALE_NONFINITE = 10
ERR_SCALE_RANGE = 11
ERR_PADDING = 12
ERR_THRESHOLDS = 13
ERR_LEVEL = 14

ERROR_MESSAGES = {
    ERR_NONFINITE: "input contains a NaN or infinite value; the KV cache cannot quantize it",
    ERR_SCALE_OVERFLOW: "a group's range exceeds the fp16 maximum (65504); use OakenConfig(scale_dtype='float32')",
    ERR_ESCAPE_TRUNCATED: "an escape is cut off before its chunk advance (truncated sparse stream)",
    ERR_ZERO_ADVANCE: "an escape with a zero chunk advance after an entry (positions must increase)",
    ERR_ESCAPE_NO_ENTRY: "an escape is not followed by an entry (truncated sparse stream)",
    ERR_POSITION_RANGE: "a COO entry points past the end of the row",
    ERR_FIFTH_BIT: "a COO entry sets the fifth code bit of a 4-bit group (the top code bit of a group whose codes "
    "fit the dense slot)",
    ERR_SHAPE: "row buffers have inconsistent sizes",
    ERR_EVICTED: "attention reached a token whose pages were evicted (it left the sliding window; check the mask)",
    ERR_SCALE_NONFINITE: "scales contain NaN or infinite values, or decode to values beyond the float32 range",
    ERR_SCALE_RANGE: "a group's range, or a value restored from it, exceeds the float32 range (|x| > 3.4e38): "
    "the KV cache cannot quantize values or thresholds this large",
    ERR_PADDING: "the padding bits after a row's last dense slot (the padding nibble of an odd-width row of 4-bit "
    "slots) are not 0 (bytes of a row of another width?)",
    ERR_THRESHOLDS: "thresholds must be 4 finite float32 values with to_lo < ti_lo <= ti_hi < to_hi",
    ERR_LEVEL: "a row's static level index is not one of the layer's static levels (OakenConfig.static_levels)",
}


class CorruptDataError(ValueError):
    """Encoded bytes that are not a valid Oaken stream (truncated, corrupted or of another shape)."""


# ------------------------------------------------------------------------------------------------ rows in memory


@dataclass
class EncodedBatch:
    """Rows in the fused dense-and-sparse format.

    Attributes:
        dense: uint8 ``[N, dense_bytes(D, b)]``: value ``j``'s ``b``-bit slot at bits ``b j ..`` of each row's
            little-endian bit stream (``b = OakenConfig.middle_bits``; for 4, nibble ``j % 2``, low first, of byte
            ``j // 2``). The batch does not record ``b``: its config does.
        scales: ``[N, 6]`` float16 (or float32): ``mid_min, mid_max, inner_min, inner_max, outer_min, outer_max``.
            With static grids the first four columns are the layer's static grid in every row (not stored).
        sparse: uint8 ``[S]``; the COO byte streams of all rows, concatenated.
        sparse_offsets: int64 ``[N + 1]``; row ``r``'s stream is ``sparse[off[r]:off[r + 1]]``. The stored per-row
            cost of this is the 16-bit header (the count ``off[r + 1] - off[r]``).
        dim: ``D``, the number of values per row.
        stored_scales: how many of the six scale columns the stored form holds (:func:`stored_scales` of the
            config that wrote it: 6, or 2 with static grids); :meth:`nbytes` counts those, :func:`check_encoded`
            refuses a batch whose count is not its config's.
        level: uint8 ``[N]``, each row's static level index (``OakenConfig.static_levels``: the row's grid is
            the level's, which the static columns of ``scales`` hold), stored as one byte per row; None without
            static levels.
    """

    dense: torch.Tensor
    scales: torch.Tensor
    sparse: torch.Tensor
    sparse_offsets: torch.Tensor
    dim: int
    stored_scales: int = NUM_SCALES
    level: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        return int(self.dense.shape[0])

    def row_sparse(self, r: int) -> torch.Tensor:
        """uint8 ``[S_r]``: the COO stream of row ``r``."""
        return self.sparse[int(self.sparse_offsets[r]) : int(self.sparse_offsets[r + 1])]

    def nbytes(self) -> int:
        """Bytes of the stored form: dense + sparse + the stored scales + the 2-byte header of every row."""
        n = self.num_rows
        return self.dense.numel() + self.sparse.numel() + n * self.stored_scale_bytes() + n * HEADER_BITS // 8

    def stored_scale_bytes(self) -> int:
        """Bytes of the scale area one row stores: :attr:`stored_scales` scales, and a static-level row's level byte
        (``scale_bytes`` of the config that wrote it)."""
        return self.stored_scales * self.scales.element_size() + (0 if self.level is None else LEVEL_BITS // 8)


def check_encoded(enc: EncodedBatch, config: OakenConfig | None = None, check_scales: bool = True) -> None:
    """Validate the structure of an :class:`EncodedBatch` (shapes, dtypes, offsets, finite scales).

    The COO streams themselves are validated while decoding. ``check_scales=False`` skips the finiteness check of
    the scales, for a decoder that checks each row's itself. Raises :class:`CorruptDataError`.
    """
    config = config or OakenConfig()
    if not isinstance(enc, EncodedBatch):
        raise CorruptDataError(f"expected an EncodedBatch, got {type(enc).__name__}")
    check_dim_corrupt(enc.dim)
    mb = config.middle_bits
    nd = dense_bytes(enc.dim, mb)
    for name in ("dense", "scales", "sparse", "sparse_offsets"):
        t = getattr(enc, name)
        if not isinstance(t, torch.Tensor):
            raise CorruptDataError(f"EncodedBatch.{name} must be a torch.Tensor")
        if t.device.type != "cpu":
            raise CorruptDataError(f"EncodedBatch.{name} is on {t.device}; the CPU codec reads CPU tensors")
    if enc.dense.dtype != torch.uint8 or enc.dense.dim() != 2 or enc.dense.shape[1] != nd:
        raise CorruptDataError(
            f"dense must be uint8 [N, {nd}] for D = {enc.dim} in {mb}-bit slots, got {enc.dense.dtype} "
            f"{tuple(enc.dense.shape)}"
        )
    n = enc.dense.shape[0]
    want = config.scale_torch_dtype
    if enc.scales.dtype != want or tuple(enc.scales.shape) != (n, NUM_SCALES):
        raise CorruptDataError(
            f"scales must be {want} [{n}, {NUM_SCALES}], got {enc.scales.dtype} {tuple(enc.scales.shape)}"
        )
    if enc.stored_scales != stored_scales(config):
        raise CorruptDataError(
            f"the batch stores {enc.stored_scales!r} scales per row, its config {stored_scales(config)} "
            f"(static_grids={config.static_grids}): decode it with the config that wrote it"
        )
    check_levels(enc, config)
    # numpy, not torch, for these whole-array checks: torch's intra-op thread pool makes every small op wait for
    # a time slice on a busy machine, numpy stays on the calling thread.
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
    pad_bits = padding_bits(enc.dim, mb)
    if pad_bits and n:
        pad = np.flatnonzero(enc.dense[:, -1].detach().cpu().numpy() >> (8 - pad_bits))
        if pad.size:
            raise CorruptDataError(f"row {int(pad[0])}: {ERROR_MESSAGES[ERR_PADDING]}")


def check_levels(enc: EncodedBatch, config: OakenConfig) -> None:
    """:class:`CorruptDataError` unless ``enc.level`` fits ``config``: uint8 ``[N]`` of indices below
    ``len(config.static_levels)`` with static levels, None otherwise."""
    n_levels = len(config.static_levels)
    lv = enc.level
    if not n_levels:
        if lv is not None:
            raise CorruptDataError("the batch has static level indices, its config no static levels")
        return
    n = enc.dense.shape[0]
    if not isinstance(lv, torch.Tensor) or lv.dtype != torch.uint8 or tuple(lv.shape) != (n,):
        raise CorruptDataError(f"level must be a uint8 [{n}] tensor with static levels, got {_describe(lv)}")
    if lv.device.type != "cpu":
        raise CorruptDataError(f"EncodedBatch.level is on {lv.device}; the CPU codec reads CPU tensors")
    bad = np.flatnonzero(lv.numpy() >= n_levels)
    if bad.size:
        raise CorruptDataError(
            f"row {int(bad[0])}: {ERROR_MESSAGES[ERR_LEVEL]} (index {int(lv[bad[0]])} of {n_levels})"
        )


# ------------------------------------------------------------------------------------------------ page records


def scale_bytes(config: OakenConfig) -> int:
    """Bytes of the scale area at the start of a dense record: the stored scales (six, or two with static grids),
    then with static levels the level byte."""
    return stored_scales(config) * config.scale_itemsize + level_bits(config) // 8


def record_size(dim: int, config: OakenConfig) -> int:
    """Bytes of one dense page record: the stored scales, then the ``dense_bytes(D, config.middle_bits)`` slot
    bytes."""
    return scale_bytes(config) + dense_bytes(dim, config.middle_bits)


def static_columns(grid: object, config: OakenConfig) -> np.ndarray:
    """The layer's static grid as the four scale columns it fills in every row (``mid_min, mid_max, inner_min,
    inner_max``), in the scale dtype: ``grid`` is any 4 numbers already rounded to the scale dtype
    (``oakenkv.quant.quantizer.static_scale_row`` computes them from the thresholds). ValueError unless 4 values
    exact in the scale dtype."""
    a = np.asarray(grid, dtype=np.float64).reshape(-1)
    if a.shape != (STATIC_COLUMNS,):
        raise ValueError(f"a static grid is {STATIC_COLUMNS} numbers (mid_min, mid_max, inner_min, inner_max), got {a}")
    with np.errstate(over="ignore"):
        out = a.astype(config.scale_np_dtype)
    if not np.array_equal(out.astype(np.float64), a):
        raise ValueError(f"a static grid must be exact {config.scale_dtype} values, got {a.tolist()}")
    return out


def level_columns(grids: object, config: OakenConfig) -> np.ndarray:
    """The layer's static-level grids (``OakenConfig.static_levels``) as the scale columns they fill: ``[L, 4]`` in
    the scale dtype, row ``j`` level ``j``'s grid (:func:`static_columns` each; ``grids`` is any ``L x 4`` numbers,
    ``oakenkv.quant.quantizer.format_level_grids``). ValueError unless ``L = len(config.static_levels)`` rows of 4
    values exact in the scale dtype."""
    a = np.asarray(grids, dtype=np.float64)
    n_levels = len(config.static_levels)
    if a.shape != (n_levels, STATIC_COLUMNS):
        raise ValueError(f"static levels' grids are {n_levels} x {STATIC_COLUMNS} numbers, got shape {a.shape}")
    return np.stack([static_columns(row, config) for row in a])


def to_records(enc: EncodedBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Page records of an :class:`EncodedBatch`: dense uint8 ``[N, record_size]`` (the stored scales, then the
    slots), sparse uint8 ``[S]`` and offsets int64 ``[N + 1]`` (the 16-bit header lives in the pool's sparse
    table). A static-grid batch (``enc.stored_scales == 2``) stores its outer scales only, a static-level batch
    then its level byte."""
    n = enc.num_rows
    scales = enc.scales[:, NUM_SCALES - enc.stored_scales :].contiguous().numpy().view(np.uint8).reshape(n, -1)
    parts = [scales] if enc.level is None else [scales, enc.level.numpy().reshape(n, 1)]
    dense = np.concatenate([*parts, enc.dense.numpy()], axis=1)
    return dense, enc.sparse.numpy(), enc.sparse_offsets.numpy()


def from_records(
    dense: np.ndarray,
    sparse: np.ndarray,
    offsets: np.ndarray,
    dim: int,
    config: OakenConfig,
    static: object = None,
) -> EncodedBatch:
    """The inverse of :func:`to_records`: an :class:`EncodedBatch` of the records (decode it to validate the
    streams). ``static``: with static grids (``config.static_grids``), the layer's static grid (4 numbers,
    :func:`static_columns`; required), which fills the first four scale columns of every row; with static levels
    the layer's ``L`` grids (``L x 4`` numbers, :func:`level_columns`), each row's columns filled with its level's;
    None otherwise. Raises :class:`CorruptDataError` when the arrays' types or shapes do not fit ``dim`` and
    ``config`` or a level index is not below ``L``, ValueError for a missing or unexpected ``static``."""
    if config.static_grids != (static is not None):
        raise ValueError(
            "from_records needs the layer's static grid (static=) for a static-grid config, and takes none otherwise"
            f" (static_grids={config.static_grids})"
        )
    levels = bool(config.static_levels)
    fixed = None if static is None else level_columns(static, config) if levels else static_columns(static, config)
    check_dim_corrupt(dim)
    size = record_size(dim, config)
    for name, a, nd in (("dense", dense, 2), ("sparse", sparse, 1)):
        if not isinstance(a, np.ndarray) or a.dtype != np.uint8 or a.ndim != nd:
            raise CorruptDataError(f"{name} records must be a {nd}-D uint8 array, got {_describe(a)}")
    if dense.shape[1] != size:
        raise CorruptDataError(
            f"dense records must be {size} bytes for D = {dim}, {config.middle_bits}-bit slots and "
            f"{config.scale_dtype} scales, got {dense.shape[1]}"
        )
    offsets = np.asarray(offsets)
    if offsets.dtype.kind not in "iu" or offsets.shape != (dense.shape[0] + 1,):
        raise CorruptDataError(f"offsets must be {dense.shape[0] + 1} integers, got {_describe(offsets)}")
    sb = scale_bytes(config)
    ns = stored_scales(config)
    sized = ns * config.scale_itemsize  # the stored scales (the level byte follows them)
    stored = np.ascontiguousarray(dense[:, :sized]).view(config.scale_np_dtype).reshape(-1, ns)
    level = None
    if fixed is None:
        scales = stored.copy()
    else:
        scales = np.empty((dense.shape[0], NUM_SCALES), config.scale_np_dtype)
        if levels:
            level = np.ascontiguousarray(dense[:, sized])
            bad = np.flatnonzero(level >= fixed.shape[0])
            if bad.size:
                raise CorruptDataError(
                    f"record {int(bad[0])}: {ERROR_MESSAGES[ERR_LEVEL]} (index {int(level[bad[0]])} of "
                    f"{fixed.shape[0]})"
                )
            scales[:, :STATIC_COLUMNS] = fixed[level]
        else:
            scales[:, :STATIC_COLUMNS] = fixed
        scales[:, STATIC_COLUMNS:] = stored
    return EncodedBatch(
        dense=torch.from_numpy(np.ascontiguousarray(dense[:, sb:])),
        scales=torch.from_numpy(scales),
        sparse=torch.from_numpy(np.ascontiguousarray(sparse)),
        sparse_offsets=torch.from_numpy(np.asarray(offsets, dtype=np.int64)),
        dim=dim,
        stored_scales=ns,
        level=None if level is None else torch.from_numpy(level),
    )


# ------------------------------------------------------------------------------------------------ paged view

#: :attr:`LayerView.static_grid` of records holding all six scales (no static grid): float32 ``[2, 0]`` (writable,
#: like a real grid, so that the kernels taking a view compile once for both).
NO_STATIC_GRID = np.zeros((2, 0), np.float32)

#: Page id of a released page (``PagePool.evict_before``: a sliding-window layer's tokens no query reaches), as a
#: view's page lists carry it; a reader must never dereference it.
EVICTED = -1


class LayerView(NamedTuple):
    """Where one layer's keys and values of every batch row lie in a page pool: what a decode kernel reads.

    Built by ``oakenkv.store.paged.PagedKVStore.layer_view`` from the tables the store keeps current on every write (no
    table is rebuilt per step); read by ``oakenkv.kernels.cpu.attention`` (and the backends to come). ``B``
    batch rows, ``T = num_tokens`` tokens stored per row, kind 0 = keys, 1 = values. The table arrays have
    capacity beyond what is live (they grow by doubling): a reader uses ``num_tokens`` and ``sparse_counts``,
    never their shapes. Token ``t < T`` of row ``b``, kind ``k``:

    * dense record: ``pool[p * page_size + (t % rpp) * record_size :][:record_size]`` with
      ``p = dense_pages[b, k, t // rpp]`` and ``rpp = page_size // record_size`` (records never straddle pages);
    * sparse record: ``sparse_lengths[b, k, t]`` bytes in the sparse page of its stream that holds it. The
      stream's sparse pages are ``sparse_pages[b, k, :n]`` with first tokens ``sparse_first[b, k, :n]``,
      ``n = sparse_counts[b, k]``; the record's offset in its page is the sum of the lengths of the tokens
      before it in that page (readers walk a stream in token order).

    Page ids of -1 (``oakenkv.store.pages.EVICTED``) are pages a sliding window released; a kernel must not read them.
    The field order is the order of a kernel's trailing arguments: pass ``*view``.
    """

    #: uint8 ``[num_pages * page_size]``: the pool's storage, flat.
    pool: np.ndarray
    #: Bytes per page.
    page_size: int
    #: Bytes per dense record (:func:`record_size`).
    record_size: int
    #: Bytes of the scales at the start of a dense record (:func:`scale_bytes`: six scales, or the outer two with
    #: static grids).
    scale_bytes: int
    #: ``T``: tokens stored in every stream of the layer.
    num_tokens: int
    #: int32 ``[B, 2, >= ceil(T / rpp)]``: dense page ids per row and kind, in token order.
    dense_pages: np.ndarray
    #: int32 ``[B, 2, >= max(sparse_counts)]``: sparse page ids per row and kind, in token order.
    sparse_pages: np.ndarray
    #: int32 ``[B, 2, >= max(sparse_counts)]``: first token whose sparse record lies in each of those pages.
    sparse_first: np.ndarray
    #: int64 ``[B, 2]``: sparse pages of each stream.
    sparse_counts: np.ndarray
    #: uint16 ``[B, 2, >= T]``: sparse record length of every token (the row format's header).
    sparse_lengths: np.ndarray
    #: float32 ``[2, 4]``: the layer's key and value thresholds ``(to_lo, ti_lo, ti_hi, to_hi)``.
    thresholds: np.ndarray
    #: Bits of the inner and outer groups' codes (``middle_bits`` or ``middle_bits + 1``).
    inner_bits: int
    outer_bits: int
    #: KV heads: a row of ``D = num_kv_heads * head_dim`` values holds every head of the token.
    num_kv_heads: int
    #: Dense slot width (``OakenConfig.middle_bits``): the bits of a middle code. Last, with the paper's 4 as its
    #: default, so that a view built without it (positionally, before slot widths other than 4 existed) reads 4-bit
    #: records.
    middle_bits: int = DENSE_BITS
    #: float32 ``[2, 4]``: with static grids (records holding the outer scales only), the layer's key and value
    #: static grids ``(mid_min, mid_max, inner_min, inner_max)`` (:func:`static_columns`, widened exactly);
    #: ``[2, 0]`` (the default, :data:`NO_STATIC_GRID`) for records holding all six scales; with static levels
    #: float32 ``[2, 4 L]``: each kind's ``L`` grids (:func:`level_columns`, flattened: level ``j``'s at ``4 j``),
    #: the record's level byte (after its outer scales) picking the row's.
    static_grid: np.ndarray = NO_STATIC_GRID  # type: ignore[assignment]
