"""vLLM plugin: vLLM stores its KV cache in Oaken's format and reads it back inside attention (``docs/vllm.md``).

Use::

    pip install "oakenkv[vllm]"
    oakenkv profile --model MODEL --out thresholds.json
    OAKENKV_VLLM_PROFILE=thresholds.json vllm serve MODEL_DIR ...

or in Python, before building ``vllm.LLM``::

    from oakenkv.integrations.vllm import enable
    enable("thresholds.json")

vLLM calls :func:`register` in every process it starts (entry point group ``vllm.general_plugins``). It does
nothing unless ``OAKENKV_VLLM_PROFILE`` names a profile; then it registers the ``OAKEN`` attention backend and,
because vLLM's CPU platform ignores the backend a user selects (``CpuPlatform.get_attn_backend_cls`` always
returns ``CPU_ATTN``), overrides ``CPU_ATTN`` with it through vLLM's ``register_backend``.

Settings (environment variables, read in every vLLM process):

- ``OAKENKV_VLLM_PROFILE``: the thresholds file (``oakenkv profile``); enables the plugin.
- ``OAKENKV_VLLM_SPARSE_BYTES``: sparse (COO) capacity per token and kind in a block, bytes; default
  ``1.35 x D x (outer_ratio + inner_ratio)``.
- ``OAKENKV_VLLM_OVERFLOW``: ``clip`` (default) or ``error``: what happens to a token whose COO record does not
  fit in its block (``docs/vllm.md``, "Overflow").
- ``OAKENKV_VLLM_ATTENTION_THREADS``: threads of the decode-attention kernel for long contexts (default 1: the
  kernel runs on the worker's thread, as vLLM's CPU worker runs torch on one thread per core it was given; on a
  busy 2-core machine numba's OpenMP threads spinning beside it made decode steps 2-20x slower).

Importing this module imports neither vLLM nor torch.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The vLLM version this plugin was written against; others are refused by :func:`register`.
SUPPORTED_VLLM = "0.32.0"
#: Name of the attention backend.
BACKEND_NAME = "OAKEN"
BACKEND_PATH = "oakenkv.integrations.vllm.backend.OakenAttentionBackend"

ENV_PROFILE = "OAKENKV_VLLM_PROFILE"
ENV_SPARSE_BYTES = "OAKENKV_VLLM_SPARSE_BYTES"
ENV_OVERFLOW = "OAKENKV_VLLM_OVERFLOW"
ENV_THREADS = "OAKENKV_VLLM_ATTENTION_THREADS"

#: Per path: the file's identity when it was read (inode, size, modification and change times) and its profile.
_PROFILES: dict[Path, tuple[tuple[int, ...], Any]] = {}
#: The most sparse bytes per token and kind ``OAKENKV_VLLM_SPARSE_BYTES`` may ask for: a token's sparse record is at
#: most 65535 bytes (its 16-bit length), so more is never used.
MAX_SPARSE_BYTES = 65535
#: The most decode-attention threads ``OAKENKV_VLLM_ATTENTION_THREADS`` may ask for.
MAX_THREADS = 1024
_LOCK = threading.Lock()


@dataclass(frozen=True)
class Settings:
    """The plugin's configuration, from the environment (module docstring)."""

    profile: Path
    sparse_bytes_per_token: float | None = None
    overflow: str = "clip"
    attention_threads: int = 1

    @classmethod
    def from_env(cls) -> Settings | None:
        """The settings, or None when the plugin is not enabled. Raises ValueError for invalid values: every number
        is finite and within its range (``oakenkv.util.exact.env_number``: ``inf`` or ``1e15`` sparse bytes would
        size blocks of exabytes)."""
        from oakenkv.util.exact import env_number

        path = os.environ.get(ENV_PROFILE, "").strip()
        if not path:
            return None
        overflow = os.environ.get(ENV_OVERFLOW, "").strip() or "clip"
        if overflow not in ("clip", "error"):
            raise ValueError(f"{ENV_OVERFLOW} must be 'clip' or 'error', got {overflow[:40]!r}")
        sparse_bytes = env_number(ENV_SPARSE_BYTES, None, 0, MAX_SPARSE_BYTES, what="a number of bytes")
        if sparse_bytes is not None and not sparse_bytes > 0:
            raise ValueError(f"{ENV_SPARSE_BYTES} must be > 0, got {sparse_bytes!r}")
        threads = env_number(ENV_THREADS, 1, 1, MAX_THREADS, integer=True, what="a number of threads")
        return cls(Path(path).expanduser().resolve(), sparse_bytes, overflow, int(threads))


def _check_version() -> None:
    import vllm

    if vllm.__version__ != SUPPORTED_VLLM:
        raise RuntimeError(
            f"oakenkv's vLLM plugin supports vLLM {SUPPORTED_VLLM} (it relies on its attention-backend interface), "
            f"found {vllm.__version__}; install `oakenkv[vllm]` or unset {ENV_PROFILE}"
        )


def check_profile(thr: Any, path: os.PathLike[str] | str) -> None:
    """Raise ValueError, naming the reason, when the plugin cannot serve with profile ``thr`` (a ``Thresholds``)."""
    cfg = thr.config
    if thr.transforms is not None:
        raise ValueError(
            f"{path}: this profile carries oaken-plus transforms (schema_version 2); the vLLM plugin does not "
            "apply them yet (the online key transform and the query rotation), so its KV cache would be wrong. "
            "Use a profile of the paper's method (`oakenkv profile` without --preset oaken-plus)"
        )
    if cfg.granularity != "token":
        raise ValueError(f"{path}: the vLLM plugin quantizes one row per token (granularity 'token')")
    if cfg.key_position != "post_rope":
        raise ValueError(f"{path}: vLLM caches keys after RoPE; profile with key_position='post_rope'")
    if cfg.scale_dtype != "float16":
        raise ValueError(f"{path}: the vLLM plugin stores fp16 scales; this profile uses float32 scales")


def load_profile(path: os.PathLike[str] | str) -> Any:
    """The thresholds file as a ``Thresholds``, checked by :func:`check_profile`; read again whenever the file is not
    the one read last (another inode, size, modification or change time: an edit, a copy over it, a new profile
    saved in its place), so a process never serves a profile the file no longer holds, nor one it was corrupted
    into (that raises)."""
    # oakenkv.calibrate.thresholds directly, not through _oaken: register() runs this in every vLLM process, and _oaken
    # imports numba. With llvmlite loaded before vLLM 0.32's CPU worker starts, the worker's Triton kernel-override
    # scan (vllm/triton_utils/dispatcher.py, _rebind_kernels: vars() of every module attribute) trips on llvmlite's
    # lazy library object and the worker fails to start. Loading a profile needs neither numba nor torch.
    from oakenkv.calibrate.thresholds import Thresholds

    path = Path(path)
    with _LOCK:
        st = path.stat()  # (taken before the read: a change during it is seen at the next call)
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        cached = _PROFILES.get(path)
        if cached is not None and cached[0] == key:
            return cached[1]
        _PROFILES.pop(path, None)
        thr = Thresholds.load(path)
        check_profile(thr, path)
        _PROFILES[path] = (key, thr)
        return thr


def register() -> None:
    """vLLM's general-plugin hook: register the Oaken backend when ``OAKENKV_VLLM_PROFILE`` is set (idempotent)."""
    settings = Settings.from_env()
    if settings is None:
        return
    if not settings.profile.is_file():
        raise FileNotFoundError(f"{ENV_PROFILE}={settings.profile}: no such thresholds file (`oakenkv profile`)")
    _check_version()
    load_profile(settings.profile)  # a profile the plugin cannot serve fails here, at start-up, with its reason
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if BACKEND_NAME not in AttentionBackendEnum.__members__:
        register_backend(BACKEND_NAME, BACKEND_PATH)
    # The CPU platform always picks CPU_ATTN (vllm/platforms/cpu.py, CpuPlatform.get_attn_backend_cls): override
    # that member, through vLLM's own registry (register_backend documents overriding an existing backend).
    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_PATH)


def enable(
    profile: str | os.PathLike[str],
    *,
    sparse_bytes_per_token: float | None = None,
    overflow: str = "clip",
    attention_threads: int = 1,
) -> None:
    """Turn the plugin on for vLLM engines built afterwards in this process and the processes it starts."""
    os.environ[ENV_PROFILE] = str(Path(profile).expanduser().resolve())
    os.environ[ENV_THREADS] = str(attention_threads)
    if sparse_bytes_per_token is None:
        os.environ.pop(ENV_SPARSE_BYTES, None)
    else:
        os.environ[ENV_SPARSE_BYTES] = repr(float(sparse_bytes_per_token))
    os.environ[ENV_OVERFLOW] = overflow
    Settings.from_env()  # validate now, not in a worker
    register()


def disable() -> None:
    """Turn the plugin off for engines built afterwards (already built engines keep it)."""
    for key in (ENV_PROFILE, ENV_SPARSE_BYTES, ENV_OVERFLOW, ENV_THREADS):
        os.environ.pop(key, None)
    try:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
    except ImportError:
        return
    AttentionBackendEnum.CPU_ATTN.clear_override()


__all__ = [
    "BACKEND_NAME",
    "SUPPORTED_VLLM",
    "Settings",
    "check_profile",
    "disable",
    "enable",
    "load_profile",
    "register",
]
