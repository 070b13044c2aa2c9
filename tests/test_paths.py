"""oakenkv.util.paths: atomic writes with the umask's permissions, and the rule that every file the library writes goes
through them (checked on the source, like tests/test_architecture.py)."""

from __future__ import annotations

import ast
import os
import stat
from pathlib import Path

import pytest

from oakenkv.util.paths import atomic_write, atomic_writer, dir_mode, file_mode, umask

SRC = Path(__file__).resolve().parents[1] / "src" / "oakenkv"


@pytest.fixture
def set_umask():
    """Set the process umask for one test, restored afterwards."""
    old = os.umask(0o022)
    yield lambda m: os.umask(m)
    os.umask(old)


@pytest.mark.parametrize("mask", [0o022, 0o002, 0o077, 0o027])
def test_atomic_write_gives_the_umask_mode_like_open(tmp_path, set_umask, mask):
    set_umask(mask)
    assert umask() == mask
    assert file_mode() == 0o666 & ~mask and dir_mode() == 0o777 & ~mask
    p = atomic_write(tmp_path / "sub" / "a.json", "{}\n")
    with open(tmp_path / "plain.txt", "w") as f:  # what a plain open gives
        f.write("x")
    assert stat.S_IMODE(p.stat().st_mode) == stat.S_IMODE((tmp_path / "plain.txt").stat().st_mode)
    assert stat.S_IMODE(p.stat().st_mode) == 0o666 & ~mask  # not tempfile's 0600
    assert p.read_text() == "{}\n"


def test_atomic_write_kinds_of_data(tmp_path):
    assert atomic_write(tmp_path / "t", "é").read_bytes() == "é".encode()
    assert atomic_write(tmp_path / "b", b"\x00\xff").read_bytes() == b"\x00\xff"
    assert atomic_write(tmp_path / "f", lambda f: f.write(b"abc")).read_bytes() == b"abc"


def test_an_interrupted_write_leaves_the_old_file_and_no_temp(tmp_path):
    p = atomic_write(tmp_path / "x.json", "old")
    for exc in (KeyboardInterrupt(), OSError("disk full")):
        with pytest.raises(type(exc)), atomic_writer(p) as f:
            f.write(b"half of the new cont")
            raise exc
        assert p.read_text() == "old"
        assert sorted(q.name for q in tmp_path.iterdir()) == ["x.json"]


def test_thresholds_and_cached_files_are_readable_by_the_group(tmp_path, set_umask):
    """The issue's example: thresholds (and every cache file) were 0600 from tempfile under a 022 umask."""
    from oakenkv.calibrate.thresholds import GroupThresholds, ModelFingerprint, Thresholds
    from oakenkv.format.config import OakenConfig

    set_umask(0o022)
    th = Thresholds(
        OakenConfig(),
        ModelFingerprint("llama", 1, 1, 4),
        (GroupThresholds(-2, -0.1, 0.1, 2),),
        (GroupThresholds(-1, -0.1, 0.1, 1),),
    )
    p = th.save(tmp_path / "t.json")
    assert stat.S_IMODE(p.stat().st_mode) == 0o644


def test_ranges_cache_refuses_code_and_survives_a_torn_file(tmp_path):
    """torch.load(weights_only=True): a pickle that runs code is refused (and recomputed), never executed; a torn
    file (the old non-atomic write, interrupted) is ignored with a warning instead of breaking every later run."""
    import torch

    from oakenkv.calibrate import ranges as cal

    ran = []

    class Payload:
        def __reduce__(self):
            return (ran.append, ("executed",))

    from oakenkv.calibrate.diskcache import CalibrationKey
    from oakenkv.calibrate.identity import ModelFingerprint
    from oakenkv.calibrate.spec import CalibrationSpec

    key = CalibrationKey("m", ModelFingerprint("llama", 1, 1, 4), CalibrationSpec(), "0" * 64)
    entry, other = cal._ranges_entry(key, 0.005), cal._ranges_entry(key, 0.01)
    bad = tmp_path / "ranges-code.pt"
    torch.save({"key_extremes": Payload()}, bad)
    with pytest.warns(UserWarning, match="unreadable cached ranges"):
        assert cal._load_ranges(entry, bad) is None
    assert ran == []
    good = cal.KVRanges([(-1.0, 1.0)], [(-2.0, 2.0)], [torch.zeros(1, 2)], [torch.ones(1, 2)], 0.005)
    path = tmp_path / "ranges.pt"
    cal._save_ranges(good, entry, path)
    back = cal._load_ranges(entry, path)
    assert back.key_extremes == good.key_extremes and torch.equal(back.key_channel_hi[0], good.key_channel_hi[0])
    assert back.sha256() == good.sha256()
    with pytest.warns(UserWarning, match="made for another q"):
        assert cal._load_ranges(other, path) is None
    path.write_bytes(path.read_bytes()[:50])  # torn
    with pytest.warns(UserWarning, match="unreadable"):
        assert cal._load_ranges(entry, path) is None


# ------------------------------------------------------------------------------------------------ the rule

#: Calls that write a file when given a path.
_WRITERS = {"write_text", "write_bytes", "savefig", "save_file", "save_pretrained", "save"}
#: Where a direct write is right, and why: inside a private temporary directory that is renamed into place whole
#: (the converted-model cache), a scratch directory deleted afterwards, or the atomic writer itself.
_ALLOWED = {
    ("util/paths.py", "atomic_writer"): "the atomic writer itself",
    ("assets/models.py", "_assemble"): "mkstemp + os.replace with file_mode(), streamed while hashing",
    ("assets/models.py", "_convert_gguf"): "writes inside a private mkdtemp directory renamed into place whole",
    ("hw/report.py", "synth_stats"): "a scratch file in a TemporaryDirectory",
    ("integrations/vllm/export.py", "export_model"): "a private mkdtemp directory renamed into place whole",
}


def _direct_writes() -> list[tuple[str, str, int, str]]:
    found = []
    for path in SRC.rglob("*.py"):
        rel = str(path.relative_to(SRC))
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if not isinstance(node, ast.Call):
                    continue
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
                mode = next((a.value for a in node.args[1:2] if isinstance(a, ast.Constant)), None)
                mode = next((k.value.value for k in node.keywords if k.arg == "mode"), mode)
                is_open_w = name in ("open", "fdopen") and isinstance(mode, str) and any(c in mode for c in "wax")
                is_torch_save = (
                    name == "save" and isinstance(f, ast.Attribute) and getattr(f.value, "id", "") == "torch"
                )
                # torch.save into a file object (lambda f: torch.save(obj, f)) is how atomic_write is fed
                if is_torch_save and isinstance(node.args[1], ast.Name) and node.args[1].id == "f":
                    continue
                if name == "save" and not is_torch_save:
                    continue  # Thresholds.save and friends write through atomic_write themselves
                if is_open_w or is_torch_save or (name in _WRITERS - {"save"}):
                    found.append((rel, fn.name, node.lineno, name))
    return found


def test_every_file_write_goes_through_atomic_write():
    """Rule 4 of issue 23 on the source: no module writes a file in place (a reader or an interruption would see
    half of it), except where listed with the reason."""
    offenders = sorted({w for w in _direct_writes() if (w[0], w[1]) not in _ALLOWED})
    # savefig into a file object is how plots are fed to atomic_write
    offenders = [w for w in offenders if not (w[3] == "savefig" and _savefig_into_file(w))]
    assert offenders == [], "write files with oakenkv.util.paths.atomic_write: " + ", ".join(
        f"{r}:{line} {fn}() {name}" for r, fn, line, name in offenders
    )


def _savefig_into_file(w: tuple[str, str, int, str]) -> bool:
    text = (SRC / w[0]).read_text().splitlines()[w[2] - 1]
    return "lambda f: fig.savefig(f" in text
