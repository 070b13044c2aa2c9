"""Left padding and oaken-plus's sink token: the last-token logit error against FP, prompt alone vs left-padded.

An oaken-plus profile keeps each sequence's first token at 16 bits (the attention sink). With left padding the
first token of a row is a pad; the sink must be the row's first real token (issue 35). For a few prompts, each
alone (batch 1) and left-padded in a batch with a longer prompt, this prints and records the max absolute error
of the last real token's logits of an ``OakenCache`` (prefill float path, then one packed decode step) against the
model with transformers' fp32 ``DynamicCache`` given the same input.

    .venv/bin/python benchmarks/sink_padding.py --label after --json benchmarks/results/sink_padding/after.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import torch

PROMPTS = [
    "The capital of France is",
    "In 1969, the first humans landed on",
    "def fibonacci(n):",
]
LONG = (
    "Once upon a time, in a small village at the edge of a large forest, there lived an old carpenter who made "
    "wooden toys for the children of the village, and every winter he"
)


def _machine() -> dict:
    model = ""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        model = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "")
    except OSError:
        pass
    return {"cpu": model or platform.processor(), "cores": os.cpu_count(), "load": os.getloadavg()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    from transformers import DynamicCache

    from oakenkv.assets.models import load_model
    from oakenkv.calibrate.presets import find_profile
    from oakenkv.hf.attention import enable_oaken_attention
    from oakenkv.hf.cache import OakenCache
    from oakenkv.util.compat import cache_kwargs

    torch.set_num_threads(1)
    loaded = load_model("default")
    tok = loaded.tokenizer
    profile = find_profile(loaded.model, "oaken-plus", progress=False)
    model = copy.deepcopy(loaded.model)
    cache0 = OakenCache.from_profile(model, profile)  # folds the transforms into the copy
    del cache0
    enable_oaken_attention(model)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token

    def last_logits(ids, mask, cache):
        pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
        with torch.inference_mode():
            out = model(
                input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **cache_kwargs(model, cache)
            )
            logits = out.logits[:, -1].float()
            # one decode step: the argmax token, through the packed attention for the Oaken cache
            nxt = logits.argmax(-1, keepdim=True)
            mask2 = torch.cat([mask, torch.ones_like(nxt)], dim=1)
            out2 = model(
                input_ids=nxt,
                attention_mask=mask2,
                position_ids=pos[:, -1:] + 1,
                use_cache=True,
                **cache_kwargs(model, cache),
            )
        return logits, out2.logits[:, -1].float()

    rows = []
    summary: dict = {}
    t0 = time.perf_counter()
    for p in PROMPTS:
        res = {"prompt": p}
        for how in ("alone", "left_padded"):
            texts = [p] if how == "alone" else [p, LONG]
            enc = tok(texts, return_tensors="pt", padding=True)
            ids, mask = enc.input_ids, enc.attention_mask
            fp, fp2 = last_logits(ids, mask, DynamicCache(config=model.config))
            oq, oq2 = last_logits(ids, mask, OakenCache(profile, model))
            res[how] = {
                "pads": int((mask[0] == 0).sum()),
                "prefill_max_err": float((oq[0] - fp[0]).abs().max()),
                "prefill_mean_err": float((oq[0] - fp[0]).abs().mean()),
                "decode_max_err": float((oq2[0] - fp2[0]).abs().max()),
                "decode_mean_err": float((oq2[0] - fp2[0]).abs().mean()),
            }
        rows.append(res)
        for k in ("prefill_mean_err", "decode_mean_err"):
            summary.setdefault(k, {"alone": [], "left_padded": []})
            for how in ("alone", "left_padded"):
                summary[k][how].append(res[how][k])
        print(json.dumps(res))
    out = {
        "command": "benchmarks/sink_padding.py" + (f" --label {args.label}" if args.label else ""),
        "label": args.label,
        "machine": _machine(),
        "seconds": time.perf_counter() - t0,
        "sink_tokens": profile.transforms.sink_tokens,
        "rows": rows,
        "mean_over_prompts": {k: {h: sum(v) / len(v) for h, v in d.items()} for k, d in summary.items()},
    }
    print(json.dumps(out["mean_over_prompts"]))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
