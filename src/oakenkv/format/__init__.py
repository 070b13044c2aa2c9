"""The bytes: the method's parameters and the row and page-record layout, defined once.

- ``config``: :class:`OakenConfig` (group ratios, bits per group, granularity, key position, scale dtype).
- ``layout``: the row format and the page-record format with their diagrams, constants and size asserts,
  :class:`EncodedBatch`, :func:`check_encoded`, the error codes, :class:`LayerView` (what a decode kernel reads).

Every other room reads these facts from here (``tests/test_architecture.py`` checks they are defined nowhere else).
"""

from oakenkv._lazy import exports

__getattr__, __dir__, __all__ = exports(
    __name__,
    {
        "OakenConfig": "format.config",
        "CorruptDataError": "format.layout",
        "EncodedBatch": "format.layout",
        "LayerView": "format.layout",
        "check_encoded": "format.layout",
        "format_bits": "format.layout",
        "record_size": "format.layout",
    },
)
