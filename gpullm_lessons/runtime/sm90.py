"""NVIDIA-only kernels for Hopper (sm_90a) from ``kernels/sm90``: compiled with NVRTC to a cubin, loaded into CuPy.

The course's kernels live in ``kernels/hip`` and run on NVIDIA and AMD from one source (runtime/hip.py). Hopper's
warpgroup matrix product (``wgmma``) has no portable form: it is inline PTX that only the architecture-specific
target ``sm_90a`` accepts (``sm_90`` refuses it: tests/test_sm90.py shows ptxas saying so). CuPy's ``RawModule(code=...)``
compiles for the device's ``sm_90``, so these sources take another road: NVRTC compiles them here for ``sm_90a`` to a
cubin (machine code for that GPU, nothing left for the driver to compile), and ``cupy.RawModule(path=...)`` loads it.

``compile_check(name, arch)`` compiles a source without a GPU ((ok, log), the CI check); ``kernel(name, function)``
returns a ``cupy.RawKernel`` on an sm_90 GPU (H100, H200) and a clear error anywhere else. The launchers:
``wgmma_gemm(a, b)``, the building block (wgmma.cu); ``flash_forward_v7`` and ``flash_backward_v7`` (flash_v7.cu),
flash attention in the engine's packed layout, bf16, head size 64. tests/test_sm90.py checks each against NumPy's
float64 reference.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.resources
import os
import tempfile
from pathlib import Path

import numpy as np

from .. import device
from ..contracts import check_array, is_cupy
from ..contracts.flash import scale_of

ARCH = "sm_90a"
TILE = 64  # kernels/sm90/wgmma.cu: WG_TILE


class NotHopperError(RuntimeError):
    """The kernels of kernels/sm90 need an NVIDIA GPU of compute capability 9.0 (H100, H200)."""


def kernel_dir() -> Path:
    return Path(str(importlib.resources.files("gpullm_lessons.kernels") / "sm90"))


def source_path(name: str) -> Path:
    path = kernel_dir() / (name if name.endswith(".cu") else f"{name}.cu")
    if not path.exists():
        known = ", ".join(sorted(p.stem for p in kernel_dir().glob("*.cu")))
        raise FileNotFoundError(f"no sm90 kernel source {path.name} in {kernel_dir()} (known: {known})")
    return path


def compile_check(name: str, arch: str = ARCH, fast: bool = True) -> tuple[bool, str]:
    """Compile kernels/sm90/<name>.cu with NVRTC for arch without a GPU: (ok, log)."""
    from .hip import _nvrtc

    return _nvrtc(source_path(name).read_bytes(), f"{name}.cu", arch, (f"-I{kernel_dir()}",), fast=fast)


@functools.lru_cache(maxsize=None)
def cubin(name: str) -> bytes:
    """The sm_90a cubin of kernels/sm90/<name>.cu, compiled at full optimisation (raises with NVRTC's log)."""
    from .hip import _nvrtc_program

    text, opts = source_path(name).read_bytes(), (f"-I{kernel_dir()}",)  # the sources include wgmma.h
    ok, log, binary = _nvrtc_program(text, f"{name}.cu", ARCH, opts, fast=False, cubin=True)
    if not ok:
        raise RuntimeError(f"NVRTC could not compile kernels/sm90/{name}.cu for {ARCH}:\n{log}")
    return binary


def require_hopper() -> None:
    """Raise NotHopperError unless this process sees an NVIDIA GPU of compute capability 9.0."""
    if device.kind() != "cuda":
        raise NotHopperError(
            f"kernels/sm90 runs on an NVIDIA Hopper GPU (H100, H200) only; this machine: {device.kind()}"
        )
    import cupy

    cc = cupy.cuda.Device().compute_capability
    if cc != "90":
        raise NotHopperError(
            f"kernels/sm90 is compiled for sm_90a (H100, H200); this GPU is sm_{cc}: use the portable kernels"
        )


def is_hopper() -> bool:
    """Whether require_hopper() would pass: kernels/sm90 can run here (the GPU tests' skip condition)."""
    try:
        require_hopper()
    except NotHopperError:
        return False
    return True


@functools.lru_cache(maxsize=None)
def _module(name: str):
    import cupy

    binary = cubin(name)
    folder = Path(tempfile.gettempdir()) / f"gpullm_sm90_{os.getuid() if hasattr(os, 'getuid') else 0}"
    folder.mkdir(exist_ok=True)
    path = folder / f"{name}-{hashlib.sha256(binary).hexdigest()[:16]}.cubin"
    if not path.exists():
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(binary)
        tmp.replace(path)  # atomic: a process beside this one never loads half a file
    return cupy.RawModule(path=str(path))


def kernel(name: str, function: str):
    """The cupy.RawKernel `function` of kernels/sm90/<name>.cu (an sm_90 GPU only)."""
    require_hopper()
    return _module(name).get_function(function)


def _check_gemm(a, b, out, b_kn=False) -> tuple[int, int, int]:
    """(M, N, K) of wgmma_gemm's arguments, or an error that names the argument and the rule it breaks."""
    for what, x in (("a", a), ("b", b)):
        if getattr(x, "dtype", None) != np.uint16 or getattr(x, "ndim", None) != 2:
            raise TypeError(
                f"wgmma_gemm: {what} must be a 2-D array of bf16 bits (uint16), got "
                f"{type(x).__name__} {getattr(x, 'dtype', '')} {getattr(x, 'shape', '')}"
            )
        if not x.flags.c_contiguous:
            raise ValueError(f"wgmma_gemm: {what} must be C-contiguous (row-major)")
    (M, K), (N, Kb) = a.shape, (b.shape[::-1] if b_kn else b.shape)
    if K != Kb:
        which = "a's columns and b's rows" if b_kn else "their second dimensions"
        raise ValueError(f"wgmma_gemm: a is {a.shape} and b is {b.shape}: {which} (K) differ")
    for what, n in (("M", M), ("N", N), ("K", K)):
        if n <= 0 or n % TILE:
            raise ValueError(f"wgmma_gemm: {what} = {n} must be a positive multiple of {TILE} (the kernel's tile)")
    if out is not None:
        check_array("wgmma_gemm", "out", out, (M, N), "float32")
    return M, N, K


def wgmma_gemm(a, b, out=None, b_kn=False, a_regs=False):
    """C = a @ b.T in float32 through wgmma: a (M, K) and b (N, K) bf16 bits (uint16) CuPy arrays on an sm_90 GPU,
    M, N and K multiples of 64. b_kn: b is (K, N) and C = a @ b (the kernel transposes it as it stages it).
    a_regs: the products read a from registers (loaded in the fragment layout) instead of shared memory.
    out: a float32 (M, N) CuPy array to write (default: a new one)."""
    M, N, K = _check_gemm(a, b, out, b_kn)
    require_hopper()
    import cupy

    for what, x in (("a", a), ("b", b), ("out", out)):
        if x is not None and not is_cupy(x):
            raise TypeError(f"wgmma_gemm: {what} must be a CuPy array on the GPU, got {type(x).__name__}")
    if out is None:
        out = cupy.empty((M, N), dtype=cupy.float32)
    k = kernel("wgmma", "wgmma_gemm_bf16")
    args = (a, b, out, np.int32(M), np.int32(N), np.int32(K), np.int32(bool(b_kn)), np.int32(bool(a_regs)))
    k((N // TILE, M // TILE), (128,), args)
    return out


V7_HS = 64  # kernels/sm90/flash_v7.cu: the head size it is written for


def _v7_shape(qkv, nh) -> tuple[int, int, int]:
    """(B, T, C) of a v7 call's qkv, or an error naming what v7 cannot take."""
    if getattr(qkv, "ndim", None) != 3 or qkv.dtype != np.uint16:
        raise TypeError(
            f"flash v7: qkv must be (B, T, 3C) bf16 bits (uint16), got {getattr(qkv, 'dtype', '')} "
            f"{getattr(qkv, 'shape', '')}"
        )
    if not qkv.flags.c_contiguous:
        raise ValueError("flash v7: qkv must be C-contiguous")
    B, T, C3 = qkv.shape
    if nh <= 0 or C3 != 3 * nh * V7_HS:
        raise ValueError(
            f"flash v7: qkv's rows of {C3} are not 3 x {nh} heads x {V7_HS} (v7 is written for head size {V7_HS})"
        )
    if T % TILE:
        raise ValueError(f"flash v7: T = {T} must be a multiple of {TILE} (v7 walks whole tiles; v6 takes any T)")
    return B, T, C3 // 3


def _check_v7(qkv, dout, lse, delta, dqkv, nh, out=None) -> tuple[int, int, int]:
    """(B, T, C) of the backward's arguments, or an error naming the argument and the rule it breaks."""
    B, T, C = _v7_shape(qkv, nh)
    arrays = [("dout", dout, (B, T, C), "uint16"), ("lse", lse, (B, nh, T), "float32")]
    arrays += [("delta", delta, (B, nh, T), "float32"), ("dqkv", dqkv, (B, T, 3 * C), "float32")]
    arrays += [("out", out, (B, T, C), "uint16")] if out is not None else []
    for name, a, shape, dtype in arrays:
        check_array("flash v7 backward", name, a, shape, dtype)
    return B, T, C


def flash_backward_dkdv_v7(qkv, dout, lse, delta, dqkv, nh: int, scale: float | None = None):
    """dK and dV of causal attention into dqkv's k and v columns (its q columns are left as they are), through
    kernels/sm90/flash_v7.cu: the packed layout of the engine (see that file), bf16, head size 64."""
    B, T, C = _check_v7(qkv, dout, lse, delta, dqkv, nh)
    require_hopper()
    scale = scale_of(V7_HS) if scale is None else scale
    k = kernel("flash_v7", "flash_attention_backward_v7_packed_dkdv_hs64_bf16")
    k((B * nh, T // TILE), (128,), (qkv, dout, lse, delta, dqkv, np.int32(T), np.int32(nh), np.float32(scale)))
    return dqkv


def flash_backward_v7(qkv, out, dout, lse, delta, dqkv, nh: int, scale: float | None = None):
    """dq, dk and dv of causal attention into dqkv, through kernels/sm90/flash_v7.cu: the dQ kernel first (it also
    writes delta = rowsum(dout o out) into `delta` for the next), then dK dV. The packed layout of the engine (out:
    (B, T, C) bf16 bits, as the forward wrote it), bf16, head size 64, T a multiple of 64."""
    B, T, C = _check_v7(qkv, dout, lse, delta, dqkv, nh, out=out)
    require_hopper()
    scale = scale_of(V7_HS) if scale is None else scale
    k = kernel("flash_v7", "flash_attention_backward_v7_packed_dq_hs64_bf16")
    k((B * nh, T // TILE), (128,), (qkv, out, dout, lse, delta, dqkv, np.int32(T), np.int32(nh), np.float32(scale)))
    return flash_backward_dkdv_v7(qkv, dout, lse, delta, dqkv, nh, scale)


def flash_forward_v7(qkv, out, lse, nh: int, scale: float | None = None):
    """Causal attention's forward through kernels/sm90/flash_v7.cu: out (B, T, C) bf16 bits and lse (B, nh, T)
    float32 (natural log) from qkv (B, T, 3C) bf16 bits, the packed layout of the engine; head size 64, T a multiple
    of 64."""
    B, T, C = _v7_shape(qkv, nh)
    check_array("flash v7 forward", "out", out, (B, T, C), "uint16")
    check_array("flash v7 forward", "lse", lse, (B, nh, T), "float32")
    require_hopper()
    scale = scale_of(V7_HS) if scale is None else scale
    k = kernel("flash_v7", "flash_attention_forward_v7_packed_hs64_bf16")
    k((B * nh, T // TILE), (128,), (qkv, out, lse, np.int32(T), np.int32(nh), np.float32(scale)))
    return out, lse
