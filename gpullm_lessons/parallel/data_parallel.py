"""Data parallel training and ZeRO-1 / ZeRO-2 around an engine: the shard bookkeeping (which elements of the flat
buffer each rank's optimizer owns) and DataParallel, the step every rank runs (see the package docstring)."""

from __future__ import annotations

import time

import numpy as np

from .comm import Communicator, is_cupy
from ..model.optim import shard_decay_table  # noqa: F401 - part of the ZeRO bookkeeping taught here (exercise 10.3)
from .buckets import GradBuckets

ZERO_STAGES = (0, 1, 2)  # 0: plain data parallel; 1: AdamW's state sharded; 2: and the gradient kept as a shard


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
    """Per-rank bytes of the model state, plain data parallel vs ZeRO-1 (optimizer state sharded) vs ZeRO-2 (the
    gradient too: each rank keeps the reduced gradient of its shard only), per world size.

    fp32 params and grads (4 B each), AdamW m and v (8 B per parameter), + the half copy (2 B) in bf16/fp16. The
    model state held from one step to the next; during its backward a rank also writes its own full gradient (the
    course's engines: one flat buffer; ZeRO-2 as in the paper reduces it bucket by bucket instead)."""
    half = 0 if precision == "fp32" else 2
    rows = []
    for W in worlds:
        S = shard_size(n_params, W)
        dp = {"params": 4 * n_params + half * n_params, "grads": 4 * n_params, "optimizer": 8 * n_params}
        z1 = {"params": dp["params"], "grads": dp["grads"], "optimizer": 8 * S}
        z2 = {"params": dp["params"], "grads": 4 * S, "optimizer": 8 * S}
        rows.append(
            {
                "world": W,
                "dp_total": sum(dp.values()),
                "zero1_total": sum(z1.values()),
                "zero2_total": sum(z2.values()),
                **{f"dp_{k}": v for k, v in dp.items()},
                **{f"zero1_{k}": v for k, v in z1.items()},
                **{f"zero2_{k}": v for k, v in z2.items()},
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

        dp = DataParallel(eng, comm, zero=0, check_every=10)
        out = dp.train_step(x_local, y_local, lr, weight_decay, grad_clip)   # {"loss" (global mean), "grad_norm", ...}

    x_local, y_local: this rank's rows of the global batch (B/N, T). See the package docstring for what happens.
    At construction the parameters are broadcast from rank 0 (every rank starts from the same weights even if their
    seeds differed). zero=1 (or True): ZeRO-1, the engine's own full-size m and v are released (the shard's live
    here); zero=2: ZeRO-2, also the gradient: after the reduce-scatter a rank keeps only its shard of the reduced
    gradient, and the full-size local gradient buffer exists only from the start of backward to the reduce-scatter.
    bucket_mb > 0 (plain data parallel): the gradient all-reduce in buckets of that many MiB, filled in the order
    backward finishes the layers (buckets.py), one after the other after backward; overlap=True starts each bucket's
    all-reduce during backward, as soon as its layers are final (the same buckets, so the same bits).
    comm_seconds: gradient communication in flight, summed over the steps; comm_exposed_seconds: the part of it the
    steps waited for (all of it unless overlapped).
    """

    def __init__(self, engine, comm: Communicator, zero=0, check_every=0, align=64, bucket_mb=0.0, overlap=False):
        from ..model.params import num_params

        zero = int(zero)  # False / True: 0 / 1
        if zero not in ZERO_STAGES:
            raise ValueError(f"DataParallel: zero must be one of {ZERO_STAGES} (0: off), got {zero}")
        if overlap and (zero or not bucket_mb > 0):
            raise ValueError(
                "DataParallel: overlap=True starts plain data parallel's bucketed all-reduces during backward: it "
                f"needs bucket_mb > 0 (got {bucket_mb}) and zero=0 (got {zero})"
            )
        self.eng, self.comm, self.zero_stage, self.zero = engine, comm, zero, zero > 0
        self.check_every, self.bucket_mb, self.overlap = int(check_every), float(bucket_mb), bool(overlap)
        self.W, self.rank = comm.world_size, comm.rank
        self.xp = getattr(engine, "xp", np)
        self.n = num_params(engine.cfg)
        self.steps = 0
        self.comm_seconds = self.comm_exposed_seconds = 0.0
        self.buckets = None
        if self.bucket_mb > 0 and not self.zero and self.W > 1:
            self.buckets = GradBuckets(engine.cfg, comm, max(1, int(self.bucket_mb * 2**20 // 4)), self.xp)
        if comm.name == "nccl" and self.xp is np:
            raise ValueError(
                "DataParallel: an NCCL communicator needs a GPU engine (backend hip or numba on a GPU); "
                "the NumPy engine runs on MPI ranks"
            )
        moment_format = getattr(engine, "moment_format", "fp32")
        if self.zero and moment_format != "fp32":
            raise ValueError(
                f"DataParallel: ZeRO shards fp32 moments; this engine keeps them as {moment_format} "
                f"(optimizer_state={moment_format!r})"
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
        if self.zero_stage == 2:
            self._release_grads()

    def _release_grads(self):
        """ZeRO-2: drop the full-size local gradient (the engine's buffer); g_shard keeps this rank's reduced part."""
        self.eng.grads = self.gpad = None

    def _grads_for_backward(self):
        """ZeRO-2: a fresh full-size gradient buffer for the engine's backward to write, padded like ZeRO-1's."""
        from ..model.params import ParamBuffer

        if self.eng.grads is None:
            self.eng.grads = ParamBuffer(self.eng.cfg, np.float32, self.xp)
            self.gpad = self.eng.grads.pad_to(self.W * self.S)

    # ---- memory ----------------------------------------------------------------------------------------------------
    def optimizer_bytes(self) -> int:
        """Bytes of AdamW state (m + v) this rank holds."""
        if self.zero:
            return int(self.shard.m.nbytes + self.shard.v.nbytes)
        if hasattr(self.eng, "optimizer_bytes"):  # fp32, bf16 or 8-bit moments, as the engine stores them
            return self.eng.optimizer_bytes()
        return int(self.eng.m.nbytes + self.eng.v.nbytes)

    def gradient_bytes(self) -> int:
        """Bytes of gradient this rank holds between steps (the arrays that exist now): the full local buffer (padded
        under ZeRO-1) and, under ZeRO, the reduced shard; ZeRO-2 the shard only."""
        if not self.zero:
            return int(self.eng.grads.flat.nbytes)
        return int((self.gpad.nbytes if self.gpad is not None else 0) + self.g_shard.nbytes)

    def memory(self) -> dict:
        """This rank's model-state bytes between steps, from the arrays it holds: params (padded under ZeRO), grads
        (gradient_bytes), optimizer; and the unsharded sizes: optimizer_full (m + v of every parameter, in the engine's
        optimizer_state: ZeRO's are fp32; ratio: optimizer / optimizer_full), grads_full
        (one fp32 gradient of every parameter, what backward writes on every rank, ZeRO-2 included)."""
        p = self.ppad.nbytes if self.zero else self.eng.params.flat.nbytes
        return {
            "params": int(p),
            "grads": self.gradient_bytes(),
            "grads_full": 4 * self.n,
            "optimizer": self.optimizer_bytes(),
            "optimizer_full": self._optimizer_full(),
            "ratio": self.optimizer_bytes() / max(self._optimizer_full(), 1),
        }

    def _optimizer_full(self) -> int:
        from ..engine.core import optimizer_state_bytes

        return optimizer_state_bytes(self.n, getattr(self.eng, "moment_format", "fp32"))

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
        dt = time.perf_counter() - t0
        self.comm_seconds += dt  # blocking: all of it exposed
        self.comm_exposed_seconds += dt

    def mean_gradient(self, g):
        """This rank's gradient -> the mean of every rank's, in place: the all-reduce (sum, timed), then x 1/N; with
        buckets, their all-reduces one after the other (GradBuckets.all_reduce_in_order)."""
        if self.W == 1:
            return
        if self.buckets is not None:
            self.buckets.all_reduce_in_order(g)
            self.comm_seconds += self.buckets.total_s
            self.comm_exposed_seconds += self.buckets.exposed_s
            return
        self._timed(self.comm.all_reduce, g)
        g *= np.float32(1.0 / self.W)

    def _overlapped_step(self, x, y, lr, weight_decay, grad_clip, micro_batches):
        """Plain data parallel with each bucket's all-reduce started from backward (grads_ready) and waited for
        before the update: the engine's own train_step with the communication moved into its backward, step by step
        from Python (a captured graph cannot start collectives in the middle of its backward)."""
        eng, gb = self.eng, self.buckets
        scale = eng.scaler.scale if eng.scaler is not None else 1.0
        gb.begin(eng.grads.flat)
        loss = eng.forward_backward(x, y, micro_batches, loss_scale=scale, grads_ready=gb.ready)
        gb.finish(eng.grads.flat)
        self.comm_seconds += gb.total_s
        self.comm_exposed_seconds += gb.exposed_s
        return {"loss": loss, **eng.optimizer_step(lr, weight_decay, grad_clip)}

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
            elif self.overlap:
                out = self._overlapped_step(x, y, lr, weight_decay, grad_clip, micro_batches)
                out["loss"] = float(self.comm.all_reduce_scalars([out["loss"]])[0]) / self.W
            else:
                out = dict(
                    eng.train_step(
                        x, y, lr, weight_decay, grad_clip, reduce_grads=self.mean_gradient, micro_batches=micro_batches
                    )
                )
                out["loss"] = float(self.comm.all_reduce_scalars([out["loss"]])[0]) / self.W
        else:
            if self.zero_stage == 2:
                self._grads_for_backward()
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
        if self.zero_stage == 2:  # this rank's shard of the reduced gradient is all it keeps
            self._release_grads()
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
