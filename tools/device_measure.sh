#!/usr/bin/env bash
# Measures the product on a machine with an NVIDIA GPU and no Rust toolchain (the `device`
# tool's machine): every figure of docs/perf.md's "Decode from disk", "Kernels" and "CPU"
# sections comes from this script, each against a baseline taken in the same call.
#
#   bash tools/device_measure.sh build   here: build and strip the binaries into .devbin/
#   bash tools/device_measure.sh         there, about 9 minutes: the GPU op tests, the kernel
#                                        benchmark (each kernel against a plain read of the
#                                        same bytes), a k3-slice model synthesized on the
#                                        machine's disk, its greedy ids on the GPU, and the
#                                        streaming sweep with the VRAM expert tier off and at
#                                        2 GB
#   bash tools/device_measure.sh cpu     there, right after (the model is still on its disk):
#                                        the CPU backend's greedy ids and streaming sweep
#
# How to run it with the `device` tool:
# 1. Once, here, in the repository root: fetch the Vulkan loader the device image lacks, and
#    keep it and the binaries out of git (they travel as `carry`):
#      echo /.gl/ >> .git/info/exclude; echo /.devbin/ >> .git/info/exclude
#      mkdir -p .gl /tmp/amd64/partial
#      o='-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/amd64'
#      apt-get $o update; (cd .gl && apt-get $o download libvulkan1)
# 2. Here: `bash tools/device_measure.sh build` (release k3, the gpu_kernels bench and the
#    GPU test binary (tests/gpu/); nothing is compiled on the device).
# 3. `run` with carry [".devbin", ".gl"], command `bash tools/device_measure.sh`, then again
#    with `bash tools/device_measure.sh cpu`. Results land under $OUT; the tool copies them back.
# BENCH_ARGS names benchmark cases to run instead of every case (`gpu_kernels list` prints
# them).
set -u
cd "$(dirname "$0")/.."

if [ "${1:-}" = build ]; then
    set -e
    newest() { # the newest test or bench executable of a target name
        ls -t target/release/deps/"$1"-* | grep -v '\.d$' | head -1
    }
    cargo build --release
    cargo bench --bench gpu_kernels --no-run
    cargo test --release --test gpu --no-run
    mkdir -p .devbin
    cp target/release/k3 .devbin/k3
    cp "$(newest gpu_kernels)" .devbin/gpu_kernels
    cp "$(newest gpu)" .devbin/gpu
    strip .devbin/k3 .devbin/gpu_kernels .devbin/gpu
    ls -la .devbin
    exit 0
fi

: "${OUT:?OUT must name the folder results are written to}"
# The Vulkan loader carried in .gl/, pointed at the NVIDIA driver.
for f in .gl/*.deb; do dpkg -x "$f" /; done
ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json

K=./.devbin/k3
M=/tmp/k3slice
# Eight prompt ids; the first is the BOS token.
P8="163584,1000,2000,3000,4000,5000,6000,7000"
synth() {
    [ -f "$M/config.json" ] || "$K" synth --preset k3-slice --layers 4 "$M" > "$OUT/synth.txt" 2>&1
}
greedy_ids() { # backend: six greedy ids after P8, the experts cached in RAM (and VRAM)
    "$K" run "$M" --ids "$P8" --ngen 6 --ignore-eos --quiet --backend "$1" --expert-gb 60 \
        --gpu-expert-gb 60 > "$OUT/ids_$1.txt" 2> "$OUT/ids_$1.err"
    echo "$1 greedy ids: $(cat "$OUT/ids_$1.txt")"
}
sweep() { # name, k3 flags...: `k3 bench decode` at a cold and a 16 GB host cache
    local name=$1
    shift
    timeout 240 "$K" bench decode "$M" "$@" --expert-gb-list 0,16 --runs 2 --ngen 6 \
        --out "$OUT/sweep_$name" --quiet > "$OUT/decode_$name.md" 2> "$OUT/decode_$name.err"
    echo "== decode sweep, $name"
    cat "$OUT/decode_$name.md"
}

if [ "${1:-}" = cpu ]; then
    synth
    greedy_ids cpu
    sweep cpu --backend cpu
    exit 0
fi

"$K" devices > "$OUT/devices.txt" 2>&1
( synth ) &
SYNTH=$!
CI=true timeout 120 ./.devbin/gpu gpu_ops:: > "$OUT/gpu_ops.txt" 2>&1
grep -E "test result|FAILED|panicked" "$OUT/gpu_ops.txt" | head -5
wait "$SYNTH"
tail -1 "$OUT/synth.txt"
# After the synth: it loads the disk and the CPUs, which the kernel times would feel.
# shellcheck disable=SC2086
timeout 240 ./.devbin/gpu_kernels ${BENCH_ARGS:-} > "$OUT/kernels.txt" 2>&1
grep -E "^adapter|% of read|no GPU" "$OUT/kernels.txt" | head -40
greedy_ids gpu
for tier in 0 2; do
    sweep "gpu_tier$tier" --backend gpu --gpu-expert-gb "$tier"
done
