"""Commands of the throughput simulator (``oakenkv.sim``, no torch): ``simulate``, ``advise``."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated

import typer

from oakenkv.cli._common import app, bad_option, check_out


@app.command()
def simulate(
    ctx: typer.Context,
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
    seed: Annotated[int, typer.Option(help="Random seed of the --trace.", min=0)] = 0,
) -> None:
    """Simulate end-to-end serving throughput of the Oaken accelerator and its baselines (no GPU needed)."""
    from oakenkv.sim import report

    if paper:
        given = [
            p.opts[0]
            for p in ctx.command.params
            if p.name not in ("paper", "json_out")
            and getattr(ctx.get_parameter_source(p.name), "name", "") == "COMMANDLINE"
        ]
        if given:
            raise bad_option(
                "--paper", f"compares with the paper's own figures and takes only --json: drop {', '.join(given)}"
            )
        check_out(json_out, "--json")
        data = report.print_paper_comparison()
        if json_out is not None:
            typer.echo(f"wrote {report.write_json(data, json_out)}")
        return
    names = _sim_names(model, systems, kv_format)
    batches = report.parse_int_list(batch, "--batch")
    if seq_lens:
        report.parse_int_list(seq_lens, "--seq-lens")
    if plot_seq is not None and not seq_lens:
        raise bad_option("--plot-seq", "--plot-seq needs --seq-lens")
    if rate is not None and not (math.isfinite(rate) and rate > 0):
        raise bad_option("--rate", f"must be a positive number of requests per second, got {rate}")
    if trace is not None and trace not in ("conversation", "bursty"):
        raise bad_option("--trace", f"must be 'conversation' or 'bursty', got {trace!r}")
    for path, option in ((json_out, "--json"), (plot, "--plot"), (plot_seq, "--plot-seq")):
        check_out(path, option)
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
        raise bad_option("--systems", "no system given")
    for option, values, get in (
        ("--model", [model], get_model),
        ("--systems", names, get_system),
        ("--kv-format", [] if kv_format is None else [kv_format], get_kv_format),
    ):
        for v in values:
            try:
                get(v)
            except KeyError as e:
                raise bad_option(option, str(e.args[0])) from None
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
    if min_tokens_per_s is not None and not math.isfinite(min_tokens_per_s):
        raise bad_option("--min-tokens-per-s", f"must be a finite number of tokens/s, got {min_tokens_per_s}")
    check_out(json_out, "--json")
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
