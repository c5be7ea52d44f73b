"""softmax_backward through the portable kernels of kernels/hip/softmax.cu, launched with CuPy (NVIDIA or AMD).

Same name, signature and versions as kernels/numba/softmax.py (v1 one thread per row, v2 one block per row with a
shared-memory tree, v3 one block per row with warp shuffles, v4 one warp per row). HIP only:
v5: v4 with float4 loads and the row held in registers between the two passes (n % 4 == 0 and 16-byte aligned
arrays; otherwise v4's scalar loop inside the same kernel).
v6: G threads (whole warps) per row and R = threads / G rows per block; each thread keeps K float4 of out and dout
in registers (K in 1, 2, 4, 8: the smallest with n <= 4 K G), so the row is read from memory exactly once (v5
re-reads the tail of rows longer than 1024 floats) and written once: 3 n floats per row, the minimum. At n = 1024
the default G = 64 (2 warps per row on NVIDIA) needs K = 4: ~64 registers per thread instead of v5's ~100, so 32
warps per SM instead of 16, about the same bytes in flight but half of them issued by warps that are not waiting
on a barrier or a store; one barrier per row tile (double-buffered shared slots). The blocks loop over row tiles,
so the default grid is exactly what fits on the GPU at once (no block launch churn, no tail wave); blocks_per_sm=0
gives one row tile per block instead. Tunables: threads, rows_per_block, blocks_per_sm.
v7: one warp per row, grid-stride, and the warp's NEXT row loaded into a second set of registers before this row's
reduction and stores: two rows in flight per warp, no shared memory and no barrier. n <= 32 * warp size (1024 on
NVIDIA: ~166 registers per lane, so at most 256 threads per block). Tunables: threads, blocks_per_sm.
v6 and v7 need n % 4 == 0 and 16-byte aligned arrays and rows that fit their registers; otherwise (and only for the
default settings, see softmax_backward) they run v5, which handles any shape. Arrays are CuPy arrays.
"""

from __future__ import annotations

import numpy as np

from gpullm_lessons.runtime import hip
from gpullm_lessons.contracts import check_cupy_args

VERSIONS = ("v1", "v2", "v3", "v4", "v5", "v6", "v7")
DEFAULT_THREADS = {"v1": 128, "v2": 256, "v3": 256, "v4": 256, "v5": 256, "v6": 256, "v7": 128}
# v6 / v7 entry points softmax_backward_v6_k{K} / _v7_k{K}: K float4 per thread and array, with the largest block
# each is compiled for (__launch_bounds__ in softmax.cu)
V6_MAX_THREADS = {1: 1024, 2: 1024, 4: 1024, 8: 512}
V7_MAX_THREADS = {1: 1024, 2: 1024, 4: 512, 8: 256}
V6_FLOATS_PER_THREAD = 16  # the default v6 plan: threads per row so that each holds <= 16 floats (K <= 4)
DEFAULT_BLOCKS_PER_SM = {"v6": None, "v7": None}  # None: as many blocks as fit at once; 0: a block per row tile


def _k_for(n: int, group: int, ks=(1, 2, 4, 8)):
    """The smallest K with n <= 4 K group (float4 per thread for a row of n floats over `group` threads), or None."""
    for k in ks:
        if n <= 4 * k * group:
            return k
    return None


def v6_plan(fn, n: int, ws: int, threads=None, rows_per_block=None):
    """(K, threads, rows_per_block) for v6 on rows of n floats and ws-lane warps, or None when the default settings
    cannot hold the row (the launcher then runs v5). ValueError for explicit settings that cannot work.

    Default: G = the fewest whole warps that keep each thread at <= V6_FLOATS_PER_THREAD (16) floats per array
    (G = 64 for n = 1024), and rows_per_block = DEFAULT_THREADS["v6"] (256) // G (threads = 256 at n = 1024).
    threads= alone: rows_per_block = threads // default G. rows_per_block= alone: threads = rows_per_block x G."""
    explicit = threads is not None or rows_per_block is not None
    g_default = ws * max(1, -(-n // (V6_FLOATS_PER_THREAD * ws)))
    if rows_per_block is not None and (not isinstance(rows_per_block, (int, np.integer)) or rows_per_block < 1):
        raise ValueError(f"{fn}: rows_per_block={rows_per_block!r}, expected a positive int")
    if threads is None:
        r = int(rows_per_block) if rows_per_block is not None else max(1, DEFAULT_THREADS["v6"] // g_default)
        threads = r * g_default
    else:
        threads = int(threads)
        r = int(rows_per_block) if rows_per_block is not None else max(1, threads // g_default)
    if not explicit and threads > 1024:
        return None
    if not 1 <= threads <= 1024:
        raise ValueError(
            f"{fn}: threads={threads} must be in [1, 1024] (v6: threads = rows_per_block x threads per row)"
        )
    if threads % r or (threads // r) % ws:
        raise ValueError(
            f"{fn}: v6 gives each row threads / rows_per_block = {threads}/{r} threads, which must be "
            f"whole warps (a multiple of {ws})"
        )
    g = threads // r
    k = _k_for(n, g)
    if k is None:
        if not explicit:
            return None
        raise ValueError(
            f"{fn}: v6 holds at most 32 floats per thread: a row of n={n} needs at least "
            f"{-(-n // 32)} threads per row, got {g} (threads={threads}, rows_per_block={r})"
        )
    if threads > V6_MAX_THREADS[k]:
        raise ValueError(
            f"{fn}: v6 with {4 * k} floats per thread (n={n}, {g} threads per row) is compiled for "
            f"blocks of at most {V6_MAX_THREADS[k]} threads, got threads={threads}"
        )
    return k, threads, r


def v7_plan(fn, n: int, ws: int, threads=None):
    """(K, threads) for v7 (one warp per row), or None when the row does not fit (n > 32 ws: the launcher runs v5)."""
    k = _k_for(n, ws)
    if k is None:
        return None
    threads = min(DEFAULT_THREADS["v7"], V7_MAX_THREADS[k]) if threads is None else int(threads)
    if threads > V7_MAX_THREADS[k]:
        raise ValueError(
            f"{fn}: v7 with {4 * k} floats per lane and two rows in registers (n={n}) is compiled for "
            f"blocks of at most {V7_MAX_THREADS[k]} threads, got threads={threads}"
        )
    return k, threads


def _grid(k, threads, tiles, blocks_per_sm, device_id):
    """Blocks for the grid-stride kernels v6/v7: `tiles` (one row tile per block) when blocks_per_sm == 0, else
    min(tiles, blocks_per_sm x SMs), blocks_per_sm None meaning as many as fit at once (the occupancy API)."""
    if blocks_per_sm == 0:
        return tiles
    if blocks_per_sm is None:
        blocks_per_sm = hip.blocks_per_sm(k, threads, hip.device_properties(device_id))  # the occupancy API
    return max(1, min(tiles, int(blocks_per_sm) * hip.sm_count(device_id)))


def _aligned16(*arrays) -> bool:
    return all(int(a.data.ptr) % 16 == 0 for a in arrays)


def softmax_backward(dout, out, dinp, version="v3", threads=None, rows_per_block=None, blocks_per_sm=None):
    """dinp[:] = out * (dout - sum_row(out * dout)); dout, out, dinp float32 (N, n) CuPy arrays.

    threads: per block (v2: a power of two; v3..v7: a multiple of the warp size; at most 1024); None: default.
    v5 lowers threads to what its register use allows (its kernel's max_threads_per_block).
    v6 only: rows_per_block (rows per block; threads / rows_per_block threads, whole warps, share a row; see v6_plan).
    v6, v7: blocks_per_sm (grid = blocks_per_sm x SMs, the blocks looping over the rows; 0: one row tile per block;
    None: as many blocks as fit at once). With default settings, rows v6/v7 cannot hold (n % 4 != 0, arrays not
    16-byte aligned, n > 16384 for v6 or n > 32 x warp size for v7) run v5; explicit settings that cannot work raise.
    """
    fn = "softmax_backward"
    if version not in VERSIONS:
        raise ValueError(f"{fn}: version={version!r} is not one of {', '.join(VERSIONS)}")
    if rows_per_block is not None and version != "v6":
        raise ValueError(f"{fn}: rows_per_block= is a v6 setting; version {version!r} does not take it")
    if blocks_per_sm is not None:
        if version not in ("v6", "v7"):
            raise ValueError(f"{fn}: blocks_per_sm= is a v6/v7 setting; version {version!r} does not take it")
        if not isinstance(blocks_per_sm, (int, np.integer)) or isinstance(blocks_per_sm, bool) or blocks_per_sm < 0:
            raise ValueError(
                f"{fn}: blocks_per_sm={blocks_per_sm!r}, expected an int >= 0 (0: one row tile per "
                f"block; None: as many blocks as fit)"
            )
    check_cupy_args(fn, ("dout", "out", "dinp"), (dout, out, dinp), ndim=2)
    if version in ("v6", "v7"):
        N, n = dout.shape
        if N == 0 or n == 0:
            return
        if N >= 2**31 or n >= 2**31:
            raise ValueError(f"{fn}: N={N} and n={n} must each fit in an int32")
        dev = dout.device.id
        ws = hip.warp_size(dev)
        if blocks_per_sm is None:
            blocks_per_sm = DEFAULT_BLOCKS_PER_SM[version]
        if threads is not None and (int(threads) % ws or not 1 <= int(threads) <= 1024):
            raise ValueError(
                f"{fn}: {version} needs whole warps, threads a multiple of {ws} in [1, 1024], got {threads}"
            )
        vector = n % 4 == 0 and _aligned16(dout, out, dinp)
        plan = v6_plan(fn, n, ws, threads, rows_per_block) if version == "v6" else v7_plan(fn, n, ws, threads)
        if plan is not None and vector:
            if version == "v6":
                kk, threads, r = plan
                k = hip.kernel("softmax", f"softmax_backward_v6_k{kk}")
                blocks = _grid(k, threads, (N + r - 1) // r, blocks_per_sm, dev)
                k((blocks,), (threads,), (dout, out, dinp, np.int32(N), np.int32(n), np.int32(r)))
            else:
                kk, threads = plan
                k = hip.kernel("softmax", f"softmax_backward_v7_k{kk}")
                wpb = threads // ws
                blocks = _grid(k, threads, (N + wpb - 1) // wpb, blocks_per_sm, dev)
                k((blocks,), (threads,), (dout, out, dinp, np.int32(N), np.int32(n)))
            return
        version, threads = "v5", None  # n % 4 != 0, unaligned, or rows too long for v6/v7's registers
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
    ws = hip.warp_size(dout.device.id) if version in ("v3", "v4", "v5") else 1
    if threads % ws:
        raise ValueError(f"{fn}: {version} needs whole warps, threads a multiple of {ws}, got {threads}")
    k = hip.kernel("softmax", f"softmax_backward_{version}")
    if version == "v5":
        # v5 holds its rows in registers (~100 per thread on sm_90): the GPU runs at most max_threads_per_block
        # threads of it per block (about 640 on NVIDIA), so a larger threads= is lowered to whole warps below that
        threads = min(threads, int(getattr(k, "max_threads_per_block", 1024)) // ws * ws)
    if version == "v1":
        blocks = (N + threads - 1) // threads  # one thread per row
    elif version in ("v4", "v5"):
        rows_per_block = threads // ws  # one warp per row
        blocks = (N + rows_per_block - 1) // rows_per_block
    else:
        blocks = N  # one block per row
    k((blocks,), (threads,), (dout, out, dinp, np.int32(N), np.int32(n)))
