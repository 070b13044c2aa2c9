"""oakenkv: Oaken online-offline hybrid KV-cache quantization (Kim et al., ISCA 2025).

Importing the package is lean: it loads no model, downloads nothing and does not initialise a GPU. Heavy
modules (torch, transformers, numba) are imported by the submodules that need them.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
