"""`OakenConfig`: the method's hyper-parameters, validated and versioned.

The defaults are the paper's (Kim et al., ISCA 2025, Section 4): 4% outer / 90% middle / 6% inner values per
decoder layer, the middle group quantized to 4 bits and the inner and outer groups to 5 bits, per-token min/max
scales stored in fp16, and keys quantized after RoPE (the tensors the cache really stores).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

from oakenkv.util.exact import is_int, is_number, one_of

#: Version of the serialized config; bump when a field changes meaning.
CONFIG_VERSION = 1
#: The most tokens an oaken-plus profile may keep at 16 bits beside their codes (``Transforms.sink_tokens``; a
#: sink is a few tokens, not a window).
MAX_SINK_TOKENS = 64


def valid_sink_tokens(n: Any) -> bool:
    """Whether ``n`` is a sink-token count: an int (not a bool) in ``[0, MAX_SINK_TOKENS]``."""
    return isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= MAX_SINK_TOKENS


#: The keys of a serialized config, in the order files have always had them.
_V1_KEYS = (
    "outer_ratio",
    "inner_ratio",
    "middle_bits",
    "inner_bits",
    "outer_bits",
    "granularity",
    "key_position",
    "scale_dtype",
    "chunk_size",
)

#: Two format constants that version-1 files record next to the knobs (``oakenkv.format.layout.MIDDLE_BITS`` and
#: ``CHUNK_SIZE``; ``oakenkv.format.layout`` asserts they agree). They are not knobs: :meth:`OakenConfig.to_dict` still
#: writes them, so files and the cache keys derived from them stay as they were, and :meth:`OakenConfig.from_dict`
#: accepts them with these values only.
V1_FIXED_FIELDS = {"middle_bits": 4, "chunk_size": 64}

Granularity = Literal["token", "head"]
KeyPosition = Literal["post_rope", "pre_rope"]
ScaleDtype = Literal["float16", "float32"]


@dataclass(frozen=True)
class OakenConfig:
    """Hyper-parameters of Oaken quantization.

    The three group ratios are fractions of all values of one layer's keys (or values): ``outer_ratio`` of the
    values with the largest magnitude on either side (split evenly between the top and the bottom tail),
    ``inner_ratio`` of the values nearest the centre, and the middle group takes the rest.
    """

    #: Fraction of values in the outer (large-magnitude) group, both tails together. Paper: 0.04.
    outer_ratio: float = 0.04
    #: Fraction of values in the inner (near-zero) group. Paper: 0.06.
    inner_ratio: float = 0.06
    #: Bits per code of the inner group (4 in the dense slot + 1 in the COO entry). Paper: 5.
    inner_bits: int = 5
    #: Bits per code of the outer group (4 in the dense slot + 1 in the COO entry). Paper: 5.
    outer_bits: int = 5
    #: "token": one min/max set per token over all KV heads of a layer (the paper); "head": one per token and head.
    granularity: Granularity = "token"
    #: Where keys are quantized: after RoPE (what the cache stores; default) or before (the official harness).
    key_position: KeyPosition = "post_rope"
    #: Storage dtype of the six per-token min/max values.
    scale_dtype: ScaleDtype = "float16"

    def __post_init__(self) -> None:
        for name in ("outer_ratio", "inner_ratio"):
            r = getattr(self, name)
            if not is_number(r) or not math.isfinite(r) or not 0.0 <= r < 1.0:
                raise ValueError(f"OakenConfig.{name} must be a finite fraction in [0, 1), got {r!r}")
        if self.outer_ratio + self.inner_ratio >= 1.0:
            raise ValueError(
                f"outer_ratio + inner_ratio must leave a middle group, got {self.outer_ratio} + {self.inner_ratio}"
            )
        for name in ("inner_bits", "outer_bits"):
            b = getattr(self, name)
            if not is_int(b) or b not in (4, 5):  # (5.0 or True would pass `in` and fail inside numba's typing)
                raise ValueError(f"OakenConfig.{name} must be 4 or 5 (4-bit dense slot + optional COO bit), got {b!r}")
        if self.granularity not in ("token", "head"):
            raise ValueError(f"granularity must be 'token' or 'head', got {self.granularity!r}")
        if self.key_position not in ("post_rope", "pre_rope"):
            raise ValueError(f"key_position must be 'post_rope' or 'pre_rope', got {self.key_position!r}")
        if self.scale_dtype not in ("float16", "float32"):
            raise ValueError(f"scale_dtype must be 'float16' or 'float32', got {self.scale_dtype!r}")

    @property
    def scale_itemsize(self) -> int:
        """Bytes per stored scale: 2 (float16) or 4 (float32)."""
        return 2 if self.scale_dtype == "float16" else 4

    @property
    def scale_bits(self) -> int:
        """Bits per stored scale."""
        return 8 * self.scale_itemsize

    @property
    def scale_np_dtype(self) -> Any:
        """The scales' numpy dtype (numpy is imported on first use; the config itself needs neither it nor torch)."""
        import numpy as np

        return np.dtype(self.scale_dtype)

    @property
    def scale_torch_dtype(self) -> Any:
        """The scales' torch dtype (torch is imported on first use)."""
        import torch

        return getattr(torch, self.scale_dtype)

    @property
    def middle_ratio(self) -> float:
        """Fraction of values in the middle group."""
        return 1.0 - self.outer_ratio - self.inner_ratio

    @property
    def outlier_ratio(self) -> float:
        """Fraction of values that get a sparse COO entry (inner + outer)."""
        return self.outer_ratio + self.inner_ratio

    def replace(self, **changes: Any) -> OakenConfig:
        """A copy with some fields changed (validated again)."""
        return OakenConfig(**{**asdict(self), **changes})

    def to_dict(self) -> dict[str, Any]:
        d = {**asdict(self), **V1_FIXED_FIELDS}
        return {"version": CONFIG_VERSION, **{k: d[k] for k in _V1_KEYS}}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> OakenConfig:
        """From :meth:`to_dict`'s form, with exact types (``true`` or ``1.0`` is not the version ``1``)."""
        if not isinstance(d, dict):
            raise ValueError(f"an OakenConfig must be an object, got {type(d).__name__}")
        d = dict(d)
        version = d.pop("version", CONFIG_VERSION)
        if not one_of(version, (CONFIG_VERSION,)):
            raise ValueError(f"unsupported OakenConfig version {version!r} (this oakenkv reads {CONFIG_VERSION})")
        for name, fixed in V1_FIXED_FIELDS.items():
            value = d.pop(name, fixed)
            if not one_of(value, (fixed,)):
                raise ValueError(
                    f"{name} must be {fixed} (a constant of the format, oakenkv.format.layout), got {value!r}"
                )
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown OakenConfig fields: {sorted(unknown)}")
        return cls(**d)


assert {f.name for f in fields(OakenConfig)} | set(V1_FIXED_FIELDS) == set(_V1_KEYS)
