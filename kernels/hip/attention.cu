// attention.cu: causal multi-head self-attention backward (see kernels/numba/attention.py for the math).
// q, k, v are read straight from qkv (B, T, 3C) at channel offsets 0, C, 2C + h*hs; att (B, nh, T, T) was saved
// by the forward. Masked entries (s > t) have att = 0 and are skipped, not multiplied by zero.
#include "portable.h"

// v1, step 1: datt[b,h,t,s] = sum_d dout[b,t,h*hs+d] * v[b,s,h*hs+d] for s <= t, else 0.
// One block per (b*h, t) row; threads stride over s.
extern "C" __global__ void attention_datt_v1(const float* __restrict__ dout, const float* __restrict__ qkv,
                                             float* __restrict__ datt, int B, int T, int C, int n_head) {
    int bh = blockIdx.x, t = blockIdx.y;
    int b = bh / n_head, h = bh % n_head, hs = C / n_head;
    const float* dy = dout + ((long long)b * T + t) * C + h * hs;
    float* row = datt + ((long long)bh * T + t) * T;
    for (int s = threadIdx.x; s < T; s += blockDim.x) {
        float acc = 0.0f;
        if (s <= t) {
            const float* v = qkv + ((long long)b * T + s) * 3 * C + 2 * C + h * hs;
            for (int d = 0; d < hs; d++) acc += dy[d] * v[d];
        }
        row[s] = acc;
    }
}

// Step 2 (v1 and cublas): causal softmax backward with the scale folded in. One block per (b, h, t) row:
// dpre[s] = scale * att[s] * (datt[s] - sum_{s'<=t} att[s'] datt[s']) for s <= t, else 0.
// The row sum is a block reduction: warp shuffles, then one shared slot per warp (sized for 32-lane warps).
extern "C" __global__ void attention_dpre(const float* __restrict__ att, const float* __restrict__ datt,
                                         float* __restrict__ dpre, int T, float scale) {
    __shared__ float partial[MAX_WARPS_PER_BLOCK];
    long long row = blockIdx.x;
    int t = (int)(row % T);
    const float* a = att + row * T;
    const float* da = datt + row * T;
    float* out = dpre + row * T;
    float v = 0.0f;
    for (int s = threadIdx.x; s <= t; s += blockDim.x) v += a[s] * da[s];
    v = warp_sum(v);
    int lane = threadIdx.x % warpSize, warp = threadIdx.x / warpSize;
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    int n_warps = (blockDim.x + warpSize - 1) / warpSize;
    float dot = 0.0f;
    for (int w = 0; w < n_warps; w++) dot += partial[w];
    for (int s = threadIdx.x; s < T; s += blockDim.x) out[s] = s <= t ? scale * a[s] * (da[s] - dot) : 0.0f;
}

// v1, steps 3-5: one thread per element of dqkv (B, T, 3C): dq, dk, dv by loops over the unmasked range.
extern "C" __global__ void attention_dqkv_v1(const float* __restrict__ dout, const float* __restrict__ qkv,
                                             const float* __restrict__ att, const float* __restrict__ dpre,
                                             float* __restrict__ dqkv, int B, int T, int C, int n_head) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long n = (long long)B * T * 3 * C;
    if (i >= n) return;
    int hs = C / n_head;
    int c = (int)(i % (3 * C));
    long long bt = i / (3 * C);
    int t = (int)(bt % T), b = (int)(bt / T);
    int part = c / C, cc = c % C, h = cc / hs, d = cc % hs;
    long long bh = (long long)b * n_head + h;
    float acc = 0.0f;
    if (part == 0) {         // dq[t,d] = sum_{s<=t} dpre[t,s] k[s,d]
        for (int s = 0; s <= t; s++) acc += dpre[(bh * T + t) * T + s] * qkv[((long long)b * T + s) * 3 * C + C + h * hs + d];
    } else if (part == 1) {  // dk[t,d] = sum_{t2>=t} dpre[t2,t] q[t2,d]
        for (int t2 = t; t2 < T; t2++) acc += dpre[(bh * T + t2) * T + t] * qkv[((long long)b * T + t2) * 3 * C + h * hs + d];
    } else {                 // dv[t,d] = sum_{t2>=t} att[t2,t] dy[t2,d]
        for (int t2 = t; t2 < T; t2++) acc += att[(bh * T + t2) * T + t] * dout[((long long)b * T + t2) * C + h * hs + d];
    }
    dqkv[i] = acc;
}

// Forward (the training loop): causal softmax of the scaled scores, one block per (b, h, t) row of pre (rows, T):
// att[s] = exp(scale*pre[s] - max) / sum_{s'<=t} exp(scale*pre[s'] - max) for s <= t, else 0. Row t of a (T, T)
// block is query position t = row % T. Each thread reads and writes only its own columns, so att may be pre
// (in place). Two block reductions (max, then sum): warp shuffles, then one shared slot per warp.
extern "C" __global__ void attention_softmax_fwd(const float* __restrict__ pre, float* __restrict__ att,
                                                int T, float scale) {
    __shared__ float partial[MAX_WARPS_PER_BLOCK];
    long long row = blockIdx.x;
    int t = (int)(row % T);
    const float* p = pre + row * T;
    float* out = att + row * T;
    int lane = threadIdx.x % warpSize, warp = threadIdx.x / warpSize;
    int n_warps = (blockDim.x + warpSize - 1) / warpSize;
    float mx = -3.402823466e38f;             // the lowest float (t >= 0: every row has at least s = 0)
    for (int s = threadIdx.x; s <= t; s += blockDim.x) mx = fmaxf(mx, scale * p[s]);
    mx = warp_max(mx);
    if (lane == 0) partial[warp] = mx;
    __syncthreads();
    mx = partial[0];
    for (int w = 1; w < n_warps; w++) mx = fmaxf(mx, partial[w]);
    __syncthreads();                          // everyone has read the maxima before the slots are reused
    float sum = 0.0f;
    for (int s = threadIdx.x; s <= t; s += blockDim.x) sum += expf(scale * p[s] - mx);
    sum = warp_sum(sum);
    if (lane == 0) partial[warp] = sum;
    __syncthreads();
    sum = 0.0f;
    for (int w = 0; w < n_warps; w++) sum += partial[w];
    float inv = 1.0f / sum;
    for (int s = threadIdx.x; s < T; s += blockDim.x) out[s] = s <= t ? expf(scale * p[s] - mx) * inv : 0.0f;
}
