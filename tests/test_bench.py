"""The decode benchmark on a tiny context (src/oakenkv/bench/decode.py): structure, bytes, paired timing."""

from __future__ import annotations

import importlib.util
import statistics

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
            # per round the two are one measurement; the point holds each one's median over rounds (a loaded
            # machine spreads the rounds, so the medians need not be reciprocal: compare them with the rounds)
            for rd in p["rounds"]:
                assert rd["decode_step_ms"] == pytest.approx(1e3 * batch / rd["tokens_per_s"], rel=1e-9)
            for k in ("tokens_per_s", "decode_step_ms", "prefill_s"):
                assert p[k] == pytest.approx(statistics.median(rd[k] for rd in p["rounds"]), rel=1e-12)
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


def test_decode_bench_with_a_batch(default_model):
    res = run_decode_bench(
        [24], ["oaken", "dynamic"], thresholds=quick_thresholds(default_model), steps=1, source_tokens=16, batch=2
    )
    r = res["results"]
    assert res["meta"]["batch"] == 2
    assert r["dynamic"]["24"]["kv_bytes"] == 2 * 24 * 30 * 2 * 192 * 4 and r["dynamic"]["24"]["fp32_ratio"] == 1.0
    assert r["oaken"]["24"]["kv_bytes"] < r["dynamic"]["24"]["kv_bytes"]


def test_tile_rows_offsets_each_row():
    import torch

    from oakenkv.bench.decode import tile_rows

    x = torch.arange(10.0).reshape(1, 1, 10, 1)
    t = tile_rows(x, 12, 2)
    assert t.shape == (2, 1, 12, 1)
    assert t[0, 0, :, 0].tolist() == [*range(10), 0, 1]
    assert t[1, 0, :3, 0].tolist() == [7.0, 8.0, 9.0]  # row 1 starts 37 tokens on: 37 % 10


def test_attention_bench_reports_bandwidth_next_to_memcpy(default_model):
    from oakenkv.bench.attention import run_attention_bench

    res = run_attention_bench([64], [1, 2], [1], thresholds=quick_thresholds(default_model), rounds=1, source_tokens=16)
    pts = res["points"]
    assert [(p["context"], p["batch"], p["threads"]) for p in pts] == [(64, 1, 1), (64, 2, 1)]
    for p in pts:
        # dense records of keys and values (12 B of scales + 96 B of nibbles per token), plus the sparse bytes
        dense = 2 * p["batch"] * 64 * 108
        assert dense < p["packed_bytes"] < 1.5 * dense and p["fp32_bytes"] == 2 * p["batch"] * 64 * 192 * 4
        assert p["packed_gbps"] > 0 and p["memcpy_gbps"] > 0
        assert p["packed_vs_memcpy"] == pytest.approx(p["packed_gbps"] / p["memcpy_gbps"])
    with pytest.raises(ValueError, match="thresholds"):
        run_attention_bench([64], [1], [1])


def test_a_saved_result_is_the_points_one_current_file_with_its_run(tmp_path):
    import json

    from oakenkv.bench import results

    results.start()
    path = results.save("decode", "ctx128_batch1", {"ratio": 1.0, "meta": {"steps": 5}}, root=tmp_path)
    assert path == tmp_path / "decode" / "ctx128_batch1.json"
    body = json.loads(path.read_text())
    assert body["ratio"] == 1.0 and body["settings"] == {"steps": 5}  # the benchmark's own settings kept apart
    run = body["meta"]
    assert run["machine"]["logical_cpus"] >= 1 and run["machine"]["cpu"]
    assert run["load"]["start"] is None or len(run["load"]["start"]) == 3
    assert run["command"] and run["date"] and run["seconds"] is not None
    results.save("decode", "ctx128_batch1", {"ratio": 2.0}, root=tmp_path)  # a rerun replaces the point's file
    assert json.loads(path.read_text())["ratio"] == 2.0 and len(list(tmp_path.rglob("*.json"))) == 1
    with pytest.raises(ValueError, match="letters, digits"):
        results.save("../decode", "x", {}, root=tmp_path)


def test_bench_vllm_runs_a_kind_with_the_plugins_threads_as_a_kind_of_its_own():
    """``oaken-plus@cpus=1`` pairs the plugin's own decode threads against the same kind without them in one run:
    the child engine gets the base kind and that setting (replacing the command line's), plain kinds are unchanged,
    anything else is refused."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_vllm.py"
    spec = importlib.util.spec_from_file_location("bench_vllm", path)
    bv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bv)  # stdlib only at import: vLLM is imported inside the child engines
    argv = ["--kv-mib", "18", "--attention-cpus", "0", "--rounds", "2"]
    cmd = bv._one_command("serve-load", "oaken-plus@cpus=1", argv)
    assert cmd[2:] == ["_one", "serve-load", "oaken-plus", "--kv-mib", "18", "--rounds", "2", "--attention-cpus", "1"]
    assert bv._one_command("serve-load", "fp8", argv)[2:] == ["_one", "serve-load", "fp8", *argv]
    for bad in ("fp8@cpus=1", "oaken-plus@threads=2", "oaken-plus@cpus="):
        with pytest.raises(ValueError, match="@cpus=N"):
            bv._split_kind(bad)
