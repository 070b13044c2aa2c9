"""benchmarks/gpu_check.py's dry run: every stage of the GPU check on the CPU under the Triton interpreter, tiny
shapes, so that the one run on a GPU has exercised code (the GPU's own numbers are not checked here)."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed (pip install 'oakenkv[triton]')")

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run_writes_every_stage(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    out = tmp_path / "check.json"
    args = ["--dry-run", "--out", str(out), "--layers", "gqa_4q2kv_x16", "--batches", "1", "--contexts", "16"]
    res = gpu_check.main([*args, "--reps", "1", "--rows", "16"])
    saved = json.loads(out.read_text())
    assert saved["errors"] == [] == res["errors"]
    assert saved["meta"]["dry_run"] is True
    assert all(c["encode_bit_exact"] and c["decode_bit_exact"] for c in saved["correctness"] if "D" in c)
    assert [c["allclose_rtol1e-4"] for c in saved["correctness"] if c["check"] == "attention"] == [True]
    (case,) = saved["attention"]
    assert case["packed_bytes"] > 0 and case["triton_exact"]["median_ms"] > 0 and "median_ms" in case["sdpa_fp16"]
    assert case["flash_attn_fp16"].get("skipped") or "median_ms" in case["flash_attn_fp16"]
    assert {e["rows"] for e in saved["encode"]} == {2, 8} and saved["copy"]["gbps_read_plus_write"] > 0
    assert len(saved["tuning"]["runs"]) == 2
    goals = saved["goals"]
    assert goals["speedup_vs_sdpa"]["value"] is not None and goals["packed_bandwidth_over_copy"]["value"] is not None
    assert [c["batch"] for c in goals["encode_share_of_attention"]["cases"]] == [1]
    # the device store against the CPU store, the model through both backends, a decode step, vLLM's note
    store = saved["store"]
    assert store["bytes_equal"] and store["read_bit_exact"] and store["attention_allclose"]
    assert store["records"]["tokens"] > 0 and store["evicted_slots"][0] > 0
    own = store["rows_own_sinks_adapt"]  # left-padded rows' own sink tokens under adaptive grouping
    assert own["ok"] and own["adapt_moved"] and own["records"]["tokens"] > 0
    model = saved["model"]
    assert model["cpu_store"] == "PagedKVStore" and model["device_store"] == "DeviceKVStore"
    assert model["greedy"]["same_tokens"] and model["perplexity"]["within_0.5%"]
    (step,) = saved["step"]["cases"]
    assert step["oaken"]["median_ms"] > 0 and step["dynamic_fp16"]["median_ms"] > 0 and step["oaken_kv_bytes"] > 0
    assert "vLLM" in saved["vllm"]["skipped"]  # (no vLLM here, or the dry run: it starts none)
    assert goals["vllm_oaken_over_fp8_at_a_budget_limiting_fp8"]["skipped"] == saved["vllm"]["skipped"]
    assert goals["store_bytes_equal_cpu"]["value"] is True and goals["greedy_tokens_equal_cpu"]["value"] is True
    assert goals["store_left_padding_adapt_equal_cpu"]["value"] is True
