"""Cycle-counted, stage-by-stage Python models of Oaken's quantization and dequantization engines.

Plain Python integers, one 64-value chunk per stage call, written the way the hardware (and the Amaranth RTL in
:mod:`oakenkv.hw.rtl`) computes: no torch, no float. They are the bridge between the vectorised definition in
:mod:`oakenkv.hw.arith` (tested equal) and the RTL (simulated against these stage functions lane for lane), and
they produce the codec's bytes themselves (:class:`QuantEngineModel.encode_row` equals
``codec.pack(arith.quantize_hw(x))`` byte for byte, scales as fp16 bit patterns).

Quantization engine (per row of ``D`` values, ``C = ceil(D / 64)`` chunks; see ``docs/hw.md``)::

    pass 1, one chunk per cycle:  Q1 decomposer (group compare + shift)  ->  min/max finders (row registers)
    once per row:                 Q2 scale calculator (j search, step ROM, reciprocal, fp16 rounding)
    pass 2, one chunk per cycle:  Q3 code units -> outlier splitter (dense nibbles | COO entries)
                                     -> zero-remove shifter (compact entry list of the chunk)
    per entry:                    Q4 COO stream formatter (escapes; serial, off the chunk path)

Dequantization engine (per chunk)::

    D0 sparse stream parser (per row, serial over bytes): the COO stream -> per-chunk entry lists
    D1 zero-insert shifter: compact entry list -> per-lane (outlier, group bit, fifth code bit)
    D2 outlier extractor (5-bit codes, group ids) -> middle/inner/outer dequantizers -> OR merge
    once per row: scale preprocessing (fp16 -> FX, (max - min) * ROM)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from oakenkv.format.layout import COO_GROUP_BIT, COO_INDEX_MASK
from oakenkv.hw.arith import (
    DEQ_SHIFT,
    DIV_SHIFT,
    FX_FRAC,
    LUT_BITS,
    RECIP_BITS,
    RECIP_LUT,
    SMALL_RECIP,
    STEP_EXTRA,
    dequant_const,
)
from oakenkv.quant.quantizer import GROUP_INNER, GROUP_MIDDLE, GROUP_OUTER

LANES = 64


def check_engine_bits(bits: tuple[int, int, int]) -> None:
    """Refuse group widths the engines do not model: the paper's 4-bit dense slot (two codes a byte) with 4- or 5-bit
    inner and outer codes (the slot plus the COO entry's bit). Other widths packed 4-bit bytes or indexed past the
    step ROM's 32 entries, silently or with an IndexError."""
    if len(bits) != 3 or bits[0] != 4 or any(b not in (4, 5) for b in bits[1:]):
        raise ValueError(f"the engines model the paper's 4-bit dense slot, bits (4, 4 or 5, 4 or 5); got {bits}")


# --------------------------------------------------------------------------------------------------------------
# Scalar units shared by both engines
# --------------------------------------------------------------------------------------------------------------


def fx_to_fp16_bits(v: int, frac: int) -> int:
    """fp16 converter: the fixed-point integer ``v * 2^-frac`` -> fp16 bit pattern (round to nearest even)."""
    sign = 0x8000 if v < 0 else 0
    m = -v if v < 0 else v
    if m == 0:
        return sign
    e = m.bit_length() - 1 - frac
    qe = max(e - 10, -24)
    sh = qe + frac
    if sh > 0:
        q, rem, half = m >> sh, m & ((1 << sh) - 1), 1 << (sh - 1)
        if rem > half or (rem == half and q & 1):
            q += 1
    else:
        q = m << -sh
    if q == 2048:  # rounding carried into the next binade
        q, qe = 1024, qe + 1
    if q < 1024:  # subnormal (only possible at qe = -24)
        return sign | q
    exp_field = qe + 25
    if exp_field >= 31:
        raise ValueError("a grid end point exceeds the fp16 maximum (65504)")
    return sign | (exp_field << 10) | (q - 1024)


def fp16_bits_to_fx(b: int) -> int:
    """fp16 bit pattern -> FX integer (exact)."""
    exp_field, man = (b >> 10) & 31, b & 1023
    if exp_field == 31:
        raise ValueError("fp16 scale is Inf or NaN")
    mag = man if exp_field == 0 else (1024 + man) << (exp_field - 1)
    return -mag if b & 0x8000 else mag


def reciprocal_unit(d: int) -> tuple[int, int]:
    """``(Y1, L)`` with ``1 / d ~ Y1 * 2^-(RECIP_BITS + L - 1)``: leading-one detector, normaliser, LUT, Newton."""
    p = RECIP_BITS
    d = max(d, 1)
    L = d.bit_length()
    m = d << (p - L) if p >= L else d >> (L - p)
    y0 = RECIP_LUT[(m >> (p - 1 - LUT_BITS)) & (2**LUT_BITS - 1)]
    t = (m * y0) >> (p - 1)
    return (y0 * ((1 << (p + 1)) - t)) >> p, L


def signed_grid_unit(lo: int, hi: int, bits: int) -> tuple[int, int]:
    """Scale calculator of a signed group: ``(j, step)`` (see :func:`oakenkv.hw.arith.signed_grid`).

    ``j*`` is computed as the hardware does, with a thermometer of comparisons ``n * a >= (a + b) * i``.
    """
    n = 2**bits
    a, b = max(-lo, 0), max(hi, 0)
    if a + b == 0:
        return 0, 0
    jstar = sum(1 for i in range(1, n + 1) if n * a >= (a + b) * i)
    j = jstar + (1 if jstar < n and b * jstar < a * (n - 1 - jstar) else 0)
    lo_dom = j > 0 and a * (n - j) >= b * j
    num, den = (a, j) if lo_dom else (b, n - j)
    return j, max((num * SMALL_RECIP[den]) >> (DIV_SHIFT - STEP_EXTRA), 1)


# --------------------------------------------------------------------------------------------------------------
# Quantization engine
# --------------------------------------------------------------------------------------------------------------


@dataclass
class GroupScale:
    """Scale calculator output for one group: what the code units and the scale writer need."""

    lo: int  # inner: min (FX); signed: j (codes below zero)
    y1: int  # reciprocal mantissa
    shift: int  # right shift after the multiply
    valid: bool  # the group has a non-zero range / step
    min_bits: int  # fp16 bit pattern of the stored grid minimum
    max_bits: int  # fp16 bit pattern of the stored grid maximum


@dataclass
class ChunkOut:
    """Q3 output for one chunk: 32 dense bytes and the compacted COO entries (zero-remove shifter)."""

    dense: list[int]
    entries: list[int]


@dataclass
class QuantEngineModel:
    """The quantization engine for rows of ``dim`` values with FX thresholds ``t = (to_lo, ti_lo, ti_hi, to_hi)``."""

    t: tuple[int, int, int, int]
    bits: tuple[int, int, int] = (4, 5, 5)
    cycles: int = 0
    stats: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_engine_bits(tuple(self.bits))

    # Q1 -------------------------------------------------------------------------------------------------------
    def decompose(self, x: list[int]) -> tuple[list[int], list[int]]:
        """Group ids and shifted values of one chunk (``len(x) <= 64`` FX integers)."""
        to_lo, ti_lo, ti_hi, to_hi = self.t
        groups, shifted = [], []
        for v in x:
            if v > to_hi or v < to_lo:
                g, s = GROUP_OUTER, v - (to_hi if v > to_hi else to_lo)
            elif ti_lo <= v <= ti_hi:
                g, s = GROUP_INNER, v
            else:
                g, s = GROUP_MIDDLE, v - (ti_hi if v > ti_hi else ti_lo)
            groups.append(g)
            shifted.append(s)
        return groups, shifted

    @staticmethod
    def minmax_update(
        acc: list[tuple[int, int] | None], groups: list[int], shifted: list[int]
    ) -> list[tuple[int, int] | None]:
        """Min/max finders: fold one chunk into the row's ``(min, max)`` per group (``None`` = no member yet)."""
        out = list(acc)
        for g, s in zip(groups, shifted, strict=True):
            cur = out[g]
            out[g] = (s, s) if cur is None else (min(cur[0], s), max(cur[1], s))
        return out

    # Q2 -------------------------------------------------------------------------------------------------------
    def scale_calc(self, acc: list[tuple[int, int] | None]) -> list[GroupScale]:
        """Per-group grid parameters and fp16 end points from the row's min/max registers."""
        out = []
        for g in (GROUP_MIDDLE, GROUP_INNER, GROUP_OUTER):
            n = 2 ** self.bits[g]
            mn, mx = acc[g] if acc[g] is not None else (0, 0)
            if g == GROUP_INNER:
                r = mx - mn
                y1, L = reciprocal_unit(r)
                out.append(
                    GroupScale(
                        mn, y1, RECIP_BITS + L - 1, r > 0, fx_to_fp16_bits(mn, FX_FRAC), fx_to_fp16_bits(mx, FX_FRAC)
                    )
                )
            else:
                j, step = signed_grid_unit(mn, mx, self.bits[g])
                y1, L = reciprocal_unit(step)
                gmin2 = -(2 * j - 1) * step
                gmax2 = gmin2 + 2 * (n - 1) * step
                frac = FX_FRAC + STEP_EXTRA + 1
                has = acc[g] is not None
                out.append(
                    GroupScale(
                        j,
                        y1,
                        RECIP_BITS + L - 1 - STEP_EXTRA,
                        step > 0,
                        fx_to_fp16_bits(gmin2, frac) if has else 0,
                        fx_to_fp16_bits(gmax2, frac) if has else 0,
                    )
                )
        return out

    # Q3 -------------------------------------------------------------------------------------------------------
    def code_unit(self, g: int, s: int, sc: GroupScale) -> int:
        """One lane's code."""
        n = 2 ** self.bits[g]
        if not sc.valid:
            return 0
        if g == GROUP_INNER:
            q = ((s - sc.lo) * (n - 1) * sc.y1 + (1 << (sc.shift - 1))) >> sc.shift
        else:
            q = sc.lo + ((s * sc.y1) >> sc.shift)
        return min(max(q, 0), n - 1)

    def split_and_compress(self, groups: list[int], codes: list[int]) -> ChunkOut:
        """Outlier splitter + zero-remove shifter: dense nibbles and the chunk's compacted COO entry bytes."""
        nib = [c & 0xF for c in codes] + [0] * (len(codes) % 2)
        dense = [nib[2 * i] | (nib[2 * i + 1] << 4) for i in range(len(nib) // 2)]
        # The zero-remove shifter moves outlier lane i to output slot (number of outliers in lanes < i).
        entries = [
            i | (COO_GROUP_BIT if g == GROUP_OUTER else 0) | (((c >> 4) & 1) << 7)
            for i, (g, c) in enumerate(zip(groups, codes, strict=True))
            if g != GROUP_MIDDLE
        ]
        return ChunkOut(dense, entries)

    # Q4 -------------------------------------------------------------------------------------------------------
    @staticmethod
    def coo_stream(chunk_entries: list[list[int]]) -> list[int]:
        """COO stream formatter: per-chunk entry lists -> the row's byte stream with escapes (codec rules)."""
        out: list[int] = []
        c, p, prev = 0, -1, 0x00
        for cc, entries in enumerate(chunk_entries):
            for e in entries:
                i = e & COO_INDEX_MASK
                natural = e != prev and ((cc == c and i > p) or (cc == c + 1 and i <= p))
                if not natural:
                    out.append(prev)
                    k = cc - c
                    while k >= 0xFF:
                        out.append(0xFF)
                        k -= 0xFF
                    out.append(k)
                out.append(e)
                c, p, prev = cc, i, e
        return out

    # row driver -----------------------------------------------------------------------------------------------
    def encode_row(self, x: list[int]) -> tuple[list[int], list[int], list[int]]:
        """One row of FX values -> ``(dense bytes, 6 fp16 scale bit patterns, COO stream bytes)``.

        Cycle count (added to ``self.cycles``): ``C`` cycles of pass 1, 1 of the scale calculator, ``C`` of
        pass 2 (the RTL's register stages; the formatter runs beside pass 2 and is not on the chunk path).
        """
        chunks = [x[i : i + LANES] for i in range(0, len(x), LANES)]
        acc: list[tuple[int, int] | None] = [None, None, None]
        for ch in chunks:
            groups, shifted = self.decompose(ch)
            acc = self.minmax_update(acc, groups, shifted)
        scales = self.scale_calc(acc)
        dense: list[int] = []
        entries: list[list[int]] = []
        for ch in chunks:  # pass 2 re-reads the row (the input buffer holds it, as the vector unit's SRAM does)
            groups, shifted = self.decompose(ch)
            codes = [self.code_unit(g, s, scales[g]) for g, s in zip(groups, shifted, strict=True)]
            out = self.split_and_compress(groups, codes)
            dense += out.dense
            entries.append(out.entries)
        self.cycles += 2 * len(chunks) + 1
        flat = [b for sc in scales for b in (sc.min_bits, sc.max_bits)]
        return dense, flat, self.coo_stream(entries)


# --------------------------------------------------------------------------------------------------------------
# Dequantization engine
# --------------------------------------------------------------------------------------------------------------


@dataclass
class DequantEngineModel:
    """The dequantization engine: FX thresholds ``t`` and the group bits."""

    t: tuple[int, int, int, int]
    bits: tuple[int, int, int] = (4, 5, 5)
    cycles: int = 0

    def __post_init__(self) -> None:
        check_engine_bits(tuple(self.bits))

    @staticmethod
    def parse_stream(stream: list[int], dim: int) -> list[list[int]]:
        """D0 sparse stream parser: a row's COO bytes -> per-chunk entry lists (codec rules; trusted input)."""
        chunks: list[list[int]] = [[] for _ in range((dim + LANES - 1) // LANES)]
        c, p, prev = 0, -1, 0x00
        j = 0
        while j < len(stream):
            e = stream[j]
            j += 1
            if prev is not None and e == prev:
                k = 0
                while True:
                    a = stream[j]
                    j += 1
                    k += a
                    if a != 0xFF:
                        break
                c, p, prev = c + k, -1, None
                continue
            i = e & COO_INDEX_MASK
            if i <= p:
                c += 1
            chunks[c].append(e)
            p, prev = i, e
        return chunks

    def row_scales(self, scale_bits: list[int]) -> list[tuple[int, int]]:
        """Scale preprocessing: per group ``(g0, dr)`` with ``g0`` the FX minimum and ``dr = (g1 - g0) * RD_n``."""
        out = []
        for g in range(3):
            g0, g1 = fp16_bits_to_fx(scale_bits[2 * g]), fp16_bits_to_fx(scale_bits[2 * g + 1])
            out.append((g0, (g1 - g0) * dequant_const(self.bits[g])))
        return out

    @staticmethod
    def zero_insert(entries: list[int], lanes: int = LANES) -> list[tuple[bool, int, int]]:
        """D1: per lane ``(is_outlier, group bit, fifth code bit)`` from the compact entry list."""
        out = [(False, 0, 0)] * lanes
        for e in entries:
            out[e & COO_INDEX_MASK] = (True, (e >> 6) & 1, (e >> 7) & 1)
        return out

    def dequant_chunk(
        self, dense: list[int], entries: list[int], scales: list[tuple[int, int]], n_vals: int
    ) -> list[int]:
        """D1 + D2 for one chunk: ``dense`` bytes (``ceil(n_vals / 2)``) -> ``n_vals`` FX outputs."""
        to_lo, ti_lo, ti_hi, to_hi = self.t
        flags = self.zero_insert(entries)
        out = []
        for lane in range(n_vals):
            nib = (dense[lane // 2] >> (4 * (lane % 2))) & 0xF
            outlier, gbit, b4 = flags[lane]
            g = (GROUP_OUTER if gbit else GROUP_INNER) if outlier else GROUP_MIDDLE
            code = nib | (b4 << 4)
            g0, dr = scales[g]
            v = g0 + ((code * dr) >> DEQ_SHIFT)
            if g == GROUP_MIDDLE:
                v += ti_hi if v > 0 else ti_lo
            elif g == GROUP_OUTER:
                v += to_hi if v > 0 else to_lo
            out.append(v)
        return out

    def decode_row(self, dense: list[int], scale_bits: list[int], stream: list[int], dim: int) -> list[int]:
        """One row -> ``dim`` FX values. Adds ``C`` cycles (one chunk per cycle; D0 runs ahead of it)."""
        chunks = self.parse_stream(stream, dim)
        scales = self.row_scales(scale_bits)
        out: list[int] = []
        for c, entries in enumerate(chunks):
            n_vals = min(LANES, dim - c * LANES)
            out += self.dequant_chunk(dense[c * 32 : c * 32 + (n_vals + 1) // 2], entries, scales, n_vals)
        self.cycles += len(chunks)
        return out
