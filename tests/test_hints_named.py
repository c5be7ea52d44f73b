"""Every named mistake of every task's checker is told by its own hint, never by the checker's generic fallback.

For each task's Op (gpullm_lessons/checks/backward.py, checks/kernels.py, checks/ops.py, checks/flash.py) every entry of its
mistake table is replayed as a NumPy answer through the checker itself (arrays="numpy": fast, no kernel runs): the
answer writes the mistake's outputs, and the right values where the mistake leaves an output alone or does not apply
to a case. A mistake given by its outputs must get exactly its hint. A pattern mistake (a test on the output, whose
hint is written from what it finds: "rows 2..6 were never written", "only the last tile along K") has a producer
here that makes the output it describes, and the words its hint must say. A mistake that the checker's cases cannot
tell from another is listed in SAME_OUTPUT with the reason, and the verdict must name the other one; the catch-all
hints (wrong values with no pattern: what a missing barrier gives on a GPU) are listed in FALLBACKS: they are what a
named mistake must never get. A new mistake without a producer, or an entry here that no longer exists, fails.

The hints that are derived from the pattern of the wrong output whatever the op (only head 0 written or right, -inf
from a log of 0, log(0) raised in a simulated kernel) and the capstone's tables (lesson 09: the block forward, the
block backward, a forward mistake seen by the whole step) are replayed the same way at the end.
"""

import dataclasses
import math
import warnings

import gpullm_lessons  # noqa: F401  (first: the simulator before numba)
import numpy as np
import pytest
from numba import cuda

from gpullm_lessons.checks import backward as checks, opcheck
from gpullm_lessons import device
from gpullm_lessons.checks import capstone as cc
from gpullm_lessons.checks import flash as F
from gpullm_lessons.checks import kernels as K
from gpullm_lessons.checks import ops as O
from gpullm_lessons.engine import capstone

# task -> (checker, the Op it runs, checker keywords)
TASKS = {
    **{name: (checks.CHECKERS[name], op, {}) for name, op in checks._OPS.items()},
    "bias_add": (K.check_bias_add, K._BIAS_ADD, {}),
    "linear_dweight": (K.check_dweight_tiled, K._DWEIGHT, {}),
    "linear_dinp": (K.check_dinp_tiled, K._DINP, {}),
    "row_max": (K.check_row_max, K._ROW_MAX, {}),
    "softmax_forward_warp": (K.check_softmax_forward_warp, K._SOFTMAX_FWD_WARP, {}),
    "layernorm_dparams": (O.check_layernorm_dparams, O._LN_DPARAMS, {}),
    "crossentropy_online": (O.check_crossentropy_online, O._ce_op(), {}),
    "attention_softmax_backward": (O.check_attention_softmax_backward, O._ATT_SOFTMAX, {}),
    "encoder_backward_atomic": (O.check_encoder_backward_atomic, O._enc_op(), {}),
    "encoder_backward_deterministic": (O.check_encoder_backward_deterministic, O._enc_op(O._ENC_DET_DIMS), {}),
    "flash_attention_forward": (F.check_flash_attention_forward, F._FORWARD, {}),
    "flash_attention_backward": (F.check_flash_attention_backward, F._BACKWARD, {}),
    "flash_attention_forward_packed": (F.check_flash_attention_forward_packed, F._PACKED, {}),
}

_CASE = {}   # the case the checker made last, and the op it came from: what an answer replays a mistake on


@pytest.fixture(autouse=True)
def recording(monkeypatch):
    """Every checker's opcheck.run sees an op whose cases are recorded in _CASE before the answer is called."""
    real = opcheck.run

    def run(op, fn, **kw):
        def make(rng, dt, size, k):
            c = op.make(rng, dt, size, k)
            _CASE["case"], _CASE["op"] = c, op
            return c
        return real(dataclasses.replace(op, make=make), fn, **kw)

    for module in (opcheck, checks, K):       # the modules that call run by name
        monkeypatch.setattr(module, "run", run)


def answer(produce):
    """A NumPy answer that writes produce(case, expected) (a dict of outputs; {} or None: the right answer). A NaN
    in a produced output is an element the answer leaves unwritten (it keeps the checker's poison)."""
    def fn(*args):
        c, op = _CASE["case"], _CASE["op"]
        right = op.expected(c)
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            bad = produce(c, {k: np.array(v, dtype=np.float64) for k, v in right.items()}) or {}
        outs = args[len(c.inputs):len(c.inputs) + len(c.outputs)]
        for name, dst in zip(c.outputs, outs):
            value = np.asarray(bad.get(name, right[name]), dtype=np.float64)
            written = ~np.isnan(value)
            dst[written] = value[written]
    return fn


def replay(task, produce, seed=7, size=None):
    check, _, kw = TASKS[task]
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return check(answer(produce), arrays="numpy", seed=seed, size=size, quiet=True, **kw)


# ---- producers of the pattern mistakes: (task, index in the op's mistakes) -> (produce, words its hint says, size) --
def _nan(e, name, index):
    out = e[name].copy()
    out[index] = np.nan
    return {name: out}


def _flat_nan(e, name, sl):
    out = e[name].copy()
    out.reshape(-1)[sl] = np.nan
    return {name: out}


def _carried(row_max, G):
    """Each row's max with the maxes of the rows the same block (of G) took before it."""
    out = row_max.copy()
    for first in range(G):
        out[first::G] = np.maximum.accumulate(row_max[first::G])
    return out


def _k_rows(which):
    return lambda c, rows: K._k_rows(c, which, rows)


def _gemm(which, name, K_of):
    """The pattern producers of a tiled GEMM (K: the reduction's length in a case)."""
    rows = _k_rows(which)
    return {
        2: (lambda c, e: {name: rows(c, range(16))} if K_of(c) > 16 else None, [f"{name} holds only the sum over k = "
                                                                                 "0..15"], None),
        3: (lambda c, e: {name: rows(c, range(16, K_of(c)))} if 16 < K_of(c) < 32 else None,
            [f"{name} holds only the last tile along K", "set back to 0 at every tile"], None),
        # every full tile but the partial one: at the simulator's K (<= 37) that is the first 32, a 32-wide tile's
        # first (and only full) tile, whose hint says the partial tile is left out; the GPU sizes tell them apart
        4: (lambda c, e: {name: rows(c, range(K_of(c) // 16 * 16))} if K_of(c) > 64 and K_of(c) % 16 else None,
            ["leaves out the last, partial tile along K"], "large"),
        5: (lambda c, e: ({name: e[name] + rows(c, range(K_of(c) // 16 * 16 - 16 + K_of(c) % 16, K_of(c) // 16 * 16))}
                          if K_of(c) > 16 and K_of(c) % 16 else None), ["the slots past K still hold the previous "
                                                                         "tile's values"], None),
        6: (lambda c, e: _nan(e, name, (slice(None), -1)), ["were never written, the rest is right"], None),
    }


PRODUCERS = {
    ("linear_backward", 6): (lambda c, e: {"dinp": checks._linear_partial_k(c, "dinp", 16)} if c.dims["OC"] > 16
                             else None, ["your dinp equals the sum over the first 16"], None),
    ("bias_add", 5): (lambda c, e: _nan(e, "out", (slice(None), slice(32, None))) if c.dims["C"] > 32 else None,
                      ["columns 32..36 of every row were never written"], None),
    ("bias_add", 6): (lambda c, e: _flat_nan(e, "out", slice(64, None)) if c.dims["N"] * c.dims["C"] > 64 else None,
                      ["every element past index G = 64 is unwritten"], None),
    ("bias_add", 7): (lambda c, e: _flat_nan(e, "out", slice(-1, None)), ["only the last element of out"], None),
    ("bias_add", 8): (lambda c, e: _flat_nan(e, "out", np.r_[3:6, 10:13]), ["in 2 separate runs"], None),
    **{("linear_dweight", i): p for i, p in _gemm("dweight", "dweight", lambda c: c.dims["N"]).items()},
    **{("linear_dinp", i): p for i, p in _gemm("dinp", "dinp", lambda c: c.dims["OC"]).items()},
    ("row_max", 3): (lambda c, e: {"m": c.x["x"][:, np.isin(np.arange(c.dims["n"]) % 24,
                                                             K._halving_tree_slots(24))].max(axis=1)},
                     ["as if it were a power of two", "blockDim.x = 24"], None),
    ("row_max", 4): (lambda c, e: {"m": c.x["x"][:, :24].max(axis=1)} if c.dims["n"] > 24 else None,
                     ["m is the max of the first 24 columns only"], None),
    ("row_max", 5): (lambda c, e: _nan(e, "m", slice(2, None)) if c.dims["N"] > 3 else None,
                     ["rows 2..6 were never written", "your launch has 2 blocks"], None),
    ("row_max", 6): (lambda c, e: _nan(e, "m", [1, 3]) if c.dims["N"] > 3 else None,
                     ["rows 1, 3 of m were never written"], None),
    ("row_max", 7): (lambda c, e: {"m": _carried(c.x["x"].max(axis=1), 2)},
                     ["every earlier row the same block took", "the grid has 2 blocks"], None),
    ("softmax_forward", 17): (lambda c, e: _nan(e, "out", 0), ["row 0 of out, whose logits are all near +1000"], None),
    ("softmax_forward", 18): (lambda c, e: _nan(e, "out", slice(4, None)) if c.dims["N"] > 5 else None,
                              ["your launch has 4 warps"], None),
    ("softmax_forward", 19): (lambda c, e: _nan(e, "out", [2, 5]) if c.dims["N"] > 5 else None,
                              ["rows 2, 5 of out were never written"], None),
    ("softmax_forward", 20): (lambda c, e: _nan(e, "out", (slice(None), slice(32, None))) if c.dims["n"] > 32 else None,
                              ["columns 32..69 of every row were never written"], None),
}


def _tiled(**kw):
    return lambda c, e: dict(zip(("out", "lse"), F._tiled(c, 8, **kw)))


def _packed(**kw):
    def produce(c, e):
        out, lse = F._tiled(c, 8, **kw)
        return {"out": F._merge(out), "lse": lse}
    return produce


def _diagonal_excluded(c, e):
    P, lse = F._softmax_rows(F._scores(c, shift=-1))
    return {"out": P @ c.x["v"], "lse": lse}


PRODUCERS.update({
    ("flash_attention_forward", 0): (_tiled(rescale_acc=False), ["running output is not rescaled"], None),
    ("flash_attention_forward", 1): (_tiled(rescale_l=False), ["running sum l is not rescaled"], None),
    ("flash_attention_forward", 2): (_tiled(rescale_acc=False, rescale_l=False), ["neither the running sum"], None),
    ("flash_attention_forward", 3): (_tiled(accumulate="seen"), ["keeps only the last key tile's p v"], None),
    ("flash_attention_forward", 4): (_tiled(accumulate="always", rows=16),
                                     ["keeps only the last key tile's p v", "set to 0 (or replaced) at every"], None),
    ("flash_attention_forward", 5): (_tiled(accumulate="reset", rows=16),
                                     ["running state (m, l and acc) is set back", "l = 0"], None),
    ("flash_attention_forward", 6): (_tiled(BR=16), ["tile skipping stops too early", "blocks of 16 rows"], None),
    ("flash_attention_forward", 7): (_diagonal_excluded, ["yours takes s < t, so row 0 has no key"], None),
    ("flash_attention_forward_packed", 3): (_packed(BR=16), ["tile skipping stops too early"], None),
    ("flash_attention_forward_packed", 4): (_packed(rescale_acc=False), ["running output is not rescaled"], None),
})

# (task, index) -> (task, index of the mistake the verdict names instead, why the cases cannot tell them apart)
SAME_OUTPUT = {
    ("softmax_forward_warp", 15): (6, "a 64-lane warp that reduces only columns 0..63 and a 32-lane warp that drops "
                                       "the tail past the last full 32 give the same output at n = 70, the only case "
                                       "longer than 64 (both see columns 0..63)"),
    ("softmax_forward_warp", 16): (6, "the 64-lane and the 32-lane tail mistakes both see columns 0..63 at n = 70, "
                                       "and at n = 37 a 64-lane warp has no tail"),
}
# (task, index) of the catch-all hints: wrong values in no known pattern. The verdict falls back to them; no wrong
# output stands for them (a missing barrier gives values that depend on the scheduling).
FALLBACKS = {("linear_dweight", 7), ("linear_dinp", 7), ("row_max", 8)}
GENERIC = ("with no pattern of a known mistake", "does your grid (or loop) cover every element",
           "a loop bound or grid size stops at")


def _named_cases():
    for task, (_, op, _) in TASKS.items():
        for i, m in enumerate(op.mistakes):
            if (task, i) not in FALLBACKS:
                yield pytest.param(task, i, id=f"{task}[{i}]")


def _key(task, op, i):
    """The PRODUCERS / SAME_OUTPUT key of mistake i of a task (producers are keyed by the op's name)."""
    return (op.name, i) if (op.name, i) in PRODUCERS else (task, i)


@pytest.mark.parametrize("task,i", list(_named_cases()))
def test_each_named_mistake_gets_its_own_hint(task, i):
    _, op, _ = TASKS[task]
    m = op.mistakes[i]
    if (task, i) in SAME_OUTPUT:
        other, why = SAME_OUTPUT[(task, i)]
        r = replay(task, lambda c, e: m.outputs(c))
        assert r.status == "wrong" and op.mistakes[other].hint in r.hint, (why, r.message)
        return
    if m.outputs is not None:
        r = replay(task, lambda c, e: m.outputs(c))
        words, where = [m.hint], m.hint[:60]
    else:
        key = _key(task, op, i)
        assert key in PRODUCERS, f"{task}[{i}] is a pattern mistake without a producer here: add one"
        produce, words, size = PRODUCERS[key]
        r = replay(task, produce, size=size)
        where = words[0]
    assert r.status == "wrong", (where, r.message)
    missing = [w for w in words if w not in (r.hint or "")]
    assert not missing, f"{task}[{i}] should say {missing}: {r.message}"
    assert not any(g in r.hint for g in GENERIC), r.message


def test_the_tables_here_name_only_mistakes_that_exist():
    names = {op.name: (task, op) for task, (_, op, _) in TASKS.items()}
    for key in PRODUCERS:
        task, op = names[key[0]]
        assert key[1] < len(op.mistakes) and op.mistakes[key[1]].outputs is None, key
    for (task, i), (other, _) in SAME_OUTPUT.items():
        assert op_of(task).mistakes[i].outputs is not None and other < i, (task, i)
    for task, i in FALLBACKS:
        assert op_of(task).mistakes[i].outputs is None, (task, i)


def op_of(task):
    return TASKS[task][1]


# ---- hints derived from the wrong output's pattern, whatever the op -------------------------------------------------
HEADS = {   # task -> (the output with a head axis, what the hint of reads that lost the head index says)
    "flash_attention_forward": ("out", "every head of out holds head 0's result"),
    "flash_attention_backward": ("dq", "every head of dq holds head 0's result"),
    # the packed layout's own mistake table has this one: every head reads head 0's columns
    "flash_attention_forward_packed": ("out", "every head reads head 0's columns"),
    "attention_softmax_backward": ("dpreatt", "every head of dpreatt holds head 0's result"),
    "attention_backward": ("dqkv", "every head of dqkv holds head 0's result"),
}


def _head0_only(name, c, e):
    """Only head 0 of `name` written: every head's result landed in head 0's place."""
    out = e[name].copy()
    heads = opcheck._along(c, name, np.arange(out.size).reshape(out.shape), "nh")
    if heads is None or c.dims["nh"] < 2:
        return None
    out.reshape(-1)[heads[1:].reshape(-1)] = np.nan
    return {name: out}


def _head0_inputs(name, c, e):
    """Every head holds head 0's result: the reads lost the head index, the writes did not."""
    out = e[name].copy()
    heads = opcheck._along(c, name, np.arange(out.size).reshape(out.shape), "nh")
    if heads is None or c.dims["nh"] < 2:
        return None
    flat = out.reshape(-1)
    for h in range(1, c.dims["nh"]):
        flat[heads[h]] = flat[heads[0]]
    return {name: out}


@pytest.mark.parametrize("task", sorted(HEADS))
def test_a_kernel_that_lost_the_head_index_is_named(task):
    name, reads = HEADS[task]
    r = replay(task, lambda c, e: _head0_only(name, c, e))
    assert r.status == "wrong" and f"only head 0 of {name} was written" in r.hint, r.message
    r = replay(task, lambda c, e: _head0_inputs(name, c, e))
    assert r.status == "wrong" and reads in r.hint, r.message
    assert not any(g in r.hint for g in GENERIC), r.message


def test_a_kernel_that_lost_the_batch_index_is_named():
    """Only sequence 0 written: the flash forward's case of B = 2 sequences (one head) shows it."""
    def seq0_only(c, e):
        if c.dims["B"] < 2:
            return None
        out, lse = e["out"].copy(), e["lse"].copy()
        out[1:], lse[1:] = np.nan, np.nan
        return {"out": out, "lse": lse}

    r = replay("flash_attention_forward", seq0_only)
    assert r.status == "wrong" and "only sequence 0 of out was written" in r.hint and "batch index b" in r.hint, \
        r.message


def test_a_log_of_zero_in_the_output_is_named():
    def lse_minus_inf(c, e):
        lse = e["lse"].copy()
        lse[..., 3:5] = -np.inf
        return {"lse": lse}

    r = replay("flash_attention_forward", lse_minus_inf)
    assert r.status == "wrong" and "are -inf" in r.hint and "the log of 0" in r.hint, r.message
    assert "variance" not in r.hint


@cuda.jit
def lse_of_nothing(q, k, v, out, lse):
    if cuda.grid(1) == 0:
        l = q[0, 0, 0, 0] * 0.0                       # a running sum no term was added to
        lse[0, 0, 0] = math.log(l)


@pytest.mark.skipif(device.numba_on_gpu(), reason="the simulator raises on log(0); a GPU gives -inf")
def test_a_log_of_zero_raised_in_a_kernel_is_named_with_its_value():
    r = F.check_flash_attention_forward(lambda q, k, v, out, lse: lse_of_nothing[1, 1](q, k, v, out, lse),
                                        arrays="numba", seed=1, quiet=True)
    assert r.status == "error" and "log(l) with l = 0" in r.hint and "a sum that ended at 0" in r.hint, r.message
    assert "variance" not in r.hint


# ---- lesson 09's capstone: the named mistakes of the block, replayed through the checkers -----------------------
def _P(eng):
    return cc._views(eng.cfg, cc._host(eng.params.flat).astype(np.float64))


def _forward_with(flags):
    def block_forward(eng, x, l, B, T):
        t = cc.block_model_forward(_P(eng), l, cc._host(x).astype(np.float64), B, T, eng.cfg.n_head, flags)
        cache = {k: eng.xp.asarray(t[k].astype(np.float32)) for k in capstone.CACHE_KEYS}
        return eng.xp.asarray(t["out"].astype(np.float32)), cache
    return block_forward


def _backward_with(flags):
    def block_backward(eng, dout, cache, l, B, T):
        t = {k: cc._host(v).astype(np.float64) for k, v in cache.items()}
        dx, g = cc.block_model_backward(_P(eng), l, t, cc._host(dout).astype(np.float64), B, T, eng.cfg.n_head, flags)
        for p in capstone.LAYER_PARAMS:
            eng.grads[p][l] = eng.xp.asarray(g[p].astype(np.float32))
        return eng.xp.asarray(dx.astype(np.float32))
    return block_backward


@pytest.mark.parametrize("flags,hint", cc._FORWARD_MISTAKES, ids=["+".join(f) for f, _ in cc._FORWARD_MISTAKES])
def test_each_block_forward_mistake_gets_its_own_hint(flags, hint):
    r = cc.check_block_forward(_forward_with(flags), seed=3, quiet=True)
    assert r.status == "wrong" and r.hint == hint, r.message


@pytest.mark.parametrize("flags,hint", cc._BACKWARD_MISTAKES, ids=["+".join(f) for f, _ in cc._BACKWARD_MISTAKES])
def test_each_block_backward_mistake_gets_its_own_hint(flags, hint):
    r = cc.check_block_backward(_backward_with(flags), seed=3, quiet=True)
    assert r.status == "wrong" and r.hint == hint, r.message


def test_the_model_replay_of_the_capstone_is_right():
    assert cc.check_block_forward(_forward_with(()), seed=3, quiet=True).status == "correct"
    assert cc.check_block_backward(_backward_with(()), seed=3, quiet=True).status == "correct"


def test_a_forward_that_reuses_its_cache_arrays_is_blamed_on_the_forward_by_the_whole_step():
    """One set of cache arrays for every layer: each cache is right when returned, the next layer's call overwrites
    it before the backward reads it."""
    kept = {}

    def block_forward(eng, x, l, B, T):
        out, cache = _forward_with(())(eng, x, l, B, T)
        for k, v in cache.items():
            kept.setdefault(k, v.copy())[...] = v
        return out, dict(kept)

    r = cc.check_training_step(block_forward, _backward_with(()), lambda *a: 0.0, seed=3, quiet=True)
    assert r.status == "wrong" and "the cause is on the forward side" in r.hint, r.message
    assert "reuses arrays between calls" in r.hint and "09.3" in r.hint, r.hint


def test_a_forward_cache_mistake_is_blamed_on_the_forward_by_the_whole_step():
    """The block's output right, a cache entry wrong: the step's gradients come out wrong, and the hint sends the
    learner to the forward (09.3), not to the backward, whose own checker builds its cache itself and passes."""
    def block_forward(eng, x, l, B, T):
        out, cache = _forward_with(())(eng, x, l, B, T)
        cache["mean2"], cache["rstd2"] = cache["mean1"], cache["rstd1"]
        return out, cache

    def optimizer_step(eng, lr, weight_decay, grad_clip, loss_scale):   # never reached: the backward is wrong first
        raise AssertionError("the optimizer step ran")

    r = cc.check_training_step(block_forward, _backward_with(()), optimizer_step, seed=3, quiet=True)
    assert r.status == "wrong" and "the cause is on the forward side" in r.hint, r.message
    assert "cache['mean2']" in r.hint and "wrong LayerNorm saved for backward" in r.hint and "09.3" in r.hint
    assert "check_block_backward" not in r.hint
