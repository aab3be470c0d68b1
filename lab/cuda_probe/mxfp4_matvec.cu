// Diagnostic only, not part of k3: the one-token MXFP4 matvec of shaders_wgsl/matvec_mxfp4.wgsl
// (the default decode: two nibbles placed as one f16 pair and widened; one E8M0 scale a
// 32-column unit; 4 rows a lane; the next unit's weights requested before this one is
// computed) written again in CUDA for Nsight Compute, at the shapes of the batched-expert
// target: 16 experts' w1|w3 for one token are 98304 rows × 3584 columns against one x, and
// one expert's 3072 rows.
//
// Variants: 32 lanes a row (the dense geometry) or 8 (the expert kernel's lanes, here side
// by side in a warp); at 8 lanes also the decode removed (same loads), x from one address,
// x staged in shared memory, padded and not, and x read coalesced from a permuted copy; at
// 32 lanes also the last two. Session 9's results: lab/notebook.md, "The CUDA twin".
// Build, run and profile as int4_matvec.cu (lab/device/device_cuda_probe.sh).
#include <cuda_fp16.h>

#include <cstring>

#include "probe_common.cuh"

// Nibbles j and j + 4 of `q` as the f16 pair whose values are their E2M1 values times 2^-14.
__device__ __forceinline__ float2 pair(uint32_t q, int j) {
    const uint32_t n = q >> (4 * j);
    const uint32_t h = ((n & 0x00070007u) << 9) | ((n & 0x00080008u) << 12);
    __half2 v;
    memcpy(&v, &h, 4);
    return __half22float2(v);
}

// w: rows × units uint4; sc: rows × units E8M0 bytes, four to a word. DECODE false: the
// decode replaced by a bit cast.
template <bool DECODE>
struct Mxfp4 {
    struct Unit {
        uint4 q;
        uint32_t s;
    };
    static __device__ __forceinline__ Unit load(const uint4* w, const void* sc, size_t row, int u, int units) {
        const size_t si = row * units + u;
        return {w[si], (static_cast<const uint32_t*>(sc)[si >> 2] >> ((si & 3) * 8)) & 0xFFu};
    }
    static __device__ __forceinline__ float4 prep(float4 v) { return v; }
    static __device__ __forceinline__ float dot(const Unit& a, const float4 (&xv)[8]) {
        const uint32_t qs[4] = {a.q.x, a.q.y, a.q.z, a.q.w};
        float d = 0.0f;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            float4 lo, hi;
            if (!DECODE) {
                lo = make_float4(__uint_as_float(qs[i] & 0x3F7FFFFFu), 0.f, 0.f, 0.f);
                hi = lo;
            } else {
                const float2 p0 = pair(qs[i], 0), p1 = pair(qs[i], 1), p2 = pair(qs[i], 2), p3 = pair(qs[i], 3);
                lo = make_float4(p0.x, p1.x, p2.x, p3.x);
                hi = make_float4(p0.y, p1.y, p2.y, p3.y);
            }
            d += dot4(lo, xv[2 * i]) + dot4(hi, xv[2 * i + 1]);
        }
        // The scale 2^(s-127), times 2^14 to undo the f16 placement.
        return d * (__uint_as_float(a.s << 23) * 16384.0f);
    }
};

// The matvec of rows [0, n) on the host, from the same bytes.
static void reference(const std::vector<uint32_t>& w, const std::vector<uint8_t>& sc, const std::vector<float>& x,
                      int n, int units, std::vector<double>& out) {
    static const double e2m1[8] = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0};
    out.assign(n, 0.0);
    for (int r = 0; r < n; r++) {
        double acc = 0;
        for (int c = 0; c < units * 32; c++) {
            const uint32_t word = w[(size_t)r * units * 4 + c / 8];
            const int nib = (word >> (4 * (c % 8))) & 0xF;
            const double v = (nib & 8 ? -1.0 : 1.0) * e2m1[nib & 7];
            acc += v * std::ldexp(1.0, (int)sc[(size_t)r * units + c / 32] - 127) * x[c];
        }
        out[r] = acc;
    }
}

int main(int argc, char** argv) {
    const bool profile = argc > 1 && std::string(argv[1]) == "profile";
    const int cols = 3584, units = cols / 32;
    const size_t max_rows = 98304;
    const size_t wbytes = max_rows * units * 16, sbytes = max_rows * units;
    const Buffers b = alloc_buffers(wbytes, sbytes, cols, max_rows, 3u);
    // Scales 2^-7 .. 2^2: the kernel's common path (the engine takes another above 240).
    const std::vector<uint8_t> hsc = upload_scales<uint8_t>(b.sc, sbytes, 11, [] { return (uint8_t)(120 + rand() % 10); });
    const std::vector<float> hx = random_x(b.x, cols, 13);
    std::vector<double> want;
    reference(head_words(b.w, (size_t)64 * units * 4), hsc, hx, 64, units, want);

    const Variant variants[9] = {
        {"32 lanes a row", 32, RPL, launch<Mxfp4<true>, 32, X_GLOBAL>},
        {"8 lanes a row", 8, RPL, launch<Mxfp4<true>, 8, X_GLOBAL>},
        {"8, decode removed", 8, RPL, launch<Mxfp4<false>, 8, X_GLOBAL>},
        {"8, x from one address", 8, RPL, launch<Mxfp4<true>, 8, X_ONE>},
        {"8, x in shared memory", 8, RPL, launch<Mxfp4<true>, 8, X_SHARED>},
        {"8, x in shared, padded", 8, RPL, launch<Mxfp4<true>, 8, X_SHARED_PAD>},
        {"8, x coalesced (permuted)", 8, RPL, launch<Mxfp4<true>, 8, X_PERM>},
        {"32, x coalesced (permuted)", 32, RPL, launch<Mxfp4<true>, 32, X_PERM>},
        {"32, x in shared, padded", 32, RPL, launch<Mxfp4<true>, 32, X_SHARED_PAD>},
    };
    run_variants(profile, "mxfp4 matvec", variants, 9, {0, 1, 4, 5, 6, 7, 8}, 3072, {98304, 3072}, cols, (size_t)units * 17, b, want);
    return 0;
}
