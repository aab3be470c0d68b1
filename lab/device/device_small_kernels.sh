#!/usr/bin/env bash
# The one-workgroup kernels of a decode step, rewritten in session 8 after it was out of
# device time (one call, about 5 minutes): bench block 19 (an add pass as the floor, the
# RMSNorm, the two-pass AttnRes mix, the router with its readback, the KDA step: session 9
# ran it and its filter dropped the KDA lines, now kept), then k3slice32 decode
# with the session-8 start binary (.devbin/k3_prev) alternated with this one over three
# rounds. Results under $OUT. Prepare with `PREV=936a65b bash lab/device/device_prepare.sh`
# (936a65b: the start of session 8), then run with carry [".devbin", ".gl"].
set -u
. "$(dirname "$0")/device_vulkan.sh"
D=./.devbin
for rep in 1 2; do
    timeout 60 $D/gpu_kernels blocks=19 2>&1 | grep -E "^passes|^kda step"
done | tee "$OUT/passes.txt"
# Synthesizes the model first, then the rounds.
ROUNDS_ONLY=1 VARIANTS="prev auto" ROUNDS=3 bash "$(dirname "$0")/device_dispatch_cost.sh"
