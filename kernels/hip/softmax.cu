// softmax.cu: softmax backward for lesson 03, portable (NVRTC on NVIDIA, hiprtc/hipcc on AMD).
//   dinp = out * (dout - s),  s = sum_j out[j] * dout[j] over each row;  dout, out, dinp are (N, n) row-major.
// The same versions as kernels/numba/softmax.py; they differ in who computes each row's reduction s:
//   v1: one thread per row, two loops over the row (uncoalesced: a warp's threads read different rows).
//   v2: one block per row, threads stride the row, tree reduction in shared memory (blockDim a power of two).
//   v3: one block per row, warp_sum shuffles inside each warp + one shared slot per warp (blockDim whole warps).
//   v4: one warp per row, several rows per block, shuffles only (blockDim whole warps).
//   v5: v4 with float4 loads and the row kept in registers (read once from memory; n % 4 == 0 and 16-byte
//       aligned arrays, else v4's scalar loop).
// Never assume 32 lanes: warpSize is 64 on AMD CDNA; shared buffers are sized with MAX_WARPS_PER_BLOCK.
#include "portable.h"

// v1: thread `row` owns the n elements of its row.
extern "C" __global__ void softmax_backward_v1(const float* __restrict__ dout, const float* __restrict__ out,
                                               float* __restrict__ dinp, int N, int n) {
    int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= N) return;                       // the grid is rounded up to whole blocks
    long long base = (long long)row * n;        // start of this row in the (N, n) arrays
    float s = 0.0f;
    for (int j = 0; j < n; j++) s += out[base + j] * dout[base + j];          // pass 1: the row sum
    for (int j = 0; j < n; j++) dinp[base + j] = out[base + j] * (dout[base + j] - s);  // pass 2: write
}

// v2: block `blockIdx.x` owns one row; thread t handles elements t, t + blockDim, ...; tree in shared memory.
extern "C" __global__ void softmax_backward_v2(const float* __restrict__ dout, const float* __restrict__ out,
                                               float* __restrict__ dinp, int N, int n) {
    __shared__ float partial[1024];             // one partial sum per thread (blockDim.x <= 1024)
    long long base = (long long)blockIdx.x * n;
    int tid = threadIdx.x;
    float s = 0.0f;
    for (int j = tid; j < n; j += blockDim.x) s += out[base + j] * dout[base + j];  // coalesced
    partial[tid] = s;
    __syncthreads();
    // the first half of the active threads adds the second half's partials, halving each step
    for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
        if (tid < stride) partial[tid] += partial[tid + stride];
        __syncthreads();
    }
    s = partial[0];                             // the row sum, seen by every thread
    for (int j = tid; j < n; j += blockDim.x) dinp[base + j] = out[base + j] * (dout[base + j] - s);
}

// v3: one block per row; each warp reduces with shuffles, warp sums meet in one shared slot per warp.
extern "C" __global__ void softmax_backward_v3(const float* __restrict__ dout, const float* __restrict__ out,
                                               float* __restrict__ dinp, int N, int n) {
    __shared__ float warp_sums[MAX_WARPS_PER_BLOCK];
    long long base = (long long)blockIdx.x * n;
    int tid = threadIdx.x;
    int lane = tid % warpSize, warp = tid / warpSize;
    int n_warps = blockDim.x / warpSize;
    float s = 0.0f;
    for (int j = tid; j < n; j += blockDim.x) s += out[base + j] * dout[base + j];
    s = warp_sum(s);                            // every lane holds its warp's sum
    if (lane == 0) warp_sums[warp] = s;
    __syncthreads();                            // the only barrier
    // every warp adds the n_warps (<= warpSize) warp sums itself: no second barrier to share the result
    s = lane < n_warps ? warp_sums[lane] : 0.0f;
    s = warp_sum(s);
    for (int j = tid; j < n; j += blockDim.x) dinp[base + j] = out[base + j] * (dout[base + j] - s);
}

// v4: one warp per row; a block of blockDim.x threads handles blockDim.x / warpSize rows.
extern "C" __global__ void softmax_backward_v4(const float* __restrict__ dout, const float* __restrict__ out,
                                               float* __restrict__ dinp, int N, int n) {
    int lane = threadIdx.x % warpSize;
    int row = blockIdx.x * (blockDim.x / warpSize) + threadIdx.x / warpSize;
    if (row >= N) return;                       // the whole warp leaves together, its shuffles stay complete
    long long base = (long long)row * n;
    float s = 0.0f;
    for (int j = lane; j < n; j += warpSize) s += out[base + j] * dout[base + j];
    s = warp_sum(s);
    for (int j = lane; j < n; j += warpSize) dinp[base + j] = out[base + j] * (dout[base + j] - s);
}

// v5: v4 with 16-byte (float4) loads, and the first SMX_V5_CACHE float4 of each lane kept in registers between
// the two passes, so dout and out are read from memory once and many loads are in flight per lane.
// Lane `lane` of the warp owning row `row` holds float4 number j = lane + k * warpSize of the row (elements
// 4j .. 4j+3) in oc[k], dc[k]; a row longer than SMX_V5_CACHE * warpSize float4 re-reads its tail in pass 2.
// Used when n % 4 == 0 and all three pointers are 16-byte aligned (so every row starts aligned); otherwise the
// warp runs v4's scalar loop.
#define SMX_V5_CACHE 8   // float4 per lane and per array held in registers: 1024 floats per row on 32-lane warps

__device__ __forceinline__ bool aligned16(const void* p) { return ((unsigned long long)p) % 16 == 0; }

extern "C" __global__ void softmax_backward_v5(const float* __restrict__ dout, const float* __restrict__ out,
                                               float* __restrict__ dinp, int N, int n) {
    int lane = threadIdx.x % warpSize;
    int row = blockIdx.x * (blockDim.x / warpSize) + threadIdx.x / warpSize;
    if (row >= N) return;                       // whole warps leave together
    long long base = (long long)row * n;
    float s = 0.0f;
    if (n % 4 != 0 || !aligned16(dout) || !aligned16(out) || !aligned16(dinp)) {   // v4's scalar loop
        for (int j = lane; j < n; j += warpSize) s += out[base + j] * dout[base + j];
        s = warp_sum(s);
        for (int j = lane; j < n; j += warpSize) dinp[base + j] = out[base + j] * (dout[base + j] - s);
        return;
    }
    const float4* o4 = reinterpret_cast<const float4*>(out + base);    // the row as n/4 float4
    const float4* d4 = reinterpret_cast<const float4*>(dout + base);
    float4* di4 = reinterpret_cast<float4*>(dinp + base);
    int n4 = n / 4;
    float4 oc[SMX_V5_CACHE], dc[SMX_V5_CACHE];  // registers: the loop is unrolled, k is a compile-time index
#pragma unroll
    for (int k = 0; k < SMX_V5_CACHE; k++) {    // pass 1a: all loads issued before the adds need them
        int j = lane + k * warpSize;
        if (j < n4) { oc[k] = o4[j]; dc[k] = d4[j]; }
    }
#pragma unroll
    for (int k = 0; k < SMX_V5_CACHE; k++) {
        int j = lane + k * warpSize;
        if (j < n4) s += oc[k].x * dc[k].x + oc[k].y * dc[k].y + oc[k].z * dc[k].z + oc[k].w * dc[k].w;
    }
    for (int j = lane + SMX_V5_CACHE * warpSize; j < n4; j += warpSize) {   // pass 1b: the uncached tail
        float4 o = o4[j], d = d4[j];
        s += o.x * d.x + o.y * d.y + o.z * d.z + o.w * d.w;
    }
    s = warp_sum(s);
#pragma unroll
    for (int k = 0; k < SMX_V5_CACHE; k++) {    // pass 2a: from registers
        int j = lane + k * warpSize;
        if (j < n4) di4[j] = make_float4(oc[k].x * (dc[k].x - s), oc[k].y * (dc[k].y - s),
                                         oc[k].z * (dc[k].z - s), oc[k].w * (dc[k].w - s));
    }
    for (int j = lane + SMX_V5_CACHE * warpSize; j < n4; j += warpSize) {   // pass 2b: the tail, read again
        float4 o = o4[j], d = d4[j];
        di4[j] = make_float4(o.x * (d.x - s), o.y * (d.y - s), o.z * (d.z - s), o.w * (d.w - s));
    }
}
