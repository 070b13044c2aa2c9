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
import heapq
import math
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from oakenkv.calibrate.recording import AttentionRecord, LayerRecord
from oakenkv.calibrate.stats import RunAccumulator, kurtosis, run_quantiles
from oakenkv.calibrate.thresholds import GroupThresholds, LayerStats
from oakenkv.calibrate.transforms import LayerTransforms, TransformError, fwht, tie_rope_pairs
from oakenkv.format.config import MAX_SINK_TOKENS, OakenConfig, valid_sink_tokens

__all__ = [
    "ALLOC_SCALES",
    "DEFAULT_RATIOS",
    "DEFAULT_SPARSE",
    "LayerChoice",
    "PlusSearch",
    "allocate_sparse",
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


#: The multiples of the sparse share each layer's keys and values may take with ``oaken-plus:alloc=1``
#: (:attr:`PlusSearch.budget_scales`): the search scores every split at each, and :func:`allocate_sparse` spends the
#: model's budget (the share times its values) where the scored error falls most.
ALLOC_SCALES: tuple[float, ...] = (0.5, 1.0, 1.5, 2.0)


def ratio_choices(sparse: float) -> tuple[tuple[float, float], ...]:
    """:data:`DEFAULT_RATIOS` scaled to a sparse (inner + outer) share of ``sparse``: the same three splits of the
    budget, 40/60, 80/20 and 100/0 (``DEFAULT_RATIOS`` itself for 0.10)."""
    if not isinstance(sparse, (int, float)) or isinstance(sparse, bool) or not 0.0 < sparse < 1.0:
        raise ValueError(f"the sparse share must be a fraction in (0, 1), got {sparse!r}")
    if sparse == DEFAULT_SPARSE:
        return DEFAULT_RATIOS
    return _scale_ratios(DEFAULT_RATIOS, sparse / DEFAULT_SPARSE)


def _scale_ratios(ratios: Sequence[tuple[float, float]], scale: float) -> tuple[tuple[float, float], ...]:
    """Each ``(outer, inner)`` times ``scale``, rounded to 6 decimals (the same splits of a larger or smaller share)."""
    return tuple((round(o * scale, 6), round(i * scale, 6)) for o, i in ratios)


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
    #: Multiples of the sparse share (``ratios``' sum) a layer's keys or values may take: ``(1.0,)`` (the default)
    #: gives every layer and kind the same share; more (:data:`ALLOC_SCALES`, ``oaken-plus:alloc=1``) score every
    #: split at each multiple too, and the profile spends the same budget over the model where the scored error
    #: falls most (:func:`allocate_sparse`).
    budget_scales: tuple[float, ...] = (1.0,)
    #: The grids the candidates are scored with: per row (the default), or the format's static grids
    #: (``OakenConfig.static_grids``) and, if given, static levels (``OakenConfig.static_levels``) of each candidate's
    #: thresholds, as the profile will be served with them (``oaken-plus:static=1,aware=1``). The profile's config
    #: then carries them.
    static_grids: bool = False
    static_levels: tuple[float, ...] = ()

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
        alloc: bool = False,
        static_levels: tuple[float, ...] | None = None,
    ) -> PlusSearch:
        """The search of the method spec ``oaken-plus:shift=..,rot_k=..,rot_v=..,smooth=..,ratios=..,sink=..,bits=..,
        sparse=..`` (each remedy on or off; off ratios means the 40/60 outer/inner split only; ``sink``: tokens kept
        at 16 bits; ``bits``: the dense slot width; ``sparse``: the inner + outer share, :func:`ratio_choices`;
        ``alloc``: the share allocated over layers and kinds, :data:`ALLOC_SCALES`; ``static_levels``: None (score
        with per-row grids) or the static levels to score with, ``()`` for one static grid)."""
        choices = ratio_choices(sparse)
        return cls(
            alphas=cls().alphas if smooth else (0.0,),
            key_shift=bool(shift),
            key_rotation=bool(rot_k),
            value_rotation=bool(rot_v),
            ratios=choices if ratios else choices[:1],
            sink_tokens=int(sink),
            middle_bits=int(bits),
            budget_scales=ALLOC_SCALES if alloc else (1.0,),
            static_grids=static_levels is not None,
            static_levels=tuple(static_levels or ()),
        )

    @property
    def sparse(self) -> float:
        """The sparse (inner + outer) share of the ratios (each split has the same)."""
        outer, inner = self.ratios[0]
        return round(outer + inner, 6)

    def scaled_ratios(self, scale: float) -> tuple[tuple[float, float], ...]:
        """The ratios at ``scale`` times the sparse share (the same splits; ``ratios`` itself at 1)."""
        return self.ratios if scale == 1.0 else _scale_ratios(self.ratios, scale)

    def config(self, outer: float | None = None, inner: float | None = None) -> OakenConfig:
        """The codec's configuration for candidate ratios ``(outer, inner)`` at this search's slot width (default
        ratios: the paper's, what a profile file records as its config)."""
        static = {"static_grids": self.static_grids, "static_levels": self.static_levels}
        if outer is None or inner is None:
            return OakenConfig(middle_bits=self.middle_bits, **static)
        return OakenConfig(outer_ratio=outer, inner_ratio=inner, middle_bits=self.middle_bits, **static)

    def __post_init__(self) -> None:
        if not self.alphas or any(not 0.0 <= a <= 1.0 for a in self.alphas):
            raise ValueError(f"alphas must be a non-empty subset of [0, 1], got {self.alphas}")
        self.config()  # validates the slot width
        for o, i in self.ratios:
            self.config(o, i)  # validates
        scales = self.budget_scales
        if (
            not scales
            or 1.0 not in scales
            or any(isinstance(x, bool) or not isinstance(x, (int, float)) or not x > 0 for x in scales)
            or list(scales) != sorted(set(scales))
        ):
            raise ValueError(f"budget_scales must be ascending positive multiples including 1.0, got {scales!r}")
        for x in scales:
            for o, i in self.scaled_ratios(x):
                self.config(o, i)  # validates (a share of 1 or more is refused here, before any profiling)
        if self.query_runs < 1 or self.query_positions < 1:
            raise ValueError("query_runs and query_positions must be positive")
        if not valid_sink_tokens(self.sink_tokens):  # (checked before minutes of profiling, not after)
            raise ValueError(f"sink_tokens must be an int in [0, {MAX_SINK_TOKENS}], got {self.sink_tokens!r}")


# ----------------------------------------------------------------------------------------------- scoring


def attention_output(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float, window: int | None, positions: int
) -> torch.Tensor:
    """Causal (optionally sliding-window) attention of the last ``positions`` queries: q ``[R, Hq, S, hd]``,
    k/v ``[R, H, S, hd]`` -> ``[R, Hq, positions, hd]``. The plain definition of what the search scores
    (:class:`_Scorer` computes the same numbers faster)."""
    group = q.shape[1] // k.shape[1]
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
    return probs @ v.repeat_interleave(group, dim=1)


#: Fewest scoring positions at which the query heads of one KV head are stacked (:class:`_Scorer`).
STACK_MIN_POSITIONS = 64


class _Scorer:
    """The attention output of one layer's scoring queries (the last ``positions`` of each query window) for
    candidate keys or values, and its error against the exact output: the same numbers as
    :func:`attention_output`, bit for bit (``tests/test_search.py``), at a fraction of its cost.

    Every candidate's scores and probabilities go into one buffer allocated once per layer (a fresh tensor of the
    scores' size is mapped and zeroed by the OS on every call: that cost as much as the matmuls), the softmax runs in
    place, the query heads that share a KV head are stacked along the query axis (one matmul per KV head, no
    repeated keys or values), a power-of-two softmax scale is folded into the queries once (exact: it scales each
    product and sum by a power of two), and only the columns that hide something are masked.
    """

    def __init__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float, window: int | None, positions: int
    ):
        r, hq, s, hd = q.shape
        h = k.shape[1]
        g, p = hq // h, min(positions, s)
        self.shape = (r, hq, p, hd)
        # stacked, a head's rows give the same products as alone only in a matrix-matrix product: with a few rows the
        # plain attention's matmul takes another kernel (tests/test_search.py), so few positions repeat the keys
        self.repeat = 1 if p >= STACK_MIN_POSITIONS else g
        heads, rows = (h, g * p) if self.repeat == 1 else (hq, p)
        mantissa, _ = math.frexp(scaling)
        self.post_scale = None if mantissa == 0.5 else scaling
        qq = q[:, :, s - p :]
        if self.post_scale is None:
            qq = qq * scaling
        self.q = qq.reshape(r, heads, rows, hd).contiguous()  # query head h * g + j: row block j of KV head h
        pq = torch.arange(s - p, s)[:, None]
        pk = torch.arange(s)[None, :]
        hide = pk > pq
        if window is not None:
            hide |= pk <= pq - window
        cols = hide.any(dim=0).nonzero().flatten()
        self.c0, self.c1 = (int(cols[0]), int(cols[-1]) + 1) if cols.numel() else (0, 0)
        self.hide = hide[:, self.c0 : self.c1].repeat(rows // p, 1)
        self.probs = torch.empty((r, heads, rows, s), dtype=torch.float32)
        self.work = torch.empty_like(self.probs)
        self.out = torch.empty((r, heads, rows, hd), dtype=torch.float32)
        self._softmax(k, self.probs)
        self.ref = self.output(v, self.probs).clone()
        self.diff = torch.empty(self.shape, dtype=torch.float32)
        self.energy = float(self.ref.pow(2).sum())

    def _softmax(self, k: torch.Tensor, into: torch.Tensor) -> torch.Tensor:
        if self.repeat > 1:
            k = k.repeat_interleave(self.repeat, dim=1)
        torch.matmul(self.q, k.transpose(-1, -2), out=into)
        if self.post_scale is not None:
            into.mul_(self.post_scale)
        if self.c1 > self.c0:
            into[..., self.c0 : self.c1].masked_fill_(self.hide, float("-inf"))
        return torch.softmax(into, dim=-1, out=into)

    def output(self, v: torch.Tensor, probs: torch.Tensor | None = None) -> torch.Tensor:
        """The attention output ``[R, Hq, positions, hd]`` (a view of a reused buffer) for values ``v [R, H, S, hd]``
        and the probabilities ``probs`` (default: the exact keys')."""
        if self.repeat > 1:
            v = v.repeat_interleave(self.repeat, dim=1)
        torch.matmul(self.probs if probs is None else probs, v, out=self.out)
        return self.out.view(self.shape)

    def error(self, out: torch.Tensor) -> float:
        diff = torch.sub(out, self.ref.view(self.shape), out=self.diff)
        return float(diff.pow_(2).sum()) / self.energy

    def key_error(self, k: torch.Tensor, v: torch.Tensor) -> float:
        """The error of keys ``k [R, H, S, hd]`` with values ``v``."""
        return self.error(self.output(v, self._softmax(k, self.work)))

    def value_error(self, v: torch.Tensor) -> float:
        """The error of values ``v`` with the exact keys (their probabilities are kept)."""
        return self.error(self.output(v))


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


class _Profile:
    """The thresholds of one candidate's vectors ``x [R, H, S, hd]`` (one run per window) at every ratio of the
    search, exactly as ``oakenkv.calibrate.profile`` averages them. One pass over the runs serves every ratio: a
    run's quantiles at several ratios come from one partition, and each is the same number as alone (exact order
    statistics). The runs are taken on two threads (numpy's partition releases the GIL) and averaged in their order.
    The statistics (:meth:`profiled`) also need each run's kurtosis, which costs more than its quantiles: they are
    made for the chosen candidate only, from its vectors made again."""

    def __init__(self, x: torch.Tensor, configs: Sequence[OakenConfig], layer: int, kind: str):
        self.configs = list(dict.fromkeys(configs))
        self.layer, self.kind, self.num_values = layer, kind, x[0].numel()
        outer, inner = tuple(c.outer_ratio for c in self.configs), tuple(c.inner_ratio for c in self.configs)
        self.runs = list(_pool().map(lambda r: run_quantiles(x[r], outer, inner), range(x.shape[0])))
        # the averaged thresholds do not depend on the kurtosis (no kurtosis tuning): a stand-in for it
        self.thresholds = {
            c: self._accumulate(j, [0.0] * len(self.runs)).finish(c, False, layer, kind)[0]
            for j, c in enumerate(self.configs)
        }

    def _accumulate(self, j: int, kurt: Sequence[float]) -> RunAccumulator:
        acc = RunAccumulator()
        for (o, i), k in zip(self.runs, kurt, strict=True):
            acc.add(o[j : j + 1], i[j : j + 1], k, self.num_values)
        return acc

    def profiled(self, x: torch.Tensor, config: OakenConfig) -> Profiled:
        """The thresholds and statistics at ``config``; ``x``: the vectors this profile was made of."""
        return self.profiled_many(x, [config])[0]

    def profiled_many(self, x: torch.Tensor, configs: Sequence[OakenConfig]) -> list[Profiled]:
        """:meth:`profiled` at each of ``configs`` (the runs' kurtosis computed once)."""
        kurt = list(_pool().map(lambda r: kurtosis(x[r]), range(x.shape[0])))
        return [self._accumulate(self.configs.index(c), kurt).finish(c, False, self.layer, self.kind) for c in configs]


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
        shift = torch.tensor(lt.key_shift, dtype=torch.float32).reshape(1, h, 1, hd)
        k = k - shift if lt.key_scale is None else k.sub_(shift)  # (in place on a tensor of our own)
    if lt.key_rotation:
        k = torch.from_numpy(fwht(k.numpy()))
    return k


def _key_restore(k: torch.Tensor, lt: LayerTransforms, h: int, hd: int) -> torch.Tensor:
    """Keys back in the unfolded model's frame up to the shift (which softmax ignores); ``k`` is overwritten."""
    if lt.key_rotation:
        k = torch.from_numpy(fwht(k.numpy()))
    if lt.key_scale is not None:
        k = k.mul_(torch.tensor(lt.key_scale, dtype=torch.float32).reshape(1, h, 1, hd))
    return k


@dataclass
class _Candidate:
    name: str
    lt: LayerTransforms
    config: OakenConfig
    #: The candidate's thresholds at every ratio of the search, and its transformed vectors of the query windows.
    profile: _Profile
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
    #: With several budget scales (:attr:`PlusSearch.budget_scales`): per kind (``"key"``, ``"value"``), one option
    #: per scale, ascending: ``(sparse share, error, config, profiled)`` of the best split at that share (the chosen
    #: transforms'); :func:`allocate_sparse` picks one. None with one scale.
    options: dict[str, list[tuple[float, float, OakenConfig, Profiled]]] | None = None


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
    scorer = _Scorer(q, k_q, v_q, sc, win, pos)

    configs = [search.config(o, inn) for o, inn in search.ratios]
    # other shares of the sparse budget (alloc): every split at each, scored for the chosen transforms only
    scaled = {x: [search.config(o, inn) for o, inn in search.scaled_ratios(x)] for x in search.budget_scales if x != 1}
    profiled_configs = configs + [c for cs in scaled.values() for c in cs]

    def key_error(c: _Candidate, cfg: OakenConfig) -> float:
        kq = _fake_quant(c.scored, c.profile.thresholds[cfg], cfg, search.sink_tokens)
        return scorer.key_error(_key_restore(kq, c.lt, h, hd), v_q)

    # keys: shift, rotation and smoothing first (at the middle ratios), then the ratios for the winner
    if search.key_shift and layer.softcap:
        raise TransformError(f"layer {i}: soft-capped logits change under a key shift; search with key_shift=False")
    shift = k_all[:, :, 1:].mean(dim=(0, 2)).reshape(-1) if search.key_shift else None  # token 0: the sink
    key_errs: dict[str, float] = {}
    best: _Candidate | None = None
    base_cfg = configs[-1]
    absmax: dict[bool, torch.Tensor] = {}
    for use_shift in (False, True) if shift is not None else (False,):
        for rot in (False, True) if search.key_rotation else (False,):
            for alpha in search.alphas:
                if alpha and partners is None:
                    continue
                lam = None
                if alpha:
                    if use_shift not in absmax:  # (one per shift: every alpha and rotation takes the same)
                        centred = k_all[:, :, 1:] - (shift.reshape(1, h, 1, hd) if use_shift else 0.0)
                        absmax[use_shift] = centred.abs().amax(dim=(0, 2))  # [h, hd]
                    amax = absmax[use_shift]
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
                cand = _Candidate(name, lt, base_cfg, _Profile(x, profiled_configs, i, "key"), x[:rq].clone())
                del x
                key_errs[name] = key_error(cand, base_cfg)
                if best is None or key_errs[name] < key_errs[best.name]:
                    best = cand
                if progress:
                    progress(1)
    assert best is not None
    tname = best.name
    for cfg in configs[:-1]:
        name = best.name + f",outer={cfg.outer_ratio:g},inner={cfg.inner_ratio:g}"
        key_errs[name] = key_error(best, cfg)
        if key_errs[name] < key_errs[best.name]:
            best = _Candidate(name, best.lt, cfg, best.profile, best.scored)
        if progress:
            progress(1)
    key_scaled = _scaled_options(scaled, tname, key_errs, lambda cfg: key_error(best, cfg), progress)
    # values: rotation, then ratios
    val_errs: dict[str, float] = {}
    vbest: _Candidate | None = None
    for rot in (False, True) if search.value_rotation and not layer.value_norm else (False,):
        x = _rotate(v_all) if rot else v_all
        profile = _Profile(x, profiled_configs, i, "value")
        for cfg in configs:
            vq = _fake_quant(x[:rq], profile.thresholds[cfg], cfg, search.sink_tokens)
            vh = _rotate(vq) if rot else vq
            name = f"rot={int(rot)},outer={cfg.outer_ratio:g},inner={cfg.inner_ratio:g}"
            # exact keys: the reference's attention probabilities, so the error of P @ vh (the same numbers)
            val_errs[name] = scorer.value_error(vh)
            if vbest is None or val_errs[name] < val_errs[vbest.name]:
                vbest = _Candidate(name, LayerTransforms(value_rotation=rot), cfg, profile, vq)
            if progress:
                progress(1)
    assert vbest is not None
    v_rot = vbest.lt.value_rotation
    v_x = _rotate(v_all) if v_rot else v_all

    def value_error(cfg: OakenConfig) -> float:
        vq = _fake_quant(v_x[:rq], vbest.profile.thresholds[cfg], cfg, search.sink_tokens)
        return scorer.value_error(_rotate(vq) if v_rot else vq)

    val_scaled = _scaled_options(scaled, f"rot={int(v_rot)}", val_errs, value_error, progress)
    k_x = _key_transform(k_all, best.lt, h, hd)
    # the chosen candidates' thresholds and statistics, at every scale's best split too with alloc (one kurtosis
    # pass per kind either way)
    options: dict[str, list[tuple[float, float, OakenConfig, Profiled]]] = {}
    chosen: dict[str, Profiled] = {}
    for kind, cand, errs, extra, x in (
        ("key", best, key_errs, key_scaled, k_x),
        ("value", vbest, val_errs, val_scaled, v_x),
    ):
        opts = sorted([(search.sparse, errs[cand.name], cand.config), *extra], key=lambda o: o[0])
        made = cand.profile.profiled_many(x, [o[2] for o in opts])
        options[kind] = [(sh, err, cfg, p) for (sh, err, cfg), p in zip(opts, made, strict=True)]
        chosen[kind] = made[[o[2] for o in opts].index(cand.config)]
    return LayerChoice(
        LayerTransforms(
            key_shift=best.lt.key_shift,
            key_scale=best.lt.key_scale,
            key_rotation=best.lt.key_rotation,
            value_rotation=vbest.lt.value_rotation,
        ),
        best.config,
        vbest.config,
        chosen["key"],
        chosen["value"],
        {
            "key": best.name,
            "value": vbest.name,
            "key_errors": {n: round(e, 8) for n, e in key_errs.items()},
            "value_errors": {n: round(e, 8) for n, e in val_errs.items()},
        },
        options if scaled else None,
    )


def _scaled_options(
    scaled: dict[float, list[OakenConfig]],
    prefix: str,
    errs: dict[str, float],
    error: Callable[[OakenConfig], float],
    progress: Callable[[int], None] | None,
) -> list[tuple[float, float, OakenConfig]]:
    """The best split at each other budget scale: ``(share, error, config)`` per scale; every split's error is
    noted in ``errs`` under ``prefix`` and its ratios."""
    out = []
    for cfgs in scaled.values():
        pick = None
        for cfg in cfgs:
            err = error(cfg)
            errs[f"{prefix},outer={cfg.outer_ratio:g},inner={cfg.inner_ratio:g}"] = err
            if pick is None or err < pick[1]:
                pick = (round(cfg.outer_ratio + cfg.inner_ratio, 6), err, cfg)
            if progress:
                progress(1)
        assert pick is not None
        out.append(pick)
    return out


def allocate_sparse(choices: Sequence[LayerChoice], sparse: float) -> tuple[list[LayerChoice], dict[str, Any]]:
    """Spend the sparse budget over every layer's keys and values (``oaken-plus:alloc=1``): each (layer, kind)
    takes one of its :attr:`LayerChoice.options`, the shares averaging at most ``sparse`` (keys and values of a
    layer hold the same number of values), the sum of the scored errors as small as found.

    Greedy over each option list's lower convex hull (error against share): every (layer, kind) starts at its
    smallest share and the step that lowers the error most per share spent is taken while the budget allows (the
    Lagrangian solution, then filled); ties go to the earlier layer, keys first. The result is kept only if its
    summed error is below the uniform choice's (every share ``sparse``, what the search picks without alloc).
    Returns the choices with their key and value configs and thresholds replaced, and a summary for the profile.
    """
    # one option list per (layer, kind), keys first: item n is layer n // 2's kind n % 2
    items = []
    for c in choices:
        if c.options is None:
            raise ValueError("allocate_sparse needs choices made with several budget scales (PlusSearch.budget_scales)")
        items += [c.options["key"], c.options["value"]]
    budget = sparse * len(items) + 1e-9

    def hull(opts: list[tuple[float, float, OakenConfig, Profiled]]) -> list[int]:
        path, cur = [0], 0
        while True:
            best_j, best_slope = None, 0.0
            for j in range(cur + 1, len(opts)):
                gain = opts[cur][1] - opts[j][1]
                cost = opts[j][0] - opts[cur][0]
                if gain > 0 and cost > 0 and gain / cost > best_slope:
                    best_j, best_slope = j, gain / cost
            if best_j is None:
                return path
            path.append(best_j)
            cur = best_j

    paths = [hull(opts) for opts in items]
    at = [0] * len(items)  # position along each hull
    used = sum(opts[0][0] for opts in items)
    heap: list[tuple[float, int]] = []  # (minus the step's error drop per share, item): ties to the earlier item

    def push(n: int) -> None:
        if at[n] + 1 < len(paths[n]):
            a, b = items[n][paths[n][at[n]]], items[n][paths[n][at[n] + 1]]
            heapq.heappush(heap, (-(a[1] - b[1]) / (b[0] - a[0]), n))

    for n in range(len(items)):
        push(n)
    while heap:
        _, n = heapq.heappop(heap)
        cost = items[n][paths[n][at[n] + 1]][0] - items[n][paths[n][at[n]]][0]
        if used + cost <= budget:
            used += cost
            at[n] += 1
            push(n)
    picked = [opts[paths[n][at[n]]] for n, opts in enumerate(items)]
    uniform = [next(o for o in opts if abs(o[0] - sparse) < 1e-9) for opts in items]
    err_alloc = sum(o[1] for o in picked)
    err_uniform = sum(o[1] for o in uniform)
    use = picked if err_alloc < err_uniform else uniform
    out = []
    for li, c in enumerate(choices):
        k, v = use[2 * li], use[2 * li + 1]
        notes = dict(c.notes, allocated={"key": k[0], "value": v[0]})
        out.append(replace(c, key_config=k[2], value_config=v[2], key=k[3], value=v[3], notes=notes))
    summary = {
        "scales": sorted({o[0] for opts in items for o in opts}),
        "mean_share": round(sum(o[0] for o in use) / len(use), 6),
        "error_sum": {"allocated": round(err_alloc, 8), "uniform": round(err_uniform, 8)},
        "used": "allocated" if use is picked else "uniform",
    }
    return out, summary


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
    scaled = (len(search.budget_scales) - 1) * len(search.ratios)  # other shares, the chosen transforms only
    return keys + (2 if search.value_rotation else 1) * len(search.ratios) + 2 * scaled
