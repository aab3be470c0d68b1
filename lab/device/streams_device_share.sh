#!/bin/bash
# Batched decode on the device box, builds and switches in one call: wall against kernel time
# a pass (`k3 bench streams`, last column under `--gpu-profile 1`) for 1, 4 and 8 streams of
# k3slice32 resident. $KOLD (baseline build), $K with K3_LAB_PASS_PER_DISPATCH=on (a compute
# pass per dispatch, as before the shared pass) and $K as is, alternated over $ROUNDS calls;
# then the profile of $K and the CPU demo. Where perf exists, the host's profile of 8 streams ($KSYM: $K with
# symbols, `objcopy --strip-debug`). Output under $OUT.
for f in .gl/*.deb; do dpkg -x $f / >/dev/null; done; ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
K=${K:-./.devbin/k3-serve}; KOLD=${KOLD:-./.devbin/k3-old}; KSYM=${KSYM:-./.devbin/k3-sym}
OUT=${OUT:-/tmp/streams_device_share}; M=/tmp/k3slice32
mkdir -p "$OUT"
[ -f "$M/config.json" ] || timeout 60 "$K" synth --preset k3-slice --layers 4 --experts 32 "$M" >/dev/null 2>&1
bench() { # name binary profile
    echo "== $1 (--gpu-profile $3)"
    timeout 150 "$2" bench streams "$M" --backend gpu --expert-gb 8 --gpu-expert-gb 8 --ngen 32 \
        --streams 1,4,8 --rounds 2 --gpu-profile "$3" > "$OUT/$1-p$3.txt" 2>&1
    grep -E "^\||equal|differ|rror" "$OUT/$1-p$3.txt"
}
for r in $(seq 1 "${ROUNDS:-1}"); do
    [ -x "$KOLD" ] && bench "old$r" "$KOLD" 0
    K3_LAB_PASS_PER_DISPATCH=on bench "ppd$r" "$K" 0
    bench "new$r" "$K" 0
done
bench new "$K" 1
# FULL=1: the per-dispatch pass under the profile and the chunk kernel from 8 rows.
if [ "${FULL:-0}" = 1 ]; then
    K3_LAB_PASS_PER_DISPATCH=on bench ppd "$K" 1
    # The chunk kernel from 8 rows (docs/tuning.md, K3_LAB_CHUNK_FROM) against the matvec a row.
    K3_LAB_CHUNK_FROM=8 bench new-chunk8 "$K" 0
fi
# Host and wall cost of a dispatch, a pass each against the shared pass ($GK: the
# gpu_kernels bench binary of the same tip, stripped).
GK=${GK:-./.devbin/gpu_kernels}
if [ -x "$GK" ]; then
    for m in on off on off; do
        echo -n "pass per dispatch $m: "
        K3_LAB_PASS_PER_DISPATCH=$m timeout 60 "$GK" dispatch-chain 2>&1 | grep "add 1x"
    done
fi
# The CPU demo on this box's cores, for the CPU row of the same table.
echo "== cpu demo"
timeout 60 "$K" bench streams --demo --backend cpu --streams 1,4,8 --ngen 64 --rounds 3 2>&1 | grep -E "^\||equal"
if command -v perf >/dev/null && [ -x "$KSYM" ]; then
    perf record -F 2000 -g -o /tmp/perf.data "$KSYM" bench streams "$M" --backend gpu --expert-gb 8 \
        --gpu-expert-gb 8 --ngen 64 --streams 8 --rounds 1 2>&1 | grep "^|"
    perf report -i /tmp/perf.data --no-children --sort sym --stdio 2>/dev/null | grep "%" | head -40
else
    echo "no perf here"
fi
