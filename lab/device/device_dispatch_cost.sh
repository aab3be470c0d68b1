#!/usr/bin/env bash
# What the kernel-parameter slots (param_arena.rs) buy on the H200, and the matvec kernels
# (one call, up to 10 minutes): the GPU op tests; host time per dispatch
# (reused slots against a uniform buffer per dispatch); k3slice32 decode with the binary
# from before the slots (.devbin/k3_prev: a buffer per dispatch, f32 int4 decode) against
# this one with int4 auto (the default), float and digits, alternated; then the kernel
# blocks. Results under $OUT.
# The decode rounds (what matters most) come before the kernel blocks, which take the rest
# of the 10-minute call.
# ROUNDS_ONLY=1 runs only the synth and the decode rounds; VARIANTS picks them, ROUNDS
# says how many.
# Prepare with `PREV=22410ae bash lab/device/device_prepare.sh` (22410ae: the last commit
# before the slots), then run with carry [".devbin", ".gl"].
set -u
. "$(dirname "$0")/device_vulkan.sh"
D=./.devbin
M=/tmp/k3slice32
( [ -f "$M/config.json" ] || $D/k3 synth --preset k3-slice --layers 4 --experts 32 "$M" > /dev/null 2>&1 ) &
SYNTH=$!
S0=$(date +%s)
if [ "${ROUNDS_ONLY:-}" != 1 ]; then
    CI=true timeout 60 $D/gpu gpu_ops:: --test-threads 4 > "$OUT/gpu_ops.txt" 2>&1
    echo "gpu_ops rc $?: $(grep -E 'test result|FAILED|panicked' "$OUT/gpu_ops.txt" | head -3)"
fi
# The benchmarks after the synth: it loads the disk and the CPUs.
wait "$SYNTH"
echo "synth done after $(( $(date +%s) - S0 )) s"
[ "${ROUNDS_ONLY:-}" = 1 ] || timeout 40 $D/gpu_kernels blocks=17,18 2>&1 | grep host | tee "$OUT/host.txt"
IDS=$(seq -s, 1000 97 2000)
for rep in $(seq "${ROUNDS:-2}"); do
    for v in ${VARIANTS:-prev auto float digits}; do
        K=$D/k3; F="--gpu-int4-decode $v"
        [ "$v" = prev ] && K=$D/k3_prev && F=""
        T0=$(date +%s)
        # 100 s: a run loads the model first (a 40 s limit killed every run in one call).
        timeout 100 $K run "$M" --ids "$IDS" --ngen 97 --ignore-eos --quiet --backend gpu \
            --expert-gb 60 --gpu-expert-gb 60 $F > /dev/null 2> "$OUT/run_$v.txt"
        RC=$?
        L=$(grep -o 'decode 97 tokens.*tok/s)' "$OUT/run_$v.txt")
        echo "round $rep, $v: rc $RC, $(( $(date +%s) - T0 )) s: ${L:-$(tail -2 "$OUT/run_$v.txt" | tr '\n' ' ')}"
    done
done | tee "$OUT/rounds.txt"
[ "${ROUNDS_ONLY:-}" = 1 ] && exit 0
# The int4 lines with the read kernel interleaved: default, f32 decode, digits unchecked.
# (Session 8 also ran blocks 19-25 here, the variants that lost and were then removed.)
timeout 240 $D/gpu_kernels blocks=2,3,5 > "$OUT/kernels.txt" 2>&1
grep -E "^==|int4 matvec|16 experts' w1|moe resident: 16" "$OUT/kernels.txt" | cut -c1-150
