"""The op checker: how every ``check_<op>`` runs your function against the NumPy reference.

``gpullm_lessons.checks.backward`` and ``gpullm_lessons.checks.ops`` describe ops (an ``Op``: how to make each case's inputs,
the expected outputs, the table of known mistakes) and, where a task asks for more than the values, ``Rules``
(hints that name a place, the same bits twice, the exact bits of a fixed order, no races, float atomics or missing
barriers in the simulator). ``run(op, fn, rules=...)`` is the one loop that grades them all: it validates the
arguments, makes the cases from the seed, puts them on the learner's backend with NaN-poisoned (and, on a GPU,
guarded) outputs, calls the function, compares with the float64 reference (``verdict.compare``), and turns the first
wrong element into a message and a hint: a known mistake, a pattern that says where (never written, past the capped
grid, the last partial block, only head 0 or sequence 0, a factor, a transpose, -inf from a log of 0, the answer of an
earlier call or added onto it), a missing barrier (a shared-memory kernel's wrong values in no known pattern: the
call is traced in the simulator), or the thread and block that raised (with the value a log or sqrt was given). The
verdict itself (``CheckResult``, recording, number formats) is ``gpullm_lessons.checks.verdict``.
"""
from __future__ import annotations

import dataclasses
import inspect
import math
import re
import secrets
from typing import Callable, Optional

import numpy as np

from ..runtime import arrays as _arrays
from .. import device as _device
from . import verdict
from .verdict import CheckResult, close, compare, fmt, fmt_index, mistake_slack, where_raised

SIZES = ("small", "large")

# Relative tolerance per dtype; the absolute floor is tol * M, M the output's magnitude (see the docstring).
TOLERANCES = {"float64": 1e-9, "float32": 1e-5, "float16": 1e-2, "bfloat16": 5e-2}
_ALIASES = {"fp64": "float64", "fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "half": "float16",
            "float": "float32", "double": "float64"}

# The poison: a quiet NaN with a recognizable payload, so "never written" can be told apart from a NaN that
# your arithmetic produced (NumPy on the CPU carries the payload through x + NaN, GPUs do not).
_POISON = {"float64": (np.uint64, 0x7FF80000DEADBEEF), "float32": (np.uint32, 0x7FC0DEAD),
           "float16": (np.uint16, 0x7E5A), "bfloat16": (np.uint16, 0x7FD5)}

# The verdict (CheckResult, STATUSES), how it is recorded and printed, how your function is called, and how numbers
# and indices are written in the messages: gpullm_lessons/checks/verdict.py, the core every checker module shares.


# ------------------------------------------------------------------------------------------------------------
# Cases: one set of inputs for one call of your function
# ------------------------------------------------------------------------------------------------------------
class Case:
    """Inputs (rounded to dtype), output shapes, int scalars, and float64 copies for the reference/mistakes."""

    def __init__(self, dtype: np.dtype, dims: dict):
        self.dtype = dtype
        self.dims = dict(dims)   # symbol -> size
        self.inputs = {}         # name -> np.ndarray in call order (floats in dtype, indices int32)
        self.outputs = {}        # name -> shape, in call order
        self.scalars = {}        # name -> int, passed after the outputs
        self.sym = {}            # name -> symbolic shape, e.g. ("N", "C")
        self.x = {}              # name -> float64 array (rounded inputs, derived values) for reference/mistakes

    def shape(self, sym) -> tuple:
        return tuple(self.dims[s] for s in sym)

    def add_float(self, name, sym, values):
        """A float input: rounded to the case's dtype; the reference sees exactly the rounded values."""
        a = np.ascontiguousarray(np.asarray(values, dtype=np.float64).astype(self.dtype))
        self.inputs[name], self.sym[name], self.x[name] = a, tuple(sym), a.astype(np.float64)
        return self.x[name]

    def add_index(self, name, sym, values):
        a = np.ascontiguousarray(np.asarray(values, dtype=np.int32))
        self.inputs[name], self.sym[name], self.x[name] = a, tuple(sym), a
        return a

    def add_output(self, name, sym):
        self.outputs[name], self.sym[name] = self.shape(sym), tuple(sym)

    def describe_shapes(self) -> str:
        """'dout (N, OC) = (37, 12), inp (N, C) = (37, 20), ...' for every argument, in call order."""
        parts = []
        for name in list(self.inputs) + list(self.outputs):
            sym = self.sym[name]
            parts.append(f"{name} ({', '.join(sym)}{',' if len(sym) == 1 else ''}) = {self.shape(sym)}")
        parts += [f"{k}={v}" for k, v in self.scalars.items()]
        return ", ".join(parts)


@dataclasses.dataclass
class Mistake:
    """A known mistake: either the wrong outputs it produces, or a pattern test on your output."""
    hint: str
    outputs: Optional[Callable] = None  # case -> {output name: wrong float64 array} for the outputs it changes
    test: Optional[Callable] = None     # (case, name, ours, expected, bad) -> bool, or the hint itself (a str)
    catchall: bool = False              # wrong values in no known pattern: the op's fallback, not a named mistake


@dataclasses.dataclass
class Op:
    name: str
    make: Callable       # (rng, dtype, size, k) -> Case, k = case number
    expected: Callable   # case -> {output name: float64 array}
    formula: str         # the right formula, the fallback hint
    shape_hint: str      # for shape errors (raised by matmul/broadcasting)
    mistakes: list
    n_cases: int = 1
    accumulates: bool = False  # outputs must be zeroed first: "all NaN" is that op's own mistake, not rebinding
    terms: Optional[Callable] = None  # case -> {output: size of the terms it is computed from}, see verdict.compare
    parts: Optional[dict] = None      # {output: blocks along the last axis judged separately}, see verdict.compare
    own: tuple = ()  # the course's own implementations of the task ("module:attr"), else found by the op's name
    #                  (borrowed.course_implementations): an answer that is, wraps or calls one is wrong


def awkward_size(rng, lo, hi, avoid=()) -> int:
    """A random size in [lo, hi] that is not a multiple of 16 (so never of 32) and not in `avoid`."""
    for _ in range(1000):
        n = int(rng.integers(lo, hi + 1))
        if (n % 16 or lo == hi) and n not in avoid:
            return n
    return lo


def row_scales(rng, n, lo=-1.0, hi=0.5):
    """Per-row scale factors 10**U(lo, hi): rows of very different magnitude."""
    return 10.0 ** rng.uniform(lo, hi, size=n)


def random_rows(rng, shape, lo=-1.0, hi=0.5):
    """Standard normal values whose rows (leading axis after flattening all but the last) have random scales."""
    x = rng.standard_normal(shape)
    lead = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    s = row_scales(rng, lead, lo, hi).reshape(shape[:-1] + (1,)) if len(shape) > 1 else row_scales(rng, shape[0], lo, hi)
    return x * s


def if_square(fn):
    """A mistake that only exists as numbers when the shapes allow it (else it is a shape error)."""
    def wrapped(c):
        try:
            return fn(c)
        except ValueError:
            return {}
    return wrapped


# ------------------------------------------------------------------------------------------------------------
# Comparing, diagnosing
# ------------------------------------------------------------------------------------------------------------
def normalize_dtype(dtype) -> np.dtype:
    name = dtype.lower() if isinstance(dtype, str) else None
    name = _ALIASES.get(name, name)
    try:
        if name == "bfloat16":
            import ml_dtypes
            dt = np.dtype(ml_dtypes.bfloat16)
        else:
            dt = np.dtype(name if name is not None else dtype)
    except (TypeError, ImportError):
        dt = None
    if dt is None or dt.name not in TOLERANCES:
        raise ValueError(f"dtype={dtype!r} is not supported by the checkers; use one of: "
                         + ", ".join(TOLERANCES) + " (e.g. np.float32)")
    return dt


def poison(shape, dt) -> np.ndarray:
    uint, bits = _POISON[dt.name]
    return np.full(shape, bits, dtype=uint).view(dt)


def is_poison(a: np.ndarray) -> np.ndarray:
    uint, bits = _POISON[a.dtype.name] if a.dtype.name in _POISON else (None, None)
    if uint is None or a.dtype.itemsize != np.dtype(uint).itemsize:
        return np.zeros(a.shape, dtype=bool)
    return np.ascontiguousarray(a).view(uint) == bits


# Guard zones: on a real GPU nothing traps a write past the end of an array (the simulator raises IndexError and
# the checker names the thread), so there each output is a view into a larger buffer with a zone of poison before
# and after it. A zone that changed is an out-of-bounds write. 256 bytes keep the view on the 256-byte alignment
# of a fresh allocation, so vector (float4) loads and stores stay legal. GUARDS: None = on a real GPU only,
# True / False to force (the tests exercise the zones with NumPy arrays).
GUARD_BYTES = 256
GUARDS: Optional[bool] = None


def guards_on(arrays: str) -> bool:
    if GUARDS is not None:
        return bool(GUARDS)
    return arrays == "cupy" or (arrays == "numba" and _device.numba_on_gpu())


def guarded_outputs(shapes, dt, arrays, guards: bool):
    """(output arrays to pass, their guarded buffers or None) for the output shapes, all filled with the poison."""
    outs, bufs = [], []
    for shape in shapes:
        if not guards:
            outs.append(_arrays.to_backend(poison(shape, dt), arrays))
            bufs.append(None)
            continue
        g, n = GUARD_BYTES // dt.itemsize, int(np.prod(shape, dtype=np.int64))
        big = _arrays.to_backend(poison((g + n + g,), dt), arrays)
        outs.append(big[g:g + n].reshape(shape))
        bufs.append(big)
    return outs, bufs


def _guard_breach(names, shapes, bufs, dt):
    """(output name, elements written before its start, after its end, first flat index past the end or None) for
    the first output whose guard zones changed, else None."""
    for name, shape, big in zip(names, shapes, bufs):
        if big is None:
            continue
        host = np.asarray(_arrays.to_numpy(big))
        g, n = GUARD_BYTES // dt.itemsize, int(np.prod(shape, dtype=np.int64))
        before, after = ~is_poison(host[:g]), ~is_poison(host[g + n:])
        if before.any() or after.any():
            first = n + int(np.argmax(after)) if after.any() else None
            return name, int(before.sum()), int(after.sum()), first
    return None


def guard_verdict(op, case, k, guard_bufs, dt, seed, info) -> Optional["CheckResult"]:
    """'wrong' when case k's call wrote into a guard zone around one of its outputs (see guarded_outputs)."""
    breach = _guard_breach(case.outputs, case.outputs.values(), guard_bufs, dt)
    if breach is None:
        return None
    name, n_before, n_after, first = breach
    n = int(np.prod(case.outputs[name], dtype=np.int64))
    where = []
    if n_after:
        where.append(f"{n_after} element{'s' if n_after > 1 else ''} past its end (its last is flat index "
                     f"{n - 1}; the first written past it: {first})")
    if n_before:
        where.append(f"{n_before} element{'s' if n_before > 1 else ''} before its start (a negative index)")
    hint = (f"an out-of-bounds write: a thread whose index lies outside {name} still wrote. Every thread must test "
            f"its index against the size before it writes (if i < n, not i <= n; with a grid-stride loop, the "
            f"loop's condition is that guard). On a GPU nothing stops such a write: it lands in whatever memory "
            f"lies there (seed {seed})")
    msg = (f"{op.name}: wrong - your kernel wrote outside {name}: {' and '.join(where)} "
           f"({_case_text(case, k, op)}; seed {seed})")
    return verdict.build_result("wrong", msg, hint, output=name, **info)


def _factor_name(c: float, dims: dict) -> str:
    """'x0.5', 'x-1', 'x37 (= N)', 'x0.027 (= 1/N)', 'x2 (= sqrt(hs))'."""
    text = f"x{c:.3g}"
    for sym, d in dims.items():
        if d <= 1:
            continue
        for value, label in ((d, sym), (1 / d, f"1/{sym}"), (math.sqrt(d), f"sqrt({sym})"),
                             (1 / math.sqrt(d), f"1/sqrt({sym})")):
            if abs(c - value) <= 1e-3 * abs(value) and label not in ("2", "1/2"):
                return f"{text} (= {label})"
    return text


def _ranges(idx) -> str:
    """'3, 17' / '4..9' / '4..9, 12' for sorted indices (at most 4 ranges, then '...')."""
    runs, start, prev = [], None, None
    for i in (int(v) for v in idx):
        if start is None:
            start = prev = i
        elif i == prev + 1:
            prev = i
        else:
            runs.append((start, prev))
            start = prev = i
    if start is not None:
        runs.append((start, prev))
    text = ", ".join(f"{a}..{b}" if b > a else f"{a}" for a, b in runs[:4])
    return text + (", ..." if len(runs) > 4 else "")


def _rows_text(bad: np.ndarray) -> str:
    """Where the wrong elements are: 'only the last 2 rows (35..36)', 'rows 3, 17', 'rows 4..9', '' (all or none)."""
    if bad.ndim == 0:
        return ""
    lead = bad.reshape(bad.shape[0], -1).any(axis=1) if bad.ndim > 1 else bad
    k, n = int(lead.sum()), lead.size
    if k == n or k == 0:
        return ""
    unit = "row" if bad.ndim > 1 else "element"
    idx = np.flatnonzero(lead)
    first = int(idx[0])
    if lead[first:].all():
        return f"only the last {unit} ({first})" if k == 1 else f"only the last {k} {unit}s ({first}..{n - 1})"
    if k <= 5 or len(_ranges(idx).split(", ")) <= 2:
        return f"only {unit}s " + _ranges(idx)
    return ""


# The grids the exercises' launchers cap at (MAX_BLOCKS x THREADS): 2 x 32 in the simulator, 4096 x 256 on a GPU;
# row kernels launch a block (or a warp, or a thread) per row: at most 2 / 4096 blocks, 64 / 1,048,576 threads.
_GRID_CAPS = (2 * 32, 4096 * 256)
_ROW_CAPS = (2, 2 * 32, 4096, 4096 * 256 // 32)


def _ordinal(k: int) -> str:
    return f"{k}{'th' if 10 <= k % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(k % 10, 'th')}"


def _stride_pattern(idx, n) -> Optional[tuple]:
    """(k, j) when the indices are exactly every k-th index from j (k > 1, at least 3 of them), else None."""
    if idx.size < 3 or n < 6:
        return None
    d = np.diff(idx)
    k, j = int(d[0]), int(idx[0])
    if k <= 1 or not (d == k).all() or j >= k or idx[-1] + k < n:
        return None
    return k, j


def _where_pattern(name, mask, what) -> Optional[str]:
    """A sentence naming the pattern of `mask` (the wrong or unwritten elements of `name`), or None.

    Patterns: a suffix past the (capped) grid, the last partial block, everything past the first block, a range of
    rows, every k-th element. `what` is 'never written' or 'wrong'."""
    if mask.ndim == 0 or not mask.any() or mask.all():
        return None
    flat = mask.reshape(-1)
    n = flat.size
    idx = np.flatnonzero(flat)
    s = int(idx[0])
    row_len = int(np.prod(mask.shape[1:])) if mask.ndim > 1 else 1
    if mask.ndim == 2 and not flat[s:].all():            # only a top-left r0 x c0 block right: tiles / blocks
        good = ~mask
        r0 = int(good[:, 0].argmin()) if not good[:, 0].all() else mask.shape[0]
        c0 = int(good[0].argmin()) if not good[0].all() else mask.shape[1]
        if 0 < r0 and 0 < c0 and good[:r0, :c0].all() and mask[r0:].all() and mask[:, c0:].all():
            R, C = mask.shape
            part = (f"columns {c0}..{C - 1} of every row" if r0 == R else
                    f"rows {r0}..{R - 1} and columns {c0}..{C - 1}")
            return (f"only the top-left {r0} x {c0} block of {name} ({name}[:{r0}, :{c0}]) is right; {part} are "
                    f"{what}: the grid covers only the first tile(s) / block(s) along "
                    f"{'the columns' if r0 == R else 'both axes'}. Launch ceil(rows / TILE) x ceil(cols / TILE) "
                    f"blocks (blockIdx.y for rows, blockIdx.x for columns), or loop over the rest")
    if flat[s:].all():                                   # a suffix: everything from s on
        if mask.ndim > 1 and s % row_len == 0 and row_len > 1:
            unit, start, total, caps = "row", s // row_len, mask.shape[0], _ROW_CAPS
        else:
            unit, start, total, caps = "element", s, n, _GRID_CAPS
        at = ("" if unit == "row" or mask.ndim == 1 else
              f" (flat index; {name}{fmt_index(np.unravel_index(s, mask.shape))})")
        span = f"{unit}s {start}..{total - 1}" if total - start > 1 else f"{unit} {start}"
        partial = [b for b in (32, 64, 128, 256, 512, 1024) if total % b and start == total - total % b]
        if start in caps:
            text = (f"every {unit} past index G = {start} is {what} ({span}{at}): only the first G = blocks x threads "
                    f"{unit}s are covered. A launcher that caps the grid (MAX_BLOCKS x THREADS) needs a grid-stride "
                    f"loop in the kernel (for i in range(cuda.grid(1), n, cuda.gridsize(1)), or i += gridDim.x * "
                    f"blockDim.x in C++); without a cap, launch blocks = (n + threads - 1) // threads")
            if partial:
                text += " (the last partial block)"
            return text
        if partial:
            return (f"the last partial block is {what} ({span}{at}: {total} {unit}s is not a multiple of the "
                    f"{partial[0]}-thread block): launch blocks = (n + threads - 1) // threads, rounding up, and "
                    f"guard i < n in the kernel")
        if start % 32 == 0:
            return (f"only the first {start} {unit}s are right, {span} are {what}: the grid covers {start} threads "
                    f"(only the first block?); launch blocks = (n + threads - 1) // threads, or loop (grid-stride) "
                    f"over the rest")
        return f"{span} are {what}{at}: a loop bound or grid size stops at {start} instead of {total}"
    pattern = _stride_pattern(idx, n)
    if pattern is not None:
        k, j = pattern
        return (f"every {_ordinal(k)} element of {name} is {what} (flat indices {j}, {j + k}, {j + 2 * k}, ...): "
                f"an index mapping or stride bug (a step of {k}, or i * {k} where i is meant)")
    good = np.flatnonzero(~flat)
    pattern = _stride_pattern(good, n)
    if pattern is not None:
        k, j = pattern
        return (f"only every {_ordinal(k)} element of {name} is right (flat indices {j}, {j + k}, {j + 2 * k}, "
                f"...), the others are {what}: an index mapping or stride bug (a step of {k}, or each thread "
                f"handling one element of every {k})")
    if mask.ndim > 1:
        rows = np.flatnonzero(mask.reshape(mask.shape[0], -1).any(axis=1))
        if 0 < rows.size < mask.shape[0] and len(_ranges(rows).split(", ")) <= 2:
            return f"rows {_ranges(rows)} of {name} are {what} (the other rows are right)"
    return None


def _along(case, name, a, axis) -> Optional[np.ndarray]:
    """Output `name`'s array `a` as (size of `axis`, everything else), for axis "nh" (the heads: an axis of its own,
    or hs-wide blocks of the last axis when that is C or 3C = [q | k | v]) or "B" (the sequences); None when the
    output has no such axis."""
    sym = tuple(getattr(case, "sym", {}).get(name, ()))
    if len(sym) != np.ndim(a):
        return None
    if axis in sym:
        i = sym.index(axis)
        return np.moveaxis(a, i, 0).reshape(a.shape[i], -1)
    nh, hs = case.dims.get("nh", 0), case.dims.get("hs", 0)
    if axis == "nh" and sym and sym[-1] in ("C", "3C") and nh and hs and a.shape[-1] % (nh * hs) == 0:
        parts = a.shape[-1] // (nh * hs)
        b = np.reshape(a, a.shape[:-1] + (parts, nh, hs))
        return np.moveaxis(b, -2, 0).reshape(nh, -1)
    return None


_AXES = (  # (axis, what one index of it is, where a kernel gets that index, where one index's data lie)
    ("nh", "head", "the head index h (blockIdx.y % nh, or (row // T) % nh)",
     "[b, h, ...] of every array, or the offset (b * nh + h) * T * hs in a flat layout"),
    ("B", "sequence", "the batch index b (blockIdx.y // nh, or row // (nh * T))",
     "[b, ...] of every array, or the offset of sequence b in a flat layout"),
)


def _axis_hint(case, name, raw, ours, expected, bad) -> Optional[str]:
    """Only head 0 (or only sequence 0) written, or right: a kernel that lost the head (or batch) index. None when the
    wrong or unwritten elements are not exactly the heads (sequences) past the first."""
    unwritten = is_poison(raw)
    for axis, unit, index, at in _AXES:
        n = int(case.dims.get(axis, 0) or 0)
        if n < 2:
            continue
        nan = _along(case, name, unwritten, axis)
        wrong = _along(case, name, bad, axis)
        if nan is None or wrong is None or nan.shape[1] == 0:
            continue
        rest = f"{unit}s 1..{n - 1}" if n > 2 else f"{unit} 1"
        if nan[1:].all() and not nan[0].any():
            zero_ok = not wrong[0].any()
            return (f"only {unit} 0 of {name} was written, {rest} still hold{'s' if n == 2 else ''} the NaN we "
                    f"filled {name} with" + ("" if zero_ok else f", and {unit} 0 holds wrong values (another "
                                             f"{unit}'s result landed there)")
                    + f": every {unit} wrote to {unit} 0's place. {index[0].upper() + index[1:]} must select where "
                    f"each {unit}'s result goes as well as where its inputs are read: {at}")
        if nan.any() or wrong[0].any() or not wrong[1:].any(axis=1).all():
            continue
        o = _along(case, name, ours, axis)
        e = _along(case, name, expected, axis)
        tol = TOLERANCES.get(case.dtype.name, 1e-5)
        if all(close(o[i], e[0], mistake_slack(tol)) for i in range(1, n)):
            return (f"every {unit} of {name} holds {unit} 0's result ({unit} 0 is right): your kernel reads {unit} "
                    f"0's inputs for every {unit} and writes each result to its own place. {index[0].upper() + index[1:]} "
                    f"must offset the reads too: {at}")
        return (f"only {unit} 0 of {name} is right, {rest} {'are' if n > 2 else 'is'} wrong: {index} is missing "
                f"from (or wrong in) some index of your kernel: {at}")
    return None


def _factor_hint(name, c, dims, formula) -> str:
    if abs(c + 1) < 1e-3:
        return f"the sign of {name} is flipped (x-1): check the sign. {formula}"
    return f"{name} is off by a constant factor ({_factor_name(c, dims)}): check the scale. {formula}"


def _generic_hint(op, case, name, raw, o, e, bad, tol, returned) -> str:
    """A hint from the pattern of the wrong elements, when no known mistake matches."""
    poison = is_poison(raw)
    n = o.size
    kernel = getattr(case, "arrays", "numpy") in ("numba", "cupy")
    if poison.all():
        extra = (" Your function returned a value: the checker ignores it, it reads the output arrays."
                 if returned is not None else "")
        if kernel:
            return (f"{name} was never written (it still holds the NaN we filled it with): no thread of your kernel "
                    f"wrote it. A launch of 0 blocks (blocks = n // threads is 0 when n < threads: use "
                    f"(n + threads - 1) // threads), a guard that is never true, or a kernel given other arrays than "
                    f"the outputs (pass the very array you were given to the kernel)? If you accumulate (+=), zero it "
                    f"first.{extra}")
        return (f"{name} was never written (it still holds the NaN we filled it with): write into the array you "
                f"were given ({name}[...] = ... or in a kernel {name}[i] = ...); {name} = ... only rebinds the "
                f"name to a new array the checker never sees. If you accumulate (+=), zero it first.{extra}")
    if poison.any():
        k = int(poison.sum())
        pattern = _axis_hint(case, name, raw, o, e, bad)
        if pattern is not None:
            return pattern
        pattern = _where_pattern(name, poison, "never written")
        if pattern is None:
            where = _rows_text(poison)
            pattern = ("does your grid (or loop) cover every element, including the last partial block "
                       "(blocks = ceil(n / threads))?" + (f" ({where})" if where else ""))
        return (f"{k} of {n} elements of {name} were never written (still NaN; first at "
                f"{fmt_index(np.argwhere(poison)[0])}): {pattern}. Did you write into the output ({name}[...] = ...) "
                f"rather than rebinding the name?")
    nonfinite = ~np.isfinite(o)
    if nonfinite.any():
        k = int(nonfinite.sum())
        first = fmt_index(np.argwhere(nonfinite)[0])
        if (o[nonfinite] == -np.inf).all():
            return (f"{k} of {n} elements of {name} are -inf (first at {first}): the log of 0. What you take the log "
                    f"of is a sum that ended at 0: no term was ever added to it, or it was reset after terms were "
                    f"added (a running sum set back to 0 at every tile keeps only the last tile's terms, and a row "
                    f"with nothing in the last tile ends at 0)")
        return (f"{k} of {n} elements of {name} are NaN/inf (first at {first}): they "
                f"come from reading an output before writing it (outputs start as NaN: zero before +=), 0/0, inf - "
                f"inf, or exp overflow (subtract the row max)")
    pattern = _axis_hint(case, name, raw, o, e, bad)
    if pattern is not None:
        return f"{pattern}. {op.formula}"
    # a constant factor?
    ee = float((e * e).sum())
    if ee > 0:
        c = float((o * e).sum()) / ee
        if abs(c - 1) > mistake_slack(tol) and c != 0 and close(o, c * e, mistake_slack(tol)):
            return _factor_hint(name, c, case.dims, op.formula)
    if o.ndim == 2 and o.shape[0] == o.shape[1] and close(o, e.T, mistake_slack(tol)):
        return f"{name} looks transposed: it should be laid out {case.sym[name]}. {op.formula}"
    if not o.any():
        return f"{name} is all zeros. {op.formula}"
    if o.size > 1 and (o == o.flat[0]).all() and not (e == e.flat[0]).all():
        return (f"every element of {name} has the same value ({fmt(float(o.flat[0]))}): a scalar broadcast into "
                f"the array (a reduction over all axes?) where each element needs its own value. {op.formula}")
    pattern = _where_pattern(name, bad, "wrong")
    if pattern is not None:
        return f"{pattern}. {op.formula}"
    where = _rows_text(bad)
    if where.startswith("only the last"):
        return f"{name} is right except {where[5:]}: check your loop bound / grid size (the last partial block)."
    count = f"{int(bad.sum())} of {n} elements of {name} are wrong" + (f" ({where})" if where else "")
    return f"{count}. {op.formula}"


def compare_outputs(op, case, ours_raw: dict, expected: dict, tol: float):
    """Every output of one case against its float64 reference (the tolerance rule of verdict.compare, with the op's
    extra terms and parts): (ours in float64, bad masks, (max abs, max rel) per output (NaN where the output is not
    finite), atol per output, the names of the wrong outputs in order, (max abs, max rel) over the right ones)."""
    ours = {name: r.astype(np.float64) for name, r in ours_raw.items()}
    bads, stats, atols, wrong = {}, {}, {}, []
    terms = op.terms(case) if op.terms is not None else {}
    for name in case.outputs:
        bad, err, rel, atol = compare(ours[name], expected[name], tol, terms.get(name, 0.0),
                                       (op.parts or {}).get(name, 1))
        bads[name], atols[name] = bad, atol
        finite = bool(np.isfinite(ours[name]).all())
        stats[name] = (float(err.max()) if finite and err.size else (math.nan if not finite else 0.0),
                       float(rel.max()) if finite and rel.size else (math.nan if not finite else 0.0))
        if bad.any():
            wrong.append(name)
    right = [stats[n] for n in case.outputs if n not in wrong and not math.isnan(stats[n][0])]
    best = (max((a for a, _ in right), default=0.0), max((r for _, r in right), default=0.0))
    return ours, bads, stats, atols, wrong, best


def changed_inputs_note(case, dev_in) -> str:
    """" (Note: your function changed its input ...)" when the learner's function wrote into an input, else ""."""
    changed = [n for n, d in zip(case.inputs, dev_in)
               if not np.array_equal(np.asarray(_arrays.to_numpy(d)), case.inputs[n], equal_nan=True)]
    if not changed:
        return ""
    return (f" (Note: your function changed its input{'s' if len(changed) > 1 else ''} "
            f"{', '.join(changed)}; inputs are read-only.)")


def diagnose(op, case, ours_raw, ours, expected, bads, wrong, tol, returned) -> tuple:
    """Known mistakes first (per wrong output), then generic patterns; at most two hints. Returns (hint, generic):
    generic when no mistake of the op's table named it (or only a catch-all did)."""
    cache = {}

    def mistake_outputs(i, m):
        if i not in cache:
            try:
                cache[i] = m.outputs(case) if m.outputs is not None else {}
            except Exception:  # a mistake that does not apply to these shapes
                cache[i] = {}
        return cache[i]

    previous = getattr(case, "previous", None)   # {output: expected of an earlier call with the same shapes}
    if previous and all(name in previous and previous[name].shape == ours[name].shape
                        and not close(previous[name], expected[name], tol)
                        and close(ours[name], previous[name], mistake_slack(tol)) for name in wrong):
        return (f"your {', '.join(wrong)} equal{'s' if len(wrong) == 1 else ''} the right answer for the inputs of an "
                f"EARLIER call, not this one: your function keeps state between calls (a cached result, a global, "
                f"a buffer filled once and reused). Compute everything from this call's inputs; the checker calls "
                f"it several times with different inputs"), False
    if previous and all(name in previous and previous[name].shape == ours[name].shape
                        and not close(expected[name] + previous[name], expected[name], tol)
                        and close(ours[name], expected[name] + previous[name], mistake_slack(tol)) for name in wrong):
        return (f"your {', '.join(wrong)} {'is' if len(wrong) == 1 else 'are'} the right answer for this call PLUS the "
                f"right answer of an EARLIER call with the same shapes: your function adds into something it keeps "
                f"between calls (a scratch buffer allocated once, a partial sum, an accumulator filled with atomics) "
                f"without setting it to 0 first. Zero what you add into at the start of every call"), False

    if not op.accumulates and all(is_poison(r).all() for r in ours_raw.values()):
        name = wrong[0]  # nothing at all was written: the rebinding hint, whatever the op
        hint = _generic_hint(op, case, name, ours_raw[name], ours[name], expected[name], bads[name], tol, returned)
        if len(ours_raw) > 1:
            names = ", ".join(ours_raw)
            hint = hint.replace(f"{name} was never written", f"nothing was written ({names} still hold the NaN "
                                                             f"we filled them with)", 1)
            hint = hint.replace(" (it still holds the NaN we filled it with)", "", 1)
        return hint, False

    def known(name):
        """(hint, catch-all) of the first mistake whose output equals yours; else of the first matching pattern
        test; (None, False) when none does."""
        for i, m in enumerate(op.mistakes):
            wrong_out = mistake_outputs(i, m).get(name)
            if wrong_out is not None and np.shape(wrong_out) == ours[name].shape:
                wrong_out = np.asarray(wrong_out, dtype=np.float64)
                if not close(wrong_out, expected[name], tol) and close(ours[name], wrong_out, mistake_slack(tol)):
                    return m.hint, m.catchall
        for m in op.mistakes:
            try:
                found = m.test(case, name, ours[name], expected[name], bads[name]) if m.test is not None else None
                if found:
                    return (found if isinstance(found, str) else m.hint), m.catchall
            except Exception:  # a pattern test that does not apply
                pass
        return None, False

    hints, generic = [], False
    for name in wrong:
        hint, catchall = known(name)
        if not hints:
            generic = hint is None or catchall
        if hint is None and not hints:
            hint = _generic_hint(op, case, name, ours_raw[name], ours[name], expected[name], bads[name], tol, returned)
        if hint is not None and hint not in hints:
            hints.append(hint)
        if len(hints) == 2:
            break
    return " Also: ".join(hints), generic


_SHAPE_WORDS = ("shape", "broadcast", "mismatch", "dimension", "matmul", "out of bounds", "index", "size",
                "aligned")


# An exception raised inside a kernel in Numba's CUDA simulator starts with the thread and block that raised it.
_SIM_THREAD = re.compile(r"tid=\[(\d+),\s*(\d+),\s*(\d+)\]\s*ctaid=\[(\d+),\s*(\d+),\s*(\d+)\]:?\s*(.*)", re.S)


def kernel_error(exc) -> Optional[tuple]:
    """(thread (x, y, z), block (x, y, z), message) when exc was raised inside a kernel in the CUDA simulator."""
    m = _SIM_THREAD.search(str(exc))
    if m is None:
        return None
    g = [int(v) for v in m.groups()[:6]]
    return tuple(g[:3]), tuple(g[3:]), " ".join(m.group(7).split())


# A call of math's log / sqrt (or their cousins) in the line that raised, and its argument.
_MATH_CALL = re.compile(r"\b(?:math\.|np\.|numpy\.)?(log|log2|log10|log1p|sqrt|acos|asin)\s*\(\s*([\w\[\], .]+?)\s*\)")
_PLAIN_ARG = re.compile(r"[A-Za-z_]\w*(\[[\w, ]+\])?")   # a name, or a name indexed by names and numbers: safe to read


def _raising_frame(exc):
    """(frame, line number) of the innermost frame of the learner's code in exc's traceback (else of code compiled
    from a string), or None."""
    import traceback
    found, cell = None, None
    for frame, lineno in traceback.walk_tb(exc.__traceback__):
        filename = frame.f_code.co_filename
        if verdict.is_learner_code(filename):
            found = (frame, lineno)
        elif filename.startswith("<") and not filename.startswith("<frozen"):
            cell = (frame, lineno)       # code compiled from a string (a cell run by hand, a test's edited solution)
    return found or cell


def _read_arg(arg, frame) -> Optional[float]:
    """The value of `arg` (a name, or a name indexed by names and integers) in the frame, or None."""
    if not _PLAIN_ARG.fullmatch(arg):
        return None

    def lookup(name):
        return frame.f_locals[name] if name in frame.f_locals else frame.f_globals.get(name)

    name, _, index = arg.partition("[")
    try:
        value = lookup(name)
        if index:
            keys = tuple(int(k) if k.strip().lstrip("-").isdigit() else int(lookup(k.strip()))
                         for k in index.rstrip("]").split(","))
            value = value[keys if len(keys) > 1 else keys[0]]
        return float(value)
    except Exception:  # not readable here: the function alone is named
        return None


def math_domain_why(exc) -> str:
    """Why a math domain error was raised (log or sqrt of 0 or a negative number), from the learner's line that
    raised it and the value of the argument there: log of 0 (a sum that stayed 0), or of a negative number."""
    import linecache
    found = _raising_frame(exc)
    calls, values = [], {}
    if found is not None:
        frame, lineno = found
        line = linecache.getline(frame.f_code.co_filename, lineno)
        calls = _MATH_CALL.findall(line)
        for func, arg in calls:
            value = _read_arg(arg, frame)
            if value is not None:
                values[arg] = value
    for func, arg in calls:
        v = values.get(arg)
        if v is None:
            continue
        if v == 0 and func in ("log", "log2", "log10"):
            return (f"{func}({arg}) with {arg} = 0: the log of 0 (on a GPU -inf, and -inf or NaN in the output). "
                    f"{arg} is a sum that ended at 0: no term was ever added to it, or it was reset after terms were "
                    f"added (a running sum set back to 0 at every tile keeps only the last tile's terms, and a row "
                    f"with nothing in the last tile ends at 0). Set it to 0 once, before the loop, and add every "
                    f"term into it")
        if v < 0:
            return (f"{func}({arg}) with {arg} = {fmt(v)}, a negative number: a variance that rounding made slightly "
                    f"negative (take the mean of the squared deviations, or clamp at 0), a sign error, or a value "
                    f"read from outside the array?")
    funcs = sorted({func for func, _ in calls})
    if funcs and all(f.startswith("log") for f in funcs):
        return ("a math domain error in log: the log of 0 or of a negative number. A sum that stayed 0 (nothing "
                "added to it, or reset inside the loop after it was filled)? A value read from outside the array?")
    return ("a math domain error: sqrt or log of a negative number, or log of 0 (a variance that rounding made "
            "slightly negative? a sum that stayed 0? a value read from outside the array?)")


def _kernel_error_hint(exc, where, shapes) -> Optional[str]:
    """The hint for an error raised inside a simulated kernel: which thread, which block, the likely cause."""
    parsed = kernel_error(exc)
    if parsed is None:
        return None
    tid, ctaid, text = parsed
    at = f" at {where}" if where else ""
    who = f"thread {tid} of block {ctaid} raised {type(exc).__name__}{at}: {text}"
    low = text.lower()
    if isinstance(exc, IndexError):
        why = ("likely an index past the end of an array: guard it (if i < n:), since the last block has threads "
               "past the end; check the index arithmetic (row * width + col, tile offsets k0 + kk) and loop bounds")
    elif isinstance(exc, ZeroDivisionError):
        why = "a division by zero in that thread: a count, size or stride that is 0 there?"
    elif "math domain" in low:
        why = math_domain_why(exc)
    elif isinstance(exc, OverflowError) or "range" in low:
        why = "a math range error: exp of a large number overflows (subtract the row max first)"
    elif isinstance(exc, TypeError):
        why = "a type problem inside the kernel (an argument of the wrong kind: pass arrays and int scalars)"
    else:
        why = "the error is in your kernel"
    return f"{who} - {why}; {shapes}"


def _error_hint(op, case, exc) -> str:
    text = f"{type(exc).__name__}: {exc}".lower()
    where = where_raised(exc)
    at = f" (at {where})" if where else ""
    shapes = f"shapes here: {case.describe_shapes()}"
    in_kernel = _kernel_error_hint(exc, where, shapes)
    if in_kernel is not None:
        return in_kernel
    if "grid" in text or "launch" in text:
        return (f"check your kernel launch{at}: blocks = (n + threads - 1) // threads covers n elements with at "
                f"least one block; {shapes}")
    if isinstance(exc, (ValueError, IndexError, TypeError)) and any(w in text for w in _SHAPE_WORDS):
        return f"a shape or index problem{at}: check your transposes and axes. {shapes}. {op.shape_hint}"
    return verdict.error_hint(exc, shapes)


def op_error(op, case, exc, seed, info) -> CheckResult:
    """The "error" verdict (not yet recorded) for an exception raised by the call on `case`: the thread and block
    when it was raised inside a kernel in the simulator, the hint of _error_hint, the seed. info: CheckResult
    fields (name, task, dims, ...)."""
    msg = verdict.error_message(op.name, exc)
    parsed = kernel_error(exc)
    if parsed is not None:
        tid, ctaid, text = parsed
        text = verdict.error_text(text)
        msg = (f"{op.name}: error - your kernel raised {type(exc).__name__} in thread {tid} of block {ctaid}"
               + (f": {text}" if text else ""))
    return verdict.build_result("error", msg, _error_hint(op, case, exc) + f" (seed {seed})", **info)


# ------------------------------------------------------------------------------------------------------------
# Running one check
# ------------------------------------------------------------------------------------------------------------
def validate(op_name, fn, arrays, dtype, size, seed):
    checker = f"check_{op_name}"
    if not callable(fn):
        raise TypeError(f"{checker}(fn): fn must be your function, got {type(fn).__name__} {fn!r:.60}: pass the "
                        f"function itself, e.g. {checker}({op_name}), without calling it")
    kind = type(fn).__name__
    if kind in ("CUDADispatcher", "FakeCUDAKernel") and "numba" in (type(fn).__module__ or ""):
        raise TypeError(f"{checker}(fn): fn is a Numba kernel; pass a Python function that launches it with "
                        f"the same arguments, e.g. def {op_name}(...): kernel[blocks, threads](...)")
    _arrays.require(arrays)
    dt = normalize_dtype(dtype)
    size = default_size(arrays, size)
    if size not in SIZES:
        raise ValueError(f"size={size!r}: use one of {', '.join(repr(s) for s in SIZES)} (or None: 'large' when the "
                         f"arrays live on a GPU, else 'small')")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0):
        raise TypeError(f"seed={seed!r}: use a non-negative int, or None for fresh random inputs")
    return dt, size


def default_size(arrays, size=None) -> str:
    """size=None means "large" when the arrays live on a real GPU (arrays="cupy", or "numba" when Numba runs on the
    GPU) and "small" otherwise (NumPy, the CUDA simulator). Any other size is returned as given."""
    if size is not None:
        return size
    on_gpu = arrays == "cupy" or (arrays == "numba" and _device.numba_on_gpu())
    return "large" if on_gpu else "small"


def learner_fn_and_seed(name, fn, seed, what="inputs") -> int:
    """The checks every checker starts with: fn is the learner's callable (not its result), seed a non-negative int
    or None. Returns the seed to use (a fresh one for None); raises naming the mistake."""
    if not callable(fn):
        raise TypeError(f"check_{name}(fn): fn must be your function, got {type(fn).__name__} {fn!r:.60}: pass "
                        f"the function itself, without calling it")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0):
        raise TypeError(f"seed={seed!r}: use a non-negative int, or None for fresh random {what}")
    return secrets.randbelow(1_000_000) if seed is None else int(seed)


def source_text(source):
    """(text, None) or (None, (status, why)) from a HIP source given as a str or a zero-argument callable."""
    if isinstance(source, str):
        return source, None
    try:
        text = source()
    except NotImplementedError:
        return None, ("not attempted", "your source function raised NotImplementedError")
    except Exception as exc:  # the learner's error is reported, never raised
        where = where_raised(exc)
        return None, ("error", verdict.what_raised(exc, "source function") + (f" (at {where})" if where else ""))
    if not isinstance(text, str):
        return None, ("error", f"your source function returned {type(text).__name__}, not the kernel source "
                               f"as a str")
    return text, None


def hip_compile_only(name, source, entries, *, task=None, quiet=False) -> "CheckResult":
    """Grade a HIP/CUDA C++ kernel source without a GPU: it must compile for NVIDIA (NVRTC, sm_90) and AMD (hipcc,
    gfx90a, when installed), define every entry point in `entries` as ``extern "C" __global__``, and pass the
    course's portability lint (``hip.lint_source``). It is not run: status "compiled" (counted apart from
    correct/wrong), or "wrong" naming the compiler error, the lint finding or the missing entry point.

    source: the source str, or a zero-argument function returning it (NotImplementedError: "not attempted").
    entries: an entry point name or a list of them. Records the verdict for grading like every checker.
    """
    from ..runtime import hip
    if not (isinstance(source, str) or callable(source)):
        raise TypeError(f"hip_compile_only(source): pass the kernel source as a str, or a function returning it; "
                        f"got {type(source).__name__}")
    entries = (entries,) if isinstance(entries, str) else tuple(entries or ())
    if not all(isinstance(e, str) and e for e in entries):
        raise TypeError(f"hip_compile_only(entries): entry point names must be non-empty str, got {entries!r}")
    text, failed = source_text(source)
    if failed is not None:
        status, why = failed
        if status == "not attempted":
            return verdict.record(verdict.not_attempted(name, who="source function", task=task, arrays="cupy",
                                                        hint="replace the `raise NotImplementedError` with your "
                                                             "kernel source"), quiet=quiet)
        return verdict.verdict(name, task, "error", f"{name}: error - {why}", quiet=quiet, arrays="cupy")
    ok, report = hip.grade_source(text, entries)
    if ok:
        return verdict.verdict(name, task, "compiled", f"{name}: compiled - {report}; {NOT_RUN_HIP}", quiet=quiet,
                               arrays="cupy")
    return verdict.verdict(name, task, "wrong", f"{name}: wrong - your kernel source does not pass the checks without "
                           f"a GPU", report, quiet=quiet, arrays="cupy")


# what a HIP task's verdict says without a GPU: it was compiled and linted, not run, and what a GPU run checks
NOT_RUN_HIP = ("not run: no GPU (compiled and linted only; on a GPU server the same checker runs it on fresh random "
               "inputs against the reference, past the launch's capped grid, with guard zones around every output)")


def _kernels_of(fn):
    """(name, Python source or None) of every Numba kernel the launcher ``fn`` refers to: a global name in its code,
    nested code included, or a variable of an enclosing function."""
    code, glob = getattr(fn, "__code__", None), getattr(fn, "__globals__", None)
    if code is None or glob is None:
        return []
    cells = dict(zip(code.co_freevars, getattr(fn, "__closure__", None) or ()))
    names, todo = set(code.co_freevars), [code]
    while todo:
        co = todo.pop()
        names.update(co.co_names)
        todo.extend(c for c in co.co_consts if hasattr(c, "co_names"))
    found = []
    for name in sorted(names):
        try:
            obj = cells[name].cell_contents if name in cells else glob.get(name)
        except ValueError:  # an empty closure cell
            continue
        if type(obj).__name__ not in ("CUDADispatcher", "FakeCUDAKernel"):
            continue
        py = getattr(obj, "py_func", None) or getattr(obj, "fn", None)
        try:
            found.append((name, inspect.getsource(py)))
        except (OSError, TypeError):
            found.append((name, None))
    return found


def unfinished_kernel(fn) -> Optional[str]:
    """The name of a Numba kernel that the launcher ``fn`` refers to (a global name in its code, nested code
    included, or a variable of an enclosing function) whose source still raises NotImplementedError, else None.

    Needed on a GPU: there Numba compiles a ``raise`` inside a kernel away (it only raises with debug=True), so an
    untouched exercise kernel runs, writes nothing and would read as "wrong" instead of "not attempted"."""
    return next((name for name, src in _kernels_of(fn) if src and "raise NotImplementedError" in src), None)


def _uses_shared_memory(fn) -> bool:
    """A kernel that the launcher fn refers to allocates shared memory (cuda.shared.array)."""
    return any(src and "shared.array" in src for _, src in _kernels_of(inspect.unwrap(fn)))


def _barrier_hint(trace, values_wrong=True) -> Optional[str]:
    """The hint for a traced call in which one thread wrote a shared slot and another read it between the same two
    barriers (kernel_trace's shared_hazards), else None."""
    hazards = trace.shared_hazards
    if not hazards:
        return None
    h = hazards[0]
    slot = f"{h['array']}{fmt_index(h['index'] if isinstance(h['index'], tuple) else (h['index'],))}"
    writer, reader = _who(h["writer"]), _who(h["reader"])
    more = (f" ({len(hazards)} shared slots like it in {h['kernel']})" if len(hazards) > 1 else "")
    what = (f"{writer} wrote {slot} and {reader} read it between the same two barriers, with no cuda.syncthreads() "
            f"between the write and the read{more}: on a GPU either can happen first, so the read sees the old or the "
            f"new value by chance")
    return (f"a missing barrier in {h['kernel']}: {what}. A thread may read another thread's shared slot only after "
            f"a barrier that follows the write (after the stores into shared memory, after each step of a tree), and "
            f"a slot may be written again only after a barrier that follows the reads (before the next tile's or "
            f"row's stores)" + (". The wrong values here are what the simulator's order of threads made of it"
                                if values_wrong else ""))


# ------------------------------------------------------------------------------------------------------------
# Rules beyond the values, and the one loop
# ------------------------------------------------------------------------------------------------------------
def matches(ours, candidate, expected, tol) -> bool:
    """ours equals a mistake's output (within the mistake slack) that is itself not the right answer."""
    candidate = np.asarray(candidate, dtype=np.float64)
    if candidate.shape != ours.shape:
        return False
    with np.errstate(all="ignore"):
        return not close(candidate, expected, tol) and close(ours, candidate, mistake_slack(tol))


@dataclasses.dataclass
class Rules:
    """How the outputs must be made, beyond their values (the defaults: nothing more).

    checker: the name the verdict is recorded under for grading (None: check_<op name>).
    patterns: (case, name, ours, expected, bad) -> hint or None, tried before the op's mistake table (hints that
        name a place: "rows 32..36 are missing").
    repeat: call fn a second time on the last case's inputs: the outputs must be the same bits.
    exact: case -> {output: array in the case's dtype}: after the values pass, these bits are required.
    races: in the simulator, trace the first call; an element stored by several threads in one launch without
        atomics is wrong. no_float_atomics: in the simulator, any atomic on a float array is wrong.
    split: (input name, hint): in the simulator, a thread that loads elements from more than half of that input's
        rows (one thread walking a whole column) is wrong: the task asks for the work split into chunks.
    barriers: in the simulator, one thread of a block writing a shared-memory slot and another reading it between
        the same two cuda.syncthreads() is wrong (a missing barrier), even where the simulator's order of threads
        happened to give the right values.
    trace_case: the case that is traced for races, float atomics, split and barriers (0: the first).
    """
    checker: Optional[str] = None
    patterns: tuple = ()
    repeat: bool = False
    exact: Optional[Callable] = None
    exact_hint: str = ""
    races: bool = False
    no_float_atomics: bool = False
    split: Optional[tuple] = None     # (input, hint): in the simulator, no thread may load over half of its rows
    barriers: bool = False
    trace_case: int = 0


def _simulating() -> bool:
    from numba import config
    return bool(config.ENABLE_CUDASIM)


def _who(w) -> str:
    b, t = w
    return f"(block {b}, thread {t})"


def _trace_names(trace, dev_arrays, names):
    """trace array name -> the checker's name, for the arrays the trace saw (matched by memory)."""
    res = {}
    for name, d in zip(names, dev_arrays):
        a = getattr(d, "_ary", d)
        if not isinstance(a, np.ndarray):
            continue
        lo = a.__array_interface__["data"][0]
        for info in trace.arrays.values():
            if info.space == "global" and info.ptr <= lo < info.ptr + max(info.nbytes, 1):
                res[info.name] = name
    return res


def _trace_problem(rules, case, trace, dev_in, dev_out) -> Optional[tuple]:
    """(what, hint) when the traced call broke a rule of `rules`, else None."""
    from . import kernel_trace as kt
    outs = _trace_names(trace, dev_out, list(case.outputs))
    if rules.barriers:
        hint = _barrier_hint(trace, values_wrong=False)
        if hint is not None:
            h = trace.shared_hazards[0]
            return (f"your values are right here, but one thread of a block wrote the shared slot {h['array']}"
                    f"{fmt_index(h['index'] if isinstance(h['index'], tuple) else (h['index'],))} and another read it "
                    f"between the same two barriers (a missing cuda.syncthreads(); the order the simulator ran the "
                    f"threads in hid it)", hint)
    if rules.split is not None:
        name, hint = rules.split
        ins = _trace_names(trace, dev_in, list(case.inputs))
        ids = [i for i, a in trace.arrays.items() if ins.get(a.name) == name]
        rec = trace.records[(trace.records["kind"] == kt.READ) & np.isin(trace.records["array"], ids)]
        if len(rec) and ids:
            a = trace.arrays[ids[0]]
            row = (rec["addr"] - a.vbase) // a.itemsize // max(1, int(np.prod(a.shape[1:])))
            key = np.stack([rec["launch"], rec["block"], rec["thread"], row], 1).astype(np.int64)
            who, per = np.unique(np.unique(key, axis=0)[:, :3], axis=0, return_counts=True)
            n_rows = a.shape[0]
            if n_rows >= 8 and per.max() > n_rows // 2:
                L = trace.launches[int(who[per.argmax()][0])]
                w = L.who(int(who[per.argmax()][1]), int(who[per.argmax()][2]))
                return (f"one thread ({L.kernel} {_who(w)}) read {int(per.max())} of the {n_rows} rows of {name}",
                        hint)
    if rules.races:
        for tname, rows in trace.multiple_writers.items():
            name = outs.get(tname, tname)
            index, who = rows[0]
            idx = fmt_index(index if isinstance(index, tuple) else (index,))
            threads = ", ".join(_who(w) for w in who[:3]) + (f" and {len(who) - 3} more" if len(who) > 3 else "")
            what = (f"{name}{idx} was stored by {len(who)} threads in one launch without atomics ({threads}); "
                    f"{len(rows)} element{'s' if len(rows) > 1 else ''} of {name} like it")
            hint = (f"a race: on a GPU those threads read the same old value and each writes back its own sum, so all "
                    f"but one contribution can be lost (here, in the simulator, threads happen to run one after "
                    f"another, so the values came out right). Add into {name} with cuda.atomic.add({tname}, index, "
                    f"value), or give every element of {name} one owner thread")
            return what, hint
    if rules.no_float_atomics and len(trace.records):
        rec = trace.records[trace.records["kind"] == kt.ATOMIC]
        floats = sorted({trace.arrays[int(a)].name for a in np.unique(rec["array"])
                         if trace.arrays[int(a)].dtype.kind == "f"})
        if floats:
            shown = ", ".join(outs.get(n, n) for n in floats)
            what = f"your kernels add into {shown} with float atomics (cuda.atomic.add)"
            hint = ("float atomics are not deterministic: on a GPU they land in whatever order the threads get "
                    "there, float addition is not associative, so the last bits change from run to run (in the "
                    "simulator they happen to land in order). Give every output element one owner thread that adds "
                    "its terms in a fixed order (or write partial sums, then add the partials in a fixed order)")
            return what, hint
    return None


def _case_text(case, k, op) -> str:
    sizes = ", ".join(f"{name}={v}" for name, v in case.dims.items() if name.isidentifier())
    return f"case {k + 1} of {op.n_cases}: {sizes}"


def _first_diff(a, b):
    """Index of the first element whose bits differ (NaN payloads included), or None."""
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    if a.shape != b.shape:
        return ()
    u = {2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize]
    diff = a.view(u) != b.view(u)
    if not diff.any():
        return None
    return tuple(int(i) for i in np.argwhere(diff)[0])


def _known_mistake(op, case, name, ours, expected, tol) -> Optional[str]:
    """The hint of the first mistake of the op's table that changes output `name` and whose outputs all equal yours
    (exact mistakes come before the pattern hints, which only say where)."""
    for m in op.mistakes:
        if m.outputs is None:
            continue
        try:
            outs = m.outputs(case)
        except Exception:  # a mistake that does not apply to these shapes
            continue
        if name in outs and all(matches(ours[n], o, expected[n], tol) for n, o in outs.items() if n in ours):
            return m.hint
    return None


def _rule_hint(rules, op, case, name, ours_raw, ours, expected, bads, tol) -> Optional[str]:
    """With rules.patterns: the op's mistake whose outputs all equal yours, else the first pattern's hint (hints that
    name a place come before the generic diagnosis), else None. Without patterns: None (diagnose decides)."""
    if not rules.patterns:
        return None
    hint = _known_mistake(op, case, name, ours, expected, tol)
    if hint is not None or is_poison(ours_raw[name]).all():
        return hint
    hint = _axis_hint(case, name, ours_raw[name], ours[name], expected[name], bads[name])
    if hint is not None:
        return hint
    for pattern in rules.patterns:
        try:
            hint = pattern(case, name, ours[name], expected[name], bads[name])
        except Exception:  # a pattern that does not apply to these shapes
            hint = None
        if hint:
            return hint
    return None


def run(op: Op, fn, *, rules: Optional[Rules] = None, arrays="numpy", dtype=np.float32, size=None, seed=None,
        task=None, quiet=False, source=None, entries=None) -> CheckResult:
    """Grade `fn` on op's cases (see the module docstring), with `rules` on top of the values; record and return the
    verdict. source, entries: a HIP task's kernel source and entry points, graded by hip_compile_only when
    arrays="cupy" on a machine without a GPU."""
    rules = Rules() if rules is None else rules
    if arrays == "cupy" and callable(fn) and not _device.has_gpu():
        if source is not None:
            return hip_compile_only(op.name, source, entries, task=task, quiet=quiet)
        return verdict.skipped(op.name, task, quiet=quiet, check=rules.checker)
    dt, size = validate(op.name, fn, arrays, dtype, size, seed)   # size None: "large" on a GPU
    from . import borrowed

    own = op.own or borrowed.course_implementations(op.name)
    taken = borrowed.borrowed_verdict(op.name, [fn], own, task=task, seed=seed, quiet=quiet, check=rules.checker)
    if taken is not None:
        return taken
    stub = unfinished_kernel(inspect.unwrap(fn))
    seed = secrets.randbelow(1_000_000) if seed is None else int(seed)
    rng = np.random.default_rng(seed)
    tol = TOLERANCES[dt.name]
    base = dict(name=op.name, task=task, tol=tol, seed=seed, dtype=dt.name, arrays=arrays)
    traced = (rules.races or rules.no_float_atomics or rules.split is not None or rules.barriers) \
        and arrays == "numba" and _simulating()
    max_rel_all, max_abs_all = 0.0, 0.0
    result, case, last = None, None, None

    def call(case, info, trace_it):
        """Run fn on fresh poisoned outputs: (ours_raw, returned, trace, dev_in, dev_out) or a CheckResult."""
        try:
            dev_in = [_arrays.to_backend(a, arrays) for a in case.inputs.values()]
            dev_out, guard_bufs = guarded_outputs(case.outputs.values(), dt, arrays,
                                                           guards_on(arrays) and not trace_it)
        except _arrays.BackendUnavailableError:
            raise
        except Exception as exc:
            raise _arrays.BackendUnavailableError(f"could not put {dt.name} arrays on arrays={arrays!r} "
                                                  f"({type(exc).__name__}: {exc}); use another dtype or "
                                                  f"backend") from exc
        args = [*dev_in, *dev_out, *case.scalars.values()]
        returned, trace = None, None
        try:
            if trace_it:
                from . import kernel_trace
                trace = kernel_trace.trace(fn, *args, raise_errors=True)
            else:
                returned = fn(*args)
            ours_raw = {name: np.asarray(_arrays.to_numpy(d)) for name, d in zip(case.outputs, dev_out)}
            stray = guard_verdict(op, case, k, guard_bufs, dt, seed, info)
            if stray is not None:
                return stray
        except NotImplementedError:
            return verdict.not_attempted(**info)
        except Exception as exc:  # the learner's error is reported, never raised
            return op_error(op, case, exc, seed, info)
        return ours_raw, returned, trace, dev_in, dev_out

    def wrong(info, what, hint, **kw):
        msg = f"{op.name}: wrong - {what} ({_case_text(case, k, op)}; seed {seed})"
        return verdict.build_result("wrong", msg, hint, **kw, **info)

    history = []   # expected outputs of the earlier cases: checks' hints recognize a stale answer
    for k in range(op.n_cases):
        case = op.make(rng, dt, size, k)
        case.arrays = arrays
        expected = {name: np.asarray(v, dtype=np.float64) for name, v in op.expected(case).items()}
        shapes = {name: np.shape(v) for name, v in expected.items()}
        case.previous = next((prev for prev_shapes, prev in reversed(history) if prev_shapes == shapes), None)
        history.append((shapes, expected))
        info = dict(base, dims=dict(case.dims), inputs={k2: v.copy() for k2, v in case.inputs.items()})
        if stub is not None:
            result = verdict.unfinished(kernel=stub, **info)
            break
        got = call(case, info, traced and k == min(rules.trace_case, op.n_cases - 1))
        if isinstance(got, verdict.CheckResult):
            result = got
            break
        ours_raw, returned, trace, dev_in, dev_out = got

        ours, bads, stats, atols, bad_names, (case_abs, case_rel) = compare_outputs(op, case, ours_raw,
                                                                                           expected, tol)
        max_abs_all, max_rel_all = max(max_abs_all, case_abs), max(max_rel_all, case_rel)
        info["atol"] = atols

        if bad_names:
            name = bad_names[0]
            index = tuple(int(i) for i in np.argwhere(bads[name])[0])
            mine, exp = float(ours[name][index]), float(expected[name][index])
            max_abs, max_rel = stats[name]
            hint = _rule_hint(rules, op, case, name, ours_raw, ours, expected, bads, tol)
            generic = False
            if hint is None:
                hint, generic = diagnose(op, case, ours_raw, ours, expected, bads, bad_names, tol, returned)
            if generic and arrays == "numba" and _simulating() and _uses_shared_memory(fn):
                # wrong values in no known pattern from a kernel with shared memory: the call traced (again, unless
                # it was), and a missing barrier named if two threads touched a slot between the same two barriers
                if trace is None:
                    again = call(case, info, True)
                    trace = None if isinstance(again, verdict.CheckResult) else again[2]
                barrier = None if trace is None else _barrier_hint(trace)
                if barrier is not None:
                    hint = barrier
            hint += changed_inputs_note(case, dev_in)
            msg = (f"{op.name}: wrong - {name} at {fmt_index(index)} ({_case_text(case, k, op)}): yours "
                   f"{fmt(mine, exp)}, expected {fmt(exp, mine)} (max abs err {max_abs:.2g}, "
                   f"max rel {max_rel:.2g}, tol {tol:g}; seed {seed})")
            result = verdict.build_result("wrong", msg, hint, output=name, max_abs=max_abs, max_rel=max_rel,
                                          first_bad=index, ours=mine, expected=exp, **info)
            break

        if trace is not None:
            problem = _trace_problem(rules, case, trace, dev_in, dev_out)
            if problem is not None:
                result = wrong(info, *problem)
                break

        if rules.exact is not None:
            for name, want in rules.exact(case).items():
                i = _first_diff(ours_raw[name], np.asarray(want, dtype=dt))
                if i is not None:
                    result = wrong(info, f"{name}{fmt_index(i)} is {fmt(float(ours_raw[name][i]))}, "
                                         f"correct to rounding, but the contract's order gives "
                                         f"{fmt(float(want[i]))} (other bits)", rules.exact_hint,
                                   output=name, first_bad=i, ours=float(ours_raw[name][i]), expected=float(want[i]))
                    break
            if result is not None:
                break
        last = (case, ours_raw, info)

    if result is None and rules.repeat and last is not None:
        case, first_raw, info = last
        got = call(case, info, False)
        if isinstance(got, verdict.CheckResult):
            result = got
        else:
            for name in case.outputs:
                i = _first_diff(first_raw[name], got[0][name])
                if i is not None:
                    one, two = first_raw[name].astype(np.float64), got[0][name].astype(np.float64)
                    if close(two, 2 * one, mistake_slack(tol)) and not close(one, 2 * one, tol):
                        why = ("the second call gave twice what the first gave: your function adds into something it "
                               "keeps between calls (a scratch buffer allocated once, a partial sum) without setting "
                               "it to 0 first, so the second call adds onto the first call's leftovers. Zero what you "
                               "add into at the start of every call")
                    else:
                        why = ("your result depends on the order in which threads or blocks run: float atomics, or "
                               "a sum whose order is decided by scheduling. Give each output element one owner that "
                               "adds its terms in a fixed order (partial sums in order, then the partials in order)")
                    result = wrong(info, f"two calls on the same inputs gave different bits: {name}"
                                         f"{fmt_index(i)} was {fmt(float(first_raw[name][i]))}, then "
                                         f"{fmt(float(got[0][name][i]))}", why, output=name, first_bad=i)
                    break

    if result is None:
        n_out = len(case.outputs)
        extra = []
        if rules.repeat:
            extra.append("same bits twice")
        if rules.exact is not None:
            extra.append("bits of the fixed order")
        if traced and rules.races:
            extra.append("no races (traced)")
        if traced and rules.no_float_atomics:
            extra.append("no float atomics (traced)")
        if traced and rules.split is not None:
            extra.append(f"work split over the rows of {rules.split[0]} (traced)")
        if traced and rules.barriers:
            extra.append("no missing barriers (traced)")
        msg = (f"{op.name}: correct (max rel err {max_rel_all:.2g}, tol {tol:g}, {verdict.DTYPE_SHORT[dt.name]}, "
               f"{n_out} output{'s' if n_out > 1 else ''}{'; ' + ', '.join(extra) if extra else ''})")
        result = verdict.build_result("correct", msg, max_abs=max_abs_all, max_rel=max_rel_all, **info)
    return verdict.record(result, quiet=quiet, check=rules.checker)
