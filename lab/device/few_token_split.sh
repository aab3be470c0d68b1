#!/bin/bash
# The few-token kernel's row segments: $K against $KOLD (the build before) alternated over
# $ROUNDS calls of `k3 bench streams` of k3slice32 resident, then $K under --gpu-profile 1
# (a kernel table per case), then the gpu_kernels few-token cases of both builds
# ($GK, $GKOLD). Output under $OUT, at most 8 files.
#   usage: ROUNDS=2 bash lab/device/few_token_split.sh
for f in .gl/*.deb; do dpkg -x $f / >/dev/null; done; ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
K=${K:-./.devbin/k3}; KOLD=${KOLD:-./.devbin/k3_prev}
GK=${GK:-./.devbin/gpu_kernels}; GKOLD=${GKOLD:-./.devbin/gpu_kernels_prev}
OUT=${OUT:-/tmp/few_token_split}; M=/tmp/k3slice32
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader
[ -f "$M/config.json" ] || timeout 60 "$K" synth --preset k3-slice --layers 4 --experts 32 "$M" >/dev/null 2>&1
bench() { # binary profile
    timeout 150 "$1" bench streams "$M" --backend gpu --expert-gb 8 --gpu-expert-gb 8 \
        --ngen 32 --streams 1,4,8 --rounds 2 --gpu-profile "$2" 2>&1
}
for r in $(seq 1 "${ROUNDS:-1}"); do
    for b in "$KOLD" "$K"; do
        echo "== $b round $r"
        bench "$b" 0 | grep -E "^\| [0-9]|differ|rror"
    done
done > "$OUT/streams.txt"
cat "$OUT/streams.txt"
bench "$K" 1 > "$OUT/profile.txt"
grep -E "^\| [0-9]" "$OUT/profile.txt"
for b in "$GKOLD" "$GK"; do
    echo "== $b"
    timeout 200 "$b" int8-head-8-tokens int4-kda-projections-4-tokens int4-kda-projections-8-tokens \
        int4-7168x7168-4-tokens int4-7168x7168-8-tokens int4-1536x7168-8-tokens \
        int4-3072x7168-8-tokens 2>&1 | grep -E "token"
done > "$OUT/kernels.txt" 2>&1
cat "$OUT/kernels.txt"
