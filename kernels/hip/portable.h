// portable.h: the one place that knows whether we compile for NVIDIA (CUDA/NVRTC) or AMD (HIP/hiprtc).
// Every kernel in kernels/hip includes only this header and uses only what it defines, so the same
// source compiles with NVRTC or nvcc for NVIDIA and with hipcc/hiprtc for AMD. Rules (DESIGN.md section 5):
//   - never assume 32 lanes: read warpSize (64 on AMD CDNA), size shared buffers for 1024/WARP_MIN lanes;
//   - lane masks are lanemask_t (64-bit on HIP), shuffles through the shfl_* wrappers below;
//   - no std::, no <cstdint>, no cooperative groups, no inline PTX: NVRTC has no C++ standard library;
//   - extern "C" entry points with raw __restrict__ pointers and int / long long sizes.
#pragma once

#if defined(__HIPCC__) || defined(__HIP_PLATFORM_AMD__) || defined(__HIPCC_RTC__)
  #define GPULLM_HIP 1
  #ifndef __HIPCC_RTC__
    #include <hip/hip_runtime.h>
    #include <hip/hip_fp16.h>
  #endif
  typedef unsigned long long lanemask_t;   // a wavefront has up to 64 lanes
  #define FULL_MASK (~0ull)
  // HIP's shuffles take no mask: every active lane of the wavefront takes part.
  __device__ __forceinline__ float shfl_xor(float v, int lane_mask, int width) { return __shfl_xor(v, lane_mask, width); }
  __device__ __forceinline__ float shfl_down(float v, unsigned int delta, int width) { return __shfl_down(v, delta, width); }
  __device__ __forceinline__ float shfl(float v, int src_lane, int width) { return __shfl(v, src_lane, width); }
#else
  #define GPULLM_CUDA 1
  #ifndef __CUDACC_RTC__
    #include <cuda_runtime.h>
  #endif
  #include <cuda_fp16.h>
  #include <cuda_bf16.h>
  typedef unsigned int lanemask_t;         // a warp has 32 lanes
  #define FULL_MASK (0xffffffffu)
  __device__ __forceinline__ float shfl_xor(float v, int lane_mask, int width) { return __shfl_xor_sync(FULL_MASK, v, lane_mask, width); }
  __device__ __forceinline__ float shfl_down(float v, unsigned int delta, int width) { return __shfl_down_sync(FULL_MASK, v, delta, width); }
  __device__ __forceinline__ float shfl(float v, int src_lane, int width) { return __shfl_sync(FULL_MASK, v, src_lane, width); }
#endif

// The smallest warp any supported GPU has; shared buffers for one value per warp hold 1024 / WARP_MIN entries.
#define WARP_MIN 32
#define MAX_WARPS_PER_BLOCK (1024 / WARP_MIN)

// Sum over the lanes of one warp/wavefront (warpSize lanes: 32 on NVIDIA, 64 on AMD CDNA).
__device__ __forceinline__ float warp_sum(float v) {
    for (int offset = warpSize / 2; offset > 0; offset /= 2) v += shfl_xor(v, offset, warpSize);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int offset = warpSize / 2; offset > 0; offset /= 2) v = fmaxf(v, shfl_xor(v, offset, warpSize));
    return v;
}

// 2^x for softmax-style exponents: NVIDIA's ex2.approx.ftz (one MUFU instruction; results below 2^-126 flush to 0,
// 2^-inf = 0), exp2f elsewhere. exp2f on NVIDIA is ex2.approx without ftz: the same value for every normal result,
// plus the instructions that keep subnormal results.
#if GPULLM_CUDA && defined(__CUDA_ARCH__)
__device__ __forceinline__ float exp2_fast(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
#else
__device__ __forceinline__ float exp2_fast(float x) { return exp2f(x); }
#endif

// Make one warp's (wavefront's) shared-memory writes visible to its other lanes before they read them.
#if GPULLM_HIP
__device__ __forceinline__ void warp_sync() {
    __builtin_amdgcn_fence(__ATOMIC_RELEASE, "workgroup");
    __builtin_amdgcn_wave_barrier();
    __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "workgroup");
}
#else
__device__ __forceinline__ void warp_sync() { __syncwarp(); }
#endif

// ---- Copies from global to shared memory that overlap the math (cp.async on NVIDIA sm_80+) -----------------------
// copy16_async(dst, src, ok): 16 bytes from global src to shared dst, both 16-byte aligned, or 16 zero bytes where !ok
// (src is then not read, but pass a valid address); copy4_async: the same for 4 bytes (4-byte aligned). copy_commit()
// closes this thread's group of copies so far; copy_wait<N>() waits until at most N of its groups are in flight. The
// block's other threads see the bytes after copy_wait and __syncthreads(). AMD (and NVIDIA before sm_80): a plain load
// and store, done when the call returns; commit and wait do nothing.
#if GPULLM_CUDA && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
__device__ __forceinline__ void copy16_async(void* dst, const void* src, bool ok) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"((unsigned int)__cvta_generic_to_shared(dst)), "l"(src), "r"(ok ? 16 : 0) : "memory");
}
__device__ __forceinline__ void copy4_async(void* dst, const void* src, bool ok) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n"
                 :: "r"((unsigned int)__cvta_generic_to_shared(dst)), "l"(src), "r"(ok ? 4 : 0) : "memory");
}
__device__ __forceinline__ void copy_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void copy_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory"); }
#else
__device__ __forceinline__ void copy16_async(void* dst, const void* src, bool ok) {
    uint4 x = make_uint4(0u, 0u, 0u, 0u);
    if (ok) x = *reinterpret_cast<const uint4*>(src);
    *reinterpret_cast<uint4*>(dst) = x;
}
__device__ __forceinline__ void copy4_async(void* dst, const void* src, bool ok) {
    *reinterpret_cast<unsigned int*>(dst) = ok ? *reinterpret_cast<const unsigned int*>(src) : 0u;
}
__device__ __forceinline__ void copy_commit() {}
template <int N> __device__ __forceinline__ void copy_wait() {}
#endif

// ---- Matrix tiles on the matrix units (tensor cores on NVIDIA, MFMA on AMD CDNA: gfx90a, gfx942) ----------------
// Only for sources that #define GPULLM_MATRIX_UNITS before including this header (NVIDIA's <mma.h> needs the CUDA
// headers' crt/ folder: pip's nvidia-cuda-crt, or a CUDA toolkit).
#ifdef GPULLM_MATRIX_UNITS
// One warp (wavefront) multiplies 16x16 tiles: acc (16x16 fp32) += A (16x16) * B (16x16), A and B 16-bit floats of
// format H (1: bfloat16, 2: float16, half.h's numbering) read from shared memory as their raw bits (unsigned short).
// Every lane of the warp calls each function together (no lane may be inside an if the others skip).
//   mma_load_a<H, L>(a, p, ld):  L = MMA_ROW: A[i][k] = p[i * ld + k];  MMA_COL: A[i][k] = p[k * ld + i]
//   mma_load_b<H, L>(b, p, ld):  L = MMA_ROW: B[k][j] = p[k * ld + j];  MMA_COL: B[k][j] = p[j * ld + k]
//   mma_zero(acc); mma_run(acc, a, b): acc += A B;  mma_store(p, acc, ld): p[i * ld + j] = acc[i][j] (fp32)
// ld: NVIDIA's loads need ld a multiple of 8 (16-bit) or 4 (fp32) elements and p 32-byte aligned.
// What a lane holds is the vendor's business (NVIDIA does not document it); code outside this header only loads,
// runs and stores. AMD: v_mfma_f32_16x16x16{bf16_1k,f16} on a 64-lane wavefront, each lane 4 elements of A, B and
// the result: A[lane % 16][4 (lane / 16) + e], B[4 (lane / 16) + e][lane % 16], acc[4 (lane / 16) + e][lane % 16].
#define MMA_ROW 0
#define MMA_COL 1
// MMA_WARP: the lanes of the warp that runs them, as a compile-time constant (loops over a lane's share of a tile
// unroll and keep it in registers): 32 on NVIDIA, 64 on AMD CDNA.
#if GPULLM_HIP
#define MMA_WARP 64
typedef short mma_s4 __attribute__((ext_vector_type(4)));
typedef _Float16 mma_h4 __attribute__((ext_vector_type(4)));
typedef float mma_f4 __attribute__((ext_vector_type(4)));
struct mma_acc { mma_f4 x; };
template <int H, int L> struct mma_a { mma_s4 x; };
template <int H, int L> struct mma_b { mma_s4 x; };
__device__ __forceinline__ void mma_zero(mma_acc& c) { c.x = mma_f4{0.0f, 0.0f, 0.0f, 0.0f}; }
template <int H, int L> __device__ __forceinline__ void mma_load_a(mma_a<H, L>& a, const unsigned short* p, int ld) {
    int lane = threadIdx.x % warpSize, i = lane % 16, k0 = 4 * (lane / 16);
    for (int e = 0; e < 4; e++) a.x[e] = (short)(L == MMA_ROW ? p[i * ld + k0 + e] : p[(k0 + e) * ld + i]);
}
template <int H, int L> __device__ __forceinline__ void mma_load_b(mma_b<H, L>& b, const unsigned short* p, int ld) {
    int lane = threadIdx.x % warpSize, j = lane % 16, k0 = 4 * (lane / 16);
    for (int e = 0; e < 4; e++) b.x[e] = (short)(L == MMA_ROW ? p[(k0 + e) * ld + j] : p[j * ld + k0 + e]);
}
template <int H, int LA, int LB>
__device__ __forceinline__ void mma_run(mma_acc& c, const mma_a<H, LA>& a, const mma_b<H, LB>& b) {
    if (H == 1) c.x = __builtin_amdgcn_mfma_f32_16x16x16bf16_1k(a.x, b.x, c.x, 0, 0, 0);
    else c.x = __builtin_amdgcn_mfma_f32_16x16x16f16(__builtin_bit_cast(mma_h4, a.x), __builtin_bit_cast(mma_h4, b.x),
                                                     c.x, 0, 0, 0);
}
__device__ __forceinline__ void mma_store(float* p, const mma_acc& c, int ld) {
    int lane = threadIdx.x % warpSize, j = lane % 16, i0 = 4 * (lane / 16);
    for (int e = 0; e < 4; e++) p[(i0 + e) * ld + j] = c.x[e];
}
// Register tiles (below): a lane holds row lane % 16, columns 4 (lane / 16) + e, e < 4 (the transposed products:
// each MFMA computes tile^T, so the row a lane owns is the MFMA result's column).
#define MMA_SE 4
#define MMA_QPL 1
struct mma_tile { float x[4]; };
template <int H> struct mma_rows { mma_s4 x; };
template <int H> struct mma_packed { mma_s4 x; };
__device__ __forceinline__ int mma_tile_row(int e) { return threadIdx.x % warpSize % 16; }
__device__ __forceinline__ int mma_tile_col(int e) { return 4 * (threadIdx.x % warpSize / 16) + e; }
__host__ __device__ constexpr int mma_tile_q(int e) { return 0; }
__device__ __forceinline__ int mma_lane_row(int qi) { return threadIdx.x % warpSize % 16; }
__device__ __forceinline__ bool mma_row_leader() { return threadIdx.x % warpSize < 16; }
__device__ __forceinline__ float mma_row_max(float v) {
    v = fmaxf(v, shfl_xor(v, 16, warpSize));
    return fmaxf(v, shfl_xor(v, 32, warpSize));
}
__device__ __forceinline__ float mma_row_sum(float v) {
    v += shfl_xor(v, 16, warpSize);
    return v + shfl_xor(v, 32, warpSize);
}
template <int H> __device__ __forceinline__ void mma_rows_load(mma_rows<H>& f, const unsigned short* p, int ld) {
    int lane = threadIdx.x % warpSize, i = lane % 16, k0 = 4 * (lane / 16);
    for (int e = 0; e < 4; e++) f.x[e] = (short)p[i * ld + k0 + e];
}
template <int H> __device__ __forceinline__ void mma_mfma(mma_f4& c, const mma_s4& a, const mma_s4& b) {
    if (H == 1) c = __builtin_amdgcn_mfma_f32_16x16x16bf16_1k(a, b, c, 0, 0, 0);
    else c = __builtin_amdgcn_mfma_f32_16x16x16f16(__builtin_bit_cast(mma_h4, a), __builtin_bit_cast(mma_h4, b), c,
                                                    0, 0, 0);
}
// t += F B^T with B's 16 rows at p (tile^T = B F^T: B as the MFMA's A, F as its B operand)
template <int H>
__device__ __forceinline__ void mma_rows_run(mma_tile& t, const mma_rows<H>& f, const unsigned short* p, int ld) {
    int lane = threadIdx.x % warpSize, i = lane % 16, k0 = 4 * (lane / 16);
    mma_s4 a;
    for (int e = 0; e < 4; e++) a[e] = (short)p[i * ld + k0 + e];
    mma_f4 c = {t.x[0], t.x[1], t.x[2], t.x[3]};
    mma_mfma<H>(c, a, f.x);
    for (int e = 0; e < 4; e++) t.x[e] = c[e];
}
template <int H, typename Round>
__device__ __forceinline__ void mma_pack(mma_packed<H>& pk, const mma_tile& t, Round round) {
    for (int e = 0; e < 4; e++) pk.x[e] = (short)round(t.x[e]);
}
// a left operand P[i][k] = p[k * ld + i] (stored transposed) into the registers mma_pack fills; and the reverse of
// mma_pack's registers: P[i][k] to p[i * ld + k]
template <int H> __device__ __forceinline__ void mma_packed_load_t(mma_packed<H>& pk, const unsigned short* p, int ld) {
    int lane = threadIdx.x % warpSize, i = lane % 16, k0 = 4 * (lane / 16);
    for (int e = 0; e < 4; e++) pk.x[e] = (short)p[(k0 + e) * ld + i];
}
template <int H> __device__ __forceinline__ void mma_packed_store(unsigned short* p, const mma_packed<H>& pk, int ld) {
    int lane = threadIdx.x % warpSize, i = lane % 16, k0 = 4 * (lane / 16);
    for (int e = 0; e < 4; e++) p[i * ld + k0 + e] = (unsigned short)pk.x[e];
}
// mma_pack rounding to nearest even (gfx90a has no bfloat16 conversion: the bits by hand, NaN not special-cased)
template <int H> __device__ __forceinline__ void mma_pack_rn(mma_packed<H>& pk, const mma_tile& t) {
    for (int e = 0; e < 4; e++) {
        unsigned int b = __float_as_uint(t.x[e]);
        pk.x[e] = (short)(H == 1 ? (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16 : __half_as_ushort(__float2half_rn(t.x[e])));
    }
}
// t += P V with V's 16 rows at p (tile^T = V^T P^T: V^T as the MFMA's A, P^T, which the lane already holds, as B)
template <int H>
__device__ __forceinline__ void mma_packed_run(mma_tile& t, const mma_packed<H>& pk, const unsigned short* p, int ld) {
    int lane = threadIdx.x % warpSize, j = lane % 16, k0 = 4 * (lane / 16);
    mma_s4 a;
    for (int e = 0; e < 4; e++) a[e] = (short)p[(k0 + e) * ld + j];
    mma_f4 c = {t.x[0], t.x[1], t.x[2], t.x[3]};
    mma_mfma<H>(c, a, pk.x);
    for (int e = 0; e < 4; e++) t.x[e] = c[e];
}
// Operand fragments loaded once and used by several products (a warp's row tiles share them):
// mma_kfrag: B's 16 rows for t += F B^T (what mma_rows_run loads); mma_vfrag: V's 16 rows for t += P V (mma_packed_run's)
template <int H> struct mma_kfrag { mma_s4 x; };
template <int H> struct mma_vfrag { mma_s4 x; };
template <int H> __device__ __forceinline__ void mma_kfrag_load(mma_kfrag<H>& b, const unsigned short* p, int ld) {
    int lane = threadIdx.x % warpSize, i = lane % 16, k0 = 4 * (lane / 16);
    for (int e = 0; e < 4; e++) b.x[e] = (short)p[i * ld + k0 + e];
}
template <int H>
__device__ __forceinline__ void mma_rows_mul(mma_tile& t, const mma_rows<H>& f, const mma_kfrag<H>& b) {
    mma_f4 c = {t.x[0], t.x[1], t.x[2], t.x[3]};
    mma_mfma<H>(c, b.x, f.x);
    for (int e = 0; e < 4; e++) t.x[e] = c[e];
}
template <int H> __device__ __forceinline__ void mma_vfrag_load(mma_vfrag<H>& b, const unsigned short* p, int ld) {
    int lane = threadIdx.x % warpSize, j = lane % 16, k0 = 4 * (lane / 16);
    for (int e = 0; e < 4; e++) b.x[e] = (short)p[(k0 + e) * ld + j];
}
template <int H>
__device__ __forceinline__ void mma_packed_mul(mma_tile& t, const mma_packed<H>& pk, const mma_vfrag<H>& b) {
    mma_f4 c = {t.x[0], t.x[1], t.x[2], t.x[3]};
    mma_mfma<H>(c, b.x, pk.x);
    for (int e = 0; e < 4; e++) t.x[e] = c[e];
}
#else
#include <mma.h>
#define MMA_WARP 32
template <int H> struct mma_elem { typedef __nv_bfloat16 t; };
template <> struct mma_elem<2> { typedef __half t; };
template <int L> struct mma_layout { typedef nvcuda::wmma::row_major t; };
template <> struct mma_layout<MMA_COL> { typedef nvcuda::wmma::col_major t; };
struct mma_acc { nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 16, float> f; };
template <int H, int L> struct mma_a {
    nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, 16, 16, 16, typename mma_elem<H>::t, typename mma_layout<L>::t> f;
};
template <int H, int L> struct mma_b {
    nvcuda::wmma::fragment<nvcuda::wmma::matrix_b, 16, 16, 16, typename mma_elem<H>::t, typename mma_layout<L>::t> f;
};
__device__ __forceinline__ void mma_zero(mma_acc& c) { nvcuda::wmma::fill_fragment(c.f, 0.0f); }
template <int H, int L> __device__ __forceinline__ void mma_load_a(mma_a<H, L>& a, const unsigned short* p, int ld) {
    nvcuda::wmma::load_matrix_sync(a.f, reinterpret_cast<const typename mma_elem<H>::t*>(p), ld);
}
template <int H, int L> __device__ __forceinline__ void mma_load_b(mma_b<H, L>& b, const unsigned short* p, int ld) {
    nvcuda::wmma::load_matrix_sync(b.f, reinterpret_cast<const typename mma_elem<H>::t*>(p), ld);
}
template <int H, int LA, int LB>
__device__ __forceinline__ void mma_run(mma_acc& c, const mma_a<H, LA>& a, const mma_b<H, LB>& b) {
    nvcuda::wmma::mma_sync(c.f, a.f, b.f, c.f);
}
__device__ __forceinline__ void mma_store(float* p, const mma_acc& c, int ld) {
    nvcuda::wmma::store_matrix_sync(p, c.f, ld, nvcuda::wmma::mem_row_major);
}
// Register tiles (below), on mma.sync.m16n8k16 whose register layouts the PTX ISA documents: with g = lane / 4 and
// c = lane % 4, element e < 8 of a lane is at row g + 8 ((e % 4) / 2), column 8 (e / 4) + 2 c + e % 2 (two m16n8
// results side by side), so a lane holds two rows (g and g + 8). That is also the layout of the A operand of the
// next product, so P goes from the accumulators to the operand registers with no shuffle.
#define MMA_SE 8
#define MMA_QPL 2
struct mma_tile { float x[8]; };
template <int H> struct mma_rows { unsigned int r[4]; };
template <int H> struct mma_packed { unsigned int r[4]; };
__device__ __forceinline__ int mma_tile_row(int e) { return threadIdx.x % 32 / 4 + 8 * ((e % 4) / 2); }
__device__ __forceinline__ int mma_tile_col(int e) { return 8 * (e / 4) + 2 * (threadIdx.x % 4) + e % 2; }
__host__ __device__ constexpr int mma_tile_q(int e) { return (e % 4) / 2; }
__device__ __forceinline__ int mma_lane_row(int qi) { return threadIdx.x % 32 / 4 + 8 * qi; }
__device__ __forceinline__ bool mma_row_leader() { return threadIdx.x % 4 == 0; }
__device__ __forceinline__ float mma_row_max(float v) {
    v = fmaxf(v, shfl_xor(v, 1, 32));
    return fmaxf(v, shfl_xor(v, 2, 32));
}
__device__ __forceinline__ float mma_row_sum(float v) {
    v += shfl_xor(v, 1, 32);
    return v + shfl_xor(v, 2, 32);
}
__device__ __forceinline__ unsigned int mma_smem(const void* p) { return (unsigned int)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mma_ldmatrix(unsigned int (&r)[4], const unsigned short* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(mma_smem(p)));
}
__device__ __forceinline__ void mma_ldmatrix_trans(unsigned int (&r)[4], const unsigned short* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(mma_smem(p)));
}
// c (16x8 fp32: c[0..3]) += A (16x16, a) B (16x8, b0 b1)
template <int H>
__device__ __forceinline__ void mma_m16n8k16(float* c, const unsigned int (&a)[4], unsigned int b0, unsigned int b1) {
    if (H == 1)
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                     "{%8, %9}, {%0, %1, %2, %3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    else
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                     "{%8, %9}, {%0, %1, %2, %3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <int H> __device__ __forceinline__ void mma_rows_load(mma_rows<H>& f, const unsigned short* p, int ld) {
    int lane = threadIdx.x % 32;
    mma_ldmatrix(f.r, p + (lane % 16) * ld + 8 * (lane / 16));
}
// t += F B^T with B's 16 rows at p: B^T is the col-major B operand, which ldmatrix reads from B's rows
template <int H>
__device__ __forceinline__ void mma_rows_run(mma_tile& t, const mma_rows<H>& f, const unsigned short* p, int ld) {
    int lane = threadIdx.x % 32;
    unsigned int b[4];
    mma_ldmatrix(b, p + (lane % 8 + 8 * (lane / 16)) * ld + 8 * (lane / 8 % 2));
    mma_m16n8k16<H>(&t.x[0], f.r, b[0], b[1]);
    mma_m16n8k16<H>(&t.x[4], f.r, b[2], b[3]);
}
template <int H, typename Round>
__device__ __forceinline__ void mma_pack(mma_packed<H>& pk, const mma_tile& t, Round round) {
    for (int i = 0; i < 4; i++)
        pk.r[i] = (unsigned int)round(t.x[2 * i]) | ((unsigned int)round(t.x[2 * i + 1]) << 16);
}
// a left operand P[i][k] = p[k * ld + i] (stored transposed) into the registers mma_pack fills: ldmatrix .trans of
// the four 8x8 blocks; and the reverse of mma_pack's registers: P[i][k] to p[i * ld + k], two elements per store
template <int H> __device__ __forceinline__ void mma_packed_load_t(mma_packed<H>& pk, const unsigned short* p, int ld) {
    int lane = threadIdx.x % 32;
    mma_ldmatrix_trans(pk.r, p + (lane % 8 + 8 * (lane / 16)) * ld + 8 * (lane / 8 % 2));
}
template <int H> __device__ __forceinline__ void mma_packed_store(unsigned short* p, const mma_packed<H>& pk, int ld) {
    int lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
    for (int i = 0; i < 4; i++) *reinterpret_cast<unsigned int*>(p + (g + 8 * (i % 2)) * ld + 8 * (i / 2) + 2 * c) = pk.r[i];
}
// mma_pack rounding to nearest even with the hardware's conversion of two floats at once (cvt.rn.bf16x2.f32 /
// cvt.rn.f16x2.f32): the bits of half.h's rounding for every number; a NaN becomes the hardware's NaN
template <int H> __device__ __forceinline__ void mma_pack_rn(mma_packed<H>& pk, const mma_tile& t) {
    for (int i = 0; i < 4; i++) {
        if (H == 1) {
            __nv_bfloat162 h = __floats2bfloat162_rn(t.x[2 * i], t.x[2 * i + 1]);
            pk.r[i] = *reinterpret_cast<unsigned int*>(&h);
        } else {
            __half2 h = __floats2half2_rn(t.x[2 * i], t.x[2 * i + 1]);
            pk.r[i] = *reinterpret_cast<unsigned int*>(&h);
        }
    }
}
// t += P V with V's 16 rows at p (row-major): ldmatrix .trans gives the col-major B operand
template <int H>
__device__ __forceinline__ void mma_packed_run(mma_tile& t, const mma_packed<H>& pk, const unsigned short* p, int ld) {
    int lane = threadIdx.x % 32;
    unsigned int b[4];
    mma_ldmatrix_trans(b, p + (lane % 8 + 8 * (lane / 8 % 2)) * ld + 8 * (lane / 16));
    mma_m16n8k16<H>(&t.x[0], pk.r, b[0], b[1]);
    mma_m16n8k16<H>(&t.x[4], pk.r, b[2], b[3]);
}
// Operand fragments loaded once and used by several products (a warp's row tiles share them): the same ldmatrix
// addresses as mma_rows_run / mma_packed_run, the load split from the two m16n8k16 products.
template <int H> struct mma_kfrag { unsigned int r[4]; };
template <int H> struct mma_vfrag { unsigned int r[4]; };
template <int H> __device__ __forceinline__ void mma_kfrag_load(mma_kfrag<H>& b, const unsigned short* p, int ld) {
    int lane = threadIdx.x % 32;
    mma_ldmatrix(b.r, p + (lane % 8 + 8 * (lane / 16)) * ld + 8 * (lane / 8 % 2));
}
template <int H>
__device__ __forceinline__ void mma_rows_mul(mma_tile& t, const mma_rows<H>& f, const mma_kfrag<H>& b) {
    mma_m16n8k16<H>(&t.x[0], f.r, b.r[0], b.r[1]);
    mma_m16n8k16<H>(&t.x[4], f.r, b.r[2], b.r[3]);
}
template <int H> __device__ __forceinline__ void mma_vfrag_load(mma_vfrag<H>& b, const unsigned short* p, int ld) {
    int lane = threadIdx.x % 32;
    mma_ldmatrix_trans(b.r, p + (lane % 8 + 8 * (lane / 8 % 2)) * ld + 8 * (lane / 16));
}
template <int H>
__device__ __forceinline__ void mma_packed_mul(mma_tile& t, const mma_packed<H>& pk, const mma_vfrag<H>& b) {
    mma_m16n8k16<H>(&t.x[0], pk.r, b.r[0], b.r[1]);
    mma_m16n8k16<H>(&t.x[4], pk.r, b.r[2], b.r[3]);
}
#endif
// Register tiles, for code whose row-wise work (a softmax) runs between two products without a trip through shared
// memory. mma_tile is a 16x16 fp32 tile spread over the warp: element e < MMA_SE of a lane is at row
// mma_tile_row(e), column mma_tile_col(e); a lane holds MMA_QPL whole rows' worth of elements (its rows are
// mma_lane_row(qi), qi < MMA_QPL; element e belongs to its row mma_tile_q(e)); mma_row_max / mma_row_sum combine a
// value over the lanes that share a row, and mma_row_leader() is true on one lane per row.
//   mma_rows<H> f; mma_rows_load(f, p, ld): a 16x16 operand F[i][k] = p[i * ld + k] kept in registers (Q's rows);
//   mma_rows_run(t, f, p, ld):   t += F B^T, B[j][k] = p[j * ld + k] in shared memory (S = Q K^T: K's rows);
//   mma_pack<H>(pk, t, round):  the tile as the left operand of the next product, each element rounded to format H
//                                by round(float) -> bits (P, in the registers that held S);
//   mma_packed_run(t, pk, p, ld): t += P V, V[k][j] = p[k * ld + j] in shared memory (V's rows).
//   mma_pack_rn<H>(pk, t):      mma_pack rounding to nearest even (the hardware's conversion where there is one);
//   mma_packed_store(p, pk, ld): the packed operand to shared memory, P[i][k] at p[i * ld + k];
//   mma_packed_load_t(pk, p, ld): a packed (left) operand from shared memory stored transposed, P[i][k] = p[k * ld + i];
//   mma_kfrag_load(b, p, ld); mma_rows_mul(t, f, b):     mma_rows_run split in two (one B fragment, several F);
//   mma_vfrag_load(b, p, ld); mma_packed_mul(t, pk, b):  mma_packed_run split in two (one V fragment, several P).
// Pointers into shared memory; rows 16-byte aligned (ld a multiple of 8).
#endif  // GPULLM_MATRIX_UNITS
