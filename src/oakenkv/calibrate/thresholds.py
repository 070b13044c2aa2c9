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
its weights (:func:`weights_digest`, the ``"weights"`` entry of ``"model"``; both defined in
``oakenkv.calibrate.identity`` and re-exported here): thresholds profiled for a base model
are refused for its fine-tune. Files written before the digest existed have ``"weights"`` absent (or null); they
still load, and checking them against a model compares the shape only and says so
(:class:`UnverifiedWeightsWarning`). Newer profiles also record the digest of the weights rounded to bfloat16
(``"weights_bf16"``, written only when known): a profile made on a float32 model then serves its bfloat16 copy,
and the reverse, with :class:`OtherDtypeWarning`.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

# ModelFingerprint and weights_digest live in oakenkv.calibrate.identity; they are re-exported here, where users have
# always imported them from.
from oakenkv.calibrate.identity import (
    MAX_LAYERS,
    ModelFingerprint,
    rounded_weights_digest,
    short_digest,
    weights_digest,
)
from oakenkv.format.config import OakenConfig
from oakenkv.quant.groups import FLOAT32_MAX, GroupThresholds, as_float32, finite_float
from oakenkv.util.exact import one_of
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
    "OtherDtypeWarning",
    "Thresholds",
    "ThresholdsFileError",
    "UnverifiedWeightsWarning",
    "as_float32",
    "weights_digest",
]

#: Value of the file's "format" field (tells a thresholds file from any other JSON).
FORMAT_NAME = "oakenkv-thresholds"
#: Version of the file layout; bump when a field changes meaning. Loading another version is an error.
SCHEMA_VERSION = 1
#: Largest file :meth:`Thresholds.load` reads: a profile of 1000 layers with statistics is about 1 MB.
MAX_FILE_BYTES = 64 * 2**20
#: The fields of a profile's "profile" metadata that time its run (wall, CPU, and the oaken-plus search's numba
#: compilation, which only a process's first search pays): two runs that decide the same profile differ in these.
TIMING_KEYS = ("seconds", "cpu_seconds", "compile_seconds")
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


class OtherDtypeWarning(UserWarning):
    """A profile was paired with its model's weights in another dtype (a float32 profile with the bfloat16 copy, or
    the reverse: equal when rounded to bfloat16, ``identity.rounded_weights_digest``): the profile is used as it
    is; one made in the model's own dtype would have the model's own numbers."""


class DuplicateThresholdsWarning(UserWarning):
    """Two decoder layers have bit-identical thresholds: almost surely a broken profile (e.g. one layer
    recorded twice, or the same tensor captured for every layer)."""


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

        The shapes must be equal; the weights digests too when both are known, unless both sides also carry the
        digest of their weights rounded to bfloat16 (``ModelFingerprint.weights_bf16``) and those are equal: the
        same weights in another dtype, accepted with :class:`OtherDtypeWarning`. When ``other`` has a digest and
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
            rounded = self.fingerprint.weights_bf16
            if rounded is not None and rounded == other.weights_bf16:
                warnings.warn(
                    "these thresholds were profiled on this model's weights in another dtype (equal when rounded to "
                    "bfloat16): they are used as they are; profile the model in its own dtype for thresholds of its "
                    "own numbers",
                    OtherDtypeWarning,
                    stacklevel=4,
                )
                return
            raise ModelMismatchError(
                f"these thresholds were profiled for other weights of the same shape ({self.fingerprint.describe()}):"
                f" weights {short_digest(mine)}... in the profile, {short_digest(theirs)}... in the model (another "
                "checkpoint, a fine-tune, another dtype, or a part of the profiled model, such as its base model "
                "without the LM head: pass the ...ForCausalLM); profile this model with `oakenkv profile --model ...`"
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
        fp = ModelFingerprint.from_model(model)
        if fp.weights != self.fingerprint.weights and self.fingerprint.weights_bf16 is not None:
            fp = replace(fp, weights_bf16=rounded_weights_digest(model))  # another dtype of the same weights?
        self.check_fingerprint(fp)

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

    def to_json(self) -> str:
        """The file's text (what :meth:`save` writes)."""
        # allow_nan=False: a NaN can only come from a bug upstream, and "NaN" is not JSON.
        return json.dumps(self.to_dict(), indent=1, allow_nan=False) + "\n"

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the JSON file atomically (``oakenkv.util.paths.atomic_write``: temp file + rename, no reader sees half
        a file; the umask's permissions, so a shared cache stays readable)."""
        return atomic_write(path, self.to_json())

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
