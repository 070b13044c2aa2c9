"""The same accuracy numbers on every x86-64 machine: pin the CPU code paths that round differently.

torch picks its vectorized CPU kernels (softmax, scaled-dot-product attention, reductions) by the CPU it runs on:
AVX-512 where the CPU has it, else AVX2. The two round differently in the last bits; a full-precision model barely
notices (the default model's first two WikiText-2 windows of 2048: 0.017 nats each), but quantization amplifies
it, because a value next to a rounding boundary of a 4-bit grid takes the other code and the difference grows layer
by layer: `oaken-plus` on those windows lost 7.7 nats more per window with AVX-512 kernels than with AVX2 ones on
one and the same AMD EPYC (5610.40 and 6501.48 against 5602.71 and 6493.76), and the Intel Xeon of earlier
sessions had given the AVX2 numbers bit for bit (docs/results.md, "Numerics between machines"). Paired
comparisons of runs made on different machines carried that spread.

So the commands that measure accuracy (``oakenkv eval ppl``, ``eval zeroshot``, ``profile``, ``demo``) run torch's
AVX2 kernels (``ATEN_CPU_CAPABILITY=avx2``), MKL's AVX2 code path in its conditional-numerical-reproducibility mode
(``MKL_CBWR=AVX2``) and oneDNN's AVX2 kernels (``ONEDNN_MAX_CPU_ISA=AVX2``), which every x86-64 CPU with AVX2
(Intel since 2013, AMD since 2015) runs alike: the Intel Xeon's numbers and this AMD EPYC's pinned ones agree bit
for bit. It cost no measured time here (an oaken-plus evaluation of two windows: 26.2-27.9 s either way; its
time is MKL's matmuls, which on this AMD CPU took their AVX2 path already, and numba's codec). numba's codec does
not depend on the CPU (compiled without fast-math: the same numbers for a Skylake and a Zen 4 target, checked).

The variables must be set before torch runs its first operation (it reads them once); a variable the user set
is left as it is, and ``OAKENKV_NATIVE_NUMERICS=1`` keeps the CPU's own code paths. What a run actually used is
recorded in its result (:func:`cpu_numerics`), whether or not the pin took effect.
"""

from __future__ import annotations

import os
import platform
from typing import Any

from oakenkv.util.resources import cpu_model_and_flags

ENV_ATEN = "ATEN_CPU_CAPABILITY"
ENV_MKL = "MKL_CBWR"
ENV_ONEDNN = "ONEDNN_MAX_CPU_ISA"
#: The variables :func:`pin_cpu_numerics` sets, and their values (read back only to be recorded and compared).
PINNED: dict[str, str] = {ENV_ATEN: "avx2", ENV_MKL: "AVX2", ENV_ONEDNN: "AVX2"}
#: Set to anything but "" or "0" to keep the CPU's own (possibly wider) code paths.
ENV_NATIVE = "OAKENKV_NATIVE_NUMERICS"


def _x86_with_avx2() -> bool:
    """An x86-64 CPU that reports AVX2 (not Linux: no flags to read; torch's own dispatch decides)."""
    return platform.machine().lower() in ("x86_64", "amd64") and "avx2" in cpu_model_and_flags()[1]


def pin_cpu_numerics() -> bool:
    """Set :data:`PINNED`'s variables that are not set (x86-64 with AVX2 only; not with :data:`ENV_NATIVE`).
    Call before torch's first operation. Returns whether it set or found the pinned torch capability."""
    if os.environ.get(ENV_NATIVE, "").strip() not in ("", "0") or not _x86_with_avx2():
        return False
    for k, v in PINNED.items():
        os.environ.setdefault(k, v)
    return os.environ.get(ENV_ATEN, "").strip().lower() == PINNED[ENV_ATEN]


def cpu_numerics() -> dict[str, Any]:
    """What a run's CPU numerics were: torch's kernel capability in use (``"AVX2"``, ``"AVX512"``, ...), the
    pinning variables as the process has them, the CPU's architecture. Runs with different ``torch_cpu_capability``
    are not bit-comparable; pinned runs gave equal numbers on an Intel Xeon and an AMD EPYC (module doc)."""
    import torch

    return {
        "torch_cpu_capability": str(torch.backends.cpu.get_cpu_capability()),
        "env": {k: _short(v) for k, v in _pinned_env().items()},
        "arch": platform.machine(),
    }


def _pinned_env() -> dict[str, str | None]:
    """The pinning variables as the process has them (recorded in results, never parsed)."""
    aten, mkl, onednn = os.environ.get(ENV_ATEN), os.environ.get(ENV_MKL), os.environ.get(ENV_ONEDNN)
    return {ENV_ATEN: aten, ENV_MKL: mkl, ENV_ONEDNN: onednn}


def _short(v: str | None) -> str | None:
    return v if v is None else v[:64]
