"""Benchmarks of the hardware engines (issue 8): perplexity cost of hardware arithmetic, reconstruction error,
RTL simulation against the Python models, and Yosys cell counts.

    .venv/bin/python benchmarks/bench_hw.py ppl --windows 8 --window 512 --json results/hw_ppl.json
    .venv/bin/python benchmarks/bench_hw.py rtl --vectors 2000 --json results/hw_rtl.json

``ppl`` runs the default model over WikiText-2 windows through ``FakeQuantCache`` three ways: the float reference
quantizer (``oakenkv.quant.quantizer``), hardware quantization + float dequantization, and both engines' arithmetic
(``oakenkv.hw.arith``); it also reports the reconstruction error of each on the real keys/values of one window.
``rtl`` simulates the Amaranth engines on random and real K/V rows against the Python models and synthesises
them with Yosys (see ``oakenkv.hw.report``).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch


def run_ppl(windows: int, window: int) -> dict:
    from tqdm import tqdm

    from oakenkv.assets.data import load_text, token_windows
    from oakenkv.assets.models import load_model
    from oakenkv.calibrate.ranges import oaken_thresholds
    from oakenkv.eval.ppl import window_nll
    from oakenkv.format.config import OakenConfig
    from oakenkv.hw.fakequant import HwOakenQuantizer
    from oakenkv.methods.fakequant import FakeQuantCache
    from oakenkv.methods.oaken import OakenQuantizer

    torch.set_num_threads(1)  # the machine is shared; a single thread keeps timings honest
    loaded = load_model("default")
    model, tok = loaded.model, loaded.tokenizer
    config = OakenConfig()
    thr = oaken_thresholds(model, tok, loaded.name, config, progress=True)
    ids = token_windows(tok, load_text("wikitext2"), window, max_windows=windows)
    methods = {
        "float": OakenQuantizer(thr, config),
        "hw_quant": HwOakenQuantizer(thr, config, mode="hw_quant"),
        "hw": HwOakenQuantizer(thr, config, mode="hw"),
    }
    out: dict = {"model": loaded.name, "windows": int(ids.shape[0]), "window": window, "text": "wikitext2"}
    for name, q in methods.items():
        nll, ntok, per = 0.0, 0, []
        t0 = time.perf_counter()
        for i in tqdm(range(ids.shape[0]), desc=f"ppl {name}"):
            a, b = window_nll(model, ids[i], FakeQuantCache(model, q))
            nll, ntok = nll + a, ntok + b
            per.append(a / b)
        out[name] = {
            "ppl": math.exp(nll / ntok),
            "nll": nll,
            "tokens": ntok,
            "window_nll_per_token": per,
            "seconds": time.perf_counter() - t0,
        }
    with torch.no_grad():  # fp16 baseline: the plain DynamicCache
        from transformers import DynamicCache

        nll, ntok = 0.0, 0
        for i in range(ids.shape[0]):
            a, b = window_nll(model, ids[i], DynamicCache(config=model.config))
            nll, ntok = nll + a, ntok + b
        out["fp32_cache"] = {"ppl": math.exp(nll / ntok)}
    for m in ("hw", "hw_quant"):  # paired per-window difference of mean NLL/token: mean and standard error
        d = torch.tensor(out[m]["window_nll_per_token"]) - torch.tensor(out["float"]["window_nll_per_token"])
        se = float(d.std() / math.sqrt(d.numel())) if d.numel() > 1 else float("nan")
        out[f"nll_delta_{m}_vs_float"] = {"mean": float(d.mean()), "stderr": se}
    out["ppl_delta_hw_vs_float"] = out["hw"]["ppl"] - out["float"]["ppl"]
    out["ppl_delta_hw_quant_vs_float"] = out["hw_quant"]["ppl"] - out["float"]["ppl"]
    out["recon"] = recon_error(model, ids[0], thr, config)
    return out


def recon_error(model, ids: torch.Tensor, thr, config) -> dict:
    """RMS / max reconstruction error of float, hw_quant and hw modes on one window's real keys and values."""
    from transformers import DynamicCache

    from oakenkv.hw.arith import dequantize_hw, quantize_hw
    from oakenkv.quant.quantizer import dequantize, quantize

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids[None], past_key_values=cache, use_cache=True)
    acc = {m: [0.0, 0.0, 0] for m in ("float", "hw_quant", "hw")}
    diff_max, same_codes, total = 0.0, 0, 0
    for li, layer in enumerate(cache.layers):
        for kind, x in (("key", layer.keys), ("value", layer.values)):
            b, h, s, d = x.shape
            rows = x.permute(0, 2, 1, 3).reshape(b * s, h * d).float()
            t = thr.layer(li, kind)
            qf, qh = quantize(rows, t, config), quantize_hw(rows, t, config)
            outs = {
                "float": dequantize(qf, t, config),
                "hw_quant": dequantize(qh, t, config),
                "hw": dequantize_hw(qh, t, config),
            }
            for m, y in outs.items():
                e = (y - rows).abs()
                acc[m][0] += float((e**2).sum())
                acc[m][1] = max(acc[m][1], float(e.max()))
                acc[m][2] += e.numel()
            diff_max = max(diff_max, float((outs["hw"] - outs["hw_quant"]).abs().max()))
            same_codes += int(((qf.codes == qh.codes) & (qf.groups == qh.groups)).sum())
            total += rows.numel()
    res = {m: {"rms": math.sqrt(v[0] / v[2]), "max_abs": v[1]} for m, v in acc.items()}
    res["max_abs_hw_dequant_vs_float_dequant"] = diff_max
    res["codes_equal_fraction"] = same_codes / total
    res["values"] = total
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("ppl", help="perplexity cost of the hardware arithmetic on the default model")
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--json", type=Path, default=None)
    r = sub.add_parser("rtl", help="RTL simulation against the Python models + Yosys cell counts")
    r.add_argument("--vectors", type=int, default=2000, help="rows of 64 values per engine (half random, half real)")
    r.add_argument("--no-synth", action="store_true", help="skip Yosys synthesis")
    r.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.cmd == "ppl":
        res = run_ppl(args.windows, args.window)
    else:
        from oakenkv.hw.report import hw_report

        res = hw_report(vectors=args.vectors, synth=not args.no_synth, progress=True)
    text = json.dumps(res, indent=2)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
