"""Lazy re-exports for the rooms' ``__init__`` modules: ``import oakenkv.store`` loads nothing until a name is used.

A room's ``__init__`` names its public names and the module that defines each; the first access imports that
module (PEP 562 ``__getattr__``). Inside oakenkv, modules import from the defining module, never through these
re-exports (``tests/test_architecture.py``), so the import graph stays the real one and no room's import order can
form a cycle.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def exports(package: str, names: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """``(__getattr__, __dir__, __all__)`` for ``package``, whose public ``names`` map to their modules (relative
    to ``oakenkv``, e.g. ``{"OakenCache": "hf.cache"}``)."""

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"oakenkv.{module}"), name)
        globals_of_package = importlib.import_module(package).__dict__
        globals_of_package[name] = value  # later accesses skip this function
        return value

    def __dir__() -> list[str]:
        return sorted({*importlib.import_module(package).__dict__, *names})

    return __getattr__, __dir__, sorted(names)
