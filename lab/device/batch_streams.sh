#!/bin/bash
# Batched decode on the device box (docs/perf.md, "Several requests at once"): `k3 bench
# streams` on k3-slice with 4 layers and 32 experts a MoE layer, GPU with every expert in
# VRAM (1, 4, 8 streams against the same streams one at a time), then the 256-expert slice
# from a 2 GB host cache with O_DIRECT (disk-bound; expert GB read per step reported), then
# the serve-level TTFT of a short chat beside a 16k-token prefill (lab/device/serve_parallel.sh,
# GPU part). Binary: $K (default .devbin/k3-serve, carried). Output under $OUT.
set -u
K=${K:-./.devbin/k3-serve}
OUT=${OUT:-/tmp/batch_streams_out}
mkdir -p "$OUT"
M32=/tmp/k3slice32; M256=/tmp/k3slice256
[ -f "$M32/config.json" ] || timeout 60 "$K" synth --preset k3-slice --layers 4 --experts 32 "$M32" > "$OUT/synth32.txt" 2>&1
echo "== resident (32 experts, GPU, every expert in VRAM)"
timeout 150 "$K" bench streams "$M32" --backend gpu --expert-gb 8 --gpu-expert-gb 8 \
    --streams 1,4,8 --ngen 32 --rounds 2 --json "$OUT/resident.json" 2>&1 | tee "$OUT/resident.txt" | grep -v "^\[K3\] \(load\|weights\)"
[ -f "$M256/config.json" ] || timeout 200 "$K" synth --preset k3-slice --layers 4 --experts 256 "$M256" > "$OUT/synth256.txt" 2>&1
echo "== disk-bound (256 experts, GPU, 2 GB host cache, no VRAM tier, O_DIRECT)"
timeout 150 "$K" bench streams "$M256" --backend gpu --expert-gb 2 --gpu-expert-gb 0 --direct 1 \
    --streams 1,4 --ngen 16 --rounds 1 --json "$OUT/disk.json" 2>&1 | tee "$OUT/disk.txt" | grep -v "^\[K3\] \(load\|weights\)"
