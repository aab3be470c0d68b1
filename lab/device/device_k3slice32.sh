# Sourced by the decode scripts: the k3 binary, the k3slice32 model (k3-slice dimensions,
# 4 layers, 32 experts a MoE layer; synthesized on the device's disk when it is not there)
# and the prompt ids they run.
K=./.devbin/k3
M=/tmp/k3slice32
[ -f "$M/config.json" ] || "$K" synth --preset k3-slice --layers 4 --experts 32 "$M" > "$OUT/synth32.txt" 2>&1
IDS=$(seq -s, 1000 97 2000)
# One decode run of binary $1 at $2 tokens, every expert in VRAM, with any further flags:
# its `decode N tokens in ... (... tok/s)` line.
decode_run() {
    local k=$1 n=$2
    shift 2
    timeout 120 ./.devbin/$k run "$M" --ids "$IDS" --ngen "$n" --ignore-eos --quiet --backend gpu \
        --expert-gb 60 --gpu-expert-gb 60 "$@" 2>&1 > /dev/null | grep -o "decode $n tokens.*tok/s)"
}

# Decode of this k3 against .devbin/k3_prev (PREV= in lab/device/device_prepare.sh), alternated
# for $1 rounds of $2 tokens: one `decode round R, BIN: ...` line each.
decode_ab() {
    local r k
    for r in $(seq 1 "$1"); do
        for k in k3 k3_prev; do
            echo "decode round $r, $k: $(decode_run "$k" "$2")"
        done
    done
}

# The same A/B with the per-kernel GPU profile (--gpu-profile 1: every submission waits, so
# the wall figure is not a decode speed; the GPU total is the measure), for $1 rounds of $2
# tokens: one `round R, BIN: <decode line>; <profile total>` line each, the full profiles
# under $OUT/profile_BIN_R.txt.
profile_ab() {
    local r k f
    for r in $(seq 1 "$1"); do
        for k in k3 k3_prev; do
            f="$OUT/profile_${k}_$r.txt"
            timeout 120 ./.devbin/$k run "$M" --ids "$IDS" --ngen "$2" --ignore-eos --quiet \
                --backend gpu --expert-gb 60 --gpu-expert-gb 60 --gpu-profile 1 > /dev/null 2> "$f"
            echo "round $r, $k: $(grep -o "decode $2 tokens.*tok/s)" "$f"); $(grep -m1 "profile:" "$f")"
        done
    done
}
