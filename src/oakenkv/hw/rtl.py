"""Amaranth HDL of Oaken's quantization and dequantization engines, one 64-value chunk per cycle.

Each block computes exactly the integer functions of :mod:`oakenkv.hw.engines` (the tests simulate them against
those stage functions lane for lane); widths are chosen so that no intermediate wraps for any fp16 input (the
bounds are in the comments). Requires the ``hw`` extra (``amaranth``); imported only by the hw tests, the bench
and ``oakenkv hw``.

* :class:`DequantEngine`: zero-insert shifter (compact COO entry list -> per-lane flags), outlier extractor
  (5-bit codes, group ids), scale preprocessing (fp16 -> FX, ``(max - min) * RD_n``), three dequantizers as one
  small multiply-add per lane, threshold add-back by sign, OR merge; outputs registered (latency 1 cycle,
  ``lanes`` values per cycle).
* :class:`QuantEngine`: decomposer (group compare + shift), min/max finders with row accumulators (pass 1),
  scale calculator (``j`` thermometer search, step ROM, reciprocal unit, fp16 rounding; registered), and in
  pass 2 the code units, outlier splitter (dense nibbles) and zero-remove shifter (compact COO entry list),
  registered. A row of ``C`` chunks takes ``C + 1 + C`` cycles (+1 output register).
  The COO stream formatter (escape insertion, serial per entry) is not in RTL; it is modelled in
  :class:`oakenkv.hw.engines.QuantEngineModel.coo_stream`.
"""

from __future__ import annotations

from amaranth.hdl import Array, Cat, Const, Module, Mux, Signal, signed
from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out

from oakenkv.hw.arith import (
    DEQ_SHIFT,
    DIV_SHIFT,
    FX_FRAC,
    LUT_BITS,
    RECIP_BITS,
    RECIP_LUT,
    SMALL_RECIP,
    STEP_EXTRA,
    dequant_const,
)

#: FX input width: |x| <= 65504 * 2^24 < 2^40 -> 41 bits signed.
X_W = 41
#: Shifted values and thresholds: |x - thr| < 2^41 -> 42 bits signed.
S_W = 42
#: Dequantized output: g0 + code * (g1 - g0) * RD / 2^18 + thr, |.| < 2^43 -> 45 bits signed.
OUT_W = 45
#: Signed-group step: num * ROM >> 8 < 2^41 * 2^16 / 2^8 = 2^49 -> 50 bits.
STEP_W = 50
GROUP_MIDDLE, GROUP_INNER, GROUP_OUTER = 0, 1, 2


def _s(v):
    """Zero-extend an unsigned value into a signed one (Amaranth's unsigned '-' wraps instead of going negative)."""
    return Cat(v, Const(0, 1)).as_signed()


def _bit_length(m: Module, v, width: int, name: str) -> Signal:
    """Leading-one detector: ``bit_length(v)`` of an unsigned value (later ``If``s take priority)."""
    bl = Signal(range(width + 1), name=name)
    m.d.comb += bl.eq(0)
    for i in range(width):
        with m.If(v[i]):
            m.d.comb += bl.eq(i + 1)
    return bl


def _reciprocal(m: Module, d, width: int, name: str) -> tuple[Signal, Signal]:
    """Reciprocal unit ``(Y1, L)`` of an unsigned ``d`` (``d = 0`` treated as 1), as ``engines.reciprocal_unit``."""
    p = RECIP_BITS
    dd = Signal(width, name=f"{name}_d")
    m.d.comb += dd.eq(Mux(d == 0, 1, d))
    L = _bit_length(m, dd, width, f"{name}_L")
    shl = Signal(range(p + 1), name=f"{name}_shl")
    shr = Signal(range(width + 1), name=f"{name}_shr")
    m.d.comb += [shl.eq(Mux(p >= L, p - L, 0)), shr.eq(Mux(p < L, L - p, 0))]
    mant = Signal(p, name=f"{name}_m")  # normalised: leading one at bit p - 1
    m.d.comb += mant.eq(((dd << shl) >> shr)[:p])
    y0 = Signal(p + 1, name=f"{name}_y0")
    m.d.comb += y0.eq(Array(Const(v, p + 1) for v in RECIP_LUT)[mant[p - 1 - LUT_BITS : p - 1]])
    t = Signal(p + 2, name=f"{name}_t")
    m.d.comb += t.eq((mant * y0) >> (p - 1))
    y1 = Signal(p + 1, name=f"{name}_y1")
    m.d.comb += y1.eq((y0 * ((1 << (p + 1)) - t)) >> p)
    return y1, L


def _to_fp16(m: Module, v, width: int, frac: int, name: str) -> tuple[Signal, Signal]:
    """fp16 converter (round to nearest even) of the signed fixed-point ``v * 2^-frac``: ``(bits, overflow)``."""
    assert frac >= 24  # so the shift below is never negative
    neg = Signal(name=f"{name}_neg")
    mag = Signal(width, name=f"{name}_mag")
    m.d.comb += [neg.eq(v < 0), mag.eq(Mux(v < 0, -v, v))]
    bl = _bit_length(m, mag, width, f"{name}_bl")
    sh = Signal(range(width + 1), name=f"{name}_sh")  # = max(bl - 11, frac - 24) = qe + frac
    m.d.comb += sh.eq(Mux(bl > frac - 13, bl - 11, frac - 24))
    q = Signal(12, name=f"{name}_q")
    rem = Signal(width, name=f"{name}_rem")
    half = Signal(width, name=f"{name}_half")
    m.d.comb += [
        q.eq(mag >> sh),
        rem.eq(mag - ((mag >> sh) << sh)),
        half.eq(Mux(sh > 0, Const(1, width) << (sh - 1)[: len(sh)], 0)),
    ]
    up = Signal(name=f"{name}_up")
    m.d.comb += up.eq((sh > 0) & ((rem > half) | ((rem == half) & q[0])))
    q2 = Signal(12, name=f"{name}_q2")
    m.d.comb += q2.eq(q + up)
    exp = Signal(signed(10), name=f"{name}_exp")  # qe + 25, +1 when the rounding carried into 2^11
    m.d.comb += exp.eq(_s(sh) + (25 - frac) + q2[11])  # signed: unsigned '-' would wrap
    bits = Signal(16, name=f"{name}_bits")
    ovf = Signal(name=f"{name}_ovf")
    with m.If(q2 < 1024):  # subnormal (or zero)
        m.d.comb += bits.eq(Cat(q2[:10], Const(0, 5), neg))
    with m.Else():
        m.d.comb += bits.eq(Cat(Mux(q2[11], 0, q2[:10]), exp[:5], neg))
    m.d.comb += ovf.eq((q2 >= 1024) & (exp >= 31))
    return bits, ovf


def _fp16_to_fx(m: Module, b, name: str) -> Signal:
    """fp16 bit pattern -> FX (exact), 41 bits signed."""
    e, man = b[10:15], b[:10]
    mag = Signal(X_W - 1, name=f"{name}_mag")
    m.d.comb += mag.eq(Mux(e == 0, man, Cat(man, Const(1, 1)) << (e - 1)[:5]))
    fx = Signal(signed(X_W), name=name)
    m.d.comb += fx.eq(Mux(b[15], -mag, mag))
    return fx


# --------------------------------------------------------------------------------------------------------------
# Dequantization engine
# --------------------------------------------------------------------------------------------------------------


class DequantEngine(wiring.Component):
    """One chunk per cycle: ``dense`` nibbles + compact COO ``entries[:count]`` + row scales -> ``out`` (FX).

    Ports: ``dense`` (4 * lanes bits, value i in bits 4i..4i+3), ``entries`` (8-bit COO bytes, lane-sorted,
    entry j in bits 8j..8j+7, ``count`` valid), ``scales`` (6 fp16 bit patterns), ``thr`` (FX ``to_lo, ti_lo,
    ti_hi, to_hi``); ``out`` (registered FX values, one cycle later).
    """

    def __init__(self, lanes: int = 64, bits: tuple[int, int, int] = (4, 5, 5)) -> None:
        self.lanes, self.bits = lanes, bits
        super().__init__(
            {
                "dense": In(4 * lanes),
                "entries": In(8 * lanes),
                "count": In(range(lanes + 1)),
                "scales": In(16).array(6),
                "thr": In(signed(S_W)).array(4),
                "out": Out(signed(OUT_W)).array(lanes),
            }
        )

    def elaborate(self, platform):
        m = Module()
        to_lo, ti_lo, ti_hi, to_hi = self.thr
        entries = [self.entries[8 * j : 8 * j + 8] for j in range(self.lanes)]
        # Scale preprocessing (once per row in a real engine; here recomputed each cycle from the held inputs).
        g0s, drs = [], []
        for g in range(3):
            g0 = _fp16_to_fx(m, self.scales[2 * g], f"g0_{g}")
            g1 = _fp16_to_fx(m, self.scales[2 * g + 1], f"g1_{g}")
            dr = Signal(58, name=f"dr_{g}")  # (g1 - g0) < 2^41, RD < 2^15, g1 >= g0
            m.d.comb += dr.eq((g1 - g0) * dequant_const(self.bits[g]))
            g0s.append(g0)
            drs.append(dr)
        for p in range(self.lanes):
            # Zero-insert shifter: lane p takes the entry whose 6-bit index is p (at most one: indices increase).
            hit = Signal(self.lanes, name=f"hit_{p}")
            m.d.comb += hit.eq(Cat(((e[:6] == p) & (j < self.count)) for j, e in enumerate(entries)))
            gbit, b4 = Signal(name=f"gbit_{p}"), Signal(name=f"b4_{p}")
            m.d.comb += [
                gbit.eq((hit & Cat(e[6] for e in entries)).any()),
                b4.eq((hit & Cat(e[7] for e in entries)).any()),
            ]
            # Outlier extractor.
            code = Signal(5, name=f"code_{p}")
            m.d.comb += code.eq(Cat(self.dense[4 * p : 4 * p + 4], b4))
            grp = Signal(2, name=f"grp_{p}")
            m.d.comb += grp.eq(Mux(hit.any(), Mux(gbit, GROUP_OUTER, GROUP_INNER), GROUP_MIDDLE))
            # Dequantizer: v = g0 + (code * dr) >> 18, then the threshold of the side (signed groups).
            v = Signal(signed(OUT_W), name=f"v_{p}")
            m.d.comb += v.eq(Array(g0s)[grp] + ((code * Array(drs)[grp]) >> DEQ_SHIFT))
            lo = Mux(grp == GROUP_OUTER, to_lo, ti_lo)
            hi = Mux(grp == GROUP_OUTER, to_hi, ti_hi)
            add = Mux(grp == GROUP_INNER, 0, Mux(v > 0, hi, lo))
            m.d.sync += self.out[p].eq(v + add)  # OR merge = the group mux above; registered output
        return m


# --------------------------------------------------------------------------------------------------------------
# Quantization engine
# --------------------------------------------------------------------------------------------------------------


class QuantEngine(wiring.Component):
    """Quantization engine for one chunk per cycle (two passes per row).

    ``x`` holds the chunk's FX values, lane p in bits ``41p .. 41p + 40`` (two's complement; one wide port so a
    testbench sets a chunk in one step). Control (all sampled at the clock edge): ``clear`` resets the row's
    min/max registers; ``acc`` folds the current chunk ``x[:nvals]`` into them (pass 1); ``calc`` latches the
    scale calculator's outputs; every cycle the code units, splitter and zero-remove shifter register the
    current chunk's ``dense``, ``entries`` and ``count`` (pass 2, valid one cycle later). ``scale_bits`` (6 fp16
    patterns) and ``ovf`` (an end point overflowed fp16) are valid after ``calc``.
    """

    def __init__(self, lanes: int = 64, bits: tuple[int, int, int] = (4, 5, 5)) -> None:
        self.lanes, self.bits = lanes, bits
        super().__init__(
            {
                "x": In(X_W * lanes),
                "nvals": In(range(lanes + 1)),
                "thr": In(signed(S_W)).array(4),
                "clear": In(1),
                "acc": In(1),
                "calc": In(1),
                "scale_bits": Out(16).array(6),
                "ovf": Out(1),
                "dense": Out(4 * lanes),
                "entries": Out(8).array(lanes),
                "count": Out(range(lanes + 1)),
            }
        )

    def elaborate(self, platform):
        m = Module()
        lanes = self.lanes
        to_lo, ti_lo, ti_hi, to_hi = self.thr
        # ---- Q1 decomposer -------------------------------------------------------------------------------
        gs, ss, valid = [], [], []
        for p in range(lanes):
            x = self.x[X_W * p : X_W * (p + 1)].as_signed()
            g = Signal(2, name=f"g_{p}")
            s = Signal(signed(S_W), name=f"s_{p}")
            ok = Signal(name=f"ok_{p}")
            m.d.comb += ok.eq(p < self.nvals)
            with m.If((x > to_hi) | (x < to_lo)):
                m.d.comb += [g.eq(GROUP_OUTER), s.eq(x - Mux(x > to_hi, to_hi, to_lo))]
            with m.Elif((x >= ti_lo) & (x <= ti_hi)):
                m.d.comb += [g.eq(GROUP_INNER), s.eq(x)]
            with m.Else():
                m.d.comb += [g.eq(GROUP_MIDDLE), s.eq(x - Mux(x > ti_hi, ti_hi, ti_lo))]
            gs.append(g)
            ss.append(s)
            valid.append(ok)
        # ---- Q1 min/max finders + row registers ----------------------------------------------------------
        big = (1 << (S_W - 1)) - 1
        mn_r = [Signal(signed(S_W), name=f"mn_r{g}", init=big) for g in range(3)]
        mx_r = [Signal(signed(S_W), name=f"mx_r{g}", init=-big) for g in range(3)]
        has_r = [Signal(name=f"has_r{g}") for g in range(3)]
        for g in range(3):
            lo_vals = [Mux(valid[p] & (gs[p] == g), ss[p], big) for p in range(lanes)]
            hi_vals = [Mux(valid[p] & (gs[p] == g), ss[p], -big) for p in range(lanes)]
            cmin, cmax = _tree(m, lo_vals, min_=True, name=f"cmin{g}"), _tree(m, hi_vals, min_=False, name=f"cmax{g}")
            present = Cat(valid[p] & (gs[p] == g) for p in range(lanes)).any()
            with m.If(self.clear):
                m.d.sync += [mn_r[g].eq(big), mx_r[g].eq(-big), has_r[g].eq(0)]
            with m.Elif(self.acc):
                m.d.sync += [
                    mn_r[g].eq(Mux(cmin < mn_r[g], cmin, mn_r[g])),
                    mx_r[g].eq(Mux(cmax > mx_r[g], cmax, mx_r[g])),
                    has_r[g].eq(has_r[g] | present),
                ]
        # ---- Q2 scale calculator -------------------------------------------------------------------------
        lo_q = [Signal(signed(S_W), name=f"par_lo{g}") for g in range(3)]  # inner: min; signed: j
        y1_q = [Signal(RECIP_BITS + 1, name=f"par_y1{g}") for g in range(3)]
        sh_q = [Signal(7, name=f"par_sh{g}") for g in range(3)]
        ok_q = [Signal(name=f"par_ok{g}") for g in range(3)]
        ovfs = []
        for g in range(3):
            mn = Signal(signed(S_W), name=f"mn{g}")
            mx = Signal(signed(S_W), name=f"mx{g}")
            m.d.comb += [mn.eq(Mux(has_r[g], mn_r[g], 0)), mx.eq(Mux(has_r[g], mx_r[g], 0))]
            n = 2 ** self.bits[g]
            if g == GROUP_INNER:
                r = Signal(S_W + 1, name="r_inner")  # max - min >= 0, < 2^42
                m.d.comb += r.eq(mx - mn)
                y1, L = _reciprocal(m, r, S_W + 1, "rcp_inner")
                b0, o0 = _to_fp16(m, mn, S_W, FX_FRAC, "fp_min1")
                b1, o1 = _to_fp16(m, mx, S_W, FX_FRAC, "fp_max1")
                with m.If(self.calc):
                    m.d.sync += [lo_q[g].eq(mn), y1_q[g].eq(y1), sh_q[g].eq(RECIP_BITS + L - 1), ok_q[g].eq(r > 0)]
            else:
                j, step = _signed_grid(m, mn, mx, self.bits[g], f"sg{g}")
                y1, L = _reciprocal(m, step, STEP_W, f"rcp{g}")
                gmin2 = Signal(signed(STEP_W + 8), name=f"gmin2_{g}")  # (2j - 1) * step < 63 * 2^49
                gmax2 = Signal(signed(STEP_W + 8), name=f"gmax2_{g}")
                m.d.comb += [gmin2.eq(_s(step) - 2 * _s(j) * _s(step)), gmax2.eq(gmin2 + 2 * (n - 1) * _s(step))]
                frac = FX_FRAC + STEP_EXTRA + 1
                b0, o0 = _to_fp16(m, gmin2, STEP_W + 8, frac, f"fp_min{g}")
                b1, o1 = _to_fp16(m, gmax2, STEP_W + 8, frac, f"fp_max{g}")
                with m.If(self.calc):
                    m.d.sync += [
                        lo_q[g].eq(j),
                        y1_q[g].eq(y1),
                        sh_q[g].eq(RECIP_BITS + L - 1 - STEP_EXTRA),
                        ok_q[g].eq(step > 0),
                    ]
            with m.If(self.calc):
                m.d.sync += [self.scale_bits[2 * g].eq(b0), self.scale_bits[2 * g + 1].eq(b1)]
            ovfs += [o0, o1]
        with m.If(self.calc):
            m.d.sync += self.ovf.eq(Cat(ovfs).any())
        # ---- Q3 code units, outlier splitter, zero-remove shifter ----------------------------------------
        codes, outl, ents = [], [], []
        for p in range(lanes):
            g, s = gs[p], ss[p]
            inner = g == GROUP_INNER
            lo, y1, sh, ok = Array(lo_q)[g], Array(y1_q)[g], Array(sh_q)[g], Array(ok_q)[g]
            base = Signal(signed(S_W + 6), name=f"base_{p}")  # inner: (s - min) * 31 < 2^47; signed: s
            m.d.comb += base.eq(Mux(inner, (s - lo) * (2 ** self.bits[GROUP_INNER] - 1), s))
            prod = Signal(signed(64), name=f"prod_{p}")  # < 2^47 * 2^15 = 2^62
            m.d.comb += prod.eq(base * y1 + Mux(inner, Const(1, 64) << (sh - 1)[:6], 0))
            q = Signal(signed(S_W + 2), name=f"q_{p}")
            m.d.comb += q.eq((prod >> sh) + Mux(inner, 0, lo))
            top = Mux(
                g == GROUP_MIDDLE,
                2 ** self.bits[GROUP_MIDDLE] - 1,
                Mux(inner, 2 ** self.bits[1] - 1, 2 ** self.bits[2] - 1),
            )
            code = Signal(5, name=f"qc_{p}")
            m.d.comb += code.eq(Mux(~ok | ~valid[p] | (q < 0), 0, Mux(q > top, top, q)))
            codes.append(code)
            o = Signal(name=f"outl_{p}")
            m.d.comb += o.eq(valid[p] & (g != GROUP_MIDDLE))
            outl.append(o)
            ents.append(Cat(Const(p, 6), g == GROUP_OUTER, code[4]))
        m.d.sync += self.dense.eq(Cat(c[:4] for c in codes))
        prefix = []
        acc = Const(0, range(lanes + 1))
        for p in range(lanes):
            ps = Signal(range(lanes + 1), name=f"pre_{p}")
            m.d.comb += ps.eq(acc)
            prefix.append(ps)
            acc = ps + outl[p]
        cnt = Signal(range(lanes + 1), name="cnt")
        m.d.comb += cnt.eq(acc)
        m.d.sync += self.count.eq(cnt)
        for k in range(lanes):
            # Output slot k takes the outlier lane with k outliers before it (lanes >= k can qualify).
            sel = [Mux(outl[p] & (prefix[p] == k), ents[p], 0) for p in range(k, lanes)]
            slot = Signal(8, name=f"slot_{k}")
            m.d.comb += slot.eq(_or_tree(sel))
            m.d.sync += self.entries[k].eq(slot)
        return m


def _tree(m: Module, vals: list, *, min_: bool, name: str):
    """Balanced min (or max) tree."""
    level = 0
    while len(vals) > 1:
        nxt = []
        for i in range(0, len(vals) - 1, 2):
            a, b = vals[i], vals[i + 1]
            w = Signal(signed(S_W), name=f"{name}_{level}_{i}")
            m.d.comb += w.eq(Mux((a < b) if min_ else (a > b), a, b))
            nxt.append(w)
        if len(vals) % 2:
            nxt.append(vals[-1])
        vals, level = nxt, level + 1
    return vals[0]


def _or_tree(vals: list):
    while len(vals) > 1:
        vals = [vals[i] | vals[i + 1] if i + 1 < len(vals) else vals[i] for i in range(0, len(vals), 2)]
    return vals[0]


def _signed_grid(m: Module, mn, mx, bits: int, name: str) -> tuple[Signal, Signal]:
    """Signed-group scale calculator ``(j, step)``, as ``engines.signed_grid_unit``."""
    n = 2**bits
    a = Signal(S_W, name=f"{name}_a")
    b = Signal(S_W, name=f"{name}_b")
    m.d.comb += [a.eq(Mux(mn < 0, -mn, 0)), b.eq(Mux(mx > 0, mx, 0))]
    tot = Signal(S_W + 1, name=f"{name}_tot")
    m.d.comb += tot.eq(a + b)
    # Thermometer: j* = #{i in 1..n : n * a >= tot * i} (constant multiples only).
    therm = Cat((a * n) >= (tot * i) for i in range(1, n + 1))
    jstar = Signal(range(n + 1), name=f"{name}_jstar")
    m.d.comb += jstar.eq(sum(therm[i] for i in range(n)))
    up = Signal(name=f"{name}_up")
    m.d.comb += up.eq((jstar < n) & ((b * jstar) < (a * (n - 1 - jstar)[: bits + 1])))
    j = Signal(range(n + 1), name=f"{name}_j")
    m.d.comb += j.eq(jstar + up)
    nj = Signal(range(n + 1), name=f"{name}_nj")
    m.d.comb += nj.eq(n - j)
    lo_dom = Signal(name=f"{name}_lodom")
    m.d.comb += lo_dom.eq((j > 0) & ((a * nj) >= (b * j)))
    num = Signal(S_W, name=f"{name}_num")
    den = Signal(range(n + 1), name=f"{name}_den")
    m.d.comb += [num.eq(Mux(lo_dom, a, b)), den.eq(Mux(lo_dom, j, nj))]
    rom = Array(Const(v, DIV_SHIFT + 1) for v in SMALL_RECIP[: n + 1])[den]
    raw = Signal(STEP_W, name=f"{name}_raw")
    m.d.comb += raw.eq((num * rom) >> (DIV_SHIFT - STEP_EXTRA))
    step = Signal(STEP_W, name=f"{name}_step")
    m.d.comb += step.eq(Mux(tot == 0, 0, Mux(raw == 0, 1, raw)))
    jo = Signal(range(n + 1), name=f"{name}_jo")
    m.d.comb += jo.eq(Mux(tot == 0, 0, j))
    return jo, step


__all__ = ["DequantEngine", "QuantEngine"]
