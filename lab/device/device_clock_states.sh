#!/usr/bin/env bash
# Runs `gpu_kernels blocks=BLOCKS` twice while nvidia-smi samples the P-state, SM and memory
# clocks, power, utilization and clock-event reasons every 50 ms, to tell a kernel's speed
# from the clock it ran at. The H200 under Vulkan drops to 345 MHz within seconds of light
# use (block 29 shows it; the bench now heats the GPU before each line, K3_BENCH_HEAT=0
# turns that off). The `order:`, `state:` and `clock:` lines carry Unix times to match the
# samples. Usage: `bash lab/device/device_clock_states.sh BLOCKS [more gpu_kernels args]`.
# Prepare with `bash lab/device/device_prepare.sh`, run with carry [".devbin", ".gl"]; results
# under $OUT.
set -u
. "$(dirname "$0")/device_vulkan.sh"
D=./.devbin
B=${1:-27}
shift || true
nvidia-smi -q -d PERFORMANCE,CLOCK,POWER > "$OUT/smi_before.txt" 2>&1
nvidia-smi --query-gpu=timestamp,pstate,clocks.sm,clocks.mem,power.draw,utilization.gpu,clocks_event_reasons.active \
    --format=csv,noheader -lms 50 > "$OUT/smi_samples.csv" 2>&1 &
SMI=$!
for r in 1 2; do
    date +%s.%N
    timeout 280 $D/gpu_kernels "blocks=$B" "$@" > "$OUT/clock_states_$r.txt" 2>&1
    grep -E "^== block|^order|^state|^clock|int4 matvec 12288|int4 matvec 163840|mxfp4|moe resident: 16|^kda|^mla" \
        "$OUT/clock_states_$r.txt" | cut -c1-150
done
kill $SMI
echo "samples: $(wc -l < "$OUT/smi_samples.csv")"
cut -d, -f2-4,7 "$OUT/smi_samples.csv" | sort | uniq -c | sort -rn | head -8
