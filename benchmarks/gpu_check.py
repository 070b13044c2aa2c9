"""One prepared check of the Triton backend and the device store on a GPU (issues 24 and 33): correctness on real
shapes, then timings.

Run through ``benchmarks/gpu_check.sh`` on a CUDA machine (no network, nothing installed: the repository's
``src`` on ``PYTHONPATH``; torch, triton and transformers of the machine). ``--dry-run`` runs every stage on the CPU
under the Triton interpreter with tiny shapes, so that the one GPU run works the first time
(``tests/test_gpu_check.py``). ``--stages a,b`` runs some stages only.

Stages (the JSON is rewritten after each, so a run cut short still leaves what it measured):

1. ``correctness``: the Triton encode against ``codec.pack(quant.quantize(x))`` byte for byte (fp16, bf16, fp32
   input, Llama-2-7B and GQA row widths), the Triton decode against ``quant.dequantize`` bit for bit (decode
   attention on a synthetic pool is checked in stage ``attention``, rtol 1e-4);
   ``store``: ``DeviceKVStore`` on the GPU against ``PagedKVStore`` (numba) on a GQA layer's rows with an oaken-plus
   rotation and sink tokens: every record's bytes through prefill chunks, decode steps, a fork and an eviction,
   the tables, ``read`` bit for bit, decode and prefill attention against float attention;
   ``model``: the default model (or a random-weight stand-in of its architecture, where its file is absent)
   through ``OakenCache`` on CUDA (``backend="auto"``, the packed attention) against the CPU backend: greedy tokens
   and logits, perplexity on 4 windows (chunked prefill) within 0.5%;
2. ``copy``: the device-to-device copy bandwidth (bytes read + written per second), the ceiling of what follows;
3. ``encode``: encode throughput against a copy of the same fp16 input, and the encode time of one step's K/V;
4. ``attention``: decode attention, one query token per sequence: a Llama-2-7B-shaped layer (32 heads x 128) and a
   GQA layer (32 query / 8 KV heads x 128), batch 1/16/64, context 4K/32K: the Triton kernel (and its variant with
   FMA contraction), ``torch.nn.functional.scaled_dot_product_attention`` over fp16 K/V of the same shape, and
   FlashAttention's ``flash_attn_with_kvcache`` when installed; achieved bandwidth in packed bytes per second;
5. ``step``: a whole decode step of the model in fp16, ``OakenCache`` against ``DynamicCache``, batch 1/16 at 1K/4K;
6. ``vllm``: vLLM on the device with bf16, fp8 and Oaken KV (``vllm_cuda_serve.py`` per kind: output tokens per
   second at a KV budget that limits fp8), where vLLM is installed and the budget leaves time; ``tuning``: splits,
   tiles, warps, FMA;
   ``goals``: the issues' goals read off the measurements.

The paged pool of a layer shape is built once at its largest batch and context (rows encoded on the GPU by the
Triton encoder, copied into randomly permuted dense pages; each stream's sparse records back to back) and the
smaller cases read a prefix of its tables. Memory is estimated before anything is allocated: a pool that would not
fit ``--mem-gib`` is built at a smaller batch (recorded in ``size_down``); fp16 K/V that would not fit beside it
are not allocated and the SDPA case is recorded as skipped with the bytes it needed. Each case stops timing after
``--case-cap-s``; the whole run stops starting new work after ``--budget-s`` (the rest is listed as skipped). The
L2 cache is flushed (a 256 MiB write) before every timed launch.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import math
import os
import platform
import socket
import statistics
import sys
import time
import traceback
from pathlib import Path

GIB = 1 << 30

# Real shapes (issue 24) and the dry run's tiny ones: name -> (query heads, KV heads, head_dim, page_size).
LAYERS = {"mha_32x128": (32, 32, 128, 65536), "gqa_32q8kv_x128": (32, 8, 128, 16384)}
DRY_LAYERS = {"mha_2x16": (2, 2, 16, 1024), "gqa_4q2kv_x16": (4, 2, 16, 512)}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--out", default="benchmarks/results", help="JSON file, or a folder for gpu_check_<date>_<host>.json"
    )
    p.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, tiny shapes (tests the driver)")
    p.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,16,64; dry run 1,2)")
    p.add_argument("--contexts", default=None, help="comma-separated contexts (default 4096,32768)")
    p.add_argument("--layers", default=None, help="comma-separated layer shapes (default: all of LAYERS)")
    p.add_argument("--mem-gib", type=float, default=None, help="device memory to plan with (default: 92%% of total)")
    p.add_argument("--budget-s", type=float, default=400.0, help="start no new case after this many seconds")
    p.add_argument("--case-cap-s", type=float, default=20.0, help="stop timing one case after this many seconds")
    p.add_argument("--reps", type=int, default=20, help="timed launches per case (fewer if the cap is reached)")
    p.add_argument("--rows", type=int, default=4096, help="distinct encoded rows the synthetic pool repeats")
    p.add_argument("--model", default="default", help="'default' (the embedded model if installed) or 'random'")
    p.add_argument("--stages", default=None, help="comma-separated stages to run (default: all)")
    return p.parse_args(argv)


class Run:
    """Device, clock, budget and the results dict (written after every stage)."""

    def __init__(self, args: argparse.Namespace, torch, path: Path) -> None:
        self.args, self.torch, self.path = args, torch, path
        self.t0 = time.perf_counter()
        self.cuda = not args.dry_run
        self.dev = torch.device("cuda" if self.cuda else "cpu")
        self.res: dict = {"skipped": [], "size_down": [], "errors": [], "notes": []}
        if self.cuda:
            self.flush_buf = torch.empty(256 << 20, dtype=torch.uint8, device=self.dev)
        else:
            self.flush_buf = torch.empty(1 << 16, dtype=torch.uint8)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def over_budget(self) -> bool:
        return self.elapsed() > self.args.budget_s

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def save(self) -> None:
        self.res["elapsed_s"] = round(self.elapsed(), 2)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.res, indent=1, default=str) + "\n")

    def time_ms(self, fn, reps: int | None = None) -> dict:
        """Median/min milliseconds of ``fn()`` over up to ``reps`` launches after a warm-up (the L2 flushed before
        each), stopping after ``--case-cap-s``. On a GPU ``fn`` is captured once in a CUDA graph and the graph is
        replayed, so that the times are the device's, not Python's launch overhead (a Triton launch costs tens
        of microseconds on the host, more than a small decode step on the device); if capture fails, eager."""
        torch = self.torch
        reps = reps or self.args.reps
        fn()
        self.sync()
        mode, run_once = "eager", fn
        if self.cuda:
            try:
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    fn()
                torch.cuda.current_stream().wait_stream(s)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    fn()
                graph.replay()
                self.sync()
                mode, run_once = "cuda_graph", graph.replay
            except Exception as e:  # not capturable: eager launches (recorded)
                self.sync()
                mode = f"eager ({type(e).__name__})"
        times: list[float] = []
        start = time.perf_counter()
        for _ in range(reps):
            self.flush_buf.zero_()
            if self.cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                run_once()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b))
            else:
                t = time.perf_counter()
                run_once()
                times.append(1e3 * (time.perf_counter() - t))
            if time.perf_counter() - start > self.args.case_cap_s:
                break
        return {"median_ms": statistics.median(times), "min_ms": min(times), "launches": len(times), "mode": mode}

    def free_bytes(self) -> int:
        if self.cuda:
            free, _ = self.torch.cuda.mem_get_info()
            return int(free)
        return 8 * GIB


def _meta(run: Run) -> dict:
    torch = run.torch
    import triton

    meta = {
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dry_run": run.args.dry_run,
        "args": vars(run.args),
    }
    if run.cuda:
        p = torch.cuda.get_device_properties(0)
        meta.update(
            device=p.name, sms=p.multi_processor_count, memory_gib=round(p.total_memory / GIB, 1),
            capability=f"{p.major}.{p.minor}",
        )  # fmt: skip
    else:
        meta["device"] = "cpu (TRITON_INTERPRET=1)"
    try:
        import flash_attn

        meta["flash_attn"] = flash_attn.__version__
    except Exception:
        meta["flash_attn"] = None
    return meta


# ------------------------------------------------------------------------------------------------- synthetic K/V


def _kv_rows(torch, n: int, d: int, seed: int, dev, dtype):
    """``[n, d]`` K-like rows: Gaussian with a few outlier channels (x6), as real keys have."""
    g = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(n, d, generator=g, device=dev)
    x[:, 5::97] *= 6.0
    return x.to(dtype)


def _thresholds(torch, x) -> tuple[float, float, float, float]:
    """4% outer, 6% inner: the paper's split, from quantiles of (a sample of) ``x``."""
    flat = x.float().flatten()
    if flat.numel() > 1 << 22:
        flat = flat[:: flat.numel() // (1 << 22) + 1]
    qs = torch.tensor([0.02, 0.47, 0.53, 0.98], device=flat.device)
    t = torch.quantile(flat, qs).tolist()
    return (t[0], t[1], t[2], t[3])


# ------------------------------------------------------------------------------------------------- stages


def stage_correctness(run: Run, layers: dict) -> None:
    """Encode and decode bit for bit against the reference on real row widths; attention against float32."""
    torch = run.torch
    from oakenkv.format.config import OakenConfig
    from oakenkv.kernels import codec
    from oakenkv.kernels.triton import decode as tdecode
    from oakenkv.kernels.triton import encode as tencode
    from oakenkv.quant.quantizer import dequantize, quantize

    out = []
    n_rows = 8 if run.args.dry_run else 256
    widths = sorted({kv * hd for (_, kv, hd, _) in layers.values()})
    for d in widths:
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            for scale_dtype in ("float16", "float32"):
                if dtype != torch.float16 and scale_dtype == "float32":
                    continue  # fp32 scales once (fp16 input), the paper's fp16 scales for every input dtype
                cfg = OakenConfig(scale_dtype=scale_dtype)
                x = _kv_rows(torch, n_rows, d, seed=d, dev=run.dev, dtype=dtype)
                thr = _thresholds(torch, x)
                t = time.perf_counter()
                ref_q = quantize(x.cpu(), thr, cfg)
                ref = codec.pack(ref_q, cfg)
                got = tencode.encode_batch(x, thr, cfg)
                same = (
                    torch.equal(got.dense.cpu(), ref.dense)
                    and torch.equal(got.sparse.cpu(), ref.sparse)
                    and torch.equal(got.sparse_offsets.cpu(), ref.sparse_offsets)
                    and torch.equal((got.scales.cpu().float() + 0.0).view(torch.int32),
                                    (ref.scales.float() + 0.0).view(torch.int32))
                )  # fmt: skip
                dec = tdecode.decode_batch(ref, thr, cfg, device=run.dev).cpu()
                want = dequantize(ref_q, thr, cfg)
                dec_same = torch.equal((dec + 0.0).view(torch.int32), (want + 0.0).view(torch.int32))
                out.append({
                    "check": "encode+decode", "D": d, "rows": n_rows, "input": str(dtype).replace("torch.", ""),
                    "scales": scale_dtype, "encode_bit_exact": bool(same), "decode_bit_exact": bool(dec_same),
                    "outlier_fraction": round(float((ref_q.groups != 0).float().mean()), 4),
                    "seconds": round(time.perf_counter() - t, 2),
                })  # fmt: skip
                print(
                    f"  encode/decode D={d} {dtype} scales={scale_dtype}: encode exact={same} decode exact={dec_same}"
                )
    run.res["correctness"] = out
    run.save()


def build_pool(run: Run, hq: int, kv: int, hd: int, page_size: int, batch: int, ctx: int):
    """A synthetic paged pool of ``batch`` sequences x ``ctx`` tokens (keys and values) for one layer shape.

    Returns ``(view, info)``: the :class:`DeviceLayerView` and the bytes it holds."""
    torch = run.torch
    from oakenkv.format.config import OakenConfig
    from oakenkv.kernels.triton import _oaken as F
    from oakenkv.kernels.triton import encode as tencode
    from oakenkv.kernels.triton.view import DeviceLayerView

    cfg = OakenConfig()
    dev = run.dev
    d = kv * hd
    rec = F.record_size(d, cfg)
    cap = F.sparse_capacity(d)
    r = min(run.args.rows, batch * ctx)
    xk = _kv_rows(torch, r, d, seed=1, dev=dev, dtype=torch.float16)
    xv = _kv_rows(torch, r, d, seed=2, dev=dev, dtype=torch.float16) * 0.8
    thr = torch.tensor([_thresholds(torch, xk), _thresholds(torch, xv)], dtype=torch.float32, device=dev)
    recs = torch.empty((2 * r, rec), dtype=torch.uint8, device=dev)
    sps = torch.empty((2 * r, cap), dtype=torch.uint8, device=dev)
    cnts = torch.empty(2 * r, dtype=torch.int32, device=dev)
    tencode.encode_records(xk, thr[0].tolist(), cfg, records=recs[:r], sparse=sps[:r], counts=cnts[:r])
    tencode.encode_records(xv, thr[1].tolist(), cfg, records=recs[r:], sparse=sps[r:], counts=cnts[r:])
    del xk, xv
    rpp = page_size // rec
    n_pages = -(-ctx // rpp)
    # token (b, kind, t) -> one of the r encoded rows of its kind
    t_idx = torch.arange(ctx, device=dev, dtype=torch.int64)
    b_idx = torch.arange(batch, device=dev, dtype=torch.int64)[:, None, None]
    k_idx = torch.arange(2, device=dev, dtype=torch.int64)[None, :, None]
    row = (t_idx[None, None, :] * 7919 + b_idx * 104729 + k_idx * 31) % r + k_idx * r  # [B, 2, T]
    perm = torch.randperm(batch * 2 * n_pages, device=dev).to(torch.int32)
    dense_pages = perm.view(batch, 2, n_pages)
    dense_pool = torch.zeros(batch * 2 * n_pages * page_size, dtype=torch.uint8, device=dev)
    dst = dense_pages.to(torch.int64)[:, :, t_idx // rpp] * page_size + (t_idx % rpp) * rec
    flat_row = row.flatten()
    tencode.copy_spans(
        recs.view(-1), flat_row * rec, dense_pool, dst.flatten(),
        torch.full((flat_row.numel(),), rec, dtype=torch.int32, device=dev),
    )  # fmt: skip
    del dst
    lens = cnts[flat_row]  # int32 [B * 2 * T]
    addr = torch.cumsum(lens.to(torch.int64), 0) - lens
    sparse_pool = torch.zeros(max(1, int(lens.sum())), dtype=torch.uint8, device=dev)
    tencode.copy_spans(sps.view(-1), flat_row * cap, sparse_pool, addr, lens)
    run.sync()
    view = DeviceLayerView(
        dense_pool=dense_pool, sparse_pool=sparse_pool, page_size=page_size, record_size=rec,
        scale_bytes=F.scale_bytes(cfg), dense_pages=dense_pages, sparse_addr=addr.view(batch, 2, ctx),
        sparse_lengths=lens.view(batch, 2, ctx), thresholds=thr, inner_bits=cfg.inner_bits,
        outer_bits=cfg.outer_bits, num_kv_heads=kv, head_dim=hd,
    )  # fmt: skip
    info = {"dense_bytes": int(dense_pool.numel()), "sparse_bytes": int(sparse_pool.numel()), "rows": r, "rpp": rpp}
    return view, info


def slice_view(view, batch: int, ctx: int):
    """The view of the first ``batch`` sequences and ``ctx`` tokens (same pools, prefixes of the tables)."""
    from dataclasses import replace

    rpp = view.records_per_page
    return replace(
        view,
        dense_pages=view.dense_pages[:batch, :, : -(-ctx // rpp)],
        sparse_addr=view.sparse_addr[:batch, :, :ctx],
        sparse_lengths=view.sparse_lengths[:batch, :, :ctx],
    )


def pool_bytes_estimate(kv: int, hd: int, page_size: int, batch: int, ctx: int) -> int:
    """Bytes of a synthetic pool (and its tables) before building it: ~12% outliers' sparse bytes."""
    from oakenkv.format.config import OakenConfig
    from oakenkv.kernels.triton import _oaken as F

    d = kv * hd
    rec = F.record_size(d, OakenConfig())
    tokens = batch * 2 * ctx
    dense = batch * 2 * -(-ctx // (page_size // rec)) * page_size
    return int(dense + tokens * (0.12 * d + 2) + tokens * 40)


def reference_attention(run: Run, view, q, keep, scaling: float):
    """float32 attention over the view's tokens decoded by the (bit-exact) Triton decoder."""
    torch = run.torch
    from oakenkv.kernels.triton.decode import read_view

    k, v = read_view(view, 0), read_view(view, 1)  # [B, H, T, hd]
    group = q.shape[1] // view.num_kv_heads
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    s = torch.einsum("bhd,bhtd->bht", q.float(), k) * scaling
    s = s.masked_fill(keep[:, None, :] == 0, float("-inf"))
    return torch.einsum("bht,bhtd->bhd", torch.softmax(s, dim=-1), v)


def stage_copy_bandwidth(run: Run) -> float:
    torch = run.torch
    n = (2 * GIB) if run.cuda else (1 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=run.dev)
    dst = torch.empty_like(src)
    src.fill_(1)
    t = run.time_ms(lambda: dst.copy_(src), reps=10)
    gbps = 2 * n / (t["median_ms"] * 1e-3) / 1e9
    run.res["copy"] = {"bytes": n, **t, "gbps_read_plus_write": round(gbps, 1)}
    print(f"  device-to-device copy: {gbps:.0f} GB/s (read + write)")
    run.save()
    return gbps


def stage_encode(run: Run, layers: dict, batches: list[int]) -> None:
    """Encode throughput against a copy of the same fp16 input; one decode step's K/V rows per layer."""
    torch = run.torch
    from oakenkv.format.config import OakenConfig
    from oakenkv.kernels.triton import encode as tencode

    cfg = OakenConfig()
    out = []
    for name, (_, kv, hd, _) in layers.items():
        d = kv * hd
        for n in [2 * b for b in batches] + ([65536 * 1024 // d] if run.cuda else [8]):
            if run.over_budget():
                run.res["skipped"].append(f"encode {name} rows={n}: time budget")
                continue
            x = _kv_rows(torch, n, d, seed=3, dev=run.dev, dtype=torch.float16)
            # per-row thresholds already on the device: nothing crosses from the host inside a CUDA graph
            thr = torch.tensor(_thresholds(torch, x), device=run.dev).expand(n, 4).contiguous()
            bufs = tencode.encode_records(x, thr, cfg, check=False)
            enc = run.time_ms(lambda x=x, thr=thr, bufs=bufs: tencode.encode_records(
                x, thr, cfg, records=bufs[0], sparse=bufs[1], counts=bufs[2], check=False))  # fmt: skip
            y = torch.empty_like(x)
            cp = run.time_ms(lambda x=x, y=y: y.copy_(x))
            gbps = x.numel() * 2 / (enc["median_ms"] * 1e-3) / 1e9
            out.append({
                "layer": name, "D": d, "rows": n, "encode": enc, "copy": cp, "encode_gbps_fp16_in": round(gbps, 2),
                "encode_over_copy_time": round(enc["median_ms"] / cp["median_ms"], 2),
            })  # fmt: skip
            print(f"  encode {name} rows={n}: {enc['median_ms']:.4f} ms ({gbps:.1f} GB/s fp16 in), "
                  f"copy {cp['median_ms']:.4f} ms")  # fmt: skip
            run.res["encode"] = out
            run.save()


def _sdpa_case(run: Run, hq: int, kv: int, hd: int, b: int, t_n: int, q16) -> dict:
    """torch SDPA over fp16 K/V ``[B, H, T, hd]`` and FlashAttention's kvcache kernel (``[B, T, H, hd]``), each
    with its K/V allocated only if it fits beside the pool."""
    need = 2 * b * kv * t_n * hd * 2
    if need > run.free_bytes() - GIB:
        skip = {"skipped": f"fp16 K/V need {need / GIB:.1f} GiB, {run.free_bytes() / GIB:.1f} GiB free"}
        return {"sdpa_fp16": skip, "flash_attn_fp16": skip}
    return {
        "sdpa_fp16": _time_sdpa(run, hq, kv, hd, b, t_n, q16),
        "flash_attn_fp16": _time_fa(run, kv, hd, b, t_n, q16),
    }


def _time_sdpa(run: Run, hq: int, kv: int, hd: int, b: int, t_n: int, q16) -> dict:
    import torch.nn.functional as fn

    torch = run.torch
    need = 2 * b * kv * t_n * hd * 2
    from torch.nn.attention import SDPBackend, sdpa_kernel

    k = torch.randn(b, kv, t_n, hd, device=run.dev, dtype=torch.float16)
    v = torch.randn_like(k)
    qq = q16[:, :, None, :]
    r: dict = {"bytes": need}
    # The fused backends only: the math backend would expand GQA's K/V to every query head (4x the memory at
    # batch 64 x 128K) and is not what a GPU user runs. The first backend that takes the shape is timed.
    backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    if not run.cuda:
        backends = [SDPBackend.MATH]
    errors = []
    for backend in backends:
        try:
            with sdpa_kernel([backend]):
                r.update(run.time_ms(lambda: fn.scaled_dot_product_attention(qq, k, v, enable_gqa=hq != kv)))
            r["backend"] = backend.name
            r["gbps"] = round(need / (r["median_ms"] * 1e-3) / 1e9, 1)
            break
        except Exception as e:  # this backend refuses the shape: try the next, record why
            errors.append(f"{backend.name}: {e!r}"[:200])
    if errors:
        r["backend_errors"] = errors
    if "median_ms" not in r:
        r["error"] = "no fused SDPA backend took the shape"
    return r


def _time_fa(run: Run, kv: int, hd: int, b: int, t_n: int, q16) -> dict:
    torch = run.torch
    try:
        from flash_attn import flash_attn_with_kvcache
    except ImportError:
        return {"skipped": "flash_attn not installed"}
    need = 2 * b * kv * t_n * hd * 2
    try:
        kc = torch.randn(b, t_n, kv, hd, device=run.dev, dtype=torch.float16)
        vc = torch.randn_like(kc)
        qf = q16[:, None, :, :].contiguous()
        r = run.time_ms(lambda: flash_attn_with_kvcache(qf, kc, vc))
        r["gbps"] = round(need / (r["median_ms"] * 1e-3) / 1e9, 1)
        return r
    except Exception as e:
        return {"error": repr(e)[:300]}


def stage_attention(run: Run, layers: dict, batches: list[int], contexts: list[int], copy_gbps: float) -> None:
    torch = run.torch
    from oakenkv.kernels.triton import attention as tattn

    out = []
    run.res["attention"] = out
    mem = run.args.mem_gib * GIB if run.args.mem_gib else 0.92 * run.free_bytes()
    for name, (hq, kv, hd, page_size) in layers.items():
        if run.over_budget():
            run.res["skipped"].append(f"attention {name}: time budget")
            continue
        bmax, tmax = max(batches), max(contexts)
        # the largest pool that fits half the memory plan (the other half is for fp16 K/V of the SDPA baseline)
        while bmax > 1 and pool_bytes_estimate(kv, hd, page_size, bmax, tmax) > mem / 2:
            bmax //= 2
        if bmax < max(batches):
            full = pool_bytes_estimate(kv, hd, page_size, max(batches), tmax) / GIB
            run.res["size_down"].append(
                f"{name}: pool built for batch {bmax} at context {tmax} (batch {max(batches)} needs ~{full:.0f} GiB)"
            )
        t = time.perf_counter()
        try:
            pool, info = build_pool(run, hq, kv, hd, page_size, bmax, tmax)
        except Exception as e:
            run.res["errors"].append(f"build_pool {name}: {e!r}"[:400])
            traceback.print_exc()
            continue
        info["build_s"] = round(time.perf_counter() - t, 2)
        print(f"  pool {name}: batch {bmax} x {tmax} tokens, {info}")
        # correctness of the kernel on this pool (a slice: the float reference materializes K/V)
        cb, ct = min(2, bmax), min(contexts[0], tmax)
        v = slice_view(pool, cb, ct)
        q = torch.randn(cb, hq, hd, device=run.dev)
        keep = torch.ones(cb, ct, dtype=torch.uint8, device=run.dev)
        keep[-1, : ct // 3] = 0  # padding on the last row
        want = reference_attention(run, v, q, keep, hd**-0.5)
        got = tattn.paged_decode_attention(q, v, keep, hd**-0.5)
        fused = tattn.paged_decode_attention(q, v, keep, hd**-0.5, exact_dequant=False)
        err = ((got - want).abs().max() / want.abs().max()).item()
        err_f = ((fused - want).abs().max() / want.abs().max()).item()
        ok = bool(torch.allclose(got, want, rtol=1e-4, atol=1e-5))
        run.res.setdefault("correctness", []).append({
            "check": "attention", "layer": name, "batch": cb, "context": ct, "max_rel_err": err,
            "max_rel_err_fused": err_f, "allclose_rtol1e-4": ok,
        })  # fmt: skip
        print(f"  attention check {name} B={cb} T={ct}: max rel err {err:.2e} (fused {err_f:.2e}) ok={ok}")
        for b in batches:
            for t_n in contexts:
                case = {"layer": name, "q_heads": hq, "kv_heads": kv, "head_dim": hd, "batch": b, "context": t_n}
                if run.over_budget():
                    run.res["skipped"].append(f"attention {name} B={b} T={t_n}: time budget")
                    continue
                if b > bmax or t_n > tmax:
                    case["skipped"] = f"pool sized down to batch {bmax}"
                    out.append(case)
                    continue
                v = slice_view(pool, b, t_n)
                q = torch.randn(b, hq, hd, device=run.dev)
                packed = int(b * 2 * t_n * v.record_size + v.sparse_lengths.sum().item())
                fp16_bytes = 2 * b * kv * t_n * hd * 2
                splits = tattn.num_splits_for(b, kv, t_n)
                try:
                    sc = hd**-0.5
                    ours = run.time_ms(
                        lambda v=v, q=q, sc=sc: tattn.paged_decode_attention(q, v, None, sc, check=False)
                    )
                    fused = run.time_ms(lambda v=v, q=q, sc=sc: tattn.paged_decode_attention(
                        q, v, None, sc, check=False, exact_dequant=False))  # fmt: skip
                except Exception as e:
                    case["error"] = repr(e)[:400]
                    traceback.print_exc()
                    out.append(case)
                    run.save()
                    continue
                best = min(ours["median_ms"], fused["median_ms"])
                gbps = packed / (best * 1e-3) / 1e9
                case.update(
                    splits=splits, packed_bytes=packed, fp16_kv_bytes=fp16_bytes,
                    triton_exact=ours, triton_fused=fused, packed_gbps=round(gbps, 1),
                    packed_gbps_over_copy=round(gbps / copy_gbps, 3),
                )  # fmt: skip
                case.update(_sdpa_case(run, hq, kv, hd, b, t_n, q.to(torch.float16)))
                sd = case["sdpa_fp16"].get("median_ms")
                if sd:
                    case["speedup_vs_sdpa"] = round(sd / best, 3)
                fa = case["flash_attn_fp16"].get("median_ms")
                if fa:
                    case["speedup_vs_flash_attn"] = round(fa / best, 3)
                out.append(case)
                print(f"  {name} B={b} T={t_n}: triton {ours['median_ms']:.3f} ms (fused {fused['median_ms']:.3f}), "
                      f"{gbps:.0f} GB/s packed ({gbps / copy_gbps:.2f} of copy); SDPA {sd} ms; "
                      f"speedup {case.get('speedup_vs_sdpa')}")  # fmt: skip
                run.save()
                if run.cuda:
                    torch.cuda.empty_cache()
        del pool
        if run.cuda:
            torch.cuda.empty_cache()


def stage_tuning(run: Run, layers: dict) -> None:
    """Splits and warps of the attention kernel around their defaults, on the goal's case (GQA, batch 16, 32K;
    the dry run: its smallest case): the numbers to set the defaults from."""
    torch = run.torch
    from oakenkv.kernels.triton import attention as tattn

    name = next((k for k in layers if k.startswith("gqa")), None)
    if name is None or run.over_budget():
        run.res["skipped"].append("tuning: no GQA layer or time budget")
        return
    hq, kv, hd, ps = layers[name]
    b, t_n = (16, 32768) if run.cuda else (1, 32)
    pool, _ = build_pool(run, hq, kv, hd, ps, b, t_n)
    q = torch.randn(b, hq, hd, device=run.dev)
    base = tattn.num_splits_for(b, kv, t_n)
    packed = int(b * 2 * t_n * pool.record_size + pool.sparse_lengths.sum().item())
    out = []
    # (tokens per tile, warps): the default first, then the variants triton_sm90_check.py compiles without spills
    configs = [(tattn.TILE_TOKENS, tattn.NUM_WARPS), (8, 4), (16, 4)] if run.cuda else [(8, 4)]
    for splits in sorted({max(1, base // 2), base, 2 * base}) if run.cuda else [base]:
        for tile, warps in configs:
            for exact in (True, False):
                if run.over_budget():
                    run.res["skipped"].append(f"tuning splits={splits} tile={tile} warps={warps}: time budget")
                    continue
                t = run.time_ms(lambda s=splits, w=warps, e=exact, bt=tile: tattn.paged_decode_attention(
                    q, pool, None, hd**-0.5, num_splits=s, check=False, exact_dequant=e, num_warps=w,
                    tile_tokens=bt))  # fmt: skip
                gbps = packed / (t["median_ms"] * 1e-3) / 1e9
                out.append({"splits": splits, "tile_tokens": tile, "num_warps": warps, "exact_dequant": exact, **t,
                            "packed_gbps": gbps})  # fmt: skip
                print(f"  tuning {name} B={b} T={t_n} splits={splits} tile={tile} warps={warps} exact={exact}: "
                      f"{t['median_ms']:.3f} ms, {gbps:.0f} GB/s packed")  # fmt: skip
    run.res["tuning"] = {"layer": name, "batch": b, "context": t_n, "default_splits": base, "runs": out}
    run.save()


# ------------------------------------------------------------------------------------- the device store and a model


def _store_pair(run: Run, thr, layers: int, kv: int, hd: int, page_size: int, budget: int, chunk: int):
    """A CPU store (numba) and a device store of one profile: the reference and the store under test."""
    from oakenkv.store.device import DeviceKVStore
    from oakenkv.store.paged import PagedKVStore
    from oakenkv.store.pages import PoolConfig

    pc = PoolConfig(page_size=page_size, budget_bytes=budget)
    return (
        PagedKVStore(thr, layers, kv, hd, pc, prefill_chunk=chunk),
        DeviceKVStore(thr, layers, kv, hd, pc, prefill_chunk=chunk, device=run.dev),
    )


def _synthetic_thresholds(torch, layers: int, kv: int, hd: int, transforms=None):
    from oakenkv.calibrate.thresholds import GroupThresholds, ModelFingerprint, Thresholds
    from oakenkv.format.config import OakenConfig

    x = _kv_rows(torch, 512, kv * hd, seed=5, dev="cpu", dtype=torch.float32)
    t = GroupThresholds(*_thresholds(torch, x))
    keys = tuple(GroupThresholds(t.to_lo - 0.01 * i, t.ti_lo, t.ti_hi, t.to_hi + 0.01 * i) for i in range(layers))
    values = tuple(GroupThresholds(t.to_lo - 0.02 * i, t.ti_lo, t.ti_hi, t.to_hi + 0.02 * i) for i in range(layers))
    fp = ModelFingerprint("llama", layers, kv, hd)
    return Thresholds(OakenConfig(), fp, keys, values, transforms=transforms)


def _records_equal(cpu, dev, layer: int) -> dict:
    """Every stored token's dense and sparse record in the device store's pages (where its tables say) against the
    CPU store's bytes; the device tables against the host tables, the pool's invariants."""
    import numpy as np

    from oakenkv.store.device import stream_addresses

    dev.settle()
    ps, rpp, rec = dev.pool.config.page_size, dev.rpp, dev.rec_size
    data = dev.bytes.cpu().numpy()
    tokens = dense_bad = sparse_bad = 0
    for r in range(len(cpu.seqs)):
        for kind in (0, 1):
            stream = 2 * layer + kind
            ct, dt = cpu.pool.table(cpu.seqs[r], stream), dev.pool.table(dev.seqs[r], stream)
            start, n = ct.evicted_before, ct.num_tokens
            dense = cpu.pool.read_dense(cpu.seqs[r], stream, start)
            sparse, offs = cpu.pool.read_sparse(cpu.seqs[r], stream, start)
            addr = stream_addresses(dt, ps, start, n)
            pages = dt.dense_pages.view.astype(np.int64)
            for t in range(start, n):
                tokens += 1
                a = int(pages[t // rpp]) * ps + (t % rpp) * rec
                dense_bad += not np.array_equal(data[a : a + rec], dense[t - start])
                length = int(dt.sparse_len.view[t])
                want = sparse[offs[t - start] : offs[t - start + 1]]
                sparse_bad += not np.array_equal(data[addr[t - start] : addr[t - start] + length], want)
    dev.check_tables()
    dev.pool.check_invariants()
    return {"tokens": tokens, "dense_mismatch": dense_bad, "sparse_mismatch": sparse_bad}


def stage_store(run: Run) -> None:
    """The device store against the CPU store on a GQA layer's rows (8 x 128; the dry run: 2 x 16): a prefill in
    chunks, decode steps, a fork (copy on write), more steps, a sliding-window eviction; every record's bytes, the
    tables, the floats read back, decode and prefill attention against float attention over the CPU store's read.
    With an oaken-plus key shift and rotation and two sink tokens."""
    import numpy as np

    torch = run.torch
    from oakenkv.calibrate.transforms import LayerTransforms, Transforms
    from oakenkv.hf.attention import float_attention

    dry = run.args.dry_run
    kv, hd, hq = (2, 16, 4) if dry else (8, 128, 32)
    prefill, steps, page_size = (7, 3, 256) if dry else (300, 24, 16384)
    shift = tuple(float(v) for v in np.random.default_rng(3).standard_normal(kv * hd) * 0.3)
    plus = Transforms((LayerTransforms(key_shift=shift, key_rotation=True), LayerTransforms()), kv, hd, sink_tokens=2)
    thr = _synthetic_thresholds(torch, 2, kv, hd, plus)
    cpu, dev = _store_pair(run, thr, 2, kv, hd, page_size, 256 << 20 if not dry else 1 << 20, 128 if not dry else 4)
    g = torch.Generator().manual_seed(0)

    def kv_pair(b, s):
        k = torch.randn(b, kv, s, hd, generator=g) * 1.3
        k[..., 3] *= 4.0
        return k, torch.randn(b, kv, s, hd, generator=g)

    def both(b, s, layer=0):
        k, v = kv_pair(b, s)
        cpu.append(layer, k, v)
        dev.append(layer, k.to(run.dev), v.to(run.dev))

    t = time.perf_counter()
    out: dict = {}
    both(1, prefill)
    for _ in range(steps):
        both(1, 1)
    for st in (cpu, dev):
        st.reorder([0, 0])
    for _ in range(steps):
        both(2, 1)
    both(2, prefill // 3)
    out["records"] = _records_equal(cpu, dev, 0)
    read_same = all(torch.equal(dev.read(0, kind).cpu(), cpu.read(0, kind)) for kind in (0, 1))
    n = cpu.num_tokens(0)
    s = min(n, 17 if dry else 96)
    q = torch.randn(2, hq, s, hd, generator=g)
    mask = torch.ones(2, 1, s, n, dtype=torch.bool).tril(n - s)
    kr, vr = cpu.read(0, 0), cpu.read(0, 1)
    pre = dev.attention(q.to(run.dev), 0, None, hd**-0.5).cpu()
    pre_want = float_attention(q, kr, vr, mask, hd**-0.5)
    dec = dev.attention(q[:, :, -1:].to(run.dev), 0, None, hd**-0.5).cpu()
    dec_want = float_attention(q[:, :, -1:], kr, vr, None, hd**-0.5)
    dev.settle()
    released = [st.evict_before(0, n - 3) for st in (cpu, dev)]
    after_evict = _records_equal(cpu, dev, 0)
    out.update(
        read_bit_exact=bool(read_same),
        prefill_attention_max_abs_err=float((pre - pre_want).abs().max()),
        decode_attention_max_abs_err=float((dec - dec_want).abs().max()),
        attention_allclose=bool(
            torch.allclose(pre, pre_want, rtol=1e-4, atol=1e-5) and torch.allclose(dec, dec_want, rtol=1e-4, atol=1e-5)
        ),
        evicted_slots=released,
        records_after_eviction=after_evict,
        tokens=n,
        D=kv * hd,
        seconds=round(time.perf_counter() - t, 2),
    )
    out["bytes_equal"] = (
        out["records"]["dense_mismatch"] == out["records"]["sparse_mismatch"] == 0
        and after_evict["dense_mismatch"] == after_evict["sparse_mismatch"] == 0
        and released[0] == released[1]
    )
    out["rows_own_sinks_adapt"] = _store_own_starts_adapt(run, thr, kv, hd, hq, page_size, prefill, steps)
    run.res["store"] = out
    print(f"  device store vs CPU store: {json.dumps(out)}")
    run.save()


def _store_own_starts_adapt(run: Run, thr, kv: int, hd: int, hq: int, page_size: int, prefill: int, steps: int):
    """Left-padded rows (each row's sink tokens from its own start, ``set_row_starts``) under adaptive grouping
    (short epochs, so that the thresholds move): the device store against the CPU store, records, floats read back,
    the adaptive scales, and decode attention with a padding mask against float attention over the CPU read."""
    torch = run.torch
    from oakenkv.hf.attention import float_attention
    from oakenkv.quant.adapt import AdaptConfig
    from oakenkv.store.device import DeviceKVStore
    from oakenkv.store.paged import PagedKVStore
    from oakenkv.store.pages import PoolConfig

    t0 = time.perf_counter()
    ad = AdaptConfig(epoch=3 if run.args.dry_run else 16, gain=1.0, high=3.0)
    pc = PoolConfig(page_size=page_size, budget_bytes=(1 << 20) if run.args.dry_run else (256 << 20))
    chunk = 4 if run.args.dry_run else 128
    cpu = PagedKVStore(thr, 2, kv, hd, pc, prefill_chunk=chunk, adapt=ad)
    dev = DeviceKVStore(thr, 2, kv, hd, pc, prefill_chunk=chunk, device=run.dev, adapt=ad)
    pad = 3
    for st in (cpu, dev):
        st.set_row_starts([0, pad])
    g = torch.Generator().manual_seed(1)
    for s in [prefill] + [1] * steps:
        k = torch.randn(2, kv, s, hd, generator=g) * 2.0
        v = torch.randn(2, kv, s, hd, generator=g) * 2.0
        cpu.append(0, k, v)
        dev.append(0, k.to(run.dev), v.to(run.dev))
    rec = _records_equal(cpu, dev, 0)
    read_same = all(torch.equal(dev.read(0, kind).cpu(), cpu.read(0, kind)) for kind in (0, 1))
    n = cpu.num_tokens(0)
    q = torch.randn(2, hq, 1, hd, generator=g)
    keep = torch.ones(2, 1, 1, n, dtype=torch.bool)
    keep[1, ..., :pad] = False
    got = dev.attention(q.to(run.dev), 0, keep.to(run.dev), hd**-0.5).cpu()
    want = float_attention(q, cpu.read(0, 0), cpu.read(0, 1), keep, hd**-0.5)
    dev.settle()
    return {
        "records": rec,
        "read_bit_exact": bool(read_same),
        "adapt_scales_equal": dev.adapt_state.scale == cpu.adapt_state.scale,
        "adapt_moved": any(a != 1.0 for row in cpu.adapt_state.scale for a in row),
        "decode_attention_max_abs_err": float((got - want).abs().max()),
        "ok": bool(
            rec["dense_mismatch"] == rec["sparse_mismatch"] == 0
            and read_same
            and dev.adapt_state.scale == cpu.adapt_state.scale
            and torch.allclose(got, want, rtol=1e-4, atol=1e-5)
        ),
        "seconds": round(time.perf_counter() - t0, 2),
    }


#: The default model's architecture (SmolLM2-135M-Instruct), for a random-weight stand-in where its file is absent.
DEFAULT_ARCH = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
)  # fmt: skip
DRY_ARCH = dict(
    vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=256, eos_token_id=1, pad_token_id=0,
)  # fmt: skip


def _load_model(run: Run):
    """``(model fp32 on the CPU, name, tokenizer or None)``: the embedded default model where its package is
    installed, else a random-weight model of its architecture (the GGUF, 98 MB, does not fit what a device call
    carries: 64 MiB), recorded in the JSON. The dry run: a 2-layer random Llama."""
    torch = run.torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if not run.args.dry_run and run.args.model == "default":
        try:
            from oakenkv.assets.models import load_model

            loaded = load_model("default")
            return loaded.model.float().eval(), "default (SmolLM2-135M-Instruct)", loaded.tokenizer
        except Exception as e:  # the package is not there: the stand-in
            run.res["notes"].append(f"default model not available ({type(e).__name__}): random-weight stand-in")
    torch.manual_seed(0)
    arch = DRY_ARCH if run.args.dry_run else DEFAULT_ARCH
    model = LlamaForCausalLM(LlamaConfig(**arch)).float().eval()
    return model, ("tiny random Llama" if run.args.dry_run else "random weights, SmolLM2-135M architecture"), None


def _model_thresholds(torch, model, ids):
    """A quick profile: per-layer quantiles of one forward pass's keys (post-RoPE) and values (4% outer, 6% inner;
    ``tests/kv_helpers.quick_thresholds``' rule)."""
    from transformers import DynamicCache

    from oakenkv.calibrate.thresholds import GroupThresholds, ModelFingerprint, Thresholds
    from oakenkv.format.config import OakenConfig
    from oakenkv.util.compat import cache_kwargs

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, **cache_kwargs(model, cache), use_cache=True)
    qs = torch.tensor([0.02, 0.47, 0.53, 0.98], dtype=torch.float64)
    keys, values = [], []
    for layer in cache.layers:
        for x, out in ((layer.keys, keys), (layer.values, values)):
            t = torch.quantile(x.double().flatten()[: 1 << 22], qs).tolist()
            t[0] = min(t[0], t[1] - 1e-3)
            t[3] = max(t[3], t[2] + 1e-3)
            out.append(GroupThresholds(*t))
    fp = ModelFingerprint.from_model_config(model.config)
    return Thresholds(config=OakenConfig(), fingerprint=fp, keys=tuple(keys), values=tuple(values))


def _nll(torch, model, ids, cache, chunk: int) -> float:
    """Summed NLL of ``ids[1:]`` (one window) fed ``chunk`` tokens per forward through ``cache``."""
    from oakenkv.util.compat import cache_kwargs

    nll, s = 0.0, ids.numel()
    kw = cache_kwargs(model, cache)
    with torch.no_grad():
        for a in range(0, s - 1, chunk):
            b = min(a + chunk, s - 1)
            pos = torch.arange(a, b, device=ids.device)[None]
            logits = model(input_ids=ids[a:b][None], position_ids=pos, use_cache=True, **kw).logits[0].float()
            nll += float(torch.nn.functional.cross_entropy(logits, ids[a + 1 : b + 1], reduction="sum"))
    return nll


def stage_model(run: Run) -> None:
    """The default model through ``OakenCache`` on the device (``backend="auto"``: the Triton device store, the
    packed attention for prefill and decode) against the CPU backend (numba; the model in float32 on the CPU):
    greedy tokens and their logits, then perplexity on 4 windows (chunked prefill through the cache)."""
    import copy

    torch = run.torch
    from oakenkv.hf.attention import oaken_attention
    from oakenkv.hf.cache import OakenCache
    from oakenkv.store.pages import PoolConfig
    from oakenkv.util.compat import cache_kwargs

    dry = run.args.dry_run
    t0 = time.perf_counter()
    model_cpu, name, tok = _load_model(run)
    g = torch.Generator().manual_seed(1)
    vocab = model_cpu.config.vocab_size
    if tok is not None:
        prompt = tok("The tower is 324 metres tall, about the same height as", return_tensors="pt").input_ids
        text = Path(__file__).resolve().parents[1].joinpath("README.md").read_text(encoding="utf-8")
        corpus = tok(text * 4, return_tensors="pt").input_ids[0]
    else:
        prompt = torch.randint(3, vocab, (1, 12 if not dry else 5), generator=g)
        corpus = torch.randint(3, vocab, (8192,), generator=g)
    thr = _model_thresholds(torch, model_cpu, corpus[None, : 512 if not dry else 32])
    model_dev = copy.deepcopy(model_cpu).to(run.dev)
    res: dict = {"model": name, "layers": model_cpu.config.num_hidden_layers}
    pc = PoolConfig(budget_bytes=(1 << 30) if not dry else (4 << 20))
    new = 3 if dry else 16
    kw = {"max_new_tokens": new, "do_sample": False, "output_logits": True, "return_dict_in_generate": True}
    # the dry run's "device" is the CPU: the Triton backend is forced there (under the interpreter)
    runs = (("cpu", model_cpu, "cpu", "numba"), ("device", model_dev, run.dev, "triton" if dry else "auto"))
    outs = {}
    for label, model, dev, backend in runs:
        cache = OakenCache(thr, model.config, pool_config=pc, backend=backend)
        with oaken_attention(model), torch.no_grad():
            outs[label] = model.generate(input_ids=prompt.to(dev), **cache_kwargs(model, cache), **kw)
        res[f"{label}_store"] = type(cache.store).__name__
    a, b = outs["cpu"], outs["device"]
    first = [float((x.cpu() - y).abs().max()) for x, y in zip(a.logits, [t.cpu() for t in b.logits], strict=True)]
    same = a.sequences.cpu() == b.sequences.cpu()
    diverge = None if bool(same.all()) else int((~same[0]).nonzero()[0, 0]) - prompt.shape[1]
    top = a.logits[diverge].topk(2).values[0] if diverge is not None else None
    res["greedy"] = {
        "new_tokens": new, "same_tokens": diverge is None, "first_divergence": diverge,
        "margin_at_divergence": None if top is None else float(top[0] - top[1]),
        "logits_max_abs_diff_per_step": [round(x, 6) for x in first],
        "tokens_cpu": a.sequences[0, prompt.shape[1] :].tolist(),
        "tokens_device": b.sequences[0, prompt.shape[1] :].tolist(),
    }  # fmt: skip
    print(f"  greedy ({name}): same tokens {diverge is None}, logits diff per step {first}")
    run.res["model"] = res
    run.save()
    # perplexity on 4 windows: prefill chunks through the cache
    w, chunk = (256, 64) if not dry else (10, 5)
    windows = [corpus[i * w : (i + 1) * w] for i in range(4 if not dry else 1)]
    ppl = {}
    for label, model, dev, backend in runs:
        total = 0.0
        with oaken_attention(model):
            for ids in windows:
                cache = OakenCache(thr, model.config, pool_config=pc, backend=backend)
                total += _nll(torch, model, ids.to(dev), cache, chunk)
        ppl[label] = math.exp(total / (len(windows) * (w - 1)))
    rel = abs(ppl["device"] - ppl["cpu"]) / ppl["cpu"]
    res["perplexity"] = {"windows": len(windows), "window": w, "chunk": chunk, "cpu": ppl["cpu"],
                         "device": ppl["device"], "rel_diff": rel, "within_0.5%": rel <= 0.005}  # fmt: skip
    res["seconds"] = round(time.perf_counter() - t0, 1)
    print(f"  perplexity {len(windows)} x {w} (chunks of {chunk}): CPU {ppl['cpu']:.4f}, device "
          f"{ppl['device']:.4f}, rel diff {rel:.2e}")  # fmt: skip
    run.res["model"] = res
    run.save()


def stage_step(run: Run) -> None:
    """A whole decode step of the model in float16 on the device: ``OakenCache`` (device store, packed attention)
    against ``DynamicCache`` (fp16 K/V, SDPA), batch 1 and 16 at 1K and 4K tokens of context; CUDA events around
    each step's forward (the host's work included: both caches run eagerly)."""
    import copy

    torch = run.torch
    from transformers import DynamicCache

    from oakenkv.hf.attention import oaken_attention
    from oakenkv.hf.cache import OakenCache
    from oakenkv.store.pages import PoolConfig
    from oakenkv.util.compat import cache_kwargs

    dry = run.args.dry_run
    model_cpu, name, _ = _load_model(run)
    model = copy.deepcopy(model_cpu).to(device=run.dev, dtype=torch.float32 if dry else torch.float16)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(2)
    thr = _model_thresholds(torch, model_cpu, torch.randint(3, vocab, (1, 512 if not dry else 32), generator=g))
    del model_cpu
    cases = [(1, 16)] if dry else [(1, 1024), (16, 1024), (1, 4096), (16, 4096)]
    steps = 2 if dry else 8
    out = []
    run.res["step"] = {"model": name, "dtype": str(next(model.parameters()).dtype), "cases": out}
    for b, ctx in cases:
        if run.over_budget():
            run.res["skipped"].append(f"step B={b} T={ctx}: time budget")
            continue
        ids = torch.randint(3, vocab, (b, ctx), generator=g).to(run.dev)
        nxt = torch.randint(3, vocab, (b, steps), generator=g).to(run.dev)
        case = {"batch": b, "context": ctx}
        for label in ("dynamic_fp16", "oaken"):
            if label == "oaken":
                budget = (4 << 20) if dry else (4 << 30)
                cache = OakenCache(thr, model.config, pool_config=PoolConfig(page_size=16384 if not dry else 4096,
                                   budget_bytes=budget), backend="auto" if not dry else "triton")  # fmt: skip
            else:
                cache = DynamicCache(config=model.config)
            kw = cache_kwargs(model, cache)
            with torch.no_grad():
                model(input_ids=ids, use_cache=True, **kw)  # the prefill (float path for OakenCache)
                times = []
                ctxm = oaken_attention(model) if label == "oaken" else contextlib.nullcontext()
                with ctxm:
                    for i in range(steps):
                        if run.cuda:
                            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                            e0.record()
                            model(input_ids=nxt[:, i : i + 1], use_cache=True, **kw)
                            e1.record()
                            e1.synchronize()
                            times.append(e0.elapsed_time(e1))
                        else:
                            t = time.perf_counter()
                            model(input_ids=nxt[:, i : i + 1], use_cache=True, **kw)
                            times.append(1e3 * (time.perf_counter() - t))
            warm = times[1:] or times  # the first step loads and compiles kernels
            case[label] = {"median_ms": statistics.median(warm), "min_ms": min(warm), "steps": len(warm)}
            if label == "oaken":
                case["oaken_kv_bytes"] = cache.kv_bytes()
                case["oaken_store"] = type(cache.store).__name__
            del cache
            if run.cuda:
                torch.cuda.empty_cache()
        case["oaken_over_dynamic"] = round(case["oaken"]["median_ms"] / case["dynamic_fp16"]["median_ms"], 3)
        out.append(case)
        print(f"  decode step B={b} T={ctx}: DynamicCache fp16 {case['dynamic_fp16']['median_ms']:.2f} ms, "
              f"OakenCache {case['oaken']['median_ms']:.2f} ms ({case['oaken_over_dynamic']}x)")  # fmt: skip
        run.save()


#: The vllm stage needs about this many seconds of the budget (three engines starting, three timed batches).
VLLM_STAGE_S = 150.0


def stage_vllm(run: Run) -> None:
    """vLLM on this device with bf16, fp8 and Oaken KV (the plugin's CUDA backend, ``OAKEN_CUDA``, picked by the
    served profile): the default model (or its random-weight stand-in) saved to a directory, a quick profile of it,
    then ``benchmarks/vllm_cuda_serve.py`` once per kind, each in a process of its own: output tokens per second of
    64 requests of 256 + 128 tokens at a 128 MiB KV budget (one that limits fp8), and the greedy tokens. Needs vLLM
    installed on the machine (nothing is installed here) and the plugin's vLLM version; skipped with the reason
    otherwise, and in the dry run (``tests/test_vllm_plugin.py`` runs the backend inside vLLM's CPU engine under the
    Triton interpreter)."""
    import subprocess
    import tempfile

    torch = run.torch
    res: dict = {}
    run.res["vllm"] = res
    try:
        import vllm

        from oakenkv.integrations.vllm import SUPPORTED_VLLM
    except ImportError as e:
        res["skipped"] = f"vLLM is not installed here ({e}); the serve comparison needs it on the device machine"
    else:
        if vllm.__version__ != SUPPORTED_VLLM:
            res["skipped"] = f"vLLM {vllm.__version__} here; the plugin supports {SUPPORTED_VLLM}"
        elif run.args.dry_run:
            res["skipped"] = "the dry run starts no vLLM (tests/test_vllm_plugin.py runs the backend in its CPU engine)"
        elif run.args.budget_s - run.elapsed() < VLLM_STAGE_S:
            res["skipped"] = (
                f"time budget ({run.args.budget_s - run.elapsed():.0f} s left, about {VLLM_STAGE_S:.0f} s needed): "
                "run benchmarks/gpu_check.sh OUT --stages vllm"
            )
    if "skipped" in res:
        print(f"  vllm: {res['skipped']}")
        run.save()
        return
    model, name, _ = _load_model(run)
    work = Path(tempfile.mkdtemp(prefix="gpu_check_vllm_"))
    model_dir, profile = work / "model", work / "oaken-profile.json"  # (not oakenkv-profile.json: bf16 and fp8 too)
    model.to(torch.bfloat16).save_pretrained(model_dir)
    ids = torch.randint(10, model.config.vocab_size, (1, 512))
    _model_thresholds(torch, model.float(), ids).save(profile)
    res["model"] = name
    script = Path(__file__).with_name("vllm_cuda_serve.py")
    for kind in ("bf16", "fp8", "oaken"):
        left = run.args.budget_s + 60 - run.elapsed()
        if left < 30:
            run.res["skipped"].append(f"vllm {kind}: time budget")
            continue
        cmd = [sys.executable, str(script), "--model", str(model_dir), "--kind", kind, "--profile", str(profile)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=min(left, 150), check=False)
        except subprocess.TimeoutExpired:
            res[kind] = {"error": "timed out"}
            continue
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if lines:
            res[kind] = json.loads(lines[-1][7:])
            print(f"  vllm {kind}: {res[kind]['output_tokens_per_s']} output tokens/s")
        else:
            res[kind] = {"error": f"exit {proc.returncode}", "tail": (proc.stdout[-1500:] + proc.stderr[-3000:])}
            run.res["errors"].append(f"vllm {kind}: exit {proc.returncode}")
        run.save()
    tps = {k: res[k].get("output_tokens_per_s") for k in ("bf16", "fp8", "oaken") if isinstance(res.get(k), dict)}
    if tps.get("oaken") and tps.get("fp8"):
        res["oaken_over_fp8"] = round(tps["oaken"] / tps["fp8"], 3)
    if tps.get("oaken") and tps.get("bf16"):
        res["oaken_over_bf16"] = round(tps["oaken"] / tps["bf16"], 3)
    run.save()


def stage_goals(run: Run) -> None:
    """The issue's goals read off the measurements: speed against SDPA and bandwidth at GQA batch 16 x 32K (the dry
    run: its GQA layer's largest case), encode of one decode step's K/V against the attention at 4K."""
    att = [c for c in run.res.get("attention", []) if "triton_exact" in c]
    enc = run.res.get("encode", [])
    goals: dict = {}
    gqa = [c for c in att if c["layer"].startswith("gqa")]
    target = [c for c in gqa if (c["batch"], c["context"]) == (16, 32768)] or gqa[-1:]
    for c in target:
        goals["speedup_vs_sdpa"] = {"case": f"B={c['batch']} T={c['context']}", "goal": ">= 2.5",
                                    "value": c.get("speedup_vs_sdpa")}  # fmt: skip
        goals["packed_bandwidth_over_copy"] = {"case": f"B={c['batch']} T={c['context']}", "goal": ">= 0.6",
                                               "value": c.get("packed_gbps_over_copy")}  # fmt: skip
    shares = []
    for c in att:
        if c["context"] != min(x["context"] for x in att):
            continue
        e = [x for x in enc if x["layer"] == c["layer"] and x["rows"] == 2 * c["batch"]]
        if e:
            best = min(c["triton_exact"]["median_ms"], c["triton_fused"]["median_ms"])
            shares.append({"layer": c["layer"], "batch": c["batch"], "context": c["context"],
                           "encode_ms": e[0]["encode"]["median_ms"], "attention_ms": best,
                           "share": round(e[0]["encode"]["median_ms"] / best, 4)})  # fmt: skip
    goals["encode_share_of_attention"] = {"goal": "< 0.05 at 4K", "cases": shares}
    store = run.res.get("store", {})
    goals["store_bytes_equal_cpu"] = {"goal": "true", "value": store.get("bytes_equal")}
    own = store.get("rows_own_sinks_adapt", {})
    goals["store_left_padding_adapt_equal_cpu"] = {"goal": "true", "value": own.get("ok")}
    vl = run.res.get("vllm", {})
    goals["vllm_oaken_over_fp8_at_a_budget_limiting_fp8"] = {"goal": ">= 1", "value": vl.get("oaken_over_fp8"),
                                                             "skipped": vl.get("skipped")}  # fmt: skip
    model = run.res.get("model", {})
    goals["greedy_tokens_equal_cpu"] = {"goal": "true", "value": model.get("greedy", {}).get("same_tokens")}
    goals["perplexity_within_0.5%_of_cpu"] = {"goal": "<= 0.005", "value": model.get("perplexity", {}).get("rel_diff")}
    steps = run.res.get("step", {}).get("cases", [])
    goals["decode_step_over_dynamic_fp16"] = {
        "cases": [{k: c[k] for k in ("batch", "context", "oaken_over_dynamic")} for c in steps]
    }
    run.res["goals"] = goals
    print("  goals:", json.dumps(goals))
    run.save()


def main(argv: list[str] | None = None) -> dict:
    args = _parse(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels' modules are imported
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device (use --dry-run to exercise the driver on the CPU)")
    layers_all = DRY_LAYERS if args.dry_run else LAYERS
    layers = {k: layers_all[k] for k in (args.layers.split(",") if args.layers else layers_all)}
    batches = [int(v) for v in (args.batches or ("1,2" if args.dry_run else "1,16,64")).split(",")]
    contexts = [int(v) for v in (args.contexts or ("32,80" if args.dry_run else "4096,32768")).split(",")]
    if args.dry_run:
        args.rows = min(args.rows, 64)
        args.reps = min(args.reps, 2)
    out = Path(args.out)
    if out.suffix != ".json":
        stamp = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d")
        host = "dryrun" if args.dry_run else torch.cuda.get_device_name(0).replace(" ", "-")
        out = out / f"gpu_check_{stamp}_{host}.json"
    run = Run(args, torch, out)
    torch.manual_seed(0)
    if run.cuda:
        torch.backends.cuda.matmul.allow_tf32 = False
    run.res["meta"] = _meta(run)
    print(f"gpu_check: {run.res['meta']['device']}, torch {torch.__version__}, writing {out}")
    stages = [
        ("correctness", lambda: stage_correctness(run, layers)),
        ("store", lambda: stage_store(run)),
        ("model", lambda: stage_model(run)),
        ("copy", lambda: run.res.__setitem__("copy_gbps", stage_copy_bandwidth(run))),
        ("encode", lambda: stage_encode(run, layers, batches)),
        ("attention", lambda: stage_attention(run, layers, batches, contexts, run.res.get("copy_gbps") or math.nan)),
        ("step", lambda: stage_step(run)),
        ("vllm", lambda: stage_vllm(run)),
        ("tuning", lambda: stage_tuning(run, layers)),
        ("goals", lambda: stage_goals(run)),
    ]
    if args.stages:
        keep = set(args.stages.split(","))
        stages = [st for st in stages if st[0] in keep or st[0] == "goals"]
    for name, fn in stages:
        print(f"[{run.elapsed():6.1f} s] {name}")
        try:
            fn()
        except Exception as e:  # record and go on: one broken stage must not cost the others' numbers
            run.res["errors"].append(f"{name}: {e!r}"[:600])
            traceback.print_exc()
        run.save()
    print(f"[{run.elapsed():6.1f} s] done; {len(run.res['errors'])} error(s); results in {out}")
    return run.res


if __name__ == "__main__":
    res = main()
    sys.exit(1 if res["errors"] else 0)
