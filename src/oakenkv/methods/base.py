"""The interface every fake-quantizing KV method implements, and how stored bits are counted.

A :class:`KVFakeQuantizer` is stateless per call: it receives the keys (or values) of some new tokens of one
layer, ``[B, H, S, D]`` (batch, KV heads, tokens, head dim), and returns what the attention would read back
from the method's stored cache (same shape and dtype) together with the number of bits the method stores for
them. Methods that keep state across calls (KIVI's residual window) are cache layers instead
(:mod:`oakenkv.methods.kivi`).

Bit accounting, the same for every method: codes + scales / zero points + outlier entries (value and index)
+ per-vector headers, divided by the number of stored values; an unquantized value costs 16 bits (fp16, the
serving dtype, even though the CPU evaluation runs in float32). Constants calibrated once per layer (KVQuant's
per-channel key ranges, the official Oaken harness's global min/max, a per-tensor FP8 scale) cost nothing
per value.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal

import torch

Kind = Literal["key", "value"]
KeyPosition = Literal["post_rope", "pre_rope"]

#: Bits of one unquantized (fp16) value, and of one fp16 scale, zero point or outlier value.
FP16_BITS = 16


def check_kv(x: torch.Tensor, what: str = "x") -> None:
    """Validate a ``[B, H, S, D]`` floating tensor of finite values (clear error instead of silent NaNs)."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"{what} must be a floating torch.Tensor, got {type(x).__name__}")
    if x.dim() != 4:
        raise ValueError(f"{what} must have shape [batch, kv_heads, tokens, head_dim], got {tuple(x.shape)}")
    if not torch.isfinite(x).all():
        raise ValueError(f"{what} contains NaN or Inf")


@dataclass
class BitCounter:
    """Running total of stored bits and stored values (one per K or V element)."""

    bits: float = 0.0
    values: int = 0

    def add(self, bits: float, values: int) -> None:
        self.bits += float(bits)
        self.values += int(values)

    def merge(self, other: BitCounter) -> None:
        self.add(other.bits, other.values)

    @property
    def effective_bits(self) -> float:
        """Stored bits per value; NaN before anything was stored."""
        return self.bits / self.values if self.values else float("nan")


class KVFakeQuantizer(ABC):
    """Quantize-dequantize the keys and values of a model's cache, layer by layer, counting stored bits."""

    #: Where keys are quantized: "post_rope" (what a KV cache stores) or "pre_rope" (KVQuant; the cache
    #: un-rotates, quantizes and re-rotates; see :mod:`oakenkv.calibrate.rope`).
    key_position: KeyPosition = "post_rope"
    #: The first tokens of a sequence the method keeps at 16 bits beside its codes (oaken-plus), read back
    #: through :meth:`sink`; 0 for every other method.
    sink_tokens: int = 0

    def for_sequence(self) -> KVFakeQuantizer:
        """The quantizer a new cache (one sequence, or one batch of them) runs: ``self`` for a stateless method; a
        fresh copy with its own state for one that adapts to what it has seen (Oaken's adaptive grouping)."""
        return self

    def sink(self, layer_idx: int, kind: Kind, x: torch.Tensor) -> torch.Tensor:
        """The first ``sink_tokens`` tokens ``x`` as the attention reads them (only where ``sink_tokens > 0``)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no sink tokens")

    def unquantized(self, layer_idx: int, kind: Kind, x: torch.Tensor) -> torch.Tensor:
        """Tokens ``x`` the cache holds unquantized (a full-precision window) as the attention reads them, in the
        frame of the method's dequantized ones: ``x`` itself, unless the method shifts what it returns (oaken-plus:
        softmax ignores a shift common to all keys, not one that only some of them carry)."""
        return x

    @abstractmethod
    def quantize(self, layer_idx: int, kind: Kind, x: torch.Tensor) -> tuple[torch.Tensor, float]:
        """Fake-quantize the new keys or values of one layer.

        Args:
            layer_idx: decoder layer index.
            kind: "key" or "value".
            x: ``[B, H, S, D]`` float tensor: the new tokens' keys (post- or pre-RoPE, see ``key_position``)
                or values.

        Returns:
            ``(x_hat, bits)``: ``x_hat`` has x's shape and dtype (what the attention reads back), ``bits`` is
            the number of bits the method stores for these ``x.numel()`` values.
        """
