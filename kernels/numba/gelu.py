"""GELU (tanh form, as in GPT-2) forward and backward, and the residual backward: Numba CUDA kernels for lesson 05.

Elementwise ops on 1-D arrays of any length n (flatten (B, T, 4C) activations first): element i of every output
depends on element i of the inputs only, so one thread per element, nothing shared, nothing to reduce.

    gelu forward:   u = sqrt(2/pi) (x + 0.044715 x^3),  out = 0.5 x (1 + tanh(u))
    gelu backward:  dinp = dout * (0.5 (1 + tanh(u)) + 0.5 x (1 - tanh(u)^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2))
    residual backward (out = a + b):  da = dout, db = dout

Versions (KERNELS keys; the wrappers take version="v1"):
v1: gelu_backward, one thread per element in a grid-stride loop (a capped grid covers any n).
forward_v1: gelu_forward, the same grid-stride loop.
residual_v1: residual_backward, the same grid-stride loop, two writes per element.
No version is GPU-only: all of them run in Numba's CUDA simulator.
"""
import math

import numba
import numpy as np
from numba import cuda

from gpullm_lessons.contracts import check_threads, check_version
from gpullm_lessons.kernels.numba import launch_stream

GELU_SCALE = numba.float32(math.sqrt(2.0 / math.pi))   # sqrt(2/pi), a float32 constant inside the kernels
GELU_CUBE = numba.float32(0.044715)
HALF = numba.float32(0.5)
ONE = numba.float32(1.0)
THREE = numba.float32(3.0)
MAX_BLOCKS = 4096   # grid cap: enough blocks to fill any GPU; the grid-stride loop covers the rest


# forward_v1: thread i owns elements i, i + stride, i + 2*stride, ... of inp (n,) and out (n,).
@cuda.jit
def gelu_forward_v1(inp, out):
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for i in range(start, out.shape[0], stride):
        x = inp[i]
        u = GELU_SCALE * (x + GELU_CUBE * x * x * x)
        out[i] = HALF * x * (ONE + math.tanh(u))


# v1: gelu backward, thread i owns elements i, i + stride, ... of dout, inp, dinp (n,).
@cuda.jit
def gelu_backward_v1(dout, inp, dinp):
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for i in range(start, dinp.shape[0], stride):
        x = inp[i]
        t = math.tanh(GELU_SCALE * (x + GELU_CUBE * x * x * x))      # tanh(u), recomputed from the saved inp
        dudx = GELU_SCALE * (ONE + THREE * GELU_CUBE * x * x)
        local = HALF * (ONE + t) + HALF * x * (ONE - t * t) * dudx    # d out / d inp (product rule)
        dinp[i] = dout[i] * local                                     # chain rule


# residual_v1: out = a + b sends dout unchanged to both branches; thread i owns elements i, i + stride, ...
@cuda.jit
def residual_backward_v1(dout, da, db):
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for i in range(start, dout.shape[0], stride):
        da[i] = dout[i]
        db[i] = dout[i]


KERNELS = {"v1": gelu_backward_v1, "forward_v1": gelu_forward_v1, "residual_v1": residual_backward_v1}
SIGNATURES = {"v1": "void(float32[::1], float32[::1], float32[::1])",          # dout, inp, dinp
              "forward_v1": "void(float32[::1], float32[::1])",                # inp, out
              "residual_v1": "void(float32[::1], float32[::1], float32[::1])"}  # dout, da, db
GPU_ONLY = set()
VERSIONS = ("v1",)


def _check_args(fn, names, arrays):
    """1-D float32 arrays of one length; raise TypeError/ValueError naming the argument otherwise."""
    for name, a in zip(names, arrays):
        if not (hasattr(a, "shape") and hasattr(a, "dtype")):
            raise TypeError(f"{fn}: {name} must be an array (NumPy, CuPy or Numba device array), "
                            f"got {type(a).__name__}")
        if np.dtype(a.dtype) != np.float32:
            raise TypeError(f"{fn}: {name} must be float32, got dtype {a.dtype}")
    first = arrays[0]
    if len(first.shape) != 1:
        raise ValueError(f"{fn}: {names[0]} must be 1-D (n,), got shape {tuple(first.shape)}; flatten it first")
    for name, a in zip(names[1:], arrays[1:]):
        if tuple(a.shape) != tuple(first.shape):
            raise ValueError(f"{fn}: {name} has shape {tuple(a.shape)}, expected {tuple(first.shape)} "
                             f"(the shape of {names[0]})")


def _launch(fn, prefix, version, threads, arrays):
    """Launch KERNELS[prefix + version] over n = len(arrays[0]) elements with a capped grid."""
    check_version(fn, version, VERSIONS)
    threads = check_threads(fn, threads)
    n = arrays[0].shape[0]
    if n == 0:
        return
    blocks = min(math.ceil(n / threads), MAX_BLOCKS)
    KERNELS[prefix + version][blocks, threads, launch_stream()](*arrays)


def gelu_forward(inp, out, version="v1", threads=256):
    """out[:] = gelu(inp) (tanh form); inp, out float32 (n,)."""
    _check_args("gelu_forward", ("inp", "out"), (inp, out))
    _launch("gelu_forward", "forward_", version, threads, (inp, out))


def gelu_backward(dout, inp, dinp, version="v1", threads=256):
    """dinp[:] = dout * gelu'(inp); dout, inp, dinp float32 (n,)."""
    _check_args("gelu_backward", ("dout", "inp", "dinp"), (dout, inp, dinp))
    _launch("gelu_backward", "", version, threads, (dout, inp, dinp))


def residual_backward(dout, da, db, version="v1", threads=256):
    """da[:] = dout; db[:] = dout (out = a + b); dout, da, db float32 (n,)."""
    _check_args("residual_backward", ("dout", "da", "db"), (dout, da, db))
    _launch("residual_backward", "residual_", version, threads, (dout, da, db))
