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
so it changes no number: the helpers run the same code over the same patched modules.

Two more fixed costs per operation, both work whose result nobody reads:

- :func:`skip_overflow_checks`: every integer ``+``, ``-`` and ``*`` of a kernel also ran in int64 with range
  comparisons (``sanitize_overflow``, on in the interpreter's options) for a ``device_assert`` that emits nothing
  unless ``debug`` is set (it never is here): 32% of a cProfile of the default model's ``generate``;
- :func:`lazy_tuple_types`: every tensor and block type builds a ``triton.language.core.tuple`` of its shape, whose
  constructor formats the name of its ``tuple_type``; the type is now built when first read (rarely): measured
  0.78x of the device store's time per decode step of the default model, interleaved A/B at load 2 (written against
  triton 3.6, installed only there).

The rest of the interpreter's cost is per operation of a program, whatever the size of its blocks: the device
store launches its kernels with larger blocks and fewer programs under the interpreter (:func:`store_blocks`,
:func:`interpreting`). Only for the interpreter; on a GPU nothing here runs. The shortcuts are installed by
:func:`install`, which every kernel module calls at import (a no-op unless ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import dataclasses
import os
import threading

_installed = False
_lazy_tuples = False
#: triton versions whose ``core.tuple`` :func:`lazy_tuple_types` was written against (the pinned 3.6).
_LAZY_TUPLE_VERSIONS = ("3.6.",)
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


def skip_overflow_checks() -> bool:
    """Switch off the interpreter's integer overflow checks, whose result it discards (module doc); returns whether
    they are off (False under ``debug``, where the checks assert, or on a triton without the option)."""
    try:
        from triton.runtime import interpreter as ti
    except Exception:  # pragma: no cover - triton absent or broken
        return False
    options = getattr(getattr(ti, "interpreter_builder", None), "options", None)
    if options is None or not hasattr(options, "sanitize_overflow") or getattr(options, "debug", False):
        return False
    if options.sanitize_overflow:
        ti.interpreter_builder.options = dataclasses.replace(options, sanitize_overflow=False)
    return True


def lazy_tuple_types() -> bool:
    """Make ``triton.language.core.tuple`` compute its ``type`` when first read instead of at construction (module
    doc); returns whether it is installed (only on the triton versions it was checked against, and only when a
    tuple built both ways has the same type)."""
    global _lazy_tuples
    if _lazy_tuples:
        return True
    try:
        import triton
        from triton.language import core
    except Exception:  # pragma: no cover - triton absent or broken
        return False
    if not triton.__version__.startswith(_LAZY_TUPLE_VERSIONS):
        return False
    tup, tuple_type = getattr(core, "tuple", None), getattr(core, "tuple_type", None)
    types_of = getattr(core, "_type_for_tuple_values", None)
    if tup is None or tuple_type is None or types_of is None or "__getattr__" not in vars(tup):
        return False
    eager_init, named_field = tup.__init__, tup.__getattr__

    def init(self, args, type=None):  # the original, less the type of a tuple built without one
        self.values = [i for i in args]
        if isinstance(type, tuple_type):
            self.type = type
        elif type is not None:
            self.type = tuple_type(type)

    def getattr_(self, name):
        if name == "type":  # (only while not computed: then it is an instance attribute)
            t = self.__dict__["type"] = types_of(self.__dict__["values"])
            return t
        return named_field(self, name)

    want = tup([core.constexpr(3), core.constexpr(4)])
    tup.__init__, tup.__getattr__ = init, getattr_
    got = tup([core.constexpr(3), core.constexpr(4)])
    if str(got.type) != str(want.type) or got.values != want.values:  # pragma: no cover - another triton
        tup.__init__, tup.__getattr__ = eager_init, named_field
        return False
    _lazy_tuples = True
    return True


def interpreting() -> bool:
    """Whether the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``: CPU tensors, numpy). The one
    test for it: a wrapper that launches a kernel in another configuration under the interpreter (larger blocks:
    the interpreter's cost is per operation, not per value; module doc) asks this."""
    return os.environ.get("TRITON_INTERPRET") == "1"


#: Under the interpreter the device store reads its pages in larger blocks than on a GPU (:func:`store_blocks`):
#: tokens per attention tile (one tile covers a context of up to 64 tokens), log2 of the COO bytes read per token and
#: step (128: a whole stream of the default model's 192-value rows, at most 118 bytes measured, in one step), rows
#: per program of the float read, of the decode attention's combine and of the encoder.
INTERPRET_TILE_TOKENS = 64
INTERPRET_SPARSE_BLOCK_LOG = 7
INTERPRET_READ_ROWS = 64
INTERPRET_COMBINE_ROWS = 64
INTERPRET_ENCODE_ROWS = 64


def store_blocks() -> dict[str, dict]:
    """The launch options ``oakenkv.store.device.DeviceKVStore`` passes its kernels: keyword arguments of
    ``attention.paged_decode_attention_parts`` (``"attention"``), ``prefill.paged_prefill_attention``
    (``"prefill"``), ``decode.read_view`` (``"read"``) and ``encode.encode_records`` (``"encode"``).

    On a GPU none: each kernel's defaults, the configurations ``benchmarks/triton_sm90_check.py`` compiles. Under
    the interpreter (:func:`interpreting`) larger blocks and fewer programs: it runs each operation of a program
    over a whole block in numpy, so its cost is per program and operation, not per value (a 16-token tile costs
    about what a 64-token one does). So: one attention tile over a context of up to 64 tokens, a whole COO stream
    in one step of the walk, all KV heads in one program (``merge_heads``), and many rows per program of the
    encoder, the float read and the split combine. The stored bytes and the dequantized floats are the same;
    attention sums in another order (float32 rounding). The kernels' own tests launch them with their defaults,
    so the GPU's block boundaries stay tested under the interpreter too."""
    if not interpreting():
        return {"attention": {}, "prefill": {}, "read": {}, "encode": {}}
    tiles = {
        "tile_tokens": INTERPRET_TILE_TOKENS,
        "sparse_block_log": INTERPRET_SPARSE_BLOCK_LOG,
        "merge_heads": True,
    }
    return {
        "attention": {**tiles, "combine_rows": INTERPRET_COMBINE_ROWS},
        "prefill": dict(tiles),
        "read": {"rows_per_program": INTERPRET_READ_ROWS, "sparse_block_log": INTERPRET_SPARSE_BLOCK_LOG},
        "encode": {"rows_per_program": INTERPRET_ENCODE_ROWS},
    }


def install() -> None:
    """The interpreter's shortcuts (:func:`skip_nested_patching`, :func:`skip_overflow_checks`,
    :func:`lazy_tuple_types`) when the kernels run under it (:func:`interpreting`)."""
    if interpreting():
        skip_nested_patching()
        skip_overflow_checks()
        lazy_tuple_types()
