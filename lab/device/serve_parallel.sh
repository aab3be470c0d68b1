#!/bin/bash
# Several clients at once (issue 44) on the device box: lab/device/serve_parallel.py on k3-slice
# with 4 layers and 32 experts a MoE layer, GPU backend with every expert in VRAM, then CPU:
# 1, 4 and 8 concurrent greedy streams' aggregate tok/s, and a short chat's TTFT while a 16k
# prompt prefills, under --parallel 8 and --parallel 1. Binary: $K (default .devbin/k3-serve,
# carried). Output under $OUT.
set -u
K=${K:-./.devbin/k3-serve}
M=/tmp/k3slice32
OUT=${OUT:-/tmp/serve_parallel_out}
mkdir -p "$OUT"
{ nproc; python3 --version; } > "$OUT/machine.txt" 2>&1
[ -f "$M/config.json" ] || timeout 60 "$K" synth --preset k3-slice --layers 4 --experts 32 "$M" > "$OUT/synth.txt" 2>&1
timeout ${GPU_S:-300} python3 lab/device/serve_parallel.py "$M" --k3 "$K" --parallel 8 --streams 1,4,8 \
    --ngen ${NGEN:-64} --words 16000 --context 32768 \
    --flags "--backend gpu --expert-gb 8 --gpu-expert-gb 8" 2>&1 | sed 's/^/gpu: /' | tee -a "$OUT/log.txt"
timeout ${CPU_S:-240} python3 lab/device/serve_parallel.py "$M" --k3 "$K" --parallel 4 --streams 1,4 \
    --ngen ${NGEN:-32} --words 4000 --context 32768 \
    --flags "--backend cpu --expert-gb 8" 2>&1 | sed 's/^/cpu: /' | tee -a "$OUT/log.txt"
