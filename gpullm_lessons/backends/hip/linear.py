"""HIP/CUDA C++ launchers for linear_backward (kernels/hip/linear.cu) through CuPy, with the Numba signature.

    linear_backward(dout (N,OC), inp (N,C), weight (C,OC), dinp (N,C), dweight (C,OC), dbias (OC,), version="v2")

Versions ("v1", "v2", "v3" are the GEMM kernels of linear.cu, described in kernels/numba/linear.py's docstring):
    v1      naive GEMM, one thread per output element
    v2      16x16 shared-memory tiles
    v3      shared-memory tiles + a 4x4 register tile per thread (64x64 outputs per block)
    cublas  the fast path: CuPy's matmul (cuBLAS on NVIDIA, hipBLAS/rocBLAS on AMD) and cupy.sum, for comparison
Every custom version computes dinp = dout @ weight.T and dweight = inp.T @ dout with one general kernel
matmul_vX(A, B, out, M, P, K, trans_a, trans_b), then dbias with bias_backward_v1 (one thread per column).
Arrays: C-contiguous float32 CuPy arrays. cupy is imported lazily (it is an optional extra).
"""

from __future__ import annotations

import numpy as np

from gpullm_lessons.runtime import hip
from gpullm_lessons.contracts import is_cupy
from gpullm_lessons.contracts import shape_of as _shape_of
from gpullm_lessons.contracts.linear import validate

VERSIONS = ("v1", "v2", "v3", "cublas")
TILE = 16  # v1, v2: one 16x16 block per 16x16 tile of out
BIG = 64  # v3: one 16x16 block per 64x64 tile of out
DBIAS_THREADS = 256
MAX_GRID_Y = 65535  # the hardware limit on gridDim.y (rows of tiles)


def _validate(dout, inp, weight, dinp, dweight, dbias, version, fn="linear_backward"):
    """Version, dtypes, shapes (the Numba wrapper's checks), then that every array is a C-contiguous CuPy array.
    Returns (N, C, OC)."""
    N, C, OC = validate(dout, inp, weight, dinp, dweight, dbias, version, fn=fn, versions=VERSIONS, xp="cupy")
    args = {"dout": dout, "inp": inp, "weight": weight, "dinp": dinp, "dweight": dweight, "dbias": dbias}
    for name, x in args.items():
        if not is_cupy(x):
            raise TypeError(
                f"{fn}: {name} must be a CuPy array (HIP kernels run on the GPU), got "
                f"{type(x).__module__}.{type(x).__name__}; move it with cupy.asarray(...)"
            )
        if not x.flags.c_contiguous:
            raise ValueError(
                f"{fn}: {name} must be C-contiguous (the kernels index raw row-major memory); "
                f"pass cupy.ascontiguousarray({name})"
            )
    return N, C, OC


def matmul(a, b, out, trans_a=False, trans_b=False, version="v2"):
    """out (M, P) = op(a) @ op(b) with matmul_<version> from linear.cu; op(x) = x.T when its trans_ flag is set.

    C-contiguous float32 CuPy arrays; shapes are checked by linear_backward.
    """
    M, P = _shape_of(out)
    K = _shape_of(a)[0] if trans_a else _shape_of(a)[1]
    if M == 0 or P == 0:
        return out
    tile = BIG if version == "v3" else TILE
    grid = ((P + tile - 1) // tile, (M + tile - 1) // tile)  # (x: column tiles, y: row tiles), rounded up
    if grid[1] > MAX_GRID_Y:
        raise ValueError(
            f"linear_backward: {M} rows need {grid[1]} row tiles, more than gridDim.y allows ({MAX_GRID_Y})"
        )
    k = hip.kernel("linear", f"matmul_{version}")
    k(
        grid,
        (TILE, TILE),
        (a, b, out, np.int32(M), np.int32(P), np.int32(K), np.int32(bool(trans_a)), np.int32(bool(trans_b))),
    )
    return out


def linear_backward(dout, inp, weight, dinp, dweight, dbias, version="v2"):
    """Fill dinp = dout @ weight.T (N, C), dweight = inp.T @ dout (C, OC), dbias = dout.sum(0) (OC,). Returns nothing.

    dout (N, OC), inp (N, C), weight (C, OC) stored (in, out); C-contiguous float32 CuPy arrays.
    version: "v1", "v2", "v3" (the kernels of kernels/hip/linear.cu) or "cublas" (CuPy's matmul and sum).
    """
    N, C, OC = _validate(dout, inp, weight, dinp, dweight, dbias, version)
    if version == "cublas":
        import cupy  # lazily: cupy is an optional extra

        if N == 0:  # no rows: the sums over rows are empty (zeros); do not ask BLAS for a K = 0 product
            dweight.fill(0)
            dbias.fill(0)
            return
        cupy.matmul(dout, weight.T, out=dinp)  # (N, OC) @ (OC, C) -> (N, C)
        cupy.matmul(inp.T, dout, out=dweight)  # (C, N) @ (N, OC) -> (C, OC)
        cupy.sum(dout, axis=0, out=dbias)  # (OC,)
        return
    matmul(dout, weight, dinp, trans_a=False, trans_b=True, version=version)  # (N, OC) @ (OC, C) -> (N, C)
    matmul(inp, dout, dweight, trans_a=True, trans_b=False, version=version)  # (C, N) @ (N, OC) -> (C, OC)
    if OC > 0:
        blocks = (OC + DBIAS_THREADS - 1) // DBIAS_THREADS
        hip.kernel("linear", "bias_backward_v1")((blocks,), (DBIAS_THREADS,), (dout, dbias, np.int32(N), np.int32(OC)))
