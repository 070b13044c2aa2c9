"""One KV kind through vLLM's engine on this machine's device: output tokens per second of a batch of requests at a
KV budget, and the greedy tokens (issue 33: the plugin's CUDA backend, ``OAKEN_CUDA``, against vLLM's bf16 and fp8
caches). ``benchmarks/gpu_check.py``'s ``vllm`` stage runs it once per kind, each in a process of its own; it also
runs on vLLM's CPU engine (the Oaken kind then with ``--kernels triton`` under ``TRITON_INTERPRET=1``: how it was
checked without a GPU).

    python benchmarks/vllm_cuda_serve.py --model DIR --kind oaken --profile P.json --kv-mib 128

Prompts are random token ids (``skip_tokenizer_init``: a model directory needs no tokenizer), the same for every
kind (``--seed``). One short request first compiles and warms everything; the timed batch follows. Prints one line
``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

KINDS = ("bf16", "fp8", "oaken")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True, help="a Hugging Face model directory")
    p.add_argument("--kind", choices=KINDS, required=True, help="vLLM's bf16 or fp8 KV cache, or the Oaken plugin's")
    p.add_argument("--profile", type=Path, default=None, help="the Oaken profile (`oakenkv profile`), kind oaken")
    p.add_argument("--kv-mib", type=int, default=128, help="KV memory budget (MiB)")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--kernels",
        choices=("numba", "triton"),
        default="numba",
        help="oaken on vLLM's CPU engine: the CPU backend (numba) or the device one (triton); CUDA: ignored",
    )
    args = p.parse_args(argv)
    if args.kind == "oaken" and args.profile is None:
        p.error("--kind oaken needs --profile")
    return args


def run(args: argparse.Namespace) -> dict:
    import numpy as np

    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc(worker_stats)
    from oakenkv.integrations.vllm import disable, enable

    disable()
    if args.kind == "oaken":
        enable(args.profile, overflow="clip", kernels=args.kernels)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(
        model=str(args.model), dtype=args.dtype, max_model_len=args.max_model_len, enforce_eager=True,
        kv_cache_memory_bytes=args.kv_mib << 20, skip_tokenizer_init=True, seed=0,
        **({"kv_cache_dtype": "fp8"} if args.kind == "fp8" else {}),
    )  # fmt: skip
    ready_s = time.perf_counter() - t0
    vocab = int(llm.llm_engine.model_config.hf_config.vocab_size)
    rng = np.random.default_rng(args.seed)
    prompts = [
        TokensPrompt(prompt_token_ids=rng.integers(10, vocab, args.prompt_tokens).tolist())
        for _ in range(args.requests)
    ]
    greedy = SamplingParams(max_tokens=args.output_tokens, temperature=0, ignore_eos=True, detokenize=False)
    try:
        llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0, detokenize=False), use_tqdm=False)
        t1 = time.perf_counter()
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        elapsed = time.perf_counter() - t1
        stats = None
        if args.kind == "oaken":
            from oakenkv.integrations.vllm.backend import worker_stats

            (stats,) = llm.collective_rpc(worker_stats)
    finally:
        llm.llm_engine.engine_core.shutdown()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "kind": args.kind,
        "model": str(args.model),
        "kv_mib": args.kv_mib,
        "requests": args.requests,
        "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens,
        "engine_ready_s": round(ready_s, 2),
        "elapsed_s": round(elapsed, 3),
        "output_tokens_per_s": round(tokens / elapsed, 2),
        "greedy_first_requests": [list(o.outputs[0].token_ids) for o in outs[:4]],
        "oaken": None
        if stats is None
        else {k: stats.get(k) for k in ("backend", "layout", "num_blocks", "totals", "times_s")},
    }


def main(argv: list[str] | None = None) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    res = run(_parse(argv))
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
