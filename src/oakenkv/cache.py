"""`OakenCache`: a transformers 5.x ``Cache`` that stores keys and values in the Oaken format, in pages.

Built on transformers' own cache types (``Cache`` / ``CacheLayerMixin``, ``transformers/cache_utils.py``): one
:class:`OakenLayer` per decoder layer, all sharing one :class:`PagedKVStore` (a :class:`~oakenkv.pages.PagePool`
plus the codec and the thresholds). Each batch row is one pool sequence with ``2 * num_layers`` streams
(``stream = 2 * layer + 0`` for keys, ``+ 1`` for values); a token's vector is all KV heads of the layer
(``D = num_kv_heads * head_dim``, granularity "token", the paper's).

What ``update`` returns
-----------------------
* **Prefill** (``S > 1``), or any step when the model does not use the ``"oaken"`` attention: the dequantized keys
  and values of the whole history plus the new tokens (``[B, H, T, hd]``), so stock attention runs on exactly what
  is stored (the paper's harness also attends over quantized K/V). The new tokens are encoded chunk by chunk
  (``prefill_chunk`` tokens), so the encoder's temporaries stay small; the float tensors returned for one layer
  are the size of that layer's unquantized cache and are dropped after its attention, so peak memory never
  exceeds that of an unquantized cache.
* **Decode** (``S == 1``) with the ``"oaken"`` attention (:func:`oakenkv.attention.enable_oaken_attention`):
  lightweight :class:`PackedKV` handles; the attention function reads the packed pages directly.

Sliding-window layers (Gemma 3: 5 of every 6 layers, window 512) are quantized and paged like full layers; the
sliding mask that transformers builds limits what attention sees, and each update releases the pages that hold
only tokens no query can reach any more (``PagedKVStore.evict_before``, whole pages: a sliding layer keeps the
window plus at most one page of records before it). The tables keep their per-token entries (2 bytes of
sparse length per token and stream) and evicted tokens read as zeros in the float path; the kernel never reads
them (the mask hides them). ``OakenCache(..., evict_sliding=False)`` keeps everything.

Running out of the pool's budget raises :class:`~oakenkv.pages.PoolExhaustedError` from the layer that could not
append; that layer and every other sequence of the pool are unchanged, but the layers before it already hold the
step's tokens, so a cache that raised must be ``reset()`` (or dropped) before it is used again.

Beam search and batch selection are table operations: a reordered row is a :meth:`~oakenkv.pages.PagePool.fork`
of its source sequence (pages shared, copied on write), never a copy of the KV bytes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from oakenkv.format import EncodedBatch, from_records, record_size, scale_bytes, to_records
from oakenkv.pages import PagePool, PoolConfig, PoolStats
from oakenkv.thresholds import Thresholds

#: Name under which the packed-page attention is registered in transformers' ``AttentionInterface``.
ATTN_IMPLEMENTATION = "oaken"

KEY, VALUE = 0, 1
_KINDS = ("key", "value")


# ------------------------------------------------------------------------------------------------ codec glue


def _codec_functions(kind: str):
    """``(encode, decode)`` of the codec: the fast numba pair, or the plain PyTorch reference pair.

    Both have the signatures of ``oakenkv.codec.encode`` / ``decode`` and give identical bytes and numbers.
    """
    if kind not in ("auto", "fast", "reference"):
        raise ValueError(f"codec must be 'auto', 'fast' or 'reference', got {kind!r}")
    if kind in ("auto", "fast"):
        try:
            import oakenkv.kernels.cpu  # noqa: F401  (fast kernels present?)
            from oakenkv.codec import decode, encode

            return encode, decode
        except ImportError:
            if kind == "fast":
                raise
    from oakenkv import reference

    return reference.encode, reference.decode


#: Below this many rows a numba call runs on one thread: waking the thread pool costs more than the work, and on
#: a loaded machine a parallel launch for one decode token was measured at ~40 ms against 0.03 ms serial.
SERIAL_BELOW_ROWS = 1024


@contextlib.contextmanager
def serial_numba(active: bool = True) -> Iterator[None]:
    """Run the numba kernels called inside the block on the calling thread only (when ``active``)."""
    if not active:
        yield
        return
    import numba

    previous = numba.get_num_threads()
    if previous == 1:
        yield
        return
    numba.set_num_threads(1)
    try:
        yield
    finally:
        numba.set_num_threads(previous)


# ------------------------------------------------------------------------------------------------ shared store


class PagedKVStore:
    """The state all layers of one :class:`OakenCache` share: the page pool, one sequence per batch row, the codec.

    Args:
        thresholds: the model's profile (per layer and kind).
        num_layers, num_kv_heads, head_dim: the decoder's KV shape.
        pool_config: page size and memory budget.
        codec: "auto" (fast kernels when installed), "fast" or "reference".
        prefill_chunk: tokens encoded per chunk of a long update.
    """

    def __init__(
        self,
        thresholds: Thresholds,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        pool_config: PoolConfig | None = None,
        codec: str = "auto",
        prefill_chunk: int = 256,
    ) -> None:
        if thresholds.num_layers != num_layers:
            raise ValueError(f"thresholds hold {thresholds.num_layers} layers, the model has {num_layers}")
        config = thresholds.config
        if config.granularity != "token":
            raise ValueError("OakenCache stores one vector per token and layer: it needs granularity='token'")
        if config.key_position != "post_rope":
            raise ValueError(
                "OakenCache stores keys after RoPE, but these thresholds were profiled before RoPE "
                "(key_position='pre_rope'); profile with key_position='post_rope'"
            )
        if not isinstance(prefill_chunk, int) or prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be a positive int, got {prefill_chunk!r}")
        self.thresholds = thresholds
        self.config = config
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dim = num_kv_heads * head_dim
        self.rec_size = record_size(self.dim, config)
        self.pool = PagePool(pool_config)
        self.encode, self.decode = _codec_functions(codec)
        from oakenkv.codec import encode as fast_encode

        #: Whether the numba kernels are in use (then a decode step takes the fused single-token path).
        self.fast = self.encode is fast_encode
        self._token_scratch: tuple[np.ndarray, ...] | None = None
        self.prefill_chunk = prefill_chunk
        #: Pool sequence id of each batch row.
        self.seqs: list[int] = []
        #: float32 ``[num_layers, 2, 4]``: ``(to_lo, ti_lo, ti_hi, to_hi)`` per layer and kind, for kernels.
        self.thr = np.array(
            [[thresholds.layer(i, k).as_tuple() for k in _KINDS] for i in range(num_layers)], dtype=np.float32
        )

    @property
    def batch_size(self) -> int:
        return len(self.seqs)

    def ensure_batch(self, batch_size: int) -> None:
        if not self.seqs:
            self.seqs = [self.pool.new_sequence(2 * self.num_layers) for _ in range(batch_size)]
        elif batch_size != len(self.seqs):
            raise ValueError(f"the cache holds {len(self.seqs)} sequences but got a batch of {batch_size}")

    def num_tokens(self, layer: int) -> int:
        return self.pool.num_tokens(self.seqs[0], 2 * layer) if self.seqs else 0

    def append(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[EncodedBatch, EncodedBatch]:
        """Encode and store new tokens of one layer for every row, atomically for the layer.

        Args:
            keys, values: ``[B, H, S, hd]`` float (any float dtype; quantized in float32).

        Returns:
            The encoded keys and values, rows ordered ``(b, s)``: ``[B * S]`` rows of ``D`` values.
        """
        b, h, s, hd = keys.shape
        if (h, hd) != (self.num_kv_heads, self.head_dim) or values.shape != keys.shape:
            raise ValueError(
                f"expected keys and values [B, {self.num_kv_heads}, S, {self.head_dim}], got "
                f"{tuple(keys.shape)} and {tuple(values.shape)}"
            )
        self.ensure_batch(b)
        encoded = []
        items = []
        # One serial section for both kinds: switching numba's thread count costs ~20 us a call.
        with serial_numba(b * s < SERIAL_BELOW_ROWS):
            for kind, x in ((KEY, keys), (VALUE, values)):
                # [B, H, S, hd] -> [B * S, H * hd]: one row per token, all heads of the layer (granularity
                # "token"). The copy is done by numpy on this thread: torch's multi-threaded copy of these small
                # tensors was measured at ~27 ms per call on a loaded 2-core machine (thread wake-ups).
                x32 = x.detach().to(torch.float32).numpy()
                rows = torch.from_numpy(np.ascontiguousarray(x32.transpose(0, 2, 1, 3)).reshape(b * s, self.dim))
                enc = self.encode(rows, self.thresholds.layer(layer, _KINDS[kind]), self.config)
                encoded.append(enc)
                dense, sparse, offs = to_records(enc)
                for r in range(b):
                    o = offs[r * s : (r + 1) * s + 1]
                    items.append(
                        (self.seqs[r], 2 * layer + kind, dense[r * s : (r + 1) * s], sparse[o[0] : o[-1]], o - o[0])
                    )
        self.pool.append_many(items)
        return encoded[0], encoded[1]

    def append_token(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store one new token ``[B, H, 1, hd]`` of one layer for every row (a decode step), atomically.

        Same bytes as :meth:`append`; one serial numba call encodes the ``2 B`` rows straight into page records
        and the pool appends them with scalar bookkeeping (:meth:`PagePool.append_token`). Needs the fast codec.
        """
        from oakenkv.format import ERROR_MESSAGES, sparse_capacity
        from oakenkv.kernels.cpu import encode_records

        b, h, s, hd = keys.shape
        if (h, s, hd) != (self.num_kv_heads, 1, self.head_dim) or values.shape != keys.shape:
            raise ValueError(
                f"append_token expects keys and values [B, {self.num_kv_heads}, 1, {self.head_dim}], got "
                f"{tuple(keys.shape)} and {tuple(values.shape)}"
            )
        self.ensure_batch(b)
        scratch = self._token_scratch
        if scratch is None or scratch[0].shape[0] != 2 * b:
            m = 2 * b
            scratch = (
                np.empty((m, self.dim), np.float32),
                np.empty((m, self.rec_size), np.uint8),
                np.empty((m, sparse_capacity(self.dim)), np.uint8),
                np.empty(m, np.int64),
                np.empty((m, 4), np.float32),
            )
            self._token_scratch = scratch
        rows, records, sparse, counts, thr = scratch
        # [B, H, 1, hd] -> [B, H * hd] rows (keys first, then values); numpy copies on this thread (see append).
        rows[:b] = keys.detach().to(torch.float32).numpy().reshape(b, self.dim)
        rows[b:] = values.detach().to(torch.float32).numpy().reshape(b, self.dim)
        thr[:b] = self.thr[layer, KEY]
        thr[b:] = self.thr[layer, VALUE]
        cfg = self.config
        fp16 = cfg.scale_dtype == "float16"
        encode_records(rows, thr, cfg.inner_bits, cfg.outer_bits, fp16, scale_bytes(cfg), records, sparse, counts)
        bad = np.flatnonzero(counts < 0)
        if bad.size:
            r = int(bad[0])
            kind = "keys" if r < b else "values"
            raise ValueError(f"cannot encode the {kind} of row {r % b}: {ERROR_MESSAGES[int(-counts[r])]}")
        targets = [(seq, 2 * layer + KEY) for seq in self.seqs] + [(seq, 2 * layer + VALUE) for seq in self.seqs]
        self.pool.append_token(targets, records, sparse, counts)

    def read(self, layer: int, kind: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dequantize one layer's whole stored keys or values (the reference read path): ``[B, H, T, hd]``.

        Tokens a sliding window evicted (:meth:`evict_before`) read as zeros; the sliding mask hides them.
        """
        out = []
        for seq in self.seqs:
            stream = 2 * layer + kind
            table = self.pool.table(seq, stream)
            start = table.evicted_before
            dense = self.pool.read_dense(seq, stream, start)
            sparse, offs = self.pool.read_sparse(seq, stream, start)
            enc = from_records(dense, sparse, offs, self.dim, self.config)
            thr = self.thresholds.layer(layer, _KINDS[kind])
            with serial_numba(enc.num_rows < SERIAL_BELOW_ROWS):
                x = self.decode(enc, thr, self.config) if enc.num_rows else torch.zeros(0, self.dim)
            if start:
                x = torch.cat([torch.zeros(start, self.dim, dtype=x.dtype), x])
            out.append(x.reshape(-1, self.num_kv_heads, self.head_dim).permute(1, 0, 2))
        return torch.stack(out).to(dtype)

    def evict_before(self, layer: int, token: int) -> int:
        """Release the pages of one layer (keys and values, every row) that hold only tokens below ``token``;
        returns the table slots released. For sliding-window layers: no query will attend to those tokens."""
        released = 0
        for seq in self.seqs:
            for kind in (KEY, VALUE):
                released += self.pool.evict_before(seq, 2 * layer + kind, token)
        return released

    def reorder(self, index: list[int]) -> None:
        """New row ``i`` = old row ``index[i]`` (beam search, batch selection): forks and frees, no KV copies."""
        if not self.seqs:
            return
        if any(not 0 <= j < len(self.seqs) for j in index):
            raise IndexError(f"reorder index {index} out of range for {len(self.seqs)} rows")
        used: set[int] = set()
        new = []
        for j in index:
            if j in used:
                new.append(self.pool.fork(self.seqs[j]))
            else:
                used.add(j)
                new.append(self.seqs[j])
        for j, seq in enumerate(self.seqs):
            if j not in used:
                self.pool.free(seq)
        self.seqs = new

    def reset(self) -> None:
        for seq in self.seqs:
            self.pool.free(seq)
        self.seqs = []

    def stats(self) -> PoolStats:
        return self.pool.stats()


@dataclass(frozen=True)
class PackedKV:
    """A handle ``OakenLayer.update`` returns at decode instead of float tensors: where one layer's keys or
    values live. Only the ``"oaken"`` attention function accepts it."""

    store: PagedKVStore
    layer: int
    #: ``KEY`` or ``VALUE``.
    kind: int
    #: Tokens stored (the current one included).
    num_tokens: int

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The shape the float tensor would have: ``[B, H, T, hd]``."""
        s = self.store
        return (s.batch_size, s.num_kv_heads, self.num_tokens, s.head_dim)


# ------------------------------------------------------------------------------------------------ layers


class OakenLayer(CacheLayerMixin):
    """One decoder layer of an :class:`OakenCache`; its keys and values live in the shared store's pages."""

    is_compileable = False
    # Cropping would need truncating page tables; assisted decoding is not supported yet.
    is_croppable = False

    def __init__(
        self, store: PagedKVStore, layer_idx: int, sliding_window: int | None = None, evict: bool = True
    ) -> None:
        super().__init__()
        self.store = store
        self.layer_idx = layer_idx
        self.is_sliding = sliding_window is not None
        self.sliding_window = sliding_window
        #: Sliding layers: release the pages of tokens that left the window (module docstring).
        self.evict = evict
        #: Whether decode steps return :class:`PackedKV` handles (set by the cache from the model's attention).
        self.packed_decode = False

    def __repr__(self) -> str:
        return f"OakenLayer(layer={self.layer_idx}, tokens={self.get_seq_length()}, sliding={self.sliding_window})"

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.dtype = key_states.dtype
        if self.device.type != "cpu":
            raise ValueError(f"OakenCache runs on CPU (its pages are host memory), got tensors on {self.device}")
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor | PackedKV, torch.Tensor | PackedKV]:
        """Store new tokens ``[B, H, S, hd]``; return what the attention function needs (module docstring)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        store = self.store
        past = store.num_tokens(self.layer_idx)
        s = key_states.shape[2]
        enc_k = enc_v = None
        chunk = store.prefill_chunk
        if s == 1 and past and store.fast:  # a decode step: the single-token path
            store.append_token(self.layer_idx, key_states, value_states)
        else:
            for start in range(0, s, chunk):
                ks, vs = key_states[:, :, start : start + chunk], value_states[:, :, start : start + chunk]
                encoded = store.append(self.layer_idx, ks, vs)
                if s <= chunk:
                    enc_k, enc_v = encoded
        total = past + s
        if s == 1 and self.packed_decode:
            result = (PackedKV(store, self.layer_idx, KEY, total), PackedKV(store, self.layer_idx, VALUE, total))
        elif past == 0 and enc_k is not None:
            # The whole history is what we just encoded: decode it directly instead of reading the pages back.
            b = key_states.shape[0]
            with serial_numba(b * s < SERIAL_BELOW_ROWS):
                # [B * S, D] -> a [B, H, S, hd] view (no copy; attention accepts strided inputs).
                result = tuple(
                    store.decode(enc, store.thresholds.layer(self.layer_idx, name), store.config)
                    .view(b, s, store.num_kv_heads, store.head_dim)
                    .permute(0, 2, 1, 3)
                    .to(key_states.dtype)
                    for enc, name in ((enc_k, "key"), (enc_v, "value"))
                )
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

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Every stored token is returned (sliding layers too: the sliding mask hides what left the window).
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self.store.num_tokens(self.layer_idx)

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


class OakenCache(Cache):
    """A transformers ``Cache`` holding the KV cache in the Oaken format, in pages.

    Args:
        thresholds: the model's profile (``oakenkv.thresholds.Thresholds``); checked against ``config``.
        config: the model's config (``model.config``); decides the layers (full or sliding) and whether decode
            steps use the packed-page attention (``config._attn_implementation == "oaken"``).
        pool_config: page size and memory budget (default 4 KiB pages, 1 GiB).
        codec: "auto" (fast kernels when installed), "fast" or "reference".
        prefill_chunk: tokens encoded per chunk during prefill.
        evict_sliding: release the pages of tokens that left a sliding layer's window (default); False keeps
            them (the sliding mask still hides them).

    Example::

        from oakenkv.attention import enable_oaken_attention
        enable_oaken_attention(model)           # optional: decode reads the packed pages directly
        cache = OakenCache(thresholds, model.config)
        out = model.generate(**inputs, cache=cache, max_new_tokens=32)
        print(cache.kv_bytes())
    """

    def __init__(
        self,
        thresholds: Thresholds,
        config: Any,
        *,
        pool_config: PoolConfig | None = None,
        codec: str = "auto",
        prefill_chunk: int = 256,
        evict_sliding: bool = True,
    ) -> None:
        text = config.get_text_config(decoder=True)
        thresholds.check_model(text)
        num_layers = text.num_hidden_layers
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        self.store = PagedKVStore(
            thresholds, num_layers, text.num_key_value_heads, head_dim, pool_config, codec, prefill_chunk
        )
        self._model_config = config
        layer_types = getattr(text, "layer_types", None) or ["full_attention"] * num_layers
        layers: list[CacheLayerMixin] = []
        for i, kind in enumerate(layer_types):
            if kind == "full_attention":
                layers.append(OakenLayer(self.store, i))
            elif kind == "sliding_attention":
                layers.append(OakenLayer(self.store, i, sliding_window=text.sliding_window, evict=evict_sliding))
            else:
                raise ValueError(f"OakenCache supports full and sliding attention layers, layer {i} is {kind!r}")
        super().__init__(layers=layers)

    # The layers are views of one store: batch operations act on the store once, not once per layer.

    def update(self, key_states, value_states, layer_idx: int, *args: Any, **kwargs: Any):
        self.layers[layer_idx].packed_decode = self._model_config._attn_implementation == ATTN_IMPLEMENTATION
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

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

    def stats(self) -> PoolStats:
        return self.store.stats()

    @property
    def batch_size(self) -> int:
        return self.store.batch_size if self.store.seqs else -1
