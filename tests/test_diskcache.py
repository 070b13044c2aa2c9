"""The calibration disk cache (src/oakenkv/calibrate/diskcache.py), one module for the paper's thresholds, the
oaken-plus profiles and the peers' ranges.

What must hold: a result is found by the content it was computed from (the model's weights, the calibration
windows' tokens, what was computed), never by a name; a file whose recorded identity is not its entry's (copied,
renamed, another model's) is not served but computed again with a warning naming what differs; an unreadable file
is computed again, not a crash. (tests/test_robustness.py holds the thresholds' and ranges' own cases.)
"""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

from oakenkv.calibrate.diskcache import CacheEntry, CalibrationKey, calibration_key, profile_cache_dir
from oakenkv.calibrate.identity import ModelFingerprint
from oakenkv.calibrate.spec import CalibrationSpec, calibration_windows


def _tiny_llama(seed: int = 0):
    """A random Llama reading the default tokenizer's ids (2 KV heads x 8); two seeds: a model and its fine-tune."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=49152, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture
def calib(tmp_path, monkeypatch):
    """A calibration text file of our own, and the cache in a temporary directory."""
    from oakenkv.assets.data import load_text

    monkeypatch.setenv("OAKENKV_CACHE", str(tmp_path / "cache"))
    text = tmp_path / "calib.txt"
    text.write_text(load_text("wikipedia")[:20000])
    return CalibrationSpec("file", samples=2, window=24, text_path=str(text))


def _key(weights: str | None = None, windows: str = "0" * 64) -> CalibrationKey:
    return CalibrationKey("m", ModelFingerprint("llama", 2, 2, 8, weights=weights), CalibrationSpec(), windows)


def test_an_entry_is_named_and_checked_by_its_content(tmp_path):
    entry = CacheEntry(_key(), "demo", {"q": 0.5}, ("demo", 0.5), directory=tmp_path)
    assert entry.path.parent == tmp_path and entry.path.name.startswith("demo-m-wikipedia-16x256-")
    assert entry.path.name.endswith(entry.digest[:16] + ".json")
    others = [
        CacheEntry(_key("sha256:" + "1" * 64), "demo", {"q": 0.5}, ("demo", 0.5), directory=tmp_path),
        CacheEntry(_key(windows="1" * 64), "demo", {"q": 0.5}, ("demo", 0.5), directory=tmp_path),
        CacheEntry(_key(), "demo", {"q": 0.25}, ("demo", 0.25), directory=tmp_path),
    ]
    assert len({entry.path, *(o.path for o in others)}) == 4  # every part of the content names the file

    def read(path):
        return json.loads(path.read_text())

    def recorded(d):
        return d["identity"]

    entry.store(json.dumps({"identity": entry.identity(), "value": 7}))
    assert entry.load(read, recorded, "demo", "recomputing")["value"] == 7
    for other, what in zip(others, ("model", "calibration windows", "q"), strict=True):
        other.path.write_bytes(entry.path.read_bytes())  # entry's file under the other's name
        with pytest.warns(UserWarning, match=f"the cached demo .* was made for another {what}; recomputing"):
            assert other.load(read, recorded, "demo", "recomputing") is None
    entry.path.write_text("{")  # torn
    with pytest.warns(UserWarning, match="ignoring the unreadable cached demo"):
        assert entry.load(read, recorded, "demo", "recomputing") is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert entry.load(read, recorded, "demo", "recomputing", quiet=True) is None  # (shipped files: silently)
    entry.path.unlink()
    assert entry.load(read, recorded, "demo", "recomputing") is None  # no file: no warning either


def test_a_cached_plus_profile_follows_the_model_and_the_windows(default_tokenizer, calib, monkeypatch):
    """The oaken-plus cache: a fine-tune at the same name, or an edited calibration text, is profiled again; a
    profile copied under another model's name is refused with a warning; the same model is served from disk."""
    from pathlib import Path

    import oakenkv.calibrate.plus as plus

    made = []
    real = plus.profile_plus_many
    monkeypatch.setattr(plus, "profile_plus_many", lambda *a, **k: made.append(1) or real(*a, **k))
    search = plus.PlusSearch(alphas=(0.0,), query_positions=8)
    a, b = _tiny_llama(0), _tiny_llama(1)
    pa = plus.cached_plus_profile(a, default_tokenizer, "same/name", calib, search)
    assert plus.cached_plus_profile(a, default_tokenizer, "same/name", calib, search).sha256() == pa.sha256()
    assert len(made) == 1
    pb = plus.cached_plus_profile(b, default_tokenizer, "same/name", calib, search)
    assert len(made) == 2 and pb.sha256() != pa.sha256()
    pb.check_model(b)
    windows = calibration_windows(default_tokenizer, calib)
    path_a = plus.plus_entry(calibration_key(a, "same/name", calib, windows), search).path
    path_b = plus.plus_entry(calibration_key(b, "same/name", calib, windows), search).path
    assert path_a.parent == profile_cache_dir() and path_a != path_b
    path_b.write_bytes(path_a.read_bytes())  # a's profile under b's name
    with pytest.warns(UserWarning, match="was made for another model"):
        again = plus.cached_plus_profile(b, default_tokenizer, "same/name", calib, search)
    # b's own profile, from its copy under the rounded digest (rounded_entry), put back under its name
    assert len(made) == 2 and again.sha256() == pb.sha256()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert plus.cached_plus_profile(b, default_tokenizer, "same/name", calib, search).sha256() == pb.sha256()
    for path in profile_cache_dir().glob("plus-*"):
        path.write_bytes(path_a.read_bytes())  # a's profile under every name: b is profiled again
    with pytest.warns(UserWarning, match="was made for another model"):
        again = plus.cached_plus_profile(b, default_tokenizer, "same/name", calib, search)
    assert len(made) == 3 and again.sha256() == pb.sha256()
    text = Path(calib.text_path)
    text.write_text(text.read_text()[5000:])  # the same spec, other text: other windows
    edited = plus.cached_plus_profile(a, default_tokenizer, "same/name", calib, search)
    assert len(made) == 4 and edited.profile["windows_sha256"] != pa.profile["windows_sha256"]
    # another search is another entry, not a replacement
    other = plus.PlusSearch(alphas=(0.0,), query_positions=8, key_shift=False)
    plus.cached_plus_profile(a, default_tokenizer, "same/name", calib, other)
    assert len(made) == 5
    assert plus.cached_plus_profile(a, default_tokenizer, "same/name", calib, search).sha256() == edited.sha256()
    assert len(made) == 5


def test_ranges_files_of_the_earlier_cache_are_still_read(default_tokenizer, calib, monkeypatch):
    """Before the cache was one module, a ranges file recorded the digest of its key; such a file is still served
    (not recomputed), and one recording another digest is not."""
    from oakenkv.calibrate import ranges as cal

    m = _tiny_llama(0)
    got = cal.kv_ranges(m, default_tokenizer, "m", calib)
    key = calibration_key(m, "m", calib, calibration_windows(default_tokenizer, calib))
    entry = cal._ranges_entry(key, 0.005)
    d = torch.load(entry.path, weights_only=True)
    d["identity"] = entry.digest  # as the earlier cache wrote it
    torch.save(d, entry.path)

    def no_recording(*a, **k):
        raise AssertionError("recomputed a valid cached file")

    monkeypatch.setattr(cal, "record_kv", no_recording)
    assert cal.kv_ranges(m, default_tokenizer, "m", calib).sha256() == got.sha256()
    d["identity"] = "0" * 64
    torch.save(d, entry.path)
    with pytest.warns(UserWarning, match="made for another"), pytest.raises(AssertionError, match="recomputed"):
        cal.kv_ranges(m, default_tokenizer, "m", calib)


def test_a_calibration_file_is_named_by_its_content_not_its_path(tmp_path):
    """The same text under two paths is one calibration (one label, one cache file name: an experiment that writes
    its text to a fresh temporary file reuses the search); an edited file is another; a file the reader would refuse
    (a pipe) is named by its path without being read (hashing a pipe would block)."""
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("def f():\n    return 1\n" * 50)
    b.write_bytes(a.read_bytes())
    tag = CalibrationSpec("file", 2, 24, str(a)).tag()
    assert tag == CalibrationSpec("file", 2, 24, str(b)).tag() and tag.startswith("file-") and tag.endswith("-2x24")
    b.write_text("def g():\n    return 2\n" * 50)
    assert CalibrationSpec("file", 2, 24, str(b)).tag() != tag
    key = CalibrationKey("m", ModelFingerprint("llama", 2, 2, 8), CalibrationSpec("file", 2, 24, str(a)), "0" * 64)
    assert CacheEntry(key, "demo", {}, ("demo",), directory=tmp_path).path.name.startswith(f"demo-m-{tag}-")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert CalibrationSpec("file", 2, 24, str(fifo)).tag().startswith("file-")  # (returns: nothing read)


def test_a_profile_made_in_one_dtype_is_found_for_the_other(default_tokenizer, calib, monkeypatch):
    """The same weights loaded in float32 and in bfloat16 share a profile: the one made for either is found for the
    other from the cache (kept under the rounded digest too), accepted with OtherDtypeWarning, folded into the
    copy and checked again later by the fold record; another checkpoint in bfloat16 is profiled anew. For the
    oaken-plus search and the paper's thresholds, in both directions."""
    import oakenkv.calibrate.plus as plus
    import oakenkv.calibrate.profile as prof
    from oakenkv.calibrate.match import check_profile_model
    from oakenkv.calibrate.thresholds import OtherDtypeWarning
    from oakenkv.format.config import OakenConfig

    made = []
    real_plus, real_thr = plus.profile_plus_many, prof.profile_thresholds
    monkeypatch.setattr(plus, "profile_plus_many", lambda *a, **k: made.append("plus") or real_plus(*a, **k))
    monkeypatch.setattr(prof, "profile_thresholds", lambda *a, **k: made.append("thr") or real_thr(*a, **k))
    search = plus.PlusSearch(alphas=(0.0,), query_positions=8)
    fp32, bf16 = _tiny_llama(0), _tiny_llama(0).to(torch.bfloat16)
    th = plus.cached_plus_profile(fp32, default_tokenizer, "m", calib, search)
    assert made == ["plus"] and th.fingerprint.weights_bf16 is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # found by the rounded digest, silently: the model check says it
        found = plus.cached_plus_profile(bf16, default_tokenizer, "m", calib, search)
    assert made == ["plus"] and found.sha256() == th.sha256()
    with pytest.warns(OtherDtypeWarning, match="another dtype"):
        plus.apply_profile(bf16, found)
    assert plus.is_folded(bf16) is not None
    with pytest.warns(OtherDtypeWarning):
        check_profile_model(found, bf16)  # the folded copy, by its fold record
    plus.cached_plus_profile(_tiny_llama(1).to(torch.bfloat16), default_tokenizer, "m", calib, search)
    assert made == ["plus", "plus"]  # a fine-tune is not the same weights
    # the paper's thresholds, made on the bfloat16 copy first
    fresh = _tiny_llama(0).to(torch.bfloat16)
    t16 = prof.cached_thresholds(fresh, default_tokenizer, "m", OakenConfig(), calib)
    t32 = prof.cached_thresholds(_tiny_llama(0), default_tokenizer, "m", OakenConfig(), calib)
    assert made == ["plus", "plus", "thr"] and t32.sha256() == t16.sha256()
    with pytest.warns(OtherDtypeWarning):
        t32.check_model(_tiny_llama(0))
