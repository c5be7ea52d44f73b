"""Graded tasks 14.1-14.2 (a matrix product with its epilogue fused in: cuBLASLt's GELU_AUX_BIAS and DGELU_BGRAD,
written by hand in Numba): the solutions pass on fresh seeds in the simulator, plausible wrong answers fail with a hint
naming them, and the checkers report what the learner's code raised instead of raising it. On a GPU the same tests
run the kernels there, at the checkers' GPU sizes.

A wrong answer is the solution with one edit (run in the simulator), or, for the finer points of the comparison (a
rounding that truncates, GELU with erf, a dbias summed from rounded values), a NumPy stand-in of the same contract:
the checkers take arrays="numpy" as well, and a stand-in runs in milliseconds.
"""

import math

import ml_dtypes
import numpy as np
import pytest

from gpullm_lessons import device
from gpullm_lessons.checks import epilogue
from gpullm_lessons.checks.epilogue import check_matmul_bias_gelu, check_matmul_dgelu_bgrad

from conftest import quiet_solution_namespace, wrong

NAME = "14_past_torch_compile"


def edited(cell, *edits):
    """The solution namespace with edits (old, new) in one cell."""
    return quiet_solution_namespace(NAME, cell, *edits)


@pytest.fixture(scope="module")
def ns():
    return edited("e14-t1-code")


def fwd(fn, seed=3, **kw):
    return check_matmul_bias_gelu(fn, seed=seed, quiet=True, **kw)


def bwd(fn, seed=3, **kw):
    return check_matmul_dgelu_bgrad(fn, seed=seed, quiet=True, **kw)


@pytest.mark.parametrize("seed", [0, 1])
def test_solutions_pass(ns, seed):
    assert fwd(ns["matmul_bias_gelu"], seed).status == "correct"
    r = bwd(ns["matmul_dgelu_bgrad"], seed)
    assert r.status == "correct", r.message


# ---- NumPy stand-ins of the contracts: the checker's comparison and hints, quickly ----------------------------------
def f32(bits):
    return epilogue.bf16_values(bits).astype(np.float32)


def rne(x32):
    return np.asarray(x32, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def gelu32(x, erf=False):
    x = np.asarray(x, np.float32)
    if erf:
        return (0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2.0)))).astype(np.float32)
    s = np.float32(math.sqrt(2 / math.pi))
    return (np.float32(0.5) * x * (np.float32(1) + np.tanh(s * (x + np.float32(0.044715) * x * x * x)))).astype(
        np.float32
    )


def np_forward(bias_mode="col", aux_mode="pre", rounding="rne", erf=False, k_tile=None, rows=None):
    def fn(a, w, bias, aux, out):
        A, W = f32(a), f32(w)
        K = A.shape[1]
        if k_tile:
            K = K - K % k_tile
        pre = A[:, :K] @ W[:K]
        if bias_mode == "col":
            pre = pre + bias
        elif bias_mode == "twice":
            pre = pre + 2 * bias
        elif bias_mode == "after":
            pre = gelu32(pre) + bias
        elif bias_mode == "row":
            pre = pre + bias[: pre.shape[0]][:, None]
        g = gelu32(pre, erf)
        n = pre.shape[0] if rows is None else rows
        aux[:n] = g[:n] if aux_mode == "gelu" else pre[:n]
        out[:n] = rne(g)[:n] if rounding == "rne" else (g.view(np.uint32) >> 16).astype(np.uint16)[:n]

    return fn


def test_a_numpy_stand_in_passes():
    for seed in range(4):
        assert fwd(np_forward(), seed, arrays="numpy").status == "correct"


@pytest.mark.parametrize(
    "kw, words",
    [
        ({"bias_mode": "none"}, ["aux", "without the bias"]),
        ({"bias_mode": "twice"}, ["bias was added twice"]),
        ({"bias_mode": "after"}, ["added after gelu"]),
        ({"aux_mode": "gelu"}, ["aux holds gelu's output"]),
        ({"rounding": "trunc"}, ["out at", "truncated", "nearest"]),
        ({"erf": True}, ["out at", "erf"]),
        ({"k_tile": 16}, ["last partial tile of the reduction"]),
        ({"rows": 16}, ["never written", "row 16"]),
    ],
)
def test_14_1_wrong_stand_ins_fail_with_their_hint(kw, words):
    r = fwd(np_forward(**kw), 5, arrays="numpy")
    wrong(r, *words)


def test_14_1_row_indexed_bias_is_named():
    found = 0
    for seed in range(12):   # the row-indexed bias can only be told where M <= P
        r = fwd(np_forward(bias_mode="row"), seed, arrays="numpy")
        assert r.status in ("wrong", "error"), r.message
        found += "indexed by the row" in (r.hint or "")
    assert found


def test_14_1_changed_inputs_are_named():
    def fn(a, w, bias, aux, out):
        np_forward()(a, w, bias, aux, out)
        bias[:] = 0

    wrong(fwd(fn, arrays="numpy"), "an input was changed")


def np_backward(gelu_mode="full", sums="exact", add=False, p_tile=None, rounding="rne"):
    def fn(dy, w, aux, dpre, dbias):
        D, W = f32(dy), f32(w)
        P = D.shape[1] - (D.shape[1] % p_tile if p_tile else 0)
        dh = D[:, :P] @ W[:, :P].T
        x = aux.astype(np.float64)
        t = np.tanh(epilogue.S2PI * (x + 0.044715 * x**3))
        gp = {
            "full": epilogue.gelu_tanh_grad(x),
            "first": 0.5 * (1 + t),
            "none": np.ones_like(x),
            "gelu": epilogue.gelu_tanh(x),
        }[gelu_mode]
        g = (dh * gp).astype(np.float32)
        dpre[:] = rne(g) if rounding == "rne" else (g.view(np.uint32) >> 16).astype(np.uint16)
        s = (f32(rne(g)) if sums == "rounded" else g).sum(axis=0, dtype=np.float32)
        if add:
            dbias += s
        else:
            dbias[:] = s

    return fn


def test_a_numpy_stand_in_of_the_backward_passes():
    for seed in range(4):
        r = bwd(np_backward(), seed, arrays="numpy")
        assert r.status == "correct", r.message


@pytest.mark.parametrize(
    "kw, words",
    [
        ({"gelu_mode": "none"}, ["dpre", "dy @ w.t alone"]),
        ({"gelu_mode": "first"}, ["second term"]),
        ({"gelu_mode": "gelu"}, ["derivative"]),
        ({"rounding": "trunc"}, ["dpre", "nearest"]),
        ({"sums": "rounded"}, ["dbias", "rounded values"]),
        ({"add": True}, ["dbias", "added into"]),
        ({"p_tile": 16}, ["dpre"]),
    ],
)
def test_14_2_wrong_stand_ins_fail_with_their_hint(kw, words):
    wrong(bwd(np_backward(**kw), 5, arrays="numpy"), *words)


def test_14_2_sums_whose_order_changes_are_caught():
    calls = []

    def fn(dy, w, aux, dpre, dbias):
        np_backward()(dy, w, aux, dpre, dbias)
        calls.append(1)
        if len(calls) == 4:          # the first inputs again: last bits differ, as atomics' order would make them
            dbias.view(np.uint32)[0] ^= 1

    wrong(bwd(fn, arrays="numpy"), "differs in its last bits", "fixed order")


def test_the_comparison_accepts_a_neighbour_only_at_a_midpoint():
    x = np.array([1.0 + 2**-8, 1.0 + 2**-8 + 2**-12, 3.0], np.float64)   # a tie, above a tie, exact
    want = rne(x.astype(np.float32))
    ok, nearest = epilogue._bits_ok(want, x)
    assert ok.all() and np.array_equal(nearest, want)
    other = want.copy()
    other[0] += 1                      # the tie's other neighbour: within float32's reach of the midpoint
    other[1] -= 1                      # above the tie by 2^-12: float32 cannot land below it
    other[2] += 1
    ok, _ = epilogue._bits_ok(other, x)
    assert ok.tolist() == [True, False, False]


# ---- the solution with one edit, in the simulator ---------------------------------------------------------------------
T1 = "e14-t1-code"
T2 = "e14-t2-code"
OUT_LINE = "out[i, j] = f32_to_bf16_bits(numba.float32(0.5) * x * (numba.float32(1.0) + t))"


@pytest.mark.parametrize(
    "cell, old, new, words",
    [
        (T1, "x = acc + bias[j]", "x = acc", ["without the bias"]),
        (T1, "aux[i, j] = x", "aux[i, j] = numba.float32(0.5) * x * (numba.float32(1.0) + math.tanh(S2PI * (x + C3 * "
         "x * x * x)))", ["aux holds gelu's output"]),
        (T1, OUT_LINE, "out[i, j] = numba.uint16(numba.uint32(libdevice.float_as_int(numba.float32(0.5) * x * "
         "(numba.float32(1.0) + t))) >> numba.uint32(16))", ["truncated"]),
        (T1, "for k0 in range(0, K, TILE):", "for k0 in range(0, K - K % TILE, TILE):",
         ["last partial tile of the reduction"]),
        (T1, "i = cuda.blockIdx.y * TILE + ty ", "i = ty ", ["never written"]),
        pytest.param(T1, "if i < M and k0 + tx < K else", "if k0 + tx < K else", ["IndexError"],
                     marks=pytest.mark.skipif(device.numba_on_gpu(), reason="the simulator's bounds check: a GPU reads "
                                              "past the array without an error")),
        (T2, "g = acc * grad", "g = acc", ["dy @ w.t alone"]),
        (T2, "grad = half * (one + t) + half * x * (one - t * t) * S2PI * (one + numba.float32(3.0) * C3 * x * x)",
         "grad = half * (one + t)", ["second term"]),
        (T2, "gs[ty, tx] = g", "gs[ty, tx] = bf16_value(f32_to_bf16_bits(g))", ["rounded values"]),
        (T2, "dbias[k] = s", "dbias[k] += s", ["dbias", "added into"]),
    ],
)
def test_wrong_kernels_fail_with_their_hint(cell, old, new, words):
    n = edited(cell, (old, new))
    check = fwd if cell == T1 else bwd
    r = check(n["matmul_bias_gelu" if cell == T1 else "matmul_dgelu_bgrad"])
    wrong(r, *words)


def test_an_unfinished_kernel_is_not_attempted():
    n = edited(T1, ("    M, K = a.shape\n", "    raise NotImplementedError('exercise: write this part')\n    M, K = a.shape\n"))
    r = fwd(n["matmul_bias_gelu"])
    assert r.status == "not attempted", r.message


def test_a_kernel_instead_of_its_launcher_is_refused(ns):
    with pytest.raises(TypeError, match="pass the launcher"):
        fwd(ns["matmul_bias_gelu_kernel"])


def test_an_answer_built_on_the_courses_own_kernels_is_refused_when_graded():
    from gpullm_lessons.kernels.numba import fused

    def fn(a, w, bias, aux, out):
        import numpy as np

        fused.bias_gelu_forward(f32(a) @ f32(w), bias, aux, np.zeros(aux.shape, np.float32))

    r = fwd(fn, arrays="numpy", task="14.1 test")
    wrong(r, "course's own implementation")
