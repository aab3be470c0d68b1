#!/usr/bin/env bash
# CPU side by side: k3 against the C engine on one synthesized K3-sized model, same machine,
# same cache budget, alternated rounds. Run on the device machine with both binaries carried
# in .devbin/ (k3 built here; the C engine built from its public source outside this
# repository, never committed). Prints start-up, prefill and decode lines of each run; k3
# runs exact (its default) and with K3_IDOT=1. K3BIN names k3's binary inside BIN.
#   usage: bash lab/device/cpu_side_by_side.sh [ROUNDS] [PROMPT_TOKENS] [NGEN]
set -u
ROUNDS=${1:-2}; NP=${2:-128}; NGEN=${3:-32}
BIN=${BIN:-.devbin}; SNAP=${SNAP:-/tmp/k3slice4x32}
echo "cores: $(nproc) logical, $(lscpu -p=core | grep -v '^#' | sort -u | wc -l) physical"
grep -m1 "model name" /proc/cpuinfo
grep -m1 -o 'avx512[a-z_]*\|avx2' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
if [ ! -f "$SNAP/config.json" ]; then
  /usr/bin/time -f "synth %e s" "$BIN/${K3BIN:-k3}" synth --preset k3-slice --layers 4 --experts 32 "$SNAP" 2>&1 | tail -2
fi
IDS_C=$(seq 100 $((99 + NP)) | tr '\n' ' ')
IDS_K=$(seq 100 $((99 + NP)) | paste -sd,)
run_c() { # $1 = K3_IDOT
  local t0=$(date +%s%N)
  K3_IDOT=$1 K3_EXPERT_GB=${EXPERT_GB:-8} "$BIN/kimi_k3" "$SNAP" --ids "$IDS_C" --ngen "$NGEN" 2>&1 >/dev/null \
    | grep -E "^\[K3\] (prefill|decode)|load|quantiz" | head -6
  echo "  wall $(( ($(date +%s%N) - t0) / 1000000 )) ms"
}
run_k3() { # $1 = K3_IDOT
  local t0=$(date +%s%N)
  K3_IDOT=$1 K3_EXPERT_GB=${EXPERT_GB:-8} "$BIN/${K3BIN:-k3}" run "$SNAP" --backend cpu --quiet --ids "$IDS_K" --ngen "$NGEN" 2>&1 >/dev/null \
    | grep -E "^\[K3\] (backend|prefill|decode)|load" | head -6
  echo "  wall $(( ($(date +%s%N) - t0) / 1000000 )) ms"
}
for r in $(seq 1 "$ROUNDS"); do
  echo "== round $r: C engine (K3_IDOT=1, its default)"; run_c 1
  echo "== round $r: C engine K3_IDOT=0";                run_c 0
  echo "== round $r: k3 --backend cpu";                  run_k3 0
  echo "== round $r: k3 --backend cpu K3_IDOT=1";        run_k3 1
done
