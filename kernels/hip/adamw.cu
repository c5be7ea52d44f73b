// adamw.cu: the AdamW optimizer step over ONE flat fp32 parameter buffer; portable (NVRTC on NVIDIA, hiprtc/hipcc
// on AMD). Same math and versions as kernels/numba/adamw.py (read its docstring for the decay table):
//   g = grad_scale g;  p = p - lr wd p (decaying tensors only);  m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;
//   p = p - lr (m / bias1) / (sqrt(v / bias2) + eps)  with bias1 = 1 - b1^t, bias2 = 1 - b2^t (from the host);
//   g = 0;  optionally half_out = p in float16 or bfloat16 bits (round to nearest even).
// Arrays: params, grads, m, v (n,); bounds (ntensors + 1,) tensor boundaries, flags (ntensors,) 1 = decays.
//   v1: unfused, five kernels one after the other (decay, m, v, update, zero): about 60 bytes per parameter.
//   v2: fused, one grid-stride pass: reads p, g, m, v and writes p, m, v, g once: 32 bytes per parameter.
//   v3 (HIP only): v2 with float4 (16-byte) loads and stores, 4 elements per thread (n % 4 == 0, aligned).
//   v4 (HIP only): v3 reading lr, lr wd, the bias corrections and the clip / loss-scale factor from GPU memory, so
//       that a CUDA graph can replay the step (adamw_step_device); grad_sumsq* give it the gradient norm.
//   adamw_bf16_moments_v2: v2 with m and v stored as bfloat16 bits (unsigned short, 2 bytes each): read back to
//       float32 (exact), updated and used for the step in float32, written back rounded to nearest even (half.h's
//       f32_to_bf16_bits): 24 bytes per parameter. adamw_bf16_moments_device_v2: the same with v4's scalars in GPU
//       memory (the CUDA-graph step). Twins of kernels/numba/adamw.py's kernels of the same names.
//   adamw_int8_moments_v2: m and v block-wise quantised in gpullm_lessons.model.quant's format (int8 codes of m,
//       uint8 codes of sqrt(v), one float32 scale per block of 256 and moment): one thread block per quantisation
//       block, which it reads back, updates and quantises again with the block's new absmax: 20 bytes per parameter
//       (+ 16 per block).
//       adamw_int8_moments_device_v2: the same with v4's scalars in GPU memory. Twins of the Numba kernels.
#include "portable.h"
#include "half.h"

// The half-precision copy of p into half_out[i] (half_mode 0: none, 1: float16, 2: bfloat16 bits).
__device__ __forceinline__ void store_half(unsigned short* __restrict__ half_out, long long i, float p, int half_mode) {
    if (half_mode == 1) {
        half_out[i] = __half_as_ushort(__float2half_rn(p));
    } else if (half_mode == 2) {
        unsigned int bits = __float_as_uint(p);
        if (p != p) {   // NaN: a quiet NaN with the sign kept (as ml_dtypes)
            half_out[i] = (unsigned short)(((bits >> 16) & 0x8000u) | 0x7FC0u);
        } else {        // round to nearest even on the 16 bits dropped
            half_out[i] = (unsigned short)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
        }
    }
}

// v1_decay: g = grad_scale g; p = p - lr wd p where element i's tensor decays. Thread owns i, i + stride, ...
// j is the tensor element i lies in, walked forward as i grows (bounds[ntensors] = n stops the walk).
extern "C" __global__ void adamw_step_v1_decay(float* __restrict__ params, float* __restrict__ grads,
                                               const long long* __restrict__ bounds,
                                               const unsigned char* __restrict__ flags, long long n,
                                               float lr_wd, float grad_scale) {
    long long stride = (long long)gridDim.x * blockDim.x;
    int j = 0;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        while (bounds[j + 1] <= i) j++;
        grads[i] = grads[i] * grad_scale;
        if (flags[j] && lr_wd != 0.0f) params[i] = params[i] - lr_wd * params[i];
    }
}

// v1_m: m = b1 m + (1 - b1) g
extern "C" __global__ void adamw_step_v1_m(const float* __restrict__ grads, float* __restrict__ m, long long n,
                                           float beta1, float one_minus_beta1) {
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        m[i] = beta1 * m[i] + one_minus_beta1 * grads[i];
}

// v1_v: v = b2 v + (1 - b2) g^2
extern "C" __global__ void adamw_step_v1_v(const float* __restrict__ grads, float* __restrict__ v, long long n,
                                           float beta2, float one_minus_beta2) {
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float g = grads[i];
        v[i] = beta2 * v[i] + one_minus_beta2 * (g * g);
    }
}

// v1_update: p = p - lr mhat / (sqrt(vhat) + eps), and the optional half copy
extern "C" __global__ void adamw_step_v1_update(float* __restrict__ params, const float* __restrict__ m,
                                                const float* __restrict__ v, unsigned short* __restrict__ half_out,
                                                int half_mode, long long n, float lr, float bias1, float bias2,
                                                float eps) {
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float denom = sqrtf(v[i] / bias2) + eps;
        float p = params[i] - (lr * (m[i] / bias1)) / denom;
        params[i] = p;
        store_half(half_out, i, p, half_mode);
    }
}

// v1_zero: g = 0 for the next accumulation
extern "C" __global__ void adamw_step_v1_zero(float* __restrict__ grads, long long n) {
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) grads[i] = 0.0f;
}

// v2: fused. Thread owns elements i, i + stride, ...: reads p, g, m, v once, keeps them in registers, writes once.
extern "C" __global__ void adamw_step_v2(float* __restrict__ params, float* __restrict__ grads, float* __restrict__ m,
                                         float* __restrict__ v, const long long* __restrict__ bounds,
                                         const unsigned char* __restrict__ flags,
                                         unsigned short* __restrict__ half_out, int half_mode, long long n,
                                         float lr, float lr_wd, float beta1, float one_minus_beta1, float beta2,
                                         float one_minus_beta2, float bias1, float bias2, float eps,
                                         float grad_scale) {
    long long stride = (long long)gridDim.x * blockDim.x;
    int j = 0;   // the tensor element i lies in, walked forward
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        while (bounds[j + 1] <= i) j++;
        float g = grads[i] * grad_scale;
        float p = params[i];
        if (flags[j] && lr_wd != 0.0f) p = p - lr_wd * p;      // decoupled weight decay (none for wd = 0)
        float mi = beta1 * m[i] + one_minus_beta1 * g;
        float vi = beta2 * v[i] + one_minus_beta2 * (g * g);
        p = p - (lr * (mi / bias1)) / (sqrtf(vi / bias2) + eps);
        params[i] = p;
        m[i] = mi;
        v[i] = vi;
        grads[i] = 0.0f;
        store_half(half_out, i, p, half_mode);
    }
}

// v3 (HIP only): v2 with float4 loads and stores, each thread owning 4 consecutive elements per grid-stride step
// (i4, i4 + stride, ... count float4s: elements 4 i4 .. 4 i4 + 3). Needs n % 4 == 0 and 16-byte aligned buffers:
// the launcher falls back to v2 otherwise. The 4 elements may straddle a tensor boundary: j is walked per element.
__device__ __forceinline__ void adamw_v3_body(float* __restrict__ params, float* __restrict__ grads,
                                              float* __restrict__ m, float* __restrict__ v,
                                              const long long* __restrict__ bounds,
                                              const unsigned char* __restrict__ flags,
                                              unsigned short* __restrict__ half_out, int half_mode, long long n,
                                              float lr, float lr_wd, float beta1, float one_minus_beta1, float beta2,
                                              float one_minus_beta2, float bias1, float bias2, float eps,
                                              float grad_scale) {
    long long n4 = n / 4;
    long long stride = (long long)gridDim.x * blockDim.x;
    int j = 0;
    for (long long i4 = (long long)blockIdx.x * blockDim.x + threadIdx.x; i4 < n4; i4 += stride) {
        float4 p4 = reinterpret_cast<float4*>(params)[i4];
        float4 g4 = reinterpret_cast<float4*>(grads)[i4];
        float4 m4 = reinterpret_cast<float4*>(m)[i4];
        float4 v4 = reinterpret_cast<float4*>(v)[i4];
        float pv[4] = {p4.x, p4.y, p4.z, p4.w}, gv[4] = {g4.x, g4.y, g4.z, g4.w};
        float mv[4] = {m4.x, m4.y, m4.z, m4.w}, vv[4] = {v4.x, v4.y, v4.z, v4.w};
        for (int k = 0; k < 4; k++) {
            long long i = 4 * i4 + k;
            while (bounds[j + 1] <= i) j++;
            float g = gv[k] * grad_scale;
            float p = pv[k];
            if (flags[j] && lr_wd != 0.0f) p = p - lr_wd * p;
            mv[k] = beta1 * mv[k] + one_minus_beta1 * g;
            vv[k] = beta2 * vv[k] + one_minus_beta2 * (g * g);
            pv[k] = p - (lr * (mv[k] / bias1)) / (sqrtf(vv[k] / bias2) + eps);
            store_half(half_out, i, pv[k], half_mode);
        }
        reinterpret_cast<float4*>(params)[i4] = make_float4(pv[0], pv[1], pv[2], pv[3]);
        reinterpret_cast<float4*>(m)[i4] = make_float4(mv[0], mv[1], mv[2], mv[3]);
        reinterpret_cast<float4*>(v)[i4] = make_float4(vv[0], vv[1], vv[2], vv[3]);
        reinterpret_cast<float4*>(grads)[i4] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
}

extern "C" __global__ void adamw_step_v3(float* __restrict__ params, float* __restrict__ grads, float* __restrict__ m,
                                         float* __restrict__ v, const long long* __restrict__ bounds,
                                         const unsigned char* __restrict__ flags,
                                         unsigned short* __restrict__ half_out, int half_mode, long long n,
                                         float lr, float lr_wd, float beta1, float one_minus_beta1, float beta2,
                                         float one_minus_beta2, float bias1, float bias2, float eps,
                                         float grad_scale) {
    adamw_v3_body(params, grads, m, v, bounds, flags, half_out, half_mode, n, lr, lr_wd, beta1, one_minus_beta1,
                  beta2, one_minus_beta2, bias1, bias2, eps, grad_scale);
}

// ---- the step with its scalars in GPU memory (for CUDA graphs: a captured launch replays its arguments as they were
// at capture, so whatever changes from step to step must be read from memory the host rewrites before each replay).
// hyper (float32, 6): lr, lr * weight_decay, bias1, bias2, 1 / loss_scale, clip (0: no clipping).
// sumsq (float32, 1): the sum of squares of the (scaled) gradient buffer, written by grad_sumsq before this kernel.
// grad_scale = coef / loss_scale with coef = min(1, clip / (sqrt(sumsq) / loss_scale + 1e-6)): the host's formula.
__device__ __forceinline__ float adamw_device_grad_scale(const float* __restrict__ hyper,
                                                         const float* __restrict__ sumsq) {
    float inv_scale = hyper[4], clip = hyper[5];
    float coef = 1.0f;
    if (clip > 0.0f) {
        float c = clip / (sqrtf(sumsq[0]) * inv_scale + 1e-6f);
        if (c < 1.0f) coef = c;
    }
    return coef * inv_scale;
}

// v4 (HIP only): v3 (float4) with lr, lr * wd, bias1, bias2 and the clip / loss-scale factor read from hyper, sumsq.
extern "C" __global__ void adamw_step_v4(float* __restrict__ params, float* __restrict__ grads, float* __restrict__ m,
                                         float* __restrict__ v, const long long* __restrict__ bounds,
                                         const unsigned char* __restrict__ flags,
                                         unsigned short* __restrict__ half_out, int half_mode, long long n,
                                         const float* __restrict__ hyper, const float* __restrict__ sumsq,
                                         float beta1, float one_minus_beta1, float beta2, float one_minus_beta2,
                                         float eps) {
    adamw_v3_body(params, grads, m, v, bounds, flags, half_out, half_mode, n, hyper[0], hyper[1], beta1,
                  one_minus_beta1, beta2, one_minus_beta2, hyper[2], hyper[3], eps,
                  adamw_device_grad_scale(hyper, sumsq));
}

// ---- bf16 moments: m and v as bfloat16 bits, the update in float32 (one pass, v2's loop) ---------------------------
__device__ __forceinline__ void adamw_bf16_moments_body(float* __restrict__ params, float* __restrict__ grads,
                                                        unsigned short* __restrict__ m, unsigned short* __restrict__ v,
                                                        const long long* __restrict__ bounds,
                                                        const unsigned char* __restrict__ flags,
                                                        unsigned short* __restrict__ half_out, int half_mode,
                                                        long long n, float lr, float lr_wd, float beta1,
                                                        float one_minus_beta1, float beta2, float one_minus_beta2,
                                                        float bias1, float bias2, float eps, float grad_scale) {
    long long stride = (long long)gridDim.x * blockDim.x;
    int j = 0;   // the tensor element i lies in, walked forward
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        while (bounds[j + 1] <= i) j++;
        float g = grads[i] * grad_scale;
        float p = params[i];
        if (flags[j] && lr_wd != 0.0f) p = p - lr_wd * p;
        float m_old = __uint_as_float(((unsigned int)m[i]) << 16);   // bf16 bits -> float32: 16 zero bits appended
        float v_old = __uint_as_float(((unsigned int)v[i]) << 16);
        float mi = beta1 * m_old + one_minus_beta1 * g;
        float vi = beta2 * v_old + one_minus_beta2 * (g * g);
        p = p - (lr * (mi / bias1)) / (sqrtf(vi / bias2) + eps);   // this step's float32 moments, before rounding
        params[i] = p;
        m[i] = f32_to_bf16_bits(mi);   // round to nearest even, back to 2 bytes
        v[i] = f32_to_bf16_bits(vi);
        grads[i] = 0.0f;
        store_half(half_out, i, p, half_mode);
    }
}

extern "C" __global__ void adamw_bf16_moments_v2(float* __restrict__ params, float* __restrict__ grads,
                                                 unsigned short* __restrict__ m, unsigned short* __restrict__ v,
                                                 const long long* __restrict__ bounds,
                                                 const unsigned char* __restrict__ flags,
                                                 unsigned short* __restrict__ half_out, int half_mode, long long n,
                                                 float lr, float lr_wd, float beta1, float one_minus_beta1,
                                                 float beta2, float one_minus_beta2, float bias1, float bias2,
                                                 float eps, float grad_scale) {
    adamw_bf16_moments_body(params, grads, m, v, bounds, flags, half_out, half_mode, n, lr, lr_wd, beta1,
                            one_minus_beta1, beta2, one_minus_beta2, bias1, bias2, eps, grad_scale);
}

// the CUDA-graph step with bf16 moments: lr, lr wd, bias1, bias2 and the clip / loss-scale factor from hyper, sumsq
extern "C" __global__ void adamw_bf16_moments_device_v2(float* __restrict__ params, float* __restrict__ grads,
                                                        unsigned short* __restrict__ m, unsigned short* __restrict__ v,
                                                        const long long* __restrict__ bounds,
                                                        const unsigned char* __restrict__ flags,
                                                        unsigned short* __restrict__ half_out, int half_mode,
                                                        long long n, const float* __restrict__ hyper,
                                                        const float* __restrict__ sumsq, float beta1,
                                                        float one_minus_beta1, float beta2, float one_minus_beta2,
                                                        float eps) {
    adamw_bf16_moments_body(params, grads, m, v, bounds, flags, half_out, half_mode, n, hyper[0], hyper[1], beta1,
                            one_minus_beta1, beta2, one_minus_beta2, hyper[2], hyper[3], eps,
                            adamw_device_grad_scale(hyper, sumsq));
}

// ---- int8 moments: block-wise 8-bit m and sqrt(v), gpullm_lessons.model.quant's format ---------------------------
//   m: signed codes q = rint(m / a * 127) with a = the block's max |m| (m_scale[b]); read back as q * (a / 127)
//   v: unsigned codes r = rint(sqrt(v) / a * 255) with a = the block's max sqrt(v) (v_scale[b]); read back as
//      (r * (a / 255))^2, a code 0 as r = 0.5 (half a level: m / (0 + eps) would be a huge step)
// rint rounds to nearest, ties to even (np.rint); an all-zero block has scale 0 and codes 0 (divided by 1).
// Thread block bid owns quantisation blocks bid, bid + gridDim.x, ...; in each, thread t owns elements lo + t,
// lo + t + blockDim.x, ...: (1) read back with the OLD scales, update p (and the half copy), m, v in float32, keep the
// new m and sqrt(v) in shared memory; (2) the block's NEW absmax of each (warp_max, then one value per warp);
// (3) quantise with the new scales, thread 0 stores them. blockDim.x: 64, 128 or 256 (whole warps / wavefronts).
#define ADAMW_Q8_BLOCK 256   // values per quantisation block: quant.BLOCK

// The max over the thread block of x >= 0, returned to every thread; wmax: MAX_WARPS_PER_BLOCK floats of shared memory
// that no thread may touch again before the next __syncthreads.
__device__ __forceinline__ float q8_block_max(float x, float* wmax) {
    int lane = threadIdx.x % warpSize, warp = threadIdx.x / warpSize, n_warps = blockDim.x / warpSize;
    x = warp_max(x);                             // every lane holds its warp's max
    if (lane == 0) wmax[warp] = x;
    __syncthreads();
    x = lane < n_warps ? wmax[lane] : 0.0f;      // 0 is neutral: the values are >= 0
    return warp_max(x);                          // every warp reduces the n_warps (<= warpSize) maxima itself
}

__device__ __forceinline__ void adamw_int8_moments_body(float* __restrict__ params, float* __restrict__ grads,
                                                        signed char* __restrict__ m, unsigned char* __restrict__ v,
                                                        float* __restrict__ m_scale, float* __restrict__ v_scale,
                                                        const long long* __restrict__ bounds,
                                                        const unsigned char* __restrict__ flags,
                                                        unsigned short* __restrict__ half_out, int half_mode,
                                                        long long n, float lr, float lr_wd, float beta1,
                                                        float one_minus_beta1, float beta2, float one_minus_beta2,
                                                        float bias1, float bias2, float eps, float grad_scale) {
    __shared__ float m_new[ADAMW_Q8_BLOCK], r_new[ADAMW_Q8_BLOCK];   // the block's new m and sqrt(v)
    __shared__ float wmax_m[MAX_WARPS_PER_BLOCK], wmax_v[MAX_WARPS_PER_BLOCK];
    long long blocks = (n + ADAMW_Q8_BLOCK - 1) / ADAMW_Q8_BLOCK;
    int j = 0;   // the tensor element i lies in, walked forward
    for (long long b = blockIdx.x; b < blocks; b += gridDim.x) {
        long long lo = b * ADAMW_Q8_BLOCK;
        int size = n - lo < ADAMW_Q8_BLOCK ? (int)(n - lo) : ADAMW_Q8_BLOCK;   // the last block may be shorter
        float per_m = m_scale[b] / 127.0f, per_v = v_scale[b] / 255.0f;   // the OLD scales
        float amax_m = 0.0f, amax_v = 0.0f;
        for (int k = threadIdx.x; k < size; k += blockDim.x) {   // (1) read back, update, keep
            long long i = lo + k;
            while (bounds[j + 1] <= i) j++;
            float g = grads[i] * grad_scale;
            float p = params[i];
            if (flags[j] && lr_wd != 0.0f) p = p - lr_wd * p;
            float m_old = (float)m[i] * per_m;
            float r = (float)v[i];
            if (r == 0.0f) r = 0.5f;
            float s = r * per_v;
            float v_old = s * s;
            float mi = beta1 * m_old + one_minus_beta1 * g;
            float vi = beta2 * v_old + one_minus_beta2 * (g * g);
            p = p - (lr * (mi / bias1)) / (sqrtf(vi / bias2) + eps);   // this step's float32 moments, before quantising
            params[i] = p;
            grads[i] = 0.0f;
            store_half(half_out, i, p, half_mode);
            float ri = sqrtf(vi);   // v is stored as sqrt(v)
            m_new[k] = mi;
            r_new[k] = ri;
            amax_m = fmaxf(amax_m, fabsf(mi));
            amax_v = fmaxf(amax_v, ri);
        }
        amax_m = q8_block_max(amax_m, wmax_m);   // (2) the block's new absmax of each
        amax_v = q8_block_max(amax_v, wmax_v);
        float safe_m = amax_m > 0.0f ? amax_m : 1.0f, safe_v = amax_v > 0.0f ? amax_v : 1.0f;
        for (int k = threadIdx.x; k < size; k += blockDim.x) {   // (3) quantise: the thread's own m_new, r_new
            long long i = lo + k;
            m[i] = (signed char)rintf(m_new[k] / safe_m * 127.0f);
            v[i] = (unsigned char)rintf(r_new[k] / safe_v * 255.0f);
        }
        if (threadIdx.x == 0) {
            m_scale[b] = amax_m;
            v_scale[b] = amax_v;
        }
        __syncthreads();   // wmax_* are written again by the next block
    }
}

extern "C" __global__ void adamw_int8_moments_v2(float* __restrict__ params, float* __restrict__ grads,
                                                 signed char* __restrict__ m, unsigned char* __restrict__ v,
                                                 float* __restrict__ m_scale, float* __restrict__ v_scale,
                                                 const long long* __restrict__ bounds,
                                                 const unsigned char* __restrict__ flags,
                                                 unsigned short* __restrict__ half_out, int half_mode, long long n,
                                                 float lr, float lr_wd, float beta1, float one_minus_beta1,
                                                 float beta2, float one_minus_beta2, float bias1, float bias2,
                                                 float eps, float grad_scale) {
    adamw_int8_moments_body(params, grads, m, v, m_scale, v_scale, bounds, flags, half_out, half_mode, n, lr, lr_wd,
                            beta1, one_minus_beta1, beta2, one_minus_beta2, bias1, bias2, eps, grad_scale);
}

// the CUDA-graph step with int8 moments: lr, lr wd, bias1, bias2 and the clip / loss-scale factor from hyper, sumsq
extern "C" __global__ void adamw_int8_moments_device_v2(float* __restrict__ params, float* __restrict__ grads,
                                                        signed char* __restrict__ m, unsigned char* __restrict__ v,
                                                        float* __restrict__ m_scale, float* __restrict__ v_scale,
                                                        const long long* __restrict__ bounds,
                                                        const unsigned char* __restrict__ flags,
                                                        unsigned short* __restrict__ half_out, int half_mode,
                                                        long long n, const float* __restrict__ hyper,
                                                        const float* __restrict__ sumsq, float beta1,
                                                        float one_minus_beta1, float beta2, float one_minus_beta2,
                                                        float eps) {
    adamw_int8_moments_body(params, grads, m, v, m_scale, v_scale, bounds, flags, half_out, half_mode, n, hyper[0],
                            hyper[1], beta1, one_minus_beta1, beta2, one_minus_beta2, hyper[2], hyper[3], eps,
                            adamw_device_grad_scale(hyper, sumsq));
}

// ---- the global gradient norm: the sum of squares of the flat buffer in two deterministic stages ------------------
// grad_sumsq_partials: block b adds the squares of its grid-stride elements (a tree in shared memory, fixed order)
// into partial[b]; grad_sumsq_reduce: one block adds partial[0..blocks) in a fixed order into out[0]. Same bits run
// after run for a given n and grid (no atomics). blockDim.x must be a power of two <= 1024 in both.
__device__ float sumsq_block_tree(float* buf, float s) {
    buf[threadIdx.x] = s;
    __syncthreads();
    for (int half = blockDim.x / 2; half > 0; half /= 2) {
        if (threadIdx.x < half) buf[threadIdx.x] += buf[threadIdx.x + half];
        __syncthreads();
    }
    return buf[0];
}

extern "C" __global__ void grad_sumsq_partials(const float* __restrict__ flat, float* __restrict__ partial,
                                               long long n) {
    __shared__ float buf[1024];
    long long stride = (long long)gridDim.x * blockDim.x;
    float s = 0.0f;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) s += flat[i] * flat[i];
    float total = sumsq_block_tree(buf, s);
    if (threadIdx.x == 0) partial[blockIdx.x] = total;
}

extern "C" __global__ void grad_sumsq_reduce(const float* __restrict__ partial, float* __restrict__ out, int blocks) {
    __shared__ float buf[1024];
    float s = 0.0f;
    for (int b = threadIdx.x; b < blocks; b += blockDim.x) s += partial[b];
    float total = sumsq_block_tree(buf, s);
    if (threadIdx.x == 0) out[0] = total;
}
