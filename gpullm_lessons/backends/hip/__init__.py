"""The HIP backend: launchers for kernels/hip/<op>.cu through CuPy (NVIDIA through NVRTC, AMD through hiprtc).

Each op's launchers live in gpullm_lessons/backends/hip/<op>.py (softmax.py, layernorm.py, ...); they share code only
through the loader (gpullm_lessons.runtime.hip: kernels, device properties, occupancy) and the contracts
(gpullm_lessons.contracts: argument checks), never with each other or with the Numba modules.

Same names and signatures as the Numba backend, on CuPy arrays. ``versions(op)`` lists each op's versions,
including the library fast paths ("cublas": CuPy matmul, i.e. cuBLAS or hipBLAS) where an op has one.
Importing this module needs no GPU; calling a launcher does.
"""

from .._collect import collect

_LAUNCHERS, _OWNERS = collect("gpullm_lessons.backends.hip")
globals().update(_LAUNCHERS)
__all__ = sorted(_LAUNCHERS) + ["versions", "variants"]


def versions(op: str) -> list:
    """Versions of `op`'s backward (e.g. 'softmax'; or its step: 'adamw'), in order."""
    mod = _OWNERS.get(f"{op}_backward") or _OWNERS.get(f"{op}_step")  # adamw: adamw_step
    return list(getattr(mod, "VERSIONS", ())) if mod is not None else []


def variants(launcher: str) -> list:
    """(label, keyword arguments) of a launcher's other ways to run beside its versions (a module's VARIANTS, e.g.
    flash's one-kernel backward), which the kernel benchmark times as rows of their own."""
    mod = _OWNERS.get(launcher)
    return list(getattr(mod, "VARIANTS", {}).get(launcher, [])) if mod is not None else []
