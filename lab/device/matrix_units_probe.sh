#!/bin/bash
# The matrix-unit probe beside the engine's few-token kernels: what the adapter offers
# (`k3 devices`), lab/coop_probe.rs's int4 and MXFP4 matmuls of 8 tokens (checked against the
# host), and the `gpu_kernels` cases they compare with (one-token and few-token int4, the
# int8 head, 16 experts' MXFP4 matmuls and the resident MoE of 1 and 8 tokens). Binaries in
# .devbin: k3, coop_probe, gpu_kernels (lab/README.md says how to build the probe).
#   usage: bash lab/device/matrix_units_probe.sh
for f in .gl/*.deb; do dpkg -x $f / >/dev/null; done; ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
D=${D:-./.devbin}
nvidia-smi --query-gpu=name --format=csv,noheader
"$D/k3" devices 2>&1 | grep -E '^\[|features'
timeout 150 "$D/coop_probe" 2>&1 | tail -12
timeout 150 "$D/gpu_kernels" int4-12288x7168 int4-1536x7168 int4-7168x7168-8-tokens \
    int4-kda-projections-8-tokens int8-head-8-tokens int8-head mxfp4-16-experts-w1w3 \
    mxfp4-16-experts-w2 moe-resident-16x1 moe-resident-16x8 2>&1 | tail -12
