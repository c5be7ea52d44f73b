"""Several ranks, one model: ring all-reduce by hand, data parallel training and ZeRO-1/2, on a communicator (parallel/comm.py).

    ring_allreduce_sim(buffers)          the ring all-reduce of N simulated ranks in NumPy, with its step log
    ring_allreduce(comm, buf)            the same algorithm across real ranks, over comm.sendrecv
    DataParallel(engine, comm, zero=)    one training step on every rank: local slice -> gradients -> all-reduce
                                         (or ZeRO-1: reduce-scatter, AdamW on the local shard, all-gather;
                                         ZeRO-2: the same, keeping only the shard of the reduced gradient)
    assign_buckets(sizes, limit)         gradient tensors packed into buckets in the order backward finishes them
                                         (DataParallel(bucket_mb=, overlap=): buckets.py, lesson 12)
    bench_allreduce(comm, sizes)         algorithm and bus bandwidth (nccl-tests' definitions), engine vs ring
    pipeline.gpipe_schedule(p, m)        pipeline parallelism (pipeline.py): the GPipe and 1F1B schedules as tables
    pipeline.one_f_one_b_schedule(p, m)  (bubble_fraction, peak_activations, validate_schedule, format_schedule) and
    pipeline.train_step(stage, comm, ..) the NumPy GPT's blocks split into stages, one per CPU rank
    zero3.Zero3(cfg, comm, params)       ZeRO-3 (zero3.py): params, grads and AdamW state 1/N per rank, each unit
                                         gathered only while it computes (zero3_memory: the bytes per rank)
    zero3.ZeroPP(cfg, comm, params)      ZeRO++'s qwZ and qgZ on it: the gathers and the reduce-scatter in int8 blocks
    ring_attention.ring_attention_forward(comm, q, k, v)   ring attention (ring_attention.py): the sequence split
                                         over the ranks, k/v blocks around the ring, merged by lse (and its backward)
    tensor.TensorParallel(cfg, comm, params)   Megatron tensor parallelism (tensor.py): qkv and fc column-, the
                                         projections row-parallel, 2 all-reduces per block each way (tp_memory)
    tensor.SequenceParallel(cfg, comm, params)  the same with Megatron's sequence parallelism (T/N positions outside
                                         the split linears; all-gathers and reduce-scatters along T)
    ulysses.Ulysses(cfg, comm, params)   DeepSpeed-Ulysses (ulysses.py): T/N positions per rank, all-to-alls around
                                         attention (comm.all_to_all)
    plan.state_per_rank(cfg, N, strategy)  which strategy on how many GPUs (plan.py): each strategy's model state
                                         per rank, plan.fits_table, and the alpha-beta model of its messages

The training job on N ranks is train.py's own loop (gpullm_lessons.train.train: one loop for 1..N ranks), which
wraps its engine in DataParallel; `python -m gpullm_lessons.parallel train ...` runs it.

CLI (each rank runs it; start the ranks with the launcher or mpirun):
    python -m gpullm_lessons.parallel.launch --nproc 2 --module gpullm_lessons.parallel -- selftest
    python -m gpullm_lessons.parallel.launch --nproc 2 --module gpullm_lessons.parallel -- bench --json runs/allreduce.json
    python -m gpullm_lessons.parallel.launch --nproc 2 --module gpullm_lessons.parallel -- train --steps 50 [--zero]
    python -m gpullm_lessons.parallel.launch --nproc 2 --module gpullm_lessons.parallel -- dpbench --preset gpt2
    python -m gpullm_lessons.parallel.launch --nproc 4 --backend mpi --module gpullm_lessons.parallel -- pipeline --schedule 1f1b
    python -m gpullm_lessons.parallel.launch --nproc 2 --backend mpi --module gpullm_lessons.parallel -- zero3 --steps 5
    python -m gpullm_lessons.parallel.launch --nproc 4 --backend mpi --module gpullm_lessons.parallel -- ring-attention
    python -m gpullm_lessons.parallel.launch --nproc 2 --backend mpi --module gpullm_lessons.parallel -- tensor --n-head 4
    python -m gpullm_lessons.parallel.launch --nproc 2 --backend mpi --module gpullm_lessons.parallel -- ulysses --n-head 4

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
ZeRO-2 (zero=2) also shards the gradient: after the reduce-scatter a rank keeps only its summed shard and drops its
full-size local gradient until the next backward writes a fresh one (the same arithmetic as ZeRO-1, so the same
losses). The engines write their gradient into one flat buffer, so during backward a rank still holds all of its own;
the paper's ZeRO-2 reduces each bucket as backward finishes it and frees it, which would need a backward writing into
bucket-sized buffers.

Buckets and overlap (buckets.py): with bucket_mb > 0 the gradient tensors are packed into buckets in the order
backward finishes them (assign_buckets); overlap=True starts each bucket's all-reduce (non-blocking: MPI's Iallreduce,
NCCL on a second stream) from backward's grads_ready hook as soon as its layers are final, and waits for all of them
before the update. The time the step still waits is the exposed communication (comm_exposed_s in the log).
"""

from __future__ import annotations

from .benchmark import (
    DEFAULT_SIZES,
    bench_allreduce,
    bench_result,
    dp_bench,
    format_bench,  # noqa: F401
    ring_fraction,
)
from .buckets import GradBuckets, assign_buckets  # noqa: F401
from .data_parallel import (
    ZERO_STAGES,  # noqa: F401
    DataParallel,
    ReplicaMismatch,
    shard_bounds,
    shard_decay_table,
    shard_size,  # noqa: F401
    zero_memory_table,
)
from .launching import launch_plan, launch_subprocess  # noqa: F401
from .ring import (
    check_allreduce,
    chunk_bounds,
    ring_allreduce,
    ring_allreduce_chunks,
    ring_allreduce_sim,  # noqa: F401
    ring_contributions,
    selftest,
)

__all__ = [
    "chunk_bounds",
    "ring_allreduce_chunks",
    "ring_allreduce_sim",
    "ring_allreduce",
    "check_allreduce",
    "shard_size",
    "shard_bounds",
    "shard_decay_table",
    "DataParallel",
    "ReplicaMismatch",
    "assign_buckets",
    "bench_allreduce",
    "format_bench",
    "zero_memory_table",
]
