"""The plugin's one door into oakenkv: every oakenkv name the vLLM integration uses is imported here.

Keep it that way: the rest of ``oakenkv.integrations.vllm`` imports oakenkv only through this module (one
exception: the package's ``load_profile`` imports ``oakenkv.calibrate.thresholds`` itself, to load a profile at
registration
without importing numba; it says why), so moving oakenkv's internals changes this file alone. What is used, and why:

- the profile: :class:`~oakenkv.calibrate.thresholds.Thresholds` (loaded from the file named by the plugin's config) and
its
  :class:`~oakenkv.format.config.OakenConfig` (group bits, ratios, scale dtype);
- the format (``oakenkv.format.layout``): :func:`record_size` / :func:`scale_bytes` (dense record = scales + nibbles),
  :func:`sparse_capacity` (longest COO record of a row), :func:`from_records` (records -> ``EncodedBatch``),
  ``CorruptDataError``, ``ERROR_MESSAGES`` and :class:`LayerView`, the fields a decode kernel reads (the plugin
  builds one per layer and step over vLLM's blocks);
- the encoder that writes page records (:func:`encode_records`, a serial numba call: the decode step's path of
  ``OakenCache``) and the codec's decoder (:func:`decode`, the public API), both bit-exact with the reference;
- the packed-page decode-attention kernel (``packed_decode_attention`` and its serial twin), run unchanged on
  vLLM's blocks, and its rule for splitting rows over threads (``split_work``).

Importing this module compiles nothing; numba compiles (or loads from its cache) on the first call.
"""

from __future__ import annotations

from oakenkv.calibrate.thresholds import Thresholds
from oakenkv.format.config import OakenConfig
from oakenkv.format.layout import (
    ERROR_MESSAGES,
    CorruptDataError,
    EncodedBatch,
    LayerView,
    from_records,
    record_size,
    scale_bytes,
    sparse_capacity,
)
from oakenkv.kernels.codec import decode
from oakenkv.kernels.cpu.attention import (
    packed_decode_attention,
    packed_decode_attention_serial,
    split_work,
)
from oakenkv.kernels.cpu.codec import encode_records

__all__ = [
    "ERROR_MESSAGES",
    "CorruptDataError",
    "EncodedBatch",
    "LayerView",
    "OakenConfig",
    "Thresholds",
    "decode",
    "encode_records",
    "from_records",
    "packed_decode_attention",
    "packed_decode_attention_serial",
    "record_size",
    "scale_bytes",
    "sparse_capacity",
    "split_work",
]
