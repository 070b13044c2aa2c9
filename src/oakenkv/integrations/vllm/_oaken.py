"""The plugin's one door into oakenkv: every oakenkv name the vLLM integration uses is imported here.

Keep it that way: the rest of ``oakenkv.integrations.vllm`` imports oakenkv only through this module, so moving
oakenkv's internals (the ``format.py`` / ``store.py`` split) changes this file alone. What is used, and why:

- the profile: :class:`~oakenkv.thresholds.Thresholds` (loaded from the file named by the plugin's config) and its
  :class:`~oakenkv.config.OakenConfig` (group bits, ratios, scale dtype);
- the page-record format: :func:`record_size` / :func:`scale_bytes` (dense record = fp16 scales + nibbles),
  :func:`sparse_capacity` (longest COO record of a row), :func:`from_records` (records -> ``EncodedBatch``),
  ``CorruptDataError`` and the kernels' ``ERROR_MESSAGES``;
- the encoder that writes page records (:func:`encode_records`, a serial numba call: the decode step's path of
  ``OakenCache``) and the codec's decoder (:func:`decode`), both bit-exact with the reference;
- the packed-page decode-attention kernel (``packed_decode_attention`` and its serial twin), run unchanged on
  vLLM's blocks.

Importing this module compiles nothing; numba compiles (or loads from its cache) on the first call.
"""

from __future__ import annotations

from oakenkv.cache import from_records, record_size, scale_bytes
from oakenkv.codec import CorruptDataError, EncodedBatch, decode
from oakenkv.config import OakenConfig
from oakenkv.kernels.attention_cpu import packed_decode_attention, packed_decode_attention_serial
from oakenkv.kernels.cpu import ERROR_MESSAGES, encode_records, sparse_capacity
from oakenkv.thresholds import Thresholds

__all__ = [
    "ERROR_MESSAGES",
    "CorruptDataError",
    "EncodedBatch",
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
]
