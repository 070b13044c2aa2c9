"""How often a token's COO record overflows its vLLM block's sparse area, measured with the plugin's own writer.

Records the model's post-RoPE keys and values on WikiText-2 windows (transformers, float32), writes every token
into simulated vLLM blocks with ``oakenkv.integrations.vllm.layout.BlockWriter`` (the code the vLLM backend runs,
overflow policy ``clip``) for several block sizes and sparse capacities, and reports per configuration: bytes per
token, records that overflowed (fraction of all K and V records), values the clip policy moved into the middle
group, and how much that raised the squared error of the stored keys and values. Needs no vLLM::

    python benchmarks/vllm_overflow.py --thresholds thr.json --windows 8 --window 1024 \\
        --json benchmarks/results/vllm_overflow/default.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--thresholds", type=Path, required=True, help="profile (`oakenkv profile`)")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--block-sizes", default="16,32,64,128")
    ap.add_argument(
        "--capacities",
        default="16,20,22,24,default,28",
        help="sparse bytes per token and kind; 'default' = the plugin's default",
    )
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    from tqdm import tqdm

    from oakenkv.assets.data import load_text, token_windows
    from oakenkv.assets.models import load_model
    from oakenkv.calibrate.profile import record_kv
    from oakenkv.calibrate.thresholds import Thresholds
    from oakenkv.integrations.vllm.layout import BlockLayout, BlockWriter, dequantize, pool_view
    from oakenkv.kernels.codec import decode, encode

    lm = load_model(args.model)
    thr = Thresholds.load(args.thresholds)
    thr.check_model(lm.model.config)
    cfg = thr.config
    ids = token_windows(lm.tokenizer, load_text("wikitext2"), window=args.window, max_windows=args.windows)
    sizes = [int(b) for b in args.block_sizes.split(",")]
    caps = [None if c.strip() == "default" else float(c) for c in args.capacities.split(",")]
    num_layers = thr.num_layers
    thr_arr = [np.array([thr.layer(i, k).as_tuple() for k in ("key", "value")], np.float32) for i in range(num_layers)]
    acc: dict[tuple[int, float | None], dict[str, float]] = {
        (b, c): {"records": 0, "overflows": 0, "values_moved": 0, "err_exact": 0.0, "err_stored": 0.0}
        for b in sizes
        for c in caps
    }
    lengths: list[np.ndarray] = []
    t0 = time.time()
    for w in tqdm(range(ids.shape[0]), desc="windows", unit="window"):
        with torch.inference_mode():
            keys, values = record_kv(lm.model, ids[w : w + 1])
        for layer in range(num_layers):
            k = keys[layer][0].permute(1, 0, 2).reshape(args.window, -1).float().contiguous()
            v = values[layer][0].permute(1, 0, 2).reshape(args.window, -1).float().contiguous()
            dim = k.shape[1]
            exact = []
            for kind, x in enumerate((k, v)):
                enc = encode(x, tuple(thr_arr[layer][kind]), cfg)
                lengths.append(np.diff(enc.sparse_offsets.numpy()))
                exact.append(decode(enc, tuple(thr_arr[layer][kind]), cfg))
            for b in sizes:
                for c in caps:
                    lay = BlockLayout.make(dim, b, cfg, c)
                    nblocks = -(-args.window // b)
                    raw = torch.zeros((nblocks, lay.block_bytes), dtype=torch.uint8)
                    pool, upb = pool_view(raw, lay)
                    writer = BlockWriter(lay, thr_arr[layer], "clip")
                    writer.write(pool, upb, np.arange(args.window), k, v)
                    a = acc[(b, c)]
                    st = writer.stats
                    a["records"] += st.written
                    a["overflows"] += sum(st.tokens)
                    a["values_moved"] += st.values_moved
                    if sum(st.tokens):
                        kd, vd = dequantize(pool, upb, lay, np.arange(nblocks), args.window, thr_arr[layer])
                        for x, e, s in ((k, exact[0], kd), (v, exact[1], vd)):
                            a["err_exact"] += float(((x - e) ** 2).sum())
                            a["err_stored"] += float(((x - s) ** 2).sum())
    lens = np.concatenate(lengths)
    configs = []
    for (b, c), a in acc.items():
        lay = BlockLayout.make(dim, b, cfg, c)
        row = {
            "block_size": b,
            "sparse_bytes_per_token": c if c is not None else "default",
            "sparse_capacity_per_token": lay.sparse_area_bytes / b,
            "bytes_per_token": lay.bytes_per_token,
            "records": int(a["records"]),
            "overflows": int(a["overflows"]),
            "overflow_fraction": a["overflows"] / max(a["records"], 1),
            "values_moved": int(a["values_moved"]),
            "squared_error_increase_where_overflowed": (a["err_stored"] / a["err_exact"] - 1.0)
            if a["err_exact"]
            else 0.0,
        }
        configs.append(row)
        print(
            f"B={b:>3} capacity {row['sparse_capacity_per_token']:5.1f} B/token "
            f"({row['bytes_per_token']:6.1f} B/token in all): "
            f"{row['overflows']} of {row['records']} records overflowed ({row['overflow_fraction']:.2e}), "
            f"{row['values_moved']} values moved"
        )
    result = {
        "kind": "vllm_overflow",
        "model": args.model,
        "thresholds": str(args.thresholds),
        "windows": args.windows,
        "window": args.window,
        "row_sparse_bytes": {
            "mean": float(lens.mean()),
            "p50": float(np.percentile(lens, 50)),
            "p99": float(np.percentile(lens, 99)),
            "p999": float(np.percentile(lens, 99.9)),
            "max": int(lens.max()),
        },
        "configs": configs,
        "seconds": time.time() - t0,
    }
    print(json.dumps(result["row_sparse_bytes"]))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
