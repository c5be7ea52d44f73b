"""The command line of the ranks (each rank runs it; start them with the launcher or mpirun): selftest, bench,
dpbench, train (the training job itself, gpullm_lessons.train, on these ranks), pipeline (pipeline-parallel training
of the NumPy GPT, one stage per rank: parallel/pipeline.py), tensor (Megatron-style tensor-parallel training of the
NumPy GPT: parallel/tensor.py), ulysses (sequence-parallel training with all-to-alls around attention:
parallel/ulysses.py) and ring-attention (the self-check of sequence-parallel
causal attention: parallel/ring_attention.py). See the package docstring."""

from __future__ import annotations

import json
import os
import sys

from .comm import from_env
from .benchmark import bench_result, dp_bench, format_bench
from .ring import selftest


def main(argv=None) -> int:
    import argparse

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "train":  # the training job itself (train.py), its flags follow
        from ..train import cli

        cli(argv[1:])  # configuration problems: "error: ..." and exit status 2
        return 0
    if argv and argv[0] == "pipeline":  # pipeline parallel training, one stage per rank: its flags follow
        from .pipeline import cli as pipeline_cli

        return pipeline_cli(argv[1:])  # configuration problems: "error: ..." and exit status 2
    if argv and argv[0] == "zero3":  # ZeRO-3 (fully sharded data parallel) training (zero3.py): its flags follow
        from .zero3 import cli as zero3_cli

        return zero3_cli(argv[1:])  # configuration problems: "error: ..." and exit status 2
    if argv and argv[0] == "tensor":  # Megatron-style tensor-parallel training (tensor.py): its flags follow
        from .tensor import cli as tensor_cli

        return tensor_cli(argv[1:])  # configuration problems: "error: ..." and exit status 2
    if argv and argv[0] == "ulysses":  # DeepSpeed-Ulysses sequence-parallel training (ulysses.py): its flags follow
        from .ulysses import cli as ulysses_cli

        return ulysses_cli(argv[1:])  # configuration problems: "error: ..." and exit status 2
    if argv and argv[0] == "ring-attention":  # ring attention's self-check (ring_attention.py): its flags follow
        from .ring_attention import cli as ring_attention_cli

        return ring_attention_cli(argv[1:])  # 1: an error over tolerance; 2: "error: ..." (T not divisible by N)
    p = argparse.ArgumentParser(
        prog="python -m gpullm_lessons.parallel",
        description="collectives self-test, all-reduce benchmark, data-parallel throughput, pipeline training "
        "(run on every rank: start with python -m gpullm_lessons.parallel.launch)",
    )
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
    sub.add_parser("pipeline", help="pipeline-parallel training (GPipe / 1F1B), one stage per rank: its flags follow")
    sub.add_parser("zero3", help="ZeRO-3 (fully sharded data parallel) training of the NumPy GPT: its flags follow")
    sub.add_parser("tensor", help="tensor-parallel (Megatron) training of the NumPy GPT: its flags follow")
    sub.add_parser("ulysses", help="sequence-parallel (DeepSpeed-Ulysses) training of the NumPy GPT: its flags follow")
    sub.add_parser("ring-attention", help="ring attention (sequence parallel) vs one rank: its flags follow")
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
            res = dp_bench(
                comm, args.preset, args.precision, args.batch_per_rank, args.steps, zero=args.zero, backend=args.backend
            )
            if comm.rank == 0:
                print(json.dumps(res))
                print(
                    f"data parallel {res['preset']} {res['precision']}: {res['world']} rank(s) x B={res['batch_per_rank']}"
                    f", {res['step_ms']:.1f} ms/step (gradient comm {res['comm_ms']:.1f} ms), "
                    f"{res['tokens_per_s']:,.0f} tokens/s"
                )
                if args.json:
                    with open(args.json, "w") as f:
                        json.dump(res, f, indent=1)
            return 0
    finally:
        comm.close()
    return 1


if __name__ == "__main__":
    sys.exit(main())
