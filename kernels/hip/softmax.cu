// softmax.cu: softmax backward for lesson 03, portable (NVRTC on NVIDIA, hiprtc/hipcc on AMD).
//   dinp = out * (dout - s),  s = sum_j out[j] * dout[j] over each row;  dout, out, dinp are (N, n) row-major.
// The same versions as kernels/numba/softmax.py; they differ in who computes each row's reduction s:
//   v1: one thread per row, two loops over the row (uncoalesced: a warp's threads read different rows).
//   v2: one block per row, threads stride the row, tree reduction in shared memory (blockDim a power of two).
//   v3: one block per row, warp_sum shuffles inside each warp + one shared slot per warp (blockDim whole warps).
//   v4: one warp per row, several rows per block, shuffles only (blockDim whole warps).
//   v5: v4 with float4 loads and the row kept in registers (read once from memory; n % 4 == 0 and 16-byte
//       aligned arrays, else v4's scalar loop).
//   v6: a group of G threads (whole warps) per row, R = blockDim.x / G rows per block, each thread holding its
//       K float4 of out and dout in registers (K = 1, 2, 4, 8 by entry point: n <= 4 * K * G), so the row is read
//       from memory exactly once and never re-read; warp shuffles, then one shared slot per warp and ONE barrier
//       per row tile (double-buffered slots). Fewer registers per thread than v5 (K = 4 at G = 64 for n = 1024:
//       ~45 instead of ~100) so more warps, and so more loads, are in flight per SM; the blocks loop over row tiles
//       (grid-stride), so the grid can be exactly what fits on the GPU at once (no block launches, no tail waves).
//   v7: one warp per row, grid-stride over rows, K float4 per lane, and the NEXT row's loads issued before this
//       row's reduction and stores (double-buffered registers): two rows in flight per warp, no shared memory,
//       no barrier.
// v6 and v7 need n % 4 == 0 and 16-byte aligned arrays (the launcher checks, else it runs v5).
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

// ---- v6: G threads (whole warps) per row, R rows per block, the row in registers -----------------------------------
// Thread t (0 <= t < G) of the group owning row `row` holds float4 number j = t + k * G of the row (elements
// 4j .. 4j+3) in oc[k] (out) and dc[k] (dout), k < K: consecutive threads read consecutive 16 bytes (coalesced).
// The launcher guarantees n <= 4 * K * G, n % 4 == 0 and 16-byte aligned arrays. All loads of a row are issued
// before the first add needs one, so a thread has 2K 16-byte loads in flight.
template <int K>
__device__ __forceinline__ void softmax_backward_v6_body(const float* __restrict__ dout,
                                                         const float* __restrict__ out,
                                                         float* __restrict__ dinp, int N, int n,
                                                         int rows_per_block, float* red) {
    int G = blockDim.x / rows_per_block;             // threads per row: whole warps (launcher-checked)
    int slot = threadIdx.x / G, t = threadIdx.x % G; // which of the block's rows, which thread of its group
    int warps_per_row = G / warpSize;
    int lane = threadIdx.x % warpSize, warp = threadIdx.x / warpSize;
    int n4 = n / 4;
    int parity = 0;
    // block-uniform loop (every thread runs the same iterations: the barrier below is reached by all)
    for (int tile = blockIdx.x; tile < (N + rows_per_block - 1) / rows_per_block; tile += gridDim.x) {
        int row = tile * rows_per_block + slot;
        bool valid = row < N;                        // uniform per warp: a warp lies inside one group
        long long base = (long long)row * n;
        const float4* o4 = reinterpret_cast<const float4*>(out + base);
        const float4* d4 = reinterpret_cast<const float4*>(dout + base);
        float4 oc[K], dc[K];
        float s = 0.0f;
        if (valid) {
#pragma unroll
            for (int k = 0; k < K; k++) {            // every load issued first
                int j = t + k * G;
                if (j < n4) { oc[k] = o4[j]; dc[k] = d4[j]; }
            }
#pragma unroll
            for (int k = 0; k < K; k++) {
                int j = t + k * G;
                if (j < n4) s += oc[k].x * dc[k].x + oc[k].y * dc[k].y + oc[k].z * dc[k].z + oc[k].w * dc[k].w;
            }
        }
        s = warp_sum(s);                             // whole warps call it (valid is warp-uniform)
        if (warps_per_row > 1) {                     // block-uniform: the group's warps meet in shared memory
            float* buf = red + parity * MAX_WARPS_PER_BLOCK;   // double-buffered: one barrier per tile suffices
            if (lane == 0) buf[warp] = s;
            __syncthreads();
            s = 0.0f;
            for (int w = 0; w < warps_per_row; w++) s += buf[slot * warps_per_row + w];   // fixed order
            parity ^= 1;
        }
        if (valid) {
            float4* di4 = reinterpret_cast<float4*>(dinp + base);
#pragma unroll
            for (int k = 0; k < K; k++) {
                int j = t + k * G;
                if (j < n4) di4[j] = make_float4(oc[k].x * (dc[k].x - s), oc[k].y * (dc[k].y - s),
                                                 oc[k].z * (dc[k].z - s), oc[k].w * (dc[k].w - s));
            }
        }
    }
}

// Entry points, one per K. __launch_bounds__ tells the compiler the largest block so it keeps registers within
// what that block needs (65536 / threads per thread on NVIDIA: 64 at 1024, 128 at 512); K = 8 holds 64 floats of
// data per thread, so its blocks are limited to 512 threads.
#define SMX_V6_ENTRY(K, LB)                                                                                          \
    extern "C" __global__ void __launch_bounds__(LB)                                                                  \
    softmax_backward_v6_k##K(const float* __restrict__ dout, const float* __restrict__ out,                           \
                             float* __restrict__ dinp, int N, int n, int rows_per_block) {                            \
        __shared__ float red[2 * MAX_WARPS_PER_BLOCK];                                                               \
        softmax_backward_v6_body<K>(dout, out, dinp, N, n, rows_per_block, red);                                     \
    }
SMX_V6_ENTRY(1, 1024)
SMX_V6_ENTRY(2, 1024)
SMX_V6_ENTRY(4, 1024)
SMX_V6_ENTRY(8, 512)

// ---- v7: one warp per row, grid-stride, the next row prefetched into registers --------------------------------------
// Lane `lane` holds float4 j = lane + k * warpSize (k < K) of the current row in oc/dc and of the warp's next row
// (row + number of warps in the grid) in on/dn: the next row's loads are issued before the current row's shuffles
// and stores, so they are in flight while the warp computes and writes. n <= 4 * K * warpSize, n % 4 == 0 and
// 16-byte aligned arrays (launcher-checked).
template <int K>
__device__ __forceinline__ void softmax_v7_load(const float* __restrict__ dout, const float* __restrict__ out,
                                                int row, int n, int lane, float4* oc, float4* dc) {
    long long base = (long long)row * n;
    const float4* o4 = reinterpret_cast<const float4*>(out + base);
    const float4* d4 = reinterpret_cast<const float4*>(dout + base);
    int n4 = n / 4;
#pragma unroll
    for (int k = 0; k < K; k++) {
        int j = lane + k * warpSize;
        if (j < n4) { oc[k] = o4[j]; dc[k] = d4[j]; }
    }
}

template <int K>
__device__ __forceinline__ void softmax_backward_v7_body(const float* __restrict__ dout,
                                                         const float* __restrict__ out,
                                                         float* __restrict__ dinp, int N, int n) {
    int lane = threadIdx.x % warpSize;
    int warps = blockDim.x / warpSize;
    int stride = gridDim.x * warps;                  // warps in the grid
    int row = blockIdx.x * warps + threadIdx.x / warpSize;
    if (row >= N) return;                            // whole warps leave together
    int n4 = n / 4;
    float4 oc[K], dc[K], on[K], dn[K];
    softmax_v7_load<K>(dout, out, row, n, lane, oc, dc);
    for (; row < N; row += stride) {                 // warp-uniform loop
        int next = row + stride;
        if (next < N) softmax_v7_load<K>(dout, out, next, n, lane, on, dn);   // in flight during what follows
        float s = 0.0f;
#pragma unroll
        for (int k = 0; k < K; k++) {
            int j = lane + k * warpSize;
            if (j < n4) s += oc[k].x * dc[k].x + oc[k].y * dc[k].y + oc[k].z * dc[k].z + oc[k].w * dc[k].w;
        }
        s = warp_sum(s);
        float4* di4 = reinterpret_cast<float4*>(dinp + (long long)row * n);
#pragma unroll
        for (int k = 0; k < K; k++) {
            int j = lane + k * warpSize;
            if (j < n4) di4[j] = make_float4(oc[k].x * (dc[k].x - s), oc[k].y * (dc[k].y - s),
                                             oc[k].z * (dc[k].z - s), oc[k].w * (dc[k].w - s));
        }
#pragma unroll
        for (int k = 0; k < K; k++) { oc[k] = on[k]; dc[k] = dn[k]; }   // register moves (the next row)
    }
}

// K = 8 keeps 2 x 2 x 32 floats per lane (two rows of out and dout): at most 256 threads per block.
#define SMX_V7_ENTRY(K, LB)                                                                                          \
    extern "C" __global__ void __launch_bounds__(LB)                                                                  \
    softmax_backward_v7_k##K(const float* __restrict__ dout, const float* __restrict__ out,                           \
                             float* __restrict__ dinp, int N, int n) {                                                \
        softmax_backward_v7_body<K>(dout, out, dinp, N, n);                                                          \
    }
SMX_V7_ENTRY(1, 1024)
SMX_V7_ENTRY(2, 1024)
SMX_V7_ENTRY(4, 512)
SMX_V7_ENTRY(8, 256)
