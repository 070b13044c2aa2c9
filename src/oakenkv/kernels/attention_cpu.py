"""Decode attention over packed Oaken pages (numba, CPU): one query token per row, flash-decoding style.

The kernel reads every stored token's dense record (six fp16 scales + nibbles) and sparse record (COO bytes)
straight from the page pool, dequantizes it into a ``D``-float scratch row with the codec's own single-row
decoder specialised for this loop (same float32 arithmetic as ``oakenkv.kernels.cpu.decode_row_into_lut``,
bit-exact with ``oakenkv.quant.dequantize``), and folds it
into an online softmax. It never materialises more than one key row and one value row per thread: the float
history is never rebuilt.

Parallelism: the tokens of each batch row are split into ``num_splits`` contiguous ranges (split-K, as in
flash-decoding); each (row, split) work item keeps its own running max, sum and accumulator per query head, and a
final pass combines them. Within a work item, tokens are processed in blocks of ``_BLOCK`` so that the
accumulator is rescaled once per block, not once per token.

What the kernels read is one layer's :class:`~oakenkv.format.LayerView` (built by
``oakenkv.store.PagedKVStore.layer_view``; its docstring has the table layout), passed as the kernels' trailing
arguments (``*view``: numba dispatches plain arrays and integers fastest) and rebuilt as the named tuple inside.
Page ids of -1 (``pages.EVICTED``: a sliding window released them) are never dereferenced: masked tokens are
skipped without reading their pages, and an unmasked token on a released page stops the row with ``ERR_EVICTED``.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from oakenkv.format import (
    ADVANCE_CONTINUE,
    CHUNK_SIZE,
    COO_GROUP_BIT,
    COO_INDEX_MASK,
    ERR_ESCAPE_TRUNCATED,
    ERR_EVICTED,
    ERR_OK,
    ERR_POSITION_RANGE,
    NUM_SCALES,
    LayerView,
)
from oakenkv.kernels.numba_helpers import f16_widen_int

#: Tokens per softmax block inside a work item.
_BLOCK = 32

_F32 = np.float32


@njit(cache=True, nogil=True)
def _sparse_start(first, lens, t0):
    """Walker state ``(page index, byte offset)`` of a stream's sparse records at token ``t0``."""
    sp = -1
    for i in range(first.shape[0]):
        if first[i] <= t0:
            sp = i
        else:
            break
    off = 0
    if sp >= 0:
        for t in range(first[sp], t0):
            off += lens[t]
    return sp, off


@njit(cache=True, nogil=True)
def _decode_token(
    pool,
    page_size,
    dense_pages,
    rpp,
    rec,
    sb,
    sc_pages,
    sc_first,
    lens,
    t,
    sp,
    off,
    thr,
    ib,
    ob,
    sc,
    out,
    codes,
):
    """Decode token ``t`` of one stream into float32 ``out[D]``; returns ``(status, sp, off)`` (advanced walker).

    ``sc`` (float32 ``[6]``) and ``codes`` (uint8 ``[D]``) are scratch. The arithmetic is exactly
    ``oakenkv.kernels.cpu.fill_lut`` / ``decode_row_into_lut`` (and so the reference ``quant.dequantize``):
    ``v = lo + code * step`` in float32, then the threshold of the value's side. It is laid out for the attention
    loop, where one row is ~200 values and the per-row work dominates: the nibbles are first unpacked into
    ``codes`` and the values then computed from them (two simple loops that LLVM vectorizes, faster than a
    table look-up per nibble: docs/perf-notes.md), and each COO entry's value is computed for both outlier groups and
    selected without a branch (the group of consecutive entries is random, a branch mispredicts). This function
    is compiled without fastmath (no FMA contraction), so the numbers stay bit-exact even when inlined into the
    fastmath attention kernel.
    """
    page = np.int64(dense_pages[t // rpp])
    if page < 0:  # released by a sliding window (pages.EVICTED): the mask should have hidden this token
        return ERR_EVICTED, sp, off
    base = page * page_size + (t % rpp) * rec
    for i in range(NUM_SCALES):  # fp16 scales, little-endian (the page-record layout of oakenkv.format)
        bits = np.int64(pool[base + 2 * i]) | (np.int64(pool[base + 2 * i + 1]) << 8)
        sc[i] = f16_widen_int(bits)
    to_lo, ti_lo, ti_hi, to_hi = thr[0], thr[1], thr[2], thr[3]
    lo = sc[0]
    step = (sc[1] - lo) / _F32(15.0)
    d = out.shape[0]
    dense0 = base + sb
    # The middle value of code c is computed, not looked up: the same float32 operations as fill_lut's table
    # entry (lo + c * step, then the threshold of its side), but branch-free and gather-free, so LLVM
    # vectorizes both loops (unpack the nibbles, then compute the values).
    zero = _F32(0.0)
    half = d >> 1
    src = pool[dense0 : dense0 + half]
    for j in range(half):
        b = src[j]
        codes[2 * j] = b & np.uint8(15)
        codes[2 * j + 1] = b >> np.uint8(4)
    if d & 1:
        codes[d - 1] = pool[dense0 + half] & np.uint8(15)
    for j in range(d):
        v = lo + _F32(codes[j]) * step
        out[j] = v + (ti_hi if v > zero else ti_lo)
    n = np.int64(lens[t])
    if n == 0:
        return ERR_OK, sp, off
    while sp + 1 < sc_first.shape[0] and sc_first[sp + 1] <= t:
        sp += 1
        off = 0
    spage = np.int64(sc_pages[sp])
    if spage < 0:
        return ERR_EVICTED, sp, off
    s0 = spage * page_size + off
    off += n
    in_lo = sc[2]
    in_step = (sc[3] - in_lo) / _F32((1 << ib) - 1)
    out_lo = sc[4]
    out_step = (sc[5] - out_lo) / _F32((1 << ob) - 1)
    # The COO walk of oakenkv.codec (module docstring there): implicit chunks, escapes for the rare jumps.
    # Indexing a slice with unsigned integers spares numba's negative-index checks on this serial path
    # (docs/perf-notes.md).
    coo = pool[s0 : s0 + n]
    c, p, prev = 0, -1, 0
    j = 0
    while j < n:
        e = np.int64(coo[np.uint64(j)])
        j += 1
        if e == prev:
            k = 0
            while True:
                if j >= n:
                    return ERR_ESCAPE_TRUNCATED, sp, off
                a = np.int64(coo[np.uint64(j)])
                j += 1
                k += a
                if a != ADVANCE_CONTINUE:
                    break
            c += k
            p = -1
            prev = -1
            continue
        i = e & COO_INDEX_MASK
        c += np.int64(i <= p)
        pos = c * CHUNK_SIZE + i
        if pos >= d:
            return ERR_POSITION_RANGE, sp, off
        upos = np.uint64(pos)
        cf = _F32(np.int64(codes[upos]) | ((e >> 7) << 4))
        vi = in_lo + cf * in_step
        vo = out_lo + cf * out_step
        vo = vo + (to_hi if vo > zero else to_lo)
        out[upos] = vo if (e & COO_GROUP_BIT) else vi
        p = i
        prev = e
    return ERR_OK, sp, off


@njit(cache=True, nogil=True)
def _skip_token(sc_first, lens, t, sp, off):
    """Advance a sparse walker past token ``t`` without decoding it (masked tokens)."""
    n = np.int64(lens[t])
    if n > 0:
        while sp + 1 < sc_first.shape[0] and sc_first[sp + 1] <= t:
            sp += 1
            off = 0
        off += n
    return sp, off


@njit(cache=True, nogil=True, fastmath=True)
def _work_item(q, keep, scaling, softcap, num_splits, w, part_m, part_l, part_acc, view):
    """Work item ``w`` of :func:`packed_decode_attention`: row ``b = w // num_splits``, token range
    ``s = w % num_splits``, over the layer's ``view`` (a :class:`LayerView`). Writes its running max, sum and
    accumulator per query head to ``part_*[b, s]``; returns ``ERR_OK`` or the first codec error code met."""
    pool, page_size, rec, sb = view.pool, view.page_size, view.record_size, view.scale_bytes
    thr, ib, ob, num_kv_heads = view.thresholds, view.inner_bits, view.outer_bits, view.num_kv_heads
    dense_pages, sparse_lengths = view.dense_pages, view.sparse_lengths
    sparse_pages, sparse_first, sparse_starts = view.sparse_pages, view.sparse_first, view.sparse_starts
    hq_n, hd = q.shape[1], q.shape[2]
    t_n = sparse_lengths.shape[2]
    d = num_kv_heads * hd
    group = hq_n // num_kv_heads
    rpp = page_size // rec
    b = w // num_splits
    s = w % num_splits
    t0 = s * t_n // num_splits
    t1 = (s + 1) * t_n // num_splits
    sc = np.empty(NUM_SCALES, np.float32)
    codes = np.empty(d, np.uint8)
    krow = np.empty(d, np.float32)
    vrow = np.empty(d, np.float32)
    scores = np.empty((hq_n, _BLOCK), np.float32)
    m = np.full(hq_n, -np.inf, dtype=np.float32)
    ell = np.zeros(hq_n, dtype=np.float32)
    acc = np.zeros((hq_n, hd), dtype=np.float32)
    kp0, kp1 = sparse_starts[2 * b], sparse_starts[2 * b + 1]
    vp0, vp1 = sparse_starts[2 * b + 1], sparse_starts[2 * b + 2]
    k_pages, k_first = sparse_pages[kp0:kp1], sparse_first[kp0:kp1]
    v_pages, v_first = sparse_pages[vp0:vp1], sparse_first[vp0:vp1]
    k_len, v_len = sparse_lengths[b, 0], sparse_lengths[b, 1]
    k_dense, v_dense = dense_pages[b, 0], dense_pages[b, 1]
    ksp, koff = _sparse_start(k_first, k_len, t0)
    vsp, voff = _sparse_start(v_first, v_len, t0)
    for tb in range(t0, t1, _BLOCK):
        te = min(tb + _BLOCK, t1)
        # Scores of the block.
        bmax = np.full(hq_n, -np.inf, dtype=np.float32)
        for t in range(tb, te):
            j = t - tb
            if keep[b, t] == 0:
                ksp, koff = _skip_token(k_first, k_len, t, ksp, koff)
                for h in range(hq_n):
                    scores[h, j] = -np.inf
                continue
            st, ksp, koff = _decode_token(
                pool,
                page_size,
                k_dense,
                rpp,
                rec,
                sb,
                k_pages,
                k_first,
                k_len,
                t,
                ksp,
                koff,
                thr[0],
                ib,
                ob,
                sc,
                krow,
                codes,
            )
            if st != ERR_OK:
                return st  # the first error ends the item: a walker past a bad record would misread what follows
            for h in range(hq_n):
                kb = (h // group) * hd
                # 1-D views keep the inner loops unit-stride and alias-free, so LLVM vectorises them
                # (faster than indexing the 3-D arrays directly: docs/perf-notes.md).
                dot = _F32(0.0)
                qv = q[b, h]
                kv = krow[kb : kb + hd]
                for i in range(hd):
                    dot += qv[i] * kv[i]
                x = dot * scaling
                if softcap > 0:
                    x = np.tanh(x / softcap) * softcap
                scores[h, j] = x
                if x > bmax[h]:
                    bmax[h] = x
        # Rescale the running sums to the new maximum once per block.
        for h in range(hq_n):
            if bmax[h] > m[h]:
                if m[h] > -np.inf:
                    corr = np.exp(m[h] - bmax[h])
                    ell[h] *= corr
                    for i in range(hd):
                        acc[h, i] *= corr
                m[h] = bmax[h]
        # Values of the block.
        for t in range(tb, te):
            j = t - tb
            if keep[b, t] == 0:
                vsp, voff = _skip_token(v_first, v_len, t, vsp, voff)
                continue
            st, vsp, voff = _decode_token(
                pool,
                page_size,
                v_dense,
                rpp,
                rec,
                sb,
                v_pages,
                v_first,
                v_len,
                t,
                vsp,
                voff,
                thr[1],
                ib,
                ob,
                sc,
                vrow,
                codes,
            )
            if st != ERR_OK:
                return st  # the first error ends the item: a walker past a bad record would misread what follows
            for h in range(hq_n):
                p = np.exp(scores[h, j] - m[h])
                ell[h] += p
                vb = (h // group) * hd
                av = acc[h]
                vv = vrow[vb : vb + hd]
                for i in range(hd):
                    av[i] += p * vv[i]
    for h in range(hq_n):
        part_m[b, s, h] = m[h]
        part_l[b, s, h] = ell[h]
        for i in range(hd):
            part_acc[b, s, h, i] = acc[h, i]
    return ERR_OK


@njit(cache=True, nogil=True, fastmath=True)
def _combine(part_m, part_l, part_acc, out):
    """Combine the splits of each row: ``out[b, h] = sum_s acc_s e^(m_s - m) / sum_s l_s e^(m_s - m)``."""
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
                for i in range(hd):
                    out[b, h, i] /= total


@njit(cache=True, nogil=True, parallel=True, fastmath=True)
def packed_decode_attention(q, keep, scaling, softcap, num_splits, out, status, *view):
    """Attention of one query token per row over ``T`` packed tokens, multi-threaded over (row, split) work
    items: for long contexts.

    Args:
        q: float32 ``[B, Hq, hd]`` query (post-RoPE), ``Hq`` a multiple of ``view.num_kv_heads`` (GQA).
        keep: uint8 ``[B, T]``: 1 where the query may attend to the token (mask), 0 to skip it.
        scaling: softmax scale (``hd ** -0.5`` or the model's); softcap: logit soft cap, 0 for none.
        num_splits: token ranges per row processed in parallel.
        out: float32 ``[B, Hq, hd]``, written. status: int64 ``[B * num_splits]``, 0 or a codec error code.
        view: the fields of the layer's :class:`~oakenkv.format.LayerView`, in order (call with ``*view``).
    """
    lv = LayerView(*view)
    b_n, hq_n, hd = q.shape
    part_m = np.full((b_n, num_splits, hq_n), -np.inf, dtype=np.float32)
    part_l = np.zeros((b_n, num_splits, hq_n), dtype=np.float32)
    part_acc = np.zeros((b_n, num_splits, hq_n, hd), dtype=np.float32)
    for w in prange(b_n * num_splits):
        status[w] = _work_item(q, keep, scaling, softcap, num_splits, w, part_m, part_l, part_acc, lv)
    _combine(part_m, part_l, part_acc, out)


@njit(cache=True, nogil=True, fastmath=True)
def packed_decode_attention_serial(q, keep, scaling, softcap, num_splits, out, status, *view):
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
    _combine(part_m, part_l, part_acc, out)
