#!/usr/bin/env bash
# Start-up side by side: k3's first start (no weight cache: it quantizes and writes the
# cache), k3's warm start (the cache written by the first), k3 with --no-weight-cache and the
# C engine's start, on one synthesized K3-sized model, rounds alternated, same machine and
# K3_EXPERT_GB. For every engine "wall-derived" is the run's wall time less its prefill and
# decode (one prompt token, one generated); for k3, "ready" is its own start-up figure
# (process start to model ready: the wait a user has before the prompt is read) and the
# weight cache's write, finished in the background, is shown apart (the wall-derived figure
# of a first start includes any time the process waited for that write at its end).
# Binaries: k3 built here, the C engine built from its public source outside this
# repository (never committed); both passed in, e.g. carried in .devbin/.
# BEFORE=<another k3 binary> adds its first start to every round (a change against its base).
#   usage: K3BIN=.devbin/k3 CBIN=.devbin/kimi_k3 SNAP=/tmp/k3slice4x32 [BEFORE=...] \
#          bash lab/device/startup_side_by_side.sh [ROUNDS]
set -u
ROUNDS=${1:-2}
K3BIN=${K3BIN:-.devbin/k3}; CBIN=${CBIN:-.devbin/kimi_k3}; SNAP=${SNAP:-/tmp/k3slice4x32}
export K3_EXPERT_GB=${EXPERT_GB:-1}
echo "cores: $(nproc) logical; load $(cut -d' ' -f1-3 /proc/loadavg)"
if [ ! -f "$SNAP/config.json" ]; then
  /usr/bin/time -f "synth %e s" "$K3BIN" synth --preset k3-slice --layers 4 --experts 32 "$SNAP" 2>&1 | tail -1
fi
ms() { date +%s%N | cut -c1-13; }
# Prints "<label> start <s> (wall <s>, prefill <s>, decode <s>) | <engine's own load line>".
report() { # $1 label, $2 wall ms, $3 log
  local pre dec ready
  pre=$(grep -oE "prefill done in [0-9.]+s" "$3" | grep -oE "[0-9.]+" | tail -1)
  dec=$(grep -oE "decode [0-9]+ tokens in [0-9.]+s" "$3" | grep -oE "[0-9.]+s" | tr -d s | tail -1)
  ready=$(grep -oE "start-up: ready in [0-9.]+s" "$3" | grep -oE "[0-9.]+" | tail -1)
  awk -v l="$1" -v w="$2" -v p="${pre:-0}" -v d="${dec:-0}" -v r="${ready:--}" \
    -v x="$(grep -E "dense weights|init done" "$3" | head -1)" \
    'BEGIN { printf "%-11s ready %6s s | wall-derived %6.2f s (wall %.2f, prefill %.2f, decode %.2f) | %s\n", l, r, w/1000-p-d, w/1000, p, d, x }'
  grep -E "start-up: ready" "$3" | sed 's/^/            /'
}
run_k3() { # $1 label, then extra flags
  local t0 log=/tmp/startup_k3.log label=$1 bin=$K3BIN; shift; t0=$(ms)
  if [ "$label" = "k3 before" ]; then bin=$BEFORE; fi
  "$bin" run "$SNAP" --backend cpu --quiet --ids 100 --ngen 1 "$@" >/dev/null 2>$log
  report "$label" $(( $(ms) - t0 )) $log
}
run_c() {
  local t0 log=/tmp/startup_c.log; t0=$(ms)
  "$CBIN" "$SNAP" --ids "100" --ngen 1 >/dev/null 2>$log
  report "C" $(( $(ms) - t0 )) $log
}
# Reads every shard once so the first round does not pay for a cold page cache alone.
cat "$SNAP"/*.safetensors > /dev/null
for r in $(seq 1 "$ROUNDS"); do
  echo "== round $r"
  if [ -n "${BEFORE:-}" ]; then
    rm -f "$SNAP/k3-weights.cache"
    run_k3 "k3 before"
  fi
  rm -f "$SNAP/k3-weights.cache"
  run_k3 "k3 first"
  run_k3 "k3 warm"
  run_c
  run_k3 "k3 no-cache" --no-weight-cache
done
