"""Graded tasks 11.1-11.4 (flash attention): the solutions pass, plausible wrong answers fail with a hint naming them.

A wrong answer is the solution with one edit (conftest.solution_namespace(..., edits=)); the edits that matter only
show past one tile of keys or past one block of query rows (the simulator's third case has T = 37 with tiles of 8 keys
and blocks of 16 rows). Numba kernels run in the CUDA simulator here.
"""

import gpullm_lessons  # noqa: F401  (first: switches the CUDA simulator on before numba loads)
import numpy as np
import pytest

from gpullm_lessons import device
from gpullm_lessons.checks.flash import (
    check_flash_attention_backward,
    check_flash_attention_forward,
    check_flash_attention_forward_packed,
)

from conftest import solution_namespace, wrong

NAME = "11_flash_attention"
SIM = not device.numba_on_gpu()


@pytest.fixture(scope="module")
def ns():
    return solution_namespace(NAME)


def fwd_numpy(ns_, seed=5):
    return check_flash_attention_forward(ns_["flash_forward_numpy"], arrays="numpy", seed=seed, quiet=True)


def fwd_kernel(ns_, seed=5):
    return check_flash_attention_forward(ns_["flash_forward"], arrays="numba", seed=seed, quiet=True)


# ---- 11.1 NumPy over key tiles ------------------------------------------------------------------------------------
def test_11_1_solution_passes(ns):
    r = fwd_numpy(ns)
    assert r.status == "correct", r.message


def test_11_1_solution_passes_on_fresh_seeds(ns):
    for seed in (0, 1, 2):
        r = fwd_numpy(ns, seed)
        assert r.status == "correct", r.message


@pytest.mark.parametrize("old,new,words", [
    ("acc = alpha[..., None] * acc + p @ v", "acc = acc + p @ v", ["running output is not rescaled", "tiles of {TILE} keys"]),
    ("l = alpha * l + p.sum(axis=-1)", "l = l + p.sum(axis=-1)", ["running sum l is not rescaled"]),
    ("acc = alpha[..., None] * acc + p @ v", "acc = p @ v", ["last key tile"]),
    ("scale = 1.0 / math.sqrt(hs)", "scale = 1.0", ["1/sqrt(hs) scale is missing"]),
    ("S = np.where(s <= t, S, -np.inf)", "S = np.where(s <= t + 1, S, -np.inf)", ["off by one", "s = t + 1"]),
    ("lse[...] = m + np.log(l)", "lse[...] = m", ["lse is the row max m only"]),
    ("lse[...] = m + np.log(l)", "lse[...] = np.log(l)", ["without the max"]),
    ("out[...] = acc / l[..., None]", "out[...] = acc", ["not normalised"]),
])
def test_11_1_wrong_answers_fail_with_their_hint(old, new, words):
    ns_ = solution_namespace(NAME, [("e11-t1-code", old, new)])
    wrong(fwd_numpy(ns_), *(w.format(TILE=ns_["TILE"]) for w in words))


def test_11_1_diagonal_excluded_is_named():
    r = fwd_numpy(solution_namespace(NAME, [("e11-t1-code", "S = np.where(s <= t, S, -np.inf)",
                                             "S = np.where(s < t, S, -np.inf)")]))
    wrong(r, "off by one", "yours takes s < t", "row 0 has no key")


# ---- 11.2 the Numba forward kernel -----------------------------------------------------------------------------------
def test_11_2_solution_passes(ns):
    r = fwd_kernel(ns)
    assert r.status == "correct", r.message


def test_11_2_stub_is_not_attempted():
    stub = 'raise NotImplementedError("exercise: write this part")'
    ns_ = solution_namespace(NAME, [("e11-t2-code", "    t_last = min(T, t0 + ROWS) - 1\n    for s0",
                                     f"    {stub}\n    t_last = min(T, t0 + ROWS) - 1\n    for s0")])
    r = fwd_kernel(ns_)
    assert r.status == "not attempted", r.message


@pytest.mark.skipif(not SIM, reason="simulator sizes: the tile and block edges the edits hit")
@pytest.mark.parametrize("old,new,words", [
    # only wrong once a later tile raises a row's max: past the first tile of 8 keys
    ("                for j in range(hs):\n                    acc[j] *= alpha\n", "",
     ["running output is not rescaled"]),
    # only wrong for the rows of a block past its first: the block's tile loop stops at its first row
    ("    t_last = min(T, t0 + ROWS) - 1\n", "    t_last = t0\n", ["tile skipping stops too early", "blocks of 16"]),
    ("alpha = math.exp(m - m_new)\n                l *= alpha", "alpha = math.exp(m - m_new)\n                l *= 1.0",
     ["running sum l is not rescaled"]),
    ("                if s0 + r <= t:\n                    x = numba.float32(0.0)",
     "                if s0 + r <= t + 1 and s0 + r < T:\n                    x = numba.float32(0.0)", ["off by one"]),
    # the running state reset at every key tile: a row with no key in its block's last tile ends with l = 0, and the
    # simulator's log(0) raises (a GPU writes -inf and NaN, which the tile replay names)
    ("        cuda.syncthreads()\n        if t < T:\n            mt = NEG_INF",
     "        cuda.syncthreads()\n        m = NEG_INF\n        l = numba.float32(0.0)\n        for j in range(hs):\n"
     "            acc[j] = numba.float32(0.0)\n        if t < T:\n            mt = NEG_INF",
     ["log(l) with l = 0", "reset"]),
    # the head index lost: every head's block computes head 0 and writes it there
    ("b, h = cuda.blockIdx.y // nh, cuda.blockIdx.y % nh", "b, h = cuda.blockIdx.y // nh, 0",
     ["only head 0 of out was written"]),
    # no barrier after a key tile's products: the next tile's loads overwrite kt, vt while others still read them
    ("                m = m_new\n        cuda.syncthreads()\n", "                m = m_new\n",
     ["a missing barrier in flash_forward_kernel", "between the same two barriers"]),
])
def test_11_2_wrong_kernels_fail_with_their_hint(old, new, words):
    # the mask edit must change both of its places (scores and additions) to be the plausible mistake
    edits = [("e11-t2-code", old, new)]
    if "t + 1" in new:
        edits.append(("e11-t2-code", "                    if s0 + r <= t:\n                        p =",
                      "                    if s0 + r <= t + 1 and s0 + r < T:\n                        p ="))
    r = fwd_kernel(solution_namespace(NAME, edits))
    wrong(r, *words)


@pytest.mark.skipif(not SIM, reason="the simulator raises on an index past the array; a GPU reads it silently")
def test_11_2_unguarded_tile_load_is_an_error_naming_the_thread():
    ns_ = solution_namespace(NAME, [("e11-t2-code", "kt[r, j] = k[b, h, s, j] if s < T else numba.float32(0.0)",
                                     "kt[r, j] = k[b, h, s, j]")])
    r = fwd_kernel(ns_)
    assert r.status == "error" and "thread" in r.message and "IndexError" in r.message, r.message


# ---- 11.3 the dQ kernel ---------------------------------------------------------------------------------------------
def bwd(ns_, seed=5):
    return check_flash_attention_backward(ns_["flash_backward"], arrays="numba", seed=seed, quiet=True)


def test_11_3_solution_passes_with_determinism_checked(ns):
    r = bwd(ns)
    assert r.status == "correct" and "same bits twice" in r.message, r.message


@pytest.mark.parametrize("old,new,words", [
    ("            dq[b, h, t, j] = dqr[j] * scale", "            dq[b, h, t, j] = dqr[j]", ["dq is missing"]),
    ("ds = math.exp(x - lt) * (dp - dl)", "ds = math.exp(x - lt) * dp", ["row term"]),
    ("b, h = cuda.blockIdx.y // nh, cuda.blockIdx.y % nh", "b, h = cuda.blockIdx.y // nh, 0",
     ["only head 0 of dq was written"]),
])
def test_11_3_wrong_dq_fails_with_its_hint(old, new, words):
    wrong(bwd(solution_namespace(NAME, [("e11-t3-code", old, new)])), *words)


@pytest.mark.skipif(not SIM, reason="the trace of float atomics runs in the simulator")
def test_11_3_float_atomics_fail_even_when_the_values_are_right():
    ns_ = solution_namespace(NAME, [("e11-t3-code", "            dq[b, h, t, j] = dqr[j] * scale",
                                     "            dq[b, h, t, j] = 0.0\n"
                                     "            cuda.atomic.add(dq, (b, h, t, j), dqr[j] * scale)")])
    r = bwd(ns_)
    assert r.status == "wrong" and "atomic" in r.message.lower(), r.message


def test_checker_rejects_the_answer_of_an_earlier_call():
    """A function that caches its first result passes case 1 and must fail case 2 (same shapes, new values)."""
    cache = {}

    def stale(q, k, v, out, lse):
        if "out" not in cache:
            from gpullm_lessons.checks.flash import _forward, _make  # noqa: F401
            S = (q.astype(np.float64) @ k.astype(np.float64).swapaxes(-1, -2)) / np.sqrt(q.shape[-1])
            T = q.shape[2]
            S = np.where(np.tril(np.ones((T, T), bool)), S, -np.inf)
            m = S.max(-1, keepdims=True)
            e = np.exp(S - m)
            cache["out"] = (e / e.sum(-1, keepdims=True)) @ v
            cache["lse"] = (m + np.log(e.sum(-1, keepdims=True)))[..., 0]
        if cache["out"].shape == out.shape:
            out[...] = cache["out"]
            lse[...] = cache["lse"]

    r = check_flash_attention_forward(stale, arrays="numpy", seed=2, quiet=True)
    wrong(r, "EARLIER call")


# ---- 11.4 the forward on the engine's layout ------------------------------------------------------------------------
def fwd_packed(ns_, seed=5):
    return check_flash_attention_forward_packed(ns_["flash_forward_packed"], arrays="numba", seed=seed, quiet=True)


def test_11_4_solution_passes(ns):
    r = fwd_packed(ns)
    assert r.status == "correct", r.message


def test_11_4_stub_is_not_attempted():
    stub = 'raise NotImplementedError("exercise: write this part")'
    ns_ = solution_namespace(NAME, [("e11-t4-code", "    t_last = min(T, t0 + ROWS) - 1\n    for s0",
                                     f"    {stub}\n    t_last = min(T, t0 + ROWS) - 1\n    for s0")])
    r = fwd_packed(ns_)
    assert r.status == "not attempted", r.message


@pytest.mark.skipif(not SIM, reason="simulator sizes: the tile and block edges the edits hit")
@pytest.mark.parametrize("edits,words", [
    ([("qkv[b, t, h * hs + j]", "qkv[b, t, j]"), ("qkv[b, s, C + h * hs + j]", "qkv[b, s, C + j]"),
      ("qkv[b, s, 2 * C + h * hs + j]", "qkv[b, s, 2 * C + j]")], ["head 0's columns"]),
    ([("qkv[b, s, C + h * hs + j]", "qkv[b, s, hs + h * hs + j]"),
      ("qkv[b, s, 2 * C + h * hs + j]", "qkv[b, s, 2 * hs + h * hs + j]")], ["hs columns after q"]),
    ([("qkv[b, s, C + h * hs + j]", "qkv[b, s, 2 * C + h * hs + j] if s < T else numba.float32(0.0)\n"
       "            vt[r, j] = qkv[b, s, C + h * hs + j]")], ["k and v are swapped"]),
    ([("for s0 in range(0, t_last + 1, TILE):", "for s0 in range(0, t0 + 1, TILE):")],
     ["tile skipping stops too early"]),
])
def test_11_4_wrong_kernels_fail_with_their_hint(edits, words):
    ns_ = solution_namespace(NAME, [("e11-t4-code", old, new) for old, new in edits])
    wrong(fwd_packed(ns_), *words)
