"""Sweeps and their presentation (JSON payloads, rich tables) for the ``oakenkv simulate`` command."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from oakenkv.sim.hardware import get_system
from oakenkv.sim.serving import RunResult, simulate
from oakenkv.sim.shapes import get_model


def parse_int_list(text: str, what: str) -> list[int]:
    """'16,32,64' -> [16, 32, 64], with a clear error for anything that is not a list of positive integers."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as e:
        raise ValueError(f"{what} must be comma-separated positive integers, got {text!r}") from e
    if not values or any(v < 1 for v in values):
        raise ValueError(f"{what} must be comma-separated positive integers, got {text!r}")
    return values


def batch_sweep(
    model: str,
    systems: Sequence[str],
    batches: Sequence[int],
    input_len: int,
    output_len: int,
    kv_format: str | None = None,
) -> list[RunResult]:
    """Every (system, batch) at one input:output length."""
    m = get_model(model)
    specs = [get_system(s) for s in systems]
    return [simulate(s, m, b, input_len, output_len, kv_format) for s in specs for b in batches]


def length_sweep(
    model: str, systems: Sequence[str], batch: int, seq_lens: Sequence[int], kv_format: str | None = None
) -> list[RunResult]:
    """Every (system, sequence length) at one batch; each length is split evenly into input and output."""
    m = get_model(model)
    specs = [get_system(s) for s in systems]
    out = []
    for s in specs:
        for n in seq_lens:
            if n < 2:
                raise ValueError(f"sequence lengths must be >= 2 (input + output), got {n}")
            out.append(simulate(s, m, batch, n // 2, n - n // 2, kv_format))
    return out


def payload(results: Sequence[RunResult]) -> dict:
    """JSON-ready nesting: {"results": {system: {batch or length: {tokens_per_s, max_batch, ...}}}}."""
    nested: dict[str, dict[str, dict]] = {}
    for r in results:
        key = str(r.batch) if len({x.input_len for x in results}) == 1 else str(r.input_len + r.output_len)
        nested.setdefault(r.system, {})[key] = r.to_dict()
    return {"units": {"tokens_per_s": "generated tokens per second (end to end)", "bytes": "bytes"}, "results": nested}


def write_json(data: dict, path: str | Path) -> Path:
    from oakenkv.util.paths import atomic_write

    return atomic_write(path, json.dumps(data, indent=2, sort_keys=False))


def print_results(results: Sequence[RunResult], title: str) -> None:
    """A rich table: system, KV bits, batch asked / run / max, tokens/s, KV bytes per token, memory used."""
    from rich.table import Table

    table = Table(title=title)
    for col in ("system", "KV bits", "in:out", "batch", "runs", "max", "tokens/s", "KV B/token", "mem GB"):
        table.add_column(col, justify="left" if col == "system" else "right")
    for r in results:
        table.add_row(
            r.system,
            f"{r.kv_bits_per_value:.2f}",
            f"{r.input_len}:{r.output_len}",
            str(r.batch),
            str(r.batch_run),
            str(r.max_batch),
            f"{r.tokens_per_s:.0f}",
            f"{r.kv_bytes_per_token:,.0f}",
            f"{r.memory_used / 1e9:.1f}",
        )
    _console().print(table)


def _console():
    """A console at least 110 columns wide, so that tables stay readable when piped or in a narrow terminal."""
    from rich.console import Console

    con = Console()
    return Console(width=max(con.width, 110)) if con.width < 110 else con


def print_paper_comparison() -> dict:
    """Figure 11 and Figure 5(b): paper, simulated, error, plus the worst and RMS errors; returns them as a dict
    (per figure: ``worst_error_pct``, ``rms_error_pct`` and every point)."""
    import dataclasses

    from rich.console import Console

    from oakenkv.sim.validate import error_summary, figure5b_table, figure11_table, format_table

    con = Console()
    data = {}
    for name, rows in (("Figure 11", figure11_table()), ("Figure 5(b)", figure5b_table())):
        worst, rms = error_summary(rows)
        con.print(f"\n[bold]{name}[/bold]: worst error {worst:.1f}%, RMS {rms:.1f}%")
        con.print(format_table(rows), markup=False)
        points = [{**dataclasses.asdict(p), "error_pct": p.error_pct} for p in rows]
        data[name] = {"worst_error_pct": worst, "rms_error_pct": rms, "points": points}
    return data


def trace_runs(
    model: str, systems: Sequence[str], kind: str, requests: int, rate: float | None, seed: int, max_batch: int
) -> list:
    """Run a synthetic trace ('conversation' or 'bursty', see oakenkv.sim.workload) through each system."""
    from oakenkv.sim.scheduler import simulate_trace
    from oakenkv.sim.workload import bursty_trace, conversation_trace

    if kind == "conversation":
        trace = conversation_trace(requests, seed=seed, rate=rate)
    elif kind == "bursty":
        if rate is None:
            raise ValueError("a bursty trace needs --rate (mean requests per second)")
        trace = bursty_trace(requests, rate=rate, seed=seed)
    else:
        raise ValueError(f"trace must be 'conversation' or 'bursty', got {kind!r}")
    m = get_model(model)
    return [simulate_trace(get_system(s), m, trace, max_batch=max_batch) for s in systems]


def print_trace_results(results: Sequence, title: str) -> None:
    from rich.table import Table

    table = Table(title=title)
    for col in ("system", "tokens/s", "mean batch", "mean latency s", "p99 latency s", "mean TTFT s", "preemptions"):
        table.add_column(col, justify="left" if col == "system" else "right")
    for r in results:
        table.add_row(
            r.system,
            f"{r.tokens_per_s:.0f}",
            f"{r.mean_batch:.1f}",
            f"{r.mean_latency_s:.1f}",
            f"{r.p99_latency_s:.1f}",
            f"{r.mean_ttft_s:.2f}",
            str(r.preemptions),
        )
    _console().print(table)
