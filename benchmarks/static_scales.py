"""Issue #36: do oaken-plus's middle and inner grid end points need to be stored per token? A SIMULATION.

Oaken stores six fp16 grid end points per row (min/max of the outer, middle and inner groups; 96 bits, 0.5 bit per
value at D = 192). Values are grouped by the layer's fixed thresholds, so the shifted middle values always lie in
``[to_lo - ti_lo, 0) U (0, to_hi - ti_hi]`` and the inner ones in ``[ti_lo, ti_hi]``: if those two groups' grids
were fixed per layer (``oakenkv.quant.quantizer.static_grid``), only the outer group's two end points would stay per
row, 64 bits per row less, which at a fixed budget buys about 4% more sparse share (8 bits per outlier).

This runs ``oakenkv eval ppl``'s machinery (the oaken-plus profile and folded model of a spec, ``FakeQuantCache``,
``perplexity``) with the quantizer replaced by the plain-PyTorch reference (``quantize(..., static_scales=clip)``
then ``dequantize``), and counts bits as the format would if the middle and inner end points were not stored:
per row ``slot x D`` (dense) + 16 (header) + 32 per stored group's end points (3 groups, or 1 with static scales),
+ 8 per inner/outer value (COO entry; escape bytes left out, as the evaluation does), + 16 per sink-token value.
Nothing is changed in the format, the kernels or the codec.

``--static none`` is the check that the simulation is the real path: the reference quantizer reproduces the numba
codec bit for bit (``--check`` asserts it on every call: the same dequantized values and the same bits), so its
perplexity is ``oakenkv eval ppl --method <spec>``'s.

Variants: ``--levels 0.5,0.7,0.85,1`` (a few static grids per layer, each row taking the smallest that covers its
middle values, a 2-bit index per row counted; the format stores it in a byte, ``OakenConfig.static_levels``, whose
choice is this one: ``oakenkv eval ppl --method 'oaken-plus:...,static=1,levels=1'`` gives the same window NLLs);
``--static-search DIR`` (the oaken-plus search scores its candidates
with the static quantizer; those profiles are kept in DIR, never in the calibration cache). ``--first 4`` evaluates
windows the report does not use (to choose settings). Peers and FP come from ``docs/results/default-<n>w/``.

    OAKENKV_DATA_DIR=... OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 .venv/bin/python benchmarks/static_scales.py \\
        --spec 'oaken-plus:bits=4,sparse=0.057,rot_k=1,rot_v=1' --static 1 --peer kvquant4
    .venv/bin/python benchmarks/static_scales.py --table      # the notebook's rows from every result

Writes ``benchmarks/results/static_scales/<point>.json`` (``--point``; default from the spec, grids and windows).
docs/notebook/lowbit-sweep.md (2026-12-06, afternoon) reads them.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import torch

from oakenkv.methods.base import check_kv
from oakenkv.methods.oaken import OakenQuantizer, PlusQuantizer

#: the peers' results over the first n windows: ``default-<n>w/ppl-<name>.json`` (n = 4 or 20)
PEERS = Path(__file__).resolve().parents[1] / "docs" / "results"
HEADER_BITS, SCALE_BITS, COO_BITS = 16, 16, 8


class _ReferenceOaken(OakenQuantizer):
    """OakenQuantizer.quantize through the reference quantizer, optionally with static middle/inner scales, and the
    bits the format would store (module doc). With ``check``, every call is compared with the numba codec's round
    trip (the real path): with ``static`` None, bit-identical values and the same bits are asserted."""

    static: float | None = None
    #: ascending clip factors (the last 1) of per-row selectable static grids, or () for one static grid
    levels: tuple[float, ...] = ()
    #: the kinds whose grids are static (the other kind keeps per-row grids)
    static_kinds: tuple[str, ...] = ("key", "value")
    check: bool = False
    stats: dict[str, float]

    def quantize(self, layer_idx: int, kind: Any, x: torch.Tensor) -> tuple[torch.Tensor, float]:
        from oakenkv.quant.quantizer import GROUP_MIDDLE, GROUP_OUTER, dequantize, error_bound, quantize

        check_kv(x, kind)
        if kind not in self.kinds or self.adapt is not None or self.config.granularity != "token":
            raise NotImplementedError("the simulation covers token granularity, both kinds, no adaptive grouping")
        b, h, s, d = x.shape
        rows = x.permute(0, 2, 1, 3).reshape(b * s, h * d)
        thr = self.thresholds.layer(layer_idx, kind)
        static = self.static if kind in self.static_kinds else None
        if self.levels and static is not None:
            q = self._quantize_levels(rows, thr)
        else:
            q = quantize(rows, thr, self.config, static_scales=static)
        y = dequantize(q, thr, self.config)
        n_rows, width = rows.shape
        sparse = int((q.groups != GROUP_MIDDLE).sum())
        stored_groups = 3 if static is None else 1
        dense_bits = 8 * math.ceil(self.config.middle_bits * width / 8)
        level_bits = math.ceil(math.log2(len(self.levels))) if self.levels and static is not None else 0
        bits = n_rows * (dense_bits + HEADER_BITS + 2 * SCALE_BITS * stored_groups + level_bits) + COO_BITS * sparse
        st = self.stats
        st["rows"] += n_rows
        st["values"] += n_rows * width
        st["sparse"] += sparse
        st["outer"] += int((q.groups == GROUP_OUTER).sum())
        # middle values the grid does not cover (clipped to an end code: error beyond half a step)
        mid = q.groups == GROUP_MIDDLE
        over = ((y - rows.to(torch.float32)).abs() > error_bound(q, self.config) * 1.05) & mid
        st["middle_clipped"] += int(over.sum())
        st["middle"] += int(mid.sum())
        err = (y - rows.to(torch.float32)) ** 2
        st[f"sq_err_{kind}"] += float(err.sum())
        st[f"sq_{kind}"] += float((rows.to(torch.float32) ** 2).sum())
        if self.check:
            from oakenkv.kernels.cpu.codec import decode_batch, encode_batch, sparse_stream_stats

            enc = encode_batch(rows, thr, self.config)
            y_real = decode_batch(enc, thr, self.config)
            real_bits = 8 * (enc.nbytes() - sparse_stream_stats(enc)[1])
            st["checked_calls"] += 1
            if static is None:
                assert torch.equal(y, y_real), f"layer {layer_idx} {kind}: reference != codec"
                assert bits == real_bits, f"layer {layer_idx} {kind}: {bits} bits != codec's {real_bits}"
            else:  # the format's bits less the four end points of every row (plus the level index)
                assert bits == real_bits - n_rows * (4 * SCALE_BITS - level_bits), (bits, real_bits)
        return y.reshape(b, s, h, d).permute(0, 2, 1, 3).contiguous(), bits

    def _quantize_levels(self, rows: torch.Tensor, thr: Any) -> Any:
        """Static grids at a few sizes (``levels``, clip factors), each row taking the smallest that covers its
        middle values (a ``ceil(log2(len(levels)))``-bit index per row instead of four fp16 end points)."""
        from oakenkv.quant.quantizer import (
            GROUP_MIDDLE,
            QuantizedVectors,
            assign_groups,
            group_shift,
            quantize,
            thresholds_tuple,
        )

        to_lo, ti_lo, ti_hi, to_hi = thresholds_tuple(thr)
        x32 = rows.to(torch.float32)
        groups = assign_groups(x32, thr)
        sh = group_shift(x32, groups, thr)
        mid = groups == GROUP_MIDDLE
        zero = torch.zeros((), dtype=torch.float32)
        lo = torch.where(mid & (sh < 0), -sh, zero).amax(dim=1) / (ti_lo - to_lo)
        hi = torch.where(mid & (sh > 0), sh, zero).amax(dim=1) / (to_hi - ti_hi)
        need = torch.maximum(lo, hi)  # [N] the share of the static range the row's middle values reach (<= 1)
        levels = torch.tensor(self.levels, dtype=torch.float32)  # ascending, the last 1
        pick = torch.searchsorted(levels, need.contiguous()).clamp(max=len(self.levels) - 1)
        out = None
        for j, c in enumerate(self.levels):
            idx = torch.nonzero(pick == j).flatten()
            self.stats[f"level_{c:g}"] = self.stats.get(f"level_{c:g}", 0) + int(idx.numel())
            if not idx.numel():
                continue
            qj = quantize(rows[idx], thr, self.config, static_scales=c)
            if out is None:
                out = QuantizedVectors(
                    torch.zeros_like(rows, dtype=torch.uint8),
                    torch.zeros_like(rows, dtype=torch.uint8),
                    torch.zeros((rows.shape[0], 3), dtype=qj.mins.dtype),
                    torch.zeros((rows.shape[0], 3), dtype=qj.mins.dtype),
                )
            out.codes[idx], out.groups[idx], out.mins[idx], out.maxs[idx] = qj.codes, qj.groups, qj.mins, qj.maxs
        assert out is not None
        return out


class StaticPlusQuantizer(PlusQuantizer, _ReferenceOaken):
    """oaken-plus (its online key transform, sink) over :class:`_ReferenceOaken` (PlusQuantizer's ``super()``)."""

    def __init__(self, thresholds: Any, static: float | None, check: bool, levels: tuple[float, ...] = ()) -> None:
        super().__init__(thresholds)
        self.static, self.check, self.levels = static, check, levels
        keys = ("rows", "values", "sparse", "outer", "middle", "middle_clipped", "checked_calls")
        self.stats = dict.fromkeys(keys, 0) | {f"{a}_{k}": 0.0 for a in ("sq_err", "sq") for k in ("key", "value")}


def static_aware_profiles(model: Any, tokenizer: Any, searches: list[Any], clip: float, out: Path) -> list[Any]:
    """oaken-plus profiles whose search scores every candidate through the static-scale quantizer (the search's
    codec round trip, ``oakenkv.calibrate.search._fake_quant``, replaced for the call): the transforms and ratios
    chosen for static scales. Never put in the calibration cache, whose key does not know the quantizer: kept as
    files under ``out``, named by clip and search, and read from there by a later run."""
    import hashlib

    import oakenkv.calibrate.search as search_mod
    from oakenkv.calibrate.plus import PLUS_CALIBRATION, _search_dict, profile_plus_many
    from oakenkv.calibrate.spec import calibration_windows
    from oakenkv.calibrate.thresholds import Thresholds
    from oakenkv.quant.quantizer import dequantize, quantize

    def digest(search: Any) -> str:
        return hashlib.sha256(json.dumps(_search_dict(search), sort_keys=True).encode()).hexdigest()[:16]

    paths = [out / f"plus-default-static{clip:g}-{digest(s)}.json" for s in searches]
    if all(p.exists() for p in paths):
        return [Thresholds.load(p) for p in paths]

    def fake_quant(x: torch.Tensor, thr: Any, config: Any, sink_tokens: int = 0) -> torch.Tensor:
        r, h, n, hd = x.shape
        rows = x.permute(0, 2, 1, 3).reshape(r * n, h * hd).contiguous()
        y = dequantize(quantize(rows, thr, config, static_scales=clip), thr, config)
        y = y.reshape(r, n, h, hd).permute(0, 2, 1, 3)
        if sink_tokens:
            y[:, :, :sink_tokens] = x[:, :, :sink_tokens].to(torch.float16).to(y.dtype)
        return y

    windows = calibration_windows(tokenizer, PLUS_CALIBRATION)
    real = search_mod._fake_quant
    search_mod._fake_quant = fake_quant
    try:
        made = profile_plus_many(model, windows, searches, progress=True, name="default")
    finally:
        search_mod._fake_quant = real
    out.mkdir(parents=True, exist_ok=True)
    for p, th in zip(paths, made, strict=True):
        p.write_text(th.to_json())
    return made


def _peer(name: str, windows: int) -> dict[str, Any] | None:
    path = PEERS / f"default-{windows}w" / f"ppl-{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def table(root: Path) -> str:
    """A markdown row per result under ``root`` (the notebook's table): spec, grids, windows, bits, sparse share,
    delta vs FP and the paired difference from each peer."""
    lines = []
    for f in sorted(root.glob("*.json")):
        s = json.loads(f.read_text())["summary"]
        clip = s["static_clip"]
        grids = (
            "per row"
            if clip is None
            else f"static, clip {clip:g}" + (" (aware search)" if s.get("static_aware_search") else "")
        )
        if s.get("levels"):
            grids = "static, levels " + "/".join(f"{v:g}" for v in s["levels"])
            grids += " (aware search)" if s.get("static_aware_search") else ""
        if clip is not None and s.get("static_kinds", ["key", "value"]) != ["key", "value"]:
            grids += f" ({', '.join(s['static_kinds'])} only; the other per row)"
        if s.get("model", "default") != "default":
            grids += f", {s['model']}"
        w = s.get("windows", [0, 0])
        delta = s.get("delta_vs_fp", s.get("delta_vs_fp_same_windows"))
        peers = "; ".join(
            f"{k[3:]} ({v['peer_bits']:.2f}): {v['delta']:+.3f} [{v['ci95'][0]:+.3f}, {v['ci95'][1]:+.3f}]"
            for k, v in s.items()
            if k.startswith("vs_")
        )
        lines.append(
            f"| `{s['spec']}` | {grids} | {w[0]}-{w[1] - 1} | {s['bits']:.4f} | {s['sparse_share']:.4f} | "
            f"{'' if delta is None else f'{delta:+.3f}'} | {s['ppl']:.3f} | {peers} |"
        )
    return "\n".join(lines)


def main() -> None:
    if sys.argv[1:] == ["--table"]:
        print(table(Path(__file__).resolve().parent / "results" / "static_scales"))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="model name (peers and FP are read for 'default' only)")
    ap.add_argument(
        "--static-kinds", default="key,value", help="kinds with static grids (key, value or both), the other per row"
    )
    ap.add_argument("--spec", required=True, help="an oaken-plus spec (its profile and transforms are used)")
    ap.add_argument("--static", default="1", help="clip factor in (0, 1] of the static grids, or 'none' (per row)")
    ap.add_argument("--max-windows", type=int, default=4)
    ap.add_argument(
        "--first", type=int, default=0, help="skip this many windows (e.g. 4: tune on windows the report does not use)"
    )
    ap.add_argument("--peer", action="append", default=[], help="a peer in docs/results/default-4w: kvquant4, ...")
    ap.add_argument("--search-with", action="append", default=[], help="other oaken-plus specs to search together")
    ap.add_argument("--check", action="store_true", help="compare every call with the numba codec (module doc)")
    ap.add_argument("--point", help="result file name (default: from the spec and clip)")
    ap.add_argument(
        "--levels",
        help="comma-separated clip factors: each row takes the smallest static grid covering its middle values",
    )
    ap.add_argument(
        "--static-search",
        type=Path,
        metavar="DIR",
        help="profile with the search scoring the static quantizer (static_aware_profiles), files kept in DIR",
    )
    args = ap.parse_args()
    static = None if args.static == "none" else float(args.static)
    levels = tuple(sorted({float(v) for v in args.levels.split(",")} | {1.0})) if args.levels else ()
    static_kinds = tuple(k.strip() for k in args.static_kinds.split(","))  # checked before minutes of search
    if not set(static_kinds) <= {"key", "value"}:
        raise SystemExit(f"--static-kinds takes key, value or key,value, got {args.static_kinds!r}")
    if levels and (static is None or not all(0 < v <= 1 for v in levels)):
        raise SystemExit("--levels needs --static (any clip) and factors in (0, 1]")

    from oakenkv.assets.data import load_text, token_windows
    from oakenkv.assets.models import load_model
    from oakenkv.bench.results import save, start
    from oakenkv.calibrate.plus import PlusSearch, cached_plus_profiles
    from oakenkv.calibrate.presets import OAKEN_PLUS
    from oakenkv.eval.ppl import perplexity
    from oakenkv.eval.report import paired_delta
    from oakenkv.methods.build import _fake_quant
    from oakenkv.methods.registry import BuildContext, build_method, parse_spec

    start()
    loaded = load_model(args.model)
    searches = []
    for spec in [args.spec, *args.search_with]:
        family, p = parse_spec(spec)
        if family != OAKEN_PLUS.name:
            raise SystemExit(f"--spec and --search-with take oaken-plus specs, got {spec!r}")
        flags = (p["shift"], p["rot_k"], p["rot_v"], p["smooth"], p["ratios"], p["sink"], p["bits"], p["sparse"])
        searches.append(PlusSearch.from_flags(*flags))
    if args.static_search is not None:
        if static is None:
            raise SystemExit("--static-search needs --static CLIP")
        thresholds = static_aware_profiles(loaded.model, loaded.tokenizer, searches, static, args.static_search)[0]
        method = build_method(args.spec, loaded.model, loaded.tokenizer, "default", thresholds=thresholds)
    else:
        # every profile of this run from one recording (the ones cached already are read)
        profiles = cached_plus_profiles(
            loaded.model, loaded.tokenizer, args.model, searches, OAKEN_PLUS.calibration, progress=True
        )
        thresholds = profiles[0]
        method = build_method(args.spec, loaded.model, loaded.tokenizer, args.model, progress=True)
    assert method.extra["thresholds_sha256"] == thresholds.sha256()  # the profile build_method found is ours
    q = StaticPlusQuantizer(thresholds, static, args.check, levels)
    q.static_kinds = static_kinds
    ctx = BuildContext(args.spec, loaded.model, loaded.tokenizer, args.model, None, None, False)
    method.make_cache = _fake_quant(ctx, q, method.params["residual"], method.model)
    tag = "per-row" if static is None else f"static{static:g}" + ("-aware" if args.static_search else "")
    if levels:
        tag = "levels" + "_".join(f"{v:g}" for v in levels) + ("-aware" if args.static_search else "")
    if static is not None and set(q.static_kinds) != {"key", "value"}:
        tag += "-" + "".join(k[0] for k in q.static_kinds)
    if args.model != "default":
        tag = f"{args.model}-{tag}"
    method.name = f"{method.name}+{tag}(simulated)"
    ids = token_windows(loaded.tokenizer, load_text("wikitext2"), 2048, None, args.first + args.max_windows)
    ids = ids[args.first :]
    res = perplexity(loaded.model, ids, method, progress=True, model_name=args.model)
    out = res.to_dict()
    n = len(res.window_nll)
    fp = _peer("fp", n) if args.first == 0 and args.model == "default" else None
    st = q.stats
    summary: dict[str, Any] = {
        "spec": args.spec,
        "model": args.model,
        "static_clip": static,
        "static_kinds": list(q.static_kinds),
        "levels": list(levels),
        "level_rows": {k[6:]: v for k, v in q.stats.items() if k.startswith("level_")},
        "static_aware_search": args.static_search is not None,
        "thresholds_sha256": thresholds.sha256(),
        "ppl": res.ppl,
        "bits": res.effective_bits,
        "sparse_share": st["sparse"] / st["values"],
        "outer_share": st["outer"] / st["values"],
        "middle_clipped_share": st["middle_clipped"] / max(st["middle"], 1),
        "rel_sq_err": {k: st[f"sq_err_{k}"] / st[f"sq_{k}"] for k in ("key", "value")},
        "checked_calls": st["checked_calls"],
        "windows": [args.first, args.first + n],
    }
    if fp is not None:  # the peers' results over the same windows (docs/results/default-<n>w)
        summary["delta_vs_fp"] = res.ppl - fp["ppl"]
        for name in args.peer:
            peer = _peer(name, n)
            if peer is None:
                continue
            d, lo, hi = paired_delta(res.window_nll, peer["window_nll"], res.tokens)
            summary[f"vs_{name}"] = {"peer_bits": peer["effective_bits"], "delta": d, "ci95": [lo, hi]}
    elif args.first == 0 and args.model == "default":  # no FP over these windows: FP's first n of the 4-window run
        fp4 = _peer("fp", 4)
        tok = res.tokens // n
        summary["delta_vs_fp_same_windows"] = res.ppl - math.exp(sum(fp4["window_nll"][:n]) / (tok * n))
    print(json.dumps(summary, indent=2))
    point = args.point or re.sub(r"[^A-Za-z0-9._-]+", "_", f"{args.spec}-{tag}-w{args.first}-{args.first + n}")
    print(save("static_scales", point, {"summary": summary, "result": out}))


if __name__ == "__main__":
    main()
