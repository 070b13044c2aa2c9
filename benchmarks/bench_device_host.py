"""The host's share of a device-store decode step: the page tables' bookkeeping per step (no GPU needed).

A decode step on the device store (``oakenkv.store.device``) reserves every stream's next dense slot and sparse tail
on the host (``DevicePagePool.reserve_tokens``), and at the next step learns the lengths (``settle_tokens``): a
Python walk over the ``2 B`` streams of each layer, twice. This times it per step for the default model's 30 layers
(``rec = 108``, ``capacity = 199``, 20-byte COO records) at several batch sizes, interleaved with the CPU store's
single-token append (``PagePool.append_token``, the same walk plus the records' copy) as the baseline measured in
the same run, and writes one JSON.

    python benchmarks/bench_device_host.py [--out benchmarks/results/device_host/batch1-16-64.json] [--batches 1,16,64]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np

from oakenkv.store.device import DevicePagePool
from oakenkv.store.pages import PagePool, PoolConfig

LAYERS, REC, CAPACITY, LENGTH = 30, 108, 199, 20


def _machine() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        name = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "?")
    except OSError:
        name = platform.processor() or "?"
    return f"{name}, {os.cpu_count()} cores"


def _pools(batch: int):
    cfg = PoolConfig(page_size=16384, budget_bytes=8 << 30)
    dev, cpu = DevicePagePool(cfg), PagePool(cfg)
    out = []
    for pool in (dev, cpu):
        seqs = [pool.new_sequence(2 * LAYERS) for _ in range(batch)]
        out.append(
            [pool.token_targets([(s, 2 * la) for s in seqs] + [(s, 2 * la + 1) for s in seqs]) for la in range(LAYERS)]
        )
    return dev, cpu, out[0], out[1]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results/device_host/batch1-16-64.json")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--steps", type=int, default=40, help="timed steps per round")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    res: dict = {
        "command": " ".join(["python", "benchmarks/bench_device_host.py", *(argv or [])]),
        "machine": _machine(),
        "load_before": os.getloadavg(),
        "layers": LAYERS,
        "cases": [],
    }
    for b in (int(x) for x in args.batches.split(",")):
        dev, cpu, dt, ct = _pools(b)
        lens = np.full(2 * b, LENGTH, np.int64)
        dense = np.zeros((2 * b, REC), np.uint8)
        sparse = np.zeros((2 * b, CAPACITY), np.uint8)
        device_ms, cpu_ms = [], []
        for r in range(args.rounds + 1):  # round 0 warms up (numba loads its cache)
            t = time.perf_counter()
            for _ in range(args.steps):
                placed = [dev.reserve_tokens(dt[la], REC, CAPACITY) for la in range(LAYERS)]
                for la in range(LAYERS):
                    dev.settle_tokens(dt[la], lens, placed[la][1], placed[la][2])
            d = (time.perf_counter() - t) / args.steps
            t = time.perf_counter()
            for _ in range(args.steps):
                for la in range(LAYERS):
                    cpu.append_token(ct[la], dense, sparse, lens)
            c = (time.perf_counter() - t) / args.steps
            if r:
                device_ms.append(1e3 * d)
                cpu_ms.append(1e3 * c)
        dev.check_invariants()
        case = {
            "batch": b,
            "streams_per_step": 2 * b * LAYERS,
            "device_reserve_settle_ms_per_step": round(statistics.median(device_ms), 3),
            "cpu_append_token_ms_per_step": round(statistics.median(cpu_ms), 3),
        }
        res["cases"].append(case)
        print(json.dumps(case), flush=True)
    res["load_after"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    return res


if __name__ == "__main__":
    main()
