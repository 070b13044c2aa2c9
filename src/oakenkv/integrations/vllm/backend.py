"""The Oaken attention backend for vLLM 0.32 (``vllm/v1/attention/backend.py``'s interface).

- :class:`OakenAttentionBackend`: declares what it supports and, through ``customize_spec``, makes each layer's
  KV page a ``uint8`` block of exactly :class:`~oakenkv.integrations.vllm.layout.BlockLayout`'s bytes, so vLLM's
  block count is computed from Oaken's real size.
- :class:`OakenMetadataBuilder`: per step, the requests' query ranges, lengths and block tables; the kernels' page
  tables (``layout.BlockTables``) live on the builder across steps and are refilled only where a row changed.
- :class:`OakenAttentionImpl`: ``do_kv_cache_update`` transforms (an oaken-plus profile's key shift and rotation)
  and encodes the step's new keys and values into their block slots with one numba call per layer; ``forward``
  runs the packed-page decode kernel for one-token queries (multi-threaded over (row, token range) work items,
  16-bit sink tokens merged) and, for longer queries (prefill, chunked prefill, prefix-cache hits), a flash loop over
  tiles of the row's tokens dequantized from the blocks; a prompt's first chunk (no history) goes to vLLM's own CPU
  attention kernel over its dequantized rows, in float32 (``chunk.py``).

The numba kernels are compiled (or loaded from numba's on-disk cache) by :func:`warm_up` while the engine starts
(the first attention layer built in the worker), never inside a request. Everything runs on the CPU, in the worker
process; ``docs/vllm.md`` has the design.
"""

from __future__ import annotations

import threading
import time
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

from oakenkv.integrations.vllm import BACKEND_NAME, Settings, chunk, load_profile, settings_for
from oakenkv.integrations.vllm.layout import (
    ROW_THREADS_MIN_TOKENS,
    BlockLayout,
    BlockTables,
    BlockWriter,
    DecodeScratch,
    LayerParams,
    RowThreads,
    decode_attention_rows,
    layer_static_grid,
    pool_view,
    prefill_attention,
    profile_outlier_share,
)

logger = init_logger("vllm.oakenkv")  # (a child of vLLM's logger: its handlers print our lines with its own)


def _settings() -> Settings:
    """The settings of the engine being built (:func:`oakenkv.integrations.vllm.settings_for` its served model)."""
    from vllm.config import get_current_vllm_config_or_none

    mc = getattr(get_current_vllm_config_or_none(), "model_config", None)
    return settings_for(getattr(mc, "model", None), getattr(mc, "hf_config", None))


def _threads(s: Settings) -> int:
    """Threads of the decode-attention kernel: the setting, else torch's thread count (vLLM's CPU worker sets it
    to the cores it was given), within numba's pool."""
    import numba

    n = s.attention_threads or torch.get_num_threads()
    return max(1, min(n, numba.config.NUMBA_NUM_THREADS))


_ROW_THREADS: dict[tuple[int, ...], RowThreads] = {}


def _row_threads(s: Settings) -> RowThreads | None:
    """The process's decode threads bound to ``s.attention_cpus`` (one set, shared by every layer), or None."""
    if not s.attention_cpus:
        return None
    with _WARM:
        rt = _ROW_THREADS.get(s.attention_cpus)
        if rt is None:
            rt = _ROW_THREADS[s.attention_cpus] = RowThreads(s.attention_cpus)
            logger.info("Oaken KV: decode rows shared with %d thread(s) bound to CPU(s) %s", len(rt),
                        ",".join(map(str, rt.cpus)))  # fmt: skip
        return rt


def _numba_threads(n: int) -> None:
    """Run this thread's parallel numba kernels on ``n`` threads."""
    import numba

    if numba.get_num_threads() != n:
        numba.set_num_threads(n)


def layout_for(num_kv_heads: int, head_size: int, block_size: int) -> BlockLayout:
    """The block layout of a layer with ``num_kv_heads x head_size`` values per token (this rank's heads)."""
    s = _settings()
    thr = load_profile(s.profile)
    sink = thr.transforms.sink_tokens if thr.transforms is not None else 0
    return BlockLayout.make(
        num_kv_heads * head_size, block_size, thr.config, s.sparse_bytes_per_token, sink, profile_outlier_share(thr)
    )


_WARM = threading.Lock()
_WARMED: set[tuple[Any, ...]] = set()


def warm_up(
    layout: BlockLayout,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    threads: int,
    row_threads: RowThreads | None = None,
) -> float:
    """Run every kernel the backend calls once on a few synthetic tokens of ``layout`` (the write with a key
    transform and sink copies, the tables, the decode kernels, the sink merge, a prefill tile), so that numba
    compiles them, or loads them from its cache, now and not in a user's request. Once per process and shape;
    returns the seconds it took."""
    key = (layout, num_heads, num_kv_heads, head_size)
    with _WARM:
        if key in _WARMED:
            return 0.0
        t0 = time.perf_counter()
        import numba

        from oakenkv.integrations.vllm import _oaken

        rng = np.random.default_rng(0)
        bs, d = layout.block_size, layout.dim
        n = min(bs + 3, 2 * bs)
        blocks = 2
        raw = torch.zeros(blocks, layout.block_bytes, dtype=torch.uint8)
        pool, upb = pool_view(raw, layout)
        x = rng.standard_normal((2, n, d)).astype(np.float32)
        thr = np.array([[-2.0, -0.1, 0.1, 2.0]] * 2, np.float32)
        for shift, rot in ((None, False), (np.zeros(d, np.float32), head_size & (head_size - 1) == 0)):
            w = BlockWriter(layout, thr, "clip", key_shift=shift, key_rotation=rot, head_dim=head_size)
            w.write(pool, upb, np.arange(n), torch.from_numpy(x[0]), torch.from_numpy(x[1]))
        # the overflow policy's path (a record that does not fit its block: clipped, encoded again, written on)
        tight = replace(layout, sparse_units=1)
        raw_tight = torch.zeros(blocks, tight.block_bytes, dtype=torch.uint8)
        pool_tight, upb_tight = pool_view(raw_tight, tight)
        w = BlockWriter(tight, thr, "clip", head_dim=head_size)
        w.write(pool_tight, upb_tight, np.arange(n), torch.from_numpy(4 * x[0]), torch.from_numpy(4 * x[1]))
        table = np.array([[0, 1]], np.int32)
        tables = BlockTables(layout, upb)
        tables.update(0, table, np.array([n]), np.array([n]))
        tables.update(1, table, np.array([n]), np.array([1]))  # the incremental path
        params = LayerParams(thr, num_kv_heads, 0.125, static_grid=layer_static_grid(layout, thr))
        q = rng.standard_normal((1, num_heads, head_size)).astype(np.float32)
        decode_attention_rows(tables, 0, pool, q, params, 1)
        if row_threads is not None:  # a step shared with the plugin's threads: enough rows of n tokens to share
            rows = max(len(row_threads) + 1, -(-ROW_THREADS_MIN_TOKENS // n))
            tables.update(2, np.repeat(table, rows, axis=0), np.full(rows, n), np.ones(rows, np.int64))
            decode_attention_rows(tables, 0, pool, np.repeat(q, rows, axis=0), params, 1, None, row_threads)
        if threads > 1:  # the parallel kernel, on the same view types
            lt = tables.layer(0, pool)
            view = lt.view(pool, layout.unit, layout.unit, layout.scale_bytes, thr, layout.inner_bits,
                           layout.outer_bits, num_kv_heads, rows=1, static_grid=params.static_grid)  # fmt: skip
            _numba_threads(threads)
            out = np.empty((1, num_heads, head_size), np.float32)
            _oaken.packed_decode_attention(
                q, tables.keep[:1], np.float32(0.125), np.float32(0.0), 2, out, np.zeros(2, np.int64),
                np.empty((1, num_heads), np.float32), *view,
            )  # fmt: skip
        sinks = np.zeros((1, 2, 1, d), np.uint16)
        _oaken.merge_sinks(q, np.ones((1, 1), np.uint8), sinks, np.float32(0.125), np.float32(0.0),
                           np.zeros_like(q), np.zeros((1, num_heads), np.float32))  # fmt: skip
        prefill_attention(tables, 0, pool, 0, torch.from_numpy(rng.standard_normal((3, num_heads, head_size))),
                          params)  # fmt: skip
        if head_size & (head_size - 1) == 0:
            _oaken.fwht(q)
        _WARMED.add(key)
        spent = time.perf_counter() - t0
        try:
            layer = numba.threading_layer()
        except ValueError:  # (no parallel kernel has run in this process)
            layer = "not started"
        logger.info("Oaken KV: kernels ready in %.1f s (%d attention threads; numba threading layer %s)", spent,
                    threads, layer)  # fmt: skip
        return spent


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
    #: Requests with one query token (decode attention kernel), leading the batch, and the others (prefill tiles).
    num_decodes: int
    prefill_reqs: np.ndarray
    #: The builder's step counter (the tables are updated once per step).
    step: int
    _builder: OakenMetadataBuilder | None = field(default=None, repr=False)

    def tables(self, layout: BlockLayout, units_per_block: int) -> BlockTables:
        """The kernels' tables for this step (updated by the first layer that asks; the builder keeps them)."""
        assert self._builder is not None
        t = self._builder.block_tables(layout, units_per_block)
        t.update(self.step, self.block_table, self.seq_lens, np.diff(self.query_start_loc))
        return t


class OakenMetadataBuilder(AttentionMetadataBuilder[OakenMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(
        self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config: VllmConfig, device: torch.device
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        if device.type != "cpu":
            raise NotImplementedError(f"the Oaken vLLM backend runs on the CPU, not on {device}")
        # Decodes first: their query tokens are then one contiguous slice, their rows the tables' first ones.
        self._init_reorder_batch_threshold(1)
        self._tables: BlockTables | None = None
        self._step = 0

    def block_tables(self, layout: BlockLayout, units_per_block: int) -> BlockTables:
        t = self._tables
        if t is None or t.layout != layout or t.units_per_block != units_per_block:
            t = self._tables = BlockTables(layout, units_per_block)
        return t

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> OakenMetadata:
        cm = common_attn_metadata
        n = cm.num_reqs
        qsl = cm.query_start_loc_cpu[: n + 1].numpy().astype(np.int64)
        seq_lens = cm.seq_lens[:n].cpu().numpy().astype(np.int64)
        block_table = cm.block_table_tensor[:n].cpu().numpy()
        qlen = np.diff(qsl)
        # The decodes are the leading rows of one query token (vLLM puts its decodes first: reorder_batch). A
        # one-token query after a longer one is the last chunk of a chunked prefill (a prompt of 129 tokens in chunks
        # of 64), which vLLM keeps among the prefills: attended as a prefill of one token, the same attention.
        longer = np.flatnonzero(qlen != 1)
        num_decodes = int(longer[0]) if longer.size else n
        self._step += 1
        return OakenMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            query_start_loc=qsl,
            seq_lens=seq_lens,
            block_table=np.ascontiguousarray(block_table, dtype=np.int32),
            num_decodes=num_decodes,
            prefill_reqs=num_decodes + np.flatnonzero(qlen[num_decodes:] > 0),
            step=self._step,
            _builder=self,
        )


@dataclass
class _LayerState:
    layer_index: int
    layout: BlockLayout
    writer: BlockWriter
    params: LayerParams
    pool_key: tuple[int, int, int] | None = None
    pool: np.ndarray | None = None
    units_per_block: int = 0


class OakenAttentionImpl(AttentionImpl[OakenMetadata]):
    """Writes new tokens in Oaken's format and attends over them (module docstring)."""

    #: The backend's name (``worker_stats`` reports it).
    backend_name: ClassVar[str] = BACKEND_NAME

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
        self._common_init(
            num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype, logits_soft_cap,
            attn_type, kv_sharing_target_layer_name, sinks,
        )  # fmt: skip
        self.threads = _threads(self.settings)
        self.row_threads = _row_threads(self.settings)
        config = get_current_vllm_config()
        self._state: _LayerState | None = None
        #: The decode step's buffers, reused by every step of this layer.
        self._scratch = DecodeScratch()
        #: vLLM's own CPU attention kernel for a prompt's first chunk (no history), or None (torch's flash then).
        self._chunk = chunk.make(num_heads, self.num_kv_heads, head_size)
        #: Seconds spent in this layer's parts (write, decode attention, prefill attention) and their calls: where a
        #: step's time goes (``worker_stats``).
        self.times = {"write": 0.0, "decode": 0.0, "prefill": 0.0, "write_calls": 0, "decode_calls": 0,
                      "prefill_calls": 0}  # fmt: skip
        # Compile (or load) the kernels now, while the engine starts: with a block size of vLLM's default for this
        # platform; the layer's real layout, if it differs, is warmed when its cache is bound (_layer).
        cache_config = config.cache_config
        block_size = int(getattr(cache_config, "block_size", None) or 128)
        warm_up(
            layout_for(self.num_kv_heads, head_size, block_size), num_heads, self.num_kv_heads, head_size, self.threads,
            self.row_threads,
        )  # fmt: skip

    # ------------------------------------------------------------------------------------------ helpers

    def _common_init(
        self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
        logits_soft_cap, attn_type, kv_sharing_target_layer_name, sinks,
    ) -> None:  # fmt: skip
        """What the CPU and the device backends check and keep alike: what they refuse, the heads, the settings and
        the profile (checked against the served model), the tensor-parallel size."""
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
        config = get_current_vllm_config()
        self.tp_size = int(getattr(config.parallel_config, "tensor_parallel_size", 1) or 1)
        if config.model_config is not None:
            self.profile.check_model(config.model_config.hf_config)

    def _layer_transforms(self, index: int) -> tuple[np.ndarray | None, bool]:
        """Layer ``index``'s online key transform for this rank's heads: ``(key shift or None, key rotation)``."""
        t = self.profile.transforms
        if t is None:
            return None, False
        lt = t.layers[index]
        shift = None if lt.key_shift is None else np.asarray(lt.key_shift, np.float32)[self._rank_slice()]
        return shift, lt.key_rotation

    def _rank_slice(self) -> slice:
        """The values of this tensor-parallel rank's KV heads within a token's full row (the profile's): its share of
        the heads, or the one head it holds a copy of when vLLM replicates KV heads over more ranks than heads."""
        if self.tp_size == 1:
            return slice(None)
        from vllm.distributed import get_tensor_model_parallel_rank

        total = self.profile.fingerprint.num_kv_heads
        r = get_tensor_model_parallel_rank()
        first = r * self.num_kv_heads if total >= self.tp_size else r * total // self.tp_size
        return slice(first * self.head_size, (first + self.num_kv_heads) * self.head_size)

    def _layer(self, layer: AttentionLayer, kv_cache: torch.Tensor) -> _LayerState:
        st = self._state
        if st is None:
            from vllm.model_executor.models.utils import extract_layer_index

            index = extract_layer_index(layer.layer_name)  # type: ignore[attr-defined]
            block_size = kv_cache.shape[2]
            layout = layout_for(self.num_kv_heads, self.head_size, block_size)
            warm_up(layout, self.num_heads, self.num_kv_heads, self.head_size, self.threads, self.row_threads)
            thr = np.array([self.profile.layer(index, kind).as_tuple() for kind in ("key", "value")], dtype=np.float32)
            shift, rotation = self._layer_transforms(index)
            writer = BlockWriter(
                layout, thr, self.settings.overflow, key_shift=shift, key_rotation=rotation, head_dim=self.head_size
            )
            params = LayerParams(
                thr, self.num_kv_heads, self.scale, self.softcap, rotation, static_grid=writer.static_grid
            )
            st = self._state = _LayerState(index, layout, writer, params)
        key = (kv_cache.data_ptr(), kv_cache.shape[0], kv_cache.stride(0))
        if st.pool_key != key:
            st.pool, st.units_per_block = pool_view(kv_cache, st.layout)
            st.pool_key = key
        return st

    # ------------------------------------------------------------------------------------------ vLLM API

    def _slots(self, slot_mapping: torch.Tensor) -> Any:
        """The step's slots as this backend's writer takes them (the CPU writer: a numpy array)."""
        return slot_mapping.cpu().numpy()

    def do_kv_cache_update(
        self,
        layer: AttentionLayer,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Transform the step's new keys and encode them and the values (``[N, H_kv, hd]``) into their slots."""
        if kv_cache.numel() == 0:
            return
        t0 = time.perf_counter()
        st = self._layer(layer, kv_cache)
        n = slot_mapping.shape[0]
        before = sum(st.writer.stats.tokens)
        st.writer.write(st.pool, st.units_per_block, self._slots(slot_mapping), key[:n], value[:n])
        self.times["write"] += time.perf_counter() - t0
        self.times["write_calls"] += 1
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
        t0 = time.perf_counter()
        st = self._layer(layer, kv_cache)
        tables = md.tables(st.layout, st.units_per_block)
        hd = self.head_size
        nd = md.num_decodes
        if nd:
            _numba_threads(self.threads)
            # the query converted once, into the scratch buffer the kernel reads (rotated there in place); the
            # result converted once, straight into vLLM's output
            q = self._scratch.get("query", (nd, self.num_heads, hd), np.float32)
            torch.from_numpy(q).copy_(query[:nd].detach().reshape(nd, self.num_heads, hd))
            out = decode_attention_rows(
                tables, st.layer_index, st.pool, q, st.params, self.threads, self._scratch, self.row_threads
            )
            output[:nd].view(nd, self.num_heads, hd).copy_(torch.from_numpy(out))
            t1 = time.perf_counter()
            self.times["decode"] += t1 - t0
            self.times["decode_calls"] += 1
            t0 = t1
        reqs = [int(r) for r in md.prefill_reqs]

        def prefill(r: int) -> None:
            a, b = int(md.query_start_loc[r]), int(md.query_start_loc[r + 1])
            q = query[a:b].reshape(b - a, self.num_heads, hd)
            out = prefill_attention(tables, st.layer_index, st.pool, r, q, st.params, own=self._chunk)
            output[a:b] = out.reshape(output[a:b].shape).to(output.dtype)

        rt = self.row_threads
        if rt is not None and len(reqs) > 1:  # requests taken in turn by this thread and the plugin's own
            tables.layer(st.layer_index, st.pool)  # brought up to date once, before the threads read it
            # torch's inference and grad modes are per thread: the plugin's threads run under the caller's
            inference, grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()

            def one(i: int) -> None:
                with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                    prefill(reqs[i])

            rt.share(len(reqs), one)
        else:
            for r in reqs:
                prefill(r)
        if md.prefill_reqs.size:
            self.times["prefill"] += time.perf_counter() - t0
            self.times["prefill_calls"] += 1
        return output

    @property
    def overflow_stats(self) -> dict[str, int]:
        return self._state.writer.stats.to_dict() if self._state else {}


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
        out["backend"] = impl.backend_name
        out["attention_threads"] = impl.threads
        out["torch_threads"] = torch.get_num_threads()  # (what vLLM set: numba's start must leave it alone)
        out["attention_cpus"] = list(impl.row_threads.cpus) if impl.row_threads is not None else []
        out["row_thread_runs"] = impl.row_threads.runs if impl.row_threads is not None else 0
        out["row_thread_taken"] = list(impl.row_threads.taken) if impl.row_threads is not None else []
        out["profile"] = str(impl.settings.profile)
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
    times: dict[str, float] = {}
    for module in model.modules():
        impl = getattr(module, "impl", None)
        if isinstance(impl, OakenAttentionImpl):
            for k, v in impl.times.items():
                times[k] = times.get(k, 0) + v
    out["times_s"] = times
    return out
