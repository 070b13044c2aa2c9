"""The ``oakenkv`` command line. Thin: each command checks its arguments, then calls the library.

Commands import their library modules inside the function body so that ``oakenkv --help`` stays fast.

Errors a user can cause (a bad argument, a missing or corrupt file, a model path that is no model, a resource
limit) end the command with one ``error: ...`` line on stderr and exit code 2, never a traceback
(:func:`run`); ``--debug`` (anywhere on the line) or ``OAKENKV_DEBUG=1`` prints the traceback too. Every
command validates its arguments before anything expensive (loading a model, profiling, benchmarking): numbers
by their option's range, names against what exists, files by opening them, output paths by where they would be
written, memory by what the machine has. A bug (any other exception) still prints its traceback.
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from pathlib import Path
from typing import Annotated, Any

import typer

try:  # typer >= 0.24 runs on its own copy of click: its exceptions are the ones raised
    from typer._click import exceptions as _cx
except ImportError:  # pragma: no cover - older typer, on the click package
    from click import exceptions as _cx

app = typer.Typer(
    name="oakenkv",
    help="Oaken KV-cache quantization (ISCA 2025): profile thresholds, quantize the KV cache of a transformers "
    "model into a fused dense-and-sparse 4.8-bit format, evaluate it against its peers and simulate the "
    "Oaken accelerator. Add --debug to any command to see a traceback with its error.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

#: Exit code of an error the user can fix (click's code for a usage error).
USER_ERROR = 2
#: Exception types a user causes: bad values (ValueError: every library validation, ThresholdsFileError,
#: ModelMismatchError, ModelFileError, CorruptDataError, ResourceLimitError), files (OSError: FileNotFoundError,
#: MissingModelError, DataNotFoundError, IsADirectoryError, PermissionError), memory (MemoryError, the page
#: pool's PoolExhaustedError) and a model the library cannot handle (NotImplementedError).
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, OSError, MemoryError, NotImplementedError)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _message(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror and e.filename is not None:
        return f"{e.strerror}: {e.filename}"
    if isinstance(e, MemoryError) and not str(e):
        return "out of memory"
    return str(e) or type(e).__name__


def _error(text: str) -> None:
    print(f"error: {_one_line(text)}", file=sys.stderr, flush=True)


def _show_warning(message: Any, category: type, filename: str, lineno: int, file: Any = None, line: Any = None):
    """Warnings as one ``warning: ...`` line each (no file name and source line: they are for the user)."""
    print(f"warning: {_one_line(str(message))}", file=sys.stderr, flush=True)


@functools.cache
def _command() -> Any:
    """The click command typer builds from ``app`` (built once: building it evaluates every command's signature)."""
    return typer.main.get_command(app)


def run(argv: list[str] | None = None, prog_name: str = "oakenkv") -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``) and return its exit code: 0, ``USER_ERROR`` (2)
    with one ``error:`` line for an error the user can fix, 130 on Ctrl-C. Other exceptions (bugs) propagate."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args or os.environ.get("OAKENKV_DEBUG", "") not in ("", "0")
    args = [a for a in args if a != "--debug"]
    with warnings.catch_warnings():
        warnings.showwarning = _show_warning
        try:
            code = _command().main(args=args, prog_name=prog_name, standalone_mode=False)
            return code if isinstance(code, int) else 0
        except _cx.NoArgsIsHelpError as e:  # a group without a command: its help, as click prints it
            print(e.format_message(), file=sys.stderr)
            return USER_ERROR
        except _cx.UsageError as e:
            if debug:
                import traceback

                traceback.print_exc()
            where = e.ctx.command_path if e.ctx is not None else prog_name
            _error(f"{e.format_message()} (see `{where} --help`)")
            return USER_ERROR
        except typer.Exit as e:
            return e.exit_code
        except typer.Abort:
            _error("aborted")
            return 1
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130
        except USER_ERRORS as e:
            if debug:
                import traceback

                traceback.print_exc()
            _error(_message(e))
            return USER_ERROR


def _bad(option: str, message: str) -> typer.BadParameter:
    """A usage error naming the option (it becomes one ``error:`` line)."""
    return typer.BadParameter(message, param_hint=f"'{option}'")


def _check_out(path: Path | None, option: str) -> None:
    """Refuse an output path that cannot be written, before any work: an existing directory, a parent that is a
    file, or a directory without write permission."""
    if path is None:
        return
    if path.is_dir():
        raise _bad(option, f"{path} is a directory; give a file name")
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise _bad(option, f"cannot create {path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise _bad(option, f"cannot write {path}: no permission to write in {parent}")


def _check_model(model: str, option: str = "--model") -> None:
    """Resolve a model name without loading it (a missing package or path, a file that is no model)."""
    from oakenkv.assets.models import locate_model

    locate_model(model)


def _load_thresholds(path: Path | None) -> Any:
    """Read and validate a thresholds file before anything expensive (None stays None)."""
    if path is None:
        return None
    from oakenkv.calibrate.thresholds import Thresholds

    return Thresholds.load(path)


@app.command()
def info() -> None:
    """Print versions, thread counts, and where the default model and each data source were found."""
    from oakenkv.apps.info import print_info

    print_info()


@app.command()
def demo(
    model: Annotated[
        str, typer.Option(help="Model: 'default', a Hugging Face id, a local directory or a .gguf path.")
    ] = "default",
    windows: Annotated[int, typer.Option(help="Number of WikiText-2 windows for perplexity.", min=1)] = 4,
    window: Annotated[int, typer.Option(help="Tokens per perplexity window.", min=2)] = 512,
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
        int | None, typer.Option(help="Calibration windows of the oaken-plus profile (default 16).", min=1)
    ] = None,
    plus_window: Annotated[
        int | None, typer.Option(help="Tokens per oaken-plus calibration window (default 2048).", min=2)
    ] = None,
) -> None:
    """Run the main job on the default model: perplexity on WikiText-2 windows and a greedy generation, FP next
    to oaken-plus and the paper's Oaken."""
    if preset not in ("oaken", "oaken-plus"):
        raise _bad("--preset", f"must be 'oaken' or 'oaken-plus', got {preset!r}")
    _check_out(json_out, "--json")
    _check_model(model)
    from oakenkv.apps.demo import run_demo

    run_demo(
        model=model,
        windows=windows,
        window=window,
        max_new_tokens=max_new_tokens,
        json_out=json_out,
        preset=preset,
        plus_samples=plus_samples,
        plus_window=plus_window,
    )


#: ``--residual`` of the commands that build an OakenCache (``OakenCache(residual=...)``, docs/pages.md).
_Residual = Annotated[
    int,
    typer.Option(
        help="OakenCache's full-precision window: its newest RESIDUAL to 2*RESIDUAL-1 tokens per layer stay "
        "unquantized (float32) and are encoded RESIDUAL at a time (KIVI's and QuantizedCache's residual). "
        "0: every token quantized on arrival, the paper's Oaken.",
        min=0,
    ),
]


@app.command()
def generate(
    prompt: Annotated[str, typer.Option(help="The prompt (sent through the chat template when there is one).")],
    model: Annotated[
        str, typer.Option(help="Model: 'default', a Hugging Face id, a local directory or a .gguf path.")
    ] = "default",
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
    residual: _Residual = 0,
) -> None:
    """Generate text with the Oaken-quantized KV cache (oaken-plus, the paper's oaken beside it) and print it with
    the bytes the cache holds."""
    if not prompt.strip():
        raise _bad("--prompt", "the prompt is empty; give some text to continue")
    if preset not in ("oaken", "oaken-plus"):
        raise _bad("--preset", f"must be 'oaken' or 'oaken-plus', got {preset!r}")
    _check_model(model)
    thr_file = _load_thresholds(thresholds)
    if thr_file is not None:
        preset = "oaken-plus" if thr_file.transforms is not None else "oaken"
    from oakenkv.apps.generate import generate_text, load_or_profile_plus, load_or_profile_thresholds, plus_model
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
    input_len: Annotated[int, typer.Option("--input", help="Prompt tokens per request.", min=1)] = 1024,
    output_len: Annotated[int, typer.Option("--output", help="Generated tokens per request.", min=1)] = 1024,
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
    requests: Annotated[int, typer.Option(help="Requests in the --trace.", min=1, max=1_000_000)] = 500,
    rate: Annotated[
        float | None,
        typer.Option(help="Mean arrival rate of the --trace in requests/s, > 0 (default: all at once)."),
    ] = None,
    seed: Annotated[int, typer.Option(help="Random seed of the --trace.")] = 0,
) -> None:
    """Simulate end-to-end serving throughput of the Oaken accelerator and its baselines (no GPU needed)."""
    from oakenkv.sim import report

    if paper:
        report.print_paper_comparison()
        return
    names = _sim_names(model, systems, kv_format)
    batches = report.parse_int_list(batch, "--batch")
    if seq_lens:
        report.parse_int_list(seq_lens, "--seq-lens")
    if plot_seq is not None and not seq_lens:
        raise _bad("--plot-seq", "--plot-seq needs --seq-lens")
    if rate is not None and not rate > 0:
        raise _bad("--rate", f"must be a positive number of requests per second, got {rate}")
    if trace is not None and trace not in ("conversation", "bursty"):
        raise _bad("--trace", f"must be 'conversation' or 'bursty', got {trace!r}")
    for path, option in ((json_out, "--json"), (plot, "--plot"), (plot_seq, "--plot-seq")):
        _check_out(path, option)
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
        from oakenkv.sim.plots import plot_vs_length

        typer.echo(f"wrote {plot_vs_length(by_len, plot_seq)}")


def _sim_names(model: str, systems: str, kv_format: str | None = None) -> list[str]:
    """The simulator's model, systems and KV format checked against what it knows (one-line errors)."""
    from oakenkv.sim.hardware import get_system
    from oakenkv.sim.kvbytes import get_kv_format
    from oakenkv.sim.shapes import get_model

    names = [s.strip() for s in systems.split(",") if s.strip()]
    if not names:
        raise _bad("--systems", "no system given")
    for option, values, get in (
        ("--model", [model], get_model),
        ("--systems", names, get_system),
        ("--kv-format", [] if kv_format is None else [kv_format], get_kv_format),
    ):
        for v in values:
            try:
                get(v)
            except KeyError as e:
                raise _bad(option, str(e.args[0])) from None
    return names


@app.command()
def advise(
    model: Annotated[str, typer.Option(help="Model shape, e.g. llama2-13b.")] = "llama2-13b",
    batch: Annotated[int, typer.Option(help="Concurrent requests to serve.", min=1)] = 64,
    input_len: Annotated[int, typer.Option("--input", help="Prompt tokens per request.", min=1)] = 1024,
    output_len: Annotated[int, typer.Option("--output", help="Generated tokens per request.", min=1)] = 1024,
    min_tokens_per_s: Annotated[
        float | None, typer.Option(help="Throughput goal (generated tokens/s, end to end).", min=0.0)
    ] = None,
    min_context: Annotated[
        int | None, typer.Option(help="Context goal: tokens each of the batch's sequences must reach.", min=1)
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

    names = tuple(_sim_names(model, systems))
    _check_out(json_out, "--json")
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
    preset: Annotated[
        str,
        typer.Option(
            help="'oaken': the paper's thresholds at fixed group ratios. 'oaken-plus': offline transforms (key "
            "shift, key smoothing folded into the weights, per-head rotations) and group ratios chosen per layer by "
            "the attention-output error on the calibration text, then thresholds profiled after them (docs/plus.md)."
        ),
    ] = "oaken",
    samples: Annotated[
        int | None,
        typer.Option(
            help="Calibration windows (= profiling runs) averaged; the paper uses about 100, fewer warn. "
            "Default: 100 for oaken, 16 for oaken-plus.",
            min=1,
        ),
    ] = None,
    window: Annotated[
        int | None,
        typer.Option(
            help="Tokens per calibration window. Default: 256 for oaken (about 1-2 s per run for the default model "
            "on 2 CPU cores, so 100 runs take a few minutes); 2048 for oaken-plus, whose key shift is a mean over "
            "the positions it sees (about 10-20 minutes for the default model).",
            min=2,
        ),
    ] = None,
    out: Annotated[Path, typer.Option(help="Where to write the thresholds JSON file.")] = Path("thresholds.json"),
    data: Annotated[
        str,
        typer.Option(
            help="Calibration text: 'wikipedia' (the default calibration excerpt) or 'wikitext2' (the "
            "evaluation text; warned about, since perplexity on it is then not held-out)."
        ),
    ] = "wikipedia",
    data_path: Annotated[
        Path | None,
        typer.Option(
            help="Read the calibration text from this file instead of the built-in source.",
            exists=True,
            dir_okay=False,
            readable=True,
        ),
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
    batch_size: Annotated[int, typer.Option(help="Windows per forward pass (speed only).", min=1)] = 1,
    threads: Annotated[
        int | None,
        typer.Option(
            help="torch CPU threads (default: torch's choice). On a machine shared with other jobs, 1 is much "
            "faster than oversubscribed threads (measured: 100 runs of the default model on a busy 2-core box "
            "take 2.8 min with 1 thread, 20 min with 2).",
            min=1,
        ),
    ] = None,
) -> None:
    """Profile the per-layer Oaken thresholds of a model on calibration text and save them as JSON."""
    from oakenkv.assets.data import TEXTS
    from oakenkv.format.config import OakenConfig

    if preset not in ("oaken", "oaken-plus"):
        raise _bad("--preset", f"must be 'oaken' or 'oaken-plus', got {preset!r}")
    plus = preset == "oaken-plus"
    samples = samples or (16 if plus else 100)
    window = window or (2048 if plus else 256)
    config = OakenConfig(
        outer_ratio=outer_ratio, inner_ratio=inner_ratio, key_position="pre_rope" if pre_rope else "post_rope"
    )
    if plus and (pre_rope or kurtosis_tuning or (outer_ratio, inner_ratio) != (0.04, 0.06)):
        raise _bad("--preset", "oaken-plus chooses its own group ratios on post-RoPE keys; drop the ratio options")
    if data not in TEXTS:
        raise _bad("--data", f"unknown text {data!r}; known: {', '.join(TEXTS)}")
    if inner_center not in ("median", "zero"):
        raise _bad("--inner-center", f"must be 'median' or 'zero', got {inner_center!r}")
    _check_out(out, "--out")
    _check_model(model)
    from oakenkv.calibrate.profile import profile_model

    if threads is not None:
        import torch

        torch.set_num_threads(threads)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        source = {"data": data, "data_path": None if data_path is None else str(data_path)}
        if plus:
            from oakenkv.calibrate.plus import profile_plus_model

            th = profile_plus_model(model, samples=samples, window=window, progress=True, **source)
        else:
            th = profile_model(
                model,
                samples=samples,
                window=window,
                config=config,
                kurtosis_tuning=kurtosis_tuning,
                inner_center=inner_center,  # type: ignore[arg-type]
                batch_size=batch_size,
                progress=True,
                **source,
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
    from oakenkv.calibrate.thresholds import Thresholds, print_thresholds

    print_thresholds(Thresholds.load(path), layers=layers)


@app.command("diagnose")
def diagnose_cmd(
    model: Annotated[
        str, typer.Option(help="Model: 'default', 'gemma3-270m', a Hugging Face id, a local directory or a .gguf path.")
    ] = "default",
    samples: Annotated[int, typer.Option(help="Calibration windows to record.")] = 4,
    window: Annotated[int, typer.Option(help="Tokens per calibration window.")] = 512,
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
        typer.Option(help="Calibration windows of the oaken-plus profile (default: --samples; the preset uses 16)."),
    ] = None,
    plus_window: Annotated[
        int | None,
        typer.Option(help="Tokens per oaken-plus calibration window (default: --window; the preset uses 2048)."),
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
    from oakenkv.apps.diagnose import diagnose_model, plot_diagnosis, print_diagnosis, require_matplotlib
    from oakenkv.calibrate.profile import CalibrationSpec

    # the user's mistakes, before any slow work (one `error:` line each, exit code 2: see run())
    if calib_path is not None and not calib_path.is_file():
        raise _bad("--calib-path", f"{calib_path} is not a file")
    if calib_path is None and calib_text not in ("wikipedia", "wikitext2"):
        raise _bad("--calib-text", f"must be 'wikipedia' or 'wikitext2', got {calib_text!r}")
    text, path = ("file", str(calib_path)) if calib_path is not None else (calib_text, None)
    try:
        spec = CalibrationSpec(text, samples, window, path)
        plus_spec = CalibrationSpec(text, plus_samples or samples, plus_window or window, path)
    except ValueError as e:
        raise _bad("--samples/--window", str(e)) from e
    if threads is not None and threads < 1:
        raise _bad("--threads", f"must be at least 1, got {threads}")
    if png is not None:
        if png.suffix.lower() != ".png":
            raise _bad("--png", f"must name a .png file, got {png}")
        try:
            require_matplotlib()
        except ImportError as e:
            raise _bad("--png", str(e)) from e
    _check_out(json_out, "--json")
    _check_out(png, "--png")
    _check_model(model)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    diag = diagnose_model(model, spec, plus=plus, plus_spec=plus_spec, progress=True)
    print_diagnosis(diag)
    _write_json(diag.to_dict(), json_out)
    if png is not None:
        typer.echo(f"wrote {plot_diagnosis(diag, png)}")


bench_app = typer.Typer(
    help="Benchmarks of oakenkv's components; each writes machine-readable JSON with --json.",
    no_args_is_help=True,
)
app.add_typer(bench_app, name="bench")


@bench_app.command("codec")
def bench_codec(
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the results to this JSON file.")] = None,
    threads: Annotated[int, typer.Option(help="CPU threads for the kernels, torch and quanto.", min=1)] = 2,
    reps: Annotated[int, typer.Option(help="Timed repetitions per measurement (the best is kept).", min=1)] = 5,
    quanto: Annotated[bool, typer.Option(help="Also time optimum-quanto's int4 quantize/dequantize.")] = True,
    real_kv: Annotated[
        bool, typer.Option(help="Also record real K/V of the default model for the storage comparison.")
    ] = True,
    real_tokens: Annotated[
        int, typer.Option(help="WikiText-2 tokens of real K/V to record (checked against the memory).", min=1)
    ] = 4096,
) -> None:
    """Encode/decode throughput of the fused dense-and-sparse format next to memcpy and quanto int4, effective
    bits, and pure dense vs pure sparse vs fused storage of the default model's real K/V."""
    _check_out(json_out, "--json")
    if real_kv:
        _check_real_tokens(real_tokens)
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


#: Bytes the codec benchmark keeps per recorded token and per (layer, K/V value): float32 K and V of two texts
#: (WikiText-2 and the calibration text), twice over while they are concatenated and encoded.
_CODEC_BENCH_BYTES_PER_VALUE = 4 * 2 * 2 * 2


def _check_real_tokens(real_tokens: int) -> None:
    """``bench codec --real-tokens``: the memory its recording needs, before any work (1e9 tokens would grow
    until the machine runs out)."""
    from oakenkv.assets.models import model_kv_shape
    from oakenkv.util.resources import check_memory

    layers, dim = model_kv_shape("default") or (30, 192)  # the default model's shape until it is converted
    need = real_tokens * layers * dim * _CODEC_BENCH_BYTES_PER_VALUE
    check_memory(need, f"--real-tokens {real_tokens}", "record fewer tokens (4096 is the default)")


#: The caches `bench decode` and `bench generate` compare.
_BENCH_CACHES_HELP = (
    "Comma-separated caches to compare: oaken (OakenCache + packed attention), dynamic (fp32 DynamicCache), "
    "quanto (QuantizedCache, quanto int4)."
)


@bench_app.command("decode")
def bench_decode(
    context: Annotated[str, typer.Option(help="Comma-separated context lengths in tokens.")] = "1024,4096,16384",
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the results to this JSON file.")] = None,
    methods: Annotated[str, typer.Option(help=_BENCH_CACHES_HELP)] = "oaken,dynamic,quanto",
    steps: Annotated[int, typer.Option(help="Timed decode steps per point (the median is reported).", min=1)] = 5,
    batch: Annotated[int, typer.Option(help="Rows decoded together.", min=1)] = 1,
    residual: _Residual = 0,
    threads: Annotated[
        int | None, typer.Option(help="CPU threads for torch and numba (default: leave them as they are).", min=1)
    ] = None,
    thresholds: Annotated[
        Path | None, typer.Option(help="Thresholds file (default: a cached 16-window profile of the model).")
    ] = None,
    model: Annotated[str, typer.Option(help="Model name (see `oakenkv info`).")] = "default",
) -> None:
    """Time one decode step and count KV-cache bytes at long contexts for OakenCache, transformers'
    DynamicCache (fp32) and QuantizedCache (quanto int4), all in one run."""
    import json

    from oakenkv.sim.report import parse_int_list

    contexts = parse_int_list(context, "--context")
    names = _check_methods(methods)
    if thresholds is not None and "oaken" not in names:
        raise _bad("--thresholds", "the thresholds are for the 'oaken' method, which --methods does not include")
    if residual and "oaken" not in names:
        raise _bad("--residual", "the window is the 'oaken' method's, which --methods does not include")
    _check_out(json_out, "--json")
    _check_model(model)
    _check_decode_contexts(model, contexts, batch)
    thr_file = _load_thresholds(thresholds)
    from rich.console import Console

    from oakenkv.apps.generate import load_or_profile_thresholds
    from oakenkv.assets.models import load_model
    from oakenkv.bench.decode import print_decode_bench, run_decode_bench

    _set_threads(threads)
    console = Console(stderr=True)
    with console.status("loading the model and thresholds") as status:
        thr = None
        if "oaken" in names:
            thr = load_or_profile_thresholds(load_model(model), thr_file)
        result = run_decode_bench(
            contexts,
            names,
            model=model,
            thresholds=thr,
            steps=steps,
            batch=batch,
            residual=residual,
            progress=lambda m: status.update(m),
        )
    print_decode_bench(result)
    if json_out is not None:
        from oakenkv.util.paths import atomic_write

        atomic_write(json_out, json.dumps(result, indent=2) + "\n")
        typer.echo(f"wrote {json_out}")


def _check_decode_contexts(model: str, contexts: list[int], batch: int = 1, option: str = "--context") -> None:
    """``bench decode --context`` (and ``bench generate``'s prompts): every method's cache of the longest context
    is held at once (fp32 K/V for DynamicCache, about a third of that for the others), so check the memory before
    loading anything."""
    from oakenkv.assets.models import model_kv_shape
    from oakenkv.util.resources import check_memory

    shape = model_kv_shape(model)
    if shape is None:  # a model not converted yet: its shape is known only once it loads
        return
    layers, dim = shape
    need = int(max(contexts) * batch * layers * dim * 2 * 4 * 1.5)
    what = f"{option} {max(contexts)}" + (f" at batch {batch}" if batch > 1 else "")
    check_memory(need, what, "give shorter contexts")


_BENCH_METHODS = ("oaken", "dynamic", "quanto")


def _check_methods(methods: str) -> list[str]:
    """``--methods`` of the cache benchmarks: distinct names among :data:`_BENCH_METHODS`."""
    names = [m.strip() for m in methods.split(",") if m.strip()]
    if not names or len(set(names)) != len(names) or any(m not in _BENCH_METHODS for m in names):
        raise _bad("--methods", f"give distinct methods among {', '.join(_BENCH_METHODS)}, got {methods!r}")
    return names


def _set_threads(threads: int | None) -> None:
    if threads is not None:
        import numba
        import torch

        torch.set_num_threads(threads)
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))


@bench_app.command("attention")
def bench_attention(
    context: Annotated[str, typer.Option(help="Comma-separated context lengths in tokens.")] = "1024,16384",
    batch: Annotated[str, typer.Option(help="Comma-separated batch sizes.")] = "1,8",
    threads: Annotated[str, typer.Option(help="Comma-separated thread counts (torch and numba).")] = "1,2",
    rounds: Annotated[int, typer.Option(help="Interleaved timing rounds (the best time is reported).", min=1)] = 5,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the results to this JSON file.")] = None,
    thresholds: Annotated[
        Path | None, typer.Option(help="Thresholds file (default: a cached 16-window profile of the model).")
    ] = None,
    model: Annotated[str, typer.Option(help="Model name (see `oakenkv info`).")] = "default",
) -> None:
    """Time the packed decode-attention kernel on one layer's real K/V and report the packed bytes it reads per
    second next to memcpy (same threads) and fp32 SDPA, measured in the same rounds."""
    import json

    from oakenkv.sim.report import parse_int_list

    contexts = parse_int_list(context, "--context")
    batches = parse_int_list(batch, "--batch")
    counts = parse_int_list(threads, "--threads")
    import numba

    if max(counts) > numba.config.NUMBA_NUM_THREADS:
        raise _bad("--threads", f"numba has {numba.config.NUMBA_NUM_THREADS} threads; give at most that many")
    _check_out(json_out, "--json")
    _check_model(model)
    thr_file = _load_thresholds(thresholds)
    from rich.console import Console

    from oakenkv.apps.generate import load_or_profile_thresholds
    from oakenkv.assets.models import load_model
    from oakenkv.bench.attention import print_attention_bench, run_attention_bench

    console = Console(stderr=True)
    with console.status("loading the model and thresholds") as status:
        thr = load_or_profile_thresholds(load_model(model), thr_file)
        result = run_attention_bench(
            contexts, batches, counts, model=model, thresholds=thr, rounds=rounds, progress=status.update
        )
    print_attention_bench(result)
    if json_out is not None:
        from oakenkv.util.paths import atomic_write

        atomic_write(json_out, json.dumps(result, indent=2) + "\n")
        typer.echo(f"wrote {json_out}")


@bench_app.command("generate")
def bench_generate(
    prompts: Annotated[str, typer.Option(help="Comma-separated prompt lengths in tokens.")] = "128,1024,4096,16384",
    batches: Annotated[str, typer.Option(help="Comma-separated batch sizes (every prompt with every batch).")] = "1,8",
    points: Annotated[
        str | None,
        typer.Option(help="Comma-separated PROMPTxBATCH points to run instead of the grid, e.g. '128x1,4096x8'."),
    ] = None,
    methods: Annotated[str, typer.Option(help=_BENCH_CACHES_HELP)] = "oaken,dynamic,quanto",
    new_tokens: Annotated[
        int, typer.Option(help="Tokens generated per row (greedy, end of sequence ignored).", min=2)
    ] = 64,
    rounds: Annotated[int, typer.Option(help="Timed generates per method and point (interleaved).", min=1)] = 3,
    residual: _Residual = 0,
    threads: Annotated[
        int | None, typer.Option(help="CPU threads for torch and numba (default: leave them as they are).", min=1)
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

    from oakenkv.sim.report import parse_int_list

    names = _check_methods(methods)
    if thresholds is not None and "oaken" not in names:
        raise _bad("--thresholds", "the thresholds are for the 'oaken' method, which --methods does not include")
    if residual and "oaken" not in names:
        raise _bad("--residual", "the window is the 'oaken' method's, which --methods does not include")
    if points:
        try:
            grid = [tuple(int(x) for x in p.lower().split("x")) for p in points.split(",") if p.strip()]
        except ValueError:
            grid = []
        if not grid or any(len(p) != 2 or min(p) < 1 for p in grid):
            raise _bad("--points", f"points are PROMPTxBATCH with positive integers, e.g. 128x1; got {points!r}")
    else:
        grid = [(p, b) for p in parse_int_list(prompts, "--prompts") for b in parse_int_list(batches, "--batches")]
    _check_out(json_out, "--json")
    _check_model(model)
    p_max, b_max = max(grid, key=lambda pb: (pb[0] + new_tokens) * pb[1])
    _check_decode_contexts(model, [p_max + new_tokens], b_max, option="a prompt of")
    thr_file = _load_thresholds(thresholds)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from oakenkv.apps.generate import load_or_profile_thresholds
    from oakenkv.assets.models import load_model
    from oakenkv.bench.generate import print_generate_bench, run_generate_bench

    _set_threads(threads)
    console = Console(stderr=True)
    with console.status("loading the model and thresholds"):
        thr = load_or_profile_thresholds(load_model(model), thr_file) if "oaken" in names else None
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("bench generate", total=None)

        def progress(done: int, total: int, message: str) -> None:
            bar.update(task, completed=done, total=total, description=message)

        result = run_generate_bench(
            points=grid, methods=names, model=model, thresholds=thr, new_tokens=new_tokens, rounds=rounds,
            residual=residual, progress=progress,
        )  # fmt: skip
    print_generate_bench(result)
    if json_out is not None:
        from oakenkv.util.paths import atomic_write

        atomic_write(json_out, json.dumps(result, indent=2) + "\n")
        typer.echo(f"wrote {json_out}")


eval_app = typer.Typer(
    help="Evaluate KV-cache methods against each other: WikiText-2 perplexity, zero-shot tasks, reports. "
    "Methods: fp, oaken[:outer=..,inner=..,key_position=pre,granularity=head,kurtosis=1], "
    "oaken-plus[:shift=0,rot_k=1,rot_v=1,smooth=0,ratios=0,sink=N] (offline transforms chosen per layer; each "
    "switch turns one remedy on or off; sink: first tokens kept at 16 bits, default 1), oaken-official, int4, "
    "int5, int:bits=N, kivi4, kvquant4, fp8, quanto4.",
    no_args_is_help=True,
)
app.add_typer(eval_app, name="eval")


def _calib_spec(
    calib_text: str | None,
    calib_samples: int | None,
    calib_window: int | None,
    calib_path: str | None,
    *,
    method: str = "oaken",
    thresholds: Path | None = None,
):
    """The calibration spec from the --calib-* options (None: the default), validated; refused with --thresholds
    for Oaken, whose thresholds then come from the file (the options would be recorded and ignored)."""
    from oakenkv.calibrate.spec import DEFAULT_CALIB_SAMPLES, DEFAULT_CALIB_TEXT, DEFAULT_CALIB_WINDOW, CalibrationSpec
    from oakenkv.methods.spec import parse_spec

    given = [
        o
        for o, v in (
            ("--calib-text", calib_text),
            ("--calib-samples", calib_samples),
            ("--calib-window", calib_window),
            ("--calib-path", calib_path),
        )
        if v is not None
    ]
    if thresholds is not None and given and parse_spec(method)[0] in ("oaken", "oaken-plus"):
        raise _bad(given[0], "the thresholds come from --thresholds, so calibration options do not apply")
    if calib_path is not None and calib_text is None:
        calib_text = "file"
    return CalibrationSpec(
        DEFAULT_CALIB_TEXT if calib_text is None else calib_text,
        DEFAULT_CALIB_SAMPLES if calib_samples is None else calib_samples,
        DEFAULT_CALIB_WINDOW if calib_window is None else calib_window,
        calib_path,
    )


def _write_json(obj: dict, path: Path | None) -> None:
    import json

    text = json.dumps(obj, indent=2)
    if path is None:
        typer.echo(text)
        return
    from oakenkv.util.paths import atomic_write

    atomic_write(path, text + "\n")
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
    window: Annotated[int, typer.Option(help="Tokens per window (the paper: 2048).", min=2)] = 2048,
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
    calib_text: Annotated[
        str | None, typer.Option(help="Calibration text for thresholds and baseline ranges [default: wikipedia].")
    ] = None,
    calib_samples: Annotated[int | None, typer.Option(help="Calibration windows [default: 16].", min=1)] = None,
    calib_window: Annotated[
        int | None, typer.Option(help="Tokens per calibration window [default: 256].", min=2)
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
    """Perplexity on WikiText-2 test windows with every key and value passed through METHOD's cache."""
    from oakenkv.methods.spec import check_run_args

    _check_out(json_out, "--json")
    calibration = _calib_spec(calib_text, calib_samples, calib_window, calib_path, method=method, thresholds=thresholds)
    check_run_args(model, method, thresholds, dataset=dataset, window=window, stride=stride, chunk=chunk)
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
    limit: Annotated[int | None, typer.Option(help="Evaluate only the first N documents of each task.", min=1)] = None,
    thresholds: Annotated[Path | None, typer.Option(help="Oaken thresholds file.")] = None,
    calib_text: Annotated[
        str | None, typer.Option(help="Calibration text for thresholds and baseline ranges [default: wikipedia].")
    ] = None,
    calib_samples: Annotated[int | None, typer.Option(help="Calibration windows [default: 16].", min=1)] = None,
    calib_window: Annotated[
        int | None, typer.Option(help="Tokens per calibration window [default: 256].", min=2)
    ] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the result here.")] = None,
) -> None:
    """Zero-shot accuracy (lm-evaluation-harness, local task data) with METHOD's cache."""
    from oakenkv.methods.spec import ZEROSHOT_TASKS, check_run_args

    names = tuple(t.strip() for t in tasks.split(",") if t.strip())
    if not names or any(t not in ZEROSHOT_TASKS for t in names):
        raise _bad("--tasks", f"give tasks among {', '.join(ZEROSHOT_TASKS)}, got {tasks!r}")
    _check_out(json_out, "--json")
    calibration = _calib_spec(calib_text, calib_samples, calib_window, None, method=method, thresholds=thresholds)
    check_run_args(model, method, thresholds)
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
    _write_json(res.to_dict(), json_out)


@eval_app.command("calibrate")
def eval_calibrate(
    model: Annotated[str, typer.Option(help="Model name or path.")] = "default",
    sweep: Annotated[
        str,
        typer.Option(help=("Comma-separated outlier shares to profile besides the paper's 10% (outer:inner = 4:6).")),
    ] = "0.08,0.12,0.16,0.20",
    calib_text: Annotated[str | None, typer.Option(help="Calibration text [default: wikipedia].")] = None,
    calib_samples: Annotated[int | None, typer.Option(help="Calibration windows [default: 16].", min=1)] = None,
    calib_window: Annotated[
        int | None, typer.Option(help="Tokens per calibration window [default: 256].", min=2)
    ] = None,
    calib_path: Annotated[str | None, typer.Option(help="Path of the calibration text file.")] = None,
) -> None:
    """Profile, in one pass, every Oaken configuration the report uses and the baselines' calibrated ranges."""
    from oakenkv.format.config import OakenConfig
    from oakenkv.methods.spec import sweep_config

    base = OakenConfig()
    configs = [(base, False), (base, True), (base.replace(key_position="pre_rope"), False)]
    for s in (s.strip() for s in sweep.split(",")):
        if not s:
            continue
        try:
            configs.append((sweep_config(float(s)), False))
        except ValueError as e:
            raise _bad("--sweep", f"{s!r} is not an outlier share in (0, 1): {e}") from None
    spec = _calib_spec(calib_text, calib_samples, calib_window, calib_path)
    if spec.text_path is not None and not Path(spec.text_path).is_file():
        raise _bad("--calib-path", f"{spec.text_path} is not a file")
    _check_model(model)
    from oakenkv.assets.models import load_model
    from oakenkv.calibrate.ranges import calibrate_all

    loaded = load_model(model)
    calibrate_all(loaded.model, loaded.tokenizer, model, configs, spec, progress=True)
    typer.echo(f"calibrated {len(configs)} Oaken configurations and the baseline ranges for {model}")


@eval_app.command("report")
def eval_report(
    results: Annotated[list[Path], typer.Argument(help="JSON result files or directories holding them.", exists=True)],
    out: Annotated[Path, typer.Option(help="Markdown file to write.")] = Path("docs/results.md"),
    plot: Annotated[Path, typer.Option(help="Pareto plot (PNG) to write.")] = Path("docs/results_pareto.png"),
    header: Annotated[
        Path | None,
        typer.Option(help="Markdown to put before the tables (commands, caveats).", exists=True, dir_okay=False),
    ] = None,
) -> None:
    """Collect `eval ppl` / `eval zeroshot` JSON results into markdown tables and a perplexity-vs-bits plot."""
    _check_out(out, "--out")
    _check_out(plot, "--plot")
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
    vectors: Annotated[
        int,
        typer.Option(help="Rows of 64 values to simulate (half random, half real K/V).", min=1, max=1_000_000),
    ] = 400,
    synth: Annotated[bool, typer.Option(help="Synthesise both engines with Yosys (minutes to an hour).")] = True,
    synth_lanes: Annotated[
        int, typer.Option(help="Lanes of the synthesised engines (64 = as simulated).", min=1, max=4096)
    ] = 64,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the report to this JSON file.")] = None,
) -> None:
    """Simulate both engines' RTL bit for bit against the Python models and the codec's bytes, and report cycles,
    values per cycle and Yosys cell counts next to the paper's Table 4 area ratio."""
    _check_out(json_out, "--json")
    from oakenkv.hw.report import hw_report

    res = hw_report(vectors=vectors, synth=synth, progress=True, synth_lanes=synth_lanes)
    for eng in ("quant", "dequant"):
        res[eng].get("synth", {}).pop("stat", None)
    _write_json(res, json_out)


@hw_app.command("verilog")
def hw_verilog_cmd(
    engine: Annotated[str, typer.Argument(help="'quant' or 'dequant'.")],
    out: Annotated[Path, typer.Option(help="Verilog file to write.")],
    lanes: Annotated[int, typer.Option(help="Values per chunk (the paper's engines: 64).", min=1, max=4096)] = 64,
) -> None:
    """Emit the Verilog of one engine (Amaranth's built-in Yosys)."""
    if engine not in ("quant", "dequant"):
        raise _bad("ENGINE", f"must be 'quant' or 'dequant', got {engine!r}")
    _check_out(out, "--out")
    from oakenkv.hw.report import verilog
    from oakenkv.util.paths import atomic_write

    atomic_write(out, verilog(engine, lanes))
    typer.echo(f"wrote {out}")


def main() -> None:
    """The console script: :func:`run` on ``sys.argv``, exiting with its code."""
    sys.exit(run())


if __name__ == "__main__":
    main()
