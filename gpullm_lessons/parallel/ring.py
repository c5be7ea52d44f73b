"""The ring all-reduce by hand: N simulated ranks in NumPy (with the step log lesson 10 draws), the same algorithm
across real ranks over the communicator's send/recv, a check of any all-reduce against the locally computed sum,
and the self-test of a communicator's collectives (`python -m gpullm_lessons.parallel selftest`)."""

from __future__ import annotations

import numpy as np

from .comm import Communicator, is_cupy


# ================================================================================================================
# 1. The ring, simulated: N ranks as N NumPy buffers in one process
# ================================================================================================================


def chunk_bounds(n: int, world: int) -> list:
    """The ring's N chunks of n elements: [(lo, hi), ...], sizes differ by at most 1 (the first n mod N are longer)."""
    if world < 1:
        raise ValueError(f"chunk_bounds: world must be >= 1, got {world}")
    base, extra = divmod(int(n), int(world))
    out, lo = [], 0
    for c in range(world):
        hi = lo + base + (1 if c < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


def ring_allreduce_chunks(chunks):
    """The ring all-reduce (sum) of N ranks, simulated: chunks[r][c] is rank r's chunk c (N ranks x N chunks).

    Returns (chunks, log): chunks summed in place (every rank ends with every chunk's sum) and the step log, one
    list per step of the (src, dst, chunk) messages sent in it: 2(N-1) steps, N messages each. Within a step every
    rank sends before any receives (the messages are copied first), as real ranks do."""
    N = len(chunks)
    log = []
    for s in range(N - 1):  # reduce-scatter
        sends = [(r, (r + 1) % N, (r - s) % N) for r in range(N)]
        data = [np.array(chunks[src][c], copy=True) for src, _, c in sends]
        for (src, dst, c), d in zip(sends, data):
            chunks[dst][c] += d  # add what arrives into my copy of that chunk
        log.append(sends)
    for s in range(N - 1):  # all-gather
        sends = [(r, (r + 1) % N, (r + 1 - s) % N) for r in range(N)]
        data = [np.array(chunks[src][c], copy=True) for src, _, c in sends]
        for (src, dst, c), d in zip(sends, data):
            chunks[dst][c][...] = d  # a finished sum: overwrite
        log.append(sends)
    return chunks, log


def ring_allreduce_sim(buffers):
    """N ranks' buffers (N 1-D arrays of one length n, any n) -> (results, log): results[r] is rank r's buffer after
    the ring all-reduce (the elementwise sum), log the (src, dst, chunk) messages of each of the 2(N-1) steps.
    The buffers are cut into N chunks with chunk_bounds (uneven when N does not divide n)."""
    N = len(buffers)
    if N < 1:
        raise ValueError("ring_allreduce_sim: give at least one buffer")
    bufs = [
        np.array(b, dtype=np.float64 if np.asarray(b).dtype.kind != "f" else np.asarray(b).dtype, copy=True).reshape(-1)
        for b in buffers
    ]
    n = bufs[0].size
    if any(b.size != n for b in bufs):
        raise ValueError(
            f"ring_allreduce_sim: every rank's buffer must have the same size, got {[b.size for b in bufs]}"
        )
    bounds = chunk_bounds(n, N)
    chunks = [[b[lo:hi] for lo, hi in bounds] for b in bufs]  # views: the chunks write through to the buffers
    _, log = ring_allreduce_chunks(chunks)
    return bufs, log


def ring_contributions(N: int, log):
    """Replay a step log symbolically: after each step, which ranks' data each (rank, chunk) holds.

    Returns a list of 1 + len(log) states; state[r][c] is a frozenset of the ranks summed into rank r's chunk c."""
    state = [[frozenset([r]) for _ in range(N)] for r in range(N)]
    states = [state]
    for k, sends in enumerate(log):
        new = [row[:] for row in state]
        for src, dst, c in sends:
            new[dst][c] = state[dst][c] | state[src][c] if k < N - 1 else state[src][c]
        state = new
        states.append(state)
    return states


# ================================================================================================================
# 2. The ring across real ranks, over the communicator's send/recv
# ================================================================================================================


def ring_allreduce(comm: Communicator, buf, work=None, _skip_allgather=False):
    """Sum `buf` (a contiguous 1-D buffer, NumPy for MPI / CuPy for NCCL) over all ranks, in place, by the ring.

    Each step is one comm.sendrecv (send to the right neighbour, receive from the left one at the same time: no
    rank waits for another's send to finish, so no deadlock). work: a scratch buffer of at least ceil(n/N) elements
    of buf's dtype (allocated when None). _skip_allgather: the classic mistake, kept for the tests and the lesson."""
    N, r = comm.world_size, comm.rank
    flat = buf.reshape(-1)
    if N == 1:
        return buf
    bounds = chunk_bounds(flat.size, N)
    width = max(hi - lo for lo, hi in bounds)
    if work is None:
        xp = xp_of(flat)
        work = xp.empty(width, flat.dtype)
    right, left = (r + 1) % N, (r - 1) % N
    for s in range(N - 1):  # reduce-scatter
        (slo, shi), (rlo, rhi) = bounds[(r - s) % N], bounds[(r - s - 1) % N]
        tmp = work[: rhi - rlo]
        comm.sendrecv(flat[slo:shi], right, tmp, left)
        flat[rlo:rhi] += tmp
    if _skip_allgather:
        return buf
    for s in range(N - 1):  # all-gather
        (slo, shi), (rlo, rhi) = bounds[(r + 1 - s) % N], bounds[(r - s) % N]
        comm.sendrecv(flat[slo:shi], right, flat[rlo:rhi], left)
    return buf


def xp_of(a):
    if is_cupy(a):
        import cupy

        return cupy
    return np


def check_allreduce(comm: Communicator, fn, sizes=(1, 7, 1000, 4099), seed=0, rtol=1e-5) -> tuple:
    """Does fn(comm, buf) sum buf over the ranks in place? Compared with comm.all_reduce on random float32 buffers of
    awkward sizes (not multiples of N), on every rank. Returns (ok, message); the verdict is the same on every rank."""
    N, r = comm.world_size, comm.rank
    ok, msg = True, f"ring all-reduce matches comm.all_reduce on {N} ranks, sizes {list(sizes)}"
    for n in sizes:
        rng = np.random.default_rng([seed, n, r])  # different data on every rank
        host = rng.standard_normal(n).astype(np.float32)
        xp = np if comm.name in ("mpi", "single") else comm.array_module()
        mine, ref = xp.asarray(host.copy()), xp.asarray(host.copy())
        try:
            fn(comm, mine)
            err = None
        except Exception as exc:  # reported, the other ranks are told too
            err = f"{type(exc).__name__}: {exc}"
        comm.all_reduce(ref)
        a = np.asarray(mine.get() if is_cupy(mine) else mine, dtype=np.float64)
        b = np.asarray(ref.get() if is_cupy(ref) else ref, dtype=np.float64)
        bad = np.abs(a - b) > rtol * (np.abs(b) + np.abs(b).max())
        first = int(np.flatnonzero(bad)[0]) if bad.any() else -1
        flags = comm.gather_scalars([1.0 if err else 0.0, float(bad.sum()), float(first), a.sum()])
        if flags[:, 0].any() or flags[:, 1].any():
            ok = False
            worst = int(np.argmax(flags[:, 1] + 1e9 * flags[:, 0]))
            if flags[worst, 0]:
                msg = f"size {n}: the function raised on rank {worst}" + (f" ({err})" if err and worst == r else "")
            else:
                msg = (
                    f"size {n}: {int(flags[worst, 1])} of {n} elements differ from comm.all_reduce on rank "
                    f"{worst} (first at index {int(flags[worst, 2])}); ranks with errors: "
                    f"{[int(i) for i in np.flatnonzero(flags[:, 1])]}"
                )
            break
        if len(set(flags[:, 3].tolist())) != 1:
            ok, msg = False, f"size {n}: the ranks ended with different buffers (sums {flags[:, 3].tolist()})"
            break
    return ok, msg


def selftest(comm: Communicator) -> bool:
    """Every collective of `comm` against the answer computed locally, the ring against comm.all_reduce, and a wrong
    ring (no all-gather phase) caught. Prints one line per check on rank 0; True when all pass on every rank."""
    N, r = comm.world_size, comm.rank
    gpu = comm.name == "nccl"
    xp = comm.array_module() if gpu else np
    host = lambda a: np.asarray(a.get() if is_cupy(a) else a)  # noqa: E731
    results = []

    def check(name, got, want):
        ok = bool(np.allclose(host(got), want, rtol=1e-6, atol=0))
        flags = comm.all_reduce_scalars([0.0 if ok else 1.0])
        results.append((name, flags[0] == 0))

    for m in (1, 7, 1000):
        base = np.arange(N * m, dtype=np.float32)
        buf = xp.asarray(base + r)
        comm.all_reduce(buf)
        check(f"all_reduce sum ({N * m} elements)", buf, N * base + N * (N - 1) / 2)
        a, b = xp.asarray(base + r), xp.asarray(2 * base + r)
        for req in [comm.all_reduce_async(a), comm.all_reduce_async(b)]:  # two in flight at once, then waited for
            req.wait()
        want = np.concatenate([N * base + N * (N - 1) / 2, 2 * N * base + N * (N - 1) / 2])
        check(f"all_reduce_async, two in flight ({N * m} elements each)", np.concatenate([host(a), host(b)]), want)
        buf = xp.asarray(base + r)
        comm.all_reduce(buf, op="max")
        check(f"all_reduce max ({N * m})", buf, base + N - 1)
        recv = xp.zeros(m, xp.float32)
        comm.reduce_scatter(xp.asarray(base * (r + 1)), recv)
        check(f"reduce_scatter ({N * m} -> {m})", recv, base[r * m : (r + 1) * m] * N * (N + 1) / 2)
        recv = xp.zeros(N * m, xp.float32)
        comm.all_gather(xp.asarray(np.full(m, r, np.float32)), recv)
        check(f"all_gather ({m} -> {N * m})", recv, np.repeat(np.arange(N, dtype=np.float32), m))
        buf = xp.asarray(np.full(m, float(r), np.float32))
        comm.broadcast(buf, root=N - 1)
        check(f"broadcast from rank {N - 1} ({m})", buf, np.full(m, N - 1.0))
        out = xp.zeros(m, xp.float32)
        comm.sendrecv(xp.asarray(np.full(m, float(r), np.float32)), (r + 1) % N, out, (r - 1) % N)
        check(f"sendrecv around the ring ({m})", out, np.full(m, float((r - 1) % N)))
    ok_ring, msg = check_allreduce(comm, ring_allreduce, sizes=(1, 5, 1001, 4099 * N + 3))
    results.append((f"ring_allreduce by hand == all_reduce ({msg})", ok_ring))
    if N > 1:
        wrong = lambda c, b: ring_allreduce(c, b, _skip_allgather=True)  # noqa: E731
        ok_wrong, msg = check_allreduce(comm, wrong, sizes=(1001,))
        results.append((f"a ring without its all-gather phase is caught ({msg})", not ok_wrong))
    comm.barrier()
    if r == 0:
        import textwrap

        for name, ok in results:  # lines of at most 100 characters (a notebook shows this output)
            print(
                textwrap.fill(
                    f"[{'OK' if ok else 'FAIL'}] {name}",
                    100,
                    subsequent_indent="     ",
                    break_long_words=False,
                    break_on_hyphens=False,
                )
            )
        print(f"selftest: {sum(ok for _, ok in results)}/{len(results)} passed on {N} ranks ({comm.name})")
    return all(ok for _, ok in results)
