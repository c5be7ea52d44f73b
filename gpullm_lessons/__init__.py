"""gpullm_lessons: the course library. Everything a notebook imports lives here.

Importing the package first decides where kernels run (see ``gpullm_lessons.device``) and, with no GPU,
switches on Numba's CUDA simulator before numba is imported anywhere. Nothing here imports numba or cupy
at import time: cupy is optional (GPU extras) and is imported lazily where it is used.
"""
from . import device as device

device.configure()

__version__ = "0.1.0"
