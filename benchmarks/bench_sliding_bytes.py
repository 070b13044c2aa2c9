"""KV bytes of a sliding-window model (default: Gemma-3-270m) with and without sliding-window page eviction.

For each context: the real prefill K/V of WikiText-2 tiled to the context length go into each cache in one update
(a prefill), then one decode step's token; the bytes are counted after that step (OakenCache: pages in use plus
tables; DynamicCache: its tensors, a ``window``-token fp32 window for sliding layers)::

    .venv/bin/python benchmarks/bench_sliding_bytes.py --context 1024,4096,16384 \\
        --json benchmarks/results/sliding_bytes/gemma3-270m.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--context", default="1024,4096,16384", help="comma-separated context lengths")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args()

    from transformers import DynamicCache

    from oakenkv.apps.generate import load_or_profile_thresholds
    from oakenkv.assets.data import load_text, token_windows
    from oakenkv.assets.models import load_model
    from oakenkv.bench.decode import _tile, record_source_kv
    from oakenkv.hf.cache import OakenCache, kv_bytes

    lm = load_model(args.model)
    model = lm.model
    thr = load_or_profile_thresholds(lm)
    ids = token_windows(lm.tokenizer, load_text("wikitext2"), window=512, max_windows=1)
    source = record_source_kv(model, ids)
    makers = {
        "oaken": lambda: OakenCache(thr, model),
        "oaken_no_eviction": lambda: OakenCache(thr, model, evict_sliding=False),
        "dynamic_fp32": lambda: DynamicCache(config=model.config),
    }
    results: dict[str, dict[str, float]] = {}
    for ctx in (int(c) for c in args.context.split(",") if c.strip()):
        row: dict[str, float] = {}
        for name, make in makers.items():
            cache = make()
            with torch.inference_mode():
                for i, (k, v) in enumerate(source):
                    cache.update(_tile(k, ctx), _tile(v, ctx), i)
                for i, (k, v) in enumerate(source):
                    cache.update(k[:, :, :1], v[:, :, :1], i)
            row[name] = kv_bytes(cache)
        row["dynamic_over_oaken"] = row["dynamic_fp32"] / row["oaken"]
        row["dynamic_over_oaken_no_eviction"] = row["dynamic_fp32"] / row["oaken_no_eviction"]
        results[str(ctx)] = row
        print(
            f"{ctx:>6} tokens: "
            + ", ".join(f"{k} {v:,.2f}" if isinstance(v, float) else f"{k} {v:,}" for k, v in row.items())
        )
    out = {"model": args.model, "sliding_window": model.config.get_text_config().sliding_window, "results": results}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
