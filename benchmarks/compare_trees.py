"""Compare `oakenkv bench decode` and `oakenkv bench codec` between two source trees in one session.

The two trees run alternately (old, new, old, new, ...) so that the machine's load drifts over both alike; each
run is a fresh process with ``PYTHONPATH`` set to the tree's ``src``. The result holds every run's numbers and,
per measurement, the median over rounds and the ratio new / old (step time: below 1 is faster; throughput:
above 1 is faster).

    # the previous commit, exported next to the working tree
    git archive main src | tar -x -C /tmp/old
    python benchmarks/compare_trees.py --old /tmp/old/src --new src --rounds 5 \\
        --json benchmarks/results/compare_trees/<point>.json

``--summarize DIR`` rebuilds the result from the per-run JSON files a previous call left in ``DIR``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

DECODE_ARGS = ["bench", "decode", "--context", "1024,4096", "--methods", "oaken,dynamic", "--steps", "15"]
CODEC_ARGS = ["bench", "codec", "--no-quanto", "--no-real-kv", "--reps", "5"]


BENCHES = {"decode": DECODE_ARGS, "codec": CODEC_ARGS}


def run_all(old: Path, new: Path, rounds: int, work: Path, only: tuple[str, ...] = tuple(BENCHES)) -> None:
    env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    for r in range(1, rounds + 1):
        for tree, src in (("old", old), ("new", new)):
            for name, args in ((n, BENCHES[n]) for n in only):
                out = work / f"{name}_{tree}_{r}.json"
                cmd = [sys.executable, "-m", "oakenkv.cli", *args, "--json", str(out)]
                print(f"round {r} {tree} {name} {time.strftime('%H:%M:%S')}", flush=True)
                subprocess.run(cmd, env={**env, "PYTHONPATH": str(src)}, check=True, capture_output=True)


def _median_ratio(old: list[float], new: list[float]) -> dict[str, float]:
    mo, mn = statistics.median(old), statistics.median(new)
    return {"old_median": mo, "new_median": mn, "new_over_old": mn / mo, "old": old, "new": new}


def summarize(work: Path, rounds: int, only: tuple[str, ...] = tuple(BENCHES)) -> dict:
    def load(name: str, tree: str) -> list[dict]:
        return [json.loads((work / f"{name}_{tree}_{r}.json").read_text()) for r in range(1, rounds + 1)]

    codec = {t: load("codec", t) for t in ("old", "new")} if "codec" in only else {"old": [{"shapes": []}]}
    decode_out = {}
    if "decode" in only:
        _summarize_decode({t: load("decode", t) for t in ("old", "new")}, decode_out)
    codec_out = {}
    for i, shape in enumerate(codec["old"][0]["shapes"]):
        for key in ("encode_gbps", "decode_gbps", "encode_vs_memcpy", "decode_vs_memcpy"):
            vals = {t: [run["shapes"][i][key] for run in codec[t]] for t in codec}
            codec_out[f"{shape['name']} {key}"] = _median_ratio(vals["old"], vals["new"])
        for key in ("encode", "decode"):  # CPU time, one thread: what the machine's other tenants disturb least
            vals = {t: [run["shapes"][i]["per_core_cpu_time_gbps"][key] for run in codec[t]] for t in codec}
            codec_out[f"{shape['name']} {key} per-core cpu gbps"] = _median_ratio(vals["old"], vals["new"])
    return {
        "what": "new / old of `oakenkv bench decode` and `bench codec`, trees alternating in one session",
        "decode_command": "oakenkv " + " ".join(DECODE_ARGS) if "decode" in only else None,
        "codec_command": "oakenkv " + " ".join(CODEC_ARGS) if "codec" in only else None,
        "rounds": rounds,
        "load_average_at_end": os.getloadavg(),
        "decode": decode_out,
        "codec": codec_out,
    }


def _summarize_decode(dec: dict[str, list[dict]], decode_out: dict) -> None:
    for method in dec["old"][0]["results"]:
        for ctx in dec["old"][0]["results"][method]:
            steps = {t: [run["results"][method][ctx]["step_ms"] for run in dec[t]] for t in dec}
            decode_out[f"{method}@{ctx} step_ms"] = _median_ratio(steps["old"], steps["new"])

    # The load-robust measure: per run, the median over steps of oaken_i / dynamic_i (timed in the same rounds,
    # so the machine's load cancels); then new / old of its median over runs.
    def paired(run: dict, ctx: str) -> float:
        o, d = run["results"]["oaken"][ctx]["steps_ms"], run["results"]["dynamic"][ctx]["steps_ms"]
        return statistics.median(a / b for a, b in zip(o, d, strict=True))

    for ctx in dec["old"][0]["results"]["oaken"]:
        ratios = {t: [paired(run, ctx) for run in dec[t]] for t in dec}
        decode_out[f"oaken/dynamic@{ctx} paired step ratio"] = _median_ratio(ratios["old"], ratios["new"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", type=Path, help="src directory of the baseline tree")
    ap.add_argument("--new", type=Path, help="src directory of the tree under test")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds (each runs both benchmarks per tree)")
    ap.add_argument("--work", type=Path, default=Path("compare_trees_runs"), help="folder for the per-run JSON")
    ap.add_argument("--summarize", type=Path, help="only summarize the per-run JSON files in this folder")
    ap.add_argument("--json", type=Path, required=True, help="write the comparison here")
    ap.add_argument("--only", choices=tuple(BENCHES), action="append", help="run only this benchmark (repeatable)")
    a = ap.parse_args()
    only = tuple(a.only or BENCHES)
    if a.summarize is None:
        if a.old is None or a.new is None:
            ap.error("--old and --new are needed unless --summarize is given")
        a.work.mkdir(parents=True, exist_ok=True)
        run_all(a.old.resolve(), a.new.resolve(), a.rounds, a.work, only)
    result = summarize(a.summarize or a.work, a.rounds, only)
    a.json.write_text(json.dumps(result, indent=1) + "\n")
    for section in ("decode", "codec"):
        for name, r in result[section].items():
            print(f"{name:40s} old {r['old_median']:9.3f}  new {r['new_median']:9.3f}  new/old {r['new_over_old']:.3f}")


if __name__ == "__main__":
    main()
