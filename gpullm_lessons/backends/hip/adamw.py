"""adamw_step through kernels/hip/adamw.cu, launched with CuPy (NVIDIA or AMD).

Same name, signature, versions and decay table as kernels/numba/adamw.py (read its docstring; its decay_table builds
the table), and the same argument checks (gpullm_lessons/contracts/adamw.py):
v1 unfused (five elementwise kernels, ~60 bytes per parameter), v2 fused (one pass, 32 bytes per parameter).
HIP only: v3, v2 with float4 loads and stores (4 elements per thread per step); it needs n % 4 == 0 and 16-byte
aligned buffers and runs v2 otherwise.
params, grads, m, v are 1-D float32 CuPy arrays of one length n (the flat parameter buffer and its companions); m and
v may instead both be uint16, the bits of bf16 moments: adamw_bf16_moments_v2 (version "v2", scalar loads) and, in
adamw_step_device, adamw_bf16_moments_device_v2 (no float4 requirement); or m int8 and v uint8 with their float32
scales m_scale, v_scale (ceil(n / 256),): block-wise 8-bit moments in gpullm_lessons.model.quant's format,
adamw_int8_moments_v2 / adamw_int8_moments_device_v2 (one thread block per block of 256 values; threads 64, 128 or
256; any n).
"""

from __future__ import annotations

import numpy as np

from gpullm_lessons.contracts import check_array, check_threads, check_version
from gpullm_lessons.contracts.adamw import (
    HALF_NONE,
    MOMENTS_BF16,
    MOMENTS_INT8,
    check_bf16_moments_version,
    check_device_args,
    check_hyper,
    check_int8_moments,
    check_moment_buffers,
    check_table,
    half_mode_of,
    host_scalars,
    int8_blocks,
)

__all__ = ["adamw_step", "adamw_step_device", "grad_sumsq", "VERSIONS"]
VERSIONS = ("v1", "v2", "v3")
LAUNCHERS = ("adamw_step_device", "grad_sumsq")  # besides adamw_step; gathered by backends/_collect.py
SUMSQ_THREADS = 512
SUMSQ_BLOCKS = 1024  # stage 1's grid: enough blocks to fill an H200 / MI300 several times
MAX_BLOCKS = 4096  # grid cap: enough blocks to fill any GPU; the grid-stride loop covers the rest
_DEFAULT_TABLES = {}  # (device id, n) -> the "decay everything" table ([0, n], [1]) on that GPU

BUFFER_NAMES = ("params", "grads", "m", "v")  # the four buffers, as the checks name them


def _check_cupy(fn, name, a, shape, dtype):
    check_array(fn, name, a, shape, dtype, cupy=True)


def _is_host(a) -> bool:
    return isinstance(a, np.ndarray)


def _kernel(name):
    from gpullm_lessons.runtime import hip

    return hip.kernel("adamw", name)


def _check_threads_and_buffers(fn, threads, buffers):
    """(threads, n, moments): the block size, the length of params, grads, m, v (checked, in that order, named after
    fn) and how m and v are stored (contracts.adamw.MOMENTS_F32, MOMENTS_BF16 or MOMENTS_INT8)."""
    return (check_threads(fn, threads), *check_moment_buffers(fn, BUFFER_NAMES, buffers, _check_cupy))


def _float4_ok(n, buffers) -> bool:
    """Whether the float4 kernels (v3, v4) can run: n % 4 == 0 and every buffer 16-byte aligned."""
    return n % 4 == 0 and not any(a.data.ptr % 16 for a in buffers)


def _float4_grid(n, threads):
    """The grid of a float4 kernel: a thread per group of 4 elements, capped at MAX_BLOCKS (grid-stride loop)."""
    return (min((n // 4 + threads - 1) // threads, MAX_BLOCKS),)


def _fused_scalars(s):
    """host_scalars' float32 values in the order adamw_step_v2 and v3 take them (after n)."""
    keys = (
        "lr",
        "lr_wd",
        "beta1",
        "one_minus_beta1",
        "beta2",
        "one_minus_beta2",
        "bias1",
        "bias2",
        "eps",
        "grad_scale",
    )
    return tuple(s[k] for k in keys)


def _int8_grid(n):
    """The grid of an int8-moment kernel: a thread block per quantisation block, capped at MAX_BLOCKS (grid-stride)."""
    return (min(int8_blocks(n), MAX_BLOCKS),)


def _launch_fused(name, grid, threads, buffers, table, n, scalars):
    """One launch of a one-pass kernel (v2, v3, v4): params, grads, m, v (int8 moments: and m_scale, v_scale), then
    _table_and_half's (bounds, flags, half bits, half_mode), n, then that kernel's scalars."""
    _kernel(name)(grid, (threads,), (*buffers, *table, np.int64(n), *scalars))


def _table_and_half(fn, params, n, decay_bounds, half_out, half_dtype):
    """(bounds, flags, half bits, half_mode) on the GPU: the decay table (None: decay everything) and the half copy
    (a one-element stand-in when there is none); checks named after fn."""
    import cupy as cp

    half_mode = half_mode_of(fn, half_out, half_dtype, n)
    if half_out is not None and not isinstance(half_out, cp.ndarray):
        raise TypeError(
            f"{fn}: half_out must be a CuPy array, got {type(half_out).__module__}.{type(half_out).__name__}"
        )
    if decay_bounds is None:
        key = (params.device.id, n)
        if key not in _DEFAULT_TABLES:
            _DEFAULT_TABLES[key] = (cp.asarray(np.array([0, n], np.int64)), cp.ones(1, cp.uint8))
        bounds, flags = _DEFAULT_TABLES[key]
    else:
        check_table(fn, decay_bounds, n, _is_host)
        bounds, flags = decay_bounds
        if _is_host(bounds):  # a NumPy table: copy it to the GPU (build it there once with decay_table instead)
            bounds = cp.asarray(np.ascontiguousarray(bounds, dtype=np.int64))
        if _is_host(flags):
            flags = cp.asarray(np.ascontiguousarray(np.asarray(flags) != 0, dtype=np.uint8))
    if half_mode == HALF_NONE:
        key = (params.device.id, "half")
        if key not in _DEFAULT_TABLES:
            _DEFAULT_TABLES[key] = cp.zeros(1, cp.uint16)  # never written (half_mode 0)
        half_bits = _DEFAULT_TABLES[key]
    else:
        half_bits = half_out.view(cp.uint16)
    return bounds, flags, half_bits, np.int32(half_mode)


def adamw_step(
    params,
    grads,
    m,
    v,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    step,
    decay_bounds=None,
    grad_scale=1.0,
    half_out=None,
    half_dtype=None,
    version="v2",
    threads=256,
    m_scale=None,
    v_scale=None,
):
    """One AdamW step in place on CuPy arrays: params, m, v updated, grads zeroed (all float32 (n,)).

    step: the step count t after increment (>= 1). decay_bounds: None (decay everything) or (bounds, flags) from
    decay_table() (CuPy arrays: int64 (k+1,), uint8 (k,); NumPy ones are copied to the GPU on every call).
    grad_scale multiplies the gradient first. half_out (n,) CuPy float16 (half_dtype="float16") or uint16
    (half_dtype="bfloat16": the bfloat16 bits) also receives the updated weights. m and v uint16 (both): bf16
    moments (adamw_bf16_moments_v2, version "v2" only). m int8 and v uint8 with m_scale, v_scale float32
    (ceil(n / 256),): block-wise 8-bit moments, updated in place with their scales (adamw_int8_moments_v2, version
    "v2", threads 64, 128 or 256).
    """
    fn = "adamw_step"
    buffers = (params, grads, m, v)
    check_version(fn, version, VERSIONS)
    threads, n, moments = _check_threads_and_buffers(fn, threads, buffers)
    if moments == MOMENTS_BF16:
        check_bf16_moments_version(fn, version)
    check_int8_moments(fn, moments, n, m_scale, v_scale, version, threads, _check_cupy)
    check_hyper(fn, lr, beta1, beta2, eps, weight_decay, step, grad_scale)
    table = _table_and_half(fn, params, n, decay_bounds, half_out, half_dtype)
    if n == 0:
        return
    s = host_scalars(lr, beta1, beta2, eps, weight_decay, step, grad_scale)
    blocks = min((n + threads - 1) // threads, MAX_BLOCKS)
    grid, block, nn = (blocks,), (threads,), np.int64(n)
    if moments == MOMENTS_INT8:  # one thread block per quantisation block, grid-stride over the blocks
        _launch_fused(
            "adamw_int8_moments_v2", _int8_grid(n), threads, (*buffers, m_scale, v_scale), table, n, _fused_scalars(s)
        )
        return
    if moments == MOMENTS_BF16:
        _launch_fused("adamw_bf16_moments_v2", grid, threads, buffers, table, n, _fused_scalars(s))
        return
    if version == "v3" and not _float4_ok(n, buffers):
        version = "v2"  # float4 needs whole, aligned groups of 4: the scalar kernel does the same work
    if version == "v3":  # float4 loads and stores: a thread per group of 4 elements
        _launch_fused("adamw_step_v3", _float4_grid(n, threads), threads, buffers, table, n, _fused_scalars(s))
    elif version == "v2":
        _launch_fused("adamw_step_v2", grid, threads, buffers, table, n, _fused_scalars(s))
    else:  # v1: five launches, each a full pass over its buffers
        bounds, flags, half_bits, mode = table
        _kernel("adamw_step_v1_decay")(grid, block, (params, grads, bounds, flags, nn, s["lr_wd"], s["grad_scale"]))
        _kernel("adamw_step_v1_m")(grid, block, (grads, m, nn, s["beta1"], s["one_minus_beta1"]))
        _kernel("adamw_step_v1_v")(grid, block, (grads, v, nn, s["beta2"], s["one_minus_beta2"]))
        _kernel("adamw_step_v1_update")(
            grid, block, (params, m, v, half_bits, mode, nn, s["lr"], s["bias1"], s["bias2"], s["eps"])
        )
        _kernel("adamw_step_v1_zero")(grid, block, (grads, nn))


def adamw_step_device(
    params,
    grads,
    m,
    v,
    hyper,
    sumsq,
    beta1,
    beta2,
    eps,
    decay_bounds=None,
    half_out=None,
    half_dtype=None,
    threads=256,
    m_scale=None,
    v_scale=None,
):
    """adamw_step (v3's float4 pass; v2's scalar pass is not offered) with lr, weight decay, the step count, the loss
    scale and the clip threshold read from `hyper` (contracts.adamw.adamw_hyper(), copied to the GPU) and the
    squared gradient norm from `sumsq` (grad_sumsq): nothing in the launch changes from step to step, so a CUDA graph
    can replay it. Needs n % 4 == 0 and 16-byte aligned buffers (ValueError otherwise). m and v uint16 (both): bf16
    moments, adamw_bf16_moments_device_v2 (one element per thread per step: any n). m int8, v uint8 with m_scale,
    v_scale: block-wise 8-bit moments, adamw_int8_moments_device_v2 (any n)."""
    fn = "adamw_step_device"
    buffers = (params, grads, m, v)
    threads, n, moments = _check_threads_and_buffers(fn, threads, buffers)
    check_int8_moments(fn, moments, n, m_scale, v_scale, "v2", threads, _check_cupy)
    check_device_args(fn, n, hyper, sumsq, _check_cupy)
    check_hyper(fn, 1e-3, beta1, beta2, eps, 0.0, 1, 1.0)
    f = np.float32
    scalars = (hyper, sumsq, f(beta1), f(1.0 - beta1), f(beta2), f(1.0 - beta2), f(eps))
    if moments == MOMENTS_INT8:
        table = _table_and_half(fn, params, n, decay_bounds, half_out, half_dtype)
        if n:
            _launch_fused(
                "adamw_int8_moments_device_v2", _int8_grid(n), threads, (*buffers, m_scale, v_scale), table, n, scalars
            )
        return
    if moments == MOMENTS_BF16:
        table = _table_and_half(fn, params, n, decay_bounds, half_out, half_dtype)
        if n:
            grid = (min((n + threads - 1) // threads, MAX_BLOCKS),)
            _launch_fused("adamw_bf16_moments_device_v2", grid, threads, buffers, table, n, scalars)
        return
    if not _float4_ok(n, buffers):
        raise ValueError(
            f"{fn}: the float4 kernel needs n % 4 == 0 (n = {n}) and 16-byte aligned buffers; use adamw_step"
        )
    table = _table_and_half(fn, params, n, decay_bounds, half_out, half_dtype)
    if n == 0:
        return
    _launch_fused("adamw_step_v4", _float4_grid(n, threads), threads, buffers, table, n, scalars)


def grad_sumsq(flat, out, blocks=SUMSQ_BLOCKS):
    """out[0] = sum of flat[i]^2 (flat float32 (n,), out float32 (1,), CuPy): the squared global gradient norm, in
    two deterministic stages (block partials into scratch, then one block adds them in a fixed order)."""
    import cupy as cp

    from gpullm_lessons.runtime import hip

    fn = "grad_sumsq"
    if not hasattr(flat, "shape") or len(flat.shape) != 1:
        raise ValueError(f"{fn}: flat must be a 1-D float32 array, got shape {getattr(flat, 'shape', None)}")
    _check_cupy(fn, "flat", flat, flat.shape, "float32")
    _check_cupy(fn, "out", out, (1,), "float32")
    n = int(flat.shape[0])
    blocks = max(1, min(int(blocks), (n + SUMSQ_THREADS - 1) // SUMSQ_THREADS))
    partial = cp.empty(blocks, cp.float32)
    hip.kernel("adamw", "grad_sumsq_partials")((blocks,), (SUMSQ_THREADS,), (flat, partial, np.int64(n)))
    hip.kernel("adamw", "grad_sumsq_reduce")((1,), (1024,), (partial, out, np.int32(blocks)))
