"""DeepSpeed-Ulysses sequence parallelism of the NumPy GPT on CPU ranks: every rank holds T / N positions of every
sequence, and two all-to-alls around each attention trade positions for heads, so that attention sees the whole
sequence for nh / N of the heads.

    Ulysses(cfg, comm, params)          this rank: the whole model (replicated, like data parallel), its gradient and
                                        AdamW's m and v, and the step
    Ulysses.train_step(x, y, lr, ...)   one step: x, y the GLOBAL batch (B, T); rank r takes positions
                                        [r T/N, (r+1) T/N) of every sequence
    ulysses_ranks(cfg, world, params)   the N ranks' objects in one process; simulate_step(ranks, ...) their step
    ulysses_traffic(cfg, world, B, T)   the elements each rank sends per step (all-to-alls and the gradient's
                                        all-reduce)

CLI (each rank runs it; start the ranks with the launcher or mpirun):
    python -m gpullm_lessons.parallel.launch --nproc 2 --backend mpi --module gpullm_lessons.parallel -- \\
        ulysses --n-layer 2 --n-head 4 --d-model 32 --steps 3

What is split. Everything a position computes alone (the embeddings, the LayerNorms, the four linears, GELU, the
residual adds, the head and the loss) runs on the rank's own T/N positions with the whole weights. Attention is the
one op that mixes positions, so around it the ranks trade:

    forward   qkv (B, T/N, 3C) on every rank -> all-to-all -> (B, T, 3C/N): the whole sequence's q, k and v of this
              rank's heads [r nh/N, (r+1) nh/N) (taken from each of q, k and v, packed q_r | k_r | v_r as the
              attention reads them); causal attention over all T positions, this rank's heads only -> atty
              (B, T, C/N) -> all-to-all -> (B, T/N, C): this rank's positions, every head, in head order.
    backward  the same two all-to-alls in reverse: d(atty) (B, T/N, C) -> (B, T, C/N) for this rank's heads;
              attention's backward; dqkv (B, T, 3C/N) -> (B, T/N, 3C) for this rank's positions.

An all-to-all sends chunk j of a rank's buffer to rank j and receives chunk i from rank i: each rank sends
(N-1)/N of its buffer. Per block and step, 2 all-to-alls of 3 B T C / N elements (qkv and dqkv) and 2 of B T C / N
(atty and its gradient): 8 B T C / N per block, of which each rank sends (N-1)/N. Against tensor parallelism's
all-reduces of B T C per block (each sending 2 (N-1)/N of it), Ulysses moves less as N grows: its buffers shrink
with N, the all-reduce's do not. N must divide both T and nh.

The weights are replicated, so their gradients are partial: each rank's sum over its own positions. One all-reduce
(sum) of the flat gradient buffer after the backward gives every rank the whole gradient (as data parallel: there
the rows are split, here the positions). The loss is the mean over all B T tokens = the mean of the N ranks' local
means (equal counts), so each rank's backward starts from dloss = 1/N.

Memory. Parameters, gradients and AdamW's state: 16 Psi per rank, as data parallel. The activations are what is
split: every tensor the forward keeps is either per position (1/N of the positions) or per head (1/N of the heads: the
attention probabilities (B, nh/N, T, T)), so a rank's cache is 1/N of one rank's; `cache_bytes()` measures it after
the forward and the tests check N x the per-rank bytes == the one-rank bytes.

Numerics. One rank (SingleComm): the same reference ops on the same arrays as NumpyEngine; the float64 norm's order
is the flat buffer's; the tests find the losses and parameters bitwise equal. N ranks: each weight's gradient is a sum
over positions cut into N partial sums (then MPI's all-reduce order), the loss a mean of means: rounding of about 1e-7
relative in float32, carried by AdamW; the tests allow 1e-5 on losses of about 5.5 nats over 3 steps.

Not here: overlapping the all-to-alls with the linears, a GPU engine (NCCL's all-to-all is a group of sends and
receives, as comm.Communicator.all_to_all builds it), and combining Ulysses with ZeRO to shard the replicated state.
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

from .numpy_job import whole_params

FLOAT = np.float32


def _check(fn, cfg, world, T=None):
    """tensor.py's checks of cfg and world (N whole heads per rank), and T / N positions per rank."""
    from .tensor import _check as heads_split

    world = heads_split(fn, cfg, world)
    if T is not None and T % world:
        raise ValueError(
            f"{fn}: T={T} positions do not split over {world} ranks: each rank takes T / N of them; pass a sequence "
            f"length divisible by {world}"
        )
    return world


def ulysses_traffic(cfg, world: int, B: int, T: int) -> dict:
    """Per step and rank: {"all_to_all" (elements of the all-to-all buffers, 8 L B T C / N), "all_to_alls" (4 L),
    "sent" (the elements a rank sends of them, (N-1)/N), "grad_all_reduce" (the gradient's elements, Psi)}."""
    from ..model.params import num_params

    N = _check("ulysses_traffic", cfg, world, T)
    n = 8 * cfg.n_layer * B * T * cfg.d_model // N
    return {
        "all_to_all": n,
        "all_to_alls": 4 * cfg.n_layer,
        "sent": n * (N - 1) // N,
        "grad_all_reduce": num_params(cfg),
    }


class _Rank:
    """A rank of a simulation in one process: no communicator, only its place."""

    name = "simulated"

    def __init__(self, rank, world_size):
        self.rank, self.world_size = rank, world_size


class Ulysses:
    """This rank's replicated model (one flat fp32 array each of params, grads, m, v, with ParamBuffer's named views)
    and the regions of its step (the driver _forward_backward trades between them)."""

    def __init__(self, cfg, comm, params, betas=None, eps=None):
        from ..engine.core import BETAS, EPS
        from ..model.optim import decay_mask_for
        from ..model.params import ParamBuffer

        self.cfg, self.comm = cfg, comm
        self.W, self.rank = comm.world_size, comm.rank
        _check("Ulysses", cfg, self.W)
        flat = whole_params("Ulysses", cfg, params)
        self.P, self.G = ParamBuffer(cfg, dtype=FLOAT), ParamBuffer(cfg, dtype=FLOAT)
        self.P.flat[...] = flat
        self.m, self.v = np.zeros_like(self.P.flat), np.zeros_like(self.P.flat)
        self.decay = decay_mask_for(cfg)
        self.betas = tuple(float(b) for b in (BETAS if betas is None else betas))
        self.eps = float(EPS if eps is None else eps)
        self.t = 0
        self.c = {}
        C, N = cfg.d_model, self.W
        w = C // N
        # the packed qkv columns of rank j's heads: [j C/N, (j+1) C/N) of each of q, k, v
        self.qkv_cols = [
            np.concatenate([np.arange(o + j * w, o + (j + 1) * w) for o in (0, C, 2 * C)]) for j in range(N)
        ]

    def __repr__(self):
        return f"Ulysses(rank {self.rank}/{self.W}: {self.P.flat.size:,} parameters, replicated)"

    def positions(self, T: int) -> slice:
        return slice(self.rank * T // self.W, (self.rank + 1) * T // self.W)

    def cache_bytes(self) -> int:
        """The bytes of the arrays the forward keeps for the backward (each buffer once; the parameters the ops'
        caches refer to are the model's, not activations, and are left out)."""
        from .numpy_job import held_bytes

        return held_bytes(self.c, self.P.flat)

    # ---- forward regions ---------------------------------------------------------------------------------------------
    def embed(self, x):
        from ..reference.encoder import encoder_forward

        T = x.shape[1]
        pos = self.positions(T)
        h, self.c["encoder"] = encoder_forward(x[:, pos], self.P["wte"], self.P["wpe"][pos])
        self.c["layers"], self.c["T"] = [], T
        return h

    def attn_in(self, l, h):
        """ln1, qkv on this rank's positions: the chunks for each rank j, its heads' columns (B, T/N, 3C/N)."""
        from ..reference.layernorm import layernorm_forward
        from ..reference.linear import linear_forward

        p, c = self.P, {}
        self.c["layers"].append(c)
        ln1, c["ln1"] = layernorm_forward(h, p["ln1w"][l], p["ln1b"][l])
        qkv, c["qkv"] = linear_forward(ln1, p["qkvw"][l], p["qkvb"][l])  # (B, T/N, 3C)
        return [np.ascontiguousarray(qkv[..., cols]) for cols in self.qkv_cols]

    def attn_core(self, l, parts):
        """parts[i]: rank i's positions of this rank's heads. Attention over the whole sequence; the chunks of atty
        (B, T/N, C/N) for each rank j, its positions."""
        from ..reference.attention import attention_forward

        qkv = np.concatenate(parts, axis=1)  # (B, T, 3C/N), positions in rank order
        atty, self.c["layers"][l]["attention"] = attention_forward(qkv, self.cfg.n_head // self.W)
        T = self.c["T"]
        return [np.ascontiguousarray(atty[:, j * T // self.W : (j + 1) * T // self.W]) for j in range(self.W)]

    def attn_out(self, l, h, parts):
        """parts[i]: rank i's heads at this rank's positions. attproj, the residual, the MLP: the block's output."""
        from ..reference.gelu import gelu_forward
        from ..reference.layernorm import layernorm_forward
        from ..reference.linear import linear_forward
        from ..reference.residual import residual_forward

        p, c = self.P, self.c["layers"][l]
        atty = np.concatenate(parts, axis=2)  # (B, T/N, C), heads in order
        att, c["attproj"] = linear_forward(atty, p["attprojw"][l], p["attprojb"][l])
        h = residual_forward(h, att)[0]
        ln2, c["ln2"] = layernorm_forward(h, p["ln2w"][l], p["ln2b"][l])
        fch, c["fc"] = linear_forward(ln2, p["fcw"][l], p["fcb"][l])
        fch_gelu, c["gelu"] = gelu_forward(fch)
        mlp, c["fcproj"] = linear_forward(fch_gelu, p["fcprojw"][l], p["fcprojb"][l])
        return residual_forward(h, mlp)[0]

    def head(self, h, y):
        """lnf, the tied head and the loss over this rank's positions, and at once their backward from dloss = 1/N:
        (the local mean loss, dh)."""
        from ..reference.crossentropy import crossentropy_backward, crossentropy_forward
        from ..reference.layernorm import layernorm_backward, layernorm_forward
        from ..reference.linear import linear_backward, linear_forward

        lnf, lnf_cache = layernorm_forward(h, self.P["lnfw"], self.P["lnfb"])
        logits, head_cache = linear_forward(lnf, self.P["wte"].T)
        loss, ce_cache = crossentropy_forward(logits, y[:, self.positions(self.c["T"])])
        self.c["head"], self.c["crossentropy"] = head_cache, ce_cache  # kept: the cache a rank holds at its peak
        dlogits = crossentropy_backward(1.0 / self.W, ce_cache)
        dlnf, dwte_head, _ = linear_backward(dlogits, head_cache)
        self.dwte_head = dwte_head.T  # a gradient, held until embed_back adds the embedding's part
        dh, self.G["lnfw"][...], self.G["lnfb"][...] = layernorm_backward(dlnf, lnf_cache)
        return float(loss), dh

    # ---- backward regions --------------------------------------------------------------------------------------------
    def out_back(self, l, dx):
        """The MLP's and attproj's backward: (dx of the residual stream so far, the chunks of d(atty) for each rank j:
        its heads' channels at this rank's positions (B, T/N, C/N))."""
        from ..reference.gelu import gelu_backward
        from ..reference.layernorm import layernorm_backward
        from ..reference.linear import linear_backward

        c, g, w = self.c["layers"][l], self.G, self.cfg.d_model // self.W
        dfch_gelu, g["fcprojw"][l], g["fcprojb"][l] = linear_backward(dx, c["fcproj"])
        dfch = gelu_backward(dfch_gelu, c["gelu"])
        dln2, g["fcw"][l], g["fcb"][l] = linear_backward(dfch, c["fc"])
        dx_ln2, g["ln2w"][l], g["ln2b"][l] = layernorm_backward(dln2, c["ln2"])
        dx = dx + dx_ln2
        datty, g["attprojw"][l], g["attprojb"][l] = linear_backward(dx, c["attproj"])
        return dx, [np.ascontiguousarray(datty[..., j * w : (j + 1) * w]) for j in range(self.W)]

    def core_back(self, l, parts):
        """parts[i]: d(atty) of this rank's heads at rank i's positions. Attention's backward over the whole
        sequence; the chunks of dqkv (B, T/N, 3C/N) for each rank j, its positions."""
        from ..reference.attention import attention_backward

        datty = np.concatenate(parts, axis=1)  # (B, T, C/N)
        dqkv = attention_backward(datty, self.c["layers"][l].pop("attention"))
        T = self.c["T"]
        return [np.ascontiguousarray(dqkv[:, j * T // self.W : (j + 1) * T // self.W]) for j in range(self.W)]

    def in_back(self, l, dx, parts):
        """parts[i]: dqkv of rank i's heads at this rank's positions. qkv's and ln1's backward: dx of the block's
        input."""
        from ..reference.layernorm import layernorm_backward
        from ..reference.linear import linear_backward

        c, g = self.c["layers"].pop(), self.G
        dqkv = np.empty(parts[0].shape[:2] + (3 * self.cfg.d_model,), FLOAT)
        for cols, part in zip(self.qkv_cols, parts):
            dqkv[..., cols] = part
        dln1, g["qkvw"][l], g["qkvb"][l] = linear_backward(dqkv, c["qkv"])
        dx_ln1, g["ln1w"][l], g["ln1b"][l] = layernorm_backward(dln1, c["ln1"])
        return dx + dx_ln1

    def embed_back(self, dh):
        from ..reference.encoder import encoder_backward

        dwte, dwpe = encoder_backward(dh, self.c["encoder"])
        self.G["wte"][...] = dwte + self.dwte_head  # weight tying: both uses, as gpt_backward
        self.G["wpe"][...] = 0
        self.G["wpe"][self.positions(self.c["T"])] = dwpe
        self.c, self.dwte_head = {}, None

    def update(self, lr, weight_decay, grad_clip):
        """The global norm of the (already summed) gradient, the clip factor, AdamW: as NumpyEngine."""
        from ..model.optim import adamw_update, clip_coefficient

        norm = math.sqrt(float(np.sum(np.square(self.G.flat, dtype=np.float64))))
        coef = clip_coefficient(norm, grad_clip)
        if coef != 1.0:
            self.G.flat[...] *= FLOAT(coef)
        self.t += 1
        adamw_update(
            self.P.flat, self.G.flat, self.m, self.v, self.t, lr, self.betas, self.eps, float(weight_decay), self.decay
        )
        return norm

    # ---- the step on ranks -------------------------------------------------------------------------------------------
    def train_step(self, x, y, lr, weight_decay=0.0, grad_clip=0.0) -> dict:
        """One step on this rank: x, y the global batch (B, T), the same on every rank. Returns (the same on every
        rank) {"loss", "grad_norm", "all_to_all" (elements of this rank's all-to-all buffers), "all_to_alls", "sent"
        (elements it sent), "cache_bytes" (its activations at the end of the forward), "seconds"}."""
        x, y = _check_batch("Ulysses.train_step", self.cfg, self.W, x, y)
        t0 = time.perf_counter()
        count = {"all_to_all": 0, "all_to_alls": 0, "sent": 0}

        def exchange(outgoing):
            (chunks,) = outgoing
            send = np.concatenate([a.reshape(-1) for a in chunks])
            recv = np.empty_like(send)
            self.comm.all_to_all(send, recv)
            n = chunks[0].size
            count["all_to_all"] += send.size
            count["all_to_alls"] += 1
            count["sent"] += send.size - n
            return [[recv[i * n : (i + 1) * n].reshape(chunks[0].shape) for i in range(self.W)]]

        (loss,), (peak,) = _forward_backward([self], x, y, exchange)
        self.comm.all_reduce(self.G.flat)  # each rank's gradient is its positions' share: the sum is the whole
        loss = float(self.comm.all_reduce_scalars([loss])[0]) / self.W
        norm = self.update(lr, weight_decay, grad_clip)
        return {"loss": loss, "grad_norm": norm, **count, "cache_bytes": peak, "seconds": time.perf_counter() - t0}


def _check_batch(fn, cfg, world, x, y):
    from .tensor import _check_batch as check

    x, y = check(fn, cfg, x, y)
    _check(fn, cfg, world, x.shape[1])
    return x, y


def _forward_backward(ranks, x, y, exchange):
    """The step's forward and backward on `ranks` (this rank alone, or all N in one process): each region on every
    rank, exchange(per rank: the chunks it sends to each rank) -> per rank: the chunks it received from each rank,
    between them. Returns (each rank's local mean loss, each rank's cache bytes at the end of its forward)."""
    L = ranks[0].cfg.n_layer
    hs = [r.embed(x) for r in ranks]
    for l in range(L):
        got = exchange([r.attn_in(l, h) for r, h in zip(ranks, hs)])  # qkv: positions -> heads
        got = exchange([r.attn_core(l, g) for r, g in zip(ranks, got)])  # atty: heads -> positions
        hs = [r.attn_out(l, h, g) for r, h, g in zip(ranks, hs, got)]
    out = [r.head(h, y) for r, h in zip(ranks, hs)]
    peaks = [r.cache_bytes() for r in ranks]
    losses, dxs = [o[0] for o in out], [o[1] for o in out]
    del hs, out
    for l in reversed(range(L)):
        pairs = [r.out_back(l, d) for r, d in zip(ranks, dxs)]
        dxs = [p[0] for p in pairs]
        got = exchange([r.core_back(l, g) for r, g in zip(ranks, exchange([p[1] for p in pairs]))])
        dxs = [r.in_back(l, d, g) for r, d, g in zip(ranks, dxs, got)]
    for r, d in zip(ranks, dxs):
        r.embed_back(d)
    return losses, peaks


def ulysses_ranks(cfg, world: int, params, betas=None, eps=None) -> list:
    """The N ranks' Ulysses objects in one process (each with its place, no communicator), for simulate_step."""
    N = _check("ulysses_ranks", cfg, world)
    return [Ulysses(cfg, _Rank(r, N), params, betas, eps) for r in range(N)]


def simulate_step(ranks, x, y, lr, weight_decay=0.0, grad_clip=0.0) -> dict:
    """train_step with all N ranks in one process: each all-to-all hands chunk j of rank i to rank j as its chunk
    i, the gradient's all-reduce is the sum in rank order. Returns {"loss", "grad_norm", "cache_bytes" ([N])}."""
    N = len(ranks)
    if not N or any(not isinstance(r, Ulysses) or r.rank != i or r.W != N for i, r in enumerate(ranks)):
        raise ValueError(f"simulate_step: pass ranks 0 .. N-1 of one world of N (ulysses_ranks), got {ranks}")
    x, y = _check_batch("simulate_step", ranks[0].cfg, N, x, y)

    def exchange(outgoing):
        return [[outgoing[i][j] for i in range(N)] for j in range(N)]

    losses, peaks = _forward_backward(ranks, x, y, exchange)
    total = ranks[0].G.flat.copy()
    for r in ranks[1:]:
        total += r.G.flat
    norms = []
    for r in ranks:
        r.G.flat[...] = total
        norms.append(r.update(lr, weight_decay, grad_clip))
    return {"loss": sum(losses) / N, "grad_norm": norms[0], "cache_bytes": peaks}


# ================================================================================================================
# The command: `python -m gpullm_lessons.parallel ulysses ...` on N ranks
# ================================================================================================================


def build_parser() -> argparse.ArgumentParser:
    from .numpy_job import job_parser

    p = job_parser(
        "python -m gpullm_lessons.parallel ulysses",
        "DeepSpeed-Ulysses sequence-parallel training of the NumPy GPT on CPU ranks (start the ranks with "
        "python -m gpullm_lessons.parallel.launch --nproc N --backend mpi)",
        json="losses, activations and traffic",
    )
    return p


def main(argv=None, comm=None) -> dict:
    """The ulysses command on this rank (comm: default the environment's). Returns the summary (on every rank);
    rank 0 prints each step and writes --json."""

    from ..model.params import init_params
    from ..train import ConfigError
    from .numpy_job import job_from_args, write_summary

    args = build_parser().parse_args(argv)

    def check(preset, B, comm):
        W, T = comm.world_size, preset["block_size"]
        if preset["n_head"] % W:
            raise ConfigError(
                f"--n-head {preset['n_head']} does not split over {W} ranks: attention runs n_head / N whole heads "
                f"per rank; pass a number of heads divisible by {W}"
            )
        if T % W:
            raise ConfigError(
                f"--block-size {T} does not split over {W} ranks: each rank takes T / N positions; pass a multiple "
                f"of {W}"
            )

    job = job_from_args(args, comm, check=check)
    cfg, B, comm = job.cfg, job.B, job.comm
    W, T = comm.world_size, cfg.block_size
    u = Ulysses(cfg, comm, init_params(cfg, seed=args.seed))
    traffic = ulysses_traffic(cfg, W, B, T)
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    say(
        f"ulysses: {W} rank(s) over {comm.name}, T={T} as {W} x {T // W} positions, nh={cfg.n_head} as {W} x "
        f"{cfg.n_head // W} heads in attention (L={cfg.n_layer}, C={cfg.d_model}, V={cfg.vocab_size}) | B={B} | "
        f"{args.steps} steps, lr {job.lr:g}"
    )
    say(
        f"traffic per step and rank: {traffic['all_to_alls']} all-to-alls of {traffic['all_to_all']:,} elements in "
        f"all, {traffic['sent']:,} of them sent; the gradient's all-reduce {traffic['grad_all_reduce']:,}"
    )
    losses, norms, caches, res = [], [], [], None
    for step, res in job.run(args.steps, lambda x, y, lr: u.train_step(x, y, lr, args.weight_decay, args.grad_clip)):
        per_rank = [int(v) for v in comm.gather_scalars([res["cache_bytes"]])[:, 0]]
        losses.append(res["loss"])
        norms.append(res["grad_norm"])
        caches.append(per_rank)
        say(
            f"step {step:4d} | loss {res['loss']:.6f} | grad norm {res['grad_norm']:.4f} | activations per rank "
            + " ".join(f"{b:,}" for b in per_rank)
            + f" B | {res['seconds'] * 1e3:.1f} ms"
        )
    replicas = comm.gather_scalars([float(np.sum(u.P.flat, dtype=np.float64))])[:, 0]
    summary = {
        "world": W,
        "losses": losses,
        "grad_norms": norms,
        "cache_bytes": caches,
        "traffic": traffic,
        "traffic_measured": {k: res[k] for k in ("all_to_all", "all_to_alls", "sent")} if res else None,
        "replicas_equal": bool(np.all(replicas == replicas[0])),
    }
    say(
        f"done: loss {losses[0]:.4f} -> {losses[-1]:.4f}; activations per rank {caches[-1] if caches else []} B; "
        f"parameters equal on every rank: {summary['replicas_equal']}"
    )
    write_summary(comm, args.json, summary)
    return summary


def cli(argv=None) -> int:
    """Command-line entry: configuration problems print one line and exit with status 2 (as the training job)."""
    from .numpy_job import run_cli

    return run_cli(main, argv)
