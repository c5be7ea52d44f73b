"""Attention in general, the NumPy reference (gpullm_lessons/reference/attention.py: sdpa_forward / sdpa_backward,
attention_mask, and attention_forward's causal= / mask=): causal or not, a (Tq, Tk) bool mask, Tq != Tk.

Against a direct computation written row by row here, with the rule of which keys a query sees spelled out in loops
(bottom-right aligned causal: query i sees key j <= i + Tk - Tq): a square and a rectangular causal case, non-causal
with more keys and with fewer keys than queries, masks with rows that see no key (out 0, lse -inf, no gradient, no
NaN, no warning); finite differences of the backward; the default (causal, no mask, square) gives attention_forward's
bits; the argument errors; checks.flash.reference's general path.
"""

import math
import warnings

import numpy as np
import pytest

from gpullm_lessons.checks import flash as checks_flash
from gpullm_lessons.checks.gradcheck import gradcheck
from gpullm_lessons.reference import attention_backward, attention_forward, attention_mask, sdpa_backward, sdpa_forward
from gpullm_lessons.reference.attention import _merge_heads, _split_heads


def sees(Tq, Tk, causal, mask):
    """(Tq, Tk) bool, one element at a time: query i sees key j."""
    a = np.zeros((Tq, Tk), bool)
    for i in range(Tq):
        for j in range(Tk):
            a[i, j] = (not causal or j <= i + (Tk - Tq)) and (mask is None or bool(mask[i, j]))
    return a


def direct(q, k, v, dout, allowed):
    """(out, lse, dq, dk, dv) in float64, one query row at a time over the keys it sees (none: 0, -inf, 0)."""
    q, k, v, dout = (np.asarray(x, np.float64) for x in (q, k, v, dout))
    B, nh, Tq, hs = q.shape
    scale = 1.0 / math.sqrt(hs)
    out, dq = np.zeros_like(q), np.zeros_like(q)
    dk, dv = np.zeros_like(k), np.zeros_like(v)
    lse = np.full((B, nh, Tq), -np.inf)
    for b in range(B):
        for h in range(nh):
            for i in range(Tq):
                idx = np.flatnonzero(allowed[i])
                if idx.size == 0:
                    continue
                s = k[b, h, idx] @ q[b, h, i] * scale                     # the scores of the keys row i sees
                lse[b, h, i] = s.max() + math.log(np.exp(s - s.max()).sum())
                p = np.exp(s - lse[b, h, i])
                out[b, h, i] = p @ v[b, h, idx]
                dp = v[b, h, idx] @ dout[b, h, i]
                ds = p * (dp - p @ dp)
                dq[b, h, i] = ds @ k[b, h, idx] * scale
                dk[b, h, idx] += ds[:, None] * q[b, h, i] * scale
                dv[b, h, idx] += p[:, None] * dout[b, h, i]
    return out, lse, dq, dk, dv


def random_mask(rng, Tq, Tk, empty_rows=()):
    m = rng.random((Tq, Tk)) < 0.6
    m[list(empty_rows)] = False
    return m


def inputs(rng, B, nh, Tq, Tk, hs, dtype=np.float64):
    q = rng.standard_normal((B, nh, Tq, hs)).astype(dtype)
    k, v = (rng.standard_normal((B, nh, Tk, hs)).astype(dtype) for _ in range(2))
    dout = rng.standard_normal((B, nh, Tq, hs)).astype(dtype)
    return q, k, v, dout


# (B, nh, Tq, Tk, hs, causal, mask rows with no key or None for no mask)
CASES = {
    "square causal": (2, 2, 9, 9, 8, True, None),
    "rectangular causal": (1, 2, 5, 13, 8, True, None),
    "square not causal": (1, 2, 9, 9, 16, False, None),
    "more keys, not causal": (2, 1, 6, 11, 8, False, None),
    "fewer keys, not causal": (2, 1, 11, 4, 8, False, None),
    "mask with empty rows": (2, 2, 10, 14, 8, False, (0, 7)),
    "mask and causal, rectangular": (1, 2, 7, 12, 16, True, (3,)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_sdpa_matches_the_direct_computation(name):
    B, nh, Tq, Tk, hs, causal, empty = CASES[name]
    rng = np.random.default_rng(sum(map(ord, name)))   # a seed per case, the same every run
    q, k, v, dout = inputs(rng, B, nh, Tq, Tk, hs)
    mask = None if empty is None else random_mask(rng, Tq, Tk, empty)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                  # no 0/0, no -inf - -inf on the way
        out, cache = sdpa_forward(q, k, v, causal=causal, mask=mask)
        grads = sdpa_backward(dout, cache)
    want = direct(q, k, v, dout, sees(Tq, Tk, causal, mask))
    got = (out, cache["lse"], *grads)
    for what, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert g.shape == w.shape, (what, g.shape, w.shape)
        assert not np.isnan(g).any(), what
        np.testing.assert_array_equal(np.isneginf(g), np.isneginf(w), err_msg=what)
        fin = np.isfinite(w)
        np.testing.assert_allclose(g[fin], w[fin], rtol=1e-10, atol=1e-12, err_msg=what)
    if empty:
        assert (out[:, :, list(empty)] == 0).all() and np.isneginf(cache["lse"][:, :, list(empty)]).all()
        assert (grads[0][:, :, list(empty)] == 0).all()


def test_causal_is_bottom_right_aligned():
    assert attention_mask(2, 4).tolist() == [[True, True, True, False], [True, True, True, True]]
    np.testing.assert_array_equal(attention_mask(5, 5), np.tril(np.ones((5, 5), bool)))     # square: s <= t
    top_left = np.tril(np.ones((2, 4), bool))          # PyTorch SDPA's is_causal on a rectangle: s <= t
    assert not np.array_equal(attention_mask(2, 4), top_left)
    np.testing.assert_array_equal(attention_mask(3, 7), sees(3, 7, True, None))
    assert attention_mask(3, 4, causal=False).all()
    m = np.random.default_rng(0).random((3, 7)) < 0.5
    np.testing.assert_array_equal(attention_mask(3, 7, mask=m), sees(3, 7, True, m))


def test_the_last_queries_of_a_longer_sequence_see_what_they_saw_there():
    """Bottom-right alignment is what a KV cache needs: the last Tq rows of square causal attention over Tk positions
    are causal attention of those Tq queries over all Tk keys."""
    rng = np.random.default_rng(1)
    q, k, v, _ = inputs(rng, 1, 2, 12, 12, 8)
    full, c_full = sdpa_forward(q, k, v)
    tail, c_tail = sdpa_forward(q[:, :, -5:], k, v)
    np.testing.assert_allclose(tail, full[:, :, -5:], rtol=1e-13)
    np.testing.assert_allclose(c_tail["lse"], c_full["lse"][:, :, -5:], rtol=1e-13)


def test_square_causal_default_gives_attention_forwards_bits():
    rng = np.random.default_rng(2)
    B, T, C, nh = 2, 11, 24, 3
    for dtype in (np.float32, np.float64):
        qkv = rng.standard_normal((B, T, 3 * C)).astype(dtype)
        dout = rng.standard_normal((B, T, C)).astype(dtype)
        out, cache = attention_forward(qkv, nh)
        dqkv = attention_backward(dout, cache)
        q, k, v = (_split_heads(x, nh) for x in np.split(qkv, 3, axis=-1))
        y, c = sdpa_forward(q, k, v)
        grads = sdpa_backward(_split_heads(dout, nh), c)
        assert y.dtype == dtype and _merge_heads(y).tobytes() == out.tobytes()
        assert c["att"].tobytes() == cache["att"].tobytes()
        assert np.concatenate([_merge_heads(g) for g in grads], -1).tobytes() == dqkv.tobytes()
        # attention_forward's own causal= / mask= are sdpa's on the heads
        m = rng.random((T, T)) < 0.5
        m[4] = False
        out2, cache2 = attention_forward(qkv, nh, causal=False, mask=m)
        y2, c2 = sdpa_forward(q, k, v, causal=False, mask=m)
        assert _merge_heads(y2).tobytes() == out2.tobytes()
        g2 = sdpa_backward(_split_heads(dout, nh), c2)
        assert np.concatenate([_merge_heads(g) for g in g2], -1).tobytes() == attention_backward(dout, cache2).tobytes()


def test_backward_matches_finite_differences_with_an_empty_row():
    rng = np.random.default_rng(3)
    q, k, v, _ = inputs(rng, 1, 2, 4, 7, 4)
    mask = random_mask(rng, 4, 7, empty_rows=(1,))
    r = gradcheck(sdpa_forward, sdpa_backward, {"q": q, "k": k, "v": v, "causal": True, "mask": mask})
    assert r.passed, r.report()


def test_checks_flash_reference_takes_the_general_arguments():
    rng = np.random.default_rng(4)
    q, k, v, dout = inputs(rng, 1, 2, 6, 10, 8, np.float32)
    mask = random_mask(rng, 6, 10, empty_rows=(2,))
    got = checks_flash.reference(q, k, v, dout, causal=True, mask=mask)
    want = direct(q, k, v, dout, sees(6, 10, True, mask))
    for g, w in zip(got, want):
        fin = np.isfinite(w)
        np.testing.assert_array_equal(np.isneginf(g), np.isneginf(w))
        np.testing.assert_allclose(g[fin], w[fin], rtol=1e-10, atol=1e-12)
    q, k, v, dout = inputs(rng, 1, 2, 6, 6, 8, np.float32)      # the default: lesson 01's path, as before
    for g, w in zip(checks_flash.reference(q, k, v, dout), direct(q, k, v, dout, sees(6, 6, True, None))):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)


def _qkv(Tq=5, Tk=7, hs=8, kshape=None, vshape=None, dtype=np.float64):
    z = np.zeros
    return z((1, 2, Tq, hs), dtype), z(kshape or (1, 2, Tk, hs), dtype), z(vshape or kshape or (1, 2, Tk, hs), dtype)


@pytest.mark.parametrize("call, exc, match", [
    (lambda: sdpa_forward(*_qkv(), mask=np.ones((5, 7), np.uint8)), TypeError, r"mask must be a bool array.*uint8"),
    (lambda: sdpa_forward(*_qkv(), mask=np.ones((5, 7))), TypeError, r"mask must be a bool array.*float64"),
    (lambda: sdpa_forward(*_qkv(), mask=np.ones((7, 5), bool)), ValueError,
     r"mask has shape \(7, 5\), expected \(Tq, Tk\) = \(5, 7\)"),
    (lambda: sdpa_forward(*_qkv(), mask=np.ones((2, 5, 7), bool)), ValueError, r"mask has shape \(2, 5, 7\)"),
    (lambda: sdpa_forward(*_qkv(), mask=[[True] * 7] * 5), TypeError, r"mask must be a NumPy bool array"),
    (lambda: sdpa_forward(*_qkv(Tq=5, Tk=3)), ValueError, r"causal with fewer keys than queries \(Tk=3 < Tq=5\)"),
    (lambda: sdpa_forward(*_qkv(), causal=1), TypeError, r"causal must be True or False, got 1"),
    (lambda: sdpa_forward(*_qkv(kshape=(1, 2, 7, 4))), ValueError, r"k has shape \(1, 2, 7, 4\).*hs=8"),
    (lambda: sdpa_forward(*_qkv(kshape=(2, 2, 7, 8))), ValueError, r"k has shape \(2, 2, 7, 8\).*B=1"),
    (lambda: sdpa_forward(*_qkv(vshape=(1, 2, 6, 8))), ValueError, r"v has shape \(1, 2, 6, 8\) but k is"),
    (lambda: sdpa_forward(np.zeros((2, 5, 8)), *_qkv()[1:]), ValueError, r"q must be 4-D"),
    (lambda: sdpa_forward(*_qkv(kshape=(1, 2, 0, 8)), causal=False), ValueError, r"at least one key"),
    (lambda: sdpa_forward(_qkv()[0].astype(np.float32), *_qkv()[1:]), TypeError, r"one dtype"),
    (lambda: sdpa_forward(np.zeros((1, 2, 5, 8), int), *_qkv()[1:]), TypeError, r"q must be a floating-point"),
    (lambda: sdpa_backward(np.zeros((1, 2, 7, 8)), sdpa_forward(*_qkv())[1]), ValueError,
     r"sdpa_backward: dout is \(1, 2, 7, 8\) but out was \(1, 2, 5, 8\)"),
    (lambda: attention_forward(np.zeros((1, 4, 24)), 2, mask=np.ones((4, 5), bool)), ValueError,
     r"attention_forward: mask has shape \(4, 5\)"),
])
def test_bad_arguments_are_named(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_fewer_keys_than_queries_needs_no_causal_or_a_mask():
    q, k, v = _qkv(Tq=5, Tk=3)
    out, cache = sdpa_forward(q, k, v, causal=False)           # cross-attention to a shorter sequence: allowed
    assert out.shape == (1, 2, 5, 8) and np.isfinite(cache["lse"]).all()
    out, cache = sdpa_forward(q, k, v, causal=False, mask=sees(5, 3, True, None) | np.eye(5, 3, dtype=bool))
    assert out.shape == (1, 2, 5, 8)
