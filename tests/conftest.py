"""Shared pytest fixtures: the embedded default model, loaded once per test session.

Tests that request ``default_model`` (or ``default_tokenizer``) are marked ``model`` automatically, so
``pytest -m "not model"`` runs everything that does not need the real model.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

# OpenMP threads that busy-wait between parallel regions collapse when the cores are oversubscribed (a shared
# 2-core machine, several pytest runs at once): one 13-token forward of the default model took 2.5-14 s with the
# default policy and 0.2 s with PASSIVE, at 2 threads and a load average of 12. Set before torch is imported
# (test modules are imported after this conftest); an explicit setting in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# torch's AVX2 kernels on every x86-64 machine, as `oakenkv eval` runs them (oakenkv.util.numerics): the tests'
# float paths then compute the same numbers on whichever machine CI lands, AVX-512 or not (tolerances tuned on one
# kind of machine held too tightly on the other). Set before torch runs its first operation;
# OAKENKV_NATIVE_NUMERICS=1 keeps the CPU's own kernels.
from oakenkv.util.numerics import pin_cpu_numerics  # (light: os and platform only)

pin_cpu_numerics()

# Triton kernels (oakenkv.kernels.triton) run under the interpreter on CPU tensors when no GPU is there. @triton.jit
# reads TRITON_INTERPRET when a kernel's module is imported, and any test may import those modules first (the numba
# dispatcher walk in test_attention.py imports every module), so it is set here, before every test module.
try:
    import torch

    _has_cuda = torch.cuda.is_available()
except ImportError:  # pragma: no cover - torch is a dependency
    _has_cuda = False
if not _has_cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Hypothesis: random examples on every local run (new ones find new bugs), the same examples in CI
# (HYPOTHESIS_PROFILE=ci, set by .ci/run), so that a CI run on main never fails on a draw no commit caused.
# Loaded here, before the test modules build their settings objects, which inherit the profile.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(scope="session")
def default_model():
    """The embedded SmolLM2-135M-Instruct as an ``oakenkv.assets.models.LoadedModel`` (fp32, CPU, eval mode).

    Shared by every test of the session: do not modify its weights or config in a test. The first session on a
    machine converts the GGUF (~20 s) into the oakenkv cache; later sessions load the cache in well under 3 s.
    A missing model package fails loudly (``make test`` installs it) instead of skipping, so CI cannot pass
    without having run the model tests.
    """
    from oakenkv.assets.models import MissingModelError, load_model

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
