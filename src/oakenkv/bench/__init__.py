"""Benchmarks behind ``oakenkv bench``: each module measures one component and returns JSON-able results.

- ``oakenkv.bench.codec``: encode/decode throughput of the fused format vs memcpy and optimum-quanto int4,
  effective bits, and the storage comparison (pure dense / pure sparse / fused) on real K/V.
"""
