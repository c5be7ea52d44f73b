"""How the course times things on a GPU: validate first, then time, with one set of clocks, beside the two ceilings
a kernel is compared with (the clocks need a GPU; cupy imported lazily). The benchmarks (bench/kernels.py,
bench/train_step.py) and the lessons time with these, so every row of a table comes from the same clock and no
wrong version gets a time:

    time_gpu(fn)         CUDA events around a batch of calls (queued time: includes launch gaps)
    time_gpu_graph(fn)   the calls captured once in a CUDA graph and replayed: the GPU's time for the kernels alone
    time_torch_graph(fn) the same for PyTorch's calls (torch.cuda.graph)
    time_host(fn)        Python's time to issue one call (the launcher's own cost on the host)
    copy_bandwidth()     device-to-device copy: the memory-bound kernels' ceiling
    matmul_rate(dtype=)  a large cuBLAS product: the compute-bound ones'

    validate_then_time(run, outputs, reference, tol, timer)   one call checked against the reference, then timed
    max_error(got, expected, tol)                             the check: the validation record of a row
    wrong_message(validation)                                 what a failed check found, in one line
"""

from __future__ import annotations

import sys

import numpy as np

from .. import device


def time_gpu(fn, warmup: int = 3, iters: int = 20, reps: int = 5) -> float:
    """Seconds per fn() call on the GPU: median over `reps` of (events around `iters` calls queued back to back) / iters.

    The calls are queued without waiting, so while Python's launch overhead per call is below the kernel's time the
    GPU never idles and the figure is the kernel's own time; when the launch overhead is larger, that is what limits
    the op in a real step too, and it shows here.
    """
    import cupy as cp

    for _ in range(warmup):
        fn()
    cp.cuda.Device().synchronize()
    times = []
    for _ in range(reps):
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        for _ in range(iters):
            fn()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop) / 1e3 / iters)
    return float(np.median(times))


def time_host(fn, iters: int = 20, reps: int = 3) -> float:
    """Seconds of CPU time per fn() call while the calls are only queued (the GPU's work is waited for after the
    clock stops): what Python, the launcher's checks and the driver's launch cost per call, the GPU aside."""
    import time

    import cupy as cp

    fn()
    cp.cuda.Device().synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        times.append((time.perf_counter() - t0) / iters)
        cp.cuda.Device().synchronize()
    return float(np.median(times))


def time_gpu_graph(fn, iters: int = 20, reps: int = 5) -> float:
    """Seconds per fn() call of GPU time alone: `iters` calls captured once in a CUDA graph (CuPy stream capture,
    a private memory pool), the graph replayed `reps` times between CUDA events; median / iters.

    time_gpu measures what a Python loop of launches achieves (when Python's launch overhead per call exceeds the
    kernel's time, the GPU waits for Python and that shows); this measures the kernels themselves, which is what a
    kernel's fraction of the copy bandwidth is about and what a captured training step pays."""
    import cupy as cp

    from ..runtime.blas import prepare_capture

    prepare_capture()
    pool, stream = cp.cuda.MemoryPool(), cp.cuda.Stream(non_blocking=True)
    cp.cuda.Device().synchronize()
    with cp.cuda.using_allocator(pool.malloc), stream:
        fn()  # compiles, fills the private pool
        stream.synchronize()
        stream.begin_capture(mode=cp.cuda.runtime.streamCaptureModeRelaxed)
        try:
            for _ in range(iters):
                fn()
        finally:
            graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
        times = []
        for _ in range(reps):
            start, stop = cp.cuda.Event(), cp.cuda.Event()
            start.record(stream)
            graph.launch(stream)
            stop.record(stream)
            stop.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, stop) / 1e3 / iters)
    return float(np.median(times))


def time_torch_graph(fn, iters: int = 20, reps: int = 5) -> float:
    """time_gpu_graph for a PyTorch callable (torch.cuda.CUDAGraph: PyTorch launches on its own streams)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1e3 / iters)
    return float(np.median(times))


def copy_bandwidth(nbytes: int = 2 * 2**30) -> dict:
    """Device-to-device copy: GB/s counted as read + write (2 x nbytes per copy)."""
    device.require_gpu("measuring copy bandwidth")
    import cupy as cp

    n = nbytes // 4
    src = cp.ones(n, cp.float32)
    dst = cp.empty_like(src)
    t = time_gpu(lambda: cp.copyto(dst, src))
    return {"what": "device copy", "bytes": 2 * n * 4, "seconds": t, "GB/s": 2 * n * 4 / t / 1e9}


def matmul_rate(n: int = 8192, dtype: str = "float32") -> dict:
    """Square matmul through CuPy (cuBLAS / hipBLAS): TFLOP/s counted as 2 n^3 per product. dtype "tf32": float32
    inputs read as TF32 (runtime/blas.py's gemm, cuBLAS's TF32 mode), the rate an fp32 run with TF32 products reaches."""
    device.require_gpu("measuring the matmul rate")
    import cupy as cp

    if dtype == "tf32":
        from ..runtime.blas import gemm

        a, b = (cp.asarray(np.random.default_rng(s).standard_normal((n, n), dtype=np.float32)) for s in (0, 1))
        out = cp.empty((n, n), cp.float32)
        t = time_gpu(lambda: gemm(a, b, out, fmt="tf32"), warmup=2, iters=5, reps=3)
        return {"what": f"matmul {n}^3 tf32", "flops": 2 * n**3, "seconds": t, "TFLOP/s": 2 * n**3 / t / 1e12}
    if dtype == "bfloat16":
        import ml_dtypes

        dt = np.dtype(ml_dtypes.bfloat16)
    else:
        dt = np.dtype(dtype)
    a = cp.asarray(np.random.default_rng(0).standard_normal((n, n), dtype=np.float32).astype(dt))
    b = cp.asarray(np.random.default_rng(1).standard_normal((n, n), dtype=np.float32).astype(dt))
    t = time_gpu(lambda: a @ b, warmup=2, iters=5, reps=3)
    return {"what": f"matmul {n}^3 {dtype}", "flops": 2 * n**3, "seconds": t, "TFLOP/s": 2 * n**3 / t / 1e12}


# ---- validate, then time: the core both benchmarks share (bench/kernels.py's kernel rows, bench/train_step.py's
# step rows) ----------------------------------------------------------------------------------------------------------
# As llm.c's dev/cuda benchmarks do: every kernel version (every step configuration) first runs once on the
# benchmark's own inputs and its outputs are compared with the reference; only one that matches is timed. A row says
# what the check found:
#
#   status      "ok": validated, then timed; "wrong": its outputs do not match (or it raised), no time;
#               "error": validated, but its timing raised; "unvalidated": timed without a check (validation says why)
#   validation  {"max_err": the largest |got - expected| of an output over that output's largest |expected| (the
#                output's magnitude; 1 for an output that should be all zeros), over every output, NaN/inf aside;
#                None when the call raised,
#                "tol": the largest max_err a right version reaches (kernels.Case.tol, train_step.TRAIN_TOL: from
#                the tests),
#                "ok": max_err <= tol and no NaN/inf and no exception (None: not validated),
#                "where": the element of max_err ("dinp[17, 3]"), or the first NaN/inf one when there are any,
#                "nonfinite": how many output elements are NaN or inf (outputs start as NaN: unwritten ones count),
#                "raised": the exception, when the call raised; "why_not": why a row is not validated}
#   error       why a row has no time (a wrong row: wrong_message), so code that keeps the rows without "error"
#               keeps exactly the timed ones


def _array_module(a):
    """numpy, or cupy for a CuPy array (cupy only when it is already imported: a CuPy array implies it)."""
    cp = sys.modules.get("cupy")
    return cp.get_array_module(a) if cp is not None and hasattr(cp, "get_array_module") else np


def _index(shape, flat) -> str:
    return "[" + ", ".join(str(int(i)) for i in np.unravel_index(int(flat), shape)) + "]" if shape else ""


def max_error(got: dict, expected: dict, tol: float) -> dict:
    """The validation record (see above) of outputs `got` against `expected` ({name: array}, NumPy or CuPy, any
    float dtype; scalars too): max_err, tol, ok, where, nonfinite. Every name of `expected` must be in `got`, with
    the same number of elements."""
    worst, where, nonfinite, first_bad = 0.0, None, 0, None
    for name, want in expected.items():
        xp = _array_module(got[name]) if _array_module(want) is np else _array_module(want)  # CuPy if either is
        g = xp.asarray(got[name], dtype=xp.float64)
        want = xp.asarray(want, dtype=xp.float64)
        if g.size != want.size:
            raise ValueError(f"{name}: {g.size} elements, the reference has {want.size} ({tuple(want.shape)})")
        g = g.reshape(want.shape)
        bad = ~xp.isfinite(g)
        n_bad = int(bad.sum())
        if n_bad and first_bad is None:
            first_bad = f"{name}{_index(want.shape, int(xp.argmax(bad.ravel())))}"
        nonfinite += n_bad
        if not want.size:
            continue
        scale = float(xp.abs(want).max()) or 1.0  # an all-zero output: the absolute error
        err = xp.where(bad, 0.0, xp.abs(g - want)).ravel()
        i = int(xp.argmax(err))
        e = float(err[i]) / scale
        if where is None or e > worst:
            worst, where = e, f"{name}{_index(want.shape, i)}"
    return {
        "max_err": worst,
        "tol": tol,
        "ok": bool(nonfinite == 0 and worst <= tol),
        "where": first_bad if nonfinite else where,
        "nonfinite": nonfinite,
    }


def wrong_message(v: dict) -> str:
    """What a failed validation found, in one line: "wrong (max err 0.31 > tol 2e-05 at dinp[17, 3])"."""
    if v.get("raised"):
        return f"wrong (raised {v['raised']})"
    if v.get("nonfinite"):
        return (
            f"wrong ({v['nonfinite']} NaN/inf elements, first at {v['where']}; max err of the rest "
            f"{v['max_err']:.2g}, tol {v['tol']:g})"
        )
    return f"wrong (max err {v['max_err']:.2g} > tol {v['tol']:g} at {v['where']})"


def validate_then_time(run, outputs, reference, tol, timer, prepare=None, why_not=None) -> dict:
    """Validate one call, then time it: the fields of its row (status, validation, and timer's fields or error).

    prepare(): sets up the check (the outputs poisoned with NaN, inputs the call overwrites restored); run() makes
    the call once (its return value goes to outputs); outputs(returned) -> {name: array} (the arrays it wrote, or
    what it returned); reference: {name: expected}, compared by max_error with `tol`. Only when they match is
    timer(run) called, and its dict (the row's times) returned with status "ok". A mismatch, NaN/inf or an
    exception in prepare/run/outputs gives status "wrong" and no time. reference None: nothing to compare with
    (why_not says why): timed, status "unvalidated". Runs on NumPy arrays as on CuPy ones; the timer is the
    caller's (bench_kernels: CUDA graphs; a test: a stand-in)."""
    if reference is None:
        v = {"ok": None, "why_not": why_not or "no reference to compare with"}
    else:
        try:
            if prepare is not None:
                prepare()
            v = max_error(outputs(run()), reference, tol)
        except Exception as e:  # noqa: BLE001 - a version that raises is wrong, and the table goes on
            v = {
                "max_err": None,
                "tol": tol,
                "ok": False,
                "where": None,
                "nonfinite": 0,
                "raised": f"{type(e).__name__}: {e}"[:200],
            }
        if not v["ok"]:
            return {"status": "wrong", "validation": v, "error": wrong_message(v)}
    try:
        times = timer(run)
    except Exception as e:  # noqa: BLE001 - one failing version must not stop the table
        return {"status": "error", "validation": v, "error": f"{type(e).__name__}: {e}"[:200]}
    return {"status": "ok" if v["ok"] else "unvalidated", "validation": v, **times}
