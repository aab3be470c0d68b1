#!/usr/bin/env bash
# Session 11's open questions, one device call of about 8 minutes (prepare with
# `PREV=e3d2857 bash lab/device/device_prepare.sh`, session 10's tip as .devbin/k3_prev; run with
# carry [".devbin", ".gl"]):
# 0. whether the driver has robustBufferAccess2 (shader_stats' device line): where it does,
#    wgpu leaves buffer accesses to the driver and its remaining checks are index clamps.
# 1. bench block 31: the int8 and int4 heads, each loaded three times and timed three times
#    a load. Session 11 read the int8 head at 71.8 and 89.9 % of the read kernel in two runs
#    with the read kernel steady: does a head's time move line to line, or with its
#    allocation?
# 2. bench block 32: the int4 head, int4/int8 12288 rows, the int8 head and 16 experts'
#    MXFP4 w1|w3, each split into its passes by the engine's profiler: what the int4 head's
#    matvec kernel reads at without its x_planes pass (the op: 73.9-74.0 % of read).
# 3. k3slice32 decode, 400 tokens, this k3 against session 10's, alternated twice: the MXFP4
#    decode by multiplies and the matvec checks dropped, in the whole token.
# 4. submitting early (--gpu-submit-every 64 and 4 against the default), last measured in
#    session 5 with 49-token runs that carried the low-clock start.
# Results under $OUT.
set -u
. "$(dirname "$0")/device_vulkan.sh"
D=./.devbin
timeout 60 $D/shader_stats read_bench:stream_read 2>&1 | grep -m1 "^device:"
timeout 200 $D/gpu_kernels blocks=31 > "$OUT/repeat.txt" 2>&1
grep -E "^repeat" "$OUT/repeat.txt" | cut -c1-140
timeout 200 $D/gpu_kernels blocks=32 > "$OUT/pass_times.txt" 2>&1
grep -E "^pass times" "$OUT/pass_times.txt"
. "$(dirname "$0")/device_k3slice32.sh"
decode_ab 2 400
# 4: alternated twice at 400 tokens (4096, the default, submits at readbacks only).
for r in 1 2; do
    for n in 4096 64 4; do
        echo "submit-every $n, round $r: $(decode_run k3 400 --gpu-submit-every "$n")"
    done
done
