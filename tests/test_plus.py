"""The ``oaken-plus`` preset: offline transforms (src/oakenkv/calibrate/transforms.py) and their profile
(src/oakenkv/calibrate/plus.py).

What must hold: folding leaves the model's full-precision outputs unchanged; key scales are tied over the pairs the
model's own RoPE code rotates together; a profile with transforms is refused by another model, by a model that
does not carry them, and by a second, different fold; and OakenCache (float and packed decode paths) generates
exactly what the fake-quantizing evaluation cache does with the same profile.
"""

from __future__ import annotations

import copy
import dataclasses
import json

import numpy as np
import pytest
import torch

from oakenkv.calibrate.plus import PlusSearch, apply_profile, profile_plus
from oakenkv.calibrate.thresholds import TIMING_KEYS, Thresholds, ThresholdsFileError
from oakenkv.calibrate.transforms import (
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
from oakenkv.hf.attention import oaken_attention
from oakenkv.hf.cache import OakenCache
from oakenkv.store.paged import serial_numba

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
    from oakenkv.calibrate.profile import CalibrationSpec, calibration_windows

    w = calibration_windows(default_model.tokenizer, CalibrationSpec(samples=2, window=160))
    return profile_plus(default_model.model, w, PlusSearch(alphas=(0.0, 0.5), query_positions=32), name="default")


@pytest.fixture(scope="module")
def folded(default_model, profile):
    return apply_profile(copy.deepcopy(default_model.model), profile)


def _random_transforms(model, partners, seed=0, rotate=True, same_for_heads=False) -> Transforms:
    from oakenkv.calibrate.identity import kv_shape

    cfg = model.config
    h, hd = kv_shape(cfg)
    n = cfg.num_hidden_layers
    g = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(n):
        raw = torch.rand(1 if same_for_heads else h, hd, generator=g) + 0.5
        lam = tie_rope_pairs(raw.expand(h, hd), partners)
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


def test_fwht_of_a_strided_array_rotates_it():
    """Regression: ``fwht`` copied a strided input keeping its layout, rotated a temporary and returned the input
    unrotated: OakenCache's prefill handed attention still-rotated keys under a key rotation, and the profiler
    scored every rotation candidate of a model with several KV heads with unrotated keys or values (so it never
    chose one)."""
    x = torch.randn(2, 30, 3, 64).permute(0, 2, 1, 3)  # [B, H, S, hd] view of [B, S, H, hd], as the prefill has
    torch.testing.assert_close(torch.from_numpy(fwht(x.numpy())), x @ hadamard(64), rtol=0, atol=1e-5)


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


def _randomized(model, pick, mean: float = 0.0):
    """``model`` with the parameters whose names ``pick`` takes drawn from N(mean, 0.3^2), in parameter order."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if pick(name):
                p.normal_(mean, 0.3)
    return model


def _tiny(family: str):
    """A small random model of another family (no download): Qwen2 has biases on q/k/v; Gemma 3 has q/k norms
    that store ``1 + w``, sliding-window layers and an attention soft-cap-free GQA with head_dim 64."""
    torch.manual_seed(0)
    common = dict(
        vocab_size=97,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    if family == "qwen2":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        return Qwen2ForCausalLM(Qwen2Config(**common)).eval()
    if family == "gpt-neox":  # one fused query_key_value, laid out per head (full rotary here: Pythia's is partial)
        from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

        kw = {k: v for k, v in common.items() if k != "num_key_value_heads"}
        cfg = GPTNeoXConfig(**kw, attention_bias=True, rotary_pct=1.0)
        return _randomized(GPTNeoXForCausalLM(cfg).eval(), lambda name: name.endswith("bias"))
    if family.startswith("falcon"):  # query_key_value in three layouts (modeling_falcon); dense; biases
        from transformers import FalconConfig, FalconForCausalLM

        layout = {
            "falcon-gqa": {"new_decoder_architecture": True, "num_kv_heads": 2},  # [H][G + 2][hd]
            "falcon-mq": {"multi_query": True, "new_decoder_architecture": False},  # [q | k | v], one KV head
            "falcon-mha": {"multi_query": False, "new_decoder_architecture": False},  # [head][q | k | v]
        }[family]
        cfg = FalconConfig(
            vocab_size=97, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256,
            bias=True, **layout,
        )  # fmt: skip
        return _randomized(FalconForCausalLM(cfg).eval(), lambda name: name.endswith("bias"))
    if family == "gpt2":  # c_attn [q | k | v] and c_proj are Conv1D (weights [in, out]); no RoPE
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(vocab_size=97, n_embd=128, n_layer=2, n_head=4, n_positions=256, bos_token_id=0)
        return _randomized(GPT2LMHeadModel(cfg).eval(), lambda name: name.endswith("bias"))
    if family == "opt":  # out_proj; learned positions (no RoPE)
        from transformers import OPTConfig, OPTForCausalLM

        cfg = OPTConfig(
            vocab_size=97, hidden_size=128, ffn_dim=256, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=256, word_embed_proj_dim=128, pad_token_id=1,
        )  # fmt: skip
        return OPTForCausalLM(cfg).eval()
    if family == "phi3":  # one fused qkv_proj
        from transformers import Phi3Config, Phi3ForCausalLM

        return Phi3ForCausalLM(Phi3Config(**common, pad_token_id=0)).eval()
    if family in ("olmo2", "cohere"):  # q/k norms with a weight per head: over the whole projection / per head
        import transformers

        if family == "olmo2":
            model = transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**common)).eval()
        else:
            model = transformers.CohereForCausalLM(transformers.CohereConfig(**common, use_qk_norm=True)).eval()
        return _randomized(model, lambda name: "norm" in name, mean=1.0)
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(
        **common, head_dim=64, sliding_window=16, layer_types=["sliding_attention", "full_attention"]
    )
    # random, non-trivial norm weights and biases: the fold must handle each
    return _randomized(Gemma3ForCausalLM(cfg).eval(), lambda name: "norm" in name or name.endswith("bias"))


@pytest.mark.parametrize(
    "family",
    ["qwen2", "gemma3", "olmo2", "cohere", "phi3", "gpt-neox", "gpt2", "opt", "falcon-gqa", "falcon-mq", "falcon-mha"],
)
def test_folding_preserves_logits_on_other_families(family):
    model = _tiny(family)
    if family == "qwen2":
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0.0, 0.5)  # Qwen2's key bias: what makes its keys' channels offset
    ids = torch.randint(0, 97, (1, 40))
    partners = rope_partners(model)
    norms = family == "gemma3"  # q/k norms: one weight for every head, so one set of key scales
    with torch.no_grad():
        want = model(ids).logits
        ok = copy.deepcopy(model)
        fold_into_model(ok, _random_transforms(model, partners, seed=3, same_for_heads=norms))
        torch.testing.assert_close(ok(ids).logits, want, rtol=1e-4, atol=1e-4)
        moved = sum(float((a - b).abs().max()) for a, b in zip(ok.parameters(), model.parameters(), strict=True))
        assert moved > 1e-2  # the weights did change: the test is not vacuous
        if norms:
            refused = copy.deepcopy(model)
            with pytest.raises(TransformError, match="shared by the heads"):
                fold_into_model(refused, _random_transforms(model, partners, seed=3))
            # checked before anything changes: layer 0's value rotation did not happen before the refusal
            for a, b in zip(refused.parameters(), model.parameters(), strict=True):
                assert torch.equal(a, b)
    # the search itself respects what the model allows: a profile of it folds, and the FP outputs stay
    windows = torch.randint(0, 97, (2, 48))
    th = profile_plus(model, windows, PlusSearch(alphas=(0.0, 0.5, 0.75), query_positions=16))
    folded = apply_profile(copy.deepcopy(model), th)
    with torch.no_grad():
        torch.testing.assert_close(folded(ids).logits, want, rtol=1e-4, atol=1e-4)
    scaled = [lt for lt in th.transforms.layers if lt.key_scale is not None]
    assert scaled or not norms  # (seeded: the search smooths a layer of the Gemma-like model)
    for lt in scaled:
        if norms:
            lam = torch.tensor(lt.key_scale).reshape(2, 64)
            assert torch.equal(lam[0], lam[1])


def test_the_norm_probe_restores_the_weight_whatever_the_norm_raises():
    from oakenkv.calibrate.transforms import _norm_adds_one

    class Broken(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.tensor([0.5, 2.0, -1.0]))

        def forward(self, x):
            raise RuntimeError("no")

    norm = Broken()
    with pytest.raises(TransformError, match="cannot run Broken"):
        _norm_adds_one(norm)
    assert norm.weight.tolist() == [0.5, 2.0, -1.0]


def test_a_search_with_rotations_runs_without_them_on_a_head_dim_that_is_no_power_of_two():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=97, hidden_size=96, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=48, max_position_embeddings=256,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    windows = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(1))
    with pytest.warns(UserWarning, match="power-of-two head_dim, this model's is 48"):
        th = profile_plus(model, windows, PlusSearch(query_positions=16, key_rotation=True, value_rotation=True))
    assert not any(lt.key_rotation or lt.value_rotation for lt in th.transforms.layers)
    ids = torch.randint(0, 97, (1, 24))
    with torch.no_grad():
        want = model(ids).logits
        torch.testing.assert_close(apply_profile(copy.deepcopy(model), th)(ids).logits, want, rtol=1e-4, atol=1e-4)


def test_a_profiles_seconds_leave_out_the_kernels_compilation(monkeypatch):
    """The codec kernels compile (or load from numba's cache) before the search's clock starts: a first process's
    compilation is the profile's ``compile_seconds``, not part of its ``seconds``."""
    import time

    from transformers import LlamaConfig, LlamaForCausalLM

    import oakenkv.calibrate.plus as plus

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    windows = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(1))
    search = PlusSearch(alphas=(0.0,), query_positions=8)
    profile_plus(model, windows, search)  # compiled now, if it was not
    real = plus._warm_kernels
    monkeypatch.setattr(plus, "_warm_kernels", lambda *a: time.sleep(2.0) or real(*a) + 2.0)  # a slow compilation
    th = profile_plus(model, windows, search)
    assert th.profile["compile_seconds"] >= 2.0 and th.profile["seconds"] < 2.0


def _decided(th: Thresholds) -> tuple[str, list]:
    """Everything a profile decides (thresholds, statistics, transforms, model), and every candidate's error."""
    return th.sha256(), th.profile["choices"]


@pytest.mark.parametrize("family", ["qwen2", "gemma3", "phi3", "gpt-neox", "gpt2", "opt", "falcon-gqa"])
def test_the_streamed_search_equals_the_search_over_every_layer_at_once(family, monkeypatch):
    """The search records one layer at a time (oakenkv.calibrate.recording.stream_attention); it must choose and
    profile exactly what the search over all layers recorded at once chooses, every candidate's error included.
    A model the stream does not support is recorded all at once, with a warning, to the same profile."""
    import oakenkv.calibrate.plus as plus
    from oakenkv.calibrate.recording import StreamingUnsupported, record_attention

    model = _tiny(family)
    if family == "qwen2":
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0.0, 0.5)
    windows = torch.randint(0, 97, (3, 40), generator=torch.Generator().manual_seed(2))
    search = PlusSearch(query_positions=16, key_rotation=True, value_rotation=True)  # every kind of candidate
    streamed = profile_plus(model, windows, search)
    record = record_attention(model, windows, search.query_runs)
    at_once = plus.profile_from_record(record, streamed.fingerprint, search, rope_partners(model))
    assert _decided(streamed) == _decided(at_once)
    assert len(streamed.profile["choices"][0]["key_errors"]) == 2 * 2 * 4 + 2  # shift x rotation x alpha, ratios

    def unsupported(*a, **k):
        raise StreamingUnsupported("test")

    monkeypatch.setattr(plus, "stream_attention", unsupported)
    with pytest.warns(UserWarning, match="every layer at once"):
        fallback = profile_plus(model, windows, search)
    assert _decided(fallback) == _decided(streamed)


def test_alloc_spreads_the_same_sparse_budget_over_layers_and_kinds():
    """oaken-plus:alloc=1: every split is scored at each budget scale too, and the profile's per-layer ratios
    average at most the sparse share; the choice at scale 1 is the plain search's, the streamed and the all-at-once
    searches agree, and the profile records what was spent."""
    import oakenkv.calibrate.plus as plus
    from oakenkv.calibrate.recording import record_attention

    model = _tiny("qwen2")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)
    windows = torch.randint(0, 97, (3, 40), generator=torch.Generator().manual_seed(4))
    plain = PlusSearch(query_positions=16, alphas=(0.0, 0.5))
    search = dataclasses.replace(plain, budget_scales=(0.5, 1.0, 2.0))
    th = profile_plus(model, windows, search)
    base = profile_plus(model, windows, plain)
    stats = th.key_stats + th.value_stats
    shares = [s.outer_ratio + s.inner_ratio for s in stats]
    assert sum(shares) / len(shares) <= 0.1 + 1e-9
    alloc = th.profile["allocation"]
    assert alloc["used"] in ("allocated", "uniform")
    assert alloc["error_sum"]["allocated"] <= alloc["error_sum"]["uniform"] or alloc["used"] == "uniform"
    for made, ref in zip(th.profile["choices"], base.profile["choices"], strict=True):
        assert made["key"] == ref["key"] and made["value"] == ref["value"]  # scale 1's choice: the plain search's
        # every split at the two other scales, for the chosen transforms
        assert len(made["key_errors"]) == len(ref["key_errors"]) + 2 * 3
        assert len(made["value_errors"]) == len(ref["value_errors"]) + 2 * 3
        assert {made["allocated"]["key"], made["allocated"]["value"]} <= {0.05, 0.1, 0.2}
    if alloc["used"] == "uniform":
        assert th.keys == base.keys and th.values == base.values
    record = record_attention(model, windows, search.query_runs)
    at_once = plus.profile_from_record(record, th.fingerprint, search, rope_partners(model))
    assert _decided(at_once) == _decided(th)
    assert th.transforms.notes["search"]["budget_scales"] == [0.5, 1.0, 2.0]
    assert "budget_scales" not in base.transforms.notes["search"]  # a plain profile's digest is unchanged


def test_an_aware_search_scores_its_candidates_with_the_static_grids():
    """oaken-plus:static=1,aware=1: the candidates' errors are those of the static grids (and levels) the profile
    is served with, and the profile's config carries them; the spec refuses aware=1 without static=1."""
    from oakenkv.calibrate.search import _fake_quant
    from oakenkv.methods.registry import parse_spec

    model = _tiny("qwen2")
    windows = torch.randint(0, 97, (3, 40), generator=torch.Generator().manual_seed(5))
    plain = PlusSearch(query_positions=16, alphas=(0.0,), key_shift=False)
    aware = dataclasses.replace(plain, static_grids=True, static_levels=(0.5, 1.0))
    a, p = profile_plus(model, windows, aware), profile_plus(model, windows, plain)
    assert a.config.static_grids and a.config.static_levels == (0.5, 1.0) and not p.config.static_grids
    assert a.transforms.notes["search"]["static_levels"] == [0.5, 1.0]
    assert "static_grids" not in p.transforms.notes["search"]  # a per-row search's digest is unchanged
    ea, ep = a.profile["choices"][0]["value_errors"], p.profile["choices"][0]["value_errors"]
    assert ea.keys() == ep.keys() and ea != ep
    # the round trip the aware search scores is the static codec's
    x = torch.randn(1, 2, 24, 64)
    cfg = aware.config(0.04, 0.06)
    thr = a.values[0]
    from oakenkv.kernels.codec import decode, encode

    rows = x.permute(0, 2, 1, 3).reshape(24, 128).contiguous()
    want = decode(encode(rows, thr, cfg), thr, cfg).reshape(1, 24, 2, 64).permute(0, 2, 1, 3)
    assert torch.equal(_fake_quant(x, thr, cfg), want)
    with pytest.raises(ValueError, match="needs static=1"):
        parse_spec("oaken-plus:aware=1")


def test_the_streamed_search_on_the_default_model(default_model, profile):
    import oakenkv.calibrate.plus as plus
    from oakenkv.calibrate.profile import CalibrationSpec, calibration_windows
    from oakenkv.calibrate.recording import record_attention

    w = calibration_windows(default_model.tokenizer, CalibrationSpec(samples=2, window=160))
    search = PlusSearch(alphas=(0.0, 0.5), query_positions=32)  # the fixture's
    record = record_attention(default_model.model, w, search.query_runs)
    at_once = plus.profile_from_record(record, profile.fingerprint, search, rope_partners(default_model.model))
    assert _decided(profile) == _decided(at_once)


def test_windows_of_one_token_are_refused_before_the_search(default_model):
    """Token 0 is the sink, left out of the key statistics: one-token windows died in the search with torch's
    "amax(): Expected reduction dim 2 to have non-zero size"; two tokens are enough."""
    ids = torch.tensor([[1], [2]])
    with pytest.raises(ValueError, match=r"at least 2 tokens .* got windows of 1"):
        profile_plus(copy.deepcopy(default_model.model), ids)


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


def test_a_folded_model_in_another_dtype_still_gets_its_cache(profile, folded, tmp_path):
    """``for_model`` folds, then the user casts the model (``.to(torch.bfloat16)``) or saves it and loads it again in
    bfloat16: every way to a cache was refused ("weights changed after oaken-plus transforms were folded ... build
    the cache with OakenCache.from_profile", which was what had been called). The fold now records the folded
    weights' rounded digest, so the same weights in another dtype are accepted (warned); changed ones are not."""
    import transformers as tf

    from oakenkv.calibrate.thresholds import ModelMismatchError, OtherDtypeWarning

    cast = copy.deepcopy(folded).to(torch.bfloat16)
    with pytest.warns(OtherDtypeWarning):
        assert OakenCache.from_profile(cast, profile).store.thresholds is profile
    cast.save_pretrained(tmp_path / "m")
    again = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.bfloat16)
    with pytest.warns(OtherDtypeWarning):
        OakenCache.from_profile(again, profile)
    with torch.no_grad():
        again.model.layers[3].mlp.down_proj.weight[0, :8] += 0.5  # changed, not cast: refused
    with pytest.raises(ModelMismatchError, match="changed after oaken-plus transforms were folded"):
        OakenCache.from_profile(again, profile)


def test_greedy_generation_matches_the_evaluation_cache(default_model, profile, folded):
    """OakenCache (float path and packed decode attention) and the evaluation's fake-quantizing cache quantize
    the same transformed keys and values, so greedy tokens are identical (the packed attention's up to its
    summation order: ``kv_helpers.assert_same_greedy``)."""
    from kv_helpers import assert_same_greedy
    from oakenkv.methods.fakequant import FakeQuantCache
    from oakenkv.methods.oaken import PlusQuantizer

    tok = default_model.tokenizer
    tok.padding_side = "left"
    batch = tok(PROMPTS, return_tensors="pt", padding=True)
    kw = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": folded.config.eos_token_id}
    logits = {"output_logits": True, "return_dict_in_generate": True}
    with torch.no_grad():
        want = folded.generate(**batch, cache=FakeQuantCache(folded, PlusQuantizer(profile)), **kw, **logits)
        got_float = folded.generate(**batch, cache=OakenCache(profile, folded), **kw)
        with oaken_attention(folded):
            cache = OakenCache.from_profile(folded, profile)
            got_packed = folded.generate(**batch, cache=cache, **kw, **logits)
    assert torch.equal(got_float, want.sequences)
    assert_same_greedy(want, got_packed)
    cache.store.pool.check_invariants()


def test_store_encodes_the_transformed_keys(default_model, profile):
    """The pages hold exactly the quantized transformed keys (a key shift and rotation in every layer)."""
    import dataclasses

    from transformers import DynamicCache

    from oakenkv.calibrate.transforms import FOLD_MARK
    from oakenkv.quant.quantizer import quantize_dequantize

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


def test_a_shipped_profile_is_used_only_when_it_fits(default_model, tmp_path, monkeypatch):
    import oakenkv.calibrate.plus as plus
    from oakenkv.calibrate.profile import CalibrationSpec

    monkeypatch.setenv("OAKENKV_CACHE", str(tmp_path / "cache"))
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    monkeypatch.setattr(plus, "SHIPPED_PROFILES", shipped)
    spec, search = CalibrationSpec(samples=2, window=96), PlusSearch(alphas=(0.0,), query_positions=16)
    args = (default_model.model, default_model.tokenizer, "default", spec, search)
    made = plus.cached_plus_profile(*args)
    # the entry's file, and its copy under the rounded digest (diskcache.rounded_entry), which is not shipped
    cached, rounded = sorted((tmp_path / "cache" / "eval").glob("plus-*.json"), key=lambda p: "-bf16-" in p.name)
    assert "-bf16-" in rounded.name
    rounded.unlink()
    cached.rename(shipped / cached.name)  # as the package ships it: the cache's own file name

    def no_profiling(*a, **k):
        raise AssertionError("profiled although a fitting profile was shipped")

    monkeypatch.setattr(plus, "profile_plus_many", no_profiling)
    got = plus.cached_plus_profile(*args)
    assert got.sha256() == made.sha256() and (tmp_path / "cache" / "eval" / cached.name).is_file()
    # a shipped file made for other weights is not used (its name would differ; here the content does)
    (tmp_path / "cache" / "eval" / cached.name).unlink()
    data = json.loads((shipped / cached.name).read_text())
    data["model"]["weights"] = "0" * 64
    (shipped / cached.name).write_text(json.dumps(data))
    with pytest.raises(AssertionError, match="profiled although"):
        plus.cached_plus_profile(*args)


def test_the_default_models_shipped_profile_fits_it(default_model, tmp_path, monkeypatch):
    """The package ships the embedded default model's oaken-plus profile; it must be the one the preset asks for
    (same weights digest, calibration windows and search), or `make demo` profiles for minutes on first use."""
    import oakenkv.calibrate.plus as plus

    assert list(plus.SHIPPED_PROFILES.glob("plus-default-*.json")), "no shipped profile of the default model"
    monkeypatch.setenv("OAKENKV_CACHE", str(tmp_path / "cache"))

    def no_profiling(*a, **k):
        raise AssertionError("the shipped profile does not fit the default model: regenerate it")

    monkeypatch.setattr(plus, "profile_plus_many", no_profiling)
    th = plus.cached_plus_profile(default_model.model, default_model.tokenizer, "default")
    assert th.transforms is not None
    th.check_model(default_model.model)


def test_profiles_made_together_equal_profiles_made_alone(default_model, tmp_path, monkeypatch):
    import oakenkv.calibrate.plus as plus
    from oakenkv.calibrate.profile import CalibrationSpec

    monkeypatch.setenv("OAKENKV_CACHE", str(tmp_path / "cache"))
    spec = CalibrationSpec(samples=2, window=96)
    searches = [
        PlusSearch(alphas=(0.0,), key_rotation=False, value_rotation=False, query_positions=16),
        PlusSearch(alphas=(0.0, 0.5), key_shift=False, ratios=plus.DEFAULT_RATIOS[:1], query_positions=16),
    ]
    args = (default_model.model, default_model.tokenizer, "default")
    together = plus.cached_plus_profiles(*args, searches, spec)
    for f in (tmp_path / "cache" / "eval").glob("plus-*.json"):
        f.unlink()
    for s, t in zip(searches, together, strict=True):
        alone = plus.cached_plus_profile(*args, spec, s)
        assert alone.transforms.digest() == t.transforms.digest()
        assert alone.keys == t.keys and alone.values == t.values
    assert together[0].transforms.digest() != together[1].transforms.digest()  # the searches did differ


@pytest.mark.model
def test_cli_oaken_plus_profile_on_the_lazy_model_equals_the_eager_search(default_model, tmp_path):
    """`oakenkv profile --preset oaken-plus` loads the model lazily (oakenkv.assets.lazy: one unit's weights in memory
    at a time); its profile is the one the search makes on the eagerly loaded model, JSON for JSON (timing aside)."""
    from typer.testing import CliRunner

    from oakenkv.calibrate.presets import PRESETS
    from oakenkv.calibrate.profile import load_calibration
    from oakenkv.cli import app

    out = tmp_path / "plus.json"
    res = CliRunner().invoke(
        app, ["profile", "--preset", "oaken-plus", "--samples", "2", "--window", "48", "--out", str(out)]
    )
    assert res.exit_code == 0, res.output
    _, ids, meta = load_calibration("default", 2, 48)
    want = profile_plus(default_model.model, ids, PRESETS["oaken-plus"].search(), name="default", metadata=meta)
    got = Thresholds.load(out).to_dict()
    want = want.to_dict()
    for d in (got, want):
        for k in TIMING_KEYS:  # compile_seconds too: only the first search of a process compiles (a fresh CI cache)
            d["profile"].pop(k, None)
    assert got == want
