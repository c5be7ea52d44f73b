// wgmma.cu: a matrix product through wgmma.h's building blocks, checked against NumPy (tests/test_sm90.py).
#include "wgmma.h"

// C (M x N, float32) = A (M x K) B^T, A and B bf16 (their bits as uint16) row-major; B is (N x K), or (K x N) with
// b_kn = 1 (then C = A B). a_regs = 1: A goes to the products from registers, else from shared memory. One warpgroup
// (128 threads) per 64 x 64 tile of C: grid (N / 64, M / 64); M, N and K multiples of 64 (the launcher checks). Each
// 64-column chunk of K is staged in shared memory and multiplied in four k16 steps.
extern "C" __global__ void __launch_bounds__(128) wgmma_gemm_bf16(const uint16_t* __restrict__ A,
                                                                  const uint16_t* __restrict__ B,
                                                                  float* __restrict__ C, int M, int N, int K,
                                                                  int b_kn, int a_regs) {
    __shared__ __align__(128) uint16_t sa[WG_TILE * WG_TILE];
    __shared__ __align__(128) uint16_t sb[WG_TILE * WG_TILE];
    const long m0 = static_cast<long>(blockIdx.y) * WG_TILE, n0 = static_cast<long>(blockIdx.x) * WG_TILE;
    const uint32_t sbo = WG_TILE * 16;  // bytes between 8-row groups of a staged tile (LBO: 128, core matrices along K)
    float d[32];
    for (int i = 0; i < 32; ++i) d[i] = 0.0f;
    uint32_t a[WG_TILE / 16][4];
    for (int k0 = 0; k0 < K; k0 += WG_TILE) {
        if (a_regs)
            for (int s = 0; s < WG_TILE / 16; ++s) load_a_fragment(a[s], A, K, m0, k0 + 16 * s);
        else
            stage_tile(sa, A, K, m0, k0, 0);
        stage_tile(sb, B, b_kn ? N : K, n0, k0, b_kn);
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();
        fence_operands(d);
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
        for (int s = 0; s < WG_TILE / 16; ++s) {  // a k16 step starts two core matrices (256 bytes) further along K
            const uint64_t db = smem_desc(sb + s * 128, 128, sbo);
            if (a_regs)
                wgmma_64x64x16_rs(d, a[s], db);
            else
                wgmma_64x64x16(d, smem_desc(sa + s * 128, 128, sbo), db);
        }
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        fence_operands(d);
        __syncthreads();  // every product has read this chunk before the next one overwrites it
    }
    store_d(C, d, N, m0, n0);
}
