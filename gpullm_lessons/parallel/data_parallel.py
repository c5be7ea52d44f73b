"""Data parallel training and ZeRO-1 around an engine: the shard bookkeeping (which elements of the flat buffer
each rank's optimizer owns) and DataParallel, the step every rank runs (see the package docstring)."""

from __future__ import annotations

import time

import numpy as np

from ..comm import Communicator, is_cupy
from ..optim import shard_decay_table  # noqa: F401 - part of the ZeRO bookkeeping taught here (exercise 10.3)


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
        rows.append(
            {
                "world": W,
                "dp_total": sum(dp.values()),
                "zero1_total": sum(z1.values()),
                **{f"dp_{k}": v for k, v in dp.items()},
                **{f"zero1_{k}": v for k, v in z1.items()},
            }
        )
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
        from ..params import num_params

        self.eng, self.comm, self.zero = engine, comm, bool(zero)
        self.check_every, self.bucket_mb = int(check_every), float(bucket_mb)
        self.W, self.rank = comm.world_size, comm.rank
        self.xp = getattr(engine, "xp", np)
        self.n = num_params(engine.cfg)
        self.steps = 0
        self.comm_seconds = 0.0
        if comm.name == "nccl" and self.xp is np:
            raise ValueError(
                "DataParallel: an NCCL communicator needs a GPU engine (backend hip or numba on a GPU); "
                "the NumPy engine runs on MPI ranks"
            )
        if self.zero and getattr(engine, "moments_q", None) is not None:
            raise ValueError(
                "DataParallel: ZeRO shards fp32 moments; this engine keeps them in 8 bits (optimizer_state='int8')"
            )
        comm.broadcast(engine.params.flat, root=0)
        engine.params_changed()
        if self.zero:
            self._setup_zero(align)

    # ---- ZeRO-1 setup --------------------------------------------------------------------------------------------
    def _setup_zero(self, align):
        xp, eng, W, r = self.xp, self.eng, self.W, self.rank
        self.S = S = shard_size(self.n, W, align)
        self.lo, self.hi = r * S, (r + 1) * S  # this rank's slice of the padded buffer
        self.gpad = eng.grads.pad_to(W * S)
        self.ppad = eng.params.pad_to(W * S)
        self.g_shard = xp.zeros(S, xp.float32)  # the reduce-scatter's output: the summed shard
        # AdamW over the shard: params a view of the padded params (the update lands there), m and v of S elements
        # (from the engine's, so a loaded checkpoint carries over); then the full-size state goes
        self.shard = eng.optimizer_shard(self.lo, self.hi, self.ppad[self.lo : self.hi], self.g_shard)
        eng.release_optimizer_state()

    # ---- memory ----------------------------------------------------------------------------------------------------
    def optimizer_bytes(self) -> int:
        """Bytes of AdamW state (m + v) this rank holds."""
        if self.zero:
            return int(self.shard.m.nbytes + self.shard.v.nbytes)
        if hasattr(self.eng, "optimizer_bytes"):  # the NumPy engine: fp32 or 8-bit moments
            return self.eng.optimizer_bytes()
        return int(self.eng.m.nbytes + self.eng.v.nbytes)

    def memory(self) -> dict:
        """This rank's model-state bytes: params, grads (padded under ZeRO), optimizer; and the unsharded optimizer."""
        p = self.ppad.nbytes if self.zero else self.eng.params.flat.nbytes
        g = self.gpad.nbytes if self.zero else self.eng.grads.flat.nbytes
        return {
            "params": int(p),
            "grads": int(g),
            "optimizer": self.optimizer_bytes(),
            "optimizer_full": 8 * self.n,
            "ratio": self.optimizer_bytes() / (8 * self.n),
        }

    # ---- state: what a checkpoint holds, the same on 1 and N ranks -------------------------------------------------
    def state_dict(self) -> dict:
        """The engine's state_dict with the whole model's m and v (ZeRO: gathered from the ranks' shards). Every rank
        must call it (it is a collective under ZeRO); every rank gets the same dict."""
        state = self.eng.state_dict()
        if self.zero:
            for key in ("m", "v"):
                full = self.xp.zeros(self.W * self.S, self.xp.float32)
                self.comm.all_gather(getattr(self.shard, key), full)
                state[key] = np.array(full[: self.n].get() if is_cupy(full) else full[: self.n], np.float32)
        return state

    # ---- one step ----------------------------------------------------------------------------------------------
    def _sync(self):
        if self.xp is not np:
            self.xp.cuda.get_current_stream().synchronize()

    def _timed(self, fn, *args):
        self._sync()  # the kernels before it done: time only the comm
        t0 = time.perf_counter()
        fn(*args)
        self._sync()
        self.comm_seconds += time.perf_counter() - t0

    def _all_reduce(self, g):
        if self.bucket_mb > 0:
            step = max(1, int(self.bucket_mb * 2**20 // 4))
            for lo in range(0, g.size, step):
                self.comm.all_reduce(g[lo : lo + step])
        else:
            self.comm.all_reduce(g)

    def mean_gradient(self, g):
        """This rank's gradient -> the mean of every rank's, in place: the all-reduce (sum, timed), then x 1/N."""
        if self.W == 1:
            return
        self._timed(self._all_reduce, g)
        g *= np.float32(1.0 / self.W)

    def train_step(self, x, y, lr, weight_decay=0.0, grad_clip=0.0, micro_batches=1) -> dict:
        """Forward and backward on this rank's rows, gradients combined over ranks, the same update everywhere.

        Plain data parallel is the engine's own train_step with the gradient all-reduce between backward and the
        update (mean_gradient; on a GPU engine with graphs, between the two replayed graphs); ZeRO-1 runs the
        engine's update on this rank's shard (_zero_step). micro_batches=K: this rank's rows are K micro-batches whose
        gradients accumulate before the one all-reduce (or reduce-scatter) of the step."""
        eng = self.eng
        if not self.zero:
            if self.W == 1:  # nothing to combine: the engine's own step
                out = eng.train_step(x, y, lr, weight_decay, grad_clip, micro_batches=micro_batches)
            else:
                out = dict(
                    eng.train_step(
                        x, y, lr, weight_decay, grad_clip, reduce_grads=self.mean_gradient, micro_batches=micro_batches
                    )
                )
                out["loss"] = float(self.comm.all_reduce_scalars([out["loss"]])[0]) / self.W
        else:
            scale = eng.scaler.scale if eng.scaler is not None else 1.0
            loss = eng.forward_backward(x, y, micro_batches, loss_scale=scale)
            out = self._zero_step(loss, lr, weight_decay, grad_clip)
        self.steps += 1
        if self.W > 1 and self.check_every > 0 and self.steps % self.check_every == 0:
            self.check_replicas()
        return out

    def _zero_step(self, loss, lr, weight_decay, grad_clip):
        eng, comm, g = self.eng, self.comm, self.g_shard
        self._timed(comm.reduce_scatter, self.gpad, g)  # rank r: the sum of every rank's shard r
        if self.W > 1:
            g *= np.float32(1.0 / self.W)
        bad = eng.count_nonfinite(g) if eng.scaler is not None else 0
        red = comm.all_reduce_scalars([loss, eng.grad_sumsq(g), bad])  # one small all-reduce for all three
        # the same global norm and non-finite count on every rank: the same clip factor and skip decision
        out = {
            "loss": float(red[0]) / self.W,
            **eng.update(lr, weight_decay, grad_clip, sumsq=float(red[1]), nonfinite=int(red[2]), shard=self.shard),
        }
        if not out["skipped"]:
            self._timed(comm.all_gather, self.shard.params, self.ppad)  # every rank gets every updated shard
            eng.params_changed()  # the half copy, re-converted from the fp32 params
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
        return float(self.xp.sum(p, dtype=self.xp.float64)), float(self.xp.dot(p, p))  # no float64 copy on a GPU

    def check_replicas(self):
        """Compare every rank's parameter checksum with rank 0's; ReplicaMismatch naming the ranks that differ."""
        sums = self.comm.gather_scalars(self.checksum())
        bad = [r for r in range(self.W) if not np.array_equal(sums[r], sums[0])]
        if bad:
            raise ReplicaMismatch(
                f"after step {self.steps} the parameters differ between ranks: rank(s) {bad} "
                f"disagree with rank 0 (checksums {', '.join(f'rank {r}: {sums[r, 0]!r}' for r in range(self.W))})"
            )
        return sums[0]
