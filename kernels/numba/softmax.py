"""softmax_backward: Numba CUDA kernels for lesson 03 (dinp = out * (dout - sum_row(out * dout))).

Every row of N = B*T rows (length n) needs one reduction, s = sum_j out[j] * dout[j], and then an elementwise
write, dinp[j] = out[j] * (dout[j] - s). The versions differ in who does the reduction:

v1: one thread per row: the thread loops over its row twice (sum, then write). Simple, but a warp's 32 threads
    read 32 different rows, so neighbouring threads never touch neighbouring addresses (uncoalesced), and small
    N leaves most of the GPU idle.
v2: one block per row: threads stride the row (coalesced), each keeps a partial sum, and the block adds the
    partials with a tree reduction in shared memory (log2(threads) steps, a __syncthreads between steps).
v3: one block per row, warp shuffles: each warp adds its 32 partials with shfl_xor (no shared memory, no
    barriers), one shared slot per warp, one barrier, then every warp adds the (at most 32) warp sums. GPU-only.
v4: one warp per row, several rows per block: the reduction is shuffles only (no shared memory, no barrier);
    best when rows are short (n of a few hundred to a few thousand). GPU-only.

GPU-only versions use warp intrinsics (cuda.shfl_xor_sync). Numba's own CUDA simulator has none; gpullm_lessons.runtime.simwarp
adds them (``import gpullm_lessons`` installs it when the simulator is on), so these kernels also run there when
launched directly (lesson 03 runs v4 that way). The launcher below still keeps them for the GPU: a block per row
with shuffles and barriers is the simulator's slowest case. They are compiled to PTX on CI
(tests/test_kernels_numba.py). Numba kernels assume 32-lane warps (Numba targets NVIDIA only); the portable HIP
versions in kernels/hip/softmax.cu read warpSize instead.
"""
import math

import numba
import numpy as np
from numba import cuda
from gpullm_lessons.kernels.numba import launch_stream

MAX_THREADS = 1024        # most threads a block may have: the size of v2's shared buffer
WARP = 32                 # lanes per warp (NVIDIA; Numba targets NVIDIA only)
MAX_WARPS = MAX_THREADS // WARP
FULL_MASK = 0xFFFFFFFF    # all 32 lanes take part in a shuffle


# v1: one thread per row. Thread `row` owns dout[row, :], out[row, :], dinp[row, :] (n elements each).
@cuda.jit
def softmax_backward_v1(dout, out, dinp):
    row = cuda.grid(1)
    N, n = dout.shape                      # (N, n)
    if row < N:                            # the grid is rounded up to whole blocks
        s = numba.float32(0.0)
        for j in range(n):                 # pass 1: the row's reduction, s = sum_j out * dout
            s += out[row, j] * dout[row, j]
        for j in range(n):                 # pass 2: the elementwise write
            dinp[row, j] = out[row, j] * (dout[row, j] - s)


# v2: one block per row (block b owns row b), threads stride the row; tree reduction in shared memory.
# blockDim.x must be a power of two (the tree halves the active threads at each step).
@cuda.jit
def softmax_backward_v2(dout, out, dinp):
    partial = cuda.shared.array(MAX_THREADS, numba.float32)   # one partial sum per thread
    row = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    n = dout.shape[1]
    # 1. each thread sums the elements tid, tid + blockDim, tid + 2*blockDim, ... of the row (coalesced reads)
    s = numba.float32(0.0)
    for j in range(tid, n, cuda.blockDim.x):
        s += out[row, j] * dout[row, j]
    partial[tid] = s
    cuda.syncthreads()
    # 2. tree: at each step the first half of the active threads adds the second half's partials
    stride = cuda.blockDim.x // 2
    while stride > 0:
        if tid < stride:
            partial[tid] += partial[tid + stride]
        cuda.syncthreads()                 # every add of this step is done before the next step reads
        stride //= 2
    s = partial[0]                         # the row sum, seen by every thread
    # 3. elementwise write, same striding as step 1
    for j in range(tid, n, cuda.blockDim.x):
        dinp[row, j] = out[row, j] * (dout[row, j] - s)


@cuda.jit(device=True, inline=True)
def warp_sum(v):
    """Sum over the 32 lanes of a warp (butterfly: after 5 xor-shuffles every lane holds the total)."""
    offset = WARP // 2
    while offset > 0:
        v += cuda.shfl_xor_sync(FULL_MASK, v, offset)
        offset //= 2
    return v


# v3: one block per row; warp shuffles reduce inside each warp, one shared slot per warp joins the warps.
# blockDim.x must be a multiple of 32 (whole warps, so every lane of FULL_MASK exists).
@cuda.jit
def softmax_backward_v3(dout, out, dinp):
    warp_sums = cuda.shared.array(MAX_WARPS, numba.float32)   # one slot per warp
    row = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    lane, warp = tid % WARP, tid // WARP
    n_warps = cuda.blockDim.x // WARP
    n = dout.shape[1]
    s = numba.float32(0.0)
    for j in range(tid, n, cuda.blockDim.x):
        s += out[row, j] * dout[row, j]
    s = warp_sum(s)                        # every lane of the warp now holds the warp's sum
    if lane == 0:
        warp_sums[warp] = s
    cuda.syncthreads()                     # the only barrier
    # every warp adds the warp sums itself (so no second barrier is needed to share the result)
    s = warp_sums[lane] if lane < n_warps else numba.float32(0.0)
    s = warp_sum(s)
    for j in range(tid, n, cuda.blockDim.x):
        dinp[row, j] = out[row, j] * (dout[row, j] - s)


# v4: one warp per row; a block of blockDim.x threads handles blockDim.x / 32 rows. Shuffles only.
@cuda.jit
def softmax_backward_v4(dout, out, dinp):
    lane = cuda.threadIdx.x % WARP
    row = cuda.blockIdx.x * (cuda.blockDim.x // WARP) + cuda.threadIdx.x // WARP
    N, n = dout.shape
    if row >= N:                           # the whole warp leaves together: its shuffles stay complete
        return
    s = numba.float32(0.0)
    for j in range(lane, n, WARP):         # lanes stride the row by 32 (coalesced)
        s += out[row, j] * dout[row, j]
    s = warp_sum(s)
    for j in range(lane, n, WARP):
        dinp[row, j] = out[row, j] * (dout[row, j] - s)


KERNELS = {"v1": softmax_backward_v1, "v2": softmax_backward_v2, "v3": softmax_backward_v3,
           "v4": softmax_backward_v4}
_SIG = "void(float32[:, ::1], float32[:, ::1], float32[:, ::1])"   # dout, out, dinp: C-contiguous (N, n)
SIGNATURES = {v: _SIG for v in KERNELS}
GPU_ONLY = {"v3", "v4"}
DEFAULT_THREADS = {"v1": 128, "v2": 256, "v3": 256, "v4": 256}


def _check_args(fn, names, arrays, ndim=2):
    """Same shape, float32, `ndim` dims; raise TypeError/ValueError naming the argument otherwise."""
    for name, a in zip(names, arrays):
        if not (hasattr(a, "shape") and hasattr(a, "dtype")):
            raise TypeError(f"{fn}: {name} must be an array (NumPy, CuPy or Numba device array), "
                            f"got {type(a).__name__}")
    first = arrays[0]
    if len(first.shape) != ndim:
        raise ValueError(f"{fn}: {names[0]} must be {ndim}-D, got shape {tuple(first.shape)}")
    for name, a in zip(names, arrays):
        if np.dtype(a.dtype) != np.float32:
            raise TypeError(f"{fn}: {name} must be float32, got dtype {a.dtype}")
        if tuple(a.shape) != tuple(first.shape):
            raise ValueError(f"{fn}: {name} has shape {tuple(a.shape)}, expected {tuple(first.shape)} "
                             f"(the shape of {names[0]})")


def _check_version(fn, version, gpu_only):
    if version not in KERNELS:
        raise ValueError(f"{fn}: version={version!r} is not one of {', '.join(sorted(KERNELS))}")
    if version in gpu_only and numba.config.ENABLE_CUDASIM:
        raise RuntimeError(f"{fn}: version {version!r} uses warp shuffles, and this launcher keeps it for an NVIDIA "
                           f"GPU (in the simulator, where gpullm_lessons.runtime.simwarp provides the shuffles, launch "
                           f"KERNELS[{version!r}] directly; launcher versions here: "
                           f"{', '.join(v for v in sorted(KERNELS) if v not in gpu_only)})")


def softmax_backward(dout, out, dinp, version=None, threads=None):
    """Launch wrapper (destination-passing): dinp[:] = out * (dout - sum_row(out * dout)).

    dout, out, dinp: float32 (N, n), C-contiguous; NumPy or Numba simulator arrays under the simulator, Numba
    device arrays or CuPy arrays on a GPU. version: "v1".."v4"; None picks v3 on a GPU, v2 in the simulator.
    threads: threads per block (v2: a power of two; v3, v4: a multiple of 32; at most 1024); None picks a
    default (at most 32 in the simulator, which runs every CUDA thread in Python).
    """
    fn = "softmax_backward"
    simulating = bool(numba.config.ENABLE_CUDASIM)
    if version is None:
        version = "v2" if simulating else "v3"
    _check_version(fn, version, GPU_ONLY)
    _check_args(fn, ("dout", "out", "dinp"), (dout, out, dinp))
    if threads is None:
        threads = min(DEFAULT_THREADS[version], 32) if simulating else DEFAULT_THREADS[version]
    threads = int(threads)
    if not 1 <= threads <= MAX_THREADS:
        raise ValueError(f"{fn}: threads={threads} must be in [1, {MAX_THREADS}]")
    if version == "v2" and threads & (threads - 1):
        raise ValueError(f"{fn}: v2's tree reduction needs a power-of-two threads, got {threads}")
    if version in ("v3", "v4") and threads % WARP:
        raise ValueError(f"{fn}: {version} needs whole warps, threads a multiple of {WARP}, got {threads}")
    N = dout.shape[0]
    if N == 0 or dout.shape[1] == 0:
        return
    if version == "v1":
        blocks = math.ceil(N / threads)                # one thread per row
    elif version == "v4":
        blocks = math.ceil(N / (threads // WARP))      # one warp per row
    else:
        blocks = N                                     # one block per row
    KERNELS[version][blocks, threads, launch_stream()](dout, out, dinp)
