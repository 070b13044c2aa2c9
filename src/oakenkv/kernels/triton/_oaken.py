"""Every fact about the Oaken bytes that the Triton kernels use, from where oakenkv defines it.

The only module of ``oakenkv.kernels.triton`` that imports oakenkv: the format (``oakenkv.format.layout``, the page id
of a released page ``EVICTED`` included), its config (``oakenkv.format.config``) and the reference quantizer's step
floor and threshold parsing (``oakenkv.quant``); nothing above them (``tests/test_architecture.py``).

Inside ``@triton.jit`` code a module global must be a ``tl.constexpr``: the format constants the kernels use are
bound below as ``tl.constexpr`` from ``oakenkv.format.layout``'s, under names of their own (``format/layout.py`` stays
the one definition of each fact). What the kernels' code is shaped by, and cannot take as a parameter, is asserted at
import against ``oakenkv.format.layout``, so that a format change the kernels do not follow fails here, not as a wrong
byte on a GPU.
"""

from __future__ import annotations

import torch
import triton.language as tl

from oakenkv.format.config import OakenConfig
from oakenkv.format.layout import (
    ADVANCE_CONTINUE,
    CHUNK_SIZE,
    COO_CODE_BIT4,
    COO_ENTRY_BITS,
    COO_GROUP_BIT,
    COO_INDEX_MASK,
    DENSE_BITS,
    ERR_ESCAPE_NO_ENTRY,
    ERR_ESCAPE_TRUNCATED,
    ERR_EVICTED,
    ERR_FIFTH_BIT,
    ERR_NONFINITE,
    ERR_OK,
    ERR_POSITION_RANGE,
    ERR_SCALE_NONFINITE,
    ERR_SCALE_OVERFLOW,
    ERR_ZERO_ADVANCE,
    ERROR_MESSAGES,
    EVICTED,
    MAX_DIM,
    MIDDLE_BITS,
    NUM_SCALES,
    SCALE_NAMES,
    CorruptDataError,
    EncodedBatch,
    LayerView,
    dense_bytes,
    num_chunks,
    record_size,
    scale_bytes,
    sparse_capacity,
)
from oakenkv.quant.quantizer import STEP_FLOOR, ThresholdsLike, thresholds_tuple

#: Largest fp16 value: a grid end point beyond it cannot be stored as an fp16 scale (``quant``'s check).
FP16_MAX = float(torch.finfo(torch.float16).max)

# ------------------------------------------------------------------------------- the format, as tl.constexpr

#: Values per COO chunk (``CHUNK_SIZE``): the encoder's tile of a row is ``[chunks, CHUNK]``.
CHUNK = tl.constexpr(CHUNK_SIZE)
#: The COO entry byte's fields: index in the chunk, group (0 inner, 1 outer), fifth code bit.
INDEX_MASK = tl.constexpr(COO_INDEX_MASK)
GROUP_BIT = tl.constexpr(COO_GROUP_BIT)
CODE_BIT4 = tl.constexpr(COO_CODE_BIT4)
CODE_BIT4_SHIFT = tl.constexpr(COO_CODE_BIT4.bit_length() - 1)
#: An escape's advance byte that adds its own value and is followed by another (0xFF).
ADV_CONTINUE = tl.constexpr(ADVANCE_CONTINUE)
#: Bits of a dense slot, and its mask: the low bits of a 5-bit code, the fifth bit sits just above them.
SLOT_BITS = tl.constexpr(DENSE_BITS)
SLOT_MASK = tl.constexpr((1 << DENSE_BITS) - 1)
#: Codes of the middle group (the signed grid's ``N``), and its top code as a float (the step's divisor).
MIDDLE_LEVELS = tl.constexpr(1 << MIDDLE_BITS)
MIDDLE_TOP = tl.constexpr(float((1 << MIDDLE_BITS) - 1))
#: Scales per record, and the power-of-two lane count a kernel holds them in.
SCALES = tl.constexpr(NUM_SCALES)
SCALE_LANES = tl.constexpr(1 << (NUM_SCALES - 1).bit_length())
#: ``scale_bytes`` of records with fp16 scales (the other scale dtype is fp32).
FP16_SCALE_BYTES = tl.constexpr(NUM_SCALES * torch.float16.itemsize)

# ------------------------------------------------------------------------- what the kernels' code assumes
# The chunk tile needs a power of two; the encoder orders entries by a packed key chunk << 14 | index << 8 | byte,
# so an index fits 6 bits and an entry one byte.
assert CHUNK_SIZE & (CHUNK_SIZE - 1) == 0 and CHUNK_SIZE <= 64 and COO_ENTRY_BITS == 8
# Entry fields: index in the low bits, group and fifth code bit above it, one bit each; the attention kernel
# marks an outlier's slot with (byte & (GROUP_BIT | CODE_BIT4)) | 1, so bit 0 is not one of them.
assert COO_INDEX_MASK == CHUNK_SIZE - 1 and COO_GROUP_BIT.bit_count() == COO_CODE_BIT4.bit_count() == 1
assert COO_GROUP_BIT > COO_INDEX_MASK and COO_CODE_BIT4 > COO_INDEX_MASK and (COO_GROUP_BIT | COO_CODE_BIT4) & 1 == 0
# An advance byte adds its value; ADVANCE_CONTINUE is the largest byte, so the byte values are the additions.
assert ADVANCE_CONTINUE == (1 << COO_ENTRY_BITS) - 1
# Two slots per dense byte (value 2j low nibble, 2j + 1 high: `pos >> 1`, `(pos & 1) * SLOT_BITS`); a middle code
# fills its slot; an inner or outer code (OakenConfig: 4 or 5 bits) is its slot plus the entry's fifth bit.
assert 2 * DENSE_BITS == 8 and MIDDLE_BITS == DENSE_BITS
# The kernels take the scales by position: s0 .. s5 in this order.
assert SCALE_NAMES == ("mid_min", "mid_max", "inner_min", "inner_max", "outer_min", "outer_max")


def check_slot_bits(middle_bits: int) -> None:
    """Refuse slot widths other than the paper's 4 bits: these kernels read nibbles (``OakenConfig.middle_bits``
    2, 3 and 5..7, ``oaken-plus-2`` / ``-3`` / ``-5`` / ``-6``, run on the CPU kernels, ``oakenkv.kernels.cpu``)."""
    if middle_bits != DENSE_BITS:
        raise ValueError(
            f"the Triton kernels read {DENSE_BITS}-bit dense slots only, these records have {middle_bits}-bit slots "
            f"(OakenConfig.middle_bits={middle_bits}): use the CPU kernels (codec='fast') for this profile"
        )


#: What the Triton kernels say to a static-grid config or record (``OakenConfig.static_grids``).
STATIC_GRIDS_REFUSED = (
    "the Triton kernels read records of six scales; static middle/inner grids (OakenConfig.static_grids, records "
    "of the outer scales alone) are not implemented there: use the CPU kernels (codec='fast') for this profile"
)


def check_static_grids(static_grids: bool) -> None:
    """Refuse static grids (``OakenConfig.static_grids``) with NotImplementedError: these kernels read six scales
    from every record."""
    if static_grids:
        raise NotImplementedError(STATIC_GRIDS_REFUSED)


def fp16_scales(record_scale_bytes: int) -> bool:
    """Whether records whose scales take ``record_scale_bytes`` hold fp16 scales (True) or fp32 ones (False);
    NotImplementedError for records of two scales (static grids)."""
    if record_scale_bytes in (2 * torch.float16.itemsize, 2 * torch.float32.itemsize):
        raise NotImplementedError(STATIC_GRIDS_REFUSED)
    fp16 = record_scale_bytes == FP16_SCALE_BYTES
    if not fp16 and record_scale_bytes != NUM_SCALES * torch.float32.itemsize:
        raise ValueError(f"records hold {NUM_SCALES} fp16 or fp32 scales, not {record_scale_bytes} bytes of them")
    return fp16


__all__ = [
    "ADV_CONTINUE",
    "CHUNK",
    "CODE_BIT4",
    "CODE_BIT4_SHIFT",
    "ERROR_MESSAGES",
    "ERR_ESCAPE_NO_ENTRY",
    "ERR_ESCAPE_TRUNCATED",
    "ERR_EVICTED",
    "ERR_FIFTH_BIT",
    "ERR_NONFINITE",
    "ERR_OK",
    "ERR_POSITION_RANGE",
    "ERR_SCALE_NONFINITE",
    "ERR_SCALE_OVERFLOW",
    "ERR_ZERO_ADVANCE",
    "EVICTED",
    "FP16_MAX",
    "FP16_SCALE_BYTES",
    "GROUP_BIT",
    "INDEX_MASK",
    "MAX_DIM",
    "MIDDLE_BITS",
    "MIDDLE_LEVELS",
    "MIDDLE_TOP",
    "NUM_SCALES",
    "SCALES",
    "SCALE_LANES",
    "SLOT_BITS",
    "SLOT_MASK",
    "STEP_FLOOR",
    "CorruptDataError",
    "EncodedBatch",
    "LayerView",
    "OakenConfig",
    "ThresholdsLike",
    "check_slot_bits",
    "check_static_grids",
    "dense_bytes",
    "fp16_scales",
    "num_chunks",
    "record_size",
    "scale_bytes",
    "sparse_capacity",
    "thresholds_tuple",
]
