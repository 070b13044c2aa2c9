"""Recording what a model's attention layers receive on calibration windows: the offline profilers' input.

What is recorded
----------------
Exactly the tensors the cache will store: a :class:`KVRecorder` (a ``transformers.DynamicCache`` subclass) sees the
``key_states`` / ``value_states`` ``[B, H, S, D]`` that every attention layer hands to ``cache.update``. For Llama-style
models those keys are post-RoPE (``OakenConfig.key_position == "post_rope"``, the default). For ``"pre_rope"`` (what
the official harness quantizes) the recorder rotates the keys back: a forward pre-hook on every attention module
captures the ``position_embeddings`` ``(cos, sin)`` it is called with, and ``k = k_rot * cos - rotate_half(k_rot) *
sin`` inverts ``k_rot = k * cos + rotate_half(k) * sin`` exactly up to float rounding (RoPE rotates each pair of
dimensions by an angle; the inverse rotates by minus that angle). This is more faithful than hooking ``k_proj``
because models with a key norm (Gemma 3, Qwen 3) apply it between ``k_proj`` and RoPE. Values have no RoPE.

What the oaken-plus search records
----------------------------------
The queries, keys and values every attention layer receives (post-RoPE keys, as the cache receives them), through
a recording attention function registered in transformers' ``AttentionInterface`` that calls SDPA unchanged.
:func:`record_attention` keeps every layer of every window (:class:`AttentionRecord`): one prefill per window, but
all layers' keys and values at once (about 9.6 GB for a 1.5B-parameter model at 16 x 2048 tokens).
:func:`stream_attention` yields the same tensors one layer at a time (:class:`LayerRecord`), so memory holds one
layer's recording and the hidden states between layers, never every layer's:

1. per window, the model runs up to its first decoder layer; stand-ins for the decoder layers record the
   arguments each layer is called with (the attention masks and RoPE tables, which do not depend on the hidden
   states) and the last one stops the pass, so neither the decoder layers nor the LM head run;
2. then layer by layer, every window's hidden states go through the real layer (with the recorded arguments and a
   fresh cache, as in a prefill), which records that layer's attention inputs and leaves the next layer's hidden
   states in place of its own.

Every layer thus runs once per window on the inputs it has in a whole forward pass, so the recorded tensors are
the same bits (``tests/test_recording.py``), and the decoder layers cost one forward pass in all. That holds for
a model whose forward only passes the hidden states from one decoder layer to the next; :func:`stream_attention`
checks it on a few tokens against a whole forward pass and raises :class:`StreamingUnsupported` when it does not
hold (or the stand-ins see the layers called otherwise than once each, in order); the caller then records all
layers at once.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from oakenkv.assets.lazy import execution_device
from oakenkv.calibrate.identity import layer_kinds
from oakenkv.calibrate.rope import has_rope, rotate_half
from oakenkv.calibrate.transforms import TransformError, attention_modules, head_dim, norm_heads, projection
from oakenkv.util.compat import cache_kwargs
from oakenkv.util.resources import release_free_memory

if TYPE_CHECKING:
    from transformers import DynamicCache

__all__ = [
    "CHECK_TOKENS",
    "AttentionRecord",
    "KVRecorder",
    "LayerRecord",
    "StreamingUnsupported",
    "decoder_layers",
    "record_attention",
    "record_kv",
    "stream_attention",
]

# ---------------------------------------------------------------------------------------------- the cache's K/V


@functools.cache
def _cache_class() -> type[DynamicCache]:
    from transformers import DynamicCache

    class _Recorder(DynamicCache):
        """A DynamicCache that also hands every layer's new key/value states to a callback."""

        def __init__(self, sink: Callable[[int, torch.Tensor, torch.Tensor], None], **kw: Any) -> None:
            super().__init__(**kw)
            self._sink = sink

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            self._sink(layer_idx, key_states, value_states)
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    return _Recorder


class KVRecorder:
    """Runs a transformers causal LM and returns, per decoder layer, the keys and values its cache would store.

    Keys are post-RoPE (what ``cache.update`` receives) or, with ``key_position="pre_rope"``, rotated back to
    pre-RoPE (see the module doc). Use as a context manager so the attention pre-hooks are removed afterwards.
    """

    def __init__(self, model: Any, key_position: Literal["post_rope", "pre_rope"] = "post_rope") -> None:
        if key_position not in ("post_rope", "pre_rope"):
            raise ValueError(f"key_position must be 'post_rope' or 'pre_rope', got {key_position!r}")
        self.model = model
        self.key_position = key_position
        self.num_layers = int(model.config.get_text_config(decoder=True).num_hidden_layers)
        self._rope: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._hooks: list[Any] = []
        self._keys: list[torch.Tensor | None] = []
        self._values: list[torch.Tensor | None] = []
        #: Whether the model applies no rotary embedding (GPT-2, OPT): its cached keys are already pre-RoPE.
        self.no_rope = not has_rope(model)
        if key_position == "pre_rope" and not self.no_rope:
            attn = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "k_proj")]
            if len(attn) != self.num_layers:
                raise NotImplementedError(
                    f"pre-RoPE recording found {len(attn)} attention modules (with k_proj and layer_idx) for "
                    f"{self.num_layers} layers in {type(model).__name__}, so it cannot undo its RoPE; methods "
                    "that quantize post-RoPE keys (oaken, kivi, int) record it (key_position='post_rope')"
                )
            for m in attn:
                self._hooks.append(m.register_forward_pre_hook(self._capture_rope, with_kwargs=True))

    def _capture_rope(self, module: Any, args: tuple, kwargs: dict) -> None:
        pe = kwargs.get("position_embeddings")
        if pe is None and len(args) > 1:
            pe = args[1]
        if pe is None:
            raise NotImplementedError(
                f"{type(module).__name__} is not called with position_embeddings=(cos, sin); cannot undo RoPE"
            )
        self._rope[module.layer_idx] = pe

    def _sink(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        # k, v: [B, H, S, D]
        if self.key_position == "pre_rope" and not self.no_rope:
            cos, sin = self._rope[layer_idx]  # [B, S, D] (or [1, S, D])
            if cos.shape[-1] != k.shape[-1]:
                raise NotImplementedError(
                    f"layer {layer_idx} applies RoPE to {cos.shape[-1]} of {k.shape[-1]} head dims (partial "
                    "rotary); pre-RoPE recording supports full-width RoPE only"
                )
            cos, sin = cos.unsqueeze(1).to(k.dtype), sin.unsqueeze(1).to(k.dtype)
            k = k * cos - rotate_half(k) * sin
        self._keys[layer_idx] = k.detach()
        self._values[layer_idx] = v.detach()

    def __enter__(self) -> KVRecorder:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    @torch.inference_mode()
    def record(self, input_ids: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """One forward pass (prefill) over ``input_ids`` int64 ``[B, S]``.

        Returns:
            ``(keys, values)``: lists with one tensor ``[B, H_kv, S, D]`` per decoder layer (model dtype).
        """
        if input_ids.dim() != 2 or input_ids.dtype != torch.int64:
            raise ValueError(f"input_ids must be int64 [B, S], got {input_ids.dtype} {tuple(input_ids.shape)}")
        self._keys = [None] * self.num_layers
        self._values = [None] * self.num_layers
        self._rope.clear()
        cache = _cache_class()(self._sink, config=self.model.config)
        params = inspect.signature(self.model.forward).parameters
        kw: dict[str, Any] = {"use_cache": True}
        kw["cache" if "cache" in params else "past_key_values"] = cache
        if "logits_to_keep" in params:
            kw["logits_to_keep"] = 1  # we need no logits: skip most of the LM head
        device = execution_device(self.model)
        self.model(input_ids.to(device), **kw)
        missing = [i for i, k in enumerate(self._keys) if k is None]
        if missing:
            raise RuntimeError(f"layers {missing} never called cache.update: cannot record their keys/values")
        return self._keys, self._values  # type: ignore[return-value]


def record_kv(
    model: Any, input_ids: torch.Tensor, key_position: Literal["post_rope", "pre_rope"] = "post_rope"
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Convenience: the per-layer keys and values ``[B, H_kv, S, D]`` the cache stores for ``input_ids [B, S]``."""
    with KVRecorder(model, key_position) as rec:
        return rec.record(input_ids)


# ---------------------------------------------------------------------------------------------- attention inputs


@dataclass
class LayerRecord:
    """What one decoder layer's attention received over the calibration windows: queries ``[R_q, Hq, S, hd]`` (of
    the first ``R_q`` windows), keys and values ``[R, H, S, hd]`` (post-RoPE, as the cache receives them), all
    float32 on the CPU; the softmax scale and the sliding window (or None); and what the model's attention allows a
    fold to do: key scales shared by all KV heads (a q/k norm, whose weight every head shares, takes them) and no
    value rotation (a value norm does not commute with it)."""

    index: int
    queries: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    scaling: float
    sliding_window: int | None
    key_scale_shared_by_heads: bool = False
    value_norm: bool = False
    #: Whether the attention soft-caps its logits (Gemma 2): a key shift would change them.
    softcap: bool = False


@dataclass
class AttentionRecord:
    """:class:`LayerRecord` of every layer at once, as lists over layers (:func:`record_attention`)."""

    queries: list[torch.Tensor]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    scaling: list[float]
    sliding_window: list[int | None]
    key_scale_shared_by_heads: bool = False
    value_norm: bool = False
    softcap: bool = False

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    def layer(self, i: int) -> LayerRecord:
        return LayerRecord(
            i,
            self.queries[i],
            self.keys[i],
            self.values[i],
            self.scaling[i],
            self.sliding_window[i],
            self.key_scale_shared_by_heads,
            self.value_norm,
            self.softcap,
        )


class StreamingUnsupported(RuntimeError):
    """The model's forward cannot be run one decoder layer at a time (:func:`stream_attention`)."""


_ATTN_NAME = "oakenkv_record"


@dataclass(frozen=True)
class _Traits:
    modules: list[Any]
    sliding_window: list[int | None]
    key_scale_shared_by_heads: bool
    value_norm: bool
    softcap: bool


def _traits(model: Any) -> _Traits:
    """The attention modules and what the search needs to know of them; refuses learned attention sinks (the
    key shift would change their weight, and the packed attention does not add them)."""
    mods = attention_modules(model)
    for m in mods:
        if getattr(m, "sinks", None) is not None:
            raise TransformError("attention sinks are not shift-invariant: oaken-plus does not support this model")
    text = model.config.get_text_config(decoder=True)
    types = layer_kinds(text)
    shared = False  # a q/k norm whose one weight every head shares takes one set of key scales
    for m in mods:
        hd = head_dim(m)
        for which, norm in (("k", "k_norm"), ("q", "q_norm")):
            if getattr(m, norm, None) is not None:
                heads = len(projection(m, which, hd)[1]) // hd
                try:
                    shared |= norm_heads(getattr(m, norm), heads, hd) == 1
                except TransformError as e:
                    where = f"layer {m.layer_idx} {norm}"
                    raise TransformError(f"{where}: {e}; oaken-plus cannot fold key scales into it") from None
    return _Traits(
        mods,
        [int(text.sliding_window) if t == "sliding_attention" else None for t in types],
        key_scale_shared_by_heads=shared,
        value_norm=any(hasattr(m, "v_norm") for m in mods),
        softcap=bool(getattr(text, "attn_logit_softcapping", None)),
    )


@contextlib.contextmanager
def _recording_attention(model: Any, sink: Callable[[Any, torch.Tensor, torch.Tensor, torch.Tensor, dict], None]):
    """Within the block, every attention of ``model`` hands ``(module, query, key, value, kwargs)`` to ``sink`` and
    then runs SDPA unchanged (with SDPA's masks)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def rec(module, query, key, value, attention_mask, **kw):
        sink(module, query, key, value, kw)
        if kw.get("softcap"):  # SDPA has no soft cap: the eager formula, as the model computes it
            from oakenkv.quant.attention import float_attention, module_is_causal

            scaling = kw.get("scaling") or module.scaling
            causal = module_is_causal(module, kw)
            return float_attention(query, key, value, attention_mask, scaling, kw["softcap"], is_causal=causal), None
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register(_ATTN_NAME, rec)
    AttentionMaskInterface.register(_ATTN_NAME, sdpa_mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation(_ATTN_NAME)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


def _check_recorded(model: Any, counts: list[int]) -> None:
    """Raise :class:`TransformError` when a layer's attention recorded nothing: the model computes attention itself
    instead of through transformers' attention interface (Falcon in transformers 5.19 calls SDPA directly), so
    nothing of it can be recorded (nor read from packed pages)."""
    missing = [i for i, c in enumerate(counts) if not c]
    if missing:
        raise TransformError(
            f"{type(model).__name__}'s attention of layer(s) {missing[:4]} did not go through transformers' attention "
            "interface (its code computes attention itself: newer transformers versions route it through the "
            "interface), so oaken-plus cannot record it"
        )


def _host(x: torch.Tensor) -> torch.Tensor:
    """A float32 copy on the CPU, where the search's statistics and kernels run (bf16/fp16 widen exactly)."""
    return x.detach().to("cpu", torch.float32, copy=True)


def _prefill(model: Any, ids: torch.Tensor) -> None:
    from transformers import DynamicCache

    model(input_ids=ids, use_cache=True, **cache_kwargs(model, DynamicCache(config=model.config)))


def record_attention(
    model: Any, windows: torch.Tensor, query_runs: int, progress: Callable[[int], None] | None = None
) -> AttentionRecord:
    """One prefill per calibration window (int64 ``[R, S]``) through the recording attention, keeping what every
    layer's attention received (queries of the first ``query_runs`` windows): every layer at once (module doc)."""
    traits = _traits(model)
    n = len(traits.modules)
    qs: list[list[torch.Tensor]] = [[] for _ in range(n)]
    ks: list[list[torch.Tensor]] = [[] for _ in range(n)]
    vs: list[list[torch.Tensor]] = [[] for _ in range(n)]
    scaling: list[float] = [0.0] * n
    run = [0]

    def sink(module, query, key, value, kw):
        i = module.layer_idx
        if run[0] < query_runs:
            qs[i].append(_host(query[0]))
        ks[i].append(_host(key[0]))
        vs[i].append(_host(value[0]))
        scaling[i] = float(kw.get("scaling") or module.scaling)

    device = execution_device(model)
    with _recording_attention(model, sink), torch.inference_mode():
        for r in range(windows.shape[0]):
            run[0] = r
            _prefill(model, windows[r : r + 1].to(device))
            if progress is not None:
                progress(1)
    _check_recorded(model, [len(k) for k in ks])
    return AttentionRecord(
        [torch.stack(q) for q in qs],
        [torch.stack(k) for k in ks],
        [torch.stack(v) for v in vs],
        scaling,
        traits.sliding_window,
        traits.key_scale_shared_by_heads,
        traits.value_norm,
        traits.softcap,
    )


def decoder_layers(model: Any, attention: list[Any] | None = None) -> list[Any]:
    """The model's decoder layers in order: the first ``ModuleList`` whose ``i``-th entry holds the ``i``-th
    attention module (:func:`~oakenkv.calibrate.transforms.attention_modules`); :class:`StreamingUnsupported` if
    there is none."""
    mods = attention_modules(model) if attention is None else attention
    for m in model.modules():
        if (
            isinstance(m, torch.nn.ModuleList)
            and len(m) >= len(mods)
            and all(any(sub is a for sub in layer.modules()) for layer, a in zip(m, mods, strict=False))
        ):
            return list(m[: len(mods)])
    raise StreamingUnsupported(f"{type(model).__name__}: no list of decoder layers holding its attention modules")


class _Stop(Exception):
    """Raised by the last stand-in layer: the rest of the forward pass is not needed."""


def _layer_inputs(model: Any, layers: list[Any], ids: torch.Tensor) -> tuple[torch.Tensor, list[tuple[tuple, dict]]]:
    """Run ``model`` on ``ids [1, S]`` with stand-ins for its decoder ``layers`` (module doc): the hidden states
    the first layer receives, and per layer the other arguments ``(args, kwargs)`` it is called with."""
    calls: list[tuple[int, tuple, dict]] = []
    n = len(layers)

    def stand_in(i: int) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            calls.append((i, args, kwargs))
            if i == n - 1:
                raise _Stop
            return args[0] if args else kwargs["hidden_states"]

        forward.needs_weights = False  # a model made by oakenkv.assets.lazy does not read this layer for it
        return forward

    # an instance attribute "forward" shadows the class's; a hook library may have put its own there: restored after
    saved = [layer.__dict__.get("forward") for layer in layers]
    for i, layer in enumerate(layers):
        layer.forward = stand_in(i)
    try:
        _prefill(model, ids)
    except _Stop:
        pass
    else:
        raise StreamingUnsupported(f"{type(model).__name__}'s forward did not call its last decoder layer")
    finally:
        for layer, f in zip(layers, saved, strict=True):
            if f is None:
                del layer.forward
            else:
                layer.forward = f
    if [i for i, _, _ in calls] != list(range(n)):
        raise StreamingUnsupported(
            f"{type(model).__name__} called its decoder layers in the order {[i for i, _, _ in calls]}, not once each"
        )
    out = []
    for _, args, kwargs in calls:
        if args:
            hidden, args = args[0], args[1:]
        else:
            kwargs = dict(kwargs)
            hidden = kwargs.pop("hidden_states")
        out.append((args, kwargs))
        if len(out) == 1:
            first = hidden
    return first, out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and a.device == b.device
            and bool(torch.equal(a, b))
        )
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a is b or (type(a) is type(b) and isinstance(a, (bool, int, float, str, type(None))) and a == b)


def _shared(value: Any, first: Any) -> Any:
    """``first`` where it equals ``value`` (the windows share one length, so their masks and RoPE tables are
    equal: kept once, not once per window)."""
    return first if _same(value, first) else value


#: Tokens of the first window on which running the layers one at a time is checked against a whole forward pass.
CHECK_TOKENS = 32


def stream_attention(
    model: Any, windows: torch.Tensor, query_runs: int, progress: Callable[[int], None] | None = None
) -> Iterator[LayerRecord]:
    """What :func:`record_attention` records, one :class:`LayerRecord` at a time in layer order, holding one
    layer's recording and every window's hidden states (module doc). The stand-in pass runs here, and the
    layer-by-layer run is checked against a whole forward pass on the first :data:`CHECK_TOKENS` tokens (all
    queries, keys and values, bit for bit), so a model it does not fit raises :class:`StreamingUnsupported` before
    anything is yielded; the layers run as the iterator is consumed (``progress(1)`` per window and layer).
    Consume it to the end or close it: until then the model's attention records."""
    traits = _traits(model)
    layers = decoder_layers(model, traits.modules)
    device = execution_device(model)
    probe = windows[:1, :CHECK_TOKENS].to(device)
    whole = record_attention(model, probe, 1)
    inputs: list[tuple[torch.Tensor, list[tuple[tuple, dict]]]] = []
    with _recording_attention(model, lambda *a: None), torch.inference_mode():
        probe_inputs = _layer_inputs(model, layers, probe)
        for r in range(windows.shape[0]):
            hidden, calls = _layer_inputs(model, layers, windows[r : r + 1].to(device))
            if inputs:
                calls = [(_shared(a, a0), _shared(k, k0)) for (a, k), (a0, k0) in zip(calls, inputs[0][1], strict=True)]
            inputs.append((hidden, calls))
    check = _run_layers(model, layers, [probe_inputs], traits, 1, None)
    try:
        for got in check:
            want = whole.layer(got.index)
            if not all(torch.equal(getattr(got, f), getattr(want, f)) for f in ("queries", "keys", "values")):
                raise StreamingUnsupported(
                    f"running {type(model).__name__}'s decoder layers one at a time does not reproduce its forward "
                    f"pass (layer {got.index} receives other inputs)"
                )
    finally:
        check.close()
    return _run_layers(model, layers, inputs, traits, query_runs, progress)


def _run_layers(
    model: Any,
    layers: list[Any],
    inputs: list[tuple[torch.Tensor, list[tuple[tuple, dict]]]],
    traits: _Traits,
    query_runs: int,
    progress: Callable[[int], None] | None,
) -> Iterator[LayerRecord]:
    from transformers import Cache, DynamicCache

    runs = len(inputs)
    hidden = [h for h, _ in inputs]
    calls = [c for _, c in inputs]
    del inputs
    got: dict[str, Any] = {}
    run = [0]

    def sink(module, query, key, value, kw):
        r = run[0]
        for name, x, n in (("q", query, min(query_runs, runs)), ("k", key, runs), ("v", value, runs)):
            if r >= n:
                continue
            if name not in got:  # one buffer per layer, filled in place: no list of copies to stack
                got[name] = torch.empty((n, *x.shape[1:]), dtype=torch.float32)
            got[name][r].copy_(x[0].detach())
        got["scaling"] = float(kw.get("scaling") or module.scaling)
        got.setdefault("runs", set()).add(r)

    with _recording_attention(model, sink):
        for i, layer in enumerate(layers):
            got.clear()
            with torch.inference_mode():
                for r in range(runs):
                    run[0] = r
                    args, kwargs = calls[r][i]
                    # a fresh cache, as in a prefill (the stand-in pass's one would keep every layer's keys)
                    kwargs = {
                        k: DynamicCache(config=model.config) if isinstance(v, Cache) else v for k, v in kwargs.items()
                    }
                    out = layer(hidden[r], *args, **kwargs)
                    hidden[r] = out[0] if isinstance(out, tuple) else out
                    if progress is not None:
                        progress(1)
            if got.get("runs") != set(range(runs)):
                raise RuntimeError(f"layer {i}'s attention was not called once per calibration window")
            record = LayerRecord(
                i,
                got.pop("q"),
                got.pop("k"),
                got.pop("v"),
                got["scaling"],
                traits.sliding_window[i],
                traits.key_scale_shared_by_heads,
                traits.value_norm,
                traits.softcap,
            )
            got.clear()
            if i == len(layers) - 1:
                hidden.clear()
            yield record
            del record
            release_free_memory()  # (the consumer is done with the layer: its buffers' pages back to the system)
