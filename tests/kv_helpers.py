"""Helpers shared by the tests: quick thresholds from one short forward pass, the command line's commands."""

from __future__ import annotations

import torch

from oakenkv.calibrate.thresholds import GroupThresholds, ModelFingerprint, Thresholds
from oakenkv.format.config import OakenConfig
from oakenkv.util.compat import cache_kwargs


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


#: How far the packed decode attention's logits may drift from the float path's over a short greedy generation.
#: The kernel sums in another order than SDPA (~1e-4 at its first step); once a later token's keys and values come
#: out of a forward pass that differs in the last bits, a value next to a rounding boundary of the 4-bit grid takes
#: the other code, and the difference grows step by step (0.56 measured after 6 steps on an AVX-512 Xeon, where
#: the default model's greedy tokens then changed at a near tie; they had not on an AVX2 EPYC; 1.13 after 7 steps
#: with the tokens equal, on a Zen 4 running torch's and numba's AVX2 code paths: ATEN_CPU_CAPABILITY=avx2
#: NUMBA_CPU_NAME=haswell).
GREEDY_DRIFT = 1.5


def assert_same_greedy(want, got, first_atol: float = 1e-3, drift: float = GREEDY_DRIFT) -> None:
    """Two greedy generations (``generate(..., output_logits=True, return_dict_in_generate=True)``) of one model
    whose attention differs only in float summation order (the packed kernel against SDPA over the same stored
    values): the prompt's logits agree within ``first_atol``, the first decode step's within ``10 * first_atol``
    (its token's keys and values come out of a forward pass that already differs in the last bits, so a value at a
    rounding boundary may take the other code: 1.4e-3 with torch's and numba's AVX2 code paths, under 1e-3 with
    AVX-512's); while the tokens agree, the logits stay within ``drift``; the tokens agree at every step whose
    reference margin (top-1 minus top-2 logit) is at least ``2 * drift``, and may part only at a near tie."""
    prompt = want.sequences.shape[1] - len(want.logits)
    assert torch.equal(want.sequences[:, :prompt], got.sequences[:, :prompt])
    for i, (a, b) in enumerate(zip(want.logits, got.logits, strict=True)):
        diff = float((a - b).abs().max())
        atol = first_atol if i == 0 else 10 * first_atol if i == 1 else drift
        assert diff <= atol, f"step {i}: logits differ by {diff}"
        ta, tb = want.sequences[:, prompt + i], got.sequences[:, prompt + i]
        if not torch.equal(ta, tb):
            top = a.topk(2, dim=-1).values
            margin = (top[:, 0] - top[:, 1])[ta != tb]
            assert bool((margin < 2 * drift).all()), f"step {i}: tokens differ at margins {margin.tolist()}"
            return  # the contexts differ from here on


def cli_commands() -> list:
    """``(path, click command)`` of every leaf command of ``oakenkv`` (e.g. ``(["eval", "ppl"], ...)``)."""
    import typer

    from oakenkv.cli import app

    def walk(c, path):
        if hasattr(c, "commands"):
            for name, sub in c.commands.items():
                yield from walk(sub, [*path, name])
        else:
            yield path, c

    return list(walk(typer.main.get_command(app), []))
