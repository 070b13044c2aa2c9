"""Tests of the hardware arithmetic (oakenkv.hw.arith) and the cycle-level engine models (oakenkv.hw.engines)."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

from oakenkv.format.config import OakenConfig
from oakenkv.hw import arith
from oakenkv.hw.engines import (
    DequantEngineModel,
    QuantEngineModel,
    fp16_bits_to_fx,
    fx_to_fp16_bits,
    reciprocal_unit,
    signed_grid_unit,
)
from oakenkv.kernels.codec import pack, unpack
from oakenkv.quant.quantizer import GROUP_MIDDLE, assign_groups, dequantize, error_bound, quantize

# Dyadic thresholds: exact in FX, so grouping can be compared with the float reference.
THR = (-2.0, -0.125, 0.125, 2.0)


def _rows(n: int, d: int, seed: int = 0) -> torch.Tensor:
    """Random rows with heavy channels plus edge rows: constant, one-sided, all outliers, exact thresholds."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    x[:, : max(1, d // 60)] *= 8  # outlier channels
    if n >= 8:
        x[0] = 0.05  # inner only, one value repeated (range 0)
        x[1] = 3.0  # outer upper only
        x[2] = -0.5  # middle lower only
        x[3] = torch.linspace(-6, 6, d)
        x[4] = torch.tensor(THR * (d // 4 + 1))[:d]  # values exactly on the thresholds
        x[5] = 0.0
        x[6, ::2] = 40.0  # half the row outer, far out
        x[7] = -1e-4
    return x


# ---------------------------------------------------------------------------------------------- number formats


@pytest.mark.parametrize("frac", [24, 33])
def test_fx_to_fp16_rounds_like_ieee(frac):
    g = torch.Generator().manual_seed(frac)
    v = torch.randint(-(2 ** (frac + 15)), 2 ** (frac + 15), (20000,), generator=g)
    v = v >> torch.randint(0, 45, (20000,), generator=g)
    v = torch.cat([v, torch.tensor([0, 1, -1, 3 << (frac - 20), 2**frac * 65504])])
    # numpy rounds float64 -> float16 once (torch goes through float32 and can double-round)
    want = torch.from_numpy((v.double() * 2.0**-frac).numpy().astype(np.float16))
    got = arith.fx_to_fp16(v, frac)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    # the scalar converter of the engine model agrees bit for bit
    idx = torch.randint(0, v.numel(), (500,), generator=g)
    for i in idx.tolist():
        assert fx_to_fp16_bits(int(v[i]), frac) == int(want[i].view(torch.int16)) & 0xFFFF


def test_fx_to_fp16_overflow_and_fp16_roundtrip():
    with pytest.raises(ValueError, match="fp16 maximum"):
        arith.fx_to_fp16(torch.tensor([65520 << 24]), 24)
    with pytest.raises(ValueError, match="fp16 maximum"):
        fx_to_fp16_bits(65520 << 24, 24)
    h = torch.tensor([0.0, -0.0, 2**-24, -(2**-14), 1.5, -65504.0, 0.1], dtype=torch.float16)
    fx = arith.fp16_to_fx(h)
    assert fx.tolist() == [fp16_bits_to_fx(int(b) & 0xFFFF) for b in h.view(torch.int16)]
    assert torch.equal(arith.fx_to_fp16(fx, 24), h)


def test_reciprocal_unit_accuracy():
    g = torch.Generator().manual_seed(1)
    d = torch.randint(1, 2**42, (50000,), generator=g) >> torch.randint(0, 42, (50000,), generator=g)
    d = torch.cat([d.clamp(min=1), torch.tensor([1, 2, 3, 2**14 - 1, 2**14, 2**14 + 1, 2**49 - 1])])
    y, L = arith.reciprocal(d)
    rel = y.double() * torch.pow(2.0, -(arith.RECIP_BITS + L.double() - 1)) * d.double() - 1
    assert float(rel.abs().max()) < 2**-12
    for i in range(0, d.numel(), 997):
        assert reciprocal_unit(int(d[i])) == (int(y[i]), int(L[i]))


def test_threshold_and_input_validation():
    with pytest.raises(ValueError, match="scale_dtype"):
        arith.quantize_hw(torch.zeros(1, 4), THR, OakenConfig(scale_dtype="float32"))
    with pytest.raises(ValueError, match="NaN"):
        arith.quantize_hw(torch.tensor([[0.0, float("nan")]]), THR)
    with pytest.raises(ValueError, match="fp16 range"):
        arith.quantize_hw(torch.tensor([[0.0, 1e6]]), THR)
    with pytest.raises(ValueError, match=r"\[N, D\]"):
        arith.quantize_hw(torch.zeros(4), THR)
    with pytest.raises(ValueError, match="collapse"):
        arith.threshold_fx((-1e-9, 0.0, 0.0, 1.0))
    # other slot widths were computed with the 4-bit engine's 32-entry step ROM (a 7-bit grid got twice the step)
    # or packed as 4-bit bytes: refused
    for mb in (3, 5, 7):
        with pytest.raises(ValueError, match="4-bit dense slot"):
            arith.quantize_hw(torch.zeros(1, 4), THR, OakenConfig(middle_bits=mb))
    from oakenkv.hw.engines import DequantEngineModel, QuantEngineModel

    for bits in ((3, 4, 4), (5, 6, 6), (4, 5)):
        for engine in (QuantEngineModel, DequantEngineModel):
            with pytest.raises(ValueError, match="4-bit dense slot"):
                engine((-4, -1, 1, 4), bits)


# ---------------------------------------------------------------------------------------------- the quantizer


@pytest.mark.parametrize("bits", [4, 5])
def test_signed_grid_search_is_the_exact_minimum(bits):
    """j from the division-free search = the float search's k + 1 (first minimum of the exact step)."""
    n = 2**bits
    g = torch.Generator().manual_seed(bits)
    a = torch.randint(0, 5000, (3000,), generator=g)
    b = torch.randint(0, 5000, (3000,), generator=g)
    a[:50], b[50:100] = 0, 0
    j_vec, _ = arith.signed_grid(-a, b, bits)
    for i in range(a.numel()):
        ai, bi = int(a[i]), int(b[i])
        if ai == bi == 0:
            continue

        def step(jj, ai=ai, bi=bi, inf=Fraction(10**30)):
            lo = (Fraction(ai, jj) if jj else inf) if ai else 0
            hi = (Fraction(bi, n - jj) if jj < n else inf) if bi else 0
            return max(lo, hi)

        best = min(range(n + 1), key=lambda jj: (step(jj), jj))
        assert int(j_vec[i]) == best, (ai, bi)
        assert signed_grid_unit(-ai, bi, bits)[0] == best


@pytest.mark.parametrize("d", [192, 64, 7, 130])
def test_quantize_hw_is_a_valid_oaken_encoding(d):
    x = _rows(64, d)
    q = arith.quantize_hw(x, THR)
    x16 = x.half().float()
    # grouping and shift are the reference's (dyadic thresholds are exact in FX)
    assert torch.equal(q.groups, assign_groups(x16, THR))
    # the codec stores it losslessly
    u = unpack(pack(q))
    assert torch.equal(u.codes, q.codes) and torch.equal(u.groups, q.groups)
    # both decoders put every value on its side, within half a step (+ fp16 end-point slack, as test_quant.py;
    # the reciprocal unit may move a value within ~2^-12 of a code boundary to the other code)
    ends = torch.maximum(q.mins.abs(), q.maxs.abs()).float()
    rnd = torch.gather(ends, 1, q.groups.long())
    bound = error_bound(q) * (1 + 2**-5) + rnd * 2**-9 + 1e-6
    for y in (dequantize(q, THR), arith.dequantize_hw(q, THR)):
        assert bool(((y - x16).abs() <= bound).all())


def test_hw_error_close_to_float_mode():
    x = _rows(256, 192, seed=3)
    x16 = x.half().float()
    e_float = (dequantize(quantize(x16, THR), THR) - x16).pow(2).mean().sqrt()
    e_hw = (arith.dequantize_hw(arith.quantize_hw(x, THR), THR) - x16).pow(2).mean().sqrt()
    assert float(e_hw) <= 1.05 * float(e_float)
    q_f, q_h = quantize(x16, THR), arith.quantize_hw(x, THR)
    mid = q_f.groups == GROUP_MIDDLE
    assert float((q_f.codes[mid] == q_h.codes[mid]).float().mean()) > 0.95


def test_dequantize_hw_matches_float_decoder_closely():
    x = _rows(64, 192, seed=5)
    q = arith.quantize_hw(x, THR)
    diff = (arith.dequantize_hw(q, THR) - dequantize(q, THR)).abs()
    # the 1/(n - 1) ROM constant is off by <= 2^-13 relative: < 1% of a step at the top code
    assert bool((diff <= error_bound(q) * 2**-7 + 2**-20).all())


def test_quantize_dequantize_hw_shapes():
    x = torch.randn(2, 3, 5, 64, dtype=torch.float16)
    y = arith.quantize_dequantize_hw(x, THR)
    assert y.shape == x.shape and y.dtype == x.dtype


# ---------------------------------------------------------------------------------------------- engine models


@pytest.mark.parametrize("d", [192, 64, 130, 7])
def test_engine_models_produce_the_codec_bytes(d):
    x = _rows(24, d, seed=d)
    t = arith.threshold_fx(THR)
    xf = arith.input_fx(x)
    q = arith.quantize_hw_fx(xf, t)
    enc = pack(q)
    ref = arith.dequantize_hw_fx(q, t)
    qe, de = QuantEngineModel(t), DequantEngineModel(t)
    for r in range(x.shape[0]):
        dense, scales, stream = qe.encode_row(xf[r].tolist())
        assert dense == enc.dense[r].tolist()
        assert scales == [b & 0xFFFF for b in enc.scales[r].view(torch.int16).tolist()]
        assert stream == enc.row_sparse(r).tolist()
        assert de.decode_row(dense, scales, stream, d) == ref[r].tolist()
    chunks = (d + 63) // 64
    assert qe.cycles == x.shape[0] * (2 * chunks + 1)
    assert de.cycles == x.shape[0] * chunks


def test_zero_remove_and_zero_insert_are_inverse():
    qe = QuantEngineModel(arith.threshold_fx(THR))
    groups = [0, 1, 2, 0, 2, 1] + [0] * 58
    codes = [3, 17, 31, 15, 4, 0] + [0] * 58
    out = qe.split_and_compress(groups, codes)
    assert out.entries == [1 | 0x80, 2 | 0x40 | 0x80, 4 | 0x40, 5]
    assert out.dense[:3] == [3 | (1 << 4), 15 | (15 << 4), 4 | (0 << 4)]
    flags = DequantEngineModel.zero_insert(out.entries)
    assert [f[0] for f in flags[:6]] == [False, True, True, False, True, True]
    assert flags[2] == (True, 1, 1) and flags[5] == (True, 0, 0)


@pytest.mark.model
def test_engine_models_on_real_kv(default_model):
    from transformers import DynamicCache

    model, tok = default_model.model, default_model.tokenizer
    ids = tok("The quick brown fox jumps over the lazy dog near the river bank.", return_tensors="pt").input_ids
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    for li in (0, 15, 29):
        for x in (cache.layers[li].keys, cache.layers[li].values):
            b, h, s, d = x.shape
            rows = x.permute(0, 2, 1, 3).reshape(b * s, h * d)
            qs = torch.quantile(rows.flatten().double(), torch.tensor([0.02, 0.47, 0.53, 0.98], dtype=torch.float64))
            thr = tuple(float(v) for v in qs)
            t = arith.threshold_fx(thr)
            xf = arith.input_fx(rows)
            q = arith.quantize_hw_fx(xf, t)
            enc = pack(q)
            qe = QuantEngineModel(t)
            for r in range(rows.shape[0]):
                dense, _, stream = qe.encode_row(xf[r].tolist())
                assert dense == enc.dense[r].tolist() and stream == enc.row_sparse(r).tolist()
            # hardware and float modes reconstruct the real vectors about equally well
            x16 = rows.half().float()
            e_hw = (arith.dequantize_hw(q, thr) - x16).pow(2).mean().sqrt()
            e_fl = (dequantize(quantize(x16, thr), thr) - x16).pow(2).mean().sqrt()
            assert float(e_hw) <= 1.05 * float(e_fl) + 1e-6


def test_fake_quantizer_modes():
    from oakenkv.hw.fakequant import HwOakenQuantizer

    class _Thr:
        def layer(self, i, kind):
            return THR

    x = torch.randn(1, 3, 5, 64)
    for mode in ("hw", "hw_quant"):
        y, bits = HwOakenQuantizer(_Thr(), OakenConfig(), mode=mode).quantize(0, "key", x)
        assert y.shape == x.shape and bits > 4 * x.numel()
        assert float((y - x).abs().max()) < 1.0
    with pytest.raises(ValueError, match="mode"):
        HwOakenQuantizer(_Thr(), OakenConfig(), mode="float")
    # static grids (OakenConfig.static_grids) are not modelled by the engines: refused, naming the feature
    static = OakenConfig(static_grids=True)
    with pytest.raises(NotImplementedError, match="static middle/inner grids"):
        HwOakenQuantizer(_Thr(), static)
    with pytest.raises(NotImplementedError, match="static middle/inner grids"):
        arith.quantize_hw(x.reshape(-1, 64), THR, static)
    q = quantize(x.reshape(-1, 64), THR, static)
    with pytest.raises(NotImplementedError, match="static middle/inner grids"):
        arith.dequantize_hw(q, THR, static)


def test_encode_decode_hw_roundtrip_and_lean_import():
    import subprocess
    import sys

    x = _rows(16, 192, seed=7)
    enc = arith.encode_hw(x, THR)
    q = arith.quantize_hw(x, THR)
    assert torch.equal(enc.dense, pack(q).dense) and torch.equal(enc.sparse, pack(q).sparse)
    assert torch.equal(arith.decode_hw(enc, THR), arith.dequantize_hw(q, THR))
    # importing the hw package (and the arithmetic) must not pull in amaranth
    code = "import sys, oakenkv.hw.arith, oakenkv.hw.engines; assert 'amaranth' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
