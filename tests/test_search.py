"""Tests of oakenkv.calibrate.search's scoring parts against their plain definitions: the candidates' attention
errors (``_Scorer``: reused buffers, stacked query heads, in-place softmax) and their thresholds (``_Profile``:
the kurtosis only for the chosen candidate) must be the same numbers, bit for bit, as the plain attention and the
paper's per-run statistics (the choices and every candidate's error in a profile file depend on them)."""

from __future__ import annotations

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
