"""The Numba backend: launchers from kernels/numba/<op>.py (a GPU, or the simulator on a laptop).

Every launcher has the op's destination-passing signature plus ``version=``; ``versions(op)`` lists the versions
that can run here (GPU-only versions, which use warp intrinsics, are left out under the simulator).
"""

from .. import device
from ._collect import collect, numbered

_LAUNCHERS, _OWNERS = collect("gpullm_lessons.kernels.numba")
globals().update(_LAUNCHERS)
__all__ = sorted(_LAUNCHERS) + ["versions"]


def versions(op: str) -> list:
    """Versions of `op`'s backward (e.g. 'softmax'; or its step: 'adamw') runnable on this machine, in order."""
    mod = _OWNERS.get(f"{op}_backward") or _OWNERS.get(f"{op}_step")  # adamw: adamw_step
    if mod is None:
        return []
    names = numbered(getattr(mod, "VERSIONS", None) or mod.KERNELS)
    gpu_only = getattr(mod, "GPU_ONLY", set())
    return [v for v in names if device.numba_on_gpu() or v not in gpu_only]
