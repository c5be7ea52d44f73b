// flash_v7.cu: flash attention v7's backward dK dV on Hopper's warpgroup products (wgmma.h). NVIDIA sm_90a only.
//
// The math is v6's (kernels/hip/flash.cu, flash_dkdv_v4): a block owns a block of key rows and walks the query tiles
// from its first key on; per tile S^T = K Q^T and dP^T = V dO^T, P^T = exp(scale S^T - lse) (zero where a query is
// before its key), dS^T = P^T (dP^T - delta); dV += P^T dO and dK += dS^T Q accumulate in registers, dK times scale
// at the end. What changes is who multiplies: one warpgroup (4 warps, 128 threads) owns 64 key rows, and each product
// is four wgmma instructions of 64 x 64 x 16 instead of a warp's many 16 x 8 x 16 mma.sync:
//   K and V are A operands kept in registers for the whole walk (load_a_fragment, once);
//   Q and dO are staged in shared memory twice each, as rows (the B of S^T and dP^T) and transposed (the B of dK
//     and dV), in wgmma.h's core-matrix layout;
//   P^T and dS^T go from the accumulators of S^T and dP^T straight into the A registers of dV's and dK's products
//     (d_to_a): the accumulator's layout is the A fragment's, column pair by column pair.
// The packed layout of the engine: qkv (B, T, 3C) and dout (B, T, C) bf16 bits, lse and delta (B, nh, T) float32
// (lse the natural log of each query's sum; delta rowsum(dO o O), which v6's dQ kernel writes), dqkv (B, T, 3C)
// float32 of which this kernel writes dk (columns C ..) and dv (2C ..). Head size 64, T a multiple of 64 (the
// launcher checks).
#include "wgmma.h"

#define V7_HS 64
#define V7_LOG2E 1.4426950408889634f
#define V7_NEG_INF (-__int_as_float(0x7f800000))

// two floats rounded to bf16 (to nearest even) in one register, lo in the low half
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    uint32_t r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// A 64 x 64 accumulator (wgmma.h's D layout) as the A fragments of four k16 steps, rounded to bf16: step s takes the
// column chunks 2s and 2s + 1, which hold exactly the elements load_a_fragment would put in its four registers.
__device__ __forceinline__ void d_to_a(uint32_t (*a)[4], const float* d) {
    for (int s = 0; s < 4; ++s) {
        const float* e = d + 8 * s;
        a[s][0] = pack_bf16(e[0], e[1]);
        a[s][1] = pack_bf16(e[2], e[3]);
        a[s][2] = pack_bf16(e[4], e[5]);
        a[s][3] = pack_bf16(e[6], e[7]);
    }
}

extern "C" __global__ void __launch_bounds__(128)
    flash_attention_backward_v7_packed_dkdv_hs64_bf16(const uint16_t* __restrict__ qkv,
                                                      const uint16_t* __restrict__ dout,
                                                      const float* __restrict__ lse, const float* __restrict__ delta,
                                                      float* __restrict__ dqkv, int T, int nh, float scale) {
    __shared__ __align__(128) uint16_t sq[WG_TILE * WG_TILE];    // Q's tile, rows = queries (B of S^T)
    __shared__ __align__(128) uint16_t sqt[WG_TILE * WG_TILE];   // Q's tile transposed, rows = dims (B of dK)
    __shared__ __align__(128) uint16_t sdo[WG_TILE * WG_TILE];   // dO's tile, rows = queries (B of dP^T)
    __shared__ __align__(128) uint16_t sdot[WG_TILE * WG_TILE];  // dO's tile transposed (B of dV)
    __shared__ float s_lse[WG_TILE], s_del[WG_TILE];             // the tile's lse (times log2 e) and delta
    const long head = blockIdx.x, b = head / nh, h = head % nh, C = static_cast<long>(nh) * V7_HS, ld = 3 * C;
    const uint16_t* q = qkv + b * T * ld + h * V7_HS;
    const uint16_t* k = q + C;
    const uint16_t* v = q + 2 * C;
    const uint16_t* dO = dout + b * T * C + h * V7_HS;
    float* dk = dqkv + b * T * ld + h * V7_HS + C;
    float* dv = dk + C;
    lse += head * T;
    delta += head * T;
    const long s0 = static_cast<long>(blockIdx.y) * WG_TILE;  // key block 0 (the longest walk) first
    const uint32_t sbo = WG_TILE * 16;
    const float sl2 = scale * V7_LOG2E;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    uint32_t kf[4][4], vf[4][4];
    for (int s = 0; s < 4; ++s) {
        load_a_fragment(kf[s], k, ld, s0, 16 * s);
        load_a_fragment(vf[s], v, ld, s0, 16 * s);
    }
    float dK[32], dV[32];
    for (int i = 0; i < 32; ++i) dK[i] = dV[i] = 0.0f;
    for (long t0 = s0; t0 < T; t0 += WG_TILE) {
        __syncthreads();  // every thread's products of the previous tile are done with the buffers
        stage_tile(sq, q, ld, t0, 0, 0);
        stage_tile(sqt, q, ld, 0, t0, 1);
        stage_tile(sdo, dO, C, t0, 0, 0);
        stage_tile(sdot, dO, C, 0, t0, 1);
        if (threadIdx.x < WG_TILE) {
            s_lse[threadIdx.x] = lse[t0 + threadIdx.x] * V7_LOG2E;
            s_del[threadIdx.x] = delta[t0 + threadIdx.x];
        }
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();
        float S[32], dP[32];
        for (int i = 0; i < 32; ++i) S[i] = dP[i] = 0.0f;
        fence_operands(S);
        fence_operands(dP);
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
        for (int s = 0; s < 4; ++s) {
            wgmma_64x64x16_rs(S, kf[s], smem_desc(sq + s * 128, 128, sbo));
            wgmma_64x64x16_rs(dP, vf[s], smem_desc(sdo + s * 128, 128, sbo));
        }
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        fence_operands(S);
        fence_operands(dP);
        // element i = 4j + e of a thread's accumulators: key row s0 + 16 warp + lane/4 + 8 (e/2), query
        // t0 + 8j + 2 (lane%4) + e%2
        for (int i = 0; i < 32; ++i) {
            const int row = 16 * warp + lane / 4 + 8 * ((i % 4) / 2), col = 8 * (i / 4) + 2 * (lane % 4) + i % 2;
            const float p = t0 + col >= s0 + row ? exp2f(fmaf(S[i], sl2, -s_lse[col])) : 0.0f;
            S[i] = p;
            dP[i] = p * (dP[i] - s_del[col]);
        }
        uint32_t pa[4][4], da[4][4];
        d_to_a(pa, S);
        d_to_a(da, dP);
        fence_operands(dK);
        fence_operands(dV);
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
        for (int s = 0; s < 4; ++s) {
            wgmma_64x64x16_rs(dV, pa[s], smem_desc(sdot + s * 128, 128, sbo));
            wgmma_64x64x16_rs(dK, da[s], smem_desc(sqt + s * 128, 128, sbo));
        }
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        fence_operands(dK);
        fence_operands(dV);
    }
    for (int i = 0; i < 32; ++i) {
        const long row = s0 + 16 * warp + lane / 4 + 8 * ((i % 4) / 2), col = 8 * (i / 4) + 2 * (lane % 4) + i % 2;
        dk[row * ld + col] = dK[i] * scale;
        dv[row * ld + col] = dV[i];
    }
}

// dQ (and delta): a block owns 64 query rows and walks the key tiles up to its own; per tile S = Q K^T and
// dP = dO V^T (Q and dO as register A operands, K and V staged as rows), P = exp(scale S - lse), dS = P (dP - delta),
// dQ += dS K (dS from the accumulators into A registers, K staged transposed); dQ times scale at the end. It runs
// before dK dV and writes delta = rowsum(dO o O) for it, from out in bf16 (out: (B, T, C) bf16 bits, as the
// forward left it), as v6's dQ kernel does.
extern "C" __global__ void __launch_bounds__(128)
    flash_attention_backward_v7_packed_dq_hs64_bf16(const uint16_t* __restrict__ qkv, const uint16_t* __restrict__ out,
                                                    const uint16_t* __restrict__ dout, const float* __restrict__ lse,
                                                    float* __restrict__ delta, float* __restrict__ dqkv, int T, int nh,
                                                    float scale) {
    __shared__ __align__(128) uint16_t sk[WG_TILE * WG_TILE];   // K's tile, rows = keys (B of S)
    __shared__ __align__(128) uint16_t sv[WG_TILE * WG_TILE];   // V's tile, rows = keys (B of dP)
    __shared__ __align__(128) uint16_t skt[WG_TILE * WG_TILE];  // K's tile transposed, rows = dims (B of dQ)
    __shared__ float s_del[WG_TILE];
    const long head = blockIdx.x, b = head / nh, h = head % nh, C = static_cast<long>(nh) * V7_HS, ld = 3 * C;
    const uint16_t* q = qkv + b * T * ld + h * V7_HS;
    const uint16_t* k = q + C;
    const uint16_t* v = q + 2 * C;
    const uint16_t* dO = dout + b * T * C + h * V7_HS;
    const uint16_t* o = out + b * T * C + h * V7_HS;
    float* dq = dqkv + b * T * ld + h * V7_HS;
    lse += head * T;
    delta += head * T;
    const long qb = static_cast<long>(gridDim.y - 1 - blockIdx.y);  // the last query block (the longest walk) first
    const long t0 = qb * WG_TILE;
    const uint32_t sbo = WG_TILE * 16;
    const float sl2 = scale * V7_LOG2E;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (threadIdx.x < WG_TILE) {  // delta of the block's rows, one thread a row
        const long r = t0 + threadIdx.x;
        float acc = 0.0f;
        for (int c = 0; c < V7_HS; ++c) {
            const float x = __uint_as_float(static_cast<uint32_t>(dO[r * C + c]) << 16);
            const float y = __uint_as_float(static_cast<uint32_t>(o[r * C + c]) << 16);
            acc = fmaf(x, y, acc);
        }
        delta[r] = acc;
        s_del[threadIdx.x] = acc;
    }
    uint32_t qf[4][4], of[4][4];
    for (int s = 0; s < 4; ++s) {
        load_a_fragment(qf[s], q, ld, t0, 16 * s);
        load_a_fragment(of[s], dO, C, t0, 16 * s);
    }
    __syncthreads();  // s_del written
    const int r_lo = 16 * warp + lane / 4;  // this thread's two rows of the tile: r_lo and r_lo + 8
    const float lse2[2] = {lse[t0 + r_lo] * V7_LOG2E, lse[t0 + r_lo + 8] * V7_LOG2E};
    const float del[2] = {s_del[r_lo], s_del[r_lo + 8]};
    float dQ[32];
    for (int i = 0; i < 32; ++i) dQ[i] = 0.0f;
    for (long k0 = 0; k0 <= t0; k0 += WG_TILE) {
        __syncthreads();  // every thread's products of the previous tile are done with the buffers
        stage_tile(sk, k, ld, k0, 0, 0);
        stage_tile(sv, v, ld, k0, 0, 0);
        stage_tile(skt, k, ld, 0, k0, 1);
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();
        float S[32], dP[32];
        for (int i = 0; i < 32; ++i) S[i] = dP[i] = 0.0f;
        fence_operands(S);
        fence_operands(dP);
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
        for (int s = 0; s < 4; ++s) {
            wgmma_64x64x16_rs(S, qf[s], smem_desc(sk + s * 128, 128, sbo));
            wgmma_64x64x16_rs(dP, of[s], smem_desc(sv + s * 128, 128, sbo));
        }
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        fence_operands(S);
        fence_operands(dP);
        for (int i = 0; i < 32; ++i) {  // query t0 + r_lo + 8 hi, key k0 + 8 (i / 4) + 2 (lane % 4) + i % 2
            const int hi = (i % 4) / 2, col = 8 * (i / 4) + 2 * (lane % 4) + i % 2;
            const float p = k0 + col <= t0 + r_lo + 8 * hi ? exp2f(fmaf(S[i], sl2, -lse2[hi])) : 0.0f;
            S[i] = p * (dP[i] - del[hi]);  // dS
        }
        uint32_t da[4][4];
        d_to_a(da, S);
        fence_operands(dQ);
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
        for (int s = 0; s < 4; ++s) wgmma_64x64x16_rs(dQ, da[s], smem_desc(skt + s * 128, 128, sbo));
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        fence_operands(dQ);
    }
    for (int i = 0; i < 32; ++i) {
        const long row = t0 + r_lo + 8 * ((i % 4) / 2), col = 8 * (i / 4) + 2 * (lane % 4) + i % 2;
        dq[row * ld + col] = dQ[i] * scale;
    }
}

// Forward: a block owns 64 query rows (Q as register A operands) and walks the key tiles up to its own with the
// online softmax: S = Q K^T (K staged as rows), each row's running max m and sum l (a thread holds two rows, r_lo
// and r_lo + 8, sixteen columns each; the four lanes that share a row combine theirs with two shuffles), P =
// exp(scale S - m) from the accumulator into A registers, O = O exp(m_old - m) + P V (V staged transposed). At the
// end out = O / l in bf16 and lse = m + log l (natural log), both in the engine's packed layout.
__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

extern "C" __global__ void __launch_bounds__(128)
    flash_attention_forward_v7_packed_hs64_bf16(const uint16_t* __restrict__ qkv, uint16_t* __restrict__ out,
                                                float* __restrict__ lse, int T, int nh, float scale) {
    __shared__ __align__(128) uint16_t sk[WG_TILE * WG_TILE];   // K's tile, rows = keys (B of S)
    __shared__ __align__(128) uint16_t svt[WG_TILE * WG_TILE];  // V's tile transposed, rows = dims (B of O)
    const long head = blockIdx.x, b = head / nh, h = head % nh, C = static_cast<long>(nh) * V7_HS, ld = 3 * C;
    const uint16_t* q = qkv + b * T * ld + h * V7_HS;
    const uint16_t* k = q + C;
    const uint16_t* v = q + 2 * C;
    uint16_t* o = out + b * T * C + h * V7_HS;
    lse += head * T;
    const long t0 = static_cast<long>(gridDim.y - 1 - blockIdx.y) * WG_TILE;  // the longest walk first
    const uint32_t sbo = WG_TILE * 16;
    const float sl2 = scale * V7_LOG2E;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int r_lo = 16 * warp + lane / 4;
    uint32_t qf[4][4];
    for (int s = 0; s < 4; ++s) load_a_fragment(qf[s], q, ld, t0, 16 * s);
    float O[32], m[2] = {V7_NEG_INF, V7_NEG_INF}, l[2] = {0.0f, 0.0f};  // m in units of log2 (scaled scores)
    for (int i = 0; i < 32; ++i) O[i] = 0.0f;
    for (long k0 = 0; k0 <= t0; k0 += WG_TILE) {
        __syncthreads();
        stage_tile(sk, k, ld, k0, 0, 0);
        stage_tile(svt, v, ld, 0, k0, 1);
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();
        float S[32];
        for (int i = 0; i < 32; ++i) S[i] = 0.0f;
        fence_operands(S);
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
        for (int s = 0; s < 4; ++s) wgmma_64x64x16_rs(S, qf[s], smem_desc(sk + s * 128, 128, sbo));
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        fence_operands(S);
        float mt[2] = {V7_NEG_INF, V7_NEG_INF};
        for (int i = 0; i < 32; ++i) {
            const int hi = (i % 4) / 2, col = 8 * (i / 4) + 2 * (lane % 4) + i % 2;
            S[i] = k0 + col <= t0 + r_lo + 8 * hi ? S[i] * sl2 : V7_NEG_INF;
            mt[hi] = fmaxf(mt[hi], S[i]);
        }
        float alpha[2], ls[2] = {0.0f, 0.0f};
        for (int hi = 0; hi < 2; ++hi) {  // every row has a key in every tile it visits (key k0 <= its query)
            const float mn = fmaxf(m[hi], quad_max(mt[hi]));
            alpha[hi] = exp2f(m[hi] - mn);
            m[hi] = mn;
        }
        for (int i = 0; i < 32; ++i) {
            const int hi = (i % 4) / 2;
            S[i] = exp2f(S[i] - m[hi]);
            ls[hi] += S[i];
            O[i] *= alpha[hi];
        }
        for (int hi = 0; hi < 2; ++hi) l[hi] = l[hi] * alpha[hi] + quad_sum(ls[hi]);
        uint32_t pa[4][4];
        d_to_a(pa, S);
        fence_operands(O);
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
        for (int s = 0; s < 4; ++s) wgmma_64x64x16_rs(O, pa[s], smem_desc(svt + s * 128, 128, sbo));
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        fence_operands(O);
    }
    for (int i = 0; i < 32; i += 2) {  // two neighbouring columns per 32-bit store
        const int hi = (i % 4) / 2, col = 8 * (i / 4) + 2 * (lane % 4);
        const long row = t0 + r_lo + 8 * hi;
        const float inv = 1.0f / l[hi];
        *reinterpret_cast<uint32_t*>(o + row * C + col) = pack_bf16(O[i] * inv, O[i + 1] * inv);
    }
    if (lane % 4 == 0)
        for (int hi = 0; hi < 2; ++hi) lse[t0 + r_lo + 8 * hi] = (m[hi] + log2f(l[hi])) / V7_LOG2E;
}
