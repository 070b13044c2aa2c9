"""Decode-step benchmark: time per generated token and KV-cache bytes at long contexts, for OakenCache and the
transformers caches it replaces (``oakenkv bench decode``, ``benchmarks/bench_decode.py``).

Methods:

* ``oaken``: :class:`~oakenkv.hf.cache.OakenCache` with the packed-page decode attention (``"oaken"``); with
  ``residual=R`` its newest tokens stay in a full-precision window (``OakenCache(residual=R)``).
* ``dynamic``: transformers' ``DynamicCache`` in fp32 (what the CPU model runs in), SDPA attention.
* ``quanto``: transformers' ``QuantizedCache(backend="quanto", nbits=4)`` (needs ``optimum-quanto``; residual
  length 128, group size 64: transformers' defaults), SDPA attention.

How a context is built: running a real 16K-token prefill three times would take many minutes on 2 CPU cores and
would not change a decode step, so the benchmark records the keys and values of one real prefill of
``source_tokens`` WikiText-2 tokens and tiles them to the context length, then pushes them into each cache with
its own ``update`` (each cache quantizes them its own way). Every decode step after that is a real forward pass
of the model with one new token. KV bytes are counted from what each cache holds: tensor storage for the
transformers caches (quanto's packed data, scales and shifts included), pages in use plus tables for OakenCache.

Timing: at each context all caches are filled first, then timed in interleaved rounds (one step of each method
per round, the starting method rotating), so that the load drifts of a shared machine hit every method alike
and step ``i`` of two methods forms a pair; ``oaken`` reports the median of its per-round ratios to each other
method and how many rounds it won.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from oakenkv.hf.cache import OakenCache, kv_bytes
from oakenkv.util.compat import cache_kwargs

METHODS = ("oaken", "dynamic", "quanto")


@dataclass(frozen=True)
class DecodeResult:
    method: str
    context: int
    #: Median wall time of one decode step (the whole model forward), milliseconds.
    step_ms: float
    #: All measured step times, milliseconds.
    steps_ms: tuple[float, ...]
    #: KV-cache bytes after filling the context (before the timed steps).
    kv_bytes: int
    #: Seconds spent filling the cache (quantizing the context).
    fill_s: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "step_ms": self.step_ms,
            "kv_bytes": self.kv_bytes,
            "steps_ms": list(self.steps_ms),
            "fill_s": self.fill_s,
        }


def record_source_kv(model: Any, input_ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Keys (post-RoPE) and values ``[1, H, S, hd]`` of every layer after one real prefill."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=input_ids, use_cache=True, **cache_kwargs(model, cache))
    return [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]


def tile_rows(x: torch.Tensor, n: int, batch: int = 1) -> torch.Tensor:
    """``[1, H, S, hd]`` -> ``[batch, H, n, hd]``: ``x`` tiled along the tokens, row ``b`` starting ``37 b`` tokens
    further (so that the rows differ)."""
    reps = -(-(n + 37 * (batch - 1)) // x.shape[2])
    tiled = x.repeat(1, 1, reps, 1)
    return torch.cat([tiled[:, :, 37 * b : 37 * b + n] for b in range(batch)]).contiguous()


def make_cache(method: str, model: Any, thresholds: Any, residual: int = 0) -> Any:
    """A fresh cache of ``method``; ``residual``: the ``oaken`` cache's full-precision window (0: none)."""
    if method == "oaken":
        return OakenCache(thresholds, model, residual=residual)
    if method == "dynamic":
        from transformers import DynamicCache

        return DynamicCache(config=model.config)
    if method == "quanto":
        from transformers import QuantizedCache

        return QuantizedCache(backend="quanto", config=model.config, nbits=4)
    raise ValueError(f"unknown method {method!r}; choose from {METHODS}")


def fill_cache(
    method: str,
    model: Any,
    thresholds: Any,
    source: list[tuple[torch.Tensor, torch.Tensor]],
    context: int,
    batch: int = 1,
    residual: int = 0,
):
    """A fresh cache of ``method`` holding ``context`` tokens per row for ``batch`` rows (the source K/V tiled,
    :func:`tile_rows`); returns ``(cache, seconds)``."""
    cache = make_cache(method, model, thresholds, residual)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i, (k, v) in enumerate(source):
            out = cache.update(tile_rows(k, context, batch), tile_rows(v, context, batch), i)
            del out  # the float tensors returned for prefill attention are not kept
    return cache, time.perf_counter() - t0


def time_steps(
    model: Any, caches: dict[str, Any], steps: int, warmup: int = 1, batch: int = 1
) -> dict[str, list[float]]:
    """Decode-step times (ms) of several caches, interleaved: round ``r`` times one step of every cache, starting
    with a different one each round, so that drifting machine load hits every method alike and step ``i`` of two
    methods can be compared as a pair. The ``"oaken"`` attention is on for all of them: it runs SDPA for float
    caches (a type check per layer) and reads the packed pages for OakenCache."""
    from oakenkv.hf.attention import oaken_attention

    names = list(caches)
    times: dict[str, list[float]] = {m: [] for m in names}
    tokens = {m: torch.full((batch, 1), 1000) for m in names}
    kw = {m: cache_kwargs(model, caches[m]) for m in names}  # built outside the timed region
    ctx = oaken_attention(model) if "oaken" in names else contextlib.nullcontext()
    with ctx, torch.inference_mode():
        for r in range(warmup + steps):
            for k in range(len(names)):
                m = names[(r + k) % len(names)]
                t = time.perf_counter()
                logits = model(input_ids=tokens[m], use_cache=True, **kw[m]).logits
                dt = time.perf_counter() - t
                tokens[m] = logits[:, -1:].argmax(-1)
                if r >= warmup:
                    times[m].append(dt * 1e3)
    return times


def paired(a: list[float], b: list[float]) -> dict[str, Any]:
    """Step-by-step comparison of two methods timed in the same rounds: median of ``a_i / b_i`` and how often
    ``a`` was faster."""
    ratios = [x / y for x, y in zip(a, b, strict=True)]
    return {"median_ratio": statistics.median(ratios), "faster_steps": sum(r < 1 for r in ratios), "steps": len(ratios)}


def run_decode_bench(
    contexts: list[int],
    methods: list[str] | tuple[str, ...] = METHODS,
    *,
    model: str = "default",
    thresholds: Any = None,
    steps: int = 5,
    source_tokens: int = 512,
    batch: int = 1,
    residual: int = 0,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run every method at every context; returns ``{"results": {method: {context: {...}}}, "meta": {...}}``.

    At each context every method's cache is filled, then their decode steps are timed in interleaved rounds
    (:func:`time_steps`); ``oaken`` also gets ``paired_vs_<method>``: the median step-time ratio over the rounds
    and in how many rounds it was the faster one.

    Args:
        contexts: context lengths in tokens (e.g. ``[1024, 4096, 16384]``).
        methods: any of :data:`METHODS`.
        model: model name for :func:`oakenkv.assets.models.load_model`.
        thresholds: a ``Thresholds`` for the model (required for "oaken").
        steps: timed decode steps per point (the median is reported).
        source_tokens: WikiText-2 tokens of the real prefill whose K/V are tiled to each context.
        batch: rows decoded together (each row's K/V start at another offset of the source).
        residual: the ``oaken`` cache's full-precision window (``OakenCache(residual=...)``; 0: none).
        progress: called with a short message before each point.
    """
    import numba

    from oakenkv.assets.data import load_text, token_windows
    from oakenkv.assets.models import load_model
    from oakenkv.calibrate.identity import kv_shape
    from oakenkv.calibrate.spec import check_positions, max_positions

    for m in methods:
        if m not in METHODS:
            raise ValueError(f"unknown method {m!r}; choose from {METHODS}")
    if len(set(methods)) != len(methods) or not methods:
        raise ValueError(f"methods must be distinct and not empty, got {list(methods)}")
    if "oaken" in methods and thresholds is None:
        raise ValueError("the 'oaken' method needs thresholds")
    if any(c < 1 for c in contexts) or steps < 1 or batch < 1:
        raise ValueError("contexts, steps and batch must be positive")
    loaded = load_model(model)
    source_tokens = min(source_tokens, max_positions(loaded.model) or source_tokens)  # (tiled to the contexts)
    longest = f"a context of {max(contexts)} tokens and {steps} steps"
    check_positions(loaded.model, max(contexts) + steps, longest, "--context", table_only=True)
    ids = token_windows(loaded.tokenizer, load_text("wikitext2"), window=source_tokens, max_windows=1)
    source = record_source_kv(loaded.model, ids)
    cfg = loaded.model.config
    fp32_per_token = 2 * cfg.num_hidden_layers * math.prod(kv_shape(cfg)) * 4
    results: dict[str, dict[str, Any]] = {m: {} for m in methods}
    for context in contexts:
        caches, filled = {}, {}
        for m in methods:
            if progress:
                progress(f"filling {m} @ {context} tokens")
            caches[m], fill_s = fill_cache(m, loaded.model, thresholds, source, context, batch, residual)
            filled[m] = (kv_bytes(caches[m]), fill_s)
        if progress:
            progress(f"timing {', '.join(methods)} @ {context} tokens")
        times = time_steps(loaded.model, caches, steps, batch=batch)
        del caches
        for m in methods:
            r = DecodeResult(m, context, statistics.median(times[m]), tuple(times[m]), *filled[m])
            d = r.to_dict()
            d["fp32_ratio"] = fp32_per_token * context * batch / r.kv_bytes
            results[m][str(context)] = d
        if "oaken" in methods:
            for other in methods:
                if other != "oaken":
                    results["oaken"][str(context)][f"paired_vs_{other}"] = paired(times["oaken"], times[other])
    meta = {
        "model": loaded.name,
        "torch_threads": torch.get_num_threads(),
        "numba_threads": numba.get_num_threads(),
        "steps": steps,
        "batch": batch,
        "oaken_residual": residual,
        "source_tokens": source_tokens,
        "fp32_bytes_per_token": fp32_per_token,
        "note": "context = real prefill K/V of WikiText-2 tiled to length; step = one full model forward; "
        "methods timed in interleaved rounds",
    }
    return {"results": results, "meta": meta, "goals": goals(results, contexts)}


def goals(results: dict[str, dict[str, Any]], contexts: list[int]) -> dict[str, Any]:
    """The issue's goals, evaluated where the needed methods ran."""
    out: dict[str, Any] = {}
    if "oaken" in results and "dynamic" in results:
        c = str(max(contexts))
        o, d = results["oaken"][c], results["dynamic"][c]
        out[f"kv_bytes_ratio_dynamic_over_oaken@{c}"] = d["kv_bytes"] / o["kv_bytes"]
        out["kv_bytes_goal (>= 5.5)"] = d["kv_bytes"] / o["kv_bytes"] >= 5.5
        out[f"step_ratio_oaken_over_dynamic@{c}"] = o["step_ms"] / d["step_ms"]
        out["step_goal (<= 1.5)"] = o["step_ms"] / d["step_ms"] <= 1.5
    if "oaken" in results and "quanto" in results:
        out["faster_than_quanto_at_every_context"] = all(
            results["oaken"][str(c)]["step_ms"] < results["quanto"][str(c)]["step_ms"] for c in contexts
        )
        pairs = [results["oaken"][str(c)].get("paired_vs_quanto") for c in contexts]
        if all(pairs):
            out["faster_than_quanto_paired_at_every_context (median step ratio < 1)"] = all(
                p["median_ratio"] < 1 for p in pairs
            )
    return out


def print_decode_bench(result: dict[str, Any]) -> None:
    """A table of the results: step time and KV bytes per method and context, with ratios to DynamicCache."""
    from rich.console import Console
    from rich.table import Table

    res = result["results"]
    meta = result["meta"]
    table = Table(
        title=f"decode step, {meta['model']} model, batch {meta.get('batch', 1)} (median of {meta['steps']} steps)"
    )
    for col in ("method", "context", "step ms", "x dynamic", "KV MiB", "fp32 / KV"):
        table.add_column(col, justify="right" if col != "method" else "left")
    for method, points in res.items():
        for ctx, p in points.items():
            dyn = res.get("dynamic", {}).get(ctx)
            ratio = f"{p['step_ms'] / dyn['step_ms']:.2f}" if dyn else "-"
            table.add_row(
                method, ctx, f"{p['step_ms']:.1f}", ratio, f"{p['kv_bytes'] / 2**20:.1f}", f"{p['fp32_ratio']:.2f}"
            )
    console = Console()
    console.print(table)
    for ctx, p in res.get("oaken", {}).items():
        for k, v in p.items():
            if k.startswith("paired_vs_"):
                console.print(
                    f"oaken / {k[len('paired_vs_') :]} @ {ctx}: median step ratio {v['median_ratio']:.3f}, "
                    f"faster in {v['faster_steps']} of {v['steps']} rounds"
                )
    for k, v in result.get("goals", {}).items():
        console.print(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}")
