"""Helpers shared by the cache and attention tests: quick thresholds from one short forward pass."""

from __future__ import annotations

import torch

from oakenkv.compat import cache_kwargs
from oakenkv.config import OakenConfig
from oakenkv.thresholds import GroupThresholds, ModelFingerprint, Thresholds


def quick_thresholds(loaded, text: str = "", config: OakenConfig | None = None) -> Thresholds:
    """Per-layer thresholds from quantiles of the keys (post-RoPE) and values of one forward pass.

    Not a real profile (one sample, no averaging): enough to exercise the cache with realistic group sizes.
    """
    from transformers import DynamicCache

    config = config or OakenConfig()
    model, tok = loaded.model, loaded.tokenizer
    text = text or (
        "The tower is 324 metres tall, about the same height as an 81-storey building, and the tallest structure "
        "in Paris. Its base is square, measuring 125 metres on each side. During its construction, the Eiffel "
        "Tower surpassed the Washington Monument to become the tallest man-made structure in the world."
    )
    ids = tok(text, return_tensors="pt").input_ids
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, **cache_kwargs(model, cache), use_cache=True)
    o, i = config.outer_ratio / 2, config.inner_ratio / 2
    qs = torch.tensor([o, 0.5 - i, 0.5 + i, 1 - o], dtype=torch.float64)
    keys, values = [], []
    for layer in cache.layers:
        for x, out in ((layer.keys, keys), (layer.values, values)):
            t = torch.quantile(x.double().flatten(), qs).tolist()
            # Quantiles of a small sample can tie; nudge so that to_lo < ti_lo <= ti_hi < to_hi holds.
            t[0] = min(t[0], t[1] - 1e-3)
            t[3] = max(t[3], t[2] + 1e-3)
            out.append(GroupThresholds(*t))
    fp = ModelFingerprint.from_model_config(model.config, name=loaded.name)
    return Thresholds(config=config, fingerprint=fp, keys=tuple(keys), values=tuple(values))
