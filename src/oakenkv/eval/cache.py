"""The caches the evaluation runs every method through (transformers ``DynamicCache`` subclasses).

:class:`FakeQuantCache` keeps transformers' own per-layer classes (full or sliding-window ``DynamicLayer``) and
only changes what they store: ``update`` quantize-dequantizes the incoming ``key_states`` / ``value_states``
``[B, H, S, D]`` with a :class:`~oakenkv.baselines.base.KVFakeQuantizer` before storing them. Llama-style
attention uses what ``update`` returns, so the prefill attention too reads quantized keys and values (as the
paper's harness does), and so does every later decode step. Keys are quantized post-RoPE (what ``update``
receives) or, for ``key_position == "pre_rope"``, un-rotated, quantized and re-rotated
(:mod:`oakenkv.rope`).

Every cache reports the bits the method would store for what it holds (:func:`stored_bits`).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from oakenkv.baselines.base import FP16_BITS, BitCounter, KVFakeQuantizer
from oakenkv.baselines.kivi import KiviLayer
from oakenkv.rope import RopeTable, apply_rope, invert_rope


class _FakeQuantLayerMixin:
    """Mixed in front of a transformers layer class: fake-quantize, then store as the base class does."""

    _fq_cache: FakeQuantCache
    _fq_layer_idx: int
    _fq_seen: int

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        # key_states, value_states: [B, H, S, D], keys post-RoPE
        k, v = self._fq_cache.quantize_kv(self._fq_layer_idx, key_states, value_states, self._fq_seen)
        self._fq_seen += key_states.shape[-2]
        return super().update(k, v, *args, **kwargs)

    def reset(self) -> None:
        super().reset()
        self._fq_seen = 0


_FQ_CLASSES: dict[type, type] = {}


def _fake_quant_class(base: type) -> type:
    """``FakeQuant<Base>``: the layer class ``base`` with :class:`_FakeQuantLayerMixin`'s ``update``."""
    cls = _FQ_CLASSES.get(base)
    if cls is None:
        cls = type(f"FakeQuant{base.__name__}", (_FakeQuantLayerMixin, base), {})
        _FQ_CLASSES[base] = cls
    return cls


class FakeQuantCache(DynamicCache):
    """A ``DynamicCache`` whose layers store ``quantizer``'s quantize-dequantized keys and values."""

    def __init__(self, model: Any, quantizer: KVFakeQuantizer, rope: RopeTable | None = None) -> None:
        """
        Args:
            model: the transformers causal LM the cache is for (its config picks the layer types; its rotary
                embedding serves pre-RoPE quantization).
            quantizer: the method.
            rope: a shared :class:`RopeTable` of ``model`` (optional; built when the quantizer needs one).
        """
        from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, get_layer_types_and_kwargs

        # The same layer types and arguments DynamicCache(config=...) would build, with the mixin in front.
        layer_types, layer_kwargs = get_layer_types_and_kwargs(model.config.get_text_config(decoder=True))
        layers = []
        for i, (lt, kw) in enumerate(zip(layer_types, layer_kwargs, strict=True)):
            base = DYNAMIC_LAYER_TYPE_MAPPING[lt]
            if not issubclass(base, DynamicLayer):
                raise NotImplementedError(f"layer {i} is a {base.__name__}; only DynamicLayer types are supported")
            layer = _fake_quant_class(base)(**kw)
            layer._fq_cache, layer._fq_layer_idx, layer._fq_seen = self, i, 0
            layers.append(layer)
        super().__init__()
        self.layers = layers
        self.layer_class_to_replicate = None
        self.quantizer = quantizer
        self.counter = BitCounter()
        self.rope = None
        if quantizer.key_position == "pre_rope":
            self.rope = rope if rope is not None else RopeTable(model)

    def quantize_kv(
        self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, start: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Fake-quantize one layer's new keys (post-RoPE in and out) and values ``[B, H, S, D]`` at ``start``."""
        q = self.quantizer
        if self.rope is not None:
            cos, sin = self.rope.cos_sin(layer_idx, start, k.shape[-2], k)
            k_pre, kbits = q.quantize(layer_idx, "key", invert_rope(k, cos, sin))
            k_hat = apply_rope(k_pre, cos, sin)
        else:
            k_hat, kbits = q.quantize(layer_idx, "key", k)
        v_hat, vbits = q.quantize(layer_idx, "value", v)
        n = min(q.sink_tokens - start, k.shape[-2])
        if n > 0:  # oaken-plus: the first tokens also kept at 16 bits and read from there, as OakenCache does
            k_hat, v_hat = k_hat.clone(), v_hat.clone()
            k_hat[:, :, :n] = q.sink(layer_idx, "key", k[:, :, :n])
            v_hat[:, :, :n] = q.sink(layer_idx, "value", v[:, :, :n])
            kbits += 16 * k[:, :, :n].numel()
            vbits += 16 * v[:, :, :n].numel()
        self.counter.add(kbits + vbits, k.numel() + v.numel())
        return k_hat, v_hat


class KiviCache(DynamicCache):
    """A ``DynamicCache`` of :class:`~oakenkv.baselines.kivi.KiviLayer`, one per decoder layer.

    Every layer keeps the whole history (a sliding-window layer's attention mask still limits what it reads).
    """

    def __init__(self, model: Any, bits: int = 4, group: int = 32, residual: int = 128) -> None:
        n = model.config.get_text_config(decoder=True).num_hidden_layers
        super().__init__()
        self.layers = [KiviLayer(bits, group, residual) for _ in range(n)]
        self.layer_class_to_replicate = None


def stored_bits(cache: Any) -> BitCounter:
    """Bits the method stores for what ``cache`` holds now, and the number of values (K and V elements).

    - :class:`FakeQuantCache`: counted by the quantizer as values arrive (sliding layers count evicted tokens
      too: the rate, not the footprint, is what is compared);
    - :class:`KiviCache`: quantized tokens at their rate, the residual window at 16 bits;
    - transformers' ``QuantizedCache`` (quanto/HQQ backends, group-wise): ``nbits`` per quantized value plus an
      fp16 scale and zero point per group of ``q_group_size``, 16 bits per residual value;
    - any other ``Cache`` (full precision): 16 bits per stored value.
    """
    if isinstance(cache, FakeQuantCache):
        return BitCounter(cache.counter.bits, cache.counter.values)
    out = BitCounter()
    if isinstance(cache, KiviCache):
        for layer in cache.layers:
            out.add(*layer.stored_bits())
        return out
    for layer in cache.layers:
        if hasattr(layer, "q_group_size") and hasattr(layer, "cumulative_length"):
            if not layer.is_initialized or layer._quantized_keys is None:
                continue
            qk = layer._quantized_keys
            shape = qk.shape if hasattr(qk, "shape") else qk[0].shape  # [B, H, S_quantized, D]
            per_token = 2 * shape[0] * shape[1] * shape[-1]  # keys and values
            res = layer.keys.numel() + layer.values.numel() if layer.keys.dim() == 4 else 0
            total = per_token * layer.cumulative_length
            quant = total - res
            out.add(quant * (layer.nbits + 2 * FP16_BITS / layer.q_group_size) + res * FP16_BITS, total)
        elif getattr(layer, "keys", None) is not None and layer.is_initialized:
            n = layer.keys.numel() + layer.values.numel()
            out.add(n * FP16_BITS, n)
    return out
