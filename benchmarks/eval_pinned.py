"""Rerun the default model's leading frontier pairs with oakenkv's pinned CPU numerics and compare with the files
docs/results.md cites (computed before the pin, with whichever torch kernels each machine chose).

``oakenkv eval`` now runs torch's AVX2 kernels on every x86-64 CPU (oakenkv.util.numerics); the committed
20-window files of the default model were made on an Intel Xeon (torch's AVX2 kernels) and on this AMD EPYC (its
AVX-512 kernels), unrecorded which. This reruns FP, KVQuant-style 4, oaken-plus and the 3- and 4-bit points of the
frontier, then the 8-bit pair (int8 against ``bits=7,sparse=0.1,alloc=1``, a tie as committed) and fp8, KIVI-4 and
int5 against theirs, each into ``--out`` (``ppl-<method>.json``, a file that exists is kept), then writes for each
method its loss against FP and the frontier pairs (paired over the windows), pinned and as committed:

    python benchmarks/eval_pinned.py --json benchmarks/results/numerics/default-20w.json

Once compared (2026-12-07), the pinned files replaced the committed ones in ``docs/results/default-20w`` (the JSON
above keeps both sides' numbers); a rerun now compares pinned runs with pinned files.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

from oakenkv.bench.results import meta, start
from oakenkv.eval.report import paired_delta
from oakenkv.util.paths import atomic_write

ROOT = Path(__file__).resolve().parents[1]

BITS3 = "oaken-plus:bits=3,sparse=0.05,rot_k=1,rot_v=1,static=1,levels=1,alloc=1"
BITS4 = "oaken-plus:bits=4,sparse=0.05,rot_k=1,rot_v=1,static=1,levels=1,alloc=1"
BITS7 = "oaken-plus:bits=7,sparse=0.1,alloc=1"
LEADING = ("fp", "kvquant4", "kvquant3", "oaken-plus", BITS4, BITS3)
METHODS = (*LEADING, "int8", BITS7, "fp8", "oaken-plus-7", "kivi4", "int5")
#: (ours, peer) pairs the frontier table of docs/results.md reports for the default model, 20 windows
PAIRS = (
    (BITS4, "kvquant4"),
    (BITS3, "kvquant3"),
    ("oaken-plus", "kvquant4"),
    (BITS7, "int8"),
    ("oaken-plus-7", "fp8"),
    ("oaken-plus", "kivi4"),
    ("oaken-plus", "int5"),
)


def stem(method: str) -> str:
    return "ppl-" + method.translate(str.maketrans(":=,", "___")) + ".json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/numerics/default-20w")
    ap.add_argument("--committed", type=Path, default=ROOT / "docs/results/default-20w")
    ap.add_argument("--windows", type=int, default=20)
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args()
    start()
    args.out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, dict[str, dict]] = {"pinned": {}, "committed": {}}
    for m in METHODS:
        f = args.out / stem(m)
        if not f.exists():
            cmd = [str(ROOT / ".venv/bin/oakenkv"), "eval", "ppl", "--model", "default", "--method", m]
            subprocess.run([*cmd, "--max-windows", str(args.windows), "--json", str(f)], check=True)
        runs["pinned"][m] = json.loads(f.read_text())
        runs["committed"][m] = json.loads((args.committed / stem(m)).read_text())
    out: dict = {"what": __doc__.split("\n\n")[0], "methods": {}, "pairs": {}}
    for m in METHODS:
        row = {}
        for kind, rs in runs.items():
            r, fp = rs[m], rs["fp"]
            d = paired_delta(r["window_nll"], fp["window_nll"], r["tokens"]) if m != "fp" else None
            row[kind] = {
                "ppl": r["ppl"],
                "bits": r["effective_bits"],
                "vs_fp": d,
                "numerics": r.get("extra", {}).get("numerics", {}).get("torch_cpu_capability", "not recorded"),
            }
        pin, com = runs["pinned"][m], runs["committed"][m]
        row["pinned_minus_committed"] = paired_delta(pin["window_nll"], com["window_nll"], pin["tokens"])
        out["methods"][m] = row
    for ours, peer in PAIRS:
        out["pairs"][f"{ours} - {peer}"] = {
            kind: paired_delta(rs[ours]["window_nll"], rs[peer]["window_nll"], rs[ours]["tokens"])
            for kind, rs in runs.items()
        }
    out["meta"] = meta()
    atomic_write(args.json, json.dumps(out, indent=2) + "\n")
    for m, row in out["methods"].items():
        p, c = row["pinned"], row["committed"]
        vp = "" if p["vs_fp"] is None else f"{p['vs_fp'][0]:+.3f}"
        vc = "" if c["vs_fp"] is None else f"{c['vs_fp'][0]:+.3f}"
        print(f"{m:72s} pinned {p['ppl']:.4f} ({vp}) committed {c['ppl']:.4f} ({vc})")
    for k, v in out["pairs"].items():
        print(
            f"{k:72s} pinned {v['pinned'][0]:+.3f} [{v['pinned'][1]:+.3f}, {v['pinned'][2]:+.3f}] "
            f"committed {v['committed'][0]:+.3f}"
        )
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
