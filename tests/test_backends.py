"""Every backend's launchers pass the op's checker (NumPy here; Numba and HIP in tests/test_kernels_*.py)."""
import pytest

from gpullm_lessons.checks import backward as checks
from gpullm_lessons.backends import numpy as np_backend

OPS = ["linear", "softmax", "layernorm", "gelu", "crossentropy", "attention", "encoder", "residual"]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_numpy_backend_passes_its_checker(op, dtype):
    r = getattr(checks, f"check_{op}_backward")(getattr(np_backend, f"{op}_backward"), dtype=dtype, quiet=True)
    assert r.status == "correct", r.message


@pytest.mark.parametrize("backend", ["numba", "hip"])
def test_backends_gather_every_launcher(backend):
    import importlib
    mod = importlib.import_module(f"gpullm_lessons.backends.{backend}")
    expected = {f"{op}_backward" for op in OPS} | {"adamw_step", "f32_to_bf16", "bf16_to_f32", "f32_to_f16",
                                                   "nonfinite_count", "layernorm_forward", "gelu_forward"}
    assert expected <= set(mod.__all__), sorted(expected - set(mod.__all__))
