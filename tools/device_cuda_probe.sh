#!/usr/bin/env bash
# The int4 matvec written again in CUDA (tools/cuda_probe/int4_matvec.cu), on the H200: nvcc
# build (registers from -Xptxas -v), the timed variants against the read kernel, the SASS,
# and Nsight Compute on one launch of each variant and shape (the hardware counters come
# back on the Firecracker machines only; on gVisor ones ncu fails and the rest still
# stands). One call, a few minutes, nothing to prepare here; results under $OUT.
set -u
cd "$(dirname "$0")/.."
P="$OUT/int4_probe"
nvcc -O3 -arch=sm_90 -Xptxas -v -o "$P" tools/cuda_probe/int4_matvec.cu > "$OUT/build.txt" 2>&1
echo "nvcc rc $?"
grep -E "error|Used" "$OUT/build.txt" | head -12
[ -x "$P" ] || exit 1
timeout 120 "$P" | tee "$OUT/probe.txt"
cuobjdump --dump-sass "$P" > "$OUT/sass.txt" 2>&1
timeout 300 ncu --clock-control none --set full -k regex:int4_mv -c 8 -o "$OUT/ncu" "$P" profile > "$OUT/ncu_log.txt" 2>&1
echo "ncu rc $?: $(tail -2 "$OUT/ncu_log.txt" | tr '\n' ' ')"
if [ -f "$OUT/ncu.ncu-rep" ]; then
    ncu --import "$OUT/ncu.ncu-rep" --page details > "$OUT/ncu_details.txt" 2>&1
    grep -E "int4_mv|Memory Throughput|DRAM Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Registers Per|Issue Slots Busy|Warp Cycles|stall|Scoreboard" "$OUT/ncu_details.txt" | head -60
    rm -f "$OUT/ncu.ncu-rep"
fi
rm -f "$P"
