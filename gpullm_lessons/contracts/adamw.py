"""adamw's contract: the checks of adamw_step / adamw_step_device / grad_sumsq's arguments, the half-copy modes, the
host-side scalars and adamw_hyper (the device step's hyperparameter array), shared by kernels/numba/adamw.py (its
docstring has the math) and gpullm_lessons/backends/hip/adamw.py. Every `check_array` argument is a flavour of
gpullm_lessons.contracts.check_array (cupy=True for the HIP launchers)."""

import math

import numpy as np

HALF_NONE, HALF_FP16, HALF_BF16 = 0, 1, 2  # half_mode: which half-precision copy to write
HYPER_LEN = 6  # adamw_hyper(): lr, lr * weight_decay, 1 - beta1^t, 1 - beta2^t, 1 / loss_scale, clip


def check_hyper(fn, lr, beta1, beta2, eps, weight_decay, step, grad_scale):
    """The scalar arguments, as torch.optim.AdamW checks them; ValueError/TypeError naming the argument."""
    for name, x in (
        ("lr", lr),
        ("beta1", beta1),
        ("beta2", beta2),
        ("eps", eps),
        ("weight_decay", weight_decay),
        ("grad_scale", grad_scale),
    ):
        if isinstance(x, bool) or not isinstance(x, (int, float, np.integer, np.floating)):
            raise TypeError(f"{fn}: {name} must be a number, got {type(x).__name__}")
        if not math.isfinite(float(x)):
            raise ValueError(f"{fn}: {name} must be finite, got {x}")
    if lr < 0:
        raise ValueError(f"{fn}: lr must be >= 0, got {lr}")
    for name, b in (("beta1", beta1), ("beta2", beta2)):
        if not 0.0 <= b < 1.0:
            raise ValueError(f"{fn}: {name} must be in [0, 1), got {b}")
    if eps < 0:
        raise ValueError(f"{fn}: eps must be >= 0, got {eps}")
    if weight_decay < 0:
        raise ValueError(f"{fn}: weight_decay must be >= 0, got {weight_decay}")
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
        raise TypeError(f"{fn}: step must be an int (the step count t after increment), got {type(step).__name__}")
    if step < 1:
        raise ValueError(f"{fn}: step must be >= 1 (the step count t after increment: 1 on the first step), got {step}")


def check_buffers(fn, names, arrays, check_array):
    """params, grads, m, v: 1-D float32 of one length n (check_array: _args.check_array or a CuPy flavour)."""
    first = arrays[0]
    if not hasattr(first, "shape") or len(first.shape) != 1:
        raise ValueError(
            f"{fn}: {names[0]} must be 1-D (n,), got shape {tuple(getattr(first, 'shape', ()))}; "
            f"use the flat buffer (ParamBuffer.flat)"
        )
    n = int(first.shape[0])
    for name, a in zip(names, arrays):
        check_array(fn, name, a, (n,), "float32")
    return n


MOMENTS_F32, MOMENTS_BF16, MOMENTS_INT8 = "fp32", "bf16", "int8"  # how m and v are stored (see below)
# the dtype of v for each dtype of m: float32 moments; bfloat16 bits in uint16; block-wise 8 bits (m int8, v uint8
# holding sqrt(v), plus one float32 scale per block of each: gpullm_lessons.model.quant's format)
_MOMENT_DTYPES = {
    "float32": ("float32", MOMENTS_F32),
    "uint16": ("uint16", MOMENTS_BF16),
    "int8": ("uint8", MOMENTS_INT8),
}
INT8_BLOCK = 256  # values per quantisation block of int8 moments: quant.BLOCK (tests/test_optimizer_state_int8.py)
INT8_THREADS = (64, 128, 256)  # threads per block of the int8-moment kernels: one thread block per quantisation
# block (at most INT8_BLOCK threads), whole 64-lane wavefronts (AMD; the HIP max is warp_max), a power of two (the
# Numba max is a shared-memory tree)


def check_moment_buffers(fn, names, arrays, check_array):
    """params, grads (1-D float32, one length n) and m, v: both float32, both uint16 holding bfloat16 bits (the
    bf16-moment kernels), or m int8 and v uint8 (block-wise 8-bit moments, with their scales: check_int8_moments).
    Returns (n, MOMENTS_F32, MOMENTS_BF16 or MOMENTS_INT8); errors name the argument and the choices."""
    n = check_buffers(fn, names[:2], arrays[:2], check_array)
    m = arrays[2]
    dt = str(getattr(m, "dtype", ""))
    if dt not in _MOMENT_DTYPES:
        if not (hasattr(m, "shape") and hasattr(m, "dtype")):
            check_array(fn, names[2], m, (n,), "float32")  # not an array: the usual message
        raise TypeError(
            f"{fn}: {names[2]} has dtype {dt}, expected float32 (fp32 moments) or uint16 (the bits of bf16 moments), "
            f"or int8 with {names[3]} uint8 (block-wise 8-bit moments, with m_scale and v_scale)"
        )
    v_dt, moments = _MOMENT_DTYPES[dt]
    check_array(fn, names[2], m, (n,), dt)
    check_array(fn, names[3], arrays[3], (n,), v_dt)
    return n, moments


def check_bf16_moments_version(fn, version):
    """bf16 moments run the fused one-pass kernel only (v2's loop): the version must be 'v2'."""
    if version != "v2":
        raise ValueError(
            f"{fn}: m and v hold bf16 moments (uint16): they run the fused one-pass kernel, version='v2' "
            f"(got version={version!r})"
        )


def int8_blocks(n: int) -> int:
    """How many quantisation blocks (and scales per moment) n values of int8 moments have: ceil(n / INT8_BLOCK)."""
    return -(-int(n) // INT8_BLOCK)


def check_int8_moments(fn, moments, n, m_scale, v_scale, version, threads, check_array):
    """The int8-moment arguments: m_scale and v_scale float32 (int8_blocks(n),) exactly when m, v are int8 / uint8,
    version 'v2' (the one fused kernel), threads one of INT8_THREADS. No-op for other moments except that scales
    given without int8 moments are an error."""
    if moments != MOMENTS_INT8:
        if m_scale is not None or v_scale is not None:
            raise ValueError(
                f"{fn}: m_scale / v_scale belong to block-wise 8-bit moments (m int8, v uint8); "
                f"m and v here hold {moments} moments"
            )
        return
    if m_scale is None or v_scale is None:
        missing = " and ".join(k for k, a in (("m_scale", m_scale), ("v_scale", v_scale)) if a is None)
        raise ValueError(
            f"{fn}: m int8 and v uint8 are block-wise 8-bit moments: pass their per-block scales "
            f"(missing {missing}: float32 ({int8_blocks(n)},), one per block of {INT8_BLOCK} values)"
        )
    for name, a in (("m_scale", m_scale), ("v_scale", v_scale)):
        check_array(fn, name, a, (int8_blocks(n),), "float32")
    if version != "v2":
        raise ValueError(
            f"{fn}: m and v hold block-wise 8-bit moments (int8 / uint8): they run the fused one-pass kernel, "
            f"version='v2' (got version={version!r})"
        )
    if threads not in INT8_THREADS:
        raise ValueError(
            f"{fn}: threads={threads}: the int8-moment kernel runs one quantisation block of {INT8_BLOCK} values per "
            f"thread block, in whole 64-lane wavefronts, its max a power-of-two tree: threads must be one of "
            f"{', '.join(map(str, INT8_THREADS))}"
        )


def half_mode_of(fn, half_out, half_dtype, n):
    """(half_mode, the dtype half_out must have) from half_out / half_dtype; errors name the argument."""
    if half_out is None:
        if half_dtype is not None:
            raise ValueError(f"{fn}: half_dtype={half_dtype!r} given without half_out")
        return HALF_NONE
    dt = str(half_out.dtype)
    if half_dtype is None:  # infer it from half_out's dtype where that is unambiguous
        half_dtype = {"float16": "float16", "bfloat16": "bfloat16"}.get(dt)
        if half_dtype is None:
            raise ValueError(f"{fn}: half_out has dtype {dt}: pass half_dtype='float16' or 'bfloat16'")
    if half_dtype not in ("float16", "bfloat16"):
        raise ValueError(f"{fn}: half_dtype must be 'float16' or 'bfloat16', got {half_dtype!r}")
    allowed = ("float16", "uint16") if half_dtype == "float16" else ("bfloat16", "uint16")
    if dt not in allowed:
        raise TypeError(f"{fn}: half_out has dtype {dt}, expected {' or '.join(allowed)} for half_dtype={half_dtype!r}")
    if tuple(half_out.shape) != (n,):
        raise ValueError(f"{fn}: half_out has shape {tuple(half_out.shape)}, expected {(n,)} (the shape of params)")
    return HALF_FP16 if half_dtype == "float16" else HALF_BF16


def check_table(fn, decay_bounds, n, is_host):
    """decay_bounds = (bounds (k+1,), flags (k,)); values checked where they are NumPy arrays (no device sync)."""
    if not (isinstance(decay_bounds, (tuple, list)) and len(decay_bounds) == 2):
        raise TypeError(
            f"{fn}: decay_bounds must be None or a pair (bounds, flags) as decay_table() returns, "
            f"got {type(decay_bounds).__name__}"
        )
    bounds, flags = decay_bounds
    for name, a in (("decay_bounds[0] (bounds)", bounds), ("decay_bounds[1] (flags)", flags)):
        if not hasattr(a, "shape") or len(a.shape) != 1:
            raise ValueError(f"{fn}: {name} must be a 1-D array, got shape {tuple(getattr(a, 'shape', ()))}")
    if int(bounds.shape[0]) != int(flags.shape[0]) + 1 or int(flags.shape[0]) < 1:
        raise ValueError(
            f"{fn}: decay_bounds: bounds has shape {tuple(bounds.shape)}, expected "
            f"({int(flags.shape[0]) + 1},) (one more than flags {tuple(flags.shape)}, at least 1 tensor)"
        )
    if is_host(bounds):
        b = np.asarray(bounds)
        if not np.issubdtype(b.dtype, np.integer):
            raise TypeError(f"{fn}: decay_bounds: bounds has dtype {b.dtype}, expected an integer dtype")
        if b[0] != 0 or b[-1] != n or np.any(np.diff(b) < 0):
            raise ValueError(
                f"{fn}: decay_bounds: bounds must rise from 0 to n={n} (the length of params), got {b[0]} .. {b[-1]}"
            )
    else:
        if str(bounds.dtype) != "int64":
            raise TypeError(f"{fn}: decay_bounds: bounds has dtype {bounds.dtype}, expected int64")
        if str(flags.dtype) != "uint8":
            raise TypeError(f"{fn}: decay_bounds: flags has dtype {flags.dtype}, expected uint8")


def host_scalars(lr, beta1, beta2, eps, weight_decay, step, grad_scale):
    """The float32 scalars the kernels take; products and bias corrections computed in float64 on the host."""
    f = np.float32
    return dict(
        lr=f(lr),
        lr_wd=f(lr * weight_decay),
        beta1=f(beta1),
        one_minus_beta1=f(1.0 - beta1),
        beta2=f(beta2),
        one_minus_beta2=f(1.0 - beta2),
        bias1=f(1.0 - beta1**step),
        bias2=f(1.0 - beta2**step),
        eps=f(eps),
        grad_scale=f(grad_scale),
    )


def adamw_hyper(lr, weight_decay, step, beta1, beta2, clip=0.0, loss_scale=1.0) -> np.ndarray:
    """The float32 (6,) array adamw_step_device reads: lr, lr * weight_decay, the bias corrections 1 - beta^t (in
    float64 on the host), 1 / loss_scale and the clip threshold (0: no clipping). Copy it to the GPU before each step."""
    fn = "adamw_hyper"
    check_hyper(fn, lr, beta1, beta2, 1e-8, weight_decay, step, 1.0)
    for name, x in (("clip", clip), ("loss_scale", loss_scale)):
        if not isinstance(x, (int, float, np.floating, np.integer)) or isinstance(x, bool) or not math.isfinite(x):
            raise TypeError(f"{fn}: {name} must be a finite number, got {x!r}")
    if clip < 0:
        raise ValueError(f"{fn}: clip must be >= 0 (0: no clipping), got {clip}")
    if loss_scale <= 0:
        raise ValueError(f"{fn}: loss_scale must be > 0, got {loss_scale}")
    return np.array([lr, lr * weight_decay, 1.0 - beta1**step, 1.0 - beta2**step, 1.0 / loss_scale, clip], np.float32)


def check_device_args(fn, n, hyper, sumsq, check_array):
    """hyper float32 (HYPER_LEN,) and sumsq float32 (1,) on the device of the buffers."""
    check_array(fn, "hyper", hyper, (HYPER_LEN,), "float32")
    check_array(fn, "sumsq", sumsq, (1,), "float32")
