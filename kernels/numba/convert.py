"""Mixed precision on the GPU: float32 <-> bfloat16 / float16 conversion and the inf/NaN count of the gradients.

Every kernel is elementwise over a 1-D buffer of n elements: thread i owns elements i, i + stride, ... (a
grid-stride loop, so a capped grid covers any n). The rounding is the NumPy reference gpullm_lessons.model.precision
(read its docstring), done on the float32 bits:

    f32 -> bf16: bits + 0x7FFF + (lowest kept bit), keep the top 16 bits (round to nearest even);
                 NaN -> the quiet NaN 0x7FC0 with the sign kept (bit-exact with ml_dtypes.bfloat16)
    bf16 -> f32: the 16 bits shifted to the top (exact)
    f32 -> f16:  libdevice float2half_rn (the hardware's round to nearest even, overflow to inf, subnormals kept);
                 NaN done by hand as NumPy does: sign, exponent all ones, the top 10 mantissa bits (at least 1)
    nonfinite:   inf and NaN are exactly the floats whose 8 exponent bits are all ones: one mask and compare

Bits are read with libdevice (float_as_int, int_as_float), not with device functions, so the kernels compile to
PTX without a driver; under the simulator a NumPy stand-in does the same (as kernels/numba/adamw.py).
The two roundings are inline device functions, f32_to_bf16_bits(x) and f32_to_f16_bits(x) (-> uint16), used by
f32_to_bf16_v1 / f32_to_f16_v1 here and imported by the kernels that write half bits (fused.py, attention.py).

Versions (KERNELS keys; the wrappers take version="v1"):
f32_to_bf16_v1: float32 (n,) -> bfloat16 bits uint16 (n,), one thread per element, grid-stride.
bf16_to_f32_v1: bfloat16 bits uint16 (n,) -> float32 (n,), the same loop.
f32_to_f16_v1: float32 (n,) -> float16 bits uint16 (n,), the same loop.
nonfinite_count_v1: count the inf/NaN of a float32 (n,) buffer into out (1,): each thread counts in a register
    over its grid-stride elements, then one atomic add per thread that found any (finite data: no atomics at all).
nonfinite_zero_v1: out[0] = 0, one thread; launched before nonfinite_count_v1 (the count only adds).
No version is GPU-only: all of them run in Numba's CUDA simulator.
"""
import math

import numba
import numpy as np
from numba import cuda

from gpullm_lessons.contracts import check_threads, check_version
from gpullm_lessons.contracts.convert import check_count_args, check_pair   # shared with the HIP launchers

from gpullm_lessons.kernels.numba._libdevice import libdevice
from gpullm_lessons.kernels.numba import launch_stream

MAX_BLOCKS = 4096   # grid cap: enough blocks to fill any GPU; the grid-stride loop covers the rest
U16 = numba.uint32(16)
U13 = numba.uint32(13)
ONE = numba.uint32(1)
ROUND = numba.uint32(0x7FFF)          # added before dropping 16 bits: rounds to nearest
SIGN16 = numba.uint32(0x8000)         # the sign bit of a 16-bit float
ABS = numba.uint32(0x7FFFFFFF)        # all float32 bits but the sign
EXP = numba.uint32(0x7F800000)        # the float32 exponent bits: all ones = inf or NaN
BF16_QNAN = numba.uint32(0x7FC0)      # bfloat16 quiet NaN (positive)
F16_EXP = numba.uint32(0x7C00)        # float16 exponent bits all ones
F16_MANT = numba.uint32(0x3FF)        # float16 mantissa bits
ZERO_COUNT = numba.int32(0)


# The rounding, as device functions (kernels/numba/fused.py calls them too): float32 x -> the 16 bits of its
# bfloat16 / float16, round to nearest even, NaN kept quiet with its sign.
@cuda.jit(device=True, inline=True)
def f32_to_bf16_bits(x):
    bits = numba.uint32(libdevice.float_as_int(x))
    if (bits & ABS) > EXP:                    # NaN (exponent all ones, mantissa not 0): quiet NaN, sign kept
        return numba.uint16(((bits >> U16) & SIGN16) | BF16_QNAN)
    return numba.uint16((bits + ROUND + ((bits >> U16) & ONE)) >> U16)   # + 0x7FFF + lowest kept bit: ties to even


@cuda.jit(device=True, inline=True)
def f32_to_f16_bits(x):
    bits = numba.uint32(libdevice.float_as_int(x))
    if (bits & ABS) > EXP:                    # NaN: sign, all-ones exponent, top 10 mantissa bits (never 0 = inf)
        mant = (bits >> U13) & F16_MANT
        if mant == numba.uint32(0):
            mant = ONE
        return numba.uint16(((bits >> U16) & SIGN16) | F16_EXP | mant)
    return numba.uint16(libdevice.float2half_rn(x))   # the hardware conversion: round to nearest even


@cuda.jit(device=True, inline=True)
def f32_to_half_bits(x, mode):
    """x -> the bits of its bfloat16 (mode 1) or float16 (mode 2): the kernels' half-format mode argument."""
    if mode == 1:
        return f32_to_bf16_bits(x)
    return f32_to_f16_bits(x)


# f32_to_bf16_v1: thread i owns elements i, i + stride, ... of src float32 (n,) and dst uint16 (n,).
@cuda.jit
def f32_to_bf16_v1(src, dst):
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for i in range(start, dst.shape[0], stride):
        dst[i] = f32_to_bf16_bits(src[i])


# bf16_to_f32_v1: thread i owns elements i, i + stride, ... of src uint16 (n,) and dst float32 (n,).
@cuda.jit
def bf16_to_f32_v1(src, dst):
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for i in range(start, dst.shape[0], stride):
        dst[i] = libdevice.int_as_float(numba.uint32(src[i]) << U16)   # the bf16 bits on top, 16 zero bits below


# f32_to_f16_v1: thread i owns elements i, i + stride, ... of src float32 (n,) and dst uint16 (n,) (float16 bits).
@cuda.jit
def f32_to_f16_v1(src, dst):
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for i in range(start, dst.shape[0], stride):
        dst[i] = f32_to_f16_bits(src[i])


# nonfinite_count_v1: thread i looks at elements i, i + stride, ... of flat float32 (n,), counts the inf/NaN in a
# register and adds its count to out[0] (int32 (1,), zeroed before) with one atomic add, only if it found any.
@cuda.jit
def nonfinite_count_v1(flat, out):
    start, stride = cuda.grid(1), cuda.gridsize(1)
    count = 0
    for i in range(start, flat.shape[0], stride):
        bits = numba.uint32(libdevice.float_as_int(flat[i]))
        if (bits & EXP) == EXP:               # exponent all ones: inf or NaN
            count += 1
    if count > 0:
        cuda.atomic.add(out, 0, numba.int32(count))


# nonfinite_zero_v1: out[0] = 0 (one thread), so that nonfinite_count_v1 counts from zero on every call.
@cuda.jit
def nonfinite_zero_v1(out):
    if cuda.grid(1) == 0:
        out[0] = ZERO_COUNT


KERNELS = {"f32_to_bf16_v1": f32_to_bf16_v1, "bf16_to_f32_v1": bf16_to_f32_v1, "f32_to_f16_v1": f32_to_f16_v1,
           "nonfinite_count_v1": nonfinite_count_v1, "nonfinite_zero_v1": nonfinite_zero_v1}
SIGNATURES = {"f32_to_bf16_v1": "void(float32[::1], uint16[::1])",      # src, dst
              "bf16_to_f32_v1": "void(uint16[::1], float32[::1])",      # src, dst
              "f32_to_f16_v1": "void(float32[::1], uint16[::1])",       # src, dst (float16 bits)
              "nonfinite_count_v1": "void(float32[::1], int32[::1])",   # flat, out (1,)
              "nonfinite_zero_v1": "void(int32[::1])"}                  # out (1,)
GPU_ONLY = set()
VERSIONS = ("v1",)


# ---- the launch wrappers ----------------------------------------------------------------------------------------

def as_uint16(a):
    """The same memory as uint16 (float16 / bfloat16 arrays are viewed; uint16 is returned as is)."""
    return a if str(a.dtype) == "uint16" else a.view(np.uint16)


def _launch(fn, name, version, threads, n, args):
    check_version(fn, version, VERSIONS)
    threads = check_threads(fn, threads)
    if n == 0:
        return
    blocks = min(math.ceil(n / threads), MAX_BLOCKS)
    KERNELS[f"{name}_{version}"][blocks, threads, launch_stream()](*args)


LAUNCHERS = ("f32_to_bf16", "bf16_to_f32", "f32_to_f16", "nonfinite_count")  # gathered by backends/_collect.py


def f32_to_bf16(src, dst, version="v1", threads=256):
    """dst[:] = src rounded to bfloat16 (nearest even), as bits; src float32 (n,), dst uint16 (n,) (or bfloat16)."""
    n = check_pair("f32_to_bf16", src, dst, ("float32",), ("uint16", "bfloat16"))
    _launch("f32_to_bf16", "f32_to_bf16", version, threads, n, (src, as_uint16(dst)))


def bf16_to_f32(src, dst, version="v1", threads=256):
    """dst[:] = the float32 value of the bfloat16 bits src (exact); src uint16 (n,) (or bfloat16), dst float32."""
    n = check_pair("bf16_to_f32", src, dst, ("uint16", "bfloat16"), ("float32",))
    _launch("bf16_to_f32", "bf16_to_f32", version, threads, n, (as_uint16(src), dst))


def f32_to_f16(src, dst, version="v1", threads=256):
    """dst[:] = src rounded to float16 (nearest even, as NumPy's cast); src float32 (n,), dst float16 or uint16."""
    n = check_pair("f32_to_f16", src, dst, ("float32",), ("float16", "uint16"))
    _launch("f32_to_f16", "f32_to_f16", version, threads, n, (src, as_uint16(dst)))


def widen_half(bits, half):
    """A float32 copy of the half bits `bits` (format half: "bf16" | "fp16"), exact, same shape: NumPy arrays in and
    out in the simulator; on a GPU device memory (the bf16_to_f32 kernel; fp16 through CuPy's cast). For launchers
    that take half inputs into a float32 kernel (their HIP twins read the bits as they are)."""
    from gpullm_lessons import device
    from gpullm_lessons.kernels.numba import device_scratch
    if isinstance(bits, np.ndarray):  # (kernels import no model code: tests/test_layers.py)
        if half == "bf16":
            return (bits.astype(np.uint32) << 16).view(np.float32)
        return bits.view(np.float16).astype(np.float32)
    if half == "bf16":
        wide = device_scratch(bits.shape, np.float32)
        bf16_to_f32(bits.reshape(-1), wide.reshape(-1))
        return wide
    if device.numba_on_gpu():
        import cupy as cp
        return cp.asarray(bits).view(cp.float16).astype(cp.float32)
    return bits.copy_to_host().view(np.float16).astype(np.float32)   # the simulator's device array


def nonfinite_count(flat, out, version="v1", threads=256):
    """out[0] = how many elements of flat (float32 (n,), the flat gradient buffer) are inf or NaN; out int32 (1,).

    One pass over flat; 0 means every gradient is finite (the optimizer step may be taken)."""
    fn = "nonfinite_count"
    n = check_count_args(fn, flat, out)
    check_version(fn, version, VERSIONS)
    threads = check_threads(fn, threads)
    KERNELS[f"nonfinite_zero_{version}"][1, 1, launch_stream()](out)
    if n == 0:
        return
    blocks = min(math.ceil(n / threads), MAX_BLOCKS)
    KERNELS[f"nonfinite_count_{version}"][blocks, threads, launch_stream()](flat, out)
