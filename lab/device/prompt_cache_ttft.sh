#!/usr/bin/env bash
# The on-disk prompt cache against a cold prefill: one process prefills an N-token prompt
# (default 16,384) on the GPU and stores its state; a second process with the same prompt
# loads it; a third adds 64 ids after it. Same snapshot, flags and disk; each prints its
# prefill time and its tokens, which must be the same as the cold run's at temperature 0.
# Builds nothing. usage: K3BIN=.devbin/k3 bash lab/device/prompt_cache_ttft.sh [N]
set -u
N=${1:-16384}
SNAP=${SNAP:-/tmp/k3slice256}
K3BIN=${K3BIN:-.devbin/k3}
DIR=${OUT:-/tmp/prompt_cache_ttft}
mkdir -p "$DIR"
if [ -d .gl ] && [ -f /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ]; then
    . "$(dirname "$0")/device_vulkan.sh"
fi
if [ ! -f "$SNAP/config.json" ]; then
    "$K3BIN" synth --preset k3-slice --layers 4 --experts 256 "$SNAP" > "$DIR/synth.txt" 2>&1 \
        || { tail -5 "$DIR/synth.txt"; exit 1; }
fi
PC=/tmp/prompt_cache_ttft_entries
rm -rf "$PC"
IDS=$(seq -s, 1000 $((1000 + N - 1)))
MORE=$(seq -s, 20000 20063)
run() { # name, ids
    env -u K3_GPU_GB K3_DIRECT=1 "$K3BIN" run "$SNAP" --backend gpu --ids "$2" --ngen 4 \
        --ignore-eos --expert-gb 2 --usage-pins off --prompt-cache "$PC" \
        > "$DIR/$1.out" 2> "$DIR/$1.txt"
    echo "$1: $(grep -m1 -E '^\[K3\] prefill done' "$DIR/$1.txt") | $(grep -E '^\[K3\] prompt cache' "$DIR/$1.txt" | paste -sd';') | tokens $(tr '\n' ' ' < "$DIR/$1.out")"
}
run cold "$IDS"
run cached "$IDS"
run cached_plus_64 "$IDS,$MORE"
du -sh "$PC"
