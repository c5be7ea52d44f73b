"""Tests for gpullm_lessons.checks.backward and gpullm_lessons.runtime.arrays.

For every checker: a correct NumPy implementation (destination-passing, written here) passes over several seeds
in float32 and float64; plausible wrong implementations fail with the hint for their mistake; a stub gives
"not attempted"; other errors give "error" and never propagate. Plus Numba kernels under the simulator.
"""
import dataclasses
import json
import math

import numpy as np
import pytest

import gpullm_lessons  # noqa: F401  (first: switches the CUDA simulator on before numba loads)
from gpullm_lessons.runtime import arrays
from gpullm_lessons.checks import backward as checks, opcheck
from gpullm_lessons import device
from numba import cuda  # noqa: E402  (after gpullm_lessons)
from numba import float32 as numba_float32  # noqa: E402

from gpullm_lessons.checks.backward import (
    check_attention_backward, check_crossentropy_backward, check_encoder_backward, check_gelu_backward,
    check_layernorm_backward, check_linear_backward, check_residual_backward, check_softmax_backward)

SEEDS = range(6)
S, K = math.sqrt(2 / math.pi), 0.044715


# ------------------------------------------------------------------------------------------------------------
# Correct implementations (NumPy, destination-passing: write every element of the outputs)
# ------------------------------------------------------------------------------------------------------------
def linear_backward(dout, inp, weight, dinp, dweight, dbias):
    dinp[...] = dout @ weight.T          # (N, OC) @ (OC, C)
    dweight[...] = inp.T @ dout          # (C, N) @ (N, OC)
    dbias[...] = dout.sum(axis=0)        # (OC,)


def softmax_backward(dout, out, dinp):
    dinp[...] = out * (dout - (out * dout).sum(axis=-1, keepdims=True))


def _xhat(inp, mean, rstd):
    return (inp - mean[:, None]) * rstd[:, None]


def layernorm_backward(dout, inp, weight, mean, rstd, dinp, dweight, dbias):
    xhat = _xhat(inp, mean, rstd)
    g = dout * weight
    dinp[...] = rstd[:, None] * (g - g.mean(axis=-1, keepdims=True) - xhat * (g * xhat).mean(axis=-1, keepdims=True))
    dweight[...] = (dout * xhat).sum(axis=0)
    dbias[...] = dout.sum(axis=0)


def _gelu_grad(x, dudx=None):
    t = np.tanh(S * (x + K * x ** 3))
    dudx = S * (1 + 3 * K * x ** 2) if dudx is None else dudx
    return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * dudx


def gelu_backward(dout, inp, dinp):
    dinp[...] = dout * _gelu_grad(inp)


def _probs(logits):
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def crossentropy_backward(logits, targets, dlogits):
    N = logits.shape[0]
    p = _probs(logits)
    p[np.arange(N), targets] -= 1
    dlogits[...] = p / N


def _attention(dout, qkv, att, dqkv, n_head, scale=True, mask=True, dk_t=True, rowsum=True, heads_ok=True):
    B, T, C3 = qkv.shape
    C = C3 // 3
    hs = C // n_head

    def split(x):  # (B, T, C) -> (B, nh, T, hs)
        if not heads_ok:
            return x.reshape(B, n_head, T, hs)
        return x.reshape(B, T, n_head, hs).transpose(0, 2, 1, 3)

    def merge(x):  # (B, nh, T, hs) -> (B, T, C)
        if not heads_ok:
            return x.reshape(B, T, C)
        return x.transpose(0, 2, 1, 3).reshape(B, T, C)

    q, k, v = split(qkv[..., :C]), split(qkv[..., C:2 * C]), split(qkv[..., 2 * C:])
    s = 1 / math.sqrt(hs)
    if not mask:  # recompute att, forgetting the causal mask
        att = _probs(q @ k.swapaxes(-1, -2) * s)
    dy = split(dout)
    datt = dy @ v.swapaxes(-1, -2)
    dv = att.swapaxes(-1, -2) @ dy
    dpre = att * (datt - (att * datt).sum(axis=-1, keepdims=True)) if rowsum else att * datt
    s = s if scale else 1.0
    dq = dpre @ k * s
    dk = (dpre.swapaxes(-1, -2) if dk_t else dpre) @ q * s
    dqkv[..., :C], dqkv[..., C:2 * C], dqkv[..., 2 * C:] = merge(dq), merge(dk), merge(dv)


def attention_backward(dout, qkv, att, dqkv, n_head):
    _attention(dout, qkv, att, dqkv, n_head)


def encoder_backward(dout, idx, dwte, dwpe):
    dwte[...] = 0
    dwpe[...] = 0
    np.add.at(dwte, idx, dout)                 # repeated tokens accumulate
    dwpe[:idx.shape[1]] = dout.sum(axis=0)


def residual_backward(dout, da, db):
    da[...] = dout
    db[...] = dout


CORRECT = [
    (check_linear_backward, linear_backward), (check_softmax_backward, softmax_backward),
    (check_layernorm_backward, layernorm_backward), (check_gelu_backward, gelu_backward),
    (check_crossentropy_backward, crossentropy_backward), (check_attention_backward, attention_backward),
    (check_encoder_backward, encoder_backward), (check_residual_backward, residual_backward),
]
IDS = [c.__name__ for c, _ in CORRECT]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("check,fn", CORRECT, ids=IDS)
def test_correct_passes(check, fn, dtype):
    for seed in SEEDS:
        r = check(fn, dtype=dtype, seed=seed, quiet=True)
        assert r.status == "correct" and r.passed and bool(r), r.message
        assert r.max_rel <= r.tol


def test_a_correct_verdict_reports_the_largest_error_of_every_output_and_case():
    """A right answer off by a relative 4e-6 in dbias only: the verdict's max rel is that error, not 0 (the maximum
    runs over every output of every case, not only over the first one)."""
    def slightly_off(dout, inp, weight, dinp, dweight, dbias):
        linear_backward(dout, inp, weight, dinp, dweight, dbias)
        dbias *= np.float32(1 + 4e-6)
    r = check_linear_backward(slightly_off, dtype=np.float32, seed=5, quiet=True)
    assert r.passed and 1e-6 < r.max_rel < 1e-5, r.message   # float32 rounding alone: ~1e-7


@pytest.mark.parametrize("check,fn", CORRECT, ids=IDS)
def test_correct_passes_fresh_seeds_and_low_precision(check, fn):
    seeds = {check(fn, quiet=True).seed for _ in range(3)}   # seed=None: fresh inputs each call
    assert len(seeds) >= 2
    for dtype in (np.float16, "bfloat16"):
        r = check(fn, dtype=dtype, quiet=True)
        assert r.passed, r.message


# ------------------------------------------------------------------------------------------------------------
# Wrong implementations: each must fail, with the hint for its mistake
# ------------------------------------------------------------------------------------------------------------
def lin_no_transpose(dout, inp, weight, dinp, dweight, dbias):
    dinp[...] = dout @ weight                    # missing .T
    dweight[...] = inp.T @ dout
    dbias[...] = dout.sum(axis=0)


def lin_dbias_axis(dout, inp, weight, dinp, dweight, dbias):
    linear_backward(dout, inp, weight, dinp, dweight, dbias)
    dbias[...] = dout.sum(axis=1)                # wrong axis


def lin_no_dbias(dout, inp, weight, dinp, dweight, dbias):
    dinp[...] = dout @ weight.T                  # forgot the bias gradient
    dweight[...] = inp.T @ dout


def lin_dweight_layout(dout, inp, weight, dinp, dweight, dbias):
    linear_backward(dout, inp, weight, dinp, dweight, dbias)
    dweight[...] = dout.T @ inp                  # (OC, C) layout


def lin_skip_last_row(dout, inp, weight, dinp, dweight, dbias):
    dinp[:-1] = (dout @ weight.T)[:-1]           # loop bound off by one: last row never written
    dweight[...] = inp.T @ dout
    dbias[...] = dout.sum(axis=0)


def lin_half(dout, inp, weight, dinp, dweight, dbias):
    linear_backward(dout, inp, weight, dinp, dweight, dbias)
    dweight *= 0.5


def lin_rebind(dout, inp, weight, dinp, dweight, dbias):
    dinp = dout @ weight.T                       # noqa: F841  rebinds the names: nothing is written
    dweight = inp.T @ dout                       # noqa: F841
    dbias = dout.sum(axis=0)                     # noqa: F841


def sm_no_rowsum(dout, out, dinp):
    dinp[...] = out * dout


def sm_wrong_axis(dout, out, dinp):
    dinp[...] = out * (dout - (out * dout).sum(axis=0, keepdims=True))


def sm_no_keepdims(dout, out, dinp):
    dinp[...] = out * (dout - (out * dout).sum(axis=-1))


def sm_diagonal(dout, out, dinp):
    dinp[...] = out * (1 - out) * dout


def sm_skip_last_row(dout, out, dinp):
    dinp[:-1] = (out * (dout - (out * dout).sum(axis=-1, keepdims=True)))[:-1]


def ln_no_mean_term(dout, inp, weight, mean, rstd, dinp, dweight, dbias):
    layernorm_backward(dout, inp, weight, mean, rstd, dinp, dweight, dbias)
    xhat, g = _xhat(inp, mean, rstd), dout * weight
    dinp[...] = rstd[:, None] * (g - xhat * (g * xhat).mean(axis=-1, keepdims=True))


def ln_no_xhat_term(dout, inp, weight, mean, rstd, dinp, dweight, dbias):
    layernorm_backward(dout, inp, weight, mean, rstd, dinp, dweight, dbias)
    g = dout * weight
    dinp[...] = rstd[:, None] * (g - g.mean(axis=-1, keepdims=True))


def ln_wrong_axis(dout, inp, weight, mean, rstd, dinp, dweight, dbias):
    layernorm_backward(dout, inp, weight, mean, rstd, dinp, dweight, dbias)
    dweight[...] = (dout * _xhat(inp, mean, rstd)).sum(axis=1)
    dbias[...] = dout.sum(axis=1)


def ln_no_weight(dout, inp, weight, mean, rstd, dinp, dweight, dbias):
    layernorm_backward(dout, inp, np.ones_like(weight), mean, rstd, dinp, dweight, dbias)


def ln_no_dbias(dout, inp, weight, mean, rstd, dinp, dweight, dbias):
    layernorm_backward(dout, inp, weight, mean, rstd, dinp, dweight, dbias)
    dbias[...] = 0


def gelu_erf(dout, inp, dinp):
    x = inp.astype(np.float64)
    cdf = 0.5 * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))
    dinp[...] = dout * (cdf + x * np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi))


def gelu_no_cube_term(dout, inp, dinp):
    dinp[...] = dout * _gelu_grad(inp, dudx=S)


def gelu_no_dout(dout, inp, dinp):
    dinp[...] = _gelu_grad(inp)


def gelu_skip_tail(dout, inp, dinp):
    n = (inp.shape[0] // 32) * 32                # a grid of whole blocks only: the tail is never written
    dinp[:n] = (dout * _gelu_grad(inp))[:n]


def ce_no_mean(dout_logits, targets, dlogits):
    p = _probs(dout_logits)
    p[np.arange(len(targets)), targets] -= 1
    dlogits[...] = p                             # forgot / N


def ce_no_onehot(logits, targets, dlogits):
    dlogits[...] = _probs(logits) / logits.shape[0]


def ce_broadcast_onehot(logits, targets, dlogits):
    p = _probs(logits)
    p[:, targets] -= 1                           # every row's target in every row
    dlogits[...] = p / logits.shape[0]


def ce_skip_last_row(logits, targets, dlogits):
    p = _probs(logits)
    p[np.arange(len(targets)), targets] -= 1
    dlogits[:-1] = (p / logits.shape[0])[:-1]


def att_no_mask(dout, qkv, att, dqkv, n_head):
    _attention(dout, qkv, att, dqkv, n_head, mask=False)


def att_no_scale(dout, qkv, att, dqkv, n_head):
    _attention(dout, qkv, att, dqkv, n_head, scale=False)


def att_dk_no_transpose(dout, qkv, att, dqkv, n_head):
    _attention(dout, qkv, att, dqkv, n_head, dk_t=False)


def att_no_rowsum(dout, qkv, att, dqkv, n_head):
    _attention(dout, qkv, att, dqkv, n_head, rowsum=False)


def att_heads(dout, qkv, att, dqkv, n_head):
    _attention(dout, qkv, att, dqkv, n_head, heads_ok=False)


def enc_no_zero(dout, idx, dwte, dwpe):
    np.add.at(dwte, idx, dout)                   # forgot to zero: the NaN poison stays
    dwpe[:idx.shape[1]] += dout.sum(axis=0)


def enc_overwrite(dout, idx, dwte, dwpe):
    dwte[...] = 0
    dwpe[...] = 0
    dwte[idx] += dout                            # buffered: repeated tokens keep one contribution
    dwpe[:idx.shape[1]] = dout.sum(axis=0)


def enc_race(dout, idx, dwte, dwpe):
    """What a kernel without atomics may give: for a repeated token, only the first write survives."""
    dwte[...] = 0
    dwpe[...] = 0
    B, T = idx.shape
    for b in reversed(range(B)):
        for t in reversed(range(T)):
            dwte[idx[b, t]] = dout[b, t]
    dwpe[:T] = dout.sum(axis=0)


def enc_no_batch_sum(dout, idx, dwte, dwpe):
    encoder_backward(dout, idx, dwte, dwpe)
    dwpe[:idx.shape[1]] = dout[0]


def enc_zero_only_used(dout, idx, dwte, dwpe):
    dwte[idx] = 0                                # zeroes only the rows it touches
    dwpe[:idx.shape[1]] = 0
    np.add.at(dwte, idx, dout)
    dwpe[:idx.shape[1]] += dout.sum(axis=0)


def res_only_da(dout, da, db):
    da[...] = dout


def res_split(dout, da, db):
    da[...] = 0.5 * dout
    db[...] = 0.5 * dout


def res_db_zero(dout, da, db):
    da[...] = dout
    db[...] = 0


def res_skip_tail(dout, da, db):
    da[:-3] = dout[:-3]
    db[:-3] = dout[:-3]


WRONG = [
    (check_linear_backward, lin_no_transpose, "missing transpose: dinp looks like dout @ weight"),
    (check_linear_backward, lin_dbias_axis, "dbias is summed over the wrong axis"),
    (check_linear_backward, lin_no_dbias, "dbias was never written"),
    (check_linear_backward, lin_dweight_layout, "dweight is transposed"),
    (check_linear_backward, lin_skip_last_row, "elements of dinp were never written"),
    (check_linear_backward, lin_half, "off by a constant factor (x0.5)"),
    (check_linear_backward, lin_rebind, "only rebinds the name"),
    (check_softmax_backward, sm_no_rowsum, "missing the row-sum term"),
    (check_softmax_backward, sm_wrong_axis, "the row sum runs over the wrong axis"),
    (check_softmax_backward, sm_no_keepdims, "keepdims=True"),
    (check_softmax_backward, sm_diagonal, "only the diagonal of the softmax Jacobian"),
    (check_softmax_backward, sm_skip_last_row, "were never written"),
    (check_layernorm_backward, ln_no_mean_term, "missing the mean term"),
    (check_layernorm_backward, ln_no_xhat_term, "missing the xhat * mean(g * xhat) term"),
    (check_layernorm_backward, ln_wrong_axis, "reduced over the wrong axis"),
    (check_layernorm_backward, ln_no_weight, "dinp ignores weight"),
    (check_layernorm_backward, ln_no_dbias, "dbias is not computed"),
    (check_gelu_backward, gelu_erf, "exact (erf) GELU"),
    (check_gelu_backward, gelu_no_cube_term, "missing the 3 * 0.044715 x^2 term"),
    (check_gelu_backward, gelu_no_dout, "multiply the local derivative by dout"),
    (check_gelu_backward, gelu_skip_tail, "last partial block"),
    (check_crossentropy_backward, ce_no_mean, "divided by N"),
    (check_crossentropy_backward, ce_no_onehot, "subtract 1 at each row's target"),
    (check_crossentropy_backward, ce_broadcast_onehot, "only at each row's own target"),
    (check_crossentropy_backward, ce_skip_last_row, "were never written"),
    (check_attention_backward, att_no_mask, "without the causal mask"),
    (check_attention_backward, att_no_scale, "missing the 1/sqrt(hs) scale"),
    (check_attention_backward, att_dk_no_transpose, "missing transpose in dk"),
    (check_attention_backward, att_no_rowsum, "missing its row-sum term"),
    (check_attention_backward, att_heads, "the heads are split wrong"),
    (check_encoder_backward, enc_no_zero, "set dwte and dwpe to 0 first"),
    (check_encoder_backward, enc_overwrite, "must collect every contribution"),
    (check_encoder_backward, enc_race, "must collect every contribution"),
    (check_encoder_backward, enc_no_batch_sum, "dwpe[t] sums dout[b, t] over the whole batch b"),
    (check_encoder_backward, enc_zero_only_used, "rows that get no gradient must be 0"),
    (check_residual_backward, res_only_da, "db was never written"),
    (check_residual_backward, res_split, "not split between them"),
    (check_residual_backward, res_db_zero, "db = dout too"),
    (check_residual_backward, res_skip_tail, "never written"),
]


@pytest.mark.parametrize("check,fn,hint", WRONG, ids=[f.__name__ for _, f, _ in WRONG])
def test_wrong_fails_with_hint(check, fn, hint):
    for seed in (1, 2, 3):
        r = check(fn, seed=seed, quiet=True)
        assert r.status == "wrong" and not r.passed and not bool(r), r.message
        assert hint in r.hint, r.message
        assert r.output is not None and r.first_bad is not None and r.seed == seed
        assert f"seed {seed}" in r.message.splitlines()[0]


def test_wrong_in_float64_too():
    r = check_layernorm_backward(ln_no_mean_term, dtype=np.float64, seed=5, quiet=True)
    assert r.status == "wrong" and "missing the mean term" in r.hint and r.tol == checks.TOLERANCES["float64"]


def test_rectangular_case_turns_transposes_into_shape_errors():
    """After the square case, the rectangular one (C != OC): a missing transpose fails on shape, with shape hints."""
    rect = dataclasses.replace(checks._LINEAR, n_cases=1,
                               make=lambda rng, dt, size, k: checks._make_linear(rng, dt, size, 2))
    for fn in (lin_no_transpose, lin_dbias_axis):
        r = opcheck.run(rect, fn, seed=4, quiet=True)
        assert r.status == "error" and "ValueError" in r.message, r.message
        assert "shape or index problem" in r.hint and "dbias (OC,) = (" in r.hint and "dout @ weight.T" in r.hint


# ------------------------------------------------------------------------------------------------------------
# Not attempted, errors, NaN
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("check", [c for c, _ in CORRECT], ids=IDS)
def test_stub_is_not_attempted(check, capsys):
    def stub(*args):
        raise NotImplementedError("TODO")

    r = check(stub)
    assert r.status == "not attempted" and not r.passed
    out = capsys.readouterr().out
    assert out == f"{r.name}: not attempted (your function raised NotImplementedError)\n"


@pytest.mark.parametrize("check", [c for c, _ in CORRECT], ids=IDS)
def test_other_error_is_reported_not_raised(check, capsys):
    def broken(*args):
        raise ZeroDivisionError("my bug")

    r = check(broken)
    assert r.status == "error" and not r.passed
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    assert lines[0] == f"{r.name}: error - your function raised ZeroDivisionError: my bug"
    assert lines[1].startswith("  hint: ") and "in broken" in lines[1] and f"seed {r.seed}" in lines[1]


def test_shape_error_hint_lists_shapes(capsys):
    def wrong_shapes(dout, inp, weight, dinp, dweight, dbias):
        dinp[...] = dout @ weight.T
        dweight[...] = inp.T @ dout
        dbias[...] = dout.sum(axis=0, keepdims=True).T   # (OC, 1) does not fit (OC,)

    r = check_linear_backward(wrong_shapes, seed=3)
    out = capsys.readouterr().out.splitlines()
    assert r.status == "error" and out[0].startswith("linear_backward: error - your function raised ValueError: ")
    assert "shape or index problem" in out[1] and "dout (N, OC) = " in out[1] and "weight.T" in out[1]


@pytest.mark.parametrize("check,fn", CORRECT, ids=IDS)
def test_nan_output_fails(check, fn):
    def with_nan(*args):
        fn(*args)
        n_in = {"linear_backward": 3, "softmax_backward": 2, "layernorm_backward": 5, "gelu_backward": 2,
                "crossentropy_backward": 2, "attention_backward": 3, "encoder_backward": 2,
                "residual_backward": 1}[check.__name__[len("check_"):]]
        args[n_in].reshape(-1)[0] = np.nan          # a NaN that our arithmetic "made"
        args[n_in].reshape(-1)[1] = np.inf

    r = check(with_nan, seed=0, quiet=True)
    assert r.status == "wrong" and not r.passed
    assert "NaN/inf" in r.hint and r.first_bad is not None and math.isnan(r.ours)


def test_printed_forms(capsys):
    r = check_linear_backward(linear_backward, seed=7)
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.startswith("linear_backward: correct (max rel err ")
    assert out.rstrip().endswith(", tol 1e-05, fp32, 3 outputs)") and out.strip() == r.message == str(r)

    r = check_linear_backward(lin_no_transpose, seed=7)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("linear_backward: wrong - dinp at [")
    assert ": yours " in lines[0] and ", expected " in lines[0] and "(max abs err " in lines[0]
    assert lines[0].endswith("tol 1e-05; seed 7)") and lines[1].startswith("  hint: missing transpose")
    assert r.first_bad == tuple(int(i) for i in lines[0].split(" at [")[1].split("]")[0].split(", "))

    check_gelu_backward(gelu_backward, seed=1, dtype=np.float64)
    assert capsys.readouterr().out.endswith("tol 1e-09, fp64, 1 output)\n")

    check_gelu_backward(gelu_backward, quiet=True)
    assert capsys.readouterr().out == ""


def test_result_fields_and_reproducible_seed():
    a = check_softmax_backward(sm_no_rowsum, seed=11, quiet=True)
    b = check_softmax_backward(sm_no_rowsum, seed=11, quiet=True)
    assert a.message == b.message and a.first_bad == b.first_bad and a.ours == b.ours
    assert a.expected != a.ours and a.max_abs > 0 and a.max_rel > a.tol and a.dtype == "float32"
    assert a.arrays == "numpy" and set(a.atol) == {"dinp"} and a.dims["N"] > 0 and "out" in a.inputs
    assert repr(a).startswith("CheckResult(softmax_backward: wrong")


def test_square_case_then_rectangular():
    shapes = []

    def spy(dout, inp, weight, dinp, dweight, dbias):
        shapes.append((dout.shape, inp.shape, weight.shape))
        linear_backward(dout, inp, weight, dinp, dweight, dbias)

    for seed in range(2):
        shapes.clear()
        assert check_linear_backward(spy, seed=seed, quiet=True)
        (sq_dout, sq_inp, _), again, (dout_shape, inp_shape, weight_shape), row = shapes
        assert sq_dout[0] == sq_dout[1] == sq_inp[1] and again == shapes[0]   # N = C = OC, then the same again
        N, OC = dout_shape
        C = inp_shape[1]
        assert C != OC and weight_shape == (C, OC) and N % 16 and C % 16 and OC % 16
        assert min(N, C, OC) > 16 and row[0][0] == 1                           # several tiles; a single row


def test_encoder_inputs_have_repeats_and_unused_rows():
    seen = []

    def spy(dout, idx, dwte, dwpe):
        seen.append((idx.copy(), dwte.shape, dwpe.shape, np.isnan(dwte).all() and np.isnan(dwpe).all()))
        encoder_backward(dout, idx, dwte, dwpe)

    for seed in range(5):
        assert check_encoder_backward(spy, seed=seed, quiet=True)
    for idx, (V, C), (maxT, _), poisoned in seen:
        counts = np.bincount(idx.ravel(), minlength=V)
        assert (counts == 0).any() and maxT > idx.shape[1] and poisoned and idx.dtype == np.int32
        assert counts.max() >= 2 or idx.size == 1                 # a repeated token, except in the B = T = 1 case
    assert any(idx.shape == (1, 1) for idx, *_ in seen)


def test_input_mutation_is_noted():
    def mutates(dout, out, dinp):
        dout *= out                                   # in place: changes the caller's dout
        dinp[...] = dout

    r = check_softmax_backward(mutates, seed=2, quiet=True)
    assert r.status == "wrong" and "changed its input dout" in r.hint


def test_grading_record(tmp_path, monkeypatch):
    log = tmp_path / "grades.jsonl"
    monkeypatch.setenv("GPULLM_GRADE_LOG", str(log))
    check_residual_backward(residual_backward, task="03.1 residual", quiet=True)
    check_residual_backward(res_only_da, quiet=True)
    check_gelu_backward(lambda *a: 1 / 0, task="gelu", quiet=True)
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    assert [e["status"] for e in entries] == ["correct", "wrong", "error"]
    assert entries[0]["check"] == "check_residual_backward" and entries[0]["task"] == "03.1 residual"
    assert entries[1]["task"] is None and entries[1]["message"].startswith("residual_backward: wrong - db at [")
    assert "\n" not in entries[1]["message"] and entries[2]["task"] == "gelu"


# ------------------------------------------------------------------------------------------------------------
# Misuse of the checker itself: clear errors
# ------------------------------------------------------------------------------------------------------------
def test_bad_use_of_checker():
    with pytest.raises(TypeError, match="without calling it"):
        check_linear_backward(None)
    with pytest.raises(ValueError, match="'numpy', 'cupy', 'numba'"):
        check_linear_backward(linear_backward, arrays="torch")
    with pytest.raises(ValueError, match="float32"):
        check_linear_backward(linear_backward, dtype=np.int32)
    with pytest.raises(ValueError, match="float32"):
        check_linear_backward(linear_backward, dtype="float8")
    with pytest.raises(ValueError, match="'small', 'large'"):
        check_linear_backward(linear_backward, size="huge")
    with pytest.raises(TypeError, match="seed"):
        check_linear_backward(linear_backward, seed="abc")


@pytest.mark.skipif(device.has_gpu(), reason="checks the message shown without a GPU")
def test_cupy_without_gpu_names_the_fix():
    with pytest.raises(arrays.BackendUnavailableError, match=r"cuda13|arrays='numba'"):
        arrays.to_backend(np.zeros(3, np.float32), "cupy")


@pytest.mark.skipif(device.has_gpu(), reason="checks what happens without a GPU")
def test_cupy_check_without_gpu_is_skipped_not_crashed(capsys, tmp_path, monkeypatch):
    log = tmp_path / "log.jsonl"
    monkeypatch.setenv("GPULLM_GRADE_LOG", str(log))
    r = check_residual_backward(residual_backward, arrays="cupy", task="t")
    assert r.status == "skipped" and not r.passed
    assert "skipped - arrays='cupy' runs on a GPU" in capsys.readouterr().out
    assert '"status": "skipped"' in log.read_text()


# ------------------------------------------------------------------------------------------------------------
# runtime/arrays.py
# ------------------------------------------------------------------------------------------------------------
def test_arrays_roundtrip():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    x = arrays.to_backend(a, "numpy")
    assert arrays.backend_of(x) == "numpy" and x is not a and np.array_equal(arrays.to_numpy(x), a)
    d = arrays.to_backend(a, "numba")
    assert arrays.backend_of(d) == "numba"
    back = arrays.to_numpy(d)
    assert isinstance(back, np.ndarray) and np.array_equal(back, a) and back.dtype == np.float32
    with pytest.raises(ValueError, match="'numpy', 'cupy', 'numba'"):
        arrays.to_backend(a, "jax")
    with pytest.raises(TypeError):
        arrays.backend_of([1, 2])


# ------------------------------------------------------------------------------------------------------------
# Numba kernels under the simulator (arrays="numba")
# ------------------------------------------------------------------------------------------------------------
@cuda.jit
def residual_kernel(dout, da, db):
    i = cuda.grid(1)
    if i < dout.shape[0]:
        da[i] = dout[i]
        db[i] = dout[i]


@cuda.jit
def gelu_kernel(dout, inp, dinp):
    i = cuda.grid(1)
    if i < inp.shape[0]:
        x = inp[i]
        t = math.tanh(S * (x + K * x * x * x))
        dinp[i] = dout[i] * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * S * (1 + 3 * K * x * x))


@cuda.jit
def unguarded_kernel(dout, da, db):
    i = cuda.grid(1)
    da[i] = dout[i]                                  # no `if i < n`: reads past the end
    db[i] = dout[i]


def test_numba_kernels_in_the_simulator():
    threads = 64

    def residual_numba(dout, da, db):
        residual_kernel[(dout.shape[0] + threads - 1) // threads, threads](dout, da, db)

    def residual_numba_short(dout, da, db):
        residual_kernel[dout.shape[0] // threads, threads](dout, da, db)   # forgets the last partial block

    def gelu_numba(dout, inp, dinp):
        gelu_kernel[(inp.shape[0] + threads - 1) // threads, threads](dout, inp, dinp)

    def residual_unguarded(dout, da, db):
        unguarded_kernel[(dout.shape[0] + threads - 1) // threads, threads](dout, da, db)

    r = check_residual_backward(residual_numba, arrays="numba", seed=1, quiet=True)
    assert r.passed and r.arrays == "numba", r.message
    r = check_gelu_backward(gelu_numba, arrays="numba", seed=2, quiet=True)
    assert r.passed, r.message
    r = check_residual_backward(residual_numba_short, arrays="numba", seed=1, quiet=True)
    assert r.status == "wrong" and "never written" in r.hint and "last partial block" in r.hint
    assert r.output == "da" and ("elements 64..96" in r.hint or device.numba_on_gpu())   # 97 elements (simulator)
    if not device.numba_on_gpu():
        # The simulator bounds-checks every access; a real GPU does not, so there the unguarded kernel's
        # out-of-range accesses go unseen (or corrupt other memory): the reason every kernel guards with `if i < n`.
        r = check_residual_backward(residual_unguarded, arrays="numba", seed=1, quiet=True)
        assert r.status == "error" and "IndexError" in r.message
    with pytest.raises(TypeError, match="Numba kernel"):
        check_residual_backward(residual_kernel, arrays="numba")


def test_scalar_broadcast_into_output():
    def dbias_scalar(dout, inp, weight, dinp, dweight, dbias):
        linear_backward(dout, inp, weight, dinp, dweight, dbias)
        dbias[...] = dout.sum(axis=1).mean()          # one number for every channel

    r = check_linear_backward(dbias_scalar, seed=8, quiet=True)
    assert r.status == "wrong" and r.output == "dbias" and "has the same value" in r.hint


# ------------------------------------------------------------------------------------------------------------
# Checkers that size cannot fool: deterministic cases, stale state, tiles, blocks, capped grids
# ------------------------------------------------------------------------------------------------------------
SIM_MAX_BLOCKS, SIM_THREADS = 2, 32          # the exercises' capped launchers in the simulator
GPU_GRID = 4096 * 256                        # ... and on a GPU


def _cases(op_name, size):
    return checks.CASE_DIMS[op_name][size]


@pytest.mark.parametrize("name", sorted(checks._OPS))
def test_case_lists_are_deterministic_repeat_and_include_awkward_shapes(name):
    op = checks._OPS[name]
    for size in checks.SIZES:
        cases = _cases(name, size)
        assert len(cases) == op.n_cases >= 3
        assert cases[0] == cases[1]                   # the same shapes twice, new values: stale state fails
        assert any(c.get(d) == 1 for c in cases for d in ("N", "n", "T")), cases   # one row / n = 1 / T = 1
        if size == "small":                           # shapes never depend on the seed
            for k in range(op.n_cases):
                a, b = (op.make(np.random.default_rng(s), np.dtype(np.float32), size, k) for s in (0, 1))
                assert a.dims == b.dims and a.dims.items() >= cases[k].items()


def test_case_sizes_span_tiles_blocks_and_capped_grids():
    lin = _cases("linear_backward", "small")
    assert any(all(c[d] > 16 and c[d] % 16 for d in ("N", "C", "OC")) and c["C"] != c["OC"] for c in lin)
    assert any(c["N"] == 1 for c in lin)
    for name in ("gelu_backward", "residual_backward"):
        small, large = [c["n"] for c in _cases(name, "small")], [c["n"] for c in _cases(name, "large")]
        assert max(small) > SIM_MAX_BLOCKS * SIM_THREADS and any(32 < n < 64 for n in small) and 1 in small
        assert max(large) > GPU_GRID and any(256 < n < GPU_GRID and n % 256 for n in large) and 1 in large
        assert all(n % 4 for n in small + large)      # float4 loads need a scalar tail
    for name in ("softmax_backward", "layernorm_backward", "crossentropy_backward"):
        small, large = _cases(name, "small"), _cases(name, "large")
        assert max(c["N"] for c in small) > SIM_MAX_BLOCKS * SIM_THREADS and any(c["N"] == 1 for c in small)
        assert max(c["N"] for c in large) > 4096 and any(c["N"] == 1 for c in large)
        assert any(max(v for k, v in c.items() if k != "N") > 32 for c in small)   # rows longer than a warp
    att = _cases("attention_backward", "small")
    assert any(c["T"] == 1 for c in att) and any(c["T"] > 32 for c in att)
    assert any(c["B"] * c["nh"] * c["T"] > 64 for c in att)
    enc = _cases("encoder_backward", "small")
    assert all(c["B"] * c["T"] * c["C"] > 64 for c in enc[:3]) and any(c["T"] == 1 for c in enc)
    assert any(c["B"] * c["T"] * c["C"] > GPU_GRID for c in _cases("encoder_backward", "large"))


def test_size_none_means_large_on_a_gpu(monkeypatch):
    assert checks.default_size("numpy") == "small" and checks.default_size("cupy") == "large"
    monkeypatch.setattr(device, "numba_on_gpu", lambda: False)
    assert checks.default_size("numba") == "small"
    monkeypatch.setattr(device, "numba_on_gpu", lambda: True)
    assert checks.default_size("numba") == "large" and checks.default_size("numba", "small") == "small"
    assert opcheck.validate("residual_backward", residual_backward, "numba", np.float32, None, None)[1] == "large"


def _caching(fn):
    """A function that computes its first answer once and copies it out on every later call."""
    memo = {}

    def cached(*args):
        n_out = {"linear_backward": 3, "layernorm_backward": 3, "encoder_backward": 2, "residual_backward": 2}
        if not memo:
            fn(*args)
            memo["outs"] = [a.copy() for a in args if isinstance(a, np.ndarray) and a.dtype.kind == "f"]
        outs = [a for a in args if isinstance(a, np.ndarray) and a.dtype.kind == "f"]
        for dst, src in zip(outs[len(outs) - len(memo["outs"]):], memo["outs"]):
            if dst.shape == src.shape:
                dst[...] = src
        del n_out
    return cached


@pytest.mark.parametrize("check,fn", CORRECT, ids=IDS)
def test_a_function_that_keeps_its_first_answer_fails_on_the_second_call(check, fn):
    r = check(_caching(fn), seed=3, quiet=True)
    assert r.status == "wrong", r.message
    assert "EARLIER call" in r.hint and "keeps state between calls" in r.hint, r.message


# ---- a tiled GEMM (Numba, simulator) that sums only the first tile along K ----------------------------------
TILE = 16


@cuda.jit
def _gemm_first_k_tile(a, b, out, trans_a, trans_b):
    """out = op(a) @ op(b) with 16 x 16 shared tiles, but the loop over K tiles is missing: only k0 = 0."""
    sa = cuda.shared.array((16, 16), numba_float32)
    sb = cuda.shared.array((16, 16), numba_float32)
    M, P = out.shape
    K = a.shape[0] if trans_a else a.shape[1]
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    i, j = cuda.blockIdx.y * 16 + ty, cuda.blockIdx.x * 16 + tx
    acc = numba_float32(0.0)
    k0 = 0                                            # BUG: for k0 in range(0, K, 16) is missing
    r, c = (k0 + tx, i) if trans_a else (i, k0 + tx)
    sa[ty, tx] = a[r, c] if r < a.shape[0] and c < a.shape[1] and k0 + tx < K and i < M else 0.0
    r, c = (j, k0 + ty) if trans_b else (k0 + ty, j)
    sb[ty, tx] = b[r, c] if r < b.shape[0] and c < b.shape[1] and k0 + ty < K and j < P else 0.0
    cuda.syncthreads()
    for kk in range(16):
        acc += sa[ty, kk] * sb[kk, tx]
    cuda.syncthreads()
    if i < M and j < P:
        out[i, j] = acc


@cuda.jit
def _column_sum(dout, dbias):
    o = cuda.grid(1)
    if o < dbias.shape[0]:
        s = numba_float32(0.0)
        for n in range(dout.shape[0]):
            s += dout[n, o]
        dbias[o] = s


def _linear_with(gemm_kernel):
    """dweight = inp^T dout through the tiled kernel (K = N); dinp and dbias right (keeps the simulator cheap)."""
    def launcher(dout, inp, weight, dinp, dweight, dbias):
        M, P = dweight.shape
        gemm_kernel[((P + TILE - 1) // TILE, (M + TILE - 1) // TILE), (TILE, TILE)](inp, dout, dweight, 1, 0)
        dinp.copy_to_device(dout.copy_to_host() @ weight.copy_to_host().T)
        _column_sum[(dbias.shape[0] + 31) // 32, 32](dout, dbias)
    return launcher


@pytest.mark.skipif(device.numba_on_gpu(), reason="the simulator case; on a GPU test_checks_gpu runs large sizes")
def test_tiled_gemm_summing_only_the_first_k_tile_fails_naming_it():
    r = check_linear_backward(_linear_with(_gemm_first_k_tile), arrays="numba", seed=5, quiet=True)
    assert r.status == "wrong" and r.output == "dweight" and r.dims["N"] > 16, r.message   # passes while K <= 16
    assert r.hint.startswith("only the first tile along K is summed (a 16-wide tile; K = 37 needs several): your "
                             "dweight equals the sum over the first 16 of its K = N = 37 products"), r.hint


def lin_first_k_tile_32(dout, inp, weight, dinp, dweight, dbias):
    dinp[...] = dout[:, :32] @ weight[:, :32].T          # a 32-wide tile, the K loop stops after one tile
    dweight[...] = inp[:32].T @ dout[:32]
    dbias[...] = dout.sum(axis=0)


def lin_whole_k_tiles_only(dout, inp, weight, dinp, dweight, dbias):
    K1, K2 = (weight.shape[1] // 16) * 16, (inp.shape[0] // 16) * 16   # range(K // TILE): the partial tile is lost
    dinp[...] = dout[:, :K1] @ weight[:, :K1].T
    dweight[...] = inp[:K2].T @ dout[:K2]
    dbias[...] = dout.sum(axis=0)


def test_k_tile_mistakes_mimicked_in_numpy():
    r = check_linear_backward(lin_first_k_tile_32, seed=1, quiet=True)
    assert r.status == "wrong" and "your dweight equals the sum over the first 32 of its K = N = 37" in r.hint
    r = check_linear_backward(lin_whole_k_tiles_only, seed=1, quiet=True)   # K = 7 < 16 first: nothing summed
    assert r.status == "wrong" and "as a loop over K // TILE tiles gives when K < TILE" in r.hint, r.message
    # past the first cases (K > 16): a loop over whole tiles only
    big = dataclasses.replace(checks._LINEAR, n_cases=1,
                              make=lambda rng, dt, size, k: checks._make_linear(rng, dt, size, 2))
    r = opcheck.run(big, lin_whole_k_tiles_only, seed=1, quiet=True)
    assert r.status == "wrong" and r.output == "dinp", r.message     # K = OC = 18: 16 products either way
    assert r.hint.startswith("only the first tile along K is summed (16 wide), or the partial last"), r.message
    assert "Also: " in r.hint and "your dweight equals the sum over the first 32 of its K = N = 37" in r.hint


# ---- launchers that cover too little: one block, a capped grid without a grid-stride loop, 0 blocks ----------
@cuda.jit
def gelu_no_stride_kernel(dout, inp, dinp):
    i = cuda.grid(1)                                 # one element per thread, no grid-stride loop
    if i < inp.shape[0]:
        x = inp[i]
        t = math.tanh(S * (x + K * x * x * x))
        dinp[i] = dout[i] * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * S * (1 + 3 * K * x * x))


@cuda.jit
def gelu_stride_kernel(dout, inp, dinp):
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for i in range(start, inp.shape[0], stride):
        x = inp[i]
        t = math.tanh(S * (x + K * x * x * x))
        dinp[i] = dout[i] * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * S * (1 + 3 * K * x * x))


def _capped(kernel):
    def launcher(dout, inp, dinp):                  # the exercises' launcher: the grid is capped
        n = inp.shape[0]
        kernel[min(SIM_MAX_BLOCKS, (n + SIM_THREADS - 1) // SIM_THREADS), SIM_THREADS](dout, inp, dinp)
    return launcher


@pytest.mark.skipif(device.numba_on_gpu(), reason="simulator sizes")
def test_kernel_without_grid_stride_loop_fails_under_a_capped_launcher():
    assert check_gelu_backward(_capped(gelu_stride_kernel), arrays="numba", seed=2, quiet=True).passed
    r = check_gelu_backward(_capped(gelu_no_stride_kernel), arrays="numba", seed=2, quiet=True)
    assert r.status == "wrong" and r.first_bad == (64,), r.message
    assert "every element past index G = 64" in r.hint and "grid-stride loop" in r.hint, r.message


@pytest.mark.skipif(device.numba_on_gpu(), reason="simulator sizes")
def test_launcher_covering_only_the_first_block_fails_naming_it():
    def one_block(dout, da, db):
        residual_kernel[1, 32](dout, da, db)         # n > 32: only the first block of elements

    r = check_residual_backward(one_block, arrays="numba", seed=4, quiet=True)
    assert r.status == "wrong" and "only the first 32 elements are right" in r.hint, r.message
    assert "only the first block?" in r.hint and "(n + threads - 1) // threads" in r.hint


@pytest.mark.skipif(device.numba_on_gpu(), reason="simulator sizes")
def test_launch_of_zero_blocks_is_named_not_called_rebinding():
    def floor_blocks(dout, da, db):
        residual_kernel[dout.shape[0] // 128, 128](dout, da, db)   # 0 blocks whenever n < 128

    r = check_residual_backward(floor_blocks, arrays="numba", seed=4, quiet=True)
    assert r.status == "wrong" and "launch of 0 blocks" in r.hint and "rebinds" not in r.hint, r.message


def sm_rows_capped(dout, out, dinp):
    """A row kernel launched on a capped grid of 64 threads, one row per thread, no grid-stride loop."""
    softmax_backward(dout[:64], out[:64], dinp[:64])


def test_row_kernel_without_grid_stride_loop_names_the_rows():
    r = check_softmax_backward(sm_rows_capped, seed=1, quiet=True)
    assert r.status == "wrong" and "every row past index G = 64" in r.hint and "grid-stride" in r.hint, r.message


# ---- hints that say where ---------------------------------------------------------------------------------
def test_hint_names_a_range_of_wrong_rows():
    def rows_3_to_6(dout, out, dinp):
        softmax_backward(dout, out, dinp)
        dinp[3:7] *= 1.5

    r = check_softmax_backward(rows_3_to_6, seed=1, quiet=True)
    assert r.status == "wrong" and "rows 3..6 of dinp are wrong" in r.hint, r.message


def test_hint_names_every_kth_element():
    def every_other(dout, da, db):
        da[...] = 0
        da[::2] = dout[::2]                          # a stride bug: only even indices
        db[...] = dout

    r = check_residual_backward(every_other, seed=1, quiet=True)
    assert r.status == "wrong" and "every 2nd element of da is wrong (flat indices 1, 3, 5, ...)" in r.hint, r.message

    def every_third_right(dout, da, db):
        da[...] = 0
        da[1::3] = dout[1::3]
        db[...] = dout

    r = check_residual_backward(every_third_right, seed=1, quiet=True)
    assert r.status == "wrong" and "only every 3rd element of da is right (flat indices 1, 4, 7" in r.hint, r.message


def test_sign_flip_wording():
    def neg_dweight(dout, inp, weight, dinp, dweight, dbias):
        linear_backward(dout, inp, weight, dinp, dweight, dbias)
        dweight *= -1

    r = check_linear_backward(neg_dweight, seed=2, quiet=True)
    assert r.status == "wrong" and r.hint.startswith("the sign of dweight is flipped (x-1)"), r.message
    assert "is the sign" not in r.hint


def test_scattered_wrong_elements_counted_once():
    def scattered(dout, inp, dinp):
        gelu_backward(dout, inp, dinp)
        dinp[[3, 10, 11, 40, 41, 42, 70, 90]] += 1.0

    r = check_gelu_backward(scattered, seed=3, quiet=True)
    assert r.status == "wrong" and r.hint.count("elements") == 1 and "8 of 97 elements of dinp are wrong" in r.hint


@cuda.jit
def gelu_sqrt_kernel(dout, inp, dinp):
    i = cuda.grid(1)
    if i < inp.shape[0]:
        dinp[i] = dout[i] * math.sqrt(inp[i])        # a math domain error for inp < 0


@pytest.mark.skipif(device.numba_on_gpu(), reason="the simulator raises inside the kernel; a GPU does not")
def test_errors_inside_a_kernel_name_thread_block_and_cause():
    def unguarded(dout, da, db):
        unguarded_kernel[(dout.shape[0] + 31) // 32, 32](dout, da, db)

    r = check_residual_backward(unguarded, arrays="numba", seed=1, quiet=True)
    assert r.status == "error" and "your kernel raised IndexError in thread (" in r.message, r.message
    assert "tid=" not in r.message and "of block (" in r.hint and "guard it (if i < n:)" in r.hint
    assert "transposes and axes" not in r.hint
    r = check_gelu_backward(lambda d, x, o: gelu_sqrt_kernel[4, 32](d, x, o), arrays="numba", seed=1, quiet=True)
    # the hint names the call, its argument and the argument's value in the thread that raised
    assert r.status == "error" and "math domain error" in r.hint and "sqrt(inp[i]) with inp[i] = -" in r.hint \
        and "a negative number" in r.hint, r.message


def test_a_launcher_of_an_unwritten_kernel_is_not_attempted_before_anything_runs():
    """On a GPU Numba compiles a kernel's `raise` away and the stub runs, writing nothing: the checker must say
    "not attempted" from the kernel's source, not "wrong" from its (unwritten) output."""
    from numba import cuda

    @cuda.jit
    def stub_kernel(dout, inp, dinp):
        raise NotImplementedError("exercise: write this part")

    calls = []

    def gelu_backward(dout, inp, dinp):
        calls.append(1)
        stub_kernel[1, 32](dout, inp, dinp)

    assert checks.unfinished_kernel(gelu_backward) == "stub_kernel"
    r = checks.check_gelu_backward(gelu_backward, arrays="numba", quiet=True)
    assert r.status == "not attempted" and "stub_kernel" in r.message and calls == []

    @cuda.jit
    def written(dout, inp, dinp):
        i = cuda.grid(1)
        if i < dinp.shape[0]:
            dinp[i] = dout[i]

    assert checks.unfinished_kernel(lambda d, x, o: written[1, 32](d, x, o)) is None


# ---- guard zones: an out-of-bounds write, which nothing traps on a real GPU --------------------------------------
def _gelu_right(dout, inp, dinp):
    import gpullm_lessons.reference as ref
    dinp[...] = ref.gelu_backward(dout.astype(np.float64), {"inp": inp.astype(np.float64)})


def _gelu_one_past_the_end(dout, inp, dinp):
    """Right, and one element past the end written too: what `i <= n` does on a GPU (a view of a larger buffer)."""
    _gelu_right(dout, inp, dinp)
    base = dinp.base
    g = (base.size - dinp.size) // 2
    base[g + dinp.size] = 0.0


def _gelu_before_the_start(dout, inp, dinp):
    _gelu_right(dout, inp, dinp)
    dinp.base[0] = 1.0


@pytest.fixture
def guards(monkeypatch):
    monkeypatch.setattr(opcheck, "GUARDS", True)


def test_guard_zones_leave_a_right_answer_right(guards):
    r = checks.check_gelu_backward(_gelu_right, arrays="numpy", seed=3, quiet=True)
    assert r.status == "correct", r.message


def test_a_write_past_the_end_is_named_with_the_guard(guards):
    r = checks.check_gelu_backward(_gelu_one_past_the_end, arrays="numpy", seed=3, quiet=True)
    assert r.status == "wrong" and "wrote outside dinp" in r.message and "1 element past its end" in r.message
    assert "i < n, not i <= n" in r.hint and "out-of-bounds write" in r.hint


def test_a_write_before_the_start_is_named(guards):
    r = checks.check_gelu_backward(_gelu_before_the_start, arrays="numpy", seed=3, quiet=True)
    assert r.status == "wrong" and "before its start" in r.message, r.message


def test_guard_zones_by_default_only_where_nothing_traps_a_stray_write(monkeypatch):
    """The simulator and NumPy raise IndexError on a write out of bounds (the checker names the thread); a GPU's
    arrays (CuPy, Numba on a GPU) do not: there the zones are on."""
    monkeypatch.setattr(opcheck, "GUARDS", None)
    assert opcheck.guards_on("numpy") is False and opcheck.guards_on("cupy") is True
    assert opcheck.guards_on("numba") is device.numba_on_gpu()


def test_guard_zones_keep_vector_alignment():
    outs, bufs = opcheck.guarded_outputs([(3, 5)], np.dtype(np.float16), "numpy", True)
    g = (bufs[0].size - 15) // 2
    assert g * 2 == opcheck.GUARD_BYTES and outs[0].shape == (3, 5) and opcheck.is_poison(bufs[0]).all()


def test_the_ops_checkers_use_the_guard_zones_too(guards):
    """checks_ops (the determinism / race / one-pass checkers) allocates its outputs the same way."""
    from gpullm_lessons.checks import ops as checks_ops

    def ce(logits, targets, dlogits):
        x = logits.astype(np.float64)
        p = np.exp(x - x.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        p[np.arange(len(targets)), targets] -= 1.0
        dlogits[...] = p / len(targets)

    def ce_one_too_far(logits, targets, dlogits):
        ce(logits, targets, dlogits)
        dlogits.base[(dlogits.base.size - dlogits.size) // 2 + dlogits.size] = 0.0

    assert checks_ops.check_crossentropy_online(ce, arrays="numpy", seed=2, quiet=True).status == "correct"
    r = checks_ops.check_crossentropy_online(ce_one_too_far, arrays="numpy", seed=2, quiet=True)
    assert r.status == "wrong" and "wrote outside dlogits" in r.message and "i < n, not i <= n" in r.hint, r.message
