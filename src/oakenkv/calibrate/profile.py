"""Offline threshold profiling: run a model over calibration windows and derive each layer's group thresholds.

Oaken (Kim et al., ISCA 2025, Section 4.2) profiles the thresholds once per model: about 100 inferences over
calibration text, per decoder layer and separately for keys and values, the thresholds that split the values into
the configured group ratios (default 4% outer / 90% middle / 6% inner), averaged over the runs.

Layer by layer (post-RoPE keys, one window per forward, the defaults): every window's keys and values of one layer
(``oakenkv.calibrate.recording.stream_attention``, the oaken-plus search's recording), their per-run quantiles and
kurtosis (``oakenkv.calibrate.stats``), averaged over runs; memory holds every window's hidden states and one
layer's keys and values, and a model loaded lazily (``load_model(lazy=True)``, what :func:`profile_model` loads)
keeps one unit's weights in memory, so a model larger than memory profiles. Otherwise (pre-RoPE keys, batches of
windows, a model whose layers cannot run one at a time or whose attention the layer-by-layer recorder does not
know: Falcon) one window (or batch) at a time through the whole model:
the keys and values the cache would store (``oakenkv.calibrate.recording.KVRecorder``); memory holds one window's
recording of every layer. Both give the same profile, bit for bit (``tests/test_profile.py``).

Entry points
------------
- :func:`profile_thresholds` (given windows) and :func:`profile_model` (load a model and its calibration text):
  what ``oakenkv profile`` runs.
- :func:`cached_thresholds`: a profile over the windows of a :class:`CalibrationSpec`, made once and then read
  from the calibration disk cache (``oakenkv.calibrate.diskcache``, keyed by content); what ``oakenkv
  generate``/``demo`` and the evaluation use.
- The parts, for a profiler that records K/V its own way (``oakenkv.calibrate.ranges.calibrate_all`` profiles
  several configs in one pass), are re-exported here from the modules that define them: :class:`KVRecorder` /
  :func:`record_kv` (``recording``), :func:`run_thresholds` per run, :func:`candidate_ratios` and
  :class:`RunAccumulator` to average runs exactly as :func:`profile_thresholds` (``stats``), and the cache's
  :class:`CalibrationKey`, :func:`calibration_key`, :func:`thresholds_cache_path`, :func:`load_cached_thresholds`
  and :func:`profile_cache_dir` (``diskcache``).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from oakenkv.assets.lazy import lazy_weights
from oakenkv.calibrate.diskcache import (
    CalibrationKey,
    calibration_key,
    load_cached_thresholds,
    load_profile,
    load_profile_of_other_dtype,
    profile_cache_dir,
    store_profile,
    thresholds_cache_path,
    thresholds_entry,
)
from oakenkv.calibrate.identity import ModelFingerprint
from oakenkv.calibrate.recording import KVRecorder, StreamingUnsupported, record_kv, stream_attention
from oakenkv.calibrate.spec import (
    DEFAULT_CALIB_SAMPLES,
    DEFAULT_CALIB_TEXT,
    DEFAULT_CALIB_WINDOW,
    CalibrationSpec,
    calibration_text,
    calibration_windows,
    check_windows,
    max_positions,
    warn_if_short,
)
from oakenkv.calibrate.stats import (
    INNER_DELTA,
    KURTOSIS_HIGH,
    KURTOSIS_LOW,
    OUTER_DELTA,
    InnerCenter,
    RunAccumulator,
    candidate_ratios,
    exact_quantiles,
    kurtosis,
    run_thresholds,
)
from oakenkv.calibrate.thresholds import Thresholds
from oakenkv.calibrate.transforms import TransformError
from oakenkv.format.config import OakenConfig

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
    "ProgressLog",
    "RunAccumulator",
    "cached_thresholds",
    "calibration_key",
    "calibration_windows",
    "candidate_ratios",
    "exact_quantiles",
    "kurtosis",
    "load_cached_thresholds",
    "load_calibration",
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
#: Default tokens per calibration window: 256 keeps 100 runs short (docs/notebook/perf-notes.md has the time)
#: while the first (attention-sink) token, whose keys are atypical, is under 0.4% of a run's values.
DEFAULT_WINDOW = 256


class FewRunsWarning(UserWarning):
    """Fewer calibration runs than RECOMMENDED_RUNS: the averaged thresholds may be noisy."""


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
    check_windows(model, windows)
    runs, seq = windows.shape
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
    fingerprint = ModelFingerprint.from_model(model, name=name, rounded=True)
    outer_ratios, inner_ratios = candidate_ratios(config, kurtosis_tuning)
    accs = {(layer, kind): RunAccumulator() for layer in range(fingerprint.num_layers) for kind in ("key", "value")}

    def add(layer: int, kind: str, states: torch.Tensor, start: int) -> None:
        """Runs ``start, start + 1, ...`` of one layer's keys or values ``[B, H, S, D]``, in order."""
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

    t0, cpu0 = time.perf_counter(), time.process_time()
    streamed = config.key_position == "post_rope" and batch_size == 1
    if streamed:
        with ProgressLog(progress, runs * fingerprint.num_layers, "profiling", "layer runs") as advance:
            try:
                layers = stream_attention(model, windows, 1, advance)
            except (StreamingUnsupported, TransformError) as e:
                # TransformError: attention the layer-by-layer recorder does not know (Falcon's fused projections)
                # or refuses for oaken-plus (learned sinks); the cache sees every model's K/V
                streamed = False
                if lazy_weights(model) is not None:
                    warnings.warn(
                        f"running every window through the whole model, which reads each layer from disk once per "
                        f"window ({e})",
                        stacklevel=2,
                    )
            else:
                seen = 0
                try:
                    for record in layers:
                        add(record.index, "key", record.keys, 0)
                        add(record.index, "value", record.values, 0)
                        seen += 1
                        del record
                finally:
                    layers.close()
                if seen != fingerprint.num_layers:
                    raise RuntimeError(f"recorded {seen} layers, the config says {fingerprint.num_layers}")
    if not streamed:
        with KVRecorder(model, config.key_position) as rec, ProgressLog(progress, runs) as advance:
            for start in range(0, runs, batch_size):
                batch = windows[start : start + batch_size]
                keys, values = rec.record(batch)
                if len(keys) != fingerprint.num_layers:
                    raise RuntimeError(f"recorded {len(keys)} layers, the config says {fingerprint.num_layers}")
                for layer in range(fingerprint.num_layers):
                    add(layer, "key", keys[layer], start)
                    add(layer, "value", values[layer], start)
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
    model: str,
    samples: int,
    window: int,
    data: str = "wikipedia",
    data_path: str | None = None,
    *,
    lazy: bool = False,
) -> tuple[Any, torch.Tensor, dict[str, Any]]:
    """Load a model and cut ``samples`` consecutive, non-overlapping windows of ``window`` tokens from the start of
    its calibration text: ``(LoadedModel, int64 [R, S] windows, metadata for the profile)``. ``data`` defaults to
    the calibration text ("wikipedia"); "wikitext2" (the evaluation text) is allowed but warned about; "file" is the
    plain text file at ``data_path`` (:func:`~oakenkv.calibrate.spec.calibration_text`). ``lazy``:
    the model's units stay on disk until called (``load_model(lazy=True)``; hub ids load eagerly)."""
    from oakenkv.assets.data import token_windows
    from oakenkv.assets.models import load_model, locate_model

    if not isinstance(samples, int) or samples < 1:
        raise ValueError(f"samples must be a positive int, got {samples!r}")
    if data == "wikitext2":
        warnings.warn(
            "profiling on wikitext2, the evaluation text: perplexity measured on it afterwards is not held-out",
            UserWarning,
            stacklevel=3,
        )
    loaded = load_model(model, lazy=lazy and locate_model(model).kind != "hub")
    most = max_positions(loaded.model)
    if most is not None and window > most:
        raise ValueError(f"windows of {window} tokens are longer than the model's {most} positions (--window {most})")
    ids = token_windows(loaded.tokenizer, calibration_text(data, data_path), window, max_windows=samples)
    warn_if_short(ids, samples, window, data, data_path, stacklevel=4)
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
    """Load a model and its calibration text (:func:`load_calibration`) and profile the paper's thresholds. Where
    the profile runs layer by layer (post-RoPE keys, ``batch_size`` 1: the defaults) the model is loaded lazily
    (module doc); the profile is the same."""
    lazy = (config or OakenConfig()).key_position == "post_rope" and batch_size == 1
    loaded, ids, meta = load_calibration(model, samples, window, data, data_path, lazy=lazy)
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
    of ``spec`` (default :class:`CalibrationSpec`), profiled once and then read from the calibration disk cache
    (``oakenkv.calibrate.diskcache.thresholds_entry``; ``cache_dir`` defaults to :func:`profile_cache_dir`).

    The cache is keyed by content (:class:`CalibrationKey`: the model's weights and the windows' tokens, with the
    config and tuning) and a cached file is checked against that key when read: a model changed at the same
    name or path, or an edited calibration text, is profiled again, never served another model's profile."""
    spec = (spec or CalibrationSpec()).fit(model)
    ids = calibration_windows(tokenizer, spec)
    key = calibration_key(model, model_name, spec, ids)
    entry = thresholds_entry(key, config, kurtosis_tuning, cache_dir)
    cached = load_profile(entry)
    if cached is None:  # the same weights profiled in another dtype
        cached = load_profile_of_other_dtype(entry, model)
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
    store_profile(entry, thr)
    return thr
