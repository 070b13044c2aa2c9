"""Importing oakenkv is lean: no torch/transformers/numba, no network, no GPU (checked in a fresh interpreter)."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("torch", "transformers", "numba", "safetensors", "gguf", "accelerate", "pyarrow", "gensim")

# Any socket connection attempt during the import fails loudly, so "downloads nothing" is checked, not assumed.
PROBE = f"""
import json, socket, sys
def _no_network(*args, **kwargs):
    raise AssertionError("network access during import")
socket.socket.connect = _no_network
socket.create_connection = _no_network
import importlib
for mod in sys.argv[1:]:
    importlib.import_module(mod)
print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))
"""


def _heavy_modules_after_importing(*modules: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, *modules], capture_output=True, text=True, check=True, timeout=60
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_oakenkv_is_lean():
    assert _heavy_modules_after_importing("oakenkv") == []


def test_cli_module_is_lean():
    """`oakenkv --help` must not pay for torch: commands import the library inside their body."""
    assert _heavy_modules_after_importing("oakenkv.cli") == []


def test_version():
    import oakenkv

    assert isinstance(oakenkv.__version__, str) and oakenkv.__version__.count(".") >= 2
