"""Paged prefill attention in Triton: a chunk of query tokens over a layer's pages, flash-attention style.

The prefill (and chunked prefill) counterpart of :mod:`oakenkv.kernels.triton.attention`: the chunk's keys and values
are already in the pages (a store encodes them before attending, as the CPU backend does), so every key and value
the queries see is read from the pages, a tile of ``BT`` tokens at a time, dequantized in registers by the decode
kernel's tile reader (``attention._tile_values``: the reference's float32 arithmetic), and consumed by an online
softmax. Nothing larger than a tile is materialized, however long the history.

Grid ``(B * H, ceil(S / BQ))``: program ``(b, h, j)`` takes the ``G`` query heads of KV head ``h`` and the ``j``-th
block of ``BQ`` query positions, as one ``[G * BQ, hd]`` tile (so that a key tile is read once for the whole
group), and walks the key tiles up to the block's last visible token. Masks: causal with the chunk at positions
``past .. past + S - 1`` (the default), or an explicit ``uint8 [B, S, T]`` (padding, sliding windows: the 4-D mask
transformers builds); tiles no query of the block sees are skipped without reading their pages. The first
``skip`` tokens are left out (a store's sink tokens, read at 16 bits and merged through the returned log-sum-exp).

Numbers: the keys and values are the reference's floats (compiled without FMA contraction); scores and the
weighted sum use ``tl.dot`` in float32 (``input_precision="ieee"``) for float32 queries, or in the queries'
float16/bfloat16 with float32 accumulation (tensor cores), as SDPA over float tensors of that dtype would. The
result agrees with float attention over the dequantized history to the rounding of that dtype, not bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from oakenkv.kernels.triton import _oaken as F
from oakenkv.kernels.triton.attention import (
    SPARSE_BLOCK_LOG,
    _or_all,
    _tile_values,
    merged_view,
    own_heads,
    spread_heads,
)
from oakenkv.kernels.triton.coo import flags_to_error
from oakenkv.kernels.triton.interpret import install, interpreting
from oakenkv.kernels.triton.view import DeviceLayerView

install()  # under TRITON_INTERPRET=1: the interpreter's helper calls without a redundant patch each

#: Query positions per program (times the group's ``G`` query heads: the rows of the score tile).
QUERY_BLOCK = 16
#: Key tokens per tile.
TILE_TOKENS = 16
#: Warps per program: with 4, ptxas for sm_90a spills 196-3948 bytes (``benchmarks/triton_sm90_check.py``); with
#: 8, none for MHA and 20 bytes for GQA groups of 4 with 16-bit products (868 with float32 ones).
NUM_WARPS = 8
#: ``tl.dot`` operand types: float32 (IEEE), float16, bfloat16 (float32 accumulation for all).
DOT_FP32, DOT_FP16, DOT_BF16 = 0, 1, 2


@triton.jit
def _dot(a, b, DOT: tl.constexpr):
    """``a @ b`` with float32 accumulation, operands in float32 (IEEE), float16 or bfloat16 (``DOT``)."""
    if DOT == 1:
        r = tl.dot(a.to(tl.float16), b.to(tl.float16), out_dtype=tl.float32)
    elif DOT == 2:
        r = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), out_dtype=tl.float32)
    else:
        r = tl.dot(a, b, input_precision="ieee", out_dtype=tl.float32)
    return r


@triton.jit
def _prefill_kernel(
    q_ptr, sq_b, sq_h, sq_s,  # [B, Hq, S, hd] query (float), unit stride over hd
    dpool, spool,  # uint8 dense and sparse pages, flat
    pages_ptr, sp_b, sp_k,  # int32 [B, 2, NP] dense page ids
    addr_ptr, len_ptr, sa_b, sa_k,  # int64 / int32 [B, 2, T] sparse addresses and lengths
    mask_ptr, sm_b, sm_s,  # uint8 [B, S, T] (MASKED): 1 = attend
    thr_ptr,  # float32 [2, 4]
    scratch_ptr,  # uint8 [programs, BT, HD_P]
    out_ptr, so_b, so_h, so_s,  # float32 [B, Hq, S, hd] out
    lse_ptr,  # float32 [B, Hq, S] out
    status_ptr, status_stride,  # int32: error codes max-ed into status_ptr[prog * stride]
    S, T, past, skip, H, HD, D, page_size, rec, rpp, scaling, softcap, NQB,
    G: tl.constexpr, G_P: tl.constexpr, BQ: tl.constexpr, HD_P: tl.constexpr, BT: tl.constexpr, SB: tl.constexpr,
    INNER_BITS: tl.constexpr, OUTER_BITS: tl.constexpr, SBLK: tl.constexpr, SBLK_LOG: tl.constexpr,
    SOFTCAP: tl.constexpr, MASKED: tl.constexpr, DOT: tl.constexpr, E_POS: tl.constexpr, E_ZERO: tl.constexpr,
    E_FIFTH: tl.constexpr, E_TRUNC: tl.constexpr, E_NOENTRY: tl.constexpr, E_EVICTED: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0)
    qb = tl.program_id(1)
    b = bh // H
    h = bh % H
    prog = bh * NQB + qb
    scratch = scratch_ptr + prog.to(tl.int64) * (BT * HD_P)
    M: tl.constexpr = G_P * BQ
    r = tl.arange(0, M)
    g = r // BQ
    si = qb * BQ + r % BQ  # query position in the chunk
    rm = (g < G) & (si < S)
    hq = h * G + g
    col = tl.arange(0, HD_P)
    cm = col < HD
    q = tl.load(q_ptr + b * sq_b + hq[:, None] * sq_h + si[:, None] * sq_s + col[None, :],
                mask=rm[:, None] & cm[None, :], other=0.0).to(tl.float32)  # fmt: skip
    qpos = past + si  # absolute position
    m_i = tl.full([M], -float("inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, HD_P], tl.float32)
    flags = tl.zeros([BT], tl.int32)
    # causal: the block's last query sees up to itself
    t_end = T if MASKED else tl.minimum(T, past + tl.minimum(S, (qb + 1) * BQ))
    k_pages = pages_ptr + b * sp_b
    v_pages = k_pages + sp_k
    k_addr = addr_ptr + b * sa_b
    v_addr = k_addr + sa_k
    k_len = len_ptr + b * sa_b
    v_len = k_len + sa_k
    t0 = (skip // BT) * BT
    while t0 < t_end:
        t = t0 + tl.arange(0, BT)
        inr = (t < t_end) & (t >= skip)
        if MASKED:
            seen = tl.load(mask_ptr + b * sm_b + si[:, None] * sm_s + t[None, :], mask=rm[:, None] & inr[None, :],
                           other=0) != 0  # fmt: skip
        else:
            seen = rm[:, None] & inr[None, :] & (t[None, :] <= qpos[:, None])
        use = tl.max(seen.to(tl.int32), axis=0) > 0  # [BT]: a token some query of the block sees
        if tl.max(use.to(tl.int32), axis=0) > 0:
            k, kf = _tile_values(dpool, spool, k_pages, k_addr, k_len, t, use, h, thr_ptr, scratch, page_size, rec,
                                 rpp, HD, D, BT, HD_P, SB, INNER_BITS, OUTER_BITS, SBLK, SBLK_LOG)  # fmt: skip
            x = _dot(q, tl.trans(k), DOT) * scaling  # [M, BT]
            if SOFTCAP:
                y = x / softcap
                x = softcap * (1.0 - 2.0 / (tl.exp(2.0 * y) + 1.0))  # tanh(y), saturating at +-1
            x = tl.where(seen, x, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(x, axis=1))
            m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(x - m_safe[:, None])
            v, vf = _tile_values(dpool, spool, v_pages, v_addr, v_len, t, use, h, thr_ptr + 4, scratch, page_size,
                                 rec, rpp, HD, D, BT, HD_P, SB, INNER_BITS, OUTER_BITS, SBLK, SBLK_LOG)  # fmt: skip
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + _dot(p, v, DOT)
            m_i = m_new
            flags |= kf | vf
        t0 += BT
    has = l_i > 0.0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    o = tl.where(has[:, None], o, 0.0)
    tl.store(out_ptr + b * so_b + hq[:, None] * so_h + si[:, None] * so_s + col[None, :], o,
             mask=rm[:, None] & cm[None, :])  # fmt: skip
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), -float("inf"))
    tl.store(lse_ptr + (b * (H * G) + hq) * S + si, lse, mask=rm)
    allf = _or_all(flags)
    code = flags_to_error(allf, E_POS, E_ZERO, E_FIFTH, E_TRUNC, E_NOENTRY)
    tl.atomic_max(status_ptr + prog * status_stride, tl.where((allf & 32) != 0, E_EVICTED, code))


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def dot_kind(dtype: torch.dtype) -> int:
    """The ``tl.dot`` operand type for queries of ``dtype``: float16 and bfloat16 keep theirs, others float32.

    Under the interpreter bfloat16 takes float32 products: its ``tl.dot`` of bfloat16 operands returns garbage
    (1e10 for a product of unit normals, triton 3.6 and 3.9; numpy has no bfloat16), where a GPU's is right."""
    if dtype == torch.bfloat16 and interpreting():
        return DOT_FP32
    return {torch.float16: DOT_FP16, torch.bfloat16: DOT_BF16}.get(dtype, DOT_FP32)


def prefill_mask(attention_mask: torch.Tensor | None, batch: int, queries: int, num_tokens: int, device):
    """uint8 ``[B, S, T]`` (1 = attend) on ``device`` from a transformers 4-D mask ``[B, 1, S, T]`` (bool: True
    attends; additive float: attends where above ``finfo.min / 2``), or None (causal: the kernel's default)."""
    if attention_mask is None:
        return None
    m = attention_mask
    if m.dim() != 4 or m.shape[1] != 1 or m.shape[-2:] != (queries, num_tokens):
        raise ValueError(f"prefill attention expects a [B, 1, {queries}, {num_tokens}] mask, got {tuple(m.shape)}")
    keep = m[:, 0] if m.dtype == torch.bool else m[:, 0] > torch.finfo(m.dtype).min / 2
    return keep.expand(batch, queries, num_tokens).to(device=device, dtype=torch.uint8).contiguous()


def paged_prefill_attention(
    q: torch.Tensor,
    view: DeviceLayerView,
    past: int,
    mask: torch.Tensor | None,
    scaling: float,
    softcap: float | None = None,
    skip: int = 0,
    dot: int | None = None,
    status: torch.Tensor | None = None,
    tile_tokens: int = TILE_TOKENS,
    sparse_block_log: int = SPARSE_BLOCK_LOG,
    merge_heads: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention of ``S`` query tokens per sequence over a layer's pages (module docstring).

    Args:
        q: ``[B, Hq, S, hd]`` float queries (post-RoPE), unit stride over ``hd``, on the view's device.
        view: the layer's :class:`~oakenkv.kernels.triton.view.DeviceLayerView`, holding the chunk's tokens too.
        past: position of the first query (``T - S`` for a chunk just appended).
        mask: uint8 ``[B, S, T]`` (:func:`prefill_mask`), or None: causal.
        scaling: the softmax scale; softcap: logit soft cap or None.
        skip: tokens at the start left out (their part is merged by the caller through the log-sum-exp).
        dot: operand type of the products (``DOT_*``); default from ``q``'s dtype (:func:`dot_kind`).
        status: int32 ``[1]`` to max every program's error code into, or None (one code per program).
        tile_tokens, sparse_block_log: key tokens per tile (a power of two) and log2 of the COO bytes read per token
            and step (the defaults; larger under the interpreter, ``interpret.store_blocks``).
        merge_heads: all KV heads in one program (``attention.paged_decode_attention_parts``' option: for the
            interpreter).

    Returns:
        ``(out, lse, status)``: float32 ``[B, Hq, S, hd]``, float32 ``[B, Hq, S]`` (``-inf`` where a query sees no
        token), int32 status.
    """
    b, hq, s, hd = q.shape
    h, t_n = view.num_kv_heads, view.num_tokens
    if hd != view.head_dim or hq % h or b != view.batch_size:
        raise ValueError(
            f"query [B={b}, Hq={hq}, S={s}, hd={hd}] does not fit the view (batch {view.batch_size}, {h} KV heads, "
            f"head_dim {view.head_dim})"
        )
    if not 0 <= past <= t_n - s:
        raise ValueError(f"{s} queries from position {past} do not fit the {t_n} tokens of the pages")
    if hd < 16:
        raise ValueError(f"the Triton prefill attention needs head_dim >= 16 (tl.dot), got {hd}")
    if merge_heads and h > 1:
        out, lse, status = paged_prefill_attention(
            spread_heads(q, h), merged_view(view), past, mask, scaling, softcap, skip, dot, status, tile_tokens,
            sparse_block_log,
        )  # fmt: skip
        return own_heads(out, h), lse, status
    dev = q.device
    if q.stride(3) != 1:
        q = q.contiguous()
    if mask is not None:
        if tuple(mask.shape) != (b, s, t_n) or mask.dtype != torch.uint8:
            raise ValueError(f"mask must be uint8 [B, S, T] = [{b}, {s}, {t_n}], got {mask.dtype} {tuple(mask.shape)}")
        if mask.stride(2) != 1:
            mask = mask.contiguous()
    group = hq // h
    hd_p = _pow2(hd)
    nqb = triton.cdiv(max(s, 1), QUERY_BLOCK)
    out = torch.empty((b, hq, s, hd), dtype=torch.float32, device=dev)
    lse = torch.empty((b, hq, s), dtype=torch.float32, device=dev)
    if status is None:
        status, status_stride = torch.zeros(b * h * nqb, dtype=torch.int32, device=dev), 1
    else:
        status_stride = 0
    pages, addr, lens = view.dense_pages, view.sparse_addr, view.sparse_lengths
    if addr.stride() != lens.stride() or addr.stride(2) != 1 or pages.stride(2) != 1:
        raise ValueError(
            "sparse_addr and sparse_lengths must share strides, with unit stride over tokens (as dense_pages)"
        )
    F.fp16_scales(view.scale_bytes)
    if s == 0:
        return out, lse, status
    scratch = torch.empty(b * h * nqb * tile_tokens * hd_p, dtype=torch.uint8, device=dev)
    thr = view.thresholds
    if thr.dtype != torch.float32 or not thr.is_contiguous():
        thr = thr.to(torch.float32).contiguous()
    m_t = mask if mask is not None else q  # (a valid pointer; not read)
    _prefill_kernel[(b * h, nqb)](
        q, q.stride(0), q.stride(1), q.stride(2), view.dense_pool, view.sparse_pool,
        pages, pages.stride(0), pages.stride(1), addr, lens, addr.stride(0), addr.stride(1),
        m_t, m_t.stride(0) if mask is not None else 0, m_t.stride(1) if mask is not None else 0,
        thr, scratch, out, out.stride(0), out.stride(1), out.stride(2), lse, status, status_stride,
        s, t_n, past, skip, h, hd, view.dim, view.page_size, view.record_size, view.records_per_page,
        float(scaling), float(softcap or 1.0), nqb,
        G=group, G_P=_pow2(group), BQ=QUERY_BLOCK, HD_P=hd_p, BT=tile_tokens, SB=view.scale_bytes,
        INNER_BITS=view.inner_bits, OUTER_BITS=view.outer_bits, SBLK=1 << sparse_block_log,
        SBLK_LOG=sparse_block_log, SOFTCAP=bool(softcap), MASKED=mask is not None,
        DOT=dot_kind(q.dtype) if dot is None else dot,
        E_POS=F.ERR_POSITION_RANGE, E_ZERO=F.ERR_ZERO_ADVANCE, E_FIFTH=F.ERR_FIFTH_BIT,
        E_TRUNC=F.ERR_ESCAPE_TRUNCATED, E_NOENTRY=F.ERR_ESCAPE_NO_ENTRY, E_EVICTED=F.ERR_EVICTED,
        num_warps=NUM_WARPS, enable_fp_fusion=False,
    )  # fmt: skip
    return out, lse, status


def merge_lse(out_a, lse_a, out_b, lse_b):
    """Two softmax-weighted sums over disjoint token sets merged into the one over their union: ``out_*``
    float32 ``[..., hd]``, ``lse_*`` float32 ``[...]`` (``-inf``: no token). Returns ``(out, lse)``."""
    m = torch.maximum(lse_a, lse_b)
    m_safe = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), m)
    wa = torch.exp(lse_a - m_safe)
    wb = torch.exp(lse_b - m_safe)
    total = wa + wb
    safe = torch.where(total > 0, total, torch.ones_like(total))
    out = (out_a * wa[..., None] + out_b * wb[..., None]) / safe[..., None]
    lse = torch.where(total > 0, m_safe + torch.log(safe), torch.full_like(m, -float("inf")))
    return out, lse


def sink_attention(q, sink_keys, sink_values, keep, scaling: float, softcap: float | None = None):
    """Attention of queries ``q [B, Hq, S, hd]`` (float32) over 16-bit sink tokens read as float32 ``sink_keys`` /
    ``sink_values [B, H, n, hd]`` (``H`` KV heads, ``Hq`` a multiple), ``keep`` ``[B, S, n]`` (nonzero: attend).
    Returns ``(out [B, Hq, S, hd], lse [B, Hq, S])`` (``-inf`` where nothing is kept), to merge with the pages' part
    through :func:`merge_lse`: how a store (``oakenkv.store.device``) and the vLLM plugin's device path read an
    oaken-plus profile's sink tokens."""
    hq, h = q.shape[1], sink_keys.shape[1]
    g = hq // h
    sk = sink_keys.repeat_interleave(g, dim=1)
    sv = sink_values.repeat_interleave(g, dim=1)
    x = (q @ sk.transpose(-1, -2)) * scaling  # [B, Hq, S, n]
    if softcap:
        x = torch.tanh(x / softcap) * softcap
    x = x.masked_fill(keep[:, None].to(torch.bool).logical_not(), float("-inf"))
    lse = torch.logsumexp(x, dim=-1)
    finite = torch.isfinite(lse)
    p = torch.exp(x - torch.where(finite, lse, torch.zeros_like(lse))[..., None])
    return p @ sv, lse
