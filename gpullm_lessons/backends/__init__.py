"""Op launchers per backend, with the same names and destination-passing signatures in each.

    numpy  the reference ops in destination-passing form (CPU)
    numba  Numba CUDA kernels from kernels/numba (a GPU, or the simulator)
    hip    portable HIP/CUDA C++ kernels from kernels/hip, launched through CuPy (a GPU)

The model (later lessons) is handed one backend and never branches on which one it has.
"""
