"""adamw_step through kernels/hip/adamw.cu, launched with CuPy (NVIDIA or AMD).

Same name, signature, versions and decay table as kernels/numba/adamw.py (read its docstring):
v1 unfused (five elementwise kernels, ~60 bytes per parameter), v2 fused (one pass, 32 bytes per parameter).
HIP only: v3, v2 with float4 loads and stores (4 elements per thread per step); it needs n % 4 == 0 and 16-byte
aligned buffers and runs v2 otherwise.
params, grads, m, v are 1-D float32 CuPy arrays of one length n (the flat parameter buffer and its companions).
"""
from __future__ import annotations

import numpy as np

from gpullm_lessons.kernels.numba.adamw import (HALF_NONE, check_buffers, check_hyper, check_table, decay_table,
                                                half_mode_of, host_scalars)

from ._args import check_array, check_threads, check_version

__all__ = ["adamw_step", "decay_table", "VERSIONS"]
VERSIONS = ("v1", "v2", "v3")
MAX_BLOCKS = 4096   # grid cap: enough blocks to fill any GPU; the grid-stride loop covers the rest
_DEFAULT_TABLES = {}   # (device id, n) -> the "decay everything" table ([0, n], [1]) on that GPU


def _check_cupy(fn, name, a, shape, dtype):
    check_array(fn, name, a, shape, dtype, cupy=True)


def _is_host(a) -> bool:
    return isinstance(a, np.ndarray)


def adamw_step(params, grads, m, v, lr, beta1, beta2, eps, weight_decay, step, decay_bounds=None, grad_scale=1.0,
               half_out=None, half_dtype=None, version="v2", threads=256):
    """One AdamW step in place on CuPy arrays: params, m, v updated, grads zeroed (all float32 (n,)).

    step: the step count t after increment (>= 1). decay_bounds: None (decay everything) or (bounds, flags) from
    decay_table() (CuPy arrays: int64 (k+1,), uint8 (k,); NumPy ones are copied to the GPU on every call).
    grad_scale multiplies the gradient first. half_out (n,) CuPy float16 (half_dtype="float16") or uint16
    (half_dtype="bfloat16": the bfloat16 bits) also receives the updated weights.
    """
    import cupy as cp

    from gpullm_lessons import hip
    fn = "adamw_step"
    check_version(fn, version, VERSIONS)
    threads = check_threads(fn, threads)
    n = check_buffers(fn, ("params", "grads", "m", "v"), (params, grads, m, v), _check_cupy)
    check_hyper(fn, lr, beta1, beta2, eps, weight_decay, step, grad_scale)
    half_mode = half_mode_of(fn, half_out, half_dtype, n)
    if half_out is not None and not isinstance(half_out, cp.ndarray):
        raise TypeError(f"{fn}: half_out must be a CuPy array, got {type(half_out).__module__}.{type(half_out).__name__}")
    if decay_bounds is None:
        key = (params.device.id, n)
        if key not in _DEFAULT_TABLES:
            _DEFAULT_TABLES[key] = (cp.asarray(np.array([0, n], np.int64)), cp.ones(1, cp.uint8))
        bounds, flags = _DEFAULT_TABLES[key]
    else:
        check_table(fn, decay_bounds, n, _is_host)
        bounds, flags = decay_bounds
        if _is_host(bounds):   # a NumPy table: copy it to the GPU (build it there once with decay_table instead)
            bounds = cp.asarray(np.ascontiguousarray(bounds, dtype=np.int64))
        if _is_host(flags):
            flags = cp.asarray(np.ascontiguousarray(np.asarray(flags) != 0, dtype=np.uint8))
    half_bits = cp.empty(1, cp.uint16) if half_mode == HALF_NONE else half_out.view(cp.uint16)
    if n == 0:
        return
    s = host_scalars(lr, beta1, beta2, eps, weight_decay, step, grad_scale)
    blocks = min((n + threads - 1) // threads, MAX_BLOCKS)
    grid, block, nn, mode = (blocks,), (threads,), np.int64(n), np.int32(half_mode)
    if version == "v3" and (n % 4 != 0 or any(a.data.ptr % 16 for a in (params, grads, m, v))):
        version = "v2"   # float4 needs whole, aligned groups of 4: the scalar kernel does the same work
    if version == "v3":
        blocks4 = min((n // 4 + threads - 1) // threads, MAX_BLOCKS)
        hip.kernel("adamw", "adamw_step_v3")((blocks4,), block, (
            params, grads, m, v, bounds, flags, half_bits, mode, nn, s["lr"], s["lr_wd"], s["beta1"],
            s["one_minus_beta1"], s["beta2"], s["one_minus_beta2"], s["bias1"], s["bias2"], s["eps"],
            s["grad_scale"]))
    elif version == "v2":
        hip.kernel("adamw", "adamw_step_v2")(grid, block, (
            params, grads, m, v, bounds, flags, half_bits, mode, nn, s["lr"], s["lr_wd"], s["beta1"],
            s["one_minus_beta1"], s["beta2"], s["one_minus_beta2"], s["bias1"], s["bias2"], s["eps"],
            s["grad_scale"]))
    else:  # v1: five launches, each a full pass over its buffers
        hip.kernel("adamw", "adamw_step_v1_decay")(grid, block, (params, grads, bounds, flags, nn, s["lr_wd"],
                                                                 s["grad_scale"]))
        hip.kernel("adamw", "adamw_step_v1_m")(grid, block, (grads, m, nn, s["beta1"], s["one_minus_beta1"]))
        hip.kernel("adamw", "adamw_step_v1_v")(grid, block, (grads, v, nn, s["beta2"], s["one_minus_beta2"]))
        hip.kernel("adamw", "adamw_step_v1_update")(grid, block, (params, m, v, half_bits, mode, nn, s["lr"],
                                                                  s["bias1"], s["bias2"], s["eps"]))
        hip.kernel("adamw", "adamw_step_v1_zero")(grid, block, (grads, nn))
