"""Text generation with the Oaken KV cache, and the thresholds it needs (``oakenkv generate``, ``oakenkv demo``).

:func:`load_or_profile_thresholds` reads a thresholds file, or profiles the model once on the calibration text
and caches the result on disk (``oakenkv.calibrate.profile.cached_thresholds``), so later runs start in seconds.

:func:`timed_generate` runs ``model.generate`` and times it split at the first new token (prefill, then each
decode step); the demo's tokens/s and ``oakenkv bench generate`` both come from it.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any

from oakenkv.util.compat import cache_kwargs


def load_or_profile_thresholds(
    loaded: Any, path: Any = None, *, samples: int = 16, window: int = 256, progress: bool = False
) -> Any:
    """The model's :class:`~oakenkv.calibrate.thresholds.Thresholds`: from ``path`` (a file, or thresholds already
    loaded;
    checked against the model's shape and weights), or a profile of ``samples`` calibration windows of ``window``
    tokens, cached on disk after the first run."""
    from oakenkv.calibrate.thresholds import Thresholds

    if path is not None:
        from oakenkv.calibrate.match import check_profile_model

        thr = path if isinstance(path, Thresholds) else Thresholds.load(path)
        check_profile_model(thr, loaded.model)  # shape, weights, no oaken-plus transforms on either side
        return thr
    from oakenkv.calibrate.profile import CalibrationSpec, cached_thresholds
    from oakenkv.format.config import OakenConfig

    spec = CalibrationSpec(samples=samples, window=window)
    return cached_thresholds(loaded.model, loaded.tokenizer, loaded.name, OakenConfig(), spec, progress=progress)


@dataclass(frozen=True)
class GenerationTiming:
    """Wall-clock times of one ``model.generate`` call, split at the first new token.

    ``prefill_s`` runs from the call to the first new token (the prompt's forward pass and the first pick);
    ``step_s`` holds each later token's time (one decode step: a forward pass of one token per row, its pick
    and transformers' bookkeeping). Tokens/s count every batch row.
    """

    batch: int
    prompt_tokens: int
    new_tokens: int
    prefill_s: float
    step_s: tuple[float, ...]

    @property
    def decode_s(self) -> float:
        return sum(self.step_s)

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def tokens_per_s(self) -> float:
        """Decode tokens per second: ``batch * decode steps / decode time`` (NaN without a decode step)."""
        return self.batch * len(self.step_s) / self.decode_s if self.step_s else float("nan")

    @property
    def prefill_tokens_per_s(self) -> float:
        """Prompt tokens per second of the prefill: ``batch * prompt tokens / prefill_s``."""
        return self.batch * self.prompt_tokens / self.prefill_s

    @property
    def decode_step_ms(self) -> float:
        """Mean decode step, milliseconds."""
        return 1e3 * self.decode_s / len(self.step_s) if self.step_s else float("nan")

    def to_dict(self) -> dict[str, Any]:
        return {
            "batch": self.batch,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "prefill_s": self.prefill_s,
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "decode_step_ms": self.decode_step_ms,
            "tokens_per_s": self.tokens_per_s,
            "step_ms": [1e3 * t for t in self.step_s],
        }


class _Clock:
    """A transformers streamer that only notes when each ``put`` arrives: the prompt first, then every new
    token (all rows of the batch at once)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: Any) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def timed_generate(
    model: Any,
    input_ids: Any,
    cache: Any,
    *,
    max_new_tokens: int,
    attention_mask: Any = None,
    exact_length: bool = False,
    **generate_kwargs: Any,
) -> tuple[Any, GenerationTiming]:
    """``model.generate`` with ``cache``, timed: returns ``(output ids, GenerationTiming)``.

    Args:
        input_ids: int64 ``[B, P]`` prompt ids; attention_mask: ``[B, P]`` (default: all ones).
        exact_length: generate exactly ``max_new_tokens`` tokens (end-of-sequence ignored), as a benchmark does.
        generate_kwargs: passed on (``do_sample``, ``pad_token_id``, ...).

    The attention implementation is the model's current one: wrap the call in ``oaken_attention(model)`` for
    an ``OakenCache``'s packed decode. Timing marks come from a streamer (one mark per new token), so they
    include transformers' per-step work, as a user sees it.
    """
    import torch

    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if exact_length:
        generate_kwargs["min_new_tokens"] = max_new_tokens
    clock = _Clock()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            **cache_kwargs(model, cache),
            max_new_tokens=max_new_tokens,
            streamer=clock,
            **generate_kwargs,
        )
    marks = [t0, *clock.times[1:]]  # times[0]: the prompt, handed to the streamer before the prefill
    b, p = input_ids.shape
    timing = GenerationTiming(
        batch=int(b),
        prompt_tokens=int(p),
        new_tokens=int(out.shape[1] - p),
        prefill_s=marks[1] - marks[0] if len(marks) > 1 else time.perf_counter() - t0,
        step_s=tuple(y - x for x, y in itertools.pairwise(marks[1:])),
    )
    return out, timing


@dataclass(frozen=True)
class Generation:
    """One generation and what its KV cache cost."""

    text: str
    new_tokens: int
    prompt_tokens: int
    seconds: float
    #: Bytes the cache holds at the end (OakenCache: pages in use + tables; float caches: tensor bytes).
    kv_bytes: int
    #: What an fp32 DynamicCache holds for the same tokens.
    fp32_kv_bytes: int
    #: The call's prefill and decode times (:func:`timed_generate`).
    timing: GenerationTiming | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {
            "text": self.text,
            "new_tokens": self.new_tokens,
            "prompt_tokens": self.prompt_tokens,
            "seconds": self.seconds,
            "kv_bytes": self.kv_bytes,
            "fp32_kv_bytes": self.fp32_kv_bytes,
            "compression": self.fp32_kv_bytes / self.kv_bytes if self.kv_bytes else None,
        }
        if self.timing is not None:
            t = self.timing
            out.update(
                prefill_s=t.prefill_s,
                decode_step_ms=t.decode_step_ms,
                tokens_per_s=t.tokens_per_s,
                step_ms=[1e3 * x for x in t.step_s],
            )
        return out


def generate_text(
    loaded: Any,
    prompt: str,
    thresholds: Any | None,
    *,
    max_new_tokens: int = 64,
    chat: bool = True,
    packed_attention: bool = True,
    do_sample: bool = False,
    residual: int = 0,
) -> Generation:
    """Generate from ``prompt`` with an :class:`~oakenkv.hf.cache.OakenCache` (``thresholds`` given) or with
    transformers' fp32 ``DynamicCache`` (``thresholds=None``, the FP baseline).

    Args:
        chat: wrap the prompt in the tokenizer's chat template when it has one.
        packed_attention: decode with the packed-page attention (``"oaken"``) instead of the float read path.
        residual: the OakenCache's full-precision window (``OakenCache(residual=...)``; 0: none).
    """
    import contextlib

    from transformers import DynamicCache

    from oakenkv.calibrate.spec import check_positions
    from oakenkv.hf.attention import oaken_attention
    from oakenkv.hf.cache import OakenCache, kv_bytes

    model, tok = loaded.model, loaded.tokenizer
    if chat and getattr(tok, "chat_template", None):
        ids = tok.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
    else:
        ids = tok(prompt, return_tensors="pt").input_ids
    if ids.shape[-1] == 0:
        raise ValueError("the prompt is empty (no tokens to continue); give some text")
    n = ids.shape[-1]
    what = f"the prompt ({n} tokens) and {max_new_tokens} new tokens"
    check_positions(model, n + max_new_tokens, what, "a shorter prompt or fewer --max-new-tokens")
    if thresholds is not None:
        cache = OakenCache(thresholds, model, residual=residual)
    else:
        cache = DynamicCache(config=model.config)
    ctx = oaken_attention(model) if (thresholds is not None and packed_attention) else contextlib.nullcontext()
    with ctx:
        out, timing = timed_generate(
            model,
            ids,
            cache,
            max_new_tokens=max_new_tokens,
            do_sample=do_sample,
            pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
        )
    new = out[0, ids.shape[1] :]
    fp32 = fp32_kv_bytes(model.config, cache.get_seq_length())
    return Generation(
        text=tok.decode(new, skip_special_tokens=True),
        new_tokens=int(new.numel()),
        prompt_tokens=int(ids.shape[1]),
        seconds=timing.total_s,
        kv_bytes=kv_bytes(cache),
        fp32_kv_bytes=fp32,
        timing=timing,
    )


def fp32_kv_bytes(config: Any, tokens: int) -> int:
    """Bytes of keys and values a float32 transformers cache holds after ``tokens`` tokens of one sequence: every
    token in a full-attention layer, the last ``sliding_window - 1`` in a sliding one (``DynamicSlidingWindowLayer``;
    the layers as transformers reads them, ``calibrate.identity.layer_kinds``): what the compression is against."""
    from oakenkv.calibrate.identity import kv_shape, layer_kinds

    cfg = config.get_text_config(decoder=True)
    kv_heads, head_dim = kv_shape(cfg)
    held = sum(
        min(tokens, max(int(cfg.sliding_window) - 1, 0)) if kind == "sliding_attention" else tokens
        for kind in layer_kinds(cfg)
    )
    return 2 * kv_heads * head_dim * 4 * held


def size_against(reference: int, held: int) -> str:
    """``held`` bytes against ``reference`` bytes in words: ``"4.78x smaller"``, ``"1.86x larger"`` (a short
    context holds whole pages), ``"the same"``."""
    if held <= 0 or reference <= 0:
        return "n/a"
    if held == reference:
        return "the same"
    return f"{reference / held:.2f}x smaller" if held < reference else f"{held / reference:.2f}x larger"


def oaken_window_nll(model: Any, windows: Any, thresholds: Any) -> tuple[float, int, dict[str, float], int]:
    """Next-token NLL of token windows scored through an :class:`~oakenkv.hf.cache.OakenCache`.

    Every window but its last token (only a target) is one prefill: its keys and values are quantized into the
    pages as they are produced, and attention runs over the dequantized (stored) K/V, as in the paper's evaluation;
    the same forward as ``oakenkv eval ppl``'s, so a window's NLL is the same in both (quantization would amplify the
    last-bit differences of another input length).

    Args:
        windows: int64 ``[N, S]`` token ids; all scored in one batch.

    Returns:
        ``(total_nll, predicted_tokens, bits per value (OakenCache.bits_per_value), kv_bytes)``.
    """
    import torch

    from oakenkv.hf.cache import OakenCache

    cache = OakenCache(thresholds, model)
    with torch.inference_mode():  # (the last token is only a target: not stored, as `eval ppl` does not store it)
        logits = model(input_ids=windows[:, :-1], use_cache=True, **cache_kwargs(model, cache)).logits
        logp = torch.log_softmax(logits.float(), dim=-1)
        nll = -logp.gather(-1, windows[:, 1:, None]).squeeze(-1)
    return float(nll.sum()), nll.numel(), cache.bits_per_value(), cache.kv_bytes()


def plus_model(loaded: Any, profile: Any) -> Any:
    """A copy of ``loaded`` whose model carries the oaken-plus ``profile``'s transforms (folded into a deep copy
    of the weights; ``loaded`` itself is left as it is, so the paper's ``oaken`` can run beside it)."""
    import copy
    import dataclasses

    from oakenkv.calibrate.plus import apply_profile

    return dataclasses.replace(loaded, model=apply_profile(copy.deepcopy(loaded.model), profile))


def load_or_profile_plus(
    loaded: Any, path: Any = None, *, samples: int | None = None, window: int | None = None, progress: bool = False
) -> Any:
    """The model's oaken-plus profile: from ``path`` (a file or a loaded ``Thresholds``, which must carry
    transforms; checked against the model), or :func:`oakenkv.calibrate.plus.cached_plus_profile` on ``samples`` x
    ``window`` calibration tokens (default: the preset's 16 x 2048), made once and then read from the cache."""
    from oakenkv.calibrate.thresholds import Thresholds

    if path is not None:
        thr = path if isinstance(path, Thresholds) else Thresholds.load(path)
        if thr.transforms is None:
            raise ValueError("this thresholds file is a paper (oaken) profile, not an oaken-plus one")
        from oakenkv.calibrate.match import check_identity

        check_identity(thr, loaded.model)  # shape and weights (the transforms are folded into a copy later)
        return thr
    from oakenkv.calibrate.plus import PLUS_CALIBRATION, cached_plus_profile
    from oakenkv.calibrate.profile import CalibrationSpec

    spec = CalibrationSpec(samples=samples or PLUS_CALIBRATION.samples, window=window or PLUS_CALIBRATION.window)
    return cached_plus_profile(loaded.model, loaded.tokenizer, loaded.name, spec, progress=progress)


def oaken_demo_side(
    loaded: Any,
    windows: Any,
    prompt: str,
    max_new_tokens: int,
    *,
    thresholds: Any = None,
    console: Any = None,
    preset: str = "oaken",
    plus_samples: int | None = None,
    plus_window: int | None = None,
) -> dict[str, Any]:
    """One Oaken side of ``oakenkv demo``: profile (or reuse the cached profile), perplexity of the windows
    through an :class:`~oakenkv.hf.cache.OakenCache`, stored bits and KV bytes, and a greedy generation.

    Args:
        windows: int64 ``[N, S]`` WikiText-2 windows (the same the FP side scored).
        thresholds: a ``Thresholds`` (default: the preset's cached profile, made on first use).
        console: a rich console for progress (None: silent).
        preset: ``"oaken"`` (the paper's thresholds, 16 x 256 calibration tokens) or ``"oaken-plus"`` (offline
            transforms folded into a copy of the model, :func:`load_or_profile_plus`; ``plus_samples`` x
            ``plus_window`` calibration tokens, default 16 x 2048).
    """
    import contextlib
    import math

    if preset not in ("oaken", "oaken-plus"):
        raise ValueError(f"preset must be 'oaken' or 'oaken-plus', got {preset!r}")
    status = console.status if console is not None else (lambda msg: contextlib.nullcontext())
    out: dict[str, Any] = {"preset": preset}
    t0 = time.perf_counter()
    if preset == "oaken":
        with status("Profiling Oaken thresholds (16 calibration windows; cached after the first run)..."):
            thr = thresholds if thresholds is not None else load_or_profile_thresholds(loaded)
    else:
        msg = "Profiling oaken-plus (a per-layer search of transforms, minutes; cached after the first run)..."
        with status(msg):
            thr = load_or_profile_plus(loaded, thresholds, samples=plus_samples, window=plus_window)
        loaded = plus_model(loaded, thr)
    out["profile_s"] = time.perf_counter() - t0
    # the codec's and the attention's kernels compile (first run) or load from numba's cache at their first use: not
    # part of the scoring's tokens/s (a fresh clone's first demo read oaken-plus at a quarter of Oaken's rate)
    t0 = time.perf_counter()
    oaken_window_nll(loaded.model, windows[:1, : min(windows.shape[1], 64)], thr)
    out["kernel_warm_up_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    total_nll, total_tokens, kv = 0.0, 0, 0
    bits: dict[str, float] = {}
    with status(f"Oaken perplexity on {windows.shape[0]} WikiText-2 windows..."):
        for row in windows:
            nll, n, bits, kv = oaken_window_nll(loaded.model, row[None], thr)
            total_nll += nll
            total_tokens += n
    seconds = time.perf_counter() - t0
    fp32 = fp32_kv_bytes(loaded.model.config, windows.shape[1])
    out["oaken"] = {
        "perplexity": math.exp(total_nll / total_tokens),
        "nll": total_nll,
        "tokens": total_tokens,
        "seconds": seconds,
        "bits_per_value": bits,
        "kv_bytes_per_window": kv,
        "fp32_kv_bytes_per_window": fp32,
    }
    if max_new_tokens > 0:
        from oakenkv.hf.attention import load_kernels

        # the decode kernels' first use loads them from numba's disk cache: not part of the tokens/s
        with status("Loading the decode kernels..."):
            out["kernel_load_s"] = load_kernels()
        with status(f"Generating {max_new_tokens} tokens greedily with the Oaken cache..."):
            g = generate_text(loaded, prompt, thr, max_new_tokens=max_new_tokens)
        out["oaken_generation"] = g.to_dict()
    return out
