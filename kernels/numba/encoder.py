"""encoder: backward of the embedding layer out[b, t] = wte[idx[b, t]] + wpe[t]  (Numba CUDA).

    dwte (V, C):    dwte[v] = sum of dout[b, t] over every (b, t) with idx[b, t] == v   (scatter-add: tokens repeat)
    dwpe (maxT, C): dwpe[t] = sum over b of dout[b, t] for t < T, and 0 for t >= T
The outputs arrive holding garbage: every element must be written (0 where nothing is added).

v1: atomics. v1_zero (one thread per element) zeroes dwte, then dwpe; then v1, one thread per (b, t, c), adds
    dout[b, t, c] into dwte[idx[b, t], c] and dwpe[t, c] with cuda.atomic.add (threads of a repeated token, and
    of the B rows of one position, add into the same element). NOT deterministic: the order in which the atomic
    adds land depends on scheduling, and float addition is not associative, so results can differ in the last
    bits from run to run.
v2: deterministic, no atomics. The wrapper sorts the B*T positions by token on the host (a stable np.argsort of
    idx: one bucket of positions per token, in increasing position order) and passes `order` and each token's
    bucket bounds `starts` (V + 1,). v2: one thread per (v, c) of dwte sums dout[position, c] over token v's
    bucket in that fixed order (an empty bucket writes 0: no zeroing pass needed). v2_dwpe: one thread per
    (t, c) of dwpe sums dout[b, t, c] over b = 0, 1, ... in order. Same bits every run. The price: a copy of
    idx (B*T ints) to the host and a sort on every call (llm.c's encoder backward buckets on the host too).

Launch wrapper (destination-passing, the checker's signature):
    encoder_backward(dout (B,T,C), idx (B,T) int32, dwte (V,C), dwpe (maxT,C), version="v2")
"""
import numba
import numpy as np
from numba import cuda

from gpullm_lessons import arrays, device
from gpullm_lessons.backends._args import check_array

MAX_THREADS = 1024


# v1_zero: thread i owns element i of a (rows, C) array and sets it to 0
@cuda.jit
def encoder_zero_v1(a):
    i = cuda.grid(1)
    rows, C = a.shape
    if i < rows * C:
        a[i // C, i % C] = numba.float32(0.0)


# v1: thread i owns dout[b, t, c], i = (b * T + t) * C + c, and adds it where it belongs, atomically
@cuda.jit
def encoder_backward_v1(dout, idx, dwte, dwpe):
    i = cuda.grid(1)
    B, T, C = dout.shape
    if i < B * T * C:
        c = i % C
        t = (i // C) % T
        b = i // (T * C)
        g = dout[b, t, c]
        cuda.atomic.add(dwte, (idx[b, t], c), g)       # another (b', t') with the same token adds here too
        cuda.atomic.add(dwpe, (t, c), g)               # the B threads of position t add here


# v2: thread i owns dwte[v, c], i = v * C + c, and sums token v's bucket of positions in a fixed order
#     order (B*T,): positions p = b * T + t sorted by token; starts (V + 1,): token v's bucket is
#     order[starts[v]:starts[v + 1]]
@cuda.jit
def encoder_backward_v2(dout, order, starts, dwte):
    i = cuda.grid(1)
    V, C = dwte.shape
    T = dout.shape[1]
    if i < V * C:
        v = i // C
        c = i % C                                      # neighbouring threads: neighbouring c (coalesced)
        acc = numba.float32(0.0)                       # float32 accumulator
        for k in range(starts[v], starts[v + 1]):
            p = order[k]
            acc += dout[p // T, p % T, c]
        dwte[v, c] = acc                               # 0 for a token that never appears


# v2_dwpe: thread i owns dwpe[t, c], i = t * C + c: the sum over b of dout[b, t, c] (0 for t >= T)
@cuda.jit
def encoder_backward_v2_dwpe(dout, dwpe):
    i = cuda.grid(1)
    maxT, C = dwpe.shape
    B, T, _ = dout.shape
    if i < maxT * C:
        t = i // C
        c = i % C
        acc = numba.float32(0.0)
        if t < T:
            for b in range(B):
                acc += dout[b, t, c]
        dwpe[t, c] = acc


KERNELS = {"v1_zero": encoder_zero_v1, "v1": encoder_backward_v1,
           "v2": encoder_backward_v2, "v2_dwpe": encoder_backward_v2_dwpe}
SIGNATURES = {
    "v1_zero": "void(float32[:, ::1])",
    "v1": "void(float32[:, :, ::1], int32[:, ::1], float32[:, ::1], float32[:, ::1])",
    "v2": "void(float32[:, :, ::1], int32[::1], int32[::1], float32[:, ::1])",
    "v2_dwpe": "void(float32[:, :, ::1], float32[:, ::1])",
}
GPU_ONLY = set()
VERSIONS = ("v1", "v2")


def check_inputs(dout, idx, dwte, dwpe, cupy=False):
    """Validate shapes and dtypes; returns (B, T, C, V, maxT). cupy=True: CuPy arrays only (the HIP wrapper)."""
    if not hasattr(dout, "shape") or len(dout.shape) != 3:
        raise ValueError(f"encoder_backward: dout must be 3-D (B, T, C), got shape {getattr(dout, 'shape', None)}")
    B, T, C = dout.shape
    for name, a in (("dwte", dwte), ("dwpe", dwpe)):
        if not hasattr(a, "shape") or len(a.shape) != 2:
            raise ValueError(f"encoder_backward: {name} must be 2-D, got shape {getattr(a, 'shape', None)}")
    V, maxT = dwte.shape[0], dwpe.shape[0]
    check_array("encoder_backward", "dout", dout, (B, T, C), "float32", cupy=cupy)
    check_array("encoder_backward", "idx", idx, (B, T), "int32", cupy=cupy)
    check_array("encoder_backward", "dwte", dwte, (V, C), "float32", cupy=cupy)
    check_array("encoder_backward", "dwpe", dwpe, (maxT, C), "float32", cupy=cupy)
    if maxT < T:
        raise ValueError(f"encoder_backward: dwpe has shape {tuple(dwpe.shape)}: it needs maxT >= T = {T} rows")
    return B, T, C, V, maxT


def token_buckets(idx_host, V):
    """Host-side bucketing for v2: (order (B*T,) int32, starts (V + 1,) int32); token v's positions, in
    increasing order, are order[starts[v]:starts[v + 1]]. Raises ValueError for a token outside [0, V)."""
    flat = np.asarray(idx_host).ravel()
    if flat.size and (flat.min() < 0 or flat.max() >= V):
        raise ValueError(f"encoder_backward: idx must be in [0, V={V}), got min {flat.min()}, max {flat.max()}")
    order = np.argsort(flat, kind="stable").astype(np.int32)         # positions grouped by token
    starts = np.zeros(V + 1, np.int32)
    starts[1:] = np.cumsum(np.bincount(flat, minlength=V))            # bucket bounds
    return order, starts


def _blocks(n, threads):
    return max((n + threads - 1) // threads, 1)


def encoder_backward(dout, idx, dwte, dwpe, version="v2", threads=None):
    """dwte = 0, dwpe = 0, then dwte[idx[b, t]] += dout[b, t] and dwpe[t] += dout[b, t] for every (b, t).

    Arrays: Numba device arrays or CuPy arrays on a GPU; Numba simulator arrays or NumPy arrays in the simulator.
    v1 does not check that idx is in [0, V) (that would need a copy to the host); v2 does.
    """
    B, T, C, V, maxT = check_inputs(dout, idx, dwte, dwpe)
    if version not in VERSIONS:
        raise ValueError(f"encoder_backward: version={version!r}, expected one of {', '.join(VERSIONS)}")
    if threads is None:
        threads = 256 if device.numba_on_gpu() else 64
    if not 1 <= threads <= MAX_THREADS:
        raise ValueError(f"encoder_backward: threads={threads}, expected 1..{MAX_THREADS}")
    if version == "v1":
        encoder_zero_v1[_blocks(V * C, threads), threads](dwte)
        encoder_zero_v1[_blocks(maxT * C, threads), threads](dwpe)
        if B * T * C:
            encoder_backward_v1[_blocks(B * T * C, threads), threads](dout, idx, dwte, dwpe)
    else:
        order, starts = token_buckets(arrays.to_numpy(idx), V)
        kind = arrays.backend_of(idx)
        order, starts = arrays.to_backend(order, kind), arrays.to_backend(starts, kind)
        encoder_backward_v2[_blocks(V * C, threads), threads](dout, order, starts, dwte)
        encoder_backward_v2_dwpe[_blocks(maxT * C, threads), threads](dout, dwpe)
    return dwte, dwpe
