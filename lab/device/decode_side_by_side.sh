#!/usr/bin/env bash
# Decode from disk, side by side: the C engine (kimi_k3) on the CPU and with its Vulkan
# tier, and k3 on the CPU, on the GPU with a VRAM expert tier of the same size as the C
# engine's, and on the GPU without a tier; same snapshot, disk, host expert cache, prompt
# and token count, in alternated rounds. It only runs the binaries it is given; it builds
# nothing.
#
#   usage: K3BIN=.devbin/k3-cvk CBIN=.devbin/c-vk/kimi_k3 \
#          bash lab/device/decode_side_by_side.sh [SNAP] [ROUNDS]
#
# SNAP (default /tmp/k3slice256) is synthesized first when it holds no config.json
# (`k3 synth --preset k3-slice --layers 4 --experts $EXPERTS`, EXPERTS 256). Settings:
#   EXPERT_GB (2)     host RAM expert cache, both engines (--expert-gb / K3_EXPERT_GB)
#   VRAM_GB (2)       VRAM expert tier of the tier runs (--gpu-expert-gb / K3_VK_GB)
#   NGEN (24)         greedy tokens; NP (8) prompt ids START, START+STEP, ... (1000, 97)
#   CONFIGS           the runs of a round, in order, rotated by one each round:
#                     "c_cpu c_vk k3_cpu k3_gpu_tier k3_gpu"
#   RUN_TIMEOUT (150) seconds a run may take
#   DIRECT (1)        k3's --direct: 0 re-reads experts from the page cache (the fast-SSD
#                     stand-in; the C engine keeps O_DIRECT)
#   ROUTING (random)  the synthesized snapshot's routing (`k3 synth --routing`): local
#                     gives real K3's expert reuse between consecutive tokens
# The kinds c_cpu_pin and c_vk_pin run the C engine with AUTOPIN=1 on a usage history
# (COLI_USAGE) written once before the rounds: the C engine (CPU, AUTOPIN=0) generates
# PIN_NGEN (64) tokens after the NP prompt ids PIN_START, PIN_START+STEP, ... (5000: a
# different prompt from the timed one), then every count is multiplied by the whole
# factor that lifts the total to 200,000 selections, the history at which AUTOPIN pins
# its full quota (half of each layer's slots): the ranking of a short run, the confidence
# of hours of use. The timed runs read it and leave it as it is (USAGE_SAVE=0).
# A k3 run kind may end in @VALUE to pass --prefetch VALUE (on, always, off), and in
# +POLICY to pass --cache-policy POLICY (lru, lfu-decay, 2q): "k3_gpu@off k3_cpu+lru".
# Both engines read experts with O_DIRECT (K3_DIRECT=1, their default) and use no usage
# history: the C engine runs with AUTOPIN=0 USAGE_SAVE=0 (else every run would seed pins
# from the runs before it, which replay the same prompt), k3 with --usage-pins off. CBIN
# must be a build with the Vulkan tier (`make VK=1 kimi_k3`) for c_vk; its shaders are read
# from the shaders/ folder beside it (COLI_VK_SHADERS). c_cpu runs the same binary with
# K3_VK=0. k3 runs with its defaults otherwise (prefetch on). With .gl/ carried to a machine
# with the NVIDIA driver, the Vulkan loader is unpacked first (lab/device/device_vulkan.sh);
# elsewhere the installed loader and drivers are used (lavapipe here).
#
# Per run it prints one table row:
#   tok/s       decode tokens / decode wall seconds (each engine's own decode line; both
#               count the first token, whose logits come from the prompt, in the tokens)
#   GB/step     expert bytes read per decode forward step. k3: decode bytes_streamed /
#               (tokens - 1), guessed prefetch reads included. The C engine prints running
#               totals only: (GB after its last token line - GB after its first) / (steps
#               between them)
#   hit %       decode lookups served without a read, all tiers. k3: its decode counters.
#               The C engine counts only host-cache lookups that its VRAM tier did not
#               serve, so this is 1 - misses / selections, misses = bytes / slot size and
#               selections = MoE layers x experts a token (config.json)
#   eload s     expert load time not hidden behind compute (prompt included, both)
#   GB/s        decode GB read / decode wall (what the disk delivered on average)
#   busy GB/s   k3 only: bytes / the time at least one read was in flight
#   overlap     k3 only: decode wall / max(disk busy, wall - eload)
# At the end, per run kind: the median tok/s over the rounds and its ratio to the C
# engine's medians of this call. Raw stderr of each run lands in $OUT (or
# /tmp/side_by_side) as <run>_<round>.txt.
set -u
SNAP=${1:-/tmp/k3slice256}
ROUNDS=${2:-2}
K3BIN=${K3BIN:-.devbin/k3}
CBIN=${CBIN:-}
EXPERTS=${EXPERTS:-256}
EXPERT_GB=${EXPERT_GB:-2}
VRAM_GB=${VRAM_GB:-2}
NGEN=${NGEN:-24}
NP=${NP:-8}
START=${START:-1000}
STEP=${STEP:-97}
CONFIGS=${CONFIGS:-c_cpu c_vk k3_cpu k3_gpu_tier k3_gpu}
RUN_TIMEOUT=${RUN_TIMEOUT:-150}
DIRECT=${DIRECT:-1}
ROUTING=${ROUTING:-random}
PIN_NGEN=${PIN_NGEN:-64}
PIN_START=${PIN_START:-5000}
DIR=${OUT:-/tmp/side_by_side}
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
    "$K3BIN" synth --preset k3-slice --layers 4 --experts "$EXPERTS" --routing "$ROUTING" "$SNAP" \
        > "$DIR/synth.txt" 2>&1 \
        || { tail -5 "$DIR/synth.txt"; exit 1; }
    sync
    echo "synth: $(($(date +%s) - t0)) s, $(du -sh "$SNAP" | cut -f1)"
fi
rm -f "$SNAP/.coli_usage"
IDS_K=$(seq "$START" "$STEP" $((START + STEP * (NP - 1))) | paste -sd,)
IDS_C=$(seq "$START" "$STEP" $((START + STEP * (NP - 1))) | tr '\n' ' ')
# Routed-expert selections per decode step: MoE layers x experts a token.
cfg_num() { grep -oE "\"$1\": *[0-9]+" "$SNAP/config.json" | head -1 | grep -oE '[0-9]+$'; }
SEL=$((($(cfg_num num_hidden_layers) - $(cfg_num first_k_dense_replace)) * $(cfg_num num_experts_per_token)))

# The numbers after a pattern on the line matching $2 in file $1.
field() { grep -m1 -E "$2" "$1" | grep -oE "$3" | grep -oE '[0-9.]+' | head -1; }
json() { grep -oE "\"$2\": [0-9.e+-]+" "$1" | sed -n 1p | grep -oE '[0-9.e+-]+$'; }
calc() { awk "BEGIN { $1 }"; }

row() { # run name, stderr file, is_k3
    local f=$2 toks secs tps gbt hit eload gbs busy ov
    toks=$(field "$f" '^\[K3\] decode [0-9]+ tokens' 'decode [0-9]+')
    secs=$(field "$f" '^\[K3\] decode [0-9]+ tokens' 'in [0-9.]+s')
    tps=$(field "$f" '^\[K3\] decode [0-9]+ tokens' '\([0-9.]+ tok/s\)')
    eload=$(field "$f" '^\[K3\] time:' 'eload [0-9.]+s')
    if [ -z "$toks" ] || [ "$toks" -lt 3 ]; then
        echo "| $1 | failed: $(grep -m1 -iE 'error|panic|unavailable' "$f" | cut -c1-100) |"
        return
    fi
    if [ "$3" = 1 ]; then
        local j=${f%.txt}.json b
        # The decode object's bytes_streamed, whatever order the JSON keys come in.
        b=$(awk '/"decode": \{/ { d = 1 } d && /"bytes_streamed"/ { gsub(/[^0-9]/, ""); print; exit }' "$j")
        gbt=$(calc "printf \"%.3f\", $b / 1e9 / ($toks - 1)")
        gbs=$(calc "printf \"%.2f\", $b / 1e9 / $secs")
        hit=$(field "$f" '^\[K3\] decode [0-9]+ tokens' 'hit [0-9.]+%')
        busy=$(field "$f" '^\[K3\] disk:' '\([0-9.]+ GB/s\)')
        ov=$(field "$f" '^\[K3\] overlap:' '= [0-9.]+')
    else
        local n1 g1 n2 g2 slot
        n1=$(grep -m1 -E '^\s*\[tok [0-9]+:' "$f" | grep -oE 'tok [0-9]+' | grep -oE '[0-9]+')
        g1=$(grep -m1 -E '^\s*\[tok [0-9]+:' "$f" | grep -oE '[0-9.]+ GB read' | grep -oE '[0-9.]+')
        n2=$(grep -E '^\s*\[tok [0-9]+:' "$f" | tail -1 | grep -oE 'tok [0-9]+' | grep -oE '[0-9]+')
        g2=$(grep -E '^\s*\[tok [0-9]+:' "$f" | tail -1 | grep -oE '[0-9.]+ GB read' | grep -oE '[0-9.]+')
        slot=$(field "$f" '^\[K3\] init done' '\([0-9.]+ MB/slot\)')
        gbt=$(calc "printf \"%.3f\", ($g2 - $g1) / ($n2 - $n1)")
        gbs=$(calc "printf \"%.2f\", $gbt * ($toks - 1) / $secs")
        hit=$(calc "printf \"%.1f\", 100 * (1 - $gbt * 1000 / $slot / $SEL)")
        busy=-; ov=-
        if [ "${1%_pin}" = c_vk ] && ! grep -q '^\[VK\] ready' "$f"; then
            echo "| $1 | failed: no Vulkan tier ($(grep -m1 -E 'K3-VK|VK\]' "$f" | cut -c1-80)) |"
            return
        fi
    fi
    echo "$1 $tps" >> "$DIR/tps.txt"
    echo "| $1 | $tps | $gbt | $hit | $eload | $gbs | $busy | $ov |"
}

run() { # run name, round
    local f="$DIR/$1_$2.txt" g pf=on pol=() base=${1%%[@+]*}
    case $1 in *@*) pf=${1#*@}; pf=${pf%%+*} ;; esac
    case $1 in *+*) pol=(--cache-policy "${1#*+}"); pol[1]=${pol[1]%%@*} ;; esac
    case $base in
    c_cpu | c_vk | c_cpu_pin | c_vk_pin)
        local pin=0
        case $1 in c_vk*) g=1 ;; *) g=0 ;; esac
        case $1 in *_pin) pin=1 ;; esac
        env -u K3_GPU_GB K3_VK="$g" K3_VK_GB="$VRAM_GB" COLI_VK_SHADERS="$(dirname "$CBIN")/shaders" \
            K3_DIRECT=1 K3_EXPERT_GB="$EXPERT_GB" AUTOPIN="$pin" USAGE_SAVE=0 COLI_USAGE="$HIST" \
            timeout "$RUN_TIMEOUT" "$CBIN" "$SNAP" --ids "$IDS_C" --ngen "$NGEN" > /dev/null 2> "$f"
        row "$1" "$f" 0
        ;;
    k3_cpu | k3_gpu_tier | k3_gpu)
        local backend=gpu tier=0
        [ "$base" = k3_cpu ] && backend=cpu
        [ "$base" = k3_gpu_tier ] && tier=$VRAM_GB
        env -u K3_VK_GB -u K3_GPU_GB K3_DIRECT="$DIRECT" timeout "$RUN_TIMEOUT" "$K3BIN" run "$SNAP" \
            --backend "$backend" --ids "$IDS_K" --ngen "$NGEN" --ignore-eos --quiet --prefetch "$pf" \
            --expert-gb "$EXPERT_GB" --gpu-expert-gb "$tier" --usage-pins off "${pol[@]}" \
            --stats-json "${f%.txt}.json" > /dev/null 2> "$f"
        row "$1" "$f" 1
        ;;
    *) echo "unknown run kind $1 (CONFIGS)"; exit 2 ;;
    esac
}

HIST="$DIR/coli_usage"
rm -f "$HIST"
if echo "$CONFIGS" | grep -q '_pin'; then
    IDS_PIN=$(seq "$PIN_START" "$STEP" $((PIN_START + STEP * (NP - 1))) | tr '\n' ' ')
    K3_VK=0 K3_DIRECT=1 K3_EXPERT_GB="$EXPERT_GB" AUTOPIN=0 USAGE_SAVE=1 COLI_USAGE="$HIST" \
        timeout "$RUN_TIMEOUT" "$CBIN" "$SNAP" --ids "$IDS_PIN" --ngen "$PIN_NGEN" \
        > /dev/null 2> "$DIR/pin_history.txt"
    total=$(awk '$1 >= 0 { s += $3 } END { print s + 0 }' "$HIST" 2> /dev/null)
    if [ -z "$total" ] || [ "$total" -eq 0 ]; then
        echo "no usage history written for the _pin runs ($(tail -1 "$DIR/pin_history.txt"))"
    else
        factor=$(((200000 + total - 1) / total))
        awk -v f="$factor" '$1 >= 0 { $3 = $3 * f } { print }' "$HIST" > "$HIST.scaled" \
            && mv "$HIST.scaled" "$HIST"
        echo "usage history for the _pin runs: $total selections x $factor"
    fi
fi
echo "snapshot $SNAP ($ROUTING routing) | host expert cache $EXPERT_GB GB | VRAM tier $VRAM_GB GB (tier runs)" \
    "| prompt $NP tokens | $NGEN tokens | O_DIRECT | $SEL selections a step"
rm -f "$DIR/tps.txt"
read -r -a KINDS <<< "$CONFIGS"
for r in $(seq 1 "$ROUNDS"); do
    echo
    echo "round $r"
    echo "| run | tok/s | GB/step | hit % | eload s | GB/s | busy GB/s | overlap |"
    echo "|---|---|---|---|---|---|---|---|"
    n=${#KINDS[@]}
    for i in $(seq 0 $((n - 1))); do
        run "${KINDS[$(((i + r - 1) % n))]}" "$r"
    done
done
echo
echo "median tok/s over $ROUNDS round(s), ratio to the C engine's medians of this call:"
for k in "${KINDS[@]}"; do
    grep "^$k " "$DIR/tps.txt" 2>/dev/null | cut -d' ' -f2 | sort -g \
        | awk -v k="$k" '{ v[NR] = $1 } END { if (NR) printf "%s %.3f\n", k, (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
done > "$DIR/median.txt"
cpu=$(grep '^c_cpu ' "$DIR/median.txt" | cut -d' ' -f2)
vk=$(grep '^c_vk ' "$DIR/median.txt" | cut -d' ' -f2)
while read -r k m; do
    printf "  %-12s %s tok/s" "$k" "$m"
    [ -n "$cpu" ] && printf "  %.2fx C CPU" "$(calc "print $m / $cpu")"
    [ -n "$vk" ] && printf "  %.2fx C Vulkan" "$(calc "print $m / $vk")"
    echo
done < "$DIR/median.txt"
grep -E '^\[K3\](\[RAM_GB| init done| expert reads| tiers)|^\[K3-(VK|GPU)\]|^\[VK\] ready|^\[PIN\]' \
    "$DIR"/*_1.txt 2>/dev/null | sed "s|^$DIR/||"
