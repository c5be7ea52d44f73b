// convert.cu: mixed precision on the GPU, portable (NVRTC on NVIDIA, hiprtc/hipcc on AMD). Same kernels and rounding
// as kernels/numba/convert.py (read its docstring, and gpullm_lessons/precision.py for the bfloat16 rounding):
//   f32 -> bf16: bits + 0x7FFF + (lowest kept bit), keep the top 16 bits (round to nearest even); NaN -> 0x7FC0|sign
//   bf16 -> f32: the 16 bits shifted to the top (exact)
//   f32 -> f16:  __float2half_rn (round to nearest even); NaN by hand as NumPy: sign, 0x7C00, top 10 mantissa bits
//   nonfinite:   count the floats whose 8 exponent bits are all ones (inf or NaN)
// Every kernel is elementwise over n elements: thread i owns i, i + stride, ... (grid-stride loop, capped grid).
//   v1 (all four ops): one thread per element; the count keeps a per-thread register and does one atomicAdd per
//   thread that found any (none on finite data). out must be zeroed before the count (the launcher does it).
#include "portable.h"
#include "half.h"
// f32_to_bf16_bits and f32_to_f16_bits (the rounding) live in half.h, shared with attention.cu.

// src float32 (n,) -> dst bfloat16 bits (n,)
extern "C" __global__ void f32_to_bf16_v1(const float* __restrict__ src, unsigned short* __restrict__ dst,
                                          long long n) {
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        dst[i] = f32_to_bf16_bits(src[i]);
}

// src bfloat16 bits (n,) -> dst float32 (n,)
extern "C" __global__ void bf16_to_f32_v1(const unsigned short* __restrict__ src, float* __restrict__ dst,
                                          long long n) {
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        dst[i] = __uint_as_float(((unsigned int)src[i]) << 16);
}

// src float32 (n,) -> dst float16 bits (n,)
extern "C" __global__ void f32_to_f16_v1(const float* __restrict__ src, unsigned short* __restrict__ dst,
                                         long long n) {
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        dst[i] = f32_to_f16_bits(src[i]);
}

// out[0] += how many of flat (n,) are inf or NaN (out zeroed before the launch). Each thread counts its elements in
// a register; one atomicAdd per thread that found any.
extern "C" __global__ void nonfinite_count_v1(const float* __restrict__ flat, int* __restrict__ out, long long n) {
    long long stride = (long long)gridDim.x * blockDim.x;
    int count = 0;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        if ((__float_as_uint(flat[i]) & 0x7F800000u) == 0x7F800000u) count++;   // exponent all ones
    if (count > 0) atomicAdd(out, count);
}
