#!/usr/bin/env bash
# The int4 and MXFP4 one-token matvecs written again in CUDA (lab/cuda_probe/), on the
# H200: nvcc builds (registers from -Xptxas -v), each probe's host check and its variants
# timed against the read kernel, the SASS, and Nsight Compute on one launch of each variant
# and shape (the counters come back on the Firecracker machines only; on gVisor ones ncu
# fails and the rest still stands). One call, a few minutes, nothing to prepare here;
# results under $OUT: three files a probe (build and timings, SASS, ncu details).
set -u
cd "$(dirname "$0")/../.."
for probe in int4_matvec mxfp4_matvec; do
    P="$OUT/$probe"
    T="$OUT/probe_$probe.txt"
    nvcc -O3 -arch=sm_90 -Xptxas -v -o "$P" "lab/cuda_probe/$probe.cu" > "$T" 2>&1
    echo "== $probe: nvcc rc $?"
    grep -E "error|Used" "$T" | head -8
    [ -x "$P" ] || continue
    timeout 120 "$P" 2>&1 | tee -a "$T"
    cuobjdump --dump-sass "$P" > "$OUT/sass_$probe.txt" 2>&1
    timeout 240 ncu --clock-control none --set full -k regex:matvec -c 12 -o "$OUT/ncu" "$P" profile \
        > "$OUT/ncu_log.txt" 2>&1
    echo "ncu rc $?: $(tail -2 "$OUT/ncu_log.txt" | tr '\n' ' ' | cut -c1-300)"
    rm -f "$OUT/ncu_log.txt"
    if [ -f "$OUT/ncu.ncu-rep" ]; then
        ncu --import "$OUT/ncu.ncu-rep" --page details > "$OUT/ncu_$probe.txt" 2>&1
        grep -E "matvec<|Memory Throughput|DRAM Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Registers Per|Issue Slots Busy|Warp Cycles|stall|Scoreboard" \
            "$OUT/ncu_$probe.txt" | cut -c1-160 | head -60
        rm -f "$OUT/ncu.ncu-rep"
    fi
    rm -f "$P"
done
