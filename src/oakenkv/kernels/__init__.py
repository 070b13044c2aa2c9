"""Fast implementations of the Oaken format (``oakenkv.format``), each tested bit for bit against the reference
(``oakenkv.quant``). They import the format and the reference, never a room above them.

- ``codec``: the checked public entry points, :func:`encode` / :func:`decode` (float rows to the format's bytes and
  back) and :func:`effective_bits`.
- ``cpu``: numba kernels (``codec``: encode and decode of rows and page records; ``attention``: decode attention
  over a layer's packed pages; ``rotate``: oaken-plus's online key transform; ``helpers``).
- ``triton``: the same encode, decode and attention in Triton over the same bytes (GPU; interpreter-tested on CPU).

Nothing is imported here, so that ``import oakenkv.kernels`` does not compile or load numba.
"""

from oakenkv._lazy import exports

__getattr__, __dir__, __all__ = exports(
    __name__, {"decode": "kernels.codec", "encode": "kernels.codec", "effective_bits": "kernels.codec"}
)
