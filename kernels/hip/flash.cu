// flash.cu: causal flash attention, forward and backward, on the matrix units (lesson 11; the math and the readable
// one-thread-per-row version are kernels/numba/flash.py).
//
// One section per version, in order; each holds the version's kernels, then its entry-point macro and the
// instantiations of it for bf16 and f16 inside `#if FLASH_PART(V, H)` blocks (a launcher compiles one part:
// backends/hip/flash.py's part_options). Search for "// ==== " to jump to a section:
//   flash_common.h     (included below) what several versions share: the FLASH_* constants, FLASH_PART,
//                      load_rows, row_max / row_sum, RoundTo, zero_tile and the delta pass flash_delta
//   ==== v2            the products on the matrix units, the softmax through shared memory; FLASH_ENTRIES_V2
//   ==== v3            the softmax in registers (portable.h's register tiles); FLASH_ENTRIES_V3 (v2's part), and
//                      FLASH_ENTRIES_V3_GENERAL: attention in general (not causal, a mask, Tq != Tk) on v3's code
//   ==== v4, v5, v6    FlashAttention-2's blocks and double-buffered tiles: v4 to v6 share this templated code and
//                      differ by LV (v4 0, v5 1, v6 2); FLASH_ENTRIES_V4 and FLASH_ENTRIES_PACKED (packed layout)
//   ==== v5 fused      v5's backward in one kernel (fused=True); FLASH_ENTRIES_FUSED (v5's part)
//   ==== delta         the backward's delta pass of v2 to v5 (flash_common.h's flash_delta), in every part
#define GPULLM_MATRIX_UNITS 1  // portable.h's mma_* functions
#include "portable.h"
#include "half.h"
#include "flash_common.h"

// ==== v2: the products on the matrix units, the softmax through shared memory ========================================
// v2: q, k, v, dout are 16-bit floats (format H: 1 bfloat16, 2 float16, as bits), (B*nh, T, HS) rows contiguous;
// out, dq, dk, dv, lse, delta are float32. Every product of two tiles runs on the matrix units through portable.h's
// mma_* functions (tensor cores on NVIDIA, MFMA on AMD CDNA) with fp32 accumulation; the softmax, its running max and
// sum, and the rescale of the output stay fp32 in registers. The probabilities P (and dS in the backward) are rounded
// to format H in shared memory as the next product's input, the same rounding a cuBLAS path in H applies to them.
//
// A block is 4 warps (wavefronts: 128 threads on NVIDIA, 256 on AMD); each warp owns 16 rows of the block's tile and
// multiplies 16x16 tiles. HS (the head size) is a template argument: 16, 32, 48 or 64.
//   forward   flash_attention_forward_v2_hs{HS}_{bf16|f16}: a block owns 64 query rows and walks the key tiles of 64
//             rows up to its last query row (causal tile skipping). Per tile: S = Q K^T (mma), per row the online
//             merge of lesson 05 (m' = max(m, rowmax), alpha = 2^(m - m'), l' = alpha l + sum p, p = 2^(S' - m'),
//             scores in base 2: S' = S scale log2(e)), P to shared memory in format H, then O = alpha O + P V (mma into
//             a scratch tile, added into the registers that hold O). At the end out = O / l, lse = (m + log2 l) ln 2.
//   backward  flash_attention_backward_v2_delta_{fmt}: delta[row] = sum_j dout * out (one warp per row);
//             flash_attention_backward_v2_dkdv_hs{HS}_{fmt}: a block owns 64 key rows, walks the query tiles of 32 rows
//             from its first key on: S^T = K Q^T, dP^T = V dO^T, P^T = 2^(S^T scale log2 e - lse log2 e),
//             dS^T = P^T (dP^T - delta); dV += P^T dO and dK += dS^T Q accumulate in the warps' fragments;
//             flash_attention_backward_v2_dq_hs{HS}_{fmt}: a block owns 64 query rows, walks the key tiles of 32 rows up
//             to its last row: the same P and dS, dQ += dS K.
//             Each element of dq, dk, dv is summed by one warp in a fixed order: no atomics, the same bits every run.
// Rows past T are loaded as zeros and never written; keys past T and above the diagonal get p = 0.

// ---- forward ----------------------------------------------------------------------------------------------------
template <int H, int HS>
__device__ void flash_forward(const unsigned short* __restrict__ q, const unsigned short* __restrict__ k,
                              const unsigned short* __restrict__ v, float* __restrict__ out, float* __restrict__ lse,
                              int T, float scale) {
    constexpr int LD = HS + FLASH_PAD, PLD = FLASH_KTILE + FLASH_PAD, LPR = MMA_WARP / 16;
    constexpr int SLD = (FLASH_KTILE > HS ? FLASH_KTILE : HS) + 4;
    __shared__ __align__(32) unsigned short ks[FLASH_KTILE][LD];
    __shared__ __align__(32) unsigned short vs[FLASH_KTILE][LD];
    __shared__ __align__(32) float scr[FLASH_WARPS][16][SLD];
    __shared__ __align__(32) unsigned short ps[FLASH_WARPS][16][PLD];
    const long long head = blockIdx.x;
    q += head * T * HS;
    k += head * T * HS;
    v += head * T * HS;
    const int warp = threadIdx.x / warpSize, lane = threadIdx.x % warpSize;
    const int r = lane / LPR, sub = lane % LPR;  // this lane's row of the warp's 16, and its part of the row
    // the last query blocks walk the most key tiles: they start first (blockIdx.y = 0), the short ones fill the tail
    const int t0 = (gridDim.y - 1 - blockIdx.y) * FLASH_ROWS, tw = t0 + 16 * warp, t = tw + r;
    const float sl2 = scale * FLASH_LOG2E;

    // the warp's 16 query rows as A fragments, kept in registers for every key tile (staged through ks)
    mma_a<H, MMA_ROW> qa[HS / 16];
    load_rows<HS>(ks, q, t0, FLASH_ROWS, T);
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < HS / 16; kk++) mma_load_a<H, MMA_ROW>(qa[kk], &ks[16 * warp][16 * kk], LD);

    float o[HS / LPR];  // this lane's columns sub, sub + LPR, ... of its row of O
#pragma unroll
    for (int i = 0; i < HS / LPR; i++) o[i] = 0.0f;
    float m = FLASH_NEG_INF, l = 0.0f;
    const int t_last = min(T, t0 + FLASH_ROWS) - 1;
    for (int s0 = 0; s0 <= t_last; s0 += FLASH_KTILE) {
        __syncthreads();  // every warp is done with the last tile (and with qa's staging)
        load_rows<HS>(ks, k, s0, FLASH_KTILE, T);
        load_rows<HS>(vs, v, s0, FLASH_KTILE, T);
        __syncthreads();
        if (s0 > tw + 15) continue;  // the whole tile is above the diagonal for this warp's rows
        // S = Q K^T for the warp's 16 rows x 64 keys
#pragma unroll
        for (int n = 0; n < FLASH_KTILE / 16; n++) {
            mma_acc acc;
            mma_zero(acc);
#pragma unroll
            for (int kk = 0; kk < HS / 16; kk++) {
                mma_b<H, MMA_COL> b;
                mma_load_b<H, MMA_COL>(b, &ks[16 * n][16 * kk], LD);
                mma_run(acc, qa[kk], b);
            }
            mma_store(&scr[warp][0][16 * n], acc, SLD);
        }
        warp_sync();
        // the online merge, row r, columns sub + LPR i
        float mt = FLASH_NEG_INF;
#pragma unroll
        for (int i = 0; i < FLASH_KTILE / LPR; i++) {
            int c = sub + LPR * i;
            if (s0 + c <= t) mt = fmaxf(mt, scr[warp][r][c] * sl2);
        }
        mt = row_max(mt, LPR);
        const float m_new = fmaxf(m, mt);
        const float alpha = m == FLASH_NEG_INF ? 0.0f : exp2f(m - m_new);
        float ls = 0.0f;
#pragma unroll
        for (int i = 0; i < FLASH_KTILE / LPR; i++) {
            int c = sub + LPR * i;
            float p = s0 + c <= t && m_new != FLASH_NEG_INF ? exp2f(scr[warp][r][c] * sl2 - m_new) : 0.0f;
            ls += p;
            ps[warp][r][c] = f32_to_half_bits<H>(p);
        }
        l = alpha * l + row_sum(ls, LPR);
        m = m_new;
        warp_sync();
        // scr = P V (16 x HS), then O = alpha O + scr
#pragma unroll
        for (int j = 0; j < HS / 16; j++) {
            mma_acc acc;
            mma_zero(acc);
#pragma unroll
            for (int kk = 0; kk < FLASH_KTILE / 16; kk++) {
                mma_a<H, MMA_ROW> a;
                mma_b<H, MMA_ROW> b;
                mma_load_a<H, MMA_ROW>(a, &ps[warp][0][16 * kk], PLD);
                mma_load_b<H, MMA_ROW>(b, &vs[16 * kk][16 * j], LD);
                mma_run(acc, a, b);
            }
            mma_store(&scr[warp][0][16 * j], acc, SLD);
        }
        warp_sync();
#pragma unroll
        for (int i = 0; i < HS / LPR; i++) o[i] = alpha * o[i] + scr[warp][r][sub + LPR * i];
        warp_sync();  // scr is read before the next tile's S overwrites it
    }
    if (t < T) {
        float inv = 1.0f / l;
        float* orow = out + (head * T + t) * HS;
#pragma unroll
        for (int i = 0; i < HS / LPR; i++) orow[sub + LPR * i] = o[i] * inv;
        if (sub == 0) lse[head * T + t] = (m + log2f(l)) * FLASH_LN2;
    }
}

// ---- backward: delta ------------------------------------------------------------------------------------------------
// flash_common.h's flash_delta (v3 to v5 run it too); its entry points are in the delta section at the end.

// Write a warp's 16 x HS accumulator tiles, times `mul`, to rows [row0, row0 + 16) of a (T, HS) float32 head, rows
// past T left alone (through the warp's scratch: 16 x 16 at a time).
template <int HS, int SLD>
__device__ __forceinline__ void store_rows(float* __restrict__ dst, mma_acc (&acc)[HS / 16], float (*scr)[SLD],
                                           int row0, int T, float mul) {
    const int lane = threadIdx.x % warpSize;
#pragma unroll
    for (int j = 0; j < HS / 16; j++) {
        mma_store(&scr[0][0], acc[j], SLD);
        warp_sync();
        for (int e = lane; e < 256; e += warpSize) {
            int rr = e / 16, cc = e % 16;
            if (row0 + rr < T) dst[(long long)(row0 + rr) * HS + 16 * j + cc] = scr[rr][cc] * mul;
        }
        warp_sync();
    }
}

// ---- backward: dK, dV -------------------------------------------------------------------------------------------
template <int H, int HS>
__device__ void flash_dkdv(const unsigned short* __restrict__ q, const unsigned short* __restrict__ k,
                           const unsigned short* __restrict__ v, const unsigned short* __restrict__ dout,
                           const float* __restrict__ lse, const float* __restrict__ delta, float* __restrict__ dk,
                           float* __restrict__ dv, int T, float scale) {
    constexpr int LD = HS + FLASH_PAD, BT = FLASH_BTILE, SLD = (BT > 16 ? BT : 16) + 4, PLD = BT + FLASH_PAD;
    constexpr int LPR = MMA_WARP / 16;
    __shared__ __align__(32) unsigned short qd[2 * BT > FLASH_ROWS ? 2 * BT : FLASH_ROWS][LD];  // Q rows, then dO
    __shared__ float lse_s[BT], del_s[BT];
    __shared__ __align__(32) float sS[FLASH_WARPS][16][SLD];
    __shared__ __align__(32) float sP[FLASH_WARPS][16][SLD];
    __shared__ __align__(32) unsigned short pt[FLASH_WARPS][16][PLD];
    __shared__ __align__(32) unsigned short dst[FLASH_WARPS][16][PLD];
    const long long head = blockIdx.x;
    q += head * T * HS;
    k += head * T * HS;
    v += head * T * HS;
    dout += head * T * HS;
    lse += head * T;
    delta += head * T;
    const int warp = threadIdx.x / warpSize, lane = threadIdx.x % warpSize;
    const int r = lane / LPR, sub = lane % LPR;
    // the first key blocks walk the most query tiles: blockIdx.y = 0 is key block 0
    const int s_first = blockIdx.y * FLASH_ROWS, sw = s_first + 16 * warp, s = sw + r;  // this lane's key row
    const float sl2 = scale * FLASH_LOG2E;

    // the warp's 16 key rows of K and of V as A fragments (K Q^T and V dO^T), staged through qd
    mma_a<H, MMA_ROW> ka[HS / 16], va[HS / 16];
    load_rows<HS>(qd, k, s_first, FLASH_ROWS, T);
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < HS / 16; kk++) mma_load_a<H, MMA_ROW>(ka[kk], &qd[16 * warp][16 * kk], LD);
    __syncthreads();
    load_rows<HS>(qd, v, s_first, FLASH_ROWS, T);
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < HS / 16; kk++) mma_load_a<H, MMA_ROW>(va[kk], &qd[16 * warp][16 * kk], LD);

    mma_acc dka[HS / 16], dva[HS / 16];
#pragma unroll
    for (int j = 0; j < HS / 16; j++) {
        mma_zero(dka[j]);
        mma_zero(dva[j]);
    }
    for (int t0 = (s_first / BT) * BT; t0 < T; t0 += BT) {
        __syncthreads();
        load_rows<HS>(qd, q, t0, BT, T);
        load_rows<HS>(qd + BT, dout, t0, BT, T);
        for (int i = threadIdx.x; i < BT; i += blockDim.x) {
            lse_s[i] = t0 + i < T ? lse[t0 + i] * FLASH_LOG2E : 0.0f;
            del_s[i] = t0 + i < T ? delta[t0 + i] : 0.0f;
        }
        __syncthreads();
        if (t0 + BT - 1 < sw) continue;  // every query of the tile is before this warp's keys
        // S^T = K Q^T and dP^T = V dO^T: 16 keys x BT queries each
#pragma unroll
        for (int n = 0; n < BT / 16; n++) {
            mma_acc a1, a2;
            mma_zero(a1);
            mma_zero(a2);
#pragma unroll
            for (int kk = 0; kk < HS / 16; kk++) {
                mma_b<H, MMA_COL> b;
                mma_load_b<H, MMA_COL>(b, &qd[16 * n][16 * kk], LD);
                mma_run(a1, ka[kk], b);
                mma_load_b<H, MMA_COL>(b, &qd[BT + 16 * n][16 * kk], LD);
                mma_run(a2, va[kk], b);
            }
            mma_store(&sS[warp][0][16 * n], a1, SLD);
            mma_store(&sP[warp][0][16 * n], a2, SLD);
        }
        warp_sync();
#pragma unroll
        for (int i = 0; i < BT / LPR; i++) {
            int c = sub + LPR * i, tq = t0 + c;
            float p = tq >= s && tq < T ? exp2f(sS[warp][r][c] * sl2 - lse_s[c]) : 0.0f;
            pt[warp][r][c] = f32_to_half_bits<H>(p);
            dst[warp][r][c] = f32_to_half_bits<H>(p * (sP[warp][r][c] - del_s[c]));
        }
        warp_sync();
        // dV += P^T dO, dK += dS^T Q (16 keys x HS)
#pragma unroll
        for (int kk = 0; kk < BT / 16; kk++) {
            mma_a<H, MMA_ROW> ap, ad;
            mma_load_a<H, MMA_ROW>(ap, &pt[warp][0][16 * kk], PLD);
            mma_load_a<H, MMA_ROW>(ad, &dst[warp][0][16 * kk], PLD);
#pragma unroll
            for (int j = 0; j < HS / 16; j++) {
                mma_b<H, MMA_ROW> b;
                mma_load_b<H, MMA_ROW>(b, &qd[BT + 16 * kk][16 * j], LD);
                mma_run(dva[j], ap, b);
                mma_load_b<H, MMA_ROW>(b, &qd[16 * kk][16 * j], LD);
                mma_run(dka[j], ad, b);
            }
        }
    }
    store_rows<HS, SLD>(dk + head * T * HS, dka, sS[warp], sw, T, scale);
    store_rows<HS, SLD>(dv + head * T * HS, dva, sS[warp], sw, T, 1.0f);
}

// ---- backward: dQ -----------------------------------------------------------------------------------------------
template <int H, int HS>
__device__ void flash_dq(const unsigned short* __restrict__ q, const unsigned short* __restrict__ k,
                         const unsigned short* __restrict__ v, const unsigned short* __restrict__ dout,
                         const float* __restrict__ lse, const float* __restrict__ delta, float* __restrict__ dq, int T,
                         float scale) {
    constexpr int LD = HS + FLASH_PAD, BT = FLASH_BTILE, SLD = (BT > 16 ? BT : 16) + 4, PLD = BT + FLASH_PAD;
    constexpr int LPR = MMA_WARP / 16;
    __shared__ __align__(32) unsigned short kv[2 * BT > FLASH_ROWS ? 2 * BT : FLASH_ROWS][LD];  // K rows, then V
    __shared__ __align__(32) float sS[FLASH_WARPS][16][SLD];
    __shared__ __align__(32) float sP[FLASH_WARPS][16][SLD];
    __shared__ __align__(32) unsigned short dst[FLASH_WARPS][16][PLD];
    const long long head = blockIdx.x;
    q += head * T * HS;
    k += head * T * HS;
    v += head * T * HS;
    dout += head * T * HS;
    const int warp = threadIdx.x / warpSize, lane = threadIdx.x % warpSize;
    const int r = lane / LPR, sub = lane % LPR;
    const int t0 = (gridDim.y - 1 - blockIdx.y) * FLASH_ROWS, tw = t0 + 16 * warp, t = tw + r;  // this lane's query row
    const float sl2 = scale * FLASH_LOG2E;
    const float lse_t = t < T ? lse[head * T + t] * FLASH_LOG2E : 0.0f;
    const float del_t = t < T ? delta[head * T + t] : 0.0f;

    mma_a<H, MMA_ROW> qa[HS / 16], da[HS / 16];
    load_rows<HS>(kv, q, t0, FLASH_ROWS, T);
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < HS / 16; kk++) mma_load_a<H, MMA_ROW>(qa[kk], &kv[16 * warp][16 * kk], LD);
    __syncthreads();
    load_rows<HS>(kv, dout, t0, FLASH_ROWS, T);
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < HS / 16; kk++) mma_load_a<H, MMA_ROW>(da[kk], &kv[16 * warp][16 * kk], LD);

    mma_acc dqa[HS / 16];
#pragma unroll
    for (int j = 0; j < HS / 16; j++) mma_zero(dqa[j]);
    const int t_last = min(T, t0 + FLASH_ROWS) - 1;
    for (int s0 = 0; s0 <= t_last; s0 += BT) {
        __syncthreads();
        load_rows<HS>(kv, k, s0, BT, T);
        load_rows<HS>(kv + BT, v, s0, BT, T);
        __syncthreads();
        if (s0 > tw + 15) continue;
        // S = Q K^T, dP = dO V^T: 16 queries x BT keys
#pragma unroll
        for (int n = 0; n < BT / 16; n++) {
            mma_acc a1, a2;
            mma_zero(a1);
            mma_zero(a2);
#pragma unroll
            for (int kk = 0; kk < HS / 16; kk++) {
                mma_b<H, MMA_COL> b;
                mma_load_b<H, MMA_COL>(b, &kv[16 * n][16 * kk], LD);
                mma_run(a1, qa[kk], b);
                mma_load_b<H, MMA_COL>(b, &kv[BT + 16 * n][16 * kk], LD);
                mma_run(a2, da[kk], b);
            }
            mma_store(&sS[warp][0][16 * n], a1, SLD);
            mma_store(&sP[warp][0][16 * n], a2, SLD);
        }
        warp_sync();
#pragma unroll
        for (int i = 0; i < BT / LPR; i++) {
            int c = sub + LPR * i;
            float p = s0 + c <= t && t < T ? exp2f(sS[warp][r][c] * sl2 - lse_t) : 0.0f;
            dst[warp][r][c] = f32_to_half_bits<H>(p * (sP[warp][r][c] - del_t));
        }
        warp_sync();
        // dQ += dS K (16 queries x HS)
#pragma unroll
        for (int kk = 0; kk < BT / 16; kk++) {
            mma_a<H, MMA_ROW> a;
            mma_load_a<H, MMA_ROW>(a, &dst[warp][0][16 * kk], PLD);
#pragma unroll
            for (int j = 0; j < HS / 16; j++) {
                mma_b<H, MMA_ROW> b;
                mma_load_b<H, MMA_ROW>(b, &kv[16 * kk][16 * j], LD);
                mma_run(dqa[j], a, b);
            }
        }
    }
    store_rows<HS, SLD>(dq + head * T * HS, dqa, sS[warp], tw, T, scale);
}

// ---- v2's entry points: one per format and head size (part 2, with v3's) --------------------------------------------
#define FLASH_ENTRIES_V2(HS, FMT, H)                                                                                  \
    extern "C" __global__ void flash_attention_forward_v2_hs##HS##_##FMT(                                            \
        const unsigned short* q, const unsigned short* k, const unsigned short* v, float* out, float* lse, int T,     \
        float scale) {                                                                                                \
        flash_forward<H, HS>(q, k, v, out, lse, T, scale);                                                            \
    }                                                                                                                 \
    extern "C" __global__ void flash_attention_backward_v2_dkdv_hs##HS##_##FMT(                                      \
        const unsigned short* q, const unsigned short* k, const unsigned short* v, const unsigned short* dout,         \
        const float* lse, const float* delta, float* dk, float* dv, int T, float scale) {                             \
        flash_dkdv<H, HS>(q, k, v, dout, lse, delta, dk, dv, T, scale);                                               \
    }                                                                                                                 \
    extern "C" __global__ void flash_attention_backward_v2_dq_hs##HS##_##FMT(                                        \
        const unsigned short* q, const unsigned short* k, const unsigned short* v, const unsigned short* dout,         \
        const float* lse, const float* delta, float* dq, int T, float scale) {                                        \
        flash_dq<H, HS>(q, k, v, dout, lse, delta, dq, T, scale);                                                     \
    }
#if FLASH_PART(2, 1)  // v2, bf16 (part 2: v2 and v3)
FLASH_ENTRIES_V2(16, bf16, 1)
FLASH_ENTRIES_V2(32, bf16, 1)
FLASH_ENTRIES_V2(48, bf16, 1)
FLASH_ENTRIES_V2(64, bf16, 1)
#endif
#if FLASH_PART(2, 2)  // v2, f16
FLASH_ENTRIES_V2(16, f16, 2)
FLASH_ENTRIES_V2(32, f16, 2)
FLASH_ENTRIES_V2(48, f16, 2)
FLASH_ENTRIES_V2(64, f16, 2)
#endif

// ==== v3: the softmax in registers ===================================================================================
// The same algorithm as v2, on portable.h's register tiles: S (and dP) stay in the accumulators the matrix units
// wrote, the online merge (or P and dS) runs on them in place, and the rounded P (dS) goes straight into the operand
// registers of the next product. No scratch tile goes through shared memory; shared memory holds only the tiles
// of K and V (Q and dO in the backward) that every warp of the block reads.
// (RoundTo and zero_tile, which v4 to v6 use too, are flash_common.h's.)

// Attention in general (v3's general entry points, GEN = true; the math is kernels/numba/flash.py's): Tq = T queries
// and Tk keys, causal bottom-right aligned (query t sees keys s <= t + off, off = Tk - Tq >= 0) or not, and a (Tq, Tk)
// uint8 mask (nonzero = allowed, the same for every head) or none. A row that sees no key gets out = 0, lse = -inf and
// no gradient. With GEN = false each helper below is exactly v3's causal, square test, so the causal entry points
// compile to the code they had.
struct FlashGeneral {
    int Tk, off, causal;
    const unsigned char* mask;  // row-major (Tq, Tk), or nullptr for none
};
template <bool GEN>
__device__ __forceinline__ bool flash_sees(int t, int s, int Tq, int Tk, const FlashGeneral& g) {
    if (!GEN) return s <= t;
    return s < Tk && (!g.causal || s <= t + g.off) && (g.mask == nullptr || (t < Tq && g.mask[(long long)t * Tk + s]));
}
// the end of the key tiles a block of queries up to t_last walks (forward, dQ)
template <bool GEN> __device__ __forceinline__ int flash_key_end(int t_last, int Tk, const FlashGeneral& g) {
    return !GEN ? t_last + 1 : g.causal ? min(Tk, t_last + g.off + 1) : Tk;
}
// whether a key tile starting at s0 is past every key the queries up to t_last see (causal)
template <bool GEN> __device__ __forceinline__ bool flash_tile_after(int s0, int t_last, const FlashGeneral& g) {
    return !GEN ? s0 > t_last : g.causal && s0 > t_last + g.off;
}
// the first query that can see key s_first (dK dV's walk over the query tiles)
template <bool GEN> __device__ __forceinline__ int flash_query_begin(int s_first, const FlashGeneral& g) {
    return !GEN ? s_first : g.causal ? max(0, s_first - g.off) : 0;
}
// whether every query up to t_end comes before key s (causal)
template <bool GEN> __device__ __forceinline__ bool flash_tile_before(int t_end, int s, const FlashGeneral& g) {
    return !GEN ? t_end < s : g.causal && t_end + g.off < s;
}

// rows [row0, row0 + 16) of a (T, HS) float32 head from a warp's HS / 16 register tiles, times mul (rows past T
// left alone)
template <int HS>
__device__ __forceinline__ void store_tiles(float* __restrict__ dst, const mma_tile (&t)[HS / 16], int row0, int T,
                                            float mul) {
#pragma unroll
    for (int j = 0; j < HS / 16; j++)
#pragma unroll
        for (int e = 0; e < MMA_SE; e++) {
            int row = row0 + mma_tile_row(e);
            if (row < T) dst[(long long)row * HS + 16 * j + mma_tile_col(e)] = t[j].x[e] * mul;
        }
}

template <int H, int HS, bool GEN = false>
__device__ void flash_forward_v3(const unsigned short* __restrict__ q, const unsigned short* __restrict__ k,
                                 const unsigned short* __restrict__ v, float* __restrict__ out,
                                 float* __restrict__ lse, int T, float scale, FlashGeneral g = FlashGeneral{0, 0, 1, nullptr}) {
    constexpr int LD = HS + FLASH_PAD, KT = FLASH_KTILE;
    __shared__ __align__(16) unsigned short ks[KT][LD];
    __shared__ __align__(16) unsigned short vs[KT][LD];
    const long long head = blockIdx.x;
    const int Tk = GEN ? g.Tk : T;  // T is the number of queries (Tq)
    q += head * T * HS;
    k += head * Tk * HS;
    v += head * Tk * HS;
    const int warp = threadIdx.x / warpSize;
    const int t0 = (gridDim.y - 1 - blockIdx.y) * FLASH_ROWS, tw = t0 + 16 * warp;  // heavy blocks first
    const float sl2 = scale * FLASH_LOG2E;

    mma_rows<H> qf[HS / 16];  // the warp's 16 query rows, staged through ks
    load_rows<HS>(ks, q, t0, FLASH_ROWS, T);
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < HS / 16; kk++) mma_rows_load<H>(qf[kk], &ks[16 * warp][16 * kk], LD);
    mma_tile o[HS / 16];
#pragma unroll
    for (int j = 0; j < HS / 16; j++) zero_tile(o[j]);
    float m[MMA_QPL], l[MMA_QPL];
#pragma unroll
    for (int qi = 0; qi < MMA_QPL; qi++) m[qi] = FLASH_NEG_INF, l[qi] = 0.0f;
    const int t_last = min(T, t0 + FLASH_ROWS) - 1;
    for (int s0 = 0; s0 < flash_key_end<GEN>(t_last, Tk, g); s0 += KT) {
        __syncthreads();
        load_rows<HS>(ks, k, s0, KT, Tk);
        load_rows<HS>(vs, v, s0, KT, Tk);
        __syncthreads();
        if (flash_tile_after<GEN>(s0, tw + 15, g)) continue;  // the whole tile is above the diagonal for the warp
        mma_tile s[KT / 16];  // S = Q K^T: 16 rows x 64 keys
#pragma unroll
        for (int n = 0; n < KT / 16; n++) {
            zero_tile(s[n]);
#pragma unroll
            for (int kk = 0; kk < HS / 16; kk++) mma_rows_run<H>(s[n], qf[kk], &ks[16 * n][16 * kk], LD);
        }
        float mt[MMA_QPL];
#pragma unroll
        for (int qi = 0; qi < MMA_QPL; qi++) mt[qi] = FLASH_NEG_INF;
#pragma unroll
        for (int n = 0; n < KT / 16; n++)
#pragma unroll
            for (int e = 0; e < MMA_SE; e++) {
                bool keep = flash_sees<GEN>(tw + mma_tile_row(e), s0 + 16 * n + mma_tile_col(e), T, Tk, g);
                s[n].x[e] = keep ? s[n].x[e] * sl2 : FLASH_NEG_INF;
                mt[mma_tile_q(e)] = fmaxf(mt[mma_tile_q(e)], s[n].x[e]);
            }
        float alpha[MMA_QPL], ls[MMA_QPL];
#pragma unroll
        for (int qi = 0; qi < MMA_QPL; qi++) {
            float m_new = fmaxf(m[qi], mma_row_max(mt[qi]));
            alpha[qi] = m[qi] == FLASH_NEG_INF ? 0.0f : exp2f(m[qi] - m_new);
            m[qi] = m_new;
            ls[qi] = 0.0f;
        }
#pragma unroll
        for (int n = 0; n < KT / 16; n++)
#pragma unroll
            for (int e = 0; e < MMA_SE; e++) {
                float x = s[n].x[e], p = x == FLASH_NEG_INF ? 0.0f : exp2f(x - m[mma_tile_q(e)]);
                s[n].x[e] = p;
                ls[mma_tile_q(e)] += p;
            }
#pragma unroll
        for (int qi = 0; qi < MMA_QPL; qi++) l[qi] = alpha[qi] * l[qi] + mma_row_sum(ls[qi]);
#pragma unroll
        for (int j = 0; j < HS / 16; j++)
#pragma unroll
            for (int e = 0; e < MMA_SE; e++) o[j].x[e] *= alpha[mma_tile_q(e)];
        // O += P V, P rounded to format H straight from the registers that held S
#pragma unroll
        for (int kk = 0; kk < KT / 16; kk++) {
            mma_packed<H> pk;
            mma_pack<H>(pk, s[kk], RoundTo<H>());
#pragma unroll
            for (int j = 0; j < HS / 16; j++) mma_packed_run<H>(o[j], pk, &vs[16 * kk][16 * j], LD);
        }
    }
    if (GEN)  // a row that sees no key (l = 0): out = 0 and lse = -inf, not 0 / 0
#pragma unroll
        for (int qi = 0; qi < MMA_QPL; qi++)
            if (l[qi] == 0.0f) l[qi] = __int_as_float(0x7f800000), m[qi] = FLASH_NEG_INF;
#pragma unroll
    for (int j = 0; j < HS / 16; j++)
#pragma unroll
        for (int e = 0; e < MMA_SE; e++) o[j].x[e] /= l[mma_tile_q(e)];
    store_tiles<HS>(out + head * T * HS, o, tw, T, 1.0f);
    if (mma_row_leader())
#pragma unroll
        for (int qi = 0; qi < MMA_QPL; qi++) {
            int t = tw + mma_lane_row(qi);
            if (t < T)
                lse[head * T + t] = GEN && m[qi] == FLASH_NEG_INF ? FLASH_NEG_INF : (m[qi] + log2f(l[qi])) * FLASH_LN2;
        }
}

// dQ: a block owns 64 query rows (16 per warp) and walks the key tiles up to its last row: S = Q K^T and
// dP = dO V^T in registers, P = 2^(S scale log2 e - lse log2 e), dS = P (dP - delta), dQ += dS K.
template <int H, int HS, bool GEN = false>
__device__ void flash_dq_v3(const unsigned short* __restrict__ q, const unsigned short* __restrict__ k,
                            const unsigned short* __restrict__ v, const unsigned short* __restrict__ dout,
                            const float* __restrict__ lse, const float* __restrict__ delta, float* __restrict__ dq,
                            int T, float scale, FlashGeneral g = FlashGeneral{0, 0, 1, nullptr}) {
    constexpr int LD = HS + FLASH_PAD, KT = FLASH_KTILE;
    __shared__ __align__(16) unsigned short ks[KT][LD];
    __shared__ __align__(16) unsigned short vs[KT][LD];
    const long long head = blockIdx.x;
    const int Tk = GEN ? g.Tk : T;  // T is the number of queries (Tq)
    q += head * T * HS;
    k += head * Tk * HS;
    v += head * Tk * HS;
    dout += head * T * HS;
    const int warp = threadIdx.x / warpSize;
    const int t0 = (gridDim.y - 1 - blockIdx.y) * FLASH_ROWS, tw = t0 + 16 * warp;
    const float sl2 = scale * FLASH_LOG2E;
    float lse_r[MMA_QPL], del_r[MMA_QPL];
#pragma unroll
    for (int qi = 0; qi < MMA_QPL; qi++) {
        int t = tw + mma_lane_row(qi);
        lse_r[qi] = t < T ? lse[head * T + t] * FLASH_LOG2E : 0.0f;
        del_r[qi] = t < T ? delta[head * T + t] : 0.0f;
    }
    mma_rows<H> qf[HS / 16], df[HS / 16];  // the warp's rows of Q and of dO, staged through ks and vs
    load_rows<HS>(ks, q, t0, FLASH_ROWS, T);
    load_rows<HS>(vs, dout, t0, FLASH_ROWS, T);
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < HS / 16; kk++) {
        mma_rows_load<H>(qf[kk], &ks[16 * warp][16 * kk], LD);
        mma_rows_load<H>(df[kk], &vs[16 * warp][16 * kk], LD);
    }
    mma_tile dqt[HS / 16];
#pragma unroll
    for (int j = 0; j < HS / 16; j++) zero_tile(dqt[j]);
    const int t_last = min(T, t0 + FLASH_ROWS) - 1;
    for (int s0 = 0; s0 < flash_key_end<GEN>(t_last, Tk, g); s0 += KT) {
        __syncthreads();
        load_rows<HS>(ks, k, s0, KT, Tk);
        load_rows<HS>(vs, v, s0, KT, Tk);
        __syncthreads();
        if (flash_tile_after<GEN>(s0, tw + 15, g)) continue;
        mma_tile s[KT / 16], dp[KT / 16];
#pragma unroll
        for (int n = 0; n < KT / 16; n++) {
            zero_tile(s[n]);
            zero_tile(dp[n]);
#pragma unroll
            for (int kk = 0; kk < HS / 16; kk++) {
                mma_rows_run<H>(s[n], qf[kk], &ks[16 * n][16 * kk], LD);
                mma_rows_run<H>(dp[n], df[kk], &vs[16 * n][16 * kk], LD);
            }
        }
#pragma unroll
        for (int n = 0; n < KT / 16; n++)
#pragma unroll
            for (int e = 0; e < MMA_SE; e++) {
                int t = tw + mma_tile_row(e), qi = mma_tile_q(e);
                bool keep = flash_sees<GEN>(t, s0 + 16 * n + mma_tile_col(e), T, Tk, g) && t < T;
                float p = keep ? exp2f(s[n].x[e] * sl2 - lse_r[qi]) : 0.0f;
                s[n].x[e] = p * (dp[n].x[e] - del_r[qi]);  // dS
            }
#pragma unroll
        for (int kk = 0; kk < KT / 16; kk++) {
            mma_packed<H> pk;
            mma_pack<H>(pk, s[kk], RoundTo<H>());
#pragma unroll
            for (int j = 0; j < HS / 16; j++) mma_packed_run<H>(dqt[j], pk, &ks[16 * kk][16 * j], LD);
        }
    }
    store_tiles<HS>(dq + head * T * HS, dqt, tw, T, scale);
}

// dK, dV: a block owns 64 key rows (16 per warp) and walks the query tiles from its first key on, the tiles
// transposed (rows are keys): S^T = K Q^T and dP^T = V dO^T in registers, P^T, dS^T = P^T (dP^T - delta);
// dV += P^T dO and dK += dS^T Q accumulate in registers.
template <int H, int HS, bool GEN = false>
__device__ void flash_dkdv_v3(const unsigned short* __restrict__ q, const unsigned short* __restrict__ k,
                              const unsigned short* __restrict__ v, const unsigned short* __restrict__ dout,
                              const float* __restrict__ lse, const float* __restrict__ delta, float* __restrict__ dk,
                              float* __restrict__ dv, int T, float scale, FlashGeneral g = FlashGeneral{0, 0, 1, nullptr}) {
    constexpr int LD = HS + FLASH_PAD, QT = FLASH_KTILE;
    __shared__ __align__(16) unsigned short qs[QT][LD];
    __shared__ __align__(16) unsigned short ds[QT][LD];
    __shared__ float lse_s[QT], del_s[QT];
    const long long head = blockIdx.x;
    const int Tk = GEN ? g.Tk : T;  // T is the number of queries (Tq); the block's rows are keys
    q += head * T * HS;
    k += head * Tk * HS;
    v += head * Tk * HS;
    dout += head * T * HS;
    lse += head * T;
    delta += head * T;
    const int warp = threadIdx.x / warpSize;
    const int s_first = blockIdx.y * FLASH_ROWS, sw = s_first + 16 * warp;  // key block 0 (the longest walk) first
    const float sl2 = scale * FLASH_LOG2E;
    mma_rows<H> kf[HS / 16], vf[HS / 16];  // the warp's rows of K and of V, staged through qs and ds
    load_rows<HS>(qs, k, s_first, FLASH_ROWS, Tk);
    load_rows<HS>(ds, v, s_first, FLASH_ROWS, Tk);
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < HS / 16; kk++) {
        mma_rows_load<H>(kf[kk], &qs[16 * warp][16 * kk], LD);
        mma_rows_load<H>(vf[kk], &ds[16 * warp][16 * kk], LD);
    }
    mma_tile dkt[HS / 16], dvt[HS / 16];
#pragma unroll
    for (int j = 0; j < HS / 16; j++) {
        zero_tile(dkt[j]);
        zero_tile(dvt[j]);
    }
    // causal: s_first is a multiple of the tile and no earlier query can see it (GEN: the first query that can see
    // key s_first is s_first - off; none without causal)
    for (int t0 = flash_query_begin<GEN>(s_first, g); t0 < T; t0 += QT) {
        __syncthreads();
        load_rows<HS>(qs, q, t0, QT, T);
        load_rows<HS>(ds, dout, t0, QT, T);
        for (int i = threadIdx.x; i < QT; i += blockDim.x) {
            lse_s[i] = t0 + i < T ? lse[t0 + i] * FLASH_LOG2E : 0.0f;
            del_s[i] = t0 + i < T ? delta[t0 + i] : 0.0f;
        }
        __syncthreads();
        if (flash_tile_before<GEN>(t0 + QT - 1, sw, g)) continue;  // every query of the tile is before the warp's keys
        mma_tile st[QT / 16], dpt[QT / 16];
#pragma unroll
        for (int n = 0; n < QT / 16; n++) {
            zero_tile(st[n]);
            zero_tile(dpt[n]);
#pragma unroll
            for (int kk = 0; kk < HS / 16; kk++) {
                mma_rows_run<H>(st[n], kf[kk], &qs[16 * n][16 * kk], LD);
                mma_rows_run<H>(dpt[n], vf[kk], &ds[16 * n][16 * kk], LD);
            }
        }
#pragma unroll
        for (int n = 0; n < QT / 16; n++)
#pragma unroll
            for (int e = 0; e < MMA_SE; e++) {
                int c = 16 * n + mma_tile_col(e), tq = t0 + c;
                bool keep = flash_sees<GEN>(tq, sw + mma_tile_row(e), T, Tk, g) && tq < T;
                float p = keep ? exp2f(st[n].x[e] * sl2 - lse_s[c]) : 0.0f;
                st[n].x[e] = p;
                dpt[n].x[e] = p * (dpt[n].x[e] - del_s[c]);  // dS^T
            }
#pragma unroll
        for (int kk = 0; kk < QT / 16; kk++) {
            mma_packed<H> pp, pd;
            mma_pack<H>(pp, st[kk], RoundTo<H>());
            mma_pack<H>(pd, dpt[kk], RoundTo<H>());
#pragma unroll
            for (int j = 0; j < HS / 16; j++) {
                mma_packed_run<H>(dvt[j], pp, &ds[16 * kk][16 * j], LD);
                mma_packed_run<H>(dkt[j], pd, &qs[16 * kk][16 * j], LD);
            }
        }
    }
    store_tiles<HS>(dk + head * Tk * HS, dkt, sw, Tk, scale);
    store_tiles<HS>(dv + head * Tk * HS, dvt, sw, Tk, 1.0f);
}

// ---- v3's entry points: one per format and head size (part 2, with v2's) --------------------------------------------
#define FLASH_ENTRIES_V3(HS, FMT, H)                                                                                  \
    extern "C" __global__ void flash_attention_forward_v3_hs##HS##_##FMT(                                            \
        const unsigned short* q, const unsigned short* k, const unsigned short* v, float* out, float* lse, int T,     \
        float scale) {                                                                                                \
        flash_forward_v3<H, HS>(q, k, v, out, lse, T, scale);                                                         \
    }                                                                                                                 \
    extern "C" __global__ void flash_attention_backward_v3_dkdv_hs##HS##_##FMT(                                      \
        const unsigned short* q, const unsigned short* k, const unsigned short* v, const unsigned short* dout,         \
        const float* lse, const float* delta, float* dk, float* dv, int T, float scale) {                             \
        flash_dkdv_v3<H, HS>(q, k, v, dout, lse, delta, dk, dv, T, scale);                                            \
    }                                                                                                                 \
    extern "C" __global__ void flash_attention_backward_v3_dq_hs##HS##_##FMT(                                        \
        const unsigned short* q, const unsigned short* k, const unsigned short* v, const unsigned short* dout,         \
        const float* lse, const float* delta, float* dq, int T, float scale) {                                        \
        flash_dq_v3<H, HS>(q, k, v, dout, lse, delta, dq, T, scale);                                                  \
    }
// v3's general entry points (attention in general: Tq queries, Tk keys, causal 0 or 1, mask a (Tq, Tk) uint8 array read
// where has_mask is 1; the backward's delta is the v2 delta pass over the Tq rows)
#define FLASH_GENERAL (FlashGeneral{Tk, Tk - Tq, causal, has_mask ? mask : nullptr})
#define FLASH_ENTRIES_V3_GENERAL(HS, FMT, H)                                                                          \
    extern "C" __global__ void flash_attention_forward_v3_general_hs##HS##_##FMT(                                    \
        const unsigned short* q, const unsigned short* k, const unsigned short* v, float* out, float* lse, int Tq,    \
        int Tk, int causal, const unsigned char* mask, int has_mask, float scale) {                                   \
        flash_forward_v3<H, HS, true>(q, k, v, out, lse, Tq, scale, FLASH_GENERAL);                                  \
    }                                                                                                                 \
    extern "C" __global__ void flash_attention_backward_v3_general_dkdv_hs##HS##_##FMT(                              \
        const unsigned short* q, const unsigned short* k, const unsigned short* v, const unsigned short* dout,         \
        const float* lse, const float* delta, float* dk, float* dv, int Tq, int Tk, int causal,                       \
        const unsigned char* mask, int has_mask, float scale) {                                                       \
        flash_dkdv_v3<H, HS, true>(q, k, v, dout, lse, delta, dk, dv, Tq, scale, FLASH_GENERAL);                      \
    }                                                                                                                 \
    extern "C" __global__ void flash_attention_backward_v3_general_dq_hs##HS##_##FMT(                                \
        const unsigned short* q, const unsigned short* k, const unsigned short* v, const unsigned short* dout,         \
        const float* lse, const float* delta, float* dq, int Tq, int Tk, int causal, const unsigned char* mask,       \
        int has_mask, float scale) {                                                                                  \
        flash_dq_v3<H, HS, true>(q, k, v, dout, lse, delta, dq, Tq, scale, FLASH_GENERAL);                            \
    }
#if FLASH_PART(2, 1)  // v3, bf16 (part 2: v2 and v3)
FLASH_ENTRIES_V3(16, bf16, 1)
FLASH_ENTRIES_V3(32, bf16, 1)
FLASH_ENTRIES_V3(48, bf16, 1)
FLASH_ENTRIES_V3(64, bf16, 1)
FLASH_ENTRIES_V3_GENERAL(16, bf16, 1)
FLASH_ENTRIES_V3_GENERAL(32, bf16, 1)
FLASH_ENTRIES_V3_GENERAL(48, bf16, 1)
FLASH_ENTRIES_V3_GENERAL(64, bf16, 1)
#endif
#if FLASH_PART(2, 2)  // v3, f16
FLASH_ENTRIES_V3(16, f16, 2)
FLASH_ENTRIES_V3(32, f16, 2)
FLASH_ENTRIES_V3(48, f16, 2)
FLASH_ENTRIES_V3(64, f16, 2)
FLASH_ENTRIES_V3_GENERAL(16, f16, 2)
FLASH_ENTRIES_V3_GENERAL(32, f16, 2)
FLASH_ENTRIES_V3_GENERAL(48, f16, 2)
FLASH_ENTRIES_V3_GENERAL(64, f16, 2)
#endif

// ==== v4, v5, v6: more rows per block, tiles copied while the previous one is multiplied =============================
// v5 and v6 are v4's LV levels: v4 to v6 share this section's templated code and differ by LV (see below); v5's
// one-kernel backward is the next section.
// The math of v3 (register tiles), reorganised as FlashAttention-2 does:
//   - a block owns 128 rows. Forward and dQ: 4 warps of two 16-row tiles each (32 rows per warp), so every K / V
//     fragment a warp reads from shared memory (ldmatrix on NVIDIA) feeds two products instead of one: half the
//     shared-memory traffic per multiply. dK dV: 8 warps of 16 key rows (the dK and dV accumulators, K and V as
//     operands, S^T and dP^T already fill a thread's registers at 16 rows), each Q / dO tile shared by twice the keys;
//   - the tiles walked are double-buffered: while the warps multiply tile i, the copies of tile i + 1 are in flight
//     (portable.h's copy16_async: cp.async on NVIDIA; plain loads on AMD), one __syncthreads per tile;
//   - the dQ kernel takes a key tile in two halves of 32 keys (S, dP of the half in registers), to stay in registers.
// The results are summed in the same fixed order on every run (no atomics); tiles past the diagonal are skipped.
// Layouts: every row of q, k, v, dout, out, dq, dk, dv is HS contiguous elements, rows `ld` apart (the device functions'
// ld_* arguments), head h of batch b starting at (b T ld + h HS): the heads layout (B*nh, T, HS) is nh = 1, ld = HS;
// the packed layout of the engine reads q, k, v straight out of the qkv product's (B, T, 3C) rows (ld = 3C, k and v
// at columns C and 2C), writes y into the (B, T, C) rows the attention projection reads (in format H) and dq, dk, dv
// into the (B, T, 3C) float32 rows of dqkv: no head split or merge pass.
// The template argument LV picks the version: v4 (LV = 0), v5 (1), v6 (2).
// v5 (LEAN): less work per element of S between the products. Only the tiles that cross the diagonal are masked (the
// masked scores become -inf, and 2^-inf = 0 needs no guard; rows and queries past T need no mask, their Q and dO rows
// being zeros); the scale goes into the exponent's fma; the exponential is exp2_fast (one ex2.approx.ftz on NVIDIA)
// and two roundings to format H one conversion (mma_pack_rn).
// v6 (FAST) is v5 with fewer instructions around the products; Nsight Compute showed v5's warps issuing an
// instruction on only 27-41% of cycles, mostly waiting on the result of the instruction before (two warps per
// scheduler hide little), so:
//   - copy_rows unrolled for the block's thread count: v5's loop over the block's threads cost ~28 instructions per
//     16-byte copy (a division, 64-bit address math and a branch each time), a fifth of the forward's instructions;
//   - results stored two neighbouring columns at a time (a float2, or two 16-bit values in one 32-bit store);
//   - the products of a tile ordered k-step outer, so that the products issued back to back add into different
//     accumulators; a row's max and sum as trees (tile_reduce) instead of one chain of dependent operations;
//   - the forward's O times 1 / l (one reciprocal per row) instead of a division per element;
//   - the backward's delta computed by the dQ kernel, which runs first (flash_dq_v4): no delta pass.
// v6's l is summed in another order than v5's, so its bits differ from v5's (not its accuracy).
#define FLASH4_ROWS 128        // rows a v4 block owns
#define FLASH4_WARPS 4         // forward, dQ: warps per block (two 16-row tiles each)
#define FLASH4_DKDV_WARPS 8    // dK dV: warps per block (16 key rows each)
#define FLASH4_RT 2            // forward, dQ: 16-row tiles per warp
#define FLASH4_KC 32           // dQ: keys per half tile

// rows [r0, r0 + nrows) of a (T, HS) head into shared memory (row stride LD elements) with asynchronous 16-byte
// copies; rows past T become zeros. Every thread of the block calls it; copy_commit / copy_wait are the caller's.
// NT > 0 (v6): the block's threads (blockDim.x), known when compiled: each thread's copies are then unrolled, rows
// NT / chunks apart, from one address (nrows is a constant at every call); NT = 0: a loop over the block's threads
template <int HS, int LD, int NT>
__device__ __forceinline__ void copy_rows(unsigned short* dst, const unsigned short* __restrict__ src, int r0,
                                          int nrows, int T, int ld) {
    constexpr int chunks = HS / 8;  // 8 halves = 16 bytes
    if (NT > 0 && NT % chunks == 0) {
        constexpr int step = NT >= chunks ? NT / chunks : 1;
        const int r = threadIdx.x / chunks, c = threadIdx.x % chunks * 8;
        const unsigned short* s = src + (long long)(r0 + r) * ld + c;
        const long long sstep = (long long)step * ld;
#pragma unroll
        for (int k = 0; k < nrows / step; k++) {
            bool ok = r0 + r + k * step < T;
            copy16_async(dst + (r + k * step) * LD + c, ok ? s + k * sstep : src, ok);
        }
        if (nrows % step == 0 || r + nrows / step * step >= nrows) return;
        bool ok = r0 + r + nrows / step * step < T;
        copy16_async(dst + (r + nrows / step * step) * LD + c, ok ? s + nrows / step * sstep : src, ok);
    } else
    for (int i = threadIdx.x; i < nrows * chunks; i += blockDim.x) {
        int r = i / chunks, c = (i % chunks) * 8;
        bool ok = r0 + r < T;
        copy16_async(dst + r * LD + c, ok ? src + (long long)(r0 + r) * ld + c : src, ok);
    }
}

// where block blockIdx.x's head starts in an array whose rows are ld elements apart (see Layouts above)
template <int HS> __device__ __forceinline__ long long head_start(int T, int nh, int ld) {
    const long long head = blockIdx.x;
    return (head / nh) * T * ld + (head % nh) * HS;
}

// one element of a result: float32, or rounded to format H (16-bit bits)
template <int H> __device__ __forceinline__ void put(float* p, float x) { *p = x; }
template <int H> __device__ __forceinline__ void put(unsigned short* p, float x) { *p = f32_to_half_bits<H>(x); }

// rows [row0, row0 + 16) of a head from a warp's HS / 16 register tiles, times mul, rows ld apart (rows past T left
// alone); v4's twin of store_tiles
template <int H> __device__ __forceinline__ void put2(float* p, float x, float y) {
    *reinterpret_cast<float2*>(p) = make_float2(x, y);
}
template <int H> __device__ __forceinline__ void put2(unsigned short* p, float x, float y) {
    *reinterpret_cast<unsigned int*>(p) = f32_to_half_bits<H>(x) | ((unsigned int)f32_to_half_bits<H>(y) << 16);
}
template <int H, int HS, bool PAIRS, typename OutT>
__device__ __forceinline__ void store_tiles_ld(OutT* __restrict__ dst, const mma_tile (&t)[HS / 16], int row0, int T,
                                               float mul, int ld) {
    if (PAIRS) {  // v6: two neighbouring columns (elements e, e + 1 of a lane) in one store
#pragma unroll
        for (int j = 0; j < HS / 16; j++)
#pragma unroll
            for (int e = 0; e < MMA_SE; e += 2) {
                int row = row0 + mma_tile_row(e);
                if (row < T) put2<H>(dst + (long long)row * ld + 16 * j + mma_tile_col(e), t[j].x[e] * mul, t[j].x[e + 1] * mul);
            }
    } else
#pragma unroll
    for (int j = 0; j < HS / 16; j++)
#pragma unroll
        for (int e = 0; e < MMA_SE; e++) {
            int row = row0 + mma_tile_row(e);
            if (row < T) put<H>(dst + (long long)row * ld + 16 * j + mma_tile_col(e), t[j].x[e] * mul);
        }
}

// the max (MAX) or sum of row qi's elements of a lane's N register tiles, as a tree (no chain of N MMA_SE / MMA_QPL
// dependent operations): each tile's pairs first, then the tiles pairwise
template <bool MAX, int N>
__device__ __forceinline__ float tile_reduce(const mma_tile (&t)[N], int qi) {
    float part[N];
#pragma unroll
    for (int n = 0; n < N; n++) {
        float a[MMA_SE / MMA_QPL];
        int c = 0;
#pragma unroll
        for (int e = 0; e < MMA_SE; e++)
            if (mma_tile_q(e) == qi) a[c++] = t[n].x[e];
#pragma unroll
        for (int w = 1; w < MMA_SE / MMA_QPL; w *= 2)
#pragma unroll
            for (int i = 0; i + w < MMA_SE / MMA_QPL; i += 2 * w) a[i] = MAX ? fmaxf(a[i], a[i + w]) : a[i] + a[i + w];
        part[n] = a[0];
    }
#pragma unroll
    for (int w = 1; w < N; w *= 2)
#pragma unroll
        for (int i = 0; i + w < N; i += 2 * w) part[i] = MAX ? fmaxf(part[i], part[i + w]) : part[i] + part[i + w];
    return part[0];
}

template <int H, int HS, int LV, typename OutT>
__device__ void flash_forward_v4(const unsigned short* __restrict__ q, const unsigned short* __restrict__ k,
                                 const unsigned short* __restrict__ v, OutT* __restrict__ out,
                                 float* __restrict__ lse, int T, float scale, int nh, int ld, int ld_out) {
    constexpr int LD = HS + FLASH_PAD, KT = FLASH_KTILE, RT = FLASH4_RT, NT = LV >= 2 ? FLASH4_WARPS * MMA_WARP : 0;
    constexpr bool LEAN = LV >= 1, FAST = LV >= 2;
    static_assert(2 * KT == FLASH4_ROWS, "Q's rows are staged in one buffer of K and V rows");
    __shared__ __align__(16) unsigned short kv[2][2 * KT][LD];  // [buffer][K's KT rows, then V's KT rows]
    const long long head = blockIdx.x, in0 = head_start<HS>(T, nh, ld);
    q += in0;
    k += in0;
    v += in0;
    out += head_start<HS>(T, nh, ld_out);
    const int warp = threadIdx.x / warpSize;
    const int t0 = (gridDim.y - 1 - blockIdx.y) * FLASH4_ROWS;  // heavy blocks first
    const int tw = t0 + 16 * RT * warp;                          // the warp's rows: [tw, tw + 16 RT), tile rt at tw + 16 rt
    const float sl2 = scale * FLASH_LOG2E;
    const int t_last = min(T, t0 + FLASH4_ROWS) - 1, ntiles = t_last / KT + 1;

    // Q's 128 rows staged in buffer 1, key tile 0 in buffer 0: one group of copies
    copy_rows<HS, LD, NT>(&kv[1][0][0], q, t0, FLASH4_ROWS, T, ld);
    copy_rows<HS, LD, NT>(&kv[0][0][0], k, 0, KT, T, ld);
    copy_rows<HS, LD, NT>(&kv[0][KT][0], v, 0, KT, T, ld);
    copy_commit();
    copy_wait<0>();
    __syncthreads();
    mma_rows<H> qf[RT][HS / 16];
#pragma unroll
    for (int rt = 0; rt < RT; rt++)
#pragma unroll
        for (int kk = 0; kk < HS / 16; kk++) mma_rows_load<H>(qf[rt][kk], &kv[1][16 * (RT * warp + rt)][16 * kk], LD);
    mma_tile o[RT][HS / 16];
    float m[RT][MMA_QPL], l[RT][MMA_QPL];
#pragma unroll
    for (int rt = 0; rt < RT; rt++) {
#pragma unroll
        for (int j = 0; j < HS / 16; j++) zero_tile(o[rt][j]);
#pragma unroll
        for (int qi = 0; qi < MMA_QPL; qi++) m[rt][qi] = FLASH_NEG_INF, l[rt][qi] = 0.0f;
    }
    for (int it = 0; it < ntiles; it++) {
        const int s0 = it * KT, b = it % 2;
        copy_wait<0>();   // this thread's copies of tile it have landed
        __syncthreads();  // everyone's have; every warp is done with buffer 1 - b (tile it - 1, or Q's staging)
        if (it + 1 < ntiles) {
            copy_rows<HS, LD, NT>(&kv[1 - b][0][0], k, s0 + KT, KT, T, ld);
            copy_rows<HS, LD, NT>(&kv[1 - b][KT][0], v, s0 + KT, KT, T, ld);
            copy_commit();
        }
        if (s0 > tw + 16 * RT - 1) continue;  // the whole tile is above the diagonal for this warp's rows
        const unsigned short(*ks)[LD] = kv[b];
        const unsigned short(*vs)[LD] = kv[b] + KT;
        mma_tile s[RT][KT / 16];  // S = Q K^T: 16 RT rows x 64 keys, each K fragment used by both row tiles
#pragma unroll
        for (int n = 0; n < KT / 16; n++)
#pragma unroll
            for (int rt = 0; rt < RT; rt++) zero_tile(s[rt][n]);
#pragma unroll
        for (int i = 0; i < KT / 16 * (HS / 16); i++) {  // v6: k-step outer; v4, v5: key block n outer
            const int n = FAST ? i % (KT / 16) : i / (HS / 16), kk = FAST ? i / (KT / 16) : i % (HS / 16);
            mma_kfrag<H> kf;
            mma_kfrag_load<H>(kf, &ks[16 * n][16 * kk], LD);
#pragma unroll
            for (int rt = 0; rt < RT; rt++) mma_rows_mul<H>(s[rt][n], qf[rt][kk], kf);
        }
        // LEAN (v5): the merge below; v4: the merge after it, every tile masked element by element, exp2f, the
        // scale applied before the max, the rounding to 16 bits by hand
        float alpha[RT][MMA_QPL];
        if (LEAN) {
            // the online merge of each row tile, on the raw scores (m is a raw score; p = 2^(S sl2 - m sl2), one fma).
            // Only a tile that crosses the diagonal for the warp's rows is masked: there a key past a row (or past T)
            // gets S = -inf, p = 2^-inf = 0. A row tile wholly above the diagonal gets p = 0, alpha = 1: its m is finite
            // from tile 0, where key 0 is visible to every row.
            const bool diag = s0 + KT - 1 > tw;
#pragma unroll
            for (int rt = 0; rt < RT; rt++) {
                float mt[MMA_QPL], ls[MMA_QPL], ms[MMA_QPL];
#pragma unroll
                for (int qi = 0; qi < MMA_QPL; qi++) mt[qi] = FLASH_NEG_INF;
                if (diag)
#pragma unroll
                    for (int n = 0; n < KT / 16; n++)
#pragma unroll
                        for (int e = 0; e < MMA_SE; e++)
                            if (s0 + 16 * n + mma_tile_col(e) > tw + 16 * rt + mma_tile_row(e)) s[rt][n].x[e] = FLASH_NEG_INF;
                if (FAST)
#pragma unroll
                    for (int qi = 0; qi < MMA_QPL; qi++) mt[qi] = tile_reduce<true, KT / 16>(s[rt], qi);
                else
#pragma unroll
                    for (int n = 0; n < KT / 16; n++)
#pragma unroll
                        for (int e = 0; e < MMA_SE; e++) mt[mma_tile_q(e)] = fmaxf(mt[mma_tile_q(e)], s[rt][n].x[e]);
#pragma unroll
                for (int qi = 0; qi < MMA_QPL; qi++) {
                    float m_new = fmaxf(m[rt][qi], mma_row_max(mt[qi]));
                    alpha[rt][qi] = m[rt][qi] == FLASH_NEG_INF ? 0.0f : exp2_fast((m[rt][qi] - m_new) * sl2);
                    m[rt][qi] = m_new;
                    ms[qi] = -m_new * sl2;
                    ls[qi] = 0.0f;
                }
#pragma unroll
                for (int n = 0; n < KT / 16; n++)
#pragma unroll
                    for (int e = 0; e < MMA_SE; e++) {
                        float p = exp2_fast(fmaf(s[rt][n].x[e], sl2, ms[mma_tile_q(e)]));
                        s[rt][n].x[e] = p;
                        if (!FAST) ls[mma_tile_q(e)] += p;
                    }
                if (FAST)
#pragma unroll
                    for (int qi = 0; qi < MMA_QPL; qi++) ls[qi] = tile_reduce<false, KT / 16>(s[rt], qi);
#pragma unroll
                for (int qi = 0; qi < MMA_QPL; qi++) l[rt][qi] = alpha[rt][qi] * l[rt][qi] + mma_row_sum(ls[qi]);
#pragma unroll
                for (int j = 0; j < HS / 16; j++)
#pragma unroll
                    for (int e = 0; e < MMA_SE; e++) o[rt][j].x[e] *= alpha[rt][mma_tile_q(e)];
            }
        } else {
            // the online merge of each row tile (a row tile wholly above the diagonal gets p = 0, alpha = 1: its m is
            // finite from tile 0, where key 0 is visible to every row)
#pragma unroll
            for (int rt = 0; rt < RT; rt++) {
                float mt[MMA_QPL], ls[MMA_QPL];
#pragma unroll
                for (int qi = 0; qi < MMA_QPL; qi++) mt[qi] = FLASH_NEG_INF;
#pragma unroll
                for (int n = 0; n < KT / 16; n++)
#pragma unroll
                    for (int e = 0; e < MMA_SE; e++) {
                        bool keep = s0 + 16 * n + mma_tile_col(e) <= tw + 16 * rt + mma_tile_row(e);
                        s[rt][n].x[e] = keep ? s[rt][n].x[e] * sl2 : FLASH_NEG_INF;
                        mt[mma_tile_q(e)] = fmaxf(mt[mma_tile_q(e)], s[rt][n].x[e]);
                    }
#pragma unroll
                for (int qi = 0; qi < MMA_QPL; qi++) {
                    float m_new = fmaxf(m[rt][qi], mma_row_max(mt[qi]));
                    alpha[rt][qi] = m[rt][qi] == FLASH_NEG_INF ? 0.0f : exp2f(m[rt][qi] - m_new);
                    m[rt][qi] = m_new;
                    ls[qi] = 0.0f;
                }
#pragma unroll
                for (int n = 0; n < KT / 16; n++)
#pragma unroll
                    for (int e = 0; e < MMA_SE; e++) {
                        float x = s[rt][n].x[e], p = x == FLASH_NEG_INF ? 0.0f : exp2f(x - m[rt][mma_tile_q(e)]);
                        s[rt][n].x[e] = p;
                        ls[mma_tile_q(e)] += p;
                    }
#pragma unroll
                for (int qi = 0; qi < MMA_QPL; qi++) l[rt][qi] = alpha[rt][qi] * l[rt][qi] + mma_row_sum(ls[qi]);
#pragma unroll
                for (int j = 0; j < HS / 16; j++)
#pragma unroll
                    for (int e = 0; e < MMA_SE; e++) o[rt][j].x[e] *= alpha[rt][mma_tile_q(e)];
            }
        }
        // O += P V, each V fragment used by both row tiles
#pragma unroll
        for (int kk = 0; kk < KT / 16; kk++) {
            mma_packed<H> pk[RT];
#pragma unroll
            for (int rt = 0; rt < RT; rt++) {
                if (LEAN) mma_pack_rn<H>(pk[rt], s[rt][kk]);
                else mma_pack<H>(pk[rt], s[rt][kk], RoundTo<H>());
            }
#pragma unroll
            for (int j = 0; j < HS / 16; j++) {
                mma_vfrag<H> vf;
                mma_vfrag_load<H>(vf, &vs[16 * kk][16 * j], LD);
#pragma unroll
                for (int rt = 0; rt < RT; rt++) mma_packed_mul<H>(o[rt][j], pk[rt], vf);
            }
        }
    }
#pragma unroll
    for (int rt = 0; rt < RT; rt++) {
#pragma unroll
        for (int j = 0; j < HS / 16; j++)
#pragma unroll
            for (int e = 0; e < MMA_SE; e++) {
                if (FAST) o[rt][j].x[e] *= 1.0f / l[rt][mma_tile_q(e)];
                else o[rt][j].x[e] /= l[rt][mma_tile_q(e)];
            }
        store_tiles_ld<H, HS, FAST>(out, o[rt], tw + 16 * rt, T, 1.0f, ld_out);
        if (mma_row_leader())
#pragma unroll
            for (int qi = 0; qi < MMA_QPL; qi++) {
                int t = tw + 16 * rt + mma_lane_row(qi);
                if (t < T) lse[head * T + t] = ((LEAN ? m[rt][qi] * sl2 : m[rt][qi]) + log2f(l[rt][qi])) * FLASH_LN2;
            }
    }
}

// dQ: a block owns 128 query rows (two 16-row tiles per warp) and walks the key tiles up to its last row, each in
// two halves of 32 keys: S = Q K^T and dP = dO V^T in registers, P = 2^(S scale log2 e - lse log2 e),
// dS = P (dP - delta), dQ += dS K; every K and V fragment feeds both row tiles.
// v6 (FAST) runs before the dK dV kernel and computes delta itself (no delta pass): each thread of the first 128 takes
// one of the block's rows, delta = sum over the row of dO O, dO from the rows staged in shared memory and O (format H
// on the packed layout, float32 on the heads layout: `out`, rows ld_out apart) from global memory, 8 elements at a
// time in the same order on both layouts; the block keeps it for its warps and writes it for the dK dV kernel.
// v4 and v5 read the delta pass's (out is not read). GT, dQ's type: float, or unsigned short (the half bits of
// format H, each value rounded once from the float32 sum: v6's _hg entry points on the packed layout).
template <int H, int HS, int LV, typename OT, typename GT>
__device__ void flash_dq_v4(const unsigned short* __restrict__ q, const unsigned short* __restrict__ k,
                            const unsigned short* __restrict__ v, const OT* __restrict__ out,
                            const unsigned short* __restrict__ dout, const float* __restrict__ lse,
                            float* __restrict__ delta, GT* __restrict__ dq, int T, float scale, int nh, int ld,
                            int ld_out, int ld_do, int ld_grad) {
    constexpr int LD = HS + FLASH_PAD, KT = FLASH_KTILE, KC = FLASH4_KC, RT = FLASH4_RT;
    constexpr int NT = LV >= 2 ? FLASH4_WARPS * MMA_WARP : 0;
    constexpr bool LEAN = LV >= 1, FAST = LV >= 2;
    static_assert(2 * KT == FLASH4_ROWS, "Q's and dO's rows are staged in the two buffers of K and V rows");
    __shared__ __align__(16) unsigned short kv[2][2 * KT][LD];  // [buffer][K's KT rows, then V's KT rows]
    __shared__ float del_s[FAST ? FLASH4_ROWS : 1];              // v6: the block's delta
    const long long head = blockIdx.x, in0 = head_start<HS>(T, nh, ld);
    q += in0;
    k += in0;
    v += in0;
    dout += head_start<HS>(T, nh, ld_do);
    dq += head_start<HS>(T, nh, ld_grad);
    const int warp = threadIdx.x / warpSize;
    const int t0 = (gridDim.y - 1 - blockIdx.y) * FLASH4_ROWS, tw = t0 + 16 * RT * warp;  // heavy blocks first
    const float sl2 = scale * FLASH_LOG2E;
    const int t_last = min(T, t0 + FLASH4_ROWS) - 1, ntiles = t_last / KT + 1;
    float lse_r[RT][MMA_QPL], del_r[RT][MMA_QPL];
#pragma unroll
    for (int rt = 0; rt < RT; rt++)
#pragma unroll
        for (int qi = 0; qi < MMA_QPL; qi++) {
            int t = tw + 16 * rt + mma_lane_row(qi);
            lse_r[rt][qi] = t < T ? lse[head * T + t] * FLASH_LOG2E : 0.0f;
            if (!FAST) del_r[rt][qi] = t < T ? delta[head * T + t] : 0.0f;
        }
    // Q's 128 rows staged in buffer 0, dO's in buffer 1
    copy_rows<HS, LD, NT>(&kv[0][0][0], q, t0, FLASH4_ROWS, T, ld);
    copy_rows<HS, LD, NT>(&kv[1][0][0], dout, t0, FLASH4_ROWS, T, ld_do);
    copy_commit();
    copy_wait<0>();
    __syncthreads();
    if (FAST) {
        const int r = threadIdx.x, t = t0 + r;
        if (r < FLASH4_ROWS) {
            float acc = 0.0f;
            if (t < T) {
                const OT* orow = out + head_start<HS>(T, nh, ld_out) + (long long)t * ld_out;
#pragma unroll
                for (int c = 0; c < HS / 8; c++) {
                    float o[8], d[8];
                    chunk8<H>(o, orow + 8 * c);
                    chunk8<H>(d, &kv[1][r][8 * c]);
#pragma unroll
                    for (int i = 0; i < 8; i++) acc += d[i] * o[i];
                }
                delta[head * T + t] = acc;
            }
            del_s[r] = acc;
        }
        __syncthreads();
#pragma unroll
        for (int rt = 0; rt < RT; rt++)
#pragma unroll
            for (int qi = 0; qi < MMA_QPL; qi++) del_r[rt][qi] = del_s[16 * (RT * warp + rt) + mma_lane_row(qi)];
    }
    mma_rows<H> qf[RT][HS / 16], df[RT][HS / 16];
#pragma unroll
    for (int rt = 0; rt < RT; rt++)
#pragma unroll
        for (int kk = 0; kk < HS / 16; kk++) {
            mma_rows_load<H>(qf[rt][kk], &kv[0][16 * (RT * warp + rt)][16 * kk], LD);
            mma_rows_load<H>(df[rt][kk], &kv[1][16 * (RT * warp + rt)][16 * kk], LD);
        }
    __syncthreads();  // every warp holds its rows: the staging buffers are free
    copy_rows<HS, LD, NT>(&kv[0][0][0], k, 0, KT, T, ld);
    copy_rows<HS, LD, NT>(&kv[0][KT][0], v, 0, KT, T, ld);
    copy_commit();
    mma_tile dqt[RT][HS / 16];
#pragma unroll
    for (int rt = 0; rt < RT; rt++)
#pragma unroll
        for (int j = 0; j < HS / 16; j++) zero_tile(dqt[rt][j]);
    for (int it = 0; it < ntiles; it++) {
        const int s0 = it * KT, b = it % 2;
        copy_wait<0>();
        __syncthreads();  // tile it is in buffer b; every warp is done with buffer 1 - b
        if (it + 1 < ntiles) {
            copy_rows<HS, LD, NT>(&kv[1 - b][0][0], k, s0 + KT, KT, T, ld);
            copy_rows<HS, LD, NT>(&kv[1 - b][KT][0], v, s0 + KT, KT, T, ld);
            copy_commit();
        }
        const unsigned short(*ks)[LD] = kv[b];
        const unsigned short(*vs)[LD] = kv[b] + KT;
#pragma unroll
        for (int c0 = 0; c0 < KT; c0 += KC) {
            if (s0 + c0 > tw + 16 * RT - 1) break;  // this half and the next are above the diagonal for the warp's rows
            mma_tile s[RT][KC / 16], dp[RT][KC / 16];
#pragma unroll
            for (int n = 0; n < KC / 16; n++)
#pragma unroll
                for (int rt = 0; rt < RT; rt++) {
                    zero_tile(s[rt][n]);
                    zero_tile(dp[rt][n]);
                }
#pragma unroll
            for (int i = 0; i < KC / 16 * (HS / 16); i++) {  // v6: k-step outer; v4, v5: key block n outer
                const int n = FAST ? i % (KC / 16) : i / (HS / 16), kk = FAST ? i / (KC / 16) : i % (HS / 16);
                mma_kfrag<H> kf, vf;
                mma_kfrag_load<H>(kf, &ks[c0 + 16 * n][16 * kk], LD);
                mma_kfrag_load<H>(vf, &vs[c0 + 16 * n][16 * kk], LD);
#pragma unroll
                for (int rt = 0; rt < RT; rt++) {
                    mma_rows_mul<H>(s[rt][n], qf[rt][kk], kf);
                    mma_rows_mul<H>(dp[rt][n], df[rt][kk], vf);
                }
            }
            if (LEAN) {
                // v5: only a half that crosses the diagonal is masked (S = -inf, p = 2^-inf = 0). Rows past T need
                // no mask: their Q and dO rows are zeros and lse, delta 0, so p = 1 and dP = 0 give dS = 0 (and they
                // are not stored)
                if (s0 + c0 + KC - 1 > tw)
#pragma unroll
                    for (int rt = 0; rt < RT; rt++)
#pragma unroll
                        for (int n = 0; n < KC / 16; n++)
#pragma unroll
                            for (int e = 0; e < MMA_SE; e++)
                                if (s0 + c0 + 16 * n + mma_tile_col(e) > tw + 16 * rt + mma_tile_row(e))
                                    s[rt][n].x[e] = FLASH_NEG_INF;
#pragma unroll
                for (int rt = 0; rt < RT; rt++)
#pragma unroll
                    for (int n = 0; n < KC / 16; n++)
#pragma unroll
                        for (int e = 0; e < MMA_SE; e++) {
                            const int qi = mma_tile_q(e);
                            float p = exp2_fast(fmaf(s[rt][n].x[e], sl2, -lse_r[rt][qi]));
                            s[rt][n].x[e] = p * (dp[rt][n].x[e] - del_r[rt][qi]);  // dS
                        }
            } else {
#pragma unroll
                for (int rt = 0; rt < RT; rt++)
#pragma unroll
                    for (int n = 0; n < KC / 16; n++)
#pragma unroll
                        for (int e = 0; e < MMA_SE; e++) {
                            int t = tw + 16 * rt + mma_tile_row(e), qi = mma_tile_q(e);
                            bool keep = s0 + c0 + 16 * n + mma_tile_col(e) <= t && t < T;
                            float p = keep ? exp2f(s[rt][n].x[e] * sl2 - lse_r[rt][qi]) : 0.0f;
                            s[rt][n].x[e] = p * (dp[rt][n].x[e] - del_r[rt][qi]);  // dS
                        }
            }
#pragma unroll
            for (int kk = 0; kk < KC / 16; kk++) {
                mma_packed<H> pk[RT];
#pragma unroll
                for (int rt = 0; rt < RT; rt++) {
                    if (LEAN) mma_pack_rn<H>(pk[rt], s[rt][kk]);
                    else mma_pack<H>(pk[rt], s[rt][kk], RoundTo<H>());
                }
#pragma unroll
                for (int j = 0; j < HS / 16; j++) {
                    mma_vfrag<H> kt;
                    mma_vfrag_load<H>(kt, &ks[c0 + 16 * kk][16 * j], LD);
#pragma unroll
                    for (int rt = 0; rt < RT; rt++) mma_packed_mul<H>(dqt[rt][j], pk[rt], kt);
                }
            }
        }
    }
#pragma unroll
    for (int rt = 0; rt < RT; rt++) store_tiles_ld<H, HS, FAST>(dq, dqt[rt], tw + 16 * rt, T, scale, ld_grad);
}

// dK, dV: a block owns 128 key rows (16 per warp, 8 warps) and walks the query tiles from its first key on, double-
// buffered with their lse and delta; per tile v3's math: S^T = K Q^T and dP^T = V dO^T in registers, P^T,
// dS^T = P^T (dP^T - delta); dV += P^T dO and dK += dS^T Q accumulate in registers. GT: dK's and dV's type, as
// flash_dq_v4's.
template <int H, int HS, int LV, typename GT>
__device__ void flash_dkdv_v4(const unsigned short* __restrict__ q, const unsigned short* __restrict__ k,
                              const unsigned short* __restrict__ v, const unsigned short* __restrict__ dout,
                              const float* __restrict__ lse, const float* __restrict__ delta, GT* __restrict__ dk,
                              GT* __restrict__ dv, int T, float scale, int nh, int ld, int ld_do, int ld_grad) {
    constexpr int LD = HS + FLASH_PAD, QT = FLASH_KTILE, NT = LV >= 2 ? FLASH4_DKDV_WARPS * MMA_WARP : 0;
    constexpr bool LEAN = LV >= 1, FAST = LV >= 2;
    static_assert(2 * QT == FLASH4_ROWS && 16 * FLASH4_DKDV_WARPS == FLASH4_ROWS,
                  "K's and V's rows are staged in the two buffers of Q and dO rows, 16 per warp");
    __shared__ __align__(16) unsigned short qd[2][2 * QT][LD];  // [buffer][Q's QT rows, then dO's QT rows]
    __shared__ __align__(16) float ld_s[2][2][QT];              // [buffer][lse, delta] of the tile's queries
    const long long head = blockIdx.x, in0 = head_start<HS>(T, nh, ld), g0 = head_start<HS>(T, nh, ld_grad);
    q += in0;
    k += in0;
    v += in0;
    dout += head_start<HS>(T, nh, ld_do);
    dk += g0;
    dv += g0;
    lse += head * T;
    delta += head * T;
    const int warp = threadIdx.x / warpSize;
    const int s_first = blockIdx.y * FLASH4_ROWS, sw = s_first + 16 * warp;  // key block 0 (the longest walk) first
    const float sl2 = scale * FLASH_LOG2E;
    const int ntiles = (T - s_first + QT - 1) / QT;  // s_first < T: the grid has ceil(T / 128) key blocks
    // K's 128 rows staged in buffer 0, V's in buffer 1
    copy_rows<HS, LD, NT>(&qd[0][0][0], k, s_first, FLASH4_ROWS, T, ld);
    copy_rows<HS, LD, NT>(&qd[1][0][0], v, s_first, FLASH4_ROWS, T, ld);
    copy_commit();
    copy_wait<0>();
    __syncthreads();
    mma_rows<H> kf[HS / 16], vf[HS / 16];
#pragma unroll
    for (int kk = 0; kk < HS / 16; kk++) {
        mma_rows_load<H>(kf[kk], &qd[0][16 * warp][16 * kk], LD);
        mma_rows_load<H>(vf[kk], &qd[1][16 * warp][16 * kk], LD);
    }
    __syncthreads();  // every warp holds its rows: the staging buffers are free
    // query tile i (queries s_first + QT i ...) into buffer i % 2: Q, dO, lse, delta (zeros past T)
    auto issue = [&](int i) {
        const int tq0 = s_first + i * QT, bb = i % 2;
        copy_rows<HS, LD, NT>(&qd[bb][0][0], q, tq0, QT, T, ld);
        copy_rows<HS, LD, NT>(&qd[bb][QT][0], dout, tq0, QT, T, ld_do);
        for (int x = threadIdx.x; x < 2 * QT; x += NT > 0 ? NT : blockDim.x) {  // v6: one pass
            int c = x % QT, ok = tq0 + c < T;
            const float* src = x < QT ? lse : delta;
            copy4_async(&ld_s[bb][x / QT][c], ok ? src + tq0 + c : src, ok);
        }
        copy_commit();
    };
    issue(0);
    mma_tile dkt[HS / 16], dvt[HS / 16];
#pragma unroll
    for (int j = 0; j < HS / 16; j++) {
        zero_tile(dkt[j]);
        zero_tile(dvt[j]);
    }
    for (int it = 0; it < ntiles; it++) {
        const int t0 = s_first + it * QT, b = it % 2;
        copy_wait<0>();
        __syncthreads();  // tile it is in buffer b; every warp is done with buffer 1 - b
        if (it + 1 < ntiles) issue(it + 1);
        if (t0 + QT - 1 < sw) continue;  // every query of the tile is before this warp's keys
        const unsigned short(*qs)[LD] = qd[b];
        const unsigned short(*ds)[LD] = qd[b] + QT;
        const float* lse_s = ld_s[b][0];
        const float* del_s = ld_s[b][1];
        mma_tile st[QT / 16], dpt[QT / 16];
#pragma unroll
        for (int n = 0; n < QT / 16; n++) {
            zero_tile(st[n]);
            zero_tile(dpt[n]);
        }
#pragma unroll
        for (int i = 0; i < QT / 16 * (HS / 16); i++) {  // v6: k-step outer; v4, v5: query block n outer
            const int n = FAST ? i % (QT / 16) : i / (HS / 16), kk = FAST ? i / (QT / 16) : i % (HS / 16);
            mma_rows_run<H>(st[n], kf[kk], &qs[16 * n][16 * kk], LD);
            mma_rows_run<H>(dpt[n], vf[kk], &ds[16 * n][16 * kk], LD);
        }
        if (LEAN) {
            // v5: only a tile that crosses the diagonal is masked (S^T = -inf, p = 0). Queries past T need no mask:
            // their Q and dO rows are zeros and lse, delta 0, so p = 1 meets dO = 0 (no dV) and dP = 0 gives dS = 0
            if (t0 < sw + 15)
#pragma unroll
                for (int n = 0; n < QT / 16; n++)
#pragma unroll
                    for (int e = 0; e < MMA_SE; e++)
                        if (t0 + 16 * n + mma_tile_col(e) < sw + mma_tile_row(e)) st[n].x[e] = FLASH_NEG_INF;
#pragma unroll
            for (int n = 0; n < QT / 16; n++)
#pragma unroll
                for (int e = 0; e < MMA_SE; e++) {
                    const int c = 16 * n + mma_tile_col(e);
                    float p = exp2_fast(fmaf(st[n].x[e], sl2, lse_s[c] * -FLASH_LOG2E));
                    st[n].x[e] = p;
                    dpt[n].x[e] = p * (dpt[n].x[e] - del_s[c]);  // dS^T
                }
        } else {
#pragma unroll
            for (int n = 0; n < QT / 16; n++)
#pragma unroll
                for (int e = 0; e < MMA_SE; e++) {
                    int c = 16 * n + mma_tile_col(e), tq = t0 + c;
                    bool keep = tq >= sw + mma_tile_row(e) && tq < T;
                    float p = keep ? exp2f(st[n].x[e] * sl2 - lse_s[c] * FLASH_LOG2E) : 0.0f;
                    st[n].x[e] = p;
                    dpt[n].x[e] = p * (dpt[n].x[e] - del_s[c]);  // dS^T
                }
        }
#pragma unroll
        for (int kk = 0; kk < QT / 16; kk++) {
            mma_packed<H> pp, pd;
            if (LEAN) {
                mma_pack_rn<H>(pp, st[kk]);
                mma_pack_rn<H>(pd, dpt[kk]);
            } else {
                mma_pack<H>(pp, st[kk], RoundTo<H>());
                mma_pack<H>(pd, dpt[kk], RoundTo<H>());
            }
#pragma unroll
            for (int j = 0; j < HS / 16; j++) {
                mma_packed_run<H>(dvt[j], pp, &ds[16 * kk][16 * j], LD);
                mma_packed_run<H>(dkt[j], pd, &qs[16 * kk][16 * j], LD);
            }
        }
    }
    store_tiles_ld<H, HS, FAST>(dk, dkt, sw, T, scale, ld_grad);
    store_tiles_ld<H, HS, FAST>(dv, dvt, sw, T, 1.0f, ld_grad);
}

// ---- v4's, v5's and v6's entry points: one per format, head size and layout (parts 4, 5, 6) -------------------------
// v4's, v5's and v6's entry points (LV = 0, 1, 2) declare their block size (__launch_bounds__): the compilers may then give a
// thread the registers that size leaves (AMD's default assumes 1024 threads).
#define FLASH_ENTRIES_V4(HS, FMT, H, V, LV)                                                                         \
    extern "C" __global__ void __launch_bounds__(FLASH4_WARPS * MMA_WARP) flash_attention_forward_##V##_hs##HS##_##FMT(\
        const unsigned short* q, const unsigned short* k, const unsigned short* v, float* out, float* lse, int T,     \
        float scale) {                                                                                                \
        flash_forward_v4<H, HS, LV>(q, k, v, out, lse, T, scale, 1, HS, HS);                                        \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(FLASH4_DKDV_WARPS * MMA_WARP)                                        \
        flash_attention_backward_##V##_dkdv_hs##HS##_##FMT(const unsigned short* q, const unsigned short* k,          \
                                                        const unsigned short* v, const unsigned short* dout,          \
                                                        const float* lse, const float* delta, float* dk, float* dv,   \
                                                        int T, float scale) {                                         \
        flash_dkdv_v4<H, HS, LV>(q, k, v, dout, lse, delta, dk, dv, T, scale, 1, HS, HS, HS);                       \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(FLASH4_WARPS * MMA_WARP) flash_attention_backward_##V##_dq_hs##HS##_##FMT(\
        const unsigned short* q, const unsigned short* k, const unsigned short* v, const float* out,                  \
        const unsigned short* dout, const float* lse, float* delta, float* dq, int T, float scale) {                  \
        flash_dq_v4<H, HS, LV>(q, k, v, out, dout, lse, delta, dq, T, scale, 1, HS, HS, HS, HS);                      \
    }

// the packed layout (see v4's Layouts): qkv (B, T, 3C) and out, dout (B, T, C) in format H, dqkv (B, T, 3C) float32,
// C = nh HS; lse and delta (B, nh, T) as in the heads layout
#define FLASH_ENTRIES_PACKED(HS, FMT, H, V, LV)                                                                     \
    extern "C" __global__ void __launch_bounds__(FLASH4_WARPS * MMA_WARP)                            \
        flash_attention_forward_##V##_packed_hs##HS##_##FMT(const unsigned short* qkv, unsigned short* out, float* lse,\
                                                         int T, int nh, float scale) {                                \
        const int C = nh * HS;                                                                                        \
        flash_forward_v4<H, HS, LV>(qkv, qkv + C, qkv + 2 * C, out, lse, T, scale, nh, 3 * C, C);                   \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(FLASH4_DKDV_WARPS * MMA_WARP)                      \
        flash_attention_backward_##V##_packed_dkdv_hs##HS##_##FMT(const unsigned short* qkv, const unsigned short* dout,\
                                                               const float* lse, const float* delta, float* dqkv,     \
                                                               int T, int nh, float scale) {                          \
        const int C = nh * HS;                                                                                        \
        flash_dkdv_v4<H, HS, LV>(qkv, qkv + C, qkv + 2 * C, dout, lse, delta, dqkv + C, dqkv + 2 * C, T, scale, nh, \
                                   3 * C, C, 3 * C);                                                                  \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(FLASH4_WARPS * MMA_WARP)                             \
        flash_attention_backward_##V##_packed_dq_hs##HS##_##FMT(const unsigned short* qkv, const unsigned short* out, \
                                                             const unsigned short* dout, const float* lse,            \
                                                             float* delta, float* dqkv, int T, int nh, float scale) { \
        const int C = nh * HS;                                                                                        \
        flash_dq_v4<H, HS, LV>(qkv, qkv + C, qkv + 2 * C, out, dout, lse, delta, dqkv, T, scale, nh, 3 * C, C, C,     \
                               3 * C);                                                                                \
    }
// v6 on the packed layout with dqkv (B, T, 3C) in format H instead of float32 (_hg: half gradients): each of dq, dk,
// dv rounded once from the float32 sums the float32 entry points write, so the result is those entry points' rounded
// to format H, bit for bit; the products that read dqkv take it as it is (no conversion pass)
#define FLASH_ENTRIES_PACKED_HG(HS, FMT, H, V, LV)                                                                  \
    extern "C" __global__ void __launch_bounds__(FLASH4_DKDV_WARPS * MMA_WARP)                                        \
        flash_attention_backward_##V##_packed_hg_dkdv_hs##HS##_##FMT(                                                 \
            const unsigned short* qkv, const unsigned short* dout, const float* lse, const float* delta,              \
            unsigned short* dqkv, int T, int nh, float scale) {                                                      \
        const int C = nh * HS;                                                                                        \
        flash_dkdv_v4<H, HS, LV>(qkv, qkv + C, qkv + 2 * C, dout, lse, delta, dqkv + C, dqkv + 2 * C, T, scale, nh, \
                                   3 * C, C, 3 * C);                                                                  \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(FLASH4_WARPS * MMA_WARP)                                             \
        flash_attention_backward_##V##_packed_hg_dq_hs##HS##_##FMT(                                                   \
            const unsigned short* qkv, const unsigned short* out, const unsigned short* dout, const float* lse,       \
            float* delta, unsigned short* dqkv, int T, int nh, float scale) {                                         \
        const int C = nh * HS;                                                                                        \
        flash_dq_v4<H, HS, LV>(qkv, qkv + C, qkv + 2 * C, out, dout, lse, delta, dqkv, T, scale, nh, 3 * C, C, C,     \
                               3 * C);                                                                                \
    }
#if FLASH_PART(4, 1)  // v4, bf16
FLASH_ENTRIES_V4(16, bf16, 1, v4, 0)
FLASH_ENTRIES_PACKED(16, bf16, 1, v4, 0)
FLASH_ENTRIES_V4(32, bf16, 1, v4, 0)
FLASH_ENTRIES_PACKED(32, bf16, 1, v4, 0)
FLASH_ENTRIES_V4(48, bf16, 1, v4, 0)
FLASH_ENTRIES_PACKED(48, bf16, 1, v4, 0)
FLASH_ENTRIES_V4(64, bf16, 1, v4, 0)
FLASH_ENTRIES_PACKED(64, bf16, 1, v4, 0)
#endif
#if FLASH_PART(4, 2)  // v4, f16
FLASH_ENTRIES_V4(16, f16, 2, v4, 0)
FLASH_ENTRIES_PACKED(16, f16, 2, v4, 0)
FLASH_ENTRIES_V4(32, f16, 2, v4, 0)
FLASH_ENTRIES_PACKED(32, f16, 2, v4, 0)
FLASH_ENTRIES_V4(48, f16, 2, v4, 0)
FLASH_ENTRIES_PACKED(48, f16, 2, v4, 0)
FLASH_ENTRIES_V4(64, f16, 2, v4, 0)
FLASH_ENTRIES_PACKED(64, f16, 2, v4, 0)
#endif
#if FLASH_PART(5, 1)  // v5, bf16
FLASH_ENTRIES_V4(16, bf16, 1, v5, 1)
FLASH_ENTRIES_PACKED(16, bf16, 1, v5, 1)
FLASH_ENTRIES_V4(32, bf16, 1, v5, 1)
FLASH_ENTRIES_PACKED(32, bf16, 1, v5, 1)
FLASH_ENTRIES_V4(48, bf16, 1, v5, 1)
FLASH_ENTRIES_PACKED(48, bf16, 1, v5, 1)
FLASH_ENTRIES_V4(64, bf16, 1, v5, 1)
FLASH_ENTRIES_PACKED(64, bf16, 1, v5, 1)
#endif
#if FLASH_PART(5, 2)  // v5, f16
FLASH_ENTRIES_V4(16, f16, 2, v5, 1)
FLASH_ENTRIES_PACKED(16, f16, 2, v5, 1)
FLASH_ENTRIES_V4(32, f16, 2, v5, 1)
FLASH_ENTRIES_PACKED(32, f16, 2, v5, 1)
FLASH_ENTRIES_V4(48, f16, 2, v5, 1)
FLASH_ENTRIES_PACKED(48, f16, 2, v5, 1)
FLASH_ENTRIES_V4(64, f16, 2, v5, 1)
FLASH_ENTRIES_PACKED(64, f16, 2, v5, 1)
#endif
#if FLASH_PART(6, 1)  // v6, bf16
FLASH_ENTRIES_V4(16, bf16, 1, v6, 2)
FLASH_ENTRIES_PACKED(16, bf16, 1, v6, 2)
FLASH_ENTRIES_PACKED_HG(16, bf16, 1, v6, 2)
FLASH_ENTRIES_V4(32, bf16, 1, v6, 2)
FLASH_ENTRIES_PACKED(32, bf16, 1, v6, 2)
FLASH_ENTRIES_PACKED_HG(32, bf16, 1, v6, 2)
FLASH_ENTRIES_V4(48, bf16, 1, v6, 2)
FLASH_ENTRIES_PACKED(48, bf16, 1, v6, 2)
FLASH_ENTRIES_PACKED_HG(48, bf16, 1, v6, 2)
FLASH_ENTRIES_V4(64, bf16, 1, v6, 2)
FLASH_ENTRIES_PACKED(64, bf16, 1, v6, 2)
FLASH_ENTRIES_PACKED_HG(64, bf16, 1, v6, 2)
#endif
#if FLASH_PART(6, 2)  // v6, f16
FLASH_ENTRIES_V4(16, f16, 2, v6, 2)
FLASH_ENTRIES_PACKED(16, f16, 2, v6, 2)
FLASH_ENTRIES_PACKED_HG(16, f16, 2, v6, 2)
FLASH_ENTRIES_V4(32, f16, 2, v6, 2)
FLASH_ENTRIES_PACKED(32, f16, 2, v6, 2)
FLASH_ENTRIES_PACKED_HG(32, f16, 2, v6, 2)
FLASH_ENTRIES_V4(48, f16, 2, v6, 2)
FLASH_ENTRIES_PACKED(48, f16, 2, v6, 2)
FLASH_ENTRIES_PACKED_HG(48, f16, 2, v6, 2)
FLASH_ENTRIES_V4(64, f16, 2, v6, 2)
FLASH_ENTRIES_PACKED(64, f16, 2, v6, 2)
FLASH_ENTRIES_PACKED_HG(64, f16, 2, v6, 2)
#endif

// ==== v5 fused: v5's backward in one kernel (fused=True; slower than the two on the H200, lesson 11) =================
// The LEAN dK dV kernel also computes dQ, so S and dP are computed once instead of twice (five products per tile pair
// instead of seven), as FlashAttention-2's backward does. A block owns 128 key rows (16 per warp, 8 warps) and walks
// the query tiles of 64 rows from its first key on; per tile, after v4's dK dV work:
//   - each warp writes its rounded dS^T (16 keys x 64 queries) to shared memory, beside K's 128 rows kept there;
//   - the block multiplies dQ_tile = dS K (64 queries x HS), each warp one or two 16 x 16 output tiles, summing over
//     the block's keys in order;
//   - and adds it into dq. Several key blocks add into the same query rows; FlashAttention-2 uses float atomics
//     there, whose order (and so the bits) changes from run to run. Here the key blocks of a head take turns in a
//     fixed order: an int per (head, query tile), zeroed by the launcher, counts the key blocks that have added;
//     block j waits until it reads j, then adds with atomicAdd (block 0 stores), whose result it never reads; the
//     adds of one address are done at L2 one after the other, block j's after block j - 1's, so the sum has the
//     same order, and the same bits, on every run. The block passes the turn on (a fence, then the counter + 1)
//     after its next tile's products, by when its adds have long been sent; the counter is read before the products
//     too, so the wait seldom costs anything. The wait relies on the GPU starting blocks in the order of their index
//     (every block a block waits for has a smaller one: blockIdx.y is the key block), as FlashAttention-3's
//     deterministic backward and CUTLASS's semaphores do.
// Shared memory is dynamic (the bytes backends/hip/flash.py's _fused_smem counts): Q and dO tiles (FLASH5_BUFS buffers: double-buffered
// where copies are asynchronous, NVIDIA; one on AMD, whose copies return done and whose LDS holds 64 KiB), K, dS^T,
// lse and delta.
// It builds on the v4 section's helpers (FLASH4_*, copy_rows, head_start, store_tiles_ld).
#if GPULLM_HIP
#define FLASH5_BUFS 1
#else
#define FLASH5_BUFS 2
#endif
#define FLASH5_QT 64  // query rows per tile walked

// one thread waits until the counter at s reaches value, then fences: what the blocks that counted wrote before
// their turn passed is visible to it (and, after a __syncthreads, to its block)
__device__ __forceinline__ void sem_wait(const int* s, int value) {
    while (*reinterpret_cast<const volatile int*>(s) < value) {
    }
    __threadfence();
}
// one thread passes the turn on: the block's writes and adds, ordered before it by a __syncthreads, reach the GPU
// before the counter moves
__device__ __forceinline__ void pass_turn(int* s) {
    __threadfence();
    atomicAdd(s, 1);
}

template <int H, int HS>
__device__ void flash_bwd_fused_v5(const unsigned short* __restrict__ q, const unsigned short* __restrict__ k,
                                   const unsigned short* __restrict__ v, const unsigned short* __restrict__ dout,
                                   const float* __restrict__ lse, const float* __restrict__ delta, float* __restrict__ dq,
                                   float* __restrict__ dk, float* __restrict__ dv, int* __restrict__ sem, int T,
                                   float scale, int nh, int ld, int ld_do, int ld_grad) {
    constexpr int LD = HS + FLASH_PAD, QT = FLASH5_QT, NB = FLASH5_BUFS, KR = FLASH4_ROWS, LDS = QT + FLASH_PAD;
    constexpr int DQ_TILES = 4 * HS / 16, DQ_PER_WARP = (DQ_TILES + FLASH4_DKDV_WARPS - 1) / FLASH4_DKDV_WARPS;
    static_assert(QT == 64 && 16 * FLASH4_DKDV_WARPS == KR && 2 * QT == KR, "8 warps of 16 keys, tiles of 64 queries");
    extern __shared__ __align__(16) unsigned char flash_smem[];
    typedef unsigned short RowH[LD];
    typedef unsigned short RowS[LDS];
    RowH* qd = reinterpret_cast<RowH*>(flash_smem);            // [NB][Q's QT rows, then dO's QT rows]
    RowH* ks = qd + NB * 2 * QT;                                // K's 128 rows
    RowS* dss = reinterpret_cast<RowS*>(ks + KR);               // dS^T: 128 keys x QT queries, format H
    float* ld_s = reinterpret_cast<float*>(dss + KR);           // [NB][lse, delta][QT]
    const long long head = blockIdx.x, in0 = head_start<HS>(T, nh, ld), g0 = head_start<HS>(T, nh, ld_grad);
    q += in0;
    k += in0;
    v += in0;
    dout += head_start<HS>(T, nh, ld_do);
    dq += g0;
    dk += g0;
    dv += g0;
    lse += head * T;
    delta += head * T;
    const int nqt = (T + QT - 1) / QT;
    sem += head * nqt;
    const int warp = threadIdx.x / warpSize;
    const int s_first = blockIdx.y * KR, sw = s_first + 16 * warp;  // key block 0 (the longest walk) first
    const float sl2 = scale * FLASH_LOG2E;
    const int ntiles = (T - s_first + QT - 1) / QT;  // s_first < T: the grid has ceil(T / 128) key blocks
    // K's 128 rows into their place, V's staged in buffer 0 (2 QT = 128 rows)
    copy_rows<HS, LD, 0>(&ks[0][0], k, s_first, KR, T, ld);
    copy_rows<HS, LD, 0>(&qd[0][0], v, s_first, KR, T, ld);
    copy_commit();
    copy_wait<0>();
    __syncthreads();
    mma_rows<H> vf[HS / 16];
#pragma unroll
    for (int kk = 0; kk < HS / 16; kk++) mma_rows_load<H>(vf[kk], &qd[16 * warp][16 * kk], LD);
    __syncthreads();  // every warp holds its V rows: buffer 0 is free
    auto issue = [&](int i) {  // query tile i (queries s_first + QT i ...) into buffer i % NB: Q, dO, lse, delta
        const int tq0 = s_first + i * QT, bb = i % NB;
        copy_rows<HS, LD, 0>(&qd[bb * 2 * QT][0], q, tq0, QT, T, ld);
        copy_rows<HS, LD, 0>(&qd[bb * 2 * QT + QT][0], dout, tq0, QT, T, ld_do);
        for (int x = threadIdx.x; x < 2 * QT; x += blockDim.x) {
            int c = x % QT, ok = tq0 + c < T;
            const float* src = x < QT ? lse : delta;
            copy4_async(&ld_s[(bb * 2 + x / QT) * QT + c], ok ? src + tq0 + c : src, ok);
        }
        copy_commit();
    };
    issue(0);
    mma_tile dkt[HS / 16], dvt[HS / 16];
#pragma unroll
    for (int j = 0; j < HS / 16; j++) {
        zero_tile(dkt[j]);
        zero_tile(dvt[j]);
    }
    int* posted = nullptr;  // the turn counter this block has added for and not yet passed on
    for (int it = 0; it < ntiles; it++) {
        const int t0 = s_first + it * QT, b = it % NB;
        copy_wait<0>();
        __syncthreads();  // tile it is in buffer b; with two buffers every warp is done with the other one
        if (NB == 2 && it + 1 < ntiles) issue(it + 1);
        const RowH* qs = qd + b * 2 * QT;
        const RowH* ds = qs + QT;
        const float* lse_s = ld_s + b * 2 * QT;
        const float* del_s = lse_s + QT;
        // thread 0 reads this tile's turn counter now, to know by the time of the adds whether it must wait
        int seen = threadIdx.x == 0 && blockIdx.y > 0 ? *reinterpret_cast<const volatile int*>(sem + t0 / QT) : 0;
        if (t0 + QT - 1 >= sw) {  // some query of the tile is at or after this warp's first key
            mma_tile st[QT / 16], dpt[QT / 16];
#pragma unroll
            for (int n = 0; n < QT / 16; n++) {
                zero_tile(st[n]);
                zero_tile(dpt[n]);
            }
#pragma unroll
            for (int kk = 0; kk < HS / 16; kk++) {
                mma_rows<H> kf;  // K's rows from shared memory (kept there for dQ)
                mma_rows_load<H>(kf, &ks[16 * warp][16 * kk], LD);
#pragma unroll
                for (int n = 0; n < QT / 16; n++) {
                    mma_rows_run<H>(st[n], kf, &qs[16 * n][16 * kk], LD);
                    mma_rows_run<H>(dpt[n], vf[kk], &ds[16 * n][16 * kk], LD);
                }
            }
            if (t0 < sw + 15)  // the tile crosses the diagonal: mask (see v4's dK dV)
#pragma unroll
                for (int n = 0; n < QT / 16; n++)
#pragma unroll
                    for (int e = 0; e < MMA_SE; e++)
                        if (t0 + 16 * n + mma_tile_col(e) < sw + mma_tile_row(e)) st[n].x[e] = FLASH_NEG_INF;
#pragma unroll
            for (int n = 0; n < QT / 16; n++)
#pragma unroll
                for (int e = 0; e < MMA_SE; e++) {
                    const int c = 16 * n + mma_tile_col(e);
                    float p = exp2_fast(fmaf(st[n].x[e], sl2, lse_s[c] * -FLASH_LOG2E));
                    st[n].x[e] = p;
                    dpt[n].x[e] = p * (dpt[n].x[e] - del_s[c]);  // dS^T
                }
#pragma unroll
            for (int kk = 0; kk < QT / 16; kk++) {
                mma_packed<H> pp, pd;
                mma_pack_rn<H>(pp, st[kk]);
                mma_pack_rn<H>(pd, dpt[kk]);
                mma_packed_store<H>(&dss[16 * warp][16 * kk], pd, LDS);
#pragma unroll
                for (int j = 0; j < HS / 16; j++) {
                    mma_packed_run<H>(dvt[j], pp, &ds[16 * kk][16 * j], LD);
                    mma_packed_run<H>(dkt[j], pd, &qs[16 * kk][16 * j], LD);
                }
            }
        }
        if (threadIdx.x == 0 && posted) pass_turn(posted);  // the previous tile's (its adds came before the barrier above)
        posted = nullptr;
        __syncthreads();  // dS^T of every warp that has keys at or before the tile's queries is in shared memory
        // dQ_tile = dS K over the key chunks (16 keys, one warp's) that reach the tile: output tile u of this warp is
        // rows 16 (tile % 4), columns 16 (tile / 4), tile = warp + 8 u
        const int nk = min(KR / 16, (t0 + QT - 1 - s_first) / 16 + 1);
        const int r = warp % 4;
        mma_tile acc[DQ_PER_WARP];
#pragma unroll
        for (int u = 0; u < DQ_PER_WARP; u++) zero_tile(acc[u]);
        for (int c = 0; c < nk; c++) {
            mma_packed<H> pk;
            mma_packed_load_t<H>(pk, &dss[16 * c][16 * r], LDS);
#pragma unroll
            for (int u = 0; u < DQ_PER_WARP; u++) {
                const int tile = warp + FLASH4_DKDV_WARPS * u;
                if (tile < DQ_TILES) {
                    mma_vfrag<H> kf;
                    mma_vfrag_load<H>(kf, &ks[16 * c][16 * (tile / 4)], LD);
                    mma_packed_mul<H>(acc[u], pk, kf);
                }
            }
        }
        // the fixed order: key block j adds to this query tile after blocks 0 .. j - 1 have (the counter was read
        // before this tile's products: usually it has long reached j). Their adds were done at L2 before the counter
        // moved (their fence); ours are sent after thread 0 has read it (the barrier), so they come after theirs.
        int* turn = sem + t0 / QT;
        if (threadIdx.x == 0 && seen < (int)blockIdx.y) sem_wait(turn, blockIdx.y);
        __syncthreads();
#pragma unroll
        for (int u = 0; u < DQ_PER_WARP; u++) {
            const int tile = warp + FLASH4_DKDV_WARPS * u;
            if (tile < DQ_TILES)
#pragma unroll
                for (int e = 0; e < MMA_SE; e++) {
                    const int row = t0 + 16 * r + mma_tile_row(e);
                    float* dst = dq + (long long)row * ld_grad + 16 * (tile / 4) + mma_tile_col(e);
                    if (row < T) {
                        if (blockIdx.y == 0) *dst = acc[u].x[e] * scale;  // the first block stores,
                        else atomicAdd(dst, acc[u].x[e] * scale);         // the others add in turn (no result read)
                    }
                }
        }
        posted = turn;  // the turn passes after the next tile's products, when these adds have long been sent
        if (NB == 1 && it + 1 < ntiles) issue(it + 1);
    }
    __syncthreads();  // every thread's adds of the last tile were sent
    if (threadIdx.x == 0 && posted) pass_turn(posted);
    store_tiles_ld<H, HS, false>(dk, dkt, sw, T, scale, ld_grad);
    store_tiles_ld<H, HS, false>(dv, dvt, sw, T, 1.0f, ld_grad);
}

// ---- v5's fused entry points: one per format, head size and layout (part 5) -----------------------------------------
// v5's backward in one kernel, on both layouts; sem: an int per (head, query tile of 64), zeroed before the launch
#define FLASH_ENTRIES_FUSED(HS, FMT, H)                                                                               \
    extern "C" __global__ void __launch_bounds__(FLASH4_DKDV_WARPS * MMA_WARP)                                        \
        flash_attention_backward_v5_fused_hs##HS##_##FMT(const unsigned short* q, const unsigned short* k,            \
                                                      const unsigned short* v, const unsigned short* dout,            \
                                                      const float* lse, const float* delta, float* dq, float* dk,     \
                                                      float* dv, int* sem, int T, float scale) {                      \
        flash_bwd_fused_v5<H, HS>(q, k, v, dout, lse, delta, dq, dk, dv, sem, T, scale, 1, HS, HS, HS);               \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(FLASH4_DKDV_WARPS * MMA_WARP)                                        \
        flash_attention_backward_v5_fused_packed_hs##HS##_##FMT(const unsigned short* qkv, const unsigned short* dout,\
                                                             const float* lse, const float* delta, float* dqkv,       \
                                                             int* sem, int T, int nh, float scale) {                  \
        const int C = nh * HS;                                                                                        \
        flash_bwd_fused_v5<H, HS>(qkv, qkv + C, qkv + 2 * C, dout, lse, delta, dqkv, dqkv + C, dqkv + 2 * C, sem, T,  \
                                  scale, nh, 3 * C, C, 3 * C);                                                        \
    }
#if FLASH_PART(5, 1)  // v5, bf16
FLASH_ENTRIES_FUSED(16, bf16, 1)
FLASH_ENTRIES_FUSED(32, bf16, 1)
FLASH_ENTRIES_FUSED(48, bf16, 1)
FLASH_ENTRIES_FUSED(64, bf16, 1)
#endif
#if FLASH_PART(5, 2)  // v5, f16
FLASH_ENTRIES_FUSED(16, f16, 2)
FLASH_ENTRIES_FUSED(32, f16, 2)
FLASH_ENTRIES_FUSED(48, f16, 2)
FLASH_ENTRIES_FUSED(64, f16, 2)
#endif

// ==== delta: the backward's delta pass (v2 to v5), in every part =====================================================
// flash_common.h's flash_delta: delta = the row sums of dout * out, before the dK dV and dQ kernels: out float32
// (the heads layout, v2 to v5) or format H (the packed layout, v4 and v5). v6's dQ kernel computes delta itself.
// Outside every FLASH_PART block: each part compiles them.
extern "C" __global__ void flash_attention_backward_v2_delta_bf16(const float* out, const unsigned short* dout,
                                                                  float* delta, long long rows, int hs) {
    flash_delta<1, false>(out, dout, delta, rows, hs, 1, 1);
}
extern "C" __global__ void flash_attention_backward_v2_delta_f16(const float* out, const unsigned short* dout,
                                                                 float* delta, long long rows, int hs) {
    flash_delta<2, false>(out, dout, delta, rows, hs, 1, 1);
}

extern "C" __global__ void flash_attention_backward_v4_packed_delta_bf16(const unsigned short* out,
                                                                      const unsigned short* dout, float* delta,
                                                                      long long rows, int hs, int T, int nh) {
    flash_delta<1, true>(out, dout, delta, rows, hs, T, nh);
}
extern "C" __global__ void flash_attention_backward_v4_packed_delta_f16(const unsigned short* out,
                                                                     const unsigned short* dout, float* delta,
                                                                     long long rows, int hs, int T, int nh) {
    flash_delta<2, true>(out, dout, delta, rows, hs, T, nh);
}
