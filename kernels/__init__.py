"""Kernel sources, shipped inside the package as ``gpullm_lessons.kernels``.

numba/<op>.py  @cuda.jit kernels, numbered versions v1..vN, each module with KERNELS and SIGNATURES
hip/<op>.cu    extern "C" __global__ kernels in the portable subset, including only hip/portable.h
"""
