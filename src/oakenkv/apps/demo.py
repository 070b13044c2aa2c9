"""``oakenkv demo``: the end-to-end run on the embedded default model, FP next to ``oaken-plus`` and the paper's
``oaken``.

FP side: perplexity on a few WikiText-2 windows and a short greedy generation with transformers' fp32 cache.
Each Oaken side (``oakenkv.apps.generate.oaken_demo_side``): its profile (cached on disk after the first run; for
``oaken-plus`` the offline transforms are folded into a copy of the model, docs/plus.md), perplexity of the same
windows through the paged OakenCache, the bits per stored value (format, and with page overhead), KV bytes, and the
same greedy generation with the packed-page attention. ``preset="oaken"`` runs the paper's side only.
:func:`run_demo` returns a plain dict (also written as JSON with ``--json``).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from oakenkv.util.numerics import cpu_numerics
from oakenkv.util.paths import atomic_write
from oakenkv.util.text import markup_safe, printable

__all__ = ["DEMO_PROMPT", "demo_text", "run_demo", "window_nll"]

#: Prompt of the greedy generation (sent through the chat template when the tokenizer has one).
DEMO_PROMPT = "What does the key-value cache of a transformer store? Answer in two sentences."


#: Label of each evaluation text in the demo's table and JSON.
_TEXT_LABELS = {"wikitext2": "WikiText-2", "wikipedia-heldout": "held-out Wikipedia"}


def demo_text() -> tuple[str, str]:
    """``(name, text)`` the demo scores: WikiText-2's test split when it is found (``oakenkv.assets.data``), else
    the held-out part of the packaged Wikipedia excerpt, which installs with the package and is never part of the
    calibration text: so that a clone of the repository alone runs the demo to the end."""
    from oakenkv.assets.data import DataNotFoundError, load_text

    try:
        return "wikitext2", load_text("wikitext2")
    except DataNotFoundError:
        return "wikipedia-heldout", load_text("wikipedia-heldout")


def window_nll(model: Any, windows: Any) -> tuple[float, int]:
    """Summed next-token negative log-likelihood of each window, scored independently.

    Args:
        model: a transformers causal LM.
        windows: int64 token ids ``[num_windows, window]`` (see :func:`oakenkv.assets.data.token_windows`).

    Returns:
        ``(total_nll_nats, predicted_tokens)`` for one batch of windows; perplexity is
        ``exp(total_nll / predicted_tokens)``. Each window predicts ``window - 1`` tokens (the first has no
        context).
    """
    import torch

    if windows.dtype != torch.int64 or windows.dim() != 2 or windows.shape[1] < 2:
        raise ValueError(
            f"windows must be int64 [num_windows, window >= 2], got {windows.dtype} {tuple(windows.shape)}"
        )
    with torch.inference_mode():  # (the last token is only a target, as in `oakenkv eval ppl`)
        logits = model(input_ids=windows[:, :-1], use_cache=False).logits  # [B, S-1, vocab]
        logp = torch.log_softmax(logits.float(), dim=-1)
        nll = -logp.gather(-1, windows[:, 1:, None]).squeeze(-1)  # [B, S-1]
    return float(nll.sum()), nll.numel()


def run_demo(
    model: str = "default",
    windows: int = 4,
    window: int = 512,
    max_new_tokens: int = 32,
    json_out: str | Path | None = None,
    *,
    preset: str = "oaken-plus",
    plus_samples: int | None = None,
    plus_window: int | None = None,
    quiet: bool = False,
) -> dict[str, Any]:
    """Load a model, report FP perplexity on WikiText-2 windows (:func:`demo_text`) and a greedy generation.

    Args:
        model: model name for :func:`oakenkv.assets.models.load_model` (``"default"``: embedded SmolLM2-135M).
        windows: number of non-overlapping WikiText-2 test windows to score.
        window: tokens per window.
        max_new_tokens: tokens to generate greedily after :data:`DEMO_PROMPT`.
        json_out: also write the returned dict to this JSON file.
        preset: ``"oaken-plus"`` (default: oaken-plus, with the paper's ``oaken`` beside it) or ``"oaken"`` (the
            paper's only).
        plus_samples, plus_window: calibration windows and tokens per window of the oaken-plus profile (default:
            the preset's 16 x 2048).
        quiet: print nothing (the dict is still returned).

    Returns:
        ``{"model", "source", "config", "numerics", "fp": {"perplexity", "nll", "tokens", "seconds"},
        "generation": {...}, "oaken": {...}, "oaken_generation": {...}, "oaken_plus": {...},
        "oaken_plus_generation": {...}, "timings": {...}}`` (the ``oaken_plus`` entries with
        ``preset="oaken-plus"`` only).
    """
    if preset not in ("oaken", "oaken-plus"):
        raise ValueError(f"preset must be 'oaken' or 'oaken-plus', got {preset!r}")
    if windows < 1 or window < 2 or max_new_tokens < 0:
        raise ValueError(
            f"need windows >= 1, window >= 2, max_new_tokens >= 0; got {windows}, {window}, {max_new_tokens}"
        )
    import torch
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table
    from rich.text import Text
    from transformers.utils import logging as hf_logging

    from oakenkv.assets.data import token_windows
    from oakenkv.assets.models import load_model
    from oakenkv.calibrate.identity import kv_shape
    from oakenkv.calibrate.spec import check_positions

    console = Console(quiet=quiet)
    # transformers' own per-tensor "Loading weights" bar would interleave with ours.
    hf_logging.disable_progress_bar()
    timings: dict[str, float] = {}

    t0 = time.perf_counter()
    with console.status(f"Loading model {markup_safe(repr(model))} (the first time converts the GGUF, once)..."):
        lm = load_model(model)
    timings["load_model_s"] = time.perf_counter() - t0
    check_positions(lm.model, window, f"windows of {window} tokens", "--window {most} or less")
    cfg = lm.model.config
    console.print(
        f"Loaded [bold]{markup_safe(model)}[/bold] ({type(lm.model).__name__}) from {markup_safe(lm.source)} in "
        f"{timings['load_model_s']:.1f} s"
    )

    t0 = time.perf_counter()
    text_name, text = demo_text()
    label = _TEXT_LABELS[text_name]
    if text_name != "wikitext2":
        console.print(
            "WikiText-2 was not found (see `oakenkv info`); scoring the held-out part of the packaged Wikipedia "
            "excerpt instead (never calibrated on; its perplexities are not WikiText-2's)"
        )
    ids = token_windows(lm.tokenizer, text, window, max_windows=windows)
    timings["tokenize_s"] = time.perf_counter() - t0

    total_nll, total_tokens = 0.0, 0
    t0 = time.perf_counter()
    with Progress(
        TextColumn(f"FP perplexity on {label}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as progress:
        task = progress.add_task("ppl", total=ids.shape[0])
        for row in ids:
            nll, n = window_nll(lm.model, row[None])
            total_nll += nll
            total_tokens += n
            progress.advance(task)
    ppl_s = time.perf_counter() - t0
    ppl = math.exp(total_nll / total_tokens)

    generation = _greedy_generation(lm, max_new_tokens, console) if max_new_tokens > 0 else None

    # The Oaken side (profile or cached profile, perplexity through the paged 4.8-bit cache, generation).
    from oakenkv.apps.generate import oaken_demo_side, size_against

    plus = None
    if preset == "oaken-plus":
        plus = oaken_demo_side(
            lm,
            ids,
            DEMO_PROMPT,
            max_new_tokens,
            console=console,
            preset="oaken-plus",
            plus_samples=plus_samples,
            plus_window=plus_window,
        )
        timings["plus_profile_s"] = plus["profile_s"]
    oaken = oaken_demo_side(lm, ids, DEMO_PROMPT, max_new_tokens, console=console)
    timings["profile_s"] = oaken["profile_s"]

    results: dict[str, Any] = {
        "model": model,
        "source": lm.source,
        "architecture": type(lm.model).__name__,
        "config": {
            "num_layers": cfg.num_hidden_layers,
            **dict(zip(("num_kv_heads", "head_dim"), kv_shape(cfg), strict=True)),
            "dtype": str(next(lm.model.parameters()).dtype).removeprefix("torch."),
        },
        "data": {"text": text_name, "windows": int(ids.shape[0]), "window": window},
        "numerics": cpu_numerics(),  # torch's CPU kernels: the numbers depend on them (oakenkv.util.numerics)
        "fp": {"perplexity": ppl, "nll": total_nll, "tokens": total_tokens, "seconds": ppl_s},
        "generation": generation,
        "oaken": oaken["oaken"],
        "oaken_generation": oaken.get("oaken_generation"),
        **(
            {"oaken_plus": plus["oaken"], "oaken_plus_generation": plus.get("oaken_generation")}
            if plus is not None
            else {}
        ),
        "timings": timings,
        "torch_threads": torch.get_num_threads(),
    }

    table = Table(title="oakenkv demo", title_justify="left")
    table.add_column("cache")
    table.add_column(f"{label} perplexity ({ids.shape[0]} x {window} tokens)", justify="right")
    table.add_column("tokens/s (scoring)", justify="right")
    table.add_column("KV bits/value (format; with pages)", justify="right")
    table.add_column("KV bytes per window", justify="right")
    fp32_bytes = oaken["oaken"]["fp32_kv_bytes_per_window"]
    table.add_row("FP (full precision)", f"{ppl:.3f}", f"{total_tokens / ppl_s:,.0f}", "32", f"{fp32_bytes:,}")
    sides = [("oaken-plus (paged, packed)", plus)] if plus is not None else []
    sides.append(("Oaken, the paper's (paged, packed)", oaken))
    for label, side in sides:
        o = side["oaken"]
        table.add_row(
            label,
            f"{o['perplexity']:.3f}",
            f"{o['tokens'] / o['seconds']:,.0f}",
            f"{o['bits_per_value']['format']:.2f}; {o['bits_per_value']['with_pages']:.2f}",
            f"{o['kv_bytes_per_window']:,} ({size_against(fp32_bytes, o['kv_bytes_per_window'])})",
        )
    console.print(table)
    if generation is not None:
        console.print(Text.assemble(("Prompt: ", "bold"), printable(generation["prompt"], newlines=True)))
        console.print(
            Text.assemble(
                (f"Greedy ({generation['new_tokens']} tokens, {_rate(generation)}): ", "bold"),
                printable(generation["text"], newlines=True),
            )
        )
    for name, side in (("oaken-plus", plus), ("Oaken", oaken)):
        og = side.get("oaken_generation") if side is not None else None
        if og is not None:
            head = (
                f"{name} greedy ({og['new_tokens']} tokens, {_rate(og)}, KV "
                f"{og['kv_bytes']:,} B vs fp32 {og['fp32_kv_bytes']:,} B): "
            )
            console.print(Text.assemble((head, "bold"), printable(og["text"].strip(), newlines=True)))

    if json_out is not None:
        out = atomic_write(json_out, json.dumps(results, indent=2) + "\n")
        console.print("Results written to " + printable(out), markup=False)
    return results


def _rate(g: dict[str, Any]) -> str:
    """``"12.3 tok/s decode, prefill 45 ms"`` from a generation's timing
    (``oakenkv.apps.generate.GenerationTiming``)."""
    rate = g["tokens_per_s"]
    decode = f"{rate:.1f} tok/s decode, " if rate == rate else ""  # NaN with a single new token
    return f"{decode}prefill {1e3 * g['prefill_s']:.0f} ms"


def _greedy_generation(lm: Any, max_new_tokens: int, console: Any) -> dict[str, Any]:
    """Greedy decoding of :data:`DEMO_PROMPT` with transformers' full-precision (fp32) ``DynamicCache``, timed as
    the Oaken side is (``oakenkv.apps.generate.timed_generate``)."""

    tok = lm.tokenizer
    if getattr(tok, "chat_template", None):
        prompt_ids = tok.apply_chat_template(
            [{"role": "user", "content": DEMO_PROMPT}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )["input_ids"]
    else:
        prompt_ids = tok(DEMO_PROMPT, return_tensors="pt")["input_ids"]
    from transformers import DynamicCache

    from oakenkv.apps.generate import timed_generate

    with console.status(f"Generating {max_new_tokens} tokens greedily..."):
        out, timing = timed_generate(
            lm.model,
            prompt_ids,
            DynamicCache(config=lm.model.config),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
        )
    new = out[0, prompt_ids.shape[1] :]
    return {
        "prompt": DEMO_PROMPT,
        "text": tok.decode(new, skip_special_tokens=True).strip(),
        "new_tokens": int(new.numel()),
        "token_ids": new.tolist(),
        "seconds": timing.total_s,
        **{k: v for k, v in timing.to_dict().items() if k in _TIMING_KEYS},
    }


#: What the demo's JSON keeps of a GenerationTiming.
_TIMING_KEYS = ("prefill_s", "decode_step_ms", "tokens_per_s", "step_ms")
