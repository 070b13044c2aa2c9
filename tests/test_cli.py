"""The `oakenkv` command: --help, info and demo (in-process through typer's runner, and the console script)."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from typer.testing import CliRunner

from oakenkv.cli import app

runner = CliRunner()


def test_help_lists_the_commands():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0, result.output
    assert "info" in result.output and "demo" in result.output


def test_no_help_text_is_eaten_as_rich_markup():
    """typer renders help through rich, which takes ``[word...]`` as a markup tag and drops it: "Calibration
    windows [default: 16]." printed as "Calibration windows .". A property over every command and option."""
    import re

    from kv_helpers import cli_commands

    texts = 0
    for path, cmd in cli_commands():
        for where, text in [("", cmd.help), *((p.name, getattr(p, "help", None)) for p in cmd.params)]:
            assert not re.search(r"\[/?[a-zA-Z]", text or ""), (path, where, text)
            texts += bool(text)
    assert texts > 150
    result = runner.invoke(app, ["eval", "ppl", "--help"], env={"COLUMNS": "250"})
    assert "Calibration windows (default: 16)." in " ".join(result.output.split())


def test_console_script_is_installed():
    exe = shutil.which("oakenkv") or str(Path(sys.executable).parent / "oakenkv")
    result = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "demo" in result.stdout


def test_info_reports_default_model_and_each_data_source_found():
    from oakenkv.apps.info import collect_info

    info = collect_info()
    for name in ("default", "gemma3-270m"):
        assert info["models"][name]["found"], info["models"][name]["note"]
    for name in ("wikitext2", "wikipedia", "piqa", "winogrande", "hellaswag"):
        assert info["data"][name]["found"], info["data"][name]["note"]
    assert info["versions"]["torch"] and info["threads"]["torch"] >= 1
    json.dumps(info)  # JSON-able

    result = runner.invoke(app, ["info"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "MISSING" not in result.output
    assert "wiki.test.raw" in result.output and "SmolLM2-135M-Instruct.Q4_1.gguf" in result.output


def test_demo_prints_fp_perplexity_and_writes_json(default_model, tmp_path):
    out = tmp_path / "demo.json"
    args = [
        "demo",
        "--windows",
        "2",
        "--window",
        "64",
        "--max-new-tokens",
        "4",
        "--json",
        str(out),
        "--preset",
        "oaken",
    ]
    result = runner.invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "WikiText-2 perplexity" in result.output and "FP" in result.output
    res = json.loads(out.read_text())
    assert res["data"] == {"text": "wikitext2", "windows": 2, "window": 64}
    assert res["fp"]["tokens"] == 2 * 63
    assert 1.0 < res["fp"]["perplexity"] < 200 and math.isfinite(res["fp"]["nll"])
    assert res["config"] == {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64, "dtype": "float32"}
    assert 1 <= res["generation"]["new_tokens"] <= 4
    assert "oaken_plus" not in res and 1.0 < res["oaken"]["perplexity"] < 200


def test_demo_runs_oaken_plus_beside_oaken_without_touching_the_model(default_model, tmp_path):
    from oakenkv.calibrate.transforms import is_folded

    out = tmp_path / "demo.json"
    args = ["demo", "--windows", "1", "--window", "64", "--max-new-tokens", "3", "--json", str(out)]
    args += ["--plus-samples", "2", "--plus-window", "96"]  # a tiny oaken-plus calibration keeps this quick
    result = runner.invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "oaken-plus" in result.output and "Oaken, the paper's" in result.output
    res = json.loads(out.read_text())
    fp, plus, oaken = res["fp"]["perplexity"], res["oaken_plus"]["perplexity"], res["oaken"]["perplexity"]
    assert res["oaken_plus"]["tokens"] == res["oaken"]["tokens"] == 63
    # both quantize (not FP's exact number) and neither is broken; bits stay the paper's budget (10% sparse)
    assert plus != fp and oaken != fp and fp / 2 < plus < 2 * fp and fp / 2 < oaken < 2 * fp
    assert abs(res["oaken_plus"]["bits_per_value"]["format"] - res["oaken"]["bits_per_value"]["format"]) < 0.5
    assert 1 <= res["oaken_plus_generation"]["new_tokens"] <= 3
    assert is_folded(default_model.model) is None  # the transforms went into a copy


def test_generate_runs_oaken_plus_with_the_papers_oaken_beside_it(default_model):
    args = ["generate", "--prompt", "The capital of France is", "--max-new-tokens", "3", "--no-chat"]
    result = runner.invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "--- oaken-plus (" in result.output and "--- oaken (" in result.output
    assert result.output.count("KV cache:") == 2  # the shipped profile of the default model: no profiling here
    only = runner.invoke(app, [*args, "--preset", "oaken"], env={"COLUMNS": "200"})
    assert only.exit_code == 0 and "oaken-plus" not in only.output and only.output.count("KV cache:") == 1


def test_window_nll_matches_transformers_loss(default_model):
    import torch

    from oakenkv.apps.demo import window_nll
    from oakenkv.assets.data import load_text, token_windows

    ids = token_windows(default_model.tokenizer, load_text("wikitext2"), 48, max_windows=2)
    nll, n = window_nll(default_model.model, ids)
    assert n == 2 * 47
    with torch.inference_mode():
        losses = [default_model.model(input_ids=row[None], labels=row[None]).loss for row in ids]
    assert math.isclose(nll / n, float(sum(losses)) / 2, rel_tol=1e-4)


def test_bench_generate_runs_a_selected_point_and_rejects_bad_points(default_model, tmp_path):
    out = tmp_path / "gen.json"
    args = ["bench", "generate", "--points", "8x1", "--methods", "dynamic", "--new-tokens", "2", "--rounds", "1"]
    result = runner.invoke(app, [*args, "--json", str(out)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    res = json.loads(out.read_text())
    assert res["meta"]["points"] == ["8x1"] and res["results"]["dynamic"]["8x1"]["new_tokens"] == 2
    bad = runner.invoke(app, ["bench", "generate", "--points", "8by1", "--methods", "dynamic"])
    assert bad.exit_code != 0 and "PROMPTxBATCH" in bad.output


def _tiny_profiled_checkpoint(tokenizer, tmp_path, dtype, preset: str):
    """A tiny random Llama saved in ``dtype`` with ``tokenizer`` at ``tmp_path / "tiny"`` (returned), and its
    ``preset`` profile, made on it read in float32 as oakenkv loads it, at ``tmp_path / "thr.json"``."""
    import torch
    import transformers as tf

    from oakenkv.calibrate.plus import PlusSearch, profile_plus
    from oakenkv.calibrate.profile import profile_thresholds

    src = tmp_path / "tiny"
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    tf.LlamaForCausalLM(cfg).to(dtype).save_pretrained(src)
    tokenizer.save_pretrained(src)
    model = tf.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    ids = torch.randint(0, 1000, (2, 32), generator=torch.Generator().manual_seed(1))
    if preset == "oaken":
        profile_thresholds(model, ids, name="tiny").save(tmp_path / "thr.json")
    else:
        profile_plus(model, ids, PlusSearch(alphas=(0.0,), query_positions=8), name="tiny").save(tmp_path / "thr.json")
    return src


@pytest.mark.parametrize("preset", ["oaken", "oaken-plus"])
def test_export_of_a_bfloat16_checkpoint_writes_bfloat16_weights(default_model, tmp_path, preset):
    """oakenkv loads a model in float32 and folds the transforms there; the export of a checkpoint saved in
    bfloat16 is written in bfloat16 (not twice its bytes in float32), and the command says so. Its profile still
    fits it, read back in bfloat16 or in float32 (the fold record holds the cast weights' digests)."""
    import torch
    import transformers as tf

    from oakenkv.calibrate.match import check_profile_model
    from oakenkv.calibrate.thresholds import OtherDtypeWarning, Thresholds

    src = _tiny_profiled_checkpoint(default_model.tokenizer, tmp_path, torch.bfloat16, preset)
    out = tmp_path / "export"
    args = ["export", "--model", str(src), "--preset", preset, "--profile", str(tmp_path / "thr.json")]
    res = runner.invoke(app, [*args, "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert (
        "is saved in bfloat16: oakenkv loaded it in float32, folded the profile there and wrote the export in "
        "bfloat16" in " ".join(res.output.split())
    )
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    written = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    assert written < 1.1 * sum(f.stat().st_size for f in src.glob("*.safetensors"))  # the checkpoint's bytes
    th = Thresholds.load(out / "oakenkv-profile.json")
    for dtype in (torch.bfloat16, torch.float32):
        back = tf.AutoModelForCausalLM.from_pretrained(out, dtype=dtype)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            check_profile_model(th, back)
        other_dtype = [w for w in seen if issubclass(w.category, OtherDtypeWarning)]
        # the profile was made on the float32 reading: the paper's preset read back in bfloat16 fits it by the
        # rounded digest; the folded export read back in float32 fits its fold record (bfloat16 weights) by it
        assert bool(other_dtype) == ((dtype == torch.bfloat16) == (preset == "oaken")), [str(w.message) for w in seen]


def test_a_float32_export_read_back_in_bfloat16_fits_its_profile(default_model, tmp_path):
    """``vllm serve DIR --dtype bfloat16`` of a float32 export is what docs/vllm.md shows; the profile fitted it, but
    the export read back in bfloat16 by transformers (to compare with vLLM) was refused: "weights changed after
    oaken-plus transforms were folded". The fold record now holds the folded weights' rounded digest too."""
    import torch
    import transformers as tf

    from oakenkv.calibrate.match import check_profile_model
    from oakenkv.calibrate.thresholds import OtherDtypeWarning, Thresholds

    src = _tiny_profiled_checkpoint(default_model.tokenizer, tmp_path, torch.float32, "oaken-plus")
    out = tmp_path / "export"
    args = ["export", "--model", str(src), "--preset", "oaken-plus", "--profile", str(tmp_path / "thr.json")]
    assert runner.invoke(app, [*args, "--out", str(out)]).exit_code == 0
    th = Thresholds.load(out / "oakenkv-profile.json")
    check_profile_model(th, tf.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32))
    with pytest.warns(OtherDtypeWarning):
        check_profile_model(th, tf.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16))


def test_export_refuses_a_profile_of_the_other_preset_in_the_flags_words(tmp_path):
    """Checked before the model loads, and said with the command's flags (the API's message says preset='...')."""
    from oakenkv.calibrate.plus import SHIPPED_PROFILES

    plus = next(SHIPPED_PROFILES.glob("plus-default-wikipedia-*.json"))
    args = ["export", "--model", "default", "--preset", "oaken", "--profile", str(plus), "--out", str(tmp_path / "x")]
    res = runner.invoke(app, args, env={"COLUMNS": "300"})
    assert res.exit_code == 2
    assert "not a profile of --preset oaken; use --preset oaken-plus" in " ".join(res.output.split())
    assert not (tmp_path / "x").exists()
    # a profile of another slot width (it was said after the model loaded)
    from oakenkv.calibrate.thresholds import Thresholds

    three = tmp_path / "three.json"
    th = Thresholds.load(plus)
    dataclasses.replace(th, config=th.config.replace(middle_bits=3, inner_bits=4, outer_bits=4)).save(three)
    args = ["export", "--model", "default", "--profile", str(three), "--out", str(tmp_path / "x")]
    res = runner.invoke(app, args, env={"COLUMNS": "300"})
    assert res.exit_code == 2 and "3-bit dense slots, --preset oaken-plus to 4-bit ones" in " ".join(res.output.split())
    assert not (tmp_path / "x").exists()
    from oakenkv.integrations.vllm import check_profile

    with pytest.raises(ValueError, match="blocks hold 4-bit dense slots, not 3-bit ones"):
        check_profile(Thresholds.load(three), three)  # (the plugin at start, for such a profile named by its path)


@pytest.mark.parametrize("preset", ["oaken-plus-3", "oaken-plus-7"])
def test_export_refuses_a_preset_the_plugin_cannot_serve(preset, tmp_path):
    """The plugin's blocks hold 4-bit dense slots: an export of another width was written, then refused by vLLM at
    start. Refused now before any work, by the CLI and by ``export_model``."""
    from oakenkv.integrations.vllm.export import export_model

    out = tmp_path / "x"
    res = runner.invoke(app, ["export", "--preset", preset, "--out", str(out)], env={"COLUMNS": "300"})
    said = " ".join(res.output.split())
    assert res.exit_code == 2 and "4-bit dense slots" in said and "export 'oaken-plus' or 'oaken'" in said, said
    with pytest.raises(ValueError, match=f"preset '{preset}': the vLLM plugin's blocks hold 4-bit dense slots"):
        export_model(None, None, out, preset)
    assert not out.exists()
