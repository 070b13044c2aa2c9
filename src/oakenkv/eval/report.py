"""Collect ``eval ppl`` / ``eval zeroshot`` JSON results into markdown tables and a Pareto plot.

Per model: a perplexity table (effective bits, perplexity, increase over FP), a zero-shot table (PIQA and
HellaSwag acc_norm, Winogrande acc, as the paper reports them) and one panel of the plot: perplexity increase
over FP against effective bits, with the Pareto frontier (no other method is both smaller and more accurate).
Result files with ``"kind": "thresholds_diff"`` (written by ``benchmarks/eval_peers.py``) add a section on how
much the profiled thresholds depend on the calibration text.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any


def load_results(paths: list[Path]) -> list[dict[str, Any]]:
    """Every JSON result in ``paths`` (files, or directories searched recursively), sorted by file name."""
    files: list[Path] = []
    for p in paths:
        p = Path(p)
        if p.is_dir():
            files += sorted(p.rglob("*.json"))
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(f"no such result file or directory: {p}")
    out = []
    for f in files:
        try:
            d = json.loads(f.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{f} is not valid JSON: {e}") from e
        if isinstance(d, dict) and d.get("kind") in ("ppl", "zeroshot", "thresholds_diff"):
            d["_file"] = str(f)
            out.append(d)
    return out


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points (bits, loss) that no other point beats on both (sorted by bits)."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1]))
    front, best = [], math.inf
    for i in order:
        if points[i][1] < best:
            front.append(i)
            best = points[i][1]
    return front


def _fmt(x: float, nd: int = 3) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def ppl_table(rows: list[dict[str, Any]]) -> str:
    """Markdown table of one model's perplexity results, FP first then by effective bits."""
    fp = next((r for r in rows if r["method"] == "fp" and not r.get("chunk")), None)
    lines = [
        "| method | eff. bits | perplexity | Δ vs FP | tokens | windows | keys quantized | note |",
        "|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r["method"] != "fp", r["effective_bits"], r["method"])):
        d = r["ppl"] - fp["ppl"] if fp else float("nan")
        name = r["method"] + (f" (chunk {r['chunk']})" if r.get("chunk") else "")
        kp = r.get("extra", {}).get("key_position", "")
        kp = {"post_rope": "post-RoPE", "pre_rope": "pre-RoPE"}.get(kp, kp) if r["method"] != "fp" else "-"
        lines.append(
            f"| {name} | {_fmt(r['effective_bits'], 2)} | {_fmt(r['ppl'], 4)} | {d:+.4f} | {r['tokens']} | "
            f"{r['windows']} | {kp} | {r.get('extra', {}).get('note', '')} |"
        )
    return "\n".join(lines)


def zeroshot_table(rows: list[dict[str, Any]]) -> str:
    """Markdown table of one model's zero-shot results (the paper's metrics, plus acc / acc_norm)."""
    tasks = ["piqa", "winogrande", "hellaswag"]
    head = (
        "| method | eff. bits | "
        + " | ".join(f"{t} ({'acc' if t == 'winogrande' else 'acc_norm'})" for t in tasks)
        + " | mean | docs per task |"
    )
    lines = [head, "|---|---:|" + "---:|" * (len(tasks) + 2)]
    for r in sorted(rows, key=lambda r: (r["method"] != "fp", r["effective_bits"], r["method"])):
        vals = [r["tasks"].get(t, {}).get("reported") for t in tasks]
        have = [v for v in vals if v is not None]
        n = {r["tasks"][t].get("n") for t in tasks if t in r["tasks"]}
        lines.append(
            f"| {r['method']} | {_fmt(r['effective_bits'], 2)} | "
            + " | ".join("n/a" if v is None else f"{100 * v:.2f}" for v in vals)
            + f" | {100 * sum(have) / len(have):.2f} | {'/'.join(str(x) for x in sorted(n))} |"
        )
    return "\n".join(lines)


def thresholds_diff_section(rows: list[dict[str, Any]]) -> str:
    out = []
    for r in rows:
        out.append(f"Model `{r['model']}`, reference calibration text `{r['reference']}`.\n")
        out.append(
            "| calibration text | mean abs(threshold - reference) / (to_hi - to_lo) | max | ppl | Δ ppl vs reference |"
        )
        out.append("|---|---:|---:|---:|---:|")
        for t in r["texts"]:
            out.append(
                f"| {t['text']} | {_fmt(t['mean_rel_diff'], 4)} | {_fmt(t['max_rel_diff'], 4)} | "
                f"{_fmt(t.get('ppl'), 4)} | {_fmt(t.get('ppl_delta'), 4)} |"
            )
        out.append("")
    return "\n".join(out)


def plot_pareto(by_model: dict[str, list[dict[str, Any]]], path: Path) -> None:
    """One panel per model: perplexity increase over FP vs effective bits, Pareto frontier drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted(by_model)
    fig, axes = plt.subplots(1, max(1, len(models)), figsize=(6.5 * max(1, len(models)), 5), squeeze=False)
    for ax, m in zip(axes[0], models, strict=False):
        # quanto in one forward per window never quantizes what attention reads (its prefill is returned as is):
        # a point at "4.5 bits, no loss" would be misleading, so only its chunked (decode-like) rows are drawn.
        # Ablations (only the keys or only the values quantized) are diagnostics, not methods: not drawn.
        rows = [
            r
            for r in by_model[m]
            if r["method"] != "fp"
            and not (r.get("extra", {}).get("family") == "quanto" and not r.get("chunk"))
            and r.get("extra", {}).get("params", {}).get("only", "kv") == "kv"
        ]
        fp = next((r for r in by_model[m] if r["method"] == "fp" and not r.get("chunk")), None)
        if not rows or fp is None:
            ax.set_title(f"{m}: no FP baseline")
            continue
        pts = [(r["effective_bits"], r["ppl"] - fp["ppl"]) for r in rows]
        for r, (x, y) in zip(rows, pts, strict=True):
            is_oaken = r["method"].startswith("oaken")
            ax.scatter(x, y, c="tab:red" if is_oaken else "tab:blue", s=30, zorder=3)
            label = r["method"] + (f" (chunk {r['chunk']})" if r.get("chunk") else "")
            ax.annotate(label, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        front = pareto_front(pts)
        ax.plot([pts[i][0] for i in front], [pts[i][1] for i in front], "k--", lw=0.8, label="Pareto frontier")
        ax.axhline(0, color="grey", lw=0.5)
        if max(p[1] for p in pts) > 20 * max(min(abs(p[1]) for p in pts), 0.05):
            ax.set_yscale("symlog", linthresh=1.0)  # one collapsed method would flatten every other point
        ax.set_xlabel("effective bits per K/V value")
        ax.set_ylabel(f"perplexity increase over FP ({fp['ppl']:.3f})")
        ax.set_title(f"{m}: WikiText-2, {fp['windows']} x {fp['window']} tokens")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(paths: list[Path], out: Path, plot: Path, header: Path | None = None) -> str:
    """Write the markdown report ``out`` and the plot ``plot`` from the results in ``paths``; returns the text."""
    results = load_results(paths)
    if not results:
        raise ValueError(f"no ppl/zeroshot JSON results found in {', '.join(map(str, paths))}")
    ppl: dict[str, list[dict[str, Any]]] = defaultdict(list)
    zs: dict[str, list[dict[str, Any]]] = defaultdict(list)
    diffs = []
    for r in results:
        if r["kind"] == "ppl":
            ppl[r.get("model", "")].append(r)
        elif r["kind"] == "zeroshot":
            zs[r.get("model", "")].append(r)
        else:
            diffs.append(r)
    parts = [Path(header).read_text().rstrip() + "\n"] if header else ["# Results\n"]
    panels: dict[str, list[dict[str, Any]]] = {}
    for m in sorted(set(ppl) | set(zs)):
        parts.append(f"## Model `{m}`\n")
        # Runs over different numbers of windows score different tokens: one table (and plot panel) each,
        # the largest first.
        groups: dict[tuple[Any, ...], list[dict[str, Any]]] = defaultdict(list)
        for r in ppl.get(m, []):
            groups[(r.get("windows"), r.get("window"), r.get("stride"))].append(r)
        for key in sorted(groups, key=lambda k: -(k[0] or 0)):
            rows = groups[key]
            r0 = rows[0]
            parts.append(
                f"### WikiText-2 perplexity ({r0.get('windows')} window(s) of {r0.get('window')} tokens, "
                f"stride {r0.get('stride')})\n"
            )
            parts.append(ppl_table(rows) + "\n")
            panels[m if len(groups) == 1 else f"{m}, {key[0]} windows"] = rows
        if zs.get(m):
            parts.append(f"### Zero-shot (first {zs[m][0].get('limit')} validation documents per task)\n")
            parts.append(zeroshot_table(zs[m]) + "\n")
    if diffs:
        parts.append("## Do the thresholds depend on the profiling text?\n")
        parts.append(thresholds_diff_section(diffs))
    plot_pareto(panels, plot)
    parts.append(
        f"\n![perplexity increase vs effective bits]({Path(plot).name})\n\n"
        "Red: Oaken variants; blue: peers; dashed: Pareto frontier. quanto's one-forward rows are not drawn (their "
        "prefill is unquantized, see above), nor the keys-only / values-only ablations.\n"
    )
    text = "\n".join(parts)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return text
