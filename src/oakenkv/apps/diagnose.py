"""Diagnosis of a model's keys and values: where Oaken's outliers sit, and what each method does to them.

``oakenkv diagnose --model M`` (:func:`diagnose_model`) runs the model over a few calibration windows, records what
every layer's cache would store (keys after RoPE, values) and rotates the keys back to before RoPE
(:mod:`oakenkv.calibrate.rope`). Per layer, for keys (post- and pre-RoPE) and values, it reports:

- **outer-group concentration**: the share of the layer's outer-group values (outside ``To_lo``/``To_hi`` of the
  paper's thresholds, ``oakenkv.calibrate.profile``) that fall in its top ``k`` channels, ``k`` = 2% of the
  ``num_kv_heads * head_dim`` channels (at least 1), beside ``k / D``, what a uniform spread gives. Oaken shares one
  set of thresholds and one set of per-token scales over all channels: when a few channels hold most outliers,
  every token's range is set by them. Pre-RoPE keys use thresholds of the same ratios taken on the pre-RoPE keys;
- **channel magnitude**: each channel's absmax over the tokens, the largest relative to the median channel's, and
  which (head, channel) it is;
- **offsets**: each channel's mean over the tokens relative to its absmax (near 1: a channel of constant sign),
  and the share of the keys' power that the per-channel means carry (what ``oaken-plus``'s key shift removes);
- **reconstruction SQNR** in dB, ``10 log10(sum x^2 / sum (x - x_hat)^2)``, of each method's round trip of the
  recorded keys and values (:data:`METHODS`), with its stored bits per value.

Channel statistics skip each window's first token (the attention sink, whose key is atypical and would set
every channel's absmax), as ``oaken-plus`` does for its key shift; the SQNR covers every token, as the cache
stores them. From these, a verdict in words (:data:`FIXED_CHANNEL_SHARE`, :data:`OFFSET_POWER` state the rules)
and, with an ``oaken-plus`` profile, what that preset does per layer (``oakenkv.calibrate.plus``).
:func:`plot_diagnosis` draws the channels x layers heat map.

Product module: it stands on the profiler, the codec, the transforms and ``oakenkv.methods``' quantizers; it
never imports the evaluation (``tests/test_architecture.py``).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from oakenkv.apps.diagnose_stats import (
    CONSTANT_SIGN,
    TOP_SHARE,
    ChannelStats,
    Tally,
    channel_stats,
    finite_or_none,
    kivi_keys_round_trip,
    oaken_round_trip,
    sqnr_db,
    top_k_channels,
    window_thresholds,
)
from oakenkv.calibrate.profile import CalibrationSpec, KVRecorder, ProgressLog
from oakenkv.calibrate.thresholds import ModelFingerprint, Thresholds
from oakenkv.format.config import OakenConfig
from oakenkv.methods.registry import NAMES

#: Default calibration of a diagnosis: 4 windows of 512 tokens of the Wikipedia excerpt (short: a diagnosis comes
#: before any long run; the oaken-plus search is what costs more).
DIAGNOSE_CALIBRATION = CalibrationSpec(samples=4, window=512)
#: Verdict rule: a layer has fixed-channel key outliers when its top-k post-RoPE key channels hold at least this
#: share of its outer-group key values, about 12 times what a uniform spread gives (``TOP_SHARE``). One channel
#: whose values are all outliers holds ``1 / (outer_ratio * D)`` of them (13% at D = 192, 4% outer). The rule sits
#: between the shares of the embedded models (all far above it) and of a randomly initialised Llama (a few
#: percent); docs/diagnose.md and docs/notebook/perf-notes.md have the measured shares.
FIXED_CHANNEL_SHARE = 0.25
#: Verdict rule: a layer's keys carry per-channel offsets when the per-channel means (over positions, post-RoPE)
#: carry at least this share of the keys' power (mean square): a key shift removes that much.
OFFSET_POWER = 0.1

#: The methods whose round trip is measured (registry names), with how the diagnosis measures each (key frame,
#: grouping, bits): in-sample on the diagnosis windows, not through the evaluation's cache.
METHODS: dict[str, str] = {
    NAMES.oaken: "the paper's Oaken: per-token groups over all KV heads, the model's profiled thresholds, the "
    "codec's bytes",
    NAMES.oaken_plus: "Oaken after the oaken-plus profile's transforms (key scale, shift and rotation, value "
    "rotation; per-layer ratios); key error in the model's frame up to the shift, which softmax ignores",
    NAMES.int4: "per-token per-head asymmetric INT4 (QServe / Atom style), post-RoPE keys",
    NAMES.kivi4: "KIVI-style INT4: keys per channel in groups of 32 tokens of a window, values per token in groups "
    "of 32 channels; no fp16 residual window",
    NAMES.kvquant4: "KVQuant-style 4-bit + 1% fp16 outliers: pre-RoPE keys per channel with ranges from these same "
    "windows (in-sample), values per token",
    NAMES.fp8: "FP8 e4m3, per-tensor scale 1.0 (vLLM's default)",
}
KINDS = ("key", "value")


# ----------------------------------------------------------------------------------------------- oaken-plus


def plus_choices(profile: Thresholds) -> list[dict[str, Any]]:
    """Per layer, what an ``oaken-plus`` profile does: key shift, key rotation, key smoothing exponent (0: none),
    value rotation, and the (outer, inner) group ratios of keys and values."""
    t = profile.transforms
    if t is None:
        raise ValueError("not an oaken-plus profile: it carries no transforms")
    notes = profile.profile.get("choices") or []
    out = []
    for i, lt in enumerate(t.layers):
        alpha: float | None = 0.0
        if lt.key_scale is not None:
            m = re.search(r"alpha=([0-9.eE+-]+)", notes[i].get("key", "")) if i < len(notes) else None
            alpha = float(m.group(1)) if m else None  # smoothing, exponent not recorded
        ks, vs = profile.stats(i, "key"), profile.stats(i, "value")
        out.append(
            {
                "key_shift": lt.key_shift is not None,
                "key_rotation": lt.key_rotation,
                "key_smoothing": lt.key_scale is not None,
                "key_alpha": alpha,
                "value_rotation": lt.value_rotation,
                "key_ratios": None if ks is None else [ks.outer_ratio, ks.inner_ratio],
                "value_ratios": None if vs is None else [vs.outer_ratio, vs.inner_ratio],
            }
        )
    return out


def _count(items: Sequence[Any]) -> str:
    seen: dict[str, int] = {}
    for it in items:
        seen[str(it)] = seen.get(str(it), 0) + 1
    return ", ".join(f"{k} x{n}" for k, n in seen.items())


def remedy_summary(choices: list[dict[str, Any]]) -> str:
    """One sentence: how many layers use each oaken-plus remedy."""
    n = len(choices)

    def layers(key: str) -> int:
        return sum(bool(c[key]) for c in choices)

    alphas = [c["key_alpha"] for c in choices if c["key_smoothing"]]
    smooth = f"key smoothing in {len(alphas)}/{n}"
    if alphas:
        smooth += " (alpha " + _count(["?" if a is None else f"{a:g}" for a in alphas]) + ")"

    def ratios(key: str) -> str:
        return _count([f"{r[0]:.0%}/{r[1]:.0%}" for r in (c[key] for c in choices) if r is not None])

    return (
        f"key shift in {layers('key_shift')}/{n} layers, key rotation in {layers('key_rotation')}/{n}, {smooth}, "
        f"value rotation in {layers('value_rotation')}/{n}; outer/inner ratios of keys: {ratios('key_ratios')}; "
        f"of values: {ratios('value_ratios')}"
    )


# ----------------------------------------------------------------------------------------------- the diagnosis


@dataclass
class LayerDiagnosis:
    """One decoder layer: channel statistics, each method's SQNR (dB) per kind, and the verdict's flags."""

    index: int
    keys: ChannelStats
    keys_pre_rope: ChannelStats | None
    values: ChannelStats
    #: method -> {"key": dB, "value": dB}
    sqnr: dict[str, dict[str, float]]
    fixed_channel_keys: bool
    key_offsets: bool
    plus: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "keys": self.keys.to_dict(),
            "keys_pre_rope": None if self.keys_pre_rope is None else self.keys_pre_rope.to_dict(),
            "values": self.values.to_dict(),
            "sqnr_db": {m: {k: finite_or_none(v) for k, v in kv.items()} for m, kv in self.sqnr.items()},
            "fixed_channel_keys": self.fixed_channel_keys,
            "key_offsets": self.key_offsets,
            "plus": self.plus,
        }


@dataclass
class Diagnosis:
    """The result of :func:`diagnose`: per-layer findings, per-method totals, and the verdict."""

    model: str
    fingerprint: dict[str, Any]
    head_dim: int
    calibration: dict[str, Any]
    top_k: int
    layers: list[LayerDiagnosis]
    #: method -> {"key": {"sqnr_db", "bits"}, "value": {...}, "description"}
    methods: dict[str, dict[str, Any]]
    verdict: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    #: Share of the post-RoPE keys' power (all layers, all tokens) in their per-channel means over the tokens.
    key_mean_power: float = 0.0
    seconds: float = 0.0

    def channel_name(self, c: int) -> str:
        """``h<head>:c<dim>`` for flat channel ``c``."""
        return f"h{c // self.head_dim}:c{c % self.head_dim}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "fingerprint": self.fingerprint,
            "head_dim": self.head_dim,
            "calibration": self.calibration,
            "top_k": self.top_k,
            "rules": {
                "top_share": TOP_SHARE,
                "fixed_channel_share": FIXED_CHANNEL_SHARE,
                "offset_power": OFFSET_POWER,
                "constant_sign": CONSTANT_SIGN,
            },
            "verdict": self.verdict,
            "methods": self.methods,
            "layers": [layer.to_dict() for layer in self.layers],
            "notes": self.notes,
            "key_mean_power": self.key_mean_power,
            "seconds": round(self.seconds, 3),
        }


def record_windows(
    model: Any, windows: torch.Tensor, progress: bool = False
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Keys (post-RoPE) and values the cache stores for each window, per layer float32 ``[R, H, S, hd]``."""
    keys: list[list[torch.Tensor]] = []
    values: list[list[torch.Tensor]] = []
    with KVRecorder(model) as rec, ProgressLog(progress, int(windows.shape[0]), "recording K/V", "windows") as adv:
        for r in range(windows.shape[0]):
            k, v = rec.record(windows[r : r + 1])
            if not keys:
                keys, values = [[] for _ in k], [[] for _ in v]
            for i in range(len(k)):
                keys[i].append(k[i][0].float().clone())
                values[i].append(v[i][0].float().clone())
            adv(1)
    return [torch.stack(k) for k in keys], [torch.stack(v) for v in values]


def pre_rope_keys(model: Any, keys: list[torch.Tensor]) -> tuple[list[torch.Tensor] | None, str | None]:
    """The keys rotated back to before RoPE (``oakenkv.calibrate.rope``; windows start at position 0), or ``(None,
    why)`` when the model's RoPE cannot be undone here (no ``rotary_emb``, partial rotary)."""
    from oakenkv.calibrate.rope import RopeTable, invert_rope

    try:
        table = RopeTable(model)
        out = []
        for i, k in enumerate(keys):
            cos, sin = table.cos_sin(i, 0, k.shape[2], k)
            out.append(invert_rope(k, cos, sin))
    except (ValueError, TypeError, NotImplementedError) as e:
        return None, f"pre-RoPE statistics skipped: {e}"
    return out, None


def diagnose(
    model: Any,
    windows: torch.Tensor,
    *,
    thresholds: Thresholds | None = None,
    plus_profile: Thresholds | None = None,
    plus_missing: str | None = None,
    name: str | None = None,
    calibration: dict[str, Any] | None = None,
    progress: bool = False,
) -> Diagnosis:
    """Diagnose ``model``'s keys and values on ``windows`` (module doc).

    Args:
        model: a transformers causal LM (unfolded: no oaken-plus transforms in it).
        windows: int64 ``[R, S]`` calibration windows, each starting at position 0.
        thresholds: the paper's Oaken thresholds of the model (``oakenkv.calibrate.profile.cached_thresholds``);
        default:
            profiled on ``windows`` at the paper's ratios, exactly as ``profile_thresholds`` would.
        plus_profile: an ``oaken-plus`` profile of the model (``oakenkv.calibrate.plus.cached_plus_profile``), or None
        to
            leave ``oaken-plus`` out.
        name: the model's name in the report.
        plus_missing: why there is no ``plus_profile`` (said in the verdict), when it is not by choice.
        calibration: how ``windows`` were made (reported as is).
    """
    from oakenkv.calibrate.match import check_identity
    from oakenkv.calibrate.transforms import is_folded
    from oakenkv.methods.fp8 import Fp8Quantizer
    from oakenkv.methods.kivi import kivi_quantize_values
    from oakenkv.methods.kvquant import KVQuantQuantizer
    from oakenkv.methods.uniform import GROUP_SCALE_BITS, PerTokenIntQuantizer

    if not isinstance(windows, torch.Tensor) or windows.dim() != 2 or windows.dtype != torch.int64:
        raise ValueError(f"windows must be an int64 tensor [runs, tokens], got {getattr(windows, 'shape', windows)}")
    if windows.shape[0] < 1 or windows.shape[1] < 2:
        raise ValueError(f"need at least one window of at least two tokens, got {tuple(windows.shape)}")
    if is_folded(model) is not None:
        raise ValueError("diagnose the original model, not one with oaken-plus transforms folded in")
    fingerprint = ModelFingerprint.from_model_config(model.config, name=name)
    for th, what in ((thresholds, "thresholds"), (plus_profile, "oaken-plus profile")):
        if th is not None:
            check_identity(th, model)  # shape and weights
            if what == "oaken-plus profile" and th.transforms is None:
                raise ValueError("the oaken-plus profile carries no transforms (a paper profile was given)")
            if what == "thresholds" and th.transforms is not None:
                raise ValueError("the paper's thresholds were expected, got an oaken-plus profile")
    t0 = time.perf_counter()
    notes: list[str] = []
    keys, values = record_windows(model, windows, progress)
    pre, why = pre_rope_keys(model, keys)
    if why:
        notes.append(why)
    n = len(keys)
    _, h, _, hd = keys[0].shape
    top_k = top_k_channels(h * hd)
    paper = OakenConfig() if thresholds is None else thresholds.config
    if thresholds is None:
        notes.append(f"paper thresholds profiled on the {windows.shape[0]} diagnosis windows")
    choices = plus_choices(plus_profile) if plus_profile is not None else None
    methods = [NAMES.oaken, *([NAMES.oaken_plus] if plus_profile is not None else []), NAMES.int4, NAMES.kivi4]
    methods += [NAMES.kvquant4] if pre is not None else []
    methods += [NAMES.fp8]
    tally = {(m, kind): Tally() for m in methods for kind in KINDS}
    int4, fp8 = PerTokenIntQuantizer(4), Fp8Quantizer()
    kivi_bits = 4 + GROUP_SCALE_BITS / 32
    layers: list[LayerDiagnosis] = []
    key_power = [0.0, 0.0]  # all keys, keys less their per-channel means
    with ProgressLog(progress, n, "diagnosing", "layers") as advance:
        for i in range(n):
            k, v = keys[i], values[i]
            kthr = thresholds.layer(i, "key") if thresholds else window_thresholds(k, paper, i, "key")
            vthr = thresholds.layer(i, "value") if thresholds else window_thresholds(v, paper, i, "value")
            kst = channel_stats(k, kthr.to_lo, kthr.to_hi, top_k)
            vst = channel_stats(v, vthr.to_lo, vthr.to_hi, top_k)
            pst = None
            if pre is not None:
                pthr = window_thresholds(pre[i], paper, i, "key")
                pst = channel_stats(pre[i], pthr.to_lo, pthr.to_hi, top_k)
            # the keys' power, and their power less the per-channel means over all tokens (which move every score
            # of a query alike): the part of the keys' signal that attention sees
            key_power[0] += float(k.double().pow(2).sum())
            key_power[1] += float((k.double() - k.double().mean(dim=(0, 2), keepdim=True)).pow(2).sum())
            # round trips: keys post-RoPE unless stated
            for kind, x, thr in (("key", k, kthr), ("value", v, vthr)):
                tally[NAMES.oaken, kind].add(x, *oaken_round_trip(x, thr, paper))
                tally[NAMES.int4, kind].add(x, *int4.quantize(i, kind, x))
                tally[NAMES.fp8, kind].add(x, *fp8.quantize(i, kind, x))
            tally[NAMES.kivi4, "key"].add(k, kivi_keys_round_trip(k), kivi_bits * k.numel())
            tally[NAMES.kivi4, "value"].add(
                v, kivi_quantize_values(v, 4, 32), (4 + GROUP_SCALE_BITS / min(32, hd)) * v.numel()
            )
            if pre is not None:
                q = pre[i].permute(1, 3, 0, 2).reshape(h, hd, -1)  # [H, hd, N]
                lo, hi = (torch.quantile(q, t, dim=-1) for t in (0.005, 0.995))
                kvq = KVQuantQuantizer([(lo, hi)])  # this layer's ranges only: quantized as layer 0
                # RoPE is a rotation per position: the pre-RoPE error and signal are the post-RoPE ones
                tally[NAMES.kvquant4, "key"].add(pre[i], *kvq.quantize(0, "key", pre[i]))
                tally[NAMES.kvquant4, "value"].add(v, *kvq.quantize(0, "value", v))
            if plus_profile is not None:
                _plus_round_trips(plus_profile, i, k, v, tally)
            layers.append(
                LayerDiagnosis(
                    index=i,
                    keys=kst,
                    keys_pre_rope=pst,
                    values=vst,
                    sqnr={m: {kind: tally[m, kind].layer_db(i) for kind in KINDS} for m in methods},
                    fixed_channel_keys=bool(kst.outer_share >= FIXED_CHANNEL_SHARE),
                    key_offsets=bool(kst.offset_power >= OFFSET_POWER),
                    plus=None if choices is None else choices[i],
                )
            )
            advance(1)
    summary = {
        m: {
            "description": METHODS[m],
            **{
                kind: {
                    "sqnr_db": finite_or_none(tally[m, kind].total_db()),
                    "min_layer_sqnr_db": finite_or_none(min(tally[m, kind].layer_db(i) for i in range(n))),
                    "bits": round(tally[m, kind].effective_bits, 4),
                }
                for kind in KINDS
            },
        }
        for m in methods
    }
    diag = Diagnosis(
        model=name or fingerprint.describe(),
        fingerprint=fingerprint.to_dict(),
        head_dim=int(hd),
        calibration={"windows": int(windows.shape[0]), "window": int(windows.shape[1]), **(calibration or {})},
        top_k=top_k,
        layers=layers,
        methods=summary,
        verdict={},
        notes=notes,
        key_mean_power=1.0 - key_power[1] / key_power[0] if key_power[0] > 0 else 0.0,
    )
    diag.verdict = _verdict(diag, choices, plus_missing)
    diag.seconds = time.perf_counter() - t0
    return diag


def _plus_round_trips(
    profile: Thresholds,
    i: int,
    k: torch.Tensor,
    v: torch.Tensor,
    tally: dict[tuple[str, str], Tally],
) -> None:
    """oaken-plus on recorded (unfolded) keys and values: the folded model's keys are ``k / lam``; the cache
    shifts and rotates them (``Transforms.keys_forward``), Oaken quantizes, attention reads them un-rotated
    (``keys_restore``) beside queries ``q * lam``. So the error that reaches the scores is ``lam *`` the folded
    frame's error, measured against ``k - lam * shift``; the signal is ``k``. Values are rotated per head (what the
    folded ``v_proj`` produces); the rotation is orthogonal, so the error is the same in either frame."""
    from oakenkv.calibrate.transforms import fwht

    t = profile.transforms
    lt = t.layers[i]
    _, h, _, hd = k.shape
    lam = torch.ones(1, h, 1, hd) if lt.key_scale is None else torch.tensor(lt.key_scale).reshape(1, h, 1, hd)
    xk = t.keys_forward(i, k / lam)
    yk, bits = oaken_round_trip(xk, profile.layer(i, "key"), profile.config)
    k_hat = t.keys_restore(i, yk) * lam
    target = k if lt.key_shift is None else k - torch.tensor(lt.key_shift).reshape(1, h, 1, hd) * lam
    tally[NAMES.oaken_plus, "key"].add(target, k_hat, bits, signal=k)
    xv = torch.from_numpy(fwht(v.numpy())) if lt.value_rotation else v
    yv, bits = oaken_round_trip(xv, profile.layer(i, "value"), profile.config)
    tally[NAMES.oaken_plus, "value"].add(xv, yv, bits, signal=v)


def _verdict(diag: Diagnosis, choices: list[dict[str, Any]] | None, plus_missing: str | None) -> dict[str, Any]:
    n = len(diag.layers)
    d = len(diag.layers[0].keys.absmax_rel)
    fixed = [layer for layer in diag.layers if layer.fixed_channel_keys]
    offs = [layer for layer in diag.layers if layer.key_offsets]
    shares = [layer.keys.outer_share for layer in diag.layers if not math.isnan(layer.keys.outer_share)]
    lines = []
    rule = f"rule: >= {FIXED_CHANNEL_SHARE:.0%}"
    if fixed:
        big = max(fixed, key=lambda layer: layer.keys.absmax_ratio)
        chans = sorted({c for layer in fixed for c in layer.keys.outer_channels})
        most = max(fixed, key=lambda layer: layer.keys.outer_share)
        fs = [layer.keys.outer_share for layer in fixed]
        lines.append(
            f"fixed-channel key outliers: YES, in {len(fixed)} of {n} layers "
            f"({ranges_text([x.index for x in fixed])}): "
            f"their top {diag.top_k} of {d} channels hold {min(fs):.0%}-{max(fs):.0%} of the layer's outer-group "
            f"post-RoPE keys (a uniform spread: {diag.top_k / d:.1%}; {rule}); largest channel: layer {big.index} "
            f"{diag.channel_name(big.keys.absmax_channels[0])} at {big.keys.absmax_ratio:.1f}x the median channel's "
            f"absmax; most concentrated: layer {most.index}, channels "
            + ", ".join(diag.channel_name(c) for c in most.keys.outer_channels)
        )
    else:
        chans = []
        top = f"{max(shares):.0%}" if shares else "no outer values"
        lines.append(
            f"fixed-channel key outliers: no: in no layer do the top {diag.top_k} of {d} channels hold >= "
            f"{FIXED_CHANNEL_SHARE:.0%} of the outer-group post-RoPE keys (most: {top}; a uniform spread: "
            f"{diag.top_k / d:.1%})"
        )
    top_off = max(diag.layers, key=lambda layer: layer.keys.offset_power)
    pre_note = ""
    if all(layer.keys_pre_rope is not None for layer in diag.layers):
        pre_max = max(diag.layers, key=lambda layer: layer.keys_pre_rope.offset_power)  # type: ignore[union-attr]
        pre_note = f"; before RoPE up to {pre_max.keys_pre_rope.offset_power:.0%} (layer {pre_max.index})"  # type: ignore[union-attr]
    if offs:
        lines.append(
            f"per-channel key offsets: YES, in {len(offs)} of {n} layers ({ranges_text([x.index for x in offs])}): the "
            f"channels' means over positions carry >= {OFFSET_POWER:.0%} of the post-RoPE keys' power, up to "
            f"{top_off.keys.offset_power:.0%} (layer {top_off.index}){pre_note}; a key shift removes it"
        )
    else:
        lines.append(
            f"per-channel key offsets: no: the channels' means carry < {OFFSET_POWER:.0%} of the post-RoPE keys' "
            f"power in every layer (most: {top_off.keys.offset_power:.1%}, layer {top_off.index}){pre_note}"
        )
    remedy = None
    if choices is not None:
        remedy = remedy_summary(choices)
        lines.append(f"oaken-plus will use: {remedy}")
    else:
        lines.append(
            f"oaken-plus: not available for this model: {plus_missing}"
            if plus_missing
            else "oaken-plus: not profiled (--no-plus); run with --plus to see which remedies it chooses"
        )
    m = diag.methods
    sq = ", ".join(f"{name} {decibels(m[name]['key']['sqnr_db'])}" for name in m)
    mean_db = -10 * math.log10(1 - diag.key_mean_power) if diag.key_mean_power < 1 else math.inf
    lines.append(
        f"key SQNR over all layers: {sq} (each {mean_db:.1f} dB lower against what moves attention scores, the keys "
        f"less their per-channel means, which carry {diag.key_mean_power:.0%} of the keys' power)"
    )
    sq = ", ".join(f"{name} {decibels(m[name]['value']['sqnr_db'])}" for name in m)
    lines.append(f"value SQNR over all layers: {sq}")
    return {
        "fixed_channel_key_outliers": bool(fixed),
        "fixed_channel_layers": [layer.index for layer in fixed],
        "fixed_channels": chans,
        "fixed_channel_names": [diag.channel_name(c) for c in chans],
        "key_offsets": bool(offs),
        "key_offset_layers": [layer.index for layer in offs],
        "oaken_plus": remedy,
        "lines": lines,
    }


def ranges_text(idx: Sequence[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"layers 0-2, 5, 7-8"``."""
    parts, i = [], 0
    while i < len(idx):
        j = i
        while j + 1 < len(idx) and idx[j + 1] == idx[j] + 1:
            j += 1
        parts.append(str(idx[i]) if i == j else f"{idx[i]}-{idx[j]}")
        i = j + 1
    return ("layer " if len(idx) == 1 else "layers ") + ", ".join(parts)


def percent(x: float) -> str:
    return "no outer values" if math.isnan(x) else f"{x:.0%}"


def decibels(x: float | None) -> str:
    return "exact" if x is None else f"{x:.1f} dB"


# ----------------------------------------------------------------------------------------------- entry point


def diagnose_model(
    model: str = "default",
    spec: CalibrationSpec | None = None,
    *,
    plus: bool = True,
    plus_spec: CalibrationSpec | None = None,
    progress: bool = False,
) -> Diagnosis:
    """Load ``model`` and diagnose it on the calibration windows of ``spec`` (default
    :data:`DIAGNOSE_CALIBRATION`).

    The paper's thresholds are the model's cached profile (``oakenkv.calibrate.profile.cached_thresholds`` at the
    default
    calibration, the one ``oaken`` uses in ``generate`` and ``eval``); with ``plus``, the ``oaken-plus`` profile is
    ``oakenkv.calibrate.plus.cached_plus_profile`` on ``plus_spec`` (default: ``spec``; the preset itself calibrates on
    ``oakenkv.calibrate.plus.PLUS_CALIBRATION``), made once and then read from the profile cache.
    """
    from oakenkv.assets.models import load_model
    from oakenkv.calibrate.profile import cached_thresholds, calibration_windows

    loaded = load_model(model)
    spec = (spec or DIAGNOSE_CALIBRATION).fit(loaded.model)
    windows = calibration_windows(loaded.tokenizer, spec)
    paper_spec = CalibrationSpec()
    thresholds = cached_thresholds(loaded.model, loaded.tokenizer, model, OakenConfig(), paper_spec, progress=progress)
    calib = {"text": spec.text, "text_path": spec.text_path, "paper_thresholds": paper_spec.tag()}
    profile, missing = None, None
    if plus:
        from oakenkv.calibrate.plus import cached_plus_profile

        plus_spec = plus_spec or spec
        from oakenkv.calibrate.transforms import TransformError

        try:
            profile = cached_plus_profile(loaded.model, loaded.tokenizer, model, plus_spec, progress=progress)
            calib["oaken_plus_profile"] = plus_spec.tag()
        except TransformError as e:  # an attention oaken-plus does not support: diagnose the rest
            missing = str(e)
    return diagnose(
        loaded.model,
        windows,
        thresholds=thresholds,
        plus_profile=profile,
        plus_missing=missing,
        name=model,
        calibration=calib,
        progress=progress,
    )


__all__: Sequence[str] = [
    "CONSTANT_SIGN",
    "DIAGNOSE_CALIBRATION",
    "FIXED_CHANNEL_SHARE",
    "METHODS",
    "OFFSET_POWER",
    "TOP_SHARE",
    "ChannelStats",
    "Diagnosis",
    "LayerDiagnosis",
    "channel_stats",
    "diagnose",
    "diagnose_model",
    "oaken_round_trip",
    "plus_choices",
    "pre_rope_keys",
    "record_windows",
    "remedy_summary",
    "sqnr_db",
    "top_k_channels",
    "window_thresholds",
]
