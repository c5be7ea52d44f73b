"""Checkers for lesson 12 (memory at scale): gradient accumulation, block-wise 8-bit quantisation, and the gradient
buckets that data parallel fills in backward order.

They follow the conventions of the course's checkers (``gpullm_lessons.checks.verdict``): fresh random inputs on every call
(the seed is printed), one verdict printed and recorded (not attempted / error / wrong with a hint naming the mistake
/ correct), your exceptions reported and never raised, ``task=`` for grading, ``quiet=``.

``check_accumulate(fn)`` (exercise 12.1), fn called as

    loss, grad = fn(grad_fn, x, y, K)

grad_fn(xb, yb) -> (loss, grad): the mean loss of a batch of rows and its gradient (a flat float64 array), here a
softmax regression the checker builds; x (B, d) float64 and y (B,) int64 are one batch; K divides B. fn must return
the loss and the gradient of the mean over the whole batch computed from K micro-batches of B / K consecutive rows,
calling grad_fn once per micro-batch and never on more than B / K rows. grad_fn may return the same array on every
call, refilled with the new gradient (a training engine's gradient buffer works that way): what it returns is valid
until the next call, so fn adds it into an accumulator of its own and never keeps it. Checked for K = 1, 2, 3, 4 and
8 rows split 8 ways, twice on fresh inputs (an accumulator kept between calls fails the second), and once more with
a grad_fn that returns one array refilled (a function that keeps what grad_fn returned fails there), against
grad_fn on the whole batch, float64 to 1e-12. The named mistakes: no 1/K, only the last micro-batch, dividing by the rows of a
micro-batch, a micro-batch of K rows (B / K of them), grad_fn on the whole batch.

``check_quantize_blockwise(quantize, dequantize)`` (exercise 12.2), called as

    q, scales = quantize(x, block)          x = dequantize(q, scales, block)

x float32 (n,) with n any size; q int8 (n,): round(x / a * 127) with a the absolute maximum of x's block of `block`
consecutive values (the last block may be shorter); scales float32 (ceil(n / block),), the blocks' absmax; a block of
zeros has scale 0 and q 0. dequantize returns float32 (n,) = q * scale / 127 of each value's block. Checked on n a
multiple of the block and not, n < block, a block of zeros and a block with one large value, against the reference
(quant.quantize_blockwise): q and the scales exactly, dequantize within half a level of each block. The named
mistakes: one scale for the whole vector, the max instead of the absolute max, truncation instead of rounding, 128 or
255 levels instead of 127, the last partial block dropped, division by a zero scale.

``check_bucket_assignment(fn)`` (exercise 12.3), fn called as

    buckets = fn(sizes, limit)

sizes: the element counts of the gradient tensors in the order the forward pass uses them (backward finishes the last
first); limit: the most elements a bucket holds. fn returns a list of buckets, each a list of tensor indices (any
order inside a bucket), the first bucket holding the tensors backward finishes first: walking from the last tensor to
the first, a tensor joins the open bucket while its total stays <= limit, else it starts the next bucket; a tensor
larger than limit gets one of its own (parallel.assign_buckets, which data parallel uses). Checked every call on
random sizes with a bucket filled exactly to the limit, everything in one bucket, a tensor larger than the limit, a
limit below every tensor, no tensors and one, and the tiny GPT's gradient tensors. The named mistakes: forward order
instead of backward, a bucket over the limit, a tensor split across buckets (or in two) or missing, the last bucket
never closed, the off-by-one at the boundary (a tensor that fills the bucket exactly goes to the next one), a bucket
closed with room left, everything in one bucket whatever the limit.
"""

from __future__ import annotations

import math
import warnings

import numpy as np

from . import borrowed, opcheck, verdict
from ..model import quant
from .verdict import CheckResult

# the course's own implementations of the tasks (checks/borrowed.py): an answer that is, wraps or calls one is not correct
OWN = {
    "quantize_blockwise": ("gpullm_lessons.model.quant:quantize_blockwise", "gpullm_lessons.model.quant:dequantize_blockwise"),
    "assign_buckets": ("gpullm_lessons.parallel.buckets:assign_buckets",),
}

__all__ = ["check_accumulate", "check_quantize_blockwise", "check_bucket_assignment", "softmax_regression"]

_FIELDS = {"dtype": "float64", "arrays": "numpy"}


def _result(name, task, status, msg, hint=None, seed=None, dims=None, quiet=False):
    return verdict.verdict(name, task, status, msg, hint, quiet=quiet, seed=seed, dims=dims, **_FIELDS)


def _call(name, fn, args, seed, task, dims, quiet, where, who="function"):
    value, failed = verdict.call_learner(name, fn, args, context=where, task=task, seed=seed, dims=dims, who=who,
                                         **_FIELDS)
    return (value, None) if failed is None else (None, verdict.record(failed, quiet=quiet))


# ----------------------------------------------------------------------------------------------------------------
# 12.1 gradient accumulation
# ----------------------------------------------------------------------------------------------------------------
def softmax_regression(W, reuse=False):
    """grad_fn(x, y) -> (mean cross-entropy of softmax(x W) against y, its gradient wrt W, flattened), float64.
    It records the number of rows of every call in grad_fn.calls. reuse: every call returns the same array, refilled
    (as a training engine's gradient buffer is): what it returned before holds the latest gradient."""
    W = np.asarray(W, np.float64)
    buffer = np.empty(W.size)

    def grad_fn(x, y):
        x, y = np.asarray(x, np.float64), np.asarray(y)
        grad_fn.calls.append(x.shape[0])
        z = x @ W
        z = z - z.max(axis=1, keepdims=True)
        p = np.exp(z)
        p /= p.sum(axis=1, keepdims=True)
        b = x.shape[0]
        loss = float(-np.log(p[np.arange(b), y]).mean())
        p[np.arange(b), y] -= 1.0
        grad = (x.T @ p / b).reshape(-1)
        if reuse:
            buffer[...] = grad
            return loss, buffer
        return loss, grad

    grad_fn.calls = []
    return grad_fn


def _accumulated(grad_fn, x, y, K, kind="right"):
    """What a right answer and each named mistake return for (x, y) in K micro-batches (float64)."""
    B = x.shape[0]
    b = min(K, B) if kind == "rows_k" else B // K  # rows_k: K micro-batches of K rows (the first K * K rows)
    parts = [grad_fn(x[i * b:(i + 1) * b], y[i * b:(i + 1) * b]) for i in range(K)]
    losses = np.array([p[0] for p in parts])
    grads = np.array([p[1] for p in parts])
    if kind == "no_scale":
        return float(losses.sum()), grads.sum(0)
    if kind == "last":
        return float(losses[-1]), grads[-1]
    if kind == "by_rows":
        return float(losses.sum() / b), grads.sum(0) / b
    return float(losses.mean()), grads.mean(0)


_ACC_MISTAKES = [
    ("no_scale", "the micro-batches' gradients are summed, not averaged: each is the gradient of its micro-batch's "
                 "mean loss, so the batch's mean is their sum / K (scale each by 1/K, or the loss before backward)"),
    ("last", "only the last micro-batch's gradient is returned: add each micro-batch's gradient into an accumulator "
             "(acc += g / K) instead of replacing it"),
    ("by_rows", "divided by the rows of a micro-batch: grad_fn already returns the mean over its rows, so the K "
                "micro-batches are averaged with 1/K"),
    ("rows_k", "micro-batches of K rows (B / K of them): the batch of B rows splits into K micro-batches of B / K "
               "rows each"),
]
_WHOLE = ("grad_fn was given more than one micro-batch's rows at once: accumulation exists to call it on B / K rows "
          "at a time (only one micro-batch's activations in memory)")
_KEPT = ("grad_fn returned the same array on every call, refilled with the new micro-batch's gradient (as a training "
         "engine's gradient buffer is), and your function kept that array (in a list, or as the accumulator it then "
         "adds into): by the end it holds only the last gradient. What grad_fn returns is yours to read until the "
         "next call: add it into an accumulator of your own (a new array, not the one grad_fn handed you), never keep "
         "the array itself")


def check_accumulate(fn, *, seed=None, task=None, quiet=False) -> CheckResult:
    """Check loss, grad = fn(grad_fn, x, y, K) (module docstring). Returns a CheckResult."""
    name = "accumulate"
    seed = opcheck.learner_fn_and_seed(name, fn, seed, "batches")
    rng = np.random.default_rng(seed)
    # the last case: a grad_fn that returns one array on every call, refilled (the contract allows it)
    cases = [(12, 4, 3, 2), (12, 4, 3, 3), (16, 5, 4, 4), (8, 3, 2, 8), (6, 4, 3, 1), (12, 4, 3, 3), (12, 4, 3, 3)]
    for i, (B, d, c, K) in enumerate(cases):
        W = rng.standard_normal((d, c))
        x, y = rng.standard_normal((B, d)), rng.integers(0, c, B)
        dims = {"B": B, "K": K, "d": d, "classes": c}
        reuse = i == len(cases) - 1
        where = (f"B={B}, K={K}, case {i + 1} of {len(cases)}{', grad_fn reusing its returned array' if reuse else ''}"
                 f"; seed {seed}")
        g = softmax_regression(W, reuse=reuse)
        out, err = _call(name, fn, (g, x.copy(), y.copy(), K), seed, task, dims, quiet, where)
        if err is not None:
            return err
        if not (isinstance(out, tuple) and len(out) == 2):
            return _result(name, task, "wrong", f"{name}: wrong - return (loss, grad), got {type(out).__name__} "
                           f"({where})", "return a pair: the mean loss (a float) and the gradient (a flat array)",
                           seed, dims, quiet)
        loss, grad = out
        grad = np.asarray(grad, np.float64)
        want_loss, want = _accumulated(softmax_regression(W), x, y, K)
        if grad.shape != want.shape:
            return _result(name, task, "wrong", f"{name}: wrong - the gradient has shape {grad.shape}, expected "
                           f"{want.shape} (grad_fn's) ({where})", "return the accumulated flat gradient", seed, dims,
                           quiet)
        ok = (np.abs(grad - want).max() <= 1e-12 * max(1.0, np.abs(want).max())
              and abs(float(loss) - want_loss) <= 1e-12 * max(1.0, abs(want_loss)))
        if g.calls and max(g.calls) > B // K:
            return _result(name, task, "wrong", f"{name}: wrong - grad_fn was called on {max(g.calls)} rows at once; "
                           f"a micro-batch has B / K = {B // K} ({where})", _WHOLE, seed, dims, quiet)
        if ok:
            continue
        msg = (f"{name}: wrong - loss {float(loss):.6g} (expected {want_loss:.6g}), gradient off by up to "
               f"{np.abs(grad - want).max():.3g} ({where})")
        if reuse:
            try:            # the same inputs with a grad_fn that returns new arrays
                again = fn(softmax_regression(W), x.copy(), y.copy(), K)
                fresh = np.abs(np.asarray(again[1], np.float64) - want).max() <= 1e-12 * max(1.0, np.abs(want).max())
            except Exception:  # noqa: BLE001 - not this mistake: the hints below
                fresh = False
            if fresh:   # right with a grad_fn that returns new arrays: the array it was handed was kept
                return _result(name, task, "wrong", msg, _KEPT, seed, dims, quiet)
        if i == len(cases) - 2:
            msg += "; the same shapes were right on an earlier call: does your function keep state between calls?"
        grad_ok = np.abs(grad - want).max() <= 1e-12 * max(1.0, np.abs(want).max())
        for kind, hint in _ACC_MISTAKES:  # the loss or the gradient (whichever is wrong) as the mistake, or 1/K of it
            with np.errstate(all="ignore"), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a variant may take empty micro-batches (NaN): it matches nothing
                wl, wg = _accumulated(softmax_regression(W), x, y, K, kind)
            if grad_ok:
                like = [c * wl for c in (1.0, 1.0 / K) if not math.isclose(c * wl, want_loss, rel_tol=1e-9)]
                if any(math.isclose(float(loss), v, rel_tol=1e-9) for v in like):
                    return _result(name, task, "wrong", msg, hint, seed, dims, quiet)
                continue
            like = [c * wg for c in (1.0, 1.0 / K) if not np.allclose(c * wg, want, rtol=1e-9, atol=1e-12)]
            if any(np.allclose(grad, v, rtol=1e-9, atol=1e-12) for v in like):
                return _result(name, task, "wrong", msg, hint, seed, dims, quiet)
        return _result(name, task, "wrong", msg, "the gradient of the batch's mean loss is the mean of the K "
                       "micro-batches' gradients (each grad_fn call returns its micro-batch's mean); the loss too",
                       seed, dims, quiet)
    return _result(name, task, "correct", f"{name}: correct ({len(cases)} batches, K = 1 to 8, the last with a grad_fn "
                   f"that reuses its returned array; float64 to 1e-12; "
                   f"seed {seed})", seed=seed, dims={"cases": len(cases)}, quiet=quiet)


# ----------------------------------------------------------------------------------------------------------------
# 12.2 block-wise 8-bit quantisation
# ----------------------------------------------------------------------------------------------------------------
def _q_variant(x, block, kind):
    """(q, scales) of the reference with one named mistake (int64 q: before any int8 wrap-around)."""
    n, nb = x.size, max(1, math.ceil(x.size / block)) if x.size else 0
    pad = np.zeros(nb * block)
    pad[:n] = x
    blk = pad.reshape(nb, block)
    levels = 127
    if kind == "one_scale":
        s = np.full(nb, np.abs(x).max() if n else 0.0)
    elif kind == "max":
        s = blk.max(axis=1)
    else:
        s = np.abs(blk).max(axis=1)
    if kind in ("levels_128", "levels_255"):
        levels = int(kind.split("_")[1])
    safe = np.where(s != 0, s, 1.0)
    r = blk / safe[:, None] * levels
    q = np.trunc(r) if kind == "trunc" else np.rint(r)
    q = q.reshape(-1)[:n]
    if kind in ("levels_128", "levels_255", "max"):
        q = ((q.astype(np.int64) + 128) % 256 - 128)  # what astype(int8) makes of values past 127
    if kind == "drop_last" and n % block:
        return q[: (n // block) * block], s[: n // block]
    return q.astype(np.int64), s


_Q_MISTAKES = [
    ("one_scale", "one scale for the whole vector: each block of `block` consecutive values has its own absmax "
                  "(one large value then spoils only its block)"),
    ("max", "the scale is the block's max, not its absolute max: a negative value larger in size than the max "
            "lands outside [-127, 127] and wraps around in int8 (use np.abs(...).max())"),
    ("trunc", "the values are truncated (astype(np.int8) cuts toward zero): round to the nearest level first "
              "(np.rint)"),
    ("levels_128", "128 levels: x / a * 128 reaches 128 at the absmax, which int8 wraps to -128; use 127"),
    ("levels_255", "255 levels: a signed int8 holds -127..127 symmetrically; use 127"),
    ("drop_last", "the last, shorter block is missing: n values in blocks of `block` need ceil(n / block) blocks"),
]


def _q_cases(rng):
    big = rng.standard_normal(300).astype(np.float32)
    big[40] = 50.0
    zeros = rng.standard_normal(200).astype(np.float32)
    zeros[64:128] = 0.0
    neg = rng.standard_normal(130).astype(np.float32)
    neg[7] = -9.0
    return [(rng.standard_normal(256).astype(np.float32), 64), (big, 128), (zeros, 64), (neg, 64),
            (rng.standard_normal(5).astype(np.float32), 16), (rng.standard_normal(1000).astype(np.float32), 256)]


def check_quantize_blockwise(quantize, dequantize, *, seed=None, task=None, quiet=False) -> CheckResult:
    """Check q, scales = quantize(x, block) and dequantize(q, scales, block) (module docstring)."""
    name = "quantize_blockwise"
    seed = opcheck.learner_fn_and_seed(name, quantize, seed, "vectors")
    opcheck.learner_fn_and_seed(name, dequantize, seed, "vectors")
    taken = borrowed.borrowed_verdict(name, [quantize, dequantize], OWN[name], task=task, seed=seed, quiet=quiet,
                                      check="check_quantize_blockwise")
    if taken is not None:
        return taken
    rng = np.random.default_rng(seed)
    cases = _q_cases(rng)
    for i, (x, block) in enumerate(cases):
        n = x.size
        dims = {"n": n, "block": block}
        where = f"n={n}, block={block}, case {i + 1} of {len(cases)}; seed {seed}"

        def wrong(msg, hint):
            return _result(name, task, "wrong", f"{name}: wrong - {msg} ({where})", hint, seed, dims, quiet)

        out, err = _call(name, quantize, (x.copy(), block), seed, task, dims, quiet, where, who="quantize")
        if err is not None:
            return err
        if not (isinstance(out, tuple) and len(out) == 2):
            return wrong(f"quantize returned {type(out).__name__}", "return the pair (q, scales)")
        q, s = (np.asarray(a) for a in out)
        want_q, want_s = quant.quantize_blockwise(x, block)
        for kind, hint in _Q_MISTAKES:
            vq, vs = _q_variant(x.astype(np.float64), block, kind)
            same_shape = vq.shape == q.shape and vs.shape == s.shape
            if (same_shape and np.array_equal(q.astype(np.int64), vq) and np.allclose(s, vs, rtol=1e-6)
                    and not (np.array_equal(vq, want_q.astype(np.int64)) and np.allclose(vs, want_s))):
                return wrong(f"q or the scales match the mistake named below (first wrong q at "
                             f"{_first_diff(q, want_q)})", hint)
        if q.dtype != np.int8:
            return wrong(f"q has dtype {q.dtype}", "q holds one byte per value: return q.astype(np.int8) after "
                         "rounding")
        if s.shape != want_s.shape:
            return wrong(f"{s.size} scales for {n} values in blocks of {block}, expected {want_s.size}",
                         "one scale per block: ceil(n / block), the last block shorter")
        if not np.all(np.isfinite(s)) or not np.allclose(s, want_s, rtol=1e-6):
            j = int(np.argmax(~np.isclose(s, want_s, rtol=1e-6)))
            return wrong(f"scale of block {j} is {s[j]}, expected {want_s[j]}", "each block's scale is the "
                         "largest absolute value among its values")
        if q.shape != want_q.shape or not np.array_equal(q, want_q):
            j = _first_diff(q, want_q)
            got = q[j] if q.shape == want_q.shape else "?"
            return wrong(f"q[{j}] = {got}, expected {want_q[j]} (x = {x[j]:.6g}, scale {want_s[j // block]:.6g})",
                         "q = round(x / a * 127) with a the absmax of x's block; a block of zeros gives q = 0 (do "
                         "not divide by a zero scale)")
        back, err = _call(name, dequantize, (want_q.copy(), want_s.copy(), block), seed, task, dims, quiet, where,
                          who="dequantize")
        if err is not None:
            return err
        back = np.asarray(back)
        want_back = quant.dequantize_blockwise(want_q, want_s, block)
        if back.shape != (n,):
            return wrong(f"dequantize returned shape {back.shape}, expected ({n},)", "one float per value")
        if not np.allclose(back, want_back, rtol=1e-6, atol=1e-7 * max(1.0, float(want_s.max(initial=0)))):
            j = int(np.argmax(~np.isclose(back, want_back, rtol=1e-6, atol=1e-7)))
            scaled = np.repeat(want_s, block)[:n] * want_q / 127
            hint = ("multiply each q by its own block's scale: scale = scales[i // block]"
                    if not np.allclose(back, scaled[::-1]) else "the blocks are in the wrong order")
            if np.allclose(back, want_q * want_s.max() / 127):
                hint = "every value used the largest scale: use the scale of the value's block, scales[i // block]"
            elif np.allclose(back, want_q.astype(np.float64) * np.repeat(want_s, block)[:n]):
                hint = "divide by the 127 levels: x ~ q / 127 * scale"
            return wrong(f"dequantize gave {back[j]:.6g} at {j}, expected {want_back[j]:.6g}", hint)
    return _result(name, task, "correct", f"{name}: correct ({len(cases)} vectors: partial last blocks, n < block, "
                   f"a block of zeros, outliers; q and scales exact; seed {seed})", seed=seed,
                   dims={"cases": len(cases)}, quiet=quiet)


def _first_diff(a, b):
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        return 0
    d = np.nonzero(a.astype(np.int64) != b.astype(np.int64))[0]
    return int(d[0]) if d.size else 0


# ----------------------------------------------------------------------------------------------------------------
# 12.3 gradient buckets in backward order
# ----------------------------------------------------------------------------------------------------------------
def _bucket_cases(rng):
    """(sizes, limit, what) cases; every call has the boundary case, one bucket, an oversized tensor, n = 0 and 1."""
    from ..model.params import GPTConfig, layer_segments

    limit = int(rng.integers(40, 80))
    a = int(rng.integers(5, limit - 5))
    exact = [int(v) for v in rng.integers(1, 30, 6)] + [limit - a, a]  # backward takes a, then limit - a: exactly full
    tiny = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, d_model=32)
    gpt = [hi - lo for layer in layer_segments(tiny) for _, lo, hi in layer]
    sizes = [int(v) for v in rng.integers(1, 50, int(rng.integers(12, 20)))]
    return [
        (exact, limit, "a bucket filled exactly to the limit"),
        (sizes, int(rng.integers(60, 120)), "random sizes"),
        (sizes[:5], sum(sizes[:5]) + int(rng.integers(0, 5)), "everything fits one bucket"),
        ([int(v) for v in rng.integers(1, 9, 5)] + [100] + [int(v) for v in rng.integers(1, 9, 4)], 30,
         "a tensor larger than the limit"),
        ([int(v) for v in rng.integers(10, 20, 4)], 9, "a limit below every tensor"),
        ([], 10, "no tensors"),
        ([7], 5, "one tensor"),
        (gpt, 4096, "the tiny GPT's 2 + 12 L + 2 gradient tensors, 16 KiB buckets"),
    ]


def _bucket_verdict(buckets, sizes, limit):
    """None if `buckets` is the assignment for (sizes, limit), else (what is wrong, the hint naming the mistake)."""
    from ..parallel.buckets import assign_buckets

    n = len(sizes)
    if not isinstance(buckets, (list, tuple)) or not all(isinstance(b, (list, tuple)) for b in buckets):
        return (f"returned {type(buckets).__name__}", "return a list of buckets, each a list of tensor indices")
    try:
        idx = [[int(i) for i in b] for b in buckets]
    except (TypeError, ValueError):
        return ("a bucket holds something that is not a tensor index", "each bucket lists tensor indices 0..n-1")
    flat = [i for b in idx for i in b]
    bad = [i for i in flat if not 0 <= i < n]
    if bad:
        return (f"index {bad[0]} is not a tensor (there are {n}: 0..{n - 1})", "list tensor indices, not sizes")
    where = {}
    for j, b in enumerate(idx):
        for i in b:
            if i in where:
                return (f"tensor {i} is in bucket {where[i]} and in bucket {j}",
                        "a tensor is never split across buckets, nor put in two: each index appears exactly once")
            where[i] = j
    if any(len(b) == 0 for b in idx):
        return (f"bucket {[len(b) for b in idx].index(0)} is empty", "close a bucket only when it holds a tensor")
    missing = sorted(set(range(n)) - set(flat))
    if missing:
        if missing == list(range(len(missing))):
            return (f"tensors {missing[0]}..{missing[-1]} (the last ones backward finishes) are in no bucket",
                    "the last open bucket was never added: after the loop, append the bucket still being filled")
        return (f"tensor {missing[0]} (size {sizes[missing[0]]}) is in no bucket",
                "every tensor goes into exactly one bucket: the tensor that does not fit starts the next bucket")
    order = [i for b in idx for i in sorted(b, reverse=True)]
    if order != list(range(n - 1, -1, -1)):
        if [i for b in idx for i in sorted(b)] == list(range(n)):
            return (f"bucket 0 holds tensor {sorted(idx[0])[0]}, which backward finishes last",
                    "the buckets are filled in forward order: backward finishes tensor n-1 first and tensor 0 last, "
                    "so walk from the last tensor to the first")
        return ("the buckets do not follow the order backward finishes the tensors",
                "each bucket is a run of consecutive tensors, the first bucket the last ones (walk from n-1 to 0)")
    totals = [sum(sizes[i] for i in b) for b in idx]
    for j, (b, t) in enumerate(zip(idx, totals)):
        if len(b) > 1 and t > limit:
            if len(idx) == 1:
                return (f"one bucket of all {n} tensors, {t} elements, over the limit of {limit}",
                        "this works only when everything fits one bucket: close the bucket when the next tensor "
                        "would take it past the limit, and start a new one with that tensor")
            return (f"bucket {j} holds {t} elements, over the limit of {limit}",
                    "check before adding: if total + size > limit, close the bucket first (a tensor larger than the "
                    "limit alone is the only bucket allowed over it)")
    for j in range(len(idx) - 1):
        nxt = sizes[max(idx[j + 1])]  # the first tensor of the next bucket: its highest index
        if totals[j] + nxt == limit:
            return (f"bucket {j} closed at {totals[j]} elements although the next tensor ({nxt}) fills it exactly to "
                    f"the limit of {limit}", "off by one at the boundary: a tensor fits when total + size <= limit "
                    "(not <)")
        if totals[j] + nxt < limit:
            return (f"bucket {j} closed at {totals[j]} elements with room for the next tensor ({nxt}, limit "
                    f"{limit})", "close a bucket only when the next tensor does not fit; reset its total when a new "
                    "bucket starts")
    want = assign_buckets(sizes, limit)
    if [sorted(b) for b in idx] != [sorted(b) for b in want]:
        return ("the buckets differ from the assignment", "fill greedily from the last tensor to the first")
    return None


def check_bucket_assignment(fn, *, seed=None, task=None, quiet=False) -> CheckResult:
    """Check buckets = fn(sizes, limit) (module docstring). Returns a CheckResult."""
    name = "assign_buckets"
    seed = opcheck.learner_fn_and_seed(name, fn, seed, "size lists")
    taken = borrowed.borrowed_verdict(name, [fn], OWN[name], task=task, seed=seed, quiet=quiet,
                                      check="check_bucket_assignment")
    if taken is not None:
        return taken
    rng = np.random.default_rng(seed)
    cases = _bucket_cases(rng)
    for i, (sizes, limit, what) in enumerate(cases):
        dims = {"n": len(sizes), "limit": limit}
        where = f"{what}: {len(sizes)} tensors, limit {limit}, case {i + 1} of {len(cases)}; seed {seed}"
        out, err = _call(name, fn, (list(sizes), limit), seed, task, dims, quiet, where)
        if err is not None:
            return err
        bad = _bucket_verdict(out, sizes, limit)
        if bad is not None:
            shown = sizes if len(sizes) <= 12 else f"{sizes[:12]}..."
            return _result(name, task, "wrong", f"{name}: wrong - {bad[0]} (sizes {shown}; {where})", bad[1], seed,
                           dims, quiet)
    return _result(name, task, "correct", f"{name}: correct ({len(cases)} cases: an exactly full bucket, one bucket, "
                   f"a tensor over the limit, n = 0 and 1, the tiny GPT's tensors; seed {seed})", seed=seed,
                   dims={"cases": len(cases)}, quiet=quiet)
