"""Method specs and evaluation arguments, checked without torch (the CLI validates them before any model loads).

A method is named by a spec string ``family[:key=value,...]`` (``oakenkv.methods.registry`` builds it): this module
parses specs (:func:`parse_spec`), refuses a spec that contradicts a thresholds file
(:func:`check_spec_with_thresholds`) and checks an evaluation's arguments (:func:`check_run_args`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from oakenkv.format.config import MAX_SINK_TOKENS, OakenConfig, valid_sink_tokens

#: Zero-shot tasks and the metric each reports (``oakenkv.eval.zeroshot``).
ZEROSHOT_TASKS = {
    "piqa": ("piqa", "acc_norm"),
    "winogrande": ("winogrande", "acc"),
    "hellaswag": ("hellaswag", "acc_norm"),
}

ALIASES = {
    "int4": "int:bits=4",
    "int5": "int:bits=5",
    "kivi4": "kivi:bits=4",
    "kvquant4": "kvquant:bits=4",
    "quanto4": "quanto:bits=4",
    "oaken-kurtosis": "oaken:kurtosis=1",
}

#: Each family's parameters and defaults (also the set of accepted keys).
FAMILIES: dict[str, dict[str, Any]] = {
    "fp": {},
    "oaken": {
        "outer": 0.04,
        "inner": 0.06,
        "granularity": "token",
        "key_position": "post",
        "kurtosis": 0,
        "only": "kv",
        "residual": 0,
    },
    # oaken-plus: each remedy can be switched on or off for the ablation table (the defaults: the preset; the
    # Hadamard rotations are off in it, see oakenkv.calibrate.plus.PlusSearch).
    # sink: the first tokens of a sequence kept at 16 bits (a count, not a switch).
    "oaken-plus": {"shift": 1, "rot_k": 0, "rot_v": 0, "smooth": 1, "ratios": 1, "sink": 1, "residual": 0},
    "oaken-official": {"outer": 0.04, "inner": 0.06},
    "int": {"bits": 4, "group": 0},
    "kivi": {"bits": 4, "group": 32, "residual": 128},
    "kvquant": {"bits": 4, "outliers": 0.01},
    "fp8": {"scale": 1.0},
    "quanto": {"bits": 4, "group": 64, "residual": 128},
}

#: The families that take ``residual``: the newest tokens of each layer kept at full precision, unquantized (a
#: token count; 0, the default, is the paper's Oaken, every token quantized).
#: ``oakenkv.methods.fakequant.FakeQuantCache``
#: has the semantics. A thresholds file does not decide it (:func:`check_spec_with_thresholds` passes it through).
RESIDUAL_FAMILIES = ("oaken", "oaken-plus")

#: What each family simplifies relative to the method it stands for (printed in reports).
SIMPLIFIED = {
    "kvquant": "uniform 4-bit grid instead of KVQuant's non-uniform nuq4; no attention-sink token; ranges from "
    "calibration quantiles",
    "int": "KV format only (no SmoothAttention / weight quantization of QServe, no reordering of Atom)",
    "fp8": "per-tensor scale 1.0 (vLLM's uncalibrated default)",
    "quanto": "transformers' QuantizedCache: the first update (the whole prefill) is returned unquantized",
    "kivi": "",
}


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``"family:k=v,..."`` -> ``(family, params)`` with defaults filled in and types checked."""
    spec = ALIASES.get(spec.strip(), spec.strip())
    family, _, rest = spec.partition(":")
    if family not in FAMILIES:
        raise ValueError(f"unknown method {family!r}; known: {', '.join([*FAMILIES, *ALIASES])}")
    params = dict(FAMILIES[family])
    for item in filter(None, (s.strip() for s in rest.split(","))):
        k, eq, v = item.partition("=")
        if not eq or k not in params:
            raise ValueError(f"method {family!r}: bad parameter {item!r}; accepted: {', '.join(params) or 'none'}")
        default = params[k]
        try:
            params[k] = type(default)(v) if not isinstance(default, str) else v
        except ValueError as e:
            raise ValueError(f"method {family!r}: {k}={v!r} is not a {type(default).__name__}") from e
    if family in RESIDUAL_FAMILIES and params["residual"] < 0:
        raise ValueError(
            f"method {family!r}: residual must be 0 (off: every token quantized) or a positive token count, "
            f"got {params['residual']}"
        )
    if family == "oaken-plus":  # switches (and the sink's token count): checked here, before a model loads
        for k, v in params.items():
            if k == "residual":
                continue
            if k == "sink":
                if not valid_sink_tokens(v):
                    raise ValueError(f"method 'oaken-plus': sink must be 0 to {MAX_SINK_TOKENS} tokens, got {v}")
            elif v not in (0, 1):
                raise ValueError(f"method 'oaken-plus': {k} must be 0 or 1, got {v}")
    return family, params


def given_params(spec: str) -> set[str]:
    """The parameters ``spec`` sets itself (an alias counts as setting its own), as opposed to defaults."""
    spec = ALIASES.get(spec.strip(), spec.strip())
    _, _, rest = spec.partition(":")
    return {item.partition("=")[0].strip() for item in rest.split(",") if item.strip()}


#: The spec parameters of ``oaken`` that a thresholds file decides, and how to read each from the file.
_FROM_FILE: dict[str, Callable[[Any], Any]] = {
    "outer": lambda th: th.config.outer_ratio,
    "inner": lambda th: th.config.inner_ratio,
    "granularity": lambda th: th.config.granularity,
    "key_position": lambda th: "pre" if th.config.key_position == "pre_rope" else "post",
    "kurtosis": lambda th: int(bool(th.profile.get("kurtosis_tuning", False))),
}


def check_spec_with_thresholds(spec: str, thresholds: Any, source: str = "the thresholds file") -> dict[str, Any]:
    """Refuse a method spec that contradicts a thresholds file; return the spec's parameters as they will run.

    A thresholds file decides Oaken's ratios, granularity, key position and kurtosis tuning: a spec that sets one
    of them to another value (``oaken:outer=0.1`` with a file profiled at 0.04) would record one setting and run
    another, and a method other than ``oaken`` / ``oaken-plus`` would ignore the file. A profile made after
    oaken-plus transforms needs ``oaken-plus`` (plain Oaken would use its thresholds on untransformed keys), whose
    switches the file's transforms then decide. All raise ValueError. The returned parameters are the file's for
    everything it decides (what the result records), the spec's for the rest (``only``, ``residual``: how the
    cache holds the tokens, not how the file quantizes them).
    """
    family, params = parse_spec(spec)
    transforms = getattr(thresholds, "transforms", None)
    if family == "oaken-plus":
        # the profile's transforms decide every remedy: a switch in the spec would be recorded and not run
        if transforms is None:
            raise ValueError(
                f"{source} holds no oaken-plus transforms: profile with `oakenkv profile --preset oaken-plus`, or "
                "use --method oaken"
            )
        given = sorted(given_params(spec) - {"residual"})
        if given:
            raise ValueError(f"--method sets {', '.join(given)}, but with a thresholds file its transforms decide them")
        return params
    if family != "oaken":
        raise ValueError(
            f"a thresholds file applies to the 'oaken' and 'oaken-plus' methods only, not {spec.strip()!r}: drop "
            "--thresholds, or use --method oaken"
        )
    if transforms is not None:
        raise ValueError(
            f"{source} was profiled after oaken-plus transforms, which --method oaken does not apply: use --method "
            "oaken-plus"
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


def canonical(family: str, params: dict[str, Any]) -> str:
    """The spec string with only non-default parameters (used as the method's name in results)."""
    diff = [f"{k}={v}" for k, v in params.items() if v != FAMILIES[family][k]]
    return family + (":" + ",".join(diff) if diff else "")


def sweep_config(outlier_share: float) -> OakenConfig:
    """The paper's configuration with the outlier share (outer + inner) scaled, keeping outer:inner = 4:6.

    Figure 12(a) of the paper varies the share of values that go to the sparse (inner + outer) groups.
    """
    return OakenConfig(outer_ratio=round(0.4 * outlier_share, 6), inner_ratio=round(0.6 * outlier_share, 6))


def check_run_args(
    model: str,
    method: str,
    thresholds: Any = None,
    *,
    dataset: str | None = None,
    window: int | None = None,
    stride: int | None = None,
    chunk: int | None = None,
) -> None:
    """Validate an evaluation's arguments without loading anything heavy (no torch; the model is located, not
    loaded): the method spec, a thresholds file (read, and refused when it contradicts the spec or the method is
    not Oaken), the text and the window sizes. Raises ValueError / FileNotFoundError naming the problem."""
    from oakenkv.assets.data import TEXTS
    from oakenkv.assets.models import locate_model

    parse_spec(method)
    if thresholds is not None:
        th, source = thresholds, "the thresholds"
        if not hasattr(th, "layer"):
            from oakenkv.calibrate.thresholds import Thresholds

            th, source = Thresholds.load(thresholds), str(thresholds)
        check_spec_with_thresholds(method, th, source)
    if dataset is not None and dataset not in TEXTS:
        raise ValueError(f"unknown dataset {dataset!r}; known: {', '.join(TEXTS)}")
    for name, v, least in (("window", window, 2), ("stride", stride, 1), ("chunk", chunk, 1)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < least):
            raise ValueError(f"{name} must be an int >= {least}, got {v!r}")
    locate_model(model)
