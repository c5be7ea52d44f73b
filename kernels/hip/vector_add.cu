// vector_add.cu: the first portable kernel of lesson 00. One thread per element, a grid-stride loop so any
// grid size covers any n. Compiled by NVRTC (NVIDIA) or hiprtc (AMD) through CuPy from this same source.
#include "portable.h"

// v1: out[i] = a[i] + b[i]
extern "C" __global__ void vector_add(const float* __restrict__ a, const float* __restrict__ b,
                                      float* __restrict__ out, long long n) {
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        out[i] = a[i] + b[i];
    }
}

// Block-wide sum: each warp reduces with shuffles, warp leaders meet in shared memory (sized for 32-lane warps,
// the smallest warp, so it also fits 64-lane wavefronts). Used by lesson 00 to show warpSize differs by vendor.
extern "C" __global__ void block_sum(const float* __restrict__ x, float* __restrict__ out, long long n) {
    __shared__ float partial[MAX_WARPS_PER_BLOCK];
    float v = 0.0f;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        v += x[i];
    }
    v = warp_sum(v);
    int lane = threadIdx.x % warpSize, warp = threadIdx.x / warpSize;
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    if (warp == 0) {
        int n_warps = (blockDim.x + warpSize - 1) / warpSize;
        v = lane < n_warps ? partial[lane] : 0.0f;
        v = warp_sum(v);
        if (lane == 0) atomicAdd(out, v);
    }
}
