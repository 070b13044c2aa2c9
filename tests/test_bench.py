"""The decode benchmark on a tiny context (src/oakenkv/bench/decode.py): structure, bytes, paired timing."""

from __future__ import annotations

import importlib.util

import pytest

from kv_helpers import quick_thresholds
from oakenkv.bench.decode import paired, run_decode_bench


def test_paired_ratios():
    p = paired([1.0, 2.0, 3.0], [2.0, 1.0, 4.0])
    assert p == {"median_ratio": 0.75, "faster_steps": 2, "steps": 3}
    with pytest.raises(ValueError):
        paired([1.0], [1.0, 2.0])


def test_decode_bench_small_context(default_model):
    methods = ["oaken", "dynamic"] + (["quanto"] if importlib.util.find_spec("optimum.quanto") else [])
    res = run_decode_bench([40], methods, thresholds=quick_thresholds(default_model), steps=2, source_tokens=16)
    r = res["results"]
    assert set(r) == set(methods)
    for m in methods:
        point = r[m]["40"]
        assert len(point["steps_ms"]) == 2 and point["step_ms"] > 0 and point["kv_bytes"] > 0
    # fp32 DynamicCache holds exactly 40 tokens x 30 layers x 2 x 192 floats; Oaken far less even in whole pages
    assert r["dynamic"]["40"]["kv_bytes"] == 40 * 30 * 2 * 192 * 4 and r["dynamic"]["40"]["fp32_ratio"] == 1.0
    assert r["oaken"]["40"]["kv_bytes"] < r["dynamic"]["40"]["kv_bytes"]
    vs = r["oaken"]["40"]["paired_vs_dynamic"]
    assert vs["steps"] == 2 and 0 <= vs["faster_steps"] <= 2 and vs["median_ratio"] > 0
    assert "step_goal (<= 1.5)" in res["goals"]
    with pytest.raises(ValueError, match="distinct"):
        run_decode_bench([40], ["oaken", "oaken"], thresholds=quick_thresholds(default_model))
