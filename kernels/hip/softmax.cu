// softmax.cu: softmax backward for lesson 03, portable (NVRTC on NVIDIA, hiprtc/hipcc on AMD).
//   dinp = out * (dout - s),  s = sum_j out[j] * dout[j] over each row;  dout, out, dinp are (N, n) row-major.
// The same versions as kernels/numba/softmax.py; they differ in who computes each row's reduction s:
//   v1: one thread per row, two loops over the row (uncoalesced: a warp's threads read different rows).
//   v2: one block per row, threads stride the row, tree reduction in shared memory (blockDim a power of two).
//   v3: one block per row, warp_sum shuffles inside each warp + one shared slot per warp (blockDim whole warps).
//   v4: one warp per row, several rows per block, shuffles only (blockDim whole warps).
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
