"""The checkers at their edges: each case added for an edge of a task's contract, with a wrong answer that only that
case catches (every one of them passed the checkers before the case was added).

- a missing barrier the simulator's order of threads hides (03.1): the first call of a shared-memory kernel is
  traced, and a shared slot one thread wrote and another read between the same two barriers fails; where a missing
  barrier gives wrong values (04.1, 05.2; 02.2, 03.1 and 11.2 in their tasks' tests), the hint names it instead of
  the op's formula or a generic "check the barriers";
- state kept between calls: the kernel checkers' last case repeats an earlier shape with new values (00.1, 02.2),
  and an answer that adds onto a buffer it keeps is told so, on a repeated shape or on the repeat of the same inputs
  (04.2);
- a callback's returned array: 12.1's grad_fn may return one array, refilled on every call (the contract says so), and
  the checker's last call hands over such a grad_fn;
- zeros where the contract defines them: 06.1's parameters that decay but got no gradient still move.
"""

import gpullm_lessons  # noqa: F401  (first: the simulator before numba)
import numpy as np
import pytest
from numba import cuda, float32

from gpullm_lessons import device
from gpullm_lessons.checks import kernels as K
from gpullm_lessons.checks.backward import check_layernorm_backward
from gpullm_lessons.checks.ops import check_crossentropy_online, check_layernorm_dparams
from gpullm_lessons.checks.optim import check_adamw_mixed
from gpullm_lessons.checks.scale import check_accumulate

from conftest import solution_namespace, wrong

SIM = not device.numba_on_gpu()
sim_only = pytest.mark.skipif(not SIM, reason="the trace of shared memory runs in the simulator")


# ---- a missing barrier ---------------------------------------------------------------------------------------------
THREADS = 24     # 03.1's block in the simulator


@cuda.jit
def seeded_row_max(x, m):
    """03.1 with every thread's max started from the row's first value, which thread 0 puts in shared memory: no
    barrier between that write and the other threads' reads. In the simulator thread 0 runs first, so the values
    come out right; on a GPU a thread can read the slot before thread 0 wrote it (the previous row's value)."""
    part = cuda.shared.array(THREADS, float32)
    first = cuda.shared.array(1, float32)
    N, n = x.shape
    t = cuda.threadIdx.x
    for row in range(cuda.blockIdx.x, N, cuda.gridDim.x):
        if t == 0:
            first[0] = x[row, 0]
        v = first[0]
        for j in range(t, n, cuda.blockDim.x):
            v = max(v, x[row, j])
        part[t] = v
        cuda.syncthreads()
        active = cuda.blockDim.x
        while active > 1:
            half = (active + 1) // 2
            if t + half < active:
                part[t] = max(part[t], part[t + half])
            cuda.syncthreads()
            active = half
        if t == 0:
            m[row] = part[0]
        cuda.syncthreads()


@sim_only
def test_a_missing_barrier_the_simulator_hides_fails():
    r = K.check_row_max(lambda x, m: seeded_row_max[min(x.shape[0], 2), THREADS](x, m), arrays="numba", seed=0,
                        quiet=True)
    wrong(r, "a missing barrier in seeded_row_max", "wrote first[0]", "read it between the same two barriers")


@sim_only
@pytest.mark.parametrize("name,cell,old,new,check,fn", [
    # 04.1: no barrier between the partial sums' stores and the tree
    ("04_layernorm_backward", "72e92837", "    buf_gx[tid] = own_gx\n    cuda.syncthreads()\n",
     "    buf_gx[tid] = own_gx\n", check_layernorm_backward, "layernorm_backward"),
    # 05.2: no barrier after each step of the merge tree
    ("05_gelu_attention_cross_entropy", "s05-03", "            sh_max[tid] = m_new\n        cuda.syncthreads()\n",
     "            sh_max[tid] = m_new\n", check_crossentropy_online, "crossentropy_backward"),
])
def test_a_missing_barrier_that_gives_wrong_values_is_named(name, cell, old, new, check, fn):
    ns = solution_namespace(name, [(cell, old, new)])
    wrong(check(ns[fn], arrays="numba", seed=1, quiet=True), "a missing barrier in", "between the same two barriers")


# ---- state kept between calls --------------------------------------------------------------------------------------
def test_a_result_cached_by_shape_fails_on_the_repeated_shape():
    """00.1: a launcher that computes each shape once (the shapes were all different)."""
    cache = {}

    def bias_add(inp, bias, out):
        if inp.shape not in cache:
            cache[inp.shape] = inp + bias
        out[...] = cache[inp.shape]

    wrong(K.check_bias_add(bias_add, arrays="numpy", seed=2, quiet=True), "EARLIER call")


def test_a_scratch_buffer_added_into_across_calls_is_named():
    """02.2: partial products added into a buffer kept per shape and never zeroed: right on the first call of each
    shape, the earlier call's answer added on the repeated shape."""
    scratch = {}

    def dweight_tiled(inp, dout, dweight):
        acc = scratch.setdefault(dweight.shape, np.zeros(dweight.shape))
        acc += inp.astype(np.float64).T @ dout
        dweight[...] = acc

    r = K.check_dweight_tiled(dweight_tiled, arrays="numpy", seed=2, quiet=True)
    wrong(r, "PLUS the right answer of an EARLIER call", "without setting it to 0 first")
    assert "case 4 of 4" in r.message, r.message


def test_a_second_call_that_adds_onto_the_first_is_named_not_blamed_on_scheduling():
    """04.2: the column sums added into a buffer kept per shape: every shape is right once, and the repeat of the
    last case (the same inputs, for the same bits) gives twice the first."""
    scratch = {}

    def layernorm_dparams(dout, inp, mean, rstd, dweight, dbias):
        w, b = scratch.setdefault(dweight.shape, (np.zeros(dweight.shape, np.float32),
                                                  np.zeros(dbias.shape, np.float32)))
        xhat = (inp - mean[:, None]) * rstd[:, None]
        w += (dout * xhat).sum(axis=0)
        b += dout.sum(axis=0)
        dweight[...], dbias[...] = w, b

    r = check_layernorm_dparams(layernorm_dparams, arrays="numpy", seed=2, quiet=True)
    wrong(r, "twice what the first gave", "without setting it to 0 first")
    assert "order in which threads" not in r.hint, r.hint


# ---- a callback that reuses the array it returns (12.1) ------------------------------------------------------------
def kept_arrays(grad_fn, x, y, K):
    """Keeps each micro-batch's gradient array as grad_fn returned it and sums them at the end."""
    b = x.shape[0] // K
    parts = [grad_fn(x[i * b:(i + 1) * b], y[i * b:(i + 1) * b]) for i in range(K)]
    return sum(loss for loss, _ in parts) / K, sum(g for _, g in parts) / K


def first_array_as_accumulator(grad_fn, x, y, K):
    """Adds every later micro-batch into the array the first call returned."""
    b = x.shape[0] // K
    loss, acc = 0.0, None
    for i in range(K):
        li, gi = grad_fn(x[i * b:(i + 1) * b], y[i * b:(i + 1) * b])
        loss += li / K
        if acc is None:
            acc = gi
            acc /= K
        else:
            acc += gi / K
    return loss, acc


@pytest.mark.parametrize("fn", [kept_arrays, first_array_as_accumulator])
def test_12_1_an_answer_that_keeps_grad_fns_array_fails_on_the_reused_array(fn):
    r = check_accumulate(fn, seed=3, quiet=True)
    wrong(r, "grad_fn returned the same array on every call", "never keep")
    assert "case 7 of 7" in r.message and "reusing its returned array" in r.message, r.message


def test_12_1_the_contract_says_grad_fn_may_reuse_its_array():
    import json
    from conftest import ROOT
    for folder in ("solutions", "exercises"):
        nb = json.loads((ROOT / folder / "12_memory.ipynb").read_text(encoding="utf-8"))
        text = "".join(next("".join(c["source"]) for c in nb["cells"] if c.get("id") == "e12-t1"))
        assert "may return the same array on every call" in " ".join(text.split()), folder


# ---- zeros the contract defines: a parameter with no gradient still moves (06.1) ----------------------------------
@pytest.mark.skipif(not device.numba_available(), reason="Numba kernels need a GPU or the simulator")
def test_06_1_elements_with_a_zero_gradient_still_move():
    """An element whose gradient is 0 left as it was (only its bf16 copy written, to save work): m, v, the step from
    m and the weight decay of those elements are undone. The frozen parameters (no gradient, no decay, m = v = 0) do
    not show it; the cases now also hold decaying parameters with no gradient (an embedding row no token used)."""
    ns = solution_namespace("06_fused_adamw", [(
        "194781a9", "        grad = grads[k] * inv_scale                    # the true gradient (a power of two: exact)\n",
        "        grad = grads[k] * inv_scale                    # the true gradient (a power of two: exact)\n"
        "        if grad == numba.float32(0.0):               # no gradient: only the copy\n"
        "            b = numba.uint32(libdevice.float_as_int(params[k]))\n"
        "            half_out[k] = (b + low + ((b >> u16) & lowbit)) >> u16\n"
        "            continue\n")])
    r = check_adamw_mixed(ns["adamw_step_mixed"], arrays="numba", seed=4, quiet=True)
    wrong(r, "gradient is exactly 0", "AdamW still moves them")
