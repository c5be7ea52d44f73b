"""Embedding (encoder) backward kernels: kernels/numba/encoder.py and kernels/hip/encoder.cu.

In the simulator: v1 (atomics) and v2 (deterministic buckets) against check_encoder_backward, broken launches
caught, the host-side bucketing, wrapper validation. On a GPU (`pytest -m gpu`): both versions, Numba and HIP, at
the checker's large size (V = 50257, C = 768) and awkward sizes; v2 gives the same bits on every run.
PTX for every KERNELS entry: tests/test_kernels_numba.py.
"""
import numpy as np
import pytest

from gpullm_lessons import reference
from gpullm_lessons.arrays import to_backend, to_numpy
from gpullm_lessons.checks import check_encoder_backward
from gpullm_lessons.kernels.numba import encoder as enc

SIM_VERSIONS = [v for v in enc.VERSIONS if v not in enc.GPU_ONLY]


def _inputs(B, T, C, V, maxT, seed):
    rng = np.random.default_rng(seed)
    dout = rng.standard_normal((B, T, C)).astype(np.float32)
    idx = rng.integers(0, min(V, 5), (B, T)).astype(np.int32)      # few distinct tokens: many repeats
    return dout, idx


def _expected(dout, idx, V, maxT):
    wte, wpe = np.zeros((V, dout.shape[2])), np.zeros((maxT, dout.shape[2]))
    _, cache = reference.encoder_forward(idx, wte, wpe)
    return reference.encoder_backward(dout.astype(np.float64), cache)


# ---- (a) the simulator ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arrays", ["numba", "numpy"])
@pytest.mark.parametrize("version", SIM_VERSIONS)
def test_passes_checker(version, arrays):
    r = check_encoder_backward(lambda *a: enc.encoder_backward(*a, version=version), arrays=arrays, quiet=True)
    assert r.passed, r.message


def test_broken_launches_are_caught():
    def no_zeroing(dout, idx, dwte, dwpe):               # v1 without the zeroing kernel: adds into NaN
        B, T, C = dout.shape
        enc.KERNELS["v1"][(B * T * C + 63) // 64, 64](dout, idx, dwte, dwpe)

    r = check_encoder_backward(no_zeroing, arrays="numba", quiet=True)
    assert not r.passed and "NaN" in r.hint

    def one_block(dout, idx, dwte, dwpe):                # v2 with a single block of 8 threads
        order, starts = enc.token_buckets(to_numpy(idx), dwte.shape[0])
        enc.KERNELS["v2"][1, 8](dout, to_backend(order, "numba"), to_backend(starts, "numba"), dwte)
        enc.KERNELS["v2_dwpe"][1, 8](dout, dwpe)

    r = check_encoder_backward(one_block, arrays="numba", quiet=True)
    assert not r.passed and "never written" in r.hint


def test_token_buckets():
    idx = np.array([[3, 1, 3], [0, 3, 1]], np.int32)     # positions 0..5 = b * T + t
    order, starts = enc.token_buckets(idx, V=5)
    np.testing.assert_array_equal(starts, [0, 1, 3, 3, 6, 6])       # token 2 and 4: empty buckets
    np.testing.assert_array_equal(order, [3, 1, 5, 0, 2, 4])        # each bucket in increasing position order
    with pytest.raises(ValueError, match=r"idx must be in \[0, V=3\), got min 0, max 3"):
        enc.token_buckets(idx, V=3)


@pytest.mark.parametrize("version", SIM_VERSIONS)
def test_many_repeats_and_unused_rows(version):
    """Five tokens only, V = 9 (rows 5..8 never touched, must be 0), maxT > T (rows T.. of dwpe are 0)."""
    B, T, C, V, maxT = 3, 7, 5, 9, 11
    dout, idx = _inputs(B, T, C, V, maxT, seed=4)
    dwte = np.full((V, C), np.nan, np.float32)
    dwpe = np.full((maxT, C), np.nan, np.float32)
    enc.encoder_backward(dout, idx, dwte, dwpe, version=version)
    dwte_ref, dwpe_ref = _expected(dout, idx, V, maxT)
    np.testing.assert_allclose(dwte, dwte_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dwpe, dwpe_ref, rtol=1e-5, atol=1e-6)


# ---- (b) wrapper validation ----------------------------------------------------------------------------------------
def test_validation_errors():
    dout, idx = np.zeros((2, 3, 4), np.float32), np.zeros((2, 3), np.int32)
    dwte, dwpe = np.zeros((7, 4), np.float32), np.zeros((5, 4), np.float32)
    with pytest.raises(ValueError, match="dout must be 3-D"):
        enc.encoder_backward(dout[0], idx, dwte, dwpe)
    with pytest.raises(ValueError, match=r"idx has shape \(3, 2\), expected \(2, 3\)"):
        enc.encoder_backward(dout, idx.T.copy(), dwte, dwpe)
    with pytest.raises(TypeError, match="idx has dtype int64, expected int32"):
        enc.encoder_backward(dout, idx.astype(np.int64), dwte, dwpe)
    with pytest.raises(ValueError, match=r"dwte has shape \(7, 5\), expected \(7, 4\)"):
        enc.encoder_backward(dout, idx, np.zeros((7, 5), np.float32), dwpe)
    with pytest.raises(TypeError, match="dwpe has dtype float64, expected float32"):
        enc.encoder_backward(dout, idx, dwte, dwpe.astype(np.float64))
    with pytest.raises(ValueError, match=r"needs maxT >= T = 3 rows"):
        enc.encoder_backward(dout, idx, dwte, np.zeros((2, 4), np.float32))
    with pytest.raises(ValueError, match="version='v3'"):
        enc.encoder_backward(dout, idx, dwte, dwpe, version="v3")
    with pytest.raises(ValueError, match=r"idx must be in \[0, V=7\)"):
        enc.encoder_backward(dout, idx + 7, dwte, dwpe, version="v2")


def test_hip_wrapper_validation_without_gpu():
    from gpullm_lessons.backends import _hip_encoder as henc
    dout, idx = np.zeros((2, 3, 4), np.float32), np.zeros((2, 3), np.int32)
    with pytest.raises(TypeError, match="dout must be a CuPy array"):
        henc.encoder_backward(dout, idx, np.zeros((7, 4), np.float32), np.zeros((5, 4), np.float32))
    with pytest.raises(ValueError, match="dwpe must be 2-D"):
        henc.encoder_backward(dout, idx, np.zeros((7, 4), np.float32), np.zeros(5, np.float32))
    with pytest.raises(ValueError, match=r"idx must be in \[0, V=2\), got min 0, max 4"):
        henc._token_buckets(np.array([0, 4]), V=2)


# ---- (c) on a GPU ----------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("size", ["small", "large"])
@pytest.mark.parametrize("version", enc.VERSIONS)
def test_numba_on_gpu(version, size):
    for threads in (None, 96, 1024):
        r = check_encoder_backward(lambda *a: enc.encoder_backward(*a, version=version, threads=threads),
                                   arrays="numba", size=size, quiet=True)
        assert r.passed, (threads, r.message)


@pytest.mark.gpu
@pytest.mark.parametrize("size", ["small", "large"])
@pytest.mark.parametrize("version", enc.VERSIONS)
def test_hip_on_gpu(version, size):
    from gpullm_lessons.backends import _hip_encoder as henc
    for threads in (96, 256, 1024):
        r = check_encoder_backward(lambda *a: henc.encoder_backward(*a, version=version, threads=threads),
                                   arrays="cupy", size=size, quiet=True)
        assert r.passed, (threads, r.message)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["numba", "hip"])
def test_v2_is_deterministic_on_gpu(backend):
    """GPT-2 sizes with heavy token repeats: v2 gives the same bits on every run, and matches float64."""
    if backend == "hip":
        from gpullm_lessons.backends import _hip_encoder as mod
        arrays = "cupy"
    else:
        mod, arrays = enc, "numba"
    B, T, C, V, maxT = 8, 1000, 768, 50257, 1024
    dout, idx = _inputs(B, T, C, V, maxT, seed=5)
    d_dout, d_idx = to_backend(dout, arrays), to_backend(idx, arrays)
    runs = []
    for _ in range(3):
        dwte = to_backend(np.full((V, C), np.nan, np.float32), arrays)
        dwpe = to_backend(np.full((maxT, C), np.nan, np.float32), arrays)
        mod.encoder_backward(d_dout, d_idx, dwte, dwpe, version="v2")
        runs.append((to_numpy(dwte), to_numpy(dwpe)))
    for dwte, dwpe in runs[1:]:
        np.testing.assert_array_equal(dwte, runs[0][0])
        np.testing.assert_array_equal(dwpe, runs[0][1])
    dwte_ref, dwpe_ref = _expected(dout, idx, V, maxT)
    np.testing.assert_allclose(runs[0][0], dwte_ref, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(runs[0][1], dwpe_ref, rtol=1e-4, atol=1e-4)
