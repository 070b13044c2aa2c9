"""Collect ``eval ppl`` / ``eval zeroshot`` JSON results into markdown tables and a frontier plot.

Per model: a perplexity table (effective bits, perplexity, increase over FP), the frontier table (for every peer's
point, oakenkv's best preset at no more bits, paired), a zero-shot table (PIQA and HellaSwag acc_norm, Winogrande
acc, as the paper reports them) and one panel of the plot: perplexity increase over FP against effective bits,
with oakenkv's frontier and the peers' (the best loss at each number of bits or fewer).
Result files with ``"kind": "thresholds_diff"`` (written by ``benchmarks/eval_peers.py``) add a section on how
much the profiled thresholds depend on the calibration text.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from oakenkv.util.paths import atomic_write
from oakenkv.util.text import printable


def load_results(paths: list[Path]) -> list[dict[str, Any]]:
    """Every JSON result in ``paths`` (files, or directories searched recursively), sorted by file name.

    Every file is read as untrusted: a regular file of at most ``MAX_RESULT_BYTES`` (a pipe named ``x.json`` in a
    results directory would block, ``/dev/zero`` would never end), valid JSON, and each result with the exact types
    of the fields the report uses (:func:`check_result`; a bool is not a count, a string not a perplexity), so
    that a malformed file is one error naming it, not a traceback half-way through the report. Text fields are
    made safe for a markdown table (``|`` escaped, control characters visible)."""
    from oakenkv.util.paths import MAX_RESULT_BYTES, check_input_file, read_text_capped

    files: list[Path] = []
    for p in paths:
        p = Path(p)
        if p.is_dir():
            files += sorted(p.rglob("*.json"))
        elif p.exists():
            files.append(check_input_file(p, "result file", MAX_RESULT_BYTES))
        else:
            raise FileNotFoundError(f"no such result file or directory: {p}")
    seen: set[Path] = set()  # (a file named twice, or inside a folder also named, is one result)
    files = [f for f in files if not (f.resolve() in seen or seen.add(f.resolve()))]
    out = []
    for f in files:
        text = read_text_capped(f, "result file", MAX_RESULT_BYTES)
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{f} is not valid JSON: {e}") from e
        except RecursionError as e:
            raise ValueError(f"{f}: JSON nested too deeply to be a result") from e
        if isinstance(d, dict) and d.get("kind") in ("ppl", "zeroshot", "thresholds_diff"):
            check_result(d, f)
            d["_file"] = str(f)
            out.append(d)
    return out


#: The fields of a result the report reads, per kind: name -> (accepted types, required). ``float`` accepts ints
#: (JSON writes 5.0 as 5); ``int`` accepts no float and no bool (util.exact).
_RESULT_FIELDS: dict[str, dict[str, tuple[tuple[type, ...], bool]]] = {
    "ppl": {
        "method": ((str,), True),
        "model": ((str,), False),
        "ppl": ((float,), True),
        "effective_bits": ((float,), True),
        "tokens": ((int,), True),
        "windows": ((int,), True),
        "window": ((int, type(None)), False),
        "stride": ((int, type(None)), False),
        "chunk": ((int, type(None)), False),
        "dataset": ((str,), False),
        "extra": ((dict,), False),
        "window_nll": ((list, type(None)), False),
    },
    "zeroshot": {
        "method": ((str,), True),
        "model": ((str,), False),
        "effective_bits": ((float,), True),
        "tasks": ((dict,), True),
        "limit": ((int, type(None)), False),
        "extra": ((dict,), False),
    },
    "thresholds_diff": {"model": ((str,), True), "reference": ((str,), True), "texts": ((list,), True)},
}
_TASK_FIELDS = {
    "reported": ((float, type(None)), False),
    "reported_metric": ((str, type(None)), False),
    "n": ((int, type(None)), False),
    "per_doc": ((dict, type(None)), False),
}
_EXTRA_FIELDS = {
    "key_position": ((str, type(None)), False),
    "note": ((str, type(None)), False),
    "family": ((str, type(None)), False),
    "params": ((dict, type(None)), False),
    "text_file": ((dict, type(None)), False),
}
_TEXT_FIELDS = {
    "text": ((str,), True),
    "mean_rel_diff": ((float,), True),
    "max_rel_diff": ((float,), True),
    "ppl": ((float, type(None)), False),
    "ppl_delta": ((float, type(None)), False),
}


def _typed(v: Any, types: tuple[type, ...]) -> bool:
    from oakenkv.util.exact import is_int, is_number

    for t in types:
        if (t is float and is_number(v)) or (t is int and is_int(v)) or (t not in (int, float) and isinstance(v, t)):
            return True
    return False


def _check_fields(d: dict[str, Any], spec: dict[str, tuple[tuple[type, ...], bool]], where: str) -> None:
    for name, (types, required) in spec.items():
        if name not in d:
            if required:
                raise ValueError(f"{where}: missing field {name!r}")
            continue
        if not _typed(d[name], types):
            want = " or ".join("null" if t is type(None) else t.__name__ for t in types)
            raise ValueError(f"{where}: field {name!r} must be {want}, got {printable(repr(d[name]), limit=60)}")


def check_result(d: dict[str, Any], source: Any = "<result>") -> None:
    """Raise ValueError naming ``source`` unless ``d`` (an ``eval ppl`` / ``eval zeroshot`` / thresholds-diff result)
    has the fields the report reads, with exact types; then make its text fields safe for markdown, in place."""
    kind = d.get("kind")
    _check_fields(d, _RESULT_FIELDS[kind], f"{source}")
    if kind == "ppl" and d.get("window_nll") is not None and not all(_typed(x, (float,)) for x in d["window_nll"]):
        raise ValueError(f"{source}: field 'window_nll' must be a list of numbers")
    if kind == "zeroshot":
        for t, e in d["tasks"].items():
            if not isinstance(e, dict):
                raise ValueError(f"{source}: task {printable(t, limit=40)!r} must be an object")
            _check_fields(e, _TASK_FIELDS, f"{source}: task {printable(t, limit=40)}")
    if kind == "thresholds_diff":
        for i, t in enumerate(d["texts"]):
            if not isinstance(t, dict):
                raise ValueError(f"{source}: texts[{i}] must be an object")
            _check_fields(t, _TEXT_FIELDS, f"{source}: texts[{i}]")
            t["text"] = _md(t["text"])
    for name in ("method", "model", "reference", "dataset"):
        if isinstance(d.get(name), str):
            d[name] = _md(d[name])
    extra = d.get("extra")
    if isinstance(extra, dict):
        _check_fields(extra, _EXTRA_FIELDS, f"{source}: extra")
        for name in ("note", "key_position", "family"):
            if isinstance(extra.get(name), str):
                extra[name] = _md(extra[name])


def _md(text: str) -> str:
    """Text from a result file as a markdown table cell holds it: control characters visible, ``|`` escaped."""
    return printable(text, limit=300).replace("|", "\\|")


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points (bits, loss) that no other point beats on both (sorted by bits)."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1]))
    front, best = [], math.inf
    for i in order:
        if points[i][1] < best:
            front.append(i)
            best = points[i][1]
    return front


def paired_delta(
    nll_a: list[float], nll_b: list[float], tokens: int, *, n_boot: int = 2000, seed: int = 0
) -> tuple[float, float, float]:
    """``ppl_a - ppl_b`` over the same windows and its 95% paired-bootstrap interval ``(delta, low, high)``.

    ``nll_a`` / ``nll_b``: summed NLL of each window (``PplResult.window_nll``) of two runs over the same windows;
    ``tokens``: predicted tokens in all. Windows are resampled with replacement, the same ones for both methods,
    so what the windows share (hard text, easy text) cancels and only the methods' difference varies.
    """
    import numpy as np

    a, b = np.asarray(nll_a, dtype=np.float64), np.asarray(nll_b, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1 or a.size < 2:
        raise ValueError(f"paired_delta needs two equally long lists of >= 2 window NLLs, got {a.shape} and {b.shape}")
    per_window = tokens / a.size
    delta = math.exp(a.sum() / tokens) - math.exp(b.sum() / tokens)
    idx = np.random.default_rng(seed).integers(0, a.size, size=(n_boot, a.size))
    boot = np.exp(a[idx].mean(axis=1) / per_window) - np.exp(b[idx].mean(axis=1) / per_window)
    lo, hi = np.quantile(boot, [0.025, 0.975])
    return float(delta), float(lo), float(hi)


def paired_accuracy(
    a: list[int], b: list[int], *, n_boot: int = 2000, seed: int = 0
) -> tuple[float, float, float, int, int]:
    """Accuracy of ``a`` minus that of ``b`` (0/1 per document, the same documents) with its 95% paired-bootstrap
    interval, and the documents only ``a`` answers right / only ``b`` does: ``(delta, low, high, gained, lost)``.

    Documents are resampled with replacement, the same ones for both, so only the answers that differ between
    the two methods move the interval (documents both get right or both get wrong cancel).
    """
    import numpy as np

    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1 or x.size < 2:
        raise ValueError(f"paired_accuracy needs two equally long lists of >= 2 scores, got {x.shape} and {y.shape}")
    d = x - y
    idx = np.random.default_rng(seed).integers(0, d.size, size=(n_boot, d.size))
    lo, hi = np.quantile(d[idx].mean(axis=1), [0.025, 0.975])
    return float(d.mean()), float(lo), float(hi), int((d > 0).sum()), int((d < 0).sum())


def _paired(r: dict[str, Any], ref: dict[str, Any] | None) -> tuple[float, float, float] | None:
    """:func:`paired_delta` of two result rows when both hold per-window NLLs of the same windows."""
    if ref is None or r is ref:
        return None
    a, b = r.get("window_nll") or [], ref.get("window_nll") or []
    if len(a) < 2 or len(a) != len(b) or r.get("tokens") != ref.get("tokens") or r.get("window") != ref.get("window"):
        return None
    return paired_delta(a, b, r["tokens"])


def _ci(p: tuple[float, float, float] | None) -> str:
    return "" if p is None else f"[{p[1]:+.3f}, {p[2]:+.3f}]"


def _fmt(x: float, nd: int = 3) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


#: The method families that are oakenkv's presets (the frontier's "ours"); ``oaken-official`` reproduces the paper
#: authors' harness and is neither ours nor a peer's system.
OURS = ("oaken", "oaken-plus")
NEITHER = ("fp", "oaken-official")


def _family(r: dict[str, Any]) -> str:
    return r.get("extra", {}).get("family") or r["method"].split(":")[0]


def _drawn(r: dict[str, Any]) -> bool:
    """Whether a result is a method's point on the frontier: not FP, not quanto in one forward per window (its
    prefill is never quantized), not a keys-only or values-only ablation."""
    return (
        r["method"] != "fp"
        and not (_family(r) == "quanto" and not r.get("chunk"))
        and r.get("extra", {}).get("params", {}).get("only", "kv") == "kv"
    )


def _name(r: dict[str, Any]) -> str:
    return r["method"] + (f" (chunk {r['chunk']})" if r.get("chunk") else "")


def frontier(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For every peer's point of one group of runs (same model, text and windows), sorted by bits: oakenkv's best
    run at no more bits (least perplexity) and the paired difference. Each entry: ``peer``, ``ours`` (None when
    no preset is that small), ``delta`` (ours - peer) with its 95% paired-bootstrap interval ``ci`` (None without
    per-window NLLs) and ``holds`` (ours loses no more)."""
    drawn = [r for r in rows if _drawn(r) and _family(r) not in NEITHER]
    # a relabelled run (``extra.relabelled``: an earlier session's profile, which today's search does not make) is
    # history, not a point a user can reproduce: never oakenkv's point on the frontier
    ours = [r for r in drawn if _family(r) in OURS and not r.get("extra", {}).get("relabelled")]
    peers = sorted((r for r in drawn if _family(r) not in OURS), key=lambda r: (r["effective_bits"], r["method"]))
    out = []
    for p in peers:
        fit = [r for r in ours if r["effective_bits"] <= p["effective_bits"] + 1e-9]
        best = min(fit, key=lambda r: (r["ppl"], r["effective_bits"])) if fit else None
        entry: dict[str, Any] = {"peer": p, "ours": best, "delta": None, "ci": None, "holds": False}
        if best is not None:
            entry["delta"] = best["ppl"] - p["ppl"]
            entry["ci"] = _paired(best, p)
            entry["holds"] = entry["delta"] <= 0
        out.append(entry)
    return out


def frontier_table(rows: list[dict[str, Any]], files: bool = False) -> str:
    """Markdown of :func:`frontier` (empty when the group has no peer or no FP run); ``files``: a last column with
    each point's JSON result file."""
    fp = next((r for r in rows if r["method"] == "fp" and not r.get("chunk")), None)
    entries = frontier(rows)
    if fp is None or not entries:
        return ""
    head = "| peer | bits | Δ vs FP | oakenkv at <= its bits | bits | Δ vs FP | oakenkv − peer (95% CI) | holds |"
    lines = [head + (" JSON (peer; oakenkv) |" if files else ""), "|---|---:|---:|---|---:|---:|---:|---|"]
    if files:
        lines[1] += "---|"
    for e in entries:
        p, o = e["peer"], e["ours"]
        left = f"| {_name(p)} | {_fmt(p['effective_bits'], 2)} | {p['ppl'] - fp['ppl']:+.3f} |"
        where = f" `{p.get('_file', '')}`; `{o.get('_file', '')}` |" if files and o else " |" if files else ""
        if o is None:
            lines.append(left + " none that small | | | | no |" + (f" `{p.get('_file', '')}` |" if files else ""))
            continue
        ci = "" if e["ci"] is None else f" {_ci(e['ci'])}"
        lines.append(
            left + f" {_name(o)} | {_fmt(o['effective_bits'], 2)} | {o['ppl'] - fp['ppl']:+.3f} | "
            f"{e['delta']:+.3f}{ci} | {'yes' if e['holds'] else 'no'} |" + where
        )
    lines.append(
        "\nFor every peer's point, the oakenkv run (oaken, oaken-plus and their presets) with the least perplexity "
        "at no more bits; holds: it loses no more than the peer (the point estimate; the interval is the paired "
        "bootstrap over windows)."
    )
    shown = {id(r): r for e in entries for r in (fp, e["peer"], e["ours"]) if r is not None}
    note = numerics_note(list(shown.values()))  # (the pairs' own rows: their kernels are part of the margin)
    return "\n".join(lines) + (note and "\n" + note)


def _text(r: dict[str, Any]) -> str:
    """The evaluation text of a result, for titles: WikiText-2, or the text file's name."""
    if r.get("dataset") == "file":
        path = (r.get("extra", {}).get("text_file") or {}).get("path")
        return "text file " + (_md(Path(path).name) if isinstance(path, str) else "?")
    return {"wikitext2": "WikiText-2"}.get(r.get("dataset", "wikitext2"), r.get("dataset", ""))


def _capability(r: dict[str, Any]) -> str | None:
    """torch's CPU kernels a result was computed with (``extra.numerics``, oakenkv.util.numerics), or None when the
    result does not say (made before oakenkv recorded it, or damaged)."""
    extra = r.get("extra")
    n = extra.get("numerics") if isinstance(extra, dict) else None
    cap = n.get("torch_cpu_capability") if isinstance(n, dict) else None
    return _md(printable(cap, limit=20)) if isinstance(cap, str) else None


def numerics_note(rows: list[dict[str, Any]]) -> str:
    """A line saying which rows were computed with which of torch's CPU kernels, when they were not all computed
    with the same (known) ones: such rows differ in the last bits before quantization amplifies it, so their paired
    intervals carry that spread too (docs/results.md, "Numerics between machines"). "" when all agree."""
    caps = [_capability(r) for r in rows]
    if len(set(caps)) < 2:
        return ""
    by: dict[str, list[str]] = defaultdict(list)
    for r, c in zip(rows, caps, strict=True):
        by["not recorded" if c is None else f"torch {c} kernels"].append(str(r.get("method", "?")))  # (checked)
    parts = [f"{k}: {', '.join(sorted(v))}" for k, v in sorted(by.items())]
    return (
        "\nNumerics differ between these rows (" + "; ".join(parts) + "): results computed with other CPU kernels "
        "differ in the last bits, which quantization amplifies (oakenkv.util.numerics); `oakenkv eval` pins torch's "
        "AVX2 kernels so that new runs agree on every x86-64 machine."
    )


def ppl_table(rows: list[dict[str, Any]]) -> str:
    """Markdown table of one model's perplexity results, FP first then by effective bits."""
    fp = next((r for r in rows if r["method"] == "fp" and not r.get("chunk")), None)
    oaken = next((r for r in rows if r["method"] == "oaken" and not r.get("chunk")), None)
    # 95% paired-bootstrap intervals over windows, where the runs recorded per-window NLLs (window_nll)
    vs_fp = [_paired(r, fp) for r in rows]
    paired = any(vs_fp)
    ci_head = " Δ 95% CI | − oaken (95% CI) |" if paired else ""
    lines = [
        f"| method | eff. bits | perplexity | Δ vs FP |{ci_head} tokens | windows | keys quantized | note |",
        "|---|---:|---:|---:|" + ("---:|---:|" if paired else "") + "---:|---:|---|---|",
    ]
    order = sorted(
        range(len(rows)), key=lambda i: (rows[i]["method"] != "fp", rows[i]["effective_bits"], rows[i]["method"])
    )
    for i in order:
        r = rows[i]
        d = r["ppl"] - fp["ppl"] if fp else float("nan")
        name = r["method"] + (f" (chunk {r['chunk']})" if r.get("chunk") else "")
        kp = r.get("extra", {}).get("key_position", "")
        kp = {"post_rope": "post-RoPE", "pre_rope": "pre-RoPE"}.get(kp, kp) if r["method"] != "fp" else "-"
        cis = ""
        if paired:
            vs_oaken = _paired(r, oaken)
            vs = "" if vs_oaken is None else f"{vs_oaken[0]:+.3f} {_ci(vs_oaken)}"
            cis = f" {_ci(vs_fp[i])} | {vs} |"
        lines.append(
            f"| {name} | {_fmt(r['effective_bits'], 2)} | {_fmt(r['ppl'], 4)} | {d:+.4f} |{cis} {r['tokens']} | "
            f"{r['windows']} | {kp} | {r.get('extra', {}).get('note', '')} |"
        )
    if paired:
        lines.append(
            "\nΔ 95% CI: paired bootstrap over the windows (2000 resamples) of the method's perplexity minus FP's; "
            "− oaken: the method's perplexity minus Oaken's, with its interval (negative: the method loses less "
            "than Oaken; an interval that holds 0: no difference this evaluation can tell)."
        )
    note = numerics_note(rows)
    if note:
        lines.append(note)
    return "\n".join(lines)


ZS_TASKS = ("piqa", "winogrande", "hellaswag")


def _zs_tasks(rows: list[dict[str, Any]]) -> list[str]:
    """The tasks any of ``rows`` ran, in the paper's order (a table shows only those columns)."""
    have = {t for r in rows for t in r["tasks"]}
    return [t for t in ZS_TASKS if t in have] + sorted(have - set(ZS_TASKS))


def zeroshot_table(rows: list[dict[str, Any]]) -> str:
    """Markdown table of one model's zero-shot results (the paper's metrics, plus acc / acc_norm)."""
    tasks = _zs_tasks(rows)
    mean = len(tasks) > 1  # a mean over one task would repeat its column
    head = (
        "| method | eff. bits | "
        + " | ".join(f"{t} ({'acc' if t == 'winogrande' else 'acc_norm'})" for t in tasks)
        + (" | mean" if mean else "")
        + " | docs per task |"
    )
    lines = [head, "|---|---:|" + "---:|" * (len(tasks) + 1 + mean)]
    for r in sorted(rows, key=lambda r: (r["method"] != "fp", r["effective_bits"], r["method"])):
        vals = [r["tasks"].get(t, {}).get("reported") for t in tasks]
        have = [v for v in vals if v is not None]
        # Documents per task in the columns' order; one number when every task ran the same count.
        n = [r["tasks"][t].get("n") for t in tasks if t in r["tasks"]]
        n = n[:1] if len(set(n)) == 1 else n
        lines.append(
            f"| {r['method']} | {_fmt(r['effective_bits'], 2)} | "
            + " | ".join("n/a" if v is None else f"{100 * v:.2f}" for v in vals)
            + (f" | {100 * sum(have) / len(have):.2f}" if mean else "")
            + f" | {'/'.join(str(x) for x in n)} |"
        )
    return "\n".join(lines)


def zeroshot_paired_table(rows: list[dict[str, Any]]) -> str:
    """Markdown table: each method's accuracy minus FP's on the same documents (the paper's metric per task),
    with a 95% paired-bootstrap interval and the answers it gains / loses; empty without per-document scores."""
    tasks = _zs_tasks(rows)
    fp = next((r for r in rows if r["method"] == "fp"), None)
    if fp is None:
        return ""

    def scores(r: dict[str, Any], t: str) -> tuple[list[int], list[int]] | None:
        e = r["tasks"].get(t, {})
        pd = e.get("per_doc") or {}
        m = e.get("reported_metric") or ("acc" if t == "winogrande" else "acc_norm")
        return (pd["doc_id"], pd[m]) if m in pd and "doc_id" in pd else None

    lines = []
    for r in sorted(rows, key=lambda r: (r["effective_bits"], r["method"])):
        if r is fp:
            continue
        cells = []
        for t in tasks:
            a, b = scores(r, t), scores(fp, t)
            if a is None or b is None or a[0] != b[0] or len(a[0]) < 2:
                cells.append("n/a")
                continue
            d, lo, hi, gained, lost = paired_accuracy(a[1], b[1])
            cells.append(f"{100 * d:+.2f} [{100 * lo:+.2f}, {100 * hi:+.2f}] (+{gained}/−{lost})")
        if any(c != "n/a" for c in cells):
            lines.append(f"| {r['method']} | {_fmt(r['effective_bits'], 2)} | " + " | ".join(cells) + " |")
    if not lines:
        return ""
    head = [
        "| method | eff. bits | " + " | ".join(f"{t} Δ vs FP" for t in tasks) + " |",
        "|---|---:|" + "---:|" * len(tasks),
    ]
    note = (
        "\nΔ vs FP: the method's accuracy minus FP's in points on the same documents, 95% paired bootstrap "
        "(2000 resamples); (+g/−l): documents only the method answers right / only FP does. An interval that "
        "holds 0: no difference these documents can tell."
    )
    return "\n".join(head + lines) + "\n" + note


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


def label_offsets(
    anchors: list[tuple[float, float]],
    sizes: list[tuple[float, float]],
    gap: float = 3.0,
    tries: int = 40,
    right: float | None = None,
) -> list[tuple[float, float]]:
    """Where to put each point's label so that no two labels overlap: (dx, dy) from its point, in pixels.

    ``anchors`` are the points and ``sizes`` the labels' (width, height), both in pixels (y up). Greedy, in the
    order of the points from the top: a label goes right of its point, just above it; where that box meets a label
    already placed (or a point), it moves down and up by one label height at a time, nearest first. A label with
    no free place within ``tries`` steps keeps the default place. A label that would end beyond ``right`` (the
    axes' right edge) goes left of its point instead.
    """
    if len(anchors) != len(sizes):
        raise ValueError(f"{len(anchors)} anchors but {len(sizes)} label sizes")
    dot = 4.0  # half the marker's size in pixels: a label must not cover another point either
    points = [(x - dot, y - dot, x + dot, y + dot) for x, y in anchors]
    placed: list[tuple[float, float, float, float]] = []
    out: list[tuple[float, float]] = [(gap, gap)] * len(anchors)
    steps = [0] + [s for k in range(1, tries + 1) for s in (-k, k)]  # label heights to move by, nearest first

    def free(box: tuple[float, float, float, float], own: int) -> bool:
        x0, y0, x1, y1 = box
        others = placed + [b for j, b in enumerate(points) if j != own]
        return all(x1 <= a0 or x0 >= a1 or y1 <= b0 or y0 >= b1 for a0, b0, a1, b1 in others)

    for i in sorted(range(len(anchors)), key=lambda k: (-anchors[k][1], anchors[k][0])):
        (x, y), (w, h) = anchors[i], sizes[i]
        dx = -gap - w if right is not None and x + gap + w > right else gap
        out[i] = (dx, gap)
        for k in steps:
            dy = gap + k * (h + 1.0)
            box = (x + dx, y + dy, x + dx + w, y + dy + h)
            if free(box, i):
                out[i] = (dx, dy)
                placed.append(box)
                break
        else:
            placed.append((x + dx, y + gap, x + dx + w, y + gap + h))
    return out


def _place_labels(fig: Any, ax: Any, pts: list[tuple[float, float]], labels: list[str]) -> None:
    """Annotate each point with its label, moved (with a thin leader line) where labels would overlap.

    Call after the axes' scale, limits and the figure's layout are final: placement works in pixels.
    """
    renderer = fig.canvas.get_renderer()
    probe = [ax.annotate(t, p, fontsize=7) for t, p in zip(labels, pts, strict=True)]
    sizes = [(b.width, b.height) for b in (a.get_window_extent(renderer) for a in probe)]
    for a in probe:
        a.remove()
    ax.get_xlim(), ax.get_ylim()  # settles any pending autoscaling before data is mapped to pixels
    anchors = [(float(u), float(v)) for u, v in (ax.transData.transform(p) for p in pts)]
    px_to_pt = 72.0 / fig.dpi
    offsets = label_offsets(anchors, sizes, right=ax.bbox.x1)
    for t, p, (dx, dy), (_, h) in zip(labels, pts, offsets, sizes, strict=True):
        far = abs(dy) > h + 4  # moved away from its point: a leader line shows which point it names
        arrow = {"arrowstyle": "-", "lw": 0.4, "color": "grey", "shrinkA": 0, "shrinkB": 3} if far else None
        ax.annotate(
            t, p, fontsize=7, xytext=(dx * px_to_pt, dy * px_to_pt), textcoords="offset points", arrowprops=arrow
        )


def plot_pareto(by_model: dict[str, list[dict[str, Any]]], path: Path) -> None:
    """One panel per model: perplexity increase over FP vs effective bits, Pareto frontier drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted(by_model)
    ncols = min(3, max(1, len(models)))  # at most three panels per row, so that each stays readable
    nrows = -(-max(1, len(models)) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.5 * ncols, 5 * nrows), squeeze=False, dpi=120)
    flat = list(axes.flat)
    for ax in flat[len(models) :]:
        ax.set_visible(False)
    to_label = []  # (axes, points, labels): placed once the layout is final
    for ax, m in zip(flat, models, strict=False):
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
            color = "tab:grey" if _family(r) in NEITHER else "tab:red" if _family(r) in OURS else "tab:blue"
            ax.scatter(x, y, c=color, s=30, zorder=3)
        labels = [_name(r) for r in rows]
        to_label.append((ax, pts, labels))
        # each side's frontier: the least loss at each number of bits or fewer, as a staircase to the right edge
        right = max(p[0] for p in pts)
        for side, color, style in (("oakenkv frontier", "tab:red", "--"), ("peers' frontier", "tab:blue", ":")):
            mine = side.startswith("oakenkv")
            idx = [i for i, r in enumerate(rows) if _family(r) not in NEITHER and (_family(r) in OURS) == mine]
            front = [idx[j] for j in pareto_front([pts[i] for i in idx])]
            if front:
                xs = [pts[i][0] for i in front] + [right]
                ys = [pts[i][1] for i in front] + [pts[front[-1]][1]]
                ax.step(xs, ys, where="post", color=color, ls=style, lw=1.0, label=side)
        ax.axhline(0, color="grey", lw=0.5)
        ax.margins(x=0.06, y=0.08)  # room for the labels of the outermost points
        if max(p[1] for p in pts) > 20 * max(min(abs(p[1]) for p in pts), 0.05):
            ax.set_yscale("symlog", linthresh=1.0)  # one collapsed method would flatten every other point
            if min(p[1] for p in pts) >= 0:  # no method gained: no empty negative decade below the axis
                ax.set_ylim(bottom=-0.1)
        ax.set_xlabel("effective bits per K/V value")
        ax.set_ylabel(f"perplexity increase over FP ({fp['ppl']:.3f})")
        ax.set_title(f"{m}: {_text(fp)}, {fp['windows']} x {fp['window']} tokens")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    for ax, pts, labels in to_label:
        _place_labels(fig, ax, pts, labels)
    atomic_write(path, lambda f: fig.savefig(f, dpi=120, format="png"))
    plt.close(fig)


def frontier_section(paths: list[Path], plot: Path) -> str:
    """The report's lead: for the results in ``paths`` (one directory per model and number of windows), one plot
    panel and one frontier table each (every point with its JSON file and the command that writes it)."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = defaultdict(list)
    for r in load_results(paths):
        if r["kind"] == "ppl":
            groups[(r.get("model", ""), r.get("windows"), r.get("window"), _text(r))].append(r)
    parts = ["## The accuracy frontier\n", f"![oakenkv's frontier against the peers']({Path(plot).name})\n"]
    panels = {}
    for key in sorted(groups):
        model, windows, window, text = key
        rows = groups[key]
        table = frontier_table(rows, files=True)
        if not table:
            continue
        panels[f"{model}, {windows} windows" + ("" if text == "WikiText-2" else f", {text}")] = rows
        src = "" if text == "WikiText-2" else " --text-file <file>"
        parts.append(f"### `{model}`, {text}, first {windows} windows of {window} tokens\n")
        parts.append(
            f"Each point: `oakenkv eval ppl --model {model} --method <method> --max-windows {windows}{src} "
            "--json <JSON>` (`benchmarks/eval_frontier.sh`).\n"
        )
        parts.append(table + "\n")
    if not panels:  # no peer point to face: say so, and link no plot that is not drawn
        return (
            "## The accuracy frontier\n\nNo frontier: these results hold no peer's point (`eval report --frontier`).\n"
        )
    plot_pareto(panels, plot)
    return "\n".join(parts)


def write_report(
    paths: list[Path],
    out: Path,
    plot: Path,
    header: Path | None = None,
    frontier: list[Path] | None = None,
    *,
    loaded: list[dict[str, Any]] | None = None,
) -> str:
    """Write the markdown report ``out`` and the plot ``plot`` from the results in ``paths`` (or ``loaded``, what
    :func:`load_results` returned for them); returns the text. ``frontier``: result directories whose frontier
    (:func:`frontier_section`, its own plot beside ``plot``) leads the report, after the header's introduction (its
    text before its first ``## `` section)."""
    from oakenkv.util.paths import MAX_RESULT_BYTES, read_text_capped

    results = load_results(paths) if loaded is None else loaded
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
    parts = [read_text_capped(header, "--header", MAX_RESULT_BYTES).rstrip() + "\n"] if header else ["# Results\n"]
    if frontier:  # right after the header's introduction (its text before its first "## " section)
        lead = frontier_section(frontier, Path(plot).with_name(Path(plot).stem + "_frontier.png"))
        intro, sep, rest = parts[0].partition("\n## ")
        parts[0:1] = [intro.rstrip() + "\n", lead] + ([sep.lstrip("\n") + rest] if sep else [])
    panels: dict[str, list[dict[str, Any]]] = {}
    for m in sorted(set(ppl) | set(zs)):
        parts.append(f"## Model `{m}`\n")
        # Runs over different numbers of windows score different tokens: one table (and plot panel) each,
        # the largest first.
        groups: dict[tuple[Any, ...], list[dict[str, Any]]] = defaultdict(list)
        for r in ppl.get(m, []):
            groups[(r.get("windows"), r.get("window"), r.get("stride"), _text(r))].append(r)
        for key in sorted(groups, key=lambda k: (k[3] != "WikiText-2", k[3], -(k[0] or 0))):
            rows = groups[key]
            r0 = rows[0]
            parts.append(
                f"### {key[3]} perplexity ({r0.get('windows')} window(s) of {r0.get('window')} tokens, "
                f"stride {r0.get('stride')})\n"
            )
            parts.append(ppl_table(rows) + "\n")
            front = frontier_table(rows)
            if front:
                parts.append("Frontier:\n\n" + front + "\n")
            text = "" if key[3] == "WikiText-2" else f", {key[3]}"
            panels[m if len(groups) == 1 else f"{m}, {key[0]} windows{text}"] = rows
        # likewise one zero-shot table per number of documents and set of tasks, the largest first
        zgroups: dict[tuple[Any, ...], list[dict[str, Any]]] = defaultdict(list)
        for r in zs.get(m, []):
            zgroups[(r.get("limit"), tuple(_zs_tasks([r])))].append(r)
        for key in sorted(zgroups, key=lambda k: (-(k[0] or math.inf), -len(k[1]), k[1])):
            lim, tasks = key
            what = "every validation document" if lim is None else f"first {lim} validation documents per task"
            if set(tasks) != set(ZS_TASKS):
                what += " of " + ", ".join(tasks)
            parts.append(f"### Zero-shot ({what})\n")
            parts.append(zeroshot_table(zgroups[key]) + "\n")
            paired = zeroshot_paired_table(zgroups[key])
            if paired:
                parts.append(paired + "\n")
    if diffs:
        parts.append("## Do the thresholds depend on the profiling text?\n")
        parts.append(thresholds_diff_section(diffs))
    plot_pareto(panels, plot)
    parts.append(
        f"\n![perplexity increase vs effective bits]({Path(plot).name})\n\n"
        "Red: oakenkv's presets (oaken, oaken-plus and their variants); blue: peers; grey: the paper authors' harness "
        "(oaken-official); red dashed: oakenkv's frontier, blue dotted: the peers' (the least loss at each number of "
        "bits or fewer). quanto's one-forward rows are not drawn (their prefill is unquantized, see "
        "above), nor the keys-only / values-only ablations.\n"
    )
    text = "\n".join(parts)
    atomic_write(out, text)
    return text
