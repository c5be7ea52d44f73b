// attention.cu: causal multi-head self-attention backward (see kernels/numba/attention.py for the math).
// q, k, v are read straight from qkv (B, T, 3C) at channel offsets 0, C, 2C + h*hs; att (B, nh, T, T) was saved
// by the forward. Masked entries (s > t) have att = 0 and are skipped, not multiplied by zero.
// The training loop's causal softmax forward / backward (end of file) also read and write half precision: bf16 or
// fp16 as uint16 bits, converted in registers (rounding by half.h's f32_to_bf16_bits / f32_to_f16_bits, exactly as
// convert.cu); every sum stays fp32. Each format pair is its own extern "C" entry point, instantiated from one
// template whose format arguments are compile-time constants (the f32 entry points keep their names and arguments).
// Half inputs too: the raw scores pre (forward) and datt (backward) may be half bits of the output's format (half in,
// half out: attention_softmax_fwd[_w{K}]_<bf16|f16>_in, attention_dpre[_w{K}]_<fmt>_<fmt>_<fmt>), read through
// load_f32 (exact) and summed in fp32.
#include "portable.h"
#include "half.h"

// Element formats of the softmax kernels' arrays (template arguments): float32, or bf16 / fp16 bits (uint16).
#define FMT_F32 0
#define FMT_BF16 1
#define FMT_F16 2

// A value of format FMT as float32 (the float itself, or the half bits converted exactly: bf16 = the 16 bits on
// top of 16 zero bits, as convert.cu's bf16_to_f32_v1; fp16 = __half2float, subnormals, inf and NaN included).
template <int FMT> __device__ __forceinline__ float load_f32(float x) { return x; }
template <int FMT> __device__ __forceinline__ float load_f32(unsigned short b) {
    return FMT == FMT_BF16 ? __uint_as_float(((unsigned int)b) << 16) : __half2float(__ushort_as_half(b));
}
// Store a float32 value as format FMT (the float itself, or rounded to nearest even into half bits).
template <int FMT> __device__ __forceinline__ void store_f32(float* p, float v) { *p = v; }
template <int FMT> __device__ __forceinline__ void store_f32(unsigned short* p, float v) {
    *p = f32_to_half_bits<FMT>(v);
}

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
// AF / OF / DF: the formats of att / dpre / datt (float, or half bits of format FMT_BF16 / FMT_F16, read and written
// through load_f32 / store_f32); every sum is fp32. dpre may be datt (in place) when both are the same format: each
// thread reads its own columns of datt before it writes the same columns of dpre.
template <int AF, int OF, int DF, typename TA, typename TD, typename TO>
__device__ __forceinline__ void dpre_row(const TA* __restrict__ att, const TD* __restrict__ datt,
                                         TO* __restrict__ dpre, int T, float scale) {
    __shared__ float partial[MAX_WARPS_PER_BLOCK];
    long long row = blockIdx.x;
    int t = (int)(row % T);
    const TA* a = att + row * T;
    const TD* da = datt + row * T;
    TO* out = dpre + row * T;
    float v = 0.0f;
    for (int s = threadIdx.x; s <= t; s += blockDim.x) v += load_f32<AF>(a[s]) * load_f32<DF>(da[s]);
    v = warp_sum(v);
    int lane = threadIdx.x % warpSize, warp = threadIdx.x / warpSize;
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    int n_warps = (blockDim.x + warpSize - 1) / warpSize;
    float dot = 0.0f;
    for (int w = 0; w < n_warps; w++) dot += partial[w];
    for (int s = threadIdx.x; s < T; s += blockDim.x)
        store_f32<OF>(out + s, s <= t ? scale * load_f32<AF>(a[s]) * (load_f32<DF>(da[s]) - dot) : 0.0f);
}

extern "C" __global__ void attention_dpre(const float* __restrict__ att, const float* __restrict__ datt,
                                         float* __restrict__ dpre, int T, float scale) {
    dpre_row<FMT_F32, FMT_F32, FMT_F32>(att, datt, dpre, T, scale);
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
// F32: write the float32 att; HF: also (or only, F32 = 0) write att_h, the same float32 values rounded to half bits
// of format HF (FMT_BF16 / FMT_F16; FMT_F32 = no half output). IF: the format of pre (FMT_F32: float; FMT_BF16 /
// FMT_F16: half bits, TI = unsigned short, read through load_f32; att_h may then be pre, in place).
template <int F32, int HF, int IF, typename TI>
__device__ __forceinline__ void softmax_fwd_row(const TI* __restrict__ pre, float* __restrict__ att,
                                                unsigned short* __restrict__ att_h, int T, float scale) {
    __shared__ float partial[MAX_WARPS_PER_BLOCK];
    long long row = blockIdx.x;
    int t = (int)(row % T);
    const TI* p = pre + row * T;
    int lane = threadIdx.x % warpSize, warp = threadIdx.x / warpSize;
    int n_warps = (blockDim.x + warpSize - 1) / warpSize;
    float mx = -3.402823466e38f;             // the lowest float (t >= 0: every row has at least s = 0)
    for (int s = threadIdx.x; s <= t; s += blockDim.x) mx = fmaxf(mx, scale * load_f32<IF>(p[s]));
    mx = warp_max(mx);
    if (lane == 0) partial[warp] = mx;
    __syncthreads();
    mx = partial[0];
    for (int w = 1; w < n_warps; w++) mx = fmaxf(mx, partial[w]);
    __syncthreads();                          // everyone has read the maxima before the slots are reused
    float sum = 0.0f;
    for (int s = threadIdx.x; s <= t; s += blockDim.x) sum += expf(scale * load_f32<IF>(p[s]) - mx);
    sum = warp_sum(sum);
    if (lane == 0) partial[warp] = sum;
    __syncthreads();
    sum = 0.0f;
    for (int w = 0; w < n_warps; w++) sum += partial[w];
    float inv = 1.0f / sum;
    for (int s = threadIdx.x; s < T; s += blockDim.x) {
        float v = s <= t ? expf(scale * load_f32<IF>(p[s]) - mx) * inv : 0.0f;
        if (F32) att[row * T + s] = v;
        if (HF != FMT_F32) store_f32<HF>(att_h + row * T + s, v);
    }
}

extern "C" __global__ void attention_softmax_fwd(const float* __restrict__ pre, float* __restrict__ att,
                                                int T, float scale) {
    softmax_fwd_row<1, FMT_F32, FMT_F32>(pre, att, nullptr, T, scale);
}

// ---- half-precision entry points of the two softmax kernels (the same templates, one name per format pair) --------
// Forward, half only: pre float32 (rows, T) -> att_h half bits (rows, T).
extern "C" __global__ void attention_softmax_fwd_bf16(const float* __restrict__ pre,
                                                     unsigned short* __restrict__ att_h, int T, float scale) {
    softmax_fwd_row<0, FMT_BF16, FMT_F32>(pre, nullptr, att_h, T, scale);
}
extern "C" __global__ void attention_softmax_fwd_f16(const float* __restrict__ pre,
                                                    unsigned short* __restrict__ att_h, int T, float scale) {
    softmax_fwd_row<0, FMT_F16, FMT_F32>(pre, nullptr, att_h, T, scale);
}
// Forward, both: att float32 (may be pre) and att_h, its values rounded to half bits.
extern "C" __global__ void attention_softmax_fwd_f32_bf16(const float* __restrict__ pre, float* __restrict__ att,
                                                         unsigned short* __restrict__ att_h, int T, float scale) {
    softmax_fwd_row<1, FMT_BF16, FMT_F32>(pre, att, att_h, T, scale);
}
extern "C" __global__ void attention_softmax_fwd_f32_f16(const float* __restrict__ pre, float* __restrict__ att,
                                                        unsigned short* __restrict__ att_h, int T, float scale) {
    softmax_fwd_row<1, FMT_F16, FMT_F32>(pre, att, att_h, T, scale);
}

// Forward, half in, half out (the same format): pre half bits (rows, T) -> att_h half bits; att_h may be pre.
extern "C" __global__ void attention_softmax_fwd_bf16_in(const unsigned short* __restrict__ pre,
                                                        unsigned short* __restrict__ att_h, int T, float scale) {
    softmax_fwd_row<0, FMT_BF16, FMT_BF16>(pre, nullptr, att_h, T, scale);
}
extern "C" __global__ void attention_softmax_fwd_f16_in(const unsigned short* __restrict__ pre,
                                                       unsigned short* __restrict__ att_h, int T, float scale) {
    softmax_fwd_row<0, FMT_F16, FMT_F16>(pre, nullptr, att_h, T, scale);
}

// Backward: attention_dpre_<att format>_<dpre format>; datt is float32 in all of them.
#define ATTENTION_DPRE(NAME, AF, TA, OF, TO)                                                                     \
    extern "C" __global__ void NAME(const TA* __restrict__ att, const float* __restrict__ datt,                      \
                                    TO* __restrict__ dpre, int T, float scale) {                                     \
        dpre_row<AF, OF, FMT_F32>(att, datt, dpre, T, scale);                                                        \
    }
ATTENTION_DPRE(attention_dpre_bf16_f32, FMT_BF16, unsigned short, FMT_F32, float)
ATTENTION_DPRE(attention_dpre_f16_f32, FMT_F16, unsigned short, FMT_F32, float)
ATTENTION_DPRE(attention_dpre_f32_bf16, FMT_F32, float, FMT_BF16, unsigned short)
ATTENTION_DPRE(attention_dpre_f32_f16, FMT_F32, float, FMT_F16, unsigned short)
ATTENTION_DPRE(attention_dpre_bf16_bf16, FMT_BF16, unsigned short, FMT_BF16, unsigned short)
ATTENTION_DPRE(attention_dpre_f16_f16, FMT_F16, unsigned short, FMT_F16, unsigned short)
// Backward, all half (att, datt, dpre of one format): attention_dpre_<att>_<datt>_<dpre>; dpre may be datt (in place).
extern "C" __global__ void attention_dpre_bf16_bf16_bf16(const unsigned short* __restrict__ att,
                                                         const unsigned short* __restrict__ datt,
                                                         unsigned short* __restrict__ dpre, int T, float scale) {
    dpre_row<FMT_BF16, FMT_BF16, FMT_BF16>(att, datt, dpre, T, scale);
}
extern "C" __global__ void attention_dpre_f16_f16_f16(const unsigned short* __restrict__ att,
                                                      const unsigned short* __restrict__ datt,
                                                      unsigned short* __restrict__ dpre, int T, float scale) {
    dpre_row<FMT_F16, FMT_F16, FMT_F16>(att, datt, dpre, T, scale);
}

// ---- warp-per-row versions (the launchers' choice when T <= 32 * warpSize) ------------------------------------------
// The block-per-row kernels above spend a block (two or three barriers, three passes over the row) on a row of a few
// hundred live elements: at T = 1024 and 196608 rows (GPT-2 at B=16) they moved ~1.5 TB/s. Here one warp owns one
// row and keeps it in registers: lane l holds elements s = l + j * warpSize, j < K (K = T / warpSize rounded up to a
// compile-time bucket), loaded once (only s <= t: the causal half, about half the row on average), reduced with
// shuffles only (no shared memory, no barrier), and written once (zeros for s > t). Blocks hold several rows.
// IF / TI: the format of pre, as in softmax_fwd_row (float, or half bits read through load_f32).
template <int K, int F32, int HF, int IF, typename TI>
__device__ __forceinline__ void softmax_fwd_warp(const TI* __restrict__ pre, float* __restrict__ att,
                                                 unsigned short* __restrict__ att_h, long long rows, int T,
                                                 float scale) {
    int lane = threadIdx.x % warpSize;
    long long row = (long long)blockIdx.x * (blockDim.x / warpSize) + threadIdx.x / warpSize;
    if (row >= rows) return;                                  // whole warps leave together
    int t = (int)(row % T);
    const TI* p = pre + row * T;
    float v[K];
    float mx = -3.402823466e38f;
#pragma unroll
    for (int j = 0; j < K; j++) {
        int s = lane + j * warpSize;
        v[j] = s <= t ? scale * load_f32<IF>(p[s]) : -3.402823466e38f;
        mx = fmaxf(mx, v[j]);
    }
    mx = warp_max(mx);
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < K; j++) {
        int s = lane + j * warpSize;
        v[j] = s <= t ? expf(v[j] - mx) : 0.0f;
        sum += v[j];
    }
    float inv = 1.0f / warp_sum(sum);
#pragma unroll
    for (int j = 0; j < K; j++) {
        int s = lane + j * warpSize;
        if (s < T) {
            float out = v[j] * inv;                           // 0 for s > t
            if (F32) att[row * T + s] = out;
            if (HF != FMT_F32) store_f32<HF>(att_h + row * T + s, out);
        }
    }
}

// DF / TD: the format of datt (float, or half bits of the same format as att and dpre).
template <int K, int AF, int OF, int DF, typename TA, typename TD, typename TO>
__device__ __forceinline__ void dpre_warp(const TA* __restrict__ att, const TD* __restrict__ datt,
                                          TO* __restrict__ dpre, long long rows, int T, float scale) {
    int lane = threadIdx.x % warpSize;
    long long row = (long long)blockIdx.x * (blockDim.x / warpSize) + threadIdx.x / warpSize;
    if (row >= rows) return;
    int t = (int)(row % T);
    const TA* a = att + row * T;
    const TD* da = datt + row * T;
    float av[K], dv[K];
    float dot = 0.0f;
#pragma unroll
    for (int j = 0; j < K; j++) {
        int s = lane + j * warpSize;
        av[j] = s <= t ? load_f32<AF>(a[s]) : 0.0f;
        dv[j] = s <= t ? load_f32<DF>(da[s]) : 0.0f;
        dot += av[j] * dv[j];
    }
    dot = warp_sum(dot);
#pragma unroll
    for (int j = 0; j < K; j++) {
        int s = lane + j * warpSize;
        // +0 above the diagonal, written as such: 0 * (0 - dot) would be -0 (sign bit set) wherever dot > 0
        if (s < T) store_f32<OF>(dpre + row * T + s, s <= t ? scale * av[j] * (dv[j] - dot) : 0.0f);
    }
}

// Entry points: attention_softmax_fwd_w{K}_<out> with out = f32 | bf16 | f16 (one output: the engine writes the
// matmul format only), attention_dpre_w{K}_<att>_<dpre> for the formats the engine uses (f32_f32, bf16_bf16,
// f16_f16), and the half-in versions: attention_softmax_fwd_w{K}_<bf16|f16>_in (pre and att_h half bits of one
// format) and attention_dpre_w{K}_<fmt>_<fmt>_<fmt> (att, datt, dpre half bits of one format).
// K in {1, 2, 4, 8, 16, 32}: T <= K * warpSize.
#define SOFTMAX_FWD_WARP(K)                                                                                          \
    extern "C" __global__ void attention_softmax_fwd_w##K##_f32(const float* __restrict__ pre,                       \
            float* __restrict__ att, long long rows, int T, float scale) {                                           \
        softmax_fwd_warp<K, 1, FMT_F32, FMT_F32>(pre, att, nullptr, rows, T, scale); }                               \
    extern "C" __global__ void attention_softmax_fwd_w##K##_bf16(const float* __restrict__ pre,                      \
            unsigned short* __restrict__ att_h, long long rows, int T, float scale) {                                \
        softmax_fwd_warp<K, 0, FMT_BF16, FMT_F32>(pre, nullptr, att_h, rows, T, scale); }                            \
    extern "C" __global__ void attention_softmax_fwd_w##K##_f16(const float* __restrict__ pre,                       \
            unsigned short* __restrict__ att_h, long long rows, int T, float scale) {                                \
        softmax_fwd_warp<K, 0, FMT_F16, FMT_F32>(pre, nullptr, att_h, rows, T, scale); }                             \
    extern "C" __global__ void attention_dpre_w##K##_f32_f32(const float* __restrict__ att,                          \
            const float* __restrict__ datt, float* __restrict__ dpre, long long rows, int T, float scale) {          \
        dpre_warp<K, FMT_F32, FMT_F32, FMT_F32>(att, datt, dpre, rows, T, scale); }                                  \
    extern "C" __global__ void attention_dpre_w##K##_bf16_bf16(const unsigned short* __restrict__ att,               \
            const float* __restrict__ datt, unsigned short* __restrict__ dpre, long long rows, int T,                \
            float scale) {                                                                                           \
        dpre_warp<K, FMT_BF16, FMT_BF16, FMT_F32>(att, datt, dpre, rows, T, scale); }                                \
    extern "C" __global__ void attention_dpre_w##K##_f16_f16(const unsigned short* __restrict__ att,                 \
            const float* __restrict__ datt, unsigned short* __restrict__ dpre, long long rows, int T,                \
            float scale) {                                                                                           \
        dpre_warp<K, FMT_F16, FMT_F16, FMT_F32>(att, datt, dpre, rows, T, scale); }                                  \
    extern "C" __global__ void attention_softmax_fwd_w##K##_bf16_in(const unsigned short* __restrict__ pre,          \
            unsigned short* __restrict__ att_h, long long rows, int T, float scale) {                                \
        softmax_fwd_warp<K, 0, FMT_BF16, FMT_BF16>(pre, nullptr, att_h, rows, T, scale); }                           \
    extern "C" __global__ void attention_softmax_fwd_w##K##_f16_in(const unsigned short* __restrict__ pre,           \
            unsigned short* __restrict__ att_h, long long rows, int T, float scale) {                                \
        softmax_fwd_warp<K, 0, FMT_F16, FMT_F16>(pre, nullptr, att_h, rows, T, scale); }                             \
    extern "C" __global__ void attention_dpre_w##K##_bf16_bf16_bf16(const unsigned short* __restrict__ att,          \
            const unsigned short* __restrict__ datt, unsigned short* __restrict__ dpre, long long rows, int T,       \
            float scale) {                                                                                           \
        dpre_warp<K, FMT_BF16, FMT_BF16, FMT_BF16>(att, datt, dpre, rows, T, scale); }                               \
    extern "C" __global__ void attention_dpre_w##K##_f16_f16_f16(const unsigned short* __restrict__ att,             \
            const unsigned short* __restrict__ datt, unsigned short* __restrict__ dpre, long long rows, int T,       \
            float scale) {                                                                                           \
        dpre_warp<K, FMT_F16, FMT_F16, FMT_F16>(att, datt, dpre, rows, T, scale); }
SOFTMAX_FWD_WARP(1)
SOFTMAX_FWD_WARP(2)
SOFTMAX_FWD_WARP(4)
SOFTMAX_FWD_WARP(8)
SOFTMAX_FWD_WARP(16)
SOFTMAX_FWD_WARP(32)

// ---- vectorised warp-per-row versions, half in and half out (the engine's half-score path) --------------------------
// The warp-per-row kernels above move 2-byte elements one per lane per instruction, and ncu showed them issue-bound
// at ~1 TB/s on GPT-2's scores (H200: SM throughput 67%, DRAM 20-28%, 497 / 522 us per layer). Here lane l owns
// chunks of 8 consecutive elements, s = 8 * (l + c * warpSize) + i (i < 8, c < C): one 16-byte load or store per
// chunk, a warp moves 512 contiguous bytes per instruction; chunks wholly above the diagonal are not read. The
// exponential is exp2 of the scores pre-multiplied by log2(e) (the same value as exp(scale*x - max), one rounding
// apart). Needs T % 8 == 0 and 16-byte aligned rows (the launcher checks; otherwise the kernels above run).
// C in {1, 2, 4, 8}: T <= 8 * C * warpSize.
template <int FMT> __device__ __forceinline__ void unpack8(uint4 q, float* f) {
    unsigned int w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        f[2 * i] = load_f32<FMT>((unsigned short)(w[i] & 0xFFFFu));          // little-endian: element 2i is low
        f[2 * i + 1] = load_f32<FMT>((unsigned short)(w[i] >> 16));
    }
}

template <int FMT> __device__ __forceinline__ uint4 pack8(const float* f) {
    return make_uint4(pack_half2<FMT>(f[0], f[1]), pack_half2<FMT>(f[2], f[3]), pack_half2<FMT>(f[4], f[5]),
                      pack_half2<FMT>(f[6], f[7]));
}

template <int C, int HF>
__device__ __forceinline__ void softmax_fwd_warp_vec(const unsigned short* pre, unsigned short* att_h,
                                                     long long rows, int T, float scale) {
    int lane = threadIdx.x % warpSize;
    long long row = (long long)blockIdx.x * (blockDim.x / warpSize) + threadIdx.x / warpSize;
    if (row >= rows) return;                                  // whole warps leave together
    int t = (int)(row % T);
    const uint4* p = reinterpret_cast<const uint4*>(pre + row * T);
    uint4* o = reinterpret_cast<uint4*>(att_h + row * T);     // may be p (in place): every load precedes every store
    const float sl2 = scale * 1.4426950408889634f;            // exp(scale*x - m) = exp2(scale*log2(e)*x - m')
    float v[8 * C];
    float mx = -3.402823466e38f;
#pragma unroll
    for (int c = 0; c < C; c++) {
        int s0 = 8 * (lane + c * warpSize);
        uint4 q = make_uint4(0u, 0u, 0u, 0u);
        if (s0 <= t) q = p[lane + c * warpSize];              // chunks above the diagonal are not read
        float f[8];
        unpack8<HF>(q, f);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            v[8 * c + i] = s0 + i <= t ? sl2 * f[i] : -3.402823466e38f;
            mx = fmaxf(mx, v[8 * c + i]);
        }
    }
    mx = warp_max(mx);
    float sum = 0.0f;
#pragma unroll
    for (int c = 0; c < C; c++) {
        int s0 = 8 * (lane + c * warpSize);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            v[8 * c + i] = s0 + i <= t ? exp2f(v[8 * c + i] - mx) : 0.0f;
            sum += v[8 * c + i];
        }
    }
    float inv = 1.0f / warp_sum(sum);
#pragma unroll
    for (int c = 0; c < C; c++) {
        if (8 * (lane + c * warpSize) < T) {
            float f[8];
#pragma unroll
            for (int i = 0; i < 8; i++) f[i] = v[8 * c + i] * inv;    // 0 above the diagonal
            o[lane + c * warpSize] = pack8<HF>(f);
        }
    }
}

// att, datt, dpre: half bits of format HF; dpre may be datt (in place).
template <int C, int HF>
__device__ __forceinline__ void dpre_warp_vec(const unsigned short* att, const unsigned short* datt,
                                              unsigned short* dpre, long long rows, int T, float scale) {
    int lane = threadIdx.x % warpSize;
    long long row = (long long)blockIdx.x * (blockDim.x / warpSize) + threadIdx.x / warpSize;
    if (row >= rows) return;
    int t = (int)(row % T);
    const uint4* a = reinterpret_cast<const uint4*>(att + row * T);
    const uint4* d = reinterpret_cast<const uint4*>(datt + row * T);
    uint4* o = reinterpret_cast<uint4*>(dpre + row * T);
    uint4 qa[C], qd[C];                                       // the row stays packed: half the registers of floats
    float dot = 0.0f;
#pragma unroll
    for (int c = 0; c < C; c++) {
        int s0 = 8 * (lane + c * warpSize);
        qa[c] = qd[c] = make_uint4(0u, 0u, 0u, 0u);
        if (s0 <= t) {
            qa[c] = a[lane + c * warpSize];
            qd[c] = d[lane + c * warpSize];
        }
        float fa[8], fd[8];
        unpack8<HF>(qa[c], fa);
        unpack8<HF>(qd[c], fd);
#pragma unroll
        for (int i = 0; i < 8; i++) dot += s0 + i <= t ? fa[i] * fd[i] : 0.0f;
    }
    dot = warp_sum(dot);
#pragma unroll
    for (int c = 0; c < C; c++) {
        int s0 = 8 * (lane + c * warpSize);
        if (s0 < T) {
            float fa[8], fd[8], f[8];
            unpack8<HF>(qa[c], fa);
            unpack8<HF>(qd[c], fd);
#pragma unroll
            for (int i = 0; i < 8; i++) f[i] = s0 + i <= t ? scale * fa[i] * (fd[i] - dot) : 0.0f;
            o[lane + c * warpSize] = pack8<HF>(f);
        }
    }
}

// Entry points: attention_softmax_fwd_v{C}_<bf16|f16>_in and attention_dpre_v{C}_<fmt>_<fmt>_<fmt>, with the
// arguments of their _w{K} namesakes.
#define SOFTMAX_WARP_VEC(C)                                                                                          \
    extern "C" __global__ void attention_softmax_fwd_v##C##_bf16_in(const unsigned short* pre,                       \
            unsigned short* att_h, long long rows, int T, float scale) {                                             \
        softmax_fwd_warp_vec<C, FMT_BF16>(pre, att_h, rows, T, scale); }                                             \
    extern "C" __global__ void attention_softmax_fwd_v##C##_f16_in(const unsigned short* pre,                        \
            unsigned short* att_h, long long rows, int T, float scale) {                                             \
        softmax_fwd_warp_vec<C, FMT_F16>(pre, att_h, rows, T, scale); }                                              \
    extern "C" __global__ void attention_dpre_v##C##_bf16_bf16_bf16(const unsigned short* att,                       \
            const unsigned short* datt, unsigned short* dpre, long long rows, int T, float scale) {                   \
        dpre_warp_vec<C, FMT_BF16>(att, datt, dpre, rows, T, scale); }                                               \
    extern "C" __global__ void attention_dpre_v##C##_f16_f16_f16(const unsigned short* att,                          \
            const unsigned short* datt, unsigned short* dpre, long long rows, int T, float scale) {                  \
        dpre_warp_vec<C, FMT_F16>(att, datt, dpre, rows, T, scale); }
SOFTMAX_WARP_VEC(1)
SOFTMAX_WARP_VEC(2)
SOFTMAX_WARP_VEC(4)
SOFTMAX_WARP_VEC(8)
