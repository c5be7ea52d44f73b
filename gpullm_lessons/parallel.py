"""Several ranks, one model: ring all-reduce by hand, data parallel training and ZeRO-1, on a communicator (comm.py).

    ring_allreduce_sim(buffers)          the ring all-reduce of N simulated ranks in NumPy, with its step log
    ring_allreduce(comm, buf)            the same algorithm across real ranks, over comm.sendrecv
    DataParallel(engine, comm, zero=)    one training step on every rank: local slice -> gradients -> all-reduce
                                         (or ZeRO-1: reduce-scatter, AdamW on the local shard, all-gather)
    bench_allreduce(comm, sizes)         algorithm and bus bandwidth (nccl-tests' definitions), engine vs ring
    train_distributed(argv)              the training job on N ranks (the hook train.py calls when WORLD_SIZE > 1)

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

__all__ = ["chunk_bounds", "ring_allreduce_chunks", "ring_allreduce_sim", "ring_allreduce", "check_allreduce",
           "shard_size", "shard_bounds", "shard_decay_table", "DataParallel", "ReplicaMismatch", "bench_allreduce",
           "format_bench", "train_distributed", "zero_memory_table"]


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


def shard_decay_table(bounds, flags, lo: int, hi: int) -> tuple:
    """The AdamW decay table of the shard lo..hi of the flat buffer: (bounds', flags') in shard-local indices.

    bounds (k+1,), flags (k,) as kernels.numba.adamw.decay_table builds them for the whole buffer (tensor j is
    elements bounds[j] .. bounds[j+1]-1). Each tensor's range is shifted by -lo and clipped to 0 .. hi-lo; tensors
    outside the shard are dropped. When hi runs past the last tensor (the zero padding), the tail is one more
    "tensor" with flag 0 (no decay). Returns int64 bounds starting at 0 and ending at hi - lo, uint8 flags."""
    b = np.asarray(bounds, dtype=np.int64)
    f = np.asarray(flags).astype(np.uint8)
    if b.ndim != 1 or f.ndim != 1 or b.size != f.size + 1:
        raise ValueError(f"shard_decay_table: bounds must be (k+1,) and flags (k,), got {b.shape} and {f.shape}")
    if not 0 <= lo <= hi:
        raise ValueError(f"shard_decay_table: need 0 <= lo <= hi, got lo={lo}, hi={hi}")
    starts = np.clip(b[:-1] - lo, 0, hi - lo)
    stops = np.clip(b[1:] - lo, 0, hi - lo)
    keep = stops > starts
    out_b, out_f = [0], []
    for s0, s1, fl in zip(starts[keep], stops[keep], f[keep]):
        out_b.append(int(s1))
        out_f.append(int(fl))
    if out_b[-1] < hi - lo:                                       # the padding past the last tensor
        out_b.append(hi - lo)
        out_f.append(0)
    if not out_f:                                                # an empty shard: one empty tensor
        out_b, out_f = [0, 0], [0]
    return np.array(out_b, np.int64), np.array(out_f, np.uint8)


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


def _pad_buffer(pbuf, total, xp):
    """Re-home a ParamBuffer into zero-padded storage of `total` elements: its flat buffer and every named view
    become views of storage[:n]; returns the storage (the engine keeps using pbuf as before)."""
    n = pbuf.flat.size
    storage = xp.zeros(total, pbuf.flat.dtype)
    storage[:n] = pbuf.flat
    pbuf.flat = storage[:n]
    pbuf.views = {k: pbuf.flat[a:b].reshape(pbuf.shapes[k]) for k, (a, b) in pbuf.offsets.items()}
    return storage


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
        engine._params_changed()
        if self.zero:
            self._setup_zero(align)

    # ---- ZeRO-1 setup --------------------------------------------------------------------------------------------
    def _setup_zero(self, align):
        xp, eng, W, r = self.xp, self.eng, self.W, self.rank
        self.S = S = shard_size(self.n, W, align)
        self.lo, self.hi = r * S, (r + 1) * S                    # this rank's slice of the padded buffer
        self.gpad = _pad_buffer(eng.grads, W * S, xp)
        self.ppad = _pad_buffer(eng.params, W * S, xp)
        self.p_shard = self.ppad[self.lo:self.hi]                # a view: AdamW updates the padded params in place
        self.g_shard = xp.zeros(S, xp.float32)
        if eng.backend == "numpy":
            from .optim import AdamW, decay_mask_for

            mask = np.zeros(W * S, bool)
            mask[:self.n] = decay_mask_for(eng.cfg)
            self.opt = AdamW(self.p_shard, lr=1.0, betas=eng.betas, eps=eng.eps, weight_decay=0.0,
                             decay_mask=mask[self.lo:self.hi])
            self.m, self.v = self.opt.m, self.opt.v
            eng.opt.m = eng.opt.v = np.zeros(0, np.float32)
        else:
            from .arrays import to_backend
            from .kernels.numba.adamw import decay_table

            b, f = decay_table(eng.params, arrays="numpy")
            b, f = shard_decay_table(b, f, self.lo, self.hi)
            where = "cupy" if eng.on_gpu else "numpy"
            self.table = (to_backend(b, where), to_backend(f, where))
            self.m, self.v = xp.zeros(S, xp.float32), xp.zeros(S, xp.float32)
        eng.m = eng.v = xp.zeros(0, xp.float32)                  # the full-size state is not kept

    # ---- memory ----------------------------------------------------------------------------------------------------
    def optimizer_bytes(self) -> int:
        """Bytes of AdamW state (m + v) this rank holds."""
        if self.zero:
            return int(self.m.nbytes + self.v.nbytes)
        return int(self.eng.m.nbytes + self.eng.v.nbytes)

    def memory(self) -> dict:
        """This rank's model-state bytes: params, grads (padded under ZeRO), optimizer; and the unsharded optimizer."""
        p = self.ppad.nbytes if self.zero else self.eng.params.flat.nbytes
        g = self.gpad.nbytes if self.zero else self.eng.grads.flat.nbytes
        return {"params": int(p), "grads": int(g), "optimizer": self.optimizer_bytes(), "optimizer_full": 8 * self.n,
                "ratio": self.optimizer_bytes() / (8 * self.n)}

    # ---- one step ----------------------------------------------------------------------------------------------
    def _sync(self):
        if self.xp is not np:
            self.xp.cuda.get_current_stream().synchronize()

    def _all_reduce_grads(self):
        g = self.eng.grads.flat
        if self.bucket_mb > 0:
            step = max(1, int(self.bucket_mb * 2**20 // 4))
            for lo in range(0, g.size, step):
                self.comm.all_reduce(g[lo:lo + step])
        else:
            self.comm.all_reduce(g)

    def train_step(self, x, y, lr, weight_decay=0.0, grad_clip=0.0) -> dict:
        """Forward and backward on this rank's rows, gradients combined over ranks, the same update everywhere."""
        eng = self.eng
        scale = eng.scaler.scale if eng.scaler is not None else 1.0
        _, loss = eng.forward(x, y)
        eng.backward(loss_scale=scale)
        if not self.zero:
            self._sync()                                        # the backward's kernels done: time only the comm
            t0 = time.perf_counter()
            self._all_reduce_grads()                            # sum over ranks ...
            self._sync()
            self.comm_seconds += time.perf_counter() - t0
            if self.W > 1:
                eng.grads.flat *= np.float32(1.0 / self.W)      # ... / N: the mean of the ranks' mean-loss gradients
            out = eng.optimizer_step(lr, weight_decay, grad_clip, grad_norm=eng.grad_norm())
            out["loss"] = float(self.comm.all_reduce_scalars([loss])[0]) / self.W
        else:
            out = self._zero_step(loss, scale, lr, weight_decay, grad_clip)
        self.steps += 1
        if self.check_every > 0 and self.steps % self.check_every == 0:
            self.check_replicas()
        return out

    def _zero_step(self, loss, scale, lr, weight_decay, grad_clip):
        xp, eng, comm = self.xp, self.eng, self.comm
        self._sync()
        t0 = time.perf_counter()
        comm.reduce_scatter(self.gpad, self.g_shard)             # rank r: the sum of every rank's shard r
        self._sync()
        self.comm_seconds += time.perf_counter() - t0
        if self.W > 1:
            self.g_shard *= np.float32(1.0 / self.W)
        g = self.g_shard
        if xp is np:                                             # as each engine's own grad_norm() sums
            sq = float(np.sum(np.square(g, dtype=np.float64)))
        else:
            sq = float(xp.dot(g, g))
        bad = 0.0
        if eng.scaler is not None:
            eng.K.nonfinite_count(g, eng._count)
            bad = float(int(eng._count[0]))
        red = comm.all_reduce_scalars([loss, sq, bad])           # one small all-reduce for all three
        out = {"loss": float(red[0]) / self.W}
        if eng.scaler is not None:
            out["scale"] = scale
            if eng.scaler.update(red[2] > 0):                   # every rank sees the same count: the same decision
                out.update(grad_norm=float("nan"), skipped=True)
                return out
        norm = math.sqrt(float(red[1])) / scale
        coef = grad_clip / (norm + 1e-6) if grad_clip > 0 and grad_clip / (norm + 1e-6) < 1.0 else 1.0
        if eng.backend == "numpy":
            if coef < 1.0:
                g *= np.float32(coef)
            self.opt.weight_decay = float(weight_decay)
            self.opt.t = eng.t
            self.opt.step(g, lr=lr)
            eng.t = self.opt.t
        else:
            eng.t += 1
            eng.K.adamw_step(self.p_shard, g, self.m, self.v, lr, eng.betas[0], eng.betas[1], eng.eps, weight_decay,
                             eng.t, decay_bounds=self.table,
                             grad_scale=float(np.float32(coef) / np.float32(scale)) if scale != 1.0 else float(coef),
                             version=eng.ver["adamw"])
        self._sync()
        t0 = time.perf_counter()
        comm.all_gather(self.p_shard, self.ppad)                 # every rank gets every updated shard
        self._sync()
        self.comm_seconds += time.perf_counter() - t0
        eng._params_changed()                                    # the half copy, re-converted from the fp32 params
        out.update(grad_norm=norm, skipped=False)
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
# 6. The training job on N ranks
# ================================================================================================================

def add_parallel_args(parser):
    """The flags data parallel adds to train.py's parser (skipped where train.py already defines them)."""
    have = set(parser._option_string_actions)
    if "--zero" not in have:
        parser.add_argument("--zero", action="store_true",
                            help="ZeRO-1: shard AdamW's state over the ranks (reduce-scatter, shard update, all-gather)")
    if "--check-every" not in have:
        parser.add_argument("--check-every", type=int, default=10,
                            help="compare a parameter checksum across ranks every N steps (0: only at the end)")
    if "--bucket-mb" not in have:
        parser.add_argument("--bucket-mb", type=float, default=0.0,
                            help="all-reduce the gradients in buckets of this many MiB (0: one all-reduce)")
    return parser


def train_distributed(argv=None, comm=None) -> dict:
    """The training job of gpullm_lessons.train on every rank of `comm` (default from_env()), data parallel.

    The hook for train.py: when WORLD_SIZE (or OMPI_COMM_WORLD_SIZE) > 1, call train_distributed(argv) instead of
    train.main(argv). It takes train.py's flags (train.build_parser(), plus --zero, --check-every, --bucket-mb) and
    the same presets, data, LR schedule, seed and engine; --batch-size is the GLOBAL batch B: each of the N ranks
    trains on rows [r B/N, (r+1) B/N) of the batch the one-rank run draws, so with the same seed the losses match the
    one-rank run's to fp32 rounding. Rank 0 writes log.jsonl (train.py's records + comm_s, the seconds spent in
    gradient communication), loss.png, config.json, sample.txt and, without --zero, ckpt.npz; --resume is not
    supported on several ranks. Returns the summary (on every rank)."""
    from . import engine as engine_mod
    from . import train as T_
    from .data import BatchSampler, byte_unigram_entropy, decode, load_corpus
    from .optim import lr_schedule
    from .params import GPTConfig, num_params

    args = add_parallel_args(T_.build_parser()).parse_args(argv)
    preset, B, T, lr, backend = T_.settings(args)
    comm = comm if comm is not None else from_env("mpi" if backend == "numpy" else None)   # NumPy: CPU ranks
    W, rank = comm.world_size, comm.rank
    say = print if rank == 0 else (lambda *a, **k: None)
    if B % W:
        raise T_.ConfigError(f"the global batch --batch-size {B} does not divide by the {W} ranks: each rank takes "
                             f"B / N rows; use a multiple of {W}")
    if args.resume:
        raise T_.ConfigError("--resume is not supported with several ranks yet: resume on one rank, or start anew")
    if comm.name == "nccl" and backend == "numpy":
        raise T_.ConfigError("NCCL ranks need a GPU backend (--backend hip); the NumPy engine runs on MPI ranks")
    cfg = GPTConfig(**preset)
    steps = args.steps
    warmup = steps // 10 if args.warmup is None else args.warmup
    min_lr = lr / 10 if args.min_lr is None else args.min_lr
    from pathlib import Path

    out = Path(args.out if args.out is not None else f"runs/{args.preset}-{backend}-x{W}")
    corpus = load_corpus(args.data, block_size=T)
    entropy = byte_unigram_entropy(corpus.val)
    train_batches = BatchSampler(corpus.train, B, T, seed=args.seed)        # the same global batches on every rank
    val_sampler = BatchSampler(corpus.val, B, T, seed=args.seed + 1)
    val_batches = [next(val_sampler) for _ in range(args.eval_batches)]
    sample_rng = np.random.default_rng(args.seed + 2)
    rows = slice(rank * B // W, (rank + 1) * B // W)                       # this rank's rows of every batch
    try:
        eng = engine_mod.build(cfg, backend, args.precision, args.checkpointing, seed=args.seed)
    except engine_mod.EngineError as e:
        raise T_.ConfigError(str(e)) from e
    dp = DataParallel(eng, comm, zero=args.zero, check_every=args.check_every, bucket_mb=args.bucket_mb)
    n_params = num_params(cfg)
    run_config = {"model": {k: getattr(cfg, k) for k in ("vocab_size", "block_size", "n_layer", "n_head", "d_model")},
                  "batch_size": B, "seq_len": T, "steps": steps, "lr": lr, "warmup": warmup, "min_lr": min_lr,
                  "weight_decay": args.weight_decay, "grad_clip": args.grad_clip, "backend": backend,
                  "precision": args.precision, "policy": args.checkpointing, "seed": args.seed,
                  "data_source": corpus.source, "world_size": W, "comm": comm.name, "zero": bool(args.zero)}
    say(f"data: {corpus.describe()}")
    say(f"model: {args.preset} L={cfg.n_layer} nh={cfg.n_head} C={cfg.d_model} block={cfg.block_size} "
        f"V={cfg.vocab_size}, {n_params:,} parameters | global B={B} = {W} ranks x {B // W}, T={T}, {steps} steps, "
        f"lr {lr:g} (warmup {warmup}, min {min_lr:g})")
    say(f"data parallel: {W} ranks over {comm.name}, backend {T_.describe_backend(eng)}, precision {args.precision}"
        + (", ZeRO-1 (AdamW state sharded)" if args.zero else ""))
    mem = comm.gather_scalars([dp.optimizer_bytes(), dp.memory()["optimizer_full"]])
    for r in range(W):
        say(f"rank {r}: optimizer state (AdamW m + v) {int(mem[r, 0]):,} bytes of {int(mem[r, 1]):,} unsharded "
            f"({mem[r, 0] / mem[r, 1]:.4f})")
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps({**vars(args), **run_config, "num_params": n_params}, indent=2)
                                         + "\n")

    def evaluate():
        return float(np.mean([dp.eval_loss(x[rows], y[rows]) for x, y in val_batches]))

    val_loss_init = evaluate()
    records = []
    log = open(out / "log.jsonl", "w") if rank == 0 else None
    t_start = time.perf_counter()
    try:
        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            c0 = dp.comm_seconds
            x, y = next(train_batches)                                     # (B, T): the global batch
            step_lr = lr_schedule(step - 1, lr, warmup, steps, min_lr)
            res = dp.train_step(x[rows], y[rows], lr=step_lr, weight_decay=args.weight_decay,
                                grad_clip=args.grad_clip)
            loss = float(res["loss"])
            if not math.isfinite(loss):
                raise RuntimeError(f"loss is {loss} at step {step}: training diverged; try a lower --lr")
            dt = comm.all_reduce_scalars([time.perf_counter() - t0], op="max")[0]
            grad_norm = float(res["grad_norm"])
            record = {"step": step, "loss": loss, "lr": step_lr,
                      "grad_norm": grad_norm if math.isfinite(grad_norm) else None,
                      "skipped": bool(res.get("skipped", False)), "tokens_per_s": B * T / dt,
                      "comm_s": dp.comm_seconds - c0}
            if "scale" in res:
                record["scale"] = float(res["scale"])
            if (args.eval_every > 0 and step % args.eval_every == 0) or step == steps:
                record["val_loss"] = evaluate()
                say(f"step {step:5d} | train loss {loss:.4f} | val loss {record['val_loss']:.4f}", file=sys.stderr)
            records.append(record)
            if log is not None:
                log.write(json.dumps(record) + "\n")
                log.flush()
        dp.check_replicas()
    finally:
        if log is not None:
            log.close()
    train_time = time.perf_counter() - t_start
    summary = {"preset": args.preset, "backend": backend, "precision": args.precision, "world_size": W,
               "comm": comm.name, "zero": bool(args.zero), "steps": steps, "num_params": n_params,
               "train_loss_first": records[0]["loss"], "train_loss_last": records[-1]["loss"],
               "val_loss_init": val_loss_init, "val_loss": records[-1]["val_loss"], "unigram_entropy": entropy,
               "time_s": train_time, "tokens_per_s": steps * B * T / train_time,
               "optimizer_bytes_per_rank": [int(v) for v in mem[:, 0]], "optimizer_bytes_full": int(mem[0, 1]),
               "out": str(out)}
    if rank == 0:
        from .viz import plot_loss
        import matplotlib.pyplot as plt

        plt.close(plot_loss([{"step": 0, "val_loss": val_loss_init}] + records, out / "loss.png", entropy=entropy))
        if not args.zero:                                                  # rank 0 holds the whole state
            T_.save_checkpoint(out / T_.CKPT_NAME, eng, run_config,
                               {"step": steps, "sampler": train_batches.state(),
                                "sample_rng": sample_rng.bit_generator.state, "val_loss_init": val_loss_init})
        if args.sample_tokens > 0:
            ids = T_.generate(eng.next_logits, cfg.block_size, args.prompt, args.sample_tokens, args.temperature,
                              args.top_k, rng=sample_rng)
            text = decode(np.where(ids < 256, ids, ord("?")))
            (out / "sample.txt").write_text(text, encoding="utf-8")
            say(f"--- sample ({args.sample_tokens} bytes) ---\n{text}\n---")
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    say(f"done: {steps} steps on {W} ranks in {train_time:.1f} s ({summary['tokens_per_s']:,.0f} tokens/s) | train "
        f"loss {summary['train_loss_first']:.4f} -> {summary['train_loss_last']:.4f} | val loss "
        f"{summary['val_loss']:.4f} | replicas identical (checksum) | output in {out}")
    return summary


# ================================================================================================================
# 7. Self-test, data-parallel throughput, CLI
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
    if argv and argv[0] == "train":                   # train.py's own flags follow
        from .train import ConfigError

        try:
            train_distributed(argv[1:])
        except (ConfigError, FileNotFoundError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
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
    sub.add_parser("train", help="data-parallel training: train.py's flags follow (+ --zero, --check-every)")
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
