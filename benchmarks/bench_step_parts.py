"""Where a decode step's time goes inside the model: OakenCache's single-token append and packed attention against
DynamicCache's update (``torch.cat``) and SDPA, per step, at one context and batch, 2 threads by default. With
``--residual R`` the OakenCache keeps a full-precision window (``window_update`` instead of ``append_token``).

``benchmarks/bench_step_cost.py`` times the same parts alone, warm in cache; inside the model each part runs
after the layer's weights have streamed through the caches, and costs 2-4x more (session 14: the append ~90 us per
layer at batch 1 against ~22 us alone). The parts are timed by wrapping the functions (wall time, ~1 us of
wrapper per call); the step times come from ``oakenkv.bench.decode.time_steps`` (interleaved rounds).

    PYTHONPATH=src python benchmarks/bench_step_parts.py --context 128 --batch 1 --json /tmp/parts.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

from _parts import part_timer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=128, help="tokens per row before the timed steps")
    ap.add_argument("--batch", type=int, default=1, help="rows")
    ap.add_argument("--steps", type=int, default=20, help="timed decode steps per method")
    ap.add_argument("--threads", type=int, default=2, help="torch and numba threads")
    ap.add_argument("--residual", type=int, default=0, help="OakenCache's full-precision window (0: none)")
    ap.add_argument("--json", type=Path, help="write the results here")
    a = ap.parse_args()

    import numba
    import torch
    import transformers.integrations.sdpa_attention as sdpa
    from transformers.cache_utils import DynamicLayer

    import oakenkv.hf.attention as attention
    from oakenkv.apps.generate import load_or_profile_thresholds
    from oakenkv.assets.data import load_text, token_windows
    from oakenkv.assets.models import load_model
    from oakenkv.bench.decode import fill_cache, record_source_kv, time_steps
    from oakenkv.store.paged import PagedKVStore

    torch.set_num_threads(a.threads)
    numba.set_num_threads(a.threads)
    spent, timed = part_timer()

    timed(PagedKVStore, "append_token", "oaken append_token")
    timed(PagedKVStore, "window_update", "oaken window_update")
    timed(attention, "packed_decode_attention", "oaken attention")
    timed(DynamicLayer, "update", "dynamic update")
    timed(sdpa, "sdpa_attention_forward", "dynamic sdpa")

    loaded = load_model("default")
    thr = load_or_profile_thresholds(loaded, None)
    ids = token_windows(loaded.tokenizer, load_text("wikitext2"), window=512, max_windows=1)
    source = record_source_kv(loaded.model, ids)
    caches = {
        m: fill_cache(m, loaded.model, thr, source, a.context, a.batch, a.residual)[0] for m in ("oaken", "dynamic")
    }
    time_steps(loaded.model, caches, 2, warmup=0, batch=a.batch)  # warm-up: kernels loaded, buffers grown
    spent.clear()
    times = time_steps(loaded.model, caches, a.steps, warmup=0, batch=a.batch)
    parts = {k: v / a.steps * 1e3 for k, v in sorted(spent.items())}
    steps = {m: statistics.median(v) for m, v in times.items()}
    ratios = [o / d for o, d in zip(times["oaken"], times["dynamic"], strict=True)]
    for m, v in steps.items():
        print(f"{m:8s} median step {v:8.2f} ms")
    print(f"oaken / dynamic: median paired ratio {statistics.median(ratios):.3f}")
    for k, v in parts.items():
        print(f"{k:20s} {v:7.2f} ms per step ({v / loaded.model.config.num_hidden_layers * 1e3:6.1f} us per layer)")
    if a.json:
        out = {
            "step_ms": steps,
            "paired_ratio_oaken_over_dynamic": statistics.median(ratios),
            "parts_ms_per_step": parts,
            "meta": {
                "context": a.context,
                "batch": a.batch,
                "steps": a.steps,
                "threads": a.threads,
                "residual": a.residual,
                "loadavg": list(os.getloadavg()),
                "note": "parts: wall time of the wrapped calls per timed step (warm-up steps excluded)",
            },
        }
        a.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
