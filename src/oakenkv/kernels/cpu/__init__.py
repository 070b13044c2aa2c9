"""numba CPU kernels, compiled once into numba's on-disk cache and bit-exact with ``oakenkv.quant``.

- ``codec``: ``encode_batch`` / ``decode_batch`` (rows, multi-threaded), ``encode_records`` / ``decode_records``
  (rows straight into page records and back), and the ``@njit`` row helpers other kernels inline.
- ``attention``: decode attention over a layer's packed pages (a ``format.layout.LayerView``) and the merges of
  sink tokens and a full-precision window through the log-sum-exp; ``split_work``, its rule for threads.
- ``rotate``: oaken-plus's online key transform (a shift, then a per-head Walsh-Hadamard transform).
- ``helpers``: fp16 conversions, borrowed array views and LLVM intrinsics the kernels share.

Nothing is imported here (numba compiles on first use).
"""
