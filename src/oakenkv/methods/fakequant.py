"""The caches the evaluation runs every method through (transformers ``DynamicCache`` subclasses).

:class:`FakeQuantCache` keeps transformers' own per-layer classes (full or sliding-window ``DynamicLayer``) and
only changes what they store: ``update`` quantize-dequantizes the incoming ``key_states`` / ``value_states``
``[B, H, S, D]`` with a :class:`~oakenkv.methods.base.KVFakeQuantizer` before storing them. Llama-style
attention uses what ``update`` returns, so the prefill attention too reads quantized keys and values (as the
paper's harness does), and so does every later decode step. Keys are quantized post-RoPE (what ``update``
receives) or, for ``key_position == "pre_rope"``, un-rotated, quantized and re-rotated
(:mod:`oakenkv.calibrate.rope`).

With ``residual`` R > 0 (``oaken:residual=R``, ``oaken-plus:residual=R``), every layer holds its newest tokens at
full precision, unquantized, in a window: after an update (a prefill chunk or a decode token) that leaves n >= 2R
tokens in the window, its oldest n - R are quantized and leave it, which then holds R (a prefill of S < 2R tokens
stays at full precision; S >= 2R quantizes tokens [0, S - R) and keeps the last R). A token once quantized stays
quantized. This is ``OakenCache``'s window, so that ``eval ppl`` measures what it costs. The attention reads the
window's tokens exactly as ``update`` received them, except oaken-plus's keys: those carry its key shift, as its
dequantized keys do (:meth:`~oakenkv.methods.base.KVFakeQuantizer.unquantized`; softmax ignores a shift common
to every key, but exact keys beside shifted ones would each score ``q . shift`` higher). The quantized tokens are
overwritten in place in what the base class stores (as :class:`~oakenkv.methods.kivi.KiviLayer` does), quantized
from the originals the layer keeps aside, through the same :meth:`FakeQuantCache.quantize_kv` an immediate
quantization takes, at their absolute positions (RoPE for pre-RoPE keys, oaken-plus's sink tokens): Oaken
quantizes each token on its own, so a token quantized later gets the bits it would have got at insertion.

oaken-plus's sink tokens are each row's first real tokens, as in ``OakenCache``: the cache learns where a
left-padded row's real tokens begin from the forward's attention mask (``oakenkv.hf.cache.track_padding``).

Every cache reports the bits the method would store for what it holds (:func:`stored_bits`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from oakenkv.calibrate.rope import RopeTable, apply_rope, has_rope, invert_rope
from oakenkv.methods.base import FP16_BITS, BitCounter, KVFakeQuantizer
from oakenkv.methods.kivi import KiviLayer


class _FakeQuantLayerMixin:
    """Mixed in front of a transformers layer class: fake-quantize, then store as the base class does."""

    _fq_cache: FakeQuantCache
    _fq_layer_idx: int
    #: tokens received so far (the absolute position of the next one)
    _fq_seen: int
    #: residual window only: tokens [0, _fq_quantized) are quantized, [_fq_quantized, _fq_seen) are not
    _fq_quantized: int
    #: residual window only: the window's keys and values [B, H, n, D] as received (None before the first update)
    _fq_window: tuple[torch.Tensor, torch.Tensor] | None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        # key_states, value_states: [B, H, S, D], keys post-RoPE
        cache = self._fq_cache
        if cache.residual == 0:  # the paper's Oaken: every token quantized as it arrives
            k, v = cache.quantize_kv(self._fq_layer_idx, key_states, value_states, self._fq_seen)
            self._fq_seen += key_states.shape[-2]
            return super().update(k, v, *args, **kwargs)
        return self._update_with_window(key_states, value_states, *args, **kwargs)

    def _update_with_window(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        """Store the new tokens as they are, then quantize in place what leaves the window (module doc).

        The window's originals are kept aside (``_fq_window``): what the base class stores may be in another frame
        (oaken-plus's keys), and a sliding layer whose span is shorter than 2R drops window tokens from what it
        stores before they are due; each is still quantized and counted when it leaves the window, as the counter
        counts a sliding layer's evicted tokens (:func:`stored_bits`).
        """
        cache, r = self._fq_cache, self._fq_cache.residual
        q, i = cache.quantizer, self._fq_layer_idx
        for kind, x in (("key", key_states), ("value", value_states)):  # refused as quantizing them is (nothing stored)
            if not bool(torch.isfinite(x).all()):
                raise ValueError(f"{kind} contains NaN or Inf (the window refuses what quantization would)")
        # what the attention reads: the window's tokens as they are (oaken-plus: keys in its shifted frame)
        k_read, v_read = q.unquantized(i, "key", key_states), q.unquantized(i, "value", value_states)
        keys, values = super().update(k_read, v_read, *args, **kwargs)
        self._fq_seen += key_states.shape[-2]
        if self._fq_window is None:
            wk, wv = key_states, value_states
        else:
            wk = torch.cat([self._fq_window[0], key_states], dim=-2)
            wv = torch.cat([self._fq_window[1], value_states], dim=-2)
        n = wk.shape[-2]
        if n >= 2 * r:
            f = n - r  # the oldest n - R leave the window: tokens [_fq_quantized, _fq_quantized + f)
            start = self._fq_quantized
            kq, vq = cache.quantize_kv(i, wk[:, :, :f], wv[:, :, :f], start)
            # keys[..., j, :] is token j + first (a sliding layer returns only its span: first > 0)
            first = self._fq_seen - keys.shape[-2]
            lo = max(start, first)
            if lo < start + f:  # (a token before `first` is no longer read: nothing to overwrite)
                keys[:, :, lo - first : start + f - first] = kq[:, :, lo - start :]
                values[:, :, lo - first : start + f - first] = vq[:, :, lo - start :]
            self._fq_quantized += f
            wk, wv = wk[:, :, f:].clone(), wv[:, :, f:].clone()  # (not a view holding the flushed tokens)
        self._fq_window = (wk, wv)
        return keys, values

    def window_bits(self) -> BitCounter:
        """The residual window's stored bits and values: 32 bits per value, as ``OakenCache`` holds its window
        (float32, whatever the model's dtype: the rows the encoder will take, bit for bit)."""
        out = BitCounter()
        if self._fq_window is not None:
            for x in self._fq_window:  # keys, values
                out.add(32 * x.numel(), x.numel())
        return out

    def reset(self) -> None:
        super().reset()
        self._fq_seen = self._fq_quantized = 0
        self._fq_window = None


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

    def __init__(
        self, model: Any, quantizer: KVFakeQuantizer, rope: RopeTable | None = None, residual: int = 0
    ) -> None:
        """
        Args:
            model: the transformers causal LM the cache is for (its config picks the layer types; its rotary
                embedding serves pre-RoPE quantization).
            quantizer: the method.
            rope: a shared :class:`RopeTable` of ``model`` (optional; built when the quantizer needs one).
            residual: R, the newest tokens of each layer kept at full precision (module doc); 0: none.
        """
        if isinstance(residual, bool) or not isinstance(residual, int) or residual < 0:
            raise ValueError(f"residual must be 0 (off) or a positive token count, got {residual!r}")
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
            layer._fq_quantized, layer._fq_window = 0, None
            layers.append(layer)
        super().__init__()
        self.layers = layers
        self.layer_class_to_replicate = None
        self.quantizer = quantizer.for_sequence()  # (a stateful method's state is this cache's)
        self.residual = residual
        #: bits of the quantized tokens, counted as they are quantized (the residual window's: stored_bits)
        self.counter = BitCounter()
        self.rope = None
        if quantizer.key_position == "pre_rope" and (rope is not None or has_rope(model)):
            self.rope = rope if rope is not None else RopeTable(model)  # (no RoPE: the keys are pre-RoPE)
        #: int64 ``[B]``: each row's first real token (its first sink token); None: 0 for every row (module doc).
        self.row_starts: np.ndarray | None = None
        if quantizer.sink_tokens:
            from oakenkv.hf.cache import track_padding

            track_padding(model)

    def note_attention_mask(self, mask: Any) -> None:
        """Learn each row's first real token from a forward's 2-D attention mask, as ``OakenCache`` does: a row
        keeps the start its first sink token was quantized with."""
        n = self.quantizer.sink_tokens
        held = self.layers[0]._fq_seen if self.layers else 0
        old = self.row_starts
        if not n or (old is not None and held >= int(old.max(initial=0)) + n):
            return
        from oakenkv.hf.cache import row_starts_from_mask

        new = row_starts_from_mask(mask)
        if new is None:
            return
        if held:
            old = old if old is not None and old.shape[0] == new.shape[0] else np.zeros_like(new)
            new = np.where(old < held, old, new)
        self.row_starts = new

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        if self.row_starts is not None:
            self.row_starts = self.row_starts[beam_idx.cpu().numpy()]

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        if self.row_starts is not None:
            self.row_starts = self.row_starts[torch.as_tensor(indices).reshape(-1).cpu().numpy()]

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        if self.row_starts is not None:
            self.row_starts = np.repeat(self.row_starts, repeats)

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
        n, s = q.sink_tokens, k.shape[-2]
        if n:  # oaken-plus: each row's first real tokens also kept at 16 bits and read from there, as OakenCache does
            starts = self.row_starts
            if starts is None or starts.shape[0] != k.shape[0]:
                starts = np.zeros(k.shape[0], np.int64)
            cloned = False
            for r, p in enumerate(starts.tolist()):
                lo, hi = max(p, start) - start, min(p + n, start + s) - start
                if lo >= hi:
                    continue
                if not cloned:
                    k_hat, v_hat, cloned = k_hat.clone(), v_hat.clone(), True
                k_hat[r : r + 1, :, lo:hi] = q.sink(layer_idx, "key", k[r : r + 1, :, lo:hi])
                v_hat[r : r + 1, :, lo:hi] = q.sink(layer_idx, "value", v[r : r + 1, :, lo:hi])
                kbits += 16 * k[r : r + 1, :, lo:hi].numel()
                vbits += 16 * v[r : r + 1, :, lo:hi].numel()
        self.counter.add(kbits + vbits, k.numel() + v.numel())
        return k_hat, v_hat


class KiviCache(DynamicCache):
    """A ``DynamicCache`` of :class:`~oakenkv.methods.kivi.KiviLayer`, one per decoder layer.

    Every layer keeps the whole history (a sliding-window layer's attention mask still limits what it reads).
    """

    def __init__(self, model: Any, bits: int = 4, group: int = 32, residual: int = 128) -> None:
        n = model.config.get_text_config(decoder=True).num_hidden_layers
        super().__init__()
        self.layers = [KiviLayer(bits, group, residual) for _ in range(n)]
        self.layer_class_to_replicate = None


def stored_bits(cache: Any) -> BitCounter:
    """Bits the method stores for what ``cache`` holds now, and the number of values (K and V elements).

    - :class:`FakeQuantCache`: counted by the quantizer as values are quantized (sliding layers count evicted
      tokens too: the rate, not the footprint, is what is compared), plus, with a residual window, the window's
      tokens at 32 bits per value (float32, what ``OakenCache`` holds them in, whatever the model's dtype);
    - :class:`KiviCache`: quantized tokens at their rate, the residual window at 16 bits;
    - transformers' ``QuantizedCache`` (quanto/HQQ backends, group-wise): ``nbits`` per quantized value plus an
      fp16 scale and zero point per group of ``q_group_size``, 16 bits per residual value;
    - any other ``Cache`` (full precision): 16 bits per stored value.
    """
    if isinstance(cache, FakeQuantCache):
        out = BitCounter(cache.counter.bits, cache.counter.values)
        for layer in cache.layers:
            out.merge(layer.window_bits())
        return out
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
