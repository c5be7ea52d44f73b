"""Portable HIP/CUDA C++ kernels from ``kernels/hip``: loading them into CuPy, and compiling them without a GPU.

On a GPU, ``load("vector_add")`` returns a ``cupy.RawModule`` built from ``kernels/hip/vector_add.cu``: NVRTC compiles
it on NVIDIA, hiprtc on AMD (CuPy's ROCm build), from the same source. Local ``#include "..."`` lines are expanded
into the source text before CuPy sees it, so CuPy's on-disk compile cache (keyed on the source text and options)
notices an edit of ``portable.h`` too. Modules are also cached in memory per process.

Without a GPU the sources are still compiled, to prove portability (tests/test_hip.py):
``compile_nvrtc`` (NVIDIA, NVRTC from pip's CUDA wheels, sm_90), ``compile_nvcc`` and ``compile_hipcc`` (AMD,
``HIP_PLATFORM=amd hipcc --offload-arch=gfx90a --genco``), and linted for portability (``lint_source``, the rules in
``LINT_RULES``: no 32-lane masks or other warp-size assumptions, no raw shuffles, no CUDA-only headers).

A learner's kernel source (the HIP exercises) is graded the same way without a GPU: ``grade_source(text, entries)``
compiles it for both vendors, checks its ``extern "C"`` entry points and lints it; ``checks.hip_compile_only`` turns
that into a verdict ("compiled" or "wrong").

The launchers (gpullm_lessons/backends/hip/<op>.py) size their grids from the device, read here once per device:
``device_properties``, ``warp_size``, ``sm_count``, and the occupancy: ``blocks_per_sm`` (the driver's calculator) and
``resident_blocks`` (an estimate from the kernel's registers).
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

import numpy as np

from .. import device

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
    extra = include_options() if device.kind() == "cuda" else ()
    return _load(name, expanded_source(name), tuple(options) + extra)


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


# ---- entry points' parameters: the launchers take each kernel's argument list from its source -----------------------

def expand_macros(code: str) -> str:
    """Function-like macros (``#define NAME(a, b) body``, continued with backslashes) expanded where a line invokes
    one: parameters substituted as whole words outside string literals (a parameter C leaves ``extern "C"`` alone),
    ``##`` pasted. Enough for the entry-point macros of kernels/hip (not a C preprocessor)."""
    code = code.replace("\\\n", " ")
    macros, lines = {}, []
    for line in code.split("\n"):
        m = re.match(r"\s*#\s*define\s+(\w+)\(([^)]*)\)(.*)", line)
        if m:
            macros[m.group(1)] = ([p.strip() for p in m.group(2).split(",")], m.group(3))
        else:
            lines.append(line)
    out = []
    for line in lines:
        m = re.match(r"\s*(\w+)\((.*)\)\s*;?\s*$", line)
        if m and m.group(1) in macros:
            params, body = macros[m.group(1)]
            args = dict(zip(params, (a.strip() for a in m.group(2).split(","))))
            body = re.sub(r'"[^"\n]*"|\b\w+\b', lambda w: args.get(w.group(0), w.group(0)), body)
            line = re.sub(r"\s*##\s*", "", body)
        out.append(line)
    return "\n".join(out)


_SIGNATURE = re.compile(r"__global__\s+(?:__launch_bounds__\s*\([^)]*\)\s+)?void\s+"
                        r"(?:__launch_bounds__\s*\([^)]*\)\s+)?(\w+)\s*\(([^)]*)\)")
# the C type of a parameter -> the NumPy dtype its argument must have (pointers: the array's dtype; scalars: the
# NumPy scalar type CuPy passes with that width). A type not listed here is not checked.
PARAM_DTYPES = {"unsigned short*": "uint16", "unsigned char*": "uint8", "float*": "float32", "int*": "int32", "unsigned int*": "uint32",
                "int": "int32", "unsigned int": "uint32", "long long": "int64", "float": "float32"}


def signatures(text: str) -> dict:
    """``{entry point: ((C type, parameter name), ...)}`` of every ``__global__`` function of a source, after its
    entry-point macros are expanded; the type without ``const`` / ``__restrict__`` (``"unsigned short*"``)."""
    code = expand_macros(_blank_comments(text))
    out = {}
    for m in _SIGNATURE.finditer(code):
        params = []
        for p in filter(None, (p.strip() for p in m.group(2).split(","))):
            p = re.sub(r"\b(?:const|__restrict__|__restrict)\b", " ", p).replace("*", " * ")
            words = p.split()
            params.append((" ".join(words[:-1]).replace(" *", "*"), words[-1]))
        out[m.group(1)] = tuple(params)
    return out


_SIGS: dict = {}


def signature(name: str, function: str) -> tuple:
    """The parameters of entry point `function` of ``kernels/hip/<name>.cu``: ((C type, name), ...), read from the
    source (cached; re-read when the file changes, as ``kernel`` recompiles)."""
    hit = _SIGS.get(name)
    now = time.monotonic()
    if hit is None or (now - hit[2] >= RECHECK_S and hit[0] != _stamp(name)):
        hit = (_stamp(name), signatures(source_path(name).read_text()), now)
        _SIGS[name] = hit
    try:
        return hit[1][function]
    except KeyError:
        raise LookupError(f"{name}.cu has no entry point {function!r}") from None


def _dtype_name(value) -> str:
    dtype = getattr(value, "dtype", None)
    return str(dtype) if dtype is not None else type(value).__name__


def launch_args(name: str, function: str, values: dict) -> tuple:
    """The argument tuple of entry point `function` of ``kernels/hip/<name>.cu``: one value per parameter, in the
    source's order, taken from `values` by the parameter's name, each checked against its C type (PARAM_DTYPES).
    A launcher that builds its arguments here cannot pass a kernel an argument it does not take, miss one or shift
    the rest: the source is the one place the list is written. Values the kernel does not take are left out."""
    args = []
    for ctype, pname in signature(name, function):
        if pname not in values:
            raise TypeError(f"{function} ({name}.cu) takes {ctype} {pname}, which its launcher does not provide "
                            f"(it provides {', '.join(sorted(values))})")
        value, want = values[pname], PARAM_DTYPES.get(ctype)
        pointer = ctype.endswith("*")
        is_array = hasattr(value, "dtype") and not isinstance(value, np.generic)
        if want is not None and (pointer != is_array or _dtype_name(value) != want):
            got = f"{'an array of ' if is_array else 'a '}{_dtype_name(value)}"
            raise TypeError(f"{function} ({name}.cu): parameter {ctype} {pname} needs "
                            f"{'an array of ' if pointer else 'a '}{want}, got {got}")
        args.append(value)
    return tuple(args)


# ---- the device: properties, warp size, occupancy (what the launchers size their grids by) -------------------------

@functools.lru_cache(maxsize=None)
def device_properties(device_id: int = 0) -> dict:
    """cudaGetDeviceProperties / hipGetDeviceProperties, once per device: the call reads every property (some
    through the driver) and can take longer than the kernels launched after it (a launcher reading it on every call
    measured 1.47 ms on the H200 instead of 0.153 ms with this cache)."""
    import cupy
    return dict(cupy.cuda.runtime.getDeviceProperties(device_id))


@functools.lru_cache(maxsize=None)
def warp_size(device_id: int = 0) -> int:
    """Lanes per warp of the GPU: 32 on NVIDIA, 64 on AMD CDNA (read from the device, never assumed)."""
    return int(device_properties(device_id)["warpSize"])


def sm_count(device_id: int = 0) -> int:
    """Streaming multiprocessors (NVIDIA) / compute units (AMD) of the GPU; 108 (an A100) where it is not reported."""
    return int(device_properties(device_id).get("multiProcessorCount", 0)) or 108


def resident_blocks(kernel, threads, props) -> int:
    """About how many blocks of `threads` of `kernel` fit on the GPU at once, from the kernel's register count and
    `props` (device_properties()). A heuristic: too many blocks only adds partial rows to reduce, too few leaves SMs
    idle."""
    sms = int(props.get("multiProcessorCount", 0)) or 108
    per_sm = 2
    try:
        regs = int(kernel.num_regs)
        ws = int(props["warpSize"])
        warp_regs = -(-regs * ws // 256) * 256                      # registers are given out per warp, in 256s
        per_sm = min(int(props["regsPerMultiprocessor"]) // (warp_regs * (threads // ws)),
                     int(props["maxThreadsPerMultiProcessor"]) // threads)
    except Exception:  # noqa: BLE001 - an attribute this CuPy/driver does not report: keep the guess
        pass
    return sms * max(1, per_sm)


_OCCUPANCY: dict = {}


def blocks_per_sm(kernel, threads, props) -> int:
    """Blocks of `threads` threads of `kernel` that fit on one SM (CU) at once: the driver's occupancy calculator
    (cuOccupancyMaxActiveBlocksPerMultiprocessor / its HIP twin, through CuPy), else resident_blocks' register
    estimate (`props`: device_properties()). Cached per kernel and block size."""
    function = getattr(kernel, "kernel", kernel)           # a CuPy RawKernel holds its driver Function in .kernel
    key = (int(getattr(function, "ptr", id(kernel))), int(threads))
    hit = _OCCUPANCY.get(key)
    if hit is not None:
        return hit
    sms = int(props.get("multiProcessorCount", 0)) or 108
    try:
        import cupy
        per_sm = int(cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(function.ptr, int(threads), 0))
    except Exception:  # noqa: BLE001 - no occupancy API in this CuPy/ROCm build: the register estimate
        per_sm = resident_blocks(kernel, threads, props) // sms
    _OCCUPANCY[key] = max(1, per_sm)
    return _OCCUPANCY[key]


def compile_source_nvrtc(text: str, arch: str = "sm_90") -> tuple[bool, str]:
    """Compile a kernel source string with NVRTC without a GPU: (ok, log). Lets a laptop check a HIP exercise compiles."""
    return _nvrtc(expand_includes(text).encode(), "notebook.cu", arch)


# ---- compiling without a GPU --------------------------------------------------------------------------------------

def crt_include_dir() -> Path | None:
    """The folder that holds crt/mma.h when it is not beside the CUDA headers: CUDA 12's pip wheels put <mma.h> in
    nvidia-cuda-runtime-cu12 and the crt/ folder it includes in nvidia-cuda-nvcc-cu12 (CUDA 13's nvidia-cuda-crt
    installs crt/ beside the headers, and a CUDA toolkit has both in one folder: None)."""
    main = nvrtc_include_dir()
    if main is not None and (main / "crt" / "mma.h").exists():
        return None
    try:
        import nvidia
    except ImportError:
        return None
    for base in nvidia.__path__:
        cand = Path(base) / "cuda_nvcc" / "include"
        if (cand / "crt" / "mma.h").exists():
            return cand
    return None


def include_options() -> tuple:
    """The -I options a CUDA compile of kernels/hip needs beyond NVRTC's own (crt_include_dir), as a tuple."""
    crt = crt_include_dir()
    return (f"-I{crt}",) if crt is not None else ()


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


def compile_nvrtc(name: str, arch: str = "sm_90", options=()) -> tuple[bool, str]:
    """Compile with NVRTC (cuda-python bindings), as CuPy does on an NVIDIA GPU. Returns (ok, log). options: more
    compiler options (e.g. flash.part_options: one part of flash.cu)."""
    return _nvrtc(expanded_source(name).encode(), f"{name}.cu", arch, options)


# These compiles check that a source is valid CUDA (front end, NVVM, ptxas for sm_90), not what the GPU will run (CuPy
# compiles that with its own options): NVRTC's fast-compile mode (CUDA >= 12.8) skips most optimisation, which makes
# flash.cu's check six times faster (104 s -> 16 s on 2 cores). An NVRTC without the option compiles as before.
FAST_COMPILE = "--Ofast-compile=max"


def _nvrtc(text: bytes, filename: str, arch: str, options=(), fast: bool = True) -> tuple[bool, str]:
    return _nvrtc_program(text, filename, arch, options, fast)[:2]


def _nvrtc_program(text: bytes, filename: str, arch: str, options=(), fast: bool = True, cubin: bool = False):
    """(ok, log, the cubin's bytes when cubin=True and ok, else None). arch sm_XX: NVRTC runs ptxas for that GPU."""
    from cuda.bindings import nvrtc  # lazy: comes with numba-cuda[cu13] / cuda-python

    err, prog = nvrtc.nvrtcCreateProgram(text, filename.encode(), 0, [], [])
    opts = [f"--gpu-architecture={arch}".encode(), b"--std=c++17"]
    inc = nvrtc_include_dir()
    if inc is not None:
        opts.append(f"-I{inc}".encode())
    opts += [o.encode() for o in (*include_options(), *options)]
    if fast:
        opts.append(FAST_COMPILE.encode())
    (res,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    _, size = nvrtc.nvrtcGetProgramLogSize(prog)
    # NVRTC writes the log into this buffer in place: it must be a bytes object of its own. b" " * 1 is CPython's
    # cached one-byte b" " itself, and an empty log (size 1: its NUL) would turn every b" " of the process into NUL.
    log = b" " * max(size, 2)
    nvrtc.nvrtcGetProgramLog(prog, log)
    ok = res == nvrtc.nvrtcResult.NVRTC_SUCCESS
    binary = None
    if ok and cubin:
        _, n = nvrtc.nvrtcGetCUBINSize(prog)
        binary = b" " * n  # filled in place, like the log (n > 1: never CPython's cached one-byte object)
        nvrtc.nvrtcGetCUBIN(prog, binary)
    nvrtc.nvrtcDestroyProgram(prog)
    log = log.decode(errors="replace").strip("\x00 \n")
    if fast and not ok and "Ofast-compile" in log:  # an NVRTC older than 12.8: the same check, at full optimisation
        return _nvrtc_program(text, filename, arch, options, False, cubin)
    return ok, log, binary


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


# ---- grading a learner's source without a GPU: portability lint + both compilers -----------------------------------

# Each rule: (regex on the source with comments blanked, what is wrong and the portable fix). The lint runs line by
# line, so every finding names its line. Only portable.h may hold platform specifics; it is not linted.
LINT_RULES: list[tuple[str, str]] = [
    (r"\b0x[fF]{8}(?![0-9a-fA-F])[uU]?[lL]{0,2}\b",
     "hard-coded 32-lane mask 0xffffffff: use FULL_MASK / lanemask_t from portable.h (a wavefront has 64 lanes)"),
    (r"&\s*(?:31|0x1[fF])\b(?!\.)",
     "lane index via & 31 assumes 32 lanes: use threadIdx.x % warpSize"),
    (r"%\s*32\b(?!\.)",
     "lane index via % 32 assumes 32 lanes: use % warpSize"),
    (r"(?<![/*])/\s*32\b(?!\.)",
     "warp index via / 32 assumes 32 lanes: use / warpSize"),
    (r">>\s*5\b",
     "warp index via >> 5 assumes 32 lanes: use / warpSize"),
    (r"\bwarpSize\s*(?:[=!]=|=|\s)\s*32\b|\b32\s*[=!]=\s*warpSize\b",
     "warpSize == 32 is an NVIDIA assumption (AMD CDNA wavefronts have 64 lanes): write code for any warpSize"),
    (r"(?i)#\s*define\s+\w*(?:warp|warp_?size|lanes)\s+32\b|"
     r"\b(?:const|constexpr)\s+(?:unsigned\s+|int\s+|unsigned\s+int\s+)*\w*(?:warp|warp_?size|lanes)\s*=\s*32\b",
     "a warp size constant of 32: use warpSize (32 on NVIDIA, 64 on AMD CDNA)"),
    (r"\b32\s*\*\s*32\b",
     "32 * 32 assumes 32 lanes: use warpSize (and MAX_WARPS_PER_BLOCK from portable.h for shared buffers)"),
    (r"\bshfl(?:_xor|_down|_up)?\s*\([^;]*,\s*32\s*\)",
     "shuffle width 32 assumes 32 lanes: pass warpSize as the width"),
    (r"\bfor\s*\([^;]*=\s*16\s*;[^;]*>\s*0\s*;",
     "a shuffle loop starting at offset 16 reduces 32 lanes only: start at warpSize / 2"),
    (r"\b__shfl\w*\s*\(",
     "raw shuffle (__shfl_*): use shfl_xor / shfl_down / shfl from portable.h (CUDA's take a 32-bit mask, HIP's none)"),
    (r"\b__(?:ballot_sync|any_sync|all_sync|activemask|match_any_sync|match_all_sync|syncwarp|reduce_\w+_sync)\s*\(",
     "CUDA-only warp intrinsic with a 32-bit lane mask: use the portable.h helpers (warp_sum, warp_max, shfl_*)"),
    (r"\bstd::", "no C++ standard library under NVRTC (std::): use fmaxf, fminf, ... from the device math library"),
    (r"#\s*include\s*<", 'CUDA-only or system header (#include <...>): include only "portable.h"'),
    (r"\basm\s*(?:volatile\s*)?\(", "no inline PTX/assembly: it compiles for one vendor only"),
    (r"cooperative_groups", "no cooperative groups: use __syncthreads and the portable.h warp helpers"),
]
_LINT_COMPILED = [(re.compile(p), why) for p, why in LINT_RULES]
_ENTRY = re.compile(r'extern\s+"C"\s+__global__\s+(?:__launch_bounds__\s*\([^)]*\)\s+)?void\s+'
                    r'(?:__launch_bounds__\s*\([^)]*\)\s+)?(\w+)\s*\(')
SOURCE_NAME = "kernel.cu"   # the file name compiler messages give the learner's source


def _blank_comments(text: str) -> str:
    """Comments replaced by spaces (newlines kept), so line numbers still match the source."""
    def repl(m):
        return re.sub(r"[^\n]", " ", m.group(0))
    return re.sub(r"//[^\n]*|/\*.*?\*/", repl, text, flags=re.S)


def _line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def _extern_c_blocks(code: str) -> list[tuple[int, int]]:
    """(start, end) offsets of every ``extern "C" { ... }`` block."""
    spans = []
    for m in re.finditer(r'extern\s+"C"\s*\{', code):
        depth, i = 1, m.end()
        while i < len(code) and depth:
            depth += {"{": 1, "}": -1}.get(code[i], 0)
            i += 1
        spans.append((m.start(), i))
    return spans


# Headers that belong to one source (kernel name): the pieces its sections share, split off so that each section
# reads as one part (flash_common.h: what flash.cu's versions share). Only that source may include them: a learner's
# source may not (they hold answers of the lessons' tasks, e.g. row_max / row_sum's shuffle loops).
OWN_HEADERS = {"flash_common.h": "flash"}


def shared_headers(source: str | None = None) -> list[str]:
    """Headers of kernels/hip a source may include after portable.h (e.g. half.h); `source` (a kernel's name, e.g.
    "flash"): also the headers that are that source's own (OWN_HEADERS)."""
    return sorted(p.name for p in kernel_dir().glob("*.h")
                  if p.name != "portable.h" and OWN_HEADERS.get(p.name, source) == source)


def entry_points(text: str) -> list[str]:
    """Names of the ``extern "C" __global__`` functions of a source (also inside an ``extern "C" { }`` block)."""
    code = _blank_comments(text)
    names = _ENTRY.findall(code)
    for start, end in _extern_c_blocks(code):
        names += re.findall(r'__global__\s+(?:__launch_bounds__\s*\([^)]*\)\s+)?void\s+'
                            r'(?:__launch_bounds__\s*\([^)]*\)\s+)?(\w+)\s*\(', code[start:end])
    return list(dict.fromkeys(names))


def lint_source(text: str, *, require_portable_h: bool = False, source: str | None = None) -> list[str]:
    """The course's portability lint: findings ``"line N: what is wrong: the fix"``, [] when clean.

    Catches what breaks on the other vendor or under NVRTC/hiprtc: 32-lane masks and other warp-size assumptions
    (``& 31``, ``% 32``, ``warpSize == 32``, a width or start offset of 32 lanes), raw or CUDA-only warp intrinsics,
    the C++ standard library, system/CUDA headers, inline assembly, cooperative groups; local includes other than
    portable.h (first) and the shared headers of kernels/hip; ``__global__`` functions that are not
    ``extern "C"``. ``require_portable_h``: the source must include portable.h (the course's own kernels do).
    ``source``: the name of the course's kernel linted (e.g. "flash"), which may also include its own headers
    (OWN_HEADERS); a learner's source (None) may not.
    """
    code = _blank_comments(text)
    findings = []
    for lineno, line in enumerate(code.split("\n"), 1):
        for pattern, why in _LINT_COMPILED:
            if pattern.search(line):
                findings.append((lineno, why))
    # multi-line shuffle loops / calls: rules that may span lines, checked on the whole text once
    for pattern, why in _LINT_COMPILED:
        for m in pattern.finditer(code):
            line = _line_of(code, m.start())
            if "\n" in m.group(0) and (line, why) not in findings:
                findings.append((line, why))
    includes = [(m.group(1), _line_of(code, m.start())) for m in re.finditer(r'#\s*include\s*"([^"]+)"', code)]
    allowed = set(shared_headers(source))
    if includes and includes[0][0] != "portable.h":
        findings.append((includes[0][1], f'include "portable.h" first (found "{includes[0][0]}")'))
    elif not includes and require_portable_h:
        findings.append((1, 'include "portable.h" (the one header that knows the vendor)'))
    for name, line in includes[1:]:
        if name not in allowed:
            findings.append((line, f'#include "{name}": include only "portable.h"'
                                   + (f", then {', '.join(sorted(allowed))}" if allowed else "")))
    blocks = _extern_c_blocks(code)
    for m in re.finditer(r"__global__", code):
        before = code[max(0, m.start() - 40):m.start()]
        if re.search(r'extern\s+"C"\s+$', before) or any(s <= m.start() < e for s, e in blocks):
            continue
        findings.append((_line_of(code, m.start()), 'kernels must be extern "C" __global__ (unmangled names, '
                                                    "so CuPy finds them by name)"))
    findings.sort(key=lambda f: f[0])
    return [f"line {line}: {why}" for line, why in dict.fromkeys(findings)]


def _grading_text(text: str) -> str:
    """The source with its local includes expanded as the course does, plus ``#line`` markers so compiler errors
    give the lines of the learner's own text (``kernel.cu``) or of the header."""
    out, seen = [f'#line 1 "{SOURCE_NAME}"'], set()
    for i, line in enumerate(text.split("\n"), 1):
        m = _INCLUDE.match(line)
        if not m:
            out.append(line)
            continue
        name = m.group(1)
        path = kernel_dir() / name
        if name in seen:
            out.append(f"// (already included: {name})")
            continue
        if not path.exists():
            raise FileNotFoundError(f'line {i}: #include "{name}": no such header in kernels/hip; include only '
                                    f'"portable.h"')
        seen.add(name)
        body = path.read_text().replace("#pragma once", "")
        out += [f'#line 1 "{name}"', expand_includes(body, kernel_dir(), seen), f'#line {i + 1} "{SOURCE_NAME}"']
    return "\n".join(out) + "\n"


_ERROR_LINE = [
    re.compile(r"^(?:.*/)?([\w.]+)\((\d+)\): (?:catastrophic )?error\b:?\s*(.*)$"),       # NVRTC: f.cu(12): error: ...
    re.compile(r"^(?:.*/)?([\w.]+):(\d+):\d+: (?:fatal )?error:\s*(.*)$"),               # clang: f.cu:12:5: error: ...
]


def _first_errors(log: str, limit: int = 3) -> list[str]:
    """The first compiler error lines, as 'line N: error: ...' (N a line of the learner's source)."""
    errors = []
    for raw in log.splitlines():
        for pat in _ERROR_LINE:
            m = pat.match(raw.strip())
            if m:
                where = f"line {m.group(2)}" if m.group(1) == SOURCE_NAME else f"{m.group(1)} line {m.group(2)}"
                errors.append(f"{where}: error: {m.group(3).strip()}")
                break
    if not errors:
        errors = [" ".join(raw.split()) for raw in log.splitlines() if raw.strip()][:limit]
    return list(dict.fromkeys(errors))[:limit]


def _require_compilers() -> bool:
    return os.environ.get("GPULLM_REQUIRE_COMPILERS") == "1"


def _nvrtc_learner(text: str) -> tuple[bool | None, str]:
    """(ok, log) from NVRTC sm_90; ok None when NVRTC is not installed."""
    try:
        import cuda.bindings.nvrtc  # noqa: F401
    except ImportError:
        return None, "NVRTC (cuda-python) is not installed"
    return _nvrtc(text.encode(), SOURCE_NAME, "sm_90")


def _hipcc_learner(text: str) -> tuple[bool | None, str]:
    """(ok, log) from hipcc --offload-arch=gfx90a; ok None when hipcc is not installed."""
    hipcc = shutil.which("hipcc")
    if hipcc is None:
        return None, "hipcc not found"
    env = dict(os.environ, HIP_PLATFORM="amd")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, SOURCE_NAME)
        Path(src).write_text(text)
        try:
            return _run_compiler([hipcc, "--offload-arch=gfx90a", "--genco", f"-I{kernel_dir()}", src,
                                  "-o", os.path.join(tmp, "kernel.hsaco")], env=env)
        except subprocess.TimeoutExpired:
            return False, "hipcc took longer than 300 s"


@functools.lru_cache(maxsize=64)
def _compile_both(full: str) -> tuple:
    """((vendor, what, ok, log), ...) for NVRTC sm_90 and hipcc gfx90a; ok None when that compiler is missing."""
    return tuple((vendor, what, *compile_(full)) for vendor, what, compile_ in
                 (("NVIDIA", "NVRTC sm_90", _nvrtc_learner), ("AMD", "hipcc gfx90a", _hipcc_learner)))


def _grade(text: str, entries: tuple, require: bool) -> tuple[bool, str]:
    problems, checked, unchecked = [], [], []
    found = entry_points(text)
    missing = [e for e in entries if e not in found]
    if missing:
        problems.append(f"no extern \"C\" __global__ function named {', '.join(repr(e) for e in missing)} "
                        f"(entry points found: {', '.join(found) or 'none'})")
    elif not entries and not found:
        problems.append('no extern "C" __global__ function in the source')
    findings = lint_source(text)
    if findings:
        more = f" (and {len(findings) - 3} more)" if len(findings) > 3 else ""
        problems.append("portability lint: " + "; ".join(findings[:3]) + more)
    try:
        full = _grading_text(text)
    except FileNotFoundError as e:
        problems.append(str(e))
        return False, "; ".join(problems)
    for vendor, what, ok, log in _compile_both(full):
        if ok is None:
            if require:
                problems.append(f"not compiled for {vendor}: {log} (GPULLM_REQUIRE_COMPILERS=1)")
            else:
                unchecked.append(f"{vendor} not checked ({log})")
        elif ok:
            checked.append(f"{vendor} ({what.split()[1]})")
        else:
            problems.append(f"does not compile for {vendor} ({what}): " + " | ".join(_first_errors(log)))
    if problems:
        return False, "; ".join(problems)
    if checked:
        report = "compiles for " + " and ".join(checked) + ", portability lint clean"
    else:
        report = "portability lint clean, not compiled (no compiler on this machine)"
    if unchecked:
        report += "; " + "; ".join(unchecked)
    return True, report


def grade_source(text: str, entries) -> tuple[bool, str]:
    """Check a learner's kernel source without a GPU: ``(ok, report)``.

    Compiles it (its ``#include "portable.h"`` expanded as the course does) for NVIDIA with NVRTC (sm_90) and for
    AMD with hipcc (gfx90a, when hipcc is installed; ``GPULLM_REQUIRE_COMPILERS=1`` makes a missing compiler a
    failure), checks that every name in ``entries`` is an ``extern "C" __global__`` function of it, and runs
    ``lint_source``. The report says what was checked, or what failed: the missing entry point, the lint findings,
    the first compiler error lines (``line N`` is a line of your source). Compiles are cached per source text.
    """
    if not isinstance(text, str):
        raise TypeError(f"grade_source(text): text must be the kernel source as a str, got {type(text).__name__}")
    if isinstance(entries, str):
        entries = (entries,)
    entries = tuple(entries or ())
    if not all(isinstance(e, str) for e in entries):
        raise TypeError(f"grade_source(entries): entry point names must be str, got {entries!r}")
    return _grade(text, entries, _require_compilers())
