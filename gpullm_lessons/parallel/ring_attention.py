"""Ring attention: sequence parallelism for long contexts, causal self-attention over N ranks (CPU ranks, NumPy).

    merge_partials(out1, lse1, out2, lse2)          two partial attention results over disjoint key sets -> one
    ring_attention_forward(comm, q, k, v)           this rank's block of causal attention: (out, lse)
    ring_attention_backward(comm, dout, q, k, v, out, lse)   this rank's (dq, dk, dv)
    simulate_ring_attention(q, k, v, N)             the same arithmetic for N simulated ranks in one process,
    simulate_ring_attention_backward(dout, q, k, v, N)       with the step log (rank, key block, kind) a lesson draws
    step_kind(r, j)                                 what rank r does with key block j: "full", "causal" or "skip"
    memory_model(B, nh, T, hs, N)                   the bytes a rank allocates, phase by phase, and its peak
    measure_memory(comm, B, nh, T, hs)              each rank's allocations measured (tracemalloc) beside the model

One sequence of T positions is cut into N contiguous blocks of T/N (N must divide T): rank r holds the queries, keys
and values of block r, q, k, v each (B, nh, T/N, hs), and ends with the rows of causal attention for block r, the
same numbers one rank's sdpa_forward(q, k, v, causal=True) gives those rows (reference/attention.py). No rank ever
holds the whole (T, T) score matrix, nor the whole k and v: a rank holds blocks of T/N positions and one
(T/N, T/N) score block at a time (a flash kernel would tile even that), which is the point: N ranks, N times the
context.

The ring (rank r sends to r+1 and receives from r-1, all at once, like the ring all-reduce of parallel/__init__.py):
    step s = 0 .. N-1: rank r holds the k, v block j = (r - s) mod N (its own at step 0) and attends its q block to
        it, then (s < N-1) passes that k, v block on to r+1 and receives block (r - s - 1) mod N from r-1.
    After N steps every q block has met every k, v block once.
The mask of a step (causal, blocks of equal length, so query t of block r may see key s of block j when
j T/N + s <= r T/N + t):
    j < r   every key is in the past: no mask ("full", non-causal attention of the two blocks)
    j == r  the diagonal block: the causal square s <= t ("causal"; sdpa's bottom-right alignment = top-left here)
    j > r   every key is in the future: nothing to compute ("skip"); the block still travels on.
The merge (lesson 11's online softmax, at the granularity of blocks): a step's partial result over key set K_j is
out_j = softmax(scores over K_j) @ v_j with lse_j = log sum_{s in K_j} exp(score_s); over disjoint key sets
    m = max(lse1, lse2),  w_i = exp(lse_i - m),  lse = m + log(w1 + w2),  out = (w1 out1 + w2 out2) / (w1 + w2)
is exactly the softmax over the union (w_i / (w1 + w2) is the share of the total softmax mass in K_i). Subtracting
m keeps every exp <= 1 (no overflow for large scores); a side that saw no key has lse = -inf and weight 0 (both
-inf: out 0, lse -inf, no NaN). Each rank starts from (out 0, lse -inf) and merges one partial per computed step.

Communication per step: one sendrecv of the k and v block, 2 B nh (T/N) hs elements each way, N-1 of them: every
rank sends 2 (N-1)/N of the whole k and v over the whole forward, whatever N is. The scores of a step cost
B nh (T/N)^2 hs multiply-adds, so compute per byte moved grows with T/N: with long blocks a real implementation
hides the transfer behind the step's attention (start the sendrecv of the next block, then compute on the current
one; here sendrecv is blocking and the steps run one after the other).

Backward (FlashAttention-2's, block by block): with the forward's final out and lse of this rank's queries and
D = sum(dout * out, -1), the probabilities of block j are recomputed as P = exp(scores - lse) (no second softmax:
lse is the whole row's normaliser), then dv_j = P^T dout, dP = dout v_j^T, dS = P (dP - D), dq += scale dS k_j,
dk_j = scale dS^T q. dq stays on the q's rank. dk and dv of block j gather contributions from every rank r >= j, so
they travel with their k, v block: the ring passes (k, v, dk, dv) of block j on each step, every rank adds its part,
and after the N-th computing step rank r holds block (r+1) mod N, which one more hop (dk, dv only) returns to its
owner r+1. Volume: N-1 hops of 4 blocks + 1 hop of 2 blocks = (4N-2) B nh (T/N) hs elements per rank, a little
over twice the forward's 2(N-1). The other choice, computing dk_j, dv_j partials and sending each straight back
to owner j, moves about the same (k, v still travel: 2(N-1) blocks, plus 2 blocks to each of up to N-1 owners) but
to ranks that are not neighbours and needs a sum at each owner; carrying them is the same loop as the forward,
neighbours only.

The causal imbalance: rank r computes r full blocks and one half (the diagonal) and skips N-1-r: rank 0 does half
a block of work, rank N-1 does N - 1/2 blocks, and since every step waits for its sendrecv the slowest rank sets
the pace: about half of the ranks' time is idle, the same wall time as non-causal attention for half the useful
work. The fix (not implemented here) is to deal positions out so that every rank holds as much past as future:
zig-zag (cut T into 2N chunks, rank r takes chunks r and 2N-1-r, one early and one late: every rank then has the
same work at every step; ring-flash-attention's zigzag variant, and the chunks Llama 3's context parallelism deals
out) or striped attention (Brandon et al. 2023: rank r holds the positions t with t mod N = r, so every step is a
near-triangular mask of about half a block). Both change only which positions a rank holds and the mask of each
step; the ring and the merge stay as here.

Not here: the GPU version (NCCLComm sendrecv of CuPy blocks overlapped with flash-attention kernels that return
lse), and Ulysses (DeepSpeed): an all-to-all that trades the sequence split for a head split, so each rank runs
ordinary attention on all T positions of nh/N heads, then a second all-to-all back; it needs nh divisible by N.

CLI (each rank runs it; a self-check against the one-rank computation, exit status 1 when an error is over its
tolerance, 2 for a configuration problem):
    python -m gpullm_lessons.parallel.launch --nproc 4 --backend mpi --module gpullm_lessons.parallel -- \\
        ring-attention --seq 32 --dtype both
"""

from __future__ import annotations

import argparse
import math
import sys

import numpy as np

from ..reference.attention import attention_mask, sdpa_backward, sdpa_forward

KINDS = ("full", "causal", "skip")
TOLERANCES = {"float64": 1e-12, "float32": 1e-5}  # the self-check's limit on max|err| / max|reference| (cli)
MEMORY_TOLERANCE = 0.10  # measure_memory: each rank's measured peak within 10% of memory_model's


# ================================================================================================================
# 1. The merge and the steps
# ================================================================================================================


def merge_partials(out1, lse1, out2, lse2):
    """Merge two partial attention results over disjoint key sets: out_i (..., hs), lse_i (...) -> (out, lse), the
    attention over the union of the key sets (module docstring). A side with lse = -inf saw no key and has weight 0
    (its out is ignored, even a NaN); both -inf gives out 0 and lse -inf."""
    out1, lse1, out2, lse2 = (np.asarray(a) for a in (out1, lse1, out2, lse2))
    if out1.shape != out2.shape:
        raise ValueError(f"merge_partials: out1 has shape {out1.shape} but out2 {out2.shape}: they must be equal")
    if out1.ndim < 1 or lse1.shape != out1.shape[:-1] or lse2.shape != out1.shape[:-1]:
        raise ValueError(
            f"merge_partials: lse1 {lse1.shape} and lse2 {lse2.shape} must be out's shape {out1.shape} without "
            f"its last axis (one lse per query)"
        )
    m = np.maximum(lse1, lse2)
    m = np.where(np.isfinite(m), m, 0.0)  # both -inf: any finite m gives weights exp(-inf) = 0, no -inf - -inf
    w1, w2 = np.exp(lse1 - m), np.exp(lse2 - m)  # each <= 1: no overflow
    den = w1 + w2
    seen = den > 0
    lse = np.where(seen, m + np.log(np.where(seen, den, 1.0)), -np.inf)
    w1, w2 = w1[..., None], w2[..., None]  # one weight per query, over its hs outputs
    num = np.where(w1 > 0, w1 * out1, 0.0) + np.where(w2 > 0, w2 * out2, 0.0)  # weight 0: out ignored (even NaN)
    out = num / np.where(seen, den, 1.0)[..., None]
    return out.astype(np.result_type(out1, out2), copy=False), lse.astype(np.result_type(lse1, lse2), copy=False)


def step_kind(r: int, j: int, causal: bool = True) -> str:
    """What rank r (queries of block r) does with key block j: "full" (j < r, or not causal: every key seen),
    "causal" (j == r: the causal square) or "skip" (j > r: every key in the future, nothing to compute)."""
    if not causal:
        return "full"
    return "full" if j < r else "causal" if j == r else "skip"


def block_attention(q, k, v, kind):
    """One step's partial result: (out, lse) of q's block attending to the k, v block (sdpa_forward, no mask or the
    causal square), or None for "skip"."""
    if kind not in KINDS:
        raise ValueError(f"block_attention: kind must be one of {KINDS}, got {kind!r}")
    if kind == "skip":
        return None
    out, cache = sdpa_forward(q, k, v, causal=kind == "causal")
    return out, cache["lse"]


def block_attention_backward(dout, q, k, v, lse, D, kind):
    """One step's gradients (dq part, dk part, dv part) from the forward's final lse (B, nh, Tq) and
    D = sum(dout * out, -1) of q's rows (module docstring: P = exp(scores - lse), recomputed), or None for "skip"."""
    if kind not in KINDS:
        raise ValueError(f"block_attention_backward: kind must be one of {KINDS}, got {kind!r}")
    if kind == "skip":
        return None
    scale = 1.0 / math.sqrt(q.shape[-1])
    allowed = attention_mask(q.shape[2], k.shape[2], causal=kind == "causal")
    lse = np.where(np.isfinite(lse), lse, np.inf)[..., None]  # a row that saw no key: P = 0
    s = (q @ k.swapaxes(-1, -2)) * scale
    p = np.exp(np.where(allowed, s - lse, -np.inf))  # (B, nh, Tq, Tk), the final softmax's entries
    dv = p.swapaxes(-1, -2) @ dout
    ds = p * (dout @ v.swapaxes(-1, -2) - D[..., None])
    return (ds @ k) * scale, (ds.swapaxes(-1, -2) @ q) * scale, dv


# ================================================================================================================
# 2. One rank's ring, written once: a generator that yields what it passes on and is sent what it receives
# ================================================================================================================


def _forward_steps(r, N, q, k, v, causal, kind, log):
    """Rank r's forward: yields the (2, ...) k, v block to pass to r+1 and gets the one from r-1 back (N-1 times);
    returns (out, lse). Appends (step, rank, block, kind) to log."""
    out = np.zeros_like(q)
    lse = np.full(q.shape[:-1], -np.inf, dtype=q.dtype)
    kv = np.stack([k, v])  # one contiguous buffer: one sendrecv per step
    for s in range(N):
        j = (r - s) % N
        what = kind(r, j, causal)
        log.append((s, r, j, what))
        part = block_attention(q, kv[0], kv[1], what)
        if part is not None:
            out, lse = merge_partials(out, lse, *part)
            part = None  # freed before the next step's block (memory_model)
        if s < N - 1:
            kv = yield kv
    return out, lse


def _backward_steps(r, N, dout, q, k, v, out, lse, causal, kind, log):
    """Rank r's backward: yields the (4, ...) k, v, dk, dv block N-1 times, then the (2, ...) dk, dv block it holds
    once more (to its owner); returns (dq, dk, dv) of block r."""
    D = (dout * out).sum(-1)
    dq = np.zeros_like(q)
    buf = np.stack([k, v, np.zeros_like(k), np.zeros_like(v)])
    for s in range(N):
        j = (r - s) % N
        what = kind(r, j, causal)
        log.append((s, r, j, what))
        g = block_attention_backward(dout, q, buf[0], buf[1], lse, D, what)
        if g is not None:
            dq += g[0]
            buf[2] += g[1]
            buf[3] += g[2]
            g = None  # freed before the next step's block (memory_model)
        if s < N - 1:
            buf = yield buf
    dkv = yield np.ascontiguousarray(buf[2:])  # block (r+1) mod N's gradients go home to rank r+1
    return dq, dkv[0], dkv[1]


def _run_on_comm(comm, gen):
    """Drive one rank's generator over comm.sendrecv (send to r+1, receive from r-1)."""
    r, N = comm.rank, comm.world_size
    try:
        send = next(gen)
        while True:
            recv = np.empty_like(send)
            comm.sendrecv(send, (r + 1) % N, recv, (r - 1) % N)
            send = None  # the block passed on is freed before the next step computes (memory_model counts one)
            send = gen.send(recv)
    except StopIteration as done:
        return done.value


def _run_simulated(gens):
    """Drive N ranks' generators in lock-step: at each hop rank r receives a copy of what rank r-1 yielded. Every
    rank yields the same number of times, so all of them finish in the same round."""
    N = len(gens)
    sends, results, recvs = [None] * N, [None] * N, None
    while True:
        done = 0
        for r, g in enumerate(gens):
            try:
                sends[r] = next(g) if recvs is None else g.send(recvs[r])
            except StopIteration as stop:
                results[r], done = stop.value, done + 1
        if done:
            if done != N:
                raise RuntimeError("ring attention: the simulated ranks took different numbers of steps")
            return results
        recvs = [np.array(sends[(r - 1) % N], copy=True) for r in range(N)]


# ================================================================================================================
# 3. The API: real ranks and simulated ones
# ================================================================================================================


def _check_qkv(fn, q, k, v, what="q"):
    q, k, v = (np.asarray(x) for x in (q, k, v))
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not np.issubdtype(x.dtype, np.floating):
            raise TypeError(f"{fn}: {name} must be a floating-point array, got dtype {x.dtype}")
        if x.ndim != 4:
            raise ValueError(f"{fn}: {name} must be 4-D (B, nh, T, hs) ({what}), got shape {x.shape}")
    if not (q.shape == k.shape == v.shape):
        raise ValueError(
            f"{fn}: q {q.shape}, k {k.shape} and v {v.shape} must have one shape (B, nh, T, hs) ({what}): "
            f"self-attention over one sequence"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{fn}: q, k, v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.shape[2] < 1 or q.shape[3] < 1:
        raise ValueError(f"{fn}: q, k, v need T >= 1 and hs >= 1, got {q.shape}")
    return q, k, v


def _check_like(fn, name, x, shape, dtype):
    x = np.asarray(x)
    if x.shape != shape:
        raise ValueError(f"{fn}: {name} has shape {x.shape}, expected {shape}")
    return x.astype(dtype, copy=False)


def _check_split(fn, T, N):
    if isinstance(N, bool) or not isinstance(N, (int, np.integer)) or N < 1:
        raise ValueError(f"{fn}: N (the number of ranks) must be a positive int, got {N!r}")
    if T % N:
        raise ValueError(
            f"{fn}: T={T} positions do not split into N={N} equal blocks (T % N = {T % N}): ring attention "
            f"gives each rank T/N contiguous positions; pad the sequence or pick N dividing T"
        )
    return T // N


def ring_attention_forward(comm, q, k, v, causal=True, *, kind=step_kind):
    """This rank's causal attention over the whole sequence: q, k, v (B, nh, T/N, hs) of block comm.rank ->
    (out (B, nh, T/N, hs), lse (B, nh, T/N)), the rows of one-rank sdpa_forward(q, k, v, causal=True) for this
    block. Every rank must call it with blocks of one shape and dtype. causal=False: every step is "full".
    kind(r, j, causal) -> "full" | "causal" | "skip" is step_kind (a test plants a wrong one)."""
    q, k, v = _check_qkv("ring_attention_forward", q, k, v, what="this rank's block")
    return _run_on_comm(comm, _forward_steps(comm.rank, comm.world_size, q, k, v, causal, kind, []))


def ring_attention_backward(comm, dout, q, k, v, out, lse, causal=True, *, kind=step_kind):
    """This rank's gradients: dout (B, nh, T/N, hs) of its out, with the forward's q, k, v, out, lse ->
    (dq, dk, dv), each (B, nh, T/N, hs): the rows of one-rank sdpa_backward for this block (dk, dv of this rank's
    keys, summed over every rank's queries)."""
    fn = "ring_attention_backward"
    q, k, v = _check_qkv(fn, q, k, v, what="this rank's block")
    dout = _check_like(fn, "dout", dout, q.shape, q.dtype)
    out = _check_like(fn, "out", out, q.shape, q.dtype)
    lse = _check_like(fn, "lse", lse, q.shape[:-1], q.dtype)
    gen = _backward_steps(comm.rank, comm.world_size, dout, q, k, v, out, lse, causal, kind, [])
    return _run_on_comm(comm, gen)


def _blocks(x, N):
    return [np.ascontiguousarray(b) for b in np.split(x, N, axis=2)]


def simulate_ring_attention(q, k, v, N, causal=True, *, kind=step_kind):
    """Ring attention of N simulated ranks in one process (the arithmetic of ring_attention_forward, the same
    code): q, k, v (B, nh, T, hs), the whole sequence, N dividing T -> (out (B, nh, T, hs), lse (B, nh, T), log),
    log[s] the list of (rank, key block, kind) of step s."""
    fn = "simulate_ring_attention"
    q, k, v = _check_qkv(fn, q, k, v, what="the whole sequence")
    _check_split(fn, q.shape[2], N)
    log = []
    qs, ks, vs = _blocks(q, N), _blocks(k, N), _blocks(v, N)
    gens = [_forward_steps(r, N, qs[r], ks[r], vs[r], causal, kind, log) for r in range(N)]
    res = _run_simulated(gens)
    out = np.concatenate([o for o, _ in res], axis=2)
    lse = np.concatenate([m for _, m in res], axis=2)
    return out, lse, _step_log(log, N)


def simulate_ring_attention_backward(dout, q, k, v, N, causal=True, *, kind=step_kind):
    """The backward of simulate_ring_attention: dout (B, nh, T, hs) -> (dq, dk, dv, log), each (B, nh, T, hs) as
    one-rank sdpa_backward of sdpa_forward(q, k, v, causal=True); runs the forward first (for out and lse)."""
    fn = "simulate_ring_attention_backward"
    q, k, v = _check_qkv(fn, q, k, v, what="the whole sequence")
    dout = _check_like(fn, "dout", dout, q.shape, q.dtype)
    _check_split(fn, q.shape[2], N)
    out, lse, _ = simulate_ring_attention(q, k, v, N, causal, kind=kind)
    log = []
    b = [_blocks(x, N) for x in (dout, q, k, v, out)]
    ls = [np.ascontiguousarray(x) for x in np.split(lse, N, axis=2)]
    gens = [_backward_steps(r, N, *(x[r] for x in b), ls[r], causal, kind, log) for r in range(N)]
    res = _run_simulated(gens)
    dq, dk, dv = (np.concatenate([g[i] for g in res], axis=2) for i in range(3))
    return dq, dk, dv, _step_log(log, N)


def _step_log(log, N):
    steps = [[] for _ in range(N)]
    for s, r, j, what in sorted(log):
        steps[s].append((r, j, what))
    return steps


def work_per_rank(N: int, causal: bool = True) -> list:
    """Blocks of attention each rank computes over the ring (a "causal" diagonal counts 1/2): causal r + 1/2."""
    return [sum({"full": 1.0, "causal": 0.5, "skip": 0.0}[step_kind(r, j, causal)] for j in range(N)) for r in range(N)]


# ================================================================================================================
# 4. Memory per rank: what a rank allocates, predicted and measured
# ================================================================================================================


def _traced_peak(fn):
    """(fn's return, bytes allocated at fn's peak over what was allocated when it started): tracemalloc's peak, which
    NumPy's arrays report to (their data buffers; Python objects are a few hundred bytes)."""
    import tracemalloc

    was = tracemalloc.is_tracing()
    if not was:
        tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        res = fn()
        return res, tracemalloc.get_traced_memory()[1] - base
    finally:
        if not was:
            tracemalloc.stop()


def memory_model(batch, n_head, seq, head_size, N, dtype="float64") -> dict:
    """Bytes one of N ranks allocates over its forward and backward, from what the ring holds (below) and the peak of
    one step's block attention (block_attention, block_attention_backward on (T/N, T/N) blocks, measured alone, in
    this process). With X = B nh (T/N) hs and L = B nh (T/N) elements, a rank allocates out (X) and lse (L) in the
    forward, which stay; then at each phase, beside them:
        forward step      the k, v block (2X) + one block's forward
        forward exchange  the k, v block and the one arriving (2X + 2X)
        backward step     D (L), dq (X), the k, v, dk, dv block (4X) + one block's backward
        backward exchange D, dq, the block and the one arriving (4X + 4X); the last hop: dk, dv only (2X + 2X)
    The peak is the largest phase. one_rank: sdpa_forward + sdpa_backward on all T positions (what one rank without
    the ring allocates: the (T, T) scores it caches, measured the same way)."""
    fn = "memory_model"
    Tb = _check_split(fn, seq, N)
    e = np.dtype(dtype).itemsize
    X, L = batch * n_head * Tb * head_size * e, batch * n_head * Tb * e
    q, k, v, dout = self_check_inputs(batch, n_head, Tb, head_size, dtype, seed=0)
    part, fwd = _traced_peak(lambda: block_attention(q, k, v, "full"))
    D = (dout * part[0]).sum(-1)
    _, bwd = _traced_peak(lambda: block_attention_backward(dout, q, k, v, part[1], D, "full"))
    kept = X + L  # out, lse
    phases = {
        "forward step": kept + 2 * X + fwd,
        "forward exchange": kept + 4 * X,
        "backward step": kept + L + X + 4 * X + bwd,
        "backward exchange": kept + L + X + 8 * X,
    }
    worst = max(phases, key=phases.get)
    full = self_check_inputs(batch, n_head, seq, head_size, dtype, seed=1)

    def one_rank():
        out, cache = sdpa_forward(*full[:3], causal=True)
        return sdpa_backward(full[3], cache)

    _, whole = _traced_peak(one_rank)
    return {
        "N": N,
        "block": Tb,
        "itemsize": e,
        "X": X,
        "L": L,
        "step_forward": fwd,
        "step_backward": bwd,
        "phases": phases,
        "peak_phase": worst,
        "peak": phases[worst],
        "one_rank": whole,
        "scores_block": batch * n_head * Tb * Tb * e,
    }


def measure_memory(comm, batch=2, n_head=2, seq=32, head_size=8, dtype="float64", seed=0) -> dict:
    """This rank's forward and backward of ring attention on its own random blocks, under tracemalloc: the bytes it
    allocates at its peak, beside memory_model's prediction. Every rank returns every rank's measurement."""
    N, r = comm.world_size, comm.rank
    Tb = _check_split("measure_memory", seq, N)
    q, k, v, dout = self_check_inputs(batch, n_head, Tb, head_size, dtype, seed=seed + r)  # this rank's own

    def both():
        out, lse = ring_attention_forward(comm, q, k, v)
        return ring_attention_backward(comm, dout, q, k, v, out, lse)

    comm.barrier()
    _, mine = _traced_peak(both)
    peaks = np.zeros(N)
    peaks[r] = mine
    comm.all_reduce(peaks, op="sum")
    model = memory_model(batch, n_head, seq, head_size, N, dtype)
    ratio = [float(p / model["peak"]) for p in peaks]
    return {
        "measured": [int(p) for p in peaks],
        "model": model,
        "ratio": ratio,
        "tolerance": MEMORY_TOLERANCE,
        "ok": all(abs(x - 1) <= MEMORY_TOLERANCE for x in ratio),
    }


# ================================================================================================================
# 5. The self-check on real ranks: python -m gpullm_lessons.parallel ring-attention
# ================================================================================================================


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m gpullm_lessons.parallel ring-attention",
        description="ring attention on these ranks against one rank's sdpa_forward / sdpa_backward (every rank "
        "draws the whole q, k, v with one seed and keeps its block); exit status 1 when an error is over tolerance",
    )
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--n-head", type=int, default=2)
    p.add_argument("--seq", type=int, default=32, help="T, the whole sequence (divisible by the number of ranks)")
    p.add_argument("--head-size", type=int, default=8)
    p.add_argument("--dtype", choices=("float64", "float32", "both"), default="both")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--plant",
        choices=("none", "see-future", "keep-blocks"),
        default="none",
        help="a planted bug: j > r attended (see-future), or every k, v block kept as it passes (keep-blocks)",
    )
    p.add_argument("--json", default=None, help="write the errors (rank 0)")
    p.add_argument("--save", default=None, help="a folder: each rank writes rank<r>_<dtype>.npz (out, lse, dq, dk, dv)")
    p.add_argument(
        "--memory",
        action="store_true",
        help="also measure each rank's allocations against memory_model (--dtype's first, float64 for both)",
    )
    return p


def _rel_err(a, ref):
    return float(np.abs(a - ref).max() / max(np.abs(ref).max(), np.finfo(np.float64).tiny))


def self_check_inputs(batch=2, n_head=2, seq=32, head_size=8, dtype="float64", seed=0):
    """The whole sequence's q, k, v and dout (B, nh, T, hs) the self-check draws on every rank (one seed)."""
    rng = np.random.default_rng(seed)
    shape = (batch, n_head, seq, head_size)
    return tuple(rng.standard_normal(shape).astype(dtype) for _ in range(4))


def check_on_ranks(
    comm, batch=2, n_head=2, seq=32, head_size=8, dtype="float64", seed=0, kind=step_kind, save=None
) -> dict:
    """Forward and backward on comm's ranks against the one-rank computation; every rank returns every rank's
    errors (max|err| / max|reference| of out, lse, dq, dk, dv; lse: max|err| / max(1, max|lse|)). save: a folder
    where this rank writes rank<r>_<dtype>.npz of its results."""
    N, r = comm.world_size, comm.rank
    Tb = _check_split("ring-attention", seq, N)
    q, k, v, dout = self_check_inputs(batch, n_head, seq, head_size, dtype, seed)
    ref_out, cache = sdpa_forward(q, k, v, causal=True)
    ref = dict(zip(("dq", "dk", "dv"), sdpa_backward(dout, cache)), out=ref_out, lse=cache["lse"])
    rows = slice(r * Tb, (r + 1) * Tb)
    mine = [np.ascontiguousarray(x[:, :, rows]) for x in (q, k, v, dout)]
    out, lse = ring_attention_forward(comm, *mine[:3], kind=kind)
    dq, dk, dv = ring_attention_backward(comm, mine[3], *mine[:3], out, lse, kind=kind)
    got = {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}
    if save:
        import os

        os.makedirs(save, exist_ok=True)
        np.savez(os.path.join(save, f"rank{r}_{dtype}.npz"), **got)
    names = list(got)
    errs = np.zeros((N, len(names)))
    for i, n in enumerate(names):
        ref_rows = ref[n][:, :, rows]
        errs[r, i] = (
            float(np.abs(got[n] - ref_rows).max() / max(1.0, np.abs(ref_rows).max()))
            if n == "lse"
            else _rel_err(got[n], ref_rows)
        )
    errs[~np.isfinite(errs)] = np.inf  # a NaN is an error too
    comm.all_reduce(errs, op="sum")  # every rank's row, on every rank
    return {
        "dtype": dtype,
        "tolerance": TOLERANCES[dtype],
        "errors": {n: errs[:, i].tolist() for i, n in enumerate(names)},
        "ok": bool(np.all(errs <= TOLERANCES[dtype])),
    }


def main(argv=None, comm=None) -> dict:
    """Run the self-check (cli's body); returns rank 0's result dict. ValueError for a configuration problem."""
    import json

    from .comm import from_env

    args = build_parser().parse_args(argv)
    own = comm is None
    comm = from_env() if own else comm
    step = globals()["block_attention"]
    try:
        if args.plant == "keep-blocks":  # what gathering the whole k, v would cost: every block stays alive
            kept = []

            def keeping(q, k, v, kind):
                kept.append((k, v))
                return step(q, k, v, kind)

            globals()["block_attention"] = keeping
        kind = step_kind
        if args.plant == "see-future":

            def kind(r, j, causal=True):
                return "full" if j != r else "causal"

        dtypes = ("float64", "float32") if args.dtype == "both" else (args.dtype,)
        checks = [
            check_on_ranks(comm, args.batch, args.n_head, args.seq, args.head_size, dt, args.seed, kind, args.save)
            for dt in dtypes
        ]
        res = {"world": comm.world_size, "comm": comm.name, "T": args.seq, "checks": checks}
        res["ok"] = all(c["ok"] for c in checks)
        if args.memory:
            res["memory"] = measure_memory(
                comm, args.batch, args.n_head, args.seq, args.head_size, dtypes[0], args.seed
            )
            res["ok"] = res["ok"] and res["memory"]["ok"]
        if comm.rank == 0:
            for c in checks:
                worst = ", ".join(f"{n} {max(e):.1e}" for n, e in c["errors"].items())
                print(
                    f"ring attention on {comm.world_size} rank(s) ({comm.name}), T={args.seq} in blocks of "
                    f"{args.seq // comm.world_size}, {c['dtype']}: max error vs one rank {worst} "
                    f"(tolerance {c['tolerance']:.0e}): {'ok' if c['ok'] else 'WRONG'}"
                )
            if args.memory:
                mem, model = res["memory"], res["memory"]["model"]
                print(
                    f"memory per rank, {dtypes[0]}: measured {', '.join(f'{b:,}' for b in mem['measured'])} B; model "
                    f"{model['peak']:,} B ({model['peak_phase']}; one block's scores {model['scores_block']:,} B); "
                    f"one rank over all T: {model['one_rank']:,} B: {'ok' if mem['ok'] else 'OVER'} (within "
                    f"{mem['tolerance']:.0%})"
                )
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(res, f, indent=1)
        return res
    finally:
        globals()["block_attention"] = step
        if own:
            comm.close()


def cli(argv=None) -> int:
    """Command-line entry: 0 when every error is within tolerance, 1 when not, 2 (one "error: ..." line) for a
    configuration problem such as T not divisible by the number of ranks."""
    try:
        res = main(argv)
    except ValueError as e:
        sys.stderr.write(f"error: {e}\n")
        sys.stderr.flush()
        return 2
    return 0 if res["ok"] else 1
