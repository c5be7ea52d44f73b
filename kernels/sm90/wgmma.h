// wgmma.h: Hopper's warpgroup matrix product (wgmma), the building block of flash attention v7. NVIDIA sm_90a only.
// wgmma.cu multiplies matrices with it (tests/test_sm90.py checks it against NumPy); flash_v7.cu builds on it.
//
// The portable kernels of kernels/hip reach the tensor cores through portable.h's register tiles (mma.sync on
// NVIDIA, MFMA on AMD): a warp multiplies 16x8 tiles it holds in registers. Hopper adds a wider instruction: the four
// warps of a *warpgroup* (128 threads) multiply a 64 x N tile together, reading both operands straight from shared
// memory, asynchronously. It exists only as inline PTX for the architecture-specific target sm_90a (no HIP
// equivalent), so it lives here, beside kernels/hip, and runtime/sm90.py compiles it with NVRTC to an sm_90a cubin.
//
// What one instruction needs:
//   the operands in shared memory in the "core matrix" layout: 8 rows x 16 bytes (8 bf16) stored as 128 contiguous
//     bytes; here K-major without swizzling (core_offset below);
//   a 64-bit descriptor per operand (smem_desc): its start address, the byte distance between core matrices
//     adjacent along K (LBO) and along the rows (SBO), all in units of 16 bytes;
//   fence.proxy.async after the threads' ordinary stores, so the asynchronous unit reading shared memory sees them;
//   wgmma.fence before the first product, commit_group after the last, wait_group 0 before the registers are read.
// A may also come from registers (wgmma_64x64x16_rs): four 32-bit registers per thread holding A's 64 x 16 slice
// in the mma.sync 16x16 layout, warp w owning rows 16w .. 16w + 15 (load_a_fragment). That is how flash attention
// multiplies the probabilities it has just computed in registers without a trip through shared memory.
// The accumulator D (64 x 64 float32) is spread over the 128 threads, 32 registers each: warp w holds rows
// 16w .. 16w + 15; lane l holds, for each 8-column chunk j, (row l/4, columns 8j + 2(l%4) + {0, 1}) in d[4j], d[4j+1]
// and the same columns of row l/4 + 8 in d[4j+2], d[4j+3] (the mma.sync 16x8 layout repeated along N).
#pragma once
// NVRTC compiles this without the C++ standard headers: the fixed-width types by hand.
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;

#define WG_TILE 64  // rows of A and B (and so of C) per block, and the K chunk staged in shared memory at a time

// Byte offset of element (r, k) of a tile with `cols` columns in the K-major core-matrix layout without swizzling:
// 8-row groups are SBO = cols * 2 * 8 bytes apart, core matrices along K are LBO = 128 bytes apart.
__device__ __forceinline__ uint32_t core_offset(int r, int k, int cols) {
    return (r / 8) * (cols * 16) + (k / 8) * 128 + (r % 8) * 16 + (k % 8) * 2;
}

// The shared memory matrix descriptor: bits 0-13 start address / 16, 16-29 LBO / 16, 32-45 SBO / 16; base offset and
// swizzle mode (bits 49-51, 62-63) zero: no swizzling.
__device__ __forceinline__ uint64_t smem_desc(const void* p, uint32_t lbo, uint32_t sbo) {
    uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(p));
    return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>((lbo & 0x3FFFF) >> 4) << 16) |
           (static_cast<uint64_t>((sbo & 0x3FFFF) >> 4) << 32);
}

// d (64 x 64, float32, the layout above) += A (64 x 16) B (64 x 16)^T, both K-major bf16 in shared memory.
__device__ __forceinline__ void wgmma_64x64x16(float* d, uint64_t desc_a, uint64_t desc_b) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(desc_a), "l"(desc_b));
}

// The same with A (64 x 16) from registers: a[0..3] as load_a_fragment leaves them.
__device__ __forceinline__ void wgmma_64x64x16_rs(float* d, const uint32_t* a, uint64_t desc_b) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
}

// Keep the compiler from moving ordinary reads or writes of the 32 accumulator registers across the asynchronous
// products: an empty asm that "reads and writes" each one, placed before wgmma.fence and after wait_group.
__device__ __forceinline__ void fence_operands(float* d) {
    for (int i = 0; i < 32; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Stage rows r0 .. r0 + 63 and columns k0 .. k0 + 63 of X into s in the K-major core-matrix layout, tile rows along
// the rows of X (x_kn = 0: X is (rows, ld), row-major) or along its columns (x_kn = 1: X is (K, rows) row-major, and
// the tile is X's transpose: the staging transposes for free, so B may come as (N, K) or as (K, N)).
__device__ __forceinline__ void stage_tile(uint16_t* s, const uint16_t* __restrict__ X, long ld, long r0, long k0,
                                           int x_kn) {
    for (int i = threadIdx.x; i < WG_TILE * WG_TILE; i += blockDim.x) {
        const int r = i / WG_TILE, k = i % WG_TILE;
        const int rr = x_kn ? k : r, kk = x_kn ? r : k;  // (x_kn) consecutive threads read consecutive columns of X
        s[core_offset(rr, kk, WG_TILE) / 2] = x_kn ? X[(k0 + r) * ld + r0 + k] : X[(r0 + r) * ld + k0 + k];
    }
}

// A's 64 x 16 slice at (m0, k0) of row-major A (ld columns) into this thread's four registers (two bf16 each, the
// lower column in the low half): warp w, lane l, g = l / 4, c = 2 (l % 4):
//   a[0] = (16w + g, c .. c+1), a[1] = (16w + g + 8, c .. c+1), a[2] = (16w + g, c+8 .. c+9), a[3] = (16w + g + 8, c+8 .. c+9)
__device__ __forceinline__ void load_a_fragment(uint32_t* a, const uint16_t* __restrict__ A, long ld, long m0,
                                                long k0) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const long row = m0 + 16 * warp + lane / 4, col = k0 + 2 * (lane % 4);
    for (int i = 0; i < 4; ++i) {
        const long r = row + 8 * (i % 2), c = col + 8 * (i / 2);
        a[i] = static_cast<uint32_t>(A[r * ld + c]) | (static_cast<uint32_t>(A[r * ld + c + 1]) << 16);
    }
}

// The accumulator's 64 x 64 tile into C (row-major, N columns) at (m0, n0), in the layout described at the top.
__device__ __forceinline__ void store_d(float* __restrict__ C, const float* d, long N, long m0, long n0) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const long row = m0 + 16 * warp + lane / 4;
    for (int j = 0; j < 8; ++j) {
        const long col = n0 + 8 * j + 2 * (lane % 4);
        C[row * N + col] = d[4 * j];
        C[row * N + col + 1] = d[4 * j + 1];
        C[(row + 8) * N + col] = d[4 * j + 2];
        C[(row + 8) * N + col + 1] = d[4 * j + 3];
    }
}

