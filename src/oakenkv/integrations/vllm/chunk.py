"""vLLM's own CPU attention kernel over a prompt chunk's dequantized keys and values, in float32.

A prompt's first chunk has no history: its queries attend only to the chunk's own tokens, which the Oaken backend
has just encoded into their blocks and reads back (the codec's numbers, as ``OakenCache`` attends). torch's CPU
flash attention over those floats took about twice what vLLM's own kernel takes for the same work (one thread,
AMD EPYC, 9 query heads over 3 KV heads of 64: 256 tokens 1.95 ms against 0.96 ms; 40 tokens 117 against 56 us;
``benchmarks/bench_vllm_parts.py``), and vLLM's kernel runs in float32 too when its cache is float32: the same
inputs, the same arithmetic up to the order of float sums (measured: within 1e-6 of plain float32 attention,
3e-6 with a soft cap, 1 to 3000 tokens). So :class:`ChunkAttention` copies the chunk's rows into a small float32
cache in vLLM's layout (its ``cpu_attn_reshape_and_cache``, which knows the ISA's layout) and calls
``cpu_attention_with_kv_cache`` on it. A chunk with history keeps the tiled flash loop of
``layout.prefill_attention``: it needs each part's log-sum-exp, which vLLM's kernel does not return.

The backend builds one per layer; :func:`make` imports vLLM's ops and returns None where vLLM, its CPU ops or the
head size are missing (the backend then keeps torch's flash attention).
"""

from __future__ import annotations

import threading

import numpy as np
import torch

#: Tokens per block of the scratch cache (vLLM's CPU kernels take multiples of 32).
BLOCK = 128
#: Head sizes vLLM 0.32's CPU attention supports (``CPUAttentionBackend.get_supported_head_sizes``).
HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

#: vLLM's CPU attention is not safe to call from two threads at once (its working memory is the process's: two
#: concurrent calls gave wrong rows, and NaN keys in the next layer, when the plugin's row threads took a step's
#: prompts in turn): one call at a time, process-wide.
_CALL = threading.Lock()
#: The float32 scratch cache ``[blocks, H_kv, 2 x BLOCK, hd]`` per ``(H_kv, hd)``, shared by every layer (used under
#: ``_CALL`` only): one per layer would hold 30 copies of a long prompt's rows.
_SCRATCH: dict[tuple[int, int], torch.Tensor] = {}


class ChunkAttention:
    """Causal float32 attention of ``S`` queries over the ``S`` key and value rows of the same positions, by vLLM's
    CPU kernel. One per layer; the scratch cache it copies the rows into is the process's (``_SCRATCH``), grown to
    the longest chunk seen."""

    def __init__(self, ops, isa: str, num_heads: int, num_kv_heads: int, head_size: int) -> None:
        self._ops = ops
        self.isa = isa
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_size

    def _cache(self, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = (self.num_kv_heads, self.head_size)
        kv = _SCRATCH.get(key)
        if kv is None or kv.shape[0] < blocks:
            # zeros, and later only finite decoded rows: the kernel reads the unused tail of the last block (masked,
            # but 0 x NaN would still be NaN)
            kv = _SCRATCH[key] = torch.zeros(blocks, self.num_kv_heads, 2 * BLOCK, self.head_size)
        k, v = kv[:blocks].chunk(2, dim=2)
        return k, v

    def __call__(self, query: torch.Tensor, keys: np.ndarray, values: np.ndarray, scale: float, softcap: float):
        """``query`` float32 ``[S, Hq, hd]``; ``keys``, ``values`` float32 ``[S, H_kv * hd]`` (token ``j`` of the
        chunk at row ``j``). Returns float32 ``[S, Hq, hd]``."""
        s = query.shape[0]
        hkv, hd = self.num_kv_heads, self.head_size
        blocks = -(-s // BLOCK)
        ops = self._ops
        k = torch.from_numpy(keys).view(s, hkv, hd)
        v = torch.from_numpy(values).view(s, hkv, hd)
        qsl = torch.tensor([0, s], dtype=torch.int32)
        lens = torch.tensor([s], dtype=torch.int32)
        table = torch.arange(blocks, dtype=torch.int32)[None]
        out = torch.empty(s, self.num_heads, hd, dtype=torch.float32)
        query = query.contiguous()
        with _CALL:
            kc, vc = self._cache(blocks)
            ops.cpu_attn_reshape_and_cache(k, v, kc, vc, torch.arange(s, dtype=torch.int64), self.isa)
            meta = ops.cpu_attn_get_scheduler_metadata(
                1, self.num_heads, hkv, hd, lens, torch.float32, qsl, True, -1, self.isa, False
            )
            ops.cpu_attention_with_kv_cache(
                query, kc, vc, out, qsl, lens, float(scale), True, None, -1, table, float(softcap), meta, None
            )
        return out


def make(num_heads: int, num_kv_heads: int, head_size: int) -> ChunkAttention | None:
    """A :class:`ChunkAttention` for this layer shape, or None where vLLM's CPU ops or the head size are missing."""
    if head_size not in HEAD_SIZES:
        return None
    try:
        import vllm._custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = _get_attn_isa(torch.float32, BLOCK, head_size)
        for name in ("cpu_attention_with_kv_cache", "cpu_attn_reshape_and_cache", "get_scheduler_metadata"):
            getattr(torch.ops._C, name)  # registered by vLLM's CPU extension, or AttributeError / RuntimeError
    except (ImportError, AttributeError, RuntimeError, NotImplementedError):
        return None
    return ChunkAttention(ops, isa, num_heads, num_kv_heads, head_size)
