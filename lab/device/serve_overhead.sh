#!/bin/bash
# k3 serve's overhead on the device box: tools/bench_serve.py (streaming /v1/chat/completions
# against `k3 run`, same model and prompt, rounds alternating; decode rates only) on k3-slice with 4 layers and
# 32 experts a MoE layer, CPU backend (all cores) then GPU backend. Binary: $K (default
# .devbin/k3-serve, carried). Output under $OUT.
set -u
K=${K:-./.devbin/k3-serve}
M=/tmp/k3slice32
OUT=${OUT:-/tmp/serve_out}
mkdir -p "$OUT"
{ nproc; python3 --version; } > "$OUT/machine.txt" 2>&1
t0=$(date +%s)
[ -f "$M/config.json" ] || timeout 60 "$K" synth --preset k3-slice --layers 4 --experts 32 "$M" > "$OUT/synth.txt" 2>&1
echo "synth done after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/log.txt"
FLAGS_CPU="--backend cpu --expert-gb 8"
timeout ${CPU_S:-90} python3 tools/bench_serve.py "$M" --k3 "$K" --ngen ${NGEN:-48} --rounds 2 \
    --flags "$FLAGS_CPU" --no-ttft 2>&1 | tail -25 | sed 's/^/cpu: /' | tee -a "$OUT/log.txt"
echo "cpu done after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/log.txt"
FLAGS_GPU="--backend gpu --expert-gb 8 --gpu-expert-gb 8"
timeout ${GPU_S:-60} python3 tools/bench_serve.py "$M" --k3 "$K" --ngen ${NGEN_GPU:-64} --rounds 2 \
    --flags "$FLAGS_GPU" --no-ttft 2>&1 | tail -25 | sed 's/^/gpu: /' | tee -a "$OUT/log.txt"
echo "gpu done after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/log.txt"
