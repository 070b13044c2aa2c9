"""The two-line way in: ``OakenCache.for_model`` (src/oakenkv/hf/cache.py, src/oakenkv/calibrate/presets.py).

The README's first Python example runs here as it is written; the rest checks what ``for_model`` promises: the
preset's profile found or taken from ``profile=``, the model prepared once, either cache keyword reaching the
cache, and a clear error for a profile of the other preset or a cache the model would ignore.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from pathlib import Path

import pytest
import torch

from kv_helpers import quick_thresholds
from oakenkv import OakenCache
from oakenkv.calibrate.presets import PRESETS, find_profile, get_preset
from oakenkv.util.compat import cache_keyword

README = Path(__file__).resolve().parents[1] / "README.md"


def _first_python_block(text: str) -> str:
    return re.search(r"```python\n(.*?)```", text, re.S).group(1)


def test_the_readme_opens_with_the_two_line_example_and_it_runs(capsys):
    code = _first_python_block(README.read_text(encoding="utf-8"))
    assert "from oakenkv import OakenCache" in code and "OakenCache.for_model(" in code
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)  # the embedded model, loaded afresh (folded in place)
    cache, out = namespace["cache"], namespace["out"]
    assert cache.store.thresholds.transforms is not None  # oaken-plus, the shipped profile
    assert cache.get_seq_length() == out.shape[1] - 1  # every prompt and decode token went through the cache
    assert cache.store.num_tokens(0) == cache.get_seq_length()
    assert namespace["model"].config._attn_implementation == "oaken"  # decode read the packed pages
    assert "Paris" in capsys.readouterr().out


@pytest.fixture
def model_copy(default_model):
    """A copy of the default model: for_model folds transforms into the model it is given."""
    return copy.deepcopy(default_model.model)


def test_for_model_takes_a_profile_and_generates_as_the_constructor_does(default_model, model_copy):
    thresholds = quick_thresholds(default_model)
    tok = default_model.tokenizer
    inputs = tok("The capital of France is", return_tensors="pt")
    kw = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": model_copy.config.eos_token_id}
    cache = OakenCache.for_model(model_copy, preset="oaken", profile=thresholds)
    assert cache.store.thresholds is thresholds
    with torch.no_grad():
        got = model_copy.generate(**inputs, cache=cache, **kw)
        # the same model and profile through the documented constructor (packed decode too: for_model switched it)
        want = model_copy.generate(**inputs, cache=OakenCache(thresholds, model_copy), **kw)
    assert torch.equal(got, want)
    # a second cache for the same model reuses what it was prepared with
    assert find_profile(model_copy, "oaken") is thresholds


def test_for_model_refuses_a_profile_of_the_other_preset_and_unknown_presets(default_model, model_copy):
    with pytest.raises(ValueError, match="unknown preset 'oaken-pro'; known: oaken, oaken-plus, oaken-plus-3"):
        OakenCache.for_model(model_copy, preset="oaken-pro")
    with pytest.raises(ValueError, match="not a profile of the 'oaken-plus' preset"):
        OakenCache.for_model(model_copy, preset="oaken-plus", profile=quick_thresholds(default_model))
    with pytest.raises(TypeError, match="profile must be a Thresholds or a path"):
        OakenCache.for_model(model_copy, profile=3)
    assert model_copy.config._attn_implementation != "oaken"  # nothing was changed


def test_a_model_prepared_for_the_papers_preset_can_take_another(default_model, model_copy):
    """The paper's preset folds nothing, so a model it prepared is still as loaded: ``for_model`` with oaken-plus
    then finds its profile (here the shipped one) and folds it (it was refused, "its weights carry that preset's
    transforms"); the other way round the weights are folded, and that is refused."""
    OakenCache.for_model(model_copy, preset="oaken", profile=quick_thresholds(default_model))
    cache = OakenCache.for_model(model_copy, preset="oaken-plus")
    assert cache.store.thresholds.transforms is not None
    with pytest.raises(ValueError, match="prepared for another preset than 'oaken'"):
        OakenCache.for_model(model_copy, preset="oaken")


def test_presets_are_declared_once():
    from oakenkv.calibrate.search import PlusSearch
    from oakenkv.methods.registry import ALIASES, parse_spec

    slots = {"oaken-plus-3": 3, "oaken-plus-2": 2, "oaken-plus-5": 5, "oaken-plus-6": 6, "oaken-plus-7": 7}
    assert list(PRESETS) == ["oaken", "oaken-plus", *slots]
    assert get_preset("oaken-plus").transforms and not get_preset("oaken").transforms
    for name, bits in slots.items():
        p = get_preset(name)
        assert p.transforms and p.middle_bits == bits and p.search().middle_bits == bits
        assert ALIASES[name] == p.spec  # the method registry runs the preset as this spec
        family, params = parse_spec(name)
        assert family == "oaken-plus" and params["bits"] == bits and params["sparse"] == p.sparse
        flags = [params[k] for k in ("shift", "rot_k", "rot_v", "smooth", "ratios", "sink", "bits", "sparse")]
        assert p.search() == PlusSearch.from_flags(*flags)  # the eval's search of the alias is the preset's
        assert sum(p.search().ratios[0]) == pytest.approx(p.sparse)


@pytest.mark.parametrize("adapt", [False, True])
def test_a_narrow_slot_preset_generates_through_the_packed_pages(adapt):
    """oaken-plus-3's profile (a 3-bit dense slot) through ``for_model``: prefill, packed decode steps, greedy tokens
    equal to the float read path's; a 4-bit profile is refused for it."""
    from oakenkv.calibrate.transforms import LayerTransforms, Transforms
    from oakenkv.format.config import OakenConfig

    model = _tiny_llama()
    base = _tiny_profile(model)
    transforms = Transforms(tuple(LayerTransforms() for _ in range(2)), 2, 16, sink_tokens=1)
    profile = dataclasses.replace(base, config=OakenConfig(middle_bits=3), transforms=transforms)
    with pytest.raises(ValueError, match="3-bit dense slots"):
        OakenCache.for_model(copy.deepcopy(model), preset="oaken-plus", profile=profile)
    four = dataclasses.replace(profile, config=OakenConfig())
    with pytest.raises(ValueError, match="4-bit dense slots"):
        OakenCache.for_model(copy.deepcopy(model), preset="oaken-plus-3", profile=four)
    cache = OakenCache.for_model(model, preset="oaken-plus-3", profile=profile, adapt=adapt)
    assert cache.store.config.middle_bits == 3 and (cache.store.adapt_state is not None) == adapt
    ids = torch.arange(7)[None]
    kw = {"max_new_tokens": 5, "do_sample": False}
    with torch.no_grad():
        got = model.generate(input_ids=ids, cache=cache, **kw)
        model.config._attn_implementation = "sdpa"  # the float read path over the same pages
        want = model.generate(input_ids=ids, cache=OakenCache(profile, model.config, adapt=adapt), **kw)
    assert torch.equal(got, want) and cache.get_seq_length() == got.shape[1] - 1


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64, head_dim=16,
        intermediate_size=32, vocab_size=32,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def _tiny_profile(model):
    from oakenkv.calibrate.thresholds import GroupThresholds, ModelFingerprint, Thresholds
    from oakenkv.format.config import OakenConfig

    layers = tuple(GroupThresholds(-1.0 - i, -0.05, 0.05, 1.0 + i) for i in range(2))
    fp = ModelFingerprint.from_model_config(model.config, name="tiny")
    return Thresholds(config=OakenConfig(), fingerprint=fp, keys=layers, values=layers)


@pytest.mark.parametrize("keyword", ["cache", "past_key_values"])
def test_either_cache_keyword_reaches_the_cache(keyword):
    model = _tiny_llama()
    cache = OakenCache.for_model(model, preset="oaken", profile=_tiny_profile(model))
    ids = torch.arange(5)[None]
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, **{keyword: cache})
    assert cache.get_seq_length() == 5  # the model stored its keys and values in our cache, whichever keyword
    cache = OakenCache.for_model(model, preset="oaken", profile=cache.store.thresholds)
    with torch.no_grad():
        out = model.generate(input_ids=ids, max_new_tokens=3, do_sample=False, **{keyword: cache})
    assert cache.get_seq_length() == out.shape[1] - 1


def test_a_forward_that_wants_gradients_is_told_none_flow_through_the_cache():
    """A loss computed with the cache (no torch.no_grad) back-propagated as if the keys and values were exact, while
    k_proj and v_proj got no gradient at all: now said, once per cache; nothing said under no_grad."""
    import warnings

    from oakenkv.hf.cache import NoGradientWarning

    model = _tiny_llama()
    ids = torch.arange(6)[None]
    cache = OakenCache.for_model(model, preset="oaken", profile=_tiny_profile(model))
    with pytest.warns(NoGradientWarning, match="no gradient flows back through the cache") as seen:
        model(input_ids=ids, labels=ids, use_cache=True, past_key_values=cache).loss.backward()
    assert sum(w.category is NoGradientWarning for w in seen) == 1  # (two layers, one warning)
    assert model.model.layers[0].self_attn.k_proj.weight.grad is None  # (what it warns of)
    cache = OakenCache.for_model(model, preset="oaken", profile=_tiny_profile(model))
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error", NoGradientWarning)
        model(input_ids=ids, use_cache=True, past_key_values=cache)


def test_a_cache_built_before_the_model_was_folded_is_refused():
    """An ``oaken`` cache, then ``for_model(model, "oaken-plus")`` (which folds into the same model in place): the
    first cache kept running on keys and values its profile no longer described (logit error up 45% on the default
    model). Refused at its next update; the new cache runs."""
    from oakenkv.calibrate.transforms import LayerTransforms, Transforms

    model = _tiny_llama()
    base = _tiny_profile(model)
    ids = torch.arange(5)[None]
    old = OakenCache.for_model(model, preset="oaken", profile=base)
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, past_key_values=old)
        plus = dataclasses.replace(base, transforms=Transforms(tuple(LayerTransforms() for _ in range(2)), 2, 16))
        new = OakenCache.for_model(model, preset="oaken-plus", profile=plus)
        with pytest.raises(ValueError, match="transforms changed after this cache was built"):
            model(input_ids=ids[:, :1], use_cache=True, past_key_values=old)
        model(input_ids=ids, use_cache=True, past_key_values=new)
    assert new.get_seq_length() == 5


def test_a_cache_under_the_other_keyword_beside_a_filled_cache_raises():
    from transformers import DynamicCache

    model = _tiny_llama()
    cache = OakenCache.for_model(model, preset="oaken", profile=_tiny_profile(model))
    keyword = cache_keyword(model)
    other = "past_key_values" if keyword == "cache" else "cache"
    ids = torch.arange(4)[None]
    filled = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, **{keyword: filled})
        with pytest.raises(TypeError, match=f"passed as {other}=.*pass {keyword}=cache"):
            model(input_ids=ids, use_cache=True, **{keyword: filled, other: cache})
    assert cache.get_seq_length() == 0


def test_for_model_with_static_grids_stores_fewer_bytes_and_generates(default_model, model_copy):
    """``static_grids=True``: the same profile's rows stored with static middle/inner grids (each record 8 bytes
    smaller: its two outer scales alone); greedy generation runs through the packed decode,
    and the model keeps the profile as found (a later cache without the switch stores per-row grids)."""
    thresholds = quick_thresholds(default_model)
    tok = default_model.tokenizer
    inputs = tok("The capital of France is", return_tensors="pt")
    kw = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": model_copy.config.eos_token_id}
    static = OakenCache.for_model(model_copy, preset="oaken", profile=thresholds, static_grids=True)
    assert static.store.thresholds.config.static_grids and not thresholds.config.static_grids
    with torch.no_grad():
        got = model_copy.generate(**inputs, cache=static, **kw)
    assert got.shape[1] == inputs.input_ids.shape[1] + 6
    plain = OakenCache.for_model(model_copy, preset="oaken")
    assert plain.store.thresholds is thresholds
    with torch.no_grad():
        model_copy.generate(**inputs, cache=plain, **kw)
    # 4 fp16 scales fewer per 192-value row: 64 / 192 bit per value (the COO streams hold the same entries; an escape
    # byte may differ where a code bit changes an entry's byte)
    saved = plain.bits_per_value()["format"] - static.bits_per_value()["format"]
    assert 0.3 < saved < 0.37, saved
    with pytest.raises(TypeError, match="static_grids"):
        OakenCache.for_model(model_copy, preset="oaken", static_grids=1)
    # static levels: one byte per row more than one static grid, the same profile again
    levels = OakenCache.for_model(model_copy, preset="oaken", profile=thresholds, static_grids=True, static_levels=True)
    assert levels.store.thresholds.config.static_levels == (0.5, 0.7, 0.85, 1.0)
    with torch.no_grad():
        model_copy.generate(**inputs, cache=levels, **kw)
    more = levels.bits_per_value()["format"] - static.bits_per_value()["format"]
    assert 0.0 < more < 0.1, more  # 8 / 192 bit per value, and the escape bytes of other codes
    with pytest.raises(ValueError, match="static_grids=True as well"):
        OakenCache.for_model(model_copy, preset="oaken", static_levels=True)
    with pytest.raises(ValueError, match="ascend strictly"):
        OakenCache.for_model(model_copy, preset="oaken", static_grids=True, static_levels=(0.9, 0.5, 1.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_embedded_model_finds_its_shipped_oaken_plus_profile_in_float32_and_bfloat16(dtype, monkeypatch):
    """A profile belongs to the weights' bytes, so the embedded model loaded in bfloat16 (``load_model(...,
    dtype=torch.bfloat16)``) is other weights than the float32 model: the package ships a profile for each, so that
    ``for_model`` finds one instead of running the oaken-plus search (minutes) in either dtype. Only shipped files
    are looked at here (not the disk cache), and profiling fails the test."""
    import oakenkv.calibrate.plus as plus
    from oakenkv import load_model
    from oakenkv.calibrate.identity import weights_digest

    real = plus.load_profile
    monkeypatch.setattr(plus, "load_profile", lambda entry, path=None, **k: real(entry, path, **k) if path else None)

    def no_profiling(*a, **k):
        raise AssertionError(f"no shipped oaken-plus profile for the embedded model in {dtype}: it profiled")

    monkeypatch.setattr(plus, "profile_plus_many", no_profiling)
    lm = load_model("default", dtype=dtype)
    found = find_profile(lm.model, "oaken-plus", tokenizer=lm.tokenizer, progress=False)
    assert found.transforms is not None and found.fingerprint.weights == weights_digest(lm.model)
    cache = OakenCache.for_model(lm.model, profile=found)
    inputs = lm.tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        out = lm.model.generate(**inputs, max_new_tokens=3, do_sample=False, **{cache_keyword(lm.model): cache})
    assert "Paris" in lm.tokenizer.decode(out[0])
