"""Warp shuffles and votes for Numba's CUDA simulator, so warp-level kernels run (and are graded) on a laptop, and
the block runner that makes the simulator fast enough to train a toy model.

Numba's simulator has no warp intrinsics: ``cuda.shfl_down_sync`` raises AttributeError inside a simulated kernel.
``install()`` adds them, with the semantics of the GPU instructions Numba emits (PTX ``shfl.sync`` / ``vote.sync``,
32-lane warps):

    shfl_sync(mask, value, src_lane)     the value of lane src_lane % 32
    shfl_up_sync(mask, value, delta)     the value of lane - delta % 32; below lane 0: your own value
    shfl_down_sync(mask, value, delta)   the value of lane + delta % 32; past lane 31: your own value
    shfl_xor_sync(mask, value, lane_mask)  the value of lane ^ (lane_mask % 32)
    syncwarp(mask=0xffffffff)            a barrier for the lanes of mask
    ballot_sync(mask, pred)              bit l set when lane l of mask has pred true (an int32, as on the GPU)
    all_sync / any_sync / eq_sync(mask, pred)
    lanemask_lt()                        the lanes below yours

How: the block's CUDA threads are greenlets (the `greenlet` package: coroutines that can pause anywhere in a call
stack), run one at a time in the launching Python thread by this module's scheduler (``_run_block``, which replaces
the simulator's block runner). A thread runs until it returns, reaches ``cuda.syncthreads()`` or reaches a warp
operation. The lanes of one warp (thread ids 32w .. 32w + 31 of the block) meet in a round per (warp, mask): each lane
leaves its value and waits until every lane of the mask has arrived; the last to arrive hands each its source lane's
value. A barrier opens when every thread that has not returned waits at it. What the GPU leaves undefined is made
loud, so a bug shows up in the simulator instead of passing by luck:

- every lane named in ``mask`` that exists must call the same operation: a lane that already returned, waits at
  ``cuda.syncthreads()`` or at another warp operation instead makes the operation raise an error naming the lanes
  (on a GPU this hangs or returns garbage);
- the calling lane must be in its own mask; lanes calling different operations with one mask raise an error;
- a partial last warp (a block of 48 threads: lanes 0..15 of warp 1) works for its lanes; reading a lane that does
  not exist or is not in the mask returns an undefined value: NaN for floats, 0xDEADBEEF for ints.

Not supported: the ``width`` argument of CUDA C++'s ``__shfl_*_sync`` (Numba's functions have none either).
``activemask()`` is not provided: which lanes are converged is not something the simulator models.
Numba's own simulator starts an operating-system thread per CUDA thread and lets them race for the interpreter's
lock; the greenlets run the same kernels, in a fixed order (a thread runs until it must wait), several times faster:
a forward and backward of the numba engine on a toy model (tests/test_grad_accum.py's TOY, batch 4 x 8), best of 3
on one core of a 2-core machine, 2026-12-07: 3.45 s on threads, 0.74 s on greenlets.
A kernel that spins until another thread of its block writes a flag, with no barrier between, never ends here. On
a GPU it depends on the hardware's scheduling (NVIDIA's since Volta lets the writer run; AMD's wavefronts and older
warps may hang), so the course's kernels, written for both vendors, do not do it.
Installed by ``import gpullm_lessons`` (its __init__, right after ``device.configure()``) when the simulator is on;
with Numba on a GPU it is never installed: the real intrinsics run.
"""
from __future__ import annotations

import importlib.abc
import math
import sys
import collections
import threading
import types

import numpy as np

WARP = 32
FULL = 0xFFFFFFFF
_UNDEFINED_INT = 0xDEADBEEF

_TARGET = "numba.cuda.simulator.kernel"
_installed = False


class WarpError(RuntimeError):
    """A warp operation that a GPU would hang on or answer with garbage."""


# --------------------------------------------------------------------------------------------------------------
# One exchange among the lanes of a mask
# --------------------------------------------------------------------------------------------------------------
def _undefined(value):
    """What reading a lane that does not take part returns: NaN for floats, 0xDEADBEEF for ints."""
    if isinstance(value, (float, np.floating)):
        return type(value)(math.nan)
    if isinstance(value, (bool, np.bool_)):
        return value
    if isinstance(value, np.integer):
        return np.array(_UNDEFINED_INT, dtype=np.uint64).astype(type(value))[()]
    return _UNDEFINED_INT - (1 << 32)   # Python int: 0xDEADBEEF as a signed 32-bit value


def _int32(bits: int) -> int:
    bits &= FULL
    return bits - (1 << 32) if bits & 0x80000000 else bits


def _mask_text(mask: int) -> str:
    return f"0x{mask:08x}"


def _lanes_text(lanes) -> str:
    lanes = sorted(lanes)
    if len(lanes) > 2 and lanes[-1] - lanes[0] == len(lanes) - 1:
        return f"{lanes[0]}..{lanes[-1]}"
    return ", ".join(str(x) for x in lanes)


def _answers(op, arrived, members, exists):
    """Every lane's result once all lanes of the mask have arrived."""
    ops = {a[0] for a in arrived.values()}
    if len(ops) > 1:
        by_op = {o: _lanes_text([lane for lane, a in arrived.items() if a[0] == o]) for o in sorted(ops)}
        return WarpError("lanes of one warp reached different warp operations with the same mask: "
                         + "; ".join(f"{o} by lanes {ls}" for o, ls in by_op.items())
                         + " (every lane of the mask must call the same one)")
    out = {}
    if op in ("shfl_idx", "shfl_up", "shfl_down", "shfl_bfly"):
        for lane, (_, value, arg) in arrived.items():
            b = int(arg) & (WARP - 1)                 # PTX uses the low 5 bits of the lane / delta / xor mask
            if op == "shfl_idx":
                src = b
            elif op == "shfl_up":
                src = lane - b if lane - b >= 0 else lane
            elif op == "shfl_down":
                src = lane + b if lane + b < WARP else lane
            else:
                src = lane ^ b
            out[lane] = arrived[src][1] if src in members else _undefined(value)
        return out
    preds = {lane: bool(a[1]) for lane, a in arrived.items()}
    if op == "ballot":
        bits = sum(1 << lane for lane, p in preds.items() if p)
        return {lane: _int32(bits) for lane in arrived}
    if op == "all":
        r = all(preds.values())
    elif op == "any":
        r = any(preds.values())
    elif op == "eq":
        r = len(set(preds.values())) == 1
    else:  # "sync"
        r = None
    return {lane: r for lane in arrived}


def _exchange(op, name, mask, value, arg=0):
    t = current_thread()
    if not isinstance(t, SimThread):
        raise WarpError(f"cuda.{name} can only be called inside a kernel running in the simulator")
    block = t.block
    warp, lane = divmod(t.thread_id, WARP)
    exists = min(WARP, block.nthreads - warp * WARP)
    mask = int(mask) & FULL
    members = {lane_ for lane_ in range(exists) if mask >> lane_ & 1}
    where = _where(t.blockIdx, warp, exists)
    if lane not in members:
        raise WarpError(f"cuda.{name} with mask {_mask_text(mask)} called by lane {lane} of {where}, which is not "
                        f"in the mask: the calling lane must be one of the mask's lanes")
    arrived = block.rounds.setdefault((warp, mask), {})
    arrived[lane] = (op, value, arg)
    if len(arrived) == len(members):      # the last lane: answer every lane of the round
        del block.rounds[(warp, mask)]
        answers = _answers(op, arrived, members, exists)
        for other in sorted(members - {lane}):
            th = block.threads[warp * WARP + other]
            th.answer, th.waiting = answers, None
            block.ready.append(th)
    else:
        t.waiting = (warp, mask, name)
        block.pause()
        answers = t.answer
        t.answer = None
    if isinstance(answers, WarpError):
        raise WarpError(f"cuda.{name} in {where}: {answers}")
    return answers[lane]


def _where(block_idx, warp, exists) -> str:
    return f"block {tuple(block_idx)}, warp {warp} (threads {warp * WARP}..{warp * WARP + exists - 1})"


def _stuck(block) -> WarpError:
    """The error when no thread can go on and not all wait at the barrier: the first waiting warp operation's lanes
    that can never arrive (returned, at cuda.syncthreads(), at another warp operation)."""
    t = next(th for th in block.threads if th.waiting is not None)
    warp, mask, name = t.waiting
    exists = min(WARP, block.nthreads - warp * WARP)
    members = {lane for lane in range(exists) if mask >> lane & 1}
    missing = sorted(members - set(block.rounds.get((warp, mask), {})))
    exited, at_barrier, elsewhere = [], [], {}
    for lane in missing:
        th = block.threads[warp * WARP + lane]
        if th.waiting is not None:
            elsewhere.setdefault((th.waiting[2], th.waiting[1]), []).append(lane)
        elif th.greenlet.dead:
            exited.append(lane)
        else:
            at_barrier.append(lane)
    parts = []
    if exited:
        parts.append(f"lanes {_lanes_text(exited)} returned from the kernel without calling it")
    if at_barrier:
        parts.append(f"lanes {_lanes_text(at_barrier)} wait at cuda.syncthreads() instead")
    for (other, other_mask), lanes in elsewhere.items():
        parts.append(f"lanes {_lanes_text(lanes)} wait at cuda.{other} with mask {_mask_text(other_mask)} instead")
    return WarpError(f"cuda.{name} with mask {_mask_text(mask)} in {_where(t.blockIdx, warp, exists)}: "
                     f"{' and '.join(parts)}. Every lane named in the mask must call the same warp operation (on a "
                     f"GPU this hangs or returns garbage): keep the whole warp in the loop (guard the loads, not the "
                     f"shuffle), or pass a mask of the lanes that do call it")


# --------------------------------------------------------------------------------------------------------------
# The functions a kernel calls (methods of the simulator's fake `cuda` module)
# --------------------------------------------------------------------------------------------------------------
def shfl_sync(self, mask, value, src_lane):
    return _exchange("shfl_idx", "shfl_sync", mask, value, src_lane)


def shfl_up_sync(self, mask, value, delta):
    return _exchange("shfl_up", "shfl_up_sync", mask, value, delta)


def shfl_down_sync(self, mask, value, delta):
    return _exchange("shfl_down", "shfl_down_sync", mask, value, delta)


def shfl_xor_sync(self, mask, value, lane_mask):
    return _exchange("shfl_bfly", "shfl_xor_sync", mask, value, lane_mask)


def syncwarp(self, mask=FULL):
    _exchange("sync", "syncwarp", mask, None)


def ballot_sync(self, mask, predicate):
    return _exchange("ballot", "ballot_sync", mask, predicate)


def all_sync(self, mask, predicate):
    return _exchange("all", "all_sync", mask, predicate)


def any_sync(self, mask, predicate):
    return _exchange("any", "any_sync", mask, predicate)


def eq_sync(self, mask, predicate):
    return _exchange("eq", "eq_sync", mask, predicate)


def lanemask_lt(self):
    return _int32((1 << (current_thread().thread_id % WARP)) - 1)


FUNCTIONS = {f.__name__: f for f in (shfl_sync, shfl_up_sync, shfl_down_sync, shfl_xor_sync, syncwarp, ballot_sync,
                                     all_sync, any_sync, eq_sync, lanemask_lt)}


# --------------------------------------------------------------------------------------------------------------
# Running a block: its CUDA threads as greenlets, one at a time
# --------------------------------------------------------------------------------------------------------------
class SimThread:
    """One CUDA thread of a block in the simulator: its indices (what the simulator's `cuda` module asks of it), its
    greenlet, and what it waits for (a barrier, or `waiting`: the (warp, mask, operation) of a warp round)."""

    def __init__(self, block, block_point, thread_point):
        self.block = block
        self.blockIdx = _dim3(*block_point)
        self.threadIdx = _dim3(*thread_point)
        bx, by, _ = block.dim
        x, y, z = thread_point
        self.thread_id = x + bx * (y + by * z)
        self.waiting = None
        self.answer = None
        self.greenlet = None

    def syncthreads(self):
        self.block.at_barrier += 1
        self.block.pause()

    def _vote(self, value) -> list:
        """The predicates of the threads that have not returned (CUDA's __syncthreads_count / _and / _or)."""
        block = self.block
        key = block.barriers
        block.votes.setdefault(key, {})[self.thread_id] = bool(value)
        self.syncthreads()
        votes = list(block.votes[key].values())
        self.syncthreads()
        block.votes.pop(key, None)
        return votes

    def syncthreads_count(self, value):
        return sum(self._vote(value))

    def syncthreads_and(self, value):
        return 1 if all(self._vote(value)) else 0

    def syncthreads_or(self, value):
        return 1 if any(self._vote(value)) else 0

    def __str__(self):
        return f"Thread <<<{self.blockIdx}, {self.threadIdx}>>>"


class _Block:
    """The state one block's threads share while it runs: the scheduler's greenlet, the threads ready to go on, the
    open warp rounds, and how many threads wait at the barrier."""

    def __init__(self, dim, scheduler):
        self.dim = tuple(dim)
        self.nthreads = int(np.prod(dim))
        self.scheduler = scheduler
        self.threads: list = []
        self.ready = collections.deque()
        self.rounds: dict = {}          # (warp, mask) -> {lane: (op, value, arg)}
        self.at_barrier = 0
        self.barriers = 0               # barriers opened so far
        self.votes: dict = {}           # barrier number -> {thread id: predicate} (syncthreads_count and co)

    def pause(self):
        """Give the interpreter back to the scheduler until the calling thread may go on."""
        self.scheduler.switch()


GREENLET_MISSING = ("the CUDA simulator's block runner needs the greenlet package (a dependency of gpullm-lessons), "
                    "which is not installed")
GREENLET_FIX = "pip install 'greenlet>=3'"
_current = threading.local()     # .thread: the SimThread running now in this Python thread (None between threads)
_dim3 = None                     # the simulator's Dim3, set by _patch


def current_thread():
    """The simulated CUDA thread running now (outside a kernel: the Python thread)."""
    t = getattr(_current, "thread", None)
    return t if t is not None else threading.current_thread()


def _with_indices(e: Exception, t: SimThread) -> Exception:
    """The error as the simulator reports it: the thread's and the block's indices first."""
    msg = f"tid={list(t.threadIdx)} ctaid={list(t.blockIdx)}" + (f": {e}" if str(e) else "")
    try:
        return type(e)(msg).with_traceback(e.__traceback__)
    except Exception:
        return e


def _run_block(manager, grid_point, args):
    """Run one block: each thread in turn until it returns or must wait; open the barrier when every live thread
    waits at it; raise the first error a thread hits, or a WarpError when no thread can go on."""
    try:
        from greenlet import greenlet
    except ImportError:
        raise ImportError(f"{GREENLET_MISSING}: {GREENLET_FIX}") from None

    block = _Block(manager._block_dim, greenlet.getcurrent())
    f = manager._f
    if manager._debug:            # as the simulator's debug mode: a division by zero raises
        def body():
            with np.errstate(divide="raise"):
                f(*args)
    else:
        def body():
            f(*args)
    block.threads = [None] * block.nthreads      # by thread id: x fastest, then y, then z
    for p in np.ndindex(*block.dim):
        t = SimThread(block, grid_point, p)
        t.greenlet = greenlet(body, parent=block.scheduler)
        block.threads[t.thread_id] = t
    block.ready.extend(block.threads)
    live = block.nthreads
    try:
        while live:
            while block.ready:
                t = block.ready.popleft()
                _current.thread = t
                try:
                    t.greenlet.switch()
                except Exception as e:
                    raise _with_indices(e, t) from None
                finally:
                    _current.thread = None
                if t.greenlet.dead:
                    live -= 1
            if live and block.at_barrier == live:
                block.at_barrier = 0
                block.barriers += 1
                block.ready.extend(t for t in block.threads if not t.greenlet.dead)
            elif live:
                raise _stuck(block)
    finally:
        for t in block.threads:   # after an error: end the paused threads (their greenlets unwind)
            if t.greenlet:        # started and not returned
                _current.thread = t
                try:
                    t.greenlet.throw()
                except BaseException:
                    pass
                finally:
                    _current.thread = None


def _block_runner(kernel_module):
    """A BlockManager.run for the simulator: the block's threads as greenlets (_run_block)."""

    def run(self, grid_point, *args):
        _run_block(self, grid_point, args)

    run._simwarp = True
    return run


# --------------------------------------------------------------------------------------------------------------
# Installing
# --------------------------------------------------------------------------------------------------------------
def _patch(kernel_module) -> None:
    """Add the functions to the simulator's fake cuda module (only those it lacks), run blocks with _block_runner,
    and let the fake module find the running CUDA thread through current_thread()."""
    from numba.cuda.simulator import kernelapi
    global _dim3
    _dim3 = kernelapi.Dim3
    if not isinstance(kernelapi.threading, _ThreadingForKernels):
        kernelapi.threading = _ThreadingForKernels()   # threadIdx, blockIdx, syncthreads: current_thread()'s
    fake = kernelapi.FakeCUDAModule
    for name, fn in FUNCTIONS.items():
        if not hasattr(fake, name):
            setattr(fake, name, fn)
    if not getattr(kernel_module.BlockManager.run, "_simwarp", False):
        kernel_module.BlockManager.run = _block_runner(kernel_module)


class _ThreadingForKernels(types.ModuleType):
    """The `threading` the simulator's `cuda` module sees: the real one, with current_thread() of this module (a
    simulated CUDA thread is a greenlet, not an operating-system thread)."""

    def __init__(self):
        super().__init__("threading")

    def __getattr__(self, name):
        return getattr(threading, name)

    @staticmethod
    def current_thread():
        return current_thread()


class _PatchOnImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Patch the simulator right after numba imports it (gpullm_lessons never imports numba itself)."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        self._loader = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self._loader.create_module(spec) if hasattr(self._loader, "create_module") else None

    def exec_module(self, module):
        self._loader.exec_module(module)
        _patch(module)
        if self in sys.meta_path:
            sys.meta_path.remove(self)


def install() -> None:
    """Give the CUDA simulator warp shuffles and votes (idempotent). Call it only when the simulator is on."""
    global _installed
    if _installed:
        return
    _installed = True
    module = sys.modules.get(_TARGET)
    if module is not None:
        _patch(module)
    else:
        sys.meta_path.insert(0, _PatchOnImport())


def installed() -> bool:
    """Whether the simulator in this process has the warp functions."""
    module = sys.modules.get("numba.cuda.simulator.kernelapi")
    return module is not None and hasattr(module.FakeCUDAModule, "shfl_down_sync")
