"""Causal attention backward: Numba v1 in the simulator (and on a GPU), HIP v1 and cuBLAS path on a GPU."""
import numpy as np
import pytest

from gpullm_lessons import checks, device
from gpullm_lessons.kernels.numba import attention as nb_attention


def test_numba_v1_passes_the_checker():
    r = checks.check_attention_backward(nb_attention.attention_backward, arrays="numba", quiet=True)
    assert r.status == "correct", r.message


def test_a_grid_one_block_short_is_caught():
    """The dq/dk/dv kernel launched one block short leaves the tail of dqkv unwritten (still poisoned)."""
    from numba import cuda

    def short(dout, qkv, att, dqkv, n_head):
        B, T, C3 = qkv.shape
        nh, C = n_head, C3 // 3
        datt = cuda.device_array((B, nh, T, T), np.float32)
        dpre = cuda.device_array((B, nh, T, T), np.float32)
        nb_attention.attention_datt_v1[(B * nh, T), 32](dout, qkv, datt, nh)
        nb_attention.attention_dpre_v1[(B * nh * T + 31) // 32, 32](att, datt, dpre, np.float32((C // nh) ** -0.5))
        n = B * T * C3
        nb_attention.attention_dqkv_v1[max((n + 63) // 64 - 1, 1), 64](dout, qkv, att, dpre, dqkv, nh)

    r = checks.check_attention_backward(short, arrays="numba", quiet=True)
    assert r.status == "wrong" and "never written" in r.hint, r.message


def test_bad_arguments_are_named():
    qkv = np.zeros((2, 5, 12), np.float32)
    with pytest.raises(ValueError, match="C = 4 is not divisible by n_head = 3"):
        nb_attention.attention_backward(np.zeros((2, 5, 4), np.float32), qkv, np.zeros((2, 3, 5, 5), np.float32),
                                        np.zeros_like(qkv), 3)
    with pytest.raises(ValueError, match=r"att is \(2, 2, 5, 4\), expected \(2, 2, 5, 5\)"):
        nb_attention.attention_backward(np.zeros((2, 5, 4), np.float32), qkv, np.zeros((2, 2, 5, 4), np.float32),
                                        np.zeros_like(qkv), 2)
    with pytest.raises(TypeError, match="qkv must be float32, got float64"):
        nb_attention.attention_backward(np.zeros((2, 5, 4), np.float32), qkv.astype(np.float64),
                                        np.zeros((2, 2, 5, 5), np.float32), np.zeros_like(qkv), 2)
    with pytest.raises(ValueError, match="version 'v9' unknown"):
        nb_attention.attention_backward(None, qkv, None, None, 2, version="v9")


@pytest.mark.gpu
@pytest.mark.parametrize("backend,version", [("numba", "v1"), ("hip", "v1"), ("hip", "cublas")])
def test_every_version_on_gpu_at_large_size(backend, version):
    if backend == "numba":
        fn, arrays = nb_attention.attention_backward, "numba"
    else:
        from gpullm_lessons.backends import _hip_attention
        fn, arrays = _hip_attention.attention_backward, "cupy"
    r = checks.check_attention_backward(lambda *a: fn(*a, version=version), arrays=arrays, size="large", quiet=True)
    assert r.status == "correct", r.message


# ---- the training loop's causal softmax forward / backward launchers (engine.py) ----------------------------------
def _causal_rows(rng, G, T):
    pre = rng.standard_normal((G * T, T), dtype=np.float32) * 3
    t = np.arange(G * T) % T
    mask = np.arange(T)[None, :] <= t[:, None]
    return pre, mask


def _reference_softmax(pre, mask, scale):
    z = np.where(mask, pre.astype(np.float64) * scale, -np.inf)
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def _launchers():
    """(name, launcher module, to device, to host) for every backend this machine runs."""
    dev = host = np.asarray
    if device.has_gpu():
        import cupy as cp
        from gpullm_lessons.backends import hip
        dev, host = cp.asarray, cp.asnumpy
        yield "hip", hip, dev, host
    if device.numba_available():
        yield "numba", nb_attention, dev, host


@pytest.mark.parametrize("G, T", [(3, 5), (2, 33)])
def test_causal_softmax_forward_and_backward_match_numpy(G, T):
    rng = np.random.default_rng()
    pre, mask = _causal_rows(rng, G, T)
    scale = 0.37
    att = _reference_softmax(pre, mask, scale)
    datt = rng.standard_normal(pre.shape)
    dpre = scale * att * (datt - (att * datt).sum(axis=1, keepdims=True))
    for name, K, dev, host in _launchers():
        out = dev(np.full_like(pre, np.nan))
        K.attention_softmax_forward(dev(pre), out, scale)
        np.testing.assert_allclose(host(out), att, rtol=1e-5, atol=1e-6, err_msg=name)
        got = dev(np.full_like(pre, np.nan))
        K.attention_softmax_backward(dev(att.astype(np.float32)), dev(datt.astype(np.float32)), got, scale)
        np.testing.assert_allclose(host(got), dpre, rtol=1e-4, atol=1e-5, err_msg=name)


def test_causal_softmax_reference_would_catch_a_missing_mask():
    """The comparison above can fail: a softmax over the whole row (no causal mask) is far from it."""
    pre, mask = _causal_rows(np.random.default_rng(0), 2, 6)
    assert not np.allclose(_reference_softmax(pre, np.ones_like(mask), 0.37), _reference_softmax(pre, mask, 0.37),
                           atol=1e-3)


def test_causal_softmax_bad_shapes_are_named():
    with pytest.raises(ValueError, match="multiple of T"):
        nb_attention.attention_softmax_forward(np.zeros((5, 4), np.float32), np.zeros((5, 4), np.float32), 1.0)
    with pytest.raises(TypeError, match="float32"):
        nb_attention.attention_softmax_forward(np.zeros((8, 4)), np.zeros((8, 4), np.float32), 1.0)
