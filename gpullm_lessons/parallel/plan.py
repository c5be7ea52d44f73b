"""Which strategy, on how many GPUs: the model state per rank of each parallel strategy, predicted from the modules'
own memory models, and an alpha-beta model of the time their communication takes (lesson 13).

    STRATEGIES                          "dp", "zero1", "zero2", "zero3", "tensor", "pipeline"
    state_per_rank(cfg, world, strategy, precision)   bytes per rank of params + half copy + grads + AdamW's m, v
    fits_table(models, card_bytes, worlds, precision)  the fewest ranks on which each strategy holds each model
    state_curves(cfg, worlds, precision)  strategy -> [(N, bytes per rank)] where the strategy can split the model
    fit_alpha_beta(rows, world)         alpha (s per collective) and beta (s per byte a ring sends per rank) from
                                        all-reduce timings (the rows `python -m gpullm_lessons.parallel bench` writes)
    collective_seconds(kind, nbytes, world, alpha, beta)   one collective's predicted time
    comm_per_step(cfg, B, T, world, strategy, ...)   the collectives one training step makes: [(kind, bytes)]
    comm_seconds(calls, world, alpha, beta)          their predicted time, one after the other
    sent_bytes(calls, world)            the bytes a rank sends for them (a ring's share of each buffer)

The model state. The course's engine holds, per parameter, the fp32 master weight (4 bytes), the fp32 gradient (4),
AdamW's m and v (8) and, in bf16 / fp16, the half copy the kernels read (2): K = 16 (fp32) or 18 bytes per parameter.
(ZeRO's paper counts 2 + 2 + 12 = 16 for mixed precision: an fp16 gradient and fp32 master, m, v; the course's engine
accumulates its gradient in fp32, 2 bytes more.) Per rank, with N ranks and Psi parameters (S = the ZeRO shard,
about Psi / N):

    dp        K Psi                                    every rank a whole replica
    zero1     (4 + h + 4) Psi + 8 S                    AdamW's state sharded (h: the half copy's bytes, 0 or 2)
    zero2     (4 + h) Psi + 12 S                       the gradient too, reduced bucket by bucket as backward goes
                                                       (the paper's stage 2; the course's DataParallel(zero=2)
                                                       writes its whole gradient first, so its peak is zero1's)
    zero3     K S + (h + 4) x the most gathered elements alive at once (zero3.zero3_memory: a unit's parameters
              and its full gradient, and the embeddings' gradient held through backward)
    tensor    K x tensor.tp_memory's elements per rank (the block linears 1/N, the rest replicated)
    pipeline  K x the largest stage's parameters (pipeline.stage_ranges: blocks L/p, plus the embeddings on the
              first stage and the tied head and final LayerNorm on the last)
    ulysses   K Psi, as data parallel: sequence parallelism (ulysses.py) splits the activations, not the state

Activations come on top of these and depend on the batch and on lesson 12's policies (each rank of tensor
parallelism holds 1/N of the wide ones; a pipeline stage holds its blocks' activations for up to p micro-batches
under 1F1B): the table here is the model state only, the part that decides whether a model can be trained at all.

The alpha-beta model. A ring collective over N ranks makes (N - 1) or 2 (N - 1) steps, each a message of n / N
bytes: t = alpha + f n beta, with f the bytes a ring sends per rank per byte of the buffer (all-reduce 2 (N-1)/N,
all-gather, reduce-scatter and all-to-all (N-1)/N, a point-to-point message 1) and beta = 1 / the bus bandwidth (nccl-tests'
busbw). Both come from a least-squares fit to measured all-reduce times, weighted so that every size counts alike
(each row's error relative to its time), which fits latency at small sizes and bandwidth at large ones.
"""

from __future__ import annotations

import math

import numpy as np

STRATEGIES = ("dp", "zero1", "zero2", "zero3", "tensor", "pipeline", "ulysses")
KINDS = {
    "all_reduce": 2.0,
    "all_gather": 1.0,
    "reduce_scatter": 1.0,
    "all_to_all": 1.0,
    "sendrecv": None,
}  # ring factor x (N-1)/N


def _precision(fn, precision):
    if precision not in ("fp32", "bf16", "fp16"):
        raise ValueError(f"{fn}: precision must be 'fp32', 'bf16' or 'fp16', got {precision!r}")
    return 0 if precision == "fp32" else 2


def _world(fn, world):
    if isinstance(world, bool) or not isinstance(world, (int, np.integer)) or world < 1:
        raise ValueError(f"{fn}: world must be a positive int (ranks), got {world!r}")
    return int(world)


def why_not(cfg, world: int, strategy: str):
    """Why `strategy` cannot split `cfg` over `world` ranks (a sentence), or None when it can."""
    if strategy in ("tensor", "ulysses") and cfg.n_head % world:
        return f"{strategy} parallelism splits whole heads: {cfg.n_head} heads do not divide over {world} ranks"
    if strategy == "pipeline" and world > cfg.n_layer:
        return f"a pipeline needs a block per stage: {cfg.n_layer} blocks, {world} stages"
    return None


def state_per_rank(cfg, world: int, strategy: str, precision: str = "bf16", align: int = 64) -> dict:
    """{"params", "half", "grads", "optimizer", "gathered", "total"}: bytes per rank of the model state under
    `strategy` on `world` ranks (module docstring). ValueError for an unknown strategy or a split the strategy
    cannot make (tensor: heads over ranks; pipeline: blocks over stages)."""
    from ..model.params import num_params
    from .data_parallel import shard_size

    if strategy not in STRATEGIES:
        raise ValueError(f"state_per_rank: strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    h = _precision("state_per_rank", precision)
    N = _world("state_per_rank", world)
    reason = why_not(cfg, N, strategy)
    if reason:
        raise ValueError(f"state_per_rank: {reason}")
    psi = num_params(cfg)
    S = shard_size(psi, N, align)
    out = dict(params=4 * psi, half=h * psi, grads=4 * psi, optimizer=8 * psi, gathered=0)
    if strategy == "zero1":
        out["optimizer"] = 8 * S
    elif strategy == "zero2":
        out.update(grads=4 * S, optimizer=8 * S)
    elif strategy == "zero3":
        from .zero3 import zero3_memory

        z = zero3_memory(cfg, N, align)
        s = z["shard_elements"]
        out = dict(params=4 * s, half=h * s, grads=4 * s, optimizer=8 * s, gathered=(h + 4) * z["gathered_peak"] // 4)
    elif strategy == "tensor":
        from .tensor import tp_memory

        n = tp_memory(cfg, N)["elements"]
        out = dict(params=4 * n, half=h * n, grads=4 * n, optimizer=8 * n, gathered=0)
    elif strategy == "pipeline":
        from .pipeline import stage_ranges

        n = max(sum(hi - lo for _, lo, hi, _ in stage_ranges(cfg, s, N)) for s in range(N))
        out = dict(params=4 * n, half=h * n, grads=4 * n, optimizer=8 * n, gathered=0)
    out["total"] = sum(out.values())
    return out


def fits_table(models: dict, card_bytes: int, worlds=(1, 2, 4, 8, 16, 32, 64), precision: str = "bf16") -> list:
    """For each model (name -> GPTConfig) and strategy, the fewest ranks of `worlds` whose model state per rank is
    at most card_bytes: [{"model", "psi", "dp_bytes", strategy: N or None, ...}] (None: not within `worlds`)."""
    from ..model.params import num_params

    if not isinstance(card_bytes, (int, np.integer)) or card_bytes <= 0:
        raise ValueError(f"fits_table: card_bytes must be a positive int, got {card_bytes!r}")
    rows = []
    for name, cfg in models.items():
        row = {"model": name, "psi": num_params(cfg), "dp_bytes": state_per_rank(cfg, 1, "dp", precision)["total"]}
        for strategy in STRATEGIES:
            row[strategy] = next(
                (
                    N
                    for N in worlds
                    if why_not(cfg, N, strategy) is None
                    and state_per_rank(cfg, N, strategy, precision)["total"] <= card_bytes
                ),
                None,
            )
        rows.append(row)
    return rows


def state_curves(cfg, worlds=(1, 2, 4, 8, 16, 32), precision: str = "bf16") -> dict:
    """strategy -> [(N, state_per_rank's total)] for the N of `worlds` the strategy can split cfg over."""
    return {
        s: [(N, state_per_rank(cfg, N, s, precision)["total"]) for N in worlds if why_not(cfg, N, s) is None]
        for s in STRATEGIES
    }


def _factor(kind: str, world: int) -> float:
    if kind not in KINDS:
        raise ValueError(f"unknown collective {kind!r}: one of {', '.join(KINDS)}")
    return 1.0 if KINDS[kind] is None else KINDS[kind] * (world - 1) / world


def fit_alpha_beta(rows, world: int, algo=None) -> dict:
    """alpha (s), beta (s per byte sent per rank) and busbw (GB/s = 1e-9 / beta) fitted to all-reduce timings.

    rows: dicts with "size_bytes" and "time_us" (and "algo": pass algo= to keep one, e.g. "nccl" or "mpi"), as
    `python -m gpullm_lessons.parallel bench` writes them. Each row weighs by 1 / its time (relative errors), so the
    small sizes fit the latency and the large ones the bandwidth. Returns also "rel_err": each row's
    (model - measured) / measured, in the rows' order."""
    N = _world("fit_alpha_beta", world)
    if N < 2:
        raise ValueError("fit_alpha_beta: a collective of one rank moves nothing; fit timings of 2 or more ranks")
    rows = [r for r in rows if algo is None or r.get("algo") == algo]
    if len(rows) < 2:
        raise ValueError(f"fit_alpha_beta: need at least two timings to fit two numbers, got {len(rows)}")
    n = np.array([float(r["size_bytes"]) for r in rows])
    t = np.array([float(r["time_us"]) * 1e-6 for r in rows])
    if (t <= 0).any() or (n <= 0).any():
        raise ValueError("fit_alpha_beta: every row needs a positive size_bytes and time_us")
    A = np.stack([np.ones_like(n), _factor("all_reduce", N) * n], axis=1) / t[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(A, np.ones_like(t), rcond=None)
    if alpha < 0 or beta <= 0:  # latency below resolution or a bandwidth-only run: refit the one that is left
        alpha = max(float(alpha), 0.0)
        beta = float(np.sum((t - alpha) / t) / np.sum(_factor("all_reduce", N) * n / t))
    model = alpha + _factor("all_reduce", N) * n * beta
    return {
        "alpha": float(alpha),
        "beta": float(beta),
        "busbw_GBps": 1e-9 / float(beta),
        "rel_err": ((model - t) / t).tolist(),
        "sizes": n.astype(int).tolist(),
    }


def collective_seconds(kind: str, nbytes: float, world: int, alpha: float, beta: float) -> float:
    """Predicted seconds of one collective of nbytes (the buffer's size) over `world` ranks: alpha + f nbytes beta."""
    N = _world("collective_seconds", world)
    if N == 1 and kind != "sendrecv":
        return 0.0
    return float(alpha + _factor(kind, N) * float(nbytes) * beta)


def comm_per_step(
    cfg,
    B: int,
    T: int,
    world: int,
    strategy: str,
    precision: str = "bf16",
    micro_batches: int = 1,
    bucket_bytes: int = 0,
    align: int = 64,
) -> list:
    """The collectives of one training step, [(kind, bytes of the buffer)], as each strategy makes them (B sequences
    of T per step in all, ranks as in state_per_rank):

    dp, zero1, zero2  the fp32 gradient (4 Psi bytes): one all-reduce (dp; bucket_bytes > 0: one per bucket) or a
                      reduce-scatter (zero1 / zero2), then zero1 / zero2's all-gather of the fp32 parameters.
    zero3             zero3.zero3_traffic's units: each gathered as the module does (blocks and embeddings twice, the
                      final LayerNorm once) in the half format (fp32 on "fp32"), each gradient reduce-scattered in fp32.
    tensor            4 L all-reduces of the (B, T, C) activations in the compute format.
    ulysses           4 L all-to-alls of the attention's inputs and outputs and their gradients (3 + 1 + 1 + 3 = 8
                      B T C / N elements per block in the compute format), then data parallel's gradient all-reduce.
    pipeline          the activations (B / m, T, C) a stage sends per micro-batch: the busiest (a middle stage, p > 2)
                      sends each micro-batch's output on and its input's gradient back, 2 m messages; with p = 2
                      each stage sends one way, m."""
    from ..model.params import num_params
    from .data_parallel import shard_size

    h = _precision("comm_per_step", precision)
    e = h or 4
    N = _world("comm_per_step", world)
    reason = why_not(cfg, N, strategy)
    if reason:
        raise ValueError(f"comm_per_step: {reason}")
    psi = num_params(cfg)
    if strategy == "dp":
        grads = 4 * psi
        if bucket_bytes and bucket_bytes < grads:
            full, rest = divmod(grads, int(bucket_bytes))
            return [("all_reduce", int(bucket_bytes))] * full + ([("all_reduce", rest)] if rest else [])
        return [("all_reduce", grads)]
    if strategy in ("zero1", "zero2"):
        padded = 4 * N * shard_size(psi, N, align)
        return [("reduce_scatter", padded), ("all_gather", padded)]
    if strategy == "zero3":
        from .zero3 import unit_sizes

        full = [N * s for _, s in unit_sizes(cfg, N, align)]
        gathers = [g for g in full[:-1] for _ in range(2)] + [full[-1]]
        return [("all_gather", e * g) for g in gathers] + [("reduce_scatter", 4 * g) for g in full]
    if strategy == "tensor":
        return [("all_reduce", e * B * T * cfg.d_model)] * (4 * cfg.n_layer)
    if strategy == "ulysses":
        per = [3, 1, 1, 3]  # qkv, atty forward; d(atty), dqkv backward: in units of B T C / N
        calls = [("all_to_all", e * k * B * T * cfg.d_model // N) for _ in range(cfg.n_layer) for k in per]
        return calls + [("all_reduce", 4 * psi)]
    if strategy == "pipeline":
        if B % micro_batches:
            raise ValueError(f"comm_per_step: {micro_batches} micro-batches do not divide B={B}")
        if N == 1:
            return []
        sends = micro_batches * (2 if N > 2 else 1)  # a middle stage: m activations on, m gradients back
        return [("sendrecv", e * (B // micro_batches) * T * cfg.d_model)] * sends
    raise ValueError(f"comm_per_step: strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")


def comm_seconds(calls, world: int, alpha: float, beta: float) -> float:
    """The predicted seconds of a step's collectives (comm_per_step), one after the other (no overlap)."""
    return math.fsum(collective_seconds(kind, n, world, alpha, beta) for kind, n in calls)


def sent_bytes(calls, world: int) -> float:
    """The bytes one rank sends for a step's collectives (comm_per_step) on a ring: f x each buffer's bytes."""
    N = _world("sent_bytes", world)
    return math.fsum(0.0 if N == 1 and k != "sendrecv" else _factor(k, N) * n for k, n in calls)
