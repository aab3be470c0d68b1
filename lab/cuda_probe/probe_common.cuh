// What the CUDA probes share (not part of k3): error checks, the bench's read kernel, a fill,
// and timing a kernel against the read kernel with their runs interleaved, as
// `benches/gpu_kernels.rs` does.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <string>
#include <vector>

#define CK(call)                                                                    \
    do {                                                                            \
        cudaError_t e_ = (call);                                                    \
        if (e_ != cudaSuccess) {                                                    \
            fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
            exit(1);                                                                \
        }                                                                           \
    } while (0)

constexpr int WG = 256;  // threads a block
constexpr int REPS = 20;

__device__ __forceinline__ float dot4(float4 a, float4 b) {
    return a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
}

constexpr int RPL = 4;  // rows a lane, as the WGSL kernels' default

// Where a lane's x comes from: global memory (as the WGSL kernels read it), shared memory
// staged once a block, or one address for every lane and unit (session 3's diagnostic);
// shared memory with one pad vec4 after each unit's eight (a lane's 128-byte slice then
// starts 4 banks after its neighbour's, so a quarter-warp's 16-byte reads meet no bank
// conflict); or global memory in the coalesced order `perm_x` writes (at load i the LPR
// lanes of a row read adjacent vec4s).
enum XFrom { X_GLOBAL = 0, X_SHARED = 1, X_ONE = 2, X_SHARED_PAD = 3, X_PERM = 4 };

// Where `perm_x` puts x's copy in the order of LPR lanes a row (after x, one copy a width).
__host__ __device__ constexpr int perm_offset(int lpr, int units) { return units * 8 * (lpr == 32 ? 1 : 2); }

// Where vec4 i of unit u sits in that copy: blocks of LPR units (the last may be narrower),
// their i-th vec4s side by side.
__host__ __device__ inline int perm_index(int lpr, int units, int u, int i) {
    const int b = u / lpr * lpr;
    return b * 8 + i * (units - b < lpr ? units - b : lpr) + u - b;
}

// The row-split driver of shaders_wgsl/matvec_common.wgsl: lane groups of LPR share a row
// group of R rows and walk its 16-byte units LPR apart, the next unit's weights requested
// before this one is computed; then each group's sums meet through shuffles. The format F
// gives `Unit` (one row's unit and its scale), `load`, `prep` (x as the decode wants it)
// and `dot`. Rows past the end repeat the last and are not written, so every lane reaches
// the shuffles.
template <class F, int LPR, int XF, int R = RPL>
__global__ void __launch_bounds__(WG) matvec(const uint4* __restrict__ w, const void* __restrict__ sc,
                                             const float4* __restrict__ x, float* __restrict__ y, int rows,
                                             int units) {
    extern __shared__ float4 xs[];
    constexpr bool staged = XF == X_SHARED || XF == X_SHARED_PAD;
    if (staged) {
        for (int i = threadIdx.x; i < units * 8; i += WG) xs[XF == X_SHARED_PAD ? i / 8 * 9 + i % 8 : i] = x[i];
        __syncthreads();
    }
    const float4* xp = staged ? xs : XF == X_PERM ? x + perm_offset(LPR, units) : x;
    const int lane = threadIdx.x % LPR;
    const int row0 = (blockIdx.x * (WG / LPR) + threadIdx.x / LPR) * R;
    float acc[R];
    typename F::Unit cur[R];
    auto load = [&](int u, typename F::Unit(&d)[R]) {
#pragma unroll
        for (int r = 0; r < R; r++) d[r] = F::load(w, sc, (size_t)min(row0 + r, rows - 1), u, units);
    };
#pragma unroll
    for (int r = 0; r < R; r++) acc[r] = 0.0f;
    int u = lane;
    load(min(u, units - 1), cur);
    while (u < units) {
        const int un = u + LPR;
        typename F::Unit nxt[R];
        load(min(un, units - 1), nxt);
        float4 xv[8];
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const int xi = XF == X_ONE          ? i
                           : XF == X_SHARED_PAD ? u * 9 + i
                           : XF == X_PERM       ? perm_index(LPR, units, u, i)
                                                : u * 8 + i;
            xv[i] = F::prep(xp[xi]);
        }
#pragma unroll
        for (int r = 0; r < R; r++) {
            acc[r] += F::dot(cur[r], xv);
            cur[r] = nxt[r];
        }
        u = un;
    }
#pragma unroll
    for (int r = 0; r < R; r++) {
        float s = acc[r];
        for (int o = LPR / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xFFFFFFFFu, s, o);
        if (lane == 0 && row0 + r < rows) y[row0 + r] = s;
    }
}

// Launches `matvec` on `n` blocks, with x's shared-memory copy where XF asks for one (at
// most 28 KB here, under the 48 KB a block gets without opting in).
template <class F, int LPR, int XF, int R = RPL>
static void launch(int n, const uint4* w, const void* sc, const float4* x, float* y, int rows, int units) {
    const size_t smem = XF == X_SHARED ? (size_t)units * 8 * 16 : XF == X_SHARED_PAD ? (size_t)units * 9 * 16 : 0;
    if (smem > 48 * 1024) CK(cudaFuncSetAttribute(matvec<F, LPR, XF, R>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    matvec<F, LPR, XF, R><<<n, WG, smem>>>(w, sc, x, y, rows, units);
}

// A variant of a probe: its name, lanes and rows a lane, and its launch.
struct Variant {
    const char* name;
    int lpr;
    int rpl;
    void (*run)(int, const uint4*, const void*, const float4*, float*, int, int);
};

// Blocks for `rows` rows at LPR lanes a row and `rpl` rows a lane.
static inline int blocks_for(int rows, int lpr, int rpl = RPL) {
    const int per_block = rpl * WG / lpr;
    return (rows + per_block - 1) / per_block;
}

// The bench's read kernel: every 16-byte word once, grid-stride, folded into a sink.
__global__ void read_words(const uint4* __restrict__ p, size_t n, uint32_t* sink) {
    uint32_t a = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint4 v = p[i];
        a ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (a == 0x9E3779B9u) sink[0] = a;
}

__global__ void fill_words(uint32_t* p, size_t n, uint32_t seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint32_t s = (uint32_t)i * 2654435761u ^ seed;
        s ^= s << 13;
        s ^= s >> 17;
        s ^= s << 5;
        p[i] = s;
    }
}

static inline float median(std::vector<float> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

// Median ms of `f` and of the read kernel over `bytes`, their runs interleaved.
template <class F>
static void time_vs_read(F f, const uint4* src, size_t bytes, uint32_t* sink, float* ms, float* read_ms) {
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    std::vector<float> t1, t2;
    f();
    read_words<<<132 * 8 * 4, WG>>>(src, bytes / 16, sink);
    for (int r = 0; r < REPS; r++) {
        float t;
        CK(cudaEventRecord(a));
        f();
        CK(cudaEventRecord(b));
        CK(cudaEventSynchronize(b));
        CK(cudaEventElapsedTime(&t, a, b));
        t1.push_back(t);
        CK(cudaEventRecord(a));
        read_words<<<132 * 8 * 4, WG>>>(src, bytes / 16, sink);
        CK(cudaEventRecord(b));
        CK(cudaEventSynchronize(b));
        CK(cudaEventElapsedTime(&t, a, b));
        t2.push_back(t);
    }
    CK(cudaGetLastError());
    *ms = median(t1);
    *read_ms = median(t2);
}

// `n` scales from `gen()` after srand(seed), copied to the device at `dst`.
template <class S, class G>
static std::vector<S> upload_scales(void* dst, size_t n, unsigned seed, G gen) {
    std::vector<S> h(n);
    srand(seed);
    for (auto& s : h) s = gen();
    CK(cudaMemcpy(dst, h.data(), n * sizeof(S), cudaMemcpyHostToDevice));
    return h;
}

// x in [-1, 1) (multiples of 2^-10), on the host and copied to the device, followed by its
// X_PERM copies for 32 and for 8 lanes a row (`perm_index`).
static inline std::vector<float> random_x(float4* x, int cols, unsigned seed) {
    std::vector<float> hx(cols);
    srand(seed);
    for (auto& v : hx) v = (rand() % 2048) / 1024.0f - 1.0f;
    const int units = cols / 32;
    std::vector<float> all(hx);
    all.resize((size_t)cols * 3);
    for (int lpr : {32, 8}) {
        float* perm = all.data() + (size_t)perm_offset(lpr, units) * 4;
        for (int u = 0; u < units; u++)
            for (int i = 0; i < 8; i++)
                for (int k = 0; k < 4; k++) perm[(size_t)perm_index(lpr, units, u, i) * 4 + k] = hx[u * 32 + i * 4 + k];
    }
    CK(cudaMemcpy(x, all.data(), all.size() * 4, cudaMemcpyHostToDevice));
    return hx;
}

// The first `words` 32-bit words of w, read back for the host reference.
static inline std::vector<uint32_t> head_words(const uint4* w, size_t words) {
    std::vector<uint32_t> hw(words);
    CK(cudaMemcpy(hw.data(), w, words * 4, cudaMemcpyDeviceToHost));
    return hw;
}

// Prints the relative L2 error of y's first want.size() outputs (after `launch` ran).
static inline void check_rows(const char* what, const float* y, const std::vector<double>& want) {
    CK(cudaDeviceSynchronize());
    std::vector<float> got(want.size());
    CK(cudaMemcpy(got.data(), y, got.size() * 4, cudaMemcpyDeviceToHost));
    double err = 0, norm = 0;
    for (size_t r = 0; r < got.size(); r++) {
        err += (got[r] - want[r]) * (got[r] - want[r]);
        norm += want[r] * want[r];
    }
    printf("check %s: rel L2 %.2e over %zu rows\n", what, std::sqrt(err / norm), got.size());
}

// `profile`: launches `run` once (for ncu). Otherwise times it against the read kernel over
// `bytes` of `src` and prints the line `name`.
template <class F>
static void measure(bool profile, const std::string& name, F run, const uint4* src, size_t bytes, uint32_t* sink) {
    if (profile) {
        run();
        CK(cudaDeviceSynchronize());
        return;
    }
    float ms, read_ms;
    time_vs_read(run, src, bytes, sink, &ms, &read_ms);
    printf("%-58s %8.1f us %8.1f GB/s   read %8.1f GB/s %6.1f %%\n", name.c_str(), ms * 1e3, bytes / ms / 1e6,
           bytes / read_ms / 1e6, 100.0 * read_ms / ms);
}

// A probe's device buffers: weights (random words, with room past them for the read
// kernel to read weights and scales' worth of bytes), scales, x, y and the read sink.
struct Buffers {
    uint4* w;
    void* sc;
    float4* x;
    float* y;
    uint32_t* sink;
};

static inline Buffers alloc_buffers(size_t wbytes, size_t sbytes, int cols, size_t rows, uint32_t seed) {
    Buffers b;
    CK(cudaMalloc(&b.w, wbytes + sbytes));
    CK(cudaMalloc(&b.sc, sbytes));
    CK(cudaMalloc(&b.x, (size_t)cols * 3 * 4));
    CK(cudaMalloc(&b.y, rows * 4));
    CK(cudaMalloc(&b.sink, 4));
    fill_words<<<4096, 256>>>((uint32_t*)b.w, (wbytes + sbytes) / 4, seed);
    CK(cudaGetLastError());
    return b;
}

// A probe's run: the `checked` variants at `check_at` rows against `want` (unless
// `profile`), then every variant at each of `shapes` rows of `cols` columns (`row_bytes` of
// weights and scales a row), timed against the read kernel, or launched once for ncu.
static inline void run_variants(bool profile, const char* what, const Variant* vs, int nv,
                                std::initializer_list<int> checked, int check_at,
                                std::initializer_list<int> shapes, int cols, size_t row_bytes, const Buffers& b,
                                const std::vector<double>& want) {
    const int units = cols / 32;
    for (int v : checked) {
        if (profile) break;
        vs[v].run(blocks_for(check_at, vs[v].lpr, vs[v].rpl), b.w, b.sc, b.x, b.y, check_at, units);
        check_rows(vs[v].name, b.y, want);
    }
    for (int rows : shapes) {
        for (int i = 0; i < nv; i++) {
            const Variant& v = vs[i];
            measure(profile,
                    std::string("cuda ") + what + " " + std::to_string(rows) + "x" + std::to_string(cols) + ", " + v.name,
                    [&] { v.run(blocks_for(rows, v.lpr, v.rpl), b.w, b.sc, b.x, b.y, rows, units); }, b.w,
                    rows * row_bytes, b.sink);
        }
    }
}
