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
(1024 on NVIDIA) go through v3.
v5 (backward only, HIP only): v4's one-pass plan rebuilt around a register budget. One warp per row, grid-stride over
rows; each lane loads its columns of dout and inp ONCE (float4 when C % 4 == 0 and dout, inp, weight, dinp are
16-byte aligned, else scalar), turns them in place into g = weight * dout and xhat, and writes dinp from registers:
per row it moves exactly 3C floats (dout, inp in; dinp out), the minimum, where v3 reads each row twice. Its
dweight/dbias partials stay in registers over all its rows. The number of float4 (or floats) each lane holds is a
compile-time K per entry point, picked here as the smallest that covers C: C = 768 on 32-lane warps takes K = 6
float4, ~128 registers, 16 warps (16 rows in flight, ~96 KB of loads) per SM, where v4 spent 170 registers on a
fixed 1024-column budget. A block adds its warps' partials in warp order in shared memory (<= 16 KB) and writes one
row of (grid, 2C) scratch; layernorm_backward_v5_reduce sums it per column in a fixed order (deterministic, same
bits every run on a given GPU and launch configuration). The grid is about as many blocks as fit on the GPU at once
(the CUDA/HIP occupancy API, or the register heuristic), tunable with blocks_per_sm= or grid=. Rows wider than
32 * warpSize columns (1024 on NVIDIA, 2048 on AMD CDNA) go through v3.
dweight and dbias are overwritten (not accumulated into) by every version.
Device properties are read once per device and cached (gpullm_lessons.runtime.hip.device_properties):
cudaGetDeviceProperties can cost far more than the kernel (v4 measured 1.47 ms on the H200 before this cache existed,
0.153 ms after it).
All arrays float32, C-contiguous CuPy arrays (GPU memory). cupy is imported lazily.
"""

from __future__ import annotations

import numpy as np

from gpullm_lessons.runtime import hip
from gpullm_lessons.contracts import check_version, is_cupy

# the shape/dtype/threads checks are the Numba wrappers' too (cupy=True: CuPy arrays, cupy in the hints)
from gpullm_lessons.contracts.layernorm import check_array, check_block, check_half_copy, check_residual, check_rows

VERSIONS = ("v1", "v2", "v3", "v4", "v5")
FORWARD_VERSIONS = ("v1", "v2", "v3")  # v4, v5 are backward kernels only
LN_V4_COLS = 32  # v4: columns each lane owns (LN_V4_COLS in layernorm.cu): C <= LN_V4_COLS * warp size
V4_THREADS = 256  # v4's default block: 8 warps (NVIDIA), 4 wavefronts (AMD)
WARP_MAX = 64  # v3 blocks are whole warps on either vendor (32 lanes on NVIDIA, 64 on AMD CDNA)
ROWS_PER_CHUNK = 32  # rows summed by one thread in stage 1 of the dweight/dbias reduction
V5_THREADS = 256  # v5's default block: 8 warps (NVIDIA), 4 wavefronts (AMD)
V5_BLOCKS_PER_SM = None  # v5's default grid: None = as many blocks as fit at once (occupancy API)
V5_F4_K = (1, 2, 3, 4, 6, 8)  # v5 entry points layernorm_backward_v5_w4_k{K}: K float4 per lane per array
V5_F1_K = (1, 4, 8, 16, 32)  # v5 entry points layernorm_backward_v5_w1_k{K}: K floats per lane (scalar path)
V5_REDUCE_THREADS = 512  # v5 stage 2: 32 columns x 16 row groups per block (fixes its summation order)


def _check_on_gpu(fn, named):
    """Every array must live in GPU memory: a CuPy array."""
    for name, x in named:
        if not is_cupy(x):
            raise TypeError(
                f"{fn}: {name} must be a CuPy array (GPU memory), got {type(x).__module__}."
                f"{type(x).__name__}: move it with cupy.asarray(...)"
            )


def _shape(name, N, C):
    """The shape the wrappers' array `name` must have: (N, C) for the row arrays, (N,) for the per-row statistics
    (mean, rstd), (C,) for the per-column ones (weight, bias, dweight, dbias)."""
    if name in ("inp", "out", "dout", "dinp"):
        return (N, C)
    if name in ("mean", "rstd"):
        return (N,)
    return (C,)


def _check_arrays(fn, N, C, **arrays):
    """check_array (cupy=True) on each array, in the order given, with its shape by name (_shape); returns the
    (name, array) pairs for _check_on_gpu."""
    for name, x in arrays.items():
        check_array(fn, name, x, _shape(name, N, C), cupy=True)
    return list(arrays.items())


_FMT = {"bf16": "_bf16", "fp16": "_f16"}  # the engine's half formats -> the entry points' suffixes


def _check_launch(fn, version, threads):
    check_version(fn, version, VERSIONS)
    threads = check_block(fn, version, threads)
    if version in ("v3", "v4", "v5") and threads % WARP_MAX:
        raise ValueError(
            f"{fn}: threads={threads} must be a multiple of {WARP_MAX} for {version} (whole warps on NVIDIA and AMD)"
        )
    return threads


def _check_v5_tunables(fn, version, blocks_per_sm, grid):
    """v5's grid settings: None or a positive int each, not both; only v5 takes them."""
    for name, v in (("blocks_per_sm", blocks_per_sm), ("grid", grid)):
        if v is None:
            continue
        if version != "v5":
            raise ValueError(f"{fn}: {name}= sets v5's grid; version {version!r} does not take it")
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{fn}: {name}={v!r}, expected a positive int (or None: as many blocks as fit)")
    if blocks_per_sm is not None and grid is not None:
        raise ValueError(f"{fn}: give blocks_per_sm= or grid=, not both (grid= is the total number of blocks)")


def v5_entry_point(C: int, warp: int, vector: bool):
    """The v5 kernel for rows of C columns on `warp`-lane warps: the float4 entry point (vector=True: C % 4 == 0 and
    16-byte aligned arrays) or the scalar one with the smallest K that covers C; None when C > 32 * warp (v3 then)."""
    if vector and C % 4 == 0:
        for k in V5_F4_K:
            if C <= 4 * k * warp:
                return f"layernorm_backward_v5_w4_k{k}"
        return None
    for k in V5_F1_K:
        if C <= k * warp:
            return f"layernorm_backward_v5_w1_k{k}"
    return None


def _aligned16(*arrays) -> bool:
    return all(int(a.data.ptr) % 16 == 0 for a in arrays)


def _layernorm_backward_v5(
    dout,
    inp,
    weight,
    mean,
    rstd,
    dinp,
    dweight,
    dbias,
    threads,
    blocks_per_sm,
    grid,
    residual=None,
    dinp_half=None,
    half=None,
):
    """v5's two launches; returns False (nothing launched) when C is too wide for it. residual: the _res entry
    points (the residual's gradient added into dinp in the same pass); dinp_half (with residual): the _res_half
    entry points of format `half`, which also write dinp's half copy."""
    import cupy

    N, C = inp.shape
    props = hip.device_properties(int(dout.device.id))
    ws = int(props["warpSize"])
    extra = () if residual is None else (residual,)
    vector = _aligned16(dout, inp, weight, dinp, *extra) and (dinp_half is None or int(dinp_half.data.ptr) % 8 == 0)
    name = v5_entry_point(C, ws, vector)
    if name is None:
        return False
    outs = (dinp,)
    if dinp_half is not None:  # the _res_half entry points: residual, dinp, dinp_half
        name = name.replace("layernorm_backward_v5_", "layernorm_backward_v5_res_half_") + _FMT[half]
        outs = (dinp, dinp_half)
    elif residual is not None:
        name = name.replace("layernorm_backward_v5_", "layernorm_backward_v5_res_")
    k = hip.kernel("layernorm", name)
    # the big-K entry points are compiled for smaller blocks (__launch_bounds__): lower threads to whole warps below
    threads = max(ws, min(threads, int(getattr(k, "max_threads_per_block", 1024)) // ws * ws))
    warps = threads // ws
    blocks = (N + warps - 1) // warps  # enough blocks to give every warp a row
    if grid is not None:
        blocks = min(blocks, int(grid))
    else:
        blocks_per_sm = V5_BLOCKS_PER_SM if blocks_per_sm is None else blocks_per_sm
        per_sm = int(blocks_per_sm) if blocks_per_sm is not None else hip.blocks_per_sm(k, threads, props)
        blocks = min(blocks, per_sm * hip.sm_count(int(dout.device.id)))
    part = cupy.empty((blocks, 2 * C), dtype=cupy.float32)  # one (dweight | dbias) row per block, all written
    n, c = np.int32(N), np.int32(C)
    k((blocks,), (threads,), (dout, inp, weight, mean, rstd, *extra, *outs, part, n, c))
    hip.kernel("layernorm", "layernorm_backward_v5_reduce")(
        ((2 * C + 31) // 32,), (V5_REDUCE_THREADS,), (part, dweight, dbias, np.int32(blocks), c)
    )
    return True


def layernorm_forward(inp, weight, bias, out, mean, rstd, eps=1e-5, version="v2", threads=128):
    """inp (N, C), weight (C,), bias (C,) -> writes out (N, C), mean (N,), rstd (N,)."""
    fn = "layernorm_forward"
    N, C = check_rows(fn, inp, cupy=True)
    named = _check_arrays(fn, N, C, inp=inp, weight=weight, bias=bias, out=out, mean=mean, rstd=rstd)
    check_version(fn, version, FORWARD_VERSIONS)
    threads = _check_launch(fn, version, threads)
    _check_on_gpu(fn, named)
    blocks = (N + threads - 1) // threads if version == "v1" else N  # v1: a thread per row; v2, v3: a block
    k = hip.kernel("layernorm", f"layernorm_forward_{version}")
    k((blocks,), (threads,), (inp, weight, bias, out, mean, rstd, np.int32(N), np.int32(C), np.float32(eps)))
    return out


def layernorm_backward(
    dout,
    inp,
    weight,
    mean,
    rstd,
    dinp,
    dweight,
    dbias,
    version="v2",
    threads=None,
    rows_per_chunk=ROWS_PER_CHUNK,
    blocks_per_sm=None,
    grid=None,
    residual=None,
    dinp_half=None,
    half=None,
):
    """dout, inp (N, C), weight (C,), mean, rstd (N,) -> writes dinp (N, C), dweight (C,), dbias (C,).

    residual (N, C) float32, another array than dinp: dinp = the layer norm's input gradient + residual (the
    gradient that reaches the input past the sublayer, on the residual stream). v5 adds it in its one pass over the
    row (layernorm_backward_v5_res_*); the other versions in a pass of their own after the kernel.
    dinp_half (N, C) uint16, with residual and half ("bf16" | "fp16"): also the half bits of dinp (each float32 value
    rounded to nearest even), the input of the matrix products below; v5 writes them in the same pass
    (layernorm_backward_v5_res_half_*), the others through the conversion kernel afterwards.

    threads: per block; None: 256 for v4 and v5, 128 otherwise. v4 and v5 lower threads to what their register use
    allows (the kernel's max_threads_per_block: about 384 for v4 on NVIDIA; 512 or 256 for v5's wide entry points).
    v5 only: blocks_per_sm= (blocks per SM, times the SM count) or grid= (total blocks) sets its grid, capped at
    one row per warp; None: as many blocks as fit on the GPU at once. dweight/dbias are bit-identical run after run
    for a given GPU and launch configuration; a different grid sums in a different order (last bits differ)."""
    fn = "layernorm_backward"
    N, C = check_rows(fn, inp, cupy=True)
    named = _check_arrays(
        fn, N, C, dout=dout, inp=inp, weight=weight, mean=mean, rstd=rstd, dinp=dinp, dweight=dweight, dbias=dbias
    )
    if residual is not None:
        check_residual(fn, N, C, residual, dinp, cupy=True)
        named.append(("residual", residual))
    if dinp_half is not None:
        check_half_copy(fn, N, C, dinp_half, half, residual, cupy=True)
        named.append(("dinp_half", dinp_half))
    if threads is None:
        threads = {"v4": V4_THREADS, "v5": V5_THREADS}.get(version, 128)
    threads = _check_launch(fn, version, threads)
    _check_v5_tunables(fn, version, blocks_per_sm, grid)
    if not isinstance(rows_per_chunk, (int, np.integer)) or rows_per_chunk < 1:
        raise ValueError(f"{fn}: rows_per_chunk={rows_per_chunk!r}, expected a positive int")
    _check_on_gpu(fn, named)
    n, c = np.int32(N), np.int32(C)
    col_blocks = (C + threads - 1) // threads
    if version == "v5" and residual is not None and N:
        if _layernorm_backward_v5(
            dout,
            inp,
            weight,
            mean,
            rstd,
            dinp,
            dweight,
            dbias,
            threads,
            blocks_per_sm,
            grid,
            residual,
            dinp_half,
            half,
        ):
            return dinp, dweight, dbias
    if dinp_half is not None:  # the other versions (and v5 on rows too wide for it): then convert.cu's kernel
        layernorm_backward(
            dout,
            inp,
            weight,
            mean,
            rstd,
            dinp,
            dweight,
            dbias,
            version,
            threads,
            rows_per_chunk,
            blocks_per_sm,
            grid,
            residual,
        )
        n = N * C  # convert.cu's float32 -> half bits, grid-stride (no launcher module imports another)
        blocks = min((n + 255) // 256, 65535)
        hip.kernel("convert", "f32_to_bf16_v1" if half == "bf16" else "f32_to_f16_v1")(
            (blocks,), (256,), (dinp.reshape(-1), dinp_half.reshape(-1), np.int64(n))
        )
        return dinp, dweight, dbias
    if residual is not None:  # the other versions (and v5 on rows too wide for it): the kernel, then the add
        layernorm_backward(
            dout, inp, weight, mean, rstd, dinp, dweight, dbias, version, threads, rows_per_chunk, blocks_per_sm, grid
        )
        dinp += residual
        return dinp, dweight, dbias
    if version == "v1":
        hip.kernel("layernorm", "layernorm_backward_v1")(
            ((N + threads - 1) // threads,), (threads,), (dout, inp, weight, mean, rstd, dinp, n, c)
        )
        hip.kernel("layernorm", "layernorm_backward_v1_dparams")(
            (col_blocks,), (threads,), (dout, inp, mean, rstd, dweight, dbias, n, c)
        )
        return dinp, dweight, dbias
    import cupy  # lazily: an optional extra

    if version == "v5":
        if _layernorm_backward_v5(dout, inp, weight, mean, rstd, dinp, dweight, dbias, threads, blocks_per_sm, grid):
            return dinp, dweight, dbias
        version = "v3"  # rows too wide for v5's per-lane registers (C > 32 * warp size): the two-pass v3
    if version == "v4":
        props = hip.device_properties(int(dout.device.id))
        ws = int(props["warpSize"])
        if C <= LN_V4_COLS * ws:
            k = hip.kernel("layernorm", "layernorm_backward_v4")
            # ~170 registers per thread on sm_90: at most max_threads_per_block (about 384) threads per block
            threads = min(threads, int(getattr(k, "max_threads_per_block", 1024)) // ws * ws)
            blocks = min((N + threads // ws - 1) // (threads // ws), hip.resident_blocks(k, threads, props))
            dweight_part = cupy.empty((blocks, C), dtype=cupy.float32)  # one row per block, every element written
            dbias_part = cupy.empty((blocks, C), dtype=cupy.float32)
            k((blocks,), (threads,), (dout, inp, weight, mean, rstd, dinp, dweight_part, dbias_part, n, c))
            # a block per tile of warpSize columns: C / 32 tiles covers either warp size (the kernel grid-strides)
            hip.kernel("layernorm", "layernorm_backward_v4_reduce")(
                ((C + 31) // 32,), (512,), (dweight_part, dbias_part, dweight, dbias, np.int32(blocks), c)
            )
            return dinp, dweight, dbias
        version = "v3"  # rows too wide for v4's per-lane registers: the two-pass v3
    hip.kernel("layernorm", f"layernorm_backward_{version}")(
        (N,), (threads,), (dout, inp, weight, mean, rstd, dinp, n, c)
    )  # one block per row
    rows_per_chunk = max(int(rows_per_chunk), (N + 65534) // 65535)  # gridDim.y is at most 65535
    n_chunks = (N + rows_per_chunk - 1) // rows_per_chunk
    dweight_part = cupy.empty((n_chunks, C), dtype=cupy.float32)  # scratch, every element written
    dbias_part = cupy.empty((n_chunks, C), dtype=cupy.float32)
    hip.kernel("layernorm", "layernorm_backward_v2_partials")(
        (col_blocks, n_chunks),
        (threads,),
        (dout, inp, mean, rstd, dweight_part, dbias_part, n, c, np.int32(rows_per_chunk)),
    )
    hip.kernel("layernorm", "layernorm_backward_v2_reduce")(
        (col_blocks,), (threads,), (dweight_part, dbias_part, dweight, dbias, np.int32(n_chunks), c)
    )
    return dinp, dweight, dbias
