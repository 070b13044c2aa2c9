"""Every KV-cache method oakenkv runs, ours and the peers', behind one interface.

- ``registry``: each family declared once (parameters, defaults, bits, what it simplifies, how it is built), the
  aliases, spec parsing and ``build_method``; the command line, the evaluation and the diagnosis read it.
- ``build``: one builder per family. ``oaken``: Oaken's quantizers for the evaluation's cache.
- ``fakequant``: the transformers caches the evaluation runs a method through (quantize, then store dequantized).
- The peers, as fake-quantizers with the same interface and bit accounting (``base``): ``uniform`` (the min/max
  quantizer they share, and per-token INT-n, QServe / Atom style), ``kivi``, ``kvquant`` (KVQuant-style, uniform
  grid), ``fp8``, ``oaken_official`` (Oaken as the authors' harness computes it).
"""

from oakenkv._lazy import exports

__getattr__, __dir__, __all__ = exports(
    __name__,
    {
        "ALIASES": "methods.registry",
        "FAMILIES": "methods.registry",
        "NAMES": "methods.registry",
        "build_method": "methods.registry",
        "parse_spec": "methods.registry",
    },
)
