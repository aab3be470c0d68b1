#!/usr/bin/env bash
# Decode on the GPU with every expert in VRAM (one device call, about 4 minutes): a k3-slice
# model with real dimensions but 32 experts a MoE layer (the prompt's prefill loads them all
# into the VRAM tier), first profiled (`--gpu-profile 1`: GPU time per kernel and grid, for
# 1 and for 49 generated tokens, so their difference is 48 decode steps), then plain runs for
# tok/s, submitting at readbacks only (4096, the default) and every 4 passes, alternated over
# three rounds. Prepare with lab/device/device_prepare.sh; results land under $OUT.
set -u
. "$(dirname "$0")/device_vulkan.sh"
. "$(dirname "$0")/device_k3slice32.sh"
run() { # generated tokens, extra flags...
    local n=$1
    shift
    timeout 100 "$K" run "$M" --ids "$IDS" --ngen "$n" --ignore-eos --quiet --backend gpu \
        --expert-gb 60 --gpu-expert-gb 60 "$@" 2>&1 > /dev/null
}
for n in 1 49; do
    run "$n" --gpu-profile 1 > "$OUT/profile_$n.txt"
    echo "== profile, $n generated"
    grep -A45 "profile:" "$OUT/profile_$n.txt" | head -45
done
for rep in 1 2 3; do
    for s in 4096 4; do
        echo "round $rep, submit every $s: $(run 49 --gpu-submit-every "$s" | grep -o 'decode 49 tokens.*tok/s)')"
    done
done
