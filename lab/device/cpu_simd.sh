#!/usr/bin/env bash
# SIMD level measurements on the device machine: the CPU's flags; every SIMD level's
# kernels against portable (tests/ops/simd_kernels.rs, AVX-512 included, and tests/ops/quant.rs's
# SIMD tests); the one-core matvec bench (every format and level against a plain read);
# the KDA/MLA vector kernel bench; the backend line on each level. Binaries carried in
# .devbin/: ops-simd (the `ops` test binary, `cargo test --release --test ops --no-run`), matvec-simd,
# attn-simd (`cargo bench --no-run`), k3-simd.
#   usage: bash lab/device/cpu_simd.sh [MATVEC_FILTER]
set -u
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
echo "flags: $(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -E 'avx2|fma|avx512|vnni' | sort -u | tr '\n' ' ')"
echo "== tests/ops/simd_kernels.rs"
.devbin/ops-simd simd_kernels:: --nocapture 2>&1 | grep -E 'SKIPPED|checked|^test |test result'
echo "== tests/ops/quant.rs simd"
.devbin/ops-simd quant:: 2>&1 | grep -E '^test .*simd|test result'
for level in portable avx2 avx512; do
    echo "K3_SIMD=$level: $(K3_SIMD=$level .devbin/k3-simd run --demo --backend cpu --ngen 2 2>&1 | grep 'backend:')"
done
echo "== benches/cpu_attention.rs"
.devbin/attn-simd --bench 2>&1
echo "== benches/matvec.rs"
.devbin/matvec-simd --bench ${1:-} 2>&1
