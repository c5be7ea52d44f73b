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
v3: deterministic AND all on the GPU: fixed-point integer atomics (no copy to the host, no sync: a CUDA graph can
    capture it; v2 cannot). Integer addition is associative, so the total does not depend on the order the atomics
    land in. v3_amax (block partial maxima) and v3_scale (one block): m = max |dout| and a power of two 2^e with
    (B*T) * m * 2^e < 2^62 (the worst case: every position holds the same token), kept on the device in
    scale = [2^e, 2^-e]. v3_zero zeroes an int64 scratch acc (V, C); v3_add, one thread per (b, t, c), adds the
    integer q = rint(dout[b, t, c] * 2^e) into acc[idx[b, t], c] with cuda.atomic.add; v3_finish writes
    dwte = acc * 2^-e (v3_finish_add adds it into dwte: the launcher's accumulate=True); dwpe as v2
    (v2_dwpe). Same bits every run and for any order of the positions. The price:
    an element of dwte is exact to (its token's count) * 2^-e / 2, about max|dout| * (B*T)^2 * 2^-63: elements far
    below max|dout| lose relative accuracy (a dout of 1e30 wipes out the O(1) ones); a non-finite dout makes all of
    dwte NaN; 8 bytes of scratch per element of dwte.
v1 and v3 do not check that idx is in [0, V) (that needs idx on the host: the engine checks token ids on the host
before they reach the GPU); v2 does.

Launch wrapper (destination-passing, the checker's signature):
    encoder_backward(dout (B,T,C), idx (B,T) int32, dwte (V,C), dwpe (maxT,C), version="v2", threads=None,
                     accumulate=False)
"""
import numba
import numpy as np
from numba import cuda

from gpullm_lessons.runtime import arrays
from gpullm_lessons import device
from gpullm_lessons.contracts.encoder import check_inputs, token_buckets   # shared with the HIP launcher
from gpullm_lessons.kernels.numba import launch_stream, device_scratch

MAX_THREADS = 1024


# v1_zero: thread i owns element i of a (rows, C) array and sets it to 0
@cuda.jit
def encoder_backward_v1_zero(a):
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


# ---- v3: fixed-point integer atomics (see the module docstring) ------------------------------------------------------
# The error of dwte[v, c] is at most (count of v) * 2^-e / 2 (each q's rint) plus the final float32 rounding.
FLT_MAX = 3.4028234663852886e38
AMAX_BLOCKS = 1024          # partial maxima: at most this many blocks (grid-stride), one partial each
ADD_BLOCKS = 65535          # v3_add / v3_zero / v3_finish: grid-stride beyond this many blocks
SIM_BLOCKS = 2              # in the simulator (every GPU thread runs in Python) every v3 kernel: at most 2 blocks,
SIM_REDUCE_THREADS = 16     # and the block reductions at most 16 threads (fewer simulated threads)


@cuda.jit(device=True, inline=True)   # inlined: a kernel calling a device function compiles to PTX without a GPU
def _block_max(v, buf):
    """The max of v over the threads of the block, for any block size: a tree over shared memory (pairs tid and
    tid + s for s = half the next power of two >= the block size, then halving). No warp intrinsics."""
    tid = cuda.threadIdx.x
    n = cuda.blockDim.x
    buf[tid] = v
    cuda.syncthreads()
    p = 1
    while p < n:
        p *= 2
    s = p // 2
    while s > 0:
        if tid < s and tid + s < n:
            buf[tid] = max(buf[tid], buf[tid + s])
        cuda.syncthreads()
        s //= 2
    return buf[0]


# v3_amax: block j writes partial[j] = max |dout| over its grid-stride share of the B*T*C elements (0 for none);
# a NaN counts as +inf (so that a non-finite dout is seen by v3_scale)
@cuda.jit
def encoder_backward_v3_amax(dout, partial):
    buf = cuda.shared.array(MAX_THREADS, numba.float32)
    B, T, C = dout.shape
    m = numba.float32(0.0)
    for i in range(cuda.grid(1), B * T * C, cuda.gridsize(1)):
        a = abs(dout[i // (T * C), (i // C) % T, i % C])
        if a != a:
            a = numba.float32(np.inf)
        m = max(m, a)
    m = _block_max(m, buf)
    if cuda.threadIdx.x == 0:
        partial[cuda.blockIdx.x] = m


# v3_scale (one block): m = max(partial); scale[0] = 2^e, scale[1] = 2^-e with N * m * 2^e < 2^62 (N = B*T):
# p = 2^k with p / 2 <= m < p (what frexp gives, by halving/doubling: exact in float64), 2^j >= N, e = 62 - j - k,
# clamped to [-126, 126] (both powers normal float32: e > 126 only when N * m < 2^-64, e < -126 needs N > 2^60);
# m == 0: e = 0. Non-finite m: scale = [0, NaN].
# Computed on the device: the host never reads m (a CUDA graph could not replay a host decision).
@cuda.jit
def encoder_backward_v3_scale(partial, N, scale):
    buf = cuda.shared.array(MAX_THREADS, numba.float32)
    m = numba.float32(0.0)
    for i in range(cuda.threadIdx.x, partial.shape[0], cuda.blockDim.x):
        m = max(m, partial[i])
    m = _block_max(m, buf)
    if cuda.threadIdx.x == 0:
        if not (m <= numba.float32(FLT_MAX)):
            scale[0] = numba.float32(0.0)
            scale[1] = numba.float32(np.nan)
        else:
            e = 0
            if m > numba.float32(0.0):
                mm = numba.float64(m)
                k = 0
                p = 1.0
                while mm >= p:
                    p *= 2.0
                    k += 1
                while mm < p * 0.5:
                    p *= 0.5
                    k -= 1
                j = 0
                while j < 62 and (1 << j) < N:
                    j += 1
                e = min(max(62 - j - k, -126), 126)
            s = 1.0
            for _ in range(abs(e)):
                s *= 2.0
            if e < 0:
                s = 1.0 / s
            scale[0] = numba.float32(s)
            scale[1] = numba.float32(1.0 / s)


# v3_zero: acc (V, C) int64 = 0, grid-stride
@cuda.jit
def encoder_backward_v3_zero(acc):
    V, C = acc.shape
    for i in range(cuda.grid(1), V * C, cuda.gridsize(1)):
        acc[i // C, i % C] = 0


# v3_add: thread i owns dout[b, t, c], i = (b * T + t) * C + c (grid-stride), and adds q = rint(dout * 2^e), an
# int64, into acc[idx[b, t], c]. dout * 2^e is exact (a power of two) and |.| < 2^62 / N; a non-finite dout counts
# as 0 here (no undefined conversion; v3_finish writes NaN then). round(): half to even, like rintf.
@cuda.jit
def encoder_backward_v3_add(dout, idx, scale, acc):
    B, T, C = dout.shape
    s = scale[0]
    for i in range(cuda.grid(1), B * T * C, cuda.gridsize(1)):
        c = i % C
        t = (i // C) % T
        b = i // (T * C)
        g = dout[b, t, c]
        if not (abs(g) <= numba.float32(FLT_MAX)):          # inf or NaN
            g = numba.float32(0.0)
        q = numba.int64(round(g * s))
        cuda.atomic.add(acc, (idx[b, t], c), q)     # integer adds: the total is the same in any order


# v3_finish: thread i owns dwte[v, c], i = v * C + c (grid-stride): dwte = acc * 2^-e (float64, then float32)
@cuda.jit
def encoder_backward_v3_finish(acc, scale, dwte):
    V, C = dwte.shape
    inv = numba.float64(scale[1])
    for i in range(cuda.grid(1), V * C, cuda.gridsize(1)):
        v = i // C
        c = i % C
        dwte[v, c] = numba.float32(numba.float64(acc[v, c]) * inv)


# v3_finish_add: v3_finish adding into dwte (accumulate=True): dwte += acc * 2^-e, the same float32 rounding of the
# sum as writing it and adding it afterwards
@cuda.jit
def encoder_backward_v3_finish_add(acc, scale, dwte):
    V, C = dwte.shape
    inv = numba.float64(scale[1])
    for i in range(cuda.grid(1), V * C, cuda.gridsize(1)):
        v = i // C
        c = i % C
        dwte[v, c] = dwte[v, c] + numba.float32(numba.float64(acc[v, c]) * inv)


KERNELS = {"v1_zero": encoder_backward_v1_zero, "v1": encoder_backward_v1,
           "v2": encoder_backward_v2, "v2_dwpe": encoder_backward_v2_dwpe,
           "v3_amax": encoder_backward_v3_amax, "v3_scale": encoder_backward_v3_scale,
           "v3_zero": encoder_backward_v3_zero, "v3_add": encoder_backward_v3_add,
           "v3_finish": encoder_backward_v3_finish, "v3_finish_add": encoder_backward_v3_finish_add}
SIGNATURES = {
    "v1_zero": "void(float32[:, ::1])",
    "v1": "void(float32[:, :, ::1], int32[:, ::1], float32[:, ::1], float32[:, ::1])",
    "v2": "void(float32[:, :, ::1], int32[::1], int32[::1], float32[:, ::1])",
    "v2_dwpe": "void(float32[:, :, ::1], float32[:, ::1])",
    "v3_amax": "void(float32[:, :, ::1], float32[::1])",
    "v3_scale": "void(float32[::1], int64, float32[::1])",
    "v3_zero": "void(int64[:, ::1])",
    "v3_add": "void(float32[:, :, ::1], int32[:, ::1], float32[::1], int64[:, ::1])",
    "v3_finish": "void(int64[:, ::1], float32[::1], float32[:, ::1])",
    "v3_finish_add": "void(int64[:, ::1], float32[::1], float32[:, ::1])",
}
GPU_ONLY = set()
VERSIONS = ("v1", "v2", "v3")


def _blocks(n, threads):
    return max((n + threads - 1) // threads, 1)


def encoder_backward(dout, idx, dwte, dwpe, version="v2", threads=None, accumulate=False):
    """dwte = 0, dwpe = 0, then dwte[idx[b, t]] += dout[b, t] and dwpe[t] += dout[b, t] for every (b, t).
    accumulate=True: dwte is not zeroed first: the sums are added to what it holds (the tied head's share of the
    embedding's gradient); v1 adds into it, v3 in its last pass (v3_finish_add), v2 into a scratch array then added.

    Arrays: Numba device arrays or CuPy arrays on a GPU; Numba simulator arrays or NumPy arrays in the simulator.
    v1 and v3 do not check that idx is in [0, V) (that would need a copy to the host); v2 does.
    v3 allocates its scratch (acc (V, C) int64, the partial maxima, scale) with device_scratch and never reads
    a device value on the host.
    """
    B, T, C, V, maxT = check_inputs(dout, idx, dwte, dwpe)
    if version not in VERSIONS:
        raise ValueError(f"encoder_backward: version={version!r}, expected one of {', '.join(VERSIONS)}")
    if threads is None:
        threads = 256 if device.numba_on_gpu() else 64
    if not 1 <= threads <= MAX_THREADS:
        raise ValueError(f"encoder_backward: threads={threads}, expected 1..{MAX_THREADS}")
    if not isinstance(accumulate, bool):
        raise TypeError(f"encoder_backward: accumulate must be True or False, got {accumulate!r}")
    if accumulate and version == "v2":  # v2 writes each element once: into scratch, then added
        tmp = device_scratch((V, C), np.float32)
        encoder_backward(dout, idx, tmp, dwpe, version, threads)
        if hasattr(type(dwte), "__iadd__"):  # NumPy (the simulator) or CuPy
            dwte += tmp
        else:  # a Numba device array: the course's vector add kernel
            from gpullm_lessons.kernels.numba.vector_add import vector_add

            vector_add(dwte.reshape(V * C), tmp.reshape(V * C), dwte.reshape(V * C))
        return dwte, dwpe
    if version == "v1":
        if not accumulate:
            encoder_backward_v1_zero[_blocks(V * C, threads), threads, launch_stream()](dwte)
        encoder_backward_v1_zero[_blocks(maxT * C, threads), threads, launch_stream()](dwpe)
        if B * T * C:
            encoder_backward_v1[_blocks(B * T * C, threads), threads, launch_stream()](dout, idx, dwte, dwpe)
    elif version == "v3":
        n = B * T * C
        on_gpu = device.numba_on_gpu()
        red = threads if on_gpu else min(threads, SIM_REDUCE_THREADS)   # any block size works (_block_max)
        n_partial = min(_blocks(n, red), AMAX_BLOCKS if on_gpu else SIM_BLOCKS)
        cap = ADD_BLOCKS if on_gpu else SIM_BLOCKS              # the grid-stride loops cover the rest
        partial = device_scratch(n_partial, np.float32)      # scratch, every element written by v3_amax
        scale = device_scratch(2, np.float32)                # [2^e, 2^-e], written by v3_scale
        acc = device_scratch((V, C), np.int64)               # zeroed by v3_zero
        encoder_backward_v3_amax[n_partial, red, launch_stream()](dout, partial)
        encoder_backward_v3_scale[1, red, launch_stream()](partial, B * T, scale)
        encoder_backward_v3_zero[min(_blocks(V * C, threads), cap), threads, launch_stream()](acc)
        encoder_backward_v3_add[min(_blocks(n, threads), cap), threads, launch_stream()](dout, idx, scale, acc)
        finish = encoder_backward_v3_finish_add if accumulate else encoder_backward_v3_finish
        finish[min(_blocks(V * C, threads), cap), threads, launch_stream()](acc, scale, dwte)
        encoder_backward_v2_dwpe[_blocks(maxT * C, threads), threads, launch_stream()](dout, dwpe)
    else:
        order, starts = token_buckets(arrays.to_numpy(idx), V)
        kind = arrays.backend_of(idx)
        order, starts = arrays.to_backend(order, kind), arrays.to_backend(starts, kind)
        encoder_backward_v2[_blocks(V * C, threads), threads, launch_stream()](dout, order, starts, dwte)
        encoder_backward_v2_dwpe[_blocks(maxT * C, threads), threads, launch_stream()](dout, dwpe)
    return dwte, dwpe
