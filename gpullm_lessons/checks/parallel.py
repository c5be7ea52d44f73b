"""Checkers for lesson 10 (multi-GPU): the ring all-reduce, ZeRO-1's shard bookkeeping and ZeRO's reduce-scatter.

They follow the conventions of ``gpullm_lessons.checks.backward``: fresh random inputs on every call (the seed is printed),
one verdict printed (not attempted / error / wrong with a hint naming the mistake / correct), your exceptions reported
and never raised, ``task=`` for grading, ``quiet=``. Values are small integers stored as float64, so sums are exact
and compared exactly. The sizes that decide (how many ranks, buffer lengths that the ranks do not divide, fewer
elements than ranks, one rank, every rank) are fixed, not drawn: only the values are random.

``check_ring_allreduce_sim(fn)`` (exercise 10.1), fn called as

    out, log = fn(buffers)

buffers: float64 (N, n), row r is rank r's buffer (N simulated ranks, any n >= 0), each cut into the N chunks of
``gpullm_lessons.parallel.chunk_bounds(n, N)`` (chunk c is elements lo..hi-1 of every buffer). fn runs the ring
all-reduce (sum) and returns out (N, n), every row the elementwise sum of the N buffers (it may update buffers in
place and return it), and its log: one list per step of the messages sent in that step, each (src, dst, chunk),
rank src sending its copy of chunk `chunk` to rank dst = (src + 1) mod N; every rank sends once per step. The first
N-1 steps are the reduce-scatter (the receiver adds what arrives into its copy of that chunk), the last N-1 the
all-gather (the receiver overwrites its copy). Checked for N = 1, 2, 3, 4, 5 with n not a multiple of N and n < N:
the sums, the log's shape, and the log replayed step by step (which ranks' data every chunk holds): no rank's data
added twice, the all-gather passing only finished chunks, and the replay giving your result.

``check_shard_bounds(fn)`` (exercise 10.2), fn called as ``lo, hi = fn(n, world, rank)``: the elements lo..hi-1 of
a flat buffer of n parameters that `rank` owns under ZeRO-1. The buffer padded to world * S elements, S = the
smallest shard size that lets world shards cover n, is cut into world equal pieces; rank r gets piece r and owns the
part of it below n. A piece that lies wholly in the padding is an empty range at n (lo == hi == n). Checked for every
rank of n a multiple of world and not, n < world, n = 0 and world = 1.

``check_shard_decay_table(fn)`` (exercise 10.3), fn called as ``b, f = fn(bounds, flags, lo, hi)``: the AdamW decay
table of the shard lo..hi in shard-local indices. bounds (k+1,) int64 and flags (k,) uint8 describe the whole
buffer (tensor j is elements bounds[j] .. bounds[j+1]-1 and decays when flags[j] = 1). The result must start at 0,
end at hi - lo, and give element i of the shard the flag of global element lo + i. Tensors outside the shard may be
dropped (with their flags) or kept as empty ranges. Checked on shards at 0, at n, inside one tensor, on tensor
boundaries, empty, and every rank's shard of two models.

``check_zero_reduce_scatter(fn)`` (exercise 10.4), fn called on every rank at once (one thread per rank) as

    fn(comm, grad, out)

comm: a ``gpullm_lessons.parallel.comm.Communicator`` of N ranks that offers only point-to-point ring messages:
``comm.sendrecv(send_buf, dst, recv_buf, src)`` with dst = (rank + 1) mod N and src = (rank - 1) mod N (and
``comm.rank``, ``comm.world_size``, ``comm.barrier()``). grad: float64 (N * S,), this rank's gradient, padded;
shard j is elements j*S .. (j+1)*S - 1. out: float64 (S,): fn writes into it the sum over the N ranks of shard
``comm.rank`` (what ZeRO's reduce-scatter gives rank r: its own shard, summed). grad may be used as workspace.
Checked for N = 1, 2, 3, 4, 5 ranks and odd S.
"""
from __future__ import annotations

import queue
import threading
import time

import numpy as np

from . import borrowed, opcheck
from . import verdict
from .verdict import CheckResult
from ..parallel.comm import Communicator

# the course's own implementations of the tasks (checks/borrowed.py): an answer that is, wraps or calls one is not correct
OWN = {
    "ring_allreduce_sim": (
        "gpullm_lessons.parallel.ring:ring_allreduce_sim",
        "gpullm_lessons.parallel.ring:ring_allreduce_chunks",
    ),
    "shard_bounds": ("gpullm_lessons.parallel.data_parallel:shard_bounds",),
    "shard_decay_table": ("gpullm_lessons.model.optim:shard_decay_table",),
    "zero_reduce_scatter": ("gpullm_lessons.parallel.ring:ring_allreduce",),
}

__all__ = ["check_ring_allreduce_sim", "check_shard_bounds", "check_shard_decay_table", "check_zero_reduce_scatter",
           "ring_variant", "reduce_scatter_variant"]


_FIELDS = {"dtype": "float64", "arrays": "numpy"}   # every checker here: float64 NumPy buffers


def _result(name, task, status, msg, hint=None, seed=None, dims=None, quiet=False, **extra):
    return verdict.verdict(name, task, status, msg, hint, quiet=quiet, seed=seed, dims=dims, **_FIELDS, **extra)


def _seed(name, fn, seed):
    return opcheck.learner_fn_and_seed(name, fn, seed, "inputs")


def _not_attempted(name, task, seed, dims, quiet):
    return verdict.record(verdict.not_attempted(name, task=task, seed=seed, dims=dims, **_FIELDS), quiet=quiet)


def _raised(name, exc, task, seed, dims, quiet, where):
    return verdict.record(verdict.raised(name, exc, where, task=task, seed=seed, dims=dims, **_FIELDS), quiet=quiet)


def _call(name, fn, args, seed, task, dims, quiet, where):
    """(value, None) or (None, the recorded CheckResult) for not attempted / error."""
    value, failed = verdict.call_learner(name, fn, args, context=where, task=task, seed=seed, dims=dims, **_FIELDS)
    return (value, None) if failed is None else (None, verdict.record(failed, quiet=quiet))


def _ranks(s) -> str:
    s = sorted(s)
    return ("rank " if len(s) == 1 else "ranks ") + ", ".join(str(r) for r in s) if s else "no rank"


# ----------------------------------------------------------------------------------------------------------------
# 10.1 the ring all-reduce, simulated
# ----------------------------------------------------------------------------------------------------------------

def _bounds(n, N, chunking="ring"):
    from ..parallel import chunk_bounds
    if chunking == "ring":
        return chunk_bounds(n, N)
    q = n // N                                         # "floor": equal chunks of n // N, the remainder dropped
    return [(c * q, (c + 1) * q) for c in range(N)]


def ring_variant(buffers, rs=lambda r, s, N: (r - s) % N, ag=lambda r, s, N: (r + 1 - s) % N, rs_steps=None,
                 ag_steps=None, ag_add=False, chunking="ring"):
    """The ring all-reduce on a copy of buffers (N, n) with the chunk rank r sends at step s of each phase given by
    rs / ag, the phases' step counts (None: N-1), and the chunking ("ring": parallel.chunk_bounds; "floor": chunks
    of n // N, the remainder never sent): the correct ring with the defaults, a named mistake otherwise.
    Returns (out, log)."""
    c = np.array(buffers, dtype=np.float64, copy=True)
    N, n = c.shape
    bounds = _bounds(n, N, chunking)
    log = []
    for phase, pick, steps in (("rs", rs, N - 1 if rs_steps is None else rs_steps),
                               ("ag", ag, N - 1 if ag_steps is None else ag_steps)):
        for s in range(steps):
            sends = [(r, (r + 1) % N, pick(r, s, N)) for r in range(N)]
            data = [c[src, bounds[k][0]:bounds[k][1]].copy() for src, _, k in sends]
            for (src, dst, k), d in zip(sends, data):
                lo, hi = bounds[k]
                if phase == "rs" or ag_add:
                    c[dst, lo:hi] += d
                else:
                    c[dst, lo:hi] = d
            log.append(sends)
    return c, log


def _replay(buffers, log, N, ag_add=False, chunking="ring"):
    """Apply a (well-formed) log to a copy of buffers: the first N-1 steps add, the rest overwrite (or add)."""
    c = np.array(buffers, dtype=np.float64, copy=True)
    bounds = _bounds(c.shape[1], N, chunking)
    for k, step in enumerate(log):
        data = [c[src, bounds[ch][0]:bounds[ch][1]].copy() for src, _, ch in step]
        for (src, dst, ch), d in zip(step, data):
            lo, hi = bounds[ch]
            if k < N - 1 or ag_add:
                c[dst, lo:hi] += d
            else:
                c[dst, lo:hi] = d
    return c


def _parse_log(log, N):
    """(messages as lists of int triples, None) or (None, (message, hint)) when the log is not the ring's shape."""
    try:
        msgs = [[tuple(int(v) for v in m) for m in step] for step in log]
    except Exception:
        return None, ("the log is not a list of steps of (src, dst, chunk) messages",
                      "append one list per step, holding the N messages (src, dst, chunk) sent in it")
    for k, step in enumerate(msgs):
        if any(len(m) != 3 for m in step):
            return None, (f"step {k}: a message is not (src, dst, chunk)", "log each message as (src, dst, chunk)")
    return msgs, None


def _log_shape(msgs, N, prev_len):
    """None when the log has the ring's shape (2(N-1) steps of N messages to the right), else (message, hint)."""
    want = 2 * (N - 1)
    if len(msgs) != want:
        if prev_len is not None and len(msgs) == prev_len + want and want > 0:
            return (f"the log has {len(msgs)} steps: the previous call's {prev_len} plus this call's {want}",
                    "the log is kept between calls (a global, or a default argument log=[]): start a new list "
                    "inside your function on every call")
        if N > 1 and len(msgs) == N - 1:
            return (f"the log has {len(msgs)} steps, N-1: only the reduce-scatter was done",
                    "only the reduce-scatter was done: after it every rank holds ONE fully summed chunk; the "
                    "all-gather (N-1 more steps, the receiver overwriting) passes the finished chunks around")
        return (f"the log has {len(msgs)} steps, the ring has 2(N-1) = {want} for N = {N}",
                "wrong number of steps: N-1 reduce-scatter steps (a chunk collects one more rank's data per step, "
                "so N-1 steps collect all N), then N-1 all-gather steps, one log entry each")
    for k, step in enumerate(msgs):
        senders = sorted(m[0] for m in step)
        if senders != list(range(N)):
            return (f"step {k}: the senders are {senders}; every one of the N = {N} ranks sends exactly once per step",
                    "in every step each of the N ranks sends one chunk to its right neighbour, all at once")
        for src, dst, ch in step:
            if dst != (src + 1) % N:
                way = " (its LEFT neighbour)" if dst == (src - 1) % N else ""
                return (f"step {k}: rank {src} sends to rank {dst}{way}, not to its right neighbour "
                        f"{(src + 1) % N}", "rank r sends only to rank (r + 1) mod N: that is what makes it a ring "
                        "(and why every link carries one message per step)")
            if not 0 <= ch < N:
                return (f"step {k}: rank {src} sends chunk {ch}, the chunks are 0..{N - 1}",
                        "a chunk index is 0..N-1: wrap it around with % N")
    return None


def _schedule(msgs, N):
    """Replay the log on sets of ranks (which ranks' data each chunk of each rank holds). None when it is a valid
    all-reduce, else (message, hint) naming the first message that breaks it: its step, rank and chunk."""
    held = [[frozenset([r]) for _ in range(N)] for r in range(N)]
    received = [None] * N                 # the chunk each rank received in the previous step
    finished = [None] * N
    for k, step in enumerate(msgs):
        rs = k < N - 1
        s = k if rs else k - (N - 1)
        phase = f"{'reduce-scatter' if rs else 'all-gather'} step {s} (log step {k})"
        new = [row[:] for row in held]
        got = [None] * N
        for src, dst, ch in step:
            a, b = held[src][ch], held[dst][ch]
            if rs:
                twice = a & b
                if twice:
                    what = (f"at {phase} rank {src} sent chunk {ch} (holding {_ranks(a)}) to rank {dst}, whose "
                            f"chunk {ch} already holds {_ranks(b)}: the data of {_ranks(twice)} would be added twice")
                    if received[src] is not None and ch != received[src]:
                        return (what, f"wrong chunk index at step {s}: in the reduce-scatter a rank passes on the "
                                f"chunk it has just added to; rank {src} received chunk {received[src]} in the "
                                f"previous step, so that is the one it sends now")
                    first = [m[2] for m in sorted(msgs[0])]
                    clash = sorted({r for r in range(N) if first.count(first[r]) > 1})
                    return (what, f"the ranks start with clashing chunks: at step 0 {_ranks(clash)} sent the same "
                            f"chunk (step-0 chunks {first}); at step 0 the N ranks must send N different chunks, so "
                            f"that each chunk travels once around the ring, collecting one rank's data per step")
                if received[src] is not None and ch != received[src]:
                    return (f"at {phase} rank {src} sent chunk {ch} (holding {_ranks(a)}); in the previous step it "
                            f"received and added chunk {received[src]}, which holds more",
                            f"wrong chunk index at step {s}: a rank passes on the chunk it has just added to "
                            f"(chunk {received[src]} for rank {src} here), so that every chunk grows by one rank's "
                            f"data per step and is complete after N-1 steps")
                new[dst][ch] = a | b
            else:
                if len(a) < N:
                    fin = f" (rank {src} finished chunk {finished[src]} in the reduce-scatter)" \
                        if finished[src] is not None else ""
                    return (f"at {phase} rank {src} sent chunk {ch}, which holds only {_ranks(a)}, not yet the sum "
                            f"of all {N}{fin}",
                            "the all-gather passes on finished sums only: each rank starts with the chunk it "
                            "completed in the reduce-scatter, then passes on the chunk it received in the previous "
                            "step" + (f"; wrong chunk index at all-gather step {s}" if s else
                                      "; the all-gather starts with the wrong chunk"))
                if len(b) == N and received[src] is not None and ch != received[src]:
                    return (f"at {phase} rank {src} sent chunk {ch} to rank {dst}, which already holds its sum: "
                            f"the message is wasted", f"wrong chunk index at all-gather step {s}: pass on the chunk "
                            f"you received in the previous step (chunk {received[src]} for rank {src})")
                new[dst][ch] = a
            got[dst] = ch
        held, received = new, got
        if k == N - 2:                                    # the end of the reduce-scatter
            for r in range(N):
                full = [c for c in range(N) if len(held[r][c]) == N]
                finished[r] = full[0] if full else None
            missing = [c for c in range(N) if not any(len(held[r][c]) == N for r in range(N))]
            if missing:
                return (f"after the reduce-scatter no rank holds the full sum of chunk {missing[0]}",
                        "every chunk must be complete on one rank after N-1 steps")
        if k == N - 2 and N > 1:
            received = [None] * N                          # the all-gather starts from the finished chunk
    for r in range(N):
        for c in range(N):
            if len(held[r][c]) != N:
                return (f"after the last step rank {r}'s chunk {c} holds only {_ranks(held[r][c])}",
                        "the all-gather must bring every finished chunk to every rank: N-1 steps, each rank passing "
                        "on the chunk it received in the previous one")
    return None


_RING_MISTAKES = (   # numeric mistakes a valid log cannot show: (_replay keywords, hint)
    (dict(ag_add=True), "the all-gather ADDS what arrives: the chunk that arrives there is already the full sum, "
     "overwrite your copy with it"),
    (dict(chunking="floor"), "the remainder is never sent: chunks of n // N elements leave the last n mod N elements "
     "out; cut the buffers with parallel.chunk_bounds(n, N) (chunk sizes differ by at most 1)"),
)

# N ranks, n elements: n not a multiple of N, n < N (empty chunks), one rank, prime N
_RING_CASES = ((3, 11), (2, 7), (5, 13), (5, 3), (1, 4), (4, 9))


def check_ring_allreduce_sim(fn, seed=None, task=None, quiet=False) -> "CheckResult":
    """Check out, log = fn(buffers) (module docstring): the ring all-reduce of N simulated ranks, for N = 3, 2, 5, 5,
    1, 4 ranks and buffers of 11, 7, 13, 3, 4, 9 elements. seed: None for fresh values, or the seed a check printed.
    task: label for grading. quiet: do not print. Returns a CheckResult (truthy when correct)."""
    name = "ring_allreduce_sim"
    seed = _seed(name, fn, seed)
    taken = borrowed.borrowed_verdict(name, [fn], OWN[name], task=task, seed=seed, quiet=quiet,
                                      check="check_ring_allreduce_sim")
    if taken is not None:
        return taken
    rng = np.random.default_rng(seed)
    prev_len = None
    for i, (N, n) in enumerate(_RING_CASES):
        buffers = rng.integers(-9, 10, (N, n)).astype(np.float64)
        expected = np.broadcast_to(buffers.sum(axis=0), (N, n))
        dims = {"N": N, "n": n, "call": i + 1}
        where = f"call {i + 1} of {len(_RING_CASES)}: N={N} ranks, n={n} elements, chunks {_bounds(n, N)}; seed {seed}"
        got, err = _call(name, fn, (buffers.copy(),), seed, task, dims, quiet, where)
        if err is not None:
            return err

        def fail(msg, hint):
            return _result(name, task, "wrong", f"{name}: wrong - {msg} ({where})", hint=hint, seed=seed, dims=dims,
                           quiet=quiet)
        if not (isinstance(got, tuple) and len(got) == 2):
            return fail(f"your function returned {type(got).__name__}", "return two things: (out, log)")
        out, log = got
        try:
            out = np.asarray(out, dtype=np.float64)
        except Exception:
            return fail(f"out is {type(out).__name__}, not an array", "return the (N, n) buffers after the all-reduce")
        if out.shape != (N, n):
            return fail(f"out has shape {out.shape}, expected {(N, n)}",
                        "return the (N, n) array of buffers after the all-reduce (row r: rank r)")
        msgs, bad = _parse_log(log, N)
        if bad is None:
            bad = _log_shape(msgs, N, prev_len)
        if bad is None:
            bad = _schedule(msgs, N)
        if bad is not None:
            return fail(*bad)
        prev_len = len(msgs)
        if np.array_equal(out, expected):
            replay = _replay(buffers, msgs, N)
            if not np.array_equal(replay, out):        # cannot happen for a valid schedule; kept as a guard
                return fail("replaying your log from the input does not give your result",
                            "log exactly the messages your simulation sends")
            continue
        r, j = (int(v) for v in np.argwhere(~(out == expected))[0])
        bounds = _bounds(n, N)
        c = next(c for c, (lo, hi) in enumerate(bounds) if lo <= j < hi)
        rows = sorted({int(v) for v in np.argwhere(~(out == expected))[:, 0]})
        at = (f"rank {r}'s element {j} (chunk {c}, elements {bounds[c][0]}..{bounds[c][1] - 1}): yours "
              f"{out[r, j]:g}, expected {expected[r, j]:g}, the sum over the ranks; wrong on {_ranks(rows)}")
        for kw, hint in _RING_MISTAKES:
            if np.array_equal(out, _replay(buffers, msgs, N, **kw)):
                return fail(at, hint)
        if np.array_equal(out, buffers):
            return fail(f"out is the input unchanged; {at}", "no message was delivered: add (reduce-scatter) or copy "
                        "(all-gather) what arrives into the receiver's chunk")
        return fail(at, "your log is a valid ring but your buffers did not follow it: each message must carry the "
                    "sender's chunk (elements chunk_bounds(n, N)[chunk]) as it was at the start of the step, added "
                    "into the receiver's copy in the reduce-scatter and copied over it in the all-gather")
    return _result(name, task, "correct", f"{name}: correct (every rank ends with the sum, in 2(N-1) ring steps whose "
                   f"replay counts every rank once, for N = {', '.join(str(N) for N, _ in _RING_CASES)} and n not a "
                   f"multiple of N; seed {seed})", seed=seed, dims={"cases": len(_RING_CASES)}, quiet=quiet)


# ----------------------------------------------------------------------------------------------------------------
# 10.2 shard bounds
# ----------------------------------------------------------------------------------------------------------------

def _ceil(n, W):
    return -(-n // W)


def _expected_bounds(n, W):
    S = _ceil(n, W)
    return [(min(r * S, n), min((r + 1) * S, n)) for r in range(W)]


def _bounds_variant(kind, n, W):
    S = _ceil(n, W)
    out = []
    for r in range(W):
        if kind == "lo-unclipped":
            b = (r * S, min((r + 1) * S, n))
        elif kind == "unclipped":
            b = (r * S, (r + 1) * S)
        elif kind == "floor":
            q = n // W
            b = (r * q, (r + 1) * q)
        elif kind == "floor-last-rest":
            q = n // W
            b = (r * q, n if r == W - 1 else (r + 1) * q)
        elif kind == "array-split":
            from ..parallel import chunk_bounds
            b = chunk_bounds(n, W)[r]
        elif kind == "inclusive":
            b = (min(r * S, n), min((r + 1) * S, n) - 1)
        elif kind == "plus-one":
            T = n // W + 1
            b = (min(r * T, n), min((r + 1) * T, n))
        elif kind == "round":
            T = int(round(n / W))
            b = (min(r * T, n), min((r + 1) * T, n))
        elif kind == "empty-at-zero":
            lo, hi = min(r * S, n), min((r + 1) * S, n)
            b = (0, 0) if lo == hi else (lo, hi)
        else:
            raise ValueError(kind)
        out.append(b)
    return out


_BOUNDS_MISTAKES = (
    ("lo-unclipped", "the lower end is not clipped: a rank whose piece starts past n (n < world, or the last ranks "
     "when world does not divide n) must get the empty range at n, lo = hi = n, not lo > n"),
    ("unclipped", "the shard is not clipped to n: both ends of a piece that runs into the padding stop at n (the "
     "padding n .. world * S - 1 belongs to no parameter)"),
    ("floor", "the last shard misses the remainder: pieces of n // world elements lose the last n mod world "
     "elements; the piece size is the ceiling of n / world (the padded buffer splits evenly), the last ones stopping "
     "at n"),
    ("floor-last-rest", "uneven shards, the last shard took the remainder: reduce-scatter and all-gather move equal "
     "pieces, so every piece has the ceiling of n / world elements and only the part past n is cut off"),
    ("array-split", "uneven shards (the first n mod world ranks one longer, as np.array_split): ZeRO pads the buffer "
     "to world equal pieces of ceil(n / world), so only the LAST pieces are short"),
    ("inclusive", "hi is inclusive: (lo, hi) means elements lo .. hi-1, so hi is one past the last element and rank "
     "r+1's lo equals rank r's hi"),
    ("plus-one", "the piece size is n // world + 1: that is one too many when world divides n; use the ceiling of "
     "n / world in integer arithmetic"),
    ("round", "the piece size is rounded to nearest: round(n / world) is too small when the fraction is below 1/2; "
     "use the ceiling, so that world pieces always cover n"),
    ("empty-at-zero", "an empty shard is put at 0: a rank whose piece lies wholly in the padding owns the empty range "
     "AT n (lo = hi = n), so that the ranks' ranges stay in order and tile 0..n"),
)

# (n, world): not a multiple, a multiple, n < world, the last ranks past n, n = 0, world = 1, one element, a big one
_BOUNDS_CASES = ("rem", "mult", (3, 5), (9, 6), (0, 3), (7, 1), (1, 1), (1, 4), "big")


def _bounds_cases(rng):
    cases = []
    for c in _BOUNDS_CASES:
        if c == "rem":
            W = int(rng.integers(3, 8))
            cases.append((W * int(rng.integers(5, 40)) + int(rng.integers(1, W)), W))
        elif c == "mult":
            cases.append((4 * int(rng.integers(50, 500)), 4))
        elif c == "big":
            cases.append((int(rng.integers(10_000, 200_000)), int(rng.choice([3, 6, 8]))))
        else:
            cases.append(c)
    return cases


def _as_bounds(v):
    """(lo, hi) as ints, or a str saying what is wrong with v."""
    try:
        lo, hi = v
    except Exception:
        return f"your function returned {v!r:.80}"
    for x in (lo, hi):
        if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer, float, np.floating)):
            return f"your function returned {v!r:.80}"
        if isinstance(x, (float, np.floating)):
            return f"your function returned floats {v!r:.80}"
    return int(lo), int(hi)


def check_shard_bounds(fn, seed=None, task=None, quiet=False) -> "CheckResult":
    """Check lo, hi = fn(n, world, rank) (module docstring) for every rank of (n, world) pairs: n a multiple of
    world and not, n < world, ranks whose piece lies past n, n = 0, world = 1. Returns a CheckResult."""
    name = "shard_bounds"
    seed = _seed(name, fn, seed)
    taken = borrowed.borrowed_verdict(name, [fn], OWN[name], task=task, seed=seed, quiet=quiet,
                                      check="check_shard_bounds")
    if taken is not None:
        return taken
    rng = np.random.default_rng(seed)
    cases = _bounds_cases(rng)
    done = []                                   # (n, W, got) of the cases that ran
    for n, W in cases:
        dims = {"n": n, "world": W}
        where = f"n={n}, world={W}; seed {seed}"
        got = []
        for r in range(W):
            v, err = _call(name, fn, (n, W, r), seed, task, dims, quiet, where + f", rank={r}")
            if err is not None:
                if any(g != _expected_bounds(m, V) for m, V, g in done):
                    break                       # a wrong answer came before the error: report that
                return err
            b = _as_bounds(v)
            if isinstance(b, str):
                hint = ("return ints: use integer arithmetic (// and the ceiling -(-n // world)), not /"
                        if "floats" in b else "return a pair of ints (lo, hi)")
                return _result(name, task, "wrong", f"{name}: wrong - rank {r}: {b} ({where})", hint=hint,
                               seed=seed, dims=dims, quiet=quiet)
            got.append(b)
        else:
            done.append((n, W, got))
            continue
        break
    bad = [(n, W, got) for n, W, got in done if got != _expected_bounds(n, W)]
    if not bad:
        return _result(name, task, "correct", f"{name}: correct (every rank of {len(cases)} (n, world) pairs, "
                       f"including n < world, n = 0 and world = 1; seed {seed})", seed=seed,
                       dims={"cases": len(cases)}, quiet=quiet)
    n, W, got = bad[0]
    want = _expected_bounds(n, W)
    dims = {"n": n, "world": W}
    where = f"n={n}, world={W}; seed {seed}"

    def fail(msg, hint):
        return _result(name, task, "wrong", f"{name}: wrong - {msg} ({where})", hint=hint, seed=seed, dims=dims,
                       quiet=quiet, first_bad=(r,))
    r = next(r for r in range(W) if got[r] != want[r])
    at = f"rank {r}: yours {got[r]}, expected {want[r]}"
    for kind, hint in _BOUNDS_MISTAKES:            # the mistake that explains every case that ran
        if all(g == _bounds_variant(kind, m, V) for m, V, g in done):
            return fail(at, hint)
    for q in range(W):
        lo, hi = got[q]
        if hi < lo:
            return fail(f"{at}; rank {q}: lo={lo} > hi={hi}", "hi is one past the last element, so hi >= lo; a rank "
                        "with nothing to own gets an empty range (lo == hi)")
        if hi > n or lo > n:
            return fail(f"{at}; rank {q}'s shard ({lo}, {hi}) runs past n={n}",
                        "clip to n: the padding past n belongs to no parameter")
    for q in range(W - 1):
        if got[q][1] > got[q + 1][0]:
            return fail(f"{at}; ranks {q} and {q + 1} overlap: {got[q]} and {got[q + 1]}",
                        "shards must not overlap: rank r+1 starts where rank r stops (hi is exclusive)")
        if got[q][1] < got[q + 1][0]:
            return fail(f"{at}; elements {got[q][1]}..{got[q + 1][0] - 1} belong to no rank (between ranks {q} and "
                        f"{q + 1})", "rank r+1 starts where rank r stops")
    if got[0][0] != 0:
        return fail(f"{at}; rank 0 starts at {got[0][0]}", "rank 0's shard starts at element 0")
    return fail(f"{at}; shard sizes {[b - a for a, b in got]}, expected {[b - a for a, b in want]}",
                f"every piece has the ceiling of n / world = {_ceil(n, W)} elements (the buffer padded to world "
                f"pieces splits evenly), and each rank keeps the part of its piece below n")


# ----------------------------------------------------------------------------------------------------------------
# 10.3 the shard's decay table
# ----------------------------------------------------------------------------------------------------------------

def _table_case(rng, n_layer, d_model):
    from ..model.optim import DECAY_NAMES
    from ..model.params import GPTConfig, ParamBuffer

    cfg = GPTConfig(vocab_size=int(rng.integers(5, 14)), block_size=int(rng.integers(3, 10)),
                    n_layer=n_layer, n_head=2, d_model=d_model)
    buf = ParamBuffer(cfg)
    bounds = np.array([0] + [buf.offsets[k][1] for k in buf.names], dtype=np.int64)
    flags = np.array([k in DECAY_NAMES for k in buf.names], dtype=np.uint8)
    return bounds, flags


def _table_variant(kind, bounds, flags, lo, hi):
    b = np.asarray(bounds, dtype=np.int64)
    if kind == "unshifted":
        return np.clip(b, lo, hi), flags
    if kind == "unclipped":
        return b - lo, flags
    if kind == "low-only":
        return np.maximum(b - lo, 0), flags
    if kind == "high-only":
        return np.minimum(b - lo, hi - lo), flags
    if kind == "whole":
        return b, flags
    if kind == "off-by-one":
        return np.clip(b - lo, 0, hi - lo - 1), flags
    raise ValueError(kind)


_TABLE_MISTAKES = (
    ("whole", "you returned the whole buffer's table: the shard is indexed from 0 (its element i is global element "
     "lo + i), so every bound moves by lo and is limited to the shard"),
    ("unshifted", "the table bounds are not shifted: they are limited to lo..hi but still in the whole buffer's "
     "indices; the shard's own first element is index 0"),
    ("unclipped", "the bounds are not clipped: a tensor that starts before the shard or ends after it must be cut "
     "at 0 and at hi - lo"),
    ("low-only", "the bounds are not clipped at the top: tensors that end after the shard must stop at hi - lo"),
    ("high-only", "the bounds are not clipped at the bottom: tensors that start before the shard must start at 0"),
    ("off-by-one", "the table stops one element short: the shard has hi - lo elements, indices 0 .. hi-lo-1, so the "
     "last bound is hi - lo"),
)


def _table_mask(b, f):
    return np.repeat(np.asarray(f).astype(bool), np.diff(np.asarray(b, dtype=np.int64)))


def _table_calls(rng):
    from ..parallel import shard_bounds
    calls = []
    for n_layer, d_model, W in ((2, 6, 3), (1, 4, 5)):
        bounds, flags = _table_case(rng, n_layer, d_model)
        n = int(bounds[-1])
        j = int(rng.integers(1, len(bounds) - 3))
        shards = [(0, int(rng.integers(3, n - 3))),                          # from 0, ending inside a tensor
                  (int(rng.integers(3, n - 3)), n),                          # ending at n
                  (int(bounds[j]), int(bounds[j + 2])),                      # on tensor boundaries
                  (int(bounds[j]) + 1, int(bounds[j + 1]) - 1),              # strictly inside one tensor
                  (int(bounds[j + 1]), int(bounds[j + 1])),                  # empty
                  *(shard_bounds(n, W, r) for r in range(W))]                # every rank's shard
        calls += [(bounds, flags, lo, hi) for lo, hi in shards if lo <= hi]
    return calls


def _table_problem(b, f, lo, hi, mask):
    """None when (b, f) is the right table for the shard, else (message, hint)."""
    if b[0] != 0 or b[-1] != hi - lo:
        return (f"bounds run from {b[0]} to {b[-1]}, the shard from 0 to hi - lo = {hi - lo}",
                "the first bound is 0 and the last hi - lo: the table covers exactly the shard")
    if np.any(np.diff(b) < 0):
        k = int(np.flatnonzero(np.diff(b) < 0)[0])
        return (f"bounds are not increasing: bounds[{k}] = {b[k]} > bounds[{k + 1}] = {b[k + 1]}",
                "keep the tensors in buffer order; a tensor outside the shard is an empty range (or dropped)")
    ours = _table_mask(b, f)
    if not np.array_equal(ours, mask):
        e = int(np.flatnonzero(ours != mask)[0])
        return (f"shard element {e} (global {lo + e}) gets decay flag {int(ours[e])}, expected {int(mask[e])}",
                "the flags are out of step with the bounds: keep flags[j] with the range of tensor j (drop both or "
                "neither)")
    return None


def check_shard_decay_table(fn, seed=None, task=None, quiet=False) -> "CheckResult":
    """Check b, f = fn(bounds, flags, lo, hi) (module docstring) on the decay tables of two small GPTs and shards
    at 0, at n, inside one tensor, on tensor boundaries, empty, and every rank's shard. Returns a CheckResult."""
    name = "shard_decay_table"
    seed = _seed(name, fn, seed)
    taken = borrowed.borrowed_verdict(name, [fn], OWN[name], task=task, seed=seed, quiet=quiet,
                                      check="check_shard_decay_table")
    if taken is not None:
        return taken
    rng = np.random.default_rng(seed)
    calls = _table_calls(rng)
    done, first = [], None                     # (call index, b, f) of well-formed answers; the first wrong one
    for i, (bounds, flags, lo, hi) in enumerate(calls):
        n = int(bounds[-1])
        dims = {"n": n, "tensors": len(flags), "lo": lo, "hi": hi, "call": i + 1}
        where = (f"call {i + 1} of {len(calls)}: {len(flags)} tensors, n={n}, shard lo={lo}, hi={hi}"
                 f"{' (empty)' if lo == hi else ''}; seed {seed}")

        def fail(msg, hint, dims=dims, where=where):
            return _result(name, task, "wrong", f"{name}: wrong - {msg} ({where})", hint=hint, seed=seed, dims=dims,
                           quiet=quiet)
        got, err = _call(name, fn, (bounds.copy(), flags.copy(), lo, hi), seed, task, dims, quiet, where)
        if err is not None:
            if first is not None:
                break                           # a wrong answer came before the error: report that
            return err
        if not (isinstance(got, tuple) and len(got) == 2):
            return fail(f"your function returned {type(got).__name__}", "return two arrays: (bounds, flags)")
        try:
            b, f = (np.asarray(a) for a in got)
        except Exception:
            return fail("the two things returned are not arrays", "return two arrays: (bounds, flags)")
        empty_ok = lo == hi and b.size == 1 and f.size == 0
        if b.ndim != 1 or f.ndim != 1 or b.size != f.size + 1 or (f.size < 1 and not empty_ok):
            return fail(f"bounds has shape {b.shape} and flags {f.shape}",
                        "bounds needs one more entry than flags (tensor j is bounds[j] .. bounds[j+1]-1): when you "
                        "drop a tensor, drop its flag too")
        if b.size and not np.issubdtype(b.dtype, np.integer):
            return fail(f"bounds has dtype {b.dtype}", "bounds are element indices: an integer array (int64)")
        done.append((i, b, f))
        if first is None and _table_problem(b, f, lo, hi, _table_mask(bounds, flags)[lo:hi]) is not None:
            first = (i, fail)
    if first is None:
        return _result(name, task, "correct", f"{name}: correct (every shard element gets its tensor's decay flag, "
                       f"for {len(calls)} shards of two models: at 0, at n, inside one tensor, on boundaries, empty, "
                       f"every rank's; seed {seed})", seed=seed, dims={"cases": len(calls)}, quiet=quiet)
    i, fail = first
    bounds, flags, lo, hi = calls[i]
    b, f = next((b, f) for k, b, f in done if k == i)
    msg, hint = _table_problem(b, f, lo, hi, _table_mask(bounds, flags)[lo:hi])
    shown = f"your bounds {b.tolist()[:8]}{'...' if b.size > 8 else ''}: {msg}"
    for kind, text in _TABLE_MISTAKES:          # the mistake that explains every call that ran
        if all(np.array_equal(bk, vb) and np.array_equal(fk, vf)
               for k, bk, fk in done for vb, vf in [_table_variant(kind, *calls[k])]):
            return fail(shown, text)
    return fail(shown, hint)


# ----------------------------------------------------------------------------------------------------------------
# 10.4 ZeRO's reduce-scatter over point-to-point messages
# ----------------------------------------------------------------------------------------------------------------

class _RingBreak(Exception):
    """Raised inside a rank by the checker's communicator when a call breaks the contract (a named mistake)."""

    def __init__(self, what, hint):
        super().__init__(what)
        self.what, self.hint = what, hint


class _Stalled(Exception):
    def __init__(self, rank, call, src):
        super().__init__(f"rank {rank} waited in its sendrecv call {call} for a message from rank {src}")
        self.rank, self.call, self.src = rank, call, src


_ONLY_SENDRECV = ("use only comm.sendrecv(send_buf, dst, recv_buf, src) with your two ring neighbours: the point of "
                  "the exercise is to build the reduce-scatter out of point-to-point messages")


class _RingComm(Communicator):
    """N ranks as N threads: each sendrecv posts a copy of send_buf to the right neighbour's mailbox and waits (with a
    timeout) for the left neighbour's message. Only the ring's point-to-point messages are allowed."""

    name = "ring-threads"

    def __init__(self, rank, world, boxes, calls, barrier, timeout, slots=None):
        super().__init__(rank=rank, world_size=world)
        self._boxes, self._calls, self._barrier, self._timeout = boxes, calls, barrier, timeout
        self._slots = slots  # one per rank: what each rank brought to a collective (_SumComm)

    def sendrecv(self, send_buf, dst, recv_buf, src):
        r, N = self.rank, self.world_size
        k = self._calls[r]
        self._calls[r] += 1
        if isinstance(dst, bool) or not isinstance(dst, (int, np.integer)) or \
                isinstance(src, bool) or not isinstance(src, (int, np.integer)):
            raise _RingBreak(f"rank {r}, sendrecv call {k}: dst={dst!r}, src={src!r} are not ranks",
                             "dst and src are ranks (ints): the right neighbour (rank + 1) mod N and the left one")
        if int(dst) != (r + 1) % N or int(src) != (r - 1) % N:
            return self._wrong_peer(r, k, int(dst), int(src))
        if not isinstance(recv_buf, np.ndarray) or not isinstance(send_buf, np.ndarray):
            raise _RingBreak(f"rank {r}, sendrecv call {k}: send_buf and recv_buf must be NumPy arrays, got "
                             f"{type(send_buf).__name__} and {type(recv_buf).__name__}",
                             "pass arrays (slices of grad, or a scratch array of the right size): sendrecv receives "
                             "INTO recv_buf")
        if not recv_buf.flags.writeable:
            raise _RingBreak(f"rank {r}, sendrecv call {k}: recv_buf is read-only", "receive into a writable array")
        if np.shares_memory(send_buf, recv_buf):
            raise _RingBreak(f"rank {r}, sendrecv call {k}: send_buf and recv_buf overlap in memory",
                             "receive into a separate scratch buffer: the arriving chunk must be ADDED to yours, so "
                             "it cannot land on top of the chunk you are sending (or adding into)")
        self._boxes[r].put((k, np.array(send_buf, dtype=np.float64, copy=True)))
        try:
            k_src, data = self._boxes[(r - 1) % N].get(timeout=self._timeout)
        except queue.Empty:
            raise _Stalled(r, k, (r - 1) % N) from None
        if data.size != recv_buf.size:
            raise _RingBreak(f"rank {r}, sendrecv call {k}: rank {(r - 1) % N} sent {data.size} elements, your "
                             f"recv_buf holds {recv_buf.size}",
                             "every message is one shard of S elements: send a shard and receive into an S-element "
                             "buffer")
        recv_buf[...] = data.reshape(recv_buf.shape)
        return recv_buf

    def _wrong_peer(self, r, k, dst, src):
        N = self.world_size
        raise _RingBreak(f"rank {r}, sendrecv call {k}: dst={dst}, src={src}; its ring neighbours are dst "
                         f"{(r + 1) % N} (right) and src {(r - 1) % N} (left)",
                         "in a ring each rank sends only to its right neighbour (rank + 1) mod N and receives only "
                         "from its left one (rank - 1) mod N")

    def barrier(self):
        try:
            self._barrier.wait(timeout=self._timeout)
        except threading.BrokenBarrierError:
            raise _Stalled(self.rank, "barrier", "all") from None

    def _only(self, *a, **k):
        raise _RingBreak(f"rank {self.rank} called a collective of the communicator", _ONLY_SENDRECV)

    all_reduce = reduce_scatter = all_gather = broadcast = send = recv = _only


class _SumComm(_RingComm):
    """N ranks as N threads with one collective (exercise 13.1): all_reduce(buf) replaces buf, on every rank, with
    the elementwise sum of the N ranks' bufs (added in rank order, so every rank gets the same bits) and returns it,
    as the course's communicators do. Every rank must call it the same number of times with arrays of one shape; a
    rank that waits longer than the timeout for the others raises _Stalled. No point-to-point messages."""

    name = "sum-threads"

    def all_reduce(self, buf, op="sum"):
        r, N = self.rank, self.world_size
        k = self._calls[r]
        self._calls[r] += 1
        if op != "sum":
            raise _RingBreak(f"rank {r}, all_reduce call {k}: op={op!r}",
                             "all_reduce here sums (op='sum', the default): the ranks' parts add up to the whole")
        if not isinstance(buf, np.ndarray):
            raise _RingBreak(f"rank {r}, all_reduce call {k}: buf is {type(buf).__name__}, not a NumPy array",
                             "pass the NumPy array to sum over the ranks: all_reduce replaces its values in place")
        if not buf.flags.writeable:
            raise _RingBreak(f"rank {r}, all_reduce call {k}: buf is read-only",
                             "all_reduce writes the sum into buf: pass an array of your own (a new one, or a copy)")
        self._slots[r] = (k, np.array(buf, copy=True))
        self._wait(k)                                  # every rank has brought its part
        mine = (k, buf.shape)
        others = [(q, kq, part.shape) for q, (kq, part) in enumerate(self._slots) if (kq, part.shape) != mine]
        if others:
            q, kq, shape = others[0]
            raise _RingBreak(f"rank {r}'s all_reduce call {k} got an array of shape {buf.shape}, rank {q}'s call {kq} "
                             f"one of shape {shape}",
                             "every rank calls all_reduce with the same tensors in the same order: one call per tensor "
                             "to sum, the same shapes on every rank")
        total = self._slots[0][1].copy()
        for q in range(1, N):
            total += self._slots[q][1]
        self._wait(k)                                  # every rank has read the parts before the next call's arrive
        buf[...] = total
        return buf

    def _wait(self, k):
        try:
            self._barrier.wait(timeout=self._timeout)
        except threading.BrokenBarrierError:
            raise _Stalled(self.rank, k, "all") from None

    def _not_here(self, *a, **k):
        raise _RingBreak(f"rank {self.rank} called a communicator method other than all_reduce",
                         "this exercise's comm offers comm.all_reduce(buf) (with comm.rank and comm.world_size): the "
                         "sum over the ranks, in place")

    sendrecv = reduce_scatter = all_gather = broadcast = send = recv = all_to_all = _not_here


def _run_threads(fn, args, timeout=1.0, comm_cls=_RingComm):
    """Run fn(comm_r, *args[r]) for the N = len(args) ranks, one thread each, each with its comm_cls communicator.
    Returns (values, outcomes, calls, hung): values[r] what rank r returned (None if it raised), outcomes[r] None
    (returned) or the exception it raised, calls[r] its number of communicator calls, hung the ranks still running."""
    N = len(args)
    boxes = [queue.Queue() for _ in range(N)]          # boxes[r]: the messages rank r sent to rank r+1
    calls = [0] * N
    barrier = threading.Barrier(N)
    slots = [None] * N
    values, outcomes = [None] * N, [None] * N

    def body(r):
        comm = comm_cls(r, N, boxes, calls, barrier, timeout, slots)
        try:
            values[r] = fn(comm, *args[r])
        except BaseException as exc:  # noqa: B902 - reported by the checker
            outcomes[r] = exc

    threads = [threading.Thread(target=body, args=(r,), daemon=True, name=f"rank{r}") for r in range(N)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout * (N + 4)
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    hung = [r for r, t in enumerate(threads) if t.is_alive()]
    return values, outcomes, calls, hung


def _run_ranks(fn, grads, outs, timeout=1.0):
    """Run fn(comm_r, grads[r], outs[r]) on N threads. Returns (outcomes, calls, hung): outcomes[r] is None
    (returned) or the exception the rank raised; calls[r] its number of sendrecv calls; hung: ranks still running."""
    _, outcomes, calls, hung = _run_threads(fn, list(zip(grads, outs)), timeout)
    return outcomes, calls, hung


def reduce_scatter_variant(grads, S, offset=1, steps=None, add=True):
    """ZeRO's ring reduce-scatter simulated in NumPy on a copy of grads (N, N*S), or a named mistake: at step s rank
    r sends shard (r - s - offset) mod N to rank r+1 (offset 1: rank r ends with shard r, as ZeRO needs; offset 0:
    with shard r + 1, as the lesson's ring), for `steps` steps (None: N-1), adding (or overwriting) what arrives.
    Returns (g, last): every rank's buffer afterwards (N, N*S) and the shard each rank received last."""
    g = np.array(grads, dtype=np.float64, copy=True)
    N = g.shape[0]
    steps = N - 1 if steps is None else steps
    for s in range(steps):
        ks = [(r - s - offset) % N for r in range(N)]
        data = [g[r, ks[r] * S:(ks[r] + 1) * S].copy() for r in range(N)]
        for r in range(N):
            lo, hi = ks[r] * S, (ks[r] + 1) * S
            if add:
                g[(r + 1) % N, lo:hi] += data[r]
            else:
                g[(r + 1) % N, lo:hi] = data[r]
    last = [(r - steps - offset) % N if steps else r for r in range(N)]
    return g, last


def _rs_mistakes(grads, S):
    """(the (N, S) outs a named mistake gives, hint) for the inputs grads (N, N*S)."""
    N = grads.shape[0]
    total = grads.sum(axis=0)

    def shards(g, which):
        return np.stack([g[r, which[r] * S:(which[r] + 1) * S] for r in range(N)])
    own = list(range(N))
    out = [(shards(grads, own), "out holds only this rank's own shard: nothing from the other ranks was added (pass "
            "the shards around the ring, N-1 steps, adding what arrives)")]
    for k in range(1, N):
        lesson = (": the lesson's reduce-scatter finishes chunk r + 1 on rank r; to finish your own shard, start one "
                  "shard earlier") if k == 1 else ""
        out.append((np.stack([total[((r + k) % N) * S:((r + k) % N + 1) * S] for r in range(N)]),
                    f"every rank ended with the sum of the wrong shard: rank r holds shard (r + {k}) mod N's, ZeRO "
                    f"needs shard r on rank r{lesson}"))
    out.append((shards(np.broadcast_to(total, grads.shape) / N, own),
                "you averaged: the reduce-scatter SUMS the ranks' shards (data parallel multiplies by 1/N afterwards)"))
    for offset in (1, 0):
        g, last = reduce_scatter_variant(grads, S, offset=offset, add=False)
        for which in (own, last):
            out.append((shards(g, which), "what arrives overwrites instead of being added: receive into a scratch "
                        "buffer and ADD it into your copy of that shard"))
    g, last = reduce_scatter_variant(grads, S, offset=0)
    out.append((shards(g, own), "your own shard is not complete: with the lesson's schedule rank r finishes shard "
                "r + 1 and its own shard r holds only part of the sum; to end with shard r, start one shard earlier"))
    for steps, hint in ((N - 2, "one step short: after N-2 steps a shard holds N-1 ranks' data; the reduce-scatter "
                                "needs N-1 steps"),
                        (N, "one step too many: N steps add one rank's data twice; the reduce-scatter has N-1 steps")):
        if steps >= 1:
            g, last = reduce_scatter_variant(grads, S, steps=steps)
            out += [(shards(g, own), hint), (shards(g, last), hint)]
    return out


# N ranks, S elements per shard: one rank, two, odd S, prime N, one element per shard
_RS_CASES = ((3, 5), (2, 3), (5, 3), (1, 4), (4, 1))


def check_zero_reduce_scatter(fn, seed=None, task=None, quiet=False, timeout=1.0) -> "CheckResult":
    """Check fn(comm, grad, out) (module docstring) run on N ranks at once (one thread each), for N = 3, 2, 5, 1, 4
    ranks and shards of 5, 3, 3, 4, 1 elements: every rank's out must be the sum over the ranks of its own shard.
    timeout: seconds a rank waits for a message before the checker calls it stuck. Returns a CheckResult."""
    name = "zero_reduce_scatter"
    seed = _seed(name, fn, seed)
    taken = borrowed.borrowed_verdict(name, [fn], OWN[name], task=task, seed=seed, quiet=quiet,
                                      check="check_zero_reduce_scatter")
    if taken is not None:
        return taken
    rng = np.random.default_rng(seed)
    for i, (N, S) in enumerate(_RS_CASES):
        grads = rng.integers(-9, 10, (N, N * S)).astype(np.float64)
        total = grads.sum(axis=0)
        expected = np.stack([total[r * S:(r + 1) * S] for r in range(N)])
        dims = {"N": N, "S": S, "call": i + 1}
        where = f"call {i + 1} of {len(_RS_CASES)}: N={N} ranks, shards of S={S}, grad ({N * S},); seed {seed}"

        def fail(msg, hint):
            return _result(name, task, "wrong", f"{name}: wrong - {msg} ({where})", hint=hint, seed=seed, dims=dims,
                           quiet=quiet)
        work = [grads[r].copy() for r in range(N)]
        outs = [np.full(S, np.nan) for _ in range(N)]
        outcomes, calls, hung = _run_ranks(fn, work, outs, timeout=timeout)
        raised = [(r, e) for r, e in enumerate(outcomes) if e is not None]
        if any(isinstance(e, NotImplementedError) for _, e in raised):
            return _not_attempted(name, task, seed, dims, quiet)
        learner = [(r, e) for r, e in raised if not isinstance(e, (_RingBreak, _Stalled))]
        if learner:
            r, e = learner[0]
            return _raised(name, e, task, seed, dims, quiet, f"on rank {r}; {where}")
        breaks = [(r, e) for r, e in raised if isinstance(e, _RingBreak)]
        if breaks:
            return fail(breaks[0][1].what, breaks[0][1].hint)
        if hung:
            return fail(f"{_ranks(hung)} did not return within {timeout * (N + 4):g} s",
                        "an endless loop, or a rank waiting for something that never happens")
        stalled = [(r, e) for r, e in raised if isinstance(e, _Stalled)]
        if stalled:
            r, e = stalled[0]
            return fail(f"rank {r} waited in its sendrecv call {e.call} for rank {e.src}, which made only "
                        f"{calls[e.src] if isinstance(e.src, int) else '?'} calls (calls per rank: {calls})",
                        "every rank must make the same number of sendrecv calls (N-1): a rank that skips or adds a "
                        "step leaves its neighbour waiting")
        if N > 1 and len(set(calls)) == 1 and calls[0] == 0:
            if np.array_equal(np.stack(outs), expected):
                return fail("no rank called sendrecv, yet out holds the sum", "the ranks cannot see each other's "
                            "data: build the sum from sendrecv messages")
        if any(np.isnan(o).all() for o in outs) and S > 0:
            r = next(r for r in range(N) if np.isnan(outs[r]).all())
            return fail(f"rank {r}'s out was never written (it still holds the checker's NaN fill)",
                        "write INTO out (out[...] = ...): `out = ...` only rebinds the name inside your function")
        ours = np.stack(outs)
        if np.array_equal(ours, expected):
            continue
        r, j = (int(v) for v in np.argwhere(~(ours == expected))[0])
        rows = sorted({int(v) for v in np.argwhere(~(ours == expected))[:, 0]})
        at = (f"rank {r}'s out[{j}] (element {r * S + j} of the buffer): yours {ours[r, j]:g}, expected "
              f"{expected[r, j]:g}, the sum over the {N} ranks; wrong on {_ranks(rows)}; sendrecv calls per rank: "
              f"{calls}")
        own = np.stack([grads[q, q * S:(q + 1) * S] for q in range(N)])
        if N > 1 and np.array_equal(ours, own):
            if sum(calls):
                return fail(at, "your own shard never received anything: with the lesson's schedule rank r "
                            "finishes chunk r + 1 and never receives chunk r; to end with your own shard r, start "
                            "one shard earlier")
            return fail(at, "out holds only this rank's own shard: no message was sent (pass the shards around the "
                        "ring with comm.sendrecv, N-1 steps, adding what arrives)")
        for wrong, hint in _rs_mistakes(grads, S):
            if np.array_equal(ours, wrong):
                return fail(at, hint)
        return fail(at, "each of the N-1 steps: send the shard you have just added to (at the first step one of "
                    "your own), receive the left neighbour's into a scratch buffer, add it into your copy of that "
                    "shard; after the last step your own shard holds every rank's data")
    return _result(name, task, "correct", f"{name}: correct (every rank ends with the sum of its own shard, from ring "
                   f"sendrecv messages only, for N = {', '.join(str(N) for N, _ in _RS_CASES)} ranks; seed {seed})",
                   seed=seed, dims={"cases": len(_RS_CASES)}, quiet=quiet)
