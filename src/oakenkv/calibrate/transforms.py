"""Offline transforms of the ``oaken-plus`` preset: what the model's weights and the cache do to keys and values
before Oaken's per-token quantizer sees them, so that it sees well-behaved vectors.

Every transform here leaves the model's full-precision outputs unchanged (exactly, or up to float rounding), and
costs nothing or next to nothing per token online:

=====================  ==========================================================  ===============================
transform              what it does                                                where it lives
=====================  ==========================================================  ===============================
``value_rotation``     each value head ``v -> H v`` (H: the normalised Sylvester    folded: ``v_proj`` rows (and
                       Hadamard matrix, orthogonal and symmetric); attention is     bias) and ``o_proj`` columns,
                       linear in V, so ``o_proj`` undoes it. Spreads a value        once, at load. Zero online cost.
                       channel's outliers over the head.
``key_scale``          keys divided per channel by ``lam`` (SmoothAttention),       folded: ``k_proj`` (and bias) or
                       queries multiplied by it, so every score ``q . k`` is        ``k_norm``; ``q_proj`` or
                       unchanged; ``lam`` is tied over each RoPE pair (read off     ``q_norm``. Zero online cost.
                       the model's own rotary code) so it commutes with RoPE.
``key_shift``          a fixed post-RoPE vector ``mu`` subtracted from every key    online: one subtraction per
                       of a layer: every score of one query moves by the same       key row before encoding; the
                       ``q . mu``, which softmax ignores. Removes the per-channel    attention never adds it back.
                       offset (a key bias, a constant-sign channel) that makes one
                       token's range wide.
``key_rotation``       each key head ``k -> H k`` after RoPE and the query the      online: one ``hd x hd`` product
                       same, so ``q . k`` is unchanged. Spreads outlier channels.   per key row and per query head.
=====================  ==========================================================  ===============================

and one policy of the cache, ``sink_tokens``: the first ``n`` tokens of every sequence (the attention sink, whose
key is far from the others and which most queries attend to) are kept at 16 bits beside their Oaken codes, and
every attention reads them from there (``oakenkv.store.paged``). Not a transform (it changes what is stored, by
``16 n`` bits per value of a sequence: ~0.008 bit per value at 2048 tokens and ``n = 1``, counted in the bits), but
part of the profile, because the thresholds and the per-layer choices were made with it.

A fused projection (Phi-3's ``qkv_proj``, GPT-NeoX's and Falcon's ``query_key_value``, GPT-2's ``c_attn``) takes each
fold in its query, key or value rows (:func:`projection`); per-head q/k norm weights take per-head key scales, a
weight every head shares one set (:func:`norm_heads`); without RoPE every channel is its own pair.

Order on a key (post-RoPE, as the cache receives it): ``H ((k - mu))`` where ``k`` already carries the folded
``1 / lam``; the shift is subtracted before the rotation. Values carry their rotation from the weights.

:class:`Transforms` is the per-layer record, saved inside the profile file (``oakenkv.calibrate.thresholds``, schema 2)
next to the thresholds that were profiled on the transformed vectors; :func:`fold_into_model` applies the weight part
once (a second application is refused), and the cache applies the online part (``oakenkv.store.paged``).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import numpy as np
import torch

from oakenkv.format.config import MAX_SINK_TOKENS, valid_sink_tokens
from oakenkv.quant.groups import FLOAT32_MAX
from oakenkv.util.exact import is_int, is_number, one_of

#: Version of the serialized transforms; bump when a field changes meaning. Version 2 adds ``sink_tokens``; a
#: record without sink tokens is still written as version 1 (same bytes and digest as before), so that an older
#: oakenkv refuses only the profiles it would misread.
TRANSFORMS_VERSION = 2
_READS_VERSIONS = (1, 2)
#: Name of the attribute on the model's config that records the folded transforms (their digest).
FOLD_MARK = "oakenkv_transforms"


class TransformError(ValueError):
    """Transforms that cannot be applied to this model (wrong shape, applied twice, unsupported architecture)."""


@cache
def _hadamard_np(n: int) -> np.ndarray:
    h = np.ones((1, 1), dtype=np.float64)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / math.sqrt(n)


def hadamard(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The normalised Sylvester Hadamard matrix of order ``n`` (a power of two): orthogonal and symmetric, so it is
    its own inverse."""
    if n < 1 or n & (n - 1):
        raise TransformError(f"a Hadamard rotation needs a power-of-two head_dim, got {n}")
    return torch.from_numpy(_hadamard_np(n)).to(dtype)


def fwht(x: np.ndarray) -> np.ndarray:
    """``x @ hadamard(n)`` over the last axis (``n`` a power of two) as a fast Walsh-Hadamard transform, in float32
    (a new array). The butterflies run in a fixed order (``oakenkv.kernels.cpu.rotate``), so every caller (the cache,
    the evaluation, the profiler) gets the same bits whatever the batch shape, unlike a BLAS matrix product."""
    from oakenkv.kernels.cpu.rotate import shift_rotate_rows

    # a C-ordered copy: numpy's default copy keeps a strided input's layout, and the reshape below would then be a
    # temporary copy whose rotation is lost (a permuted [B, H, S, hd] view came back unrotated)
    x = np.array(x, dtype=np.float32, order="C")
    n = x.shape[-1]
    if n < 1 or n & (n - 1):
        raise TransformError(f"a Hadamard rotation needs a power-of-two size, got {n}")
    shift_rotate_rows(x.reshape(-1, n), _NO_SHIFT, True, n, np.float32(1.0 / math.sqrt(n)))
    return x


_NO_SHIFT = np.zeros(0, dtype=np.float32)


def _notes(notes: Any) -> dict[str, Any]:
    if notes is None:
        return {}
    if not isinstance(notes, dict):
        raise TransformError(f"transforms notes must be an object, got {type(notes).__name__}")
    return dict(notes)


def _floats(name: str, values: Any, n: int) -> tuple[float, ...] | None:
    if values is None:
        return None
    raw = values.tolist() if hasattr(values, "tolist") else values
    if isinstance(raw, (str, bytes)) or not all(is_number(v) for v in raw):  # (no strings or booleans from a file)
        raise TransformError(f"{name} must be a list of numbers")
    t = tuple(float(v) for v in raw)
    if len(t) != n:
        raise TransformError(f"{name} must hold {n} values, got {len(t)}")
    if not all(math.isfinite(v) and abs(v) <= FLOAT32_MAX for v in t):  # (applied in float32: 1e39 is inf there)
        raise TransformError(f"{name} holds NaN, infinite or beyond-float32 values")
    return t


@dataclass(frozen=True)
class LayerTransforms:
    """The transforms of one decoder layer (module doc). Vectors are flat over ``num_kv_heads * head_dim``."""

    #: Post-RoPE vector subtracted from every key row before encoding (online), or None.
    key_shift: tuple[float, ...] | None = None
    #: Per-channel key divisor folded into the weights (queries multiplied by it), or None. Positive.
    key_scale: tuple[float, ...] | None = None
    #: Per-head Hadamard rotation of keys and queries after RoPE (online).
    key_rotation: bool = False
    #: Per-head Hadamard rotation of values (folded into ``v_proj`` / ``o_proj``).
    value_rotation: bool = False

    @property
    def is_identity(self) -> bool:
        return self.key_shift is None and self.key_scale is None and not self.key_rotation and not self.value_rotation

    def to_dict(self) -> dict[str, Any]:
        return {
            "key_shift": None if self.key_shift is None else list(self.key_shift),
            "key_scale": None if self.key_scale is None else list(self.key_scale),
            "key_rotation": self.key_rotation,
            "value_rotation": self.value_rotation,
        }


@dataclass(frozen=True)
class Transforms:
    """Per-layer transforms of one model (module doc); validated on construction."""

    layers: tuple[LayerTransforms, ...]
    num_kv_heads: int
    head_dim: int
    #: Free-form JSON-able notes (how each layer's transforms were chosen).
    notes: dict[str, Any] = field(default_factory=dict, compare=False)
    #: The first tokens of every sequence kept at 16 bits beside their codes (module doc); 0: none.
    sink_tokens: int = 0

    def __post_init__(self) -> None:
        d = self.num_kv_heads * self.head_dim
        if not valid_sink_tokens(self.sink_tokens):
            raise TransformError(f"sink_tokens must be an int in [0, {MAX_SINK_TOKENS}], got {self.sink_tokens!r}")
        if not isinstance(self.notes, dict):
            raise TransformError(f"notes must be a dict, got {type(self.notes).__name__}")
        object.__setattr__(self, "layers", tuple(self.layers))
        for i, lt in enumerate(self.layers):
            if not isinstance(lt, LayerTransforms):
                raise TransformError(f"layer {i}: expected LayerTransforms, got {type(lt).__name__}")
            _floats(f"layer {i} key_shift", lt.key_shift, d)
            s = _floats(f"layer {i} key_scale", lt.key_scale, d)
            if s is not None and min(s) <= 0:
                raise TransformError(f"layer {i} key_scale must be positive")
            if (lt.key_rotation or lt.value_rotation) and self.head_dim & (self.head_dim - 1):
                raise TransformError(f"layer {i}: Hadamard rotations need a power-of-two head_dim, got {self.head_dim}")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def zero_key_bound(self) -> float:
        """A bound on the largest magnitude the online key transform gives a key of zeros, over every layer: its
        shift, rotated (an orthonormal rotation keeps each value within its head's norm). A profile whose bound
        exceeds what its scales can hold cannot encode any key (checked by ``Thresholds``)."""
        worst = 0.0
        for lt in self.layers:
            if lt.key_shift is None:
                continue
            s = np.abs(np.asarray(lt.key_shift, dtype=np.float64)).reshape(self.num_kv_heads, self.head_dim)
            worst = max(worst, float(np.sqrt((s**2).sum(axis=1)).max() if lt.key_rotation else s.max()))
        return worst

    @property
    def dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def folds_weights(self) -> bool:
        """Whether some part must be folded into the model's weights (:func:`fold_into_model`)."""
        return any(lt.key_scale is not None or lt.value_rotation for lt in self.layers)

    @property
    def online_keys(self) -> bool:
        """Whether the cache transforms key rows itself (a shift or a rotation in some layer)."""
        return any(lt.key_shift is not None or lt.key_rotation for lt in self.layers)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "version": TRANSFORMS_VERSION if self.sink_tokens else 1,
            "rotation": "hadamard-sylvester",
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "layers": [{"index": i, **lt.to_dict()} for i, lt in enumerate(self.layers)],
            "notes": self.notes,
        }
        if self.sink_tokens:
            d["sink_tokens"] = self.sink_tokens
        return d

    @classmethod
    def from_dict(cls, d: Any) -> Transforms:
        if not isinstance(d, dict):
            raise TransformError(f"transforms must be an object, got {type(d).__name__}")
        version = d.get("version")
        if not one_of(version, _READS_VERSIONS):
            known = ", ".join(map(str, _READS_VERSIONS))
            raise TransformError(f"unsupported transforms version {version!r} (this oakenkv reads {known})")
        if version == 1 and "sink_tokens" in d:
            raise TransformError("transforms version 1 cannot hold sink_tokens")
        if d.get("rotation") != "hadamard-sylvester":
            raise TransformError(f"unknown rotation {d.get('rotation')!r}")
        for k in ("num_kv_heads", "head_dim"):
            if not is_int(d.get(k)) or d[k] < 1:
                raise TransformError(f"transforms {k} must be a positive int, got {d.get(k)!r}")
        if not isinstance(d["layers"], list):
            raise TransformError("transforms layers must be a list")
        layers = []
        for pos, e in enumerate(d["layers"]):
            if not isinstance(e, dict):
                raise TransformError(f"transforms layer entry {pos} must be an object")
            if not one_of(e.get("index"), (pos,)):
                raise TransformError(f"transforms layer entry {pos} has index {e.get('index')!r}")
            for k in ("key_rotation", "value_rotation"):
                if not isinstance(e[k], bool):
                    raise TransformError(f"transforms layer {pos}: {k} must be true or false")
            layers.append(
                LayerTransforms(
                    key_shift=None if e["key_shift"] is None else tuple(e["key_shift"]),
                    key_scale=None if e["key_scale"] is None else tuple(e["key_scale"]),
                    key_rotation=e["key_rotation"],
                    value_rotation=e["value_rotation"],
                )
            )
        return cls(
            tuple(layers),
            d["num_kv_heads"],
            d["head_dim"],
            _notes(d.get("notes")),
            d.get("sink_tokens", 0),
        )

    def digest(self) -> str:
        """sha256 of the transforms (notes excluded): what a folded model is marked with."""
        body = {k: v for k, v in self.to_dict().items() if k != "notes"}
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()

    # ------------------------------------------------------------------------------------- online parts

    def key_shifts(self) -> np.ndarray:
        """float32 ``[L, D]``: each layer's key shift (zeros where it has none)."""
        shift = np.zeros((self.num_layers, self.dim), dtype=np.float32)
        for i, lt in enumerate(self.layers):
            if lt.key_shift is not None:
                shift[i] = lt.key_shift
        return shift

    def key_rows(self, layer: int, rows: np.ndarray, shift: np.ndarray | None = None, out: np.ndarray | None = None):
        """The online key transform of ``layer`` on float32 key rows ``[N, D]`` (one token's KV heads per row, the
        cache's layout): the shift, then the per-head rotation. The one definition every path uses (the cache, the
        evaluation, the profiler), so they all quantize the same bits. Writes into ``out`` (may be ``rows``
        itself; default a new array) and returns it. ``shift``: the layer's row of :meth:`key_shifts`, when the
        caller keeps one."""
        from oakenkv.kernels.cpu.rotate import shift_rotate_rows

        lt = self.layers[layer]
        if out is None:
            out = np.array(rows, dtype=np.float32)
        elif out is not rows:
            out[:] = rows
        if lt.key_shift is not None and shift is None:
            shift = np.asarray(lt.key_shift, dtype=np.float32)
        shift = shift if lt.key_shift is not None else _NO_SHIFT
        scale = np.float32(1.0 / math.sqrt(self.head_dim))
        shift_rotate_rows(out, shift, lt.key_rotation, self.head_dim, scale)
        return out

    def keys_forward(self, layer: int, k: torch.Tensor) -> torch.Tensor:
        """:meth:`key_rows` on keys ``[B, H, S, hd]`` (float32 out, same layout)."""
        b, h, s, hd = k.shape
        rows = k.detach().to(torch.float32).permute(0, 2, 1, 3).reshape(b * s, h * hd).numpy()
        out = torch.from_numpy(self.key_rows(layer, rows))
        return out.reshape(b, s, h, hd).permute(0, 2, 1, 3)

    def keys_restore(self, layer: int, k: torch.Tensor) -> torch.Tensor:
        """Undo the rotation of :meth:`key_rows` (not the shift, which softmax ignores) on keys ``[..., hd]``:
        what stock attention must see next to the model's own queries. Same dtype out."""
        if not self.layers[layer].key_rotation:
            return k
        return torch.from_numpy(fwht(k.detach().to(torch.float32).numpy())).to(k.dtype)


# ----------------------------------------------------------------------------------------------- the model side


_QKV = ("q_proj", "k_proj", "v_proj")


def _neox(m: Any) -> bool:
    """GPT-NeoX's attention (``query_key_value`` laid out per head, ``dense``); Falcon's module of the same names
    lays its heads out otherwise (:func:`_falcon`)."""
    return "NeoX" in type(m).__name__ and hasattr(m, "query_key_value") and hasattr(m, "dense")


def _falcon(m: Any) -> bool:
    """Falcon's attention (``query_key_value`` in one of three layouts, :func:`projection`; ``dense``)."""
    return "Falcon" in type(m).__name__ and hasattr(m, "query_key_value") and hasattr(m, "dense")


def _gpt2(m: Any) -> bool:
    """GPT-2's self-attention (``c_attn`` ``[q | k | v]`` and ``c_proj``, ``Conv1D`` layers: weights ``[in, out]``)."""
    return "GPT2" in type(m).__name__ and hasattr(m, "c_attn") and not getattr(m, "is_cross_attention", False)


def _is_attention(m: Any) -> bool:
    if not hasattr(m, "layer_idx"):
        return False
    if _neox(m) or _gpt2(m) or _falcon(m):
        return True
    outs = hasattr(m, "o_proj") or hasattr(m, "out_proj")
    return outs and (hasattr(m, "qkv_proj") or all(hasattr(m, p) for p in _QKV))


def attention_modules(model: Any) -> list[Any]:
    """The decoder's attention modules in layer order (modules with ``layer_idx``, an output projection and q/k/v
    projections: separate, or fused as Phi-3's ``qkv_proj``, GPT-NeoX's ``query_key_value`` and GPT-2's ``c_attn``)."""
    mods = [m for m in model.modules() if _is_attention(m)]
    mods.sort(key=lambda m: m.layer_idx)
    n = int(model.config.get_text_config(decoder=True).num_hidden_layers)
    if len(mods) != n or [m.layer_idx for m in mods] != list(range(n)):
        raise TransformError(
            f"found {len(mods)} attention modules with q/k/v/o projections for {n} layers in "
            f"{type(model).__name__}; oaken-plus transforms support Llama-style attention (Llama, Qwen2, Gemma 3, "
            "...); the paper's preset='oaken' needs no transforms and runs on it"
        )
    return mods


def head_dim(m: Any) -> int:
    """The head size of attention module ``m`` (``head_dim``; GPT-NeoX's ``head_size``)."""
    hd = getattr(m, "head_dim", None) or getattr(m, "head_size", None)
    if hd is None:
        raise TransformError(f"{type(m).__name__} has no head_dim")
    return int(hd)


def out_projection(m: Any) -> Any:
    """The output projection of attention module ``m`` (``o_proj``; OPT's ``out_proj``, GPT-NeoX's ``dense``,
    GPT-2's ``c_proj``)."""
    for name in ("o_proj", "out_proj"):
        if hasattr(m, name):
            return getattr(m, name)
    return m.c_proj if _gpt2(m) else m.dense


def _conv1d(layer: Any) -> bool:
    """Whether ``layer`` is transformers' ``Conv1D`` (GPT-2): ``y = x W + b``, ``W`` ``[in, out]``."""
    return type(layer).__name__ == "Conv1D"


def _out_rows(layer: Any) -> torch.Tensor:
    """``layer``'s weight as ``[out, in]`` (a view: a ``Conv1D``'s transposed)."""
    return layer.weight.T if _conv1d(layer) else layer.weight


def projection(m: Any, which: str, hd: int) -> tuple[Any, torch.Tensor]:
    """``(linear, rows)``: where attention module ``m`` computes its queries (``"q"``), keys (``"k"``) or values
    (``"v"``), as the output rows (int64) of a linear layer: a projection of its own (``q_proj``...); a slice of
    a fused ``qkv_proj`` laid out ``[q | k | v]`` (Phi-3: ``Hq + 2 H`` heads of ``hd``, ``Hq = H x
    num_key_value_groups``; GPT-2's ``Conv1D`` ``c_attn``, multi-head, whose rows are its weight's columns:
    :func:`_out_rows`); or every head's share of GPT-NeoX's ``query_key_value``, laid out ``[head][q | k | v][hd]``
    (multi-head), or of Falcon's (:func:`_falcon_rows`: three layouts)."""
    own = getattr(m, f"{which}_proj", None)
    if own is not None:
        return own, torch.arange(int(own.out_features))
    part = {"q": 0, "k": 1, "v": 2}[which]
    if _gpt2(m):  # c_attn: [q | k | v], multi-head
        e = int(m.c_attn.nf) // 3
        return m.c_attn, torch.arange(part * e, (part + 1) * e)
    fused = getattr(m, "qkv_proj", None)
    if fused is not None:
        group = int(getattr(m, "num_key_value_groups", 0) or 0)
        total = int(fused.out_features)
        if group < 1 or total % (hd * (group + 2)):
            raise TransformError(
                f"{type(m).__name__}.qkv_proj has {total} outputs, not [q | k | v] heads of {hd} with {group} query "
                "heads per KV head"
            )
        kv = total // (hd * (group + 2)) * hd
        first, n = (0, kv * group) if part == 0 else (kv * group + (part - 1) * kv, kv)
        return fused, torch.arange(first, first + n)
    fused = m.query_key_value
    total = int(fused.out_features)
    if _falcon(m):
        return fused, _falcon_rows(m, part, hd, total)
    if total % (3 * hd):
        raise TransformError(f"{type(m).__name__}.query_key_value has {total} outputs, not [head][q | k | v] of {hd}")
    heads = torch.arange(total // (3 * hd))[:, None] * (3 * hd)
    return fused, (heads + part * hd + torch.arange(hd)).reshape(-1)


def _falcon_rows(m: Any, part: int, hd: int, total: int) -> torch.Tensor:
    """The rows of Falcon's ``query_key_value`` holding its queries (``part`` 0, in query-head order), keys (1) or
    values (2): ``new_decoder_architecture``: per KV head its ``G`` query heads, then its key and value
    (``[H][G + 2][hd]``); ``multi_query``: ``[q (Hq heads) | k | v]``; otherwise per head ``[q | k | v]``, as
    GPT-NeoX (``modeling_falcon.FalconAttention.forward``)."""
    hq = int(m.num_heads)
    h = int(m.num_kv_heads)
    g = hq // h
    cols = torch.arange(hd)
    if getattr(m, "new_decoder_architecture", False):
        rows = torch.arange(h)[:, None] * ((g + 2) * hd)  # each KV head's first row
        if part == 0:
            rows = (rows[:, :, None] + torch.arange(g)[None, :, None] * hd + cols).reshape(-1)
        else:
            rows = (rows + (g + part - 1) * hd + cols).reshape(-1)
        want = h * (g + 2) * hd
    elif getattr(m, "multi_query", False):
        rows = torch.arange(hq * hd) if part == 0 else (hq + part - 1) * hd + cols
        want = (hq + 2) * hd
    else:
        rows = (torch.arange(hq)[:, None] * (3 * hd) + part * hd + cols).reshape(-1)
        want = 3 * hq * hd
    if total != want:
        raise TransformError(f"{type(m).__name__}.query_key_value has {total} outputs, its layout needs {want}")
    return rows


def rope_partners(model: Any) -> np.ndarray:
    """For each of the ``head_dim`` channels, the channel RoPE rotates it with, read off the model's own
    ``apply_rotary_pos_emb`` (transformers' Llama-style models pair ``i`` with ``i + hd / 2``; GPT-J-style code
    pairs neighbours); each channel its own for a model without RoPE (GPT-2). Raises :class:`TransformError` when
    the pairing cannot be established."""
    from oakenkv.calibrate.rope import has_rope

    attn = attention_modules(model)[0]
    if not has_rope(model):
        return np.arange(head_dim(attn))
    apply = getattr(sys.modules[type(attn).__module__], "apply_rotary_pos_emb", None)
    decoder = getattr(model, "model", None) or model.base_model
    rotary = getattr(decoder, "rotary_emb", None)
    if apply is None or rotary is None:
        raise TransformError(f"{type(model).__name__}: no apply_rotary_pos_emb / rotary_emb to read RoPE pairs from")
    hd = head_dim(attn)
    eye = torch.eye(hd, dtype=torch.float32)[None, :, None, :]  # [1, hd (as heads), 1, hd]
    kwargs = {}
    cfg = model.config.get_text_config(decoder=True)
    if "layer_type" in inspect.signature(rotary.forward).parameters and getattr(cfg, "layer_types", None):
        kwargs["layer_type"] = cfg.layer_types[0]
    pos = torch.tensor([[3]])
    with torch.no_grad():
        cos, sin = rotary(eye[:, :1, 0, :], pos, **kwargs)  # the first argument only gives dtype and device
        cos, sin = cos.to(torch.float32), sin.to(torch.float32)
        if cos.shape[-1] != hd:
            raise TransformError(f"partial rotary embedding ({cos.shape[-1]} of {hd} dims) is not supported")
        out, _ = apply(eye, eye, cos, sin)
    mix = out[0, :, 0, :].abs() > 1e-6  # [hd, hd]: row i = channels e_i reaches
    partners = np.full(hd, -1, dtype=np.int64)
    for i in range(hd):
        others = [j for j in torch.nonzero(mix[i]).flatten().tolist() if j != i]
        if len(others) != 1:
            raise TransformError(f"RoPE mixes channel {i} with {others}: not a rotation of channel pairs")
        partners[i] = others[0]
    if not (partners[partners] == np.arange(hd)).all():
        raise TransformError("RoPE channel pairing is not symmetric")
    return partners


def tie_rope_pairs(scale: torch.Tensor, partners: np.ndarray) -> torch.Tensor:
    """``scale [..., hd]`` with each RoPE pair given the larger of its two values (so it commutes with RoPE)."""
    return torch.maximum(scale, scale[..., torch.from_numpy(partners)])


def is_folded(model: Any) -> str | None:
    """The digest of the transforms folded into ``model``, or None."""
    return getattr(model.config, FOLD_MARK, None)


def fold_into_model(model: Any, transforms: Transforms) -> None:
    """Fold the weight part of ``transforms`` (value rotations, key scales) into ``model`` in place and mark it.

    Refused (:class:`TransformError`) when the model already carries folded transforms, or its shape differs.
    Models with a q/k norm take key scales in the norm weights, following each family's convention (Gemma's norm
    multiplies by ``1 + w``; :func:`norm_heads` has the weight shapes taken): a norm whose weight every head shares
    (Gemma 3, Qwen 3) needs the same scales for every KV head. Everything is checked before the first weight
    changes, so a refused fold leaves the model as it was.
    """
    done = is_folded(model)
    if done is not None:
        raise TransformError(
            "this model already carries folded oaken-plus transforms "
            f"({'the same ones' if done == transforms.digest() else 'different ones'}); load a fresh copy to fold again"
        )
    mods = attention_modules(model)
    if len(mods) != transforms.num_layers:
        raise TransformError(f"transforms hold {transforms.num_layers} layers, the model has {len(mods)}")
    h, hd = transforms.num_kv_heads, transforms.head_dim
    plans = []
    for i, (m, lt) in enumerate(zip(mods, transforms.layers, strict=True)):
        if head_dim(m) != hd or len(projection(m, "k", hd)[1]) != h * hd:
            raise TransformError(f"layer {i}: the model's KV shape differs from the transforms' ({h} x {hd})")
        if hasattr(m, "v_norm") and lt.value_rotation:
            raise TransformError(f"layer {i}: a value norm does not commute with a value rotation")
        reads = _out_rows(out_projection(m)).shape[1]
        if lt.value_rotation and reads % hd:
            raise TransformError(f"layer {i}: the output projection reads {reads} values, not whole heads of {hd}")
        group = len(projection(m, "q", hd)[1]) // (h * hd)
        scale = None
        if lt.key_scale is not None:
            lam = torch.tensor(lt.key_scale, dtype=torch.float64).reshape(h, hd)
            try:
                scale = _key_scale_plan(m, lam, group)
            except TransformError as e:
                raise TransformError(f"layer {i}: {e}") from None
        plans.append((m, lt, group, scale))
    with torch.no_grad():
        for m, lt, group, scale in plans:
            if lt.value_rotation:
                _rotate_values(m, h, hd, group)
            for target, factor, kind in scale or ():
                _scale_weight(target, factor, kind)
    setattr(model.config, FOLD_MARK, transforms.digest())


def _rotate_values(m: Any, h: int, hd: int, group: int) -> None:
    had = hadamard(hd, torch.float64)
    proj, rows = projection(m, "v", hd)
    weight = _out_rows(proj)
    w = weight[rows]  # [h * hd, hidden]: the value rows (a copy: fused projections interleave them)
    weight[rows] = (had @ w.double().reshape(h, hd, -1)).reshape_as(w).to(w.dtype)
    if proj.bias is not None:
        b = proj.bias[rows]
        proj.bias[rows] = (b.double().reshape(h, hd) @ had).reshape_as(b).to(b.dtype)  # H symmetric: H b = b H
    wo = _out_rows(out_projection(m))  # [hidden, hq * hd]; query head j reads value head j // group
    hq = h * group
    wo.copy_((wo.double().reshape(-1, hq, hd) @ had).reshape_as(wo).to(wo.dtype))


def _key_scale_plan(m: Any, lam: torch.Tensor, group: int) -> list[tuple[Any, torch.Tensor, str]]:
    """What folding keys / lam, queries * lam (lam ``[h, hd]`` float64, RoPE-pair tied) changes, checked before
    anything changes: ``(target, factor, kind)`` per target, ``kind`` ``"proj"`` (a projection's output rows,
    ``target`` :func:`projection`'s pair, ``factor [heads, hd]``), ``"norm"`` or ``"norm+1"`` (a norm's weight,
    ``factor`` shaped like it; ``+1``: the norm multiplies by ``1 + w``)."""
    hd = lam.shape[1]
    q_lam = lam.repeat_interleave(group, dim=0)  # [hq, hd]
    plan = []
    for which, norm_name, factor in (("k", "k_norm", 1.0 / lam), ("q", "q_norm", q_lam)):
        norm = getattr(m, norm_name, None)
        if norm is None:
            plan.append((projection(m, which, hd), factor, "proj"))
            continue
        heads = norm_heads(norm, factor.shape[0], hd)
        if heads == 1:
            if not torch.allclose(factor, factor[:1].expand_as(factor)):
                raise TransformError(f"{norm_name} is shared by the heads: key scales must be equal across heads")
            factor = factor[0]
        plan.append((norm, factor.reshape(norm.weight.shape), "norm+1" if _norm_adds_one(norm) else "norm"))
    return plan


def norm_heads(norm: Any, heads: int, hd: int) -> int:
    """How many heads a q/k norm's weight covers: 1 (one ``[hd]`` weight every head shares: Qwen 3, Gemma 3) or
    ``heads`` (a weight per head: ``[heads * hd]`` over the whole projection, OLMo 2; ``[heads, hd]``, Cohere).
    Raises :class:`TransformError` for any other weight."""
    w = getattr(norm, "weight", None)
    if not isinstance(w, torch.Tensor):
        raise TransformError(f"{type(norm).__name__} has no weight to take key scales")
    if w.numel() == hd:
        return 1
    if w.numel() == heads * hd and w.shape[-1] in (hd, heads * hd):
        return heads
    raise TransformError(
        f"{type(norm).__name__}'s weight {tuple(w.shape)} fits neither one head ({hd}) nor {heads} heads of {hd}"
    )


def _scale_weight(target: Any, factor: torch.Tensor, kind: str) -> None:
    """Multiply what ``target`` outputs by ``factor`` (:func:`_key_scale_plan`)."""
    if kind == "proj":
        proj, rows = target  # (:func:`projection`)
        hd = factor.shape[-1]
        weight = _out_rows(proj)
        w = weight[rows]  # [heads * hd, hidden]
        weight[rows] = (w.double().reshape(-1, hd, w.shape[1]) * factor[..., None]).reshape_as(w).to(w.dtype)
        if proj.bias is not None:
            b = proj.bias[rows]
            proj.bias[rows] = (b.double().reshape(-1, hd) * factor).reshape_as(b).to(b.dtype)
        return
    w = target.weight
    if kind == "norm+1":
        w.copy_(((1.0 + w.double()) * factor - 1.0).to(w.dtype))
    else:
        w.copy_((w.double() * factor).to(w.dtype))
    b = getattr(target, "bias", None)
    if isinstance(b, torch.Tensor):
        b.copy_((b.double() * factor).to(b.dtype))


def _norm_adds_one(norm: Any) -> bool:
    """Whether a norm multiplies by ``1 + weight`` (Gemma's convention) instead of ``weight``: checked on the
    module itself, not by its name (with its weight and bias zeroed, a plain norm outputs zeros). The weight and
    bias are restored whatever the call raises."""
    w = norm.weight
    b = getattr(norm, "bias", None)
    b = b if isinstance(b, torch.Tensor) else None
    x = torch.randn((2, *w.shape), generator=torch.Generator().manual_seed(0)).to(w.dtype)
    with torch.no_grad():
        saved = w.detach().clone(), None if b is None else b.detach().clone()
        try:
            w.zero_()
            if b is not None:
                b.zero_()
            y = norm(x).float()
        except Exception as e:
            shape = ", ".join(map(str, (2, *w.shape)))
            raise TransformError(f"cannot run {type(norm).__name__} on a [{shape}] probe: {e}") from e
        finally:
            w.copy_(saved[0])
            if b is not None:
                b.copy_(saved[1])
    return not bool(torch.allclose(y, torch.zeros_like(y), atol=1e-6))


def check_transforms_shape(transforms: Transforms, num_layers: int, num_kv_heads: int, head_dim: int) -> None:
    if (transforms.num_layers, transforms.num_kv_heads, transforms.head_dim) != (num_layers, num_kv_heads, head_dim):
        raise TransformError(
            f"transforms are for {transforms.num_layers} layers x {transforms.num_kv_heads} KV heads x "
            f"{transforms.head_dim}, the model has {num_layers} x {num_kv_heads} x {head_dim}"
        )


def identity(num_layers: int, num_kv_heads: int, head_dim: int) -> Transforms:
    return Transforms(tuple(LayerTransforms() for _ in range(num_layers)), num_kv_heads, head_dim)


__all__: Sequence[str] = [
    "FOLD_MARK",
    "TRANSFORMS_VERSION",
    "LayerTransforms",
    "TransformError",
    "Transforms",
    "attention_modules",
    "check_transforms_shape",
    "fold_into_model",
    "hadamard",
    "identity",
    "is_folded",
    "rope_partners",
    "tie_rope_pairs",
]
