"""Running the Triton kernels under the interpreter (``TRITON_INTERPRET=1``, CPU tensors) at a bearable speed.

Triton's interpreter runs every program of a grid in Python, over numpy. Around that it has a fixed cost per call of
a ``@triton.jit`` *helper* from inside a kernel (``InterpretedFunction.__call__``): it patches ``triton.language``
again (``_patch_lang``: ``inspect.getmembers`` over the language modules, a lambda per builtin), although the kernel's
launch (``GridExecutor.__call__``) has patched the same modules for the whole grid and restores them after it. Our
kernels call small helpers many times per program (reductions, the COO block reader, the tile reader): measured under
the interpreter on the default model, that re-patching was 28% of the wall time of a ``generate`` with
``backend="triton"`` (221 s of 784 s, load 12 on 2 cores).

:func:`skip_nested_patching` makes a helper patch only on the first call, within a launch, of a helper of the
same language namespaces (a helper outside any launch still patches, as before). A later call's patch would only
set the same attributes again (the interpreter never undoes a helper's patch: the patched builtins stay patched),
so it changes no number: the helpers run the same code over the same patched modules. Only for the interpreter;
on a GPU nothing here runs. Installed by :func:`install`, which every kernel module calls at import (a no-op unless
``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import os
import threading

_installed = False
_state = threading.local()
#: Per helper function: the language namespaces its module sees (what ``_patch_lang`` patches for it).
_namespaces: dict = {}


def skip_nested_patching() -> bool:
    """Install the shortcut (module doc) once per process; returns whether it is installed (False when triton's
    interpreter does not have the two methods it wraps: a triton version this was not written against)."""
    global _installed
    if _installed:
        return True
    try:
        from triton.runtime import interpreter as ti
    except Exception:  # pragma: no cover - triton absent or broken: nothing to speed up
        return False
    grid_call = vars(ti.GridExecutor).get("__call__")
    fn_call = vars(ti.InterpretedFunction).get("__call__")
    if grid_call is None or fn_call is None or not hasattr(ti, "_patch_lang"):
        return False

    def launch(self, *args, **kwargs):
        outer = getattr(_state, "patched", None)
        _state.patched = set()  # the language namespaces patched by helpers during this launch
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            _state.patched = outer

    def helper(self, *args, **kwargs):
        patched = getattr(_state, "patched", None)
        if patched is None:  # (outside a launch: the interpreter's own path)
            return fn_call(self, *args, **kwargs)
        key = _namespaces.get(self.fn)
        if key is None:
            key = _namespaces[self.fn] = frozenset(
                id(v) for v in self.fn.__globals__.values() if v is ti.tl or v is ti.tl.core
            )
        if key not in patched:  # the first call of a helper of these namespaces in this launch patches them
            ti._patch_lang(self.fn)
            patched.add(key)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise ti.InterpreterError(repr(e)) from e

    ti.GridExecutor.__call__ = launch
    ti.InterpretedFunction.__call__ = helper
    _installed = True
    return True


def install() -> None:
    """:func:`skip_nested_patching` when the kernels run under the interpreter (``TRITON_INTERPRET=1``)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        skip_nested_patching()
