"""`Thresholds`: the offline profile of one model, its JSON file format, and its validation.

Oaken (Kim et al., ISCA 2025, Section 4.2) splits every key and value vector into three groups with four
thresholds profiled offline once per model, per decoder layer and separately for keys and values::

    outer (lower)   middle (lower)   inner      middle (upper)   outer (upper)
    ------------ To_lo ---------- Ti_lo ---- Ti_hi ---------- To_hi ------------>  value

with ``To_lo < Ti_lo <= Ti_hi < To_hi`` (:class:`GroupThresholds`). The quantizer (``oakenkv.quant.quantizer``) reads
only these four numbers; the profiler (``oakenkv.calibrate.profile``) produces them.

File format (one JSON object, ``SCHEMA_VERSION`` 1)::

    {
      "format": "oakenkv-thresholds",
      "schema_version": 1,
      "config": {...OakenConfig.to_dict()...},
      "model": {"architecture": "llama", "num_layers": 30, "num_kv_heads": 3, "head_dim": 64,
                "name": "default", "weights": "sha256:..." or null},
      "layers": [
        {"index": 0,
         "key":   {"thresholds": [to_lo, ti_lo, ti_hi, to_hi], "stats": {...LayerStats...} or null},
         "value": {"thresholds": [...], "stats": ...}},
        ...
      ],
      "profile": {...free-form metadata: calibration source, window, runs, timing...}
    }

Floats are written with Python's shortest round-trip repr, so save -> load gives bit-identical thresholds.
The loader rejects truncated or corrupt JSON, another format or schema version, missing keys, unordered or
non-finite thresholds and a layer count that contradicts the model fingerprint, always with a
:class:`ThresholdsFileError` naming the file; loading for another model raises :class:`ModelMismatchError`.

The model's identity is its shape (:class:`ModelFingerprint`) and, since the profiler records it, the digest of
its weights (:func:`weights_digest`, the ``"weights"`` entry of ``"model"``): thresholds profiled for a base model
are refused for its fine-tune. Files written before the digest existed have ``"weights"`` absent (or null); they
still load, and checking them against a model compares the shape only and says so
(:class:`UnverifiedWeightsWarning`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import warnings
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from oakenkv.format.config import OakenConfig
from oakenkv.quant.groups import FLOAT32_MAX, GroupThresholds, as_float32, finite_float
from oakenkv.util.exact import is_int, one_of
from oakenkv.util.paths import atomic_write

__all__ = [
    "FLOAT32_MAX",
    "FORMAT_NAME",
    "MAX_FILE_BYTES",
    "SCHEMA_VERSION",
    "DuplicateThresholdsWarning",
    "GroupThresholds",
    "LayerStats",
    "ModelFingerprint",
    "ModelMismatchError",
    "Thresholds",
    "ThresholdsFileError",
    "UnverifiedWeightsWarning",
    "as_float32",
    "print_thresholds",
    "weights_digest",
]

#: Value of the file's "format" field (tells a thresholds file from any other JSON).
FORMAT_NAME = "oakenkv-thresholds"
#: Version of the file layout; bump when a field changes meaning. Loading another version is an error.
SCHEMA_VERSION = 1
#: Largest file :meth:`Thresholds.load` reads: a profile of 1000 layers with statistics is about 1 MB.
MAX_FILE_BYTES = 64 * 2**20
#: Most decoder layers a profile may describe (the largest models have a few hundred): bounds what a file costs to
#: read and print.
MAX_LAYERS = 4096
#: The layout of a profile that carries offline transforms (``oaken-plus``): version 1 plus a "transforms" object.
#: A reader that knows only version 1 refuses such a file instead of using its thresholds on an untransformed model.
SCHEMA_VERSION_TRANSFORMS = 2

Kind = Literal["key", "value"]
_KINDS: tuple[Kind, Kind] = ("key", "value")


class ThresholdsFileError(ValueError):
    """A thresholds file is unreadable, truncated, of another format/schema, or holds invalid values."""


class ModelMismatchError(ValueError):
    """Thresholds profiled for one model were used with another (different fingerprint)."""


class UnverifiedWeightsWarning(UserWarning):
    """A thresholds file without a weights digest (written before oakenkv recorded one) was checked against a
    model: only its shape could be compared, so a fine-tune of the profiled model would go unnoticed."""


class DuplicateThresholdsWarning(UserWarning):
    """Two decoder layers have bit-identical thresholds: almost surely a broken profile (e.g. one layer
    recorded twice, or the same tensor captured for every layer)."""


#: How :func:`weights_digest` spells a digest: the scheme, then 64 hex digits.
WEIGHTS_DIGEST_PREFIX = "sha256:"
_DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")


#: Per model object: the tensors' identity and version counters when :func:`weights_digest` last hashed them, and
#: the digest (weak keys: a model's entry goes with it).
_DIGESTS: weakref.WeakKeyDictionary[Any, tuple[tuple[Any, ...], str]] = weakref.WeakKeyDictionary()


def _versions(state: dict[str, Any]) -> tuple[Any, ...] | None:
    """What torch changes whenever a tensor of ``state`` is written or replaced: each one's storage, layout and
    version counter (bumped by every in-place op, ``load_state_dict`` included); None where a tensor keeps no
    counter (inference-mode tensors)."""
    try:
        return tuple(
            (
                n,
                t.device,
                t.untyped_storage().data_ptr(),
                t.storage_offset(),
                tuple(t.shape),
                t.stride(),
                t.dtype,
                t._version,
            )
            for n, t in state.items()
        )
    except (RuntimeError, AttributeError):
        return None


def weights_digest(model: Any, *, reuse: bool = True) -> str:
    """The identity of a model's weights by content: ``"sha256:<64 hex digits>"``, cheap enough to take per run.

    Over every entry of ``model.state_dict()`` (parameters and persistent buffers) in name order, one line
    ``name, dtype, shape, sha256 of the tensor's bytes`` (native byte order, row-major); the digest is the sha256
    of those lines. Tied tensors (one storage under two names, e.g. ``lm_head.weight``) are hashed once and listed
    under both names. Two models have the same digest iff they hold the same numbers under the same names (up to
    sha256 collisions): a fine-tune, another checkpoint of one family, or the same weights loaded in another
    dtype all differ. The config is not part of it (its shape is in :class:`ModelFingerprint`).

    Every byte is hashed, no sampling: the tensors are hashed in parallel threads (hashlib releases the GIL), about
    0.4-0.7 s for the 135M fp32 parameters (538 MB) of the default model on 2 busy cores, and linear in the bytes
    beyond (docs/robustness.md).

    The digest is remembered per model object, with each tensor's storage and version counter: a model whose
    tensors were neither replaced nor written in place since (torch counts every in-place op, an optimizer step
    and ``load_state_dict`` included) gets it back without hashing, so making a cache per request costs ~1 ms,
    not a hash of every weight. Writes torch does not count (through ``param.data``, or a numpy view of the
    memory) are not seen: pass ``reuse=False`` after those.

    Args:
        model: a ``torch.nn.Module`` (anything with ``state_dict()`` returning tensors); tensors on another
            device are copied to the CPU one at a time.
        reuse: return the remembered digest when no tensor changed (above); False hashes every byte again.

    Raises:
        ValueError: a tensor without data (the ``meta`` device).
    """
    import torch

    state = model.state_dict()
    versions = _versions(state)
    if reuse and versions is not None:
        try:
            known = _DIGESTS.get(model)
        except TypeError:  # (not weakly referenceable)
            known = None
        if known is not None and known[0] == versions:
            return known[1]
    names = sorted(state)
    # one digest per distinct tensor view (tied weights share it)
    views: dict[tuple[Any, ...], list[str]] = {}
    for name in names:
        t = state[name]
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"state_dict entry {name!r} is a {type(t).__name__}, not a tensor")
        if t.device.type == "meta":
            raise ValueError(f"parameter {name!r} is on the meta device (no data to fingerprint)")
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        views.setdefault(key, []).append(name)

    def digest_of(name: str) -> str:
        t = state[name].detach()
        if t.device.type != "cpu":
            t = t.cpu()
        flat = t.contiguous().reshape(-1)
        data = flat.view(torch.uint8).numpy() if flat.numel() else b""
        return hashlib.sha256(data).hexdigest()

    firsts = [group[0] for group in views.values()]
    workers = max(1, min(4, os.cpu_count() or 1, len(firsts)))
    if workers > 1:
        from concurrent.futures import ThreadPoolExecutor

        # the largest tensors first, so that the threads finish together
        order = sorted(firsts, key=lambda n: -state[n].numel() * state[n].element_size())
        with ThreadPoolExecutor(workers) as pool:
            per_first = dict(zip(order, pool.map(digest_of, order), strict=True))
    else:
        per_first = {n: digest_of(n) for n in firsts}
    per_name = {n: per_first[group[0]] for group in views.values() for n in group}
    h = hashlib.sha256()
    for name in names:
        t = state[name]
        h.update(f"{name}\t{str(t.dtype).removeprefix('torch.')}\t{list(t.shape)}\t{per_name[name]}\n".encode())
    digest = WEIGHTS_DIGEST_PREFIX + h.hexdigest()
    if versions is not None:
        with contextlib.suppress(TypeError):
            _DIGESTS[model] = (versions, digest)
    return digest


def _short(digest: str) -> str:
    return digest[: len(WEIGHTS_DIGEST_PREFIX) + 12]


@dataclass(frozen=True)
class ModelFingerprint:
    """What identifies the model a profile belongs to: thresholds of another shape, architecture or weights are
    wrong.

    The shape fields are always compared. ``weights`` (:func:`weights_digest`) tells apart two checkpoints of
    one shape (a base model and its fine-tune); it is compared when both sides have one (:meth:`Thresholds.
    check_fingerprint`), and a profile without it (an older file) is checked on its shape only, with a warning.
    ``name`` is informational and not compared.
    """

    #: ``config.model_type`` of the decoder ("llama", "gemma3_text"): always set, unlike ``architectures``.
    architecture: str
    #: Number of decoder layers (= entries per kind in the profile).
    num_layers: int
    #: Key/value heads per layer.
    num_kv_heads: int
    #: Dimension of one head.
    head_dim: int
    #: The name the model was loaded by (not compared).
    name: str | None = field(default=None, compare=False)
    #: :func:`weights_digest` of the model, or None when unknown (compared by ``Thresholds.check_fingerprint``).
    weights: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.architecture, str) or not self.architecture:
            raise ValueError(f"architecture must be a non-empty string, got {self.architecture!r}")
        for n in ("num_layers", "num_kv_heads", "head_dim"):
            v = getattr(self, n)
            if not is_int(v) or v < 1:
                raise ValueError(f"{n} must be a positive int, got {v!r}")
        if self.num_layers > MAX_LAYERS:
            raise ValueError(f"num_layers must be at most {MAX_LAYERS} (more than a model has), got {self.num_layers}")
        if self.name is not None and not isinstance(self.name, str):
            raise ValueError(f"name must be a string or None, got {self.name!r}")
        if self.weights is not None and not (isinstance(self.weights, str) and _DIGEST_RE.fullmatch(self.weights)):
            raise ValueError(f"weights must be 'sha256:' and 64 lowercase hex digits, or None, got {self.weights!r}")

    @classmethod
    def from_model_config(cls, hf_config: Any, name: str | None = None, weights: str | None = None) -> ModelFingerprint:
        """From a transformers ``PretrainedConfig`` (multimodal configs: their text decoder's config); the shape
        only unless the ``weights`` digest is given."""
        cfg = hf_config.get_text_config(decoder=True) if hasattr(hf_config, "get_text_config") else hf_config
        try:
            num_layers = int(cfg.num_hidden_layers)
            num_heads = int(cfg.num_attention_heads)
        except AttributeError as e:
            raise ValueError(f"{type(cfg).__name__} does not describe a decoder (missing {e.name})") from e
        kv_heads = getattr(cfg, "num_key_value_heads", None) or num_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
        arch = getattr(cfg, "model_type", None) or type(cfg).__name__
        return cls(str(arch), num_layers, int(kv_heads), int(head_dim), name, weights)

    @classmethod
    def from_model(cls, model: Any, name: str | None = None) -> ModelFingerprint:
        """From a transformers model: its config's shape and :func:`weights_digest` of its weights."""
        return cls.from_model_config(model.config, name, weights_digest(model))

    def describe(self) -> str:
        who = f"{self.name!r}: " if self.name else ""
        weights = f", weights {_short(self.weights)}..." if self.weights else ""
        return (
            f"{who}{self.architecture}, {self.num_layers} layers, {self.num_kv_heads} KV heads, "
            f"head_dim {self.head_dim}{weights}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "architecture": self.architecture,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "name": self.name,
            "weights": self.weights,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelFingerprint:
        return cls(
            d["architecture"], d["num_layers"], d["num_kv_heads"], d["head_dim"], d.get("name"), d.get("weights")
        )


@dataclass(frozen=True)
class LayerStats:
    """What the profiler saw for one layer's keys or values (kept in the file to diagnose a profile)."""

    #: Pearson kurtosis E[(x-mu)^4] / var^2 (3 for a Gaussian) of all values of one run, averaged over runs.
    kurtosis: float
    #: Values the thresholds were computed from, summed over runs (tokens x heads x head_dim x runs).
    num_samples: int
    #: Number of runs (calibration windows) averaged.
    num_runs: int
    #: Outer-group ratio the thresholds were profiled for (the config's, or raised by kurtosis tuning).
    outer_ratio: float
    #: Inner-group ratio the thresholds were profiled for (the config's, or lowered by kurtosis tuning).
    inner_ratio: float
    #: Standard deviation over runs of each threshold (to_lo, ti_lo, ti_hi, to_hi): how stable the average is.
    run_std: tuple[float, float, float, float] | None = None
    #: Human-readable notes on ratio adjustments (e.g. "kurtosis 31.2 > 20: outer_ratio +0.005").
    adjustments: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        k = finite_float("kurtosis", self.kurtosis)
        object.__setattr__(self, "kurtosis", k)
        for n in ("num_samples", "num_runs"):
            v = getattr(self, n)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{n} must be a non-negative int, got {v!r}")
        for n in ("outer_ratio", "inner_ratio"):
            r = finite_float(n, getattr(self, n))
            if not 0.0 <= r < 1.0:
                raise ValueError(f"{n} must be in [0, 1), got {r!r}")
            object.__setattr__(self, n, r)
        if self.run_std is not None:
            if len(self.run_std) != 4:
                raise ValueError(f"run_std must have 4 entries, got {self.run_std!r}")
            object.__setattr__(self, "run_std", tuple(finite_float("run_std", s) for s in self.run_std))
        if isinstance(self.adjustments, (str, bytes)) or not all(isinstance(a, str) for a in self.adjustments):
            raise ValueError(f"adjustments must be a list of strings, got {self.adjustments!r}")
        object.__setattr__(self, "adjustments", tuple(self.adjustments))

    def to_dict(self) -> dict[str, Any]:
        return {
            "kurtosis": self.kurtosis,
            "num_samples": self.num_samples,
            "num_runs": self.num_runs,
            "outer_ratio": self.outer_ratio,
            "inner_ratio": self.inner_ratio,
            "run_std": None if self.run_std is None else list(self.run_std),
            "adjustments": list(self.adjustments),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LayerStats:
        run_std = d.get("run_std")
        return cls(
            kurtosis=d["kurtosis"],
            num_samples=d["num_samples"],
            num_runs=d["num_runs"],
            outer_ratio=d["outer_ratio"],
            inner_ratio=d["inner_ratio"],
            run_std=None if run_std is None else tuple(run_std),
            adjustments=tuple(d.get("adjustments", ())),
        )


@dataclass(frozen=True)
class Thresholds:
    """The offline profile of one model: per decoder layer, key and value :class:`GroupThresholds`.

    ``keys[i]`` / ``values[i]`` belong to decoder layer ``i``; ``key_stats`` / ``value_stats`` (optional, same
    length) record what the profiler saw. ``profile`` is free-form JSON-able metadata (calibration source,
    window, number of runs, timing). Construction validates lengths against the fingerprint and warns
    (:class:`DuplicateThresholdsWarning`) when two layers of one kind have identical thresholds.
    """

    #: The method's configuration the profile was made for (ratios; key position).
    config: OakenConfig
    #: The model the profile belongs to.
    fingerprint: ModelFingerprint
    #: Key thresholds, one per decoder layer.
    keys: tuple[GroupThresholds, ...]
    #: Value thresholds, one per decoder layer.
    values: tuple[GroupThresholds, ...]
    #: Key statistics, one per decoder layer, or None.
    key_stats: tuple[LayerStats, ...] | None = None
    #: Value statistics, one per decoder layer, or None.
    value_stats: tuple[LayerStats, ...] | None = None
    #: Free-form metadata about how the profile was made (JSON-able).
    profile: dict[str, Any] = field(default_factory=dict, compare=False)
    #: Offline transforms the thresholds were profiled after (``oakenkv.calibrate.transforms``; the ``oaken-plus``
    #: preset), or None for the paper's method. A profile with transforms is only valid for a model they are applied to.
    transforms: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.config, OakenConfig):
            raise TypeError(f"config must be an OakenConfig, got {type(self.config).__name__}")
        if not isinstance(self.fingerprint, ModelFingerprint):
            raise TypeError(f"fingerprint must be a ModelFingerprint, got {type(self.fingerprint).__name__}")
        n = self.fingerprint.num_layers
        for kind, seq in (("keys", self.keys), ("values", self.values)):
            seq = tuple(g if isinstance(g, GroupThresholds) else GroupThresholds.from_sequence(g) for g in seq)
            object.__setattr__(self, kind, seq)
            if len(seq) != n:
                raise ValueError(f"{kind} has {len(seq)} layers but the model ({self.fingerprint.describe()}) has {n}")
        for kind in ("key_stats", "value_stats"):
            seq = getattr(self, kind)
            if seq is None:
                continue
            seq = tuple(seq)
            object.__setattr__(self, kind, seq)
            if len(seq) != n or not all(isinstance(s, LayerStats) for s in seq):
                raise ValueError(f"{kind} must hold {n} LayerStats (one per layer), got {len(seq)} entries")
        if self.transforms is not None:
            from oakenkv.calibrate.transforms import Transforms, check_transforms_shape

            if not isinstance(self.transforms, Transforms):
                raise TypeError(f"transforms must be a Transforms, got {type(self.transforms).__name__}")
            fp = self.fingerprint
            check_transforms_shape(self.transforms, fp.num_layers, fp.num_kv_heads, fp.head_dim)
            if self.config.scale_dtype == "float16":
                import numpy as np

                bound, most = self.transforms.zero_key_bound(), float(np.finfo(np.float16).max)
                if bound > most:
                    raise ValueError(
                        f"the key shifts move a key of zeros up to {bound:.4g}, beyond the float16 scales' range "
                        f"({most:g}): no key could be encoded"
                    )
        for kind, seq in (("key", self.keys), ("value", self.values)):
            seen: dict[tuple[float, ...], int] = {}
            for i, g in enumerate(seq):
                j = seen.setdefault(g.as_tuple(), i)
                if j != i:
                    warnings.warn(
                        f"{kind} thresholds of layers {j} and {i} are identical {g.as_tuple()}: "
                        "the profile is probably broken (one layer recorded for several); re-run `oakenkv profile`",
                        DuplicateThresholdsWarning,
                        stacklevel=3,
                    )
                    break

    # ------------------------------------------------------------------------------------------- access

    @property
    def num_layers(self) -> int:
        return self.fingerprint.num_layers

    def layer(self, i: int, kind: Kind) -> GroupThresholds:
        """Thresholds of decoder layer ``i`` for ``kind`` "key" or "value"."""
        if kind not in _KINDS:
            raise ValueError(f"kind must be 'key' or 'value', got {kind!r}")
        if isinstance(i, bool) or not isinstance(i, int) or not -self.num_layers <= i < self.num_layers:
            raise IndexError(f"layer index {i!r} out of range for {self.num_layers} layers")
        return (self.keys if kind == "key" else self.values)[i]

    def stats(self, i: int, kind: Kind) -> LayerStats | None:
        """Profiling statistics of layer ``i`` for ``kind``, or None when the profile has none."""
        self.layer(i, kind)  # validates i and kind
        seq = self.key_stats if kind == "key" else self.value_stats
        return None if seq is None else seq[i]

    # ------------------------------------------------------------------------------------------- model check

    def check_fingerprint(self, other: ModelFingerprint) -> None:
        """Raise :class:`ModelMismatchError` naming both models when ``other`` is not this profile's model.

        The shapes must be equal; the weights digests too when both are known. When ``other`` has a digest and
        this profile has none (a file written before oakenkv recorded it), warns
        :class:`UnverifiedWeightsWarning`: only the shape was checked.
        """
        if other != self.fingerprint:
            raise ModelMismatchError(
                f"these thresholds were profiled for ({self.fingerprint.describe()}) but the model is "
                f"({other.describe()}); profile this model with `oakenkv profile --model ...`"
            )
        mine, theirs = self.fingerprint.weights, other.weights
        if mine is not None and theirs is not None and mine != theirs:
            raise ModelMismatchError(
                f"these thresholds were profiled for other weights of the same shape ({self.fingerprint.describe()}):"
                f" weights {_short(mine)}... in the profile, {_short(theirs)}... in the model (another checkpoint, a "
                "fine-tune, or another dtype); profile this model with `oakenkv profile --model ...`"
            )
        if mine is None and theirs is not None:
            self._warn_unverified()

    def _warn_unverified(self) -> None:
        warnings.warn(
            "these thresholds carry no weights digest (profiled before oakenkv recorded one): only the model's "
            "shape was checked, so thresholds of another checkpoint of this shape would not be noticed; "
            "re-profile to record it",
            UnverifiedWeightsWarning,
            stacklevel=4,
        )

    def check_model(self, model: Any) -> None:
        """Raise :class:`ModelMismatchError` (a ValueError) when ``model`` is not the profiled model.

        ``model``: a transformers model (its shape and, when this profile records one, the digest of its weights
        are compared: :func:`weights_digest`; a profile without one warns :class:`UnverifiedWeightsWarning`) or
        only its ``PretrainedConfig`` (the shape only, silently: the caller chose not to give the weights).
        """
        if not (hasattr(model, "state_dict") and hasattr(model, "config")):
            self.check_fingerprint(ModelFingerprint.from_model_config(getattr(model, "config", model)))
            return
        if self.fingerprint.weights is None:  # nothing to compare a digest with: do not compute one
            self.check_fingerprint(ModelFingerprint.from_model_config(model.config))
            self._warn_unverified()
            return
        self.check_fingerprint(ModelFingerprint.from_model(model))

    def sha256(self) -> str:
        """Digest (hex) of everything the profile decides: config, model (shape and weights digest), every layer's
        thresholds and statistics; not the free-form ``profile`` metadata (timing) or the model's name. A result or
        a checkpoint that used these thresholds records it, so that another profile is never mixed in."""
        d = self.to_dict()
        del d["profile"], d["model"]["name"]
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()

    # ------------------------------------------------------------------------------------------- JSON

    def to_dict(self) -> dict[str, Any]:
        layers = []
        for i in range(self.num_layers):
            entry: dict[str, Any] = {"index": i}
            for kind in _KINDS:
                st = self.stats(i, kind)
                entry[kind] = {
                    "thresholds": list(self.layer(i, kind).as_tuple()),
                    "stats": None if st is None else st.to_dict(),
                }
            layers.append(entry)
        d = {
            "format": FORMAT_NAME,
            "schema_version": SCHEMA_VERSION if self.transforms is None else SCHEMA_VERSION_TRANSFORMS,
            "config": self.config.to_dict(),
            "model": self.fingerprint.to_dict(),
            "layers": layers,
            "profile": self.profile,
        }
        if self.transforms is not None:
            d["transforms"] = self.transforms.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: Any, *, source: str = "<dict>") -> Thresholds:
        """Parse and validate a decoded file; any problem: :class:`ThresholdsFileError` naming ``source``."""

        def fail(msg: str) -> ThresholdsFileError:
            return ThresholdsFileError(f"{source}: {msg}")

        if not isinstance(d, dict):
            raise fail(f"not a thresholds file (top level is {type(d).__name__}, expected an object)")
        if d.get("format") != FORMAT_NAME:
            raise fail(f"not a thresholds file (format is {d.get('format')!r}, expected {FORMAT_NAME!r})")
        version = d.get("schema_version")
        if not one_of(version, (SCHEMA_VERSION, SCHEMA_VERSION_TRANSFORMS)):  # (not true, not 2.0)
            raise fail(
                f"unsupported schema_version {version!r} (this oakenkv reads {SCHEMA_VERSION} and "
                f"{SCHEMA_VERSION_TRANSFORMS}); re-profile"
            )
        if (version == SCHEMA_VERSION_TRANSFORMS) != ("transforms" in d):
            raise fail(f"schema_version {version} {'needs' if version == 2 else 'cannot hold'} a 'transforms' object")
        try:
            config = OakenConfig.from_dict(d["config"])
            fingerprint = ModelFingerprint.from_dict(d["model"])
            layers = d["layers"]
            if not isinstance(layers, list):
                raise fail("'layers' must be a list")
            keys, values, kstats, vstats = [], [], [], []
            if len(layers) > MAX_LAYERS:
                raise fail(f"holds {len(layers):,} layers, more than any model has ({MAX_LAYERS:,} at most)")
            for pos, entry in enumerate(layers):
                if not isinstance(entry, dict):
                    raise fail(f"layer entry {pos} must be an object")
                if not one_of(entry.get("index"), (pos,)):
                    raise fail(f"layer entry {pos} has index {entry.get('index')!r} (layers must be in order)")
                for kind, thr, st in (("key", keys, kstats), ("value", values, vstats)):
                    try:
                        thr.append(GroupThresholds.from_sequence(entry[kind]["thresholds"]))
                    except ValueError as e:
                        raise fail(f"layer {pos} {kind}: {e}") from e
                    raw = entry[kind].get("stats")
                    st.append(None if raw is None else LayerStats.from_dict(raw))
            if len(keys) != fingerprint.num_layers:
                raise fail(f"holds {len(keys)} layers but its model fingerprint says {fingerprint.num_layers}")
            profile = d.get("profile", {})
            if not isinstance(profile, dict):
                raise fail("'profile' must be an object")

            def all_or_none(seq: list[LayerStats | None], kind: str) -> tuple[LayerStats, ...] | None:
                if all(s is None for s in seq):
                    return None
                if any(s is None for s in seq):
                    raise fail(f"{kind} stats are present for some layers only")
                return tuple(seq)  # type: ignore[arg-type]

            transforms = None
            if "transforms" in d:
                from oakenkv.calibrate.transforms import TransformError, Transforms

                try:
                    transforms = Transforms.from_dict(d["transforms"])
                except (TransformError, KeyError, TypeError) as e:
                    raise fail(f"invalid transforms: {e}") from e
            return cls(
                config=config,
                fingerprint=fingerprint,
                keys=tuple(keys),
                values=tuple(values),
                key_stats=all_or_none(kstats, "key"),
                value_stats=all_or_none(vstats, "value"),
                profile=profile,
                transforms=transforms,
            )
        except ThresholdsFileError:
            raise
        except KeyError as e:
            raise fail(f"missing field {e.args[0]!r}") from e
        except (TypeError, ValueError, AttributeError) as e:
            raise fail(f"invalid content: {e}") from e

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the JSON file atomically (``oakenkv.util.paths.atomic_write``: temp file + rename, no reader sees half
        a file; the umask's permissions, so a shared cache stays readable)."""
        # allow_nan=False: a NaN can only come from a bug upstream, and "NaN" is not JSON.
        text = json.dumps(self.to_dict(), indent=1, allow_nan=False) + "\n"
        return atomic_write(path, text)

    @classmethod
    def load(cls, path: str | os.PathLike[str], expect: ModelFingerprint | None = None) -> Thresholds:
        """Read and validate a thresholds file; with ``expect``, also check it belongs to that model.

        Raises:
            FileNotFoundError: no such file.
            ThresholdsFileError: not a regular file (a directory, a device), larger than ``MAX_FILE_BYTES``,
                truncated/corrupt JSON or JSON nested too deeply, wrong format/schema, missing fields, invalid
                values (thresholds not ordered or not finite in float32 included).
            ModelMismatchError: ``expect`` is given and differs from the file's fingerprint.
        """
        p = Path(path)
        if not p.exists():
            raise FileNotFoundError(f"thresholds file {p} does not exist")
        if p.is_dir():
            raise ThresholdsFileError(f"{p}: is a directory, not a thresholds file")
        if not p.is_file():
            raise ThresholdsFileError(f"{p}: not a regular file (a device or a pipe?), so not a thresholds file")
        size = p.stat().st_size
        if size > MAX_FILE_BYTES:
            raise ThresholdsFileError(
                f"{p}: {size:,} bytes, more than any thresholds file holds ({MAX_FILE_BYTES:,} at most)"
            )
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ThresholdsFileError(f"{p}: not a text file ({e})") from e

        def reject_constant(c: str) -> None:
            raise ThresholdsFileError(f"{p}: holds {c}, which is not a valid threshold")

        try:
            d = json.loads(text, parse_constant=reject_constant)
        except json.JSONDecodeError as e:
            hint = " (the file looks truncated)" if e.pos >= len(text.rstrip()) - 1 else ""
            raise ThresholdsFileError(f"{p}: corrupt JSON at line {e.lineno} column {e.colno}: {e.msg}{hint}") from e
        except RecursionError as e:
            raise ThresholdsFileError(f"{p}: JSON nested too deeply to be a thresholds file") from e
        except ValueError as e:  # e.g. an integer of more than 4300 digits
            raise ThresholdsFileError(f"{p}: corrupt JSON ({e})") from e
        th = cls.from_dict(d, source=str(p))
        if expect is not None:
            th.check_fingerprint(expect)
        return th


def print_thresholds(th: Thresholds, console: Any = None, layers: bool = True) -> None:
    """Print a profile for people: model, config, how it was profiled, and (``layers``) a per-layer table.

    Everything that came from the file is printed through :func:`oakenkv.util.text.printable` (escape sequences and
    control characters made visible) and cut to a line's worth, and no markup is interpreted: a shared profile
    cannot act on the terminal. The table is plain text, written at once (a 4096-layer profile prints in well
    under a second; a rich table of it took minutes).

    ``console`` is a ``rich.console.Console`` to write to (default: standard output).
    """
    from oakenkv.util.text import printable

    def text(v: Any, limit: int = 200) -> str:
        return printable(v, limit=limit)

    c = th.config
    lines = [
        f"model   {text(th.fingerprint.describe())}",
        f"config  outer {c.outer_ratio:.2%} / middle {c.middle_ratio:.2%} / inner {c.inner_ratio:.2%}; "
        f"bits middle {c.to_dict()['middle_bits']}, inner {c.inner_bits}, outer {c.outer_bits}; keys {c.key_position}, "
        f"granularity {c.granularity}, scales {c.scale_dtype}",
    ]
    if th.profile:
        shown = [f"{text(k, 40)}={text(v, 80)}" for k, v in list(th.profile.items())[:32] if v is not None]
        more = len(th.profile) - 32
        lines.append("profile " + text(", ".join(shown), 2000) + (f" (and {more} more fields)" if more > 0 else ""))
    if th.transforms is not None:
        t = th.transforms
        lines.append(
            f"transforms oaken-plus: {sum(lt.key_shift is not None for lt in t.layers)} key shifts, "
            f"{sum(lt.key_scale is not None for lt in t.layers)} key scales, {sum(lt.key_rotation for lt in t.layers)} "
            f"key and {sum(lt.value_rotation for lt in t.layers)} value rotations, {t.sink_tokens} sink tokens"
        )
    if layers:
        head = ("layer", "to_lo", "ti_lo", "ti_hi", "to_hi", "kurtosis", "runs")
        for kind in _KINDS:
            lines += ["", f"{kind} thresholds per decoder layer"]
            lines.append("  ".join(f"{h:>9}" for h in head) + "  notes")
            for i in range(th.num_layers):
                st = th.stats(i, kind)
                cells = [str(i), *(f"{v:+.4f}" for v in th.layer(i, kind).as_tuple())]
                cells += ["-", "-"] if st is None else [f"{st.kurtosis:.1f}", str(st.num_runs)]
                notes = "" if st is None else text("; ".join(st.adjustments), 100)
                lines.append("  ".join(f"{x:>9}" for x in cells) + ("  " + notes if notes else ""))
    import sys

    f = sys.stdout if console is None else console.file
    f.write("\n".join(lines) + "\n")
    f.flush()
