"""Lesson 13's five strategies on the course preset: each trained on 2 and 4 CPU ranks against its one-rank run.

    python -m gpullm_lessons.parallel.course_check --json runs/strategies_course.json   (make strategies)

For each strategy (ZeRO-3, tensor parallelism with and without sequence parallelism, the 1F1B pipeline, Ulysses) the
command trains the same model for the same steps three ways: in this process on one rank (the reference), then on
N = 2 and N = 4 MPI ranks started by the launcher. A row passes when

- every step's loss is within LOSS_TOLERANCE of the one-rank loss: the ranks compute in float32 and sum the same
  numbers in another order (each rank's mean over its rows, then the all-reduce; a split matrix product's partial
  sums), so the losses agree to float32 rounding of the sums, not bitwise;
- what each rank holds is within MEMORY_TOLERANCE of the strategy's own model: ZeRO-3's peak of parameters,
  gradients and optimizer state (zero3's memory_model), tensor parallelism's parameters, gradients, m and v per rank
  (tensor's memory_model), Ulysses' activations (1/N of one rank's), the pipeline's micro-batches held at once per
  stage (the 1F1B table's count, exactly).

A configuration a strategy cannot run is refused by the rank command with a one-line reason (exit status 2), and the
row says so: the course preset's 6 heads do not split over 4 ranks (tensor parallelism, Ulysses). Its 6 blocks go to
4 pipeline stages as 2, 2, 1, 1. The run is on CPU ranks, NumPy arithmetic; the batch is cut to --batch-size
sequences (8 by default), the model is the preset's: the whole check takes about two minutes on 2 cores (CI runs it,
tests/test_course_check.py) and lesson 13 prints the stored run (results/strategies_course_cpu.json).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

from .comm import SingleComm
from .launching import launch_subprocess

LOSS_TOLERANCE = 1e-5  # |loss on N ranks - loss on one rank| at every step (float32 sums in another order)
MEMORY_TOLERANCE = 0.10  # each rank's measured bytes within 10% of the strategy's model
# name -> (rank command, its extra arguments)
STRATEGIES = {
    "zero3": ("zero3", []),
    "tensor": ("tensor", []),
    "tensor+sp": ("tensor", ["--sequence-parallel"]),
    "pipeline-1f1b": ("pipeline", ["--schedule", "1f1b", "--micro-batches", "4"]),
    "ulysses": ("ulysses", []),
}


def _module(command: str):
    from . import pipeline, tensor, ulysses, zero3

    return {"zero3": zero3, "tensor": tensor, "pipeline": pipeline, "ulysses": ulysses}[command]


def memory_check(command: str, one: dict, got: dict, N: int) -> dict:
    """What each of N ranks holds against the strategy's model: {"what", "measured" (per rank), "predicted",
    "ratio" (largest measured / predicted), "ok"}. one: the one-rank run's result (Ulysses: 1/N of its activations)."""
    if command == "zero3":
        what, measured, predicted = (
            "parameters, gradients, m, v at the peak",
            got["peak_bytes"][-1],
            got["memory_model"]["peak"],
        )
    elif command == "tensor":
        what, measured, predicted = "parameters, gradients, m, v", got["bytes"][-1], got["memory_model"]["total"]
    elif command == "ulysses":
        what, measured, predicted = (
            "activations kept for backward",
            list(got["cache_bytes"][-1]),
            one["cache_bytes"][-1][0] / N,
        )
    elif command == "pipeline":
        what, measured = "micro-batches held at once, per stage", got["peak_activations"]
        table = got["peak_activations_table"]
        ratio = max(m / t for m, t in zip(measured, table))
        return {"what": what, "measured": measured, "predicted": table, "ratio": ratio, "ok": measured == table}
    else:
        raise ValueError(f"memory_check: no memory model for {command!r}")
    ratio = max(m / predicted for m in measured)
    ok = all(abs(m / predicted - 1) <= MEMORY_TOLERANCE for m in measured)
    return {"what": what, "measured": list(measured), "predicted": predicted, "ratio": ratio, "ok": ok}


def _refusal(stderr: str) -> str | None:
    lines = [line[len("error: ") :] for line in stderr.splitlines() if line.startswith("error: ")]
    return lines[0] if lines else None


def run(preset="course", ranks=(2, 4), steps=2, batch_size=8, strategies=None, timeout=1800, log=print) -> dict:
    """Every strategy on one rank and on each N of ranks; returns {"rows": [...], "ok"} (module docstring)."""
    names = list(STRATEGIES) if strategies is None else list(strategies)
    for n in names:
        if n not in STRATEGIES:
            raise ValueError(f"course_check: no strategy {n!r}; the strategies are {', '.join(STRATEGIES)}")
    model = ["--preset", preset, "--batch-size", str(batch_size), "--steps", str(steps)]
    rows = []
    with tempfile.TemporaryDirectory(prefix="course-check-") as tmp:
        for name in names:
            command, extra = STRATEGIES[name]
            args = [*model, *extra]
            t0 = time.perf_counter()
            with contextlib.redirect_stdout(io.StringIO()):
                one = _module(command).main(args, comm=SingleComm())
            log(
                f"{name}: one rank, losses {' '.join(f'{x:.6f}' for x in one['losses'])} ({time.perf_counter() - t0:.0f} s)"
            )
            for N in ranks:
                out = Path(tmp) / f"{name}-{N}.json"
                t0 = time.perf_counter()
                p = launch_subprocess(N, [command, *args, "--json", out], comm="mpi", timeout=timeout)
                row = {
                    "strategy": name,
                    "command": [command, *args],
                    "ranks": N,
                    "seconds": round(time.perf_counter() - t0, 1),
                }
                if p.returncode == 2 and _refusal(p.stderr):
                    row.update(status="refused", reason=_refusal(p.stderr))
                elif p.returncode != 0 or not out.exists():
                    row.update(status="failed", reason=(p.stdout + p.stderr)[-1500:])
                else:
                    got = json.loads(out.read_text())
                    diff = max(abs(a - b) for a, b in zip(got["losses"], one["losses"]))
                    mem = memory_check(command, one, got, N)
                    ok = diff <= LOSS_TOLERANCE and len(got["losses"]) == len(one["losses"]) and mem["ok"]
                    row.update(
                        status="ok" if ok else "wrong",
                        losses=got["losses"],
                        one_rank_losses=one["losses"],
                        max_loss_diff=diff,
                        memory=mem,
                    )
                rows.append(row)
                log(_row_line(row))
    runnable = [r for r in rows if r["status"] != "refused"]
    return {
        "preset": preset,
        "batch_size": batch_size,
        "steps": steps,
        "ranks": list(ranks),
        "loss_tolerance": LOSS_TOLERANCE,
        "memory_tolerance": MEMORY_TOLERANCE,
        "rows": rows,
        "ok": bool(runnable) and all(r["status"] == "ok" for r in runnable),
    }


def _row_line(row: dict) -> str:
    head = f"{row['strategy']:>13} on {row['ranks']} ranks: "
    if row["status"] == "refused":
        return head + f"refused: {row['reason']}"
    if row["status"] == "failed":
        return head + "FAILED: " + row["reason"].strip().splitlines()[-1][:200]
    mem = row["memory"]
    return head + (
        f"{row['status']}, largest loss difference {row['max_loss_diff']:.1e} (tolerance {LOSS_TOLERANCE:.0e}); "
        f"{mem['what']}: measured / model {mem['ratio']:.3f} ({row['seconds']:.0f} s)"
    )


def machine() -> str:
    """The CPU this ran on: its model name (Linux /proc/cpuinfo) and the cores Python sees."""
    name = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    return f"CPU: {name}, {os.cpu_count()} cores"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m gpullm_lessons.parallel.course_check", description=__doc__.split("\n")[0]
    )
    p.add_argument("--preset", default="course")
    p.add_argument("--ranks", default="2,4", help="comma-separated rank counts")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--strategies", default=",".join(STRATEGIES), help=f"comma-separated, from {', '.join(STRATEGIES)}")
    p.add_argument("--json", default=None, help="write the result here (card, date, commit added)")
    a = p.parse_args(argv)
    try:
        ranks = tuple(int(x) for x in a.ranks.split(","))
        res = run(a.preset, ranks, a.steps, a.batch_size, a.strategies.split(","))
    except ValueError as e:
        sys.stderr.write(f"error: {e}\n")
        return 2
    res.update(card=machine(), date=date.today().isoformat(), commit=os.environ.get("GPULLM_COMMIT"))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(res, indent=1) + "\n")
    print("every runnable row within its tolerances" if res["ok"] else "SOME ROWS FAILED")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
