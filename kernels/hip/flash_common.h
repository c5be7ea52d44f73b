// flash_common.h: what two or more of flash.cu's versions use, so that each section of flash.cu holds only its own
// version's code. flash.cu includes it right after portable.h and half.h (GPULLM_MATRIX_UNITS defined before them).
//   FLASH_* constants    v2's and v3's blocks and tiles (FLASH_KTILE: v4's to v6's tiles too), the padding of every
//                        version's shared rows (FLASH_PAD), the softmax's FLASH_LOG2E, FLASH_LN2, FLASH_NEG_INF
//   FLASH_PART(V, H)     the guard of each section's entry points: a launcher compiles one version's part
//   load_rows            rows of a head into shared memory (v2, v3)
//   row_max, row_sum     a row's reduction over the lanes that share it (v2's forward, the delta pass)
//   RoundTo, zero_tile   register-tile helpers of v3, v4 to v6 and v5's fused backward
//   chunk8, flash_delta  the backward's delta pass (flash.cu's delta section; chunk8 also in v6's dQ kernel)
#pragma once
#include "portable.h"
#include "half.h"

#ifndef GPULLM_MATRIX_UNITS
#error "flash_common.h uses portable.h register tiles: #define GPULLM_MATRIX_UNITS before including portable.h"
#endif

#define FLASH_WARPS 4         // warps (wavefronts) per block: blockDim.x = FLASH_WARPS * warpSize
#define FLASH_ROWS 64         // rows a block owns (16 per warp)
#define FLASH_KTILE 64        // forward: key rows per tile
#define FLASH_BTILE 32        // backward: rows of the tile walked (query rows for dK dV, key rows for dQ)
#define FLASH_PAD 8           // 16-bit elements added to each shared row (keeps 32-byte alignment, spreads banks)
#define FLASH_LOG2E 1.4426950408889634f
#define FLASH_LN2 0.6931471805599453f
#define FLASH_NEG_INF (-__int_as_float(0x7f800000))

// The entry points by part: each section of flash.cu instantiates its entry points inside `#if FLASH_PART(V, H)`
// blocks, and a launcher compiles only the part it runs (-DFLASH_PART_V=2|4|5|6 -DFLASH_PART_H=1|2,
// backends/hip/flash.py), so a process running v6 in bf16 compiles an eighth of the entry points; without them every
// part is compiled (the compile checks). The delta kernels (flash.cu's last section) are in every part.
#if defined(FLASH_PART_V) && defined(FLASH_PART_H)
#define FLASH_PART(V, H) (FLASH_PART_V == (V) && FLASH_PART_H == (H))
#else
#define FLASH_PART(V, H) 1
#endif

// rows [r0, r0 + nrows) of a (T, HS) head into shared memory dst[nrows][HS + FLASH_PAD], 16 bytes per load; rows past
// T become zeros. Every thread of the block calls it.
template <int HS>
__device__ __forceinline__ void load_rows(unsigned short (*dst)[HS + FLASH_PAD], const unsigned short* __restrict__ src,
                                          int r0, int nrows, int T) {
    const int chunks = HS / 8;  // 8 halves = 16 bytes
    for (int i = threadIdx.x; i < nrows * chunks; i += blockDim.x) {
        int r = i / chunks, c = (i % chunks) * 8;
        uint4 val = make_uint4(0u, 0u, 0u, 0u);
        if (r0 + r < T) val = *reinterpret_cast<const uint4*>(src + (long long)(r0 + r) * HS + c);
        *reinterpret_cast<uint4*>(&dst[r][c]) = val;
    }
}

// The reduction of a row's value over the `lpr` lanes that share the row (consecutive lanes, lpr a power of two).
__device__ __forceinline__ float row_max(float v, int lpr) {
    for (int o = 1; o < lpr; o *= 2) v = fmaxf(v, shfl_xor(v, o, warpSize));
    return v;
}
__device__ __forceinline__ float row_sum(float v, int lpr) {
    for (int o = 1; o < lpr; o *= 2) v += shfl_xor(v, o, warpSize);
    return v;
}

// v3's register tiles, also v4's to v6's and v5's fused backward: a float32 as the bits of format H (the rounding
// mma_pack takes), and a tile of zeros.
template <int H> struct RoundTo {
    __device__ __forceinline__ unsigned short operator()(float x) const { return f32_to_half_bits<H>(x); }
};

__device__ __forceinline__ void zero_tile(mma_tile& t) {
#pragma unroll
    for (int e = 0; e < MMA_SE; e++) t.x[e] = 0.0f;
}

// ---- backward: delta ------------------------------------------------------------------------------------------
// delta[row] = sum_j dout[row][j] out[row][j] over rows of hs contiguous elements (the heads layout (B*nh, T, hs), or
// the packed layout's (B, T, C) rows cut into heads: row r = (b T + t) nh + h, delta (B, nh, T) as the dK dV and dQ
// kernels read it). out is float32 (OutT float) or format H (OutT unsigned short). A row is shared by `lpr`
// consecutive lanes (the largest power of two up to 8 that divides its hs / 8 chunks of 8 elements), each chunk one
// 16-byte load of dout and one or two of out; every layout and format sums in the same order (the packed and heads
// backward then see the same delta for the same numbers). The launchers keep rows below 2^31.
template <int H> __device__ __forceinline__ void chunk8(float (&x)[8], const unsigned short* p) {
    const uint4 a = *reinterpret_cast<const uint4*>(p);
    const unsigned int w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        x[2 * i] = half_to_f32<H>((unsigned short)(w[i] & 0xFFFFu));
        x[2 * i + 1] = half_to_f32<H>((unsigned short)(w[i] >> 16));
    }
}
template <int H> __device__ __forceinline__ void chunk8(float (&x)[8], const float* p) {
    const float4 a = *reinterpret_cast<const float4*>(p), b = *reinterpret_cast<const float4*>(p + 4);
    x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
}
template <int H, bool PACKED, typename OutT>
__device__ void flash_delta(const OutT* __restrict__ out, const unsigned short* __restrict__ dout,
                            float* __restrict__ delta, long long rows, int hs, int T, int nh) {
    const int chunks = hs / 8, lpr = min(chunks & -chunks, 8), sub = threadIdx.x % lpr, per_block = blockDim.x / lpr;
    // r0 is the same for the whole block, so every lane reaches row_sum's shuffles
    for (long long r0 = (long long)blockIdx.x * per_block; r0 < rows; r0 += (long long)gridDim.x * per_block) {
        const long long row = r0 + threadIdx.x / lpr;
        float acc = 0.0f;
        if (row < rows)
            for (int c = sub; c < chunks; c += lpr) {
                float o[8], d[8];
                chunk8<H>(o, out + row * hs + 8 * c);
                chunk8<H>(d, dout + row * hs + 8 * c);
#pragma unroll
                for (int i = 0; i < 8; i++) acc += d[i] * o[i];
            }
        acc = row_sum(acc, lpr);
        if (sub == 0 && row < rows) {
            if (PACKED) {
                const unsigned int r = (unsigned int)row, bt = r / (unsigned int)nh, b = bt / (unsigned int)T;
                delta[((long long)b * nh + (r - bt * nh)) * T + (bt - b * T)] = acc;
            } else {
                delta[row] = acc;
            }
        }
    }
}
