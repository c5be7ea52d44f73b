"""linear_backward kernels: Numba (kernels/numba/linear.py, in the simulator here) and HIP (kernels/hip/linear.cu,
launched by gpullm_lessons/backends/hip/linear.py on a GPU), against check_linear_backward and NumPy.

The PTX compile of every Numba version is in test_kernels_numba.py, the NVRTC/hipcc compile and lint in test_hip.py.
"""
import numpy as np
import pytest

from gpullm_lessons.checks import backward as checks
from gpullm_lessons import device
from gpullm_lessons.backends.hip import linear as hip_linear
from gpullm_lessons.kernels.numba import linear as numba_linear
from gpullm_lessons.kernels.numba.linear import GPU_ONLY, KERNELS, TILE, VERSIONS, linear_backward

SIM_VERSIONS = [v for v in VERSIONS if v not in GPU_ONLY]


def _check(fn, **kw):
    return checks.check_linear_backward(fn, arrays="numba", quiet=True, **kw)


def _inputs(N, C, OC, seed=0):
    rng = np.random.default_rng(seed)
    dout = rng.standard_normal((N, OC)).astype(np.float32)
    inp = rng.standard_normal((N, C)).astype(np.float32)
    weight = rng.standard_normal((C, OC)).astype(np.float32)
    return dout, inp, weight


def _expected(dout, inp, weight):
    d, x, w = (a.astype(np.float64) for a in (dout, inp, weight))
    return d @ w.T, x.T @ d, d.sum(axis=0)


def _assert_close(name, ours, expected, tol=1e-5):
    """The checker's rule: |ours - expected| <= tol * (|expected| + max|expected|), every element written."""
    M = float(np.abs(expected).max()) if expected.size else 0.0
    ok = np.abs(ours.astype(np.float64) - expected) <= tol * (np.abs(expected) + M)
    assert ok.all(), f"{name}: {int((~ok).sum())} of {ok.size} elements wrong, first at {np.argwhere(~ok)[0]}"


def _run_direct(fn, to_dev, to_host, N, C, OC, seed=0):
    """fn on the awkward shape (N, C, OC) with NaN-filled outputs; compare with NumPy in float64."""
    dout, inp, weight = _inputs(N, C, OC, seed)
    outs = [np.full(s, np.nan, np.float32) for s in ((N, C), (C, OC), (OC,))]
    dev = [to_dev(a) for a in (dout, inp, weight, *outs)]
    fn(*dev)
    for name, d, e in zip(("dinp", "dweight", "dbias"), dev[3:], _expected(dout, inp, weight)):
        _assert_close(name, to_host(d), e)


# Awkward shapes (N, C, OC): single elements, a dimension of 0 rows (dweight and dbias must be all zeros), and sizes
# that cross the 16- (v1, v2) and 64-element (v3) block tiles with a partial last tile.
SIM_SHAPES = [(1, 1, 1), (0, 3, 2), (70, 2, 3), (3, 66, 2)]


# ---- (a) in the simulator (or on a GPU when there is one): the checker, awkward shapes, broken variants ---------

@pytest.mark.parametrize("version", SIM_VERSIONS)
def test_numba_version_passes_checker(version):
    r = _check(lambda *a: linear_backward(*a, version=version), seed=11 + SIM_VERSIONS.index(version))
    assert r.status == "correct", r.message


@pytest.mark.parametrize("shape", SIM_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("version", SIM_VERSIONS)
def test_numba_version_on_awkward_shapes(version, shape):
    from numba import cuda
    _run_direct(lambda *a: linear_backward(*a, version=version), cuda.to_device, lambda d: d.copy_to_host(), *shape)


def test_checker_catches_too_few_dbias_threads():
    """One thread short for dbias: its last element keeps the checker's NaN poison."""
    def broken(dout, inp, weight, dinp, dweight, dbias):
        numba_linear.matmul(dout, weight, dinp, trans_b=True, version="v1")
        numba_linear.matmul(inp, dout, dweight, trans_a=True, version="v1")
        KERNELS["v1_dbias"][1, dbias.shape[0] - 1](dout, dbias)      # should be OC threads
    r = _check(broken, seed=3)
    assert r.status == "wrong" and r.output == "dbias", r.message
    assert "never written" in r.hint


def test_checker_catches_missing_transpose_flag():
    """dweight launched without trans_a: inp @ dout instead of inp.T @ dout (the square first case shows it)."""
    def broken(dout, inp, weight, dinp, dweight, dbias):
        numba_linear.matmul(dout, weight, dinp, trans_b=True, version="v2")
        numba_linear.matmul(inp, dout, dweight, trans_a=False, version="v2")   # should be trans_a=True
        KERNELS["v1_dbias"][1, 256](dout, dbias)
    r = _check(broken, seed=4)
    assert r.status == "wrong" and r.output == "dweight", r.message
    assert "missing transpose in dweight" in r.hint


def test_checker_catches_grid_rounded_down():
    """blocks = n // TILE instead of ceil(n / TILE): the last partial tile (or, below 16, everything) is missed."""
    def broken(dout, inp, weight, dinp, dweight, dbias):
        for a, b, out, ta, tb in ((dout, weight, dinp, 0, 1), (inp, dout, dweight, 1, 0)):
            M, P = out.shape
            grid = (max(P // TILE, 1), max(M // TILE, 1))                 # rounded down: wrong
            KERNELS["v2"][grid, (TILE, TILE)](a, b, out, np.int32(ta), np.int32(tb))
        KERNELS["v1_dbias"][1, 256](dout, dbias)
    r = _check(broken, seed=5)   # seed 5: the rectangular case has C = 23 channels, 7 of them in a partial tile
    assert r.status == "wrong" and "never written" in r.hint, r.message


# ---- (b) wrapper input validation (no GPU needed: the HIP wrapper validates before touching CuPy) -----------------

def _good(N=5, C=3, OC=4):
    dout, inp, weight = _inputs(N, C, OC)
    return [dout, inp, weight, np.zeros((N, C), np.float32), np.zeros((C, OC), np.float32),
            np.zeros(OC, np.float32)]


WRAPPERS = {"numba": linear_backward, "hip": hip_linear.linear_backward}


@pytest.mark.parametrize("backend", WRAPPERS)
@pytest.mark.parametrize("index, bad, exc, match", [
    (3, np.zeros((3, 5), np.float32), ValueError, r"dinp has shape \(3, 5\), expected \(5, 3\)"),
    (4, np.zeros((4, 3), np.float32), ValueError, r"dweight has shape \(4, 3\), expected \(3, 4\)"),
    (5, np.zeros(3, np.float32), ValueError, r"dbias has shape \(3,\), expected \(4,\)"),
    (2, np.zeros((4, 3), np.float32), ValueError, r"weight has shape \(4, 3\), expected \(3, 4\)"),
    (1, np.zeros((6, 3), np.float32), ValueError, r"inp has shape \(6, 3\), expected \(5, 3\)"),
    (0, np.zeros((2, 5, 4), np.float32), ValueError, r"dout must be 2-D, got shape \(2, 5, 4\)"),
    (1, np.zeros((5, 3), np.float64), TypeError, r"inp must be float32, got dtype float64"),
    (5, [0.0] * 4, TypeError, r"dbias must be an array, got list"),
], ids=["dinp", "dweight", "dbias", "weight", "inp", "dout-3d", "float64", "list"])
def test_wrapper_rejects_bad_arguments(backend, index, bad, exc, match):
    args = _good()
    args[index] = bad
    with pytest.raises(exc, match=match):
        WRAPPERS[backend](*args)


@pytest.mark.parametrize("backend", WRAPPERS)
def test_wrapper_rejects_unknown_version(backend):
    with pytest.raises(ValueError, match=r"unknown version='v9'; use one of 'v1', 'v2', 'v3'"):
        WRAPPERS[backend](*_good(), version="v9")


def test_hip_wrapper_wants_cupy_arrays():
    with pytest.raises(TypeError, match=r"dout must be a CuPy array .* got numpy.ndarray"):
        hip_linear.linear_backward(*_good(), version="v2")


def test_gpu_only_versions_refused_in_simulator(monkeypatch):
    if device.numba_on_gpu():
        pytest.skip("Numba runs on a real GPU here")
    monkeypatch.setattr(numba_linear, "GPU_ONLY", {"v3"})
    with pytest.raises(RuntimeError, match=r"version='v3' uses GPU-only features"):
        linear_backward(*_good(), version="v3")


# ---- (c) on a GPU (the lead runs these on an H200): every version, both backends, large and awkward sizes --------

GPU_SHAPES = [(1, 1, 1), (0, 5, 7), (4097, 17, 33), (33, 1000, 65), (130, 70, 1), (1000, 768, 2304)]
HIP_VERSIONS = list(hip_linear.VERSIONS)


@pytest.mark.gpu
@pytest.mark.parametrize("size", ["small", "large"])
@pytest.mark.parametrize("version", VERSIONS)
def test_numba_version_on_gpu(version, size):
    r = checks.check_linear_backward(lambda *a: linear_backward(*a, version=version), arrays="numba", size=size,
                                     quiet=True)
    assert r.status == "correct", r.message


@pytest.mark.gpu
@pytest.mark.parametrize("size", ["small", "large"])
@pytest.mark.parametrize("version", HIP_VERSIONS)
def test_hip_version_on_gpu(version, size):
    r = checks.check_linear_backward(lambda *a: hip_linear.linear_backward(*a, version=version), arrays="cupy",
                                     size=size, quiet=True)
    assert r.status == "correct", r.message


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("version", VERSIONS)
def test_numba_version_on_gpu_awkward_shapes(version, shape):
    from numba import cuda
    _run_direct(lambda *a: linear_backward(*a, version=version), cuda.to_device, lambda d: d.copy_to_host(), *shape)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("version", HIP_VERSIONS)
def test_hip_version_on_gpu_awkward_shapes(version, shape):
    import cupy
    _run_direct(lambda *a: hip_linear.linear_backward(*a, version=version), cupy.asarray, cupy.asnumpy, *shape)


@pytest.mark.gpu
def test_hip_wrapper_rejects_non_contiguous_cupy_array():
    import cupy
    args = [cupy.asarray(a) for a in _good()]
    args[2] = cupy.asfortranarray(args[2])
    with pytest.raises(ValueError, match="weight must be C-contiguous"):
        hip_linear.linear_backward(*args)
