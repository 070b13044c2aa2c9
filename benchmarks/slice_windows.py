"""Write the first N windows of an `oakenkv eval ppl` result that recorded per-window NLLs as a result of its own.

Windows are evaluated independently from an empty cache, so the first N windows of a run over the whole test set
score exactly what a run with ``--max-windows N`` scores (docs/results.md checks it on every model): the per-window
NLLs are copied, perplexity, NLL and tokens recomputed. The effective bits stay the whole run's (the per-window
bits are not recorded); ``extra.sliced_from`` names the source and says so.

    python benchmarks/slice_windows.py docs/results/default-full/ppl-kivi4.json 20 \
        docs/results/default-20w/ppl-kivi4.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source", type=Path)
    ap.add_argument("windows", type=int)
    ap.add_argument("out", type=Path)
    args = ap.parse_args()
    d = json.loads(args.source.read_text())
    nll = d.get("window_nll") or []
    if d.get("kind") != "ppl" or len(nll) < args.windows or d["tokens"] % d["windows"]:
        raise SystemExit(f"{args.source}: not a ppl result with at least {args.windows} per-window NLLs")
    per = d["tokens"] // d["windows"]
    keep = [float(x) for x in nll[: args.windows]]
    out = {
        **d,
        "window_nll": keep,
        "windows": args.windows,
        "tokens": per * args.windows,
        "nll": sum(keep),
        "ppl": math.exp(sum(keep) / (per * args.windows)),
        "seconds": d.get("seconds", 0.0) * args.windows / d["windows"],
        "extra": {
            **d.get("extra", {}),
            "sliced_from": {
                "file": str(args.source),
                "windows": d["windows"],
                "note": "the first windows' NLLs of that run; effective_bits is that whole run's",
            },
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"{args.out}: {out['method']} ppl {out['ppl']:.4f} over {args.windows} windows")


if __name__ == "__main__":
    main()
