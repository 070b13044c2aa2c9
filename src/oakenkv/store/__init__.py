"""Storage: every layer's keys and values of a batch in one page pool, in the Oaken format.

- ``pages``: :class:`PagePool`, the software MMU (dense and sparse pages per sequence and stream, tables,
  ask-then-commit allocation, copy on write, eviction, fork); knows nothing of quantization (docs/pages.md).
- ``paged``: :class:`PagedKVStore`, the codec and thresholds over the pool, sink tokens, the optional
  full-precision window, and the per-layer tables a decode kernel reads (``layer_view``).
- ``records``: the one writer of page records (a token's dense record and COO bytes to their addresses), called by
  the pool and by the vLLM plugin's blocks.
- ``view``: :class:`LayerTables`, the one builder of a layer's ``LayerView`` (filled from the pool's tables or from
  vLLM's block tables).
"""

from oakenkv._lazy import exports

__getattr__, __dir__, __all__ = exports(
    __name__,
    {
        "PagePool": "store.pages",
        "PoolConfig": "store.pages",
        "PoolExhaustedError": "store.pages",
        "PoolStats": "store.pages",
        "PagedKVStore": "store.paged",
    },
)
