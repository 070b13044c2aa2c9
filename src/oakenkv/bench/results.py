"""One writer of benchmark results: ``benchmarks/results/<benchmark>/<point>.json``, one current file per benchmark
and point, each with what a reader needs to trust it (the command, the code, the machine and its load).

History stays in git: a rerun replaces the point's file. :func:`save` adds a ``meta`` object to the payload:

- ``command``: the command line that ran (``sys.argv``, as typed);
- ``commit``: the git commit of the code (and whether the tree had uncommitted changes), when run from a checkout;
- ``machine``: CPU model, logical CPUs, the SIMD extensions the kernels care about (AVX2, AVX-512), memory;
- ``load``: the 1/5/15-minute load averages when the run started (:func:`start`) and when it was saved;
- ``versions``: python, torch, numba, transformers (those imported);
- ``date`` (UTC) and ``seconds`` (from :func:`start` to :func:`save`).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from oakenkv.util.paths import atomic_write
from oakenkv.util.resources import cpu_model_and_flags

__all__ = ["DEFAULT_ROOT", "machine", "meta", "save", "start"]

#: Where results go when run from a checkout: ``benchmarks/results`` of the repository (else ``./benchmarks/...``).
DEFAULT_ROOT = Path("benchmarks") / "results"

_STARTED: dict[str, Any] = {}
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # not on every platform
        return None


def start() -> None:
    """Note the start of a run (time and load); :func:`save` reports both."""
    _STARTED.update(time=time.perf_counter(), load=_loadavg())


def machine() -> dict[str, Any]:
    """The machine a result was measured on."""
    model, flags = cpu_model_and_flags()
    mem = None
    with contextlib.suppress(ValueError, OSError, AttributeError):
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "cpu": model,
        "logical_cpus": os.cpu_count(),
        "simd": sorted(f for f in flags if f in ("avx2", "avx512f", "avx512bw", "avx512vnni", "fma")),
        "memory_bytes": mem,
        "system": f"{platform.system()} {platform.release()}",
    }


def _git() -> dict[str, Any] | None:
    root = Path(__file__).resolve().parents[3]
    if not (root / ".git").exists():
        return None
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode != 0:
        return None
    return {"commit": head.stdout.strip(), "uncommitted_changes": bool(dirty.stdout.strip())}


def meta() -> dict[str, Any]:
    """The ``meta`` object :func:`save` adds (also for results written elsewhere)."""
    versions = {"python": platform.python_version()}
    for name in ("torch", "numba", "transformers", "triton", "vllm"):
        module = sys.modules.get(name)
        if module is not None:
            versions[name] = getattr(module, "__version__", "?")
    seconds = time.perf_counter() - _STARTED["time"] if "time" in _STARTED else None
    return {
        "command": " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]) if sys.argv else None,
        "git": _git(),
        "machine": machine(),
        "load": {"start": _STARTED.get("load"), "end": _loadavg()},
        "versions": versions,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "seconds": None if seconds is None else round(seconds, 1),
    }


def result_path(benchmark: str, point: str, root: str | os.PathLike[str] | None = None) -> Path:
    """``<root>/<benchmark>/<point>.json``, the one current file of a benchmark's point. ``benchmark`` and
    ``point`` are file-name parts: letters, digits, ``._-``."""
    for what, name in (("benchmark", benchmark), ("point", point)):
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(f"{what} name {name!r} must be letters, digits, '.', '_' or '-'")
    return Path(DEFAULT_ROOT if root is None else root) / benchmark / f"{point}.json"


def save(
    benchmark: str,
    point: str,
    payload: dict[str, Any],
    root: str | os.PathLike[str] | None = None,
    *,
    path: str | os.PathLike[str] | None = None,
) -> Path:
    """Write ``payload`` with :func:`meta` as :func:`result_path` (replacing the point's previous result), or at
    ``path``, and return the path."""
    path = result_path(benchmark, point, root) if path is None else Path(path)
    body = {"meta": meta(), **{k: v for k, v in payload.items() if k != "meta"}}
    if isinstance(payload.get("meta"), dict):  # the benchmark's own settings stay, beside the run's
        body["settings"] = payload["meta"]
    return atomic_write(path, json.dumps(body, indent=2, default=str) + "\n")
