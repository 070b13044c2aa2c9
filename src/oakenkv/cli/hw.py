"""``oakenkv hw``: the quantization and dequantization engines' RTL, simulated and synthesised."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from oakenkv.cli._common import app, bad_option, check_out, write_json

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
    check_out(json_out, "--json")
    from oakenkv.hw.report import hw_report

    res = hw_report(vectors=vectors, synth=synth, progress=True, synth_lanes=synth_lanes)
    for eng in ("quant", "dequant"):
        res[eng].get("synth", {}).pop("stat", None)
    write_json(res, json_out)


@hw_app.command("verilog")
def hw_verilog_cmd(
    engine: Annotated[str, typer.Argument(help="'quant' or 'dequant'.")],
    out: Annotated[Path, typer.Option(help="Verilog file to write.")],
    lanes: Annotated[int, typer.Option(help="Values per chunk (the paper's engines: 64).", min=1, max=4096)] = 64,
) -> None:
    """Emit the Verilog of one engine (Amaranth's built-in Yosys)."""
    if engine not in ("quant", "dequant"):
        raise bad_option("ENGINE", f"must be 'quant' or 'dequant', got {engine!r}")
    check_out(out, "--out")
    from oakenkv.hw.report import verilog
    from oakenkv.util.paths import atomic_write

    atomic_write(out, verilog(engine, lanes))
    typer.echo(f"wrote {out}")
