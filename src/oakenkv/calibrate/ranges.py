"""Calibration for the evaluation: Oaken thresholds and baseline ranges, from calibration text only.

Nothing here reads the evaluation text unless asked: the default calibration text is the Wikipedia excerpt
(``oakenkv.assets.data.load_text("wikipedia")``), not WikiText-2. Results are kept in the calibration disk cache
(``oakenkv.calibrate.diskcache``), keyed by content (the model's weights and the calibration windows' tokens) and the
config, so a report run profiles each model once, and a model changed at the same path is calibrated again.

- :func:`oaken_thresholds`: ``oakenkv.calibrate.profile.cached_thresholds`` in this module's cache directory (the
  calibration spec, windows and profile cache are ``oakenkv.calibrate.profile``'s, re-exported here).
- :func:`kv_ranges`: per layer, the global min/max of the pre-RoPE keys and of the values (the official
  Oaken harness's grids) and the per-channel quantiles of the pre-RoPE keys (KVQuant's key ranges).
- :func:`calibrate_all`: several Oaken configurations and the ranges in one pass over the windows.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from oakenkv.calibrate.diskcache import (
    CacheEntry,
    CalibrationKey,
    calibration_key,
    load_profile,
    profile_cache_dir,
    thresholds_entry,
)
from oakenkv.calibrate.profile import cached_thresholds
from oakenkv.calibrate.recording import record_kv
from oakenkv.calibrate.spec import (
    DEFAULT_CALIB_SAMPLES,
    DEFAULT_CALIB_TEXT,
    DEFAULT_CALIB_WINDOW,
    CalibrationSpec,
    calibration_windows,
)
from oakenkv.calibrate.stats import RunAccumulator, candidate_ratios, run_thresholds
from oakenkv.calibrate.thresholds import Thresholds
from oakenkv.format.config import OakenConfig

__all__ = [
    "DEFAULT_CALIB_SAMPLES",
    "DEFAULT_CALIB_TEXT",
    "DEFAULT_CALIB_WINDOW",
    "CalibrationSpec",
    "KVRanges",
    "calibrate_all",
    "calibration_windows",
    "kv_ranges",
    "oaken_thresholds",
]


def _cache_dir() -> Path:
    """The disk cache of this module (a function, so that tests can point it elsewhere)."""
    return profile_cache_dir()


def oaken_thresholds(
    model: Any,
    tokenizer: Any,
    model_name: str,
    config: OakenConfig,
    spec: CalibrationSpec | None = None,
    *,
    kurtosis_tuning: bool = False,
    progress: bool = False,
) -> Thresholds:
    """Profiled :class:`~oakenkv.calibrate.thresholds.Thresholds` for ``config``
    (``oakenkv.calibrate.profile.cached_thresholds``)."""
    return cached_thresholds(
        model,
        tokenizer,
        model_name,
        config,
        spec,
        kurtosis_tuning=kurtosis_tuning,
        progress=progress,
        cache_dir=_cache_dir(),
    )


@dataclass
class KVRanges:
    """Per-layer ranges of the pre-RoPE keys and the values over the calibration windows.

    ``key_extremes[i]`` / ``value_extremes[i]``: global ``(min, max)`` of layer i.
    ``key_channel_lo[i]`` / ``key_channel_hi[i]``: ``[H, D]`` per-channel quantiles at ``q`` and ``1 - q``,
    averaged over windows.
    """

    key_extremes: list[tuple[float, float]]
    value_extremes: list[tuple[float, float]]
    key_channel_lo: list[torch.Tensor]
    key_channel_hi: list[torch.Tensor]
    q: float

    def sha256(self) -> str:
        """Digest of every number held (what a result or a checkpoint that used these ranges depends on)."""
        h = hashlib.sha256(json.dumps([self.key_extremes, self.value_extremes, self.q]).encode())
        for t in (*self.key_channel_lo, *self.key_channel_hi):
            t = t.detach().to(torch.float32).contiguous()
            h.update(repr(tuple(t.shape)).encode())
            h.update(t.numpy().tobytes())
        return h.hexdigest()


def kv_ranges(
    model: Any, tokenizer: Any, model_name: str, spec: CalibrationSpec | None = None, q: float = 0.005
) -> KVRanges:
    """Compute (or load from the disk cache) :class:`KVRanges` on the calibration windows."""
    spec = (spec or CalibrationSpec()).fit(model)
    ids = calibration_windows(tokenizer, spec)
    key = calibration_key(model, model_name, spec, ids)
    entry = _ranges_entry(key, q)
    cached = _load_ranges(entry)
    if cached is not None:
        return cached
    kmin = kmax = vmin = vmax = None
    lo_sum: list[torch.Tensor] = []
    hi_sum: list[torch.Tensor] = []
    levels = torch.tensor([q, 1 - q])
    with torch.no_grad():
        for w in range(ids.shape[0]):
            keys, values = record_kv(model, ids[w : w + 1], "pre_rope")  # per layer [1, H, S, D]
            kmn = torch.stack([k.amin() for k in keys])
            kmx = torch.stack([k.amax() for k in keys])
            vmn = torch.stack([v.amin() for v in values])
            vmx = torch.stack([v.amax() for v in values])
            kmin = kmn if kmin is None else torch.minimum(kmin, kmn)
            kmax = kmx if kmax is None else torch.maximum(kmax, kmx)
            vmin = vmn if vmin is None else torch.minimum(vmin, vmn)
            vmax = vmx if vmax is None else torch.maximum(vmax, vmx)
            for i, k in enumerate(keys):
                _, h, s, d = k.shape
                per_ch = torch.quantile(k[0].permute(1, 0, 2).reshape(s, h * d).float(), levels, dim=0)  # [2, H*D]
                lo, hi = per_ch[0].reshape(h, d), per_ch[1].reshape(h, d)
                if w == 0:
                    lo_sum.append(lo)
                    hi_sum.append(hi)
                else:
                    lo_sum[i] += lo
                    hi_sum[i] += hi
    n = ids.shape[0]
    out = KVRanges(
        key_extremes=[(float(a), float(b)) for a, b in zip(kmin, kmax, strict=True)],
        value_extremes=[(float(a), float(b)) for a, b in zip(vmin, vmax, strict=True)],
        key_channel_lo=[x / n for x in lo_sum],
        key_channel_hi=[x / n for x in hi_sum],
        q=q,
    )
    _save_ranges(out, entry)
    return out


def _ranges_entry(key: CalibrationKey, q: float) -> CacheEntry:
    """The ranges' entry in the calibration disk cache (``oakenkv.calibrate.diskcache``)."""
    return CacheEntry(
        key, "ranges", {"q": float(q)}, ("kv_ranges", float(q)), suffix=".pt", label=f"-q{q:g}", directory=_cache_dir()
    )


def _save_ranges(ranges: KVRanges, entry: CacheEntry, path: Path | None = None) -> None:
    """Write the ranges atomically (a torn file would break every later run), with the identity
    (:meth:`~oakenkv.calibrate.diskcache.CacheEntry.identity`) they were computed for."""
    entry.store(lambda f: torch.save({"identity": entry.identity(), **ranges.__dict__}, f), path)


def _read_ranges(path: Path) -> tuple[Any, KVRanges]:
    """``(identity, ranges)`` of a ranges file; ``weights_only=True``: tensors and plain containers only, never code
    (torch < 2.6 defaults to unpickling anything)."""
    d = torch.load(path, weights_only=True)
    ident = d.pop("identity", None)
    return ident, KVRanges(**d)


def _load_ranges(entry: CacheEntry, path: Path | None = None) -> KVRanges | None:
    """The cached ranges at ``path`` (default the entry's) if they were computed for ``entry``, else None
    (:meth:`~oakenkv.calibrate.diskcache.CacheEntry.load`: no file; an unreadable one, or one computed for another
    model or calibration, which warns; then recomputed and overwritten)."""

    def recorded(got: tuple[Any, KVRanges]) -> Any:
        # a file written before the cache was one module records the digest of the same identity
        return entry.identity() if isinstance(got[0], str) and got[0] == entry.digest else got[0]

    got = entry.load(_read_ranges, recorded, "ranges", "recomputing", path=path)
    return None if got is None else got[1]


def _pos(config: OakenConfig) -> str:
    return "pre" if config.key_position == "pre_rope" else "post"


def calibrate_all(
    model: Any,
    tokenizer: Any,
    model_name: str,
    configs: list[tuple[OakenConfig, bool]],
    spec: CalibrationSpec | None = None,
    *,
    progress: bool = False,
) -> None:
    """Profile several Oaken configurations and the baseline ranges in ONE pass over the calibration windows.

    Fills the same disk cache :func:`oaken_thresholds` and :func:`kv_ranges` read (so they return at once
    afterwards). Thresholds follow :func:`oakenkv.calibrate.profile.profile_thresholds` exactly (its per-run quantiles,
    kurtosis rule and averaging, reused from that module), but each window is recorded once (post-RoPE; the
    pre-RoPE keys are un-rotated from them) instead of once per configuration: on 2 shared CPU cores the
    forward passes dominate.

    Args:
        configs: ``(config, kurtosis_tuning)`` pairs.
    """
    from oakenkv.calibrate.rope import RopeTable, invert_rope

    spec = (spec or CalibrationSpec()).fit(model)
    ids = calibration_windows(tokenizer, spec)
    key = calibration_key(model, model_name, spec, ids)
    fp = key.fingerprint
    n_layers = fp.num_layers
    todo = []
    for config, tuning in configs:
        entry = thresholds_entry(key, config, tuning, _cache_dir())
        if load_profile(entry) is None:
            cand = candidate_ratios(config, tuning)
            accs = {(i, k): RunAccumulator() for i in range(n_layers) for k in ("key", "value")}
            todo.append((config, tuning, entry, cand, accs))
    q = 0.005
    ranges_entry = _ranges_entry(key, q)
    need_ranges = _load_ranges(ranges_entry) is None
    if not todo and not need_ranges:
        return
    union_outer = tuple(sorted({r for *_, (oc, _ic), _a in todo for r in oc}))
    union_inner = tuple(sorted({r for *_, (_oc, ic), _a in todo for r in ic}))
    rope = RopeTable(model)
    kmin = [float("inf")] * n_layers
    kmax = [float("-inf")] * n_layers
    vmin = [float("inf")] * n_layers
    vmax = [float("-inf")] * n_layers
    lo_sum: list[Any] = [0.0] * n_layers
    hi_sum: list[Any] = [0.0] * n_layers
    levels = torch.tensor([q, 1 - q])
    it = range(ids.shape[0])
    if progress:
        from tqdm import tqdm

        it = tqdm(it, desc=f"calibrate {model_name}", unit="window")
    with torch.no_grad():
        for w in it:
            keys, values = record_kv(model, ids[w : w + 1], "post_rope")  # per layer [1, H, S, D]
            for i in range(n_layers):
                k_post, v = keys[i], values[i]
                cos, sin = rope.cos_sin(i, 0, k_post.shape[-2], k_post)
                k_pre = invert_rope(k_post, cos, sin)
                kmin[i], kmax[i] = min(kmin[i], float(k_pre.amin())), max(kmax[i], float(k_pre.amax()))
                vmin[i], vmax[i] = min(vmin[i], float(v.amin())), max(vmax[i], float(v.amax()))
                _, h, s, d = k_pre.shape
                per_ch = torch.quantile(k_pre[0].permute(1, 0, 2).reshape(s, h * d), levels, dim=0)  # [2, H*D]
                lo_sum[i] = lo_sum[i] + per_ch[0].reshape(h, d)
                hi_sum[i] = hi_sum[i] + per_ch[1].reshape(h, d)
                # One sort per tensor: the union of every configuration's candidate ratios in one call.
                tensors = {"post": k_post[0], "pre": k_pre[0], "value": v[0]}
                done: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
                for name, x in tensors.items():
                    if name != "value" and not any(_pos(c) == name for c, *_ in todo):
                        continue
                    done[name] = run_thresholds(x, union_outer, union_inner)
                for config, _tuning, _path, (outer_c, inner_c), accs in todo:
                    for kind, name in (("key", _pos(config)), ("value", "value")):
                        o_all, i_all, kurt = done[name]
                        accs[(i, kind)].add(
                            o_all[[union_outer.index(r) for r in outer_c]],
                            i_all[[union_inner.index(r) for r in inner_c]],
                            kurt,
                            tensors[name].numel(),
                        )
    for config, tuning, entry, _cand, accs in todo:
        kt, vt, ks, vs = [], [], [], []
        for i in range(n_layers):
            for kind, tl, sl in (("key", kt, ks), ("value", vt, vs)):
                thr, st = accs[(i, kind)].finish(config, tuning, i, kind)
                tl.append(thr)
                sl.append(st)
        th = Thresholds(
            config=config,
            fingerprint=fp,
            keys=tuple(kt),
            values=tuple(vt),
            key_stats=tuple(ks),
            value_stats=tuple(vs),
            profile={
                "data": spec.text,
                "data_path": spec.text_path,
                "runs": spec.samples,
                "window": spec.window,
                "kurtosis_tuning": tuning,
                "windows_sha256": key.windows_sha256,
                "profiler": "oakenkv.calibrate.ranges.calibrate_all (oakenkv.calibrate.profile quantiles, one pass)",
            },
        )
        entry.store(th.to_json())
    if need_ranges:
        n = ids.shape[0]
        _save_ranges(
            KVRanges(
                key_extremes=list(zip(kmin, kmax, strict=True)),
                value_extremes=list(zip(vmin, vmax, strict=True)),
                key_channel_lo=[x / n for x in lo_sum],
                key_channel_hi=[x / n for x in hi_sum],
                q=q,
            ),
            ranges_entry,
        )
