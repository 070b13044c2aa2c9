"""What a vLLM server's first request costs the Oaken plugin beyond its second (issue #32's first-request goal),
without vLLM's engine: in one process, the 30 layers' writes and first-chunk attention of two 256-token prompts,
three requests in a row after a warm-up write of ``block_size + 3`` tokens (what ``backend.warm_up`` writes).

Each layer has its own ``BlockWriter`` as in the worker; the prefill is ``layout.prefill_attention`` (vLLM's own
kernel where the vLLM venv provides it, the tiles otherwise). A first request slower than the second here is a cost
the plugin pays once per process (buffers grown, memory first touched); in a whole server run the engine's own parts
add theirs. Compare two trees by running the script with each on ``PYTHONPATH``, in fresh processes.

    PYTHONPATH=src python benchmarks/bench_vllm_first_request.py --json /tmp/first.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--requests", type=int, default=3, help="requests in a row (the first is the one in question)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()

    import numba
    import numpy as np
    import torch

    import oakenkv.integrations.vllm.layout as lay_mod
    from oakenkv.format.config import OakenConfig

    torch.set_num_threads(1)
    numba.set_num_threads(1)
    rng = np.random.default_rng(0)
    hkv, hd, hq, bs, n = 3, 64, 9, 128, a.prompt_tokens
    d = hkv * hd
    cfg = OakenConfig()
    lay = lay_mod.BlockLayout.make(d, bs, cfg, sink_tokens=1)
    k = rng.standard_t(5, size=(2 * n + a.requests, d)).astype(np.float32)
    v = (0.5 * rng.standard_t(8, size=(2 * n + a.requests, d))).astype(np.float32)
    o, i = cfg.outer_ratio / 2, cfg.inner_ratio / 2
    thr = np.array([np.quantile(x, [o, 0.5 - i, 0.5 + i, 1 - o]) for x in (k, v)], np.float32)
    params = lay_mod.LayerParams(thr, hkv, 0.125, 0.0, True)
    own = None
    try:
        from oakenkv.integrations.vllm import chunk

        own = chunk.make(hq, hkv, hd)
    except ImportError:  # no vLLM (or a tree from before chunk.py): the tiles
        pass

    def writer():
        return lay_mod.BlockWriter(lay, thr, "clip", key_shift=np.zeros(d, np.float32), key_rotation=True, head_dim=hd)

    writers = [writer() for _ in range(a.layers)]
    per = -(-n // bs)

    def request(layer_writers, tokens: int, seed: int) -> tuple[float, float]:
        pool, upb = lay_mod.pool_view(torch.zeros(2 * per, lay.block_bytes, dtype=torch.uint8), lay)
        tables = lay_mod.BlockTables(lay, upb)
        table = np.arange(2 * per, dtype=np.int32).reshape(2, per)
        tables.update(1, table, np.array([tokens, tokens]), np.array([tokens, tokens]))
        slots = np.concatenate([table[r, np.arange(tokens) // bs] * bs + np.arange(tokens) % bs for r in range(2)])
        kk = torch.from_numpy(k[seed : seed + 2 * tokens].copy())
        vv = torch.from_numpy(v[seed : seed + 2 * tokens].copy())
        q = torch.from_numpy(rng.standard_normal((tokens, hq, hd)).astype(np.float32))
        write = prefill = 0.0
        for w in layer_writers:
            t = time.perf_counter()
            w.write(pool, upb, slots, kk, vv)
            write += time.perf_counter() - t
            t = time.perf_counter()
            for row in range(2):
                lay_mod.prefill_attention(tables, 0, pool, row, q, params, own=own)
            prefill += time.perf_counter() - t
        return write * 1e3, prefill * 1e3

    request([writer()], bs + 3, 0)  # the engine's warm-up: one writer of its own, a short write (compiles too)
    rows = []
    for r in range(a.requests):
        w_ms, p_ms = request(writers, n, r + 1)
        rows.append({"request": r + 1, "write_ms": round(w_ms, 2), "prefill_ms": round(p_ms, 2)})
        print(f"request {r + 1}: {a.layers} layers' writes {w_ms:6.1f} ms, first-chunk attention {p_ms:6.1f} ms")
    first, second = rows[0], rows[1]
    extra = first["write_ms"] + first["prefill_ms"] - second["write_ms"] - second["prefill_ms"]
    print(f"the first request's extra: {extra:.1f} ms")
    if a.json:
        from oakenkv.bench.results import machine

        meta = {"layers": a.layers, "prompt_tokens": n, "prompts": 2, "vllm_kernel": own is not None,
                "machine": machine(), "command": " ".join(["python", *sys.argv])}  # fmt: skip
        a.json.write_text(json.dumps({"requests": rows, "first_extra_ms": round(extra, 2), "meta": meta}, indent=1))


if __name__ == "__main__":
    main()
