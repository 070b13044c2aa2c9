"""Tests of oakenkv.calibrate.search's scoring parts against their plain definitions: the candidates' attention
errors (``_Scorer``: reused buffers, stacked query heads, in-place softmax) and their thresholds (``_Profile``:
the kurtosis only for the chosen candidate) must be the same numbers, bit for bit, as the plain attention and the
paper's per-run statistics (the choices and every candidate's error in a profile file depend on them)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from oakenkv.calibrate.search import DEFAULT_RATIOS, _Profile, _Scorer, attention_output
from oakenkv.calibrate.stats import RunAccumulator, run_thresholds
from oakenkv.format.config import OakenConfig


def _plain_error(q, k, v, ref, scaling, window, positions) -> float:
    out = attention_output(q, k, v, scaling, window, positions)
    return float((out - ref).pow(2).sum()) / float(ref.pow(2).sum())


@pytest.mark.parametrize(
    ("scaling", "window", "positions"),
    [(0.125, None, 24), (0.1, None, 64), (0.25, 20, 80), (0.3, 9, 200), (0.125, None, 1)],
)
def test_the_scorer_gives_the_plain_attentions_errors(scaling, window, positions):
    g = torch.Generator().manual_seed(int(scaling * 100) + positions)
    r, hq, h, s, hd = 2, 6, 2, 96, 16
    q = torch.randn(r, hq, s, hd, generator=g) * 2
    k = torch.randn(r, h, s, hd, generator=g) * 2 + 0.5
    v = torch.randn(r, h, s, hd, generator=g)
    ref = attention_output(q, k, v, scaling, window, positions)
    scorer = _Scorer(q, k, v, scaling, window, positions)
    assert torch.equal(scorer.ref.view(ref.shape), ref)
    for trial in range(3):
        kc = k + 0.05 * torch.randn(k.shape, generator=g)
        vc = v + 0.05 * torch.randn(v.shape, generator=g)
        want_k = _plain_error(q, kc, v, ref, scaling, window, positions)
        want_v = _plain_error(q, k, vc, ref, scaling, window, positions)
        assert scorer.key_error(kc, v) == want_k and want_k > 0, trial
        assert scorer.value_error(vc) == want_v and want_v > 0, trial
    assert scorer.key_error(k, v) == 0.0 and scorer.value_error(v) == 0.0


def test_a_profile_equals_the_papers_statistics_of_each_run():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 2, 700, 16, generator=g) ** 3  # heavy tails: kurtosis far from 3
    configs = [OakenConfig(outer_ratio=o, inner_ratio=i) for o, i in DEFAULT_RATIOS]
    prof = _Profile(x, configs, 5, "key")
    for c in configs:
        acc = RunAccumulator()
        for r in range(x.shape[0]):
            o, i, kurt = run_thresholds(x[r], (c.outer_ratio,), (c.inner_ratio,))
            acc.add(o, i, kurt, x[r].numel())
        want = acc.finish(c, False, 5, "key")
        assert prof.thresholds[c] == want[0]
        assert prof.profiled(x, c) == want


# ----------------------------------------------------------------------------------------------- allocation (alloc=1)


def _choice(key_opts, value_opts):
    """A LayerChoice whose options are ``(share, error)`` pairs (configs at those shares, stand-in profiles)."""
    from oakenkv.calibrate.search import LayerChoice
    from oakenkv.calibrate.transforms import LayerTransforms

    def opts(pairs):
        return [(sh, err, OakenConfig(outer_ratio=sh, inner_ratio=0.0), ("thr", sh)) for sh, err in pairs]

    k, v = opts(key_opts), opts(value_opts)
    one = next(o for o in k if o[0] == 0.1), next(o for o in v if o[0] == 0.1)
    return LayerChoice(LayerTransforms(), one[0][2], one[1][2], one[0][3], one[1][3], {}, {"key": k, "value": v})


def test_allocation_spends_the_budget_where_the_error_falls_most():
    from oakenkv.calibrate.search import allocate_sparse

    shares = (0.05, 0.1, 0.15, 0.2)
    # layer 0's keys gain much from more outliers, its values little; layer 1's keys nothing, its values some
    choices = [
        _choice(zip(shares, (9.0, 5.0, 2.0, 1.0), strict=True), zip(shares, (1.0, 0.98, 0.97, 0.96), strict=True)),
        _choice(zip(shares, (1.0, 1.0, 1.0, 1.0), strict=True), zip(shares, (2.0, 1.5, 1.2, 1.1), strict=True)),
    ]
    out, summary = allocate_sparse(choices, 0.1)
    picked = [(c.key[1], c.value[1]) for c in out]  # the stand-in profiles hold their shares
    got = [(o.key_config.outer_ratio, o.value_config.outer_ratio) for o in out]
    assert sum(a + b for a, b in got) <= 4 * 0.1 + 1e-9  # the budget: the model's average share
    assert got[0][0] == 0.2 and got[1][0] == 0.05  # spent on layer 0's keys, taken from layer 1's
    assert picked == got  # the thresholds follow the configs
    assert summary["used"] == "allocated" and summary["error_sum"]["allocated"] < summary["error_sum"]["uniform"]
    assert out[0].notes["allocated"] == {"key": 0.2, "value": got[0][1]}


def test_allocation_keeps_the_uniform_choice_when_it_is_no_worse():
    from oakenkv.calibrate.search import allocate_sparse

    shares = (0.05, 0.1, 0.15, 0.2)
    flat = list(zip(shares, (1.0, 1.0, 1.0, 1.0), strict=True))
    out, summary = allocate_sparse([_choice(flat, flat)], 0.1)
    assert summary["used"] == "uniform"
    assert out[0].key_config.outer_ratio == 0.1 and out[0].value_config.outer_ratio == 0.1
    with pytest.raises(ValueError, match="several budget scales"):
        allocate_sparse([dataclasses.replace(out[0], options=None)], 0.1)


def test_budget_scales_are_checked_before_any_profiling():
    from oakenkv.calibrate.search import ALLOC_SCALES, PlusSearch

    assert PlusSearch.from_flags(True, False, False, True, True, alloc=True).budget_scales == ALLOC_SCALES
    assert PlusSearch.from_flags(True, False, False, True, True).budget_scales == (1.0,)
    for bad in ((), (0.5,), (1.0, 0.5), (0.0, 1.0), (1.0, 1.0)):
        with pytest.raises(ValueError, match="budget_scales"):
            PlusSearch(budget_scales=bad)
    with pytest.raises(ValueError):  # 0.3 x 4: no middle group left
        PlusSearch(ratios=((0.3, 0.0),), budget_scales=(1.0, 4.0))
    s = PlusSearch(budget_scales=(0.5, 1.0, 2.0))
    assert s.sparse == 0.1 and s.scaled_ratios(2.0) == ((0.08, 0.12), (0.16, 0.04), (0.2, 0.0))
