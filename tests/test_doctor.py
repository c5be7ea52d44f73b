"""`python -m gpullm_lessons doctor`: one [OK]/[FAIL]/[SKIP] line per check, a fix on every non-OK line."""
import os
import re
import subprocess
import sys

from gpullm_lessons.runtime import doctor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_doctor_runs_and_every_line_is_a_verdict():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "gpullm_lessons", "doctor"], capture_output=True, text=True, env=env,
                       timeout=300)
    lines = p.stdout.strip().splitlines()
    assert lines[0].startswith("gpullm_lessons doctor - device kind")
    verdicts = [ln for ln in lines[1:-1] if not ln.startswith("       fix:")]
    assert all(re.match(r"^\[(OK|FAIL|SKIP)\] \w[\w-]*: ", ln) for ln in verdicts), verdicts
    names = {re.match(r"^\[\w+\] ([\w-]+):", ln).group(1) for ln in verdicts}
    assert {"python", "numpy", "numba", "simulator", "gpu", "cupy", "cublaslt", "nvrtc", "tensor-cores", "nvcc",
            "hipcc"} <= names
    failed = [ln for ln in verdicts if ln.startswith("[FAIL]")]
    assert p.returncode == (1 if failed else 0)
    assert re.match(r"^\d+ ok/skipped, \d+ failed$", lines[-1])


def test_numpy_too_new_fails_with_the_fix(monkeypatch):
    monkeypatch.setattr(doctor, "_version", lambda dist: "2.5.0" if dist == "numpy" else None)
    c = doctor.check_numpy()
    assert c.status == "FAIL" and "pip install 'numpy<2.5'" in c.line()
    monkeypatch.setattr(doctor, "_version", lambda dist: "2.4.6")
    assert doctor.check_numpy().status == "OK"


def test_missing_numba_fails_with_the_fix(monkeypatch):
    monkeypatch.setattr(doctor, "_version", lambda dist: None if dist == "numba-cuda" else "0.68.1")
    (c,) = doctor.check_numba()
    assert c.status == "FAIL" and "numba-cuda not installed" in c.detail and c.fix


def test_cupy_missing_with_a_gpu_is_a_failure(monkeypatch):
    from gpullm_lessons import device
    fake = device.DeviceInfo("cuda", device.GPU("nvidia", "H200", 1, 1), False, "test")
    monkeypatch.setattr(device, "info", lambda: fake)
    monkeypatch.setattr(doctor, "_version", lambda dist: None)
    c = doctor.check_cupy()
    assert c.status == "FAIL" and "[cuda13]" in c.fix


def test_cublaslt_missing_on_an_nvidia_gpu_is_a_failure_and_elsewhere_a_skip(monkeypatch):
    from gpullm_lessons import device
    monkeypatch.setattr(doctor, "_version", lambda dist: None)
    for kind, status in (("cuda", "FAIL"), ("rocm", "SKIP"), ("sim", "SKIP")):
        fake = device.DeviceInfo(kind, device.GPU("nvidia", "H200", 1, 1) if kind != "sim" else None, False, "test")
        monkeypatch.setattr(device, "info", lambda: fake)
        c = doctor.check_cublaslt()
        assert c.status == status and (status == "SKIP" or "[cuda13]" in c.fix), (kind, c.line())


def test_missing_tensor_core_headers_fail_with_the_fix(monkeypatch):
    from gpullm_lessons.runtime import hip
    log = 'mma.h(55): catastrophic error: cannot open source file "crt/mma.h"'
    calls = []

    def compile_nvrtc(name, arch="sm_90", options=()):
        calls.append((name, tuple(options)))
        return name != "flash", log if name == "flash" else ""

    monkeypatch.setattr(hip, "compile_nvrtc", compile_nvrtc)
    (nvrtc, cores) = [c for c in doctor.check_compilers() if c.name in ("nvrtc", "tensor-cores")]
    assert nvrtc.status == "OK"
    assert cores.status == "FAIL" and "crt/mma.h" in cores.detail and "nvidia-cuda-crt" in cores.line()
    # one part of flash.cu (seconds), not the whole file (minutes on 2 cores)
    assert ("flash", ("-DFLASH_PART_V=2", "-DFLASH_PART_H=1")) in calls


def test_nvrtc_missing_is_a_skip_on_an_amd_gpu_only(monkeypatch):
    """The rocm extra brings cuda-bindings (numba-cuda's dependency) but no NVRTC library: on an AMD GPU the lessons
    never compile for NVIDIA, so the doctor (the ROCm container's health check) must not fail there; elsewhere the
    lessons compile the HIP kernels with NVRTC, and it fails."""
    from gpullm_lessons import device
    from gpullm_lessons.runtime import hip

    def no_library(name, arch="sm_90", options=()):
        raise RuntimeError('Failure finding "libnvrtc.so.13"')

    monkeypatch.setattr(hip, "compile_nvrtc", no_library)
    amd = device.DeviceInfo("rocm", device.GPU("amd", "MI300X", 1, 1), True, "test")
    monkeypatch.setattr(device, "info", lambda: amd)
    (nvrtc,) = [c for c in doctor.check_compilers() if c.name == "nvrtc"]
    assert nvrtc.status == "SKIP" and "hiprtc" in nvrtc.detail
    laptop = device.DeviceInfo("sim", None, True, "test")
    monkeypatch.setattr(device, "info", lambda: laptop)
    (nvrtc,) = [c for c in doctor.check_compilers() if c.name == "nvrtc"]
    assert nvrtc.status == "FAIL" and "libnvrtc" in nvrtc.detail


def test_the_simulator_without_greenlet_fails_with_the_fix(monkeypatch):
    import pytest

    from gpullm_lessons import device
    if not device.info().simulator:
        pytest.skip("the simulator is off on this machine")
    real = doctor._version
    monkeypatch.setattr(doctor, "_version", lambda dist: None if dist == "greenlet" else real(dist))
    sim = next(c for c in doctor.check_numba() if c.name == "simulator")
    assert sim.status == "FAIL" and "greenlet" in sim.detail and sim.fix == "pip install 'greenlet>=3'"
    monkeypatch.setattr(doctor, "_version", real)
    assert next(c for c in doctor.check_numba() if c.name == "simulator").status == "OK"
