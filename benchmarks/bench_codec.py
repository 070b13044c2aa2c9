"""Codec benchmark driver: ``python benchmarks/bench_codec.py [--json OUT]`` (same as ``oakenkv bench codec``).

Measures encode/decode throughput of the fused dense-and-sparse format on [tokens, values] fp16 tensors next to
memcpy and optimum-quanto's int4, effective bits, and the storage comparison on the default model's real K/V.
See ``oakenkv.bench.codec`` for what each number means.
"""

from __future__ import annotations

from oakenkv.cli import app

if __name__ == "__main__":
    app(["bench", "codec", *__import__("sys").argv[1:]])
