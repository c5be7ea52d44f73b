"""GELU forward/backward and residual backward through kernels/hip/gelu.cu, launched with CuPy (NVIDIA or AMD).

Same names, signatures and versions as kernels/numba/gelu.py (v1: one thread per element, grid-stride loop).
Arrays are 1-D float32 CuPy arrays of one length n.
"""

from __future__ import annotations

import numpy as np

from gpullm_lessons.contracts import check_cupy_args, check_threads, check_version

VERSIONS = ("v1",)
MAX_BLOCKS = 4096  # grid cap: enough blocks to fill any GPU; the grid-stride loop covers the rest


def _launch(fn, name, version, threads, names, arrays):
    from gpullm_lessons.runtime import hip

    check_version(fn, version, VERSIONS)
    check_cupy_args(fn, names, arrays, ndim=1)
    threads = check_threads(fn, threads)
    n = arrays[0].shape[0]
    if n == 0:
        return
    blocks = min((n + threads - 1) // threads, MAX_BLOCKS)
    hip.kernel("gelu", f"{name}_{version}")((blocks,), (threads,), (*arrays, np.int64(n)))


def gelu_forward(inp, out, version="v1", threads=256):
    """out[:] = gelu(inp) (tanh form); inp, out float32 (n,)."""
    _launch("gelu_forward", "gelu_forward", version, threads, ("inp", "out"), (inp, out))


def gelu_backward(dout, inp, dinp, version="v1", threads=256):
    """dinp[:] = dout * gelu'(inp); dout, inp, dinp float32 (n,)."""
    _launch("gelu_backward", "gelu_backward", version, threads, ("dout", "inp", "dinp"), (dout, inp, dinp))


def residual_backward(dout, da, db, version="v1", threads=256):
    """da[:] = dout; db[:] = dout (out = a + b); dout, da, db float32 (n,)."""
    _launch("residual_backward", "residual_backward", version, threads, ("dout", "da", "db"), (dout, da, db))
