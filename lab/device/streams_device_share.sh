#!/bin/bash
# Batched decode on the device box, two builds in one call: `k3 bench streams` of k3slice32
# resident for 1, 4 and 8 streams (its throughput table and where a pass's time goes),
# $KOLD (baseline build) and $K alternated over $ROUNDS calls; then $K under `--gpu-profile
# 1` (wall against kernel ms a pass, per-kernel times), what one dispatch costs ($GK: the
# gpu_kernels bench binary, stripped) and the CPU demo on the box's cores. Where perf exists,
# the host's profile of 8 streams ($KSYM: $K with symbols, `objcopy --strip-debug`). Output
# under $OUT.
for f in .gl/*.deb; do dpkg -x $f / >/dev/null; done; ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
K=${K:-./.devbin/k3}; KOLD=${KOLD:-./.devbin/k3_prev}; KSYM=${KSYM:-./.devbin/k3-sym}
GK=${GK:-./.devbin/gpu_kernels}
OUT=${OUT:-/tmp/streams_device_share}; M=/tmp/k3slice32
mkdir -p "$OUT"
[ -f "$M/config.json" ] || timeout 60 "$K" synth --preset k3-slice --layers 4 --experts 32 "$M" >/dev/null 2>&1
bench() { # name binary profile
    echo "== $1 (--gpu-profile $3)"
    timeout 150 "$2" bench streams "$M" --backend gpu --expert-gb 8 --gpu-expert-gb 8 --ngen 32 \
        --streams 1,4,8 --rounds 2 --gpu-profile "$3" > "$OUT/$1-p$3.txt" 2>&1
    grep -E "^\||equal|differ|rror" "$OUT/$1-p$3.txt" | grep -v "^|---"
}
for r in $(seq 1 "${ROUNDS:-1}"); do
    [ -x "$KOLD" ] && bench "old$r" "$KOLD" 0
    bench "new$r" "$K" 0
done
bench new "$K" 1
# FULL=1: the chunk kernel from 8 rows (docs/tuning.md, K3_LAB_CHUNK_FROM) against the matvec a row.
[ "${FULL:-0}" = 1 ] && K3_LAB_CHUNK_FROM=8 bench new-chunk8 "$K" 0
[ -x "$GK" ] && for i in 1 2; do timeout 60 "$GK" dispatch-chain 2>&1 | grep "add 1x"; done
echo "== cpu demo"
timeout 60 "$K" bench streams --demo --backend cpu --streams 1,4,8 --ngen 64 --rounds 3 2>&1 | grep -E "^\||equal" | grep -v "^|---"
if command -v perf >/dev/null && [ -x "$KSYM" ]; then
    perf record -F 2000 -g -o /tmp/perf.data "$KSYM" bench streams "$M" --backend gpu --expert-gb 8 \
        --gpu-expert-gb 8 --ngen 64 --streams 8 --rounds 1 2>&1 | grep "^|"
    perf report -i /tmp/perf.data --no-children --sort sym --stdio 2>/dev/null | grep "%" | head -40
else
    echo "no perf here"
fi
