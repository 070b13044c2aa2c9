"""Decode-attention kernel benchmark: packed KV bytes read per second next to memcpy (``oakenkv bench attention``).

The kernel alone (``oakenkv.hf.attention.packed_decode_attention``, its Python wrapper included), on real keys and
values: one prefill of ``source_tokens`` WikiText-2 tokens gives one layer's K/V (post-RoPE), tiled to the
context, each batch row starting at another offset, stored in a :class:`~oakenkv.store.paged.PagedKVStore` with the
model's thresholds. For each (context, batch, threads) point, interleaved rounds time

* the kernel: one query token per row over the layer's packed pages;
* memcpy: a copy of a buffer the size of the packed bytes (at least 64 MiB, so never from cache) by as many
  threads as the kernel has (numba ``prange`` over 1 MiB chunks);
* SDPA over the fp32 keys and values (what transformers' ``DynamicCache`` decode reads), for reference;

and the best time of each is reported. Bytes read: ``packed`` = every token's dense and sparse records of keys
and values (the pages' unused tails not counted), ``fp32`` = ``2 B T D * 4``. The goal of issue 22: the kernel
reads packed KV at >= 0.5x the memcpy bandwidth (16K tokens, batch 8).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from numba import njit, prange

#: Bytes copied per memcpy task.
_CHUNK = 1 << 20


@njit(cache=True, nogil=True, parallel=True)
def parallel_copy(dst, src):
    """``dst[:] = src`` (uint8, same size) in 1 MiB chunks over numba's threads."""
    n = src.shape[0]
    for c in prange((n + _CHUNK - 1) // _CHUNK):
        a = c * _CHUNK
        b = min(n, a + _CHUNK)
        dst[a:b] = src[a:b]


def _best_times(fns: dict[str, Callable[[], Any]], rounds: int) -> dict[str, float]:
    """Best wall time of each function over ``rounds`` rounds that run them in turn (after one warm-up each)."""
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            best[k] = min(best[k], time.perf_counter() - t)
    return best


def layer_store(thresholds: Any, config: Any, layer: int, keys: torch.Tensor, values: torch.Tensor) -> Any:
    """A :class:`~oakenkv.store.paged.PagedKVStore` for the model of ``config`` holding one layer's keys and values
    ``[B, H, T, hd]`` (any length: the pool's budget is 16 GiB), appended as a prefill would."""
    from oakenkv.calibrate.identity import kv_shape
    from oakenkv.store.paged import PagedKVStore
    from oakenkv.store.pages import PoolConfig

    store = PagedKVStore(
        thresholds,
        config.num_hidden_layers,
        *kv_shape(config),
        PoolConfig(budget_bytes=1 << 34),
    )
    chunk = store.prefill_chunk
    for start in range(0, keys.shape[2], chunk):
        store.append(layer, keys[:, :, start : start + chunk], values[:, :, start : start + chunk])
    return store


def run_attention_bench(
    contexts: list[int],
    batches: list[int],
    threads: list[int],
    *,
    model: str = "default",
    thresholds: Any = None,
    layer: int | None = None,
    rounds: int = 5,
    source_tokens: int = 512,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Kernel time, packed bytes per second, memcpy and fp32 SDPA at every (context, batch, threads) point.

    Args:
        contexts, batches, threads: the grid.
        thresholds: the model's ``Thresholds`` (required).
        layer: the decoder layer whose K/V are used (default: the middle one).
        rounds: interleaved timing rounds (the best time is reported).
        source_tokens: WikiText-2 tokens of the prefill whose K/V are tiled.
    """
    import numba

    from oakenkv.assets.data import load_text, token_windows
    from oakenkv.assets.models import load_model
    from oakenkv.bench.decode import record_source_kv, tile_rows
    from oakenkv.calibrate.identity import kv_shape
    from oakenkv.hf.attention import packed_decode_attention
    from oakenkv.hf.cache import KEY, VALUE, PackedKV

    if thresholds is None:
        raise ValueError("the attention benchmark needs the model's thresholds")
    if not contexts or not batches or not threads or min([*contexts, *batches, *threads]) < 1 or rounds < 1:
        raise ValueError("contexts, batches, threads and rounds must be positive and not empty")
    load_start = os.getloadavg()  # a shared machine: the load is part of the result
    loaded = load_model(model)
    cfg = loaded.model.config
    layer = cfg.num_hidden_layers // 2 if layer is None else layer
    ids = token_windows(loaded.tokenizer, load_text("wikitext2"), window=source_tokens, max_windows=1)
    k_src, v_src = record_source_kv(loaded.model, ids)[layer]
    (h, hd), hq = kv_shape(cfg), cfg.num_attention_heads
    scaling = hd**-0.5
    saved = (torch.get_num_threads(), numba.get_num_threads())
    points = []
    try:
        for context in contexts:
            for batch in batches:
                if progress:
                    progress(f"filling {context} tokens x {batch} rows")
                k, v = tile_rows(k_src, context, batch), tile_rows(v_src, context, batch)
                store = layer_store(thresholds, cfg, layer, k, v)
                handles = PackedKV(store, layer, KEY, context), PackedKV(store, layer, VALUE, context)
                view = store.layer_view(layer)
                lens = view.sparse_lengths[:, :, :context]
                packed = 2 * batch * context * view.record_size + int(lens.sum(dtype=np.int64))
                fp32 = 2 * batch * context * h * hd * 4
                q = torch.randn(batch, hq, 1, hd, generator=torch.Generator().manual_seed(0))
                mask = torch.ones(batch, 1, 1, context, dtype=torch.bool)
                src = np.ones(max(packed, 64 << 20), np.uint8)
                dst = np.zeros_like(src)
                for t in threads:
                    if progress:
                        progress(f"timing {context} tokens x {batch} rows, {t} thread(s)")
                    torch.set_num_threads(t)
                    numba.set_num_threads(t)
                    best = _best_times(
                        {
                            "kernel": lambda q=q, hs=handles, m=mask: packed_decode_attention(q, *hs, m, scaling),
                            "memcpy": lambda d=dst, s=src: parallel_copy(d, s),
                            "sdpa": lambda q=q, k=k, v=v: torch.nn.functional.scaled_dot_product_attention(
                                q, k, v, scale=scaling, enable_gqa=True
                            ),
                        },
                        rounds,
                    )
                    memcpy_gbps = src.size / best["memcpy"] / 1e9
                    points.append(
                        {
                            "context": context,
                            "batch": batch,
                            "threads": t,
                            "kernel_ms": 1e3 * best["kernel"],
                            "ns_per_token_row": 1e9 * best["kernel"] / (batch * context),
                            "packed_bytes": packed,
                            "packed_gbps": packed / best["kernel"] / 1e9,
                            "memcpy_gbps": memcpy_gbps,
                            "packed_vs_memcpy": packed / best["kernel"] / 1e9 / memcpy_gbps,
                            "sdpa_fp32_ms": 1e3 * best["sdpa"],
                            "fp32_bytes": fp32,
                            "sdpa_fp32_gbps": fp32 / best["sdpa"] / 1e9,
                            "kernel_time_vs_sdpa": best["kernel"] / best["sdpa"],
                        }
                    )
                del store, handles, view, src, dst
    finally:
        torch.set_num_threads(saved[0])
        numba.set_num_threads(saved[1])
    meta = {
        "model": loaded.name,
        "layer": layer,
        "rounds": rounds,
        "source_tokens": source_tokens,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "loadavg_1_5_15min": {"start": list(load_start), "end": list(os.getloadavg())},
        "cpus": os.cpu_count(),
        "note": "best wall time over interleaved rounds; packed_gbps = packed K/V bytes (dense + sparse records) "
        "read per second by the kernel; memcpy with as many threads as the kernel; SDPA over fp32 K/V for "
        "reference",
    }
    return {"points": points, "meta": meta}


def print_attention_bench(result: dict[str, Any], console: Any = None) -> None:
    """A table: kernel time, packed GB/s next to memcpy, and fp32 SDPA, per point."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    meta = result["meta"]
    table = Table(title=f"decode attention kernel, {meta['model']} layer {meta['layer']} (best of {meta['rounds']})")
    cols = ("T", "B", "threads", "kernel ms", "ns/token", "packed GB/s", "memcpy GB/s", "x memcpy", "SDPA fp32 ms")
    for col in cols:
        table.add_column(col, justify="right")
    for p in result["points"]:
        table.add_row(
            str(p["context"]),
            str(p["batch"]),
            str(p["threads"]),
            f"{p['kernel_ms']:.2f}",
            f"{p['ns_per_token_row']:.0f}",
            f"{p['packed_gbps']:.2f}",
            f"{p['memcpy_gbps']:.2f}",
            f"{p['packed_vs_memcpy']:.3f}",
            f"{p['sdpa_fp32_ms']:.2f}",
        )
    console.print(table)
