#!/usr/bin/env bash
# K3_IDOT measurements on the device machine: the CPU's SIMD flags, the one-core matvec
# bench (every format and level against a plain read, and the integer-dot rows), then one
# side-by-side round with the C engine (k3 exact and K3_IDOT=1). Binaries carried in
# .devbin/: k3-idot, matvec-idot (the bench executable), kimi_k3 (built outside the repo).
#   usage: bash lab/device/cpu_idot.sh [ROUNDS] [PROMPT_TOKENS] [NGEN]
set -u
echo "flags: $(grep -m1 -o 'avx512[a-z_0-9]*\|avx_vnni\|avx2' /proc/cpuinfo | sort -u | tr '\n' ' ')"
echo "flags: $(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -E 'avx512|vnni' | sort -u | tr '\n' ' ')"
[ "${SKIP_BENCH:-0}" = 1 ] || .devbin/matvec-idot --bench 2>&1 | tail -40
K3BIN=k3-idot bash lab/device/cpu_side_by_side.sh "${1:-1}" "${2:-64}" "${3:-32}"
