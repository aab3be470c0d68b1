#!/usr/bin/env bash
# The unified expert pool against the two tiers of a discrete GPU on one shared-memory
# adapter (lavapipe here, the stand-in for Apple Silicon): alternated rounds of
#   pool      K3_LAB_EXPERT_POOL=auto (the pool; reads into lent staging)
#   pool-host K3_LAB_EXPERT_POOL=auto K3_LAB_READ_STAGING=off (the pool; reads into host buffers)
#   two-tier  K3_LAB_EXPERT_POOL=off (host cache of the same budget, no VRAM tier)
# on one synthetic snapshot and budget; prints prefill s, decode tok/s, hit % and disk busy
# per run, from --stats-json.
# Usage: K3BIN=target/release/k3 SNAP=/tmp/pool-small GB=0.05 ROUNDS=3 NGEN=32 bash lab/unified_pool_lavapipe.sh
# K3BIN is a lab build (`cargo build --release --features lab`): the product binary does not
# read the switches, and every run would be the default.
set -euo pipefail
K3BIN=${K3BIN:-target/release/k3}
grep -q K3_LAB_ "$K3BIN" || { echo "$K3BIN is not a lab build: cargo build --release --features lab" >&2; exit 2; }
SNAP=${SNAP:-/tmp/pool-small}
GB=${GB:-0.05}
ROUNDS=${ROUNDS:-3}
NGEN=${NGEN:-32}
[ -d "$SNAP" ] || "$K3BIN" synth --preset small "$SNAP" >/dev/null
IDS=$(seq -s, 1 48)
OUT=$(mktemp -d)
run() { # name, env...
  local name=$1; shift
  env "$@" "$K3BIN" run "$SNAP" --ids "$IDS" --ngen "$NGEN" --quiet --backend gpu \
    --expert-gb "$GB" --stats-json "$OUT/$name.json" >/dev/null 2>"$OUT/$name.err"
  python3 - "$name" "$OUT/$name.json" <<'PY'
import json, sys
v = json.load(open(sys.argv[2]))
d = v["decode"]
print(f'{sys.argv[1]:10s} prefill {v["prefill_s"]:6.2f} s | decode {v["decode_tok_per_s"]:6.2f} tok/s'
      f' | hit {d["hit_percent"]:5.1f} % | disk busy {v["total"]["disk_busy_s"]:5.2f} s'
      f' | hand-off {v["total"]["expert_handoff_s"]:5.2f} s'
      f' | {v.get("expert_tiers", "?")}')
PY
}
for r in $(seq 1 "$ROUNDS"); do
  echo "round $r"
  run pool K3_LAB_EXPERT_POOL=auto
  run pool-host K3_LAB_EXPERT_POOL=auto K3_LAB_READ_STAGING=off
  run two-tier K3_LAB_EXPERT_POOL=off
done
rm -rf "$OUT"
