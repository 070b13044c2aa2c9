"""Issue #36's experiment: how much of the 3-bit middle group's error a non-uniform grid would remove (a bound).

The middle group holds ~99% of a 3-bit profile's squared error. This records one calibration window's keys and
values as the quantizer sees them (after the online key transform), and compares, on the middle group's shifted
values of every row normalised to the row's own [min, max]: the uniform 8-level grid (what per-row grids store)
against 8 Lloyd-Max levels fitted per layer and kind (one small codebook a profile could carry; the same per-row
scales). Squared errors summed over the model, per kind; the codec's own errors beside them (its grids, static
levels included, are not the plain per-row grid: compare Lloyd-Max with both).

    python benchmarks/experiments/mixed_slots/codebook.py --json benchmarks/results/mixed_slots/codebook.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import SPEC, build, meta, start


def lloyd_max(u: np.ndarray, levels: int, iterations: int = 40) -> np.ndarray:
    """``levels`` reconstruction points minimising the squared error of ``u`` (1-D k-means from a uniform start)."""
    points = np.linspace(0.0, 1.0, levels)
    for _ in range(iterations):
        nearest = np.abs(u[:, None] - points[None]).argmin(1)
        for j in range(levels):
            members = u[nearest == j]
            if members.size:
                points[j] = members.mean()
    return points


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--spec", default=SPEC)
    ap.add_argument("--window", type=int, default=2, help="which calibration window (the sensitivity used 0 and 1)")
    ap.add_argument("--json", type=Path, required=True)
    a = ap.parse_args()
    import torch

    import oakenkv.methods.oaken as oaken
    from oakenkv.calibrate.presets import OAKEN_PLUS
    from oakenkv.calibrate.spec import calibration_windows
    from oakenkv.util.compat import cache_kwargs

    torch.set_num_threads(1)
    start()
    lm, m = build(a.spec, a.model)
    seen: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = {}
    quantize = oaken.OakenQuantizer.quantize

    def recording(self, layer_idx, kind, x):  # the rows as quantized (keys after the online transform), and back
        y, bits = quantize(self, layer_idx, kind, x)
        b, h, s, d = x.shape
        rows = [t.permute(0, 2, 1, 3).reshape(b * s, h * d).double().numpy().copy() for t in (x, y)]
        seen[(layer_idx, kind)] = (rows[0], rows[1])
        return y, bits

    oaken.OakenQuantizer.quantize = recording
    cache = m.make_cache()
    profile = cache.quantizer.thresholds
    levels = 2**profile.config.middle_bits
    ids = calibration_windows(lm.tokenizer, OAKEN_PLUS.calibration)[a.window]
    with torch.no_grad():
        m.model(input_ids=ids[None], use_cache=True, **cache_kwargs(m.model, cache))
    oaken.OakenQuantizer.quantize = quantize

    sums = {
        k: dict.fromkeys(("uniform", "lloyd_max", "codec_middle", "codec_all", "signal"), 0.0) for k in ("key", "value")
    }
    layers = []
    for (i, kind), (x, y) in sorted(seen.items()):
        t = profile.layer(i, kind)
        middle = ((x >= t.to_lo) & (x < t.ti_lo)) | ((x > t.ti_hi) & (x <= t.to_hi))
        shifted = np.where(middle, np.where(x > t.ti_hi, x - t.ti_hi, x - t.ti_lo), np.nan)
        lo, hi = np.nanmin(shifted, 1, keepdims=True), np.nanmax(shifted, 1, keepdims=True)
        span = np.broadcast_to(np.maximum(hi - lo, 1e-30), x.shape)[middle]
        u = ((shifted - lo) / np.maximum(hi - lo, 1e-30))[middle]
        uniform = float((((u - np.round(u * (levels - 1)) / (levels - 1)) * span) ** 2).sum())
        points = lloyd_max(u[np.random.default_rng(0).permutation(u.size)[:200_000]], levels)
        nearest = points[np.abs(u[:, None] - points[None]).argmin(1)]
        fitted = float((((u - nearest) * span) ** 2).sum())
        err = (x - y) ** 2
        row = {"uniform": uniform, "lloyd_max": fitted, "codec_middle": float(err[middle].sum()),
               "codec_all": float(err.sum()), "signal": float((x**2).sum())}  # fmt: skip
        for k, v in row.items():
            sums[kind][k] += v
        layers.append({"layer": i, "kind": kind, **row, "levels": points.round(4).tolist()})
    for kind, s in sums.items():
        s["lloyd_max_over_uniform"] = s["lloyd_max"] / s["uniform"]
        s["lloyd_max_over_codec_middle"] = s["lloyd_max"] / s["codec_middle"]
        s["codec_middle_share"] = s["codec_middle"] / s["codec_all"]
        print(f"{kind}: Lloyd-Max / uniform {s['lloyd_max_over_uniform']:.3f} (middle group, per-row ranges), / the "
              f"codec's own middle group {s['lloyd_max_over_codec_middle']:.3f}; the codec's middle group "
              f"{s['codec_middle_share']:.1%} of its squared error")  # fmt: skip
    a.json.parent.mkdir(parents=True, exist_ok=True)
    out = {"meta": meta(), "model": a.model, "spec": a.spec, "window": a.window, "totals": sums, "layers": layers}
    a.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
