"""What the NumPy training commands on CPU ranks share (pipeline.py's `pipeline`, zero3.py's `zero3`, tensor.py's
`tensor`): the training job's model, data and optimizer flags (same names and defaults as python -m
gpullm_lessons.train, so the same flags give the same run on one rank), their checks, the run they describe, and the
command-line wrapper.

    p = job_parser(prog, description)        the shared flags; the command adds its own (and --json)
    job = job_from_args(args, comm, positive={"--micro-batches": m}, check=fn)
                                             the model, batch, learning-rate schedule and batches of the run
    for step, res in job.run(steps, lambda x, y, lr: ...)   each step: the batches, the schedule, a finite loss
    return run_cli(main, argv)               configuration problems: one "error: ..." line, exit status 2
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys

import numpy as np


def job_parser(prog: str, description: str, json=None) -> argparse.ArgumentParser:
    """An ArgumentParser with the training job's model, data and optimizer flags and its defaults; json: what the
    command's --json file holds (the flag is added when given)."""
    from ..model.params import PRESETS
    from ..train import build_parser as train_parser

    d = train_parser().parse_args([])  # the training job's defaults
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--preset", choices=list(PRESETS), default=d.preset, help="model size and defaults")
    for flag, what in (("--n-layer", "layers L"), ("--n-head", "heads nh"), ("--d-model", "channels C")):
        p.add_argument(flag, type=int, default=None, help=f"override the preset's {what}")
    p.add_argument("--block-size", type=int, default=None, help="override the preset's context length T")
    p.add_argument("--batch-size", type=int, default=None, help="GLOBAL sequences per step B (default: the preset's)")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the preset's)")
    p.add_argument("--min-lr", type=float, default=None, help="final learning rate (default: lr / 10)")
    p.add_argument("--warmup", type=int, default=None, help="linear warmup steps (default: steps // 10)")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay, help="AdamW decoupled weight decay")
    p.add_argument("--grad-clip", type=float, default=d.grad_clip, help="clip the global gradient norm (0: off)")
    p.add_argument("--data", default=d.data, help="a text file read as bytes (default: Python's help topics)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed for init and batches")
    if json:
        p.add_argument("--json", default=None, help=f"write the run's {json} here (rank 0)")
    return p


@dataclasses.dataclass
class Job:
    """The run the flags describe: the model, the global batch B, the learning-rate schedule's lr / warmup / min_lr,
    the training job's batches (the same on every rank) and the communicator."""

    cfg: object
    B: int
    lr: float
    warmup: int
    min_lr: float
    batches: object
    comm: object

    def run(self, steps: int, step):
        """Yield (step number from 1, step(x, y, lr)'s result) for `steps` steps: the training job's batches and
        learning-rate schedule; a non-finite loss raises RuntimeError naming the step."""
        from ..model.optim import lr_schedule

        for n in range(1, steps + 1):
            x, y = next(self.batches)
            res = step(x, y, lr_schedule(n - 1, self.lr, self.warmup, steps, self.min_lr))
            if not math.isfinite(res["loss"]):
                raise RuntimeError(f"loss is {res['loss']} at step {n}: training diverged; try a lower --lr")
            yield n, res


def job_from_args(args, comm=None, positive=None, check=None) -> Job:
    """The Job of parsed job_parser flags; ConfigError (naming the flag) for a size below 1 (the model's, the
    batch's, --steps and the command's own `positive` {flag: value}) or d_model not divisible by n_head; then
    check(preset dict, B, comm) for the command's own rules (it raises ConfigError), before the corpus is read.
    comm: default the environment's (MPI ranks, or one)."""
    from ..data import BatchSampler, load_corpus
    from ..model.params import PRESETS, GPTConfig
    from ..train import ConfigError, communicator

    preset = dict(PRESETS[args.preset])
    for key in ("n_layer", "n_head", "d_model", "block_size", "batch_size", "lr"):
        if getattr(args, key) is not None:
            preset[key] = getattr(args, key)
    B, lr = preset.pop("batch_size"), preset.pop("lr")
    sizes = {"--n-layer": preset["n_layer"], "--n-head": preset["n_head"], "--d-model": preset["d_model"]}
    sizes.update({"--block-size": preset["block_size"], "--batch-size": B, "--steps": args.steps, **(positive or {})})
    for flag, value in sizes.items():
        if value < 1:
            raise ConfigError(f"{flag} must be a positive integer, got {value}")
    if preset["d_model"] % preset["n_head"]:
        raise ConfigError(
            f"d_model {preset['d_model']} is not divisible by n_head {preset['n_head']} (--d-model / --n-head)"
        )
    comm = communicator("numpy") if comm is None else comm
    if check is not None:
        check(preset, B, comm)
    cfg = GPTConfig(**preset)
    try:
        corpus = load_corpus(args.data, block_size=cfg.block_size)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(str(e)) from e
    return Job(
        cfg=cfg,
        B=B,
        lr=lr,
        warmup=args.steps // 10 if args.warmup is None else args.warmup,
        min_lr=lr / 10 if args.min_lr is None else args.min_lr,
        batches=BatchSampler(corpus.train, B, cfg.block_size, seed=args.seed),  # the training job's batches
        comm=comm,
    )


def run_cli(main, argv=None) -> int:
    """main(argv) with one BLAS thread per rank (as the training job); configuration problems print one line and exit
    with status 2."""
    from ..train import ConfigError

    try:
        try:
            from threadpoolctl import threadpool_limits
        except ImportError:
            main(argv)
        else:
            with threadpool_limits(limits=1, user_api="blas"):
                main(argv)
    except (ConfigError, FileNotFoundError) as e:
        sys.stderr.write(f"error: {e}\n")
        sys.stderr.flush()
        return 2
    return 0


def held_bytes(obj, params=None) -> int:
    """Bytes of the NumPy arrays reachable from obj (dicts, lists, tuples: an op's cache), each array's own elements
    (a view counts what it shows, e.g. this rank's positions of the batch), the same view counted once, none that
    lies inside the flat array `params` (the parameters the ops' caches refer to are the model, not activations)."""
    skip = (0, 0)
    if params is not None:
        at = params.__array_interface__["data"][0]
        skip = (at, at + params.nbytes)
    seen = set()

    def walk(o):
        if isinstance(o, np.ndarray):
            at = o.__array_interface__["data"][0]
            if skip[0] <= at < skip[1] or (at, o.nbytes) in seen:
                return 0
            seen.add((at, o.nbytes))
            return o.nbytes
        if isinstance(o, dict):
            return sum(walk(v) for v in o.values())
        if isinstance(o, (list, tuple)):
            return sum(walk(v) for v in o)
        return 0

    return walk(obj)


def write_summary(comm, path, summary: dict) -> None:
    """Rank 0 writes the command's summary as JSON to path (the --json flag; None: nothing), its folder made."""
    import json
    from pathlib import Path

    if comm.rank == 0 and path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(summary, indent=1) + "\n")


def whole_params(fn, cfg, params) -> np.ndarray:
    """The whole model's flat parameters from a ParamBuffer or its flat array (every rank passes the same:
    init_params(cfg, seed), the one-rank run's values); ValueError naming fn when the count is not the model's."""
    from ..model.params import num_params

    flat = np.asarray(getattr(params, "flat", params))
    if flat.shape != (num_params(cfg),):
        raise ValueError(f"{fn}: params hold {flat.shape} values, this model has ({num_params(cfg)},)")
    return flat
