"""The identity of a model a profile belongs to: its shape (:class:`ModelFingerprint`) and the digest of its weights
(:func:`weights_digest`).

Thresholds profiled for one model are wrong for another of another shape, and for another checkpoint of the same
shape (a base model and its fine-tune): a profile records both, and every reader compares them
(``oakenkv.calibrate.thresholds.Thresholds.check_model``; the calibration cache's keys,
``oakenkv.calibrate.diskcache.CalibrationKey``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import weakref
from dataclasses import dataclass, field, replace
from typing import Any

from oakenkv.util.exact import is_int

__all__ = [
    "ROUNDED_DTYPE",
    "WEIGHTS_DIGEST_PREFIX",
    "ModelFingerprint",
    "layer_kinds",
    "rounded_weights_digest",
    "short_digest",
    "weights_digest",
]

#: How :func:`weights_digest` spells a digest: the scheme, then 64 hex digits.
WEIGHTS_DIGEST_PREFIX = "sha256:"
_DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")


#: The dtype :func:`rounded_weights_digest` rounds floating-point weights to: a float32 checkpoint and its bfloat16
#: copy (``model.to(torch.bfloat16)``, or ``from_pretrained(..., dtype=torch.bfloat16)`` of the float32 files) hold
#: the same numbers at this precision.
ROUNDED_DTYPE = "bfloat16"

#: Per model object: the tensors' identity and version counters when :func:`weights_digest` last hashed them, and
#: the digest (weak keys: a model's entry goes with it); one table per kind of digest (exact, rounded).
_DIGESTS: weakref.WeakKeyDictionary[Any, tuple[tuple[Any, ...], str]] = weakref.WeakKeyDictionary()
_ROUNDED: weakref.WeakKeyDictionary[Any, tuple[tuple[Any, ...], str]] = weakref.WeakKeyDictionary()


def _versions(state: dict[str, Any]) -> tuple[Any, ...] | None:
    """What torch changes whenever a tensor of ``state`` is written or replaced: each one's storage, layout and
    version counter (bumped by every in-place op, ``load_state_dict`` included); None where a tensor keeps no
    counter (inference-mode tensors)."""
    try:
        return tuple(
            (
                n,
                t.device,
                t.untyped_storage().data_ptr(),
                t.storage_offset(),
                tuple(t.shape),
                t.stride(),
                t.dtype,
                t._version,
            )
            for n, t in state.items()
        )
    except (RuntimeError, AttributeError):
        return None


def rounded_weights_digest(model: Any, *, reuse: bool = True) -> str:
    """The identity of a model's weights up to their dtype: :func:`weights_digest` of the weights with every
    floating-point tensor rounded to :data:`ROUNDED_DTYPE` (bfloat16; listed under that dtype), the others as they
    are. A float32 model and its bfloat16 copy have the same rounded digest and different :func:`weights_digest`;
    two checkpoints that differ beyond bfloat16's precision (a fine-tune) differ here too. A profile records it
    (``ModelFingerprint.weights_bf16``) so that it serves the same weights loaded in the other dtype
    (``Thresholds.check_fingerprint``); a float16 copy is not the same (float16 rounds otherwise) and does not match.
    Costs one more pass over the weights (each tensor rounded, one at a time); remembered per model object as
    :func:`weights_digest` is (``reuse``)."""
    return _digest(model, reuse, rounded=True)


def weights_digest(model: Any, *, reuse: bool = True) -> str:
    """The identity of a model's weights by content: ``"sha256:<64 hex digits>"``, cheap enough to take per run.

    Over every entry of ``model.state_dict()`` (parameters and persistent buffers) in name order, one line
    ``name, dtype, shape, sha256 of the tensor's bytes`` (native byte order, row-major); the digest is the sha256
    of those lines. Tied tensors (one storage under two names, e.g. ``lm_head.weight``) are hashed once and listed
    under both names. Two models have the same digest iff they hold the same numbers under the same names (up to
    sha256 collisions): a fine-tune, another checkpoint of one family, or the same weights loaded in another
    dtype all differ. The config is not part of it (its shape is in :class:`ModelFingerprint`).

    Every byte is hashed, no sampling: the tensors are hashed in parallel threads (hashlib releases the GIL); the
    time is linear in the weights' bytes (docs/robustness.md, "Cost", has it for the embedded models).

    The digest is remembered per model object, with each tensor's storage and version counter: a model whose
    tensors were neither replaced nor written in place since (torch counts every in-place op, an optimizer step
    and ``load_state_dict`` included) gets it back without hashing, so making a cache per request costs a walk
    over the tensors' version counters, not a hash of every weight. Writes torch does not count (through
    ``param.data``, or a numpy view of the memory) are not seen: pass ``reuse=False`` after those.

    Args:
        model: a ``torch.nn.Module`` (anything with ``state_dict()`` returning tensors); tensors on another
            device are copied to the CPU one at a time.
        reuse: return the remembered digest when no tensor changed (above); False hashes every byte again.

    Raises:
        ValueError: a tensor without data (the ``meta`` device).
    """
    return _digest(model, reuse, rounded=False)


def _digest(model: Any, reuse: bool, rounded: bool) -> str:
    """:func:`weights_digest` (``rounded`` False) or :func:`rounded_weights_digest`."""
    import torch

    from oakenkv.assets.lazy import lazy_weights

    memo = _ROUNDED if rounded else _DIGESTS
    state = model.state_dict()
    # a model made by oakenkv.assets.lazy: its units' placeholders hold no data; they are read from disk one at a
    # time (as the eagerly loaded model holds them), and only the other tensors can change
    lazy = lazy_weights(model)
    on_disk = lazy.lazy_names if lazy is not None else frozenset()
    versions = _versions({n: t for n, t in state.items() if n not in on_disk})
    if reuse and versions is not None:
        try:
            known = memo.get(model)
        except TypeError:  # (not weakly referenceable)
            known = None
        if known is not None and known[0] == versions:
            return known[1]
    names = sorted(state)
    # one digest per distinct tensor view (tied weights share it)
    views: dict[tuple[Any, ...], list[str]] = {}
    for name in names:
        t = state[name]
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"state_dict entry {name!r} is a {type(t).__name__}, not a tensor")
        if name in on_disk:
            continue
        if t.device.type == "meta":
            raise ValueError(f"parameter {name!r} is on the meta device (no data to fingerprint)")
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        views.setdefault(key, []).append(name)

    def digest_of(name: str) -> str:
        return _sha256_of(state[name], rounded)

    firsts = [group[0] for group in views.values()]
    workers = max(1, min(4, os.cpu_count() or 1, len(firsts)))
    if workers > 1:
        from concurrent.futures import ThreadPoolExecutor

        # the largest tensors first, so that the threads finish together
        order = sorted(firsts, key=lambda n: -state[n].numel() * state[n].element_size())
        with ThreadPoolExecutor(workers) as pool:
            per_first = dict(zip(order, pool.map(digest_of, order), strict=True))
    else:
        per_first = {n: digest_of(n) for n in firsts}
    per_name = {n: per_first[group[0]] for group in views.values() for n in group}
    for name in names:
        if name in on_disk:  # one at a time: bounded memory (tied names read twice)
            per_name[name] = _sha256_of(lazy.tensor(name), rounded)  # type: ignore[union-attr]
    h = hashlib.sha256()
    for name in names:
        t = state[name]
        dtype = ROUNDED_DTYPE if rounded and t.is_floating_point() else str(t.dtype).removeprefix("torch.")
        h.update(f"{name}\t{dtype}\t{list(t.shape)}\t{per_name[name]}\n".encode())
    digest = WEIGHTS_DIGEST_PREFIX + h.hexdigest()
    if versions is not None:
        with contextlib.suppress(TypeError):
            memo[model] = (versions, digest)
    return digest


def _sha256_of(t: Any, rounded: bool = False) -> str:
    """sha256 of a tensor's bytes (native byte order, row-major), copied to the CPU if it is elsewhere; ``rounded``:
    of its values rounded to :data:`ROUNDED_DTYPE` when it is floating-point."""
    import torch

    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if rounded and t.is_floating_point():
        t = t.to(getattr(torch, ROUNDED_DTYPE))
    flat = t.contiguous().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy() if flat.numel() else b"").hexdigest()


def short_digest(digest: str) -> str:
    return digest[: len(WEIGHTS_DIGEST_PREFIX) + 12]


#: Most decoder layers a profile may describe (the largest models have a few hundred): bounds what a file costs to
#: read and print.
MAX_LAYERS = 4096


def kv_shape(cfg: Any) -> tuple[int, int]:
    """``(KV heads, head_dim)`` of a transformers decoder config: ``num_key_value_heads``, or Falcon's
    ``num_kv_heads`` (its new decoder) or one head (``multi_query``), else every attention head (GPT-2, OPT,
    GPT-NeoX: multi-head attention); ``head_dim``, else ``hidden_size / num_attention_heads``."""
    heads = int(cfg.num_attention_heads)
    kv = getattr(cfg, "num_key_value_heads", None)
    if kv is None and getattr(cfg, "new_decoder_architecture", False):
        kv = getattr(cfg, "num_kv_heads", None)
    if kv is None and getattr(cfg, "multi_query", False):
        kv = 1
    return int(kv or heads), int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)


def layer_kinds(cfg: Any) -> list[str]:
    """Each decoder layer's attention kind (``"full_attention"``, ``"sliding_attention"``, ...) as transformers'
    own caches read it (``cache_utils.get_layer_types_and_kwargs``): the config's ``layer_types``, else every
    layer sliding when it has a ``sliding_window`` (Mistral, Phi-3: their attention masks slide), chunked when it has
    an ``attention_chunk_size``, full otherwise."""
    kinds = getattr(cfg, "layer_types", None)
    if kinds is not None:
        return list(kinds)
    if getattr(cfg, "sliding_window", None) is not None:
        kind = "sliding_attention"
    elif getattr(cfg, "attention_chunk_size", None) is not None:
        kind = "chunked_attention"
    else:
        kind = "full_attention"
    return [kind] * int(cfg.num_hidden_layers)


@dataclass(frozen=True)
class ModelFingerprint:
    """What identifies the model a profile belongs to: thresholds of another shape, architecture or weights are
    wrong.

    The shape fields are always compared. ``weights`` (:func:`weights_digest`) tells apart two checkpoints of
    one shape (a base model and its fine-tune); it is compared when both sides have one (:meth:`Thresholds.
    check_fingerprint`), and a profile without it (an older file) is checked on its shape only, with a warning.
    ``name`` is informational and not compared.
    """

    #: ``config.model_type`` of the decoder ("llama", "gemma3_text"): always set, unlike ``architectures``.
    architecture: str
    #: Number of decoder layers (= entries per kind in the profile).
    num_layers: int
    #: Key/value heads per layer.
    num_kv_heads: int
    #: Dimension of one head.
    head_dim: int
    #: The name the model was loaded by (not compared).
    name: str | None = field(default=None, compare=False)
    #: :func:`weights_digest` of the model, or None when unknown (compared by ``Thresholds.check_fingerprint``).
    weights: str | None = field(default=None, compare=False)
    #: :func:`rounded_weights_digest` of the model, or None (profiles made before oakenkv recorded it): lets the
    #: profile serve the same weights in another dtype (``Thresholds.check_fingerprint``). Written to a file only
    #: when set, and not part of a calibration cache key, so earlier files keep their digests and names.
    weights_bf16: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.architecture, str) or not self.architecture:
            raise ValueError(f"architecture must be a non-empty string, got {self.architecture!r}")
        for n in ("num_layers", "num_kv_heads", "head_dim"):
            v = getattr(self, n)
            if not is_int(v) or v < 1:
                raise ValueError(f"{n} must be a positive int, got {v!r}")
        if self.num_layers > MAX_LAYERS:
            raise ValueError(f"num_layers must be at most {MAX_LAYERS} (more than a model has), got {self.num_layers}")
        if self.name is not None and not isinstance(self.name, str):
            raise ValueError(f"name must be a string or None, got {self.name!r}")
        for n in ("weights", "weights_bf16"):
            v = getattr(self, n)
            if v is not None and not (isinstance(v, str) and _DIGEST_RE.fullmatch(v)):
                raise ValueError(f"{n} must be 'sha256:' and 64 lowercase hex digits, or None, got {v!r}")

    @classmethod
    def from_model_config(
        cls, hf_config: Any, name: str | None = None, weights: str | None = None, weights_bf16: str | None = None
    ) -> ModelFingerprint:
        """From a transformers ``PretrainedConfig`` (multimodal configs: their text decoder's config); the shape
        only unless the ``weights`` digests are given."""
        cfg = hf_config.get_text_config(decoder=True) if hasattr(hf_config, "get_text_config") else hf_config
        try:
            num_layers = int(cfg.num_hidden_layers)
            kv_heads, head_dim = kv_shape(cfg)
        except AttributeError as e:
            raise ValueError(f"{type(cfg).__name__} does not describe a decoder (missing {e.name})") from e
        arch = getattr(cfg, "model_type", None) or type(cfg).__name__
        return cls(str(arch), num_layers, int(kv_heads), int(head_dim), name, weights, weights_bf16)

    @classmethod
    def from_model(cls, model: Any, name: str | None = None, *, rounded: bool = False) -> ModelFingerprint:
        """From a transformers model: its config's shape and :func:`weights_digest` of its weights (and, with
        ``rounded``, :func:`rounded_weights_digest`: what a new profile records)."""
        fp = cls.from_model_config(model.config, name, weights_digest(model))
        return replace(fp, weights_bf16=rounded_weights_digest(model)) if rounded else fp

    def describe(self) -> str:
        who = f"{self.name!r}: " if self.name else ""
        weights = f", weights {short_digest(self.weights)}..." if self.weights else ""
        return (
            f"{who}{self.architecture}, {self.num_layers} layers, {self.num_kv_heads} KV heads, "
            f"head_dim {self.head_dim}{weights}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "architecture": self.architecture,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "name": self.name,
            "weights": self.weights,
            **({"weights_bf16": self.weights_bf16} if self.weights_bf16 is not None else {}),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelFingerprint:
        return cls(
            d["architecture"],
            d["num_layers"],
            d["num_kv_heads"],
            d["head_dim"],
            d.get("name"),
            d.get("weights"),
            d.get("weights_bf16"),
        )
