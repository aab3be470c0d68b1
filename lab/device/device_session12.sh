#!/usr/bin/env bash
# Session 12's measurements, one device call of about 7 minutes (prepare with
# `PREV=63b2e06 bash lab/device/device_prepare.sh`, session 11's tip as .devbin/k3_prev; run with
# carry [".devbin", ".gl"]):
# 1. bench blocks 32 and 34, twice: the large matvecs split into passes, among them a KDA
#    layer's four int4 12288×7168 projections of one input through `matmul_many` (one shared
#    digit pass), at the default 4 rows a lane and at 2.
# 2. k3slice32 decode, 100 tokens, this k3 against session 11's, alternated twice, with the
#    per-kernel GPU profile: the GPU time the shared digits save, which the wall clock's
#    noise hides.
# Results under $OUT.
set -u
. "$(dirname "$0")/device_vulkan.sh"
D=./.devbin
for r in 1 2; do
    timeout 150 $D/gpu_kernels blocks=32,34 > "$OUT/pass_times_$r.txt" 2>&1
    grep -E "^pass times|^== block" "$OUT/pass_times_$r.txt" | cut -c1-300
done
. "$(dirname "$0")/device_k3slice32.sh"
profile_ab 2 100
