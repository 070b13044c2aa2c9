"""Oaken's quantizers for the evaluation's fake-quantizing cache (``oakenkv.methods.fakequant``): the paper's
(:class:`OakenQuantizer`) and oaken-plus's (:class:`PlusQuantizer`), both through the codec's numba kernels."""

from __future__ import annotations

import copy
from typing import Any

import torch

from oakenkv.format.config import OakenConfig
from oakenkv.methods.base import Kind, KVFakeQuantizer, check_kv
from oakenkv.quant.adapt import AdaptConfig, AdaptState, new_state


class OakenQuantizer(KVFakeQuantizer):
    """Oaken's quantize-dequantize (:mod:`oakenkv.quant.quantizer`, run through the codec's kernels), one vector per
    token.

    Token granularity: ``[B, H, S, D] -> [B*S, H*D]`` (one token's keys of all KV heads of a layer, the paper's
    vector); head granularity: ``[B*S*H, D]``. Stored bits are the bytes the codec produced for those rows
    (dense nibbles, COO entries, six per-token scales, 16-bit header; ``oakenkv.format.layout``), less the rare escape
    bytes: the evaluation has always reported the format's cost without escapes (its committed results), and
    ``codec.effective_bits`` gives the figure with them (+0.004 bits per value on the default model).
    """

    def __init__(
        self,
        thresholds: Any,
        config: OakenConfig,
        kinds: tuple[str, ...] = ("key", "value"),
        adapt: AdaptConfig | None = None,
    ) -> None:
        if not kinds or any(k not in ("key", "value") for k in kinds):
            raise ValueError(f"kinds must be a non-empty subset of ('key', 'value'), got {kinds!r}")
        if adapt is not None and config.granularity != "token":
            raise ValueError("adaptive grouping counts tokens: it needs granularity='token'")
        self.thresholds = thresholds
        self.config = config
        self.key_position = config.key_position
        #: The kinds that are quantized; the other one (an ablation) stays unquantized, counted at 16 bits.
        self.kinds = tuple(kinds)
        #: Adaptive grouping (``oakenkv.quant.adapt``), or None; its state is a sequence's (:meth:`for_sequence`).
        self.adapt = adapt
        self.adapt_state: AdaptState | None = None

    def for_sequence(self) -> OakenQuantizer:
        """``self``, or with adaptive grouping a copy with a fresh state: each cache (a window, a batch of documents)
        adapts from the profile's thresholds, as a new ``OakenCache`` does."""
        if self.adapt is None:
            return self
        q = copy.copy(self)
        q.adapt_state = new_state(self.thresholds, self.adapt)
        return q

    def quantize(self, layer_idx: int, kind: Kind, x: torch.Tensor) -> tuple[torch.Tensor, float]:
        from oakenkv.kernels.cpu.codec import decode_batch, encode_batch, sparse_stream_stats

        check_kv(x, kind)
        if kind not in self.kinds:
            return x, 16.0 * x.numel()
        b, h, s, d = x.shape
        if self.adapt is not None:
            if self.adapt_state is None:
                raise RuntimeError("an adaptive quantizer runs per sequence: use for_sequence() (FakeQuantCache does)")
            return self._quantize_adaptive(layer_idx, kind, x)
        rows = x.permute(0, 2, 1, 3).reshape(b * s, h * d)  # [B*S, H*D]: one token vector per row
        if self.config.granularity == "head":
            rows = rows.reshape(b * s * h, d)
        thr = self.thresholds.layer(layer_idx, kind)
        # The numba codec's round trip: bit-identical to quant.quantize_dequantize (tests/test_eval.py checks it)
        # and much faster than the reference.
        enc = encode_batch(rows, thr, self.config)
        y = decode_batch(enc, thr, self.config)
        _, escape_bytes = sparse_stream_stats(enc)
        bits = 8 * (enc.nbytes() - escape_bytes)
        return y.reshape(b, s, h, d).permute(0, 2, 1, 3).contiguous(), bits

    def _quantize_adaptive(self, layer_idx: int, kind: Kind, x: torch.Tensor) -> tuple[torch.Tensor, float]:
        """:meth:`quantize` under adaptive grouping, as ``PagedKVStore`` encodes: the new tokens one epoch at a time
        (``AdaptState.segment``), each grouped by its epoch's thresholds and shifted (and decoded) by the fixed
        ones, the epoch's sparse bytes counted over every batch row."""
        from oakenkv.kernels.cpu.codec import decode_batch, encode_batch, sparse_stream_stats

        state = self.adapt_state
        assert state is not None
        k = 0 if kind == "key" else 1
        b, h, s, d = x.shape
        rows = x.permute(0, 2, 1, 3).reshape(b, s, h * d).to(torch.float32)  # [B, S, H*D]
        out = torch.empty(b, s, h * d, dtype=torch.float32)
        shift = state.shift(layer_idx, k)
        bits = 0
        a = 0
        while a < s:
            e = a + state.segment(layer_idx, k, s - a)
            seg = rows[:, a:e].reshape(b * (e - a), h * d)
            enc = encode_batch(seg, shift, self.config, state.grouping(layer_idx, k))
            out[:, a:e] = decode_batch(enc, shift, self.config).reshape(b, e - a, h * d)
            _, escape_bytes = sparse_stream_stats(enc)
            bits += 8 * (enc.nbytes() - escape_bytes)
            state.record(layer_idx, k, e - a, enc.sparse.numel(), seg.numel())
            a = e
        y = out.reshape(b, s, h, d).permute(0, 2, 1, 3).contiguous().to(x.dtype)
        return y, bits


class PlusQuantizer(OakenQuantizer):
    """``oaken-plus``: Oaken's quantizer after the profile's online key transform (a shift, a rotation), on a
    model that carries the profile's folded transforms (``oakenkv.calibrate.transforms``). Returns keys in the model's
    frame up to the shift, which softmax ignores, exactly as ``OakenCache`` hands them to attention."""

    def __init__(self, thresholds: Any, adapt: AdaptConfig | None = None) -> None:
        super().__init__(thresholds, thresholds.config, adapt=adapt)
        self.transforms = thresholds.transforms

    def quantize(self, layer_idx: int, kind: Kind, x: torch.Tensor) -> tuple[torch.Tensor, float]:
        if kind != "key":
            return super().quantize(layer_idx, kind, x)
        y, bits = super().quantize(layer_idx, kind, self.transforms.keys_forward(layer_idx, x))
        return self.transforms.keys_restore(layer_idx, y).to(x.dtype), bits

    @property
    def sink_tokens(self) -> int:
        """The first tokens of a sequence kept at 16 bits beside their codes (``Transforms.sink_tokens``)."""
        return self.transforms.sink_tokens

    def unquantized(self, layer_idx: int, kind: Kind, x: torch.Tensor) -> torch.Tensor:
        """Keys of the full-precision window as ``OakenCache`` hands them to attention: after the online transform
        (in float32, as the store holds its window) and restored like the dequantized ones, so that every key
        carries the shift; values as they are."""
        if kind != "key":
            return x
        return self.transforms.keys_restore(layer_idx, self.transforms.keys_forward(layer_idx, x)).to(x.dtype)

    def sink(self, layer_idx: int, kind: Kind, x: torch.Tensor) -> torch.Tensor:
        """Sink tokens ``[B, H, n, hd]`` as ``OakenCache`` hands them to attention: float16 (keys after the online
        transform, then restored like the dequantized ones). The cache's bits count them (``FakeQuantCache``)."""
        if kind != "key":
            return x.to(torch.float16).to(x.dtype)
        k = self.transforms.keys_forward(layer_idx, x).to(torch.float16).to(torch.float32)
        return self.transforms.keys_restore(layer_idx, k).to(x.dtype)
