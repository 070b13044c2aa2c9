"""Decode attention over packed Oaken pages (numba, CPU): one query token per row, flash-decoding style.

Why one module (over 600 lines): the serial and parallel kernels and the window and sink merges share the
inlined row decoder, COO walk and block loop, and numba's disk cache is invalidated only by a change of the
function's own file: kept together, an edit of a shared helper recompiles every kernel that inlines it.

The kernel reads every stored token's dense record (six fp16 scales + nibbles; with static grids two, the outer
group's, the middle and inner grids coming from the view's ``static_grid``; with static levels those two and a level
byte, which picks the row's grid among the view's levels') and sparse record (COO bytes)
straight from the page pool, dequantizes it with its own single-row decoder (the same float32 arithmetic as
``oakenkv.kernels.cpu.codec.decode_row_into_lut``, bit-exact with ``oakenkv.quant.quantizer.dequantize``) and folds it
into an online softmax. The float history is never rebuilt: a work item holds one block of decoded key rows, one of
value rows and its per-head accumulators.

Blocks: a work item takes its tokens ``_BLOCK`` at a time. It decodes the block's key rows into a small float
buffer, then computes all the block's scores (unit-stride dot products that LLVM vectorizes), the block's maximum
and the probabilities (a polynomial ``exp`` that vectorizes, where a libm call per score would not), rescales the
accumulators once, and finally decodes the block's value rows and adds them into every query head's
accumulator, four rows per pass (the accumulator is loaded and stored once for four rows). Loops
over the buffers use borrowed views (``numba_helpers.row_view`` / ``span_view``): a numba slice costs an atomic
reference-count increment and decrement, which per token and head was most of the old kernel's time
(docs/notebook/perf-notes.md).

Parallelism: the tokens of each batch row are split into ``num_splits`` contiguous ranges (split-K, as in
flash-decoding); each (row, split) work item keeps its own running max, sum and accumulator per query head, and a
final pass combines them.

What the kernels read is one layer's :class:`~oakenkv.format.layout.LayerView`
(``oakenkv.store.paged.PagedKVStore.layer_view``;
its docstring has the table layout), passed as the kernels' trailing arguments (``*view``: numba dispatches
plain arrays and integers fastest) and rebuilt as the named tuple inside. Page ids of -1 (``pages.EVICTED``: a
sliding window released them) are never dereferenced: masked tokens are skipped without reading their pages, and
an unmasked token on a released page stops the row with ``ERR_EVICTED``.

Fast math: the attention loops may reassociate and contract (vectorized reductions, FMA), but keep IEEE
infinities (a masked score is ``-inf``; numba's plain ``fastmath=True`` would assume none exist). The row
decoder is compiled without any, so the dequantized values are the codec's to the bit: its functions say
``fastmath=False`` explicitly, because numba compiles a callee that sets no fastmath option with its caller's
(``inherit_if_not_set``), and caches that code for direct calls too (the row decoder had been contracting
``lo + code * step`` into FMAs inside the kernel, 1 ulp off the codec's values).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from oakenkv.format.config import MIDDLE_BITS_CHOICES
from oakenkv.format.layout import (
    ADVANCE_CONTINUE,
    CHUNK_SIZE,
    COO_CODE_BIT4,
    COO_GROUP_BIT,
    COO_INDEX_MASK,
    ERR_ESCAPE_TRUNCATED,
    ERR_EVICTED,
    ERR_LEVEL,
    ERR_OK,
    ERR_POSITION_RANGE,
    LayerView,
)
from oakenkv.kernels.cpu.helpers import f16_widen, row_view, span_view

#: Tokens per block inside a work item: the scores of a block are computed together, the accumulators rescaled
#: once per block.
_BLOCK = 32

#: Below this many (row, token) pairs a decode step runs :func:`packed_decode_attention_serial`: waking the threads
#: costs more than they save. The trade-off is set inside the model, where numba's threads sleep between layers and
#: torch's run the matmuls around them: the wake-up then costs far more than in a kernel timed alone and warm
#: (which favours threads from a few hundred pairs). The value sits between the largest context x batch where the
#: serial kernel made the whole step faster and the smallest where the parallel one did, on 2 threads
#: (docs/notebook/perf-notes.md, session 15, has the steps; ``benchmarks/bench_step_parts.py`` measures them).
PARALLEL_MIN_TOKENS = 6144
#: Smallest token range worth a parallel work item of its own.
THREADS_MIN_TOKENS = 128


def split_work(batch: int, num_tokens: int, threads: int) -> tuple[bool, int]:
    """How a decode step over ``batch`` rows of ``num_tokens`` tokens runs on ``threads`` threads: ``(parallel,
    splits)``. ``parallel``: :func:`packed_decode_attention` (from ``PARALLEL_MIN_TOKENS`` (row, token) pairs, on
    two threads or more), else :func:`packed_decode_attention_serial`. ``splits``: token ranges per row, enough
    work items for two per thread, each at least ``THREADS_MIN_TOKENS`` tokens (1 when the rows alone are
    enough: the parallel kernel then runs one row per work item)."""
    if threads < 2 or batch * num_tokens < PARALLEL_MIN_TOKENS:
        return False, 1
    per_row = max(1, -(-2 * threads // batch))
    return True, int(max(1, min(per_row, num_tokens // THREADS_MIN_TOKENS)))


#: LLVM fast-math flags of the attention loops: everything but "no NaNs" and "no infinities".
_FASTMATH = {"nsz", "arcp", "contract", "reassoc"}

_F32 = np.float32

#: An outlier's entry in the look-up table of :func:`_coo_walk`: ``2^b * (e >> _CLASS_SHIFT) + slot`` for COO
#: byte ``e`` and ``b``-bit slots; ``e >> _CLASS_SHIFT`` is its (top code bit, group bit) pair.
_CLASS_SHIFT = 6
assert COO_GROUP_BIT == 1 << _CLASS_SHIFT and COO_CODE_BIT4 == 1 << (_CLASS_SHIFT + 1)
_LUT_SIZE = 4 << max(MIDDLE_BITS_CHOICES)


@njit(cache=True, nogil=True, fastmath=_FASTMATH)
def _exp(x):
    """``e ** x`` in float32 for ``x <= 0`` (``-inf`` included), without a libm call, so a loop over it
    vectorizes: ``2 ** n`` times Cephes' ``expf`` polynomial on ``[-ln 2 / 2, ln 2 / 2]`` (about 1 ulp); 0 below
    -87.3, where float32 would turn subnormal."""
    xc = max(x, _F32(-87.3))
    n = np.rint(xc * _F32(1.44269504))
    r = xc - n * _F32(0.693359375) + n * _F32(2.12194440e-4)
    p = _F32(1.9875691500e-4)
    p = p * r + _F32(1.3981999507e-3)
    p = p * r + _F32(8.3334519073e-3)
    p = p * r + _F32(4.1665795894e-2)
    p = p * r + _F32(1.6666665459e-1)
    p = p * r + _F32(5.0000001201e-1)
    p = p * r * r + r + _F32(1.0)
    scale = np.int32((np.int32(n) + np.int32(127)) << np.int32(23)).view(np.float32)
    return p * scale if x > _F32(-87.3) else _F32(0.0)


@njit(cache=True, nogil=True, fastmath=False)
def _f16_at(pool, i):
    """The fp16 stored little-endian at ``pool[i:i + 2]``, as float32 (exact)."""
    return f16_widen(np.uint16(np.int64(pool[i]) | (np.int64(pool[i + 1]) << 8)))


@njit(cache=True, nogil=True)
def _sparse_start(first, count, lens, t0):
    """Walker state ``(page index, byte offset)`` of a stream's sparse records at token ``t0``."""
    sp = -1
    for i in range(count):
        if first[i] <= t0:
            sp = i
        else:
            break
    off = 0
    if sp >= 0:
        for t in range(first[sp], t0):
            off += lens[t]
    return sp, off


@njit(cache=True, nogil=True, fastmath=False)
def _decode_rows(
    pool, page_size, rec, sb, dense_pages, sc_pages, sc_first, sc_count, lens, thr, mb, ib, ob, keep, t0, sp, off, out,
    static,
):  # fmt: skip
    """:func:`_decode_block` compiled once per slot width ``mb`` (a constant inside each copy: the paper's 4-bit
    slots run the nibble arithmetic they ran before slot widths were a parameter)."""
    if mb == 4:
        return _decode_block(
            pool, page_size, rec, sb, dense_pages, sc_pages, sc_first, sc_count, lens, thr, 4, ib, ob, keep, t0, sp,
            off, out, static,
        )  # fmt: skip
    if mb == 3:
        return _decode_block(
            pool, page_size, rec, sb, dense_pages, sc_pages, sc_first, sc_count, lens, thr, 3, ib, ob, keep, t0, sp,
            off, out, static,
        )  # fmt: skip
    if mb == 2:
        return _decode_block(
            pool, page_size, rec, sb, dense_pages, sc_pages, sc_first, sc_count, lens, thr, 2, ib, ob, keep, t0, sp,
            off, out, static,
        )  # fmt: skip
    # 5..7-bit slots: one copy, the width a runtime value (their speed is not the hot path's)
    return _decode_block(
        pool, page_size, rec, sb, dense_pages, sc_pages, sc_first, sc_count, lens, thr, mb, ib, ob, keep, t0, sp, off,
        out, static,
    )  # fmt: skip


@njit(cache=True, nogil=True, fastmath=False, inline="always")
def _decode_block(
    pool, page_size, rec, sb, dense_pages, sc_pages, sc_first, sc_count, lens, thr, mb, ib, ob, keep, t0, sp, off, out,
    static,
):  # fmt: skip
    """Decode tokens ``t0 .. t0 + len(out)`` of one stream whose ``keep`` is set into the float32 rows ``out[j]``
    (``out[j]`` is token ``t0 + j``; masked tokens are skipped, their pages never read). ``(sp, off)`` is the
    stream's sparse walker at ``t0`` (page index, byte offset); returns ``(status, sp, off)`` advanced past the
    block. ``mb``, ``ib``, ``ob``: the middle (slot), inner and outer code bits. ``static``: float32 ``[4]``, the
    static grid ``(mid_min, mid_max, inner_min, inner_max)`` of records that hold the outer scales alone (static
    grids); float32 ``[4 L]`` (``L >= 2``), the static levels' grids of records that hold the outer scales and a
    level byte (the row's grid is level ``j``'s, at ``4 j``; ``ERR_LEVEL`` for ``j >= L``); or empty (records of
    six scales).

    The arithmetic is exactly ``oakenkv.kernels.cpu.codec.fill_lut`` / ``decode_row_into_lut`` (and so the reference
    ``quant.dequantize``): ``v = lo + code * step`` in float32, then the threshold of the value's side. The
    nibbles (or 2..7-bit slots) are first split into a uint8 code row (``codes``, which the COO walk reads too),
    then the middle
    values are computed from it in one contiguous loop that LLVM vectorizes (through int32, not int64: numba
    would widen the codes; two loops are faster than one that stores the even and odd values interleaved,
    docs/notebook/perf-notes.md); each COO entry then overwrites its value (:func:`_coo_walk`). Compiled without
    fastmath (no FMA contraction), so the numbers stay bit-exact inside the fast-math attention kernel. A block per
    call, not a row: the call and the page arithmetic cost as much as a row's nibbles (docs/notebook/perf-notes.md).
    """
    rpp = page_size // rec
    d = out.shape[1]
    half = d >> 1
    zero = _F32(0.0)
    to_lo, ti_lo, ti_hi, to_hi = thr[0], thr[1], thr[2], thr[3]
    in_div = _F32((1 << ib) - 1)
    out_div = _F32((1 << ob) - 1)
    mid_div = _F32((1 << mb) - 1)
    nbytes = (mb * d + 7) >> 3
    pi = t0 // rpp
    slot = t0 - pi * rpp
    # static grids: the middle and inner grids are the layer's, the record holds the outer scales alone (at 0)
    fixed = static.shape[0] >= 4
    n_levels = static.shape[0] >> 2 if static.shape[0] > 4 else 0  # static levels: the record's byte picks one
    s_lo, s_step, s_in_lo, s_in_step = zero, zero, zero, zero
    if fixed:  # (the decoder's float32 operations, as for scales read from a record)
        s_lo, s_in_lo = static[0], static[2]
        s_step = (static[1] - s_lo) / mid_div
        s_in_step = (static[3] - s_in_lo) / in_div
    o_at = 0 if fixed else 8  # the outer scales' offset in the record
    codes = np.empty(d, np.uint8)  # the row's nibbles, one per value
    lut = np.empty(_LUT_SIZE, np.float32)  # the outlier values of the row being decoded (_coo_walk)
    for j in range(out.shape[0]):
        t = t0 + j
        n = np.int64(lens[t])
        s0 = off
        if n:  # the walker follows every record, read or not
            while sp + 1 < sc_count and sc_first[sp + 1] <= t:
                sp += 1
                off = 0
            s0 = off
            off += n
        if keep[t]:
            page = np.int64(dense_pages[pi])
            if page < 0:  # released by a sliding window (pages.EVICTED): the mask should have hidden this token
                return ERR_EVICTED, sp, off
            base = page * page_size + slot * rec
            row = row_view(out, j)
            at = 0  # the row's grid in static: its level's (static levels), else the one
            if n_levels:
                at = np.int64(pool[base + 4]) << 2  # the level byte, after the two fp16 outer scales
                if at >= static.shape[0]:
                    return ERR_LEVEL, sp, off
                lo = static[at]
                step = (static[at + 1] - lo) / mid_div  # (the decoder's float32 operations, as s_step's)
            elif fixed:
                lo, step = s_lo, s_step
            else:
                lo = _f16_at(pool, base)
                step = (_f16_at(pool, base + 2) - lo) / mid_div
            src = span_view(pool, base + sb, base + sb + nbytes)
            if mb == 4:
                for i in range(half):
                    byte = src[i]
                    codes[2 * i] = byte & np.uint8(15)
                    codes[2 * i + 1] = byte >> np.uint8(4)
                if d & 1:
                    codes[d - 1] = src[half] & np.uint8(15)
            else:
                _unpack_slots(src, mb, codes)
            for i in range(d):
                v0 = lo + _F32(np.int32(codes[i])) * step
                row[i] = v0 + (ti_hi if v0 > zero else ti_lo)
            if n:
                spage = np.int64(sc_pages[sp])
                if spage < 0:
                    return ERR_EVICTED, sp, off
                if n_levels:
                    in_lo = static[at + 2]
                    in_step = (static[at + 3] - in_lo) / in_div
                elif fixed:
                    in_lo, in_step = s_in_lo, s_in_step
                else:
                    in_lo = _f16_at(pool, base + 4)
                    in_step = (_f16_at(pool, base + 6) - in_lo) / in_div
                out_lo = _f16_at(pool, base + o_at)
                out_step = (_f16_at(pool, base + o_at + 2) - out_lo) / out_div
                st = _coo_walk(
                    pool, spage * page_size + s0, n, codes, mb, in_lo, in_step, out_lo, out_step, to_lo, to_hi, row,
                    lut,
                )  # fmt: skip
                if st != ERR_OK:
                    return st, sp, off
        slot += 1
        if slot == rpp:
            slot = 0
            pi += 1
    return ERR_OK, sp, off


@njit(cache=True, nogil=True, fastmath=False)
def _unpack_slots(src, mb, codes):
    """The ``mb``-bit slots (2..7 bits, not 4) of a row's dense bytes ``src`` into ``codes`` (one uint8 per value):
    eight values (``mb`` bytes) at a time from a 64-bit word of the bit stream (``oakenkv.format.layout``)."""
    d = codes.shape[0]
    nbytes = src.shape[0]
    mask = np.uint64((1 << mb) - 1)
    for g in range((d + 7) >> 3):
        base = g * mb
        acc = np.uint64(0)
        for i in range(min(mb, nbytes - base)):
            acc |= np.uint64(src[base + i]) << np.uint64(8 * i)
        j0 = g * 8
        for k in range(min(8, d - j0)):
            codes[j0 + k] = np.uint8((acc >> np.uint64(mb * k)) & mask)


@njit(cache=True, nogil=True, fastmath=False, inline="always")
def _coo_walk(pool, s0, n, src, mb, in_lo, in_step, out_lo, out_step, to_lo, to_hi, row, lut):
    """Overwrite the outliers of one decoded row with their values: the COO walk of ``oakenkv.format.layout`` (its
    module docstring: implicit chunks, escapes for the rare jumps) over ``pool[s0:s0 + n]``; the low ``mb`` code
    bits (the slot) come from the row's codes ``src`` (one uint8 per value). Returns ``ERR_OK`` or an ``ERR_*``
    code.

    The values of every code of both outlier groups go to ``lut`` (float32 ``[_LUT_SIZE]``) first, in a loop LLVM
    vectorizes; an entry then costs one look-up, ``lut[2^mb * (e >> _CLASS_SHIFT) + slot]`` (cheaper than
    computing each entry's value: docs/notebook/perf-notes.md). Entries are taken two at a time while neither is an
    escape (one loop test and one range check per pair: positions only increase, so the second one's check covers
    both); escapes and a last odd entry take the one-entry path. Unsigned indices spare numba's negative-index
    checks."""
    zero = _F32(0.0)
    d = row.shape[0]
    # block k = e >> _CLASS_SHIFT of the table holds group k & 1's codes 2^mb * (k >> 1) + slot (group 0 inner)
    ns = np.int64(1) << mb
    for c in range(ns):
        lut[c] = in_lo + _F32(np.int32(c)) * in_step
        lut[2 * ns + c] = in_lo + _F32(np.int32(c + ns)) * in_step
        vo = out_lo + _F32(np.int32(c)) * out_step
        lut[ns + c] = vo + (to_hi if vo > zero else to_lo)
        vo = out_lo + _F32(np.int32(c + ns)) * out_step
        lut[3 * ns + c] = vo + (to_hi if vo > zero else to_lo)
    coo = span_view(pool, s0, s0 + n)
    base, p, prev = 0, -1, 0
    j = 0
    while j < n:
        e = np.int64(coo[np.uint64(j)])
        if j + 1 < n:  # two entries at a time while neither is an escape
            e1 = np.int64(coo[np.uint64(j + 1)])
            if e != prev and e1 != e:
                i = e & COO_INDEX_MASK
                base += CHUNK_SIZE * np.int64(i <= p)
                pos = base + i
                i1 = e1 & COO_INDEX_MASK
                base += CHUNK_SIZE * np.int64(i1 <= i)
                pos1 = base + i1
                if pos1 >= d:  # positions only increase: pos < pos1
                    return ERR_POSITION_RANGE
                row[np.uint64(pos)] = lut[np.uint64(((e >> _CLASS_SHIFT) << mb) | np.int64(src[np.uint64(pos)]))]
                row[np.uint64(pos1)] = lut[np.uint64(((e1 >> _CLASS_SHIFT) << mb) | np.int64(src[np.uint64(pos1)]))]
                p = i1
                prev = e1
                j += 2
                continue
        j += 1
        if e == prev:
            k = 0
            while True:
                if j >= n:
                    return ERR_ESCAPE_TRUNCATED
                a = np.int64(coo[np.uint64(j)])
                j += 1
                k += a
                if a != ADVANCE_CONTINUE:
                    break
            base += k * CHUNK_SIZE
            p = -1
            prev = -1
            continue
        i = e & COO_INDEX_MASK
        base += CHUNK_SIZE * np.int64(i <= p)
        pos = base + i
        if pos >= d:
            return ERR_POSITION_RANGE
        row[np.uint64(pos)] = lut[np.uint64(((e >> _CLASS_SHIFT) << mb) | np.int64(src[np.uint64(pos)]))]
        p = i
        prev = e
    return ERR_OK


@njit(cache=True, nogil=True, fastmath=_FASTMATH)
def _work_item(q, keep, scaling, softcap, num_splits, w, part_m, part_l, part_acc, view):
    """Work item ``w`` of :func:`packed_decode_attention`: row ``b = w // num_splits``, token range
    ``s = w % num_splits``, over the layer's ``view`` (a :class:`LayerView`). Writes its running max, sum and
    accumulator per query head to ``part_*[b, s]``; returns ``ERR_OK`` or the first codec error code met."""
    pool, page_size, rec, sb = view.pool, view.page_size, view.record_size, view.scale_bytes
    thr, ib, ob, num_kv_heads = view.thresholds, view.inner_bits, view.outer_bits, view.num_kv_heads
    mb = view.middle_bits
    t_n = view.num_tokens
    hq_n, hd = q.shape[1], q.shape[2]
    d = num_kv_heads * hd
    group = hq_n // num_kv_heads
    b = w // num_splits
    s = w % num_splits
    t0 = s * t_n // num_splits
    t1 = (s + 1) * t_n // num_splits
    # per-item buffers: the scaled query, a block of key rows and one of value rows, scores/probabilities,
    # accumulators
    qs = np.empty(hq_n * hd, np.float32)
    for h in range(hq_n):
        for i in range(hd):
            qs[h * hd + i] = q[b, h, i] * scaling
    kbuf = np.empty((_BLOCK, d), np.float32)
    vbuf = np.empty((_BLOCK, d), np.float32)
    probs = np.empty((hq_n, _BLOCK), np.float32)
    m = np.full(hq_n, -np.inf, dtype=np.float32)
    ell = np.zeros(hq_n, dtype=np.float32)
    acc = np.zeros(hq_n * hd, dtype=np.float32)
    zero = _F32(0.0)
    k_dense, v_dense = view.dense_pages[b, 0], view.dense_pages[b, 1]
    k_pages, v_pages = view.sparse_pages[b, 0], view.sparse_pages[b, 1]
    k_first, v_first = view.sparse_first[b, 0], view.sparse_first[b, 1]
    k_count, v_count = view.sparse_counts[b, 0], view.sparse_counts[b, 1]
    k_len, v_len = view.sparse_lengths[b, 0], view.sparse_lengths[b, 1]
    thr_k, thr_v = thr[0], thr[1]
    st_k, st_v = view.static_grid[0], view.static_grid[1]  # static grids, or empty
    keep_b = keep[b]
    ksp, koff = _sparse_start(k_first, k_count, k_len, t0)
    vsp, voff = _sparse_start(v_first, v_count, v_len, t0)
    for tb in range(t0, t1, _BLOCK):
        nb = min(_BLOCK, t1 - tb)
        nlive = 0
        for j in range(nb):
            nlive += keep_b[tb + j] != 0
        # 1. the block's key rows
        st, ksp, koff = _decode_rows(
            pool, page_size, rec, sb, k_dense, k_pages, k_first, k_count, k_len, thr_k, mb, ib, ob, keep_b, tb, ksp,
            koff, kbuf[:nb], st_k,
        )  # fmt: skip
        if st != ERR_OK:
            return st  # the first error ends the item: a walker past a bad record would misread what follows
        if nlive == 0:  # nothing to attend to: only the value walker moves on
            st, vsp, voff = _decode_rows(
                pool, page_size, rec, sb, v_dense, v_pages, v_first, v_count, v_len, thr_v, mb, ib, ob, keep_b, tb,
                vsp, voff, vbuf[:nb], st_v,
            )  # fmt: skip
            continue
        # 2. scores of every query head for the block; its maximum; the running sums rescaled once
        for h in range(hq_n):
            qh = span_view(qs, h * hd, h * hd + hd)
            ko = (h // group) * hd
            ph = row_view(probs, h)
            for j in range(nb):
                # indices from range() only: numba's wrap-around of a negative index (ko + i) would stop LLVM
                # from vectorizing the loop
                kr = span_view(row_view(kbuf, j), ko, ko + hd)
                dot = _F32(0.0)
                for i in range(hd):
                    dot += qh[i] * kr[i]
                if softcap > 0:
                    dot = np.tanh(dot / softcap) * softcap
                ph[j] = dot if keep_b[tb + j] else -np.inf
            bmax = _F32(-np.inf)
            for j in range(nb):
                bmax = max(bmax, ph[j])
            mh = m[h]
            if bmax > mh:
                if mh > -np.inf:
                    corr = _exp(mh - bmax)
                    ell[h] *= corr
                    ah = span_view(acc, h * hd, h * hd + hd)
                    for i in range(hd):
                        ah[i] *= corr
                m[h] = bmax
                mh = bmax
            total = _F32(0.0)
            for j in range(nb):
                e = _exp(ph[j] - mh)
                ph[j] = e
                total += e
            ell[h] += total
        # 3. the block's value rows, added into every query head's accumulator
        st, vsp, voff = _decode_rows(
            pool, page_size, rec, sb, v_dense, v_pages, v_first, v_count, v_len, thr_v, mb, ib, ob, keep_b, tb, vsp,
            voff, vbuf[:nb], st_v,
        )  # fmt: skip
        if st != ERR_OK:
            return st
        for j in range(nb):  # masked tokens add nothing: their probability is exactly 0
            if not keep_b[tb + j]:
                for i in range(d):
                    vbuf[j, i] = zero
        for h in range(hq_n):
            vo = (h // group) * hd
            ah = span_view(acc, h * hd, h * hd + hd)
            ph = row_view(probs, h)
            j = 0
            while j + 4 <= nb:  # four rows per pass: the accumulator is loaded and stored once for four
                p0, p1, p2, p3 = ph[j], ph[j + 1], ph[j + 2], ph[j + 3]
                v0 = span_view(row_view(vbuf, j), vo, vo + hd)
                v1 = span_view(row_view(vbuf, j + 1), vo, vo + hd)
                v2 = span_view(row_view(vbuf, j + 2), vo, vo + hd)
                v3 = span_view(row_view(vbuf, j + 3), vo, vo + hd)
                for i in range(hd):
                    ah[i] += (p0 * v0[i] + p1 * v1[i]) + (p2 * v2[i] + p3 * v3[i])
                j += 4
            while j < nb:
                pj = ph[j]
                vr = span_view(row_view(vbuf, j), vo, vo + hd)
                for i in range(hd):
                    ah[i] += pj * vr[i]
                j += 1
    for h in range(hq_n):
        part_m[b, s, h] = m[h]
        part_l[b, s, h] = ell[h]
        for i in range(hd):
            part_acc[b, s, h, i] = acc[h * hd + i]
    return ERR_OK


@njit(cache=True, nogil=True, fastmath=_FASTMATH)
def _combine(part_m, part_l, part_acc, out, lse):
    """Combine the splits of each row: ``out[b, h] = sum_s acc_s e^(m_s - m) / sum_s l_s e^(m_s - m)``, and
    ``lse[b, h] = m + log(sum_s l_s e^(m_s - m))``, the log of the softmax's denominator (-inf when every token
    is masked): what a caller needs to merge the result with attention over tokens outside the pages."""
    b_n, num_splits, hq_n = part_m.shape
    hd = out.shape[2]
    for b in range(b_n):
        for h in range(hq_n):
            mm = -np.inf
            for s in range(num_splits):
                if part_m[b, s, h] > mm:
                    mm = part_m[b, s, h]
            total = _F32(0.0)
            for i in range(hd):
                out[b, h, i] = 0.0
            lse[b, h] = -np.inf
            if mm == -np.inf:
                continue  # every token masked: output zeros (as a fully masked row carries no information)
            for s in range(num_splits):
                if part_m[b, s, h] == -np.inf:
                    continue
                c = np.exp(part_m[b, s, h] - mm)
                total += part_l[b, s, h] * c
                for i in range(hd):
                    out[b, h, i] += part_acc[b, s, h, i] * c
            if total > 0:  # not when a failed work item left nothing (the caller raises on its status)
                lse[b, h] = mm + np.log(total)
                for i in range(hd):
                    out[b, h, i] /= total


@njit(cache=True, nogil=True, parallel=True, fastmath=_FASTMATH)
def packed_decode_attention(q, keep, scaling, softcap, num_splits, out, status, lse, *view):
    """Attention of one query token per row over ``T`` packed tokens, multi-threaded over (row, split) work
    items: for long contexts.

    Args:
        q: float32 ``[B, Hq, hd]`` query (post-RoPE), ``Hq`` a multiple of ``view.num_kv_heads`` (GQA).
        keep: uint8 ``[B, >= T]``: 1 where the query may attend to the token (mask), 0 to skip it.
        scaling: softmax scale (``hd ** -0.5`` or the model's); softcap: logit soft cap, 0 for none.
        num_splits: token ranges per row processed in parallel.
        out: float32 ``[B, Hq, hd]``, written. status: int64 ``[B * num_splits]``, 0 or a codec error code.
        lse: float32 ``[B, Hq]``, written: the log-sum-exp of each head's kept scores (see :func:`_combine`).
        view: the fields of the layer's :class:`~oakenkv.format.layout.LayerView`, in order (call with ``*view``).
    """
    lv = LayerView(*view)
    b_n, hq_n, hd = q.shape
    part_m = np.full((b_n, num_splits, hq_n), -np.inf, dtype=np.float32)
    part_l = np.zeros((b_n, num_splits, hq_n), dtype=np.float32)
    part_acc = np.zeros((b_n, num_splits, hq_n, hd), dtype=np.float32)
    for w in prange(b_n * num_splits):
        status[w] = _work_item(q, keep, scaling, softcap, num_splits, w, part_m, part_l, part_acc, lv)
    _combine(part_m, part_l, part_acc, out, lse)


@njit(cache=True, nogil=True, fastmath=_FASTMATH)
def packed_decode_attention_serial(q, keep, scaling, softcap, num_splits, out, status, lse, *view):
    """:func:`packed_decode_attention` on the calling thread: for short contexts, where waking threads costs
    more than the work.

    A function of its own, not a second ``njit`` of the same Python function: numba's on-disk cache keys an
    entry by the function's source location and signature, not by its compile options, so two dispatchers of
    one function share one cache entry, and whichever compiled first is what both run (the parallel kernel
    ran serially whenever the serial one had been cached first).
    """
    lv = LayerView(*view)
    b_n, hq_n, hd = q.shape
    part_m = np.full((b_n, num_splits, hq_n), -np.inf, dtype=np.float32)
    part_l = np.zeros((b_n, num_splits, hq_n), dtype=np.float32)
    part_acc = np.zeros((b_n, num_splits, hq_n, hd), dtype=np.float32)
    for w in range(b_n * num_splits):
        status[w] = _work_item(q, keep, scaling, softcap, num_splits, w, part_m, part_l, part_acc, lv)
    _combine(part_m, part_l, part_acc, out, lse)


@njit(cache=True, nogil=True, fastmath=_FASTMATH)
def packed_decode_attention_rows(q, keep, scaling, softcap, num_splits, first, stop, out, status, lse, *view):
    """:func:`packed_decode_attention_serial` for rows ``first:stop`` of ``q`` only: writes their ``out`` and
    ``lse`` rows and their ``status`` entries (``[first * num_splits, stop * num_splits)``), nothing else: callers
    with threads of their own (the kernel releases the GIL) give each a share of a step's rows. The serial kernel's
    work items and combine per row; under the same fast-math flags, so equal to its numbers up to the summation
    order LLVM picks when it compiles each (measured: bit-identical, or 1 ulp apart when compiled in different
    processes)."""
    lv = LayerView(*view)
    b_n, hq_n, hd = q.shape
    part_m = np.full((b_n, num_splits, hq_n), -np.inf, dtype=np.float32)
    part_l = np.zeros((b_n, num_splits, hq_n), dtype=np.float32)
    part_acc = np.zeros((b_n, num_splits, hq_n, hd), dtype=np.float32)
    for w in range(first * num_splits, stop * num_splits):
        status[w] = _work_item(q, keep, scaling, softcap, num_splits, w, part_m, part_l, part_acc, lv)
    _combine(part_m[first:stop], part_l[first:stop], part_acc[first:stop], out[first:stop], lse[first:stop])


@njit(cache=True, nogil=True, fastmath=_FASTMATH)
def merge_sinks(q, keep, sinks, scaling, softcap, out, lse):
    """Add tokens kept at 16 bits outside the pages (an oaken-plus profile's sink tokens, ``oakenkv.store.paged``) to
    the result of :func:`packed_decode_attention` over the other tokens, in place: per row and query head,
    ``out = (out e^lse + sum_j e^s_j v_j) / (e^lse + sum_j e^s_j)``, the softmax over both parts, and ``lse``
    updated to match.

    Args:
        q: float32 ``[B, Hq, hd]``, the kernel's queries (in the pages' key frame). keep: uint8 ``[B, n]``, 1
            where the query may attend to sink token ``j``.
        sinks: uint16 ``[B, 2, >= n, D]``: the float16 bits of the sink tokens' key rows (index 0, in the pages'
            frame) and value rows (index 1).
        scaling, softcap: as for the kernel. out: float32 ``[B, Hq, hd]``; lse: float32 ``[B, Hq]`` (both
            written).
    """
    b_n, hq_n, hd = q.shape
    n = keep.shape[1]
    group = hq_n // (sinks.shape[3] // hd)
    s = np.empty(n, np.float32)
    for b in range(b_n):
        for h in range(hq_n):
            ko = (h // group) * hd
            mm = lse[b, h]
            for j in range(n):
                if keep[b, j]:
                    dot = _F32(0.0)
                    for i in range(hd):
                        dot += q[b, h, i] * f16_widen(sinks[b, 0, j, ko + i])
                    dot *= scaling
                    if softcap > 0:
                        dot = np.tanh(dot / softcap) * softcap
                    s[j] = dot
                    mm = max(mm, dot)
                else:
                    s[j] = -np.inf
            if mm == -np.inf:
                continue  # nothing to attend to at all: the kernel's zeros stay
            w_pages = np.exp(lse[b, h] - mm)  # 0 when the kernel had no token
            total = w_pages
            for i in range(hd):
                out[b, h, i] *= w_pages
            for j in range(n):
                if s[j] > -np.inf:
                    w = np.exp(s[j] - mm)
                    total += w
                    for i in range(hd):
                        out[b, h, i] += w * f16_widen(sinks[b, 1, j, ko + i])
            for i in range(hd):
                out[b, h, i] /= total
            lse[b, h] = mm + np.log(total)


@njit(cache=True, nogil=True, fastmath=_FASTMATH)
def _merge_window_group(q, keep, keys_t, values, scaling, softcap, out, lse, b, g, s, acc):
    """:func:`merge_window` for row ``b`` and KV head ``g``: its ``group`` query heads together, so that each key
    and value of the window is loaded once for all of them (GQA). ``s``: float32 scratch ``[group, >= n]``; ``acc``:
    ``[group, hd]``."""
    hd = q.shape[2]
    n = keep.shape[1]
    group = q.shape[1] // keys_t.shape[1]
    h0 = g * group
    s[:, :n] = 0.0
    for i in range(hd):
        for hh in range(group):
            qi = q[b, h0 + hh, i] * scaling
            for j in range(n):
                s[hh, j] += qi * keys_t[b, g, i, j]
    for hh in range(group):
        h = h0 + hh
        mm = lse[b, h]
        for j in range(n):
            x = s[hh, j]
            if softcap > 0:
                x = np.tanh(x / softcap) * softcap
            if not keep[b, j]:
                x = -np.inf
            s[hh, j] = x
            mm = max(mm, x)
        if mm == -np.inf:  # nothing to attend to at all: the kernel's result stays (weights 0, out kept)
            for j in range(n):
                s[hh, j] = 0.0
            for i in range(hd):
                acc[hh, i] = out[b, h, i]
            continue
        w_pages = _exp(lse[b, h] - mm)  # 0 when the pages had no token
        total = w_pages
        for j in range(n):
            w = _exp(s[hh, j] - mm)
            s[hh, j] = w
            total += w
        inv = _F32(1.0) / total
        for j in range(n):
            s[hh, j] *= inv
        for i in range(hd):
            acc[hh, i] = out[b, h, i] * (w_pages * inv)
        lse[b, h] = mm + np.log(total)
    for j in range(n):
        for hh in range(group):
            w = s[hh, j]
            for i in range(hd):
                acc[hh, i] += w * values[b, g, j, i]
    for hh in range(group):
        for i in range(hd):
            out[b, h0 + hh, i] = acc[hh, i]


@njit(cache=True, nogil=True, fastmath=_FASTMATH)
def merge_window(q, keep, keys_t, values, scaling, softcap, out, lse):
    """Add the full-precision window's tokens (``oakenkv.store.paged``, ``residual``) to the result of the page
    attention in place, as :func:`merge_sinks` does for sink tokens: per row and query head the softmax over both
    parts, ``lse`` updated to match. Called with ``lse = -inf`` and ``out = 0`` when the pages hold no token.

    Args:
        q: float32 ``[B, Hq, hd]``, the kernel's queries (in the pages' key frame, which the window shares).
        keep: uint8 ``[B, n]``, 1 where the query may attend to window token ``j``.
        keys_t: float32 ``[B, H, hd, >= n]``: the window's keys, transposed (a query's scores are then sums of
            contiguous token rows, which vectorize); values: float32 ``[B, H, >= n, hd]``.
        scaling, softcap: as for the kernel. out: float32 ``[B, Hq, hd]``; lse: float32 ``[B, Hq]`` (both
            read and written).
    """
    group = q.shape[1] // keys_t.shape[1]
    s = np.empty((group, keep.shape[1]), np.float32)
    acc = np.empty((group, q.shape[2]), np.float32)
    for b in range(q.shape[0]):
        for g in range(keys_t.shape[1]):
            _merge_window_group(q, keep, keys_t, values, scaling, softcap, out, lse, b, g, s, acc)


@njit(cache=True, nogil=True, parallel=True, fastmath=_FASTMATH)
def merge_window_parallel(q, keep, keys_t, values, scaling, softcap, out, lse):
    """:func:`merge_window` with the (row, KV head) pairs spread over numba's threads."""
    hkv = keys_t.shape[1]
    group = q.shape[1] // hkv
    for w in prange(q.shape[0] * hkv):
        s = np.empty((group, keep.shape[1]), np.float32)
        acc = np.empty((group, q.shape[2]), np.float32)
        _merge_window_group(q, keep, keys_t, values, scaling, softcap, out, lse, w // hkv, w % hkv, s, acc)
