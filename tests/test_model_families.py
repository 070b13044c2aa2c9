"""The paper's preset on model families beyond Llama (tiny random models, no download).

The paper's method needs only the keys and values a model's cache receives: GPT-2 (fused projections, no RoPE),
GPT-NeoX (partial rotary), Falcon (one KV head) and Gemma 2 (soft-capped logits) profile (through the cache,
``oakenkv.calibrate.recording.KVRecorder``, where the layer-by-layer recorder does not know the attention) and
decode from the packed pages. oaken-plus refuses BLOOM's attention with the reason, and leaves the key shift out for
Gemma 2's soft cap (``tests/test_plus.py`` has the families it folds into, GPT-2, GPT-NeoX, OPT and Falcon's three
layouts among them).
"""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch

from oakenkv import OakenCache
from oakenkv.calibrate.identity import kv_shape, layer_kinds
from oakenkv.calibrate.profile import profile_thresholds
from oakenkv.calibrate.transforms import TransformError
from oakenkv.hf.attention import enable_oaken_attention, float_attention
from oakenkv.util.compat import cache_kwargs

VOCAB = 97


def _model(family: str):
    import transformers as tf

    torch.manual_seed(0)
    if family == "gpt2":
        cfg = tf.GPT2Config(
            vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256, bos_token_id=0, eos_token_id=0
        )
    elif family == "gpt-neox":
        cfg = tf.GPTNeoXConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=256, rotary_pct=0.25,
        )  # fmt: skip
    elif family in ("falcon", "falcon-alibi"):
        cfg = tf.FalconConfig(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, multi_query=True,
            new_decoder_architecture=False, max_position_embeddings=256, alibi=family == "falcon-alibi",
        )  # fmt: skip
    else:
        cfg = tf.Gemma2Config(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, sliding_window=8, max_position_embeddings=256,
            attn_logit_softcapping=5.0,
        )  # fmt: skip
        cfg._attn_implementation = "eager"
    return tf.AutoModelForCausalLM.from_config(cfg).eval()


def test_kv_shape_reads_each_familys_config():
    import transformers as tf

    assert kv_shape(tf.GPT2Config(n_embd=64, n_head=4)) == (4, 16)
    assert kv_shape(tf.FalconConfig(hidden_size=64, num_attention_heads=4, multi_query=True)) == (1, 16)
    new = tf.FalconConfig(hidden_size=64, num_attention_heads=4, num_kv_heads=2, new_decoder_architecture=True)
    assert kv_shape(new) == (2, 16)
    llama = tf.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    assert kv_shape(llama) == (2, 32)


def test_layer_kinds_read_a_sliding_window_without_layer_types_as_transformers_does():
    import transformers as tf

    small = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 3}
    assert layer_kinds(tf.MistralConfig(**small, sliding_window=8)) == ["sliding_attention"] * 3
    assert layer_kinds(tf.MistralConfig(**small, sliding_window=None)) == ["full_attention"] * 3
    assert layer_kinds(tf.LlamaConfig(**small)) == ["full_attention"] * 3
    kinds = ["sliding_attention", "full_attention", "sliding_attention"]
    gemma = tf.Gemma3TextConfig(**small, sliding_window=8, layer_types=kinds)
    assert layer_kinds(gemma) == gemma.layer_types  # explicit layer types win


@pytest.mark.parametrize("family", ["mistral", "phi3"])
def test_a_sliding_window_without_layer_types_slides_and_evicts(family):
    """Mistral and Phi-3 configs give a ``sliding_window`` and no ``layer_types``; their attention masks slide on
    every layer (transformers' own caches read them so). The cache's layers slide too: a prompt far past the window
    releases its pages, with the same logits as a cache that keeps everything (the mask hides the same tokens)."""
    import transformers as tf

    torch.manual_seed(0)
    kw = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
          "sliding_window": 16}  # fmt: skip
    cfg = tf.MistralConfig(**kw) if family == "mistral" else tf.Phi3Config(**kw, pad_token_id=0)
    assert getattr(cfg, "layer_types", None) is None
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    profile = profile_thresholds(model, torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(1)))
    ids = torch.randint(0, VOCAB, (1, 400), generator=torch.Generator().manual_seed(2))
    logits, caches = [], []
    for evict in (True, False):
        cache = OakenCache.for_model(model, preset="oaken", profile=profile, evict_sliding=evict)
        with torch.no_grad():
            model(input_ids=ids, use_cache=True, **cache_kwargs(model, cache))
            step = model(input_ids=ids[:, -1:], use_cache=True, **cache_kwargs(model, cache)).logits
        assert all(layer.is_sliding and layer.sliding_window == 16 for layer in cache.layers)
        logits.append(step)
        caches.append(cache)
    assert torch.equal(logits[0], logits[1])
    store, seq = caches[0].store, caches[0].store.seqs[0]
    for i in range(2):  # the pages of tokens that left the window are released (whole pages), the rest kept
        table = store.pool.table(seq, 2 * i)
        assert table.evicted_before == 401 - 16
        released = table.evicted_before // store.pool.records_per_page(table.rec_size)
        assert (table.dense_pages.view == -1).sum() == released > 0
    assert caches[0].kv_bytes() < caches[1].kv_bytes()


@pytest.mark.parametrize("family", ["gpt2", "gpt-neox", "falcon", "falcon-alibi", "gemma2-softcap"])
def test_the_papers_preset_profiles_and_decodes_models_without_llama_style_attention(family, monkeypatch):
    """... and with ALiBi (Falcon adds its position bias to the attention mask, per head), where the packed kernels,
    which read a keep mask, would drop the bias: those layers read their pages back to floats (warned)."""
    import oakenkv.hf.attention as attention

    packed = []
    kernel = attention.packed_decode_attention
    monkeypatch.setattr(attention, "packed_decode_attention", lambda *a, **k: packed.append(1) or kernel(*a, **k))
    model = _model(family)
    kv_heads, head_dim = kv_shape(model.config)
    windows = torch.randint(0, VOCAB, (3, 48), generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # few calibration runs
        th = profile_thresholds(model, windows)
    assert (th.fingerprint.num_kv_heads, th.fingerprint.head_dim) == (kv_heads, head_dim)
    # a left-padded batch: row 1's padding attends to nothing (a softmax over all -inf must not give NaN keys)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    step = torch.randint(0, VOCAB, (2, 1), generator=torch.Generator().manual_seed(3))
    float_model = copy.deepcopy(model)
    cache = OakenCache.for_model(model, preset="oaken", profile=th)  # decode reads the packed pages
    reference = OakenCache(th, float_model)  # the same pages, read back as floats by the model's own attention
    logits = []
    alibi = family == "falcon-alibi"
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for m, c in ((model, cache), (float_model, reference)):
            m(input_ids=ids, attention_mask=mask, use_cache=True, **cache_kwargs(m, c))
            out = m(input_ids=step, attention_mask=torch.cat([mask, torch.ones_like(step)], 1), **cache_kwargs(m, c))
            logits.append(out.logits)
    assert cache.get_seq_length() == 13 and torch.isfinite(logits[0]).all()
    # each layer's decode step read the packed pages (the reference did not); with ALiBi their floats, warned
    assert len(packed) == (0 if alibi else 2)
    assert any("ALiBi" in str(w.message) for w in caught) == alibi
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)


@pytest.mark.filterwarnings("ignore:key smoothing disabled")
def test_oaken_plus_refuses_other_attention_modules_and_names_the_papers_preset():
    from oakenkv.calibrate.plus import PlusSearch, profile_plus

    windows = torch.randint(0, VOCAB, (2, 32))
    import transformers as tf

    torch.manual_seed(0)
    bloom = tf.BloomForCausalLM(tf.BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4)).eval()
    with pytest.raises(TransformError, match="preset='oaken' needs no transforms"):
        profile_plus(bloom, windows, PlusSearch(query_positions=8))


def test_oaken_plus_on_soft_capped_logits_searches_without_the_key_shift():
    """A soft cap is not shift-invariant, smoothing and rotations keep every score: on Gemma 2 the search leaves
    the key shift out (warned), the fold keeps the logits, and the cache decodes from the packed pages."""
    from oakenkv.calibrate.identity import ModelFingerprint
    from oakenkv.calibrate.plus import PlusSearch, apply_profile, profile_from_record, profile_plus
    from oakenkv.calibrate.recording import record_attention

    model = _model("gemma2-softcap")
    windows = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(4))
    with pytest.warns(UserWarning, match="without the key shift"):
        th = profile_plus(model, windows, PlusSearch(query_positions=16, alphas=(0.0, 0.5)))
    assert all(lt.key_shift is None for lt in th.transforms.layers)
    ids = torch.randint(0, VOCAB, (1, 20))
    with torch.no_grad():
        want = model(ids).logits
        torch.testing.assert_close(apply_profile(copy.deepcopy(model), th)(ids).logits, want, rtol=1e-4, atol=1e-4)
    cache = OakenCache.for_model(model, preset="oaken-plus", profile=th)
    with torch.no_grad():
        out = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False, **cache_kwargs(model, cache))
    assert cache.get_seq_length() == out.shape[1] - 1
    # a search asked for the shift anyway is refused at the layer, not run wrong
    record = record_attention(_model("gemma2-softcap"), windows, 1)
    fp = ModelFingerprint.from_model(_model("gemma2-softcap"))
    with pytest.raises(TransformError, match="soft-capped logits change under a key shift"):
        profile_from_record(record, fp, PlusSearch(query_positions=16), None)


def test_a_soft_capped_prompt_without_padding_stays_causal():
    """transformers' mask functions return no mask for an unpadded causal prompt and leave causality to SDPA's
    ``is_causal``; the soft-cap path (float attention: SDPA has no soft cap) of the oaken attention and of the
    calibration's recording must then mask the future themselves (they attended to every token)."""
    from oakenkv.calibrate.recording import _recording_attention

    model = _model("gemma2-softcap")  # eager attention; layer 1 is a full-attention layer
    ids = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = model(ids).logits
        with _recording_attention(model, lambda *a: None):
            torch.testing.assert_close(model(ids).logits, want, rtol=1e-5, atol=1e-5)
        oaken = copy.deepcopy(model)
        enable_oaken_attention(oaken)
        torch.testing.assert_close(oaken(ids).logits, want, rtol=1e-5, atol=1e-5)
    q, k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 1, 7, 8), torch.randn(1, 1, 7, 8)
    upper_left = torch.ones(5, 7, dtype=torch.bool).tril()  # SDPA's is_causal (a static cache's empty tail)
    got = float_attention(q, k, v, None, 0.3, is_causal=True)
    torch.testing.assert_close(got, float_attention(q, k, v, upper_left, 0.3), rtol=0, atol=0)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k.expand(1, 2, 7, 8), v.expand(1, 2, 7, 8), None,
                                                            is_causal=True, scale=0.3)  # fmt: skip
    torch.testing.assert_close(got, sdpa.transpose(1, 2), rtol=1e-5, atol=1e-6)


def test_a_fully_masked_query_gets_zeros_not_nan():
    q = torch.randn(1, 2, 3, 8)
    k, v = torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8)
    mask = torch.ones(1, 1, 3, 4, dtype=torch.bool)
    mask[0, 0, 0] = False  # query 0 may attend to nothing
    for softcap in (None, 5.0):
        out = float_attention(q, k, v, mask, 8**-0.5, softcap)
        assert torch.equal(out[0, 0], torch.zeros(2, 8))
        torch.testing.assert_close(out[:, 1:], float_attention(q[:, :, 1:], k, v, mask[:, :, 1:], 8**-0.5, softcap))


def test_learned_attention_sinks_are_refused():
    model = _model("gpt2")
    model.transformer.h[0].attn.sinks = torch.nn.Parameter(torch.zeros(4))  # as gpt-oss's attention carries
    with pytest.raises(NotImplementedError, match="attention sinks"):
        enable_oaken_attention(model)


def test_pre_rope_keys_of_a_model_without_rope_are_its_cached_keys():
    """KVQuant-style methods quantize pre-RoPE keys: GPT-2 applies no RoPE, so they are the keys it caches; GPT-NeoX
    rotates inside fused projections the recorder cannot undo, which it says."""
    from oakenkv.calibrate.recording import record_kv
    from oakenkv.calibrate.rope import has_rope

    model = _model("gpt2")
    ids = torch.randint(0, VOCAB, (1, 16))
    assert not has_rope(model)
    pre, post = record_kv(model, ids, "pre_rope"), record_kv(model, ids, "post_rope")
    for a, b in zip(pre[0] + pre[1], post[0] + post[1], strict=True):
        assert torch.equal(a, b)
    neox = _model("gpt-neox")
    assert has_rope(neox)
    with pytest.raises(NotImplementedError, match="cannot undo its RoPE"):
        record_kv(neox, ids, "pre_rope")


def test_calibration_windows_fit_the_models_positions():
    """oaken-plus calibrates on 2048-token windows; GPT-2 has 1024 positions (here 256): the windows shorten to
    them, with a warning, instead of an index error inside the model."""
    from oakenkv.calibrate.spec import CalibrationSpec

    model = _model("gpt2")
    with pytest.warns(UserWarning, match="longer than the model's 256 positions"):
        assert CalibrationSpec(samples=2, window=2048).fit(model).window == 256
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        short = CalibrationSpec(samples=2, window=128)
        assert short.fit(model) is short


def test_attention_that_bypasses_the_interface_is_refused_by_name_not_by_a_stack_error(monkeypatch):
    """A model whose attention does not go through transformers' attention interface (Falcon in transformers 5.19
    calls SDPA itself) records nothing: oaken-plus refuses it naming why (it failed on ``torch.stack`` of no
    tensors), and the paper's preset profiles it from its cache instead."""
    from oakenkv.calibrate import recording
    from oakenkv.calibrate.plus import PlusSearch, profile_plus

    monkeypatch.setattr(recording, "_recording_attention", lambda model, sink: contextlib.nullcontext())
    model = _model("gpt-neox")
    windows = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(4))
    with pytest.raises(TransformError, match="did not go through transformers' attention interface"):
        profile_plus(model, windows, PlusSearch(query_positions=8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        th = profile_thresholds(model, windows)
    assert th.fingerprint.num_layers == 2
