#!/usr/bin/env bash
# Regenerate tests/fixtures/conformance/* from scratch: fetch llama.cpp (vendored in the
# llama-cpp-python sdist on PyPI), build it (CPU), make a Python venv for its converter,
# synthesize the checkpoints with `k3 synth`, convert them to f32 GGUF, and write
# llama.cpp's logits for every prompt position. See docs/conformance.md.
#
# Usage: tools/conformance/make_fixtures.sh [SCRATCH_DIR]
#   SCRATCH_DIR (default /work/scratch-conf, or $K3_CONF_SCRATCH) holds everything that
#   is built or downloaded; it is outside the repository and never committed.
# Environment: LLAMA_CPP_PYTHON_VERSION (default 0.3.36), JOBS (default 2).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
SCRATCH="${1:-${K3_CONF_SCRATCH:-/work/scratch-conf}}"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
JOBS="${JOBS:-2}"
HERE="$REPO/tools/conformance"
mkdir -p "$SCRATCH"
SCRATCH="$(cd "$SCRATCH" && pwd)"
cd "$SCRATCH"
export K3_CONF_SCRATCH="$SCRATCH"

# --- llama.cpp source -------------------------------------------------------------
SRC="$SCRATCH/llama_cpp_python-$VERSION/vendor/llama.cpp"
if [ ! -f "$SRC/src/models/kimi-k3.cpp" ]; then
    # --no-binary for this package only: its build dependencies may come as wheels.
    python3 -m pip download --no-deps --no-binary llama-cpp-python \
        "llama-cpp-python==$VERSION" -d "$SCRATCH/sdist"
    tar xzf "$SCRATCH/sdist/llama_cpp_python-$VERSION.tar.gz" -C "$SCRATCH"
fi
[ -f "$SRC/src/models/kimi-k3.cpp" ] || { echo "llama-cpp-python $VERSION has no kimi-k3 model; set LLAMA_CPP_PYTHON_VERSION" >&2; exit 1; }

# --- build libllama (CPU) and our logits dumper ------------------------------------
BUILD="$SCRATCH/build"
if [ ! -f "$BUILD/src/libllama.a" ]; then
    cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
        -DLLAMA_BUILD_TOOLS=OFF -DBUILD_SHARED_LIBS=OFF
    cmake --build "$BUILD" --target llama -j"$JOBS"
fi
DUMPER="$SCRATCH/llama_logits"
if [ ! -x "$DUMPER" ] || [ "$HERE/llama_logits.cpp" -nt "$DUMPER" ]; then
    g++ -O2 -std=c++17 "$HERE/llama_logits.cpp" -I"$SRC/include" -I"$SRC/ggml/include" \
        "$BUILD/src/libllama.a" "$BUILD/ggml/src/libggml.a" "$BUILD/ggml/src/libggml-cpu.a" \
        "$BUILD/ggml/src/libggml-base.a" -fopenmp -lpthread -ldl -o "$DUMPER"
fi

# --- Python for the converter and the numpy reference -------------------------------
VENV="$SCRATCH/venv"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install numpy safetensors torch "transformers==4.57.6" sentencepiece
fi
PY="$VENV/bin/python"

# --- k3 itself ----------------------------------------------------------------------
(cd "$REPO" && cargo build --release --bin k3)
K3="$REPO/target/release/k3"

# --- fixtures -----------------------------------------------------------------------
# 24 prompt positions: ids spread over the vocabulary, with repeats (the recurrent and
# attention states must handle a token seen before).
IDS="1,768,17,512,1000,3,3,250,999,42,600,7,128,900,64,5,333,1023,0,77,701,12,450,88"

make_one() {  # name preset seed
    local name="$1" preset="$2" seed="$3"
    local model="$SCRATCH/ckpt/$name" work="$SCRATCH/work/$name"
    rm -rf "$model"
    "$K3" synth --preset "$preset" --seed "$seed" "$model"
    "$PY" "$HERE/make_fixture.py" --model "$model" --preset "$preset" --seed "$seed" \
        --ids "$IDS" --llama-src "$SRC" --llama-logits "$DUMPER" --work "$work" \
        --out "$REPO/tests/fixtures/conformance/$name" \
        --synth-command "k3 synth --preset $preset --seed $seed MODEL_DIR"
}

make_one tiny-seed1 tiny 1
make_one tiny-seed2 tiny 2
make_one small-seed1 small 1
