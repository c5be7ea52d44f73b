"""Portable HIP/CUDA C++ kernels from ``kernels/hip``: loading them into CuPy, and compiling them without a GPU.

On a GPU, ``load("vector_add")`` returns a ``cupy.RawModule`` built from ``kernels/hip/vector_add.cu``: NVRTC compiles
it on NVIDIA, hiprtc on AMD (CuPy's ROCm build), from the same source. Local ``#include "..."`` lines are expanded
into the source text before CuPy sees it, so CuPy's on-disk compile cache (keyed on the source text and options)
notices an edit of ``portable.h`` too. Modules are also cached in memory per process.

Without a GPU the sources are still compiled, to prove portability (tests/test_hip_compile.py):
``compile_nvrtc`` (NVIDIA, NVRTC from pip's CUDA wheels, sm_90), ``compile_nvcc`` and ``compile_hipcc`` (AMD,
``HIP_PLATFORM=amd hipcc --offload-arch=gfx90a --genco``).
"""
from __future__ import annotations

import functools
import importlib.resources
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from . import device

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.M)


@functools.lru_cache(maxsize=None)
def kernel_dir() -> Path:
    """The folder holding the .cu sources and portable.h (inside the installed package, or the checkout)."""
    return Path(str(importlib.resources.files("gpullm_lessons.kernels") / "hip"))


def sources() -> list[Path]:
    """Every kernel source, sorted."""
    return sorted(kernel_dir().glob("*.cu"))


def source_path(name: str) -> Path:
    path = kernel_dir() / (name if name.endswith(".cu") else f"{name}.cu")
    if not path.exists():
        known = ", ".join(p.stem for p in sources())
        raise FileNotFoundError(f"no HIP kernel source {path.name} in {kernel_dir()} (known: {known})")
    return path


def expand_includes(text: str, folder: Path | None = None, _seen=None) -> str:
    """Replace each local ``#include "x.h"`` with the file's text (once per file), recursively."""
    folder = folder or kernel_dir()
    seen = set() if _seen is None else _seen

    def repl(m):
        name = m.group(1)
        if name in seen:
            return f"// (already included: {name})"
        seen.add(name)
        path = folder / name
        if not path.exists():
            raise FileNotFoundError(f'#include "{name}": no such file in {folder}')
        body = path.read_text().replace("#pragma once", "")
        return f"// ---- begin {name} ----\n{expand_includes(body, folder, seen)}\n// ---- end {name} ----"

    return _INCLUDE.sub(repl, text)


def expanded_source(name: str) -> str:
    return expand_includes(source_path(name).read_text())


def _cupy():
    try:
        import cupy  # noqa: F401  (lazy: cupy is an optional extra)
    except ImportError as e:
        raise ImportError("HIP/CUDA kernels are launched through CuPy, which is not installed. On an NVIDIA server: "
                          "pip install '.[cuda13]' (or [cuda12]); on AMD ROCm 7: pip install '.[rocm]'.") from e
    return cupy


@functools.lru_cache(maxsize=None)
def _load(name: str, text: str, options: tuple):
    cupy = _cupy()
    return cupy.RawModule(code=text, options=("--std=c++17",) + options)


def load(name: str, options: tuple = ()):
    """The ``cupy.RawModule`` for ``kernels/hip/<name>.cu``; raises NoGPUError without a GPU."""
    device.require_gpu(f"loading the HIP kernel {name}.cu")
    return _load(name, expanded_source(name), tuple(options))


_KERNELS: dict = {}
RECHECK_S = 2.0   # a cached kernel's source files are stat()ed again at most this often (seconds)


def _stamp(name: str) -> tuple:
    folder = kernel_dir()
    headers = sorted(folder.glob("*.h"))
    return tuple(os.stat(p).st_mtime_ns for p in (source_path(name), *headers))


def kernel(name: str, function: str, options: tuple = ()):
    """One ``extern "C"`` entry point of ``kernels/hip/<name>.cu`` as a launchable CuPy kernel.

    Cached per process. An edited .cu file or header is recompiled: the cache compares the files' modification
    times, at most every RECHECK_S seconds per kernel, so that a launch costs a dictionary lookup and a clock
    read (a training step launches a few hundred kernels; stat() calls on every launch cost ~10 us each).
    """
    key = (name, function, tuple(options))
    hit = _KERNELS.get(key)
    now = time.monotonic()
    if hit is not None and now - hit[2] < RECHECK_S:
        return hit[1]
    stamp = _stamp(name)
    if hit is not None and hit[0] == stamp:
        _KERNELS[key] = (stamp, hit[1], now)
        return hit[1]
    fn = load(name, options).get_function(function)
    _KERNELS[key] = (stamp, fn, now)
    return fn


def kernel_from_source(text: str, function: str, options: tuple = ()):
    """Compile your own kernel source (a string that may `#include "portable.h"`) and return one entry point.
    Used by the exercises: learners write HIP/CUDA C++ in a notebook cell. Needs a GPU and CuPy."""
    device.require_gpu(f"running the HIP kernel {function}")
    module = _load("<notebook>", expand_includes(text), tuple(options))
    try:
        return module.get_function(function)
    except Exception as e:  # noqa: BLE001 - CuPy's message lacks the names we have
        names = re.findall(r'extern\s+"C"\s+__global__\s+void\s+(\w+)', text)
        raise LookupError(f"no kernel named {function!r} in your source (extern \"C\" __global__ entry points: "
                          f"{', '.join(names) or 'none'}): {e}") from e


def compile_source_nvrtc(text: str, arch: str = "sm_90") -> tuple[bool, str]:
    """Compile a kernel source string with NVRTC without a GPU: (ok, log). Lets a laptop check a HIP exercise compiles."""
    return _nvrtc(expand_includes(text).encode(), "notebook.cu", arch)


# ---- compiling without a GPU --------------------------------------------------------------------------------------

def nvrtc_include_dir() -> Path | None:
    """CUDA headers from pip's nvidia wheels (nvidia-cuda-runtime), or a system CUDA toolkit."""
    try:
        import nvidia  # namespace package of the pip CUDA wheels
        for base in nvidia.__path__:
            for cand in (Path(base) / "cu13" / "include", Path(base) / "cuda_runtime" / "include"):
                if (cand / "cuda_fp16.h").exists():
                    return cand
    except ImportError:
        pass
    for cand in (os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"):
        if cand and (Path(cand) / "include" / "cuda_fp16.h").exists():
            return Path(cand) / "include"
    return None


def compile_nvrtc(name: str, arch: str = "sm_90") -> tuple[bool, str]:
    """Compile with NVRTC (cuda-python bindings), as CuPy does on an NVIDIA GPU. Returns (ok, log)."""
    return _nvrtc(expanded_source(name).encode(), f"{name}.cu", arch)


def _nvrtc(text: bytes, filename: str, arch: str) -> tuple[bool, str]:
    from cuda.bindings import nvrtc  # lazy: comes with numba-cuda[cu13] / cuda-python

    err, prog = nvrtc.nvrtcCreateProgram(text, filename.encode(), 0, [], [])
    opts = [f"--gpu-architecture={arch}".encode(), b"--std=c++17"]
    inc = nvrtc_include_dir()
    if inc is not None:
        opts.append(f"-I{inc}".encode())
    (res,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    _, size = nvrtc.nvrtcGetProgramLogSize(prog)
    log = b" " * size
    nvrtc.nvrtcGetProgramLog(prog, log)
    nvrtc.nvrtcDestroyProgram(prog)
    return res == nvrtc.nvrtcResult.NVRTC_SUCCESS, log.decode(errors="replace").strip("\x00 \n")


def _run_compiler(cmd: list[str], env=None) -> tuple[bool, str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    return proc.returncode == 0, (proc.stdout + proc.stderr).strip()


def compile_nvcc(name: str, arch: str = "sm_90") -> tuple[bool, str]:
    """Compile to PTX with nvcc (if installed)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise FileNotFoundError("nvcc not found (install the CUDA toolkit, or use compile_nvrtc)")
    with tempfile.TemporaryDirectory() as tmp:
        return _run_compiler([nvcc, f"-arch={arch}", "--ptx", f"-I{kernel_dir()}", str(source_path(name)),
                              "-o", os.path.join(tmp, f"{name}.ptx")])


def compile_hipcc(name: str, arch: str = "gfx90a") -> tuple[bool, str]:
    """Compile a code object for an AMD GPU with hipcc (HIP_PLATFORM=amd), no GPU needed."""
    hipcc = shutil.which("hipcc")
    if hipcc is None:
        raise FileNotFoundError("hipcc not found (Debian/Ubuntu: apt-get install hipcc; or a ROCm install)")
    env = dict(os.environ, HIP_PLATFORM="amd")
    with tempfile.TemporaryDirectory() as tmp:
        return _run_compiler([hipcc, f"--offload-arch={arch}", "--genco", f"-I{kernel_dir()}",
                              str(source_path(name)), "-o", os.path.join(tmp, f"{name}.hsaco")], env=env)
