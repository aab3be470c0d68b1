#!/usr/bin/env bash
# The prefetch gate against prefetch off and prefetch on every pass (`--prefetch on`,
# `off`, `always`), k3 GPU and CPU, on the k3-slice snapshot (4 layers, 256 experts a MoE
# layer, random routing), 2 GB host expert cache, in alternated rounds: first with O_DIRECT
# reads from the device's virtual disk, then re-reading experts from the page cache (the
# fast-SSD stand-in). Runs lab/device/decode_side_by_side.sh with those run kinds; builds
# nothing. usage: K3BIN=.devbin/k3 bash lab/device/prefetch_gate.sh [ROUNDS]
set -u
ROUNDS=${1:-2}
D=$(dirname "$0")
BASE=${OUT:-/tmp/prefetch_gate}
export CONFIGS=${CONFIGS:-"k3_gpu k3_gpu@off k3_gpu@always k3_cpu k3_cpu@off"}
export RUN_TIMEOUT=${RUN_TIMEOUT:-90}
echo "== O_DIRECT from the virtual disk"
OUT=$BASE/direct DIRECT=1 bash "$D/decode_side_by_side.sh" /tmp/k3slice256 "$ROUNDS"
echo
echo "== experts re-read from the page cache (--direct 0)"
cat /tmp/k3slice256/*.safetensors > /dev/null
OUT=$BASE/cached DIRECT=0 bash "$D/decode_side_by_side.sh" /tmp/k3slice256 "$ROUNDS"
for f in "$BASE"/*/k3_*_1.txt; do
    echo "$f: $(grep -h '^\[K3\] prefetch decode' "$f")"
done
