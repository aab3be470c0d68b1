#!/usr/bin/env bash
# int4 digits against the f32 decode in the whole model: the k3slice32 model (real
# dimensions, 32 experts a MoE layer, every expert in the VRAM tier after the prompt),
# 400-token runs of `--gpu-int4-decode auto`, `float` and `digits` alternated over two
# rounds (about 6 minutes). 400 tokens, because the H200's clock sits at 345 MHz for the
# first ~0.3 s of a decode (lab/notebook.md, session 10): session 7's 97-token rounds, which
# set `auto`, carried that stretch. PROFILE=1 first runs one profiled 49-token run of float
# and of digits (GPU time per kernel; about 2 minutes more). Prepare with
# lab/device/device_prepare.sh; results land under $OUT.
set -u
. "$(dirname "$0")/device_vulkan.sh"
. "$(dirname "$0")/device_k3slice32.sh"
run() { # int4 decode, generated tokens, extra flags...
    local d=$1 n=$2
    shift 2
    timeout 120 "$K" run "$M" --ids "$IDS" --ngen "$n" --ignore-eos --quiet --backend gpu \
        --expert-gb 60 --gpu-expert-gb 60 --gpu-int4-decode "$d" "$@" 2>&1 > /dev/null
}
if [ "${PROFILE:-0}" = 1 ]; then
    for d in float digits; do
        run "$d" 49 --gpu-profile 1 > "$OUT/profile_$d.txt"
        echo "== profile, int4 $d"
        grep -A12 "profile:" "$OUT/profile_$d.txt" | head -12
        grep -E "^  (dense|x_planes) " "$OUT/profile_$d.txt" | sort -k4 -n -r | head -12
    done
fi
for rep in 1 2; do
    for d in auto float digits; do
        echo "round $rep, int4 $d: $(run "$d" 400 | grep -o 'decode 400 tokens.*tok/s)')"
    done
done | tee "$OUT/rounds.txt"
