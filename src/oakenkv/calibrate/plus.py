"""The ``oaken-plus`` preset: the paper's online quantizer, after offline transforms chosen per layer.

Oaken (the paper) profiles four thresholds per layer and kind, at fixed group ratios (4% outer, 6% inner). On
models whose keys carry per-channel offsets (a key bias, channels of constant sign) or a few large channels, one
token's range is set by those channels and the per-token 4-bit middle grid is too coarse for the rest; on a
Qwen2 model this makes Oaken worse than plain per-token INT4. ``oaken-plus`` keeps the online half exactly as it is
(per-token grouping, 4/5-bit codes, the fused dense-and-sparse bytes, the pages and kernels) and lets the offline
half do more:

1. record queries, keys and values of calibration windows, one layer at a time
   (``oakenkv.calibrate.recording.stream_attention``: memory holds one layer's recording, not every layer's);
2. per layer, score candidate transforms (``oakenkv.calibrate.transforms``: a key shift, key smoothing folded into
   the weights with exponent ``alpha``, per-head Hadamard rotations of keys and of values) and group ratios by the
   error they cause in the layer's attention output on calibration text (never the evaluation text), and keep
   the best (:func:`choose_layer`);
3. the layer's thresholds are those of the chosen candidate, profiled on its transformed keys and values while it
   was scored; then the layer's recording is dropped and the next layer runs (:func:`profile_plus`).

Scoring a layer needs every window of that layer (the key shift and the smoothing scales are taken over all of
them before any candidate's thresholds), so the search streams layers, not windows. Each layer's numbers are
those of the all-layers-at-once recording (:func:`~oakenkv.calibrate.recording.record_attention`,
:func:`choose_transforms`, :func:`profile_from_record`), bit for bit (``tests/test_plus.py``).

The result is one :class:`~oakenkv.calibrate.thresholds.Thresholds` carrying its
:class:`~oakenkv.calibrate.transforms.Transforms` (file schema 2). :func:`apply_profile` folds the weight part into a
model (once; a second, different fold is refused) and the cache applies the online part (``oakenkv.store.paged``).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from oakenkv.calibrate.diskcache import (
    CacheEntry,
    calibration_key,
    load_profile,
    load_profile_of_other_dtype,
    store_profile,
)
from oakenkv.calibrate.identity import ModelFingerprint, rounded_weights_digest, weights_digest
from oakenkv.calibrate.profile import ProgressLog
from oakenkv.calibrate.recording import (
    AttentionRecord,
    LayerRecord,
    StreamingUnsupported,
    record_attention,
    stream_attention,
)
from oakenkv.calibrate.search import (
    DEFAULT_RATIOS,
    DEFAULT_SPARSE,
    LayerChoice,
    PlusSearch,
    _fake_quant,
    allocate_sparse,
    attention_output,
    candidates_per_layer,
    choose_layer,
    choose_transforms,
    ratio_choices,
)
from oakenkv.calibrate.spec import CalibrationSpec, calibration_windows, check_windows
from oakenkv.calibrate.thresholds import Thresholds
from oakenkv.calibrate.transforms import TransformError, Transforms, fold_into_model, is_folded, rope_partners

#: Calibration of oaken-plus: 16 windows of 2048 tokens of the Wikipedia excerpt. Long windows matter: the key
#: shift is the mean of post-RoPE keys, which depends on the positions it is taken over.
PLUS_CALIBRATION = CalibrationSpec(samples=16, window=2048)


# ----------------------------------------------------------------------------------------------- the profile


def profile_plus(
    model: Any,
    windows: torch.Tensor,
    search: PlusSearch | None = None,
    *,
    progress: bool = False,
    name: str | None = None,
    metadata: dict[str, Any] | None = None,
) -> Thresholds:
    """Choose the transforms per layer and profile the thresholds after them (module doc).

    Args:
        model: a transformers causal LM with Llama-style attention, unfolded (no oaken-plus transforms in it).
        windows: int64 ``[R, S]`` calibration windows (default calibration: :data:`PLUS_CALIBRATION`).
        search: the candidates (default :class:`PlusSearch`).

    Returns:
        Thresholds with ``transforms`` set; the fingerprint is the unfolded model's.
    """
    return profile_plus_many(model, windows, [search or PlusSearch()], progress=progress, name=name, metadata=metadata)[
        0
    ]


def _layer_records(
    model: Any, windows: torch.Tensor, query_runs: int, num_layers: int, advance: Callable[[int], None]
) -> Iterator[LayerRecord]:
    """The layers' recordings in order: streamed, or, for a model whose layers cannot run one at a time, recorded
    all at once (more memory; warned)."""
    try:
        return stream_attention(model, windows, query_runs, advance)
    except StreamingUnsupported as e:
        warnings.warn(f"recording every layer at once, which takes more memory ({e})", stacklevel=3)
    record = record_attention(model, windows, query_runs, lambda n: advance(n * num_layers))
    return (record.layer(i) for i in range(record.num_layers))


def profile_plus_many(
    model: Any,
    windows: torch.Tensor,
    searches: Sequence[PlusSearch],
    *,
    progress: bool = False,
    name: str | None = None,
    metadata: dict[str, Any] | None = None,
) -> list[Thresholds]:
    """:func:`profile_plus` for several searches (an ablation) from one recording of the calibration attention,
    the slow part; each profile equals the one :func:`profile_plus` makes alone. Memory holds one layer's
    recording at a time (module doc)."""
    if is_folded(model) is not None:
        raise TransformError("profile oaken-plus on the original model, not on one with transforms folded in")
    check_windows(model, windows)
    if windows.shape[1] < 2:  # (token 0, the sink, is left out of the key statistics)
        raise ValueError(
            f"oaken-plus calibration windows need at least 2 tokens (the first is the attention sink, left out of "
            f"the key statistics), got windows of {int(windows.shape[1])}"
        )
    runs = int(windows.shape[0])
    query_runs = {min(s.query_runs, runs) for s in searches}
    if len(query_runs) != 1:
        raise ValueError("searches profiled together must record the same query_runs")
    # shape and weights digests (exact and rounded) of the unfolded model
    fingerprint = ModelFingerprint.from_model(model, name=name, rounded=True)
    try:
        partners = rope_partners(model)
    except TransformError as e:
        partners = None
        warnings.warn(f"key smoothing disabled: {e}", stacklevel=2)
    text = model.config.get_text_config(decoder=True)
    if getattr(text, "attn_logit_softcapping", None) and any(s.key_shift for s in searches):
        # a shift moves every score of a query by the same amount, which softmax ignores and a soft cap does not;
        # smoothing and rotations keep each score, so they stay
        warnings.warn("soft-capped attention logits (Gemma 2): searching without the key shift", stacklevel=2)
        searches = [replace(s, key_shift=False) for s in searches]
    hd = fingerprint.head_dim
    if hd & (hd - 1) and any(s.key_rotation or s.value_rotation for s in searches):
        # the rotations are a choice the search makes per layer: without them it still runs (and chooses the rest)
        warnings.warn(
            f"Hadamard rotations need a power-of-two head_dim, this model's is {hd}: searching without them",
            stacklevel=2,
        )
        searches = [replace(s, key_rotation=False, value_rotation=False) for s in searches]
    compile_s = _warm_kernels(searches, hd)
    t0, cpu0 = time.perf_counter(), time.process_time()
    n = fingerprint.num_layers
    work = n * (runs + sum(candidates_per_layer(s, partners is not None) for s in searches))
    choices: list[list[LayerChoice]] = [[] for _ in searches]
    with ProgressLog(progress, work, "oaken-plus profile", "steps") as advance:
        layers = _layer_records(model, windows, query_runs.pop(), n, advance)
        try:
            for layer in layers:
                for search, made in zip(searches, choices, strict=True):
                    made.append(choose_layer(layer, search, partners, advance))
                del layer  # before the next layer is recorded
        finally:
            close = getattr(layers, "close", None)
            if close is not None:
                close()
    out = []
    for search, made in zip(searches, choices, strict=True):
        th = _profile(made, fingerprint, search, runs)
        th.profile.update(
            {
                "window": int(windows.shape[1]),
                "seconds": round(time.perf_counter() - t0, 3),
                "cpu_seconds": round(time.process_time() - cpu0, 3),
                "compile_seconds": round(compile_s, 3),
                **(metadata or {}),
            }
        )
        out.append(th)
    return out


def _warm_kernels(searches: Sequence[PlusSearch], head_dim: int) -> float:
    """Compile (or load from numba's disk cache) the codec kernels the searches score candidates with, before the
    search's clock starts: a profile's ``seconds`` is the search's, not a first process's compilation (47.6 s
    against 0.7 s on a tiny model, found by a probe). Returns the seconds it took (the profile's
    ``compile_seconds``)."""
    from oakenkv.quant.groups import GroupThresholds

    t = time.perf_counter()
    x = torch.linspace(-3.0, 3.0, 2 * head_dim).reshape(1, 1, 2, head_dim)
    thr = GroupThresholds(-2.0, -0.1, 0.1, 2.0)
    for config in {s.config() for s in searches}:
        _fake_quant(x, thr, config)
    return time.perf_counter() - t


def profile_plus_model(
    model: str = "default",
    *,
    samples: int = PLUS_CALIBRATION.samples,
    window: int = PLUS_CALIBRATION.window,
    data: str = "wikipedia",
    data_path: str | None = None,
    search: PlusSearch | None = None,
    progress: bool = False,
) -> Thresholds:
    """Load a model and its calibration text (``oakenkv.calibrate.profile.load_calibration``) and run
    :func:`profile_plus`. The model is loaded lazily (``oakenkv.assets.lazy``: its embeddings, LM head and decoder
    layers read from disk one at a time as the search runs them), so memory holds about one layer's weights and
    recording, not the whole model; the profile is the same."""
    from oakenkv.calibrate.profile import load_calibration

    loaded, ids, meta = load_calibration(model, samples, window, data, data_path, lazy=True)
    return profile_plus(loaded.model, ids, search, progress=progress, name=model, metadata=meta)


def profile_from_record(
    record: AttentionRecord,
    fingerprint: ModelFingerprint,
    search: PlusSearch,
    partners: np.ndarray | None,
    progress: Callable[[int], None] | None = None,
) -> Thresholds:
    """The body of :func:`profile_plus` on calibration attention inputs recorded all at once
    (:func:`~oakenkv.calibrate.recording.record_attention`): :func:`choose_layer` of every layer."""
    choices = [choose_layer(record.layer(i), search, partners, progress) for i in range(record.num_layers)]
    return _profile(choices, fingerprint, search, int(record.keys[0].shape[0]))


def _profile(choices: list[LayerChoice], fingerprint: ModelFingerprint, search: PlusSearch, runs: int) -> Thresholds:
    """The profile of the layers' choices: their transforms and the thresholds profiled after them (with several
    budget scales, the sparse share first allocated over layers and kinds: :func:`allocate_sparse`)."""
    allocation = None
    if len(search.budget_scales) > 1:
        choices, allocation = allocate_sparse(choices, search.sparse)
    transforms = Transforms(
        tuple(c.transforms for c in choices),
        fingerprint.num_kv_heads,
        fingerprint.head_dim,
        {"search": _search_dict(search)},
        search.sink_tokens,
    )
    info = {
        "method": "oaken-plus",
        "runs": runs,
        "key_position": "post_rope",
        "ratios": "per layer and kind, in each layer's stats",
        "choices": [c.notes for c in choices],
    }
    if allocation is not None:
        info["allocation"] = allocation
    return Thresholds(
        search.config(),
        fingerprint,
        tuple(c.key[0] for c in choices),
        tuple(c.value[0] for c in choices),
        tuple(c.key[1] for c in choices),
        tuple(c.value[1] for c in choices),
        info,
        transforms=transforms,
    )


def _search_dict(search: PlusSearch) -> dict[str, Any]:
    """The search as its profile's notes and cache key hold it. A 4-bit search leaves ``middle_bits`` out: its dict,
    and so the digest in the name of a cached or shipped profile, is what it was before slot widths existed."""
    d = asdict(search)
    d["ratios"] = [list(r) for r in search.ratios]
    d["alphas"] = list(search.alphas)
    if search.middle_bits == 4:
        del d["middle_bits"]
    if not search.static_grids:  # (likewise: a search scored with per-row grids keeps its digest)
        del d["static_grids"], d["static_levels"]
    else:
        d["static_levels"] = list(search.static_levels)
    if search.budget_scales == (1.0,):  # (likewise: a profile without alloc keeps its digest)
        del d["budget_scales"]
    else:
        d["budget_scales"] = list(search.budget_scales)
    return d


# ----------------------------------------------------------------------------------------------- the cache

#: oaken-plus profiles shipped with the package (the embedded default model's, on the default calibration and
#: search), under the cache's file names, so that ``make demo`` does not spend minutes profiling on first use.
#: :func:`cached_plus_profile` uses one only when its recorded weights digest, calibration windows and search
#: are the ones asked for (the same checks as the on-disk cache); otherwise it profiles as usual.
SHIPPED_PROFILES = Path(__file__).parent / "profiles"


def plus_entry(key: Any, search: PlusSearch) -> CacheEntry:
    """The calibration cache's entry (``oakenkv.calibrate.diskcache``) of the oaken-plus profile of ``search`` over
    ``key``'s model and windows."""
    return CacheEntry(
        key,
        "plus",
        {"config": search.config().to_dict(), "search": _search_dict(search)},
        ("oaken-plus", _search_dict(search)),
    )


def cached_plus_profile(
    model: Any,
    tokenizer: Any,
    model_name: str,
    spec: CalibrationSpec | None = None,
    search: PlusSearch | None = None,
    *,
    progress: bool = False,
) -> Thresholds:
    """:func:`profile_plus` over the calibration windows of ``spec`` (default :data:`PLUS_CALIBRATION`), made once
    and then read from the calibration disk cache (:func:`plus_entry`), keyed by content (the model's weights and
    the windows' tokens: ``oakenkv.calibrate.diskcache.CalibrationKey``) and the search settings, and checked
    against them when read."""
    return cached_plus_profiles(model, tokenizer, model_name, [search or PlusSearch()], spec, progress=progress)[0]


def cached_plus_profiles(
    model: Any,
    tokenizer: Any,
    model_name: str,
    searches: Sequence[PlusSearch],
    spec: CalibrationSpec | None = None,
    *,
    progress: bool = False,
) -> list[Thresholds]:
    """:func:`cached_plus_profile` for several search settings (an ablation): the profiles not cached yet are all
    chosen from one recording of the calibration attention (the slow part), as :func:`profile_plus` would each."""
    spec = (spec or PLUS_CALIBRATION).fit(model)
    windows = calibration_windows(tokenizer, spec)
    key = calibration_key(model, model_name, spec, windows)
    out: list[Thresholds | None] = []
    missing: list[tuple[int, CacheEntry]] = []
    for j, search in enumerate(searches):
        entry = plus_entry(key, search)
        found = load_profile(entry)
        if found is None:
            # A shipped file is found by the content digest its name ends with (the same model weights, windows
            # and search), whatever name the model was loaded by; one that does not fit is silently not used.
            for shipped in sorted(SHIPPED_PROFILES.glob(f"plus-*-{entry.digest[:16]}.json")):
                found = load_profile(entry, shipped, quiet=True)
                if found is not None:
                    entry.store(shipped.read_bytes())
                    break
        if found is None:  # the same weights profiled in another dtype
            found = load_profile_of_other_dtype(entry, model)
        out.append(found)
        if found is None:
            missing.append((j, entry))
    if not missing:
        return out  # type: ignore[return-value]
    meta = {
        "data": spec.text,
        "data_path": spec.text_path,
        "samples": spec.samples,
        "window": spec.window,
        "windows_sha256": key.windows_sha256,
    }
    made = profile_plus_many(
        model, windows, [searches[j] for j, _ in missing], progress=progress, name=model_name, metadata=meta
    )
    for (j, entry), th in zip(missing, made, strict=True):
        store_profile(entry, th)
        out[j] = th
    return out  # type: ignore[return-value]


# ----------------------------------------------------------------------------------------------- applying


def apply_profile(model: Any, thresholds: Thresholds) -> Any:
    """Make ``model`` ready for ``thresholds``: check it is the profiled model, fold the profile's weight
    transforms into it (in place) and return it.

    A model that already carries exactly these transforms is returned unchanged (so a cache can be made for it
    many times); one with other transforms is refused, as is a profile for another model
    (``oakenkv.calibrate.match``: the fold records the weights before and after it, so a folded model is still
    checked by its weights).
    """
    from oakenkv.calibrate.match import check_identity, check_transforms, record_fold

    check_identity(thresholds, model)  # shape and weights (a folded model: those recorded at its fold)
    t = thresholds.transforms
    done = is_folded(model)
    if t is None or done is not None:
        check_transforms(thresholds, model)  # nothing to fold: the model must carry exactly the profile's
        return model
    before = weights_digest(model)
    # the profile of these weights in another dtype (check_identity accepted it by the rounded digest): recorded too
    fp = thresholds.fingerprint
    rounded = None
    if fp.weights_bf16 is not None and fp.weights is not None and before != fp.weights:
        rounded = rounded_weights_digest(model)
    if t.folds_weights:
        fold_into_model(model, t)
    else:  # nothing to fold: still mark the model, so that another profile's fold is refused later
        from oakenkv.calibrate.transforms import FOLD_MARK

        setattr(model.config, FOLD_MARK, t.digest())
    record_fold(model, before, rounded)
    return model


#: (``DEFAULT_RATIOS``, ``DEFAULT_SPARSE``, ``ratio_choices``, ``PlusSearch``, ``attention_output``,
#: ``choose_transforms``: ``oakenkv.calibrate.search``;
#: ``AttentionRecord``, ``record_attention``: ``oakenkv.calibrate.recording``; re-exported, as users import them here.)
__all__: Sequence[str] = [
    "DEFAULT_RATIOS",
    "DEFAULT_SPARSE",
    "PLUS_CALIBRATION",
    "SHIPPED_PROFILES",
    "AttentionRecord",
    "PlusSearch",
    "apply_profile",
    "attention_output",
    "cached_plus_profile",
    "cached_plus_profiles",
    "choose_transforms",
    "plus_entry",
    "profile_from_record",
    "profile_plus",
    "profile_plus_many",
    "profile_plus_model",
    "ratio_choices",
    "record_attention",
]
