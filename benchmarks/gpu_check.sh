#!/usr/bin/env bash
# The one prepared GPU check of the Triton backend and the device store (issues 24 and 33; docs/gpu.md). Stage 1,
# correctness: the Triton encode/decode against the reference byte for byte; the device store against the CPU store
# (every record's bytes, tables, reads, attention); the default model through OakenCache on CUDA against the CPU
# backend (greedy tokens, perplexity on 4 windows). Then CUDA-event timings: device-to-device copy, encode, decode
# attention against SDPA over fp16 K/V (and FlashAttention if installed), a whole decode step of the model against
# DynamicCache fp16, kernel tuning; vLLM with bf16, fp8 and Oaken KV (the plugin's CUDA backend) where the machine
# has vLLM and the budget leaves time (else skipped with the reason; alone: --stages vllm).
# Writes one JSON (default benchmarks/results/gpu_check_<date>_<device>.json), rewritten after every stage.
#
#   benchmarks/gpu_check.sh [OUT] [extra gpu_check.py options]     e.g. benchmarks/gpu_check.sh "$OUT"
#
# Runs from the repository's sources (src on PYTHONPATH) with the machine's python3, torch, triton and transformers:
# nothing is downloaded, nothing installed except wheels carried in .whl/ (into /tmp/site, without network). The
# default model's file (98 MB) does not fit what a device call carries (64 MiB): where its package is absent the
# model stages use random weights of its architecture (recorded in the JSON). Planned for one H100/H200: about 5-7
# minutes; the driver starts no new case after 400 s, caps each case at 20 s, and this script kills it at 470 s, so
# it ends within 8 minutes whatever is slow. Exit status: 0, or 1 when a stage recorded an error.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-benchmarks/results}"
shift || true
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
py="${PYTHON:-python3}"  # the machine's python3 holds torch and triton
if compgen -G ".whl/*.whl" >/dev/null; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
echo "==> $(date -u +%FT%TZ) on $(hostname)"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv,noheader || echo "(no nvidia-smi)"
"$py" -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)'
timeout --signal=INT --kill-after=10 470 "$py" benchmarks/gpu_check.py --out "$out" "$@"
