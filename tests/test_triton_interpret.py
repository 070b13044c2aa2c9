"""src/oakenkv/kernels/triton/interpret.py: the interpreter's shortcuts (helper calls without a redundant patch each,
no discarded overflow checks, tuple types built when read) give the same numbers."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed (pip install 'oakenkv[triton]')")

import triton
import triton.language as tl

from oakenkv.kernels.triton.interpret import skip_nested_patching


@triton.jit
def _twice(x):
    return tl.max(x, axis=0) * 2.0  # (a helper calling a helper of triton.language.standard, another namespace)


@triton.jit
def _kernel(x_ptr, out_ptr, N: tl.constexpr):
    i = tl.program_id(0)
    x = tl.load(x_ptr + i * N + tl.arange(0, N))
    acc = _twice(x)
    for _ in range(3):
        acc += _twice(x)
    tl.store(out_ptr + i, acc)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter only")
def test_helpers_called_inside_a_launch_give_the_same_numbers_and_helpers_outside_still_patch():
    from triton.runtime import interpreter as ti

    assert skip_nested_patching()  # (installed already by the kernel modules: idempotent)
    assert ti.InterpretedFunction.__call__.__module__ == "oakenkv.kernels.triton.interpret"
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(0))
    out = torch.empty(3)
    _kernel[(3,)](x, out, N=16)
    assert torch.equal(out, x.max(dim=1).values * 8.0)
    _kernel[(3,)](x * -1, out, N=16)  # a second launch: the helpers patch again on their first call
    assert torch.equal(out, (-x).max(dim=1).values * 8.0)


@triton.jit
def _int_kernel(x_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    x = tl.load(x_ptr + i)
    tl.store(out_ptr + i, (x * 3 + 7) - (x << 2))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter only")
def test_overflow_checks_off_and_lazy_tuple_types_give_the_same_numbers_and_types():
    import triton.language.core as core
    from triton.runtime import interpreter as ti

    from oakenkv.kernels.triton.interpret import lazy_tuple_types, skip_overflow_checks

    assert skip_overflow_checks() and not ti.interpreter_builder.options.sanitize_overflow
    x = torch.arange(-8, 8, dtype=torch.int32) * 1000
    out = torch.empty_like(x)
    _int_kernel[(1,)](x, out, N=16)
    assert torch.equal(out, (x * 3 + 7) - (x << 2))
    if lazy_tuple_types():  # (triton 3.6 only)
        t = core.tuple([core.constexpr(2), core.constexpr(5)])
        assert "type" not in vars(t) and str(t.type) == str(core._type_for_tuple_values(t.values))
        assert "type" in vars(t)  # computed once, then an attribute
