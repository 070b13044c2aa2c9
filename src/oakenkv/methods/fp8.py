"""FP8 e4m3 KV cache, as vLLM stores it with ``kv_cache_dtype="fp8"`` (``fp8_e4m3``).

vLLM divides by a per-tensor scale (``k_scale`` / ``v_scale``: 1.0 unless the checkpoint provides calibrated
scales), saturates to the e4m3 range (+-448) and casts; reading multiplies the scale back. 8 bits per value;
the per-layer scale is a constant.
"""

from __future__ import annotations

import torch

from oakenkv.methods.base import Kind, KVFakeQuantizer, check_kv

E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448.0


def fp8_e4m3_fake_quant(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Round ``x / scale`` to float8 e4m3 (saturating at +-448) and scale back; x's shape and dtype."""
    if not scale > 0:
        raise ValueError(f"scale must be positive, got {scale}")
    y = torch.clamp(x.float() / scale, -E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * scale
    return y.to(x.dtype)


class Fp8Quantizer(KVFakeQuantizer):
    """FP8 e4m3 keys (post-RoPE) and values with a fixed per-tensor scale (vLLM's uncalibrated default 1.0)."""

    def __init__(self, scale: float = 1.0) -> None:
        if not scale > 0:
            raise ValueError(f"scale must be positive, got {scale}")
        self.scale = scale

    def quantize(self, layer_idx: int, kind: Kind, x: torch.Tensor) -> tuple[torch.Tensor, float]:
        check_kv(x, kind)
        return fp8_e4m3_fake_quant(x, self.scale), 8.0 * x.numel()
