"""Offline threshold profiling: run a model over calibration windows and derive each layer's group thresholds.

Oaken (Kim et al., ISCA 2025, Section 4.2) profiles the thresholds once per model: about 100 inferences over
calibration text, per decoder layer and separately for keys and values, the thresholds that split the values into
the configured group ratios (default 4% outer / 90% middle / 6% inner), averaged over the runs.

What is recorded
----------------
Exactly the tensors the cache will store: a :class:`KVRecorder` (a ``transformers.DynamicCache`` subclass) sees the
``key_states`` / ``value_states`` ``[B, H, S, D]`` that every attention layer hands to ``cache.update``. For Llama-style
models those keys are post-RoPE (``OakenConfig.key_position == "post_rope"``, the default). For ``"pre_rope"`` (what
the official harness quantizes) the recorder rotates the keys back: a forward pre-hook on every attention module
captures the ``position_embeddings`` ``(cos, sin)`` it is called with, and ``k = k_rot * cos - rotate_half(k_rot) *
sin`` inverts ``k_rot = k * cos + rotate_half(k) * sin`` exactly up to float rounding (RoPE rotates each pair of
dimensions by an angle; the inverse rotates by minus that angle). This is more faithful than hooking ``k_proj``
because models with a key norm (Gemma 3, Qwen 3) apply it between ``k_proj`` and RoPE. Values have no RoPE.

Thresholds of one run
---------------------
Over all values of one run (all tokens x KV heads x head_dim of one window, flattened), with outer ratio ``o`` and
inner ratio ``i``, exact order statistics (``np.partition`` + linear interpolation, the same definition as
``torch.quantile``; no sampling, so no sampling error; no 16M-element limit)::

    to_lo = q(o / 2)           to_hi = q(1 - o / 2)
    ti_lo = q(0.5 - i / 2)     ti_hi = q(0.5 + i / 2)      (inner_center="median", the default)

The inner group is the ``i`` of values around the median. The paper describes it as the values "near zero"; for
these activations the median of a layer's flattened values is close to 0 (default model, 4 x 256 Wikipedia tokens:
on average 0.02 and at most 0.08 standard deviations away, layer 4 keys), and centring on the median gives exactly
the requested fraction in every run, whereas a band symmetric around 0 is lopsided in an off-centre layer.
``inner_center="zero"`` gives that band instead: ``ti_hi = -ti_lo = q_|x|(i)``, the ``i`` of values of smallest
magnitude. Each of the four thresholds is then averaged over runs, and the standard deviation over runs is
recorded (:class:`~oakenkv.calibrate.thresholds.LayerStats.run_std`).

Kurtosis tuning (optional)
--------------------------
Heavy-tailed layers have more outliers than the nominal ratio. With ``kurtosis_tuning=True``, per layer and kind,
Pearson kurtosis (3 for a Gaussian; per run, averaged over runs) above ``KURTOSIS_HIGH`` = 20 raises the outer ratio by
0.5 points, and below ``KURTOSIS_LOW`` = 5 lowers the inner ratio by 0.3 points. The quantiles for both the nominal
and the adjusted ratios are collected in the same pass, so tuning costs no second pass; the ratios used and the
reason are recorded in the layer's :class:`~oakenkv.calibrate.thresholds.LayerStats`.

Entry points
------------
- :func:`profile_thresholds` (given windows) and :func:`profile_model` (load a model and its calibration text):
  what ``oakenkv profile`` runs.
- :func:`cached_thresholds`: a profile over the windows of a :class:`CalibrationSpec`, made once and then read
  from the disk cache (:func:`thresholds_cache_path`, keyed by content: :class:`CalibrationKey`); what
  ``oakenkv generate``/``demo`` and the evaluation use.
- The parts, for a profiler that records K/V its own way (``oakenkv.calibrate.ranges.calibrate_all`` profiles
  several configs in one pass): :class:`KVRecorder` / :func:`record_kv`, :func:`run_thresholds` per run,
  :func:`candidate_ratios` and :class:`RunAccumulator` to average runs exactly as :func:`profile_thresholds`.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from oakenkv.calibrate.rope import rotate_half
from oakenkv.calibrate.spec import (
    DEFAULT_CALIB_SAMPLES,
    DEFAULT_CALIB_TEXT,
    DEFAULT_CALIB_WINDOW,
    CalibrationSpec,
)
from oakenkv.calibrate.thresholds import GroupThresholds, LayerStats, ModelFingerprint, Thresholds
from oakenkv.format.config import OakenConfig
from oakenkv.util.paths import cache_root

if TYPE_CHECKING:
    from transformers import DynamicCache

__all__ = [
    "DEFAULT_CALIB_SAMPLES",
    "DEFAULT_CALIB_TEXT",
    "DEFAULT_CALIB_WINDOW",
    "DEFAULT_SAMPLES",
    "DEFAULT_WINDOW",
    "INNER_DELTA",
    "KURTOSIS_HIGH",
    "KURTOSIS_LOW",
    "OUTER_DELTA",
    "RECOMMENDED_RUNS",
    "CalibrationKey",
    "CalibrationSpec",
    "FewRunsWarning",
    "KVRecorder",
    "RunAccumulator",
    "cached_thresholds",
    "calibration_key",
    "calibration_windows",
    "candidate_ratios",
    "exact_quantiles",
    "kurtosis",
    "load_cached_thresholds",
    "profile_cache_dir",
    "profile_model",
    "profile_thresholds",
    "record_kv",
    "run_thresholds",
    "thresholds_cache_path",
]

#: The paper's (and the seed's troubleshooting advice's) number of profiling runs; fewer triggers FewRunsWarning.
RECOMMENDED_RUNS = 100
#: Default number of calibration windows (= runs) of ``oakenkv profile``.
DEFAULT_SAMPLES = 100
#: Default tokens per calibration window: 256 keeps 100 runs of the default model at a few minutes on 2 CPU cores
#: while the first (attention-sink) token, whose keys are atypical, is under 0.4% of a run's values.
DEFAULT_WINDOW = 256
#: Kurtosis tuning: above this kurtosis the outer ratio is raised by OUTER_DELTA.
KURTOSIS_HIGH = 20.0
#: Kurtosis tuning: below this kurtosis the inner ratio is lowered by INNER_DELTA.
KURTOSIS_LOW = 5.0
#: Kurtosis tuning: +0.5 percentage points of outer ratio.
OUTER_DELTA = 0.005
#: Kurtosis tuning: -0.3 percentage points of inner ratio.
INNER_DELTA = 0.003

InnerCenter = Literal["median", "zero"]
Kind = Literal["key", "value"]


class FewRunsWarning(UserWarning):
    """Fewer calibration runs than RECOMMENDED_RUNS: the averaged thresholds may be noisy."""


# ---------------------------------------------------------------------------------------------- statistics


def _as_numpy(x: torch.Tensor | np.ndarray) -> np.ndarray:
    """All elements of ``x`` as a flat float32 (or float64) numpy array on the CPU (bf16/fp16 widened exactly)."""
    if isinstance(x, torch.Tensor):
        x = x.detach()
        if x.dtype not in (torch.float32, torch.float64):
            x = x.to(torch.float32)
        x = x.cpu().numpy()
    return np.ascontiguousarray(x).reshape(-1)


# The statistics run in numpy on purpose: they are single-threaded there, and torch's multi-threaded sort of a
# 50k-element run costs far more CPU time than numpy's on a busy 2-core machine (OpenMP threads spin while they
# wait), which made the statistics cost as much as the model's forward pass (docs/perf-notes.md).


def exact_quantiles(x: torch.Tensor | np.ndarray, q: Sequence[float] | torch.Tensor) -> torch.Tensor:
    """Exact quantiles of all elements of ``x`` at levels ``q``, as ``torch.quantile(..., interpolation="linear")``.

    The needed order statistics are found with one ``np.partition`` (O(n), exact), so there is no element-count
    limit (``torch.quantile`` refuses more than 2^24 elements) and no sampling error.

    Args:
        x: float tensor or array of any shape (flattened).
        q: levels in [0, 1], ``[L]``.

    Returns:
        float64 tensor ``[L]``: ``s[lo] + (s[hi] - s[lo]) * (pos - lo)`` with ``pos = q * (n - 1)``, ``s`` sorted.
    """
    flat = _as_numpy(x)
    n = flat.size
    if n == 0:
        raise ValueError("cannot take quantiles of an empty tensor")
    qs = np.asarray(q.tolist() if isinstance(q, torch.Tensor) else q, dtype=np.float64)
    if qs.ndim != 1 or not ((qs >= 0) & (qs <= 1)).all():
        raise ValueError(f"quantile levels must be a 1-D sequence in [0, 1], got {qs!r}")
    pos = qs * (n - 1)
    lo = np.clip(np.floor(pos).astype(np.int64), 0, n - 1)
    hi = np.clip(np.ceil(pos).astype(np.int64), 0, n - 1)
    part = np.partition(flat, np.unique(np.concatenate([lo, hi])))
    s_lo, s_hi = part[lo].astype(np.float64), part[hi].astype(np.float64)
    return torch.from_numpy(s_lo + (s_hi - s_lo) * (pos - lo))


def kurtosis(x: torch.Tensor | np.ndarray) -> float:
    """Pearson kurtosis E[(x-mu)^4] / var^2 of all elements of ``x`` (3 for a Gaussian), in float64.

    Raises ValueError for a constant tensor (kurtosis undefined): a layer whose values are all equal means the
    recording is broken, and silently returning a number would hide it.
    """
    x64 = _as_numpy(x).astype(np.float64)
    c = x64 - x64.mean()
    c2 = c * c
    var = c2.mean()
    if not var > 0:
        raise ValueError("cannot compute kurtosis: all recorded values are equal (broken recording?)")
    return float((c2 * c2).mean() / (var * var))


def run_thresholds(
    x: torch.Tensor,
    outer_ratios: tuple[float, ...],
    inner_ratios: tuple[float, ...],
    inner_center: InnerCenter = "median",
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The thresholds of one run for several candidate ratios, and the run's kurtosis.

    Args:
        x: float tensor, all values of one layer's keys (or values) in one run, any shape (e.g. ``[H, S, D]``).
        outer_ratios: candidate outer ratios.
        inner_ratios: candidate inner ratios.
        inner_center: "median" (quantiles around the median) or "zero" (smallest magnitudes); see module doc.

    Returns:
        ``outer`` float64 ``[len(outer_ratios), 2]`` (to_lo, to_hi) per candidate, ``inner`` float64
        ``[len(inner_ratios), 2]`` (ti_lo, ti_hi) per candidate, and the Pearson kurtosis.

    Raises:
        ValueError: ``x`` holds NaN or Inf, or all its values are equal.
    """
    flat = _as_numpy(x)
    if not np.isfinite(flat).all():
        raise ValueError(f"{int((~np.isfinite(flat)).sum())} recorded values are NaN or infinite")
    outer_levels = [lv for o in outer_ratios for lv in (o / 2, 1 - o / 2)]
    if inner_center == "median":
        inner_levels = [lv for i in inner_ratios for lv in (0.5 - i / 2, 0.5 + i / 2)]
        q = exact_quantiles(flat, outer_levels + inner_levels)
        outer = q[: len(outer_levels)].reshape(-1, 2)
        inner = q[len(outer_levels) :].reshape(-1, 2)
    elif inner_center == "zero":
        outer = exact_quantiles(flat, outer_levels).reshape(-1, 2)
        t = exact_quantiles(np.abs(flat), list(inner_ratios))
        inner = torch.stack([-t, t], dim=1)
    else:
        raise ValueError(f"inner_center must be 'median' or 'zero', got {inner_center!r}")
    return outer, inner, kurtosis(flat)


# ---------------------------------------------------------------------------------------------- recording


@functools.cache
def _cache_class() -> type[DynamicCache]:
    from transformers import DynamicCache

    class _Recorder(DynamicCache):
        """A DynamicCache that also hands every layer's new key/value states to a callback."""

        def __init__(self, sink: Callable[[int, torch.Tensor, torch.Tensor], None], **kw: Any) -> None:
            super().__init__(**kw)
            self._sink = sink

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            self._sink(layer_idx, key_states, value_states)
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    return _Recorder


class KVRecorder:
    """Runs a transformers causal LM and returns, per decoder layer, the keys and values its cache would store.

    Keys are post-RoPE (what ``cache.update`` receives) or, with ``key_position="pre_rope"``, rotated back to
    pre-RoPE (see the module doc). Use as a context manager so the attention pre-hooks are removed afterwards.
    """

    def __init__(self, model: Any, key_position: Literal["post_rope", "pre_rope"] = "post_rope") -> None:
        if key_position not in ("post_rope", "pre_rope"):
            raise ValueError(f"key_position must be 'post_rope' or 'pre_rope', got {key_position!r}")
        self.model = model
        self.key_position = key_position
        self.num_layers = int(model.config.get_text_config(decoder=True).num_hidden_layers)
        self._rope: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._hooks: list[Any] = []
        self._keys: list[torch.Tensor | None] = []
        self._values: list[torch.Tensor | None] = []
        if key_position == "pre_rope":
            attn = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "k_proj")]
            if len(attn) != self.num_layers:
                raise NotImplementedError(
                    f"pre-RoPE recording found {len(attn)} attention modules (with k_proj and layer_idx) for "
                    f"{self.num_layers} layers in {type(model).__name__}; use key_position='post_rope'"
                )
            for m in attn:
                self._hooks.append(m.register_forward_pre_hook(self._capture_rope, with_kwargs=True))

    def _capture_rope(self, module: Any, args: tuple, kwargs: dict) -> None:
        pe = kwargs.get("position_embeddings")
        if pe is None and len(args) > 1:
            pe = args[1]
        if pe is None:
            raise NotImplementedError(
                f"{type(module).__name__} is not called with position_embeddings=(cos, sin); cannot undo RoPE"
            )
        self._rope[module.layer_idx] = pe

    def _sink(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        # k, v: [B, H, S, D]
        if self.key_position == "pre_rope":
            cos, sin = self._rope[layer_idx]  # [B, S, D] (or [1, S, D])
            if cos.shape[-1] != k.shape[-1]:
                raise NotImplementedError(
                    f"layer {layer_idx} applies RoPE to {cos.shape[-1]} of {k.shape[-1]} head dims (partial "
                    "rotary); pre-RoPE recording supports full-width RoPE only"
                )
            cos, sin = cos.unsqueeze(1).to(k.dtype), sin.unsqueeze(1).to(k.dtype)
            k = k * cos - rotate_half(k) * sin
        self._keys[layer_idx] = k.detach()
        self._values[layer_idx] = v.detach()

    def __enter__(self) -> KVRecorder:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    @torch.inference_mode()
    def record(self, input_ids: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """One forward pass (prefill) over ``input_ids`` int64 ``[B, S]``.

        Returns:
            ``(keys, values)``: lists with one tensor ``[B, H_kv, S, D]`` per decoder layer (model dtype).
        """
        if input_ids.dim() != 2 or input_ids.dtype != torch.int64:
            raise ValueError(f"input_ids must be int64 [B, S], got {input_ids.dtype} {tuple(input_ids.shape)}")
        self._keys = [None] * self.num_layers
        self._values = [None] * self.num_layers
        self._rope.clear()
        cache = _cache_class()(self._sink, config=self.model.config)
        params = inspect.signature(self.model.forward).parameters
        kw: dict[str, Any] = {"use_cache": True}
        kw["cache" if "cache" in params else "past_key_values"] = cache
        if "logits_to_keep" in params:
            kw["logits_to_keep"] = 1  # we need no logits: skip most of the LM head
        device = next(self.model.parameters()).device
        self.model(input_ids.to(device), **kw)
        missing = [i for i, k in enumerate(self._keys) if k is None]
        if missing:
            raise RuntimeError(f"layers {missing} never called cache.update: cannot record their keys/values")
        return self._keys, self._values  # type: ignore[return-value]


def record_kv(
    model: Any, input_ids: torch.Tensor, key_position: Literal["post_rope", "pre_rope"] = "post_rope"
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Convenience: the per-layer keys and values ``[B, H_kv, S, D]`` the cache stores for ``input_ids [B, S]``."""
    with KVRecorder(model, key_position) as rec:
        return rec.record(input_ids)


# ---------------------------------------------------------------------------------------------- profiling


def candidate_ratios(config: OakenConfig, tuning: bool) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The outer and inner ratios whose thresholds a run records: the config's, plus with kurtosis ``tuning`` the
    raised outer and lowered inner ratio (``OUTER_DELTA``, ``INNER_DELTA``), so tuning costs no second pass."""
    if not tuning:
        return (config.outer_ratio,), (config.inner_ratio,)
    raised = config.outer_ratio + OUTER_DELTA
    lowered = max(config.inner_ratio - INNER_DELTA, 0.0)
    if raised + config.inner_ratio >= 1.0:
        raise ValueError(f"kurtosis tuning would raise outer_ratio to {raised}, leaving no middle group")
    return (config.outer_ratio, raised), (config.inner_ratio, lowered)


@dataclass
class RunAccumulator:
    """The per-run results of one (layer, kind) over a profile, and the averaged thresholds they give.

    Feed it :func:`run_thresholds`' output for the ratios of :func:`candidate_ratios`, one run at a time
    (:meth:`add`), then :meth:`finish`. Any profiler that records K/V its own way (the evaluation's one-pass
    calibration of several configs) uses it to get exactly :func:`profile_thresholds`' numbers.
    """

    #: Each float64 ``[num_outer_candidates, 2]``: ``(to_lo, to_hi)`` per candidate ratio.
    outer: list[torch.Tensor] = field(default_factory=list)
    #: Each float64 ``[num_inner_candidates, 2]``: ``(ti_lo, ti_hi)`` per candidate ratio.
    inner: list[torch.Tensor] = field(default_factory=list)
    #: Pearson kurtosis of each run.
    kurt: list[float] = field(default_factory=list)
    #: Values recorded over all runs.
    num_samples: int = 0

    def add(self, outer: torch.Tensor, inner: torch.Tensor, kurt: float, num_values: int) -> None:
        """One run's candidate thresholds and kurtosis (:func:`run_thresholds`), over ``num_values`` values."""
        self.outer.append(outer)
        self.inner.append(inner)
        self.kurt.append(kurt)
        self.num_samples += num_values

    def finish(self, config: OakenConfig, tuning: bool, layer: int, kind: str) -> tuple[GroupThresholds, LayerStats]:
        """The thresholds averaged over runs (for the ratios kurtosis ``tuning`` picks) and their statistics."""
        runs = len(self.kurt)
        k = sum(self.kurt) / runs
        oi, ii, notes = 0, 0, []
        if tuning and k > KURTOSIS_HIGH:
            oi = 1
            notes.append(f"kurtosis {k:.2f} > {KURTOSIS_HIGH:g}: outer_ratio +{OUTER_DELTA:g}")
        if tuning and k < KURTOSIS_LOW:
            ii = 1
            notes.append(f"kurtosis {k:.2f} < {KURTOSIS_LOW:g}: inner_ratio -{INNER_DELTA:g}")
        outer_ratios, inner_ratios = candidate_ratios(config, tuning)
        per_run = torch.stack(
            [torch.stack([o[oi, 0], i[ii, 0], i[ii, 1], o[oi, 1]]) for o, i in zip(self.outer, self.inner, strict=True)]
        )  # [runs, 4]
        mean = per_run.mean(dim=0)
        std = per_run.std(dim=0, correction=0)
        try:
            thr = GroupThresholds(*(float(v) for v in mean))
        except ValueError as e:
            raise ValueError(
                f"layer {layer} {kind}: profiled thresholds are invalid ({e}); is the model degenerate?"
            ) from e
        stats = LayerStats(
            kurtosis=k,
            num_samples=self.num_samples,
            num_runs=runs,
            outer_ratio=outer_ratios[oi],
            inner_ratio=inner_ratios[ii],
            run_std=tuple(float(s) for s in std),
            adjustments=tuple(notes),
        )
        return thr, stats


def profile_thresholds(
    model: Any,
    windows: torch.Tensor,
    config: OakenConfig | None = None,
    *,
    kurtosis_tuning: bool = False,
    inner_center: InnerCenter = "median",
    batch_size: int = 1,
    progress: bool = False,
    name: str | None = None,
    metadata: dict[str, Any] | None = None,
) -> Thresholds:
    """Profile Oaken thresholds: one run per calibration window, per-run quantiles averaged over runs.

    Args:
        model: a transformers causal LM (eval mode); its cache must call ``cache.update`` for every layer.
        windows: int64 ``[R, S]`` token ids: R runs of S tokens (e.g. from ``oakenkv.assets.data.token_windows``).
        config: ratios and key position (default ``OakenConfig()``); stored in the result.
        kurtosis_tuning: adjust the ratios per layer and kind by kurtosis (module doc).
        inner_center: "median" (default) or "zero": how the inner thresholds are placed (module doc).
        batch_size: windows per forward pass (each window stays its own run; only speed changes).
        progress: show a rich progress bar.
        name: model name recorded in the fingerprint.
        metadata: extra JSON-able entries for ``Thresholds.profile``.

    Warns:
        FewRunsWarning: fewer than RECOMMENDED_RUNS windows.
    """
    config = OakenConfig() if config is None else config
    if not isinstance(windows, torch.Tensor) or windows.dim() != 2 or windows.dtype != torch.int64:
        raise ValueError(f"windows must be an int64 tensor [runs, tokens], got {getattr(windows, 'shape', windows)}")
    runs, seq = windows.shape
    if runs < 1 or seq < 1:
        raise ValueError(f"need at least one window of at least one token, got {tuple(windows.shape)}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if inner_center not in ("median", "zero"):
        raise ValueError(f"inner_center must be 'median' or 'zero', got {inner_center!r}")
    if runs < RECOMMENDED_RUNS:
        warnings.warn(
            f"profiling with {runs} runs; the paper averages about {RECOMMENDED_RUNS} and fewer runs give noisier "
            f"thresholds (pass --samples {RECOMMENDED_RUNS} or more)",
            FewRunsWarning,
            stacklevel=2,
        )
    fingerprint = ModelFingerprint.from_model(model, name=name)
    outer_ratios, inner_ratios = candidate_ratios(config, kurtosis_tuning)
    accs = {(layer, kind): RunAccumulator() for layer in range(fingerprint.num_layers) for kind in ("key", "value")}

    t0, cpu0 = time.perf_counter(), time.process_time()
    with KVRecorder(model, config.key_position) as rec, ProgressLog(progress, runs) as advance:
        for start in range(0, runs, batch_size):
            batch = windows[start : start + batch_size]
            keys, values = rec.record(batch)
            if len(keys) != fingerprint.num_layers:
                raise RuntimeError(f"recorded {len(keys)} layers, the config says {fingerprint.num_layers}")
            for layer in range(fingerprint.num_layers):
                for kind, states in (("key", keys[layer]), ("value", values[layer])):
                    if states.shape[1] != fingerprint.num_kv_heads or states.shape[3] != fingerprint.head_dim:
                        raise RuntimeError(
                            f"layer {layer} {kind}s have shape {tuple(states.shape)}, expected "
                            f"[B, {fingerprint.num_kv_heads}, S, {fingerprint.head_dim}]"
                        )
                    acc = accs[(layer, kind)]
                    for b in range(states.shape[0]):
                        x = states[b]  # [H, S, D]: one run
                        try:
                            o, i, k = run_thresholds(x, outer_ratios, inner_ratios, inner_center)
                        except ValueError as e:
                            raise ValueError(f"layer {layer} {kind}s of run {start + b}: {e}") from e
                        acc.add(o, i, k, x.numel())
            advance(batch.shape[0])
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0

    keys_t, values_t, kst, vst = [], [], [], []
    for layer in range(fingerprint.num_layers):
        for kind, thr_list, st_list in (("key", keys_t, kst), ("value", values_t, vst)):
            thr, st = accs[(layer, kind)].finish(config, kurtosis_tuning, layer, kind)
            thr_list.append(thr)
            st_list.append(st)
    info = {
        "runs": runs,
        "window": seq,
        "key_position": config.key_position,
        "inner_center": inner_center,
        "kurtosis_tuning": kurtosis_tuning,
        "quantiles": "exact (order statistics + linear interpolation) per run, averaged over runs",
        # Wall time, and this process's CPU time (both cores count): on a shared machine the wall time alone
        # mostly measures the other processes.
        "seconds": round(elapsed, 3),
        "cpu_seconds": round(cpu, 3),
        "torch_threads": torch.get_num_threads(),
        **(metadata or {}),
    }
    return Thresholds(config, fingerprint, tuple(keys_t), tuple(values_t), tuple(kst), tuple(vst), info)


class ProgressLog:
    """Context manager yielding an ``advance(n)`` callable: a rich progress bar on a terminal, a line per ~10% of
    the work when stderr is not a terminal (logs of long runs), or a no-op when disabled. ``label`` names the work
    and ``unit`` its steps."""

    def __init__(self, enabled: bool, total: int, label: str = "profiling", unit: str = "runs") -> None:
        self.enabled, self.total, self.label, self.unit = enabled, total, label, unit

    def __enter__(self) -> Callable[[int], None]:
        if not self.enabled:
            return lambda n: None
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        console = Console(stderr=True)
        self._p = Progress(
            TextColumn(self.label),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn(self.unit),
            TimeRemainingColumn(),
            console=console,
        )
        if not console.is_terminal:
            self._p = None
            done, t0, every = [0], time.perf_counter(), max(1, self.total // 10)

            def log(n: int) -> None:
                before, done[0] = done[0], done[0] + n
                if done[0] // every > before // every or done[0] == self.total:
                    console.print(f"{self.label}: {done[0]}/{self.total} {self.unit}, {time.perf_counter() - t0:.1f} s")

            return log
        self._p.start()
        task = self._p.add_task("profile", total=self.total)
        return lambda n: self._p.advance(task, n)

    def __exit__(self, *exc: Any) -> None:
        if self.enabled and self._p is not None:
            self._p.stop()


def load_calibration(
    model: str, samples: int, window: int, data: str = "wikipedia", data_path: str | None = None
) -> tuple[Any, torch.Tensor, dict[str, Any]]:
    """Load a model and cut ``samples`` consecutive, non-overlapping windows of ``window`` tokens from the start of
    its calibration text: ``(LoadedModel, int64 [R, S] windows, metadata for the profile)``. ``data`` defaults to
    the calibration text ("wikipedia"); "wikitext2" (the evaluation text) is allowed but warned about."""
    from oakenkv.assets.data import load_text, token_windows
    from oakenkv.assets.models import load_model

    if not isinstance(samples, int) or samples < 1:
        raise ValueError(f"samples must be a positive int, got {samples!r}")
    if data == "wikitext2":
        warnings.warn(
            "profiling on wikitext2, the evaluation text: perplexity measured on it afterwards is not held-out",
            UserWarning,
            stacklevel=3,
        )
    loaded = load_model(model)
    text = load_text(data, data_path)
    ids = token_windows(loaded.tokenizer, text, window, max_windows=samples)
    if ids.shape[0] < samples:
        warnings.warn(
            f"the {data!r} text holds only {ids.shape[0]} windows of {window} tokens; profiling with those",
            UserWarning,
            stacklevel=3,
        )
    meta = {"model": model, "model_source": loaded.source, "data": data, "data_path": data_path}
    return loaded, ids, meta


def profile_model(
    model: str = "default",
    *,
    samples: int = DEFAULT_SAMPLES,
    window: int = DEFAULT_WINDOW,
    data: str = "wikipedia",
    data_path: str | None = None,
    config: OakenConfig | None = None,
    kurtosis_tuning: bool = False,
    inner_center: InnerCenter = "median",
    batch_size: int = 1,
    progress: bool = False,
) -> Thresholds:
    """Load a model and its calibration text (:func:`load_calibration`) and profile the paper's thresholds."""
    loaded, ids, meta = load_calibration(model, samples, window, data, data_path)
    return profile_thresholds(
        loaded.model,
        ids,
        config,
        kurtosis_tuning=kurtosis_tuning,
        inner_center=inner_center,
        batch_size=batch_size,
        progress=progress,
        name=model,
        metadata=meta,
    )


# ---------------------------------------------------------------------------------------------- calibration


def calibration_windows(tokenizer: Any, spec: CalibrationSpec) -> torch.Tensor:
    """int64 ``[samples, window]`` token windows of the calibration text (warns if it is WikiText-2)."""
    from oakenkv.assets.data import load_text, token_windows

    if spec.text == "wikitext2":
        warnings.warn("calibrating on wikitext2, the evaluation text: results are not held-out", stacklevel=2)
    if spec.text == "file":  # any plain UTF-8 text file
        if spec.text_path is None:
            raise ValueError("calibration text 'file' needs a path (--calib-path)")
        from oakenkv.util.paths import MAX_TEXT_BYTES, read_text_capped

        text = read_text_capped(spec.text_path, "the calibration text file", MAX_TEXT_BYTES)  # (a regular file, capped)
    else:
        text = load_text(spec.text, spec.text_path)
    return token_windows(tokenizer, text, spec.window, max_windows=spec.samples)


def profile_cache_dir() -> Path:
    """Where profiles made on demand are kept: ``oakenkv.util.paths.cache_root() / "eval"`` (named after the evaluation,
    which kept them there first; the name stays so that existing caches stay valid)."""
    d = cache_root() / "eval"
    d.mkdir(parents=True, exist_ok=True)
    return d


@dataclass(frozen=True)
class CalibrationKey:
    """What a cached calibration result depends on, by content: the model's shape and weights
    (:class:`~oakenkv.calibrate.thresholds.ModelFingerprint` with :func:`~oakenkv.calibrate.thresholds.weights_digest`)
    and the token
    ids of the calibration windows (which carry the text's content, the tokenizer, BOS, the window count and
    length). ``model_name`` and ``spec`` only make the cache's file names readable: two models loaded by one name,
    or one text file edited in place, get different keys.
    """

    model_name: str
    fingerprint: ModelFingerprint
    spec: CalibrationSpec
    #: sha256 of the windows' int64 token ids.
    windows_sha256: str

    def digest(self, *extra: Any) -> str:
        """sha256 (hex) of the key's content and ``extra`` (JSON-able: the config, tuning, ...)."""
        fp = {k: v for k, v in self.fingerprint.to_dict().items() if k != "name"}
        payload = json.dumps([fp, self.windows_sha256, *extra], sort_keys=True, default=str)
        return hashlib.sha256(payload.encode()).hexdigest()

    def stem(self) -> str:
        """The readable part of a cache file's name: ``<model>-<spec tag>``."""
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in self.model_name)[-60:]
        return f"{safe}-{self.spec.tag()}"


def calibration_key(model: Any, model_name: str, spec: CalibrationSpec, windows: torch.Tensor) -> CalibrationKey:
    """The :class:`CalibrationKey` of ``model`` (shape and :func:`~oakenkv.calibrate.thresholds.weights_digest`) over
    the calibration ``windows`` (:func:`calibration_windows` of ``spec``)."""
    ids = windows.detach().to(torch.int64).contiguous()
    return CalibrationKey(
        model_name,
        ModelFingerprint.from_model(model, name=model_name),
        spec,
        hashlib.sha256(ids.numpy().tobytes() + repr(tuple(ids.shape)).encode()).hexdigest(),
    )


def thresholds_cache_path(
    key: CalibrationKey,
    config: OakenConfig,
    kurtosis_tuning: bool = False,
    cache_dir: Path | None = None,
) -> Path:
    """The file :func:`cached_thresholds` keeps a profile in: named by the model, the calibration, and a digest of
    the :class:`CalibrationKey`'s content, the config and the tuning."""
    digest = key.digest(config.to_dict(), bool(kurtosis_tuning))[:16]
    directory = profile_cache_dir() if cache_dir is None else cache_dir
    return directory / f"thr-{key.stem()}-{digest}.json"


def load_cached_thresholds(
    path: Path, key: CalibrationKey, config: OakenConfig, kurtosis_tuning: bool = False
) -> Thresholds | None:
    """The profile cached at ``path`` if it is the one ``key``, ``config`` and ``kurtosis_tuning`` ask for, else
    None (no file, an unreadable one, or one whose recorded model, weights, windows, config or tuning differ: a
    warning says which, and the caller profiles again and overwrites it)."""
    if not path.is_file():
        return None
    try:
        thr = Thresholds.load(path)
    except (OSError, ValueError) as e:
        warnings.warn(f"ignoring the unreadable cached profile {path} ({e}); profiling again", stacklevel=3)
        return None
    recorded = {
        "model": (thr.fingerprint, thr.fingerprint.weights),
        "calibration windows": thr.profile.get("windows_sha256"),
        "config": thr.config,
        "kurtosis tuning": bool(thr.profile.get("kurtosis_tuning")),
    }
    wanted = {
        "model": (key.fingerprint, key.fingerprint.weights),
        "calibration windows": key.windows_sha256,
        "config": config,
        "kurtosis tuning": bool(kurtosis_tuning),
    }
    differ = [k for k in wanted if recorded[k] != wanted[k]]
    if differ:
        warnings.warn(
            f"the cached profile {path} was made for another {', '.join(differ)}; profiling again", stacklevel=3
        )
        return None
    return thr


def cached_thresholds(
    model: Any,
    tokenizer: Any,
    model_name: str,
    config: OakenConfig,
    spec: CalibrationSpec | None = None,
    *,
    kurtosis_tuning: bool = False,
    progress: bool = False,
    cache_dir: Path | None = None,
) -> Thresholds:
    """The :class:`~oakenkv.calibrate.thresholds.Thresholds` of :func:`profile_thresholds` over the calibration windows
    of
    ``spec`` (default :class:`CalibrationSpec`), profiled once and then read from the disk cache
    (:func:`thresholds_cache_path`; ``cache_dir`` defaults to :func:`profile_cache_dir`).

    The cache is keyed by content (:class:`CalibrationKey`: the model's weights and the windows' tokens, with the
    config and tuning) and a cached file is checked against that key when read: a model changed at the same
    name or path, or an edited calibration text, is profiled again, never served another model's profile."""
    spec = spec or CalibrationSpec()
    ids = calibration_windows(tokenizer, spec)
    key = calibration_key(model, model_name, spec, ids)
    path = thresholds_cache_path(key, config, kurtosis_tuning, cache_dir)
    cached = load_cached_thresholds(path, key, config, kurtosis_tuning)
    if cached is not None:
        return cached
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FewRunsWarning)
        thr = profile_thresholds(
            model,
            ids,
            config,
            kurtosis_tuning=kurtosis_tuning,
            progress=progress,
            name=model_name,
            metadata={
                "data": spec.text,
                "data_path": spec.text_path,
                "samples": spec.samples,
                "window": spec.window,
                "windows_sha256": key.windows_sha256,
            },
        )
    thr.save(path)
    return thr
