"""``oakenkv diagnose`` (src/oakenkv/apps/diagnose.py): the verdict finds a fixed-channel key outlier planted in a tiny
random Llama and none in a clean one; the oaken-plus round trip is measured in the model's frame; the report on the
default model holds every field, with SQNRs in a sensible order; bad input is refused in one line."""

from __future__ import annotations

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from oakenkv.apps.diagnose import FIXED_CHANNEL_SHARE, diagnose
from oakenkv.apps.diagnose_report import plot_diagnosis
from oakenkv.apps.diagnose_stats import channel_stats, top_k_channels, window_thresholds
from oakenkv.calibrate.thresholds import ModelFingerprint, Thresholds
from oakenkv.calibrate.transforms import LayerTransforms, Transforms
from oakenkv.cli import app
from oakenkv.format.config import OakenConfig

HEAD_DIM = 16
#: The planted channel: KV head 1, dimension 7. Llama's RoPE pairs dimension i with i + 8 and rotates pair 7 the
#: slowest (1e4 ** -(14 / 16) rad per token, 0.04 rad over a window), so it stays in its channel after RoPE.
PLANTED_LAYER, PLANTED_HEAD, PLANTED_DIM = 1, 1, 7
PLANTED = PLANTED_HEAD * HEAD_DIM + PLANTED_DIM


def tiny_llama(plant: str | None = None, seed: int = 0):
    """A random 2-layer Llama (4 query heads, 2 KV heads of 16); ``plant="scale"`` multiplies the planted channel's
    ``k_proj`` row by 30 (a large channel of either sign), ``plant="bias"`` gives it a constant bias of 5."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=HEAD_DIM,
        max_position_embeddings=256,
        attention_bias=plant == "bias",
    )
    model = LlamaForCausalLM(cfg).eval()
    k_proj = model.model.layers[PLANTED_LAYER].self_attn.k_proj
    with torch.no_grad():
        if plant == "scale":
            k_proj.weight[PLANTED] *= 30.0
        elif plant == "bias":
            for layer in model.model.layers:
                layer.self_attn.k_proj.bias.zero_()
            k_proj.bias[PLANTED] = 5.0
    return model


@pytest.fixture(scope="module")
def windows():
    return torch.randint(0, 256, (2, 96), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("plant", ["scale", "bias"])
def test_the_verdict_finds_a_planted_fixed_channel(plant, windows):
    diag = diagnose(tiny_llama(plant), windows, name=f"tiny-{plant}")
    v = diag.verdict
    assert v["fixed_channel_key_outliers"], v["lines"][0]
    assert v["fixed_channel_layers"] == [PLANTED_LAYER]
    planted = diag.layers[PLANTED_LAYER].keys
    assert planted.outer_channels[0] == PLANTED and planted.absmax_channels[0] == PLANTED
    assert diag.channel_name(PLANTED) == f"h{PLANTED_HEAD}:c{PLANTED_DIM}"
    assert f"h{PLANTED_HEAD}:c{PLANTED_DIM}" in v["lines"][0] and "YES" in v["lines"][0]
    assert planted.absmax_ratio > 5 and planted.outer_share >= FIXED_CHANNEL_SHARE
    # a bias is a per-channel offset (what a key shift removes); a scaled row is not
    assert v["key_offsets"] == (plant == "bias")
    if plant == "bias":
        assert v["key_offset_layers"] == [PLANTED_LAYER]
        assert planted.mean_ratio > 0.5 and PLANTED in planted.constant_sign
        assert diag.layers[PLANTED_LAYER].keys_pre_rope.offset_power > 0.5
    # the values and the other layer are untouched
    assert not diag.layers[0].fixed_channel_keys
    assert diag.layers[PLANTED_LAYER].values.absmax_ratio < 10


def test_a_clean_model_has_no_fixed_channel_outliers(windows):
    diag = diagnose(tiny_llama(None), windows, name="tiny", plus_missing="no rotary here")
    v = diag.verdict
    assert not v["fixed_channel_key_outliers"] and not v["key_offsets"], v["lines"]
    assert v["lines"][0].startswith("fixed-channel key outliers: no")
    assert v["lines"][2] == "oaken-plus: not available for this model: no rotary here"
    for layer in diag.layers:
        assert layer.keys.outer_share < FIXED_CHANNEL_SHARE / 2
        assert layer.keys.absmax_ratio < 5


def test_channel_stats_on_a_hand_made_tensor():
    x = torch.zeros(1, 2, 5, 4)  # [R, H, S, hd]: 8 channels, 4 tokens after the first
    x[0, 1, :, 2] = torch.tensor([100.0, 5.0, 5.0, 6.0, 5.0])  # channel 6: constant sign; token 0 (the sink) skipped
    x[0, 0, 1:, 0] = torch.tensor([1.0, -1.0, 0.25, -0.25])  # channel 0: zero mean, two outer values
    s = channel_stats(x, -0.5, 0.5, top_k=1)
    assert s.outer_channels == (6,) and s.outer_share == pytest.approx(4 / 6)
    assert s.outer_fraction == pytest.approx(6 / 32) and s.uniform_share == 1 / 8
    assert s.absmax_channels == (6,) and s.absmax_ratio == math.inf  # the median channel is all zeros
    assert s.mean_channel == 6 and s.mean_ratio == pytest.approx(21 / 4 / 6) and s.constant_sign == (6,)
    # power of the means / power: channel 6 mean 5.25, mean square 27.75; channel 0 mean 0, mean square 0.53125
    assert s.offset_power == pytest.approx(5.25**2 / (27.75 + 0.53125))
    s = channel_stats(x + 1.0, 0.5, 3.0, top_k=1, skip_first=False)  # now the sink token counts
    assert s.outer_channels[0] == 6 and s.outer_share == pytest.approx(5 / 6)
    assert s.absmax_ratio == pytest.approx(101 / 1)
    assert top_k_channels(192) == 4 and top_k_channels(32) == 1


def _plus_profile(model, windows, paper: Thresholds, scale: float) -> Thresholds:
    """A hand-made oaken-plus profile: every key divided by ``scale`` (folded), thresholds scaled alike."""
    cfg = model.config
    h, n = cfg.num_key_value_heads, cfg.num_hidden_layers
    lt = LayerTransforms(key_scale=(scale,) * (h * HEAD_DIM))
    keys = [tuple(t / scale for t in paper.layer(i, "key").as_tuple()) for i in range(n)]
    return Thresholds(
        paper.config,
        paper.fingerprint,
        tuple(keys),
        paper.values,
        transforms=Transforms((lt,) * n, h, HEAD_DIM),
    )


def test_oaken_plus_is_measured_in_the_models_frame(windows):
    """Keys x 2 (a folded scale of 0.5) with thresholds x 2 quantize to exactly twice what Oaken stores (doubling is
    exact, even of an fp16 subnormal scale), so
    oaken-plus must measure exactly Oaken's SQNR: the folded scale is undone before the error is taken."""
    from oakenkv.apps.diagnose import record_windows

    model = tiny_llama("scale")
    keys, values = record_windows(model, windows)
    n = len(keys)
    paper = Thresholds(
        OakenConfig(),
        ModelFingerprint.from_model_config(model.config),
        tuple(window_thresholds(keys[i], OakenConfig(), i, "key") for i in range(n)),
        tuple(window_thresholds(values[i], OakenConfig(), i, "value") for i in range(n)),
    )
    diag = diagnose(model, windows, thresholds=paper, plus_profile=_plus_profile(model, windows, paper, 0.5))
    for layer in diag.layers:
        assert layer.sqnr["oaken-plus"]["key"] == pytest.approx(layer.sqnr["oaken"]["key"], abs=1e-9)
        assert layer.sqnr["oaken-plus"]["value"] == pytest.approx(layer.sqnr["oaken"]["value"], abs=1e-9)
        assert layer.plus["key_smoothing"] and not layer.plus["key_shift"]
    assert "key smoothing in 2/2" in diag.verdict["oaken_plus"]
    with pytest.raises(ValueError, match="paper"):
        diagnose(model, windows, thresholds=_plus_profile(model, windows, paper, 0.5))


def test_diagnosis_of_the_default_model(default_model, tmp_path):
    from oakenkv.calibrate.plus import DEFAULT_RATIOS, PlusSearch, profile_plus
    from oakenkv.calibrate.profile import CalibrationSpec, calibration_windows

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        w = calibration_windows(default_model.tokenizer, CalibrationSpec(samples=1, window=128))
        search = PlusSearch(alphas=(0.0, 0.5), ratios=DEFAULT_RATIOS[::2], query_runs=1, query_positions=16)
        profile = profile_plus(default_model.model, w, search, name="default")
        diag = diagnose(default_model.model, w, plus_profile=profile, name="default")
    finally:
        torch.set_num_threads(previous)
    d = json.loads(json.dumps(diag.to_dict(), allow_nan=False))  # strict JSON
    assert d["model"] == "default" and d["top_k"] == 4 and d["head_dim"] == 64
    assert d["calibration"]["windows"] == 1 and d["calibration"]["window"] == 128
    assert len(d["layers"]) == 30
    for key in ("fixed_channel_key_outliers", "fixed_channel_layers", "key_offsets", "oaken_plus", "lines"):
        assert key in d["verdict"]
    layer = d["layers"][3]
    for kind in ("keys", "keys_pre_rope", "values"):
        for field in ("outer_share", "uniform_share", "outer_channels", "absmax_ratio", "absmax_channels"):
            assert field in layer[kind]
        assert len(layer[kind]["absmax_rel"]) == 192
        assert {"mean_ratio", "offset_power", "constant_sign"} <= set(layer[kind])
    assert set(layer["plus"]) >= {"key_shift", "key_rotation", "key_alpha", "value_rotation", "key_ratios"}
    methods = d["methods"]
    assert set(methods) == {"oaken", "oaken-plus", "int4", "kivi4", "kvquant4", "fp8"}
    for m in methods.values():
        for kind in ("key", "value"):
            assert math.isfinite(m[kind]["sqnr_db"]) and 4 <= m[kind]["bits"] <= 8
    for kind in ("key", "value"):
        db = {name: m[kind]["sqnr_db"] for name, m in methods.items()}
        assert db["fp8"] > db["int4"] and db["oaken"] > db["int4"], db
        assert 10 < db["int4"] < db["fp8"] < 40, db
    assert methods["kivi4"]["key"]["sqnr_db"] > methods["int4"]["key"]["sqnr_db"]  # per-channel keys help
    assert methods["fp8"]["key"]["bits"] == 8 and methods["int4"]["key"]["bits"] == pytest.approx(4.5)
    assert 5.0 < methods["oaken"]["key"]["bits"] < 5.8
    assert d["verdict"]["lines"][2].startswith("oaken-plus will use: key shift in")
    assert 0.2 < d["key_mean_power"] < 0.95  # the default model's keys carry large per-channel offsets
    png = plot_diagnosis(diag, tmp_path / "heat.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


runner = CliRunner()


def test_the_command_prints_and_writes_the_diagnosis(default_model, tmp_path, monkeypatch):
    """End to end, kept cheap: the paper profile the command asks the profile cache for is a 2 x 64-token one
    made here (instead of the default 16 x 256), and nothing is written to the real cache."""
    from oakenkv.calibrate.profile import CalibrationSpec, calibration_windows, profile_thresholds

    monkeypatch.setattr("oakenkv.calibrate.diskcache.profile_cache_dir", lambda: tmp_path)
    tok = default_model.tokenizer
    w = calibration_windows(tok, CalibrationSpec(samples=2, window=64))
    with pytest.warns(UserWarning):  # few runs
        th = profile_thresholds(default_model.model, w, name="default")
    monkeypatch.setattr("oakenkv.calibrate.profile.cached_thresholds", lambda *args, **kwargs: th)
    out = tmp_path / "d.json"
    args = ["diagnose", "--no-plus", "--samples", "1", "--window", "64", "--json", str(out)]
    args += ["--png", str(tmp_path / "d.png"), "--threads", "1"]
    result = runner.invoke(app, args, env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    d = json.loads(out.read_text())
    for line in d["verdict"]["lines"]:  # printed as they are in the file
        assert line[:60] in " ".join(result.output.split()), line
    assert "channels per layer" in result.output and "reconstruction SQNR" in result.output
    assert d["calibration"] == {
        "windows": 1,
        "window": 64,
        "text": "wikipedia",
        "text_path": None,
        "paper_thresholds": "wikipedia-16x256",
    }
    assert "oaken-plus" not in d["methods"] and (tmp_path / "d.png").stat().st_size > 10_000
    # without --json the report is the output (the whole diagnosis as JSON followed it: ~23,000 lines)
    plain = runner.invoke(app, [*args[: args.index("--json")], "--threads", "1"], env={"COLUMNS": "250"})
    assert plain.exit_code == 0 and "reconstruction SQNR" in plain.output, plain.output
    assert '"verdict"' not in plain.output and len(plain.output.splitlines()) < 300


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--samples", "0"], "samples"),
        (["--window", "1"], "window"),
        (["--png", "heat.jpg"], "must name a .png file"),
        (["--calib-text", "novels"], "must be 'wikipedia'"),
        (["--calib-path", "/nonexistent/text.txt"], "does not exist"),
        (["--model", "no-such-model"], "Unknown model 'no-such-model'"),
    ],
)
def test_bad_input_is_refused_in_one_line(args, message, capsys):
    from oakenkv.cli import run

    assert run(["diagnose", "--no-plus", *args]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines


def test_help_explains_the_command():
    result = runner.invoke(app, ["diagnose", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for opt in ("--samples", "--window", "--plus", "--no-plus", "--json", "--png"):
        assert opt in result.output
