"""The graded tasks of lessons 00, 02 and 03: each solution passes, and plausible wrong answers fail with a hint
that names the mistake.

The solutions are the code cells of solutions/00, 02, 03 (run here without their checker cells); the wrong answers
are small variants of them. Each one would pass a checker that only ran easy sizes: no grid-stride loop (passes
while n fits in the capped grid), only the first K tile (passes while K <= 16), no zero fill of the partial tile
(passes when K is a multiple of 16), a warp reduction that drops columns past 32 or the tail (passes while n <= 32
or a multiple of 32), ... Numba tasks run in the simulator (warp shuffles through gpullm_lessons.simwarp); HIP
tasks are compiled and linted without a GPU, and run by the gpu-marked tests on one.
"""
import functools
from pathlib import Path

import nbformat
import numpy as np
import pytest

import gpullm_lessons  # noqa: F401  (before numba)
from gpullm_lessons import checks_kernels as ck
from gpullm_lessons import device, hip
from gpullm_lessons.checks import check_linear_backward
from gpullm_lessons.grading import checker_only_cells

from numba import cuda, float32  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
numba_ok = pytest.mark.skipif(not device.numba_available(), reason="Numba kernels need a GPU or the simulator")
no_gpu = pytest.mark.skipif(device.has_gpu(), reason="the no-GPU path (compile + lint) of a HIP task")


@functools.lru_cache(maxsize=None)
def solution(name: str) -> dict:
    """The namespace of solutions/<name>.ipynb after running its code cells, checker cells left out."""
    nb = nbformat.read(ROOT / "solutions" / f"{name}.ipynb", as_version=4)
    skip = checker_only_cells(nb)
    ns: dict = {"__name__": f"solution_{name}"}
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code" and i not in skip:
            exec(compile(cell.source, f"<solution {name} cell {i}>", "exec"), ns)
    return ns


def wrong(result, *words):
    """The verdict is wrong (or an error) and the hint names the mistake: every word appears in it."""
    assert result.status in ("wrong", "error"), result.message
    text = (result.message + " " + (result.hint or "")).lower()
    missing = [w for w in words if w.lower() not in text]
    assert not missing, f"hint does not say {missing}: {result.message}"


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
    wrong(ck.check_bias_add(capped(bias_no_guard), arrays="numba", seed=1, quiet=True),
          "thread threadIdx=", "of block", "guard")


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


@pytest.mark.gpu
def test_00_2_on_a_gpu_runs_and_catches_a_missing_grid_stride_loop():
    ns = solution("00_gpu_orientation")
    assert ck.check_bias_add(ns["bias_add_hip"], arrays="cupy", seed=1, quiet=True).status == "correct"
    src = ns["bias_add_source"]().replace("i += stride", "i += n")

    def one_pass(inp, bias, out):
        kernel = hip.kernel_from_source(src, "bias_add")
        N, C = out.shape
        kernel((min(4096, (N * C + 255) // 256),), (256,), (inp, bias, out, np.int64(N * C), np.int32(C)))

    wrong(ck.check_bias_add(one_pass, arrays="cupy", seed=1, quiet=True), "grid-stride")


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
])
def test_02_2_tile_mistakes_are_named(variant, words):
    wrong(ck.check_dweight_tiled(dweight_variant(variant), arrays="numba", seed=4, quiet=True), *words)


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
# 03.1 row max, block tree (Numba)
# ------------------------------------------------------------------------------------------------------------
def row_max_variant(variant):
    ns = solution("03_softmax_backward")
    T = ns["THREADS"]

    @cuda.jit
    def kernel(x, m):
        part = cuda.shared.array(T, float32)
        N, n = x.shape
        t = cuda.threadIdx.x
        first = cuda.blockIdx.x
        for row in range(first, N if variant != "no_row_loop" else first + 1, cuda.gridDim.x):
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
            s = cuda.blockDim.x // 2
            while s > 0:
                if t < s:
                    part[t] = part[t] + part[t + s] if variant == "sum" else max(part[t], part[t + s])
                if variant != "no_barrier":
                    cuda.syncthreads()
                s //= 2
            if t == 0:
                m[row] = part[0]
            cuda.syncthreads()

    def launch(x, m):
        kernel[min(x.shape[0], ns["MAX_BLOCKS"]), T](x, m)
    return launch


@numba_ok
def test_03_1_solution_is_correct():
    ns = solution("03_softmax_backward")
    assert ck.check_row_max(ns["row_max"], arrays="numba", seed=7, quiet=True).status == "correct"


@numba_ok
@pytest.mark.parametrize("variant, words", [
    ("zero_start", ["-inf"]),
    ("no_stride", ["first 32 columns"]),
    ("sum", ["row sum"]),
    ("no_row_loop", ["never written", "loop over rows"]),
    ("no_barrier", ["barrier"]),
])
def test_03_1_mistakes_are_named(variant, words):
    wrong(ck.check_row_max(row_max_variant(variant), arrays="numba", seed=7, quiet=True), *words)


# ------------------------------------------------------------------------------------------------------------
# 03.2 softmax backward, one warp per row with shuffles (Numba, in the simulator through simwarp)
# ------------------------------------------------------------------------------------------------------------
def warp_variant(variant):
    ns = solution("03_softmax_backward")

    @cuda.jit
    def kernel(dout, out, dinp):
        N, n = dout.shape
        lane = cuda.threadIdx.x % 32
        warp = (cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x) // 32
        n_warps = cuda.gridDim.x * cuda.blockDim.x // 32
        for row in range(warp, N if variant != "no_row_loop" else min(warp + 1, N), n_warps):
            s = float32(0.0)
            if variant == "first_32":                  # drops the columns past the first 32 lanes
                if lane < n:
                    s = out[row, lane] * dout[row, lane]
            elif variant == "no_tail":                 # only whole chunks of 32 columns
                for j0 in range(0, n - n % 32, 32):
                    s += out[row, j0 + lane] * dout[row, j0 + lane]
            else:
                for j in range(lane, n, 32):
                    s += out[row, j] * dout[row, j]
            if variant == "down_no_broadcast":
                off = 16
                while off > 0:
                    s += cuda.shfl_down_sync(0xFFFFFFFF, s, off)
                    off //= 2
            else:
                off = 8 if variant == "16_lanes" else 16
                while off > 0:
                    s += cuda.shfl_xor_sync(0xFFFFFFFF, s, off)
                    off //= 2
            if variant == "writes_first_32":
                if lane < n:
                    dinp[row, lane] = out[row, lane] * (dout[row, lane] - s)
            else:
                for j in range(lane, n, 32):
                    dinp[row, j] = out[row, j] * (dout[row, j] - s)

    @cuda.jit
    def exits_early(dout, out, dinp):
        N, n = dout.shape
        lane = cuda.threadIdx.x % 32
        warp = (cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x) // 32
        n_warps = cuda.gridDim.x * cuda.blockDim.x // 32
        for row in range(warp, N, n_warps):
            if lane >= n:                              # lanes without a column leave: the shuffle misses them
                return
            s = out[row, lane] * dout[row, lane]
            for j in range(lane + 32, n, 32):
                s += out[row, j] * dout[row, j]
            off = 16
            while off > 0:
                s += cuda.shfl_xor_sync(0xFFFFFFFF, s, off)
                off //= 2
            for j in range(lane, n, 32):
                dinp[row, j] = out[row, j] * (dout[row, j] - s)

    k = exits_early if variant == "exits_early" else kernel

    def launch(dout, out, dinp):
        T = ns["WARP_THREADS"]
        N = dout.shape[0]
        k[min(ns["MAX_BLOCKS"], (N + T // 32 - 1) // (T // 32)), T](dout, out, dinp)
    return launch


@numba_ok
def test_03_2_solution_is_correct_in_the_simulator_too():
    ns = solution("03_softmax_backward")
    r = ck.check_softmax_backward_warp(ns["softmax_backward_warp"], arrays="numba", seed=8, quiet=True)
    assert r.status == "correct", r.message


@numba_ok
@pytest.mark.parametrize("variant, words", [
    ("first_32", ["only columns 0..31"]),
    ("no_tail", ["tail"]),
    ("down_no_broadcast", ["lane 0"]),
    ("16_lanes", ["only 16 lanes"]),
    ("writes_first_32", ["never written", "not only the first 32"]),
    ("no_row_loop", ["never written", "each warp must loop over rows"]),
    ("exits_early", ["returned from the kernel", "every lane named in the mask"]),
])
def test_03_2_warp_mistakes_are_named(variant, words):
    wrong(ck.check_softmax_backward_warp(warp_variant(variant), arrays="numba", seed=8, quiet=True), *words)


def test_03_2_cases_cover_every_row_length_a_warp_gets_wrong():
    for size in ("small", "large"):
        ns_ = [n for _, n in ck.CASES["softmax_backward"][size]]
        assert 1 in ns_ and any(1 < n < 32 for n in ns_) and any(n > 64 and n % 32 for n in ns_), ns_
        assert any(n > 32 and n % 32 for n in ns_)


# ------------------------------------------------------------------------------------------------------------
# 03.3 the warp reduction in portable HIP (32 and 64 lanes)
# ------------------------------------------------------------------------------------------------------------
@no_gpu
def test_03_3_solution_compiles_for_both_vendors_and_lints_clean():
    ns = solution("03_softmax_backward")
    fn, good = ns["softmax_backward_warp_hip"], ns["softmax_backward_warp_source"]
    r = ck.check_softmax_backward_warp(fn, arrays="cupy", source=good, entries="softmax_backward_warp", quiet=True)
    assert r.status == "compiled", r.message


@no_gpu
def test_03_3_a_hard_coded_32_lane_mask_is_wrong_with_the_lint_finding():
    ns = solution("03_softmax_backward")
    bad = ns["softmax_backward_warp_source"]().replace("shfl_xor(s, offset, warpSize)",
                                                        "__shfl_xor_sync(0xffffffff, s, offset)")
    wrong(ck.check_softmax_backward_warp(ns["softmax_backward_warp_hip"], arrays="cupy", source=bad,
                                         entries="softmax_backward_warp", quiet=True), "32-lane mask 0xffffffff")


def test_03_3_the_lint_rejects_every_32_lane_assumption():
    ns = solution("03_softmax_backward")
    good = ns["softmax_backward_warp_source"]()
    assert hip.lint_source(good) == []
    for old, new, says in [
        ("threadIdx.x % warpSize", "threadIdx.x % 32", "% 32"),
        ("threadIdx.x / warpSize", "threadIdx.x / 32", "/ 32"),
        ("offset = warpSize / 2", "offset = 16", "offset 16"),
        ("shfl_xor(s, offset, warpSize)", "shfl_xor(s, offset, 32)", "width 32"),
        ("shfl_xor(s, offset, warpSize)", "__shfl_xor_sync(0xffffffff, s, offset)", "0xffffffff"),
    ]:
        assert old in good
        findings = hip.lint_source(good.replace(old, new))
        assert any(says in f for f in findings), (new, findings)


def test_03_3_portable_h_warp_sum_is_not_the_answer():
    ns = solution("03_softmax_backward")
    good = ns["softmax_backward_warp_source"]()
    loop = "for (int offset = warpSize / 2; offset > 0; offset /= 2) s += shfl_xor(s, offset, warpSize);"
    assert loop in good
    r = ck.check_softmax_backward_warp(ns["softmax_backward_warp_hip"], arrays="cupy",
                                       source=good.replace(loop, "s = warp_sum(s);"),
                                       entries="softmax_backward_warp", quiet=True)
    wrong(r, "shuffle loop itself")


@pytest.mark.gpu
def test_03_3_on_a_gpu_runs_and_names_a_lane_0_only_reduction():
    ns = solution("03_softmax_backward")
    r = ck.check_softmax_backward_warp(ns["softmax_backward_warp_hip"], arrays="cupy", seed=9, quiet=True)
    assert r.status == "correct", r.message
    src = ns["softmax_backward_warp_source"]().replace("shfl_xor(s, offset, warpSize)", "shfl_down(s, offset, warpSize)")

    def lane0(dout, out, dinp):
        kernel = hip.kernel_from_source(src, "softmax_backward_warp")
        N, n = dout.shape
        kernel((min(4096, (N + 7) // 8),), (256,), (dout, out, dinp, np.int32(N), np.int32(n)))

    wrong(ck.check_softmax_backward_warp(lane0, arrays="cupy", seed=9, quiet=True), "lane 0")


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
