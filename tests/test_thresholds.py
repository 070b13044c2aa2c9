"""Tests of oakenkv.calibrate.thresholds: validation, the JSON file format, and the model fingerprint check."""

from __future__ import annotations

import json
import math
import warnings
from types import SimpleNamespace

import pytest

from oakenkv.calibrate.thresholds import (
    SCHEMA_VERSION,
    DuplicateThresholdsWarning,
    GroupThresholds,
    LayerStats,
    ModelFingerprint,
    ModelMismatchError,
    OtherDtypeWarning,
    Thresholds,
    ThresholdsFileError,
    UnverifiedWeightsWarning,
    weights_digest,
)
from oakenkv.format.config import OakenConfig

FP = ModelFingerprint("llama", 3, 2, 8, name="tiny")


def _thr(i: int, scale: float = 1.0) -> GroupThresholds:
    # Distinct per layer: identical layers would warn.
    s = scale * (1.0 + 0.1 * i)
    return GroupThresholds(-2.0 * s, -0.1 * s, 0.12 * s, 2.5 * s)


def _stats(i: int) -> LayerStats:
    return LayerStats(
        kurtosis=3.0 + i,
        num_samples=1000,
        num_runs=4,
        outer_ratio=0.04,
        inner_ratio=0.06,
        run_std=(0.1, 0.01, 0.01, 0.1),
        adjustments=("x",) if i == 0 else (),
    )


def make(fp: ModelFingerprint = FP, with_stats: bool = True, **kw) -> Thresholds:
    n = fp.num_layers
    return Thresholds(
        config=kw.pop("config", OakenConfig()),
        fingerprint=fp,
        keys=tuple(_thr(i) for i in range(n)),
        values=tuple(_thr(i, 0.5) for i in range(n)),
        key_stats=tuple(_stats(i) for i in range(n)) if with_stats else None,
        value_stats=tuple(_stats(i) for i in range(n)) if with_stats else None,
        profile={"window": 16, "source": "test"},
        **kw,
    )


# ------------------------------------------------------------------------------------- GroupThresholds


def test_group_thresholds_accepts_ordered_and_equal_inner():
    g = GroupThresholds(-3, -0.5, 0.5, 3)
    assert g.as_tuple() == (-3.0, -0.5, 0.5, 3.0)
    assert all(isinstance(v, float) for v in g.as_tuple())
    GroupThresholds(-1.0, 0.0, 0.0, 1.0)  # empty inner group is legal


@pytest.mark.parametrize(
    "vals",
    [
        (-1.0, -1.0, 0.5, 2.0),  # to_lo == ti_lo
        (-1.0, 0.6, 0.5, 2.0),  # ti_lo > ti_hi
        (-1.0, -0.5, 2.0, 2.0),  # ti_hi == to_hi
        (3.0, -0.5, 0.5, 2.0),  # to_lo above everything
    ],
)
def test_group_thresholds_rejects_unordered(vals):
    with pytest.raises(ValueError, match="to_lo < ti_lo <= ti_hi < to_hi"):
        GroupThresholds(*vals)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("pos", range(4))
def test_group_thresholds_rejects_non_finite(bad, pos):
    vals = [-2.0, -0.1, 0.1, 2.0]
    vals[pos] = bad
    with pytest.raises(ValueError, match="finite"):
        GroupThresholds(*vals)


def test_group_thresholds_rejects_non_numbers():
    with pytest.raises(ValueError, match="number"):
        GroupThresholds(-1.0, "0", 0.1, 1.0)
    with pytest.raises(ValueError, match="number"):
        GroupThresholds(-1.0, False, True, 2.0)
    with pytest.raises(ValueError, match="4 numbers"):
        GroupThresholds.from_sequence([1.0, 2.0, 3.0])
    assert GroupThresholds.from_sequence(GroupThresholds(-1, 0, 0, 1)) == GroupThresholds(-1, 0, 0, 1)


# ---------------------------------------------------------------------------------------------- fingerprint


def test_fingerprint_from_llama_like_config():
    cfg = SimpleNamespace(
        model_type="llama",
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        hidden_size=576,
    )
    fp = ModelFingerprint.from_model_config(cfg)
    assert (fp.architecture, fp.num_layers, fp.num_kv_heads, fp.head_dim) == ("llama", 30, 3, 64)


def test_fingerprint_prefers_explicit_head_dim_and_text_config():
    text = SimpleNamespace(
        model_type="gemma3_text",
        num_hidden_layers=18,
        num_attention_heads=4,
        num_key_value_heads=1,
        hidden_size=640,
        head_dim=256,
    )
    outer = SimpleNamespace(get_text_config=lambda decoder: text)
    fp = ModelFingerprint.from_model_config(outer)
    assert (fp.architecture, fp.num_layers, fp.num_kv_heads, fp.head_dim) == ("gemma3_text", 18, 1, 256)


def test_fingerprint_name_is_not_compared_and_validation():
    assert ModelFingerprint("llama", 3, 2, 8, name="a") == ModelFingerprint("llama", 3, 2, 8, name="b")
    with pytest.raises(ValueError, match="num_layers"):
        ModelFingerprint("llama", 0, 2, 8)
    with pytest.raises(ValueError, match="architecture"):
        ModelFingerprint("", 1, 2, 8)


def test_check_model_names_both_models():
    th = make()
    other = SimpleNamespace(
        model_type="llama", num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, hidden_size=32
    )
    with pytest.raises(ModelMismatchError, match=r"3 layers.*4 layers") as ei:
        th.check_model(other)
    assert isinstance(ei.value, ValueError)
    same = SimpleNamespace(
        model_type="llama", num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, hidden_size=32
    )
    th.check_model(same)  # no error


# ---------------------------------------------------------------------------------------------- weights digest


def _tiny_llama(seed: int = 0, tie: bool = False):
    """A randomly initialised 3-layer Llama of FP's shape (2 KV heads, head_dim 8): no download, ~0.1 s."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tie,
    )
    return LlamaForCausalLM(cfg).eval()


def test_weights_digest_is_the_content_of_every_tensor():
    import torch

    a, b = _tiny_llama(0), _tiny_llama(0)
    d = weights_digest(a)
    assert d.startswith("sha256:") and len(d) == 7 + 64
    assert weights_digest(b) == d  # same numbers under the same names: same digest (not the object's identity)
    with torch.no_grad():
        # any single element of any tensor, however small the change
        p = b.model.layers[2].mlp.down_proj.weight
        p[5, 7] = torch.nextafter(p[5, 7], torch.tensor(1.0))
    assert weights_digest(b) != d
    assert weights_digest(_tiny_llama(1)) != d  # same shape, other weights (a "fine-tune")
    assert weights_digest(_tiny_llama(0).to(torch.bfloat16)) != d  # same weights in another dtype


def test_weights_digest_is_remembered_until_a_tensor_changes(monkeypatch):
    import torch

    import oakenkv.calibrate.thresholds as thresholds_module

    m = _tiny_llama(0)
    d = weights_digest(m)

    class _NoHashing:
        def __getattr__(self, name):
            raise AssertionError("hashed again")

    with monkeypatch.context() as patch:
        patch.setattr(thresholds_module, "hashlib", _NoHashing())
        assert weights_digest(m) == d  # nothing changed: no byte hashed
    p = m.model.layers[1].self_attn.k_proj.weight
    with torch.no_grad():
        p.mul_(2.0)  # an in-place op: torch's version counter moves
    doubled = weights_digest(m)
    assert doubled != d and doubled == weights_digest(m, reuse=False)
    with torch.no_grad():
        p.div_(2.0)
    assert weights_digest(m) == d
    p.data = p.data.clone() + 1.0  # a replaced tensor: another storage
    assert weights_digest(m) != d
    m.load_state_dict(_tiny_llama(0).state_dict())
    assert weights_digest(m) == d
    p.data.add_(1.0)  # a write torch may not count: reuse=False hashes again
    fresh = weights_digest(m, reuse=False)
    assert fresh != d and weights_digest(m) == fresh


def test_weights_digest_hashes_tied_tensors_once_under_both_names():
    import torch

    tied = _tiny_llama(0, tie=True)
    assert tied.lm_head.weight.data_ptr() == tied.model.embed_tokens.weight.data_ptr()
    untied = _tiny_llama(0, tie=False)
    with torch.no_grad():
        untied.load_state_dict(tied.state_dict())
    assert untied.lm_head.weight.data_ptr() != untied.model.embed_tokens.weight.data_ptr()
    assert weights_digest(tied) == weights_digest(untied)  # the content, not the storage layout


def test_weights_digest_refuses_meta_tensors():
    import torch

    with torch.device("meta"):
        m = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="meta"):
        weights_digest(m)


def test_fingerprint_weights_round_trip_and_validation(tmp_path):
    digest = weights_digest(_tiny_llama(0))
    fp = ModelFingerprint("llama", 3, 2, 8, name="tiny", weights=digest)
    assert fp == FP  # the digest is compared by check_fingerprint, not by ==
    back = Thresholds.load(make(fp).save(tmp_path / "t.json"))
    assert back.fingerprint.weights == digest
    assert json.loads((tmp_path / "t.json").read_text())["model"]["weights"] == digest
    for bad in ("sha256:xyz", "md5:" + "0" * 32, 3):
        with pytest.raises(ValueError, match="weights"):
            ModelFingerprint("llama", 3, 2, 8, weights=bad)


def test_check_model_compares_the_weights():
    model, other = _tiny_llama(0), _tiny_llama(1)
    th = make(ModelFingerprint.from_model(model, name="tiny"))
    assert th.fingerprint == FP and th.fingerprint.weights == weights_digest(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        th.check_model(model)  # the same weights: no error, no warning
        th.check_model(model.config)  # the config alone: the shape only, as asked
    with pytest.raises(ModelMismatchError, match="other weights of the same shape"):
        th.check_model(other)
    with pytest.raises(ModelMismatchError, match="other weights"):
        th.check_fingerprint(ModelFingerprint.from_model(other))


def test_the_rounded_digest_is_the_same_weights_in_float32_and_bfloat16():
    """``rounded_weights_digest``: a float32 model and its bfloat16 copy are the same weights (their exact digests
    differ); another checkpoint of the shape is not, nor is a change beyond bfloat16's precision."""
    import torch

    from oakenkv.calibrate.identity import rounded_weights_digest

    a, bf16 = _tiny_llama(0), _tiny_llama(0).to(torch.bfloat16)
    assert weights_digest(a) != weights_digest(bf16)
    assert rounded_weights_digest(a) == rounded_weights_digest(bf16) == rounded_weights_digest(bf16.float())
    assert rounded_weights_digest(a) != weights_digest(bf16)  # never mistaken for an exact digest
    assert rounded_weights_digest(_tiny_llama(1)) != rounded_weights_digest(a)
    with torch.no_grad():
        p = a.model.layers[2].mlp.down_proj.weight
        p[5, 7] = p[5, 7] * 1.5  # far beyond a bfloat16 rounding
    assert rounded_weights_digest(a) != rounded_weights_digest(bf16)


def test_a_profile_serves_its_weights_in_the_other_dtype_with_a_warning(tmp_path):
    """A profile recording the rounded digest is accepted for the model's bfloat16 copy (and a bfloat16 profile for
    the float32 model) with OtherDtypeWarning; another checkpoint is still refused; a profile without the rounded
    digest (made before oakenkv recorded it) refuses the copy as before. The file keeps the field only when set, so
    an earlier profile's sha256 is unchanged."""
    import torch

    model, copy, other = _tiny_llama(0), _tiny_llama(0).to(torch.bfloat16), _tiny_llama(1).to(torch.bfloat16)
    th = make(ModelFingerprint.from_model(model, name="tiny", rounded=True))
    assert th.fingerprint.weights_bf16 is not None
    with pytest.warns(OtherDtypeWarning, match="another dtype"):
        th.check_model(copy)
    with pytest.raises(ModelMismatchError, match="other weights of the same shape"):
        th.check_model(other)
    back = Thresholds.load(th.save(tmp_path / "t.json"))
    assert back.fingerprint.weights_bf16 == th.fingerprint.weights_bf16 and back.sha256() == th.sha256()
    reverse = make(ModelFingerprint.from_model(copy, name="tiny", rounded=True))
    with pytest.warns(OtherDtypeWarning):
        reverse.check_model(model)
    old = make(ModelFingerprint.from_model(model, name="tiny"))  # no rounded digest
    assert "weights_bf16" not in old.to_dict()["model"]
    assert old.sha256() == make(ModelFingerprint("llama", 3, 2, 8, "tiny", weights_digest(model))).sha256()
    with pytest.raises(ModelMismatchError, match="another dtype"):
        old.check_model(copy)
    with pytest.raises(ValueError, match="weights_bf16"):
        ModelFingerprint("llama", 3, 2, 8, weights_bf16="sha256:xyz")


def test_a_file_without_weights_still_loads_and_says_it_is_unverified(tmp_path):
    """Files written before the digest existed: the shape is checked, and the user is told the weights were not."""
    d = make().to_dict()
    del d["model"]["weights"]  # exactly the old layout
    p = tmp_path / "old.json"
    p.write_text(json.dumps(d))
    th = Thresholds.load(p)
    assert th.fingerprint.weights is None
    with pytest.warns(UnverifiedWeightsWarning, match="only the model's shape was checked"):
        th.check_model(_tiny_llama(1))
    with pytest.warns(UnverifiedWeightsWarning):
        th.check_fingerprint(ModelFingerprint.from_model(_tiny_llama(1)))
    with pytest.raises(ModelMismatchError, match="3 layers"):
        th.check_fingerprint(ModelFingerprint("llama", 4, 2, 8))


# ---------------------------------------------------------------------------------------------- Thresholds


def test_thresholds_access():
    th = make()
    assert th.num_layers == 3
    assert th.layer(1, "key") == _thr(1)
    assert th.layer(-1, "value") == _thr(2, 0.5)
    assert th.stats(2, "key").kurtosis == 5.0
    with pytest.raises(ValueError, match="kind"):
        th.layer(0, "keys")
    with pytest.raises(IndexError):
        th.layer(3, "key")
    assert make(with_stats=False).stats(0, "value") is None


def test_thresholds_layer_count_must_match_fingerprint():
    with pytest.raises(ValueError, match="has 2 layers"):
        Thresholds(OakenConfig(), FP, keys=(_thr(0), _thr(1)), values=(_thr(0), _thr(1)))


def test_duplicate_layers_warn():
    keys = (_thr(0), _thr(1), _thr(0))
    with pytest.warns(DuplicateThresholdsWarning, match="layers 0 and 2"):
        Thresholds(OakenConfig(), FP, keys=keys, values=tuple(_thr(i, 0.5) for i in range(3)))


def test_distinct_layers_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make()


# ---------------------------------------------------------------------------------------------- file format


def test_json_round_trip_is_exact(tmp_path):
    cfg = OakenConfig(outer_ratio=0.05, key_position="pre_rope")
    th = make(config=cfg)
    # Awkward floats must survive exactly (shortest repr round-trips).
    keys = list(th.keys)
    keys[0] = GroupThresholds(-1 / 3, -1e-7, 2**-30, 7.123456789012345)
    th = Thresholds(cfg, FP, tuple(keys), th.values, th.key_stats, th.value_stats, th.profile)
    p = th.save(tmp_path / "sub" / "t.json")
    back = Thresholds.load(p)
    assert back == th
    assert back.keys[0].as_tuple() == keys[0].as_tuple()
    assert back.config == cfg
    assert back.fingerprint.name == "tiny"
    assert back.profile == {"window": 16, "source": "test"}
    assert back.key_stats[0].adjustments == ("x",)
    assert back.key_stats[0].run_std == (0.1, 0.01, 0.01, 0.1)
    d = json.loads(p.read_text())
    assert d["schema_version"] == SCHEMA_VERSION and d["format"] == "oakenkv-thresholds"
    assert not list(p.parent.glob(".*tmp"))  # atomic write leaves no temp file


def test_round_trip_without_stats(tmp_path):
    th = make(with_stats=False)
    back = Thresholds.load(th.save(tmp_path / "t.json"))
    assert back == th and back.key_stats is None


def test_load_checks_expected_model(tmp_path):
    p = make().save(tmp_path / "t.json")
    Thresholds.load(p, expect=ModelFingerprint("llama", 3, 2, 8))
    with pytest.raises(ModelMismatchError, match=r"head_dim 8.*head_dim 64"):
        Thresholds.load(p, expect=ModelFingerprint("llama", 3, 2, 64))
    with pytest.raises(ModelMismatchError, match="mistral"):
        Thresholds.load(p, expect=ModelFingerprint("mistral", 3, 2, 8))


def _write(tmp_path, d_or_text) -> str:
    p = tmp_path / "bad.json"
    p.write_text(d_or_text if isinstance(d_or_text, str) else json.dumps(d_or_text))
    return str(p)


def test_truncated_file_is_clear_error(tmp_path):
    text = json.dumps(make().to_dict(), indent=1)
    for cut in (0, 1, len(text) // 2, len(text) - 2):
        with pytest.raises(ThresholdsFileError, match="corrupt JSON"):
            Thresholds.load(_write(tmp_path, text[:cut]))


def test_binary_garbage_is_clear_error(tmp_path):
    p = tmp_path / "bin.json"
    p.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ThresholdsFileError):
        Thresholds.load(p)


def test_missing_file():
    with pytest.raises(FileNotFoundError):
        Thresholds.load("/nonexistent/t.json")


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda d: d.update(schema_version=99), "schema_version 99"),
        (lambda d: d.pop("schema_version"), "schema_version None"),
        (lambda d: d.update(format="something"), "not a thresholds file"),
        (lambda d: d.pop("config"), "missing field 'config'"),
        (lambda d: d.pop("model"), "missing field 'model'"),
        (lambda d: d["model"].pop("head_dim"), "missing field 'head_dim'"),
        (lambda d: d["layers"][1]["key"].pop("thresholds"), "missing field 'thresholds'"),
        (lambda d: d["layers"].pop(), "holds 2 layers"),
        (lambda d: d["layers"].reverse(), "index"),
        (lambda d: d["layers"][1]["value"].update(thresholds=[1, 0, 2, 3]), "layer 1 value"),
        (lambda d: d["layers"][0]["key"].update(thresholds=[1, 2, 3]), "4 numbers"),
        (lambda d: d["layers"][0]["key"].update(thresholds=[-1, None, 0, 1]), "number"),
        (lambda d: d["config"].update(outer_ratio=2.0), "outer_ratio"),
        (lambda d: d.update(layers={"0": 1}), "'layers' must be a list"),
        (lambda d: d["layers"][0]["key"].update(stats=None), "some layers only"),
    ],
)
def test_corrupt_content_is_clear_error(tmp_path, mutate, match):
    d = make().to_dict()
    mutate(d)
    with pytest.raises(ThresholdsFileError, match=match):
        Thresholds.load(_write(tmp_path, d))


@pytest.mark.parametrize("const", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_in_file_is_clear_error(tmp_path, const):
    text = json.dumps(make().to_dict())
    d = json.loads(text)
    d["layers"][2]["key"]["thresholds"][3] = 12345.5
    text = json.dumps(d).replace("12345.5", const)
    with pytest.raises(ThresholdsFileError, match=const.lstrip("-")):
        Thresholds.load(_write(tmp_path, text))


def test_top_level_not_object(tmp_path):
    with pytest.raises(ThresholdsFileError, match="top level is list"):
        Thresholds.load(_write(tmp_path, "[1, 2]"))


def test_duplicate_layers_in_file_warn(tmp_path):
    d = make().to_dict()
    d["layers"][2]["value"]["thresholds"] = d["layers"][0]["value"]["thresholds"]
    with pytest.warns(DuplicateThresholdsWarning):
        Thresholds.load(_write(tmp_path, d))
