"""Throughput simulator: the Oaken accelerator against GPU serving (pure Python + numpy, no torch).

Quick use::

    from oakenkv.sim import get_model, get_system, simulate

    r = simulate(get_system("oaken-lpddr"), get_model("llama2-13b"), batch=256, input_len=1024,
                 output_len=1024)
    r.tokens_per_s, r.batch_run, r.kv_bytes_per_token

Modules: ``hardware`` (system specs and the global efficiency factors), ``shapes`` (model shapes),
``kvbytes`` (bits per KV value), ``serving`` (roofline step times, capacity, end-to-end runs), ``workload``
(traces), ``scheduler`` (iteration-level trace simulation), ``advisor`` (memory configuration advice, longest
context), ``validate`` (comparison with the paper), ``plots`` (matplotlib, optional). See ``docs/sim.md``.
"""

from oakenkv.sim.hardware import SYSTEMS, MemoryTier, SystemSpec, get_system
from oakenkv.sim.kvbytes import KV_FORMATS, get_kv_format, oaken_bits
from oakenkv.sim.serving import RunResult, max_batch, max_context, simulate
from oakenkv.sim.shapes import MODELS, ModelShape, get_model

__all__ = [
    "KV_FORMATS",
    "MODELS",
    "SYSTEMS",
    "MemoryTier",
    "ModelShape",
    "RunResult",
    "SystemSpec",
    "get_kv_format",
    "get_model",
    "get_system",
    "max_batch",
    "max_context",
    "oaken_bits",
    "simulate",
]
