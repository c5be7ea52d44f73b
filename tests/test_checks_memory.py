"""check_block_recompute and check_layernorm_rebuild: the right answers pass bitwise, each plausible mistake fails
with the hint that names it, not attempted / error are reported (never raised)."""
import numpy as np
import pytest

from gpullm_lessons.checks_memory import check_block_recompute, check_layernorm_rebuild
from gpullm_lessons.reference.gpt import block_backward, block_forward

SEEDS = range(6)


def right(x_in, params, l, n_head, dx_out, grads):
    _, c = block_forward(params, l, x_in, n_head)
    return block_backward(dx_out, c, grads, l)


def skipped_block(x_in, params, l, n_head, dx_out, grads):      # only the residual path
    _, c = block_forward(params, l, x_in, n_head)
    block_backward(dx_out, c, grads, l)
    return dx_out


def layer_off_by_one(x_in, params, l, n_head, dx_out, grads):
    _, c = block_forward(params, l - 1, x_in, n_head)               # stale / other layer's weights
    return block_backward(dx_out, c, grads, l)


def accumulates(x_in, params, l, n_head, dx_out, grads):
    _, c = block_forward(params, l, x_in, n_head)
    fresh = grads.zeros_like()
    dx = block_backward(dx_out, c, fresh, l)
    for name in grads.names:
        grads[name][l:l + 1] += fresh[name][l:l + 1] if grads[name].ndim > 1 and name not in (
            "wte", "wpe") else 0
    return dx


def not_recomputed(x_in, params, l, n_head, dx_out, grads):
    return block_backward(dx_out, None, grads, l)


def into_copy(x_in, params, l, n_head, dx_out, grads):
    _, c = block_forward(params, l, x_in, n_head)
    return block_backward(dx_out, c, grads.copy(), l)


def wrong_slice(x_in, params, l, n_head, dx_out, grads):
    _, c = block_forward(params, l, x_in, n_head)
    return block_backward(dx_out, c, grads, (l + 1) % params.cfg.n_layer)


def zeroes_all(x_in, params, l, n_head, dx_out, grads):
    grads.flat[...] = 0
    return right(x_in, params, l, n_head, dx_out, grads)


def in_float64(x_in, params, l, n_head, dx_out, grads):
    p64 = params.copy()
    p64 = {k: v.astype(np.float64) for k, v in params.items()}
    g64 = {k: v.astype(np.float64) for k, v in grads.items()}
    _, c = block_forward(p64, l, x_in.astype(np.float64), n_head)
    dx = block_backward(dx_out.astype(np.float64), c, g64, l)
    for k in grads.names:
        grads[k][...] = g64[k]
    return dx.astype(np.float32)


def returns_none(x_in, params, l, n_head, dx_out, grads):
    right(x_in, params, l, n_head, dx_out, grads)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_right_passes(seed, dtype):
    r = check_block_recompute(right, dtype=dtype, seed=seed, quiet=True)
    assert r.status == "correct", r.message


@pytest.mark.parametrize("fn, status, words", [
    (skipped_block, "wrong", "incoming gradient unchanged"),
    (layer_off_by_one, "wrong", "weights"),
    (accumulates, "wrong", "accumulated"),
    (not_recomputed, "error", "not recomputed"),
    (into_copy, "wrong", "not a copy"),
    (wrong_slice, "wrong", "write into layer l"),
    (zeroes_all, "wrong", "do not zero"),
    (in_float64, "wrong", "bitwise"),
    (returns_none, "wrong", "return d(x_in)"),
])
@pytest.mark.parametrize("seed", SEEDS)
def test_mistakes_named(fn, status, words, seed):
    r = check_block_recompute(fn, seed=seed, quiet=True)
    assert r.status == status, r.message
    assert words in r.hint, r.message


def test_not_attempted_and_error_reported_not_raised(capsys):
    def todo(*a):
        raise NotImplementedError("exercise: write this part")
    assert check_block_recompute(todo, quiet=True).status == "not attempted"

    def boom(*a):
        raise RuntimeError("oops")
    r = check_block_recompute(boom)
    assert r.status == "error" and "oops" in r.message
    out = capsys.readouterr().out
    assert out.startswith("block_recompute: error") and "seed" in out
    with pytest.raises(TypeError):
        check_block_recompute(right(*[None] * 6) if False else 3)


def test_fresh_inputs_and_seed_reproduces():
    a = check_block_recompute(right, seed=5, quiet=True)
    b = check_block_recompute(right, seed=5, quiet=True)
    assert a.message == b.message and a.dims == b.dims and "seed 5" in a.message


# ---------------------------------------------------------------------------------------------- 08.2

def ln_right(inp, mean, rstd, weight, bias):
    xhat = (inp - mean[..., None]) * rstd[..., None]
    return xhat * weight + bias


@pytest.mark.parametrize("seed", SEEDS)
def test_layernorm_rebuild_right(seed):
    r = check_layernorm_rebuild(ln_right, seed=seed, quiet=True)
    assert r.status == "correct", r.message


@pytest.mark.parametrize("fn, words", [
    (lambda i, m, r, w, b: (i - m[..., None]) * r[..., None] * w, "bias is missing"),
    (lambda i, m, r, w, b: (i - m[..., None]) * r[..., None] + b, "weight is missing"),
    (lambda i, m, r, w, b: (i - m[..., None]) / r[..., None] * w + b, "divided by rstd"),
    (lambda i, m, r, w, b: i * r[..., None] * w + b, "mean was not subtracted"),
    (lambda i, m, r, w, b: i * r[..., None] * w - m[..., None] * r[..., None] * w + b, "bitwise"),
    (lambda i, m, r, w, b: None, "return"),
])
@pytest.mark.parametrize("seed", SEEDS)
def test_layernorm_rebuild_mistakes(fn, words, seed):
    r = check_layernorm_rebuild(fn, seed=seed, quiet=True)
    assert r.status == "wrong", r.message
    assert words in r.hint, r.message


def test_layernorm_rebuild_broadcast_error():
    r = check_layernorm_rebuild(lambda i, m, r, w, b: (i - m) * r * w + b, seed=1, quiet=True)
    assert r.status == "error" and "mean[..., None]" in r.hint, r.message
