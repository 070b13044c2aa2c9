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
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=False))
    return path


def print_results(results: Sequence[RunResult], title: str) -> None:
    """A rich table: system, batch (run / fits), tokens/s, KV bytes per token, memory used."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in (
        "system",
        "KV format (bits)",
        "batch",
        "runs",
        "max batch",
        "seq len",
        "tokens/s",
        "KV bytes/token",
        "memory GB",
    ):
        table.add_column(col, justify="right" if col not in ("system", "KV format (bits)") else "left")
    for r in results:
        table.add_row(
            r.system,
            f"{r.kv_format} ({r.kv_bits_per_value:.2f})",
            str(r.batch),
            str(r.batch_run),
            str(r.max_batch),
            f"{r.input_len}:{r.output_len}",
            f"{r.tokens_per_s:.0f}",
            f"{r.kv_bytes_per_token:,.0f}",
            f"{r.memory_used / 1e9:.1f}",
        )
    Console().print(table)


def print_paper_comparison() -> None:
    """Figure 11 and Figure 5(b): paper, simulated, error, plus the worst and RMS errors."""
    from rich.console import Console

    from oakenkv.sim.validate import error_summary, figure5b_table, figure11_table, format_table

    con = Console()
    for name, rows in (("Figure 11", figure11_table()), ("Figure 5(b)", figure5b_table())):
        worst, rms = error_summary(rows)
        con.print(f"\n[bold]{name}[/bold]: worst error {worst:.1f}%, RMS {rms:.1f}%")
        con.print(format_table(rows), markup=False)
