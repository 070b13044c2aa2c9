"""Fake quantization through the hardware arithmetic, for perplexity: the engines' cost measured on a real model.

:class:`HwOakenQuantizer` is :class:`oakenkv.methods.registry.OakenQuantizer` with the quantizer (and optionally the
dequantizer) replaced by :mod:`oakenkv.hw.arith`, so :class:`oakenkv.methods.fakequant.FakeQuantCache` runs it exactly
like the float method and the perplexity difference is the cost of hardware arithmetic alone.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from oakenkv.format.config import OakenConfig
from oakenkv.format.layout import format_bits
from oakenkv.methods.base import Kind, KVFakeQuantizer, check_kv

#: "hw": quantization engine + dequantization engine arithmetic; "hw_quant": quantization engine arithmetic,
#: decoded by the float reference decoder (what a software reader of hardware-written pages computes).
HwMode = Literal["hw", "hw_quant"]


class HwOakenQuantizer(KVFakeQuantizer):
    """Oaken with the engines' fixed-point arithmetic (token or head granularity, like ``OakenQuantizer``)."""

    def __init__(self, thresholds: Any, config: OakenConfig, mode: HwMode = "hw") -> None:
        if mode not in ("hw", "hw_quant"):
            raise ValueError(f"mode must be 'hw' or 'hw_quant', got {mode!r}")
        if config.static_grids:
            from oakenkv.hw.arith import STATIC_GRIDS_REFUSED

            raise NotImplementedError(STATIC_GRIDS_REFUSED)
        self.thresholds = thresholds
        self.config = config
        self.mode = mode
        self.key_position = config.key_position

    def quantize(self, layer_idx: int, kind: Kind, x: torch.Tensor) -> tuple[torch.Tensor, float]:
        from oakenkv.hw.arith import dequantize_hw, quantize_hw
        from oakenkv.quant.quantizer import GROUP_MIDDLE, dequantize

        check_kv(x, kind)
        b, h, s, d = x.shape  # x: [B, H, S, D]
        rows = x.permute(0, 2, 1, 3).reshape(b * s, h * d)  # [B*S, H*D]: one token vector per row
        if self.config.granularity == "head":
            rows = rows.reshape(b * s * h, d)
        thr = self.thresholds.layer(layer_idx, kind)
        q = quantize_hw(rows, thr, self.config)
        y = dequantize_hw(q, thr, self.config) if self.mode == "hw" else dequantize(q, thr, self.config)
        n_out = int((q.groups != GROUP_MIDDLE).sum())
        bits = format_bits(rows.shape[0], rows.shape[1], n_out)  # fp16 scales, as the engines write
        y = y.to(x.dtype).reshape(b, s, h, d).permute(0, 2, 1, 3).contiguous()
        return y, bits
