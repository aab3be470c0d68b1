#!/usr/bin/env bash
# Expert tiers on the GPU backend, one device call (a few minutes):
#  1. Prefill with the VRAM tier on against off (the chunk carry on), in alternated rounds.
#     The rounds without the carry (K3_LAB_CHUNK_CARRY=off) went with the switch, which lost
#     (lab/notebook.md, "Lab switches and GPU options removed").
#     Reads are buffered and a warm-up run fills the page cache first, so each run reads its
#     experts from host memory and the figure is the uploads, not the disk.
#  2. Decode from disk (O_DIRECT) with the host cache and the VRAM tier split: RAM only,
#     VRAM only, half and half (exclusive tiers: their sum), and the whole budget in RAM.
#  3. With K3OLD set (another build), the splits of OLDSPLITS again on each binary, in
#     DROUNDS alternated rounds: new, old, new, old ...
# Prints one line a run (prefill s from --stats-json, hits by tier, GB read) and keeps the
# raw output under $OUT.
#
#   usage: K3BIN=.devbin/k3-tiers bash lab/device/tiers.sh [SNAP] [EXPERTS]
# ROUNDS (2) prefill rounds (0: no prefill runs), NGEN (24) decode tokens, SPLITS
# ("1:0 0:1 0.5:0.5 1:1 2:0", host GB:VRAM GB) the decode runs, K3OLD (unset) the build to
# compare with, OLDSPLITS ("1:1"), DROUNDS (2).
set -u
ROUNDS=${ROUNDS:-2}
NGEN=${NGEN:-24}
SPLITS=${SPLITS:-"1:0 0:1 0.5:0.5 1:1 2:0"}
SNAP=${1:-/tmp/k3slice64}
EXPERTS=${2:-64}
K=${K3BIN:-.devbin/k3}
OUT=${OUT:-/tmp/tiers_out}
mkdir -p "$OUT"
[ -d .gl ] && . "$(dirname "$0")/device_vulkan.sh"
if [ ! -f "$SNAP/config.json" ]; then
    /usr/bin/time -f "synth %e s" "$K" synth --preset k3-slice --layers 4 --experts "$EXPERTS" "$SNAP" \
        > "$OUT/synth.txt" 2>&1
    tail -1 "$OUT/synth.txt"
fi
PROMPT=$(seq -s, 1000 97 13400) # 128 ids
field() { grep -o "\"$2\": *[0-9.e-]*" "$1" | head -1 | grep -o '[0-9.e-]*$'; }
pre() { # name, gpu-expert-gb
    K3_DIRECT=0 timeout 300 "$K" run "$SNAP" --ids "$PROMPT" --ngen 1 \
        --ignore-eos --quiet --backend gpu --chunk 32 --expert-gb 60 --gpu-expert-gb "$2" \
        --stats-json "$OUT/$1.json" > "$OUT/$1.ids" 2> "$OUT/$1.err"
    echo "$1: prefill_s $(field "$OUT/$1.json" prefill_s) gpu_hits $(field "$OUT/$1.json" gpu_hits) ids $(cat "$OUT/$1.ids" | tr '\n' ' ')"
}
[ "$ROUNDS" -gt 0 ] && pre warmup 0
for r in $(seq 1 "$ROUNDS"); do
    pre "tier_on_$r" 60
    pre "tier_off_carry_$r" 0
done
DPROMPT=$(seq -s, 1000 97 1700) # 8 ids
dec() { # name, expert-gb, gpu-expert-gb [binary]
    K3_DIRECT=1 timeout 200 "${4:-$K}" run "$SNAP" --ids "$DPROMPT" --ngen "$NGEN" --ignore-eos --quiet \
        --backend gpu --expert-gb "$2" --gpu-expert-gb "$3" \
        --stats-json "$OUT/$1.json" > "$OUT/$1.ids" 2> "$OUT/$1.err"
    local j="$OUT/$1.json"
    echo "$1: decode tok/s $(field "$j" decode_tok_per_s) demotions $(field "$j" tier_demotions) prefetch wasted $(field "$j" prefetch_wasted_bytes) B | $(grep '\[K3\] tiers' "$OUT/$1.err") | $(grep '\[K3\] disk' "$OUT/$1.err")"
}
for sp in $SPLITS; do
    dec "ram${sp%%:*}_vram${sp##*:}" "${sp%%:*}" "${sp##*:}"
done
if [ -n "${K3OLD:-}" ]; then
    for r in $(seq 1 "${DROUNDS:-2}"); do
        for sp in ${OLDSPLITS:-1:1}; do
            dec "new_ram${sp%%:*}_vram${sp##*:}_$r" "${sp%%:*}" "${sp##*:}"
            dec "old_ram${sp%%:*}_vram${sp##*:}_$r" "${sp%%:*}" "${sp##*:}" "$K3OLD"
        done
    done
fi
