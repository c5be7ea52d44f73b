// encoder.cu: backward of the embedding layer out[b, t] = wte[idx[b, t]] + wpe[t], portable HIP/CUDA.
// Same versions as kernels/numba/encoder.py (read its docstring):
//   dwte (V, C): dwte[v] = sum of dout[b, t] over (b, t) with idx[b, t] == v;  dwpe (maxT, C): dwpe[t] = sum_b dout[b, t]
//   v1: zero both (encoder_backward_v1_zero), then one thread per (b, t, c) with atomicAdd (not deterministic:
//       the order the atomic float adds land in depends on scheduling, so the last bits can change run to run).
//   v2: deterministic, no atomics: the host sorts positions by token (order, starts); one thread per (v, c) sums
//       its token's bucket in a fixed order (encoder_backward_v2), one thread per (t, c) sums over b (..._v2_dwpe).
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
