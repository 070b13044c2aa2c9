"""The Oaken attention backend on the pools' device (vLLM's CUDA engine): the Triton kernels over the CPU plugin's
blocks (``device.py``).

- :class:`OakenCudaAttentionBackend` (``OAKEN_CUDA``): the CPU backend's block layout (``customize_spec``: one
  ``uint8`` page per block, ``layout.BlockLayout``'s bytes), with vLLM's checks for a CUDA platform
  (``validate_configuration``: head sizes the kernels take, compute capability 8.0 or newer, decoder attention).
- :class:`OakenDeviceMetadataBuilder`: per step, the requests' query ranges and lengths on the host and their block
  table on the device; the step's shared tables (``device.step_pages``) built by the first layer that asks.
- :class:`OakenDeviceAttentionImpl`: ``do_kv_cache_update`` (the CPU impl's, over this backend's layer state)
  encodes the step's keys (after the profile's key shift and rotation) and values into their slots
  (``device.DeviceBlockWriter``); ``forward`` runs the paged decode kernel for one-token queries and the paged
  prefill kernel per longer query, each layer's view built from its headers (``device.layer_view``), the sink tokens
  merged at 16 bits.

vLLM's CUDA platform honours a selected backend: ``--attention-config.backend OAKEN_CUDA`` (``register()``
registers the name); a served model with a profile also gets it in place of ``FLASH_ATTN`` (``select.py``). On the
CPU engine ``OAKENKV_VLLM_KERNELS=triton`` selects it too, with ``TRITON_INTERPRET=1``: how the tests run the whole
backend inside vLLM without a GPU. CUDA graphs: not supported (``AttentionCGSupport.NEVER``; the step's tables
are rebuilt on the host side of each step). Nothing of this has run on a GPU yet (``docs/gpu.md``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
from vllm.config import VllmConfig
from vllm.v1.attention.backend import (
    AttentionCGSupport,
    AttentionLayer,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from vllm.v1.kv_cache_interface import AttentionSpec

from oakenkv.integrations.vllm import CUDA_BACKEND_NAME, device
from oakenkv.integrations.vllm.backend import OakenAttentionBackend, OakenAttentionImpl, layout_for, logger
from oakenkv.integrations.vllm.layout import BlockLayout

#: Smallest head size the Triton prefill kernel takes (``tl.dot`` needs 16).
MIN_HEAD_SIZE = 16


class OakenCudaAttentionBackend(OakenAttentionBackend):
    """Oaken KV cache in vLLM's blocks on the GPU (module docstring)."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]

    @staticmethod
    def get_name() -> str:
        return CUDA_BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[OakenDeviceAttentionImpl]:
        return OakenDeviceAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[OakenDeviceMetadataBuilder]:
        return OakenDeviceMetadataBuilder

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return MIN_HEAD_SIZE <= head_size <= 8192

    @classmethod
    def supports_compute_capability(cls, capability: Any) -> bool:
        return capability is None or (int(capability.major), int(capability.minor)) >= (8, 0)

    @classmethod
    def validate_configuration(cls, *args: Any, **kwargs: Any) -> list[str]:
        """vLLM's checks; when they fail, say so loudly: vLLM then serves the model with another backend, in its own
        KV format, although a profile asked for Oaken's."""
        reasons = super().validate_configuration(*args, **kwargs)
        if reasons:
            logger.warning(
                "the Oaken KV backend (%s) cannot serve this configuration: %s; vLLM falls back to another attention "
                "backend and its own KV cache, not Oaken's",
                CUDA_BACKEND_NAME,
                "; ".join(reasons),
            )
        return reasons


@dataclass
class OakenDeviceMetadata:
    """One step's requests (shared by all layers of the KV-cache group)."""

    num_actual_tokens: int
    #: int64 ``[R + 1]`` (host): request ``r``'s query tokens are ``query_start_loc[r]:query_start_loc[r + 1]``.
    query_start_loc: np.ndarray
    #: int64 ``[R]`` (host): stored tokens of each request after this step.
    seq_lens: np.ndarray
    #: int32 ``[R, max blocks]`` on the device.
    block_table: torch.Tensor
    #: Requests with one query token (the decode kernel), leading the batch, and the others (the prefill kernel).
    num_decodes: int
    prefill_reqs: np.ndarray
    _pages: dict[tuple[BlockLayout, int], device.StepPages] = field(default_factory=dict, repr=False)

    def pages(self, layout: BlockLayout, units_per_block: int) -> device.StepPages:
        """The step's shared tables (built by the first layer that asks)."""
        key = (layout, units_per_block)
        p = self._pages.get(key)
        if p is None:
            p = self._pages[key] = device.step_pages(layout, units_per_block, self.block_table, self.seq_lens)
        return p


class OakenDeviceMetadataBuilder(AttentionMetadataBuilder[OakenDeviceMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(
        self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config: VllmConfig, device: torch.device
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._init_reorder_batch_threshold(1)  # decodes first

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> OakenDeviceMetadata:
        cm = common_attn_metadata
        n = cm.num_reqs
        qsl = cm.query_start_loc_cpu[: n + 1].numpy().astype(np.int64)
        seq_lens = cm.seq_lens[:n].cpu().numpy().astype(np.int64)
        qlen = np.diff(qsl)
        longer = np.flatnonzero(qlen != 1)
        num_decodes = int(longer[0]) if longer.size else n
        return OakenDeviceMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            query_start_loc=qsl,
            seq_lens=seq_lens,
            block_table=cm.block_table_tensor[:n],
            num_decodes=num_decodes,
            prefill_reqs=num_decodes + np.flatnonzero(qlen[num_decodes:] > 0),
        )


@dataclass
class _DeviceLayer:
    layer_index: int
    layout: BlockLayout
    writer: device.DeviceBlockWriter
    thresholds: torch.Tensor
    rotation: bool
    pool_key: tuple[int, int, int] | None = None
    pool: torch.Tensor | None = None
    units_per_block: int = 0


class OakenDeviceAttentionImpl(OakenAttentionImpl):
    """Writes new tokens in Oaken's format on the device and attends over them with the Triton kernels."""

    backend_name: ClassVar[str] = CUDA_BACKEND_NAME

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
        attn_type: str = "decoder",
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        self._common_init(
            num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype, logits_soft_cap,
            attn_type, kv_sharing_target_layer_name, sinks,
        )  # fmt: skip
        if self.profile.config.static_grids:
            raise NotImplementedError(device.STATIC_GRIDS_REFUSED)
        if head_size < MIN_HEAD_SIZE:
            raise NotImplementedError(f"the Oaken device backend needs head_size >= {MIN_HEAD_SIZE}, got {head_size}")
        self._state: _DeviceLayer | None = None
        #: Host seconds per part, as the CPU backend's (``worker_stats``); on a GPU the kernels run asynchronously,
        #: so these count launches and the host reads between them, not the kernels' time.
        self.times = {"write": 0.0, "decode": 0.0, "prefill": 0.0, "write_calls": 0, "decode_calls": 0,
                      "prefill_calls": 0}  # fmt: skip
        self.threads, self.row_threads = 1, None  # (worker_stats reads them)

    def _layer(self, layer: AttentionLayer, kv_cache: torch.Tensor) -> _DeviceLayer:
        st = self._state
        if st is None:
            from vllm.model_executor.models.utils import extract_layer_index

            index = extract_layer_index(layer.layer_name)  # type: ignore[attr-defined]
            layout = layout_for(self.num_kv_heads, self.head_size, kv_cache.shape[2])
            thr = np.array([self.profile.layer(index, kind).as_tuple() for kind in ("key", "value")], dtype=np.float32)
            shift, rotation = self._layer_transforms(index)
            writer = device.DeviceBlockWriter(
                layout, thr, self.settings.overflow, key_shift=shift, key_rotation=rotation, head_dim=self.head_size,
                device=kv_cache.device,
            )  # fmt: skip
            st = self._state = _DeviceLayer(index, layout, writer, writer.thr, rotation)
            logger.info("Oaken KV (device kernels): layer %d on %s", index, kv_cache.device)
        key = (kv_cache.data_ptr(), kv_cache.shape[0], kv_cache.stride(0))
        if st.pool_key != key:
            st.pool, st.units_per_block = device.pool_tensor(kv_cache, st.layout)
            st.pool_key = key
        return st

    def _slots(self, slot_mapping: torch.Tensor) -> torch.Tensor:
        return slot_mapping  # (the device writer reads them where they are)

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: OakenDeviceMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by the Oaken backend")
        if attn_metadata is None:  # profiling / warm-up run
            return output
        md = attn_metadata
        t0 = time.perf_counter()
        st = self._layer(layer, kv_cache)
        lay, hd = st.layout, self.head_size
        pages = md.pages(lay, st.units_per_block)
        view = device.layer_view(st.pool, lay, st.units_per_block, pages, st.thresholds, self.num_kv_heads, hd)
        sinks = None
        if lay.sink_tokens:
            sinks = device.layer_sinks(st.pool, lay, st.units_per_block, md.block_table[:, 0])
        nd = md.num_decodes
        if nd:
            dview, dpages = device.row_view(view, slice(0, nd), pages.num_tokens), device.head_rows(pages, nd)
            out = device.decode_attention(
                query[:nd].reshape(nd, self.num_heads, hd), dview, dpages, None if sinks is None else sinks[:nd],
                self.scale, self.softcap, st.rotation,
            )  # fmt: skip
            output[:nd].view(nd, self.num_heads, hd).copy_(out)
            t1 = time.perf_counter()
            self.times["decode"] += t1 - t0
            self.times["decode_calls"] += 1
            t0 = t1
        for r in md.prefill_reqs:
            r = int(r)
            a, b = int(md.query_start_loc[r]), int(md.query_start_loc[r + 1])
            out = device.prefill_attention(
                query[a:b].reshape(b - a, self.num_heads, hd), device.row_view(view, r, int(md.seq_lens[r])),
                None if sinks is None else sinks[r : r + 1], self.scale, self.softcap, st.rotation,
            )  # fmt: skip
            output[a:b].view(b - a, self.num_heads, hd).copy_(out)
        if md.prefill_reqs.size:
            self.times["prefill"] += time.perf_counter() - t0
            self.times["prefill_calls"] += 1
        return output
