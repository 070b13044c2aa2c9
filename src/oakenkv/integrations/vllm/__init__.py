"""vLLM plugin: vLLM stores its KV cache in Oaken's format and reads it back inside attention (``docs/vllm.md``).

Use::

    pip install "oakenkv[vllm]"
    oakenkv export --model MODEL --preset oaken-plus --out DIR    # folded weights + DIR/oakenkv-profile.json
    python -m vllm.entrypoints.openai.api_server --model DIR ...  # serves DIR with Oaken's KV cache

or, with a profile of the paper's method for an unchanged model, ``OAKENKV_VLLM_PROFILE=thresholds.json`` before
starting vLLM (in Python: :func:`enable` before building ``vllm.LLM``).

vLLM calls :func:`register` in every process it starts (entry point group ``vllm.general_plugins``). It registers
the ``OAKEN`` attention backend and, because vLLM's CPU platform ignores the backend a user selects
(``CpuPlatform.get_attn_backend_cls`` always returns ``CPU_ATTN``), overrides ``CPU_ATTN`` through vLLM's
``register_backend`` with :mod:`~oakenkv.integrations.vllm.select`, which resolves in the worker, once the served
model is known: to the Oaken backend when ``OAKENKV_VLLM_PROFILE`` names a profile or the served directory holds
one (``oakenkv-profile.json``), else to vLLM's own CPU backend, unchanged.

Settings (environment variables, read in every vLLM process):

- ``OAKENKV_VLLM_PROFILE``: the profile file (``oakenkv profile`` / ``oakenkv export``); without it the plugin uses
  the served directory's ``oakenkv-profile.json`` when there is one.
- ``OAKENKV_VLLM_SPARSE_BYTES``: sparse (COO) capacity per token and kind in a block, bytes; default
  ``1.35 x D x (outer_ratio + inner_ratio)``.
- ``OAKENKV_VLLM_OVERFLOW``: ``clip`` (default) or ``error``: what happens to a token whose COO record does not
  fit in its block (``docs/vllm.md``, "Overflow").
- ``OAKENKV_VLLM_ATTENTION_THREADS``: threads of the decode-attention kernel (default: torch's thread count in the
  worker, which vLLM sets to the cores it was given; the kernel splits (row, token range) work items over them
  once a step holds ``PARALLEL_MIN_TOKENS`` (row, token) pairs, else runs on the worker's thread).
- ``OAKENKV_VLLM_ATTENTION_CPUS``: CPUs (``1``, ``2,3``, ``4-7``) for threads of the plugin's own, one bound to each,
  that share every decode step's rows with the worker's thread (``layout.RowThreads``). Off by default. vLLM binds
  the worker and its OpenMP threads (numba's too) to the cores it gives the worker; this puts the decode kernel on
  cores vLLM left out, such as the one it reserves for the engine process on a machine of few cores.
- ``OAKENKV_VLLM_KERNELS``: ``numba`` (default) or ``triton``: on vLLM's CPU engine, the device backend
  (``OAKEN_CUDA``, ``cuda.py``: the Triton kernels) instead of the CPU one; with ``TRITON_INTERPRET=1`` that is how
  its tests run it inside vLLM without a GPU. vLLM's CUDA engine always takes the device backend.

Importing this module imports neither vLLM nor torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from oakenkv.integrations.vllm.served import PROFILE_FILE, ServedWeightsError, check_weights, export_record

#: The vLLM version this plugin was written against; others are refused by :func:`register`.
SUPPORTED_VLLM = "0.32.0"
#: Name of the attention backend.
BACKEND_NAME = "OAKEN"
BACKEND_PATH = "oakenkv.integrations.vllm.backend.OakenAttentionBackend"
#: What ``CPU_ATTN`` is overridden with: a name resolved per process (:mod:`oakenkv.integrations.vllm.select`).
SELECT_PATH = "oakenkv.integrations.vllm.select.Backend"
#: The backend on the pools' device (the Triton kernels: vLLM's CUDA engine; ``cuda.py``).
CUDA_BACKEND_NAME = "OAKEN_CUDA"
CUDA_BACKEND_PATH = "oakenkv.integrations.vllm.cuda.OakenCudaAttentionBackend"
#: What ``FLASH_ATTN`` (CUDA's first choice) is overridden with: the Oaken device backend when a profile serves the
#: model, else vLLM's own.
SELECT_CUDA_PATH = "oakenkv.integrations.vllm.select.CudaBackend"
#: ``triton``: the CPU engine uses the device backend too (its Triton kernels on CPU tensors: with
#: ``TRITON_INTERPRET=1``, how the tests run it inside vLLM without a GPU); unset or ``numba``: the CPU backend.
ENV_KERNELS = "OAKENKV_VLLM_KERNELS"

ENV_PROFILE = "OAKENKV_VLLM_PROFILE"
ENV_SPARSE_BYTES = "OAKENKV_VLLM_SPARSE_BYTES"
ENV_OVERFLOW = "OAKENKV_VLLM_OVERFLOW"
ENV_THREADS = "OAKENKV_VLLM_ATTENTION_THREADS"
ENV_CPUS = "OAKENKV_VLLM_ATTENTION_CPUS"

#: Profiles parsed in this process, by the sha256 of the file's bytes (a file edited on disk is parsed again).
_PROFILES: dict[str, Any] = {}
#: The most sparse bytes per token and kind ``OAKENKV_VLLM_SPARSE_BYTES`` may ask for: a token's sparse record is at
#: most 65535 bytes (its 16-bit length), so more is never used.
MAX_SPARSE_BYTES = 65535
#: The most decode-attention threads ``OAKENKV_VLLM_ATTENTION_THREADS`` may ask for.
MAX_THREADS = 1024
_LOCK = threading.Lock()
#: The settings the worker resolved for the served model (:func:`activate`), when the environment names no profile.
_ACTIVE: Settings | None = None
#: The served model (vLLM's ``model``) :func:`activate` last decided for.
_ACTIVE_FOR: str | None = None


@dataclass(frozen=True)
class Settings:
    """The plugin's configuration (module docstring)."""

    profile: Path
    sparse_bytes_per_token: float | None = None
    overflow: str = "clip"
    #: Threads of the decode-attention kernel; None: torch's thread count in the worker.
    attention_threads: int | None = None
    #: CPUs of the plugin's own decode threads, one thread bound to each (``layout.RowThreads``); () for none.
    attention_cpus: tuple[int, ...] = ()
    #: ``numba`` (the CPU backend on the CPU engine) or ``triton`` (the device backend there too: ``ENV_KERNELS``).
    kernels: str = "numba"

    @classmethod
    def from_env(cls, profile: str | os.PathLike[str] | None = None) -> Settings | None:
        """The settings from the environment, or None when it names no profile and ``profile`` (a file found by
        other means: the served directory's) is None. Raises ValueError for invalid values: every number is finite
        and within its range (``oakenkv.util.exact.env_number``: ``inf`` or ``1e15`` sparse bytes would size blocks
        of exabytes)."""
        from oakenkv.util.exact import env_number

        path = os.environ.get(ENV_PROFILE, "").strip() or (str(profile) if profile is not None else "")
        if not path:
            return None
        overflow = os.environ.get(ENV_OVERFLOW, "").strip() or "clip"
        if overflow not in ("clip", "error"):
            raise ValueError(f"{ENV_OVERFLOW} must be 'clip' or 'error', got {overflow[:40]!r}")
        sparse_bytes = env_number(ENV_SPARSE_BYTES, None, 0, MAX_SPARSE_BYTES, what="a number of bytes")
        if sparse_bytes is not None and not sparse_bytes > 0:
            raise ValueError(f"{ENV_SPARSE_BYTES} must be > 0, got {sparse_bytes!r}")
        threads = env_number(ENV_THREADS, None, 1, MAX_THREADS, integer=True, what="a number of threads")
        cpus = parse_cpus(os.environ.get(ENV_CPUS, ""), ENV_CPUS)
        kernels = os.environ.get(ENV_KERNELS, "").strip() or "numba"
        if kernels not in ("numba", "triton"):
            raise ValueError(f"{ENV_KERNELS} must be 'numba' or 'triton', got {kernels[:40]!r}")
        return cls(
            Path(path).expanduser().resolve(), sparse_bytes, overflow, None if threads is None else int(threads), cpus,
            kernels,
        )  # fmt: skip


def parse_cpus(text: str, what: str = "CPU list") -> tuple[int, ...]:
    """CPU ids from a list such as ``1``, ``2,3`` or ``4-7,9`` (Linux's cpulist format): sorted, without
    repeats; ``()`` for an empty string. Raises ValueError naming ``what`` for anything else, or for a CPU this
    machine does not have."""
    text = text.strip()
    if not text:
        return ()
    ncpu = os.cpu_count() or 1
    cpus: set[int] = set()
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            a, b = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"{what} must be CPU ids such as 1, 2,3 or 4-7, got {text[:40]!r}") from None
        if not 0 <= a <= b:
            raise ValueError(f"{what}: {part.strip()!r} is not a CPU id or an increasing range")
        if b >= ncpu:
            raise ValueError(f"{what}: CPU {b} does not exist (this machine has CPUs 0-{ncpu - 1})")
        cpus.update(range(a, b + 1))
    if len(cpus) > MAX_THREADS:
        raise ValueError(f"{what}: at most {MAX_THREADS} CPUs")
    return tuple(sorted(cpus))


def _check_version() -> None:
    import vllm

    if vllm.__version__ != SUPPORTED_VLLM:
        raise RuntimeError(
            f"oakenkv's vLLM plugin supports vLLM {SUPPORTED_VLLM} (it relies on its attention-backend interface), "
            f"found {vllm.__version__}; install `oakenkv[vllm]`, or unset {ENV_PROFILE} and serve a directory "
            f"without {PROFILE_FILE}"
        )


#: The dense slot width (``OakenConfig.middle_bits``) the plugin's blocks hold; the presets of other widths
#: (oaken-plus-2, -3, -5, -6, -7) run in OakenCache and eval only.
SERVED_SLOT_BITS = 4


def slot_refusal(middle_bits: int) -> str | None:
    """Why the plugin cannot serve ``middle_bits``-bit dense slots, or None when it can (:func:`check_profile`, and
    ``oakenkv export`` before any work)."""
    if middle_bits == SERVED_SLOT_BITS:
        return None
    return (
        f"the vLLM plugin's blocks hold {SERVED_SLOT_BITS}-bit dense slots, not {middle_bits}-bit ones (oaken-plus-2, "
        "-3, -5, -6 and -7 run in OakenCache and eval only, for now)"
    )


#: What the plugin says to a profile with static levels (``OakenConfig.static_levels``): its blocks and kernels
#: read records of one static grid per layer and kind, not a level byte per row.
LEVELS_REFUSED = (
    "the vLLM plugin serves one static middle/inner grid per layer (OakenConfig.static_grids), not static levels "
    "(OakenConfig.static_levels, a level byte per record); this profile runs in OakenCache and eval only, for now"
)


def check_profile(thr: Any, path: os.PathLike[str] | str) -> None:
    """Raise ValueError, naming the reason, when the plugin cannot serve with profile ``thr`` (a ``Thresholds``);
    NotImplementedError for static levels (:data:`LEVELS_REFUSED`).
    Static middle/inner grids (``OakenConfig.static_grids``) are served: the blocks hold the outer scales alone.

    oaken-plus profiles are served: their online parts (the key shift and rotation, the 16-bit sink tokens) are
    applied by the plugin, their weight parts must be folded into the served weights (:func:`check_served`)."""
    cfg = thr.config
    if cfg.granularity != "token":
        raise ValueError(f"{path}: the vLLM plugin quantizes one row per token (granularity 'token')")
    if cfg.key_position != "post_rope":
        raise ValueError(f"{path}: vLLM caches keys after RoPE; profile with key_position='post_rope'")
    if cfg.scale_dtype != "float16":
        raise ValueError(f"{path}: the vLLM plugin stores fp16 scales; this profile uses float32 scales")
    refused = slot_refusal(cfg.middle_bits)
    if refused is not None:
        raise ValueError(f"{path}: {refused}")
    if cfg.static_levels:
        raise NotImplementedError(f"{path}: {LEVELS_REFUSED}")


def load_profile(path: os.PathLike[str] | str) -> Any:
    """The profile file as a ``Thresholds``, checked by :func:`check_profile`. Parsed once per content: the file is
    read at every call (a regular file under ``Thresholds``' size cap) and a changed file is parsed again, so an
    edited profile is never served from a stale copy, nor one it was corrupted into (that raises)."""
    # oakenkv.calibrate.thresholds directly, not through _oaken: register() runs this in every vLLM process, and _oaken
    # imports numba. With llvmlite loaded before vLLM 0.32's CPU worker starts, the worker's Triton kernel-override
    # scan (vllm/triton_utils/dispatcher.py, _rebind_kernels: vars() of every module attribute) trips on llvmlite's
    # lazy library object and the worker fails to start. Loading a profile needs neither numba nor torch.
    from oakenkv.calibrate.thresholds import MAX_FILE_BYTES, Thresholds, ThresholdsFileError
    from oakenkv.util.paths import check_input_file

    path = check_input_file(path, "the profile", MAX_FILE_BYTES)
    data = path.read_bytes()
    key = hashlib.sha256(data).hexdigest()
    with _LOCK:
        thr = _PROFILES.get(key)
        if thr is None:
            try:
                thr = Thresholds.from_dict(json.loads(data), source=str(path))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ThresholdsFileError(f"{path}: not a profile file ({e})") from None
            check_profile(thr, path)
            _PROFILES[key] = thr
        return thr


def fold_mark(hf_config: Any) -> str | None:
    """The digest of the oaken-plus transforms folded into the served weights, as their ``config.json`` records it
    (``oakenkv.calibrate.transforms.FOLD_MARK``, written by ``oakenkv export``), or None."""
    return getattr(hf_config, "oakenkv_transforms", None)


def check_served(thr: Any, path: os.PathLike[str] | str, model_dir: str | None, hf_config: Any) -> None:
    """Raise ValueError, naming the reason, when profile ``thr`` (read from ``path``) does not fit the served model:
    its shape (``hf_config``), the transforms folded into its weights (the config's fold mark), and, for an
    exported profile, the weights themselves by content (:func:`~oakenkv.integrations.vllm.served.check_weights` on
    ``model_dir``'s safetensors files)."""
    if hf_config is not None:
        thr.check_model(hf_config)
        mark = fold_mark(hf_config)
        t = thr.transforms
        if t is None and mark is not None:
            raise ValueError(
                f"{path}: the served weights carry oaken-plus transforms ({mark[:12]}...) but this profile has none; "
                f"serve them with the profile they were exported with ({PROFILE_FILE} in their directory)"
            )
        if t is not None and mark != t.digest():
            got = "no transforms" if mark is None else f"other transforms ({mark[:12]}...)"
            raise ValueError(
                f"{path}: this oaken-plus profile's transforms ({t.digest()[:12]}...) must be folded into the served "
                f"weights, which carry {got}; export the model with `oakenkv export --preset oaken-plus` and serve "
                "that directory"
            )
    if export_record(thr.profile) is not None:
        if model_dir is None or not Path(model_dir).is_dir():
            raise ValueError(f"{path}: an exported profile is served from its local directory, not {model_dir!r}")
        try:
            check_weights(thr.profile, model_dir, str(path))
        except ServedWeightsError as e:
            raise ValueError(str(e)) from None


def discover(model_dir: str | os.PathLike[str] | None) -> Path | None:
    """The profile inside a served model directory (``oakenkv-profile.json``), or None."""
    if not model_dir:
        return None
    candidate = Path(model_dir).expanduser() / PROFILE_FILE
    if candidate.is_file():
        return candidate.resolve()
    if os.path.lexists(candidate):  # a directory, a dangling link, a pipe: not silently vLLM's own cache
        raise ValueError(
            f"{candidate} is not a regular profile file (a directory, a broken link or a special file): the plugin "
            "cannot tell which KV cache to serve; replace it with the export's profile or remove it"
        )
    return None


def activate(model_dir: str | None, hf_config: Any) -> Settings | None:
    """Decide, in a vLLM worker about to build its model, whether the plugin serves it: the settings (the profile
    ``OAKENKV_VLLM_PROFILE`` names, else the served directory's) after every check of the profile against the served
    model (:func:`check_profile`, :func:`check_served`), or None (vLLM's own KV cache). Raises for a profile that
    cannot be served, with the reason, before any weight is loaded."""
    global _ACTIVE, _ACTIVE_FOR
    _ACTIVE_FOR = None if model_dir is None else str(model_dir)
    settings = Settings.from_env(discover(model_dir))
    if settings is None:
        _ACTIVE = None
        return None
    if not settings.profile.is_file():
        raise FileNotFoundError(f"{ENV_PROFILE}={settings.profile}: no such profile file (`oakenkv profile`)")
    _check_version()
    thr = load_profile(settings.profile)
    check_served(thr, settings.profile, model_dir, hf_config)
    _ACTIVE = settings
    return settings


def settings() -> Settings | None:
    """The plugin's settings in this process: the environment's, else what :func:`activate` found."""
    return Settings.from_env() or _ACTIVE


def settings_for(model_dir: str | None, hf_config: Any) -> Settings:
    """The settings of the engine that serves ``model_dir``, when its attention backend is built. vLLM caches the
    backend class per process (keyed by head size and dtype, not by model): a second engine of the same process
    gets the class chosen for the first without asking :mod:`select` again, so the decision is made again here for
    the model served now (its own profile, checked), and an engine whose model has no profile is refused instead
    of served with the first engine's."""
    if model_dir is not None and str(model_dir) != _ACTIVE_FOR and activate(model_dir, hf_config) is None:
        raise RuntimeError(
            f"vLLM chose the Oaken attention backend for an earlier engine of this process and reuses it for "
            f"{model_dir}, which has no Oaken profile ({ENV_PROFILE} unset, no {PROFILE_FILE}); build each "
            "engine in its own process (vLLM's default, VLLM_ENABLE_V1_MULTIPROCESSING=1)"
        )
    s = settings()
    if s is None:
        raise RuntimeError(
            f"the Oaken attention backend needs a profile: {ENV_PROFILE}, or an `oakenkv export` directory"
        )
    return s


def register() -> None:
    """vLLM's general-plugin hook (idempotent): register the ``OAKEN`` backend and point ``CPU_ATTN`` at the
    per-process selector (module docstring). With ``OAKENKV_VLLM_PROFILE`` set, the profile is checked here already
    (a profile the plugin cannot serve fails at start-up, with its reason); without it, a vLLM version the plugin
    does not support leaves vLLM untouched."""
    env = Settings.from_env()
    if env is not None:
        if not env.profile.is_file():
            raise FileNotFoundError(f"{ENV_PROFILE}={env.profile}: no such profile file (`oakenkv profile`)")
        _check_version()
        load_profile(env.profile)
    else:
        try:
            import vllm
        except ImportError:
            return
        if vllm.__version__ != SUPPORTED_VLLM:
            return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if BACKEND_NAME not in AttentionBackendEnum.__members__:
        register_backend(BACKEND_NAME, BACKEND_PATH)
    if CUDA_BACKEND_NAME not in AttentionBackendEnum.__members__:
        register_backend(CUDA_BACKEND_NAME, CUDA_BACKEND_PATH)
    # CUDA's platform walks FLASH_ATTN first when no backend is selected (vllm/platforms/cuda.py): the same kind of
    # selector, so that a served profile gets the device backend without a flag (on the CPU engine never consulted).
    register_backend(AttentionBackendEnum.FLASH_ATTN, SELECT_CUDA_PATH)
    # The CPU platform always picks CPU_ATTN (vllm/platforms/cpu.py, CpuPlatform.get_attn_backend_cls): override
    # that member, through vLLM's own registry (register_backend documents overriding an existing backend), with the
    # selector, which gives back vLLM's own class unless the served model is to be served with Oaken.
    register_backend(AttentionBackendEnum.CPU_ATTN, SELECT_PATH)


def enable(
    profile: str | os.PathLike[str],
    *,
    sparse_bytes_per_token: float | None = None,
    overflow: str = "clip",
    attention_threads: int | None = None,
    attention_cpus: str | None = None,
    kernels: str = "numba",
) -> None:
    """Turn the plugin on with ``profile`` for vLLM engines built afterwards in this process and the processes it
    starts (to serve an exported directory, nothing needs turning on)."""
    os.environ[ENV_PROFILE] = str(Path(profile).expanduser().resolve())
    _set_env(sparse_bytes_per_token, overflow, attention_threads, attention_cpus, kernels)
    Settings.from_env()  # validate now, not in a worker
    register()


def configure(
    *,
    sparse_bytes_per_token: float | None = None,
    overflow: str = "clip",
    attention_threads: int | None = None,
    attention_cpus: str | None = None,
    kernels: str = "numba",
) -> None:
    """Set the optional settings (module docstring) for engines built afterwards, without naming a profile (for
    an exported directory, whose profile the plugin finds itself)."""
    _set_env(sparse_bytes_per_token, overflow, attention_threads, attention_cpus, kernels)
    Settings.from_env(os.environ.get(ENV_PROFILE) or "(found in the served directory)")  # validate them now
    register()


def _set_env(
    sparse_bytes_per_token: float | None,
    overflow: str,
    attention_threads: int | None,
    attention_cpus: str | None,
    kernels: str = "numba",
) -> None:
    os.environ[ENV_KERNELS] = kernels
    if attention_cpus is None:
        os.environ.pop(ENV_CPUS, None)
    else:
        os.environ[ENV_CPUS] = attention_cpus
    if attention_threads is None:
        os.environ.pop(ENV_THREADS, None)
    else:
        os.environ[ENV_THREADS] = str(attention_threads)
    if sparse_bytes_per_token is None:
        os.environ.pop(ENV_SPARSE_BYTES, None)
    else:
        os.environ[ENV_SPARSE_BYTES] = repr(float(sparse_bytes_per_token))
    os.environ[ENV_OVERFLOW] = overflow


def disable() -> None:
    """Turn the plugin off for engines built afterwards (already built engines keep it)."""
    global _ACTIVE, _ACTIVE_FOR
    for key in (ENV_PROFILE, ENV_SPARSE_BYTES, ENV_OVERFLOW, ENV_THREADS, ENV_CPUS, ENV_KERNELS):
        os.environ.pop(key, None)
    _ACTIVE = None
    _ACTIVE_FOR = None
    try:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
    except ImportError:
        return
    AttentionBackendEnum.CPU_ATTN.clear_override()
    AttentionBackendEnum.FLASH_ATTN.clear_override()


__all__ = [
    "BACKEND_NAME",
    "PROFILE_FILE",
    "SERVED_SLOT_BITS",
    "SUPPORTED_VLLM",
    "Settings",
    "activate",
    "check_profile",
    "check_served",
    "configure",
    "disable",
    "discover",
    "enable",
    "load_profile",
    "register",
    "settings",
    "settings_for",
    "slot_refusal",
]
