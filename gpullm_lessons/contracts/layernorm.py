"""layernorm's contract: the checks of layernorm_forward / layernorm_backward's arguments (float32 arrays of the
shapes the rows give, C-contiguous) and block sizes, shared by kernels/numba/layernorm.py and
gpullm_lessons/backends/hip/layernorm.py (cupy=True: CuPy arrays, cupy in the hints)."""

import numpy as np

from gpullm_lessons.contracts import MAX_THREADS, check_shape


def _c_contiguous(x) -> bool:
    expected = x.dtype.itemsize
    for dim, stride in zip(reversed(x.shape), reversed(x.strides)):
        if dim > 1 and stride != expected:
            return False
        expected *= dim
    return True


def _what(cupy):
    return "a CuPy array" if cupy else "an array (NumPy, CuPy or Numba device array)"


def check_array(fn, name, x, shape, cupy=False):
    """ValueError/TypeError naming the argument, the shape/dtype got and the one expected.
    cupy=True: the HIP wrappers' flavour (CuPy arrays: .flags, cupy in the hints)."""
    if not (hasattr(x, "shape") and hasattr(x, "dtype") and hasattr(x, "flags" if cupy else "strides")):
        raise TypeError(f"{fn}: {name} must be {_what(cupy)}, got {type(x).__name__}")
    check_shape(fn, name, x, shape)
    if np.dtype(x.dtype) != np.float32:
        raise TypeError(f"{fn}: {name} has dtype {x.dtype}, expected float32 (these kernels compute in float32)")
    if not (x.flags.c_contiguous if cupy else _c_contiguous(x)):
        raise ValueError(
            f"{fn}: {name} of shape {tuple(x.shape)} must be C-contiguous "
            f"({'cupy' if cupy else 'np'}.ascontiguousarray)"
        )


def _address(x) -> int:
    """The address of an array's first element (NumPy, CuPy or Numba device array)."""
    if isinstance(x, np.ndarray):
        return x.__array_interface__["data"][0]
    return x.__cuda_array_interface__["data"][0]


def check_residual(fn, N, C, residual, dinp, cupy=False):
    """layernorm_backward's residual: (N, C) float32 like dinp, and another array than dinp (the kernels read it
    while they write dinp)."""
    check_array(fn, "residual", residual, (N, C), cupy=cupy)
    if _address(residual) == _address(dinp):
        raise ValueError(f"{fn}: residual must be another array than dinp (dinp is written while residual is read)")


def check_half_copy(fn, N, C, dinp_half, half, residual, cupy=False):
    """layernorm_backward's dinp_half: half "bf16" or "fp16", given with a residual (the kernels that write the copy
    are the residual's), uint16 of shape (N, C), C-contiguous."""
    from gpullm_lessons.contracts import check_array as check_typed

    if half not in ("bf16", "fp16"):
        raise ValueError(f"{fn}: dinp_half needs half='bf16' or 'fp16' (its format), got {half!r}")
    if residual is None:
        raise ValueError(f"{fn}: dinp_half is written with a residual (the residual stream's gradient); pass residual=")
    check_typed(fn, "dinp_half", dinp_half, (N, C), "uint16", cupy=cupy)


def check_rows(fn, inp, cupy=False):
    """(N, C) from inp, which must be a non-empty 2-D array."""
    if not hasattr(inp, "shape"):
        raise TypeError(f"{fn}: inp must be {_what(cupy)}, got {type(inp).__name__}")
    if len(inp.shape) != 2 or inp.shape[0] < 1 or inp.shape[1] < 1:
        raise ValueError(
            f"{fn}: inp has shape {tuple(inp.shape)}, expected (N, C) with N, C >= 1 (flatten (B, T, C) to (B*T, C))"
        )
    return int(inp.shape[0]), int(inp.shape[1])


def check_block(fn, version, threads):
    """threads per block: an int in 1..MAX_THREADS, a power of two for v2 (tree reduction). Returns it as an int."""
    if not isinstance(threads, (int, np.integer)) or not 1 <= threads <= MAX_THREADS:
        raise ValueError(f"{fn}: threads={threads!r}, expected an int in 1..{MAX_THREADS}")
    if version == "v2" and threads & (threads - 1):
        raise ValueError(f"{fn}: threads={threads} must be a power of two for v2 (tree reduction)")
    return int(threads)
