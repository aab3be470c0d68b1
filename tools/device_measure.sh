#!/usr/bin/env bash
# The device calls that take every figure docs/perf.md and docs/tuning.md report. With no
# argument (about 9 minutes, under the 10-minute call limit): the GPU op tests under
# CI=true, the kernel benchmark, the k3-slice model (synthesized on the device's disk), its
# greedy tokens on the GPU (to compare with the CPU's), and the GPU streaming sweep with the
# VRAM tier off and small. With `cpu` (make that call right after, while the machine and its
# model are still there; it synthesizes the model again otherwise): the CPU backend's sweep.
# Results land under $OUT. Prepare with tools/device_prepare.sh. Prefill end to end (the
# chunk kernel on and off) is tools/device_prefill.sh, a separate call.
set -u
. "$(dirname "$0")/device_vulkan.sh"
K=./.devbin/k3
M=/tmp/k3slice
if [ "${1:-}" = cpu ]; then
    [ -f "$M/config.json" ] || "$K" synth --preset k3-slice --layers 4 "$M" > "$OUT/synth.txt" 2>&1
    timeout 500 "$K" bench decode "$M" --backend cpu --expert-gb-list 0,16 --runs 2 --ngen 6 \
        --out "$OUT/sweep_cpu" --quiet > "$OUT/decode_cpu.md" 2> "$OUT/decode_cpu.err"
    echo "== CPU sweep"
    cat "$OUT/decode_cpu.md"
    exit 0
fi
"$K" devices > "$OUT/devices.txt" 2>&1
( "$K" synth --preset k3-slice --layers 4 "$M" > "$OUT/synth.txt" 2>&1 ) &
SYNTH=$!
CI=true timeout 120 ./.devbin/gpu_ops > "$OUT/gpu_ops.txt" 2>&1
grep -E "test result|FAILED|panicked" "$OUT/gpu_ops.txt" | head -5
wait "$SYNTH"
tail -1 "$OUT/synth.txt"
# Benchmarks after the synth: it loads the disk and the CPUs. Block 1 (every kernel at its
# default) and the chunk blocks 9-11: with the heater before each line (session 10) all 29
# blocks no longer fit the call; the variant blocks have their own scripts.
timeout 240 ./.devbin/gpu_kernels blocks=1,9,10,11 > "$OUT/kernels.txt" 2>&1
grep -E "==|mxfp4 matvec|moe resident: 16 experts x (1|32)|int[48] matvec 12288x7168, (1|32|512) |kda|mla" "$OUT/kernels.txt" | cut -c1-130
P8="163584,1000,2000,3000,4000,5000,6000,7000"
"$K" run "$M" --ids "$P8" --ngen 6 --ignore-eos --quiet --backend gpu --expert-gb 60 --gpu-expert-gb 60 \
    > "$OUT/gpu_ids.txt" 2> "$OUT/gpu_ids.err"
echo "gpu greedy ids: $(cat "$OUT/gpu_ids.txt") (CPU, session 1-3: 18567,32176,151879,12370,65656,95)"
for tier in 0 2; do
    timeout 200 "$K" bench decode "$M" --backend gpu --gpu-expert-gb "$tier" --expert-gb-list 0,16 \
        --runs 2 --ngen 6 --out "$OUT/sweep_tier$tier" --quiet > "$OUT/decode_tier$tier.md" 2> "$OUT/decode_tier$tier.err"
    echo "== GPU sweep, VRAM tier $tier GB"
    cat "$OUT/decode_tier$tier.md"
done
