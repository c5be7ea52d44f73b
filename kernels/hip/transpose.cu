// transpose.cu: out = a^T through a tile in shared memory, the staging half of lesson 02's tiled GEMM.
// Same kernel as kernels/numba/transpose.py. Launch: block (TILE, TILE), grid (ceil(S / TILE), ceil(R / TILE)).
#include "portable.h"

#define TILE 16

// tiled: block (bx, by) owns the tile of a (R, S) at rows by*TILE.., columns bx*TILE..; each thread reads one
// element into the shared tile and, after the barrier, writes one element of the transposed tile into out (S, R).
// Both global accesses walk a stored row with threadIdx.x (coalesced); the reordering happens in shared memory,
// whose rows are TILE + 1 floats wide so that reading down a column touches 16 different banks, not 2.
// Threads past the edge of a load and store nothing: nobody reads their slot.
extern "C" __global__ void transpose_tiled(const float* __restrict__ a, float* __restrict__ out, int R, int S) {
    __shared__ float tile[TILE][TILE + 1];
    int tx = threadIdx.x, ty = threadIdx.y;
    int r0 = blockIdx.y * TILE, s0 = blockIdx.x * TILE;
    if (r0 + ty < R && s0 + tx < S) tile[ty][tx] = a[(long long)(r0 + ty) * S + s0 + tx];   // tx along a's row
    __syncthreads();                                                                      // the tile is complete
    // out[s0 + ty][r0 + tx] = a[r0 + tx][s0 + ty]: tx now walks a row of out, and a column of the tile
    if (s0 + ty < S && r0 + tx < R) out[(long long)(s0 + ty) * R + r0 + tx] = tile[tx][ty];
}
