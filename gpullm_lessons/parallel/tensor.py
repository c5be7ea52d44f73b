"""Tensor parallelism (Megatron-LM's intra-layer model parallelism) of the NumPy GPT on CPU ranks: each block's four
linears split over N ranks, the whole batch on every rank, two all-reduces of the activations per block in each
direction.

    tp_shapes(cfg, world)                 this rank's shape of every tensor (the split ones 1/N, the others whole)
    TensorParallel(cfg, comm, params)     this rank's shards of the split weights, the replicated ones whole, their
                                          gradients and AdamW's m and v; and the step
    TensorParallel.train_step(x, y, lr, ...)   one step on this rank: x, y the GLOBAL batch (B, T), the same on every rank
    TensorParallel.full_params()          the whole model's flat parameters, gathered (a collective: every rank calls it)
    tp_ranks(cfg, world, params)          the N ranks' objects in one process (no communicator)
    simulate_step(ranks, x, y, lr, ...)   the same step with all N ranks in one process (the all-reduce a sum in rank order)
    tp_memory(cfg, world)                 the predicted bytes of params + grads + AdamW's m and v per rank
    tp_traffic(cfg, world, B, T)          the elements all-reduced per step (and the bytes a ring sends per rank)
    SequenceParallel(cfg, comm, params)   the same with Megatron's sequence parallelism (below): the regions outside
                                          the split linears on T/N positions, all-gathers and reduce-scatters along T

CLI (each rank runs it; start the ranks with the launcher or mpirun):
    python -m gpullm_lessons.parallel.launch --nproc 2 --backend mpi --module gpullm_lessons.parallel -- \\
        tensor --n-layer 4 --d-model 32 --steps 5

The split of each weight (N ranks, rank r; weights stored (in, out); nh heads of hs = C / nh channels; N divides nh):
    qkvw (C, 3C), qkvb (3C)   COLUMN-parallel: rank r holds the columns of heads [r nh/N, (r+1) nh/N). The packed
                              output is q | k | v, each C wide, so the rank takes its C/N columns from EACH of the
                              three: [r C/N, (r+1) C/N) + {0, C, 2C}, kept packed as q_r | k_r | v_r (C, 3C/N), which
                              is what attention_forward(qkv_r, nh / N) reads: the rank's heads, whole. Attention needs
                              no communication: a head's q, k and v are all on one rank.
    attprojw (C, C)           ROW-parallel: rank r holds rows [r C/N, (r+1) C/N), the channels of its heads in the
                              attention's output; x_r @ W_r is a partial sum of the full product (B, T, C).
    attprojb (C)              replicated: added ONCE, after the all-reduce of the partial sums (on every rank).
    fcw (C, 4C), fcb (4C)     COLUMN-parallel: columns [r 4C/N, (r+1) 4C/N); the GELU is elementwise, so it runs on
                              the rank's own 4C/N columns.
    fcprojw (4C, C)           ROW-parallel: rows [r 4C/N, (r+1) 4C/N); fcprojb replicated, added once after the
                              all-reduce.
    wte, wpe, ln1, ln2, lnf   replicated: every rank runs the embeddings, the LayerNorms, the residual adds, the tied
                              head and the loss on the full activations (B, T, C).

The f / g conjugate pair (Megatron's names). A column-parallel linear followed by a row-parallel one is one region:
    f   at its input: the identity in forward (every rank has the full LayerNorm output); all-reduce in backward
        (each rank's column shard gives only a partial d(input) = dout_r @ W_r^T: the sum over ranks is the whole).
    g   at its output: all-reduce in forward (the row-parallel partial products summed); the identity in backward
        (d(output) is the same full tensor on every rank, which is exactly what each rank's partial product needs).
Two regions per block (attention: qkv .. attproj; MLP: fc .. fcproj), so per block 2 all-reduces of B T C elements
in forward (g) and 2 in backward (f): 4 L B T C elements per step, each all-reduce on a ring sending
2 (N-1)/N x its bytes per rank. The tensors the all-reduces carry are activations, not weights.

Why the replicated parameters need no gradient communication. After each g all-reduce, every rank holds the same
full activation; every replicated op (LayerNorm, residual, the head, the loss, a row-parallel bias) then reads the
same inputs and the same parameters, so its output and, in backward, its incoming gradient (after each f all-reduce:
the same full d(input) on every rank) are the same everywhere: so are the gradients of the replicated parameters, and
AdamW (elementwise, the same clip factor) keeps them identical. (The all-reduce's result must be the same on every
rank, as MPI's implementations give it; the ranks test checks the replicated parameters bitwise equal across ranks.)
Data parallel all-reduces the gradients because each rank sees other rows; here every rank sees the whole batch.

Memory per rank, parameters + gradients + AdamW's m and v (fp32: 16 bytes per element this rank holds):
    16 x [ V C + T_max C + 2 C  +  L (6 C + (12 C^2 + 7 C) / N) ]
(the replicated: embeddings, final LayerNorm, per block ln1, ln2 (4C) and the two row-parallel biases (2C); the split:
qkv (3C^2 + 3C), attproj (C^2), fc (4C^2 + 4C), fcproj (4C^2), all over N). tp_memory computes it; TensorParallel's
step reports the bytes of the four arrays it really holds (params, grads, m, v: one flat array each of this rank's
elements) and the tests check measured == predicted. Not counted: activations (each rank keeps the full (B, T, C)
ones for the replicated ops and 1/N of the (B, T, 3C), (B, T, 4C) and attention ones), the decay mask.

Against ZeRO-3 (zero3.py): both hold ~1/N of the blocks' weights per rank, but ZeRO-3 all-gathers each unit's
weights before it computes (the weights travel, 3 Psi elements per step whatever the batch) and splits the batch,
while tensor parallelism never gathers a weight (they stay sharded during the compute) and moves activations instead:
4 L B T C elements per step, growing with the batch and the sequence, on the critical path (the next op waits for
the all-reduce), which is why it stays inside one NVLink node in practice. And it splits the compute of one sample
(each rank does 1/N of the block's matmuls), which ZeRO-3 does not; the embeddings, the head and the LayerNorms are
not split here (their memory and compute are replicated).

Numerics. One rank (SingleComm): the same reference ops in the same order as NumpyEngine (the row-parallel linear
adds its bias after the matmul, as linear_forward does), the same elementwise AdamW; the float64 sum of squares for
the norm runs tensor by tensor: the tests find the losses and parameters bitwise equal. N ranks: the row-parallel
products x_r @ W_r are summed over ranks (the matmul's sum over the input channels cut into N partial sums added in
another order, then the all-reduce's own order) and the f all-reduce sums the N partial input gradients the same way:
rounding of about 1e-7 relative in float32, carried through the blocks and by AdamW into the next steps. The tests
allow 1e-5 absolute on losses of about 5.5 nats over 3 steps (and 1e-5 on the parameters after them).

Sequence parallelism (Megatron's, SequenceParallel, the command's --sequence-parallel). Outside the split linears
every rank computes the same thing on the whole (B, T, C): the LayerNorms, the residual adds, the embeddings, the head
and the loss, each position on its own. SequenceParallel gives rank r only positions [r T/N, (r+1) T/N) there, and
each all-reduce of a region turns into two collectives along T that move the same elements:
    forward   the LayerNorm's output (B, T/N, C) is all-gathered along T before the column-parallel linear (f becomes
              an all_gather); the row-parallel linear's partial sums (B, T, C) are reduce-scattered along T (g becomes
              a reduce_scatter: rank r receives the sum of its positions), then the bias and the residual on T/N.
    backward  the gradient arriving at the row-parallel linear is all-gathered along T (the whole d(output) its
              weight gradient needs); the column-parallel linear's partial input gradients are reduce-scattered
              along T into the LayerNorm's backward on T/N positions.
The head and the loss run on the rank's positions (each rank's mean over B T/N tokens; the loss is their mean, so
backward starts from dloss = 1/N). The replicated parameters now see only their rank's positions: the gradients of
wte, wpe and the LayerNorms are partial sums, added by one all-reduce after the backward (the row-parallel biases'
come from the gathered, whole gradient and need none). What it saves: the LayerNorms' inputs and statistics and the
token ids, 1/N of them per rank: L 2 (B T C + 2 B T) + B T elements of one rank's activations become 1/N
(cache_bytes measures them; the tests check the saving is exactly (1 - 1/N) of that). The gathered LayerNorm output
the column-parallel linear reads is kept whole here; Megatron keeps the rank's part and gathers it again in backward.

Not here: a vocabulary-parallel embedding and head (with a parallel cross-entropy), overlap of the all-reduces with
compute, a GPU engine (NCCL).
This is the course's toy: every rank initialises the whole model (init_params, the one-rank values) and keeps its part.
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

from .numpy_job import whole_params

FLOAT = np.float32

# the split tensors: name -> (axis of one block's tensor that is split (0: rows, 1: columns; None: a bias), kind)
SPLIT = {
    "qkvw": (1, "qkv"),
    "qkvb": (0, "qkv"),
    "attprojw": (0, "rows"),
    "fcw": (1, "cols"),
    "fcb": (0, "cols"),
    "fcprojw": (0, "rows"),
}


# ================================================================================================================
# 1. The split and the memory model
# ================================================================================================================


def _check(fn, cfg, world):
    from ..model.params import GPTConfig

    if not isinstance(cfg, GPTConfig):
        raise TypeError(f"{fn}: cfg must be a GPTConfig, got {type(cfg).__name__}")
    if isinstance(world, bool) or not isinstance(world, (int, np.integer)) or world < 1:
        raise ValueError(f"{fn}: world must be a positive integer, got {world!r}")
    if cfg.n_head % world:
        raise ValueError(
            f"{fn}: n_head {cfg.n_head} does not split over {world} ranks: each rank takes n_head / N whole heads; "
            f"pass a world size that divides n_head"
        )
    return int(world)


def tp_shapes(cfg, world: int) -> dict:
    """name -> this rank's shape (the same on every rank), in the buffer's order: the split tensors 1/N along their
    split axis (module docstring), the others whole."""
    from ..model.params import param_shapes

    N = _check("tp_shapes", cfg, world)
    out = {}
    for name, shape in param_shapes(cfg).items():
        if name in SPLIT:
            ax = 1 + SPLIT[name][0]  # after the leading L axis
            shape = shape[:ax] + (shape[ax] // N,) + shape[ax + 1 :]
        out[name] = shape
    return out


def tp_memory(cfg, world: int) -> dict:
    """The predicted bytes per rank: {"elements" (this rank's parameters), "params", "grads" (4 B each), "optimizer"
    (AdamW's m and v, 8 B), "total" (16 B per element), "replicated" and "split" (elements), "dp" (16 Psi: a whole
    replica)}."""
    from ..model.params import num_params

    N = _check("tp_memory", cfg, world)
    V, T, L, C = cfg.vocab_size, cfg.block_size, cfg.n_layer, cfg.d_model
    replicated = V * C + T * C + 2 * C + L * 6 * C
    split = L * (12 * C * C + 7 * C) // N
    n = replicated + split
    assert n == sum(math.prod(s) for s in tp_shapes(cfg, N).values())
    return {
        "world": N,
        "elements": n,
        "replicated": replicated,
        "split": split,
        "params": 4 * n,
        "grads": 4 * n,
        "optimizer": 8 * n,
        "total": 16 * n,
        "dp": 16 * num_params(cfg),
    }


def tp_traffic(cfg, world: int, B: int, T: int) -> dict:
    """Per step: {"all_reduce" (elements all-reduced: 2 per block forward + 2 backward, B T C each = 4 L B T C),
    "all_reduces" (how many), "ring_bytes_per_rank" (2 (N-1)/N x 4 B per element: a ring all-reduce's sends)}."""
    N = _check("tp_traffic", cfg, world)
    n = 4 * cfg.n_layer * B * T * cfg.d_model
    return {
        "all_reduce": n,
        "all_reduces": 4 * cfg.n_layer,
        "ring_bytes_per_rank": int(round(2 * (N - 1) / N * 4 * n)),
    }


def _cols(name, cfg, N, r):
    """The indices, along the split axis of one block's tensor `name`, that rank r holds."""
    C = cfg.d_model
    axis, kind = SPLIT[name]
    if kind == "qkv":  # its heads' columns of each of q, k and v: packed q_r | k_r | v_r
        c = C // N
        return np.concatenate([np.arange(part * C + r * c, part * C + (r + 1) * c) for part in range(3)])
    n = (4 * C if name in ("fcw", "fcb", "fcprojw") else C) // N
    return np.arange(r * n, (r + 1) * n)


def shard_of(cfg, name, full, world, rank):
    """Rank `rank`'s part of tensor `name` (the whole (L, ...) tensor `full`): its shard, or the whole if replicated."""
    if name not in SPLIT:
        return np.array(full, FLOAT)
    return np.take(full, _cols(name, cfg, world, rank), axis=1 + SPLIT[name][0]).astype(FLOAT)


# ================================================================================================================
# 2. One rank's state and the regions of its step
# ================================================================================================================


class _Rank:
    """A rank of a simulation in one process: no communicator, only its place."""

    name = "simulated"

    def __init__(self, rank, world_size):
        self.rank, self.world_size = rank, world_size


class TensorParallel:
    """This rank's parameters (its shards of the split tensors, the replicated ones whole), their gradients and AdamW's
    m and v: one flat fp32 array each, with a named view per tensor (tp_shapes). params: the whole model's flat
    parameters (ParamBuffer or array: init_params(cfg, seed), the same on every rank)."""

    def __init__(self, cfg, comm, params, betas=None, eps=None):
        from ..model.optim import DECAY_NAMES
        from ..model.params import ParamBuffer, param_shapes
        from ..engine.core import BETAS, EPS

        self.cfg, self.comm = cfg, comm
        self.W, self.rank = comm.world_size, comm.rank
        _check("TensorParallel", cfg, self.W)
        flat = whole_params("TensorParallel", cfg, params)
        whole = ParamBuffer(cfg, dtype=np.float32)
        whole.flat[...] = flat
        self.shapes = tp_shapes(cfg, self.W)
        n = sum(math.prod(s) for s in self.shapes.values())
        self.params, self.grads = np.zeros(n, FLOAT), np.zeros(n, FLOAT)
        self.m, self.v = np.zeros(n, FLOAT), np.zeros(n, FLOAT)
        self.p, self.g, self.decay, a = {}, {}, np.zeros(n, bool), 0
        self.split_mask = np.zeros(n, bool)  # the elements of the split tensors (their squared norms summed over ranks)
        for name, shape in self.shapes.items():
            k = math.prod(shape)
            self.p[name] = self.params[a : a + k].reshape(shape)
            self.g[name] = self.grads[a : a + k].reshape(shape)
            self.p[name][...] = shard_of(cfg, name, whole[name], self.W, self.rank)
            self.decay[a : a + k] = name in DECAY_NAMES
            self.split_mask[a : a + k] = name in SPLIT
            a += k
        assert set(param_shapes(cfg)) == set(self.shapes)
        self.betas = tuple(float(b) for b in (BETAS if betas is None else betas))
        self.eps = float(EPS if eps is None else eps)
        self.t = 0
        self.c = {}

    def __repr__(self):
        return (
            f"TensorParallel(rank {self.rank}/{self.W}: {self.params.size:,} parameters per kind, "
            f"{int(self.split_mask.sum()):,} of them this rank's shards)"
        )

    def memory_bytes(self) -> int:
        """The bytes of what this rank holds: parameters, gradients, AdamW's m and v."""
        return int(sum(a.nbytes for a in (self.params, self.grads, self.m, self.v)))

    def cache_bytes(self) -> int:
        """The bytes of the activations the forward keeps for the backward (each array once, the parameters the ops'
        caches refer to left out)."""
        from .numpy_job import held_bytes

        return held_bytes(self.c, self.params)

    # ---- forward regions (per rank; the driver all-reduces between them) -------------------------------------------
    def embed(self, x):
        from ..reference.encoder import encoder_forward

        h, self.c["encoder"] = encoder_forward(x, self.p["wte"], self.p["wpe"])
        self.c["layers"] = []
        return h

    def attn_partial(self, l, h):
        """ln1 (replicated), qkv column-parallel, attention on this rank's heads, attproj row-parallel without its
        bias: this rank's partial sum (B, T, C) of attproj's product (g: all-reduced next)."""
        from ..reference.layernorm import layernorm_forward

        p, c = self.p, {}
        self.c["layers"].append(c)
        ln1, c["ln1"] = layernorm_forward(h, p["ln1w"][l], p["ln1b"][l])  # (B, T, C), the same on every rank
        return self.attn_core(l, ln1)

    def attn_core(self, l, ln1):
        """qkv column-parallel, attention on this rank's heads, attproj row-parallel without its bias, from the whole
        ln1 output (B, T, C): the partial sum (B, T, C)."""
        from ..reference.attention import attention_forward
        from ..reference.linear import linear_forward

        p, c = self.p, self.c["layers"][l]
        qkv, c["qkv"] = linear_forward(ln1, p["qkvw"][l], p["qkvb"][l])  # (B, T, 3C/N): q_r | k_r | v_r
        atty, c["attention"] = attention_forward(qkv, self.cfg.n_head // self.W)  # (B, T, C/N): this rank's heads
        part, c["attproj"] = linear_forward(atty, p["attprojw"][l])  # (B, T, C) partial
        return np.ascontiguousarray(part)

    def attn_finish(self, l, h, summed):
        """After g: the bias once, the residual."""
        from ..reference.residual import residual_forward

        return residual_forward(h, summed + self.p["attprojb"][l])[0]

    def mlp_partial(self, l, h):
        """ln2 (replicated), fc column-parallel, GELU on this rank's 4C/N columns, fcproj row-parallel without its
        bias: this rank's partial sum (B, T, C)."""
        from ..reference.layernorm import layernorm_forward

        p, c = self.p, self.c["layers"][l]
        ln2, c["ln2"] = layernorm_forward(h, p["ln2w"][l], p["ln2b"][l])
        return self.mlp_core(l, ln2)

    def mlp_core(self, l, ln2):
        """fc column-parallel, GELU on this rank's 4C/N columns, fcproj row-parallel without its bias, from the whole
        ln2 output (B, T, C): the partial sum (B, T, C)."""
        from ..reference.gelu import gelu_forward
        from ..reference.linear import linear_forward

        p, c = self.p, self.c["layers"][l]
        fch, c["fc"] = linear_forward(ln2, p["fcw"][l], p["fcb"][l])  # (B, T, 4C/N)
        fch_gelu, c["gelu"] = gelu_forward(fch)
        part, c["fcproj"] = linear_forward(fch_gelu, p["fcprojw"][l])  # (B, T, C) partial
        return np.ascontiguousarray(part)

    def mlp_finish(self, l, h, summed):
        from ..reference.residual import residual_forward

        return residual_forward(h, summed + self.p["fcprojb"][l])[0]

    def head(self, h, y, dloss=1.0):
        """The final LayerNorm, the tied head, the loss and at once their backward from dloss (all replicated):
        (loss, dh)."""
        from ..reference.crossentropy import crossentropy_backward, crossentropy_forward
        from ..reference.layernorm import layernorm_backward, layernorm_forward
        from ..reference.linear import linear_backward, linear_forward

        lnf, lnf_cache = layernorm_forward(h, self.p["lnfw"], self.p["lnfb"])
        logits, head_cache = linear_forward(lnf, self.p["wte"].T)  # (B, T, V)
        loss, ce_cache = crossentropy_forward(logits, y)
        dlogits = crossentropy_backward(dloss, ce_cache)
        dlnf, dwte_head, _ = linear_backward(dlogits, head_cache)  # (B, T, C), (C, V)
        self.dwte_head = dwte_head.T  # a gradient, held until the embedding backward adds its part
        dh, self.g["lnfw"][...], self.g["lnfb"][...] = layernorm_backward(dlnf, lnf_cache)
        return float(loss), dh

    # ---- backward regions ----------------------------------------------------------------------------------------
    def mlp_back_partial(self, l, dx):
        """fcproj's backward (g's backward: the identity; its bias's gradient from the full dout), the GELU's, fc's:
        this rank's partial d(ln2's output) (B, T, C) (f: all-reduced next)."""
        from ..reference.gelu import gelu_backward
        from ..reference.linear import linear_backward

        c, g = self.c["layers"][l], self.g
        dfch_gelu, g["fcprojw"][l], _ = linear_backward(dx, c["fcproj"])
        g["fcprojb"][l] = dx.reshape(-1, self.cfg.d_model).sum(axis=0)  # as linear_backward's dbias
        dfch = gelu_backward(dfch_gelu, c["gelu"])
        dln2, g["fcw"][l], g["fcb"][l] = linear_backward(dfch, c["fc"])
        return np.ascontiguousarray(dln2)

    def mlp_back_finish(self, l, dx, dln2):
        from ..reference.layernorm import layernorm_backward

        dx_ln2, self.g["ln2w"][l], self.g["ln2b"][l] = layernorm_backward(dln2, self.c["layers"][l]["ln2"])
        return dx + dx_ln2  # both paths into the block's middle residual stream

    def attn_back_partial(self, l, dx):
        from ..reference.attention import attention_backward
        from ..reference.linear import linear_backward

        c, g = self.c["layers"][l], self.g
        datty, g["attprojw"][l], _ = linear_backward(dx, c["attproj"])
        g["attprojb"][l] = dx.reshape(-1, self.cfg.d_model).sum(axis=0)
        dqkv = attention_backward(datty, c["attention"])  # (B, T, 3C/N)
        dln1, g["qkvw"][l], g["qkvb"][l] = linear_backward(dqkv, c["qkv"])
        return np.ascontiguousarray(dln1)

    def attn_back_finish(self, l, dx, dln1):
        from ..reference.layernorm import layernorm_backward

        c = self.c["layers"].pop()
        dx_ln1, self.g["ln1w"][l], self.g["ln1b"][l] = layernorm_backward(dln1, c["ln1"])
        return dx + dx_ln1

    def embed_back(self, dh):
        from ..reference.encoder import encoder_backward

        dwte, self.g["wpe"][...] = encoder_backward(dh, self.c["encoder"])
        self.g["wte"][...] = dwte + self.dwte_head  # weight tying: both uses (as gpt_backward)
        self.c = {}

    def sumsq(self) -> tuple:
        """(the split tensors' squared norm, the replicated ones'), float64, tensor by tensor."""
        split = rep = 0.0
        for name, g in self.g.items():
            s = float(np.sum(np.square(g, dtype=np.float64)))
            if name in SPLIT:
                split += s
            else:
                rep += s
        return split, rep

    def update(self, lr, weight_decay, coef):
        from ..model.optim import adamw_update

        if coef != 1.0:
            self.grads *= FLOAT(coef)
        self.t += 1
        adamw_update(
            self.params, self.grads, self.m, self.v, self.t, lr, self.betas, self.eps, float(weight_decay), self.decay
        )

    # ---- the step on ranks -----------------------------------------------------------------------------------------
    def norm_and_update(self, lr, weight_decay, grad_clip) -> float:
        """The global norm (the split tensors' squares summed over ranks, the replicated ones once), the clip factor,
        AdamW; returns the norm."""
        from ..model.optim import clip_coefficient

        split, rep = self.sumsq()
        split = float(self.comm.all_reduce_scalars([split])[0])
        norm = math.sqrt(max(split + rep, 0.0))
        self.update(lr, weight_decay, clip_coefficient(norm, grad_clip))
        return norm

    def train_step(self, x, y, lr, weight_decay=0.0, grad_clip=0.0) -> dict:
        """One step on this rank: x, y the global batch (B, T), the same on every rank (all of it goes through every
        rank). Returns (the same on every rank) {"loss", "grad_norm", "all_reduce" (elements this rank all-reduced),
        "all_reduces", "bytes" (this rank's params + grads + m + v), "seconds"}."""
        x, y = _check_batch("TensorParallel.train_step", self.cfg, x, y)
        t0 = time.perf_counter()
        count = {"all_reduce": 0, "all_reduces": 0}

        def all_reduce(bufs):
            (b,) = bufs
            self.comm.all_reduce(b)
            count["all_reduce"] += b.size
            count["all_reduces"] += 1

        loss = _forward_backward([self], x, y, all_reduce)[0]
        norm = self.norm_and_update(lr, weight_decay, grad_clip)
        return {
            "loss": loss,
            "grad_norm": norm,
            **count,
            "bytes": self.memory_bytes(),
            "cache_bytes": self.peak_cache,
            "seconds": time.perf_counter() - t0,
        }

    def full_params(self) -> np.ndarray:
        """The whole model's flat parameters in ParamBuffer's layout (the split tensors all-gathered: a collective)."""
        from ..model.params import ParamBuffer

        out = ParamBuffer(self.cfg, dtype=np.float32)
        for name, local in self.p.items():
            if name not in SPLIT:
                out[name][...] = local
                continue
            ax = 1 + SPLIT[name][0]
            mine = np.ascontiguousarray(np.moveaxis(local, ax, 0))
            every = np.empty((self.W,) + mine.shape, FLOAT)
            self.comm.all_gather(mine.reshape(-1), every.reshape(-1))
            _place(self.cfg, name, out[name], [every[r] for r in range(self.W)], self.W)
        return out.flat.copy()

    def replicated(self) -> np.ndarray:
        """This rank's replicated parameters, one flat copy (equal on every rank: module docstring)."""
        return self.params[~self.split_mask].copy()


def _place(cfg, name, full, parts, N):
    """Write the ranks' parts (each with the split axis moved first) into the whole tensor `full`."""
    ax = 1 + SPLIT[name][0]
    for r, part in enumerate(parts):
        idx = [slice(None)] * full.ndim
        idx[ax] = _cols(name, cfg, N, r)
        full[tuple(idx)] = np.moveaxis(part, 0, ax)


def _check_batch(fn, cfg, x, y):
    x, y = np.asarray(x), np.asarray(y)
    if x.ndim != 2 or y.shape != x.shape:
        raise ValueError(f"{fn}: x and y must be (B, T) token ids of one shape, got {x.shape}, {y.shape}")
    if x.shape[1] > cfg.block_size:
        raise ValueError(f"{fn}: T={x.shape[1]} is longer than block_size={cfg.block_size}")
    for name, a in (("x", x), ("y", y)):
        if not np.issubdtype(a.dtype, np.integer) or (a.size and (a.min() < 0 or a.max() >= cfg.vocab_size)):
            raise ValueError(f"{fn}: {name} must hold token ids in [0, {cfg.vocab_size})")
    return x.astype(np.int32), y.astype(np.int32)


def _forward_backward(ranks, x, y, all_reduce) -> list:
    """The step's forward and backward on `ranks` (this rank alone, or all N in one process), each region on every
    rank, all_reduce(list of one buffer per rank) in place between them (g in forward, f in backward). Returns each
    rank's loss (the same)."""
    L = ranks[0].cfg.n_layer
    hs = [r.embed(x) for r in ranks]
    for l in range(L):
        parts = [r.attn_partial(l, h) for r, h in zip(ranks, hs)]
        all_reduce(parts)  # g: the row-parallel attproj's partial sums
        hs = [r.attn_finish(l, h, s) for r, h, s in zip(ranks, hs, parts)]
        parts = [r.mlp_partial(l, h) for r, h in zip(ranks, hs)]
        all_reduce(parts)  # g: fcproj's
        hs = [r.mlp_finish(l, h, s) for r, h, s in zip(ranks, hs, parts)]
    out = [r.head(h, y) for r, h in zip(ranks, hs)]
    for r in ranks:
        r.peak_cache = r.cache_bytes()
    losses, dhs = [o[0] for o in out], [o[1] for o in out]
    del hs, out
    for l in reversed(range(L)):
        parts = [r.mlp_back_partial(l, d) for r, d in zip(ranks, dhs)]
        all_reduce(parts)  # f: fc's partial input gradients
        dhs = [r.mlp_back_finish(l, d, s) for r, d, s in zip(ranks, dhs, parts)]
        parts = [r.attn_back_partial(l, d) for r, d in zip(ranks, dhs)]
        all_reduce(parts)  # f: qkv's
        dhs = [r.attn_back_finish(l, d, s) for r, d, s in zip(ranks, dhs, parts)]
    for r, d in zip(ranks, dhs):
        r.embed_back(d)
    return losses


class SequenceParallel(TensorParallel):
    """Tensor parallelism with Megatron's sequence parallelism on top: the regions outside the split linears (the
    LayerNorms, the residual adds, the embeddings, the head and the loss) run on this rank's T/N positions only,
    and each all-reduce of plain tensor parallelism becomes a pair (the module docstring's "Sequence parallelism").
    The same parameters, shards and optimizer as TensorParallel."""

    def positions(self, T: int) -> slice:
        return slice(self.rank * T // self.W, (self.rank + 1) * T // self.W)

    def embed(self, x):
        from ..reference.encoder import encoder_forward

        pos = self.positions(x.shape[1])
        h, self.c["encoder"] = encoder_forward(x[:, pos], self.p["wte"], self.p["wpe"][pos])
        self.c["layers"], self.c["T"] = [], x.shape[1]
        return h

    def ln1(self, l, h):
        from ..reference.layernorm import layernorm_forward

        c = {}
        self.c["layers"].append(c)
        out, c["ln1"] = layernorm_forward(h, self.p["ln1w"][l], self.p["ln1b"][l])  # (B, T/N, C)
        return np.ascontiguousarray(out)

    def ln2(self, l, h):
        from ..reference.layernorm import layernorm_forward

        c = self.c["layers"][l]
        out, c["ln2"] = layernorm_forward(h, self.p["ln2w"][l], self.p["ln2b"][l])
        return np.ascontiguousarray(out)

    def embed_back(self, dh):
        from ..reference.encoder import encoder_backward

        dwte, dwpe = encoder_backward(dh, self.c["encoder"])
        self.g["wte"][...] = dwte + self.dwte_head
        self.g["wpe"][...] = 0
        self.g["wpe"][self.positions(self.c["T"])] = dwpe
        self.c = {}

    def partial_mask(self):
        """The elements whose gradients are sums over this rank's positions only (the replicated tensors but the
        row-parallel biases, which backward computes from the gathered, whole gradient)."""
        mask = ~self.split_mask.copy()
        a = 0
        for name, shape in self.shapes.items():
            k = math.prod(shape)
            if name in ("attprojb", "fcprojb"):
                mask[a : a + k] = False
            a += k
        return mask

    def train_step(self, x, y, lr, weight_decay=0.0, grad_clip=0.0) -> dict:
        """As TensorParallel's, the all-reduces replaced by all-gathers and reduce-scatters along T, then one
        all-reduce of the replicated gradients that are sums over positions."""
        x, y = _check_batch("SequenceParallel.train_step", self.cfg, x, y)
        if x.shape[1] % self.W:
            raise ValueError(
                f"SequenceParallel.train_step: T={x.shape[1]} positions do not split over {self.W} ranks; pass a "
                f"sequence length divisible by {self.W}"
            )
        t0 = time.perf_counter()
        count = {"all_gather": 0, "reduce_scatter": 0, "collectives": 0}
        N = self.W

        def all_gather(bufs):
            (b,) = bufs
            out = np.empty((N,) + b.shape, FLOAT)
            self.comm.all_gather(b.reshape(-1), out.reshape(-1))
            count["all_gather"] += out.size
            count["collectives"] += 1
            return [np.ascontiguousarray(np.concatenate(list(out), axis=1))]  # rank r's positions at [r T/N, ...)

        def reduce_scatter(bufs):
            (b,) = bufs
            B, T, C = b.shape
            send = np.ascontiguousarray(b.reshape(B, N, T // N, C).transpose(1, 0, 2, 3))  # chunk r: rank r's positions
            out = np.empty((B, T // N, C), FLOAT)
            self.comm.reduce_scatter(send.reshape(-1), out.reshape(-1))
            count["reduce_scatter"] += send.size
            count["collectives"] += 1
            return [out]

        (loss,) = _sp_forward_backward([self], x, y, all_gather, reduce_scatter)
        mask = self.partial_mask()
        partial = np.ascontiguousarray(self.grads[mask])
        self.comm.all_reduce(partial)  # sums over every rank's positions
        self.grads[mask] = partial
        loss = float(self.comm.all_reduce_scalars([loss])[0]) / N
        norm = self.norm_and_update(lr, weight_decay, grad_clip)
        return {
            "loss": loss,
            "grad_norm": norm,
            **count,
            "grad_all_reduce": int(partial.size),
            "bytes": self.memory_bytes(),
            "cache_bytes": self.peak_cache,
            "seconds": time.perf_counter() - t0,
        }


def _sp_forward_backward(ranks, x, y, all_gather, reduce_scatter) -> list:
    """SequenceParallel's forward and backward on `ranks` (this rank alone, or all N in one process): all_gather(per
    rank (B, T/N, C)) -> per rank (B, T, C) and reduce_scatter(per rank (B, T, C)) -> per rank (B, T/N, C) of the
    sum, both along T, between the regions. Returns each rank's local mean loss."""
    L, N, T = ranks[0].cfg.n_layer, ranks[0].W, x.shape[1]
    hs = [r.embed(x) for r in ranks]
    for l in range(L):
        full = all_gather([r.ln1(l, h) for r, h in zip(ranks, hs)])
        parts = reduce_scatter([r.attn_core(l, f) for r, f in zip(ranks, full)])
        hs = [r.attn_finish(l, h, s) for r, h, s in zip(ranks, hs, parts)]
        full = all_gather([r.ln2(l, h) for r, h in zip(ranks, hs)])
        parts = reduce_scatter([r.mlp_core(l, f) for r, f in zip(ranks, full)])
        hs = [r.mlp_finish(l, h, s) for r, h, s in zip(ranks, hs, parts)]
    out = [r.head(h, y[:, r.positions(T)], 1.0 / N) for r, h in zip(ranks, hs)]
    for r in ranks:
        r.peak_cache = r.cache_bytes()
    losses, dhs = [o[0] for o in out], [o[1] for o in out]
    del hs, out
    for l in reversed(range(L)):
        parts = reduce_scatter([r.mlp_back_partial(l, f) for r, f in zip(ranks, all_gather(dhs))])
        dhs = [r.mlp_back_finish(l, d, s) for r, d, s in zip(ranks, dhs, parts)]
        parts = reduce_scatter([r.attn_back_partial(l, f) for r, f in zip(ranks, all_gather(dhs))])
        dhs = [r.attn_back_finish(l, d, s) for r, d, s in zip(ranks, dhs, parts)]
    for r, d in zip(ranks, dhs):
        r.embed_back(d)
    return losses


# ================================================================================================================
# 3. All N ranks in one process
# ================================================================================================================


def tp_ranks(cfg, world: int, params, betas=None, eps=None, sequence=False) -> list:
    """The N ranks' TensorParallel objects (sequence=True: SequenceParallel) in one process (each with its place, no
    communicator), for simulate_step."""
    N = _check("tp_ranks", cfg, world)
    kind = SequenceParallel if sequence else TensorParallel
    return [kind(cfg, _Rank(r, N), params, betas, eps) for r in range(N)]


def simulate_step(ranks, x, y, lr, weight_decay=0.0, grad_clip=0.0) -> dict:
    """train_step with all N ranks in one process (tp_ranks): each all-reduce the sum of the ranks' buffers in rank
    order, given to every rank (SequenceParallel ranks: the all-gathers concatenate their positions, the
    reduce-scatters sum in rank order and hand each rank its positions, then the partial gradients are
    all-reduced). Returns {"loss", "grad_norm", "all_reduce" (elements per rank), "all_reduces", "bytes" (per rank:
    [N values]), "cache_bytes"}."""
    from ..model.optim import clip_coefficient

    N = len(ranks)
    if not N or any(not isinstance(r, TensorParallel) or r.rank != i or r.W != N for i, r in enumerate(ranks)):
        raise ValueError(
            f"simulate_step: pass ranks 0 .. N-1 of one world of N (tp_ranks(cfg, N, params)), got {ranks}"
        )
    x, y = _check_batch("simulate_step", ranks[0].cfg, x, y)
    count = {"all_reduce": 0, "all_reduces": 0}

    def all_reduce(bufs):
        total = bufs[0].copy()
        for b in bufs[1:]:
            total += b
        for b in bufs:
            b[...] = total
        count["all_reduce"] += total.size
        count["all_reduces"] += 1

    if isinstance(ranks[0], SequenceParallel):  # all-gathers and reduce-scatters along T, then the partial gradients
        T = x.shape[1]
        if T % N:
            raise ValueError(f"simulate_step: T={T} positions do not split over {N} ranks")

        def all_gather(bufs):
            return [np.ascontiguousarray(np.concatenate(bufs, axis=1))] * N

        def reduce_scatter(bufs):
            total = bufs[0].copy()
            for b in bufs[1:]:  # in rank order, as all_reduce above
                total += b
            return [np.ascontiguousarray(total[:, r * T // N : (r + 1) * T // N]) for r in range(N)]

        losses = _sp_forward_backward(ranks, x, y, all_gather, reduce_scatter)
        mask = ranks[0].partial_mask()
        partial = [np.ascontiguousarray(r.grads[mask]) for r in ranks]
        all_reduce(partial)
        for r, g in zip(ranks, partial):
            r.grads[mask] = g
        loss = sum(losses) / N
    else:
        losses = _forward_backward(ranks, x, y, all_reduce)
        assert all(v == losses[0] for v in losses)
        loss = losses[0]
    sq = [r.sumsq() for r in ranks]
    norm = math.sqrt(max(sum(s for s, _ in sq) + sq[0][1], 0.0))  # the shards' summed, the replicated once
    coef = clip_coefficient(norm, grad_clip)
    for r in ranks:
        r.update(lr, weight_decay, coef)
    return {
        "loss": loss,
        "grad_norm": norm,
        **count,
        "bytes": [r.memory_bytes() for r in ranks],
        "cache_bytes": [r.peak_cache for r in ranks],
    }


def simulated_full_params(ranks, which="p") -> np.ndarray:
    """The whole model's flat parameters (which="g": gradients) from the N simulated ranks' parts (full_params
    without the all_gather)."""
    from ..model.params import ParamBuffer

    cfg, N = ranks[0].cfg, len(ranks)
    out = ParamBuffer(cfg, dtype=np.float32)
    for name in ranks[0].p:
        if name not in SPLIT:
            out[name][...] = getattr(ranks[0], which)[name]
            continue
        ax = 1 + SPLIT[name][0]
        _place(cfg, name, out[name], [np.moveaxis(getattr(r, which)[name], ax, 0) for r in ranks], N)
    return out.flat.copy()


# ================================================================================================================
# 4. The command: `python -m gpullm_lessons.parallel tensor ...` on N ranks
# ================================================================================================================


def build_parser() -> argparse.ArgumentParser:
    """The tensor command's flags: the training job's (numpy_job.job_parser) and --json."""
    from .numpy_job import job_parser

    p = job_parser(
        "python -m gpullm_lessons.parallel tensor",
        "Megatron-style tensor-parallel training of the NumPy GPT on CPU ranks (start the ranks with "
        "python -m gpullm_lessons.parallel.launch --nproc N --backend mpi)",
        json="losses, memory and traffic",
    )
    p.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="Megatron's sequence parallelism on top: LayerNorms, residuals, embeddings and the loss on T/N positions",
    )
    return p


def main(argv=None, comm=None) -> dict:
    """The tensor command on this rank (comm: default the environment's). Returns the summary (on every rank); rank 0
    prints each step's loss, the elements all-reduced and every rank's bytes, and writes --json."""

    from ..model.params import init_params
    from ..train import ConfigError
    from .numpy_job import job_from_args, write_summary

    args = build_parser().parse_args(argv)

    def check(preset, B, comm):
        W = comm.world_size
        if preset["n_head"] % W:
            raise ConfigError(
                f"--n-head {preset['n_head']} does not split over {W} ranks: each rank takes n_head / N whole heads "
                f"(and 4 d_model / N MLP columns); pass a number of heads divisible by {W}"
            )

    job = job_from_args(args, comm, check=check)
    cfg, B, lr, comm = job.cfg, job.B, job.lr, job.comm
    W, T = comm.world_size, cfg.block_size
    if args.sequence_parallel and T % W:
        raise ConfigError(
            f"--block-size {T} does not split over {W} ranks: sequence parallelism gives each rank T / N positions; "
            f"pass a multiple of {W}"
        )
    kind = SequenceParallel if args.sequence_parallel else TensorParallel
    tp = kind(cfg, comm, init_params(cfg, seed=args.seed))
    model, traffic = tp_memory(cfg, W), tp_traffic(cfg, W, B, T)
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    say(
        f"tensor: {W} rank(s) over {comm.name}, L={cfg.n_layer} (C={cfg.d_model}, nh={cfg.n_head} as {W} x "
        f"{cfg.n_head // W} heads, T={T}, V={cfg.vocab_size}) | B={B} on every rank | {args.steps} steps, lr {lr:g}"
    )
    say(
        f"memory per rank (model): 16 x ({model['replicated']:,} replicated + {model['split']:,} split) = "
        f"{model['total']:,} B; one whole replica {model['dp']:,} B"
    )
    say(
        f"traffic per step: {traffic['all_reduces']} all-reduces of B*T*C = {B * T * cfg.d_model:,} elements "
        f"(2 per block forward, 2 backward) = {traffic['all_reduce']:,} elements, a ring sends "
        f"{traffic['ring_bytes_per_rank']:,} B per rank"
    )
    if args.sequence_parallel:
        say(
            f"sequence parallel: T={T} as {W} x {T // W} positions outside the split linears; each all-reduce becomes "
            f"an all-gather and a reduce-scatter along T (the same elements), plus one all-reduce of the replicated "
            f"gradients"
        )
    losses, norms, mem, caches, res = [], [], [], [], None
    for step, res in job.run(args.steps, lambda x, y, lr: tp.train_step(x, y, lr, args.weight_decay, args.grad_clip)):
        per_rank = [int(v) for v in comm.gather_scalars([res["bytes"]])[:, 0]]
        losses.append(res["loss"])
        norms.append(res["grad_norm"])
        mem.append(per_rank)
        caches.append([int(v) for v in comm.gather_scalars([res["cache_bytes"]])[:, 0]])
        if args.sequence_parallel:
            moved = (
                f"all-gathered {res['all_gather']:,} + reduce-scattered {res['reduce_scatter']:,} elements in "
                f"{res['collectives']}, replicated gradients {res['grad_all_reduce']:,} | activations per rank "
                + " ".join(f"{b:,}" for b in caches[-1])
                + " B"
            )
        else:
            moved = f"all-reduced {res['all_reduce']:,} elements in {res['all_reduces']}"
        say(
            f"step {step:4d} | loss {res['loss']:.6f} | grad norm {res['grad_norm']:.4f} | {moved} | bytes per rank "
            + " ".join(f"{b:,}" for b in per_rank)
            + f" | {res['seconds'] * 1e3:.1f} ms"
        )
    # the replicated parameters, bitwise the same on every rank (rank 0's broadcast, compared on each)
    rep = tp.replicated()
    ref = rep.copy()
    comm.broadcast(ref, root=0)
    mismatched = comm.all_reduce_scalars([0.0 if np.array_equal(rep, ref) else 1.0])[0]
    summary = {
        "world": W,
        "losses": losses,
        "grad_norms": norms,
        "bytes": mem,
        "memory_model": model,
        "traffic": traffic,
        "replicated_equal": bool(mismatched == 0),
        "cache_bytes": caches,
    }
    if args.sequence_parallel:
        keys = ("all_gather", "reduce_scatter", "collectives", "grad_all_reduce")
        summary.update(sequence_parallel=True)
    else:
        keys = ("all_reduce", "all_reduces")
    summary["traffic_measured"] = {k: res[k] for k in keys} if res else None
    say(
        f"done: loss {losses[0]:.4f} -> {losses[-1]:.4f}; bytes per rank {mem[-1]} (model {model['total']:,}); "
        f"replicated parameters equal on every rank: {summary['replicated_equal']}"
        if losses
        else "done: no steps"
    )
    write_summary(comm, args.json, summary)
    return summary


def cli(argv=None) -> int:
    """Command-line entry: configuration problems print one line and exit with status 2 (as the training job)."""
    from .numpy_job import run_cli

    return run_cli(main, argv)
