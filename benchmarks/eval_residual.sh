#!/usr/bin/env bash
# Accuracy of OakenCache's full-precision window (`residual`, docs/pages.md) on the default model: the JSON files
# under benchmarks/results/residual/ (session 15). Two conventions:
#
# - ppl3w_*: `eval ppl`'s usual one, 3 windows of 2048 tokens, each one prefill: every query attends over the
#   quantized keys and values of the whole window, so a window of the newest tokens only changes what the last
#   queries of each window see (compare docs/results/default/ppl-oaken*.json);
# - dec_*: windows of 1024 tokens fed 8 at a time (`--chunk 8`), as a generation feeds the cache: every query then
#   sees its own newest tokens through the window, which is where decode attention puts much of its weight.
#
#   benchmarks/eval_residual.sh            # about 35 min on 2 cores (ppl3w ~70 s, dec ~150 s per method)
set -euo pipefail
cd "$(dirname "$0")/.."
OAK="${OAK:-.venv/bin/oakenkv}"
OUT="${OUT:-benchmarks/results/residual}"
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
mkdir -p "$OUT"
name() { echo "$1" | tr ':=' '__'; }
for m in oaken oaken:residual=128 oaken-plus:residual=128; do
  f="$OUT/ppl3w_$(name "$m").json"
  [ -e "$f" ] || $OAK eval ppl --method "$m" --max-windows 3 --json "$f"
done
for m in fp kivi4 oaken oaken:residual=32 oaken:residual=128 oaken-plus oaken-plus:residual=32 \
  oaken-plus:residual=64 oaken-plus:residual=128; do
  f="$OUT/dec_$(name "$m").json"
  [ -e "$f" ] || $OAK eval ppl --method "$m" --window 1024 --chunk 8 --max-windows 6 --json "$f"
done
