"""Lesson 02's tiled transpose (kernels/numba/transpose.py and kernels/hip/transpose.cu) against NumPy.

Shapes with partial tiles along both axes, a single element, an exact multiple of the tile, and a tall and a wide
matrix; the output is NaN-poisoned so an element that no thread writes fails. The HIP twin is compiled and linted
by tests/test_hip.py (every .cu file) and run here on a GPU.
"""
import numpy as np
import pytest

import gpullm_lessons  # noqa: F401  (before numba)
from gpullm_lessons import device
from gpullm_lessons.runtime import hip
from gpullm_lessons.kernels.numba import transpose

SHAPES = [(20, 37), (1, 1), (16, 32), (33, 5), (3, 50)]


@pytest.mark.skipif(not device.numba_available(), reason="Numba kernels need a GPU or the simulator")
@pytest.mark.parametrize("shape", SHAPES)
def test_numba_transpose_matches_numpy(shape):
    a = np.random.default_rng(sum(shape)).standard_normal(shape).astype(np.float32)
    out = np.full(shape[::-1], np.nan, np.float32)
    transpose.transpose(a, out)
    assert np.array_equal(out, a.T)


def test_transpose_rejects_a_wrong_output_shape():
    with pytest.raises(ValueError, match="need out of shape"):
        transpose.transpose(np.zeros((2, 3), np.float32), np.zeros((2, 3), np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES)
def test_hip_transpose_matches_numpy(shape):
    import cupy as cp
    R, S = shape
    a = np.random.default_rng(sum(shape)).standard_normal(shape).astype(np.float32)
    d_out = cp.full((S, R), cp.nan, cp.float32)
    hip.kernel("transpose", "transpose_tiled")(((S + 15) // 16, (R + 15) // 16), (16, 16),
                                                (cp.asarray(a), d_out, np.int32(R), np.int32(S)))
    assert cp.array_equal(d_out, cp.asarray(a.T))
