"""Warp shuffles and votes for Numba's CUDA simulator, so warp-level kernels run (and are graded) on a laptop.

Numba's simulator runs each CUDA thread of a block as a Python thread, but it has no warp intrinsics:
``cuda.shfl_down_sync`` raises AttributeError inside a simulated kernel. ``install()`` adds them, with the
semantics of the GPU instructions Numba emits (PTX ``shfl.sync`` / ``vote.sync``, 32-lane warps):

    shfl_sync(mask, value, src_lane)     the value of lane src_lane % 32
    shfl_up_sync(mask, value, delta)     the value of lane - delta % 32; below lane 0: your own value
    shfl_down_sync(mask, value, delta)   the value of lane + delta % 32; past lane 31: your own value
    shfl_xor_sync(mask, value, lane_mask)  the value of lane ^ (lane_mask % 32)
    syncwarp(mask=0xffffffff)            a barrier for the lanes of mask
    ballot_sync(mask, pred)              bit l set when lane l of mask has pred true (an int32, as on the GPU)
    all_sync / any_sync / eq_sync(mask, pred)
    lanemask_lt()                        the lanes below yours

How: the lanes of one warp (thread ids 32w .. 32w + 31 of the block) meet in a slot table per (warp, mask): each
lane writes its value and waits until every lane of the mask has arrived; then each reads its source lane's slot.
What the GPU leaves undefined is made loud, so a bug shows up in the simulator instead of passing by luck:

- every lane named in ``mask`` that exists must call the same operation: a lane that already returned, or waits
  at ``cuda.syncthreads()`` instead, raises an error naming the lanes (on a GPU this hangs or returns garbage);
- the calling lane must be in its own mask; lanes calling different operations with one mask raise an error;
- a partial last warp (a block of 48 threads: lanes 0..15 of warp 1) works for its lanes; reading a lane that does
  not exist or is not in the mask returns an undefined value: NaN for floats, 0xDEADBEEF for ints.

Not supported: the ``width`` argument of CUDA C++'s ``__shfl_*_sync`` (Numba's functions have none either).
``activemask()`` is not provided: which lanes are converged is not something the simulator models.
The simulator's blocks also run on a loop of this module's (``_block_runner``): Numba's own checks its threads
without pause and starves them of the interpreter's lock; this one yields it between checks, about twice as fast.
Installed by ``import gpullm_lessons`` (its __init__, right after ``device.configure()``) when the simulator is on;
with Numba on a GPU it is never installed: the real intrinsics run.
"""
from __future__ import annotations

import importlib.abc
import math
import sys
import threading
import time

import numpy as np

WARP = 32
FULL = 0xFFFFFFFF
POLL_S = 0.02          # how often a waiting lane looks for lanes that can never arrive
GIVE_UP_S = 120.0      # a shuffle still incomplete after this long raises (a hang is worse than an error)
_UNDEFINED_INT = 0xDEADBEEF

_TARGET = "numba.cuda.simulator.kernel"
_STATE_LOCK = threading.Lock()
_installed = False


class WarpError(RuntimeError):
    """A warp operation that a GPU would hang on or answer with garbage."""


# --------------------------------------------------------------------------------------------------------------
# One exchange among the lanes of a mask
# --------------------------------------------------------------------------------------------------------------
class _Round:
    """The slot table of one (warp, mask): lanes arriving for generation `gen`, finished generations' answers."""

    def __init__(self):
        self.gen = 0
        self.arrived = {}     # lane -> (op, value, arg)
        self.done = {}        # gen -> [answers {lane: value} or a WarpError, readers left]


class _Warp:
    def __init__(self):
        self.cond = threading.Condition()
        self.rounds = {}      # mask -> _Round


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
    t = threading.current_thread()
    manager = getattr(t, "_manager", None)
    if manager is None or not hasattr(t, "thread_id"):
        raise WarpError(f"cuda.{name} can only be called inside a kernel running in the simulator")
    nthreads = int(np.prod(manager._block_dim))
    tid = t.thread_id
    warp, lane = divmod(tid, WARP)
    exists = min(WARP, nthreads - warp * WARP)
    mask = int(mask) & FULL
    members = {lane_ for lane_ in range(exists) if mask >> lane_ & 1}
    where = f"block {tuple(t.blockIdx)}, warp {warp} (threads {warp * WARP}..{warp * WARP + exists - 1})"
    if lane not in members:
        raise WarpError(f"cuda.{name} with mask {_mask_text(mask)} called by lane {lane} of {where}, which is not "
                        f"in the mask: the calling lane must be one of the mask's lanes")
    with _STATE_LOCK:
        warps = manager.__dict__.setdefault("_simwarp_warps", {})
        state = warps.get(warp)
        if state is None:
            state = warps[warp] = _Warp()
    with state.cond:
        rnd = state.rounds.get(mask)
        if rnd is None:
            rnd = state.rounds[mask] = _Round()
        my_gen = rnd.gen
        rnd.arrived[lane] = (op, value, arg)
        if len(rnd.arrived) == len(members):
            rnd.done[my_gen] = [_answers(op, rnd.arrived, members, exists), len(members)]
            rnd.gen += 1
            rnd.arrived = {}
            state.cond.notify_all()
        else:
            start = time.monotonic()
            while rnd.gen == my_gen:
                state.cond.wait(POLL_S)
                if rnd.gen != my_gen:
                    break
                if getattr(t, "abort", False):
                    raise WarpError("another thread of the block failed")
                _check_stuck(manager, warp, members, rnd, name, mask, where, time.monotonic() - start)
        entry = rnd.done[my_gen]
        entry[1] -= 1
        if entry[1] == 0:
            del rnd.done[my_gen]
    answers = entry[0]
    if isinstance(answers, WarpError):
        raise WarpError(f"cuda.{name} in {where}: {answers}")
    return answers[lane]


def _check_stuck(manager, warp, members, rnd, name, mask, where, waited):
    """Raise when lanes of the mask can never arrive: they returned from the kernel or wait at syncthreads."""
    missing = sorted(members - set(rnd.arrived))
    registry = manager.__dict__.get("_simwarp_threads", {})
    exited, at_barrier = [], []
    for lane in missing:
        th = registry.get(warp * WARP + lane)
        if th is None:
            return                      # not started yet
        if getattr(th, "exception", None) is not None:
            exc = th.exception[0]
            raise WarpError(f"cuda.{name} in {where} cannot complete: thread {warp * WARP + lane} failed first with "
                            f"{type(exc).__name__}: {exc}")
        if th.ident is not None and not th.is_alive():
            exited.append(lane)
        elif getattr(th, "syncthreads_blocked", False):
            at_barrier.append(lane)
        else:
            if waited > GIVE_UP_S:
                raise WarpError(f"cuda.{name} with mask {_mask_text(mask)} in {where} waited {waited:.0f} s for lanes "
                                f"{_lanes_text(missing)}: do all lanes of the mask reach this call?")
            return                      # still running: it may yet arrive
    parts = []
    if exited:
        parts.append(f"lanes {_lanes_text(exited)} returned from the kernel without calling it")
    if at_barrier:
        parts.append(f"lanes {_lanes_text(at_barrier)} wait at cuda.syncthreads() instead")
    raise WarpError(f"cuda.{name} with mask {_mask_text(mask)} in {where}: {' and '.join(parts)}. Every lane named "
                    f"in the mask must call the same shuffle (on a GPU this hangs or returns garbage): keep the "
                    f"whole warp in the loop (guard the loads, not the shuffle), or pass a mask of the lanes that "
                    f"do call it")


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
    return _int32((1 << (threading.current_thread().thread_id % WARP)) - 1)


FUNCTIONS = {f.__name__: f for f in (shfl_sync, shfl_up_sync, shfl_down_sync, shfl_xor_sync, syncwarp, ballot_sync,
                                     all_sync, any_sync, eq_sync, lanemask_lt)}


# --------------------------------------------------------------------------------------------------------------
# Running a block without starving it
# --------------------------------------------------------------------------------------------------------------
def _block_runner(kernel_module):
    """A BlockManager.run for the simulator: start one Python thread per CUDA thread of the block, then, until all
    have returned, release the block from cuda.syncthreads() once every live thread waits there and raise the first
    error a thread hit (after stopping the others). Numba's own loop does the same but checks the threads without
    pause, holding the interpreter's lock the threads need: yielding it before each check (time.sleep(0)) runs the
    kernels' threads about twice as fast (a training step of the numba engine on a toy model: 10.2 s -> 4.5 s)."""
    thread_cls = kernel_module.BlockThread

    def run(self, grid_point, *args):
        def body():
            self._f(*args)

        threads = [thread_cls(body, self, grid_point, p, self._debug) for p in np.ndindex(*self._block_dim)]
        for t in threads:
            t.start()
        live = threads
        while live:
            time.sleep(0)
            failed = next((t for t in live if t.exception), None)
            if failed is not None:
                for t in threads:  # the others stop at their next syncthreads (the simulator's abort flag)
                    t.abort, t.syncthreads_blocked = True, False
                    t.syncthreads_event.set()
                raise failed.exception[0].with_traceback(failed.exception[1])
            live = [t for t in live if t.is_alive()]
            if live and all(t.syncthreads_blocked for t in live):
                for t in live:
                    t.syncthreads_blocked = False
                    t.syncthreads_event.set()
        for t in threads:  # an error set just before its thread returned
            if t.exception:
                raise t.exception[0].with_traceback(t.exception[1])

    run._simwarp = True
    return run


# --------------------------------------------------------------------------------------------------------------
# Installing
# --------------------------------------------------------------------------------------------------------------
def _patch(kernel_module) -> None:
    """Add the functions to the simulator's fake cuda module (only those it lacks), register each simulated thread
    with its block, so a waiting lane can tell a lane that returned from one that is still running, and run blocks
    with _block_runner."""
    from numba.cuda.simulator import kernelapi
    fake = kernelapi.FakeCUDAModule
    for name, fn in FUNCTIONS.items():
        if not hasattr(fake, name):
            setattr(fake, name, fn)
    if not getattr(kernel_module.BlockManager.run, "_simwarp", False):
        kernel_module.BlockManager.run = _block_runner(kernel_module)
    thread_cls = kernel_module.BlockThread
    if getattr(thread_cls.__init__, "_simwarp", False):
        return
    original = thread_cls.__init__

    def __init__(self, f, manager, *args, **kwargs):
        original(self, f, manager, *args, **kwargs)
        with _STATE_LOCK:
            manager.__dict__.setdefault("_simwarp_threads", {})[self.thread_id] = self

    __init__._simwarp = True
    thread_cls.__init__ = __init__


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
