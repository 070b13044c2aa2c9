"""The vLLM plugin's per-layer step parts, timed alone (no vLLM): what one decode step of one layer costs at issue
#32's ample point (16 rows, 3 KV heads x 64, 9 query heads, blocks of 128, contexts ~300), oaken-plus's layout (one
sink token, key rotation), on one thread, as vLLM's CPU worker runs them; and a prompt's first chunk of 256 tokens,
by the tiles and (with the vLLM venv's python) by vLLM's own kernel.

The blocks hold synthetic heavy-tailed keys and values with thresholds at the config's quantiles (~10% outliers, as
a profile gives). Every part is timed ``--repeats`` times and the minimum kept: the machine is shared, a minimum is
the least disturbed figure. Compare two trees by running the script with each on ``PYTHONPATH``.

    PYTHONPATH=src python benchmarks/bench_vllm_parts.py --context 300 --json /tmp/parts.json
"""

from __future__ import annotations

import argparse
import inspect
import json
import subprocess
from pathlib import Path
from types import SimpleNamespace


def synthetic_blocks(rows: int, ctx: int) -> SimpleNamespace:
    """The plugin's blocks at this benchmark's shape, filled: ``rows`` rows of ``ctx`` stored tokens of synthetic
    heavy-tailed keys and values (3 KV heads x 64, 9 query heads, blocks of 128, oaken-plus's layout with one sink
    token and key rotation), thresholds at the config's quantiles; the fields the parts read (``view``: layer 0's
    ``LayerView`` over every token) and ``rng`` to draw the rest from (``benchmarks/experiments/c_decode`` too)."""
    import numpy as np
    import torch

    import oakenkv.integrations.vllm.layout as lay_mod
    from oakenkv.format.config import OakenConfig

    rng = np.random.default_rng(0)
    hkv, hd, hq, bs = 3, 64, 9, 128
    d = hkv * hd
    cfg = OakenConfig()
    lay = lay_mod.BlockLayout.make(d, bs, cfg, sink_tokens=1)
    per_row = -(-(ctx + 1) // bs)
    raw = torch.zeros(rows * per_row, lay.block_bytes, dtype=torch.uint8)
    pool, upb = lay_mod.pool_view(raw, lay)
    k = rng.standard_t(5, size=(rows * ctx, d)).astype(np.float32)
    v = (0.5 * rng.standard_t(8, size=(rows * ctx, d))).astype(np.float32)
    o, i = cfg.outer_ratio / 2, cfg.inner_ratio / 2
    thr = np.array([np.quantile(x, [o, 0.5 - i, 0.5 + i, 1 - o]) for x in (k, v)], np.float32)
    w = lay_mod.BlockWriter(lay, thr, "clip", key_shift=np.zeros(d, np.float32), key_rotation=True, head_dim=hd)
    table = np.arange(rows * per_row, dtype=np.int32).reshape(rows, per_row)
    slots = np.concatenate([table[r, np.arange(ctx) // bs] * bs + np.arange(ctx) % bs for r in range(rows)])
    w.write(pool, upb, slots, torch.from_numpy(k), torch.from_numpy(v))
    tables = lay_mod.BlockTables(lay, upb)
    tables.update(1, table, np.full(rows, ctx, np.int64), np.ones(rows, np.int64))
    view = tables.layer(0, pool).view(
        pool, lay.unit, lay.unit, lay.scale_bytes, thr, lay.inner_bits, lay.outer_bits, hkv, rows=rows
    )._replace(num_tokens=ctx)  # fmt: skip
    return SimpleNamespace(
        rng=rng, rows=rows, ctx=ctx, hkv=hkv, hd=hd, hq=hq, bs=bs, d=d, lay=lay, pool=pool, upb=upb, k=k, v=v,
        thr=thr, w=w, table=table, tables=tables, view=view,
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=300, help="stored tokens per row")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()

    import numba
    import numpy as np
    import torch

    import oakenkv.integrations.vllm.layout as lay_mod
    from oakenkv.bench.codec import _best_time
    from oakenkv.integrations.vllm import _oaken

    torch.set_num_threads(1)
    numba.set_num_threads(1)
    b = synthetic_blocks(a.rows, a.context)
    rng, rows, ctx, hkv, hd, hq, bs = b.rng, b.rows, b.ctx, b.hkv, b.hd, b.hq, b.bs
    lay, pool, upb, k, v, thr, w, table, tables = b.lay, b.pool, b.upb, b.k, b.v, b.thr, b.w, b.table, b.tables
    params = lay_mod.LayerParams(thr, hkv, 0.125, 0.0, True)
    q = rng.standard_normal((rows, hq, hd)).astype(np.float32)
    if "scratch" in inspect.signature(lay_mod.decode_attention_rows).parameters:
        scratch = lay_mod.DecodeScratch()

        def decode() -> None:
            lay_mod.decode_attention_rows(tables, 0, pool, q, params, 1, scratch)
    else:  # a tree from before the decode scratch buffers

        def decode() -> None:
            lay_mod.decode_attention_rows(tables, 0, pool, q, params, 1)

    view = b.view
    out = np.empty((rows, hq, hd), np.float32)
    lse = np.empty((rows, hq), np.float32)
    status = np.zeros(rows, np.int64)
    keep = tables.keep[:rows]
    sinks = tables.sinks(pool, rows)
    sink_keep = np.ones((rows, 1), np.uint8)
    qp = rng.standard_normal((256, hq, hd)).astype(np.float32)
    k16, v16 = torch.from_numpy(k[:rows].copy()), torch.from_numpy(v[:rows].copy())
    s16 = table[:, ctx // bs] * bs + ctx % bs
    k256, v256 = torch.from_numpy(k[:256].copy()), torch.from_numpy(v[:256].copy())
    s256 = table[0, np.arange(256) // bs] * bs + np.arange(256) % bs
    f32 = np.float32
    # a prompt's first chunk of 256 tokens (no history), attended by the tiles (torch's flash) and, where vLLM's ops
    # are present (run with the vLLM venv's python), by vLLM's own kernel (integrations/vllm/chunk.py)
    first = -(-256 // bs)
    ppool, pupb = lay_mod.pool_view(torch.zeros(first, lay.block_bytes, dtype=torch.uint8), lay)
    w.write(ppool, pupb, np.arange(256), torch.from_numpy(k[:256].copy()), torch.from_numpy(v[:256].copy()))
    ptables = lay_mod.BlockTables(lay, pupb)
    ptables.update(1, np.arange(first, dtype=np.int32)[None], np.array([256]), np.array([256]))
    qprompt = torch.from_numpy(rng.standard_normal((256, hq, hd)).astype(np.float32))
    own = None
    try:
        from oakenkv.integrations.vllm import chunk

        own = chunk.make(hq, hkv, hd)
    except ImportError:  # a tree from before chunk.py
        pass
    parts = {
        "decode_attention_rows (one layer's decode)": decode,
        "decode kernel (packed_decode_attention_serial)": lambda: _oaken.packed_decode_attention_serial(
            q, keep, f32(0.125), f32(0.0), 1, out, status, lse, *view
        ),
        "sink gather": lambda: tables.sinks(pool, rows),
        "merge_sinks": lambda: _oaken.merge_sinks(q, sink_keep, sinks, f32(0.125), f32(0.0), out, lse),
        "fwht of the step's queries [16, 9, 64]": lambda: _oaken.fwht(q),
        "fwht of a prompt's queries [256, 9, 64]": lambda: _oaken.fwht(qp),
        "write 16 tokens (a decode step)": lambda: w.write(pool, upb, s16, k16, v16),
        "write 256 tokens (a prompt)": lambda: w.write(pool, upb, s256, k256, v256),
        "prefill of a 256-token first chunk, tiles (torch's flash)": lambda: lay_mod.prefill_attention(
            ptables, 0, ppool, 0, qprompt, params
        ),
    }
    if own is not None:
        parts["prefill of a 256-token first chunk, vLLM's kernel"] = lambda: lay_mod.prefill_attention(
            ptables, 0, ppool, 0, qprompt, params, own=own
        )
    res = {}
    for name, fn in parts.items():
        best = _best_time(fn, a.repeats)  # the minimum of --repeats calls after a warm-up
        res[name] = best * 1e6
        print(f"{name:48s} {best * 1e6:9.1f} us")
    if a.json:
        up = subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
        import sys

        from oakenkv.bench.results import machine

        meta = {"rows": rows, "context": ctx, "repeats": a.repeats, "threads": 1, "uptime": up, "machine": machine(),
                "vllm_kernel": own is not None, "command": " ".join(["python", *sys.argv])}  # fmt: skip
        a.json.write_text(json.dumps({"min_us": res, "meta": meta}, indent=1) + "\n")


if __name__ == "__main__":
    main()
