#!/bin/bash
# The few-token dense kernel (`dense_few`) on the device box, one binary, switch on against
# off (`K3_LAB_FEW_TOKEN_DENSE=off`, one matvec a row) alternated over $ROUNDS calls of
# `k3 bench streams` of k3slice32 resident (1, 4 and 8 streams); then on under
# `--gpu-profile 1` (per-kernel times), and the CPU demo on the box's cores, $K against
# $KOLD (the build before) alternated. Output under $OUT.
#   usage: ROUNDS=2 bash lab/device/few_token_dense.sh
for f in .gl/*.deb; do dpkg -x $f / >/dev/null; done; ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
K=${K:-./.devbin/k3}; KOLD=${KOLD:-./.devbin/k3_prev}
OUT=${OUT:-/tmp/few_token_dense}; M=/tmp/k3slice32
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader
GK=${GK:-./.devbin/gpu_kernels}
if [ -x "$GK" ]; then
    for r in 1 2; do
        for sw in off on; do
            echo "== gpu_kernels, few-token dense $sw"
            K3_LAB_FEW_TOKEN_DENSE=$sw timeout 120 "$GK" int8-head int8-head-4-tokens int8-head-8-tokens \
                int4-kda-projections int4-kda-projections-4-tokens int4-kda-projections-8-tokens \
                int4-1536x7168 int4-1536x7168-8-tokens 2>&1 | grep -E "token"
        done
    done
fi
[ -f "$M/config.json" ] || timeout 60 "$K" synth --preset k3-slice --layers 4 --experts 32 "$M" >/dev/null 2>&1
bench() { # name switch profile
    echo "== $1 (few-token dense $2, --gpu-profile $3)"
    K3_LAB_FEW_TOKEN_DENSE=$2 timeout 150 "$K" bench streams "$M" --backend gpu --expert-gb 8 \
        --gpu-expert-gb 8 --ngen 32 --streams 1,4,8 --rounds 2 --gpu-profile "$3" > "$OUT/$1-p$3.txt" 2>&1
    grep -E "^\||equal|differ|rror" "$OUT/$1-p$3.txt" | grep -v "^|---"
}
for r in $(seq 1 "${ROUNDS:-1}"); do
    bench "off$r" off 0
    bench "on$r" on 0
done
bench on on 1
grep -E "dense_few|dense_xs|dense |dense_cs|moe_xs|kda|mla" "$OUT/on-p1.txt" | head -30
echo "== cpu demo ($(nproc) cores)"
for r in 1 2; do
    for b in "$KOLD" "$K"; do
        echo "-- $b"
        timeout 60 "$b" bench streams --demo --backend cpu --streams 1,4,8 --ngen 64 --rounds 3 2>&1 \
            | grep -E "^\||equal" | grep -v "^|---" | grep -E "together|one at a time|equal" | head -5
    done
done
