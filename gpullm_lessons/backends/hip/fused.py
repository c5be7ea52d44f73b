"""The engine's glue kernels through kernels/hip/fused.cu, launched with CuPy (NVIDIA or AMD).

Same names, signatures and argument checks as kernels/numba/fused.py (read its docstring for the math):
    bias_add(inp, bias, out, res=None)
    bias_gelu_forward(inp, bias, pre, out, half=None)        (pre uint16 with half: GELU's input kept as half bits)
    gelu_half(inp, out, half)                                (the recompute from a half pre)
    split_heads(inp, col0, out, B, T, nh, bias=None, half=None)
    merge_heads(inp, out, col0, B, T, nh, half=None)
    colsum_convert(inp, colsum, out=None, half=None, gelu_of=None, gelu_bias=None)
    layernorm_forward_half(inp, weight, bias, out, mean, rstd, half, eps=1e-5)
each with version="v1", threads=256. half: None (float32 output) or "bf16" / "fp16" (uint16 output: the 16-bit bits,
rounded by kernels/hip/half.h exactly as convert.cu). Arrays are C-contiguous CuPy arrays; cupy is imported lazily.

Layouts (fused.cu's header says more): bias_add and bias_gelu_forward are grid-stride loops over the N*C elements;
split_heads / merge_heads use 2-D blocks (x: the C columns of a row, y: rows), so reads and writes are contiguous in
runs of hs; colsum_convert runs a block per (tile of 32 columns x chunk of rows) into scratch (chunks, C) allocated
here, then one thread per column adds the chunks in order: the chunking depends on (N, C) only, so the sum has the
same bits on every run; layernorm_forward_half runs one warp per row.
"""

from __future__ import annotations

import math

import numpy as np

from gpullm_lessons.contracts import check_array, check_threads, check_version
from gpullm_lessons.contracts.fused import (
    check_bias_add,
    check_bias_gelu,
    check_colsum,
    check_gelu_half,
    check_layernorm_half,
    check_merge,
    check_split,
    half_pre,
)

LAUNCHERS = (
    "bias_add",
    "bias_gelu_forward",
    "gelu_half",
    "split_heads",
    "merge_heads",
    "colsum_convert",
    "layernorm_forward_half",
)  # gathered by backends/_collect.py
__all__ = [*LAUNCHERS, "VERSIONS"]
VERSIONS = ("v1",)
MAX_BLOCKS = 4096  # grid cap for the grid-stride kernels: enough to fill any GPU
MAX_ROW_BLOCKS = 8192  # grid cap for the row kernels (split/merge, layernorm)
WARP_MAX = 64  # layernorm_forward_half: blocks of whole warps on NVIDIA (32) and AMD CDNA (64)
COLSUM_TILE = 32  # colsum stage 1: columns per block (blockDim.x)
COLSUM_ROWS = 8  # colsum stage 1: threads striding the rows of a chunk (blockDim.y)
COLSUM_TARGET_BLOCKS = 2048  # colsum stage 1: about this many blocks (tiles x chunks), whatever the GPU
SUFFIX = {0: "f32", 1: "bf16", 2: "f16"}


def _check_cupy(fn, name, a, shape, dtype):
    check_array(fn, name, a, shape, dtype, cupy=True)


def _kernel(name):
    from gpullm_lessons.runtime import hip

    return hip.kernel("fused", name)


def _setup(fn, version, threads):
    check_version(fn, version, VERSIONS)
    return check_threads(fn, threads)


def _flat_grid(n, threads):
    return min((n + threads - 1) // threads, MAX_BLOCKS)


def _row_block(C, threads):
    """2-D block for the row kernels: x covers the columns (a multiple of 32, at most threads), y the rows."""
    tx = min(threads, max(32, -(-C // 32) * 32))
    return tx, max(1, threads // tx)


def bias_add(inp, bias, out, res=None, version="v1", threads=256):
    """out (N,C) = inp + bias[col] (+ res); inp, res, out float32 (N,C), bias (C,) CuPy. out may be inp or res."""
    fn = "bias_add"
    N, C = check_bias_add(fn, inp, bias, out, res, check=_check_cupy)
    threads = _setup(fn, version, threads)
    n = N * C
    if n == 0:
        return
    grid = (_flat_grid(n, threads),)
    if res is None:
        _kernel("bias_add_v1")(grid, (threads,), (inp, bias, out, np.int64(n), np.int32(C)))
    else:
        _kernel("bias_add_res_v1")(grid, (threads,), (inp, bias, res, out, np.int64(n), np.int32(C)))


def bias_gelu_forward(inp, bias, pre, out, half=None, version="v1", threads=256):
    """pre (N,C) = inp + bias[col] (pre may be inp; None: not written); out (N,C) = gelu_tanh(pre): float32, or
    uint16 bits (half). pre uint16 (with half): GELU's input kept as half bits, and out = gelu_tanh of that rounded
    value (gelu_half(pre) gives out's bits again)."""
    fn = "bias_gelu_forward"
    N, C, mode = check_bias_gelu(fn, inp, bias, pre, out, half, check=_check_cupy)
    threads = _setup(fn, version, threads)
    n = N * C
    if n == 0:
        return
    if half_pre(pre):
        args = (inp, bias, pre, out, np.int64(n), np.int32(C))
        _kernel(f"bias_gelu_forward_v1_hpre_{SUFFIX[mode]}")((_flat_grid(n, threads),), (threads,), args)
        return
    if pre is None:
        args = (inp, bias, out, np.int64(n), np.int32(C))
        _kernel(f"bias_gelu_forward_v1_nopre_{SUFFIX[mode]}")((_flat_grid(n, threads),), (threads,), args)
        return
    _kernel(f"bias_gelu_forward_v1_{SUFFIX[mode]}")(
        (_flat_grid(n, threads),), (threads,), (inp, bias, pre, out, np.int64(n), np.int32(C))
    )


def gelu_half(inp, out, half, version="v1", threads=256):
    """out (N,C) = gelu_tanh(inp) for inp and out uint16 CuPy arrays, half bits of half ('bf16' / 'fp16'): the
    selective recompute of the GELU output from a half pre (bias_gelu_forward's), the same bits."""
    fn = "gelu_half"
    N, C, mode = check_gelu_half(fn, inp, out, half, check=_check_cupy)
    threads = _setup(fn, version, threads)
    n = N * C
    if n == 0:
        return
    _kernel(f"gelu_half_v1_{SUFFIX[mode]}")((_flat_grid(n, threads),), (threads,), (inp, out, np.int64(n)))


def _heads_launch(name, args, N, C, threads, sizes):
    tx, ty = _row_block(C, threads)
    grid = min(-(-N // ty), MAX_ROW_BLOCKS)
    _kernel(name)((grid,), (tx, ty), (*args, *(np.int32(s) for s in sizes)))


def split_heads(inp, col0, out, B, T, nh, bias=None, half=None, version="v1", threads=256):
    """out[b*nh+h, t, d] = inp[b*T+t, col0 + h*hs + d] (+ bias[h*hs+d]); inp (B*T, ld) float32, out (B*nh, T, hs)
    float32 or uint16 bits (half), bias (nh*hs,) float32 or None; CuPy arrays."""
    fn = "split_heads"
    N, ld, hs, mode = check_split(fn, inp, col0, out, B, T, nh, bias, half, check=_check_cupy)
    threads = _setup(fn, version, threads)
    if N == 0 or hs == 0:
        return
    if nh == 1 and hs % 4 == 0 and ld % 4 == 0 and col0 % 4 == 0 and inp.data.ptr % 16 == 0 and out.data.ptr % 16 == 0:
        # one head of whole rows (the engine's qkv pass before flash): four columns per thread, the same values
        kind = "split_heads_v1_x4" if bias is None else "split_heads_bias_v1_x4"
        args = (inp, out) if bias is None else (inp, bias, out)
        _heads_launch(f"{kind}_{SUFFIX[mode]}", args, N, hs // 4, threads, (N, hs, ld, col0))
        return
    sizes = (N, T, nh, hs, ld, col0)
    if bias is None:
        _heads_launch(f"split_heads_v1_{SUFFIX[mode]}", (inp, out), N, nh * hs, threads, sizes)
    else:
        _heads_launch(f"split_heads_bias_v1_{SUFFIX[mode]}", (inp, bias, out), N, nh * hs, threads, sizes)


def merge_heads(inp, out, col0, B, T, nh, half=None, version="v1", threads=256):
    """out[b*T+t, col0 + h*hs + d] = inp[b*nh+h, t, d]; inp (B*nh, T, hs) float32, out (B*T, ld) float32 or uint16
    bits (half); columns of out outside [col0, col0 + nh*hs) are not touched; CuPy arrays."""
    fn = "merge_heads"
    N, ld, hs, mode = check_merge(fn, inp, out, col0, B, T, nh, half, check=_check_cupy)
    threads = _setup(fn, version, threads)
    if N == 0 or hs == 0:
        return
    _heads_launch(f"merge_heads_v1_{SUFFIX[mode]}", (inp, out), N, nh * hs, threads, (N, T, nh, hs, ld, col0))


def colsum_chunking(N: int, C: int) -> tuple[int, int]:
    """(chunks, rows per chunk) of colsum stage 1: a function of (N, C) only, so the summation order (and the bits of
    the result) is the same on every run and every GPU."""
    tiles = -(-C // COLSUM_TILE)
    chunks = max(1, min(-(-N // COLSUM_ROWS), -(-COLSUM_TARGET_BLOCKS // tiles)))
    rows = max(1, -(-N // chunks))
    return max(1, -(-N // rows)), rows


def colsum_convert(inp, colsum, out=None, half=None, version="v1", threads=256, gelu_of=None, gelu_bias=None):
    """colsum (C,) = inp.sum(axis=0) for inp (N,C) float32, deterministic (two stages, fixed order); with out (N,C)
    uint16 and half 'bf16'/'fp16', also out = the half bits of inp, in the same pass. CuPy arrays.
    gelu_of (N, C) and gelu_bias (C,) float32, GELU's input gelu_of + gelu_bias[col] (needs out): inp is the gradient
    of GELU's output, and the pass sums and converts inp * gelu'(gelu_of + gelu_bias) (gelu_backward's bits)
    instead: the fc layer's dfc without a float32 copy. gelu_of uint16 alone: GELU's input as half bits of half's
    format, its bias in (bias_gelu_forward's half pre); then inp may be uint16 too, the half bits of GELU's output
    gradient in half's format (its product rounded it): the _hin entry points.
    threads: the stage-2 block; stage 1 always runs 32 x 8 blocks."""
    fn = "colsum_convert"
    N, C, mode = check_colsum(fn, inp, colsum, out, half, check=_check_cupy, gelu_of=gelu_of, gelu_bias=gelu_bias)
    threads = _setup(fn, version, threads)
    if C == 0:
        return
    import cupy  # lazy: after the checks, so they work (and teach) without cupy

    chunks, rows = colsum_chunking(N, C)
    partial = cupy.empty((chunks, C), cupy.float32)  # scratch: every element written by stage 1
    # x4 (four columns per thread, 16-byte loads) where C % 4 == 0 and the rows are aligned for them: the same sums
    hpre = half_pre(gelu_of)  # GELU's input as half bits, its bias in: 8-byte loads of it in x4
    hin = str(inp.dtype) == "uint16"  # GELU's output gradient as half bits (with hpre only): 8-byte loads in x4
    x4 = C % 4 == 0 and inp.data.ptr % (8 if hin else 16) == 0
    x4 = x4 and (gelu_of is None or gelu_of.data.ptr % (8 if hpre else 16) == 0)
    x4 = x4 and (out is None or out.data.ptr % 8 == 0)
    grid1 = (-(-C // (COLSUM_TILE * (4 if x4 else 1))), chunks)
    block1 = (COLSUM_TILE, COLSUM_ROWS)
    sizes = (np.int32(N), np.int32(C), np.int32(rows))
    name = "colsum_partials_v1" + ("_x4" if x4 else "")
    if hpre:
        _kernel(f"{name}_gelu_hpre_{'hin_' if hin else ''}{SUFFIX[mode]}")(
            grid1, block1, (inp, gelu_of, partial, out, *sizes)
        )
    elif gelu_of is not None:
        _kernel(f"{name}_gelu_{SUFFIX[mode]}")(grid1, block1, (inp, gelu_of, gelu_bias, partial, out, *sizes))
    elif mode == 0 and x4:
        _kernel(name)(grid1, block1, (inp, partial, partial, *sizes))  # out: never written (H = 0)
    elif mode == 0:
        _kernel(name)(grid1, block1, (inp, partial, *sizes))
    else:
        _kernel(f"{name}_{SUFFIX[mode]}")(grid1, block1, (inp, partial, out, *sizes))
    _kernel("colsum_reduce_v1")(
        (min(-(-C // threads), MAX_BLOCKS),), (threads,), (partial, colsum, np.int32(chunks), np.int32(C))
    )


def layernorm_forward_half(inp, weight, bias, out, mean, rstd, half, eps=1e-5, version="v1", threads=256):
    """As layernorm_forward (mean, rstd = 1/sqrt(var + eps), biased variance), but out (N,C) is uint16: the bf16 or
    fp16 bits (half='bf16' / 'fp16'). One warp per row; threads a multiple of 64 (whole warps on NVIDIA and AMD)."""
    fn = "layernorm_forward_half"
    N, C, mode = check_layernorm_half(fn, inp, weight, bias, out, mean, rstd, half, check=_check_cupy)
    threads = _setup(fn, version, threads)
    if threads % WARP_MAX:
        raise ValueError(f"{fn}: threads={threads} must be a multiple of {WARP_MAX} (whole warps on NVIDIA and AMD)")
    if N == 0:
        return
    rows_per_block = threads // 32  # warps per block on NVIDIA; on AMD the grid-stride loop covers the rest
    grid = min(math.ceil(N / rows_per_block), MAX_ROW_BLOCKS)
    _kernel(f"layernorm_forward_half_v1_{SUFFIX[mode]}")(
        (grid,), (threads,), (inp, weight, bias, out, mean, rstd, np.int32(N), np.int32(C), np.float32(eps))
    )
