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


def test_generate_bench_small_points(default_model):
    from oakenkv.bench.generate import run_generate_bench

    methods = ["oaken", "dynamic"] + (["quanto"] if importlib.util.find_spec("optimum.quanto") else [])
    seen = []
    res = run_generate_bench(
        points=[(12, 1), (12, 2)],
        methods=methods,
        thresholds=quick_thresholds(default_model),
        new_tokens=3,
        rounds=2,
        progress=lambda done, total, msg: seen.append((done, total)),
    )
    r = res["results"]
    assert set(r) == set(methods)
    for m in methods:
        for key, batch in (("12x1", 1), ("12x2", 2)):
            p = r[m][key]
            assert (p["prompt"], p["batch"], p["new_tokens"], len(p["rounds"])) == (12, batch, 3, 2)
            assert p["tokens_per_s"] > 0 and p["prefill_s"] > 0 and p["kv_bytes"] > 0
            assert p["decode_step_ms"] == pytest.approx(1e3 * batch / p["tokens_per_s"], rel=0.5)
    # fp32 DynamicCache after 12 + 3 tokens: 14 stored (the last new token is never fed back)
    assert r["dynamic"]["12x2"]["kv_bytes"] == 2 * 14 * 30 * 2 * 192 * 4
    assert r["oaken"]["12x2"]["kv_bytes"] < r["dynamic"]["12x2"]["kv_bytes"]
    assert 0.0 <= r["oaken"]["12x1"]["tokens_equal_to_dynamic"] <= 1.0
    vs = r["oaken"]["12x2"]["paired_vs_dynamic"]
    assert vs["tokens_per_s_ratio"]["rounds"] == 2 and vs["prefill_tokens_per_s_ratio"]["median"] > 0
    assert "decode >= 1.0x dynamic at every point" in res["goals"]
    assert seen[-1][0] == seen[-1][1] == 2 * (2 + 1) * len(methods)  # progress reached the end
    with pytest.raises(ValueError, match="distinct"):
        run_generate_bench(points=[(12, 1)], methods=["dynamic", "dynamic"])
    with pytest.raises(ValueError, match="new_tokens"):
        run_generate_bench(points=[(12, 1)], methods=["dynamic"], new_tokens=1)
