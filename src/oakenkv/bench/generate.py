"""End-to-end generation benchmark: ``model.generate`` tokens/s, prefill and decode apart, for OakenCache and the
transformers caches it replaces (``oakenkv bench generate``).

Methods (as :mod:`oakenkv.bench.decode`): ``oaken`` (:class:`~oakenkv.hf.cache.OakenCache` with the packed-page
decode attention), ``dynamic`` (transformers' ``DynamicCache``, fp32, SDPA) and ``quanto``
(``QuantizedCache(backend="quanto", nbits=4)``, transformers' defaults, SDPA). Each runs as a user would run
it: only ``oaken`` switches the model to the ``"oaken"`` attention.

A point is a prompt length ``P`` and a batch ``B``: ``B`` distinct windows of ``P`` WikiText-2 tokens, greedy,
exactly ``new_tokens`` new tokens (end of sequence ignored). Timing comes from
:func:`oakenkv.apps.generate.timed_generate` (the demo's too): the prefill (call to first new token) and each
decode step. Rounds are interleaved as in ``bench decode``: round ``r`` runs one ``generate`` of every method,
the starting method rotating, each with a fresh cache, so that the drifting load of a shared machine hits every
method alike; ``oaken`` reports per-round ratios to every other method (median, and rounds won). Before the
timed rounds every method runs one untimed generate of two tokens (numba kernels loaded, memory allocated): on
the whole prompt up to ``WARMUP_FULL_TOKENS`` prompt tokens in all rows, on its first 16 tokens above that (a
fresh process's first prefill of a size pays the allocator's page faults, a visible share of a short prompt's
prefill: docs/notebook/perf-notes.md; for a 16K prompt a full warm-up would cost minutes). KV bytes are
counted after the generation (``oakenkv.hf.cache.kv_bytes``: pages in use plus tables for OakenCache, tensor
storage for the others). The greedy tokens are compared with ``dynamic``'s (the fraction of equal new tokens).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from oakenkv.bench.decode import METHODS, make_cache
from oakenkv.hf.attention import load_kernels

#: The issue's grid.
DEFAULT_PROMPTS = (128, 1024, 4096, 16384)
DEFAULT_BATCHES = (1, 8)

Progress = Callable[[int, int, str], None]


def _ratio_stats(a: list[float], b: list[float]) -> dict[str, Any]:
    """Per-round ratios ``a_i / b_i``: median, rounds where the ratio is > 1, rounds."""
    ratios = [x / y for x, y in zip(a, b, strict=True)]
    return {"median": statistics.median(ratios), "above_1": sum(r > 1 for r in ratios), "rounds": len(ratios)}


def paired_vs(mine: list[dict[str, Any]], other: list[dict[str, Any]]) -> dict[str, Any]:
    """``oaken`` against another method over the same rounds: tokens/s ratios (above 1: oaken faster)."""
    return {
        "tokens_per_s_ratio": _ratio_stats([r["tokens_per_s"] for r in mine], [r["tokens_per_s"] for r in other]),
        "prefill_tokens_per_s_ratio": _ratio_stats(
            [r["prefill_tokens_per_s"] for r in mine], [r["prefill_tokens_per_s"] for r in other]
        ),
    }


#: Warm-up on the whole prompt up to this many prompt tokens (all rows); above, on its first 16 tokens.
WARMUP_FULL_TOKENS = 8192


def _prompt_ids(tokenizer: Any, prompt: int, batch: int) -> torch.Tensor:
    from oakenkv.assets.data import load_text, token_windows

    ids = token_windows(tokenizer, load_text("wikitext2"), window=prompt, max_windows=batch)
    if ids.shape[0] < batch:
        raise ValueError(f"WikiText-2 holds only {ids.shape[0]} windows of {prompt} tokens; batch {batch} needs more")
    return ids


def _generate(
    model: Any, method: str, thresholds: Any, ids: torch.Tensor, new_tokens: int, pad: int, residual: int = 0
):
    from oakenkv.apps.generate import timed_generate
    from oakenkv.hf.attention import oaken_attention
    from oakenkv.hf.cache import kv_bytes

    cache = make_cache(method, model, thresholds, residual)
    ctx = oaken_attention(model) if method == "oaken" else contextlib.nullcontext()
    with ctx:
        out, timing = timed_generate(
            model, ids, cache, max_new_tokens=new_tokens, exact_length=True, do_sample=False, pad_token_id=pad
        )
    return out[:, ids.shape[1] :], timing, kv_bytes(cache)


def run_generate_bench(
    prompts: list[int] | tuple[int, ...] = DEFAULT_PROMPTS,
    batches: list[int] | tuple[int, ...] = DEFAULT_BATCHES,
    methods: list[str] | tuple[str, ...] = METHODS,
    *,
    model: str = "default",
    thresholds: Any = None,
    new_tokens: int = 64,
    rounds: int = 3,
    points: list[tuple[int, int]] | None = None,
    residual: int = 0,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Time ``model.generate`` for every method at every (prompt, batch) point.

    Args:
        prompts, batches: the grid (every prompt length with every batch size), unless ``points`` lists the
            ``(prompt, batch)`` pairs to run.
        methods: any of ``oaken``, ``dynamic``, ``quanto`` (distinct).
        thresholds: a ``Thresholds`` for the model (required for ``oaken``).
        new_tokens: tokens generated per row (at least 2: one prefill, then decode steps).
        rounds: timed generates per method and point.
        residual: the ``oaken`` cache's full-precision window (``OakenCache(residual=...)``; 0: none).
        progress: called as ``progress(done, total, message)`` before each generate.

    Returns:
        ``{"results": {method: {"<P>x<B>": {...}}}, "meta": {...}, "goals": {...}}``; a point holds the medians
        over rounds of ``tokens_per_s`` (decode), ``prefill_s``, ``prefill_tokens_per_s``, ``decode_step_ms``,
        ``kv_bytes``, every round's figures, and for ``oaken`` ``paired_vs_<method>``.
    """
    import numba

    from oakenkv.assets.models import load_model
    from oakenkv.calibrate.spec import check_positions

    methods = list(methods)
    for m in methods:
        if m not in METHODS:
            raise ValueError(f"unknown method {m!r}; choose from {', '.join(METHODS)}")
    if not methods or len(set(methods)) != len(methods):
        raise ValueError(f"methods must be distinct and not empty, got {methods}")
    if "oaken" in methods and thresholds is None:
        raise ValueError("the 'oaken' method needs thresholds")
    grid = list(points) if points is not None else [(p, b) for p in prompts for b in batches]
    if not grid or any(p < 1 or b < 1 for p, b in grid):
        raise ValueError(f"prompt lengths and batch sizes must be positive, got {grid}")
    if new_tokens < 2 or rounds < 1:
        raise ValueError(f"need new_tokens >= 2 and rounds >= 1, got {new_tokens} and {rounds}")
    load_start = os.getloadavg()  # a shared machine: the load is part of the result
    loaded = load_model(model)
    longest = max(p for p, _ in grid)
    check_positions(loaded.model, longest + new_tokens, f"a prompt of {longest} tokens and {new_tokens} new tokens")
    tok = loaded.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    total = len(grid) * (rounds + 1) * len(methods)
    done = 0

    def tick(message: str) -> None:
        nonlocal done
        if progress:
            progress(done, total, message)
        done += 1

    results: dict[str, dict[str, Any]] = {m: {} for m in methods}
    for prompt, batch in grid:
        ids = _prompt_ids(tok, prompt, batch)
        key = f"{prompt}x{batch}"
        warm = ids if prompt * batch <= WARMUP_FULL_TOKENS else ids[:, : min(prompt, 16)]
        for m in methods:  # warm-up: kernels loaded, allocator primed (not timed)
            tick(f"{key}: warm-up {m}")
            _generate(loaded.model, m, thresholds, warm, 2, pad, residual)
            if m == "oaken":
                load_kernels()  # the multi-threaded kernel too, which only long contexts take
        per_round: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
        tokens: dict[str, torch.Tensor] = {}
        for r in range(rounds):
            for k in range(len(methods)):
                m = methods[(r + k) % len(methods)]
                tick(f"{key}: round {r + 1}/{rounds}, {m}")
                new, timing, nbytes = _generate(loaded.model, m, thresholds, ids, new_tokens, pad, residual)
                per_round[m].append({**timing.to_dict(), "kv_bytes": nbytes})
                tokens.setdefault(m, new)
        for m in methods:
            rs = per_round[m]
            point = {
                "prompt": prompt,
                "batch": batch,
                "new_tokens": new_tokens,
                "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
                "prefill_s": statistics.median(r["prefill_s"] for r in rs),
                "prefill_tokens_per_s": statistics.median(r["prefill_tokens_per_s"] for r in rs),
                "decode_step_ms": statistics.median(r["decode_step_ms"] for r in rs),
                "kv_bytes": rs[-1]["kv_bytes"],
                "rounds": rs,
            }
            if "dynamic" in tokens and m != "dynamic":
                point["tokens_equal_to_dynamic"] = float((tokens[m] == tokens["dynamic"]).float().mean())
            results[m][key] = point
        if "oaken" in methods:
            for other in methods:
                if other != "oaken":
                    results["oaken"][key][f"paired_vs_{other}"] = paired_vs(per_round["oaken"], per_round[other])
    if progress:
        progress(total, total, "done")
    meta = {
        "model": loaded.name,
        "torch_threads": torch.get_num_threads(),
        "numba_threads": numba.get_num_threads(),
        "new_tokens": new_tokens,
        "rounds": rounds,
        "oaken_residual": residual,
        "points": [f"{p}x{b}" for p, b in grid],
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "loadavg_1_5_15min": {"start": list(load_start), "end": list(os.getloadavg())},
        "cpus": os.cpu_count(),
        "note": "prompt = WikiText-2 windows; greedy, exactly new_tokens tokens; tokens_per_s = decode tokens "
        "(all rows) per second after the first new token; prefill_s = call to first new token; medians over "
        "interleaved rounds; paired ratios > 1 mean oaken is faster",
    }
    return {"results": results, "meta": meta, "goals": goals(results)}


def goals(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Issue 22's goals, evaluated on the paired ratios where the needed methods ran."""
    out: dict[str, Any] = {}
    oaken = results.get("oaken", {})
    for other, name in (("dynamic", "dynamic"), ("quanto", "quanto")):
        pts = {k: p[f"paired_vs_{other}"] for k, p in oaken.items() if f"paired_vs_{other}" in p}
        if not pts:
            continue
        dec = {k: v["tokens_per_s_ratio"]["median"] for k, v in pts.items()}
        if other == "dynamic":
            out["decode >= 1.0x dynamic at every point"] = all(r >= 1.0 for r in dec.values())
            out["prefill >= 0.9x dynamic at every point"] = all(
                v["prefill_tokens_per_s_ratio"]["median"] >= 0.9 for v in pts.values()
            )
            for k, r in dec.items():
                p, b = (int(x) for x in k.split("x"))
                if p >= 16384:
                    want = 1.5 if b == 1 else 2.5
                    out[f"decode >= {want}x dynamic at {k}"] = r >= want
        else:
            out["decode faster than quanto at every point"] = all(r > 1.0 for r in dec.values())
        out[f"decode_ratio_vs_{name}"] = dec
    return out


def print_generate_bench(result: dict[str, Any], console: Any = None) -> None:
    """A table: decode tokens/s, prefill time, KV bytes per method and point, with oaken's paired ratios."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    meta = result["meta"]
    table = Table(
        title=f"model.generate, {meta['model']} model, {meta['new_tokens']} new tokens, median of "
        f"{meta['rounds']} rounds, {meta['torch_threads']} threads"
    )
    for col in ("point (P x B)", "method", "decode tok/s", "step ms", "prefill s", "prefill tok/s", "KV MiB"):
        table.add_column(col, justify="left" if col in ("method", "point (P x B)") else "right")
    for method, points in result["results"].items():
        for key, p in points.items():
            table.add_row(
                key,
                method,
                f"{p['tokens_per_s']:.1f}",
                f"{p['decode_step_ms']:.1f}",
                f"{p['prefill_s']:.2f}",
                f"{p['prefill_tokens_per_s']:.0f}",
                f"{p['kv_bytes'] / 2**20:.1f}",
            )
    console.print(table)
    for key, p in result["results"].get("oaken", {}).items():
        for k, v in p.items():
            if k.startswith("paired_vs_"):
                d, f = v["tokens_per_s_ratio"], v["prefill_tokens_per_s_ratio"]
                console.print(
                    f"oaken / {k[len('paired_vs_') :]} @ {key}: decode tok/s x{d['median']:.3f} "
                    f"(faster in {d['above_1']} of {d['rounds']} rounds), prefill tok/s x{f['median']:.3f}"
                )
    for k, v in result.get("goals", {}).items():
        if not isinstance(v, dict):
            console.print(f"{k}: {v}")
