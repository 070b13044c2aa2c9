"""Where the decode-attention kernel's time goes: the serial kernel (``oakenkv.kernels.cpu.attention``) timed
whole and with one part removed at a time, on one real layer's K/V of the default model.

The variants are built from the kernel's own source by text edits (a part's loop made empty) and compiled
without numba's cache, so they always match the code in the tree; an edit whose anchor text is no longer in the
source is reported as not applicable instead of timed. Only ``full`` computes the right result (checked against
the installed kernel); the others are timing probes, their outputs are meaningless.

    PYTHONPATH=src python benchmarks/bench_attention_parts.py --context 4096 --json /tmp/parts.json

Warm loop, one thread, best of 7 rounds; ns per (token, row). Part cost = full - variant.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

#: variant -> (anchor text in the kernel source, replacement)
VARIANTS = {
    "no_coo_walk": ("        if n:  # the walker", "        n = 0\n        if n:  # the walker"),
    "no_coo_entries": ("    coo = span_view(pool, s0, s0 + n)\n", "    coo = span_view(pool, s0, s0 + n)\n    n = 0\n"),
    "no_row_decode": (
        "    for j in range(out.shape[0]):\n        t = t0 + j",
        "    for j in range(0):\n        t = t0 + j",
    ),
    "no_value_accumulation": (
        "        for h in range(hq_n):\n            vo = (h // group) * hd",
        "        for h in range(0):\n            vo = (h // group) * hd",
    ),
    "no_exp": ("                e = _exp(ph[j] - mh)\n", "                e = ph[j] - mh\n"),
}


def _load(source: str, name: str, tmp: Path):
    path = tmp / f"{name}.py"
    path.write_text(source.replace("cache=True", "cache=False"))
    spec = importlib.util.spec_from_file_location(f"_parts_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=4096, help="tokens per row")
    ap.add_argument("--batch", type=int, default=1, help="rows")
    ap.add_argument("--layer", type=int, default=15, help="decoder layer whose K/V are used")
    ap.add_argument("--json", type=Path, help="write the results here")
    a = ap.parse_args()

    import numba
    import torch

    import oakenkv.kernels.cpu.attention as installed
    from oakenkv.apps.generate import load_or_profile_thresholds
    from oakenkv.assets.data import load_text, token_windows
    from oakenkv.assets.models import load_model
    from oakenkv.bench.attention import layer_store
    from oakenkv.bench.decode import record_source_kv, tile_rows

    numba.set_num_threads(1)
    torch.set_num_threads(1)
    loaded = load_model("default")
    thr = load_or_profile_thresholds(loaded, None)
    cfg = loaded.model.config
    ids = token_windows(loaded.tokenizer, load_text("wikitext2"), window=512, max_windows=1)
    k_src, v_src = record_source_kv(loaded.model, ids)[a.layer]
    t, b = a.context, a.batch
    hd, hq = cfg.head_dim, cfg.num_attention_heads
    store = layer_store(thr, cfg, a.layer, tile_rows(k_src, t, b), tile_rows(v_src, t, b))
    view = store.layer_view(a.layer)
    q = np.random.default_rng(0).standard_normal((b, hq, hd)).astype(np.float32)
    keep = np.ones((b, t), np.uint8)
    args = (q, keep, np.float32(hd**-0.5), np.float32(0.0), 1)

    def run(kernel):
        out = np.empty((b, hq, hd), np.float32)
        lse = np.empty((b, hq), np.float32)
        status = np.zeros(b, np.int64)
        kernel(*args, out, status, lse, *view)
        best = float("inf")
        calls = max(3, int(2e5 / (t * b)))
        for _ in range(7):
            t0 = time.perf_counter()
            for _ in range(calls):
                kernel(*args, out, status, lse, *view)
            best = min(best, (time.perf_counter() - t0) / calls)
        return best * 1e9 / (t * b), out

    source = Path(installed.__file__).read_text()
    _, want = run(installed.packed_decode_attention_serial)
    results: dict[str, float | str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        full_ns, got = run(_load(source, "full", Path(tmp)).packed_decode_attention_serial)
        assert np.allclose(got, want, rtol=1e-5, atol=1e-6), "the uncached copy of the kernel disagrees"
        results["full"] = full_ns
        print(f"{'full':24s} {full_ns:7.1f} ns per token and row", flush=True)
        for name, (anchor, replacement) in VARIANTS.items():
            if anchor not in source:
                results[name] = "not applicable (anchor text not in the kernel source)"
                print(f"{name:24s} not applicable", flush=True)
                continue
            ns, _ = run(_load(source.replace(anchor, replacement, 1), name, Path(tmp)).packed_decode_attention_serial)
            results[name] = ns
            print(f"{name:24s} {ns:7.1f} ns  (the part: {full_ns - ns:6.1f} ns)", flush=True)
    if a.json:
        meta = {"context": t, "batch": b, "layer": a.layer, "threads": 1, "loadavg": list(os.getloadavg())}
        a.json.write_text(json.dumps({"ns_per_token_row": results, "meta": meta}, indent=1) + "\n")


if __name__ == "__main__":
    main()
