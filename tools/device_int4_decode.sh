#!/usr/bin/env bash
# int4 digits against the f32 decode in the whole model (one device call, about 5 minutes):
# the k3slice32 model (real dimensions, 32 experts a MoE layer, every expert in the VRAM
# tier after the prompt), one profiled 49-token run each (GPU time per kernel), then plain
# 97-token runs alternated over three rounds, f32 first. Prepare with
# tools/device_prepare.sh; results land under $OUT.
set -u
. "$(dirname "$0")/device_vulkan.sh"
K=./.devbin/k3
M=/tmp/k3slice32
[ -f "$M/config.json" ] || "$K" synth --preset k3-slice --layers 4 --experts 32 "$M" > /dev/null 2>&1
IDS=$(seq -s, 1000 97 2000)
run() { # int4 decode, generated tokens, extra flags...
    local d=$1 n=$2
    shift 2
    timeout 100 "$K" run "$M" --ids "$IDS" --ngen "$n" --ignore-eos --quiet --backend gpu \
        --expert-gb 60 --gpu-expert-gb 60 --gpu-int4-decode "$d" "$@" 2>&1 > /dev/null
}
for d in float digits; do
    run "$d" 49 --gpu-profile 1 > "$OUT/profile_$d.txt"
    echo "== profile, int4 $d"
    grep -A12 "profile:" "$OUT/profile_$d.txt" | head -12
    grep -E "^  (dense|x_planes) " "$OUT/profile_$d.txt" | sort -k4 -n -r | head -12
done
for rep in 1 2 3; do
    for d in float digits; do
        echo "round $rep, int4 $d: $(run "$d" 97 | grep -o 'decode 97 tokens.*tok/s)')"
    done
done | tee "$OUT/rounds.txt"
