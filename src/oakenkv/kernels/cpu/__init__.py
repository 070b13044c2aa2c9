"""numba CPU kernels, each bit-exact with ``oakenkv.quant.quantizer``."""
