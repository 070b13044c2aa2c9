"""Triton kernels (GPU; tested on CPU under ``TRITON_INTERPRET=1``) over the same bytes and pages as the CPU path.

- ``encode``: float rows -> page records + COO bytes (bit-exact with ``quant.quantize`` + ``codec.pack``).
- ``decode``: page records (or pages) -> float rows (bit-exact with ``quant.dequantize`` + ``codec.unpack``).
- ``coo``: reading COO streams a block of bytes at a time (no per-byte loop), for decode and attention.
- ``attention``: paged decode attention (flash-decoding) over a layer's dense and sparse pages.
- ``prefill``: paged prefill attention (flash-attention style) of a chunk of queries over a layer's pages.
- ``rotate``: oaken-plus's online key transform on the device (the CPU kernel's bits).
- ``view``: a store's per-layer ``format.LayerView`` on a device, with the per-token sparse addresses the
  kernels read (``DeviceLayerView``).

- ``interpret``: the interpreter's fixed costs cut, and the larger blocks the device store launches under it
  (``TRITON_INTERPRET=1`` only).

Only ``_oaken`` imports oakenkv (``format`` and ``quant``: nothing above them).
Nothing is imported here, so that ``import oakenkv.kernels.triton`` does not import triton; :func:`available` says
whether it can be.
"""

from __future__ import annotations


def available() -> bool:
    """Whether triton imports (the kernels need it; on a machine without a GPU, only the interpreter runs them)."""
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True
