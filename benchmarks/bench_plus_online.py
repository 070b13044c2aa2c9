"""What oaken-plus costs online: a decode step with OakenCache under the ``oaken-plus`` profile (the model with its
transforms folded in; the cache shifts and rotates each new key row, the attention rotates the queries) against
the same step under the paper's ``oaken`` thresholds (the original model), timed in interleaved rounds in one
process, so the ratio is paired step by step (issue 20's goal: within 3%).

Both caches hold the same context: each model's own post-RoPE K/V of one real WikiText-2 prefill, tiled to the
length. Both profiles come from the profile cache (made on the first run: minutes for oaken-plus)::

    .venv/bin/python benchmarks/bench_plus_online.py --context 1024,4096 --steps 30 \\
        --json benchmarks/results/bench_plus_online.json
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--context", default="1024,4096", help="comma-separated context lengths (tokens)")
    ap.add_argument("--steps", type=int, default=30, help="timed decode steps per context and method")
    ap.add_argument("--source-tokens", type=int, default=512)
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()
    contexts = [int(c) for c in args.context.split(",")]
    if args.steps < 2 or any(c < 1 for c in contexts):
        ap.error("--steps must be >= 2 and contexts positive")

    import torch

    from oakenkv.assets.data import load_text, token_windows
    from oakenkv.assets.models import load_model
    from oakenkv.bench.decode import fill_cache, paired, record_source_kv
    from oakenkv.calibrate.plus import apply_profile, cached_plus_profile
    from oakenkv.calibrate.profile import CalibrationSpec, cached_thresholds
    from oakenkv.format.config import OakenConfig
    from oakenkv.hf.attention import oaken_attention
    from oakenkv.hf.cache import OakenCache, kv_bytes

    loaded = load_model(args.model)
    base = loaded.model
    oaken_thr = cached_thresholds(base, loaded.tokenizer, loaded.name, OakenConfig(), CalibrationSpec(), progress=True)
    plus_thr = cached_plus_profile(base, loaded.tokenizer, loaded.name, progress=True)
    folded = apply_profile(copy.deepcopy(base), plus_thr)
    ids = token_windows(loaded.tokenizer, load_text("wikitext2"), window=args.source_tokens, max_windows=1)
    runs = {
        "oaken": (base, oaken_thr, record_source_kv(base, ids)),
        "oaken-plus": (folded, plus_thr, record_source_kv(folded, ids)),
    }
    results: dict[str, dict] = {m: {} for m in runs}
    for context in contexts:
        caches = {}
        for m, (model, thr, source) in runs.items():
            print(f"filling {m} @ {context} tokens", flush=True)
            caches[m], fill_s = fill_cache("oaken", model, thr, source, context)
            results[m][str(context)] = {"kv_bytes": kv_bytes(caches[m]), "fill_s": fill_s}
            assert isinstance(caches[m], OakenCache)
        times: dict[str, list[float]] = {m: [] for m in runs}
        tokens = {m: torch.tensor([[1000]]) for m in runs}
        names = list(runs)
        with oaken_attention(base), oaken_attention(folded), torch.inference_mode():
            for r in range(args.steps + 1):  # round 0 warms up
                for k in range(len(names)):
                    m = names[(r + k) % len(names)]
                    model = runs[m][0]
                    t = time.perf_counter()
                    logits = model(input_ids=tokens[m], cache=caches[m], use_cache=True).logits
                    dt = time.perf_counter() - t
                    tokens[m] = logits[:, -1:].argmax(-1)
                    if r:
                        times[m].append(dt * 1e3)
        for m in runs:
            results[m][str(context)].update(step_ms=statistics.median(times[m]), steps_ms=times[m])
        pair = paired(times["oaken-plus"], times["oaken"])
        results["oaken-plus"][str(context)]["paired_vs_oaken"] = pair
        print(
            f"@{context}: oaken {results['oaken'][str(context)]['step_ms']:.2f} ms, oaken-plus "
            f"{results['oaken-plus'][str(context)]['step_ms']:.2f} ms; paired median ratio "
            f"{pair['median_ratio']:.3f} (oaken-plus faster in {pair['faster_steps']}/{pair['steps']} steps)",
            flush=True,
        )
    out = {
        "kind": "bench_plus_online",
        "model": loaded.name,
        "contexts": contexts,
        "steps": args.steps,
        "torch_threads": torch.get_num_threads(),
        "machine": {"platform": platform.platform(), "load_avg": list(__import__("os").getloadavg())},
        "results": results,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
