"""Oaken-vs-FP helpers used by `oakenkv generate` and the demo (src/oakenkv/apps/generate.py)."""

from __future__ import annotations

import math

import pytest
import torch

from kv_helpers import quick_thresholds
from oakenkv.apps.generate import generate_text, oaken_window_nll
from oakenkv.hf.cache import serial_numba


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    with serial_numba():
        yield
    torch.set_num_threads(previous)


def test_window_nll_and_stored_bits(default_model):
    from oakenkv.apps.demo import window_nll
    from oakenkv.assets.data import load_text, token_windows

    thr = quick_thresholds(default_model)
    ids = token_windows(default_model.tokenizer, load_text("wikitext2"), 128, max_windows=2)
    fp_nll, n = window_nll(default_model.model, ids)
    nll, n2, bits, nbytes = oaken_window_nll(default_model.model, ids, thr)
    assert n2 == n
    fp_ppl, ppl = math.exp(fp_nll / n), math.exp(nll / n)
    print(f"perplexity FP {fp_ppl:.3f} Oaken {ppl:.3f}; bits {bits}")
    assert ppl != fp_ppl and abs(ppl / fp_ppl - 1) < 0.15  # quantized, but close
    # D = 192: 4 (nibbles) + 96/192 (scales) + 16/192 (header) + 8 x outliers ~ 5.4 bits; pages add more.
    assert 5.0 < bits["format"] < 6.0
    assert bits["with_pages"] > bits["format"]
    assert nbytes * 8 == pytest.approx(bits["with_pages"] * 2 * 30 * 2 * 127 * 192)  # (the last token: a target)
    # the demo's window is eval ppl's: the same forward (the window but its last token), so the same NLL; storing the
    # last token too changed the projections' shapes, whose last bits quantization amplified (0.41 nats of 886)
    from oakenkv.eval.ppl import window_nll as eval_window_nll
    from oakenkv.hf.cache import OakenCache

    one, _, _, _ = oaken_window_nll(default_model.model, ids[:1], thr)
    assert one == pytest.approx(eval_window_nll(default_model.model, ids[0], OakenCache(thr, default_model.model))[0])


def test_generate_text_reports_bytes(default_model):
    thr = quick_thresholds(default_model)
    g = generate_text(default_model, "Name a color.", thr, max_new_tokens=4)
    fp = generate_text(default_model, "Name a color.", None, max_new_tokens=4)
    assert g.new_tokens == fp.new_tokens == 4
    assert fp.kv_bytes == fp.fp32_kv_bytes
    assert g.fp32_kv_bytes == fp.fp32_kv_bytes and g.kv_bytes < g.fp32_kv_bytes


def test_timed_generate_splits_prefill_and_decode(default_model):
    from transformers import DynamicCache

    from oakenkv.apps.generate import timed_generate

    model, tok = default_model.model, default_model.tokenizer
    ids = tok(["Name a color.", "Name a fruit!"], return_tensors="pt").input_ids
    out, t = timed_generate(
        model, ids, DynamicCache(config=model.config), max_new_tokens=5, exact_length=True, pad_token_id=0
    )
    assert out.shape == (2, ids.shape[1] + 5)
    assert (t.batch, t.prompt_tokens, t.new_tokens, len(t.step_s)) == (2, ids.shape[1], 5, 4)
    assert t.prefill_s > 0 and all(s > 0 for s in t.step_s)
    assert t.tokens_per_s == pytest.approx(2 * 4 / sum(t.step_s))
    assert t.prefill_tokens_per_s == pytest.approx(2 * ids.shape[1] / t.prefill_s)
    assert t.total_s == pytest.approx(t.prefill_s + t.decode_s)
    d = t.to_dict()
    assert d["decode_step_ms"] == pytest.approx(1e3 * t.decode_s / 4) and len(d["step_ms"]) == 4


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma3"])
def test_the_fp32_reference_bytes_are_what_a_float32_transformers_cache_holds(family):
    """The compression the apps print is against what transformers' own float32 cache holds: every token of a
    full-attention layer, the window's of a sliding one (Mistral slides on every layer, Gemma 3 on some); counting
    every token there printed a sliding model's Oaken cache as 4.78x smaller when it was 2.25x larger."""
    import transformers as tf
    from transformers import DynamicCache

    from oakenkv.apps.generate import fp32_kv_bytes
    from oakenkv.hf.cache import kv_bytes

    small = {"vocab_size": 64, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 4,
             "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
    cfg = {
        "llama": lambda: tf.LlamaConfig(**small),
        "mistral": lambda: tf.MistralConfig(**small, sliding_window=8),
        "gemma3": lambda: tf.Gemma3TextConfig(**small, head_dim=16, sliding_window=8, sliding_window_pattern=2),
    }[family]()
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.arange(30)[None] % 64, use_cache=True, past_key_values=cache)
    assert fp32_kv_bytes(model.config, 30) == kv_bytes(cache)


def test_a_cache_larger_than_its_reference_is_said_to_be_larger():
    from oakenkv.apps.generate import size_against

    assert size_against(171_008, 35_776) == "4.78x smaller"
    assert size_against(27_648, 33_504) == "1.21x larger"
    assert size_against(100, 100) == "the same"
