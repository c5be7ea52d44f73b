"""gpullm_lessons: the course library. Everything a notebook imports lives here.

Importing the package first decides where kernels run (see ``gpullm_lessons.device``) and, with no GPU,
switches on Numba's CUDA simulator before numba is imported anywhere. Nothing here imports numba or cupy
at import time: cupy is optional (GPU extras) and is imported lazily where it is used.
"""
import importlib.util as _ilu
import sys as _sys
from pathlib import Path as _Path

from . import device as device

if device.configure().simulator:   # give the CUDA simulator warp shuffles (patched when numba loads it)
    from .runtime import simwarp as _simwarp
    _simwarp.install()

__version__ = "0.1.0"


def _mount_checkout_kernels():
    """An install maps the top-level kernels/ folder to ``gpullm_lessons.kernels``. Run from a plain source checkout
    (PYTHONPATH=repo, no pip install), mount it the same way so imports and kernel paths are identical."""
    if "gpullm_lessons.kernels" in _sys.modules or _ilu.find_spec("gpullm_lessons.kernels") is not None:
        return
    folder = _Path(__file__).resolve().parent.parent / "kernels"
    if not (folder / "__init__.py").exists():
        return
    spec = _ilu.spec_from_file_location("gpullm_lessons.kernels", folder / "__init__.py",
                                        submodule_search_locations=[str(folder)])
    module = _ilu.module_from_spec(spec)
    _sys.modules["gpullm_lessons.kernels"] = module
    spec.loader.exec_module(module)


_mount_checkout_kernels()
