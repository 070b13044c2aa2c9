"""Issue #32's experiment: a hand-written AVX-512 decode-attention kernel (``oaken_decode.c`` beside this file)
against the numba kernel, on the vLLM plugin's ample shape (16 rows x 300 stored tokens, 3 KV heads x 64, 9 query
heads, oaken-plus's layout: ``benchmarks/bench_vllm_parts.py``'s ``synthetic_blocks``, ~9% outliers).

Needs gcc and an AVX-512 CPU (``-march=native``). For each variant (``oaken_decode.c``'s header): the whole kernel
(checked against ``packed_decode_attention_serial``: max |difference| of the outputs, and its time), and the row
decoder alone over every stored row (dense part only, and with the COO walk): the minimum of ``--repeats`` calls,
one thread, numba measured in the same run. Writes ``--json``.

    PYTHONPATH=src python benchmarks/experiments/c_decode/run.py --json benchmarks/results/c_decode.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
VARIANTS = [
    "",
    "-DVECLUT",
    "-DVECLUT -DFIXSCALAR",
    "-DVECLUT -DVECWALK",
    "-DVECLUT -DVECWALK -DFIXED",
    "-DVECLUT -DVECWALK -DSCATTER",
    "-DVECLUT -DDENSELUT",
    "-DVECLUT -DVECWALK -DDENSELUT",
]
ISOLATION = ["-DNOLUT", "-DNOWALK", "-DVECLUT -DVECWALK -DNODENSE", "-DVECLUT -DNOWALK -DNODENSE"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()

    import numba
    import numpy as np
    import torch

    from oakenkv.bench.codec import _best_time
    from oakenkv.kernels.cpu import attention as A

    sys.path.insert(0, str(HERE.parent.parent))  # benchmarks/: the blocks of bench_vllm_parts.py
    from bench_vllm_parts import synthetic_blocks

    torch.set_num_threads(1)
    numba.set_num_threads(1)
    blocks = synthetic_blocks(a.rows, a.context)
    rng, rows, ctx, hkv, hd, hq, d = blocks.rng, a.rows, a.context, blocks.hkv, blocks.hd, blocks.hq, blocks.d
    view, tables = blocks.view, blocks.tables
    q = rng.standard_normal((rows, hq, hd)).astype(np.float32)
    keep = np.ascontiguousarray(tables.keep[:rows])
    names = ("dense_pages", "sparse_pages", "sparse_first", "sparse_counts", "sparse_lengths", "thresholds")
    arr = {n: np.ascontiguousarray(getattr(view, n)) for n in names}
    no_coo = np.zeros_like(arr["sparse_lengths"])
    f32 = np.float32

    def best(fn) -> float:  # microseconds: the minimum of --repeats calls after a warm-up
        return _best_time(fn, a.repeats) * 1e6

    out_n = np.zeros((rows, hq, hd), np.float32)
    lse_n = np.zeros((rows, hq), np.float32)
    status = np.zeros(rows, np.int64)

    def numba_call() -> None:
        A.packed_decode_attention_serial(q, keep, f32(0.125), f32(0.0), 1, out_n, status, lse_n, *view)

    numba_us = best(numba_call)
    numba_no_coo_us = best(
        lambda: A.packed_decode_attention_serial(
            q, keep, f32(0.125), f32(0.0), 1, out_n, status, lse_n, *view._replace(sparse_lengths=no_coo)
        )
    )
    numba_call()
    ref = out_n.copy()
    p = ctypes.c_void_p
    i64, i32, flt = ctypes.c_int64, ctypes.c_int, ctypes.c_float
    tmp = Path(tempfile.mkdtemp(prefix="c_decode-"))

    def compile_variant(flags: str):
        so = tmp / f"v{abs(hash(flags))}.so"
        cmd = f"gcc -O3 -march=native -ffp-contract=off -shared -fPIC {flags} -o {so} {HERE / 'oaken_decode.c'}"
        subprocess.run(cmd, shell=True, check=True)
        lib = ctypes.CDLL(str(so))
        lib.oaken_decode.argtypes = [p, p, i64, flt, i32, i32, i32, i32, i32, p, i64, i64, i32, p, i64, p, p, i64, p,
                                     p, i64, p, p, p]  # fmt: skip
        lib.decode_all.argtypes = [i32, i32, i32, p, i64, i64, i32, p, i64, p, p, i64, p, p, i64, p, p, i32]
        return lib

    def common(lens):
        return (
            view.pool.ctypes.data, view.page_size, view.record_size, view.scale_bytes,
            arr["dense_pages"].ctypes.data, arr["dense_pages"].shape[2], arr["sparse_pages"].ctypes.data,
            arr["sparse_first"].ctypes.data, arr["sparse_pages"].shape[2], arr["sparse_counts"].ctypes.data,
            lens.ctypes.data, lens.shape[2], arr["thresholds"].ctypes.data,
        )  # fmt: skip

    out_c = np.zeros_like(out_n)
    lse_c = np.zeros_like(lse_n)
    sink = np.zeros(1, np.float32)

    def kernel(lib, lens):
        def call() -> None:
            rc = lib.oaken_decode(q.ctypes.data, keep.ctypes.data, keep.shape[1], 0.125, rows, hq, hd, hkv, ctx,
                                  *common(lens), out_c.ctypes.data, lse_c.ctypes.data)  # fmt: skip
            assert rc == 0, rc

        return call

    def rows_only(lib, use_coo):
        return lambda: lib.decode_all(rows, d, ctx, *common(arr["sparse_lengths"]), sink.ctypes.data, use_coo)

    res = {"numba_us": numba_us, "numba_no_coo_us": numba_no_coo_us, "variants": {}, "isolation": {}}
    for flags in VARIANTS:
        lib = compile_variant(flags)
        t = best(kernel(lib, arr["sparse_lengths"]))
        diff = float(np.abs(out_c - ref).max())
        r = {"kernel_us": t, "numba_over_c": numba_us / t, "max_abs_diff_vs_numba": diff,
             "kernel_no_coo_us": best(kernel(lib, no_coo)), "rows_dense_us": best(rows_only(lib, 0)),
             "rows_with_coo_us": best(rows_only(lib, 1))}  # fmt: skip
        r["coo_ns_per_row"] = (r["rows_with_coo_us"] - r["rows_dense_us"]) * 1e3 / (2 * rows * ctx)
        res["variants"][flags or "scalar"] = r
        print(f"{flags or 'scalar':30s} kernel {t:6.0f} us (numba {numba_us:.0f}: {numba_us / t:.2f}x),"
              f" diff {diff:.1e}; no COO {r['kernel_no_coo_us']:.0f} us (numba {numba_no_coo_us:.0f}); rows: dense"
              f" {r['rows_dense_us']:.0f} us, +COO {r['coo_ns_per_row']:.1f} ns/row")  # fmt: skip
    for flags in ISOLATION:
        lib = compile_variant(flags)
        dense, coo = best(rows_only(lib, 0)), best(rows_only(lib, 1))
        res["isolation"][flags] = {"rows_dense_us": dense, "rows_with_coo_us": coo}
        print(f"{flags:30s} rows: dense part {dense:.0f} us, with the COO part {coo:.0f} us")
    if a.json:
        from oakenkv.bench.results import machine

        up = subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
        meta = {"rows": rows, "context": ctx, "repeats": a.repeats, "threads": 1, "uptime": up, "machine": machine(),
                "gcc": subprocess.run(["gcc", "--version"], capture_output=True, text=True).stdout.splitlines()[0],
                "command": " ".join(["python", *sys.argv])}  # fmt: skip
        a.json.write_text(json.dumps({**res, "meta": meta}, indent=1) + "\n")


if __name__ == "__main__":
    main()
