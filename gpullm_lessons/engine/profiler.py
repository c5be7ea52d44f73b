"""OpProfiler: every launcher call and matrix product of a GPUEngine timed (CUDA events on a GPU, the wall clock in
the simulator), for lesson 09's per-op table (GPUEngine.enable_profiling); nvtx_range: the NVTX ranges the engine
puts around its step's phases (bench/profiling.py's timeline and Nsight read them; range_hook adds a tracer's own)."""

from __future__ import annotations

import contextlib


class OpProfiler:
    """Time every launcher call and matrix product of a GPUEngine: CUDA events on a GPU, wall clock in the simulator.

    eng.enable_profiling(); eng.train_step(...); rows = eng.profiler.report()  -> per op: calls, ms, share of the
    step. What no event covers (CuPy's own elementwise kernels, copies, Python between launches) is the row
    "other (CuPy ops, copies, Python)" = wall time of the profiled steps minus the sum of the timed ops.
    """

    def __init__(self, on_gpu):
        self.on_gpu = on_gpu
        self.records = []  # (name, start, stop): events or perf_counter floats
        self.wall = 0.0

    def wrap(self, name, fn):
        import time

        def timed(*args, **kwargs):
            if self.on_gpu:
                import cupy as cp

                start, stop = cp.cuda.Event(), cp.cuda.Event()
                start.record()
                out = fn(*args, **kwargs)
                stop.record()
            else:
                start = time.perf_counter()
                out = fn(*args, **kwargs)
                stop = time.perf_counter()
            self.records.append((name, start, stop))
            return out

        return timed

    def step(self, fn, *args, **kwargs):
        """Run fn (e.g. eng.train_step) and add its wall time (synchronised on a GPU)."""
        import time

        if self.on_gpu:
            import cupy as cp

            cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        if self.on_gpu:
            cp.cuda.Device().synchronize()
        self.wall += time.perf_counter() - t0
        return out

    def report(self) -> list:
        """[{"op", "calls", "ms", "share"}] sorted by time, plus the "other" row; ms summed over the profiled steps."""
        totals, calls = {}, {}
        for name, start, stop in self.records:
            if self.on_gpu:
                import cupy as cp

                stop.synchronize()
                ms = cp.cuda.get_elapsed_time(start, stop)
            else:
                ms = 1e3 * (stop - start)
            totals[name] = totals.get(name, 0.0) + ms
            calls[name] = calls.get(name, 0) + 1
        wall_ms = 1e3 * self.wall
        rows = [{"op": k, "calls": calls[k], "ms": v} for k, v in sorted(totals.items(), key=lambda kv: -kv[1])]
        if wall_ms:
            rows.append(
                {"op": "other (CuPy ops, copies, Python)", "calls": 0, "ms": max(wall_ms - sum(totals.values()), 0.0)}
            )
        for r in rows:
            r["share"] = r["ms"] / wall_ms if wall_ms else float("nan")
        return rows


class TimedLaunchers:
    """The launcher module with every call timed by an OpProfiler."""

    def __init__(self, module, profiler):
        self._module, self._profiler = module, profiler

    def __getattr__(self, name):
        fn = getattr(self._module, name)
        return self._profiler.wrap(name, fn) if callable(fn) else fn


# ---- NVTX ranges around the step's phases (the engine marks them; bench/profiling.py's timeline and Nsight read them)
_NVTX: dict = {}
_range_hooks: list = []  # context managers entered with every range (range_hook)


def _nvtx():
    if "fns" not in _NVTX:
        try:
            from cupy.cuda import nvtx

            _NVTX["fns"] = (nvtx.RangePush, nvtx.RangePop)
        except Exception:  # noqa: BLE001 - CuPy without NVTX (or no CuPy): ranges are a no-op
            _NVTX["fns"] = None
    return _NVTX["fns"]


@contextlib.contextmanager
def nvtx_range(name: str):
    """An NVTX range around a phase of the step (seen by Nsight Systems, `ncu --nvtx`, and the timeline below)."""
    nv = _nvtx()
    with contextlib.ExitStack() as stack:
        for hook in _range_hooks:
            stack.enter_context(hook(name))
        if nv is not None:
            nv[0](name)
        try:
            yield
        finally:
            if nv is not None:
                nv[1]()


@contextlib.contextmanager
def range_hook(hook):
    """Enter hook(name) (a context manager) with every nvtx_range while this block runs (the step timeline adds
    torch.profiler's record_function, so the phases show in its trace)."""
    _range_hooks.append(hook)
    try:
        yield
    finally:
        _range_hooks.remove(hook)
