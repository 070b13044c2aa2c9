"""CPU time per call of the hot entry points, one thread: decode attention on a tiny store (the Python around the
kernel dominates) and the codec's encode / decode of synthetic fp16 rows.

CPU time (``time.process_time``), not wall time: on a shared machine another job's time slices inflate wall time
but not the CPU time this process spends. Meant to be run for two source trees alternately, e.g.

    for i in 1 2 3 4; do
        PYTHONPATH=/tmp/old/src python benchmarks/bench_call_overhead.py --tag old
        PYTHONPATH=src python benchmarks/bench_call_overhead.py --tag new
    done

and prints one JSON line per run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings

import numba
import torch


def _median_cpu_us(f, calls: int, rounds: int = 7) -> float:
    for _ in range(max(1, calls // 10)):
        f()
    per_call = []
    for _ in range(rounds):
        t = time.process_time()
        for _ in range(calls):
            f()
        per_call.append((time.process_time() - t) / calls * 1e6)
    return statistics.median(per_call)


def attention_overhead(tokens: list[int]) -> dict[str, float]:
    from oakenkv.calibrate.thresholds import GroupThresholds, ModelFingerprint, Thresholds
    from oakenkv.format.config import OakenConfig
    from oakenkv.hf.attention import packed_decode_attention
    from oakenkv.hf.cache import KEY, VALUE, PackedKV
    from oakenkv.store.pages import PoolConfig

    try:
        from oakenkv.store.paged import PagedKVStore
    except ImportError:  # trees before oakenkv/store/paged.py
        from oakenkv.hf.cache import PagedKVStore

    h, hd, hq = 3, 64, 9  # the default model's attention shape
    fp = ModelFingerprint("llama", 2, h, hd)
    keys = tuple(GroupThresholds(-2.0, -0.15, 0.15, 2.0 + i) for i in range(2))
    values = tuple(GroupThresholds(-1.5, -0.1, 0.1, 1.5 + i) for i in range(2))
    out = {}
    for t in tokens:
        store = PagedKVStore(Thresholds(OakenConfig(), fp, keys, values), 2, h, hd, PoolConfig())
        g = torch.Generator().manual_seed(0)
        store.append(1, torch.randn(1, h, t, hd, generator=g), torch.randn(1, h, t, hd, generator=g))
        kh, vh = PackedKV(store, 1, KEY, t), PackedKV(store, 1, VALUE, t)
        q = torch.randn(1, hq, 1, hd, generator=g)
        mask = torch.ones(1, 1, 1, t, dtype=torch.bool)
        call = lambda q=q, kh=kh, vh=vh, mask=mask: packed_decode_attention(q, kh, vh, mask, 0.125)  # noqa: E731
        out[f"attention_us@{t}"] = _median_cpu_us(call, 2000)
    return out


def codec_throughput() -> dict[str, float]:
    from oakenkv.format.config import OakenConfig
    from oakenkv.kernels.codec import decode, encode

    cfg, thr = OakenConfig(), (-2.0, -0.07, 0.07, 2.0)
    out = {}
    for n, d in ((2048, 4096), (32768, 192)):
        x = torch.randn(n, d, generator=torch.Generator().manual_seed(0)).to(torch.float16)
        enc = encode(x, thr, cfg)
        gb = x.numel() * 2 / 1e9
        out[f"encode_gbps_cpu@{d}"] = gb / (_median_cpu_us(lambda x=x: encode(x, thr, cfg), 5, 5) / 1e6)
        out[f"decode_gbps_cpu@{d}"] = gb / (_median_cpu_us(lambda enc=enc: decode(enc, thr, cfg), 5, 5) / 1e6)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tag", default="", help="a label copied into the output line (e.g. old / new)")
    ap.add_argument("--tokens", default="1,64", help="comma-separated stored tokens for the attention timing")
    a = ap.parse_args()
    warnings.simplefilter("ignore")
    numba.set_num_threads(1)
    torch.set_num_threads(1)
    result = {"tag": a.tag, **attention_overhead([int(t) for t in a.tokens.split(",")]), **codec_throughput()}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
