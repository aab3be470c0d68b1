#!/usr/bin/env bash
# Decode's expert reads on the device box's virtual disk, in one call: `k3 bench reader
# --pattern decode` (the engine with each read piece size, plain O_DIRECT in the same shape,
# plain O_DIRECT back to back), then CPU decodes of the build before (K3OLD), this build
# (K3BIN) and, when CBIN is given, the C engine, rotated over ROUNDS rounds, then the plain
# sweep and (EIGHT=1, the default) the decode bench at 8 threads. It only runs the binaries
# it is given.
#
#   usage: K3BIN=.devbin/k3 K3OLD=.devbin/k3-main [CBIN=.devbin/c/kimi_k3] \
#          bash lab/device/reader_decode.sh [SNAP] [ROUNDS]
#
# SNAP (default /tmp/m) is synthesized first when it holds no config.json (`k3 synth
# --preset k3-slice --layers 4 --experts 256`: 768 experts, 13.5 GB). Each decode: 8-token
# prompt, NGEN (24) greedy tokens, --backend cpu, --expert-gb 2, O_DIRECT, no usage pins;
# the C engine with K3_VK=0 K3_DIRECT=1 K3_EXPERT_GB=2 AUTOPIN=0 USAGE_SAVE=0.
# Per decode one row: tok/s; decode GB; k3's decode busy GB/s (bytes / time a read was in
# flight, from --stats-json); decode GB / decode wall (both engines; the C engine has no
# busy meter). Raw output lands in $OUT (or /tmp/reader_decode): the benches' output, and
# every run's stderr and stats JSON appended to runs.log (the device tool brings back at
# most 8 files, so the runs share one).
set -u
SNAP=${1:-/tmp/m}
ROUNDS=${2:-2}
K3BIN=${K3BIN:-.devbin/k3}
K3OLD=${K3OLD:-.devbin/k3-main}
CBIN=${CBIN:-}
NGEN=${NGEN:-24}
TOKENS=${TOKENS:-6}
SWEEP=${SWEEP:-128}
EIGHT=${EIGHT:-1}
DIR=${OUT:-/tmp/reader_decode}
RUNS=/tmp/reader_decode_runs
mkdir -p "$DIR" "$RUNS"
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
for q in /sys/block/*/queue; do
    d=${q%/queue}
    case ${d##*/} in loop* | ram*) continue ;; esac
    echo "${d##*/}: max_sectors_kb $(cat "$q/max_sectors_kb") nr_requests $(cat "$q/nr_requests")" \
        "scheduler $(cat "$q/scheduler") rotational $(cat "$q/rotational")"
done
df -h "$(dirname "$SNAP")" | tail -1
if [ ! -f "$SNAP/config.json" ]; then
    t0=$(date +%s)
    "$K3BIN" synth --preset k3-slice --layers 4 --experts 256 "$SNAP" > "$DIR/synth.txt" 2>&1 \
        || { tail -5 "$DIR/synth.txt"; exit 1; }
    sync
    echo "synth: $(($(date +%s) - t0)) s, $(du -sh "$SNAP" | cut -f1)"
fi

echo
echo "== k3 bench reader --pattern decode, 4 threads (this build)"
"$K3BIN" bench reader "$SNAP" --pattern decode --tokens "$TOKENS" --rounds 3 \
    --piece-kib 0,4096,2048,1024 > "$DIR/bench_decode_t4.txt" 2>&1
cat "$DIR/bench_decode_t4.txt"

IDS_K=$(seq 1000 97 1679 | paste -sd,)
IDS_C=$(seq 1000 97 1679 | tr '\n' ' ')
num() { grep -oE "\"$2\": [0-9.e+-]+" "$1" | sed -n "${3}p" | grep -oE '[0-9.e+-]+$'; }
run() { # kind, round
    local f="$RUNS/$1_$2.txt" j="$RUNS/$1_$2.json" bin
    run_kind "$@"
    for x in "$f" "$j"; do
        [ -f "$x" ] && { echo "==> ${x##*/}"; cat "$x"; } >> "$DIR/runs.log"
    done
}
run_kind() { # kind, round
    local f="$RUNS/$1_$2.txt" j="$RUNS/$1_$2.json" bin
    case $1 in
    c)
        rm -f "$SNAP/.coli_usage"
        K3_VK=0 K3_DIRECT=1 K3_EXPERT_GB=2 AUTOPIN=0 USAGE_SAVE=0 timeout 150 \
            "$CBIN" "$SNAP" --ids "$IDS_C" --ngen "$NGEN" > /dev/null 2> "$f"
        local line toks secs tps n1 g1 n2 g2
        line=$(grep -m1 -E '^\[K3\] decode [0-9]+ tokens' "$f")
        toks=$(echo "$line" | grep -oE 'decode [0-9]+' | grep -oE '[0-9]+')
        secs=$(echo "$line" | grep -oE 'in [0-9.]+s' | grep -oE '[0-9.]+')
        tps=$(echo "$line" | grep -oE '[0-9.]+ tok/s' | grep -oE '[0-9.]+')
        n1=$(grep -m1 -E '^\s*\[tok [0-9]+:' "$f" | grep -oE 'tok [0-9]+' | grep -oE '[0-9]+')
        g1=$(grep -m1 -E '^\s*\[tok [0-9]+:' "$f" | grep -oE '[0-9.]+ GB read' | grep -oE '[0-9.]+')
        n2=$(grep -E '^\s*\[tok [0-9]+:' "$f" | tail -1 | grep -oE 'tok [0-9]+' | grep -oE '[0-9]+')
        g2=$(grep -E '^\s*\[tok [0-9]+:' "$f" | tail -1 | grep -oE '[0-9.]+ GB read' | grep -oE '[0-9.]+')
        if [ -z "$tps" ] || [ -z "$g2" ]; then
            echo "| C engine | $2 | failed: $(grep -m1 -iE 'error|fail|missing' "$f" | cut -c1-100) |"
            return
        fi
        # Its running byte total moves once a token: GB a step times the steps of decode.
        awk -v t="$toks" -v s="$secs" -v p="$tps" -v n1="$n1" -v g1="$g1" -v n2="$n2" -v g2="$g2" -v r="$2" \
            'BEGIN { gbt = (g2 - g1) / (n2 - n1); printf "| C engine | %s | %s | %.2f | - | %.2f |\n", r, p, gbt * (t - 1), gbt * (t - 1) / s }'
        ;;
    old | new)
        [ "$1" = old ] && bin=$K3OLD || bin=$K3BIN
        timeout 150 "$bin" run "$SNAP" --backend cpu --ids "$IDS_K" --ngen "$NGEN" --ignore-eos \
            --quiet --expert-gb 2 --direct 1 --usage-pins off --stats-json "$j" > /dev/null 2> "$f"
        if [ ! -s "$j" ]; then
            echo "| k3 $1 | $2 | failed: $(grep -m1 -iE 'error|panic' "$f" | cut -c1-100) |"
            return
        fi
        # The decode object is the second with these keys (prefill, decode, total).
        awk -v p="$(num "$j" decode_tok_per_s 1)" -v s="$(num "$j" decode_s 1)" \
            -v b="$(num "$j" bytes_streamed 2)" -v busy="$(num "$j" disk_busy_s 2)" -v k="$1" -v r="$2" \
            'BEGIN { printf "| k3 %s | %s | %.2f | %.2f | %.2f | %.2f |\n", k, r, p, b / 1e9, b / 1e9 / busy, b / 1e9 / s }'
        ;;
    esac
}
echo
echo "== decode, CPU backend, $NGEN tokens, --expert-gb 2, O_DIRECT (old: $K3OLD, new: $K3BIN)"
KINDS=(old new)
[ -n "$CBIN" ] && KINDS+=(c)
echo "| run | round | tok/s | decode GB | busy GB/s | GB / decode wall |"
echo "|---|---|---|---|---|---|"
n=${#KINDS[@]}
for r in $(seq 1 "$ROUNDS"); do
    for i in $(seq 0 $((n - 1))); do
        run "${KINDS[$(((i + r - 1) % n))]}" "$r"
    done
done

echo
echo "== k3 bench reader (sweep, $SWEEP experts)"
"$K3BIN" bench reader "$SNAP" --limit "$SWEEP" --rounds 2 --piece-kib 0,2048 > "$DIR/bench_sweep.txt" 2>&1
cat "$DIR/bench_sweep.txt"
[ "$EIGHT" = 1 ] || exit 0
echo
echo "== k3 bench reader --pattern decode, 8 threads"
"$K3BIN" bench reader "$SNAP" --pattern decode --tokens "$TOKENS" --rounds 2 --load-threads 8 \
    --piece-kib 0,2048,1024 > "$DIR/bench_decode_t8.txt" 2>&1
cat "$DIR/bench_decode_t8.txt"
