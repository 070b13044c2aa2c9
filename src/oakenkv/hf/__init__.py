"""The transformers adapter: Oaken inside ``model.generate``.

- ``cache``: :class:`OakenCache` / :class:`OakenLayer`, transformers ``Cache`` types over a paged store
  (``OakenCache.for_model``: the two-line way in).
- ``attention``: the ``"oaken"`` attention function (decode reads the packed pages; SDPA otherwise),
  :func:`enable_oaken_attention`, :func:`oaken_attention`.
"""

from oakenkv._lazy import exports

__getattr__, __dir__, __all__ = exports(
    __name__,
    {
        "OakenCache": "hf.cache",
        "OakenLayer": "hf.cache",
        "kv_bytes": "hf.cache",
        "enable_oaken_attention": "hf.attention",
        "oaken_attention": "hf.attention",
    },
)
