"""Graded tasks 12.1-12.3 (gradient accumulation, block-wise 8-bit quantisation, gradient buckets in backward
order): the solutions pass on fresh seeds, plausible wrong answers fail with a hint naming them (a wrong answer is the
solution with one edit), and the checkers report what the learner's function raised instead of raising it."""

import numpy as np
import pytest

from gpullm_lessons.checks.scale import check_accumulate, check_bucket_assignment, check_quantize_blockwise

from conftest import solution_namespace, wrong

NAME = "12_memory"


@pytest.fixture(scope="module")
def ns():
    return solution_namespace(NAME)


def acc(ns_, seed=3):
    return check_accumulate(ns_["accumulate"], seed=seed, quiet=True)


def quant(ns_, seed=3):
    return check_quantize_blockwise(ns_["quantize"], ns_["dequantize"], seed=seed, quiet=True)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_solutions_pass(ns, seed):
    assert acc(ns, seed).status == "correct", acc(ns, seed).message
    assert quant(ns, seed).status == "correct", quant(ns, seed).message


# ---- 12.1 -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("old,new,words", [
    ("loss += li / K", "loss += li", ["summed, not averaged"]),
    ("grad = gi / K if grad is None else grad + gi / K", "grad = gi / K", ["only the last micro-batch"]),
    ("grad = gi / K if grad is None else grad + gi / K", "grad = gi if grad is None else grad + gi",
     ["summed, not averaged"]),
    ("grad = gi / K if grad is None else grad + gi / K", "grad = gi / b if grad is None else grad + gi / b",
     ["rows of a micro-batch"]),
    ("b = B // K", "b = K", ["micro-batches of K rows"]),
    ("li, gi = grad_fn(x[i * b:(i + 1) * b], y[i * b:(i + 1) * b])", "li, gi = grad_fn(x, y)",
     ["more than one micro-batch's rows at once"]),
])
def test_12_1_wrong_answers_fail_with_their_hint(old, new, words):
    wrong(acc(solution_namespace(NAME, [("e12-t1-code", old, new)])), *words)


def test_12_1_state_kept_between_calls_fails():
    """An accumulator that lives outside the function is right on the first call only."""
    ns_ = solution_namespace(NAME, [
        ("e12-t1-code", "    loss, grad = 0.0, None\n", "    loss, grad = 0.0, STATE.get('grad')\n"),
        ("e12-t1-code", "    return loss, grad\n", "    STATE['grad'] = grad\n    return loss, grad\n"),
    ])
    ns_["STATE"] = {}
    r = acc(ns_)
    assert r.status == "wrong", r.message


def test_12_1_not_attempted_and_errors_are_reported():
    def stub(grad_fn, x, y, K):
        raise NotImplementedError

    def broken(grad_fn, x, y, K):
        return grad_fn(x[: len(x) // K], y)  # mismatched shapes: grad_fn raises

    assert check_accumulate(stub, quiet=True).status == "not attempted"
    r = check_accumulate(broken, quiet=True)
    assert r.status == "error" and "line" in r.message + (r.hint or "")


# ---- 12.2 -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("old,new,words", [
    ("scales = np.abs(blocks).max(axis=1)", "scales = np.full(nb, np.abs(blocks).max())", ["one scale for the whole"]),
    ("scales = np.abs(blocks).max(axis=1)", "scales = blocks.max(axis=1)", ["absolute max"]),
    ("q = np.rint(blocks / safe[:, None] * 127)", "q = (blocks / safe[:, None] * 127)", ["truncated"]),
    ("q = np.rint(blocks / safe[:, None] * 127)", "q = np.rint(blocks / safe[:, None] * 128)", ["128 levels"]),
    ("q = np.rint(blocks / safe[:, None] * 127)", "q = np.rint(blocks / safe[:, None] * 255)", ["255 levels"]),
    ("per = np.repeat(scales, block)[: q.size]", "per = np.full(q.size, scales.max())", ["largest scale"]),
    ("return (q.astype(np.float32) * per / np.float32(127)).astype(np.float32)",
     "return (q.astype(np.float32) * per).astype(np.float32)", ["divide by the 127 levels"]),
])
def test_12_2_wrong_answers_fail_with_their_hint(old, new, words):
    with np.errstate(all="ignore"):
        wrong(quant(solution_namespace(NAME, [("e12-t2-code", old, new)])), *words)


def test_12_2_a_dropped_last_block_is_named():
    ns_ = solution_namespace(NAME, [("e12-t2-code", "nb = math.ceil(n / block)", "nb = n // block"),
                                    ("e12-t2-code", "padded[:n] = x", "padded[:] = x[: nb * block]")])
    wrong(quant(ns_), "last, shorter block")


def test_12_2_q_must_be_one_byte():
    ns_ = solution_namespace(NAME, [("e12-t2-code", ".astype(np.int8).reshape(-1)[:n]", ".reshape(-1)[:n]")])
    wrong(quant(ns_), "int8")


# ---- 12.3 -----------------------------------------------------------------------------------------------------------
def buckets(ns_, seed=3):
    return check_bucket_assignment(ns_["assign_buckets"], seed=seed, quiet=True)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_12_3_solution_passes_and_is_what_data_parallel_uses(ns, seed):
    from gpullm_lessons.parallel import assign_buckets

    assert buckets(ns, seed).status == "correct", buckets(ns, seed).message
    rng = np.random.default_rng(seed)
    sizes = [int(v) for v in rng.integers(1, 100, 40)]
    for limit in (1, 50, 150, 10_000):
        assert ns["assign_buckets"](sizes, limit) == assign_buckets(sizes, limit)


LOOP = "    for i in reversed(range(len(sizes))):\n"
TEST = "        if current and total + sizes[i] > limit:\n"


@pytest.mark.parametrize("old,new,words", [
    (LOOP, "    for i in range(len(sizes)):\n", ["forward order"]),                       # forward, not backward
    (TEST, "        if current and total > limit:\n", ["over the limit", "check before adding"]),   # overflows
    (TEST, "        if current and total + sizes[i] >= limit:\n", ["off by one", "exactly"]),    # boundary
    ("            buckets.append(current)\n            current, total",
     "            buckets.append(current + [i])\n            current, total", ["in bucket", "split"]),  # in two
    ("    if current:\n        buckets.append(current)\n", "", ["last open bucket"]),      # the last one left out
    ("            current, total = [], 0\n", "            current = []\n", ["with room", "reset"]),
    (TEST, "        if False:\n", ["only when everything fits one bucket"]),
])
def test_12_3_wrong_answers_fail_with_their_hint(old, new, words):
    wrong(buckets(solution_namespace(NAME, [("e12-t3-code", old, new)])), *words)


def test_12_3_a_tensor_left_out_and_sizes_for_indices_are_named():
    def skips_the_boundary_tensor(sizes, limit):
        out, current, total = [], [], 0
        for i in reversed(range(len(sizes))):
            if current and total + sizes[i] > limit:
                out.append(current)
                current, total = [], 0
                continue  # the tensor that did not fit is dropped instead of starting the next bucket
            current.append(i)
            total += sizes[i]
        return out + ([current] if current else [])

    wrong(buckets({"assign_buckets": skips_the_boundary_tensor}), "in no bucket", "exactly one bucket")
    r = check_bucket_assignment(lambda sizes, limit: [[s] for s in reversed(sizes)], seed=1, quiet=True)
    wrong(r, "not a tensor")
    assert check_bucket_assignment(lambda s, l: (_ for _ in ()).throw(NotImplementedError),
                                   quiet=True).status == "not attempted"
