"""Request traces for the simulator: fixed lengths and synthetic generators with sampled lengths.

A :class:`Trace` holds n requests as numpy arrays (arrival time, input tokens, output tokens). The generators
are illustrative, documented distributions, not fits to a particular dataset:

* ``conversation_trace``: chat-like lengths. Input and output lengths are log-normal (heavy right tail: most
  turns are short, a few paste long documents), clipped to [min_len, max_len]. Defaults: median input 512,
  median output 256, log-space sigma 0.8 (so the mean is about 1.4x the median and the 99th percentile about
  6x). Arrivals are Poisson at ``rate`` requests/s, or all at t=0 when ``rate`` is None (an offline batch
  job).
* ``bursty_trace``: conversation lengths with bursty arrivals. Inter-arrival gaps are Gamma distributed with
  mean 1/rate and coefficient of variation ``cv`` (cv = 1 is Poisson; cv = 3, the default, gives bursts of
  near-simultaneous requests separated by long idle gaps).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Trace:
    """n requests. arrival_s: float64 [n], seconds, non-decreasing; input_len, output_len: int64 [n], >= 1."""

    arrival_s: np.ndarray
    input_len: np.ndarray
    output_len: np.ndarray

    def __post_init__(self) -> None:
        a, i, o = self.arrival_s, self.input_len, self.output_len
        for name, arr in (("arrival_s", a), ("input_len", i), ("output_len", o)):
            if not isinstance(arr, np.ndarray) or arr.ndim != 1:
                raise ValueError(f"Trace.{name} must be a 1-D numpy array")
        if not (len(a) == len(i) == len(o)) or len(a) == 0:
            raise ValueError(f"Trace arrays must be non-empty and of equal length, got {len(a)}, {len(i)}, {len(o)}")
        if not np.all(np.isfinite(a)) or np.any(a < 0) or np.any(np.diff(a) < 0):
            raise ValueError("Trace.arrival_s must be finite, >= 0 and non-decreasing")
        if np.any(i < 1) or np.any(o < 1):
            raise ValueError("Trace input_len and output_len must all be >= 1")

    def __len__(self) -> int:
        return len(self.arrival_s)

    @property
    def generated_tokens(self) -> int:
        return int(self.output_len.sum())


def fixed_trace(n: int, input_len: int, output_len: int) -> Trace:
    """n identical requests, all arriving at t=0 (the paper's Figure 11 setup)."""
    if n < 1 or input_len < 1 or output_len < 1:
        raise ValueError(f"n, input_len and output_len must be >= 1, got {n}, {input_len}, {output_len}")
    return Trace(np.zeros(n), np.full(n, input_len, dtype=np.int64), np.full(n, output_len, dtype=np.int64))


def _lognormal_lengths(rng: np.random.Generator, n: int, median: float, sigma: float, lo: int, hi: int) -> np.ndarray:
    x = rng.lognormal(mean=np.log(median), sigma=sigma, size=n)
    return np.clip(np.rint(x), lo, hi).astype(np.int64)


def conversation_trace(
    n: int,
    seed: int = 0,
    input_median: float = 512,
    output_median: float = 256,
    sigma: float = 0.8,
    min_len: int = 16,
    max_len: int = 4096,
    rate: float | None = None,
) -> Trace:
    """Chat-like trace: log-normal input/output lengths, Poisson arrivals at ``rate`` req/s (None: all at
    0)."""
    if n < 1 or sigma < 0 or input_median <= 0 or output_median <= 0 or not 1 <= min_len <= max_len:
        raise ValueError("conversation_trace: need n >= 1, sigma >= 0, positive medians, 1 <= min_len <= max_len")
    rng = np.random.default_rng(seed)
    inp = _lognormal_lengths(rng, n, input_median, sigma, min_len, max_len)
    out = _lognormal_lengths(rng, n, output_median, sigma, min_len, max_len)
    if rate is None:
        arrivals = np.zeros(n)
    else:
        if rate <= 0:
            raise ValueError(f"rate must be > 0 requests/s, got {rate}")
        arrivals = np.cumsum(rng.exponential(1.0 / rate, size=n))
    return Trace(arrivals, inp, out)


def bursty_trace(n: int, rate: float, cv: float = 3.0, seed: int = 0, **length_kw) -> Trace:
    """Conversation lengths with Gamma inter-arrival gaps of mean 1/rate and coefficient of variation
    ``cv``."""
    if rate <= 0 or cv <= 0:
        raise ValueError(f"rate and cv must be > 0, got {rate} and {cv}")
    base = conversation_trace(n, seed=seed, **length_kw)
    rng = np.random.default_rng(seed + 1)
    shape = 1.0 / cv**2
    gaps = rng.gamma(shape, (1.0 / rate) / shape, size=n)
    return Trace(np.cumsum(gaps) - gaps[0], base.input_len, base.output_len)
