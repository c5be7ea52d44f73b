"""Checkers on a real GPU: CuPy and Numba device arrays at realistic sizes (size="large": N up to 4096, C = 768).

Skipped without a GPU (the simulator runs the same checkers at small sizes in test_checks.py)."""
import math

import pytest

from gpullm_lessons.checks import backward as checks
from gpullm_lessons import device

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


def attention_backward(dout, qkv, att, dqkv, n_head):
    B, T, C3 = qkv.shape
    C = C3 // 3
    hs = C // n_head

    def split(x):
        return x.reshape(B, T, n_head, hs).transpose(0, 2, 1, 3)

    def merge(x):
        return x.transpose(0, 2, 1, 3).reshape(B, T, C)

    q, k, v, dy = split(qkv[..., :C]), split(qkv[..., C:2 * C]), split(qkv[..., 2 * C:]), split(dout)
    datt = dy @ v.swapaxes(-1, -2)
    dpre = att * (datt - (att * datt).sum(axis=-1, keepdims=True)) / math.sqrt(hs)
    dqkv[..., :C], dqkv[..., C:2 * C], dqkv[..., 2 * C:] = merge(dpre @ k), merge(dpre.swapaxes(-1, -2) @ q), \
        merge(att.swapaxes(-1, -2) @ dy)


def encoder_backward(dout, idx, dwte, dwpe):
    import cupyx
    dwte[...] = 0
    dwpe[...] = 0
    cupyx.scatter_add(dwte, idx, dout)
    dwpe[:idx.shape[1]] = dout.sum(axis=0)


CASES = [(checks.check_linear_backward, linear_backward), (checks.check_softmax_backward, softmax_backward),
         (checks.check_layernorm_backward, layernorm_backward), (checks.check_gelu_backward, gelu_backward),
         (checks.check_crossentropy_backward, crossentropy_backward),
         (checks.check_residual_backward, residual_backward),
         (checks.check_attention_backward, attention_backward), (checks.check_encoder_backward, encoder_backward)]


@pytest.mark.parametrize("check,fn", CASES, ids=[c.__name__ for c, _ in CASES])
def test_cupy_implementations_pass_at_large_sizes(check, fn):
    r = check(fn, arrays="cupy", quiet=True)            # size=None: "large" on a GPU
    assert r.status == "correct", r.message
    assert r.dims.items() >= checks.CASE_DIMS[r.name]["large"][-1].items()   # every case ran, the last one too


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


def test_stale_answer_caught_on_the_gpu():
    memo = []

    def cached(dout, da, db):
        if not memo:
            residual_backward(dout, da, db)
            memo.append(da.copy())
        da[...] = memo[0]
        db[...] = memo[0]

    r = checks.check_residual_backward(cached, arrays="cupy", quiet=True)
    assert r.status == "wrong" and "EARLIER call" in r.hint, r.message


CAPPED_BLOCKS, THREADS = 4096, 256                  # the exercises' launchers on a GPU


def test_numba_kernel_without_grid_stride_fails_under_a_capped_launcher_on_gpu():
    from numba import cuda

    @cuda.jit
    def no_stride(dout, da, db):
        i = cuda.grid(1)
        if i < dout.shape[0]:
            da[i] = dout[i]
            db[i] = dout[i]

    @cuda.jit
    def stride(dout, da, db):
        for i in range(cuda.grid(1), dout.shape[0], cuda.gridsize(1)):
            da[i] = dout[i]
            db[i] = dout[i]

    def launcher(kernel):
        def run(dout, da, db):
            n = dout.shape[0]
            kernel[min(CAPPED_BLOCKS, (n + THREADS - 1) // THREADS), THREADS](dout, da, db)
        return run

    assert checks.check_residual_backward(launcher(stride), arrays="numba", quiet=True).status == "correct"
    r = checks.check_residual_backward(launcher(no_stride), arrays="numba", quiet=True)   # size=None: large
    assert r.status == "wrong" and r.first_bad == (CAPPED_BLOCKS * THREADS,), r.message
    assert "every element past index G = 1048576" in r.hint and "grid-stride loop" in r.hint, r.message


GELU_HIP = """#include "portable.h"
extern "C" __global__ void gelu_bwd(const float* __restrict__ dout, const float* __restrict__ inp,
                                    float* __restrict__ dinp, long long n) {
    const float s = 0.7978845608028654f, k = 0.044715f;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += STRIDE) {
        float x = inp[i];
        float t = tanhf(s * (x + k * x * x * x));
        dinp[i] = dout[i] * (0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * s * (1.0f + 3.0f * k * x * x));
    }
}
"""


@pytest.mark.parametrize("stride,status", [("(long long)gridDim.x * blockDim.x", "correct"), ("n", "wrong")])
def test_hip_source_is_run_on_the_gpu(stride, status):
    """On a GPU, source= is not compiled-only: the launcher runs the kernel; without a grid-stride loop it fails."""
    import cupy
    from gpullm_lessons.runtime import hip
    source = GELU_HIP.replace("STRIDE", stride)

    def gelu_hip(dout, inp, dinp):
        n = inp.shape[0]
        kernel = hip.kernel_from_source(source, "gelu_bwd")
        kernel((min(CAPPED_BLOCKS, (n + THREADS - 1) // THREADS),), (THREADS,), (dout, inp, dinp, cupy.int64(n)))

    r = checks.check_gelu_backward(gelu_hip, arrays="cupy", source=source, entries="gelu_bwd", quiet=True)
    assert r.status == status, r.message
    if status == "wrong":
        assert "every element past index G = 1048576" in r.hint, r.message
