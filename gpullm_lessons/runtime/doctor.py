"""`python -m gpullm_lessons doctor`: one [OK]/[FAIL]/[SKIP] line per check, each with the fix.

FAIL means something a lesson needs on this machine is broken; SKIP means it does not apply here (no GPU, no
AMD toolchain) and says what would turn it on. Exit status: 1 if any check failed, else 0.
"""
from __future__ import annotations

import importlib
import importlib.metadata as md
import platform
import shutil
import subprocess
import sys
from dataclasses import dataclass

from .. import device

NUMPY_PIN = (2, 5)  # numpy must be < 2.5 (numba-cuda 0.30 registers np.row_stack, which 2.5 removed)


@dataclass
class Check:
    status: str  # OK | FAIL | SKIP
    name: str
    detail: str
    fix: str = ""

    def line(self) -> str:
        s = f"[{self.status}] {self.name}: {self.detail}"
        return s + (f"\n       fix: {self.fix}" if self.fix and self.status != "OK" else "")


def _version(dist: str):
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _vtuple(v: str) -> tuple:
    out = []
    for part in v.split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


def check_python() -> Check:
    v = platform.python_version()
    if sys.version_info < (3, 10):
        return Check("FAIL", "python", v, "use Python 3.10 or newer (conda env create -f environment.yml)")
    return Check("OK", "python", f"{v} ({sys.executable})")


def check_numpy() -> Check:
    v = _version("numpy")
    if v is None:
        return Check("FAIL", "numpy", "not installed", "pip install -e .")
    if _vtuple(v)[:2] >= NUMPY_PIN:
        return Check("FAIL", "numpy", f"{v} is too new: numba-cuda 0.30 fails to import beside numpy >= 2.5",
                     "pip install 'numpy<2.5'")
    return Check("OK", "numpy", f"{v} (pin: <2.5)")


def check_numba() -> list[Check]:
    nb, nbc = _version("numba"), _version("numba-cuda")
    out = []
    if nb is None or nbc is None:
        missing = " and ".join(n for n, v in (("numba", nb), ("numba-cuda", nbc)) if v is None)
        return [Check("FAIL", "numba", f"{missing} not installed", "pip install -e .")]
    try:
        from numba import cuda  # noqa: F401  (gpullm_lessons is imported, so the simulator is set first)
        out.append(Check("OK", "numba", f"numba {nb}, numba-cuda {nbc} import fine"))
    except Exception as e:  # noqa: BLE001 - report anything that stops the import
        return [Check("FAIL", "numba", f"numba {nb} / numba-cuda {nbc} fail to import: {type(e).__name__}: {e}",
                      "pip install 'numba>=0.68,<0.69' 'numba-cuda>=0.30,<0.31' 'numpy<2.5'")]
    info = device.info()
    sim_on = bool(getattr(importlib.import_module("numba").config, "ENABLE_CUDASIM", 0))
    if info.simulator and not sim_on:
        out.append(Check("FAIL", "simulator", "should be on (no NVIDIA GPU) but numba was imported before it was set",
                         "import gpullm_lessons before numba, or export NUMBA_ENABLE_CUDASIM=1"))
    elif sim_on and _version("greenlet") is None:
        from .simwarp import GREENLET_FIX, GREENLET_MISSING
        out.append(Check("FAIL", "simulator", GREENLET_MISSING, GREENLET_FIX))
    elif sim_on:
        out.append(Check("OK", "simulator", "ON: Numba kernels run on the CPU in the CUDA simulator (slow, tiny sizes)"))
    elif info.kind == "cuda":
        out.append(Check("OK", "simulator", "off: Numba kernels run on the GPU"))
    else:
        out.append(Check("SKIP", "simulator", "off (NUMBA_ENABLE_CUDASIM=0): Numba kernels cannot run here",
                         "unset NUMBA_ENABLE_CUDASIM to run them in the simulator"))
    return out


def check_gpu() -> Check:
    info = device.info()
    if info.gpu is None:
        return Check("SKIP", "gpu", f"none ({info.reason})",
                     "on a lab server: NVIDIA driver (nvidia-smi) or ROCm (rocm-smi) must list a GPU")
    g = info.gpu
    name = g.name if g.name.upper().startswith(g.vendor.upper()) else f"{g.vendor.upper()} {g.name}"
    return Check("OK", "gpu", f"{name}, {g.memory_bytes / 2**30:.1f} GiB, {g.count} device(s)")


def check_cupy() -> Check:
    dists = [d for d in ("cupy-cuda13x", "cupy-cuda12x", "cupy-rocm-7-0", "cupy") if _version(d)]
    info = device.info()
    if not dists:
        if info.has_gpu:
            extra = "rocm" if info.kind == "rocm" else "cuda13"
            return Check("FAIL", "cupy", "not installed, but a GPU is present", f"pip install -e '.[{extra}]'")
        return Check("SKIP", "cupy", "not installed (optional: HIP kernels need a GPU)",
                     "on a GPU server: pip install -e '.[cuda13]' (NVIDIA) or '.[rocm]' (AMD)")
    try:
        import cupy
    except Exception as e:  # noqa: BLE001
        return Check("FAIL", "cupy", f"{dists[0]} installed but fails to import: {e}", "reinstall the matching extra")
    backend = "ROCm" if getattr(cupy.cuda.runtime, "is_hip", False) else "CUDA"
    if not info.has_gpu:
        return Check("SKIP", "cupy", f"{dists[0]} {cupy.__version__} ({backend}) installed; no GPU to run it on")
    try:
        drv = cupy.cuda.runtime.driverGetVersion()
        n = cupy.cuda.runtime.getDeviceCount()
        (cupy.arange(4, dtype=cupy.float32) * 2).get()
    except Exception as e:  # noqa: BLE001
        return Check("FAIL", "cupy", f"{dists[0]} {cupy.__version__} ({backend}) cannot use the GPU: {e}",
                     "the CuPy build must match the driver: cuda12 extra for CUDA 12 drivers, cuda13 for CUDA 13")
    return Check("OK", "cupy", f"{dists[0]} {cupy.__version__}, backend {backend}, driver {drv}, {n} device(s)")


def check_compilers() -> list[Check]:
    out = []
    try:
        from . import hip
        ok, log = hip.compile_nvrtc("vector_add")
        out.append(Check("OK" if ok else "FAIL", "nvrtc", "compiles kernels/hip for sm_90" if ok else log[:300],
                         "pip install -e '.[dev]' (brings NVRTC and the CUDA headers)"))
        if ok:  # lesson 11's v2 on the tensor cores: <mma.h>, which needs the headers' crt/ folder (v2's bf16 part
            # of flash.cu: the whole file takes minutes, and tests/test_hip.py compiles it)
            from ..backends.hip.flash import part_options

            ok, log = hip.compile_nvrtc("flash", options=part_options("v2", "bf16"))
            out.append(Check("OK" if ok else "FAIL", "tensor-cores",
                             "kernels/hip/flash.cu (wmma tiles, v2 in bf16) compiles for sm_90" if ok else log[:300],
                             "the crt/ headers that <mma.h> includes: pip install nvidia-cuda-crt (CUDA 13; in the "
                             "cuda13 and dev extras) or nvidia-cuda-nvcc-cu12 (CUDA 12; in the cuda12 extra), or point "
                             "CUDA_HOME to a CUDA toolkit"))
    except ImportError:
        out.append(Check("SKIP", "nvrtc", "cuda-python NVRTC bindings not installed",
                         "pip install -e '.[dev]' to compile-check kernels for NVIDIA without a GPU"))
    except Exception as e:  # noqa: BLE001
        if device.info().kind == "rocm":  # the rocm extra has no NVRTC, and an AMD GPU compiles with hiprtc
            out.append(Check("SKIP", "nvrtc", f"not usable ({type(e).__name__}); not needed on an AMD GPU, where the "
                             "HIP kernels compile with hiprtc", "pip install -e '.[dev]' to compile-check for NVIDIA too"))
        else:
            out.append(Check("FAIL", "nvrtc", f"{type(e).__name__}: {e}", "pip install -e '.[dev]'"))
    nvcc = shutil.which("nvcc")
    out.append(Check("OK", "nvcc", _first_line([nvcc, "--version"], last=True)) if nvcc else
               Check("SKIP", "nvcc", "not found (NVRTC is enough)", "install the CUDA toolkit for nvcc"))
    hipcc = shutil.which("hipcc")
    out.append(Check("OK", "hipcc", _first_line([hipcc, "--version"]) + " (compile checks with HIP_PLATFORM=amd)")
               if hipcc else Check("SKIP", "hipcc", "not found: AMD compile checks are skipped",
                                   "Debian/Ubuntu: sudo apt-get install hipcc (or install ROCm)"))
    return out


def _first_line(cmd, last=False) -> str:
    try:
        env = None
        if cmd[0].endswith("hipcc"):
            import os
            env = dict(os.environ, HIP_PLATFORM="amd")
        text = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env).stdout.strip().splitlines()
        return (text[-1] if last else text[0]) if text else "found"
    except Exception:  # noqa: BLE001
        return "found"


def check_cublaslt() -> Check:
    """nvmath-python, through which runtime/blaslt.py calls cuBLASLt's matrix products with epilogues (NVIDIA)."""
    info = device.info()
    v = _version("nvmath-python")
    if info.kind != "cuda":
        return Check("SKIP", "cublaslt", f"{'nvmath-python ' + v if v else 'nvmath-python not installed'}; the "
                     "epilogues run on NVIDIA GPUs only (elsewhere the same call runs in NumPy)",
                     "on an NVIDIA GPU server: pip install -e '.[cuda13]'")
    if not v:
        return Check("FAIL", "cublaslt", "nvmath-python not installed (cuBLASLt's epilogues, runtime/blaslt.py)",
                     "pip install -e '.[cuda13]' (or '.[cuda12]')")
    try:
        from nvmath.bindings import cublasLt

        lt_version = cublasLt.get_version()
    except Exception as e:  # noqa: BLE001
        return Check("FAIL", "cublaslt", f"nvmath-python {v} cannot load cuBLASLt: {type(e).__name__}: {e}",
                     "reinstall the cuda extra that matches the driver")
    return Check("OK", "cublaslt", f"nvmath-python {v}, cuBLASLt {lt_version}")


def run_checks() -> list[Check]:
    checks = [check_python(), check_numpy()]
    checks += check_numba()
    checks.append(check_gpu())
    checks.append(check_cupy())
    checks.append(check_cublaslt())
    checks += check_compilers()
    return checks


def main(argv=None) -> int:
    info = device.info()
    print(f"gpullm_lessons doctor - device kind '{info.kind}': {info.reason}")
    checks = run_checks()
    for c in checks:
        print(c.line())
    failed = [c for c in checks if c.status == "FAIL"]
    print(f"{len(checks) - len(failed)} ok/skipped, {len(failed)} failed")
    return 1 if failed else 0
