#!/bin/sh
# Three greedy texts of 160 tokens of a `k3 synth --routing local` checkpoint on the CPU
# backend, their route traces and lab/locality/measure.py's figures (docs/tuning.md, a
# checkpoint with real K3 locality).
# Usage: lab/locality/texts.sh K3_BINARY MODEL_DIR TRACE_DIR
set -e
k3=$1 model=$2 dir=$3
mkdir -p "$dir"
for p in 5,300,17 900,41,7 2000,12,13; do
  "$k3" run "$model" --ids $p --ngen 160 --ignore-eos --backend cpu --quiet \
    --route-trace "$dir/$p.jsonl" > /dev/null
done
python3 "$(dirname "$0")/measure.py" "$dir/5,300,17.jsonl" "$dir/900,41,7.jsonl" "$dir/2000,12,13.jsonl"
