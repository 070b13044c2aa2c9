"""``oakenkv eval``: perplexity, zero-shot tasks, one-pass calibration and reports of KV-cache methods."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from oakenkv.cli._common import (
    MAX_TOKENS,
    MAX_WINDOWS,
    app,
    bad_option,
    calib_spec,
    check_input,
    check_model,
    check_out,
    write_json,
)
from oakenkv.methods.registry import methods_help
from oakenkv.util.numerics import pin_cpu_numerics

eval_app = typer.Typer(
    help="Evaluate KV-cache methods against each other: WikiText-2 perplexity, zero-shot tasks, reports. METHOD is "
    "family[:key=value,...] or an alias. " + methods_help(),
    no_args_is_help=True,
)


app.add_typer(eval_app, name="eval")


@eval_app.command("ppl")
def eval_ppl(
    model: Annotated[
        str, typer.Option(help=("Model: 'default', 'gemma3-270m', a Hugging Face id, a directory or a .gguf path."))
    ] = "default",
    method: Annotated[
        str, typer.Option(help=("Method spec, e.g. 'oaken', 'int4', 'kivi4', 'oaken:outer=0.06,inner=0.09'."))
    ] = "oaken",
    thresholds: Annotated[
        Path | None, typer.Option(help=("Oaken thresholds file (default: profile on the calibration text)."))
    ] = None,
    window: Annotated[int, typer.Option(help="Tokens per window (the paper: 2048).", min=2, max=MAX_TOKENS)] = 2048,
    stride: Annotated[
        int | None, typer.Option(help="Distance between window starts (default: the window).", min=1)
    ] = None,
    max_windows: Annotated[
        int | None, typer.Option(help="Evaluate at most this many windows (default: all).", min=1)
    ] = None,
    chunk: Annotated[
        int | None,
        typer.Option(help=("Feed each window this many tokens per forward call (default: whole window)."), min=1),
    ] = None,
    dataset: Annotated[str, typer.Option(help="Evaluation text (oakenkv.assets.data name).")] = "wikitext2",
    text_file: Annotated[
        Path | None,
        typer.Option(
            help="Evaluate on this text file instead of --dataset (your own text: a regular UTF-8 file, at most "
            "64 MiB; the result records its SHA-256)."
        ),
    ] = None,
    calib_text: Annotated[
        str | None, typer.Option(help="Calibration text for thresholds and baseline ranges (default: wikipedia).")
    ] = None,
    calib_samples: Annotated[
        int | None, typer.Option(help="Calibration windows (default: 16).", min=1, max=MAX_WINDOWS)
    ] = None,
    calib_window: Annotated[
        int | None, typer.Option(help="Tokens per calibration window (default: 256).", min=2, max=MAX_TOKENS)
    ] = None,
    calib_path: Annotated[
        str | None, typer.Option(help=("Path of the calibration text file, if not the packaged one."))
    ] = None,
    json_out: Annotated[
        Path | None,
        typer.Option("--json", help=("Write the result (method, ppl, effective_bits, tokens, windows, ...) here.")),
    ] = None,
    resume: Annotated[
        bool,
        typer.Option(
            help=(
                "With --json OUT: keep OUT's .partial.json checkpoint after every window and resume an interrupted "
                "run from it (same method, model and windows; removed when the run completes)."
            )
        ),
    ] = True,
) -> None:
    """Perplexity on WikiText-2 test windows with every key and value passed through METHOD's cache.

    On x86-64 torch runs its AVX2 kernels on any CPU, so that results agree between machines.

    OAKENKV_NATIVE_NUMERICS=1 keeps the CPU's own kernels; the result records which ran (extra.numerics).
    """
    pin_cpu_numerics()  # the same numbers on every x86-64 CPU (oakenkv.util.numerics)
    from oakenkv.eval.args import check_run_args

    calibration = calib_spec(calib_text, calib_samples, calib_window, calib_path, method=method, thresholds=thresholds)
    if text_file is not None and dataset != "wikitext2":
        raise bad_option("--text-file", "give --text-file or --dataset, not both")
    if text_file is not None:
        from oakenkv.assets.data import load_text_file

        try:
            load_text_file(text_file)  # (read and decoded now: a binary file is refused before the model loads)
        except (OSError, ValueError) as e:
            raise bad_option("--text-file", str(e)) from None
    check_run_args(model, method, thresholds, dataset=dataset, window=window, stride=stride, chunk=chunk)
    check_out(json_out, "--json")
    from oakenkv.eval.ppl import run_ppl

    checkpoint = json_out.with_name(json_out.stem + ".partial.json") if json_out is not None and resume else None
    res = run_ppl(
        model,
        method,
        thresholds=None if thresholds is None else str(thresholds),
        window=window,
        stride=stride,
        max_windows=max_windows,
        chunk=chunk,
        dataset=dataset,
        calibration=calibration,
        checkpoint=checkpoint,
        text_file=text_file,
    )
    typer.echo(f"{res.method}: ppl {res.ppl:.4f} at {res.effective_bits:.3f} bits/value ({res.tokens} tokens)")
    write_json(res.to_dict(), json_out)


@eval_app.command("zeroshot")
def eval_zeroshot(
    model: Annotated[str, typer.Option(help="Model name or path (as for `eval ppl`).")] = "default",
    method: Annotated[str, typer.Option(help="Method spec (as for `eval ppl`).")] = "oaken",
    tasks: Annotated[
        str, typer.Option(help=("Comma-separated tasks: piqa, winogrande, hellaswag."))
    ] = "piqa,winogrande,hellaswag",
    limit: Annotated[int | None, typer.Option(help="Evaluate only the first N documents of each task.", min=1)] = None,
    thresholds: Annotated[Path | None, typer.Option(help="Oaken thresholds file.")] = None,
    calib_text: Annotated[
        str | None, typer.Option(help="Calibration text for thresholds and baseline ranges (default: wikipedia).")
    ] = None,
    calib_samples: Annotated[
        int | None, typer.Option(help="Calibration windows (default: 16).", min=1, max=MAX_WINDOWS)
    ] = None,
    calib_window: Annotated[
        int | None, typer.Option(help="Tokens per calibration window (default: 256).", min=2, max=MAX_TOKENS)
    ] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the result here.")] = None,
) -> None:
    """Zero-shot accuracy (lm-evaluation-harness, local task data) with METHOD's cache."""
    pin_cpu_numerics()  # the same numbers on every x86-64 CPU (oakenkv.util.numerics)
    from oakenkv.eval.args import ZEROSHOT_TASKS, check_run_args

    names = tuple(t.strip() for t in tasks.split(",") if t.strip())
    if not names or any(t not in ZEROSHOT_TASKS for t in names):
        raise bad_option("--tasks", f"give tasks among {', '.join(ZEROSHOT_TASKS)}, got {tasks!r}")
    calibration = calib_spec(calib_text, calib_samples, calib_window, None, method=method, thresholds=thresholds)
    check_run_args(model, method, thresholds)
    check_out(json_out, "--json")
    from oakenkv.eval.zeroshot import run_zeroshot

    res = run_zeroshot(
        model,
        method,
        names,
        thresholds=None if thresholds is None else str(thresholds),
        limit=limit,
        calibration=calibration,
    )
    for t, r in res.tasks.items():
        typer.echo(f"{res.method} {t}: {r['reported_metric']} {r['reported']:.4f}")
    write_json(res.to_dict(), json_out)


@eval_app.command("calibrate")
def eval_calibrate(
    model: Annotated[str, typer.Option(help="Model name or path.")] = "default",
    sweep: Annotated[
        str,
        typer.Option(help=("Comma-separated outlier shares to profile besides the paper's 10% (outer:inner = 4:6).")),
    ] = "0.08,0.12,0.16,0.20",
    calib_text: Annotated[str | None, typer.Option(help="Calibration text (default: wikipedia).")] = None,
    calib_samples: Annotated[
        int | None, typer.Option(help="Calibration windows (default: 16).", min=1, max=MAX_WINDOWS)
    ] = None,
    calib_window: Annotated[
        int | None, typer.Option(help="Tokens per calibration window (default: 256).", min=2, max=MAX_TOKENS)
    ] = None,
    calib_path: Annotated[str | None, typer.Option(help="Path of the calibration text file.")] = None,
) -> None:
    """Profile, in one pass, every Oaken configuration the report uses and the baselines' calibrated ranges."""
    pin_cpu_numerics()  # the same numbers on every x86-64 CPU (oakenkv.util.numerics)
    from oakenkv.format.config import OakenConfig
    from oakenkv.methods.registry import sweep_config

    base = OakenConfig()
    configs = [(base, False), (base, True), (base.replace(key_position="pre_rope"), False)]
    for s in (s.strip() for s in sweep.split(",")):
        if not s:
            continue
        try:
            configs.append((sweep_config(float(s)), False))
        except ValueError as e:
            raise bad_option("--sweep", f"{s!r} is not an outlier share in (0, 1): {e}") from None
    spec = calib_spec(calib_text, calib_samples, calib_window, calib_path)  # (--calib-path: a file, checked)
    check_model(model)
    from oakenkv.assets.models import load_model
    from oakenkv.calibrate.ranges import calibrate_all

    loaded = load_model(model)
    calibrate_all(loaded.model, loaded.tokenizer, model, configs, spec, progress=True)
    typer.echo(f"calibrated {len(configs)} Oaken configurations and the baseline ranges for {model}")


@eval_app.command("report")
def eval_report(
    results: Annotated[list[Path], typer.Argument(help="JSON result files or directories holding them.", exists=True)],
    out: Annotated[
        Path, typer.Option(help="Markdown file to write (default under ./results/, never a tracked file).")
    ] = Path("results/report.md"),
    plot: Annotated[Path, typer.Option(help="Pareto plot (PNG) to write.")] = Path("results/report_pareto.png"),
    header: Annotated[
        Path | None,
        typer.Option(help="Markdown to put before the tables (commands, caveats).", exists=True, dir_okay=False),
    ] = None,
    frontier: Annotated[
        list[Path] | None,
        typer.Option(
            help="A directory of results (one model, one number of windows) whose frontier table and plot lead the "
            "report (repeatable; the plot is written beside --plot, as <name>_frontier.png).",
            exists=True,
        ),
    ] = None,
) -> None:
    """Collect `eval ppl` / `eval zeroshot` JSON results into markdown tables and a perplexity-vs-bits plot."""
    from oakenkv.util.paths import MAX_RESULT_BYTES

    check_input(header, "--header", MAX_RESULT_BYTES)
    if out.resolve() == plot.resolve():
        raise bad_option("--plot", f"{plot} is also the --out file; give two paths")
    from oakenkv.eval.report import load_results, write_report

    loaded = load_results(results)  # every file read and checked before anything is written
    check_out(out, "--out")
    check_out(plot, "--plot")
    if frontier:
        check_out(plot.with_name(plot.stem + "_frontier.png"), "--plot")  # (the frontier's plot, beside it)
    text = write_report(results, out, plot, header, frontier, loaded=loaded)
    drawn = f", {plot.with_name(plot.stem + '_frontier.png')}" if "_frontier.png)" in text else ""
    typer.echo(f"wrote {out}, {plot}{drawn}")
