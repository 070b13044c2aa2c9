"""oakenkv: Oaken online-offline hybrid KV-cache quantization (Kim et al., ISCA 2025).

Two lines put it into a Hugging Face model's ``generate``::

    from oakenkv import OakenCache
    cache = OakenCache.for_model(model, preset="oaken-plus")
    model.generate(**inputs, past_key_values=cache)

Importing the package is lean: it loads no model, downloads nothing and does not initialise a GPU; the names below
load their modules (torch, transformers, numba) on first use. The rooms, each a sub-package: ``format`` (the bytes),
``quant`` (the reference quantizer), ``kernels`` (numba and Triton), ``store`` (pages), ``calibrate`` (profiles),
``hf`` (the transformers adapter), ``methods`` (ours and the peers'), ``integrations`` (vLLM), ``assets`` (models
and texts), ``apps``, ``eval``, ``bench``, ``sim``, ``hw``, ``cli``, ``util`` (docs/architecture.md).
"""

from oakenkv._lazy import exports

__version__ = "0.1.0"

__getattr__, __dir__, _names = exports(
    __name__,
    {
        "OakenCache": "hf.cache",
        "OakenConfig": "format.config",
        "Thresholds": "calibrate.thresholds",
        "load_model": "assets.models",
    },
)
__all__ = ["__version__", *_names]
