#!/usr/bin/env bash
# Session 9's work that is built but not measured, in one call of about 4 minutes: the
# register counts of the staged kernels and of each lab/wgsl_variants patch
# (device_register_variants.sh); then, two rounds, the bench blocks that compare staged x
# read by unit and by word (`XW`: 21 against 23 in the expert geometry, 3 against 24 for
# int4 DEC 1) and matrices in one buffer against row chunks of 64 MiB (2 against 25, 3
# against 26: the int4 head's per-byte slowness); then block 19 for the KDA lines that
# session 9's filter dropped. Prepare with
# `bash lab/device/device_prepare.sh`, run with carry [".devbin", ".gl"]; results under $OUT.
set -u
bash "$(dirname "$0")/device_register_variants.sh"
. "$(dirname "$0")/device_vulkan.sh"
D=./.devbin
for r in 1 2; do
    timeout 240 $D/gpu_kernels blocks=2,3,21,23,24,25,26 > "$OUT/staged_x_$r.txt" 2>&1
    grep -E "^== block|int4 matvec 12288|int4 matvec 163840|mxfp4|moe resident: 16" "$OUT/staged_x_$r.txt" | cut -c1-140
done
timeout 60 $D/gpu_kernels blocks=19 2>&1 | grep -E "^passes|^kda step" | tee "$OUT/passes.txt"
