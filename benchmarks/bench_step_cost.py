"""The per-layer fixed cost of a decode step, CPU time, one thread: what OakenCache adds to each layer (the
single-token append, the packed attention call with its Python) next to what transformers' fp32 DynamicCache
spends there (its ``update``: a ``torch.cat`` of the history, and SDPA), at a short context where nothing but
this cost shows. The default model's attention shape (3 KV heads of 64, 9 query heads), synthetic K/V.

CPU time (``time.process_time``), not wall time: on a shared machine other jobs' time slices inflate wall
time, not this process's CPU time. Meant to be run for two source trees alternately:

    git archive main src | tar -x -C /tmp/main
    for i in 1 2 3; do
        PYTHONPATH=/tmp/main/src python benchmarks/bench_step_cost.py --tag main >> /tmp/step.jsonl
        PYTHONPATH=src python benchmarks/bench_step_cost.py --tag new >> /tmp/step.jsonl
    done
    python benchmarks/bench_step_cost.py --summarize /tmp/step.jsonl --json benchmarks/results/step_cost/128.json

Each run prints one JSON line of medians (us per call).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from pathlib import Path

H, HD, HQ = 3, 64, 9


def _median_cpu_us(f, calls: int, rounds: int = 5) -> float:
    for _ in range(max(1, calls // 10)):
        f()
    per_call = []
    for _ in range(rounds):
        t = time.process_time()
        for _ in range(calls):
            f()
        per_call.append((time.process_time() - t) / calls * 1e6)
    return statistics.median(per_call)


def measure(batches: list[int], tokens: int) -> dict[str, float]:
    import torch
    from transformers import DynamicCache
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from oakenkv.calibrate.thresholds import GroupThresholds, ModelFingerprint, Thresholds
    from oakenkv.format.config import OakenConfig
    from oakenkv.hf.attention import packed_decode_attention
    from oakenkv.hf.cache import KEY, VALUE, PackedKV
    from oakenkv.store.paged import PagedKVStore
    from oakenkv.store.pages import PoolConfig

    fp = ModelFingerprint("llama", 2, H, HD)
    keys = tuple(GroupThresholds(-2.0 - 0.1 * i, -0.15, 0.15, 2.0 + 0.1 * i) for i in range(2))
    values = tuple(GroupThresholds(-1.5 - 0.1 * i, -0.1, 0.1, 1.5 + 0.1 * i) for i in range(2))
    thr = Thresholds(OakenConfig(), fp, keys, values)
    out: dict[str, float] = {}
    for b in batches:
        g = torch.Generator().manual_seed(b)
        k, v = torch.randn(b, H, tokens, HD, generator=g), torch.randn(b, H, tokens, HD, generator=g)
        k1, v1 = torch.randn(b, H, 1, HD, generator=g), torch.randn(b, H, 1, HD, generator=g)
        q = torch.randn(b, HQ, 1, HD, generator=g)
        mask = torch.ones(b, 1, 1, tokens, dtype=torch.bool)
        # Oaken: the append of one token (into a store that grows: as in decoding) ...
        store = PagedKVStore(thr, 2, H, HD, PoolConfig(budget_bytes=1 << 31))
        store.append(1, k, v)
        append = lambda s=store, k1=k1, v1=v1: s.append_token(1, k1, v1)  # noqa: E731
        out[f"oaken_append_token_us@B{b}"] = _median_cpu_us(append, 300)
        # ... and the attention over a store of `tokens` tokens
        fixed = PagedKVStore(thr, 2, H, HD, PoolConfig())
        fixed.append(1, k, v)
        kh, vh = PackedKV(fixed, 1, KEY, tokens), PackedKV(fixed, 1, VALUE, tokens)
        out[f"oaken_attention_us@B{b}"] = _median_cpu_us(
            lambda kh=kh, vh=vh, q=q, m=mask: packed_decode_attention(q, kh, vh, m, HD**-0.5), 300
        )
        out[f"oaken_layer_view_us@B{b}"] = _median_cpu_us(lambda s=fixed: s.layer_view(1), 2000)
        # DynamicCache fp32: its update (torch.cat of the history and the new token) and SDPA
        cache = DynamicCache()
        cache.update(k, v, 0)
        layer = cache.layers[0]

        def dyn_update(layer=layer, k=k, v=v, k1=k1, v1=v1):
            layer.keys, layer.values = k, v  # back to `tokens` tokens: each call appends to the same history
            layer.update(k1, v1)

        out[f"dynamic_update_us@B{b}"] = _median_cpu_us(dyn_update, 300)
        kk, vv = torch.cat([k, k1], 2), torch.cat([v, v1], 2)
        module = torch.nn.Module()
        module.num_key_value_groups = HQ // H  # as a model's attention layer carries it (GQA)
        module.is_causal = True
        out[f"dynamic_sdpa_us@B{b}"] = _median_cpu_us(
            lambda q=q, kk=kk, vv=vv, m=module: sdpa_attention_forward(m, q, kk, vv, None, scaling=HD**-0.5),
            300,
        )
        out[f"oaken_step_us@B{b}"] = out[f"oaken_append_token_us@B{b}"] + out[f"oaken_attention_us@B{b}"]
        out[f"dynamic_step_us@B{b}"] = out[f"dynamic_update_us@B{b}"] + out[f"dynamic_sdpa_us@B{b}"]
    return out


def summarize(path: Path) -> dict:
    runs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    tags = sorted({r["tag"] for r in runs})
    keys = [k for k in runs[0] if k not in ("tag", "tokens")]
    table = {}
    for k in keys:
        row = {t: [r[k] for r in runs if r["tag"] == t] for t in tags}
        table[k] = {**{f"{t}_median": statistics.median(v) for t, v in row.items()}, **{t: v for t, v in row.items()}}
    return {"tokens": runs[0]["tokens"], "runs": len(runs), "tags": tags, "us_per_call": table}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tag", default="", help="a label copied into the output line (e.g. main / new)")
    ap.add_argument("--tokens", type=int, default=128, help="stored tokens per row")
    ap.add_argument("--batches", default="1,8", help="comma-separated batch sizes")
    ap.add_argument("--summarize", type=Path, help="summarize a file of output lines instead of measuring")
    ap.add_argument("--json", type=Path, help="with --summarize: write the summary here")
    a = ap.parse_args()
    if a.summarize:
        result = summarize(a.summarize)
        text = json.dumps(result, indent=1)
        if a.json:
            a.json.write_text(text + "\n")
        print(text)
        return
    warnings.simplefilter("ignore")
    import numba
    import torch

    numba.set_num_threads(1)
    torch.set_num_threads(1)
    batches = [int(x) for x in a.batches.split(",")]
    print(json.dumps({"tag": a.tag, "tokens": a.tokens, **measure(batches, a.tokens)}))


if __name__ == "__main__":
    main()
