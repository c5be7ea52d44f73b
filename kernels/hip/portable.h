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
