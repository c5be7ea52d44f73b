"""Checkers on a real GPU: CuPy and Numba device arrays at realistic sizes (size="large": N up to 4096, C = 768).

Skipped without a GPU (the simulator runs the same checkers at small sizes in test_checks.py)."""
import math

import numpy as np
import pytest

from gpullm_lessons import checks, device

pytestmark = pytest.mark.gpu
S, K = math.sqrt(2 / math.pi), 0.044715


def _xp(a):
    import cupy
    return cupy.get_array_module(a)


def linear_backward(dout, inp, weight, dinp, dweight, dbias):
    dinp[...] = dout @ weight.T
    dweight[...] = inp.T @ dout
    dbias[...] = dout.sum(axis=0)


def softmax_backward(dout, out, dinp):
    dinp[...] = out * (dout - (out * dout).sum(axis=-1, keepdims=True))


def layernorm_backward(dout, inp, weight, mean, rstd, dinp, dweight, dbias, mean_term=True):
    xhat = (inp - mean[:, None]) * rstd[:, None]
    g = dout * weight
    gm = g.mean(axis=-1, keepdims=True) if mean_term else 0
    dinp[...] = rstd[:, None] * (g - gm - xhat * (g * xhat).mean(axis=-1, keepdims=True))
    dweight[...] = (dout * xhat).sum(axis=0)
    dbias[...] = dout.sum(axis=0)


def gelu_backward(dout, inp, dinp):
    xp = _xp(inp)
    t = xp.tanh(S * (inp + K * inp ** 3))
    dinp[...] = dout * (0.5 * (1 + t) + 0.5 * inp * (1 - t * t) * S * (1 + 3 * K * inp ** 2))


def crossentropy_backward(logits, targets, dlogits):
    xp = _xp(logits)
    e = xp.exp(logits - logits.max(axis=-1, keepdims=True))
    p = e / e.sum(axis=-1, keepdims=True)
    p[xp.arange(logits.shape[0]), targets] -= 1
    dlogits[...] = p / logits.shape[0]


def residual_backward(dout, da, db):
    da[...] = dout
    db[...] = dout


CASES = [(checks.check_linear_backward, linear_backward), (checks.check_softmax_backward, softmax_backward),
         (checks.check_layernorm_backward, layernorm_backward), (checks.check_gelu_backward, gelu_backward),
         (checks.check_crossentropy_backward, crossentropy_backward),
         (checks.check_residual_backward, residual_backward)]


@pytest.mark.parametrize("check,fn", CASES, ids=[c.__name__ for c, _ in CASES])
def test_cupy_implementations_pass_at_large_sizes(check, fn):
    r = check(fn, arrays="cupy", size="large", quiet=True)
    assert r.status == "correct", r.message


def test_cupy_mistake_caught_at_large_size():
    def no_mean_term(*args):
        layernorm_backward(*args, mean_term=False)
    r = checks.check_layernorm_backward(no_mean_term, arrays="cupy", size="large", quiet=True)
    assert r.status == "wrong" and "mean" in r.hint, r.message


def test_numba_kernel_on_gpu_and_unwritten_tail_caught():
    assert device.numba_on_gpu()
    from numba import cuda

    @cuda.jit
    def residual_kernel(dout, da, db, n):
        i = cuda.grid(1)
        if i < n:
            da[i] = dout[i]
            db[i] = dout[i]

    def full(dout, da, db):
        n = dout.shape[0]
        residual_kernel[(n + 255) // 256, 256](dout, da, db, n)

    def short(dout, da, db):  # one block too few: the tail stays poisoned
        n = dout.shape[0]
        residual_kernel[max(n // 256, 1), 256](dout, da, db, n)

    assert checks.check_residual_backward(full, arrays="numba", size="large", quiet=True).status == "correct"
    r = checks.check_residual_backward(short, arrays="numba", size="large", quiet=True)
    assert r.status == "wrong" and "never written" in r.hint, r.message
