"""Text generation with the Oaken KV cache, and the thresholds it needs (``oakenkv generate``, ``oakenkv demo``).

:func:`load_or_profile_thresholds` reads a thresholds file, or profiles the model once on the calibration text
and caches the result on disk (``oakenkv.profile.cached_thresholds``), so later runs start in seconds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from oakenkv.compat import cache_kwargs


def load_or_profile_thresholds(
    loaded: Any, path: Any = None, *, samples: int = 16, window: int = 256, progress: bool = False
) -> Any:
    """The model's :class:`~oakenkv.thresholds.Thresholds`: from ``path`` (a file, or thresholds already loaded;
    checked against the model's shape and weights), or a profile of ``samples`` calibration windows of ``window``
    tokens, cached on disk after the first run."""
    from oakenkv.thresholds import Thresholds

    if path is not None:
        thr = path if isinstance(path, Thresholds) else Thresholds.load(path)
        thr.check_model(loaded.model)  # shape and weights
        return thr
    from oakenkv.config import OakenConfig
    from oakenkv.profile import CalibrationSpec, cached_thresholds

    spec = CalibrationSpec(samples=samples, window=window)
    return cached_thresholds(loaded.model, loaded.tokenizer, loaded.name, OakenConfig(), spec, progress=progress)


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

    def to_dict(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "new_tokens": self.new_tokens,
            "prompt_tokens": self.prompt_tokens,
            "seconds": self.seconds,
            "kv_bytes": self.kv_bytes,
            "fp32_kv_bytes": self.fp32_kv_bytes,
            "compression": self.fp32_kv_bytes / self.kv_bytes if self.kv_bytes else None,
        }


def generate_text(
    loaded: Any,
    prompt: str,
    thresholds: Any | None,
    *,
    max_new_tokens: int = 64,
    chat: bool = True,
    packed_attention: bool = True,
    do_sample: bool = False,
) -> Generation:
    """Generate from ``prompt`` with an :class:`~oakenkv.cache.OakenCache` (``thresholds`` given) or with
    transformers' fp32 ``DynamicCache`` (``thresholds=None``, the FP baseline).

    Args:
        chat: wrap the prompt in the tokenizer's chat template when it has one.
        packed_attention: decode with the packed-page attention (``"oaken"``) instead of the float read path.
    """
    import contextlib

    import torch
    from transformers import DynamicCache

    from oakenkv.attention import oaken_attention
    from oakenkv.cache import OakenCache, kv_bytes

    model, tok = loaded.model, loaded.tokenizer
    if chat and getattr(tok, "chat_template", None):
        ids = tok.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
    else:
        ids = tok(prompt, return_tensors="pt").input_ids
    if ids.shape[-1] == 0:
        raise ValueError("the prompt is empty (no tokens to continue); give some text")
    cache = OakenCache(thresholds, model.config) if thresholds is not None else DynamicCache(config=model.config)
    ctx = oaken_attention(model) if (thresholds is not None and packed_attention) else contextlib.nullcontext()
    t0 = time.perf_counter()
    with ctx, torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            **cache_kwargs(model, cache),
            max_new_tokens=max_new_tokens,
            do_sample=do_sample,
            pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
        )
    seconds = time.perf_counter() - t0
    new = out[0, ids.shape[1] :]
    cfg = model.config.get_text_config(decoder=True)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    stored = cache.get_seq_length()
    fp32 = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 4 * stored
    return Generation(
        text=tok.decode(new, skip_special_tokens=True),
        new_tokens=int(new.numel()),
        prompt_tokens=int(ids.shape[1]),
        seconds=seconds,
        kv_bytes=kv_bytes(cache),
        fp32_kv_bytes=fp32,
    )


def oaken_window_nll(model: Any, windows: Any, thresholds: Any) -> tuple[float, int, dict[str, float], int]:
    """Next-token NLL of token windows scored through an :class:`~oakenkv.cache.OakenCache`.

    Every window is one prefill: its keys and values are quantized into the pages as they are produced, and
    attention runs over the dequantized (stored) K/V, as in the paper's evaluation.

    Args:
        windows: int64 ``[N, S]`` token ids; all scored in one batch.

    Returns:
        ``(total_nll, predicted_tokens, bits per value (OakenCache.bits_per_value), kv_bytes)``.
    """
    import torch

    from oakenkv.cache import OakenCache

    cache = OakenCache(thresholds, model.config)
    with torch.inference_mode():
        logits = model(input_ids=windows, use_cache=True, **cache_kwargs(model, cache)).logits
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        nll = -logp.gather(-1, windows[:, 1:, None]).squeeze(-1)
    return float(nll.sum()), nll.numel(), cache.bits_per_value(), cache.kv_bytes()


def oaken_demo_side(
    loaded: Any,
    windows: Any,
    prompt: str,
    max_new_tokens: int,
    *,
    thresholds: Any = None,
    console: Any = None,
) -> dict[str, Any]:
    """The Oaken half of ``oakenkv demo``: profile (or reuse the cached profile), perplexity of the windows
    through an :class:`~oakenkv.cache.OakenCache`, stored bits and KV bytes, and a greedy generation.

    Args:
        windows: int64 ``[N, S]`` WikiText-2 windows (the same the FP side scored).
        thresholds: a ``Thresholds`` (default: the cached 16-window profile, made on first use).
        console: a rich console for progress (None: silent).
    """
    import contextlib
    import math

    status = console.status if console is not None else (lambda msg: contextlib.nullcontext())
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    with status("Profiling Oaken thresholds (16 calibration windows; cached after the first run)..."):
        thr = thresholds if thresholds is not None else load_or_profile_thresholds(loaded)
    out["profile_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    total_nll, total_tokens, kv = 0.0, 0, 0
    bits: dict[str, float] = {}
    with status(f"Oaken perplexity on {windows.shape[0]} WikiText-2 windows..."):
        for row in windows:
            nll, n, bits, kv = oaken_window_nll(loaded.model, row[None], thr)
            total_nll += nll
            total_tokens += n
    seconds = time.perf_counter() - t0
    cfg = loaded.model.config
    fp32 = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4 * windows.shape[1]
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
        with status(f"Generating {max_new_tokens} tokens greedily with the Oaken cache..."):
            g = generate_text(loaded, prompt, thr, max_new_tokens=max_new_tokens)
        out["oaken_generation"] = {**g.to_dict(), "tokens_per_s": g.new_tokens / g.seconds if g.seconds else None}
    return out
