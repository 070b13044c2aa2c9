"""Differences between the transformers 5.x versions oakenkv supports (``transformers>=5.0,<6``).

The keyword that hands a cache object to a model's ``forward`` (and ``generate``) was renamed within 5.x: recent
releases take ``cache=``, earlier ones (up to 5.19, the version vLLM 0.32 pins) ``past_key_values=``. A model
swallows the other keyword in its ``**kwargs`` and silently falls back to its own unquantized cache, so an
evaluation would report full-precision numbers under a quantized method's name. Pass caches with
:func:`cache_kwargs`.
"""

from __future__ import annotations

import inspect
from typing import Any


def cache_keyword(model: Any) -> str:
    """``"cache"`` or ``"past_key_values"``: the keyword ``model.forward`` takes its cache object by."""
    params = inspect.signature(model.forward).parameters
    if "cache" in params:
        return "cache"
    if "past_key_values" in params:
        return "past_key_values"
    raise TypeError(f"{type(model).__name__}.forward takes neither 'cache' nor 'past_key_values'")


def cache_kwargs(model: Any, cache: Any) -> dict[str, Any]:
    """``{keyword: cache}`` for ``model(...)`` / ``model.generate(...)`` in this transformers version."""
    return {cache_keyword(model): cache}
