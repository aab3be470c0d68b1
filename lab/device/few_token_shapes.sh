#!/bin/bash
# The few-token dense kernel's shapes (`K3_LAB_FEW_TOKEN_SHAPE`, lanes a row x rows a lane)
# against one matvec a row (`K3_LAB_FEW_TOKEN_DENSE=off`), `gpu_kernels` cases of 4 and 8
# tokens: the int8 head, the KDA projections (int4 digits) and int4 matrices of 1536 to 7168
# rows (float decode), which tell from how many row groups the kernel pays.
#   usage: SHAPES="4x2 4x4 8x2" ROUNDS=2 bash lab/device/few_token_shapes.sh
for f in .gl/*.deb; do dpkg -x $f / >/dev/null; done; ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
GK=${GK:-./.devbin/gpu_kernels}
CASES="int8-head-4-tokens int8-head-8-tokens int4-kda-projections-4-tokens int4-kda-projections-8-tokens
int4-1536x7168-8-tokens int4-3072x7168-8-tokens int4-7168x7168-4-tokens int4-7168x7168-8-tokens"
nvidia-smi --query-gpu=name --format=csv,noheader
for r in $(seq 1 "${ROUNDS:-1}"); do
    echo "== round $r: off"
    K3_LAB_FEW_TOKEN_DENSE=off timeout 150 "$GK" $CASES 2>&1 | grep token
    for s in ${SHAPES:-4x2 4x4 8x2 4x1}; do
        echo "== round $r: shape $s"
        K3_LAB_FEW_TOKEN_SHAPE=$s timeout 150 "$GK" $CASES 2>&1 | grep token
    done
done
