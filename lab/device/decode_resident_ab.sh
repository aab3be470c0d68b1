#!/usr/bin/env bash
# Decode with every expert in VRAM (docs/perf.md, "Decode resident"): k3slice32, $NGEN tokens
# (400), .devbin/k3 against .devbin/k3_prev alternated over $ROUNDS rounds (3). Prepare the
# binaries with lab/device/device_prepare.sh; output under $OUT.
set -u
OUT=${OUT:-/tmp/decode_resident_ab}
mkdir -p "$OUT"
. "$(dirname "$0")/device_vulkan.sh"
. "$(dirname "$0")/device_k3slice32.sh"
decode_ab "${ROUNDS:-3}" "${NGEN:-400}"
