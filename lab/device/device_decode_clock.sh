#!/usr/bin/env bash
# The SM clock during a whole-token decode: k3slice32 (lab/device/device_decode.sh's model, every
# expert in VRAM), NGEN generated tokens (default 97) ROUNDS times (default 3), while
# nvidia-smi samples the clocks every 50 ms. The H200 under Vulkan falls to 345 MHz within
# seconds of light use and needs 0.1-0.5 s of sustained work to climb back (bench block 29),
# so a decode whose GPU idles between kernels may run them at the low clock. Prepare with
# lab/device/device_prepare.sh, run with carry [".devbin", ".gl"]; results under $OUT.
set -u
. "$(dirname "$0")/device_vulkan.sh"
. "$(dirname "$0")/device_k3slice32.sh"
nvidia-smi --query-gpu=timestamp,pstate,clocks.sm,clocks.mem,power.draw,utilization.gpu,clocks_event_reasons.active \
    --format=csv,noheader -lms 50 > "$OUT/smi_decode.csv" 2>&1 &
SMI=$!
for r in $(seq 1 "${ROUNDS:-3}"); do
    echo "start $r: $(date +%H:%M:%S.%N)"
    timeout 120 "$K" run "$M" --ids "$IDS" --ngen "${NGEN:-97}" --ignore-eos --quiet --backend gpu \
        --expert-gb 60 --gpu-expert-gb 60 "$@" 2>&1 > /dev/null | grep -E "decode|prefill" | tee "$OUT/decode_$r.txt"
    echo "end $r: $(date +%H:%M:%S.%N)"
done
kill $SMI
echo "clock samples (P-state, SM, memory, reasons):"
cut -d, -f2-4,7 "$OUT/smi_decode.csv" | sort | uniq -c | sort -rn | head -10
