#!/usr/bin/env bash
# Decode from disk, side by side: k3 (CPU and GPU backends, next-layer prefetch off and on)
# and, when its binary is given, the C engine (kimi_k3), on the same snapshot, disk, expert
# cache budget, prompt and token count, in alternated rounds. It only runs the binaries it
# is given; it builds nothing.
#
#   usage: K3BIN=.devbin/k3-prefetch CBIN=.devbin/kimi_k3 \
#          bash lab/device/decode_side_by_side.sh [SNAP] [ROUNDS]
#
# SNAP (default /tmp/k3slice256) is synthesized first when it holds no config.json
# (`k3 synth --preset k3-slice --layers 4 --experts 256`). EXPERT_GB (2), NGEN (24), NP
# (prompt tokens, 8: ids START, START+STEP, ...; 1000 and 97), BACKENDS ("cpu gpu"), and RUN_TIMEOUT (seconds a run may take, 150)
# change the setup. Every engine reads experts uncached (O_DIRECT: K3_DIRECT=1, both
# defaults); k3's GPU runs keep no VRAM expert tier (--gpu-expert-gb 0); the C engine runs
# on the CPU (K3_VK=0; a build without its Vulkan tier ignores it). With .gl/ carried, the
# Vulkan loader is unpacked first (lab/device/device_vulkan.sh).
#
# Per run it prints one table row:
#   tok/s           decode tokens / decode wall seconds (each engine's own decode line)
#   GB/token        expert bytes read per decode token: k3's decode counters; the C engine
#                   prints running totals only, so (total after the last token - total
#                   after the first) / (tokens - 1)
#   hit %           expert cache hits / lookups: k3's decode counters; the C engine's
#                   running total, which includes the prompt
#   eload s         expert load time not hidden behind compute (prompt included, both)
#   GB/s            decode GB read / decode wall (what the disk delivered on average)
#   busy GB/s       k3 only: bytes / the time at least one read was in flight
#   overlap         k3 only: decode wall / max(disk busy, wall - eload)
#   prefetch used   k3 only: guessed reads the next layer used / guessed reads
# K3BIN2 (with K3BIN2_LABEL) adds a prefetch-on run of a second k3 build per backend, for A/B
# runs of a prefetch variant.
# Raw stderr of each run lands in $OUT (or /tmp/side_by_side) as <engine>_<round>.txt.
set -u
SNAP=${1:-/tmp/k3slice256}
ROUNDS=${2:-2}
K3BIN=${K3BIN:-.devbin/k3}
CBIN=${CBIN:-}
EXPERT_GB=${EXPERT_GB:-2}
NGEN=${NGEN:-24}
NP=${NP:-8}
START=${START:-1000}
STEP=${STEP:-97}
BACKENDS=${BACKENDS:-cpu gpu}
RUN_TIMEOUT=${RUN_TIMEOUT:-150}
DIR=${OUT:-/tmp/side_by_side}
mkdir -p "$DIR"
if [ -d .gl ] && ls .gl/*.deb > /dev/null 2>&1; then
    . "$(dirname "$0")/device_vulkan.sh"
fi
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
if [ ! -f "$SNAP/config.json" ]; then
    t0=$(date +%s)
    "$K3BIN" synth --preset k3-slice --layers 4 --experts 256 "$SNAP" > "$DIR/synth.txt" 2>&1 \
        || { tail -5 "$DIR/synth.txt"; exit 1; }
    echo "synth: $(($(date +%s) - t0)) s, $(du -sh "$SNAP" | cut -f1)"
fi
IDS_K=$(seq "$START" "$STEP" $((START + STEP * (NP - 1))) | paste -sd,)
IDS_C=$(seq "$START" "$STEP" $((START + STEP * (NP - 1))) | tr '\n' ' ')

# The numbers after a pattern on the line matching $2 in file $1.
field() { grep -m1 -E "$2" "$1" | grep -oE "$3" | grep -oE '[0-9.]+' | head -1; }
div() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.3f", a / b; else print "-" }'; }

row() { # name, stderr file, is_k3
    local f=$2 toks secs tps gbt hit eload gbs busy ov pf
    toks=$(field "$f" '^\[K3\] decode [0-9]+ tokens' 'decode [0-9]+')
    secs=$(field "$f" '^\[K3\] decode [0-9]+ tokens' 'in [0-9.]+s')
    tps=$(field "$f" '^\[K3\] decode [0-9]+ tokens' '\([0-9.]+ tok/s\)')
    hit=$(field "$f" '^\[K3\] decode [0-9]+ tokens' 'hit [0-9.]+%')
    eload=$(field "$f" '^\[K3\] time:' 'eload [0-9.]+s')
    if [ -z "$toks" ]; then
        echo "| $1 | failed: $(grep -m1 -iE 'error|panic' "$f" | cut -c1-100) |"
        return
    fi
    if [ "$3" = 1 ]; then
        # k3's decode line counts the decode alone; GB with two decimals from the JSON.
        local j=${f%.txt}.json
        gbt=$(awk -v g="$(grep -oE '"bytes_streamed": [0-9]+' "$j" | sed -n 1p | grep -oE '[0-9]+$')" \
            -v t="$toks" 'BEGIN { printf "%.3f", g / 1e9 / t }')
        gbs=$(awk -v g="$gbt" -v t="$toks" -v s="$secs" 'BEGIN { if (s > 0) printf "%.2f", g * t / s; else print "-" }')
        busy=$(field "$f" '^\[K3\] disk:' '\([0-9.]+ GB/s\)')
        ov=$(field "$f" '^\[K3\] overlap:' '= [0-9.]+')
        pf=$(grep -m1 '^\[K3\] prefetch:' "$f" | grep -oE '[0-9]+ guessed reads, [0-9]+ used \([0-9.]+%\)' \
            | sed -E 's/ guessed reads, / -> /; s/ used//')
    else
        local first last
        first=$(grep -m1 -E '^\s*\[tok 1:' "$f" | grep -oE '[0-9.]+ GB read' | grep -oE '[0-9.]+')
        last=$(grep -E '^\s*\[tok [0-9]+:' "$f" | tail -1 | grep -oE '[0-9.]+ GB read' | grep -oE '[0-9.]+')
        gbt=$(div "$(awk -v a="$last" -v b="$first" 'BEGIN { print a - b }')" $((toks - 1)))
        gbs=$(awk -v g="$gbt" -v t="$toks" -v s="$secs" 'BEGIN { if (s > 0) printf "%.2f", g * t / s; else print "-" }')
        busy=-; ov=-; pf=-
    fi
    echo "| $1 | $tps | $gbt | $hit | $eload | $gbs | $busy | $ov | ${pf:--} |"
}

run_k3() { # backend, prefetch, round[, binary, label]
    local bin=${4:-$K3BIN} f="$DIR/k3${5:-}_$1_pf$2_$3.txt"
    timeout "$RUN_TIMEOUT" "$bin" run "$SNAP" --backend "$1" --ids "$IDS_K" --ngen "$NGEN" \
        --ignore-eos --quiet --expert-gb "$EXPERT_GB" --gpu-expert-gb 0 --prefetch "$2" \
        --stats-json "${f%.txt}.json" > /dev/null 2> "$f"
    row "k3${5:+ $5} $1, prefetch $2" "$f" 1
}

run_c() { # round
    local f="$DIR/c_cpu_$1.txt"
    K3_VK=0 K3_DIRECT=1 K3_EXPERT_GB="$EXPERT_GB" timeout "$RUN_TIMEOUT" "$CBIN" "$SNAP" \
        --ids "$IDS_C" --ngen "$NGEN" > /dev/null 2> "$f"
    row "C engine, CPU" "$f" 0
}

echo "snapshot $SNAP | expert cache $EXPERT_GB GB | prompt $NP tokens | $NGEN tokens | O_DIRECT"
for r in $(seq 1 "$ROUNDS"); do
    echo
    echo "round $r"
    echo "| engine | tok/s | GB/token | hit % | eload s | GB/s | busy GB/s | overlap | prefetch used |"
    echo "|---|---|---|---|---|---|---|---|---|"
    [ -n "$CBIN" ] && run_c "$r"
    for b in $BACKENDS; do
        for p in off on; do
            run_k3 "$b" "$p" "$r"
        done
        if [ -n "${K3BIN2:-}" ]; then run_k3 "$b" on "$r" "$K3BIN2" "${K3BIN2_LABEL:-2}"; fi
    done
done
grep -h -E '^\[K3\](\[RAM_GB| init done| expert reads)' "$DIR"/*_1.txt 2>/dev/null | sort -u
