"""The AdamW optimizer step over ONE flat fp32 parameter buffer (params.ParamBuffer.flat): Numba CUDA kernels.

Exactly the reference gpullm_lessons.model.optim.AdamW (= torch.optim.AdamW), for the step count t >= 1 (after increment):

    g = grad_scale * g                         # undo the loss scale of mixed precision (1.0: nothing to undo)
    p = p - lr * wd * p                        # decoupled weight decay, only for the tensors that decay
    m = b1 * m + (1 - b1) * g                  # first moment
    v = b2 * v + (1 - b2) * g^2                # second moment
    p = p - lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)
    g = 0                                      # the gradient buffer is zeroed for the next accumulation

Element i of every buffer depends on element i only: one thread per element (grid-stride), nothing shared. The
bias corrections 1 - b1^t and 1 - b2^t are computed once on the host (in float64, passed as float32).

Which tensors decay: the decay table
------------------------------------
The flat buffer holds ~16 named tensors one after the other; only some decay (optim.DECAY_NAMES). The table is
`(bounds, flags)`: bounds int64 (k + 1,) the tensor boundaries [0, stop_0, stop_1, ..., n] and flags uint8 (k,),
1 where tensor j (elements bounds[j] .. bounds[j+1]-1) decays. `decay_table(param_buffer)` builds it. Each thread
keeps the index j of the tensor it is in and walks it forward as its grid-stride loop moves to higher elements
(`while bounds[j + 1] <= i: j += 1`): a few cached reads per thread, no second launch, no per-element mask in
memory. decay_bounds=None decays everything (table [0, n], [1]).

Optional half-precision copy of the updated weights (half_out, n elements) in the same pass: float16 (round to
nearest even) or bfloat16 stored as uint16 bits (round to nearest even on the float32 bits, NaN kept as a quiet NaN
with its sign: the same bits as ml_dtypes.bfloat16). Bits are read with libdevice (float_as_int, float2half_rn), not
with device functions, so the kernels compile to PTX without a driver; under the simulator a NumPy stand-in is used.

Memory traffic per parameter (float32, no half_out):
  v2 reads p, g, m, v (16 B) and writes p, m, v and the zeroed g (16 B): 32 B (+ 2 B with half_out).
  v1 reads/writes them once per kernel: decay (r p, g; w p, g: 16) + m (r m, g; w m: 12) + v (r v, g; w v: 12)
     + update (r p, m, v; w p: 16) + zero (w g: 4) = 60 B, nearly twice v2, and five launches.

Versions (KERNELS keys; the wrapper takes version="v1" or "v2"):
v1: unfused, five elementwise kernels one after the other: v1_decay (grad scale + weight decay), v1_m (first
    moment), v1_v (second moment), v1_update (bias-corrected step + half copy), v1_zero (zero the gradient).
v2: fused, one grid-stride pass that reads each buffer once and writes each once.
device_v2: v2 with lr, lr * wd, the bias corrections, 1 / loss scale and the clip threshold read from a device array
    (adamw_hyper()) and the clip factor computed from the squared gradient norm in device memory: adamw_step_device,
    the step a CUDA graph can replay (its launch arguments never change from step to step).
bf16_moments_v2 (adamw_step with m, v uint16): v2 with AdamW's moments stored as bfloat16 bits, 2 bytes each: it reads
    them (exact: 16 zero bits appended), updates them and takes the step in float32 (the step uses this step's
    float32 moments), then writes them back rounded to nearest even (convert.f32_to_bf16_bits, the rounding of
    reference.rounding and half.h). 24 B per parameter instead of 32. Reference: optim.adamw_update_bf16.
bf16_moments_device_v2 (adamw_step_device with m, v uint16): bf16_moments_v2 with device_v2's scalars from hyper.
int8_moments_v2 (adamw_step with m int8, v uint8 and their scales m_scale, v_scale): AdamW's moments block-wise
    quantised in gpullm_lessons.model.quant's format (2 bytes per parameter plus 8 per block of 256): m as int8 codes
    q = round(m / a * 127), v as uint8 codes of sqrt(v) scaled by the block's max sqrt(v), one float32 scale a (the
    block's absmax) per block and moment. One thread block per quantisation block (a grid-stride loop over the
    blocks): each thread reads its elements' codes back to float32 with the OLD scales (a sqrt(v) code 0 reads as
    half a level), updates p (and the half copy), m, v in float32 and keeps the new m, sqrt(v) in shared memory;
    a tree gives the block's NEW absmax of each; then every value is quantised with the new scale (round to nearest,
    ties to even: libdevice rintf) and the scales stored. An all-zero block gets scale 0 and codes 0. Reference:
    quant.dequantize_moments -> optim.adamw_update -> quant.quantize_moments (NumpyEngine's int8 step).
    20 B per parameter instead of 32 (p and g as v2; m and v 1 B each, read and written; + 16 B of scales per block).
int8_moments_device_v2 (adamw_step_device with int8 moments): int8_moments_v2 with device_v2's scalars from hyper.
sumsq_v1, sumsq_reduce_v1: grad_sumsq, the squared global gradient norm of the flat buffer: block partials (a
    shared-memory tree), then one fixed-order sum (deterministic, no atomics).
No version is GPU-only: all of them run in Numba's CUDA simulator.
"""
import math

import numba
import numpy as np
from numba import cuda

from gpullm_lessons.contracts import check_threads, check_version
# the contract both backends share; adamw_hyper and the rest stay importable from here (the engine imports them)
from gpullm_lessons.contracts.adamw import (HALF_BF16, HALF_FP16, HALF_NONE, HYPER_LEN, adamw_hyper,  # noqa: F401
                                            check_buffers, check_device_args, check_hyper, check_table, half_mode_of,
                                            host_scalars, check_moment_buffers, check_bf16_moments_version,
                                            MOMENTS_BF16, MOMENTS_INT8, INT8_BLOCK, check_int8_moments, int8_blocks)
from gpullm_lessons.kernels.numba.convert import U16, f32_to_bf16_bits, f32_to_f16_bits

from gpullm_lessons.kernels.numba._libdevice import libdevice
from gpullm_lessons.kernels.numba import launch_stream

ZERO = numba.float32(0.0)
MAX_BLOCKS = 4096   # grid cap: enough blocks to fill any GPU; the grid-stride loop covers the rest
SIM_MAX_BLOCKS = 4  # the cap in the CUDA simulator: each simulated thread runs in Python, so fewer threads
                    # striding further do the same work without thousands of thread start-ups


def _max_blocks() -> int:
    return SIM_MAX_BLOCKS if numba.config.ENABLE_CUDASIM else MAX_BLOCKS


# v1_decay: g = grad_scale * g; p = p - lr*wd*p where the thread's tensor decays. Thread i owns i, i + stride, ...
@cuda.jit
def adamw_v1_decay(params, grads, bounds, flags, lr_wd, grad_scale):
    start, stride = cuda.grid(1), cuda.gridsize(1)
    j = 0                                   # index of the tensor element i lies in (walked forward)
    for i in range(start, params.shape[0], stride):
        while bounds[j + 1] <= i:
            j += 1
        grads[i] = grads[i] * grad_scale
        if flags[j] != 0 and lr_wd != ZERO:   # (wd = 0: no decay at all, as the reference)
            p = params[i]
            params[i] = p - lr_wd * p


# v1_m: m = b1 m + (1 - b1) g
@cuda.jit
def adamw_v1_m(grads, m, beta1, one_minus_beta1):
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for i in range(start, m.shape[0], stride):
        m[i] = beta1 * m[i] + one_minus_beta1 * grads[i]


# v1_v: v = b2 v + (1 - b2) g^2
@cuda.jit
def adamw_v1_v(grads, v, beta2, one_minus_beta2):
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for i in range(start, v.shape[0], stride):
        g = grads[i]
        v[i] = beta2 * v[i] + one_minus_beta2 * (g * g)


# v1_update: p = p - lr mhat / (sqrt(vhat) + eps), and the optional half copy of p
@cuda.jit
def adamw_v1_update(params, m, v, half_out, half_mode, lr, bias1, bias2, eps):
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for i in range(start, params.shape[0], stride):
        denom = numba.float32(math.sqrt(v[i] / bias2)) + eps
        p = params[i] - (lr * (m[i] / bias1)) / denom
        params[i] = p
        if half_mode == 1:                  # float16 bits, round to nearest even
            half_out[i] = libdevice.float2half_rn(p)
        elif half_mode == 2:                # bfloat16 bits: keep the top 16 bits of float32, rounded
            bits = numba.uint32(libdevice.float_as_int(p))
            if p != p:                      # NaN: a quiet NaN with the sign kept
                half_out[i] = numba.uint16(((bits >> numba.uint32(16)) & numba.uint32(0x8000)) | numba.uint32(0x7FC0))
            else:                           # add 0x7FFF + (lowest kept bit): ties go to even
                rounded = bits + numba.uint32(0x7FFF) + ((bits >> numba.uint32(16)) & numba.uint32(1))
                half_out[i] = numba.uint16(rounded >> numba.uint32(16))


# v1_zero: g = 0, ready for the next backward pass to accumulate into
@cuda.jit
def adamw_v1_zero(grads):
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for i in range(start, grads.shape[0], stride):
        grads[i] = ZERO


# v2: everything in one pass. Thread i owns elements i, i + stride, ... of params, grads, m, v (n,) (and half_out);
# it reads each once, keeps the values in registers, and writes each once.
@cuda.jit(device=True, inline=True)   # inlined: a kernel calling a device function compiles to PTX without a GPU
def _v2_loop(params, grads, m, v, bounds, flags, half_out, half_mode, lr, lr_wd, beta1, one_minus_beta1,
             beta2, one_minus_beta2, bias1, bias2, eps, grad_scale):
    start, stride = cuda.grid(1), cuda.gridsize(1)
    j = 0                                   # index of the tensor element i lies in (walked forward)
    for i in range(start, params.shape[0], stride):
        while bounds[j + 1] <= i:
            j += 1
        g = grads[i] * grad_scale           # unscaled gradient
        p = params[i]
        if flags[j] != 0 and lr_wd != ZERO:
            p = p - lr_wd * p               # decoupled weight decay (skipped for wd = 0, as the reference)
        mi = beta1 * m[i] + one_minus_beta1 * g
        vi = beta2 * v[i] + one_minus_beta2 * (g * g)
        denom = numba.float32(math.sqrt(vi / bias2)) + eps
        p = p - (lr * (mi / bias1)) / denom
        params[i] = p
        m[i] = mi
        v[i] = vi
        grads[i] = ZERO
        if half_mode == 1:                  # float16 bits, round to nearest even
            half_out[i] = libdevice.float2half_rn(p)
        elif half_mode == 2:                # bfloat16 bits (see v1_update)
            bits = numba.uint32(libdevice.float_as_int(p))
            if p != p:
                half_out[i] = numba.uint16(((bits >> numba.uint32(16)) & numba.uint32(0x8000)) | numba.uint32(0x7FC0))
            else:
                rounded = bits + numba.uint32(0x7FFF) + ((bits >> numba.uint32(16)) & numba.uint32(1))
                half_out[i] = numba.uint16(rounded >> numba.uint32(16))


@cuda.jit
def adamw_v2(params, grads, m, v, bounds, flags, half_out, half_mode, lr, lr_wd, beta1, one_minus_beta1,
             beta2, one_minus_beta2, bias1, bias2, eps, grad_scale):
    _v2_loop(params, grads, m, v, bounds, flags, half_out, half_mode, lr, lr_wd, beta1, one_minus_beta1,
             beta2, one_minus_beta2, bias1, bias2, eps, grad_scale)


# the graph steps' gradient factor from hyper (1 / loss_scale, clip) and sumsq[0], the squared gradient norm:
# min(1, clip / (sqrt(sumsq) / loss_scale + 1e-6)) / loss_scale in float32 (GPUEngine._grad_scale is its host twin)
@cuda.jit(device=True, inline=True)
def _device_grad_scale(hyper, sumsq):
    inv_scale, clip = hyper[4], hyper[5]
    coef = numba.float32(1.0)
    if clip > ZERO:
        c = clip / (numba.float32(math.sqrt(sumsq[0])) * inv_scale + numba.float32(1e-6))
        if c < coef:
            coef = c
    return coef * inv_scale


# device_v2 (adamw_step_device): v2 with lr, lr*wd, bias1, bias2, 1/loss_scale and clip read from hyper (float32 (6,))
# and the clip factor computed from sumsq[0] (the squared gradient norm, grad_sumsq): what a CUDA graph can replay.
@cuda.jit
def adamw_device_v2(params, grads, m, v, bounds, flags, half_out, half_mode, hyper, sumsq, beta1, one_minus_beta1,
                    beta2, one_minus_beta2, eps):
    _v2_loop(params, grads, m, v, bounds, flags, half_out, half_mode, hyper[0], hyper[1], beta1, one_minus_beta1,
             beta2, one_minus_beta2, hyper[2], hyper[3], eps, _device_grad_scale(hyper, sumsq))


# bf16_moments_v2: v2's one pass with m and v stored as bfloat16 bits (uint16): read them back to float32 (exact),
# update and step in float32, write them back rounded to nearest even (f32_to_bf16_bits: + 0x7FFF + lowest kept bit).
@cuda.jit(device=True, inline=True)
def _bf16_moments_loop(params, grads, m, v, bounds, flags, half_out, half_mode, lr, lr_wd, beta1, one_minus_beta1,
                       beta2, one_minus_beta2, bias1, bias2, eps, grad_scale):
    start, stride = cuda.grid(1), cuda.gridsize(1)
    j = 0                                   # index of the tensor element i lies in (walked forward)
    for i in range(start, params.shape[0], stride):
        while bounds[j + 1] <= i:
            j += 1
        g = grads[i] * grad_scale
        p = params[i]
        if flags[j] != 0 and lr_wd != ZERO:
            p = p - lr_wd * p
        m_old = libdevice.int_as_float(numba.uint32(m[i]) << U16)   # bf16 bits -> float32: 16 zero bits appended
        v_old = libdevice.int_as_float(numba.uint32(v[i]) << U16)
        mi = beta1 * m_old + one_minus_beta1 * g
        vi = beta2 * v_old + one_minus_beta2 * (g * g)
        denom = numba.float32(math.sqrt(vi / bias2)) + eps
        p = p - (lr * (mi / bias1)) / denom  # the step from this step's float32 moments, before they are rounded
        params[i] = p
        m[i] = f32_to_bf16_bits(mi)         # round to nearest even, back to 2 bytes
        v[i] = f32_to_bf16_bits(vi)
        grads[i] = ZERO
        if half_mode == 1:
            half_out[i] = f32_to_f16_bits(p)
        elif half_mode == 2:
            half_out[i] = f32_to_bf16_bits(p)


@cuda.jit
def adamw_bf16_moments_v2(params, grads, m, v, bounds, flags, half_out, half_mode, lr, lr_wd, beta1, one_minus_beta1,
                          beta2, one_minus_beta2, bias1, bias2, eps, grad_scale):
    _bf16_moments_loop(params, grads, m, v, bounds, flags, half_out, half_mode, lr, lr_wd, beta1, one_minus_beta1,
                       beta2, one_minus_beta2, bias1, bias2, eps, grad_scale)


# bf16_moments_device_v2 (adamw_step_device, bf16 moments): the scalars from hyper and sumsq, as device_v2.
@cuda.jit
def adamw_bf16_moments_device_v2(params, grads, m, v, bounds, flags, half_out, half_mode, hyper, sumsq, beta1,
                                 one_minus_beta1, beta2, one_minus_beta2, eps):
    _bf16_moments_loop(params, grads, m, v, bounds, flags, half_out, half_mode, hyper[0], hyper[1], beta1,
                       one_minus_beta1, beta2, one_minus_beta2, hyper[2], hyper[3], eps, _device_grad_scale(hyper, sumsq))


# int8_moments_v2: AdamW's moments block-wise quantised (quant's format; see the module docstring). Thread block bid
# owns quantisation blocks bid, bid + gridDim, ...; in each, thread t owns elements lo + t, lo + t + threads, ...
Q8 = INT8_BLOCK                       # values per quantisation block (quant.BLOCK); threads <= Q8, a power of two
Q8_LEVELS_M = numba.float32(127.0)    # m: signed codes -127..127
Q8_LEVELS_V = numba.float32(255.0)    # sqrt(v): unsigned codes 0..255
Q8_HALF_LEVEL = numba.float32(0.5)    # a sqrt(v) code 0 reads as half a level (quant.dequantize_moments)
ONE = numba.float32(1.0)


@cuda.jit(device=True, inline=True)
def _int8_moments_loop(params, grads, m, v, m_scale, v_scale, bounds, flags, half_out, half_mode, lr, lr_wd, beta1,
                       one_minus_beta1, beta2, one_minus_beta2, bias1, bias2, eps, grad_scale):
    m_new = cuda.shared.array(Q8, numba.float32)    # the block's updated m and sqrt(v), until the new scales exist
    r_new = cuda.shared.array(Q8, numba.float32)
    red_m = cuda.shared.array(Q8, numba.float32)    # the trees of max |m| and max sqrt(v) over the block
    red_v = cuda.shared.array(Q8, numba.float32)
    t, threads = cuda.threadIdx.x, cuda.blockDim.x
    n = params.shape[0]
    j = 0                                           # index of the tensor element i lies in (walked forward)
    for b in range(cuda.blockIdx.x, m_scale.shape[0], cuda.gridDim.x):
        lo = b * Q8
        size = min(Q8, n - lo)                      # the last block may be shorter
        per_m = m_scale[b] / Q8_LEVELS_M            # the OLD scales (thread 0 overwrites them after the barriers)
        per_v = v_scale[b] / Q8_LEVELS_V
        amax_m = ZERO
        amax_v = ZERO
        for k in range(t, size, threads):           # 1. read back, update, keep the new moments in shared memory
            i = lo + k
            while bounds[j + 1] <= i:
                j += 1
            g = grads[i] * grad_scale
            p = params[i]
            if flags[j] != 0 and lr_wd != ZERO:
                p = p - lr_wd * p
            m_old = numba.float32(m[i]) * per_m     # q / 127 * a, as quant.dequantize_blockwise
            r = numba.float32(v[i])
            if r == ZERO:
                r = Q8_HALF_LEVEL
            s = r * per_v                           # sqrt(v) ~ r / 255 * a
            v_old = s * s
            mi = beta1 * m_old + one_minus_beta1 * g
            vi = beta2 * v_old + one_minus_beta2 * (g * g)
            denom = numba.float32(math.sqrt(vi / bias2)) + eps
            p = p - (lr * (mi / bias1)) / denom     # the step from this step's float32 moments, before quantising
            params[i] = p
            grads[i] = ZERO
            if half_mode == 1:
                half_out[i] = f32_to_f16_bits(p)
            elif half_mode == 2:
                half_out[i] = f32_to_bf16_bits(p)
            ri = numba.float32(math.sqrt(vi))       # v is stored as sqrt(v)
            m_new[k] = mi
            r_new[k] = ri
            if abs(mi) > amax_m:
                amax_m = abs(mi)
            if ri > amax_v:
                amax_v = ri
        red_m[t] = amax_m                           # 2. the block's new absmax: a tree in shared memory
        red_v[t] = amax_v
        cuda.syncthreads()
        half = threads // 2
        while half > 0:
            if t < half:
                if red_m[t + half] > red_m[t]:
                    red_m[t] = red_m[t + half]
                if red_v[t + half] > red_v[t]:
                    red_v[t] = red_v[t + half]
            cuda.syncthreads()
            half //= 2
        a_m = red_m[0]
        a_v = red_v[0]
        safe_m = a_m if a_m > ZERO else ONE         # an all-zero block: scale 0, codes 0 (0 / 1)
        safe_v = a_v if a_v > ZERO else ONE
        for k in range(t, size, threads):           # 3. quantise with the new scales: round to nearest, ties to even
            i = lo + k
            m[i] = numba.int8(libdevice.rintf(m_new[k] / safe_m * Q8_LEVELS_M))
            v[i] = numba.uint8(libdevice.rintf(r_new[k] / safe_v * Q8_LEVELS_V))
        if t == 0:
            m_scale[b] = a_m
            v_scale[b] = a_v
        cuda.syncthreads()                          # red_*[0], m_new, r_new are reused by the next block


@cuda.jit
def adamw_int8_moments_v2(params, grads, m, v, m_scale, v_scale, bounds, flags, half_out, half_mode, lr, lr_wd, beta1,
                          one_minus_beta1, beta2, one_minus_beta2, bias1, bias2, eps, grad_scale):
    _int8_moments_loop(params, grads, m, v, m_scale, v_scale, bounds, flags, half_out, half_mode, lr, lr_wd, beta1,
                       one_minus_beta1, beta2, one_minus_beta2, bias1, bias2, eps, grad_scale)


# int8_moments_device_v2 (adamw_step_device, int8 moments): the scalars from hyper and sumsq, as device_v2.
@cuda.jit
def adamw_int8_moments_device_v2(params, grads, m, v, m_scale, v_scale, bounds, flags, half_out, half_mode, hyper,
                                 sumsq, beta1, one_minus_beta1, beta2, one_minus_beta2, eps):
    _int8_moments_loop(params, grads, m, v, m_scale, v_scale, bounds, flags, half_out, half_mode, hyper[0], hyper[1],
                       beta1, one_minus_beta1, beta2, one_minus_beta2, hyper[2], hyper[3], eps, _device_grad_scale(hyper, sumsq))


# sumsq_v1 (grad_sumsq): stage 1, block b adds the squares of its grid-stride elements in a shared-memory tree into
# partial[b]; stage 2 (sumsq_reduce_v1, one block) adds the partials in a fixed order: deterministic, no atomics.
SUMSQ_THREADS = 128


@cuda.jit
def sumsq_v1(flat, partial):
    buf = cuda.shared.array(SUMSQ_THREADS, numba.float32)
    start, stride = cuda.grid(1), cuda.gridsize(1)
    s = ZERO
    for i in range(start, flat.shape[0], stride):
        s += flat[i] * flat[i]
    t = cuda.threadIdx.x
    buf[t] = s
    cuda.syncthreads()
    half = SUMSQ_THREADS // 2
    while half > 0:
        if t < half:
            buf[t] += buf[t + half]
        cuda.syncthreads()
        half //= 2
    if t == 0:
        partial[cuda.blockIdx.x] = buf[0]


@cuda.jit
def sumsq_reduce_v1(partial, out):
    if cuda.threadIdx.x == 0 and cuda.blockIdx.x == 0:
        s = ZERO
        for b in range(partial.shape[0]):
            s += partial[b]
        out[0] = s


KERNELS = {"v1_decay": adamw_v1_decay, "v1_m": adamw_v1_m, "v1_v": adamw_v1_v, "v1_update": adamw_v1_update,
           "v1_zero": adamw_v1_zero, "v2": adamw_v2, "device_v2": adamw_device_v2, "sumsq_v1": sumsq_v1,
           "sumsq_reduce_v1": sumsq_reduce_v1, "bf16_moments_v2": adamw_bf16_moments_v2,
           "bf16_moments_device_v2": adamw_bf16_moments_device_v2, "int8_moments_v2": adamw_int8_moments_v2,
           "int8_moments_device_v2": adamw_int8_moments_device_v2}
_F = "float32[::1]"
SIGNATURES = {
    "v1_decay": f"void({_F}, {_F}, int64[::1], uint8[::1], float32, float32)",   # params, grads, bounds, flags, ...
    "v1_m": f"void({_F}, {_F}, float32, float32)",                                # grads, m, b1, 1-b1
    "v1_v": f"void({_F}, {_F}, float32, float32)",                                # grads, v, b2, 1-b2
    "v1_update": f"void({_F}, {_F}, {_F}, uint16[::1], int32, float32, float32, float32, float32)",
    "v1_zero": f"void({_F})",
    "v2": f"void({_F}, {_F}, {_F}, {_F}, int64[::1], uint8[::1], uint16[::1], int32, "
          + ", ".join(["float32"] * 10) + ")",
    "device_v2": f"void({_F}, {_F}, {_F}, {_F}, int64[::1], uint8[::1], uint16[::1], int32, {_F}, {_F}, "
                 + ", ".join(["float32"] * 5) + ")",
    "bf16_moments_v2": f"void({_F}, {_F}, uint16[::1], uint16[::1], int64[::1], uint8[::1], uint16[::1], int32, "
                       + ", ".join(["float32"] * 10) + ")",
    "bf16_moments_device_v2": f"void({_F}, {_F}, uint16[::1], uint16[::1], int64[::1], uint8[::1], uint16[::1], "
                              f"int32, {_F}, {_F}, " + ", ".join(["float32"] * 5) + ")",
    "int8_moments_v2": f"void({_F}, {_F}, int8[::1], uint8[::1], {_F}, {_F}, int64[::1], uint8[::1], uint16[::1], "
                       "int32, " + ", ".join(["float32"] * 10) + ")",
    "int8_moments_device_v2": f"void({_F}, {_F}, int8[::1], uint8[::1], {_F}, {_F}, int64[::1], uint8[::1], "
                              f"uint16[::1], int32, {_F}, {_F}, " + ", ".join(["float32"] * 5) + ")",
    "sumsq_v1": f"void({_F}, {_F})",
    "sumsq_reduce_v1": f"void({_F}, {_F})",
}
GPU_ONLY = set()
VERSIONS = ("v1", "v2")
LAUNCHERS = ("adamw_step_device", "grad_sumsq")   # besides adamw_step; gathered by backends/_collect.py


# ---- the decay table --------------------------------------------------------------------------------------------

def decay_table(param_buffer, decay_names=None, arrays=None):
    """(bounds int64 (k+1,), flags uint8 (k,)) for the tensors of a ParamBuffer, in buffer order.

    bounds[j] .. bounds[j+1] are tensor j's elements of param_buffer.flat; flags[j] = 1 when its name is in
    decay_names (default gpullm_lessons.model.optim.DECAY_NAMES, nanoGPT's rule). arrays: where to put them ("numpy",
    "numba", "cupy"); None: NumPy for a NumPy buffer, CuPy for a CuPy one. Build it once, pass it every step.
    """
    from gpullm_lessons.model.optim import DECAY_NAMES
    decay_names = DECAY_NAMES if decay_names is None else tuple(decay_names)
    unknown = set(decay_names) - set(param_buffer.offsets)
    if unknown:
        raise ValueError(f"decay_table: decay_names has names the buffer does not: {sorted(unknown)}")
    stops = [param_buffer.offsets[name][1] for name in param_buffer.names]
    bounds = np.array([0] + stops, dtype=np.int64)
    flags = np.array([name in decay_names for name in param_buffer.names], dtype=np.uint8)
    if arrays is None:
        arrays = "cupy" if getattr(param_buffer.xp, "__name__", "numpy") == "cupy" else "numpy"
    if arrays == "numpy":
        return bounds, flags
    from gpullm_lessons.runtime.arrays import to_backend
    return to_backend(bounds, arrays), to_backend(flags, arrays)


# ---- the launch wrapper -----------------------------------------------------------------------------------------

def is_numpy(a) -> bool:
    return isinstance(a, np.ndarray)


_DEFAULT_TABLES = {}   # (array type, n) -> the "decay everything" table on the device ([0, n], [1]); the half stand-in


def _device(a, like):
    """A small NumPy array on the backend of `like` (NumPy stays NumPy; Numba device arrays get a copy)."""
    if is_numpy(like):
        return a
    if (type(like).__module__ or "").startswith("cupy"):
        import cupy
        return cupy.asarray(a)
    return cuda.to_device(a)


def _table_and_half(fn, params, n, decay_bounds, half_out, half_dtype):
    """(bounds, flags, half_out, half_mode) on the device of params: the decay table (None: decay everything) and
    the half copy's bits (a one-element stand-in when there is none); checks named after fn."""
    half_mode = half_mode_of(fn, half_out, half_dtype, n)
    if decay_bounds is None:
        key = (type(params).__module__, n)
        if key not in _DEFAULT_TABLES:
            _DEFAULT_TABLES[key] = (_device(np.array([0, n], np.int64), params), _device(np.ones(1, np.uint8), params))
        bounds, flags = _DEFAULT_TABLES[key]
    else:
        check_table(fn, decay_bounds, n, is_numpy)
        bounds, flags = decay_bounds
        if is_numpy(bounds):
            bounds = _device(np.ascontiguousarray(bounds, dtype=np.int64), params)
        if is_numpy(flags):
            flags = _device(np.ascontiguousarray(np.asarray(flags) != 0, dtype=np.uint8), params)
    if half_mode == HALF_NONE:   # a one-element stand-in, never written (half_mode 0)
        key = (type(params).__module__, "half")
        if key not in _DEFAULT_TABLES:
            _DEFAULT_TABLES[key] = _device(np.zeros(1, np.uint16), params)
        half_out = _DEFAULT_TABLES[key]
    elif str(half_out.dtype) != "uint16":
        half_out = half_out.view(np.uint16)                  # the kernels write the bits
    return bounds, flags, half_out, np.int32(half_mode)


def adamw_step(params, grads, m, v, lr, beta1, beta2, eps, weight_decay, step, decay_bounds=None, grad_scale=1.0,
               half_out=None, half_dtype=None, version="v2", threads=256, m_scale=None, v_scale=None):
    """One AdamW step in place: params, m, v updated, grads zeroed (all float32 (n,)); see the module docstring.

    step: the step count t after increment (1 on the first step). decay_bounds: None (decay every element) or
    (bounds, flags) from decay_table(). grad_scale multiplies the gradient first. half_out (n,): also receives the
    updated weights in half precision: float16 (half_dtype="float16") or bfloat16 bits in uint16
    (half_dtype="bfloat16"; ml_dtypes.bfloat16 arrays are accepted on the host too).
    m and v uint16 (both): bf16 moments, their bfloat16 bits (bf16_moments_v2; version "v2" only).
    m int8 and v uint8 with m_scale, v_scale float32 (ceil(n / 256),): block-wise 8-bit moments in quant's format,
    updated in place with their scales (int8_moments_v2; version "v2", threads 64, 128 or 256).
    """
    from gpullm_lessons.contracts import check_array
    fn = "adamw_step"
    check_version(fn, version, VERSIONS)
    threads = check_threads(fn, threads)
    n, moments = check_moment_buffers(fn, ("params", "grads", "m", "v"), (params, grads, m, v), check_array)
    if moments == MOMENTS_BF16:
        check_bf16_moments_version(fn, version)
    check_int8_moments(fn, moments, n, m_scale, v_scale, version, threads, check_array)
    check_hyper(fn, lr, beta1, beta2, eps, weight_decay, step, grad_scale)
    bounds, flags, half_out, mode = _table_and_half(fn, params, n, decay_bounds, half_out, half_dtype)
    if n == 0:
        return
    s = host_scalars(lr, beta1, beta2, eps, weight_decay, step, grad_scale)
    blocks = min(math.ceil(n / threads), _max_blocks())
    if moments == MOMENTS_INT8:   # one thread block per quantisation block (grid-stride over the blocks)
        KERNELS["int8_moments_v2"][min(int8_blocks(n), _max_blocks()), threads, launch_stream()](
            params, grads, m, v, m_scale, v_scale, bounds, flags, half_out, mode, s["lr"], s["lr_wd"], s["beta1"],
            s["one_minus_beta1"], s["beta2"], s["one_minus_beta2"], s["bias1"], s["bias2"], s["eps"], s["grad_scale"])
    elif moments == MOMENTS_BF16:
        KERNELS["bf16_moments_v2"][blocks, threads, launch_stream()](
            params, grads, m, v, bounds, flags, half_out, mode, s["lr"], s["lr_wd"], s["beta1"], s["one_minus_beta1"],
            s["beta2"], s["one_minus_beta2"], s["bias1"], s["bias2"], s["eps"], s["grad_scale"])
    elif version == "v2":
        KERNELS["v2"][blocks, threads, launch_stream()](params, grads, m, v, bounds, flags, half_out, mode, s["lr"], s["lr_wd"],
                                       s["beta1"], s["one_minus_beta1"], s["beta2"], s["one_minus_beta2"],
                                       s["bias1"], s["bias2"], s["eps"], s["grad_scale"])
    else:  # v1: five launches, each a full pass over its buffers
        KERNELS["v1_decay"][blocks, threads, launch_stream()](params, grads, bounds, flags, s["lr_wd"], s["grad_scale"])
        KERNELS["v1_m"][blocks, threads, launch_stream()](grads, m, s["beta1"], s["one_minus_beta1"])
        KERNELS["v1_v"][blocks, threads, launch_stream()](grads, v, s["beta2"], s["one_minus_beta2"])
        KERNELS["v1_update"][blocks, threads, launch_stream()](params, m, v, half_out, mode, s["lr"], s["bias1"], s["bias2"], s["eps"])
        KERNELS["v1_zero"][blocks, threads, launch_stream()](grads)


# ---- the graph-friendly step: scalars in GPU memory (adamw_hyper(), from contracts.adamw) ----------------------

def adamw_step_device(params, grads, m, v, hyper, sumsq, beta1, beta2, eps, decay_bounds=None, half_out=None,
                      half_dtype=None, threads=256, m_scale=None, v_scale=None):
    """adamw_step with lr, weight decay, the step count, the loss scale and the clip threshold read from `hyper`
    (adamw_hyper(), on the device) and the gradient's squared norm from `sumsq` (grad_sumsq()): the step a CUDA
    graph replays. The clip factor is min(1, clip / (sqrt(sumsq) / loss_scale + 1e-6)), as the host computes it.
    m and v uint16 (both): bf16 moments (bf16_moments_device_v2). m int8, v uint8 with m_scale, v_scale: block-wise
    8-bit moments (int8_moments_device_v2)."""
    from gpullm_lessons.contracts import check_array
    fn = "adamw_step_device"
    threads = check_threads(fn, threads)
    n, moments = check_moment_buffers(fn, ("params", "grads", "m", "v"), (params, grads, m, v), check_array)
    check_int8_moments(fn, moments, n, m_scale, v_scale, "v2", threads, check_array)
    check_device_args(fn, n, hyper, sumsq, check_array)
    check_hyper(fn, 1e-3, beta1, beta2, eps, 0.0, 1, 1.0)
    bounds, flags, half_out, mode = _table_and_half(fn, params, n, decay_bounds, half_out, half_dtype)
    if n == 0:
        return
    f = np.float32
    if moments == MOMENTS_INT8:
        KERNELS["int8_moments_device_v2"][min(int8_blocks(n), _max_blocks()), threads, launch_stream()](
            params, grads, m, v, m_scale, v_scale, bounds, flags, half_out, mode, hyper, sumsq, f(beta1),
            f(1.0 - beta1), f(beta2), f(1.0 - beta2), f(eps))
        return
    blocks = min(math.ceil(n / threads), _max_blocks())
    key = "bf16_moments_device_v2" if moments == MOMENTS_BF16 else "device_v2"
    KERNELS[key][blocks, threads, launch_stream()](params, grads, m, v, bounds, flags, half_out, mode, hyper, sumsq, f(beta1),
                                          f(1.0 - beta1), f(beta2), f(1.0 - beta2), f(eps))


SUMSQ_BLOCKS = 64       # grad_sumsq's default grid on a GPU; in the CUDA simulator 1 (every simulated thread runs in
                        # Python, and one block of a tiny model's buffer does the work of 64 with 1/64 of the
                        # thread start-ups)


def grad_sumsq(flat, out, blocks=None):
    """out[0] = sum of flat[i]^2 (flat float32 (n,), out float32 (1,)): the squared global gradient norm, in two
    deterministic stages (block partials, then one fixed-order sum). blocks: the grid (grid-stride loop: any count
    gives the sum, each count its own fixed order); default SUMSQ_BLOCKS on a GPU, 1 in the simulator."""
    from gpullm_lessons.contracts import check_array
    fn = "grad_sumsq"
    if not hasattr(flat, "shape") or len(flat.shape) != 1:
        raise ValueError(f"{fn}: flat must be a 1-D float32 array, got shape {getattr(flat, 'shape', None)}")
    check_array(fn, "flat", flat, flat.shape, "float32")
    check_array(fn, "out", out, (1,), "float32")
    n = int(flat.shape[0])
    if blocks is None:
        blocks = 1 if numba.config.ENABLE_CUDASIM else SUMSQ_BLOCKS
    blocks = min(max(1, math.ceil(n / SUMSQ_THREADS)), int(blocks))
    partial = _device(np.zeros(blocks, np.float32), flat)
    KERNELS["sumsq_v1"][blocks, SUMSQ_THREADS, launch_stream()](flat, partial)
    KERNELS["sumsq_reduce_v1"][1, 1, launch_stream()](partial, out)
