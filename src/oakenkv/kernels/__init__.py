"""Fast implementations of the Oaken codec, each tested bit for bit against ``oakenkv.quant`` + ``oakenkv.codec``.

- ``oakenkv.kernels.cpu``: numba CPU kernels (multi-threaded over rows, compiled once into numba's on-disk
  cache): ``encode_batch`` / ``decode_batch`` and the ``@njit`` single-row helpers ``decode_row_into`` /
  ``decode_row_into_lut`` for use inside other numba kernels.
- ``oakenkv.kernels.formats``: the storage-comparison formats (pure dense 5-bit, conventional 23-bit COO).
- ``oakenkv.kernels.attention_cpu``: decode attention over packed pages (calls ``decode_row_into_lut``).

Nothing is imported here so that ``import oakenkv.kernels`` does not compile or load numba.
"""
