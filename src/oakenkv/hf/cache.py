"""`OakenCache`: a transformers 5.x ``Cache`` that stores keys and values in the Oaken format, in pages.

The adapter between transformers and the paged store. Built on transformers' own cache types (``Cache`` /
``CacheLayerMixin``, ``transformers/cache_utils.py``): one :class:`OakenLayer` per decoder layer, all sharing one
:class:`~oakenkv.store.paged.PagedKVStore` (the page pool, the codec and the thresholds; ``oakenkv.store.paged``). Each
batch row is one pool sequence with ``2 * num_layers`` streams (``stream = 2 * layer + 0`` for keys, ``+ 1`` for
values); a token's vector is all KV heads of the layer (``D = num_kv_heads * head_dim``, granularity "token").

What ``update`` returns
-----------------------
* **Prefill** (``S > 1``), or any step when the model does not use the ``"oaken"`` attention: the dequantized keys
  and values of the whole history plus the new tokens (``[B, H, T, hd]``), so stock attention runs on exactly what
  is stored (the paper's harness also attends over quantized K/V). The new tokens are encoded chunk by chunk
  (``prefill_chunk`` tokens), so the encoder's temporaries stay small; on a first update the result is decoded
  from those chunks directly, later ones read the pages back. The float tensors returned for one layer are the
  size of that layer's unquantized cache and are dropped after its attention, so peak memory never exceeds that
  of an unquantized cache.
* **Decode** (``S == 1``) with the ``"oaken"`` attention (:func:`oakenkv.hf.attention.enable_oaken_attention`):
  lightweight :class:`PackedKV` handles; the attention function reads the packed pages directly.

With ``OakenCache(..., residual=R)`` each layer's newest tokens stay unquantized in a full-precision window beside
the pages (``oakenkv.store.paged``): the float results above are the pages' tokens followed by the window's, and the
packed attention adds the window's part to the pages'.

Sliding-window layers (Gemma 3: 5 of every 6 layers, window 512) are quantized and paged like full layers; the
sliding mask that transformers builds limits what attention sees, and each update releases the pages that hold
only tokens no query can reach any more (``PagedKVStore.evict_before``, whole pages: a sliding layer keeps the
window plus at most one page of records before it). The tables keep their per-token entries (2 bytes of
sparse length per token and stream) and evicted tokens read as zeros in the float path; the kernel never reads
them (the mask hides them). ``OakenCache(..., evict_sliding=False)`` keeps everything.

Where the pages live (``OakenCache(backend=...)``): ``"auto"`` (default) decides at the first update from the key
states' device: CPU tensors keep the host store (``PagedKVStore``, numba kernels), CUDA tensors get a device store on
that device (``oakenkv.store.device.DeviceKVStore``: the same bytes, written and read by the Triton kernels; with the
``"oaken"`` attention, prefill chunks too attend over its pages: ``docs/gpu.md``). ``"numba"`` and ``"triton"`` force
one; ``"triton"`` on CPU tensors runs the kernels under the Triton interpreter (``TRITON_INTERPRET=1``), for tests.

Running out of the pool's budget raises :class:`~oakenkv.store.pages.PoolExhaustedError` from the layer that could not
append; that layer and every other sequence of the pool are unchanged, but the layers before it already hold the
step's tokens, so a cache that raised must be ``reset()`` (or dropped) before it is used again.

Left padding: an oaken-plus profile keeps each row's first ``n`` real tokens at 16 bits (its sink tokens,
``oakenkv.store.paged``). Which token of a row is its first real one only the attention mask says: a cache built
with the model (``OakenCache(thresholds, model)``, ``from_profile``, ``for_model``) puts a forward pre-hook on it
(:func:`track_padding`, once per model) that hands each forward's 2-D ``attention_mask`` to the cache it is given
(:meth:`OakenCache.note_attention_mask`), before the first of a row's sink tokens is stored. Built from a config
only, every row's sink is its token 0.

Beam search and batch selection are table operations: a reordered row is a :meth:`~oakenkv.store.pages.PagePool.fork`
of its source sequence (pages shared, copied on write), never a copy of the KV bytes.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from oakenkv.calibrate.identity import kv_shape, layer_kinds
from oakenkv.calibrate.thresholds import Thresholds
from oakenkv.calibrate.transforms import FOLD_MARK
from oakenkv.format.config import DEFAULT_STATIC_LEVELS, OakenConfig
from oakenkv.hf.attention import ATTN_IMPLEMENTATION, PackedKV, enable_oaken_attention
from oakenkv.quant.adapt import AdaptConfig
from oakenkv.store.paged import KEY, PREFILL_CHUNK, SERIAL_BELOW_ROWS, VALUE, PagedKVStore, serial_numba
from oakenkv.store.pages import PoolConfig, PoolStats

#: ``OakenCache(backend=...)``: chosen by the tensors' device, the host store (numba), the device store (Triton).
BACKENDS = ("auto", "numba", "triton")

# ------------------------------------------------------------------------------------------------ layers

_MISSING = object()


class NoGradientWarning(UserWarning):
    """An :class:`OakenCache` was given keys and values that require a gradient: it stores them quantized, through
    numpy, so no gradient flows back through the cache (to ``k_proj``/``v_proj`` and what feeds them)."""


class OakenLayer(CacheLayerMixin):
    """One decoder layer of an :class:`OakenCache`; its keys and values live in the shared store's pages."""

    is_compileable = False
    # Cropping would need truncating page tables; assisted decoding is not supported yet.
    is_croppable = False

    def __init__(
        self,
        store: PagedKVStore,
        layer_idx: int,
        sliding_window: int | None = None,
        evict: bool = True,
        model_config: Any = None,
    ) -> None:
        super().__init__()
        self.store = store
        self.layer_idx = layer_idx
        self.is_sliding = sliding_window is not None
        self.sliding_window = sliding_window
        #: Sliding layers: release the pages of tokens that left the window (module docstring).
        self.evict = evict
        #: The model's config, whose attention implementation decides what a decode step returns.
        self._model_config = model_config
        #: The oaken-plus transforms folded into the model when the cache was built (their digest, or None): a model
        #: folded later (``for_model`` for another preset) no longer makes the keys and values it was profiled for.
        self._fold = None if model_config is None else vars(model_config).get(FOLD_MARK)

    @property
    def packed_decode(self) -> bool:
        """Whether decode steps return :class:`PackedKV` handles: the model runs the ``"oaken"`` attention.

        Read at each decode step, not fixed once: a model may switch its attention between steps of one cache
        (``oakenkv.hf.attention.oaken_attention``), and a float step must get float tensors."""
        cfg = self._model_config
        if cfg is None:
            return False
        # transformers' property reads this attribute through its config class's __getattribute__, once per layer
        # and step (its cost: docs/notebook/perf-notes.md), so the attribute is read directly where it exists
        impl = vars(cfg).get("_attn_implementation_internal", _MISSING)
        return (cfg._attn_implementation if impl is _MISSING else impl) == ATTN_IMPLEMENTATION

    def __repr__(self) -> str:
        return f"OakenLayer(layer={self.layer_idx}, tokens={self.get_seq_length()}, sliding={self.sliding_window})"

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.dtype = key_states.dtype
        if self.layer_idx == 0 and torch.is_grad_enabled() and (key_states.requires_grad or value_states.requires_grad):
            warnings.warn(  # (once per cache: its first layer's first tokens)
                "OakenCache stores keys and values quantized, outside autograd: no gradient flows back through the "
                "cache (k_proj, v_proj and what feeds them get none). Run inference under torch.no_grad() or "
                "torch.inference_mode(); to train, leave the cache out",
                NoGradientWarning,
                stacklevel=4,
            )
        if self.device.type != "cpu" and not getattr(self.store, "on_device", False):
            raise ValueError(
                f"OakenCache's host store (numba) keeps its pages in host memory, got tensors on {self.device}: a "
                "model on a CUDA GPU gets the device store with backend='auto' (the default) or 'triton'"
            )
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor | PackedKV, torch.Tensor | PackedKV]:
        """Store new tokens ``[B, H, S, hd]``; return what the attention function needs (module docstring)."""
        cfg = self._model_config
        if cfg is not None and vars(cfg).get(FOLD_MARK) != self._fold:
            raise ValueError(
                "the model's oaken-plus transforms changed after this cache was built for it (a later for_model "
                "folded some in): its profile no longer describes the model's keys and values; build a new cache "
                "with OakenCache.for_model(model, ...)"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        store = self.store
        if getattr(store, "on_device", False):
            return self._update_device(key_states, value_states)
        if store.residual:
            return self._update_with_window(key_states, value_states)
        past = store.num_tokens(self.layer_idx)
        s = key_states.shape[2]
        decoded = []  # (keys, values) of each chunk as stored, while they are the whole history
        chunk = store.prefill_chunk
        packed = s == 1 and self.packed_decode
        if s == 1 and past and store.fast:  # a decode step: the single-token path
            store.append_token(self.layer_idx, key_states, value_states)
        else:
            for start in range(0, s, chunk):
                ks, vs = key_states[:, :, start : start + chunk], value_states[:, :, start : start + chunk]
                if past or packed:
                    store.append(self.layer_idx, ks, vs)
                else:  # the whole history is what we encode: keep it as decoded, not read from the pages
                    decoded.append(store.append_decoded(self.layer_idx, ks, vs))
        total = past + s
        if packed:
            result = (PackedKV(store, self.layer_idx, KEY, total), PackedKV(store, self.layer_idx, VALUE, total))
        elif decoded:
            result = tuple(self._as_read(kind, [d[kind] for d in decoded], key_states) for kind in (KEY, VALUE))
        else:
            result = (
                store.read(self.layer_idx, KEY, key_states.dtype),
                store.read(self.layer_idx, VALUE, key_states.dtype),
            )
        if self.is_sliding and self.evict:
            # transformers' sliding mask lets a query at position p see keys above p - window. The next query
            # (position ``total``) and all later ones see none below total - window + 1; this step's float tensors
            # are already built, and its packed decode query (position total - 1) reads from total - window on.
            store.evict_before(self.layer_idx, total - self.sliding_window)
        return result

    def _update_device(
        self, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor | PackedKV, torch.Tensor | PackedKV]:
        """:meth:`update` on a device store (``oakenkv.store.device``): the new tokens go into the pages on the
        model's device; with the ``"oaken"`` attention every step (prefill chunks too) returns :class:`PackedKV`
        handles and attention reads the pages (``DeviceKVStore.attention``), else the dequantized history."""
        store = self.store
        layer = self.layer_idx
        store.append(layer, key_states, value_states)
        total = store.num_tokens(layer)
        if self.packed_decode:
            result = (PackedKV(store, layer, KEY, total), PackedKV(store, layer, VALUE, total))
        else:
            dtype = key_states.dtype
            result = (store.read(layer, KEY, dtype), store.read(layer, VALUE, dtype))
        if self.is_sliding and self.evict:  # (see update)
            store.evict_before(layer, total - self.sliding_window)
        return result

    def _update_with_window(
        self, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor | PackedKV, torch.Tensor | PackedKV]:
        """:meth:`update` with a full-precision window (``OakenCache(residual=R)``, ``oakenkv.store.paged``): the new
        tokens join the window, whose oldest tokens the store encodes once it holds ``2 R``; the float result is
        the pages' tokens (dequantized) followed by the window's."""
        store = self.store
        layer = self.layer_idx
        past = store.num_tokens(layer)
        chunks = store.window_update(layer, key_states, value_states)
        paged = store.num_tokens(layer)
        total = paged + store.window_tokens(layer)
        if key_states.shape[2] == 1 and self.packed_decode:
            result = (PackedKV(store, layer, KEY, total), PackedKV(store, layer, VALUE, total))
        else:
            parts = []
            for kind in (KEY, VALUE):
                if past == 0 and chunks:  # the pages hold only this update's chunks: decode them directly
                    x = self._decode_chunks(kind, [c[kind] for c in chunks], key_states)
                elif paged:
                    x = store.read(layer, kind, key_states.dtype)
                else:
                    x = None
                w = store.window(layer, kind, key_states.dtype)
                parts.append(w.clone() if x is None else torch.cat([x.to(key_states.dtype), w], dim=2))
            result = (parts[0], parts[1])
        if self.is_sliding and self.evict:  # (see update; only pages are released, the window is kept)
            store.evict_before(layer, min(paged, total - self.sliding_window))
        return result

    def _decode_chunks(self, kind: int, chunks: list[Any], like: torch.Tensor) -> torch.Tensor:
        """Dequantize the encoded chunks of one kind (``KEY``/``VALUE``) of a first update, rows ordered ``(b, s)``
        within each chunk, into ``[B, H, S, hd]`` of ``like``'s dtype as :meth:`PagedKVStore.read` would return
        them (see :meth:`_as_read`)."""
        store = self.store
        b = like.shape[0]
        parts = []
        for enc in chunks:
            with serial_numba(enc.num_rows < SERIAL_BELOW_ROWS):
                x = store.decode_encoded(self.layer_idx, kind, enc)
            parts.append(x.numpy().reshape(b, enc.num_rows // b, store.dim))
        return self._as_read(kind, parts, like)

    def _as_read(self, kind: int, parts: list[np.ndarray], like: torch.Tensor) -> torch.Tensor:
        """Decoded float32 rows ``[B, S_i, D]`` of one kind (consecutive chunks of a first update) as
        :meth:`PagedKVStore.read` returns the history: ``[B, H, S, hd]`` of ``like``'s dtype, sink tokens put in,
        keys restored (a view of the rows for one chunk, a concatenation for several)."""
        store = self.store
        x = torch.from_numpy(parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1))
        # [B, S, H * hd] -> a [B, H, S, hd] view (no copy; attention accepts strided inputs)
        x = x.view(x.shape[0], x.shape[1], store.num_kv_heads, store.head_dim).permute(0, 2, 1, 3).to(like.dtype)
        x = store.apply_sinks(self.layer_idx, kind, x)
        return store.restore_keys(self.layer_idx, x) if kind == KEY else x

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Every stored token is returned (sliding layers too: the sliding mask hides what left the window).
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self.store.num_tokens(self.layer_idx) + self.store.window_tokens(self.layer_idx)

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.is_initialized = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise RuntimeError("reorder an OakenCache as a whole (OakenCache.reorder_cache), not one layer")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("OakenCache cannot be cropped yet (assisted decoding is not supported)")

    def offload(self) -> None:  # pages are host memory already
        pass

    def prefetch(self) -> None:
        pass


_PADDING_HOOK = "_oakenkv_padding_hook"


def row_starts_from_mask(mask: Any) -> np.ndarray | None:
    """int64 ``[B]``: per row of a 2-D attention mask ``[B, T]`` (nonzero / True: a real token) the position of its
    first real token, ``T`` for a row that has none yet; None for anything but a 2-D tensor (no padding known)."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return None
    real = (mask != 0).to(torch.uint8)
    first = real.argmax(dim=1)  # (the first maximum: the first real token)
    first = torch.where(real.amax(dim=1) > 0, first, torch.full_like(first, real.shape[1]))
    return first.cpu().numpy().astype(np.int64)


def track_padding(model: Any) -> None:
    """Hand every forward's 2-D ``attention_mask`` to the cache it is given (any cache with a
    ``note_attention_mask`` method: :class:`OakenCache`, the evaluation's ``FakeQuantCache``), before the model runs,
    so that a left-padded row's sink tokens are its first real tokens (module doc). A forward pre-hook, installed
    once per model; the mask and the cache are found by keyword or by position in ``model.forward``'s signature."""
    if getattr(model, _PADDING_HOOK, False):
        return
    import inspect

    params = list(inspect.signature(model.forward).parameters)
    mask_at = params.index("attention_mask") if "attention_mask" in params else None
    cache_at = {n: params.index(n) for n in ("cache", "past_key_values") if n in params}

    def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        mask = kwargs.get("attention_mask")
        if mask is None and mask_at is not None and len(args) > mask_at:
            mask = args[mask_at]
        for name in ("cache", "past_key_values"):
            cache = kwargs.get(name)
            if cache is None and name in cache_at and len(args) > cache_at[name]:
                cache = args[cache_at[name]]
            note = getattr(cache, "note_attention_mask", None)
            if note is not None:
                note(mask)

    model.register_forward_pre_hook(hook, with_kwargs=True)
    setattr(model, _PADDING_HOOK, True)


_GUARDED = "_oakenkv_cache_keyword_guard"


def _guard_cache_keyword(model: Any) -> None:
    """Make ``model`` take an :class:`OakenCache` under either keyword (``cache=`` or ``past_key_values=``):
    transformers 5.x renamed it, and a model swallows the other one in its ``**kwargs`` and silently runs its
    own unquantized cache. A forward pre-hook moves our cache to the keyword ``model.forward`` takes. When that
    keyword already holds another cache: an empty one is ``generate``'s own, made because it did not see ours
    under the old keyword, and ours replaces it (the model returns ours, which ``generate`` passes on from then);
    one holding tokens is the caller's, and the hook raises. Installed once per model."""
    from oakenkv.util.compat import cache_keyword

    if getattr(model, _GUARDED, False):
        return
    keyword = cache_keyword(model)

    def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        for name in ("cache", "past_key_values"):
            if name != keyword and isinstance(kwargs.get(name), OakenCache):
                ours = kwargs.pop(name)
                other = kwargs.get(keyword)
                if other is not None and other is not ours and other.get_seq_length() > 0:
                    raise TypeError(
                        f"the OakenCache was passed as {name}=, which {type(module).__name__} in this transformers "
                        f"version does not take ({keyword}= does, and holds another cache): pass {keyword}=cache"
                    )
                kwargs[keyword] = ours
        return args, kwargs

    model.register_forward_pre_hook(hook, with_kwargs=True)
    setattr(model, _GUARDED, True)


class OakenCache(Cache):
    """A transformers ``Cache`` holding the KV cache in the Oaken format, in pages.

    Args:
        thresholds: the model's profile (``oakenkv.calibrate.thresholds.Thresholds``); checked against ``model``
            (``oakenkv.calibrate.match.check_profile_model``: its shape, its weights, the oaken-plus transforms it
            carries).
        model: the transformers model the cache is for. Its config decides the layers (full or sliding) and whether
            decode steps use the packed-page attention (``config._attn_implementation == "oaken"``). The model's
            config alone (``model.config``, the older form) is accepted, but then only the shape can be checked:
            :class:`~oakenkv.calibrate.match.ShapeOnlyWarning` says so when the profile records the weights.
        pool_config: page size and memory budget (default 4 KiB pages, 1 GiB).
        codec: "auto" or "fast" (the numba kernels), or "reference" (plain PyTorch: slow, the same bytes).
        prefill_chunk: tokens encoded per chunk during prefill (default ``oakenkv.store.paged.PREFILL_CHUNK``).
        evict_sliding: release the pages of tokens that left a sliding layer's window (default); False keeps
            them (the sliding mask still hides them).
        residual: keep each layer's newest ``residual`` to ``2 * residual - 1`` tokens unquantized (float32) in a
            full-precision window, encoding the oldest ``residual`` at a time (KIVI's and ``QuantizedCache``'s
            residual; ``oakenkv.store.paged``). 0 (default): the paper's Oaken, every token quantized on arrival. A
            window makes short contexts exact and cheap to decode (no encode per step) and costs 32 bits per
            value of the tokens it holds.
        backend: where the pages live and which kernels run: ``"auto"`` (default) chooses by the device of the
            first tensors the cache stores: host memory and the numba kernels for CPU tensors
            (``oakenkv.store.paged``), the model's GPU and the Triton kernels for CUDA tensors
            (``oakenkv.store.device``, ``docs/gpu.md``); ``"numba"`` or ``"triton"`` force one (``"triton"`` on CPU
            tensors runs the kernels under the Triton interpreter, ``TRITON_INTERPRET=1``: slow, for tests).
        adapt: adaptive grouping (``oakenkv.quant.adapt``): True (its default settings) or an
            :class:`~oakenkv.quant.adapt.AdaptConfig` lets each layer's outer thresholds follow the outlier share of
            the sequence; False (default): the profile's thresholds as they are. Both stores (the same thresholds
            at every epoch).

    A profile with offline transforms (the ``oaken-plus`` preset, ``oakenkv.calibrate.plus``) is only valid on a model
    that carries them: build the cache with :meth:`from_profile`, which folds them in first.

    Example::

        from oakenkv.hf.attention import enable_oaken_attention
        enable_oaken_attention(model)           # optional: decode reads the packed pages directly
        cache = OakenCache.from_profile(model, Thresholds.load("profile.json"))  # or OakenCache(thresholds, model)
        out = model.generate(**inputs, cache=cache, max_new_tokens=32)
        print(cache.kv_bytes())
    """

    @classmethod
    def for_model(
        cls,
        model: Any,
        preset: str = "oaken-plus",
        *,
        tokenizer: Any = None,
        profile: Any = None,
        progress: bool = True,
        static_grids: bool = False,
        static_levels: bool | tuple[float, ...] = False,
        **kwargs: Any,
    ) -> OakenCache:
        """A cache for ``model`` with everything it needs, in one call::

            cache = OakenCache.for_model(model, preset="oaken-plus")
            model.generate(**inputs, past_key_values=cache)   # or cache=cache where transformers takes it

        Finds or makes the model's profile for ``preset`` (``"oaken-plus"``, the default, or the paper's
        ``"oaken"``; ``oakenkv.calibrate.presets.find_profile``): ``profile`` (a path or a loaded profile) when
        given, else one shipped for an embedded model, one cached on disk by content, or a new one profiled on the
        calibration text (a progress bar when ``progress``; ``tokenizer`` only for that, default the one saved
        with the model). Then folds the profile's transforms into ``model`` (in place, once), switches its decode
        steps to the packed-page attention (``oakenkv.hf.attention``), and makes a cache handed to ``model``
        under the keyword this transformers version does not take go where it does (or raise, when another
        cache is there): a cache the model ignores would run unquantized. ``static_grids``: store the profile's
        rows with static middle/inner grids (``OakenConfig.static_grids``: each token's outer scales alone, 0.33
        bit per value less on the default model; as accurate there, less on some models: docs/results.md).
        ``static_levels`` (with ``static_grids``): a few static grids per layer, each row taking the smallest that
        covers its middle values (``OakenConfig.static_levels``: one byte per row more); True for
        ``DEFAULT_STATIC_LEVELS``, or the clip factors themselves. Other
        keyword arguments go to the constructor (``pool_config``, ``residual``, ...). Call it once per
        generation: a cache holds one batch.
        """
        from oakenkv.calibrate.presets import find_profile, remember

        if not isinstance(static_grids, bool):
            raise TypeError(f"static_grids must be True or False, got {static_grids!r}")
        levels: tuple[float, ...] = ()
        if static_levels is not False:
            if not static_grids:
                raise ValueError("static_levels are sizes of the static grid: pass static_grids=True as well")
            levels = DEFAULT_STATIC_LEVELS if static_levels is True else tuple(static_levels)
            OakenConfig(static_grids=True, static_levels=levels)  # validated before the profile is looked for
        found = find_profile(model, preset, tokenizer=tokenizer, profile=profile, progress=progress)
        thresholds = found
        if static_grids and (not found.config.static_grids or levels):  # (the model remembers the profile as found)
            static = found.config.replace(static_grids=True, static_levels=levels)
            thresholds = dataclasses.replace(found, config=static)
        cache = cls.from_profile(model, thresholds, **kwargs)
        remember(model, found)
        enable_oaken_attention(model)
        _guard_cache_keyword(model)
        return cache

    @classmethod
    def from_profile(cls, model: Any, thresholds: Thresholds, **kwargs: Any) -> OakenCache:
        """A cache for ``model`` with ``thresholds``, after folding the profile's transforms into ``model`` (in
        place, once: ``oakenkv.calibrate.plus.apply_profile``). Keyword arguments as for the constructor."""
        from oakenkv.calibrate.plus import apply_profile

        apply_profile(model, thresholds)
        return cls(thresholds, model, **kwargs)

    def __init__(
        self,
        thresholds: Thresholds,
        model: Any,
        *,
        pool_config: PoolConfig | None = None,
        codec: str = "auto",
        prefill_chunk: int = PREFILL_CHUNK,
        evict_sliding: bool = True,
        residual: int = 0,
        backend: str = "auto",
        adapt: bool | AdaptConfig = False,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if not isinstance(adapt, (bool, AdaptConfig)):
            raise TypeError(f"adapt must be True, False or an AdaptConfig, got {type(adapt).__name__}")
        from oakenkv.calibrate.match import check_profile_model, is_model

        if not isinstance(thresholds, Thresholds):
            raise TypeError(f"thresholds must be a Thresholds (Thresholds.load(path)), got {type(thresholds).__name__}")
        if not isinstance(evict_sliding, bool):
            raise TypeError(f"evict_sliding must be True or False, got {evict_sliding!r}")
        check_profile_model(thresholds, model)
        config = model.config if is_model(model) else model
        text = config.get_text_config(decoder=True)
        if is_model(model) and thresholds.transforms is not None and thresholds.transforms.sink_tokens:
            track_padding(model)  # sink tokens are each row's first real tokens (module doc)
        num_layers = text.num_hidden_layers
        num_kv_heads, head_dim = kv_shape(text)
        self.backend = backend
        #: The stores' constructor arguments (``"auto"`` builds the device store when it first sees CUDA tensors).
        self._store_args = (
            thresholds,
            num_layers,
            num_kv_heads,
            head_dim,
            pool_config,
            codec,
            prefill_chunk,
            residual,
        )
        #: Whether the store is chosen (only ``"auto"`` chooses late: at the first update).
        self._store_chosen = backend != "auto"
        #: Adaptive grouping's settings (``oakenkv.quant.adapt``), or None.
        self._adapt = AdaptConfig() if adapt is True else adapt or None
        self.store = self._make_store(backend)
        layers: list[CacheLayerMixin] = []
        for i, kind in enumerate(layer_kinds(text)):
            if kind == "full_attention":
                layers.append(OakenLayer(self.store, i, model_config=config))
            elif kind == "sliding_attention":
                window = text.sliding_window
                layers.append(OakenLayer(self.store, i, window, evict=evict_sliding, model_config=config))
            else:
                raise ValueError(f"OakenCache supports full and sliding attention layers, layer {i} is {kind!r}")
        super().__init__(layers=layers)

    def _make_store(self, backend: str, device: torch.device | None = None) -> Any:
        if backend == "triton":
            from oakenkv.store.device import DeviceKVStore

            return DeviceKVStore(*self._store_args, device=device, adapt=self._adapt)
        return PagedKVStore(*self._store_args, self._adapt)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[Any, Any]:
        if not self._store_chosen:  # backend "auto": CUDA tensors get the device store, CPU ones keep the host's
            self._store_chosen = True
            if key_states.device.type == "cuda":
                starts = self.store.row_starts  # (the prompt's mask, noted before this first update)
                self.store = self._make_store("triton", key_states.device)
                if starts is not None:
                    self.store.set_row_starts(starts)
                for layer in self.layers:
                    layer.store = self.store
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def note_attention_mask(self, mask: Any) -> None:
        """Learn each row's first real token from a forward's 2-D attention mask ``[B, T]`` (module doc; called by
        :func:`track_padding`'s hook). Rows whose sink tokens are already stored keep them; without sink tokens,
        or once every row's are stored, nothing is done."""
        store = self.store
        if not store.sink_tokens or (store.row_starts is not None and self.get_seq_length() >= store._sink_end):
            return
        starts = row_starts_from_mask(mask)
        if starts is not None and (not store.seqs or starts.shape[0] == len(store.seqs)):  # (a mask of these rows)
            store.set_row_starts(starts)

    # The layers are views of one store: batch operations act on the store once, not once per layer.

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.store.reorder([int(i) for i in beam_idx.tolist()])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.store.reorder([int(i) for i in torch.as_tensor(indices).reshape(-1).tolist()])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.store.reorder([j for j in range(self.store.batch_size) for _ in range(repeats)])

    def reset(self) -> None:
        self.store.reset()
        super().reset()

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("OakenCache cannot be cropped yet (assisted decoding is not supported)")

    def kv_bytes(self) -> int:
        """Memory the KV cache holds: pages in use (whole pages) plus management tables."""
        return self.store.stats().total_bytes

    def bits_per_value(self) -> dict[str, float]:
        """Bits per stored value: the format's bytes, and everything held (:meth:`PagedKVStore.bits_per_value`)."""
        return self.store.bits_per_value()

    def stats(self) -> PoolStats:
        return self.store.stats()

    @property
    def batch_size(self) -> int:
        return self.store.batch_size if self.store.seqs else -1


def tensor_bytes(t: Any) -> int:
    """Storage bytes of a tensor, recursing into wrapper tensors (quanto's packed tensors, scales, shifts)."""
    if t is None:
        return 0
    if hasattr(t, "__tensor_flatten__") and type(t) is not torch.Tensor:
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, n)) for n in names)
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    return 0


def kv_bytes(cache: Any) -> int:
    """Bytes of KV state any transformers cache holds (OakenCache: pages in use + tables; others: the tensors of
    its layers, quantized ones included)."""
    if isinstance(cache, OakenCache):
        return cache.kv_bytes()
    total = 0
    for layer in cache.layers:
        for name in ("keys", "values", "_quantized_keys", "_quantized_values"):
            total += tensor_bytes(getattr(layer, name, None))
    return total
