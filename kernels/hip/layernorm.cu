// layernorm.cu: LayerNorm forward and backward, portable CUDA/HIP (the same versions as kernels/numba/layernorm.py).
// Rows flattened: N = B*T rows of C channels, row-major (N, C) float32. Per row, xhat = (inp - mean) * rstd,
// out = xhat * weight + bias. Backward with g = dout * weight:
//   dinp = rstd * (g - mean(g) - xhat * mean(g * xhat))   (means over the row's C channels)
//   dweight = sum over rows of dout * xhat,  dbias = sum over rows of dout      (C,)
// v1: one thread per row (dinp), one thread per column (dweight, dbias).
// v2: one block per row with shared-memory tree sums (blockDim.x a power of two, at most 1024); dweight/dbias by a
//     deterministic two-stage column reduction (partial sums per chunk of rows into scratch, then a sum per column).
// v3: v2 with warp-shuffle sums (warp_sum from portable.h; blockDim.x a multiple of warpSize: 64 on AMD CDNA).
// No atomics: atomicAdd into dweight would be one kernel, but the float sum order (and so the last bits of the
// result) would change from run to run.
#include "portable.h"

// ---- block-wide sums: every thread of the block gets the total --------------------------------------------------

// Shared-memory tree: buf holds blockDim.x floats; each step the lower half adds the upper half.
__device__ float block_sum_tree(float* buf, float v) {
    int t = threadIdx.x;
    buf[t] = v;
    __syncthreads();
    for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
        if (t < stride) buf[t] += buf[t + stride];
        __syncthreads();
    }
    float total = buf[0];
    __syncthreads();  // everyone has read buf[0] before the next call overwrites buf
    return total;
}

// Warp shuffles, then one shared slot per warp (buf: MAX_WARPS_PER_BLOCK floats); every warp adds the per-warp
// totals itself, so no broadcast step is needed. Works for 32- and 64-lane warps.
__device__ float block_sum_warps(float* buf, float v) {
    int lane = threadIdx.x % warpSize, warp = threadIdx.x / warpSize;
    int n_warps = blockDim.x / warpSize;
    v = warp_sum(v);
    if (lane == 0) buf[warp] = v;
    __syncthreads();
    v = lane < n_warps ? buf[lane] : 0.0f;
    v = warp_sum(v);
    __syncthreads();  // buf read by all before the next call overwrites it
    return v;
}

// ---- forward: inp, out (N, C); weight, bias (C,); mean, rstd (N,) ------------------------------------------------

// v1: one thread per row, three loops over C (mean, variance from a second pass, write)
extern "C" __global__ void layernorm_forward_v1(const float* __restrict__ inp, const float* __restrict__ weight,
                                                const float* __restrict__ bias, float* __restrict__ out,
                                                float* __restrict__ mean, float* __restrict__ rstd,
                                                int N, int C, float eps) {
    int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= N) return;
    const float* x = inp + (long long)row * C;
    float s = 0.0f;
    for (int i = 0; i < C; i++) s += x[i];
    float m = s / C;
    float v = 0.0f;
    for (int i = 0; i < C; i++) { float d = x[i] - m; v += d * d; }
    float r = 1.0f / sqrtf(v / C + eps);
    float* y = out + (long long)row * C;
    for (int i = 0; i < C; i++) y[i] = (x[i] - m) * r * weight[i] + bias[i];
    mean[row] = m;
    rstd[row] = r;
}

// v2: one block per row, thread t handles channels t, t + blockDim.x, ...; shared-memory tree sums
extern "C" __global__ void layernorm_forward_v2(const float* __restrict__ inp, const float* __restrict__ weight,
                                                const float* __restrict__ bias, float* __restrict__ out,
                                                float* __restrict__ mean, float* __restrict__ rstd,
                                                int N, int C, float eps) {
    __shared__ float buf[1024];  // one partial sum per thread
    for (int row = blockIdx.x; row < N; row += gridDim.x) {  // the whole block moves to the next row together
        const float* x = inp + (long long)row * C;
        float s = 0.0f;
        for (int i = threadIdx.x; i < C; i += blockDim.x) s += x[i];
        float m = block_sum_tree(buf, s) / C;
        float v = 0.0f;
        for (int i = threadIdx.x; i < C; i += blockDim.x) { float d = x[i] - m; v += d * d; }
        float r = 1.0f / sqrtf(block_sum_tree(buf, v) / C + eps);
        float* y = out + (long long)row * C;
        for (int i = threadIdx.x; i < C; i += blockDim.x) y[i] = (x[i] - m) * r * weight[i] + bias[i];
        if (threadIdx.x == 0) { mean[row] = m; rstd[row] = r; }
    }
}

// v3: v2 with warp-shuffle sums
extern "C" __global__ void layernorm_forward_v3(const float* __restrict__ inp, const float* __restrict__ weight,
                                                const float* __restrict__ bias, float* __restrict__ out,
                                                float* __restrict__ mean, float* __restrict__ rstd,
                                                int N, int C, float eps) {
    __shared__ float buf[MAX_WARPS_PER_BLOCK];  // one partial sum per warp
    for (int row = blockIdx.x; row < N; row += gridDim.x) {
        const float* x = inp + (long long)row * C;
        float s = 0.0f;
        for (int i = threadIdx.x; i < C; i += blockDim.x) s += x[i];
        float m = block_sum_warps(buf, s) / C;
        float v = 0.0f;
        for (int i = threadIdx.x; i < C; i += blockDim.x) { float d = x[i] - m; v += d * d; }
        float r = 1.0f / sqrtf(block_sum_warps(buf, v) / C + eps);
        float* y = out + (long long)row * C;
        for (int i = threadIdx.x; i < C; i += blockDim.x) y[i] = (x[i] - m) * r * weight[i] + bias[i];
        if (threadIdx.x == 0) { mean[row] = m; rstd[row] = r; }
    }
}

// ---- backward dinp: dout, inp, dinp (N, C); weight (C,); mean, rstd (N,) -----------------------------------------

// v1: one thread per row: the two sums in one loop over C, then the write
extern "C" __global__ void layernorm_backward_v1(const float* __restrict__ dout, const float* __restrict__ inp,
                                                 const float* __restrict__ weight, const float* __restrict__ mean,
                                                 const float* __restrict__ rstd, float* __restrict__ dinp,
                                                 int N, int C) {
    int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= N) return;
    long long base = (long long)row * C;
    float m = mean[row], r = rstd[row];
    float sg = 0.0f, sgx = 0.0f;
    for (int i = 0; i < C; i++) {
        float g = dout[base + i] * weight[i];  // dL/dxhat
        sg += g;
        sgx += g * (inp[base + i] - m) * r;
    }
    float mg = sg / C, mgx = sgx / C;          // mean(g), mean(g * xhat)
    for (int i = 0; i < C; i++) {
        float xhat = (inp[base + i] - m) * r;
        dinp[base + i] = r * (dout[base + i] * weight[i] - mg - xhat * mgx);
    }
}

// v2: one block per row, shared-memory tree sums of g and g * xhat
extern "C" __global__ void layernorm_backward_v2(const float* __restrict__ dout, const float* __restrict__ inp,
                                                 const float* __restrict__ weight, const float* __restrict__ mean,
                                                 const float* __restrict__ rstd, float* __restrict__ dinp,
                                                 int N, int C) {
    __shared__ float buf[1024];  // one partial sum per thread
    for (int row = blockIdx.x; row < N; row += gridDim.x) {
        long long base = (long long)row * C;
        float m = mean[row], r = rstd[row];
        float sg = 0.0f, sgx = 0.0f;
        for (int i = threadIdx.x; i < C; i += blockDim.x) {  // thread t: channels t, t + blockDim.x, ...
            float g = dout[base + i] * weight[i];
            sg += g;
            sgx += g * (inp[base + i] - m) * r;
        }
        float mg = block_sum_tree(buf, sg) / C;
        float mgx = block_sum_tree(buf, sgx) / C;
        for (int i = threadIdx.x; i < C; i += blockDim.x) {
            float xhat = (inp[base + i] - m) * r;
            dinp[base + i] = r * (dout[base + i] * weight[i] - mg - xhat * mgx);
        }
    }
}

// v3: v2 with warp-shuffle sums
extern "C" __global__ void layernorm_backward_v3(const float* __restrict__ dout, const float* __restrict__ inp,
                                                 const float* __restrict__ weight, const float* __restrict__ mean,
                                                 const float* __restrict__ rstd, float* __restrict__ dinp,
                                                 int N, int C) {
    __shared__ float buf[MAX_WARPS_PER_BLOCK];  // one partial sum per warp
    for (int row = blockIdx.x; row < N; row += gridDim.x) {
        long long base = (long long)row * C;
        float m = mean[row], r = rstd[row];
        float sg = 0.0f, sgx = 0.0f;
        for (int i = threadIdx.x; i < C; i += blockDim.x) {
            float g = dout[base + i] * weight[i];
            sg += g;
            sgx += g * (inp[base + i] - m) * r;
        }
        float mg = block_sum_warps(buf, sg) / C;
        float mgx = block_sum_warps(buf, sgx) / C;
        for (int i = threadIdx.x; i < C; i += blockDim.x) {
            float xhat = (inp[base + i] - m) * r;
            dinp[base + i] = r * (dout[base + i] * weight[i] - mg - xhat * mgx);
        }
    }
}

// ---- backward dweight, dbias (C,): sums over the N rows -------------------------------------------------------------

// v1: one thread per column loops over all rows (neighbouring threads read neighbouring columns: coalesced)
extern "C" __global__ void layernorm_backward_v1_dparams(const float* __restrict__ dout, const float* __restrict__ inp,
                                                         const float* __restrict__ mean,
                                                         const float* __restrict__ rstd, float* __restrict__ dweight,
                                                         float* __restrict__ dbias, int N, int C) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float dw = 0.0f, db = 0.0f;
    for (int row = 0; row < N; row++) {
        float d = dout[(long long)row * C + c];
        dw += d * (inp[(long long)row * C + c] - mean[row]) * rstd[row];
        db += d;
    }
    dweight[c] = dw;
    dbias[c] = db;
}

// v2 stage 1: grid (column blocks, n_chunks); thread owns column c over rows [chunk * rows_per_chunk, ...) and
// writes its two partial sums to scratch dweight_part, dbias_part (n_chunks, C)
extern "C" __global__ void layernorm_backward_v2_partials(const float* __restrict__ dout,
                                                          const float* __restrict__ inp,
                                                          const float* __restrict__ mean,
                                                          const float* __restrict__ rstd,
                                                          float* __restrict__ dweight_part,
                                                          float* __restrict__ dbias_part,
                                                          int N, int C, int rows_per_chunk) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    int chunk = blockIdx.y;
    if (c >= C) return;
    int end = min(N, (chunk + 1) * rows_per_chunk);
    float dw = 0.0f, db = 0.0f;
    for (int row = chunk * rows_per_chunk; row < end; row++) {
        float d = dout[(long long)row * C + c];
        dw += d * (inp[(long long)row * C + c] - mean[row]) * rstd[row];
        db += d;
    }
    dweight_part[(long long)chunk * C + c] = dw;
    dbias_part[(long long)chunk * C + c] = db;
}

// v2 stage 2: one thread per column adds the n_chunks partials in chunk order (deterministic)
extern "C" __global__ void layernorm_backward_v2_reduce(const float* __restrict__ dweight_part,
                                                        const float* __restrict__ dbias_part,
                                                        float* __restrict__ dweight, float* __restrict__ dbias,
                                                        int n_chunks, int C) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float dw = 0.0f, db = 0.0f;
    for (int k = 0; k < n_chunks; k++) {
        dw += dweight_part[(long long)k * C + c];
        db += dbias_part[(long long)k * C + c];
    }
    dweight[c] = dw;
    dbias[c] = db;
}
