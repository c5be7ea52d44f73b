"""Several ranks, one model: ring all-reduce by hand, data parallel training and ZeRO-1, on a communicator (comm.py).

    ring_allreduce_sim(buffers)          the ring all-reduce of N simulated ranks in NumPy, with its step log
    ring_allreduce(comm, buf)            the same algorithm across real ranks, over comm.sendrecv
    DataParallel(engine, comm, zero=)    one training step on every rank: local slice -> gradients -> all-reduce
                                         (or ZeRO-1: reduce-scatter, AdamW on the local shard, all-gather)
    bench_allreduce(comm, sizes)         algorithm and bus bandwidth (nccl-tests' definitions), engine vs ring

The training job on N ranks is train.py's own loop (gpullm_lessons.train.train: one loop for 1..N ranks), which
wraps its engine in DataParallel; `python -m gpullm_lessons.parallel train ...` runs it.

CLI (each rank runs it; start the ranks with the launcher or mpirun):
    python -m gpullm_lessons.launch --nproc 2 --module gpullm_lessons.parallel -- selftest
    python -m gpullm_lessons.launch --nproc 2 --module gpullm_lessons.parallel -- bench --json runs/allreduce.json
    python -m gpullm_lessons.launch --nproc 2 --module gpullm_lessons.parallel -- train --steps 50 [--zero]
    python -m gpullm_lessons.launch --nproc 2 --module gpullm_lessons.parallel -- dpbench --preset gpt2

The ring (N ranks, the buffer cut into N chunks; rank r sends to r+1 and receives from r-1, all at once):
    reduce-scatter, steps s = 0 .. N-2: rank r sends chunk (r - s) mod N and adds the chunk (r - s - 1) mod N it
        receives into its own; after N-1 steps rank r holds the full sum of chunk (r + 1) mod N.
    all-gather, steps s = 0 .. N-2: rank r sends chunk (r + 1 - s) mod N and overwrites chunk (r - s) mod N with the
        one it receives; after N-1 more steps every rank holds every summed chunk.
2(N-1) steps, each moving n/N elements per rank: 2(N-1)/N x n elements sent per rank, whatever N is: that is why
nccl-tests reports the bus bandwidth busbw = algbw x 2(N-1)/N, with algbw = bytes / time.

Data parallel: every rank holds the whole model and takes rows [r B/N, (r+1) B/N) of the global batch (drawn with the
same seed on every rank, so the global batch is the one-rank run's). The loss is a mean over tokens, so the global
gradient is the mean of the N equal-sized local gradients: one all-reduce (sum) of the flat gradient buffer, then
x 1/N. Every rank then runs the same optimizer step on the same numbers, so the parameters stay identical; a checksum
every check_every steps proves it (a mismatch raises, naming the ranks).

ZeRO-1 (optimizer state sharded): the flat buffer of n elements is split into N contiguous shards of S = ceil(n/N)
elements, rounded up to a multiple of `align` (64: 256-byte aligned shards for NCCL and the float4 AdamW kernel);
params and grads are padded with zeros to N*S (the padding has gradient 0 and stays 0). Per step: reduce-scatter the
gradients (rank r gets the summed shard r), x 1/N, the global norm from one all-reduce of the shards' squared norms,
AdamW on the shard only (m and v exist only for the shard: 1/N of the optimizer memory), all-gather the parameters.
On GPUs the half copy of the weights (bf16/fp16) is re-converted from the gathered fp32 params (one pass).
"""
from __future__ import annotations

import json
import math
import os
import sys
import time

import numpy as np

from .comm import Communicator, from_env, is_cupy
from .optim import shard_decay_table  # noqa: F401 - part of the ZeRO bookkeeping taught here (exercise 10.3)

__all__ = ["chunk_bounds", "ring_allreduce_chunks", "ring_allreduce_sim", "ring_allreduce", "check_allreduce",
           "shard_size", "shard_bounds", "shard_decay_table", "DataParallel", "ReplicaMismatch", "bench_allreduce",
           "format_bench", "zero_memory_table"]


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
    for s in range(N - 1):                                     # reduce-scatter
        sends = [(r, (r + 1) % N, (r - s) % N) for r in range(N)]
        data = [np.array(chunks[src][c], copy=True) for src, _, c in sends]
        for (src, dst, c), d in zip(sends, data):
            chunks[dst][c] += d                                # add what arrives into my copy of that chunk
        log.append(sends)
    for s in range(N - 1):                                     # all-gather
        sends = [(r, (r + 1) % N, (r + 1 - s) % N) for r in range(N)]
        data = [np.array(chunks[src][c], copy=True) for src, _, c in sends]
        for (src, dst, c), d in zip(sends, data):
            chunks[dst][c][...] = d                            # a finished sum: overwrite
        log.append(sends)
    return chunks, log


def ring_allreduce_sim(buffers):
    """N ranks' buffers (N 1-D arrays of one length n, any n) -> (results, log): results[r] is rank r's buffer after
    the ring all-reduce (the elementwise sum), log the (src, dst, chunk) messages of each of the 2(N-1) steps.
    The buffers are cut into N chunks with chunk_bounds (uneven when N does not divide n)."""
    N = len(buffers)
    if N < 1:
        raise ValueError("ring_allreduce_sim: give at least one buffer")
    bufs = [np.array(b, dtype=np.float64 if np.asarray(b).dtype.kind != "f" else np.asarray(b).dtype, copy=True)
            .reshape(-1) for b in buffers]
    n = bufs[0].size
    if any(b.size != n for b in bufs):
        raise ValueError(f"ring_allreduce_sim: every rank's buffer must have the same size, got "
                         f"{[b.size for b in bufs]}")
    bounds = chunk_bounds(n, N)
    chunks = [[b[lo:hi] for lo, hi in bounds] for b in bufs]   # views: the chunks write through to the buffers
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
        xp = _xp_of(flat)
        work = xp.empty(width, flat.dtype)
    right, left = (r + 1) % N, (r - 1) % N
    for s in range(N - 1):                                     # reduce-scatter
        (slo, shi), (rlo, rhi) = bounds[(r - s) % N], bounds[(r - s - 1) % N]
        tmp = work[:rhi - rlo]
        comm.sendrecv(flat[slo:shi], right, tmp, left)
        flat[rlo:rhi] += tmp
    if _skip_allgather:
        return buf
    for s in range(N - 1):                                     # all-gather
        (slo, shi), (rlo, rhi) = bounds[(r + 1 - s) % N], bounds[(r - s) % N]
        comm.sendrecv(flat[slo:shi], right, flat[rlo:rhi], left)
    return buf


def _xp_of(a):
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
        rng = np.random.default_rng([seed, n, r])                # different data on every rank
        host = rng.standard_normal(n).astype(np.float32)
        xp = np if comm.name in ("mpi", "single") else _xp_of(comm._host_like([0.0]))
        mine, ref = xp.asarray(host.copy()), xp.asarray(host.copy())
        try:
            fn(comm, mine)
            err = None
        except Exception as exc:                                 # reported, the other ranks are told too
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
                msg = (f"size {n}: {int(flags[worst, 1])} of {n} elements differ from comm.all_reduce on rank "
                       f"{worst} (first at index {int(flags[worst, 2])}); ranks with errors: "
                       f"{[int(i) for i in np.flatnonzero(flags[:, 1])]}")
            break
        if len(set(flags[:, 3].tolist())) != 1:
            ok, msg = False, f"size {n}: the ranks ended with different buffers (sums {flags[:, 3].tolist()})"
            break
    return ok, msg


# ================================================================================================================
# 3. ZeRO-1 bookkeeping: shards of the flat buffer
# ================================================================================================================

def shard_size(n: int, world: int, align: int = 1) -> int:
    """Elements per shard: ceil(n / world), rounded up to a multiple of align. The flat buffer is padded to world * S."""
    if world < 1 or align < 1:
        raise ValueError(f"shard_size: world and align must be >= 1, got {world}, {align}")
    S = -(-int(n) // int(world))
    return -(-S // align) * align


def shard_bounds(n: int, world: int, rank: int, align: int = 1) -> tuple:
    """The parameters rank owns: (lo, hi) with lo = rank*S, hi = min((rank+1)*S, n), S = shard_size(n, world, align).

    Shards are contiguous, do not overlap and cover 0..n; all have S elements except the last ones, which stop at n
    (the padding n..world*S belongs to no parameter)."""
    if not 0 <= rank < world:
        raise ValueError(f"shard_bounds: rank must be in 0..{world - 1}, got {rank}")
    S = shard_size(n, world, align)
    return min(rank * S, n), min((rank + 1) * S, n)


def zero_memory_table(n_params: int, worlds=(1, 2, 4, 8), precision="fp32") -> list:
    """Per-rank bytes of the model state, plain data parallel vs ZeRO-1 (optimizer state sharded), per world size.

    fp32 params and grads (4 B each), AdamW m and v (8 B per parameter), + the half copy (2 B) in bf16/fp16."""
    half = 0 if precision == "fp32" else 2
    rows = []
    for W in worlds:
        S = shard_size(n_params, W)
        dp = {"params": 4 * n_params + half * n_params, "grads": 4 * n_params, "optimizer": 8 * n_params}
        z1 = {"params": dp["params"], "grads": dp["grads"], "optimizer": 8 * S}
        rows.append({"world": W, "dp_total": sum(dp.values()), "zero1_total": sum(z1.values()), **{
            f"dp_{k}": v for k, v in dp.items()}, **{f"zero1_{k}": v for k, v in z1.items()}})
    return rows


# ================================================================================================================
# 4. Data parallel training (and ZeRO-1) around an engine
# ================================================================================================================

class ReplicaMismatch(RuntimeError):
    """The ranks' parameters differ: data parallel training lost its one invariant."""


class DataParallel:
    """One data-parallel training step of `engine` (engine.build) on every rank of `comm`.

        dp = DataParallel(eng, comm, zero=False, check_every=10)
        out = dp.train_step(x_local, y_local, lr, weight_decay, grad_clip)   # {"loss" (global mean), "grad_norm", ...}

    x_local, y_local: this rank's rows of the global batch (B/N, T). See the module docstring for what happens.
    At construction the parameters are broadcast from rank 0 (every rank starts from the same weights even if their
    seeds differed). zero=True: ZeRO-1; the engine's own full-size m and v are released (the shard's live here).
    bucket_mb > 0 (plain data parallel): the gradient all-reduce in buckets of that many MiB, one after the other.
    """

    def __init__(self, engine, comm: Communicator, zero=False, check_every=0, align=64, bucket_mb=0.0):
        from .params import num_params

        self.eng, self.comm, self.zero = engine, comm, bool(zero)
        self.check_every, self.bucket_mb = int(check_every), float(bucket_mb)
        self.W, self.rank = comm.world_size, comm.rank
        self.xp = getattr(engine, "xp", np)
        self.n = num_params(engine.cfg)
        self.steps = 0
        self.comm_seconds = 0.0
        if comm.name == "nccl" and self.xp is np:
            raise ValueError("DataParallel: an NCCL communicator needs a GPU engine (backend hip or numba on a GPU); "
                             "the NumPy engine runs on MPI ranks")
        comm.broadcast(engine.params.flat, root=0)
        engine.params_changed()
        if self.zero:
            self._setup_zero(align)

    # ---- ZeRO-1 setup --------------------------------------------------------------------------------------------
    def _setup_zero(self, align):
        xp, eng, W, r = self.xp, self.eng, self.W, self.rank
        self.S = S = shard_size(self.n, W, align)
        self.lo, self.hi = r * S, (r + 1) * S                    # this rank's slice of the padded buffer
        self.gpad = eng.grads.pad_to(W * S)
        self.ppad = eng.params.pad_to(W * S)
        self.g_shard = xp.zeros(S, xp.float32)                   # the reduce-scatter's output: the summed shard
        # AdamW over the shard: params a view of the padded params (the update lands there), m and v of S elements
        # (from the engine's, so a loaded checkpoint carries over); then the full-size state goes
        self.shard = eng.optimizer_shard(self.lo, self.hi, self.ppad[self.lo:self.hi], self.g_shard)
        eng.release_optimizer_state()

    # ---- memory ----------------------------------------------------------------------------------------------------
    def optimizer_bytes(self) -> int:
        """Bytes of AdamW state (m + v) this rank holds."""
        if self.zero:
            return int(self.shard.m.nbytes + self.shard.v.nbytes)
        return int(self.eng.m.nbytes + self.eng.v.nbytes)

    def memory(self) -> dict:
        """This rank's model-state bytes: params, grads (padded under ZeRO), optimizer; and the unsharded optimizer."""
        p = self.ppad.nbytes if self.zero else self.eng.params.flat.nbytes
        g = self.gpad.nbytes if self.zero else self.eng.grads.flat.nbytes
        return {"params": int(p), "grads": int(g), "optimizer": self.optimizer_bytes(), "optimizer_full": 8 * self.n,
                "ratio": self.optimizer_bytes() / (8 * self.n)}

    # ---- state: what a checkpoint holds, the same on 1 and N ranks -------------------------------------------------
    def state_dict(self) -> dict:
        """The engine's state_dict with the whole model's m and v (ZeRO: gathered from the ranks' shards). Every rank
        must call it (it is a collective under ZeRO); every rank gets the same dict."""
        state = self.eng.state_dict()
        if self.zero:
            for key in ("m", "v"):
                full = self.xp.zeros(self.W * self.S, self.xp.float32)
                self.comm.all_gather(getattr(self.shard, key), full)
                state[key] = np.array(full[:self.n].get() if is_cupy(full) else full[:self.n], np.float32)
        return state

    # ---- one step ----------------------------------------------------------------------------------------------
    def _sync(self):
        if self.xp is not np:
            self.xp.cuda.get_current_stream().synchronize()

    def _timed(self, fn, *args):
        self._sync()                                             # the kernels before it done: time only the comm
        t0 = time.perf_counter()
        fn(*args)
        self._sync()
        self.comm_seconds += time.perf_counter() - t0

    def _all_reduce(self, g):
        if self.bucket_mb > 0:
            step = max(1, int(self.bucket_mb * 2**20 // 4))
            for lo in range(0, g.size, step):
                self.comm.all_reduce(g[lo:lo + step])
        else:
            self.comm.all_reduce(g)

    def mean_gradient(self, g):
        """This rank's gradient -> the mean of every rank's, in place: the all-reduce (sum, timed), then x 1/N."""
        if self.W == 1:
            return
        self._timed(self._all_reduce, g)
        g *= np.float32(1.0 / self.W)

    def train_step(self, x, y, lr, weight_decay=0.0, grad_clip=0.0) -> dict:
        """Forward and backward on this rank's rows, gradients combined over ranks, the same update everywhere.

        Plain data parallel is the engine's own train_step with the gradient all-reduce between backward and the
        update (mean_gradient; on a GPU engine with graphs, between the two replayed graphs); ZeRO-1 runs the
        engine's update on this rank's shard (_zero_step)."""
        eng = self.eng
        if not self.zero:
            if self.W == 1:                                      # nothing to combine: the engine's own step
                return eng.train_step(x, y, lr, weight_decay, grad_clip)
            out = dict(eng.train_step(x, y, lr, weight_decay, grad_clip, reduce_grads=self.mean_gradient))
            out["loss"] = float(self.comm.all_reduce_scalars([out["loss"]])[0]) / self.W
        else:
            scale = eng.scaler.scale if eng.scaler is not None else 1.0
            _, loss = eng.forward(x, y)
            eng.backward(loss_scale=scale)
            out = self._zero_step(loss, lr, weight_decay, grad_clip)
        self.steps += 1
        if self.W > 1 and self.check_every > 0 and self.steps % self.check_every == 0:
            self.check_replicas()
        return out

    def _zero_step(self, loss, lr, weight_decay, grad_clip):
        eng, comm, g = self.eng, self.comm, self.g_shard
        self._timed(comm.reduce_scatter, self.gpad, g)           # rank r: the sum of every rank's shard r
        if self.W > 1:
            g *= np.float32(1.0 / self.W)
        bad = eng.count_nonfinite(g) if eng.scaler is not None else 0
        red = comm.all_reduce_scalars([loss, eng.grad_sumsq(g), bad])   # one small all-reduce for all three
        # the same global norm and non-finite count on every rank: the same clip factor and skip decision
        out = {"loss": float(red[0]) / self.W,
               **eng.update(lr, weight_decay, grad_clip, sumsq=float(red[1]), nonfinite=int(red[2]), shard=self.shard)}
        if not out["skipped"]:
            self._timed(comm.all_gather, self.shard.params, self.ppad)   # every rank gets every updated shard
            eng.params_changed()                                 # the half copy, re-converted from the fp32 params
        return out

    # ---- evaluation and checks -------------------------------------------------------------------------------
    def eval_loss(self, x, y) -> float:
        """The loss of this rank's rows, averaged over ranks (equal row counts: the global batch's mean loss)."""
        return float(self.comm.all_reduce_scalars([self.eng.eval_loss(x, y)])[0]) / self.W

    def checksum(self) -> tuple:
        """(sum, sum of squares) of the parameters: equal on every rank when the replicas agree (the same bits in,
        the same reduction on the same kind of device: the same result)."""
        p = self.eng.params.flat
        if self.xp is np:
            return float(np.sum(p, dtype=np.float64)), float(np.dot(p.astype(np.float64), p.astype(np.float64)))
        return float(self.xp.sum(p, dtype=self.xp.float64)), float(self.xp.dot(p, p))   # no float64 copy on a GPU

    def check_replicas(self):
        """Compare every rank's parameter checksum with rank 0's; ReplicaMismatch naming the ranks that differ."""
        sums = self.comm.gather_scalars(self.checksum())
        bad = [r for r in range(self.W) if not np.array_equal(sums[r], sums[0])]
        if bad:
            raise ReplicaMismatch(f"after step {self.steps} the parameters differ between ranks: rank(s) {bad} "
                                  f"disagree with rank 0 (checksums {', '.join(f'rank {r}: {sums[r, 0]!r}' for r in range(self.W))})")
        return sums[0]


# ================================================================================================================
# 5. All-reduce bandwidth: nccl-tests' algbw and busbw
# ================================================================================================================

DEFAULT_SIZES = tuple(2 ** k for k in range(10, 31, 2))          # 1 KiB, 4 KiB, ..., 1 GiB


def bench_allreduce(comm: Communicator, sizes=DEFAULT_SIZES, iters=None, ring=True, warmup=2) -> list:
    """Time comm.all_reduce (the engine's: NCCL or MPI) and ring_allreduce on float32 buffers of each size (bytes).

    Per row: size_bytes, algo, time_us (mean per call over iters, the slowest rank's), algbw_GBps = bytes / time,
    busbw_GBps = algbw x 2(N-1)/N (nccl-tests' definitions: busbw is what each link carries, comparable across N).
    iters None: about 0.2 s of calls per size (at least 3)."""
    N = comm.world_size
    gpu = comm.name == "nccl"
    xp = _xp_of(comm._host_like([0.0])) if gpu else np
    rows = []
    for size in sizes:
        n = max(1, int(size) // 4)
        buf = xp.zeros(n, xp.float32)                           # zeros: sums stay finite however often we add
        work = xp.empty(-(-n // N), xp.float32)
        algos = [(comm.name, lambda: comm.all_reduce(buf))]
        if ring and N > 1:
            algos.append(("ring", lambda: ring_allreduce(comm, buf, work=work)))
        for algo, fn in algos:
            for _ in range(warmup):
                fn()
            comm.synchronize()
            probe = time.perf_counter()
            fn()
            comm.synchronize()
            once = comm.all_reduce_scalars([time.perf_counter() - probe], op="max")[0]
            k = iters if iters else int(min(200, max(3, 0.2 / max(once, 1e-6))))
            k = int(comm.all_reduce_scalars([k], op="max")[0])
            comm.barrier()
            t0 = time.perf_counter()
            for _ in range(k):
                fn()
            comm.synchronize()
            sec = comm.all_reduce_scalars([(time.perf_counter() - t0) / k], op="max")[0]
            algbw = n * 4 / sec / 1e9
            rows.append({"size_bytes": n * 4, "algo": algo, "iters": k, "time_us": sec * 1e6, "algbw_GBps": algbw,
                         "busbw_GBps": algbw * 2 * (N - 1) / N})
    return rows


def _size(b) -> str:
    for unit, k in (("GB", 2**30), ("MB", 2**20), ("KB", 2**10)):
        if b >= k:
            return f"{b / k:g} {unit}"
    return f"{b} B"


def format_bench(result) -> str:
    """The table of a bench result (dict with rows, world, comm, card, date)."""
    lines = [f"all-reduce, {result['world']} ranks, {result['comm']} ({result['card']}, {result['date']}); "
             f"busbw = algbw x 2(N-1)/N",
             f"{'size':>9} {'algo':<6}{'time us':>11}{'algbw GB/s':>12}{'busbw GB/s':>12}"]
    for r in result["rows"]:
        lines.append(f"{_size(r['size_bytes']):>9} {r['algo']:<6}{r['time_us']:11.1f}{r['algbw_GBps']:12.2f}"
                     f"{r['busbw_GBps']:12.2f}")
    ratio = ring_fraction(result)
    if ratio:
        size, frac = ratio
        lines.append(f"ring by hand at {_size(size)}: {100 * frac:.0f}% of {result['comm']}'s bus bandwidth")
    return "\n".join(lines)


def ring_fraction(result, size=256 * 2**20):
    """(size, ring busbw / engine busbw) at `size` bytes (or the largest size measured below it); None without ring."""
    rows = result["rows"]
    eng = {r["size_bytes"]: r["busbw_GBps"] for r in rows if r["algo"] != "ring"}
    ring = {r["size_bytes"]: r["busbw_GBps"] for r in rows if r["algo"] == "ring"}
    both = sorted(s for s in eng if s in ring and s <= size)
    if not both:
        return None
    s = both[-1]
    return s, ring[s] / eng[s]


def _where(comm) -> str:
    if comm.name == "nccl":
        import cupy as cp

        return cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"].decode()
    import platform

    return f"CPU ranks on {platform.node() or 'this machine'} ({os.cpu_count()} cores)"


def bench_result(comm, sizes=DEFAULT_SIZES, iters=None, ring=True) -> dict:
    import datetime

    rows = bench_allreduce(comm, sizes, iters=iters, ring=ring)
    return {"world": comm.world_size, "comm": comm.name, "card": _where(comm),
            "date": datetime.date.today().isoformat(), "rows": rows}


# ================================================================================================================
# 6. Self-test, data-parallel throughput, CLI
# ================================================================================================================

def selftest(comm: Communicator) -> bool:
    """Every collective of `comm` against the answer computed locally, the ring against comm.all_reduce, and a wrong
    ring (no all-gather phase) caught. Prints one line per check on rank 0; True when all pass on every rank."""
    N, r = comm.world_size, comm.rank
    gpu = comm.name == "nccl"
    xp = _xp_of(comm._host_like([0.0])) if gpu else np
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
        buf = xp.asarray(base + r)
        comm.all_reduce(buf, op="max")
        check(f"all_reduce max ({N * m})", buf, base + N - 1)
        recv = xp.zeros(m, xp.float32)
        comm.reduce_scatter(xp.asarray(base * (r + 1)), recv)
        check(f"reduce_scatter ({N * m} -> {m})", recv, base[r * m:(r + 1) * m] * N * (N + 1) / 2)
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
        for name, ok in results:   # lines of at most 100 characters (a notebook shows this output)
            print(textwrap.fill(f"[{'OK' if ok else 'FAIL'}] {name}", 100, subsequent_indent="     ",
                                break_long_words=False, break_on_hyphens=False))
        print(f"selftest: {sum(ok for _, ok in results)}/{len(results)} passed on {N} ranks ({comm.name})")
    return all(ok for _, ok in results)


def dp_bench(comm, preset="gpt2", precision="bf16", batch_per_rank=16, steps=10, warmup=3, zero=False,
             backend="auto") -> dict:
    """Tokens/s of data-parallel training steps on random tokens: B = batch_per_rank rows per rank, T = block size."""
    from . import engine as engine_mod
    from .params import GPTConfig
    from .params import PRESETS

    p = dict(PRESETS[preset])
    p.pop("batch_size")
    p.pop("lr")
    cfg = GPTConfig(**p)
    T = cfg.block_size
    eng = engine_mod.build(cfg, engine_mod.check_backend(backend), precision=precision)
    dp = DataParallel(eng, comm, zero=zero)
    rng = np.random.default_rng(comm.rank)
    batches = [(rng.integers(0, cfg.vocab_size, (batch_per_rank, T)).astype(np.int32),
                rng.integers(0, cfg.vocab_size, (batch_per_rank, T)).astype(np.int32)) for _ in range(steps + warmup)]
    times, comm_times = [], []
    for i, (x, y) in enumerate(batches):
        comm.barrier()
        t0 = time.perf_counter()
        c0 = dp.comm_seconds
        dp.train_step(x, y, lr=1e-4, weight_decay=0.1, grad_clip=1.0)
        dp._sync()
        dt = comm.all_reduce_scalars([time.perf_counter() - t0], op="max")[0]
        if i >= warmup:
            times.append(dt)
            comm_times.append(dp.comm_seconds - c0)
    sec = float(np.median(times))
    return {"preset": preset, "precision": precision, "world": comm.world_size, "comm": comm.name, "zero": zero,
            "batch_per_rank": batch_per_rank, "T": T, "step_ms": 1e3 * sec, "comm_ms": 1e3 * float(np.median(comm_times)),
            "tokens_per_s": comm.world_size * batch_per_rank * T / sec, "optimizer_bytes": dp.optimizer_bytes()}


def launch_plan(nproc: int = 2) -> dict:
    """How this machine can start nproc ranks: {"comm": "nccl" | "mpi" | None, "engine": "hip" | "numpy" | None,
    "why": one line}. NCCL with the hip engine when there are nproc GPUs and NCCL, else MPI ranks on the CPU with the
    NumPy engine, else None (the line says what is missing)."""
    from . import launch as L

    errors = []
    for backend in ("auto", "mpi"):
        try:
            comm = L.choose_backend(backend, nproc)
            if comm == "mpi":
                L.mpirun_command(nproc, [])
        except L.LaunchError as e:
            errors.append(str(e))
            continue
        engine = "hip" if comm == "nccl" else "numpy"
        return {"comm": comm, "engine": engine,
                "why": f"{nproc} ranks over {comm}, one per {'GPU' if comm == 'nccl' else 'CPU process'}, "
                       f"engine {engine}"}
    return {"comm": None, "engine": None, "why": "; ".join(dict.fromkeys(errors))}


def launch_subprocess(nproc, module_args, module="gpullm_lessons.parallel", comm="auto", timeout=600):
    """Run `python -m gpullm_lessons.launch --nproc N --backend comm --module module -- module_args` and wait
    (for notebooks and tests); returns the subprocess.CompletedProcess (stdout, stderr as text)."""
    import subprocess
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "gpullm_lessons.launch", "--nproc", str(nproc), "--backend", comm, "--module",
           module, "--", *[str(a) for a in module_args]]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def main(argv=None) -> int:
    import argparse

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "train":                   # the training job itself (train.py), its flags follow
        from .train import cli

        cli(argv[1:])                                 # configuration problems: "error: ..." and exit status 2
        return 0
    p = argparse.ArgumentParser(prog="python -m gpullm_lessons.parallel",
                                description="collectives self-test, all-reduce benchmark, data-parallel throughput "
                                            "(run on every rank: start with python -m gpullm_lessons.launch)")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("selftest", help="every collective, the ring by hand, a wrong ring caught")
    b = sub.add_parser("bench", help="all-reduce algbw / busbw, engine vs ring, 1 KiB .. 1 GiB")
    b.add_argument("--min-bytes", type=int, default=2**10)
    b.add_argument("--max-bytes", type=int, default=2**30)
    b.add_argument("--iters", type=int, default=None)
    b.add_argument("--no-ring", action="store_true")
    b.add_argument("--json", default=None, help="write the result (rank 0)")
    d = sub.add_parser("dpbench", help="data-parallel training tokens/s on random tokens")
    d.add_argument("--preset", default="gpt2")
    d.add_argument("--precision", default="bf16")
    d.add_argument("--backend", default="auto")
    d.add_argument("--batch-per-rank", type=int, default=16)
    d.add_argument("--steps", type=int, default=10)
    d.add_argument("--zero", action="store_true")
    d.add_argument("--json", default=None)
    sub.add_parser("train", help="the training job (python -m gpullm_lessons.train) on these ranks: its flags follow")
    args = p.parse_args(argv)
    comm = from_env()
    try:
        if args.cmd == "selftest":
            return 0 if selftest(comm) else 1
        if args.cmd == "bench":
            sizes, s = [], args.min_bytes
            while s <= args.max_bytes:
                sizes.append(s)
                s *= 4
            res = bench_result(comm, sizes, iters=args.iters, ring=not args.no_ring)
            if comm.rank == 0:
                print(format_bench(res))
                if args.json:
                    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
                    with open(args.json, "w") as f:
                        json.dump(res, f, indent=1)
            return 0
        if args.cmd == "dpbench":
            res = dp_bench(comm, args.preset, args.precision, args.batch_per_rank, args.steps, zero=args.zero,
                           backend=args.backend)
            if comm.rank == 0:
                print(json.dumps(res))
                print(f"data parallel {res['preset']} {res['precision']}: {res['world']} rank(s) x B={res['batch_per_rank']}"
                      f", {res['step_ms']:.1f} ms/step (gradient comm {res['comm_ms']:.1f} ms), "
                      f"{res['tokens_per_s']:,.0f} tokens/s")
                if args.json:
                    with open(args.json, "w") as f:
                        json.dump(res, f, indent=1)
            return 0
    finally:
        comm.close()
    return 1


if __name__ == "__main__":
    sys.exit(main())
