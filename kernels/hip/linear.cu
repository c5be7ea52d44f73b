// linear.cu: linear_backward from one general matrix multiply (GEMM) with transpose flags, plus a column sum.
// Weight stored (in, out) = (C, OC); N = B*T rows:
//   dinp    = dout  @ weight.T   (N, OC) @ (OC, C) -> (N, C)    matmul_vX(dout, weight, dinp, N, C, OC, 0, 1)
//   dweight = inp.T @ dout       (C, N)  @ (N, OC) -> (C, OC)   matmul_vX(inp, dout, dweight, C, OC, N, 1, 0)
//   dbias   = dout.sum(axis=0)                       (OC,)      bias_backward_v1(dout, dbias, N, OC)
// Every matmul_vX computes out (M, P) = op(A) (M, K) @ op(B) (K, P), op(X) = X^T when its trans flag is 1.
// (M, P, K are GEMM sizes, not the model's symbols: for dweight the reduction size K is the N rows.)
// All matrices are row-major and C-contiguous; a transposed operand is read in place, op(A)[i][k] = A[k][i].
// Same versions as kernels/numba/linear.py (see its docstring). Launches (gpullm_lessons/backends/hip/linear.py):
//   v1, v2: block (16, 16), grid (ceil(P/16), ceil(M/16));  v3: block (16, 16), grid (ceil(P/64), ceil(M/64));
//   bias_backward_v1: block 256, grid ceil(OC/256).
#include "portable.h"

#define TILE 16            // v2: a block of TILE x TILE threads owns a TILE x TILE tile of out
#define REG 4              // v3: each thread owns REG x REG elements of out
#define BIG (TILE * REG)   // v3: a block owns a BIG x BIG = 64 x 64 tile of out

// Element [row][col] of op(X) for a row-major X whose stored rows have length ld (X itself, or X^T when trans).
__device__ __forceinline__ float load_op(const float* __restrict__ X, long long row, long long col, long long ld,
                                         int trans) {
    return trans ? X[col * ld + row] : X[row * ld + col];
}

// v1: naive: one thread per element out[i][j] (x -> column j, y -> row i), looping over K from global memory.
extern "C" __global__ void matmul_v1(const float* __restrict__ A, const float* __restrict__ B,
                                     float* __restrict__ out, int M, int P, int K, int trans_a, int trans_b) {
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    int i = blockIdx.y * blockDim.y + threadIdx.y;
    if (i >= M || j >= P) return;                      // the grid is rounded up to whole blocks
    long long lda = trans_a ? M : K;                   // A stored (K, M) or (M, K)
    long long ldb = trans_b ? K : P;                   // B stored (P, K) or (K, P)
    float acc = 0.0f;
    for (int k = 0; k < K; k++) acc += load_op(A, i, k, lda, trans_a) * load_op(B, k, j, ldb, trans_b);
    out[(long long)i * P + j] = acc;
}

// v2: tiled: the block walks along K in steps of 16, staging a 16x16 tile of op(A) and of op(B) in shared memory;
// each global element loaded is then used by 16 threads. Zeros fill tiles past the matrix edges (any size works).
// Loads always walk the stored (contiguous) axis with threadIdx.x (coalesced); a transposed operand is written
// transposed into shared memory, padded to TILE + 1 columns so that write has no bank conflicts.
extern "C" __global__ void matmul_v2(const float* __restrict__ A, const float* __restrict__ B,
                                     float* __restrict__ out, int M, int P, int K, int trans_a, int trans_b) {
    __shared__ float sa[TILE][TILE + 1];   // sa[ii][kk] = op(A)[i0 + ii][k0 + kk]
    __shared__ float sb[TILE][TILE + 1];   // sb[kk][jj] = op(B)[k0 + kk][j0 + jj]
    int tx = threadIdx.x, ty = threadIdx.y;
    int i0 = blockIdx.y * TILE, j0 = blockIdx.x * TILE;
    int i = i0 + ty, j = j0 + tx;                      // the element of out this thread owns
    float acc = 0.0f;
    for (int k0 = 0; k0 < K; k0 += TILE) {
        if (trans_a) {   // A stored (K, M): row k0+ty, column i0+tx
            int r = k0 + ty, c = i0 + tx;
            sa[tx][ty] = (r < K && c < M) ? A[(long long)r * M + c] : 0.0f;
        } else {         // A stored (M, K): row i0+ty, column k0+tx
            int r = i0 + ty, c = k0 + tx;
            sa[ty][tx] = (r < M && c < K) ? A[(long long)r * K + c] : 0.0f;
        }
        if (trans_b) {   // B stored (P, K): row j0+ty, column k0+tx
            int r = j0 + ty, c = k0 + tx;
            sb[tx][ty] = (r < P && c < K) ? B[(long long)r * K + c] : 0.0f;
        } else {         // B stored (K, P): row k0+ty, column j0+tx
            int r = k0 + ty, c = j0 + tx;
            sb[ty][tx] = (r < K && c < P) ? B[(long long)r * P + c] : 0.0f;
        }
        __syncthreads();                               // both tiles complete before anyone reads them
        for (int kk = 0; kk < TILE; kk++) acc += sa[ty][kk] * sb[kk][tx];
        __syncthreads();                               // everyone done reading before the next load
    }
    if (i < M && j < P) out[(long long)i * P + j] = acc;
}

// v3: register tiling: 16x16 threads own a 64x64 tile of out, each thread a 4x4 patch in registers (rows
// ty + 16*ri, columns tx + 16*ci: strided, so a warp reads consecutive sb columns and writes consecutive out
// columns). Per step of K: 4 + 4 shared-memory reads feed 16 FMAs (v2: 2 reads per FMA).
extern "C" __global__ void matmul_v3(const float* __restrict__ A, const float* __restrict__ B,
                                     float* __restrict__ out, int M, int P, int K, int trans_a, int trans_b) {
    __shared__ float sa[BIG][TILE + 1];    // sa[ii][kk] = op(A)[i0 + ii][k0 + kk]   (64 x 16, padded)
    __shared__ float sb[TILE][BIG + 1];    // sb[kk][jj] = op(B)[k0 + kk][j0 + jj]   (16 x 64, padded)
    int tx = threadIdx.x, ty = threadIdx.y;
    int t = ty * TILE + tx;                            // 0..255, the thread's rank in the block
    int i0 = blockIdx.y * BIG, j0 = blockIdx.x * BIG;
    float acc[REG][REG];
    for (int ri = 0; ri < REG; ri++)
        for (int ci = 0; ci < REG; ci++) acc[ri][ci] = 0.0f;
    for (int k0 = 0; k0 < K; k0 += TILE) {
        // 64*16 = 1024 elements per tile: 4 per thread, consecutive threads along the stored contiguous axis.
        for (int step = 0; step < REG; step++) {
            int e = t + step * TILE * TILE;            // 0..1023
            if (trans_a) {   // A stored (K, M): the tile is 16 rows (k) x 64 columns (i)
                int kk = e / BIG, ii = e % BIG, r = k0 + kk, c = i0 + ii;
                sa[ii][kk] = (r < K && c < M) ? A[(long long)r * M + c] : 0.0f;
            } else {         // A stored (M, K): the tile is 64 rows (i) x 16 columns (k)
                int ii = e / TILE, kk = e % TILE, r = i0 + ii, c = k0 + kk;
                sa[ii][kk] = (r < M && c < K) ? A[(long long)r * K + c] : 0.0f;
            }
            if (trans_b) {   // B stored (P, K): the tile is 64 rows (j) x 16 columns (k)
                int jj = e / TILE, kk = e % TILE, r = j0 + jj, c = k0 + kk;
                sb[kk][jj] = (r < P && c < K) ? B[(long long)r * K + c] : 0.0f;
            } else {         // B stored (K, P): the tile is 16 rows (k) x 64 columns (j)
                int kk = e / BIG, jj = e % BIG, r = k0 + kk, c = j0 + jj;
                sb[kk][jj] = (r < K && c < P) ? B[(long long)r * P + c] : 0.0f;
            }
        }
        __syncthreads();
        for (int kk = 0; kk < TILE; kk++) {
            float ra[REG], rb[REG];
            for (int ri = 0; ri < REG; ri++) ra[ri] = sa[ty + TILE * ri][kk];
            for (int ci = 0; ci < REG; ci++) rb[ci] = sb[kk][tx + TILE * ci];
            for (int ri = 0; ri < REG; ri++)
                for (int ci = 0; ci < REG; ci++) acc[ri][ci] += ra[ri] * rb[ci];
        }
        __syncthreads();
    }
    for (int ri = 0; ri < REG; ri++) {
        int i = i0 + ty + TILE * ri;
        for (int ci = 0; ci < REG; ci++) {
            int j = j0 + tx + TILE * ci;
            if (i < M && j < P) out[(long long)i * P + j] = acc[ri][ci];
        }
    }
}

// dbias (every version): one thread per output column o summing dout[:, o] over the N rows (neighbouring threads
// read neighbouring columns of a row: coalesced). O(N*OC) work, small next to the GEMMs, so kept simple.
extern "C" __global__ void bias_backward_v1(const float* __restrict__ dout, float* __restrict__ dbias, int N, int OC) {
    int o = blockIdx.x * blockDim.x + threadIdx.x;
    if (o >= OC) return;
    float acc = 0.0f;
    for (int n = 0; n < N; n++) acc += dout[(long long)n * OC + o];
    dbias[o] = acc;
}
