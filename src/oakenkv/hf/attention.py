"""Decode attention that reads the packed Oaken pages directly, registered in transformers' attention interface.

:func:`enable_oaken_attention` registers ``"oaken"`` in ``transformers.AttentionInterface`` (and its mask in
``AttentionMaskInterface``: the same boolean masks as ``"sdpa"``) and switches a model to it. The attention function
:func:`oaken_attention_forward` then receives either

* :class:`~oakenkv.hf.cache.PackedKV` handles (a decode step on an :class:`~oakenkv.hf.cache.OakenCache`): it runs
  :func:`packed_decode_attention`, a numba kernel that dequantizes key and value rows from the pages inside the
  softmax loop (``oakenkv.kernels.cpu.attention``) and never rebuilds the float history; or
* ordinary tensors (prefill, or any other cache): it calls transformers' SDPA attention unchanged.

:func:`reference_packed_attention` is the slow, obvious path the kernel is tested against: dequantize the whole
history with the reference read path, then float attention.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from numba import get_num_threads

from oakenkv.format.layout import ERROR_MESSAGES, CorruptDataError
from oakenkv.kernels.cpu import attention as attention_cpu
from oakenkv.quant.attention import float_attention, module_is_causal
from oakenkv.store.paged import KEY, VALUE, PagedKVStore

#: The last mask converted by :func:`_keep_mask` and its result. A decode step hands the same mask tensor to every
#: layer of an attention type; converting it once instead of once per layer saves time every step. The entry holds a
#: reference to the tensor, so the ``is`` test cannot be fooled by a recycled object id, and compares its
#: ``_version`` so an in-place change is seen (inference-mode tensors have no version counter: for them the
#: identity alone decides; transformers builds a new mask every forward and never edits one in place). A tuple
#: replaced whole, read once per call: threads decoding at once (two generate calls in a server) never pair one's
#: mask with the other's result (a list updated in place did, about once in 2,000 calls under contention).
_KEEP_CACHE: tuple[Any, ...] = (None, -1, 0, 0, None)


#: All ones, for a step without a mask (:func:`_keep_mask` returns views of it; grown as needed).
_ONES = np.ones(4096, np.uint8)

#: Name under which the packed-page attention is registered in transformers' ``AttentionInterface``.
ATTN_IMPLEMENTATION = "oaken"


@dataclass(frozen=True)
class PackedKV:
    """A handle ``OakenLayer.update`` returns at decode instead of float tensors: where one layer's keys or
    values live. Only the ``"oaken"`` attention function accepts it."""

    store: PagedKVStore
    layer: int
    #: ``KEY`` or ``VALUE``.
    kind: int
    #: Tokens stored (the current one included), in the pages and the full-precision window.
    num_tokens: int

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The shape the float tensor would have: ``[B, H, T, hd]``."""
        s = self.store
        return (s.batch_size, s.num_kv_heads, self.num_tokens, s.head_dim)


def _version(t: torch.Tensor) -> int:
    return -2 if t.is_inference() else t._version


def _keep_mask(attention_mask: torch.Tensor | None, batch: int, num_tokens: int) -> np.ndarray:
    """uint8 ``[B, T]``: 1 where the single query token may attend, from a bool or additive 4-D mask (read only)."""
    global _KEEP_CACHE, _ONES
    if attention_mask is None:  # (a view of one all-ones buffer: never written, as every cached mask)
        ones = _ONES
        if ones.size < batch * num_tokens:
            ones = _ONES = np.ones(max(2 * ones.size, batch * num_tokens), np.uint8)
        return ones[: batch * num_tokens].reshape(batch, num_tokens)
    c = _KEEP_CACHE
    if c[0] is attention_mask and c[1] == _version(attention_mask) and c[2] == batch and c[3] == num_tokens:
        return c[4]
    keep = _convert_mask(attention_mask, batch, num_tokens)
    _KEEP_CACHE = (attention_mask, _version(attention_mask), batch, num_tokens, keep)
    return keep


def _convert_mask(attention_mask: torch.Tensor, batch: int, num_tokens: int) -> np.ndarray:
    m = attention_mask
    if m.dim() != 4 or m.shape[-2] != 1 or m.shape[1] != 1:
        raise ValueError(f"decode attention expects a [B, 1, 1, T] mask, got {tuple(m.shape)}")
    m = m[:, 0, 0, :]
    if m.shape[-1] != num_tokens:
        raise ValueError(f"the mask covers {m.shape[-1]} tokens but the cache holds {num_tokens}")
    keep = m if m.dtype == torch.bool else m > torch.finfo(m.dtype).min / 2
    return keep.expand(batch, num_tokens).to(torch.uint8).contiguous().numpy()


def packed_decode_attention(
    query: torch.Tensor,
    key: PackedKV,
    value: PackedKV,
    attention_mask: torch.Tensor | None,
    scaling: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of one query token per row over a layer's packed pages.

    Args:
        query: ``[B, Hq, 1, hd]`` float (post-RoPE); ``Hq`` a multiple of the KV heads (GQA).
        key, value: the layer's :class:`PackedKV` handles (``value.kind == VALUE``).
        attention_mask: ``[B, 1, 1, T]`` bool (True = attend) or additive float, or None (attend to all).
        scaling: the softmax scale; softcap: logit soft cap (Gemma 2 style) or None.

    Returns:
        ``[B, 1, Hq, hd]`` in ``query``'s dtype (transformers' attention-output layout).
    """
    store = key.store
    if getattr(store, "on_device", False):
        return _device_attention(query, key, value, attention_mask, scaling, softcap)
    if key.kind != KEY or value.kind != VALUE or value.store is not store or value.layer != key.layer:
        raise ValueError("packed_decode_attention needs the key and value handles of one layer")
    b, hq, s, hd = query.shape
    if s != 1:
        raise ValueError(f"packed decode attention takes one query token per row, got {s}")
    if hd != store.head_dim or hq % store.num_kv_heads or b != store.batch_size:
        raise ValueError(
            f"query [B={b}, Hq={hq}, 1, hd={hd}] does not fit the cache (batch {store.batch_size}, "
            f"{store.num_kv_heads} KV heads, head_dim {store.head_dim})"
        )
    if store.config.scale_dtype != "float16" or _mask_has_bias(attention_mask):
        # The kernel reads fp16 scales and keep masks; fp32 scales and a mask carrying a bias (ALiBi) take the
        # reference path (correct, slower).
        return reference_packed_attention(query, key, value, attention_mask, scaling, softcap)
    t = key.num_tokens
    n_win = store.window_len[key.layer]
    paged = store.num_tokens(key.layer)
    if paged + n_win != t:
        raise RuntimeError(f"the cache holds {paged} + {n_win} tokens (pages + window), the handle says {t}")
    keep = _keep_mask(attention_mask, b, t)
    if query.dtype == torch.float32 and query.is_contiguous():
        q = np.ascontiguousarray(query.detach().numpy().reshape(b, hq, hd))  # no copy when S == 1 is contiguous
    else:
        q = query[:, :, 0, :].detach().to(torch.float32).contiguous().numpy()
    q = store.rotate_queries(key.layer, q)  # oaken-plus: the pages and the window hold keys rotated per head
    out = np.empty((b, 1, hq, hd), dtype=np.float32)
    out3 = out.reshape(b, hq, hd)
    lse = np.empty((b, hq), dtype=np.float32)
    if paged:
        view = store.layer_view(key.layer)
        if view.num_tokens != paged:
            raise RuntimeError(f"page tables hold {view.num_tokens} tokens, the store says {paged}")
        page_keep = keep if not n_win else np.ascontiguousarray(keep[:, :paged])
        # the sink tokens are read at 16 bits (store module doc), not from the pages: each row's own positions
        # (after its left padding); the mask's array is cached for the next layers, so it is never written
        split = store.split_sink_keep(page_keep) if store.sink_tokens else None
        if split is not None:
            page_keep, sink_keep = split
        parallel, splits = attention_cpu.split_work(b, paged, get_num_threads())
        kernel = attention_cpu.packed_decode_attention if parallel else attention_cpu.packed_decode_attention_serial
        status = np.zeros(b * splits, dtype=np.int64)
        kernel(q, page_keep, np.float32(scaling), np.float32(softcap or 0.0), splits, out3, status, lse, *view)
        bad = np.flatnonzero(status)
        if bad.size:
            raise CorruptDataError(f"layer {key.layer}: {ERROR_MESSAGES[int(status[bad[0]])]} (packed KV pages)")
        if split is not None:  # the sink tokens' part of the softmax, merged through the kernel's log-sum-exp
            sinks = store.sinks[key.layer].view(np.uint16)
            attention_cpu.merge_sinks(q, sink_keep, sinks, np.float32(scaling), np.float32(softcap or 0.0), out3, lse)
    else:  # everything is in the window: its softmax alone
        out3[:] = 0.0
        lse[:] = -np.inf
    if n_win:  # the full-precision window's part, merged the same way
        window_keep = np.ascontiguousarray(keep[:, paged:]) if paged else keep
        keys_t, values = store.windows[key.layer]
        parallel = b * n_win >= attention_cpu.PARALLEL_MIN_TOKENS and get_num_threads() > 1
        merge = attention_cpu.merge_window_parallel if parallel else attention_cpu.merge_window
        merge(q, window_keep, keys_t, values, np.float32(scaling), np.float32(softcap or 0.0), out3, lse)
    result = torch.from_numpy(out)
    return result if query.dtype == torch.float32 else result.to(query.dtype)


#: The last mask :func:`_mask_has_bias` looked at, its version and the answer (as :data:`_KEEP_CACHE`).
_BIAS_CACHE: tuple[Any, ...] = (None, -1, False)


def _mask_has_bias(attention_mask: torch.Tensor | None) -> bool:
    """Whether an additive mask carries more than "attend" / "do not attend": a head dimension or finite values
    other than 0 (Falcon's ALiBi comes as its position bias added to the mask, ``[B, heads, S, T]``). The packed
    kernels read a mask as a keep mask of one row per sequence, so such a mask takes the float path."""
    if attention_mask is None or attention_mask.dtype == torch.bool:
        return False
    global _BIAS_CACHE
    c = _BIAS_CACHE
    if c[0] is attention_mask and c[1] == _version(attention_mask):
        return c[2]
    m = attention_mask
    low = torch.finfo(m.dtype).min / 2
    bias = (m.dim() == 4 and m.shape[1] > 1) or bool(((m > low) & (m != 0)).any())
    _BIAS_CACHE = (attention_mask, _version(attention_mask), bias)
    return bias


def _device_attention(query, key: PackedKV, value: PackedKV, attention_mask, scaling: float, softcap) -> torch.Tensor:
    """Attention over a device store's pages (``oakenkv.store.device.DeviceKVStore.attention``): ``[B, S, Hq, hd]``."""
    store = key.store
    if key.kind != KEY or value.kind != VALUE or value.store is not store or value.layer != key.layer:
        raise ValueError("packed attention needs the key and value handles of one layer")
    if key.num_tokens != store.num_tokens(key.layer):
        raise RuntimeError(f"the cache holds {store.num_tokens(key.layer)} tokens, the handle says {key.num_tokens}")
    return store.attention(query, key.layer, attention_mask, scaling, softcap)


def load_kernels() -> float:
    """Load every decode-step kernel (the single-token append, both attention kernels, the sink and window merges) from
    numba's on-disk cache now, by running them on a tiny store, so that the first decode step of a generation does
    not pay it; returns the seconds it took. (Kernels are typed by dtypes and ranks, not sizes: a tiny store's call
    loads the code a model's will run.)"""
    import time

    from oakenkv.calibrate.thresholds import GroupThresholds, ModelFingerprint, Thresholds
    from oakenkv.format.config import OakenConfig
    from oakenkv.store.paged import PagedKVStore

    t0 = time.perf_counter()
    thr = GroupThresholds(-2.0, -0.1, 0.1, 2.0)
    store = PagedKVStore(Thresholds(OakenConfig(), ModelFingerprint("warm-up", 1, 1, 4), (thr,), (thr,)), 1, 1, 4)
    x = torch.linspace(-3.0, 3.0, 4).reshape(1, 1, 1, 4)
    store.append(0, x, x)
    store.append_token(0, x, x)
    q = np.ones((1, 1, 4), np.float32)
    keep = np.ones((1, 2), np.uint8)
    for kernel in (attention_cpu.packed_decode_attention, attention_cpu.packed_decode_attention_serial):
        out = np.empty((1, 1, 4), np.float32)
        lse = np.empty((1, 1), np.float32)
        kernel(q, keep, np.float32(1.0), np.float32(0.0), 1, out, np.zeros(1, np.int64), lse, *store.layer_view(0))
    sinks = np.zeros((1, 2, 1, 4), np.float16).view(np.uint16)
    attention_cpu.merge_sinks(q, np.ones((1, 1), np.uint8), sinks, np.float32(1.0), np.float32(0.0), out, lse)
    keys_t, values = np.zeros((1, 1, 4, 1), np.float32), np.zeros((1, 1, 1, 4), np.float32)
    for merge in (attention_cpu.merge_window, attention_cpu.merge_window_parallel):
        merge(q, np.ones((1, 1), np.uint8), keys_t, values, np.float32(1.0), np.float32(0.0), out, lse)
    return time.perf_counter() - t0


def reference_packed_attention(
    query: torch.Tensor,
    key: PackedKV,
    value: PackedKV,
    attention_mask: torch.Tensor | None,
    scaling: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """The slow reference of :func:`packed_decode_attention`: dequantize the whole layer, then float attention.

    Same arguments and result (``[B, 1, Hq, hd]``).
    """
    store = key.store
    k = store.read(key.layer, KEY)  # [B, H, T, hd]
    v = store.read(value.layer, VALUE)
    if store.window_tokens(key.layer):  # the full-precision window's tokens follow the pages'
        k = torch.cat([k, store.window(key.layer, KEY)], dim=2)
        v = torch.cat([v, store.window(key.layer, VALUE)], dim=2)
    return float_attention(query, k, v, attention_mask, scaling, softcap)


def oaken_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor | PackedKV,
    value: torch.Tensor | PackedKV,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention-interface function: packed pages at decode, SDPA for everything else."""
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("learned attention sinks (s_aux) are not supported by the packed-page attention")
    if isinstance(key, PackedKV):
        if dropout:
            raise ValueError("packed decode attention is for inference; dropout must be 0")
        scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
        if _mask_has_bias(attention_mask):  # (ALiBi in the mask: the kernels take keep masks; the float read is exact)
            _warn_bias(module)
            return reference_packed_attention(query, key, value, attention_mask, scaling, softcap), None
        if getattr(key.store, "on_device", False):  # the device store: decode and prefill over its pages
            return _device_attention(query, key, value, attention_mask, scaling, softcap), None
        return packed_decode_attention(query, key, value, attention_mask, scaling, softcap), None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if softcap:
        # SDPA has no soft cap; use the eager formula (Gemma 2 style models) on the float tensors.
        scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
        causal = module_is_causal(module, kwargs)
        return float_attention(query, key, value, attention_mask, scaling, softcap, is_causal=causal), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def _warn_bias(module: torch.nn.Module) -> None:
    """Say why a layer reads its pages back to floats (Python's warning filters show it once per place by
    default; the float path's cost dwarfs the call)."""
    warnings.warn(
        f"{type(module).__name__} adds a bias to its attention mask (ALiBi): the packed-page kernels read masks as "
        "keep masks, so its cached tokens are read back to floats and attended in float32 (correct, slower)",
        stacklevel=3,
    )


def register_oaken_attention() -> None:
    """Register ``"oaken"`` in transformers' attention and attention-mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, oaken_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


def enable_oaken_attention(model: Any) -> str:
    """Switch ``model`` to the packed-page attention; returns the implementation it used before.

    Prefill and non-Oaken caches keep running SDPA, so the model stays correct with any cache.
    """
    if any(isinstance(getattr(m, "sinks", None), torch.Tensor) for m in model.modules()):
        raise NotImplementedError(
            f"{type(model).__name__} has learned attention sinks (gpt-oss style), which the packed-page attention "
            "does not add: oakenkv does not support this model"
        )
    register_oaken_attention()
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return previous


@contextlib.contextmanager
def oaken_attention(model: Any) -> Iterator[Any]:
    """Context manager: the model uses the packed-page attention inside the block, its previous one after."""
    previous = enable_oaken_attention(model)
    try:
        yield model
    finally:
        model.set_attn_implementation(previous)
