"""layernorm: LayerNorm forward and backward as Numba CUDA kernels (rows flattened: N = B*T rows of C channels).

Per row: xhat = (inp - mean) * rstd, out = xhat * weight + bias; backward with g = dout * weight:
    dinp    = rstd * (g - mean(g) - xhat * mean(g * xhat))     (means over the C channels of the row)
    dweight = sum over rows of dout * xhat,  dbias = sum over rows of dout      (C,)

Versions (the wrapper's version= picks one; KERNELS holds every kernel, helper kernels keyed "<version>_<part>"):
  v1_forward    one thread per row: it loops over the row's C channels three times (mean, variance, write).
  v1            backward dinp, one thread per row (two loops over C: the two sums, then the write).
  v1_dparams    backward dweight/dbias, one thread per column looping over all N rows (naive, deterministic).
  v2_forward    one block per row: the threads split the C channels, sums by a shared-memory tree reduction.
  v2            backward dinp, one block per row: mean(g) and mean(g * xhat) by shared-memory tree reductions.
  v2_partials   dweight/dbias stage 1: a 2-D grid (column blocks x row chunks); each thread sums its column over
                one chunk of rows and writes the partial sums to scratch (n_chunks, C).
  v2_reduce     dweight/dbias stage 2: one thread per column adds up the n_chunks partials.
  v3_forward    GPU-only: v2_forward with warp-shuffle reductions (cuda.shfl_xor_sync), one shared slot per warp.
  v3            GPU-only: v2 (dinp) with warp-shuffle reductions; dweight/dbias reuse v2_partials + v2_reduce.
v3 uses warp shuffles. Numba's own simulator has none; gpullm_lessons.runtime.simwarp adds them when the simulator is on, so
the v3 kernels run there when launched directly, but the launch wrappers keep v3 for an NVIDIA GPU (where it is
fast; in the simulator a block per row with shuffles is the slowest case). It is compiled to PTX on CI.

Atomics vs determinism: dweight could be written with one atomicAdd per (row, column) into a zeroed dweight, in a
single kernel. That is shorter, but float addition is not associative and the order in which the atomics land
changes from run to run, so the result changes in its last bits between identical runs (and training runs stop
being reproducible). The two-stage reduction fixes the order: chunk sums in row order, then chunks in order.
"""
import math

import numpy as np
from numba import cuda, float32

from gpullm_lessons.contracts import check_version
from gpullm_lessons.contracts.layernorm import (check_array, check_block, check_half_copy,  # shared with the HIP
                                                 check_residual, check_rows)                  # launchers
from gpullm_lessons.kernels.numba import launch_stream, device_scratch

MAX_THREADS = 1024              # largest block: the shared-memory tree buffer has one slot per thread
WARP = 32                       # NVIDIA warp size (Numba CUDA targets NVIDIA only)
MAX_WARPS = MAX_THREADS // WARP  # one shared slot per warp in the warp-shuffle reductions
FULL_MASK = 0xFFFFFFFF          # every lane of the warp takes part in the shuffle
ROWS_PER_CHUNK = 32             # rows summed by one thread in stage 1 of the dweight/dbias reduction


# ---- forward ----------------------------------------------------------------------------------------------------
# v1_forward: one thread per row
@cuda.jit
def layernorm_forward_v1(inp, weight, bias, out, mean, rstd, eps):
    # inp, out (N, C); weight, bias (C,); mean, rstd (N,); eps float32
    N, C = inp.shape
    row = cuda.grid(1)
    if row < N:
        s = float32(0.0)
        for i in range(C):
            s += inp[row, i]
        m = s / float32(C)
        v = float32(0.0)
        for i in range(C):              # variance from a second pass: more accurate than E[x^2] - m^2
            d = inp[row, i] - m
            v += d * d
        r = float32(1.0) / math.sqrt(v / float32(C) + eps)
        for i in range(C):
            out[row, i] = (inp[row, i] - m) * r * weight[i] + bias[i]
        mean[row] = m
        rstd[row] = r


# v2_forward: one block per row, the block's threads stride over the C channels; tree sums in shared memory
# (blockDim.x a power of two: each step the lower half adds the upper half, log2(blockDim.x) steps)
@cuda.jit
def layernorm_forward_v2(inp, weight, bias, out, mean, rstd, eps):
    buf = cuda.shared.array(MAX_THREADS, float32)           # one partial sum per thread
    N, C = inp.shape
    t = cuda.threadIdx.x
    for row in range(cuda.blockIdx.x, N, cuda.gridDim.x):   # the whole block moves to the next row together
        s = float32(0.0)
        for i in range(t, C, cuda.blockDim.x):              # thread t: channels t, t + blockDim.x, ...
            s += inp[row, i]
        buf[t] = s
        cuda.syncthreads()
        stride = cuda.blockDim.x // 2
        while stride > 0:
            if t < stride:
                buf[t] += buf[t + stride]
            cuda.syncthreads()
            stride //= 2
        m = buf[0] / float32(C)
        cuda.syncthreads()                                  # all have read buf[0] before buf is reused
        v = float32(0.0)
        for i in range(t, C, cuda.blockDim.x):
            d = inp[row, i] - m
            v += d * d
        buf[t] = v
        cuda.syncthreads()
        stride = cuda.blockDim.x // 2
        while stride > 0:
            if t < stride:
                buf[t] += buf[t + stride]
            cuda.syncthreads()
            stride //= 2
        r = float32(1.0) / math.sqrt(buf[0] / float32(C) + eps)
        cuda.syncthreads()
        for i in range(t, C, cuda.blockDim.x):
            out[row, i] = (inp[row, i] - m) * r * weight[i] + bias[i]
        if t == 0:
            mean[row] = m
            rstd[row] = r


# v3_forward (GPU-only): v2_forward with warp-shuffle sums. Each warp adds its 32 values with 5 xor-shuffles
# (a butterfly: afterwards every lane holds the warp's total), lane 0 stores it in buf[warp], then every warp
# adds the per-warp totals the same way, so each thread ends with the block's total. blockDim.x: whole warps.
@cuda.jit
def layernorm_forward_v3(inp, weight, bias, out, mean, rstd, eps):
    buf = cuda.shared.array(MAX_WARPS, float32)             # one partial sum per warp
    N, C = inp.shape
    t = cuda.threadIdx.x
    lane = t % WARP
    warp = t // WARP
    n_warps = cuda.blockDim.x // WARP
    for row in range(cuda.blockIdx.x, N, cuda.gridDim.x):
        s = float32(0.0)
        for i in range(t, C, cuda.blockDim.x):
            s += inp[row, i]
        for k in range(2):                                  # k = 0: within the warp; k = 1: across warps
            offset = WARP // 2
            while offset > 0:
                s += cuda.shfl_xor_sync(FULL_MASK, s, offset)
                offset //= 2
            if k == 0:
                if lane == 0:
                    buf[warp] = s
                cuda.syncthreads()
                s = buf[lane] if lane < n_warps else float32(0.0)
        m = s / float32(C)
        cuda.syncthreads()                                  # all have read buf before it is reused
        v = float32(0.0)
        for i in range(t, C, cuda.blockDim.x):
            d = inp[row, i] - m
            v += d * d
        for k in range(2):
            offset = WARP // 2
            while offset > 0:
                v += cuda.shfl_xor_sync(FULL_MASK, v, offset)
                offset //= 2
            if k == 0:
                if lane == 0:
                    buf[warp] = v
                cuda.syncthreads()
                v = buf[lane] if lane < n_warps else float32(0.0)
        r = float32(1.0) / math.sqrt(v / float32(C) + eps)
        cuda.syncthreads()
        for i in range(t, C, cuda.blockDim.x):
            out[row, i] = (inp[row, i] - m) * r * weight[i] + bias[i]
        if t == 0:
            mean[row] = m
            rstd[row] = r


# ---- backward: dinp ---------------------------------------------------------------------------------------------
# v1: one thread per row
@cuda.jit
def layernorm_backward_v1(dout, inp, weight, mean, rstd, dinp):
    # dout, inp, dinp (N, C); weight (C,); mean, rstd (N,)
    N, C = inp.shape
    row = cuda.grid(1)
    if row < N:
        m = mean[row]
        r = rstd[row]
        sg = float32(0.0)
        sgx = float32(0.0)
        for i in range(C):
            g = dout[row, i] * weight[i]         # dL/dxhat
            sg += g
            sgx += g * (inp[row, i] - m) * r
        mg = sg / float32(C)                     # mean(g)
        mgx = sgx / float32(C)                   # mean(g * xhat)
        for i in range(C):
            xhat = (inp[row, i] - m) * r
            dinp[row, i] = r * (dout[row, i] * weight[i] - mg - xhat * mgx)


# v2: one block per row; the two row sums by shared-memory tree reductions (reduced side by side)
@cuda.jit
def layernorm_backward_v2(dout, inp, weight, mean, rstd, dinp):
    buf_g = cuda.shared.array(MAX_THREADS, float32)         # partial sums of g, one per thread
    buf_gx = cuda.shared.array(MAX_THREADS, float32)        # partial sums of g * xhat
    N, C = inp.shape
    t = cuda.threadIdx.x
    for row in range(cuda.blockIdx.x, N, cuda.gridDim.x):   # the whole block moves to the next row together
        m = mean[row]
        r = rstd[row]
        sg = float32(0.0)
        sgx = float32(0.0)
        for i in range(t, C, cuda.blockDim.x):              # thread t: channels t, t + blockDim.x, ...
            g = dout[row, i] * weight[i]
            sg += g
            sgx += g * (inp[row, i] - m) * r
        buf_g[t] = sg
        buf_gx[t] = sgx
        cuda.syncthreads()
        stride = cuda.blockDim.x // 2                       # blockDim.x a power of two
        while stride > 0:
            if t < stride:
                buf_g[t] += buf_g[t + stride]
                buf_gx[t] += buf_gx[t + stride]
            cuda.syncthreads()
            stride //= 2
        mg = buf_g[0] / float32(C)                          # mean(g)
        mgx = buf_gx[0] / float32(C)                        # mean(g * xhat)
        cuda.syncthreads()                                  # all have read the totals before the next row
        for i in range(t, C, cuda.blockDim.x):
            xhat = (inp[row, i] - m) * r
            dinp[row, i] = r * (dout[row, i] * weight[i] - mg - xhat * mgx)


# v3 (GPU-only): v2 with warp-shuffle sums (as in v3_forward), both sums shuffled side by side
@cuda.jit
def layernorm_backward_v3(dout, inp, weight, mean, rstd, dinp):
    buf_g = cuda.shared.array(MAX_WARPS, float32)           # one partial sum per warp
    buf_gx = cuda.shared.array(MAX_WARPS, float32)
    N, C = inp.shape
    t = cuda.threadIdx.x
    lane = t % WARP
    warp = t // WARP
    n_warps = cuda.blockDim.x // WARP
    for row in range(cuda.blockIdx.x, N, cuda.gridDim.x):
        m = mean[row]
        r = rstd[row]
        sg = float32(0.0)
        sgx = float32(0.0)
        for i in range(t, C, cuda.blockDim.x):
            g = dout[row, i] * weight[i]
            sg += g
            sgx += g * (inp[row, i] - m) * r
        for k in range(2):                                  # k = 0: within the warp; k = 1: across warps
            offset = WARP // 2
            while offset > 0:
                sg += cuda.shfl_xor_sync(FULL_MASK, sg, offset)
                sgx += cuda.shfl_xor_sync(FULL_MASK, sgx, offset)
                offset //= 2
            if k == 0:
                if lane == 0:
                    buf_g[warp] = sg
                    buf_gx[warp] = sgx
                cuda.syncthreads()
                sg = buf_g[lane] if lane < n_warps else float32(0.0)
                sgx = buf_gx[lane] if lane < n_warps else float32(0.0)
        mg = sg / float32(C)
        mgx = sgx / float32(C)
        cuda.syncthreads()                                  # all have read buf before the next row
        for i in range(t, C, cuda.blockDim.x):
            xhat = (inp[row, i] - m) * r
            dinp[row, i] = r * (dout[row, i] * weight[i] - mg - xhat * mgx)


# ---- backward: dweight, dbias (sums over rows, one value per column) -----------------------------------------------
# v1_dparams: one thread per column, looping over all N rows (neighbouring threads read neighbouring columns)
@cuda.jit
def layernorm_backward_v1_dparams(dout, inp, mean, rstd, dweight, dbias):
    # dout, inp (N, C); mean, rstd (N,); dweight, dbias (C,)
    N, C = inp.shape
    c = cuda.grid(1)
    if c < C:
        dw = float32(0.0)
        db = float32(0.0)
        for row in range(N):
            d = dout[row, c]
            dw += d * (inp[row, c] - mean[row]) * rstd[row]
            db += d
        dweight[c] = dw
        dbias[c] = db


# v2_partials (stage 1): block (blockIdx.x, blockIdx.y) owns columns blockIdx.x*blockDim.x + threadIdx.x and
# the chunk of rows blockIdx.y*rows_per_chunk ...; each thread writes its column's sums over that chunk
@cuda.jit
def layernorm_backward_v2_partials(dout, inp, mean, rstd, dweight_part, dbias_part, rows_per_chunk):
    # dout, inp (N, C); mean, rstd (N,); dweight_part, dbias_part (n_chunks, C) scratch; rows_per_chunk int
    N, C = inp.shape
    c = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    chunk = cuda.blockIdx.y
    if c < C:
        dw = float32(0.0)
        db = float32(0.0)
        for row in range(chunk * rows_per_chunk, min(N, (chunk + 1) * rows_per_chunk)):
            d = dout[row, c]
            dw += d * (inp[row, c] - mean[row]) * rstd[row]
            db += d
        dweight_part[chunk, c] = dw
        dbias_part[chunk, c] = db


# v2_reduce (stage 2): one thread per column adds the n_chunks partial sums, in chunk order
@cuda.jit
def layernorm_backward_v2_reduce(dweight_part, dbias_part, dweight, dbias):
    # dweight_part, dbias_part (n_chunks, C); dweight, dbias (C,)
    n_chunks, C = dweight_part.shape
    c = cuda.grid(1)
    if c < C:
        dw = float32(0.0)
        db = float32(0.0)
        for k in range(n_chunks):
            dw += dweight_part[k, c]
            db += dbias_part[k, c]
        dweight[c] = dw
        dbias[c] = db


KERNELS = {
    "v1_forward": layernorm_forward_v1, "v2_forward": layernorm_forward_v2, "v3_forward": layernorm_forward_v3,
    "v1": layernorm_backward_v1, "v1_dparams": layernorm_backward_v1_dparams,
    "v2": layernorm_backward_v2, "v2_partials": layernorm_backward_v2_partials,
    "v2_reduce": layernorm_backward_v2_reduce,
    "v3": layernorm_backward_v3,
}
_M, _V = "float32[:, ::1]", "float32[::1]"   # (N, C) and (N,) / (C,) arrays, C-contiguous
_FWD = f"void({_M}, {_V}, {_V}, {_M}, {_V}, {_V}, float32)"
_BWD = f"void({_M}, {_M}, {_V}, {_V}, {_V}, {_M})"
# Argument types for compiling without a GPU (tests compile every entry to PTX for sm_90).
SIGNATURES = {
    "v1_forward": _FWD, "v2_forward": _FWD, "v3_forward": _FWD,
    "v1": _BWD, "v2": _BWD, "v3": _BWD,
    "v1_dparams": f"void({_M}, {_M}, {_V}, {_V}, {_V}, {_V})",
    "v2_partials": f"void({_M}, {_M}, {_V}, {_V}, {_M}, {_M}, int64)",
    "v2_reduce": f"void({_M}, {_M}, {_V}, {_V})",
}
VERSIONS = ("v1", "v2", "v3")  # what the wrappers' version= accepts
GPU_ONLY = {"v3"}             # warp shuffles: the wrappers run every "v3*" kernel on a GPU only (simwarp can run them)


# ---- launch wrappers ----------------------------------------------------------------------------------------------
def _simulating() -> bool:
    from numba import config
    return bool(config.ENABLE_CUDASIM)


def _check_launch(fn, version, threads):
    check_version(fn, version, VERSIONS)
    if version in GPU_ONLY and _simulating():
        from gpullm_lessons.device import NoGPUError
        raise NoGPUError(f"{fn}: version {version!r} uses warp shuffles (cuda.shfl_xor_sync), and this wrapper keeps "
                         f"it for an NVIDIA GPU (in the simulator, where gpullm_lessons.runtime.simwarp provides the shuffles, "
                         f"launch the kernel directly); pick v1 / v2 here")
    threads = check_block(fn, version, threads)
    if version == "v3" and threads % WARP:
        raise ValueError(f"{fn}: threads={threads} must be a multiple of {WARP} for v3 (whole warps)")
    return threads


def layernorm_forward(inp, weight, bias, out, mean, rstd, eps=1e-5, version="v2", threads=128):
    """inp (N, C), weight (C,), bias (C,) -> writes out (N, C), mean (N,), rstd (N,). float32 arrays."""
    fn = "layernorm_forward"
    N, C = check_rows(fn, inp)
    for name, x, shape in (("inp", inp, (N, C)), ("weight", weight, (C,)), ("bias", bias, (C,)),
                           ("out", out, (N, C)), ("mean", mean, (N,)), ("rstd", rstd, (N,))):
        check_array(fn, name, x, shape)
    threads = _check_launch(fn, version, threads)
    blocks = (N + threads - 1) // threads if version == "v1" else N   # v1: a thread per row; v2, v3: a block
    KERNELS[f"{version}_forward"][blocks, threads, launch_stream()](inp, weight, bias, out, mean, rstd, np.float32(eps))
    return out


def layernorm_backward(dout, inp, weight, mean, rstd, dinp, dweight, dbias, version="v2", threads=128,
                       rows_per_chunk=ROWS_PER_CHUNK, residual=None, dinp_half=None, half=None):
    """dout, inp (N, C), weight (C,), mean, rstd (N,) -> writes dinp (N, C), dweight (C,), dbias (C,). float32.

    v1: dinp one thread per row, dweight/dbias one thread per column. v2/v3: dinp one block per row, dweight/dbias
    by the two-stage reduction over chunks of rows_per_chunk rows (scratch allocated here, (n_chunks, C) x 2).
    residual (N, C), another array than dinp: dinp = the input gradient + residual, added after the kernels (the HIP
    launcher's v5 adds it in its own pass over the row). dinp_half (N, C) uint16, with residual and half ("bf16" |
    "fp16"): also dinp's half bits, through the conversion kernels (the HIP v5 writes them in its pass).
    """
    fn = "layernorm_backward"
    N, C = check_rows(fn, inp)
    for name, x, shape in (("dout", dout, (N, C)), ("inp", inp, (N, C)), ("weight", weight, (C,)),
                           ("mean", mean, (N,)), ("rstd", rstd, (N,)), ("dinp", dinp, (N, C)),
                           ("dweight", dweight, (C,)), ("dbias", dbias, (C,))):
        check_array(fn, name, x, shape)
    if dinp_half is not None:
        check_half_copy(fn, N, C, dinp_half, half, residual)
        from gpullm_lessons.kernels.numba.convert import f32_to_bf16, f32_to_f16

        layernorm_backward(dout, inp, weight, mean, rstd, dinp, dweight, dbias, version, threads, rows_per_chunk,
                           residual)
        (f32_to_bf16 if half == "bf16" else f32_to_f16)(dinp.reshape(N * C), dinp_half.reshape(N * C))
        return dinp, dweight, dbias
    if residual is not None:
        check_residual(fn, N, C, residual, dinp)
        layernorm_backward(dout, inp, weight, mean, rstd, dinp, dweight, dbias, version, threads, rows_per_chunk)
        if hasattr(type(dinp), "__iadd__"):  # NumPy (the simulator) or CuPy
            dinp += residual
        else:  # a Numba device array (no arithmetic of its own): the course's vector add kernel
            from gpullm_lessons.kernels.numba.vector_add import vector_add

            flat = dinp.reshape(N * C)
            vector_add(flat, residual.reshape(N * C), flat)
        return dinp, dweight, dbias
    threads = _check_launch(fn, version, threads)
    if not isinstance(rows_per_chunk, (int, np.integer)) or rows_per_chunk < 1:
        raise ValueError(f"{fn}: rows_per_chunk={rows_per_chunk!r}, expected a positive int")
    col_blocks = (C + threads - 1) // threads
    if version == "v1":
        KERNELS["v1"][(N + threads - 1) // threads, threads, launch_stream()](dout, inp, weight, mean, rstd, dinp)
        KERNELS["v1_dparams"][col_blocks, threads, launch_stream()](dout, inp, mean, rstd, dweight, dbias)
        return dinp, dweight, dbias
    KERNELS[version][N, threads, launch_stream()](dout, inp, weight, mean, rstd, dinp)             # one block per row
    rows_per_chunk = max(int(rows_per_chunk), (N + 65534) // 65535)                # gridDim.y is at most 65535
    n_chunks = (N + rows_per_chunk - 1) // rows_per_chunk
    dweight_part = device_scratch((n_chunks, C), np.float32)                   # scratch, every element written
    dbias_part = device_scratch((n_chunks, C), np.float32)
    KERNELS["v2_partials"][(col_blocks, n_chunks), threads, launch_stream()](dout, inp, mean, rstd, dweight_part, dbias_part,
                                                            np.int64(rows_per_chunk))
    KERNELS["v2_reduce"][col_blocks, threads, launch_stream()](dweight_part, dbias_part, dweight, dbias)
    return dinp, dweight, dbias
