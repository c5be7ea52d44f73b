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
    kernels v1 (datt), v1_dpre (causal softmax backward) and v1_dqkv (dq, dk, dv). Runs in the simulator. The HIP backend adds a cuBLAS version (batched matmuls through CuPy) beside it.

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
FMT_F32, FMT_BF16, FMT_F16 = 0, 1, 2                  # element formats (the kernels' mode arguments)
HALF_FORMATS = {"bf16": FMT_BF16, "fp16": FMT_F16}
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


def _shape(x):
    return tuple(int(n) for n in x.shape)


def check_attention_args(fn, dout, qkv, att, dqkv, n_head):
    """Shapes and dtypes of attention_backward's arguments; raises naming the argument. Returns (B, T, C, nh)."""
    if not isinstance(n_head, (int, np.integer)) or n_head < 1:
        raise ValueError(f"{fn}: n_head must be a positive int, got {n_head!r}")
    if len(_shape(qkv)) != 3 or _shape(qkv)[2] % 3:
        raise ValueError(f"{fn}: qkv must be (B, T, 3C), got {_shape(qkv)}")
    B, T, C3 = _shape(qkv)
    C = C3 // 3
    if C % n_head:
        raise ValueError(f"{fn}: C = {C} is not divisible by n_head = {n_head}")
    expected = {"dout": (B, T, C), "att": (B, n_head, T, T), "dqkv": (B, T, C3)}
    for name, arr in (("dout", dout), ("att", att), ("dqkv", dqkv)):
        if _shape(arr) != expected[name]:
            raise ValueError(f"{fn}: {name} is {_shape(arr)}, expected {expected[name]} (from qkv {(B, T, C3)}, "
                             f"n_head {n_head})")
    for name, arr in (("dout", dout), ("qkv", qkv), ("att", att), ("dqkv", dqkv)):
        if np.dtype(arr.dtype) != np.float32:
            raise TypeError(f"{fn}: {name} must be float32, got {np.dtype(arr.dtype)}")
    return B, T, C, int(n_head)


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


def check_softmax_rows(fn, arrays, T=None):
    """(name, array) pairs: float32, 2-D (rows, T), all the same shape, rows a multiple of T. Returns (rows, T)."""
    return check_softmax_formats(fn, [(name, a, False) for name, a in arrays], None)[:2]


def half_format(fn, half):
    """half= as a format code: None -> FMT_F32, "bf16" -> FMT_BF16, "fp16" -> FMT_F16; ValueError otherwise."""
    if half is None:
        return FMT_F32
    if not isinstance(half, str) or half not in HALF_FORMATS:
        raise ValueError(f"{fn}: half={half!r} is not a half format; use half='bf16' or half='fp16' "
                         f"(or leave it None: float32 only)")
    return HALF_FORMATS[half]


def check_softmax_formats(fn, arrays, half):
    """(name, array, may_be_half) triples, None arrays skipped: 2-D (rows, T), all the same shape, rows a multiple
    of T; dtype float32, or uint16 (half bits of format `half`) where may_be_half is True, only uint16 where it is
    "half". A uint16 array without half=, an unknown half name, or half= with no uint16 array is an error naming
    the argument.
    Returns (rows, T, {name: FMT_F32 | FMT_BF16 | FMT_F16}) for the arrays given."""
    hf = half_format(fn, half)
    shape, first, formats = None, None, {}
    for name, a, may_be_half in arrays:
        if a is None:
            continue
        if not (hasattr(a, "shape") and hasattr(a, "dtype")):
            raise TypeError(f"{fn}: {name} must be an array, got {type(a).__name__}")
        if len(_shape(a)) != 2:
            raise ValueError(f"{fn}: {name} must be 2-D (B*nh*T, T), got shape {_shape(a)}")
        dtype = np.dtype(a.dtype)
        if may_be_half == "half" and dtype != np.uint16:
            raise TypeError(f"{fn}: {name} must be uint16 (half bits, with half=), got {dtype}")
        if dtype == np.uint16 and may_be_half:
            if half is None:
                raise TypeError(f"{fn}: {name} is uint16 (half bits) but half= is not given: say half='bf16' or "
                                f"half='fp16'")
            formats[name] = hf
        elif dtype == np.float32:
            formats[name] = FMT_F32
        else:
            allowed = "float32 or uint16 (half bits, with half=)" if may_be_half else "float32"
            raise TypeError(f"{fn}: {name} must be {allowed}, got {dtype}")
        if shape is not None and _shape(a) != shape:
            raise ValueError(f"{fn}: {name} is {_shape(a)} but {first} is {shape}")
        shape, first = shape or _shape(a), first or name
    if half is not None and all(f == FMT_F32 for f in formats.values()):
        names = ", ".join(name for name, _, may_be_half in arrays if may_be_half)
        raise ValueError(f"{fn}: half={half!r} given but no half array ({names}) is uint16 half bits")
    rows, T = shape
    if T == 0 or rows % T:
        raise ValueError(f"{fn}: rows = {rows} must be a multiple of T = {T} (B*nh blocks of T query rows)")
    return rows, T, formats


def _is_uint16(a):
    return hasattr(a, "dtype") and np.dtype(a.dtype) == np.uint16


def _extent(a):
    """(address of a's first byte, address past its last byte), or None where the memory cannot be told."""
    if (type(a).__module__ or "").startswith("cupy"):
        ptr = int(a.data.ptr)
    else:
        iface = getattr(a, "__cuda_array_interface__", None) or getattr(a, "__array_interface__", None)
        if iface is None:
            return None
        ptr = int(iface["data"][0])
    shape, itemsize = _shape(a), np.dtype(a.dtype).itemsize
    if 0 in shape:
        return None
    strides = tuple(int(st) for st in a.strides) if getattr(a, "strides", None) else None
    if strides is None:
        return ptr, ptr + int(np.prod(shape)) * itemsize
    lo = ptr + sum((n - 1) * st for n, st in zip(shape, strides) if st < 0)
    hi = ptr + sum((n - 1) * st for n, st in zip(shape, strides) if st > 0) + itemsize
    return lo, hi


def check_in_place(fn, out_name, out, in_name, inp):
    """out may be inp itself (the same memory, shape, strides and dtype: in place) or memory apart from it; a partial
    overlap is a ValueError naming both (the kernels read each element before they write it, nothing more)."""
    a, b = _extent(out), _extent(inp)
    if a is None or b is None or a[1] <= b[0] or b[1] <= a[0]:
        return
    same = (a == b and _shape(out) == _shape(inp) and np.dtype(out.dtype) == np.dtype(inp.dtype)
            and tuple(getattr(out, "strides", ())) == tuple(getattr(inp, "strides", ())))
    if not same:
        raise ValueError(f"{fn}: {out_name} overlaps {in_name} but is not the same array: write {out_name} in place "
                         f"of {in_name} ({out_name} = {in_name}, the same buffer) or to memory apart from it")


def check_softmax_forward_args(fn, pre, att, att_half, half):
    """attention_softmax_forward's arguments: pre float32, or uint16 half bits (format half) when att is None and
    att_half is given (half in, half out; att_half may then be pre, in place); att float32 or None; att_half uint16 or
    None (not both None). Returns (rows, T, att_half format or FMT_F32, pre format)."""
    if att is None and att_half is None:
        raise ValueError(f"{fn}: att and att_half are both None: give att (float32) and/or att_half (uint16 half "
                         f"bits, with half='bf16' or 'fp16')")
    if att_half is None and half is not None:
        half_format(fn, half)
        raise ValueError(f"{fn}: half={half!r} given but att_half is None: pass att_half (uint16) to write half bits")
    pre_half = _is_uint16(pre)
    if pre_half and att is not None:
        raise TypeError(f"{fn}: pre must be float32, got uint16: half-bit pre (half in, half out) needs att=None "
                        f"and att_half= (uint16) with half='bf16' or 'fp16'")
    rows, T, formats = check_softmax_formats(fn, (("pre", pre, pre_half), ("att", att, False),
                                                  ("att_half", att_half, "half")), half)
    if pre_half:
        check_in_place(fn, "att_half", att_half, "pre", pre)
    return rows, T, formats.get("att_half", FMT_F32), formats["pre"]


def check_softmax_backward_args(fn, att, datt, dpre, half):
    """attention_softmax_backward's arguments: att and dpre float32 or uint16 half bits (format half); datt float32,
    or uint16 half bits when att and dpre are half bits too (all one format; dpre may then be datt, in place).
    Returns (rows, T, att format, dpre format, datt format)."""
    datt_half = _is_uint16(datt)
    rows, T, formats = check_softmax_formats(fn, (("att", att, True), ("datt", datt, datt_half),
                                                  ("dpre", dpre, True)), half)
    if datt_half:
        f32 = [name for name in ("att", "dpre") if formats[name] == FMT_F32]
        if f32:
            raise TypeError(f"{fn}: datt must be float32, got uint16: half-bit datt needs att and dpre as uint16 half "
                            f"bits of the same format too, but {' and '.join(f32)} {'is' if len(f32) == 1 else 'are'}"
                            f" float32")
        check_in_place(fn, "dpre", dpre, "datt", datt)
    return rows, T, formats["att"], formats["dpre"], formats["datt"]


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
