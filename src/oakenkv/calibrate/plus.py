"""The ``oaken-plus`` preset: the paper's online quantizer, after offline transforms chosen per layer.

Oaken (the paper) profiles four thresholds per layer and kind, at fixed group ratios (4% outer, 6% inner). On
models whose keys carry per-channel offsets (a key bias, channels of constant sign) or a few large channels, one
token's range is set by those channels and the per-token 4-bit middle grid is too coarse for the rest; on a
Qwen2 model this makes Oaken worse than plain per-token INT4. ``oaken-plus`` keeps the online half exactly as it is
(per-token grouping, 4/5-bit codes, the fused dense-and-sparse bytes, the pages and kernels) and lets the offline
half do more:

1. record queries, keys and values of calibration windows (:func:`record_attention`);
2. per layer, score candidate transforms (``oakenkv.calibrate.transforms``: a key shift, key smoothing folded into the
   weights with exponent ``alpha``, per-head Hadamard rotations of keys and of values) and group ratios by the
   error they cause in the layer's attention output on calibration text (never the evaluation text), and keep
   the best (:func:`choose_transforms`);
3. profile the thresholds on the transformed keys and values (:func:`profile_plus`).

The result is one :class:`~oakenkv.calibrate.thresholds.Thresholds` carrying its
:class:`~oakenkv.calibrate.transforms.Transforms`
(file schema 2). :func:`apply_profile` folds the weight part into a model (once; a second, different fold is
refused) and the cache applies the online part (``oakenkv.store.paged``).
"""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from oakenkv.calibrate.profile import CalibrationSpec, ProgressLog, RunAccumulator, run_thresholds
from oakenkv.calibrate.thresholds import GroupThresholds, LayerStats, ModelFingerprint, Thresholds
from oakenkv.calibrate.transforms import (
    LayerTransforms,
    TransformError,
    Transforms,
    attention_modules,
    fold_into_model,
    fwht,
    is_folded,
    rope_partners,
    tie_rope_pairs,
)
from oakenkv.format.config import MAX_SINK_TOKENS, OakenConfig, valid_sink_tokens
from oakenkv.util.compat import cache_kwargs

#: Calibration of oaken-plus: 16 windows of 2048 tokens of the Wikipedia excerpt. Long windows matter: the key
#: shift is the mean of post-RoPE keys, which depends on the positions it is taken over.
PLUS_CALIBRATION = CalibrationSpec(samples=16, window=2048)

#: The group ratios (outer, inner) the search chooses from: all put 10% of the values in the sparse groups (the
#: paper's budget, so the same bits), moving that budget from the inner group to the outer one.
DEFAULT_RATIOS: tuple[tuple[float, float], ...] = ((0.04, 0.06), (0.08, 0.02), (0.10, 0.0))
#: The sparse share of :data:`DEFAULT_RATIOS`.
DEFAULT_SPARSE = 0.10


def ratio_choices(sparse: float) -> tuple[tuple[float, float], ...]:
    """:data:`DEFAULT_RATIOS` scaled to a sparse (inner + outer) share of ``sparse``: the same three splits of the
    budget, 40/60, 80/20 and 100/0 (``DEFAULT_RATIOS`` itself for 0.10)."""
    if not isinstance(sparse, (int, float)) or isinstance(sparse, bool) or not 0.0 < sparse < 1.0:
        raise ValueError(f"the sparse share must be a fraction in (0, 1), got {sparse!r}")
    if sparse == DEFAULT_SPARSE:
        return DEFAULT_RATIOS
    scale = sparse / DEFAULT_SPARSE
    return tuple((round(o * scale, 6), round(i * scale, 6)) for o, i in DEFAULT_RATIOS)


@dataclass(frozen=True)
class PlusSearch:
    """What :func:`choose_transforms` tries per layer (every candidate is scored; the least error wins)."""

    #: Key smoothing exponents (0: none): ``lam = absmax(k - shift) ** alpha`` per channel, RoPE-pair tied.
    alphas: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75)
    #: Whether the key shift and each rotation may be used (the search still chooses per layer). The rotations are
    #: off by default: on the default model the search picks them in half the layers (they lower its per-layer
    #: attention-output error) and perplexity gets worse (docs/plus.md, "Rotations"); ``oaken-plus:rot_k=1,rot_v=1``
    #: tries them.
    key_shift: bool = True
    key_rotation: bool = False
    value_rotation: bool = False
    #: Group ratios (outer, inner) to choose from, for keys and values separately.
    ratios: tuple[tuple[float, float], ...] = DEFAULT_RATIOS
    #: Calibration windows whose queries score the candidates, and the query positions per window (the last ones:
    #: they attend over the longest context).
    query_runs: int = 2
    query_positions: int = 256
    #: The first tokens of every sequence kept at 16 bits beside their codes (``Transforms.sink_tokens``); the
    #: candidates are scored with them exact, as the cache reads them.
    sink_tokens: int = 1
    #: The format's dense slot width (``OakenConfig.middle_bits``): 4 (the paper's), 3 (``oaken-plus-3``) or 2; the
    #: outliers get one bit more. The candidates are scored, and the profile made, at this width.
    middle_bits: int = 4

    @classmethod
    def from_flags(
        cls,
        shift: bool,
        rot_k: bool,
        rot_v: bool,
        smooth: bool,
        ratios: bool,
        sink: int = 1,
        bits: int = 4,
        sparse: float = DEFAULT_SPARSE,
    ) -> PlusSearch:
        """The search of the method spec ``oaken-plus:shift=..,rot_k=..,rot_v=..,smooth=..,ratios=..,sink=..,bits=..,
        sparse=..`` (each remedy on or off; off ratios means the 40/60 outer/inner split only; ``sink``: tokens kept
        at 16 bits; ``bits``: the dense slot width; ``sparse``: the inner + outer share, :func:`ratio_choices`)."""
        choices = ratio_choices(sparse)
        return cls(
            alphas=cls().alphas if smooth else (0.0,),
            key_shift=bool(shift),
            key_rotation=bool(rot_k),
            value_rotation=bool(rot_v),
            ratios=choices if ratios else choices[:1],
            sink_tokens=int(sink),
            middle_bits=int(bits),
        )

    def config(self, outer: float | None = None, inner: float | None = None) -> OakenConfig:
        """The codec's configuration for candidate ratios ``(outer, inner)`` at this search's slot width (default
        ratios: the paper's, what a profile file records as its config)."""
        if outer is None or inner is None:
            return OakenConfig(middle_bits=self.middle_bits)
        return OakenConfig(outer_ratio=outer, inner_ratio=inner, middle_bits=self.middle_bits)

    def __post_init__(self) -> None:
        if not self.alphas or any(not 0.0 <= a <= 1.0 for a in self.alphas):
            raise ValueError(f"alphas must be a non-empty subset of [0, 1], got {self.alphas}")
        self.config()  # validates the slot width
        for o, i in self.ratios:
            self.config(o, i)  # validates
        if self.query_runs < 1 or self.query_positions < 1:
            raise ValueError("query_runs and query_positions must be positive")
        if not valid_sink_tokens(self.sink_tokens):  # (checked before minutes of profiling, not after)
            raise ValueError(f"sink_tokens must be an int in [0, {MAX_SINK_TOKENS}], got {self.sink_tokens!r}")


# ----------------------------------------------------------------------------------------------- recording


@dataclass
class AttentionRecord:
    """Per layer: queries ``[R_q, Hq, S, hd]`` (of the first ``R_q`` windows), keys and values ``[R, H, S, hd]``
    (post-RoPE, as the cache receives them), the softmax scale and the sliding window (or None); and what the
    model's attention allows a fold to do: key scales shared by all KV heads (a q/k norm, whose weight every head
    shares, takes them) and no value rotation (a value norm does not commute with it)."""

    queries: list[torch.Tensor]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    scaling: list[float]
    sliding_window: list[int | None]
    key_scale_shared_by_heads: bool = False
    value_norm: bool = False


_ATTN_NAME = "oakenkv_record"


def record_attention(model: Any, windows: torch.Tensor, query_runs: int, progress: Callable[[int], None] | None = None):
    """One prefill per calibration window through a recording attention function (registered in transformers'
    ``AttentionInterface``; it calls SDPA unchanged), keeping what every layer's attention received."""
    from transformers import AttentionInterface, DynamicCache
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    mods = attention_modules(model)
    for m in mods:
        if getattr(m, "sinks", None) is not None:
            raise TransformError("attention sinks are not shift-invariant: oaken-plus does not support this model")
    text = model.config.get_text_config(decoder=True)
    if getattr(text, "attn_logit_softcapping", None):
        raise TransformError("soft-capped attention logits are not shift-invariant: oaken-plus does not support them")
    n = len(mods)
    qs: list[list[torch.Tensor]] = [[] for _ in range(n)]
    ks: list[list[torch.Tensor]] = [[] for _ in range(n)]
    vs: list[list[torch.Tensor]] = [[] for _ in range(n)]
    scaling: list[float] = [0.0] * n
    run = [0]

    def rec(module, query, key, value, attention_mask, **kw):
        i = module.layer_idx
        if run[0] < query_runs:
            qs[i].append(query[0].detach().float().clone())
        ks[i].append(key[0].detach().float().clone())
        vs[i].append(value[0].detach().float().clone())
        scaling[i] = float(kw.get("scaling") or module.scaling)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register(_ATTN_NAME, rec)
    AttentionMaskInterface.register(_ATTN_NAME, sdpa_mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation(_ATTN_NAME)
    device = next(model.parameters()).device
    try:
        with torch.inference_mode():
            for r in range(windows.shape[0]):
                run[0] = r
                cache = DynamicCache(config=model.config)
                model(input_ids=windows[r : r + 1].to(device), use_cache=True, **cache_kwargs(model, cache))
                if progress is not None:
                    progress(1)
    finally:
        model.set_attn_implementation(previous)
    types = getattr(text, "layer_types", None) or ["full_attention"] * n
    sliding = [int(text.sliding_window) if t == "sliding_attention" else None for t in types]
    return AttentionRecord(
        [torch.stack(q) for q in qs],
        [torch.stack(k) for k in ks],
        [torch.stack(v) for v in vs],
        scaling,
        sliding,
        key_scale_shared_by_heads=any(hasattr(m, "k_norm") or hasattr(m, "q_norm") for m in mods),
        value_norm=any(hasattr(m, "v_norm") for m in mods),
    )


# ----------------------------------------------------------------------------------------------- scoring


def attention_output(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float, window: int | None, positions: int
) -> torch.Tensor:
    """Causal (optionally sliding-window) attention of the last ``positions`` queries: q ``[R, Hq, S, hd]``,
    k/v ``[R, H, S, hd]`` -> ``[R, Hq, positions, hd]``."""
    s = q.shape[2]
    positions = min(positions, s)
    group = q.shape[1] // k.shape[1]
    qq = q[:, :, s - positions :]
    kk, vv = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = (qq @ kk.transpose(-1, -2)) * scaling
    pq = torch.arange(s - positions, s)[:, None]
    pk = torch.arange(s)[None, :]
    hide = pk > pq
    if window is not None:
        hide |= pk <= pq - window
    return torch.softmax(scores.masked_fill(hide, float("-inf")), dim=-1) @ vv


def _fake_quant(x: torch.Tensor, thr: GroupThresholds, config: OakenConfig, sink_tokens: int = 0) -> torch.Tensor:
    """Oaken's round trip (the codec's kernels) of ``x [R, H, S, hd]``, one row per token; the first
    ``sink_tokens`` of each run come back at 16 bits, as the cache reads them (``oakenkv.store.paged``)."""
    from oakenkv.kernels.codec import decode, encode

    r, h, s, hd = x.shape
    rows = x.permute(0, 2, 1, 3).reshape(r * s, h * hd).contiguous()
    y = decode(encode(rows, thr, config), thr, config)
    y = y.reshape(r, s, h, hd).permute(0, 2, 1, 3)
    if sink_tokens:
        y[:, :, :sink_tokens] = x[:, :, :sink_tokens].to(torch.float16).to(y.dtype)
    return y


def _thresholds(x: torch.Tensor, config: OakenConfig, layer: int, kind: str) -> tuple[GroupThresholds, LayerStats]:
    """Thresholds of ``x [R, H, S, hd]`` (one run per window), exactly as ``oakenkv.calibrate.profile`` averages
    them."""
    acc = RunAccumulator()
    for r in range(x.shape[0]):
        o, i, k = run_thresholds(x[r], (config.outer_ratio,), (config.inner_ratio,))
        acc.add(o, i, k, x[r].numel())
    return acc.finish(config, False, layer, kind)


def _rotate(x: torch.Tensor) -> torch.Tensor:
    """Per-head Hadamard rotation over the last axis (``oakenkv.calibrate.transforms.fwht``)."""
    return torch.from_numpy(fwht(x.numpy()))


@dataclass
class _Candidate:
    name: str
    lt: LayerTransforms
    config: OakenConfig


def _key_transform(k: torch.Tensor, lt: LayerTransforms, h: int, hd: int) -> torch.Tensor:
    """What the quantizer sees of keys ``[R, H, S, hd]`` (recorded from the unfolded model)."""
    if lt.key_scale is not None:
        k = k / torch.tensor(lt.key_scale, dtype=torch.float32).reshape(1, h, 1, hd)
    if lt.key_shift is not None:  # in the folded model's frame (already divided by the scale)
        k = k - torch.tensor(lt.key_shift, dtype=torch.float32).reshape(1, h, 1, hd)
    if lt.key_rotation:
        k = torch.from_numpy(fwht(k.numpy()))
    return k


def _key_restore(k: torch.Tensor, lt: LayerTransforms, h: int, hd: int) -> torch.Tensor:
    """Keys back in the unfolded model's frame up to the shift (which softmax ignores)."""
    if lt.key_rotation:
        k = torch.from_numpy(fwht(k.numpy()))
    if lt.key_scale is not None:
        k = k * torch.tensor(lt.key_scale, dtype=torch.float32).reshape(1, h, 1, hd)
    return k


def choose_transforms(
    record: AttentionRecord,
    search: PlusSearch,
    partners: np.ndarray | None,
    progress: Callable[[int], None] | None = None,
) -> tuple[list[LayerTransforms], list[tuple[OakenConfig, OakenConfig]], list[dict[str, Any]]]:
    """Per layer, the key and value transforms and group ratios with the least attention-output error.

    Keys are scored with exact values and values with exact keys (each error is relative to the exact layer
    output's energy). Returns the transforms, ``(key config, value config)`` per layer and notes (every
    candidate's error) for the profile file.
    """
    chosen, configs, notes = [], [], []
    for i in range(len(record.keys)):
        k_all, v_all = record.keys[i], record.values[i]
        _, h, _, hd = k_all.shape
        q = record.queries[i]
        k_q, v_q = k_all[: q.shape[0]], v_all[: q.shape[0]]
        sc, win, pos = record.scaling[i], record.sliding_window[i], search.query_positions
        ref = attention_output(q, k_q, v_q, sc, win, pos)
        energy = float(ref.pow(2).sum())

        def err(kh: torch.Tensor, vh: torch.Tensor, ref=ref, energy=energy, q=q, sc=sc, win=win, pos=pos) -> float:
            return float((attention_output(q, kh, vh, sc, win, pos) - ref).pow(2).sum()) / energy

        # keys: shift, rotation and smoothing first (at the middle ratios), then the ratios for the winner
        shift = k_all[:, :, 1:].mean(dim=(0, 2)).reshape(-1) if search.key_shift else None  # token 0: the sink
        key_errs: dict[str, float] = {}
        best: _Candidate | None = None
        base_cfg = search.config(search.ratios[-1][0], search.ratios[-1][1])
        for use_shift in (False, True) if shift is not None else (False,):
            for rot in (False, True) if search.key_rotation else (False,):
                for alpha in search.alphas:
                    if alpha and partners is None:
                        continue
                    lam = None
                    if alpha:
                        centred = k_all[:, :, 1:] - (shift.reshape(1, h, 1, hd) if use_shift else 0.0)
                        amax = centred.abs().amax(dim=(0, 2))  # [h, hd]
                        if record.key_scale_shared_by_heads:  # one norm weight for every head: one set of scales
                            amax = amax.amax(dim=0, keepdim=True).expand(h, hd)
                        a = tie_rope_pairs(amax.clamp_min(1e-6), partners) ** alpha
                        lam = (a / a.log().mean().exp()).reshape(-1)  # geometric mean 1: the scores' scale stays
                    # the folded model's keys carry 1 / lam, so the shift is taken in that frame
                    frame_shift = None if not use_shift else shift if lam is None else shift / lam
                    lt = LayerTransforms(
                        key_shift=None if frame_shift is None else tuple(frame_shift.tolist()),
                        key_scale=None if lam is None else tuple(lam.tolist()),
                        key_rotation=rot,
                    )
                    name = f"shift={int(use_shift)},rot={int(rot)},alpha={alpha:g}"
                    key_errs[name] = _score_keys(k_all, k_q, v_q, lt, base_cfg, i, err, search.sink_tokens)
                    if best is None or key_errs[name] < key_errs[best.name]:
                        best = _Candidate(name, lt, base_cfg)
                    if progress:
                        progress(1)
        assert best is not None
        for o, inn in search.ratios[:-1]:
            cfg = search.config(o, inn)
            name = best.name + f",outer={o:g},inner={inn:g}"
            key_errs[name] = _score_keys(k_all, k_q, v_q, best.lt, cfg, i, err, search.sink_tokens)
            if key_errs[name] < key_errs[best.name]:
                best = _Candidate(name, best.lt, cfg)
            if progress:
                progress(1)
        # values: rotation, then ratios
        val_errs: dict[str, float] = {}
        vbest: _Candidate | None = None
        for rot in (False, True) if search.value_rotation and not record.value_norm else (False,):
            for o, inn in search.ratios:
                cfg = search.config(o, inn)
                x = _rotate(v_all) if rot else v_all
                thr, _ = _thresholds(x, cfg, i, "value")
                vq = _fake_quant(x[: q.shape[0]], thr, cfg, search.sink_tokens)
                vh = _rotate(vq) if rot else vq
                name = f"rot={int(rot)},outer={o:g},inner={inn:g}"
                val_errs[name] = err(k_q, vh)
                if vbest is None or val_errs[name] < val_errs[vbest.name]:
                    vbest = _Candidate(name, LayerTransforms(value_rotation=rot), cfg)
                if progress:
                    progress(1)
        assert vbest is not None
        chosen.append(
            LayerTransforms(
                key_shift=best.lt.key_shift,
                key_scale=best.lt.key_scale,
                key_rotation=best.lt.key_rotation,
                value_rotation=vbest.lt.value_rotation,
            )
        )
        configs.append((best.config, vbest.config))
        notes.append(
            {
                "key": best.name,
                "value": vbest.name,
                "key_errors": {n: round(e, 8) for n, e in key_errs.items()},
                "value_errors": {n: round(e, 8) for n, e in val_errs.items()},
            }
        )
    return chosen, configs, notes


def _score_keys(k_all, k_q, v_q, lt, cfg, layer, err, sink_tokens=0) -> float:
    h, hd = k_all.shape[1], k_all.shape[3]
    x = _key_transform(k_all, lt, h, hd)
    thr, _ = _thresholds(x, cfg, layer, "key")
    kq = _fake_quant(x[: k_q.shape[0]], thr, cfg, sink_tokens)
    return err(_key_restore(kq, lt, h, hd), v_q)


def candidates_per_layer(search: PlusSearch, rope_ok: bool) -> int:
    alphas = len(search.alphas) if rope_ok else 1
    keys = (2 if search.key_shift else 1) * (2 if search.key_rotation else 1) * alphas + len(search.ratios) - 1
    return keys + (2 if search.value_rotation else 1) * len(search.ratios)


# ----------------------------------------------------------------------------------------------- the profile


def profile_plus(
    model: Any,
    windows: torch.Tensor,
    search: PlusSearch | None = None,
    *,
    progress: bool = False,
    name: str | None = None,
    metadata: dict[str, Any] | None = None,
) -> Thresholds:
    """Choose the transforms per layer and profile the thresholds after them (module doc).

    Args:
        model: a transformers causal LM with Llama-style attention, unfolded (no oaken-plus transforms in it).
        windows: int64 ``[R, S]`` calibration windows (default calibration: :data:`PLUS_CALIBRATION`).
        search: the candidates (default :class:`PlusSearch`).

    Returns:
        Thresholds with ``transforms`` set; the fingerprint is the unfolded model's.
    """
    return profile_plus_many(model, windows, [search or PlusSearch()], progress=progress, name=name, metadata=metadata)[
        0
    ]


def profile_plus_many(
    model: Any,
    windows: torch.Tensor,
    searches: Sequence[PlusSearch],
    *,
    progress: bool = False,
    name: str | None = None,
    metadata: dict[str, Any] | None = None,
) -> list[Thresholds]:
    """:func:`profile_plus` for several searches (an ablation) from one recording of the calibration attention,
    the slow part; each profile equals the one :func:`profile_plus` makes alone."""
    if is_folded(model) is not None:
        raise TransformError("profile oaken-plus on the original model, not on one with transforms folded in")
    if not isinstance(windows, torch.Tensor) or windows.dim() != 2 or windows.dtype != torch.int64:
        raise ValueError(f"windows must be an int64 tensor [runs, tokens], got {getattr(windows, 'shape', windows)}")
    runs = int(windows.shape[0])
    query_runs = {min(s.query_runs, runs) for s in searches}
    if len(query_runs) != 1:
        raise ValueError("searches profiled together must record the same query_runs")
    fingerprint = ModelFingerprint.from_model(model, name=name)  # shape and weights digest of the unfolded model
    try:
        partners = rope_partners(model)
    except TransformError as e:
        partners = None
        warnings.warn(f"key smoothing disabled: {e}", stacklevel=2)
    t0, cpu0 = time.perf_counter(), time.process_time()
    work = runs + sum(fingerprint.num_layers * candidates_per_layer(s, partners is not None) for s in searches)
    out = []
    with ProgressLog(progress, work, "oaken-plus profile", "steps") as advance:
        record = record_attention(model, windows, query_runs.pop(), advance)
        for search in searches:
            th = profile_from_record(record, fingerprint, search, partners, advance)
            th.profile.update(
                {
                    "window": int(windows.shape[1]),
                    "seconds": round(time.perf_counter() - t0, 3),
                    "cpu_seconds": round(time.process_time() - cpu0, 3),
                    **(metadata or {}),
                }
            )
            out.append(th)
    return out


def profile_plus_model(
    model: str = "default",
    *,
    samples: int = PLUS_CALIBRATION.samples,
    window: int = PLUS_CALIBRATION.window,
    data: str = "wikipedia",
    data_path: str | None = None,
    search: PlusSearch | None = None,
    progress: bool = False,
) -> Thresholds:
    """Load a model and its calibration text (``oakenkv.calibrate.profile.load_calibration``) and run
    :func:`profile_plus`."""
    from oakenkv.calibrate.profile import load_calibration

    loaded, ids, meta = load_calibration(model, samples, window, data, data_path)
    return profile_plus(loaded.model, ids, search, progress=progress, name=model, metadata=meta)


def profile_from_record(
    record: AttentionRecord,
    fingerprint: ModelFingerprint,
    search: PlusSearch,
    partners: np.ndarray | None,
    progress: Callable[[int], None] | None = None,
) -> Thresholds:
    """The body of :func:`profile_plus` on recorded calibration attention inputs: choose the transforms, then
    profile the thresholds on the transformed keys and values."""
    chosen, configs, notes = choose_transforms(record, search, partners, progress)
    transforms = Transforms(
        tuple(chosen),
        fingerprint.num_kv_heads,
        fingerprint.head_dim,
        {"search": _search_dict(search)},
        search.sink_tokens,
    )
    keys, values, kst, vst = [], [], [], []
    h, hd = fingerprint.num_kv_heads, fingerprint.head_dim
    for i, (lt, (kcfg, vcfg)) in enumerate(zip(chosen, configs, strict=True)):
        thr, st = _thresholds(_key_transform(record.keys[i], lt, h, hd), kcfg, i, "key")
        keys.append(thr)
        kst.append(st)
        v = _rotate(record.values[i]) if lt.value_rotation else record.values[i]
        thr, st = _thresholds(v, vcfg, i, "value")
        values.append(thr)
        vst.append(st)
    info = {
        "method": "oaken-plus",
        "runs": int(record.keys[0].shape[0]),
        "key_position": "post_rope",
        "ratios": "per layer and kind, in each layer's stats",
        "choices": notes,
    }
    return Thresholds(
        search.config(), fingerprint, tuple(keys), tuple(values), tuple(kst), tuple(vst), info, transforms=transforms
    )


def _search_dict(search: PlusSearch) -> dict[str, Any]:
    """The search as its profile's notes and cache key hold it. A 4-bit search leaves ``middle_bits`` out: its dict,
    and so the digest in the name of a cached or shipped profile, is what it was before slot widths existed."""
    d = asdict(search)
    d["ratios"] = [list(r) for r in search.ratios]
    d["alphas"] = list(search.alphas)
    if search.middle_bits == 4:
        del d["middle_bits"]
    return d


#: oaken-plus profiles shipped with the package (the embedded default model's, on the default calibration and
#: search), under the cache's file names, so that ``make demo`` does not spend minutes profiling on first use.
#: :func:`cached_plus_profile` uses one only when its recorded weights digest, calibration windows and search
#: are the ones asked for (the same checks as the on-disk cache); otherwise it profiles as usual.
SHIPPED_PROFILES = Path(__file__).parent / "profiles"


def cached_plus_profile(
    model: Any,
    tokenizer: Any,
    model_name: str,
    spec: CalibrationSpec | None = None,
    search: PlusSearch | None = None,
    *,
    progress: bool = False,
) -> Thresholds:
    """:func:`profile_plus` over the calibration windows of ``spec`` (default :data:`PLUS_CALIBRATION`), made once
    and then read from the profile cache (``oakenkv.calibrate.profile.profile_cache_dir``), keyed by content (the
    model's
    weights and the windows' tokens: ``oakenkv.calibrate.profile.CalibrationKey``) and the search settings, and checked
    against them when read."""
    return cached_plus_profiles(model, tokenizer, model_name, [search or PlusSearch()], spec, progress=progress)[0]


def cached_plus_profiles(
    model: Any,
    tokenizer: Any,
    model_name: str,
    searches: Sequence[PlusSearch],
    spec: CalibrationSpec | None = None,
    *,
    progress: bool = False,
) -> list[Thresholds]:
    """:func:`cached_plus_profile` for several search settings (an ablation): the profiles not cached yet are all
    chosen from one recording of the calibration attention (the slow part), as :func:`profile_plus` would each."""
    from oakenkv.calibrate.profile import (
        calibration_key,
        calibration_windows,
        load_cached_thresholds,
        profile_cache_dir,
    )

    spec = spec or PLUS_CALIBRATION
    windows = calibration_windows(tokenizer, spec)
    key = calibration_key(model, model_name, spec, windows)
    out: list[Thresholds | None] = []
    missing: list[tuple[int, Path]] = []
    for j, search in enumerate(searches):
        digest = key.digest("oaken-plus", _search_dict(search))[:16]
        path = profile_cache_dir() / f"plus-{key.stem()}-{digest}.json"
        wanted = json.loads(json.dumps(_search_dict(search)))  # as the file holds it
        found = None
        # A shipped file is found by the content digest its name ends with (the same model weights, windows and
        # search), whatever name the model was loaded by; one that does not fit is simply not used.
        shipped = sorted(SHIPPED_PROFILES.glob(f"plus-*-{digest}.json"))
        for candidate, quiet in [(path, False), *((f, True) for f in shipped)]:
            with warnings.catch_warnings():
                if quiet:
                    warnings.simplefilter("ignore")
                th = load_cached_thresholds(candidate, key, search.config())
            if th is not None and th.transforms is not None and th.transforms.notes.get("search") == wanted:
                found = th
                break
        if found is not None and candidate != path:
            found.save(path)
        out.append(found)
        if found is None:
            missing.append((j, path))
    if not missing:
        return out  # type: ignore[return-value]
    meta = {
        "data": spec.text,
        "data_path": spec.text_path,
        "samples": spec.samples,
        "window": spec.window,
        "windows_sha256": key.windows_sha256,
    }
    made = profile_plus_many(
        model, windows, [searches[j] for j, _ in missing], progress=progress, name=model_name, metadata=meta
    )
    for (j, path), th in zip(missing, made, strict=True):
        th.save(path)
        out[j] = th
    return out  # type: ignore[return-value]


# ----------------------------------------------------------------------------------------------- applying


def apply_profile(model: Any, thresholds: Thresholds) -> Any:
    """Make ``model`` ready for ``thresholds``: check it is the profiled model, fold the profile's weight
    transforms into it (in place) and return it.

    A model that already carries exactly these transforms is returned unchanged (so a cache can be made for it
    many times); one with other transforms is refused, as is a profile for another model.
    """
    if is_folded(model) is None:
        thresholds.check_model(model)  # shape and weights (before folding changes them)
    else:
        thresholds.check_model(model.config)  # folded weights differ from the profiled ones: the shape here
    t = thresholds.transforms
    if t is None:
        if is_folded(model) is not None:
            raise TransformError("this model carries oaken-plus transforms; the paper's thresholds do not fit it")
        return model
    done = is_folded(model)
    if done == t.digest():
        return model
    if not t.folds_weights:
        # nothing to fold: still mark the model, so that another profile's fold is refused later
        if done is not None:
            raise TransformError("this model carries other oaken-plus transforms than this profile's")
        from oakenkv.calibrate.transforms import FOLD_MARK

        setattr(model.config, FOLD_MARK, t.digest())
        return model
    fold_into_model(model, t)
    return model


__all__: Sequence[str] = [
    "DEFAULT_RATIOS",
    "DEFAULT_SPARSE",
    "PLUS_CALIBRATION",
    "AttentionRecord",
    "PlusSearch",
    "apply_profile",
    "attention_output",
    "cached_plus_profile",
    "cached_plus_profiles",
    "choose_transforms",
    "profile_from_record",
    "profile_plus",
    "profile_plus_many",
    "profile_plus_model",
    "ratio_choices",
    "record_attention",
]
