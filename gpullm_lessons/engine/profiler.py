"""OpProfiler: every launcher call and matrix product of a GPUEngine timed (CUDA events on a GPU, the wall clock in
the simulator), for lesson 09's per-op table (GPUEngine.enable_profiling)."""

from __future__ import annotations


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
