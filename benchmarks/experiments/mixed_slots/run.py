"""Issue #36's experiment: one profile with two dense slot widths, chosen per layer and kind (a simulation).

Can a 3-bit ``oaken-plus`` profile that spends its remaining bits on a 4-bit slot in some layers and kinds reach
KVQuant-style 4's loss at <= 4.0 bits? The format, the store and the kernels take one slot width per cache; this
script changes it per (layer, kind) in the evaluation's fake-quantizing cache only (``PlusQuantizer`` with the
config swapped per call: the same numba codec, bits counted from its bytes). Nothing here is a preset.

    # the sensitivity of each (layer, kind) to a wider slot, on calibration windows (never the evaluation text):
    # KL divergence of the next-token distribution to FP's, NLL and bits, with only that one widened
    python benchmarks/experiments/mixed_slots/run.py sensitivity --json benchmarks/results/mixed_slots/sensitivity.json
    # perplexity on WikiText-2 (first 20 windows of 2048) with a set widened: the N most sensitive (top:N), the N
    # most sensitive keys (top-keys:N), every key (keys), every value (values) or none (the profile as it is)
    python benchmarks/experiments/mixed_slots/run.py ppl --widen top:17 \
        --sensitivity benchmarks/results/mixed_slots/sensitivity.json \
        --json benchmarks/results/mixed_slots/ppl-top17.json

One thread per process (``--part I --parts N`` splits the sensitivity runs over processes; ``merge`` joins them).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from oakenkv.bench.results import meta, start  # the command, commit, machine and load of every result file

SPEC = "oaken-plus:bits=3,sparse=0.05,rot_k=1,rot_v=1,static=1,levels=1,alloc=1"


def mixed_quantizer(base, widened, slot):
    """``base`` (a ``PlusQuantizer``) with a ``slot``-bit dense slot (codes of the inner and outer groups one bit
    more) in the (layer, kind) pairs of ``widened``; the profile's thresholds, transforms and ratios unchanged."""
    from oakenkv.methods.oaken import PlusQuantizer

    class Mixed(PlusQuantizer):
        def quantize(self, layer_idx, kind, x):
            self.config = wide if (layer_idx, kind) in pairs else narrow
            return super().quantize(layer_idx, kind, x)

    q = Mixed.__new__(Mixed)
    q.__dict__.update(base.__dict__)
    narrow = base.config
    wide = narrow.replace(middle_bits=slot, inner_bits=slot + 1, outer_bits=slot + 1)
    pairs = {(int(i), str(k)) for i, k in widened}
    return q


def build(spec, model):
    from oakenkv.assets.models import load_model
    from oakenkv.methods.registry import build_method

    lm = load_model(model)
    return lm, build_method(spec, lm.model, lm.tokenizer, model)


def sensitivity(a):
    import torch

    from oakenkv.calibrate.presets import OAKEN_PLUS
    from oakenkv.calibrate.spec import calibration_windows
    from oakenkv.methods.fakequant import FakeQuantCache, stored_bits
    from oakenkv.util.compat import cache_kwargs

    lm, m = build(a.spec, a.model)
    base = m.make_cache().quantizer
    wins = calibration_windows(lm.tokenizer, OAKEN_PLUS.calibration)[: a.windows]

    def logprobs(model, ids, cache):
        with torch.no_grad():
            kw = cache_kwargs(model, cache) if cache is not None else {}
            out = model(input_ids=ids[None], use_cache=cache is not None, **kw)
        return torch.log_softmax(out.logits[0].float(), -1)

    refs = [logprobs(lm.model, w, None) for w in wins]
    n = lm.model.config.num_hidden_layers
    sets = [[]] + [[(i, k)] for i in range(n) for k in ("key", "value")]
    rows = []
    for widened in sets[a.part :: a.parts]:
        t = time.time()
        q = mixed_quantizer(base, widened, a.slot)
        kl = nll = bits = values = 0.0
        for ids, ref in zip(wins, refs, strict=True):
            cache = FakeQuantCache(m.model, q)
            lp = logprobs(m.model, ids, cache)
            kl += float((ref.exp() * (ref - lp)).sum())
            nll += float(torch.nn.functional.nll_loss(lp[:-1], ids[1:], reduction="sum"))
            counted = stored_bits(cache)
            bits, values = bits + counted.bits, values + counted.values
        rows.append({"widened": [list(p) for p in widened], "kl": kl, "nll": nll, "bits": bits / values,
                     "seconds": time.time() - t})  # fmt: skip
        print(rows[-1], flush=True)
        out = {"meta": meta(), "model": a.model, "spec": a.spec, "slot": a.slot,
               "windows": f"calibration ({OAKEN_PLUS.calibration.tag()}), first {a.windows}", "runs": rows}  # fmt: skip
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(out, indent=1))


def merge(a):
    parts = [json.loads(Path(p).read_text()) for p in a.parts_files]
    out = {**parts[0], "runs": [r for p in parts for r in p["runs"]]}
    out["meta"] = {"command": "merge of", "parts": [p["meta"] for p in parts]}
    a.json.write_text(json.dumps(out, indent=1))


def chosen(widen, sens_path, layers):
    if widen == "none":
        return []
    if widen == "keys":
        return [(i, "key") for i in range(layers)]
    if widen == "values":
        return [(i, "value") for i in range(layers)]
    how, _, count = widen.partition(":")
    if how not in ("top", "top-keys") or not count.isdigit():
        raise SystemExit(f"--widen: none, keys, values, top:N or top-keys:N, got {widen!r}")
    if sens_path is None:
        raise SystemExit(f"--widen {widen} ranks by a sensitivity file: give --sensitivity (from the sensitivity step)")
    runs = json.loads(Path(sens_path).read_text())["runs"]
    ranked = sorted((r for r in runs if r["widened"]), key=lambda r: r["kl"])  # lowest KL after widening first
    if how == "top-keys":
        ranked = [r for r in ranked if r["widened"][0][1] == "key"]
    return [tuple(r["widened"][0]) for r in ranked[: int(count)]]


def ppl(a):
    from oakenkv.assets.data import load_text, token_windows
    from oakenkv.eval.ppl import perplexity
    from oakenkv.methods.fakequant import FakeQuantCache

    lm, m = build(a.spec, a.model)
    widened = chosen(a.widen, a.sensitivity, lm.model.config.num_hidden_layers)
    q = mixed_quantizer(m.make_cache().quantizer, widened, a.slot)
    mixed = dataclasses.replace(m, make_cache=lambda: FakeQuantCache(m.model, q), name=f"{m.name}+{a.widen}@{a.slot}")
    ids = token_windows(lm.tokenizer, load_text("wikitext2"), 2048, None, a.windows)
    res = perplexity(lm.model, ids, mixed, model_name=a.model)
    out = {"meta": meta(), "model": a.model, "spec": a.spec, "slot": a.slot,
           "widen": a.widen,
           "widened": [list(p) for p in widened], "ppl": res.ppl, "effective_bits": res.effective_bits,
           "tokens": res.tokens, "windows": res.windows, "window_nll": res.window_nll}  # fmt: skip
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(out, indent=1))
    print(f"{mixed.name}: ppl {res.ppl:.4f} at {res.effective_bits:.3f} bits ({len(widened)} widened)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sensitivity")
    s.add_argument("--windows", type=int, default=2)
    s.add_argument("--part", type=int, default=0)
    s.add_argument("--parts", type=int, default=1)
    p = sub.add_parser("ppl")
    p.add_argument("--widen", required=True)
    p.add_argument("--sensitivity", type=Path)
    p.add_argument("--windows", type=int, default=20)
    for x in (s, p):
        x.add_argument("--model", default="default", help="an oakenkv model name (default: the embedded SmolLM2)")
        x.add_argument("--spec", default=SPEC)
        x.add_argument("--slot", type=int, default=4, help="the dense slot width of the widened pairs")
        x.add_argument("--json", type=Path, required=True)
    g = sub.add_parser("merge")
    g.add_argument("parts_files", nargs="+")
    g.add_argument("--json", type=Path, required=True)
    a = ap.parse_args()
    import torch

    start()
    torch.set_num_threads(1)
    {"sensitivity": sensitivity, "ppl": ppl, "merge": merge}[a.cmd](a)


if __name__ == "__main__":
    main()
