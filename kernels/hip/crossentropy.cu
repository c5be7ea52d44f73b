// crossentropy.cu: fused softmax + cross-entropy, forward (per-row losses) and backward (dlogits), portable HIP/CUDA.
// Same versions as kernels/numba/crossentropy.py (read its docstring for the math):
//   online softmax: one read of a row gives its max m and s = sum_j exp(logits_j - m);
//   loss_row = m + log(s) - logits[target];  dlogits_j = (exp(logits_j - m) / s - [j == target]) / N.
// The probabilities are never stored as a separate (N, V) tensor.
//   v1: one thread per row.  v2: one block per row, (max, sum) pairs merged in shared memory (tree; blockDim a
//   power of 2).  v3: v2 with warp shuffles first (blockDim a multiple of warpSize: 32 NVIDIA, 64 AMD CDNA).
//   crossentropy_forward_backward_v2: both outputs in one launch.
//   crossentropy_forward_backward_half_<bf16|f16>: both outputs in one launch, warp-shuffle merges (as v3), dlogits
//   written directly as half bits (the input of the head's matrix products in a half-precision run: no fp32
//   (N, V) dlogits, no conversion pass).
//   v4: v3 with float4 (16-byte) loads and stores when V % 4 == 0 and the arrays are 16-byte aligned (else v3's
//   scalar loops); meant for 1024 threads per block: more bytes in flight per block, and fewer rows in flight
//   per GPU, so the second read of each row tends to hit L2.
#include "portable.h"
#include "half.h"

// A thread that got no element holds (CE_EMPTY, 0). Finite, so merging two empty pairs gives exp(0) * 0 = 0,
// where -inf would give exp(-inf - -inf) = NaN.
#define CE_EMPTY (-3.0e38f)

// Fold one logit x into the running pair (m = max so far, s = sum of exp(. - m) so far).
__device__ __forceinline__ void online_update(float& m, float& s, float x) {
    if (x > m) { s = s * expf(m - x) + 1.0f; m = x; }   // new max: rescale what was summed so far
    else       { s += expf(x - m); }
}

// The same with a compensated (Kahan) sum, for v1: one thread adds up to V = 50k terms, and a plain float32 sum
// drifts by ~1e-4 relative; c carries the low bits lost so far (rescaled with s when the max changes).
__device__ __forceinline__ void online_update_kahan(float& m, float& s, float& c, float x) {
    float y;
    if (x > m) { float r = expf(m - x); s *= r; c *= r; m = x; y = 1.0f; }
    else       { y = expf(x - m); }
    y -= c;
    float t = s + y;
    c = (t - s) - y;
    s = t;
}

// Merge pair (m_b, s_b) into (m, s).
__device__ __forceinline__ void merge(float& m, float& s, float m_b, float s_b) {
    float m_new = fmaxf(m, m_b);
    s = s * expf(m - m_new) + s_b * expf(m_b - m_new);
    m = m_new;
}

// Thread `start` of a group of `step` threads: online softmax over x[start], x[start + step], ... (x: one row (V,)).
__device__ __forceinline__ void slice_stats(const float* x, int V, int start, int step, float& m, float& s) {
    m = CE_EMPTY; s = 0.0f;
    for (int j = start; j < V; j += step) online_update(m, s, x[j]);
}

// One dlogit stored as float32 (HF 0), or as half bits (HF 1: bf16, 2: fp16; half.h's rounding).
template <int HF> __device__ __forceinline__ void store_dlogit(float* d, float g) { *d = g; }
template <int HF> __device__ __forceinline__ void store_dlogit(unsigned short* d, float g) {
    *d = f32_to_half_bits<HF>(g);
}

// dlogits row (V,) = (probs - onehot) / N for elements start, start + step, ...
template <int HF, typename TO>
__device__ __forceinline__ void write_dlogits_as(const float* x, int t, TO* d, int V, int N, float m, float s,
                                                 int start, int step) {
    float inv_s = 1.0f / s, inv_n = 1.0f / (float)N;
    for (int j = start; j < V; j += step) {
        float p = expf(x[j] - m) * inv_s;                 // probs_j, never stored
        store_dlogit<HF>(d + j, (j == t ? p - 1.0f : p) * inv_n);
    }
}

__device__ __forceinline__ void write_dlogits(const float* x, int t, float* d, int V, int N, float m, float s,
                                              int start, int step) {
    write_dlogits_as<0>(x, t, d, V, N, m, s, start, step);
}

// Block tree over one pair per thread (sh_m, sh_s: blockDim entries): every thread returns the block's pair.
__device__ __forceinline__ void block_stats_tree(float* sh_m, float* sh_s, float& m, float& s) {
    int tid = threadIdx.x;
    sh_m[tid] = m; sh_s[tid] = s;
    __syncthreads();
    for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {   // tid merges the pair of tid + stride
        if (tid < stride) {
            float mm = sh_m[tid], ss = sh_s[tid];
            merge(mm, ss, sh_m[tid + stride], sh_s[tid + stride]);
            sh_m[tid] = mm; sh_s[tid] = ss;
        }
        __syncthreads();
    }
    m = sh_m[0]; s = sh_s[0];
}

// Butterfly over the lanes of a warp: every lane ends with the warp's pair.
__device__ __forceinline__ void warp_stats(float& m, float& s) {
    for (int offset = warpSize / 2; offset > 0; offset /= 2) {
        float m_b = shfl_xor(m, offset, warpSize), s_b = shfl_xor(s, offset, warpSize);
        merge(m, s, m_b, s_b);
    }
}

// Warps merge by shuffles, lane 0 of each stores the warp's pair, then every warp merges those pairs:
// every thread returns the block's pair after one __syncthreads (sh_m, sh_s: MAX_WARPS_PER_BLOCK entries).
__device__ __forceinline__ void block_stats_shfl(float* sh_m, float* sh_s, float& m, float& s) {
    int lane = threadIdx.x % warpSize, warp = threadIdx.x / warpSize, n_warps = blockDim.x / warpSize;
    warp_stats(m, s);
    if (lane == 0) { sh_m[warp] = m; sh_s[warp] = s; }
    __syncthreads();
    m = lane < n_warps ? sh_m[lane] : CE_EMPTY;
    s = lane < n_warps ? sh_s[lane] : 0.0f;
    warp_stats(m, s);
}

// ---- v1: thread `row` owns logits[row, :] (V,) --------------------------------------------------------------------
extern "C" __global__ void crossentropy_backward_v1(const float* __restrict__ logits, const int* __restrict__ targets,
                                                   float* __restrict__ dlogits, int N, int V) {
    int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= N) return;
    const float* x = logits + (long long)row * V;
    float m = CE_EMPTY, s = 0.0f, c = 0.0f;
    for (int j = 0; j < V; j++) online_update_kahan(m, s, c, x[j]);
    write_dlogits(x, targets[row], dlogits + (long long)row * V, V, N, m, s, 0, 1);
}

extern "C" __global__ void crossentropy_forward_v1(const float* __restrict__ logits, const int* __restrict__ targets,
                                                  float* __restrict__ losses, int N, int V) {
    int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= N) return;
    const float* x = logits + (long long)row * V;
    float m = CE_EMPTY, s = 0.0f, c = 0.0f;
    for (int j = 0; j < V; j++) online_update_kahan(m, s, c, x[j]);
    losses[row] = m + logf(s) - x[targets[row]];
}

// ---- v2: block `row` owns logits[row, :]; thread tid handles elements tid, tid + blockDim, ... -----------------------
extern "C" __global__ void crossentropy_backward_v2(const float* __restrict__ logits, const int* __restrict__ targets,
                                                   float* __restrict__ dlogits, int N, int V) {
    __shared__ float sh_m[1024], sh_s[1024];              // one pair per thread (blockDim <= 1024)
    int row = blockIdx.x;
    if (row >= N) return;                                 // the whole block leaves together
    const float* x = logits + (long long)row * V;
    float m, s;
    slice_stats(x, V, threadIdx.x, blockDim.x, m, s);
    block_stats_tree(sh_m, sh_s, m, s);
    write_dlogits(x, targets[row], dlogits + (long long)row * V, V, N, m, s, threadIdx.x, blockDim.x);
}

extern "C" __global__ void crossentropy_forward_v2(const float* __restrict__ logits, const int* __restrict__ targets,
                                                  float* __restrict__ losses, int N, int V) {
    __shared__ float sh_m[1024], sh_s[1024];
    int row = blockIdx.x;
    if (row >= N) return;
    const float* x = logits + (long long)row * V;
    float m, s;
    slice_stats(x, V, threadIdx.x, blockDim.x, m, s);
    block_stats_tree(sh_m, sh_s, m, s);
    if (threadIdx.x == 0) losses[row] = m + logf(s) - x[targets[row]];
}

// One launch, one reduction, both outputs. SHFL: merge the (max, sum) pairs with warp shuffles (block_stats_shfl,
// as v3) instead of the shared-memory tree; HF / TO: dlogits as float32 (0, float) or half bits (1 / 2, uint16).
template <bool SHFL, int HF, typename TO>
__device__ __forceinline__ void ce_fwd_bwd(const float* __restrict__ logits, const int* __restrict__ targets,
                                           float* __restrict__ losses, TO* __restrict__ dlogits, int N, int V) {
    __shared__ float sh_m[SHFL ? MAX_WARPS_PER_BLOCK : 1024], sh_s[SHFL ? MAX_WARPS_PER_BLOCK : 1024];
    int row = blockIdx.x;
    if (row >= N) return;
    const float* x = logits + (long long)row * V;
    int t = targets[row];
    float m, s;
    slice_stats(x, V, threadIdx.x, blockDim.x, m, s);
    if (SHFL) block_stats_shfl(sh_m, sh_s, m, s);
    else block_stats_tree(sh_m, sh_s, m, s);
    if (threadIdx.x == 0) losses[row] = m + logf(s) - x[t];
    write_dlogits_as<HF>(x, t, dlogits + (long long)row * V, V, N, m, s, threadIdx.x, blockDim.x);
}

extern "C" __global__ void crossentropy_forward_backward_v2(const float* __restrict__ logits,
                                                           const int* __restrict__ targets,
                                                           float* __restrict__ losses, float* __restrict__ dlogits,
                                                           int N, int V) {
    ce_fwd_bwd<false, 0>(logits, targets, losses, dlogits, N, V);
}

// ---- v3: v2 with warp shuffles ------------------------------------------------------------------------------------
extern "C" __global__ void crossentropy_backward_v3(const float* __restrict__ logits, const int* __restrict__ targets,
                                                   float* __restrict__ dlogits, int N, int V) {
    __shared__ float sh_m[MAX_WARPS_PER_BLOCK], sh_s[MAX_WARPS_PER_BLOCK];   // one pair per warp
    int row = blockIdx.x;
    if (row >= N) return;
    const float* x = logits + (long long)row * V;
    float m, s;
    slice_stats(x, V, threadIdx.x, blockDim.x, m, s);
    block_stats_shfl(sh_m, sh_s, m, s);
    write_dlogits(x, targets[row], dlogits + (long long)row * V, V, N, m, s, threadIdx.x, blockDim.x);
}

extern "C" __global__ void crossentropy_forward_v3(const float* __restrict__ logits, const int* __restrict__ targets,
                                                  float* __restrict__ losses, int N, int V) {
    __shared__ float sh_m[MAX_WARPS_PER_BLOCK], sh_s[MAX_WARPS_PER_BLOCK];
    int row = blockIdx.x;
    if (row >= N) return;
    const float* x = logits + (long long)row * V;
    float m, s;
    slice_stats(x, V, threadIdx.x, blockDim.x, m, s);
    block_stats_shfl(sh_m, sh_s, m, s);
    if (threadIdx.x == 0) losses[row] = m + logf(s) - x[targets[row]];
}

// ---- v4: v3 with float4 loads; block `row` owns logits[row, :], thread tid the float4 tid, tid + blockDim, ... -----
__device__ __forceinline__ bool ce_aligned16(const void* p) { return ((unsigned long long)p) % 16 == 0; }

// Fold four logits into (m, s): one rescale for the group's max, then four exps.
__device__ __forceinline__ void online_update4(float& m, float& s, float4 v) {
    float m4 = fmaxf(fmaxf(v.x, v.y), fmaxf(v.z, v.w));
    if (m4 > m) { s *= expf(m - m4); m = m4; }          // m = CE_EMPTY, s = 0 at the start: 0 * exp(..) = 0
    s += expf(v.x - m) + expf(v.y - m) + expf(v.z - m) + expf(v.w - m);
}

extern "C" __global__ void crossentropy_backward_v4(const float* __restrict__ logits, const int* __restrict__ targets,
                                                   float* __restrict__ dlogits, int N, int V) {
    __shared__ float sh_m[MAX_WARPS_PER_BLOCK], sh_s[MAX_WARPS_PER_BLOCK];   // one pair per warp
    int row = blockIdx.x;
    if (row >= N) return;                                 // the whole block leaves together
    const float* x = logits + (long long)row * V;
    float* d = dlogits + (long long)row * V;
    int t = targets[row];
    if (V % 4 != 0 || !ce_aligned16(logits) || !ce_aligned16(dlogits)) {   // v3's scalar loops
        float m, s;
        slice_stats(x, V, threadIdx.x, blockDim.x, m, s);
        block_stats_shfl(sh_m, sh_s, m, s);
        write_dlogits(x, t, d, V, N, m, s, threadIdx.x, blockDim.x);
        return;
    }
    const float4* x4 = reinterpret_cast<const float4*>(x);   // the row as V/4 float4
    float4* d4 = reinterpret_cast<float4*>(d);
    int V4 = V / 4;
    float m = CE_EMPTY, s = 0.0f;
#pragma unroll 4
    for (int j = threadIdx.x; j < V4; j += blockDim.x) online_update4(m, s, x4[j]);
    block_stats_shfl(sh_m, sh_s, m, s);                   // every thread: the row's (max, sum)
    float inv_s = 1.0f / s, inv_n = 1.0f / (float)N;
#pragma unroll 4
    for (int j = threadIdx.x; j < V4; j += blockDim.x) {
        float4 v = x4[j];                                 // second read of the row (L2 if it is still there)
        float4 p = make_float4(expf(v.x - m) * inv_s, expf(v.y - m) * inv_s, expf(v.z - m) * inv_s,
                               expf(v.w - m) * inv_s);
        if (j == t / 4) {                                 // the float4 holding the target: subtract the one-hot 1
            int e = t % 4;
            if (e == 0) p.x -= 1.0f; else if (e == 1) p.y -= 1.0f; else if (e == 2) p.z -= 1.0f; else p.w -= 1.0f;
        }
        d4[j] = make_float4(p.x * inv_n, p.y * inv_n, p.z * inv_n, p.w * inv_n);
    }
}

// ---- both outputs, dlogits in half precision (HF: 1 = bf16, 2 = fp16 bits), warp-shuffle merges ---------------------
extern "C" __global__ void crossentropy_forward_backward_half_bf16(const float* __restrict__ logits,
        const int* __restrict__ targets, float* __restrict__ losses, unsigned short* __restrict__ dlogits, int N,
        int V) {
    ce_fwd_bwd<true, 1>(logits, targets, losses, dlogits, N, V);
}

extern "C" __global__ void crossentropy_forward_backward_half_f16(const float* __restrict__ logits,
        const int* __restrict__ targets, float* __restrict__ losses, unsigned short* __restrict__ dlogits, int N,
        int V) {
    ce_fwd_bwd<true, 2>(logits, targets, losses, dlogits, N, V);
}

// ---- the same, float4 loads (v4's statistics pass) and 4 half dlogits per 8-byte store ----------------------------
// The scalar kernel above moved ~1.65 TB/s on GPT-2's (16384, 50304) logits (H200, 3.0 ms): one 4-byte load per
// thread per element, read twice. Needs V % 4 == 0, logits on 16 bytes and dlogits on 8 (the launcher checks).
template <int HF>
__device__ __forceinline__ void ce_fwd_bwd_half4(const float* __restrict__ logits, const int* __restrict__ targets,
                                                 float* __restrict__ losses, unsigned short* __restrict__ dlogits,
                                                 int N, int V) {
    __shared__ float sh_m[MAX_WARPS_PER_BLOCK], sh_s[MAX_WARPS_PER_BLOCK];
    int row = blockIdx.x;
    if (row >= N) return;                                 // the whole block leaves together
    const float* x = logits + (long long)row * V;
    const float4* x4 = reinterpret_cast<const float4*>(x);
    uint2* d2 = reinterpret_cast<uint2*>(dlogits + (long long)row * V);   // 4 half dlogits per uint2
    int t = targets[row], V4 = V / 4;
    float m = CE_EMPTY, s = 0.0f;
#pragma unroll 4
    for (int j = threadIdx.x; j < V4; j += blockDim.x) online_update4(m, s, x4[j]);
    block_stats_shfl(sh_m, sh_s, m, s);                   // every thread: the row's (max, sum)
    if (threadIdx.x == 0) losses[row] = m + logf(s) - x[t];
    float inv_s = 1.0f / s, inv_n = 1.0f / (float)N;
#pragma unroll 4
    for (int j = threadIdx.x; j < V4; j += blockDim.x) {
        float4 v = x4[j];                                 // second read of the row (L2 if it is still there)
        float p[4] = {expf(v.x - m) * inv_s, expf(v.y - m) * inv_s, expf(v.z - m) * inv_s, expf(v.w - m) * inv_s};
        if (j == t / 4) p[t % 4] -= 1.0f;                 // the one-hot 1 of the target
        d2[j] = make_uint2(pack_half2<HF>(p[0] * inv_n, p[1] * inv_n), pack_half2<HF>(p[2] * inv_n, p[3] * inv_n));
    }
}

extern "C" __global__ void crossentropy_forward_backward_half4_bf16(const float* __restrict__ logits,
        const int* __restrict__ targets, float* __restrict__ losses, unsigned short* __restrict__ dlogits, int N,
        int V) {
    ce_fwd_bwd_half4<1>(logits, targets, losses, dlogits, N, V);
}

extern "C" __global__ void crossentropy_forward_backward_half4_f16(const float* __restrict__ logits,
        const int* __restrict__ targets, float* __restrict__ losses, unsigned short* __restrict__ dlogits, int N,
        int V) {
    ce_fwd_bwd_half4<2>(logits, targets, losses, dlogits, N, V);
}

// ---- logits in half too (HF: 1 = bf16, 2 = fp16 bits), dlogits written over them or beside them -------------------
// The head's product writes the logits in the run's half format (fp32 accumulation, rounded on the way out, as
// PyTorch's autocast keeps them): half the bytes written by the product and read twice here. dlogits may be the
// logits array itself: every thread reads its own elements before it writes them, and the target's logit is read
// before the block's barrier (after it, another warp may already have overwritten it). So no __restrict__ on the two.
template <int HF>
__device__ __forceinline__ void ce_fwd_bwd_hh(const unsigned short* logits, const int* __restrict__ targets,
                                              float* __restrict__ losses, unsigned short* dlogits, int N, int V) {
    __shared__ float sh_m[MAX_WARPS_PER_BLOCK], sh_s[MAX_WARPS_PER_BLOCK];
    int row = blockIdx.x;
    if (row >= N) return;                                 // the whole block leaves together
    const unsigned short* x = logits + (long long)row * V;
    unsigned short* d = dlogits + (long long)row * V;
    int t = targets[row];
    float xt = half_to_f32<HF>(x[t]);                     // before any thread of the block writes
    float m = CE_EMPTY, s = 0.0f;
    for (int j = threadIdx.x; j < V; j += blockDim.x) online_update(m, s, half_to_f32<HF>(x[j]));
    block_stats_shfl(sh_m, sh_s, m, s);                   // every thread: the row's (max, sum)
    if (threadIdx.x == 0) losses[row] = m + logf(s) - xt;
    float inv_s = 1.0f / s, inv_n = 1.0f / (float)N;
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
        float p = expf(half_to_f32<HF>(x[j]) - m) * inv_s;
        d[j] = f32_to_half_bits<HF>((j == t ? p - 1.0f : p) * inv_n);
    }
}

// Four half logits per 8-byte load, four half dlogits per 8-byte store (V % 4 == 0, both arrays on 8 bytes).
template <int HF>
__device__ __forceinline__ void ce_fwd_bwd_hh4(const unsigned short* logits, const int* __restrict__ targets,
                                               float* __restrict__ losses, unsigned short* dlogits, int N, int V) {
    __shared__ float sh_m[MAX_WARPS_PER_BLOCK], sh_s[MAX_WARPS_PER_BLOCK];
    int row = blockIdx.x;
    if (row >= N) return;
    const uint2* x2 = reinterpret_cast<const uint2*>(logits + (long long)row * V);
    uint2* d2 = reinterpret_cast<uint2*>(dlogits + (long long)row * V);
    int t = targets[row], V4 = V / 4;
    float xt = half_to_f32<HF>(logits[(long long)row * V + t]);   // before any thread of the block writes
    float m = CE_EMPTY, s = 0.0f;
#pragma unroll 4
    for (int j = threadIdx.x; j < V4; j += blockDim.x) {
        uint2 w = x2[j];
        online_update4(m, s, make_float4(half_to_f32<HF>(w.x & 0xFFFFu), half_to_f32<HF>(w.x >> 16),
                                         half_to_f32<HF>(w.y & 0xFFFFu), half_to_f32<HF>(w.y >> 16)));
    }
    block_stats_shfl(sh_m, sh_s, m, s);
    if (threadIdx.x == 0) losses[row] = m + logf(s) - xt;
    float inv_s = 1.0f / s, inv_n = 1.0f / (float)N;
#pragma unroll 4
    for (int j = threadIdx.x; j < V4; j += blockDim.x) {
        uint2 w = x2[j];                                  // this thread's own 4 logits: read, then overwritten
        float p[4] = {expf(half_to_f32<HF>(w.x & 0xFFFFu) - m) * inv_s, expf(half_to_f32<HF>(w.x >> 16) - m) * inv_s,
                      expf(half_to_f32<HF>(w.y & 0xFFFFu) - m) * inv_s, expf(half_to_f32<HF>(w.y >> 16) - m) * inv_s};
        if (j == t / 4) p[t % 4] -= 1.0f;
        d2[j] = make_uint2(pack_half2<HF>(p[0] * inv_n, p[1] * inv_n), pack_half2<HF>(p[2] * inv_n, p[3] * inv_n));
    }
}

// Eight half logits per 16-byte load and eight half dlogits per 16-byte store (V % 8 == 0, both arrays on 16 bytes):
// the same sums as hh4 in another grouping, so the last bits may differ from it.
__device__ __forceinline__ void half8_unpack(uint4 w, unsigned short b[8]) {
    unsigned int u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int k = 0; k < 4; k++) { b[2 * k] = (unsigned short)(u[k] & 0xFFFFu); b[2 * k + 1] = (unsigned short)(u[k] >> 16); }
}

template <int HF>
__device__ __forceinline__ void ce_fwd_bwd_hh8(const unsigned short* logits, const int* __restrict__ targets,
                                               float* __restrict__ losses, unsigned short* dlogits, int N, int V) {
    __shared__ float sh_m[MAX_WARPS_PER_BLOCK], sh_s[MAX_WARPS_PER_BLOCK];
    int row = blockIdx.x;
    if (row >= N) return;
    const uint4* x8 = reinterpret_cast<const uint4*>(logits + (long long)row * V);
    uint4* d8 = reinterpret_cast<uint4*>(dlogits + (long long)row * V);
    int t = targets[row], V8 = V / 8;
    float xt = half_to_f32<HF>(logits[(long long)row * V + t]);   // before any thread of the block writes
    float m = CE_EMPTY, s = 0.0f;
#pragma unroll 2
    for (int j = threadIdx.x; j < V8; j += blockDim.x) {
        unsigned short b[8];
        half8_unpack(x8[j], b);
        online_update4(m, s, make_float4(half_to_f32<HF>(b[0]), half_to_f32<HF>(b[1]), half_to_f32<HF>(b[2]),
                                         half_to_f32<HF>(b[3])));
        online_update4(m, s, make_float4(half_to_f32<HF>(b[4]), half_to_f32<HF>(b[5]), half_to_f32<HF>(b[6]),
                                         half_to_f32<HF>(b[7])));
    }
    block_stats_shfl(sh_m, sh_s, m, s);
    if (threadIdx.x == 0) losses[row] = m + logf(s) - xt;
    float inv_s = 1.0f / s, inv_n = 1.0f / (float)N;
#pragma unroll 2
    for (int j = threadIdx.x; j < V8; j += blockDim.x) {
        unsigned short b[8];
        half8_unpack(x8[j], b);                           // this thread's own 8 logits: read, then overwritten
        float p[8];
#pragma unroll
        for (int k = 0; k < 8; k++) p[k] = expf(half_to_f32<HF>(b[k]) - m) * inv_s;
        if (j == t / 8) p[t % 8] -= 1.0f;
        d8[j] = make_uint4(pack_half2<HF>(p[0] * inv_n, p[1] * inv_n), pack_half2<HF>(p[2] * inv_n, p[3] * inv_n),
                           pack_half2<HF>(p[4] * inv_n, p[5] * inv_n), pack_half2<HF>(p[6] * inv_n, p[7] * inv_n));
    }
}

extern "C" __global__ void crossentropy_forward_backward_hh8_bf16(const unsigned short* logits,
        const int* __restrict__ targets, float* __restrict__ losses, unsigned short* dlogits, int N, int V) {
    ce_fwd_bwd_hh8<1>(logits, targets, losses, dlogits, N, V);
}

extern "C" __global__ void crossentropy_forward_backward_hh8_f16(const unsigned short* logits,
        const int* __restrict__ targets, float* __restrict__ losses, unsigned short* dlogits, int N, int V) {
    ce_fwd_bwd_hh8<2>(logits, targets, losses, dlogits, N, V);
}

extern "C" __global__ void crossentropy_forward_backward_hh_bf16(const unsigned short* logits,
        const int* __restrict__ targets, float* __restrict__ losses, unsigned short* dlogits, int N, int V) {
    ce_fwd_bwd_hh<1>(logits, targets, losses, dlogits, N, V);
}

extern "C" __global__ void crossentropy_forward_backward_hh_f16(const unsigned short* logits,
        const int* __restrict__ targets, float* __restrict__ losses, unsigned short* dlogits, int N, int V) {
    ce_fwd_bwd_hh<2>(logits, targets, losses, dlogits, N, V);
}

extern "C" __global__ void crossentropy_forward_backward_hh4_bf16(const unsigned short* logits,
        const int* __restrict__ targets, float* __restrict__ losses, unsigned short* dlogits, int N, int V) {
    ce_fwd_bwd_hh4<1>(logits, targets, losses, dlogits, N, V);
}

extern "C" __global__ void crossentropy_forward_backward_hh4_f16(const unsigned short* logits,
        const int* __restrict__ targets, float* __restrict__ losses, unsigned short* dlogits, int N, int V) {
    ce_fwd_bwd_hh4<2>(logits, targets, losses, dlogits, N, V);
}
