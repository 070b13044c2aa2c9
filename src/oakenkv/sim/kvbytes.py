"""KV-cache storage formats as bits per stored value.

Oaken's bits come from the codec's accounting (``oakenkv.kernels.codec``), mirrored here as a small function so that
the simulator stays torch-free: every value has a 4-bit dense slot, every outlier (outer + inner groups, 10%
by default) adds an 8-bit COO entry, and each token's K or V vector of one layer carries 96 bits of group
scales (min and max of three groups, FP16), amortised over the vector width; with static grids
(``OakenConfig.static_grids``, the ``oaken-static`` format) only the outer group's two, 32 bits, and with static
levels (``OakenConfig.static_levels``, ``oaken-levels``) those and the row's level byte, 40 bits. The peers' bits are
the effective bits the paper reports for them (Table 2, Llama2-7B) and are treated as model-independent.
"""

from __future__ import annotations

from dataclasses import dataclass

from oakenkv.sim.shapes import ModelShape

#: Default outlier share (outer 4% + inner 6%), mirrors OakenConfig's default group ratios.
OAKEN_OUTLIER_FRACTION = 0.10
#: Per-token scale bits of one K or V vector: 3 groups x (min, max) x FP16.
OAKEN_SCALE_BITS = 96
#: The same with static middle and inner grids (``OakenConfig.static_grids``): the outer group's min and max alone.
OAKEN_STATIC_SCALE_BITS = 32
#: With static levels (``OakenConfig.static_levels``): the outer scales and the row's 8-bit level index.
OAKEN_LEVELS_SCALE_BITS = 40


def oaken_bits(
    vector_width: int, outlier_fraction: float = OAKEN_OUTLIER_FRACTION, scale_bits: int = OAKEN_SCALE_BITS
) -> float:
    """Effective bits per value of the Oaken fused dense-and-sparse format, as the paper counts it.

    4 (dense nibble) + 8 x outlier share (COO entry) + scale bits / vector width. Llama2-7B (width 4096):
    4.82; Llama2-70B (width 1024, GQA): 4.89 -- the paper's numbers. The codec also stores a 16-bit header per
    row (its sparse length) and the occasional escape entry (docs/format.md: 4.827 at width 4096), which this leaves
    out, as the paper does (0.004 bit at width 4096: under 0.1% of the simulated bytes).
    """
    if vector_width < 1:
        raise ValueError(f"vector_width must be >= 1, got {vector_width}")
    if not 0 <= outlier_fraction <= 1:
        raise ValueError(f"outlier_fraction must be in [0, 1], got {outlier_fraction}")
    return 4 + 8 * outlier_fraction + scale_bits / vector_width


@dataclass(frozen=True)
class KVFormat:
    """A KV storage format. ``bits`` is fixed bits/value, or None when it depends on the model (Oaken: then
    ``scale_bits`` per vector)."""

    name: str
    bits: float | None
    description: str
    scale_bits: int = OAKEN_SCALE_BITS

    def bits_per_value(self, model: ModelShape) -> float:
        return oaken_bits(model.kv_vector_width, scale_bits=self.scale_bits) if self.bits is None else self.bits

    def bytes_per_token(self, model: ModelShape) -> float:
        """Bytes one token adds to the KV cache over all layers (K and V)."""
        return model.kv_values_per_token * self.bits_per_value(model) / 8


KV_FORMATS: dict[str, KVFormat] = {
    f.name: f
    for f in (
        KVFormat("fp16", 16.0, "FP16, no quantization"),
        KVFormat("fp8", 8.0, "FP8 (E4M3/E5M2), per-tensor scale"),
        KVFormat("oaken", None, "Oaken 4/5-bit groups, fused dense-and-sparse (4 + 8 x 0.10 + 96 / width)"),
        KVFormat(
            "oaken-static",
            None,
            "Oaken with static middle/inner grids: outer scales alone per vector (4 + 8 x 0.10 + 32 / width)",
            OAKEN_STATIC_SCALE_BITS,
        ),
        KVFormat(
            "oaken-levels",
            None,
            "Oaken with static levels: outer scales and a level byte per vector (4 + 8 x 0.10 + 40 / width)",
            OAKEN_LEVELS_SCALE_BITS,
        ),
        KVFormat("int4", 4.0, "plain 4-bit, scales ignored (a lower bound for 4-bit formats)"),
        KVFormat("kvquant", 4.82, "KVQuant 4-bit with 1% dense-and-sparse outliers (paper Table 2)"),
        KVFormat("kivi", 4.99, "KIVI 4-bit, per-channel K / per-token V groups (paper Table 2)"),
        KVFormat("qserve", 4.25, "QServe KV4 (paper Table 2)"),
        KVFormat("atom", 4.25, "Atom KV4 (paper Table 2)"),
        KVFormat("tender", 4.07, "Tender KV4 (paper Table 2)"),
    )
}


def get_kv_format(name: str) -> KVFormat:
    key = name.strip().lower()
    if key not in KV_FORMATS:
        raise KeyError(f"unknown KV format {name!r}; known formats: {', '.join(KV_FORMATS)}")
    return KV_FORMATS[key]
