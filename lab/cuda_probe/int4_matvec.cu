// Diagnostic only, not part of k3: the one-token int4 matvec of shaders_wgsl/matvec_int4.wgsl
// (DEC 1: f32 decode by mantissa placement; 32 lanes a row, 4 rows a lane, the next unit's
// weights requested before this one is computed) written again in CUDA, so that Nsight
// Compute, which profiles CUDA but not Vulkan, can say where such a kernel's time goes on the
// H200; with a plain read kernel over the same bytes, as `benches/gpu_kernels.rs` compares.
//
// Variants: the WGSL kernel's structure; the same loads with the decode replaced by a bit
// cast (session 3's "decode removed"); x staged in shared memory once a block; x read from
// one address by every lane (session 3's "x from one address"); x in shared memory padded
// against bank conflicts (also at 8 rows a lane); x read coalesced from a permuted copy
// (also with the decode removed). Session 9's results: lab/notebook.md, "The CUDA twin".
//
// Build and run on the device (lab/device/device_cuda_probe.sh does both, and ncu):
//   nvcc -O3 -arch=sm_90 -Xptxas -v -o int4_probe lab/cuda_probe/int4_matvec.cu
//   ./int4_probe            # check against the host, then each variant timed against the read
//   ./int4_probe profile    # each variant launched once a shape, for ncu
#include "probe_common.cuh"

// Lane k of the low half-word of `o` (offset binary) times 16^k, exactly: the nibble placed
// in the mantissa of 2^23, minus 2^23 and the bias.
__device__ __forceinline__ float4 nib4(uint32_t o) {
    return make_float4(__uint_as_float((o & 0xFu) | 0x4B000000u) - 8388616.0f,
                       __uint_as_float((o & 0xF0u) | 0x4B000000u) - 8388736.0f,
                       __uint_as_float((o & 0xF00u) | 0x4B000000u) - 8390656.0f,
                       __uint_as_float((o & 0xF000u) | 0x4B000000u) - 8421376.0f);
}

// w: rows × units uint4 (32 int4 columns each, low nibble = even column); sc: rows × units/2
// f32 scales (one per 64 columns). DECODE false: the decode replaced by a bit cast.
template <bool DECODE>
struct Int4 {
    struct Unit {
        uint4 q;
        float s;
    };
    static __device__ __forceinline__ Unit load(const uint4* w, const void* sc, size_t row, int u, int units) {
        return {w[row * units + u], static_cast<const float*>(sc)[row * (units / 2) + u / 2]};
    }
    // x lane k pre-scaled by 16^-k, so each product equals the plain one.
    static __device__ __forceinline__ float4 prep(float4 v) {
        return make_float4(v.x, v.y * 0.0625f, v.z * 0.00390625f, v.w * 0.000244140625f);
    }
    static __device__ __forceinline__ float dot(const Unit& a, const float4 (&xv)[8]) {
        const uint32_t qs[4] = {a.q.x, a.q.y, a.q.z, a.q.w};
        float d = 0.0f;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            if (!DECODE) {
                const float4 c = make_float4(__uint_as_float(qs[i] & 0x3F7FFFFFu), 0.f, 0.f, 0.f);
                d += dot4(c, xv[2 * i]) + dot4(c, xv[2 * i + 1]);
            } else {
                const uint32_t o = qs[i] ^ 0x88888888u;
                d += dot4(nib4(o), xv[2 * i]) + dot4(nib4(o >> 16), xv[2 * i + 1]);
            }
        }
        return d * a.s;
    }
};

// The matvec of rows [0, n) on the host, from the same bytes.
static void reference(const std::vector<uint32_t>& w, const std::vector<float>& sc, const std::vector<float>& x,
                      int n, int units, std::vector<double>& out) {
    out.assign(n, 0.0);
    for (int r = 0; r < n; r++) {
        double acc = 0;
        for (int c = 0; c < units * 32; c++) {
            const uint32_t word = w[(size_t)r * units * 4 + c / 8];
            const int nib = (word >> (4 * (c % 8))) & 0xF;
            const int v = nib >= 8 ? nib - 16 : nib;
            acc += (double)v * sc[(size_t)r * (units / 2) + c / 64] * x[c];
        }
        out[r] = acc;
    }
}

int main(int argc, char** argv) {
    const bool profile = argc > 1 && std::string(argv[1]) == "profile";
    const int cols = 7168, units = cols / 32;
    const size_t max_rows = 163840;
    const size_t wbytes = max_rows * units * 16, sbytes = max_rows * (units / 2) * 4;
    const Buffers b = alloc_buffers(wbytes, sbytes, cols, max_rows, 1u);
    // Scales in [2^-8, 2^-7): positive, exact, and with x in [-1, 1) sums stay small.
    const std::vector<float> hsc = upload_scales<float>(b.sc, sbytes / 4, 7, [] {
        return (1.0f + (rand() % 1024) / 1024.0f) / 256.0f;
    });
    const std::vector<float> hx = random_x(b.x, cols, 9);
    std::vector<double> want;
    reference(head_words(b.w, (size_t)64 * units * 4), hsc, hx, 64, units, want);

    const Variant variants[8] = {
        {"WGSL structure", 32, RPL, launch<Int4<true>, 32, X_GLOBAL>},
        {"decode removed", 32, RPL, launch<Int4<false>, 32, X_GLOBAL>},
        {"x in shared memory", 32, RPL, launch<Int4<true>, 32, X_SHARED>},
        {"x from one address", 32, RPL, launch<Int4<true>, 32, X_ONE>},
        {"x in shared, padded", 32, RPL, launch<Int4<true>, 32, X_SHARED_PAD>},
        {"x coalesced (permuted)", 32, RPL, launch<Int4<true>, 32, X_PERM>},
        {"x coalesced, decode removed", 32, RPL, launch<Int4<false>, 32, X_PERM>},
        // More rows a lane: each staged x load serves eight rows, at more registers.
        {"x shared padded, 8 rows a lane", 32, 8, launch<Int4<true>, 32, X_SHARED_PAD, 8>},
    };
    run_variants(profile, "int4 matvec", variants, 8, {0, 2, 4, 5, 7}, 12288, {12288, 163840}, cols, (size_t)units * 16 + (size_t)(units / 2) * 4, b, want);
    return 0;
}
