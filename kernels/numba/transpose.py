"""transpose: out = a^T through a tile in shared memory, the staging half of lesson 02's tiled GEMM.

tiled: a block of TILE x TILE threads owns one TILE x TILE tile of a (R, S). Each thread reads one element of it
    into a shared tile, the block waits at a barrier, and each thread writes one element of the transposed tile
    into out (S, R). Both global accesses walk a stored row with threadIdx.x (neighbouring threads, neighbouring
    addresses: coalesced); the change of order happens in shared memory. The shared tile is TILE_PAD = TILE + 1
    floats wide: reading it down a column then touches 16 different banks instead of one bank 16 times. A thread
    whose element lies past the edge of a loads and stores nothing: no other thread reads its slot.

A transposed copy costs a whole pass over the matrix (read R*S floats, write R*S): the reason lesson 02's GEMM
reads a transposed operand in place instead, with the same staging inside its loads. The same kernel in portable
C++ is kernels/hip/transpose.cu (lesson 02 prints that one).
"""
from numba import cuda, float32
from gpullm_lessons.kernels.numba import launch_stream

TILE = 16
TILE_PAD = TILE + 1       # one float wider than the tile: the column-wise reads hit different banks


# tiled: one TILE x TILE tile per block, through shared memory; coalesced reads and writes
@cuda.jit
def transpose_tiled(a, out):
    # a (R, S) -> out (S, R); block (bx, by) owns a[by*TILE : +TILE, bx*TILE : +TILE] and out[bx*TILE : +TILE, ...]
    tile = cuda.shared.array((TILE, TILE_PAD), float32)
    R, S = a.shape
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    r0, s0 = cuda.blockIdx.y * TILE, cuda.blockIdx.x * TILE
    if r0 + ty < R and s0 + tx < S:
        tile[ty, tx] = a[r0 + ty, s0 + tx]               # tx walks row r0 + ty of a
    cuda.syncthreads()                                   # the whole tile is in shared memory
    # out[s0 + ty, r0 + tx] = a[r0 + tx, s0 + ty]: tx now walks row s0 + ty of out, and column ty of the tile
    if s0 + ty < S and r0 + tx < R:
        out[s0 + ty, r0 + tx] = tile[tx, ty]


KERNELS = {"tiled": transpose_tiled}
SIGNATURES = {"tiled": "void(float32[:, ::1], float32[:, ::1])"}


def transpose(a, out):
    """out (S, R) = a (R, S) transposed, float32, destination-passing. Blocks of TILE x TILE threads."""
    R, S = a.shape
    if tuple(out.shape) != (S, R):
        raise ValueError(f"transpose: a is {tuple(a.shape)}, out {tuple(out.shape)}; need out of shape {(S, R)}")
    if R == 0 or S == 0:
        return out
    blocks = ((S + TILE - 1) // TILE, (R + TILE - 1) // TILE)   # (x: column tiles of a, y: row tiles of a)
    transpose_tiled[blocks, (TILE, TILE), launch_stream()](a, out)
    return out
