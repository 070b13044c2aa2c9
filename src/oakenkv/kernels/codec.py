"""The codec's public API: the Oaken format's bytes from float rows and back, fast, and what they cost in bits.

- :func:`encode` / :func:`decode`: quantize and pack (unpack and dequantize) in one fast pass (numba kernels,
  ``oakenkv.kernels.cpu.codec``), byte for byte and bit for bit the reference below;
- :func:`pack` / :func:`unpack`: the reference conversion of ``oakenkv.quant.quantizer``'s output
(``oakenkv.quant.reference``);
- :func:`effective_bits` (from the bytes produced) and :func:`expected_bits` (the layout's formula).

The format itself (layout, constants, :class:`EncodedBatch`, :func:`check_encoded`, :class:`CorruptDataError`) is
defined in ``oakenkv.format.layout`` and re-exported here; this module sits above the kernels and the reference, and
nothing below it imports it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from oakenkv.format.config import OakenConfig
from oakenkv.format.layout import (
    ADVANCE_CONTINUE,
    CHUNK_SIZE,
    COO_CODE_BIT4,
    COO_ENTRY_BITS,
    COO_GROUP_BIT,
    COO_INDEX_MASK,
    DENSE_BITS,
    HEADER_BITS,
    MAX_DIM,
    MAX_ROW_SPARSE_BYTES,
    NUM_SCALES,
    SCALE_NAMES,
    CorruptDataError,
    EncodedBatch,
    check_encoded,
    dense_bytes,
    expected_bits,
    num_chunks,
)
from oakenkv.kernels.cpu.codec import decode_batch, encode_batch, sparse_stream_stats
from oakenkv.quant.quantizer import ThresholdsLike
from oakenkv.quant.reference import pack, unpack


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


def effective_bits(enc: EncodedBatch) -> BitBreakdown:
    """Bits per value of ``enc`` counted from its bytes: dense nibbles, COO bytes (escapes included), the stored
    scales (``EncodedBatch.stored_scales``) and the 16-bit per-row header. Page-table and fragmentation overhead
    are not part of the format and not counted.
    """
    n, d = enc.num_rows, enc.dim
    values = n * d
    if values == 0:
        raise ValueError("effective_bits of an empty batch is undefined")
    entries, escapes = sparse_stream_stats(enc)
    dense = 8.0 * enc.dense.numel() / values
    sparse = 8.0 * enc.sparse.numel() / values
    scales = 8.0 * n * enc.stored_scale_bytes() / values  # the stored ones (static grids: the outer two)
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


def encode(
    x: torch.Tensor, thr: ThresholdsLike, config: OakenConfig | None = None, group: ThresholdsLike | None = None
) -> EncodedBatch:
    """Quantize and pack rows in one fast pass: equal to ``pack(quantize(x, thr, config, group))`` byte for byte.

    Args:
        x: float ``[N, D]`` (fp32, fp16 or bf16), one row per quantization vector; finite.
        thr: the layer's ``(to_lo, ti_lo, ti_hi, to_hi)``.
        group: thresholds to group the values by, ``thr`` then only shifting (and decoding) them: adaptive
            grouping (``oakenkv.quant.adapt``).
    """
    return encode_batch(x, thr, config or OakenConfig(), group)


def decode(enc: EncodedBatch, thr: ThresholdsLike, config: OakenConfig | None = None) -> torch.Tensor:
    """Unpack and dequantize in one fast pass: float32 ``[N, D]`` equal to ``dequantize(unpack(enc))`` bit for bit.

    Raises :class:`CorruptDataError` for truncated or corrupted input; never reads out of bounds.
    """
    return decode_batch(enc, thr, config or OakenConfig())


__all__ = [
    "ADVANCE_CONTINUE",
    "CHUNK_SIZE",
    "COO_CODE_BIT4",
    "COO_ENTRY_BITS",
    "COO_GROUP_BIT",
    "COO_INDEX_MASK",
    "DENSE_BITS",
    "HEADER_BITS",
    "MAX_DIM",
    "MAX_ROW_SPARSE_BYTES",
    "NUM_SCALES",
    "SCALE_NAMES",
    "BitBreakdown",
    "CorruptDataError",
    "EncodedBatch",
    "check_encoded",
    "decode",
    "dense_bytes",
    "effective_bits",
    "encode",
    "expected_bits",
    "num_chunks",
    "pack",
    "unpack",
]
