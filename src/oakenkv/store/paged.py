"""The paged K/V store: every layer's keys and values of a batch in one page pool, in the Oaken format.

:class:`PagedKVStore` owns what a cache needs below the transformers adapter (``oakenkv.hf.cache``): the page pool
(``oakenkv.store.pages``: one sequence per batch row, ``stream = 2 * layer + kind`` with kind ``KEY`` = 0 and ``VALUE``
= 1), the codec (the fast numba pair or the plain PyTorch reference), the thresholds as kernels want them, the
policy for when numba runs on one thread, and the per-layer :class:`~oakenkv.format.layout.LayerView` that a decode
kernel reads (:meth:`PagedKVStore.layer_view`). A token's row is all KV heads of the layer (``D = num_kv_heads *
head_dim``, granularity "token", the paper's); its bytes are the page records of ``oakenkv.format.layout``.

Writes are atomic per layer: an append that the pool's budget cannot hold raises
:class:`~oakenkv.store.pages.PoolExhaustedError` and changes nothing.

Sink tokens (an ``oaken-plus`` profile's ``Transforms.sink_tokens = n``): the first ``n`` real tokens of every row
are encoded into the pages like every other token, and also kept at 16 bits (float16, keys after the online key
transform, as the pages hold them) beside the pool; every read (:meth:`PagedKVStore.read`, the prefill's direct
decode through :meth:`PagedKVStore.apply_sinks`, the packed decode attention through
:meth:`PagedKVStore.split_sink_keep`) takes them from there. A row's first real token is token 0 unless the cache
was told otherwise (:meth:`PagedKVStore.set_row_starts`, from the attention mask: a left-padded row's sink is its
first token after the padding, ``oakenkv.hf.cache``).

A full-precision window (``residual = R > 0``, KIVI's and transformers' ``QuantizedCache``'s residual, off by
default: the paper's Oaken quantizes every token): every layer keeps its newest tokens unquantized, as float32
values (keys after the online key transform: what the encoder would be handed) beside the pages, in
:attr:`PagedKVStore.windows`. When an update leaves ``n >= 2 R`` tokens there, the oldest ``n - R`` are encoded
into the pages (:meth:`PagedKVStore.window_update`), with the same bytes as if they had been encoded on arrival;
the window then holds ``R``. The pages always hold a prefix of the sequence (tokens ``[0, num_tokens)``), the
window the rest (``[num_tokens, num_tokens + window_tokens)``). A decode step then costs no encode (one copy into
the window), and attention over the window is float attention merged with the pages' (``merge_window``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from numba import njit

from oakenkv.calibrate.thresholds import Thresholds
from oakenkv.calibrate.transforms import fwht
from oakenkv.format.config import OakenConfig
from oakenkv.format.layout import (
    ERR_NONFINITE,
    ERROR_MESSAGES,
    HEADER_BITS,
    NO_STATIC_GRID,
    EncodedBatch,
    LayerView,
    from_records,
    record_size,
    scale_bytes,
    sparse_capacity,
    to_records,
)
from oakenkv.kernels.cpu.codec import (
    decode_records,
    decode_trusted,
    encode_records,
    encode_trusted,
    first_error,
    levels_array,
    static_grid_array,
)
from oakenkv.quant.adapt import AdaptConfig, new_state
from oakenkv.store.pages import PagePool, PoolConfig, PoolStats, TokenTargets
from oakenkv.store.view import LayerTables, grown

KEY, VALUE = 0, 1
#: Names of the two kinds, indexed by ``KEY`` / ``VALUE`` (as ``Thresholds.layer`` spells them).
KINDS = ("key", "value")

#: Tokens per chunk of a long update (a prefill): each chunk is one encode call over ``B * chunk`` rows. Small
#: chunks cost a call's fixed work each and run below ``SERIAL_BELOW_ROWS`` on one thread, so a long prefill wants
#: chunks as large as memory allows (measured per chunk size in docs/notebook/perf-notes.md). The encoder's
#: temporaries are a few times the chunk's float rows: small next to the float tensors the prefill's attention gets.
PREFILL_CHUNK = 4096

#: Below this many rows a numba call runs on one thread: waking the thread pool costs more than the work
#: (measured in ``docs/notebook/perf-notes.md``).
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


Encoder = Callable[[torch.Tensor, Any, OakenConfig], EncodedBatch]
Decoder = Callable[[EncodedBatch, Any, OakenConfig], torch.Tensor]


def codec_functions(kind: str) -> tuple[Encoder, Decoder]:
    """``(encode, decode)``: the fast numba pair (``"auto"``, ``"fast"``: ``oakenkv.kernels.codec``) or the plain
    PyTorch reference pair (``"reference"``: ``oakenkv.quant.reference``). Both give identical bytes and numbers."""
    if kind not in ("auto", "fast", "reference"):
        raise ValueError(f"codec must be 'auto', 'fast' or 'reference', got {kind!r}")
    if kind == "reference":
        from oakenkv.quant import reference

        return reference.encode, reference.decode
    from oakenkv.kernels import codec

    return codec.encode, codec.decode


@njit(cache=True, nogil=True)
def _set_lengths(sparse_lengths, t, counts):
    """``sparse_lengths[:, KEY, t] = counts[:B]`` and ``[:, VALUE, t] = counts[B:]`` in one call (two numpy
    assignments cost more than the rest of the mirror's update)."""
    b = sparse_lengths.shape[0]
    for r in range(b):
        sparse_lengths[r, 0, t] = counts[r]
        sparse_lengths[r, 1, t] = counts[b + r]


@njit(cache=True, nogil=True)
def _packed_sparse(sparse, counts):
    """``(offsets int64 [n + 1], bytes uint8 [S])``: the first ``counts[r]`` bytes of every row of ``sparse`` back
    to back (the records' sparse form :meth:`PagePool.append_many` takes)."""
    n = counts.shape[0]
    offsets = np.empty(n + 1, np.int64)
    offsets[0] = 0
    for r in range(n):
        offsets[r + 1] = offsets[r] + counts[r]
    flat = np.empty(offsets[n], np.uint8)
    for r in range(n):
        flat[offsets[r] : offsets[r + 1]] = sparse[r, : counts[r]]
    return offsets, flat


def _merge_tokens(parts: list[EncodedBatch], b: int) -> EncodedBatch:
    """Consecutive token ranges of ``b`` rows, each encoded as one batch (rows ordered ``(row, token)``), as one
    batch of all their tokens in that order: what one encode call over the whole range returns."""
    if len(parts) == 1:
        return parts[0]
    nd, ns = parts[0].dense.shape[1], parts[0].scales.shape[1]
    dense = torch.cat([p.dense.reshape(b, -1, nd) for p in parts], dim=1).reshape(-1, nd)
    scales = torch.cat([p.scales.reshape(b, -1, ns) for p in parts], dim=1).reshape(-1, ns)
    counts = torch.cat([(p.sparse_offsets[1:] - p.sparse_offsets[:-1]).reshape(b, -1) for p in parts], dim=1)
    streams = []
    for r in range(b):
        for p in parts:
            s = p.num_rows // b
            streams.append(p.sparse[int(p.sparse_offsets[r * s]) : int(p.sparse_offsets[(r + 1) * s])])
    offsets = torch.zeros(counts.numel() + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(counts.reshape(-1), 0)
    return EncodedBatch(
        dense.contiguous(), scales.contiguous(), torch.cat(streams), offsets, parts[0].dim, parts[0].stored_scales
    )


def _check_encoded_rows(counts: np.ndarray, tokens: int) -> None:
    """Raise ValueError naming the first row ``encode_records`` refused (``counts[r] < 0``, an ``-ERR_*``):
    ``counts`` holds keys' rows, then values', each ``(row, token)`` with ``tokens`` tokens per row."""
    if min(counts.tolist()) >= 0:  # (a list's min: faster than numpy's on a few values)
        return
    r = int(np.flatnonzero(counts < 0)[0])
    n = counts.shape[0] // 2
    where = f"row {r % n // tokens}" + (f", token {r % tokens}" if tokens > 1 else "")
    raise ValueError(f"cannot encode the {'keys' if r < n else 'values'} of {where}: {ERROR_MESSAGES[int(-counts[r])]}")


def min_page_size(dim: int, config: OakenConfig) -> int:
    """Bytes the smallest page must hold: one token's dense record and the largest sparse record a row of ``dim``
    values can have (records never straddle pages, ``oakenkv.store.pages``)."""
    return max(record_size(dim, config), sparse_capacity(dim))


def _pool_config(pool_config: PoolConfig | None, dim: int, config: OakenConfig) -> PoolConfig:
    """``pool_config``, checked to hold a token of ``dim`` values; the default (4 KiB pages) with pages doubled until
    one does (a model of ``D = kv_heads x head_dim`` above ~4000 values)."""
    need = min_page_size(dim, config)
    if pool_config is not None and not isinstance(pool_config, PoolConfig):
        raise TypeError(f"pool_config must be a PoolConfig, got {type(pool_config).__name__}")
    if pool_config is None:
        page = PoolConfig().page_size
        while page < need:
            page *= 2
        return PoolConfig(page_size=page, budget_bytes=max(PoolConfig().budget_bytes, page))
    if pool_config.page_size < need:
        good = 1 << (need - 1).bit_length()
        raise ValueError(
            f"page_size {pool_config.page_size} cannot hold one token of {dim} values (a {record_size(dim, config)}-"
            f"byte dense record and up to {sparse_capacity(dim)} sparse bytes); use a page_size of at least {good}"
        )
    return pool_config


def _located(e: ValueError, kind: int, tokens: int) -> ValueError:
    """The codec's ``cannot encode row N: ...`` for rows ordered ``(row, token)``, ``tokens`` per row, as
    :func:`_check_encoded_rows` says it: the kind, the batch row and the token."""
    m = re.fullmatch(r"cannot encode row (\d+): (.*)", str(e), re.S)
    if m is None:
        return e
    r = int(m.group(1))
    where = f"row {r // tokens}" + (f", token {r % tokens}" if tokens > 1 else "")
    return ValueError(f"cannot encode the {'keys' if kind == KEY else 'values'} of {where}: {m.group(2)}")


def _refuse_nonfinite(keys: torch.Tensor, values: torch.Tensor) -> None:
    """Raise the ValueError the encoder's refusal gives (:func:`_check_encoded_rows`) for the first token of
    ``keys`` / ``values`` ``[B, H, S, hd]`` holding a NaN or an infinity (in float32, as the store holds them): the
    full-precision window takes the rows the encoder would, and refuses what it would refuse."""
    for name, x in (("keys", keys), ("values", values)):
        bad = ~torch.isfinite(x.detach().to(torch.float32)).all(dim=3).all(dim=1)  # [B, S]
        if bool(bad.any()):
            r, t = (int(i) for i in bad.nonzero()[0])
            where = f"row {r}" + (f", token {t}" if x.shape[2] > 1 else "")
            raise ValueError(f"cannot store the {name} of {where}: {ERROR_MESSAGES[ERR_NONFINITE]}")
    raise ValueError(f"cannot store these keys and values: {ERROR_MESSAGES[ERR_NONFINITE]}")


def encode_thresholds(thr: np.ndarray, adapt_state: Any, layer: int) -> np.ndarray:
    """float32 ``[2, 4]`` (``[2, 8]`` under adaptive grouping: the shift thresholds ``thr`` (``[2, 4]``, the
    layer's keys and values), then the current epoch's grouping ones): what the encoders take for ``layer``."""
    if adapt_state is None:
        return thr
    g = np.array([adapt_state.grouping(layer, kind) for kind in (KEY, VALUE)], dtype=np.float32)
    return np.concatenate([thr, g], axis=1)


def checked_row_starts(starts: np.ndarray | list[int], rows: int, held: int, old: np.ndarray | None) -> np.ndarray:
    """int64 ``[B]``: ``starts`` checked against a cache of ``rows`` rows (0: no rows yet) holding ``held`` tokens,
    where a row whose first sink token is already stored keeps its ``old`` start."""
    new = np.asarray(starts, dtype=np.int64).reshape(-1).copy()
    if (new < 0).any():
        raise ValueError(f"row starts must be >= 0, got {new.tolist()}")
    if rows and new.shape[0] != rows:
        raise ValueError(f"{new.shape[0]} row starts for a cache of {rows} rows")
    if held:  # a row whose sink is (partly) stored keeps its start
        old = old if old is not None and old.shape[0] == new.shape[0] else np.zeros_like(new)
        new = np.where(old < held, old, new)
    return new


def sink_slices(
    row_starts: np.ndarray | None, rows: int, sink_tokens: int, sink_end: int, past: int, s: int
) -> list[tuple[int, int, int, int]]:
    """Where the sink tokens fall in tokens ``[past, past + s)`` of each of ``rows`` rows whose sinks begin at
    ``row_starts`` (None, or another batch's: at 0): ``(row, a, e, j)`` for tokens ``[past + a, past + e)`` of
    ``row``, its sink tokens ``j, j + 1, ...``; empty when there are none (no row has one at or after ``sink_end``)."""
    n = sink_tokens
    if not n or past >= sink_end or s <= 0:
        return []
    starts = row_starts if row_starts is not None and row_starts.shape[0] == rows else None
    out = []
    for r in range(rows):
        p = 0 if starts is None else int(starts[r])
        lo, hi = max(p, past), min(p + n, past + s)
        if lo < hi:
            out.append((r, lo - past, hi - past, lo - p))
    return out


class PagedKVStore:
    """The state all layers of one :class:`OakenCache` share: the page pool, one sequence per batch row, the codec.

    Args:
        thresholds: the model's profile (per layer and kind).
        num_layers, num_kv_heads, head_dim: the decoder's KV shape.
        pool_config: page size and memory budget.
        codec: "auto" or "fast" (the numba kernels), or "reference" (plain PyTorch: slow, the same bytes).
        prefill_chunk: tokens encoded per chunk of a long update (``PREFILL_CHUNK``).
        residual: tokens of the full-precision window (module doc): 0 (default) encodes every token on arrival.
        adapt: adaptive grouping (``oakenkv.quant.adapt``): an :class:`~oakenkv.quant.adapt.AdaptConfig`, or None
            (default) for the profile's thresholds as they are. Every token is then decoded with the fixed shift
            thresholds (:attr:`thr`, what the page view carries) and encoded grouped by the thresholds of its epoch;
            the state (:attr:`adapt_state`) is shared by the batch's rows, per layer and kind.
    """

    def __init__(
        self,
        thresholds: Thresholds,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        pool_config: PoolConfig | None = None,
        codec: str = "auto",
        prefill_chunk: int = PREFILL_CHUNK,
        residual: int = 0,
        adapt: AdaptConfig | None = None,
    ) -> None:
        if adapt is not None and not isinstance(adapt, AdaptConfig):
            raise TypeError(f"adapt must be an AdaptConfig or None, got {type(adapt).__name__}")
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
        if not isinstance(prefill_chunk, int) or isinstance(prefill_chunk, bool) or prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be a positive int, got {prefill_chunk!r}")
        if isinstance(residual, bool) or not isinstance(residual, int) or residual < 0:
            raise ValueError(f"residual must be an int >= 0 (tokens kept at full precision), got {residual!r}")
        self.thresholds = thresholds
        self.config = config
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dim = num_kv_heads * head_dim
        #: Bytes of one dense page record, and of the scales at its start (``oakenkv.format.layout``).
        self.rec_size = record_size(self.dim, config)
        self.scale_bytes = scale_bytes(config)
        #: ``encode_records``' and ``decode_records``' format arguments (inner bits, outer bits, fp16, scale bytes),
        #: and their last one, the dense slot width (``OakenConfig.middle_bits``).
        self._record_format = (config.inner_bits, config.outer_bits, config.scale_dtype == "float16", self.scale_bytes)
        self._slot_bits = config.middle_bits
        self.pool = PagePool(_pool_config(pool_config, self.dim, config))
        self.encode, self.decode = codec_functions(codec)
        #: Whether the numba kernels are in use (then a decode step takes the fused single-token path).
        self.fast = codec != "reference"
        self._token_scratch: tuple[np.ndarray, ...] | None = None
        self.prefill_chunk = prefill_chunk
        #: Pool sequence id of each batch row.
        self.seqs: list[int] = []
        #: Per layer: the kernel's page tables of every row (:class:`LayerTables`), kept current by every write.
        self.tables: list[LayerTables] = []
        #: Per layer: ``append_token``'s targets, the (sequence, stream) of every row's keys, then its values.
        self._targets: list[TokenTargets] = []
        #: The pool's storage as one flat array (a view, renewed when the pool grows).
        self._flat: tuple[np.ndarray, np.ndarray] = (self.pool.data, self.pool.data.reshape(-1))
        #: Adaptive grouping's state (``oakenkv.quant.adapt``), or None.
        self.adapt_state = None if adapt is None else new_state(thresholds, adapt)
        #: Per layer and kind, the thresholds every token is decoded with: the profile's, or under adaptive
        #: grouping its fixed shift thresholds.
        self._decode_thresholds = [
            [
                thresholds.layer(i, k) if adapt is None else self.adapt_state.shift(i, kind)
                for kind, k in enumerate(KINDS)
            ]
            for i in range(num_layers)
        ]
        #: float32 ``[num_layers, 2, 4]``: ``(to_lo, ti_lo, ti_hi, to_hi)`` per layer and kind, for kernels.
        self.thr = np.array([[t.as_tuple() for t in row] for row in self._decode_thresholds], dtype=np.float32)
        #: float32 ``[num_layers, 2, 4]``: with static grids (``OakenConfig.static_grids``), each layer's and kind's
        #: static grid (of the thresholds in :attr:`thr`), which the records do not hold; with static levels
        #: (``OakenConfig.static_levels``) ``[num_layers, 2, 4 L]``, the levels' grids (level ``j``'s at ``4 j``,
        #: a record's level byte picks one); None without.
        self.static = None
        if config.static_grids:
            self.static = np.array([[static_grid_array(t, config) for t in row] for row in self.thr], np.float32)
        #: float32 ``[L]``: the static levels' clip factors (the record encoder picks each row's level), or None.
        self.levels = levels_array(config) if config.static_levels else None
        #: The online part of an ``oaken-plus`` profile (``oakenkv.calibrate.transforms``): None without one; else which
        #: layers transform their keys, and the float32 key shifts ``[num_layers, D]``.
        self.transforms = thresholds.transforms if thresholds.transforms and thresholds.transforms.online_keys else None
        if self.transforms is not None:
            t = self.transforms
            self._key_online = [lt.key_shift is not None or lt.key_rotation for lt in t.layers]
            self._key_shifts = t.key_shifts()
        #: Tokens at the start of every row also kept at 16 bits (module doc); 0 without an oaken-plus profile.
        self.sink_tokens = thresholds.transforms.sink_tokens if thresholds.transforms is not None else 0
        #: Per layer: float16 ``[B, 2, sink_tokens, D]``, the sink tokens' key rows (transformed) and value rows.
        self.sinks: list[np.ndarray] = []
        #: int64 ``[B]``: the position of each row's first real token, its first sink token (None: 0 for every row;
        #: :meth:`set_row_starts`).
        self.row_starts: np.ndarray | None = None
        #: No row has a sink token at or after this position (``max(row_starts) + sink_tokens``).
        self._sink_end = self.sink_tokens
        #: The last :meth:`split_sink_keep`: its mask and result (cleared when the rows or their starts change).
        self._split_memo: tuple[np.ndarray, Any] | None = None
        #: Tokens of the full-precision window (module doc); 0: none.
        self.residual = residual
        #: Per layer (with ``residual``): the window's keys (transformed, as the encoder takes them) and values,
        #: float32 ``([B, H, hd, 2 * residual], [B, H, 2 * residual, hd])``: keys transposed, so that scoring a query
        #: against them sweeps contiguous tokens (``merge_window``). The first :attr:`window_len` ``[layer]``
        #: tokens are held.
        self.windows: list[tuple[np.ndarray, np.ndarray]] = []
        self.window_len: list[int] = [0] * num_layers

    def _transform_keys(self, layer: int, rows: np.ndarray) -> None:
        """The profile's online key transform (``Transforms.key_rows``), in place, on float32 key rows ``[N, D]``.
        No-op without an oaken-plus profile."""
        if self.transforms is not None and self._key_online[layer]:
            self.transforms.key_rows(layer, rows, self._key_shifts[layer], out=rows)

    def restore_keys(self, layer: int, keys: torch.Tensor) -> torch.Tensor:
        """Dequantized keys ``[..., hd]`` of ``layer`` as stock attention must see them next to the model's own
        queries: an oaken-plus rotation undone (its shift stays: softmax ignores it)."""
        return keys if self.transforms is None else self.transforms.keys_restore(layer, keys)

    def rotate_queries(self, layer: int, q: np.ndarray) -> np.ndarray:
        """Queries ``[..., hd]`` (float32) for a kernel that reads this layer's keys: rotated like them under an
        oaken-plus key rotation (``q . k`` is unchanged because the rotation is orthogonal)."""
        if self.transforms is None or not self.transforms.layers[layer].key_rotation:
            return q
        return fwht(q)

    @property
    def batch_size(self) -> int:
        return len(self.seqs)

    def ensure_batch(self, batch_size: int) -> None:
        if not self.seqs:
            n = self.sink_tokens
            self.sinks = [np.zeros((batch_size, 2, n, self.dim), np.float16) for _ in range(self.num_layers)]
            if self.residual:  # (np.zeros: the pages of memory are only mapped as the window fills)
                shape = (batch_size, self.num_kv_heads, self.head_dim, 2 * self.residual)
                self.windows = [
                    (np.zeros(shape, np.float32), np.zeros(shape[:2] + shape[:1:-1], np.float32))
                    for _ in range(self.num_layers)
                ]
            self._set_rows([self.pool.new_sequence(2 * self.num_layers) for _ in range(batch_size)])
        elif batch_size != len(self.seqs):
            raise ValueError(f"the cache holds {len(self.seqs)} sequences but got a batch of {batch_size}")

    def num_tokens(self, layer: int) -> int:
        """Tokens of ``layer`` in the pages (the window's are :meth:`window_tokens`)."""
        return self.tables[layer].num_tokens if self.seqs else 0

    def window_tokens(self, layer: int) -> int:
        """Tokens of ``layer`` in the full-precision window (module doc), after those in the pages."""
        return self.window_len[layer]

    def _set_rows(self, seqs: list[int]) -> None:
        """Make ``seqs`` the batch rows and build every layer's tables from the pool (new rows, reorders)."""
        self.seqs = seqs
        self._targets = [
            self.pool.token_targets(
                [(seq, 2 * layer + KEY) for seq in seqs] + [(seq, 2 * layer + VALUE) for seq in seqs]
            )
            for layer in range(self.num_layers)
        ]
        self.tables = [LayerTables(len(seqs)) for _ in range(self.num_layers)]
        for layer in range(self.num_layers):
            self._sync_layer(layer)

    def _sync_layer(self, layer: int) -> None:
        """Bring ``layer``'s tables up to the pool's after a write to every row: from the last dense and sparse page
        and the first token the tables already held (those pages may have been copied on write)."""
        lt = self.tables[layer]
        t0 = lt.num_tokens
        dense_from = max(0, -(-t0 // (self.pool.config.page_size // self.rec_size)) - 1)
        counts = set()
        for r, seq in enumerate(self.seqs):
            for kind in (KEY, VALUE):
                table = self.pool.table(seq, 2 * layer + kind)
                lt.sync(r, kind, table, dense_from, max(0, int(lt.sparse_counts[r, kind]) - 1), t0)
                counts.add(table.num_tokens)
        if len(counts) > 1:
            raise RuntimeError(f"layer {layer}: the rows' streams hold different numbers of tokens {sorted(counts)}")
        lt.num_tokens = counts.pop() if counts else 0

    def _check_kv(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        _, h, _, hd = keys.shape
        if (h, hd) != (self.num_kv_heads, self.head_dim) or values.shape != keys.shape:
            raise ValueError(
                f"expected keys and values [B, {self.num_kv_heads}, S, {self.head_dim}], got "
                f"{tuple(keys.shape)} and {tuple(values.shape)}"
            )

    def _float_rows(self, layer: int, kind: int, x: torch.Tensor, out: np.ndarray | None = None) -> np.ndarray:
        """``[B, H, S, hd]`` -> float32 ``[B, S, D]``: one row per token, all heads of the layer (granularity
        "token"), as the encoder takes them (keys after the online key transform). Always the store's own array
        (a new one, or ``out``: float32 ``[B * S, D]``, C order): the transform and the encoder work in it, never
        in the caller's tensor.

        The copy is done by numpy on this thread: torch's multi-threaded copy of these small tensors waits for
        thread wake-ups on a loaded machine (docs/notebook/perf-notes.md)."""
        b, _, s, _ = x.shape
        x32 = x.detach().to(torch.float32).numpy()
        rows = np.empty((b * s, self.dim), np.float32) if out is None else out
        np.copyto(rows.reshape(b, s, self.num_kv_heads, self.head_dim), x32.transpose(0, 2, 1, 3))
        if kind == KEY:
            self._transform_keys(layer, rows)
        return rows.reshape(b, s, self.dim)

    def append(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[EncodedBatch, EncodedBatch]:
        """Encode and store new tokens of one layer for every row, atomically for the layer.

        Args:
            keys, values: ``[B, H, S, hd]`` float (any float dtype; quantized in float32).

        Returns:
            The encoded keys and values, rows ordered ``(b, s)``: ``[B * S]`` rows of ``D`` values.
        """
        self._check_kv(keys, values)
        self.ensure_batch(keys.shape[0])
        with serial_numba(keys.shape[0] * keys.shape[2] < SERIAL_BELOW_ROWS):
            rows = [self._float_rows(layer, kind, x) for kind, x in ((KEY, keys), (VALUE, values))]
            return self._append_rows(layer, rows[KEY], rows[VALUE])

    def _append_rows(self, layer: int, key_rows: np.ndarray, value_rows: np.ndarray) -> tuple[EncodedBatch, ...]:
        """:meth:`append` of float32 rows ``[B, S, D]`` (keys already transformed: :meth:`_float_rows`); the rows
        may be overwritten (the encoder works in them). Under adaptive grouping, one epoch at a time (each part
        atomic, as the chunks of a long update are)."""
        state = self.adapt_state
        s = key_rows.shape[1]
        if state is None or state.segment(layer, KEY, s) == s:
            return self._append_segment(layer, key_rows, value_rows)
        parts, a = [], 0
        while a < s:
            e = a + state.segment(layer, KEY, s - a)
            parts.append(self._append_segment(layer, key_rows[:, a:e], value_rows[:, a:e]))
            a = e
        b = key_rows.shape[0]
        return tuple(_merge_tokens([p[kind] for p in parts], b) for kind in (KEY, VALUE))  # type: ignore[return-value]

    def _append_segment(self, layer: int, key_rows: np.ndarray, value_rows: np.ndarray) -> tuple[EncodedBatch, ...]:
        """:meth:`_append_rows` of tokens of one adaptive epoch (or of any tokens without adaptive grouping)."""
        b, s, _ = key_rows.shape
        past = self.tables[layer].num_tokens
        encoded = []
        items = []
        sink_rows = []
        sink_at = self._sink_slices(past, s)
        # One serial section for both kinds: switching numba's thread count costs time (docs/notebook/perf-notes.md).
        with serial_numba(b * s < SERIAL_BELOW_ROWS):
            for kind, x in ((KEY, key_rows), (VALUE, value_rows)):
                rows_np = np.ascontiguousarray(x).reshape(b * s, self.dim)
                if sink_at:  # (a float16 copy now: the encoder may work in the rows)
                    r3 = rows_np.reshape(b, s, self.dim)
                    sink_rows.append([(r, j, r3[r, a:e].astype(np.float16)) for r, a, e, j in sink_at])
                try:
                    enc = self._encode(layer, kind, rows_np)
                except ValueError as e:  # name the (row, token) of the batch, not the flat index, and the kind
                    raise _located(e, kind, s) from None
                encoded.append(enc)
                dense, sparse, offs = to_records(enc)
                for r in range(b):
                    o = offs[r * s : (r + 1) * s + 1]
                    items.append(
                        (self.seqs[r], 2 * layer + kind, dense[r * s : (r + 1) * s], sparse[o[0] : o[-1]], o - o[0])
                    )
        self.pool.append_many(items)
        self._sync_layer(layer)
        for kind, parts in enumerate(sink_rows):  # after the pages took the tokens: the append stays atomic
            for r, j, x in parts:
                self.sinks[layer][r, kind, j : j + x.shape[0]] = x
        if self.adapt_state is not None:
            for kind, enc in enumerate(encoded):
                self.adapt_state.record(layer, kind, s, enc.sparse.numel(), enc.num_rows * self.dim)
        return encoded[0], encoded[1]

    def append_decoded(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`append`, returning the new tokens as stored instead of their encoding: float32 ``[B, S, D]`` key
        rows (in the store's frame: an oaken-plus transform is still applied, see :meth:`restore_keys`) and value
        rows, the values decoding the stored bytes gives (the attention of a first update reads them).

        A short update (fewer than ``SERIAL_BELOW_ROWS`` rows, the fast codec) takes one fused path: keys and values
        encoded straight into page records by one serial numba call (``encode_records``, as a decode step), decoded
        from the records by another (``decode_records``): the same bytes and numbers as :meth:`append` and the
        codec's decode, without their per-call work, which costs more than a short prefill's encoding
        (docs/notebook/perf-notes.md)."""
        self._check_kv(keys, values)
        b, _, s, _ = keys.shape
        state = self.adapt_state
        if not self.fast or b * s >= SERIAL_BELOW_ROWS or (state is not None and state.segment(layer, KEY, s) < s):
            encoded = self.append(layer, keys, values)
            return tuple(  # type: ignore[return-value]
                self.decode_encoded(layer, kind, e).numpy().reshape(b, s, self.dim) for kind, e in enumerate(encoded)
            )
        self.ensure_batch(b)
        n = b * s
        rows = np.empty((2 * n, self.dim), np.float32)  # keys' rows, then values'
        self._float_rows(layer, KEY, keys, rows[:n])
        self._float_rows(layer, VALUE, values, rows[n:])
        past = self.tables[layer].num_tokens
        sinks = None
        sink_at = self._sink_slices(past, s)
        if sink_at:  # (a float16 copy now: the encoder works in the rows)
            r4 = rows.reshape(2, b, s, self.dim)
            sinks = [(r, j, r4[:, r, a:e].astype(np.float16)) for r, a, e, j in sink_at]
        thr = np.repeat(self._encode_thr(layer), n, axis=0)  # each row's thresholds
        records = np.empty((2 * n, self.rec_size), np.uint8)
        sparse = np.empty((2 * n, sparse_capacity(self.dim)), np.uint8)
        counts = np.empty(2 * n, np.int64)
        static = None if self.static is None else np.repeat(self.static[layer], n, axis=0)  # as thr: each row's
        encode_records(rows, thr, *self._record_format, records, sparse, counts, self._slot_bits, static, self.levels)
        _check_encoded_rows(counts, s)
        offsets, flat = _packed_sparse(sparse, counts)
        items = []
        for kind in (KEY, VALUE):
            for r in range(b):
                a = (kind * b + r) * s
                o = offsets[a : a + s + 1]
                items.append((self.seqs[r], 2 * layer + kind, records[a : a + s], flat[o[0] : o[-1]], o - o[0]))
        self.pool.append_many(items)
        self._sync_layer(layer)
        if sinks is not None:
            for r, j, x in sinks:  # x: [2, n', D]
                self.sinks[layer][r, :, j : j + x.shape[1]] = x
        if state is not None:
            for kind in (KEY, VALUE):
                state.record(layer, kind, s, int(counts[kind * n : (kind + 1) * n].sum()), n * self.dim)
        status = np.empty(2 * n, np.int64)
        # into the rows' buffer: the decoder reads the records (the sink tokens' copy was taken before encoding)
        decode_records(records, sparse, counts, thr, *self._record_format, rows, status, self._slot_bits, static)
        r = first_error(status)
        if r >= 0:  # (our own records: this would be a bug)
            raise RuntimeError(
                f"layer {layer}: a record just written does not decode: {ERROR_MESSAGES[int(status[r])]}"
            )
        out = rows.reshape(2, b, s, self.dim)
        return out[KEY], out[VALUE]

    def _encode(self, layer: int, kind: int, rows: np.ndarray) -> EncodedBatch:
        """Encode float32 rows ``[N, D]`` (C order) with ``layer``'s thresholds for ``kind`` (under adaptive
        grouping: shifted by the fixed ones, grouped by the current epoch's)."""
        if self.fast:  # the numba codec without the public wrapper's checks: rows and thresholds are ours
            return encode_trusted(rows, self._encode_thr(layer)[kind], self.config)
        thr = self._decode_thresholds[layer][kind]
        if self.adapt_state is None:
            return self.encode(torch.from_numpy(rows), thr, self.config)
        return self.encode(torch.from_numpy(rows), thr, self.config, self.adapt_state.grouping(layer, kind))

    def _encode_thr(self, layer: int) -> np.ndarray:
        """float32 ``[2, 4]`` (``[2, 8]`` under adaptive grouping): what the encoders take for ``layer``'s keys and
        values (:func:`encode_thresholds`)."""
        return encode_thresholds(self.thr[layer], self.adapt_state, layer)

    def decode_encoded(self, layer: int, kind: int, enc: EncodedBatch) -> torch.Tensor:
        """float32 ``[N, D]``: ``enc`` decoded, a batch this store encoded for ``layer`` and ``kind`` (what
        :meth:`append` returned): the codec's decode without its structural checks of foreign input."""
        if self.fast:
            return decode_trusted(enc, self.thr[layer, kind], self.config)
        return self.decode(enc, self._decode_thresholds[layer][kind], self.config)

    def window_update(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor
    ) -> list[tuple[EncodedBatch, EncodedBatch]]:
        """Add new tokens ``[B, H, S, hd]`` of one layer to its full-precision window (module doc), encoding the
        oldest into the pages once the window would hold ``2 * residual`` or more; returns the encoded keys and
        values of each chunk encoded (:meth:`append`'s results, in token order; empty when none was).

        A flush of several chunks is not atomic as a whole (each chunk is): after a
        :class:`~oakenkv.store.pages.PoolExhaustedError` the store must be reset, as after a long :meth:`append`.
        """
        if not self.residual:
            raise RuntimeError("window_update needs a store with residual > 0")
        self._check_kv(keys, values)
        b, _, s, _ = keys.shape
        if len(self.seqs) != b:  # (new rows, or the error for a batch the store does not hold)
            self.ensure_batch(b)
        kt, vw = self.windows[layer]
        n = self.window_len[layer]
        total = n + s
        if total < 2 * self.residual and self.transforms is None:  # the usual case: the window takes the tokens
            k, v = keys.detach(), values.detach()  # (float32's numpy view: a .to() call costs more than the copy)
            kt[:, :, :, n:total] = (k if k.dtype == torch.float32 else k.float()).numpy().transpose(0, 1, 3, 2)
            vw[:, :, n:total] = (v if v.dtype == torch.float32 else v.float()).numpy()
            # refused as the encoder refuses them: the window's slots past window_len are free, so nothing changed
            if not (np.isfinite(kt[:, :, :, n:total]).all() and np.isfinite(vw[:, :, n:total]).all()):
                _refuse_nonfinite(keys, values)
            self.window_len[layer] = total
            return []
        with serial_numba(self.transforms is not None and b * s < SERIAL_BELOW_ROWS):
            rows = [self._float_rows(layer, kind, x) for kind, x in ((KEY, keys), (VALUE, values))]
        if not (np.isfinite(rows[KEY]).all() and np.isfinite(rows[VALUE]).all()):  # (before anything is written)
            _refuse_nonfinite(torch.from_numpy(rows[KEY]).unsqueeze(1), torch.from_numpy(rows[VALUE]).unsqueeze(1))
        if total < 2 * self.residual:
            self._window_write(layer, n, rows[KEY], rows[VALUE])
            self.window_len[layer] = total
            return []
        if n:
            held = self._window_rows(layer, 0, n)
            rows = [np.concatenate([held[kind], rows[kind]], axis=1) for kind in (KEY, VALUE)]
        flush = total - self.residual
        chunks = []
        for a in range(0, flush, self.prefill_chunk):
            e = min(flush, a + self.prefill_chunk)
            # (copies: the encoder may work in its rows, and the window's are still needed)
            chunks.append(self._append_rows(layer, rows[KEY][:, a:e].copy(), rows[VALUE][:, a:e].copy()))
        self._window_write(layer, 0, rows[KEY][:, flush:], rows[VALUE][:, flush:])
        self.window_len[layer] = self.residual
        return chunks

    def _window_write(self, layer: int, at: int, key_rows: np.ndarray, value_rows: np.ndarray) -> None:
        """Put float32 rows ``[B, S, D]`` (keys transformed) into the window from token ``at`` on."""
        kt, vw = self.windows[layer]
        b, s, _ = key_rows.shape
        heads = (b, s, self.num_kv_heads, self.head_dim)
        kt[:, :, :, at : at + s] = key_rows.reshape(heads).transpose(0, 2, 3, 1)
        vw[:, :, at : at + s] = value_rows.reshape(heads).transpose(0, 2, 1, 3)

    def _window_rows(self, layer: int, a: int, e: int) -> tuple[np.ndarray, np.ndarray]:
        """The window's tokens ``[a, e)`` as float32 rows ``[B, e - a, D]`` (keys as held: transformed); copies."""
        kt, vw = self.windows[layer]
        b = kt.shape[0]
        keys = np.ascontiguousarray(kt[:, :, :, a:e].transpose(0, 3, 1, 2)).reshape(b, e - a, self.dim)
        values = np.ascontiguousarray(vw[:, :, a:e].transpose(0, 2, 1, 3)).reshape(b, e - a, self.dim)
        return keys, values

    def window(self, layer: int, kind: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The window's keys or values of one layer as attention takes them: ``[B, H, n, hd]`` (keys restored to
        the model's frame up to an oaken-plus shift, as :meth:`read` returns them)."""
        n = self.window_len[layer]
        if not self.seqs:
            return torch.zeros(0, self.num_kv_heads, 0, self.head_dim, dtype=dtype)
        kt, vw = self.windows[layer]
        x = torch.from_numpy(kt[..., :n]).transpose(2, 3) if kind == KEY else torch.from_numpy(vw[:, :, :n])
        return (self.restore_keys(layer, x) if kind == KEY else x).to(dtype)

    def append_token(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store one new token ``[B, H, 1, hd]`` of one layer for every row (a decode step), atomically.

        Same bytes as :meth:`append`; one serial numba call encodes the ``2 B`` rows straight into page records
        and the pool appends them with scalar bookkeeping (:meth:`PagePool.append_token`). The layer's tables
        take the new sparse lengths, and a page id only where a page was added or copied. Needs the fast codec.
        """
        b, h, s, hd = keys.shape
        if (h, s, hd) != (self.num_kv_heads, 1, self.head_dim) or values.shape != keys.shape:
            raise ValueError(
                f"append_token expects keys and values [B, {self.num_kv_heads}, 1, {self.head_dim}], got "
                f"{tuple(keys.shape)} and {tuple(values.shape)}"
            )
        if len(self.seqs) != b:  # (new rows, or the error for a batch the cache does not hold)
            self.ensure_batch(b)
        scratch = self._token_scratch
        if scratch is None or scratch[0].shape[0] != 2 * b:
            scratch = self._token_scratch = self._make_token_scratch(b)
        rows, records, sparse, counts, thr, static = scratch
        # The rows, float32 [2B, D]: [B, H, 1, hd] -> [B, H * hd], keys then values (the online key transform runs on
        # the key rows, as in append). numpy copies on this thread (see append); a float32 tensor's numpy view is all
        # it takes (a .to() call costs more than the copy).
        k = keys.detach()
        v = values.detach()
        rows[:b] = (k if k.dtype == torch.float32 else k.float()).numpy().reshape(b, self.dim)
        rows[b:] = (v if v.dtype == torch.float32 else v.float()).numpy().reshape(b, self.dim)
        self._transform_keys(layer, rows[:b])  # an oaken-plus profile's online key transform, in place
        t = self.tables[layer].num_tokens
        # (a copy before the encoder works in the rows)
        sink = rows.astype(np.float16) if t < self._sink_end and self._sink_slices(t, 1) else None
        encode_records(
            rows, thr[layer], *self._record_format, records, sparse, counts, self._slot_bits,
            None if static is None else static[layer], self.levels,
        )  # fmt: skip
        _check_encoded_rows(counts, 1)
        changed = self.pool.append_token(self._targets[layer], records, sparse, counts)
        state = self.adapt_state
        if state is not None:  # the epoch's counts; at its end the layer's grouping thresholds move
            moved = [state.record(layer, kind, 1, int(counts[kind * b : (kind + 1) * b].sum()), b * self.dim)
                     for kind in (KEY, VALUE)]  # fmt: skip
            if any(moved):
                g = self._encode_thr(layer)
                thr[layer, :b], thr[layer, b:] = g[KEY], g[VALUE]
        if sink is not None:
            for r, _, _, j in self._sink_slices(t, 1):
                self.sinks[layer][r, KEY, j] = sink[r]
                self.sinks[layer][r, VALUE, j] = sink[b + r]
        lt = self.tables[layer]
        if t >= lt.sparse_lengths.shape[2]:
            lt.sparse_lengths = grown(lt.sparse_lengths, t + 1)
        _set_lengths(lt.sparse_lengths, t, counts)
        lt.num_tokens = t + 1
        for i in changed:  # a page added or copied on write: its id (rarely: every page_size // record bytes)
            r, kind = i % b, i // b
            table = self.pool.table(self.seqs[r], 2 * layer + kind)
            lt.sync(r, kind, table, table.dense_pages.n - 1, max(0, table.sparse_pages.n - 1), t + 1)

    def _make_token_scratch(self, b: int) -> tuple[Any, ...]:
        """append_token's buffers for ``2 b`` rows, and each layer's thresholds per row (``[.., 8]`` under adaptive
        grouping: :meth:`_encode_thr`) and static grids per row (static grids; else None)."""
        m = 2 * b
        thr = np.empty((self.num_layers, m, 4 if self.adapt_state is None else 8), np.float32)
        for layer in range(self.num_layers):
            g = self._encode_thr(layer)
            thr[layer, :b], thr[layer, b:] = g[KEY], g[VALUE]
        static = None if self.static is None else np.repeat(self.static, b, axis=1)  # [L, 2b, 4], as thr
        return (
            np.empty((m, self.dim), np.float32),
            np.empty((m, self.rec_size), np.uint8),
            np.empty((m, sparse_capacity(self.dim)), np.uint8),
            np.empty(m, np.int64),
            thr,
            static,
        )

    def __getstate__(self) -> dict[str, Any]:
        # ``_flat`` holds a view of the pool's storage; copy.deepcopy and pickle copy a view apart from its base,
        # so a copy's kernels would read stale bytes while its writes went to its own pool (wrong logits, or a
        # "corrupt" sparse stream). A copy rebuilds the view of its own pool.
        state = self.__dict__.copy()
        del state["_flat"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._flat = (self.pool.data, self.pool.data.reshape(-1))

    def layer_view(self, layer: int) -> LayerView:
        """Where ``layer``'s keys and values of every row lie in the pool: the :class:`LayerView` a decode kernel
        reads (see its docstring for shapes and layout).

        The arrays are the layer's :class:`LayerTables`, which every write keeps current: building the view
        copies nothing. It is valid until the next write (append, eviction, reorder).
        """
        lt = self.tables[layer]
        data = self.pool.data
        if self._flat[0] is not data:  # the pool grew: its storage is a new array
            self._flat = (data, data.reshape(-1))
        cfg = self.config
        return lt.view(
            self._flat[1], self.pool.config.page_size, self.rec_size, self.scale_bytes, self.thr[layer],
            cfg.inner_bits, cfg.outer_bits, self.num_kv_heads, middle_bits=cfg.middle_bits,
            static_grid=NO_STATIC_GRID if self.static is None else self.static[layer],
        )  # fmt: skip

    def check_tables(self) -> None:
        """Assert that every layer's :class:`LayerTables` equal the pool's tables (for tests)."""
        for layer, lt in enumerate(self.tables):
            for r, seq in enumerate(self.seqs):
                for kind in (KEY, VALUE):
                    t = self.pool.table(seq, 2 * layer + kind)
                    where = f"layer {layer} row {r} kind {kind}"
                    assert lt.num_tokens == t.num_tokens, f"{where}: {lt.num_tokens} != {t.num_tokens} tokens"
                    assert np.array_equal(lt.dense_pages[r, kind, : t.dense_pages.n], t.dense_pages.view), where
                    assert lt.sparse_counts[r, kind] == t.sparse_pages.n, f"{where}: sparse page count"
                    n = t.sparse_pages.n
                    assert np.array_equal(lt.sparse_pages[r, kind, :n], t.sparse_pages.view), where
                    assert np.array_equal(lt.sparse_first[r, kind, :n], t.sparse_first.view), where
                    assert np.array_equal(lt.sparse_lengths[r, kind, : t.num_tokens], t.sparse_len.view), where

    def bits_per_value(self) -> dict[str, float]:
        """Bits per stored value, from the pages: ``format``: what the Oaken format stores (dense records,
        sparse records and the 16-bit header per token; plus the sink tokens' 16 bits per value and the
        full-precision window's 32); ``with_pages``: everything the store holds (whole pages in use + tables + sink
        tokens + window)."""
        pool = self.pool
        tokens = dense = sparse = 0
        for seq in self.seqs:
            for stream in range(pool.num_streams(seq)):
                t = pool.table(seq, stream)
                tokens += t.num_tokens
                dense += t.num_tokens * t.rec_size
                sparse += int(t.sparse_len.view.sum())
        values = (tokens + 2 * len(self.seqs) * sum(self.window_len)) * self.dim
        if values == 0:
            return {"format": float("nan"), "with_pages": float("nan")}
        side = self.sink_bytes() + self.window_bytes()
        return {
            "format": 8.0 * (dense + sparse + HEADER_BITS // 8 * tokens + side) / values,
            "with_pages": 8.0 * self.stats().total_bytes / values,
        }

    def read(self, layer: int, kind: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dequantize one layer's whole stored keys or values (the reference read path): ``[B, H, T, hd]``.

        Tokens a sliding window evicted (:meth:`evict_before`) read as zeros; the sliding mask hides them. Keys
        come back in the model's frame up to an oaken-plus shift (:meth:`restore_keys`).
        """
        out = []
        for seq in self.seqs:
            stream = 2 * layer + kind
            table = self.pool.table(seq, stream)
            start = table.evicted_before
            if table.num_tokens == 0:  # (a full-precision window may hold every token so far)
                out.append(torch.zeros(self.num_kv_heads, 0, self.head_dim))
                continue
            dense = self.pool.read_dense(seq, stream, start)
            sparse, offs = self.pool.read_sparse(seq, stream, start)
            static = None if self.static is None else self.static[layer, kind]
            if static is not None and self.levels is not None:
                static = static.reshape(-1, 4)  # the levels' grids, one per row (format.layout.level_columns)
            enc = from_records(dense, sparse, offs, self.dim, self.config, static)
            thr = self._decode_thresholds[layer][kind]
            with serial_numba(enc.num_rows < SERIAL_BELOW_ROWS):
                x = self.decode(enc, thr, self.config) if enc.num_rows else torch.zeros(0, self.dim)
            if start:
                x = torch.cat([torch.zeros(start, self.dim, dtype=x.dtype), x])
            out.append(x.reshape(-1, self.num_kv_heads, self.head_dim).permute(1, 0, 2))
        x = self.apply_sinks(layer, kind, torch.stack(out))
        return (self.restore_keys(layer, x) if kind == KEY else x).to(dtype)

    def apply_sinks(self, layer: int, kind: int, x: torch.Tensor) -> torch.Tensor:
        """Put the layer's sink tokens (module doc) into ``x``, its dequantized keys (in the pages' frame, before
        :meth:`restore_keys`) or values ``[B, H, T, hd]`` of the whole history, in place; returns ``x``. Positions
        a sliding window evicted stay as they read. No-op without sink tokens."""
        t = x.shape[2]
        if not self.sink_tokens or not self.seqs or t == 0:
            return x
        start = self.pool.table(self.seqs[0], 2 * layer + kind).evicted_before
        for r, a, e, j in self._sink_slices(start, t - start) or ():
            sink = torch.from_numpy(self.sinks[layer][r, kind, j : j + e - a])  # [n', D]
            x[r, :, start + a : start + e] = sink.reshape(e - a, self.num_kv_heads, self.head_dim).transpose(0, 1)
        return x

    def set_row_starts(self, starts: np.ndarray | list[int]) -> None:
        """Declare where each batch row's real tokens begin (its first sink token): int ``[B]``, from the attention
        mask (``oakenkv.hf.cache``: a left-padded row begins after its padding). A row whose first sink token is
        already stored keeps the start it was stored with."""
        held = self.num_tokens(0) if self.seqs else 0
        new = checked_row_starts(starts, len(self.seqs), held, self.row_starts)
        self.row_starts = new
        self._sink_end = int(new.max(initial=0)) + self.sink_tokens
        self._split_memo = None

    def _sink_slices(self, past: int, s: int) -> list[tuple[int, int, int, int]]:
        """Where the sink tokens fall in tokens ``[past, past + s)`` of every row: ``(row, a, e, j)`` for tokens
        ``[past + a, past + e)`` of ``row``, its sink tokens ``j, j + 1, ...`` (:func:`sink_slices`)."""
        return sink_slices(self.row_starts, len(self.seqs), self.sink_tokens, self._sink_end, past, s)

    def split_sink_keep(self, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """For the packed decode attention over the pages' tokens: ``keep`` (uint8 ``[B, T]``, the mask over the
        pages' tokens) as ``(keep with every row's sink positions cleared, uint8 [B, sink_tokens]: the mask of each
        row's sink tokens ``j``)``; None without sink tokens. ``keep`` is never written (it is the attention's cached
        mask, shared by the layers of a step), so the result for the last ``keep`` is remembered: one split per
        decode step, not one per layer."""
        memo = self._split_memo
        if memo is not None and memo[0] is keep:
            return memo[1]
        n, (b, t) = self.sink_tokens, keep.shape
        starts = self.row_starts if self.row_starts is not None and self.row_starts.shape[0] == b else None
        lo = 0 if starts is None else int(starts.min())
        if not n or lo >= t:
            return None
        page_keep = keep.copy()
        sink_keep = np.zeros((b, n), np.uint8)
        if starts is None or lo == int(starts.max()):  # every row's sinks at tokens [lo, lo + n): two slices
            hi = min(lo + n, t)
            sink_keep[:, : hi - lo] = keep[:, lo:hi]
            page_keep[:, lo:hi] = 0
        else:
            for r, a, e, j in self._sink_slices(0, t):
                sink_keep[r, j : j + e - a] = keep[r, a:e]
                page_keep[r, a:e] = 0
        self._split_memo = (keep, (page_keep, sink_keep))
        return page_keep, sink_keep

    def sink_bytes(self) -> int:
        """Bytes of the sink tokens held (16 bits per value of the tokens stored so far)."""
        if not self.sink_tokens or not self.seqs:
            return 0
        held = sum(e - a for lt in self.tables for _, a, e, _ in self._sink_slices(0, lt.num_tokens))
        return 2 * held * self.dim * 2

    def evict_before(self, layer: int, token: int) -> int:
        """Release the pages of one layer (keys and values, every row) that hold only tokens below ``token``;
        returns the table slots released. For sliding-window layers: no query will attend to those tokens."""
        released = 0
        lt = self.tables[layer] if self.seqs else None
        for r, seq in enumerate(self.seqs):
            for kind in (KEY, VALUE):
                table = self.pool.table(seq, 2 * layer + kind)
                n = self.pool.evict_before(seq, 2 * layer + kind, token)
                if n:  # released slots became EVICTED (a prefix of the page lists): copy the lists again
                    lt.sync(r, kind, table, 0, 0, table.num_tokens)
                released += n
        return released

    def reorder(self, index: list[int]) -> None:
        """New row ``i`` = old row ``index[i]`` (beam search, batch selection): forks and frees, no KV copies."""
        if not self.seqs:
            return
        new = self.pool.reorder(self.seqs, index)
        self.sinks = [sink[index] for sink in self.sinks]
        if self.row_starts is not None and self.row_starts.shape[0] == len(self.seqs):
            self.row_starts = self.row_starts[index]
        self._split_memo = None
        self.windows = [(kt[index], vw[index]) for kt, vw in self.windows]
        self._set_rows(new)

    def reset(self) -> None:
        for seq in self.seqs:
            self.pool.free(seq)
        if self.adapt_state is not None:
            self.adapt_state.reset()
            self._token_scratch = None  # (its grouping thresholds are the old sequence's)
        self.seqs = []
        self.tables = []
        self._targets = []
        self.sinks = []
        self.row_starts = None
        self._sink_end = self.sink_tokens
        self._split_memo = None
        self.windows = []
        self.window_len = [0] * self.num_layers

    def window_bytes(self) -> int:
        """Bytes of the full-precision window's tokens held (32 bits per value, keys and values, every row)."""
        return 4 * 2 * self.dim * len(self.seqs) * sum(self.window_len)

    def stats(self) -> PoolStats:
        stats = self.pool.stats()
        if self.sink_tokens or self.residual:
            stats = dataclasses.replace(stats, sink_bytes=self.sink_bytes(), window_bytes=self.window_bytes())
        return stats
