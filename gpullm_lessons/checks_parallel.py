"""Checkers for lesson 10 (multi-GPU): the ring all-reduce, simulated, and ZeRO-1's shard bookkeeping.

They follow the conventions of ``gpullm_lessons.checks``: fresh random inputs on every call (the seed is printed),
one verdict printed (not attempted / error / wrong with a hint / correct), your exceptions reported and never raised,
``task=`` for grading, ``quiet=``. Values are small integers stored as float64, so sums are exact and compared
exactly.

``check_ring_allreduce_sim(fn)`` (exercise 10.1), fn called as

    out, log = fn(chunks)

chunks: a float64 array (N, N, m): chunks[r, c] is rank r's chunk c (N ranks, each buffer cut into N chunks of m
elements). fn simulates the ring all-reduce (sum) and returns the chunks afterwards (N, N, m) (it may update the
input in place and return it) and its log: one list per step of the messages sent in that step, each
(src, dst, chunk), rank src sending its chunk `chunk` to rank dst = (src + 1) mod N. The first N-1 steps are the
reduce-scatter (the receiver adds what arrives into its chunk), the last N-1 the all-gather (the receiver
overwrites its chunk). Checked: every rank ends with every chunk's sum; 2(N-1) steps of N messages to the right
neighbour; replaying the log from the input gives your result.

``check_shard_bounds(fn)`` (exercise 10.2), fn called as ``lo, hi = fn(n, world, rank)``: the elements lo..hi-1 of
a flat buffer of n parameters that rank owns under ZeRO-1. Shards have S = ceil(n / world) elements each (so the
buffer padded to world * S splits evenly for reduce-scatter and all-gather), the last ones stop at n:
lo = min(rank * S, n), hi = min((rank + 1) * S, n).

``check_shard_decay_table(fn)`` (exercise 10.3), fn called as ``b, f = fn(bounds, flags, lo, hi)``: the AdamW decay
table of the shard lo..hi in shard-local indices. bounds (k+1,) int64 and flags (k,) uint8 describe the whole
buffer (tensor j is elements bounds[j] .. bounds[j+1]-1 and decays when flags[j] = 1). The result must start at
0, end at hi - lo, and give element i of the shard the flag of global element lo + i. Tensors outside the shard
may be dropped or kept as empty ranges.
"""
from __future__ import annotations


import numpy as np

from . import checks as _checks

__all__ = ["check_ring_allreduce_sim", "check_shard_bounds", "check_shard_decay_table", "ring_variant"]


def _result(name, task, status, msg, hint=None, seed=None, dims=None, quiet=False):
    result = _checks.CheckResult(name=name, task=task, status=status, passed=status == "correct",
                                 message=msg + (f"\n  hint: {hint}" if hint else ""), hint=hint, seed=seed,
                                 dtype="float64", arrays="numpy", dims=dims)
    from . import grading
    grading.record(check=f"check_{name}", task=task, status=status, message=msg)
    if not quiet:
        print(result.message)
    return result


def _seed(name, fn, seed):
    return _checks.learner_fn_and_seed(name, fn, seed, "inputs")


def _call(name, fn, args, seed, task, dims, quiet, where):
    """(value, None) or (None, CheckResult) for not attempted / error."""
    try:
        return fn(*args), None
    except NotImplementedError:
        return None, _result(name, task, "not attempted", f"{name}: not attempted (your function raised "
                             f"NotImplementedError)", hint="replace the `raise NotImplementedError` with your code",
                             seed=seed, dims=dims, quiet=quiet)
    except Exception as exc:  # the learner's error is reported, never raised
        first = " ".join(str(exc).split())
        first = first if len(first) <= 200 else first[:197] + "..."
        at = _checks._where_raised(exc)
        msg = f"{name}: error - your function raised {type(exc).__name__}" + (f": {first}" if first else "")
        hint = "the error is in your code" + (f" (at {at})" if at else "") + f"; {where}"
        return None, _result(name, task, "error", msg, hint=hint, seed=seed, dims=dims, quiet=quiet)


# ----------------------------------------------------------------------------------------------------------------
# 10.1 the ring all-reduce, simulated
# ----------------------------------------------------------------------------------------------------------------

def ring_variant(chunks, rs=lambda r, s, N: (r - s) % N, ag=lambda r, s, N: (r + 1 - s) % N, rs_steps=None,
                 ag_steps=None, ag_add=False):
    """The ring on a copy of chunks (N, N, m) with the chunk each rank sends at step s given by rs / ag, and the
    phases' step counts: the correct ring with the defaults, a named mistake otherwise. Returns (out, log)."""
    c = np.array(chunks, dtype=np.float64, copy=True)
    N = c.shape[0]
    log = []
    for phase, pick, steps in (("rs", rs, N - 1 if rs_steps is None else rs_steps),
                               ("ag", ag, N - 1 if ag_steps is None else ag_steps)):
        for s in range(steps):
            sends = [(r, (r + 1) % N, pick(r, s, N)) for r in range(N)]
            data = [c[src, k].copy() for src, _, k in sends]
            for (src, dst, k), d in zip(sends, data):
                if phase == "rs" or ag_add:
                    c[dst, k] += d
                else:
                    c[dst, k] = d
            log.append(sends)
    return c, log


_RING_MISTAKES = (
    (dict(ag_steps=0), "only the reduce-scatter was done: after it each rank holds ONE fully summed chunk (rank r: "
     "chunk (r+1) mod N); the all-gather phase (N-1 more steps, overwriting) passes the finished sums around"),
    (dict(rs=lambda r, s, N: (r - s - 1) % N), "off-by-one chunk index in the reduce-scatter: at step s rank r sends "
     "chunk (r - s) mod N (its own chunk r first) and receives chunk (r - s - 1) mod N from rank r-1"),
    (dict(rs=lambda r, s, N: (r - s + 1) % N), "off-by-one chunk index in the reduce-scatter: at step s rank r sends "
     "chunk (r - s) mod N (its own chunk r first) and receives chunk (r - s - 1) mod N from rank r-1"),
    (dict(ag=lambda r, s, N: (r - s) % N), "off-by-one chunk index in the all-gather: rank r starts by sending the "
     "chunk it finished in the reduce-scatter, (r + 1) mod N, so at step s it sends (r + 1 - s) mod N"),
    (dict(ag=lambda r, s, N: (r + 2 - s) % N), "off-by-one chunk index in the all-gather: rank r starts by sending "
     "the chunk it finished in the reduce-scatter, (r + 1) mod N, so at step s it sends (r + 1 - s) mod N"),
    (dict(ag_add=True), "the all-gather ADDS what arrives: the chunk that arrives there is already the full sum, "
     "overwrite yours with it"),
    (dict(rs_steps="N"), "wrong number of steps: the reduce-scatter has N-1 steps, not N (after N-1 additions a "
     "chunk holds all N ranks' data; one more adds a rank twice)"),
    (dict(ag_steps="N"), "wrong number of steps: each phase has N-1 steps, not N"),
    (dict(rs_steps="N-2"), "wrong number of steps: the reduce-scatter needs N-1 steps for a chunk to collect all N "
     "ranks' data"),
    (dict(ag_steps="N-2"), "wrong number of steps: the all-gather needs N-1 steps to bring every sum to every rank"),
)


def _mistake(c, kw):
    N = c.shape[0]
    kw = dict(kw)
    for k in ("rs_steps", "ag_steps"):
        if isinstance(kw.get(k), str):
            kw[k] = {"N": N, "N-2": N - 2}[kw[k]]
    return ring_variant(c, **kw)[0]


def _replay(c, log, N):
    """Apply a log to a copy of c: the first N-1 steps add, the rest overwrite. None if a message is malformed."""
    c = np.array(c, copy=True)
    for k, step in enumerate(log):
        data = [c[src, ch].copy() for src, _, ch in step]
        for (src, dst, ch), d in zip(step, data):
            if k < N - 1:
                c[dst, ch] += d
            else:
                c[dst, ch] = d
    return c


def _check_log(log, N):
    """None when the log has the ring's shape, else (message, hint)."""
    try:
        steps = [list(step) for step in log]
        msgs = [[tuple(int(v) for v in m) for m in step] for step in steps]
    except Exception:
        return ("the log is not a list of steps of (src, dst, chunk) tuples",
                "append one list per step, holding the N messages (src, dst, chunk) sent in it")
    if len(msgs) != 2 * (N - 1):
        return (f"the log has {len(msgs)} steps, the ring has 2(N-1) = {2 * (N - 1)} for N = {N}",
                "wrong number of steps: N-1 reduce-scatter steps, then N-1 all-gather steps, one log entry each")
    for k, step in enumerate(msgs):
        if any(len(m) != 3 for m in step):
            return (f"step {k}: a message is not (src, dst, chunk)", "log each message as (src, dst, chunk)")
        if sorted(m[0] for m in step) != list(range(N)):
            return (f"step {k}: the senders are {sorted(m[0] for m in step)}, every rank must send exactly once",
                    "in every step each of the N ranks sends one chunk")
        bad = [m for m in step if m[1] != (m[0] + 1) % N or not 0 <= m[2] < N]
        if bad:
            return (f"step {k}: message {bad[0]} does not go to the right neighbour (src + 1) mod N, or its chunk is "
                    f"not in 0..N-1", "rank r sends only to rank (r + 1) mod N: that is what makes it a ring")
    return None


def check_ring_allreduce_sim(fn, seed=None, task=None, quiet=False) -> "_checks.CheckResult":
    """Check out, log = fn(chunks) (module docstring): the ring all-reduce of N simulated ranks. seed: None for fresh
    inputs, or the seed a check printed. task: label for grading. quiet: do not print. Returns a CheckResult."""
    name = "ring_allreduce_sim"
    seed = _seed(name, fn, seed)
    rng = np.random.default_rng(seed)
    cases = [(int(rng.integers(3, 6)), int(rng.integers(1, 4))), (2, int(rng.integers(1, 4)))]
    for N, m in cases:
        chunks = rng.integers(-9, 10, (N, N, m)).astype(np.float64)
        expected = np.broadcast_to(chunks.sum(axis=0), (N, N, m))
        dims = {"N": N, "m": m}
        where = f"N={N} ranks, chunks of m={m}; seed {seed}"
        got, err = _call(name, fn, (chunks.copy(),), seed, task, dims, quiet, where)
        if err is not None:
            return err
        fail = lambda msg, hint: _result(name, task, "wrong", f"{name}: wrong - {msg} ({where})",  # noqa: E731
                                         hint=hint, seed=seed, dims=dims, quiet=quiet)
        if not (isinstance(got, tuple) and len(got) == 2):
            return fail(f"your function returned {type(got).__name__}", "return two things: (chunks, log)")
        out, log = got
        out = np.asarray(out, dtype=np.float64)
        if out.shape != (N, N, m):
            return fail(f"the chunks you returned have shape {out.shape}, expected {(N, N, m)}",
                        "return the (N, N, m) array of chunks after the all-reduce (rank, chunk, element)")
        if not np.array_equal(out, expected):
            for kw, hint in _RING_MISTAKES:
                if np.array_equal(out, _mistake(chunks, kw)):
                    return fail("not every rank ends with every chunk's sum", hint)
            full = [[np.array_equal(out[r, c], expected[r, c]) for c in range(N)] for r in range(N)]
            if all(sum(row) == 1 for row in full):
                return fail("each rank holds exactly one summed chunk", _RING_MISTAKES[0][1])
            r, c, i = (int(v) for v in np.argwhere(out != expected)[0])
            return fail(f"rank {r}'s chunk {c}[{i}]: yours {out[r, c, i]:g}, expected {expected[r, c, i]:g} (the sum "
                        f"over ranks)", "at reduce-scatter step s rank r sends chunk (r - s) mod N to rank r+1, "
                        "which adds it into its own; at all-gather step s it sends (r + 1 - s) mod N, which the "
                        "receiver copies")
        bad = _check_log(log, N)
        if bad:
            return fail(*bad)
        if not np.array_equal(_replay(chunks, log, N), out):
            return fail("replaying your log from the input does not give your result",
                        "log exactly the messages your simulation sends, (src, dst, chunk), one list per step; the "
                        "result must come from those messages, not from a direct sum")
    return _result(name, task, "correct", f"{name}: correct (every rank ends with every chunk's sum, in 2(N-1) steps "
                   f"of N messages to the right neighbour, for N = {cases[0][0]} and 2; seed {seed})", seed=seed,
                   dims={"N": cases[0][0]}, quiet=quiet)


# ----------------------------------------------------------------------------------------------------------------
# 10.2 shard bounds
# ----------------------------------------------------------------------------------------------------------------

def _expected_bounds(n, W):
    S = -(-n // W)
    return [(min(r * S, n), min((r + 1) * S, n)) for r in range(W)]


def check_shard_bounds(fn, seed=None, task=None, quiet=False) -> "_checks.CheckResult":
    """Check lo, hi = fn(n, world, rank) (module docstring) for every rank of several (n, world), including n not a
    multiple of world and n < world. Returns a CheckResult (truthy when correct)."""
    name = "shard_bounds"
    seed = _seed(name, fn, seed)
    rng = np.random.default_rng(seed)
    W1 = int(rng.integers(3, 8))
    cases = [(W1 * int(rng.integers(5, 40)) + int(rng.integers(1, W1)), W1), (int(rng.integers(50, 500)) * 4, 4),
             (int(rng.integers(2, 5)), 5), (int(rng.integers(10_000, 200_000)), int(rng.choice([2, 3, 6, 8]))),
             (1, 1)]
    for n, W in cases:
        dims = {"n": n, "world": W}
        where = f"n={n}, world={W}; seed {seed}"
        fail = lambda msg, hint: _result(name, task, "wrong", f"{name}: wrong - {msg} ({where})",  # noqa: E731
                                         hint=hint, seed=seed, dims=dims, quiet=quiet)
        got = []
        for r in range(W):
            v, err = _call(name, fn, (n, W, r), seed, task, dims, quiet, where + f", rank={r}")
            if err is not None:
                return err
            try:
                lo, hi = (int(x) for x in v)
            except Exception:
                return fail(f"rank {r}: your function returned {v!r}", "return a pair of ints (lo, hi)")
            got.append((lo, hi))
        want = _expected_bounds(n, W)
        if got == want:
            continue
        S = -(-n // W)
        for r in range(W):
            lo, hi = got[r]
            if hi < lo:
                return fail(f"rank {r}: lo={lo} > hi={hi}", "hi is one past the last element: hi >= lo")
            if hi > n:
                return fail(f"rank {r}'s shard ({lo}, {hi}) runs past n={n}",
                            "clip to n: hi = min((rank + 1) * S, n); the padding n..world*S belongs to no parameter")
        for r in range(W - 1):
            if got[r][1] > got[r + 1][0]:
                return fail(f"ranks {r} and {r + 1} overlap: {got[r]} and {got[r + 1]}",
                            "shards must not overlap: rank r+1 starts where rank r stops (hi is exclusive)")
            if got[r][1] < got[r + 1][0] and got[r + 1][0] < n:
                return fail(f"elements {got[r][1]}..{got[r + 1][0] - 1} belong to no rank (between ranks {r} and "
                            f"{r + 1})", "rank r+1 starts where rank r stops: lo = rank * S, hi = (rank + 1) * S")
        if got[0][0] != 0:
            return fail(f"rank 0 starts at {got[0][0]}", "rank 0's shard starts at element 0")
        end = max(hi for _, hi in got)
        if end < n:
            return fail(f"the shards stop at {end}, the buffer has n={n} elements: the last {n - end} are nobody's",
                        f"the last shard misses the remainder: n // world = {n // W} elements per rank loses n mod "
                        f"world = {n % W}; use S = ceil(n / world) = {S} (the last shard stops at n)")
        sizes = [hi - lo for lo, hi in got]
        if got[-1][1] == n and sizes[:-1] and len(set(sizes[:-1])) == 1 and sizes[-1] > sizes[0]:
            return fail(f"shard sizes {sizes}: the last shard took the remainder",
                        f"uneven shards: reduce-scatter and all-gather move equal pieces, so every shard has "
                        f"S = ceil(n / world) = {S} elements except the last ones, which stop at n")
        return fail(f"shard sizes {sizes} ({got}), expected {[b - a for a, b in want]} ({want})",
                    f"uneven shards: every shard has S = ceil(n / world) = {S} elements (the buffer padded to "
                    f"world * S splits evenly for reduce-scatter and all-gather), the last ones stop at n")
    return _result(name, task, "correct", f"{name}: correct (contiguous shards of ceil(n / world), the last ones "
                   f"stopping at n, for {len(cases)} (n, world) pairs; seed {seed})", seed=seed, quiet=quiet)


# ----------------------------------------------------------------------------------------------------------------
# 10.3 the shard's decay table
# ----------------------------------------------------------------------------------------------------------------

def _table_case(rng):
    from .optim import DECAY_NAMES
    from .params import GPTConfig, ParamBuffer

    cfg = GPTConfig(vocab_size=int(rng.integers(5, 14)), block_size=int(rng.integers(3, 10)),
                    n_layer=int(rng.integers(1, 3)), n_head=2, d_model=int(rng.choice([4, 6, 8])))
    buf = ParamBuffer(cfg)
    bounds = np.array([0] + [buf.offsets[k][1] for k in buf.names], dtype=np.int64)
    flags = np.array([k in DECAY_NAMES for k in buf.names], dtype=np.uint8)
    return bounds, flags


def check_shard_decay_table(fn, seed=None, task=None, quiet=False) -> "_checks.CheckResult":
    """Check b, f = fn(bounds, flags, lo, hi) (module docstring) on a small GPT's decay table and shards that start
    and stop inside tensors, on tensor boundaries, at 0 and at n. Returns a CheckResult (truthy when correct)."""
    name = "shard_decay_table"
    seed = _seed(name, fn, seed)
    rng = np.random.default_rng(seed)
    bounds, flags = _table_case(rng)
    n = int(bounds[-1])
    mask = np.repeat(flags.astype(bool), np.diff(bounds))
    mid = int(rng.integers(1, n - 1))
    inner = int(rng.integers(1, len(bounds) - 2))
    shards = [(mid, min(n, mid + int(rng.integers(5, 60)))), (0, int(rng.integers(3, n))),
              (int(rng.integers(1, n - 2)), n), (int(bounds[inner]), int(bounds[inner + 2])),
              (int(bounds[inner]) + 1, int(bounds[inner + 1]) - 0)]
    shards = [(lo, hi) for lo, hi in shards if lo < hi]
    for lo, hi in shards:
        dims = {"n": n, "tensors": len(flags), "lo": lo, "hi": hi}
        where = f"{len(flags)} tensors, n={n}, shard lo={lo}, hi={hi}; seed {seed}"
        fail = lambda msg, hint: _result(name, task, "wrong", f"{name}: wrong - {msg} ({where})",  # noqa: E731
                                         hint=hint, seed=seed, dims=dims, quiet=quiet)
        got, err = _call(name, fn, (bounds.copy(), flags.copy(), lo, hi), seed, task, dims, quiet, where)
        if err is not None:
            return err
        if not (isinstance(got, tuple) and len(got) == 2):
            return fail(f"your function returned {type(got).__name__}", "return two arrays: (bounds, flags)")
        b, f = (np.asarray(a) for a in got)
        if b.ndim != 1 or f.ndim != 1 or b.size != f.size + 1 or f.size < 1:
            return fail(f"bounds has shape {b.shape} and flags {f.shape}",
                        "bounds needs one more entry than flags (tensor j is bounds[j] .. bounds[j+1]-1): when you "
                        "drop a tensor, drop its flag too")
        if not np.issubdtype(b.dtype, np.integer):
            return fail(f"bounds has dtype {b.dtype}", "bounds are element indices: an integer array (int64)")
        if b[0] != 0 or b[-1] != hi - lo:
            if np.array_equal(b, bounds):
                return fail("you returned the whole buffer's bounds", f"shift every bound by -lo ({lo}) and clip "
                            f"it to 0 .. hi - lo = {hi - lo}: the shard's own elements are indexed from 0")
            if lo > 0 and b.min() >= lo and b.max() <= hi:
                return fail(f"bounds run from {b[0]} to {b[-1]}, in the whole buffer's indices",
                            f"the table bounds are not shifted: subtract lo ({lo}) so that the shard's first element "
                            f"is index 0 and its last hi - lo - 1 = {hi - lo - 1}")
            if b.min() < 0 or b.max() > hi - lo:
                return fail(f"bounds run from {b.min()} to {b.max()}, the shard from 0 to hi - lo = {hi - lo}",
                            "the bounds are not clipped: after shifting by -lo, clip each to 0 .. hi - lo (the "
                            "tensors that start before the shard or end after it)")
            return fail(f"bounds run from {b[0]} to {b[-1]}, the shard from 0 to hi - lo = {hi - lo}",
                        "the first bound is 0 and the last hi - lo: the table covers exactly the shard")
        if np.any(np.diff(b) < 0):
            return fail(f"bounds are not increasing: {b.tolist()}", "keep the tensors in buffer order")
        ours = np.repeat(f.astype(bool), np.diff(b))
        if not np.array_equal(ours, mask[lo:hi]):
            i = int(np.flatnonzero(ours != mask[lo:hi])[0])
            return fail(f"shard element {i} (global {lo + i}) gets decay flag {int(ours[i])}, expected "
                        f"{int(mask[lo + i])}", "the flags are out of step with the bounds: keep flags[j] with the "
                        "range of tensor j (drop both or neither)")
    return _result(name, task, "correct", f"{name}: correct (every shard element gets its tensor's decay flag, for "
                   f"{len(shards)} shards of a {len(flags)}-tensor buffer; seed {seed})", seed=seed, quiet=quiet)
