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

