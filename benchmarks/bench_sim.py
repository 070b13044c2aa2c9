"""Benchmark and report of the throughput simulator: sweep timing, the paper comparison, generalisation.

Run: ``.venv/bin/python benchmarks/bench_sim.py [--json results/bench_sim.json]``. Prints the Figure 11 and
Figure 5(b) tables (paper / simulated / error), the timing of the full models x systems x batches sweep, the
Oaken-LPDDR / vLLM ratios behind the paper's 1.79x headline, and a trace example.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from oakenkv.sim import MODELS, SYSTEMS, simulate
from oakenkv.sim.scheduler import simulate_trace
from oakenkv.sim.validate import error_summary, figure5b_table, figure11_table, format_table, headline_ratio
from oakenkv.sim.workload import bursty_trace, conversation_trace

BATCHES = (1, 16, 32, 64, 128, 256)


def sweep_timing(repeats: int = 5) -> dict:
    """Best-of-``repeats`` wall time of every model x system x batch at 1K:1K."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for m in MODELS.values():
            for s in SYSTEMS.values():
                for b in BATCHES:
                    simulate(s, m, b, 1024, 1024)
        best = min(best, time.perf_counter() - start)
    n = len(MODELS) * len(SYSTEMS) * len(BATCHES)
    return {"points": n, "seconds": best, "us_per_point": best / n * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=None, help="write all numbers to this JSON file")
    args = ap.parse_args()

    f11, f5 = figure11_table(), figure5b_table()
    print("## Figure 11 (1K:1K, end-to-end tokens/s)")
    print(format_table(f11))
    w11, r11 = error_summary(f11)
    print(f"worst {w11:.1f}%  RMS {r11:.1f}%\n")
    print("## Figure 5(b) (Llama2-13B, LPDDR accelerator)")
    print(format_table(f5))
    w5, r5 = error_summary(f5)
    print(f"worst {w5:.1f}%  RMS {r5:.1f}%\n")

    timing = sweep_timing()
    print(
        f"## Sweep: {timing['points']} points (models x systems x batches) in {timing['seconds'] * 1e3:.1f} ms "
        f"({timing['us_per_point']:.0f} us per point; limit 1 s)\n"
    )

    ratios = headline_ratio()
    print("## Oaken-LPDDR / vLLM at batch 256 (paper headline: 1.79x average)")
    for k, v in ratios.items():
        print(f"  {k:14s} {v:5.2f}x")

    traces = {}
    for name, tr in (
        ("conversation (offline, 1000 req)", conversation_trace(1000, seed=0)),
        ("bursty (5 req/s, cv 3, 1000 req)", bursty_trace(1000, rate=5.0, seed=0)),
    ):
        for system in ("vllm-a100", "oaken-lpddr", "oaken-hbm"):
            r = simulate_trace(SYSTEMS[system], MODELS["llama2-13b"], tr)
            traces[f"{name} / {system}"] = r.to_dict()
            print(
                f"  llama2-13b {name:34s} {system:12s} {r.tokens_per_s:7.0f} tok/s  mean batch "
                f"{r.mean_batch:5.1f}  mean latency {r.mean_latency_s:6.1f} s  preemptions {r.preemptions}"
            )

    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        rows = [p.__dict__ | {"error_pct": p.error_pct} for p in f11 + f5]
        args.json.write_text(
            json.dumps(
                {
                    "figures": rows,
                    "figure11_worst_rms": [w11, r11],
                    "figure5b_worst_rms": [w5, r5],
                    "sweep": timing,
                    "headline_ratios": ratios,
                    "traces": traces,
                },
                indent=2,
            )
        )
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
