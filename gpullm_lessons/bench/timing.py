"""How the course times things on a GPU, and the two ceilings a kernel is compared with (GPU only; cupy imported
lazily). The benchmarks (bench/kernels.py, bench/train_step.py) and the lessons time with these, so every row of a table comes
from the same clock:

    time_gpu(fn)         CUDA events around a batch of calls (queued time: includes launch gaps)
    time_gpu_graph(fn)   the calls captured once in a CUDA graph and replayed: the GPU's time for the kernels alone
    time_torch_graph(fn) the same for PyTorch's calls (torch.cuda.graph)
    time_host(fn)        Python's time to issue one call (the launcher's own cost on the host)
    copy_bandwidth()     device-to-device copy: the memory-bound kernels' ceiling
    matmul_rate(dtype=)  a large cuBLAS product: the compute-bound ones'
"""

from __future__ import annotations

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
    """Square matmul through CuPy (cuBLAS / hipBLAS): TFLOP/s counted as 2 n^3 per product."""
    device.require_gpu("measuring the matmul rate")
    import cupy as cp

    if dtype == "bfloat16":
        import ml_dtypes

        dt = np.dtype(ml_dtypes.bfloat16)
    else:
        dt = np.dtype(dtype)
    a = cp.asarray(np.random.default_rng(0).standard_normal((n, n), dtype=np.float32).astype(dt))
    b = cp.asarray(np.random.default_rng(1).standard_normal((n, n), dtype=np.float32).astype(dt))
    t = time_gpu(lambda: a @ b, warmup=2, iters=5, reps=3)
    return {"what": f"matmul {n}^3 {dtype}", "flops": 2 * n**3, "seconds": t, "TFLOP/s": 2 * n**3 / t / 1e12}
