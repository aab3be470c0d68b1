#!/usr/bin/env bash
# Times the WGSL variants of lab/wgsl_variants/ (each a patch against shaders_wgsl/) with
# no rebuild: `gpu_kernels blocks=B wgsl=DIR` composes every kernel from a patched copy.
# The built-in kernels run first and again last, so each variant sits between two
# baselines of the same call. Usage: `bash lab/device/device_variants.sh [BLOCKS] [PATCH...]`
# (default blocks 21, every patch). Prepare with `bash lab/device/device_prepare.sh`, run with
# carry [".devbin", ".gl"]; results under $OUT.
set -u
. "$(dirname "$0")/device_vulkan.sh"
D=./.devbin
B=${1:-21}
shift || true
P=("$@")
[ ${#P[@]} -eq 0 ] && P=(lab/wgsl_variants/*.patch)
keep="^== block|int4 matvec 12288|int4 matvec 163840|mxfp4|moe resident: 16|^order"
run() { # name, extra args
    echo "### $1"
    timeout 200 $D/gpu_kernels "blocks=$B" "${@:2}" > "$OUT/variant_$1.txt" 2>&1
    grep -E "$keep" "$OUT/variant_$1.txt" | cut -c1-150
}
run built_in
for pf in "${P[@]}"; do
    name=$(basename "$pf" .patch)
    T=$(mktemp -d)
    cp -r shaders_wgsl/. "$T"
    if ! patch -s -d "$T" -p2 < "$pf"; then
        echo "### $name: does not apply"
        continue
    fi
    run "$name" "wgsl=$T"
    rm -rf "$T"
done
run built_in_again
