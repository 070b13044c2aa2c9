"""numba and LLVM helpers the kernels share: fp16 conversions, borrowed array views, element access generic over
float32 and fp16 storage, and two AVX-512 / bit-count intrinsics. All are callable from ``@njit`` code only
(except the ``HW_*`` flags).

numba's on-disk cache (``cache=True``) keys a compiled function by its own source file: a kernel that calls a
helper of this module is not recompiled when only this file changes. After editing it, clear the kernels'
``__pycache__/*.nbi`` / ``*.nbc`` files (or touch the kernel files) so every caller is compiled again.
"""

from __future__ import annotations

import platform

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

_F32 = np.float32

# --------------------------------------------------------------------------------------------------------------
# fp16 rounding (numba has no float16 type on CPU): exact round-half-to-even, computed in float64
# --------------------------------------------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def _f16_bits(v):
    """int32 fp16 bit pattern of finite float32 ``v``: round to nearest even, overflow to +-inf; integer-only.

    Normal results drop 13 mantissa bits with round-half-even (add ``0xFFF`` + the lowest kept bit) and rebias the
    exponent; subnormal results (``|v| < 2**-14``) are ``rint(|v| * 2**24)``, an exact scaling.
    """
    b = np.float32(v).view(np.int32)
    sign = (b >> np.int32(16)) & np.int32(0x8000)
    x = b & np.int32(0x7FFFFFFF)
    if x >= np.int32((127 + 16) << 23):  # >= 65536 (65520..65535 round up to inf too, via the normal path)
        return sign | np.int32(0x7C00)
    if x < np.int32(113 << 23):
        return sign | np.int32(np.rint(abs(np.float32(v)) * _F32(2.0**24)))
    return sign | ((x + np.int32(((15 - 127) << 23) + 0xFFF) + ((x >> np.int32(13)) & np.int32(1))) >> np.int32(13))


@njit(cache=True, nogil=True)
def f16_widen_int(h):
    """float32 value of an fp16 bit pattern ``h`` (any integer type), integer-only: ``(h & 0x7FFF) << 13`` read as
    float32 is the magnitude times 2**-112 for normals and subnormals alike; inf stays inf."""
    em = np.int32(h) & np.int32(0x7FFF)
    sign = (np.int32(h) & np.int32(0x8000)) << np.int32(16)
    if em >= np.int32(0x7C00):
        return np.int32(sign | np.int32(0x7F800000)).view(np.float32)
    return np.int32(sign | (em << np.int32(13))).view(np.float32) * _F32(2.0**112)


@njit(cache=True, nogil=True)
def round_to_f16(v):
    """float32 ``v`` (finite) rounded to the nearest fp16, ties to even, as float32 (torch's
    ``.to(float16).float()``: beyond 65504 it gives 65504 up to 65520, then inf)."""
    return f16_widen(f16_bits(np.float32(v)))


@njit(cache=True, nogil=True)
def f32_to_f16_bits(v):
    """The IEEE fp16 bit pattern (uint16) of finite float32 ``v`` rounded to nearest even; overflow gives +-inf."""
    return f16_bits(np.float32(v))


@njit(cache=True, nogil=True, error_model="numpy")
def f32_to_f16_bits_array(src, dst):
    """fp16 bit patterns (uint16 ``dst``) of the first ``len(dst)`` finite float32 values of ``src``, round to
    nearest even, overflow to +-inf (vectorizes where the CPU converts fp16); equal to :func:`f32_to_f16_bits`."""
    for j in range(dst.shape[0]):
        dst[j] = f16_bits(np.float32(src[j]))


def _host_converts_f16() -> bool:
    """Whether LLVM lowers float <-> half conversions to instructions on this host (x86 F16C, any aarch64).

    Elsewhere LLVM would call compiler-rt helpers that numba's JIT may not link, so the integer versions are used.
    """
    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        return True
    if machine not in ("x86_64", "amd64"):
        return False
    try:
        import llvmlite.binding as llvm

        return bool(llvm.get_host_cpu_features().get("f16c", False))
    except Exception:  # pragma: no cover - llvmlite without host feature queries
        return False


#: True where ``f16_bits`` / ``f16_widen`` compile to one conversion instruction (vectorizable: vcvtps2ph /
#: vcvtph2ps); False: the integer versions above (same results, tested against each other and torch).
HW_F16 = _host_converts_f16()


@intrinsic
def _f16_bits_hw(typingctx, v):
    """LLVM ``fptrunc float -> half`` (IEEE round to nearest even, overflow to inf), as its uint16 bit pattern."""
    if v != types.float32:
        return None
    sig = types.uint16(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return sig, codegen


@intrinsic
def _f16_widen_hw(typingctx, h):
    """LLVM ``fpext half -> float`` of a uint16 bit pattern (exact)."""
    if h != types.uint16:
        return None
    sig = types.float32(types.uint16)

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return sig, codegen


@njit(cache=True, nogil=True)
def f16_bits_int(v):
    """uint16 fp16 bit pattern of float32 ``v``, integer-only (the fallback of :data:`f16_bits`)."""
    return np.uint16(_f16_bits(v))


# f16_bits(v): uint16 fp16 bit pattern of float32 ``v`` (round to nearest even, overflow to +-inf);
# f16_widen(h): float32 value of the uint16 fp16 bit pattern ``h`` (exact). Both callable from @njit code only.
if HW_F16:
    f16_bits, f16_widen = _f16_bits_hw, _f16_widen_hw
else:  # pragma: no cover - every x86-64 CPU with AVX has F16C
    f16_bits, f16_widen = f16_bits_int, f16_widen_int


def _host_compresses_bytes() -> bool:
    """Whether this host packs selected bytes of a 64-byte vector in one instruction (AVX-512 VBMI2
    ``vpcompressb``: Intel Ice Lake and later, AMD Zen 4 and later)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        import llvmlite.binding as llvm

        f = llvm.get_host_cpu_features()
        return all(f.get(k, False) for k in ("avx512f", "avx512bw", "avx512vbmi2"))
    except Exception:  # pragma: no cover - llvmlite without host feature queries
        return False


#: True where encode emits each chunk's COO entries with one ``vpcompressb`` (see _coo_compress); elsewhere a
#: loop over the set bits of the chunk's outlier mask (_coo_bits). Both write the same bytes (tested).
HW_COMPRESS = _host_compresses_bytes()


@intrinsic
def compress_chunk(typingctx, src, start, mask, dst, at):
    """``dst[at:at + 64] = `` the bytes of ``src[start:start + 64]`` whose bit is set in uint64 ``mask``, packed
    to the front (the rest of the 64 bytes is zero). uint8 C arrays; the caller checks both bounds. AVX-512 VBMI2
    only (``vpcompressb``; a plain 64-byte load and store around it)."""
    u8c = types.Array(types.uint8, 1, "C")
    if src != u8c or dst != u8c or mask != types.uint64:
        return None
    if not isinstance(start, types.Integer) or not isinstance(at, types.Integer):
        return None
    sig = types.void(src, start, mask, dst, at)

    def codegen(context, builder, signature, args):
        vec = ir.VectorType(ir.IntType(8), 64)
        bits = ir.VectorType(ir.IntType(1), 64)
        a_src = context.make_array(signature.args[0])(context, builder, args[0])
        a_dst = context.make_array(signature.args[3])(context, builder, args[3])
        i0 = context.cast(builder, args[1], signature.args[1], types.intp)
        i1 = context.cast(builder, args[4], signature.args[4], types.intp)
        v = builder.load(builder.bitcast(builder.gep(a_src.data, [i0]), vec.as_pointer()), align=1)
        m = builder.bitcast(args[2], bits)
        fnty = ir.FunctionType(vec, [vec, vec, bits])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.avx512.mask.compress.v64i8")
        packed = builder.call(fn, [v, ir.Constant(vec, None), m])
        builder.store(packed, builder.bitcast(builder.gep(a_dst.data, [i1]), vec.as_pointer()), align=1)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def popcount64(typingctx, a):
    """Number of set bits of uint64 ``a`` (LLVM ``ctpop``)."""
    if a != types.uint64:
        return None
    sig = types.int64(types.uint64)

    def codegen(context, builder, signature, args):
        return builder.ctpop(args[0])

    return sig, codegen


def _borrowed_1d(context, builder, retty, data, n, stride, itemsize):
    """A 1-D array value of type ``retty`` over ``data`` with a null meminfo: it holds no reference."""
    from numba.np.arrayobj import populate_array

    view = context.make_array(retty)(context, builder)
    populate_array(view, data=data, shape=[n], strides=[stride], itemsize=itemsize, meminfo=None)
    return view._getvalue()


@intrinsic
def row_view(typingctx, a, r):
    """Row ``r`` of the 2-D C-contiguous array ``a`` as a 1-D view that holds no reference to ``a``.

    A view ``a[r]`` costs an atomic reference-count increment and decrement per row (measurable on a narrow row's
    decode: docs/notebook/perf-notes.md); this one costs nothing, for loops over the rows of an array the caller keeps
    alive. No bounds check.
    """
    if not (isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" and isinstance(r, types.Integer)):
        return None
    retty = a.copy(ndim=1, layout="C")

    def codegen(context, builder, signature, args):
        src = context.make_array(signature.args[0])(context, builder, args[0])
        shape = cgutils.unpack_tuple(builder, src.shape, 2)
        stride = cgutils.unpack_tuple(builder, src.strides, 2)[1]
        ri = context.cast(builder, args[1], signature.args[1], types.intp)
        data = builder.gep(src.data, [builder.mul(ri, shape[1])])
        return _borrowed_1d(context, builder, signature.return_type, data, shape[1], stride, src.itemsize)

    return retty(a, r), codegen


@intrinsic
def span_view(typingctx, a, start, stop):
    """``a[start:stop]`` of the 1-D C-contiguous array ``a`` as a view that holds no reference (see row_view); the
    caller guarantees ``0 <= start <= stop <= len(a)``."""
    if not (isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C"):
        return None
    if not (isinstance(start, types.Integer) and isinstance(stop, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        src = context.make_array(signature.args[0])(context, builder, args[0])
        i0 = context.cast(builder, args[1], signature.args[1], types.intp)
        i1 = context.cast(builder, args[2], signature.args[2], types.intp)
        stride = cgutils.unpack_tuple(builder, src.strides, 1)[0]
        data = builder.gep(src.data, [i0])
        return _borrowed_1d(context, builder, signature.args[0], data, builder.sub(i1, i0), stride, src.itemsize)

    return a(a, start, stop), codegen


@njit(cache=True, nogil=True)
def all_view(a):
    """All of the 1-D array ``a`` as a view that holds no reference (see row_view)."""
    return span_view(a, 0, a.shape[0])


@njit(cache=True, nogil=True)
def keep_alive(*arrays):
    """Use ``arrays`` here, so that numba keeps them alive (it releases a variable after its last use) as long as
    borrowed views of them are in use before this call."""
    return len(arrays)


def f32_at(a, i):  # pragma: no cover - only its overload runs, inside @njit code
    """Element ``i`` of ``a`` as float32: ``a`` float32, or fp16 bit patterns (uint16), widened exactly."""
    raise NotImplementedError


@overload(f32_at)
def _f32_at_impl(a, i):
    if a.dtype == types.uint16:
        return lambda a, i: f16_widen(a[i])
    return lambda a, i: _F32(a[i])


def out_elem(v, out):  # pragma: no cover - only its overload runs, inside @njit code
    """float32 ``v`` as an element of ``out``: itself, or its fp16 bit pattern for a uint16 ``out``."""
    raise NotImplementedError


@overload(out_elem)
def _out_elem_impl(v, out):
    if out.dtype == types.uint16:
        return lambda v, out: f16_bits(v)
    return lambda v, out: v
