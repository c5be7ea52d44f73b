"""linear_backward: the three gradients of out = inp @ weight + bias, from one general matrix multiply (GEMM).

The weight is stored (in, out) = (C, OC), so (N = B*T rows):
    dinp    = dout  @ weight.T     (N, OC) @ (OC, C) -> (N, C)     matmul(dout, weight, dinp, trans_a=0, trans_b=1)
    dweight = inp.T @ dout         (C, N)  @ (N, OC) -> (C, OC)    matmul(inp, dout, dweight, trans_a=1, trans_b=0)
    dbias   = dout.sum(axis=0)                          (OC,)      a column reduction
Every GEMM kernel here computes out (M, P) = op(a) (M, K) @ op(b) (K, P), op(x) = x.T when its trans_ flag is 1,
else x. (M, P, K are GEMM sizes, not the model's symbols: for dweight the reduction size K is the N rows.)
Reading a transposed operand needs no copy: op(a)[i, k] is just a[k, i].

Versions (the wrapper launches the GEMM twice, then the dbias kernel):
v1: naive: one thread per output element out[i, j] (2-D grid of 16x16-thread blocks, x -> column j so
    neighbouring threads write neighbouring elements of out), looping over the K reduction in float32. Every
    operand element is re-read from global memory by every thread that needs it: M*P*K*2 loads.
v2: tiled shared-memory GEMM: 16x16 thread blocks, one 16x16 tile of out per block. The block walks along K in
    steps of 16: each thread copies one element of op(a)'s tile and one of op(b)'s tile into cuda.shared.array,
    syncthreads, then all 256 threads read the tiles from fast shared memory (each global element is loaded
    M/16 or P/16 times instead of M or P times). Tiles past the matrix edge are filled with 0 (bounds checks), so
    any size works. A transposed operand is loaded along its stored rows (coalesced) and written transposed into
    shared memory; the tiles are padded to 17 columns so that transposed write has no bank conflicts.
v3: register tiling: the same 16x16 threads now own a 64x64 tile of out, 4x4 elements per thread kept in
    registers (cuda.local.array). Per step of K each thread reads 4 values of op(a) and 4 of op(b) from shared memory
    and does 16 multiply-adds: 4x fewer shared-memory reads per FMA than v2. Runs in the simulator too (slowly).
v1_dbias: dbias[o] = sum_n dout[n, o], one thread per output column looping over the N rows (neighbouring threads
    read neighbouring columns of a row: coalesced). Used by every version: dbias is O(N*OC) work, tiny next to the
    two O(N*C*OC) GEMMs, so it is kept simple.

No version uses warp intrinsics, so all of them run in the CUDA simulator (GPU_ONLY is empty); the wrapper still
refuses a GPU-only version under the simulator if one is added.
HIP: kernels/hip/linear.cu has the same kernels (matmul_v1..v3, bias_backward_v1), launched by
gpullm_lessons/backends/hip/linear.py, which adds version="cublas" (CuPy's matmul: cuBLAS / hipBLAS).
"""
import numpy as np
from numba import cuda, float32

from gpullm_lessons import device
from gpullm_lessons.contracts.linear import validate   # shared with the HIP launcher
from gpullm_lessons.kernels.numba import launch_stream

TILE = 16          # v2: block = TILE x TILE threads = one TILE x TILE tile of out
REG = 4            # v3: each thread owns REG x REG elements of out
BIG = TILE * REG   # v3: one block owns a BIG x BIG = 64 x 64 tile of out
TILE_PAD = TILE + 1  # shared tiles get one extra column: a transposed write then hits 16 different banks
BIG_PAD = BIG + 1
DBIAS_THREADS = 256
MAX_GRID_Y = 65535  # the hardware limit on gridDim.y (rows of tiles)


# v1: one thread per output element, K-loop straight from global memory
@cuda.jit
def matmul_v1(a, b, out, trans_a, trans_b):
    # out (M, P) = op(a) (M, K) @ op(b) (K, P)
    M, P = out.shape
    K = a.shape[0] if trans_a else a.shape[1]
    j, i = cuda.grid(2)          # x -> column j of out, y -> row i
    if i < M and j < P:          # the grid is rounded up to whole blocks
        acc = float32(0.0)
        for k in range(K):
            av = a[k, i] if trans_a else a[i, k]   # op(a)[i, k]
            bv = b[j, k] if trans_b else b[k, j]   # op(b)[k, j]
            acc += av * bv
        out[i, j] = acc


# v2: tiled: stage 16x16 tiles of op(a) and op(b) in shared memory, reuse each loaded element 16 times
@cuda.jit
def matmul_v2(a, b, out, trans_a, trans_b):
    # out (M, P) = op(a) (M, K) @ op(b) (K, P); block (bx, by) owns out[by*16 : by*16+16, bx*16 : bx*16+16]
    sa = cuda.shared.array((TILE, TILE_PAD), float32)   # sa[ii, kk] = op(a)[i0 + ii, k0 + kk]  (+1: no bank conflicts)
    sb = cuda.shared.array((TILE, TILE_PAD), float32)   # sb[kk, jj] = op(b)[k0 + kk, j0 + jj]
    M, P = out.shape
    K = a.shape[0] if trans_a else a.shape[1]
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    i0, j0 = cuda.blockIdx.y * TILE, cuda.blockIdx.x * TILE
    i, j = i0 + ty, j0 + tx                              # the element of out this thread owns
    zero = float32(0.0)
    acc = zero
    for k0 in range(0, K, TILE):
        # Load: each thread copies one element of each tile; tx always walks the stored (contiguous) axis.
        if trans_a:   # a stored (K, M): row k0+ty, column i0+tx
            r, c = k0 + ty, i0 + tx
            sa[tx, ty] = a[r, c] if r < K and c < M else zero
        else:         # a stored (M, K): row i0+ty, column k0+tx
            r, c = i0 + ty, k0 + tx
            sa[ty, tx] = a[r, c] if r < M and c < K else zero
        if trans_b:   # b stored (P, K): row j0+ty, column k0+tx
            r, c = j0 + ty, k0 + tx
            sb[tx, ty] = b[r, c] if r < P and c < K else zero
        else:         # b stored (K, P): row k0+ty, column j0+tx
            r, c = k0 + ty, j0 + tx
            sb[ty, tx] = b[r, c] if r < K and c < P else zero
        cuda.syncthreads()                               # both tiles complete before anyone reads them
        for kk in range(TILE):                           # zeros past the edge add nothing
            acc += sa[ty, kk] * sb[kk, tx]
        cuda.syncthreads()                               # everyone done reading before the next load
    if i < M and j < P:
        out[i, j] = acc


# v3: register tiling: each thread computes a 4x4 patch of a 64x64 block tile, operands staged in shared memory
@cuda.jit
def matmul_v3(a, b, out, trans_a, trans_b):
    # out (M, P) = op(a) (M, K) @ op(b) (K, P); block (bx, by) owns out[by*64 : +64, bx*64 : +64]
    sa = cuda.shared.array((BIG, TILE_PAD), float32)   # sa[ii, kk] = op(a)[i0 + ii, k0 + kk]   (64, 16) + pad
    sb = cuda.shared.array((TILE, BIG_PAD), float32)   # sb[kk, jj] = op(b)[k0 + kk, j0 + jj]   (16, 64) + pad
    acc = cuda.local.array((REG, REG), float32)        # this thread's 4x4 patch of out, in registers
    ra = cuda.local.array(REG, float32)
    rb = cuda.local.array(REG, float32)
    M, P = out.shape
    K = a.shape[0] if trans_a else a.shape[1]
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    t = ty * TILE + tx                                   # 0..255, the thread's rank in the block
    i0, j0 = cuda.blockIdx.y * BIG, cuda.blockIdx.x * BIG
    zero = float32(0.0)
    for ri in range(REG):
        for ci in range(REG):
            acc[ri, ci] = zero
    for k0 in range(0, K, TILE):
        # Load 64*16 = 1024 elements of each tile: 4 per thread, consecutive threads on the stored contiguous axis.
        for step in range(REG):
            e = t + step * TILE * TILE                   # 0..1023
            if trans_a:   # a stored (K, M): the tile is 16 rows (k) x 64 columns (i)
                kk, ii = e // BIG, e % BIG
                r, c = k0 + kk, i0 + ii
                sa[ii, kk] = a[r, c] if r < K and c < M else zero
            else:         # a stored (M, K): the tile is 64 rows (i) x 16 columns (k)
                ii, kk = e // TILE, e % TILE
                r, c = i0 + ii, k0 + kk
                sa[ii, kk] = a[r, c] if r < M and c < K else zero
            if trans_b:   # b stored (P, K): the tile is 64 rows (j) x 16 columns (k)
                jj, kk = e // TILE, e % TILE
                r, c = j0 + jj, k0 + kk
                sb[kk, jj] = b[r, c] if r < P and c < K else zero
            else:         # b stored (K, P): the tile is 16 rows (k) x 64 columns (j)
                kk, jj = e // BIG, e % BIG
                r, c = k0 + kk, j0 + jj
                sb[kk, jj] = b[r, c] if r < K and c < P else zero
        cuda.syncthreads()
        for kk in range(TILE):
            # Thread (tx, ty) owns rows ty + 16*ri and columns tx + 16*ci of the block tile (strided, so a warp
            # reads consecutive sb columns and later writes consecutive columns of out).
            for ri in range(REG):
                ra[ri] = sa[ty + TILE * ri, kk]
            for ci in range(REG):
                rb[ci] = sb[kk, tx + TILE * ci]
            for ri in range(REG):                        # 16 FMAs for 8 shared-memory reads
                for ci in range(REG):
                    acc[ri, ci] += ra[ri] * rb[ci]
        cuda.syncthreads()
    for ri in range(REG):
        i = i0 + ty + TILE * ri
        for ci in range(REG):
            j = j0 + tx + TILE * ci
            if i < M and j < P:
                out[i, j] = acc[ri, ci]


# dbias (every version): one thread per output column o, summing dout[:, o] over the N rows
@cuda.jit
def dbias_v1(dout, dbias):
    # dout (N, OC) -> dbias (OC,)
    o = cuda.grid(1)
    if o < dbias.shape[0]:
        acc = float32(0.0)
        for n in range(dout.shape[0]):
            acc += dout[n, o]
        dbias[o] = acc


KERNELS = {"v1": matmul_v1, "v2": matmul_v2, "v3": matmul_v3, "v1_dbias": dbias_v1}
_GEMM_SIG = "void(float32[:, ::1], float32[:, ::1], float32[:, ::1], int32, int32)"
# Argument types for compiling without a GPU (tests compile every entry to PTX for sm_90).
SIGNATURES = {"v1": _GEMM_SIG, "v2": _GEMM_SIG, "v3": _GEMM_SIG, "v1_dbias": "void(float32[:, ::1], float32[::1])"}
GPU_ONLY = set()   # versions the simulator cannot run (none: no warp intrinsics here)
VERSIONS = ("v1", "v2", "v3")   # what linear_backward(..., version=) accepts


def matmul(a, b, out, trans_a=False, trans_b=False, version="v2"):
    """out (M, P) = op(a) @ op(b) with the GEMM kernel of `version`; op(x) = x.T when its trans_ flag is set.

    Destination-passing: out must already have the shape (M, P). Shapes are checked by linear_backward.
    """
    M, P = out.shape
    if M == 0 or P == 0:
        return out
    tile = BIG if version == "v3" else TILE           # rows/columns of out one 16x16-thread block owns
    blocks = ((P + tile - 1) // tile, (M + tile - 1) // tile)   # (x: column tiles, y: row tiles), rounded up
    threads = (TILE, TILE)
    if blocks[1] > MAX_GRID_Y:
        raise ValueError(f"linear_backward: {M} rows need {blocks[1]} row tiles, more than gridDim.y allows "
                         f"({MAX_GRID_Y})")
    KERNELS[version][blocks, threads, launch_stream()](a, b, out, np.int32(bool(trans_a)), np.int32(bool(trans_b)))
    return out


def linear_backward(dout, inp, weight, dinp, dweight, dbias, version="v2"):
    """Fill dinp = dout @ weight.T (N, C), dweight = inp.T @ dout (C, OC), dbias = dout.sum(0) (OC,).

    dout (N, OC), inp (N, C), weight (C, OC) stored (in, out); all float32. version: "v1" (naive), "v2" (tiled
    shared memory), "v3" (shared memory + 4x4 register tiles). Arrays: Numba device arrays or CuPy arrays on a GPU,
    NumPy / simulator device arrays under the simulator. Writes every element of the outputs; returns nothing.
    """
    N, C, OC = validate(dout, inp, weight, dinp, dweight, dbias, version)
    if version in GPU_ONLY and not device.numba_on_gpu():
        raise RuntimeError(f"linear_backward: version={version!r} uses GPU-only features the CUDA simulator "
                           f"cannot run; use one of {', '.join(v for v in VERSIONS if v not in GPU_ONLY)}")
    matmul(dout, weight, dinp, trans_a=False, trans_b=True, version=version)    # (N, OC) @ (OC, C) -> (N, C)
    matmul(inp, dout, dweight, trans_a=True, trans_b=False, version=version)    # (C, N) @ (N, OC) -> (C, OC)
    if OC > 0:
        blocks = (OC + DBIAS_THREADS - 1) // DBIAS_THREADS
        dbias_v1[blocks, DBIAS_THREADS, launch_stream()](dout, dbias)
