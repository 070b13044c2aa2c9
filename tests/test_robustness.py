"""Issue 23's rules as properties: bad input never gives a silently wrong number.

1. A cached or resumed result is identified by the content of every input, never by a name or a path.
2. Validation happens in the arithmetic used (float32).
3. Untrusted bytes are checked completely by every public decoder (fuzzed, bounded).
4. Every file write is atomic and readable by the group (tests/test_paths.py).
5. Every user error at the CLI is one ``error:`` line, exit code 2, no traceback, before any expensive work.
6. What is recorded is what ran.
7. Resource limits are checked up front.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from oakenkv.config import OakenConfig

# ---------------------------------------------------------------------------------------------- helpers


def tiny_llama(seed: int = 0, layers: int = 2, vocab: int = 49152):
    """A randomly initialised Llama (2 KV heads x 8) that reads the default tokenizer's ids: no download, ~0.2 s.
    Two seeds are "the same model path after a fine-tune": same shape, other weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return LlamaForCausalLM(cfg).eval()


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


# ---------------------------------------------------------------------------------------------- rule 1


@pytest.fixture
def calib(tmp_path):
    """A calibration spec over a text file of our own, and an empty cache directory."""
    from oakenkv.data import load_text
    from oakenkv.profile import CalibrationSpec

    text = tmp_path / "calib.txt"
    text.write_text(load_text("wikipedia")[:20000])
    cache = tmp_path / "cache"
    cache.mkdir()
    return CalibrationSpec("file", samples=2, window=24, text_path=str(text)), cache


def test_a_cached_profile_follows_the_model_not_its_name(default_tokenizer, calib, monkeypatch):
    """The issue's example: a model changed at the same path reused the old profile (7.22 instead of 5.39 bits)
    or crashed (`layer index 20 out of range`). Every variation of the model at one name gets its own profile."""
    import oakenkv.profile as prof
    from oakenkv.thresholds import weights_digest

    spec, cache = calib
    runs = []
    real = prof.profile_thresholds
    monkeypatch.setattr(prof, "profile_thresholds", lambda *a, **k: runs.append(1) or real(*a, **k))
    cfg = OakenConfig()
    models = {"a": tiny_llama(0), "b (fine-tuned a)": tiny_llama(1), "c (3 layers)": tiny_llama(0, layers=3)}
    got = {}
    for label, m in models.items():
        thr = prof.cached_thresholds(m, default_tokenizer, "same/path", cfg, spec, cache_dir=cache)
        assert thr.fingerprint.weights == weights_digest(m), label
        assert thr.num_layers == m.config.num_hidden_layers
        thr.check_model(m)
        got[label] = thr
    assert len(runs) == 3
    assert got["a"].keys != got["b (fine-tuned a)"].keys
    # each is read back from the cache, not profiled again, and is the same profile
    for label, m in models.items():
        again = prof.cached_thresholds(m, default_tokenizer, "same/path", cfg, spec, cache_dir=cache)
        assert again == got[label] and again.fingerprint.weights == got[label].fingerprint.weights
    assert len(runs) == 3


def test_a_cached_file_is_checked_against_the_key_when_read(default_tokenizer, calib):
    """A cache file whose content is not what its name promises (copied, renamed, or an old oakenkv's) is not
    served: the model, windows, config and tuning recorded inside are compared."""
    from oakenkv.profile import cached_thresholds, calibration_key, calibration_windows, thresholds_cache_path

    spec, cache = calib
    a, b = tiny_llama(0), tiny_llama(1)
    cfg = OakenConfig()
    thr_a = _quiet(cached_thresholds, a, default_tokenizer, "m", cfg, spec, cache_dir=cache)
    ids = calibration_windows(default_tokenizer, spec)
    path_a = thresholds_cache_path(calibration_key(a, "m", spec, ids), cfg, cache_dir=cache)
    path_b = thresholds_cache_path(calibration_key(b, "m", spec, ids), cfg, cache_dir=cache)
    assert path_a.is_file() and path_a != path_b
    path_b.write_bytes(path_a.read_bytes())  # a's profile under b's name
    with pytest.warns(UserWarning, match="made for another model"):
        thr_b = cached_thresholds(b, default_tokenizer, "m", cfg, spec, cache_dir=cache)
    assert thr_b.keys != thr_a.keys
    path_b.write_text("{")  # torn: profiled again, not a crash
    with pytest.warns(UserWarning, match="unreadable cached profile"):
        assert cached_thresholds(b, default_tokenizer, "m", cfg, spec, cache_dir=cache) == thr_b


def test_a_cached_profile_follows_the_calibration_text(default_tokenizer, calib):
    """Editing the calibration text in place (same path, same spec) gives a new profile."""
    from pathlib import Path

    from oakenkv.profile import cached_thresholds

    spec, cache = calib
    m = tiny_llama(0)
    before = _quiet(cached_thresholds, m, default_tokenizer, "m", OakenConfig(), spec, cache_dir=cache)
    text = Path(spec.text_path)
    text.write_text(text.read_text()[5000:])
    after = _quiet(cached_thresholds, m, default_tokenizer, "m", OakenConfig(), spec, cache_dir=cache)
    assert after.profile["windows_sha256"] != before.profile["windows_sha256"] and after.keys != before.keys


def test_cached_ranges_follow_the_model(default_tokenizer, calib, monkeypatch):
    from oakenkv.eval import calibration as cal

    spec, cache = calib
    monkeypatch.setattr(cal, "_cache_dir", lambda: cache)
    a, b = tiny_llama(0), tiny_llama(1)
    ra = cal.kv_ranges(a, default_tokenizer, "m", spec)
    rb = cal.kv_ranges(b, default_tokenizer, "m", spec)
    assert ra.key_extremes != rb.key_extremes
    assert cal.kv_ranges(a, default_tokenizer, "m", spec).sha256() == ra.sha256()
    assert len(list(cache.glob("ranges-*.pt"))) == 2


def test_a_resumed_ppl_run_refuses_another_profile_or_model(default_tokenizer, calib, tmp_path, monkeypatch):
    """The issue's example: a resumed `eval ppl` mixed two threshold profiles when the file was re-profiled
    between the interrupt and the rerun. The checkpoint holds the digests of what the run depends on."""
    import oakenkv.eval.ppl as ppl_mod
    from oakenkv.data import load_text, token_windows
    from oakenkv.eval.methods import build_method
    from oakenkv.eval.ppl import perplexity
    from oakenkv.profile import CalibrationSpec, cached_thresholds

    spec, cache = calib
    a = tiny_llama(0)
    ids = token_windows(default_tokenizer, load_text("wikitext2"), 16, max_windows=3)
    thr1 = _quiet(cached_thresholds, a, default_tokenizer, "m", OakenConfig(), spec, cache_dir=cache)
    spec2 = CalibrationSpec("file", samples=3, window=24, text_path=spec.text_path)
    thr2 = _quiet(cached_thresholds, a, default_tokenizer, "m", OakenConfig(), spec2, cache_dir=cache)
    f = tmp_path / "thr.json"
    thr1.save(f)
    m1 = build_method("oaken", a, default_tokenizer, "m", thresholds=str(f))
    ckpt = tmp_path / "run.partial.json"
    real, calls = ppl_mod.window_nll, []

    def interrupted(*args, **kwargs):
        if len(calls) == 1:
            raise KeyboardInterrupt
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(ppl_mod, "window_nll", interrupted)
    with pytest.raises(KeyboardInterrupt):
        perplexity(a, ids, m1, model_name="m", checkpoint=ckpt)
    monkeypatch.setattr(ppl_mod, "window_nll", real)
    thr2.save(f)  # re-profiled at the same path
    m2 = build_method("oaken", a, default_tokenizer, "m", thresholds=str(f))
    assert m2.name == m1.name and m2.params == m1.params  # the names alone cannot tell the runs apart
    with pytest.raises(ValueError, match="differs in settings_sha256"):
        perplexity(a, ids, m2, model_name="m", checkpoint=ckpt)
    b = tiny_llama(1)  # the model changed at the same path (b's own profile, same method spec)
    thr1b = _quiet(cached_thresholds, b, default_tokenizer, "m", OakenConfig(), spec, cache_dir=cache)
    mb = build_method("oaken", b, default_tokenizer, "m", thresholds=thr1b)
    with pytest.raises(ValueError, match="model_weights"):
        perplexity(b, ids, mb, model_name="m", checkpoint=ckpt)
    thr1.save(f)  # the original profile again: the run resumes and records what ran
    m1 = build_method("oaken", a, default_tokenizer, "m", thresholds=str(f))
    res = perplexity(a, ids, m1, model_name="m", checkpoint=ckpt)
    assert res.extra["thresholds_sha256"] == thr1.sha256() and not ckpt.exists()
    whole = perplexity(a, ids, m1, model_name="m")
    assert res.window_nll == whole.window_nll
    assert json.loads(json.dumps(res.to_dict()))["extra"]["model_weights"].startswith("sha256:")
