"""The method registry: every KV-cache method oakenkv runs, ours and the peers', declared once.

A method is named by a spec string ``family[:key=value,...]``, e.g. ``oaken``, ``oaken:outer=0.06,inner=0.09``,
``int:bits=5``, ``kivi:bits=4,group=32,residual=128``, or an alias (``int4``, ``kivi4``, ...). Each family is one
:class:`Family` below: its parameters with their types, defaults and ranges, its bits per value, where it
quantizes keys, what it simplifies against the method it stands for, and the function that builds it. Spec
parsing (:func:`parse_spec`), the command line's help (:func:`methods_help`), the evaluation (:func:`build_method`),
the diagnosis and the tests read this table; no other module spells a method's name.

This module imports no torch: the command line checks a spec before anything loads. The builders (each family's
``build``, in ``oakenkv.methods.build``) import what they need when called.

| family | what the attention reads | keys quantized |
|---|---|---|
| ``fp`` | unquantized (16 bits counted) | - |
| ``oaken`` | Oaken per token vector, profiled thresholds (the paper's method) | post (or ``pre``) |
| ``oaken-plus`` | Oaken after per-layer offline transforms (``oakenkv.calibrate.plus``) | post |
| ``oaken-official`` | Oaken as the authors' harness computes it: calibrated per-layer min/max | pre-RoPE |
| ``int`` | per-token-per-head asymmetric INT-n, QServe / Atom style | post-RoPE |
| ``kivi`` | KIVI: keys per channel in token groups, values per token, fp16 residual | post-RoPE |
| ``kvquant`` | KVQuant-style n-bit + 1% fp16 outliers (uniform grid) | pre-RoPE, per channel |
| ``fp8`` | FP8 e4m3, per-tensor scale 1.0 (vLLM's default) | post-RoPE |
| ``quanto`` | transformers' ``QuantizedCache(backend="quanto")``, unchanged | post-RoPE |
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from oakenkv.calibrate.presets import OAKEN, OAKEN_PLUS, SLOT_PRESETS
from oakenkv.format.config import MAX_SINK_TOKENS, MIDDLE_BITS_CHOICES, OakenConfig

__all__ = [
    "ALIASES",
    "FAMILIES",
    "NAMES",
    "Family",
    "Method",
    "Param",
    "build_method",
    "canonical",
    "check_spec_with_thresholds",
    "given_params",
    "methods_help",
    "parse_spec",
    "sweep_config",
]

_INT = re.compile(r"[+-]?\d+")


@dataclass(frozen=True)
class Param:
    """One parameter of a family: its default (whose type is the parameter's: int, float or str), the range or
    choices it accepts, and what it means."""

    default: int | float | str
    help: str
    #: Inclusive bounds of an int or float parameter (None: unbounded on that side).
    low: float | None = None
    high: float | None = None
    #: The values a str parameter accepts (empty: any).
    choices: tuple[str, ...] = ()

    def parse(self, family: str, key: str, text: str) -> int | float | str:
        """``text`` as this parameter's type, checked; ValueError naming the family, the key and what is wrong.
        Exact types: an int parameter takes digits only (not ``1.5``, ``true`` or ``1e3``), a float a finite
        number."""
        where = f"method {family!r}: {key}={text!r}"
        d = self.default
        if isinstance(d, str):
            if self.choices and text not in self.choices:
                raise ValueError(f"{where}: use one of {', '.join(self.choices)}")
            return text
        if isinstance(d, int):
            if not _INT.fullmatch(text.strip()):
                raise ValueError(f"{where} is not an int")
            v: int | float = int(text)
        else:
            try:
                v = float(text)
            except ValueError:
                raise ValueError(f"{where} is not a number") from None
            if not math.isfinite(v):
                raise ValueError(f"{where}: must be a finite number")
        if (self.low is not None and v < self.low) or (self.high is not None and v > self.high):
            lo = "" if self.low is None else f">= {_bound(self.low, d)}"
            hi = "" if self.high is None else f"<= {_bound(self.high, d)}"
            raise ValueError(f"{where}: must be {' and '.join(filter(None, (lo, hi)))}")
        return v

    def describe(self) -> str:
        if self.choices:
            return "|".join(self.choices)
        rng = [f"{self.low:g}" if self.low is not None else "", f"{self.high:g}" if self.high is not None else ""]
        kind = "int" if isinstance(self.default, int) else "float"
        return kind if not any(rng) else f"{kind} {rng[0]}..{rng[1]}"


def _switch(help: str, default: int = 1) -> Param:
    return Param(default, help + " (1 on, 0 off)", 0, 1)


#: The most tokens a full-precision window may hold (as the command line's --residual: no model reads more).
MAX_RESIDUAL = 1 << 20


def _bound(v: float, like: Any) -> str:
    """A parameter's bound as its type writes it (an int's in digits, ``1048576``, not ``1.04858e+06``)."""
    return str(int(v)) if isinstance(like, int) else f"{v:g}"


def _residual(default: int, what: str) -> Param:
    return Param(default, f"newest tokens of each layer kept unquantized ({what})", 0, MAX_RESIDUAL)


def _slot_bits() -> Param:
    return Param(
        4,
        "dense slot width: bits of a middle code (the outliers get one more)",
        min(MIDDLE_BITS_CHOICES),
        max(MIDDLE_BITS_CHOICES),
    )


def _adapt() -> Param:
    return _switch("adaptive grouping: outer thresholds follow the sequence's outlier share (OakenCache's adapt)", 0)


@dataclass(frozen=True)
class Family:
    """One method family: everything about it that is not its implementation."""

    name: str
    description: str
    #: Its parameters, in the order a canonical spec lists them.
    params: dict[str, Param]
    #: Bits stored per value, as a formula of its parameters (D: values per token vector; the measured figure is
    #: the evaluation's ``effective_bits``).
    bits: str
    #: Where keys are quantized: "post_rope" or "pre_rope" (``oaken``'s follows its ``key_position`` parameter).
    key_position: str
    #: ``module:function`` (under ``oakenkv.``) that builds it: ``(context, params) -> Method``.
    build: str
    #: What the implementation simplifies relative to the method it stands for (printed in reports).
    simplified: str = ""
    #: What a thresholds file is to it: None (it takes none), "paper" (the paper's thresholds) or "plus" (an
    #: oaken-plus profile, whose transforms decide its switches).
    profile: str | None = None
    #: Whether its caches can run a batch of sequences of different lengths (zero-shot tasks batch 8 at a time).
    batchable: bool = True
    #: Whether a non-default calibration changes it (then its name in results says which).
    calibrated: bool = False

    def defaults(self) -> dict[str, Any]:
        return {k: p.default for k, p in self.params.items()}

    @property
    def calibrates(self) -> bool:
        """Whether building it calibrates on text when no profile file is given (its thresholds or ranges)."""
        return self.calibrated or self.profile is not None


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("fp", "no quantization: the model's own float cache", {}, "16", "post_rope", "methods.build:build_fp"),
        Family(
            OAKEN.name,
            OAKEN.description,
            {
                "outer": Param(0.04, "share of values in the outer group", 0.0, 1.0),
                "inner": Param(0.06, "share of values in the inner group", 0.0, 1.0),
                "granularity": Param(
                    "token", "one vector per token (all KV heads) or per head", choices=("token", "head")
                ),
                "key_position": Param("post", "keys quantized after or before RoPE", choices=("post", "pre")),
                "kurtosis": _switch("per-layer ratios tuned by kurtosis", 0),
                "only": Param("kv", "ablation: quantize keys and values, or only one kind", choices=("kv", "k", "v")),
                "residual": _residual(0, "OakenCache's window; 0: the paper's Oaken"),
                "bits": _slot_bits(),
                "adapt": _adapt(),
            },
            "bits + 8 x outlier share + 96/D (scales) + 16/D (header)",
            "post_rope",
            "methods.build:build_oaken",
            profile="paper",
            calibrated=True,
        ),
        Family(
            OAKEN_PLUS.name,
            OAKEN_PLUS.description,
            {
                "shift": _switch("key shift (the mean of post-RoPE keys)"),
                "rot_k": _switch("per-head Hadamard rotation of keys", 0),
                "rot_v": _switch("per-head Hadamard rotation of values", 0),
                "smooth": _switch("key smoothing folded into the weights"),
                "ratios": _switch("per-layer group ratios (else the paper's 4% / 6%)"),
                "sink": Param(1, "first tokens of a sequence kept at 16 bits", 0, MAX_SINK_TOKENS),
                "residual": _residual(0, "OakenCache's window; 0: every token quantized"),
                "bits": _slot_bits(),
                "adapt": _adapt(),
                "sparse": Param(
                    0.1, "share of values in the sparse (inner + outer) groups, split per layer", 0.005, 0.5
                ),
                "static": _switch(
                    "static middle/inner grids fixed per layer by its thresholds, only the outer scales stored per "
                    "row (OakenConfig.static_grids: 32/D instead of 96/D scale bits; the profile is the per-row one's)",
                    0,
                ),
                "alloc": _switch(
                    "the sparse share allocated over layers and kinds (each may take 0.5x to 2x of it, the model's "
                    "average staying at it) where the search's scored error falls most",
                    0,
                ),
                "aware": _switch(
                    "with static=1, the search scores its candidates with the static grids (and levels) the format "
                    "will use, not per-row grids (a profile of its own)",
                    0,
                ),
                "levels": _switch(
                    "with static=1, static levels: a few static middle grids per layer (clip factors 0.5, 0.7, 0.85, "
                    "1), each row taking the smallest covering its middle values and storing its index in a byte "
                    "(OakenConfig.static_levels: 40/D scale bits)",
                    0,
                ),
            },
            "as oaken (32/D scale bits with static=1, 40/D with levels=1), plus 16 bits x sink tokens",
            "post_rope",
            "methods.build:build_oaken_plus",
            profile="plus",
        ),
        Family(
            "oaken-official",
            "Oaken as the authors' evaluation harness computes it (per-layer calibrated min/max, pre-RoPE keys)",
            {
                "outer": Param(0.04, "share of values in the outer group", 0.0, 1.0),
                "inner": Param(0.06, "share of values in the inner group", 0.0, 1.0),
            },
            "as oaken",
            "pre_rope",
            "methods.build:build_oaken_official",
            batchable=False,
            calibrated=True,
        ),
        Family(
            "int",
            "per-token per-head asymmetric INT-n (QServe / Atom style)",
            {
                "bits": Param(4, "bits per value", 2, 8),
                "group": Param(0, "channels per group (0: the whole head vector)", 0),
            },
            "bits + 32/group (fp16 min and max per group)",
            "post_rope",
            "methods.build:build_int",
            simplified="KV format only (no SmoothAttention / weight quantization of QServe, no reordering of Atom)",
        ),
        Family(
            "kivi",
            "KIVI: keys per channel in groups of tokens, values per token, a full-precision residual window",
            {
                "bits": Param(4, "bits per value", 2, 8),
                "group": Param(32, "tokens per key group and channels per value group", 1),
                "residual": _residual(128, "fp16"),
            },
            "bits + 32/group, the residual window at 16",
            "post_rope",
            "methods.build:build_kivi",
            batchable=False,
        ),
        Family(
            "kvquant",
            "KVQuant-style: pre-RoPE keys per channel, values per token, a share of fp16 outliers kept apart",
            {
                "bits": Param(4, "bits per value", 2, 8),
                "outliers": Param(0.01, "share of values kept at fp16 as sparse outliers", 0.0, 0.5),
            },
            "bits + outliers x (16 + 32 index)",
            "pre_rope",
            "methods.build:build_kvquant",
            simplified="uniform n-bit grid instead of KVQuant's non-uniform nuq; no attention-sink token; ranges from "
            "calibration quantiles",
            calibrated=True,
        ),
        Family(
            "fp8",
            "FP8 e4m3 with a per-tensor scale (vLLM's kv_cache_dtype='fp8')",
            {"scale": Param(1.0, "the per-tensor scale", 1e-30)},
            "8",
            "post_rope",
            "methods.build:build_fp8",
            simplified="per-tensor scale 1.0 (vLLM's uncalibrated default)",
        ),
        Family(
            "quanto",
            "transformers' QuantizedCache (optimum-quanto backend), unchanged",
            {
                "bits": Param(4, "bits per value", 2, 4),
                "group": Param(64, "values per quantization group", 1),
                "residual": _residual(128, "QuantizedCache's residual_length"),
            },
            "bits + scales per group, the residual window at 16",
            "post_rope",
            "methods.build:build_quanto",
            simplified="transformers' QuantizedCache: the first update (the whole prefill) is returned unquantized",
            batchable=False,
        ),
    )
}

#: The familiar names, each a spec.
ALIASES: dict[str, str] = {
    "int4": "int:bits=4",
    "int5": "int:bits=5",
    "int8": "int:bits=8",
    "kivi2": "kivi:bits=2",
    "kivi4": "kivi:bits=4",
    "kvquant3": "kvquant:bits=3",
    "kvquant4": "kvquant:bits=4",
    "quanto2": "quanto:bits=2",
    "quanto4": "quanto:bits=4",
    "oaken-kurtosis": "oaken:kurtosis=1",
    # the oaken-plus presets at other slot widths (oakenkv.calibrate.presets)
    **{p.name: p.spec for p in SLOT_PRESETS},
}


#: Every family and alias under an attribute name (``NAMES.oaken_plus == "oaken-plus"``, ``NAMES.int4``): how other
#: modules refer to a method without spelling its name (a typo is an AttributeError, not a silent miss).
NAMES = SimpleNamespace(**{n.replace("-", "_"): n for n in (*FAMILIES, *ALIASES)})


def _split(spec: str) -> tuple[str, str]:
    if not isinstance(spec, str):
        raise TypeError(f"a method spec is a string, got {type(spec).__name__}")
    spec = ALIASES.get(spec.strip(), spec.strip())
    family, _, rest = spec.partition(":")
    return family.strip(), rest


def _items(family: str, rest: str) -> list[tuple[str, str]]:
    """The spec's ``key=value`` pairs in order; ValueError for a pair without ``=`` or a key given twice."""
    pairs, seen = [], set()
    for item in filter(None, (s.strip() for s in rest.split(","))):
        k, eq, v = item.partition("=")
        k = k.strip()
        if not eq:
            raise ValueError(f"method {family!r}: bad parameter {item!r} (use key=value)")
        if k in seen:
            raise ValueError(f"method {family!r}: {k} is given twice")
        seen.add(k)
        pairs.append((k, v.strip()))
    return pairs


def get_family(name: str) -> Family:
    if name in ALIASES:  # (an alias with parameters after it: _split resolves a bare alias)
        raise ValueError(
            f"{name!r} is an alias of {ALIASES[name]!r} and takes no parameters: give them to the spec itself "
            f"({ALIASES[name]},...)"
        )
    if name not in FAMILIES:
        raise ValueError(f"unknown method {name!r}; known: {', '.join([*FAMILIES, *ALIASES])}")
    return FAMILIES[name]


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``"family:k=v,..."`` (or an alias) -> ``(family, params)`` with defaults filled in, each value of its
    parameter's exact type and range."""
    name, rest = _split(spec)
    fam = get_family(name)
    params = fam.defaults()
    for k, v in _items(name, rest):
        if k not in fam.params:
            raise ValueError(f"method {name!r}: unknown parameter {k!r}; accepted: {', '.join(fam.params) or 'none'}")
        params[k] = fam.params[k].parse(name, k, v)
    if "outer" in params and "inner" in params and params["outer"] + params["inner"] >= 1.0:
        raise ValueError(f"method {name!r}: outer + inner must be below 1, got {params['outer'] + params['inner']:g}")
    if params.get("aware") and not params.get("static"):
        raise ValueError(f"method {name!r}: aware=1 scores the search with the static grids: it needs static=1 as well")
    if params.get("levels") and not params.get("static"):
        raise ValueError(
            f"method {name!r}: levels=1 (static levels) are sizes of the static grid: it needs static=1 as well"
        )
    return name, params


def given_params(spec: str) -> set[str]:
    """The parameters ``spec`` sets itself (an alias counts as setting its own), as opposed to defaults."""
    name, rest = _split(spec)
    return {k for k, _ in _items(name, rest)}


def canonical(family: str, params: dict[str, Any]) -> str:
    """The spec string with only non-default parameters (used as the method's name in results)."""
    defaults = get_family(family).defaults()
    diff = [f"{k}={v}" for k, v in params.items() if v != defaults[k]]
    return family + (":" + ",".join(diff) if diff else "")


def methods_help() -> str:
    """One line per family and its parameters (defaults and ranges), then the aliases: the command line's help."""
    lines = []
    for f in FAMILIES.values():
        ps = ", ".join(f"{k}={p.default} ({p.describe()})" for k, p in f.params.items())
        lines.append(f"{f.name}{'[:' + ps + ']' if ps else ''}: {f.description}.")
    lines.append("Aliases: " + ", ".join(f"{a} = {s}" for a, s in ALIASES.items()) + ".")
    return " ".join(lines)


#: The spec parameters of ``oaken`` that a thresholds file decides, and how to read each from the file.
_FROM_FILE: dict[str, Callable[[Any], Any]] = {
    "outer": lambda th: th.config.outer_ratio,
    "inner": lambda th: th.config.inner_ratio,
    "granularity": lambda th: th.config.granularity,
    "key_position": lambda th: "pre" if th.config.key_position == "pre_rope" else "post",
    "kurtosis": lambda th: int(bool(th.profile.get("kurtosis_tuning", False))),
    "bits": lambda th: th.config.middle_bits,
}
#: Parameters a thresholds file never decides: how the cache holds tokens, not how the file quantizes them.
_NOT_FROM_FILE = ("only", "residual", "adapt")


def check_spec_with_thresholds(spec: str, thresholds: Any, source: str = "the thresholds file") -> dict[str, Any]:
    """Refuse a method spec that contradicts a thresholds file; return the spec's parameters as they will run.

    A thresholds file decides Oaken's ratios, granularity, key position and kurtosis tuning: a spec that sets one
    of them to another value (``oaken:outer=0.1`` with a file profiled at 0.04) would record one setting and run
    another, and a family that takes no thresholds would ignore the file. A profile made after oaken-plus
    transforms needs the family that takes one, whose switches the file's transforms then decide. All raise
    ValueError. The returned parameters are the file's for everything it decides (what the result records), the
    spec's for the rest (``only``, ``residual``).
    """
    name, params = parse_spec(spec)
    fam = FAMILIES[name]
    has_transforms = getattr(thresholds, "transforms", None) is not None
    if fam.profile is None:
        raise ValueError(
            f"a thresholds file applies to the {OAKEN.name!r} and {OAKEN_PLUS.name!r} methods only, not "
            f"{spec.strip()!r}: drop --thresholds, or use --method {OAKEN.name}"
        )
    if fam.profile == "plus":
        if not has_transforms:
            raise ValueError(
                f"{source} holds no oaken-plus transforms: profile with `oakenkv profile --preset {OAKEN_PLUS.name}`, "
                f"or use --method {OAKEN.name}"
            )
        given = given_params(spec)
        # the slot width, the sparse share and the rotations the search allowed: a preset's alias names them; they
        # must be the file's
        recorded = {
            "bits": thresholds.config.middle_bits,
            "sparse": _plus_sparse(thresholds),
            "rot_k": _plus_search_flag(thresholds, "key_rotation"),
            "rot_v": _plus_search_flag(thresholds, "value_rotation"),
            "static": int(thresholds.config.static_grids),
            "levels": int(bool(thresholds.config.static_levels)),
            "alloc": _plus_alloc(thresholds),
            "aware": _plus_aware(thresholds),
        }
        for key, value in recorded.items():
            if key in given and value is not None and params[key] != value:
                raise ValueError(
                    f"--method sets {key}={params[key]} but {source} was profiled with {key}={value:g}: drop it from "
                    "the method (the file decides it) or use a profile made with that setting"
                )
            if value is not None:
                params[key] = value
        extra = sorted(given - set(_NOT_FROM_FILE) - set(recorded))
        if extra:
            raise ValueError(f"--method sets {', '.join(extra)}, but with a thresholds file its transforms decide them")
        return params
    if has_transforms:
        raise ValueError(
            f"{source} was profiled after oaken-plus transforms, which --method {OAKEN.name} does not apply: use "
            f"--method {OAKEN_PLUS.name}"
        )
    given = given_params(spec)
    for key, read in _FROM_FILE.items():
        value = read(thresholds)
        if key in given and params[key] != value:
            raise ValueError(
                f"--method sets {key}={params[key]} but {source} was profiled with {key}={value}: drop {key} from "
                "the method (the file decides it) or profile again with the setting you want"
            )
        params[key] = value
    return params


def _plus_search_notes(thresholds: Any) -> dict[str, Any] | None:
    """The search an oaken-plus profile's transforms record (``Transforms.notes["search"]``), or None."""
    try:
        search = thresholds.transforms.notes["search"]
    except (AttributeError, KeyError, TypeError):
        return None
    return search if isinstance(search, dict) else None


def _plus_search_flag(thresholds: Any, name: str) -> int | None:
    """Whether an oaken-plus profile's search allowed one remedy (``key_rotation``, ``value_rotation``; the search
    its transforms record), or None when the file does not say."""
    flag = (_plus_search_notes(thresholds) or {}).get(name)
    return int(flag) if isinstance(flag, bool) else None


def _plus_alloc(thresholds: Any) -> int | None:
    """Whether an oaken-plus profile's search allocated the sparse share over layers (``alloc``: several budget
    scales), or None when the file does not say (a profile's search notes leave the default out: 0)."""
    search = _plus_search_notes(thresholds)
    return None if search is None else int(len(search.get("budget_scales", [1.0])) > 1)


def _plus_aware(thresholds: Any) -> int | None:
    """Whether an oaken-plus profile's search scored its candidates with static grids (``aware``), or None when the
    file does not say (a profile's search notes leave the default out: 0)."""
    search = _plus_search_notes(thresholds)
    return None if search is None else int(bool(search.get("static_grids", False)))


def _plus_sparse(thresholds: Any) -> float | None:
    """The sparse (inner + outer) share an oaken-plus profile's search split per layer (from the search its
    transforms record), or None when the file does not say."""
    try:
        outer, inner = thresholds.transforms.notes["search"]["ratios"][0]
        return round(float(outer) + float(inner), 6)
    except (AttributeError, KeyError, IndexError, TypeError, ValueError):
        return None


def sweep_config(outlier_share: float) -> OakenConfig:
    """The paper's configuration with the outlier share (outer + inner) scaled, keeping outer:inner = 4:6.

    Figure 12(a) of the paper varies the share of values that go to the sparse (inner + outer) groups.
    """
    if not (isinstance(outlier_share, float | int) and 0.0 < outlier_share < 1.0):
        raise ValueError(f"the outlier share must be in (0, 1), got {outlier_share!r}")
    return OakenConfig(outer_ratio=round(0.4 * outlier_share, 6), inner_ratio=round(0.6 * outlier_share, 6))


@dataclass
class Method:
    """One method, built for a model: how to make a fresh cache for a sequence, and what it is."""

    name: str
    family: str
    params: dict[str, Any]
    make_cache: Callable[[], Any]
    key_position: str
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    #: The model to run instead of the one passed in (``oaken-plus``: a copy with its transforms folded in).
    model: Any = None


@dataclass(frozen=True)
class BuildContext:
    """What a family's builder gets besides its parameters (see :func:`build_method`)."""

    spec: str
    model: Any
    tokenizer: Any
    model_name: str
    thresholds: Any
    calibration: Any
    progress: bool


def build_method(
    spec: str,
    model: Any,
    tokenizer: Any,
    model_name: str = "default",
    *,
    thresholds: Any = None,
    calibration: Any = None,
    progress: bool = False,
) -> Method:
    """Build ``spec`` for ``model``.

    Args:
        spec: method spec string (module doc).
        model, tokenizer: the transformers model and tokenizer.
        model_name: name used for the calibration cache and the results.
        thresholds: a :class:`~oakenkv.calibrate.thresholds.Thresholds` (or a path to one) for the families that
            take one (``oaken``, ``oaken-plus``): the file decides what it profiled, and a spec that sets it
            otherwise, or another family, is refused (:func:`check_spec_with_thresholds`); default: profiled on
            the calibration text.
        calibration: a :class:`~oakenkv.calibrate.spec.CalibrationSpec` (default: the calibration text, 16 x 256;
            oaken-plus: its preset's 16 x 2048).
    """
    name, params = parse_spec(spec)
    fam = FAMILIES[name]
    if thresholds is not None and fam.profile is None:
        check_spec_with_thresholds(spec, thresholds)  # raises: a thresholds file is for oaken only
    module, _, function = fam.build.partition(":")
    builder = getattr(importlib.import_module(f"oakenkv.{module}"), function)
    ctx = BuildContext(spec.strip(), model, tokenizer, model_name, thresholds, calibration, progress)
    return builder(ctx, params)
