"""Each baseline quantizer checked against its definition on hand-made tensors: error bounds, grouping, bits."""

from __future__ import annotations

import pytest
import torch

from oakenkv.methods.fp8 import E4M3_MAX, Fp8Quantizer, fp8_e4m3_fake_quant
from oakenkv.methods.kivi import KiviLayer, kivi_quantize_keys, kivi_quantize_values
from oakenkv.methods.kvquant import KVQuantQuantizer, kvquant_keys, kvquant_values
from oakenkv.methods.oaken_official import OakenOfficialQuantizer, official_fake_quant
from oakenkv.methods.uniform import PerTokenIntQuantizer, grouped_fake_quant, minmax_fake_quant


def _kv(b=2, h=3, s=64, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, h, s, d, generator=g)


def _max_step(x, bits, dim):
    return ((x.amax(dim) - x.amin(dim)) / (2**bits - 1)).max()


# ---------------------------------------------------------------------------------------------- uniform / INT-n


@pytest.mark.parametrize("bits", [2, 4, 5, 8])
def test_minmax_error_within_half_step(bits):
    x = _kv()
    y = minmax_fake_quant(x, bits, dim=-1)
    step = (x.amax(-1, keepdim=True) - x.amin(-1, keepdim=True)) / (2**bits - 1)
    # half a step, plus the fp16 rounding of the stored end points
    slack = 1e-3 * x.abs().amax(-1, keepdim=True)
    assert ((y - x).abs() <= step / 2 + slack).all()
    assert y.shape == x.shape and y.dtype == x.dtype


def test_minmax_uses_at_most_2_pow_bits_levels_and_keeps_constants():
    x = _kv(s=8)
    y = minmax_fake_quant(x, 4, dim=-1)
    for row in y.reshape(-1, x.shape[-1]):
        assert row.unique().numel() <= 16
    c = torch.full((1, 1, 3, 8), 0.75)
    assert torch.equal(minmax_fake_quant(c, 4), c)
    with pytest.raises(ValueError):
        minmax_fake_quant(x, 1)


def test_grouped_fake_quant_groups_are_independent():
    x = torch.zeros(1, 1, 1, 64)
    x[..., :32] = torch.linspace(0, 1, 32)
    x[..., 32:] = torch.linspace(0, 1000, 32)  # a huge second group must not coarsen the first
    y = grouped_fake_quant(x, 4, 32)
    assert (y[..., :32] - x[..., :32]).abs().max() <= 1 / 30 + 1e-3
    with pytest.raises(ValueError):
        grouped_fake_quant(x, 4, 48)


@pytest.mark.parametrize(("bits", "d", "expected"), [(4, 64, 4.5), (5, 64, 5.5), (4, 128, 4.25)])
def test_per_token_int_bits(bits, d, expected):
    x = _kv(d=d)
    y, stored = PerTokenIntQuantizer(bits).quantize(0, "key", x)
    assert stored / x.numel() == pytest.approx(expected)
    assert (y - x).abs().max() <= _max_step(x, bits, -1) / 2 + 1e-2


def test_per_token_int_rejects_nan_and_bad_shapes():
    q = PerTokenIntQuantizer(4)
    x = _kv()
    x[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        q.quantize(0, "key", x)
    with pytest.raises(ValueError, match="shape"):
        q.quantize(0, "key", torch.zeros(3, 4))


# ---------------------------------------------------------------------------------------------- KIVI


def test_kivi_keys_are_per_channel_over_token_groups():
    k = _kv(b=1, h=1, s=64, d=4) * 0.1
    k[..., 2] += 100.0 * torch.arange(64).float()[None, None]  # one channel with a huge, varying range
    y = kivi_quantize_keys(k, 4, 32)
    # the other channels keep their own small grids
    for c in (0, 1, 3):
        assert (y[..., c] - k[..., c]).abs().max() <= _max_step(k[..., c].reshape(2, 32), 4, 1) / 2 + 1e-3
    # each (channel, 32-token group) has at most 16 levels
    for g in range(2):
        assert y[0, 0, g * 32 : (g + 1) * 32, 2].unique().numel() <= 16
    with pytest.raises(ValueError, match="multiple"):
        kivi_quantize_keys(k[..., :40, :], 4, 32)


def test_kivi_values_are_per_token():
    v = _kv(b=1, h=1, s=4, d=64)
    v[0, 0, 1] *= 1000  # a huge token must not affect the others
    y = kivi_quantize_values(v, 4, 32)
    assert (y[0, 0, 0] - v[0, 0, 0]).abs().max() <= _max_step(v[0, 0, 0].reshape(2, 32), 4, 1) / 2 + 1e-3


def test_kivi_layer_residual_windows_and_bits():
    layer = KiviLayer(bits=4, group=32, residual=128)
    k, v = _kv(b=1, h=2, s=300, d=64, seed=1), _kv(b=1, h=2, s=300, d=64, seed=2)
    ko, vo = layer.update(k, v)
    # keys: 300 - 300 % 128 = 256 quantized, last 44 exact; values: last 128 exact, first 172 quantized
    assert layer.n_quant_keys == 256 and layer.n_quant_values == 172
    assert torch.equal(ko[..., 256:, :], k[..., 256:, :]) and not torch.equal(ko[..., :256, :], k[..., :256, :])
    assert torch.equal(vo[..., 172:, :], v[..., 172:, :]) and not torch.equal(vo[..., :172, :], v[..., :172, :])
    assert torch.allclose(ko[..., :256, :], kivi_quantize_keys(k[..., :256, :], 4, 32))
    bits, n = layer.stored_bits()
    per_tok = 2 * 64
    expect = per_tok * (256 * 5 + 44 * 16 + 172 * 5 + 128 * 16)
    assert n == 2 * per_tok * 300 and bits == pytest.approx(expect)
    # decode one token at a time: keys flush when the fp16 buffer reaches 128 again (at 384 tokens)
    for t in range(84):
        ko, vo = layer.update(k[..., t : t + 1, :], v[..., t : t + 1, :])
        assert layer.n_quant_values == 172 + t + 1
        assert layer.n_quant_keys == (384 if t == 83 else 256)
    assert ko.shape[-2] == 384 and layer.get_seq_length() == 384


def test_kivi_layer_validates_config():
    with pytest.raises(ValueError):
        KiviLayer(4, group=32, residual=100)


# ---------------------------------------------------------------------------------------------- KVQuant


def test_kvquant_keys_outliers_exact_inliers_on_channel_grid():
    k = _kv(b=1, h=2, s=50, d=8)
    lo, hi = torch.full((2, 8), -1.0), torch.full((2, 8), 1.0)
    lo[1, 3], hi[1, 3] = -5.0, 5.0
    y, n_out = kvquant_keys(k, lo, hi, 4)
    outside = (k < lo[None, :, None]) | (k > hi[None, :, None])
    assert n_out == int(outside.sum()) > 0
    assert torch.allclose(y[outside], k[outside].half().float())
    step = (hi - lo)[None, :, None] / 15
    assert ((y - k).abs()[~outside] <= (step / 2).expand_as(k)[~outside] + 1e-6).all()


def test_kvquant_values_keep_one_percent_per_token():
    v = _kv(b=1, h=3, s=10, d=64)  # 192 values per token -> 1 low + 1 high outlier per token (~1%)
    y, n_out = kvquant_values(v, 0.01, 4)
    assert n_out == 2 * 10
    flat_v = v.permute(0, 2, 1, 3).reshape(10, 192)
    flat_y = y.permute(0, 2, 1, 3).reshape(10, 192)
    for t in range(10):
        for idx in (flat_v[t].argmax(), flat_v[t].argmin()):
            assert flat_y[t, idx] == flat_v[t, idx].half().float()


def test_kvquant_bits_and_pre_rope():
    k = _kv(b=1, h=3, s=16, d=64)
    ranges = [(torch.full((3, 64), -10.0), torch.full((3, 64), 10.0))]
    q = KVQuantQuantizer(ranges)
    assert q.key_position == "pre_rope"
    _, kb = q.quantize(0, "key", k)  # no key outliers inside +-10
    assert kb == 4 * k.numel() + 16 * 16  # dense nibbles + 16-bit count per token
    _, vb = q.quantize(0, "value", k)
    assert vb == 4 * k.numel() + 2 * 16 * 32 + 16 * 16 + 16 * 32


# ---------------------------------------------------------------------------------------------- FP8


def test_fp8_exact_on_representable_values_and_saturates():
    x = torch.tensor([0.0, 0.5, 1.0, -3.0, 448.0, 1000.0, -1e6])
    y = fp8_e4m3_fake_quant(x)
    assert torch.equal(y[:5], x[:5])
    assert y[5] == E4M3_MAX and y[6] == -E4M3_MAX
    r = torch.linspace(0.02, 400, 1000)  # normal range: relative error <= 2^-4 (3 mantissa bits)
    assert ((fp8_e4m3_fake_quant(r) - r).abs() / r <= 2**-4 + 1e-6).all()
    _, bits = Fp8Quantizer().quantize(0, "value", _kv())
    assert bits == 8 * _kv().numel()


# ---------------------------------------------------------------------------------------------- official Oaken


def test_official_fixed_grids_and_sides():
    thr = (-2.0, -0.1, 0.1, 2.0)
    x = torch.tensor([-3.5, -2.5, -1.0, -0.05, 0.0, 0.07, 0.5, 1.9, 2.2, 4.0])
    y, n_out = official_fake_quant(x, thr, xmin=-4.0, xmax=4.0)
    assert n_out == 2 + 3 + 2  # two outer below, three inner, two outer above (1.9 is middle)
    # each value stays in its group's range and on its side
    assert (y[x > 2.0] >= 2.0).all() and (y[x < -2.0] <= -2.0).all()
    assert (y[x.abs() <= 2.0].abs() <= 2.0 + 1e-3).all()  # + fp16 rounding of the grid end
    mid = (x.abs() > 0.1) & (x.abs() <= 2.0)
    assert ((y[mid] - x[mid]).abs() <= (1.9 - -1.9) / 15 / 2 + 1e-3).all()
    inner = x.abs() <= 0.1
    assert ((y[inner] - x[inner]).abs() <= 0.2 / 31 / 2 + 1e-3).all()


def test_official_quantizer_bits_have_no_per_token_scales():
    thr = {"key": [(-2.0, -0.1, 0.1, 2.0)], "value": [(-2.0, -0.1, 0.1, 2.0)]}
    ext = {"key": [(-5.0, 5.0)], "value": [(-5.0, 5.0)]}
    q = OakenOfficialQuantizer(thr, ext)
    x = _kv(b=1, h=3, s=4, d=64)
    _, bits = q.quantize(0, "key", x)
    _, n_out = official_fake_quant(x, thr["key"][0], -5.0, 5.0)
    assert bits == 4 * x.numel() + 8 * n_out + 16 * 4
