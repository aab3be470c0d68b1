#!/usr/bin/env bash
# Session 12's second call (prepare with `PREV=63b2e06 bash lab/device/device_prepare.sh`; carry
# [".devbin", ".gl"]): the engine's defaults after the digit decode took 2 rows a lane and
# int4 matrices of one input began sharing their digit pass:
# 1. bench block 32 (passes; the int4 head and four 12288-row matrices of one x) and block 2
#    (every one-token kernel's % of read), once each;
# 2. k3slice32 decode, 100 tokens, this k3 against session 11's, with the per-kernel GPU
#    profile, alternated twice.
set -u
. "$(dirname "$0")/device_vulkan.sh"
D=./.devbin
timeout 150 $D/gpu_kernels blocks=32 > "$OUT/pass_times.txt" 2>&1
grep -E "^pass times" "$OUT/pass_times.txt" | cut -c1-300
timeout 200 $D/gpu_kernels blocks=2 > "$OUT/block2.txt" 2>&1
grep -E "int4|mxfp4|MXFP4|int8|MoE" "$OUT/block2.txt" | cut -c1-200 | head -30
. "$(dirname "$0")/device_k3slice32.sh"
profile_ab 2 100
