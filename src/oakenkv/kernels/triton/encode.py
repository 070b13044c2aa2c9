"""Triton encode: float rows -> Oaken page records (six scales, then nibbles) + COO sparse bytes + counts.

One program per row (several under the interpreter); the row (``D <= MAX_TRITON_DIM`` values) lives in registers
as ``NCH_P`` COO chunks of ``CHUNK_SIZE`` values. The format's constants are ``_oaken``'s ``tl.constexpr`` copies of
``oakenkv.format.layout``'s.

Numbers: the kernel repeats ``oakenkv.quant.quantizer.quantize``'s float32 operations in its order: group shift, the
range statistics as max/min reductions (exact in any order), the signed grid's step evaluated for every zero
slot ``k`` and its first minimum taken, grid end points rounded to the scale dtype (round to nearest even),
codes as ``floor((s - lo) / step + 0.5)`` then the side nudge. Two GPU defaults would change those numbers and
are switched off: the division is ``tl.math.div_rn`` (IEEE round to nearest; Triton's ``/`` on float32 is the
approximate ``div.full.f32``), and the kernel is launched with ``enable_fp_fusion=False`` (no contraction of
``lo + q * step`` or ``gmin + (n - 1) * step`` into a fused multiply-add). With both, every operation is an
IEEE float32 operation with the reference's operands, so the bytes are the reference's (tested under the
interpreter, which runs the same operations in numpy float32; on a GPU by ``benchmarks/gpu_check.sh``).

The COO stream is sequential per row (an entry's escape depends on the previous entry), but only a chunk's first
entry can need an escape, and whether it does depends only on the last entry of the previous non-empty chunk
(``docs/format.md``). So the stream is built chunk-parallel: per chunk its outlier count, first and last entry;
per chunk the previous non-empty chunk's last entry (a masked max over a ``[NCH_P, NCH_P]`` tile of packed
``chunk << 14 | index << 8 | byte`` keys, which increase with the chunk); the escape decision and length; chunk
start offsets by a prefix sum; each entry's offset by a prefix sum of the outlier mask inside its chunk; then one
scatter store of all entries and one of the escape bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from oakenkv.kernels.triton import _oaken as F
from oakenkv.kernels.triton.interpret import install

install()  # under TRITON_INTERPRET=1: the interpreter's helper calls without a redundant patch each

#: Widest row the encoder holds in registers (one program per row). Wider rows (up to the format's 32768)
#: are refused with a clear error; the CPU codec takes them.
MAX_TRITON_DIM = 8192


@triton.jit
def _round_scale(v, FP16: tl.constexpr):
    """``v`` rounded to the scale dtype and widened back (torch's ``.to(float16).float()``: nearest even)."""
    r = v
    if FP16:
        r = v.to(tl.float16).to(tl.float32)
    return r


@triton.jit
def _signed_grid(lo_mag, has_lo, hi_mag, has_hi, pmin, pmax, N: tl.constexpr, KP: tl.constexpr,
                 FLOOR: tl.constexpr, FP16: tl.constexpr):  # fmt: skip
    """(gmin, gmax) of a signed group before rounding: ``quant._signed_grid`` for each row (``[R, 1]`` each).

    ``lo_mag``/``hi_mag``: largest magnitude of the negative/positive shifted values; ``pmin``/``pmax``: the
    members' min/max (for the one-sided plain grid), all ``[R, 1]``; ``N = 2^bits`` codes; ``KP``: a power of
    two > ``N``.
    Every zero slot ``k = -1 .. N - 1`` is evaluated (``N + 1`` lanes) and the first minimum taken, as the
    reference's argmin does.
    """
    kk = tl.arange(0, KP)[None, :]
    k = (kk - 1).to(tl.float32)
    below = k + 1.0
    above = (N - 1.0) - k
    inf = float("inf")
    need_lo = tl.where(below > 0.0, tl.math.div_rn(tl.zeros_like(k) + lo_mag, tl.maximum(below, 1.0)), inf)
    need_lo = tl.where(has_lo, need_lo, 0.0)
    need_hi = tl.where(above > 0.0, tl.math.div_rn(tl.zeros_like(k) + hi_mag, tl.maximum(above, 1.0)), inf)
    need_hi = tl.where(has_hi, need_hi, 0.0)
    step = tl.maximum(tl.maximum(need_lo, need_hi), FLOOR)
    step = tl.where(kk <= N, step, inf)
    best_step = tl.min(step, axis=1, keep_dims=True)
    best = tl.min(tl.where(step == best_step, kk, KP), axis=1, keep_dims=True)  # first minimum
    k_b = (best - 1).to(tl.float32)
    gmin = -(k_b + 0.5) * best_step
    gmax = gmin + (N - 1.0) * best_step
    # One side only: the plain [min, max] grid when its code nearest zero keeps the side's sign once rounded.
    # (An empty group's +-inf extremes are replaced by 0 only to keep inf - inf out of the arithmetic: such a
    # group takes neither branch.)
    pmin = tl.where(pmin < float("inf"), pmin, 0.0)
    pmax = tl.where(pmax > -float("inf"), pmax, 0.0)
    g0 = _round_scale(pmin, FP16)
    g1 = _round_scale(pmax, FP16)
    v_top = g0 + (N - 1.0) * tl.math.div_rn(g1 - g0, N - 1.0)
    upper_only = has_hi & (~has_lo) & (g0 > 0.0)
    lower_only = has_lo & (~has_hi) & (v_top < 0.0)
    plain = upper_only | lower_only
    gmin = tl.where(plain, pmin, gmin)
    gmax = tl.where(plain, pmax, gmax)
    empty = (~has_lo) & (~has_hi)
    return tl.where(empty, 0.0, gmin), tl.where(empty, 0.0, gmax)


@triton.jit
def _codes(s, lo, step, top, SIGNED: tl.constexpr):
    """float32 codes of shifted values ``s`` on the grid ``(lo, step)``, exactly quant.quantize's."""
    safe = tl.where(step > 0.0, step, 1.0)
    q = tl.math.floor(tl.math.div_rn(s - lo, safe) + 0.5)
    q = tl.minimum(tl.maximum(tl.where(step > 0.0, q, 0.0), 0.0), top)
    if SIGNED:
        v = lo + q * step
        q = tl.where((s > 0.0) & (v <= 0.0), q + 1.0, q)
        q = tl.where((s < 0.0) & (v >= 0.0), q - 1.0, q)
        q = tl.minimum(tl.maximum(tl.where(step > 0.0, q, 0.0), 0.0), top)
    return q


@triton.jit
def _reduce_max(x):
    """Each row's maximum of ``[R, BLOCK]``, as ``[R, 1]``."""
    return tl.max(x, axis=1, keep_dims=True)


@triton.jit
def _reduce_min(x):
    return tl.min(x, axis=1, keep_dims=True)


@triton.jit
def _encode_kernel(
    x_ptr, stride_x,  # [N, D] float rows (fp32, fp16 or bf16), row stride in elements
    thr_ptr, stride_thr,  # float32 [N, 4] (to_lo, ti_lo, ti_hi, to_hi), or [N, 8] with GROUP; stride 0: one set
    rec_ptr, rec_dst_ptr,  # uint8 records out; int64 [N] byte offset of each row's record (HAS_REC_DST)
    sp_ptr, sp_dst_ptr,  # uint8 sparse bytes out; int64 [N] byte offset of each row's stream (HAS_SP_DST)
    count_ptr,  # int32 [N] out: sparse bytes of each row, or -ERR_*
    N, D, REC, CAP,
    ROWS: tl.constexpr, NCH_P: tl.constexpr, INNER_BITS: tl.constexpr, OUTER_BITS: tl.constexpr, FP16: tl.constexpr,
    SB: tl.constexpr, HAS_REC_DST: tl.constexpr, HAS_SP_DST: tl.constexpr, KP: tl.constexpr,
    NE: tl.constexpr, FLOOR: tl.constexpr, FP16_MAX: tl.constexpr, ERR_NONFINITE: tl.constexpr,
    ERR_SCALE_OVERFLOW: tl.constexpr, GROUP: tl.constexpr,
):  # fmt: skip
    BLOCK: tl.constexpr = NCH_P * F.CHUNK
    # ROWS rows per program: each row's values along axis 1, its scalars as [ROWS, 1] (one row on a GPU; more
    # under the interpreter, whose cost is per operation: interpret.store_blocks)
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
    rv = row < N
    pos = tl.arange(0, BLOCK)[None, :]
    valid = rv & (pos < D)
    x = tl.load(x_ptr + row * stride_x + pos, mask=valid, other=0.0).to(tl.float32)
    tb = thr_ptr + row * stride_thr
    to_lo = tl.load(tb, mask=rv, other=0.0)
    ti_lo = tl.load(tb + 1, mask=rv, other=0.0)
    ti_hi = tl.load(tb + 2, mask=rv, other=0.0)
    to_hi = tl.load(tb + 3, mask=rv, other=0.0)
    # adaptive grouping (oakenkv.quant.adapt): the values are grouped by the row's columns 4..7, shifted by 0..3
    go_lo, gi_lo, gi_hi, go_hi = to_lo, ti_lo, ti_hi, to_hi
    if GROUP:
        go_lo = tl.load(tb + 4, mask=rv, other=0.0)
        gi_lo = tl.load(tb + 5, mask=rv, other=0.0)
        gi_hi = tl.load(tb + 6, mask=rv, other=0.0)
        go_hi = tl.load(tb + 7, mask=rv, other=0.0)
    # a NaN fails x == x, an infinity has x - x = NaN
    bad = _reduce_max(tl.where(valid & ((x - x) != 0.0), 1, 0)) > 0

    # Eq. 1 groups and Eq. 4 shift (quant.assign_groups / group_shift)
    up_o = valid & (x > go_hi)
    dn_o = valid & (x < go_lo)
    outer = up_o | dn_o
    inner = valid & (x >= gi_lo) & (x <= gi_hi) & (~outer)
    middle = valid & (~outer) & (~inner)
    up_m = middle & (x > gi_hi)
    dn_m = middle & (x < gi_lo)
    shift = tl.where(up_o, to_hi, tl.where(dn_o, to_lo, tl.where(up_m, ti_hi, tl.where(dn_m, ti_lo, 0.0))))
    s = x - shift

    # range statistics (exact: max/min in any order)
    inf = float("inf")
    m_has_lo = _reduce_max(dn_m.to(tl.int32)) > 0
    m_has_hi = _reduce_max(up_m.to(tl.int32)) > 0
    m_lo_mag = _reduce_max(tl.where(dn_m, -s, 0.0))
    m_hi_mag = _reduce_max(tl.where(up_m, s, 0.0))
    m_min = _reduce_min(tl.where(middle, s, inf))
    m_max = _reduce_max(tl.where(middle, s, -inf))
    o_has_lo = _reduce_max(dn_o.to(tl.int32)) > 0
    o_has_hi = _reduce_max(up_o.to(tl.int32)) > 0
    o_lo_mag = _reduce_max(tl.where(dn_o, -s, 0.0))
    o_hi_mag = _reduce_max(tl.where(up_o, s, 0.0))
    o_min = _reduce_min(tl.where(outer, s, inf))
    o_max = _reduce_max(tl.where(outer, s, -inf))
    i_has = _reduce_max(inner.to(tl.int32)) > 0
    i_min = tl.where(i_has, _reduce_min(tl.where(inner, s, inf)), 0.0)
    i_max = tl.where(i_has, _reduce_max(tl.where(inner, s, -inf)), 0.0)

    mg0, mg1 = _signed_grid(m_lo_mag, m_has_lo, m_hi_mag, m_has_hi, m_min, m_max, F.MIDDLE_LEVELS, KP, FLOOR, FP16)
    og0, og1 = _signed_grid(o_lo_mag, o_has_lo, o_hi_mag, o_has_hi, o_min, o_max, 1 << OUTER_BITS, KP, FLOOR,
                            FP16)  # fmt: skip
    big = tl.maximum(tl.maximum(tl.abs(mg0), tl.abs(mg1)), tl.maximum(tl.abs(og0), tl.abs(og1)))
    big = tl.maximum(big, tl.maximum(tl.abs(i_min), tl.abs(i_max)))
    overflow = big > FP16_MAX if FP16 else big != big  # fp32 scales: never (a NaN row is non-finite first)
    mg0 = _round_scale(mg0, FP16)
    mg1 = _round_scale(mg1, FP16)
    ig0 = _round_scale(i_min, FP16)
    ig1 = _round_scale(i_max, FP16)
    og0 = _round_scale(og0, FP16)
    og1 = _round_scale(og1, FP16)
    n_in = (1 << INNER_BITS) - 1.0
    n_out = (1 << OUTER_BITS) - 1.0
    m_step = tl.math.div_rn(mg1 - mg0, F.MIDDLE_TOP)
    i_step = tl.math.div_rn(ig1 - ig0, n_in)
    o_step = tl.math.div_rn(og1 - og0, n_out)

    # codes (quant.quantize's loop over the groups, each value on its own group's grid)
    q_m = _codes(s, mg0, m_step, F.MIDDLE_TOP, True)
    q_i = _codes(s, ig0, i_step, n_in, False)
    q_o = _codes(s, og0, o_step, n_out, True)
    code = tl.where(outer, q_o, tl.where(inner, q_i, q_m)).to(tl.int32)
    code = tl.where(valid, code, 0)
    ok = ~(bad | overflow) & rv

    # the record: six scales (little-endian), then the nibbles (value 2j low, 2j + 1 high)
    rec_base = tl.load(rec_dst_ptr + row, mask=rv, other=0) if HAS_REC_DST else row * REC
    si = tl.arange(0, F.SCALE_LANES)[None, :]
    sc = tl.where(si == 0, mg0, tl.where(si == 1, mg1, tl.where(si == 2, ig0, tl.where(si == 3, ig1,
         tl.where(si == 4, og0, og1)))))  # fmt: skip
    smask = ((si < F.SCALES) & ok)[:, :, None]
    if FP16:
        bits = sc.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
        bi = tl.arange(0, 2)[None, None, :]
        sbytes = (bits[:, :, None] >> (8 * bi)) & 255
        tl.store(rec_ptr + rec_base[:, :, None] + 2 * si[:, :, None] + bi, sbytes.to(tl.uint8), mask=smask)
    else:
        bits = sc.to(tl.int32, bitcast=True)
        bi = tl.arange(0, 4)[None, None, :]
        sbytes = (bits[:, :, None] >> (8 * bi)) & 255
        tl.store(rec_ptr + rec_base[:, :, None] + 4 * si[:, :, None] + bi, sbytes.to(tl.uint8), mask=smask)
    lo_nib, hi_nib = tl.split(tl.reshape(code & F.SLOT_MASK, [ROWS, BLOCK // 2, 2]))
    j = tl.arange(0, BLOCK // 2)[None, :]
    tl.store(rec_ptr + rec_base + SB + j, (lo_nib | (hi_nib << F.SLOT_BITS)).to(tl.uint8), mask=(j < (D + 1) // 2) & ok)

    # the COO stream, chunk-parallel (module docstring)
    grp_bit = tl.where(outer, F.GROUP_BIT, 0)
    ent1 = (pos & F.INDEX_MASK) | grp_bit | (((code >> F.SLOT_BITS) & 1) << F.CODE_BIT4_SHIFT)
    # (per row: chunks along axis 1, a chunk's values along axis 2)
    ent = tl.reshape(ent1, [ROWS, NCH_P, F.CHUNK])
    isout = tl.reshape((outer | inner).to(tl.int32), [ROWS, NCH_P, F.CHUNK])
    idx = tl.arange(0, F.CHUNK)[None, None, :]
    cnt = tl.sum(isout, axis=2)
    fi = tl.min(tl.where(isout > 0, idx, F.CHUNK), axis=2)
    li = tl.max(tl.where(isout > 0, idx, -1), axis=2)
    fe = tl.sum(tl.where((isout > 0) & (idx == fi[:, :, None]), ent, 0), axis=2)
    le = tl.sum(tl.where((isout > 0) & (idx == li[:, :, None]), ent, 0), axis=2)
    chv = tl.arange(0, NCH_P)[None, :]
    last = tl.where(cnt > 0, (chv << 14) | (li << 8) | le, -1)
    prv = tl.max(tl.where(chv[:, None, :] < chv[:, :, None], last[:, None, :], -1), axis=2)
    has_prev = prv >= 0
    c = tl.where(has_prev, prv >> 14, 0)
    p = tl.where(has_prev, (prv >> 8) & F.INDEX_MASK, -1)
    prev = tl.where(has_prev, prv & 255, 0)
    natural = (fe != prev) & (((chv == c) & (fi > p)) | ((chv == c + 1) & (fi <= p)))
    esc = (cnt > 0) & (~natural)
    adv = chv - c
    nff = adv // F.ADV_CONTINUE
    esc_len = tl.where(esc, 2 + nff, 0)
    size = cnt + esc_len
    start = tl.cumsum(size, axis=1) - size
    total = tl.sum(size, axis=1, keep_dims=True)
    sp_base = (tl.load(sp_dst_ptr + row, mask=rv, other=0) if HAS_SP_DST else row * CAP)[:, :, None]
    off = start[:, :, None] + esc_len[:, :, None] + tl.cumsum(isout, axis=2) - 1
    tl.store(sp_ptr + sp_base + off, ent.to(tl.uint8), mask=(isout > 0) & ok[:, :, None])
    e = tl.arange(0, NE)[None, None, :]
    last_adv = adv - F.ADV_CONTINUE * nff  # the advance's closing byte (< ADVANCE_CONTINUE)
    ebytes = tl.where(e == 0, prev[:, :, None], tl.where(e <= nff[:, :, None], F.ADV_CONTINUE, last_adv[:, :, None]))
    emask = esc[:, :, None] & (e <= nff[:, :, None] + 1) & ok[:, :, None]
    tl.store(sp_ptr + sp_base + start[:, :, None] + e, ebytes.to(tl.uint8), mask=emask)
    status = tl.where(bad, -ERR_NONFINITE, tl.where(overflow, -ERR_SCALE_OVERFLOW, total))
    tl.store(count_ptr + row, status, mask=rv)


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def thresholds_rows(thr: F.ThresholdsLike | torch.Tensor, n: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """float32 thresholds for the kernel and their row stride: one validated set for all rows (stride 0), or a
    ``[n, 4]`` tensor of per-row sets (a decode step encodes keys and values of several layers at once), or
    ``[n, 8]``: per row the shift thresholds, then the grouping ones (adaptive grouping,
    ``oakenkv.quant.quantizer.grouping_tuple``; the caller's, not checked here)."""
    if isinstance(thr, torch.Tensor) and thr.dim() == 2:
        if thr.shape[0] != n or thr.shape[1] not in (4, 8):
            raise ValueError(f"per-row thresholds must be [N, 4] or [N, 8] (N = {n}), got {tuple(thr.shape)}")
        return thr.to(device=device, dtype=torch.float32).contiguous(), int(thr.shape[1])
    return torch.tensor(F.thresholds_tuple(thr), dtype=torch.float32, device=device), 0


def encode_records(
    x: torch.Tensor,
    thr: F.ThresholdsLike | torch.Tensor,
    config: F.OakenConfig,
    records: torch.Tensor | None = None,
    record_offsets: torch.Tensor | None = None,
    sparse: torch.Tensor | None = None,
    sparse_offsets: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
    check: bool = True,
    rows_per_program: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Encode rows straight into page records on ``x``'s device: the GPU counterpart of
    ``oakenkv.kernels.cpu.codec.encode_records``.

    Args:
        x: float ``[N, D]`` (fp32, fp16, bf16), any row stride, unit column stride; ``D <= MAX_TRITON_DIM``.
        thr: the layer's ``(to_lo, ti_lo, ti_hi, to_hi)`` for every row, or float32 ``[N, 4]`` per row, or
            ``[N, 8]`` per row: shift thresholds, then grouping thresholds (:func:`thresholds_rows`).
        records: uint8 out, flat: row ``r``'s record (``record_size(D)`` bytes: scales then nibbles) is written at
            ``record_offsets[r]`` (int64 ``[N]``; default ``r * record_size``, a fresh ``[N, rec]`` buffer), so a
            caller can write straight into its dense pages.
        sparse: uint8 out, flat: row ``r``'s COO stream at ``sparse_offsets[r]`` (default ``r * capacity``, a fresh
            ``[N, sparse_capacity(D)]`` buffer; a stream never exceeds the capacity).
        counts: int32 ``[N]`` out: sparse bytes per row, or ``-ERR_*`` for a row that cannot be encoded.
        check: raise ``ValueError`` for a row with an error code (a device-to-host copy of ``counts``).
        rows_per_program: rows each program encodes (a power of two): one on a GPU (a row lives in registers),
            more under the interpreter (``interpret.store_blocks``); the same bytes.

    Returns:
        ``(records, sparse, counts)``.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dtype == torch.float64:
        raise TypeError(f"encode expects a float32, float16 or bfloat16 tensor, got {getattr(x, 'dtype', type(x))}")
    if x.dim() != 2:
        raise ValueError(f"encode expects x of shape [N, D] (one row per vector), got {tuple(x.shape)}")
    n, d = x.shape
    if not 1 <= d <= MAX_TRITON_DIM:
        raise ValueError(f"the Triton encoder takes rows of 1..{MAX_TRITON_DIM} values, got D = {d}")
    if d > 1 and x.stride(1) != 1:
        x = x.contiguous()
    dev = x.device
    F.check_slot_bits(config.middle_bits)
    F.check_static_grids(config.static_grids)
    fp16 = config.scale_dtype == "float16"
    rec = F.record_size(d, config)
    cap = F.sparse_capacity(d)
    thr_t, stride_thr = thresholds_rows(thr, n, dev)
    if records is None:
        records = torch.empty((n, rec), dtype=torch.uint8, device=dev)
    if sparse is None:
        sparse = torch.empty((n, cap), dtype=torch.uint8, device=dev)
    if counts is None:
        counts = torch.empty(n, dtype=torch.int32, device=dev)
    nch = F.num_chunks(d)
    if n:
        r = min(_pow2(n), rows_per_program)
        _encode_kernel[(triton.cdiv(n, r),)](
            x, x.stride(0), thr_t, stride_thr,
            records, record_offsets if record_offsets is not None else records,
            sparse, sparse_offsets if sparse_offsets is not None else sparse,
            counts, n, d, rec, cap,
            ROWS=r, NCH_P=_pow2(nch), INNER_BITS=config.inner_bits, OUTER_BITS=config.outer_bits, FP16=fp16,
            SB=F.scale_bytes(config), HAS_REC_DST=record_offsets is not None,
            HAS_SP_DST=sparse_offsets is not None, KP=_pow2(2 ** max(F.MIDDLE_BITS, config.outer_bits) + 1),
            NE=_pow2(2 + (nch - 1) // F.ADVANCE_CONTINUE), FLOOR=F.STEP_FLOOR, FP16_MAX=F.FP16_MAX,
            ERR_NONFINITE=F.ERR_NONFINITE, ERR_SCALE_OVERFLOW=F.ERR_SCALE_OVERFLOW, GROUP=stride_thr == 8,
            num_warps=4 if d <= 2048 else 8, enable_fp_fusion=False,
        )  # fmt: skip
    if check and n:
        _raise_on_errors(counts)
    return records, sparse, counts


def _raise_on_errors(counts: torch.Tensor) -> None:
    bad = torch.nonzero(counts < 0)
    if bad.numel():
        r = int(bad[0, 0])
        raise ValueError(f"cannot encode row {r}: {F.ERROR_MESSAGES[-int(counts[r])]}")


def encode_batch(x: torch.Tensor, thr: F.ThresholdsLike, config: F.OakenConfig | None = None) -> F.EncodedBatch:
    """Quantize and pack rows on ``x``'s device: the bytes of ``codec.pack(quant.quantize(x))``.

    The kernel writes records and per-row streams (:func:`encode_records`); this gathers them into an
    :class:`~oakenkv.format.layout.EncodedBatch` on the same device (scales as their dtype, streams concatenated).
    """
    config = config or F.OakenConfig()
    records, sparse, counts = encode_records(x, thr, config)
    n, d = x.shape
    sb = F.scale_bytes(config)
    sdt = config.scale_torch_dtype
    counts64 = counts.to(torch.int64)
    offsets = torch.zeros(n + 1, dtype=torch.int64, device=x.device)
    torch.cumsum(counts64, 0, out=offsets[1:])
    keep = torch.arange(sparse.shape[1], device=x.device)[None, :] < counts64[:, None]
    return F.EncodedBatch(
        dense=records[:, sb:].contiguous(),
        scales=records[:, :sb].contiguous().view(sdt),
        sparse=sparse[keep],
        sparse_offsets=offsets,
        dim=int(d),
    )


@triton.jit
def _copy_spans_kernel(src, src_off, dst, dst_off, lens, BLOCK: tl.constexpr):
    """``dst[dst_off[i] : dst_off[i] + lens[i]] = src[src_off[i] : ...]`` for span ``i = program_id``."""
    i = tl.program_id(0)
    so = tl.load(src_off + i)
    do = tl.load(dst_off + i)
    n = tl.load(lens + i).to(tl.int64)
    j = 0
    while j < n:
        k = j + tl.arange(0, BLOCK)
        m = k < n
        tl.store(dst + do + k, tl.load(src + so + k, mask=m), mask=m)
        j += BLOCK


def copy_spans(
    src: torch.Tensor, src_off: torch.Tensor, dst: torch.Tensor, dst_off: torch.Tensor, lens: torch.Tensor
) -> None:
    """Copy byte spans between flat uint8 tensors on one device: span ``i`` of ``lens[i]`` bytes from
    ``src_off[i]`` to ``dst_off[i]`` (int64 offsets). How encoded rows reach their pages: the encoder writes each
    row's COO stream into a scratch row; once a store has placed the streams (a record never straddles a page),
    this moves them, one program per span."""
    n = int(lens.shape[0])
    if n:
        _copy_spans_kernel[(n,)](src, src_off, dst, dst_off, lens, BLOCK=256)
