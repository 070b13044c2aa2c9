"""The ``oaken-plus`` preset: offline transforms (src/oakenkv/transforms.py) and their profile (src/oakenkv/plus.py).

What must hold: folding leaves the model's full-precision outputs unchanged; key scales are tied over the pairs the
model's own RoPE code rotates together; a profile with transforms is refused by another model, by a model that
does not carry them, and by a second, different fold; and OakenCache (float and packed decode paths) generates
exactly what the fake-quantizing evaluation cache does with the same profile.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from oakenkv.attention import oaken_attention
from oakenkv.cache import OakenCache
from oakenkv.plus import PlusSearch, apply_profile, profile_plus
from oakenkv.store import serial_numba
from oakenkv.thresholds import Thresholds, ThresholdsFileError
from oakenkv.transforms import (
    LayerTransforms,
    TransformError,
    Transforms,
    fold_into_model,
    fwht,
    hadamard,
    is_folded,
    rope_partners,
    tie_rope_pairs,
)

PROMPTS = ["The capital of France is", "Once upon a time, in a small village by the sea, there lived"]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    with serial_numba():
        yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def profile(default_model):
    """An oaken-plus profile of the default model on two short calibration windows (small search: fast)."""
    from oakenkv.profile import CalibrationSpec, calibration_windows

    w = calibration_windows(default_model.tokenizer, CalibrationSpec(samples=2, window=160))
    return profile_plus(default_model.model, w, PlusSearch(alphas=(0.0, 0.5), query_positions=32), name="default")


@pytest.fixture(scope="module")
def folded(default_model, profile):
    return apply_profile(copy.deepcopy(default_model.model), profile)


def _random_transforms(model, partners, seed=0, rotate=True) -> Transforms:
    cfg = model.config
    h, hd, n = cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers
    g = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(n):
        lam = tie_rope_pairs(torch.rand(h, hd, generator=g) + 0.5, partners)
        layers.append(LayerTransforms(key_scale=tuple(lam.flatten().tolist()), value_rotation=rotate))
    return Transforms(tuple(layers), h, hd)


def test_hadamard_and_fwht():
    for n in (1, 2, 64, 256):
        h = hadamard(n, torch.float64)
        torch.testing.assert_close(h @ h, torch.eye(n, dtype=torch.float64))
        torch.testing.assert_close(h, h.T)
        x = np.random.default_rng(n).standard_normal((3, 2, n)).astype(np.float32)
        np.testing.assert_allclose(fwht(x), x @ h.numpy(), rtol=0, atol=1e-5)
        # the same bits whatever the batch shape (the cache's and the evaluation's layouts differ)
        np.testing.assert_array_equal(fwht(x)[1:2], fwht(x[1:2]))
    with pytest.raises(TransformError, match="power-of-two"):
        hadamard(96)


def test_rope_partners_are_read_off_the_models_rotary_code(default_model):
    model = default_model.model
    hd = model.config.head_dim
    partners = rope_partners(model)
    np.testing.assert_array_equal(partners, (np.arange(hd) + hd // 2) % hd)  # Llama's rotate_half convention
    # A tied scale commutes with the model's own RoPE; a scale tied over other pairs does not.
    import transformers.models.llama.modeling_llama as llama

    cos, sin = model.model.rotary_emb(torch.zeros(1), torch.arange(40)[None])
    k = torch.randn(1, 3, 40, hd)
    g = torch.Generator().manual_seed(1)
    raw = torch.rand(3, hd, generator=g) + 0.5
    for lam, commutes in ((tie_rope_pairs(raw, partners), True), (tie_rope_pairs(raw, np.arange(hd) ^ 1), False)):
        lam = lam[None, :, None, :]
        a = llama.apply_rotary_pos_emb(k / lam, k / lam, cos, sin)[0]
        b = llama.apply_rotary_pos_emb(k, k, cos, sin)[0] / lam
        assert torch.allclose(a, b, atol=1e-5) == commutes


def test_folding_preserves_full_precision_logits(default_model):
    model = default_model.model
    ids = default_model.tokenizer(PROMPTS[1], return_tensors="pt").input_ids
    with torch.no_grad():
        want = model(ids).logits
        ok = copy.deepcopy(model)
        fold_into_model(ok, _random_transforms(model, rope_partners(model)))
        torch.testing.assert_close(ok(ids).logits, want, rtol=1e-4, atol=2e-4)
        # the same scales tied over the wrong channel pairs change the model: the pairing matters
        bad = copy.deepcopy(model)
        hd = model.config.head_dim
        fold_into_model(bad, _random_transforms(model, np.arange(hd) ^ 1, rotate=False))
        assert (bad(ids).logits - want).abs().max() > 1e-2
    with pytest.raises(TransformError, match="already carries"):
        fold_into_model(ok, _random_transforms(model, rope_partners(model)))


def test_profile_round_trip_and_refusals(default_model, profile, folded, tmp_path):
    t = profile.transforms
    assert t is not None and t.num_layers == default_model.model.config.num_hidden_layers
    path = profile.save(tmp_path / "plus.json")
    d = json.loads(path.read_text())
    assert d["schema_version"] == 2 and "transforms" in d
    loaded = Thresholds.load(path)
    assert loaded.transforms == t and loaded.keys == profile.keys and loaded.values == profile.values
    d["schema_version"] = 1  # a reader of schema 1 would ignore the transforms: never allowed
    path.write_text(json.dumps(d))
    with pytest.raises(ThresholdsFileError, match="transforms"):
        Thresholds.load(path)

    model = default_model.model
    assert is_folded(model) is None  # the session's model was never touched
    assert is_folded(folded) == t.digest()
    assert apply_profile(folded, profile) is folded  # the same profile again: nothing to do
    with pytest.raises(ValueError, match="does not carry"):
        OakenCache(profile, model.config)
    from kv_helpers import quick_thresholds

    paper = quick_thresholds(default_model)
    with pytest.raises(ValueError, match="carries oaken-plus"):
        OakenCache(paper, folded.config)
    other = Transforms(tuple(LayerTransforms(value_rotation=True) for _ in t.layers), t.num_kv_heads, t.head_dim)
    with pytest.raises(TransformError, match="already carries"):
        fold_into_model(folded, other)
    cfg = copy.deepcopy(model.config)
    cfg.num_hidden_layers = 4
    with pytest.raises(ValueError, match="profiled for"):
        OakenCache.from_profile(type("M", (), {"config": cfg})(), profile)


def test_greedy_generation_matches_the_evaluation_cache(default_model, profile, folded):
    """OakenCache (float path and packed decode attention) and the evaluation's fake-quantizing cache quantize
    the same transformed keys and values, so greedy tokens are identical."""
    from oakenkv.eval.cache import FakeQuantCache
    from oakenkv.eval.methods import PlusQuantizer

    tok = default_model.tokenizer
    tok.padding_side = "left"
    batch = tok(PROMPTS, return_tensors="pt", padding=True)
    kw = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": folded.config.eos_token_id}
    with torch.no_grad():
        want = folded.generate(**batch, cache=FakeQuantCache(folded, PlusQuantizer(profile)), **kw)
        got_float = folded.generate(**batch, cache=OakenCache(profile, folded.config), **kw)
        with oaken_attention(folded):
            cache = OakenCache.from_profile(folded, profile)
            got_packed = folded.generate(**batch, cache=cache, **kw)
    assert torch.equal(got_float, want)
    assert torch.equal(got_packed, want)
    cache.store.pool.check_invariants()


def test_store_encodes_the_transformed_keys(default_model, profile):
    """The pages hold exactly the quantized transformed keys (a key shift and rotation in every layer)."""
    import dataclasses

    from transformers import DynamicCache

    from oakenkv.quant import quantize_dequantize
    from oakenkv.transforms import FOLD_MARK

    model = default_model.model
    g = torch.Generator().manual_seed(2)
    h, hd = model.config.num_key_value_heads, model.config.head_dim
    t = Transforms(
        tuple(
            LayerTransforms(key_shift=tuple(torch.randn(h * hd, generator=g).tolist()), key_rotation=True)
            for _ in profile.transforms.layers
        ),
        h,
        hd,
    )
    th = dataclasses.replace(profile, transforms=t)
    config = copy.deepcopy(model.config)
    setattr(config, FOLD_MARK, t.digest())  # nothing to fold: the transforms are all online
    layer = 5
    ids = default_model.tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    ref = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, cache=ref)
    k = ref.layers[layer].keys  # [1, H, S, hd]
    cache = OakenCache(th, config)
    cache.store.append(layer, k, ref.layers[layer].values)
    _, _, s, _ = k.shape
    rows = t.key_rows(layer, k.permute(0, 2, 1, 3).reshape(s, h * hd).numpy())
    q = quantize_dequantize(torch.from_numpy(rows), th.layer(layer, "key"), th.config).numpy()
    want = fwht(q.reshape(s, h, hd)).transpose(1, 0, 2)[None]  # rotation undone, shift kept
    torch.testing.assert_close(cache.store.read(layer, 0), torch.from_numpy(want), rtol=0, atol=0)
    # and the transform itself is (k - shift) @ H per head, to float32 rounding
    want_rows = (k[0].permute(1, 0, 2).reshape(s, h * hd) - torch.tensor(t.layers[layer].key_shift)).reshape(s, h, hd)
    torch.testing.assert_close(torch.from_numpy(rows).reshape(s, h, hd), want_rows @ hadamard(hd), rtol=0, atol=1e-5)
