// gelu.cu: GELU (tanh form, as in GPT-2) forward and backward, and the residual backward, for lesson 05; portable
// (NVRTC on NVIDIA, hiprtc/hipcc on AMD). Elementwise on 1-D arrays of n elements: element i of every output
// depends on element i of the inputs only. Same versions as kernels/numba/gelu.py:
//   v1: one thread per element in a grid-stride loop (thread i owns i, i + stride, i + 2*stride, ...).
//   gelu forward:   u = sqrt(2/pi) (x + 0.044715 x^3),  out = 0.5 x (1 + tanh(u))
//   gelu backward:  dinp = dout * (0.5 (1 + tanh(u)) + 0.5 x (1 - tanh(u)^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2))
//   residual backward (out = a + b): da = dout, db = dout
#include "portable.h"

#define GELU_SCALE 0.7978845608028654f   // sqrt(2/pi)
#define GELU_CUBE 0.044715f

// v1: gelu forward; inp, out (n,)
extern "C" __global__ void gelu_forward_v1(const float* __restrict__ inp, float* __restrict__ out, long long n) {
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float x = inp[i];
        float u = GELU_SCALE * (x + GELU_CUBE * x * x * x);
        out[i] = 0.5f * x * (1.0f + tanhf(u));
    }
}

// v1: gelu backward; dout, inp, dinp (n,). tanh(u) is recomputed from the saved input.
extern "C" __global__ void gelu_backward_v1(const float* __restrict__ dout, const float* __restrict__ inp,
                                            float* __restrict__ dinp, long long n) {
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float x = inp[i];
        float t = tanhf(GELU_SCALE * (x + GELU_CUBE * x * x * x));
        float dudx = GELU_SCALE * (1.0f + 3.0f * GELU_CUBE * x * x);
        float local = 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * dudx;   // d out / d inp (product rule)
        dinp[i] = dout[i] * local;                                           // chain rule
    }
}

// v1: residual backward; out = a + b sends dout unchanged to both branches. dout, da, db (n,)
extern "C" __global__ void residual_backward_v1(const float* __restrict__ dout, float* __restrict__ da,
                                                float* __restrict__ db, long long n) {
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        da[i] = dout[i];
        db[i] = dout[i];
    }
}
