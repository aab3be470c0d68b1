#!/usr/bin/env bash
# Session 10's changes that were built after its device time ran out, measured in one call
# of about 9 minutes (prepare with `PREV=b3db71c bash lab/device/device_prepare.sh`, which also
# builds session 9's k3 as .devbin/k3_prev; run with carry [".devbin", ".gl"]):
# 1. bench block 2 (defaults, heated) with the MoE's down projection at 2 rows a lane
#    (the new default) and at 4 (`down_rpl=4`), alternated twice: the `moe resident: 16`
#    and `16 experts' w2` lines. The MXFP4 lines now take `SPECIAL` 0 (random scales
#    118..125), so they also show the branch's removal against session 10's 48-50 %.
# 2. blocks 21 and 23 heated: staged x by unit against by word (`XW`), taken unheated before;
#    then block 2 with each of wgpu's runtime checks off alone (`nochecks=loop|bounds|div`).
# 3. k3slice32 decode, 400 tokens, this k3 against session 9's, alternated twice, with the
#    clocks sampled (lab/device/device_decode_clock.sh's model and flags).
# Results under $OUT. PART=1 runs 1 and 2's XW line, PART=2 the runtime checks and 3 (each
# fits one device call of 600 s); unset runs all.
set -u
P=${PART:-12}
. "$(dirname "$0")/device_vulkan.sh"
D=./.devbin
keep="^== block|98304|57344|moe resident: 16|int4 matvec 163840"
# Whether the driver has robustBufferAccess2 (wgpu then leaves buffer bounds to it).
if [[ $P == *1* ]]; then
(vulkaninfo 2>/dev/null | grep -m2 -iE "robustBufferAccess2|VK_EXT_robustness2") || echo "vulkaninfo: not available"
for r in 1 2; do
    for a in down_rpl=2 down_rpl=4; do
        echo "## round $r, $a"
        timeout 120 $D/gpu_kernels blocks=2 "$a" > "$OUT/down_${r}_${a#down_rpl=}.txt" 2>&1
        grep -E "$keep" "$OUT/down_${r}_${a#down_rpl=}.txt" | cut -c1-130
    done
done
timeout 150 $D/gpu_kernels blocks=21,23 > "$OUT/xw.txt" 2>&1
grep -E "$keep" "$OUT/xw.txt" | cut -c1-130
fi
[[ $P == *2* ]] || exit 0
# Which of wgpu's runtime checks costs what `unchecked` buys (the int4 head: 70.5-71.5 %
# checked, 75.3 % unchecked): each one off alone, block 2.
for c in loop bounds div; do
    echo "## nochecks=$c"
    timeout 120 $D/gpu_kernels blocks=2 "nochecks=$c" > "$OUT/nochecks_$c.txt" 2>&1
    grep -E "$keep" "$OUT/nochecks_$c.txt" | cut -c1-130
done
. "$(dirname "$0")/device_k3slice32.sh"
decode_ab 2 400
