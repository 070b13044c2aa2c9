"""The Oaken attention backend for vLLM 0.32 (``vllm/v1/attention/backend.py``'s interface).

- :class:`OakenAttentionBackend`: declares what it supports and, through ``customize_spec``, makes each layer's
  KV page a ``uint8`` block of exactly :class:`~oakenkv.integrations.vllm.layout.BlockLayout`'s bytes, so vLLM's
  block count is computed from Oaken's real size.
- :class:`OakenMetadataBuilder`: per step, the requests' query ranges, lengths and block tables; the decode
  kernel's page tables are built once per step and shared by every layer.
- :class:`OakenAttentionImpl`: ``do_kv_cache_update`` encodes the step's new keys and values with the codec into
  their block slots; ``forward`` runs the packed-page decode kernel for one-token queries and, for longer queries
  (prefill, chunked prefill, prefix-cache hits), dequantizes the request's blocks with the codec and runs SDPA.

Everything runs on the CPU, in the worker process; ``docs/vllm.md`` has the design.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import numpy as np
import torch
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.logger import init_logger
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout, SlidingWindowSpec

from oakenkv.integrations.vllm import BACKEND_NAME, ENV_PROFILE, Settings, load_profile
from oakenkv.integrations.vllm.layout import BlockLayout, BlockWriter, DecodeBatch, dequantize, pool_view

logger = init_logger(__name__)


def _settings() -> Settings:
    settings = Settings.from_env()
    if settings is None:
        raise RuntimeError(f"the Oaken attention backend needs {ENV_PROFILE} (a profile from `oakenkv profile`)")
    return settings


def _numba_threads(n: int) -> None:
    """Run this thread's numba kernels on ``n`` threads (the codec's batch decode is a parallel kernel): one by
    default, beside vLLM's torch thread, instead of numba's OpenMP pool of one thread per core."""
    import numba

    if numba.get_num_threads() != n:
        numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))


def layout_for(num_kv_heads: int, head_size: int, block_size: int) -> BlockLayout:
    """The block layout of a layer with ``num_kv_heads x head_size`` values per token (this rank's heads)."""
    settings = _settings()
    thr = load_profile(settings.profile)
    return BlockLayout.make(num_kv_heads * head_size, block_size, thr.config, settings.sparse_bytes_per_token)


class OakenAttentionBackend(AttentionBackend):
    """Oaken KV cache: 4-bit dense nibbles + fp16 scales + 8-bit COO outliers per token, in vLLM's blocks."""

    accept_output_buffer: bool = True
    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[OakenAttentionImpl]:
        return OakenAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[OakenMetadataBuilder]:
        return OakenMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[int | MultipleOf]:
        return [MultipleOf(1)]  # any block size: the layout is computed for it

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBHNC,)

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        """One ``uint8`` page per block holding the block's Oaken K and V (``BlockLayout``): vLLM then divides
        its KV memory by Oaken's real block size."""
        if spec.dtype == torch.uint8 and spec.state_content_bytes is not None:
            return spec  # already ours
        if isinstance(spec, SlidingWindowSpec) or getattr(spec, "sliding_window", None) is not None:
            raise NotImplementedError("the Oaken vLLM backend does not support sliding-window attention layers yet")
        if spec.head_size_v != spec.head_size:
            raise NotImplementedError("the Oaken vLLM backend needs keys and values of the same head size")
        layout = layout_for(spec.num_kv_heads, spec.head_size, spec.block_size)
        return replace(
            spec,
            dtype=torch.uint8,
            num_head_slots=1,
            state_content_bytes=layout.block_bytes // spec.block_size,
            page_size_padded=layout.block_bytes,
        )


@dataclass
class OakenMetadata:
    """One step's requests (shared by all layers of the KV-cache group)."""

    num_actual_tokens: int
    #: int64 ``[R + 1]``: request ``r``'s query tokens are ``query_start_loc[r]:query_start_loc[r + 1]``.
    query_start_loc: np.ndarray
    #: int64 ``[R]``: stored tokens of each request after this step (history + query).
    seq_lens: np.ndarray
    #: int32 ``[R, max blocks]``.
    block_table: np.ndarray
    #: Requests with one query token (decode attention kernel) and with more (dequantize + SDPA).
    decode_reqs: np.ndarray
    prefill_reqs: np.ndarray
    #: The decode requests' query tokens: ``slice(0, n)`` when they lead the batch (vLLM reorders it so), else
    #: their indices.
    decode_tokens: slice | torch.Tensor
    _batch: DecodeBatch | None = field(default=None, repr=False)

    def decode_batch(
        self, layout: BlockLayout, units_per_block: int, num_heads: int, head_size: int, threads: int
    ) -> DecodeBatch:
        """The decode kernel's tables and buffers for this step (built by the first layer that asks)."""
        b = self._batch
        if b is None or b.units_per_block != units_per_block or b.out.shape[1:] != (num_heads, head_size):
            r = self.decode_reqs
            b = DecodeBatch(
                self.block_table[r], self.seq_lens[r], layout, units_per_block, num_heads, head_size, threads
            )
            self._batch = b
        return b


class OakenMetadataBuilder(AttentionMetadataBuilder[OakenMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(
        self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config: VllmConfig, device: torch.device
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        if device.type != "cpu":
            raise NotImplementedError(f"the Oaken vLLM backend runs on the CPU, not on {device}")
        # Decodes first: their query tokens are then one contiguous slice.
        self._init_reorder_batch_threshold(1)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> OakenMetadata:
        cm = common_attn_metadata
        n = cm.num_reqs
        qsl = cm.query_start_loc_cpu[: n + 1].numpy().astype(np.int64)
        seq_lens = cm.seq_lens[:n].cpu().numpy().astype(np.int64)
        block_table = cm.block_table_tensor[:n].cpu().numpy()
        qlen = np.diff(qsl)
        decode = np.flatnonzero(qlen == 1)
        starts = qsl[decode]
        leading = decode.size == 0 or (decode[-1] == decode.size - 1 and starts[-1] == decode.size - 1)
        return OakenMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            query_start_loc=qsl,
            seq_lens=seq_lens,
            block_table=np.ascontiguousarray(block_table, dtype=np.int32),
            decode_reqs=decode,
            prefill_reqs=np.flatnonzero(qlen > 1),
            decode_tokens=slice(0, decode.size) if leading else torch.from_numpy(starts),
        )


@dataclass
class _LayerState:
    layer_index: int
    layout: BlockLayout
    #: float32 ``[2, 4]``: key and value thresholds of the layer.
    thresholds: np.ndarray
    writer: BlockWriter
    pool_key: tuple[int, int, int] | None = None
    pool: np.ndarray | None = None
    units_per_block: int = 0


class OakenAttentionImpl(AttentionImpl[OakenMetadata]):
    """Writes new tokens in Oaken's format and attends over them (module docstring)."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        refuse = []
        if attn_type != AttentionType.DECODER:
            refuse.append(f"attention type {attn_type}")
        if sliding_window is not None:
            refuse.append("sliding-window layers")
        if alibi_slopes is not None:
            refuse.append("ALiBi")
        if sinks is not None:
            refuse.append("attention sinks")
        if kv_sharing_target_layer_name is not None:
            refuse.append("KV sharing between layers")
        if kv_cache_dtype != "auto":
            refuse.append(f"kv_cache_dtype={kv_cache_dtype!r} (Oaken is the KV format; keep 'auto')")
        if refuse:
            raise NotImplementedError("the Oaken vLLM backend does not support " + ", ".join(refuse))
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{num_heads} query heads are not a multiple of {self.num_kv_heads} KV heads")
        self.softcap = float(logits_soft_cap or 0.0)
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.settings = _settings()
        self.profile = load_profile(self.settings.profile)
        model_config = get_current_vllm_config().model_config
        if model_config is not None:
            self.profile.check_model(model_config.hf_config)
        self._state: _LayerState | None = None

    # ------------------------------------------------------------------------------------------ helpers

    def _layer(self, layer: AttentionLayer, kv_cache: torch.Tensor) -> _LayerState:
        st = self._state
        if st is None:
            from vllm.model_executor.models.utils import extract_layer_index

            index = extract_layer_index(layer.layer_name)  # type: ignore[attr-defined]
            block_size = kv_cache.shape[2]
            layout = layout_for(self.num_kv_heads, self.head_size, block_size)
            thr = np.array([self.profile.layer(index, kind).as_tuple() for kind in ("key", "value")], dtype=np.float32)
            st = self._state = _LayerState(index, layout, thr, BlockWriter(layout, thr, self.settings.overflow))
        key = (kv_cache.data_ptr(), kv_cache.shape[0], kv_cache.stride(0))
        if st.pool_key != key:
            st.pool, st.units_per_block = pool_view(kv_cache, st.layout)
            st.pool_key = key
        return st

    # ------------------------------------------------------------------------------------------ vLLM API

    def do_kv_cache_update(
        self,
        layer: AttentionLayer,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Encode the step's new keys and values (``[N, H_kv, hd]``) into their slots."""
        if kv_cache.numel() == 0:
            return
        _numba_threads(self.settings.attention_threads)
        st = self._layer(layer, kv_cache)
        n = slot_mapping.shape[0]
        before = sum(st.writer.stats.tokens)
        st.writer.write(st.pool, st.units_per_block, slot_mapping.cpu().numpy(), key[:n], value[:n])
        over = sum(st.writer.stats.tokens)
        if over != before:
            logger.warning(
                "Oaken KV: %d record(s) of layer %d did not fit in their block's sparse area (%s policy; layer "
                "totals %s)",
                over - before,
                st.layer_index,
                st.writer.overflow,
                st.writer.stats.to_dict(),
            )

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: OakenMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by the Oaken backend")
        if attn_metadata is None:  # profiling / warm-up run
            return output
        md = attn_metadata
        _numba_threads(self.settings.attention_threads)
        st = self._layer(layer, kv_cache)
        hd = self.head_size
        if md.decode_reqs.size:
            batch = md.decode_batch(st.layout, st.units_per_block, self.num_heads, hd, self.settings.attention_threads)
            q = query[md.decode_tokens].detach()
            if q.dtype != torch.float32:
                q = q.to(torch.float32)
            out = batch.attend(
                q.numpy().reshape(-1, self.num_heads, hd),
                st.pool,
                st.thresholds,
                self.num_kv_heads,
                self.scale,
                self.softcap,
            )
            output[md.decode_tokens] = torch.from_numpy(out)
        for r in md.prefill_reqs:
            a, b = int(md.query_start_loc[r]), int(md.query_start_loc[r + 1])
            length = int(md.seq_lens[r])
            k, v = dequantize(st.pool, st.units_per_block, st.layout, md.block_table[r], length, st.thresholds)
            output[a:b] = self._prefill(query[a:b], k, v, length).to(output.dtype)
        return output

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int) -> torch.Tensor:
        """Causal attention of ``q [S, Hq, hd]`` (the last ``S`` positions) over ``k, v [length, D]`` float32."""
        s, hd = q.shape[0], self.head_size
        qh = q.detach().to(torch.float32).transpose(0, 1)[None]  # [1, Hq, S, hd]
        kh = k.view(length, self.num_kv_heads, hd).transpose(0, 1)[None]
        vh = v.view(length, self.num_kv_heads, hd).transpose(0, 1)[None]
        if self.softcap:
            group = self.num_heads // self.num_kv_heads
            kh, vh = kh.repeat_interleave(group, 1), vh.repeat_interleave(group, 1)
            scores = torch.tanh((qh @ kh.transpose(-1, -2)) * self.scale / self.softcap) * self.softcap
            mask = _causal_mask(s, length)
            out = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ vh
        elif s == length:
            out = torch.nn.functional.scaled_dot_product_attention(
                qh, kh, vh, is_causal=True, scale=self.scale, enable_gqa=True
            )
        else:
            out = torch.nn.functional.scaled_dot_product_attention(
                qh, kh, vh, attn_mask=_causal_mask(s, length), scale=self.scale, enable_gqa=True
            )
        return out[0].transpose(0, 1)  # [S, Hq, hd]

    @property
    def overflow_stats(self) -> dict[str, int]:
        return self._state.writer.stats.to_dict() if self._state else {}


def _causal_mask(s: int, length: int) -> torch.Tensor:
    """bool ``[S, length]``: query ``i`` (position ``length - S + i``) sees keys up to its position."""
    pos = torch.arange(length - s, length)[:, None]
    return torch.arange(length)[None, :] <= pos


def worker_stats(worker: Any) -> dict[str, Any]:
    """What the Oaken layers of one vLLM worker hold: block layout, block count and overflow counts.

    Runs in the worker process: ``LLM.collective_rpc(worker_stats)`` (a callable RPC; vLLM then needs
    ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``). Layers that have not run yet are not listed.
    """
    model = worker.model_runner.get_model()
    layers: dict[int, dict[str, int]] = {}
    out: dict[str, Any] = {"backend": None, "layers": layers}
    for module in model.modules():
        impl = getattr(module, "impl", None)
        if not isinstance(impl, OakenAttentionImpl):
            continue
        out["backend"] = BACKEND_NAME
        st = impl._state
        if st is None:
            continue
        layers[st.layer_index] = st.writer.stats.to_dict()
        out["layout"] = st.layout.describe()
        out["num_blocks"] = int(module.kv_cache.shape[0])
        out["units_per_block"] = st.units_per_block
    totals: dict[str, int] = {}
    for s in layers.values():
        for k, v in s.items():
            totals[k] = totals.get(k, 0) + v
    out["totals"] = totals
    return out
