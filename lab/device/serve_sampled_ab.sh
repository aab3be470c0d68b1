#!/bin/bash
# Sampled streams through `k3 serve` on the device box, two builds alternated: $K against
# $KOLD, $ROUNDS rounds of lab/device/serve_parallel.py --aggregate-only on k3slice32 resident
# (GPU, every expert in VRAM), --parallel 8, 1, 4 and 8 concurrent chats at temperature
# $TEMP (no top-k, no top-p: the whole vocabulary ranked a token). Output under $OUT.
#   usage: ROUNDS=2 bash lab/device/serve_sampled_ab.sh
for f in .gl/*.deb; do dpkg -x $f / >/dev/null; done; ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
K=${K:-./.devbin/k3}; KOLD=${KOLD:-./.devbin/k3_prev}
OUT=${OUT:-/tmp/serve_sampled_ab}; M=/tmp/k3slice32
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader
nproc
[ -f "$M/config.json" ] || timeout 60 "$K" synth --preset k3-slice --layers 4 --experts 32 "$M" >/dev/null 2>&1
for r in $(seq 1 "${ROUNDS:-1}"); do
    for b in "$KOLD" "$K"; do
        echo "== $b round $r"
        timeout 150 python3 lab/device/serve_parallel.py "$M" --k3 "$b" --parallel 8 \
            --streams 1,4,8 --ngen "${NGEN:-32}" --temperature "${TEMP:-1}" --aggregate-only \
            --flags "--backend gpu --expert-gb 8 --gpu-expert-gb 8" 2>&1 | tail -3
    done
done | tee "$OUT/serve.txt"
