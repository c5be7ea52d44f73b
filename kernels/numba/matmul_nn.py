"""matmul_nn: the tiled shared-memory GEMM of lesson 02 in its plainest layout, out = a @ b (no transposes).

This is the product of the linear forward, out (N, OC) = inp (N, C) @ weight (C, OC): both operands are read the
way they are stored, so the tiling is all there is to see. The general kernels with transpose flags, used by the
backward, are in linear.py.

tiled: a block of TILE x TILE threads owns one TILE x TILE tile of out. It walks along the reduction axis K in
    steps of TILE: each thread copies one element of a's tile and one of b's tile into shared memory (0 where the
    element lies past the matrix edge, so any M, P, K work), the block waits at a barrier, then every thread adds
    the TILE products of its row of a's tile and its column of b's tile, and the block waits again before the next
    step overwrites the tiles. Each element loaded from global memory is used TILE times.
"""
from numba import cuda, float32

TILE = 16


# tiled: stage TILE x TILE tiles of a and b in shared memory; each thread owns one element of out
@cuda.jit
def matmul_nn_tiled(a, b, out):
    # out (M, P) = a (M, K) @ b (K, P); block (bx, by) owns out[by*TILE : +TILE, bx*TILE : +TILE]
    tile_a = cuda.shared.array((TILE, TILE), float32)    # tile_a[r, q] = a[row0 + r, step + q]
    tile_b = cuda.shared.array((TILE, TILE), float32)    # tile_b[q, s] = b[step + q, col0 + s]
    M, K = a.shape
    P = b.shape[1]
    r, s = cuda.threadIdx.y, cuda.threadIdx.x            # this thread's row and column inside the tile
    row0, col0 = cuda.blockIdx.y * TILE, cuda.blockIdx.x * TILE
    row, col = row0 + r, col0 + s                        # the element of out it owns
    total = float32(0.0)
    for step in range(0, K, TILE):
        # one element of each tile per thread; s walks each stored row, so neighbouring threads read neighbours
        tile_a[r, s] = a[row, step + s] if row < M and step + s < K else float32(0.0)
        tile_b[r, s] = b[step + r, col] if step + r < K and col < P else float32(0.0)
        cuda.syncthreads()                               # the tiles are complete
        for q in range(TILE):
            total += tile_a[r, q] * tile_b[q, s]
        cuda.syncthreads()                               # nobody still reads them when the next step loads
    if row < M and col < P:
        out[row, col] = total


KERNELS = {"tiled": matmul_nn_tiled}
SIGNATURES = {"tiled": "void(float32[:, ::1], float32[:, ::1], float32[:, ::1])"}


def matmul_nn(a, b, out):
    """out (M, P) = a (M, K) @ b (K, P), float32, destination-passing. Blocks of TILE x TILE threads."""
    M, P = out.shape
    if tuple(a.shape) != (M, a.shape[1]) or tuple(b.shape) != (a.shape[1], P):
        raise ValueError(f"matmul_nn: a is {tuple(a.shape)}, b {tuple(b.shape)}, out {tuple(out.shape)}; "
                         f"need a (M, K), b (K, P), out (M, P)")
    if M == 0 or P == 0:
        return out
    blocks = ((P + TILE - 1) // TILE, (M + TILE - 1) // TILE)   # (x: column tiles, y: row tiles), rounded up
    matmul_nn_tiled[blocks, (TILE, TILE)](a, b, out)
    return out
