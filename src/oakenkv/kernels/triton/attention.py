"""Paged decode attention in Triton (flash-decoding) over a layer's dense and sparse pages.

One query token per sequence and query head; grouped-query attention (``Hq`` a multiple of the KV heads ``H``).
Grid: ``(B * H, splits)``. Program ``(b, h, s)`` takes the ``G = Hq / H`` query heads of KV head ``h`` and the
``s``-th range of tokens, and walks it in tiles of ``BT`` tokens. Per tile and kind (keys, then values):

1. dense: the tile's records (``dense_pages[t // rpp] * page_size + (t % rpp) * rec``): six scales, and the
   nibbles of head ``h`` (``hd`` values from value ``h * hd``), every value dequantized as a middle code;
2. sparse: each token's COO stream (at ``sparse_addr[t]``, ``sparse_lengths[t]`` bytes) is read a block of bytes
   at a time for all tokens of the tile at once (:mod:`oakenkv.kernels.triton.coo`: roles by a state-map scan,
   chunks by a prefix sum); the entries that fall in head ``h`` mark their slot in a small per-program scratch
   tile (``[BT, hd]`` bytes in global memory, written and read between CTA barriers: a scatter has no
   register form), and those slots take their inner or outer value;
3. scores ``q . k`` for the ``G`` heads (times ``scaling``; optional soft cap), masked tokens at ``-inf``, an
   online softmax (running max and sum per head), and the values accumulated.

Nothing larger than a tile is materialized. Each program writes its running max, sum and accumulator; a second
kernel combines the splits by log-sum-exp. Masks (padding, sliding windows) come as ``keep [B, T]``; tiles with
no kept token are skipped without reading their pages, so evicted pages (``-1``) of a sliding window are never
read; an unmasked token on an evicted page is reported (``ERR_EVICTED``), as the CPU kernel does.

Numbers: dequantization is the reference's float32 arithmetic (compiled with ``enable_fp_fusion=False``, so the
keys and values are the reference's floats); the dot products and the softmax use ``tl.exp`` and a tree order of
summation, so the result matches float attention over the dequantized cache to float32 rounding (tested at
``rtol 2e-5``), like the CPU kernel.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from oakenkv.kernels.triton import _oaken as F
from oakenkv.kernels.triton.coo import coo_block, coo_end_error, flags_to_error
from oakenkv.kernels.triton.decode import load_scales, middle_values, outlier_values
from oakenkv.kernels.triton.interpret import install
from oakenkv.kernels.triton.view import DeviceLayerView, view_from_store

install()  # under TRITON_INTERPRET=1: the interpreter's helper calls without a redundant patch each

#: Tokens per tile (default; ``tile_tokens``).
TILE_TOKENS = 16
#: log2 of the COO bytes read per token and step of the walk. 32, not the decode kernel's 64: with 64 the kernel
#: spills (ptxas for sm_90a, 8 warps: 255 registers and 232 bytes of spill stores at 16 tokens a tile; with 32:
#: none; ``benchmarks/triton_sm90_check.py``).
SPARSE_BLOCK_LOG = 5
#: Warps per program (default; ``num_warps``).
NUM_WARPS = 8
#: Smallest token range worth a split of its own (flash-decoding).
MIN_SPLIT_TOKENS = 128


@triton.jit
def _tile_values(
    dpool, spool, pages_row, addr_row, len_row, t, use, h, thr_ptr, scratch, page_size, rec, rpp, HD, D,
    BT: tl.constexpr, HD_P: tl.constexpr, SB: tl.constexpr, INNER_BITS: tl.constexpr, OUTER_BITS: tl.constexpr,
    SBLK: tl.constexpr, SBLK_LOG: tl.constexpr,
):  # fmt: skip
    """float32 ``[BT, HD_P]`` keys or values of head ``h`` for tokens ``t`` (``use``: the kept ones), and int32
    ``[BT]`` error flags of :mod:`~oakenkv.kernels.triton.coo` (32: an evicted page)."""
    to_lo = tl.load(thr_ptr)
    ti_lo = tl.load(thr_ptr + 1)
    ti_hi = tl.load(thr_ptr + 2)
    to_hi = tl.load(thr_ptr + 3)
    pg = tl.load(pages_row + t // rpp, mask=use, other=-1)
    flags = tl.where(use & (pg < 0), 32, 0)
    ok = use & (pg >= 0)
    base = pg.to(tl.int64) * page_size + (t % rpp).to(tl.int64) * rec
    s0, s1, s2, s3, s4, s5 = load_scales(dpool, base, ok, SB)
    m_step = tl.math.div_rn(s1 - s0, F.MIDDLE_TOP)[:, None]
    i_step = tl.math.div_rn(s3 - s2, (1 << INNER_BITS) - 1.0)[:, None]
    o_step = tl.math.div_rn(s5 - s4, (1 << OUTER_BITS) - 1.0)[:, None]
    col = tl.arange(0, HD_P)[None, :]
    cm = ok[:, None] & (col < HD)
    vpos = h * HD + col  # the head's values in the row
    byte = tl.load(dpool + base[:, None] + SB + (vpos >> 1), mask=cm, other=0).to(tl.int32)
    nib = (byte >> ((vpos & 1) * F.SLOT_BITS)) & F.SLOT_MASK
    # the head's outliers: mark their slots in the scratch tile (entry byte's group and fifth bit, | 1)
    tok = tl.arange(0, BT)[:, None]
    sc_ptr = scratch + tok * HD_P + col
    tl.debug_barrier()  # the previous tile's reads of the scratch are done
    tl.store(sc_ptr, tl.zeros([BT, HD_P], tl.uint8))
    tl.debug_barrier()
    addr = tl.load(addr_row + t, mask=ok, other=0)
    length = tl.load(len_row + t, mask=ok, other=0).to(tl.int32)
    flags |= tl.where(ok & (length > 0) & (addr < 0), 32, 0)
    length = tl.where(addr < 0, 0, length)
    state = tl.zeros([BT], tl.int32)
    chunk = tl.zeros([BT], tl.int32)
    maxlen = tl.max(length, axis=0)
    INNER5: tl.constexpr = INNER_BITS > F.SLOT_BITS  # 5-bit codes: a fifth bit in the entry
    OUTER5: tl.constexpr = OUTER_BITS > F.SLOT_BITS
    jb = 0
    while jb < maxlen:
        entry, pos, e, state, chunk, err = coo_block(
            spool, addr, length, jb, state, chunk, D, SBLK, SBLK_LOG, INNER5, OUTER5
        )
        flags |= err
        li = pos - h * HD
        mine = entry & (li >= 0) & (li < HD)
        tl.store(scratch + tok * HD_P + li, ((e & (F.GROUP_BIT | F.CODE_BIT4)) | 1).to(tl.uint8), mask=mine)
        jb += SBLK
    flags |= coo_end_error(state, length)
    tl.debug_barrier()  # the scatter is visible to every thread of the program
    info = tl.load(sc_ptr).to(tl.int32)
    code5 = nib | (((info >> F.CODE_BIT4_SHIFT) & 1) << F.SLOT_BITS)
    w = outlier_values(code5, (info & F.GROUP_BIT) != 0, s2[:, None], i_step, s4[:, None], o_step, to_lo, to_hi)
    v = middle_values(nib, s0[:, None], m_step, ti_lo, ti_hi)
    v = tl.where((info & 1) != 0, w, v)
    return tl.where(cm, v, 0.0), flags


@triton.jit
def _or_all(flags):
    """Bitwise OR of an int32 vector's elements (each flag bit reduced with a max)."""
    r = tl.max(flags & 1, axis=0)
    r |= tl.max(flags & 2, axis=0)
    r |= tl.max(flags & 4, axis=0)
    r |= tl.max(flags & 8, axis=0)
    r |= tl.max(flags & 16, axis=0)
    r |= tl.max(flags & 32, axis=0)
    return r


@triton.jit
def _attn_kernel(
    q_ptr, sq_b, sq_h,  # [B, Hq, hd] query (float), unit stride over hd
    dpool, spool,  # uint8 dense and sparse pages, flat
    pages_ptr, sp_b, sp_k,  # int32 [B, 2, NP] dense page ids (strides of b and kind)
    addr_ptr, len_ptr, sa_b, sa_k,  # int64 / int32 [B, 2, T] sparse addresses and lengths (same strides)
    keep_ptr, sk_b,  # uint8 [B, T]: 1 = attend
    thr_ptr,  # float32 [2, 4]: key and value thresholds
    scratch_ptr,  # uint8 [programs, BT, HD_P]
    pm_ptr, pl_ptr, pacc_ptr,  # float32 [B, Hq, S], [B, Hq, S], [B, Hq, S, HD_P]: partial max, sum, acc
    status_ptr, status_stride,  # int32: each program's error code is max-ed into status_ptr[prog * stride]
    T, H, Hq, HD, D, page_size, rec, rpp, scaling, softcap, split_tokens, S,
    G: tl.constexpr, G_P: tl.constexpr, HD_P: tl.constexpr, BT: tl.constexpr, SB: tl.constexpr,
    INNER_BITS: tl.constexpr, OUTER_BITS: tl.constexpr, SBLK: tl.constexpr, SBLK_LOG: tl.constexpr,
    SOFTCAP: tl.constexpr, E_POS: tl.constexpr, E_ZERO: tl.constexpr, E_FIFTH: tl.constexpr,
    E_TRUNC: tl.constexpr, E_NOENTRY: tl.constexpr, E_EVICTED: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0)
    s = tl.program_id(1)
    b = bh // H
    h = bh % H
    prog = bh * S + s
    scratch = scratch_ptr + prog.to(tl.int64) * (BT * HD_P)
    g = tl.arange(0, G_P)
    gm = g < G
    col = tl.arange(0, HD_P)
    hq = h * G + g
    q = tl.load(q_ptr + b * sq_b + hq[:, None] * sq_h + col[None, :], mask=gm[:, None] & (col[None, :] < HD),
                other=0.0).to(tl.float32)  # fmt: skip
    m = tl.full([G_P], -float("inf"), tl.float32)
    ell = tl.zeros([G_P], tl.float32)
    acc = tl.zeros([G_P, HD_P], tl.float32)
    flags = tl.zeros([BT], tl.int32)
    ts = s * split_tokens
    te = tl.minimum(T, ts + split_tokens)
    k_pages = pages_ptr + b * sp_b
    v_pages = k_pages + sp_k
    k_addr = addr_ptr + b * sa_b
    v_addr = k_addr + sa_k
    k_len = len_ptr + b * sa_b
    v_len = k_len + sa_k
    t0 = ts
    while t0 < te:
        t = t0 + tl.arange(0, BT)
        use = (t < te) & (tl.load(keep_ptr + b * sk_b + t, mask=t < te, other=0) != 0)
        if tl.max(use.to(tl.int32), axis=0) > 0:
            k, kf = _tile_values(dpool, spool, k_pages, k_addr, k_len, t, use, h, thr_ptr, scratch, page_size, rec,
                                 rpp, HD, D, BT, HD_P, SB, INNER_BITS, OUTER_BITS, SBLK, SBLK_LOG)  # fmt: skip
            x = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scaling  # [G_P, BT]
            if SOFTCAP:
                y = x / softcap
                x = softcap * (1.0 - 2.0 / (tl.exp(2.0 * y) + 1.0))  # tanh(y), saturating at +-1
            x = tl.where(use[None, :], x, -float("inf"))
            m_new = tl.maximum(m, tl.max(x, axis=1))
            m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
            alpha = tl.exp(m - m_safe)
            p = tl.exp(x - m_safe[:, None])
            v, vf = _tile_values(dpool, spool, v_pages, v_addr, v_len, t, use, h, thr_ptr + 4, scratch, page_size,
                                 rec, rpp, HD, D, BT, HD_P, SB, INNER_BITS, OUTER_BITS, SBLK, SBLK_LOG)  # fmt: skip
            ell = ell * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m = m_new
            flags |= kf | vf
        t0 += BT
    out = (b * Hq + hq) * S + s
    tl.store(pm_ptr + out, m, mask=gm)
    tl.store(pl_ptr + out, ell, mask=gm)
    tl.store(pacc_ptr + out[:, None] * HD_P + col[None, :], acc, mask=gm[:, None])
    allf = _or_all(flags)
    code = flags_to_error(allf, E_POS, E_ZERO, E_FIFTH, E_TRUNC, E_NOENTRY)
    tl.atomic_max(status_ptr + prog * status_stride, tl.where((allf & 32) != 0, E_EVICTED, code))


@triton.jit
def _combine_kernel(pm_ptr, pl_ptr, pacc_ptr, out_ptr, lse_ptr, N, S, HD, R: tl.constexpr, S_P: tl.constexpr,
                    HD_P: tl.constexpr):  # fmt: skip
    """``out[b, hq] = sum_s acc_s e^(m_s - M) / sum_s l_s e^(m_s - M)``, and the log-sum-exp of the scores
    ``M + log(sum_s l_s e^(m_s - M))`` (``-inf``), for merging other tokens' attention; zeros where every token
    was masked. ``R`` rows ``b * Hq + hq`` per program (of ``N``)."""
    row = tl.program_id(0).to(tl.int64) * R + tl.arange(0, R)  # b * Hq + hq
    rm = row < N
    si = tl.arange(0, S_P)
    sm = rm[:, None] & (si < S)[None, :]
    col = tl.arange(0, HD_P)
    ps = row[:, None] * S + si[None, :]
    m = tl.load(pm_ptr + ps, mask=sm, other=-float("inf"))
    ell = tl.load(pl_ptr + ps, mask=sm, other=0.0)
    acc = tl.load(pacc_ptr + ps[:, :, None] * HD_P + col[None, None, :], mask=sm[:, :, None], other=0.0)
    mm = tl.max(m, axis=1)
    w = tl.where(m == -float("inf"), 0.0, tl.exp(m - tl.where(mm == -float("inf"), 0.0, mm)[:, None]))
    total = tl.sum(ell * w, axis=1)
    o = tl.sum(acc * w[:, :, None], axis=1)
    has = total > 0.0
    o = tl.where(has[:, None], o / tl.where(has, total, 1.0)[:, None], 0.0)
    tl.store(out_ptr + row[:, None] * HD + col[None, :], o, mask=rm[:, None] & (col < HD)[None, :])
    tl.store(lse_ptr + row, tl.where(has, mm + tl.log(tl.where(has, total, 1.0)), -float("inf")), mask=rm)


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def merged_view(view: DeviceLayerView) -> DeviceLayerView:
    """The view as one KV head of ``D = H * hd`` values (``merge_heads``: every head's keys and values in one
    program's tiles; the same pages and bytes)."""
    return dataclasses.replace(view, num_kv_heads=1, head_dim=view.dim)


def spread_heads(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Queries ``[B, Hq, ..., hd]`` as block-diagonal queries ``[B, Hq, ..., H * hd]`` over a :func:`merged_view`:
    query head ``j`` keeps its values in the columns of its KV head ``j // G`` and zeros elsewhere, so that its dot
    product with a whole row is its dot product with its head's part (the other products are exact zeros)."""
    b, hq, hd = q.shape[0], q.shape[1], q.shape[-1]
    h, g = num_kv_heads, hq // num_kv_heads
    mid = q.shape[2:-1]
    out = torch.zeros((b, h, g, *mid, h, hd), dtype=q.dtype, device=q.device)
    qh = q.reshape(b, h, g, *mid, hd)
    for k in range(h):
        out[:, k, ..., k, :] = qh[:, k]
    return out.reshape(b, hq, *mid, h * hd)


def own_heads(out: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Attention outputs ``[B, Hq, ..., H * hd]`` over a :func:`merged_view` back to ``[B, Hq, ..., hd]``: query
    head ``j``'s columns of its KV head (the rest weigh values of other heads, not its output)."""
    b, hq, d = out.shape[0], out.shape[1], out.shape[-1]
    h, g, hd = num_kv_heads, hq // num_kv_heads, d // num_kv_heads
    mid = out.shape[2:-1]
    oh = out.reshape(b, h, g, *mid, h, hd)
    return torch.stack([oh[:, k, ..., k, :] for k in range(h)], dim=1).reshape(b, hq, *mid, hd)


def num_splits_for(batch: int, kv_heads: int, tokens: int, programs: int = 528) -> int:
    """Token ranges per (sequence, KV head): enough programs to fill the device (``programs``, default four per
    multiprocessor of an H100/H200: a memory-bound kernel wants many loads in flight), each at least
    ``MIN_SPLIT_TOKENS`` tokens. A first guess, to be tuned on the device (``benchmarks/gpu_check.py``)."""
    want = max(1, -(-programs // max(1, batch * kv_heads)))
    return int(max(1, min(want, tokens // MIN_SPLIT_TOKENS)))


def paged_decode_attention(
    q: torch.Tensor,
    view: DeviceLayerView,
    keep: torch.Tensor | None,
    scaling: float,
    softcap: float | None = None,
    num_splits: int | None = None,
    check: bool = True,
    exact_dequant: bool = True,
    num_warps: int = NUM_WARPS,
    tile_tokens: int = TILE_TOKENS,
    sparse_block_log: int = SPARSE_BLOCK_LOG,
) -> torch.Tensor:
    """Decode attention of one query token per sequence over a layer's pages.

    Args:
        q: ``[B, Hq, hd]`` float query (post-RoPE), on the view's device; ``Hq`` a multiple of the KV heads.
        view: the layer's :class:`~oakenkv.kernels.triton.view.DeviceLayerView` (fp16 or fp32 scales), e.g.
            ``view.view_from_store(store, layer, device)``.
        keep: uint8/bool ``[B, T]`` (1 = attend: padding and sliding-window masks), or None (attend to all).
        scaling: the softmax scale; softcap: logit soft cap (Gemma 2 style) or None.
        num_splits: token ranges per (sequence, KV head); default :func:`num_splits_for`.
        check: raise :class:`~oakenkv.format.layout.CorruptDataError` on a kernel error code (a device sync).
        exact_dequant: compile without FMA contraction, so that the keys and values are the reference's floats;
            False lets the compiler fuse ``lo + code * step`` and the dot products (each dequantized value then
            within one rounding of the reference's; whether it is faster is for ``benchmarks/gpu_check.sh``).
        num_warps, tile_tokens: warps per program and tokens per tile (a power of two): tuning knobs, as
            ``num_splits`` (``benchmarks/gpu_check.py``'s tuning stage times them).
        sparse_block_log: log2 of the COO bytes read per token and step of the walk (``SPARSE_BLOCK_LOG``; larger
            under the interpreter, ``interpret.store_blocks``).

    Returns:
        float32 ``[B, Hq, hd]``.
    """
    out, _, status = paged_decode_attention_parts(
        q, view, keep, scaling, softcap, num_splits, exact_dequant, num_warps, tile_tokens,
        sparse_block_log=sparse_block_log,
    )  # fmt: skip
    if check:
        raise_on_status(status)
    return out


def raise_on_status(status: torch.Tensor) -> None:
    """Raise :class:`~oakenkv.format.layout.CorruptDataError` for the first non-zero error code in ``status``
    (int32, the kernels' ``ERR_*`` codes; a device-to-host copy)."""
    flat = status.flatten()
    bad = torch.nonzero(flat)
    if bad.numel():
        raise F.CorruptDataError(f"{F.ERROR_MESSAGES[int(flat[bad[0, 0]])]} (packed KV pages)")


def paged_decode_attention_parts(
    q: torch.Tensor,
    view: DeviceLayerView,
    keep: torch.Tensor | None,
    scaling: float,
    softcap: float | None = None,
    num_splits: int | None = None,
    exact_dequant: bool = True,
    num_warps: int = NUM_WARPS,
    tile_tokens: int = TILE_TOKENS,
    status: torch.Tensor | None = None,
    sparse_block_log: int = SPARSE_BLOCK_LOG,
    merge_heads: bool = False,
    combine_rows: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`paged_decode_attention` without the error check, and with what merging it with other tokens takes.

    Args:
        status: int32 ``[1]`` on the device, or None: every program's error code is max-ed into it (a store
            accumulates one step's codes and reads them once, instead of a device-to-host copy per layer); None:
            a fresh tensor of one code per program.
        sparse_block_log: as :func:`paged_decode_attention`'s.
        merge_heads: attend over all KV heads in one program per row and split (:func:`merged_view` and
            block-diagonal queries, :func:`spread_heads`): the same keys and values, scores summed over the head's
            products and exact zeros (another order: float32 rounding). For the interpreter
            (``interpret.store_blocks``), whose cost is per program and operation; on a GPU it would waste work.
        combine_rows: rows ``(b, hq)`` per program of the kernel that combines the splits (a power of two; one on a
            GPU, more under the interpreter).

    Returns:
        ``(out, lse, status)``: float32 ``[B, Hq, hd]``, float32 ``[B, Hq]`` the log-sum-exp of the scaled (and
        capped) scores over the kept tokens (``-inf`` where none is kept), and the status tensor.
    """
    b, hq, hd = q.shape
    h, t_n = view.num_kv_heads, view.num_tokens
    if hd != view.head_dim or hq % h or b != view.batch_size:
        raise ValueError(
            f"query [B={b}, Hq={hq}, hd={hd}] does not fit the view (batch {view.batch_size}, {h} KV heads, "
            f"head_dim {view.head_dim})"
        )
    if merge_heads and h > 1:
        out, lse, status = paged_decode_attention_parts(
            spread_heads(q, h), merged_view(view), keep, scaling, softcap, num_splits, exact_dequant, num_warps,
            tile_tokens, status, sparse_block_log, combine_rows=combine_rows,
        )  # fmt: skip
        return own_heads(out, h), lse, status
    dev = q.device
    if q.stride(2) != 1:
        q = q.contiguous()
    if keep is None:
        keep = torch.ones((b, max(t_n, 1)), dtype=torch.uint8, device=dev)
    elif tuple(keep.shape) != (b, t_n):
        raise ValueError(f"keep must be [B, T] = [{b}, {t_n}], got {tuple(keep.shape)}")
    if keep.dtype != torch.uint8 or keep.device != dev or keep.stride(1) != 1:
        keep = keep.to(device=dev, dtype=torch.uint8).contiguous()
    splits = num_splits or num_splits_for(b, h, t_n)
    splits = max(1, min(splits, max(1, t_n)))
    split_tokens = -(-max(t_n, 1) // splits)
    split_tokens = -(-split_tokens // tile_tokens) * tile_tokens
    splits = -(-max(t_n, 1) // split_tokens)
    hd_p = _pow2(hd)
    pm = torch.empty((b, hq, splits), dtype=torch.float32, device=dev)
    pl = torch.empty_like(pm)
    pacc = torch.empty((b, hq, splits, hd_p), dtype=torch.float32, device=dev)
    if status is None:
        status, status_stride = torch.zeros(b * h * splits, dtype=torch.int32, device=dev), 1
    else:
        status_stride = 0
    scratch = torch.empty(b * h * splits * tile_tokens * hd_p, dtype=torch.uint8, device=dev)
    pages, addr, lens = view.dense_pages, view.sparse_addr, view.sparse_lengths
    if addr.stride() != lens.stride() or addr.stride(2) != 1 or pages.stride(2) != 1:
        raise ValueError(
            "sparse_addr and sparse_lengths must share strides, with unit stride over tokens (as dense_pages)"
        )
    F.fp16_scales(view.scale_bytes)  # fp16 or fp32 scales, nothing else
    if t_n:
        group = hq // h
        thr = view.thresholds
        if thr.dtype != torch.float32 or not thr.is_contiguous():
            thr = thr.to(torch.float32).contiguous()
        _attn_kernel[(b * h, splits)](
            q, q.stride(0), q.stride(1), view.dense_pool, view.sparse_pool,
            pages, pages.stride(0), pages.stride(1), addr, lens, addr.stride(0), addr.stride(1),
            keep, keep.stride(0), thr, scratch, pm, pl, pacc, status, status_stride,
            t_n, h, hq, hd, view.dim, view.page_size, view.record_size, view.records_per_page, float(scaling),
            float(softcap or 1.0), split_tokens, splits,
            G=group, G_P=_pow2(group), HD_P=hd_p, BT=tile_tokens, SB=view.scale_bytes,
            INNER_BITS=view.inner_bits, OUTER_BITS=view.outer_bits, SBLK=1 << sparse_block_log,
            SBLK_LOG=sparse_block_log,
            SOFTCAP=bool(softcap), E_POS=F.ERR_POSITION_RANGE, E_ZERO=F.ERR_ZERO_ADVANCE, E_FIFTH=F.ERR_FIFTH_BIT,
            E_TRUNC=F.ERR_ESCAPE_TRUNCATED, E_NOENTRY=F.ERR_ESCAPE_NO_ENTRY, E_EVICTED=F.ERR_EVICTED,
            num_warps=num_warps, enable_fp_fusion=not exact_dequant,
        )  # fmt: skip
    else:
        pm.fill_(-float("inf"))
        pl.zero_()
        pacc.zero_()
    out = torch.empty((b, hq, hd), dtype=torch.float32, device=dev)
    lse = torch.empty((b, hq), dtype=torch.float32, device=dev)
    rows = b * hq
    r = min(_pow2(rows), combine_rows)
    _combine_kernel[(triton.cdiv(rows, r),)](pm, pl, pacc, out, lse, rows, splits, hd, R=r, S_P=_pow2(splits),
                                             HD_P=hd_p)  # fmt: skip
    return out, lse, status


def keep_from_mask(attention_mask: torch.Tensor | None, batch: int, num_tokens: int, device) -> torch.Tensor | None:
    """uint8 ``[B, T]`` on ``device`` from a transformers decode mask ``[B, 1, 1, T]`` (bool: True attends;
    additive float: attends where above ``finfo.min / 2``), the rule of ``oakenkv.hf.attention``'s CPU path."""
    if attention_mask is None:
        return None
    m = attention_mask
    if m.dim() != 4 or m.shape[-2] != 1 or m.shape[1] != 1:
        raise ValueError(f"decode attention expects a [B, 1, 1, T] mask, got {tuple(m.shape)}")
    m = m[:, 0, 0, :]
    if m.shape[-1] != num_tokens:
        raise ValueError(f"the mask covers {m.shape[-1]} tokens but the cache holds {num_tokens}")
    keep = m if m.dtype == torch.bool else m > torch.finfo(m.dtype).min / 2
    return keep.expand(batch, num_tokens).to(device=device, dtype=torch.uint8).contiguous()


def packed_decode_attention(query, key, value, attention_mask, scaling: float, softcap: float | None = None):
    """``oakenkv.hf.attention.packed_decode_attention`` on the query's device: ``PackedKV`` handles of one layer,
    query ``[B, Hq, 1, hd]``, mask ``[B, 1, 1, T]`` -> ``[B, 1, Hq, hd]`` in the query's dtype.

    The layer's view is the store's ``layer_view`` moved to the device on every call (:func:`view_from_store`:
    sparse addresses derived on the host): the path for a CPU store (``oakenkv.store.device.DeviceKVStore`` keeps its
    view on the device and runs its own attention). Under an ``oaken-plus`` profile the queries are rotated as the
    store's keys are (``PagedKVStore.rotate_queries``)."""
    store = key.store
    if (key.kind, value.kind) != (0, 1) or value.store is not store or value.layer != key.layer:  # LayerView's kinds
        raise ValueError("packed_decode_attention needs the key and value handles of one layer")
    b, s = query.shape[0], query.shape[2]
    if s != 1:
        raise ValueError(f"packed decode attention takes one query token per row, got {s}")
    if getattr(store, "sink_tokens", 0):
        raise NotImplementedError(
            "the Triton decode attention does not read an oaken-plus profile's sink tokens yet; use the CPU kernel "
            "(oakenkv.hf.attention.packed_decode_attention) or a profile without sink tokens"
        )
    if getattr(store, "residual", 0):
        raise NotImplementedError(
            "the Triton decode attention does not read a full-precision window (OakenCache(residual=...)) yet; use "
            "the CPU kernel (oakenkv.hf.attention.packed_decode_attention) or residual=0"
        )
    view = view_from_store(store, key.layer, query.device)
    if view.num_tokens != key.num_tokens:
        raise RuntimeError(f"page tables hold {view.num_tokens} tokens, the handle says {key.num_tokens}")
    keep = keep_from_mask(attention_mask, b, view.num_tokens, query.device)
    q = query[:, :, 0, :]
    if store.transforms is not None:
        # oaken-plus: the pages hold keys rotated per head; the store rotates the queries alike, as for the CPU
        # kernel (on the host: a CPU store's; the device store rotates on the device, kernels.triton.rotate).
        q32 = q.detach().to(torch.float32).cpu().numpy()
        q = torch.from_numpy(store.rotate_queries(key.layer, q32)).to(query.device)
    out = paged_decode_attention(q, view, keep, scaling, softcap)
    return out[:, None].to(query.dtype)
