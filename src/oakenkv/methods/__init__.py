"""The peers Oaken is compared against, as fake-quantizers with the same interface and bit accounting.

Every baseline quantizes and immediately dequantizes ("fake quantization"): the evaluation measures what the
attention would read from the method's stored cache, and each baseline counts the bits it would store the
same way (codes + scales/zero points + outliers + indices, per stored value; fp16 is 16 bits). The modules:

- :mod:`~oakenkv.methods.uniform`: the asymmetric min/max integer quantizer shared by the others, and the
  per-token-per-head INT-n baseline (QServe / Atom style).
- :mod:`~oakenkv.methods.kivi`: KIVI (keys per channel in token groups, values per token, full-precision
  residual window) as a transformers cache layer.
- :mod:`~oakenkv.methods.kvquant`: KVQuant-style 4-bit with 1% dense-and-sparse fp16 outliers and pre-RoPE
  per-channel keys (uniform grid instead of KVQuant's non-uniform one: see the module).
- :mod:`~oakenkv.methods.fp8`: FP8 e4m3 with a per-tensor scale (vLLM's ``kv_cache_dtype="fp8"``).
- :mod:`~oakenkv.methods.oaken_official`: Oaken as the authors' evaluation harness computes it (per-layer
  calibrated min/max instead of per-token, pre-RoPE keys), to measure how much that flatters it.

transformers' own ``QuantizedCache`` (quanto backend) is used unchanged; see :mod:`oakenkv.methods.registry`.
"""
