"""The NumPy reference ops and the gradient checker (gpullm_lessons.reference, gpullm_lessons.checks.gradcheck)."""
import math

import numpy as np
import pytest

import gpullm_lessons.reference as ref
from gpullm_lessons.checks.gradcheck import (GradcheckResult, fd_error_curve, gpt_gradcheck, gradcheck,
                                      numerical_grad)
from gpullm_lessons.model.params import GPTConfig, init_params
from gpullm_lessons.reference import (attention_backward, attention_forward, crossentropy_backward,
                                      crossentropy_forward, encoder_backward, encoder_forward, gelu_backward,
                                      gelu_forward, gpt_backward, gpt_forward, layernorm_backward,
                                      layernorm_forward, layernorm_stats, linear_backward, linear_forward,
                                      residual_backward, residual_forward, softmax_backward, softmax_forward)

TINY = GPTConfig(vocab_size=17, block_size=8, n_layer=2, n_head=2, d_model=8)


def rand(*shape, seed=0, scale=1.0):
    return scale * np.random.default_rng(seed).standard_normal(shape)


# ----------------------------------------------------------------------------- op inputs, by op and shape
# Each factory returns the keyword inputs of <op>_forward (float64), for gradcheck and the dtype tests.

def enc_inputs(B, T, V, maxT, C):
    rng = np.random.default_rng(B * 100 + T)
    idx = rng.integers(0, V, size=(B, T))
    idx[0, 0] = idx[-1, -1]                              # a repeated token: the scatter-add must accumulate
    return {"idx": idx, "wte": rand(V, C, seed=1), "wpe": rand(maxT, C, seed=2)}


def linear_inputs(lead, C, OC, bias=True):
    return {"inp": rand(*lead, C, seed=3), "weight": rand(C, OC, seed=4), "bias": rand(OC, seed=5) if bias else None}


def ln_inputs(lead, C):
    return {"inp": rand(*lead, C, seed=6, scale=2.0) + 0.5, "weight": rand(C, seed=7), "bias": rand(C, seed=8)}


def attn_inputs(B, T, C, nh):
    return {"qkv": rand(B, T, 3 * C, seed=9), "n_head": nh}


def ce_inputs(B, T, V):
    return {"logits": rand(B, T, V, seed=10, scale=2.0),
            "targets": np.random.default_rng(11).integers(0, V, size=(B, T))}


CASES = {
    "encoder": (encoder_forward, encoder_backward,
                [enc_inputs(2, 5, 7, 8, 3), enc_inputs(1, 1, 5, 4, 6), enc_inputs(3, 4, 2, 4, 5)]),
    "linear": (linear_forward, linear_backward,
               [linear_inputs((2, 3), 5, 7), linear_inputs((1, 1), 4, 3), linear_inputs((6,), 1, 9),
                linear_inputs((3, 2), 5, 5, bias=False), linear_inputs((), 3, 2)]),
    "layernorm": (layernorm_forward, layernorm_backward,
                  [ln_inputs((2, 3), 5), ln_inputs((1, 1), 7), ln_inputs((4,), 3), ln_inputs((2, 1, 3), 2)]),
    "gelu": (gelu_forward, gelu_backward,
             [{"inp": rand(2, 3, 5, seed=12, scale=3.0)}, {"inp": rand(1, 1, 1, seed=13)}, {"inp": rand(7, seed=14)}]),
    "softmax": (softmax_forward, softmax_backward,
                [{"inp": rand(2, 3, 5, seed=15)}, {"inp": rand(1, 1, 1, seed=16)},
                 {"inp": rand(4, 9, seed=17, scale=5)}]),
    "attention": (attention_forward, attention_backward,
                  [attn_inputs(2, 5, 8, 2), attn_inputs(1, 1, 6, 3), attn_inputs(1, 4, 3, 1), attn_inputs(2, 3, 9, 3)]),
    "crossentropy": (crossentropy_forward, crossentropy_backward,
                     [ce_inputs(2, 3, 5), ce_inputs(1, 1, 2), ce_inputs(3, 4, 11)]),
    "residual": (residual_forward, residual_backward,
                 [{"a": rand(2, 3, 5, seed=18), "b": rand(2, 3, 5, seed=19)},
                  {"a": rand(1, seed=20), "b": rand(1, seed=21)}]),
}
CASE_IDS = [(op, i) for op, (_, _, cases) in CASES.items() for i in range(len(cases))]


def shape_id(case):
    op, i = case
    inputs = CASES[op][2][i]
    return op + "-" + "-".join("x".join(map(str, v.shape)) for v in inputs.values() if isinstance(v, np.ndarray))


def test_ops_list_matches_exports():
    assert ref.OPS == ["encoder", "linear", "layernorm", "gelu", "softmax", "attention", "crossentropy", "residual"]
    assert set(CASES) == set(ref.OPS)
    for op in ref.OPS:
        assert callable(getattr(ref, f"{op}_forward")) and callable(getattr(ref, f"{op}_backward"))
    for name in ("layernorm_stats", "gpt_forward", "gpt_backward"):
        assert callable(getattr(ref, name))


# ------------------------------------------------------------------------------- gradients (float64)

@pytest.mark.parametrize("case", CASE_IDS, ids=[shape_id(c) for c in CASE_IDS])
def test_backward_passes_gradcheck(case):
    op, i = case
    forward, backward, cases = CASES[op]
    result = gradcheck(forward, backward, cases[i])
    assert isinstance(result, GradcheckResult)
    assert result.passed, str(result)


# ------------------------------------------------------------------- dtypes: float32 stays float32

def _cast(inputs, dtype):
    return {k: (v.astype(dtype) if isinstance(v, np.ndarray) and v.dtype.kind == "f" else v) for k, v in inputs.items()}


def _arrays(x):
    items = x if isinstance(x, tuple) else (x,)
    return [np.asarray(a) for a in items if a is not None]


@pytest.mark.parametrize("op", list(CASES))
def test_float32_agrees_with_float64_and_keeps_dtype(op):
    forward, backward, cases = CASES[op]
    inputs = cases[0]
    out64, cache64 = forward(**_cast(inputs, np.float64))
    out32, cache32 = forward(**_cast(inputs, np.float32))
    assert np.asarray(out32).dtype == np.float32 and np.asarray(out64).dtype == np.float64
    np.testing.assert_allclose(out32, out64, rtol=2e-5, atol=2e-5)
    dout = rand(*np.shape(out64), seed=99) if np.ndim(out64) else 1.0
    g64 = _arrays(backward(dout, cache64))
    g32 = _arrays(backward(np.asarray(dout, dtype=np.float32) if np.ndim(out64) else 1.0, cache32))
    assert len(g32) == len(g64) >= 1
    for a32, a64 in zip(g32, g64):
        assert a32.dtype == np.float32, f"{op} backward upcast to {a32.dtype}"
        np.testing.assert_allclose(a32, a64, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------- known values

def test_linear_matches_formula():
    x, w, b = rand(2, 3, 4), rand(4, 5, seed=1), rand(5, seed=2)
    out, _ = linear_forward(x, w, b)
    np.testing.assert_allclose(out, np.einsum("btc,co->bto", x, w) + b)
    out_nobias, cache = linear_forward(x, w, None)
    np.testing.assert_allclose(out_nobias, x @ w)
    assert linear_backward(np.ones_like(out), cache)[2] is None


def test_encoder_values_and_scatter_add():
    wte, wpe = rand(5, 3), rand(4, 3, seed=1)
    idx = np.array([[1, 1, 2]])
    out, cache = encoder_forward(idx, wte, wpe)
    np.testing.assert_allclose(out[0, 1], wte[1] + wpe[1])
    dwte, dwpe = encoder_backward(np.ones((1, 3, 3)), cache)
    np.testing.assert_allclose(dwte[1], 2.0)             # token 1 used twice
    np.testing.assert_allclose(dwte[[0, 3, 4]], 0.0)
    np.testing.assert_allclose(dwpe[3], 0.0)             # position 3 unused (T=3)


def test_softmax_rows_sum_to_one_and_handle_large_inputs():
    out, _ = softmax_forward(rand(3, 4, 7, scale=10))
    np.testing.assert_allclose(out.sum(-1), 1.0)
    big, _ = softmax_forward(np.array([1000.0, 1000.0, -np.inf]))   # would overflow without the max
    np.testing.assert_allclose(big, [0.5, 0.5, 0.0])


def test_layernorm_normalizes_and_stats():
    x = rand(2, 3, 6, scale=3) + 4
    out, cache = layernorm_forward(x, np.ones(6), np.zeros(6))
    np.testing.assert_allclose(out.mean(-1), 0.0, atol=1e-12)
    np.testing.assert_allclose(out.var(-1), 1.0, rtol=1e-4)
    mean, rstd = layernorm_stats(x)
    assert mean.shape == rstd.shape == (2, 3)
    np.testing.assert_allclose(cache["mean"], mean)
    np.testing.assert_allclose(cache["rstd"], 1 / np.sqrt(x.var(-1) + 1e-5))


def test_gelu_known_values():
    out, _ = gelu_forward(np.array([0.0, 10.0, -10.0, 1.0]))
    np.testing.assert_allclose(out[:3], [0.0, 10.0, 0.0], atol=1e-12)
    np.testing.assert_allclose(out[3], 0.5 * (1 + math.tanh(math.sqrt(2 / math.pi) * 1.044715)))


def test_crossentropy_of_zero_logits_is_log_v():
    loss, cache = crossentropy_forward(np.zeros((2, 3, 11)), np.zeros((2, 3), dtype=np.int64))
    assert loss == pytest.approx(math.log(11))
    dlogits = crossentropy_backward(1.0, cache)
    np.testing.assert_allclose(dlogits.sum(-1), 0.0, atol=1e-15)   # probs - onehot sums to 0 per row
    np.testing.assert_allclose(dlogits[0, 0, 0], (1 / 11 - 1) / 6)


def test_crossentropy_accepts_flat_rows():
    logits, targets = rand(6, 5), np.arange(6) % 5
    loss, _ = crossentropy_forward(logits, targets)
    loss3, _ = crossentropy_forward(logits.reshape(2, 3, 5), targets.reshape(2, 3))
    assert loss == pytest.approx(loss3)


def test_attention_is_causal():
    B, T, C, nh = 2, 6, 8, 2
    qkv = rand(B, T, 3 * C)
    out, cache = attention_forward(qkv, nh)
    assert out.shape == (B, T, C) and cache["att"].shape == (B, nh, T, T)
    np.testing.assert_allclose(np.triu(cache["att"], k=1), 0.0)     # no weight on the future
    np.testing.assert_allclose(cache["att"].sum(-1), 1.0)
    for later in range(1, T):
        bumped = qkv.copy()
        bumped[:, later, :] += 5.0                     # change q, k and v at time `later`
        out2, _ = attention_forward(bumped, nh)
        np.testing.assert_array_equal(out2[:, :later], out[:, :later])   # earlier outputs unchanged
        assert not np.allclose(out2[:, later], out[:, later])


def test_attention_first_position_copies_its_value():
    qkv = rand(1, 3, 12)
    out, _ = attention_forward(qkv, 2)
    np.testing.assert_allclose(out[0, 0], qkv[0, 0, 8:])             # t=0 attends only to itself: y = v


def test_residual():
    a, b = rand(2, 3), rand(2, 3, seed=1)
    out, cache = residual_forward(a, b)
    assert cache is None
    np.testing.assert_allclose(out, a + b)
    da, db = residual_backward(np.ones((2, 3)), cache)
    da[0, 0] = 5.0
    assert db[0, 0] == 1.0                              # independent arrays


# -------------------------------------------------------------------------------------- bad inputs

@pytest.mark.parametrize("call, exc, match", [
    (lambda: linear_forward(rand(2, 5), rand(6, 8)), ValueError,
     r"linear_forward: inp has C=5 channels but weight is \(6, 8\); weight must be \(C, OC\)"),
    (lambda: linear_forward(rand(2, 5), rand(5, 8), rand(7)), ValueError, r"bias is \(7,\).*must be \(OC,\)"),
    (lambda: linear_forward(np.ones((2, 5), dtype=np.int64), rand(5, 8)), TypeError,
     r"linear_forward: inp must be a floating-point array, got dtype int64"),
    (lambda: linear_forward(rand(2, 5).astype(np.float32), rand(5, 8)), TypeError, r"float32 but weight is float64"),
    (lambda: layernorm_forward(rand(2, 5), rand(6), rand(6)), ValueError, r"inp has C=5 channels"),
    (lambda: gelu_forward(np.arange(4)), TypeError, r"gelu_forward: inp must be a floating-point array, got dtype int"),
    (lambda: softmax_forward(np.ones(3, dtype=bool)), TypeError, r"got dtype bool"),
    (lambda: attention_forward(rand(2, 3, 10), 2), ValueError, r"qkv has 3C=10 channels, which is not divisible by 3"),
    (lambda: attention_forward(rand(2, 3, 24), 3), ValueError, r"C=8 is not divisible by n_head=3"),
    (lambda: attention_forward(rand(2, 24), 2), ValueError, r"qkv must be \(B, T, 3C\)"),
    (lambda: attention_forward(np.ones((2, 3, 24), dtype=np.int32), 2), TypeError, r"got dtype int32"),
    (lambda: crossentropy_forward(rand(2, 3, 5), np.array([[0, 1, 5], [0, 0, 0]])), ValueError,
     r"targets must be in \[0, V=5\); got min 0, max 5"),
    (lambda: crossentropy_forward(rand(2, 3, 5), -np.ones((2, 3), dtype=int)), ValueError, r"got min -1"),
    (lambda: crossentropy_forward(rand(2, 3, 5), np.zeros((3, 2), dtype=int)), ValueError,
     r"targets are \(3, 2\) but logits are \(2, 3, 5\)"),
    (lambda: crossentropy_forward(rand(2, 3, 5), np.zeros((2, 3))), TypeError, r"targets must be an integer array"),
    (lambda: encoder_forward(np.zeros((1, 9), dtype=int), rand(5, 3), rand(8, 3)), ValueError,
     r"T=9 is longer than wpe's maxT=8"),
    (lambda: encoder_forward(np.array([[0, 5]]), rand(5, 3), rand(8, 3)), ValueError,
     r"idx must be in \[0, V=5\); got min 0, max 5"),
    (lambda: encoder_forward(np.zeros((1, 2)), rand(5, 3), rand(8, 3)), TypeError, r"idx must be an integer array"),
    (lambda: residual_forward(rand(2, 3), rand(3, 2)), ValueError, r"a is \(2, 3\) but b is \(3, 2\)"),
    (lambda: linear_backward(rand(2, 4), linear_forward(rand(2, 5), rand(5, 8))[1]), ValueError,
     r"dout is \(2, 4\) but out was \(2, 8\)"),
    (lambda: gpt_forward(init_params(TINY), TINY, np.zeros((1, 9), dtype=int)), ValueError,
     r"T=9 is longer than block_size=8"),
    (lambda: gpt_backward(gpt_forward(init_params(TINY), TINY, np.zeros((1, 2), dtype=int))[2],
                          init_params(TINY).zeros_like()), ValueError, r"call gpt_forward with targets"),
])
def test_bad_inputs_raise_clear_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


# ---------------------------------------------------------------------------------- the checker itself

def test_numerical_grad_and_restore():
    x = np.array([[1.0, -2.0, 3.0]])
    before = x.copy()
    g = numerical_grad(lambda: float(np.sum(x ** 3)), x)
    np.testing.assert_allclose(g, 3 * before ** 2, rtol=1e-8)
    np.testing.assert_array_equal(x, before)


def test_gradcheck_leaves_inputs_alone_and_reports():
    inputs = linear_inputs((2, 3), 4, 5)
    copies = {k: v.copy() for k, v in inputs.items()}
    result = gradcheck(linear_forward, linear_backward, inputs, grad_names=["weight"])
    for k in inputs:
        np.testing.assert_array_equal(inputs[k], copies[k])
    assert [row.name for row in result.rows] == ["weight"]
    text = str(result)
    assert "PASSED" in text and "weight" in text and "max rel err" in text
    assert result["weight"].n_checked == 20 and result.max_rel_err["weight"] < 1e-5
    with pytest.raises(ValueError, match="not a floating-point input"):
        gradcheck(crossentropy_forward, crossentropy_backward, ce_inputs(1, 2, 3), grad_names=["targets"])


def test_gradcheck_casts_float32_inputs_to_float64():
    inputs = _cast(ln_inputs((2, 3), 5), np.float32)
    assert gradcheck(layernorm_forward, layernorm_backward, inputs).passed


def _linear_backward_missing_transpose(dout, cache):
    dinp, dweight, dbias = linear_backward(dout, cache)
    return dout @ cache["weight"], dweight, dbias        # BUG: weight instead of weight.T (square: same shape)


def _layernorm_backward_missing_mean_term(dout, cache):
    inp, weight, mean, rstd = cache["inp"], cache["weight"], cache["mean"], cache["rstd"]
    xhat = (inp - mean[..., None]) * rstd[..., None]
    g = dout * weight
    dinp = rstd[..., None] * (g - xhat * (g * xhat).mean(-1, keepdims=True))   # BUG: no - mean(g)
    _, dweight, dbias = layernorm_backward(dout, cache)
    return dinp, dweight, dbias


def _crossentropy_backward_missing_mean(dloss, cache):
    return crossentropy_backward(dloss, cache) * cache["targets"].size             # BUG: sum, not mean


def _attention_backward_no_scale(dout, cache):
    hs = cache["qkv"].shape[-1] // 3 // cache["n_head"]
    dqkv = attention_backward(dout, cache)
    C = dqkv.shape[-1] // 3
    dqkv[..., :C] *= math.sqrt(hs)                       # BUG: forgot the 1/sqrt(hs) on dq
    return dqkv


@pytest.mark.parametrize("forward, wrong_backward, inputs, bad", [
    (linear_forward, _linear_backward_missing_transpose, linear_inputs((2, 3), 5, 5), "inp"),
    (layernorm_forward, _layernorm_backward_missing_mean_term, ln_inputs((2, 3), 5), "inp"),
    (crossentropy_forward, _crossentropy_backward_missing_mean, ce_inputs(2, 3, 5), "logits"),
    (attention_forward, _attention_backward_no_scale, attn_inputs(1, 3, 8, 2), "qkv"),
])
def test_gradcheck_fails_on_wrong_backward(forward, wrong_backward, inputs, bad):
    result = gradcheck(forward, wrong_backward, inputs)
    assert not result.passed
    assert not result[bad].passed and "NO" in str(result)
    for row in result.rows:                              # the parts that are right still pass
        if row.name != bad:
            assert row.passed


def test_gradcheck_fails_on_wrong_shape_or_none():
    def transposed(dout, cache):
        dinp, dweight, dbias = linear_backward(dout, cache)
        return dinp, dweight.T, dbias
    result = gradcheck(linear_forward, transposed, linear_inputs((2,), 3, 4))
    assert not result.passed and "gradient is (4, 3) but the input is (3, 4)" in str(result)

    def no_dbias(dout, cache):
        return linear_backward(dout, cache)[:2] + (None,)
    assert not gradcheck(linear_forward, no_dbias, linear_inputs((2,), 3, 4)).passed


def test_fd_error_curve_is_a_v():
    eps, err = fd_error_curve(np.sin, np.cos, x0=1.0)
    assert eps.shape == err.shape
    best = err[np.argmin(np.abs(eps - 1e-5))]
    assert best < 1e-9
    assert err[np.argmin(np.abs(eps - 1e-1))] > 100 * best          # truncation ~ eps^2
    assert err[np.argmin(np.abs(eps - 1e-13))] > 100 * best         # round-off ~ 1e-16 / eps
    e2, err2 = fd_error_curve(np.exp, np.exp, eps_values=[1e-2, 1e-3])  # central: error falls 100x per 10x
    assert 50 < err2[0] / err2[1] < 200
    ef, errf = fd_error_curve(np.exp, np.exp, eps_values=[1e-2, 1e-3], method="forward")  # forward: 10x
    assert 5 < errf[0] / errf[1] < 20


# ------------------------------------------------------------------------------------------- the GPT

def test_gpt_gradcheck_tiny():
    result = gpt_gradcheck(TINY, seed=0, n_checks=10, B=2, T=5)
    assert result.passed, str(result)
    assert [row.name for row in result.rows] == init_params(TINY).names


def test_gpt_gradcheck_single_token():
    result = gpt_gradcheck(TINY, seed=1, n_checks=10, B=1, T=1)
    assert result.passed, str(result)


def test_gpt_gradcheck_catches_untied_head():
    def backward_without_head_term(cache, grads):
        gpt_backward(cache, grads)
        dwte_head = linear_backward(crossentropy_backward(1.0, cache["crossentropy"]), cache["head"])[1]
        grads["wte"][...] -= dwte_head.T                 # BUG: forget the LM head's use of wte
    result = gpt_gradcheck(TINY, seed=0, B=2, T=5, backward=backward_without_head_term)
    assert not result.passed and not result["wte"].passed and result["wpe"].passed


def test_gpt_weight_tying_both_paths():
    p = init_params(TINY, seed=0, dtype=np.float64)
    rng = np.random.default_rng(0)
    idx = np.array([[1, 2, 3]])
    targets = np.array([[2, 3, 4]])
    _, loss, cache = gpt_forward(p, TINY, idx, targets)
    grads = p.zeros_like()
    gpt_backward(cache, grads)
    # token 16 is not in idx: its wte row only acts through the LM head, and still has a gradient
    assert np.abs(grads["wte"][16]).max() > 0
    p["wte"][16] += 1e-3 * rng.standard_normal(TINY.d_model)
    assert gpt_forward(p, TINY, idx, targets)[1] != loss
    # the embedding path: dwte of a used token = head part + encoder scatter (the encoder part is nonzero)
    dlogits = crossentropy_backward(1.0, cache["crossentropy"])
    head_part = linear_backward(dlogits, cache["head"])[1].T       # (V, C)
    enc_part = grads["wte"] - head_part
    assert np.abs(enc_part[[1, 2, 3]]).max() > 0
    np.testing.assert_allclose(enc_part[[0, 4, 16]], 0.0, atol=1e-15)


def test_gpt_float32_dict_params_and_overwrite():
    p32 = init_params(TINY, seed=3)
    as_dict = {name: p32[name].copy() for name in p32.names}
    idx, targets = np.random.default_rng(0).integers(0, 17, size=(2, 2, 5))
    logits, loss, cache = gpt_forward(as_dict, TINY, idx, targets)
    assert logits.shape == (2, 5, 17) and logits.dtype == np.float32 and np.asarray(loss).dtype == np.float32
    assert loss == pytest.approx(math.log(17), rel=0.05)             # small init: near uniform
    grads = {name: np.full_like(v, 123.0) for name, v in as_dict.items()}  # garbage must be overwritten
    gpt_backward(cache, grads)
    again = p32.zeros_like()
    logits2, loss2, cache2 = gpt_forward(p32, TINY, idx, targets)
    gpt_backward(cache2, again)
    gpt_backward(cache2, again)                          # twice: overwritten, not accumulated
    for name in p32.names:
        assert grads[name].dtype == np.float32
        np.testing.assert_allclose(grads[name], again[name], rtol=1e-6, atol=1e-9)
    p64 = init_params(TINY, seed=3, dtype=np.float64)
    logits64, _, _ = gpt_forward(p64, TINY, idx, targets)
    np.testing.assert_allclose(logits, logits64, rtol=1e-4, atol=1e-5)
    _, no_loss, _ = gpt_forward(p32, TINY, idx)
    assert no_loss is None



def test_gpt_backward_dloss_scales_every_gradient_exactly():
    p = init_params(TINY, seed=2, dtype=np.float64)
    idx, targets = np.random.default_rng(1).integers(0, 17, size=(2, 2, 5))
    cache = gpt_forward(p, TINY, idx, targets)[2]
    plain, scaled = p.zeros_like(), p.zeros_like()
    gpt_backward(cache, plain)
    gpt_backward(cache, scaled, dloss=1024.0)            # a power of two: every op is linear in dout, so exact
    assert np.array_equal(scaled.flat, 1024.0 * plain.flat)


def test_gpt_keep_and_recompute_hooks():
    from gpullm_lessons.reference.gpt import block_forward
    p = init_params(TINY, seed=4)
    idx, targets = np.random.default_rng(2).integers(0, 17, size=(2, 2, 5))
    logits_ref, loss_ref, cache_ref = gpt_forward(p, TINY, idx, targets)
    grads_ref = p.zeros_like()
    gpt_backward(cache_ref, grads_ref)
    kept, rebuilt = [], []

    def keep(l, c):                                      # only the block input (ln1's inp)
        kept.append(l)
        return c["ln1"]["inp"]

    def recompute(l, x_in):                              # the block's forward again
        rebuilt.append(l)
        return block_forward(p, l, x_in, TINY.n_head)[1]
    logits, loss, cache = gpt_forward(p, TINY, idx, targets, keep=keep)
    assert all(isinstance(entry, np.ndarray) for entry in cache["layers"])
    grads = p.zeros_like()
    gpt_backward(cache, grads, recompute=recompute)
    assert kept == [0, 1] and rebuilt == [1, 0]
    assert loss == loss_ref and np.array_equal(logits, logits_ref)
    assert np.array_equal(grads.flat, grads_ref.flat)

def test_gpt_rejects_wrong_param_shapes():
    p = {name: v.copy() for name, v in init_params(TINY).items()}
    p["qkvw"] = p["qkvw"][:, :, :-1]
    with pytest.raises(ValueError, match=r"params\['qkvw'\] is \(2, 8, 23\) but cfg needs \(2, 8, 24\)"):
        gpt_forward(p, TINY, np.zeros((1, 2), dtype=int))
