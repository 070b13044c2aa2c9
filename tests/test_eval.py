"""The evaluation harness: fake-quant cache, pre-RoPE round trip, methods, perplexity, zero-shot, report, CLI."""

from __future__ import annotations

import json
import math
import os
import warnings

import numpy as np
import pytest
import torch

from oakenkv.eval.report import label_offsets, pareto_front, write_report
from oakenkv.methods.base import KVFakeQuantizer
from oakenkv.methods.registry import FAMILIES, Method, build_method, canonical, parse_spec, sweep_config


class _Identity(KVFakeQuantizer):
    """Stores keys/values unchanged (counts 16 bits), optionally pre-RoPE: isolates the cache plumbing."""

    def __init__(self, key_position="post_rope"):
        self.key_position = key_position
        self.seen = []

    def quantize(self, layer_idx, kind, x):
        self.seen.append((layer_idx, kind, tuple(x.shape)))
        return x, 16.0 * x.numel()


def _ids(tok, n=64):
    from oakenkv.assets.data import load_text, token_windows

    return token_windows(tok, load_text("wikitext2"), n, max_windows=1)


def _fq_method(model, quantizer):
    from oakenkv.methods.fakequant import FakeQuantCache

    return Method("test", "test", {}, lambda: FakeQuantCache(model, quantizer), quantizer.key_position)


# ---------------------------------------------------------------------------------------------- specs


def test_parse_spec_aliases_defaults_and_errors():
    assert parse_spec("int4") == ("int", {"bits": 4, "group": 0})
    assert parse_spec("kivi4")[1] == {"bits": 4, "group": 32, "residual": 128}
    fam, p = parse_spec("oaken:outer=0.06,inner=0.09")
    assert fam == "oaken" and p["outer"] == 0.06 and p["inner"] == 0.09
    assert canonical(fam, p) == "oaken:outer=0.06,inner=0.09"
    assert canonical("oaken", FAMILIES["oaken"].defaults()) == "oaken"
    with pytest.raises(ValueError, match="unknown method"):
        parse_spec("nope")
    with pytest.raises(ValueError, match="unknown parameter 'width'"):
        parse_spec("int:width=4")
    with pytest.raises(ValueError, match="not an int"):
        parse_spec("int:bits=four")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("int:bits=1.5", "bits='1.5' is not an int"),
        ("int:bits=true", "bits='true' is not an int"),
        ("int:bits=1e3", "bits='1e3' is not an int"),
        ("int:bits=0", "must be >= 2 and <= 8"),
        ("oaken:outer=nan", "must be a finite number"),
        ("oaken:outer=inf", "must be a finite number"),
        ("oaken:outer=-0.1", "must be >= 0"),
        ("oaken:outer=0.6,inner=0.5", "outer \\+ inner must be below 1"),
        ("oaken:outer=0.04,outer=0.05", "outer is given twice"),
        ("oaken:granularity=channel", "use one of token, head"),
        ("oaken-plus:sink=65", "must be >= 0 and <= 64"),
        ("oaken-plus:rot_k=2", "must be >= 0 and <= 1"),
        ("kivi:residual=-1", "must be >= 0"),
        ("int:bits", "bad parameter 'bits' \\(use key=value\\)"),
    ],
)
def test_parse_spec_takes_exact_types_in_range_once(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_spec(spec)


def test_the_registry_declares_every_method_once():
    from oakenkv.apps.diagnose import METHODS
    from oakenkv.methods.registry import ALIASES, NAMES, methods_help

    for name, fam in FAMILIES.items():
        assert fam.name == name and parse_spec(name) == (name, fam.defaults())
        assert fam.name in methods_help()
        assert fam.key_position in ("post_rope", "pre_rope")
        for p in fam.params.values():  # every default parses as its own type
            assert type(p.parse(name, "x", str(p.default))) is type(p.default)
    for alias, spec in ALIASES.items():
        assert parse_spec(alias) == parse_spec(spec) and alias in methods_help()
    assert set(METHODS) <= set(vars(NAMES).values())  # the diagnosis names registry methods only


def test_sweep_config_keeps_paper_split():
    c = sweep_config(0.10)
    assert c.outer_ratio == pytest.approx(0.04) and c.inner_ratio == pytest.approx(0.06)
    assert sweep_config(0.2).outlier_ratio == pytest.approx(0.2)


# ---------------------------------------------------------------------------------------------- RoPE and cache


def test_rope_round_trip_and_matches_transformers(default_model):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from oakenkv.calibrate.rope import RopeTable, apply_rope, invert_rope

    rope = RopeTable(default_model.model)
    k = torch.randn(1, 3, 40, 64)
    cos, sin = rope.cos_sin(0, 7, 40, k)
    assert cos.shape == (1, 1, 40, 64)
    assert torch.allclose(invert_rope(apply_rope(k, cos, sin), cos, sin), k, atol=1e-5)
    _, k_ref = apply_rotary_pos_emb(k, k, cos[:, 0], sin[:, 0])
    assert torch.allclose(apply_rope(k, cos, sin), k_ref, atol=1e-6)
    # positions 7.. are the tail of positions 0..: memoized tables are sliced consistently
    cos0, _ = rope.cos_sin(0, 0, 47, k)
    assert torch.equal(cos0[..., 7:, :], cos)


def test_identity_fake_quant_cache_matches_fp_exactly(default_model):
    from transformers import DynamicCache

    m, ids = default_model.model, _ids(default_model.tokenizer)
    q = _Identity()
    with torch.no_grad():
        ref = m(input_ids=ids, past_key_values=DynamicCache(config=m.config), use_cache=True).logits
        got = m(input_ids=ids, past_key_values=_fq_method(m, q).make_cache(), use_cache=True).logits
    assert torch.equal(ref, got)
    n_layers = m.config.num_hidden_layers
    assert len(q.seen) == 2 * n_layers and q.seen[0] == (0, "key", (1, 3, 64, 64))


def test_pre_rope_identity_is_a_round_trip(default_model):
    from transformers import DynamicCache

    m, ids = default_model.model, _ids(default_model.tokenizer)
    with torch.no_grad():
        ref = m(input_ids=ids, past_key_values=DynamicCache(config=m.config), use_cache=True).logits
        got = m(input_ids=ids, past_key_values=_fq_method(m, _Identity("pre_rope")).make_cache(), use_cache=True).logits
    assert (ref - got).abs().max() < 1e-3 * ref.abs().max()


def test_fp_method_ppl_equals_plain_forward(default_model):
    from oakenkv.eval.ppl import perplexity

    m, tok = default_model.model, default_model.tokenizer
    ids = _ids(tok, 128)
    with torch.no_grad():
        loss = m(input_ids=ids, labels=ids).loss
    r = perplexity(m, ids, build_method("fp", m, tok))
    assert r.ppl == pytest.approx(math.exp(float(loss)), rel=1e-5)
    assert r.effective_bits == 16.0 and r.tokens == 127 and r.windows == 1


def test_stateless_method_same_in_prefill_and_chunked_decode(default_model):
    from oakenkv.eval.ppl import perplexity

    m, tok = default_model.model, default_model.tokenizer
    ids = _ids(tok, 64)
    meth = build_method("int4", m, tok)
    # A cache of a stateless method stores the same values whether the tokens come in one update or in several.
    whole_cache, chunked_cache = meth.make_cache(), meth.make_cache()
    torch.manual_seed(0)
    k, v = torch.randn(1, 3, 64, 64), torch.randn(1, 3, 64, 64)
    whole_cache.update(k, v, 0)
    for a in range(0, 64, 16):
        chunked_cache.update(k[:, :, a : a + 16], v[:, :, a : a + 16], 0)
    assert torch.equal(whole_cache.layers[0].keys, chunked_cache.layers[0].keys)
    assert torch.equal(whole_cache.layers[0].values, chunked_cache.layers[0].values)
    # Through the model, one forward pass of 64 tokens and four of 16 compute the same K/V only up to float
    # summation order (FP: 1e-6 apart), and INT4's fp16 grid end points turn such a difference into another grid
    # for a head vector now and then: 2% of perplexity on 64 tokens between one and two threads (AVX-512 Xeon).
    whole = perplexity(m, ids, meth)
    chunked = perplexity(m, ids, meth, chunk=16)
    fp = perplexity(m, ids, build_method("fp", m, tok))
    fp_chunked = perplexity(m, ids, build_method("fp", m, tok), chunk=16)
    assert fp_chunked.ppl == pytest.approx(fp.ppl, rel=1e-5)
    assert chunked.ppl == pytest.approx(whole.ppl, rel=0.05)
    assert whole.effective_bits == pytest.approx(4.5)
    assert whole.ppl > fp.ppl


def test_kivi_residual_covers_short_windows(default_model):
    from oakenkv.eval.ppl import perplexity

    m, tok = default_model.model, default_model.tokenizer
    ids = _ids(tok, 64)
    fp = perplexity(m, ids, build_method("fp", m, tok))
    # residual 128 > 64 tokens: nothing is quantized yet, KIVI is exactly FP and stores fp16
    long_res = perplexity(m, ids, build_method("kivi:residual=128", m, tok))
    assert long_res.ppl == fp.ppl and long_res.effective_bits == 16.0
    short = perplexity(m, ids, build_method("kivi:group=16,residual=32", m, tok))
    assert short.ppl != fp.ppl
    # keys: 32 of 64 tokens quantized at 4 + 32/16 bits; values: 32 quantized at 4 + 32/16 (group 16 channels)
    assert short.effective_bits == pytest.approx((32 * 6 + 32 * 16) / 64)


def test_oaken_method_bits_follow_the_format(default_model):
    from oakenkv.eval.ppl import perplexity
    from oakenkv.methods.oaken import OakenQuantizer

    class Fixed:
        def layer(self, i, kind):
            return (-1.0, -0.05, 0.05, 1.0)

    from oakenkv.format.config import OakenConfig

    m, tok = default_model.model, default_model.tokenizer
    q = OakenQuantizer(Fixed(), OakenConfig())
    x = torch.randn(1, 3, 10, 64)
    y, bits = q.quantize(0, "key", x)
    n_out = int(((x > 1) | (x < -1) | (x.abs() <= 0.05)).sum())
    assert bits == 4 * x.numel() + 8 * n_out + 10 * (96 + 16)
    assert y.shape == x.shape and (y - x).abs().max() < 0.2
    r = perplexity(m, _ids(tok, 64), _fq_method(m, q))
    assert 4.5 < r.effective_bits < 8 and math.isfinite(r.ppl)


def test_perplexity_resumes_from_its_checkpoint(default_model, tmp_path, monkeypatch):
    """An interrupted run leaves a checkpoint; the next run does only the missing windows, same result."""
    import oakenkv.eval.ppl as ppl_mod
    from oakenkv.assets.data import load_text, token_windows
    from oakenkv.eval.ppl import perplexity

    m, tok = default_model.model, default_model.tokenizer
    ids = token_windows(tok, load_text("wikitext2"), 32, max_windows=3)
    method = build_method("int4", m, tok, "default")
    whole = perplexity(m, ids, method, model_name="default")
    assert len(whole.window_nll) == 3 and sum(whole.window_nll) == pytest.approx(whole.nll)

    ckpt = tmp_path / "sub" / "run.partial.json"
    real, calls = ppl_mod.window_nll, []

    def interrupted(*args, **kwargs):
        if len(calls) == 2:
            raise KeyboardInterrupt
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(ppl_mod, "window_nll", interrupted)
    with pytest.raises(KeyboardInterrupt):
        perplexity(m, ids, method, model_name="default", checkpoint=ckpt)
    state = json.loads(ckpt.read_text())
    assert state["kind"] == "ppl_checkpoint" and state["window_nll"] == whole.window_nll[:2]

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(ppl_mod, "window_nll", counting)
    calls.clear()
    resumed = perplexity(m, ids, method, model_name="default", checkpoint=ckpt)
    assert len(calls) == 1 and not ckpt.exists()  # only the third window ran; the checkpoint is gone
    assert resumed.window_nll == whole.window_nll and resumed.ppl == whole.ppl
    assert resumed.effective_bits == whole.effective_bits and resumed.tokens == whole.tokens
    # a checkpoint of another run (other windows) is refused, not mixed in
    ckpt.write_text(json.dumps({**state, "windows_sha256": "0" * 64}))
    with pytest.raises(ValueError, match="not a checkpoint of this run"):
        perplexity(m, ids, method, model_name="default", checkpoint=ckpt)
    # nor are windows computed with other CPU kernels (their numbers differ in the last bits: oakenkv.util.numerics)
    assert state["torch_cpu_capability"] == resumed.extra["numerics"]["torch_cpu_capability"]
    ckpt.write_text(json.dumps({**state, "torch_cpu_capability": "OTHER"}))
    with pytest.raises(ValueError, match="differs in torch_cpu_capability"):
        perplexity(m, ids, method, model_name="default", checkpoint=ckpt)


# ---------------------------------------------------------------------------------------------- commands


def test_cli_eval_ppl_writes_json(default_model, tmp_path):
    from typer.testing import CliRunner

    from oakenkv.cli import app

    out = tmp_path / "r.json"
    res = CliRunner().invoke(
        app, ["eval", "ppl", "--method", "int4", "--window", "128", "--max-windows", "1", "--json", str(out)]
    )
    assert res.exit_code == 0, res.output
    d = json.loads(out.read_text())
    assert {"method", "ppl", "effective_bits", "tokens", "windows"} <= set(d)
    assert d["method"] == "int4"
    assert d["tokens"] == 127 and d["windows"] == 1 and d["effective_bits"] == pytest.approx(4.5)
    assert len(d["window_nll"]) == 1 and not (tmp_path / "r.partial.json").exists()  # checkpoint removed at the end


def test_cli_eval_ppl_on_a_text_file(default_model, tmp_path):
    """``--text-file``: a user's own text, recorded by path, size and SHA-256; the same windows as that text given
    any other way. Anything that is not a regular UTF-8 file of at most 64 MiB is one error line, before the model
    loads."""
    import hashlib

    from typer.testing import CliRunner

    from oakenkv.cli import app

    text = "def f(x):\n    return x + 1\n\n" * 200
    src = tmp_path / "code.py"
    src.write_text(text)
    out = tmp_path / "r.json"
    args = ["eval", "ppl", "--method", "int4", "--window", "128", "--max-windows", "2"]
    res = CliRunner().invoke(app, [*args, "--text-file", str(src), "--json", str(out)])
    assert res.exit_code == 0, res.output
    d = json.loads(out.read_text())
    assert d["dataset"] == "file" and d["windows"] == 2
    assert d["extra"]["text_file"] == {
        "path": str(src.resolve()), "bytes": len(text), "sha256": hashlib.sha256(text.encode()).hexdigest()
    }  # fmt: skip
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe not utf-8")
    big = tmp_path / "big.txt"
    with open(big, "wb") as f:  # sparse: 64 MiB + 1 byte without writing them
        f.truncate(64 * 2**20 + 1)
    os.mkfifo(tmp_path / "fifo")
    for path, why in [
        (tmp_path / "missing.txt", "does not exist"),
        (tmp_path, "not a regular file"),
        (tmp_path / "fifo", "not a regular file"),
        (tmp_path / "empty.txt", "is empty"),
        (big, "64 MiB"),
    ]:
        res = CliRunner().invoke(app, [*args, "--text-file", str(path)], env={"COLUMNS": "300"})
        assert res.exit_code != 0 and why in res.output, (path, res.output)
    res = CliRunner().invoke(app, [*args, "--text-file", str(src), "--dataset", "wikipedia"], env={"COLUMNS": "300"})
    assert res.exit_code != 0 and "not both" in res.output
    from oakenkv.assets.data import load_text_file

    with pytest.raises(ValueError, match="not UTF-8"):
        load_text_file(tmp_path / "bad.txt")


@pytest.mark.slow
def test_zeroshot_small_limit(default_model):
    from oakenkv.eval.zeroshot import zeroshot

    m, tok = default_model.model, default_model.tokenizer
    r = zeroshot(m, tok, build_method("int4", m, tok), ["piqa"], limit=4)
    t = r.tasks["piqa"]
    assert t["n"] == 4 and 0 <= t["acc_norm"] <= 1 and t["reported_metric"] == "acc_norm"
    assert r.effective_bits == pytest.approx(4.5)
    pd = t["per_doc"]  # per-document scores, for paired comparisons: they average to the accuracy
    assert pd["doc_id"] == [0, 1, 2, 3] and set(pd["acc_norm"]) <= {0, 1}
    assert sum(pd["acc_norm"]) / 4 == pytest.approx(t["acc_norm"]) and sum(pd["acc"]) / 4 == pytest.approx(t["acc"])


# ---------------------------------------------------------------------------------------------- report


def test_pareto_front():
    pts = [(4.5, 0.3), (5.0, 0.1), (5.5, 0.2), (8.0, 0.0), (4.0, 1.0)]
    assert pareto_front(pts) == [4, 0, 1, 3]


def test_label_offsets_never_overlap():
    """Labels of crowded points (the 3-window panel: six Oaken variants at 5.38 bits) get boxes that do not
    overlap one another or another point; a lone point's label stays at its default place."""

    def box(anchor, size, off):
        return (anchor[0] + off[0], anchor[1] + off[1], anchor[0] + off[0] + size[0], anchor[1] + off[1] + size[1])

    def overlap(a, b):
        return not (a[2] <= b[0] or a[0] >= b[2] or a[3] <= b[1] or a[1] >= b[3])

    rng = np.random.default_rng(0)
    for n in (1, 2, 8, 20):
        anchors = [(float(x), float(y)) for x, y in rng.uniform([100, 100], [140, 160], size=(n, 2))]
        sizes = [(float(w), 9.0) for w in rng.uniform(20, 120, size=n)]
        offs = label_offsets(anchors, sizes)
        boxes = [box(a, s, o) for a, s, o in zip(anchors, sizes, offs, strict=True)]
        for i in range(n):
            for j in range(n):
                if i != j:
                    assert not overlap(boxes[i], boxes[j]), (n, i, j)
                    dot = (anchors[j][0] - 4, anchors[j][1] - 4, anchors[j][0] + 4, anchors[j][1] + 4)
                    assert not overlap(boxes[i], dot), (n, i, j)
    assert label_offsets([(10.0, 10.0), (10.0, 100.0)], [(50.0, 9.0)] * 2) == [(3.0, 3.0)] * 2
    # Two points 5 pixels apart: the upper one's label stays, the lower one's moves by whole label heights.
    offs = label_offsets([(10.0, 10.0), (10.0, 15.0)], [(50.0, 9.0)] * 2)
    assert offs[1] == (3.0, 3.0) and offs[0][1] != 3.0 and (offs[0][1] - 3.0) % 10.0 == 0
    # At the right edge a label goes left of its point.
    assert label_offsets([(10.0, 10.0), (480.0, 100.0)], [(50.0, 9.0)] * 2, right=500.0) == [(3.0, 3.0), (-53.0, 3.0)]
    with pytest.raises(ValueError, match="anchors"):
        label_offsets([(0.0, 0.0)], [])


def test_report_tables_and_plot(tmp_path):
    def ppl(method, bits, p):
        return {
            "kind": "ppl",
            "method": method,
            "ppl": p,
            "effective_bits": bits,
            "tokens": 100,
            "windows": 1,
            "model": "default",
            "window": 101,
            "stride": 101,
            "extra": {"key_position": "post_rope"},
        }

    for i, r in enumerate([ppl("fp", 16, 10.0), ppl("oaken", 5.4, 10.2), ppl("int4", 4.5, 11.0)]):
        (tmp_path / f"{i}.json").write_text(json.dumps(r))
    zs = {
        "kind": "zeroshot",
        "method": "fp",
        "model": "default",
        "effective_bits": 16,
        "limit": 4,
        "tasks": {"piqa": {"acc": 0.5, "acc_norm": 0.75, "reported": 0.75, "n": 4}},
    }
    (tmp_path / "z.json").write_text(json.dumps(zs))
    (tmp_path / "other.json").write_text(json.dumps({"unrelated": 1}))
    md, png = tmp_path / "out" / "results.md", tmp_path / "out" / "p.png"
    text = write_report([tmp_path], md, png)
    assert "| oaken | 5.40 | 10.2000 | +0.2000 |" in text
    assert "| int4 | 4.50 | 11.0000 | +1.0000 |" in text
    assert "75.00" in text and png.stat().st_size > 1000
    with pytest.raises(FileNotFoundError):
        write_report([tmp_path / "missing"], md, png)
    # A run over more windows scores other tokens: its own table, listed first, never mixed with the 1-window one.
    more = tmp_path / "more"
    more.mkdir()
    for i, r in enumerate([ppl("fp", 16, 9.0), ppl("oaken", 5.4, 9.5)]):
        (more / f"{i}.json").write_text(json.dumps({**r, "windows": 20}))
    text = write_report([tmp_path, more], md, png)
    assert text.index("(20 window(s)") < text.index("(1 window(s)")
    assert "| oaken | 5.40 | 9.5000 | +0.5000 |" in text and "| oaken | 5.40 | 10.2000 | +0.2000 |" in text


def test_paired_delta_interval():
    """The paired bootstrap: exact delta, an interval around it, and pairing that cancels shared window noise."""
    from oakenkv.eval.report import paired_delta

    rng = np.random.default_rng(1)
    hard = rng.normal(3.0, 0.5, size=40) * 100  # windows differ a lot in difficulty (100 tokens each)
    a, b = hard + 2.0, hard  # method a costs exactly 0.02 nats per token on every window
    d, lo, hi = paired_delta(list(a), list(b), 4000)
    assert d == pytest.approx(math.exp(a.sum() / 4000) - math.exp(b.sum() / 4000))
    assert 0 < lo <= d <= hi and hi - lo < 0.5 * d  # a constant per-window cost: an interval well above 0
    noisy = b + rng.normal(0, 5.0, size=40)  # no systematic difference: the interval holds 0
    _, lo, hi = paired_delta(list(noisy), list(b), 4000)
    assert lo < 0 < hi
    with pytest.raises(ValueError, match="equally long"):
        paired_delta([1.0, 2.0], [1.0], 200)


def test_paired_accuracy():
    from oakenkv.eval.report import paired_accuracy

    rng = np.random.default_rng(2)
    fp = rng.integers(0, 2, size=400)
    same = fp.copy()
    same[:10] ^= 1  # 10 answers flip, both ways: no difference to find
    d, lo, hi, gained, lost = paired_accuracy(list(same), list(fp))
    assert gained + lost == 10 and d == pytest.approx((gained - lost) / 400) and lo < 0 < hi
    worse = fp.copy()
    worse[np.flatnonzero(fp == 1)[:40]] = 0  # 40 right answers lost
    d, lo, hi, gained, lost = paired_accuracy(list(worse), list(fp))
    assert (d, gained, lost) == (pytest.approx(-0.1), 0, 40) and hi < 0 and lo < d < hi
    with pytest.raises(ValueError, match="equally long"):
        paired_accuracy([1, 0], [1])


def test_report_zeroshot_paired_and_grouped_by_limit_and_tasks(tmp_path):
    def zs(method, correct, limit, tasks=("piqa",)):
        n = len(correct)
        return {
            "kind": "zeroshot",
            "method": method,
            "model": "default",
            "effective_bits": {"fp": 16, "int4": 4.5}[method],
            "limit": limit,
            "tasks": {
                t: {
                    "acc_norm": sum(correct) / n,
                    "reported": sum(correct) / n,
                    "reported_metric": "acc_norm",
                    "n": n,
                    "per_doc": {"doc_id": list(range(n)), "acc_norm": correct},
                }
                for t in tasks
            },
        }

    fp = [1, 1, 0, 1, 0, 1, 1, 0, 1, 1]
    q = [0, 1, 0, 0, 0, 1, 1, 1, 1, 1]  # loses docs 0 and 3, gains doc 7
    runs = [zs("fp", fp, 10), zs("int4", q, 10), zs("fp", fp[:4], 4), zs("fp", fp, 10, ("piqa", "hellaswag"))]
    for i, r in enumerate(runs):
        (tmp_path / f"{i}.json").write_text(json.dumps(r))
    text = write_report([tmp_path], tmp_path / "r.md", tmp_path / "r.png")
    lines = text.splitlines()
    # one table per (documents, tasks): more documents first, then more tasks; a subset names its tasks
    titles = [line for line in lines if line.startswith("### Zero-shot")]
    assert titles == [
        "### Zero-shot (first 10 validation documents per task of piqa, hellaswag)",
        "### Zero-shot (first 10 validation documents per task of piqa)",
        "### Zero-shot (first 4 validation documents per task of piqa)",
    ]
    # only the tasks a table's runs have get a column (the paper's order), none all n/a
    heads = [line for line in lines if line.startswith("| method | eff. bits | piqa (")]
    assert [h.count("acc") for h in heads] == [2, 1, 1] and "hellaswag" in heads[0] and "winogrande" not in text
    assert ["| mean |" in h for h in heads] == [True, False, False]  # no mean of a single task
    for i, line in enumerate(lines):  # header, separator and first row of each table: as many columns
        if line.startswith("| method | eff. bits | piqa ("):
            assert line.count("|") == lines[i + 1].count("|") == lines[i + 2].count("|")
    row = next(line for line in lines if line.startswith("| int4 |") and "Δ" not in line and "[" in line)
    assert "-10.00 [" in row and "(+1/−2)" in row and "n/a" not in row  # paired with the piqa-only fp run


def test_zeroshot_table_documents_per_task_follow_the_columns():
    from oakenkv.eval.report import zeroshot_table

    def task(n):
        return {"reported": 0.5, "n": n}

    uneven = {"method": "fp", "effective_bits": 16, "tasks": {"winogrande": task(1267), "piqa": task(1838)}}
    even = {"method": "int4", "effective_bits": 4.5, "tasks": {"winogrande": task(200), "piqa": task(200)}}
    rows = zeroshot_table([uneven, even]).splitlines()
    assert "piqa (acc_norm) | winogrande (acc)" in rows[0]  # the paper's task order, whatever the JSON's
    assert rows[2].endswith("| 1838/1267 |") and rows[3].endswith("| 200 |")


def test_report_shows_paired_intervals(tmp_path):
    base = {"kind": "ppl", "tokens": 300, "windows": 3, "model": "default", "window": 101, "stride": 101}
    nll = {"fp": [200.0, 250.0, 300.0], "oaken": [203.0, 252.0, 304.0], "int4": [210.0, 262.0, 309.0]}
    for i, (m, w) in enumerate(nll.items()):
        p = math.exp(sum(w) / 300)
        (tmp_path / f"{i}.json").write_text(
            json.dumps({**base, "method": m, "ppl": p, "effective_bits": 16 - i, "window_nll": w})
        )
    text = write_report([tmp_path], tmp_path / "r.md", tmp_path / "r.png")
    assert "Δ 95% CI" in text and "paired bootstrap" in text
    row = next(line for line in text.splitlines() if line.startswith("| int4 |"))
    vs_oaken = math.exp(sum(nll["int4"]) / 300) - math.exp(sum(nll["oaken"]) / 300)
    assert f"{vs_oaken:+.3f} [" in row


def test_oaken_bit_formula_matches_the_codec_bytes():
    """The eval counts 4 n + 8 m + 112 bits per token vector; the real fused format adds only rare escapes."""
    from oakenkv.format.config import OakenConfig
    from oakenkv.kernels.codec import effective_bits, encode
    from oakenkv.methods.oaken import OakenQuantizer

    class Fixed:
        def layer(self, i, kind):
            return (-1.6, -0.08, 0.08, 1.6)

    cfg = OakenConfig()
    x = torch.randn(1, 3, 200, 64, generator=torch.Generator().manual_seed(3))
    _, bits = OakenQuantizer(Fixed(), cfg).quantize(0, "value", x)
    rows = x.permute(0, 2, 1, 3).reshape(200, 192)
    real = effective_bits(encode(rows, Fixed().layer(0, "value"), cfg)).total
    assert bits / x.numel() <= real < bits / x.numel() + 0.05


@pytest.mark.parametrize(
    "changes", [{}, {"granularity": "head"}, {"scale_dtype": "float32"}, {"inner_bits": 4, "outer_ratio": 0.1}]
)
def test_oaken_method_is_the_reference_quantizer_bit_for_bit(changes):
    """The eval runs the codec kernels' round trip; it must be quant.quantize_dequantize exactly."""
    from oakenkv.format.config import OakenConfig
    from oakenkv.methods.oaken import OakenQuantizer
    from oakenkv.quant.quantizer import quantize_dequantize

    thr = (-1.6, -0.08, 0.08, 1.6)

    class Fixed:
        def layer(self, i, kind):
            return thr

    cfg = OakenConfig().replace(**changes)
    x = torch.randn(2, 3, 37, 64, generator=torch.Generator().manual_seed(5)) * 0.8
    x[0, 1, 3] = 0.0  # a zero vector and a heavy-tailed token
    x[1, :, 7] *= 40
    y, _ = OakenQuantizer(Fixed(), cfg).quantize(0, "key", x)
    rows = x.permute(0, 2, 1, 3).reshape(2 * 37, 192)
    if cfg.granularity == "head":
        rows = rows.reshape(-1, 64)
    want = quantize_dequantize(rows, thr, cfg).reshape(2, 37, 3, 64).permute(0, 2, 1, 3)
    assert torch.equal(y, want)


def test_oaken_ablation_quantizes_only_one_kind():
    from oakenkv.format.config import OakenConfig
    from oakenkv.methods.oaken import OakenQuantizer

    class Fixed:
        def layer(self, i, kind):
            return (-1.6, -0.08, 0.08, 1.6)

    x = torch.randn(1, 3, 50, 64, generator=torch.Generator().manual_seed(4))
    q = OakenQuantizer(Fixed(), OakenConfig(), ("key",))
    y, bits = q.quantize(0, "value", x)
    assert y is x and bits == 16 * x.numel()
    y, bits = q.quantize(0, "key", x)
    assert not torch.equal(y, x) and bits < 6 * x.numel()
    assert parse_spec("oaken:only=k")[1]["only"] == "k"
    with pytest.raises(ValueError, match="kinds must be"):
        OakenQuantizer(Fixed(), OakenConfig(), ("keys",))


def test_one_pass_calibration_matches_the_profiler(default_model, tmp_path, monkeypatch):
    """calibrate_all profiles several configurations in one pass; each must equal oakenkv.calibrate.profile's own
    result."""
    import warnings

    from oakenkv.calibrate import ranges as cal
    from oakenkv.calibrate.profile import profile_thresholds
    from oakenkv.format.config import OakenConfig

    monkeypatch.setattr(cal, "_cache_dir", lambda: tmp_path)
    m, tok = default_model.model, default_model.tokenizer
    spec = cal.CalibrationSpec(samples=2, window=32)
    configs = [(OakenConfig(), False), (OakenConfig(key_position="pre_rope"), False), (sweep_config(0.2), True)]
    cal.calibrate_all(m, tok, "default", configs, spec)
    assert len(list(tmp_path.glob("thr-*.json"))) == 3 and len(list(tmp_path.glob("ranges-*.pt"))) == 1
    ids = cal.calibration_windows(tok, spec)
    for config, tuning in configs:
        mine = cal.oaken_thresholds(m, tok, "default", config, spec, kurtosis_tuning=tuning)  # from the disk cache
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref = profile_thresholds(m, ids, config, kurtosis_tuning=tuning)
        for i in range(ref.num_layers):
            for kind in ("key", "value"):
                a, b = mine.layer(i, kind).as_tuple(), ref.layer(i, kind).as_tuple()
                assert a == pytest.approx(b, rel=1e-4, abs=1e-5), (config, i, kind)
    rng = cal.kv_ranges(m, tok, "default", spec)
    pre = cal.oaken_thresholds(m, tok, "default", configs[1][0], spec)
    for i in range(pre.num_layers):
        lo, hi = rng.key_extremes[i]
        assert lo < pre.layer(i, "key").to_lo and hi > pre.layer(i, "key").to_hi
        assert rng.key_channel_lo[i].shape == (3, 64)


# ---------------------------------------------------------------------------------------------- residual window
# oaken:residual=R (oakenkv.methods.fakequant's module doc): each layer's newest tokens at full precision, the oldest n
# - R of a window of n >= 2R tokens quantized in place after an update. On a tiny random Llama (3 KV heads of 64, as
# the default model), through the cache's own update: no real model needed.

_H, _HD = 3, 64
_THR = (-1.6, -0.08, 0.08, 1.6)


@pytest.fixture(scope="module")
def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=96,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=_H,
        head_dim=_HD,
    )
    return LlamaForCausalLM(cfg).eval()


def _tiny_thresholds(model, sink=None):
    """Thresholds of ``model`` (oaken-plus transforms with ``sink`` sink tokens when ``sink`` is not None)."""
    from oakenkv.calibrate.thresholds import GroupThresholds, ModelFingerprint, Thresholds
    from oakenkv.calibrate.transforms import LayerTransforms, Transforms
    from oakenkv.format.config import OakenConfig

    keys = tuple(GroupThresholds(-1.6 - 0.1 * i, -0.08, 0.08, 1.6 + 0.1 * i) for i in range(2))
    values = tuple(GroupThresholds(-1.5 - 0.1 * i, -0.1, 0.1, 1.5 + 0.1 * i) for i in range(2))
    transforms = None
    if sink is not None:
        g = torch.Generator().manual_seed(7)
        layers = tuple(
            LayerTransforms(key_shift=tuple(torch.randn(_H * _HD, generator=g).mul(0.5).tolist()), key_rotation=True)
            for _ in range(2)
        )
        transforms = Transforms(layers, _H, _HD, sink_tokens=sink)
    return Thresholds(OakenConfig(), ModelFingerprint.from_model(model), keys, values, transforms=transforms)


def _quantizer(model, which):
    """Oaken post-RoPE, Oaken pre-RoPE, or oaken-plus (key shift and rotation, 2 sink tokens)."""
    from oakenkv.format.config import OakenConfig
    from oakenkv.methods.oaken import OakenQuantizer, PlusQuantizer

    class Fixed:
        def layer(self, i, kind):
            return _THR

    if which == "post":
        return OakenQuantizer(Fixed(), OakenConfig())
    if which == "pre":
        return OakenQuantizer(Fixed(), OakenConfig(key_position="pre_rope"))
    return PlusQuantizer(_tiny_thresholds(model, sink=2))


def _kv_tokens(t, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(1, _H, t, _HD, generator=g)
    k[:, :, 0] *= 8.0  # an atypical first token (a sink's key)
    v = torch.randn(1, _H, t, _HD, generator=g) * 0.8
    return k.to(dtype), v.to(dtype)


def test_residual_zero_quantizes_every_token_as_it_arrives(tiny_llama):
    """residual=0 (the default) is the cache as it was: every update's tokens quantized at insertion."""
    from oakenkv.methods.fakequant import FakeQuantCache

    q = _quantizer(tiny_llama, "pre")
    cache = FakeQuantCache(tiny_llama, q)
    assert cache.residual == 0
    k, v = _kv_tokens(20)
    ref = FakeQuantCache(tiny_llama, q)  # only its quantize_kv: the quantization at insertion, chunk by chunk
    want_k, want_v = [], []
    for a, b in ((0, 12), (12, 13), (13, 14), (14, 20)):
        got_k, got_v = cache.update(k[:, :, a:b], v[:, :, a:b], 1)
        wk, wv = ref.quantize_kv(1, k[:, :, a:b], v[:, :, a:b], a)
        want_k.append(wk)
        want_v.append(wv)
        assert torch.equal(got_k, torch.cat(want_k, dim=-2)) and torch.equal(got_v, torch.cat(want_v, dim=-2))
    assert not torch.equal(got_k, k)  # (something was quantized)
    assert cache.layers[1]._fq_window is None and cache.layers[1]._fq_quantized == 0


@pytest.mark.parametrize("which", ["post", "pre", "plus"])
@pytest.mark.parametrize("s", [15, 16, 21])
def test_residual_prefill_keeps_the_last_tokens_exact(tiny_llama, which, s):
    """A prefill of S < 2R stays exact; S >= 2R quantizes tokens [0, S - R) as plain Oaken does, keeps the rest."""
    from oakenkv.methods.fakequant import FakeQuantCache

    r = 8
    q = _quantizer(tiny_llama, which)
    k, v = _kv_tokens(s)
    got_k, got_v = FakeQuantCache(tiny_llama, q, residual=r).update(k, v, 0)
    plain_k, plain_v = FakeQuantCache(tiny_llama, q).update(k, v, 0)
    nq = 0 if s < 2 * r else s - r
    assert torch.equal(got_k[:, :, :nq], plain_k[:, :, :nq]) and torch.equal(got_v[:, :, :nq], plain_v[:, :, :nq])
    exact_k = q.unquantized(0, "key", k)  # k itself but for oaken-plus (its shift: test_residual_plus_window_...)
    assert torch.equal(got_k[:, :, nq:], exact_k[:, :, nq:]) and torch.equal(got_v[:, :, nq:], v[:, :, nq:])
    assert not torch.equal(plain_k[:, :, nq:], exact_k[:, :, nq:])  # (plain Oaken would have quantized them)
    if nq:
        assert not torch.equal(got_k[:, :, :nq], exact_k[:, :, :nq])


@pytest.mark.parametrize("which", ["post", "pre", "plus"])
def test_residual_decode_flushes_on_time_as_plain_oaken_would(tiny_llama, which):
    """A prefill of 5, then one token at a time with R = 4: the window reaches 2R = 8 tokens at 8, 12, 16, ...
    and its oldest 4 are quantized then; every quantized token reads exactly as a residual-0 cache fed the same
    tokens reads it (pre-RoPE: at its own position; oaken-plus: the sink tokens by absolute position)."""
    from oakenkv.methods.fakequant import FakeQuantCache

    q = _quantizer(tiny_llama, which)
    k, v = _kv_tokens(22, seed=1)
    cache, plain = FakeQuantCache(tiny_llama, q, residual=4), FakeQuantCache(tiny_llama, q)
    layer = cache.layers[1]
    steps = [(0, 5), *((i, i + 1) for i in range(5, 22))]
    quantized = []
    for a, b in steps:
        got_k, got_v = cache.update(k[:, :, a:b], v[:, :, a:b], 1)
        plain_k, plain_v = plain.update(k[:, :, a:b], v[:, :, a:b], 1)
        nq = layer._fq_quantized
        quantized.append(nq)
        assert got_k.shape[-2] == b and torch.equal(got_k, layer.keys) and torch.equal(got_v, layer.values)
        assert torch.equal(got_k[:, :, :nq], plain_k[:, :, :nq]) and torch.equal(got_v[:, :, :nq], plain_v[:, :, :nq])
        exact_k = q.unquantized(1, "key", k[:, :, nq:b])
        assert torch.equal(got_k[:, :, nq:], exact_k) and torch.equal(got_v[:, :, nq:], v[:, :, nq:b])
        assert torch.equal(layer._fq_window[0], k[:, :, nq:b])  # (the originals, quantized from when they leave)
    # tokens seen after each step: 5, 6, ..., 21
    assert quantized == [0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12, 16, 16, 16]
    assert cache.layers[0]._fq_quantized == 0  # (another layer, never updated)


def test_residual_plus_window_keys_carry_the_shift_of_the_dequantized_ones(tiny_llama):
    """oaken-plus returns its dequantized keys less the key shift (softmax ignores a shift common to all keys):
    the window's keys must carry it too, or each would score ``q . shift`` above the quantized ones. Other
    methods read the window as received."""
    from oakenkv.methods.fakequant import FakeQuantCache

    q = _quantizer(tiny_llama, "plus")
    k, v = _kv_tokens(12)
    shift = torch.tensor(q.transforms.layers[1].key_shift).reshape(_H, _HD)[None, :, None]  # [1, H, 1, hd]
    got_k, got_v = FakeQuantCache(tiny_llama, q, residual=8).update(k, v, 1)  # 12 < 16: all in the window
    torch.testing.assert_close(got_k, k - shift, rtol=0, atol=1e-5)  # (the rotation's round trip in float32)
    assert (got_k - k).abs().max() > 0.1 and torch.equal(got_v, v)
    for which in ("post", "pre"):
        assert _quantizer(tiny_llama, which).unquantized(1, "key", k) is k


@pytest.mark.parametrize("span", [6, 3])
def test_residual_flush_reaches_a_sliding_layer_that_dropped_window_tokens(span):
    """A sliding layer spanning fewer than 2R tokens: what it still holds is quantized in place when it leaves the
    window (span 6: some of the flushed tokens; span 3: none), and the tokens it dropped before are quantized and
    counted all the same."""
    from transformers import MistralConfig, MistralForCausalLM

    from oakenkv.methods.fakequant import FakeQuantCache, stored_bits

    cfg = MistralConfig(
        vocab_size=128,
        hidden_size=96,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=6,
        num_key_value_heads=_H,
        head_dim=_HD,
        sliding_window=span,
    )
    model = MistralForCausalLM(cfg).eval()
    q = _quantizer(model, "post")
    k, v = _kv_tokens(20, seed=2)
    cache, plain = FakeQuantCache(model, q, residual=5), FakeQuantCache(model, q)
    for i in range(20):
        got_k, _ = cache.update(k[:, :, i : i + 1], v[:, :, i : i + 1], 0)
        plain_k, _ = plain.update(k[:, :, i : i + 1], v[:, :, i : i + 1], 0)
        nq, first = cache.layers[0]._fq_quantized, i + 1 - got_k.shape[-2]
        assert first == max(0, i + 1 - span)  # the layer returns its span only: tokens first..i
        m = max(nq - first, 0)
        assert torch.equal(got_k[:, :, :m], plain_k[:, :, :m])
        assert torch.equal(got_k[:, :, m:], k[:, :, max(nq, first) : i + 1])
    assert nq == 15  # 5 tokens flushed at 10 (span 6: the layer held only token 4 of them), 15 and 20 tokens seen
    # every quantized token counted as plain counts it, dropped ones too
    sub = FakeQuantCache(model, q)
    sub.update(k[:, :, :15], v[:, :, :15], 0)
    window = 2 * 5 * _H * _HD
    assert stored_bits(cache).bits == stored_bits(sub).bits + 32 * window


def test_residual_spec_is_checked_and_round_trips():
    from oakenkv.methods.registry import check_spec_with_thresholds

    for family in ("oaken", "oaken-plus"):
        assert parse_spec(family)[1]["residual"] == 0
        fam, p = parse_spec(f"{family}:residual=128")
        assert p["residual"] == 128 and canonical(fam, p) == f"{family}:residual=128"
        assert parse_spec(canonical(fam, p)) == (fam, p)
        with pytest.raises(ValueError, match="residual='-1': must be >= 0"):
            parse_spec(f"{family}:residual=-1")
        with pytest.raises(ValueError, match="not an int"):
            parse_spec(f"{family}:residual=1.5")
    assert canonical("oaken", parse_spec("oaken:only=k,residual=64")[1]) == "oaken:only=k,residual=64"

    class File:  # a thresholds file as check_spec_with_thresholds reads it
        def __init__(self, transforms=None):
            from oakenkv.format.config import OakenConfig

            self.config, self.profile, self.transforms = OakenConfig(), {}, transforms

    assert check_spec_with_thresholds("oaken:residual=128", File())["residual"] == 128
    assert check_spec_with_thresholds("oaken-plus:residual=128", File(object()))["residual"] == 128
    with pytest.raises(ValueError, match="--method sets sink"):  # the file still decides the others
        check_spec_with_thresholds("oaken-plus:residual=128,sink=2", File(object()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_residual_window_counts_32_bits_per_value_as_the_cache_holds_it(tiny_llama, dtype):
    from oakenkv.methods.fakequant import FakeQuantCache, stored_bits

    r = 8
    q = _quantizer(tiny_llama, "post")
    k, v = _kv_tokens(2 * r - 1, dtype=dtype)
    cache = FakeQuantCache(tiny_llama, q, residual=r)
    cache.update(k, v, 0)  # shorter than 2R: all in the window
    assert stored_bits(cache).bits == 32 * 2 * k.numel() and stored_bits(cache).values == 2 * k.numel()


def test_residual_bits_are_the_quantized_tokens_plus_the_window(tiny_llama):
    from oakenkv.methods.fakequant import FakeQuantCache, stored_bits

    r = 8
    q = _quantizer(tiny_llama, "post")
    k, v = _kv_tokens(30)
    cache = FakeQuantCache(tiny_llama, q, residual=r)
    cache.update(k[:, :, :20], v[:, :, :20], 0)  # 20 >= 2R: [0, 12) quantized, 8 in the window
    for i in range(20, 30):
        cache.update(k[:, :, i : i + 1], v[:, :, i : i + 1], 0)  # at 28 (window 16): [12, 20) quantized
    plain = FakeQuantCache(tiny_llama, q)
    plain.update(k[:, :, :20], v[:, :, :20], 0)
    got, quantized = stored_bits(cache), stored_bits(plain)
    window = 2 * 10 * _H * _HD  # tokens 20..29, keys and values
    assert got.values == 2 * k.numel() and got.bits == quantized.bits + 32 * window
    assert 4 < quantized.bits / quantized.values < 6  # (the quantized ones at Oaken's rate, not 32)


def test_residual_methods_build_their_window(tiny_llama):
    """``oaken:residual=R`` and ``oaken-plus:residual=R`` (with thresholds files) make caches with the window and
    record it in their names; perplexity runs through them and counts the window at float32."""
    from oakenkv.eval.ppl import perplexity

    plain_th, plus_th = _tiny_thresholds(tiny_llama), _tiny_thresholds(tiny_llama, sink=2)
    m = build_method("oaken:residual=16", tiny_llama, None, thresholds=plain_th)
    assert m.params["residual"] == 16 and m.name == "oaken[thresholds]:residual=16"
    assert m.make_cache().residual == 16
    assert build_method("oaken", tiny_llama, None, thresholds=plain_th).make_cache().residual == 0
    p = build_method("oaken-plus:residual=16", tiny_llama, None, thresholds=plus_th)
    assert p.params["residual"] == 16 and p.name == "oaken-plus[thresholds]:residual=16"
    assert p.make_cache().residual == 16
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(0))
    r0 = perplexity(tiny_llama, ids, build_method("oaken", tiny_llama, None, thresholds=plain_th))
    r16 = perplexity(tiny_llama, ids, m)  # 23 tokens < 32: all at full precision
    fp = perplexity(tiny_llama, ids, build_method("fp", tiny_llama, None))
    assert r16.nll == fp.nll and r0.nll != fp.nll
    assert r16.effective_bits == 32.0 and r16.extra["params"]["residual"] == 16


def test_frontier_pairs_every_peer_with_the_best_preset_at_no_more_bits(tmp_path):
    """The frontier table (eval report): for each peer's point, oakenkv's best run at no more bits, paired over the
    windows; the authors' harness (oaken-official), ablations and relabelled earlier profiles are neither side."""
    from oakenkv.eval.report import frontier, frontier_table

    def ppl(method, family, bits, nll, **extra):
        return {
            "kind": "ppl", "method": method, "ppl": math.exp(sum(nll) / (3 * 100)), "effective_bits": bits,
            "tokens": 300, "windows": 3, "model": "default", "window": 101, "stride": 101, "window_nll": nll,
            "extra": {"family": family, **extra},
        }  # fmt: skip

    base = [230.0, 231.0, 232.0]
    rows = [
        ppl("fp", "fp", 16, base),
        ppl("kivi2", "kivi", 3.9, [b + 20 for b in base]),
        ppl("kvquant3", "kvquant", 3.6, [b + 30 for b in base]),
        ppl("int8", "int", 8.5, [b + 0.5 for b in base]),
        ppl("oaken-plus-3", "oaken-plus", 3.9, [b + 10 for b in base]),
        ppl("oaken-plus", "oaken-plus", 5.4, [b + 3 for b in base]),
        ppl("oaken-official", "oaken-official", 3.0, [b + 1 for b in base]),  # neither side: never "ours"
        ppl("oaken:only=k", "oaken", 2.0, [b + 0.1 for b in base], params={"only": "k"}),  # an ablation
        # an earlier session's profile, relabelled: history, never the frontier's point
        ppl("oaken-plus (session 12)", "oaken-plus", 3.0, [b + 0.2 for b in base], relabelled="session 13: ..."),
    ]
    got = {e["peer"]["method"]: e for e in frontier(rows)}
    assert list(got) == ["kvquant3", "kivi2", "int8"]  # by bits
    assert got["kvquant3"]["ours"] is None and not got["kvquant3"]["holds"]  # nothing of ours at <= 3.6 bits
    assert got["kivi2"]["ours"]["method"] == "oaken-plus-3" and got["kivi2"]["holds"]
    assert got["int8"]["ours"]["method"] == "oaken-plus" and not got["int8"]["holds"]
    lo, hi = got["kivi2"]["ci"][1:]
    assert lo <= got["kivi2"]["delta"] <= hi < 0
    text = frontier_table(rows)
    assert "| kvquant3 | 3.60 |" in text and "none that small" in text
    assert "Numerics differ" not in text
    rows[1]["extra"]["numerics"] = {"torch_cpu_capability": "AVX512"}  # a pair's peer of other kernels: said
    assert "Numerics differ between these rows (not recorded: " in frontier_table(rows)
    del rows[1]["extra"]["numerics"]
    assert "| kivi2 | 3.90 |" in text and "| oaken-plus-3 | 3.90 |" in text and "| yes |" in text
    # the report leads with it: after the header's introduction, before its first section
    for i, r in enumerate(rows):
        (tmp_path / f"{i}.json").write_text(json.dumps(r))
    header = tmp_path / "h.md"
    header.write_text("# Title\n\nIntro.\n\n## Findings\n\nOld.\n")
    png = tmp_path / "out" / "p.png"
    report = write_report([tmp_path], tmp_path / "out" / "r.md", png, header, frontier=[tmp_path])
    assert report.index("Intro.") < report.index("## The accuracy frontier") < report.index("## Findings")
    assert f"`{tmp_path / '1.json'}`" in report  # each point's JSON file
    assert (tmp_path / "out" / "p_frontier.png").stat().st_size > 1000
    # results with no peer point: the section says so and links no plot it does not draw
    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / "fp.json").write_text(json.dumps(rows[0]))
    report = write_report([lone], tmp_path / "lone.md", tmp_path / "lone.png", frontier=[lone])
    assert "No frontier" in report and "lone_frontier.png" not in report
    assert not (tmp_path / "lone_frontier.png").exists()


def test_scoring_a_method_on_its_own_calibration_text_warns(tmp_path):
    """Only calibrating on wikitext2 warned; `--dataset wikipedia` (the default calibration text) or a --text-file
    that is the --calib-path scored a method on the very tokens it was calibrated on, silently."""
    from oakenkv.calibrate.spec import CalibrationSpec
    from oakenkv.eval.ppl import _warn_if_calibrated_on

    mine = tmp_path / "mine.txt"
    mine.write_text("text " * 100)
    own = CalibrationSpec("file", 2, 64, str(mine))
    warned = [
        ("oaken", None, None, "wikipedia", None),
        ("oaken-plus", None, None, "wikipedia", None),
        ("kvquant4", None, None, "wikipedia", None),
        ("oaken", None, CalibrationSpec("wikipedia-heldout"), "wikipedia-heldout", None),
        ("oaken-plus-3", None, own, "wikitext2", mine),
    ]
    quiet = [
        ("oaken", None, None, "wikitext2", None),
        ("oaken", None, None, "wikipedia-heldout", None),
        ("fp", None, None, "wikipedia", None),
        ("kivi4", None, None, "wikipedia", None),  # calibrates nothing
        ("oaken", "thr.json", None, "wikipedia", None),  # a profile file: its calibration is not known here
        ("oaken", None, own, "wikitext2", tmp_path / "other.txt"),
    ]
    for case in warned:
        with pytest.warns(UserWarning, match="calibrated on the text it is scored on"):
            _warn_if_calibrated_on(*case)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for case in quiet:
            _warn_if_calibrated_on(*case)


def test_a_result_named_twice_is_one_result(tmp_path):
    from oakenkv.eval.report import load_results

    r = {"kind": "ppl", "method": "fp", "ppl": 10.0, "effective_bits": 16, "tokens": 100, "windows": 1,
         "model": "default", "window": 101, "stride": 101}  # fmt: skip
    (tmp_path / "fp.json").write_text(json.dumps(r))
    twice = [tmp_path, tmp_path / "fp.json", tmp_path / "." / "fp.json"]
    assert len(load_results(twice)) == 1  # (the report's table had the row twice)


def test_a_text_file_result_gets_its_own_table_and_title(tmp_path):
    def ppl(method, p, dataset):
        extra = {"family": method, "text_file": {"path": "/tmp/code.txt"}} if dataset == "file" else {}
        return {
            "kind": "ppl", "method": method, "ppl": p, "effective_bits": 16 if method == "fp" else 5.0,
            "tokens": 100, "windows": 1, "model": "default", "window": 101, "stride": 101, "dataset": dataset,
            "extra": extra,
        }  # fmt: skip

    for i, r in enumerate([ppl("fp", 10.0, "wikitext2"), ppl("fp", 7.0, "file"), ppl("int4", 7.5, "file")]):
        (tmp_path / f"{i}.json").write_text(json.dumps(r))
    text = write_report([tmp_path], tmp_path / "r.md", tmp_path / "r.png")
    assert "### WikiText-2 perplexity" in text and "### text file code.txt perplexity" in text
    assert text.index("### WikiText-2") < text.index("### text file")


def test_static_grid_spec_and_files(tiny_llama):
    """``oaken-plus:...,static=1`` sets OakenConfig.static_grids; a thresholds file decides it (a spec that
    contradicts the file is refused); perplexity through a static profile runs the real codec and counts its
    stored bits: 64 fewer per row than the per-row profile's, with the same dense and sparse bytes."""
    import dataclasses

    from oakenkv.eval.ppl import perplexity
    from oakenkv.methods.registry import check_spec_with_thresholds

    fam, p = parse_spec("oaken-plus:static=1")
    assert (
        p["static"] == 1 and canonical(fam, p) == "oaken-plus:static=1" and parse_spec("oaken-plus")[1]["static"] == 0
    )
    with pytest.raises(ValueError, match="must be >= 0 and <= 1"):
        parse_spec("oaken-plus:static=2")
    per_row = _tiny_thresholds(tiny_llama, sink=0)
    static = dataclasses.replace(per_row, config=per_row.config.replace(static_grids=True))
    assert check_spec_with_thresholds("oaken-plus", static)["static"] == 1
    assert check_spec_with_thresholds("oaken-plus:static=1", static)["static"] == 1
    with pytest.raises(ValueError, match="profiled with static=0"):
        check_spec_with_thresholds("oaken-plus:static=1", per_row)
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(0))
    m_row = build_method("oaken-plus", tiny_llama, None, thresholds=per_row)
    m_static = build_method("oaken-plus", tiny_llama, None, thresholds=static)
    assert m_static.make_cache().quantizer.config.static_grids
    r_row, r_static = perplexity(tiny_llama, ids, m_row), perplexity(tiny_llama, ids, m_static)
    assert r_row.nll != r_static.nll and r_static.effective_bits < r_row.effective_bits
    # the same groups (the thresholds decide them), so the same dense and COO bytes: 64 scale bits per row fewer
    x = torch.randn(2, _H, 9, _HD, generator=torch.Generator().manual_seed(1))
    q_row, q_static = m_row.make_cache().quantizer, m_static.make_cache().quantizer
    for kind in ("key", "value"):
        (y_row, b_row), (y_static, b_static) = q_row.quantize(1, kind, x), q_static.quantize(1, kind, x)
        assert b_row - b_static == 2 * 9 * 64 and not torch.equal(y_row, y_static)


def test_static_levels_spec_and_files(tiny_llama):
    """``oaken-plus:...,static=1,levels=1`` sets OakenConfig.static_levels (the default levels); refused without
    static=1; a thresholds file decides it; perplexity through it runs the real codec and counts the level byte:
    8 bits per row more than one static grid, the same groups and so the same dense and COO bytes."""
    import dataclasses

    from oakenkv.eval.ppl import perplexity
    from oakenkv.format.config import DEFAULT_STATIC_LEVELS
    from oakenkv.methods.registry import check_spec_with_thresholds

    fam, p = parse_spec("oaken-plus:static=1,levels=1")
    assert p["levels"] == 1 and canonical(fam, p) == "oaken-plus:static=1,levels=1"
    assert "levels" not in canonical(*parse_spec("oaken-plus:static=1"))  # existing names unchanged
    with pytest.raises(ValueError, match=r"levels=1 .* needs static=1"):
        parse_spec("oaken-plus:levels=1")
    per_row = _tiny_thresholds(tiny_llama, sink=0)
    one = dataclasses.replace(per_row, config=per_row.config.replace(static_grids=True))
    levels = dataclasses.replace(one, config=one.config.replace(static_levels=DEFAULT_STATIC_LEVELS))
    assert check_spec_with_thresholds("oaken-plus", levels)["levels"] == 1
    with pytest.raises(ValueError, match="profiled with levels=0"):
        check_spec_with_thresholds("oaken-plus:static=1,levels=1", one)
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(0))
    m_one = build_method("oaken-plus", tiny_llama, None, thresholds=one)
    m_lv = build_method("oaken-plus", tiny_llama, None, thresholds=levels)
    assert m_lv.make_cache().quantizer.config.static_levels == DEFAULT_STATIC_LEVELS
    r_one, r_lv = perplexity(tiny_llama, ids, m_one), perplexity(tiny_llama, ids, m_lv)
    assert r_one.nll != r_lv.nll and r_lv.effective_bits > r_one.effective_bits
    x = torch.randn(2, _H, 9, _HD, generator=torch.Generator().manual_seed(1))
    q_one, q_lv = m_one.make_cache().quantizer, m_lv.make_cache().quantizer
    for kind in ("key", "value"):
        (y_one, b_one), (y_lv, b_lv) = q_one.quantize(1, kind, x), q_lv.quantize(1, kind, x)
        assert b_lv - b_one == 2 * 9 * 8 and y_lv.shape == y_one.shape


def test_alloc_and_aware_specs_and_files(tiny_llama):
    """``oaken-plus:alloc=1`` (the sparse share allocated over layers) and ``static=1,aware=1`` (the search scored
    with static grids) name searches of their own: default names unchanged, aware refused without static, and a
    thresholds file's search decides both (a spec that contradicts it is refused)."""
    import dataclasses

    from oakenkv.calibrate.transforms import Transforms
    from oakenkv.methods.registry import check_spec_with_thresholds

    fam, p = parse_spec("oaken-plus:alloc=1")
    assert p["alloc"] == 1 and canonical(fam, p) == "oaken-plus:alloc=1"
    fam, p = parse_spec("oaken-plus:static=1,aware=1")
    assert p["aware"] == 1 and canonical(fam, p) == "oaken-plus:static=1,aware=1"
    assert canonical(*parse_spec("oaken-plus:static=1")) == "oaken-plus:static=1"  # existing names unchanged
    with pytest.raises(ValueError, match=r"aware=1 .* needs static=1"):
        parse_spec("oaken-plus:aware=1")
    th = _tiny_thresholds(tiny_llama, sink=0)
    plain = {"ratios": [[0.04, 0.06]], "key_rotation": True, "value_rotation": False}

    def with_search(search):
        t = th.transforms
        return dataclasses.replace(th, transforms=Transforms(t.layers, t.num_kv_heads, t.head_dim, {"search": search}))

    got = check_spec_with_thresholds("oaken-plus", with_search(plain))
    assert got["alloc"] == 0 and got["aware"] == 0
    with pytest.raises(ValueError, match="profiled with alloc=0"):
        check_spec_with_thresholds("oaken-plus:alloc=1", with_search(plain))
    alloc = with_search(plain | {"budget_scales": [0.5, 1.0, 1.5, 2.0]})
    assert check_spec_with_thresholds("oaken-plus", alloc)["alloc"] == 1
    aware = with_search(plain | {"static_grids": True, "static_levels": []})
    assert check_spec_with_thresholds("oaken-plus", aware)["aware"] == 1


def test_a_method_whose_residual_window_covers_the_windows_says_nothing_was_quantized():
    """KIVI keeps its newest 128 tokens at 16 bits: on windows of 64 it quantizes nothing, and its perplexity is full
    precision's. That is said (``NothingQuantizedWarning``), not printed as KIVI's result silently."""
    import warnings

    from oakenkv.eval.ppl import NothingQuantizedWarning, run_ppl

    with pytest.warns(NothingQuantizedWarning, match=r"kivi4: no key or value was quantized .*kivi's is 128 tokens"):
        res = run_ppl("default", "kivi4", window=64, max_windows=1)
    assert res.effective_bits >= 16
    with warnings.catch_warnings():
        warnings.simplefilter("error", NothingQuantizedWarning)
        short = run_ppl("default", "kivi:bits=4,residual=32", window=64, max_windows=1)
    assert short.effective_bits < 16 and short.ppl != res.ppl
    # quanto's cache hands its first update back unquantized: one forward per window is FP at 4.5 stored bits
    with pytest.warns(NothingQuantizedWarning, match=r"quanto4: .* this is FP's perplexity while 4\.50 bits"):
        one = run_ppl("default", "quanto4", window=64, max_windows=1)
    assert one.ppl == run_ppl("default", "fp", window=64, max_windows=1).ppl
    with warnings.catch_warnings():
        warnings.simplefilter("error", NothingQuantizedWarning)
        assert run_ppl("default", "quanto4", window=64, max_windows=1, chunk=16).ppl != one.ppl
