// Diagnostic only, not part of k3: the one-token int4 matvec of shaders_wgsl/matvec_int4.wgsl
// (DEC 1: f32 decode by mantissa placement; 32 lanes a row, 4 rows a lane, the next unit's
// weights requested before this one is computed) written again in CUDA, so that Nsight
// Compute, which profiles CUDA but not Vulkan, can say where such a kernel's time goes on the
// H200; with a plain read kernel over the same bytes, as `benches/gpu_kernels.rs` compares.
//
// Variants (MODE): 0 the WGSL kernel's structure; 1 the same loads with the decode replaced
// by a bit cast (session 3's "decode removed"); 2 x staged in shared memory once a block;
// 3 x read from one address by every lane (session 3's "x from one address").
//
// Build and run on the device (tools/device_cuda_probe.sh does both, and ncu):
//   nvcc -O3 -arch=sm_90 -Xptxas -v -o int4_probe tools/cuda_probe/int4_matvec.cu
//   ./int4_probe            # check against the host, then each variant timed against the read
//   ./int4_probe profile    # each variant launched once a shape, for ncu
#include "probe_common.cuh"

constexpr int RPL = 4;  // rows a lane

// Lane k of the low half-word of `o` (offset binary) times 16^k, exactly: the nibble placed
// in the mantissa of 2^23, minus 2^23 and the bias.
__device__ __forceinline__ float4 nib4(uint32_t o) {
    return make_float4(__uint_as_float((o & 0xFu) | 0x4B000000u) - 8388616.0f,
                       __uint_as_float((o & 0xF0u) | 0x4B000000u) - 8388736.0f,
                       __uint_as_float((o & 0xF00u) | 0x4B000000u) - 8390656.0f,
                       __uint_as_float((o & 0xF000u) | 0x4B000000u) - 8421376.0f);
}

template <int MODE>
__device__ __forceinline__ float unit_dot(uint4 q, const float4 (&xv)[8]) {
    const uint32_t qs[4] = {q.x, q.y, q.z, q.w};
    float d = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        if (MODE == 1) {
            float4 a = make_float4(__uint_as_float(qs[i] & 0x3F7FFFFFu), 0.f, 0.f, 0.f);
            d += dot4(a, xv[2 * i]) + dot4(a, xv[2 * i + 1]);
        } else {
            uint32_t o = qs[i] ^ 0x88888888u;
            d += dot4(nib4(o), xv[2 * i]) + dot4(nib4(o >> 16), xv[2 * i + 1]);
        }
    }
    return d;
}

// w: rows × units uint4 (32 int4 columns each, low nibble = even column); sc: rows × units/2
// f32 scales (one per 64 columns); x: units × 8 float4.
template <int MODE>
__global__ void __launch_bounds__(WG) int4_mv(const uint4* __restrict__ w, const float* __restrict__ sc,
                                              const float4* __restrict__ x, float* __restrict__ y,
                                              int rows, int units) {
    extern __shared__ float4 xs[];
    const int lane = threadIdx.x & 31;
    const int row0 = (blockIdx.x * (WG / 32) + (threadIdx.x >> 5)) * RPL;
    if (MODE == 2) {
        for (int i = threadIdx.x; i < units * 8; i += WG) xs[i] = x[i];
        __syncthreads();
    }
    if (row0 >= rows) return;
    const float4* xp = MODE == 2 ? xs : x;
    const int groups = units / 2;
    const float4 xs4 = make_float4(1.0f, 0.0625f, 0.00390625f, 0.000244140625f);
    float acc[RPL];
    uint4 cw[RPL];
    float cs[RPL];
#pragma unroll
    for (int r = 0; r < RPL; r++) acc[r] = 0.0f;
    auto load = [&](int u, uint4 (&ww)[RPL], float (&ss)[RPL]) {
#pragma unroll
        for (int r = 0; r < RPL; r++) {
            const size_t rr = min(row0 + r, rows - 1);
            ww[r] = w[rr * units + u];
            ss[r] = sc[rr * groups + u / 2];
        }
    };
    int u = lane;
    load(min(u, units - 1), cw, cs);
    while (u < units) {
        const int un = u + 32;
        uint4 nw[RPL];
        float ns[RPL];
        load(min(un, units - 1), nw, ns);
        float4 xv[8];
        const int xb = MODE == 3 ? 0 : u * 8;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            float4 v = xp[xb + i];
            xv[i] = make_float4(v.x * xs4.x, v.y * xs4.y, v.z * xs4.z, v.w * xs4.w);
        }
#pragma unroll
        for (int r = 0; r < RPL; r++) {
            acc[r] += unit_dot<MODE>(cw[r], xv) * cs[r];
            cw[r] = nw[r];
            cs[r] = ns[r];
        }
        u = un;
    }
#pragma unroll
    for (int r = 0; r < RPL; r++) {
        float s = acc[r];
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xFFFFFFFFu, s, o);
        if (lane == 0 && row0 + r < rows) y[row0 + r] = s;
    }
}

// The matvec of rows [0, n) on the host, from the same bytes.
static void reference(const std::vector<uint32_t>& w, const std::vector<float>& sc, const std::vector<float>& x,
                      int n, int units, std::vector<double>& out) {
    const int cols = units * 32;
    out.assign(n, 0.0);
    for (int r = 0; r < n; r++) {
        double acc = 0;
        for (int c = 0; c < cols; c++) {
            uint32_t word = w[(size_t)r * units * 4 + c / 8];
            int nib = (word >> (4 * (c % 8))) & 0xF;
            int v = nib >= 8 ? nib - 16 : nib;
            acc += (double)v * sc[(size_t)r * (units / 2) + c / 64] * x[c];
        }
        out[r] = acc;
    }
}

int main(int argc, char** argv) {
    const bool profile = argc > 1 && std::string(argv[1]) == "profile";
    const int cols = 7168, units = cols / 32;
    const int shapes[2] = {12288, 163840};
    const size_t max_rows = 163840;
    uint4* w;
    float *sc, *y;
    float4* x;
    uint32_t* sink;
    const size_t wbytes = max_rows * units * 16, sbytes = max_rows * (units / 2) * 4;
    // The read kernel reads weights and scales' worth of bytes from w: room for both.
    CK(cudaMalloc(&w, wbytes + sbytes));
    CK(cudaMalloc(&sc, sbytes));
    CK(cudaMalloc(&x, cols * 4));
    CK(cudaMalloc(&y, max_rows * 4));
    CK(cudaMalloc(&sink, 4));
    fill_words<<<4096, 256>>>((uint32_t*)w, (wbytes + sbytes) / 4, 1u);
    // Scales in [2^-8, 2^-7): positive, exact, and with x in [-1, 1) sums stay small.
    std::vector<float> hsc(max_rows * (units / 2)), hx(cols);
    srand(7);
    for (auto& s : hsc) s = (1.0f + (rand() % 1024) / 1024.0f) / 256.0f;
    for (auto& v : hx) v = (rand() % 2048) / 1024.0f - 1.0f;
    CK(cudaMemcpy(sc, hsc.data(), sbytes, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(x, hx.data(), cols * 4, cudaMemcpyHostToDevice));
    CK(cudaDeviceSynchronize());

    // Correctness of the real kernel and of the shared-memory one against the host.
    const int check_rows = 64;
    std::vector<uint32_t> hw((size_t)check_rows * units * 4);
    CK(cudaMemcpy(hw.data(), w, hw.size() * 4, cudaMemcpyDeviceToHost));
    std::vector<double> want;
    reference(hw, hsc, hx, check_rows, units, want);
    const int smem = units * 8 * 16;
    CK(cudaFuncSetAttribute(int4_mv<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    for (int mode : {0, 2}) {
        if (profile) break;
        const int rows = 12288, blocks = rows / (RPL * WG / 32);
        if (mode == 0) int4_mv<0><<<blocks, WG>>>(w, sc, x, y, rows, units);
        else int4_mv<2><<<blocks, WG, smem>>>(w, sc, x, y, rows, units);
        CK(cudaDeviceSynchronize());
        std::vector<float> got(check_rows);
        CK(cudaMemcpy(got.data(), y, check_rows * 4, cudaMemcpyDeviceToHost));
        double err = 0, norm = 0;
        for (int r = 0; r < check_rows; r++) {
            err += (got[r] - want[r]) * (got[r] - want[r]);
            norm += want[r] * want[r];
        }
        printf("check mode %d: rel L2 %.2e over %d rows\n", mode, sqrt(err / norm), check_rows);
    }

    const char* names[4] = {"WGSL structure", "decode removed", "x in shared memory", "x from one address"};
    for (int rows : shapes) {
        const int blocks = (rows + RPL * WG / 32 - 1) / (RPL * WG / 32);
        const size_t bytes = (size_t)rows * units * 16 + (size_t)rows * (units / 2) * 4;
        for (int mode = 0; mode < 4; mode++) {
            auto run = [&] {
                switch (mode) {
                    case 0: int4_mv<0><<<blocks, WG>>>(w, sc, x, y, rows, units); break;
                    case 1: int4_mv<1><<<blocks, WG>>>(w, sc, x, y, rows, units); break;
                    case 2: int4_mv<2><<<blocks, WG, smem>>>(w, sc, x, y, rows, units); break;
                    default: int4_mv<3><<<blocks, WG>>>(w, sc, x, y, rows, units); break;
                }
            };
            if (profile) {
                run();
                CK(cudaDeviceSynchronize());
                continue;
            }
            float ms, read_ms;
            time_vs_read(run, w, bytes, sink, &ms, &read_ms);
            printf("cuda int4 matvec %dx%d, %-20s %8.1f us %8.1f GB/s   read %8.1f GB/s %6.1f %%\n", rows, cols,
                   names[mode], ms * 1e3, bytes / ms / 1e6, bytes / read_ms / 1e6, 100.0 * read_ms / ms);
        }
    }
    return 0;
}
