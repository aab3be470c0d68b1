#!/usr/bin/env bash
# What NVIDIA's Vulkan compiler makes of WGSL variants (lab/wgsl_variants/*.patch, each a
# diff against shaders_wgsl/): the register counts of the staged MXFP4 expert kernel (x read
# by unit and by word, XW 0 and 1; by unit also without the huge-scale path, SPECIAL 0), the
# same kernel with x from global memory, and the staged int4 DEC 1 kernel (XW 0 and 1),
# built in and then with each variant applied to a copy of shaders_wgsl/
# (`shader_stats --wgsl-dir`, no rebuild).
# One call of about 30 s. Prepare with `bash lab/device/device_prepare.sh`, run with carry
# [".devbin", ".gl"]; results in $OUT/registers.txt. Check a new variant here first:
# `shader_stats --spirv-only --wgsl-dir DIR ...`.
set -u
. "$(dirname "$0")/device_vulkan.sh"
D=./.devbin
E=LPR=8,LW=4,RPL=4
K="matvec_mxfp4:moe_xs:$E,XT=112,XW=0 matvec_mxfp4:moe_xs:$E,XT=112,XW=0,SPECIAL=0 matvec_mxfp4:moe_xs:$E,XT=112,XW=1 matvec_mxfp4:moe:$E
   matvec_int4:dense_xs:LPR=32,RPL=4,DEC=1,XT=224,XW=0 matvec_int4:dense_xs:LPR=32,RPL=4,DEC=1,XT=224,XW=1"
{
    echo "== built in"
    $D/shader_stats $K 2>&1 | grep -E "Register|rror"
    for pf in lab/wgsl_variants/*.patch; do
        T=$(mktemp -d)
        cp -r shaders_wgsl/. "$T"
        if ! patch -s -d "$T" -p2 < "$pf"; then
            echo "== $(basename "$pf" .patch): does not apply"
            continue
        fi
        echo "== $(basename "$pf" .patch)"
        $D/shader_stats --wgsl-dir "$T" $K 2>&1 | grep -E "Register|rror"
        rm -rf "$T"
    done
} | tee "$OUT/registers.txt"
