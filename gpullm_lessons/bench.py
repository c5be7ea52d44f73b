"""Measured ceilings of this machine, and timing helpers for benchmarks (GPU only; cupy imported lazily).

A kernel's speed means something only beside the ceiling measured on the same card in the same run:
device-to-device copy bandwidth for memory-bound kernels, cuBLAS matmul rate for compute-bound ones.
Without a GPU, lessons show a stored measurement instead (``stored_ceilings()``, with its card and date).

    python -m gpullm_lessons.bench ceilings [--json PATH]
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from importlib import resources

import numpy as np

from . import device


def time_gpu(fn, warmup: int = 3, iters: int = 20) -> float:
    """Median time of fn() in seconds, measured with CUDA/HIP events around each call."""
    import cupy as cp
    for _ in range(warmup):
        fn()
    cp.cuda.Device().synchronize()
    times = []
    for _ in range(iters):
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop) / 1e3)
    return float(np.median(times))


def copy_bandwidth(nbytes: int = 2 * 2**30) -> dict:
    """Device-to-device copy: GB/s counted as read + write (2 x nbytes per copy)."""
    import cupy as cp
    device.require_gpu("measuring copy bandwidth")
    n = nbytes // 4
    src = cp.ones(n, cp.float32)
    dst = cp.empty_like(src)
    t = time_gpu(lambda: cp.copyto(dst, src))
    return {"what": "device copy", "bytes": 2 * n * 4, "seconds": t, "GB/s": 2 * n * 4 / t / 1e9}


def matmul_rate(n: int = 8192, dtype: str = "float32") -> dict:
    """Square matmul through CuPy (cuBLAS / hipBLAS): TFLOP/s counted as 2 n^3 per product."""
    import cupy as cp
    device.require_gpu("measuring the matmul rate")
    if dtype == "bfloat16":
        import ml_dtypes
        dt = np.dtype(ml_dtypes.bfloat16)
    else:
        dt = np.dtype(dtype)
    a = cp.asarray(np.random.default_rng(0).standard_normal((n, n), dtype=np.float32).astype(dt))
    b = cp.asarray(np.random.default_rng(1).standard_normal((n, n), dtype=np.float32).astype(dt))
    t = time_gpu(lambda: a @ b, warmup=2, iters=10)
    return {"what": f"matmul {n}^3 {dtype}", "flops": 2 * n**3, "seconds": t, "TFLOP/s": 2 * n**3 / t / 1e12}


def ceilings(small: bool = False) -> dict:
    """Copy bandwidth and matmul rates of this GPU, with the card's name and the date."""
    info = device.require_gpu("measuring ceilings")
    n = 2048 if small else 8192
    out = {"card": info.gpu.name, "date": datetime.date.today().isoformat(),
           "copy": copy_bandwidth(256 * 2**20 if small else 2 * 2**30),
           "matmul_fp32": matmul_rate(n, "float32"),
           "matmul_fp16": matmul_rate(n, "float16")}
    try:
        out["matmul_bf16"] = matmul_rate(n, "bfloat16")
    except Exception as e:  # noqa: BLE001 - older CuPy/hipBLAS without bf16 matmul: say so, keep the rest
        out["matmul_bf16"] = {"what": "matmul bf16", "error": f"{type(e).__name__}: {e}"}
    return out


def stored_ceilings() -> dict:
    """The ceilings measured on the course's reference GPU (see the file's card and date)."""
    text = resources.files("gpullm_lessons").joinpath("results", "ceilings_h200.json").read_text()
    return json.loads(text)


def format_ceilings(c: dict) -> str:
    lines = [f"{c['card']} ({c['date']})", f"  copy bandwidth     {c['copy']['GB/s']:8.0f} GB/s"]
    for key in ("matmul_fp32", "matmul_fp16", "matmul_bf16"):
        m = c.get(key)
        if m and "TFLOP/s" in m:
            lines.append(f"  {m['what']:<18} {m['TFLOP/s']:8.1f} TFLOP/s")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gpullm_lessons.bench", description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["ceilings"], help="what to measure")
    ap.add_argument("--json", help="write the result as JSON here")
    args = ap.parse_args(argv)
    try:
        result = ceilings()
    except device.NoGPUError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_ceilings(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
