"""Move arrays between NumPy and the backend a learner's function works on.

Three backends, named by the ``arrays=`` argument of every checker:

numpy  plain ``np.ndarray`` on the CPU (NumPy code, and Numba kernels that take host arrays).
cupy   ``cupy.ndarray`` in GPU memory (CuPy code and raw CUDA/HIP kernels). Needs a GPU and the CuPy extra.
numba  Numba CUDA device arrays (``numba.cuda.to_device``). On a GPU they live in GPU memory; without one
       they are the CUDA simulator's stand-ins, so Numba kernels can be checked on a laptop.

cupy and numba are imported lazily, inside the functions: neither is needed to import this module.
"""
from __future__ import annotations

import numpy as np

BACKENDS = ("numpy", "cupy", "numba")


class BackendUnavailableError(RuntimeError):
    """The backend asked for cannot run on this machine (missing package or no GPU); the message says the fix."""


def _check_name(arrays) -> str:
    if not isinstance(arrays, str) or arrays not in BACKENDS:
        raise ValueError(f"arrays={arrays!r} is not a backend; use one of: " + ", ".join(repr(b) for b in BACKENDS))
    return arrays


def _cupy():
    """Import cupy, or say exactly what is missing."""
    from .. import device
    try:
        import cupy
    except ImportError as e:
        sim = " (no GPU on this machine: check Numba kernels with arrays='numba', they run in the simulator)" \
            if not device.has_gpu() else ""
        raise BackendUnavailableError(
            "arrays='cupy' needs CuPy, which is not installed: install the GPU extra that matches your "
            "machine, e.g. pip install -e '.[cuda13]' (or '.[cuda12]', '.[rocm]')" + sim) from e
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception:  # CUDARuntimeError when the driver finds nothing
        n = 0
    if n < 1:
        raise BackendUnavailableError(
            "arrays='cupy' needs a GPU, and no GPU was found on this machine: under the simulator use "
            "arrays='numba' (Numba kernels) or arrays='numpy'")
    return cupy


def _numba_cuda():
    """Import numba.cuda (the package import decides simulator or GPU first)."""
    from .. import device
    if not device.numba_available():
        raise BackendUnavailableError(
            "arrays='numba' needs a GPU or Numba's CUDA simulator, and the simulator is switched off here "
            f"({device.info().reason}); unset NUMBA_ENABLE_CUDASIM=0 / GPULLM_DEVICE=cpu, or use arrays='numpy'")
    from numba import cuda
    return cuda


def require(arrays: str) -> str:
    """Check that backend `arrays` is a known name and can run here; return the name. Raises otherwise."""
    _check_name(arrays)
    if arrays == "cupy":
        _cupy()
    elif arrays == "numba":
        _numba_cuda()
    return arrays


def to_backend(a: np.ndarray, arrays: str):
    """A copy of NumPy array `a` on backend `arrays` ('numpy' returns a contiguous copy)."""
    _check_name(arrays)
    a = np.ascontiguousarray(a)
    if arrays == "numpy":
        return a.copy()
    if arrays == "cupy":
        return _cupy().asarray(a)
    return _numba_cuda().to_device(a)


def backend_of(x) -> str:
    """'numpy' | 'cupy' | 'numba' for an array; TypeError for anything else."""
    if isinstance(x, np.ndarray):
        return "numpy"
    module = type(x).__module__ or ""
    if module.startswith("cupy"):
        return "cupy"
    if module.startswith("numba") and hasattr(x, "copy_to_host"):
        return "numba"  # numba.cuda DeviceNDArray, or the simulator's FakeCUDAArray
    raise TypeError(f"expected a NumPy, CuPy or Numba device array, got {type(x).__module__}.{type(x).__name__}")


def to_numpy(x) -> np.ndarray:
    """A NumPy copy of array `x` from any backend (waits for the GPU to finish)."""
    kind = backend_of(x)
    if kind == "numpy":
        return np.array(x, copy=True)
    if kind == "cupy":
        return x.get()
    return x.copy_to_host()
