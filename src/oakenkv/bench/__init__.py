"""Benchmarks behind ``oakenkv bench``: each module measures one component and returns JSON-able results.

- ``oakenkv.bench.codec``: encode/decode throughput of the fused format vs memcpy and optimum-quanto int4,
  effective bits, and the storage comparison (pure dense / pure sparse / fused, ``formats``) on real K/V.
- ``decode``: time per decode step and KV bytes at long contexts, OakenCache against the transformers caches.
- ``attention``: the decode-attention kernel's packed bytes per second next to memcpy and fp32 SDPA.
- ``generate``: ``model.generate`` tokens/s, prefill and decode apart.
- ``results``: the one writer of ``benchmarks/results/<benchmark>/<point>.json`` (command, commit, machine, load).
"""
