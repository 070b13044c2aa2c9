"""KIVI (Liu et al., ICML 2024): keys per channel in token groups, values per token, fp16 residual window.

What the KIVI reference implementation (``KIVI/models/llama_kivi.py``) stores, reproduced as a transformers
cache layer so that it applies both to a whole prefill and token by token:

- Keys are quantized **per channel**: one min/max per (head, channel) over a group of ``group`` consecutive
  tokens. Since a group needs its tokens first, keys stay in fp16 in a residual buffer until ``residual``
  tokens have accumulated (``residual`` is a multiple of ``group``); then the whole buffer is quantized in
  ``residual / group`` token groups. After a prefill of S tokens, the first ``S - S % residual`` keys are
  quantized and the last ``S % residual`` stay fp16 (as KIVI's prefill does).
- Values are quantized **per token** (one min/max per ``group`` consecutive channels of a head vector); the
  latest ``residual`` values stay fp16 and the oldest one is quantized whenever the buffer overflows.
- KIVI-4 uses 4 bits, ``group`` 32, ``residual`` 128.

What the attention reads is the dequantized quantized part followed by the fp16 residual, for prefill too.
Stored bits: ``bits + 32 / group`` per quantized value (fp16 min and max per group), 16 per residual value.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

from oakenkv.methods.base import FP16_BITS, check_kv
from oakenkv.methods.uniform import GROUP_SCALE_BITS, grouped_fake_quant, minmax_fake_quant


def kivi_quantize_keys(k: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Per-channel fake quantization of keys over groups of ``group`` consecutive tokens.

    Args:
        k: ``[B, H, S, D]`` keys with ``S % group == 0``.

    Returns:
        ``[B, H, S, D]``, each (head, channel, token group) on its own ``bits``-bit min/max grid.
    """
    b, h, s, d = k.shape
    if s % group:
        raise ValueError(f"KIVI key groups need a multiple of {group} tokens, got {s}")
    g = k.reshape(b, h, s // group, group, d)
    return minmax_fake_quant(g, bits, dim=3).reshape(b, h, s, d)


def kivi_quantize_values(v: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Per-token fake quantization of values over groups of ``min(group, D)`` consecutive channels.

    Args:
        v: ``[B, H, S, D]`` values.
    """
    return grouped_fake_quant(v, bits, min(group, v.shape[-1]))


class KiviLayer(DynamicLayer):
    """A ``DynamicLayer`` that stores KIVI's quantized keys/values plus its fp16 residual window.

    ``self.keys`` / ``self.values`` ``[B, H, S, D]`` hold what the attention reads: the dequantized quantized
    tokens ``[:n_quant]`` followed by the fp16 residual ``[n_quant:]`` (counted separately for keys and values).
    """

    is_croppable = False

    def __init__(self, bits: int = 4, group: int = 32, residual: int = 128) -> None:
        super().__init__()
        if not 2 <= bits <= 8:
            raise ValueError(f"bits must be in 2..8, got {bits}")
        if group <= 0 or residual <= 0 or residual % group:
            raise ValueError(f"residual ({residual}) must be a positive multiple of group ({group})")
        self.bits, self.group, self.residual = bits, group, residual
        self.n_quant_keys = 0
        self.n_quant_values = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        check_kv(key_states, "key_states")
        check_kv(value_states, "value_states")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys = torch.cat([self.keys, key_states], dim=-2)
        values = torch.cat([self.values, value_states], dim=-2)
        total = keys.shape[-2]

        # Keys: flush whole multiples of `residual` tokens of the fp16 buffer into token groups.
        flush = ((total - self.n_quant_keys) // self.residual) * self.residual
        if flush:
            a, b = self.n_quant_keys, self.n_quant_keys + flush
            keys[..., a:b, :] = kivi_quantize_keys(keys[..., a:b, :], self.bits, self.group)
            self.n_quant_keys = b
        # Values: keep exactly the latest `residual` tokens in fp16.
        flush = max(0, total - self.n_quant_values - self.residual)
        if flush:
            a, b = self.n_quant_values, self.n_quant_values + flush
            values[..., a:b, :] = kivi_quantize_values(values[..., a:b, :], self.bits, self.group)
            self.n_quant_values = b

        self.keys, self.values = keys, values
        return keys, values

    def reset(self) -> None:
        super().reset()
        self.n_quant_keys = self.n_quant_values = 0

    def stored_bits(self) -> tuple[float, int]:
        """``(bits, values)`` the layer stores now, keys and values together."""
        if not self.is_initialized or self.keys.numel() == 0:
            return 0.0, 0
        b, h, s, d = self.keys.shape
        per_token = b * h * d
        gv = min(self.group, d)
        q_bits = self.bits + GROUP_SCALE_BITS / self.group  # keys: one group = `group` tokens of one channel
        qv_bits = self.bits + GROUP_SCALE_BITS / gv
        bits = per_token * (
            self.n_quant_keys * q_bits
            + (s - self.n_quant_keys) * FP16_BITS
            + self.n_quant_values * qv_bits
            + (s - self.n_quant_values) * FP16_BITS
        )
        return bits, 2 * per_token * s
