"""The plugin's one door into oakenkv: every oakenkv name the vLLM integration uses is imported here.

Keep it that way: the rest of ``oakenkv.integrations.vllm`` imports oakenkv only through this module (one
exception: the package's ``load_profile`` imports ``oakenkv.calibrate.thresholds`` itself, to load a profile at
registration without importing numba; it says why), so moving oakenkv's internals changes this file alone. What is
used, and why:

- the profile: :class:`~oakenkv.calibrate.thresholds.Thresholds` and its
  :class:`~oakenkv.format.config.OakenConfig` (group bits, ratios, scale dtype); an oaken-plus profile's
  :class:`~oakenkv.calibrate.transforms.Transforms` (the online key shift and rotation, ``fwht`` for the queries,
  the sink tokens) and, for ``oakenkv export``, ``find_profile`` / ``apply_profile`` (made and folded as
  ``OakenCache.for_model`` does), the fold mark ``FOLD_MARK`` and, to write an export in the checkpoint's dtype,
  ``cast_folded`` (which keeps a folded model's fold record true);
- the format (``oakenkv.format.layout``): :func:`record_size` / :func:`scale_bytes` (dense record = scales + nibbles),
  :func:`sparse_capacity` (longest COO record of a row), :func:`from_records` (records -> ``EncodedBatch``),
  ``CorruptDataError``, ``ERROR_MESSAGES`` and :class:`LayerView`, the fields a decode kernel reads;
- the store's one record writer (``oakenkv.store.records.put_record``: a token's dense record and COO bytes to
  their addresses, the pool's writer too) and its one view builder (``oakenkv.store.view.LayerTables``, filled from
  vLLM's block tables);
- the encoder that writes page records (:func:`encode_records`, a serial numba call: the decode step's path of
  ``OakenCache``), the codec's decoder (:func:`decode`, the public API), the row transform ``shift_rotate_rows``
  and the fp16 rounding of the sink tokens (``f32_to_f16_bits``), all bit-exact with the reference;
- the packed-page decode-attention kernels (``packed_decode_attention``, its serial twin, its row-range twin for
  the plugin's own threads, ``merge_sinks`` for the 16-bit sink tokens), run unchanged on vLLM's blocks, their rule
  for splitting rows over threads (``split_work``), and their block decoder (``decode_rows``, ``sparse_start``) for
  prefill tiles.

- for the device path (``device.py``, the CUDA backend ``cuda.py``), the Triton kernels (:func:`triton_kernels`:
  the encoder into page records and ``copy_spans``, the key transform, decode and prefill attention over
  ``DeviceLayerView`` s, the sink tokens' part and ``merge_lse``, the interpreter's launch options), imported on first
  use so that the CPU plugin never imports triton.

Importing this module compiles nothing; numba compiles (or loads from its cache) on the first call, which the
backend makes while the engine starts (``backend.warm_up``).
"""

from __future__ import annotations

from types import SimpleNamespace

from oakenkv.calibrate.match import cast_folded
from oakenkv.calibrate.plus import apply_profile
from oakenkv.calibrate.presets import PRESETS, find_profile
from oakenkv.calibrate.thresholds import Thresholds
from oakenkv.calibrate.transforms import FOLD_MARK, Transforms, fwht
from oakenkv.format.config import OakenConfig
from oakenkv.format.layout import (
    ERROR_MESSAGES,
    NO_STATIC_GRID,
    CorruptDataError,
    EncodedBatch,
    LayerView,
    from_records,
    record_size,
    scale_bytes,
    sparse_capacity,
)
from oakenkv.kernels.codec import decode
from oakenkv.kernels.cpu.attention import _decode_rows as decode_rows
from oakenkv.kernels.cpu.attention import _sparse_start as sparse_start
from oakenkv.kernels.cpu.attention import (
    merge_sinks,
    packed_decode_attention,
    packed_decode_attention_rows,
    packed_decode_attention_serial,
    split_work,
)
from oakenkv.kernels.cpu.codec import encode_records, static_grid_array
from oakenkv.kernels.cpu.helpers import f16_widen, f32_to_f16_bits
from oakenkv.kernels.cpu.rotate import shift_rotate_rows
from oakenkv.kernels.triton.interpret import interpreting
from oakenkv.store.records import put_record
from oakenkv.store.view import LayerTables, grown


def triton_kernels() -> SimpleNamespace:
    """The Triton kernels the device path uses (module docstring), imported now: ``encode``, ``rotate``,
    ``attention``, ``prefill``, ``view`` (``DeviceLayerView``) and ``interpret`` (``store_blocks``: launch options
    under the interpreter)."""
    from oakenkv.kernels.triton import attention, encode, interpret, prefill, rotate, view

    return SimpleNamespace(
        attention=attention, encode=encode, interpret=interpret, prefill=prefill, rotate=rotate, view=view
    )


__all__ = [
    "ERROR_MESSAGES",
    "FOLD_MARK",
    "NO_STATIC_GRID",
    "PRESETS",
    "CorruptDataError",
    "EncodedBatch",
    "LayerTables",
    "LayerView",
    "OakenConfig",
    "Thresholds",
    "Transforms",
    "apply_profile",
    "cast_folded",
    "decode",
    "decode_rows",
    "encode_records",
    "f16_widen",
    "f32_to_f16_bits",
    "find_profile",
    "from_records",
    "fwht",
    "grown",
    "interpreting",
    "merge_sinks",
    "packed_decode_attention",
    "packed_decode_attention_rows",
    "packed_decode_attention_serial",
    "put_record",
    "record_size",
    "scale_bytes",
    "shift_rotate_rows",
    "sparse_capacity",
    "sparse_start",
    "split_work",
    "static_grid_array",
    "triton_kernels",
]
