"""Graded tasks 13.1-13.3 (a column-parallel linear's backward on thread ranks, the ring-attention merge, the 1F1B
tick table): the solutions pass on fresh seeds, plausible wrong answers fail with a hint naming them (a wrong answer is
the solution with one edit), the checkers report what the learner's function raised instead of raising it, and an
answer that uses the course's own implementation is refused in a graded call."""

import numpy as np
import pytest

from gpullm_lessons.checks.beyond import check_attention_merge, check_column_parallel_backward, check_one_f_one_b

from conftest import quiet_solution_namespace, wrong

NAME = "13_beyond_one_gpu"


def edited(cell, *edits):
    """The solution namespace with edits (old, new) in one cell."""
    return quiet_solution_namespace(NAME, cell, *edits)


@pytest.fixture(scope="module")
def ns():
    return edited("e13-t1-code")


def tp(ns_, seed=3, **kw):
    return check_column_parallel_backward(ns_["column_parallel_backward"], seed=seed, quiet=True, **kw)


def merge(ns_, seed=3, **kw):
    return check_attention_merge(ns_["merge"], seed=seed, quiet=True, **kw)


def table(ns_, seed=3, **kw):
    return check_one_f_one_b(ns_["one_f_one_b"], seed=seed, quiet=True, **kw)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_solutions_pass(ns, seed):
    for check in (tp, merge, table):
        r = check(ns, seed)
        assert r.status == "correct", r.message


# ---- 13.1 ------------------------------------------------------------------------------------------------------------
ALL_REDUCE = "    comm.all_reduce(dx)  "
DB = "    db_r = dout_r.sum(axis=(0, 1))\n"
DW = "x.reshape(-1, C).T @ dout_r.reshape(-1, O_r)"


@pytest.mark.parametrize(
    "old,new,words",
    [
        (ALL_REDUCE, "    pass  ", ["only this rank's part", "all-reduce"]),  # N = 1 is right: run first with N = 2
        (ALL_REDUCE, "    comm.all_reduce(dx); dx /= comm.world_size  ", ["divided by N", "mean"]),
        (ALL_REDUCE, "    comm.all_reduce(dx); comm.all_reduce(dx)  ", ["N times", "twice"]),
        (DB, DB + "    comm.all_reduce(dw_r)\n", ["dw_r was all-reduced", "different columns"]),
        (DB, DB + "    comm.all_reduce(db_r)\n", ["db_r was all-reduced", "different columns"]),
        ("dout_r.sum(axis=(0, 1))", "dout_r.sum(axis=1)", ["db_r has shape", "summed over T only"]),
        ("dout_r.sum(axis=(0, 1))", "dout_r.sum(axis=0)", ["db_r has shape", "summed over B only"]),
        ("dout_r.sum(axis=(0, 1))", "dout_r.mean(axis=(0, 1))", ["divided by the B T rows"]),
        (DW, "dout_r.reshape(-1, O_r).T @ x.reshape(-1, C)", ["dw_r has shape", "transposed"]),
        ("dout_r @ w_r.T", "dout_r @ w_r", ["ValueError", "shapes do not fit", "transposed"]),  # an error, named
        ("    return dx, dw_r, db_r\n", "    return dx.reshape(-1, C), dw_r, db_r\n", ["flattened", "x's shape"]),
        ("    return dx, dw_r, db_r\n", "    return dx, dw_r\n", ["a tuple of 2", "three gradients"]),
        (ALL_REDUCE, "    comm.all_reduce(dx, op='avg')  ", ["op='avg'", "sums"]),
    ],
)
def test_13_1_wrong_answers_fail_with_their_hint(old, new, words):
    r = tp(edited("e13-t1-code", (old, new)))
    wrong(r, *words)
    assert "rank" in r.message and "call 1 of 5" in r.message, r.message  # where: the rank and the call


def test_13_1_a_square_shard_catches_a_transposed_product_with_the_right_shape():
    """C = O/N in call 4: dw_r transposed has the right shape there; its values are named (a square w_r lets
    dout_r @ w_r run too)."""

    def transposed_on_square(comm, x, w_r, dout_r):
        C, O_r = w_r.shape
        dx = comm.all_reduce(dout_r @ w_r.T)
        dw_r = x.reshape(-1, C).T @ dout_r.reshape(-1, O_r)
        return dx, (dw_r.T if C == O_r else dw_r), dout_r.sum(axis=(0, 1))

    r = tp({"column_parallel_backward": transposed_on_square})
    wrong(r, "dw_r is transposed")
    assert "call 4 of 5" in r.message, r.message


def test_13_1_ranks_that_call_all_reduce_differently_are_named():
    r = tp(edited("e13-t1-code", (ALL_REDUCE, "    if comm.rank == 0: comm.all_reduce(dx)  ")), timeout=0.3)
    wrong(r, "rank 0 waited in its all_reduce call 0", "[1, 0]", "same all_reduce calls")
    r = tp(edited("e13-t1-code", (ALL_REDUCE, "    comm.all_reduce(dx[..., :1] if comm.rank else dx)  ")))
    wrong(r, "got an array of shape", "same shapes on every rank")


def test_13_1_state_kept_between_calls_fails():
    """A weight gradient added into a buffer each rank keeps between calls: right on every first call of its sizes,
    and the last call repeats the first call's sizes."""
    ns_ = edited(
        "e13-t1-code",
        (
            f"    dw_r = {DW}\n",
            f"    dw_r = STATE.setdefault((comm.rank, w_r.shape), np.zeros(w_r.shape))\n    dw_r += {DW}\n",
        ),
    )
    ns_["STATE"] = {}
    r = tp(ns_)
    wrong(r, "PLUS an earlier call's", "keeps between calls")
    assert "call 5 of 5" in r.message, r.message


def test_13_1_not_attempted_and_errors_are_reported_not_raised():
    def stub(comm, x, w_r, dout_r):
        raise NotImplementedError

    assert tp({"column_parallel_backward": stub}).status == "not attempted"
    ns_ = edited(
        "e13-t1-code",
        ("    dx = dout_r @ w_r.T", "    if comm.rank == 1:\n        raise KeyError('w')\n    dx = dout_r @ w_r.T"),
    )
    r = tp(ns_, timeout=0.3)  # rank 0 waits for rank 1 in all_reduce meanwhile: the error is what is reported
    assert r.status == "error" and "KeyError" in r.message and "on rank 1" in r.hint, r.message


def test_13_1_the_course_linear_backward_is_refused_in_a_graded_call():
    from gpullm_lessons.reference.linear import linear_backward

    def borrowed(comm, x, w_r, dout_r):
        dx, dw_r, db_r = linear_backward(dout_r, {"inp": x, "weight": w_r, "has_bias": True})
        return comm.all_reduce(dx), dw_r, db_r

    r = check_column_parallel_backward(borrowed, task="13.1", seed=1, quiet=True)
    assert r.status == "wrong" and "gpullm_lessons.reference.linear.linear_backward" in r.message, r.message
    assert check_column_parallel_backward(borrowed, seed=1, quiet=True).status == "correct"  # ungraded: judged


# ---- 13.2 ------------------------------------------------------------------------------------------------------------
OUT = "    out = (w1[..., None] * out1 + w2[..., None] * out2) / safe[..., None]"
LSE = "    lse = np.where(total > 0, m + np.log(safe), -np.inf)"


@pytest.mark.parametrize(
    "old,new,words",
    [
        ("    m = np.maximum(lse1, lse2)\n", "    m = np.zeros_like(lse1)\n", ["overflows", "subtract the larger lse"]),
        (OUT, "    out = (out1 + out2) / 2", ["plain average"]),
        ("np.exp(lse1 - m), np.exp(lse2 - m)", "lse1, lse2", ["weights are lse1 and lse2", "exp(lse_i)"]),
        (" / safe[..., None]", "", ["not normalised"]),
        (LSE, "    lse = np.maximum(lse1, lse2)", ["lse = max(lse1, lse2)", "SUM of the two masses"]),
        (LSE, "    lse = lse1 + lse2", ["lse = lse1 + lse2", "do not add"]),
        ("    m = np.where(np.isneginf(m), 0.0, m)", "    pass", ["neither side saw a key", "NaN"]),
        ("    return out, lse", "    out1 *= 2.0\n    return out, lse", ["changed out1", "in place"]),
        ("    return out, lse", "    return out, lse[..., None]", ["lse has shape", "kept axis"]),
    ],
)
def test_13_2_wrong_answers_fail_with_their_hint(old, new, words):
    wrong(merge(edited("e13-t2-code", (old, new))), *words)


def test_13_2_nan_where_one_side_saw_no_key_is_named():
    """lse as lse1 + log1p(exp(lse2 - lse1)): right where both sides saw keys, NaN where lse1 is -inf."""

    def one_sided(out1, lse1, out2, lse2):
        m = np.maximum(lse1, lse2)
        m = np.where(np.isneginf(m), 0.0, m)
        w1, w2 = np.exp(lse1 - m), np.exp(lse2 - m)
        total = np.where(w1 + w2 > 0, w1 + w2, 1.0)[..., None]
        return (w1[..., None] * out1 + w2[..., None] * out2) / total, lse1 + np.log1p(np.exp(lse2 - lse1))

    wrong(merge({"merge": one_sided}), "where one side saw a key", "exactly")


def test_13_2_errors_are_reported_and_the_library_merge_is_refused():
    from gpullm_lessons.parallel import ring_attention

    def broken(out1, lse1, out2, lse2):
        return out1 @ lse1, lse2  # shapes that do not fit: ValueError

    r = check_attention_merge(broken, seed=1, quiet=True)
    assert r.status == "error" and "ValueError" in r.message, r.message
    for fn in (ring_attention.merge_partials, lambda *a: ring_attention.merge_partials(*a)):
        r = check_attention_merge(fn, task="13.2", seed=1, quiet=True)
        assert r.status == "wrong" and "ring_attention.merge_partials" in r.message, r.message
    assert check_attention_merge(ring_attention.merge_partials, seed=1, quiet=True).status == "correct"


# ---- 13.3 ------------------------------------------------------------------------------------------------------------
WARMUP = "w = min(p - s - 1, m)"
RETURN = "    return table\n"


@pytest.mark.parametrize(
    "old,new,words",
    [
        (WARMUP, "w = m", ["that is GPipe's order", "stage s holds m micro-batches, 1F1B holds at most p - s"]),
        (WARMUP, "w = min(p - s, m)", ["warm-up of p - s forwards", "one too many"]),
        (WARMUP, "w = p - s - 1", ["RuntimeError", "warm-up capped at m"]),  # an error on m < p - 1, named
        (
            '        orders.append(ops + [("B", i) for i in range(m - w, m)])   # cool-down',
            "        orders.append(ops)",
            ["stage 0 never runs the backward B2", "no cool-down"],
        ),
        (RETURN, "    return table + [(None,) * p]\n", ["13 ticks", "padded with idle ticks"]),
        (RETURN, "    return table[:-1]\n", ["never runs the backward B3", "every stage runs the backward"]),
        (
            "        table.append(tuple(tick))",
            "        table.append(tuple(op for op in tick if op is not None))",
            ["tick 0 has 1 cell", "one cell per stage", "None"],
        ),
        (RETURN, "    return [list(col) for col in zip(*table)]\n", ["transposed", "list of TICKS"]),
        (
            "                if not all(d in done for d in needs if 0 <= d[0] < p):",
            "                if False:",
            ["starts the forward F0 before the forward F0 of stage 0 has finished", "what it waits for"],
        ),
    ],
)
def test_13_3_wrong_answers_fail_with_their_hint(old, new, words):
    wrong(table(edited("e13-t3-code", (old, new))), *words)


def test_13_3_ragged_ticks_after_the_first_are_named():
    def ragged(p, m):
        from gpullm_lessons.parallel import pipeline

        t = [list(tick) for tick in pipeline.gpipe_schedule(p, m)]  # any valid table; a later tick cut short
        t[1] = t[1][:-1] if p > 1 else t[1]
        return t

    wrong(table({"one_f_one_b": ragged}), "tick 1 has 2 cells and tick 0 has 3", "keep the idle cells")


def test_13_3_errors_are_reported_and_the_schedule_makers_are_refused():
    from gpullm_lessons.parallel import pipeline

    def broken(p, m):
        return [None][p]  # IndexError

    r = check_one_f_one_b(broken, seed=1, quiet=True)
    assert r.status == "error" and "IndexError" in r.message, r.message

    def own_order_timed_by_the_course(p, m):
        orders = []
        for s in range(p):
            w = min(p - s - 1, m)
            ops = [("F", i) for i in range(w)]
            for i in range(m - w):
                ops += [("F", w + i), ("B", i)]
            orders.append(ops + [("B", i) for i in range(m - w, m)])
        return pipeline.timed_schedule(orders)

    answers = [
        (pipeline.one_f_one_b_schedule, "one_f_one_b_schedule"),
        (lambda p, m: pipeline.make_schedule("1f1b", p, m), "make_schedule"),
        (lambda p, m: pipeline.timed_schedule(pipeline.one_f_one_b_order(p, m)), "pipeline."),
        (own_order_timed_by_the_course, "timed_schedule"),
    ]
    for fn, named in answers:
        r = check_one_f_one_b(fn, task="13.3", seed=1, quiet=True)
        assert r.status == "wrong" and "course's own implementation" in r.message and named in r.message, r.message
        assert check_one_f_one_b(fn, seed=1, quiet=True).status == "correct"  # ungraded: judged on its table
