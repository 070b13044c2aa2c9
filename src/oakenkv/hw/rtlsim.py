"""Simulate the Amaranth engines (:mod:`oakenkv.hw.rtl`) on rows of values against the Python models.

Both drivers take FX rows (``oakenkv.hw.arith.input_fx``) and FX thresholds and return a :class:`SimResult`:
mismatch count (0 = bit for bit), rows, values and the clock cycles the engine took. The quantization engine's
registered outputs (dense nibbles, compact COO entries per chunk, fp16 scale patterns) are compared with
:class:`~oakenkv.hw.engines.QuantEngineModel`, and the row bytes it implies (with the modelled COO stream
formatter) with ``codec.pack(arith.quantize_hw_fx(...))``; the dequantization engine's outputs with
``arith.dequantize_hw_fx`` of the same rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from oakenkv.hw.engines import LANES, DequantEngineModel, QuantEngineModel


@dataclass
class SimResult:
    rows: int = 0
    values: int = 0
    cycles: int = 0
    mismatches: int = 0
    first_mismatch: str = ""
    extra: dict[str, int] = field(default_factory=dict)

    def note(self, what: str) -> None:
        self.mismatches += 1
        if not self.first_mismatch:
            self.first_mismatch = what


def _rows_ok(x: torch.Tensor) -> list[list[int]]:
    if x.dim() != 2 or x.dtype != torch.int64:
        raise ValueError(f"expected int64 FX rows [N, D], got {x.dtype} {tuple(x.shape)}")
    return x.tolist()


def simulate_quant(
    x: torch.Tensor, t: tuple[int, int, int, int], *, progress: Callable[[int], None] | None = None
) -> SimResult:
    """Run rows ``x`` (int64 FX ``[N, D]``) through :class:`~oakenkv.hw.rtl.QuantEngine` and check every output."""
    from amaranth.sim import Simulator

    from oakenkv.hw.arith import quantize_hw_fx
    from oakenkv.hw.rtl import X_W, QuantEngine
    from oakenkv.kernels.codec import pack

    _X_MASK = (1 << X_W) - 1

    rows = _rows_ok(x)
    enc = pack(quantize_hw_fx(x, t))
    model = QuantEngineModel(t)
    dut = QuantEngine(LANES)
    res = SimResult()

    async def tb(ctx):
        for k in range(4):
            ctx.set(dut.thr[k], t[k])
        for r, row in enumerate(rows):
            chunks = [row[i : i + LANES] for i in range(0, len(row), LANES)]

            def put(ch: list[int]) -> None:
                # one wide write: a testbench settles the design after every set
                ctx.set(dut.x, sum((v & _X_MASK) << (X_W * p) for p, v in enumerate(ch)))
                ctx.set(dut.nvals, len(ch))

            ctx.set(dut.clear, 1)
            await ctx.tick()
            ctx.set(dut.clear, 0)
            ctx.set(dut.acc, 1)
            for ch in chunks:  # pass 1
                put(ch)
                await ctx.tick()
            ctx.set(dut.acc, 0)
            ctx.set(dut.calc, 1)
            await ctx.tick()
            ctx.set(dut.calc, 0)
            scale_bits = [ctx.get(dut.scale_bits[k]) for k in range(6)]
            if ctx.get(dut.ovf):
                res.note(f"row {r}: fp16 overflow flagged")
            dense: list[int] = []
            entries: list[list[int]] = []
            for ch in chunks:  # pass 2: outputs registered, read after the edge
                put(ch)
                await ctx.tick()
                d = ctx.get(dut.dense)
                dense += [(d >> (8 * i)) & 0xFF for i in range((len(ch) + 1) // 2)]
                entries.append([ctx.get(dut.entries[k]) for k in range(ctx.get(dut.count))])
            res.cycles += 2 * len(chunks) + 2
            # Model, stage by stage, and the codec's bytes.
            m_dense, m_scales, m_stream = model.encode_row(row)
            if scale_bits != m_scales or scale_bits != [b & 0xFFFF for b in enc.scales[r].view(torch.int16).tolist()]:
                res.note(f"row {r}: scales {scale_bits} != model {m_scales}")
            if dense != m_dense or dense != enc.dense[r].tolist():
                res.note(f"row {r}: dense bytes differ")
            stream = model.coo_stream(entries)
            if stream != m_stream or stream != enc.row_sparse(r).tolist():
                res.note(f"row {r}: COO entries differ")
            res.rows += 1
            res.values += len(row)
            if progress:
                progress(r)

    sim = Simulator(dut)
    sim.add_clock(1e-9)
    sim.add_testbench(tb)
    sim.run()
    return res


def simulate_dequant(
    x: torch.Tensor, t: tuple[int, int, int, int], *, progress: Callable[[int], None] | None = None
) -> SimResult:
    """Encode rows ``x`` (int64 FX ``[N, D]``) with the hardware arithmetic, decode each chunk with
    :class:`~oakenkv.hw.rtl.DequantEngine`, and compare with ``dequantize_hw_fx`` and the Python model."""
    from amaranth.sim import Simulator

    from oakenkv.hw.arith import dequantize_hw_fx, quantize_hw_fx
    from oakenkv.hw.rtl import DequantEngine
    from oakenkv.kernels.codec import pack

    q = quantize_hw_fx(x, t)
    enc = pack(q)
    ref = dequantize_hw_fx(q, t).tolist()
    model = DequantEngineModel(t)
    dut = DequantEngine(LANES)
    n, d = x.shape
    res = SimResult()

    async def tb(ctx):
        for k in range(4):
            ctx.set(dut.thr[k], t[k])
        for r in range(n):
            dense = enc.dense[r].tolist()
            scale_bits = [b & 0xFFFF for b in enc.scales[r].view(torch.int16).tolist()]
            stream = enc.row_sparse(r).tolist()
            chunks = model.parse_stream(stream, d)
            m_out = model.decode_row(dense, scale_bits, stream, d)
            for k in range(6):
                ctx.set(dut.scales[k], scale_bits[k])
            out: list[int] = []
            for c, ents in enumerate(chunks):
                n_vals = min(LANES, d - c * LANES)
                chunk_dense = dense[c * 32 : c * 32 + (n_vals + 1) // 2]
                ctx.set(dut.dense, sum(b << (8 * i) for i, b in enumerate(chunk_dense)))
                ctx.set(dut.entries, sum(e << (8 * k) for k, e in enumerate(ents)))
                ctx.set(dut.count, len(ents))
                await ctx.tick()
                out += [ctx.get(dut.out[p]) for p in range(n_vals)]
            res.cycles += len(chunks)
            if out != m_out or out != ref[r]:
                bad = next(i for i in range(d) if out[i] != ref[r][i] or out[i] != m_out[i])
                res.note(f"row {r} value {bad}: rtl {out[bad]} model {m_out[bad]} arith {ref[r][bad]}")
            res.rows += 1
            res.values += d
            if progress:
                progress(r)

    sim = Simulator(dut)
    sim.add_clock(1e-9)
    sim.add_testbench(tb)
    sim.run()
    return res
