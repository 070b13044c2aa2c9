"""The ``oaken-plus`` search of one layer: candidate transforms and group ratios (:class:`PlusSearch`), scored by
the error they cause in the layer's attention output on calibration text (:func:`choose_layer`).

Per layer: keys are scored with exact values and values with exact keys, each error relative to the exact layer
output's energy, over the last ``query_positions`` queries of the first ``query_runs`` windows; every candidate's
thresholds are profiled on its transformed keys (or values) of all windows, as ``oakenkv.calibrate.profile``
averages runs, and the chosen candidate's are the layer's profile. The key shift and the smoothing scales are
taken over all windows of the layer, so a layer is scored once all of them are recorded
(``oakenkv.calibrate.recording``). ``oakenkv.calibrate.plus`` runs it over the layers and keeps the profile.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from oakenkv.calibrate.recording import AttentionRecord, LayerRecord
from oakenkv.calibrate.stats import RunAccumulator, run_thresholds
from oakenkv.calibrate.thresholds import GroupThresholds, LayerStats
from oakenkv.calibrate.transforms import LayerTransforms, fwht, tie_rope_pairs
from oakenkv.format.config import MAX_SINK_TOKENS, OakenConfig, valid_sink_tokens

__all__ = [
    "DEFAULT_RATIOS",
    "DEFAULT_SPARSE",
    "LayerChoice",
    "PlusSearch",
    "attention_output",
    "candidates_per_layer",
    "choose_layer",
    "choose_transforms",
    "ratio_choices",
]

#: The group ratios (outer, inner) the search chooses from: all put 10% of the values in the sparse groups (the
#: paper's budget, so the same bits), moving that budget from the inner group to the outer one.
DEFAULT_RATIOS: tuple[tuple[float, float], ...] = ((0.04, 0.06), (0.08, 0.02), (0.10, 0.0))
#: The sparse share of :data:`DEFAULT_RATIOS`.
DEFAULT_SPARSE = 0.10


def ratio_choices(sparse: float) -> tuple[tuple[float, float], ...]:
    """:data:`DEFAULT_RATIOS` scaled to a sparse (inner + outer) share of ``sparse``: the same three splits of the
    budget, 40/60, 80/20 and 100/0 (``DEFAULT_RATIOS`` itself for 0.10)."""
    if not isinstance(sparse, (int, float)) or isinstance(sparse, bool) or not 0.0 < sparse < 1.0:
        raise ValueError(f"the sparse share must be a fraction in (0, 1), got {sparse!r}")
    if sparse == DEFAULT_SPARSE:
        return DEFAULT_RATIOS
    scale = sparse / DEFAULT_SPARSE
    return tuple((round(o * scale, 6), round(i * scale, 6)) for o, i in DEFAULT_RATIOS)


@dataclass(frozen=True)
class PlusSearch:
    """What :func:`choose_layer` tries per layer (every candidate is scored; the least error wins)."""

    #: Key smoothing exponents (0: none): ``lam = absmax(k - shift) ** alpha`` per channel, RoPE-pair tied.
    alphas: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75)
    #: Whether the key shift and each rotation may be used (the search still chooses per layer). The rotations are
    #: off by default: on the default model the search picks them in half the layers (they lower its per-layer
    #: attention-output error) and perplexity gets worse (docs/plus.md, "Rotations"); ``oaken-plus:rot_k=1,rot_v=1``
    #: tries them.
    key_shift: bool = True
    key_rotation: bool = False
    value_rotation: bool = False
    #: Group ratios (outer, inner) to choose from, for keys and values separately.
    ratios: tuple[tuple[float, float], ...] = DEFAULT_RATIOS
    #: Calibration windows whose queries score the candidates, and the query positions per window (the last ones:
    #: they attend over the longest context).
    query_runs: int = 2
    query_positions: int = 256
    #: The first tokens of every sequence kept at 16 bits beside their codes (``Transforms.sink_tokens``); the
    #: candidates are scored with them exact, as the cache reads them.
    sink_tokens: int = 1
    #: The format's dense slot width (``OakenConfig.middle_bits``): 4 (the paper's), 2..3 or 5..7; the
    #: outliers get one bit more. The candidates are scored, and the profile made, at this width.
    middle_bits: int = 4

    @classmethod
    def from_flags(
        cls,
        shift: bool,
        rot_k: bool,
        rot_v: bool,
        smooth: bool,
        ratios: bool,
        sink: int = 1,
        bits: int = 4,
        sparse: float = DEFAULT_SPARSE,
    ) -> PlusSearch:
        """The search of the method spec ``oaken-plus:shift=..,rot_k=..,rot_v=..,smooth=..,ratios=..,sink=..,bits=..,
        sparse=..`` (each remedy on or off; off ratios means the 40/60 outer/inner split only; ``sink``: tokens kept
        at 16 bits; ``bits``: the dense slot width; ``sparse``: the inner + outer share, :func:`ratio_choices`)."""
        choices = ratio_choices(sparse)
        return cls(
            alphas=cls().alphas if smooth else (0.0,),
            key_shift=bool(shift),
            key_rotation=bool(rot_k),
            value_rotation=bool(rot_v),
            ratios=choices if ratios else choices[:1],
            sink_tokens=int(sink),
            middle_bits=int(bits),
        )

    def config(self, outer: float | None = None, inner: float | None = None) -> OakenConfig:
        """The codec's configuration for candidate ratios ``(outer, inner)`` at this search's slot width (default
        ratios: the paper's, what a profile file records as its config)."""
        if outer is None or inner is None:
            return OakenConfig(middle_bits=self.middle_bits)
        return OakenConfig(outer_ratio=outer, inner_ratio=inner, middle_bits=self.middle_bits)

    def __post_init__(self) -> None:
        if not self.alphas or any(not 0.0 <= a <= 1.0 for a in self.alphas):
            raise ValueError(f"alphas must be a non-empty subset of [0, 1], got {self.alphas}")
        self.config()  # validates the slot width
        for o, i in self.ratios:
            self.config(o, i)  # validates
        if self.query_runs < 1 or self.query_positions < 1:
            raise ValueError("query_runs and query_positions must be positive")
        if not valid_sink_tokens(self.sink_tokens):  # (checked before minutes of profiling, not after)
            raise ValueError(f"sink_tokens must be an int in [0, {MAX_SINK_TOKENS}], got {self.sink_tokens!r}")


# ----------------------------------------------------------------------------------------------- scoring


def attention_output(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float, window: int | None, positions: int
) -> torch.Tensor:
    """Causal (optionally sliding-window) attention of the last ``positions`` queries: q ``[R, Hq, S, hd]``,
    k/v ``[R, H, S, hd]`` -> ``[R, Hq, positions, hd]``."""
    return _attend(q, k, v, scaling, window, positions)[0]


def _attend(
    q: torch.Tensor | None,
    k: torch.Tensor | None,
    v: torch.Tensor,
    scaling: float,
    window: int | None,
    positions: int,
    probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attention_output` and its attention probabilities ``[R, Hq, positions, S]``; given ``probs`` (of the
    same queries and keys), only ``probs @ v``: scoring values against exact keys needs no new scores. The scores
    are scaled and masked in place (the same numbers, without two more tensors of the scores' size)."""
    group = probs.shape[1] // v.shape[1] if probs is not None else q.shape[1] // k.shape[1]
    vv = v.repeat_interleave(group, dim=1)
    if probs is None:
        s = q.shape[2]
        positions = min(positions, s)
        qq = q[:, :, s - positions :]
        scores = qq @ k.repeat_interleave(group, dim=1).transpose(-1, -2)
        scores.mul_(scaling)
        pq = torch.arange(s - positions, s)[:, None]
        pk = torch.arange(s)[None, :]
        hide = pk > pq
        if window is not None:
            hide |= pk <= pq - window
        probs = torch.softmax(scores.masked_fill_(hide, float("-inf")), dim=-1)
    return probs @ vv, probs


def _fake_quant(x: torch.Tensor, thr: GroupThresholds, config: OakenConfig, sink_tokens: int = 0) -> torch.Tensor:
    """Oaken's round trip (the codec's kernels) of ``x [R, H, S, hd]``, one row per token; the first
    ``sink_tokens`` of each run come back at 16 bits, as the cache reads them (``oakenkv.store.paged``)."""
    from oakenkv.kernels.codec import decode, encode

    r, h, s, hd = x.shape
    rows = x.permute(0, 2, 1, 3).reshape(r * s, h * hd).contiguous()
    y = decode(encode(rows, thr, config), thr, config)
    y = y.reshape(r, s, h, hd).permute(0, 2, 1, 3)
    if sink_tokens:
        y[:, :, :sink_tokens] = x[:, :, :sink_tokens].to(torch.float16).to(y.dtype)
    return y


Profiled = tuple[GroupThresholds, LayerStats]


def _thresholds(x: torch.Tensor, configs: Sequence[OakenConfig], layer: int, kind: str) -> dict[OakenConfig, Profiled]:
    """Thresholds of ``x [R, H, S, hd]`` (one run per window) for each of ``configs``, exactly as
    ``oakenkv.calibrate.profile`` averages them. One pass over the runs serves every config: a run's quantiles at
    several ratios come from one partition, and each is the same number as alone (exact order statistics). The
    runs are taken on two threads (numpy's partition releases the GIL) and averaged in their order."""
    configs = list(dict.fromkeys(configs))
    outer, inner = tuple(c.outer_ratio for c in configs), tuple(c.inner_ratio for c in configs)
    accs = [RunAccumulator() for _ in configs]
    for r, (o, i, k) in enumerate(_pool().map(lambda r: run_thresholds(x[r], outer, inner), range(x.shape[0]))):
        for j, acc in enumerate(accs):
            acc.add(o[j : j + 1], i[j : j + 1], k, x[r].numel())
    return {c: acc.finish(c, False, layer, kind) for c, acc in zip(configs, accs, strict=True)}


@functools.cache
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max(1, min(2, os.cpu_count() or 1)), thread_name_prefix="oakenkv-thresholds")


def _rotate(x: torch.Tensor) -> torch.Tensor:
    """Per-head Hadamard rotation over the last axis (``oakenkv.calibrate.transforms.fwht``)."""
    return torch.from_numpy(fwht(x.numpy()))


def _key_transform(k: torch.Tensor, lt: LayerTransforms, h: int, hd: int) -> torch.Tensor:
    """What the quantizer sees of keys ``[R, H, S, hd]`` (recorded from the unfolded model)."""
    if lt.key_scale is not None:
        k = k / torch.tensor(lt.key_scale, dtype=torch.float32).reshape(1, h, 1, hd)
    if lt.key_shift is not None:  # in the folded model's frame (already divided by the scale)
        k = k - torch.tensor(lt.key_shift, dtype=torch.float32).reshape(1, h, 1, hd)
    if lt.key_rotation:
        k = torch.from_numpy(fwht(k.numpy()))
    return k


def _key_restore(k: torch.Tensor, lt: LayerTransforms, h: int, hd: int) -> torch.Tensor:
    """Keys back in the unfolded model's frame up to the shift (which softmax ignores)."""
    if lt.key_rotation:
        k = torch.from_numpy(fwht(k.numpy()))
    if lt.key_scale is not None:
        k = k * torch.tensor(lt.key_scale, dtype=torch.float32).reshape(1, h, 1, hd)
    return k


@dataclass
class _Candidate:
    name: str
    lt: LayerTransforms
    config: OakenConfig
    #: The candidate's thresholds at every ratio of the search, and its transformed vectors of the query windows.
    profiled: dict[OakenConfig, Profiled]
    scored: torch.Tensor


@dataclass
class LayerChoice:
    """What :func:`choose_layer` keeps for one layer: the transforms, the group ratios of keys and values, the
    thresholds (and statistics) profiled after them, and notes (every candidate's error) for the profile file."""

    transforms: LayerTransforms
    key_config: OakenConfig
    value_config: OakenConfig
    key: Profiled
    value: Profiled
    notes: dict[str, Any]


def choose_layer(
    layer: LayerRecord,
    search: PlusSearch,
    partners: np.ndarray | None,
    progress: Callable[[int], None] | None = None,
) -> LayerChoice:
    """The key and value transforms and group ratios of one layer with the least attention-output error.

    Keys are scored with exact values and values with exact keys (each error is relative to the exact layer
    output's energy). Every candidate's thresholds are profiled on its transformed vectors of all windows, at every
    ratio of the search in one pass; the chosen candidate's are the layer's profile.
    """
    k_all, v_all, q, i = layer.keys, layer.values, layer.queries, layer.index
    _, h, _, hd = k_all.shape
    rq = q.shape[0]
    k_q, v_q = k_all[:rq], v_all[:rq]
    sc, win, pos = layer.scaling, layer.sliding_window, search.query_positions
    ref, probs = _attend(q, k_q, v_q, sc, win, pos)
    energy = float(ref.pow(2).sum())

    def err(kh: torch.Tensor, vh: torch.Tensor) -> float:
        return float((attention_output(q, kh, vh, sc, win, pos) - ref).pow(2).sum()) / energy

    configs = [search.config(o, inn) for o, inn in search.ratios]

    def key_error(c: _Candidate, cfg: OakenConfig) -> float:
        kq = _fake_quant(c.scored, c.profiled[cfg][0], cfg, search.sink_tokens)
        return err(_key_restore(kq, c.lt, h, hd), v_q)

    # keys: shift, rotation and smoothing first (at the middle ratios), then the ratios for the winner
    shift = k_all[:, :, 1:].mean(dim=(0, 2)).reshape(-1) if search.key_shift else None  # token 0: the sink
    key_errs: dict[str, float] = {}
    best: _Candidate | None = None
    base_cfg = configs[-1]
    for use_shift in (False, True) if shift is not None else (False,):
        for rot in (False, True) if search.key_rotation else (False,):
            for alpha in search.alphas:
                if alpha and partners is None:
                    continue
                lam = None
                if alpha:
                    centred = k_all[:, :, 1:] - (shift.reshape(1, h, 1, hd) if use_shift else 0.0)
                    amax = centred.abs().amax(dim=(0, 2))  # [h, hd]
                    if layer.key_scale_shared_by_heads:  # one norm weight for every head: one set of scales
                        amax = amax.amax(dim=0, keepdim=True).expand(h, hd)
                    a = tie_rope_pairs(amax.clamp_min(1e-6), partners) ** alpha
                    lam = (a / a.log().mean().exp()).reshape(-1)  # geometric mean 1: the scores' scale stays
                # the folded model's keys carry 1 / lam, so the shift is taken in that frame
                frame_shift = None if not use_shift else shift if lam is None else shift / lam
                lt = LayerTransforms(
                    key_shift=None if frame_shift is None else tuple(frame_shift.tolist()),
                    key_scale=None if lam is None else tuple(lam.tolist()),
                    key_rotation=rot,
                )
                name = f"shift={int(use_shift)},rot={int(rot)},alpha={alpha:g}"
                x = _key_transform(k_all, lt, h, hd)
                cand = _Candidate(name, lt, base_cfg, _thresholds(x, configs, i, "key"), x[:rq].clone())
                del x
                key_errs[name] = key_error(cand, base_cfg)
                if best is None or key_errs[name] < key_errs[best.name]:
                    best = cand
                if progress:
                    progress(1)
    assert best is not None
    for cfg in configs[:-1]:
        name = best.name + f",outer={cfg.outer_ratio:g},inner={cfg.inner_ratio:g}"
        key_errs[name] = key_error(best, cfg)
        if key_errs[name] < key_errs[best.name]:
            best = _Candidate(name, best.lt, cfg, best.profiled, best.scored)
        if progress:
            progress(1)
    # values: rotation, then ratios
    val_errs: dict[str, float] = {}
    vbest: _Candidate | None = None
    for rot in (False, True) if search.value_rotation and not layer.value_norm else (False,):
        x = _rotate(v_all) if rot else v_all
        profiled = _thresholds(x, configs, i, "value")
        for cfg in configs:
            vq = _fake_quant(x[:rq], profiled[cfg][0], cfg, search.sink_tokens)
            vh = _rotate(vq) if rot else vq
            name = f"rot={int(rot)},outer={cfg.outer_ratio:g},inner={cfg.inner_ratio:g}"
            # exact keys: the reference's attention probabilities, so the error of P @ vh (the same numbers)
            val_errs[name] = float((_attend(None, None, vh, sc, win, pos, probs)[0] - ref).pow(2).sum()) / energy
            if vbest is None or val_errs[name] < val_errs[vbest.name]:
                vbest = _Candidate(name, LayerTransforms(value_rotation=rot), cfg, profiled, vq)
            if progress:
                progress(1)
    assert vbest is not None
    return LayerChoice(
        LayerTransforms(
            key_shift=best.lt.key_shift,
            key_scale=best.lt.key_scale,
            key_rotation=best.lt.key_rotation,
            value_rotation=vbest.lt.value_rotation,
        ),
        best.config,
        vbest.config,
        best.profiled[best.config],
        vbest.profiled[vbest.config],
        {
            "key": best.name,
            "value": vbest.name,
            "key_errors": {n: round(e, 8) for n, e in key_errs.items()},
            "value_errors": {n: round(e, 8) for n, e in val_errs.items()},
        },
    )


def choose_transforms(
    record: AttentionRecord,
    search: PlusSearch,
    partners: np.ndarray | None,
    progress: Callable[[int], None] | None = None,
) -> tuple[list[LayerTransforms], list[tuple[OakenConfig, OakenConfig]], list[dict[str, Any]]]:
    """:func:`choose_layer` of every layer of ``record``: the transforms, ``(key config, value config)`` per layer
    and notes (every candidate's error) for the profile file."""
    choices = [choose_layer(record.layer(i), search, partners, progress) for i in range(record.num_layers)]
    return (
        [c.transforms for c in choices],
        [(c.key_config, c.value_config) for c in choices],
        [c.notes for c in choices],
    )


def candidates_per_layer(search: PlusSearch, rope_ok: bool) -> int:
    alphas = len(search.alphas) if rope_ok else 1
    keys = (2 if search.key_shift else 1) * (2 if search.key_rotation else 1) * alphas + len(search.ratios) - 1
    return keys + (2 if search.value_rotation else 1) * len(search.ratios)
