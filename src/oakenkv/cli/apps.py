"""Commands that run the library on a model: ``info``, ``demo``, ``generate``, ``diagnose``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from oakenkv.cli._common import (
    MAX_TOKENS,
    MAX_WINDOWS,
    ModelOption,
    ResidualOption,
    app,
    bad_option,
    check_input,
    check_model,
    check_out,
    load_thresholds,
    save_output,
    write_json,
)
from oakenkv.util.numerics import pin_cpu_numerics
from oakenkv.util.text import printable


@app.command()
def info() -> None:
    """Print versions, thread counts, and where the default model and each data source were found."""
    from oakenkv.apps.info import print_info

    print_info()


@app.command()
def demo(
    model: ModelOption = "default",
    windows: Annotated[
        int,
        typer.Option(
            help="Number of perplexity windows (WikiText-2's; a held-out part of the packaged Wikipedia text when "
            "WikiText-2 is not found, said when it runs).",
            min=1,
        ),
    ] = 4,
    window: Annotated[int, typer.Option(help="Tokens per perplexity window.", min=2, max=MAX_TOKENS)] = 512,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate greedily.", min=0)] = 32,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the results to this JSON file.")] = None,
    preset: Annotated[
        str,
        typer.Option(
            help="'oaken-plus': offline transforms (docs/plus.md), with the paper's 'oaken' beside it; 'oaken': "
            "the paper's only (no oaken-plus profiling, which takes minutes the first time)."
        ),
    ] = "oaken-plus",
    plus_samples: Annotated[
        int | None,
        typer.Option(help="Calibration windows of the oaken-plus profile (default 16).", min=1, max=MAX_WINDOWS),
    ] = None,
    plus_window: Annotated[
        int | None, typer.Option(help="Tokens per oaken-plus calibration window (default 2048).", min=2, max=MAX_TOKENS)
    ] = None,
) -> None:
    """Run the main job on the default model: perplexity on WikiText-2 windows (or held-out Wikipedia where
    WikiText-2 is not found) and a greedy generation, FP next to oaken-plus and the paper's Oaken."""
    pin_cpu_numerics()  # the same numbers on every x86-64 CPU (oakenkv.util.numerics)
    if preset not in ("oaken", "oaken-plus"):
        raise bad_option("--preset", f"must be 'oaken' or 'oaken-plus', got {preset!r}")
    if preset == "oaken" and (plus_samples is not None or plus_window is not None):
        option = "--plus-samples" if plus_samples is not None else "--plus-window"
        raise bad_option(option, "calibrates the oaken-plus profile, which --preset oaken does not run")
    check_model(model)
    check_out(json_out, "--json")
    from oakenkv.apps.demo import run_demo

    results = run_demo(
        model=model,
        windows=windows,
        window=window,
        max_new_tokens=max_new_tokens,
        preset=preset,
        plus_samples=plus_samples,
        plus_window=plus_window,
    )
    if json_out is not None:
        write_json(results, json_out)


@app.command()
def generate(
    prompt: Annotated[str, typer.Option(help="The prompt (sent through the chat template when there is one).")],
    model: ModelOption = "default",
    thresholds: Annotated[
        Path | None,
        typer.Option(help="Thresholds file from `oakenkv profile` (default: the preset's cached profile)."),
    ] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate.", min=1, max=1_000_000)] = 64,
    sample: Annotated[bool, typer.Option(help="Sample instead of greedy decoding.")] = False,
    chat: Annotated[bool, typer.Option(help="Use the tokenizer's chat template.")] = True,
    fp: Annotated[bool, typer.Option(help="Also generate with the fp32 DynamicCache, for comparison.")] = False,
    preset: Annotated[
        str,
        typer.Option(
            help="'oaken-plus' (offline transforms, docs/plus.md; its profile takes minutes the first time, then "
            "is cached) or 'oaken' (the paper's). A --thresholds file decides this by its kind."
        ),
    ] = "oaken-plus",
    beside: Annotated[
        bool, typer.Option(help="With oaken-plus, also generate with the paper's oaken, for comparison.")
    ] = True,
    residual: ResidualOption = 0,
) -> None:
    """Generate text with the Oaken-quantized KV cache (oaken-plus, the paper's oaken beside it) and print it with
    the bytes the cache holds."""
    if not prompt.strip():
        raise bad_option("--prompt", "the prompt is empty; give some text to continue")
    if preset not in ("oaken", "oaken-plus"):
        raise bad_option("--preset", f"must be 'oaken' or 'oaken-plus', got {preset!r}")
    check_model(model)
    thr_file = load_thresholds(thresholds, model)
    if thr_file is not None:
        preset = "oaken-plus" if thr_file.transforms is not None else "oaken"
    from oakenkv.apps.generate import (
        generate_text,
        load_or_profile_plus,
        load_or_profile_thresholds,
        plus_model,
        size_against,
    )
    from oakenkv.assets.models import load_model

    loaded = load_model(model)
    runs: list[tuple[str, Any, Any]] = []
    if preset == "oaken-plus":
        plus = load_or_profile_plus(loaded, thr_file, progress=True)
        runs.append(("oaken-plus", plus_model(loaded, plus), plus))
        if beside:
            runs.append(("oaken", loaded, load_or_profile_thresholds(loaded, progress=True)))
    else:
        runs.append(("oaken", loaded, load_or_profile_thresholds(loaded, thr_file, progress=True)))
    if fp:
        runs.append(("fp32", loaded, None))
    for name, lm, t in runs:
        g = generate_text(
            lm, prompt, t, max_new_tokens=max_new_tokens, chat=chat, do_sample=sample, residual=residual if t else 0
        )
        typer.echo(f"--- {name} ({g.new_tokens} tokens in {g.seconds:.1f} s)")
        typer.echo(printable(g.text, newlines=True))  # (a model's text may hold escape sequences)
        typer.echo(
            f"KV cache: {g.kv_bytes:,} bytes for {g.prompt_tokens + g.new_tokens - 1} tokens "
            f"(fp32 would hold {g.fp32_kv_bytes:,} bytes: {size_against(g.fp32_kv_bytes, g.kv_bytes)})"
        )


@app.command("diagnose")
def diagnose_cmd(
    model: Annotated[
        str, typer.Option(help="Model: 'default', 'gemma3-270m', a Hugging Face id, a local directory or a .gguf path.")
    ] = "default",
    samples: Annotated[int, typer.Option(help="Calibration windows to record.", min=1, max=MAX_WINDOWS)] = 4,
    window: Annotated[int, typer.Option(help="Tokens per calibration window.", min=2, max=MAX_TOKENS)] = 512,
    plus: Annotated[
        bool,
        typer.Option(
            "--plus/--no-plus",
            help="Profile oaken-plus (its per-layer search is the slow part, minutes; cached after the first run) "
            "to measure it and to say which remedies it uses.",
        ),
    ] = True,
    plus_samples: Annotated[
        int | None,
        typer.Option(
            help="Calibration windows of the oaken-plus profile (default: --samples; the preset uses 16).",
            min=1,
            max=MAX_WINDOWS,
        ),
    ] = None,
    plus_window: Annotated[
        int | None,
        typer.Option(
            help="Tokens per oaken-plus calibration window (default: --window; the preset uses 2048).",
            min=2,
            max=MAX_TOKENS,
        ),
    ] = None,
    calib_text: Annotated[
        str, typer.Option(help="Calibration text: 'wikipedia' (default) or 'wikitext2' (the evaluation text).")
    ] = "wikipedia",
    calib_path: Annotated[
        Path | None, typer.Option(help="Calibrate on this plain UTF-8 text file instead (overrides --calib-text).")
    ] = None,
    json_out: Annotated[
        Path | None, typer.Option("--json", help="Write the whole diagnosis to this JSON file.")
    ] = None,
    png: Annotated[
        Path | None,
        typer.Option(help="Write a heat map (channels x layers of key and value magnitude) to this PNG file."),
    ] = None,
    threads: Annotated[
        int | None, typer.Option(help="torch CPU threads (default: torch's choice; 1 is faster on a busy machine).")
    ] = None,
) -> None:
    """Diagnose a model's keys and values: per layer, how concentrated Oaken's outer-group values are in a few
    channels, channel magnitudes and offsets before and after RoPE, each method's reconstruction SQNR, and a
    verdict: fixed-channel key outliers or not, key offsets or not, and which remedies oaken-plus uses."""
    from oakenkv.calibrate.spec import CalibrationSpec  # (not calibrate.profile: the checks come before torch)

    # the user's mistakes, before any slow work (one `error:` line each, exit code 2: see run())
    check_input(calib_path, "--calib-path", text=True)
    if calib_path is None and calib_text not in ("wikipedia", "wikitext2"):
        raise bad_option("--calib-text", f"must be 'wikipedia' or 'wikitext2', got {calib_text!r}")
    text, path = ("file", str(calib_path)) if calib_path is not None else (calib_text, None)
    try:
        spec = CalibrationSpec(text, samples, window, path)
        plus_spec = CalibrationSpec(text, plus_samples or samples, plus_window or window, path)
    except ValueError as e:
        raise bad_option("--samples/--window", str(e)) from e
    if threads is not None and threads < 1:
        raise bad_option("--threads", f"must be at least 1, got {threads}")
    if png is not None:
        if png.suffix.lower() != ".png":
            raise bad_option("--png", f"must name a .png file, got {png}")
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:  # (found, not imported: the checks come before torch)
            raise bad_option("--png", "the plot needs matplotlib: pip install 'oakenkv[eval]' (or leave out --png)")
    check_model(model)
    check_out(json_out, "--json")
    check_out(png, "--png")
    from oakenkv.apps.diagnose import diagnose_model
    from oakenkv.apps.diagnose_report import plot_diagnosis, print_diagnosis

    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    diag = diagnose_model(model, spec, plus=plus, plus_spec=plus_spec, progress=True)
    print_diagnosis(diag)
    if json_out is not None:  # (without it the report above is the output, not 20,000 lines of JSON after it)
        write_json(diag.to_dict(), json_out)
    if png is not None:
        typer.echo(f"wrote {save_output(png, lambda p: plot_diagnosis(diag, p), '--png')}")
