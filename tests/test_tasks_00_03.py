"""The graded tasks of lessons 00, 02 and 03: each solution passes, and plausible wrong answers fail with a hint
that names the mistake.

The solutions are the code cells of solutions/00, 02, 03 (run here without their checker cells); the wrong answers
are small variants of them. Each one would pass a checker that only ran easy sizes: no grid-stride loop (passes
while n fits in the capped grid; in 00.2 along either axis of a 2-D grid), only the first K tile (passes while
K <= 16), no zero fill of the partial tile (passes when K is a multiple of 16), a tree that only works for
power-of-two blocks (03.1 launches 24 or 192 threads), a warp reduction that drops columns past 32 or the tail
(passes while n <= 32 or a multiple of 32), a softmax without the row max (passes until a logit overflows exp), ...
Numba tasks run in the simulator (warp shuffles through gpullm_lessons.runtime.simwarp); HIP tasks are compiled and linted
without a GPU, and run by the gpu-marked tests on one.
"""
import functools
import math

import numpy as np
import pytest

import gpullm_lessons  # noqa: F401  (before numba)
from gpullm_lessons.checks import kernels as ck
from gpullm_lessons import device
from gpullm_lessons.runtime import hip
from gpullm_lessons.checks.backward import check_linear_backward

from numba import cuda, float32  # noqa: E402

from conftest import solution_namespace, wrong  # noqa: E402
numba_ok = pytest.mark.skipif(not device.numba_available(), reason="Numba kernels need a GPU or the simulator")
no_gpu = pytest.mark.skipif(device.has_gpu(), reason="the no-GPU path (compile + lint) of a HIP task")


@functools.lru_cache(maxsize=None)
def solution(name: str) -> dict:
    """The namespace of solutions/<name>.ipynb (see conftest.solution_namespace)."""
    return solution_namespace(name)




def capped(kernel, threads_name="THREADS", ns_name="00_gpu_orientation"):
    """A launcher like the exercise's: flat elements, at most MAX_BLOCKS blocks."""
    ns = solution(ns_name)

    def launch(inp, bias, out):
        n = out.shape[0] * out.shape[1]
        threads = ns[threads_name]
        kernel[min(ns["MAX_BLOCKS"], (n + threads - 1) // threads), threads](inp, bias, out)
    return launch


# ------------------------------------------------------------------------------------------------------------
# 00.1 bias add, grid-stride (Numba)
# ------------------------------------------------------------------------------------------------------------
@cuda.jit
def bias_one_per_thread(inp, bias, out):          # lesson 00's v1 pattern: right only while n fits in the grid
    N, C = out.shape
    i = cuda.grid(1)
    if i < N * C:
        out[i // C, i % C] = inp[i // C, i % C] + bias[i % C]


@cuda.jit
def bias_no_guard(inp, bias, out):
    N, C = out.shape
    i = cuda.grid(1)
    out[i // C, i % C] = inp[i // C, i % C] + bias[i % C]


@cuda.jit
def bias_stops_short(inp, bias, out):
    N, C = out.shape
    for i in range(cuda.grid(1), N * C - 1, cuda.gridsize(1)):
        out[i // C, i % C] = inp[i // C, i % C] + bias[i % C]


@cuda.jit
def bias_one_too_far(inp, bias, out):
    N, C = out.shape
    for i in range(cuda.grid(1), N * C + 1, cuda.gridsize(1)):
        out[i // C, i % C] = inp[i // C, i % C] + bias[i % C]


@cuda.jit
def bias_starts_at_thread_index(inp, bias, out):
    N, C = out.shape
    for i in range(cuda.threadIdx.x, N * C, cuda.gridsize(1)):
        out[i // C, i % C] = inp[i // C, i % C] + bias[i % C]


@cuda.jit
def bias_by_row(inp, bias, out):
    N, C = out.shape
    for i in range(cuda.grid(1), N * C, cuda.gridsize(1)):
        out[i // C, i % C] = inp[i // C, i % C] + bias[i // C]


@numba_ok
def test_00_1_solution_is_correct():
    ns = solution("00_gpu_orientation")
    assert ck.check_bias_add(ns["bias_add"], arrays="numba", seed=1, quiet=True).status == "correct"


@numba_ok
def test_00_1_no_grid_stride_loop_fails_past_the_capped_grid():
    r = ck.check_bias_add(capped(bias_one_per_thread), arrays="numba", seed=1, quiet=True)
    G = np.prod(ck.SIM_GRID) if not device.numba_on_gpu() else np.prod(ck.GPU_GRID)
    wrong(r, f"past index G = {G}", "grid-stride")


@numba_ok
def test_00_1_missing_guard_names_the_thread():
    """The simulator traps the stray write (IndexError in a thread); on a GPU nothing does, and the checker's guard
    zones around the output show it."""
    r = ck.check_bias_add(capped(bias_no_guard), arrays="numba", seed=1, quiet=True)
    if device.numba_on_gpu():
        wrong(r, "wrote outside out", "guard")
    else:
        wrong(r, "thread threadIdx=", "of block", "guard")


@numba_ok
def test_00_1_off_by_one_both_ways():
    wrong(ck.check_bias_add(capped(bias_stops_short), arrays="numba", seed=1, quiet=True), "off-by-one")
    wrong(ck.check_bias_add(capped(bias_one_too_far), arrays="numba", seed=1, quiet=True), "i < n", "not i <= n")


@numba_ok
def test_00_1_wrong_start_leaves_holes_and_bias_by_row():
    wrong(ck.check_bias_add(capped(bias_starts_at_thread_index), arrays="numba", seed=1, quiet=True),
          "separate runs", "own global index")
    wrong(ck.check_bias_add(capped(bias_by_row), arrays="numba", seed=1, quiet=True), "indexed by the row")


@numba_ok
def test_00_1_stale_state_between_calls_fails():
    ns = solution("00_gpu_orientation")
    first = {}

    def cached_bias(inp, bias, out):               # keeps the first call's bias: fine for one call only
        first.setdefault("bias", bias)
        ns["bias_add"](inp, first["bias"], out)

    assert ck.check_bias_add(cached_bias, arrays="numba", seed=1, quiet=True).status != "correct"


def test_00_1_cases_exceed_the_capped_grid_and_include_1x1():
    for size, grid in (("small", ck.SIM_GRID), ("large", ck.GPU_GRID)):
        sizes = [N * C for N, C in ck.CASES["bias_add"][size]]
        assert max(sizes) > 2 * grid[0] * grid[1] and 1 in sizes and any(s < grid[1] for s in sizes)
        assert all(s % 32 for s in sizes if s > 1)


# ------------------------------------------------------------------------------------------------------------
# 00.2 bias add (HIP): compiled + linted without a GPU, run on one
# ------------------------------------------------------------------------------------------------------------
@no_gpu
def test_00_2_solution_compiles_for_both_vendors_and_lints_clean():
    ns = solution("00_gpu_orientation")
    r = ck.check_bias_add(ns["bias_add_hip"], arrays="cupy", source=ns["bias_add_source"], entries="bias_add",
                          quiet=True)
    assert r.status == "compiled", r.message
    assert "lint clean" in r.message and "not run" in r.message


def test_00_2_non_portable_sources_fail_the_lint():
    ns = solution("00_gpu_orientation")
    good = ns["bias_add_source"]()
    assert hip.lint_source(good) == []
    assert any("header" in f for f in hip.lint_source(good.replace('#include "portable.h"',
                                                                   "#include <cuda_runtime.h>")))


def test_00_2_a_2d_grid_without_its_loops_is_named_at_numpy_level():
    """What a 2-D kernel without a grid-stride loop writes: the rows past the grid's threads in y, or the columns
    past its threads in x, never written (here 8 rows and 32 columns of threads, the small cases' scale)."""
    def rows_only(inp, bias, out, R=8):
        out[:R] = inp[:R] + bias

    def cols_only(inp, bias, out, Q=32):
        out[:, :Q] = inp[:, :Q] + bias[:Q]

    def right(inp, bias, out):
        out[...] = inp + bias

    assert ck.check_bias_add(right, arrays="numpy", seed=2, quiet=True).status == "correct"
    wrong(ck.check_bias_add(rows_only, arrays="numpy", seed=2, quiet=True), "rows 8..", "grid-stride loop in y")
    wrong(ck.check_bias_add(cols_only, arrays="numpy", seed=2, quiet=True), "columns 32..", "grid-stride loop in x")
    for N, C in ck.CASES["bias_add"]["large"]:       # 00.2's grid: 1024 threads down, 512 across
        if N * C > 1000:
            assert N > 1024 and C > 512 and N % 8 and C % 32


def hip_bias_variant(old, new):
    """00.2's solution source with one line changed, launched like the exercise's launcher."""
    ns = solution("00_gpu_orientation")
    src = ns["bias_add_source"]()
    assert old in src
    src = src.replace(old, new)

    def launch(inp, bias, out):
        kernel = hip.kernel_from_source(src, "bias_add")
        N, C = out.shape
        bx, by = ns["HIP_BLOCK"]
        gx, gy = ns["HIP_MAX_GRID"]
        kernel((min(gx, (C + bx - 1) // bx), min(gy, (N + by - 1) // by)), (bx, by),
               (inp, bias, out, np.int32(N), np.int32(C)))
    return launch


@pytest.mark.gpu
def test_00_2_on_a_gpu_runs_and_names_a_missing_loop_along_each_axis():
    ns = solution("00_gpu_orientation")
    assert ck.check_bias_add(ns["bias_add_hip"], arrays="cupy", seed=1, quiet=True).status == "correct"
    no_y = hip_bias_variant("r += gridDim.y * blockDim.y", "r += N")
    wrong(ck.check_bias_add(no_y, arrays="cupy", seed=1, quiet=True), "grid-stride loop in y")
    no_x = hip_bias_variant("c += gridDim.x * blockDim.x", "c += C")
    wrong(ck.check_bias_add(no_x, arrays="cupy", seed=1, quiet=True), "grid-stride loop in x")
    by_row = hip_bias_variant("inp[(long long)r * C + c] + b;", "inp[(long long)r * C + c] + bias[r % C];")
    wrong(ck.check_bias_add(by_row, arrays="cupy", seed=1, quiet=True), "indexed by the row")


# ------------------------------------------------------------------------------------------------------------
# 02.1 linear backward (CuPy / NumPy) and 02.2 tiled dweight (Numba)
# ------------------------------------------------------------------------------------------------------------
def test_02_1_solution_is_correct():
    ns = solution("02_linear_backward")
    assert check_linear_backward(ns["linear_backward"], arrays="numpy", seed=3, quiet=True).status == "correct"


def dweight_variant(variant):
    """02.2's solution kernel with one mistake."""
    TILE, PAD = 16, 17

    @cuda.jit
    def kernel(inp, dout, dweight):
        sa = cuda.shared.array((TILE, PAD), float32)
        sb = cuda.shared.array((TILE, PAD), float32)
        N, C = inp.shape
        OC = dout.shape[1]
        tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
        c0, o0 = cuda.blockIdx.y * TILE, cuda.blockIdx.x * TILE
        zero = float32(0.0)
        acc = zero
        last = N if variant != "skip_partial" else (N // TILE) * TILE
        for n0 in range(0, last, TILE):
            if variant == "acc_reset":                 # the accumulator set to 0 at every tile, not once
                acc = zero
            n, c, o = n0 + ty, c0 + tx, o0 + tx
            if variant == "no_zero_fill":          # skips the load past the edge: the slot keeps the last tile's value
                if n < N and c < C:
                    sa[tx, ty] = inp[n, c]
                if n < N and o < OC:
                    sb[ty, tx] = dout[n, o]
            else:
                sa[tx, ty] = inp[n, c] if n < N and c < C else zero
                sb[ty, tx] = dout[n, o] if n < N and o < OC else zero
            if variant != "no_barrier":
                cuda.syncthreads()
            for kk in range(TILE):
                acc += sa[ty, kk] * sb[kk, tx]
            cuda.syncthreads()
            if variant == "first_tile":
                break
        c, o = c0 + ty, o0 + tx
        if c < C and o < OC:
            if variant == "transposed_store":
                dweight[o, c] = acc
            else:
                dweight[c, o] = acc

    def launch(inp, dout, dweight):
        C, OC = dweight.shape
        kernel[((OC + TILE - 1) // TILE, (C + TILE - 1) // TILE), (TILE, TILE)](inp, dout, dweight)
    return launch


@numba_ok
def test_02_2_solution_is_correct():
    ns = solution("02_linear_backward")
    assert ck.check_dweight_tiled(ns["dweight_tiled"], arrays="numba", seed=4, quiet=True).status == "correct"


@numba_ok
@pytest.mark.parametrize("variant, words", [
    ("first_tile", ["first", "tile along k"]),
    ("skip_partial", ["partial tile", "left out"]),
    ("no_zero_fill", ["previous tile", "write 0"]),
    ("no_barrier", ["barrier"]),
    ("transposed_store", ["transposed"]),
    ("acc_reset", ["only the last tile along k", "set back to 0 at every tile"]),
])
def test_02_2_tile_mistakes_are_named(variant, words):
    # the simulator's sizes on a GPU too: the words name the case that shows the mistake first at those sizes
    wrong(ck.check_dweight_tiled(dweight_variant(variant), arrays="numba", seed=4, size="small", quiet=True), *words)


def test_02_2_mistakes_named_at_numpy_level_on_every_case():
    """The tile patterns on each case shape (K = 37 spans three tiles): only the first tile, the partial tile left
    out, stale slots in the partial tile, the missing transpose (square case)."""
    def first_tile(inp, dout, dweight):
        dweight[...] = inp[:16].T @ dout[:16]

    def full_tiles_only(inp, dout, dweight):
        k = (inp.shape[0] // 16) * 16
        dweight[...] = inp[:k].T @ dout[:k]

    def stale(inp, dout, dweight):
        N = inp.shape[0]
        r, k0 = N % 16, N - N % 16
        extra = inp[k0 - 16 + r:k0].T @ dout[k0 - 16 + r:k0] if r and k0 >= 16 else 0
        dweight[...] = inp.T @ dout + extra

    def no_transpose(inp, dout, dweight):
        dweight[...] = inp @ dout

    wrong(ck.check_dweight_tiled(first_tile, arrays="numpy", seed=5, quiet=True), "first and only full tile")
    wrong(ck.check_dweight_tiled(full_tiles_only, arrays="numpy", seed=5, quiet=True), "partial tile")
    wrong(ck.check_dweight_tiled(stale, arrays="numpy", seed=5, quiet=True), "previous tile")
    wrong(ck.check_dweight_tiled(no_transpose, arrays="numpy", seed=5, quiet=True), "without the transpose")
    for size in ("small", "large"):
        Ks = [N for N, _, _ in ck.CASES["linear_dweight"][size]]
        assert 1 in Ks and any(K > 32 and K % 16 for K in Ks), Ks   # several tiles, a partial last one, K = 1


# ------------------------------------------------------------------------------------------------------------
# 02.3 tiled dinp (HIP)
# ------------------------------------------------------------------------------------------------------------
def test_02_3_mistakes_named_at_numpy_level():
    def first_tile(dout, weight, dinp):
        dinp[...] = dout[:, :16] @ weight[:, :16].T

    def no_transpose(dout, weight, dinp):
        dinp[...] = dout @ weight

    def right(dout, weight, dinp):
        dinp[...] = dout @ weight.T

    assert ck.check_dinp_tiled(right, arrays="numpy", seed=6, quiet=True).status == "correct"
    wrong(ck.check_dinp_tiled(first_tile, arrays="numpy", seed=6, quiet=True), "tile along k")
    wrong(ck.check_dinp_tiled(no_transpose, arrays="numpy", seed=6, quiet=True), "without the transpose")


@no_gpu
def test_02_3_solution_compiles_for_both_vendors_and_lints_clean():
    ns = solution("02_linear_backward")
    r = ck.check_dinp_tiled(ns["dinp_tiled_hip"], arrays="cupy", source=ns["dinp_tiled_source"],
                            entries="dinp_tiled", quiet=True)
    assert r.status == "compiled", r.message


@pytest.mark.gpu
def test_02_3_on_a_gpu_runs_and_catches_a_missing_zero_fill():
    ns = solution("02_linear_backward")
    assert ck.check_dinp_tiled(ns["dinp_tiled_hip"], arrays="cupy", seed=6, quiet=True).status == "correct"
    src = ns["dinp_tiled_source"]()
    src = src.replace("sa[ty][tx] = (r < N && k < OC) ? dout[(long long)r * OC + k] : 0.0f;",
                      "if (r < N && k < OC) sa[ty][tx] = dout[(long long)r * OC + k];")
    src = src.replace("sb[tx][ty] = (c < C && k < OC) ? weight[(long long)c * OC + k] : 0.0f;",
                      "if (c < C && k < OC) sb[tx][ty] = weight[(long long)c * OC + k];")

    def stale(dout, weight, dinp):
        kernel = hip.kernel_from_source(src, "dinp_tiled")
        N, C = dinp.shape
        kernel(((C + 15) // 16, (N + 15) // 16), (16, 16),
               (dout, weight, dinp, np.int32(N), np.int32(C), np.int32(dout.shape[1])))

    wrong(ck.check_dinp_tiled(stale, arrays="cupy", seed=6, quiet=True), "previous tile")


# ------------------------------------------------------------------------------------------------------------
# 03.1 row max, block tree for any block size (Numba)
# ------------------------------------------------------------------------------------------------------------
def row_max_variant(variant):
    """03.1's solution kernel with one mistake, launched like the exercise's launcher (THREADS = 24 here)."""
    ns = solution("03_softmax_backward")
    T = ns["THREADS"]

    @cuda.jit
    def kernel(x, m):
        part = cuda.shared.array(T, float32)
        N, n = x.shape
        t = cuda.threadIdx.x
        first = cuda.blockIdx.x
        v = float32(-np.inf)                           # "carried": the start set once, before the row loop
        for row in range(first, N if variant != "no_row_loop" else first + 1, cuda.gridDim.x):
            if variant != "carried":
                v = float32(0.0) if variant in ("zero_start", "sum") else float32(-np.inf)
            if variant == "no_stride":
                if t < n:
                    v = x[row, t]
            else:
                for j in range(t, n, cuda.blockDim.x):
                    v = v + x[row, j] if variant == "sum" else max(v, x[row, j])
            part[t] = v
            if variant != "no_barrier":
                cuda.syncthreads()
            if variant == "pow2_tree":                 # lesson 03's v2 tree: right for powers of two only
                s = cuda.blockDim.x // 2
                while s > 0:
                    if t < s:
                        part[t] = max(part[t], part[t + s])
                    cuda.syncthreads()
                    s //= 2
            else:
                active = cuda.blockDim.x
                while active > 1:
                    half = (active + 1) // 2
                    if t + half < active:
                        part[t] = part[t] + part[t + half] if variant == "sum" else max(part[t], part[t + half])
                    if variant != "no_barrier":
                        cuda.syncthreads()
                    active = half
            if t == 0:
                m[row] = part[0]
            cuda.syncthreads()

    def launch(x, m):
        kernel[min(x.shape[0], ns["MAX_BLOCKS"]), T](x, m)
    return launch


@numba_ok
def test_03_1_solution_is_correct():
    ns = solution("03_softmax_backward")
    assert ns["THREADS"] & (ns["THREADS"] - 1), "03.1's blocks must not be a power of two"
    r = ck.check_row_max(ns["row_max"], arrays="numba", seed=7, quiet=True)
    assert r.status == "correct", r.message
    if not device.numba_on_gpu():     # the first call traced: no shared slot read and written between two barriers
        assert "no missing barriers (traced)" in r.message, r.message


@numba_ok
@pytest.mark.parametrize("variant, words", [
    ("zero_start", ["-inf"]),
    ("no_stride", ["first {T} columns"]),             # T = the launch's block: 24 in the simulator, 192 on a GPU
    ("sum", ["row sum"]),
    ("no_row_loop", ["never written", "loop over rows"]),
    ("no_barrier", ["barrier"]),
    ("pow2_tree", ["as if it were a power of two", "blockDim.x = 24", "odd"]),
    ("carried", ["every earlier row the same block took", "set it inside the loop"]),
])
def test_03_1_mistakes_are_named(variant, words):
    T = solution("03_softmax_backward")["THREADS"]
    r = ck.check_row_max(row_max_variant(variant), arrays="numba", seed=7, quiet=True)
    wrong(r, *[w.format(T=T) for w in words])


def test_03_1_a_gpu_race_that_keeps_the_first_warps_is_named_as_a_missing_barrier_too():
    """On a GPU a tree without barriers often sees only the warps that wrote first: m is then the max of the first
    32 (64, ...) columns, the same values as a row loop that never strides; the hint names both causes."""
    def first_warp(x, m):
        m[...] = x[:, :32].max(axis=1)

    wrong(ck.check_row_max(first_warp, arrays="numpy", seed=7, quiet=True), "first 32 columns", "barrier")

    def first_24(x, m):                           # not whole warps: only the row loop is named
        m[...] = x[:, :24].max(axis=1)

    r = ck.check_row_max(first_24, arrays="numpy", seed=7, quiet=True)
    wrong(r, "first 24 columns")
    assert "barrier" not in r.message


def test_03_1_the_power_of_two_tree_is_named_for_the_gpu_block_too():
    """On a GPU the blocks have 192 threads: a halving tree keeps 128 of them (NumPy emulation of that launch)."""
    kept = ck._halving_tree_slots(192)
    assert len(kept) < 192 and ck._halving_tree_slots(256) == list(range(256))

    def pow2_tree_192(x, m):
        cols = np.isin(np.arange(x.shape[1]) % 192, kept)
        m[...] = np.where(cols[None, :], x, -np.inf).max(axis=1)

    wrong(ck.check_row_max(pow2_tree_192, arrays="numpy", size="large", seed=3, quiet=True),
          "as if it were a power of two", "or 192")


# ------------------------------------------------------------------------------------------------------------
# 03.2 softmax forward, one warp per row with shuffles (Numba, in the simulator through simwarp)
# ------------------------------------------------------------------------------------------------------------
def warp_variant(variant):
    """03.2's solution kernel with one mistake, launched like the exercise's launcher."""
    ns = solution("03_softmax_backward")

    @cuda.jit
    def kernel(inp, out):
        N, n = inp.shape
        lane = cuda.threadIdx.x % 32
        warp = (cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x) // 32
        n_warps = cuda.gridDim.x * cuda.blockDim.x // 32
        for row in range(warp, N if variant != "no_row_loop" else min(warp + 1, N), n_warps):
            if variant == "no_max":
                m = float32(0.0)
            else:
                m = float32(0.0) if variant == "zero_start" else float32(-math.inf)
                if variant == "first_32":
                    if lane < n:
                        m = max(m, inp[row, lane])
                elif variant == "no_tail":
                    for j0 in range(0, n - n % 32, 32):
                        m = max(m, inp[row, j0 + lane])
                else:
                    for j in range(lane, n, 32):
                        m = max(m, inp[row, j])
                if variant != "own_max":
                    off = 8 if variant == "16_lanes" else 16
                    while off > 0:
                        if variant == "down_no_broadcast":
                            m = max(m, cuda.shfl_down_sync(0xFFFFFFFF, m, off))
                        else:
                            m = max(m, cuda.shfl_xor_sync(0xFFFFFFFF, m, off))
                        off //= 2
            s = float32(0.0)
            if variant == "first_32":
                if lane < n:
                    s = math.exp(inp[row, lane] - m)
            elif variant == "no_tail":
                for j0 in range(0, n - n % 32, 32):
                    s += math.exp(inp[row, j0 + lane] - m)
            else:
                for j in range(lane, n, 32):
                    s += math.exp(inp[row, j] - m)
            off = 8 if variant == "16_lanes" else 16
            while off > 0:
                if variant == "down_no_broadcast":
                    s += cuda.shfl_down_sync(0xFFFFFFFF, s, off)
                else:
                    s += cuda.shfl_xor_sync(0xFFFFFFFF, s, off)
                off //= 2
            if variant == "writes_first_32":
                if lane < n:
                    out[row, lane] = math.exp(inp[row, lane] - m) / s
            else:
                for j in range(lane, n, 32):
                    e = math.exp(inp[row, j] - m)
                    out[row, j] = e if variant == "no_divide" else e / s

    @cuda.jit
    def exits_early(inp, out):
        N, n = inp.shape
        lane = cuda.threadIdx.x % 32
        warp = (cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x) // 32
        n_warps = cuda.gridDim.x * cuda.blockDim.x // 32
        for row in range(warp, N, n_warps):
            if lane >= n:                              # lanes without a column leave: the shuffle misses them
                return
            m = inp[row, lane]
            for j in range(lane + 32, n, 32):
                m = max(m, inp[row, j])
            off = 16
            while off > 0:
                m = max(m, cuda.shfl_xor_sync(0xFFFFFFFF, m, off))
                off //= 2
            s = float32(0.0)
            for j in range(lane, n, 32):
                s += math.exp(inp[row, j] - m)
            off = 16
            while off > 0:
                s += cuda.shfl_xor_sync(0xFFFFFFFF, s, off)
                off //= 2
            for j in range(lane, n, 32):
                out[row, j] = math.exp(inp[row, j] - m) / s

    k = exits_early if variant == "exits_early" else kernel

    def launch(inp, out):
        T = ns["WARP_THREADS"]
        N = inp.shape[0]
        k[min(ns["MAX_BLOCKS"], (N + T // 32 - 1) // (T // 32)), T](inp, out)
    return launch


@numba_ok
def test_03_2_solution_is_correct_in_the_simulator_too():
    ns = solution("03_softmax_backward")
    r = ck.check_softmax_forward_warp(ns["softmax_forward_warp"], arrays="numba", seed=8, quiet=True)
    assert r.status == "correct", r.message


@numba_ok
@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")     # 0 / 0 in the zero_start variant
@pytest.mark.parametrize("variant, words", [
    ("first_32", ["only columns 0..31"]),
    ("no_tail", ["tail"]),
    ("down_no_broadcast", ["lane 0"]),
    ("16_lanes", ["only 16 of 32 lanes"]),
    ("own_max", ["max of its own columns"]),
    ("no_divide", ["not divided by the row's sum"]),
    ("zero_start", ["near -1000", "-inf"]),
    ("writes_first_32", ["never written", "not only the first 32"]),
    ("no_row_loop", ["never written", "each warp must loop over rows"]),
    ("exits_early", ["returned from the kernel", "every lane named in the mask"]),
])
def test_03_2_warp_mistakes_are_named(variant, words):
    # a missing tail loop shows at the simulator's sizes as "the tail"; at a GPU's, rows are far longer than a warp
    # and the same mistake reads "the max and the sum cover only columns 0..31": the small sizes name it on both
    size = "small" if variant == "no_tail" else None
    r = ck.check_softmax_forward_warp(warp_variant(variant), arrays="numba", seed=8, size=size, quiet=True)
    if variant == "exits_early" and device.numba_on_gpu():
        # a shuffle whose mask names a lane that has returned is undefined on the hardware (the simulator traps
        # it and the hint says so): on a GPU the verdict is wrong, with whatever the garbage looks like
        words = []
    wrong(r, *words)


@numba_ok
@pytest.mark.skipif(device.numba_on_gpu(), reason="the simulator's math.exp raises; a GPU's gives inf (next test)")
def test_03_2_an_exp_without_the_row_max_is_named_in_the_simulator():
    """exp(1000) overflows: in the simulator math.exp raises (float64), named with the thread and the fix."""
    r = ck.check_softmax_forward_warp(warp_variant("no_max"), arrays="numba", seed=8, quiet=True)
    wrong(r, "overflowerror", "subtract the row's max")


def test_03_2_overflow_and_underflow_are_named_at_numpy_level():
    """On a GPU an exp without the max gives inf and NaN instead of raising: rows 0 and 1 of every case."""
    def no_max(inp, out):
        with np.errstate(over="ignore", invalid="ignore"):
            e = np.exp(inp)
            out[...] = e / e.sum(axis=1, keepdims=True)

    def zero_start(inp, out):
        m = np.maximum(inp.max(axis=1, keepdims=True), 0.0)
        with np.errstate(invalid="ignore"):
            e = np.exp(inp - m)
            out[...] = e / e.sum(axis=1, keepdims=True)

    def right(inp, out):
        e = np.exp(inp - inp.max(axis=1, keepdims=True))
        out[...] = e / e.sum(axis=1, keepdims=True)

    assert ck.check_softmax_forward_warp(right, arrays="numpy", seed=5, quiet=True).status == "correct"
    wrong(ck.check_softmax_forward_warp(no_max, arrays="numpy", seed=5, quiet=True), "near +1000", "overflows",
          "subtract the row's max")
    wrong(ck.check_softmax_forward_warp(zero_start, arrays="numpy", seed=5, quiet=True), "near -1000", "-inf")


def wavefront_softmax(inp, out, W=64, start=None, down=False):
    """NumPy emulation of a 64-lane wavefront running 03.3's kernel: lane l holds columns l, l + W, ...; the lanes
    combine with an xor butterfly from `start` (default W // 2), or a shfl_down tree without a broadcast."""
    N, n = inp.shape
    lane = np.arange(n) % W
    lanes = np.arange(W)

    def combine(v, op):
        off = W // 2 if start is None else start
        while off:
            if down:
                src = lanes + off
                other = np.where(src < W, v[:, np.minimum(src, W - 1)], v)
            else:
                other = v[:, lanes ^ off]
            v = op(v, other)
            off //= 2
        return v

    part = np.full((N, W), -np.inf)
    for l in range(W):
        if (lane == l).any():
            part[:, l] = inp[:, lane == l].max(axis=1)
    m = combine(part, np.maximum)[:, lane]
    e = np.exp(inp - m)
    s = combine(np.stack([e[:, lane == l].sum(axis=1) for l in range(W)], axis=1), np.add)[:, lane]
    out[...] = e / s


def test_03_3_64_lane_mistakes_are_named_at_numpy_level():
    assert ck.check_softmax_forward_warp(wavefront_softmax, arrays="numpy", seed=6, quiet=True).status == "correct"
    half = functools.partial(wavefront_softmax, start=16)             # a loop that starts at 16, not warpSize / 2
    wrong(ck.check_softmax_forward_warp(half, arrays="numpy", seed=6, quiet=True), "only 32 of 64 lanes",
          "warpSize / 2")
    lane0 = functools.partial(wavefront_softmax, down=True)
    wrong(ck.check_softmax_forward_warp(lane0, arrays="numpy", seed=6, quiet=True), "lane 0", "64-lane")


def test_03_2_cases_cover_every_row_length_a_warp_gets_wrong():
    for size in ("small", "large"):
        ns_ = [n for _, n in ck.CASES["softmax_forward"][size]]
        assert 1 in ns_ and any(1 < n < 32 for n in ns_) and any(n > 64 and n % 32 for n in ns_), ns_
        assert any(n > 32 and n % 32 for n in ns_)
    assert ck.CASES["softmax_forward"]["large"][0][0] > 4096 * 256 // 32     # more rows than the grid has warps


# ------------------------------------------------------------------------------------------------------------
# 03.3 the warp softmax in portable HIP (32 and 64 lanes)
# ------------------------------------------------------------------------------------------------------------
@no_gpu
def test_03_3_solution_compiles_for_both_vendors_and_lints_clean():
    ns = solution("03_softmax_backward")
    fn, good = ns["softmax_forward_warp_hip"], ns["softmax_forward_warp_source"]
    r = ck.check_softmax_forward_warp(fn, arrays="cupy", source=good, entries="softmax_forward_warp", quiet=True)
    assert r.status == "compiled", r.message


@no_gpu
def test_03_3_a_hard_coded_32_lane_mask_is_wrong_with_the_lint_finding():
    ns = solution("03_softmax_backward")
    bad = ns["softmax_forward_warp_source"]().replace("shfl_xor(s, offset, warpSize)",
                                                       "__shfl_xor_sync(0xffffffff, s, offset)")
    wrong(ck.check_softmax_forward_warp(ns["softmax_forward_warp_hip"], arrays="cupy", source=bad,
                                        entries="softmax_forward_warp", quiet=True), "32-lane mask 0xffffffff")


def test_03_3_the_lint_rejects_every_32_lane_assumption():
    ns = solution("03_softmax_backward")
    good = ns["softmax_forward_warp_source"]()
    assert hip.lint_source(good) == []
    for old, new, says in [
        ("threadIdx.x % warpSize", "threadIdx.x % 32", "% 32"),
        ("threadIdx.x / warpSize", "threadIdx.x / 32", "/ 32"),
        ("offset = warpSize / 2", "offset = 16", "offset 16"),
        ("shfl_xor(s, offset, warpSize)", "shfl_xor(s, offset, 32)", "width 32"),
        ("shfl_xor(m, offset, warpSize)", "__shfl_xor_sync(0xffffffff, m, offset)", "0xffffffff"),
    ]:
        assert old in good
        findings = hip.lint_source(good.replace(old, new))
        assert any(says in f for f in findings), (new, findings)


def test_03_3_portable_h_warp_sum_and_max_are_not_the_answer():
    ns = solution("03_softmax_backward")
    good = ns["softmax_forward_warp_source"]()
    for loop, call in [
        ("for (int offset = warpSize / 2; offset > 0; offset /= 2) s += shfl_xor(s, offset, warpSize);",
         "s = warp_sum(s);"),
        ("for (int offset = warpSize / 2; offset > 0; offset /= 2) m = fmaxf(m, shfl_xor(m, offset, warpSize));",
         "m = warp_max(m);"),
    ]:
        assert loop in good
        r = ck.check_softmax_forward_warp(ns["softmax_forward_warp_hip"], arrays="cupy",
                                          source=good.replace(loop, call), entries="softmax_forward_warp", quiet=True)
        wrong(r, "shuffle loops themselves")


@pytest.mark.gpu
def test_03_3_on_a_gpu_runs_and_names_a_lane_0_only_reduction():
    ns = solution("03_softmax_backward")
    r = ck.check_softmax_forward_warp(ns["softmax_forward_warp_hip"], arrays="cupy", seed=9, quiet=True)
    assert r.status == "correct", r.message
    src = ns["softmax_forward_warp_source"]().replace("shfl_xor(", "shfl_down(")

    def lane0(inp, out):
        kernel = hip.kernel_from_source(src, "softmax_forward_warp")
        N, n = inp.shape
        kernel((min(4096, (N + 7) // 8),), (256,), (inp, out, np.int32(N), np.int32(n)))

    wrong(ck.check_softmax_forward_warp(lane0, arrays="cupy", seed=9, quiet=True), "lane 0")


# ------------------------------------------------------------------------------------------------------------
# Checker contract
# ------------------------------------------------------------------------------------------------------------
def test_checkers_reject_bad_input_and_accept_seed_task_quiet():
    with pytest.raises(TypeError, match="must be your function"):
        ck.check_bias_add(np.zeros(3), arrays="numpy")
    with pytest.raises(ValueError, match="arrays="):
        ck.check_row_max(lambda x, m: None, arrays="torch")
    if device.numba_available():
        ns = solution("00_gpu_orientation")
        with pytest.raises(TypeError, match="is a Numba kernel"):
            ck.check_bias_add(ns["bias_add_kernel"], arrays="numba")

    def ni(*args):
        raise NotImplementedError

    for check in ck.CHECKERS.values():
        r = check(ni, arrays="numpy", seed=0, task="99.9 x", quiet=True)
        assert r.status == "not attempted" and r.task == "99.9 x"
