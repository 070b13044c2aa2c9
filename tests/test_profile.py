"""Tests of oakenkv.calibrate.profile: KV recording and profiling the real default model (the statistics:
tests/test_stats.py)."""

from __future__ import annotations

import time
import warnings

import pytest
import torch

from oakenkv.calibrate.profile import FewRunsWarning, profile_thresholds, record_kv
from oakenkv.calibrate.thresholds import (
    TIMING_KEYS,
    DuplicateThresholdsWarning,
    ModelFingerprint,
    Thresholds,
    weights_digest,
)
from oakenkv.format.config import OakenConfig
from oakenkv.util.compat import cache_kwargs

# ---------------------------------------------------------------------------------------------- real model


@pytest.fixture(scope="module")
def calib_ids(default_tokenizer):
    from oakenkv.assets.data import load_text, token_windows

    return token_windows(default_tokenizer, load_text("wikipedia"), 128, max_windows=6)


@pytest.fixture(scope="module")
def profiled(default_model, calib_ids) -> Thresholds:
    with pytest.warns(FewRunsWarning, match="6 runs"):
        return profile_thresholds(default_model.model, calib_ids, name="default")


@pytest.mark.model
def test_post_rope_recording_is_what_the_cache_stores(default_model, calib_ids):
    from transformers import DynamicCache

    ids = calib_ids[:1, :32]
    keys, values = record_kv(default_model.model, ids)
    cache = DynamicCache(config=default_model.model.config)
    with torch.inference_mode():
        default_model.model(ids, **cache_kwargs(default_model.model, cache), use_cache=True)
    assert len(keys) == len(cache.layers) == 30
    for i in (0, 17, 29):
        assert keys[i].shape == (1, 3, 32, 64)
        assert torch.equal(keys[i], cache.layers[i].keys)
        assert torch.equal(values[i], cache.layers[i].values)


@pytest.mark.model
def test_pre_rope_recording_undoes_rope(default_model, calib_ids):
    ids = calib_ids[:2, :48]
    attn = default_model.model.model.layers[5].self_attn
    captured = {}
    hook = attn.k_proj.register_forward_hook(lambda m, a, out: captured.__setitem__("k", out))
    try:
        pre, _ = record_kv(default_model.model, ids, "pre_rope")
    finally:
        hook.remove()
    ref = captured["k"].view(2, 48, 3, 64).transpose(1, 2)  # k_proj output as [B, H, S, D]
    torch.testing.assert_close(pre[5], ref, rtol=0, atol=1e-4 * ref.abs().max().item())
    post, _ = record_kv(default_model.model, ids)
    assert not torch.allclose(post[5][:, :, 1:], ref[:, :, 1:])  # RoPE changed positions > 0 ...
    torch.testing.assert_close(post[5][:, :, 0], ref[:, :, 0])  # ... and is the identity at position 0
    assert not attn._forward_pre_hooks  # the recorder removed its hooks


@pytest.mark.model
def test_profile_real_model(profiled, default_model, calib_ids, tmp_path):
    th = profiled
    th.check_model(default_model.model.config)
    assert th.fingerprint == ModelFingerprint("llama", 30, 3, 64)
    # the profile records the digest of the weights it was made with, and checking the model compares it
    t0 = time.perf_counter()
    digest = weights_digest(default_model.model)
    seconds = time.perf_counter() - t0
    assert th.fingerprint.weights == digest
    th.check_model(default_model.model)
    # every byte of the 135M fp32 parameters (538 MB) is hashed; ~0.5 s on 2 busy cores (docs/robustness.md)
    assert seconds < 5.0, f"weights_digest took {seconds:.1f} s"
    assert th.num_layers == 30
    runs, seq = calib_ids.shape
    for kind in ("key", "value"):
        tuples = {th.layer(i, kind).as_tuple() for i in range(30)}
        assert len(tuples) == 30, f"{kind} thresholds repeat across layers"
        for i in range(30):
            st = th.stats(i, kind)
            assert st.num_runs == runs and st.num_samples == runs * seq * 3 * 64
            assert st.outer_ratio == 0.04 and st.inner_ratio == 0.06 and st.adjustments == ()
            assert st.kurtosis > 1.0
    assert th.profile["runs"] == runs and th.profile["window"] == seq
    # The outer thresholds of keys are much wider than those of values in early layers (known for Llama-like
    # models): a sanity check that keys and values were not swapped.
    assert th.layer(0, "key").to_hi > 5 * th.layer(0, "value").to_hi
    with warnings.catch_warnings():
        warnings.simplefilter("error", DuplicateThresholdsWarning)
        assert Thresholds.load(th.save(tmp_path / "t.json"), expect=th.fingerprint) == th


@pytest.mark.model
def test_the_layer_by_layer_profile_is_the_whole_forward_passes_bit_for_bit(default_model, calib_ids, monkeypatch):
    """profile_thresholds runs layer by layer (stream_attention) by default; through the whole model one window at
    a time (KVRecorder) where it cannot: the same profile, and the same again on a lazily loaded model."""
    import oakenkv.calibrate.profile as profile
    from oakenkv.assets.lazy import lazy_weights, load_lazy
    from oakenkv.calibrate.recording import StreamingUnsupported

    ids = calib_ids[:3, :48]

    def decided(th: Thresholds) -> dict:
        d = th.to_dict()
        for k in TIMING_KEYS:
            d["profile"].pop(k, None)
        return d

    with pytest.warns(FewRunsWarning):
        streamed = profile_thresholds(default_model.model, ids)
    lazy = load_lazy(default_model.source)
    with pytest.warns(FewRunsWarning):
        lazily = profile_thresholds(lazy, ids)
    assert lazy_weights(lazy).reads < 4 * 32  # a few reads of each unit, not one per window

    def unsupported(*args, **kwargs):
        raise StreamingUnsupported("(test)")

    monkeypatch.setattr(profile, "stream_attention", unsupported)
    with pytest.warns(FewRunsWarning):
        whole = profile_thresholds(default_model.model, ids)
    assert decided(streamed) == decided(whole) == decided(lazily)


@pytest.mark.model
def test_batching_does_not_change_the_result(default_model, calib_ids):
    ids = calib_ids[:2, :64]
    with pytest.warns(FewRunsWarning):
        a = profile_thresholds(default_model.model, ids, batch_size=1)
    with pytest.warns(FewRunsWarning):
        b = profile_thresholds(default_model.model, ids, batch_size=2)
    for i in range(30):
        for kind in ("key", "value"):
            torch.testing.assert_close(
                torch.tensor(a.layer(i, kind).as_tuple()),
                torch.tensor(b.layer(i, kind).as_tuple()),
                rtol=1e-4,
                atol=1e-5,
            )


@pytest.mark.model
def test_kurtosis_tuning_adjusts_and_records(default_model, calib_ids):
    ids = calib_ids[:2, :64]
    with pytest.warns(FewRunsWarning):
        plain = profile_thresholds(default_model.model, ids)
    with pytest.warns(FewRunsWarning):
        tuned = profile_thresholds(default_model.model, ids, kurtosis_tuning=True)
    assert tuned.profile["kurtosis_tuning"] is True
    high = low = 0
    for i in range(30):
        for kind in ("key", "value"):
            st, p, t = tuned.stats(i, kind), plain.layer(i, kind), tuned.layer(i, kind)
            assert st.kurtosis == pytest.approx(plain.stats(i, kind).kurtosis)
            if st.kurtosis > 20:
                high += 1
                assert st.outer_ratio == pytest.approx(0.045) and "outer_ratio +0.005" in st.adjustments[0]
                assert t.to_hi < p.to_hi and t.to_lo > p.to_lo  # more outliers: tighter outer thresholds
            else:
                assert st.outer_ratio == 0.04 and (t.to_lo, t.to_hi) == (p.to_lo, p.to_hi)
            if st.kurtosis < 5:
                low += 1
                assert st.inner_ratio == pytest.approx(0.057) and "inner_ratio -0.003" in st.adjustments[-1]
                assert t.ti_hi - t.ti_lo < p.ti_hi - p.ti_lo
            else:
                assert st.inner_ratio == 0.06 and (t.ti_lo, t.ti_hi) == (p.ti_lo, p.ti_hi)
    assert high > 0 and low > 0  # the default model has both kinds of layers, so both branches ran


@pytest.mark.model
def test_held_out_group_fractions_match_the_ratios(profiled, default_model):
    """Thresholds profiled on the calibration text split held-out WikiText-2 close to 4 / 90 / 6."""
    from oakenkv.assets.data import load_text, token_windows
    from oakenkv.quant.quantizer import GROUP_INNER, GROUP_OUTER, assign_groups

    ev = token_windows(default_model.tokenizer, load_text("wikitext2"), 256, max_windows=2)
    keys, values = record_kv(default_model.model, ev)
    outer, inner = [], []
    for i in range(30):
        for kind, x in (("key", keys[i]), ("value", values[i])):
            g = assign_groups(x, profiled.layer(i, kind))
            outer.append((g == GROUP_OUTER).float().mean().item())
            inner.append((g == GROUP_INNER).float().mean().item())
            # Per layer: loose, the profile used only 6 short runs.
            assert 0.015 < outer[-1] < 0.09, f"layer {i} {kind}: outer fraction {outer[-1]:.4f}"
            assert 0.025 < inner[-1] < 0.11, f"layer {i} {kind}: inner fraction {inner[-1]:.4f}"
    assert sum(outer) / len(outer) == pytest.approx(0.04, abs=0.008)
    assert sum(inner) / len(inner) == pytest.approx(0.06, abs=0.01)


@pytest.mark.model
def test_profile_rejects_bad_windows(default_model):
    with pytest.raises(ValueError, match="int64"):
        profile_thresholds(default_model.model, torch.zeros(2, 8))
    with pytest.raises(ValueError, match="int64"):
        profile_thresholds(default_model.model, torch.zeros(8, dtype=torch.int64))
    with pytest.raises(ValueError, match="batch_size"):
        profile_thresholds(default_model.model, torch.zeros(1, 8, dtype=torch.int64), batch_size=0)
    with pytest.raises(ValueError, match="inner_center"):
        profile_thresholds(default_model.model, torch.zeros(1, 8, dtype=torch.int64), inner_center="x")


@pytest.mark.model
def test_pre_rope_config_is_recorded(default_model, calib_ids):
    with pytest.warns(FewRunsWarning):
        th = profile_thresholds(default_model.model, calib_ids[:1, :32], OakenConfig(key_position="pre_rope"))
    assert th.config.key_position == "pre_rope" and th.profile["key_position"] == "pre_rope"


# ---------------------------------------------------------------------------------------------- CLI


@pytest.mark.model
def test_cli_profile_and_inspect(default_model, tmp_path, capsys):
    """`oakenkv profile` writes a valid file with distinct layers and warns below 100 samples; `inspect` reads it."""
    from typer.testing import CliRunner

    from oakenkv.cli import app, run

    out = tmp_path / "t.json"
    runner = CliRunner()
    # --threads set to the current count: exercises the option without changing the session's torch state.
    threads = str(torch.get_num_threads())
    res = runner.invoke(app, ["profile", "--samples", "2", "--window", "32", "--threads", threads, "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "warning: profiling with 2 runs" in res.output
    th = Thresholds.load(out, expect=ModelFingerprint.from_model_config(default_model.model.config))
    assert th.profile["runs"] == 2 and th.profile["window"] == 32 and th.profile["data"] == "wikipedia"
    assert len({g.as_tuple() for g in th.keys}) == 30 and len({g.as_tuple() for g in th.values}) == 30

    res = runner.invoke(app, ["inspect", str(out)])
    assert res.exit_code == 0, res.output
    assert "30 layers" in res.output and "value thresholds per decoder layer" in res.output
    (tmp_path / "bad.json").write_text(out.read_text()[:100])
    capsys.readouterr()
    assert run(["inspect", str(tmp_path / "bad.json")]) == 2  # the console script's path: one error line, code 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "corrupt JSON" in err and err.count("\n") == 1


@pytest.mark.model
def test_cli_profile_on_your_own_text_file_and_a_short_text_warns(default_model, tmp_path):
    """`oakenkv profile --data file --data-path F` calibrates on a plain text file (the domain a user serves); a text
    too short for the windows asked for says so, there and in the evaluation's calibration, instead of calibrating on
    less under a label that says otherwise."""
    from typer.testing import CliRunner

    from oakenkv.assets.data import token_windows
    from oakenkv.calibrate.spec import CalibrationSpec, calibration_windows
    from oakenkv.cli import app

    tok = default_model.tokenizer
    text = "def f(x):\n    return x + 1\n\n" * 12
    n = token_windows(tok, text, 32).shape[0]
    assert 1 <= n < 9  # fewer windows of 32 tokens than the 9 asked for below
    src = tmp_path / "code.py.txt"
    src.write_text(text, encoding="utf-8")
    out = tmp_path / "t.json"
    res = CliRunner().invoke(
        app,
        ["profile", "--data", "file", "--data-path", str(src), "--samples", "9", "--window", "32", "--out", str(out)],
    )
    assert res.exit_code == 0, res.output
    assert f"holds only {n} window" in res.output and "fewer than the 9 asked for" in res.output
    th = Thresholds.load(out, expect=ModelFingerprint.from_model_config(default_model.model.config))
    assert th.profile["runs"] == n and th.profile["data"] == "file" and th.profile["data_path"] == str(src)
    with pytest.warns(UserWarning, match=f"holds only {n} window.* fewer than the 9 asked for"):
        ids = calibration_windows(tok, CalibrationSpec("file", 9, 32, str(src)))
    assert torch.equal(ids, token_windows(tok, text, 32))


def test_inspect_shows_the_group_ratios_each_layer_was_set_for():
    """oaken-plus chooses each layer's and kind's group ratios: inspect printed only the config's 4% / 6%, which
    no layer of the shipped profile uses. It says the layers have their own, and the tables list them."""
    from typer.testing import CliRunner

    from oakenkv.calibrate.plus import SHIPPED_PROFILES
    from oakenkv.cli import app

    path = next(SHIPPED_PROFILES.glob("plus-default-wikipedia-*.json"))
    th = Thresholds.load(path)
    res = CliRunner().invoke(app, ["inspect", str(path)], env={"COLUMNS": "300"})
    assert res.exit_code == 0, res.output
    assert "60 of 60 layer rows have their own" in res.output
    st = th.stats(0, "value")
    row = next(line for line in res.output.splitlines() if "value thresholds" in line)
    table = res.output.split(row, 1)[1].strip("\n").splitlines()
    assert table[0].split()[:7] == ["layer", "to_lo", "ti_lo", "ti_hi", "to_hi", "outer", "inner"]
    assert table[1].split()[:7] == [
        "0",
        *(f"{v:+.4f}" for v in th.layer(0, "value").as_tuple()),
        f"{st.outer_ratio:.2%}",
        f"{st.inner_ratio:.2%}",
    ]
