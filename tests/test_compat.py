"""oakenkv.util.compat: the keyword a model takes its cache by, in every transformers 5.x."""

import pytest

from oakenkv.util.compat import cache_keyword, cache_kwargs


class _New:
    def forward(self, input_ids=None, cache=None, use_cache=None, **kwargs):
        return kwargs


class _Old:
    def forward(self, input_ids=None, past_key_values=None, use_cache=None, **kwargs):
        return kwargs


class _Neither:
    def forward(self, input_ids=None, **kwargs):
        return kwargs


def test_cache_keyword_follows_the_forward_signature():
    assert cache_keyword(_New()) == "cache"
    assert cache_keyword(_Old()) == "past_key_values"
    cache = object()
    assert cache_kwargs(_Old(), cache) == {"past_key_values": cache}
    # the keyword lands in the named parameter, not in **kwargs (where a model would ignore it)
    assert _Old().forward(**cache_kwargs(_Old(), cache)) == {}
    assert _New().forward(**cache_kwargs(_New(), cache)) == {}


def test_cache_keyword_refuses_a_model_without_one():
    with pytest.raises(TypeError, match="neither"):
        cache_keyword(_Neither())


def test_the_installed_transformers_model_takes_one(default_model):
    assert cache_keyword(default_model.model) in ("cache", "past_key_values")
