"""ZeRO-3 (fully sharded data parallel, FSDP): parameters, gradients and AdamW's m and v each 1/N per rank, for the
NumPy GPT on CPU ranks; every rank runs data parallel on its rows of the batch and gathers a unit's parameters only
while that unit computes.

    zero3_units(cfg)                     the units: [embeddings (wte, wpe), block 0, ..., block L-1, final LayerNorm]
    Zero3(cfg, comm, params, align=64)   this rank's shards of every unit (params, grads, m, v) and the step
    Zero3.train_step(x, y, lr, ...)      one step: x, y the GLOBAL batch (B, T); rank r takes rows [rB/N, (r+1)B/N)
    Zero3.full_params()                  the whole model's flat parameters, gathered (a collective: every rank calls it)
    zero3_memory(cfg, world, align)      the predicted peak bytes of params + grads + optimizer state per rank
    zero3_traffic(cfg, world, align)     the elements all-gathered and reduce-scattered per step (and DP's all-reduce)
    ZeroPP(cfg, comm, params, align, block=256)   ZeRO++'s qwZ + qgZ: Zero3 whose gathers and reduce move int8 blocks
    zeropp_traffic(cfg, world, align, block)      its bytes per step, predicted, against ZeRO-3's fp32 bytes
    ZeroPP(..., node=k), hpz_model(cfg, world, k)  ZeRO++'s hpZ: the second gathers inside nodes of k ranks

CLI (each rank runs it; start the ranks with the launcher or mpirun):
    python -m gpullm_lessons.parallel.launch --nproc 2 --backend mpi --module gpullm_lessons.parallel -- \\
        zero3 --n-layer 4 --d-model 32 --steps 5

What is sharded. A unit is a group of parameters gathered together: the embeddings (wte, wpe), each block l (the l-th
slice of each of its twelve (L, ...) tensors: params.layer_segments), and the final LayerNorm (lnfw, lnfb). Each
unit's n_u parameters, in that order, form one flat vector, padded with zeros to N x S_u elements where
S_u = shard_size(n_u, N, align) (the course's shard cut of ZeRO-1, unit by unit); rank r owns elements
[r S_u, (r+1) S_u) of it. A rank holds, for every unit, only its shard of the fp32 parameters, of the (reduced, mean)
gradient and of AdamW's m and v, each one flat array of S = sum_u S_u elements (the units' shards one after another).
The padding starts at zero, gets a zero gradient and no weight decay, and so stays zero.

The step (as the ZeRO paper's stage 3 and PyTorch's FSDP, without prefetch):
    forward   embeddings: all_gather the unit, encoder on this rank's rows, free the gathered parameters.
              block l (l = 0 .. L-1): all_gather, blocks_forward over that one block, free. Its cache keeps the
              activations the backward needs (the inputs of its LayerNorms and linears, their means and 1/std, the
              attention's qkv and probabilities, the GELU's input), never the parameters: the reference ops' caches
              hold a reference to their weight, which is dropped here and put back from the second gather.
    head      all_gather the final LayerNorm and the embeddings again (the tied head reads wte): LayerNorm, logits,
              loss, and at once its backward (dlogits, the head, the LayerNorm: the head's forward and backward run
              together, so its parameters are gathered once). The final unit's gradient is reduce-scattered at once.
    backward  block l (l = L-1 .. 0): all_gather again, blocks_backward over the block into a full-size gradient of
              the unit, reduce_scatter it at once (the sum over ranks; then x 1/N: the mean, as data parallel) into
              this rank's gradient shard, free the gathered parameters and the full gradient.
              embeddings: the encoder's backward needs no parameter (a scatter-add at the token ids), so no gather.
    update    the global norm (one all_reduce of the shards' float64 squared norms, with the loss: the padding adds
              0), the clip factor, AdamW (optim.adamw_update, NumpyEngine's arithmetic, with its betas and eps) on the
              shards, the decay rule cut per shard as optim.shard_decay_table cuts it for ZeRO-1.

The tied wte. Its gradient has two parts: the head's (dlogits^T lnf, computed first, in the head's backward) and the
embedding's (the scatter-add, computed last). Both belong to the embedding unit, so both are written into ONE full-size
gradient buffer of that unit: the head writes its part into it during the head's backward and the buffer stays
alive through the blocks' backward; the encoder's backward adds its part into the same buffer; only then is the unit
reduce-scattered, once. Rank r's shard therefore receives sum over ranks of (head + embedding), the one-rank
backward's sum (gpt_backward adds the two parts before anything else). The price: the embedding unit's full gradient
is held through the whole backward (it is in the memory formula below).

Bytes moved per step, in parameters (Psi = the model's parameters, padding aside; each collective of n elements on a
ring sends (N-1)/N x n per rank): all_gather of every unit twice (forward and backward; the embeddings' second
gather is the head's, the final LayerNorm's only gather serves its forward and backward at once, 2C fewer) and
reduce_scatter of every unit once: 3 Psi, against plain data parallel's all-reduce of the gradient, 2 Psi
(= reduce_scatter + all_gather). ZeRO-3 moves 1.5x the bytes of data parallel to hold 1/N of the model state.

Memory, per rank, of parameters + gradients + optimizer state (fp32: 4 B params + 4 B grads + 8 B m and v):
    16 S  (the shards, S ~ Psi / N)  +  4 x (the most gathered elements alive at once)
The gathered elements alive at once: in the forward one unit's parameters; in the head the embeddings' and final
LayerNorm's parameters plus the embeddings' full gradient (written while wte is still gathered), then that gradient
and the final LayerNorm's; in block l's backward the embeddings' held gradient, the block's parameters and its full
gradient. zero3_memory computes the peak exactly; Zero3 measures it on the arrays it allocates (each registered with
a weakref whose callback subtracts its bytes when NumPy frees it, so an array still referenced, e.g. by a cache,
counts until it really goes) and the tests check measured == predicted. Not counted: activations, the decay mask
(1 byte per shard element), and the reference ops' own temporaries (each returns a weight's gradient as a new array
that is copied into the unit's buffer and dropped at once: at most one tensor, e.g. the head's V x C).

Numerics. One rank (SingleComm) runs NumpyEngine's step on the same ops: the same forward and backward, the same
elementwise AdamW; the only difference is the order of the float64 sum of squares for the norm (unit by unit instead
of the flat buffer), which changes the float32 clip factor only if it lands within 1e-16 of a float32 rounding
boundary: the tests find the losses and parameters bitwise equal. On N ranks, against the one-rank job, as data
parallel: each rank's gradient is the mean over its B/N rows (a different order of the same additions than the mean
over B), the reduce_scatter sums the N ranks' gradients in MPI's order and then x 1/N, and the loss is the mean of
the N local means; each a rounding difference of about 1e-7 relative in float32, carried by AdamW into the next
steps. The tests allow 1e-5 absolute on losses of about 5.5 nats over 3 steps.

This is the course's toy: every rank initialises the whole model (init_params, the one-rank values) and keeps only its
shards. Not here: prefetching the next unit's all_gather during this unit's compute (FSDP's forward and backward
prefetch, which needs non-blocking collectives) and a GPU engine (NCCL, the half copy gathered in bf16). ZeRO++'s
quantised all_gather (qwZ) and quantised gradient reduce-scatter (qgZ), int8 blocks, and its hierarchical partition
(hpZ): ZeroPP, below.

ZeRO++ (ZeroPP, the command's --quantized): the quantised communication of ZeRO++ on top of the above, its qwZ
(the parameters' all-gathers move int8 blocks) and qgZ (the gradients' reduce-scatter moves int8 blocks); the
master shards, the gradients' shards and AdamW stay fp32.

The int8 blocks are lesson 12's (model/quant.py, reused: quantize_blockwise / dequantize_blockwise, signed): a flat
vector cut into blocks of `block` consecutive values (default quant.BLOCK = 256), each kept as its fp32 absmax a and
every value as round(x / a * 127) in int8, read back as q / 127 * a.

qwZ, the weights' all-gather (ZeroPP.gather): each rank quantises its fp32 shard of unit u (S_u values, in
ceil(S_u / block) blocks that never cross the shard's edge), packs the codes and the scales into one byte message of
S_u + 4 ceil(S_u / block) bytes, all_gathers the messages (a byte all_gather: comm.py's all_gather moves any dtype)
and dequantises each rank's part into the fp32 buffer the unit computes with. Every rank, its own shard included,
computes with the dequantised copy, so all ranks run the same model. The master shard is never rounded: AdamW
updates the fp32 values, only the communicated copy is int8.

qgZ, the gradients' reduce-scatter (ZeroPP.reduce): the unit's full local gradient (N x S_u) is cut into N chunks,
chunk d destined for rank d; each chunk is quantised in blocks (its own scales), packed as above, and exchanged with
an all-to-all (comm.Communicator.all_to_all: N - 1 rounds of sendrecv, round k sending chunk (r + k) mod N to rank
r + k and receiving from rank r - k: each rank sends N - 1 messages and receives N - 1, never the gathered whole,
which an all_gather of every chunk would move: N times more). The rank's own chunk is quantised and read back too (as
the all-to-all would deliver it to itself), so the shard receives sum_r Q(g_r) with every term treated alike; the
sum runs in rank order 0, 1, ..., N - 1 (the same on every rank, whatever order the messages arrive in), in fp32,
then x 1/N (the mean, as data parallel).

Bytes per step (zeropp_traffic; what the step counts, in the keys "all_gather_bytes", "reduce_scatter_bytes"): each
collective's size, as zero3_traffic counts elements: the gathers 2 x (embeddings and blocks) + 1 x final LayerNorm
of N (S_u + 4 ceil(S_u / block)) bytes, the reduce-scatter each unit once, N (S_u + 4 ceil(S_u / block)) bytes;
ZeRO-3 moves 4 N S_u bytes for each. With S_u a multiple of 64 and blocks of 256: 1 + 4 / 256 bytes per value
against 4, about 3.9x fewer. Per rank, a ring all_gather and the all-to-all each send (N - 1) / N of the size
("sent_per_rank").

Numerics: why the loss stays close, and the bound. A value's rounding error is at most half a level, a / 254 (a its
block's absmax), with a sign that varies from value to value; the fp32 master is never rounded, so the weights' error
does not accumulate over steps: each step quantises the current master afresh. A linear's output sums many such
independent errors (they partly cancel), and AdamW's step m / sqrt(v) is normalised per element, so a gradient off
by a fraction of its block's largest value moves the step by a similar fraction. What sets the size here is the
block's absmax: a block's 256 values run across tensor edges in a unit's flat vector, and a block that holds a
LayerNorm gain (~1) and the first qkv weights (std 0.02) reads those weights in steps of 1 / 127 ~ 0.008, 0.4 std.
Measured, the zero3 command's tiny run (4 layers, C = 32, V = 256, T = 16, B = 8, 10 steps, the training job's
defaults; fp32 loss 5.540 -> 5.154): max |loss(quantised) - loss(fp32)| = 1.28e-2 on 1 rank and on 2 ranks (the
weights' gathers give almost all of it: the gradients' alone 2.3e-4 on random tokens), 8.6e-4 with --block 64 (the
LayerNorm parameters then fill blocks of their own); 2.6e-3 on random tokens (V = 64, lr 1e-3). The tests bound the
gap by LOSS_GAP = 0.04, 3x the largest measured, a tenth of the 0.39 nats the run learns (0.32 where Python's help
topics, the default corpus, differ, as on the course's GPU image). A wrong dequantisation
is far above it: a scale applied twice (each weight times its block's absmax again) 0.37 by step 10, a scale missing
(each weight read as q / 127, up to 1 in magnitude) 2.3 at the first step.

hpZ (ZeroPP(node=k), the command's --quantized --hpz K): ZeRO++'s hierarchical partition. Ranks are grouped in nodes of
k consecutive ranks (on CPU ranks the nodes are a bookkeeping: the messages that would stay inside a node are counted
apart). The first gather of a unit that is gathered twice (the embeddings, again at the head; each block, again in
backward) runs across all ranks as qwZ's, and each rank keeps 1/k of what arrived: the int8 messages of ranks j with
j mod k = its place in its node, W / k of the W messages. The second gather collects the node's k pieces by sendrecv
inside the node and reads back the same messages, so the unit computes with exactly the weights of its first gather:
the losses equal ZeroPP's without hpZ bit for bit. The price is memory: every such unit's piece is held from its
first gather to its second, all of them at once when the head gathers the embeddings (hpz_model's
"secondary_peak_bytes", which the step measures). Across nodes the gathers then move every unit once instead of the
embeddings and blocks twice: about half the cross-node gather bytes, the reduce-scatter unchanged. (The paper keeps
the secondary copy in fp16 and partitions it by rank within the node; keeping the int8 messages gives the same
saving in bytes moved and exactly the first gather's weights.)

Not built: qgZ's hierarchical all-to-all (intra-node, then inter-node); the int4 gradient codes of the paper (here int8);
overlapping the quantisation with communication; a GPU engine.
"""

from __future__ import annotations

import argparse
import math
import time
import weakref

import numpy as np

from ..model.quant import BLOCK, dequantize_blockwise, quantize_blockwise
from .data_parallel import shard_bounds, shard_size
from .numpy_job import whole_params

FLOAT = np.float32


# ================================================================================================================
# 1. The units and their shards
# ================================================================================================================


def zero3_units(cfg) -> list:
    """The units in forward order: [embeddings, block 0, ..., block L-1, final LayerNorm], each a list of
    (name, lo, hi, shape): tensor `name`'s elements flat[lo:hi] of the whole buffer and the shape the unit gives them
    (a block's slice of an (L, ...) tensor keeps a leading axis of 1, so blocks_forward(..., range(1)) runs it)."""
    from ..model.params import BLOCK_PARAMS, GPTConfig, layer_segments, param_shapes

    if not isinstance(cfg, GPTConfig):
        raise TypeError(f"zero3_units: cfg must be a GPTConfig, got {type(cfg).__name__}")
    shapes = param_shapes(cfg)
    return [
        [(name, lo, hi, (1,) + shapes[name][1:] if name in BLOCK_PARAMS else shapes[name]) for name, lo, hi in unit]
        for unit in layer_segments(cfg)
    ]


def _check_world(fn, world, align):
    for name, v in (("world", world), ("align", align)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{fn}: {name} must be a positive integer, got {v!r}")
    return int(world), int(align)


def unit_sizes(cfg, world: int, align: int = 64) -> list:
    """[(n_u, S_u)] per unit: its parameters and its shard's elements (shard_size(n_u, world, align))."""
    world, align = _check_world("unit_sizes", world, align)
    out = []
    for unit in zero3_units(cfg):
        n = sum(hi - lo for _, lo, hi, _ in unit)
        out.append((n, shard_size(n, world, align)))
    return out


def zero3_memory(cfg, world: int, align: int = 64) -> dict:
    """The predicted bytes per rank (fp32): the shards ("params", "grads", "optimizer": 4, 4 and 8 bytes per shard
    element), "gathered_peak" (4 x the most gathered elements alive at once, see the module docstring: the phase in
    "peak_phase"), "peak" (their sum: what Zero3 measures), "dp" (plain data parallel's 16 Psi) and "psi"."""
    from ..model.params import num_params

    world, align = _check_world("zero3_memory", world, align)
    sizes = unit_sizes(cfg, world, align)
    S = sum(s for _, s in sizes)
    full = [world * s for _, s in sizes]  # each unit's gathered (padded) elements
    emb, fin, blocks = full[0], full[-1], full[1:-1]
    phases = {
        "forward": max([emb] + blocks),
        "head": max(2 * emb + fin, emb + fin),
        "backward": max(emb + 2 * b for b in blocks),
    }
    phase = max(phases, key=phases.get)
    out = {"params": 4 * S, "grads": 4 * S, "optimizer": 8 * S, "gathered_peak": 4 * phases[phase]}
    out.update(
        peak=out["params"] + out["grads"] + out["optimizer"] + out["gathered_peak"],
        peak_phase=phase,
        shard_elements=S,
        psi=num_params(cfg),
        dp=16 * num_params(cfg),
    )
    return out


def zero3_traffic(cfg, world: int, align: int = 64) -> dict:
    """Elements through the collectives per step (the collectives' sizes, padding included): "all_gather" (every
    block twice, the embeddings twice, the final LayerNorm once), "reduce_scatter" (every unit once), "total",
    "psi", and "dp_all_reduce" (data parallel's all-reduce of the gradient counted as reduce-scatter + all-gather,
    2 x its padded size). Per rank a ring sends (world - 1) / world of each."""
    from ..model.params import num_params

    world, align = _check_world("zero3_traffic", world, align)
    full = [world * s for _, s in unit_sizes(cfg, world, align)]
    gather = 2 * sum(full[:-1]) + full[-1]
    out = {"all_gather": gather, "reduce_scatter": sum(full), "psi": num_params(cfg)}
    out["total"] = out["all_gather"] + out["reduce_scatter"]
    out["dp_all_reduce"] = 2 * world * shard_size(num_params(cfg), world, align)
    return out


class MemoryTracker:
    """Bytes of the arrays registered with it that are still alive, and the most at once: each array gets a weakref
    whose callback subtracts its bytes when NumPy frees it (a view elsewhere, e.g. in a cache, keeps it counted)."""

    def __init__(self):
        self.current = self.peak = 0
        self._refs, self._next = {}, 0  # key -> the weakref (a weakref to an array is not hashable)

    def track(self, a):
        nbytes, key = int(a.nbytes), self._next
        self._next += 1
        self.current += nbytes
        self.peak = max(self.peak, self.current)

        def gone(_ref, nbytes=nbytes, key=key):
            self.current -= nbytes
            self._refs.pop(key, None)

        self._refs[key] = weakref.ref(a, gone)
        return a

    def reset_peak(self):
        self.peak = self.current


# ================================================================================================================
# 2. The sharded model and its step
# ================================================================================================================

_WEIGHT_OF = {"ln1": "ln1w", "qkv": "qkvw", "attproj": "attprojw", "ln2": "ln2w", "fc": "fcw", "fcproj": "fcprojw"}


class Zero3:
    """This rank's shards of the GPT (comm.rank of comm.world_size) and the ZeRO-3 step (module docstring).

    params: the whole model's initial parameters (a ParamBuffer or its flat array: init_params(cfg, seed), the
    one-rank run's values; every rank passes the same); the rank copies its shard of every unit and keeps nothing
    else. self.params, self.grads, self.m, self.v: flat fp32 arrays of S = sum_u S_u elements (unit u's shard at
    self.offsets[u]); self.t: optimizer steps taken. betas, eps: default the engines' (engine.core BETAS, EPS)."""

    def __init__(self, cfg, comm, params, align: int = 64, betas=None, eps=None):
        from ..engine.core import BETAS, EPS
        from ..model.optim import DECAY_NAMES, shard_decay_table
        from ..model.params import GPTConfig

        if not isinstance(cfg, GPTConfig):
            raise TypeError(f"Zero3: cfg must be a GPTConfig, got {type(cfg).__name__}")
        self.cfg, self.comm = cfg, comm
        self.W, self.rank = comm.world_size, comm.rank
        _, self.align = _check_world("Zero3", self.W, align)
        flat = whole_params("Zero3", cfg, params)
        self.units = zero3_units(cfg)
        self.sizes = unit_sizes(cfg, self.W, self.align)
        self.offsets = list(np.cumsum([0] + [s for _, s in self.sizes])[:-1])
        S = sum(s for _, s in self.sizes)
        self.mem = MemoryTracker()
        self.params = self.mem.track(np.zeros(S, FLOAT))
        self.grads = self.mem.track(np.zeros(S, FLOAT))
        self.m = self.mem.track(np.zeros(S, FLOAT))
        self.v = self.mem.track(np.zeros(S, FLOAT))
        decay = []
        for u, (unit, (n, s)) in enumerate(zip(self.units, self.sizes)):
            vec = np.concatenate([flat[lo:hi] for _, lo, hi, _ in unit]).astype(FLOAT)
            lo, hi = shard_bounds(n, self.W, self.rank, self.align)
            self.params[self.offsets[u] : self.offsets[u] + hi - lo] = vec[lo:hi]  # the rest: padding, zeros
            # the decay rule of the unit as the kernels' (bounds, flags) table, cut to this rank's shard as ZeRO-1's
            bounds = np.cumsum([0] + [b - a for _, a, b, _ in unit])
            flags = [name in DECAY_NAMES for name, _, _, _ in unit]
            sb, sf = shard_decay_table(bounds, flags, self.rank * s, (self.rank + 1) * s)
            decay.append(np.repeat(sf.astype(bool), np.diff(sb)))
        self.decay = np.concatenate(decay)
        self.betas = tuple(float(b) for b in (BETAS if betas is None else betas))
        self.eps = float(EPS if eps is None else eps)
        self.t = 0
        self.traffic = {"all_gather": 0, "reduce_scatter": 0}

    def __repr__(self):
        return (
            f"Zero3(rank {self.rank}/{self.W}: {len(self.units)} units, {self.params.size:,} of "
            f"{sum(n for n, _ in self.sizes):,} parameters per kind, align {self.align})"
        )

    def shard(self, u: int, a=None):
        """Unit u's shard (a view) of the flat array a (default: the parameters)."""
        a = self.params if a is None else a
        return a[self.offsets[u] : self.offsets[u] + self.sizes[u][1]]

    # ---- gather / reduce-scatter one unit --------------------------------------------------------------------------
    def _views(self, u, full):
        out, a = {"_flat": full}, 0  # the buffer itself under "_flat", its tensors by name
        for name, lo, hi, shape in self.units[u]:
            out[name] = full[a : a + hi - lo].reshape(shape)
            a += hi - lo
        return out

    def gather(self, u: int) -> dict:
        """Unit u's full parameters (all_gather of the shards into a fresh buffer) as named views."""
        full = self.mem.track(np.empty(self.W * self.sizes[u][1], FLOAT))
        self.comm.all_gather(self.shard(u), full)
        self.traffic["all_gather"] += full.size
        return self._views(u, full)

    def new_grad(self, u: int) -> dict:
        """A full-size, zeroed gradient buffer of unit u as named views (its padding stays zero)."""
        return self._views(u, self.mem.track(np.zeros(self.W * self.sizes[u][1], FLOAT)))

    def reduce(self, u: int, G: dict) -> None:
        """Unit u's full local gradient (new_grad's views) -> this rank's shard of the mean over ranks: the
        reduce_scatter (sum), then x 1/N."""
        full, g = G["_flat"], self.shard(u, self.grads)
        self.comm.reduce_scatter(full, g)
        self.traffic["reduce_scatter"] += full.size
        if self.W > 1:
            g *= FLOAT(1.0 / self.W)

    # ---- the step ------------------------------------------------------------------------------------------------
    def rows(self, B: int) -> slice:
        if B % self.W:
            raise ValueError(
                f"Zero3: the batch of {B} rows does not split over {self.W} ranks: rank r takes rows "
                f"[r B/N, (r+1) B/N); pass a batch size divisible by the world size"
            )
        b = B // self.W
        return slice(self.rank * b, (self.rank + 1) * b)

    def _check_batch(self, x, y):
        x, y = np.asarray(x), np.asarray(y)
        if x.ndim != 2 or y.shape != x.shape:
            raise ValueError(
                f"Zero3.train_step: x and y must be (B, T) token ids of one shape, got {x.shape}, {y.shape}"
            )
        if x.shape[1] > self.cfg.block_size:
            raise ValueError(f"Zero3.train_step: T={x.shape[1]} is longer than block_size={self.cfg.block_size}")
        for name, a in (("x", x), ("y", y)):
            if not np.issubdtype(a.dtype, np.integer) or (a.size and (a.min() < 0 or a.max() >= self.cfg.vocab_size)):
                raise ValueError(f"Zero3.train_step: {name} must hold token ids in [0, {self.cfg.vocab_size})")
        r = self.rows(x.shape[0])
        return x[r].astype(np.int32), y[r].astype(np.int32)

    def forward_backward(self, x, y) -> float:
        """This rank's rows' forward and backward, unit by unit (module docstring): leaves this rank's shard of the
        mean gradient in self.grads and returns the local mean loss."""
        from ..reference.crossentropy import crossentropy_backward, crossentropy_forward
        from ..reference.encoder import encoder_backward, encoder_forward
        from ..reference.gpt import blocks_backward, blocks_forward
        from ..reference.layernorm import layernorm_backward, layernorm_forward
        from ..reference.linear import linear_backward, linear_forward

        L, nh, one = self.cfg.n_layer, self.cfg.n_head, range(1)
        # forward: the embeddings, then each block; a unit's parameters live only while it computes
        P = self.gather(0)
        h, enc_cache = encoder_forward(x, P["wte"], P["wpe"])  # (b, T, C)
        del P
        caches = []
        for l in range(L):
            P = self.gather(1 + l)
            h, (c,) = blocks_forward(P, h, nh, one)
            for key in _WEIGHT_OF:
                c[key]["weight"] = None  # the cache keeps the activations, not the gathered parameters
            caches.append(c)
            del P
        # the head: the final LayerNorm and the tied wte gathered once for its forward and backward
        E, F = self.gather(0), self.gather(L + 1)
        lnf, lnf_cache = layernorm_forward(h, F["lnfw"], F["lnfb"])
        logits, head_cache = linear_forward(lnf, E["wte"].T)  # (b, T, V)
        loss, ce_cache = crossentropy_forward(logits, y)
        del logits, h
        dlogits = crossentropy_backward(1.0, ce_cache)
        dlnf, dwte_head, _ = linear_backward(dlogits, head_cache)  # (b, T, C), (C, V)
        del dlogits, head_cache, ce_cache
        GE = self.new_grad(0)  # the embeddings' full gradient: the head's part now, the encoder's at the end
        GE["wte"][...] = dwte_head.T
        del dwte_head, E  # wte's gathered copy goes (head_cache held it too)
        dh, dlnfw, dlnfb = layernorm_backward(dlnf, lnf_cache)
        del F, lnf_cache, dlnf
        GF = self.new_grad(L + 1)
        GF["lnfw"][...], GF["lnfb"][...] = dlnfw, dlnfb
        self.reduce(L + 1, GF)
        del GF
        # backward: each block gathered again, its full gradient reduce-scattered at once
        for l in reversed(range(L)):
            P, c = self.gather(1 + l), caches.pop()
            for key, name in _WEIGHT_OF.items():
                c[key]["weight"] = P[name][0]
            G = self.new_grad(1 + l)
            dh = blocks_backward(dh, [c], G, one)
            del P, c
            self.reduce(1 + l, G)
            del G
        dwte, GE["wpe"][...] = encoder_backward(dh, enc_cache)  # no parameter needed: a scatter-add at the ids
        GE["wte"][...] += dwte  # the tie: head's + embedding's in one buffer before the one reduce_scatter
        del dwte
        self.reduce(0, GE)
        return float(loss)

    def train_step(self, x, y, lr, weight_decay=0.0, grad_clip=0.0) -> dict:
        """One step on this rank: x, y the global batch (B, T), the same on every rank (rank r takes rows
        [r B/N, (r+1) B/N)). Returns (the same on every rank) {"loss" (the global mean), "grad_norm", "peak_bytes"
        (this rank's measured peak of params + grads + optimizer state during the step), "all_gather",
        "reduce_scatter" (elements through each this step), "seconds"}."""
        from ..model.optim import adamw_update, clip_coefficient

        x, y = self._check_batch(x, y)
        t0 = time.perf_counter()
        self.mem.reset_peak()
        self.traffic = {"all_gather": 0, "reduce_scatter": 0}
        loss = self.forward_backward(x, y)
        sumsq = float(np.sum(np.square(self.grads, dtype=np.float64)))  # the padding adds 0
        red = self.comm.all_reduce_scalars([loss, sumsq])
        norm = math.sqrt(max(float(red[1]), 0.0))
        coef = clip_coefficient(norm, grad_clip)
        if coef != 1.0:
            self.grads *= FLOAT(coef)
        self.t += 1
        adamw_update(
            self.params, self.grads, self.m, self.v, self.t, lr, self.betas, self.eps, float(weight_decay), self.decay
        )
        return {
            "loss": float(red[0]) / self.W,
            "grad_norm": norm,
            "peak_bytes": int(self.mem.peak),
            **self.traffic,
            "seconds": time.perf_counter() - t0,
        }

    def full_params(self) -> np.ndarray:
        """The whole model's flat parameters in ParamBuffer's layout (every unit gathered: a collective)."""
        from ..model.params import num_params

        out = np.zeros(num_params(self.cfg), FLOAT)
        for u, unit in enumerate(self.units):
            full, a = np.empty(self.W * self.sizes[u][1], FLOAT), 0
            self.comm.all_gather(self.shard(u), full)
            for _, lo, hi, _ in unit:
                out[lo:hi] = full[a : a + hi - lo]
                a += hi - lo
        return out


# ================================================================================================================
# 3. ZeRO++: the int8 all-gather of the parameters (qwZ) and reduce-scatter of the gradients (qgZ)
# ================================================================================================================

LOSS_GAP = 0.04  # the bound on |loss(quantised) - loss(fp32)| over the tests' 10 steps (module docstring)


def _check_block(fn, block):
    if isinstance(block, bool) or not isinstance(block, (int, np.integer)) or block < 1:
        raise ValueError(f"{fn}: block must be a positive integer, got {block!r}")
    return int(block)


def packed_bytes(n: int, block: int = BLOCK) -> int:
    """Bytes of n values as int8 codes plus one fp32 scale per block of `block`."""
    return n + 4 * math.ceil(n / block)


def pack(x, block: int = BLOCK) -> np.ndarray:
    """x (fp32, flat) -> one uint8 message: its int8 codes, then its fp32 scales' bytes (packed_bytes(x.size))."""
    q, s = quantize_blockwise(x, block, signed=True)
    out = np.empty(q.size + 4 * s.size, np.uint8)
    out[: q.size] = q.view(np.uint8)
    out[q.size :] = s.view(np.uint8)
    return out


def unpack(msg, n: int, block: int = BLOCK) -> np.ndarray:
    """pack's message of n values -> fp32 (n,): dequantize_blockwise of its codes and scales."""
    q = msg[:n].view(np.int8)
    s = np.ascontiguousarray(msg[n:]).view(np.float32)
    return dequantize_blockwise(q, s, block, signed=True)


def _check_node(fn, node, world):
    if node is None:
        return None
    if isinstance(node, bool) or not isinstance(node, (int, np.integer)) or node < 1 or world % node:
        raise ValueError(
            f"{fn}: the node size (ranks per node for hpZ) must be a positive integer that divides the {world} "
            f"ranks, got {node!r}"
        )
    return int(node)


def hpz_model(cfg, world: int, node: int, align: int = 64, block: int = BLOCK) -> dict:
    """hpZ's prediction per step and rank: "secondary_peak_bytes" (the int8 copies a rank holds at once: W / k
    messages of every unit gathered twice, all alive when the head gathers the embeddings again), and the bytes
    through the gathers, "all_gather_bytes" (across all ranks: every unit once) and "node_gather_bytes" (inside a
    node: the embeddings' and the blocks' second gathers); the reduce-scatter is zeropp_traffic's."""
    world, align = _check_world("hpz_model", world, align)
    node = _check_node("hpz_model", node, world)
    block = _check_block("hpz_model", block)
    per = [world * packed_bytes(s, block) for _, s in unit_sizes(cfg, world, align)]  # one gather of each unit
    twice = per[:-1]  # the embeddings and the blocks; the final LayerNorm is gathered once
    return {
        "secondary_peak_bytes": sum(p // node for p in twice),
        "all_gather_bytes": sum(per),
        "node_gather_bytes": sum(twice),
    }


def zeropp_traffic(cfg, world: int, align: int = 64, block: int = BLOCK) -> dict:
    """Bytes through the collectives per step (their sizes, padding included): "all_gather_bytes" and
    "reduce_scatter_bytes" (int8 codes + fp32 scales), "total_bytes", ZeRO-3's fp32 bytes of the same collectives
    ("zero3_all_gather_bytes", "zero3_reduce_scatter_bytes", "zero3_total_bytes"), "ratio" (ZeRO-3's total over
    this), and "sent_per_rank" ((world - 1) / world of the total: a ring all_gather and the all-to-all)."""
    world, align = _check_world("zeropp_traffic", world, align)
    block = _check_block("zeropp_traffic", block)
    per = [world * packed_bytes(s, block) for _, s in unit_sizes(cfg, world, align)]
    z3 = zero3_traffic(cfg, world, align)
    out = {"all_gather_bytes": 2 * sum(per[:-1]) + per[-1], "reduce_scatter_bytes": sum(per)}
    out["total_bytes"] = out["all_gather_bytes"] + out["reduce_scatter_bytes"]
    out.update(
        zero3_all_gather_bytes=4 * z3["all_gather"],
        zero3_reduce_scatter_bytes=4 * z3["reduce_scatter"],
        zero3_total_bytes=4 * z3["total"],
    )
    out["ratio"] = out["zero3_total_bytes"] / out["total_bytes"]
    out["sent_per_rank"] = (world - 1) * out["total_bytes"] // world
    return out


class ZeroPP(Zero3):
    """Zero3 with ZeRO++'s qwZ (int8 parameter all-gather) and qgZ (int8 gradient reduce-scatter): the module
    docstring's "ZeRO++" paragraphs.
    block: values per int8 block (lesson 12's quant.BLOCK). train_step's result adds "all_gather_bytes" and
    "reduce_scatter_bytes" (this step's bytes through the collectives, zeropp_traffic's prediction)."""

    def __init__(self, cfg, comm, params, align: int = 64, block: int = BLOCK, betas=None, eps=None, node=None):
        super().__init__(cfg, comm, params, align=align, betas=betas, eps=eps)
        self.block = _check_block("ZeroPP", block)
        self.node = _check_node("ZeroPP", node, self.W)
        self.secondary = {}  # hpZ: unit -> the int8 messages this rank keeps for the unit's second gather
        self.smem = MemoryTracker()  # their bytes (the price of hpZ), apart from the fp32 peak

    def __repr__(self):
        hpz = f", hpZ over nodes of {self.node}" if self.node else ""
        return super().__repr__().replace("Zero3(", "ZeroPP(", 1)[:-1] + f", int8 blocks of {self.block}{hpz})"

    def _count(self, key, n):
        self.traffic[key] = self.traffic.get(key, 0) + n

    def _node_all_gather(self, mine, out):
        """hpZ's gather inside this rank's node (ranks [n k, (n+1) k)): piece i of out from the node's i-th rank, by
        k - 1 sendrecv rounds among them (no message leaves the node)."""
        k, m = self.node, mine.size
        base, i = self.rank - self.rank % k, self.rank % k
        out[i * m : (i + 1) * m] = mine
        for step in range(1, k):
            dst, src = (i + step) % k, (i - step) % k
            self.comm.sendrecv(mine, base + dst, out[src * m : (src + 1) * m], base + src)
        return out

    def gather(self, u: int) -> dict:
        """qwZ: unit u's parameters, every rank's shard sent as int8 blocks and read back in fp32. With hpZ the
        first gather of a unit that is gathered twice keeps the messages of ranks j = i mod k (i: this rank's place
        in its node) and the second gathers the messages inside the node instead of across all ranks."""
        S, W, L = self.sizes[u][1], self.W, self.cfg.n_layer
        nbytes = packed_bytes(S, self.block)
        if u in self.secondary:  # hpZ's second gather: the node's k pieces, each W / k messages
            k = self.node
            kept = self.secondary.pop(u)
            pieces = self._node_all_gather(kept, np.empty(k * kept.size, np.uint8)).reshape(k, W // k, nbytes)
            msgs = np.stack([pieces[j % k, j // k] for j in range(W)])
            self._count("node_gather_bytes", pieces.size)
        else:
            mine = pack(self.shard(u), self.block)
            msgs = self.comm.all_gather(mine, np.empty(W * nbytes, np.uint8)).reshape(W, nbytes)
            self._count("all_gather_bytes", msgs.size)
            if self.node and u <= L:  # the embeddings (again at the head) and the blocks (again in backward)
                self.secondary[u] = self.smem.track(msgs[self.rank % self.node :: self.node].reshape(-1))
        full = self.mem.track(np.empty(W * S, FLOAT))
        for r, msg in enumerate(msgs):
            full[r * S : (r + 1) * S] = unpack(msg, S, self.block)
        self.traffic["all_gather"] += full.size
        return self._views(u, full)

    def train_step(self, x, y, lr, weight_decay=0.0, grad_clip=0.0) -> dict:
        """Zero3's step; with hpZ the result adds "secondary_peak_bytes" (the int8 copies held at once, measured)."""
        self.smem.reset_peak()
        out = super().train_step(x, y, lr, weight_decay, grad_clip)
        if self.secondary:
            raise RuntimeError(f"ZeroPP: hpZ copies of units {sorted(self.secondary)} were never used")
        if self.node:
            out["secondary_peak_bytes"] = int(self.smem.peak)
        return out

    def reduce(self, u: int, G: dict) -> None:
        """qgZ: unit u's full local gradient -> this rank's shard of the mean over ranks, each rank's chunk sent as
        int8 blocks (comm.all_to_all), read back in fp32 and summed in rank order, then x 1/N."""
        full, g = G["_flat"], self.shard(u, self.grads)
        S, W = self.sizes[u][1], self.W
        nbytes = packed_bytes(S, self.block)
        send = np.concatenate([pack(full[d * S : (d + 1) * S], self.block) for d in range(W)])  # chunk d for rank d
        got = self.comm.all_to_all(send, np.empty_like(send)).reshape(W, nbytes)  # got[src]: rank src's chunk
        g[...] = unpack(got[0], S, self.block)
        for src in range(1, W):
            g += unpack(got[src], S, self.block)
        self.traffic["reduce_scatter"] += full.size
        self._count("reduce_scatter_bytes", W * nbytes)
        if W > 1:
            g *= FLOAT(1.0 / W)


# ================================================================================================================
# 4. The command: `python -m gpullm_lessons.parallel zero3 ...` on N ranks
# ================================================================================================================


def build_parser() -> argparse.ArgumentParser:
    """The zero3 command's flags: the training job's (numpy_job.job_parser) and --align."""
    from .numpy_job import job_parser

    p = job_parser(
        "python -m gpullm_lessons.parallel zero3",
        "ZeRO-3 (fully sharded data parallel) training of the NumPy GPT on CPU ranks (start the ranks with "
        "python -m gpullm_lessons.parallel.launch --nproc N --backend mpi)",
        json="losses, memory and traffic",
    )
    p.add_argument("--align", type=int, default=64, help="each unit's shard a multiple of this many elements")
    p.add_argument(
        "--quantized",
        action="store_true",
        help="ZeRO++'s qwZ and qgZ (ZeroPP): the all-gathers and the reduce-scatter move int8 blocks",
    )
    p.add_argument("--block", type=int, default=None, help="with --quantized: values per int8 block (default 256)")
    p.add_argument(
        "--hpz",
        type=int,
        default=None,
        metavar="K",
        help="with --quantized: ZeRO++'s hpZ over nodes of K ranks (the second gathers stay inside a node)",
    )
    return p


def main(argv=None, comm=None) -> dict:
    """The zero3 command on this rank (comm: default the environment's). Returns the summary (on every rank); rank 0
    prints each step's loss and every rank's peak bytes, and writes --json."""

    from ..model.params import init_params
    from ..train import ConfigError
    from .numpy_job import job_from_args, write_summary

    args = build_parser().parse_args(argv)
    if args.block is not None and not args.quantized:
        raise ConfigError("--block sets the int8 block of --quantized: pass --quantized too")
    if args.hpz is not None and not args.quantized:
        raise ConfigError("--hpz partitions --quantized's int8 gathers within nodes: pass --quantized too")
    block = BLOCK if args.block is None else args.block

    def check(preset, B, comm):
        W = comm.world_size
        if args.hpz is not None and (args.hpz < 1 or W % args.hpz):
            raise ConfigError(f"--hpz {args.hpz}: the node size must be a positive divisor of the {W} ranks")
        if B % W:
            raise ConfigError(
                f"--batch-size {B} does not split over {W} ranks: each rank takes B / N rows; pass a multiple of {W}"
            )

    job = job_from_args(args, comm, positive={"--align": args.align, "--block": block}, check=check)
    cfg, B, lr, comm = job.cfg, job.B, job.lr, job.comm
    W = comm.world_size
    T = cfg.block_size
    if args.quantized:
        z = ZeroPP(cfg, comm, init_params(cfg, seed=args.seed), align=args.align, block=block, node=args.hpz)
    else:
        z = Zero3(cfg, comm, init_params(cfg, seed=args.seed), align=args.align)
    model = zero3_memory(cfg, W, args.align)
    traffic = zero3_traffic(cfg, W, args.align)
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    say(
        f"zero3: {W} rank(s) over {comm.name}, {len(z.units)} units (embeddings, {cfg.n_layer} blocks, final "
        f"LayerNorm) of L={cfg.n_layer} (C={cfg.d_model}, nh={cfg.n_head}, T={T}, V={cfg.vocab_size}), "
        f"{model['psi']:,} parameters | B={B} as {W} x {B // W} rows | {args.steps} steps, lr {lr:g}"
    )
    say(
        f"memory per rank (model): 16 x {model['shard_elements']:,} shard elements = "
        f"{16 * model['shard_elements']:,} B + gathered peak {model['gathered_peak']:,} B ({model['peak_phase']}) = "
        f"{model['peak']:,} B; data parallel 16 Psi = {model['dp']:,} B"
    )
    say(
        f"traffic per step (elements): all_gather {traffic['all_gather']:,} + reduce_scatter "
        f"{traffic['reduce_scatter']:,} = {traffic['total']:,} ({traffic['total'] / traffic['psi']:.2f} Psi); data "
        f"parallel's all-reduce {traffic['dp_all_reduce']:,}"
    )
    if args.quantized:
        qt = zeropp_traffic(cfg, W, args.align, block)
        say(
            f"zero++ (qwZ + qgZ, int8 blocks of {block}) bytes per step (model): all_gather "
            f"{qt['all_gather_bytes']:,} + reduce_scatter {qt['reduce_scatter_bytes']:,} = {qt['total_bytes']:,}; "
            f"zero3's fp32 {qt['zero3_total_bytes']:,} ({qt['ratio']:.2f}x more)"
        )
    if args.hpz:
        hz = hpz_model(cfg, W, args.hpz, args.align, block)
        say(
            f"hpz over nodes of {args.hpz} rank(s) (model): gathers across nodes {hz['all_gather_bytes']:,} B, inside "
            f"a node {hz['node_gather_bytes']:,} B; int8 copies held per rank at most {hz['secondary_peak_bytes']:,} B"
        )
    losses, norms, peaks = [], [], []
    for step, res in job.run(args.steps, lambda x, y, lr: z.train_step(x, y, lr, args.weight_decay, args.grad_clip)):
        peak = [int(v) for v in comm.gather_scalars([res["peak_bytes"]])[:, 0]]
        losses.append(res["loss"])
        norms.append(res["grad_norm"])
        peaks.append(peak)
        say(
            f"step {step:4d} | loss {res['loss']:.6f} | grad norm {res['grad_norm']:.4f} | peak bytes per rank "
            + " ".join(f"{b:,}" for b in peak)
            + f" | {res['seconds'] * 1e3:.1f} ms"
            + (f" | bytes {res['all_gather_bytes'] + res['reduce_scatter_bytes']:,}" if args.quantized else "")
        )
    summary = {
        "world": W,
        "align": args.align,
        "losses": losses,
        "grad_norms": norms,
        "peak_bytes": peaks,
        "memory_model": model,
        "traffic": traffic,
        "traffic_measured": {k: res[k] for k in ("all_gather", "reduce_scatter")} if args.steps else None,
    }
    if args.quantized:
        summary.update(quantized=True, block=block, traffic_bytes=qt)
        keys = ("all_gather_bytes", "reduce_scatter_bytes")
        summary["traffic_bytes_measured"] = {k: res[k] for k in keys} if args.steps else None
    if args.hpz:
        keys = ("all_gather_bytes", "node_gather_bytes", "secondary_peak_bytes")
        summary.update(hpz=args.hpz, hpz_model=hz, hpz_measured={k: res[k] for k in keys} if args.steps else None)
    say(f"done: loss {losses[0]:.4f} -> {losses[-1]:.4f}; peak bytes per rank {peaks[-1]} (model {model['peak']:,})")
    write_summary(comm, args.json, summary)
    return summary


def cli(argv=None) -> int:
    """Command-line entry: configuration problems print one line and exit with status 2 (as the training job)."""
    from .numpy_job import run_cli

    return run_cli(main, argv)
