#!/usr/bin/env bash
# Builds and strips what the lab/device scripts run on the H200 into .devbin/ (git-excluded;
# see lab/README.md for .gl, the Vulkan loader). Run here, then call the device tool with
# carry [".devbin", ".gl"] and command `bash lab/device/NAME.sh`.
# Everything is a lab build (`--features lab`): the scripts set `K3_LAB_*` switches, which
# only a lab build reads. PREV=<commit> also builds that commit's k3 into .devbin/k3_prev,
# for A/B runs (lab/device/device_dispatch_cost.sh), as a lab build where that commit has the
# feature (before it, the switches were always built in); it is built first, as it shares
# the target directory.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .devbin
if [ -n "${PREV:-}" ]; then
    rm -rf /tmp/k3prev
    git worktree prune
    git worktree add -f /tmp/k3prev "$PREV"
    prev_lab=()
    grep -q '^lab = ' /tmp/k3prev/Cargo.toml && prev_lab=(--features lab)
    CARGO_TARGET_DIR="$(pwd)/target" cargo build --release "${prev_lab[@]}" --manifest-path /tmp/k3prev/Cargo.toml
    cp target/release/k3 .devbin/k3_prev
    strip .devbin/k3_prev
    git worktree remove --force /tmp/k3prev
fi
cargo build --release --features lab
# shader_stats is built only where examples/shader_stats.rs has been put back (lab/README.md).
[ -f examples/shader_stats.rs ] && cargo build --release --example shader_stats
exe() { # newest test/bench executable of a target name
    ls -t target/release/deps/"$1"-* | grep -v '\.d$' | head -1
}
cargo bench --features lab --bench gpu_kernels --no-run
cargo test --release --features lab --test gpu --no-run
cp target/release/k3 .devbin/k3
[ -f examples/shader_stats.rs ] && cp target/release/examples/shader_stats .devbin/shader_stats
cp "$(exe gpu_kernels)" .devbin/gpu_kernels
# The GPU test binary (tests/gpu/): its CLI tests need the k3 built here; on the device run
# the others by module (e.g. `.devbin/gpu gpu_ops::`, `.devbin/gpu gpu_model::lent`).
cp "$(exe gpu)" .devbin/gpu
strip .devbin/k3 .devbin/gpu_kernels .devbin/gpu
[ -f .devbin/shader_stats ] && strip .devbin/shader_stats
ls -la .devbin
