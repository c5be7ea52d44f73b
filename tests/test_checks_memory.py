"""Lesson 08's checkers (check_block_recompute, check_layernorm_rebuild, check_selective_rebuild): the right answers
pass bitwise; each plausible mistake fails on every seed with the hint that names it (stale activations, a hard-coded
or shifted layer index, the selective cache modified, ...); not attempted / error are reported, never raised."""
import numpy as np
import pytest

from gpullm_lessons.checks.memory import check_block_recompute, check_layernorm_rebuild, check_selective_rebuild
from gpullm_lessons.reference.gelu import gelu_forward
from gpullm_lessons.reference.gpt import block_backward, block_forward
from gpullm_lessons.reference.layernorm import layernorm_forward

SEEDS = range(6)


# ---------------------------------------------------------------------------------------------- 08.1

def right(x_in, params, l, n_head, dx_out, grads):
    _, c = block_forward(params, l, x_in, n_head)
    return block_backward(dx_out, c, grads, l)


def skipped_block(x_in, params, l, n_head, dx_out, grads):      # only the residual path
    _, c = block_forward(params, l, x_in, n_head)
    block_backward(dx_out, c, grads, l)
    return dx_out


def layer_off_by_one(x_in, params, l, n_head, dx_out, grads):
    _, c = block_forward(params, l - 1, x_in, n_head)               # another layer's weights
    return block_backward(dx_out, c, grads, l)


def hard_coded_layer_0(x_in, params, l, n_head, dx_out, grads):   # right whenever l happens to be 0
    _, c = block_forward(params, 0, x_in, n_head)
    return block_backward(dx_out, c, grads, 0)


def hard_coded_forward_0(x_in, params, l, n_head, dx_out, grads):
    _, c = block_forward(params, 0, x_in, n_head)
    return block_backward(dx_out, c, grads, l)


_CACHE = {}


def stale_cache(x_in, params, l, n_head, dx_out, grads):          # the first call's activations, kept
    if "c" not in _CACHE:
        _CACHE["c"] = block_forward(params, l, x_in, n_head)[1]
    return block_backward(dx_out, _CACHE["c"], grads, l)


_BY_LAYER = {}


def stale_cache_per_layer(x_in, params, l, n_head, dx_out, grads):   # a cache per layer: right once per layer
    if l not in _BY_LAYER:
        _BY_LAYER[l] = block_forward(params, l, x_in, n_head)[1]
    return block_backward(dx_out, _BY_LAYER[l], grads, l)


_RESULT = {}


def stale_result(x_in, params, l, n_head, dx_out, grads):
    if "dx" not in _RESULT:
        _RESULT["dx"] = right(x_in, params, l, n_head, dx_out, grads)
    return _RESULT["dx"]


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
    (layer_off_by_one, "wrong", "off by -1"),
    (hard_coded_layer_0, "wrong", "hard-coded: every call used layer 0"),
    (hard_coded_forward_0, "wrong", "hard-coded: every call used layer 0"),
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


@pytest.mark.parametrize("fn, store", [(stale_cache, _CACHE), (stale_cache_per_layer, _BY_LAYER),
                                       (stale_result, _RESULT)])
@pytest.mark.parametrize("seed", SEEDS)
def test_stale_activations_fail_with_a_hint(fn, store, seed):
    """A cache kept from an earlier call used to pass: the checker called the function once."""
    store.clear()
    r = check_block_recompute(fn, seed=seed, quiet=True)
    assert r.status == "wrong" and "stale activations" in r.hint, r.message
    assert "call 1" not in r.message.split("(call")[-1][:8], r.message     # found on a later call


def test_hard_coded_layer_fails_on_every_seed_and_names_the_layer():
    """A hard-coded layer 0 used to pass whenever the one random layer drawn was 0."""
    for seed in range(20):
        r = check_block_recompute(hard_coded_layer_0, seed=seed, quiet=True)
        assert r.status == "wrong" and "layer 0's weights" in r.message, r.message
        assert "for l = 2" in r.message and "call 1 of 6" in r.message, r.message


def test_every_layer_index_is_tried_with_new_inputs():
    seen = []

    def spy(x_in, params, l, n_head, dx_out, grads):
        seen.append((params.cfg.n_layer, l, x_in.shape, float(x_in.flat[0])))
        return right(x_in, params, l, n_head, dx_out, grads)
    assert check_block_recompute(spy, seed=1, quiet=True).status == "correct"
    assert sorted({(L, l) for L, l, _, _ in seen}) == [(2, 0), (2, 1), (3, 0), (3, 1), (3, 2)]
    assert len({v for *_, v in seen}) == len(seen)                         # every call gets a new x_in
    assert any(shape[1] == 1 for _, _, shape, _ in seen)                   # T = 1


def test_not_attempted_and_error_reported_not_raised(capsys):
    def todo(*a):
        raise NotImplementedError("exercise: write this part")
    assert check_block_recompute(todo, quiet=True).status == "not attempted"

    def boom(*a):
        raise RuntimeError("oops")
    r = check_block_recompute(boom)
    assert r.status == "error" and "oops" in r.message and "call 1 of 6" in r.hint
    out = capsys.readouterr().out
    assert out.startswith("block_recompute: error") and "seed" in out
    with pytest.raises(TypeError):
        check_block_recompute(3)


def test_fresh_inputs_and_seed_reproduces():
    a = check_block_recompute(right, seed=5, quiet=True)
    b = check_block_recompute(right, seed=5, quiet=True)
    assert a.message == b.message and a.dims == b.dims and "seed 5" in a.message


# ---------------------------------------------------------------------------------------------- 08.2

def ln_right(inp, mean, rstd, weight, bias):
    xhat = (inp - mean[..., None]) * rstd[..., None]
    return xhat * weight + bias


def ln_recomputes(inp, mean, rstd, weight, bias):                  # recomputing the statistics is bitwise the same
    return layernorm_forward(inp, weight, bias)[0]


_LN = {}


def ln_stale(inp, mean, rstd, weight, bias):
    if "out" not in _LN:
        _LN["out"] = ln_right(inp, mean, rstd, weight, bias)
    return _LN["out"]


@pytest.mark.parametrize("fn", [ln_right, ln_recomputes])
@pytest.mark.parametrize("seed", SEEDS)
def test_layernorm_rebuild_right(fn, seed):
    r = check_layernorm_rebuild(fn, seed=seed, quiet=True)
    assert r.status == "correct", r.message


@pytest.mark.parametrize("fn, words", [
    (lambda i, m, r, w, b: (i - m[..., None]) * r[..., None] * w, "bias is missing"),
    (lambda i, m, r, w, b: (i - m[..., None]) * r[..., None] + b, "weight is missing"),
    (lambda i, m, r, w, b: (i - m[..., None]) / r[..., None] * w + b, "divided by rstd"),
    (lambda i, m, r, w, b: i * r[..., None] * w + b, "mean was not subtracted"),
    (lambda i, m, r, w, b: (i - m[..., None]) / i.std(axis=-1, keepdims=True) * w + b, "np.std"),
    (lambda i, m, r, w, b: i * r[..., None] * w - m[..., None] * r[..., None] * w + b, "bitwise"),
    (lambda i, m, r, w, b: None, "return"),
])
@pytest.mark.parametrize("seed", SEEDS)
def test_layernorm_rebuild_mistakes(fn, words, seed):
    r = check_layernorm_rebuild(fn, seed=seed, quiet=True)
    assert r.status == "wrong", r.message
    assert words in r.hint, r.message


@pytest.mark.parametrize("seed", SEEDS)
def test_layernorm_rebuild_stale_output_fails(seed):
    _LN.clear()
    r = check_layernorm_rebuild(ln_stale, seed=seed, quiet=True)
    assert r.status == "wrong" and "stale" in r.hint and "call 2 of 4" in r.message, r.message


def test_layernorm_rebuild_broadcast_error_and_edge_shapes():
    r = check_layernorm_rebuild(lambda i, m, r, w, b: (i - m) * r * w + b, seed=1, quiet=True)
    assert r.status == "error" and "mean[..., None]" in r.hint, r.message
    seen = []

    def spy(inp, mean, rstd, weight, bias):
        seen.append(inp.shape)
        return ln_right(inp, mean, rstd, weight, bias)
    assert check_layernorm_rebuild(spy, seed=2, quiet=True).status == "correct"
    assert len(seen) == 4 and seen[0] == seen[1] and seen[2][1] == 1 and seen[3][2] == 1


# ---------------------------------------------------------------------------------------------- 08.3

def _ln_out(ln, bias):
    return ln_right(ln["inp"], ln["mean"], ln["rstd"], ln["weight"], bias)


def sel_right(kept):
    c = dict(kept)
    c["qkv"] = dict(kept["qkv"], inp=_ln_out(kept["ln1"], kept["ln1_bias"]))
    c["fc"] = dict(kept["fc"], inp=_ln_out(kept["ln2"], kept["ln2_bias"]))
    c["fcproj"] = dict(kept["fcproj"], inp=gelu_forward(kept["gelu"]["inp"])[0])
    return c


def sel_mutates_kept(kept):                       # dict(kept) is shallow: the inner dicts are kept's own
    c = dict(kept)
    c["qkv"]["inp"] = _ln_out(kept["ln1"], kept["ln1_bias"])
    c["fc"]["inp"] = _ln_out(kept["ln2"], kept["ln2_bias"])
    c["fcproj"]["inp"] = gelu_forward(kept["gelu"]["inp"])[0]
    return c


def sel_swapped(kept):
    c = sel_right(kept)
    c["qkv"]["inp"], c["fc"]["inp"] = c["fc"]["inp"], c["qkv"]["inp"]
    return c


def sel_no_gelu(kept):
    c = sel_right(kept)
    c["fcproj"]["inp"] = kept["gelu"]["inp"]
    return c


def sel_wrong_bias(kept):
    c = sel_right(kept)
    c["fc"]["inp"] = _ln_out(kept["ln2"], kept["ln1_bias"])
    return c


def sel_no_bias(kept):
    c = sel_right(kept)
    c["qkv"]["inp"] = _ln_out(kept["ln1"], 0 * kept["ln1_bias"])
    return c


def sel_layernorm_input(kept):
    c = sel_right(kept)
    c["qkv"]["inp"] = kept["ln1"]["inp"]
    return c


def sel_drops_weight(kept):
    c = sel_right(kept)
    c["qkv"] = {"inp": c["qkv"]["inp"]}
    return c


def sel_erf_gelu(kept):                           # the exact GELU: close, not the reference's bits
    import math
    c = sel_right(kept)
    x = kept["gelu"]["inp"].astype(np.float64)
    erf = np.vectorize(math.erf)
    c["fcproj"]["inp"] = (0.5 * x * (1 + erf(x / math.sqrt(2)))).astype(kept["gelu"]["inp"].dtype)
    return c


_SEL = {}


def sel_stale(kept):
    if "c" not in _SEL:
        _SEL["c"] = sel_right(kept)
    return _SEL["c"]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_selective_right_passes(seed, dtype):
    r = check_selective_rebuild(sel_right, dtype=dtype, seed=seed, quiet=True)
    assert r.status == "correct", r.message


@pytest.mark.parametrize("fn, words", [
    (sel_mutates_kept, "you changed the selective cache"),
    (sel_swapped, "swapped"),
    (sel_no_gelu, "the GELU was not applied"),
    (sel_wrong_bias, "ln2 was rebuilt with ln1's bias"),
    (sel_no_bias, "bias is missing"),
    (sel_layernorm_input, "the LayerNorm's INPUT"),
    (sel_drops_weight, "keep the linear cache's weight"),
    (sel_erf_gelu, "tanh approximation"),
    (lambda kept: kept, "block_backward reads cache['qkv']['inp']"),
    (lambda kept: None, "return the rebuilt block cache"),
])
@pytest.mark.parametrize("seed", SEEDS[:3])
def test_selective_mistakes_named(fn, words, seed):
    r = check_selective_rebuild(fn, seed=seed, quiet=True)
    assert r.status == "wrong", r.message
    assert words in r.message, r.message


def test_selective_stale_fails_on_the_second_call():
    _SEL.clear()
    r = check_selective_rebuild(sel_stale, seed=0, quiet=True)
    assert r.status == "wrong" and "stale" in r.hint and "call 2 of 4" in r.message, r.message


def test_selective_not_attempted_and_key_error():
    def todo(kept):
        raise NotImplementedError
    assert check_selective_rebuild(todo, quiet=True).status == "not attempted"
    r = check_selective_rebuild(lambda kept: kept["qkv"]["inp"], seed=0, quiet=True)
    assert r.status == "error" and "weight and has_bias" in r.hint, r.message
