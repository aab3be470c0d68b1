#!/usr/bin/env bash
# Long-prompt prefill, side by side: k3 (`k3 bench prefill`, GPU and CPU) and the C engine
# (kimi_k3, CPU) on the same snapshot, disk, host expert cache and prompt, in alternated
# rounds. It only runs the binaries it is given; it builds nothing.
#
#   usage: K3BIN=.devbin/k3 CBIN=.devbin/colibri/c/kimi_k3 \
#          bash lab/device/prefill_side_by_side.sh [SNAP] [ROUNDS]
#
# SNAP (default /tmp/k3slice256) is synthesized first when it holds no config.json
# (`k3 synth --preset k3-slice --layers 4 --experts $EXPERTS`, EXPERTS 256). Settings:
#   TOKENS (1024)     prompt length: ids START, START+STEP, ... modulo 160000 (1000, 97)
#   EXPERT_GB (2)     host RAM expert cache, both engines (--expert-gb / K3_EXPERT_GB)
#   CONFIGS           the runs of a round, rotated by one each round:
#                     "k3_gpu k3_cpu c_long c_default"
#   K3_CHUNKS ("")    window bounds k3 bench prefill runs beside its default (--chunks)
#   C_LONG (1024)     K3_CHUNK of the c_long run (the C engine clamps it to 512)
#   K3_FLAGS ("")     extra flags of the k3 runs (e.g. "--gpu-expert-gb 0": no VRAM tier)
#   K3OLD ("")        a second k3 binary, run by the kinds k3old_cpu and k3old_gpu (a
#                     build before a change, measured in the same call as its baseline)
# The kinds k3idot_cpu and k3idot_gpu run K3BIN with K3_IDOT=1 (int8-activation expert
# matmuls, the C engine's default arithmetic).
#   RUN_TIMEOUT (400) seconds a run may take
# Both engines read experts with O_DIRECT (K3_DIRECT=1) and use no usage history (the C
# engine AUTOPIN=0 USAGE_SAVE=0 K3_VK=0, k3 --usage-pins off); the C engine runs --ngen 0,
# so its "GB streamed" is the prefill's. Per run one table row: prefill seconds (the C
# engine's "prefill done" line; k3's bench row, the head included), tok/s, expert GB read,
# and for k3 GB read ÷ the GB of the distinct experts routed per layer (summed). Raw output
# of each run lands in $OUT (or /tmp/prefill_side_by_side) as <run>_<round>.txt.
set -u
SNAP=${1:-/tmp/k3slice256}
ROUNDS=${2:-1}
K3BIN=${K3BIN:-.devbin/k3}
CBIN=${CBIN:-}
EXPERTS=${EXPERTS:-256}
EXPERT_GB=${EXPERT_GB:-2}
TOKENS=${TOKENS:-1024}
START=${START:-1000}
STEP=${STEP:-97}
CONFIGS=${CONFIGS:-k3_gpu k3_cpu c_long c_default}
K3_CHUNKS=${K3_CHUNKS:-}
C_LONG=${C_LONG:-1024}
K3_FLAGS=${K3_FLAGS:-}
K3OLD=${K3OLD:-}
RUN_TIMEOUT=${RUN_TIMEOUT:-400}
DIR=${OUT:-/tmp/prefill_side_by_side}
mkdir -p "$DIR"
if [ -d .gl ] && ls .gl/*.deb > /dev/null 2>&1 \
    && [ -f /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ]; then
    . "$(dirname "$0")/device_vulkan.sh"
fi
if [ -z "$CBIN" ]; then
    CONFIGS=$(echo "$CONFIGS" | tr ' ' '\n' | grep -v '^c_' | paste -sd' ')
fi
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
if [ ! -f "$SNAP/config.json" ]; then
    t0=$(date +%s)
    "$K3BIN" synth --preset k3-slice --layers 4 --experts "$EXPERTS" "$SNAP" > "$DIR/synth.txt" 2>&1 \
        || { tail -5 "$DIR/synth.txt"; exit 1; }
    sync
    echo "synth: $(($(date +%s) - t0)) s, $(du -sh "$SNAP" | cut -f1)"
fi
rm -f "$SNAP/.coli_usage"
IDS=$(for i in $(seq 0 $((TOKENS - 1))); do echo $(((START + STEP * i) % 160000)); done)
IDS_K=$(echo "$IDS" | paste -sd,)
IDS_C=$(echo "$IDS" | paste -sd' ')

field() { grep -m1 -E "$2" "$1" | grep -oE "$3" | grep -oE '[0-9.]+' | head -1; }
calc() { awk "BEGIN { $1 }"; }

run() { # run name, round
    local f="$DIR/$1_$2.txt" secs gb
    case $1 in
    c_long | c_default)
        local chunk=32
        [ "$1" = c_long ] && chunk=$C_LONG
        env K3_VK=0 K3_DIRECT=1 K3_EXPERT_GB="$EXPERT_GB" K3_CHUNK="$chunk" AUTOPIN=0 USAGE_SAVE=0 \
            K3_MAXT=$((TOKENS + 8)) \
            timeout "$RUN_TIMEOUT" "$CBIN" "$SNAP" --ids "$IDS_C" --ngen 0 > /dev/null 2> "$f"
        secs=$(field "$f" 'prefill done in' 'in [0-9.]+s')
        gb=$(field "$f" 'GB streamed' '[0-9.]+ GB streamed')
        if [ -z "$secs" ]; then
            echo "| $1 (K3_CHUNK=$chunk) | failed: $(grep -m1 -iE 'error|abort|refus' "$f" | cut -c1-100) |"
            return
        fi
        echo "$1 $secs" >> "$DIR/secs.txt"
        echo "| C engine, K3_CHUNK=$chunk | $secs | $(calc "printf \"%.1f\", $TOKENS / $secs") | $gb | - |"
        ;;
    k3_gpu | k3_cpu | k3old_gpu | k3old_cpu | k3idot_gpu | k3idot_cpu)
        local backend=${1#*_} bin=$K3BIN idot=0
        [ "${1%%_*}" = k3old ] && bin=$K3OLD
        [ "${1%%_*}" = k3idot ] && idot=1
        env K3_DIRECT=1 K3_IDOT=$idot timeout "$RUN_TIMEOUT" "$bin" bench prefill "$SNAP" --backend "$backend" \
            --ids "$IDS_K" --chunks "$K3_CHUNKS" --expert-gb "$EXPERT_GB" --usage-pins off $K3_FLAGS \
            > "$f.table" 2> "$f"
        cat "$f.table" >> "$f"
        local line
        line=$(grep -m1 '^| default' "$f.table")
        if [ -z "$line" ]; then
            echo "| $1 | failed: $(grep -m1 -iE 'error|panic' "$f" | cut -c1-100) |"
            return
        fi
        secs=$(echo "$line" | cut -d'|' -f5 | tr -d ' ')
        echo "$1 $secs" >> "$DIR/secs.txt"
        echo "| ${1%%_*} $backend, default window ($(echo "$line" | cut -d'|' -f3 | tr -d ' ') tokens) | $secs | $(echo "$line" | cut -d'|' -f6 | tr -d ' ') | $(echo "$line" | cut -d'|' -f7 | tr -d ' ') | $(echo "$line" | cut -d'|' -f9 | tr -d ' ') |"
        grep '^| --chunk' "$f.table" | while read -r l; do
            echo "| k3 $backend, $(echo "$l" | cut -d'|' -f2 | sed 's/ (round.*//; s/^ //') | $(echo "$l" | cut -d'|' -f5 | tr -d ' ') | $(echo "$l" | cut -d'|' -f6 | tr -d ' ') | $(echo "$l" | cut -d'|' -f7 | tr -d ' ') | $(echo "$l" | cut -d'|' -f9 | tr -d ' ') |"
        done
        rm -f "$f.table"
        ;;
    *) echo "unknown run kind $1 (CONFIGS)"; exit 2 ;;
    esac
}

echo "snapshot $SNAP | host expert cache $EXPERT_GB GB | prompt $TOKENS tokens | O_DIRECT"
rm -f "$DIR/secs.txt"
read -r -a KINDS <<< "$CONFIGS"
for r in $(seq 1 "$ROUNDS"); do
    echo
    echo "round $r"
    echo "| run | prefill s | tok/s | expert GB read | read ÷ distinct |"
    echo "|---|---|---|---|---|"
    n=${#KINDS[@]}
    for i in $(seq 0 $((n - 1))); do
        run "${KINDS[$(((i + r - 1) % n))]}" "$r"
    done
done
echo
echo "median prefill s over $ROUNDS round(s); C engine's median ÷ k3's:"
for k in "${KINDS[@]}"; do
    grep "^$k " "$DIR/secs.txt" 2>/dev/null | cut -d' ' -f2 | sort -g \
        | awk -v k="$k" '{ v[NR] = $1 } END { if (NR) printf "%s %.2f\n", k, (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
done > "$DIR/median.txt"
cl=$(grep '^c_long ' "$DIR/median.txt" | cut -d' ' -f2)
cd=$(grep '^c_default ' "$DIR/median.txt" | cut -d' ' -f2)
while read -r k m; do
    printf "  %-10s %s s" "$k" "$m"
    case $k in k3*)
        [ -n "$cd" ] && printf "  %.1fx faster than C at K3_CHUNK=32" "$(calc "print $cd / $m")"
        [ -n "$cl" ] && printf "  %.2fx faster than C at K3_CHUNK=$C_LONG" "$(calc "print $cl / $m")"
        ;;
    esac
    echo
done < "$DIR/median.txt"
grep -hE '^\[K3\] (prefill window|expert reads|backend)|^\[K3\]\[RAM_GB|^\[K3-GPU\]' \
    "$DIR"/k3_*_1.txt 2>/dev/null | sort -u
