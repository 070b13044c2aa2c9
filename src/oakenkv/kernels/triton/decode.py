"""Triton decode: page records (wherever they lie) -> float rows, bit-exact with the reference.

``dequantize(unpack(enc))`` of the reference, for rows given by addresses: row ``r``'s dense record (scales then
nibbles) at ``records + rec_addr[r]`` and its COO stream at ``sparse + sp_addr[r]`` (``sp_len[r]`` bytes). The
same kernel decodes an :class:`~oakenkv.format.layout.EncodedBatch` (addresses of its rows) and a layer's pages (the
per-token addresses of the kernel view): the device store's float read path (``DeviceKVStore.read``).

Each program decodes ``BT`` rows: every value first as a middle-group code (``lo + code * step``, then the
threshold of its side), stored; then, after a barrier, the COO streams are read a block of bytes at a time
(:mod:`oakenkv.kernels.triton.coo`) and each outlier's value stored over its slot. Float32 arithmetic as
``quant.dequantize`` with no fused multiply-add (``enable_fp_fusion=False``), so the floats are the reference's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from oakenkv.kernels.triton import _oaken as F
from oakenkv.kernels.triton.coo import coo_block, coo_end_error, flags_to_error
from oakenkv.kernels.triton.interpret import install

install()  # under TRITON_INTERPRET=1: the interpreter's helper calls without a redundant patch each

#: Bytes of the COO streams read per step of the walk (per row of the tile), and its log2.
SPARSE_BLOCK_LOG = 6
SPARSE_BLOCK = 1 << SPARSE_BLOCK_LOG


@triton.jit
def load_scales(ptr, base, mask, SB: tl.constexpr):
    """The six scales of records at byte offsets ``base`` (int64 ``[BT]``) as float32 ``[BT]`` each, in
    ``format.SCALE_NAMES`` order (fp16 scales when ``SB`` is six fp16's bytes, else fp32), read byte by byte
    (records need not be aligned)."""
    k = tl.arange(0, F.SCALE_LANES)[None, :]
    m = mask[:, None] & (k < F.SCALES)
    if SB == F.FP16_SCALE_BYTES:
        a = tl.load(ptr + base[:, None] + 2 * k, mask=m, other=0).to(tl.int32)
        b = tl.load(ptr + base[:, None] + 2 * k + 1, mask=m, other=0).to(tl.int32)
        sc = (a | (b << 8)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        w = tl.load(ptr + base[:, None] + 4 * k, mask=m, other=0).to(tl.int32)
        w |= tl.load(ptr + base[:, None] + 4 * k + 1, mask=m, other=0).to(tl.int32) << 8
        w |= tl.load(ptr + base[:, None] + 4 * k + 2, mask=m, other=0).to(tl.int32) << 16
        w |= tl.load(ptr + base[:, None] + 4 * k + 3, mask=m, other=0).to(tl.int32) << 24
        sc = w.to(tl.float32, bitcast=True)
    sc = tl.where(m, sc, -float("inf"))
    # column extraction by a max: exact, and keeps the sign of a zero
    s0 = tl.max(tl.where(k == 0, sc, -float("inf")), axis=1)
    s1 = tl.max(tl.where(k == 1, sc, -float("inf")), axis=1)
    s2 = tl.max(tl.where(k == 2, sc, -float("inf")), axis=1)
    s3 = tl.max(tl.where(k == 3, sc, -float("inf")), axis=1)
    s4 = tl.max(tl.where(k == 4, sc, -float("inf")), axis=1)
    s5 = tl.max(tl.where(k == 5, sc, -float("inf")), axis=1)
    z = 0.0  # rows outside the mask: zeros, not the -inf sentinel (no inf - inf downstream)
    return (tl.where(mask, s0, z), tl.where(mask, s1, z), tl.where(mask, s2, z), tl.where(mask, s3, z),
            tl.where(mask, s4, z), tl.where(mask, s5, z))  # fmt: skip


@triton.jit
def middle_values(code, lo, step, ti_lo, ti_hi):
    """Middle-group values of 4-bit codes (quant.dequantize): ``lo + code * step``, then its side's threshold."""
    v = lo + code.to(tl.float32) * step
    return v + tl.where(v > 0.0, ti_hi, ti_lo)


@triton.jit
def outlier_values(code5, outer, i_lo, i_step, o_lo, o_step, to_lo, to_hi):
    """Inner (unshifted) or outer (plus its side's threshold) values of 5-bit codes (quant.dequantize)."""
    cf = code5.to(tl.float32)
    vi = i_lo + cf * i_step
    vo = o_lo + cf * o_step
    vo = vo + tl.where(vo > 0.0, to_hi, to_lo)
    return tl.where(outer, vo, vi)


@triton.jit
def _decode_kernel(
    rec_ptr, rec_addr_ptr, sp_ptr, sp_addr_ptr, sp_len_ptr,
    thr_ptr, stride_thr, out_ptr, stride_out, status_ptr, N, D,
    BT: tl.constexpr, BLOCK_D: tl.constexpr, SB: tl.constexpr, INNER_BITS: tl.constexpr,
    OUTER_BITS: tl.constexpr, SBLK: tl.constexpr, SBLK_LOG: tl.constexpr, OUT_F16: tl.constexpr, E_POS: tl.constexpr,
    E_ZERO: tl.constexpr, E_FIFTH: tl.constexpr, E_TRUNC: tl.constexpr, E_NOENTRY: tl.constexpr,
    E_SCALE: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    rmask = rows < N
    base = tl.load(rec_addr_ptr + rows, mask=rmask, other=0)
    s0, s1, s2, s3, s4, s5 = load_scales(rec_ptr, base, rmask, SB)
    inf = float("inf")
    finite = (tl.abs(s0) < inf) & (tl.abs(s1) < inf) & (tl.abs(s2) < inf) & (tl.abs(s3) < inf)
    finite = finite & (tl.abs(s4) < inf) & (tl.abs(s5) < inf)
    tb = thr_ptr + rows * stride_thr
    to_lo = tl.load(tb, mask=rmask, other=0.0)[:, None]
    ti_lo = tl.load(tb + 1, mask=rmask, other=0.0)[:, None]
    ti_hi = tl.load(tb + 2, mask=rmask, other=0.0)[:, None]
    to_hi = tl.load(tb + 3, mask=rmask, other=0.0)[:, None]
    m_step = tl.math.div_rn(s1 - s0, F.MIDDLE_TOP)[:, None]
    i_step = tl.math.div_rn(s3 - s2, (1 << INNER_BITS) - 1.0)[:, None]
    o_step = tl.math.div_rn(s5 - s4, (1 << OUTER_BITS) - 1.0)[:, None]
    # dense: every value as a middle code
    col = tl.arange(0, BLOCK_D)[None, :]
    vmask = rmask[:, None] & (col < D)
    byte = tl.load(rec_ptr + base[:, None] + SB + (col >> 1), mask=vmask, other=0).to(tl.int32)
    nib = (byte >> ((col & 1) * F.SLOT_BITS)) & F.SLOT_MASK
    v = middle_values(nib, s0[:, None], m_step, ti_lo, ti_hi)
    optr = out_ptr + rows[:, None] * stride_out + col
    if OUT_F16:
        tl.store(optr, v.to(tl.float16), mask=vmask)
    else:
        tl.store(optr, v, mask=vmask)
    tl.debug_barrier()  # the outliers below overwrite these stores
    # sparse: walk the streams a block of bytes at a time, storing each outlier's value
    addr = tl.load(sp_addr_ptr + rows, mask=rmask, other=0)
    length = tl.load(sp_len_ptr + rows, mask=rmask, other=0).to(tl.int32)
    state = tl.zeros([BT], tl.int32)
    chunk = tl.zeros([BT], tl.int32)
    flags = tl.zeros([BT], tl.int32)
    maxlen = tl.max(length, axis=0)
    INNER5: tl.constexpr = INNER_BITS > F.SLOT_BITS  # 5-bit codes: a fifth bit in the entry
    OUTER5: tl.constexpr = OUTER_BITS > F.SLOT_BITS
    jb = 0
    while jb < maxlen:
        entry, pos, e, state, chunk, err = coo_block(
            sp_ptr, addr, length, jb, state, chunk, D, SBLK, SBLK_LOG, INNER5, OUTER5
        )
        flags |= err
        ok = entry & (pos < D)
        nb = tl.load(rec_ptr + base[:, None] + SB + (pos >> 1), mask=ok, other=0).to(tl.int32)
        code5 = ((nb >> ((pos & 1) * F.SLOT_BITS)) & F.SLOT_MASK) | (((e >> F.CODE_BIT4_SHIFT) & 1) << F.SLOT_BITS)
        w = outlier_values(code5, (e & F.GROUP_BIT) != 0, s2[:, None], i_step, s4[:, None], o_step, to_lo, to_hi)
        wptr = out_ptr + rows[:, None] * stride_out + pos
        if OUT_F16:
            tl.store(wptr, w.to(tl.float16), mask=ok)
        else:
            tl.store(wptr, w, mask=ok)
        jb += SBLK
    flags |= coo_end_error(state, length)
    code = flags_to_error(flags, E_POS, E_ZERO, E_FIFTH, E_TRUNC, E_NOENTRY)
    code = tl.where(finite, code, E_SCALE)
    tl.store(status_ptr + rows, code, mask=rmask)


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def decode_rows(
    records: torch.Tensor,
    rec_addr: torch.Tensor,
    sparse: torch.Tensor,
    sp_addr: torch.Tensor,
    sp_len: torch.Tensor,
    thr: torch.Tensor,
    dim: int,
    scale_bytes: int,
    inner_bits: int,
    outer_bits: int,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
    check: bool = True,
    rows_per_program: int | None = None,
    sparse_block_log: int = SPARSE_BLOCK_LOG,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode ``N`` rows given by addresses (module docstring) into ``out`` (``[N, D]`` float32 or float16).

    Args:
        records, sparse: flat uint8 tensors (page pools, or an encoded batch's records and streams).
        rec_addr, sp_addr: int64 ``[N]`` byte offsets of each row's record and stream; sp_len: int ``[N]``.
        thr: float32 ``[4]`` (all rows) or ``[N, 4]`` (per row) thresholds.
        dim: values per row; scale_bytes: bytes of a record's scales (``format.scale_bytes``: fp16 or fp32);
            inner_bits, outer_bits: bits of the inner and outer codes (``OakenConfig``'s).
        check: raise :class:`~oakenkv.format.layout.CorruptDataError` for the first row with an error (a device sync).
        rows_per_program: rows each program decodes (a power of two; default up to 16, 4096 values in all);
            sparse_block_log: log2 of the COO bytes read per row and step (larger under the interpreter,
            ``interpret.store_blocks``).

    Returns:
        ``(out, status)``: status int32 ``[N]``, 0 or an ``ERR_*`` code per row.
    """
    n = int(rec_addr.shape[0])
    dev = records.device
    if out is None:
        out = torch.empty((n, dim), dtype=out_dtype, device=dev)
    if out.dtype not in (torch.float32, torch.float16) or tuple(out.shape) != (n, dim) or out.stride(1) != 1:
        raise ValueError(f"out must be float32 or float16 [{n}, {dim}] with unit column stride")
    F.fp16_scales(scale_bytes)  # fp16 or fp32 scales, nothing else
    stride_thr = 4 if thr.dim() == 2 else 0
    status = torch.empty(n, dtype=torch.int32, device=dev)
    block_d = _pow2(dim)
    bt = rows_per_program or max(1, min(16, 4096 // block_d))
    if n:
        _decode_kernel[(triton.cdiv(n, bt),)](
            records, rec_addr, sparse, sp_addr, sp_len, thr.to(torch.float32).contiguous(), stride_thr,
            out, out.stride(0), status, n, dim,
            BT=bt, BLOCK_D=block_d, SB=scale_bytes, INNER_BITS=inner_bits, OUTER_BITS=outer_bits,
            SBLK=1 << sparse_block_log, SBLK_LOG=sparse_block_log,
            OUT_F16=out.dtype == torch.float16,
            E_POS=F.ERR_POSITION_RANGE, E_ZERO=F.ERR_ZERO_ADVANCE, E_FIFTH=F.ERR_FIFTH_BIT,
            E_TRUNC=F.ERR_ESCAPE_TRUNCATED, E_NOENTRY=F.ERR_ESCAPE_NO_ENTRY, E_SCALE=F.ERR_SCALE_NONFINITE,
            num_warps=4, enable_fp_fusion=False,
        )  # fmt: skip
    if check and n:
        bad = torch.nonzero(status)
        if bad.numel():
            r = int(bad[0, 0])
            raise F.CorruptDataError(f"row {r}: {F.ERROR_MESSAGES[int(status[r])]}")
    return out, status


def decode_batch(
    enc: F.EncodedBatch,
    thr: F.ThresholdsLike,
    config: F.OakenConfig | None = None,
    out_dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """``dequantize(unpack(enc))`` on ``device`` (default: the batch's): float32 ``[N, D]`` (or float16, the
    float32 result rounded once). Raises :class:`~oakenkv.format.layout.CorruptDataError` for a corrupt stream."""
    config = config or F.OakenConfig()
    F.check_slot_bits(config.middle_bits)
    F.check_static_grids(config.static_grids)
    dev = torch.device(device) if device is not None else enc.dense.device
    n, d = enc.num_rows, enc.dim
    sb = F.scale_bytes(config)
    want = config.scale_torch_dtype
    if enc.scales.dtype != want or tuple(enc.scales.shape) != (n, F.NUM_SCALES):
        raise F.CorruptDataError(f"scales must be {want} [{n}, {F.NUM_SCALES}], got {enc.scales.dtype}")
    if enc.dense.dtype != torch.uint8 or tuple(enc.dense.shape) != (n, F.dense_bytes(d)):
        raise F.CorruptDataError(f"dense must be uint8 [{n}, {F.dense_bytes(d)}], got {tuple(enc.dense.shape)}")
    scales = enc.scales.to(dev).contiguous().view(torch.uint8).reshape(n, sb)
    records = torch.cat([scales, enc.dense.to(dev)], dim=1).contiguous()
    rec = records.shape[1]
    off = enc.sparse_offsets.to(dev)
    sparse = enc.sparse.to(dev)
    if sparse.numel() == 0:
        sparse = torch.zeros(1, dtype=torch.uint8, device=dev)  # a valid pointer for the (masked) loads
    rec_addr = torch.arange(n, dtype=torch.int64, device=dev) * rec
    thr_t = torch.tensor(F.thresholds_tuple(thr), dtype=torch.float32, device=dev)
    out, _ = decode_rows(
        records.reshape(-1), rec_addr, sparse, off[:-1].contiguous(), (off[1:] - off[:-1]).to(torch.int32),
        thr_t, d, sb, config.inner_bits, config.outer_bits, out_dtype=out_dtype,
    )  # fmt: skip
    return out


def read_view(view, kind: int, out_dtype: torch.dtype = torch.float32, **blocks) -> torch.Tensor:
    """A layer's stored keys (``kind`` 0) or values (1) dequantized on the view's device: ``[B, H, T, hd]``.

    The device counterpart of ``PagedKVStore.read`` (the same floats, bit for bit; ``DeviceKVStore.read`` adds the
    watermark, sink tokens and the keys' rotation back). ``view``: a
    :class:`~oakenkv.kernels.triton.view.DeviceLayerView`; tokens on evicted pages (a sliding window's past) read as
    zeros, as in ``PagedKVStore.read``. The keys are the stored ones: under an ``oaken-plus`` key rotation
    ``PagedKVStore.read`` also undoes the rotation (``restore_keys``), this does not. ``blocks``: the launch's
    ``rows_per_program`` and ``sparse_block_log`` (:func:`decode_rows`).
    """
    b, t_n, rpp = view.batch_size, view.num_tokens, view.records_per_page
    dev = view.dense_pool.device
    t_idx = torch.arange(t_n, device=dev)
    pages = view.dense_pages[:, kind, :].to(torch.int64)[:, t_idx // rpp]  # [B, T]
    live = pages >= 0
    rec_addr = torch.where(live, pages * view.page_size + (t_idx % rpp) * view.record_size, 0).flatten()
    sp_addr = view.sparse_addr[:, kind, :t_n]
    sp_len = torch.where(live & (sp_addr >= 0), view.sparse_lengths[:, kind, :t_n], 0)
    out, _ = decode_rows(
        view.dense_pool, rec_addr.contiguous(), view.sparse_pool, sp_addr.clamp(min=0).flatten().contiguous(),
        sp_len.flatten().contiguous(), view.thresholds[kind], view.dim, view.scale_bytes, view.inner_bits,
        view.outer_bits, out_dtype=out_dtype, **blocks,
    )  # fmt: skip
    out = out.view(b, t_n, view.num_kv_heads, view.head_dim)
    out = torch.where(live[:, :, None, None], out, torch.zeros((), dtype=out.dtype, device=dev))
    return out.permute(0, 2, 1, 3)
