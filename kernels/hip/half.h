// half.h: float32 <-> 16-bit float bits, shared by convert.cu, attention.cu and fused.cu (hip.py inlines each local
// include once; hipcc/nvcc find it with -I kernels/hip). The same rounding as kernels/numba/convert.py and
// gpullm_lessons/precision.py:
//   f32 -> bf16: bits + 0x7FFF + (lowest kept bit), keep the top 16 bits (round to nearest even); NaN -> 0x7FC0|sign
//   f32 -> f16:  __float2half_rn (round to nearest even); NaN by hand as NumPy: sign, 0x7C00, top 10 mantissa bits
#pragma once
#include "portable.h"

// float32 -> bfloat16 bits, round to nearest even; NaN -> the quiet NaN with the sign kept (as ml_dtypes).
__device__ __forceinline__ unsigned short f32_to_bf16_bits(float x) {
    unsigned int bits = __float_as_uint(x);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return (unsigned short)(((bits >> 16) & 0x8000u) | 0x7FC0u);
    return (unsigned short)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

// float32 -> float16 bits: the hardware rounding; NaN by hand (sign, all-ones exponent, top 10 mantissa bits, never
// 0, which would be inf), so the bits match NumPy's cast on every GPU.
__device__ __forceinline__ unsigned short f32_to_f16_bits(float x) {
    unsigned int bits = __float_as_uint(x);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) {
        unsigned int mant = (bits >> 13) & 0x3FFu;
        return (unsigned short)(((bits >> 16) & 0x8000u) | 0x7C00u | (mant ? mant : 1u));
    }
    return __half_as_ushort(__float2half_rn(x));
}

// float32 -> the bits of format H (1: bfloat16, 2: float16), H a compile-time constant: the kernels' half output.
template <int H> __device__ __forceinline__ unsigned short f32_to_half_bits(float x) {
    return H == 1 ? f32_to_bf16_bits(x) : f32_to_f16_bits(x);
}

// A 16-bit value of format H (its bits) as float32, exactly (bf16: the top of 16 zero bits; fp16: __half2float,
// subnormals, inf and NaN included).
template <int H> __device__ __forceinline__ float half_to_f32(unsigned short b) {
    return H == 1 ? __uint_as_float(((unsigned int)b) << 16) : __half2float(__ushort_as_half(b));
}

// Two float32 values rounded to format H and packed into 32 bits, a in the low half (the element at the lower address
// on little-endian GPUs): vectorised half stores (attention.cu's pack8, crossentropy.cu's half4 variant).
template <int H> __device__ __forceinline__ unsigned int pack_half2(float a, float b) {
    return (unsigned int)f32_to_half_bits<H>(a) | ((unsigned int)f32_to_half_bits<H>(b) << 16);
}
