"""Every fact about the Oaken bytes that the Triton kernels use, imported from where oakenkv defines it.

This is the only module of ``oakenkv.kernels.triton`` that imports oakenkv internals (the format constants,
record sizes, error codes, the reference's step floor). The Triton kernels take these values as ``tl.constexpr``
arguments from here, never as literals of their own, so a format change (or the move of these definitions into
``oakenkv/format.py``) touches this file only.
"""

from __future__ import annotations

from oakenkv.config import OakenConfig
from oakenkv.format import (
    ADVANCE_CONTINUE,
    CHUNK_SIZE,
    COO_CODE_BIT4,
    COO_GROUP_BIT,
    COO_INDEX_MASK,
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
    MAX_DIM,
    NUM_SCALES,
    CorruptDataError,
    EncodedBatch,
    dense_bytes,
    num_chunks,
    record_size,
    scale_bytes,
    sparse_capacity,
)
from oakenkv.pages import EVICTED
from oakenkv.quant import STEP_FLOOR, ThresholdsLike, thresholds_tuple

#: Largest fp16 value: a grid end point beyond it cannot be stored as an fp16 scale (quant._round_scales).
FP16_MAX = 65504.0

# The kernels hard-wire what follows from these (a chunk is one 64-bit mask, a COO index is 6 bits, the escape's
# advance bytes saturate at 0xFF); a format change must revisit them.
assert CHUNK_SIZE == 64 and COO_INDEX_MASK == 0x3F and COO_GROUP_BIT == 0x40 and COO_CODE_BIT4 == 0x80
assert ADVANCE_CONTINUE == 0xFF and NUM_SCALES == 6

__all__ = [
    "ADVANCE_CONTINUE",
    "CHUNK_SIZE",
    "COO_CODE_BIT4",
    "COO_GROUP_BIT",
    "COO_INDEX_MASK",
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
    "MAX_DIM",
    "NUM_SCALES",
    "STEP_FLOOR",
    "CorruptDataError",
    "EncodedBatch",
    "OakenConfig",
    "ThresholdsLike",
    "dense_bytes",
    "num_chunks",
    "record_size",
    "scale_bytes",
    "sparse_capacity",
    "thresholds_tuple",
]
