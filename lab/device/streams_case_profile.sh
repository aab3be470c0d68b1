#!/bin/bash
# Where a batched resident step's kernel time goes, case by case: k3slice32 resident,
# `k3 bench streams --streams 1,4,8 --gpu-profile 1` (a kernel table per case), then the
# few-token expert kernel (`K3_LAB_FEW_TOKEN_EXPERTS`) off against on alternated unprofiled,
# then the CPU demo at several thread counts. Output under $OUT.
#   usage: ROUNDS=2 bash lab/device/streams_case_profile.sh
for f in .gl/*.deb; do dpkg -x $f / >/dev/null; done; ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
K=${K:-./.devbin/k3}; OUT=${OUT:-/tmp/case_profile}; M=/tmp/k3slice32
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader
lscpu | grep -E "^CPU\(s\)|Thread|Core|Socket|Model name" > "$OUT/lscpu.txt"
[ -f "$M/config.json" ] || timeout 60 "$K" synth --preset k3-slice --layers 4 --experts 32 "$M" >/dev/null 2>&1
bench() { # name experts-switch profile
    K3_LAB_FEW_TOKEN_EXPERTS=$2 timeout 150 "$K" bench streams "$M" --backend gpu --expert-gb 8 \
        --gpu-expert-gb 8 --ngen 32 --streams 1,4,8 --rounds 1 --gpu-profile "$3" > "$OUT/$1.txt" 2>&1
    echo "== $1"; grep -E "^\| [0-9]|equal|differ|rror" "$OUT/$1.txt"
}
bench prof-off off 1
bench prof-on on 1
for r in $(seq 1 "${ROUNDS:-1}"); do
    bench "off$r" off 0
    bench "on$r" on 0
done
for t in 1 4 8 16; do
    timeout 60 "$K" bench streams --demo --backend cpu --threads $t --streams 1,4,8 --ngen 64 \
        --rounds 3 > "$OUT/cpu-t$t.txt" 2>&1
    echo "== cpu --threads $t"; grep -E "^\| [0-9]" "$OUT/cpu-t$t.txt" | head -4
done
