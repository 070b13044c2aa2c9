"""Where a prefill's extra time goes inside the model: one forward pass over a prompt from an empty cache, with
OakenCache against DynamicCache, in interleaved repetitions (a fresh cache each), and the time spent in the cache's
parts per pass (wrapped functions: ~1 us of wrapper per call).

OakenCache's ``update`` is timed with its parts: ``PagedKVStore.append_decoded`` (a first update), the serial
kernels of its short path (``encode_records``, ``decode_records``), ``PagePool.append_many`` and the store's table
update; DynamicCache's ``update`` and SDPA are timed for both. ``bench generate`` times the whole call to the first
new token (cache and all); this one isolates the prefill's forward pass.

    PYTHONPATH=src python benchmarks/bench_prefill_parts.py --prompt 128 --batch 1 --json /tmp/prefill.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import time
from pathlib import Path

from _parts import part_timer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens per row")
    ap.add_argument("--batch", type=int, default=1, help="rows")
    ap.add_argument("--repeats", type=int, default=9, help="timed passes per cache (interleaved)")
    ap.add_argument("--threads", type=int, default=2, help="torch and numba threads")
    ap.add_argument("--json", type=Path, help="write the results here")
    a = ap.parse_args()

    import numba
    import torch
    import transformers.integrations.sdpa_attention as sdpa
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    import oakenkv.store.paged as store_module
    from oakenkv.apps.generate import load_or_profile_thresholds
    from oakenkv.assets.data import load_text, token_windows
    from oakenkv.assets.models import load_model
    from oakenkv.hf.cache import OakenCache, OakenLayer
    from oakenkv.store.pages import PagePool

    torch.set_num_threads(a.threads)
    numba.set_num_threads(a.threads)
    spent, timed = part_timer()

    timed(OakenLayer, "update", "oaken update")
    timed(store_module.PagedKVStore, "append_decoded", "oaken append_decoded")
    timed(store_module, "encode_records", "oaken encode_records (numba)")
    timed(store_module, "decode_records", "oaken decode_records (numba)")
    timed(PagePool, "append_many", "oaken pool append_many")
    timed(store_module.PagedKVStore, "_sync_layer", "oaken tables sync")
    timed(DynamicLayer, "update", "dynamic update")
    timed(sdpa, "sdpa_attention_forward", "sdpa (both)")

    loaded = load_model("default")
    thr = load_or_profile_thresholds(loaded, None)
    model = loaded.model
    ids = token_windows(loaded.tokenizer, load_text("wikitext2"), window=a.prompt, max_windows=a.batch)
    if ids.shape[0] < a.batch:
        raise SystemExit(f"WikiText-2 holds only {ids.shape[0]} windows of {a.prompt} tokens")

    def forward(method: str) -> float:
        cache = OakenCache(thr, model) if method == "oaken" else DynamicCache(config=model.config)
        t = time.perf_counter()
        with torch.inference_mode():
            model(ids, past_key_values=cache, use_cache=True)
        return time.perf_counter() - t

    methods = ("oaken", "dynamic")
    for _ in range(2):  # warm-up: kernels loaded, allocator primed
        for m in methods:
            forward(m)
    times: dict[str, list[float]] = {m: [] for m in methods}
    parts: dict[str, list[float]] = collections.defaultdict(list)
    for r in range(a.repeats):
        for m in methods if r % 2 == 0 else methods[::-1]:
            spent.clear()
            times[m].append(forward(m))
            for k, v in spent.items():
                if k.startswith(m) or k.startswith("sdpa"):
                    parts[f"{m}: {k}"].append(v)
    ratios = [o / d for o, d in zip(times["oaken"], times["dynamic"], strict=True)]
    result = {
        "prompt": a.prompt,
        "batch": a.batch,
        "threads": a.threads,
        "repeats": a.repeats,
        "forward_ms": {m: statistics.median(v) * 1e3 for m, v in times.items()},
        "paired_time_ratio_oaken_over_dynamic": statistics.median(ratios),
        "ratios": ratios,
        "parts_ms_per_forward": {k: statistics.median(v) * 1e3 for k, v in sorted(parts.items())},
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "loadavg": list(os.getloadavg()),
    }
    print(f"forward pass, {a.prompt} x {a.batch}, median of {a.repeats}:")
    for m, v in result["forward_ms"].items():
        print(f"  {m:8s} {v:9.1f} ms")
    print(f"  oaken / dynamic time: median paired ratio {result['paired_time_ratio_oaken_over_dynamic']:.3f}")
    for k, v in result["parts_ms_per_forward"].items():
        print(f"  {k:40s} {v:8.2f} ms per forward ({v / model.config.num_hidden_layers * 1e3:7.1f} us per layer)")
    if a.json:
        a.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
