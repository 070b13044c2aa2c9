"""Every preset through the two-line API on small random models of many families: does it run, refuse with its
reason, or go wrong (NaN, an error from inside a library, logits far beyond the quantization noise)?

Each family (a transformers config, 2-3 layers, random weights, the default model's tokenizer for the calibration
text) runs in a process of its own: ``OakenCache.for_model(model, preset=...)``, a greedy ``generate`` of 8 tokens
for a 20- and a 40-token prompt in a left-padded batch of two, then the same tokens teacher-forced through a fresh
cache. The number per cell is the worst relative logit error, ``max |logits - reference| / max |reference|``, over
the prefill and the decode steps, where the reference is a copy of the model made before ``for_model`` folded
anything, run with ``DynamicCache``; ``int4`` is the same measure for a plain per-token 4-bit cache, the noise scale.
Random weights say nothing of accuracy on text (``oakenkv eval ppl`` does that); they catch what breaks.

    PYTHONPATH=src python benchmarks/probe_families.py --json benchmarks/results/families/probe.json
    PYTHONPATH=src python benchmarks/probe_families.py --families phi3,gpt2 --presets oaken-plus
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

PRESETS = ("oaken", "oaken-plus", "oaken-plus-3")
NEW_TOKENS = 8


def _families() -> dict[str, tuple[str, dict]]:
    """name -> (transformers config class, its arguments)."""
    v = {"vocab_size": 49152, "initializer_range": 0.1}
    small = {**v, "num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 256, "max_position_embeddings": 4096}
    gqa = {**small, "num_attention_heads": 4, "num_key_value_heads": 2}
    return {
        "llama-hd128-mha": ("LlamaConfig", {**small, "hidden_size": 256, "intermediate_size": 512,
                                            "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 128}),
        "llama-hd32-gqa": ("LlamaConfig", {**gqa, "head_dim": 32}),
        "llama-hd32-mqa": ("LlamaConfig", {**gqa, "num_key_value_heads": 1, "head_dim": 32}),
        "llama-5-heads-hd48": ("LlamaConfig", {**small, "hidden_size": 240, "num_attention_heads": 5,
                                               "num_key_value_heads": 5, "head_dim": 48}),
        "mistral-window-16": ("MistralConfig", {**gqa, "head_dim": 32, "sliding_window": 16}),
        "qwen2-bias": ("Qwen2Config", gqa),
        "qwen3-qk-norm": ("Qwen3Config", {**gqa, "head_dim": 32}),
        "gemma2-softcap": ("Gemma2Config", {**gqa, "head_dim": 32, "sliding_window": 16}),
        "gemma3": ("Gemma3TextConfig", {**gqa, "num_hidden_layers": 3, "head_dim": 32, "sliding_window": 16,
                                        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}),
        "phi3": ("Phi3Config", {**gqa, "pad_token_id": 0}),
        "stablelm": ("StableLmConfig", {**small, "num_attention_heads": 4, "num_key_value_heads": 4}),
        "gpt-neox": ("GPTNeoXConfig", {**small, "num_attention_heads": 4}),
        "olmo2": ("Olmo2Config", {**small, "num_attention_heads": 4, "num_key_value_heads": 4, "pad_token_id": 0}),
        "cohere-qk-norm": ("CohereConfig", {**gqa, "use_qk_norm": True, "pad_token_id": 0}),
        "granite": ("GraniteConfig", {**gqa, "attention_multiplier": 0.5, "residual_multiplier": 0.5,
                                      "logits_scaling": 2.0, "embedding_multiplier": 4.0}),
        "mixtral": ("MixtralConfig", {**gqa, "intermediate_size": 128, "head_dim": 32, "num_local_experts": 4,
                                      "num_experts_per_tok": 2, "sliding_window": None}),
        "starcoder2": ("Starcoder2Config", {**gqa, "sliding_window": None}),
        "gpt2": ("GPT2Config", {**v, "n_embd": 128, "n_layer": 2, "n_head": 4, "n_positions": 1024}),
        "opt": ("OPTConfig", {"vocab_size": 49152, "hidden_size": 128, "ffn_dim": 256, "num_hidden_layers": 2,
                              "num_attention_heads": 4, "max_position_embeddings": 2048, "word_embed_proj_dim": 128,
                              "init_std": 0.1, "pad_token_id": 1}),
        "falcon-mqa": ("FalconConfig", {**v, "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                                        "multi_query": True, "new_decoder_architecture": False,
                                        "max_position_embeddings": 4096}),
    }  # fmt: skip


def _inputs(length: int, pad_id: int, seed: int):
    import torch

    ids = torch.randint(100, 49000, (2, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(2, length, dtype=torch.long)
    ids[1, :5], mask[1, :5] = pad_id, 0  # row 1 left-padded
    return ids, mask


def _forced_logits(model, ids, mask, cont, cache):
    """The last position's logits of the prefill and of each teacher-forced decode step ``[steps, B, V]``."""
    import torch

    from oakenkv.util.compat import cache_kwargs

    out = []
    with torch.inference_mode():
        o = model(input_ids=ids, attention_mask=mask, use_cache=True, **cache_kwargs(model, cache))
        out.append(o.logits[:, -1].float())
        for t in range(cont.shape[1] - 1):
            mask = torch.cat([mask, torch.ones(mask.shape[0], 1, dtype=mask.dtype)], 1)
            o = model(input_ids=cont[:, t : t + 1], attention_mask=mask, use_cache=True, **cache_kwargs(model, cache))
            out.append(o.logits[:, -1].float())
    return torch.stack(out)


def _one_family(family: str, presets: list[str]) -> list[dict]:
    import torch
    import transformers as tf
    from transformers import DynamicCache

    from oakenkv import OakenCache
    from oakenkv.assets.models import load_tokenizer
    from oakenkv.util.compat import cache_kwargs

    class Int4Cache(DynamicCache):
        """The noise scale: per-(token, head) asymmetric 4-bit min-max fake quantization of K and V."""

        def update(self, k, v, layer_idx, *a, **kw):
            def q(x):
                lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
                s = (hi - lo).clamp(min=1e-8) / 15
                return ((x - lo) / s).round().clamp(0, 15) * s + lo

            return super().update(q(k), q(v), layer_idx, *a, **kw)

    torch.set_num_threads(1)
    tok = load_tokenizer("default")
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    cls, kw = _families()[family]
    torch.manual_seed(0)
    pristine = tf.AutoModelForCausalLM.from_config(getattr(tf, cls)(**kw)).eval()
    pristine.generation_config.eos_token_id = None
    gen = {"max_new_tokens": NEW_TOKENS, "do_sample": False, "pad_token_id": pad}
    refs = {}
    for length, seed in ((20, 1), (40, 2)):
        ids, mask = _inputs(length, pad, seed)
        with torch.inference_mode():
            toks = pristine.generate(input_ids=ids, attention_mask=mask, **gen)[:, length:]
        want = _forced_logits(pristine, ids, mask, toks, DynamicCache(config=pristine.config))
        int4 = _forced_logits(pristine, ids, mask, toks, Int4Cache(config=pristine.config))
        refs[length] = (ids, mask, toks, want, float((int4 - want).abs().amax() / want.abs().amax()))
    rows = []
    for preset in presets:
        model = copy.deepcopy(pristine)
        row: dict = {"family": family, "preset": preset}
        t0 = time.perf_counter()
        try:
            worst = int4 = 0.0
            for ids, mask, toks, want, base in refs.values():
                cache = OakenCache.for_model(model, preset=preset, tokenizer=tok, progress=False)
                with torch.inference_mode():
                    model.generate(input_ids=ids, attention_mask=mask, **gen, **cache_kwargs(model, cache))
                got = _forced_logits(model, ids, mask, toks, OakenCache.for_model(model, preset=preset, progress=False))
                if not torch.isfinite(got).all():
                    raise FloatingPointError("non-finite logits")
                worst = max(worst, float((got - want).abs().amax() / want.abs().amax()))
                int4 = max(int4, base)
            row.update(outcome="ok", rel_logit_error=round(worst, 4), int4=round(int4, 4))
        except Exception as e:  # the refusals are what this probe reports
            row.update(outcome="error", error=type(e).__name__, message=str(e).strip().split("\n")[0][:300])
            row["where"] = traceback.extract_tb(e.__traceback__)[-1].filename.split("site-packages/")[-1]
        row["seconds"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default="", help="comma-separated (default: all): " + ", ".join(_families()))
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: one family in this process
    a = ap.parse_args()
    presets = [p for p in a.presets.split(",") if p]
    if a.one:
        print("ROWS " + json.dumps(_one_family(a.one, presets)), flush=True)
        return
    families = [f for f in a.families.split(",") if f] or list(_families())
    unknown = sorted(set(families) - set(_families()))
    if unknown:
        ap.error(f"unknown families {unknown}; known: {', '.join(_families())}")
    rows = []
    for f in families:
        cmd = [sys.executable, __file__, "--one", f, "--presets", ",".join(presets)]
        done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        line = next((x for x in done.stdout.splitlines() if x.startswith("ROWS ")), None)
        got = json.loads(line[5:]) if line else [{"family": f, "outcome": f"process exit {done.returncode}",
                                                   "message": done.stderr.strip().splitlines()[-1:]}]  # fmt: skip
        for r in got:
            cell = f"{r['rel_logit_error']:.3f} (int4 {r['int4']:.3f})" if r["outcome"] == "ok" else r.get("message")
            print(f"{r['family']:22s} {r.get('preset', ''):14s} {cell}", flush=True)
        rows += got
    if a.json:
        from oakenkv.bench.results import machine

        a.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {"command": " ".join(["python", *sys.argv]), "machine": machine(), "new_tokens": NEW_TOKENS}
        a.json.write_text(json.dumps({"rows": rows, "meta": meta}, indent=1) + "\n")


if __name__ == "__main__":
    main()
