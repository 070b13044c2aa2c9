"""The reference in plain PyTorch, which defines the numbers every fast path must reproduce bit for bit.

- ``groups``: :class:`GroupThresholds`, the four thresholds that split one layer's keys or values.
- ``quantizer``: grouping (Eq. 1), group shift (Eq. 4), per-token min/max quantization (Eq. 2/3) and its inverse.
- ``reference``: pack / unpack of the quantizer's codes into the format's bytes, and encode / decode through both.
"""

from oakenkv._lazy import exports

__getattr__, __dir__, __all__ = exports(
    __name__,
    {
        "GroupThresholds": "quant.groups",
        "QuantizedVectors": "quant.quantizer",
        "dequantize": "quant.quantizer",
        "quantize": "quant.quantizer",
        "quantize_dequantize": "quant.quantizer",
        "pack": "quant.reference",
        "unpack": "quant.reference",
    },
)
