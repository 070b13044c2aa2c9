"""The ``oakenkv`` command line. Thin: each command parses its arguments and calls the library.

Commands import their library modules inside the function body so that ``oakenkv --help`` stays fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(
    name="oakenkv",
    help="Oaken KV-cache quantization (ISCA 2025): profile thresholds, quantize the KV cache of a transformers "
    "model into a fused dense-and-sparse 4.8-bit format, evaluate it against its peers and simulate the "
    "Oaken accelerator.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.command()
def info() -> None:
    """Print versions, thread counts, and where the default model and each data source were found."""
    from oakenkv.report_info import print_info

    print_info()


@app.command()
def demo(
    model: Annotated[
        str, typer.Option(help="Model: 'default', a Hugging Face id, a local directory or a .gguf path.")
    ] = "default",
    windows: Annotated[int, typer.Option(help="Number of WikiText-2 windows for perplexity.")] = 4,
    window: Annotated[int, typer.Option(help="Tokens per perplexity window.")] = 512,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate greedily.")] = 32,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the results to this JSON file.")] = None,
) -> None:
    """Run the main job on the default model: perplexity on WikiText-2 windows and a greedy generation."""
    from oakenkv.demo import run_demo

    run_demo(model=model, windows=windows, window=window, max_new_tokens=max_new_tokens, json_out=json_out)


@app.command()
def generate(
    prompt: Annotated[str, typer.Option(help="The prompt (sent through the chat template when there is one).")],
    model: Annotated[
        str, typer.Option(help="Model: 'default', a Hugging Face id, a local directory or a .gguf path.")
    ] = "default",
    thresholds: Annotated[
        Path | None,
        typer.Option(help="Thresholds file from `oakenkv profile` (default: a cached 16-window profile)."),
    ] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate.")] = 64,
    sample: Annotated[bool, typer.Option(help="Sample instead of greedy decoding.")] = False,
    chat: Annotated[bool, typer.Option(help="Use the tokenizer's chat template.")] = True,
    fp: Annotated[bool, typer.Option(help="Also generate with the fp32 DynamicCache, for comparison.")] = False,
) -> None:
    """Generate text with the Oaken-quantized KV cache and print it with the bytes the cache holds."""
    from oakenkv.generation import generate_text, load_or_profile_thresholds
    from oakenkv.models import load_model

    loaded = load_model(model)
    thr = load_or_profile_thresholds(loaded, thresholds, progress=True)
    runs = [("oaken", thr)] + ([("fp32", None)] if fp else [])
    for name, t in runs:
        g = generate_text(loaded, prompt, t, max_new_tokens=max_new_tokens, chat=chat, do_sample=sample)
        typer.echo(f"--- {name} ({g.new_tokens} tokens in {g.seconds:.1f} s)")
        typer.echo(g.text)
        typer.echo(
            f"KV cache: {g.kv_bytes:,} bytes for {g.prompt_tokens + g.new_tokens - 1} tokens "
            f"(fp32 would hold {g.fp32_kv_bytes:,} bytes: {g.fp32_kv_bytes / g.kv_bytes:.2f}x)"
        )


@app.command()
def simulate(
    model: Annotated[str, typer.Option(help="Model shape, e.g. llama2-7b, llama2-13b, mixtral-8x7b.")] = "llama2-7b",
    systems: Annotated[
        str,
        typer.Option(
            help="Comma-separated systems: vllm-a100, vllm-2xa100, lpu-hbm, lpu-lpddr, "
            "oaken-hbm, oaken-lpddr, oaken-hybrid."
        ),
    ] = "vllm-a100,lpu-lpddr,oaken-lpddr,oaken-hbm",
    batch: Annotated[str, typer.Option(help="Comma-separated batch sizes.")] = "16,32,64,128,256",
    input_len: Annotated[int, typer.Option("--input", help="Prompt tokens per request.")] = 1024,
    output_len: Annotated[int, typer.Option("--output", help="Generated tokens per request.")] = 1024,
    kv_format: Annotated[
        str | None, typer.Option(help="Override every system's KV format (fp16, oaken, kivi, qserve, ...).")
    ] = None,
    seq_lens: Annotated[
        str | None,
        typer.Option(
            help="Also sweep these total sequence lengths (split evenly into input and "
            "output) at the largest batch; needed for --plot-seq."
        ),
    ] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the results to this JSON file.")] = None,
    plot: Annotated[Path | None, typer.Option(help="Save a plot of throughput against batch (PNG).")] = None,
    plot_seq: Annotated[
        Path | None, typer.Option(help="Save a plot of throughput against sequence length (PNG).")
    ] = None,
    paper: Annotated[
        bool, typer.Option("--paper", help="Print the Figure 11 and Figure 5(b) comparison with the paper.")
    ] = False,
    trace: Annotated[
        str | None,
        typer.Option(
            help="Also run a synthetic trace with sampled lengths: 'conversation' or 'bursty' "
            "(see docs/sim.md); the largest --batch caps the running batch."
        ),
    ] = None,
    requests: Annotated[int, typer.Option(help="Requests in the --trace.")] = 500,
    rate: Annotated[
        float | None, typer.Option(help="Mean arrival rate of the --trace in requests/s (default: all at once).")
    ] = None,
    seed: Annotated[int, typer.Option(help="Random seed of the --trace.")] = 0,
) -> None:
    """Simulate end-to-end serving throughput of the Oaken accelerator and its baselines (no GPU needed)."""
    from oakenkv.sim import report

    if paper:
        report.print_paper_comparison()
        return
    names = [s.strip() for s in systems.split(",") if s.strip()]
    batches = report.parse_int_list(batch, "--batch")
    results = report.batch_sweep(model, names, batches, input_len, output_len, kv_format)
    report.print_results(results, f"{model}, {input_len}:{output_len} tokens")
    data = {"model": model, "input_len": input_len, "output_len": output_len, **report.payload(results)}
    if seq_lens:
        lens = report.parse_int_list(seq_lens, "--seq-lens")
        by_len = report.length_sweep(model, names, max(batches), lens, kv_format)
        report.print_results(by_len, f"{model}, batch {max(batches)}")
        data["by_sequence_length"] = report.payload(by_len)["results"]
    if trace is not None:
        runs = report.trace_runs(model, names, trace, requests, rate, seed, max(batches))
        report.print_trace_results(runs, f"{model}, {trace} trace, {requests} requests")
        data["trace"] = {
            "kind": trace,
            "requests": requests,
            "rate": rate,
            "seed": seed,
            "results": {r.system: r.to_dict() for r in runs},
        }
    if json_out is not None:
        typer.echo(f"wrote {report.write_json(data, json_out)}")
    if plot is not None:
        from oakenkv.sim.plots import plot_vs_batch

        typer.echo(f"wrote {plot_vs_batch(results, plot)}")
    if plot_seq is not None:
        if not seq_lens:
            raise typer.BadParameter("--plot-seq needs --seq-lens")
        from oakenkv.sim.plots import plot_vs_length

        typer.echo(f"wrote {plot_vs_length(by_len, plot_seq)}")


@app.command()
def advise(
    model: Annotated[str, typer.Option(help="Model shape, e.g. llama2-13b.")] = "llama2-13b",
    batch: Annotated[int, typer.Option(help="Concurrent requests to serve.")] = 64,
    input_len: Annotated[int, typer.Option("--input", help="Prompt tokens per request.")] = 1024,
    output_len: Annotated[int, typer.Option("--output", help="Generated tokens per request.")] = 1024,
    min_tokens_per_s: Annotated[
        float | None, typer.Option(help="Throughput goal (generated tokens/s, end to end).")
    ] = None,
    min_context: Annotated[
        int | None, typer.Option(help="Context goal: tokens each of the batch's sequences must reach.")
    ] = None,
    systems: Annotated[str, typer.Option(help="Comma-separated candidate systems.")] = (
        "oaken-hbm,oaken-lpddr,oaken-hybrid"
    ),
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the advice to this JSON file.")] = None,
) -> None:
    """Recommend HBM, LPDDR or hybrid memory for a model and workload, with the numbers behind the choice."""
    from rich.console import Console
    from rich.table import Table

    from oakenkv.sim.advisor import advise as run_advise
    from oakenkv.sim.report import write_json
    from oakenkv.sim.shapes import get_model

    names = tuple(s.strip() for s in systems.split(",") if s.strip())
    advice = run_advise(get_model(model), batch, input_len, output_len, min_tokens_per_s, min_context, names)
    table = Table(title=f"{model}, batch {batch}, {input_len}:{output_len} tokens")
    for col in ("system", "memory", "GB", "TB/s", "runs", "tokens/s", "max context", "verdict"):
        table.add_column(col)
    for c in advice.candidates:
        table.add_row(
            c.system,
            c.memory,
            f"{c.capacity_gb:.0f}",
            f"{c.bandwidth_tb_s:.2f}",
            str(c.batch_run),
            f"{c.tokens_per_s:.0f}",
            str(c.max_context),
            "meets goals" if c.meets else c.shortfall,
        )
    Console().print(table)
    typer.echo(f"recommended: {advice.recommended} -- {advice.reason}")
    if json_out is not None:
        typer.echo(f"wrote {write_json(advice.to_dict(), json_out)}")


@app.command("profile")
def profile_cmd(
    model: Annotated[
        str, typer.Option(help="Model: 'default', a Hugging Face id, a local directory or a .gguf path.")
    ] = "default",
    samples: Annotated[
        int,
        typer.Option(help="Calibration windows (= profiling runs) averaged; the paper uses about 100, fewer warn."),
    ] = 100,
    window: Annotated[
        int,
        typer.Option(
            help="Tokens per calibration window. 256 (the default) takes about 1-2 s per run for the default "
            "model on 2 CPU cores, so 100 runs take a few minutes."
        ),
    ] = 256,
    out: Annotated[Path, typer.Option(help="Where to write the thresholds JSON file.")] = Path("thresholds.json"),
    data: Annotated[
        str,
        typer.Option(
            help="Calibration text: 'wikipedia' (the default calibration excerpt) or 'wikitext2' (the "
            "evaluation text; warned about, since perplexity on it is then not held-out)."
        ),
    ] = "wikipedia",
    data_path: Annotated[
        Path | None, typer.Option(help="Read the calibration text from this file instead of the built-in source.")
    ] = None,
    outer_ratio: Annotated[float, typer.Option(help="Fraction of values in the outer group.")] = 0.04,
    inner_ratio: Annotated[float, typer.Option(help="Fraction of values in the inner group.")] = 0.06,
    pre_rope: Annotated[
        bool,
        typer.Option(
            "--pre-rope/--post-rope",
            help="Profile keys before RoPE (as the official harness) instead of after it (what the cache stores).",
        ),
    ] = False,
    kurtosis_tuning: Annotated[
        bool,
        typer.Option(
            help="Per layer, raise the outer ratio by 0.5 points where kurtosis > 20 and lower the inner ratio by "
            "0.3 points where kurtosis < 5; the adjustments are recorded in the file."
        ),
    ] = False,
    inner_center: Annotated[
        str,
        typer.Option(
            help="'median': the inner group is the values around the median (default); 'zero': the values of "
            "smallest magnitude."
        ),
    ] = "median",
    batch_size: Annotated[int, typer.Option(help="Windows per forward pass (speed only).")] = 1,
    threads: Annotated[
        int | None,
        typer.Option(
            help="torch CPU threads (default: torch's choice). On a machine shared with other jobs, 1 is much "
            "faster than oversubscribed threads (measured: 100 runs of the default model on a busy 2-core box "
            "take 2.8 min with 1 thread, 20 min with 2)."
        ),
    ] = None,
) -> None:
    """Profile the per-layer Oaken thresholds of a model on calibration text and save them as JSON."""
    import warnings

    from oakenkv.config import OakenConfig
    from oakenkv.profile import profile_model

    if threads is not None:
        import torch

        torch.set_num_threads(threads)

    config = OakenConfig(
        outer_ratio=outer_ratio, inner_ratio=inner_ratio, key_position="pre_rope" if pre_rope else "post_rope"
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        th = profile_model(
            model,
            samples=samples,
            window=window,
            data=data,
            data_path=None if data_path is None else str(data_path),
            config=config,
            kurtosis_tuning=kurtosis_tuning,
            inner_center=inner_center,  # type: ignore[arg-type]
            batch_size=batch_size,
            progress=True,
        )
    for w in caught:
        if issubclass(w.category, UserWarning):
            typer.secho(f"warning: {w.message}", fg="yellow", err=True)
    path = th.save(out)
    typer.echo(
        f"profiled {th.fingerprint.describe()} on {th.profile['runs']} x {th.profile['window']} tokens of "
        f"{data} in {th.profile['seconds']:.1f} s; wrote {path} (see `oakenkv inspect {path}`)"
    )


@app.command("inspect")
def inspect_cmd(
    path: Annotated[Path, typer.Argument(help="A thresholds JSON file written by `oakenkv profile`.")],
    layers: Annotated[bool, typer.Option(help="Print the per-layer table (--no-layers: header only).")] = True,
) -> None:
    """Print a thresholds file: model, config, how it was profiled and the per-layer thresholds and kurtosis."""
    from oakenkv.thresholds import Thresholds, ThresholdsFileError, print_thresholds

    try:
        th = Thresholds.load(path)
    except (FileNotFoundError, ThresholdsFileError) as e:
        typer.secho(f"error: {e}", fg="red", err=True)
        raise typer.Exit(1) from e
    print_thresholds(th, layers=layers)


bench_app = typer.Typer(
    help="Benchmarks of oakenkv's components; each writes machine-readable JSON with --json.",
    no_args_is_help=True,
)
app.add_typer(bench_app, name="bench")


@bench_app.command("codec")
def bench_codec(
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the results to this JSON file.")] = None,
    threads: Annotated[int, typer.Option(help="CPU threads for the kernels, torch and quanto.")] = 2,
    reps: Annotated[int, typer.Option(help="Timed repetitions per measurement (the best is kept).")] = 5,
    quanto: Annotated[bool, typer.Option(help="Also time optimum-quanto's int4 quantize/dequantize.")] = True,
    real_kv: Annotated[
        bool, typer.Option(help="Also record real K/V of the default model for the storage comparison.")
    ] = True,
    real_tokens: Annotated[int, typer.Option(help="WikiText-2 tokens of real K/V to record.")] = 4096,
) -> None:
    """Encode/decode throughput of the fused dense-and-sparse format next to memcpy and quanto int4, effective
    bits, and pure dense vs pure sparse vs fused storage of the default model's real K/V."""
    from rich.console import Console

    from oakenkv.bench.codec import print_codec_bench, run_codec_bench

    console = Console(stderr=True)
    with console.status("benchmarking the codec") as status:
        result = run_codec_bench(
            threads=threads,
            reps=reps,
            quanto=quanto,
            real_kv=real_kv,
            real_tokens=real_tokens,
            json_out=json_out,
            progress=lambda msg: status.update(f"benchmarking the codec: {msg}"),
        )
    print_codec_bench(result)


@bench_app.command("decode")
def bench_decode(
    context: Annotated[str, typer.Option(help="Comma-separated context lengths in tokens.")] = "1024,4096,16384",
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the results to this JSON file.")] = None,
    methods: Annotated[
        str,
        typer.Option(
            help="Comma-separated caches to compare: oaken (OakenCache + packed attention), dynamic (fp32 "
            "DynamicCache), quanto (QuantizedCache, quanto int4)."
        ),
    ] = "oaken,dynamic,quanto",
    steps: Annotated[int, typer.Option(help="Timed decode steps per point (the median is reported).")] = 5,
    batch: Annotated[int, typer.Option(help="Rows decoded together.")] = 1,
    threads: Annotated[
        int | None, typer.Option(help="CPU threads for torch and numba (default: leave them as they are).")
    ] = None,
    thresholds: Annotated[
        Path | None, typer.Option(help="Thresholds file (default: a cached 16-window profile of the model).")
    ] = None,
    model: Annotated[str, typer.Option(help="Model name (see `oakenkv info`).")] = "default",
) -> None:
    """Time one decode step and count KV-cache bytes at long contexts for OakenCache, transformers'
    DynamicCache (fp32) and QuantizedCache (quanto int4), all in one run."""
    import json

    from rich.console import Console

    from oakenkv.bench.decode import print_decode_bench, run_decode_bench
    from oakenkv.generation import load_or_profile_thresholds
    from oakenkv.models import load_model

    if threads is not None:
        import numba
        import torch

        torch.set_num_threads(threads)
        numba.set_num_threads(threads)
    contexts = [int(c) for c in context.split(",") if c.strip()]
    names = [m.strip() for m in methods.split(",") if m.strip()]
    console = Console(stderr=True)
    with console.status("loading the model and thresholds") as status:
        thr = None
        if "oaken" in names:
            thr = load_or_profile_thresholds(load_model(model), thresholds)
        result = run_decode_bench(
            contexts, names, model=model, thresholds=thr, steps=steps, batch=batch, progress=lambda m: status.update(m)
        )
    print_decode_bench(result)
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(result, indent=2) + "\n")
        typer.echo(f"wrote {json_out}")


@bench_app.command("attention")
def bench_attention(
    context: Annotated[str, typer.Option(help="Comma-separated context lengths in tokens.")] = "1024,16384",
    batch: Annotated[str, typer.Option(help="Comma-separated batch sizes.")] = "1,8",
    threads: Annotated[str, typer.Option(help="Comma-separated thread counts (torch and numba).")] = "1,2",
    rounds: Annotated[int, typer.Option(help="Interleaved timing rounds (the best time is reported).")] = 5,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the results to this JSON file.")] = None,
    thresholds: Annotated[
        Path | None, typer.Option(help="Thresholds file (default: a cached 16-window profile of the model).")
    ] = None,
    model: Annotated[str, typer.Option(help="Model name (see `oakenkv info`).")] = "default",
) -> None:
    """Time the packed decode-attention kernel on one layer's real K/V and report the packed bytes it reads per
    second next to memcpy (same threads) and fp32 SDPA, measured in the same rounds."""
    import json

    from rich.console import Console

    try:
        contexts, batches, counts = ([int(x) for x in s.split(",") if x.strip()] for s in (context, batch, threads))
    except ValueError:
        raise typer.BadParameter("context, batch and threads are comma-separated integers") from None
    from oakenkv.bench.attention import print_attention_bench, run_attention_bench
    from oakenkv.generation import load_or_profile_thresholds
    from oakenkv.models import load_model

    console = Console(stderr=True)
    with console.status("loading the model and thresholds") as status:
        thr = load_or_profile_thresholds(load_model(model), thresholds)
        result = run_attention_bench(
            contexts, batches, counts, model=model, thresholds=thr, rounds=rounds, progress=status.update
        )
    print_attention_bench(result)
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(result, indent=2) + "\n")
        typer.echo(f"wrote {json_out}")


@bench_app.command("generate")
def bench_generate(
    prompts: Annotated[str, typer.Option(help="Comma-separated prompt lengths in tokens.")] = "128,1024,4096,16384",
    batches: Annotated[str, typer.Option(help="Comma-separated batch sizes (every prompt with every batch).")] = "1,8",
    points: Annotated[
        str | None,
        typer.Option(help="Comma-separated PROMPTxBATCH points to run instead of the grid, e.g. '128x1,4096x8'."),
    ] = None,
    methods: Annotated[
        str,
        typer.Option(
            help="Comma-separated caches to compare: oaken (OakenCache + packed attention), dynamic (fp32 "
            "DynamicCache), quanto (QuantizedCache, quanto int4)."
        ),
    ] = "oaken,dynamic,quanto",
    new_tokens: Annotated[int, typer.Option(help="Tokens generated per row (greedy, end of sequence ignored).")] = 64,
    rounds: Annotated[int, typer.Option(help="Timed generates per method and point (interleaved).")] = 3,
    threads: Annotated[
        int | None, typer.Option(help="CPU threads for torch and numba (default: leave them as they are).")
    ] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the results to this JSON file.")] = None,
    thresholds: Annotated[
        Path | None, typer.Option(help="Thresholds file (default: a cached 16-window profile of the model).")
    ] = None,
    model: Annotated[str, typer.Option(help="Model name (see `oakenkv info`).")] = "default",
) -> None:
    """Time model.generate end to end (prefill and decode tokens/s apart) for OakenCache, transformers'
    DynamicCache (fp32) and QuantizedCache (quanto int4) at several prompt lengths and batch sizes, in interleaved
    rounds with paired ratios. The full grid (16K-token prompts at batch 8) takes hours on a 2-core machine:
    select a subset with --prompts/--batches or --points."""
    import json

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    names = [m.strip() for m in methods.split(",") if m.strip()]
    try:
        grid = (
            [tuple(int(x) for x in p.lower().split("x")) for p in points.split(",") if p.strip()]
            if points
            else [(int(p), int(b)) for p in prompts.split(",") if p.strip() for b in batches.split(",") if b.strip()]
        )
        if any(len(p) != 2 for p in grid):
            raise ValueError
    except ValueError:
        raise typer.BadParameter("points are PROMPTxBATCH, e.g. 128x1; prompts and batches are integers") from None
    from oakenkv.bench.generate import print_generate_bench, run_generate_bench
    from oakenkv.generation import load_or_profile_thresholds
    from oakenkv.models import load_model

    if threads is not None:
        import numba
        import torch

        torch.set_num_threads(threads)
        numba.set_num_threads(threads)
    console = Console(stderr=True)
    with console.status("loading the model and thresholds"):
        thr = load_or_profile_thresholds(load_model(model), thresholds) if "oaken" in names else None
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("bench generate", total=None)

        def progress(done: int, total: int, message: str) -> None:
            bar.update(task, completed=done, total=total, description=message)

        result = run_generate_bench(
            points=grid, methods=names, model=model, thresholds=thr, new_tokens=new_tokens, rounds=rounds,
            progress=progress,
        )  # fmt: skip
    print_generate_bench(result)
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(result, indent=2) + "\n")
        typer.echo(f"wrote {json_out}")


eval_app = typer.Typer(
    help="Evaluate KV-cache methods against each other: WikiText-2 perplexity, zero-shot tasks, reports. "
    "Methods: fp, oaken[:outer=..,inner=..,key_position=pre,granularity=head,kurtosis=1], oaken-official, "
    "int4, int5, int:bits=N, kivi4, kvquant4, fp8, quanto4.",
    no_args_is_help=True,
)
app.add_typer(eval_app, name="eval")


def _calib_spec(calib_text: str, calib_samples: int, calib_window: int, calib_path: str | None):
    from oakenkv.eval.calibration import CalibrationSpec

    return CalibrationSpec(calib_text, calib_samples, calib_window, calib_path)


def _write_json(obj: dict, path: Path | None) -> None:
    import json

    text = json.dumps(obj, indent=2)
    if path is None:
        typer.echo(text)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")
    typer.echo(f"wrote {path}")


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
    window: Annotated[int, typer.Option(help="Tokens per window (the paper: 2048).")] = 2048,
    stride: Annotated[int | None, typer.Option(help="Distance between window starts (default: the window).")] = None,
    max_windows: Annotated[int | None, typer.Option(help="Evaluate at most this many windows (default: all).")] = None,
    chunk: Annotated[
        int | None, typer.Option(help=("Feed each window this many tokens per forward call (default: whole window)."))
    ] = None,
    dataset: Annotated[str, typer.Option(help="Evaluation text (oakenkv.data name).")] = "wikitext2",
    calib_text: Annotated[str, typer.Option(help="Calibration text for thresholds and baseline ranges.")] = "wikipedia",
    calib_samples: Annotated[int, typer.Option(help="Calibration windows.")] = 16,
    calib_window: Annotated[int, typer.Option(help="Tokens per calibration window.")] = 256,
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
    """Perplexity on WikiText-2 test windows with every key and value passed through METHOD's cache."""
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
        calibration=_calib_spec(calib_text, calib_samples, calib_window, calib_path),
        checkpoint=checkpoint,
    )
    typer.echo(f"{res.method}: ppl {res.ppl:.4f} at {res.effective_bits:.3f} bits/value ({res.tokens} tokens)")
    _write_json(res.to_dict(), json_out)


@eval_app.command("zeroshot")
def eval_zeroshot(
    model: Annotated[str, typer.Option(help="Model name or path (as for `eval ppl`).")] = "default",
    method: Annotated[str, typer.Option(help="Method spec (as for `eval ppl`).")] = "oaken",
    tasks: Annotated[
        str, typer.Option(help=("Comma-separated tasks: piqa, winogrande, hellaswag."))
    ] = "piqa,winogrande,hellaswag",
    limit: Annotated[int | None, typer.Option(help="Evaluate only the first N documents of each task.")] = None,
    thresholds: Annotated[Path | None, typer.Option(help="Oaken thresholds file.")] = None,
    calib_text: Annotated[str, typer.Option(help="Calibration text for thresholds and baseline ranges.")] = "wikipedia",
    calib_samples: Annotated[int, typer.Option(help="Calibration windows.")] = 16,
    calib_window: Annotated[int, typer.Option(help="Tokens per calibration window.")] = 256,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the result here.")] = None,
) -> None:
    """Zero-shot accuracy (lm-evaluation-harness, local task data) with METHOD's cache."""
    from oakenkv.eval.zeroshot import run_zeroshot

    res = run_zeroshot(
        model,
        method,
        tuple(t.strip() for t in tasks.split(",") if t.strip()),
        thresholds=None if thresholds is None else str(thresholds),
        limit=limit,
        calibration=_calib_spec(calib_text, calib_samples, calib_window, None),
    )
    for t, r in res.tasks.items():
        typer.echo(f"{res.method} {t}: {r['reported_metric']} {r['reported']:.4f}")
    _write_json(res.to_dict(), json_out)


@eval_app.command("calibrate")
def eval_calibrate(
    model: Annotated[str, typer.Option(help="Model name or path.")] = "default",
    sweep: Annotated[
        str,
        typer.Option(help=("Comma-separated outlier shares to profile besides the paper's 10% (outer:inner = 4:6).")),
    ] = "0.08,0.12,0.16,0.20",
    calib_text: Annotated[str, typer.Option(help="Calibration text.")] = "wikipedia",
    calib_samples: Annotated[int, typer.Option(help="Calibration windows.")] = 16,
    calib_window: Annotated[int, typer.Option(help="Tokens per calibration window.")] = 256,
    calib_path: Annotated[str | None, typer.Option(help="Path of the calibration text file.")] = None,
) -> None:
    """Profile, in one pass, every Oaken configuration the report uses and the baselines' calibrated ranges."""
    from oakenkv.config import OakenConfig
    from oakenkv.eval.calibration import calibrate_all
    from oakenkv.eval.methods import sweep_config
    from oakenkv.models import load_model

    loaded = load_model(model)
    base = OakenConfig()
    configs = [(base, False), (base, True), (base.replace(key_position="pre_rope"), False)]
    configs += [(sweep_config(float(s)), False) for s in sweep.split(",") if s.strip()]
    calibrate_all(
        loaded.model,
        loaded.tokenizer,
        model,
        configs,
        _calib_spec(calib_text, calib_samples, calib_window, calib_path),
        progress=True,
    )
    typer.echo(f"calibrated {len(configs)} Oaken configurations and the baseline ranges for {model}")


@eval_app.command("report")
def eval_report(
    results: Annotated[list[Path], typer.Argument(help="JSON result files or directories holding them.")],
    out: Annotated[Path, typer.Option(help="Markdown file to write.")] = Path("docs/results.md"),
    plot: Annotated[Path, typer.Option(help="Pareto plot (PNG) to write.")] = Path("docs/results_pareto.png"),
    header: Annotated[Path | None, typer.Option(help="Markdown to put before the tables (commands, caveats).")] = None,
) -> None:
    """Collect `eval ppl` / `eval zeroshot` JSON results into markdown tables and a perplexity-vs-bits plot."""
    from oakenkv.eval.report import write_report

    write_report(results, out, plot, header)
    typer.echo(f"wrote {out} and {plot}")


hw_app = typer.Typer(
    help="The quantization and dequantization engines: RTL simulation against the Python models, Verilog, "
    "Yosys cell counts (needs the 'hw' extra).",
    no_args_is_help=True,
)
app.add_typer(hw_app, name="hw")


@hw_app.command("report")
def hw_report_cmd(
    vectors: Annotated[int, typer.Option(help="Rows of 64 values to simulate (half random, half real K/V).")] = 400,
    synth: Annotated[bool, typer.Option(help="Synthesise both engines with Yosys (minutes to an hour).")] = True,
    synth_lanes: Annotated[int, typer.Option(help="Lanes of the synthesised engines (64 = as simulated).")] = 64,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the report to this JSON file.")] = None,
) -> None:
    """Simulate both engines' RTL bit for bit against the Python models and the codec's bytes, and report cycles,
    values per cycle and Yosys cell counts next to the paper's Table 4 area ratio."""
    from oakenkv.hw.report import hw_report

    res = hw_report(vectors=vectors, synth=synth, progress=True, synth_lanes=synth_lanes)
    for eng in ("quant", "dequant"):
        res[eng].get("synth", {}).pop("stat", None)
    _write_json(res, json_out)


@hw_app.command("verilog")
def hw_verilog_cmd(
    engine: Annotated[str, typer.Argument(help="'quant' or 'dequant'.")],
    out: Annotated[Path, typer.Option(help="Verilog file to write.")],
    lanes: Annotated[int, typer.Option(help="Values per chunk (the paper's engines: 64).")] = 64,
) -> None:
    """Emit the Verilog of one engine (Amaranth's built-in Yosys)."""
    from oakenkv.hw.report import verilog

    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(verilog(engine, lanes))
    typer.echo(f"wrote {out}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
