"""Checkers for the kernels a learner writes in lessons 00, 02 and 03: shapes chosen so that size cannot fool them.

Each checker calls your destination-passing launcher on several cases, drawn deterministically (values are random,
shapes are not), and compares what it wrote with a float64 NumPy answer, like ``gpullm_lessons.checks.backward`` (whose
``Op`` / ``Mistake`` machinery runs them: NaN-poisoned outputs, the same tolerances, a table of named mistakes):

check_bias_add(fn)              fn(inp (N, C), bias (C,), out (N, C))         00.1 (Numba, 1-D), 00.2 (HIP, 2-D grid)
check_dweight_tiled(fn)         fn(inp (N, C), dout (N, OC), dweight (C, OC))  02.2 (Numba), dweight = inp^T dout
check_dinp_tiled(fn)            fn(dout (N, OC), weight (C, OC), dinp (N, C))  02.3 (HIP), dinp = dout weight^T
check_row_max(fn)               fn(x (N, n), m (N,))                           03.1 (Numba), m = max over each row
check_softmax_forward_warp(fn)  fn(inp (N, n), out (N, n))                     03.2 (Numba), 03.3 (HIP), row softmax

The cases. In the simulator (and for arrays="numpy") the sizes are small; on a GPU (arrays="cupy", or "numba" on an
NVIDIA GPU) they are large. Either way they include: a size larger than the capped grid the exercise launchers use
(MAX_BLOCKS x THREADS threads: 2 x 32 in the simulator, 4096 x 256 on a GPU; rows: more rows than blocks or warps),
so a kernel without a grid-stride loop leaves elements unwritten; sizes spanning several blocks / tiles / warps with
a partial last one (never a multiple of 16 or 32); the edge cases 1 x 1, n = 1, n < 32, K = 1; a square case where
a transpose gives wrong numbers rather than a shape error; for the softmax, a row of logits near +1000 and one near
-1000 (exp overflows or underflows unless the row max is subtracted). The function is called once per case, and the
last case repeats an earlier shape with new values, so a function that returns a stale answer (or adds onto what an
earlier call left in a buffer it keeps) fails too.

HIP tasks pass ``source=`` (the kernel source, or a function returning it) and ``entries=``: with arrays="cupy" on
a machine without a GPU the source is compiled for both vendors and linted (status "compiled", see
``checks.hip_compile_only``); on a GPU the launcher runs and is checked.

An exception raised inside a simulated kernel is reported with the thread and block that raised it and the likely
cause (an index past the end: a missing guard or loop bound).
"""
from __future__ import annotations

import functools
import re
import traceback

import numpy as np

from .. import device as _device
from .. import reference as ref
from . import verdict
from .opcheck import Case, Mistake, Op, Rules, if_square, math_domain_why, run, source_text
from .verdict import CheckResult, is_learner_code

__all__ = ["check_bias_add", "check_dweight_tiled", "check_dinp_tiled", "check_row_max",
           "check_softmax_forward_warp", "CASES"]

# The grids the exercise launchers cap at (for the hints): blocks x threads in the simulator / on a GPU.
SIM_GRID = (2, 32)
GPU_GRID = (4096, 256)

# Deterministic shapes per op and size. Values are drawn from the seed; shapes never are. The last case of each op
# repeats an earlier case's shape with new values: a function that keeps something between calls (a result cached by
# shape, a scratch buffer filled or added into once) gives the earlier call's answer there, or adds onto it.
CASES = {
    # (N, C): n = N*C elements. small: 21 < one block; 143 and 333 > 2 x 32 (the simulator's capped grid); 1 x 1.
    "bias_add": {"small": [(3, 7), (13, 11), (1, 1), (9, 37), (3, 7)],
                 "large": [(3, 7), (1, 1), (1531, 1031), (4099, 771), (3, 7)]},   # > 4096 x 256 = 1,048,576
    # (N, C, OC) = (K, M, P) of dweight = inp^T dout: K = N spans several 16-row tiles with a partial last one.
    # (the large cases stay moderate: a GPU run of every case and every named mistake stays quick)
    "linear_dweight": {"small": [(19, 19, 19), (37, 20, 11), (1, 3, 5), (1, 3, 5)],
                       "large": [(333, 333, 333), (1037, 259, 517), (1, 3, 5), (1, 3, 5)]},
    # (N, C, OC): dinp = dout weight^T, K = OC.
    "linear_dinp": {"small": [(19, 19, 19), (20, 11, 37), (1, 3, 5), (1, 3, 5)],
                    "large": [(333, 333, 333), (1031, 771, 2309), (1, 3, 5), (1, 3, 5)]},
    # (N, n): rows > 2 blocks (simulator) / > 4096 blocks (GPU); n < threads, n > threads, n = 1 (the exercise's
    # blocks: 24 threads in the simulator, 192 on a GPU, neither a power of two).
    "row_max": {"small": [(3, 20), (7, 45), (1, 1), (5, 70), (3, 20)],
                "large": [(3, 150), (8193, 517), (1, 1), (4099, 1029), (3, 150)]},
    # (N, n): rows > 2 x 2 warps (simulator) / > 4096 x 8 warps (GPU); n > 32 and not a multiple, n < 32, n = 1.
    "softmax_forward": {"small": [(9, 70), (3, 1), (6, 20), (5, 37), (6, 20)],
                        "large": [(33001, 37), (3, 1), (40000, 20), (777, 1029), (40000, 20)]},
}


def _auto_size(arrays: str, size) -> str:
    """small in the simulator and for NumPy, large where the kernels run on a GPU."""
    if size is not None:
        return size
    on_gpu = arrays == "cupy" or (arrays == "numba" and _device.numba_on_gpu())
    return "large" if on_gpu else "small"


# ------------------------------------------------------------------------------------------------------------
# Pattern mistakes: a test on your output that names where it is wrong (the hint is built from what it found)
# ------------------------------------------------------------------------------------------------------------
def _pattern(describe, catchall=False) -> Mistake:
    """A Mistake whose hint is written by `describe(case, name, ours, expected, bad)` (None: does not apply).
    catchall: the op's fallback for wrong values in no known pattern (the checker then looks for a missing barrier)."""
    m = Mistake(hint="", catchall=catchall)

    def test(case, name, ours, expected, bad):
        text = describe(case, name, ours, expected, bad)
        if text:
            m.hint = text
            return True
        return False

    m.test = test
    return m


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[(start, end_inclusive)] of the True runs of a 1-D mask."""
    idx = np.flatnonzero(mask)
    if idx.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(idx) > 1)
    starts = np.concatenate([[idx[0]], idx[breaks + 1]])
    ends = np.concatenate([idx[breaks], [idx[-1]]])
    return [(int(a), int(b)) for a, b in zip(starts, ends)]


def _runs_text(runs, limit=3) -> str:
    parts = [f"{a}" if a == b else f"{a}..{b}" for a, b in runs[:limit]]
    return ", ".join(parts) + (f", ... ({len(runs)} runs)" if len(runs) > limit else "")


def _flat_unwritten(case, name, ours, expected, bad):
    """(unwritten mask, written-part-correct) over the flattened output."""
    o, b = ours.ravel(), bad.ravel()
    nan = np.isnan(o)
    return nan, not (b & ~nan).any()


def _past_the_grid(case, name, ours, expected, bad):
    nan, rest_ok = _flat_unwritten(case, name, ours, expected, bad)
    n = nan.size
    if not nan.any() or nan.all() or not rest_ok:
        return None
    g = int(np.argmax(nan))
    if not nan[g:].all() or g % 32 or n - g < 2:
        return None
    return (f"the first {g} elements of {name} are right and every element past index G = {g} is unwritten "
            f"(still NaN; {n} elements in all): G = blocks x threads, the number of threads your launch starts "
            f"(the launcher caps the grid at MAX_BLOCKS x THREADS), and each thread wrote one element. Each thread "
            f"must loop over the elements i, i + stride, i + 2*stride, ... with stride = the number of threads in "
            f"the whole grid (a grid-stride loop)")


def _last_element(case, name, ours, expected, bad):
    nan, rest_ok = _flat_unwritten(case, name, ours, expected, bad)
    n = nan.size
    if n < 2 or not rest_ok or not nan[-1] or nan[:-1].any():
        return None
    return (f"only the last element of {name} (index {n - 1}) is unwritten: an off-by-one in the loop bound; "
            f"the valid indices are 0 .. n-1, so the loop runs while i < n")


def _stripes(case, name, ours, expected, bad):
    nan, rest_ok = _flat_unwritten(case, name, ours, expected, bad)
    runs = _runs(nan)
    if len(runs) < 2 or not rest_ok:
        return None
    return (f"{int(nan.sum())} of {nan.size} elements of {name} were never written, in {len(runs)} separate runs "
            f"(flat indices {_runs_text(runs)}): the threads' elements leave holes. Each thread must start at its "
            f"own global index (blockIdx.x * blockDim.x + threadIdx.x) and step by the number of threads in the "
            f"whole grid (gridDim.x * blockDim.x), so together they cover every index once")


def _unwritten_lines(ours, bad):
    """(rows, cols) masks when the never-written elements of the 2-D output are exactly whole rows and/or whole
    columns and everything else is right; else None."""
    if ours.ndim != 2:
        return None
    nan = np.isnan(ours)
    if not nan.any() or nan.all() or (bad & ~nan).any():
        return None
    rows, cols = nan.all(axis=1), nan.all(axis=0)
    if not (nan == (rows[:, None] | cols[None, :])).all():
        return None
    return rows, cols


def _grid_2d_unwritten(case, name, ours, expected, bad):
    """A 2-D grid without a grid-stride loop in x or y: the rows from R on, or the columns from P on, never written
    (R, P: the threads the grid has in y and x), everything else right."""
    lines = _unwritten_lines(ours, bad)
    if lines is None:
        return None
    rows, cols = lines
    N, C = ours.shape
    parts = []
    if rows.any():
        r = int(np.argmax(rows))
        if not rows[r:].all() or r % 8:
            return None
        parts.append(f"rows {r}..{N - 1} were never written (rows 0..{r - 1} are right): your grid has {r} threads "
                     f"in y (gridDim.y x blockDim.y) and each took one row. Each thread must also take the rows "
                     f"row + {r}, row + {2 * r}, ... while the row is < N (a grid-stride loop in y, stepping by "
                     f"gridDim.y * blockDim.y)")
    if cols.any():
        q = int(np.argmax(cols))
        if not cols[q:].all() or q % 32:
            return None
        parts.append(f"columns {q}..{C - 1} of every row were never written (columns 0..{q - 1} are right): your "
                     f"grid has {q} threads in x (gridDim.x x blockDim.x) and each took one column. Each thread must "
                     f"also take the columns col + {q}, col + {2 * q}, ... while the column is < C (a grid-stride "
                     f"loop in x, stepping by gridDim.x * blockDim.x)")
    return f"{name} (shape {ours.shape}): " + "; and ".join(parts)


def _rows_past_grid(unit):
    """Rows 0..R-1 right, rows R.. never written: a grid of R blocks (or warps) without a loop over rows."""
    def describe(case, name, ours, expected, bad):
        o = ours.reshape(ours.shape[0], -1)
        b = bad.reshape(bad.shape[0], -1)
        nan_rows = np.isnan(o).all(axis=1)
        N = nan_rows.size
        if not nan_rows.any() or nan_rows.all() or b[~nan_rows].any():
            return None
        r = int(np.argmax(nan_rows))
        if not nan_rows[r:].all():
            return None
        text = (f"rows 0..{r - 1} of {name} are right and rows {r}..{N - 1} were never written: your launch has "
                f"{r} {unit}s (the launcher caps the grid), one row each. Each {unit} must loop over rows: row, "
                f"row + (number of {unit}s in the grid), ... until N")
        if r == N - 1:
            text = (f"only the last row of {name} (row {r}) was never written: either the row loop stops one short "
                    f"(it runs while row < N), or your launch has {r} {unit}s and each {unit} took one row: each "
                    f"{unit} must loop over rows: row, row + (number of {unit}s in the grid), ... until N")
        return text
    return describe


def _edge_unwritten(case, name, ours, expected, bad):
    """Whole rows or columns of out never written (and everything else right): the store's guard or the grid."""
    lines = _unwritten_lines(ours, bad)
    if lines is None:
        return None
    rows, cols = lines
    parts = []
    if rows.any():
        parts.append(f"rows {_runs_text(_runs(rows))}")
    if cols.any():
        parts.append(f"columns {_runs_text(_runs(cols))}")
    return (f"{' and '.join(parts)} of {name} (shape {ours.shape}) were never written, the rest is right: the grid "
            f"must have a tile for every row and column (rounded up), and the final store's guard must let every "
            f"element inside the matrix through (row < rows and column < columns)")


def _row_holes(unit):
    """Some rows never written, not a prefix pattern: the loop over rows starts or steps wrong."""
    def describe(case, name, ours, expected, bad):
        o = ours.reshape(ours.shape[0], -1)
        nan_rows = np.isnan(o).all(axis=1)
        if not nan_rows.any() or nan_rows.all() or (bad.reshape(o.shape)[~nan_rows]).any():
            return None
        return (f"rows {_runs_text(_runs(nan_rows))} of {name} were never written ({int(nan_rows.sum())} of "
                f"{nan_rows.size}), the others are right: each {unit} must start at its own index in the grid and "
                f"step by the number of {unit}s in the grid, so that together they take every row once")
    return describe


def _tile_catchall(op_name, tile=16):
    """Wrong values scattered over the tiles of out, matching no known mistake: most often a missing barrier."""
    def describe(case, name, ours, expected, bad):
        if not bad.any() or ours.ndim != 2:
            return None
        nan = np.isnan(ours)
        if nan.any():
            # NaN in whole output tiles is an unwritten tile (the grid, the store); NaN scattered inside tiles comes
            # from reading shared memory nobody wrote (a missing barrier, a skipped slot)
            blocks = [nan[a:a + tile, b:b + tile] for a in range(0, nan.shape[0], tile)
                      for b in range(0, nan.shape[1], tile)]
            if not any(0 < blk.sum() < blk.size for blk in blocks):
                return None
        rows, cols = np.nonzero(bad)
        tiles = sorted({(int(r) // tile, int(c) // tile) for r, c in zip(rows, cols)})
        n_tiles = (-(-bad.shape[0] // tile)) * (-(-bad.shape[1] // tile))
        shown = ", ".join(f"({a}, {b})" for a, b in tiles[:4]) + (", ..." if len(tiles) > 4 else "")
        return (f"{int(bad.sum())} of {bad.size} elements of {name} are wrong, in {len(tiles)} of the {n_tiles} "
                f"{tile}x{tile} output tiles ({shown}), with no pattern of a known mistake. Check the barriers: "
                f"every thread must wait (cuda.syncthreads() / __syncthreads()) after the tile loads, before anyone "
                f"reads the tiles, and again after the products, before the next loads overwrite them. Then check "
                f"which shared slot each thread writes: one element of each tile per thread, none left unwritten")
    return describe


# ------------------------------------------------------------------------------------------------------------
# Errors raised inside a simulated kernel: name the thread, the block and the likely cause
# ------------------------------------------------------------------------------------------------------------
_SIM_ERROR = re.compile(r"tid=\[(?P<tid>[\d, ]+)\]\s+ctaid=\[(?P<ctaid>[\d, ]+)\]:?\s*(?P<msg>.*)", re.S)
_OUT_OF_RANGE = re.compile(r"index (?P<index>-?\d+) is out of bounds for axis (?P<axis>\d+) with size (?P<size>\d+)")


class KernelError(RuntimeError):
    """An exception raised by one thread of your kernel (in the simulator), with where and why."""


_INDEX_ADVICE = {
    "tile": "In a tiled kernel a thread whose element of a tile lies past the matrix edge must not load it: it "
            "writes 0 into its shared slot instead; the final store is guarded the same way",
    "row": "Rows past N and columns past n belong to no one: the loops over rows and columns stop there",
}
# What an overflow or a division by zero inside a softmax kernel means.
_EXP_ADVICE = ("Subtract the row's max, combined over all the lanes, before exp: every exponent is then <= 0 and the "
               "largest term is exp(0) = 1, so the sum is at least 1. Start the max at -inf, the neutral value of a "
               "max (a max started at 0 is too large for a row of negative logits, and every exp underflows to 0)")


def _explain(exc: BaseException, advice: str = "", numeric: str = ""):
    """(short message, hint) for an exception raised inside a simulated kernel, or None."""
    m = _SIM_ERROR.match(str(exc))
    if m is None:
        return None
    tid = tuple(int(x) for x in m.group("tid").split(","))
    ctaid = tuple(int(x) for x in m.group("ctaid").split(","))
    inner = " ".join(m.group("msg").split())
    where = ""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if is_learner_code(frame.filename):
            where = f" at line {frame.lineno} in {frame.name}"
            break
    thread = f"thread threadIdx={tid} of block blockIdx={ctaid}"
    oob = _OUT_OF_RANGE.search(inner)
    if isinstance(exc, IndexError) and oob:
        index, size = int(oob.group("index")), int(oob.group("size"))
        past = "at the end (index = size)" if index == size else "past the end"
        short = f"IndexError in {thread}{where}: {inner}"
        hint = (f"{thread} indexed an array {past}: index {index} on an axis of size {size}. The grid is rounded up "
                f"to whole blocks, so some threads have no element: check every index before it is used (a guard, "
                f"or the loop condition i < n; not i <= n)." + (f" {advice}" if advice else ""))
    elif type(exc).__name__ == "WarpError":
        short = f"WarpError in {thread}{where}: a warp shuffle could not complete"
        hint = inner
    elif isinstance(exc, ZeroDivisionError):
        short = f"ZeroDivisionError in {thread}{where}: {inner}"
        hint = f"{thread} divided by zero: check the sizes your kernel divides by" + (f". {numeric}" if numeric else "")
    elif isinstance(exc, OverflowError):
        short = f"OverflowError in {thread}{where}: {inner}"
        hint = (f"{thread} computed a number too large for a float (the simulator computes math.exp in float64, "
                f"which overflows above exp(709); on a GPU float32 expf gives inf above exp(88.7), and inf / inf is "
                f"NaN)" + (f". {numeric}" if numeric else ""))
    elif "math domain" in inner.lower():
        short = f"{type(exc).__name__} in {thread}{where}: {inner}"
        hint = f"{thread}{where}: {math_domain_why(exc)}"
    else:
        short = f"{type(exc).__name__} in {thread}{where}: {inner}"
        hint = f"the error was raised by {thread}{where}: {inner}"
    return short, hint


def _with_kernel_errors(fn, box, advice="", numeric=""):
    """fn, with simulator thread errors turned into a KernelError that names the thread (explanation in box)."""
    @functools.wraps(fn)
    def call(*args):
        try:
            return fn(*args)
        except NotImplementedError:
            raise
        except Exception as exc:  # noqa: BLE001 - explained, then reported by the checker
            explained = _explain(exc, advice, numeric)
            if explained is None:
                raise
            box["hint"] = explained[1]
            raise KernelError(explained[0]) from exc
    return call


def _check(op: Op, fn, *, arrays, dtype, size, seed, task, quiet, source=None, entries=None, advice="",
           numeric="", rules=None):
    """Run `op` through opcheck.run (with `rules`) at the right size; rewrite the hint of an error raised inside a
    kernel."""
    size = _auto_size(arrays, size)
    box = {}
    is_kernel = type(fn).__name__ in ("CUDADispatcher", "FakeCUDAKernel")   # opcheck.run says what to pass instead
    wrapped = _with_kernel_errors(fn, box, advice, numeric) if callable(fn) and not is_kernel else fn
    result = run(op, wrapped, rules=rules, arrays=arrays, dtype=dtype, size=size, seed=seed, task=task, quiet=True,
                 source=source, entries=entries)
    if result.status == "error" and "hint" in box:
        head = result.message.splitlines()[0]
        result.hint = box["hint"] + (f" (seed {result.seed})" if result.seed is not None else "")
        result.message = head + "\n  hint: " + result.hint
    if not quiet:
        print(result.message)
    return result


def _source_rules(name, source, rules, task, quiet):
    """A CheckResult 'wrong' when the source breaks a task rule [(regex, why)], else None (also when no source)."""
    if source is None:
        return None
    text, failed = source_text(source)
    if failed is not None:
        return None   # hip_compile_only / the run reports it
    code = re.sub(r"//[^\n]*|/\*.*?\*/", " ", text, flags=re.S)
    for pattern, why in rules:
        m = re.search(pattern, code)
        if m:
            line = code.count("\n", 0, m.start()) + 1
            msg = f"{name}: wrong - line {line} of your source: {why}"
            # the message already says why: no second "hint:" line repeating it
            return verdict.record(CheckResult(name=name, task=task, status="wrong", passed=False, message=msg,
                                              hint=why, arrays="cupy"), quiet=quiet)
    return None


# The kernels of 02.2 / 02.3 (tiles) and 03.1 (a tree) share memory between the threads of a block: in the simulator
# their first call is traced, and two threads touching one shared slot between the same two barriers (one writing)
# is wrong, even where the simulator's order of threads gave the right values.
_BARRIERS = Rules(barriers=True)


# ------------------------------------------------------------------------------------------------------------
# bias_add(inp (N, C), bias (C,), out (N, C)): out[n, c] = inp[n, c] + bias[c]       (00.1, 00.2)
# ------------------------------------------------------------------------------------------------------------
def _make_bias_add(rng, dt, size, k):
    N, C = CASES["bias_add"][size][k]
    c = Case(dt, {"N": N, "C": C})
    c.add_float("inp", ("N", "C"), rng.standard_normal((N, C)))
    c.add_float("bias", ("C",), rng.standard_normal(C) + 0.5)
    c.add_output("out", ("N", "C"))
    return c


def _bias_by_row(c):
    N, C = c.dims["N"], c.dims["C"]
    if N > C or N == C == 1:
        return {}
    return {"out": c.x["inp"] + c.x["bias"][:N, None]}


def _bias_flat(c):
    N, C = c.dims["N"], c.dims["C"]
    if N > C or N == 1:
        return {}
    return {"out": c.x["inp"] + c.x["bias"][np.arange(N * C) % N].reshape(N, C)}


_BIAS_ADD = Op(
    "bias_add", _make_bias_add,
    lambda c: {"out": c.x["inp"] + c.x["bias"][None, :]},
    n_cases=5,
    formula="out[n, c] = inp[n, c] + bias[c]: element i of the flattened (N, C) array is row i // C, column i % C",
    shape_hint="inp and out are (N, C), bias is (C,): element i (flat) is row i // C, column i % C, and adds "
               "bias[i % C]",
    mistakes=[
        Mistake("the bias is indexed by the row: bias has one value per column (channel), so element (n, c) "
                 "adds bias[c], the column index (i % C for flat index i)", _bias_by_row),
        Mistake("the bias is indexed by i % N: the column of flat element i is i % C (C = the row length)",
                 _bias_flat),
        Mistake("the bias was not added: out = inp + bias, bias[c] added to every row",
                 lambda c: {"out": c.x["inp"].copy()}),
        Mistake("inp is missing: out = inp + bias, not bias alone",
                 lambda c: {"out": np.broadcast_to(c.x["bias"], c.outputs["out"]).copy()}),
        Mistake("the bias is added twice", lambda c: {"out": c.x["inp"] + 2 * c.x["bias"][None, :]}),
        _pattern(_grid_2d_unwritten),
        _pattern(_past_the_grid),
        _pattern(_last_element),
        _pattern(_stripes),
    ])


def check_bias_add(fn, *, arrays="numba", dtype=np.float32, size=None, seed=None, task=None, quiet=False,
                   source=None, entries=None) -> CheckResult:
    """Check fn(inp (N, C), bias (C,), out (N, C)): out = inp + bias (bias broadcast over the rows).

    Runs 5 cases, one with more elements than the exercise's capped grid (so one thread per element is not
    enough), 1 x 1, and the first shape again with new values; the large ones also have more rows (1531, 4099) and
    columns (1031, 771) than the 2-D grid of 00.2 has threads in y (1024) and x (512), so a 2-D kernel needs a
    grid-stride loop along both axes.
    arrays: "numba" (a Numba kernel; simulator here), "cupy" (a HIP kernel: pass source= and entries= too, so that
    without a GPU the source is compiled and linted), or "numpy". size: None picks small in the simulator, large on
    a GPU.
    """
    return _check(_BIAS_ADD, fn, arrays=arrays, dtype=dtype, size=size, seed=seed, task=task, quiet=quiet,
                  source=source, entries=entries)


# ------------------------------------------------------------------------------------------------------------
# The two GEMMs of linear backward, as tiled kernels
#   linear_dweight: fn(inp (N, C), dout (N, OC), dweight (C, OC)), dweight = inp^T dout   (K = N)     02.2
#   linear_dinp:    fn(dout (N, OC), weight (C, OC), dinp (N, C)), dinp = dout weight^T   (K = OC)    02.3
# ------------------------------------------------------------------------------------------------------------
_TILES = (8, 16, 32)


def _make_dweight(rng, dt, size, k):
    N, C, OC = CASES["linear_dweight"][size][k]
    c = Case(dt, {"N": N, "C": C, "OC": OC})
    c.add_float("inp", ("N", "C"), rng.standard_normal((N, C)))
    c.add_float("dout", ("N", "OC"), rng.standard_normal((N, OC)))
    c.add_output("dweight", ("C", "OC"))
    return c


def _make_dinp(rng, dt, size, k):
    N, C, OC = CASES["linear_dinp"][size][k]
    c = Case(dt, {"N": N, "C": C, "OC": OC})
    c.add_float("dout", ("N", "OC"), rng.standard_normal((N, OC)))
    c.add_float("weight", ("C", "OC"), rng.standard_normal((C, OC)))
    c.add_output("dinp", ("N", "C"))
    return c


def _gemm_parts(c, which):
    """(A, B) with out = A @ B and the reduction along A's columns / B's rows (K), for the op `which`."""
    if which == "dweight":
        return c.x["inp"].T, c.x["dout"]            # (C, N) @ (N, OC)
    return c.x["dout"], c.x["weight"].T             # (N, OC) @ (OC, C)


def _k_rows(c, which, rows):
    A, B = _gemm_parts(c, which)
    rows = np.asarray(rows, dtype=int)
    return A[:, rows] @ B[rows, :]


def _per_tile(test):
    """A pattern test on the K loop of the tiled GEMM `which` (output `name`), for each tile width of _TILES in turn:
    test(case, which, name, K, t, ours, expected) -> the hint, or None when that width does not explain ours."""
    def make(which, name):
        def describe(case, out_name, ours, expected, bad):
            if out_name != name:
                return None
            K = _gemm_parts(case, which)[0].shape[1]
            for t in _TILES:
                hint = test(case, which, name, K, t, ours, expected)
                if hint:
                    return hint
            return None
        return describe
    make.__doc__ = test.__doc__
    return make


@_per_tile
def _first_tile_any(case, which, name, K, t, ours, expected):
    """The first K tile only."""
    if K <= t:
        return None
    wrong = _k_rows(case, which, range(t))
    if not (_close_to(ours, wrong) and not _close_to(expected, wrong)):
        return None
    if K < 2 * t:   # the first tile is also the only full one: the partial tile is what is missing
        return (f"{name} holds only the sum over k = 0..{t - 1}, the first and only full tile along K "
                f"(K = {K}, TILE = {t}): the last, partial tile (k = {t}..{K - 1}) is left out. The loop "
                f"over K must visit every tile, the partial one included (while k0 < K), with the "
                f"slots past K filled with 0")
    return (f"{name} holds only the first tile along K (the sum over k = 0..{t - 1}; K = {K}): the loop "
            f"over K must visit every tile, k0 = 0, TILE, 2*TILE, ... while k0 < K, loading, syncing and "
            f"adding each one")


@_per_tile
def _last_tile_only(case, which, name, K, t, ours, expected):
    """The last K tile only: the accumulator set back to 0 inside the loop over K."""
    if K <= t:
        return None
    k0 = ((K - 1) // t) * t
    wrong = _k_rows(case, which, range(k0, K))
    if not (_close_to(ours, wrong) and not _close_to(expected, wrong)):
        return None
    widths = " or ".join(str(w) for w in _TILES if K > w and ((K - 1) // w) * w == k0)   # the same last tile
    return (f"{name} holds only the last tile along K (the sum over k = {k0}..{K - 1}; K = {K}, TILE = {widths}): the "
            f"accumulator is set back to 0 at every tile, so each tile's products replace the earlier tiles' "
            f"instead of adding to them. Set acc = 0 once, before the loop over K, and add every tile into it")


@_per_tile
def _skip_partial(case, which, name, K, t, ours, expected):
    """Every full K tile, the last partial one left out."""
    full = (K // t) * t
    if full in (0, K):
        return None
    wrong = _k_rows(case, which, range(full))
    if not (_close_to(ours, wrong) and not _close_to(expected, wrong)):
        return None
    return (f"{name} leaves out the last, partial tile along K (k = {full}..{K - 1}, K = {K} is not a "
            f"multiple of TILE = {t}): the loop over tiles must include it (k0 < K), with the slots "
            f"past K filled with 0")


@_per_tile
def _stale_tail(case, which, name, K, t, ours, expected):
    """The last partial K tile with its empty slots still holding the previous tile's values (no zero fill)."""
    r = K % t
    k0 = K - r
    if r == 0 or k0 < t:
        return None
    wrong = expected + _k_rows(case, which, range(k0 - t + r, k0))
    if not _close_to(ours, wrong):
        return None
    return (f"{name} is off by exactly the products of rows {k0 - t + r}..{k0 - 1} of the previous tile: "
            f"in the last, partial tile along K (k = {k0}..{K - 1}), the slots past K still hold the "
            f"previous tile's values. Threads whose element lies past the matrix edge must write 0 into "
            f"their slot (of both tiles), not skip the load")


def _close_to(ours, wrong) -> bool:
    from .opcheck import TOLERANCES
    wrong = np.asarray(wrong, dtype=np.float64)
    return wrong.shape == ours.shape and verdict.close(ours, wrong, verdict.mistake_slack(TOLERANCES["float32"]))


_DWEIGHT = Op(
    "linear_dweight", _make_dweight,
    lambda c: {"dweight": c.x["inp"].T @ c.x["dout"]},
    n_cases=4,
    formula="dweight[c, o] = sum over the N rows of inp[n, c] * dout[n, o] (dweight = inp^T dout, K = N)",
    shape_hint="inp is (N, C), dout (N, OC), dweight (C, OC): the reduction runs over the N rows of both",
    mistakes=[
        Mistake("dweight is inp @ dout, without the transpose: op(A) = inp^T, so the A tile at (i, k) is "
                 "inp[k, i] (row k of inp, column i)", if_square(lambda c: {"dweight": c.x["inp"] @ c.x["dout"]})),
        Mistake("dweight is transposed: dweight[c, o] belongs at row c (from inp's column c), column o (from "
                 "dout's column o); it looks like dout^T inp",
                 if_square(lambda c: {"dweight": c.x["dout"].T @ c.x["inp"]})),
        _pattern(_first_tile_any("dweight", "dweight")),
        _pattern(_last_tile_only("dweight", "dweight")),
        _pattern(_skip_partial("dweight", "dweight")),
        _pattern(_stale_tail("dweight", "dweight")),
        _pattern(_edge_unwritten),
        _pattern(_tile_catchall("linear_dweight"), catchall=True),
    ])

_DINP = Op(
    "linear_dinp", _make_dinp,
    lambda c: {"dinp": c.x["dout"] @ c.x["weight"].T},
    n_cases=4,
    formula="dinp[n, c] = sum over the OC outputs of dout[n, o] * weight[c, o] (dinp = dout weight^T, K = OC)",
    shape_hint="dout is (N, OC), weight (C, OC) stored (in, out), dinp (N, C): the reduction runs over OC",
    mistakes=[
        Mistake("dinp is dout @ weight, without the transpose: op(B) = weight^T, so the B tile at (k, j) is "
                 "weight[j, k] (row j of weight, column k)", if_square(lambda c: {"dinp": c.x["dout"] @ c.x["weight"]})),
        Mistake("dinp is transposed: dinp[n, c] belongs at row n (from dout's row n), column c (from weight's "
                 "row c)", if_square(lambda c: {"dinp": (c.x["dout"] @ c.x["weight"].T).T})),
        _pattern(_first_tile_any("dinp", "dinp")),
        _pattern(_last_tile_only("dinp", "dinp")),
        _pattern(_skip_partial("dinp", "dinp")),
        _pattern(_stale_tail("dinp", "dinp")),
        _pattern(_edge_unwritten),
        _pattern(_tile_catchall("linear_dinp"), catchall=True),
    ])


def check_dweight_tiled(fn, *, arrays="numba", dtype=np.float32, size=None, seed=None, task=None, quiet=False,
                        source=None, entries=None) -> CheckResult:
    """Check fn(inp (N, C), dout (N, OC), dweight (C, OC)): dweight = inp^T dout, the reduction over the N rows.

    Cases: N = C = OC = 19 (square: a missing transpose shows as numbers), N = 37 rows (three 16-row tiles, the
    last partial) with C = 20, OC = 11 (partial tiles of dweight too), N = 1 twice (new values). Large sizes on a GPU.
    In the simulator the first call is traced: a missing barrier fails even where the values came out right.
    """
    return _check(_DWEIGHT, fn, arrays=arrays, dtype=dtype, size=size, seed=seed, task=task, quiet=quiet,
                  source=source, entries=entries, advice=_INDEX_ADVICE["tile"], rules=_BARRIERS)


def check_dinp_tiled(fn, *, arrays="cupy", dtype=np.float32, size=None, seed=None, task=None, quiet=False,
                     source=None, entries=None) -> CheckResult:
    """Check fn(dout (N, OC), weight (C, OC), dinp (N, C)): dinp = dout weight^T, the reduction over OC.

    With arrays="cupy" and no GPU, pass source= and entries=: the source is compiled for both vendors and linted.
    """
    return _check(_DINP, fn, arrays=arrays, dtype=dtype, size=size, seed=seed, task=task, quiet=quiet,
                  source=source, entries=entries, advice=_INDEX_ADVICE["tile"], rules=_BARRIERS)


# ------------------------------------------------------------------------------------------------------------
# row_max(x (N, n), m (N,)): m[row] = max_j x[row, j]        (03.1)
# ------------------------------------------------------------------------------------------------------------
def _make_row_max(rng, dt, size, k):
    N, n = CASES["row_max"][size][k]
    c = Case(dt, {"N": N, "n": n})
    x = rng.standard_normal((N, n)) * 3.0
    x[0] = -np.abs(x[0]) - 0.5          # row 0 all negative: a max tree that starts from 0 gets 0 there
    if N > 2:
        x[1, -1] = np.abs(x[1]).max() + 1.0   # row 1 has its max in the last column (the tail of the row)
    c.add_float("x", ("N", "n"), x)
    c.add_output("m", ("N",))
    return c


# Block sizes a row-max kernel may have been launched with: the exercise's (24 in the simulator, 192 on a GPU, not
# powers of two) and the usual ones.
_BLOCKS = (24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)


def _halving_tree_slots(T: int) -> list:
    """The threads whose values reach slot 0 when v2's tree (stride = T // 2, halved each step; thread t < stride
    combines slot t + stride into slot t) runs on T threads. All T when T is a power of two."""
    slots = [{t} for t in range(T)]
    stride = T // 2
    while stride > 0:
        for t in range(stride):
            slots[t] = slots[t] | slots[t + stride]
        stride //= 2
    return sorted(slots[0])


def _pow2_tree(case, name, ours, expected, bad):
    """A halving tree made for powers of two, run on a block that is not one: some threads' values are lost."""
    x = case.x["x"]
    n = x.shape[1]
    found = []                                   # block sizes whose halving tree gives exactly your output
    for T in (24, 192) + tuple(t for t in _BLOCKS if t not in (24, 192)):   # 03.1's launches first
        if T & (T - 1) == 0:
            continue
        kept = _halving_tree_slots(T)
        cols = np.flatnonzero(np.isin(np.arange(n) % T, kept))
        if cols.size == 0:
            continue
        wrong = x[:, cols].max(axis=1)
        if _close_to(ours, wrong) and not _close_to(expected, wrong):
            found.append((T, kept))
    if not found:
        return None
    T, kept = found[0]
    lost = sorted(set(range(T)) - set(kept))
    shown = ", ".join(str(t) for t in lost[:4]) + (", ..." if len(lost) > 4 else "")
    steps, k = [], T
    while k:
        steps.append(str(k))
        k //= 2
    sizes = "blockDim.x = " + " or ".join(str(t) for t, _ in found[:2])
    return (f"{name} leaves out some threads' values: the tree halves the block as if it were a power of two, and "
            f"yours is not one ({sizes}; with {T} threads the halving goes {' -> '.join(steps)}, and at a step "
            f"with an odd number of active slots the last one has no partner and is dropped: threads {shown}, "
            f"{len(lost)} of {T}). Fold the upper part of the active slots onto the lower part with the half "
            f"rounded up, so an odd slot is carried into the next step")


def _row_max_first_cols(case, name, ours, expected, bad):
    n = case.dims["n"]
    for t in _BLOCKS:
        if n <= t:
            break
        wrong = case.x["x"][:, :t].max(axis=1)
        if _close_to(ours, wrong) and not _close_to(expected, wrong):
            text = (f"m is the max of the first {t} columns only (n = {n}): a row longer than the block needs each "
                    f"thread to visit the columns t, t + blockDim.x, t + 2*blockDim.x, ... before the tree")
            if t % 32 == 0:  # whole warps: on a GPU a tree without barriers sees only the warps that wrote first
                text += (f". If yours already strides by blockDim.x: the first {t} columns are the first warps' "
                         f"values, and the tree read the other warps' shared slots before they were written: a "
                         f"cuda.syncthreads() barrier is missing (after the partial values are stored, and after "
                         f"each step of the tree)")
            return text
    return None


def _carried_over_rows(case, name, ours, expected, bad):
    """m[row] is the max over this row and the rows the same block took before it (row - G, row - 2G, ... for a
    grid of G blocks): the start value is set once, outside the loop over rows."""
    row_max = case.x["x"].max(axis=1)
    N = row_max.size
    for G in (SIM_GRID[0], GPU_GRID[0]):
        if N <= G:
            continue
        wrong = row_max.copy()
        for first in range(G):
            wrong[first::G] = np.maximum.accumulate(row_max[first::G])
        if _close_to(ours, wrong) and not _close_to(expected, wrong):
            return (f"m[row] is the max over this row and every earlier row the same block took (rows row - {G}, "
                    f"row - {2 * G}, ...; the grid has {G} blocks): the start value of the max (-inf) is set once, "
                    f"before the loop over rows, so each row starts from the previous row's max. Set it inside the "
                    f"loop, for every row")
    return None


def _tree_catchall(case, name, ours, expected, bad):
    """Wrong values (garbage or NaN read from shared memory) that match no known mistake: most often a tree without
    its barriers."""
    if not bad.any():
        return None
    rows = np.flatnonzero(bad)
    shown = ", ".join(str(r) for r in rows[:5]) + (", ..." if rows.size > 5 else "")
    return (f"{rows.size} of {bad.size} row results of {name} are wrong (rows {shown}), with no pattern of a known "
            f"mistake. Check the barriers: a thread may read another thread's shared slot only after a "
            f"cuda.syncthreads() that follows the write: one after the partial values are stored, one after each "
            f"step of the tree; and the block must not start the next row before the result of this one is read. "
            f"Then check the tree: at each step the first half of the active threads combine their slot with the "
            f"slot one half further")


_ROW_MAX = Op(
    "row_max", _make_row_max,
    lambda c: {"m": c.x["x"].max(axis=1)},
    n_cases=5,
    formula="m[row] = max over j of x[row, j] (the softmax forward's first pass)",
    shape_hint="x is (N, n), m is (N,): one value per row",
    mistakes=[
        Mistake("rows whose values are all negative came out as 0: threads that have no element (or a tree "
                 "that starts from 0) contributed 0. For a max the neutral start is -inf (a row of negative "
                 "numbers has a negative max). If yours starts from -inf: a thread read a shared slot before its "
                 "owner wrote it (a missing cuda.syncthreads() barrier; a GPU's unwritten shared memory often "
                 "reads as 0)", lambda c: {"m": np.maximum(c.x["x"].max(axis=1), 0.0)}),
        Mistake("m is the row sum: the tree must take the larger of the two values at each step, not add them",
                 lambda c: {"m": c.x["x"].sum(axis=1)}),
        Mistake("m is the max of |x|: compare the values themselves (a row of negative numbers has a negative max)",
                 lambda c: {"m": np.abs(c.x["x"]).max(axis=1)}),
        _pattern(_pow2_tree),
        _pattern(_row_max_first_cols),
        _pattern(_rows_past_grid("block")),
        _pattern(_row_holes("block")),
        _pattern(_carried_over_rows),
        _pattern(_tree_catchall, catchall=True),
    ])


def check_row_max(fn, *, arrays="numba", dtype=np.float32, size=None, seed=None, task=None, quiet=False,
                  source=None, entries=None) -> CheckResult:
    """Check fn(x (N, n), m (N,)): m = x.max(axis=1), one value per row.

    Cases: rows shorter and longer than the block, more rows than the capped grid has blocks, 1 x 1; row 0 is all
    negative (a max that starts at 0 fails there), row 1 has its max in the last column. A tree that only works for
    power-of-two blocks is named when the launch used one that is not (24 or 192 threads: 03.1's launchers). The
    first shape comes again last, with new values. In the simulator the first call is traced: a missing barrier fails
    even where the values came out right.
    """
    return _check(_ROW_MAX, fn, arrays=arrays, dtype=dtype, size=size, seed=seed, task=task, quiet=quiet,
                  source=source, entries=entries, advice=_INDEX_ADVICE["row"], rules=_BARRIERS)


# ------------------------------------------------------------------------------------------------------------
# softmax_forward with one warp per row (03.2 Numba, 03.3 HIP): out = softmax(inp) over each row, the row max and
# the sum of exponentials each reduced across the lanes with shuffles; the mistakes of a warp reduction
# ------------------------------------------------------------------------------------------------------------
_HIGH, _LOW = 1000.0, -1000.0    # the logits of rows 0 and 1: exp overflows or underflows unless the max is subtracted


def _make_softmax_logits(rng, dt, size, k):
    N, n = CASES["softmax_forward"][size][k]
    c = Case(dt, {"N": N, "n": n})
    x = rng.standard_normal((N, n)) * 10.0 ** rng.uniform(-1.0, 1.0, (N, 1))   # rows from flat to peaky
    x[0] += _HIGH                  # exp(x) is inf in float32 (and raises in the simulator's float64 math.exp)
    if N > 1:
        x[1] += _LOW               # exp(x - 0) is 0 for every column: a max that starts at 0 gives 0 / 0
    c.add_float("inp", ("N", "n"), x)
    c.add_output("out", ("N", "n"))
    return c


def _expected_softmax_forward(c):
    out, _ = ref.softmax_forward(c.x["inp"])
    return {"out": out}


_NEUTRAL = {"max": -np.inf, "sum": 0.0}
_OPS = {"max": np.maximum, "sum": np.add}


def _across_lanes(v, kind, how, W):
    """What each lane holds after combining the lanes' values v (N, W) with `how`: "all" (right: every lane holds
    the total), "none" (no shuffles), "down" / "down0" (a shfl_down tree, no broadcast: a lane whose source is past
    the last lane gets its own value back / nothing), or an int: an xor butterfly that starts at that offset."""
    op = _OPS[kind]
    lanes = np.arange(W)
    if how == "all":
        total = v.max(axis=1) if kind == "max" else v.sum(axis=1)
        return np.repeat(total[:, None], W, axis=1)
    if how == "none":
        return v.copy()
    v = v.copy()
    if how in ("down", "down0"):
        off = W // 2
        while off:
            src = lanes + off
            other = v[:, np.minimum(src, W - 1)]
            past = src >= W
            other[:, past] = v[:, past] if how == "down" else _NEUTRAL[kind]
            v = op(v, other)
            off //= 2
        return v
    off = int(how)
    while off:
        v = op(v, v[:, lanes ^ off])
        off //= 2
    return v


def _softmax_lanes(c, W=32, max_how="all", sum_how="all", cols="all", divide=True):
    """softmax over each row as a warp of W lanes computes it, lane l holding columns l, l + W, ...; the row max
    and the sum combined across the lanes with max_how / sum_how (see _across_lanes). cols: the columns the two
    reductions see, "all", "first" (0..W-1 only) or "full" (whole chunks of W only: the tail dropped)."""
    x = c.x["inp"]
    N, n = x.shape
    lane = np.arange(n) % W
    seen = np.ones(n, dtype=bool)
    if cols == "first":
        seen = np.arange(n) < W
    elif cols == "full":
        seen = np.arange(n) < (n // W) * W
    part_max = np.full((N, W), -np.inf)
    for l in range(W):
        mine = seen & (lane == l)
        if mine.any():
            part_max[:, l] = x[:, mine].max(axis=1)
    m = _across_lanes(part_max, "max", max_how, W)[:, lane]                 # (N, n): the max column j's lane uses
    with np.errstate(over="ignore", invalid="ignore"):
        e = np.exp(x - m)
        part_sum = np.stack([(e * (seen & (lane == l))).sum(axis=1) for l in range(W)], axis=1)
        s = _across_lanes(part_sum, "sum", sum_how, W)[:, lane]
        return {"out": e / s if divide else e}


def _exp_range(case, name, ours, expected, bad):
    """Only rows 0 (logits near +1000) and 1 (near -1000) wrong: exp overflowed, or underflowed to 0 / 0."""
    rows = bad.reshape(bad.shape[0], -1).any(axis=1)
    if not rows.any() or np.flatnonzero(rows).max() > 1:
        return None
    if rows[0]:
        text = (f"row 0 of {name}, whose logits are all near +1000, came out wrong (yours {ours[0, 0]:.4g} at [0, "
                f"0], expected {expected[0, 0]:.4g}), and the other rows are right: exp of such a logit overflows "
                f"(float32 exp gives inf above 88.7, and inf / inf is NaN). Subtract the row's max before exp: every "
                f"exponent is then <= 0, the largest term is exp(0) = 1")
        if rows.size > 1 and rows[1]:
            text += " (row 1, logits near -1000, is wrong too: there every exp(x) underflows to 0, and 0 / 0 is NaN)"
        return text
    return (f"row 1 of {name}, whose logits are all near -1000, came out wrong (yours {ours[1, 0]:.4g} at [1, 0], "
            f"expected {expected[1, 0]:.4g}), and the other rows are right: every exp(x - m) there underflowed to 0 "
            f"and 0 / 0 is NaN, so the m you subtracted was far above the row's values: a max that starts at 0 (or "
            f"lanes without a column that offer 0). The neutral start of a max is -inf")


def _softmax_unwritten_columns(case, name, ours, expected, bad):
    if ours.ndim != 2:
        return None
    nan_cols = np.isnan(ours).all(axis=0)
    if not nan_cols.any() or nan_cols.all() or (bad & ~np.isnan(ours)).any():
        return None
    n = nan_cols.size
    c0 = int(np.argmax(nan_cols))
    if not nan_cols[c0:].all():
        return None
    if c0 in (32, 64):
        return (f"columns {c0}..{n - 1} of every row were never written (n = {n}): each lane must write the "
                f"columns lane, lane + warp size, lane + 2 x warp size, ... of its row while the column is < n, not "
                f"only the first {c0}")
    return (f"the last {n - c0} columns of every row ({c0}..{n - 1}, n = {n}) were never written: the tail past "
            f"the last full chunk of lanes must be written too (loop while the column < n)")


def _lane_mistakes(W):
    half = "16 of 32" if W == 32 else "32 of 64"
    start = "16, half the warp" if W == 32 else "warpSize / 2 = 32"
    wave = "" if W == 32 else " (64-lane wavefront)"
    return [
        Mistake(f"the row max and the sum reach only lane 0{wave}: a shfl_down tree leaves the total in lane 0 and "
                 f"partial values in the other lanes, which then scaled and divided their columns by those. Use the "
                 f"xor butterfly (after it every lane holds the total), or read lane 0's value after the tree "
                 f"(a shuffle from lane 0)", lambda c: _softmax_lanes(c, W, "down", "down")),
        Mistake(f"the row max and the sum reach only lane 0{wave}: after a shfl_down tree only lane 0 holds the "
                 f"total; every lane must read it from lane 0, or use the xor butterfly",
                 lambda c: _softmax_lanes(c, W, "down0", "down0")),
        Mistake(f"the row max reaches only lane 0{wave} (the sum is right): the other lanes subtracted a partial "
                 f"max. Use the xor butterfly for the max too, or read lane 0's max after the tree",
                 lambda c: _softmax_lanes(c, W, "down", "all")),
        Mistake(f"the sum of exponentials reaches only lane 0{wave} (the max is right): the other lanes divided by "
                 f"a partial sum. Use the xor butterfly for the sum too, or read lane 0's sum after the tree",
                 lambda c: _softmax_lanes(c, W, "all", "down")),
        Mistake(f"the shuffles combine only {half} lanes: the butterfly must start at an offset of {start}, and "
                 f"halve down to 1", lambda c: _softmax_lanes(c, W, W // 4, W // 4)),
        Mistake(f"the max and the sum cover only columns 0..{W - 1}{wave}: a row longer than the warp needs each "
                 f"lane to visit the columns lane, lane + warp size, ... before the shuffles",
                 lambda c: _softmax_lanes(c, W, cols="first") if c.dims["n"] > W else {}),
        Mistake(f"the max and the sum leave out the tail{wave}: when n is not a multiple of the warp size, the "
                 f"last n % {W} columns count too (loop while the column < n)",
                 lambda c: _softmax_lanes(c, W, cols="full") if c.dims["n"] > W and c.dims["n"] % W else {}),
    ]


_SOFTMAX_FWD_WARP = Op(
    "softmax_forward", _make_softmax_logits, _expected_softmax_forward, n_cases=5,
    formula="out[row, j] = exp(inp[row, j] - m) / s with m = the row's max and s = the sum over the row of "
            "exp(inp[row, j] - m): every lane needs both totals",
    shape_hint="inp and out are (N, n): one softmax per row",
    mistakes=_lane_mistakes(32) + [
        Mistake("each lane subtracted the max of its own columns: the row max must be combined across the lanes "
                 "(shuffles) before any exp, or the lanes' exponentials are on different scales",
                 lambda c: _softmax_lanes(c, 32, "none", "all")),
        Mistake("each lane divided by the sum of its own columns: the sum of exponentials must be combined across "
                 "the lanes (shuffles) before the division", lambda c: _softmax_lanes(c, 32, "all", "none")),
        Mistake("out = exp(inp - max) was not divided by the row's sum of exponentials (a softmax row sums to 1)",
                 lambda c: _softmax_lanes(c, 32, divide=False)),
    ] + _lane_mistakes(64) + [
        _pattern(_exp_range),
        _pattern(_rows_past_grid("warp")),
        _pattern(_row_holes("warp")),
        _pattern(_softmax_unwritten_columns),
    ])

# A HIP warp task writes the shuffle loops itself: portable.h's helpers would be the answer.
_WARP_SOURCE_RULES = [
    (r"\bwarp_(?:sum|max)\s*\(", "this task asks for the shuffle loops themselves: portable.h's warp_sum / warp_max "
                                 "would be the answer; reduce with shfl_xor (or shfl_down, then read lane 0) and "
                                 "warpSize"),
]


def check_softmax_forward_warp(fn, *, arrays="numba", dtype=np.float32, size=None, seed=None, task=None,
                               quiet=False, source=None, entries=None) -> CheckResult:
    """Check fn(inp (N, n), out (N, n)): out = softmax of each row of inp, at the shapes a warp kernel gets wrong.

    Cases: n = 70 and 37 (more than a warp, not a multiple of 32), n = 1, n = 20 (less than a warp), each with more
    rows than the capped grid has warps, and n = 20 again (new values); row 0's logits lie near +1000 (exp overflows unless the row max is
    subtracted), row 1's near -1000 (a max that starts at 0 makes every exp underflow). Named mistakes of warp
    reductions: the max or the sum left in lane 0 only, 16 lanes reduced, only the first 32 columns, the tail
    dropped, a lane's own max or sum, rows past the grid (and the 64-lane versions).
    HIP (arrays="cupy", source=, entries=): the source must write the shuffle loops itself (not portable.h's
    warp_sum / warp_max); without a GPU it is compiled for both vendors and linted.
    """
    if arrays == "cupy":
        broken = _source_rules(_SOFTMAX_FWD_WARP.name, source, _WARP_SOURCE_RULES, task, quiet)
        if broken is not None:
            return broken
    return _check(_SOFTMAX_FWD_WARP, fn, arrays=arrays, dtype=dtype, size=size, seed=seed, task=task, quiet=quiet,
                  source=source, entries=entries, advice=_INDEX_ADVICE["row"], numeric=_EXP_ADVICE)


CHECKERS = {"bias_add": check_bias_add, "linear_dweight": check_dweight_tiled, "linear_dinp": check_dinp_tiled,
            "row_max": check_row_max, "softmax_forward_warp": check_softmax_forward_warp}
