#!/bin/bash
# Two builds side by side on several streams: $K against $KOLD alternated over $ROUNDS calls
# of `k3 bench streams` of k3slice32 resident (1, 4 and 8 streams), then the CPU demo (`tiny`,
# the box's cores, --ngen $CPU_NGEN) alternated the same way. Output under $OUT.
#   usage: ROUNDS=3 bash lab/device/streams_ab.sh
for f in .gl/*.deb; do dpkg -x $f / >/dev/null; done; ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
K=${K:-./.devbin/k3}; KOLD=${KOLD:-./.devbin/k3_prev}
OUT=${OUT:-/tmp/streams_ab}; M=/tmp/k3slice32
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader
[ -f "$M/config.json" ] || timeout 60 "$K" synth --preset k3-slice --layers 4 --experts 32 "$M" >/dev/null 2>&1
for r in $(seq 1 "${ROUNDS:-1}"); do
    for b in "$KOLD" "$K"; do
        echo "== $b round $r"
        timeout 150 "$b" bench streams "$M" --backend gpu --expert-gb 8 --gpu-expert-gb 8 \
            --ngen 32 --streams 1,4,8 --rounds 2 2>&1 | grep -E "^\| [0-9]|differ|rror"
    done
done > "$OUT/gpu.txt"
cat "$OUT/gpu.txt"
for r in $(seq 1 "${ROUNDS:-1}"); do
    for b in "$KOLD" "$K"; do
        echo "== $b round $r ($(nproc) cores)"
        timeout 100 "$b" bench streams --demo --backend cpu --streams 1,4,8 --ngen "${CPU_NGEN:-512}" \
            --rounds 3 2>&1 | grep -E "^\| [0-9]|differ|rror" | head -4
    done
done > "$OUT/cpu.txt"
cat "$OUT/cpu.txt"
