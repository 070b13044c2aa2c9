"""Adaptive grouping (src/oakenkv/quant/adapt.py): the controller, and the same numbers in the cache's store
(src/oakenkv/store/paged.py) and in the evaluation's fake-quantizer (src/oakenkv/methods/oaken.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from oakenkv.calibrate.thresholds import GroupThresholds
from oakenkv.hf.cache import KEY, VALUE, OakenLayer, PagedKVStore
from oakenkv.quant.adapt import AdaptConfig, AdaptState, new_state, next_scale, scaled, shift_thresholds
from oakenkv.store.pages import PoolConfig
from test_sinks import HD, HQ, H, _profile

THR = GroupThresholds(-2.0, -0.15, 0.15, 2.0)
KINDS_ = ("key", "value")


def test_scaled_thresholds_move_the_outer_ones_only():
    assert scaled(THR, 1.0) == THR.float32_tuple()
    lo, ti_lo, ti_hi, hi = scaled(THR, 1.25)
    assert (ti_lo, ti_hi) == THR.float32_tuple()[1:3]
    assert hi == pytest.approx(0.15 + 1.25 * 1.85) and lo == pytest.approx(-0.15 - 1.25 * 1.85)
    # monotone in the scale, in float32 too: the shift thresholds (the lowest scale) are innermost
    assert shift_thresholds(THR, AdaptConfig()).float32_tuple() == THR.float32_tuple()  # by default: the profile's
    prev = shift_thresholds(THR, AdaptConfig(low=0.8)).float32_tuple()
    for a in np.linspace(0.8, 1.25, 50):
        g = scaled(THR, float(a))
        assert g[0] <= prev[0] and g[3] >= prev[3]
    with pytest.raises(ValueError, match="low <= 1 <= high"):
        AdaptConfig(low=1.1)
    with pytest.raises(ValueError, match="epoch"):
        AdaptConfig(epoch=0)


def test_next_scale_follows_the_observed_share_within_bounds():
    cfg = AdaptConfig()
    assert next_scale(1.0, 100, 1000, 0.1, cfg) == 1.0
    assert next_scale(1.0, 200, 1000, 0.1, cfg) == pytest.approx(2**0.25)  # twice the share: wider thresholds
    assert next_scale(1.0, 50, 1000, 0.1, cfg) == cfg.low == 1.0  # by default the thresholds only widen
    assert next_scale(1.0, 50, 1000, 0.1, AdaptConfig(low=0.5)) == pytest.approx(0.5**0.25)
    assert next_scale(1.2, 10_000, 1000, 0.1, cfg) == cfg.high
    assert next_scale(1.0, 0, 1000, 0.1, cfg) == cfg.low  # no outlier at all: as if one, clipped


def test_state_counts_epochs_and_refuses_a_range_across_one():
    st = AdaptState(AdaptConfig(epoch=8), [[THR, THR]], [[0.1, 0.1]])
    assert st.segment(0, KEY, 20) == 8
    assert not st.record(0, KEY, 5, 100, 5 * 192)
    assert st.segment(0, KEY, 20) == 3
    with pytest.raises(ValueError, match="cross an epoch"):
        st.record(0, KEY, 4, 0, 4 * 192)
    assert st.record(0, KEY, 3, 400, 3 * 192)  # the epoch's share: 500 / (8 * 192) = 0.33 > 0.1
    assert st.scale[0][KEY] > 1.0 and st.scale[0][VALUE] == 1.0
    st.reset()
    assert st.scale[0][KEY] == 1.0 and st.tokens[0][KEY] == 0


def _shifting_kv(b: int, t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values whose spread changes during the sequence (narrow, then wide): the outer thresholds must
    follow."""
    g = torch.Generator().manual_seed(seed)
    spread = torch.where(torch.arange(t) < t // 2, 0.6, 1.8).reshape(1, 1, t, 1)
    k = torch.randn(b, H, t, HD, generator=g) * spread
    v = torch.randn(b, H, t, HD, generator=g) * spread * 0.8
    return k, v


@pytest.mark.parametrize(("residual", "sink", "b"), [(0, 1, 1), (0, 0, 2), (4, 1, 2)])
def test_the_evaluation_cache_reads_what_the_store_holds(residual, sink, b):
    """``eval ppl``'s ``oaken-plus:adapt=1`` (FakeQuantCache over PlusQuantizer) and ``OakenCache(adapt=...)``'s
    store return the same keys and values at every step (a prefill across epochs, then single tokens, the decode
    path), and reach the same scales, which do move."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from oakenkv.methods.fakequant import FakeQuantCache
    from oakenkv.methods.oaken import PlusQuantizer

    config = LlamaConfig(
        num_hidden_layers=2, num_attention_heads=HQ, num_key_value_heads=H, hidden_size=HQ * HD, head_dim=HD,
        intermediate_size=32, vocab_size=16,
    )  # fmt: skip
    th = _profile(sink)
    cfg = AdaptConfig(epoch=8)
    q = PlusQuantizer(th, cfg)
    evaluated = FakeQuantCache(LlamaForCausalLM(config), q, residual=residual)
    assert evaluated.quantizer is not q and q.adapt_state is None  # each cache adapts on its own
    store = PagedKVStore(th, 2, H, HD, PoolConfig(page_size=1024), residual=residual, adapt=cfg)
    layer = OakenLayer(store, 1)
    k, v = _shifting_kv(b, 60, 5)
    for a, e in [(0, 21), *((i, i + 1) for i in range(21, 60))]:
        want_k, want_v = evaluated.update(k[:, :, a:e], v[:, :, a:e], 1)
        got_k, got_v = layer.update(k[:, :, a:e], v[:, :, a:e])
        torch.testing.assert_close(got_k, want_k, rtol=0, atol=1e-6)  # (the rotation's float rounding)
        torch.testing.assert_close(got_v, want_v, rtol=0, atol=0)
    st, est = store.adapt_state, evaluated.quantizer.adapt_state
    assert st.scale == est.scale and st.tokens == est.tokens
    assert st.scale[1][KEY] > 1.0 and st.scale[1][VALUE] > 1.0  # the wide half has more outliers


def test_the_fast_and_reference_stores_agree_and_the_pages_decode_with_the_shift_thresholds():
    k, v = _shifting_kv(2, 50, 6)
    stores = [
        PagedKVStore(_profile(1), 2, H, HD, PoolConfig(page_size=1024), codec=c, adapt=AdaptConfig(epoch=16))
        for c in ("fast", "reference")
    ]
    for s in stores:
        s.append(1, k[:, :, :37], v[:, :, :37])
        for i in range(37, 50):
            if s.fast:
                s.append_token(1, k[:, :, i : i + 1], v[:, :, i : i + 1])
            else:
                s.append(1, k[:, :, i : i + 1], v[:, :, i : i + 1])
    fast, ref = stores
    assert fast.adapt_state.scale == ref.adapt_state.scale
    for kind in (KEY, VALUE):
        assert torch.equal(fast.read(1, kind), ref.read(1, kind))
    # the page view (what the packed attention reads) carries the fixed shift thresholds
    view = fast.layer_view(1)
    want = [shift_thresholds(_profile(1).layer(1, kind), AdaptConfig(epoch=16)).as_tuple() for kind in KINDS_]
    assert np.array_equal(view.thresholds, np.array(want, np.float32))


def test_without_adaptation_nothing_changes():
    k, v = _shifting_kv(1, 40, 7)
    plain = PagedKVStore(_profile(1), 2, H, HD, PoolConfig(page_size=1024))
    assert plain.adapt_state is None
    plain.append(1, k, v)
    again = PagedKVStore(_profile(1), 2, H, HD, PoolConfig(page_size=1024))
    again.append(1, k[:, :, :13], v[:, :, :13])
    again.append(1, k[:, :, 13:], v[:, :, 13:])
    assert torch.equal(plain.read(1, KEY), again.read(1, KEY))
    with pytest.raises(TypeError, match="AdaptConfig"):
        PagedKVStore(_profile(1), 2, H, HD, adapt=True)


def test_new_state_targets_each_layers_profiled_share():
    th = _profile(0)
    st = new_state(th, AdaptConfig())
    assert st.target == [[0.1, 0.1], [0.1, 0.1]]  # no statistics: the config's 4% + 6%
    assert st.grouping(0, KEY) == th.layer(0, "key").float32_tuple()
