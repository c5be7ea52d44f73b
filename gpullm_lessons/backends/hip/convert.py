"""f32_to_bf16, bf16_to_f32, f32_to_f16 and nonfinite_count through kernels/hip/convert.cu, launched with CuPy.

Same names, signatures, versions and rounding as kernels/numba/convert.py (v1: one thread per element, grid-stride
loop; the count: a register per thread, one atomicAdd per thread that found any inf/NaN). Arrays are 1-D CuPy
arrays: float32, and uint16 for the 16-bit side (float16 is accepted for f32_to_f16 and viewed as uint16).
"""

from __future__ import annotations

import numpy as np

from gpullm_lessons.contracts import check_array, check_threads, check_version
from gpullm_lessons.contracts.convert import check_count_args, check_pair

__all__ = ["f32_to_bf16", "bf16_to_f32", "f32_to_f16", "nonfinite_count", "VERSIONS"]
VERSIONS = ("v1",)
MAX_BLOCKS = 4096  # grid cap: enough blocks to fill any GPU; the grid-stride loop covers the rest


def _check_cupy(fn, name, a, shape, dtype):
    check_array(fn, name, a, shape, dtype, cupy=True)


def _bits(a):
    return a if str(a.dtype) == "uint16" else a.view("uint16")


def _launch(fn, name, version, threads, n, args):
    from gpullm_lessons.runtime import hip

    check_version(fn, version, VERSIONS)
    threads = check_threads(fn, threads)
    if n == 0:
        return
    blocks = min((n + threads - 1) // threads, MAX_BLOCKS)
    hip.kernel("convert", f"{name}_{version}")((blocks,), (threads,), (*args, np.int64(n)))


LAUNCHERS = ("f32_to_bf16", "bf16_to_f32", "f32_to_f16", "nonfinite_count")  # gathered by backends/_collect.py


def f32_to_bf16(src, dst, version="v1", threads=256):
    """dst[:] = src rounded to bfloat16 (nearest even), as bits; src float32 (n,), dst uint16 (n,) CuPy arrays."""
    n = check_pair("f32_to_bf16", src, dst, ("float32",), ("uint16",), check=_check_cupy)
    _launch("f32_to_bf16", "f32_to_bf16", version, threads, n, (src, dst))


def bf16_to_f32(src, dst, version="v1", threads=256):
    """dst[:] = the float32 value of the bfloat16 bits src (exact); src uint16 (n,), dst float32 (n,) CuPy arrays."""
    n = check_pair("bf16_to_f32", src, dst, ("uint16",), ("float32",), check=_check_cupy)
    _launch("bf16_to_f32", "bf16_to_f32", version, threads, n, (src, dst))


def f32_to_f16(src, dst, version="v1", threads=256):
    """dst[:] = src rounded to float16 (nearest even, as NumPy's cast); src float32 (n,), dst float16 or uint16."""
    n = check_pair("f32_to_f16", src, dst, ("float32",), ("float16", "uint16"), check=_check_cupy)
    _launch("f32_to_f16", "f32_to_f16", version, threads, n, (src, _bits(dst)))


def nonfinite_count(flat, out, version="v1", threads=256):
    """out[0] = how many elements of flat (float32 (n,) CuPy) are inf or NaN; out int32 (1,) CuPy."""
    fn = "nonfinite_count"
    n = check_count_args(fn, flat, out, check=_check_cupy)
    check_version(fn, version, VERSIONS)
    threads = check_threads(fn, threads)
    out.fill(0)  # the kernel only adds
    _launch(fn, "nonfinite_count", version, threads, n, (flat, out))
