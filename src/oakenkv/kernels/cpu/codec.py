"""Fast CPU kernels (numba) for the fused dense-and-sparse format: quantize+pack and unpack+dequantize.

Why one module (over 600 lines): numba's disk cache is invalidated only by a change of the function's own file,
and encode and decode share helpers that numba compiles into them (``steps_decode_finite``: the one scale check
both apply); split over files, an edit of a helper would leave stale compiled callers in the other files.

Bit-exact with the reference (``oakenkv.quant.quantizer`` + ``oakenkv.quant.reference``): every step repeats the
reference's float32
operations in the same order (``np.float32`` constants, no fastmath, no FMA contraction, true divisions, never a
multiplication by a reciprocal). Rows are independent and processed in parallel (``prange`` over blocks of rows);
each block allocates its scratch once so that narrow rows (D = 64..256) do not pay an allocation per row.

Static grids (``OakenConfig.static_grids``): the encoders take the layer's static grid (float32 ``[4]``,
``oakenkv.quant.quantizer.format_static_grid``) for the middle and inner groups instead of each row's (an empty array:
per-row grids), exactly as the reference quantizer; the record encoder then writes the outer scales only, and the
record decoder takes the static grid back. The batch decoder reads the in-memory ``[N, 6]`` scales as ever (its
wrapper checks the static columns are the grid). Static levels (``OakenConfig.static_levels``): the encoders take the
layer's ``L`` grids (float32 ``[4 L]``, level ``j``'s at ``4 j``) and the levels' clip factors (float32 ``[L]``) and
pick each row's as the reference does (``oakenkv.quant.quantizer.pick_levels``); the level index goes to the batch's
``level`` or the record's level byte, which the record decoder reads (``ERR_LEVEL`` beyond ``L``).

Kernels never raise: they return an error code per row (``ERR_*``) and the Python wrappers raise
``CorruptDataError`` / ``ValueError`` with the row and the reason. Decoding validates every byte it reads, so
corrupted or truncated input can never make it read or write out of bounds.

For other numba kernels (the decode-attention kernel) the single-row helpers :func:`decode_row_into` and
:func:`decode_row_into_lut` are ``@njit`` functions that can be called from inside their loops.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from numba import njit, prange, types
from numba.cpython.unsafe.numbers import leading_zeros, trailing_zeros
from numba.extending import overload

from oakenkv.format.config import MIDDLE_BITS_CHOICES, OakenConfig
from oakenkv.format.layout import (
    ADVANCE_CONTINUE,
    CHUNK_SIZE,
    COO_CODE_BIT4,
    COO_GROUP_BIT,
    COO_INDEX_MASK,
    ERR_ESCAPE_NO_ENTRY,
    ERR_ESCAPE_TRUNCATED,
    ERR_FIFTH_BIT,
    ERR_LEVEL,
    ERR_NONFINITE,
    ERR_OK,
    ERR_PADDING,
    ERR_POSITION_RANGE,
    ERR_SCALE_NONFINITE,
    ERR_SCALE_OVERFLOW,
    ERR_SCALE_RANGE,
    ERR_SHAPE,
    ERR_THRESHOLDS,
    ERR_ZERO_ADVANCE,
    ERROR_MESSAGES,
    MAX_DIM,
    NUM_SCALES,
    STATIC_COLUMNS,
    CorruptDataError,
    EncodedBatch,
    check_encoded,
    dense_bytes,
    sparse_capacity,
    stored_scales,
)
from oakenkv.kernels.cpu.helpers import (
    HW_COMPRESS,
    all_view,
    compress_chunk,
    f16_bits,
    f16_widen,
    f32_at,
    f32_to_f16_bits,
    keep_alive,
    out_elem,
    popcount64,
    round_to_f16,
    row_view,
    span_view,
)
from oakenkv.quant.quantizer import (
    STEP_FLOOR,
    ThresholdsLike,
    format_level_grids,
    format_static_grid,
    grouping_tuple,
    thresholds_tuple,
)

#: float32 scratch per row for the decode look-up tables: for ``b``-bit slots, ``2^b`` middle codes at 0, then
#: ``2^(b+1)`` inner codes at ``2^b`` and ``2^(b+1)`` outer codes at ``3 * 2^b``: 16 + 32 + 32 for the paper's 4 bits,
#: the widest slot.
LUT_SIZE = 5 << max(MIDDLE_BITS_CHOICES)
#: The narrowest and widest dense slot (``OakenConfig.middle_bits``) the kernels read.
_MB_MIN, _MB_MAX = min(MIDDLE_BITS_CHOICES), max(MIDDLE_BITS_CHOICES)
#: Up to this slot width the encoder keeps a value's code and group in one byte (code + 32 x group: an outlier's
#: ``middle_bits + 1``-bit code stays below 32); wider slots keep the groups in a byte array of their own
#: (:func:`wide_scratch`). An outlier's code is one byte wide at most (uint8 codes, as the reference's).
_NARROW_MAX = 4
assert _MB_MIN >= 1 and _MB_MAX + 1 <= 8 and _NARROW_MAX + 1 <= 5

#: Rows per parallel work item: amortises scratch allocation, small enough to balance 2..64 threads.
_BLOCK_ROWS = 64

_F32 = np.float32
_FP16_MAX = 65504.0
#: Bytes of one stored scale, fp16 and fp32 (the config's definition, as constants the kernels compile in).
_F16_ITEMSIZE = OakenConfig(scale_dtype="float16").scale_itemsize
_F32_ITEMSIZE = OakenConfig(scale_dtype="float32").scale_itemsize
_STEP_FLOOR = np.float32(STEP_FLOOR)
_INF32 = np.float32(np.inf)


def _is_u8_vector(a):  # pragma: no cover - only its overload runs, inside @njit code
    """Whether ``a`` is a 1-D uint8 array: a constant of the compiled specialisation (a row decoder called with
    int64 "bytes" must refuse them, not index tables with them)."""
    raise NotImplementedError


@overload(_is_u8_vector)
def _is_u8_vector_impl(a):
    ok = isinstance(a, types.Array) and a.ndim == 1 and a.dtype == types.uint8
    return lambda a: ok


def _static_rows(static, n):  # pragma: no cover - only its overload runs, inside @njit code
    """The record kernels' optional ``static`` argument: the given float32 ``[n, 4]`` array, or (omitted or None)
    an empty float32 ``[n, 0]`` one (per-row grids), so that calls made before static grids existed still work."""
    raise NotImplementedError


@overload(_static_rows)
def _static_rows_impl(static, n):
    if static is None or isinstance(static, (types.NoneType, types.Omitted)):
        return lambda static, n: np.empty((n, 0), np.float32)
    return lambda static, n: static


def _levels_arg(levels):  # pragma: no cover - only its overload runs, inside @njit code
    """The record encoder's optional ``levels`` argument: the given float32 ``[L]`` array, or (omitted or None) an
    empty one (no static levels), so that calls made before static levels existed still work."""


@overload(_levels_arg)
def _levels_arg_impl(levels):
    if levels is None or isinstance(levels, (types.NoneType, types.Omitted)):
        return lambda levels: np.empty(0, np.float32)
    return lambda levels: levels


def _is_f32_vector(a):  # pragma: no cover - only its overload runs, inside @njit code
    """Whether ``a`` is a 1-D float32 array (see _is_u8_vector)."""
    raise NotImplementedError


@overload(_is_f32_vector)
def _is_f32_vector_impl(a):
    ok = isinstance(a, types.Array) and a.ndim == 1 and a.dtype == types.float32
    return lambda a: ok


@njit(cache=True, nogil=True, error_model="numpy")
def _group_ends_zero(lo, step, n_codes, shift_lo, shift_hi):
    """0.0 if a group's lowest and highest code decode to finite values, else NaN: the decoder's float32
    operations (``v = lo + code * step``, then ``+ shift_hi`` if ``v > 0`` else ``+ shift_lo``; 0, 0 for the
    unshifted inner group), and ``w - w`` (0 for a finite ``w``, NaN for an infinite or NaN one). Every other code's
    value lies between the two ends (rounding is monotonic), so all are finite. Branch-free: it runs per row."""
    zero = _F32(0.0)
    v0 = lo + _F32(0.0) * step
    v1 = lo + _F32(n_codes - 1) * step
    w0 = v0 + (shift_hi if v0 > zero else shift_lo)
    w1 = v1 + (shift_hi if v1 > zero else shift_lo)
    return (w0 - w0) + (w1 - w1)


@njit(cache=True, nogil=True, error_model="numpy")
def steps_decode_finite(m_lo, m_step, i_lo, i_step, o_lo, o_step, thr, n_mid, n_in, n_out):
    """The format's rule on one row's scales, given each group's code-0 value and step (float32, as the decoders
    compute them), its number of codes, and ``thr`` (float32 ``[4]``): every code of each group decodes to a finite
    value. The decoders refuse a row that breaks it (``ERR_SCALE_NONFINITE``) and the encoder never writes one
    (``ERR_SCALE_RANGE``); NaN or infinite scales break it."""
    zero = _F32(0.0)
    z = (
        _group_ends_zero(m_lo, m_step, n_mid, thr[1], thr[2])
        + _group_ends_zero(i_lo, i_step, n_in, zero, zero)
        + _group_ends_zero(o_lo, o_step, n_out, thr[0], thr[3])
    )
    return z == zero


@njit(cache=True, nogil=True, error_model="numpy")
def scales_decode_finite(mid_lo, mid_hi, in_lo, in_hi, out_lo, out_hi, thr, inner_bits, outer_bits, middle_bits=4):
    """:func:`steps_decode_finite` from the six scales (float32) and the groups' bits."""
    n_mid, n_in, n_out = 1 << middle_bits, 1 << inner_bits, 1 << outer_bits
    return steps_decode_finite(
        mid_lo,
        (mid_hi - mid_lo) / _F32(n_mid - 1),
        in_lo,
        (in_hi - in_lo) / _F32(n_in - 1),
        out_lo,
        (out_hi - out_lo) / _F32(n_out - 1),
        thr,
        n_mid,
        n_in,
        n_out,
    )


@njit(cache=True, nogil=True)
def bits_valid(middle_bits, inner_bits, outer_bits):
    """Whether the groups' bits are a format the kernels read: a supported slot width (2..7) and outlier codes of
    the slot's width or one more (the COO entry's code bit)."""
    return (
        _MB_MIN <= middle_bits <= _MB_MAX
        and middle_bits <= inner_bits <= middle_bits + 1
        and middle_bits <= outer_bits <= middle_bits + 1
    )


@njit(cache=True, nogil=True)
def slot_at(dense_row, j, mb):
    """The ``mb``-bit dense slot of value ``j`` (int64): bits ``mb * j ..`` of the row's little-endian bit stream
    (``oakenkv.format.layout``); a 3-bit slot may straddle two bytes. The caller checks ``j < D``."""
    o = np.uint64(j * mb)
    i = o >> np.uint64(3)
    sh = o & np.uint64(7)
    v = np.int64(dense_row[i]) >> np.int64(sh)
    if sh + np.uint64(mb) > np.uint64(8):
        v |= np.int64(dense_row[i + np.uint64(1)]) << np.int64(np.uint64(8) - sh)
    return v & ((np.int64(1) << mb) - 1)


@njit(cache=True, nogil=True)
def thresholds_valid(thr):
    """Whether ``thr`` holds 4 finite values with ``to_lo < ti_lo <= ti_hi < to_hi`` (NaN fails every test)."""
    if thr.shape[0] < 4:
        return False
    return np.isfinite(thr[0]) and np.isfinite(thr[3]) and thr[0] < thr[1] <= thr[2] < thr[3]


# --------------------------------------------------------------------------------------------------------------
# Encode: one row
# --------------------------------------------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def _step_at(kk, lo_mag, has_lo, hi_mag, has_hi, nm1):
    """step(k) of quant._signed_grid for zero slot ``kk`` (float32, same operations and order)."""
    kf = _F32(kk)
    below = kf + _F32(1.0)
    above = nm1 - kf
    need_lo = _F32(0.0)
    if has_lo:
        need_lo = lo_mag / max(below, _F32(1.0)) if below > _F32(0.0) else _INF32
    need_hi = _F32(0.0)
    if has_hi:
        need_hi = hi_mag / max(above, _F32(1.0)) if above > _F32(0.0) else _INF32
    return max(max(need_lo, need_hi), _STEP_FLOOR)


@njit(cache=True, nogil=True)
def _signed_grid(lo_mag, lo_minmag, has_lo, hi_mag, hi_min, has_hi, n, fp16):
    """(gmin, gmax) float32 of a signed group, before rounding (see quant._signed_grid).

    ``lo_mag``/``lo_minmag``: largest/smallest magnitude of the negative shifted values; ``hi_mag``/``hi_min``:
    largest/smallest positive shifted value. Both sides: minimise the step over the zero slot k. One side: the
    plain [min, max] grid if its code nearest zero keeps the side's sign after rounding, else k = -1 / n - 1.
    """
    if not has_lo and not has_hi:
        return _F32(0.0), _F32(0.0)
    # The reference scans every k in [-1, n - 1] for the first minimum of step(k) = max(need_lo, need_hi, FLOOR).
    # need_lo = L / (k + 1) strictly decreases and need_hi = U / (n - 1 - k) strictly increases with k
    # (consecutive quotients differ by a factor >= 1 + 1/(n - 1), far above float32 rounding, wherever they exceed
    # FLOOR), so step(k) falls while need_lo >= need_hi, i.e. up to the continuous optimum kc = n L / (L + U) - 1,
    # then rises: the first minimum is floor(kc) or floor(kc) + 1 (only U: k = -1, only L: k = n - 1, each the
    # first or second of its two candidates), unless it is FLOOR, which can hold over a range of k: a scan
    # leftwards then finds its first k. Two evaluations and no data-dependent branch in the common case: the local
    # search this replaced mispredicted about once per grid (docs/notebook/perf-notes.md).
    nm1 = _F32(n - 1)
    if not has_lo:
        a = -1
    elif not has_hi:
        a = n - 2
    else:
        a = min(max(int(np.float64(n) * lo_mag / (np.float64(lo_mag) + hi_mag)) - 1, -1), n - 2)
    s0 = _step_at(a, lo_mag, has_lo, hi_mag, has_hi, nm1)
    s1 = _step_at(a + 1, lo_mag, has_lo, hi_mag, has_hi, nm1)
    k, step = (a, s0) if s0 <= s1 else (a + 1, s1)
    if step == _STEP_FLOOR:  # rare: a degenerate group, the first k of the flat minimum
        while k > -1:
            prv = _step_at(k - 1, lo_mag, has_lo, hi_mag, has_hi, nm1)
            if not prv <= step:
                break
            k, step = k - 1, prv
    best_k, best_step = _F32(k), step
    gmin = -(best_k + _F32(0.5)) * best_step
    gmax = gmin + nm1 * best_step
    if has_lo != has_hi:
        pmin = hi_min if has_hi else -lo_mag
        pmax = hi_mag if has_hi else -lo_minmag
        g0 = _round_scale(pmin, fp16)
        g1 = _round_scale(pmax, fp16)
        if has_hi:
            plain = g0 > _F32(0.0)
        else:
            v_top = g0 + nm1 * ((g1 - g0) / nm1)
            plain = v_top < _F32(0.0)
        if plain:
            gmin, gmax = pmin, pmax
    return gmin, gmax


@njit(cache=True, nogil=True)
def _round_scale(v, fp16):
    """``v`` rounded to the scale dtype and back to float32, exactly as torch's ``.to(float16).float()``."""
    return round_to_f16(v) if fp16 else v


@njit(cache=True, nogil=True)
def _store_scale(v, fp16):
    """Round a grid end point to the scale dtype; returns (value, ok)."""
    if fp16:
        if abs(v) > _FP16_MAX:
            return v, False
        return round_to_f16(v), True
    return v, True


_KMIN = np.int32(-(2**31))
_KMAX = np.int32(2**31 - 1)
# keys of +inf and -inf (key(-v) = -1 - key(v)): every finite float32 lies strictly between them, every NaN beyond
_KEY_INF = np.int32(0x7F800000)
_KEY_NEG_INF = np.int32(-1 - 0x7F800000)


@njit(cache=True, nogil=True)
def _key(b):
    """Order-preserving int32 key of float32 bits ``b`` (int32), with -0.0 mapped to +0.0's key 0.

    Non-negative floats keep their bits; negative ones get their magnitude bits flipped, so integer order equals
    float order (and integer min/max reductions vectorize, unlike numba's float max()).
    """
    k = b ^ ((b >> 31) & np.int32(0x7FFFFFFF))
    return k if k != np.int32(-1) else np.int32(0)


@njit(cache=True, nogil=True, error_model="numpy")
def _row_key_stats(x, k_to_lo, k_ti_lo, k_ti_hi, k_to_hi):
    """Pass 1 of encode_row over a float32 row ``x [D]``, on the int32 keys of its values.

    Returns ``(bad, max, min, max of values <= to_hi, min of values >= to_lo, min of values >= ti_lo, max of values
    <= ti_hi)`` as keys (``_KMIN`` / ``_KMAX`` when nothing qualifies), ``bad``: the row holds a NaN or inf.
    Non-finite values have the most extreme keys (beyond +-inf's), so ``bad`` comes from the row's extremes: no
    accumulator of its own, whose 64-bit lanes would narrow the vectorization.
    """
    kmax, k_le_tohi, k_le_tihi = _KMIN, _KMIN, _KMIN
    kmin, k_ge_tolo, k_ge_tilo = _KMAX, _KMAX, _KMAX
    for j in range(x.shape[0]):
        b = np.float32(f32_at(x, j)).view(np.int32)
        k = _key(b)
        kmax = max(kmax, k)
        kmin = min(kmin, k)
        k_le_tohi = max(k_le_tohi, k if k <= k_to_hi else _KMIN)
        k_ge_tolo = min(k_ge_tolo, k if k >= k_to_lo else _KMAX)
        k_ge_tilo = min(k_ge_tilo, k if k >= k_ti_lo else _KMAX)
        k_le_tihi = max(k_le_tihi, k if k <= k_ti_hi else _KMIN)
    bad = kmax >= _KEY_INF or kmin <= _KEY_NEG_INF
    return bad, kmax, kmin, k_le_tohi, k_ge_tolo, k_ge_tilo, k_le_tihi


_I16 = np.int16
_K16MIN = np.int16(-(2**15))
_K16MAX = np.int16(2**15 - 1)
# fp16 keys of +inf and -inf: finite values lie strictly between, NaNs beyond
_KEY16_INF = np.int16(0x7C00)
_KEY16_NEG_INF = np.int16(-1 - 0x7C00)


@njit(cache=True, nogil=True)
def _key16(h):
    """Order-preserving int32 key of fp16 bits ``h`` (as _key, on 16 bits; -0.0 has +0.0's key 0)."""
    b = np.int32(np.int16(h))
    k = b ^ ((b >> np.int32(15)) & np.int32(0x7FFF))
    return k if k != np.int32(-1) else np.int32(0)


@njit(cache=True, nogil=True)
def _key16_le(t):
    """Largest fp16 key of a value <= float32 ``t`` (so that ``v <= t`` iff ``key16(v) <= _key16_le(t)``)."""
    h = f16_bits(t)
    k = _key16(h)
    return np.int16(k - 1 if f16_widen(h) > t else k)


@njit(cache=True, nogil=True)
def _key16_ge(t):
    """Smallest fp16 key of a value >= float32 ``t``."""
    h = f16_bits(t)
    k = _key16(h)
    return np.int16(k + 1 if f16_widen(h) < t else k)


@njit(cache=True, nogil=True)
def _key16_to_key(k, empty):
    """The int32 key (see _key) of the fp16 value with key ``k``; ``empty`` for the 16-bit "none" sentinels."""
    if k == _K16MIN or k == _K16MAX:  # noqa: SIM109 (numba: plain comparisons)
        return empty
    b = np.int32(k) ^ ((np.int32(k) >> np.int32(15)) & np.int32(0x7FFF))
    return _key(np.float32(f16_widen(np.uint16(b & np.int32(0xFFFF)))).view(np.int32))


@njit(cache=True, nogil=True)
def threshold_keys16(thr):
    """int16 ``[4]``: the fp16 keys that _row_key_stats16 compares with (computed once per batch)."""
    k = np.empty(4, np.int16)
    k[0], k[1] = _key16_ge(thr[0]), _key16_ge(thr[1])
    k[2], k[3] = _key16_le(thr[2]), _key16_le(thr[3])
    return k


@njit(cache=True, nogil=True, inline="always", error_model="numpy")
def _row_key_stats16(h, k16):
    """_row_key_stats on fp16 input ``h`` (int16 bit patterns of the row), twice the lanes of float32 keys;
    ``k16``: :func:`threshold_keys16` of the thresholds.

    Same results as _row_key_stats of the widened row: a comparison with a float32 threshold is one with the
    largest (smallest) fp16 key on its side, fp16 -> float32 preserves order, and both fold -0.0 into +0.0.
    NaN keys are meaningless, but such a row is rejected by ``bad`` (from the extremes, as in _row_key_stats).
    """
    k_to_lo, k_ti_lo, k_ti_hi, k_to_hi = k16[0], k16[1], k16[2], k16[3]
    kmax, k_le_tohi, k_le_tihi = _K16MIN, _K16MIN, _K16MIN
    kmin, k_ge_tolo, k_ge_tilo = _K16MAX, _K16MAX, _K16MAX
    for j in range(h.shape[0]):
        b = h[j]
        k = _I16(b ^ ((b >> _I16(15)) & _I16(0x7FFF)))
        k = k if k != _I16(-1) else _I16(0)
        kmax = max(kmax, k)
        kmin = min(kmin, k)
        k_le_tohi = max(k_le_tohi, k if k <= k_to_hi else _K16MIN)
        k_ge_tolo = min(k_ge_tolo, k if k >= k_to_lo else _K16MAX)
        k_ge_tilo = min(k_ge_tilo, k if k >= k_ti_lo else _K16MAX)
        k_le_tihi = max(k_le_tihi, k if k <= k_ti_hi else _K16MIN)
    return (
        kmax >= _KEY16_INF or kmin <= _KEY16_NEG_INF,
        _key16_to_key(kmax, _KMIN),
        _key16_to_key(kmin, _KMAX),
        _key16_to_key(k_le_tohi, _KMIN),
        _key16_to_key(k_ge_tolo, _KMAX),
        _key16_to_key(k_ge_tilo, _KMAX),
        _key16_to_key(k_le_tihi, _KMIN),
    )


@njit(cache=True, nogil=True)
def _key_value(k):
    """float32 of an int32 key (the key mapping is an involution on the bits)."""
    return np.int32(k ^ ((k >> np.int32(31)) & np.int32(0x7FFFFFFF))).view(np.float32)


@njit(cache=True, nogil=True, error_model="numpy")
def _min_above(x, lo, hi, sub):
    """Smallest ``v - sub`` over values ``lo < v <= hi`` (inf if none): a one-sided group's value nearest zero
    (``lo``: the group's grouping threshold, ``sub``: its shift threshold, ``sub <= lo``).

    ``fl(v - sub)`` does not decrease as ``v`` grows, so it is ``fl(min v - sub)``; the smallest ``v`` is found by
    its int32 key (see _key: integer reductions vectorize, numba's float min() does not;
    docs/notebook/perf-notes.md)."""
    k_lo, k_hi = _key(np.float32(lo).view(np.int32)), _key(np.float32(hi).view(np.int32))
    best = _KMAX
    for j in range(x.shape[0]):
        k = _key(np.float32(f32_at(x, j)).view(np.int32))
        best = min(best, k if (k > k_lo) & (k <= k_hi) else _KMAX)
    return _INF32 if best == _KMAX else _key_value(best) - sub


@njit(cache=True, nogil=True, error_model="numpy")
def _min_below(x, lo, hi, sub):
    """Smallest ``sub - v`` over values ``lo <= v < hi`` (inf if none): ``fl(sub - max v)``, as in _min_above."""
    k_lo, k_hi = _key(np.float32(lo).view(np.int32)), _key(np.float32(hi).view(np.int32))
    best = _KMIN
    for j in range(x.shape[0]):
        k = _key(np.float32(f32_at(x, j)).view(np.int32))
        best = max(best, k if (k >= k_lo) & (k < k_hi) else _KMIN)
    return _INF32 if best == _KMIN else sub - _key_value(best)


@njit(cache=True, nogil=True, inline="always", error_model="numpy")
def _row_codes(
    x, comb, grp, wide, go_lo, gi_lo, gi_hi, go_hi, to_lo, ti_lo, ti_hi, to_hi, mg0, m_step, ig0, i_step, og0, o_step,
    n_mid, n_in, n_out,
):  # fmt: skip
    """Pass 2 of encode_row: ``comb[j] = code + 32 * group`` (uint8) of every value, exactly as quant.quantize;
    for ``wide`` slots (a compile-time constant, :func:`_scratch_wide`) ``comb[j] = code`` and ``grp[j] = 32 * group``
    (``grp`` is ``comb`` itself for narrow ones, and unwritten).

    ``go_lo, gi_lo, gi_hi, go_hi`` group the values (Eq. 1), ``to_lo, ti_lo, ti_hi, to_hi`` shift them (Eq. 4;
    the same numbers unless an adaptive encoder groups with thresholds on or beyond them, ``oakenkv.quant.adapt``).
    Branch-free selects so that LLVM can vectorize it; no fast-math (true division, floor, exact order). The row
    holds no NaN (rejected by pass 1), so four comparisons decide everything: inner is "neither above gi_hi nor
    below gi_lo", and the reference's ``signed & (s > 0)`` is "above gi_hi" (``s = v - sh`` with ``sh`` ti_hi or
    to_hi < v, and a difference of distinct floats is never 0), ``signed & (s < 0)`` "below gi_lo".
    """
    zero, one, half = _F32(0.0), _F32(1.0), _F32(0.5)
    # per group: the divisor, and the top code (0 for a zero step: such a group has only code 0)
    top_m = _F32(n_mid - 1) if m_step > zero else zero
    top_i = _F32(n_in - 1) if i_step > zero else zero
    top_o = _F32(n_out - 1) if o_step > zero else zero
    safe_m = m_step if m_step > zero else one
    safe_i = i_step if i_step > zero else one
    safe_o = o_step if o_step > zero else one
    for j in range(x.shape[0]):
        v = f32_at(x, j)
        up_o = v > go_hi
        dn_o = v < go_lo
        up = v > gi_hi
        dn = v < gi_lo
        outer = up_o | dn_o
        inner = not (up | dn)
        sh = to_hi if up_o else (to_lo if dn_o else (ti_hi if up else (ti_lo if dn else zero)))
        s = v - sh
        lo = og0 if outer else (ig0 if inner else mg0)
        step = o_step if outer else (i_step if inner else m_step)
        top = top_o if outer else (top_i if inner else top_m)
        safe = safe_o if outer else (safe_i if inner else safe_m)
        q = np.floor((s - lo) / safe + half)
        q = min(max(q, zero), top)
        # signed groups: nudge a code that would decode on the wrong side (decoder: sign of lo + q * step)
        w = lo + q * step
        q = q + one if (up & (w <= zero)) else q
        q = q - one if (dn & (w >= zero)) else q
        q = min(max(q, zero), top)
        g = 64 if outer else (32 if inner else 0)
        if wide:
            comb[j] = np.uint8(np.int32(q))
            grp[j] = np.uint8(g)
        else:
            comb[j] = np.uint8(np.int32(q) + g)


_LANES = np.uint64(0x0706050403020100)  # each byte's index inside its 8-byte word
_LANE_STEP = np.uint64(0x0808080808080808)
# A code byte is code + 32 * group (group 0 middle, 1 inner, 2 outer): its bit 6 is the entry's group bit (outer)
# and its bit b (b = the slot width) the top code bit, which the entry keeps in bit 7 (wide slots: the code byte's
# bit b, the group byte's bit 6). Per byte of a uint64 word:
assert COO_GROUP_BIT == 0x40 and COO_CODE_BIT4 == 0x80
_GROUP_BITS = np.uint64(0x4040404040404040)
_TOP_BITS = np.uint64(0x8080808080808080)


@njit(cache=True, nogil=True)
def _write_escape(sparse_row, nb, prev, k):
    """An escape (``prev`` repeated) and a chunk advance of ``k`` at ``sparse_row[nb]``; returns the new ``nb``."""
    sparse_row[nb] = np.uint8(prev)
    nb += 1
    while k >= ADVANCE_CONTINUE:
        sparse_row[nb] = np.uint8(ADVANCE_CONTINUE)
        nb += 1
        k -= ADVANCE_CONTINUE
    sparse_row[nb] = np.uint8(k)
    return nb + 1


@njit(cache=True, nogil=True)
def _needs_escape(ch, i, e, c, p, prev):
    """Whether chunk ``ch``'s first entry ``e`` (index ``i``) needs an escape and chunk advance before it.

    State ``(c, p, prev)``: the chunk and index of the last entry and its byte (see codec's docstring): without
    an escape an entry continues the chunk if its index is larger, else starts the next one, and may not repeat
    ``prev``. Only a chunk's first entry can need an escape: later ones have larger indices.
    """
    return not (e != prev and ((ch == c and i > p) or (ch == c + 1 and i <= p)))


@njit(cache=True, nogil=True, inline="always")
def _coo_bits(ent, cmask, sparse_row):
    """Pass 5 of encode_row: the row's COO stream into ``sparse_row`` (returns its length), one loop iteration
    per set bit of each chunk's outlier mask ``cmask``; ``ent``: every value's entry byte (see encode_row)."""
    nb = 0
    c, p, prev = 0, -1, 0
    for ch in range(cmask.shape[0]):
        m = cmask[ch]
        if m == np.uint64(0):
            continue
        base = ch * CHUNK_SIZE
        i = np.int64(trailing_zeros(m))
        if _needs_escape(ch, i, np.int64(ent[base + i]), c, p, prev):
            nb = _write_escape(sparse_row, nb, prev, ch - c)
        while m != np.uint64(0):
            i = np.int64(trailing_zeros(m))
            m &= m - np.uint64(1)
            sparse_row[nb] = ent[base + i]
            nb += 1
        c, p, prev = ch, i, np.int64(ent[base + i])
    return nb


@njit(cache=True, nogil=True, inline="always")
def _coo_compress(ent, cmask, sparse_row):
    """_coo_bits with one ``vpcompressb`` per chunk (64 values) instead of a loop iteration per outlier: the
    chunk's 64 entry bytes, packed by its outlier mask, stored whole (only where HW_COMPRESS). Near the end of
    ``sparse_row`` (less than 64 bytes left) it falls back to the loop."""
    cap = sparse_row.shape[0]
    nb = 0
    c, p, prev = 0, -1, 0
    for ch in range(cmask.shape[0]):
        m = cmask[ch]
        if m == np.uint64(0):
            continue
        base = ch * CHUNK_SIZE
        i = np.int64(trailing_zeros(m))
        if _needs_escape(ch, i, np.int64(ent[base + i]), c, p, prev):
            nb = _write_escape(sparse_row, nb, prev, ch - c)
        if nb + CHUNK_SIZE <= cap:
            compress_chunk(ent, base, m, sparse_row, nb)
            nb += popcount64(m)
        else:
            while m != np.uint64(0):
                j = np.int64(trailing_zeros(m))
                m &= m - np.uint64(1)
                sparse_row[nb] = ent[base + j]
                nb += 1
        i = 63 - np.int64(leading_zeros(cmask[ch]))
        c, p, prev = ch, i, np.int64(ent[base + i])
    return nb


_emit_coo = _coo_compress if HW_COMPRESS else _coo_bits


@njit(cache=True, nogil=True, inline="always", error_model="numpy")
def encode_row(
    x, thr, middle_bits, inner_bits, outer_bits, fp16, dense_row, scales_row, sparse_row, scratch, h16, k16, static,
    levels,
):  # fmt: skip
    """Quantize and pack one row.

    Args:
        x: float32 ``[D]``, or fp16 bit patterns (uint16 ``[D]``, each value widened exactly where it is read);
            thr: float32 ``[4]`` ``(to_lo, ti_lo, ti_hi, to_hi)``; fp16: store scales as fp16.
        middle_bits, inner_bits, outer_bits: the groups' code bits (the slot width; it or one more).
        dense_row: uint8 ``[dense_bytes(D, middle_bits)]`` (out); scales_row: float32 ``[7]`` (out; the six scales
        already rounded to the scale dtype, then with static levels the row's level index); sparse_row: uint8
        scratch of at least ``sparse_capacity(D)`` bytes (out).
        scratch: :func:`comb_scratch` of ``D`` (made once per block, not per row).
        h16: int16 ``[D]``, the fp16 bit patterns ``x`` was widened from (the statistics then run on 16-bit
            keys, compared with ``k16 = threshold_keys16`` of the grouping thresholds), or empty (``k16`` unused).
        static: float32 ``[4]``, the layer's static grid ``(mid_min, mid_max, inner_min, inner_max)`` already in
            the scale dtype (static grids: the middle and inner groups use it, values beyond it take its end
            codes), or empty (per-row grids); with static levels float32 ``[4 L]``, the ``L`` levels' grids (level
            ``j``'s at ``4 j``).
        levels: float32 ``[L]``, the static levels' clip factors (``OakenConfig.static_levels``; the row takes the
            first covering its middle values, as ``quant.quantizer.pick_levels``), or empty (no static levels).

    ``thr`` may hold 8 values: the shift thresholds (what the decoder adds back), then the thresholds the values
    are grouped by, each on or beyond its shift threshold (``oakenkv.quant.adapt``); 4 values group and shift alike.

    Returns:
        The number of sparse bytes written (>= 0), or ``-ERR_*``.
    """
    d = x.shape[0]
    comb, words, halves, bmask, cmask, ent, ents = scratch[0], scratch[1], scratch[2], scratch[3], scratch[4], \
        scratch[5], scratch[6]  # fmt: skip
    wide = _scratch_wide(scratch)  # a constant: the narrow slots' code runs as it did before wide ones existed
    grp, gwords = _group_arrays(scratch)  # comb and words themselves for narrow slots
    to_lo, ti_lo, ti_hi, to_hi = thr[0], thr[1], thr[2], thr[3]
    go_lo, gi_lo, gi_hi, go_hi = to_lo, ti_lo, ti_hi, to_hi
    if thr.shape[0] >= 8:
        go_lo, gi_lo, gi_hi, go_hi = thr[4], thr[5], thr[6], thr[7]
    zero = _F32(0.0)
    # pass 1: extremes as order-preserving int32 keys -> float32 statistics of the shifted values
    if h16.shape[0] == d:
        bad, k0, k1, k2, k3, k4, k5 = _row_key_stats16(h16, k16)
    else:
        bad, k0, k1, k2, k3, k4, k5 = _row_key_stats(
            x,
            _key(np.float32(go_lo).view(np.int32)),
            _key(np.float32(gi_lo).view(np.int32)),
            _key(np.float32(gi_hi).view(np.int32)),
            _key(np.float32(go_hi).view(np.int32)),
        )
    if bad:
        return -ERR_NONFINITE
    vmax, vmin, v_le_tohi, v_ge_tolo = _key_value(k0), _key_value(k1), _key_value(k2), _key_value(k3)
    v_ge_tilo, v_le_tihi = _key_value(k4), _key_value(k5)
    # outer: largest magnitudes from the row's extremes (v - c is monotonic in v, so max(v) - c = max(v - c))
    o_has_hi = vmax > go_hi
    o_has_lo = vmin < go_lo
    o_hi = vmax - to_hi if o_has_hi else zero
    o_lo = to_lo - vmin if o_has_lo else zero
    # middle: extremes among the values inside the outer thresholds
    m_has_hi = k2 != _KMIN and v_le_tohi > gi_hi
    m_has_lo = k3 != _KMAX and v_ge_tolo < gi_lo
    m_hi = v_le_tohi - ti_hi if m_has_hi else zero
    m_lo = ti_lo - v_ge_tolo if m_has_lo else zero
    # a one-sided group also needs its value nearest zero (plain grid): a second, rare pass
    o_hi_min = _min_above(x, go_hi, _INF32, to_hi) if o_has_hi and not o_has_lo else _INF32
    o_lo_min = _min_below(x, -_INF32, go_lo, to_lo) if o_has_lo and not o_has_hi else _INF32
    fixed = static.shape[0] >= 4  # static grids: the middle and inner grids are the layer's, not the row's
    m_hi_min = _min_above(x, gi_hi, go_hi, ti_hi) if m_has_hi and not m_has_lo and not fixed else _INF32
    m_lo_min = _min_below(x, go_lo, gi_lo, ti_lo) if m_has_lo and not m_has_hi and not fixed else _INF32
    n_mid, n_in, n_out = 1 << middle_bits, 1 << inner_bits, 1 << outer_bits
    mg0, mg1 = _signed_grid(m_lo, m_lo_min, m_has_lo, m_hi, m_hi_min, m_has_hi, n_mid, fp16)
    og0, og1 = _signed_grid(o_lo, o_lo_min, o_has_lo, o_hi, o_hi_min, o_has_hi, n_out, fp16)
    # inner: min of the values >= gi_lo is the inner minimum if it is <= gi_hi (else the group is empty)
    i_has = k4 != _KMAX and v_ge_tilo <= gi_hi
    i_min = v_ge_tilo if i_has else zero
    i_max = v_le_tihi if i_has else zero
    if fixed:  # (values of the scale dtype: _store_scale keeps them as they are)
        at = 0
        n_levels = levels.shape[0]
        if n_levels:  # static levels: the first whose clip factor covers the row's middle values (pick_levels)
            need_lo = m_lo / (ti_lo - to_lo)
            need_hi = m_hi / (to_hi - ti_hi)
            # torch.maximum's: a NaN (inf / inf of thresholds beyond the float32 range) wins, and takes the last level
            need = need_lo if need_lo >= need_hi or need_lo != need_lo else need_hi
            lv = 0
            while lv < n_levels - 1 and not levels[lv] >= need:
                lv += 1
            scales_row[NUM_SCALES] = _F32(lv)
            at = 4 * lv
        mg0, mg1, i_min, i_max = static[at], static[at + 1], static[at + 2], static[at + 3]
    mg0, ok0 = _store_scale(mg0, fp16)
    mg1, ok1 = _store_scale(mg1, fp16)
    ig0, ok2 = _store_scale(i_min, fp16)
    ig1, ok3 = _store_scale(i_max, fp16)
    og0, ok4 = _store_scale(og0, fp16)
    og1, ok5 = _store_scale(og1, fp16)
    if not (ok0 and ok1 and ok2 and ok3 and ok4 and ok5):
        return -ERR_SCALE_OVERFLOW
    scales_row[0], scales_row[1] = mg0, mg1
    scales_row[2], scales_row[3] = ig0, ig1
    scales_row[4], scales_row[5] = og0, og1
    m_step = (mg1 - mg0) / _F32(n_mid - 1)
    i_step = (ig1 - ig0) / _F32(n_in - 1)
    o_step = (og1 - og0) / _F32(n_out - 1)
    # never write a row the decoder refuses: infinite fp32 scales (a range beyond float32), or values that the
    # threshold shift takes beyond it
    if not steps_decode_finite(mg0, m_step, ig0, i_step, og0, o_step, thr, n_mid, n_in, n_out):
        return -ERR_SCALE_RANGE
    # pass 2: codes and groups
    _row_codes(
        x, comb, grp, wide, go_lo, gi_lo, gi_hi, go_hi, to_lo, ti_lo, ti_hi, to_hi, mg0, m_step, ig0, i_step, og0,
        o_step, n_mid, n_in, n_out,
    )  # fmt: skip
    # pass 3: the dense slots
    if middle_bits == 4:  # nibbles from 16-bit pairs of codes (value 2j low, 2j+1 high): vectorizes
        half = d >> 1
        for j in range(half):
            w = halves[j]
            dense_row[j] = np.uint8((w & np.uint16(0xF)) | ((w >> np.uint16(4)) & np.uint16(0xF0)))
        if d & 1:
            dense_row[half] = np.uint8(comb[d - 1] & 0xF)
    else:
        _pack_slots(words, d, middle_bits, dense_row)
    # bit 7 of each byte of a word shifted left by 7 - b is the byte's code bit b (the top bit of a b + 1-bit code)
    top_shift = np.uint64(7 - middle_bits)
    # pass 4: one bit per value, set for an outlier (a byte >= 32: it has a group bit). Per 8 bytes: adding 0x60
    # to each byte (<= 95, no carry) sets its bit 7 iff it is >= 32, and the multiplication gathers the 8 bits into
    # the top byte. Vectorizes; the byte masks of 8 consecutive words are one chunk's 64-bit mask (little-endian).
    # comb's tail beyond D is zero (middle, code 0). Also each value's COO entry, were it an outlier: its index in
    # the chunk, the group bit (bit 6 of its byte: outer), the top code bit (bit b, moved to bit 7). Wide slots
    # read the group bits from their own bytes (grp: 32 x group, the same bits), the code bit from comb.
    for w in range(words.shape[0]):
        cw = words[w]
        gw = gwords[w] if wide else cw
        g = ((gw + np.uint64(0x6060606060606060)) & np.uint64(0x8080808080808080)) >> np.uint64(7)
        bmask[w] = np.uint8((g * np.uint64(0x0102040810204080)) >> np.uint64(56))
        lanes = _LANES + np.uint64(w & 7) * _LANE_STEP
        ents[w] = lanes | (gw & _GROUP_BITS) | ((cw << top_shift) & _TOP_BITS)
    # pass 5: the COO stream
    return _emit_coo(ent, cmask, sparse_row)


@njit(cache=True, nogil=True, inline="always")
def _pack_slots(words, d, mb, dense_row):
    """Pass 3 of encode_row for slots of ``mb`` bits other than 4: the low ``mb`` bits of each code byte (8 per
    uint64 word of ``comb``) into the row's little-endian bit stream, ``mb`` bytes per word; the last word writes
    only the bytes the row has. comb's tail beyond D is zero, so the padding bits are 0."""
    nbytes = dense_row.shape[0]
    mask = np.uint64((1 << mb) - 1)
    for w in range((d + 7) >> 3):
        cw = words[w]
        acc = np.uint64(0)
        for k in range(8):
            acc |= ((cw >> np.uint64(8 * k)) & mask) << np.uint64(mb * k)
        base = w * mb
        for i in range(min(mb, nbytes - base)):
            dense_row[base + i] = np.uint8((acc >> np.uint64(8 * i)) & np.uint64(0xFF))


@njit(cache=True, nogil=True)
def comb_scratch(d):
    """Scratch of encode_row for rows of ``d`` values in slots of up to 4 bits: ``comb`` (uint8 code + 32 * group
    per value, whole chunks with a zero tail) with its uint64 and uint16 views, ``bmask`` (uint8, one outlier bit per
    value of each 8-byte word) with its uint64 view ``cmask`` (one 64-bit mask per chunk), and ``ent`` (uint8, each
    value's COO entry byte) with its uint64 view."""
    nch = (d + CHUNK_SIZE - 1) // CHUNK_SIZE
    comb = np.zeros(nch * CHUNK_SIZE, np.uint8)
    bmask = np.zeros(nch * 8, np.uint8)
    ent = np.zeros(nch * CHUNK_SIZE, np.uint8)
    return comb, comb.view(np.uint64), comb.view(np.uint16), bmask, bmask.view(np.uint64), ent, ent.view(np.uint64)


@njit(cache=True, nogil=True)
def wide_scratch(d):
    """Scratch of encode_row for slots of 5 bits or more, whose outliers' codes (up to 8 bits) leave no room for
    the group in their byte: :func:`comb_scratch` (``comb`` then holds the codes alone) and ``grp`` (uint8, 32 *
    group per value, zero tail) with its uint64 view. Its nine arrays make encode_row's ``wide`` constant true."""
    comb, words, halves, bmask, cmask, ent, ents = comb_scratch(d)
    grp = np.zeros(comb.shape[0], np.uint8)
    return comb, words, halves, bmask, cmask, ent, ents, grp, grp.view(np.uint64)


def _scratch_wide(scratch):  # pragma: no cover - only its overload runs, inside @njit code
    """Whether ``scratch`` is a :func:`wide_scratch` (a constant of the compiled specialisation)."""
    raise NotImplementedError


@overload(_scratch_wide)
def _scratch_wide_impl(scratch):
    wide = isinstance(scratch, types.BaseTuple) and len(scratch) == 9
    return lambda scratch: wide


def _group_arrays(scratch):  # pragma: no cover - only its overload runs, inside @njit code
    """``(grp, gwords)`` of a :func:`wide_scratch`; ``comb`` and its uint64 view for a :func:`comb_scratch`."""
    raise NotImplementedError


@overload(_group_arrays)
def _group_arrays_impl(scratch):
    if isinstance(scratch, types.BaseTuple) and len(scratch) == 9:
        return lambda scratch: (scratch[7], scratch[8])
    return lambda scratch: (scratch[0], scratch[1])


def _borrowed(scratch):  # pragma: no cover - only its overload runs, inside @njit code
    """Borrowed views (``all_view``) of every array of a scratch tuple."""
    raise NotImplementedError


@overload(_borrowed)
def _borrowed_impl(scratch):
    if isinstance(scratch, types.BaseTuple) and len(scratch) == 9:
        return lambda scratch: (
            all_view(scratch[0]), all_view(scratch[1]), all_view(scratch[2]), all_view(scratch[3]),
            all_view(scratch[4]), all_view(scratch[5]), all_view(scratch[6]), all_view(scratch[7]),
            all_view(scratch[8]),
        )  # fmt: skip
    return lambda scratch: (
        all_view(scratch[0]), all_view(scratch[1]), all_view(scratch[2]), all_view(scratch[3]), all_view(scratch[4]),
        all_view(scratch[5]), all_view(scratch[6]),
    )  # fmt: skip


@njit(cache=True, nogil=True, error_model="numpy")
def encode_records(
    x, thr, inner_bits, outer_bits, fp16, scale_bytes, records, sparse, counts, middle_bits=4, static=None,
    levels=None,
):  # fmt: skip
    """Quantize and pack rows straight into page records, on the calling thread (the decode step's path).

    Args:
        x: float32 ``[n, D]``; thr: float32 ``[n, 4]``, each row's thresholds (a step mixes keys and values).
        inner_bits, outer_bits, middle_bits: the groups' code bits (``middle_bits``, the slot width, last: it came
            after the others, and the paper's 4 is its default).
        fp16, scale_bytes: the scales' dtype (fp16, else fp32) and the bytes they take in a record
            (``oakenkv.format.layout.scale_bytes``).
        records: uint8 ``[n, record_size]`` (out): the page-record layout of ``oakenkv.format.layout`` (the stored
            scales, six or with static grids the outer two, as little-endian values of 2 (fp16) or 4 bytes, then the
            slots): ``format.to_records`` of the same rows.
        sparse: uint8 ``[n, >= sparse_capacity(D)]`` (out): row ``r`` starts with its sparse record.
        counts: int64 ``[n]`` (out): sparse bytes of each row, or ``-ERR_*``.
        static: float32 ``[n, 4]``, each row's static grid (static grids; ``scale_bytes`` then holds two scales), or
            None / omitted (per-row grids); with static levels ``[n, 4 L]``, each row's levels' grids.
        levels: float32 ``[L]``, the static levels' clip factors (``scale_bytes`` then holds two scales and the
            level byte, which the encoder writes), or None / omitted.
    """
    d = x.shape[1]
    static = _static_rows(static, x.shape[0])
    levels = _levels_arg(levels)
    # the row loop compiled once per scratch kind (narrow slots: as before wide ones existed)
    if middle_bits <= _NARROW_MAX:
        _encode_records_of(x, thr, inner_bits, outer_bits, fp16, scale_bytes, records, sparse, counts, middle_bits,
                           comb_scratch(d), static, levels)  # fmt: skip
    else:
        _encode_records_of(x, thr, inner_bits, outer_bits, fp16, scale_bytes, records, sparse, counts, middle_bits,
                           wide_scratch(d), static, levels)  # fmt: skip


@njit(cache=True, nogil=True, error_model="numpy")
def _encode_records_of(
    x, thr, inner_bits, outer_bits, fp16, scale_bytes, records, sparse, counts, middle_bits, scr, static, levels
):
    """:func:`encode_records` with encode_row's scratch ``scr`` (:func:`comb_scratch` or :func:`wide_scratch`)."""
    n = x.shape[0]
    # the scales not stored: none, or the static grid's four (static grids, with or without levels)
    first = STATIC_COLUMNS if static.shape[1] >= STATIC_COLUMNS else 0
    itemsize = _F16_ITEMSIZE if fp16 else _F32_ITEMSIZE
    level_at = itemsize * (NUM_SCALES - first)  # static levels: the level byte after the stored scales
    no_h16 = np.empty(0, np.int16)
    sc = np.empty(NUM_SCALES + 1, np.float32)
    for r in range(n):
        cnt = encode_row(
            x[r], thr[r], middle_bits, inner_bits, outer_bits, fp16, records[r, scale_bytes:], sc, sparse[r], scr,
            no_h16, no_h16, static[r], levels,
        )  # fmt: skip
        counts[r] = cnt
        if cnt < 0:
            continue
        if levels.shape[0]:
            records[r, level_at] = np.uint8(sc[NUM_SCALES])
        for i in range(first, NUM_SCALES):
            bits = np.int64(f32_to_f16_bits(sc[i])) if fp16 else np.int64(np.float32(sc[i]).view(np.uint32))
            for k in range(itemsize):
                records[r, itemsize * (i - first) + k] = np.uint8((bits >> (8 * k)) & 0xFF)


@njit(cache=True, nogil=True, error_model="numpy")
def widen_bf16_row(h, out):
    """bf16 bit patterns (uint16 ``[D]``) -> exact float32 ``out [D]`` (bf16 is the top half of a float32)."""
    for j in range(h.shape[0]):
        out[j] = np.int32(np.int32(h[j]) << np.int32(16)).view(np.float32)


#: Input kinds of _encode_rows.
_KIND_F32, _KIND_F16, _KIND_BF16 = 0, 1, 2


@njit(cache=True, nogil=True, error_model="numpy")
def _encode_block(
    xs, hs, r0, r1, rows, thr, middle_bits, inner_bits, outer_bits, fp16, dense, scales, scratch, cap, starts, counts,
    k16, static, levels, level,
):  # fmt: skip
    """Rows ``r0:r1`` of _encode_rows, read from rows ``r0 - rows:r1 - rows`` of ``xs`` (float32, or fp16 bits
    with their int16 view ``hs``; ``hs`` has no columns for float32). encode_row is inlined here (as are its
    helpers that take arrays): a numba call costs time per array argument and encode_row takes fourteen;
    inlining into the parallel _encode_rows instead compiles much slower (docs/notebook/perf-notes.md)."""
    d = xs.shape[1]
    if middle_bits <= _NARROW_MAX:  # compiled once per scratch kind (narrow slots: as before wide ones existed)
        _encode_block_of(
            xs, hs, r0, r1, rows, thr, middle_bits, inner_bits, outer_bits, fp16, dense, scales, scratch, cap, starts,
            counts, k16, comb_scratch(d), static, levels, level,
        )  # fmt: skip
    else:
        _encode_block_of(
            xs, hs, r0, r1, rows, thr, middle_bits, inner_bits, outer_bits, fp16, dense, scales, scratch, cap, starts,
            counts, k16, wide_scratch(d), static, levels, level,
        )  # fmt: skip


@njit(cache=True, nogil=True, error_model="numpy")
def _encode_block_of(
    xs, hs, r0, r1, rows, thr, middle_bits, inner_bits, outer_bits, fp16, dense, scales, scratch, cap, starts, counts,
    k16, scr, static, levels, level,
):  # fmt: skip
    """:func:`_encode_block` with the block's encode_row scratch ``scr`` (:func:`comb_scratch` or
    :func:`wide_scratch`). ``level`` (uint8 ``[N]``, out): each row's static level, with static levels."""
    sc = np.empty(NUM_SCALES + 1, np.float32)
    has_levels = levels.shape[0] != 0
    # borrowed views of the block's scratch (and the shared arrays) for the rows (no reference counting)
    scr_b = _borrowed(scr)
    sc_b, thr_b, k16_b, st_b, lv_b = all_view(sc), all_view(thr), all_view(k16), all_view(static), all_view(levels)
    cursor = r0 * cap
    for r in range(r0, r1):
        # borrowed views (the arrays outlive the loop; cursor + cap <= len(scratch))
        sp, dense_r = span_view(scratch, cursor, cursor + cap), row_view(dense, r)
        x_r, h_r = row_view(xs, r - rows), row_view(hs, r - rows)
        cnt = encode_row(
            x_r, thr_b, middle_bits, inner_bits, outer_bits, fp16, dense_r, sc_b, sp, scr_b, h_r, k16_b, st_b, lv_b
        )
        for i in range(NUM_SCALES):
            scales[r, i] = out_elem(sc_b[i], scales)  # exact: sc is already rounded to the scale dtype
        if has_levels and cnt >= 0:
            level[r] = np.uint8(sc_b[NUM_SCALES])
        counts[r] = cnt
        starts[r] = cursor
        cursor += max(cnt, 0)
    keep_alive(scr, sc)  # the borrowed views' arrays stay alive until here


@njit(cache=True, nogil=True, parallel=True)
def _encode_rows(
    x32, xbits, kind, thr, middle_bits, inner_bits, outer_bits, fp16, dense, scales, scratch, starts, counts, static,
    levels, level,
):  # fmt: skip
    """Encode ``N`` rows of ``D`` values: float32 ``x32 [N, D]`` (``kind`` 0) or fp16 (1) / bf16 (2) bit patterns
    ``xbits`` (uint16 ``[N, D]``; fp16 is read in place, bf16 widened exactly per block); the other input is
    unused (pass any ``[N, 0]``). ``static``: float32 ``[4]``, the layer's static grid, or empty (per-row grids);
    with static levels ``[4 L]``, the levels' grids, ``levels`` float32 ``[L]`` their clip factors (else empty) and
    ``level`` uint8 ``[N]`` (out) each row's level.
    ``scales`` (out, ``[N, 6]``): float32, or uint16 fp16 bit patterns when the scale dtype is fp16.

    Each block of rows writes its sparse bytes back to back in its own part of ``scratch`` (uint8
    ``[N * sparse_capacity(D)]``): row ``r``'s are at ``starts[r]`` (``counts[r]`` bytes, or ``-ERR_*``).
    """
    n = dense.shape[0]
    d = x32.shape[1] if kind == _KIND_F32 else xbits.shape[1]
    cap = scratch.shape[0] // max(n, 1)
    nblocks = (n + _BLOCK_ROWS - 1) // _BLOCK_ROWS
    k16 = threshold_keys16(thr[4:8] if thr.shape[0] >= 8 else thr)  # of the grouping thresholds
    x16 = xbits.view(np.int16)
    no_h16 = np.empty((n, 0), np.int16)
    for b in prange(nblocks):
        r0, r1 = b * _BLOCK_ROWS, min(n, (b + 1) * _BLOCK_ROWS)
        if kind == _KIND_F16:  # read in place, each value widened where it is used
            _encode_block(
                xbits, x16, r0, r1, 0, thr, middle_bits, inner_bits, outer_bits, fp16, dense, scales, scratch, cap,
                starts, counts, k16, static, levels, level,
            )  # fmt: skip
        else:  # float32 rows; bf16 blocks are widened exactly to float32 first
            xs, rows = x32, 0
            if kind == _KIND_BF16:
                xs, rows = np.empty((r1 - r0, d), np.float32), r0
                for r in range(r0, r1):
                    widen_bf16_row(xbits[r], xs[r - r0])
            _encode_block(
                xs, no_h16, r0, r1, rows, thr, middle_bits, inner_bits, outer_bits, fp16, dense, scales, scratch, cap,
                starts, counts, k16, static, levels, level,
            )  # fmt: skip


@njit(cache=True, nogil=True, parallel=True)
def _gather_sparse(scratch, starts, offsets, sparse):
    """Copy each block's sparse bytes (its rows back to back from ``starts`` of its first row) to ``sparse``."""
    n = starts.shape[0]
    for b in prange((n + _BLOCK_ROWS - 1) // _BLOCK_ROWS):
        r0, r1 = b * _BLOCK_ROWS, min(n, (b + 1) * _BLOCK_ROWS)
        o0, o1 = offsets[r0], offsets[r1]
        sparse[o0:o1] = scratch[starts[r0] : starts[r0] + o1 - o0]


def _thr_array(thr: ThresholdsLike) -> np.ndarray:
    return np.asarray(thresholds_tuple(thr), dtype=np.float32)


_NO_STATIC = np.empty(0, np.float32)


def static_grid_array(thr: np.ndarray | ThresholdsLike, config: OakenConfig) -> np.ndarray:
    """The kernels' ``static`` argument for thresholds ``thr`` (the shift thresholds: the first 4 of an encoder's
    ``[8]``): float32 ``[4]``, the static grid (:func:`oakenkv.quant.quantizer.format_static_grid`), for a
    static-grid config; with static levels float32 ``[4 L]``, the levels' grids (level ``j``'s at ``4 j``,
    :func:`oakenkv.quant.quantizer.format_level_grids`); empty for per-row grids. ValueError for a grid beyond the
    fp16 range."""
    if not config.static_grids:
        return _NO_STATIC
    t = thr[:4] if isinstance(thr, np.ndarray) else thr
    if config.static_levels:
        return np.asarray(format_level_grids(t, config), dtype=np.float32).reshape(-1)
    return np.asarray(format_static_grid(t, config), dtype=np.float32)


def levels_array(config: OakenConfig) -> np.ndarray:
    """The encoders' ``levels`` argument: float32 ``[L]``, the static levels' clip factors
    (``OakenConfig.static_levels``, rounded to float32 as ``quant.quantizer.pick_levels`` compares them), or empty."""
    return np.asarray(config.static_levels, dtype=np.float32)


def check_static_columns(enc: EncodedBatch, thr: ThresholdsLike, config: OakenConfig) -> None:
    """For a static-grid config: raise :class:`CorruptDataError` unless every row's middle and inner scale columns
    are the static grid of ``thr`` (with static levels the grid of the row's level, ``enc.level``, whose indices
    :func:`check_encoded` has checked) (what a stored row does not hold, and a reader restores); nothing
    otherwise."""
    if not config.static_grids or enc.num_rows == 0:
        return
    grid = static_grid_array(_thr_array(thr), config)
    if config.static_levels:
        grid = grid.reshape(-1, STATIC_COLUMNS)[enc.level.numpy()]
    cols = enc.scales[:, :STATIC_COLUMNS].to(torch.float32).numpy()
    bad = np.flatnonzero(~(cols == grid).all(axis=1))
    if bad.size:
        raise CorruptDataError(f"row {int(bad[0])}: its middle or inner scales are not the layer's static grid")


@njit(cache=True, nogil=True)
def _sparse_offsets(counts, offsets):
    """``offsets[1:]`` = the running sum of ``counts`` (``offsets[0]`` = 0); returns the first row whose count is
    negative (an ``-ERR_*`` status), or -1."""
    offsets[0] = 0
    for r in range(counts.shape[0]):
        if counts[r] < 0:
            return r
        offsets[r + 1] = offsets[r] + counts[r]
    return -1


@njit(cache=True, nogil=True)
def first_error(status):
    """The first row whose ``status`` is not ERR_OK, or -1."""
    for r in range(status.shape[0]):
        if status[r] != ERR_OK:
            return r
    return -1


def encode_batch(
    x: torch.Tensor, thr: ThresholdsLike, config: OakenConfig, group: ThresholdsLike | None = None
) -> EncodedBatch:
    """Quantize and pack rows ``x`` (float ``[N, D]``: fp32, fp16 or bf16). Same bytes as ``pack(quantize(x))``
    (with ``group``: ``quantize(x, thr, config, group)``, grouping thresholds apart from the shift ones)."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"encode expects a floating-point torch.Tensor, got {getattr(x, 'dtype', type(x))}")
    if x.dim() != 2:
        raise ValueError(f"encode expects x of shape [N, D] (one row per vector), got {tuple(x.shape)}")
    d = x.shape[1]
    if not 1 <= d <= MAX_DIM:
        raise ValueError(f"row width D must be in [1, {MAX_DIM}], got {d}")
    thr_a = np.asarray(grouping_tuple(thr, group), dtype=np.float32)
    x = x.detach()
    if x.dtype in (torch.float16, torch.bfloat16):
        kind = _KIND_BF16 if x.dtype == torch.bfloat16 else _KIND_F16
        xbits = x.contiguous().view(torch.int16).numpy().view(np.uint16)
        return _encode(np.empty((xbits.shape[0], 0), np.float32), xbits, kind, thr_a, config)
    x32 = x.to(torch.float32).contiguous().numpy()
    return _encode(x32, np.empty((x32.shape[0], 0), np.uint16), _KIND_F32, thr_a, config)


def encode_trusted(x32: np.ndarray, thr: np.ndarray, config: OakenConfig) -> EncodedBatch:
    """:func:`encode_batch` of float32 rows the caller has checked: the paged store's path (``oakenkv.store.paged``),
    without the argument checks and conversions that cost more than encoding a short prefill's rows.

    Args:
        x32: C-contiguous float32 ``[N, D]``, ``1 <= D <= MAX_DIM`` (non-finite values still raise).
        thr: C-contiguous float32 ``[4]``, thresholds validated as :func:`oakenkv.quant.quantizer.thresholds_tuple` does
            (``PagedKVStore.thr``), or ``[8]``: shift thresholds, then grouping ones
            (:func:`oakenkv.quant.quantizer.grouping_tuple`).
    """
    return _encode(x32, np.empty((x32.shape[0], 0), np.uint16), _KIND_F32, thr, config)


def _encode(x32: np.ndarray, xbits: np.ndarray, kind: int, thr_a: np.ndarray, config: OakenConfig) -> EncodedBatch:
    n, d = x32.shape if kind == _KIND_F32 else xbits.shape
    fp16 = config.scale_dtype == "float16"
    dense = np.empty((n, dense_bytes(d, config.middle_bits)), np.uint8)
    scales = np.empty((n, NUM_SCALES), np.uint16 if fp16 else np.float32)
    # Each block of rows packs its sparse bytes back to back in its part of one scratch buffer, so only the
    # bytes really written are touched (fresh pages cost a fault each; docs/notebook/perf-notes.md).
    scratch = np.empty(n * sparse_capacity(d), np.uint8)
    starts = np.empty(n, np.int64)
    counts = np.empty(n, np.int64)
    static = static_grid_array(thr_a, config)
    levels = levels_array(config)
    level = np.empty(n if config.static_levels else 0, np.uint8)
    _encode_rows(
        x32, xbits, kind, thr_a, config.middle_bits, config.inner_bits, config.outer_bits, fp16, dense, scales,
        scratch, starts, counts, static, levels, level,
    )  # fmt: skip
    offsets = np.empty(n + 1, np.int64)
    r = _sparse_offsets(counts, offsets)
    if r >= 0:
        raise ValueError(f"cannot encode row {r}: {ERROR_MESSAGES[int(-counts[r])]}")
    sparse = np.empty(int(offsets[-1]), np.uint8)
    _gather_sparse(scratch, starts, offsets, sparse)
    return EncodedBatch(
        dense=torch.from_numpy(dense),
        scales=torch.from_numpy(scales.view(np.int16)).view(torch.float16) if fp16 else torch.from_numpy(scales),
        sparse=torch.from_numpy(sparse),
        sparse_offsets=torch.from_numpy(offsets),
        dim=int(d),
        stored_scales=stored_scales(config),
        level=torch.from_numpy(level) if config.static_levels else None,
    )


# --------------------------------------------------------------------------------------------------------------
# Decode: one row
# --------------------------------------------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def fill_lut(scales_row, thr, inner_bits, outer_bits, lut, middle_bits=4):
    """The dequantized value of every code of the row's three groups (float32, exactly quant.dequantize).

    ``lut``: float32 ``[LUT_SIZE]``: for ``b = middle_bits``, middle codes at ``0..2^b - 1``, inner at ``2^b..``,
    outer at ``3 * 2^b..`` (the paper's 4 bits: 0..15, 16.., 48..). Returns ``ERR_OK``, or ``ERR_SHAPE`` (nothing
    written) when an array is too short or the groups' bits are not a format the kernels read (:func:`bits_valid`).
    """
    if (
        lut.shape[0] < LUT_SIZE
        or scales_row.shape[0] < NUM_SCALES
        or thr.shape[0] < 4
        or not bits_valid(middle_bits, inner_bits, outer_bits)
    ):
        return ERR_SHAPE
    to_lo, ti_lo, ti_hi, to_hi = thr[0], thr[1], thr[2], thr[3]
    n_mid = 1 << middle_bits
    lo = scales_row[0]
    step = (scales_row[1] - lo) / _F32(n_mid - 1)
    for c in range(n_mid):
        v = lo + _F32(c) * step
        lut[c] = v + (ti_hi if v > _F32(0.0) else ti_lo)
    n_in = 1 << inner_bits
    lo = scales_row[2]
    step = (scales_row[3] - lo) / _F32(n_in - 1)
    for c in range(n_in):
        lut[n_mid + c] = lo + _F32(c) * step
    n_out = 1 << outer_bits
    lo = scales_row[4]
    step = (scales_row[5] - lo) / _F32(n_out - 1)
    for c in range(n_out):
        v = lo + _F32(c) * step
        lut[3 * n_mid + c] = v + (to_hi if v > _F32(0.0) else to_lo)
    return ERR_OK


@njit(cache=True, nogil=True, error_model="numpy", inline="always")
def _walk_outliers(dense_row, sparse_row, d, middle_bits, inner_bits, outer_bits, lut, grid, out):
    """:func:`_walk` compiled once per slot width (``_walk_outliers4`` / ``3`` / ``2``, in each of which
    ``middle_bits`` is a constant: the paper's 4-bit slots run the nibble arithmetic they ran before slot widths were
    a parameter; a runtime width had cost their decode ~25%). Inlined: where the caller's width is a constant too,
    only one call remains."""
    if middle_bits == 4:
        return _walk_outliers4(dense_row, sparse_row, d, inner_bits, outer_bits, lut, grid, out)
    if middle_bits == 3:
        return _walk_outliers3(dense_row, sparse_row, d, inner_bits, outer_bits, lut, grid, out)
    if middle_bits == 2:
        return _walk_outliers2(dense_row, sparse_row, d, inner_bits, outer_bits, lut, grid, out)
    return _walk_outliers_wide(dense_row, sparse_row, d, middle_bits, inner_bits, outer_bits, lut, grid, out)


@njit(cache=True, nogil=True, error_model="numpy")
def _walk_outliers4(dense_row, sparse_row, d, inner_bits, outer_bits, lut, grid, out):
    return _walk(dense_row, sparse_row, d, 4, inner_bits, outer_bits, lut, grid, out)


@njit(cache=True, nogil=True, error_model="numpy")
def _walk_outliers3(dense_row, sparse_row, d, inner_bits, outer_bits, lut, grid, out):
    return _walk(dense_row, sparse_row, d, 3, inner_bits, outer_bits, lut, grid, out)


@njit(cache=True, nogil=True, error_model="numpy")
def _walk_outliers2(dense_row, sparse_row, d, inner_bits, outer_bits, lut, grid, out):
    return _walk(dense_row, sparse_row, d, 2, inner_bits, outer_bits, lut, grid, out)


@njit(cache=True, nogil=True, error_model="numpy")
def _walk_outliers_wide(dense_row, sparse_row, d, middle_bits, inner_bits, outer_bits, lut, grid, out):
    """Slots of 5..7 bits: one copy for all, the width a runtime value (their speed is not the hot path's)."""
    return _walk(dense_row, sparse_row, d, middle_bits, inner_bits, outer_bits, lut, grid, out)


@njit(cache=True, nogil=True, error_model="numpy", inline="always")
def _walk(dense_row, sparse_row, d, middle_bits, inner_bits, outer_bits, lut, grid, out):
    """Walk one row's COO stream, validating every byte, and overwrite its outliers in ``out`` (float32 or fp16
    bits as uint16).

    An outlier's value comes from ``lut`` (``LUT_SIZE`` entries of ``out``'s type, see :func:`fill_lut`) or, if
    ``lut`` is empty, is computed from ``grid`` (float32 ``(inner_min, inner_step, outer_min, outer_step, to_lo,
    to_hi)``) with the same float32 operations as ``fill_lut``: cheaper than a whole table for the ~20 outliers
    of a narrow row, dearer for the ~400 of a 4096-value row.
    """
    ns = sparse_row.shape[0]
    direct = lut.shape[0] == 0
    i_lo, i_step, o_lo, o_step, to_lo, to_hi = grid[0], grid[1], grid[2], grid[3], grid[4], grid[5]
    zero = _F32(0.0)
    # Indices are cast to unsigned: they are >= 0 by construction and bounds-checked against ns / d, and numba
    # then skips its negative-index wrap-around checks (docs/notebook/perf-notes.md).
    # entry bits that must be 0 for each group: a group whose codes fit the slot has no top code bit
    f_in = np.int64(0x80 if inner_bits <= middle_bits else 0)
    f_out = np.int64(0x80 if outer_bits <= middle_bits else 0)
    nib = middle_bits == 4
    # lut index of an outlier: inner codes at 2^b.., outer at 3 * 2^b.. (the group bit, 0x40, shifted to 2^(b+1):
    # right for b < 5, left for b > 5; both shifts >= 0, one of them 0)
    lut_group_shift = np.int64(max(5 - middle_bits, 0))
    lut_group_lshift = np.int64(max(middle_bits - 5, 0))
    bad_bits = np.int64(0)
    c, p, prev = 0, -1, 0  # prev = -1 stands for "None" (after an escape)
    j = 0
    while j < ns:
        e = np.int64(sparse_row[np.uint64(j)])
        j += 1
        if e == prev:
            k = 0
            while True:
                if j >= ns:
                    return ERR_ESCAPE_TRUNCATED
                a = np.int64(sparse_row[np.uint64(j)])
                j += 1
                k += a
                if a != ADVANCE_CONTINUE:
                    break
            if k == 0 and p != -1:
                return ERR_ZERO_ADVANCE
            if j >= ns:
                return ERR_ESCAPE_NO_ENTRY
            c += k
            p = -1
            prev = -1
            continue
        i = e & COO_INDEX_MASK
        if i <= p:
            c += 1
        pos = c * CHUNK_SIZE + i
        if pos >= d:
            return ERR_POSITION_RANGE
        # a fifth code bit of a 4-bit group: remembered, not branched on (the code it gives is still in range)
        outer = (e & COO_GROUP_BIT) != 0
        bad_bits |= e & (f_out if outer else f_in)
        upos = np.uint64(pos)
        if nib:
            code = ((np.int64(dense_row[upos >> np.uint64(1)]) >> ((pos & 1) << 2)) & 0xF) | ((e >> 7) << 4)
        else:
            code = slot_at(dense_row, pos, middle_bits) | ((e >> 7) << middle_bits)
        if direct:
            # branch-free: the group of consecutive outliers is random, a branch on it would mispredict
            v = (o_lo if outer else i_lo) + _F32(code) * (o_step if outer else i_step)
            w = v + (to_hi if v > zero else to_lo)
            out[upos] = out_elem(w if outer else v, out)
        else:
            # lut index: inner codes at 2^b.., outer at 3 * 2^b.. (16.. and 48.. for 4-bit slots)
            gofs = ((e & COO_GROUP_BIT) >> lut_group_shift) << lut_group_lshift
            out[upos] = lut[(np.int64(1) << middle_bits) + gofs + code]
        p = i
        prev = e
    return ERR_FIFTH_BIT if bad_bits else ERR_OK


@njit(cache=True, nogil=True)
def _scatter_outliers(dense_row, sparse_row, d, middle_bits, inner_bits, outer_bits, lut, out):
    """Walk one row's COO stream and overwrite its outliers in ``out`` from ``lut`` (see _walk_outliers)."""
    return _walk_outliers(dense_row, sparse_row, d, middle_bits, inner_bits, outer_bits, lut, _NO_GRID, out)


@njit(cache=True, nogil=True)
def decode_row_into_lut(dense_row, sparse_row, scales_row, thr, out, inner_bits, outer_bits, lut, middle_bits=4):
    """Decode one row into ``out`` using caller-provided scratch ``lut`` (float32 ``[LUT_SIZE]``).

    Args:
        dense_row: uint8 ``[dense_bytes(D, middle_bits)]``; sparse_row: uint8 ``[S]`` (this row's COO stream
        only); scales_row: float32 ``[6]``; thr: float32 ``[4]`` ``(to_lo, ti_lo, ti_hi, to_hi)``; out: float32
        ``[D]``; inner_bits, outer_bits, middle_bits: the groups' code bits (:func:`bits_valid`).

    Every input is checked before it is used, so untrusted bytes never make it read or write out of bounds:
    ``ERR_SHAPE`` for arrays of other dtypes or sizes (``1 <= D <= MAX_DIM``) or bits the format does not have,
    ``ERR_THRESHOLDS`` for thresholds that are not finite and ordered, ``ERR_SCALE_NONFINITE`` for scales that
    do not decode to finite values, ``ERR_PADDING`` for non-zero padding bits, and the stream's codes.

    Returns:
        ``ERR_OK`` (0) or an ``ERR_*`` code; ``out`` is then partly written and must not be used.
    """
    if not (_is_u8_vector(dense_row) and _is_u8_vector(sparse_row) and _is_f32_vector(out) and _is_f32_vector(lut)):
        return ERR_SHAPE
    d = out.shape[0]
    if (
        not 1 <= d <= MAX_DIM
        or not _MB_MIN <= middle_bits <= _MB_MAX
        or dense_row.shape[0] != (middle_bits * d + 7) // 8
        or scales_row.ndim != 1
        or thr.ndim != 1
        or fill_lut(scales_row, thr, inner_bits, outer_bits, lut, middle_bits) != ERR_OK
    ):
        return ERR_SHAPE
    if not thresholds_valid(thr):
        return ERR_THRESHOLDS
    # the decoded values of each group's end codes, as in _decode_rows (lut holds them: fill_lut's arithmetic)
    n_mid, n_in, n_out = 1 << middle_bits, 1 << inner_bits, 1 << outer_bits
    ends = (lut[0], lut[n_mid - 1], lut[n_mid], lut[n_mid + n_in - 1], lut[3 * n_mid], lut[3 * n_mid + n_out - 1])
    for v in ends:
        if not np.isfinite(v):
            return ERR_SCALE_NONFINITE
    nbytes = dense_row.shape[0]
    pad = 8 * nbytes - middle_bits * d
    if pad and dense_row[nbytes - 1] >> (8 - pad):
        return ERR_PADDING
    if middle_bits == 4:
        half = d >> 1
        for j in range(half):
            b = dense_row[j]
            out[2 * j] = lut[b & 0xF]
            out[2 * j + 1] = lut[b >> 4]
        if d & 1:
            out[d - 1] = lut[dense_row[half] & 0xF]
    else:
        for j in range(d):
            out[j] = lut[slot_at(dense_row, j, middle_bits)]
    return _scatter_outliers(dense_row, sparse_row, d, middle_bits, inner_bits, outer_bits, lut, out)


@njit(cache=True, nogil=True)
def decode_row_into(dense_row, sparse_row, scales_row, thr, out, inner_bits=5, outer_bits=5, middle_bits=4):
    """Decode one row into float32 ``out[D]`` (allocates its look-up table; see decode_row_into_lut)."""
    lut = np.empty(LUT_SIZE, np.float32)
    return decode_row_into_lut(dense_row, sparse_row, scales_row, thr, out, inner_bits, outer_bits, lut, middle_bits)


# --------------------------------------------------------------------------------------------------------------
# Batch decode, generic over the output (float32, or fp16 bit patterns as uint16) and the stored scales (float32,
# or fp16 bit patterns as uint16): the overloads out_elem / f32_at pick the conversions when numba compiles each
# combination.
# --------------------------------------------------------------------------------------------------------------


@njit(cache=True, nogil=True, error_model="numpy")
def _dense_middle(dense_row, mb, lo, step, ti_lo, ti_hi, out):
    """Every ``mb``-bit slot of ``dense_row`` dequantized as a middle-group code into ``out`` (float32 or fp16 bits),
    with ``fill_lut``'s float32 operations; the outliers are overwritten afterwards. Vectorizes (no table look-up)."""
    zero = _F32(0.0)
    d = out.shape[0]
    if mb != 4:
        _dense_middle_slots(dense_row, mb, lo, step, ti_lo, ti_hi, out)
        return
    for j in range(d >> 1):
        b = np.int32(dense_row[j])
        # int32 casts: numba types int32 & int32 as int64, and 64-bit lanes would narrow the vectorization
        v0 = lo + _F32(np.int32(b & np.int32(0xF))) * step
        v1 = lo + _F32(np.int32(b >> np.int32(4))) * step
        out[2 * j] = out_elem(v0 + (ti_hi if v0 > zero else ti_lo), out)
        out[2 * j + 1] = out_elem(v1 + (ti_hi if v1 > zero else ti_lo), out)
    if d & 1:
        v = lo + _F32(dense_row[d >> 1] & 0xF) * step
        out[d - 1] = out_elem(v + (ti_hi if v > zero else ti_lo), out)


@njit(cache=True, nogil=True, error_model="numpy")
def _dense_middle_slots(dense_row, mb, lo, step, ti_lo, ti_hi, out):
    """_dense_middle for slots other than 4 bits (2..7): eight values (``mb`` bytes) at a time from a 64-bit word of
    the bit stream; the last group reads only the bytes the row has."""
    zero = _F32(0.0)
    d = out.shape[0]
    nbytes = dense_row.shape[0]
    mask = np.int64((1 << mb) - 1)
    for g in range((d + 7) >> 3):
        base = g * mb
        acc = np.int64(0)
        for i in range(min(mb, nbytes - base)):
            acc |= np.int64(dense_row[base + i]) << np.int64(8 * i)
        j0 = g * 8
        for k in range(min(8, d - j0)):
            v = lo + _F32(np.int32((acc >> np.int64(mb * k)) & mask)) * step
            out[j0 + k] = out_elem(v + (ti_hi if v > zero else ti_lo), out)


#: Rows at least this wide take their outliers' values from a per-row table (~40 outliers or more), narrower rows
#: compute each one (see _walk_outliers).
_LUT_MIN_DIM = 512

_NO_LUT32 = np.empty(0, np.float32)
_NO_LUT16 = np.empty(0, np.uint16)
_NO_GRID = np.zeros(6, np.float32)


@njit(cache=True, nogil=True, error_model="numpy", inline="always")
def _decode_one(dense_r, sr, sp, thr, middle_bits, inner_bits, outer_bits, use_lut, sc32, lut32, lut, grid, out_r):
    """One row of the batch decoders: nibbles ``dense_r``, six scales ``sr`` (float32, or fp16 bits as uint16),
    COO stream ``sp``, thresholds ``thr`` (float32 ``[4]``) into ``out_r`` (float32 or fp16 bits); returns ERR_OK
    or ``ERR_*``. ``sc32``, ``lut32``, ``lut`` and ``grid`` are the caller's scratch. Inlined into its callers (a
    numba call costs time per array argument)."""
    n_mid, n_in, n_out = 1 << middle_bits, 1 << inner_bits, 1 << outer_bits
    lo, i_lo, o_lo = f32_at(sr, 0), f32_at(sr, 2), f32_at(sr, 4)
    m_step = (f32_at(sr, 1) - lo) / _F32(n_mid - 1)
    i_step = (f32_at(sr, 3) - i_lo) / _F32(n_in - 1)
    o_step = (f32_at(sr, 5) - o_lo) / _F32(n_out - 1)
    if not steps_decode_finite(lo, m_step, i_lo, i_step, o_lo, o_step, thr, n_mid, n_in, n_out):
        return ERR_SCALE_NONFINITE
    _dense_middle(dense_r, middle_bits, lo, m_step, thr[1], thr[2], out_r)
    grid[4], grid[5] = thr[0], thr[3]
    if use_lut:
        for i in range(NUM_SCALES):
            sc32[i] = f32_at(sr, i)
        fill_lut(sc32, thr, inner_bits, outer_bits, lut32, middle_bits)
        for i in range(5 << middle_bits):  # the entries fill_lut wrote (LUT_SIZE is the widest slot's)
            lut[i] = out_elem(lut32[i], lut)
    else:
        grid[0], grid[1] = i_lo, i_step
        grid[2], grid[3] = o_lo, o_step
    return _walk_outliers(dense_r, sp, out_r.shape[0], middle_bits, inner_bits, outer_bits, lut, grid, out_r)


@njit(cache=True, nogil=True, parallel=True)
def _decode_rows(dense, sparse, offsets, scales, thr, middle_bits, inner_bits, outer_bits, out, status):
    """Decode every row into ``out`` ([N, D] float32, or uint16 fp16 bits); ``status[r]``: ERR_OK or ``ERR_*``."""
    n = out.shape[0]
    nblocks = (n + _BLOCK_ROWS - 1) // _BLOCK_ROWS
    for b in prange(nblocks):
        r0, r1 = b * _BLOCK_ROWS, min(n, (b + 1) * _BLOCK_ROWS)
        _decode_block(dense, sparse, offsets, scales, thr, middle_bits, inner_bits, outer_bits, r0, r1, out, status)


@njit(cache=True, nogil=True, error_model="numpy")
def _decode_block(dense, sparse, offsets, scales, thr, middle_bits, inner_bits, outer_bits, r0, r1, out, status):
    """Rows ``r0:r1`` of :func:`_decode_rows`, with the block's scratch; the row loop is compiled once per slot
    width (a constant in each copy, see :func:`_walk_outliers`)."""
    use_lut = out.shape[1] >= _LUT_MIN_DIM
    sc32 = np.empty(NUM_SCALES, np.float32)
    lut32 = np.empty(LUT_SIZE, np.float32)
    lut = np.empty(LUT_SIZE if use_lut else 0, out.dtype)
    grid = np.empty(6, np.float32)
    if middle_bits == 4:
        _decode_span(dense, sparse, offsets, scales, thr, 4, inner_bits, outer_bits, use_lut, sc32, lut32, lut, grid,
                     r0, r1, out, status)  # fmt: skip
    elif middle_bits == 3:
        _decode_span(dense, sparse, offsets, scales, thr, 3, inner_bits, outer_bits, use_lut, sc32, lut32, lut, grid,
                     r0, r1, out, status)  # fmt: skip
    elif middle_bits == 2:
        _decode_span(dense, sparse, offsets, scales, thr, 2, inner_bits, outer_bits, use_lut, sc32, lut32, lut, grid,
                     r0, r1, out, status)  # fmt: skip
    else:  # 5..7: one copy, the width a runtime value
        _decode_span(dense, sparse, offsets, scales, thr, middle_bits, inner_bits, outer_bits, use_lut, sc32, lut32,
                     lut, grid, r0, r1, out, status)  # fmt: skip


@njit(cache=True, nogil=True, error_model="numpy", inline="always")
def _decode_span(
    dense, sparse, offsets, scales, thr, mb, inner_bits, outer_bits, use_lut, sc32, lut32, lut, grid, r0, r1, out,
    status,
):  # fmt: skip
    for r in range(r0, r1):
        # borrowed row views (no reference counting; the arrays outlive the loop)
        sp = span_view(sparse, offsets[r], offsets[r + 1])  # offsets validated by check_encoded
        status[r] = _decode_one(
            row_view(dense, r), row_view(scales, r), sp, thr, mb, inner_bits, outer_bits, use_lut, sc32, lut32, lut,
            grid, row_view(out, r),
        )  # fmt: skip


@njit(cache=True, nogil=True, error_model="numpy")
def decode_records(
    records, sparse, counts, thr, inner_bits, outer_bits, fp16, scale_bytes, out, status, middle_bits=4, static=None
):
    """Decode rows in page-record form (what :func:`encode_records` writes, the same arguments before ``out``, and
    ``middle_bits`` and ``static`` last, as there) into
    float32 ``out [n, D]`` on the calling thread: the values :func:`decode_batch` gives for the same rows.
    ``records`` uint8 ``[n, record]``, ``sparse`` uint8 ``[n, >= counts[r]]`` (row ``r``'s stream at its start),
    ``thr`` float32 ``[n, 4]`` (each row's thresholds); ``status[r]``: ERR_OK or ``ERR_*``. With static grids
    (records holding the outer scales only: ``scale_bytes`` of two), ``static`` float32 ``[n, 4]`` gives each row's
    middle and inner end points back; ``ERR_SHAPE`` for every row where the two disagree. With static levels
    (records of two scales and a level byte), ``static`` float32 ``[n, 4 L]`` gives each row's levels' grids, the
    level byte picking one (``ERR_LEVEL`` for an index ``>= L``)."""
    st = _static_rows(static, out.shape[0])
    if middle_bits == 4:  # the row loop compiled once per slot width (see _walk_outliers)
        _decode_records_of(records, sparse, counts, thr, inner_bits, outer_bits, fp16, scale_bytes, out, status, 4, st)
    elif middle_bits == 3:
        _decode_records_of(records, sparse, counts, thr, inner_bits, outer_bits, fp16, scale_bytes, out, status, 3, st)
    elif middle_bits == 2:
        _decode_records_of(records, sparse, counts, thr, inner_bits, outer_bits, fp16, scale_bytes, out, status, 2, st)
    else:  # 5..7: one copy, the width a runtime value
        _decode_records_of(
            records, sparse, counts, thr, inner_bits, outer_bits, fp16, scale_bytes, out, status, middle_bits, st
        )


@njit(cache=True, nogil=True, error_model="numpy", inline="always")
def _decode_records_of(
    records, sparse, counts, thr, inner_bits, outer_bits, fp16, scale_bytes, out, status, mb, static
):
    n, d = out.shape
    use_lut = d >= _LUT_MIN_DIM
    sr = np.empty(NUM_SCALES, np.float32)
    sc32 = np.empty(NUM_SCALES, np.float32)
    lut32 = np.empty(LUT_SIZE, np.float32)
    lut = np.empty(LUT_SIZE if use_lut else 0, np.float32)
    grid = np.empty(6, np.float32)
    itemsize = _F16_ITEMSIZE if fp16 else _F32_ITEMSIZE
    width = static.shape[1]  # 0 (per-row grids), 4 (a static grid) or 4 L (L >= 2 static levels)
    first = STATIC_COLUMNS if width >= STATIC_COLUMNS else 0  # the scales not stored
    n_levels = width // STATIC_COLUMNS if width > STATIC_COLUMNS else 0
    level_at = itemsize * (NUM_SCALES - first)  # static levels: the level byte after the stored scales
    # records of two scales need the static grid, records of six take none, records of two scales and a level byte
    # take the levels' grids: anything else is another format
    layout_ok = width % STATIC_COLUMNS == 0 and scale_bytes == level_at + (1 if n_levels else 0)
    for r in range(n):
        rec = records[r]
        if not layout_ok:
            status[r] = ERR_SHAPE
            continue
        at = 0
        if n_levels:
            lv = np.int64(rec[level_at])
            if lv >= n_levels:
                status[r] = ERR_LEVEL
                continue
            at = STATIC_COLUMNS * lv
        for i in range(first):  # static grids: the layer's middle and inner end points (the row's level's)
            sr[i] = static[r, at + i]
        for i in range(first, NUM_SCALES):  # the stored scales, little-endian at the record's start (encode_records)
            bits = np.int64(0)
            for k in range(itemsize):
                bits |= np.int64(rec[itemsize * (i - first) + k]) << np.int64(8 * k)
            sr[i] = f16_widen(np.uint16(bits)) if fp16 else np.uint32(bits).view(np.float32)
        status[r] = _decode_one(
            rec[scale_bytes:], sr, sparse[r, : counts[r]], thr[r], mb, inner_bits, outer_bits, use_lut, sc32, lut32,
            lut, grid, out[r],
        )  # fmt: skip


def decode_batch(
    enc: EncodedBatch,
    thr: ThresholdsLike,
    config: OakenConfig,
    out_dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Unpack and dequantize ``enc`` into ``[N, D]`` float32 (or float16: the float32 result rounded once).

    Args:
        out: optional preallocated contiguous ``[N, D]`` tensor of ``out_dtype`` to decode into (reused buffers
            avoid page faults on fresh memory in a steady-state loop).

    Raises ``CorruptDataError`` for structurally invalid input (see ``codec.check_encoded``), a corrupt stream, or
    (static grids) middle and inner scales that are not the static grid of ``thr``.
    """
    # the kernel checks that each row's scales are finite (cheaper than numpy's isfinite over fp16 scales)
    check_encoded(enc, config, check_scales=False)
    check_static_columns(enc, thr, config)
    if out_dtype not in (torch.float32, torch.float16):
        raise ValueError(f"decode can write float32 or float16, got {out_dtype}")
    n, d = enc.num_rows, enc.dim
    if out is None:
        out = torch.empty((n, d), dtype=out_dtype)
    elif out.shape != (n, d) or out.dtype != out_dtype or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous {out_dtype} tensor of shape [{n}, {d}], got {out.dtype} {tuple(out.shape)}"
        )
    return _decode(enc, _thr_array(thr), config, out)


def decode_trusted(enc: EncodedBatch, thr: np.ndarray, config: OakenConfig) -> torch.Tensor:
    """:func:`decode_batch` to float32 of a batch :func:`encode_trusted` (or :func:`encode_batch`) returned and nobody
    changed since: the paged store decoding the chunks it has just encoded (``oakenkv.hf.cache``), without the
    structural checks of ``check_encoded`` (the kernel still checks every row's scales and stream).

    Args:
        thr: C-contiguous float32 ``[4]``, validated thresholds (``PagedKVStore.thr``).
    """
    return _decode(enc, thr, config, torch.empty((enc.num_rows, enc.dim), dtype=torch.float32))


def _decode(enc: EncodedBatch, thr_a: np.ndarray, config: OakenConfig, out: torch.Tensor) -> torch.Tensor:
    n = enc.num_rows
    dense = enc.dense.contiguous().numpy()
    sparse = enc.sparse.contiguous().numpy()
    offsets = enc.sparse_offsets.contiguous().numpy()
    # fp16 values travel as their bit patterns (numba has no float16 type on the CPU); the kernel widens them
    scales = enc.scales.contiguous()
    scales = scales.view(torch.int16).numpy().view(np.uint16) if scales.dtype == torch.float16 else scales.numpy()
    out_np = out.numpy() if out.dtype == torch.float32 else out.view(torch.int16).numpy().view(np.uint16)
    status = np.empty(n, np.int64)
    _decode_rows(
        dense, sparse, offsets, scales, thr_a, config.middle_bits, config.inner_bits, config.outer_bits, out_np, status
    )
    r = first_error(status)
    if r >= 0:
        raise CorruptDataError(f"row {r}: {ERROR_MESSAGES[int(status[r])]}")
    return out


# --------------------------------------------------------------------------------------------------------------
# Stream statistics (for the effective-bit breakdown)
# --------------------------------------------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def _stream_stats(sparse, offsets, stats):
    """stats[0] += entries, stats[1] += escape + advance bytes; assumes valid streams (counts what it finds)."""
    n = offsets.shape[0] - 1
    for r in range(n):
        prev = 0
        j = offsets[r]
        end = offsets[r + 1]
        while j < end:
            e = np.int64(sparse[j])
            j += 1
            if e == prev:
                stats[1] += 1
                while j < end:
                    a = sparse[j]
                    j += 1
                    stats[1] += 1
                    if a != ADVANCE_CONTINUE:
                        break
                prev = -1
                continue
            stats[0] += 1
            prev = e


def sparse_stream_stats(enc: EncodedBatch) -> tuple[int, int]:
    """(COO entries, escape bytes) over all rows of ``enc``."""
    stats = np.zeros(2, np.int64)
    _stream_stats(enc.sparse.contiguous().numpy(), enc.sparse_offsets.contiguous().numpy(), stats)
    return int(stats[0]), int(stats[1])


def num_threads() -> int:
    return numba.get_num_threads()
