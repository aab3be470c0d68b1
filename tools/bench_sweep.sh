#!/usr/bin/env bash
# Expert-streaming benchmarks of docs/tuning.md, all in one run on one machine:
#   1. reader vs the disk: `k3 bench reader` (engine reader vs plain parallel O_DIRECT);
#   2. decode on a k3-slice model with K3_EXPERT_GB swept, RUNS runs per point, pipe on and
#      off, each run's counters as --stats-json (tools/sweep_report.py turns them into the
#      table and plot; it needs no Python here).
# Usage: tools/bench_sweep.sh K3_BINARY MODEL_DIR OUT_DIR ["GB list"] [NGEN] [RUNS]
set -euo pipefail
K3="$1"; MODEL="$2"; OUT="$3"
GBS="${4:-0 2 8 16 32}"; NGEN="${5:-8}"; RUNS="${6:-3}"
mkdir -p "$OUT"
"$K3" bench reader "$MODEL" --rounds 3 2>&1 | tee "$OUT/reader.txt"
PROMPT="163584,1000,2000,3000,4000,5000,6000,7000"
for gb in $GBS; do
  for pipe in 1 0; do
    for run in $(seq 1 "$RUNS"); do
      "$K3" run "$MODEL" --ids "$PROMPT" --ngen "$NGEN" --ignore-eos --quiet \
        --expert-gb "$gb" --pipe "$pipe" --stats-json "$OUT/run-$gb-$pipe-$run.json" \
        > /dev/null 2> "$OUT/run-$gb-$pipe-$run.log"
      tail -4 "$OUT/run-$gb-$pipe-$run.log"
    done
  done
done
echo "done: tools/sweep_report.py $OUT builds the table and the plot"
