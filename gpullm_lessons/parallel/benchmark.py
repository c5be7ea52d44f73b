"""What the ranks measure: all-reduce algorithm and bus bandwidth (nccl-tests' definitions), the collectives'
engine against the ring by hand, and data-parallel training throughput (`python -m gpullm_lessons.parallel bench |
dpbench`)."""

from __future__ import annotations

import os
import time

import numpy as np

from .comm import Communicator
from .data_parallel import DataParallel
from .ring import ring_allreduce


# ================================================================================================================
# 5. All-reduce bandwidth: nccl-tests' algbw and busbw
# ================================================================================================================

DEFAULT_SIZES = tuple(2**k for k in range(10, 31, 2))  # 1 KiB, 4 KiB, ..., 1 GiB


def bench_allreduce(comm: Communicator, sizes=DEFAULT_SIZES, iters=None, ring=True, warmup=2) -> list:
    """Time comm.all_reduce (the engine's: NCCL or MPI) and ring_allreduce on float32 buffers of each size (bytes).

    Per row: size_bytes, algo, time_us (mean per call over iters, the slowest rank's), algbw_GBps = bytes / time,
    busbw_GBps = algbw x 2(N-1)/N (nccl-tests' definitions: busbw is what each link carries, comparable across N).
    iters None: about 0.2 s of calls per size (at least 3)."""
    N = comm.world_size
    gpu = comm.name == "nccl"
    xp = comm.array_module() if gpu else np
    rows = []
    for size in sizes:
        n = max(1, int(size) // 4)
        buf = xp.zeros(n, xp.float32)  # zeros: sums stay finite however often we add
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
            rows.append(
                {
                    "size_bytes": n * 4,
                    "algo": algo,
                    "iters": k,
                    "time_us": sec * 1e6,
                    "algbw_GBps": algbw,
                    "busbw_GBps": algbw * 2 * (N - 1) / N,
                }
            )
    return rows


def _size(b) -> str:
    for unit, k in (("GB", 2**30), ("MB", 2**20), ("KB", 2**10)):
        if b >= k:
            return f"{b / k:g} {unit}"
    return f"{b} B"


def format_bench(result) -> str:
    """The table of a bench result (dict with rows, world, comm, card, date)."""
    lines = [
        f"all-reduce, {result['world']} ranks, {result['comm']} ({result['card']}, {result['date']}); "
        f"busbw = algbw x 2(N-1)/N",
        f"{'size':>9} {'algo':<6}{'time us':>11}{'algbw GB/s':>12}{'busbw GB/s':>12}",
    ]
    for r in result["rows"]:
        lines.append(
            f"{_size(r['size_bytes']):>9} {r['algo']:<6}{r['time_us']:11.1f}{r['algbw_GBps']:12.2f}"
            f"{r['busbw_GBps']:12.2f}"
        )
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
    return {
        "world": comm.world_size,
        "comm": comm.name,
        "card": _where(comm),
        "date": datetime.date.today().isoformat(),
        "rows": rows,
    }


def dp_bench(
    comm, preset="gpt2", precision="bf16", batch_per_rank=16, steps=10, warmup=3, zero=False, backend="auto"
) -> dict:
    """Tokens/s of data-parallel training steps on random tokens: B = batch_per_rank rows per rank, T = block size."""
    from .. import engine as engine_mod
    from ..model.params import GPTConfig
    from ..model.params import PRESETS

    p = dict(PRESETS[preset])
    p.pop("batch_size")
    p.pop("lr")
    cfg = GPTConfig(**p)
    T = cfg.block_size
    eng = engine_mod.build(cfg, engine_mod.check_backend(backend), precision=precision)
    dp = DataParallel(eng, comm, zero=zero)
    rng = np.random.default_rng(comm.rank)
    batches = [
        (
            rng.integers(0, cfg.vocab_size, (batch_per_rank, T)).astype(np.int32),
            rng.integers(0, cfg.vocab_size, (batch_per_rank, T)).astype(np.int32),
        )
        for _ in range(steps + warmup)
    ]
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
    return {
        "preset": preset,
        "precision": precision,
        "world": comm.world_size,
        "comm": comm.name,
        "zero": zero,
        "batch_per_rank": batch_per_rank,
        "T": T,
        "step_ms": 1e3 * sec,
        "comm_ms": 1e3 * float(np.median(comm_times)),
        "tokens_per_s": comm.world_size * batch_per_rank * T / sec,
        "optimizer_bytes": dp.optimizer_bytes(),
    }
