"""The KV-cache methods the evaluation compares, behind one interface.

A method is named by a spec string ``family[:key=value,...]``, e.g. ``oaken``, ``oaken:outer=0.06,inner=0.09``,
``int:bits=5``, ``kivi:bits=4,group=32,residual=128``. Aliases: ``int4``, ``int5``, ``kivi4``, ``kvquant4``,
``quanto4``, ``oaken-kurtosis``.

| family | what the attention reads | keys quantized |
|---|---|---|
| ``fp`` | unquantized (16 bits counted) | - |
| ``oaken`` | :func:`oakenkv.quant.quantizer.quantize_dequantize` per token vector, profiled thresholds | post (or
``pre``) |
| ``oaken-official`` | Oaken, calibrated global min/max per layer (``baselines.oaken_official``) | pre-RoPE |
| ``int`` | per-token-per-head asymmetric INT-n, QServe / Atom style | post-RoPE |
| ``kivi`` | KIVI: keys per channel in token groups, values per token, fp16 residual | post-RoPE |
| ``kvquant`` | KVQuant-style 4-bit + 1% fp16 outliers (uniform grid, see its module) | pre-RoPE, per channel |
| ``fp8`` | FP8 e4m3, per-tensor scale 1.0 (vLLM default) | post-RoPE |
| ``quanto`` | transformers' ``QuantizedCache(backend="quanto")``, unchanged | post-RoPE |

``oaken:only=k`` (or ``only=v``) is an ablation: only the keys (values) are quantized, the other kind is read
unquantized and counted at 16 bits; it shows which side costs Oaken its perplexity.

``oaken:residual=R`` (and ``oaken-plus:residual=R``) keeps each layer's newest tokens unquantized, in a window of R
to 2R - 1 tokens once the sequence is that long, as ``OakenCache``'s window does (semantics:
:mod:`oakenkv.methods.fakequant`); they count 32 bits per value (float32, as the cache holds them). 0, the default, is
the paper's Oaken. A thresholds file does not decide it.

Oaken's thresholds come from a thresholds file (``thresholds=``) or are profiled on the calibration text
(:mod:`oakenkv.calibrate.ranges`; never WikiText-2 by default).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from oakenkv.format.config import OakenConfig
from oakenkv.methods.base import Kind, KVFakeQuantizer, check_kv

# The method specs (parsed without torch, for the CLI's checks) live in oakenkv.methods.spec; re-exported here.
from oakenkv.methods.spec import (
    ALIASES,
    FAMILIES,
    SIMPLIFIED,
    canonical,
    check_spec_with_thresholds,
    given_params,
    parse_spec,
    sweep_config,
)

__all__ = [
    "ALIASES",
    "FAMILIES",
    "SIMPLIFIED",
    "Method",
    "OakenQuantizer",
    "build_method",
    "canonical",
    "check_spec_with_thresholds",
    "given_params",
    "parse_spec",
    "sweep_config",
]


class OakenQuantizer(KVFakeQuantizer):
    """Oaken's quantize-dequantize (:mod:`oakenkv.quant.quantizer`, run through the codec's kernels), one vector per
    token.

    Token granularity: ``[B, H, S, D] -> [B*S, H*D]`` (one token's keys of all KV heads of a layer, the paper's
    vector); head granularity: ``[B*S*H, D]``. Stored bits are the bytes the codec produced for those rows
    (dense nibbles, COO entries, six per-token scales, 16-bit header; ``oakenkv.format.layout``), less the rare escape
    bytes: the evaluation has always reported the format's cost without escapes (its committed results), and
    ``codec.effective_bits`` gives the figure with them (+0.004 bits per value on the default model).
    """

    def __init__(self, thresholds: Any, config: OakenConfig, kinds: tuple[str, ...] = ("key", "value")) -> None:
        if not kinds or any(k not in ("key", "value") for k in kinds):
            raise ValueError(f"kinds must be a non-empty subset of ('key', 'value'), got {kinds!r}")
        self.thresholds = thresholds
        self.config = config
        self.key_position = config.key_position
        #: The kinds that are quantized; the other one (an ablation) stays unquantized, counted at 16 bits.
        self.kinds = tuple(kinds)

    def quantize(self, layer_idx: int, kind: Kind, x: torch.Tensor) -> tuple[torch.Tensor, float]:
        from oakenkv.kernels.cpu.codec import decode_batch, encode_batch, sparse_stream_stats

        check_kv(x, kind)
        if kind not in self.kinds:
            return x, 16.0 * x.numel()
        b, h, s, d = x.shape
        rows = x.permute(0, 2, 1, 3).reshape(b * s, h * d)  # [B*S, H*D]: one token vector per row
        if self.config.granularity == "head":
            rows = rows.reshape(b * s * h, d)
        thr = self.thresholds.layer(layer_idx, kind)
        # The numba codec's round trip: bit-identical to quant.quantize_dequantize (tests/test_eval.py checks it)
        # and much faster than the reference.
        enc = encode_batch(rows, thr, self.config)
        y = decode_batch(enc, thr, self.config)
        _, escape_bytes = sparse_stream_stats(enc)
        bits = 8 * (enc.nbytes() - escape_bytes)
        return y.reshape(b, s, h, d).permute(0, 2, 1, 3).contiguous(), bits


class PlusQuantizer(OakenQuantizer):
    """``oaken-plus``: Oaken's quantizer after the profile's online key transform (a shift, a rotation), on a
    model that carries the profile's folded transforms (``oakenkv.calibrate.transforms``). Returns keys in the model's
    frame up to the shift, which softmax ignores, exactly as ``OakenCache`` hands them to attention."""

    def __init__(self, thresholds: Any) -> None:
        super().__init__(thresholds, thresholds.config)
        self.transforms = thresholds.transforms

    def quantize(self, layer_idx: int, kind: Kind, x: torch.Tensor) -> tuple[torch.Tensor, float]:
        if kind != "key":
            return super().quantize(layer_idx, kind, x)
        y, bits = super().quantize(layer_idx, kind, self.transforms.keys_forward(layer_idx, x))
        return self.transforms.keys_restore(layer_idx, y).to(x.dtype), bits

    @property
    def sink_tokens(self) -> int:
        """The first tokens of a sequence kept at 16 bits beside their codes (``Transforms.sink_tokens``)."""
        return self.transforms.sink_tokens

    def unquantized(self, layer_idx: int, kind: Kind, x: torch.Tensor) -> torch.Tensor:
        """Keys of the full-precision window as ``OakenCache`` hands them to attention: after the online transform
        (in float32, as the store holds its window) and restored like the dequantized ones, so that every key
        carries the shift; values as they are."""
        if kind != "key":
            return x
        return self.transforms.keys_restore(layer_idx, self.transforms.keys_forward(layer_idx, x)).to(x.dtype)

    def sink(self, layer_idx: int, kind: Kind, x: torch.Tensor) -> torch.Tensor:
        """Sink tokens ``[B, H, n, hd]`` as ``OakenCache`` hands them to attention: float16 (keys after the online
        transform, then restored like the dequantized ones). The cache's bits count them (``FakeQuantCache``)."""
        if kind != "key":
            return x.to(torch.float16).to(x.dtype)
        k = self.transforms.keys_forward(layer_idx, x).to(torch.float16).to(torch.float32)
        return self.transforms.keys_restore(layer_idx, k).to(x.dtype)


@dataclass
class Method:
    """One evaluated method: how to make a fresh cache for a sequence, and what it is."""

    name: str
    family: str
    params: dict[str, Any]
    make_cache: Callable[[], Any]
    key_position: str
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    #: The model to run instead of the one passed in (``oaken-plus``: a copy with its transforms folded in).
    model: Any = None


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
        thresholds: a :class:`~oakenkv.calibrate.thresholds.Thresholds` (or a path to one) for ``oaken``: the file
        decides
            the ratios, granularity, key position and tuning, and a spec that sets them otherwise, or another
            family, is refused (:func:`check_spec_with_thresholds`); default: profiled on the calibration text.
        calibration: a :class:`~oakenkv.calibrate.ranges.CalibrationSpec` (default: Wikipedia, 32 x 256).
    """
    from transformers import DynamicCache

    from oakenkv.calibrate import ranges as cal
    from oakenkv.calibrate.rope import RopeTable
    from oakenkv.methods.fakequant import FakeQuantCache, KiviCache

    family, params = parse_spec(spec)
    # Aliases are the familiar names (int4, kivi4, ...): keep them in results.
    name = spec.strip() if spec.strip() in ALIASES else canonical(family, params)
    spec_obj = calibration or cal.CalibrationSpec()
    note = SIMPLIFIED.get(family, "")
    extra: dict[str, Any] = {}
    if family in ("oaken", "oaken-official", "kvquant") and spec_obj != cal.CalibrationSpec():
        name += f"@{spec_obj.tag()}"  # a non-default calibration is part of what is compared

    def fq(quantizer: KVFakeQuantizer, residual: int = 0) -> Callable[[], Any]:
        rope = RopeTable(model) if quantizer.key_position == "pre_rope" else None
        return lambda: FakeQuantCache(model, quantizer, rope, residual)

    if family == "fp":
        return Method(name, family, params, lambda: DynamicCache(config=model.config), "post_rope")
    if thresholds is not None and family not in ("oaken", "oaken-plus"):
        check_spec_with_thresholds(spec, thresholds)  # raises: a thresholds file is for oaken only
    if family == "oaken-plus" and thresholds is not None:
        from oakenkv.calibrate.thresholds import Thresholds

        loaded = thresholds if hasattr(thresholds, "layer") else Thresholds.load(thresholds)
        check_spec_with_thresholds(spec, loaded, "the thresholds" if loaded is thresholds else str(thresholds))
    if family == "oaken":
        if thresholds is not None:
            if not hasattr(thresholds, "layer"):
                from oakenkv.calibrate.thresholds import Thresholds

                extra["thresholds_file"] = str(thresholds)
                thresholds = Thresholds.load(thresholds)
            # record what runs: the file's settings, refusing a spec that says otherwise
            params = check_spec_with_thresholds(spec, thresholds, extra.get("thresholds_file", "the thresholds"))
            thresholds.check_model(model)  # shape and weights
            config = thresholds.config
            name = f"oaken[{extra.get('thresholds_file', 'thresholds')}]"
            given = [f"{k}={params[k]}" for k in ("only", "residual") if params[k] != FAMILIES["oaken"][k]]
            if given:  # what the file does not decide
                name += ":" + ",".join(given)
        else:
            config = OakenConfig(
                outer_ratio=params["outer"],
                inner_ratio=params["inner"],
                granularity=params["granularity"],
                key_position="pre_rope" if params["key_position"] == "pre" else "post_rope",
            )
            thresholds = cal.oaken_thresholds(
                model,
                tokenizer,
                model_name,
                config,
                spec_obj,
                kurtosis_tuning=bool(params["kurtosis"]),
                progress=progress,
            )
            extra["calibration"] = spec_obj.tag()
        extra["config"] = config.to_dict()
        extra["thresholds_sha256"] = thresholds.sha256()  # what ran, by content (checkpoints compare it)
        only = {"kv": ("key", "value"), "k": ("key",), "v": ("value",)}.get(params["only"])
        if only is None:
            raise ValueError(f"method 'oaken': only={params['only']!r}; use kv (default), k or v")
        if only != ("key", "value"):
            note = f"ablation: only the {only[0]}s are quantized, the other kind stays at 16 bits"
        q = OakenQuantizer(thresholds, config, only)
        return Method(name, family, params, fq(q, params["residual"]), config.key_position, note, extra)
    if family == "oaken-plus":
        return _oaken_plus(name, params, model, tokenizer, model_name, thresholds, calibration, progress)
    if family == "oaken-official":
        from oakenkv.methods.oaken_official import OakenOfficialQuantizer

        config = OakenConfig(outer_ratio=params["outer"], inner_ratio=params["inner"], key_position="pre_rope")
        thr = cal.oaken_thresholds(model, tokenizer, model_name, config, spec_obj, progress=progress)
        rng = cal.kv_ranges(model, tokenizer, model_name, spec_obj)
        n = thr.num_layers
        q = OakenOfficialQuantizer(
            {"key": [thr.layer(i, "key") for i in range(n)], "value": [thr.layer(i, "value") for i in range(n)]},
            {"key": rng.key_extremes, "value": rng.value_extremes},
        )
        extra["calibration"] = spec_obj.tag()
        extra["thresholds_sha256"], extra["ranges_sha256"] = thr.sha256(), rng.sha256()
        return Method(name, family, params, fq(q), "pre_rope", note, extra)
    if family == "int":
        from oakenkv.methods.uniform import PerTokenIntQuantizer

        q = PerTokenIntQuantizer(params["bits"], params["group"] or None)
        return Method(name, family, params, fq(q), "post_rope", note)
    if family == "kivi":
        b, g, r = params["bits"], params["group"], params["residual"]
        return Method(name, family, params, lambda: KiviCache(model, b, g, r), "post_rope", note)
    if family == "kvquant":
        from oakenkv.methods.kvquant import KVQuantQuantizer

        rng = cal.kv_ranges(model, tokenizer, model_name, spec_obj, q=params["outliers"] / 2)
        q = KVQuantQuantizer(
            list(zip(rng.key_channel_lo, rng.key_channel_hi, strict=True)), params["bits"], params["outliers"]
        )
        extra["calibration"] = spec_obj.tag()
        extra["ranges_sha256"] = rng.sha256()
        return Method(name, family, params, fq(q), "pre_rope", note, extra)
    if family == "fp8":
        from oakenkv.methods.fp8 import Fp8Quantizer

        return Method(name, family, params, fq(Fp8Quantizer(params["scale"])), "post_rope", note)
    if family == "quanto":
        from transformers import QuantizedCache

        b, g, r = params["bits"], params["group"], params["residual"]

        def make() -> Any:
            return QuantizedCache(backend="quanto", config=model.config, nbits=b, q_group_size=g, residual_length=r)

        return Method(name, family, params, make, "post_rope", note)
    raise AssertionError(family)  # parse_spec only returns known families


def _oaken_plus(
    name: str,
    params: dict[str, Any],
    model: Any,
    tokenizer: Any,
    model_name: str,
    thresholds: Any,
    calibration: Any,
    progress: bool,
) -> Method:
    import copy

    from oakenkv.calibrate.plus import PLUS_CALIBRATION, PlusSearch, apply_profile, cached_plus_profile
    from oakenkv.calibrate.thresholds import Thresholds
    from oakenkv.methods.fakequant import FakeQuantCache

    extra: dict[str, Any] = {}
    if thresholds is not None:
        if not hasattr(thresholds, "layer"):
            extra["thresholds_file"] = str(thresholds)
            thresholds = Thresholds.load(thresholds)
        if thresholds.transforms is None:
            raise ValueError("oaken-plus needs a profile with transforms (`oakenkv profile --preset oaken-plus`)")
        name = f"oaken-plus[{extra.get('thresholds_file', 'thresholds')}]"
        if params["residual"]:  # the one parameter the file does not decide
            name += f":residual={params['residual']}"
    else:
        search = PlusSearch.from_flags(
            params["shift"], params["rot_k"], params["rot_v"], params["smooth"], params["ratios"], params["sink"]
        )  # (parse_spec checked the values)
        from oakenkv.calibrate.profile import CalibrationSpec

        # The evaluation's default calibration (16 x 256) is too short for a key shift, which is the mean of
        # post-RoPE keys over the positions it is taken at: oaken-plus calibrates on 16 x 2048 unless told otherwise.
        spec = PLUS_CALIBRATION if calibration in (None, CalibrationSpec()) else calibration
        thresholds = cached_plus_profile(model, tokenizer, model_name, spec, search, progress=progress)
        extra["calibration"] = spec.tag()
        if spec != PLUS_CALIBRATION:
            name += f"@{spec.tag()}"
    folded = apply_profile(copy.deepcopy(model), thresholds)
    extra["transforms"] = thresholds.transforms.digest()[:16]
    extra["thresholds_sha256"] = thresholds.sha256()  # what ran, by content (checkpoints compare it)
    q, residual = PlusQuantizer(thresholds), params["residual"]
    return Method(
        name, "oaken-plus", params, lambda: FakeQuantCache(folded, q, residual=residual), "post_rope", "", extra, folded
    )
