"""GELU forward/backward and residual backward kernels (kernels/numba/gelu.py, kernels/hip/gelu.cu).

gelu_backward and residual_backward against their checkers; gelu_forward against the reference gelu_forward on fresh
random inputs with a NaN-poisoned output. Simulator (CI): v1 at the checkers' small sizes, broken launches caught,
wrapper validation. GPU (`make gpu-test`): both backends at large and awkward sizes.
"""
import numpy as np
import pytest

from gpullm_lessons import device
from gpullm_lessons.runtime.arrays import to_backend, to_numpy
from gpullm_lessons.checks.backward import check_gelu_backward, check_residual_backward
from gpullm_lessons.kernels.numba import gelu as nb
from gpullm_lessons.reference import gelu_forward as ref_gelu_forward

needs_numba_gpu = pytest.mark.skipif(not device.numba_on_gpu(),
                                     reason=f"needs Numba on an NVIDIA GPU (this machine: {device.kind()})")


def hip_module():
    pytest.importorskip("cupy")
    from gpullm_lessons.backends.hip import gelu as hip_gelu
    return hip_gelu


def check_forward(fn, arrays, n, seed=None, **kw):
    """fn(inp, out) on fresh random inp (n,), out poisoned with NaN; compared with the float64 reference."""
    rng = np.random.default_rng(seed)
    inp = (rng.standard_normal(n) * 10.0 ** rng.uniform(-0.5, 0.5, n)).astype(np.float32)   # mostly in [-4, 4]
    out = to_backend(np.full(n, np.nan, np.float32), arrays)
    fn(to_backend(inp, arrays), out, **kw)
    expected = ref_gelu_forward(inp.astype(np.float64))[0]
    got = to_numpy(out)
    # relative tolerance, with an absolute floor scaled by max|x|: 0.5 x (1 + tanh(u)) cancels for negative x
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6 * max(1.0, float(np.abs(inp).max())))


# ---- (a) simulator: v1 passes; broken launches are caught -------------------------------------------------------

@pytest.mark.parametrize("threads", [256, 32, 7])
def test_gelu_backward_v1(threads):
    r = check_gelu_backward(lambda *a: nb.gelu_backward(*a, version="v1", threads=threads), arrays="numba",
                            quiet=True)
    assert r.passed, r.message


@pytest.mark.parametrize("threads", [256, 7])
def test_residual_backward_v1(threads):
    r = check_residual_backward(lambda *a: nb.residual_backward(*a, version="v1", threads=threads),
                                arrays="numba", quiet=True)
    assert r.passed, r.message


@pytest.mark.parametrize("n", [1, 37, 300])
def test_gelu_forward_v1(n):
    check_forward(nb.gelu_forward, "numba", n, version="v1", threads=32)


def test_grid_stride_covers_any_n_with_one_small_block():
    # the grid-stride loop is why a launch of 1 block of 8 threads still writes every element
    r = check_gelu_backward(lambda d, x, di: nb.KERNELS["v1"][1, 8](d, x, di), arrays="numba", quiet=True)
    assert r.passed, r.message


def test_forward_instead_of_backward_is_caught():
    r = check_gelu_backward(lambda dout, inp, dinp: nb.gelu_forward(inp, dinp), arrays="numba", quiet=True)
    assert r.status == "wrong", r.message


def test_residual_writing_da_twice_is_caught():
    r = check_residual_backward(lambda dout, da, db: nb.KERNELS["residual_v1"][1, 32](dout, da, da),
                                arrays="numba", quiet=True)
    assert r.status == "wrong" and "db was never written" in r.hint, r.message


def test_forward_checker_catches_the_erf_gelu():
    import math

    def erf_gelu(inp, out):
        x = to_numpy(inp).astype(np.float64)
        out[:] = (0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))).astype(np.float32)
    with pytest.raises(AssertionError):
        check_forward(erf_gelu, "numpy", 300, seed=0)


def test_module_lists_every_kernel():
    assert set(nb.KERNELS) == set(nb.SIGNATURES) and not nb.GPU_ONLY
    assert all(v in nb.__doc__ for v in nb.KERNELS)


# ---- (b) wrapper input validation --------------------------------------------------------------------------------

def test_numba_wrappers_validate_inputs():
    x = np.zeros(10, np.float32)
    with pytest.raises(ValueError, match=r"dinp has shape \(9,\), expected \(10,\)"):
        nb.gelu_backward(x, x, np.zeros(9, np.float32))
    with pytest.raises(ValueError, match=r"inp has shape \(11,\), expected \(10,\)"):
        nb.gelu_backward(x, np.zeros(11, np.float32), x.copy())
    with pytest.raises(TypeError, match="inp must be float32, got dtype float64"):
        nb.gelu_forward(x.astype(np.float64), x.copy())
    with pytest.raises(ValueError, match=r"dout must be 1-D \(n,\), got shape \(2, 5\)"):
        nb.residual_backward(x.reshape(2, 5), x.reshape(2, 5).copy(), x.reshape(2, 5).copy())
    with pytest.raises(TypeError, match="db must be an array"):
        nb.residual_backward(x, x.copy(), [0.0] * 10)
    with pytest.raises(ValueError, match="version='v2' is not one of v1"):
        nb.gelu_backward(x, x, x.copy(), version="v2")
    with pytest.raises(ValueError, match=r"threads=0 must be in \[1, 1024\]"):
        nb.gelu_forward(x, x.copy(), threads=0)


def test_empty_arrays_launch_nothing():
    e = np.zeros(0, np.float32)
    nb.gelu_forward(e, e.copy())
    nb.gelu_backward(e, e, e.copy())
    nb.residual_backward(e, e.copy(), e.copy())


# ---- (c) GPU: both backends, large and awkward sizes -------------------------------------------------------------

@needs_numba_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("arrays", ["numba", "cupy"])
@pytest.mark.parametrize("size", ["small", "large"])
def test_numba_backward_on_gpu(size, arrays):
    if arrays == "cupy":
        pytest.importorskip("cupy")
    r = check_gelu_backward(lambda *a: nb.gelu_backward(*a, version="v1"), arrays=arrays, size=size)
    assert r.passed, r.message
    r = check_residual_backward(lambda *a: nb.residual_backward(*a, version="v1"), arrays=arrays, size=size)
    assert r.passed, r.message


@needs_numba_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 255, 257, 1_048_577, 4096 * 3072 + 5])
def test_numba_forward_on_gpu(n):
    check_forward(nb.gelu_forward, "numba", n, version="v1")


@pytest.mark.gpu
@pytest.mark.parametrize("size", ["small", "large"])
def test_hip_backward_on_gpu(size):
    hipg = hip_module()
    r = check_gelu_backward(lambda *a: hipg.gelu_backward(*a, version="v1"), arrays="cupy", size=size)
    assert r.passed, r.message
    r = check_residual_backward(lambda *a: hipg.residual_backward(*a, version="v1"), arrays="cupy", size=size)
    assert r.passed, r.message


@pytest.mark.gpu
@pytest.mark.parametrize("threads", [1, 64, 1024])
def test_hip_other_block_sizes_on_gpu(threads):
    hipg = hip_module()
    r = check_gelu_backward(lambda *a: hipg.gelu_backward(*a, threads=threads), arrays="cupy", size="large")
    assert r.passed, r.message
    r = check_residual_backward(lambda *a: hipg.residual_backward(*a, threads=threads), arrays="cupy", size="large")
    assert r.passed, r.message


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 255, 257, 1_048_577, 4096 * 3072 + 5])
def test_hip_forward_on_gpu(n):
    hipg = hip_module()
    check_forward(hipg.gelu_forward, "cupy", n, version="v1")


@pytest.mark.gpu
def test_hip_wrappers_validate_inputs_on_gpu():
    hipg = hip_module()
    import cupy as cp
    x = cp.zeros(10, cp.float32)
    with pytest.raises(TypeError, match="dout must be a CuPy array"):
        hipg.gelu_backward(np.zeros(10, np.float32), x, x.copy())
    with pytest.raises(TypeError, match="inp must be float32, got dtype float64"):
        hipg.gelu_forward(x.astype(cp.float64), x.copy())
    with pytest.raises(ValueError, match=r"db has shape \(9,\), expected \(10,\)"):
        hipg.residual_backward(x, x.copy(), cp.zeros(9, cp.float32))
    with pytest.raises(ValueError, match=r"dout must be 1-D, got shape \(2, 5\)"):
        hipg.gelu_backward(x.reshape(2, 5), x.reshape(2, 5), x.reshape(2, 5).copy())
    with pytest.raises(ValueError, match="inp must be C-contiguous"):
        hipg.gelu_forward(cp.zeros(20, cp.float32)[::2], x.copy())
    with pytest.raises(ValueError, match="version='v3' is not one of v1"):
        hipg.gelu_backward(x, x, x.copy(), version="v3")


def test_hip_wrappers_reject_unknown_versions_without_a_gpu():
    from gpullm_lessons.backends.hip import gelu as hip_gelu
    x = np.zeros(4, np.float32)
    for call in (lambda: hip_gelu.gelu_forward(x, x, version="v0"),
                 lambda: hip_gelu.gelu_backward(x, x, x, version="v0"),
                 lambda: hip_gelu.residual_backward(x, x, x, version="v0")):
        with pytest.raises(ValueError, match="version='v0' is not one of v1"):
            call()
