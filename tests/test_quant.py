"""The reference quantizer: the paper's formulas on hand-computed vectors, and properties with hypothesis."""

from __future__ import annotations

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oakenkv.format.config import OakenConfig
from oakenkv.quant.quantizer import (
    GROUP_INNER,
    GROUP_MIDDLE,
    GROUP_OUTER,
    QuantizedVectors,
    assign_groups,
    dequantize,
    error_bound,
    group_fractions,
    quantize,
    quantize_dequantize,
    static_grid,
    thresholds_tuple,
)

THR = (-4.0, -0.5, 0.5, 4.0)


def test_hand_computed_vector_replays_the_paper_formulas():
    # Groups (Eq. 1), shifts (Eq. 4) and codes worked out by hand in the comments below.
    x = torch.tensor([[5.0, -6.0, 1.0, -2.0, 3.0, 0.25, -0.5, 0.0]])
    q = quantize(x, THR)
    assert q.groups.tolist() == [[2, 2, 0, 0, 0, 1, 1, 1]]
    # Middle: shifted 0.5, -1.5, 2.5 -> L=-1.5, U=2.5; step(k) = max(1.5/(k+1), 2.5/(15-k)) is 0.25 at k=5, so
    # gmin = -5.5*0.25 = -1.375, gmax = 2.375; codes floor((s+1.375)/0.25 + 0.5) = 8, 0, 16->15.
    assert q.mins[0, GROUP_MIDDLE].item() == -1.375 and q.maxs[0, GROUP_MIDDLE].item() == 2.375
    # Inner (unshifted): gmin=-0.5, gmax=0.25, step=0.75/31: codes 31, 0, floor(0.5/step + 0.5) = 21.
    assert q.mins[0, GROUP_INNER].item() == -0.5 and q.maxs[0, GROUP_INNER].item() == 0.25
    # Outer: shifted 1, -2 -> step(k) = max(2/(k+1), 1/(31-k)) is 2/21 at k=20, gmin = -20.5*2/21 (fp16: -1.9521484),
    # gmax = 1.0; codes 31 and 0.
    assert q.mins[0, GROUP_OUTER].item() == pytest.approx(-1.9521484, abs=1e-6)
    assert q.maxs[0, GROUP_OUTER].item() == 1.0
    assert q.codes.tolist() == [[31, 0, 8, 0, 15, 31, 0, 21]]
    y = dequantize(q, THR)[0]
    step_o = (1.0 + 1.9521484375) / 31
    expected = [
        -1.9521484375 + 31 * step_o + 4.0,  # 5.0
        -1.9521484375 - 4.0,  # -6.0, half a step (+fp16 rounding) off
        -1.375 + 8 * 0.25 + 0.5,  # 1.0 -> 1.125
        -1.375 - 0.5,  # -2.0 -> -1.875
        -1.375 + 15 * 0.25 + 0.5,  # 3.0 -> 2.875
        0.25,
        -0.5,
        -0.5 + 21 * (0.75 / 31),
    ]
    assert y.tolist() == pytest.approx(expected, abs=1e-6)


def test_values_exactly_on_thresholds():
    x = torch.tensor([[-4.0, -0.5, 0.5, 4.0, 4.0001, -4.0001, 0.4999, -0.5001]])
    g = assign_groups(x, THR)
    # On an outer threshold: middle; on an inner threshold: inner.
    assert g.tolist() == [[0, 1, 1, 0, 2, 2, 1, 0]]
    y = quantize_dequantize(x, THR)
    # Middle values keep their side: at or beyond the inner threshold of their side.
    assert y[0, 0] <= -0.5 and y[0, 3] >= 0.5 and y[0, 7] <= -0.5


def test_thresholds_validation():
    with pytest.raises(ValueError, match="to_lo < ti_lo <= ti_hi < to_hi"):
        thresholds_tuple((0.0, -1.0, 1.0, 2.0))
    with pytest.raises(ValueError, match="finite"):
        thresholds_tuple((-1.0, float("nan"), 0.0, 1.0))
    with pytest.raises(ValueError, match="4 values"):
        thresholds_tuple((-1.0, 0.0, 1.0))
    assert thresholds_tuple((-2.0, 0.0, 0.0, 2.0)) == (-2.0, 0.0, 0.0, 2.0)  # ti_lo == ti_hi is allowed


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_or_inf_input_is_a_clear_error(bad):
    x = torch.zeros(2, 8)
    x[1, 3] = bad
    with pytest.raises(ValueError, match="NaN or infinite"):
        quantize(x, THR)


def test_wrong_shape_and_dtype_are_clear_errors():
    with pytest.raises(ValueError, match=r"\[N, D\]"):
        quantize(torch.zeros(2, 3, 4), THR)
    with pytest.raises(TypeError, match="floating-point"):
        quantize(torch.zeros(2, 4, dtype=torch.int32), THR)
    # the README's function: no vector values, another array type, a dict for the config (raw torch errors before)
    with pytest.raises(ValueError, match="at least one value in the last dimension, got \\(8, 0\\)"):
        quantize_dequantize(torch.zeros(8, 0), THR)
    with pytest.raises(TypeError, match=r"expects a torch\.Tensor, got ndarray"):
        quantize_dequantize(np.zeros((2, 8), np.float32), THR)
    with pytest.raises(TypeError, match="config must be an OakenConfig, got dict"):
        quantize_dequantize(torch.zeros(2, 8), THR, {"outer_ratio": 0.04})
    assert quantize_dequantize(torch.zeros(0, 8), THR).shape == (0, 8)  # no vector: nothing to do


def test_fp16_overflowing_range_asks_for_fp32_scales():
    x = torch.tensor([[1e6, 0.0, 1.0, -1.0]])
    with pytest.raises(ValueError, match="scale_dtype='float32'"):
        quantize(x, THR)
    y = quantize_dequantize(x, THR, OakenConfig(scale_dtype="float32"))
    assert abs(y[0, 0].item() - 1e6) < 1.0


def test_constant_vectors_and_empty_groups():
    for value in (0.0, 0.3, 2.0, -3.0, 7.0, -9.5):
        x = torch.full((3, 64), value)
        q = quantize(x, THR)
        y = dequantize(q, THR)
        # A one-valued group is restored to within half a step of its own (tiny or zero) range, plus fp16 rounding.
        assert torch.allclose(y, x, atol=2e-3 * max(1.0, abs(value)))
        for g in range(3):
            if not (q.groups == g).any():
                assert q.mins[:, g].eq(0).all() and q.maxs[:, g].eq(0).all()


def test_single_value_groups():
    x = torch.tensor([[6.0, 1.0, 0.1, 1.5, 2.0, -1.0]])  # one outer, one inner, four middle
    q = quantize(x, THR)
    assert (q.groups == GROUP_OUTER).sum() == 1 and (q.groups == GROUP_INNER).sum() == 1
    err = (dequantize(q, THR) - x).abs()
    assert (err <= _slack(q, OakenConfig())).all()
    # A lone outer or inner value has a zero-width grid: it comes back as itself, up to fp16 rounding.
    assert err[0, 0] <= 6.0 * 2**-11 and err[0, 2] <= 0.1 * 2**-11


def test_head_granularity_is_a_reshape():
    torch.manual_seed(0)
    x = torch.randn(5, 3 * 64)
    per_head = quantize_dequantize(x.reshape(-1, 64), THR).reshape(5, 192)
    per_token = quantize_dequantize(x, THR)
    assert per_head.shape == per_token.shape
    assert not torch.equal(per_head, per_token)  # different scale sets
    assert (per_head - x).abs().max() < 0.5


def test_group_fractions_follow_quantile_thresholds():
    torch.manual_seed(1)
    x = torch.randn(4000, 64)
    q = torch.quantile(x.flatten()[:200_000], torch.tensor([0.02, 0.47, 0.53, 0.98])).tolist()
    fr = group_fractions(torch.randn(4000, 64), q)  # held-out draw
    assert fr["outer"] == pytest.approx(0.04, abs=0.003)
    assert fr["inner"] == pytest.approx(0.06, abs=0.003)
    assert fr["middle"] == pytest.approx(0.90, abs=0.005)


def test_four_bit_outliers_config():
    torch.manual_seed(2)
    x = torch.randn(50, 128) * 2
    cfg = OakenConfig(inner_bits=4, outer_bits=4)
    q = quantize(x, THR, cfg)
    assert q.codes.max() <= 15
    err5 = (quantize_dequantize(x, THR) - x).pow(2).mean()
    err4 = (quantize_dequantize(x, THR, cfg) - x).pow(2).mean()
    assert err4 > err5


# ---------------------------------------------------------------- properties (hypothesis)

finite32 = st.floats(min_value=-50.0, max_value=50.0, allow_nan=False, allow_infinity=False, width=32)


@st.composite
def thresholds_strategy(draw):
    a, b, c, d = sorted(draw(st.lists(st.floats(-20, 20, width=32), min_size=4, max_size=4, unique=True)))
    equal_inner = draw(st.booleans())
    return (a, b, b if equal_inner else c, d)


@st.composite
def rows_strategy(draw):
    n = draw(st.integers(1, 6))
    d = draw(st.integers(1, 200))
    arr = draw(hnp.arrays(np.float32, (n, d), elements=finite32))
    return torch.from_numpy(arr)


def _slack(q: QuantizedVectors, cfg: OakenConfig) -> torch.Tensor:
    """Half a step, widened by the fp16 rounding of the stored end points (relative 2^-11 each)."""
    bound = error_bound(q, cfg)
    ends = torch.maximum(q.mins.abs(), q.maxs.abs()).to(torch.float32)  # [N, 3]
    rnd = torch.zeros_like(bound)
    for g in range(3):
        rnd = torch.where(q.groups == g, ends[:, g : g + 1].expand_as(rnd), rnd)
    return bound * (1 + 2**-5) + rnd * 2**-9 + 1e-6


@settings(max_examples=150, deadline=None)
@given(x=rows_strategy(), thr=thresholds_strategy())
def test_error_within_half_a_step_and_never_on_the_wrong_side(x, thr):
    _check_error_and_sides(x, thr, OakenConfig())


@settings(max_examples=100, deadline=None)
@given(x=rows_strategy(), thr=thresholds_strategy(), mb=st.sampled_from([3, 2, 5, 6, 7]), narrow=st.booleans())
def test_other_slot_widths_error_within_half_a_step_and_never_on_the_wrong_side(x, thr, mb, narrow):
    """A 2-, 3- or 5..7-bit middle code (OakenConfig.middle_bits) keeps the signed grid's guarantees: half a step, and
    every middle and outer value restored on its own side, with outliers of the slot's bits or one more."""
    _check_error_and_sides(x, thr, OakenConfig(middle_bits=mb, inner_bits=mb if narrow else mb + 1))


def _check_error_and_sides(x, thr, cfg, static=None):
    q = quantize(x, thr, cfg, static_scales=static)
    y = dequantize(q, thr, cfg)
    to_lo, ti_lo, ti_hi, to_hi = thresholds_tuple(thr)
    codes = q.codes.long()  # (a uint8 tensor compared with 256 would compare with 0)
    assert (codes[q.groups == GROUP_MIDDLE] < 2**cfg.middle_bits).all()
    assert (codes[q.groups == GROUP_INNER] < 2**cfg.inner_bits).all()
    assert (codes < 2 ** (cfg.middle_bits + 1)).all()
    err = (y - x).abs()
    assert (err <= _slack(q, cfg)).all(), float((err - _slack(q, cfg)).max())
    # The side survives: a middle value above ti_hi comes back at or above ti_hi, and so on.
    mid, out = q.groups == GROUP_MIDDLE, q.groups == GROUP_OUTER
    assert (y[mid & (x > ti_hi)] >= ti_hi).all()
    assert (y[mid & (x < ti_lo)] <= ti_lo).all()
    assert (y[out & (x > to_hi)] >= to_hi).all()
    assert (y[out & (x < to_lo)] <= to_lo).all()


@settings(max_examples=60, deadline=None)
@given(x=rows_strategy(), thr=thresholds_strategy(), dtype=st.sampled_from([torch.float16, torch.bfloat16]))
def test_low_precision_inputs(x, thr, dtype):
    xl = x.to(dtype)
    y = quantize_dequantize(xl, thr)
    assert y.dtype == dtype and y.shape == xl.shape
    q = quantize(xl, thr)
    y32 = dequantize(q, thr)
    # Bound against the input as the quantizer saw it (float32 of the low-precision values).
    assert ((y32 - xl.float()).abs() <= _slack(q, OakenConfig())).all()
    # Casting the result back costs at most the output dtype's rounding.
    assert torch.allclose(y.float(), y32, rtol=2**-7, atol=1e-6)


@settings(max_examples=100, deadline=None)
@given(x=rows_strategy(), thr=thresholds_strategy())
def test_fp32_scales_meet_the_plain_half_step_bound(x, thr):
    # Without fp16 rounding of the end points, every value is within half a step of its group (float32 slack only).
    cfg = OakenConfig(scale_dtype="float32")
    q = quantize(x, thr, cfg)
    err = (dequantize(q, thr, cfg) - x).abs()
    assert (err <= error_bound(q, cfg) * (1 + 1e-5) + 1e-5 * (1 + x.abs())).all()


# ---------------------------------------------------------------- static middle/inner scales (experimental, #36)


def test_static_grid_by_hand():
    # Middle magnitudes 3.5 below and above zero: step(k) = max(3.5/(k+1), 3.5/(15-k)) is 0.4375 at k=7, so
    # gmin = -7.5 * 0.4375 = -3.28125 and the end codes absorb half a step more (+-3.5 covered). Inner: [-0.5, 0.5].
    mins, maxs = static_grid(THR)
    assert mins.tolist() == [-3.28125, -0.5, 0.0] and maxs.tolist() == [3.28125, 0.5, 0.0]
    assert mins.dtype == torch.float16
    half = static_grid(THR, clip=0.5)  # the middle grid shrinks, the inner one does not
    assert half[0][GROUP_MIDDLE].item() == pytest.approx(-3.28125 / 2, rel=1e-3)
    assert half[0][GROUP_INNER].item() == -0.5
    # adaptive grouping: the grouping thresholds bound the groups (to_lo' = -6: middle down to -6 - -0.5 = -5.5)
    wide = static_grid(THR, group=(-6.0, -0.5, 0.5, 4.0))
    assert wide[0][GROUP_MIDDLE].item() < -3.5 and wide[1][GROUP_MIDDLE].item() > 0
    for bad in (0.0, 1.5, -1.0, True, float("nan")):
        with pytest.raises(ValueError, match="clip"):
            static_grid(THR, clip=bad)


@settings(max_examples=60, deadline=None)
@given(x=rows_strategy(), thr=thresholds_strategy())
def test_static_scales_off_is_the_codec_bit_for_bit(x, thr):
    """The option's default (None) leaves the reference what the (unchanged) numba codec reproduces, bit for bit."""
    from oakenkv.kernels.codec import decode, encode

    q = quantize(x, thr, static_scales=None)
    y = dequantize(q, thr)
    assert torch.equal(y, decode(encode(x, thr), thr))
    ref = quantize(x, thr)
    assert torch.equal(q.codes, ref.codes) and torch.equal(q.mins, ref.mins) and torch.equal(q.maxs, ref.maxs)


@settings(max_examples=100, deadline=None)
@given(x=rows_strategy(), thr=thresholds_strategy(), mb=st.sampled_from([4, 3, 2]))
def test_static_scales_end_points_and_round_trip(x, thr, mb):
    """On: every row's middle and inner end points are the static ones, the outer's are the per-row ones, and
    (clip 1 covers every middle and inner value) each value comes back within its grid's half step, on its side."""
    cfg = OakenConfig(middle_bits=mb, inner_bits=mb + 1)
    q = quantize(x, thr, cfg, static_scales=1.0)
    mins, maxs = static_grid(thr, cfg)
    for g in (GROUP_MIDDLE, GROUP_INNER):
        assert (q.mins[:, g] == mins[g]).all() and (q.maxs[:, g] == maxs[g]).all()
    per_row = quantize(x, thr, cfg)
    assert torch.equal(q.mins[:, GROUP_OUTER], per_row.mins[:, GROUP_OUTER])
    assert torch.equal(q.maxs[:, GROUP_OUTER], per_row.maxs[:, GROUP_OUTER])
    assert torch.equal(q.groups, per_row.groups)
    outer = q.groups == GROUP_OUTER
    assert torch.equal(q.codes[outer], per_row.codes[outer])
    _check_error_and_sides(x, thr, cfg, static=1.0)


@settings(max_examples=60, deadline=None)
@given(x=rows_strategy(), thr=thresholds_strategy(), clip=st.sampled_from([0.25, 0.5, 0.8]))
def test_clipped_static_scales_keep_sides(x, thr, clip):
    """Below 1 a middle value beyond the static grid is clamped to an end code: never restored on the wrong side,
    and never further from its threshold than the value itself."""
    q = quantize(x, thr, static_scales=clip)
    y = dequantize(q, thr)
    _, ti_lo, ti_hi, _ = thresholds_tuple(thr)
    mid = q.groups == GROUP_MIDDLE
    up, down = mid & (x > ti_hi), mid & (x < ti_lo)
    assert (y[up] >= ti_hi).all() and (y[down] <= ti_lo).all()
    slack = _slack(q, OakenConfig())
    assert (y[up] <= torch.maximum(x[up], y[up] * 0 + ti_hi) + slack[up]).all()
    assert (y[down] >= torch.minimum(x[down], y[down] * 0 + ti_lo) - slack[down]).all()
    err = (y - x).abs()
    assert (err[~mid] <= slack[~mid]).all()


# ---------------------------------------------------------------- static levels (OakenConfig.static_levels)


def _simulation():
    """benchmarks/static_scales.py, whose ``_quantize_levels`` simulated static levels before the format had them."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "static_scales.py"
    spec = importlib.util.spec_from_file_location("static_scales_sim", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_static_levels_by_hand():
    """Each row takes the smallest level covering its middle values; the inner grid is the clip-1 one in all."""
    from oakenkv.quant.quantizer import format_level_grids, level_grids

    cfg = OakenConfig(static_grids=True, static_levels=(0.5, 0.7, 0.85, 1.0))
    # the middle range is 3.5 on both sides: need = max |shifted middle| / 3.5
    x = torch.tensor(
        [
            [0.0, 1.0, -1.0, 0.2],  # 0.5 / 3.5: level 0
            [0.0, 2.0, -1.0, 0.2],  # 1.5 / 3.5 = 0.43: level 0
            [0.0, 1.0, -2.5, 0.2],  # 2.0 / 3.5 = 0.57: level 1 (0.7)
            [0.0, 3.9, -1.0, 0.2],  # 3.4 / 3.5 = 0.97: level 3
            [0.0, 0.1, 0.3, 5.0],  # no middle value: level 0
            [0.0, 2.25, -1.0, 0.2],  # exactly 0.5: level 0 (the first level >= need)
        ]
    )
    q = quantize(x, THR, cfg)
    assert q.level.dtype == torch.uint8 and q.level.tolist() == [0, 0, 1, 3, 0, 0]
    mins, maxs = level_grids(THR, cfg)
    assert mins.shape == (4, 3) and mins.dtype == torch.float16
    assert torch.equal(q.mins[:, :2], mins[q.level.long(), :2]) and torch.equal(q.maxs[:, :2], maxs[q.level.long(), :2])
    for j, c in enumerate(cfg.static_levels):
        one = static_grid(THR, cfg, clip=c)
        assert torch.equal(mins[j], one[0]) and torch.equal(maxs[j], one[1])
        assert mins[j, GROUP_INNER] == -0.5 and maxs[j, GROUP_INNER] == 0.5  # clip-1 inner grid
    grids = format_level_grids(THR, cfg)
    assert len(grids) == 4 and grids[-1] == (-3.28125, 3.28125, -0.5, 0.5)  # the last: the one static grid
    one_grid = quantize(x, THR, cfg.replace(static_levels=()))  # the one static grid is the last level's
    assert torch.equal(one_grid.mins[:, :2], mins[3, :2].expand(6, 2))
    assert torch.equal(one_grid.maxs[:, :2], maxs[3, :2].expand(6, 2))
    with pytest.raises(ValueError, match="static levels"):
        level_grids(THR, OakenConfig(static_grids=True))


@settings(max_examples=40, deadline=None)
@given(x=rows_strategy(), thr=thresholds_strategy(), mb=st.sampled_from([2, 3, 4, 5, 7]))
def test_static_levels_are_the_simulation_bit_for_bit(x, thr, mb):
    """The format's choice and grids are what benchmarks/static_scales.py --levels simulated: the same codes, end
    points and dequantized values (so that its perplexities are the real codec's)."""
    sim = _simulation()
    levels = (0.5, 0.7, 0.85, 1.0)
    cfg = OakenConfig(middle_bits=mb, static_grids=True, static_levels=levels)
    fake = type("Sim", (), {"levels": levels, "config": cfg.replace(static_grids=False, static_levels=()), "stats": {}})
    want = sim._ReferenceOaken._quantize_levels(fake(), x, thr)
    q = quantize(x, thr, cfg)
    for name in ("codes", "groups", "mins", "maxs"):
        assert torch.equal(getattr(q, name), getattr(want, name)), name
    assert torch.equal(dequantize(q, thr, cfg), dequantize(want, thr, cfg))
    # the smallest covering level: a smaller one would have clipped a middle value
    _check_error_and_sides(x, thr, cfg)
