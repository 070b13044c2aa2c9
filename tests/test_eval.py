"""The evaluation harness: fake-quant cache, pre-RoPE round trip, methods, perplexity, zero-shot, report, CLI."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from oakenkv.baselines.base import KVFakeQuantizer
from oakenkv.eval.methods import FAMILIES, Method, build_method, canonical, parse_spec, sweep_config
from oakenkv.eval.report import label_offsets, pareto_front, write_report


class _Identity(KVFakeQuantizer):
    """Stores keys/values unchanged (counts 16 bits), optionally pre-RoPE: isolates the cache plumbing."""

    def __init__(self, key_position="post_rope"):
        self.key_position = key_position
        self.seen = []

    def quantize(self, layer_idx, kind, x):
        self.seen.append((layer_idx, kind, tuple(x.shape)))
        return x, 16.0 * x.numel()


def _ids(tok, n=64):
    from oakenkv.data import load_text, token_windows

    return token_windows(tok, load_text("wikitext2"), n, max_windows=1)


def _fq_method(model, quantizer):
    from oakenkv.eval.cache import FakeQuantCache

    return Method("test", "test", {}, lambda: FakeQuantCache(model, quantizer), quantizer.key_position)


# ---------------------------------------------------------------------------------------------- specs


def test_parse_spec_aliases_defaults_and_errors():
    assert parse_spec("int4") == ("int", {"bits": 4, "group": 0})
    assert parse_spec("kivi4")[1] == {"bits": 4, "group": 32, "residual": 128}
    fam, p = parse_spec("oaken:outer=0.06,inner=0.09")
    assert fam == "oaken" and p["outer"] == 0.06 and p["inner"] == 0.09
    assert canonical(fam, p) == "oaken:outer=0.06,inner=0.09"
    assert canonical("oaken", dict(FAMILIES["oaken"])) == "oaken"
    with pytest.raises(ValueError, match="unknown method"):
        parse_spec("nope")
    with pytest.raises(ValueError, match="bad parameter"):
        parse_spec("int:width=4")
    with pytest.raises(ValueError, match="not a int"):
        parse_spec("int:bits=four")


def test_sweep_config_keeps_paper_split():
    c = sweep_config(0.10)
    assert c.outer_ratio == pytest.approx(0.04) and c.inner_ratio == pytest.approx(0.06)
    assert sweep_config(0.2).outlier_ratio == pytest.approx(0.2)


# ---------------------------------------------------------------------------------------------- RoPE and cache


def test_rope_round_trip_and_matches_transformers(default_model):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from oakenkv.rope import RopeTable, apply_rope, invert_rope

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
    whole = perplexity(m, ids, meth)
    chunked = perplexity(m, ids, meth, chunk=16)
    fp = perplexity(m, ids, build_method("fp", m, tok))
    assert chunked.ppl == pytest.approx(whole.ppl, rel=1e-4)
    assert whole.effective_bits == pytest.approx(4.5)
    assert whole.ppl != fp.ppl


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
    from oakenkv.eval.methods import OakenQuantizer
    from oakenkv.eval.ppl import perplexity

    class Fixed:
        def layer(self, i, kind):
            return (-1.0, -0.05, 0.05, 1.0)

    from oakenkv.config import OakenConfig

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
    from oakenkv.data import load_text, token_windows
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
    from oakenkv.codec import effective_bits, encode
    from oakenkv.config import OakenConfig
    from oakenkv.eval.methods import OakenQuantizer

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
    from oakenkv.config import OakenConfig
    from oakenkv.eval.methods import OakenQuantizer
    from oakenkv.quant import quantize_dequantize

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
    from oakenkv.config import OakenConfig
    from oakenkv.eval.methods import OakenQuantizer

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
    """calibrate_all profiles several configurations in one pass; each must equal oakenkv.profile's own result."""
    import warnings

    from oakenkv.config import OakenConfig
    from oakenkv.eval import calibration as cal
    from oakenkv.profile import profile_thresholds

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
