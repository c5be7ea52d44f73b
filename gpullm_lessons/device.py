"""Where code runs: 'cuda' | 'rocm' | 'sim' (Numba's CUDA simulator on the CPU) | 'cpu'.

This module must be imported before numba (``import gpullm_lessons`` does it first): Numba reads
NUMBA_ENABLE_CUDASIM once, when ``numba`` itself is imported, and setting it later silently does nothing.
So the GPU is detected here without numba or cupy, through the driver libraries (libcuda, libamdhip64)
loaded with ctypes.

Kinds
-----
cuda  an NVIDIA GPU answered cuInit: Numba kernels and CuPy/HIP kernels run on it.
rocm  an AMD GPU answered hipInit: HIP kernels run on it through CuPy's ROCm build. Numba CUDA does not run
      on AMD GPUs, so Numba kernels run in the simulator there.
sim   no GPU: Numba kernels run in the CUDA simulator (pure Python, slow: lessons pick tiny sizes).
cpu   no GPU and the simulator switched off by the user (NUMBA_ENABLE_CUDASIM=0): only NumPy code runs.

Overrides: ``GPULLM_DEVICE=cuda|rocm|sim|cpu`` forces a kind (``sim`` on a GPU machine runs the simulator,
useful to reproduce what a laptop sees). An explicit ``NUMBA_ENABLE_CUDASIM`` set by the user is respected.
"""
from __future__ import annotations

import ctypes
import dataclasses
import os
import sys
from typing import Optional

KINDS = ("cuda", "rocm", "sim", "cpu")


class NoGPUError(RuntimeError):
    """Raised when something needs a real GPU and this machine has none (or not the right vendor)."""


@dataclasses.dataclass(frozen=True)
class GPU:
    vendor: str  # 'nvidia' | 'amd'
    name: str
    memory_bytes: int
    count: int


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    kind: str  # one of KINDS
    gpu: Optional[GPU]  # the GPU found (None if none)
    simulator: bool  # Numba kernels run in the CUDA simulator
    reason: str  # one line: why this kind

    @property
    def has_gpu(self) -> bool:
        return self.kind in ("cuda", "rocm")


def _load(names):
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def _probe_nvidia() -> Optional[GPU]:
    lib = _load(["libcuda.so.1", "libcuda.so", "nvcuda.dll", "libcuda.dylib"])
    if lib is None:
        return None
    try:
        if lib.cuInit(0) != 0:
            return None
        count = ctypes.c_int(0)
        if lib.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value < 1:
            return None
        dev = ctypes.c_int(0)
        lib.cuDeviceGet(ctypes.byref(dev), 0)
        name = ctypes.create_string_buffer(256)
        lib.cuDeviceGetName(name, 256, dev)
        mem = ctypes.c_size_t(0)
        getmem = getattr(lib, "cuDeviceTotalMem_v2", None) or lib.cuDeviceTotalMem
        getmem(ctypes.byref(mem), dev)
        return GPU("nvidia", name.value.decode(errors="replace"), int(mem.value), int(count.value))
    except Exception:  # a broken driver install is "no usable GPU", the doctor says more
        return None


def _probe_amd() -> Optional[GPU]:
    if not os.path.exists("/dev/kfd"):
        return None
    lib = _load(["libamdhip64.so", "libamdhip64.so.7", "libamdhip64.so.6", "/opt/rocm/lib/libamdhip64.so"])
    if lib is None:
        return None
    try:
        if lib.hipInit(0) != 0:
            return None
        count = ctypes.c_int(0)
        if lib.hipGetDeviceCount(ctypes.byref(count)) != 0 or count.value < 1:
            return None
        name = ctypes.create_string_buffer(256)
        lib.hipDeviceGetName(name, 256, 0)
        mem = ctypes.c_size_t(0)
        lib.hipDeviceTotalMem(ctypes.byref(mem), 0)
        return GPU("amd", name.value.decode(errors="replace"), int(mem.value), int(count.value))
    except Exception:
        return None


def probe_gpu() -> Optional[GPU]:
    """Ask the drivers (not numba, not cupy) whether a GPU is present. NVIDIA first, then AMD."""
    return _probe_nvidia() or _probe_amd()


def _truthy(value: str) -> bool:
    return value.strip().lower() not in ("", "0", "false", "no", "off")


def detect(environ=None) -> DeviceInfo:
    """Decide the kind from the environment and the drivers. Pure: changes nothing."""
    env = os.environ if environ is None else environ
    forced = env.get("GPULLM_DEVICE", "").strip().lower()
    if forced and forced not in KINDS:
        raise ValueError(f"GPULLM_DEVICE={forced!r} is not one of {', '.join(KINDS)}")
    user_sim = env.get("NUMBA_ENABLE_CUDASIM")
    gpu = None if forced in ("sim", "cpu") else probe_gpu()

    if forced == "cpu":
        return DeviceInfo("cpu", None, False, "GPULLM_DEVICE=cpu: only NumPy code runs")
    if forced == "sim" or (user_sim is not None and _truthy(user_sim)):
        why = "GPULLM_DEVICE=sim" if forced == "sim" else "NUMBA_ENABLE_CUDASIM is set by you"
        return DeviceInfo("sim", None, True, f"{why}: Numba kernels run in the CUDA simulator")
    if forced in ("cuda", "rocm") and (gpu is None or {"cuda": "nvidia", "rocm": "amd"}[forced] != gpu.vendor):
        raise NoGPUError(f"GPULLM_DEVICE={forced} but no {forced.upper()} GPU answered on this machine "
                         f"(run `python -m gpullm_lessons doctor`)")
    if gpu is not None and gpu.vendor == "nvidia":
        return DeviceInfo("cuda", gpu, False, f"NVIDIA GPU found: {gpu.name}")
    if gpu is not None and gpu.vendor == "amd":
        # Numba CUDA cannot target AMD GPUs: its kernels run simulated; HIP kernels run on the GPU.
        sim = user_sim is None or _truthy(user_sim)
        return DeviceInfo("rocm", gpu, sim, f"AMD GPU found: {gpu.name} (Numba kernels: simulator; HIP: GPU)")
    if user_sim is not None and not _truthy(user_sim):
        return DeviceInfo("cpu", None, False, "no GPU, and NUMBA_ENABLE_CUDASIM=0 set by you: only NumPy code runs")
    return DeviceInfo("sim", None, True, "no GPU found: Numba kernels run in the CUDA simulator (CPU, slow)")


_INFO: Optional[DeviceInfo] = None
_ANNOUNCED = False
_DESCRIBED = False   # describe() was called: a notebook printed the device line itself


def configure(quiet: bool = False) -> DeviceInfo:
    """Detect once per process, switch the simulator on if needed (before numba loads), say so once."""
    global _INFO, _ANNOUNCED
    if _INFO is not None:
        return _INFO
    info = detect()
    if info.simulator and "NUMBA_ENABLE_CUDASIM" not in os.environ:
        if "numba" in sys.modules and not _numba_simulating():
            print("[gpullm_lessons] WARNING: numba was imported before gpullm_lessons, so the CUDA simulator "
                  "could not be switched on and Numba kernels will fail without a GPU. Restart the kernel and "
                  "`import gpullm_lessons` before numba.", file=sys.stderr)
        else:
            os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    _INFO = info
    if not quiet and not _ANNOUNCED and info.kind != "cuda":
        _ANNOUNCED = True
        _announce(f"[gpullm_lessons] device: {info.kind} - {info.reason}")
    return info


def _ipython_shell():
    """The running IPython shell (a Jupyter kernel, or IPython in a terminal), or None. Never imports IPython."""
    ipython = sys.modules.get("IPython")
    try:
        return ipython.get_ipython() if ipython is not None else None
    except Exception:
        return None


def _announce(line: str) -> None:
    """Say where code runs, once. A script or a test: on stderr, at import. A notebook: as ordinary output
    (stdout) at the end of the cell that imported the package, and only if that cell did not print
    ``describe()`` itself (every lesson does), so the line appears once and not in an error-coloured box."""
    shell = _ipython_shell()
    if shell is None or not hasattr(shell, "events"):
        print(line, file=sys.stderr)
        return

    def after_cell(*_):
        try:
            shell.events.unregister("post_run_cell", after_cell)
        except ValueError:
            pass
        if not _DESCRIBED:
            print(line, flush=True)

    shell.events.register("post_run_cell", after_cell)


def _numba_simulating() -> bool:
    """Whether the already-imported numba runs the CUDA simulator."""
    cfg = getattr(sys.modules.get("numba"), "config", None)
    return bool(getattr(cfg, "ENABLE_CUDASIM", 0))


def info() -> DeviceInfo:
    return configure()


def kind() -> str:
    """'cuda' | 'rocm' | 'sim' | 'cpu'."""
    return configure().kind


def has_gpu() -> bool:
    return configure().has_gpu


def numba_on_gpu() -> bool:
    """True when Numba CUDA kernels run on a real GPU (NVIDIA only)."""
    return configure().kind == "cuda"


def numba_available() -> bool:
    """True when Numba CUDA kernels can run at all (on a GPU or in the simulator)."""
    i = configure()
    return i.kind == "cuda" or i.simulator


def pick(small, large):
    """Sizes for a notebook: `small` under the simulator / CPU, `large` on a real GPU."""
    return large if has_gpu() else small


def require_gpu(what: str = "this") -> DeviceInfo:
    """Raise NoGPUError naming `what` unless a real GPU is present."""
    i = configure()
    if not i.has_gpu:
        raise NoGPUError(f"{what} needs a GPU (NVIDIA CUDA or AMD ROCm); this machine runs as '{i.kind}': "
                         f"{i.reason}. `python -m gpullm_lessons doctor` says what is missing.")
    return i


def describe() -> str:
    """One line for notebooks: what runs where."""
    global _DESCRIBED
    _DESCRIBED = True
    i = configure()
    if i.gpu is not None:
        g = i.gpu
        return f"{i.kind}: {g.name}, {g.memory_bytes / 2**30:.0f} GiB" + (f" (x{g.count})" if g.count > 1 else "") + \
            ("; Numba kernels in the simulator" if i.simulator else "")
    return f"{i.kind}: {i.reason}"
