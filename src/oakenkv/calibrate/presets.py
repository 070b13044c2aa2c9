"""The presets a real cache runs, and how a model's profile for one is found or made.

- ``oaken``: the paper's method as published: per-layer thresholds at 4% outer / 6% inner, no transforms.
- ``oaken-plus``: the same online quantizer and bytes after offline transforms chosen per layer on calibration
  text (a key shift, key smoothing folded into the weights, per-layer group ratios, a 16-bit sink token;
  ``oakenkv.calibrate.plus``, docs/plus.md).
- ``oaken-plus-3`` and ``oaken-plus-2``: oaken-plus at a narrower dense slot (``OakenConfig.middle_bits`` 3 and 2:
  3- and 2-bit middle codes, 4- and 3-bit outliers) and a smaller sparse share: the same structure at lower bit
  budgets (docs/results.md, the frontier); ``oaken-plus-3``'s search may also rotate keys and values.
- ``oaken-plus-5``, ``oaken-plus-6`` and ``oaken-plus-7``: oaken-plus at a wider dense slot (5- to 7-bit middle
  codes, 6- to 8-bit outliers) and a 4% sparse share: the budgets of int5, KIVI-4 and the 8-bit formats (fp8,
  int8), where a 4-bit slot loses more than they do (docs/results.md).

:func:`find_profile` gives the profile ``OakenCache.for_model`` builds its cache from: a file or profile the user
names (checked against the model), else one shipped with the package for an embedded model, else one cached on
disk by content, else a new one profiled on the calibration text (with a progress bar) and cached. The method
registry (``oakenkv.methods``) declares the ``oaken`` and ``oaken-plus`` methods from these presets.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass
from typing import Any

from oakenkv.calibrate.spec import CalibrationSpec

__all__ = [
    "OAKEN",
    "OAKEN_PLUS",
    "OAKEN_PLUS_2",
    "OAKEN_PLUS_3",
    "OAKEN_PLUS_5",
    "OAKEN_PLUS_6",
    "OAKEN_PLUS_7",
    "PRESETS",
    "Preset",
    "find_profile",
    "get_preset",
]


@dataclass(frozen=True)
class Preset:
    """One preset: its name, what it is, and the calibration its profile is made on by default."""

    name: str
    description: str
    #: Calibration windows of a profile made on demand.
    calibration: CalibrationSpec
    #: Whether the profile carries oaken-plus transforms (found by the oaken-plus search).
    transforms: bool
    #: The format's dense slot width (``OakenConfig.middle_bits``) and, for an oaken-plus search, the share of
    #: values in the sparse (inner + outer) groups it splits per layer (``oakenkv.calibrate.plus.ratio_choices``).
    middle_bits: int = 4
    sparse: float = 0.10
    #: Whether the search may rotate keys and values per head (``PlusSearch.key_rotation`` / ``value_rotation``;
    #: it still chooses per layer).
    rotations: bool = False

    def search(self) -> Any:
        """The oaken-plus search of this preset (``oakenkv.calibrate.plus.PlusSearch``; transforms presets only)."""
        from oakenkv.calibrate.plus import PlusSearch, ratio_choices

        return PlusSearch(
            key_rotation=self.rotations,
            value_rotation=self.rotations,
            ratios=ratio_choices(self.sparse),
            middle_bits=self.middle_bits,
        )

    @property
    def spec(self) -> str:
        """The method spec this preset runs as in the registry (``oakenkv.methods.registry``)."""
        if not self.transforms or (self.middle_bits, self.sparse, self.rotations) == (4, 0.10, False):
            return self.name
        rot = ",rot_k=1,rot_v=1" if self.rotations else ""
        return f"{OAKEN_PLUS.name}:bits={self.middle_bits},sparse={self.sparse:g}{rot}"


#: The paper's Oaken. 16 windows of 256 tokens keep a first profile short, since ``for_model`` makes it while the
#: user waits (docs/notebook/perf-notes.md has the time; the paper averages ~100 runs: ``oakenkv profile
#: --samples 100`` makes such a profile, which ``profile=`` then takes).
OAKEN = Preset(
    "oaken",
    "the paper's Oaken: profiled thresholds at 4% outer / 6% inner, 4-bit middle and 5-bit outliers",
    CalibrationSpec(samples=16, window=256),
    transforms=False,
)
#: oaken-plus: long windows matter, the key shift is the mean of post-RoPE keys over the positions it is taken at.
OAKEN_PLUS = Preset(
    "oaken-plus",
    "Oaken after per-layer offline transforms (key shift, key smoothing, group ratios, a 16-bit sink token)",
    CalibrationSpec(samples=16, window=2048),
    transforms=True,
)


def _slot_preset(bits: int, rotations: bool = False) -> Preset:
    """oaken-plus at a ``bits``-bit dense slot (``bits + 1``-bit outliers) and a 4% sparse share."""
    return Preset(
        f"oaken-plus-{bits}",
        f"oaken-plus with a {bits}-bit dense slot: {bits}-bit middle codes, {bits + 1}-bit outliers, a 4% sparse share"
        + (", Hadamard rotations" if rotations else ""),
        CalibrationSpec(samples=16, window=2048),
        transforms=True,
        middle_bits=bits,
        sparse=0.04,
        rotations=rotations,
    )


#: oaken-plus with 3-bit middle codes (4-bit outliers) and a 4% sparse share: about 3.9 bits per value on the
#: default model (3 + 8 x 0.04 + 112 / 192 for its scales and header), the budget of KVQuant's 3-4 bits. Its search
#: may rotate keys and values per head: at a 3-bit slot that lowers the loss (docs/plus.md, "Below 5 bits"), where
#: at oaken-plus's 4-bit slot it did not.
OAKEN_PLUS_3 = _slot_preset(3, rotations=True)
#: oaken-plus with 2-bit middle codes (3-bit outliers) and a 4% sparse share: about 2.9 bits per value on the
#: default model, the budget of KIVI-2.
OAKEN_PLUS_2 = _slot_preset(2)
#: oaken-plus with 5-bit middle codes (6-bit outliers) and a 4% sparse share: about 5.9 bits per value on the
#: default model (5 + 8 x 0.04 + 112 / 192), the budget of int5 and KIVI-4.
OAKEN_PLUS_5 = _slot_preset(5)
#: oaken-plus with 6-bit middle codes (7-bit outliers) and a 4% sparse share: about 6.9 bits per value on the
#: default model, below the 8 bits of fp8 and int8.
OAKEN_PLUS_6 = _slot_preset(6)
#: oaken-plus with 7-bit middle codes (8-bit outliers, the widest the format has) and a 4% sparse share: about 7.9
#: bits per value on the default model, the budget of int8 (8.5 with its scales).
OAKEN_PLUS_7 = _slot_preset(7)
#: The presets whose dense slot is not the paper's 4 bits (each an alias of an oaken-plus spec in the registry).
SLOT_PRESETS = (OAKEN_PLUS_3, OAKEN_PLUS_2, OAKEN_PLUS_5, OAKEN_PLUS_6, OAKEN_PLUS_7)
PRESETS: dict[str, Preset] = {p.name: p for p in (OAKEN, OAKEN_PLUS, *SLOT_PRESETS)}

#: The profile each model object was prepared with (``find_profile`` on a model it already folded returns it).
_PREPARED: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def get_preset(name: str) -> Preset:
    """The preset called ``name``; ValueError naming the known ones otherwise."""
    if not isinstance(name, str) or name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    return PRESETS[name]


def remember(model: Any, thresholds: Any) -> None:
    """Record that ``model`` was prepared with ``thresholds`` (its transforms folded in)."""
    _PREPARED[model] = thresholds


def model_name(model: Any) -> str:
    """A readable name of ``model`` for cache file names: the last part of its name or path, else its class."""
    path = str(getattr(model.config, "_name_or_path", "") or "")
    return os.path.basename(path.rstrip("/\\")) or type(model).__name__


def _tokenizer(model: Any) -> Any:
    """The tokenizer saved with ``model`` (local files only: nothing downloads)."""
    path = str(getattr(model.config, "_name_or_path", "") or "")
    try:
        from transformers import AutoTokenizer

        if not path:
            raise OSError("the model records no name or path")
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"no tokenizer found for this model ({e}); making its profile needs one: pass tokenizer=..., or "
            "profile=... (a profile made with `oakenkv profile`)"
        ) from e


def _loaded(profile: Any) -> Any:
    from oakenkv.calibrate.thresholds import Thresholds

    if isinstance(profile, Thresholds):
        return profile
    if isinstance(profile, (str, os.PathLike)):
        return Thresholds.load(profile)
    raise TypeError(f"profile must be a Thresholds or a path to a profile file, got {type(profile).__name__}")


def find_profile(
    model: Any, preset: str = "oaken-plus", *, tokenizer: Any = None, profile: Any = None, progress: bool = True
) -> Any:
    """The profile (:class:`~oakenkv.calibrate.thresholds.Thresholds`) of ``model`` for ``preset``.

    ``profile`` (a path or a loaded profile) is used when given: it must be a profile of ``preset``'s kind (with
    transforms for ``oaken-plus``, without for ``oaken``) and of this model (shape and weights; checked by the
    cache). Otherwise, in order: the profile this model was already prepared with (its transforms are folded in),
    one shipped for an embedded model, one cached on disk for the same weights and calibration text, or a new one
    profiled on the calibration text (``preset``'s calibration; a progress bar when ``progress``) and cached.
    ``tokenizer`` is needed for that last step only (default: the one saved with the model, local files only).
    """
    p = get_preset(preset)
    if profile is not None:
        thresholds = _loaded(profile)
        has = thresholds.transforms is not None
        if has != p.transforms:
            which = "oaken-plus transforms" if has else "no transforms"
            raise ValueError(
                f"this profile has {which}, so it is not a profile of the {preset!r} preset; use preset="
                f"{'oaken-plus' if has else 'oaken'!r}, or a profile made with `oakenkv profile --preset {preset}`"
            )
        mb = thresholds.config.middle_bits
        if mb != p.middle_bits:
            raise ValueError(
                f"this profile quantizes to {mb}-bit dense slots, the {preset!r} preset to {p.middle_bits}-bit ones; "
                f"use a profile made with `oakenkv profile --preset {preset}`"
            )
        return thresholds
    prepared = _PREPARED.get(model)
    if prepared is not None:
        if (prepared.transforms is not None) == p.transforms and prepared.config.middle_bits == p.middle_bits:
            return prepared
        if prepared.transforms is not None:
            raise ValueError(
                f"this model was prepared for another preset than {preset!r} (its weights carry that preset's "
                "transforms); load the model again to use another preset"
            )
        # prepared for the paper's preset, which folds nothing: the weights are as loaded, profile them for this one
    from oakenkv.calibrate.transforms import is_folded

    if is_folded(model) is not None:
        raise ValueError(
            "this model carries oaken-plus transforms folded in elsewhere: pass profile=... (the profile they came "
            "from, e.g. an export's oakenkv-profile.json), or load the original, unfolded model"
        )
    tok = tokenizer if tokenizer is not None else _tokenizer(model)
    name = model_name(model)
    if p.transforms:
        from oakenkv.calibrate.plus import cached_plus_profile

        return cached_plus_profile(model, tok, name, p.calibration, p.search(), progress=progress)
    from oakenkv.calibrate.profile import cached_thresholds
    from oakenkv.format.config import OakenConfig

    return cached_thresholds(model, tok, name, OakenConfig(), p.calibration, progress=progress)
