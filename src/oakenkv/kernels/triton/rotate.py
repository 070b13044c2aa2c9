"""Triton counterpart of ``oakenkv.kernels.cpu.rotate``: the oaken-plus online key transform on the device.

``shift_rotate_rows`` subtracts a per-column shift from float32 rows and transforms every head (a block of ``hd``
values) by the Sylvester Hadamard matrix with a fast Walsh-Hadamard transform, then multiplies by ``1 / sqrt(hd)``:
the butterflies of the CPU kernel (``a + b``, ``a - b`` for pairs ``h`` apart, ``h = 1, 2, 4, ...``), as plain
float32 additions and subtractions and one final multiplication, so every value is the CPU kernel's bit for bit
(nothing here can be contracted into a fused multiply-add). A device store rotates key rows before encoding, and
queries before attention, with it.

One program takes ``BR`` rows as a ``[BR, H_P, HD]`` tile (heads padded to a power of two); a butterfly round is a
reshape that puts each pair's two halves on an axis of length 2, a split, and a join.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from oakenkv.kernels.triton.interpret import install

install()  # under TRITON_INTERPRET=1: the interpreter's helper calls without a redundant patch each


@triton.jit
def _shift_rotate_kernel(
    x_ptr, stride_x, shift_ptr, N, H, HD_SCALE,
    BR: tl.constexpr, H_P: tl.constexpr, HD: tl.constexpr, LOG_HD: tl.constexpr, SHIFT: tl.constexpr,
    ROTATE: tl.constexpr,
):  # fmt: skip
    r0 = tl.program_id(0).to(tl.int64) * BR
    r = r0 + tl.arange(0, BR)[:, None, None]
    hh = tl.arange(0, H_P)[None, :, None]
    c = tl.arange(0, HD)[None, None, :]
    m = (r < N) & (hh < H) & (c < HD)
    col = hh * HD + c
    ptr = x_ptr + r * stride_x + col
    x = tl.load(ptr, mask=m, other=0.0)
    if SHIFT:
        x = x - tl.load(shift_ptr + col, mask=(hh < H) & (c < HD), other=0.0)
    if ROTATE:
        # round h: value j pairs with j + h inside blocks of 2h; as [blocks, 2, h] the pair is the middle axis
        for i in tl.static_range(LOG_HD):  # (h = 1 << i inline: a shape must stay a compile-time int)
            y = tl.reshape(x, [BR * H_P * HD // (2 << i), 2, 1 << i])
            a, b = tl.split(tl.permute(y, (0, 2, 1)))
            y = tl.permute(tl.join(a + b, a - b), (0, 2, 1))
            x = tl.reshape(y, [BR, H_P, HD])
        x = x * HD_SCALE
    tl.store(ptr, x, mask=m)


def shift_rotate_rows(rows: torch.Tensor, shift: torch.Tensor | None, rotate: bool, head_dim: int) -> torch.Tensor:
    """In place on float32 ``rows [N, D]`` (unit column stride): subtract ``shift`` (float32 ``[D]``, or None),
    then, when ``rotate``, rotate each head of ``head_dim`` values (a power of two) by the normalised Hadamard
    matrix. Returns ``rows``. The same bits as ``oakenkv.kernels.cpu.rotate.shift_rotate_rows``."""
    if rows.dtype != torch.float32 or rows.dim() != 2 or (rows.shape[1] > 1 and rows.stride(1) != 1):
        raise ValueError(f"rows must be float32 [N, D] with unit column stride, got {rows.dtype} {tuple(rows.shape)}")
    n, d = rows.shape
    if rotate and (head_dim < 1 or head_dim & (head_dim - 1) or d % head_dim):
        raise ValueError(f"a Hadamard rotation needs a power-of-two head_dim dividing D = {d}, got {head_dim}")
    if shift is not None and (shift.dtype != torch.float32 or tuple(shift.shape) != (d,)):
        raise ValueError(f"shift must be float32 [{d}], got {shift.dtype} {tuple(shift.shape)}")
    if n == 0 or (shift is None and not rotate):
        return rows
    if not rotate:  # a shift alone: columns need not split into power-of-two heads
        rows.sub_(shift)
        return rows
    heads = d // head_dim
    h_p = 1 << max(0, (heads - 1).bit_length())
    br = max(1, min(16, 4096 // (h_p * head_dim)))
    scale = float(torch.tensor(1.0 / math.sqrt(head_dim), dtype=torch.float32))  # np.float32(1 / sqrt(hd))'s value
    _shift_rotate_kernel[(triton.cdiv(n, br),)](
        rows, rows.stride(0), shift if shift is not None else rows, n, heads, scale,
        BR=br, H_P=h_p, HD=head_dim, LOG_HD=head_dim.bit_length() - 1, SHIFT=shift is not None, ROTATE=True,
        num_warps=4, enable_fp_fusion=False,
    )  # fmt: skip
    return rows
