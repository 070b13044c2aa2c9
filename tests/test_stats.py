"""Tests of oakenkv.calibrate.stats: exact quantiles and the order statistics under them, kurtosis, one run's
thresholds."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import oakenkv.calibrate.stats as stats
from oakenkv.calibrate.stats import exact_quantiles, kurtosis, order_statistics, run_thresholds


@pytest.mark.parametrize("n", [1, 2, 7, 1000, 50_001])
def test_exact_quantiles_match_torch_quantile(n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g) * 3 + 0.5
    q = torch.tensor([0.0, 0.02, 0.47, 0.5, 0.53, 0.98, 1.0], dtype=torch.float64)
    ours = exact_quantiles(x, q)
    ref = torch.quantile(x.double(), q)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-12)


def test_exact_quantiles_rejects_empty_and_bad_levels_and_widens_bf16():
    with pytest.raises(ValueError, match="empty"):
        exact_quantiles(torch.empty(0), torch.tensor([0.5]))
    with pytest.raises(ValueError, match="levels"):
        exact_quantiles(torch.ones(4), [1.5])
    x = torch.randn(1001, dtype=torch.bfloat16)
    ref = torch.quantile(x.double(), torch.tensor([0.1, 0.5], dtype=torch.float64))
    torch.testing.assert_close(exact_quantiles(x, [0.1, 0.5]), ref, rtol=0, atol=1e-12)


def test_run_thresholds_rejects_non_finite():
    x = torch.randn(100)
    x[7] = float("nan")
    with pytest.raises(ValueError, match="1 recorded values are NaN"):
        run_thresholds(x, (0.04,), (0.06,))


def test_kurtosis_of_known_distributions():
    g = torch.Generator().manual_seed(0)
    assert kurtosis(torch.randn(400_000, generator=g)) == pytest.approx(3.0, abs=0.05)
    lap = torch.distributions.Laplace(0.0, 1.0).sample((400_000,))
    assert kurtosis(lap) == pytest.approx(6.0, abs=0.25)
    assert kurtosis(torch.tensor([-1.0, 1.0] * 10)) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="all recorded values are equal"):
        kurtosis(torch.ones(10))


def test_run_thresholds_give_the_requested_fractions():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 128, 64, generator=g) * 0.7 + 0.2  # one run [H, S, D], off-centre on purpose
    outer, inner, k = run_thresholds(x, (0.04, 0.045), (0.06, 0.057), "median")
    assert outer.shape == (2, 2) and inner.shape == (2, 2)
    n = x.numel()
    for c, o in enumerate((0.04, 0.045)):
        frac = ((x < outer[c, 0]) | (x > outer[c, 1])).sum().item() / n
        assert frac == pytest.approx(o, abs=2 / n)
    for c, i in enumerate((0.06, 0.057)):
        frac = ((x >= inner[c, 0]) & (x <= inner[c, 1])).sum().item() / n
        assert frac == pytest.approx(i, abs=2 / n)
    # Median-centred: the inner band sits around the median (0.2), not around 0.
    assert inner[0].mean().item() == pytest.approx(0.2, abs=0.02)
    assert k == pytest.approx(3.0, abs=0.2)


def test_run_thresholds_zero_center_is_symmetric():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(20_000, generator=g) + 0.3
    _, inner, _ = run_thresholds(x, (0.04,), (0.06,), "zero")
    assert inner[0, 0].item() == -inner[0, 1].item() < 0
    frac = (x.abs() <= inner[0, 1]).sum().item() / x.numel()
    assert frac == pytest.approx(0.06, abs=1e-3)
    with pytest.raises(ValueError, match="inner_center"):
        run_thresholds(x, (0.04,), (0.06,), "mean")


#: The ranks a run's thresholds take (the search's three ratio pairs and the median).
_LEVELS = np.array([0.02, 0.98, 0.04, 0.96, 0.05, 0.95, 0.47, 0.53, 0.49, 0.51, 0.5])


def _ranks(n: int, levels: np.ndarray = _LEVELS) -> np.ndarray:
    pos = levels * (n - 1)
    return np.unique(np.concatenate([np.floor(pos), np.ceil(pos)]).astype(np.int64))


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.tobytes() == b.tobytes()


def _arrays(rng: np.random.Generator, n: int):
    yield "normal", rng.standard_normal(n).astype(np.float32)
    yield "heavy tails", (rng.standard_normal(n) ** 3).astype(np.float32)
    yield "ties", rng.integers(-3, 4, n).astype(np.float32)
    offsets = (rng.standard_normal(64) * 10).astype(np.float32)  # per-channel offsets, as keys have
    yield "channels", (rng.standard_normal((n // 64, 64)).astype(np.float32) + offsets).reshape(-1)
    yield "sorted float64", np.sort(rng.standard_normal(n))
    nan = rng.standard_normal(n).astype(np.float32)
    nan[rng.integers(0, n, 40)] = np.nan
    nan[rng.integers(0, n, 5)] = np.inf
    nan[rng.integers(0, n, 5)] = -np.inf
    yield "nan and inf", nan


@pytest.mark.parametrize("n", [1000, 40_000, 3 * 2048 * 64])
def test_order_statistics_are_those_of_a_partition_of_everything(n):
    """The bracketed search (a random sample bounds each group of ranks) gives np.partition's values, bit for bit,
    whatever the data: ties, NaN and inf (sorting last and first as there), structured channels, sorted input."""
    rng = np.random.default_rng(n)
    for name, x in _arrays(rng, n):
        for ranks in (_ranks(x.size), np.unique(rng.integers(0, x.size, 9)), np.array([0, x.size - 1])):
            want = np.partition(x, ranks)[ranks]
            assert _same_bits(order_statistics(x, ranks), want) or np.array_equal(
                order_statistics(x, ranks), want, equal_nan=True
            ), name


def test_a_bracket_that_misses_falls_back_to_the_whole_partition(monkeypatch):
    """With no reach beyond the sample's ranks, brackets miss often: the values must not change."""
    rng = np.random.default_rng(5)
    monkeypatch.setattr(stats, "_REACH", -3.0)  # brackets that are too narrow: they miss
    partitions = []
    real = np.partition

    def counting(a, kth):
        partitions.append(a.size)
        return real(a, kth)

    monkeypatch.setattr(stats.np, "partition", counting)
    for _, x in _arrays(rng, 100_000):
        ranks = _ranks(x.size)
        assert np.array_equal(order_statistics(x, ranks), real(x, ranks)[ranks], equal_nan=True)
    assert 100_000 in partitions  # the fallback ran


def test_run_thresholds_are_the_same_with_or_without_brackets(monkeypatch):
    x = torch.randn(3, 2048, 64, generator=torch.Generator().manual_seed(3)) ** 3
    fast = run_thresholds(x, (0.04, 0.08, 0.1), (0.06, 0.02, 0.0))
    monkeypatch.setattr(stats, "BRACKET_MIN_VALUES", 1 << 40)  # one partition of everything
    slow = run_thresholds(x, (0.04, 0.08, 0.1), (0.06, 0.02, 0.0))
    assert torch.equal(fast[0], slow[0]) and torch.equal(fast[1], slow[1]) and fast[2] == slow[2]
