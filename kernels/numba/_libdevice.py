"""numba.cuda.libdevice, or under the CUDA simulator a NumPy stand-in for the few bit functions the kernels use.

Kernels that read float bits (the bf16/fp16 copies in adamw.py, convert.py) call libdevice.float_as_int,
int_as_float and float2half_rn, and adamw.py's int8 moments rintf (round to nearest, ties to even): real libdevice on
a GPU (and when compiling to PTX), NumPy in the simulator.
"""
import numpy as np
from numba import config

if config.ENABLE_CUDASIM:
    class libdevice:  # noqa: N801 - the simulator's stand-in for numba.cuda.libdevice (NumPy does the bits)
        @staticmethod
        def float_as_int(x):
            return np.float32(x).view(np.uint32)      # the float32 bits (unsigned here; cast to uint32 anyway)

        @staticmethod
        def int_as_float(x):
            return np.uint32(x).view(np.float32)      # the float32 with these bits

        @staticmethod
        def rintf(x):
            return np.rint(np.float32(x))                     # round to nearest, ties to even, as the GPU

        @staticmethod
        def float2half_rn(x):
            with np.errstate(over="ignore"):                  # beyond 65504 rounds to inf, as on the GPU
                return np.float16(np.float32(x)).view(np.uint16)   # round to nearest even, as the GPU
else:
    from numba.cuda import libdevice  # noqa: F401
