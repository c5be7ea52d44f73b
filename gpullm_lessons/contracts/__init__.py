"""The launchers' contracts: argument checks shared by the launch wrappers of both backends, the Numba ones
(kernels/numba/<op>.py) and the HIP ones (gpullm_lessons/backends/hip/<op>.py, which take CuPy arrays only). It sits
below both: kernels and backends import it, it imports neither (nothing of the course but itself; NumPy at most).

This module holds the checks every op uses; `contracts/<op>.py` holds one op's contract (its argument checks, the
constants and host-side helpers both launchers share, none of them a kernel): adamw, attention, convert, crossentropy,
encoder, fused, layernorm, linear.

Each check raises TypeError (not an array, wrong dtype) or ValueError (wrong shape, not C-contiguous, bad launch
setting) with a message that starts with the wrapper's name and names the argument. `cupy=True` is the HIP flavour:
the array must be a CuPy array (checked first) and the hints name cupy instead of NumPy. Importing this module needs
neither cupy nor a GPU (CuPy arrays are recognised by their type's module).
"""

from __future__ import annotations

import numpy as np

MAX_THREADS = 1024  # threads per block, on every GPU these lessons target


def shape_of(x) -> tuple:
    """x.shape as a tuple of Python ints (Numba device arrays, CuPy and NumPy arrays alike)."""
    return tuple(int(s) for s in x.shape)


def is_cupy(x) -> bool:
    """Whether x is a CuPy object (GPU memory), without importing cupy."""
    return (type(x).__module__ or "").startswith("cupy")


def check_shape(fn, name, a, shape):
    """ValueError naming the argument when a.shape is not `shape`."""
    if tuple(a.shape) != tuple(shape):
        raise ValueError(f"{fn}: {name} has shape {tuple(a.shape)}, expected {tuple(shape)}")


def check_array(fn, name, a, shape, dtype, cupy=False):
    """An array of `shape` and `dtype` (a name: "float32", "int32"), C-contiguous; TypeError/ValueError naming the
    argument, the shape/dtype it has and the one expected. cupy=True: a CuPy array (the HIP wrappers)."""
    if cupy:
        if not is_cupy(a):
            raise TypeError(
                f"{fn}: {name} must be a CuPy array (the HIP kernels run on the GPU), "
                f"got {type(a).__module__}.{type(a).__name__}"
            )
    elif not hasattr(a, "shape") or not hasattr(a, "dtype"):
        raise TypeError(f"{fn}: {name} must be an array (NumPy, CuPy or Numba device array), got {type(a).__name__}")
    check_shape(fn, name, a, shape)
    if str(a.dtype) != dtype:
        raise TypeError(f"{fn}: {name} has dtype {a.dtype}, expected {dtype}")
    if not (a.flags.c_contiguous if cupy else a.flags["C_CONTIGUOUS"]):
        raise ValueError(f"{fn}: {name} must be C-contiguous ({'cupy' if cupy else 'np'}.ascontiguousarray)")


def check_version(fn, version, versions):
    """ValueError when version is not one of `versions`."""
    if version not in versions:
        raise ValueError(f"{fn}: version={version!r} is not one of {', '.join(versions)}")


def check_threads(fn, threads, max_threads=MAX_THREADS) -> int:
    """threads per block as an int in [1, max_threads]; ValueError otherwise."""
    threads = int(threads)
    if not 1 <= threads <= max_threads:
        raise ValueError(f"{fn}: threads={threads} must be in [1, {max_threads}]")
    return threads


def check_cupy_args(fn, names, arrays, ndim):
    """CuPy, float32, C-contiguous, `ndim` dims, all of one shape (the HIP softmax / gelu launchers' arguments);
    TypeError/ValueError naming the argument."""
    for name, a in zip(names, arrays):
        if not is_cupy(a):
            raise TypeError(
                f"{fn}: {name} must be a CuPy array (HIP kernels read GPU memory), "
                f"got {type(a).__module__}.{type(a).__name__}"
            )
        if a.dtype != np.float32:
            raise TypeError(f"{fn}: {name} must be float32, got dtype {a.dtype}")
        if not a.flags.c_contiguous:
            raise ValueError(f"{fn}: {name} must be C-contiguous (use cupy.ascontiguousarray)")
    first = arrays[0]
    if first.ndim != ndim:
        raise ValueError(f"{fn}: {names[0]} must be {ndim}-D, got shape {first.shape}")
    for name, a in zip(names[1:], arrays[1:]):
        if a.shape != first.shape:
            raise ValueError(f"{fn}: {name} has shape {a.shape}, expected {first.shape} (the shape of {names[0]})")
