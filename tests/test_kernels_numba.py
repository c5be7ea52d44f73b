"""Every Numba kernel: run against NumPy in the simulator (or on the GPU), and compiled to PTX for sm_90 without a GPU.

Each module in kernels/numba exposes KERNELS (version -> kernel) and SIGNATURES (version -> Numba signature string),
so a typing error in a GPU-only version fails here too.
"""
import importlib
import json
import os
import pkgutil
import subprocess
import sys

import numpy as np
import pytest

import gpullm_lessons.kernels.numba as numba_kernels
from gpullm_lessons import device

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULES = sorted(m.name for m in pkgutil.iter_modules(numba_kernels.__path__) if not m.name.startswith("_"))


def test_every_module_declares_versions_and_signatures():
    assert MODULES, "no Numba kernel modules found"
    for name in MODULES:
        mod = importlib.import_module(f"gpullm_lessons.kernels.numba.{name}")
        assert set(mod.KERNELS) == set(mod.SIGNATURES), name
        assert mod.__doc__ and all(v in mod.__doc__ for v in mod.KERNELS), f"{name}: document every version"


COMPILE_ALL = r"""
import importlib, json, pkgutil, sys
import gpullm_lessons.kernels.numba as pkg
from numba import cuda
out = {}
for m in (m for m in pkgutil.iter_modules(pkg.__path__) if not m.name.startswith("_")):
    mod = importlib.import_module(f"gpullm_lessons.kernels.numba.{m.name}")
    for version, kern in mod.KERNELS.items():
        key = f"{m.name}.{version}"
        try:
            ptx, _ = cuda.compile_ptx(kern.py_func, mod.SIGNATURES[version], cc=(9, 0))
            out[key] = "ok" if ".target sm_90" in ptx else "no sm_90 target in PTX"
        except Exception as e:
            out[key] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"""


def test_every_numba_kernel_compiles_to_ptx_for_sm90():
    """No GPU needed: NVVM from pip's CUDA wheels. The simulator must be off in that process."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0", GPULLM_DEVICE="cpu",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", COMPILE_ALL], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    results = json.loads(p.stdout.strip().splitlines()[-1])
    assert results, "nothing compiled"
    bad = {k: v for k, v in results.items() if v != "ok"}
    assert not bad, bad


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_vector_add_matches_numpy(version):
    from gpullm_lessons.runtime.arrays import to_backend, to_numpy
    from gpullm_lessons.kernels.numba.vector_add import vector_add
    rng = np.random.default_rng()
    n = int(rng.integers(1, 3000)) if not device.numba_on_gpu() else 10_000_019
    a, b = rng.standard_normal((2, n), dtype=np.float32)
    out = np.full(n, np.nan, np.float32)
    arrays = "numba" if device.numba_on_gpu() else "numpy"
    da, db, dout = (to_backend(x, arrays) for x in (a, b, out))
    vector_add(da, db, dout, version=version)
    np.testing.assert_array_equal(to_numpy(dout), a + b)


def test_vector_add_rejects_mismatched_shapes():
    from gpullm_lessons.kernels.numba.vector_add import vector_add
    with pytest.raises(ValueError, match="must be 1-D of one length"):
        vector_add(np.zeros(3, np.float32), np.zeros(4, np.float32), np.zeros(3, np.float32))
