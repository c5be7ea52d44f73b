// encoder.cu: backward of the embedding layer out[b, t] = wte[idx[b, t]] + wpe[t], portable HIP/CUDA.
// Same versions as kernels/numba/encoder.py (read its docstring):
//   dwte (V, C): dwte[v] = sum of dout[b, t] over (b, t) with idx[b, t] == v;  dwpe (maxT, C): dwpe[t] = sum_b dout[b, t]
//   v1: zero both (encoder_backward_v1_zero), then one thread per (b, t, c) with atomicAdd (not deterministic:
//       the order the atomic float adds land in depends on scheduling, so the last bits can change run to run).
//   v2: deterministic, no atomics: the host sorts positions by token (order, starts); one thread per (v, c) sums
//       its token's bucket in a fixed order (encoder_backward_v2), one thread per (t, c) sums over b (..._v2_dwpe).
//   v3: deterministic AND all on the GPU (no host copy, no sync: a CUDA graph can capture it): fixed-point integer
//       atomics. v3_amax + v3_scale: m = max |dout|, scale = 2^e with (B*T) * m * 2^e < 2^62; v3_add: one thread per
//       (b, t, c) atomically adds the int64 q = rint(dout * 2^e) into acc[idx[b, t], c] (integer addition is
//       associative: the total does not depend on the order the atomics land in); v3_finish: dwte = acc * 2^-e;
//       dwpe as v2 (encoder_backward_v2_dwpe). Like v1, v3 does not check that idx is in [0, V).
#include "portable.h"

// v1_zero: thread i owns a[i] of a flat array of n floats
extern "C" __global__ void encoder_backward_v1_zero(float* __restrict__ a, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) a[i] = 0.0f;
}

// v1: thread i owns dout[b, t, c], i = (b * T + t) * C + c; dout (B, T, C), idx (B, T), dwte (V, C), dwpe (maxT, C)
extern "C" __global__ void encoder_backward_v1(const float* __restrict__ dout, const int* __restrict__ idx,
                                               float* __restrict__ dwte, float* __restrict__ dwpe,
                                               int B, int T, int C) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)B * T * C) return;
    int c = (int)(i % C);
    long long bt = i / C;                          // = b * T + t
    int t = (int)(bt % T);
    float g = dout[i];
    atomicAdd(&dwte[(long long)idx[bt] * C + c], g);   // other positions with the same token add here too
    atomicAdd(&dwpe[(long long)t * C + c], g);         // the B threads of position t add here
}

// v2: thread i owns dwte[v, c], i = v * C + c. order (B*T,): positions b * T + t sorted by token;
// token v's bucket is order[starts[v] .. starts[v + 1]). Summed in that fixed order; an empty bucket writes 0.
extern "C" __global__ void encoder_backward_v2(const float* __restrict__ dout, const int* __restrict__ order,
                                               const int* __restrict__ starts, float* __restrict__ dwte,
                                               int V, int C) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)V * C) return;
    int v = (int)(i / C), c = (int)(i % C);       // neighbouring threads: neighbouring c (coalesced)
    float acc = 0.0f;
    for (int k = starts[v]; k < starts[v + 1]; k++) acc += dout[(long long)order[k] * C + c];
    dwte[i] = acc;
}

// v2_dwpe: thread i owns dwpe[t, c], i = t * C + c: the sum over b = 0, 1, ... of dout[b, t, c] (0 for t >= T)
extern "C" __global__ void encoder_backward_v2_dwpe(const float* __restrict__ dout, float* __restrict__ dwpe,
                                                    int B, int T, int maxT, int C) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)maxT * C) return;
    int t = (int)(i / C), c = (int)(i % C);
    float acc = 0.0f;
    if (t < T)
        for (int b = 0; b < B; b++) acc += dout[((long long)b * T + t) * C + c];
    dwpe[i] = acc;
}

// ---- v3: fixed-point integer atomics --------------------------------------------------------------------------------
// Every dout[b, t, c] becomes the integer q = rint(dout * 2^e) (exact: 2^e only shifts the exponent, and the rint is
// the one rounding), the integers are summed with 64-bit atomics (associative: same total in any order), and
// dwte = total * 2^-e. The error of an element of dwte is at most (its token's count) * 2^-e / 2 plus the final
// float32 rounding: tiny next to max|dout| (about max|dout| * (B*T)^2 * 2^-63), but an element far smaller than
// max|dout| loses relative accuracy (v1 and v2 do not). A non-finite dout (inf, NaN) makes all of dwte NaN.

// v3_block_max: the max of v over the threads of the block, for any blockDim.x (not only powers of two or whole
// warps): a tree over shared memory, pairs (tid, tid + s) for s = half of the next power of two, then halving
__device__ float v3_block_max(float v, float* buf) {
    int tid = threadIdx.x, n = blockDim.x;
    buf[tid] = v;
    __syncthreads();
    int p = 1;
    while (p < n) p *= 2;                              // the smallest power of two >= n
    for (int s = p / 2; s > 0; s /= 2) {
        if (tid < s && tid + s < n) buf[tid] = fmaxf(buf[tid], buf[tid + s]);
        __syncthreads();
    }
    return buf[0];
}

// v3_amax: block j writes partial[j] = max |dout[i]| over its grid-stride share of the n = B*T*C elements
// (0 for none; a NaN counts as +inf so that it is not lost: fmaxf drops NaN)
extern "C" __global__ void encoder_backward_v3_amax(const float* __restrict__ dout, float* __restrict__ partial,
                                                    long long n) {
    __shared__ float buf[1024];
    const float inf = __int_as_float(0x7f800000);
    float m = 0.0f;
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float a = fabsf(dout[i]);
        m = fmaxf(m, a != a ? inf : a);
    }
    m = v3_block_max(m, buf);
    if (threadIdx.x == 0) partial[blockIdx.x] = m;
}

// v3_scale (one block): m = max of partial[0 .. n_partial), then scale[0] = 2^e and scale[1] = 2^-e with
// N * m * 2^e < 2^62 for N = B*T positions (the worst case: every position has the same token, so one element of
// acc sums N values of magnitude <= m). frexpf: m = f * 2^k with f in [0.5, 1), so m < 2^k; 2^j >= N; e = 62 - j - k.
// m == 0: e = 0. e is clamped to [-126, 126] so that both powers are normal floats (e > 126 only when N * m < 2^-64,
// then the result is just less fine-grained; e < -126 needs N > 2^60 as m < 2^128). A non-finite m: scale[0] = 0,
// scale[1] = NaN (v3_finish then writes NaN).
extern "C" __global__ void encoder_backward_v3_scale(const float* __restrict__ partial, int n_partial, long long N,
                                                     float* __restrict__ scale) {
    __shared__ float buf[1024];
    float m = 0.0f;
    for (int i = threadIdx.x; i < n_partial; i += blockDim.x) m = fmaxf(m, partial[i]);
    m = v3_block_max(m, buf);
    if (threadIdx.x != 0) return;
    if (!(m <= 3.402823466e38f)) {                     // inf (or NaN) somewhere in dout
        scale[0] = 0.0f;
        scale[1] = __int_as_float(0x7fc00000);         // NaN
        return;
    }
    int e = 0;
    if (m > 0.0f) {
        int k;
        frexpf(m, &k);                                 // 2^(k-1) <= m < 2^k
        int j = 0;
        while (j < 62 && (1LL << j) < N) j++;          // 2^j >= N
        e = 62 - j - k;
        e = e > 126 ? 126 : (e < -126 ? -126 : e);
    }
    scale[0] = __int_as_float((127 + e) << 23);        // 2^e, exactly: the bits of a normal float
    scale[1] = __int_as_float((127 - e) << 23);        // 2^-e
}

// v3_zero: acc (a flat array of n 64-bit integers) = 0, grid-stride
extern "C" __global__ void encoder_backward_v3_zero(unsigned long long* __restrict__ acc, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        acc[i] = 0ull;
}

// v3_add: thread i owns dout[b, t, c], i = (b * T + t) * C + c (grid-stride over the n = B*T*C elements), and adds
// q = rint(dout * 2^e) into acc[idx[b, t], c] (acc (V, C) 64-bit, zeroed). The atomic adds the two's-complement
// bits as unsigned: the same bits as a signed add, so negative q work. |dout * 2^e| < 2^62 / N; a non-finite dout
// counts as 0 here (no undefined float -> integer conversion; v3_finish writes NaN then).
extern "C" __global__ void encoder_backward_v3_add(const float* __restrict__ dout, const int* __restrict__ idx,
                                                   const float* __restrict__ scale,
                                                   unsigned long long* __restrict__ acc, long long n, int C) {
    float s = scale[0];
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float g = dout[i];
        if (!(fabsf(g) <= 3.402823466e38f)) g = 0.0f;  // inf or NaN
        long long q = (long long)rintf(g * s);         // g * 2^e exact; rint (half to even): the one rounding of v3
        long long bt = i / C;                          // = b * T + t
        atomicAdd(&acc[(long long)idx[bt] * C + i % C], (unsigned long long)q);
    }
}

// v3_finish: thread i owns dwte[i] of the flat (V, C) array: acc as a signed integer, times 2^-e (double: exact for
// the power of two; the int64 -> double and double -> float conversions round to nearest). Tokens that never
// appear: acc = 0 -> dwte = 0.
extern "C" __global__ void encoder_backward_v3_finish(const unsigned long long* __restrict__ acc,
                                                      const float* __restrict__ scale, float* __restrict__ dwte,
                                                      long long n) {
    double inv = (double)scale[1];
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        dwte[i] = (float)((double)(long long)acc[i] * inv);
}

// v3_finish_add: v3_finish adding into dwte (the launcher's accumulate=True: the tied head's share is already there):
// dwte[i] += its float32 value, the same rounding as writing it and adding it in a pass of its own
extern "C" __global__ void encoder_backward_v3_finish_add(const unsigned long long* __restrict__ acc,
                                                          const float* __restrict__ scale, float* __restrict__ dwte,
                                                          long long n) {
    double inv = (double)scale[1];
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        dwte[i] = dwte[i] + (float)((double)(long long)acc[i] * inv);
}
