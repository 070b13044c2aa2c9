"""Shared pytest fixtures: the embedded default model, loaded once per test session.

Tests that request ``default_model`` (or ``default_tokenizer``) are marked ``model`` automatically, so
``pytest -m "not model"`` runs everything that does not need the real model.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def default_model():
    """The embedded SmolLM2-135M-Instruct as an ``oakenkv.models.LoadedModel`` (fp32, CPU, eval mode).

    Shared by every test of the session: do not modify its weights or config in a test. The first session on a
    machine converts the GGUF (~20 s) into the oakenkv cache; later sessions load the cache in well under 3 s.
    A missing model package fails loudly (``make test`` installs it) instead of skipping, so CI cannot pass
    without having run the model tests.
    """
    from oakenkv.models import MissingModelError, load_model

    try:
        return load_model("default")
    except MissingModelError as e:
        pytest.fail(str(e), pytrace=False)


@pytest.fixture(scope="session")
def default_tokenizer(default_model):
    """The tokenizer of the default model."""
    return default_model.tokenizer


def pytest_collection_modifyitems(config, items):
    for item in items:
        if {"default_model", "default_tokenizer"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.model)
