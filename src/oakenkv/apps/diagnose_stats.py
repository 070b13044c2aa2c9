"""The statistics behind ``oakenkv diagnose`` (``oakenkv.apps.diagnose``): per-channel concentration of Oaken's
outer group, channel magnitudes and offsets, SQNR, and each method's round trip of recorded keys and values."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from oakenkv.calibrate.profile import RunAccumulator, run_thresholds
from oakenkv.calibrate.thresholds import GroupThresholds
from oakenkv.format.config import OakenConfig

#: The "few" channels: the top 2% of a layer's ``num_kv_heads * head_dim`` channels (at least one).
TOP_SHARE = 0.02
#: A channel counts as constant-sign when its mean is at least this fraction of its absmax (reported, not a rule).
CONSTANT_SIGN = 0.5

# ----------------------------------------------------------------------------------------------- statistics


@dataclass(frozen=True)
class ChannelStats:
    """Per-channel statistics of one layer's keys (or values): module doc. Channels are flat over
    ``num_kv_heads * head_dim`` (channel ``c`` is head ``c // head_dim``, dimension ``c % head_dim``)."""

    #: The k of "top k channels".
    top_k: int
    #: Share of the outer-group values in the top-k channels (by outer count); NaN without outer values.
    outer_share: float
    #: ``top_k / D``: the share a uniform spread would give.
    uniform_share: float
    #: The top-k channels by outer count, most first.
    outer_channels: tuple[int, ...]
    #: Share of all values that are outer (close to the profile's outer ratio when the thresholds fit).
    outer_fraction: float
    #: Largest channel absmax / median channel absmax.
    absmax_ratio: float
    #: The top-k channels by absmax, largest first, and their absmax / median.
    absmax_channels: tuple[int, ...]
    absmax_ratios: tuple[float, ...]
    #: Largest |mean| / absmax over channels, and its channel.
    mean_ratio: float
    mean_channel: int
    #: Channels whose |mean| >= CONSTANT_SIGN * absmax.
    constant_sign: tuple[int, ...]
    #: sum over channels of mean^2 / sum of mean squares: the power the per-channel means carry.
    offset_power: float
    #: Per-channel absmax / median channel absmax, ``[D]`` (the heat map's row).
    absmax_rel: tuple[float, ...] = field(repr=False)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["outer_share"] = finite_or_none(self.outer_share)
        return d


def finite_or_none(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


def top_k_channels(dim: int) -> int:
    """The k of "top k channels" for ``dim`` channels: :data:`TOP_SHARE` of them, at least one."""
    return max(1, round(TOP_SHARE * dim))


def channel_stats(x: torch.Tensor, to_lo: float, to_hi: float, top_k: int, skip_first: bool = True) -> ChannelStats:
    """Channel statistics of ``x`` float ``[R, H, S, hd]`` (R windows) against outer thresholds ``to_lo < to_hi``.

    ``skip_first`` leaves out each window's first token (the attention sink) when windows are longer than one.
    """
    _, h, s, hd = x.shape
    d = h * hd
    if not 1 <= top_k <= d:
        raise ValueError(f"top_k must be in 1..{d}, got {top_k}")
    body = x[:, :, 1:] if skip_first and s > 1 else x
    flat = body.permute(1, 3, 0, 2).reshape(d, -1).to(torch.float64)  # [D, N]: one row per channel
    absmax = flat.abs().amax(dim=1)
    mean = flat.mean(dim=1)
    power = flat.pow(2).mean(dim=1)
    outer = ((flat < to_lo) | (flat > to_hi)).sum(dim=1).to(torch.float64)  # [D]
    total = float(outer.sum())
    by_outer = torch.argsort(outer, descending=True, stable=True)[:top_k]
    share = float(outer[by_outer].sum()) / total if total else math.nan
    median = float(np.median(absmax.numpy()))
    rel = absmax / median if median > 0 else torch.full_like(absmax, math.inf)
    by_abs = torch.argsort(absmax, descending=True, stable=True)[:top_k]
    mratio = torch.where(absmax > 0, mean.abs() / absmax.clamp_min(1e-30), torch.zeros_like(mean))
    mc = int(torch.argmax(mratio))
    return ChannelStats(
        top_k=top_k,
        outer_share=share,
        uniform_share=top_k / d,
        outer_channels=tuple(int(c) for c in by_outer),
        outer_fraction=total / flat.numel(),
        absmax_ratio=float(rel.max()),
        absmax_channels=tuple(int(c) for c in by_abs),
        absmax_ratios=tuple(round(float(rel[c]), 4) for c in by_abs),
        mean_ratio=float(mratio[mc]),
        mean_channel=mc,
        constant_sign=tuple(int(c) for c in torch.nonzero(mratio >= CONSTANT_SIGN).flatten()),
        offset_power=float(mean.pow(2).sum() / power.sum()) if float(power.sum()) > 0 else 0.0,
        absmax_rel=tuple(round(float(v), 4) for v in rel),
    )


def window_thresholds(x: torch.Tensor, config: OakenConfig, layer: int, kind: str) -> GroupThresholds:
    """Thresholds of ``x`` ``[R, H, S, hd]`` at ``config``'s ratios, one run per window averaged over windows:
    what ``oakenkv.calibrate.profile.profile_thresholds`` gives for these windows."""
    acc = RunAccumulator()
    for r in range(x.shape[0]):
        o, i, k = run_thresholds(x[r], (config.outer_ratio,), (config.inner_ratio,))
        acc.add(o, i, k, x[r].numel())
    return acc.finish(config, False, layer, kind)[0]


def sqnr_db(signal: float, error: float) -> float:
    """``10 log10(signal / error)``; +inf for an exact round trip."""
    if error <= 0:
        return math.inf
    if signal <= 0:
        return -math.inf
    return 10.0 * math.log10(signal / error)


# ----------------------------------------------------------------------------------------------- round trips


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``[R, H, S, hd]`` -> ``[R*S, H*hd]``: one token's KV heads per row (the cache's and Oaken's vector)."""
    r, h, s, hd = x.shape
    return x.permute(0, 2, 1, 3).reshape(r * s, h * hd).contiguous()


def _unrows(rows: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    r, h, s, hd = like.shape
    return rows.reshape(r, s, h, hd).permute(0, 2, 1, 3)


def oaken_round_trip(x: torch.Tensor, thr: GroupThresholds, config: OakenConfig) -> tuple[torch.Tensor, float]:
    """Oaken's encode and decode (``oakenkv.kernels.codec``) of ``x`` ``[R, H, S, hd]``, one row per token: ``(x_hat,
    stored bits)``, the bits counted from the encoded bytes (``codec.effective_bits``)."""
    from oakenkv.kernels.codec import decode, effective_bits, encode

    enc = encode(_rows(x), thr, config)
    y = decode(enc, thr, config)
    return _unrows(y, x), effective_bits(enc).total * x.numel()


def kivi_keys_round_trip(k: torch.Tensor, bits: int = 4, group: int = 32) -> torch.Tensor:
    """KIVI's per-channel key quantization over token groups of each window; a window's last, shorter group is
    quantized on its own (KIVI would keep it in its fp16 residual)."""
    from oakenkv.methods.kivi import kivi_quantize_keys

    s = k.shape[2]
    full = s - s % group
    parts = [kivi_quantize_keys(k[:, :, :full], bits, group)] if full else []
    if s > full:
        parts.append(kivi_quantize_keys(k[:, :, full:], bits, s - full))
    return torch.cat(parts, dim=2)


@dataclass
class Tally:
    """Signal and error power and stored bits of one method and kind, per layer and in total."""

    signal: list[float] = field(default_factory=list)
    error: list[float] = field(default_factory=list)
    bits: float = 0.0
    values: int = 0

    def add(self, target: torch.Tensor, x_hat: torch.Tensor, bits: float, signal: torch.Tensor | None = None) -> None:
        ref = target if signal is None else signal
        self.signal.append(float(ref.to(torch.float64).pow(2).sum()))
        self.error.append(float((target.to(torch.float64) - x_hat.to(torch.float64)).pow(2).sum()))
        self.bits += float(bits)
        self.values += target.numel()

    def layer_db(self, i: int) -> float:
        return sqnr_db(self.signal[i], self.error[i])

    def total_db(self) -> float:
        return sqnr_db(sum(self.signal), sum(self.error))

    @property
    def effective_bits(self) -> float:
        return self.bits / self.values if self.values else math.nan
