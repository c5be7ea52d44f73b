"""LayerNorm forward and backward through the portable kernels of kernels/hip/layernorm.cu, launched with CuPy.

Same names, signatures and versions as the Numba wrappers (kernels/numba/layernorm.py):
    layernorm_forward(inp (N,C), weight (C,), bias (C,), out (N,C), mean (N,), rstd (N,), eps=1e-5, version=...)
    layernorm_backward(dout (N,C), inp (N,C), weight (C,), mean (N,), rstd (N,), dinp (N,C), dweight (C,),
                       dbias (C,), version=...)
v1: one thread per row (dinp), one per column (dweight, dbias). v2: one block per row, shared-memory tree sums;
dweight/dbias by a two-stage deterministic column reduction through scratch allocated here. v3: v2 with
warp-shuffle sums. v4 (backward only, HIP only): one pass, one warp per row over a grid of about as many blocks as
fit on the GPU at once; each block writes dinp for its rows and one row of dweight/dbias partials, and a small
second kernel adds those rows per column in a fixed order (deterministic); rows wider than 32 * warpSize columns
(1024 on NVIDIA) go through v3. All arrays float32, C-contiguous CuPy arrays (GPU memory). cupy is imported lazily.
"""
from __future__ import annotations

import numpy as np

from .. import hip
# the shape/dtype/threads checks are the Numba wrappers' (cupy=True: CuPy arrays, cupy in the hints)
from ..kernels.numba.layernorm import check_array, check_block, check_rows
from ._args import check_version, is_cupy

VERSIONS = ("v1", "v2", "v3", "v4")
FORWARD_VERSIONS = ("v1", "v2", "v3")   # v4 is a backward kernel only
LN_V4_COLS = 32        # v4: columns each lane owns (LN_V4_COLS in layernorm.cu): C <= LN_V4_COLS * warp size
V4_THREADS = 256       # v4's default block: 8 warps (NVIDIA), 4 wavefronts (AMD)
WARP_MAX = 64          # v3 blocks are whole warps on either vendor (32 lanes on NVIDIA, 64 on AMD CDNA)
ROWS_PER_CHUNK = 32    # rows summed by one thread in stage 1 of the dweight/dbias reduction


def _check_on_gpu(fn, named):
    """Every array must live in GPU memory: a CuPy array."""
    for name, x in named:
        if not is_cupy(x):
            raise TypeError(f"{fn}: {name} must be a CuPy array (GPU memory), got {type(x).__module__}."
                            f"{type(x).__name__}: move it with cupy.asarray(...)")


def _check_launch(fn, version, threads):
    check_version(fn, version, VERSIONS)
    threads = check_block(fn, version, threads)
    if version in ("v3", "v4") and threads % WARP_MAX:
        raise ValueError(f"{fn}: threads={threads} must be a multiple of {WARP_MAX} for {version} (whole warps on "
                         f"NVIDIA and AMD)")
    return threads


def _device_props(x):
    import cupy
    return cupy.cuda.runtime.getDeviceProperties(x.device.id)


def _resident_blocks(kernel, threads, props):
    """About how many blocks of `threads` fit on the GPU at once (v4's grid), from the kernel's register count.
    A heuristic: too many blocks only adds partial rows to reduce, too few leaves SMs idle."""
    sms = int(props.get("multiProcessorCount", 0)) or 108
    per_sm = 2
    try:
        regs = int(kernel.num_regs)
        ws = int(props["warpSize"])
        warp_regs = -(-regs * ws // 256) * 256                      # registers are given out per warp, in 256s
        per_sm = min(int(props["regsPerMultiprocessor"]) // (warp_regs * (threads // ws)),
                     int(props["maxThreadsPerMultiProcessor"]) // threads)
    except Exception:  # noqa: BLE001 - an attribute this CuPy/driver does not report: keep the guess
        pass
    return sms * max(1, per_sm)


def layernorm_forward(inp, weight, bias, out, mean, rstd, eps=1e-5, version="v2", threads=128):
    """inp (N, C), weight (C,), bias (C,) -> writes out (N, C), mean (N,), rstd (N,)."""
    fn = "layernorm_forward"
    N, C = check_rows(fn, inp, cupy=True)
    named = (("inp", inp, (N, C)), ("weight", weight, (C,)), ("bias", bias, (C,)),
             ("out", out, (N, C)), ("mean", mean, (N,)), ("rstd", rstd, (N,)))
    for name, x, shape in named:
        check_array(fn, name, x, shape, cupy=True)
    check_version(fn, version, FORWARD_VERSIONS)
    threads = _check_launch(fn, version, threads)
    _check_on_gpu(fn, [(name, x) for name, x, _ in named])
    blocks = (N + threads - 1) // threads if version == "v1" else N   # v1: a thread per row; v2, v3: a block
    k = hip.kernel("layernorm", f"layernorm_forward_{version}")
    k((blocks,), (threads,), (inp, weight, bias, out, mean, rstd, np.int32(N), np.int32(C), np.float32(eps)))
    return out


def layernorm_backward(dout, inp, weight, mean, rstd, dinp, dweight, dbias, version="v2", threads=None,
                       rows_per_chunk=ROWS_PER_CHUNK):
    """dout, inp (N, C), weight (C,), mean, rstd (N,) -> writes dinp (N, C), dweight (C,), dbias (C,).

    threads: per block; None: 256 for v4, 128 otherwise. v4 lowers threads to what its register use allows
    (its kernel's max_threads_per_block: about 384 on NVIDIA)."""
    fn = "layernorm_backward"
    N, C = check_rows(fn, inp, cupy=True)
    named = (("dout", dout, (N, C)), ("inp", inp, (N, C)), ("weight", weight, (C,)), ("mean", mean, (N,)),
             ("rstd", rstd, (N,)), ("dinp", dinp, (N, C)), ("dweight", dweight, (C,)), ("dbias", dbias, (C,)))
    for name, x, shape in named:
        check_array(fn, name, x, shape, cupy=True)
    if threads is None:
        threads = V4_THREADS if version == "v4" else 128
    threads = _check_launch(fn, version, threads)
    if not isinstance(rows_per_chunk, (int, np.integer)) or rows_per_chunk < 1:
        raise ValueError(f"{fn}: rows_per_chunk={rows_per_chunk!r}, expected a positive int")
    _check_on_gpu(fn, [(name, x) for name, x, _ in named])
    n, c = np.int32(N), np.int32(C)
    col_blocks = (C + threads - 1) // threads
    if version == "v1":
        hip.kernel("layernorm", "layernorm_backward_v1")(
            ((N + threads - 1) // threads,), (threads,), (dout, inp, weight, mean, rstd, dinp, n, c))
        hip.kernel("layernorm", "layernorm_backward_v1_dparams")(
            (col_blocks,), (threads,), (dout, inp, mean, rstd, dweight, dbias, n, c))
        return dinp, dweight, dbias
    import cupy  # lazily: an optional extra
    if version == "v4":
        props = _device_props(dout)
        ws = int(props["warpSize"])
        if C <= LN_V4_COLS * ws:
            k = hip.kernel("layernorm", "layernorm_backward_v4")
            # ~170 registers per thread on sm_90: at most max_threads_per_block (about 384) threads per block
            threads = min(threads, int(getattr(k, "max_threads_per_block", 1024)) // ws * ws)
            blocks = min((N + threads // ws - 1) // (threads // ws), _resident_blocks(k, threads, props))
            dweight_part = cupy.empty((blocks, C), dtype=cupy.float32)   # one row per block, every element written
            dbias_part = cupy.empty((blocks, C), dtype=cupy.float32)
            k((blocks,), (threads,), (dout, inp, weight, mean, rstd, dinp, dweight_part, dbias_part, n, c))
            # a block per tile of warpSize columns: C / 32 tiles covers either warp size (the kernel grid-strides)
            hip.kernel("layernorm", "layernorm_backward_v4_reduce")(
                ((C + 31) // 32,), (512,), (dweight_part, dbias_part, dweight, dbias, np.int32(blocks), c))
            return dinp, dweight, dbias
        version = "v3"   # rows too wide for v4's per-lane registers: the two-pass v3
    hip.kernel("layernorm", f"layernorm_backward_{version}")(
        (N,), (threads,), (dout, inp, weight, mean, rstd, dinp, n, c))              # one block per row
    rows_per_chunk = max(int(rows_per_chunk), (N + 65534) // 65535)                # gridDim.y is at most 65535
    n_chunks = (N + rows_per_chunk - 1) // rows_per_chunk
    dweight_part = cupy.empty((n_chunks, C), dtype=cupy.float32)                    # scratch, every element written
    dbias_part = cupy.empty((n_chunks, C), dtype=cupy.float32)
    hip.kernel("layernorm", "layernorm_backward_v2_partials")(
        (col_blocks, n_chunks), (threads,),
        (dout, inp, mean, rstd, dweight_part, dbias_part, n, c, np.int32(rows_per_chunk)))
    hip.kernel("layernorm", "layernorm_backward_v2_reduce")(
        (col_blocks,), (threads,), (dweight_part, dbias_part, dweight, dbias, np.int32(n_chunks), c))
    return dinp, dweight, dbias
