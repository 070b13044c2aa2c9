"""The one check of a profile against a model, used by every constructor that pairs them.

:func:`check_profile_model` decides whether ``thresholds`` belong to ``model``: the shape, the weights (by their
digest, :func:`~oakenkv.calibrate.thresholds.weights_digest`) and the oaken-plus transforms the model carries.
``OakenCache(thresholds, model)``, ``OakenCache.from_profile`` / ``for_model`` (through
:func:`oakenkv.calibrate.plus.apply_profile`), the evaluation's method builder and the apps call it; none has a
check of its own.

A model with oaken-plus transforms folded into it no longer has the weights its profile was made on: the fold
records on the model's config the digest of the weights before the fold (checked against the profile then) and
after it (:func:`record_fold`). Later checks hash the model's weights again (cheap when no tensor changed:
``weights_digest`` remembers) and compare them with the second, then the first with the profile's: weights
changed after the fold are refused, not taken for the profiled ones.

Given only a model's config (``OakenCache(thresholds, model.config)``, the older form), only the shape can be
compared: :class:`ShapeOnlyWarning` says so, once per call, when the profile records a weights digest that could
have been checked.
"""

from __future__ import annotations

import warnings
from typing import Any

from oakenkv.calibrate.identity import rounded_weights_digest
from oakenkv.calibrate.thresholds import (
    ModelFingerprint,
    ModelMismatchError,
    OtherDtypeWarning,
    Thresholds,
    UnverifiedWeightsWarning,
    weights_digest,
)

#: Attribute set on a folded model's config: ``(weights digest before the fold, after the fold)``, then, where known,
#: the rounded digests (``identity.rounded_weights_digest``) of the weights before the fold (when the profile was
#: matched to them in another dtype) and after it (when the folded model was cast: :func:`cast_folded`), or None.
FOLD_WEIGHTS = "oakenkv_folded_weights"


class ShapeOnlyWarning(UnverifiedWeightsWarning):
    """A profile was paired with a model's config, not the model: only the shape could be checked, so a profile of
    other weights of the same shape (another checkpoint, a fine-tune) would not be noticed."""


def is_model(obj: Any) -> bool:
    """Whether ``obj`` is a model (weights and a config), not only a config."""
    return hasattr(obj, "state_dict") and hasattr(obj, "config")


def _config(model: Any) -> Any:
    return model.config if is_model(model) else model


def record_fold(model: Any, before: str, before_rounded: str | None = None) -> None:
    """Mark ``model`` (whose oaken-plus transforms were just folded in, or marked) with the digest of its weights
    ``before`` the fold and of those it holds now, for :func:`check_profile_model`; ``before_rounded``: their
    rounded digest (``identity.rounded_weights_digest``), when the profile matched them by it (another dtype).
    The folded weights' rounded digest is recorded too, so that the folded model cast to another dtype (``.to``, or
    saved and loaded again in it) is still known by them (:func:`check_identity`, with ``OtherDtypeWarning``)."""
    setattr(model.config, FOLD_WEIGHTS, (before, weights_digest(model), before_rounded, rounded_weights_digest(model)))


def cast_folded(model: Any, dtype: Any) -> None:
    """Cast ``model`` to ``dtype`` in place, keeping the fold record of a folded model (:func:`record_fold`) true: the
    weights after the fold are now the cast ones, and their rounded digest is recorded too, so that the model read
    back in another dtype (an export written in bfloat16, loaded in float32) is still known for the folded weights
    (:func:`check_identity`, with ``OtherDtypeWarning``). A model without a record is only cast."""
    record = getattr(model.config, FOLD_WEIGHTS, None)
    model.to(dtype)
    if record is None:
        return
    before, _, *rest = record
    record_fold(model, before, rest[0] if rest else None)  # (the cast weights are now the folded ones)


def check_identity(thresholds: Thresholds, model: Any, *, stacklevel: int = 2) -> None:
    """Raise :class:`ModelMismatchError` when ``thresholds`` were not profiled on ``model``: its shape, and its weights
    when the model (not only its config) is given; a folded model by the weights recorded at its fold (module doc).
    Warns :class:`ShapeOnlyWarning` when only a config is given and the profile has a digest to compare."""
    from oakenkv.calibrate.transforms import FOLD_MARK

    config = _config(model)
    if not is_model(model):
        thresholds.check_model(config)  # the shape
        if thresholds.fingerprint.weights is not None:
            warnings.warn(
                "only the model's shape was checked against the profile (a config was given, not the model): pass "
                "the model itself, e.g. OakenCache(thresholds, model), or use OakenCache.from_profile(model, ...), so "
                "that a profile of other weights is refused",
                ShapeOnlyWarning,
                stacklevel=stacklevel + 1,
            )
        return
    if getattr(config, FOLD_MARK, None) is None:
        thresholds.check_model(model)  # shape and weights
        return
    record = getattr(config, FOLD_WEIGHTS, None)
    if record is None:  # folded by hand (transforms.fold_into_model): the weights before it are unknown
        thresholds.check_model(config)
        if thresholds.fingerprint.weights is not None:
            warnings.warn(
                "this model's oaken-plus transforms were folded in without oakenkv.calibrate.plus.apply_profile, so "
                "its weights before the fold are unknown: only its shape was checked against the profile",
                ShapeOnlyWarning,
                stacklevel=stacklevel + 1,
            )
        return
    before, after, *rest = record
    before_rounded = rest[0] if rest else None
    after_rounded = rest[1] if len(rest) > 1 else None
    if weights_digest(model) != after:
        if after_rounded is None or rounded_weights_digest(model) != after_rounded:
            raise ModelMismatchError(
                "this model's weights changed after oaken-plus transforms were folded into them (not only cast to "
                "another dtype, which is accepted), so they are no longer the profiled ones; load the original, "
                "unfolded model again and build its cache with OakenCache.for_model (or from_profile)"
            )
        warnings.warn(
            "this model holds its folded weights in another dtype than they were recorded in (equal when rounded to "
            "bfloat16): the profile is used as it is",
            OtherDtypeWarning,
            stacklevel=stacklevel + 1,
        )
    fp = ModelFingerprint.from_model_config(config, weights=before, weights_bf16=before_rounded)
    thresholds.check_fingerprint(fp)
    if thresholds.fingerprint.weights is None:
        thresholds._warn_unverified()


def check_transforms(thresholds: Thresholds, model: Any) -> None:
    """Raise :class:`~oakenkv.calibrate.transforms.TransformError` (a ValueError) when the model does not carry
    exactly the profile's oaken-plus transforms (a profile without transforms: none): either way the thresholds
    would quantize vectors they were not profiled for."""
    from oakenkv.calibrate.transforms import FOLD_MARK, TransformError

    folded = getattr(_config(model), FOLD_MARK, None)
    t = thresholds.transforms
    if t is None and folded is not None:
        raise TransformError("this model carries oaken-plus transforms; use the oaken-plus profile they came from")
    if t is not None and folded != t.digest():
        raise TransformError(
            "this profile has oaken-plus transforms the model does not carry"
            + (" (it carries other ones)" if folded else "")
            + "; build the cache with OakenCache.from_profile(model, profile), which folds them in"
        )


def check_profile_shape(thresholds: Thresholds, model_name: str) -> None:
    """Before a model loads: raise :class:`ModelMismatchError` when the model ``model_name`` (as the command line
    names it) has another shape than the profile's, read from its ``config.json`` without loading it
    (``oakenkv.assets.models.model_kv_shape``: an embedded model once converted, a local directory). Nothing is
    checked when no local config exists yet; the check at construction (:func:`check_profile_model`) still runs."""
    from oakenkv.assets.models import model_kv_shape

    shape = model_kv_shape(model_name)
    if shape is None:
        return
    fp = thresholds.fingerprint
    layers, dim = shape
    if (fp.num_layers, fp.num_kv_heads * fp.head_dim) != (layers, dim):
        raise ModelMismatchError(
            f"this profile is for ({fp.describe()}: {fp.num_kv_heads * fp.head_dim} K/V values per token) but the "
            f"model {model_name!r} has {layers} layers and {dim} K/V values per token; profile this model with "
            "`oakenkv profile --model ...`"
        )


def check_profile_model(thresholds: Thresholds, model: Any) -> None:
    """The check every constructor runs before pairing a profile with a model (module doc): raises
    :class:`ModelMismatchError` (a ValueError) for a profile of another model (shape or weights), ValueError when the
    model does not carry exactly the profile's transforms.

    ``model``: a transformers model, or only its config (the shape alone is then compared: :class:`ShapeOnlyWarning`).
    """
    check_identity(thresholds, model, stacklevel=3)
    check_transforms(thresholds, model)


__all__ = [
    "FOLD_WEIGHTS",
    "ShapeOnlyWarning",
    "cast_folded",
    "check_identity",
    "check_profile_model",
    "check_profile_shape",
    "check_transforms",
    "is_model",
    "record_fold",
]
