// layernorm.cu: LayerNorm forward and backward, portable CUDA/HIP (the same versions as kernels/numba/layernorm.py).
// Rows flattened: N = B*T rows of C channels, row-major (N, C) float32. Per row, xhat = (inp - mean) * rstd,
// out = xhat * weight + bias. Backward with g = dout * weight:
//   dinp = rstd * (g - mean(g) - xhat * mean(g * xhat))   (means over the row's C channels)
//   dweight = sum over rows of dout * xhat,  dbias = sum over rows of dout      (C,)
// v1: one thread per row (dinp), one thread per column (dweight, dbias).
// v2: one block per row with shared-memory tree sums (blockDim.x a power of two, at most 1024); dweight/dbias by a
//     deterministic two-stage column reduction (partial sums per chunk of rows into scratch, then a sum per column).
// v3: v2 with warp-shuffle sums (warp_sum from portable.h; blockDim.x a multiple of warpSize: 64 on AMD CDNA).
// v4: one pass (llm.c's approach): a grid of about as many blocks as fit on the GPU at once, one warp per row, each
//     warp loops over many rows; it writes dinp and keeps its dweight/dbias partials for its own columns in
//     registers (float4 loads when C % 4 == 0 and the arrays are 16-byte aligned); the warps of a block add their
//     partials in warp order in shared memory, the block writes one partial row (n_blocks, C), and
//     layernorm_backward_v4_reduce adds those rows per column in a fixed order. dout and inp are read from
//     memory once (the second pass over a row hits L1). Needs C <= LN_V4_COLS * warpSize (1024 on NVIDIA).
//     MEASURED on the H200 (2026-11-30, 16384 x 768): first 1.47 ms, then 0.153 ms (23% of copy) once the launcher
//     stopped calling getDeviceProperties on every launch (that host call, not the kernel, was the 1.47 ms).
// v5: v4 rebuilt around a register budget. One warp per row, grid-stride over rows; lane `lane` owns float4 number
//     j = lane + k * warpSize (k < K) of every row (or float j with the scalar entry points), so it loads its dout
//     and inp ONCE into registers, turns them in place into g = weight * dout and xhat, and writes dinp from those
//     registers (no second read of the row, not even from L1). Its dweight/dbias partials (4K + 4K floats) stay in
//     registers over all its rows. K is a compile-time constant per entry point (layernorm_backward_v5_w4_k{1,2,3,
//     4,6,8}, ..._w1_k{1,4,8,16,32}) and the launcher picks the smallest that covers C, so a C = 768 row on 32-lane
//     warps holds 6 float4 per array (about 120 registers) instead of v4's fixed 32-column budget (170 registers,
//     both paths in one kernel). Each block adds its warps' partials in warp order in shared memory and writes one
//     partial row (dweight | dbias, 2C floats) to scratch (gridDim.x, 2C); layernorm_backward_v5_reduce adds the
//     rows per column in a fixed order. Deterministic; C <= 32 * warpSize (1024 on NVIDIA), else the launcher runs v3.
//     layernorm_backward_v5_res_*: the same, and the residual's gradient (another (N, C) array) added into each dinp
//     value before it is stored: dinp = dLN + residual in the one pass, where a separate add would read dinp and the
//     residual and write dinp again (the engine's layer norms sit on the residual stream).
//     layernorm_backward_v5_res_half_*_{bf16,f16}: and the half copy of dinp too (its float32 values rounded to
//     nearest even), the matrix products' input for the layer below, instead of a pass that converts dinp.
// No atomics: atomicAdd into dweight would be one kernel, but the float sum order (and so the last bits of the
// result) would change from run to run.
#include "portable.h"
#include "half.h"

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

// ---- v4: one warp per row, dinp and the dweight/dbias partials in one pass ------------------------------------------
// Lane `lane` of a warp owns the same columns in every row it visits: with W columns per load (4: float4, 1: float)
// load k (k < LN_V4_COLS / W) covers columns W * (lane + k * warpSize) + 0 .. W-1. So the lane can keep its columns'
// dweight/dbias partials (LN_V4_COLS of each) in registers over all its rows, without atomics.
#define LN_V4_COLS 32        // columns owned per lane: C <= LN_V4_COLS * warpSize
#define LN_V4_WARP_MAX 64    // the widest warp (AMD CDNA): sizes the shared partial row below

// W consecutive floats at p into v[0 .. W-1] (one 16-byte load when W == 4: p must be 16-byte aligned)
template <int W>
__device__ __forceinline__ void ln_load(const float* p, float* v) {
    if (W == 4) { float4 t = *reinterpret_cast<const float4*>(p); v[0] = t.x; v[1] = t.y; v[2] = t.z; v[3] = t.w; }
    else        { v[0] = p[0]; }
}

template <int W>
__device__ __forceinline__ void ln_store(float* p, const float* v) {
    if (W == 4) *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
    else        p[0] = v[0];
}

template <int W>
__device__ __forceinline__ void layernorm_backward_v4_body(
        const float* __restrict__ dout, const float* __restrict__ inp, const float* __restrict__ weight,
        const float* __restrict__ mean, const float* __restrict__ rstd, float* __restrict__ dinp,
        float* __restrict__ dweight_part, float* __restrict__ dbias_part, int N, int C, float* sh_w, float* sh_b) {
    const int K = LN_V4_COLS / W;                     // loads per lane per row and array
    int lane = threadIdx.x % warpSize, warp = threadIdx.x / warpSize, n_warps = blockDim.x / warpSize;
    float aw[LN_V4_COLS], ab[LN_V4_COLS];             // this lane's dweight, dbias partials: column c0(k) + e at k*W+e
#pragma unroll
    for (int i = 0; i < LN_V4_COLS; i++) { aw[i] = 0.0f; ab[i] = 0.0f; }
    for (int row = blockIdx.x * n_warps + warp; row < N; row += gridDim.x * n_warps) {   // warp-uniform
        const float* d = dout + (long long)row * C;
        const float* x = inp + (long long)row * C;
        float m = mean[row], r = rstd[row];
        float sg = 0.0f, sgx = 0.0f;
#pragma unroll
        for (int k = 0; k < K; k++) {                 // pass 1: the row sums, and the dweight/dbias partials
            int c0 = W * (lane + k * warpSize);
            if (c0 < C) {                             // C % W == 0: the whole group of W columns is in the row
                float dv[4], xv[4], wv[4];
                ln_load<W>(d + c0, dv); ln_load<W>(x + c0, xv); ln_load<W>(weight + c0, wv);
#pragma unroll
                for (int e = 0; e < W; e++) {
                    float xhat = (xv[e] - m) * r, g = dv[e] * wv[e];
                    sg += g;
                    sgx += g * xhat;
                    aw[k * W + e] += dv[e] * xhat;
                    ab[k * W + e] += dv[e];
                }
            }
        }
        float mg = warp_sum(sg) / C, mgx = warp_sum(sgx) / C;   // every lane: mean(g), mean(g * xhat)
        float* di = dinp + (long long)row * C;
#pragma unroll
        for (int k = 0; k < K; k++) {                 // pass 2: dinp (the row was just read: L1 hits)
            int c0 = W * (lane + k * warpSize);
            if (c0 < C) {
                float dv[4], xv[4], wv[4], ov[4];
                ln_load<W>(d + c0, dv); ln_load<W>(x + c0, xv); ln_load<W>(weight + c0, wv);
#pragma unroll
                for (int e = 0; e < W; e++) ov[e] = r * (dv[e] * wv[e] - mg - (xv[e] - m) * r * mgx);
                ln_store<W>(di + c0, ov);
            }
        }
    }
    // The block's partial row: warp 0 stores its partials, then warps 1, 2, ... add theirs, one warp at a time
    // (a fixed order: the same bits every run). Each column is owned by one lane of each warp: no races.
    for (int w = 0; w < n_warps; w++) {
        if (warp == w) {
#pragma unroll
            for (int k = 0; k < K; k++) {
                int c0 = W * (lane + k * warpSize);
                if (c0 < C) {
#pragma unroll
                    for (int e = 0; e < W; e++) {
                        sh_w[c0 + e] = (w == 0 ? 0.0f : sh_w[c0 + e]) + aw[k * W + e];
                        sh_b[c0 + e] = (w == 0 ? 0.0f : sh_b[c0 + e]) + ab[k * W + e];
                    }
                }
            }
        }
        __syncthreads();
    }
    for (int c = threadIdx.x; c < C; c += blockDim.x) {           // coalesced write of row blockIdx.x of (n_blocks, C)
        dweight_part[(long long)blockIdx.x * C + c] = sh_w[c];
        dbias_part[(long long)blockIdx.x * C + c] = sh_b[c];
    }
}

// v4 stage 1: grid of n_blocks (any number), blockDim whole warps; dweight_part, dbias_part (gridDim.x, C) scratch.
extern "C" __global__ void layernorm_backward_v4(const float* __restrict__ dout, const float* __restrict__ inp,
                                                 const float* __restrict__ weight, const float* __restrict__ mean,
                                                 const float* __restrict__ rstd, float* __restrict__ dinp,
                                                 float* __restrict__ dweight_part, float* __restrict__ dbias_part,
                                                 int N, int C) {
    __shared__ float sh_w[LN_V4_COLS * LN_V4_WARP_MAX], sh_b[LN_V4_COLS * LN_V4_WARP_MAX];   // the block's row
    unsigned long long a = (unsigned long long)dout | (unsigned long long)inp | (unsigned long long)weight |
                           (unsigned long long)dinp;
    if (C % 4 == 0 && a % 16 == 0)                    // float4 path: every row starts 16-byte aligned
        layernorm_backward_v4_body<4>(dout, inp, weight, mean, rstd, dinp, dweight_part, dbias_part, N, C, sh_w, sh_b);
    else
        layernorm_backward_v4_body<1>(dout, inp, weight, mean, rstd, dinp, dweight_part, dbias_part, N, C, sh_w, sh_b);
}

// v4 stage 2: block b adds the n_parts partial rows for columns [b * warpSize, (b + 1) * warpSize) (grid-stride).
// Lane = column (coalesced reads of each partial row), warp g of G sums partial rows g, g + G, ...; then the G
// sums of a column are added by warp 0 in warp order. Fixed order throughout: deterministic. blockDim whole warps.
extern "C" __global__ void layernorm_backward_v4_reduce(const float* __restrict__ dweight_part,
                                                        const float* __restrict__ dbias_part,
                                                        float* __restrict__ dweight, float* __restrict__ dbias,
                                                        int n_parts, int C) {
    __shared__ float sh_w[1024], sh_b[1024];          // one pair of sums per thread
    int lane = threadIdx.x % warpSize, g = threadIdx.x / warpSize, G = blockDim.x / warpSize;
    for (int tile = blockIdx.x * warpSize; tile < C; tile += gridDim.x * warpSize) {   // block-uniform loop
        int c = tile + lane;
        float dw = 0.0f, db = 0.0f;
        if (c < C) {
            for (int k = g; k < n_parts; k += G) {
                dw += dweight_part[(long long)k * C + c];
                db += dbias_part[(long long)k * C + c];
            }
        }
        sh_w[threadIdx.x] = dw; sh_b[threadIdx.x] = db;
        __syncthreads();
        if (g == 0 && c < C) {
            dw = 0.0f; db = 0.0f;
            for (int h = 0; h < G; h++) { dw += sh_w[h * warpSize + lane]; db += sh_b[h * warpSize + lane]; }
            dweight[c] = dw;
            dbias[c] = db;
        }
        __syncthreads();                              // sh_w read before the next tile overwrites it
    }
}

// ---- v5: one warp per row, the row and the dweight/dbias partials in registers --------------------------------------
// W columns per load (4: float4, needs C % 4 == 0 and 16-byte aligned arrays; 1: scalar), K loads per lane per array:
// lane `lane` owns columns c0(k) + e, c0(k) = W * (lane + k * warpSize), e < W, k < K, in every row it visits.
// Registers per lane: g and xhat of the current row (2 * W * K), the partials aw, ab (2 * W * K), plus ~20.
#define LN_V5_WARP_MAX 64     // the widest warp (AMD CDNA): sizes the shared partial row (C <= W * K * warpSize)

template <int W, int K, bool RES, int H>
__device__ __forceinline__ void layernorm_backward_v5_body(
        const float* __restrict__ dout, const float* __restrict__ inp, const float* __restrict__ weight,
        const float* __restrict__ mean, const float* __restrict__ rstd, const float* __restrict__ res,
        float* __restrict__ dinp, unsigned short* __restrict__ dh, float* __restrict__ part, int N, int C,
        float* sh) {
    const int P = W * K;                              // floats per lane per row
    int lane = threadIdx.x % warpSize, warp = threadIdx.x / warpSize, n_warps = blockDim.x / warpSize;
    float aw[P], ab[P];                               // dweight, dbias partials of column c0(k) + e at k * W + e
#pragma unroll
    for (int i = 0; i < P; i++) { aw[i] = 0.0f; ab[i] = 0.0f; }
    for (int row = blockIdx.x * n_warps + warp; row < N; row += gridDim.x * n_warps) {   // warp-uniform
        const float* d = dout + (long long)row * C;
        const float* x = inp + (long long)row * C;
        float m = mean[row], r = rstd[row];
        float g[P], xh[P];                            // dout then g; inp then xhat
#pragma unroll
        for (int k = 0; k < K; k++) {                 // every load of the row issued before any use
            int c0 = W * (lane + k * warpSize);
            if (c0 < C) { ln_load<W>(d + c0, g + k * W); ln_load<W>(x + c0, xh + k * W); }
        }
        float sg = 0.0f, sgx = 0.0f;
#pragma unroll
        for (int k = 0; k < K; k++) {
            int c0 = W * (lane + k * warpSize);
            if (c0 < C) {
                float wv[4];
                ln_load<W>(weight + c0, wv);          // the same C floats for every row: L1/L2 hits
#pragma unroll
                for (int e = 0; e < W; e++) {
                    int i = k * W + e;
                    float dv = g[i], xhat = (xh[i] - m) * r, gv = dv * wv[e];
                    ab[i] += dv;
                    aw[i] += dv * xhat;
                    sg += gv;
                    sgx += gv * xhat;
                    g[i] = gv;
                    xh[i] = xhat;
                }
            }
        }
        float mg = warp_sum(sg) / C, mgx = warp_sum(sgx) / C;   // every lane: mean(g), mean(g * xhat)
        float* di = dinp + (long long)row * C;
        const float* rs = RES ? res + (long long)row * C : nullptr;
#pragma unroll
        for (int k = 0; k < K; k++) {
            int c0 = W * (lane + k * warpSize);
            if (c0 < C) {
                float ov[4], rv[4];
                if (RES) ln_load<W>(rs + c0, rv);    // the residual's gradient, added before the one store
#pragma unroll
                for (int e = 0; e < W; e++) {
                    ov[e] = r * (g[k * W + e] - mg - xh[k * W + e] * mgx);
                    if (RES) ov[e] += rv[e];         // (the compiler may fuse it into one fma: one rounding)
                }
                ln_store<W>(di + c0, ov);
                if (H) {                             // the half copy of the same float32 values (H: 1 bf16, 2 f16)
                    unsigned short* hp = dh + (long long)row * C + c0;
                    if (W == 4) {
                        *reinterpret_cast<uint2*>(hp) = make_uint2(pack_half2<H>(ov[0], ov[1]), pack_half2<H>(ov[2], ov[3]));
                    } else {
                        hp[0] = f32_to_half_bits<H>(ov[0]);
                    }
                }
            }
        }
    }
    // The block's partial row in shared memory: sh[0 .. C) dweight, sh[C .. 2C) dbias. Warp 0 stores its partials,
    // then warps 1, 2, ... add theirs one warp at a time (a fixed order: the same bits every run).
    for (int w = 0; w < n_warps; w++) {
        if (warp == w) {
#pragma unroll
            for (int k = 0; k < K; k++) {
                int c0 = W * (lane + k * warpSize);
                if (c0 < C) {
#pragma unroll
                    for (int e = 0; e < W; e++) {
                        sh[c0 + e] = (w == 0 ? 0.0f : sh[c0 + e]) + aw[k * W + e];
                        sh[C + c0 + e] = (w == 0 ? 0.0f : sh[C + c0 + e]) + ab[k * W + e];
                    }
                }
            }
        }
        __syncthreads();
    }
    float* out = part + (long long)blockIdx.x * 2 * C;   // row blockIdx.x of (gridDim.x, 2C): coalesced
    for (int c = threadIdx.x; c < 2 * C; c += blockDim.x) out[c] = sh[c];
}

// Entry points: grid of any number of blocks (the launcher: about as many as fit on the GPU at once), blockDim
// whole warps; part is (gridDim.x, 2C) scratch, every element written. __launch_bounds__(LB) caps registers at
// 65536 / LB per thread on NVIDIA (128 at 512 threads): the big-K entry points allow fewer threads per block.
#define LN_V5_ENTRY(W, K, LB)                                                                                        \
    extern "C" __global__ void __launch_bounds__(LB)                                                                  \
    layernorm_backward_v5_w##W##_k##K(const float* __restrict__ dout, const float* __restrict__ inp,                 \
                                      const float* __restrict__ weight, const float* __restrict__ mean,              \
                                      const float* __restrict__ rstd, float* __restrict__ dinp,                      \
                                      float* __restrict__ part, int N, int C) {                                      \
        __shared__ float sh[2 * W * K * LN_V5_WARP_MAX];                                                             \
        layernorm_backward_v5_body<W, K, false, 0>(dout, inp, weight, mean, rstd, nullptr, dinp, nullptr, part, N, C,  \
                                                   sh);                                                               \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(LB)                                                                  \
    layernorm_backward_v5_res_w##W##_k##K(const float* __restrict__ dout, const float* __restrict__ inp,             \
                                          const float* __restrict__ weight, const float* __restrict__ mean,          \
                                          const float* __restrict__ rstd, const float* __restrict__ residual,        \
                                          float* __restrict__ dinp, float* __restrict__ part, int N, int C) {        \
        __shared__ float sh[2 * W * K * LN_V5_WARP_MAX];                                                             \
        layernorm_backward_v5_body<W, K, true, 0>(dout, inp, weight, mean, rstd, residual, dinp, nullptr, part, N, C, \
                                                  sh);                                                                \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(LB)                                                                  \
    layernorm_backward_v5_res_half_w##W##_k##K##_bf16(                                                                \
        const float* __restrict__ dout, const float* __restrict__ inp, const float* __restrict__ weight,              \
        const float* __restrict__ mean, const float* __restrict__ rstd, const float* __restrict__ residual,           \
        float* __restrict__ dinp, unsigned short* __restrict__ dinp_half, float* __restrict__ part, int N, int C) {   \
        __shared__ float sh[2 * W * K * LN_V5_WARP_MAX];                                                             \
        layernorm_backward_v5_body<W, K, true, 1>(dout, inp, weight, mean, rstd, residual, dinp, dinp_half, part, N,  \
                                                  C, sh);                                                             \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(LB)                                                                  \
    layernorm_backward_v5_res_half_w##W##_k##K##_f16(                                                                 \
        const float* __restrict__ dout, const float* __restrict__ inp, const float* __restrict__ weight,              \
        const float* __restrict__ mean, const float* __restrict__ rstd, const float* __restrict__ residual,           \
        float* __restrict__ dinp, unsigned short* __restrict__ dinp_half, float* __restrict__ part, int N, int C) {   \
        __shared__ float sh[2 * W * K * LN_V5_WARP_MAX];                                                             \
        layernorm_backward_v5_body<W, K, true, 2>(dout, inp, weight, mean, rstd, residual, dinp, dinp_half, part, N,  \
                                                  C, sh);                                                             \
    }
LN_V5_ENTRY(4, 1, 1024)
LN_V5_ENTRY(4, 2, 1024)
LN_V5_ENTRY(4, 3, 512)
LN_V5_ENTRY(4, 4, 512)
LN_V5_ENTRY(4, 6, 512)
LN_V5_ENTRY(4, 8, 256)
LN_V5_ENTRY(1, 1, 1024)
LN_V5_ENTRY(1, 4, 1024)
LN_V5_ENTRY(1, 8, 512)
LN_V5_ENTRY(1, 16, 512)
LN_V5_ENTRY(1, 32, 256)

// v5 stage 2: part (n_parts, 2C) -> dweight = column sums of part[:, :C], dbias = of part[:, C:]. A block takes
// tiles of LN_V5_RED_COLS columns (128 bytes of each partial row: coalesced); thread (ty, tx) sums rows ty, ty + G,
// ... of column tile + tx in four interleaved running sums, then thread (0, tx) adds the G results in order ty = 0,
// 1, ... The order depends only on n_parts and blockDim.x: deterministic. blockDim.x a multiple of 32, <= 1024.
#define LN_V5_RED_COLS 32
extern "C" __global__ void layernorm_backward_v5_reduce(const float* __restrict__ part, float* __restrict__ dweight,
                                                        float* __restrict__ dbias, int n_parts, int C) {
    __shared__ float sh[1024];
    int tx = threadIdx.x % LN_V5_RED_COLS, ty = threadIdx.x / LN_V5_RED_COLS, G = blockDim.x / LN_V5_RED_COLS;
    int C2 = 2 * C;
    for (int tile = blockIdx.x * LN_V5_RED_COLS; tile < C2; tile += gridDim.x * LN_V5_RED_COLS) {   // block-uniform
        int j = tile + tx;
        float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
        if (j < C2) {
            int p = ty;
            for (; p + 3 * G < n_parts; p += 4 * G) {          // four independent loads in flight
                a0 += part[(long long)p * C2 + j];
                a1 += part[(long long)(p + G) * C2 + j];
                a2 += part[(long long)(p + 2 * G) * C2 + j];
                a3 += part[(long long)(p + 3 * G) * C2 + j];
            }
            for (; p < n_parts; p += G) a0 += part[(long long)p * C2 + j];
        }
        sh[threadIdx.x] = (a0 + a1) + (a2 + a3);
        __syncthreads();
        if (ty == 0 && j < C2) {
            float s = 0.0f;
            for (int h = 0; h < G; h++) s += sh[h * LN_V5_RED_COLS + tx];
            if (j < C) dweight[j] = s; else dbias[j - C] = s;
        }
        __syncthreads();                                       // sh read before the next tile overwrites it
    }
}
