"""The reference implementation of the Oaken format (``oakenkv.format.layout``): plain PyTorch and Python loops over the
COO stream, slow and obvious. Every fast path is tested against it byte for byte.

:func:`pack` / :func:`unpack` convert the reference quantizer's output (``oakenkv.quant.quantizer``) to and from the
bytes (with static grids, ``OakenConfig.static_grids``, the stored form holds the outer scales only: :func:`pack`
checks that the others are the layer's static grid, :func:`unpack` that they still are, both from the thresholds;
with static levels, ``OakenConfig.static_levels``, the grid of each row's level, whose index the stored form holds);
:func:`encode` / :func:`decode` chain them with the quantizer and have the signatures of
``oakenkv.kernels.codec.encode`` /
``decode`` (the fast pair), so a store can run on either.
"""

from __future__ import annotations

import torch

from oakenkv.format.config import OakenConfig
from oakenkv.format.layout import (
    ADVANCE_CONTINUE,
    CHUNK_SIZE,
    COO_GROUP_BIT,
    COO_INDEX_MASK,
    ERR_SCALE_NONFINITE,
    ERROR_MESSAGES,
    MAX_ROW_SPARSE_BYTES,
    NUM_SCALES,
    STATIC_COLUMNS,
    CorruptDataError,
    EncodedBatch,
    check_dim,
    check_encoded,
    dense_bytes,
    stored_scales,
)
from oakenkv.quant.quantizer import (
    GROUP_INNER,
    GROUP_MIDDLE,
    GROUP_OUTER,
    QuantizedVectors,
    ThresholdsLike,
    decodes_finite,
    dequantize,
    format_level_grids,
    format_static_grid,
    group_bits,
    quantize,
)


def _encode_coo_row(positions: list[int], entry_bytes: list[int]) -> list[int]:
    """The COO byte stream of one row from its outliers' positions (increasing) and entry bytes."""
    out: list[int] = []
    c, p, prev = 0, -1, 0x00
    for pos, e in zip(positions, entry_bytes, strict=True):
        cc, i = divmod(pos, CHUNK_SIZE)
        natural = e != prev and ((cc == c and i > p) or (cc == c + 1 and i <= p))
        if not natural:
            out.append(prev)  # escape: a copy of the previous byte
            k = cc - c
            while k >= ADVANCE_CONTINUE:
                out.append(ADVANCE_CONTINUE)
                k -= ADVANCE_CONTINUE
            out.append(k)
        out.append(e)
        c, p, prev = cc, i, e
    return out


def _decode_coo_row(stream: list[int], dim: int, row: int) -> tuple[list[int], list[int]]:
    """Positions and entry bytes of one row's COO stream; raises CorruptDataError on any invalid byte."""
    positions: list[int] = []
    entries: list[int] = []
    c, p, prev = 0, -1, 0x00
    j, n = 0, len(stream)
    while j < n:
        e = stream[j]
        j += 1
        if prev is not None and e == prev:
            k = 0
            while True:
                if j >= n:
                    raise CorruptDataError(f"row {row}: escape at sparse byte {j - 1} is cut off before its advance")
                a = stream[j]
                j += 1
                k += a
                if a != ADVANCE_CONTINUE:
                    break
            if k == 0 and p != -1:
                raise CorruptDataError(f"row {row}: zero chunk advance after an entry (sparse byte {j - 1})")
            if j >= n:
                raise CorruptDataError(f"row {row}: escape ending at sparse byte {j - 1} is not followed by an entry")
            c += k
            p, prev = -1, None
            continue
        i = e & COO_INDEX_MASK
        if i <= p:
            c += 1
        pos = c * CHUNK_SIZE + i
        if pos >= dim:
            raise CorruptDataError(f"row {row}: COO entry at sparse byte {j - 1} points at value {pos} >= D = {dim}")
        positions.append(pos)
        entries.append(e)
        p, prev = i, e
    return positions, entries


def _quantized_level(q: QuantizedVectors, config: OakenConfig) -> torch.Tensor | None:
    """``q.level`` checked against ``config``: uint8 ``[N]`` indices below ``len(static_levels)`` with static levels
    (ValueError otherwise), None without (ValueError if ``q`` has some)."""
    n_levels = len(config.static_levels)
    if not n_levels:
        if q.level is not None:
            raise ValueError("q has static level indices, its config no static levels")
        return None
    lv = q.level
    if not isinstance(lv, torch.Tensor) or lv.dtype != torch.uint8 or tuple(lv.shape) != (q.codes.shape[0],):
        raise ValueError(f"a static-level config needs q.level, uint8 [{q.codes.shape[0]}], got {lv!r}")
    if lv.numel() and int(lv.max()) >= n_levels:
        raise ValueError(f"q.level holds an index >= {n_levels}, the number of static levels")
    return lv.contiguous()


def _check_quantized(q: QuantizedVectors, config: OakenConfig) -> None:
    if q.codes.dim() != 2 or q.codes.shape != q.groups.shape:
        raise ValueError(f"codes and groups must both be [N, D], got {tuple(q.codes.shape)}, {tuple(q.groups.shape)}")
    if q.codes.dtype != torch.uint8 or q.groups.dtype != torch.uint8:
        raise ValueError(f"codes and groups must be uint8, got {q.codes.dtype}, {q.groups.dtype}")
    n, d = q.codes.shape
    check_dim(int(d))
    if q.mins.shape != (n, 3) or q.maxs.shape != (n, 3):
        raise ValueError(f"mins and maxs must be [N, 3] = [{n}, 3], got {tuple(q.mins.shape)}, {tuple(q.maxs.shape)}")
    if q.groups.numel() and int(q.groups.max()) > GROUP_OUTER:
        raise ValueError("groups must be GROUP_MIDDLE, GROUP_INNER or GROUP_OUTER")
    for g, b in enumerate(group_bits(config)):
        member = q.groups == g
        if member.any() and int(q.codes[member].max()) >= 2**b:
            raise ValueError(f"a code of group {g} does not fit in its {b} bits")


def _pack_slots(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """The dense bytes of codes uint8 ``[N, D]``: the low ``bits`` bits of each, as a little-endian bit stream per row
    (value ``j`` at stream bits ``bits * j ..``), zero-padded to whole bytes: uint8 ``[N, dense_bytes(D, bits)]``."""
    n, d = codes.shape
    slots = (codes & ((1 << bits) - 1)).to(torch.int64)
    # every bit of the stream, in order: bit i of value j is stream bit bits * j + i
    stream = ((slots[:, :, None] >> torch.arange(bits)) & 1).reshape(n, d * bits)
    nbytes = dense_bytes(d, bits)
    stream = torch.cat([stream, torch.zeros((n, 8 * nbytes - d * bits), dtype=torch.int64)], dim=1)
    return (stream.reshape(n, nbytes, 8) << torch.arange(8)).sum(dim=2).to(torch.uint8).contiguous()


def _unpack_slots(dense: torch.Tensor, dim: int, bits: int) -> torch.Tensor:
    """The inverse of :func:`_pack_slots`: the ``bits``-bit slot of each of ``dim`` values, uint8 ``[N, dim]``."""
    n = dense.shape[0]
    stream = ((dense.to(torch.int64)[:, :, None] >> torch.arange(8)) & 1).reshape(n, 8 * dense.shape[1])
    stream = stream[:, : dim * bits]
    return (stream.reshape(n, dim, bits) << torch.arange(bits)).sum(dim=2).to(torch.uint8)


def _static_mismatch(
    scales: torch.Tensor, thr: ThresholdsLike | None, config: OakenConfig, level: torch.Tensor | None = None
) -> int:
    """For a static-grid config: the first row whose middle and inner scale columns (``scales [N, 6]``) are not the
    layer's static grid (:func:`format_static_grid` of ``thr``; with static levels the grid of the row's level,
    ``level`` uint8 ``[N]`` of valid indices), or -1; ValueError without ``thr``."""
    if thr is None:
        raise ValueError("a static-grid config (static_grids=True) needs the thresholds: they define the static grid")
    if config.static_levels:
        assert level is not None
        grid = torch.tensor(format_level_grids(thr, config), dtype=torch.float32)[level.to(torch.int64)]
    else:
        grid = torch.tensor(format_static_grid(thr, config), dtype=torch.float32)
    bad = torch.nonzero(~(scales[:, :STATIC_COLUMNS].to(torch.float32) == grid).all(dim=1))
    return int(bad[0, 0]) if bad.numel() else -1


def pack(q: QuantizedVectors, config: OakenConfig | None = None, thr: ThresholdsLike | None = None) -> EncodedBatch:
    """Reference packer: the quantizer's codes and scales as an :class:`EncodedBatch` (bit-exact, lossless).

    Args:
        q: output of :func:`oakenkv.quant.quantizer.quantize` (codes/groups uint8 ``[N, D]``, mins/maxs ``[N, 3]``).
        config: the config ``q`` was quantized with (only the slot width, the group bits and static grids are used;
            default: the paper's).
        thr: the thresholds ``q`` was quantized with: required with static grids, whose middle and inner end
            points are not stored (ValueError unless every row's are the static grid of ``thr``, with static levels
            the grid of the row's level, ``q.level``); unused otherwise.
    """
    config = config or OakenConfig()
    _check_quantized(q, config)
    level = _quantized_level(q, config)
    n, d = q.codes.shape
    codes = q.codes.to(torch.uint8)
    dense = _pack_slots(codes, config.middle_bits)
    # scales: [mid_min, mid_max, inner_min, inner_max, outer_min, outer_max]
    scales = torch.stack([q.mins, q.maxs], dim=2).reshape(n, NUM_SCALES).to(config.scale_torch_dtype).contiguous()
    if config.static_grids and (r := _static_mismatch(scales, thr, config, level)) >= 0:
        raise ValueError(f"row {r}: its middle or inner end points are not the static grid, which is not stored")
    # sparse: one entry byte per outlier, then the per-row stream with escapes.
    outlier = q.groups != GROUP_MIDDLE
    col = torch.arange(d, dtype=torch.int64).expand(n, d)
    entry = (
        (col % CHUNK_SIZE).to(torch.int64)
        | torch.where(q.groups == GROUP_OUTER, COO_GROUP_BIT, 0)
        | (((codes.to(torch.int64) >> config.middle_bits) & 1) << 7)
    )
    streams: list[int] = []
    offsets = [0]
    for r in range(n):
        m = outlier[r]
        row = _encode_coo_row(col[r][m].tolist(), entry[r][m].tolist())
        if len(row) > MAX_ROW_SPARSE_BYTES:  # unreachable for D <= MAX_DIM; kept as the format's invariant
            raise ValueError(f"row {r} needs {len(row)} sparse bytes, more than the 16-bit header allows")
        streams.extend(row)
        offsets.append(len(streams))
    return EncodedBatch(
        dense=dense,
        scales=scales,
        sparse=torch.tensor(streams, dtype=torch.uint8),
        sparse_offsets=torch.tensor(offsets, dtype=torch.int64),
        dim=int(d),
        stored_scales=stored_scales(config),
        level=level,
    )


def unpack(enc: EncodedBatch, config: OakenConfig | None = None, thr: ThresholdsLike | None = None) -> QuantizedVectors:
    """Reference unpacker: the exact inverse of :func:`pack`. Raises :class:`CorruptDataError` on invalid input.

    ``thr``: required with static grids (ValueError without): a row whose middle or inner scale columns are not the
    static grid of ``thr`` (what a reader restores, ``oakenkv.format.layout.from_records``; with static levels the
    grid of the row's level, ``enc.level``) is corrupt."""
    config = config or OakenConfig()
    check_encoded(enc, config)
    if config.static_grids and (r := _static_mismatch(enc.scales, thr, config, enc.level)) >= 0:
        raise CorruptDataError(f"row {r}: its middle or inner scales are not the layer's static grid")
    n, d = enc.num_rows, enc.dim
    mb = config.middle_bits
    codes = _unpack_slots(enc.dense, d, mb)
    groups = torch.zeros((n, d), dtype=torch.uint8)
    bits = group_bits(config)
    sparse = enc.sparse.tolist()
    off = enc.sparse_offsets.tolist()
    for r in range(n):
        positions, entries = _decode_coo_row(sparse[off[r] : off[r + 1]], d, r)
        for pos, e in zip(positions, entries, strict=True):
            g = GROUP_OUTER if e & COO_GROUP_BIT else GROUP_INNER
            top = (e >> 7) & 1
            if top and bits[g] <= mb:
                which = "fifth" if mb == 4 else "top"
                raise CorruptDataError(f"row {r}: value {pos} has a {which} code bit but its group has {bits[g]} bits")
            groups[r, pos] = g
            codes[r, pos] = int(codes[r, pos]) | (top << mb)
    scales = enc.scales.reshape(n, 3, 2)
    return QuantizedVectors(
        codes=codes,
        groups=groups,
        mins=scales[:, :, 0].contiguous(),
        maxs=scales[:, :, 1].contiguous(),
        level=None if enc.level is None else enc.level.clone(),
    )


def encode(
    x: torch.Tensor, thr: ThresholdsLike, config: OakenConfig | None = None, group: ThresholdsLike | None = None
) -> EncodedBatch:
    """``pack(quantize(x, thr, config, group))``: the reference of ``oakenkv.kernels.codec.encode``."""
    config = config or OakenConfig()
    return pack(quantize(x, thr, config, group), config, thr)


def decode(enc: EncodedBatch, thr: ThresholdsLike, config: OakenConfig | None = None) -> torch.Tensor:
    """``dequantize(unpack(enc))``: the reference of ``oakenkv.kernels.codec.decode``. Raises :class:`CorruptDataError`
    for invalid bytes, including scales whose codes would decode to non-finite values (``quant.decodes_finite``)."""
    config = config or OakenConfig()
    q = unpack(enc, config, thr)
    bad = torch.nonzero(~decodes_finite(q.mins, q.maxs, thr, config))
    if bad.numel():
        raise CorruptDataError(f"row {int(bad[0, 0])}: {ERROR_MESSAGES[ERR_SCALE_NONFINITE]}")
    return dequantize(q, thr, config)


__all__ = ["decode", "encode", "pack", "unpack"]
