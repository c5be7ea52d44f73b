"""The device layer: detection without numba, the simulator switched on before numba loads, overrides respected."""
import os
import subprocess
import sys

import pytest

from gpullm_lessons import device

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_py(code: str, **env_overrides) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_ENABLE_CUDASIM", "GPULLM_DEVICE")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    for k, v in env_overrides.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_import_does_not_load_numba_or_cupy():
    p = run_py("import sys, gpullm_lessons; print('numba' in sys.modules, 'cupy' in sys.modules)", GPULLM_DEVICE="sim")
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["False", "False"]


def test_sim_switches_simulator_on_before_numba_and_says_so_once():
    code = ("import gpullm_lessons, importlib; from gpullm_lessons import device; device.configure(); device.configure();"
            "import numba; from numba import cuda; print(numba.config.ENABLE_CUDASIM, device.kind())")
    p = run_py(code, GPULLM_DEVICE="sim")
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["1", "sim"]
    assert p.stderr.count("[gpullm_lessons] device: sim") == 1


def test_user_setting_respected_cpu_when_simulator_disabled():
    p = run_py("from gpullm_lessons import device; print(device.kind(), device.numba_available())",
               NUMBA_ENABLE_CUDASIM="0")
    if device.probe_gpu() is not None:
        pytest.skip("a GPU is present: NUMBA_ENABLE_CUDASIM=0 then means 'run on the GPU'")
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["cpu", "False"]


def test_numba_imported_first_gives_a_clear_warning():
    if device.probe_gpu() is not None:
        pytest.skip("with a GPU the simulator is not needed")
    p = run_py("import numba; import gpullm_lessons")
    assert p.returncode == 0, p.stderr
    assert "numba was imported before gpullm_lessons" in p.stderr
    assert "Restart the kernel" in p.stderr


def test_bad_override_is_named():
    with pytest.raises(ValueError, match="GPULLM_DEVICE='tpu' is not one of cuda, rocm, sim, cpu"):
        device.detect({"GPULLM_DEVICE": "tpu"})


def test_forcing_a_missing_gpu_says_so(monkeypatch):
    monkeypatch.setattr(device, "probe_gpu", lambda: None)
    with pytest.raises(device.NoGPUError, match="GPULLM_DEVICE=cuda but no CUDA GPU"):
        device.detect({"GPULLM_DEVICE": "cuda"})


def test_detect_kinds_from_probe(monkeypatch):
    nv = device.GPU("nvidia", "NVIDIA H200", 141 * 2**30, 1)
    amd = device.GPU("amd", "AMD Instinct MI250X", 64 * 2**30, 2)
    monkeypatch.setattr(device, "probe_gpu", lambda: nv)
    i = device.detect({})
    assert (i.kind, i.simulator, i.has_gpu) == ("cuda", False, True)
    assert device.detect({"NUMBA_ENABLE_CUDASIM": "1"}).kind == "sim"  # the user's explicit choice wins
    monkeypatch.setattr(device, "probe_gpu", lambda: amd)
    i = device.detect({})
    assert (i.kind, i.simulator) == ("rocm", True)  # Numba CUDA cannot target AMD: its kernels run simulated
    monkeypatch.setattr(device, "probe_gpu", lambda: None)
    assert device.detect({}).kind == "sim"
    assert device.detect({"GPULLM_DEVICE": "cpu"}).kind == "cpu"


def test_pick_and_require_gpu_on_this_machine():
    if device.has_gpu():
        assert device.pick(1, 2) == 2
        assert device.require_gpu("x").has_gpu
    else:
        assert device.pick(1, 2) == 1
        with pytest.raises(device.NoGPUError, match="the HIP lesson needs a GPU"):
            device.require_gpu("the HIP lesson")
