"""vector_add: the first Numba CUDA kernels of lesson 00 (they run on an NVIDIA GPU or in the simulator).

v1: one thread per element, guarded by `i < n` because the grid is rounded up to whole blocks.
v2: grid-stride loop, so a fixed-size grid covers any n (the form every later kernel uses).
"""
from numba import cuda
from gpullm_lessons.kernels.numba import launch_stream


# v1: one thread per element
@cuda.jit
def vector_add_v1(a, b, out):
    i = cuda.grid(1)
    if i < out.shape[0]:
        out[i] = a[i] + b[i]


# v2: grid-stride loop: each thread handles i, i + stride, i + 2*stride, ...
@cuda.jit
def vector_add_v2(a, b, out):
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    for i in range(start, out.shape[0], stride):
        out[i] = a[i] + b[i]


KERNELS = {"v1": vector_add_v1, "v2": vector_add_v2}
# Argument types for compiling without a GPU (tests compile every version to PTX for sm_90).
SIGNATURES = {"v1": "void(float32[::1], float32[::1], float32[::1])",
              "v2": "void(float32[::1], float32[::1], float32[::1])"}


def vector_add(a, b, out, version="v2", threads=256):
    """Launch wrapper (destination-passing): out[:] = a + b. Arrays: NumPy under the simulator, CuPy or Numba on a GPU."""
    n = out.shape[0]
    if not (a.shape == b.shape == out.shape) or len(out.shape) != 1:
        raise ValueError(f"vector_add: a, b, out must be 1-D of one length; got {a.shape}, {b.shape}, {out.shape}")
    blocks = (n + threads - 1) // threads if version == "v1" else min((n + threads - 1) // threads, 1024)
    KERNELS[version][max(blocks, 1), threads, launch_stream()](a, b, out)
    return out
