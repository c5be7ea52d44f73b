"""softmax_backward through the portable kernels of kernels/hip/softmax.cu, launched with CuPy (NVIDIA or AMD).

Same name, signature and versions as kernels/numba/softmax.py (v1 one thread per row, v2 one block per row with a
shared-memory tree, v3 one block per row with warp shuffles, v4 one warp per row). HIP only:
v5: v4 with float4 loads and the row held in registers between the two passes (n % 4 == 0 and 16-byte aligned
arrays; otherwise v4's scalar loop inside the same kernel). Arrays are CuPy arrays.
"""
from __future__ import annotations

import functools

import numpy as np

VERSIONS = ("v1", "v2", "v3", "v4", "v5")
DEFAULT_THREADS = {"v1": 128, "v2": 256, "v3": 256, "v4": 256, "v5": 256}


@functools.lru_cache(maxsize=None)
def warp_size(device_id: int = 0) -> int:
    """Lanes per warp of the GPU: 32 on NVIDIA, 64 on AMD CDNA (read from the device, never assumed)."""
    import cupy
    return int(cupy.cuda.runtime.getDeviceProperties(device_id)["warpSize"])


def check_cupy_args(fn, names, arrays, ndim):
    """CuPy, float32, C-contiguous, `ndim` dims, all of one shape; TypeError/ValueError naming the argument."""
    import cupy
    for name, a in zip(names, arrays):
        if not isinstance(a, cupy.ndarray):
            raise TypeError(f"{fn}: {name} must be a CuPy array (HIP kernels read GPU memory), "
                            f"got {type(a).__module__}.{type(a).__name__}")
        if a.dtype != np.float32:
            raise TypeError(f"{fn}: {name} must be float32, got dtype {a.dtype}")
        if not a.flags.c_contiguous:
            raise ValueError(f"{fn}: {name} must be C-contiguous (use cupy.ascontiguousarray)")
    first = arrays[0]
    if first.ndim != ndim:
        raise ValueError(f"{fn}: {names[0]} must be {ndim}-D, got shape {first.shape}")
    for name, a in zip(names[1:], arrays[1:]):
        if a.shape != first.shape:
            raise ValueError(f"{fn}: {name} has shape {a.shape}, expected {first.shape} (the shape of {names[0]})")


def softmax_backward(dout, out, dinp, version="v3", threads=None):
    """dinp[:] = out * (dout - sum_row(out * dout)); dout, out, dinp float32 (N, n) CuPy arrays.

    threads: per block (v2: a power of two; v3, v4, v5: a multiple of the warp size; at most 1024); None: default.
    v5 lowers threads to what its register use allows (its kernel's max_threads_per_block).
    """
    from gpullm_lessons import hip
    fn = "softmax_backward"
    if version not in VERSIONS:
        raise ValueError(f"{fn}: version={version!r} is not one of {', '.join(VERSIONS)}")
    check_cupy_args(fn, ("dout", "out", "dinp"), (dout, out, dinp), ndim=2)
    threads = DEFAULT_THREADS[version] if threads is None else int(threads)
    if not 1 <= threads <= 1024:
        raise ValueError(f"{fn}: threads={threads} must be in [1, 1024]")
    if version == "v2" and threads & (threads - 1):
        raise ValueError(f"{fn}: v2's tree reduction needs a power-of-two threads, got {threads}")
    N, n = dout.shape
    if N == 0 or n == 0:
        return
    if N >= 2**31 or n >= 2**31:
        raise ValueError(f"{fn}: N={N} and n={n} must each fit in an int32")
    ws = warp_size(dout.device.id) if version in ("v3", "v4", "v5") else 1
    if threads % ws:
        raise ValueError(f"{fn}: {version} needs whole warps, threads a multiple of {ws}, got {threads}")
    k = hip.kernel("softmax", f"softmax_backward_{version}")
    if version == "v5":
        # v5 holds its rows in registers (~100 per thread on sm_90): the GPU runs at most max_threads_per_block
        # threads of it per block (about 640 on NVIDIA), so a larger threads= is lowered to whole warps below that
        threads = min(threads, int(getattr(k, "max_threads_per_block", 1024)) // ws * ws)
    if version == "v1":
        blocks = (N + threads - 1) // threads                      # one thread per row
    elif version in ("v4", "v5"):
        rows_per_block = threads // ws                              # one warp per row
        blocks = (N + rows_per_block - 1) // rows_per_block
    else:
        blocks = N                                                  # one block per row
    k((blocks,), (threads,), (dout, out, dinp, np.int32(N), np.int32(n)))
