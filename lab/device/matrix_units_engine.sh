#!/bin/bash
# The matrix-unit matmuls in the engine (K3_LAB_MATRIX_UNITS) on the device: the probe and
# its baselines (matrix_units_probe.sh, when PROBE=1), the GPU test that holds them to the
# CPU, then `k3 bench streams` of k3slice32 resident at 1, 4 and 8 streams with the switch
# off, on (4 subgroups a workgroup) and at 2 (or $MODES), alternated over $ROUNDS rounds. Binaries in
# .devbin: k3, gpu_tests (the stripped `cargo test --test gpu` binary), and for the probe
# coop_probe and gpu_kernels.
#   usage: ROUNDS=2 PROBE=1 MODES="off on 2" bash lab/device/matrix_units_engine.sh
for f in .gl/*.deb; do dpkg -x $f / >/dev/null; done; ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
D=${D:-./.devbin}; M=/tmp/k3slice32
nvidia-smi --query-gpu=name --format=csv,noheader
"$D/k3" devices 2>&1 | grep -E "matrix|^\["
[ "${PROBE:-0}" = 1 ] && bash lab/device/matrix_units_probe.sh 2>&1 | tail -28
CI=true timeout 120 "$D/gpu_tests" matrix_unit few_token_matmuls 2>&1 | grep -E "^test |panicked|rel L2|result" | head -20
[ -f "$M/config.json" ] || timeout 60 "$D/k3" synth --preset k3-slice --layers 4 --experts 32 "$M" >/dev/null 2>&1
for r in $(seq 1 "${ROUNDS:-1}"); do
    for mu in ${MODES:-off on 2}; do
        echo "== K3_LAB_MATRIX_UNITS=$mu round $r"
        K3_LAB_MATRIX_UNITS=$mu timeout 120 "$D/k3" bench streams "$M" --backend gpu --expert-gb 8 \
            --gpu-expert-gb 8 --ngen 32 --streams 1,4,8 --rounds 2 2>&1 | grep -E "^\| [0-9]|differ|rror|WARN"
    done
done
