#!/usr/bin/env bash
# Prefill on the GPU end to end (one device call, a few minutes): a k3-slice model with real
# dimensions but 32 experts per layer (so every expert sits in the VRAM tier and the figure
# is compute, not disk), a 256-token prompt in chunks of 128, with the chunk kernel off
# (K3_GPU_CHUNK_FROM=0: one matvec per token) and on (the default), and token by token
# (--chunk 1). Prints prefill seconds from --stats-json and the greedy ids of each run.
# Prepare with lab/device/device_prepare.sh; results land under $OUT.
set -u
. "$(dirname "$0")/device_vulkan.sh"
K=./.devbin/k3
M=/tmp/k3slice32
[ -f "$M/config.json" ] || "$K" synth --preset k3-slice --layers 4 --experts 32 "$M" > "$OUT/synth32.txt" 2>&1
tail -1 "$OUT/synth32.txt"
IDS=$(seq -s, 1000 97 25800)
run() { # name, chunk-from, chunk
    K3_GPU_CHUNK_FROM=$2 timeout 300 "$K" run "$M" --ids "$IDS" --ngen 4 --ignore-eos --quiet \
        --backend gpu --chunk "$3" --expert-gb 60 --gpu-expert-gb 60 \
        --stats-json "$OUT/$1.json" > "$OUT/$1.ids" 2> "$OUT/$1.err"
    echo "$1: prefill_s $(grep -o '"prefill_s": *[0-9.e-]*' "$OUT/$1.json" | grep -o '[0-9.e-]*$') ids $(cat "$OUT/$1.ids")"
}
run warmup 16 128
for rep in 1 2; do
    run "matvec_c128_$rep" 0 128
    run "chunk_c128_$rep" 16 128
done
run token_by_token 16 1
