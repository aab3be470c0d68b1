#!/bin/bash
# Where a resident batched decode step's time goes (docs/perf.md, "Several streams in one
# pass"): k3slice32 with every expert in VRAM, `k3 bench streams` for the binaries $K (new)
# and $KOLD (baseline, when present) in the same call, $K with the few-token expert kernel
# on (T4=0 skips it) and at each chunk threshold of $CHUNK_FROM, then per-kernel GPU time
# (`--gpu-profile 1`) of 8 streams together (PROFILE1=1: of one stream too). Output under $OUT.
set -u
K=${K:-./.devbin/k3-serve}
KOLD=${KOLD:-./.devbin/k3-old}
OUT=${OUT:-/tmp/streams_profile_out}
NGEN=${NGEN:-32}
mkdir -p "$OUT"
M32=/tmp/k3slice32
[ -f "$M32/config.json" ] || timeout 60 "$K" synth --preset k3-slice --layers 4 --experts 32 "$M32" > "$OUT/synth32.txt" 2>&1
bench() { # name binary extra-args...
    local name=$1 bin=$2; shift 2
    echo "== $name"
    timeout 150 "$bin" bench streams "$M32" --backend gpu --expert-gb 8 --gpu-expert-gb 8 \
        --ngen "$NGEN" "$@" 2>&1 | tee "$OUT/$name.txt" | grep -v "^\[K3\] \(load\|weights\)"
}
[ -x "$KOLD" ] && bench old "$KOLD" --streams 1,4,8 --rounds 2
bench new "$K" --streams 1,4,8 --rounds 2
# The few-token expert kernel (docs/tuning.md, K3_LAB_FEW_TOKEN_EXPERTS) against the default.
[ "${T4:-1}" = 1 ] && K3_LAB_FEW_TOKEN_EXPERTS=on bench t4 "$K" --streams 1,4,8 --rounds 2
for c in ${CHUNK_FROM:-}; do K3_LAB_CHUNK_FROM=$c bench "chunk$c" "$K" --streams 1,4,8 --rounds 1; done
if [ "${PROFILE:-1}" = 1 ]; then
    [ "${PROFILE1:-0}" = 1 ] && bench prof1 "$K" --streams 1 --rounds 1 --gpu-profile 1
    bench prof8 "$K" --streams 8 --rounds 1 --gpu-profile 1
fi
