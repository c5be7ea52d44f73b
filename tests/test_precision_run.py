"""Emulated half-precision matmuls (precision.matmul_precision) and the fp32 / bf16 / fp16 training comparison."""
import math

import ml_dtypes
import numpy as np
import pytest

from gpullm_lessons.model import precision as P
from gpullm_lessons.reference import rounding
from gpullm_lessons.model.params import GPTConfig
from gpullm_lessons.reference import attention_backward, attention_forward, linear_backward, linear_forward


def rb(x):
    """bf16 rounding by hand, through ml_dtypes."""
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def rh(x):
    """fp16 rounding by hand."""
    return np.asarray(x, np.float32).astype(np.float16).astype(np.float32)


HAND = {"bf16": rb, "fp16": rh}


def linear_case(rng, B=3, T=5, C=7, OC=6):
    return (rng.standard_normal((B, T, C), dtype=np.float32), rng.standard_normal((C, OC), dtype=np.float32),
            rng.standard_normal(OC, dtype=np.float32), rng.standard_normal((B, T, OC), dtype=np.float32))


def test_default_is_plain_fp32_bit_for_bit():
    inp, w, b, dout = linear_case(np.random.default_rng(0))
    for ctx in (None, "fp32"):
        if ctx is None:
            out, cache = linear_forward(inp, w, b)
            dinp, dw, db = linear_backward(dout, cache)
        else:
            with P.matmul_precision(ctx) as stats:
                out, cache = linear_forward(inp, w, b)
                dinp, dw, db = linear_backward(dout, cache)
            assert stats.values == 0                      # fp32 rounds nothing, counts nothing
        np.testing.assert_array_equal(out, inp @ w + b)
        np.testing.assert_array_equal(dinp, dout @ w.T)
        np.testing.assert_array_equal(dw, inp.reshape(-1, 7).T @ dout.reshape(-1, 6))
        np.testing.assert_array_equal(db, dout.reshape(-1, 6).sum(0))
    assert P.mm_round(inp) is inp                        # no copy at all by default


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_linear_rounds_its_matmul_inputs(name):
    r = HAND[name]
    inp, w, b, dout = linear_case(np.random.default_rng(1))
    with P.matmul_precision(name) as stats:
        out, cache = linear_forward(inp, w, b)
        dinp, dw, db = linear_backward(dout, cache)
    assert out.dtype == dinp.dtype == dw.dtype == np.float32
    assert not np.array_equal(out, inp @ w + b)          # rounding happened
    np.testing.assert_array_equal(out, r(inp) @ r(w) + b)
    np.testing.assert_array_equal(dinp, r(dout) @ r(w).T)
    np.testing.assert_array_equal(dw, r(inp).reshape(-1, 7).T @ r(dout).reshape(-1, 6))
    np.testing.assert_array_equal(db, dout.reshape(-1, 6).sum(0))   # a reduction, not a matmul: fp32
    assert stats.values == 2 * inp.size + 2 * w.size + dout.size


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_attention_rounds_its_matmul_inputs(name):
    r = HAND[name]
    rng = np.random.default_rng(2)
    B, T, C, nh = 2, 5, 8, 2
    hs = C // nh
    qkv = rng.standard_normal((B, T, 3 * C), dtype=np.float32)
    dout = rng.standard_normal((B, T, C), dtype=np.float32)
    out32, _ = attention_forward(qkv, nh)
    with P.matmul_precision(name):
        out, cache = attention_forward(qkv, nh)
        dqkv = attention_backward(dout, cache)
    assert not np.array_equal(out, out32)
    # by hand: the same computation with every matmul input rounded
    heads = lambda x: x.reshape(B, T, nh, hs).transpose(0, 2, 1, 3)      # noqa: E731
    merge = lambda x: x.transpose(0, 2, 1, 3).reshape(B, T, C)           # noqa: E731
    q, k, v = (heads(x) for x in np.split(qkv, 3, axis=-1))
    scale = 1.0 / math.sqrt(hs)
    pre = (r(q) @ r(k).swapaxes(-1, -2)) * scale
    pre = np.where(np.tril(np.ones((T, T), bool)), pre, -np.inf)
    att = np.exp(pre - pre.max(-1, keepdims=True))
    att /= att.sum(-1, keepdims=True)
    np.testing.assert_allclose(cache["att"], att, rtol=1e-6, atol=1e-7)
    att = cache["att"]                                                  # the exact same probabilities from here on
    np.testing.assert_array_equal(out, merge(r(att) @ r(v)))
    dy = heads(dout)
    datt = r(dy) @ r(v).swapaxes(-1, -2)
    dv = r(att).swapaxes(-1, -2) @ r(dy)
    dpre = att * (datt - (att * datt).sum(-1, keepdims=True))
    dq = (r(dpre) @ r(k)) * scale
    dk = (r(dpre).swapaxes(-1, -2) @ r(q)) * scale
    want = np.concatenate([merge(dq), merge(dk), merge(dv)], axis=-1)
    np.testing.assert_allclose(dqkv, want, rtol=1e-5, atol=1e-6)
    # and the fp32 default is untouched after the block
    np.testing.assert_array_equal(attention_forward(qkv, nh)[0], out32)


def test_context_restores_nests_and_counts():
    x = np.array([1e-9, 1.0, 1e5, 0.0, 3.0e-8], np.float32)
    with P.matmul_precision("bf16"):
        with P.matmul_precision("fp16") as s16:
            y = P.mm_round(x)
        assert rounding._STATE["name"] == "bf16"
    assert rounding._STATE["name"] == "fp32"
    assert y[0] == 0 and y[1] == 1 and math.isinf(y[2]) and y[4] != 0   # 1e-9 underflows, 1e5 overflows
    assert (s16.values, s16.nonzero, s16.flushed, s16.overflowed) == (5, 4, 1, 1)
    assert s16.flushed_fraction == 0.25
    with pytest.raises(RuntimeError):
        with P.matmul_precision("fp16"):
            raise RuntimeError("boom")
    assert rounding._STATE["name"] == "fp32"
    with pytest.raises(ValueError, match="unknown precision 'fp12'"):
        with P.matmul_precision("fp12"):
            pass
    # float64 inputs (gradcheck) keep their dtype, values rounded
    z = np.array([1.0 + 2.0 ** -12], np.float64)
    with P.matmul_precision("bf16"):
        assert P.mm_round(z).dtype == np.float64 and P.mm_round(z)[0] == 1.0


def test_format_rows():
    rows = {r["name"]: r for r in P.format_rows(0.1)}
    assert rows["fp32"]["hex"] == "0x3DCCCCCD" and rows["bf16"]["hex"] == "0x3DCD" and rows["fp16"]["hex"] == "0x2E66"
    assert rows["bf16"]["bits"] == "0 01111011 1001101"
    assert rows["bf16"]["stored"] == float(rb(0.1)) and rows["fp16"]["stored"] == float(rh(0.1))
    assert 1e-4 < rows["fp16"]["rel_err"] < 5e-4 and 5e-4 < rows["bf16"]["rel_err"] < 4e-3
    big = {r["name"]: r for r in P.format_rows(1e5)}
    assert big["fp16"]["rel_err"] == math.inf and big["bf16"]["rel_err"] < 4e-3
    assert "fp16" in P.format_table(0.1)


# ---- training: half precision tracks fp32, and the check can fail -------------------------------------------------

TINY = GPTConfig(vocab_size=256, block_size=16, n_layer=1, n_head=2, d_model=32)


@pytest.fixture(scope="module")
def runs():
    r = P.compare_precisions(TINY, steps=60, batch=8, precisions=("fp32", "bf16", "fp16", "fp8_e4m3"), seed=0)
    r["fp16 unscaled"] = P.compare_precisions(TINY, steps=60, batch=8, precisions=("fp16",), seed=0,
                                              loss_scale=False)["fp16"]
    return r


def test_half_precision_tracks_fp32(runs):
    ref = runs["fp32"]["loss"]
    assert len(ref) == 60 and ref[-1] < ref[0] - 0.8          # it trains: ~5.5 -> ~4.3
    for name in ("bf16", "fp16"):
        assert P.tracks(runs[name]["loss"], ref), (name, np.max(np.abs(np.subtract(runs[name]["loss"], ref))))
        assert runs[name]["loss"] != ref                      # not trivially equal: rounding happened
    assert runs["fp16"]["skipped"] == [] and set(runs["fp16"]["scale"]) == {2.0 ** 16}
    assert runs["fp16"]["flushed"] < 1e-5                     # scaled: (almost) no gradient underflows


def test_tracking_check_can_fail(runs):
    ref = runs["fp32"]["loss"]
    # fp8 e4m3 (3 mantissa bits, smallest value 2^-9) without per-tensor scaling: most small gradients vanish
    assert not P.tracks(runs["fp8_e4m3"]["loss"], ref)
    assert runs["fp8_e4m3"]["flushed"] > 0.2
    # fp16 without loss scaling: gradients underflow (at this tiny size not yet enough to change the loss much)
    assert runs["fp16 unscaled"]["flushed"] > 0.005 > runs["fp16"]["flushed"]
    assert not P.tracks(np.add(ref, 0.03 * np.asarray(ref)), ref)
    assert not P.tracks(ref[:-1], ref) and not P.tracks([math.nan] * 60, ref)


def test_too_large_scale_skips_and_backs_off():
    r = P.compare_precisions(TINY, steps=8, batch=8, precisions=("fp16",), seed=0, init_scale=2.0 ** 30)["fp16"]
    assert r["skipped"][:2] == [1, 2] and r["overflowed"] > 0
    s = r["scale"]
    assert s[0] == 2.0 ** 30 and all(b == a / 2 for a, b, k in zip(s, s[1:], range(1, 9)) if k in r["skipped"])


# ---- lesson 07's demo: gradients of GPT-2's size, where fp16 without the loss scale fails --------------------------
LESSON07 = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, d_model=32)   # lesson 07's simulator run
DLOSS = 2.0 ** -15


@pytest.fixture(scope="module")
def gpt2_sized():
    kw = dict(steps=60, batch=8, seed=0, dloss=DLOSS)
    r = P.compare_precisions(LESSON07, precisions=("fp32", "bf16", "fp16"), growth_interval=8, **kw)
    r["fp16 unscaled"] = P.compare_precisions(LESSON07, precisions=("fp16",), loss_scale=False, **kw)["fp16"]
    return r


def test_a_power_of_two_dloss_leaves_the_fp32_run_bit_for_bit(gpt2_sized):
    plain = P.compare_precisions(LESSON07, steps=60, batch=8, precisions=("fp32",), seed=0)["fp32"]
    assert gpt2_sized["fp32"]["loss"] == plain["loss"]


def test_at_gpt2_gradient_size_only_the_loss_scale_keeps_fp16_on_track(gpt2_sized):
    ref = gpt2_sized["fp32"]["loss"]
    assert P.tracks(gpt2_sized["bf16"]["loss"], ref) and P.tracks(gpt2_sized["fp16"]["loss"], ref)
    unscaled = gpt2_sized["fp16 unscaled"]
    assert not P.tracks(unscaled["loss"], ref)                       # visibly off: the lesson's point
    assert np.max(np.abs(np.subtract(unscaled["loss"], ref)) / np.asarray(ref)) > 0.05
    assert unscaled["flushed"] > 0.2 > 0.02 > gpt2_sized["fp16"]["flushed"]


def test_tf32_row_rounds_to_nearest_even_on_10_mantissa_bits():
    """The formats widget's TF32 row against an independent rounding: the significand scaled to 11 bits, np.rint."""
    rng = np.random.default_rng(5)
    x = (rng.standard_normal(2000) * np.exp2(rng.integers(-100, 100, 2000))).astype(np.float32)
    ties = (np.float32(1.0) + np.float32(2.0 ** -11) * np.array([1, 3, 5, 7], np.float32))   # exactly halfway
    for v in np.concatenate([x, ties, -ties]):
        m, e = np.frexp(np.float64(v))                       # v = m * 2**e, 0.5 <= |m| < 1
        want = np.ldexp(np.rint(m * 2.0 ** 11), int(e) - 11)
        row = P.tf32_row(float(v))
        assert row["stored"] == want, (v, row)
        assert int(row["hex"], 16) & 0x1FFF == 0             # the 13 low bits of the word are zero
    assert P.tf32_row(1.0 + 2.0 ** -11)["stored"] == 1.0              # a tie goes to the even neighbour
    assert P.tf32_row(1.0 + 3 * 2.0 ** -11)["stored"] == 1.0 + 2.0 ** -9
    assert P.tf32_row(float("inf"))["stored"] == float("inf") and math.isnan(P.tf32_row(float("nan"))["stored"])
