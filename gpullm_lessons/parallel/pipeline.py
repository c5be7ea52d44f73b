"""Pipeline parallelism: the GPT's blocks cut into p stages, one rank each, and the batch cut into m micro-batches
that flow through them under a schedule (GPipe or 1F1B): the schedules as tables, their bubble and memory, and a
training step of the NumPy GPT on CPU ranks that gives the one-rank losses.

    gpipe_schedule(p, m)                 the tick table of GPipe: all m forwards, then all m backwards
    one_f_one_b_schedule(p, m)           the tick table of 1F1B: p - s - 1 forwards, then one forward one backward
    timed_schedule(orders)               the table of any per-stage order of ops, each op as early as it can run
    validate_schedule(schedule, m)       every op once, in an order the data allows; ValueError names the first fault
    bubble_fraction(schedule)            the idle fraction of the stage-ticks: (p - 1) / (m + p - 1) for both
    peak_activations(schedule)           per stage, the most micro-batches whose activations it holds at once
    format_schedule(schedule)            the table as text, rows = stages, columns = ticks
    make_schedule(name, p, m)            "gpipe" or "1f1b" by name (the command's --schedule)
    stage_layers(n_layer, p)             the contiguous blocks [l0, l1) of each stage
    Stage(cfg, s, p, params)             stage s: its parameters, forward / backward of one micro-batch, AdamW
    train_step(stage, comm, schedule, x, y, lr, ...)   one step on this rank (the stages talk over comm)
    simulate_step(stages, schedule, x, y, lr, ...)     the same step with all p stages in one process
    check_tied(stage, comm)              whether the two copies of the tied wte (first and last stage) are equal

CLI (each rank is one stage; start the ranks with the launcher or mpirun):
    python -m gpullm_lessons.parallel.launch --nproc 2 --backend mpi --module gpullm_lessons.parallel -- \\
        pipeline --schedule 1f1b --micro-batches 4 --n-layer 4 --steps 5

The stages. Stage s holds blocks [l0, l1) (stage_layers: contiguous, as even as n_layer allows, the first stages
one longer); stage 0 also holds the embeddings wte, wpe, the last stage the final LayerNorm and the LM head. Stage s
runs its blocks' forward on the activation (b, T, C) of a micro-batch of b = B / m rows that stage s - 1 sent, and
sends its own output to stage s + 1; in backward the gradient of that activation goes the other way. Nothing else
crosses a stage boundary: (b, T, C) floats per micro-batch and direction, where data parallel sends every gradient.

The schedules, in ticks: one tick is one forward of one micro-batch on one stage; a backward takes backward_cost
ticks (1 by default; about 2 in practice: it computes the gradients of both the input and the weights). Communication
is taken as free. Cell ("F", i): the stage runs micro-batch i's forward in that tick; ("B", i): its backward; None:
idle. p = 3 stages, m = 4 micro-batches (format_schedule):

    GPipe   tick    0  1  2  3  4  5  6  7  8  9  10 11      1F1B   tick    0  1  2  3  4  5  6  7  8  9  10 11
            stage 0 F0 F1 F2 F3 .  .  .  .  B0 B1 B2 B3             stage 0 F0 F1 F2 .  .  B0 F3 B1 .  B2 .  B3
            stage 1 .  F0 F1 F2 F3 .  .  B0 B1 B2 B3 .              stage 1 .  F0 F1 .  B0 F2 B1 F3 B2 .  B3 .
            stage 2 .  .  F0 F1 F2 F3 B0 B1 B2 B3 .  .              stage 2 .  .  F0 B0 F1 B1 F2 B2 F3 B3 .  .

A forward of micro-batch i on stage s needs its forward on stage s - 1; a backward needs the backward on stage s + 1
and the stage's own forward of i (its activations). The bubble: in GPipe stage s waits s ticks for its first input
(the pipe fills), 2 (p - 1 - s) ticks between its last forward and its first backward (the last micro-batch goes down
the rest of the pipe, the first gradient comes back up) and s ticks after its last backward (the pipe drains): 2 (p - 1)
idle ticks on every stage, busy m forward and m backward ticks of a step of (m + p - 1) forward and (m + p - 1)
backward ticks:

    bubble = idle / (p x ticks) = (p - 1) / (m + p - 1)        (any backward_cost: both phases stretch alike)

p = 3, m = 4: 2/6 = 1/3 of the stage-ticks above are idle. More micro-batches shrink it (m = 16: 2/18), but each
stage must then keep the activations of all m micro-batches until their backwards (GPipe holds m on every stage).
1F1B (PipeDream-Flush, Megatron-LM's default) runs the same ops in another order: stage s starts with p - s - 1
forwards (warm-up), then alternates one forward, one backward (steady state), then finishes the remaining backwards
(cool-down). Its bubble is the same, (p - 1) / (m + p - 1), but a micro-batch's activations are freed as soon as
possible: stage s holds at most p - s micro-batches at once, whatever m is (peak_activations), so m can grow to
shrink the bubble without growing the memory. Both schedules run the backwards in micro-batch order 0, 1, ..., m - 1,
so each stage adds up its gradients in the order Engine.forward_backward(micro_batches=m) does.

On ranks (train_step): every rank walks the same tick table and runs its own cell. At the end of each tick the
messages of the ops that finished in it cross the stage boundaries: the activation of a forward to the next stage,
the gradient of a backward to the previous one. A boundary with a message each way does comm.sendrecv (one send
blocking against the other would deadlock: 1F1B's steady state sends both ways at once); one way, send / recv. Each
rank handles the boundary to its previous stage first, then the one to its next stage, so the boundaries of a tick go
in order 0, 1, ..., p - 2 and no rank waits for one that waits for it. A rank blocks only where the table says a
message crosses. The measured bubble is 1 - (the stages' seconds computing) / (p x the slowest stage's seconds of
forwards and backwards): the table's idle fraction on the clock, where communication and Python's overhead count as
idle too (on CPU ranks with a toy model they dominate).

The tied embedding: wte is both the embedding (stage 0) and the LM head (the last stage), so both hold a copy and each
computes only its own use's part of the gradient (the one-rank backward adds the two: reference/gpt.py). After the
backwards the two ranks exchange their parts (sendrecv) and both form (stage 0's part) + (stage p-1's part), the same
sum in the same order, so the same bits; their AdamW updates are then identical and the copies stay equal (the end of
a run checks it: check_tied). Megatron-LM does the same with an all-reduce over its "embedding group".

Clipping needs the global gradient norm: every stage's squared norm (wte counted once, on stage 0) gathered on every
rank and summed there in stage order, so all ranks take the same clip factor. Then each stage runs AdamW on its own
parameters, its own m and v: the optimizer state is split p ways with no extra communication.

Numerics: the same losses as the one-rank run to rounding, not bitwise. Against the one-rank training job on the whole
batch (python -m gpullm_lessons.train --backend numpy) the differences are: (1) the gradient of a step is the sum of
the m micro-batches' gradients (each scaled by 1 / m), where one rank sums all B rows inside each matrix product, a
different order of the same additions; (2) the loss is the mean of the m micro-batch means; (3) wte's gradient is
summed over the micro-batches per use and then the two uses added, where the one-rank backward adds the two uses per
micro-batch; (4) the squared norm is summed per stage. Each is a rounding difference of about 1e-7 relative in
float32; AdamW carries them into the next steps' weights. The tests allow 1e-5 absolute on losses of about 5.5 nats
over a few steps (measured: at most 5e-7, L = 4, C = 32, 3 steps, on 2 and 4 ranks). Against the one-rank engine on
the same m micro-batches (Engine.forward_backward(micro_batches=m)) only (3) and (4) remain: the first step's loss and
every gradient but wte's are bitwise equal, and a single stage (p = 1) is bitwise equal throughout.

This is the course's toy: every rank initialises the whole model (init_params, the one-rank values) and keeps only its
stage's tensors; the model runs in the NumPy reference on CPU ranks over MPI. Interleaved stages (several chunks of
blocks per rank: a smaller bubble for more messages) and zero-bubble schedules (splitting the backward into its input
and weight halves) build on the same table.
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

from .numpy_job import whole_params

KINDS = ("F", "B")  # a forward, a backward
SCHEDULES = ("gpipe", "1f1b")


# ================================================================================================================
# 1. Schedules: pure functions of (p, m) -> the tick table
# ================================================================================================================


def _check_count(fn, name, value, low=1):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{fn}: {name} must be a whole number >= {low}, got {value!r}")
    return int(value)


def _label(op) -> str:
    return f"{op[0]}{op[1]}"


def _what(op) -> str:
    return f"the {'forward' if op[0] == 'F' else 'backward'} {_label(op)}"


def _deps(s: int, p: int, op) -> list:
    """What op on stage s waits for, as (stage, op): a forward for the previous stage's forward of that micro-batch; a
    backward for the next stage's backward of it and for its own stage's forward (the activations it differentiates)."""
    kind, mb = op
    if kind == "F":
        return [(s - 1, ("F", mb))] if s > 0 else []
    return [(s, ("F", mb))] + ([(s + 1, ("B", mb))] if s < p - 1 else [])


def gpipe_order(p: int, m: int) -> list:
    """Per stage, GPipe's order of ops: F0 .. F(m-1), then B0 .. B(m-1) (every stage the same)."""
    p, m = _check_count("gpipe_order", "p (stages)", p), _check_count("gpipe_order", "m (micro-batches)", m)
    return [[("F", i) for i in range(m)] + [("B", i) for i in range(m)] for _ in range(p)]


def one_f_one_b_order(p: int, m: int) -> list:
    """Per stage, 1F1B's order of ops: stage s runs w = min(p - s - 1, m) forwards (warm-up), then forward w + i and
    backward i for i = 0 .. m - w - 1 (steady state), then the last w backwards (cool-down)."""
    p, m = _check_count("one_f_one_b_order", "p (stages)", p), _check_count("one_f_one_b_order", "m (micro-batches)", m)
    orders = []
    for s in range(p):
        w = min(p - s - 1, m)
        ops = [("F", i) for i in range(w)]
        for i in range(m - w):
            ops += [("F", w + i), ("B", i)]
        orders.append(ops + [("B", i) for i in range(m - w, m)])
    return orders


def timed_schedule(orders, backward_cost: int = 1) -> list:
    """The tick table of per-stage orders of ops (orders[s]: stage s's ("F", i) / ("B", i), in the order it runs
    them): every op starts as soon as its stage is free and what it waits for has finished (_deps); a forward takes
    1 tick, a backward backward_cost ticks (its cell repeated). Returns [tick][stage] -> op or None.

    ValueError when the orders cannot run to the end (an op waits for one that never runs, or runs only after it)."""
    cost = {"F": 1, "B": _check_count("timed_schedule", "backward_cost", backward_cost)}
    orders = [[tuple(op) for op in row] for row in orders]
    p = len(orders)
    if p < 1:
        raise ValueError("timed_schedule: give the order of at least one stage")
    for s, row in enumerate(orders):
        for op in row:
            if (
                len(op) != 2
                or op[0] not in KINDS
                or isinstance(op[1], bool)
                or not isinstance(op[1], (int, np.integer))
            ):
                raise ValueError(f"timed_schedule: stage {s}'s order holds {op!r}; an op is ('F', i) or ('B', i)")
    finish, rows, pos = {}, [[] for _ in range(p)], [0] * p
    while any(pos[s] < len(orders[s]) for s in range(p)):
        moved = False
        for s in range(p):
            while pos[s] < len(orders[s]):
                op = orders[s][pos[s]]
                deps = _deps(s, p, op)
                if any(d not in finish for d in deps):
                    break
                start = max([len(rows[s])] + [finish[d] for d in deps])
                rows[s] += [None] * (start - len(rows[s])) + [op] * cost[op[0]]
                finish[(s, op)] = len(rows[s])
                pos[s] += 1
                moved = True
        if not moved:
            stuck = [
                f"stage {s} at {_label(orders[s][pos[s]])}" for s in range(p) if pos[s] < len(orders[s])
            ]  # each waits for an op that is not done and never will be
            raise ValueError(
                f"timed_schedule: the orders stall ({', '.join(stuck)}): each waits for an op that never runs "
                f"or runs only after it"
            )
    ticks = max(len(r) for r in rows)
    return [tuple(rows[s][t] if t < len(rows[s]) else None for s in range(p)) for t in range(ticks)]


def gpipe_schedule(p: int, m: int, backward_cost: int = 1) -> list:
    """GPipe's tick table for p stages and m micro-batches (a forward 1 tick, a backward backward_cost): [tick][stage]
    -> ("F", i) / ("B", i) / None."""
    return timed_schedule(gpipe_order(p, m), backward_cost)


def one_f_one_b_schedule(p: int, m: int, backward_cost: int = 1) -> list:
    """1F1B's tick table for p stages and m micro-batches (a forward 1 tick, a backward backward_cost): [tick][stage]
    -> ("F", i) / ("B", i) / None."""
    return timed_schedule(one_f_one_b_order(p, m), backward_cost)


def make_schedule(name: str, p: int, m: int, backward_cost: int = 1) -> list:
    """The schedule called `name` ("gpipe" or "1f1b")."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}: choose one of {', '.join(SCHEDULES)}")
    return (gpipe_schedule if name == "gpipe" else one_f_one_b_schedule)(p, m, backward_cost)


# ---- reading a table -------------------------------------------------------------------------------------------


def _cell(t, s, cell, m):
    """A cell checked: None or an op (kind, micro-batch); ValueError naming the tick and stage otherwise."""
    if cell is None:
        return None
    if not isinstance(cell, (tuple, list)):
        raise ValueError(f"tick {t}, stage {s}: a cell is None or ('F', i) / ('B', i), got {cell!r}")
    if cell and all(isinstance(c, (tuple, list)) for c in cell):
        raise ValueError(
            f"tick {t}, stage {s} does {len(cell)} things at once ({', '.join(map(repr, cell))}): a stage runs one "
            f"forward or backward per tick"
        )
    if len(cell) != 2 or cell[0] not in KINDS:
        raise ValueError(f"tick {t}, stage {s}: a cell is None or ('F', i) / ('B', i), got {cell!r}")
    mb = cell[1]
    if isinstance(mb, bool) or not isinstance(mb, (int, np.integer)) or mb < 0 or (m is not None and mb >= m):
        within = f" in 0..{m - 1}" if m is not None else " >= 0"
        raise ValueError(
            f"tick {t}, stage {s}: {cell!r} names micro-batch {mb!r}; micro-batches are whole numbers{within}"
        )
    return (cell[0], int(mb))


def _stages(fn, schedule) -> int:
    if not isinstance(schedule, (list, tuple)) or not schedule:
        raise ValueError(f"{fn}: a schedule is a non-empty list of ticks, each a tuple of one cell per stage")
    p = len(schedule[0])
    for t, tick in enumerate(schedule):
        if not isinstance(tick, (list, tuple)) or len(tick) != p or p == 0:
            n = len(tick) if isinstance(tick, (list, tuple)) else type(tick).__name__
            raise ValueError(f"{fn}: tick {t} has {n} cells and tick 0 has {p}: one cell per stage in every tick")
    return p


def _runs(schedule, p):
    """Per stage, its ops as runs of consecutive equal cells: [(op, first tick, ticks)], in time order."""
    runs = [[] for _ in range(p)]
    for t, tick in enumerate(schedule):
        for s, cell in enumerate(tick):
            if cell is None:
                continue
            op = (cell[0], int(cell[1]))
            if runs[s] and runs[s][-1][0] == op and runs[s][-1][1] + runs[s][-1][2] == t:
                runs[s][-1][2] += 1
            else:
                runs[s].append([op, t, 1])
    return runs


def validate_schedule(schedule, m=None, backward_cost: int = 1) -> None:
    """Check a tick table: every cell None or one op; on every stage every F and B of micro-batches 0 .. m-1 exactly
    once (a backward over backward_cost consecutive ticks); and every op after what it waits for (_deps): a forward
    after the previous stage's forward of that micro-batch finished, a backward after the next stage's backward of
    it and after its own stage's forward. Raises ValueError naming the first fault (a malformed cell, then a repeated
    or missing op, then the earliest op that starts too soon); returns None.

    m: the number of micro-batches (default: 1 + the largest one the table names; pass it to catch a missing last
    micro-batch). backward_cost: the ticks of a backward; None: the table's own (its first backward's)."""
    fn = "validate_schedule"
    if backward_cost is not None:
        backward_cost = _check_count(fn, "backward_cost", backward_cost)
    p = _stages(fn, schedule)
    if m is not None:
        m = _check_count(fn, "m (micro-batches)", m)
    for t, tick in enumerate(schedule):
        for s, cell in enumerate(tick):
            try:
                _cell(t, s, cell, m)
            except ValueError as e:
                raise ValueError(f"{fn}: {e}") from None
    if m is None:
        m = 1 + max((c[1] for tick in schedule for c in tick if c is not None), default=-1)
        if m < 1:
            raise ValueError(f"{fn}: the schedule runs nothing (every cell is idle)")
    runs = _runs(schedule, p)
    if backward_cost is None:
        backward_cost = next((n for row in runs for op, _, n in row if op[0] == "B"), 1)
    cost = {"F": 1, "B": backward_cost}
    start, finish = {}, {}
    for s in range(p):
        for op, t0, n in runs[s]:
            if (s, op) in start:
                raise ValueError(
                    f"{fn}: stage {s} runs {_what(op)} twice (from tick {start[(s, op)]} and from tick {t0}); each "
                    f"op runs once"
                )
            if n != cost[op[0]]:
                raise ValueError(
                    f"{fn}: stage {s} runs {_what(op)} for {n} tick(s) from tick {t0}, and a "
                    f"{'forward' if op[0] == 'F' else 'backward'} takes {cost[op[0]]} (backward_cost={backward_cost})"
                )
            start[(s, op)], finish[(s, op)] = t0, t0 + n
    for s in range(p):
        for kind in KINDS:
            for mb in range(m):
                if (s, (kind, mb)) not in start:
                    raise ValueError(f"{fn}: stage {s} never runs {_what((kind, mb))} (micro-batches 0..{m - 1})")
    for t0, s, op in sorted((t0, s, op) for (s, op), t0 in start.items()):
        for ds, dop in _deps(s, p, op):
            if finish[(ds, dop)] > t0:
                why = (
                    "a backward differentiates its own forward's activations"
                    if ds == s
                    else f"its input is that {'forward' if dop[0] == 'F' else 'backward'}'s output"
                )
                raise ValueError(
                    f"{fn}: tick {t0}, stage {s} starts {_what(op)} before {_what(dop)} of stage {ds} has finished "
                    f"(it ends with tick {finish[(ds, dop)] - 1}): {why}"
                )


def bubble_fraction(schedule) -> float:
    """The idle fraction of the table's stage-ticks: idle cells / (stages x ticks). GPipe and 1F1B with one tick per
    forward and backward_cost ticks per backward: (p - 1) / (m + p - 1)."""
    p = _stages("bubble_fraction", schedule)
    idle = sum(cell is None for tick in schedule for cell in tick)
    return idle / (p * len(schedule))


def peak_activations(schedule) -> list:
    """Per stage, the largest number of micro-batches whose activations it holds at once: a micro-batch is held from
    the tick its forward runs until the end of its backward. GPipe: m on every stage; 1F1B: min(p - s, m) on stage s."""
    p = _stages("peak_activations", schedule)
    peaks = []
    for s in range(p):
        held, peak = set(), 0
        for t, tick in enumerate(schedule):
            cell = tick[s]
            if cell is None:
                continue
            kind, mb = cell[0], int(cell[1])
            if kind == "F":
                held.add(mb)
            peak = max(peak, len(held))
            if kind == "B" and (t + 1 == len(schedule) or schedule[t + 1][s] != cell):
                held.discard(mb)  # its backward ends with this tick: the activations are freed
        peaks.append(peak)
    return peaks


def format_schedule(schedule) -> str:
    """The table as text: a header of tick numbers, then one row per stage, "F3" / "B0" per cell and "." when idle."""
    p = _stages("format_schedule", schedule)
    labels = [["." if c is None else _label(c) for c in tick] for tick in schedule]
    w = max(len(str(len(schedule) - 1)), max(len(x) for col in labels for x in col))
    head = f"stage {p - 1}"
    lines = ["tick".ljust(len(head)) + " " + " ".join(str(t).ljust(w) for t in range(len(schedule)))]
    for s in range(p):
        lines.append(f"stage {s}".ljust(len(head)) + " " + " ".join(col[s].ljust(w) for col in labels))
    return "\n".join(line.rstrip() for line in lines)


def _events(schedule):
    """Per tick, per stage: the op that starts in it, and the op that ends with it (None where nothing does)."""
    out = []
    n = len(schedule)
    for t, tick in enumerate(schedule):
        starts = tuple(c if c is not None and (t == 0 or schedule[t - 1][s] != c) else None for s, c in enumerate(tick))
        ends = tuple(
            c if c is not None and (t + 1 == n or schedule[t + 1][s] != c) else None for s, c in enumerate(tick)
        )
        out.append((starts, ends))
    return out


# ================================================================================================================
# 2. Stages: a contiguous range of blocks, the embeddings on the first, the head on the last
# ================================================================================================================


def stage_layers(n_layer: int, p: int) -> list:
    """The blocks of each of p stages: [(l0, l1), ...], contiguous, covering 0 .. n_layer once, sizes differing by at
    most one (the first n_layer mod p stages one longer). ValueError when a stage would have no block."""
    n_layer = _check_count("stage_layers", "n_layer", n_layer)
    p = _check_count("stage_layers", "p (stages)", p)
    if p > n_layer:
        raise ValueError(
            f"stage_layers: {p} stages but the model has {n_layer} blocks (n_layer): each stage needs at least one "
            f"block; use at most {n_layer} stages (ranks) or a deeper model (--n-layer)"
        )
    base, extra = divmod(n_layer, p)
    out, l0 = [], 0
    for s in range(p):
        l1 = l0 + base + (1 if s < extra else 0)
        out.append((l0, l1))
        l0 = l1
    return out


def stage_ranges(cfg, s: int, p: int) -> list:
    """The elements of the whole model's flat buffer that stage s holds: [(name, lo, hi, shape)] in buffer order;
    shape is the stage's view of them (block tensors: (l1 - l0, ...)). Stage 0: wte, wpe and its blocks; the last
    stage: wte (the tied head), its blocks, lnfw, lnfb; the others: their blocks."""
    from ..model.params import BLOCK_PARAMS, param_shapes

    p = _check_count("stage_ranges", "p (stages)", p)
    if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or not 0 <= s < p:
        raise ValueError(f"stage_ranges: stage must be in 0..{p - 1}, got {s!r}")
    l0, l1 = stage_layers(cfg.n_layer, p)[s]
    out, lo = [], 0
    for name, shape in param_shapes(cfg).items():
        size = math.prod(shape)
        if name in BLOCK_PARAMS:
            per = size // cfg.n_layer
            out.append((name, lo + l0 * per, lo + l1 * per, (l1 - l0,) + shape[1:]))
        elif (
            (name == "wte" and (s == 0 or s == p - 1))
            or (name == "wpe" and s == 0)
            or (name in ("lnfw", "lnfb") and s == p - 1)
        ):
            out.append((name, lo, lo + size, shape))
        lo += size
    return out


class Stage:
    """Stage s of p: blocks [l0, l1) of the GPT (plus the embeddings on stage 0, the final LayerNorm and the tied head
    on the last), their flat fp32 parameters, gradients and AdamW moments, and one micro-batch's forward or backward.

    params: the whole model's initial parameters (a ParamBuffer or its flat array: init_params(cfg, seed), the
    one-rank run's values); the stage copies its own elements (stage_ranges) and keeps nothing of the rest. The views
    self.P / self.G name its tensors as reference/gpt.py does, block tensors indexed 0 .. l1 - l0 - 1.

    A step: begin(m); forward(i, ...) and backward(i, ...) of micro-batches 0 .. m-1 in the schedule's order (the
    caches of the micro-batches between the two are held in self.caches); then the gradient in self.acc, the sum of
    the micro-batches' gradients each scaled by 1/m (Engine.forward_backward's accumulation); update(...)."""

    def __init__(self, cfg, s: int, p: int, params, betas=None, eps=None):
        from ..engine.core import BETAS, EPS
        from ..model.optim import decay_mask_for
        from ..model.params import GPTConfig

        if not isinstance(cfg, GPTConfig):
            raise TypeError(f"Stage: cfg must be a GPTConfig, got {type(cfg).__name__}")
        self.cfg, self.s, self.p = cfg, int(s), int(p)
        self.ranges = stage_ranges(cfg, s, p)
        self.l0, self.l1 = stage_layers(cfg.n_layer, p)[s]
        self.first, self.last = self.s == 0, self.s == self.p - 1
        flat = whole_params("Stage", cfg, params)
        self.index = np.concatenate([np.arange(lo, hi) for _, lo, hi, _ in self.ranges])  # in the whole buffer
        self.params = flat[self.index].astype(np.float32)
        n = self.params.size
        self.grads, self.acc = np.zeros(n, np.float32), np.zeros(n, np.float32)
        self.m_adam, self.v_adam = np.zeros(n, np.float32), np.zeros(n, np.float32)
        self.decay = decay_mask_for(cfg)[self.index]
        self.betas = tuple(float(b) for b in (BETAS if betas is None else betas))
        self.eps = float(EPS if eps is None else eps)
        self.P, self.G, a = {}, {}, 0
        for name, lo, hi, shape in self.ranges:
            self.P[name] = self.params[a : a + hi - lo].reshape(shape)
            self.G[name] = self.grads[a : a + hi - lo].reshape(shape)
            a += hi - lo
        self.wte = slice(0, cfg.vocab_size * cfg.d_model) if "wte" in self.P else None  # wte comes first when held
        self.t = 0  # optimizer steps taken
        self.m = 0  # micro-batches of this step
        self.caches, self.losses, self.done = {}, {}, 0
        self.peak = 0  # the most micro-batches held at once so far

    def __repr__(self):
        extra = (" + embeddings" if self.first else "") + (" + final LayerNorm and head" if self.last else "")
        return f"Stage({self.s}/{self.p}: blocks [{self.l0}, {self.l1}){extra}, {self.params.size:,} parameters)"

    @property
    def blocks(self):
        return range(self.l1 - self.l0)

    def begin(self, m: int) -> None:
        """A new step of m micro-batches."""
        if self.caches:
            raise RuntimeError(
                f"stage {self.s}: micro-batches {sorted(self.caches)} of the last step never ran backward"
            )
        self.m, self.losses, self.done = _check_count("Stage.begin", "m (micro-batches)", m), {}, 0

    def forward(self, mb: int, inp, targets=None):
        """Micro-batch mb's forward through this stage. inp: its token ids (b, T) on stage 0, else the activation
        (b, T, C) the previous stage sent. Returns the activation (b, T, C) for the next stage; on the last stage
        (targets (b, T)) the loss is kept in self.losses[mb] and None returned."""
        from ..reference.crossentropy import crossentropy_forward
        from ..reference.encoder import encoder_forward
        from ..reference.gpt import blocks_forward
        from ..reference.layernorm import layernorm_forward
        from ..reference.linear import linear_forward

        if mb in self.caches:
            raise RuntimeError(f"stage {self.s}: forward of micro-batch {mb} twice before its backward")
        P, c = self.P, {}
        if self.first:
            x, c["encoder"] = encoder_forward(inp, P["wte"], P["wpe"])  # (b, T, C)
        else:
            x = inp
        x, c["blocks"] = blocks_forward(P, x, self.cfg.n_head, self.blocks)  # (b, T, C)
        self.caches[mb] = c
        self.peak = max(self.peak, len(self.caches))
        if not self.last:
            return x
        lnf, c["lnf"] = layernorm_forward(x, P["lnfw"], P["lnfb"])  # (b, T, C)
        logits, c["head"] = linear_forward(lnf, P["wte"].T)  # (b, T, V): the tied head
        loss, c["crossentropy"] = crossentropy_forward(logits, targets)
        self.losses[mb] = float(loss)
        return None

    def backward(self, mb: int, dout=None):
        """Micro-batch mb's backward through this stage. dout: the gradient (b, T, C) of its output, from the next
        stage (None on the last stage: it starts from the loss). Adds its share to self.acc; returns the gradient of
        its input for the previous stage (None on stage 0)."""
        from ..reference.crossentropy import crossentropy_backward
        from ..reference.encoder import encoder_backward
        from ..reference.gpt import blocks_backward
        from ..reference.layernorm import layernorm_backward
        from ..reference.linear import linear_backward

        if mb not in self.caches:
            raise RuntimeError(f"stage {self.s}: backward of micro-batch {mb} without its forward")
        c, G = self.caches.pop(mb), self.G
        if self.last:  # as reference gpt_backward: the loss, the head, the final LayerNorm
            dlogits = crossentropy_backward(1.0, c["crossentropy"])  # (b, T, V)
            dlnf, dwte_head, _ = linear_backward(dlogits, c["head"])  # (b, T, C), (C, V)
            dx, G["lnfw"][...], G["lnfb"][...] = layernorm_backward(dlnf, c["lnf"])
        else:
            dx = dout
        dx = blocks_backward(dx, c["blocks"], G, self.blocks)  # (b, T, C)
        if self.first:
            dwte, G["wpe"][...] = encoder_backward(dx, c["encoder"])
            G["wte"][...] = dwte + dwte_head.T if self.last else dwte  # one stage: both uses, as gpt_backward
        elif self.last:
            G["wte"][...] = dwte_head.T  # the head's use only: stage 0 adds the embedding's (train_step)
        # this micro-batch's share of the mean over the batch, summed in backward order (Engine.forward_backward)
        if self.m > 1:
            self.grads *= np.float32(1.0 / self.m)
        if self.done == 0:
            self.acc[...] = self.grads
        else:
            self.acc += self.grads
        self.done += 1
        return None if self.first else dx

    def loss(self) -> float:
        """The step's loss: the mean of the micro-batches' losses (the last stage; 0.0 on the others)."""
        if not self.last:
            return 0.0
        return float(np.mean([self.losses[i] for i in range(self.m)]))

    def grad_sumsq(self) -> float:
        """The squared norm of this stage's gradient in float64, wte counted on stage 0 only."""
        g = self.acc if self.first or self.wte is None else self.acc[self.wte.stop :]
        return float(np.sum(np.square(g, dtype=np.float64)))

    def update(self, lr: float, weight_decay: float, clip_scale: float = 1.0) -> None:
        """AdamW on this stage's parameters from self.acc, times clip_scale (the clip factor of the global norm):
        NumpyEngine's fp32 update (optim.adamw_update) on this stage's elements."""
        from ..model.optim import adamw_update

        if self.done != self.m:
            raise RuntimeError(f"stage {self.s}: {self.done} of {self.m} micro-batches ran backward before the update")
        self.t += 1
        if clip_scale != 1.0:
            self.acc *= np.float32(clip_scale)
        adamw_update(
            self.params,
            self.acc,
            self.m_adam,
            self.v_adam,
            self.t,
            lr,
            self.betas,
            self.eps,
            float(weight_decay),
            self.decay,
        )


def assemble_params(stages) -> np.ndarray:
    """The whole model's flat parameters from all p stages (in one process): wte from stage 0."""
    from ..model.params import num_params

    out = np.zeros(num_params(stages[0].cfg), np.float32)
    for st in reversed(stages):  # stage 0 last: its wte wins (the copies are equal after every step anyway)
        out[st.index] = st.params
    return out


# ================================================================================================================
# 3. A training step: the table walked tick by tick, on ranks (train_step) or in one process (simulate_step)
# ================================================================================================================


def _check_step(fn, p, schedule, x, y):
    """(the schedule with every op a tuple (kind, int), m, rows per micro-batch b) of a step; ValueError naming the
    problem."""
    validate_schedule(schedule, backward_cost=None)  # any backward_cost: the table's own
    schedule = [tuple(None if c is None else (c[0], int(c[1])) for c in tick) for tick in schedule]
    if len(schedule[0]) != p:
        raise ValueError(f"{fn}: the schedule has {len(schedule[0])} stages and there are {p}")
    m = 1 + max(c[1] for tick in schedule for c in tick if c is not None)
    x, y = np.asarray(x), np.asarray(y)
    if x.ndim != 2 or y.shape != x.shape:
        raise ValueError(f"{fn}: x and y must be (B, T) token ids of one shape, got {x.shape} and {y.shape}")
    if x.shape[0] % m:
        raise ValueError(
            f"{fn}: the batch of {x.shape[0]} rows does not split into m={m} micro-batches of equal size: choose m "
            f"dividing the batch size"
        )
    return schedule, m, x.shape[0] // m


def _run_op(stage, op, x, y, b, inbox):
    """Run op on stage; returns what it sends (an activation or a gradient) or None."""
    kind, mb = op
    rows = slice(mb * b, (mb + 1) * b)
    if kind == "F":
        inp = x[rows] if stage.first else inbox.pop(("F", mb))
        return stage.forward(mb, inp, y[rows] if stage.last else None)
    return stage.backward(mb, None if stage.last else inbox.pop(("B", mb)))


def _exchange(comm, s, a, ends, inbox, outbox, shape):
    """The messages across the boundary between stages a and a + 1 at the end of a tick, seen from stage s (one of the
    two): the output of a forward of stage a that ended now goes up, the gradient of a backward of stage a + 1 down."""
    up = ends[a] if ends[a] is not None and ends[a][0] == "F" else None
    down = ends[a + 1] if ends[a + 1] is not None and ends[a + 1][0] == "B" else None
    if s == a:
        send, recv, peer = (outbox.pop(up) if up else None), down, a + 1
    else:
        send, recv, peer = (outbox.pop(down) if down else None), up, a
    buf = np.empty(shape, np.float32) if recv is not None else None
    if send is not None and (send.dtype != np.float32 or send.shape != shape):
        raise RuntimeError(f"stage {s}: a message of {send.dtype} {send.shape}; the stages exchange float32 {shape}")
    if send is not None and recv is not None:
        comm.sendrecv(np.ascontiguousarray(send), peer, buf, peer)  # both ways at once: never a deadlock
    elif send is not None:
        comm.send(np.ascontiguousarray(send), peer)
    elif recv is not None:
        comm.recv(buf, peer)
    if recv is not None:
        inbox[recv] = buf


def run_schedule(stage, comm, schedule, x, y) -> float:
    """This rank's part of a step's forwards and backwards (rank = stage.s): its cell of every tick, then the messages
    of the tick across its two boundaries (the previous stage's first). Any table validate_schedule accepts (a
    backward over several ticks runs in its first and sends after its last). Returns the seconds it spent computing."""
    schedule, m, b = _check_step("run_schedule", stage.p, schedule, x, y)
    if comm.world_size != stage.p or comm.rank != stage.s:
        raise ValueError(
            f"run_schedule: stage {stage.s} of {stage.p} runs on rank {stage.s} of {stage.p} ranks, and this is rank "
            f"{comm.rank} of {comm.world_size}: start one rank per stage"
        )
    stage.begin(m)
    s, p, shape = stage.s, stage.p, (b, np.shape(x)[1], stage.cfg.d_model)
    inbox, outbox, busy = {}, {}, 0.0
    for starts, ends in _events(schedule):
        op = starts[s]
        if op is not None:
            t0 = time.perf_counter()
            out = _run_op(stage, op, x, y, b, inbox)
            busy += time.perf_counter() - t0
            if out is not None:
                outbox[op] = out
        for a in (s - 1, s):  # the boundary to the previous stage, then to the next: boundaries in order 0 .. p-2
            if 0 <= a < p - 1:
                _exchange(comm, s, a, ends, inbox, outbox, shape)
    return busy


def sum_tied(stage, comm) -> None:
    """wte's gradient on stages 0 and p-1: each sends its part and both keep (stage 0's) + (stage p-1's)."""
    if stage.p == 1 or not (stage.first or stage.last):
        return
    mine = stage.acc[stage.wte]
    other = np.empty_like(mine)
    peer = stage.p - 1 if stage.first else 0
    comm.sendrecv(mine, peer, other, peer)
    first, last = (mine, other) if stage.first else (other, mine)
    mine[...] = first + last  # the same order on both ranks: the same bits


def check_tied(stage, comm) -> bool:
    """Whether the copies of wte on stage 0 and stage p-1 are bitwise equal (every rank gets the answer)."""
    equal = 1.0
    if stage.p > 1 and (stage.first or stage.last):
        mine = np.ascontiguousarray(stage.P["wte"]).reshape(-1)
        other = np.empty_like(mine)
        peer = stage.p - 1 if stage.first else 0
        comm.sendrecv(mine, peer, other, peer)
        equal = float(np.array_equal(mine, other))
    return bool(comm.all_reduce_scalars([equal], op="min")[0] == 1.0)


def train_step(stage, comm, schedule, x, y, lr, weight_decay=0.0, grad_clip=0.0) -> dict:
    """One training step on this rank (stage.s = comm.rank): the schedule's forwards and backwards of the micro-batches
    of (x, y) (every rank passes the same global batch; stage 0 reads x, the last stage y), wte's gradient summed
    between the first and last stage, the global norm, clipping and this stage's AdamW.

    Returns (the same on every rank) {"loss", "grad_norm", "busy_s": per stage seconds computing, "wall_s": per stage
    seconds of the forwards and backwards, "bubble": 1 - sum(busy) / (p x the slowest wall): the measured idle
    fraction}."""
    from ..model.optim import clip_coefficient

    t0 = time.perf_counter()
    busy_s = run_schedule(stage, comm, schedule, x, y)
    wall_s = time.perf_counter() - t0
    sum_tied(stage, comm)
    stats = comm.gather_scalars([stage.grad_sumsq(), stage.loss(), busy_s, wall_s])  # (p, 4), every rank
    sumsq = float(np.sum(stats[:, 0]))  # in stage order on every rank: one clip factor everywhere
    norm = math.sqrt(max(sumsq, 0.0))
    stage.update(lr, weight_decay, clip_coefficient(norm, grad_clip))
    return {
        "loss": float(stats[-1, 1]),
        "grad_norm": norm,
        "busy_s": stats[:, 2].tolist(),
        "wall_s": stats[:, 3].tolist(),
        "bubble": float(1.0 - stats[:, 2].sum() / (stage.p * stats[:, 3].max())) if stats[:, 3].max() > 0 else 0.0,
    }


def simulate_step(stages, schedule, x, y, lr, weight_decay=0.0, grad_clip=0.0) -> dict:
    """train_step with all p stages in one process: the same ops in the same order, the messages handed over at the
    end of each tick, the same sums; so the same numbers as p ranks. Returns {"loss", "grad_norm"}."""
    from ..model.optim import clip_coefficient

    p = len(stages)
    schedule, m, b = _check_step("simulate_step", p, schedule, x, y)
    for s, st in enumerate(stages):
        if st.s != s or st.p != p:
            raise ValueError(f"simulate_step: stages[{s}] is stage {st.s} of {st.p}; pass stages 0 .. {p - 1} of {p}")
        st.begin(m)
    inbox, outbox = [{} for _ in stages], [{} for _ in stages]
    for starts, ends in _events(schedule):
        for s, op in enumerate(starts):
            if op is not None:
                out = _run_op(stages[s], op, x, y, b, inbox[s])
                if out is not None:
                    outbox[s][op] = out
        for s, op in enumerate(ends):  # what finished goes over: forward outputs up, input gradients down
            if op is not None and op in outbox[s]:
                inbox[s + 1 if op[0] == "F" else s - 1][op] = outbox[s].pop(op)
    if p > 1:
        first, last = stages[0].acc[stages[0].wte], stages[-1].acc[stages[-1].wte]
        first[...] = last[...] = first + last
    sumsq = float(np.sum(np.array([st.grad_sumsq() for st in stages])))
    norm = math.sqrt(max(sumsq, 0.0))
    for st in stages:
        st.update(lr, weight_decay, clip_coefficient(norm, grad_clip))
    return {"loss": stages[-1].loss(), "grad_norm": norm}


# ================================================================================================================
# 4. The command: `python -m gpullm_lessons.parallel pipeline ...` on p ranks, one stage each
# ================================================================================================================


def build_parser() -> argparse.ArgumentParser:
    """The pipeline command's flags: the training job's (numpy_job.job_parser) and the pipeline's own."""
    from .numpy_job import job_parser

    p = job_parser(
        "python -m gpullm_lessons.parallel pipeline",
        "pipeline-parallel training of the NumPy GPT: one stage per rank (start the ranks with "
        "python -m gpullm_lessons.parallel.launch --nproc P --backend mpi)",
        json="losses, bubble and memory",
    )
    p.add_argument("--schedule", choices=SCHEDULES, default="1f1b", help="the order of the micro-batches' F and B")
    p.add_argument("--micro-batches", type=int, default=4, help="m: micro-batches per step (must divide the batch)")
    return p


def main(argv=None, comm=None) -> dict:
    """The pipeline command on this rank (comm: default the environment's; one stage per rank). Returns the summary
    (on every rank); rank 0 prints the table, each step's loss and bubble, and writes --json."""

    from ..model.params import init_params
    from ..train import ConfigError
    from .numpy_job import job_from_args, write_summary

    args = build_parser().parse_args(argv)
    m = args.micro_batches

    def check(preset, B, comm):
        if B % m:
            raise ConfigError(
                f"--micro-batches {m} does not divide the batch of {B} sequences (--batch-size): each micro-batch "
                f"takes B / m of them"
            )
        L = preset["n_layer"]
        if comm.world_size > L:
            raise ConfigError(
                f"{comm.world_size} ranks (one stage each) but the model has {L} block{'s' * (L > 1)} (--n-layer): "
                f"each stage needs at least one block; start at most {L} rank{'s' * (L > 1)} (--nproc) or pass a "
                f"larger --n-layer"
            )

    job = job_from_args(args, comm, positive={"--micro-batches": m}, check=check)
    cfg, B, lr, comm = job.cfg, job.B, job.lr, job.comm
    p = comm.world_size
    layers = stage_layers(cfg.n_layer, p)
    T = cfg.block_size
    stage = Stage(cfg, comm.rank, p, init_params(cfg, seed=args.seed))
    schedule = make_schedule(args.schedule, p, m)
    expected = peak_activations(schedule)
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    say(
        f"pipeline: {p} stage(s) over {comm.name}, blocks "
        + " ".join(f"[{a},{b})" for a, b in layers)
        + f" of L={cfg.n_layer} (C={cfg.d_model}, nh={cfg.n_head}, T={T}, V={cfg.vocab_size}) | {args.schedule}, "
        f"B={B} as m={m} micro-batches of {B // m} | {args.steps} steps, lr {lr:g}"
    )
    say(format_schedule(schedule))
    say(
        f"bubble of the table: {bubble_fraction(schedule):.3f} = (p-1)/(m+p-1) = {p - 1}/{m + p - 1}; micro-batches "
        f"held at once per stage: {expected}"
    )
    losses, norms, bubbles = [], [], []
    for step, res in job.run(
        args.steps, lambda x, y, lr: train_step(stage, comm, schedule, x, y, lr, args.weight_decay, args.grad_clip)
    ):
        losses.append(res["loss"])
        norms.append(res["grad_norm"])
        bubbles.append(res["bubble"])
        say(
            f"step {step:4d} | loss {res['loss']:.6f} | grad norm {res['grad_norm']:.4f} | measured bubble "
            f"{res['bubble']:.3f} of {max(res['wall_s']) * 1e3:.1f} ms"
        )
    peaks = [int(v) for v in comm.gather_scalars([stage.peak])[:, 0]]
    tied = check_tied(stage, comm)
    summary = {
        "schedule": args.schedule,
        "stages": p,
        "micro_batches": m,
        "layers": [list(r) for r in layers],
        "losses": losses,
        "grad_norms": norms,
        "bubble": bubble_fraction(schedule),
        "bubble_measured": bubbles,
        "peak_activations": peaks,
        "peak_activations_table": expected,
        "tied_equal": tied,
    }
    say(
        f"done: loss {losses[0]:.4f} -> {losses[-1]:.4f}; micro-batches held at once per stage: {peaks} (the table: "
        f"{expected}); wte's copies on stages 0 and {p - 1} " + ("equal" if tied else "DIFFER")
    )
    write_summary(comm, args.json, summary)
    if not tied:
        raise RuntimeError("the two copies of wte (stage 0's embedding, the last stage's head) differ")
    return summary


def cli(argv=None) -> int:
    """Command-line entry: configuration problems print one line and exit with status 2 (as the training job)."""
    from .numpy_job import run_cli

    return run_cli(main, argv)
