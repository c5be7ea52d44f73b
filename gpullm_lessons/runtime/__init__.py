"""Where the course's code runs and how a kernel gets there (the device itself: gpullm_lessons.device).

    arrays   arrays moved between NumPy and the backend a learner's function works on
    hip      the HIP/CUDA C++ loader: kernels/hip sources compiled (NVRTC, hipcc) and launched through CuPy; the
             portability lint
    sm90     NVIDIA Hopper's kernels/sm90 (wgmma, flash attention v7): compiled with NVRTC to sm_90a cubins, loaded
             into CuPy
    blas     matrix products through cuBLAS / hipBLAS
    blaslt   matrix products with their epilogues (bias, GELU, the bias gradient): cuBLASLt through nvmath-python
    simwarp  warp shuffles and votes for Numba's CUDA simulator
    doctor   `python -m gpullm_lessons doctor`: one line per check of this installation, each with its fix
"""
