#!/usr/bin/env bash
# k3's CPU path, one build against another on the device box's 16 cores: decode and prefill of
# k3-slice (4 layers, 32 experts, K3's real widths) and `bench streams` 1 and 4, rounds
# alternated. Binaries carried as $BIN/k3-old and $BIN/k3-new (built here, stripped).
#   usage: bash lab/device/cpu_old_new.sh [ROUNDS] [PROMPT_TOKENS] [NGEN]
set -u
ROUNDS=${1:-3}; NP=${2:-128}; NGEN=${3:-32}
BIN=${BIN:-.devbin/cpu}; SNAP=${SNAP:-/tmp/k3slice4x32}
echo "cores: $(nproc)"; grep -m1 "model name" /proc/cpuinfo
[ -f "$SNAP/config.json" ] || timeout 120 "$BIN/k3-new" synth --preset k3-slice --layers 4 --experts 32 "$SNAP" > /dev/null 2>&1
IDS=$(seq 100 $((99 + NP)) | paste -sd,)
for r in $(seq 1 "$ROUNDS"); do
  for b in old new; do
    echo "== round $r: $b"
    timeout 120 "$BIN/k3-$b" run "$SNAP" --backend cpu --quiet --ids "$IDS" --ngen "$NGEN" --ignore-eos 2>&1 >/dev/null \
      | grep -E "^\[K3\] (prefill|decode)"
  done
done
for b in old new; do
  echo "== streams: $b"
  timeout 150 "$BIN/k3-$b" bench streams "$SNAP" --backend cpu --streams 1,4 --ngen 16 --rounds 1 2>&1 \
    | grep -v "^\[K3\] \(load\|weights\)" | tail -6
done
