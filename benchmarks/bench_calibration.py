"""The offline half's cost (issue #36): the oaken-plus search and ``oakenkv profile`` against their forward passes.

Per model, each in a fresh process (so that one's memory does not count in another's peak):

- ``forward``: the forward passes alone over the search's calibration windows (16 x 2048 tokens of the Wikipedia
  excerpt by default), one prefill per window as the search runs them (a fresh cache, no logits but the last);
  measured before and after the searches, interleaved, and averaged;
- ``search-new``: ``oakenkv.calibrate.plus.profile_plus`` of this tree (layer by layer);
- ``search-lazy`` (``--lazy``): the same on the model loaded with ``load_model(lazy=True)`` (its embeddings, LM
  head and decoder layers read from disk one at a time, ``oakenkv.assets.lazy``), as ``oakenkv calibrate --preset
  oaken-plus`` runs it; ``--no-eager`` leaves out ``search-new`` (its memory is the whole model's);
- ``search-old``: the same of ``--old-rev`` (every layer recorded at once), its ``calibrate/plus.py`` loaded from
  git and run against this tree's other modules (it needs nothing they no longer export);
- for ``--profile-models``: ``profile-forward`` and ``profile``, the paper's thresholds of ``oakenkv profile``
  (``profile_thresholds``, 100 x 256 tokens by default, layer by layer on the lazily loaded model as the command
  runs it) and its forward passes alone (the whole model loaded), interleaved.

For each: wall and CPU seconds of the timed part, the process's resident memory after loading the model and the
windows (its weights read once and a short prefill run, so that all of it is resident), and its peak during the
timed part (``VmHWM`` after resetting it through ``/proc/self/clear_refs``) and
over the whole process (``ru_maxrss``, loading included). The new and the old search's profiles are compared
field by field (everything but timing), and the default model's with the shipped profile.

Usage::

    .venv/bin/python benchmarks/bench_calibration.py                      # default model, ~1 h on 2 busy cores
    .venv/bin/python benchmarks/bench_calibration.py --models default qwen2.5-coder-0.5b
    .venv/bin/python benchmarks/bench_calibration.py --models qwen2.5-coder-0.5b --lazy --no-old --profile-models
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "bench_calibration.json"
#: The commit before the search streamed layers (the all-at-once recording).
OLD_REV = "08613c3"


def _status(field: str) -> float:
    """A ``VmRSS``/``VmHWM`` line of /proc/self/status, in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def _old_plus(rev: str):
    """``oakenkv.calibrate.plus`` as it was at ``rev``, as a module of its own."""
    import importlib.util

    src = subprocess.run(
        ["git", "show", f"{rev}:src/oakenkv/calibrate/plus.py"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout
    path = Path(tempfile.mkdtemp()) / "oakenkv_plus_old.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("oakenkv_plus_old", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


def child(args: argparse.Namespace) -> dict:
    import torch
    from transformers import DynamicCache

    from oakenkv.assets.models import load_model
    from oakenkv.calibrate.spec import CalibrationSpec, calibration_windows
    from oakenkv.util.compat import cache_kwargs

    t0 = time.perf_counter()
    # the profile runs layer by layer on a lazily loaded model, as `oakenkv profile` runs it (profile_model)
    lm = load_model(args.model, lazy=args.child in ("search-lazy", "profile"))
    load_s = time.perf_counter() - t0
    spec = CalibrationSpec(samples=args.samples, window=args.window)
    windows = calibration_windows(lm.tokenizer, spec)
    old = _old_plus(args.old_rev) if args.child == "search-old" else None
    import gc

    from oakenkv.calibrate.identity import weights_digest

    # The weights are mapped from their file and become resident when first read: read them (the digest every
    # search and profile takes) and run a short prefill first, so that "loaded" counts the whole model.
    weights_digest(lm.model)
    with torch.inference_mode():
        lm.model(input_ids=windows[:1, :8])
    # the codec's numba kernels (the search's fake quantization) load from their cache, or compile, untimed
    from oakenkv.calibrate.thresholds import GroupThresholds
    from oakenkv.format.config import OakenConfig
    from oakenkv.kernels.codec import decode, encode

    thr, cfg = GroupThresholds(-2.0, -0.1, 0.1, 2.0), OakenConfig()
    decode(encode(torch.randn(4, 64), thr, cfg), thr, cfg)
    gc.collect()
    rss_loaded = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    out: dict = {"mode": args.child, "model": args.model, "windows": list(windows.shape), "load_seconds": load_s}
    wall, cpu = time.perf_counter(), time.process_time()
    if args.child in ("forward", "profile-forward"):
        with torch.inference_mode():
            for r in range(windows.shape[0]):
                kw = cache_kwargs(lm.model, DynamicCache(config=lm.model.config))
                lm.model(input_ids=windows[r : r + 1], use_cache=True, logits_to_keep=1, **kw)
    elif args.child in ("search-new", "search-old", "search-lazy"):
        from oakenkv.calibrate.diskcache import calibration_key

        plus = old if old is not None else __import__("oakenkv.calibrate.plus", fromlist=["profile_plus"])
        key = calibration_key(lm.model, args.model, spec, windows)
        meta = {"data": spec.text, "data_path": None, "samples": spec.samples, "window": spec.window}
        meta["windows_sha256"] = key.windows_sha256
        th = plus.profile_plus(lm.model, windows, plus.PlusSearch(), name=args.model, metadata=meta)
        th.save(args.save)
        out["profile_sha256"] = th.sha256()
    elif args.child == "profile":
        import warnings

        from oakenkv.calibrate.profile import profile_thresholds

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            th = profile_thresholds(lm.model, windows, name=args.model)
        out["profile_sha256"] = th.sha256()
    else:
        raise ValueError(args.child)
    out["seconds"] = time.perf_counter() - wall
    out["cpu_seconds"] = time.process_time() - cpu
    out["rss_loaded_mib"] = rss_loaded
    out["peak_rss_timed_mib"] = _status("VmHWM")
    out["peak_rss_process_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out["torch_threads"] = torch.get_num_threads()
    return out


def _run(mode: str, model: str, samples: int, window: int, old_rev: str, save: Path | None = None) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, "--model", model, "--samples", str(samples)]
    cmd += ["--window", str(window), "--old-rev", old_rev, "--save", str(save or "")]
    env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    load = os.getloadavg()[0]
    got = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    res = json.loads(got.stdout.strip().splitlines()[-1])
    res["load_before"] = load
    res["load_after"] = os.getloadavg()[0]
    print(
        f"{model:>20} {mode:<16} {res['seconds']:8.1f} s  cpu {res['cpu_seconds']:8.1f} s  "
        f"rss {res['rss_loaded_mib']:7.0f} -> peak {res['peak_rss_timed_mib']:7.0f} MiB (process "
        f"{res['peak_rss_process_mib']:.0f})  load {load:.1f}",
        flush=True,
    )
    return res


def _decided(path: Path) -> dict:
    """A profile file without its timing."""
    d = json.loads(path.read_text())
    for k in ("seconds", "cpu_seconds"):
        d["profile"].pop(k, None)
    return d


def _ratio(a: float, b: float) -> float:
    return round(a / b, 3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="*", default=["default"], help="models whose search is measured (none: skip)")
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--window", type=int, default=2048)
    p.add_argument("--profile-models", nargs="*", default=["default"])
    p.add_argument("--profile-samples", type=int, default=100)
    p.add_argument("--profile-window", type=int, default=256)
    p.add_argument("--old-rev", default=OLD_REV)
    p.add_argument("--no-old", action="store_true", help="skip the old search (its memory and time)")
    p.add_argument("--lazy", action="store_true", help="also run the search on the lazily loaded model")
    p.add_argument("--no-eager", action="store_true", help="skip the search on the eagerly loaded model")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--save", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return

    import torch

    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    cpu = next((ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if ln.startswith("Model name")), "?")
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    result: dict = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {
            "cpu": cpu,
            "cores": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
        "revision": rev.strip(),
        "old_revision": args.old_rev,
        "load_start": os.getloadavg(),
        "uptime_start": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
        "search": {},
        "profile": {},
        "notes": (
            "Times are wall seconds on a machine shared with other jobs: compare the ratios of one model's runs "
            "(interleaved), not absolute times. forward = one prefill per window with a fresh cache and no logits "
            "but the last, the model's own attention; its value is the mean of the runs before and after."
        ),
    }
    tmp = Path(tempfile.mkdtemp())
    for model in args.models:
        runs = {"forward_before": _run("forward", model, args.samples, args.window, args.old_rev)}
        new_file, old_file = tmp / f"{model}-new.json", tmp / f"{model}-old.json"
        lazy_file = tmp / f"{model}-lazy.json"
        if not args.no_eager:
            runs["search_new"] = _run("search-new", model, args.samples, args.window, args.old_rev, new_file)
        if args.lazy:
            runs["search_lazy"] = _run("search-lazy", model, args.samples, args.window, args.old_rev, lazy_file)
        if not args.no_old:
            runs["search_old"] = _run("search-old", model, args.samples, args.window, args.old_rev, old_file)
        runs["forward_after"] = _run("forward", model, args.samples, args.window, args.old_rev)
        fwd = (runs["forward_before"]["seconds"] + runs["forward_after"]["seconds"]) / 2
        fwd_cpu = (runs["forward_before"]["cpu_seconds"] + runs["forward_after"]["cpu_seconds"]) / 2
        entry: dict = {"windows": [args.samples, args.window], "runs": runs, "forward_seconds": round(fwd, 1)}
        for name, run in (("new", "search_new"), ("lazy", "search_lazy")):
            if run in runs:
                entry.update(
                    {
                        f"{name}_over_forward": _ratio(runs[run]["seconds"], fwd),
                        f"{name}_over_forward_cpu": _ratio(runs[run]["cpu_seconds"], fwd_cpu),
                        f"{name}_peak_rss_mib": round(runs[run]["peak_rss_process_mib"]),
                        f"{name}_peak_above_loaded_mib": round(
                            runs[run]["peak_rss_timed_mib"] - runs[run]["rss_loaded_mib"]
                        ),
                    }
                )
        if "search_new" in runs and "search_lazy" in runs:
            entry["same_profile_lazy_as_new"] = _decided(lazy_file) == _decided(new_file)
        decided = new_file if "search_new" in runs else lazy_file if "search_lazy" in runs else None
        if not args.no_old:
            old = runs["search_old"]
            entry.update(
                {
                    "old_over_forward": _ratio(old["seconds"], fwd),
                    "old_over_forward_cpu": _ratio(old["cpu_seconds"], fwd_cpu),
                    "old_peak_rss_mib": round(old["peak_rss_process_mib"]),
                    "old_peak_above_loaded_mib": round(old["peak_rss_timed_mib"] - old["rss_loaded_mib"]),
                    "same_profile_as_old": decided is not None and _decided(decided) == _decided(old_file),
                }
            )
        if decided is not None and model == "default" and (args.samples, args.window) == (16, 2048):
            shipped = ROOT / "src/oakenkv/calibrate/profiles/plus-default-wikipedia-16x2048-602ca9a24103faa2.json"
            entry["same_profile_as_shipped"] = _decided(decided) == _decided(shipped)
        result["search"][model] = entry
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    for model in args.profile_models:
        pa = (args.profile_samples, args.profile_window)
        runs = {"forward_before": _run("profile-forward", model, *pa, args.old_rev)}
        runs["profile"] = _run("profile", model, *pa, args.old_rev)
        runs["forward_after"] = _run("profile-forward", model, *pa, args.old_rev)
        fwd = (runs["forward_before"]["seconds"] + runs["forward_after"]["seconds"]) / 2
        fwd_cpu = (runs["forward_before"]["cpu_seconds"] + runs["forward_after"]["cpu_seconds"]) / 2
        result["profile"][model] = {
            "windows": list(pa),
            "runs": runs,
            "forward_seconds": round(fwd, 1),
            "profile_over_forward": _ratio(runs["profile"]["seconds"], fwd),
            "profile_over_forward_cpu": _ratio(runs["profile"]["cpu_seconds"], fwd_cpu),
        }
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    result["load_end"] = os.getloadavg()
    result["uptime_end"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
