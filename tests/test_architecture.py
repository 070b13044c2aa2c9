"""The package's floors (docs/architecture.md): no import cycle inside oakenkv, the product path never imports the
evaluation, benchmark, simulator or hardware packages, and the format's facts are defined in one module.

Read from the source with ``ast`` (nothing is imported), counting imports inside functions too: a lazy import is
still an arrow between modules, and lazy imports are how a cycle hides.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "oakenkv"

#: The modules a user of the cache runs (and what they stand on); they must not reach the packages beside them.
PRODUCT = (
    "oakenkv.attention",
    "oakenkv.cache",
    "oakenkv.calibspec",
    "oakenkv.codec",
    "oakenkv.compat",
    "oakenkv.config",
    "oakenkv.data",
    "oakenkv.demo",
    "oakenkv.diagnose",
    "oakenkv.format",
    "oakenkv.generation",
    "oakenkv.models",
    "oakenkv.pages",
    "oakenkv.paths",
    "oakenkv.plus",
    "oakenkv.profile",
    "oakenkv.quant",
    "oakenkv.reference",
    "oakenkv.resources",
    "oakenkv.rope",
    "oakenkv.store",
    "oakenkv.thresholds",
    "oakenkv.transforms",
    "oakenkv.kernels.attention_cpu",
    "oakenkv.kernels.cpu",
    "oakenkv.kernels.formats",
    "oakenkv.kernels.numba_helpers",
    "oakenkv.kernels.triton",
    "oakenkv.kernels.triton._format",
    "oakenkv.kernels.triton.attention",
    "oakenkv.kernels.triton.coo",
    "oakenkv.kernels.triton.decode",
    "oakenkv.kernels.triton.encode",
    "oakenkv.kernels.triton.view",
    "oakenkv.integrations",
    "oakenkv.integrations.vllm",
    "oakenkv.integrations.vllm._oaken",
    "oakenkv.integrations.vllm.backend",
    "oakenkv.integrations.vllm.layout",
)
BESIDE = ("oakenkv.eval", "oakenkv.bench", "oakenkv.sim", "oakenkv.hw")


def _modules() -> dict[str, Path]:
    mods = {}
    for path in SRC.rglob("*.py"):
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Every oakenkv module ``name`` imports anywhere in its file (``from pkg import submodule`` included)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{a.name}" for a in node.names)
    return {m for m in found if m in known and m != name}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, set(mods)) for name, path in mods.items()}


def test_the_graph_sees_the_package(graph):
    assert {"oakenkv.format", "oakenkv.store", "oakenkv.kernels.cpu", "oakenkv.eval.calibration"} <= set(graph)
    assert "oakenkv.format" in graph["oakenkv.kernels.cpu"]  # a top-level import
    assert "oakenkv.kernels.cpu" in graph["oakenkv.eval.methods"]  # an import inside a method


def test_no_import_cycle_inside_oakenkv(graph):
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycle = [*path[path.index(n) :], n]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if n not in state:
                visit(n, [*path, n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_the_product_path_does_not_import_eval_bench_sim_or_hw(graph):
    for start in PRODUCT:
        reached, todo = set(), [start]
        while todo:  # everything start imports, directly or not
            for n in graph[todo.pop()]:
                if n not in reached:
                    reached.add(n)
                    todo.append(n)
        bad = sorted(m for m in reached if m.startswith(BESIDE))
        assert not bad, f"{start} reaches {bad}"


def test_kernels_and_the_format_import_nothing_above_them(graph):
    below = {"oakenkv", "oakenkv.config", "oakenkv.format", "oakenkv.quant", "oakenkv.kernels"}
    assert graph["oakenkv.format"] <= {"oakenkv", "oakenkv.config"}
    for name in ("oakenkv.kernels.cpu", "oakenkv.kernels.attention_cpu", "oakenkv.kernels.numba_helpers"):
        allowed = below | {"oakenkv.kernels.numba_helpers", "oakenkv.kernels.cpu"}
        assert graph[name] <= allowed, f"{name} imports {sorted(graph[name] - allowed)}"
    # The Triton backend stands on the same floor, plus oakenkv.pages for EVICTED (the page id of a released
    # page, which its view carries); it reads a store's view through the store's own method, never importing it.
    # Only its _format module imports oakenkv: the rest import each other and _format.
    triton = {m for m in graph if m.startswith("oakenkv.kernels.triton")}
    assert {"oakenkv.kernels.triton.attention", "oakenkv.kernels.triton._format"} <= triton
    for name in sorted(triton):
        allowed = below | {"oakenkv.pages"} | triton
        assert graph[name] <= allowed, f"{name} imports {sorted(graph[name] - allowed)}"
        if name != "oakenkv.kernels.triton._format":
            assert graph[name] <= triton, f"{name} imports {sorted(graph[name] - triton)}, not through _format"


def test_the_vllm_plugin_reaches_oakenkv_through_one_module(graph):
    """oakenkv.integrations.vllm imports oakenkv's internals only in its _oaken module (docs/vllm.md): a change of
    oakenkv's layout is a change of that one file."""
    plugin = {m for m in graph if m.startswith("oakenkv.integrations")}
    assert {"oakenkv.integrations.vllm", "oakenkv.integrations.vllm._oaken"} <= plugin
    for name in sorted(plugin - {"oakenkv.integrations.vllm._oaken"}):
        # The one exception: the package loads profiles at registration without numba (its load_profile says why).
        allowed = plugin | ({"oakenkv.thresholds"} if name == "oakenkv.integrations.vllm" else set())
        assert graph[name] <= allowed, f"{name} imports {sorted(graph[name] - allowed)}, not through _oaken"


#: Names of the format's facts: each is defined (assigned, or a def / class) in oakenkv/format.py only.
FORMAT_FACTS = (
    "CHUNK_SIZE",
    "DENSE_BITS",
    "MIDDLE_BITS",
    "COO_ENTRY_BITS",
    "COO_INDEX_MASK",
    "COO_GROUP_BIT",
    "COO_CODE_BIT4",
    "ADVANCE_CONTINUE",
    "SCALE_NAMES",
    "NUM_SCALES",
    "HEADER_BITS",
    "MAX_ROW_SPARSE_BYTES",
    "MAX_DIM",
    "ERROR_MESSAGES",
    "CorruptDataError",
    "EncodedBatch",
    "LayerView",
    "check_encoded",
    "dense_bytes",
    "num_chunks",
    "sparse_capacity",
    "scale_bytes",
    "record_size",
    "to_records",
    "from_records",
    "format_bits",
)


def _definitions(path: Path) -> set[str]:
    """Names a module defines anywhere in its file. A class's annotated fields (``record_size: int`` in a
    dataclass or NamedTuple) are attributes, as ``self.record_size = ...`` is, not definitions: a view that
    carries a record's size under the format's name does not define the format's ``record_size``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    fields = {
        id(stmt) for cls in ast.walk(tree) if isinstance(cls, ast.ClassDef) for stmt in cls.body
        if isinstance(stmt, ast.AnnAssign) and stmt.value is None
    }  # fmt: skip
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and id(node) not in fields:
            names.add(node.target.id)
    return names


def test_the_format_is_defined_once():
    defined_in = {name: [] for name in (*FORMAT_FACTS, "ERR_*")}
    for name, path in _modules().items():
        defs = _definitions(path)
        for fact in FORMAT_FACTS:
            if fact in defs:
                defined_in[fact].append(name)
        if any(d.startswith("ERR_") for d in defs):
            defined_in["ERR_*"].append(name)
    wrong = {fact: where for fact, where in defined_in.items() if where != ["oakenkv.format"]}
    assert not wrong, f"defined outside oakenkv.format (or not at all): {wrong}"


def test_no_second_literal_of_the_scale_layout():
    """The record's scale bytes (6 x 2 or 6 x 4) and the decoding of ``OakenConfig.scale_dtype`` are written once:
    config's scale_itemsize (and its dtype properties) and format's scale_bytes. A second '12 if fp16 else 24'
    is how two copies of the layout drift apart."""
    pattern = re.compile(
        r"\b(12|24)\s+if\b|\belse\s+(12|24)\b"  # the six scales' bytes
        r"|\b2\s+if\b.*\belse\s+4\b|\b16\s+if\b.*\belse\s+32\b"  # a scale's bytes or bits
        r"|float16\"?\s+else\s+(np|torch)\.float32"  # a scale dtype
    )
    hits = []
    for name, path in _modules().items():
        if name == "oakenkv.config" or name.startswith(("oakenkv.sim", "oakenkv.hw")):
            continue  # the definition; models of the accelerator (no readers of the bytes)
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if pattern.search(line):
                hits.append(f"{name}:{i}: {line.strip()}")
    assert not hits, "\n".join(hits)
