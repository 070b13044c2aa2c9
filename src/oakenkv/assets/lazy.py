"""A model whose large weights stay on disk until a forward pass needs them: one unit in memory at a time.

The ``oaken-plus`` search runs a model's decoder layers one at a time (``oakenkv.calibrate.recording``,
``stream_attention``), so it never needs more than one layer's weights at once; loading the whole model first made
the model itself the search's peak (Qwen2.5-Coder-0.5B: 630M float32 parameters, 2.4 GB, against ~310 MB for the
search's own buffers). :func:`load_lazy` builds the model's modules with their parameters on the ``meta`` device
(``accelerate.init_empty_weights``: buffers such as RoPE tables are made as usual), reads the small tensors (norms)
at once, and leaves the **units** on disk: the input embeddings, the output embeddings (the LM head) and every
decoder layer. A forward pre-hook reads a unit's tensors when it is called and releases the unit read before it, so
at most one unit is in memory (the largest: the embedding matrix, 544 MB for Qwen2.5-Coder-0.5B).

A unit is read with plain file reads from the safetensors file(s), never through a memory map: the pages of a
mapped file count in the process's resident memory for as long as it is mapped, which is what this module exists to
bound. Tensors are converted to the requested dtype as ``from_pretrained`` converts them, so the numbers (and
:func:`~oakenkv.calibrate.identity.weights_digest`, which reads them through :meth:`LazyWeights.tensor`) are the
eagerly loaded model's, bit for bit (``tests/test_lazy.py``).

What costs: a unit is read again each time it is called after another one (a whole forward pass reads every unit
once, so running the model window by window reads it once per window: use it for work that runs layer by layer, as
the oaken-plus search and the paper's profile do, not for generation). A forward set on a layer instance that
declares ``needs_weights = False`` (the stand-ins of ``stream_attention``) does not read the unit.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

__all__ = ["LazyWeights", "SafetensorsFile", "execution_device", "lazy_weights", "load_lazy"]

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
#: A safetensors header larger than this is refused as corrupt (the format's own reader caps it at 100 MB).
_MAX_HEADER = 100_000_000


class SafetensorsFile:
    """The tensors of one ``.safetensors`` file, read one at a time with ``readinto`` (no memory map)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise ValueError(f"{self.path}: not a safetensors file (shorter than its 8-byte header length)")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER:
                raise ValueError(f"{self.path}: safetensors header of {n} bytes (corrupt file?)")
            try:
                header = json.loads(f.read(n))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ValueError(f"{self.path}: unreadable safetensors header ({e})") from e
        if not isinstance(header, dict):
            raise ValueError(f"{self.path}: unreadable safetensors header (not a JSON object)")
        self._base = 8 + n
        header.pop("__metadata__", None)
        size = self.path.stat().st_size
        self.entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        for name, e in header.items():
            dtype = _DTYPES.get(e.get("dtype")) if isinstance(e, dict) else None
            if dtype is None:
                got = e.get("dtype") if isinstance(e, dict) else e
                raise ValueError(f"{self.path}: tensor {name!r} has the unsupported dtype {got!r}")
            try:
                start, end = (int(x) for x in e["data_offsets"])
                shape = tuple(int(s) for s in e["shape"])
            except (KeyError, TypeError, ValueError) as err:
                raise ValueError(f"{self.path}: tensor {name!r} has no valid shape and offsets ({err!r})") from err
            count = 1
            for s in shape:
                count *= s
            if end - start != count * dtype.itemsize or self._base + end > size:
                raise ValueError(f"{self.path}: tensor {name!r} does not fit its offsets (truncated or corrupt file?)")
            self.entries[name] = (dtype, shape, start, end)

    def read(self, name: str) -> torch.Tensor:
        """The tensor ``name``, in new memory of its stored dtype."""
        dtype, shape, start, end = self.entries[name]
        out = torch.empty(shape, dtype=dtype)
        if end > start:
            view = memoryview(out.view(-1).view(torch.uint8).numpy())
            with open(self.path, "rb") as f:
                f.seek(self._base + start)
                if f.readinto(view) != end - start:
                    raise ValueError(f"{self.path}: tensor {name!r} was cut short (file changed while reading?)")
        return out


def _weight_files(where: Path) -> dict[str, SafetensorsFile]:
    """Tensor name -> the file holding it, for a directory with ``model.safetensors`` or a sharded index."""
    single = where / "model.safetensors"
    if single.is_file():
        f = SafetensorsFile(single)
        return dict.fromkeys(f.entries, f)
    index = where / "model.safetensors.index.json"
    if not index.is_file():
        raise FileNotFoundError(f"{where}: no model.safetensors or model.safetensors.index.json to read lazily")
    shards: dict[str, SafetensorsFile] = {}
    out = {}
    for name, shard in json.loads(index.read_text())["weight_map"].items():
        if shard not in shards:
            shards[shard] = SafetensorsFile(where / shard)
        out[name] = shards[shard]
    return out


class LazyWeights:
    """The on-disk units of a model made by :func:`load_lazy` (module doc); ``model._oakenkv_lazy`` is this."""

    def __init__(self, model: torch.nn.Module, files: dict[str, SafetensorsFile], dtype: torch.dtype) -> None:
        self.files = files
        self.dtype = dtype
        # every parameter name, duplicates (tied weights) included, grouped by the placeholder they share
        by_param: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            by_param.setdefault(id(p), []).append(name)
        #: Parameter name -> the stored tensor's name (a tied LM head is stored once, under the embedding's name).
        self.source: dict[str, str] = {}
        for names in by_param.values():
            stored = [n for n in names if n in files]
            if not stored:
                raise ValueError(f"{names[0]!r} is in none of the model's safetensors files")
            for n in names:
                self.source[n] = stored[0]
        self.units: list[tuple[str, torch.nn.Module]] = _units(model)
        lazy = set()
        for prefix, unit in self.units:
            lazy.update(f"{prefix}.{n}" if prefix else n for n, _ in unit.named_parameters(remove_duplicate=False))
        self.lazy_names = frozenset(lazy)
        self.resident: tuple[str, torch.nn.Module] | None = None
        #: How many times a unit was read from disk.
        self.reads = 0
        for prefix, unit in self.units:
            unit.register_forward_pre_hook(self._pre_hook(prefix))

    def _slots(self, prefix: str, unit: torch.nn.Module) -> Iterator[tuple[torch.nn.Module, str, str]]:
        """(owning module, attribute, full parameter name) of every parameter of a unit."""
        for mod_name, mod in unit.named_modules(remove_duplicate=False):
            for attr in mod._parameters:
                full = ".".join(x for x in (prefix, mod_name, attr) if x)
                yield mod, attr, full

    def _pre_hook(self, prefix: str) -> Any:
        def hook(module: torch.nn.Module, args: Any) -> None:
            if getattr(module.__dict__.get("forward"), "needs_weights", True) is False:
                return
            self.load(prefix, module)

        return hook

    def tensor(self, name: str) -> torch.Tensor:
        """The parameter or buffer ``name`` as the eagerly loaded model holds it (read from disk, converted)."""
        t = self.files[self.source.get(name, name)].read(self.source.get(name, name))
        return t.to(self.dtype) if t.is_floating_point() and t.dtype != self.dtype else t

    def load(self, prefix: str, unit: torch.nn.Module) -> None:
        """Make ``unit`` resident (reading it from disk) and release the unit resident before."""
        if self.resident is not None and self.resident[1] is unit:
            return
        self.release()
        for mod, attr, full in self._slots(prefix, unit):
            p = mod._parameters[attr]
            if p is None:
                continue
            mod._parameters[attr] = torch.nn.Parameter(self.tensor(full), requires_grad=False)
            mod._parameters[attr]._oakenkv_placeholder = p  # type: ignore[attr-defined]
        self.resident = (prefix, unit)
        self.reads += 1

    def release(self) -> None:
        """Put the resident unit's placeholders back (its memory is freed once nothing else holds it)."""
        if self.resident is None:
            return
        prefix, unit = self.resident
        for mod, attr, _ in self._slots(prefix, unit):
            p = mod._parameters[attr]
            if p is not None and hasattr(p, "_oakenkv_placeholder"):
                mod._parameters[attr] = p._oakenkv_placeholder
        self.resident = None


def _units(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The input embeddings, the output embeddings and the decoder layers (every entry of the module list as long
    as the config's ``num_hidden_layers``), with their names."""
    names = {id(m): n for n, m in model.named_modules()}
    units: list[torch.nn.Module] = []
    for get in ("get_input_embeddings", "get_output_embeddings"):
        m = getattr(model, get, lambda: None)()
        if m is not None and m not in units:
            units.append(m)
    cfg = model.config.get_text_config(decoder=True)
    n = int(cfg.num_hidden_layers)
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == n]
    if not lists:
        raise ValueError(f"{type(model).__name__}: no list of {n} decoder layers to read lazily")
    units.extend(lists[0])
    return [(names[id(m)], m) for m in units]


def execution_device(model: Any) -> torch.device:
    """The device a model computes on: its first parameter's that is not a placeholder on the ``meta`` device (a
    model made by :func:`load_lazy` has its units there while they are on disk); the CPU if all are."""
    for p in model.parameters():
        if p.device.type != "meta":
            return p.device
    return torch.device("cpu")


def lazy_weights(model: Any) -> LazyWeights | None:
    """The :class:`LazyWeights` of a model made by :func:`load_lazy`, else None."""
    return getattr(model, "_oakenkv_lazy", None)


def load_lazy(where: str | os.PathLike[str], dtype: torch.dtype = torch.float32) -> Any:
    """A causal LM from a local directory of safetensors weights with its units left on disk (module doc), in eval
    mode on the CPU; ``lazy_weights(model)`` is its :class:`LazyWeights`."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    where = Path(where)
    files = _weight_files(where)
    config = AutoConfig.from_pretrained(where)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()  # (from_pretrained ties a tied LM head to the embeddings; from_config on meta may not)
    model.eval()
    lazy = LazyWeights(model, files, dtype)
    # the other parameters, and persistent buffers the file holds (those it does not are made by the constructor)
    eager = {
        n: lazy.tensor(n) for n in model.state_dict() if n not in lazy.lazy_names and (n in lazy.source or n in files)
    }
    model.load_state_dict(eager, strict=False, assign=True)  # (its keys come from the model's own state_dict)
    for p in model.parameters():
        p.requires_grad_(False)
    model._oakenkv_lazy = lazy
    return model
