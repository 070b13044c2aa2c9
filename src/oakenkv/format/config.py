"""`OakenConfig`: the method's hyper-parameters, validated and versioned.

The defaults are the paper's (Kim et al., ISCA 2025, Section 4): 4% outer / 90% middle / 6% inner values per
decoder layer, the middle group quantized to 4 bits and the inner and outer groups to 5 bits, per-token min/max
scales stored in fp16, and keys quantized after RoPE (the tensors the cache really stores).

``middle_bits`` is the width of the format's dense slot (one per value, ``oakenkv.format.layout``): 4 is the paper's
format; 2..3 and 5..7 are narrower and wider ones on the same structure (``oaken-plus-3``, ``oaken-plus-5``, ...),
whose inner and outer codes have ``middle_bits + 1`` bits (the slot plus the COO entry's code bit) by default.

``static_grids`` (issue #36) fixes the middle and inner groups' grids per layer, from its thresholds
(``oakenkv.quant.quantizer.static_grid``), instead of each row's min/max: a row then stores only the outer group's
two end points (``oakenkv.format.layout``: 2 scales instead of 6). ``static_levels`` (with static grids) gives each
layer a few static grids instead of one (clip factors of the clip-1 grid): each row takes the smallest that covers its
middle values and stores its index in one byte (``oakenkv.format.layout``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

from oakenkv.util.exact import is_int, is_number, one_of

#: Version of the serialized config; bump when a field changes meaning. Version 2 made ``middle_bits`` (the dense
#: slot width) a knob; version 3 added ``static_grids``, version 4 ``static_levels``. A config is written in the
#: oldest version that can express it (version 1 for a 4-bit slot, 2 for another width, 3 only with static grids on,
#: 4 only with static levels), so that the files and the cache keys derived from them stay byte for byte what they
#: were, and older readers still read them.
CONFIG_VERSION = 4
#: Dense slot widths (``middle_bits``) the format and every CPU path support. An outlier's code (``middle_bits + 1``
#: bits) fits a byte up to 7 (the codes are uint8 in the reference and the kernels); an 8-bit slot would take 9.
MIDDLE_BITS_CHOICES = (2, 3, 4, 5, 6, 7)
#: The static levels of the method spec's ``levels=1`` (``oakenkv.methods.registry``): clip factors of the layer's
#: clip-1 static grid, the four the static-grid simulation measured (``benchmarks/static_scales.py --levels``).
DEFAULT_STATIC_LEVELS = (0.5, 0.7, 0.85, 1.0)
#: How many static levels a config may have: at least two (one is plain ``static_grids``), at most 16 (a row's
#: level index is one byte; 16 keeps it a nibble's worth should a later layout pack it).
MIN_STATIC_LEVELS, MAX_STATIC_LEVELS = 2, 16
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

#: Two format constants that version-1 files record next to the knobs (``oakenkv.format.layout.MIDDLE_BITS``, the
#: paper's slot width, and ``CHUNK_SIZE``; ``oakenkv.format.layout`` asserts they agree). In version 1 neither is a
#: knob: :meth:`OakenConfig.to_dict` writes them, so files and the cache keys derived from them stay as they were,
#: and :meth:`OakenConfig.from_dict` accepts them with these values only. Version 2 makes ``middle_bits`` a knob.
V1_FIXED_FIELDS = {"middle_bits": 4, "chunk_size": 64}
#: The format constant every version fixes.
FIXED_FIELDS = {"chunk_size": 64}

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
    #: Bits per code of the inner group: ``middle_bits`` in the dense slot (+ 1 in the COO entry). Paper: 5. Default
    #: (None): ``middle_bits + 1``.
    inner_bits: int = None  # type: ignore[assignment]
    #: Bits per code of the outer group, as ``inner_bits``. Paper: 5.
    outer_bits: int = None  # type: ignore[assignment]
    #: "token": one min/max set per token over all KV heads of a layer (the paper); "head": one per token and head.
    granularity: Granularity = "token"
    #: Where keys are quantized: after RoPE (what the cache stores; default) or before (the official harness).
    key_position: KeyPosition = "post_rope"
    #: Storage dtype of the per-token min/max values (six, or two with ``static_grids``).
    scale_dtype: ScaleDtype = "float16"
    #: Width of the dense slot, one per value, and so the bits of a middle-group code (2..7). Paper: 4.
    middle_bits: int = 4
    #: The middle and inner groups' grids fixed per layer by its thresholds (``quant.quantizer.static_grid``, clip
    #: 1: every middle value covered) instead of per row: the format then stores only the outer group's two
    #: scales per row (issue #36). Off: the paper's six per-row scales.
    static_grids: bool = False
    #: Static levels (only with ``static_grids``): ascending clip factors in (0, 1], the last exactly 1.0, 2 to 16 of
    #: them (:data:`DEFAULT_STATIC_LEVELS`). Each is a static middle grid of the layer (``quant.quantizer.static_grid``
    #: with that clip); each row takes the smallest covering its middle values and stores its index (one byte). Empty
    #: (the default): the one clip-1 static grid.
    static_levels: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        mb = self.middle_bits
        if not is_int(mb) or mb not in MIDDLE_BITS_CHOICES:
            raise ValueError(
                f"OakenConfig.middle_bits (the dense slot width) must be one of {MIDDLE_BITS_CHOICES}, got {mb!r}"
            )
        for name in ("inner_bits", "outer_bits"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, mb + 1)
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
            if not is_int(b) or b not in (mb, mb + 1):  # (5.0 or True would pass `in` and fail in numba's typing)
                raise ValueError(
                    f"OakenConfig.{name} must be {mb} or {mb + 1} ({mb}-bit dense slot + optional COO bit), got {b!r}"
                )
        if self.granularity not in ("token", "head"):
            raise ValueError(f"granularity must be 'token' or 'head', got {self.granularity!r}")
        if self.key_position not in ("post_rope", "pre_rope"):
            raise ValueError(f"key_position must be 'post_rope' or 'pre_rope', got {self.key_position!r}")
        if self.scale_dtype not in ("float16", "float32"):
            raise ValueError(f"scale_dtype must be 'float16' or 'float32', got {self.scale_dtype!r}")
        if not isinstance(self.static_grids, bool):
            raise ValueError(f"OakenConfig.static_grids must be True or False, got {self.static_grids!r}")
        object.__setattr__(self, "static_levels", _check_levels(self.static_levels, self.static_grids))

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
        """A copy with some fields changed (validated again). A new ``middle_bits`` carries the group widths along
        (outliers one bit wider than the slot stay one bit wider) unless ``inner_bits``/``outer_bits`` are given."""
        mb = changes.get("middle_bits", self.middle_bits)
        if is_int(mb) and mb != self.middle_bits:
            for name in ("inner_bits", "outer_bits"):
                changes.setdefault(name, mb + (getattr(self, name) - self.middle_bits))
        return OakenConfig(**{**asdict(self), **changes})

    def to_dict(self) -> dict[str, Any]:
        """The serialized form: version 1 (exactly the keys and values files have always had) when the slot is the
        paper's 4 bits, else version 2 (the same keys, ``middle_bits`` holding the slot width); with static grids
        on, version 3 (version 2's keys, then ``static_grids``); with static levels, version 4 (version 3's keys,
        then ``static_levels``, a list)."""
        d = {**asdict(self), **FIXED_FIELDS}
        if self.static_levels:
            keys = {k: d[k] for k in _V1_KEYS}
            return {"version": 4, **keys, "static_grids": True, "static_levels": list(self.static_levels)}
        if self.static_grids:
            return {"version": 3, **{k: d[k] for k in _V1_KEYS}, "static_grids": True}
        version = 1 if self.middle_bits == V1_FIXED_FIELDS["middle_bits"] else 2
        return {"version": version, **{k: d[k] for k in _V1_KEYS}}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> OakenConfig:
        """From :meth:`to_dict`'s form, with exact types (``true`` or ``1.0`` is not the version ``1``)."""
        if not isinstance(d, dict):
            raise ValueError(f"an OakenConfig must be an object, got {type(d).__name__}")
        d = dict(d)
        version = d.pop("version", 1)
        if not one_of(version, (1, 2, 3, 4)):
            raise ValueError(f"unsupported OakenConfig version {version!r} (this oakenkv reads 1 to {CONFIG_VERSION})")
        for name, fixed in (V1_FIXED_FIELDS if version == 1 else FIXED_FIELDS).items():
            value = d.pop(name, fixed)
            if not one_of(value, (fixed,)):
                raise ValueError(
                    f"{name} must be {fixed} in a version-{version} config (a constant of the format, "
                    f"oakenkv.format.layout), got {value!r}"
                )
        if version == 1:
            d["middle_bits"] = V1_FIXED_FIELDS["middle_bits"]
        elif "middle_bits" not in d:
            raise ValueError(f"a version-{version} OakenConfig must give middle_bits (the dense slot width)")
        if version < 4 and "static_levels" in d:
            raise ValueError(f"static_levels needs a version-4 OakenConfig, got it in version {version}")
        if version < 3 and "static_grids" in d:
            raise ValueError(f"static_grids needs a version-3 OakenConfig, got it in version {version}")
        if version >= 3 and "static_grids" not in d:
            raise ValueError(f"a version-{version} OakenConfig must give static_grids")
        if version == 4:
            if "static_levels" not in d:
                raise ValueError("a version-4 OakenConfig must give static_levels")
            if not isinstance(d["static_levels"], list):
                raise ValueError(f"static_levels must be a list of numbers, got {d['static_levels']!r}")
            d["static_levels"] = tuple(d["static_levels"])
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown OakenConfig fields: {sorted(unknown)}")
        return cls(**d)


def _check_levels(levels: Any, static_grids: bool) -> tuple[float, ...]:
    """``OakenConfig.static_levels`` validated, as a tuple of floats; ValueError naming what is wrong."""
    name = "OakenConfig.static_levels"
    if not isinstance(levels, (tuple, list)):
        raise ValueError(f"{name} must be a tuple of clip factors, got {levels!r}")
    if not levels:
        return ()
    if not static_grids:
        raise ValueError(f"{name} needs static_grids=True (they are sizes of the static grid), got {tuple(levels)}")
    if not MIN_STATIC_LEVELS <= len(levels) <= MAX_STATIC_LEVELS:
        raise ValueError(f"{name} takes {MIN_STATIC_LEVELS} to {MAX_STATIC_LEVELS} clip factors, got {len(levels)}")
    if not all(is_number(v) and math.isfinite(v) and 0.0 < v <= 1.0 for v in levels):
        raise ValueError(f"{name} must be numbers in (0, 1], got {tuple(levels)}")
    out = tuple(float(v) for v in levels)
    import numpy as np  # (on first use, as scale_np_dtype: the kernels compare in float32)

    f32 = np.asarray(out, dtype=np.float32)
    if not bool((np.diff(f32) > 0).all()) or out[-1] != 1.0:
        raise ValueError(f"{name} must ascend strictly (in float32) and end with exactly 1.0, got {out}")
    return out


assert {f.name for f in fields(OakenConfig)} | set(V1_FIXED_FIELDS) == {*_V1_KEYS, "static_grids", "static_levels"}
assert CONFIG_VERSION == 4
assert V1_FIXED_FIELDS["middle_bits"] == OakenConfig().middle_bits
