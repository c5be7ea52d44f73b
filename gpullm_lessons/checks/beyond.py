"""Checkers for lesson 13 (when one GPU is not enough): the backward of a column-parallel linear on N ranks, the merge
of two partial attention results (ring attention's step), and the tick table of the 1F1B pipeline schedule.

They follow the conventions of the course's checkers (``gpullm_lessons.checks.verdict``): fresh random inputs on every
call (the seed is printed), one verdict printed and recorded (not attempted / error / wrong with a hint naming the
mistake / correct), your exceptions reported and never raised, ``task=`` for grading, ``quiet=``. A graded answer that
is, wraps or calls the course's own implementation of its task is wrong (``checks/borrowed.py``, ``OWN`` below).

``check_column_parallel_backward(fn)`` (exercise 13.1), fn called on every rank at once (one thread per rank) as

    dx, dw_r, db_r = fn(comm, x, w_r, dout_r)

comm: a ``Communicator`` of N ranks (``checks.parallel``'s thread ranks) with ``comm.rank``, ``comm.world_size`` and
``comm.all_reduce(buf)``: buf, a NumPy array, replaced in place on every rank by the elementwise sum of the N ranks'
arrays (added in rank order: the same bits everywhere) and returned; every rank makes the same calls with arrays of
one shape. x (B, T, C) float64: the whole input, the same on every rank. w_r (C, O/N): rank r's column shard of the
weight W (C, O), columns [r O/N, (r+1) O/N). dout_r (B, T, O/N): the gradient of those output columns. fn returns
dx (B, T, C), the gradient of the whole input, the same on every rank (Megatron's f: the identity in forward, an
all-reduce in backward), and dw_r (C, O/N), db_r (O/N,), this shard's gradients (no communication). The truth is the
one-rank linear backward (``reference.linear.linear_backward``) of x, W and dout (the shards side by side), cut back
into shards. Checked for N = 2, 3, 1, 4 ranks on fresh sizes (B T never round, B != T, one case with C = O/N where a
transposed product has the right shape) and once more on the first case's sizes with new values (a gradient kept
between calls fails there), float64 to 1e-12. The named mistakes: dx without the all-reduce (this rank's part only),
all-reduced then divided by N (a mean), all-reduced twice; dw_r or db_r all-reduced (different shards summed) or
divided by B T; db_r summed over T only or B only, dw_r transposed (shape messages, or the values where C = O/N); a
product whose shapes do not fit (the error's hint names the three shapes); a gradient added onto an earlier call's;
ranks that call all_reduce different numbers of times (one left waiting) or with different shapes.

``check_attention_merge(fn)`` (exercise 13.2), fn called as

    out, lse = fn(out1, lse1, out2, lse2)

out_i (..., T, hs) float64 and lse_i (..., T): the attention of T queries over two disjoint key sets K1, K2 (out_i the
softmax-weighted values of K_i's keys, lse_i the log-sum-exp of their scores; a query that saw no key of K_i has
lse_i = -inf and out_i = 0). fn returns the attention over K1 and K2 together: out (..., T, hs), lse (..., T). The
truth is ``reference.attention.sdpa_forward`` over the union, the partials the same function over each set. Cases:
(B, nh) leading axes, one leading axis and none; scores near +1000 and -1000 (exp overflows and underflows without a
shift); rows where one side saw no key (the other side's out and lse, exactly) and rows where neither did (out 0, lse
-inf, no NaN); the inputs must come back unchanged; last, causal ring attention of 4 simulated ranks that merge their
steps with fn (``ring_with_merge``) against one rank's sdpa_forward. NumPy's floating-point warnings are silenced
during the calls (a warning never becomes an error): the values are judged. The named mistakes: no shift (inf, NaN),
a plain average, weights lse_i instead of exp(lse_i), weights not normalised, lse = max(lse1, lse2), lse = lse1 +
lse2, NaN where neither side saw a key, NaN where one side did not, inputs changed in place.

``check_one_f_one_b(fn)`` (exercise 13.3), fn called as

    table = fn(p, m)

The tick table of 1F1B for p stages and m micro-batches in ``parallel.pipeline``'s format: a list of ticks, each a
tuple of p cells, cell s what stage s runs in that tick: ("F", i), ("B", i) or None (idle); a forward and a backward
take one tick each. It must be ``pipeline.one_f_one_b_schedule(p, m)``: stage s runs min(p - s - 1, m) forwards, then
one forward and one backward in turn, then the backwards still owed, each op at the first tick its stage is free and
what it waits for has finished. Checked for (p, m) = (3, 4) (the lesson's table), m >> p, m < p - 1, m = p, p = 1,
m = 1, a random pair, and (3, 4) again; in this order: the table's shape (a list of ticks of p cells), then
``validate_schedule(table, m)`` (every op once, after what it waits for; its message, which names the first fault, is
the verdict's), the length 2 (m + p - 1) ticks (the bubble (p - 1) / (m + p - 1)), ``peak_activations`` per stage <=
min(p - s, m), then cell by cell against the schedule. The named mistakes: GPipe's order, a warm-up of p - s forwards,
no cool-down, a warm-up not capped at m, trailing idle ticks, ragged ticks, the table transposed (stages by ticks).

``ring_with_merge(merge, q, k, v, N)``: causal attention of q, k, v (B, nh, T, hs) by N simulated ranks of ring
attention, each rank merging its steps' partial results with ``merge``; (out, lse) as one rank's sdpa_forward.
"""

from __future__ import annotations

import warnings

import numpy as np

from . import borrowed, opcheck, verdict
from .parallel import _RingBreak, _Stalled, _SumComm, _run_threads, _ranks
from .verdict import CheckResult, compare, fmt, fmt_index

# the course's own implementations of the tasks (checks/borrowed.py): an answer that is, wraps or calls one is not correct.
# 13.1: the shard's local gradients are lesson 02's linear backward, written by the learner here too. 13.3: turning an
# order of ops into ticks is the task's half that timed_schedule does, so it is refused with the schedule makers.
OWN = {
    "column_parallel_backward": ("gpullm_lessons.reference.linear:linear_backward",),
    "attention_merge": ("gpullm_lessons.parallel.ring_attention:merge_partials",),
    "one_f_one_b": (
        "gpullm_lessons.parallel.pipeline:one_f_one_b_schedule",
        "gpullm_lessons.parallel.pipeline:one_f_one_b_order",
        "gpullm_lessons.parallel.pipeline:make_schedule",
        "gpullm_lessons.parallel.pipeline:timed_schedule",
    ),
}

__all__ = ["check_column_parallel_backward", "check_attention_merge", "check_one_f_one_b", "ring_with_merge"]

_FIELDS = {"dtype": "float64", "arrays": "numpy"}
TOL = 1e-12  # float64: the element-wise rule of verdict.compare


def _result(name, task, status, msg, hint=None, seed=None, dims=None, quiet=False):
    return verdict.verdict(name, task, status, msg, hint, quiet=quiet, seed=seed, dims=dims, **_FIELDS)


def _call(name, fn, args, seed, task, dims, quiet, where, lead=None):
    """(value, None) or (None, the recorded CheckResult) for not attempted / error."""
    value, failed = verdict.call_learner(
        name, fn, args, context=where, lead=lead, task=task, seed=seed, dims=dims, **_FIELDS
    )
    return (value, None) if failed is None else (None, verdict.record(failed, quiet=quiet))


def _near(o, m) -> bool:
    """o equals the named mistake m (within 1e-9 relative: far tighter than any two mistakes are apart)."""
    o, m = np.asarray(o, dtype=np.float64), np.asarray(m, dtype=np.float64)
    if o.shape != m.shape or not (np.isfinite(o).all() and np.isfinite(m).all()):
        return False
    return bool(np.allclose(o, m, rtol=1e-9, atol=1e-12 * max(1.0, float(np.abs(m).max(initial=0.0)))))


def _first_bad(o, e):
    """(index, yours, expected) of the first element of o outside the tolerance of e, or None."""
    bad, _, _, _ = compare(o, e, TOL)
    if not bad.any():
        return None
    i = tuple(int(k) for k in np.argwhere(bad)[0])
    return i, float(o[i]), float(e[i])


# ----------------------------------------------------------------------------------------------------------------
# 13.1 the backward of a column-parallel linear
# ----------------------------------------------------------------------------------------------------------------
def _cpb_cases(rng):
    """(N, B, T, C, O/N) of each call: fresh sizes with B in 1..3 and T in {5, 7} (B T never round, B != T); N = 2
    first (one rank cannot tell a rank's part of dx from the whole), then 3, 1, 4 (C = O/N there: a transposed
    product has the right shape), and the first case's sizes again (a gradient kept between calls)."""

    def sizes(N, square=False):
        B, T = int(rng.integers(1, 4)), int(rng.choice([5, 7]))
        C = int(rng.integers(3, 8))
        o = C if square else int(rng.choice([v for v in range(1, 6) if v != C]))
        return (N, B, T, C, o)

    cases = [sizes(2), sizes(3), sizes(1), sizes(4, square=True)]
    return cases + [cases[0]]


def _cpb_truth(x, W, dout):
    from ..reference.linear import linear_backward

    return linear_backward(dout, {"inp": x, "weight": W, "has_bias": True})


def _shape_problem(what, got, want, B, T, C, o):
    """(message, hint) for an output of the wrong shape, naming the mistake the shape tells."""
    msg = f"{what} has shape {tuple(got)}, expected {tuple(want)}"
    if what == "dx":
        if tuple(got) == (B * T, C):
            return msg + " (the rows flattened)", "dx is the gradient of x: give it x's shape (B, T, C)"
        return msg, "dx is the gradient of x: it has x's shape (B, T, C), the same on every rank"
    if what == "dw_r":
        if tuple(got) == (o, C):
            return msg + ", the transpose", (
                "dw_r is transposed: it has w_r's shape (C, O/N), x's channels by this "
                "rank's output columns; check which operand of the product is transposed"
            )
        return msg, "dw_r is the gradient of w_r: it has w_r's shape (C, O/N)"
    if tuple(got) == (B, o) and B != T:
        return msg + ": summed over T only", (
            "db_r has one value per output column of this rank: sum dout_r over the batch axis B too, not only over T"
        )
    if tuple(got) == (T, o):
        return msg + ": summed over B only", (
            "db_r has one value per output column of this rank: sum dout_r over T too, not only over the batch axis B"
        )
    if tuple(got) == ():
        return msg + ": one number", (
            "db_r has one value per output column of this rank: sum over B and T only, not over the columns"
        )
    return msg, "db_r is the gradient of this rank's O/N biases: a vector of O/N values, summed over B and T"


def _matmul_lead(x, w, dout):
    def lead(exc):
        text = str(exc)
        if isinstance(exc, ValueError) and any(s in text for s in ("matmul", "aligned", "broadcast", "shape")):
            return (
                f"a product's shapes do not fit: x {x.shape}, w_r {w.shape}, dout_r {dout.shape}; each gradient "
                "has the shape of what it is the gradient of (dx like x, dw_r like w_r): which operand is "
                "transposed?"
            )
        return None

    return lead


def check_column_parallel_backward(fn, *, seed=None, task=None, quiet=False, timeout=1.0) -> CheckResult:
    """Check dx, dw_r, db_r = fn(comm, x, w_r, dout_r) run on N ranks at once, one thread each (module docstring).
    timeout: seconds a rank waits in all_reduce for the others before the checker calls it stuck."""
    name = "column_parallel_backward"
    seed = opcheck.learner_fn_and_seed(name, fn, seed, "inputs")
    taken = borrowed.borrowed_verdict(
        name, [fn], OWN[name], task=task, seed=seed, quiet=quiet, check="check_column_parallel_backward"
    )
    if taken is not None:
        return taken
    rng = np.random.default_rng(seed)
    cases = _cpb_cases(rng)
    earlier = {}  # the sizes of a call -> its true (dx, dw shards, db shards)
    for i, (N, B, T, C, o) in enumerate(cases):
        O = N * o
        x = rng.standard_normal((B, T, C))
        W = rng.standard_normal((C, O))
        dout = rng.standard_normal((B, T, O))
        cols = [slice(r * o, (r + 1) * o) for r in range(N)]
        shards = [(x, W[:, c], dout[..., c]) for c in cols]  # kept as they were: the mistakes are computed from them
        args = [tuple(a.copy() for a in shard) for shard in shards]
        dx_t, dw_t, db_t = _cpb_truth(x, W, dout)
        truth = [(dx_t, dw_t[:, c], db_t[c]) for c in cols]
        dims = {"N": N, "B": B, "T": T, "C": C, "O": O, "call": i + 1}
        where = (
            f"call {i + 1} of {len(cases)}: N={N} rank{'s' if N > 1 else ''}, x {x.shape}, w_r {(C, o)}, "
            f"dout_r {(B, T, o)}; seed {seed}"
        )

        def fail(msg, hint):
            return _result(name, task, "wrong", f"{name}: wrong - {msg} ({where})", hint, seed, dims, quiet)

        values, outcomes, calls, hung = _run_threads(fn, args, timeout, comm_cls=_SumComm)
        raised = [(r, e) for r, e in enumerate(outcomes) if e is not None]
        if any(isinstance(e, NotImplementedError) for _, e in raised):
            return verdict.record(verdict.not_attempted(name, task=task, seed=seed, dims=dims, **_FIELDS), quiet=quiet)
        learner = [(r, e) for r, e in raised if not isinstance(e, (_RingBreak, _Stalled))]
        if learner:
            r, e = learner[0]
            return verdict.record(
                verdict.raised(
                    name,
                    e,
                    f"on rank {r}; {where}",
                    lead=_matmul_lead(*shards[r]),
                    task=task,
                    seed=seed,
                    dims=dims,
                    **_FIELDS,
                ),
                quiet=quiet,
            )
        breaks = [e for _, e in raised if isinstance(e, _RingBreak)]
        if breaks:
            return fail(breaks[0].what, breaks[0].hint)
        if hung:
            return fail(
                f"{_ranks(hung)} did not return within {timeout * (N + 4):g} s",
                "an endless loop, or a rank waiting for something that never happens",
            )
        stalled = [(r, e) for r, e in raised if isinstance(e, _Stalled)]
        if stalled:
            r, e = stalled[0]
            return fail(
                f"rank {r} waited in its all_reduce call {e.call} for the other ranks, which did not all call "
                f"it (all_reduce calls per rank: {calls})",
                "every rank makes the same all_reduce calls, with the same tensors in the same order: a "
                "collective returns only when all N ranks have called it",
            )
        got = []
        for r, out in enumerate(values):
            if not (isinstance(out, (tuple, list)) and len(out) == 3):
                what = f"a {type(out).__name__} of {len(out)}" if isinstance(out, (tuple, list)) else type(out).__name__
                return fail(f"rank {r} returned {what}", "return the three gradients: (dx, dw_r, db_r)")
            try:
                arrays = [np.asarray(a, dtype=np.float64) for a in out]
            except (TypeError, ValueError):
                return fail(
                    f"rank {r} returned something that is not three arrays of numbers",
                    "return the three gradients (dx, dw_r, db_r) as NumPy arrays",
                )
            for what, a, want in zip(("dx", "dw_r", "db_r"), arrays, ((B, T, C), (C, o), (o,))):
                if a.shape != want:
                    msg, hint = _shape_problem(what, a.shape, want, B, T, C, o)
                    return fail(f"rank {r}'s {msg}", hint)
            got.append(arrays)
        note = ""
        if i == len(cases) - 1:
            note = "; the same sizes were right on an earlier call: does your function keep state between calls?"
        key = (N, B, T, C, o)
        for k, what in enumerate(("dx", "dw_r", "db_r")):
            ours = [g[k] for g in got]
            want = [t[k] for t in truth]
            bad = [r for r in range(N) if _first_bad(ours[r], want[r]) is not None]
            if not bad:
                continue
            r = bad[0]
            idx, yv, ev = _first_bad(ours[r], want[r])
            msg = (
                f"rank {r}'s {what}{fmt_index(idx)}: yours {fmt(yv, ev)}, expected {fmt(ev, yv)}; {what} wrong on "
                f"{_ranks(bad)}; all_reduce calls per rank: {calls}"
            )
            hint = _cpb_mistake(what, ours, want, shards, N, B, T, earlier.get(key), k)
            if hint is None:
                return fail(msg + note, _CPB_GENERIC[what])
            return fail(msg, hint)
        earlier[key] = truth
    return _result(
        name,
        task,
        "correct",
        f"{name}: correct (dx the whole input gradient on every rank, dw_r and db_r "
        f"each rank's shard, for N = {', '.join(str(c[0]) for c in cases)} ranks; float64 to {TOL:g}; "
        f"seed {seed})",
        seed=seed,
        dims={"cases": len(cases)},
        quiet=quiet,
    )


_CPB_GENERIC = {
    "dx": "dx is the gradient of the whole input: each rank's columns give a part of it (lesson 02's formula with "
    "this rank's w_r and dout_r), and the sum of the N parts is the whole, the same on every rank",
    "dw_r": "dw_r is lesson 02's weight gradient for this rank's columns: x's rows against dout_r's, summed over the "
    "B T rows; it needs nothing from the other ranks",
    "db_r": "db_r is dout_r summed over its B T rows: one value per output column of this rank; it needs nothing "
    "from the other ranks",
}


def _cpb_mistake(what, ours, want, shards, N, B, T, before, k):
    """The hint of the named mistake that `ours` (one array per rank) equals, or None."""

    def every(cands):
        return all(_near(ours[r], cands[r]) for r in range(N))

    if before is not None and every([want[r] + before[r][k] for r in range(N)]):
        return (
            f"{what} is this call's gradient PLUS an earlier call's (the same sizes): your function adds into a "
            "buffer it keeps between calls; start from a new array on every call"
        )
    if what == "dx":
        if N > 1:
            parts = [dout_r @ w_r.T for _, w_r, dout_r in shards]
            if every(parts):
                return (
                    "dx holds only this rank's part of the input gradient: every element of x feeds the output "
                    "columns of every rank, so the whole gradient is the sum of the N ranks' parts (Megatron's f: "
                    "the identity in forward, an all-reduce in backward); comm.all_reduce it"
                )
            if every([w / N for w in want]):
                return (
                    "dx was divided by N after the all-reduce: a mean, data parallel's habit (its ranks saw "
                    "different rows); here the ranks hold parts of ONE sum, and the sum is the gradient"
                )
            if every([w * N for w in want]):
                return (
                    "dx is N times the gradient: it was all-reduced twice, or a sum that was whole already was "
                    "all-reduced"
                )
        if shards[0][1].shape[0] == shards[0][1].shape[1]:
            flipped = sum(dout_r @ w_r for _, w_r, dout_r in shards)
            if every([flipped] * N):
                return (
                    "dx used w_r where its transpose belongs: dx (B, T, C) = dout_r (B, T, O/N) times w_r's transpose"
                )
        return None
    if N > 1 and every([sum(want)] * N):
        return (
            f"{what} was all-reduced: each rank's {what} is the gradient of its own columns and is whole already; "
            f"summing the ranks' {what} adds the gradients of different columns (only dx needs the other ranks)"
        )
    if every([w / (B * T) for w in want]):
        return (
            f"{what} was divided by the B T rows: the loss's mean is already in dout, a parameter's gradient sums "
            "over the rows"
        )
    if what == "dw_r" and all(w.shape[0] == w.shape[1] for w in want) and every([w.T for w in want]):
        return (
            "dw_r is transposed: it has w_r's shape (C, O/N), x's channels by this rank's output columns; check "
            "which operand of the product is transposed"
        )
    return None


# ----------------------------------------------------------------------------------------------------------------
# 13.2 the ring-attention merge
# ----------------------------------------------------------------------------------------------------------------
def _sdpa(q, k, v, mask):
    """(out, lse) of non-causal attention with a (Tq, Tk) mask (True: the query sees the key), float64."""
    from ..reference.attention import sdpa_forward

    out, cache = sdpa_forward(q, k, v, causal=False, mask=mask)
    return out, cache["lse"]


def _merge_case(rng, lead, T, hs, n1, n2, kind):
    """(out1, lse1, out2, lse2, out, lse) shaped lead + (T, hs) / lead + (T,): the partial attention of T random
    queries over two disjoint random key sets of n1 and n2 keys and the attention over both, by sdpa_forward.
    kind "large": scores near +1000 (the first half of the rows) and -1000; "empty": row 0 sees no key of set 1,
    row 1 none of set 2, row 2 none at all."""
    B, nh = ((1, 1) + tuple(lead))[-2:]
    q = rng.standard_normal((B, nh, T, hs))
    k, v = rng.standard_normal((B, nh, n1 + n2, hs)), rng.standard_normal((B, nh, n1 + n2, hs))
    if kind == "large":  # q . k / sqrt(hs) = +-2000 u.u / 2 ~ +-1000, spread by the noise
        u = np.full(hs, 1.0 / np.sqrt(hs))
        sign = np.where(np.arange(T) < T // 2, 1.0, -1.0)[:, None]
        q = 2 * np.sqrt(hs) * 1000 / 2 * sign * u + q
        k = u + 0.02 * k
    perm = rng.permutation(n1 + n2)
    K1, K2 = np.sort(perm[:n1]), np.sort(perm[n1:])
    mask = np.ones((T, n1 + n2), dtype=bool)
    if kind == "empty":
        mask = rng.random((T, n1 + n2)) < 0.7
        mask[:, K1[0]] = mask[:, K2[0]] = True  # every other row sees a key of each set
        mask[0, K1] = False
        mask[1, K2] = False
        mask[2, :] = False
    o1, l1 = _sdpa(q, k[:, :, K1], v[:, :, K1], mask[:, K1])
    o2, l2 = _sdpa(q, k[:, :, K2], v[:, :, K2], mask[:, K2])
    o, lse = _sdpa(q, k, v, mask)
    shape = tuple(lead)
    return tuple(np.ascontiguousarray(a.reshape(shape + a.shape[2:])) for a in (o1, l1, o2, l2, o, lse))


def _merge_cases(rng):
    return [
        ("random scores", _merge_case(rng, (2, 3), 5, 4, 6, 3, "plain")),
        ("no leading axes", _merge_case(rng, (), 4, 3, 2, 5, "plain")),
        ("scores near +1000 and -1000", _merge_case(rng, (3,), 6, 4, 4, 3, "large")),
        ("rows where one side or both saw no key", _merge_case(rng, (2, 2), 6, 3, 4, 4, "empty")),
    ]


_OUT_MISTAKES = (
    (
        "average",
        "a plain average of out1 and out2: each side counts in proportion to its share of the softmax mass, "
        "exp(lse_i) (relative to the larger lse), not one half",
    ),
    (
        "by_lse",
        "the weights are lse1 and lse2: a side's weight is its softmax mass exp(lse_i), taken relative to the "
        "larger lse so that it cannot overflow, not its logarithm",
    ),
    (
        "unnormalised",
        "the weights are not normalised: exp(lse1 - m) and exp(lse2 - m) must be divided by their sum, so "
        "that the two shares add up to 1",
    ),
)
_LSE_MISTAKES = (
    (
        "max",
        "lse = max(lse1, lse2): the union's mass is the SUM of the two masses, exp(lse1) + exp(lse2), so lse is "
        "the log of that sum (computed as m + log(exp(lse1 - m) + exp(lse2 - m)) with m the larger); the max is "
        "only its largest term",
    ),
    (
        "sum",
        "lse = lse1 + lse2: logs of sums do not add; the union's mass is exp(lse1) + exp(lse2), and lse is its "
        "log (shifted by the larger lse so that nothing overflows)",
    ),
)
_OVERFLOW = (
    "exp(lse) overflows for scores near 1000 (exp(710) is inf in float64) and underflows to 0 near -1000 "
    "(0 / 0 is NaN): subtract the larger lse m before exp, so that every weight is exp(lse_i - m) <= 1 and "
    "the larger is exactly 1; then lse = m + log(w1 + w2)"
)
_BOTH_EMPTY = (
    "where neither side saw a key (lse1 = lse2 = -inf) the result is out 0 and lse -inf; -inf - -inf is "
    "NaN, so a shift by the larger lse needs a finite stand-in there (any finite m: both weights are then "
    "exp(-inf) = 0) and a guard against 0 / 0"
)
_ONE_EMPTY = (
    "where one side saw no key (its lse is -inf) its weight is exp(-inf - m) = 0 and the other's 1: the result "
    "is the other side's out and lse, exactly"
)


def _merge_variants(o1, l1, o2, l2):
    """{kind: the out or lse a named mistake gives} (NumPy's warnings off: a variant may be NaN)."""
    with np.errstate(all="ignore"):
        m = np.maximum(l1, l2)
        w1, w2 = np.exp(l1 - m)[..., None], np.exp(l2 - m)[..., None]
        return {
            "average": (o1 + o2) / 2,
            "by_lse": (l1[..., None] * o1 + l2[..., None] * o2) / (l1 + l2)[..., None],
            "unnormalised": w1 * o1 + w2 * o2,
            "max": m,
            "sum": l1 + l2,
        }


def ring_with_merge(merge, q, k, v, N, causal=True):
    """Causal attention of q, k, v (B, nh, T, hs) by N simulated ranks of ring attention (parallel.ring_attention's
    steps: rank r holds query block r and meets key block (r - s) mod N at step s), each rank starting from out 0,
    lse -inf and merging every step's partial result with merge(out, lse, out_step, lse_step). Returns (out, lse)
    of the whole sequence, what one rank's sdpa_forward(q, k, v, causal=True) gives when merge is right."""
    from ..parallel.ring_attention import block_attention, step_kind

    q, k, v = (np.asarray(a) for a in (q, k, v))
    qs, ks, vs = (np.split(a, N, axis=2) for a in (q, k, v))
    outs, lses = [], []
    for r in range(N):
        out = np.zeros_like(qs[r])
        lse = np.full(qs[r].shape[:-1], -np.inf)
        for s in range(N):
            j = (r - s) % N
            part = block_attention(qs[r], ks[j], vs[j], step_kind(r, j, causal))
            if part is not None:
                out, lse = merge(out, lse, *part)
        outs.append(np.asarray(out))
        lses.append(np.asarray(lse))
    return np.concatenate(outs, axis=2), np.concatenate(lses, axis=2)


def _quiet_call(fn):
    """fn with NumPy's floating-point warnings silenced (the checker judges values; a warning is no error)."""

    def run(*args):
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            return fn(*args)

    run.__name__ = getattr(fn, "__name__", "merge")
    return run


def check_attention_merge(fn, *, seed=None, task=None, quiet=False) -> CheckResult:
    """Check out, lse = fn(out1, lse1, out2, lse2) (module docstring). Returns a CheckResult."""
    name = "attention_merge"
    seed = opcheck.learner_fn_and_seed(name, fn, seed, "inputs")
    taken = borrowed.borrowed_verdict(
        name, [fn], OWN[name], task=task, seed=seed, quiet=quiet, check="check_attention_merge"
    )
    if taken is not None:
        return taken
    rng = np.random.default_rng(seed)
    cases = _merge_cases(rng)
    n = len(cases) + 1
    quiet_fn = _quiet_call(fn)
    for i, (what, (o1, l1, o2, l2, o, lse)) in enumerate(cases):
        dims = {"shape": list(o1.shape), "call": i + 1}
        where = f"{what}: out_i {o1.shape}, lse_i {l1.shape}, call {i + 1} of {n}; seed {seed}"

        def fail(msg, hint):
            return _result(name, task, "wrong", f"{name}: wrong - {msg} ({where})", hint, seed, dims, quiet)

        inputs = (o1, l1, o2, l2)
        given = tuple(a.copy() for a in inputs)
        res, err = _call(name, quiet_fn, given, seed, task, dims, quiet, where)
        if err is not None:
            return err
        if not (isinstance(res, (tuple, list)) and len(res) == 2):
            return fail(f"merge returned {type(res).__name__}", "return the pair (out, lse)")
        try:
            ours_o, ours_l = (np.asarray(a, dtype=np.float64) for a in res)
        except (TypeError, ValueError):
            return fail("merge returned something that is not two arrays of numbers", "return (out, lse) as arrays")
        if ours_o.shape != o.shape:
            return fail(
                f"out has shape {ours_o.shape}, expected out1's {o.shape}", "out has the shape of out1 and out2"
            )
        if ours_l.shape != lse.shape:
            hint = (
                "one lse per query: lse has lse1's shape (drop the kept axis)"
                if ours_l.shape == lse.shape + (1,)
                else "lse has the shape of lse1 and lse2: one value per query"
            )
            return fail(f"lse has shape {ours_l.shape}, expected lse1's {lse.shape}", hint)
        changed = [
            nm
            for nm, a, b in zip(("out1", "lse1", "out2", "lse2"), inputs, given)
            if not np.array_equal(a, b, equal_nan=True)
        ]
        if changed:
            return fail(
                f"merge changed {', '.join(changed)} (in place)",
                "compute into new arrays and leave the inputs as they were: the caller (a ring step) still owns them",
            )
        fin1, fin2 = np.isfinite(l1), np.isfinite(l2)
        both, one, none = fin1 & fin2, fin1 ^ fin2, ~(fin1 | fin2)
        rows = {"both": both, "one": one, "none": none}
        nan_o = ~np.isfinite(ours_o).all(axis=-1)
        for kind, hint in (("one", _ONE_EMPTY), ("none", _BOTH_EMPTY)):
            r = rows[kind]
            bad = r & (np.isnan(ours_l) | nan_o)
            if bad.any():
                at = tuple(int(v) for v in np.argwhere(bad)[0])
                side = "neither side" if kind == "none" else "one side"
                return fail(
                    f"NaN at query {fmt_index(at)}, where {side} saw a key (lse1 {l1[at]}, lse2 {l2[at]})", hint
                )
        bad = both & (~np.isfinite(ours_l) | nan_o)
        if bad.any():
            at = tuple(int(v) for v in np.argwhere(bad)[0])
            return fail(
                f"out or lse is not finite at query {fmt_index(at)} (lse {ours_l[at]}; lse1 {l1[at]:.6g}, lse2 "
                f"{l2[at]:.6g}), where the answer is (lse {lse[at]:.6g})",
                _OVERFLOW if i == 2 else "out and lse are finite wherever a side saw a key",
            )
        if both.any():
            variants = _merge_variants(o1, l1, o2, l2)
            bad_o = _first_bad(ours_o[both], o[both])
            bad_l = _first_bad(ours_l[both], lse[both])
            if bad_o is not None or bad_l is not None:
                parts = []
                if bad_o is not None:
                    parts.append(
                        f"out of query row {_row(both, bad_o[0][0])}: yours {fmt(bad_o[1], bad_o[2])}, "
                        f"expected {fmt(bad_o[2], bad_o[1])} (element {bad_o[0][1]})"
                    )
                if bad_l is not None:
                    parts.append(
                        f"lse of query row {_row(both, bad_l[0][0])}: yours {fmt(bad_l[1], bad_l[2])}, "
                        f"expected {fmt(bad_l[2], bad_l[1])}"
                    )
                msg = "; ".join(parts) + " (rows where both sides saw keys)"
                for kind, hint in _OUT_MISTAKES if bad_o is not None else ():
                    if _near(ours_o[both], variants[kind][both]) and not _near(o[both], variants[kind][both]):
                        return fail(msg, hint)
                for kind, hint in _LSE_MISTAKES if bad_l is not None else ():
                    if _near(ours_l[both], variants[kind][both]) and not _near(lse[both], variants[kind][both]):
                        return fail(msg, hint)
                if i == 2 and bad_l is not None and not np.isfinite(ours_l[both]).all():
                    return fail(msg, _OVERFLOW)
                return fail(
                    msg,
                    "the union's softmax mass is exp(lse1) + exp(lse2): lse is its log, and out the "
                    "average of out1 and out2 weighted by each side's share of it",
                )
        if one.any():
            other_o = np.where(fin1[..., None], o1, o2)
            other_l = np.where(fin1, l1, l2)
            bad = one & ~((ours_o == other_o).all(axis=-1) & (ours_l == other_l))
            if bad.any():
                at = tuple(int(v) for v in np.argwhere(bad)[0])
                return fail(
                    f"query {fmt_index(at)}, where only one side saw keys (lse1 {l1[at]:.6g}, lse2 "
                    f"{l2[at]:.6g}): yours out {np.round(ours_o[at][:3], 6).tolist()}... lse {ours_l[at]:.9g}, "
                    f"expected that side's out {np.round(other_o[at][:3], 6).tolist()}... lse "
                    f"{other_l[at]:.9g}, exactly",
                    _ONE_EMPTY,
                )
        if none.any():
            bad = none & ~((ours_o == 0).all(axis=-1) & (ours_l == -np.inf))
            if bad.any():
                at = tuple(int(v) for v in np.argwhere(bad)[0])
                return fail(
                    f"query {fmt_index(at)}, where neither side saw a key: yours out "
                    f"{np.round(ours_o[at][:3], 6).tolist()}... lse {ours_l[at]}, expected out 0 and lse -inf",
                    _BOTH_EMPTY,
                )
    # last: the merge inside a ring of 4 simulated ranks (causal attention), against one rank
    B, nh, T, hs, N = 1, 2, 8, 4, 4
    q, k, v = (rng.standard_normal((B, nh, T, hs)) for _ in range(3))
    from ..reference.attention import sdpa_forward

    want_o, cache = sdpa_forward(q, k, v, causal=True)
    want_l = cache["lse"]
    dims = {"B": B, "nh": nh, "T": T, "hs": hs, "N": N, "call": n}
    where = (
        f"causal ring attention of N={N} simulated ranks merging with your merge, q, k, v {(B, nh, T, hs)} in "
        f"blocks of {T // N}, call {n} of {n}; seed {seed}"
    )
    res, err = _call(name, ring_with_merge, (quiet_fn, q, k, v, N), seed, task, dims, quiet, where)
    if err is not None:
        return err
    ours_o, ours_l = (np.asarray(a, dtype=np.float64) for a in res)
    for what, ours, want in (("out", ours_o, want_o), ("lse", ours_l, want_l)):
        bad = _first_bad(ours, want) if ours.shape == want.shape else ((0,), float("nan"), float("nan"))
        if bad is not None:
            idx, yv, ev = bad
            t = idx[2] if len(idx) > 2 else 0
            return _result(
                name,
                task,
                "wrong",
                f"{name}: wrong - rank {t // (T // N)}'s {what}{fmt_index(idx)}: yours "
                f"{fmt(yv, ev)}, expected {fmt(ev, yv)}, one rank's causal attention ({where})",
                "each rank starts from out 0, lse -inf and merges one partial result per step into what it "
                "has merged so far: merge must stay right when one side is its own earlier result (the "
                "start state has lse -inf on every row)",
                seed,
                dims,
                quiet,
            )
    return _result(
        name,
        task,
        "correct",
        f"{name}: correct ({len(cases)} cases: (B, nh) and no leading axes, scores "
        f"near +-1000, rows where one side or neither saw a key; and in a causal ring of {N} ranks; float64 "
        f"to {TOL:g}; seed {seed})",
        seed=seed,
        dims={"cases": n},
        quiet=quiet,
    )


def _row(mask, k):
    """The index (as text) of the k-th True element of mask: a query row of the leading axes."""
    return fmt_index(tuple(int(v) for v in np.argwhere(mask)[k]))


# ----------------------------------------------------------------------------------------------------------------
# 13.3 the 1F1B tick table
# ----------------------------------------------------------------------------------------------------------------
# (p, m): the lesson's table, m >> p, m < p - 1 (a warm-up capped at m), m = p, one stage, one micro-batch, ...
_PIPE_CASES = ((3, 4), (4, 8), (2, 9), (4, 2), (3, 3), (1, 1), (1, 3), (2, 1), (5, 3), (6, 16))


def _pipe_cases(rng):
    """The fixed pairs, a random one (p in 2..6, m in 1..12), and the first again (a table kept between calls)."""
    return list(_PIPE_CASES) + [(int(rng.integers(2, 7)), int(rng.integers(1, 13))), _PIPE_CASES[0]]


def _label(cell) -> str:
    return "idle" if cell is None else f"{cell[0]}{cell[1]}"


def _table_shape(table, p):
    """(list of ticks, each a tuple, None) or (None, (message, hint)) when the table is not a list of ticks of p
    cells."""
    if not isinstance(table, (list, tuple)):
        return None, (f"returned {type(table).__name__}", "return a list of ticks, each a tuple of p cells")
    if not table:
        return None, (
            "the table is empty",
            "return a list of ticks, each a tuple of p cells, until the last op has run",
        )
    bad = [t for t, tick in enumerate(table) if not isinstance(tick, (list, tuple))]
    if bad:
        return None, (
            f"tick {bad[0]} is a {type(table[bad[0]]).__name__}, not a tuple of cells",
            "every tick is a tuple of p cells, cell s what stage s runs (None when it is idle)",
        )
    lens = [len(tick) for tick in table]
    if len(table) == p and len(set(lens)) == 1 and lens[0] != p:
        return None, (
            f"the table has {p} rows of {lens[0]} cells: one row per stage",
            "the table is transposed: it is a list of TICKS, each a tuple of p cells (table[t][s] is what "
            "stage s runs at tick t), as format_schedule prints it column by column",
        )
    if lens[0] != p:
        return None, (
            f"tick 0 has {lens[0]} cell{'s' if lens[0] != 1 else ''}, and there are p = {p} stages",
            "a tick holds one cell per stage, None where the stage is idle (cell s is stage s's)",
        )
    ragged = [t for t, n in enumerate(lens) if n != p]
    if ragged:
        t = ragged[0]
        return None, (
            f"tick {t} has {lens[t]} cell{'s' if lens[t] != 1 else ''} and tick 0 has {p}",
            "every tick holds one cell per stage, None where the stage is idle: keep the idle cells, since "
            "a cell's position is its stage",
        )
    return [tuple(tick) for tick in table], None


def _invalid_hint(text, p, m, table):
    if "never runs the backward" in text:
        ran = [{int(tick[s][1]) for tick in table if tick[s] is not None and tick[s][0] == "B"} for s in range(p)]
        missing = [set(range(m)) - r for r in ran]
        if missing == [set(range(m - min(p - s - 1, m), m)) for s in range(p)]:
            return (
                "no cool-down: after the steady state stage s still owes the backwards of the micro-batches its "
                "warm-up started (the last min(p - s - 1, m) of them): its order ends with those backwards"
            )
        return (
            "every stage runs the backward of each of the m micro-batches; the table ends with the tick of the last op"
        )
    if "never runs the forward" in text:
        return "every stage runs the forward of each of the m micro-batches, and then its backward"
    if "names micro-batch" in text:
        if m < p - 1:
            return (
                f"a micro-batch that does not exist: with m = {m} < p - 1 = {p - 1} the warm-up must be capped at "
                "m, min(p - s - 1, m) forwards on stage s"
            )
        return "micro-batches are numbered 0 .. m - 1"
    if "twice" in text:
        return "each op runs once on each stage: F i and B i of every micro-batch, one tick each"
    if "before" in text:
        return (
            "an op runs only after what it waits for has finished (in an earlier tick): a forward after the "
            "previous stage's forward of its micro-batch, a backward after the next stage's backward of it and "
            "after its own stage's forward"
        )
    if "tick(s)" in text:
        return "a forward and a backward take one tick each here: each op fills one cell"
    return "a cell is None or one op, ('F', i) or ('B', i), with i a micro-batch 0 .. m - 1"


def _peak_at(table, s):
    """(peak, the first tick it is reached) of the micro-batches stage s holds (as pipeline.peak_activations)."""
    held, peak, at = set(), 0, 0
    for t, tick in enumerate(table):
        cell = tick[s]
        if cell is None:
            continue
        if cell[0] == "F":
            held.add(cell[1])
        if len(held) > peak:
            peak, at = len(held), t
        if cell[0] == "B" and (t + 1 == len(table) or table[t + 1][s] != cell):
            held.discard(cell[1])
    return peak, at


_GPIPE = (
    "that is GPipe's order: stage s holds m micro-batches, 1F1B holds at most p - s; after its warm-up of "
    "p - s - 1 forwards a stage alternates one forward and one backward, so each backward frees a micro-batch "
    "before the next forward takes one"
)
_WARMUP_PLUS_ONE = (
    "a warm-up of p - s forwards, one too many: stage s then holds p - s + 1 micro-batches; 1F1B's "
    "warm-up is p - s - 1 forwards (none on the last stage, which runs B0 right after F0)"
)


def check_one_f_one_b(fn, *, seed=None, task=None, quiet=False) -> CheckResult:
    """Check table = fn(p, m) (module docstring). Returns a CheckResult."""
    from ..parallel import pipeline

    name = "one_f_one_b"
    seed = opcheck.learner_fn_and_seed(name, fn, seed, "cases")
    taken = borrowed.borrowed_verdict(
        name, [fn], OWN[name], task=task, seed=seed, quiet=quiet, check="check_one_f_one_b"
    )
    if taken is not None:
        return taken
    rng = np.random.default_rng(seed)
    cases = _pipe_cases(rng)
    for i, (p, m) in enumerate(cases):
        dims = {"p": p, "m": m, "call": i + 1}
        where = f"p={p} stages, m={m} micro-batches, case {i + 1} of {len(cases)}; seed {seed}"
        note = (
            "; the same p and m were right on an earlier call: does your function keep state between calls?"
            if i == len(cases) - 1
            else ""
        )

        def fail(msg, hint):
            return _result(name, task, "wrong", f"{name}: wrong - {msg}{note} ({where})", hint, seed, dims, quiet)

        def lead(exc, p=p, m=m):
            if m < p - 1:
                return (
                    f"the error is in your code, on a case with fewer micro-batches than p - 1 (m = {m}, p = {p}): "
                    "is the warm-up capped at m, min(p - s - 1, m) forwards on stage s?"
                )
            return None

        table, err = _call(name, fn, (p, m), seed, task, dims, quiet, where, lead=lead)
        if err is not None:
            return err
        table, problem = _table_shape(table, p)
        if problem is not None:
            return fail(*problem)
        try:
            pipeline.validate_schedule(table, m)
        except ValueError as e:
            text = str(e)
            return fail(f"{text.removeprefix('validate_schedule: ')}", _invalid_hint(text, p, m, table))
        table = [tuple(None if c is None else (c[0], int(c[1])) for c in tick) for tick in table]
        want = pipeline.one_f_one_b_schedule(p, m)
        T = 2 * (m + p - 1)
        if len(table) != T:
            idle_end = 0
            while idle_end < len(table) and all(c is None for c in table[len(table) - 1 - idle_end]):
                idle_end += 1
            ours_b, want_b = pipeline.bubble_fraction(table), (p - 1) / (m + p - 1)
            msg = (
                f"your table has {len(table)} ticks, a bubble of {ours_b:.3f}; 1F1B's has 2 (m + p - 1) = {T} "
                f"ticks and a bubble of (p - 1) / (m + p - 1) = {want_b:.3f}"
            )
            if idle_end and len(table) - idle_end <= T:
                return fail(
                    msg + f" (your last {idle_end} tick{'s are' if idle_end > 1 else ' is'} all idle)",
                    "the table is padded with idle ticks at the end: it ends with the tick of the last op "
                    "(the bubble is counted over the table's ticks)",
                )
            return fail(
                msg,
                "each op runs at the first tick at which its stage is free and what it waits for has "
                "finished: no stage waits longer than that",
            )
        peaks = [_peak_at(table, s) for s in range(p)]
        limit = [min(p - s, m) for s in range(p)]
        over = [s for s in range(p) if peaks[s][0] > limit[s]]
        if over:
            s = over[0]
            msg = (
                f"stage {s} holds the activations of {peaks[s][0]} micro-batches at once (at tick {peaks[s][1]}), "
                f"1F1B at most min(p - s, m) = {limit[s]} (peaks per stage: {[pk for pk, _ in peaks]})"
            )
            if [pk for pk, _ in peaks] == [m] * p or table == pipeline.gpipe_schedule(p, m):
                return fail(msg, _GPIPE)
            if [pk for pk, _ in peaks] == [min(p - q + 1, m) for q in range(p)]:
                return fail(msg, _WARMUP_PLUS_ONE)
            return fail(
                msg,
                "1F1B frees a micro-batch's activations as early as it can: after p - s - 1 warm-up "
                "forwards stage s alternates one forward and one backward",
            )
        diff = [(t, s) for t in range(T) for s in range(p) if table[t][s] != want[t][s]]
        if diff:
            t, s = diff[0]
            return fail(
                f"tick {t}, stage {s}: yours {_label(table[t][s])}, 1F1B's {_label(want[t][s])} (your table is "
                f"valid, with 1F1B's bubble and memory, in another order)",
                "stage s runs 1F1B's order (p - s - 1 forwards, then one forward and one backward in turn, "
                "then the backwards still owed), each op at the first tick its stage is free and what it "
                "waits for has finished",
            )
    return _result(
        name,
        task,
        "correct",
        f"{name}: correct ({len(cases)} tables, p = 1 to 6 stages, m = 1 to 16 "
        f"micro-batches: valid, bubble (p - 1) / (m + p - 1), at most p - s micro-batches held on stage s; "
        f"seed {seed})",
        seed=seed,
        dims={"cases": len(cases)},
        quiet=quiet,
    )
