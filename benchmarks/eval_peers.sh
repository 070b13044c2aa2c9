#!/usr/bin/env bash
# Regenerate docs/results.md and docs/results_pareto.png: WikiText-2 perplexity and zero-shot accuracy of Oaken
# and its peers on the default model (and Gemma-3-270m), then the report.
#
#   benchmarks/eval_peers.sh [part...]    parts: calib baselines oaken chunked ablation windows20 zeroshot textdep
#                                          full gemma plus qwen report (windows20: 20 windows whatever WINDOWS says, ~1.5 h;
#                                          full: every window, FULL_METHODS, ~35 min each; not in the default list)
#
# WINDOWS (default 3) windows of 2048 tokens and LIMIT (default 50) documents per task keep this within about
# an hour on 2 shared CPU cores; WINDOWS= (empty) LIMIT= (empty) runs the full WikiText-2 test set (~140 windows)
# and the full validation sets. Results are JSON files under OUT (default docs/results); existing files are kept
# (delete one to re-run it). Other LIMITs write to OUT/default-zs<LIMIT>, ZS_TASKS (a subset of the three tasks)
# to OUT/default-zs<LIMIT>-<tasks> and GEMMA_WINDOWS other than 3 to OUT/gemma3-270m-<N>w, so that runs over
# different documents or windows are never mixed in one table.
# Session 6 ran: LIMIT=200 ZS_METHODS="fp oaken kvquant4 int5 int4 fp8" benchmarks/eval_peers.sh zeroshot;
# GEMMA_WINDOWS=20 benchmarks/eval_peers.sh gemma; MODEL=gemma3-270m LIMIT=200 ZS_METHODS="fp oaken kvquant4 int4"
# benchmarks/eval_peers.sh zeroshot. Session 7 ran: MODEL=gemma3-270m FULL_METHODS=fp (and =oaken, a second process;
# later OMP_NUM_THREADS=2 ... FULL_METHODS=kvquant4 alone) benchmarks/eval_peers.sh full; MODEL=gemma3-270m LIMIT=200
# ZS_METHODS="int5 fp8" benchmarks/eval_peers.sh zeroshot. Session 8 ran: benchmarks/eval_peers.sh oaken (for
# oaken-head; the rest existed); MODEL=gemma3-270m OMP_NUM_THREADS=2 FULL_METHODS=<m> benchmarks/eval_peers.sh full
# for int5, kivi4, fp8, oaken-official and int4 one after another (the same command, from a copy of the loop).
# Session 9 ran: LIMIT= ZS_TASKS=piqa,winogrande ZS_METHODS=<m> benchmarks/eval_peers.sh zeroshot, two processes at
# a time (fp, kvquant4, int5 in one; oaken, int4, fp8 in the other).
# Session 10 ran: LIMIT=2000 ZS_TASKS=hellaswag ZS_METHODS=<m> benchmarks/eval_peers.sh zeroshot, the same way.
set -euo pipefail
# One thread per process: on a shared 2-core machine two OpenMP threads fighting other jobs made a forward pass
# ~10x slower than one thread. Run several parts in parallel instead.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
cd "$(dirname "$0")/.."
OAK="${OAK:-.venv/bin/python -m oakenkv.cli}"
OUT="${OUT:-docs/results}"
WINDOWS="${WINDOWS-3}"
LIMIT="${LIMIT-50}"
MODEL="${MODEL:-default}"
mw=(); [[ -n "$WINDOWS" ]] && mw=(--max-windows "$WINDOWS")
lim=(); [[ -n "$LIMIT" ]] && lim=(--limit "$LIMIT")
parts=("$@"); [[ ${#parts[@]} -eq 0 ]] && parts=(calib baselines oaken chunked ablation windows20 zeroshot textdep gemma report)

ppl() {  # ppl <file-stem> <method> [extra args...]
  local f="$OUT/$MODEL/ppl-$1.json"; shift
  [[ -f "$f" ]] || $OAK eval ppl --model "$MODEL" --method "$1" "${mw[@]}" "${@:2}" --json "$f"
}
zs() {  # zs <file-stem> <method>  (LIMIT other than 50 documents: its own directory, e.g. default-zs200;
  # ZS_TASKS, a subset such as piqa,winogrande: its own directory too, e.g. default-zsall-piqa-winogrande)
  local d="$OUT/$MODEL"; [[ "$LIMIT" != 50 ]] && d="$OUT/$MODEL-zs${LIMIT:-all}"
  local tasks=()
  if [[ -n "${ZS_TASKS:-}" ]]; then
    [[ "$d" == "$OUT/$MODEL" ]] && d="$OUT/$MODEL-zs50"
    d="$d-${ZS_TASKS//,/-}"; tasks=(--tasks "$ZS_TASKS")
  fi
  mkdir -p "$d"
  local f="$d/zs-$1.json"
  [[ -f "$f" ]] || $OAK eval zeroshot --model "$MODEL" --method "$2" "${lim[@]}" "${tasks[@]}" --json "$f"
}

for part in "${parts[@]}"; do
  case "$part" in
    calib)  # one pass over 16 x 256 Wikipedia tokens: every Oaken profile and the baselines' ranges
      $OAK eval calibrate --model "$MODEL" ;;
    baselines)
      for m in fp int4 int5 kivi4 kvquant4 fp8 quanto4; do ppl "$m" "$m"; done ;;
    oaken)
      ppl oaken oaken
      ppl oaken-official oaken-official
      ppl oaken-prerope oaken:key_position=pre
      ppl oaken-kurtosis oaken-kurtosis
      ppl oaken-head oaken:granularity=head  # one set of scales per head vector (64 values) instead of per token
      for s in 0.08 0.12 0.16 0.20; do
        o=$(python3 -c "print(round(0.4*$s,6))"); i=$(python3 -c "print(round(0.6*$s,6))")
        ppl "oaken-share$s" "oaken:outer=$o,inner=$i"
      done ;;
    chunked)  # transformers' QuantizedCache fed 128 tokens per forward call, as in decoding (its prefill is FP)
      ppl quanto4-chunk128 quanto4 --chunk 128 ;;
    zeroshot)
      for m in ${ZS_METHODS:-fp int4 oaken kvquant4 fp8}; do zs "$m" "$m"; done ;;
    textdep)  # the paper's claim: thresholds do not depend on the profiling text (Wikipedia vs WikiText-2 vs novels)
      .venv/bin/python benchmarks/thresholds_textdep.py --make-text /tmp/oakenkv-lambada.txt
      $OAK eval calibrate --model "$MODEL" --sweep "" --calib-text wikitext2
      $OAK eval calibrate --model "$MODEL" --sweep "" --calib-text file --calib-path /tmp/oakenkv-lambada.txt
      ppl oaken-calib-wikitext2 oaken --calib-text wikitext2
      ppl oaken-calib-lambada oaken --calib-text file --calib-path /tmp/oakenkv-lambada.txt
      .venv/bin/python benchmarks/thresholds_textdep.py --model "$MODEL" --out "$OUT/$MODEL/thresholds-textdep.json" ;;
    ablation)  # which side costs Oaken its perplexity: only the keys, only the values quantized; longer calibration
      ppl oaken-onlyk oaken:only=k
      ppl oaken-onlyv oaken:only=v
      ppl oaken-calib-100x512 oaken --calib-samples 100 --calib-window 512 ;;
    windows20)  # the main methods over the first 20 windows (40,940 tokens), in their own directory
      for spec in fp:fp oaken:oaken kvquant4:kvquant4 int4:int4 int5:int5 kivi4:kivi4 fp8:fp8 \
                  oaken-official:oaken-official oaken-onlyk:oaken:only=k oaken-onlyv:oaken:only=v; do
        f="$OUT/$MODEL-20w/ppl-${spec%%:*}.json"; mkdir -p "$OUT/$MODEL-20w"
        [[ -f "$f" ]] || $OAK eval ppl --model "$MODEL" --method "${spec#*:}" --max-windows 20 --json "$f"
      done
      f="$OUT/$MODEL-20w/ppl-quanto4-chunk128.json"
      [[ -f "$f" ]] || $OAK eval ppl --model "$MODEL" --method quanto4 --chunk 128 --max-windows 20 --json "$f" ;;
    full)  # the main methods over the whole WikiText-2 test set (147 windows; ~35 min per method on one core for
      # the default model, 142 windows and ~1.5-2 h for Gemma-3-270m: MODEL=gemma3-270m)
      mkdir -p "$OUT/$MODEL-full"
      for m in ${FULL_METHODS:-fp oaken kvquant4 fp8 int4 int5 kivi4 oaken-official}; do
        f="$OUT/$MODEL-full/ppl-$m.json"
        [[ -f "$f" ]] || $OAK eval ppl --model "$MODEL" --method "$m" --json "$f"
      done ;;
    gemma)  # Gemma-3-270m: GEMMA_WINDOWS (default 3) 2048-token windows, BOS first as its tokenizer does
      # (token_windows); other window counts go to their own directory (gemma3-270m-20w for 20).
      # (no quanto: QuantizedCache rejects its sliding-window layers)
      MODEL=gemma3-270m; gw="${GEMMA_WINDOWS:-3}"
      d="$OUT/$MODEL"; [[ "$gw" != 3 ]] && d="$OUT/$MODEL-${gw}w"; mkdir -p "$d"
      $OAK eval calibrate --model "$MODEL" --sweep ""
      for m in fp oaken kvquant4 int5 kivi4 oaken-official fp8 int4; do
        f="$d/ppl-$m.json"
        [[ -f "$f" ]] || $OAK eval ppl --model "$MODEL" --method "$m" --max-windows "$gw" --json "$f"
      done
      MODEL=default ;;
    plus)  # oaken-plus (docs/plus.md): the whole test set, and each remedy alone on the first 3 windows
      # (session 12; session 13 re-ran every file after the fwht fix and with the sink token: the profile is made
      # once per search setting, 16 x 2048 Wikipedia tokens, then cached)
      mkdir -p "$OUT/$MODEL-full"
      f="$OUT/$MODEL-full/ppl-oaken-plus.json"
      [[ -f "$f" ]] || $OAK eval ppl --model "$MODEL" --method oaken-plus --resume --json "$f"
      f="$OUT/$MODEL-full/ppl-oaken-plus-with-rotations.json"
      [[ -f "$f" ]] || $OAK eval ppl --model "$MODEL" --method "oaken-plus:rot_k=1,rot_v=1" --resume --json "$f"
      ppl oaken-plus oaken-plus
      for spec in "none:shift=0,smooth=0,ratios=0,sink=0" "shift-only:smooth=0,ratios=0,sink=0" \
                  "smooth-only:shift=0,ratios=0,sink=0" "ratios-only:shift=0,smooth=0,sink=0" \
                  "sink-only:shift=0,smooth=0,ratios=0" "rotk-only:shift=0,rot_k=1,smooth=0,ratios=0,sink=0" \
                  "rotv-only:shift=0,rot_v=1,smooth=0,ratios=0,sink=0" "no-sink:sink=0" "with-rotations:rot_k=1,rot_v=1"; do
        ppl "oaken-plus-${spec%%:*}" "oaken-plus:${spec#*:}"
      done ;;
    qwen)  # Qwen2.5-Coder-0.5B (bias on q/k/v; optional embedded model, `oakenkv info` says how to install it):
      # QWEN_WINDOWS (default 6) windows of 2048 tokens, ~15-25 min per method on one loaded core
      MODEL=qwen2.5-coder-0.5b; qw="${QWEN_WINDOWS:-6}"; d="$OUT/$MODEL-${qw}w"; mkdir -p "$d"
      for m in oaken-plus oaken fp kvquant4 kivi4 int4; do
        f="$d/ppl-$m.json"
        [[ -f "$f" ]] || $OAK eval ppl --model "$MODEL" --method "$m" --max-windows "$qw" --resume --json "$f"
      done
      MODEL=default ;;
    report)
      dirs=()
      for d in "$OUT"/default "$OUT"/default-20w "$OUT"/default-full "$OUT"/default-zs* "$OUT"/gemma3-270m* \
               "$OUT"/qwen2.5-coder-0.5b*; do
        [[ -d "$d" ]] && dirs+=("$d")
      done
      $OAK eval report "${dirs[@]}" --header benchmarks/results_header.md --out docs/results.md --plot docs/results_pareto.png ;;
    *) echo "unknown part $part" >&2; exit 2 ;;
  esac
done
