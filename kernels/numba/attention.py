"""Causal multi-head self-attention backward, in Numba CUDA.

Forward (per batch b and head h, q/k/v read straight from qkv (B, T, 3C) at channel offsets 0, C, 2C + h*hs):
    att = softmax(q k^T * scale, causal)   (T, T)   scale = 1/sqrt(hs), saved by the forward
    y   = att v                            (T, hs)  written to out[b, :, h*hs:(h+1)*hs]
Backward, in five steps (each a kernel; every thread owns one output element):
    datt[t, s] = sum_d dy[t, d] v[s, d]                         s <= t   (B, nh, T, T) scratch
    dpre[t, s] = scale * att[t, s] (datt[t, s] - sum_s' att[t, s'] datt[t, s'])   (softmax backward, causal)
    dq[t, d]   = sum_{s <= t} dpre[t, s] k[s, d]
    dk[s, d]   = sum_{t >= s} dpre[t, s] q[t, d]
    dv[s, d]   = sum_{t >= s} att[t, s] dy[t, d]
Masked entries (s > t) have att = 0, so they never contribute: the loops skip them instead of multiplying by 0,
which halves the work (the causal mask is a saving in backward too).

v1: naive, one thread per output element, every sum a loop over global memory (the steps above, literally):
    kernels v1 (datt), v1_dpre (causal softmax backward) and v1_dqkv (dq, dk, dv). Runs in the simulator. The HIP
    backend adds a cuBLAS version (batched matmuls through CuPy) beside it.

For the training loop (gpullm_lessons.engine), which does the matmuls through cuBLAS and keeps att (B*nh*T, T):
    v1_softmax_fwd                   causal softmax of the scaled scores, one thread per row (launcher
                                     attention_softmax_forward); the HIP twin is attention_softmax_fwd (block per row)
    attention_softmax_backward       the launcher of v1_dpre on (B*nh*T, T) rows (HIP: attention_dpre)
In half precision the engine keeps the probabilities as bf16 / fp16 bits (uint16) for the matmuls; the launchers'
keyword arguments att_half= and half= ("bf16" | "fp16") select these versions:
    v1_softmax_fwd_half              the same forward, writing att_half (the float32 values rounded to half bits, as
                                     convert.py rounds) and, when att is given, the float32 att too (HIP:
                                     attention_softmax_fwd_bf16 / _f16, attention_softmax_fwd_f32_bf16 / _f32_f16)
    v1_dpre_half                     the backward with att and/or dpre as half bits, converted in registers; datt
                                     float32, every sum fp32 (HIP: attention_dpre_<att format>_<dpre format>)
Half inputs too (half in, half out, one format given by half=): the raw scores pre and the gradient datt as bits:
    v1_softmax_fwd_half_in           the forward reading pre as half bits, writing att_half only (att None); att_half
                                     may be pre (HIP: attention_softmax_fwd_<bf16|f16>_in, warp: _w{K}_<bf16|f16>_in)
    v1_dpre_half_in                  the backward with att, datt and dpre all half bits of one format; dpre may be
                                     datt (HIP: attention_dpre_<fmt>_<fmt>_<fmt>, warp: attention_dpre_w{K}_<fmt>_...)
The half rounding is convert.py's device functions f32_to_bf16_bits / f32_to_f16_bits (those of its f32_to_bf16_v1 /
f32_to_f16_v1); bf16_bits_to_f32 and f16_bits_to_f32 here are exact. Device functions are inline=True: a kernel
calling a non-inlined one cannot be compiled to PTX without a GPU.
"""
import math

import numba
import numpy as np
from numba import cuda, float32

from gpullm_lessons.contracts.attention import (FMT_BF16, FMT_F16, FMT_F32, HALF_FORMATS,  # noqa: F401 - re-exported
                                                check_attention_args, check_in_place, check_softmax_backward_args,
                                                check_softmax_formats, check_softmax_forward_args, check_softmax_rows,
                                                half_format)
from gpullm_lessons.kernels.numba._libdevice import libdevice
from gpullm_lessons.kernels.numba.convert import EXP, F16_MANT, SIGN16, U13, U16, f32_to_half_bits
from gpullm_lessons.kernels.numba import launch_stream, device_scratch


# v1, step 1: datt[b, h, t, s] = sum_d dout[b, t, h*hs + d] * v[b, s, h*hs + d], zero above the diagonal
@cuda.jit
def attention_datt_v1(dout, qkv, datt, n_head):
    bh, t = cuda.blockIdx.x, cuda.blockIdx.y  # one block per (b*h, t) row, threads over s
    B, T, C3 = qkv.shape
    C = C3 // 3
    hs = C // n_head
    b, h = bh // n_head, bh % n_head
    for s in range(cuda.threadIdx.x, T, cuda.blockDim.x):
        acc = float32(0.0)
        if s <= t:
            for d in range(hs):
                acc += dout[b, t, h * hs + d] * qkv[b, s, 2 * C + h * hs + d]
        datt[b, h, t, s] = acc


# v1, step 2: causal softmax backward with the 1/sqrt(hs) scale folded in; one thread per (b, h, t) row
@cuda.jit
def attention_dpre_v1(att, datt, dpre, scale):
    B, nh, T, _ = att.shape
    row = cuda.grid(1)
    if row >= B * nh * T:
        return
    b, rest = row // (nh * T), row % (nh * T)
    h, t = rest // T, rest % T
    dot = float32(0.0)
    for s in range(t + 1):
        dot += att[b, h, t, s] * datt[b, h, t, s]
    for s in range(T):
        dpre[b, h, t, s] = scale * att[b, h, t, s] * (datt[b, h, t, s] - dot) if s <= t else float32(0.0)


# v1, steps 3-5: dq, dk, dv written into dqkv (B, T, 3C); one thread per element of dqkv
@cuda.jit
def attention_dqkv_v1(dout, qkv, att, dpre, dqkv, n_head):
    B, T, C3 = qkv.shape
    C = C3 // 3
    hs = C // n_head
    i = cuda.grid(1)
    if i >= B * T * C3:
        return
    b, rest = i // (T * C3), i % (T * C3)
    t, c = rest // C3, rest % C3
    part, cc = c // C, c % C  # part 0: q, 1: k, 2: v
    h, d = cc // hs, cc % hs
    acc = float32(0.0)
    if part == 0:  # dq[t, d] = sum_{s <= t} dpre[t, s] k[s, d]
        for s in range(t + 1):
            acc += dpre[b, h, t, s] * qkv[b, s, C + h * hs + d]
    elif part == 1:  # dk[t, d] = sum_{t2 >= t} dpre[t2, t] q[t2, d]
        for t2 in range(t, T):
            acc += dpre[b, h, t2, t] * qkv[b, t2, h * hs + d]
    else:  # dv[t, d] = sum_{t2 >= t} att[t2, t] dy[t2, d]
        for t2 in range(t, T):
            acc += att[b, h, t2, t] * dout[b, t2, h * hs + d]
    dqkv[b, t, c] = acc


@cuda.jit(device=True, inline=True)
def _causal_max_inv(pre, row, t, scale):
    """(max, 1 / sum of exp(. - max)) of scale * pre[row, 0..t]: the statistics of one causal softmax row."""
    mx = scale * pre[row, 0]
    for s in range(1, t + 1):
        mx = max(mx, scale * pre[row, s])
    total = float32(0.0)
    for s in range(t + 1):
        total += math.exp(scale * pre[row, s] - mx)
    return mx, float32(1.0) / total


# Forward (the training loop): causal softmax of the scaled scores; one thread per (b, h, t) row of pre (rows, T),
# query position t = row % T. att may be pre (each thread reads its row before writing it).
@cuda.jit
def attention_softmax_fwd_v1(pre, att, scale):
    rows, T = pre.shape
    row = cuda.grid(1)
    if row >= rows:
        return
    t = row % T
    mx, inv = _causal_max_inv(pre, row, t, scale)
    for s in range(T):
        att[row, s] = math.exp(scale * pre[row, s] - mx) * inv if s <= t else float32(0.0)


# ---- half precision: bf16 / fp16 bits (uint16) in and out of the softmax kernels --------------------------------
# the element formats FMT_F32, FMT_BF16, FMT_F16 (the kernels' mode arguments) are contracts.attention's
ZERO32 = numba.uint32(0)
F16_EXP_SHIFT = numba.uint32(10)                      # fp16: 5 exponent bits above 10 mantissa bits
F16_EXP_MAX = numba.uint32(0x1F)
EXP_REBIAS = numba.uint32(127 - 15)                   # float32 exponent bias minus fp16's
U23 = numba.uint32(23)
TWO_M24 = float32(2.0 ** -24)                         # an fp16 subnormal is mantissa * 2**-24 (exact in float32)


@cuda.jit(device=True, inline=True)
def bf16_bits_to_f32(b):
    """bfloat16 bits -> float32, exact: the 16 bits on top of 16 zero bits."""
    return libdevice.int_as_float(numba.uint32(b) << U16)


@cuda.jit(device=True, inline=True)
def f16_bits_to_f32(b):
    """float16 bits -> float32, exact: rebias the exponent (normal), mantissa * 2**-24 (subnormal), inf/NaN kept."""
    h = numba.uint32(b)
    sign = (h & SIGN16) << U16
    e = (h >> F16_EXP_SHIFT) & F16_EXP_MAX
    m = h & F16_MANT
    if e == ZERO32:                                   # zero or subnormal
        v = float32(m) * TWO_M24
        return -v if sign != ZERO32 else v
    if e == F16_EXP_MAX:                              # inf or NaN: float32 exponent all ones, mantissa on top
        return libdevice.int_as_float(sign | EXP | (m << U13))
    return libdevice.int_as_float(sign | ((e + EXP_REBIAS) << U23) | (m << U13))


@cuda.jit(device=True, inline=True)
def load_f32(x32, x16, row, s, fmt):
    """Element (row, s) as float32: of x32 (fmt FMT_F32) or of the half bits x16 (FMT_BF16 / FMT_F16)."""
    if fmt == FMT_F32:
        return x32[row, s]
    if fmt == FMT_BF16:
        return bf16_bits_to_f32(x16[row, s])
    return f16_bits_to_f32(x16[row, s])


@cuda.jit(device=True, inline=True)
def half_bits_to_f32(b, fmt):
    """Half bits of format fmt (FMT_BF16 / FMT_F16) -> float32, exact."""
    if fmt == FMT_BF16:
        return bf16_bits_to_f32(b)
    return f16_bits_to_f32(b)


# Forward, half output: as attention_softmax_fwd_v1, and att_h[row, s] = the same float32 value rounded to half bits
# (half_mode FMT_BF16 / FMT_F16); att[row, s] is written too when write_f32 (else att is a placeholder, never touched).
@cuda.jit
def attention_softmax_fwd_half_v1(pre, att, att_h, write_f32, half_mode, scale):
    rows, T = pre.shape
    row = cuda.grid(1)
    if row >= rows:
        return
    t = row % T
    mx, inv = _causal_max_inv(pre, row, t, scale)
    for s in range(T):
        v = math.exp(scale * pre[row, s] - mx) * inv if s <= t else float32(0.0)
        if write_f32:
            att[row, s] = v
        att_h[row, s] = f32_to_half_bits(v, half_mode)


# Forward, half in and half out (one format, half_mode FMT_BF16 / FMT_F16): pre16 half bits (rows, T), converted
# exactly to float32 on every read; att_h[row, s] the probabilities rounded to half bits. att_h may be pre16 (in place:
# each element is read before it is written, by the same thread). Every sum fp32.
@cuda.jit
def attention_softmax_fwd_half_in_v1(pre16, att_h, half_mode, scale):
    rows, T = pre16.shape
    row = cuda.grid(1)
    if row >= rows:
        return
    t = row % T
    mx = scale * half_bits_to_f32(pre16[row, 0], half_mode)
    for s in range(1, t + 1):
        mx = max(mx, scale * half_bits_to_f32(pre16[row, s], half_mode))
    total = float32(0.0)
    for s in range(t + 1):
        total += math.exp(scale * half_bits_to_f32(pre16[row, s], half_mode) - mx)
    inv = float32(1.0) / total
    for s in range(T):
        v = math.exp(scale * half_bits_to_f32(pre16[row, s], half_mode) - mx) * inv if s <= t else float32(0.0)
        att_h[row, s] = f32_to_half_bits(v, half_mode)


# Backward, half att and/or dpre: one thread per row of (rows, T); att is read from att32 (att_mode FMT_F32) or from
# the half bits att16, dpre written to dpre32 (dpre_mode FMT_F32) or rounded into dpre16. The unused array of each
# pair is a placeholder, never touched. datt float32; the row sum in fp32.
@cuda.jit
def attention_dpre_half_v1(att32, att16, datt, dpre32, dpre16, att_mode, dpre_mode, scale):
    rows, T = datt.shape
    row = cuda.grid(1)
    if row >= rows:
        return
    t = row % T
    dot = float32(0.0)
    for s in range(t + 1):
        dot += load_f32(att32, att16, row, s, att_mode) * datt[row, s]
    for s in range(T):
        v = scale * load_f32(att32, att16, row, s, att_mode) * (datt[row, s] - dot) if s <= t else float32(0.0)
        if dpre_mode == FMT_F32:
            dpre32[row, s] = v
        else:
            dpre16[row, s] = f32_to_half_bits(v, dpre_mode)


# Backward, all half (att16, datt16, dpre16 half bits of one format, mode FMT_BF16 / FMT_F16): one thread per row; the
# row sum in fp32. dpre16 may be datt16 (in place: the row's datt is read for the sum before any of it is written, and
# each element of the last pass is read before it is written).
@cuda.jit
def attention_dpre_half_in_v1(att16, datt16, dpre16, mode, scale):
    rows, T = datt16.shape
    row = cuda.grid(1)
    if row >= rows:
        return
    t = row % T
    dot = float32(0.0)
    for s in range(t + 1):
        dot += half_bits_to_f32(att16[row, s], mode) * half_bits_to_f32(datt16[row, s], mode)
    for s in range(T):
        v = float32(0.0)
        if s <= t:
            v = scale * half_bits_to_f32(att16[row, s], mode) * (half_bits_to_f32(datt16[row, s], mode) - dot)
        dpre16[row, s] = f32_to_half_bits(v, mode)


KERNELS = {"v1": attention_datt_v1, "v1_dpre": attention_dpre_v1, "v1_dqkv": attention_dqkv_v1,
           "v1_softmax_fwd": attention_softmax_fwd_v1, "v1_softmax_fwd_half": attention_softmax_fwd_half_v1,
           "v1_dpre_half": attention_dpre_half_v1, "v1_softmax_fwd_half_in": attention_softmax_fwd_half_in_v1,
           "v1_dpre_half_in": attention_dpre_half_in_v1}
SIGNATURES = {
    "v1": "void(float32[:, :, ::1], float32[:, :, ::1], float32[:, :, :, ::1], int64)",
    "v1_dpre": "void(float32[:, :, :, ::1], float32[:, :, :, ::1], float32[:, :, :, ::1], float32)",
    "v1_dqkv": "void(float32[:, :, ::1], float32[:, :, ::1], float32[:, :, :, ::1], float32[:, :, :, ::1], "
               "float32[:, :, ::1], int64)",
    "v1_softmax_fwd": "void(float32[:, ::1], float32[:, ::1], float32)",
    # pre, att, att_h, write_f32, half_mode, scale
    "v1_softmax_fwd_half": "void(float32[:, ::1], float32[:, ::1], uint16[:, ::1], int64, int64, float32)",
    # att32, att16, datt, dpre32, dpre16, att_mode, dpre_mode, scale
    "v1_dpre_half": "void(float32[:, ::1], uint16[:, ::1], float32[:, ::1], float32[:, ::1], uint16[:, ::1], int64, "
                    "int64, float32)",
    # pre16, att_h, half_mode, scale
    "v1_softmax_fwd_half_in": "void(uint16[:, ::1], uint16[:, ::1], int64, float32)",
    # att16, datt16, dpre16, mode, scale
    "v1_dpre_half_in": "void(uint16[:, ::1], uint16[:, ::1], uint16[:, ::1], int64, float32)",
}
GPU_ONLY = set()
VERSIONS = ("v1",)


def attention_backward(dout, qkv, att, dqkv, n_head, version="v1"):
    """dout (B,T,C), qkv (B,T,3C), att (B,nh,T,T) -> dqkv (B,T,3C). Scratch (B,nh,T,T) x2 allocated here."""
    if version not in VERSIONS:
        raise ValueError(f"attention_backward: version {version!r} unknown; Numba versions: {', '.join(VERSIONS)}")
    B, T, C, nh = check_attention_args("attention_backward", dout, qkv, att, dqkv, n_head)
    datt = device_scratch((B, nh, T, T), dtype=np.float32)
    dpre = device_scratch((B, nh, T, T), dtype=np.float32)
    threads = min(128, max(32, T))
    attention_datt_v1[(B * nh, T), threads, launch_stream()](dout, qkv, datt, nh)
    rows = B * nh * T
    attention_dpre_v1[(rows + 127) // 128, 128, launch_stream()](att, datt, dpre, np.float32(1.0 / math.sqrt(C // nh)))
    n = B * T * 3 * C
    attention_dqkv_v1[(n + 255) // 256, 256, launch_stream()](dout, qkv, att, dpre, dqkv, nh)


def attention_softmax_forward(pre, att, scale, att_half=None, half=None):
    """att (rows, T) = causal softmax of scale * pre (rows, T), rows = B*nh*T; att may be pre (in place).

    att_half: None, or uint16 (rows, T): the same probabilities rounded to half bits of format half ("bf16" |
    "fp16"). att may be None when att_half is given (then only the half bits are written).
    pre may be uint16 half bits of format half when att is None (half in, half out; att_half may be pre)."""
    fn = "attention_softmax_forward"
    rows, T, hf, pf = check_softmax_forward_args(fn, pre, att, att_half, half)
    if not rows:
        return
    grid = ((rows + 127) // 128, 128)
    if pf != FMT_F32:
        attention_softmax_fwd_half_in_v1[(*grid, launch_stream())](pre, att_half, pf, np.float32(scale))
    elif hf == FMT_F32:
        attention_softmax_fwd_v1[(*grid, launch_stream())](pre, att, np.float32(scale))
    else:   # att None: pre stands in for it (never written when write_f32 is 0)
        attention_softmax_fwd_half_v1[(*grid, launch_stream())](pre, pre if att is None else att, att_half, int(att is not None), hf,
                                            np.float32(scale))


def attention_softmax_backward(att, datt, dpre, scale, half=None):
    """dpre = scale * causal softmax backward of datt through att, all (rows, T) with rows = B*nh*T.

    att and dpre: float32, or uint16 half bits of format half ("bf16" | "fp16"), converted in registers; datt is
    float32, or half bits too when att and dpre are (all one format); dpre may be datt (in place) when both are float32
    or both half bits (the same array)."""
    fn = "attention_softmax_backward"
    rows, T, af, of, df = check_softmax_backward_args(fn, att, datt, dpre, half)
    if not rows:
        return
    if df != FMT_F32:
        attention_dpre_half_in_v1[(rows + 127) // 128, 128, launch_stream()](att, datt, dpre, df, np.float32(scale))
        return
    if af == FMT_F32 and of == FMT_F32:
        shape4 = (1, rows // T, T, T)
        attention_dpre_v1[(rows + 127) // 128, 128, launch_stream()](att.reshape(shape4), datt.reshape(shape4),
                                                     dpre.reshape(shape4), np.float32(scale))
        return
    half_bits = att if af != FMT_F32 else dpre           # a uint16 array: the placeholder of the unused half slot
    attention_dpre_half_v1[(rows + 127) // 128, 128, launch_stream()](att if af == FMT_F32 else datt, half_bits, datt,
                                                     dpre if of == FMT_F32 else datt,
                                                     dpre if of != FMT_F32 else half_bits, af, of, np.float32(scale))
