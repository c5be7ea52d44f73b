// fused.cu: the glue the training engine runs between matrix products, one launch each (portable: NVRTC on NVIDIA,
// hiprtc/hipcc on AMD). Same names and math as kernels/numba/fused.py. Shapes: N = B*T rows, C = nh*hs channels.
//   bias_add:          out (N,C) = inp + bias[col] (+ res); out may be inp or res (in place: no __restrict__ there)
//   bias_gelu_forward: pre (N,C) = inp + bias[col] (pre may be inp); out = gelu_tanh(pre), float32 or half bits;
//                      the _nopre entries do not write pre (the half runs keep fc without its bias); the _hpre
//                      entries write pre as half bits and take GELU of that rounded value (a recompute from pre, gelu_half,
//                      gives the same bits)
//   gelu_half:         out (N*C,) = gelu_tanh(inp) of half bits in, half bits out (the selective recompute of _hpre)
//   split_heads:       out[b*nh+h, t, d] = inp[b*T+t, col0 + h*hs + d] (+ bias[h*hs+d]); inp (N, ld) rows
//   merge_heads:       out[b*T+t, col0 + h*hs + d] = inp[b*nh+h, t, d]; out (N, ld), other columns untouched
//   colsum_convert:    colsum (C,) = sum over rows of inp (N,C), deterministic two-stage; optionally out = half(inp);
//                      the _gelu entries sum and convert inp * gelu'(pre + gbias[col]) instead: GELU's backward fused into the
//                      pass over dfc that the fc layer's backward makes anyway (the float32 dfc is never written);
//                      the _gelu_hpre entries read GELU's input as half bits with its bias in (bias_gelu_forward's _hpre)
//   layernorm_forward_half: LayerNorm (as layernorm.cu) with out as half bits; one warp per row
// Half outputs are uint16 bits, rounded by half.h (bit-exact with convert.cu, kernels/numba/convert.py, NumPy).
// Entry points are <op>_v1_<out>, <out> = f32 | bf16 | f16 (the output format; a template parameter inside).
// v1 layouts (memory bound: every element is read once and written once, accesses coalesced):
//   elementwise ops (bias_add, bias_gelu_forward): a grid-stride loop over the N*C elements with a capped grid; each
//     thread tracks its column incrementally (col += stride % C, wrap once) instead of a 64-bit modulo per element.
//   split/merge: 2-D blocks, threadIdx.y picks a row b*T+t (grid-stride over the N rows), threadIdx.x walks the C
//     columns of that row, so consecutive threads touch consecutive d of the same (b, h, t): the (N, ld) side and the
//     (B*nh, T, hs) side are both contiguous in runs of hs. (h, d) of a column is also tracked incrementally.
//   colsum_convert: stage 1, a block per (tile of blockDim.x columns x chunk of rows), blockDim.y threads stride the
//     chunk's rows; the block adds its blockDim.y sums in a fixed order and writes partial (chunks, C); stage 2
//     (colsum_reduce_v1), one thread per column adds the chunks in order. No atomics: the same bits every run for a
//     given (N, C) (the launcher derives the chunking from N and C only).
//   layernorm_forward_half: one warp per row (warp_sum from portable.h), rows grid-stride; mean, then the variance
//     from a second pass (the row is re-read from cache), then the write; blockDim.x a multiple of warpSize.
#include "portable.h"
#include "half.h"

#define GELU_SCALE 0.7978845608028654f   // sqrt(2/pi), as gelu.cu
#define GELU_CUBE 0.044715f

// The output format: Out<0> float32, Out<1> bfloat16 bits, Out<2> float16 bits.
template <int H> struct Out {                      // 1, 2: half bits (half.h)
    typedef unsigned short T;
    static __device__ __forceinline__ unsigned short cvt(float v) { return f32_to_half_bits<H>(v); }
};
template <> struct Out<0> {
    typedef float T;
    static __device__ __forceinline__ float cvt(float v) { return v; }
};

// ---- bias_add: inp, res, out (N*C,) flat; bias (C,) -----------------------------------------------------------------
// out may be inp or res: those three pointers are not __restrict__ (each element is read before it is written, by
// the same thread).
template <bool RES>
__device__ __forceinline__ void bias_add_body(const float* inp, const float* __restrict__ bias, const float* res,
                                              float* out, long long n, int C) {
    long long start = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long stride = (long long)gridDim.x * blockDim.x;
    if (start >= n) return;
    int col = (int)(start % C), step = (int)(stride % C);
    for (long long i = start; i < n; i += stride) {
        float v = inp[i] + bias[col];
        if (RES) v += res[i];
        out[i] = v;
        col += step;
        if (col >= C) col -= C;
    }
}

extern "C" __global__ void bias_add_v1(const float* inp, const float* __restrict__ bias, float* out,
                                       long long n, int C) {
    bias_add_body<false>(inp, bias, nullptr, out, n, C);
}

extern "C" __global__ void bias_add_res_v1(const float* inp, const float* __restrict__ bias, const float* res,
                                           float* out, long long n, int C) {
    bias_add_body<true>(inp, bias, res, out, n, C);
}

// ---- bias_gelu_forward: inp, pre, out (N*C,) flat; bias (C,); pre may be inp --------------------------------------
// gelu_tanh(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), gelu.cu's float32 operations in the same order
__device__ __forceinline__ float gelu_tanh_f32(float x) {
    float u = GELU_SCALE * (x + GELU_CUBE * x * x * x);
    return 0.5f * x * (1.0f + tanhf(u));
}
template <int H, bool PRE = true>
__device__ __forceinline__ void bias_gelu_body(const float* inp, const float* __restrict__ bias, float* pre,
                                               typename Out<H>::T* __restrict__ out, long long n, int C) {
    long long start = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long stride = (long long)gridDim.x * blockDim.x;
    if (start >= n) return;
    int col = (int)(start % C), step = (int)(stride % C);
    for (long long i = start; i < n; i += stride) {
        float x = inp[i] + bias[col];
        if (PRE) pre[i] = x;
        out[i] = Out<H>::cvt(gelu_tanh_f32(x));
        col += step;
        if (col >= C) col -= C;
    }
}

#define BIAS_GELU_ENTRY(SUFFIX, H)                                                                                  \
    extern "C" __global__ void bias_gelu_forward_v1_##SUFFIX(const float* inp, const float* __restrict__ bias,     \
                                                             float* pre, Out<H>::T* __restrict__ out,              \
                                                             long long n, int C) {                                 \
        bias_gelu_body<H>(inp, bias, pre, out, n, C);                                                               \
    }                                                                                                               \
    extern "C" __global__ void bias_gelu_forward_v1_nopre_##SUFFIX(const float* __restrict__ inp,                   \
                                                                   const float* __restrict__ bias,                 \
                                                                   Out<H>::T* __restrict__ out, long long n, int C) { \
        bias_gelu_body<H, false>(inp, bias, nullptr, out, n, C);                                                    \
    }
BIAS_GELU_ENTRY(f32, 0)
BIAS_GELU_ENTRY(bf16, 1)
BIAS_GELU_ENTRY(f16, 2)

// _hpre: GELU's input kept in format H (pre, half bits: half the bytes of a float32 fc), and the GELU reads that
// rounded value, as a recompute from pre does; HIN: inp is half bits too (gelu_half: no bias, no pre)
template <int H>
__device__ __forceinline__ void bias_gelu_hpre_body(const float* __restrict__ inp, const float* __restrict__ bias,
                                                    unsigned short* __restrict__ pre, unsigned short* __restrict__ out,
                                                    long long n, int C) {
    long long start = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long stride = (long long)gridDim.x * blockDim.x;
    if (start >= n) return;
    int col = (int)(start % C), step = (int)(stride % C);
    for (long long i = start; i < n; i += stride) {
        unsigned short p = f32_to_half_bits<H>(inp[i] + bias[col]);
        pre[i] = p;
        out[i] = f32_to_half_bits<H>(gelu_tanh_f32(half_to_f32<H>(p)));
        col += step;
        if (col >= C) col -= C;
    }
}
template <int H>
__device__ __forceinline__ void gelu_half_body(const unsigned short* __restrict__ inp, unsigned short* __restrict__ out,
                                               long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        out[i] = f32_to_half_bits<H>(gelu_tanh_f32(half_to_f32<H>(inp[i])));
}
#define GELU_HALF_ENTRY(SUFFIX, H)                                                                                  \
    extern "C" __global__ void bias_gelu_forward_v1_hpre_##SUFFIX(const float* __restrict__ inp,                    \
                                                                  const float* __restrict__ bias,                  \
                                                                  unsigned short* __restrict__ pre,                \
                                                                  unsigned short* __restrict__ out, long long n,   \
                                                                  int C) {                                         \
        bias_gelu_hpre_body<H>(inp, bias, pre, out, n, C);                                                          \
    }                                                                                                               \
    extern "C" __global__ void gelu_half_v1_##SUFFIX(const unsigned short* __restrict__ inp,                        \
                                                     unsigned short* __restrict__ out, long long n) {              \
        gelu_half_body<H>(inp, out, n);                                                                             \
    }
GELU_HALF_ENTRY(bf16, 1)
GELU_HALF_ENTRY(f16, 2)

// ---- split_heads: inp (N, ld) rows -> out (B*nh, T, hs); bias (C,) or unused ------------------------------------
// Thread (x, y): row b*T+t = blockIdx.x * blockDim.y + y (grid-stride), columns c = x, x + blockDim.x, ... of C.
template <int H, bool BIAS>
__device__ __forceinline__ void split_heads_body(const float* __restrict__ inp, const float* __restrict__ bias,
                                                 typename Out<H>::T* __restrict__ out, int N, int T, int nh, int hs,
                                                 int ld, int col0) {
    int C = nh * hs;
    int hstep = blockDim.x / hs, dstep = blockDim.x % hs;   // the column step blockDim.x as (heads, d)
    long long head = (long long)T * hs;                     // out elements between head h and h + 1
    for (int row = blockIdx.x * blockDim.y + threadIdx.y; row < N; row += gridDim.x * blockDim.y) {
        int b = row / T, t = row - b * T;
        const float* x = inp + (long long)row * ld + col0;
        typename Out<H>::T* y = out + ((long long)b * nh * T + t) * hs;   // out[b*nh + 0, t, 0]
        int h = threadIdx.x / hs, d = threadIdx.x % hs;
        for (int c = threadIdx.x; c < C; c += blockDim.x) {
            float v = x[c];
            if (BIAS) v += bias[c];
            y[h * head + d] = Out<H>::cvt(v);
            h += hstep;
            d += dstep;
            if (d >= hs) { d -= hs; h++; }
        }
    }
}

#define SPLIT_ENTRY(SUFFIX, H)                                                                                      \
    extern "C" __global__ void split_heads_v1_##SUFFIX(const float* __restrict__ inp, Out<H>::T* __restrict__ out, \
                                                       int N, int T, int nh, int hs, int ld, int col0) {           \
        split_heads_body<H, false>(inp, nullptr, out, N, T, nh, hs, ld, col0);                                      \
    }                                                                                                               \
    extern "C" __global__ void split_heads_bias_v1_##SUFFIX(const float* __restrict__ inp,                          \
                                                            const float* __restrict__ bias,                        \
                                                            Out<H>::T* __restrict__ out, int N, int T, int nh,     \
                                                            int hs, int ld, int col0) {                             \
        split_heads_body<H, true>(inp, bias, out, N, T, nh, hs, ld, col0);                                          \
    }
SPLIT_ENTRY(f32, 0)
SPLIT_ENTRY(bf16, 1)
SPLIT_ENTRY(f16, 2)

// x4: nh == 1, one head of hs columns per row (the engine's bias + rounding pass over qkv before flash attention):
// out row b*T+t is hs contiguous values, four per thread (16-byte loads, 16- or 8-byte stores); the same float32
// operations per element as split_heads_body. hs, ld, col0 multiples of 4, rows 16-byte aligned (the launcher).
template <int H, bool BIAS>
__device__ __forceinline__ void split_rows_x4_body(const float* __restrict__ inp, const float* __restrict__ bias,
                                                   typename Out<H>::T* __restrict__ out, int N, int hs, int ld,
                                                   int col0) {
    for (int row = blockIdx.x * blockDim.y + threadIdx.y; row < N; row += gridDim.x * blockDim.y) {
        const float* x = inp + (long long)row * ld + col0;
        typename Out<H>::T* y = out + (long long)row * hs;
        for (int c = 4 * threadIdx.x; c < hs; c += 4 * blockDim.x) {
            float4 v = *reinterpret_cast<const float4*>(x + c);
            if (BIAS) {
                v.x += bias[c];
                v.y += bias[c + 1];
                v.z += bias[c + 2];
                v.w += bias[c + 3];
            }
            if (H == 0)
                *reinterpret_cast<float4*>(y + c) = v;
            else
                *reinterpret_cast<uint2*>(y + c) = make_uint2(pack_half2<H>(v.x, v.y), pack_half2<H>(v.z, v.w));
        }
    }
}

#define SPLIT_X4_ENTRY(SUFFIX, H)                                                                                   \
    extern "C" __global__ void split_heads_v1_x4_##SUFFIX(const float* __restrict__ inp,                           \
                                                          Out<H>::T* __restrict__ out, int N, int hs, int ld,      \
                                                          int col0) {                                              \
        split_rows_x4_body<H, false>(inp, nullptr, out, N, hs, ld, col0);                                           \
    }                                                                                                               \
    extern "C" __global__ void split_heads_bias_v1_x4_##SUFFIX(const float* __restrict__ inp,                      \
                                                               const float* __restrict__ bias,                     \
                                                               Out<H>::T* __restrict__ out, int N, int hs, int ld, \
                                                               int col0) {                                         \
        split_rows_x4_body<H, true>(inp, bias, out, N, hs, ld, col0);                                               \
    }
SPLIT_X4_ENTRY(f32, 0)
SPLIT_X4_ENTRY(bf16, 1)
SPLIT_X4_ENTRY(f16, 2)

// ---- merge_heads: inp (B*nh, T, hs) -> out (N, ld) columns [col0, col0 + C) ----------------------------------------
template <int H>
__device__ __forceinline__ void merge_heads_body(const float* __restrict__ inp, typename Out<H>::T* __restrict__ out,
                                                 int N, int T, int nh, int hs, int ld, int col0) {
    int C = nh * hs;
    int hstep = blockDim.x / hs, dstep = blockDim.x % hs;
    long long head = (long long)T * hs;
    for (int row = blockIdx.x * blockDim.y + threadIdx.y; row < N; row += gridDim.x * blockDim.y) {
        int b = row / T, t = row - b * T;
        const float* x = inp + ((long long)b * nh * T + t) * hs;           // inp[b*nh + 0, t, 0]
        typename Out<H>::T* y = out + (long long)row * ld + col0;
        int h = threadIdx.x / hs, d = threadIdx.x % hs;
        for (int c = threadIdx.x; c < C; c += blockDim.x) {
            y[c] = Out<H>::cvt(x[h * head + d]);
            h += hstep;
            d += dstep;
            if (d >= hs) { d -= hs; h++; }
        }
    }
}

#define MERGE_ENTRY(SUFFIX, H)                                                                                      \
    extern "C" __global__ void merge_heads_v1_##SUFFIX(const float* __restrict__ inp, Out<H>::T* __restrict__ out, \
                                                       int N, int T, int nh, int hs, int ld, int col0) {           \
        merge_heads_body<H>(inp, out, N, T, nh, hs, ld, col0);                                                      \
    }
MERGE_ENTRY(f32, 0)
MERGE_ENTRY(bf16, 1)
MERGE_ENTRY(f16, 2)

// ---- colsum_convert: inp (N, C) -> partial (chunks, C) -> colsum (C,); out (N, C) half bits or unused ------------
// Stage 1, block (blockIdx.x, blockIdx.y) = (column tile, chunk of chunk_rows rows); blockDim.x * blockDim.y <= 1024.
// Thread (x, y) sums rows y, y + blockDim.y, ... of the chunk in column tile * blockDim.x + x (a warp reads a run of
// consecutive columns of one row); the block then adds its blockDim.y sums in y order. H = 0: no conversion.
// d gelu_tanh(x) / dx, the float32 operations of gelu.cu's gelu_backward_v1 in the same order (the same bits)
__device__ __forceinline__ float gelu_local_grad(float x) {
    float t = tanhf(GELU_SCALE * (x + GELU_CUBE * x * x * x));
    float dudx = GELU_SCALE * (1.0f + 3.0f * GELU_CUBE * x * x);
    return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * dudx;
}

// GELU's input at element i (column col): pre + gbias[col] for a float32 pre; the value of the half bits of format
// H for an unsigned short pre (bias_gelu_forward's _hpre: the bias is in, gbias is not read). gelu_in4: four of them
// at a column that is a multiple of 4 (16-byte loads of a float32 pre, 8-byte of a half one).
template <int H> __device__ __forceinline__ float gelu_in(const float* __restrict__ pre,
                                                          const float* __restrict__ gbias, long long i, int col) {
    return pre[i] + gbias[col];
}
template <int H> __device__ __forceinline__ float gelu_in(const unsigned short* __restrict__ pre,
                                                          const float* __restrict__ gbias, long long i, int col) {
    return half_to_f32<H>(pre[i]);
}
template <int H> __device__ __forceinline__ float4 gelu_in4(const float* __restrict__ pre,
                                                            const float* __restrict__ gbias, long long i, int col) {
    float4 p = *reinterpret_cast<const float4*>(pre + i);
    return make_float4(p.x + gbias[col], p.y + gbias[col + 1], p.z + gbias[col + 2], p.w + gbias[col + 3]);
}
template <int H> __device__ __forceinline__ float4 gelu_in4(const unsigned short* __restrict__ pre,
                                                            const float* __restrict__ gbias, long long i, int col) {
    uint2 w = *reinterpret_cast<const uint2*>(pre + i);
    return make_float4(half_to_f32<H>((unsigned short)(w.x & 0xFFFFu)), half_to_f32<H>((unsigned short)(w.x >> 16)),
                       half_to_f32<H>((unsigned short)(w.y & 0xFFFFu)), half_to_f32<H>((unsigned short)(w.y >> 16)));
}

// inp's element as float32: float32 itself, or half bits of format H (GELU's output gradient written in half by its
// product: colsum_convert's gelu_hpre_hin entry points); colsum_in4: four of them (16-byte loads of float32, 8-byte
// of half bits)
template <int H> __device__ __forceinline__ float colsum_in(const float* __restrict__ inp, long long i) { return inp[i]; }
template <int H> __device__ __forceinline__ float colsum_in(const unsigned short* __restrict__ inp, long long i) {
    return half_to_f32<H>(inp[i]);
}
template <int H> __device__ __forceinline__ float4 colsum_in4(const float* __restrict__ inp, long long i) {
    return *reinterpret_cast<const float4*>(inp + i);
}
template <int H> __device__ __forceinline__ float4 colsum_in4(const unsigned short* __restrict__ inp, long long i) {
    uint2 w = *reinterpret_cast<const uint2*>(inp + i);
    return make_float4(half_to_f32<H>((unsigned short)(w.x & 0xFFFFu)), half_to_f32<H>((unsigned short)(w.x >> 16)),
                       half_to_f32<H>((unsigned short)(w.y & 0xFFFFu)), half_to_f32<H>((unsigned short)(w.y >> 16)));
}

template <int H, bool GELU = false, typename P = float, typename I = float>
__device__ __forceinline__ void colsum_partials_body(const I* __restrict__ inp, float* __restrict__ partial,
                                                     unsigned short* __restrict__ out, int N, int C, int chunk_rows,
                                                     const P* __restrict__ pre = nullptr,
                                                     const float* __restrict__ gbias = nullptr) {
    __shared__ float buf[1024];
    int col = blockIdx.x * blockDim.x + threadIdx.x;
    int r0 = blockIdx.y * chunk_rows;
    int r1 = r0 + chunk_rows < N ? r0 + chunk_rows : N;
    float s = 0.0f;
    if (col < C) {
        for (int r = r0 + threadIdx.y; r < r1; r += blockDim.y) {
            long long i = (long long)r * C + col;
            float v = colsum_in<H>(inp, i);
            if (GELU) v = v * gelu_local_grad(gelu_in<H>(pre, gbias, i, col));
            s += v;
            if (H != 0) out[i] = f32_to_half_bits<H>(v);
        }
    }
    buf[threadIdx.y * blockDim.x + threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && col < C) {
        float total = 0.0f;
        for (int y = 0; y < blockDim.y; y++) total += buf[y * blockDim.x + threadIdx.x];   // fixed order
        partial[(long long)blockIdx.y * C + col] = total;
    }
}

extern "C" __global__ void colsum_partials_v1(const float* __restrict__ inp, float* __restrict__ partial,
                                              int N, int C, int chunk_rows) {
    colsum_partials_body<0>(inp, partial, nullptr, N, C, chunk_rows);
}
extern "C" __global__ void colsum_partials_v1_bf16(const float* __restrict__ inp, float* __restrict__ partial,
                                                   unsigned short* __restrict__ out, int N, int C, int chunk_rows) {
    colsum_partials_body<1>(inp, partial, out, N, C, chunk_rows);
}
extern "C" __global__ void colsum_partials_v1_f16(const float* __restrict__ inp, float* __restrict__ partial,
                                                  unsigned short* __restrict__ out, int N, int C, int chunk_rows) {
    colsum_partials_body<2>(inp, partial, out, N, C, chunk_rows);
}
// inp = d(GELU output), GELU's input = pre + gbias[col] (bias_gelu_forward's x): the sums and the half copy of
// dfc = inp * gelu'(pre + gbias[col])
extern "C" __global__ void colsum_partials_v1_gelu_bf16(const float* __restrict__ inp, const float* __restrict__ pre,
                                                        const float* __restrict__ gbias, float* __restrict__ partial,
                                                        unsigned short* __restrict__ out, int N, int C,
                                                        int chunk_rows) {
    colsum_partials_body<1, true>(inp, partial, out, N, C, chunk_rows, pre, gbias);
}
extern "C" __global__ void colsum_partials_v1_gelu_f16(const float* __restrict__ inp, const float* __restrict__ pre,
                                                       const float* __restrict__ gbias, float* __restrict__ partial,
                                                       unsigned short* __restrict__ out, int N, int C,
                                                       int chunk_rows) {
    colsum_partials_body<2, true>(inp, partial, out, N, C, chunk_rows, pre, gbias);
}

// x4: four consecutive columns per thread where C % 4 == 0 (16-byte loads of inp and pre, 8-byte half stores): a
// block of blockDim.x threads covers 4 blockDim.x columns. Each column gets the same rows per thread and the same
// order of additions as colsum_partials_body: the same bits, a quarter of the memory instructions.
template <int H, bool GELU, typename P = float, typename I = float>
__device__ __forceinline__ void colsum_partials_x4_body(const I* __restrict__ inp, float* __restrict__ partial,
                                                        unsigned short* __restrict__ out, int N, int C, int chunk_rows,
                                                        const P* __restrict__ pre,
                                                        const float* __restrict__ gbias) {
    __shared__ float4 buf4[256];  // blockDim.x * blockDim.y <= 256 (the launcher's 32 x 8)
    int col = (blockIdx.x * blockDim.x + threadIdx.x) * 4;
    int r0 = blockIdx.y * chunk_rows;
    int r1 = r0 + chunk_rows < N ? r0 + chunk_rows : N;
    float4 s = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (col < C) {
        for (int r = r0 + threadIdx.y; r < r1; r += blockDim.y) {
            long long i = (long long)r * C + col;
            float4 v = colsum_in4<H>(inp, i);
            if (GELU) {
                float4 p = gelu_in4<H>(pre, gbias, i, col);
                v.x = v.x * gelu_local_grad(p.x);
                v.y = v.y * gelu_local_grad(p.y);
                v.z = v.z * gelu_local_grad(p.z);
                v.w = v.w * gelu_local_grad(p.w);
            }
            s.x += v.x;
            s.y += v.y;
            s.z += v.z;
            s.w += v.w;
            if (H != 0)
                *reinterpret_cast<uint2*>(out + i) = make_uint2(pack_half2<H>(v.x, v.y), pack_half2<H>(v.z, v.w));
        }
    }
    buf4[threadIdx.y * blockDim.x + threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && col < C) {
        float4 t = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        for (int y = 0; y < blockDim.y; y++) {  // fixed order
            float4 b = buf4[y * blockDim.x + threadIdx.x];
            t.x += b.x;
            t.y += b.y;
            t.z += b.z;
            t.w += b.w;
        }
        *reinterpret_cast<float4*>(partial + (long long)blockIdx.y * C + col) = t;
    }
}

#define COLSUM_X4_ENTRY(SUFFIX, H)                                                                                 \
    extern "C" __global__ void colsum_partials_v1_x4##SUFFIX(const float* __restrict__ inp,                        \
                                                             float* __restrict__ partial,                          \
                                                             unsigned short* __restrict__ out, int N, int C,       \
                                                             int chunk_rows) {                                     \
        colsum_partials_x4_body<H, false>(inp, partial, out, N, C, chunk_rows, (const float*)nullptr, nullptr);  \
    }
COLSUM_X4_ENTRY(, 0)
COLSUM_X4_ENTRY(_bf16, 1)
COLSUM_X4_ENTRY(_f16, 2)
extern "C" __global__ void colsum_partials_v1_x4_gelu_bf16(const float* __restrict__ inp,
                                                           const float* __restrict__ pre,
                                                           const float* __restrict__ gbias, float* __restrict__ partial,
                                                           unsigned short* __restrict__ out, int N, int C,
                                                           int chunk_rows) {
    colsum_partials_x4_body<1, true>(inp, partial, out, N, C, chunk_rows, pre, gbias);
}
extern "C" __global__ void colsum_partials_v1_x4_gelu_f16(const float* __restrict__ inp,
                                                          const float* __restrict__ pre,
                                                          const float* __restrict__ gbias, float* __restrict__ partial,
                                                          unsigned short* __restrict__ out, int N, int C,
                                                          int chunk_rows) {
    colsum_partials_x4_body<2, true>(inp, partial, out, N, C, chunk_rows, pre, gbias);
}

// pre = GELU's input as half bits of the output's format, its bias in (bias_gelu_forward's _hpre): no gbias; one
// entry per format, each body (one column per thread, or x4)
#define COLSUM_GELU_HPRE_ENTRY(NAME, BODY, H)                                                                       \
    extern "C" __global__ void NAME(const float* __restrict__ inp, const unsigned short* __restrict__ pre,          \
                                    float* __restrict__ partial, unsigned short* __restrict__ out, int N, int C,   \
                                    int chunk_rows) {                                                              \
        BODY<H, true>(inp, partial, out, N, C, chunk_rows, pre, (const float*)nullptr);                             \
    }
COLSUM_GELU_HPRE_ENTRY(colsum_partials_v1_gelu_hpre_bf16, colsum_partials_body, 1)
COLSUM_GELU_HPRE_ENTRY(colsum_partials_v1_gelu_hpre_f16, colsum_partials_body, 2)
COLSUM_GELU_HPRE_ENTRY(colsum_partials_v1_x4_gelu_hpre_bf16, colsum_partials_x4_body, 1)
COLSUM_GELU_HPRE_ENTRY(colsum_partials_v1_x4_gelu_hpre_f16, colsum_partials_x4_body, 2)

// the same with inp itself as half bits of the format (GELU's output gradient rounded by its product, as PyTorch's
// autocast keeps it): _hin; x4 loads 8 bytes of inp
#define COLSUM_GELU_HPRE_HIN_ENTRY(NAME, BODY, H)                                                                   \
    extern "C" __global__ void NAME(const unsigned short* __restrict__ inp, const unsigned short* __restrict__ pre, \
                                    float* __restrict__ partial, unsigned short* __restrict__ out, int N, int C,   \
                                    int chunk_rows) {                                                              \
        BODY<H, true, unsigned short, unsigned short>(inp, partial, out, N, C, chunk_rows, pre, nullptr);          \
    }
COLSUM_GELU_HPRE_HIN_ENTRY(colsum_partials_v1_gelu_hpre_hin_bf16, colsum_partials_body, 1)
COLSUM_GELU_HPRE_HIN_ENTRY(colsum_partials_v1_gelu_hpre_hin_f16, colsum_partials_body, 2)
COLSUM_GELU_HPRE_HIN_ENTRY(colsum_partials_v1_x4_gelu_hpre_hin_bf16, colsum_partials_x4_body, 1)
COLSUM_GELU_HPRE_HIN_ENTRY(colsum_partials_v1_x4_gelu_hpre_hin_f16, colsum_partials_x4_body, 2)

// Stage 2: colsum[col] = partial[0, col] + partial[1, col] + ... in chunk order; one thread per column, grid-stride.
extern "C" __global__ void colsum_reduce_v1(const float* __restrict__ partial, float* __restrict__ colsum,
                                            int chunks, int C) {
    for (int col = blockIdx.x * blockDim.x + threadIdx.x; col < C; col += gridDim.x * blockDim.x) {
        float s = 0.0f;
        for (int k = 0; k < chunks; k++) s += partial[(long long)k * C + col];
        colsum[col] = s;
    }
}

// ---- layernorm_forward_half: inp (N, C) f32 -> out (N, C) half bits; weight, bias (C,); mean, rstd (N,) ---------
// One warp per row: lane l reads columns l, l + warpSize, ...; warp_sum gives every lane the row's sums.
template <int H>
__device__ __forceinline__ void layernorm_half_body(const float* __restrict__ inp, const float* __restrict__ weight,
                                                    const float* __restrict__ bias, unsigned short* __restrict__ out,
                                                    float* __restrict__ mean, float* __restrict__ rstd,
                                                    int N, int C, float eps) {
    int lane = threadIdx.x % warpSize, warp = threadIdx.x / warpSize;
    int warps = blockDim.x / warpSize;
    for (int row = blockIdx.x * warps + warp; row < N; row += gridDim.x * warps) {   // the same row for the warp
        const float* x = inp + (long long)row * C;
        float s = 0.0f;
        for (int i = lane; i < C; i += warpSize) s += x[i];
        float m = warp_sum(s) / C;
        float v = 0.0f;
        for (int i = lane; i < C; i += warpSize) { float d = x[i] - m; v += d * d; }   // second pass (cache)
        float r = 1.0f / sqrtf(warp_sum(v) / C + eps);
        unsigned short* y = out + (long long)row * C;
        for (int i = lane; i < C; i += warpSize) y[i] = Out<H>::cvt((x[i] - m) * r * weight[i] + bias[i]);
        if (lane == 0) { mean[row] = m; rstd[row] = r; }
    }
}

extern "C" __global__ void layernorm_forward_half_v1_bf16(const float* __restrict__ inp,
                                                          const float* __restrict__ weight,
                                                          const float* __restrict__ bias,
                                                          unsigned short* __restrict__ out, float* __restrict__ mean,
                                                          float* __restrict__ rstd, int N, int C, float eps) {
    layernorm_half_body<1>(inp, weight, bias, out, mean, rstd, N, C, eps);
}
extern "C" __global__ void layernorm_forward_half_v1_f16(const float* __restrict__ inp,
                                                         const float* __restrict__ weight,
                                                         const float* __restrict__ bias,
                                                         unsigned short* __restrict__ out, float* __restrict__ mean,
                                                         float* __restrict__ rstd, int N, int C, float eps) {
    layernorm_half_body<2>(inp, weight, bias, out, mean, rstd, N, C, eps);
}
