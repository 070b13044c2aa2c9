"""How each family of the registry (``oakenkv.methods.registry.FAMILIES``) is built for a model: one function per
family, ``(context, params) -> Method``, named by the family's ``build`` entry.

Every method but ``quanto`` and ``fp`` runs through the evaluation's fake-quantizing cache
(``oakenkv.methods.fakequant.FakeQuantCache``, or KIVI's own layer): the attention reads what the method would
store. Oaken's thresholds come from a thresholds file (``thresholds=``) or are profiled on the calibration text
(never WikiText-2 by default) and cached on disk by content.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

from oakenkv.calibrate.spec import CalibrationSpec
from oakenkv.format.config import DEFAULT_STATIC_LEVELS, OakenConfig
from oakenkv.methods.registry import ALIASES, FAMILIES, BuildContext, Method, canonical, check_spec_with_thresholds
from oakenkv.quant.adapt import AdaptConfig


def _name(ctx: BuildContext, family: str, params: dict[str, Any]) -> str:
    """The method's name in results: an alias as given (the familiar names), else the canonical spec, with a
    non-default calibration of a calibrated family appended (it is part of what is compared)."""
    name = ctx.spec if ctx.spec in ALIASES else canonical(family, params)
    if FAMILIES[family].calibrated and _calibration(ctx) != CalibrationSpec():
        name += f"@{_calibration(ctx).tag()}"
    return name


def _calibration(ctx: BuildContext) -> CalibrationSpec:
    return ctx.calibration or CalibrationSpec()


def _loaded(thresholds: Any) -> tuple[Any, str | None]:
    """``(Thresholds, the file's path or None)`` of a thresholds argument (a loaded profile or a path)."""
    if hasattr(thresholds, "layer"):
        return thresholds, None
    from oakenkv.calibrate.thresholds import Thresholds

    return Thresholds.load(thresholds), str(thresholds)


def _fake_quant(ctx: BuildContext, quantizer: Any, residual: int = 0, model: Any = None) -> Callable[[], Any]:
    from oakenkv.calibrate.rope import RopeTable, has_rope
    from oakenkv.methods.fakequant import FakeQuantCache

    model = ctx.model if model is None else model
    rope = RopeTable(model) if quantizer.key_position == "pre_rope" and has_rope(model) else None
    return lambda: FakeQuantCache(model, quantizer, rope, residual)


def _method(ctx: BuildContext, family: str, params: dict[str, Any], make: Callable[[], Any], **kw: Any) -> Method:
    fam = FAMILIES[family]
    return Method(
        kw.pop("name", None) or _name(ctx, family, params),
        family,
        params,
        make,
        kw.pop("key_position", fam.key_position),
        kw.pop("note", fam.simplified),
        **kw,
    )


def build_fp(ctx: BuildContext, params: dict[str, Any]) -> Method:
    from transformers import DynamicCache

    return _method(ctx, "fp", params, lambda: DynamicCache(config=ctx.model.config))


def build_oaken(ctx: BuildContext, params: dict[str, Any]) -> Method:
    from oakenkv.calibrate import ranges as cal
    from oakenkv.methods.oaken import OakenQuantizer

    family = "oaken"
    extra: dict[str, Any] = {}
    name = None
    if ctx.thresholds is not None:
        thresholds, path = _loaded(ctx.thresholds)
        if path is not None:
            extra["thresholds_file"] = path
        # record what runs: the file's settings, refusing a spec that says otherwise
        params = check_spec_with_thresholds(ctx.spec, thresholds, path or "the thresholds")
        from oakenkv.calibrate.match import check_profile_model

        check_profile_model(thresholds, ctx.model)  # shape, weights, and no oaken-plus transforms
        config = thresholds.config
        defaults = FAMILIES[family].defaults()
        given = [f"{k}={params[k]}" for k in ("only", "residual", "adapt") if params[k] != defaults[k]]
        name = f"oaken[{path or 'thresholds'}]" + (":" + ",".join(given) if given else "")
    else:
        config = OakenConfig(
            outer_ratio=params["outer"],
            inner_ratio=params["inner"],
            granularity=params["granularity"],
            key_position="pre_rope" if params["key_position"] == "pre" else "post_rope",
            middle_bits=params["bits"],
        )
        spec = _calibration(ctx)
        thresholds = cal.oaken_thresholds(
            ctx.model,
            ctx.tokenizer,
            ctx.model_name,
            config,
            spec,
            kurtosis_tuning=bool(params["kurtosis"]),
            progress=ctx.progress,
        )
        extra["calibration"] = spec.tag()
    extra["config"] = config.to_dict()
    extra["thresholds_sha256"] = thresholds.sha256()  # what ran, by content (checkpoints compare it)
    only = {"kv": ("key", "value"), "k": ("key",), "v": ("value",)}[params["only"]]
    note = (
        "" if only == ("key", "value") else f"ablation: only the {only[0]}s are quantized, the other stays at 16 bits"
    )
    q = OakenQuantizer(thresholds, config, only, AdaptConfig() if params["adapt"] else None)
    return _method(
        ctx,
        family,
        params,
        _fake_quant(ctx, q, params["residual"]),
        name=name,
        key_position=config.key_position,
        note=note,
        extra=extra,
    )


def build_oaken_plus(ctx: BuildContext, params: dict[str, Any]) -> Method:
    from oakenkv.calibrate.plus import PlusSearch, apply_profile, cached_plus_profile
    from oakenkv.calibrate.presets import OAKEN_PLUS
    from oakenkv.methods.oaken import PlusQuantizer

    family = OAKEN_PLUS.name
    extra: dict[str, Any] = {}
    name = None
    if ctx.thresholds is not None:
        thresholds, path = _loaded(ctx.thresholds)
        check_spec_with_thresholds(ctx.spec, thresholds, path or "the thresholds")
        if path is not None:
            extra["thresholds_file"] = path
        name = f"{family}[{path or 'thresholds'}]"
        given = [f"{k}={params[k]}" for k in ("residual", "adapt") if params[k]]  # what the file does not decide
        if given:
            name += ":" + ",".join(given)
    else:
        # (levels=1: the default static levels, DEFAULT_STATIC_LEVELS, each row's index stored; static=1 only)
        levels = DEFAULT_STATIC_LEVELS if params["levels"] else ()
        search = PlusSearch.from_flags(
            params["shift"], params["rot_k"], params["rot_v"], params["smooth"], params["ratios"], params["sink"],
            params["bits"], params["sparse"], params["alloc"],
            levels if params["aware"] else None,  # aware=1: scored with the static grids it will be encoded with
        )  # fmt: skip
        # The evaluation's default calibration (16 x 256) is too short for a key shift, which is the mean of
        # post-RoPE keys over the positions it is taken at: oaken-plus calibrates on its preset's (16 x 2048)
        # unless told otherwise.
        spec = OAKEN_PLUS.calibration if ctx.calibration in (None, CalibrationSpec()) else ctx.calibration
        thresholds = cached_plus_profile(ctx.model, ctx.tokenizer, ctx.model_name, spec, search, progress=ctx.progress)
        if params["static"]:
            # static grids (OakenConfig.static_grids): the same search's profile (transforms, thresholds, ratios),
            # encoded with the layer's static middle/inner grids (and levels); the search scores per-row grids
            # unless aware=1
            static = thresholds.config.replace(static_grids=True, static_levels=levels)
            thresholds = dataclasses.replace(thresholds, config=static)
        extra["calibration"] = spec.tag()
        base = ctx.spec if ctx.spec in ALIASES else canonical(family, params)  # a preset's alias: its name
        name = base + ("" if spec == OAKEN_PLUS.calibration else f"@{spec.tag()}")
    folded = apply_profile(copy.deepcopy(ctx.model), thresholds)
    extra["transforms"] = thresholds.transforms.digest()[:16]
    extra["thresholds_sha256"] = thresholds.sha256()  # what ran, by content (checkpoints compare it)
    q = PlusQuantizer(thresholds, AdaptConfig() if params["adapt"] else None)
    return _method(
        ctx, family, params, _fake_quant(ctx, q, params["residual"], folded), name=name, extra=extra, model=folded
    )


def build_oaken_official(ctx: BuildContext, params: dict[str, Any]) -> Method:
    from oakenkv.calibrate import ranges as cal
    from oakenkv.methods.oaken_official import OakenOfficialQuantizer

    spec = _calibration(ctx)
    config = OakenConfig(outer_ratio=params["outer"], inner_ratio=params["inner"], key_position="pre_rope")
    thr = cal.oaken_thresholds(ctx.model, ctx.tokenizer, ctx.model_name, config, spec, progress=ctx.progress)
    rng = cal.kv_ranges(ctx.model, ctx.tokenizer, ctx.model_name, spec)
    n = thr.num_layers
    q = OakenOfficialQuantizer(
        {"key": [thr.layer(i, "key") for i in range(n)], "value": [thr.layer(i, "value") for i in range(n)]},
        {"key": rng.key_extremes, "value": rng.value_extremes},
    )
    extra = {"calibration": spec.tag(), "thresholds_sha256": thr.sha256(), "ranges_sha256": rng.sha256()}
    return _method(ctx, "oaken-official", params, _fake_quant(ctx, q), extra=extra)


def build_int(ctx: BuildContext, params: dict[str, Any]) -> Method:
    from oakenkv.methods.uniform import PerTokenIntQuantizer

    q = PerTokenIntQuantizer(params["bits"], params["group"] or None)
    return _method(ctx, "int", params, _fake_quant(ctx, q))


def build_kivi(ctx: BuildContext, params: dict[str, Any]) -> Method:
    from oakenkv.methods.fakequant import KiviCache

    b, g, r = params["bits"], params["group"], params["residual"]
    return _method(ctx, "kivi", params, lambda: KiviCache(ctx.model, b, g, r))


def build_kvquant(ctx: BuildContext, params: dict[str, Any]) -> Method:
    from oakenkv.calibrate import ranges as cal
    from oakenkv.methods.kvquant import KVQuantQuantizer

    spec = _calibration(ctx)
    rng = cal.kv_ranges(ctx.model, ctx.tokenizer, ctx.model_name, spec, q=params["outliers"] / 2)
    q = KVQuantQuantizer(
        list(zip(rng.key_channel_lo, rng.key_channel_hi, strict=True)), params["bits"], params["outliers"]
    )
    extra = {"calibration": spec.tag(), "ranges_sha256": rng.sha256()}
    return _method(ctx, "kvquant", params, _fake_quant(ctx, q), extra=extra)


def build_fp8(ctx: BuildContext, params: dict[str, Any]) -> Method:
    from oakenkv.methods.fp8 import Fp8Quantizer

    return _method(ctx, "fp8", params, _fake_quant(ctx, Fp8Quantizer(params["scale"])))


def build_quanto(ctx: BuildContext, params: dict[str, Any]) -> Method:
    from transformers import QuantizedCache

    b, g, r = params["bits"], params["group"], params["residual"]
    config = ctx.model.config

    def make() -> Any:
        return QuantizedCache(backend="quanto", config=config, nbits=b, q_group_size=g, residual_length=r)

    return _method(ctx, "quanto", params, make)
