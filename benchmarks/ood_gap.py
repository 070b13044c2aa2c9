"""Is Oaken's out-of-domain loss a calibration mismatch? The gap to FP, paired over windows, of runs that differ
only in their calibration text or in adaptive grouping (issue #36, "adaptive grouping halves the gap").

Each run is ``oakenkv eval ppl`` over the same windows (a subprocess; its JSON kept under ``--runs``): FP, the
method calibrated on the default calibration text (Wikipedia), the same with adaptive grouping, and the same
calibrated on *the evaluated domain itself* (a part of the text file that the scored windows do not touch: its last
``--calib-bytes``). If calibrating on the target domain does not shrink the gap, no adaptation of the thresholds to
that domain can (adaptive grouping moves the same thresholds, online): the loss is the quantization's own.

For every run: perplexity, its gap to FP with a 95% paired-bootstrap interval over windows (2000 resamples, the
same windows for both), the effective bits; for every run against the first: the ratio of the gaps and their
difference, with the same paired intervals.

    python benchmarks/make_python_text.py /tmp/oakenkv-python-stdlib.txt
    python benchmarks/ood_gap.py --text-file /tmp/oakenkv-python-stdlib.txt --windows 16 --window 1024 \\
        --out benchmarks/results/ood/default-python-16x1024.json
    python benchmarks/ood_gap.py --windows 8 --window 2048 --out benchmarks/results/ood/default-wikitext2-8x2048.json

A run is named ``METHOD`` or ``METHOD@target`` (calibrated on the text file's tail); ``--reuse`` keeps run JSONs
already under ``--runs`` (same model, method and windows: checked).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

DEFAULT_RUNS = ("oaken-plus", "oaken-plus:adapt=1", "oaken-plus@target", "oaken-plus:adapt=1@target")


def _file_name(run: str) -> str:
    return "ppl-" + "".join(c if c.isalnum() or c in "-." else "_" for c in run) + ".json"


def write_tail(text_file: Path, tail_bytes: int, out: Path, scored_chars: int) -> Path:
    """The last ``tail_bytes`` of ``text_file`` (from its first line break on) as ``out``; refused when it would
    overlap the first ``scored_chars`` characters (what the scored windows read, with a wide margin)."""
    text = text_file.read_text(encoding="utf-8")
    start = max(0, len(text) - tail_bytes)
    start = text.index("\n", start) + 1 if "\n" in text[start:] else start
    if start < scored_chars:
        raise SystemExit(
            f"{text_file}: its last {tail_bytes} characters overlap the scored windows (the first ~{scored_chars}); "
            "use a longer text or a smaller --calib-bytes"
        )
    out.write_text(text[start:], encoding="utf-8")
    return out


def run_eval(args: argparse.Namespace, run: str, path: Path, calib: Path | None) -> list[str]:
    method, _, where = run.partition("@")
    cmd = [sys.executable, "-m", "oakenkv.cli", "eval", "ppl", "--model", args.model, "--method", method]
    cmd += ["--max-windows", str(args.windows), "--window", str(args.window), "--json", str(path)]
    if args.text_file is not None:
        cmd += ["--text-file", str(args.text_file)]
    if where:
        if where != "target" or calib is None:
            raise SystemExit(
                f"run {run!r}: '@target' (calibrated on the text file's tail) is the only suffix, and needs --text-file"
            )
        cmd += ["--calib-path", str(calib), "--calib-samples", str(args.calib_samples)]
        cmd += ["--calib-window", str(args.calib_window)]
    if not (args.reuse and path.exists()):
        print("==>", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
    return cmd


def _ppl(nll: np.ndarray, tokens_per_window: float) -> np.ndarray:
    return np.exp(nll.sum(axis=-1) / (tokens_per_window * nll.shape[-1]))


def summarize(results: dict[str, dict], names: list[str], n_boot: int = 2000) -> dict:
    """Gaps to FP and their differences against ``names[0]`` with the evaluation report's paired-bootstrap intervals
    (``oakenkv.eval.report.paired_delta``), and the gap ratios with an interval from the same resampled windows
    (the same generator and seed: a resample's ratio pairs that resample's gaps)."""
    from oakenkv.eval.report import paired_delta

    fp = np.asarray(results["fp"]["window_nll"], dtype=np.float64)
    tokens = results["fp"]["tokens"]
    for name in names:
        r = results[name]
        if r["tokens"] != tokens or len(r["window_nll"]) != fp.size:
            raise SystemExit(f"run {name!r} scored other windows than FP ({r['tokens']} tokens vs {tokens})")
    per_window = tokens / fp.size
    idx = np.random.default_rng(0).integers(0, fp.size, size=(n_boot, fp.size))  # (paired_delta's draw)
    nll = {name: np.asarray(results[name]["window_nll"], dtype=np.float64) for name in names}
    boot = {name: _ppl(nll[name][idx], per_window) - _ppl(fp[idx], per_window) for name in names}
    rows = {}
    for name in names:
        gap, lo, hi = paired_delta(nll[name], fp, tokens, n_boot=n_boot)
        rows[name] = {
            "method": results[name]["method"],
            "calibration": results[name].get("extra", {}).get("calibration"),
            "ppl": results[name]["ppl"],
            "effective_bits": results[name]["effective_bits"],
            "gap": gap,
            "gap_ci95": [lo, hi],
        }
    base = names[0]
    for name in names[1:]:
        diff, lo, hi = paired_delta(nll[name], nll[base], tokens, n_boot=n_boot)
        rows[name]["vs_" + base] = {
            "gap_ratio": rows[name]["gap"] / rows[base]["gap"] if rows[base]["gap"] else math.nan,
            "gap_ratio_ci95": [float(x) for x in np.quantile(boot[name] / boot[base], [0.025, 0.975])],
            "gap_difference": diff,
            "gap_difference_ci95": [lo, hi],
        }
    return {"fp_ppl": float(_ppl(fp, per_window)), "tokens": tokens, "windows": int(fp.size), "runs": rows}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--text-file", type=Path, default=None, help="the evaluated text (default: WikiText-2)")
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--runs-list", default=",".join(DEFAULT_RUNS), help="comma-separated runs (module doc)")
    ap.add_argument("--calib-bytes", type=int, default=1_200_000, help="the text file's tail calibrated on")
    ap.add_argument("--calib-samples", type=int, default=16)
    ap.add_argument("--calib-window", type=int, default=2048)
    ap.add_argument("--runs", type=Path, default=None, help="where run JSONs go (default: next to --out)")
    ap.add_argument("--reuse", action="store_true", help="keep run JSONs already there")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)

    from oakenkv.bench.results import meta, start
    from oakenkv.util.paths import atomic_write

    start()
    names = [n for n in args.runs_list.split(",") if n]
    if args.text_file is None:
        names = [n for n in names if not n.endswith("@target")]
    runs_dir = args.runs or args.out.with_suffix("")
    runs_dir.mkdir(parents=True, exist_ok=True)
    calib = None
    tmp = tempfile.TemporaryDirectory(prefix="oakenkv-ood-")
    if args.text_file is not None:
        # ~4 characters per token of source code or prose: 8x that is far past what the windows read
        calib = write_tail(
            args.text_file,
            args.calib_bytes,
            Path(tmp.name) / "calibration-tail.txt",
            scored_chars=32 * args.windows * args.window,
        )
    results, commands = {}, {}
    for name in ["fp", *names]:
        path = runs_dir / _file_name(name)
        commands[name] = " ".join(["python", *run_eval(args, name, path, calib)[1:]])
        results[name] = json.loads(path.read_text(encoding="utf-8"))
        # (a run calibrated on a file is named "METHOD@file-<digest>-<samples>x<window>" by eval ppl)
        want = {
            "model": args.model,
            "method": name.partition("@")[0],
            "windows": args.windows,
            "window": args.window,
            "on_file": name.endswith("@target"),
        }
        got = {k: results[name].get(k) for k in want}
        got["method"], _, cal = str(got["method"]).partition("@")
        got["on_file"] = cal.startswith("file-")
        if got != want:
            raise SystemExit(f"{path}: a run of {got}, not {want} (remove it or drop --reuse)")
    tmp.cleanup()
    summary = summarize(results, names)
    body = {
        "kind": "ood_gap",
        "what": __doc__.splitlines()[0],
        "meta": meta(),
        "text_file": None if args.text_file is None else results["fp"]["extra"].get("text_file"),
        "calibration_tail_bytes": args.calib_bytes if calib is not None else None,
        "run_commands": commands,
        "run_files": {n: str(runs_dir / _file_name(n)) for n in ["fp", *names]},
        **summary,
    }
    atomic_write(args.out, json.dumps(body, indent=2) + "\n")
    print(f"FP {summary['fp_ppl']:.4f} over {summary['windows']} windows ({summary['tokens']} tokens)")
    for name, r in summary["runs"].items():
        lo, hi = r["gap_ci95"]
        line = f"{name:28s} gap {r['gap']:+.4f} [{lo:+.4f}, {hi:+.4f}] at {r['effective_bits']:.3f} bits"
        vs = r.get("vs_" + names[0])
        if vs:
            line += f"; gap ratio vs {names[0]} {vs['gap_ratio']:.2f} [{vs['gap_ratio_ci95'][0]:.2f}, "
            line += f"{vs['gap_ratio_ci95'][1]:.2f}]"
        print(line)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
