"""The two storage formats Oaken's fused dense-and-sparse encoding is compared with (the paper's Section 5.2, the
seed's table 3.1), with numba decoders so that their decode throughput can be measured next to the fused one.

Both store the same quantized numbers as the fused format (``oakenkv.quant.quantizer``), the same six fp16 scales and
the same 16-bit per-row header, so that only the way outliers are stored differs:

* **pure dense**: every value in a 5-bit slot (8 values in 5 bytes, value ``8m + t`` in bits ``5t..5t+4`` of the
  little-endian 40-bit word ``m``), plus the group of every value in a 2-bit map (4 values per byte, low bits
  first). The paper counts only the 5 bits; a decoder also needs each value's group, so both figures are reported
  (``bits_paper`` = 5-bit slots + scales + header, ``bits`` = bytes actually stored).
* **pure sparse** (conventional dense-and-sparse, as KVQuant): a 4-bit slot for every value (0 for outliers) and,
  per outlier, a 16-bit fp16 value plus an index byte (6-bit index, 1 group bit, 1 marker bit): 24 bits stored,
  23 counted by the paper. Chunks advance naturally when the index does not increase; otherwise a *marker* record
  (bit 7 set) carries the chunk advance in its 16-bit field. The fp16 value is the dequantized Oaken value, so
  the decoded rows equal the fused format's fp16 decode.

These are measurement formats: their decoders trust their input (no validation) and they have no reference
implementation beyond the round-trip tests against the fused decoder. They store six per-row scales: a static-grid
config (``OakenConfig.static_grids``) is refused (:func:`check_config`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from numba import njit, prange

from oakenkv.format.config import OakenConfig
from oakenkv.format.layout import CHUNK_SIZE, HEADER_BITS, NUM_SCALES
from oakenkv.kernels.cpu.codec import LUT_SIZE, fill_lut
from oakenkv.kernels.cpu.helpers import f32_to_f16_bits_array
from oakenkv.quant.quantizer import GROUP_MIDDLE, GROUP_OUTER, QuantizedVectors, ThresholdsLike, thresholds_tuple

_BLOCK_ROWS = 64


@dataclass
class PureDense:
    """codes5: uint8 ``[N, 5 * ceil(D/8)]``; groups2: uint8 ``[N, ceil(D/4)]``; scales: fp16 ``[N, 6]``."""

    codes5: torch.Tensor
    groups2: torch.Tensor
    scales: torch.Tensor
    dim: int

    def bits(self) -> dict[str, float]:
        n, d = self.codes5.shape[0], self.dim
        values = n * d
        scales = 8.0 * self.scales.numel() * self.scales.element_size() / values
        slots = 8.0 * self.codes5.numel() / values
        gmap = 8.0 * self.groups2.numel() / values
        return {
            "bits": slots + gmap + scales,
            "bits_paper": 5.0 + scales,
            "slots": slots,
            "group_map": gmap,
            "scales": scales,
        }


@dataclass
class PureSparse:
    """dense: uint8 ``[N, ceil(D/2)]``; records: uint8 ``[R, 3]`` (fp16 value little-endian, index byte);
    offsets: int64 ``[N + 1]`` (records of row r); scales: fp16 ``[N, 6]``."""

    dense: torch.Tensor
    records: torch.Tensor
    offsets: torch.Tensor
    scales: torch.Tensor
    dim: int
    num_outliers: int

    def bits(self) -> dict[str, float]:
        n, d = self.dense.shape[0], self.dim
        values = n * d
        scales = 8.0 * self.scales.numel() * self.scales.element_size() / values
        dense = 8.0 * self.dense.numel() / values
        sparse = 8.0 * self.records.numel() / values
        header = HEADER_BITS / d
        return {
            "bits": dense + sparse + scales + header,
            "bits_paper": dense + 23.0 * self.num_outliers / values + scales + header,
            "dense": dense,
            "sparse": sparse,
            "scales": scales,
            "header": header,
        }


def _scales(q: QuantizedVectors) -> torch.Tensor:
    n = q.codes.shape[0]
    return torch.stack([q.mins, q.maxs], dim=2).reshape(n, NUM_SCALES).contiguous()


def pack_pure_dense(q: QuantizedVectors) -> PureDense:
    """Pure dense layout of quantized rows (numpy bit packing)."""
    n, d = q.codes.shape
    d8, d4 = -(-d // 8) * 8, -(-d // 4) * 4
    codes = np.zeros((n, d8), np.uint64)
    codes[:, :d] = q.codes.numpy()
    words = (codes.reshape(n, -1, 8) << (np.arange(8, dtype=np.uint64) * np.uint64(5))).sum(axis=2, dtype=np.uint64)
    codes5 = words.view(np.uint8).reshape(n, -1, 8)[:, :, :5].reshape(n, -1)
    groups = np.zeros((n, d4), np.uint8)
    groups[:, :d] = q.groups.numpy()
    g = groups.reshape(n, -1, 4)
    groups2 = g[:, :, 0] | (g[:, :, 1] << 2) | (g[:, :, 2] << 4) | (g[:, :, 3] << 6)
    return PureDense(torch.from_numpy(np.ascontiguousarray(codes5)), torch.from_numpy(groups2), _scales(q), d)


def pack_pure_sparse(q: QuantizedVectors, dequantized: torch.Tensor) -> PureSparse:
    """Pure sparse layout: ``dequantized`` float32 ``[N, D]`` supplies the outliers' 16-bit values."""
    n, d = q.codes.shape
    outlier = (q.groups != GROUP_MIDDLE).numpy()
    nib = np.where(outlier, 0, q.codes.numpy()).astype(np.uint8)
    if d % 2:
        nib = np.concatenate([nib, np.zeros((n, 1), np.uint8)], axis=1)
    dense = nib[:, 0::2] | (nib[:, 1::2] << 4)
    vals = dequantized.to(torch.float16).view(torch.int16).numpy().view(np.uint16)
    groups = q.groups.numpy()
    records: list[tuple[int, int]] = []
    offsets = [0]
    for r in range(n):
        c, p = 0, -1
        for j in np.flatnonzero(outlier[r]).tolist():
            cc, i = divmod(j, CHUNK_SIZE)
            if not ((cc == c and i > p) or (cc == c + 1 and i <= p)):
                records.append((cc - c, 0x80))  # marker: advance cc - c, restart the chunk
                c, p = cc, -1
            records.append((int(vals[r, j]), i | (0x40 if groups[r, j] == GROUP_OUTER else 0)))
            c, p = cc, i
        offsets.append(len(records))
    rec = np.zeros((len(records), 3), np.uint8)
    if records:
        arr = np.asarray(records, dtype=np.int64)
        rec[:, 0], rec[:, 1], rec[:, 2] = arr[:, 0] & 0xFF, arr[:, 0] >> 8, arr[:, 1]
    return PureSparse(
        torch.from_numpy(np.ascontiguousarray(dense)),
        torch.from_numpy(rec),
        torch.tensor(offsets, dtype=torch.int64),
        _scales(q),
        d,
        int(outlier.sum()),
    )


@njit(cache=True, nogil=True, parallel=True)
def _decode_pure_dense_f16(codes5, groups2, scales, thr, inner_bits, outer_bits, out):
    n, d = out.shape
    nblocks = (n + _BLOCK_ROWS - 1) // _BLOCK_ROWS
    for b in prange(nblocks):
        lut = np.empty(LUT_SIZE, np.float32)
        lut16 = np.empty(LUT_SIZE, np.uint16)
        base = np.array([0, 16, 48], np.int64)  # lut offset of each group id
        for r in range(b * _BLOCK_ROWS, min(n, (b + 1) * _BLOCK_ROWS)):
            fill_lut(scales[r], thr, inner_bits, outer_bits, lut)
            f32_to_f16_bits_array(lut, lut16)
            for m in range(d // 8):
                w = np.uint64(0)
                for t in range(5):
                    w |= np.uint64(codes5[r, 5 * m + t]) << np.uint64(8 * t)
                g0 = groups2[r, 2 * m]
                g1 = groups2[r, 2 * m + 1]
                gw = np.int64(g0) | (np.int64(g1) << 8)
                for t in range(8):
                    code = np.int64((w >> np.uint64(5 * t)) & np.uint64(31))
                    g = (gw >> (2 * t)) & 3
                    out[r, 8 * m + t] = lut16[base[g] + code]
            for j in range(d // 8 * 8, d):
                m, t = j // 8, j % 8
                code = 0
                for k in range(5):
                    bit = 5 * t + k
                    code |= ((np.int64(codes5[r, 5 * m + bit // 8]) >> (bit % 8)) & 1) << k
                g = (np.int64(groups2[r, j // 4]) >> (2 * (j % 4))) & 3
                out[r, j] = lut16[base[g] + code]


@njit(cache=True, nogil=True, parallel=True)
def _decode_pure_sparse_f16(dense, records, offsets, scales, thr, inner_bits, outer_bits, out):
    n, d = out.shape
    nblocks = (n + _BLOCK_ROWS - 1) // _BLOCK_ROWS
    for b in prange(nblocks):
        lut = np.empty(LUT_SIZE, np.float32)
        lut16 = np.empty(16, np.uint16)
        pairs = np.empty(512, np.uint16)
        wide = pairs.view(np.uint32)
        for r in range(b * _BLOCK_ROWS, min(n, (b + 1) * _BLOCK_ROWS)):
            fill_lut(scales[r], thr, inner_bits, outer_bits, lut)
            f32_to_f16_bits_array(lut, lut16)
            for x in range(256):
                pairs[2 * x] = lut16[x & 0xF]
                pairs[2 * x + 1] = lut16[x >> 4]
            ow = out[r][: d & ~1].view(np.uint32)
            for j in range(d >> 1):
                ow[j] = wide[dense[r, j]]
            if d & 1:
                out[r, d - 1] = lut16[dense[r, d >> 1] & 0xF]
            c, p = 0, -1
            for t in range(offsets[r], offsets[r + 1]):
                v = np.uint16(records[t, 0]) | (np.uint16(records[t, 1]) << np.uint16(8))
                e = np.int64(records[t, 2])
                if e & 0x80:
                    c += np.int64(v)
                    p = -1
                    continue
                i = e & 63
                if i <= p:
                    c += 1
                out[r, c * CHUNK_SIZE + i] = v
                p = i


def check_config(config: OakenConfig) -> None:
    """NotImplementedError for static grids (``OakenConfig.static_grids``): these formats store six per-row scales,
    their comparison with the fused format would not be like for like."""
    if config.static_grids:
        raise NotImplementedError(
            "the pure dense and pure sparse formats store six per-row scales; static middle/inner grids "
            "(OakenConfig.static_grids) are not compared with them"
        )


def decode_pure_dense(pd: PureDense, thr: ThresholdsLike, config: OakenConfig, out: torch.Tensor) -> torch.Tensor:
    """Decode into fp16 ``out [N, D]``."""
    check_config(config)
    thr_a = np.asarray(thresholds_tuple(thr), np.float32)
    _decode_pure_dense_f16(
        pd.codes5.numpy(),
        pd.groups2.numpy(),
        np.ascontiguousarray(pd.scales.numpy(), dtype=np.float32),
        thr_a,
        config.inner_bits,
        config.outer_bits,
        out.view(torch.int16).numpy().view(np.uint16),
    )
    return out


def decode_pure_sparse(ps: PureSparse, thr: ThresholdsLike, config: OakenConfig, out: torch.Tensor) -> torch.Tensor:
    """Decode into fp16 ``out [N, D]``."""
    check_config(config)
    thr_a = np.asarray(thresholds_tuple(thr), np.float32)
    _decode_pure_sparse_f16(
        ps.dense.numpy(),
        ps.records.numpy(),
        ps.offsets.numpy(),
        np.ascontiguousarray(ps.scales.numpy(), dtype=np.float32),
        thr_a,
        config.inner_bits,
        config.outer_bits,
        out.view(torch.int16).numpy().view(np.uint16),
    )
    return out
