"""How good is a threshold profile on held-out text? Group fractions and reconstruction SQNR per layer.

Thresholds are profiled on the calibration text (``oakenkv.assets.data.load_text("wikipedia")``) and measured here on
WikiText-2 (the evaluation text, never seen by the profiler):

- the fraction of values in each group (``oakenkv.quant.quantizer.assign_groups``), per layer and kind, against the
  configured ratios (4 / 90 / 6 by default);
- the reconstruction SQNR ``10 log10(sum x^2 / sum (x - x_hat)^2)`` in dB of
``oakenkv.quant.quantizer.quantize_dequantize``
  (one quantization vector per token and layer: all KV heads together, ``granularity="token"``), per layer and
  kind, next to a per-token 4-bit asymmetric min/max quantizer of the same rows (the QServe/Atom-style baseline,
  without any outlier handling) so the number has a scale.

Usage::

    python benchmarks/bench_profile_quality.py --thresholds thresholds.json --windows 8 --window 512 \
        --out results/profile_quality.json

Without ``--thresholds`` it profiles first (``--samples`` windows of ``--profile-window`` tokens).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch


def sqnr_db(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB over all elements (float64 sums)."""
    x64, e64 = x.double(), (x.double() - x_hat.double())
    noise = float((e64 * e64).sum())
    signal = float((x64 * x64).sum())
    return math.inf if noise == 0 else 10.0 * math.log10(signal / noise)


def int4_per_token(rows: torch.Tensor) -> torch.Tensor:
    """Per-row asymmetric 4-bit min/max fake quantization of ``rows`` float32 ``[N, D]`` (baseline)."""
    lo = rows.amin(dim=1, keepdim=True)
    hi = rows.amax(dim=1, keepdim=True)
    step = ((hi - lo) / 15).clamp_min(1e-12)
    return lo + torch.round((rows - lo) / step).clamp(0, 15) * step


def to_rows(x: torch.Tensor, granularity: str) -> torch.Tensor:
    """``[B, H, S, D]`` -> one row per quantization vector: ``[B*S, H*D]`` (token) or ``[B*S*H, D]`` (head)."""
    b, h, s, d = x.shape
    tok = x.permute(0, 2, 1, 3).reshape(b * s, h * d)  # [B*S, H*D]: token-major, heads concatenated
    return tok if granularity == "token" else tok.reshape(-1, d)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default", help="model name for oakenkv.assets.models.load_model")
    ap.add_argument("--thresholds", type=Path, help="thresholds file from `oakenkv profile` (else profile now)")
    ap.add_argument("--samples", type=int, default=100, help="profiling windows when profiling here")
    ap.add_argument("--profile-window", type=int, default=256, help="tokens per profiling window")
    ap.add_argument("--windows", type=int, default=8, help="held-out WikiText-2 windows")
    ap.add_argument("--window", type=int, default=512, help="tokens per held-out window")
    ap.add_argument("--out", type=Path, default=Path("results/profile_quality.json"), help="JSON output")
    args = ap.parse_args(argv)

    from oakenkv.assets.data import load_text, token_windows
    from oakenkv.assets.models import load_model
    from oakenkv.calibrate.profile import profile_model, record_kv
    from oakenkv.calibrate.thresholds import ModelFingerprint, Thresholds
    from oakenkv.quant.quantizer import GROUP_INNER, GROUP_MIDDLE, GROUP_OUTER, assign_groups, quantize_dequantize

    loaded = load_model(args.model)
    fp = ModelFingerprint.from_model_config(loaded.model.config, name=args.model)
    if args.thresholds is not None:
        th = Thresholds.load(args.thresholds, expect=fp)
    else:
        th = profile_model(args.model, samples=args.samples, window=args.profile_window, progress=True)
    cfg = th.config
    if th.config.key_position != "post_rope":
        print("note: thresholds are pre-RoPE; measuring on pre-RoPE keys", file=sys.stderr)

    ids = token_windows(loaded.tokenizer, load_text("wikitext2"), args.window, max_windows=args.windows)
    t0 = time.perf_counter()
    keys, values = record_kv(loaded.model, ids, cfg.key_position)
    # The reference quantizer is many small element-wise ops: one thread does them with ~10x less CPU time than
    # two on a shared 2-core machine (the second thread's spin-waits), and the result is identical.
    torch.set_num_threads(1)
    layers = []
    for i in range(th.num_layers):
        entry: dict = {"layer": i}
        for kind, x in (("key", keys[i]), ("value", values[i])):
            thr = th.layer(i, kind)
            g = assign_groups(x, thr)
            rows = to_rows(x.float(), cfg.granularity)
            entry[kind] = {
                "outer": (g == GROUP_OUTER).float().mean().item(),
                "middle": (g == GROUP_MIDDLE).float().mean().item(),
                "inner": (g == GROUP_INNER).float().mean().item(),
                "sqnr_db": sqnr_db(rows, quantize_dequantize(rows, thr, cfg)),
                "int4_per_token_sqnr_db": sqnr_db(rows, int4_per_token(rows)),
                "kurtosis_profiled": None if th.stats(i, kind) is None else th.stats(i, kind).kurtosis,
            }
        layers.append(entry)
    elapsed = time.perf_counter() - t0

    def mean(kind: str, field: str) -> float:
        return sum(e[kind][field] for e in layers) / len(layers)

    def extreme(kind: str, field: str, fn) -> float:
        return fn(e[kind][field] for e in layers)

    summary = {
        kind: {
            **{f"mean_{f}": mean(kind, f) for f in ("outer", "middle", "inner", "sqnr_db", "int4_per_token_sqnr_db")},
            "min_sqnr_db": extreme(kind, "sqnr_db", min),
            "max_sqnr_db": extreme(kind, "sqnr_db", max),
            "outer_range": [extreme(kind, "outer", min), extreme(kind, "outer", max)],
            "inner_range": [extreme(kind, "inner", min), extreme(kind, "inner", max)],
        }
        for kind in ("key", "value")
    }
    result = {
        "model": args.model,
        "fingerprint": fp.to_dict(),
        "thresholds_file": None if args.thresholds is None else str(args.thresholds),
        "profile": th.profile,
        "config": cfg.to_dict(),
        "held_out": {"text": "wikitext2", "windows": int(ids.shape[0]), "window": int(ids.shape[1])},
        "target": {"outer": cfg.outer_ratio, "middle": cfg.middle_ratio, "inner": cfg.inner_ratio},
        "summary": summary,
        "layers": layers,
        "measure_seconds": round(elapsed, 2),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")

    print(f"held-out WikiText-2: {ids.shape[0]} x {ids.shape[1]} tokens; thresholds: {th.profile.get('runs')} runs")
    head = " | ".join(f"{k + ' out':>6} {k + ' in':>6} {k + ' dB':>6} {'int4':>6}" for k in ("K", "V"))
    print(f"layer | {head}")

    def cells(d: dict) -> str:
        return f"{d['outer']:6.2%} {d['inner']:6.2%} {d['sqnr_db']:6.2f} {d['int4_per_token_sqnr_db']:6.2f}"

    for e in layers:
        print(f"{e['layer']:>5} | {cells(e['key'])} | {cells(e['value'])}")
    for kind in ("key", "value"):
        s = summary[kind]
        print(
            f"{kind:>5}: outer {s['mean_outer']:.2%} (target {cfg.outer_ratio:.0%}), middle {s['mean_middle']:.2%}, "
            f"inner {s['mean_inner']:.2%} (target {cfg.inner_ratio:.0%}); SQNR mean {s['mean_sqnr_db']:.2f} dB "
            f"(min {s['min_sqnr_db']:.2f}, max {s['max_sqnr_db']:.2f}) vs per-token INT4 "
            f"{s['mean_int4_per_token_sqnr_db']:.2f} dB"
        )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
