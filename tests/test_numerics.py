"""oakenkv.util.numerics: the accuracy commands pin torch's (and MKL's, oneDNN's) CPU code paths to AVX2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import oakenkv.util.numerics as numerics
from oakenkv.eval.report import numerics_note


@pytest.fixture
def clean_env(monkeypatch):
    for k in (*numerics.PINNED, numerics.ENV_NATIVE):
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


def test_pin_sets_what_is_unset_and_leaves_what_the_user_set(clean_env):
    clean_env.setattr(numerics, "_x86_with_avx2", lambda: True)
    clean_env.setenv("MKL_CBWR", "COMPATIBLE")
    assert numerics.pin_cpu_numerics()
    assert os.environ["ATEN_CPU_CAPABILITY"] == "avx2" and os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert os.environ["MKL_CBWR"] == "COMPATIBLE"  # the user's
    clean_env.setenv("ATEN_CPU_CAPABILITY", "avx512")
    assert not numerics.pin_cpu_numerics()  # the user asked for other kernels: not pinned, and said so


@pytest.mark.parametrize("why", ["opt-out", "not x86"])
def test_pin_does_nothing_when_opted_out_or_off_x86(clean_env, why):
    if why == "opt-out":
        clean_env.setattr(numerics, "_x86_with_avx2", lambda: True)
        clean_env.setenv(numerics.ENV_NATIVE, "1")
    else:
        clean_env.setattr(numerics.platform, "machine", lambda: "aarch64")
    assert not numerics.pin_cpu_numerics()
    assert not any(k in os.environ for k in numerics.PINNED)


_PROBE = """
import json, sys
from oakenkv.util.numerics import cpu_numerics, pin_cpu_numerics
pinned = pin_cpu_numerics() if sys.argv[1] == "pin" else False
import torch
torch.ones(8).softmax(0)
print(json.dumps([pinned, cpu_numerics()]))
"""


def _probe(how: str, **env: str) -> tuple[bool, dict]:
    base = {k: v for k, v in os.environ.items() if k not in (*numerics.PINNED, numerics.ENV_NATIVE)}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, how], env={**base, **env}, capture_output=True, text=True, check=True
    )
    pinned, rec = json.loads(out.stdout.strip().splitlines()[-1])
    return pinned, rec


@pytest.mark.skipif(not numerics._x86_with_avx2(), reason="pins only x86-64 CPUs with AVX2")
def test_a_fresh_process_runs_the_pinned_kernels_whatever_the_cpu_has():
    """In a new process (as the `oakenkv` command is), pinning before torch's first operation makes torch run its
    AVX2 kernels, also on a CPU whose own choice is AVX-512; the opt-out keeps the CPU's choice."""
    pinned, rec = _probe("pin")
    assert pinned and rec["torch_cpu_capability"] == "AVX2"
    assert rec["env"] == numerics.PINNED and rec["arch"].lower() in ("x86_64", "amd64")
    _, native = _probe("none")
    _, opted_out = _probe("pin", **{numerics.ENV_NATIVE: "1"})
    assert opted_out["torch_cpu_capability"] == native["torch_cpu_capability"]
    assert opted_out["env"] == dict.fromkeys(numerics.PINNED)


def _row(method: str, cap: str | None) -> dict:
    extra = {} if cap is None else {"numerics": {"torch_cpu_capability": cap}}
    return {"method": method, "extra": extra}


def test_the_report_says_when_rows_were_computed_with_other_kernels():
    assert numerics_note([_row("fp", "AVX2"), _row("int4", "AVX2")]) == ""
    assert numerics_note([_row("fp", None), _row("int4", None)]) == ""  # (none recorded: nothing to compare)
    note = numerics_note([_row("fp", "AVX2"), _row("int4", "AVX512"), _row("kivi4", None), _row("oaken", "AVX2")])
    assert "torch AVX2 kernels: fp, oaken" in note and "torch AVX512 kernels: int4" in note
    assert "not recorded: kivi4" in note
    # a damaged record is "not recorded", never an exception
    assert "not recorded: x" in numerics_note([_row("fp", "AVX2"), {"method": "x", "extra": {"numerics": [1]}}])


_CLI = """
import sys
from oakenkv.cli import run
code = run(sys.argv[1:])
import torch
print("capability", code, torch.backends.cpu.get_cpu_capability())
"""


@pytest.mark.skipif(not numerics._x86_with_avx2(), reason="pins only x86-64 CPUs with AVX2")
@pytest.mark.parametrize(
    "args",
    [
        ["eval", "ppl", "--method", "int4", "--window", "32", "--max-windows", "1"],
        ["profile", "--model", "default", "--samples", "2", "--window", "32", "--out", "{tmp}/p.json"],
    ],
    ids=["eval-ppl", "profile"],
)
def test_the_accuracy_commands_pin_before_torchs_first_operation(default_model, tmp_path, args):
    """A command that ran a torch operation before pinning would keep the CPU's own kernels: run each in a fresh
    process with none of the variables set, as a user's shell has it, and read the kernels it ended with."""
    base = {k: v for k, v in os.environ.items() if k not in (*numerics.PINNED, numerics.ENV_NATIVE)}
    argv = [a.replace("{tmp}", str(tmp_path)) for a in args]
    out = subprocess.run([sys.executable, "-c", _CLI, *argv], env=base, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "capability 0 AVX2", out.stdout[-2000:] + out.stderr[-2000:]
