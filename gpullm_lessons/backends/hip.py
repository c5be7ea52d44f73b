"""The HIP backend: launchers for kernels/hip/<op>.cu through CuPy (NVIDIA through NVRTC, AMD through hiprtc).

Same names and signatures as the Numba backend, on CuPy arrays. ``versions(op)`` lists each op's versions,
including the library fast paths ("cublas": CuPy matmul, i.e. cuBLAS or hipBLAS) where an op has one.
Importing this module needs no GPU; calling a launcher does.
"""
from ._collect import collect

_LAUNCHERS, _OWNERS = collect("gpullm_lessons.backends", prefix="_hip_")
globals().update(_LAUNCHERS)
__all__ = sorted(_LAUNCHERS) + ["versions"]


def versions(op: str) -> list:
    """Versions of `op`'s backward (e.g. 'softmax'; or its step: 'adamw'), in order."""
    mod = _OWNERS.get(f"{op}_backward") or _OWNERS.get(f"{op}_step")   # adamw: adamw_step
    return list(getattr(mod, "VERSIONS", ())) if mod is not None else []
