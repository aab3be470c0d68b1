// Diagnostic only, not part of k3: the one-token MXFP4 matvec of shaders_wgsl/matvec_mxfp4.wgsl
// (the default decode: two nibbles placed as one f16 pair and widened; one E8M0 scale a
// 32-column unit; 4 rows a lane; the next unit's weights requested before this one is
// computed) written again in CUDA for Nsight Compute, at the shapes of the batched-expert
// target: 16 experts' w1|w3 for one token are 98304 rows × 3584 columns against one x, and
// one expert's 3072 rows.
//
// Variants: LPR 32 lanes a row (the dense geometry) or 8 (the expert kernel's lanes, here
// side by side in a warp); MODE 0 the real decode, 1 decode removed (same loads), 3 x from
// one address. Build, run and profile as int4_matvec.cu (tools/device_cuda_probe.sh).
#include <cuda_fp16.h>

#include <cstring>

#include "probe_common.cuh"

constexpr int RPL = 4;  // rows a lane

// Nibbles j and j + 4 of `q` as the f16 pair whose values are their E2M1 values times 2^-14.
__device__ __forceinline__ float2 pair(uint32_t q, int j) {
    const uint32_t n = q >> (4 * j);
    const uint32_t h = ((n & 0x00070007u) << 9) | ((n & 0x00080008u) << 12);
    __half2 v;
    memcpy(&v, &h, 4);
    return __half22float2(v);
}

template <int MODE>
__device__ __forceinline__ float unit_dot(uint4 q, const float4 (&xv)[8]) {
    const uint32_t qs[4] = {q.x, q.y, q.z, q.w};
    float d = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        float4 lo, hi;
        if (MODE == 1) {
            lo = make_float4(__uint_as_float(qs[i] & 0x3F7FFFFFu), 0.f, 0.f, 0.f);
            hi = lo;
        } else {
            const float2 a = pair(qs[i], 0), c = pair(qs[i], 1), e = pair(qs[i], 2), g = pair(qs[i], 3);
            lo = make_float4(a.x, c.x, e.x, g.x);
            hi = make_float4(a.y, c.y, e.y, g.y);
        }
        d += dot4(lo, xv[2 * i]) + dot4(hi, xv[2 * i + 1]);
    }
    return d;
}

// w: rows × units uint4; sc: rows × units E8M0 bytes, four to a word; x: units × 8 float4.
// Lane groups of LPR share a row group of RPL rows; rows past the end repeat the last and
// are not written, so every lane reaches the shuffles.
template <int MODE, int LPR>
__global__ void __launch_bounds__(WG) mxfp4_mv(const uint4* __restrict__ w, const uint32_t* __restrict__ sc,
                                               const float4* __restrict__ x, float* __restrict__ y, int rows,
                                               int units) {
    const int lane = threadIdx.x % LPR;
    const int row0 = (blockIdx.x * (WG / LPR) + threadIdx.x / LPR) * RPL;
    float acc[RPL];
    uint4 cw[RPL];
    uint32_t cs[RPL];
#pragma unroll
    for (int r = 0; r < RPL; r++) acc[r] = 0.0f;
    auto load = [&](int u, uint4 (&ww)[RPL], uint32_t (&ss)[RPL]) {
#pragma unroll
        for (int r = 0; r < RPL; r++) {
            const size_t rr = min(row0 + r, rows - 1);
            const size_t si = rr * units + u;
            ww[r] = w[si];
            ss[r] = (sc[si >> 2] >> ((si & 3) * 8)) & 0xFFu;
        }
    };
    int u = lane;
    load(min(u, units - 1), cw, cs);
    while (u < units) {
        const int un = u + LPR;
        uint4 nw[RPL];
        uint32_t ns[RPL];
        load(min(un, units - 1), nw, ns);
        float4 xv[8];
        const int xb = MODE == 3 ? 0 : u * 8;
#pragma unroll
        for (int i = 0; i < 8; i++) xv[i] = x[xb + i];
#pragma unroll
        for (int r = 0; r < RPL; r++) {
            acc[r] += unit_dot<MODE>(cw[r], xv) * (__uint_as_float(cs[r] << 23) * 16384.0f);
            cw[r] = nw[r];
            cs[r] = ns[r];
        }
        u = un;
    }
#pragma unroll
    for (int r = 0; r < RPL; r++) {
        float s = acc[r];
        for (int o = LPR / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xFFFFFFFFu, s, o);
        if (lane == 0 && row0 + r < rows) y[row0 + r] = s;
    }
}

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
    const int shapes[2] = {98304, 3072};
    const size_t max_rows = 98304;
    const size_t wbytes = max_rows * units * 16, sbytes = max_rows * units;
    uint4* w;
    uint32_t *sc, *sink;
    float* y;
    float4* x;
    // The read kernel reads weights and scales' worth of bytes from w: room for both.
    CK(cudaMalloc(&w, wbytes + sbytes));
    CK(cudaMalloc(&sc, sbytes));
    CK(cudaMalloc(&x, cols * 4));
    CK(cudaMalloc(&y, max_rows * 4));
    CK(cudaMalloc(&sink, 4));
    fill_words<<<4096, 256>>>((uint32_t*)w, (wbytes + sbytes) / 4, 3u);
    // Scales 2^-7 .. 2^2: the kernel's common path (the engine takes another above 240).
    std::vector<uint8_t> hsc(sbytes);
    std::vector<float> hx(cols);
    srand(11);
    for (auto& s : hsc) s = (uint8_t)(120 + rand() % 10);
    for (auto& v : hx) v = (rand() % 2048) / 1024.0f - 1.0f;
    CK(cudaMemcpy(sc, hsc.data(), sbytes, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(x, hx.data(), cols * 4, cudaMemcpyHostToDevice));
    CK(cudaDeviceSynchronize());

    const int check_rows = 64;
    std::vector<uint32_t> hw((size_t)check_rows * units * 4);
    CK(cudaMemcpy(hw.data(), w, hw.size() * 4, cudaMemcpyDeviceToHost));
    std::vector<double> want;
    reference(hw, hsc, hx, check_rows, units, want);

    struct Variant {
        const char* name;
        int lpr;
        void (*launch)(int, const uint4*, const uint32_t*, const float4*, float*, int, int);
    };
    const Variant variants[4] = {
        {"32 lanes a row", 32,
         [](int b, const uint4* w, const uint32_t* s, const float4* x, float* y, int r, int u) {
             mxfp4_mv<0, 32><<<b, WG>>>(w, s, x, y, r, u);
         }},
        {"8 lanes a row", 8,
         [](int b, const uint4* w, const uint32_t* s, const float4* x, float* y, int r, int u) {
             mxfp4_mv<0, 8><<<b, WG>>>(w, s, x, y, r, u);
         }},
        {"8, decode removed", 8,
         [](int b, const uint4* w, const uint32_t* s, const float4* x, float* y, int r, int u) {
             mxfp4_mv<1, 8><<<b, WG>>>(w, s, x, y, r, u);
         }},
        {"8, x from one address", 8,
         [](int b, const uint4* w, const uint32_t* s, const float4* x, float* y, int r, int u) {
             mxfp4_mv<3, 8><<<b, WG>>>(w, s, x, y, r, u);
         }},
    };
    for (int v = 0; v < 2 && !profile; v++) {
        const int rows = 3072, per_block = RPL * WG / variants[v].lpr;
        variants[v].launch((rows + per_block - 1) / per_block, w, sc, x, y, rows, units);
        CK(cudaDeviceSynchronize());
        std::vector<float> got(check_rows);
        CK(cudaMemcpy(got.data(), y, check_rows * 4, cudaMemcpyDeviceToHost));
        double err = 0, norm = 0;
        for (int r = 0; r < check_rows; r++) {
            err += (got[r] - want[r]) * (got[r] - want[r]);
            norm += want[r] * want[r];
        }
        printf("check %s: rel L2 %.2e over %d rows\n", variants[v].name, std::sqrt(err / norm), check_rows);
    }
    for (int rows : shapes) {
        const size_t bytes = (size_t)rows * units * 17;
        for (const Variant& v : variants) {
            const int per_block = RPL * WG / v.lpr;
            const int blocks = (rows + per_block - 1) / per_block;
            auto run = [&] { v.launch(blocks, w, sc, x, y, rows, units); };
            if (profile) {
                run();
                CK(cudaDeviceSynchronize());
                continue;
            }
            float ms, read_ms;
            time_vs_read(run, w, bytes, sink, &ms, &read_ms);
            printf("cuda mxfp4 matvec %dx%d, %-22s %8.1f us %8.1f GB/s   read %8.1f GB/s %6.1f %%\n", rows, cols,
                   v.name, ms * 1e3, bytes / ms / 1e6, bytes / read_ms / 1e6, 100.0 * read_ms / ms);
        }
    }
    return 0;
}
