"""Flash attention, the Numba kernels (kernels/numba/flash.py): forward (out, lse) and backward (dq, dk, dv).

Against the checkers of lesson 11 (the reference attention of lesson 01 as the oracle) and against a direct float64
computation at awkward shapes (T = 1, T not a multiple of the tile or of the block, hs up to HS_MAX); the backward
twice with the same bits; the launchers' argument errors. Simulator (CI): small shapes. GPU (`make gpu-test`): T = 1000,
1024 and 4096, hs = 64 and 128, B * nh = 192.
"""

import math

import numpy as np
import pytest

from gpullm_lessons import device
from gpullm_lessons.runtime.arrays import to_backend, to_numpy
from gpullm_lessons.checks.flash import check_flash_attention_backward, check_flash_attention_forward
from gpullm_lessons.contracts.flash import HS_MAX
from gpullm_lessons.kernels.numba import flash

GPU = device.numba_on_gpu()
needs_numba_gpu = pytest.mark.skipif(not GPU, reason=f"needs Numba on an NVIDIA GPU (this machine: {device.kind()})")
ARRAYS = "numba"


def direct(q, k, v, dout):
    """(out, lse, dq, dk, dv) in float64 from the full (T, T) matrices."""
    q, k, v, dout = (x.astype(np.float64) for x in (q, k, v, dout))
    hs, T = q.shape[-1], q.shape[-2]
    S = q @ k.swapaxes(-1, -2) / math.sqrt(hs)
    S = np.where(np.tril(np.ones((T, T), bool)), S, -np.inf)
    m = S.max(-1, keepdims=True)
    e = np.exp(S - m)
    P = e / e.sum(-1, keepdims=True)
    out = P @ v
    lse = (m + np.log(e.sum(-1, keepdims=True)))[..., 0]
    dP = dout @ v.swapaxes(-1, -2)
    dS = P * (dP - (dout * out).sum(-1, keepdims=True))
    return out, lse, dS @ k / math.sqrt(hs), dS.swapaxes(-1, -2) @ q / math.sqrt(hs), P.swapaxes(-1, -2) @ dout


def run(shape, seed, threads=64):
    rng = np.random.default_rng(seed)
    q, k, v, dout = (rng.standard_normal(shape).astype(np.float32) for _ in range(4))
    B, nh, T, hs = shape
    dev = [to_backend(x, ARRAYS) for x in (q, k, v, dout)]
    out = to_backend(np.full(shape, np.nan, np.float32), ARRAYS)
    lse = to_backend(np.full((B, nh, T), np.nan, np.float32), ARRAYS)
    flash.flash_attention_forward(dev[0], dev[1], dev[2], out, lse, threads=threads)
    grads = [to_backend(np.full(shape, np.nan, np.float32), ARRAYS) for _ in range(3)]
    flash.flash_attention_backward(dev[0], dev[1], dev[2], out, dev[3], lse, *grads, threads=threads)
    got = [to_numpy(x) for x in (out, lse, *grads)]
    return got, direct(q, k, v, dout)


def assert_close(got, want):
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert np.isfinite(g).all(), f"{name} has non-finite elements (never written?)"
        err = np.abs(g - w).max() / (np.abs(w).max() + 1e-30)
        assert err < 2e-5, f"{name}: max error {err:.2g} of its magnitude"


# ---- (a) simulator and GPU: the checkers, then awkward shapes ---------------------------------------------------------
@pytest.mark.parametrize("threads", [16, 7])
def test_forward_passes_its_checker(threads):
    r = check_flash_attention_forward(lambda q, k, v, o, lse: flash.flash_attention_forward(q, k, v, o, lse,
                                                                                          threads=threads),
                                      arrays=ARRAYS, seed=3, quiet=True)
    assert r.status == "correct", r.message


def test_backward_passes_its_checker_deterministically():
    def fn(q, k, v, o, do, lse, dq, dk, dv):
        flash.flash_attention_backward(q, k, v, o, do, lse, dq, dk, dv, threads=16)

    r = check_flash_attention_backward(fn, arrays=ARRAYS, seed=4, quiet=True)
    assert r.status == "correct" and "same bits twice" in r.message, r.message


@pytest.mark.parametrize("shape,threads", [((1, 1, 1, 4), 16), ((2, 3, 7, 8), 16), ((1, 2, 37, 16), 16),
                                           ((1, 1, 17, 33), 5), ((1, 1, 9, HS_MAX), 8)])
def test_awkward_shapes_match_the_direct_computation(shape, threads):
    got, want = run(shape, seed=sum(shape), threads=threads)
    assert_close(got, want)


def test_backward_gives_the_same_bits_twice():
    rng = np.random.default_rng(9)
    shape = (1, 2, 29, 8)
    q, k, v, do = (to_backend(rng.standard_normal(shape).astype(np.float32), ARRAYS) for _ in range(4))
    out = to_backend(np.zeros(shape, np.float32), ARRAYS)
    lse = to_backend(np.zeros(shape[:3], np.float32), ARRAYS)
    flash.flash_attention_forward(q, k, v, out, lse, threads=8)
    results = []
    for _ in range(2):
        g = [to_backend(np.full(shape, np.nan, np.float32), ARRAYS) for _ in range(3)]
        flash.flash_attention_backward(q, k, v, out, do, lse, *g, threads=8)
        results.append([to_numpy(x).tobytes() for x in g])
    assert results[0] == results[1]


# ---- (b) bad input: an error that names the argument ----------------------------------------------------------------
def args(shape=(1, 2, 5, 8), dtype=np.float32):
    B, nh, T, hs = shape
    return [np.zeros(shape, dtype) for _ in range(4)] + [np.zeros((B, nh, T), np.float32)]


@pytest.mark.parametrize("change,exc,words", [
    (lambda a: a.__setitem__(0, a[0].astype(np.float64)), TypeError, ["q must be float32", "float64"]),
    # k with 6 rows is the general form's Tk = 6 keys (tests/test_kernels_flash_general.py), so v's 5 are wrong
    (lambda a: a.__setitem__(1, np.zeros((1, 2, 6, 8), np.float32)), ValueError,
     ["v has shape (1, 2, 5, 8), expected (1, 2, 6, 8), the shape of k"]),
    (lambda a: a.__setitem__(0, np.zeros((2, 5, 8), np.float32)), ValueError, ["q must be 4-D"]),
    (lambda a: a.__setitem__(4, np.zeros((1, 2, 6), np.float32)), ValueError, ["lse has shape (1, 2, 6)"]),
    (lambda a: a.__setitem__(2, [[1.0]]), TypeError, ["v must be an array"]),
    (lambda a: a.__setitem__(3, np.zeros((1, 2, 5, 8), np.float32)[..., ::-1]), ValueError, ["out must be C-contig"]),
])
def test_forward_bad_arguments_are_named(change, exc, words):
    a = args()
    change(a)
    with pytest.raises(exc) as e:
        flash.flash_attention_forward(*a)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_head_size_past_the_register_arrays_is_refused():
    with pytest.raises(ValueError, match=f"1 <= hs <= {HS_MAX}"):
        flash.flash_attention_forward(*args((1, 1, 3, HS_MAX + 1)))


def test_backward_bad_arguments_are_named():
    q, k, v, out, lse = args()
    with pytest.raises(ValueError, match="dk has shape"):
        flash.flash_attention_backward(q, k, v, out, out.copy(), lse, q.copy(), np.zeros((1, 2, 5, 7), np.float32),
                                       v.copy())
    with pytest.raises(ValueError, match="version='v9'"):
        flash.flash_attention_backward(q, k, v, out, out.copy(), lse, q.copy(), k.copy(), v.copy(), version="v9")
    with pytest.raises(ValueError, match="threads=0"):
        flash.flash_attention_forward(q, k, v, out, lse, threads=0)


# ---- (c) GPU: realistic and awkward sizes ---------------------------------------------------------------------------
@needs_numba_gpu
@pytest.mark.parametrize("shape", [(1, 2, 1000, 64), (2, 2, 1024, 64), (1, 1, 4096, 64), (16, 12, 7, 64),
                                   (1, 2, 77, 128)])
def test_gpu_sizes_match_the_direct_computation(shape):
    got, want = run(shape, seed=1, threads=64)
    assert_close(got, want)


@needs_numba_gpu
def test_gpu_checkers_at_large_sizes():
    r = check_flash_attention_forward(flash.flash_attention_forward, arrays=ARRAYS, seed=2, quiet=True)
    assert r.status == "correct", r.message
    r = check_flash_attention_backward(flash.flash_attention_backward, arrays=ARRAYS, seed=2, quiet=True)
    assert r.status == "correct", r.message
