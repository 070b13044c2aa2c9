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

#: The rooms (sub-packages of oakenkv) and their floors: a module imports modules of its own room or of rooms on
#: lower floors only (docs/architecture.md). ``eval``, ``bench``, ``sim`` and ``hw`` stand beside the product path:
#: they may import it, it never imports them.
FLOORS = {
    "_lazy": -1,  # the rooms' lazy re-exports (oakenkv._lazy)
    "util": 0,
    "format": 1,
    "assets": 1,
    "quant": 2,
    "kernels": 3,
    "calibrate": 4,
    "store": 5,
    "hf": 6,
    "integrations": 6,
    "methods": 7,
    "apps": 8,
    "eval": 9,
    "bench": 9,
    "sim": 9,
    "hw": 9,
    "cli": 10,
}
BESIDE = ("oakenkv.eval", "oakenkv.bench", "oakenkv.sim", "oakenkv.hw")


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


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
    assert {
        "oakenkv.format.layout",
        "oakenkv.store.paged",
        "oakenkv.kernels.cpu.codec",
        "oakenkv.calibrate.ranges",
    } <= set(graph)
    assert "oakenkv.format.layout" in graph["oakenkv.kernels.cpu.codec"]  # a top-level import
    assert "oakenkv.kernels.cpu.codec" in graph["oakenkv.methods.oaken"]  # an import inside a method


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


def test_every_module_lives_in_a_room(graph):
    loose = sorted(m for m in graph if m != "oakenkv" and _room(m) not in FLOORS)
    assert not loose, f"modules outside the rooms of FLOORS: {loose}"


def test_a_room_imports_only_rooms_below_it(graph):
    wrong = []
    for m, deps in sorted(graph.items()):
        for d in sorted(deps):
            if d == "oakenkv" or _room(d) == _room(m):
                continue
            if m != "oakenkv" and FLOORS[_room(d)] >= FLOORS[_room(m)]:
                wrong.append(f"{m} -> {d}")
    assert not wrong, "imports of a room on the same or a higher floor:\n" + "\n".join(wrong)


def test_the_product_path_does_not_import_eval_bench_sim_or_hw(graph):
    product = [m for m in graph if m != "oakenkv" and FLOORS[_room(m)] < FLOORS["eval"]]
    for start in product:
        reached, todo = set(), [start]
        while todo:  # everything start imports, directly or not
            for n in graph[todo.pop()]:
                if n not in reached:
                    reached.add(n)
                    todo.append(n)
        bad = sorted(m for m in reached if m.startswith(BESIDE))
        assert not bad, f"{start} reaches {bad}"


def test_inside_oakenkv_names_come_from_their_defining_module():
    """A room's ``__init__`` re-exports its public names for users; oakenkv's own modules import each name from
    the module that defines it, so the import graph above is the real one (an ``__init__`` imports nothing)."""
    mods = _modules()
    packages = {name for name, path in mods.items() if path.name == "__init__.py"}
    wrong = []
    for name, path in sorted(mods.items()):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and not node.level and node.module in packages:
                defined = _definitions(mods[node.module])  # (a name the __init__ defines itself is its own)
                for a in node.names:
                    if f"{node.module}.{a.name}" not in mods and a.name not in defined:
                        wrong.append(f"{name}: from {node.module} import {a.name}")
    assert not wrong, "\n".join(wrong)


def test_room_inits_import_nothing_at_import_time():
    """``import oakenkv.<room>`` stays cheap and cycle-free: an ``__init__`` names its exports lazily."""
    for name, path in _modules().items():
        if path.name != "__init__.py" or name in ("oakenkv.integrations.vllm", "oakenkv.sim", "oakenkv.cli"):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom)) and n.module != "__future__"]
        mods = {a.name for n in top if isinstance(n, ast.Import) for a in n.names}
        mods |= {n.module for n in top if isinstance(n, ast.ImportFrom)}
        assert {m for m in mods if m.startswith("oakenkv")} <= {"oakenkv._lazy"}, name


def test_the_triton_kernels_reach_oakenkv_through_one_module(graph):
    """Only ``kernels.triton._oaken`` imports oakenkv (the format and the quantizer): the rest import each other."""
    triton = {m for m in graph if m.startswith("oakenkv.kernels.triton")}
    assert {"oakenkv.kernels.triton.attention", "oakenkv.kernels.triton._oaken"} <= triton
    for name in sorted(triton - {"oakenkv.kernels.triton._oaken"}):
        assert graph[name] <= triton, f"{name} imports {sorted(graph[name] - triton)}, not through _oaken"
    rooms = {_room(m) for m in graph["oakenkv.kernels.triton._oaken"]}
    assert rooms <= {"format", "quant"}, rooms


def test_the_vllm_plugin_reaches_oakenkv_through_one_module(graph):
    """oakenkv.integrations.vllm imports oakenkv's internals only in its _oaken module (docs/vllm.md): a change of
    oakenkv's layout is a change of that one file."""
    plugin = {m for m in graph if m.startswith("oakenkv.integrations")}
    assert {"oakenkv.integrations.vllm", "oakenkv.integrations.vllm._oaken"} <= plugin
    for name in sorted(plugin - {"oakenkv.integrations.vllm._oaken"}):
        # The exceptions: the package loads profiles at registration without numba (its load_profile says why), and
        # reads its settings with the environment's checked reader and the profile file with the checked file reader
        # (standard library only).
        package = {"oakenkv.calibrate.thresholds", "oakenkv.util.exact", "oakenkv.util.paths"}
        allowed = plugin | (package if name == "oakenkv.integrations.vllm" else set())
        assert graph[name] <= allowed, f"{name} imports {sorted(graph[name] - allowed)}, not through _oaken"


#: Names of the format's facts: each is defined (assigned, or a def / class) in oakenkv/format/layout.py only.
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
    "EVICTED",
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
    wrong = {fact: where for fact, where in defined_in.items() if where != ["oakenkv.format.layout"]}
    assert not wrong, f"defined outside oakenkv.format.layout (or not at all): {wrong}"


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
        if name == "oakenkv.format.config" or name.startswith(("oakenkv.sim", "oakenkv.hw")):
            continue  # the definition; models of the accelerator (no readers of the bytes)
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if pattern.search(line):
                hits.append(f"{name}:{i}: {line.strip()}")
    assert not hits, "\n".join(hits)
