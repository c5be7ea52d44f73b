"""fused: the glue the training engine runs between matrix products, one launch each (N = B*T rows, C = nh*hs).

    bias_add(inp, bias, out, res=None)                       out (N,C) = inp + bias[col] (+ res); out may be inp/res
    bias_gelu_forward(inp, bias, pre, out, half=None)        pre = inp + bias (pre may be inp, or None: not
                                                             written); out = gelu_tanh(pre); pre uint16 (with
                                                             half): GELU's input kept as half bits, out = gelu_tanh
                                                             of that rounded value
    gelu_half(inp, out, half)                                out = gelu_tanh(inp), half bits in and out (the
                                                             recompute of a half pre: the same bits)
    split_heads(inp, col0, out, B, T, nh, bias=None, half=None)
                                                             out[b*nh+h, t, d] = inp[b*T+t, col0 + h*hs + d] (+ bias)
    merge_heads(inp, out, col0, B, T, nh, half=None)         out[b*T+t, col0 + h*hs + d] = inp[b*nh+h, t, d]
    colsum_convert(inp, colsum, out=None, half=None, gelu_of=None, gelu_bias=None)
                                                             colsum (C,) = sum over rows (deterministic); out=half(inp);
                                                             gelu_of, gelu_bias: of inp * gelu'(gelu_of + gelu_bias)
                                                             instead (GELU's backward fused in: the fc layer's dfc
                                                             without a float32 copy); gelu_of uint16 alone:
                                                             GELU's input as half bits, its bias in
    layernorm_forward_half(inp, weight, bias, out, mean, rstd, half, eps=1e-5)
                                                             LayerNorm (as layernorm_forward), out as half bits

`half` is None (the output is float32) or "bf16" / "fp16": the output is then a uint16 array of the 16-bit bits,
rounded to nearest even by the device functions of kernels/numba/convert.py (bit-exact with gpullm_lessons.model.precision
and NumPy). The HIP twins (kernels/hip/fused.cu, backends/hip/fused.py) have the same names and signatures and
share the argument checks below; they are the fast path (coalesced 2-D layouts, warp-per-row LayerNorm). These
Numba versions are the plain ones, written to be read and to run in the simulator.

Versions (KERNELS keys; a "_half" key is the same kernel compiled for a uint16 output; the wrappers take version="v1"):
bias_add_v1: one thread per element of (N, C), grid-stride; has_res=0 leaves res unread.
bias_gelu_forward_v1: one thread per element, writes pre (float32; has_pre=0: not written) and out (float32).
bias_gelu_forward_v1_half: the same kernel, out uint16 (mode 1 bf16, 2 fp16).
bias_gelu_forward_v1_hpre: one thread per element, pre and out uint16: pre = half(inp + bias), out = half(gelu of the
    rounded pre), so that gelu_half_v1 of pre rebuilds out bit for bit.
gelu_half_v1: one thread per element, half bits in and out.
split_heads_v1: one thread per element of out (B*nh, T, hs), float32 out; has_bias=0 leaves bias unread.
split_heads_v1_half: the same kernel, out uint16 bits.
merge_heads_v1: one thread per element of inp (B*nh, T, hs), float32 out (N, ld).
merge_heads_v1_half: the same kernel, out uint16 bits.
colsum_partials_v1: colsum stage 1, one thread per (chunk of ROWS_PER_CHUNK rows, column): the chunk's sum in row
    order into partial (chunks, C); with mode 1/2 it also writes the half bits of every element it reads into out.
colsum_partials_v1_gelu: colsum_partials_v1 (mode 1/2) of inp * gelu'(pre + gbias[c]), the float32 operations of
    gelu_backward_v1 (kernels/numba/gelu.py) in the same order.
colsum_partials_v1_gelu_hpre: the same with GELU's input read from half bits pre (its bias in, no gbias).
colsum_reduce_v1: colsum stage 2, one thread per column adds the chunks in order (deterministic: no atomics).
layernorm_forward_half_v1: one thread per row (mean, variance from a second pass, write), out uint16 bits.
No version is GPU-only: all of them run in Numba's CUDA simulator.
"""
import math

import numba
import numpy as np
from numba import cuda

from gpullm_lessons.contracts import check_threads, check_version
from gpullm_lessons.contracts.fused import (HALF_MODES, check_bias_add, check_bias_gelu,  # noqa: F401 - re-exported
                                            check_colsum, check_gelu_half, check_layernorm_half, check_merge,
                                            check_split, half_mode, half_pre)
from gpullm_lessons.kernels.numba.attention import half_bits_to_f32   # mode 1 bf16, 2 fp16: FMT_BF16, FMT_F16
from gpullm_lessons.kernels.numba.convert import f32_to_half_bits
from gpullm_lessons.kernels.numba import launch_stream, device_scratch

MAX_BLOCKS = 4096        # grid cap: enough blocks to fill any GPU; the grid-stride loop covers the rest
ROWS_PER_CHUNK = 32      # colsum stage 1: rows summed by one thread
GELU_SCALE = numba.float32(math.sqrt(2.0 / math.pi))
GELU_CUBE = numba.float32(0.044715)
F_HALF = numba.float32(0.5)
F_ONE = numba.float32(1.0)
F_ZERO = numba.float32(0.0)
F_THREE = numba.float32(3.0)


# bias_add_v1: thread i owns elements i, i + stride, ... of the flattened (N, C); out may be inp or res.
@cuda.jit
def bias_add_v1(inp, bias, res, out, has_res):
    N, C = out.shape
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for i in range(start, N * C, stride):
        r = i // C
        c = i - r * C
        v = inp[r, c] + bias[c]
        if has_res != 0:
            v += res[r, c]
        out[r, c] = v


@cuda.jit(device=True, inline=True)
def gelu_tanh(x):
    """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), gelu_forward_v1's float32 operations in the same order."""
    return F_HALF * x * (F_ONE + math.tanh(GELU_SCALE * (x + GELU_CUBE * x * x * x)))


@cuda.jit(device=True, inline=True)
def gelu_grad(x):
    """d gelu_tanh(x) / dx, gelu_backward_v1's float32 operations in the same order."""
    t = math.tanh(GELU_SCALE * (x + GELU_CUBE * x * x * x))
    dudx = GELU_SCALE * (F_ONE + F_THREE * GELU_CUBE * x * x)
    return F_HALF * (F_ONE + t) + F_HALF * x * (F_ONE - t * t) * dudx


# bias_gelu_forward_v1(_half): thread i owns elements i, i + stride, ...; pre may be inp (read before written).
@cuda.jit
def bias_gelu_forward_v1(inp, bias, pre, out, mode, has_pre):
    N, C = out.shape
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for i in range(start, N * C, stride):
        r = i // C
        c = i - r * C
        x = inp[r, c] + bias[c]
        if has_pre != 0:
            pre[r, c] = x
        y = gelu_tanh(x)
        if mode == 0:
            out[r, c] = y
        else:
            out[r, c] = f32_to_half_bits(y, mode)


# bias_gelu_forward_v1_hpre: as bias_gelu_forward_v1, pre and out half bits (mode 1 bf16, 2 fp16); the GELU reads
# the rounded pre, as gelu_half_v1 does when it rebuilds out from pre.
@cuda.jit
def bias_gelu_forward_v1_hpre(inp, bias, pre, out, mode):
    N, C = out.shape
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for i in range(start, N * C, stride):
        r = i // C
        c = i - r * C
        p = f32_to_half_bits(inp[r, c] + bias[c], mode)
        pre[r, c] = p
        out[r, c] = f32_to_half_bits(gelu_tanh(half_bits_to_f32(p, mode)), mode)


# gelu_half_v1: thread i owns elements i, i + stride, ... of (N, C): half bits in, half bits out.
@cuda.jit
def gelu_half_v1(inp, out, mode):
    N, C = out.shape
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for i in range(start, N * C, stride):
        r = i // C
        c = i - r * C
        out[r, c] = f32_to_half_bits(gelu_tanh(half_bits_to_f32(inp[r, c], mode)), mode)


@cuda.jit(device=True, inline=True)
def _head_coords(i, T, hs, nh):
    """Element i of a flattened (B*nh, T, hs) array as (b, h, t, d)."""
    d = i % hs
    rt = i // hs
    t = rt % T
    bh = rt // T
    b = bh // nh
    return b, bh - b * nh, t, d


# split_heads_v1(_half): thread i owns elements i, i + stride, ... of out (B*nh, T, hs) flattened.
@cuda.jit
def split_heads_v1(inp, bias, out, col0, nh, has_bias, mode):
    BH, T, hs = out.shape
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for i in range(start, BH * T * hs, stride):
        b, h, t, d = _head_coords(i, T, hs, nh)
        bh = b * nh + h
        v = inp[b * T + t, col0 + h * hs + d]
        if has_bias != 0:
            v += bias[h * hs + d]
        if mode == 0:
            out[bh, t, d] = v
        else:
            out[bh, t, d] = f32_to_half_bits(v, mode)


# merge_heads_v1(_half): thread i owns elements i, i + stride, ... of inp (B*nh, T, hs) flattened.
@cuda.jit
def merge_heads_v1(inp, out, col0, nh, mode):
    BH, T, hs = inp.shape
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for i in range(start, BH * T * hs, stride):
        b, h, t, d = _head_coords(i, T, hs, nh)
        bh = b * nh + h
        v = inp[bh, t, d]
        if mode == 0:
            out[b * T + t, col0 + h * hs + d] = v
        else:
            out[b * T + t, col0 + h * hs + d] = f32_to_half_bits(v, mode)


# colsum_partials_v1: thread j owns (chunk k, column c) pairs j, j + stride, ... of (chunks, C): it adds rows
# k*ROWS_PER_CHUNK .. +ROWS_PER_CHUNK of column c in row order; mode 1/2: also out[r, c] = half bits of inp[r, c].
@cuda.jit
def colsum_partials_v1(inp, partial, out, mode):
    N, C = inp.shape
    chunks = partial.shape[0]
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for j in range(start, chunks * C, stride):
        k = j // C
        c = j - k * C
        s = F_ZERO
        for r in range(k * ROWS_PER_CHUNK, min(k * ROWS_PER_CHUNK + ROWS_PER_CHUNK, N)):
            v = inp[r, c]
            s += v
            if mode != 0:
                out[r, c] = f32_to_half_bits(v, mode)
        partial[k, c] = s


# colsum_partials_v1_gelu: colsum_partials_v1 of dfc = inp * gelu'(pre + gbias[c]), gelu_backward_v1's float32 ops
@cuda.jit
def colsum_partials_v1_gelu(inp, pre, gbias, partial, out, mode):
    N, C = inp.shape
    chunks = partial.shape[0]
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for j in range(start, chunks * C, stride):
        k = j // C
        c = j - k * C
        s = F_ZERO
        for r in range(k * ROWS_PER_CHUNK, min(k * ROWS_PER_CHUNK + ROWS_PER_CHUNK, N)):
            v = inp[r, c] * gelu_grad(pre[r, c] + gbias[c])
            s += v
            out[r, c] = f32_to_half_bits(v, mode)
        partial[k, c] = s


# colsum_partials_v1_gelu_hpre: colsum_partials_v1_gelu with GELU's input the half bits pre[r, c] (its bias in)
@cuda.jit
def colsum_partials_v1_gelu_hpre(inp, pre, partial, out, mode):
    N, C = inp.shape
    chunks = partial.shape[0]
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for j in range(start, chunks * C, stride):
        k = j // C
        c = j - k * C
        s = F_ZERO
        for r in range(k * ROWS_PER_CHUNK, min(k * ROWS_PER_CHUNK + ROWS_PER_CHUNK, N)):
            v = inp[r, c] * gelu_grad(half_bits_to_f32(pre[r, c], mode))
            s += v
            out[r, c] = f32_to_half_bits(v, mode)
        partial[k, c] = s


# colsum_reduce_v1: thread c owns columns c, c + stride, ...: colsum[c] = partial[0, c] + partial[1, c] + ...
@cuda.jit
def colsum_reduce_v1(partial, colsum):
    chunks, C = partial.shape
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for c in range(start, C, stride):
        s = F_ZERO
        for k in range(chunks):
            s += partial[k, c]
        colsum[c] = s


# layernorm_forward_half_v1: thread `row` owns rows row, row + stride, ...: mean, variance (second pass), write bits.
@cuda.jit
def layernorm_forward_half_v1(inp, weight, bias, out, mean, rstd, eps, mode):
    N, C = inp.shape
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for row in range(start, N, stride):
        s = F_ZERO
        for i in range(C):
            s += inp[row, i]
        m = s / numba.float32(C)
        v = F_ZERO
        for i in range(C):
            d = inp[row, i] - m
            v += d * d
        r = F_ONE / math.sqrt(v / numba.float32(C) + eps)
        for i in range(C):
            y = (inp[row, i] - m) * r * weight[i] + bias[i]
            out[row, i] = f32_to_half_bits(y, mode)
        mean[row] = m
        rstd[row] = r


_V, _M, _U = "float32[::1]", "float32[:, ::1]", "uint16[:, ::1]"
_M3, _U3 = "float32[:, :, ::1]", "uint16[:, :, ::1]"
KERNELS = {"bias_add_v1": bias_add_v1,
           "bias_gelu_forward_v1": bias_gelu_forward_v1, "bias_gelu_forward_v1_half": bias_gelu_forward_v1,
           "bias_gelu_forward_v1_hpre": bias_gelu_forward_v1_hpre, "gelu_half_v1": gelu_half_v1,
           "colsum_partials_v1_gelu_hpre": colsum_partials_v1_gelu_hpre,
           "split_heads_v1": split_heads_v1, "split_heads_v1_half": split_heads_v1,
           "merge_heads_v1": merge_heads_v1, "merge_heads_v1_half": merge_heads_v1,
           "colsum_partials_v1": colsum_partials_v1, "colsum_partials_v1_gelu": colsum_partials_v1_gelu,
           "colsum_reduce_v1": colsum_reduce_v1,
           "layernorm_forward_half_v1": layernorm_forward_half_v1}
SIGNATURES = {"bias_add_v1": f"void({_M}, {_V}, {_M}, {_M}, int64)",                  # inp, bias, res, out, has_res
              "bias_gelu_forward_v1": f"void({_M}, {_V}, {_M}, {_M}, int64, int64)",  # inp, bias, pre, out, mode,
              "bias_gelu_forward_v1_half": f"void({_M}, {_V}, {_M}, {_U}, int64, int64)",  # has_pre
              "bias_gelu_forward_v1_hpre": f"void({_M}, {_V}, {_U}, {_U}, int64)",  # inp, bias, pre, out, mode
              "gelu_half_v1": f"void({_U}, {_U}, int64)",                             # inp, out, mode
              "colsum_partials_v1_gelu_hpre": f"void({_M}, {_U}, {_M}, {_U}, int64)",  # inp, pre, partial, out, mode
              "split_heads_v1": f"void({_M}, {_V}, {_M3}, int64, int64, int64, int64)",   # inp, bias, out, col0,
              "split_heads_v1_half": f"void({_M}, {_V}, {_U3}, int64, int64, int64, int64)",  # nh, has_bias, mode
              "merge_heads_v1": f"void({_M3}, {_M}, int64, int64, int64)",            # inp, out, col0, nh, mode
              "merge_heads_v1_half": f"void({_M3}, {_U}, int64, int64, int64)",
              "colsum_partials_v1": f"void({_M}, {_M}, {_U}, int64)",                 # inp, partial, out, mode
              "colsum_partials_v1_gelu": f"void({_M}, {_M}, {_V}, {_M}, {_U}, int64)",  # inp, pre, gbias, partial,
              "colsum_reduce_v1": f"void({_M}, {_V})",                                # partial, colsum
              "layernorm_forward_half_v1": f"void({_M}, {_V}, {_V}, {_U}, {_V}, {_V}, float32, int64)"}
GPU_ONLY = set()
VERSIONS = ("v1",)


# ---- the launch wrappers (their argument checks: contracts/fused.py, shared with backends/hip/fused.py) ----------

def _launch(fn, key, version, threads, n, args):
    """KERNELS[key] over n work items with a capped grid (every kernel here grid-strides)."""
    check_version(fn, version, VERSIONS)
    threads = check_threads(fn, threads)
    if n == 0:
        return
    blocks = min(math.ceil(n / threads), MAX_BLOCKS)
    KERNELS[key][blocks, threads, launch_stream()](*args)


LAUNCHERS = ("bias_add", "bias_gelu_forward", "gelu_half", "split_heads", "merge_heads", "colsum_convert",
             "layernorm_forward_half")   # gathered by backends/_collect.py


def bias_add(inp, bias, out, res=None, version="v1", threads=256):
    """out (N,C) = inp + bias[col] (+ res); inp, res, out float32 (N,C), bias (C,). out may be inp or res."""
    N, C = check_bias_add("bias_add", inp, bias, out, res)
    _launch("bias_add", "bias_add_v1", version, threads, N * C,
            (inp, bias, inp if res is None else res, out, 0 if res is None else 1))


def bias_gelu_forward(inp, bias, pre, out, half=None, version="v1", threads=256):
    """pre (N,C) = inp + bias[col] (pre may be inp; None: not written); out (N,C) = gelu_tanh(pre): float32, or
    uint16 bits (half). pre uint16 (with half): GELU's input kept as half bits, and out = gelu_tanh of that rounded
    value (gelu_half(pre) gives out's bits again)."""
    N, C, mode = check_bias_gelu("bias_gelu_forward", inp, bias, pre, out, half)
    if half_pre(pre):
        _launch("bias_gelu_forward", "bias_gelu_forward_v1_hpre", version, threads, N * C, (inp, bias, pre, out, mode))
        return
    args = (inp, bias, inp if pre is None else pre, out, mode, 0 if pre is None else 1)  # has_pre 0: inp never written
    _launch("bias_gelu_forward", "bias_gelu_forward_v1", version, threads, N * C, args)


def gelu_half(inp, out, half, version="v1", threads=256):
    """out (N,C) = gelu_tanh(inp) for inp and out uint16, half bits of half ('bf16' / 'fp16'): the selective
    recompute of the GELU output from a half pre (bias_gelu_forward's), the same bits."""
    N, C, mode = check_gelu_half("gelu_half", inp, out, half)
    _launch("gelu_half", "gelu_half_v1", version, threads, N * C, (inp, out, mode))


def split_heads(inp, col0, out, B, T, nh, bias=None, half=None, version="v1", threads=256):
    """out[b*nh+h, t, d] = inp[b*T+t, col0 + h*hs + d] (+ bias[h*hs+d]); inp (B*T, ld) float32, out (B*nh, T, hs)
    float32 or uint16 bits (half), bias (nh*hs,) float32 or None."""
    N, ld, hs, mode = check_split("split_heads", inp, col0, out, B, T, nh, bias, half)
    if N == 0 or hs == 0:
        return
    _launch("split_heads", "split_heads_v1", version, threads, N * nh * hs,
            (inp, inp[0] if bias is None else bias, out, int(col0), int(nh), 0 if bias is None else 1, mode))


def merge_heads(inp, out, col0, B, T, nh, half=None, version="v1", threads=256):
    """out[b*T+t, col0 + h*hs + d] = inp[b*nh+h, t, d]; inp (B*nh, T, hs) float32, out (B*T, ld) float32 or uint16
    bits (half); columns of out outside [col0, col0 + nh*hs) are not touched."""
    N, ld, hs, mode = check_merge("merge_heads", inp, out, col0, B, T, nh, half)
    _launch("merge_heads", "merge_heads_v1", version, threads, N * nh * hs, (inp, out, int(col0), int(nh), mode))


def colsum_chunks(N: int) -> int:
    """How many row chunks stage 1 of colsum_convert uses (a function of N only: the summation order is fixed)."""
    return max(1, math.ceil(N / ROWS_PER_CHUNK))


def colsum_convert(inp, colsum, out=None, half=None, version="v1", threads=256, gelu_of=None, gelu_bias=None):
    """colsum (C,) = inp.sum(axis=0) for inp (N,C) float32, deterministic (two stages, fixed order); with out (N,C)
    uint16 and half 'bf16'/'fp16', also out = the half bits of inp, in the same pass. gelu_of (N, C) and gelu_bias
    (C,) float32, GELU's input gelu_of + gelu_bias[col] (needs out): inp is the gradient of GELU's output; the pass
    sums and converts inp * gelu'(gelu_of + gelu_bias) instead, with gelu_backward's bits; gelu_of uint16 alone: GELU's
    input as half bits of half's format, its bias in (bias_gelu_forward's half pre); then inp may be uint16 too, the
    half bits of GELU's output gradient (widened to a float32 scratch here; the HIP twin reads the bits)."""
    fn = "colsum_convert"
    N, C, mode = check_colsum(fn, inp, colsum, out, half, gelu_of=gelu_of, gelu_bias=gelu_bias)
    check_version(fn, version, VERSIONS)
    threads = check_threads(fn, threads)
    if C == 0:
        return
    if str(inp.dtype) == "uint16":
        from gpullm_lessons.kernels.numba.convert import widen_half
        inp = widen_half(inp, half)
    chunks = colsum_chunks(N)
    partial = device_scratch((chunks, C), np.float32)             # scratch, every element written
    dummy = out if out is not None else device_scratch((1, 1), np.uint16)   # mode 0: never written
    if half_pre(gelu_of):
        _launch(fn, "colsum_partials_v1_gelu_hpre", version, threads, chunks * C, (inp, gelu_of, partial, out, mode))
    elif gelu_of is not None:
        _launch(fn, "colsum_partials_v1_gelu", version, threads, chunks * C, (inp, gelu_of, gelu_bias, partial, out, mode))
    else:
        _launch(fn, "colsum_partials_v1", version, threads, chunks * C, (inp, partial, dummy, mode))
    _launch(fn, "colsum_reduce_v1", version, threads, C, (partial, colsum))


def layernorm_forward_half(inp, weight, bias, out, mean, rstd, half, eps=1e-5, version="v1", threads=256):
    """As layernorm_forward (mean, rstd = 1/sqrt(var + eps), biased variance), but out (N,C) is uint16: the bf16 or
    fp16 bits (half='bf16' / 'fp16') of (inp - mean) * rstd * weight + bias."""
    N, C, mode = check_layernorm_half("layernorm_forward_half", inp, weight, bias, out, mean, rstd, half)
    _launch("layernorm_forward_half", "layernorm_forward_half_v1", version, threads, N,
            (inp, weight, bias, out, mean, rstd, np.float32(eps), mode))
