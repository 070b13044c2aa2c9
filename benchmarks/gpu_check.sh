#!/usr/bin/env bash
# The one prepared GPU check of the Triton backend (issue 24; docs/gpu.md): correctness against the reference on
# real shapes, then CUDA-event timings of decode attention (vs SDPA over fp16 K/V, and FlashAttention if
# installed), encode throughput and achieved bandwidth. Writes one JSON (default benchmarks/results/
# gpu_check_<date>_<device>.json), rewritten after every stage.
#
#   benchmarks/gpu_check.sh [OUT] [extra gpu_check.py options]     e.g. benchmarks/gpu_check.sh "$OUT"
#
# Runs from the repository's sources (src on PYTHONPATH) with the machine's python3, torch and triton: nothing is
# installed, except wheels carried in .whl/ (installed into /tmp/site without network). Planned for one H200:
# about 3-5 minutes; the driver starts no new case after 400 s, caps each case at 20 s, and this script kills it
# at 470 s, so it ends within 8 minutes whatever is slow. Exit status: 0, or 1 when a stage recorded an error.
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
