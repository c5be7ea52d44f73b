"""crossentropy: fused softmax + cross-entropy, forward (per-row losses) and backward (dlogits), Numba CUDA.

A row of logits (V,) needs only two numbers for both its loss and its gradient: its max m and its sum
s = sum_j exp(logits_j - m). Online softmax gets both in ONE read of the row: keep a running max and rescale
the running sum whenever the max grows,  s <- s * exp(m_old - m_new) + exp(x - m_new). Then
    loss_row   = m + log(s) - logits[target]                  (= -log softmax(logits)[target])
    dlogits_j  = (exp(logits_j - m) / s - [j == target]) / N  (dloss = 1, the loss is the mean over N rows)
dlogits is written directly: the probabilities are never stored as a separate (N, V) tensor.
Two partial (max, sum) pairs merge the same way: m = max(m_a, m_b), s = s_a exp(m_a - m) + s_b exp(m_b - m),
so many threads can each reduce a slice of a row and then merge their pairs.

Versions (KERNELS keys: "vN" is the backward kernel, "vN_forward" the forward kernel with the same reduction):
v1: one thread per row; it reads its row twice (the (max, sum) pass, then the dlogits pass). Few threads
    when N is small, and neighbouring threads read addresses V floats apart (uncoalesced).
    v1_forward: the same thread writes losses[row].
v2: one block per row: thread k reduces logits k, k + threads, ... (neighbours read neighbours: coalesced),
    then the block merges its (max, sum) pairs in shared memory, a tree of log2(threads) steps.
    v2_forward: the same reduction, thread 0 writes losses[row].
    v2_fused: v2 computing losses and dlogits in one launch (crossentropy_forward_backward).
v3 (GPU-only): v2, but each warp first merges its pairs with shuffles (cuda.shfl_xor_sync, not supported by
    the simulator), so shared memory holds one pair per warp and the block needs one syncthreads, not log2(threads).
    v3_forward (GPU-only): the same reduction, thread 0 writes losses[row].

Launch wrappers (destination-passing, the checker's signatures, `version=` keyword):
    crossentropy_forward(logits (N,V), targets (N,) int32, losses (N,))
    crossentropy_backward(logits (N,V), targets (N,) int32, dlogits (N,V))
    crossentropy_forward_backward(logits, targets, losses, dlogits)            (v2_fused)
"""
import math

import numba
import numpy as np
from numba import cuda

from gpullm_lessons import device
from gpullm_lessons.contracts.crossentropy import HALF_FORMATS, check_half_inputs, check_inputs  # noqa: F401
from gpullm_lessons.kernels.numba import launch_stream, device_scratch

MAX_THREADS = 1024               # the largest block: size of the shared arrays of v2
WARP = 32                        # Numba CUDA runs on NVIDIA GPUs only: 32 lanes per warp
MAX_WARPS = MAX_THREADS // WARP  # size of the shared arrays of v3 (one pair per warp)
FULL_MASK = 0xFFFFFFFF           # every lane of the warp takes part in the shuffle


# Every kernel is written out in full (a shared helper would have to be @cuda.jit(device=True, inline=True): a plain
# device function needs a CUDA driver to compile to PTX, and tests/test_kernels_numba.py compiles without one).
# The steps repeat from kernel to kernel; comments name them:
#   "online softmax": fold x into (m, s):  if x > m: s = s * exp(m - x) + 1; m = x   else: s += exp(x - m)
#   "merge":          m = max(m_a, m_b); s = s_a * exp(m_a - m) + s_b * exp(m_b - m)
# A thread that got no element holds (EMPTY, 0): EMPTY is finite, so two empty pairs merge to (EMPTY, 0) with
# exp(0) * 0, where -inf would give exp(-inf - -inf) = exp(nan).
EMPTY = -3.0e38


# ---- v1: one thread per row --------------------------------------------------------------------------------------
# v1: thread `row` owns logits[row, :] (V,): one online-softmax pass, then it writes dlogits[row, :] (V,)
@cuda.jit
def crossentropy_backward_v1(logits, targets, dlogits):
    row = cuda.grid(1)
    N, V = logits.shape
    if row >= N:
        return
    m = numba.float32(EMPTY)                      # running max of the row
    s = numba.float32(0.0)                        # running sum of exp(x - m)
    c = numba.float32(0.0)                        # Kahan compensation: the low bits s lost so far
    for j in range(V):                            # online softmax: one read of the row
        x = logits[row, j]
        if x > m:                                 # new max: rescale what was summed (and its compensation)
            r = math.exp(m - x)
            s, c, m, y = s * r, c * r, x, numba.float32(1.0)
        else:
            y = math.exp(x - m)
        y -= c                                    # one thread adds up to V = 50k terms: a plain float32 sum
        t = s + y                                 # drifts by ~1e-4 relative, so v1 compensates (Kahan)
        c = (t - s) - y
        s = t
    inv_s = numba.float32(1.0) / s
    inv_n = numba.float32(1.0) / numba.float32(N)
    t = targets[row]
    for j in range(V):                            # dlogits = (probs - onehot) / N, probs never stored
        d = math.exp(logits[row, j] - m) * inv_s
        if j == t:
            d -= numba.float32(1.0)
        dlogits[row, j] = d * inv_n


# v1_forward: thread `row` owns logits[row, :] (V,) and writes losses[row] = m + log(s) - logits[row, target]
@cuda.jit
def crossentropy_forward_v1(logits, targets, losses):
    row = cuda.grid(1)
    N, V = logits.shape
    if row >= N:
        return
    m = numba.float32(EMPTY)
    s = numba.float32(0.0)
    c = numba.float32(0.0)
    for j in range(V):                            # online softmax with a compensated sum, as in v1 backward
        x = logits[row, j]
        if x > m:
            r = math.exp(m - x)
            s, c, m, y = s * r, c * r, x, numba.float32(1.0)
        else:
            y = math.exp(x - m)
        y -= c
        t = s + y
        c = (t - s) - y
        s = t
    losses[row] = m + math.log(s) - logits[row, targets[row]]


# ---- v2: one block per row, shared-memory tree ---------------------------------------------------------------------
# v2: block `row` owns logits[row, :] (V,); thread tid reduces and writes elements tid, tid + blockDim, ...
# blockDim must be a power of 2 (the tree halves it).
@cuda.jit
def crossentropy_backward_v2(logits, targets, dlogits):
    sh_m = cuda.shared.array(MAX_THREADS, numba.float32)   # one (max, sum) pair per thread
    sh_s = cuda.shared.array(MAX_THREADS, numba.float32)
    row = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    N, V = logits.shape
    if row >= N:                                  # the whole block leaves together (no syncthreads skipped)
        return
    m = numba.float32(EMPTY)
    s = numba.float32(0.0)
    for j in range(tid, V, cuda.blockDim.x):      # online softmax over this thread's slice (coalesced reads)
        x = logits[row, j]
        if x > m:
            s = s * math.exp(m - x) + numba.float32(1.0)
            m = x
        else:
            s += math.exp(x - m)
    sh_m[tid] = m
    sh_s[tid] = s
    cuda.syncthreads()
    stride = cuda.blockDim.x // 2
    while stride > 0:                             # tree: thread tid merges the pair of tid + stride into its own
        if tid < stride:
            m_b = sh_m[tid + stride]
            m = max(sh_m[tid], m_b)
            sh_s[tid] = sh_s[tid] * math.exp(sh_m[tid] - m) + sh_s[tid + stride] * math.exp(m_b - m)
            sh_m[tid] = m
        cuda.syncthreads()
        stride //= 2
    m = sh_m[0]                                   # the row's (max, sum), read by every thread
    inv_s = numba.float32(1.0) / sh_s[0]
    inv_n = numba.float32(1.0) / numba.float32(N)
    t = targets[row]
    for j in range(tid, V, cuda.blockDim.x):      # dlogits = (probs - onehot) / N
        d = math.exp(logits[row, j] - m) * inv_s
        if j == t:
            d -= numba.float32(1.0)
        dlogits[row, j] = d * inv_n


# v2_forward: as v2, and thread 0 writes losses[row]
@cuda.jit
def crossentropy_forward_v2(logits, targets, losses):
    sh_m = cuda.shared.array(MAX_THREADS, numba.float32)
    sh_s = cuda.shared.array(MAX_THREADS, numba.float32)
    row = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    N, V = logits.shape
    if row >= N:
        return
    m = numba.float32(EMPTY)
    s = numba.float32(0.0)
    for j in range(tid, V, cuda.blockDim.x):      # online softmax over this thread's slice
        x = logits[row, j]
        if x > m:
            s = s * math.exp(m - x) + numba.float32(1.0)
            m = x
        else:
            s += math.exp(x - m)
    sh_m[tid] = m
    sh_s[tid] = s
    cuda.syncthreads()
    stride = cuda.blockDim.x // 2
    while stride > 0:                             # tree merge of the pairs
        if tid < stride:
            m_b = sh_m[tid + stride]
            m = max(sh_m[tid], m_b)
            sh_s[tid] = sh_s[tid] * math.exp(sh_m[tid] - m) + sh_s[tid + stride] * math.exp(m_b - m)
            sh_m[tid] = m
        cuda.syncthreads()
        stride //= 2
    if tid == 0:
        losses[row] = sh_m[0] + math.log(sh_s[0]) - logits[row, targets[row]]


# v2_fused: as v2, one reduction, both outputs in one launch: losses[row] and dlogits[row, :]
@cuda.jit
def crossentropy_forward_backward_v2(logits, targets, losses, dlogits):
    sh_m = cuda.shared.array(MAX_THREADS, numba.float32)
    sh_s = cuda.shared.array(MAX_THREADS, numba.float32)
    row = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    N, V = logits.shape
    if row >= N:
        return
    m = numba.float32(EMPTY)
    s = numba.float32(0.0)
    for j in range(tid, V, cuda.blockDim.x):      # online softmax over this thread's slice
        x = logits[row, j]
        if x > m:
            s = s * math.exp(m - x) + numba.float32(1.0)
            m = x
        else:
            s += math.exp(x - m)
    sh_m[tid] = m
    sh_s[tid] = s
    cuda.syncthreads()
    stride = cuda.blockDim.x // 2
    while stride > 0:                             # tree merge of the pairs
        if tid < stride:
            m_b = sh_m[tid + stride]
            m = max(sh_m[tid], m_b)
            sh_s[tid] = sh_s[tid] * math.exp(sh_m[tid] - m) + sh_s[tid + stride] * math.exp(m_b - m)
            sh_m[tid] = m
        cuda.syncthreads()
        stride //= 2
    m = sh_m[0]
    s = sh_s[0]
    t = targets[row]
    if tid == 0:
        losses[row] = m + math.log(s) - logits[row, t]
    inv_s = numba.float32(1.0) / s
    inv_n = numba.float32(1.0) / numba.float32(N)
    for j in range(tid, V, cuda.blockDim.x):      # dlogits = (probs - onehot) / N
        d = math.exp(logits[row, j] - m) * inv_s
        if j == t:
            d -= numba.float32(1.0)
        dlogits[row, j] = d * inv_n


# ---- v3 (GPU-only): v2 with warp shuffles -------------------------------------------------------------------------
# v3: block `row` owns logits[row, :]; each warp merges its 32 pairs with shuffles (butterfly: every lane ends
# with the warp's pair), lane 0 of each warp stores it in shared memory, then every warp merges those n_warps
# pairs the same way, so every thread holds the row's pair after ONE syncthreads. blockDim: a multiple of 32.
@cuda.jit
def crossentropy_backward_v3(logits, targets, dlogits):
    sh_m = cuda.shared.array(MAX_WARPS, numba.float32)     # one (max, sum) pair per warp
    sh_s = cuda.shared.array(MAX_WARPS, numba.float32)
    row = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    lane = tid % WARP
    warp = tid // WARP
    n_warps = cuda.blockDim.x // WARP
    N, V = logits.shape
    if row >= N:
        return
    m = numba.float32(EMPTY)
    s = numba.float32(0.0)
    for j in range(tid, V, cuda.blockDim.x):      # online softmax over this thread's slice
        x = logits[row, j]
        if x > m:
            s = s * math.exp(m - x) + numba.float32(1.0)
            m = x
        else:
            s += math.exp(x - m)
    offset = WARP // 2
    while offset > 0:                             # 1) merge within the warp, registers only
        m_b = cuda.shfl_xor_sync(FULL_MASK, m, offset)
        s_b = cuda.shfl_xor_sync(FULL_MASK, s, offset)
        m_new = max(m, m_b)
        s = s * math.exp(m - m_new) + s_b * math.exp(m_b - m_new)
        m = m_new
        offset //= 2
    if lane == 0:
        sh_m[warp] = m
        sh_s[warp] = s
    cuda.syncthreads()
    m = sh_m[lane] if lane < n_warps else numba.float32(EMPTY)
    s = sh_s[lane] if lane < n_warps else numba.float32(0.0)
    offset = WARP // 2
    while offset > 0:                             # 2) every warp merges the n_warps pairs: the row's pair
        m_b = cuda.shfl_xor_sync(FULL_MASK, m, offset)
        s_b = cuda.shfl_xor_sync(FULL_MASK, s, offset)
        m_new = max(m, m_b)
        s = s * math.exp(m - m_new) + s_b * math.exp(m_b - m_new)
        m = m_new
        offset //= 2
    inv_s = numba.float32(1.0) / s
    inv_n = numba.float32(1.0) / numba.float32(N)
    t = targets[row]
    for j in range(tid, V, cuda.blockDim.x):      # dlogits = (probs - onehot) / N
        d = math.exp(logits[row, j] - m) * inv_s
        if j == t:
            d -= numba.float32(1.0)
        dlogits[row, j] = d * inv_n


# v3_forward: as v3, and thread 0 writes losses[row]
@cuda.jit
def crossentropy_forward_v3(logits, targets, losses):
    sh_m = cuda.shared.array(MAX_WARPS, numba.float32)
    sh_s = cuda.shared.array(MAX_WARPS, numba.float32)
    row = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    lane = tid % WARP
    warp = tid // WARP
    n_warps = cuda.blockDim.x // WARP
    N, V = logits.shape
    if row >= N:
        return
    m = numba.float32(EMPTY)
    s = numba.float32(0.0)
    for j in range(tid, V, cuda.blockDim.x):      # online softmax over this thread's slice
        x = logits[row, j]
        if x > m:
            s = s * math.exp(m - x) + numba.float32(1.0)
            m = x
        else:
            s += math.exp(x - m)
    offset = WARP // 2
    while offset > 0:                             # 1) merge within the warp
        m_b = cuda.shfl_xor_sync(FULL_MASK, m, offset)
        s_b = cuda.shfl_xor_sync(FULL_MASK, s, offset)
        m_new = max(m, m_b)
        s = s * math.exp(m - m_new) + s_b * math.exp(m_b - m_new)
        m = m_new
        offset //= 2
    if lane == 0:
        sh_m[warp] = m
        sh_s[warp] = s
    cuda.syncthreads()
    if warp == 0:                                 # 2) warp 0 merges the n_warps pairs; lane 0 writes the loss
        m = sh_m[lane] if lane < n_warps else numba.float32(EMPTY)
        s = sh_s[lane] if lane < n_warps else numba.float32(0.0)
        offset = WARP // 2
        while offset > 0:
            m_b = cuda.shfl_xor_sync(FULL_MASK, m, offset)
            s_b = cuda.shfl_xor_sync(FULL_MASK, s, offset)
            m_new = max(m, m_b)
            s = s * math.exp(m - m_new) + s_b * math.exp(m_b - m_new)
            m = m_new
            offset //= 2
        if lane == 0:
            losses[row] = m + math.log(s) - logits[row, targets[row]]


KERNELS = {
    "v1": crossentropy_backward_v1, "v1_forward": crossentropy_forward_v1,
    "v2": crossentropy_backward_v2, "v2_forward": crossentropy_forward_v2,
    "v2_fused": crossentropy_forward_backward_v2,
    "v3": crossentropy_backward_v3, "v3_forward": crossentropy_forward_v3,
}
_BWD = "void(float32[:, ::1], int32[::1], float32[:, ::1])"
_FWD = "void(float32[:, ::1], int32[::1], float32[::1])"
SIGNATURES = {
    "v1": _BWD, "v1_forward": _FWD, "v2": _BWD, "v2_forward": _FWD,
    "v2_fused": "void(float32[:, ::1], int32[::1], float32[::1], float32[:, ::1])",
    "v3": _BWD, "v3_forward": _FWD,
}
GPU_ONLY = {"v3", "v3_forward"}
VERSIONS = ("v1", "v2", "v3")     # what `version=` accepts (v2_fused is crossentropy_forward_backward)


# ---- launch wrappers ------------------------------------------------------------------------------------------------


def _pick(fn, version, threads, allowed=VERSIONS):
    """Validate version and threads; the block size defaults to 32 in the simulator (each thread runs in Python)."""
    if version not in allowed:
        raise ValueError(f"{fn}: version={version!r}, expected one of {', '.join(allowed)}")
    if version in GPU_ONLY and not device.numba_on_gpu():
        raise RuntimeError(f"{fn}: version {version!r} uses warp shuffles, which Numba's CUDA simulator does not "
                           f"support: it runs on an NVIDIA GPU only (use v1 or v2 here)")
    if threads is None:
        threads = 256 if device.numba_on_gpu() else 32
    if version != "v1" and (threads < WARP or threads > MAX_THREADS or threads & (threads - 1)):
        raise ValueError(f"{fn}: threads={threads}: {version} needs a power of 2 in [{WARP}, {MAX_THREADS}]")
    if not 1 <= threads <= MAX_THREADS:
        raise ValueError(f"{fn}: threads={threads}, expected 1..{MAX_THREADS}")
    return threads


def _grid(version, N, threads):
    return (N + threads - 1) // threads if version == "v1" else N   # v1: a thread per row; v2, v3: a block per row


def crossentropy_backward(logits, targets, dlogits, version="v2", threads=None):
    """dlogits (N,V) = (softmax(logits) - onehot(targets)) / N, for dloss = 1 and the mean loss over N rows."""
    N, _ = check_inputs("crossentropy_backward", logits, targets, dlogits=dlogits)
    threads = _pick("crossentropy_backward", version, threads)
    if N:
        KERNELS[version][_grid(version, N, threads), threads, launch_stream()](logits, targets, dlogits)
    return dlogits


def crossentropy_forward(logits, targets, losses, version="v2", threads=None):
    """losses (N,) = -log softmax(logits)[target] per row (the mean loss is losses.mean())."""
    N, _ = check_inputs("crossentropy_forward", logits, targets, losses=losses)
    threads = _pick("crossentropy_forward", version, threads)
    if N:
        KERNELS[version + "_forward"][_grid(version, N, threads), threads, launch_stream()](logits, targets, losses)
    return losses


def crossentropy_forward_backward(logits, targets, losses, dlogits, version="v2", threads=None):
    """Both in one launch (v2_fused): losses (N,) per row and dlogits (N,V) = (softmax - onehot) / N."""
    N, _ = check_inputs("crossentropy_forward_backward", logits, targets, losses=losses, dlogits=dlogits)
    threads = _pick("crossentropy_forward_backward", version, threads, allowed=("v2",))
    if N:
        KERNELS["v2_fused"][N, threads, launch_stream()](logits, targets, losses, dlogits)
    return losses, dlogits


LAUNCHERS = ("crossentropy_forward_backward_half",)   # gathered by backends/_collect.py


def crossentropy_forward_backward_half(logits, targets, losses, dlogits, half, threads=None):
    """crossentropy_forward_backward with dlogits (N, V) uint16 half bits ("bf16" | "fp16"): here the fused v2
    kernel into a float32 scratch, then the conversion kernel (the HIP twin writes the half bits directly).
    logits may be uint16, the half bits of the same format: widened to a float32 scratch first (the HIP twin reads
    them as they are); dlogits may then be logits itself (written over them)."""
    from .convert import f32_to_bf16, f32_to_f16, widen_half
    fn = "crossentropy_forward_backward_half"
    N, V = check_half_inputs(fn, logits, targets, losses, dlogits, half)
    if not N:
        return losses, dlogits
    if isinstance(logits, np.ndarray):
        scratch = np.empty((N, V), np.float32)
    else:
        scratch = device_scratch((N, V), np.float32)          # CuPy's pool on a GPU
    if str(logits.dtype) == "uint16":  # the half logits as float32, exactly
        logits = widen_half(logits, half)
    crossentropy_forward_backward(logits, targets, losses, scratch, threads=threads)
    (f32_to_bf16 if half == "bf16" else f32_to_f16)(scratch.reshape(-1), dlogits.reshape(-1))
    return losses, dlogits
