"""Fast implementations of the Oaken format (``oakenkv.format.layout``), each tested bit for bit against the reference
(``oakenkv.quant.quantizer`` + ``oakenkv.quant.reference``). They import the format and never a module above it.

- ``oakenkv.kernels.cpu.codec``: numba CPU kernels (multi-threaded over rows, compiled once into numba's on-disk
  cache): ``encode_batch`` / ``decode_batch``, ``encode_records`` (a decode step's rows straight into page
  records) and the ``@njit`` single-row helpers ``decode_row_into`` / ``decode_row_into_lut`` for use inside
  other numba kernels.
- ``oakenkv.kernels.cpu.attention``: decode attention over a layer's packed pages (a ``format.LayerView``).
- ``oakenkv.bench.formats``: the storage-comparison formats (pure dense 5-bit, conventional 23-bit COO).
- ``oakenkv.kernels.cpu.helpers``: fp16 conversions, borrowed views and other numba/LLVM helpers they share.

Nothing is imported here so that ``import oakenkv.kernels`` does not compile or load numba.
"""
