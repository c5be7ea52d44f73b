"""Flash attention in general, the Numba kernels (kernels/numba/flash.py: the launchers' causal= and mask=, Tq != Tk;
the kernels v1_general, v1_general_dkdv, v1_general_dq): forward (out, lse) and backward (dq, dk, dv) against the
NumPy reference (reference.sdpa_forward / sdpa_backward, float64) on fresh random inputs (the seed is in every failure
message): not causal, masked (random masks with rows that see no key, as bool and as uint8), rectangular causal
(bottom-right aligned) and not causal with more and with fewer keys than queries, T not a multiple of the key tile
(16) or of the block of rows, and more rows than one block. On causal, square, unmasked inputs the general kernels
give lesson 11's bits. The comparison itself is checked: planted wrong answers (top-left aligned causal, the mask
transposed, NaN or lse 0 or the mean of v where a row sees no key, a kernel launched with the mask transposed) must
fail it. And the launchers' argument errors. Simulator: tiny shapes (T <= 40, hs 8 / 16, B * nh <= 4); a GPU adds
T in the thousands.
"""

import numpy as np
import pytest

from gpullm_lessons import device
from gpullm_lessons.kernels.numba import flash
from gpullm_lessons.reference import attention_mask, sdpa_backward, sdpa_forward
from gpullm_lessons.runtime.arrays import to_backend, to_numpy

GPU = device.numba_on_gpu()
needs_numba_gpu = pytest.mark.skipif(not GPU, reason=f"needs Numba on an NVIDIA GPU (this machine: {device.kind()})")
ARRAYS = "numba"
NAMES = ("out", "lse", "dq", "dk", "dv")
TOL = 2e-5  # of each output's magnitude, as tests/test_kernels_flash.py


def fresh_seed():
    return int(np.random.SeedSequence().entropy % 2**32)


def make(seed, B, nh, Tq, Tk, hs, empty_rows=None, mask_dtype=bool):
    """q, k, v, dout float32 and a (Tq, Tk) mask (None when empty_rows is None) with the given rows all False."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, nh, Tq, hs)).astype(np.float32)
    k, v = (rng.standard_normal((B, nh, Tk, hs)).astype(np.float32) for _ in range(2))
    dout = rng.standard_normal((B, nh, Tq, hs)).astype(np.float32)
    return q, k, v, dout, random_mask(rng, Tq, Tk, empty_rows, mask_dtype)


def random_mask(rng, Tq, Tk, empty_rows, mask_dtype=bool):
    """A (Tq, Tk) mask, 60% of it True, the given rows all False; None when empty_rows is None."""
    if empty_rows is None:
        return None
    mask = rng.random((Tq, Tk)) < 0.6
    mask[list(empty_rows)] = False
    return mask.astype(mask_dtype)


def expected(q, k, v, dout, causal, mask, reference_mask=None):
    """(out, lse, dq, dk, dv) float64 from the reference; reference_mask: a (wrong) mask to give it instead."""
    m = mask if reference_mask is None else reference_mask
    out, cache = sdpa_forward(*(x.astype(np.float64) for x in (q, k, v)), causal=causal,
                              mask=None if m is None else np.asarray(m).astype(bool))
    return (out, cache["lse"], *sdpa_backward(dout.astype(np.float64), cache))


def launch(q, k, v, dout, causal, mask, threads, forward_only=False):
    """The launchers on device arrays (outputs start as NaN): [out, lse] or [out, lse, dq, dk, dv] as NumPy."""
    d = [to_backend(x, ARRAYS) for x in (q, k, v, dout)]
    dm = None if mask is None else to_backend(mask, ARRAYS)
    out = to_backend(np.full(q.shape, np.nan, np.float32), ARRAYS)
    lse = to_backend(np.full(q.shape[:3], np.nan, np.float32), ARRAYS)
    flash.flash_attention_forward(d[0], d[1], d[2], out, lse, threads=threads, causal=causal, mask=dm)
    if forward_only:
        return [to_numpy(out), to_numpy(lse)]
    g = [to_backend(np.full(x.shape, np.nan, np.float32), ARRAYS) for x in (q, k, v)]
    flash.flash_attention_backward(d[0], d[1], d[2], out, d[3], lse, *g, threads=threads, causal=causal, mask=dm)
    return [to_numpy(x) for x in (out, lse, *g)]


def mismatch(got, want, tol=TOL):
    """None when every output matches: no NaN anywhere, lse -inf exactly where the reference has it (the rows that see
    no key), elsewhere within tol of the output's magnitude; else what differs."""
    for name, g, w in zip(NAMES, got, want):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        if g.shape != w.shape:
            return f"{name}: shape {g.shape}, expected {w.shape}"
        if np.isnan(g).any():
            return f"{name}: {int(np.isnan(g).sum())} NaN (never written, or 0/0 in a row that sees no key?)"
        ninf = np.isneginf(w)
        if not np.array_equal(np.isneginf(g), ninf):
            return f"{name}: -inf at {np.argwhere(np.isneginf(g) != ninf)[:3].tolist()}... not where expected"
        if not np.isfinite(g[~ninf]).all():
            return f"{name}: non-finite values"
        scale = np.abs(w[~ninf]).max(initial=0.0) + 1e-30
        err = np.abs(g[~ninf] - w[~ninf]).max(initial=0.0) / scale
        if err > tol:
            return f"{name}: max error {err:.2g} of its magnitude (tol {tol:g})"
    return None


# (B, nh, Tq, Tk, hs, causal, rows that see no key or None for no mask, mask dtype, threads per block)
CASES = {
    "not causal, square": (1, 2, 19, 19, 8, False, None, bool, 8),
    "causal, more keys": (1, 2, 9, 37, 8, True, None, bool, 8),
    "causal, more keys, tiles skipped": (1, 1, 33, 40, 8, True, None, bool, 8),   # dK, dV skip query tile 0
    "not causal, more keys": (2, 1, 11, 29, 16, False, None, bool, 8),
    "not causal, fewer keys": (1, 1, 23, 7, 16, False, None, bool, 8),
    "mask, not causal": (2, 1, 13, 21, 8, False, (3, 7), bool, 8),
    "mask, causal, more keys, uint8": (2, 2, 13, 21, 8, True, (0, 12), np.uint8, 5),
}


@pytest.mark.parametrize("name", list(CASES))
def test_general_kernels_match_the_reference(name):
    B, nh, Tq, Tk, hs, causal, empty, dtype, threads = CASES[name]
    seed = fresh_seed()
    q, k, v, dout, mask = make(seed, B, nh, Tq, Tk, hs, empty, dtype)
    got = launch(q, k, v, dout, causal, mask, threads)
    want = expected(q, k, v, dout, causal, mask)
    problem = mismatch(got, want)
    assert problem is None, f"{name} (seed {seed}): {problem}"
    if empty:                                            # a row that sees no key: 0, -inf, no gradient
        rows = list(empty)
        assert (got[0][:, :, rows] == 0).all() and np.isneginf(got[1][:, :, rows]).all() and \
            (got[2][:, :, rows] == 0).all(), f"{name} (seed {seed})"


def test_general_backward_gives_the_same_bits_twice():
    seed = fresh_seed()
    q, k, v, dout, mask = make(seed, 1, 2, 17, 26, 8, (5,))
    results = [[x.tobytes() for x in launch(q, k, v, dout, True, mask, threads=8)] for _ in range(2)]
    assert results[0] == results[1], f"seed {seed}"


def test_general_kernels_give_lesson_11s_bits_on_its_inputs():
    """Causal, square: the launcher runs v1's kernels without a mask; with an all-True mask the general ones, which
    must give the same bits (the same sums in the same order)."""
    seed = fresh_seed()
    q, k, v, dout, _ = make(seed, 1, 2, 21, 21, 8)
    v1 = launch(q, k, v, dout, True, None, threads=8)
    general = launch(q, k, v, dout, True, np.ones((21, 21), bool), threads=8)
    assert [x.tobytes() for x in v1] == [x.tobytes() for x in general], f"seed {seed}"
    assert mismatch(v1, expected(q, k, v, dout, True, None)) is None, f"seed {seed}"


# ---- the comparison catches plausible wrong answers -----------------------------------------------------------------
def test_the_comparison_catches_a_top_left_aligned_causal():
    seed = fresh_seed()
    q, k, v, dout, _ = make(seed, 1, 2, 9, 37, 8)
    right = expected(q, k, v, dout, True, None)
    top_left = np.tril(np.ones((9, 37), bool))          # PyTorch SDPA's is_causal on a rectangle: s <= t
    assert not np.array_equal(top_left, attention_mask(9, 37))
    wrong = expected(q, k, v, dout, False, None, reference_mask=top_left)
    problem = mismatch(wrong, right)
    assert problem is not None and problem.startswith("out"), f"seed {seed}: {problem}"


def test_the_comparison_catches_a_transposed_mask_from_the_kernel_too():
    seed = fresh_seed()
    q, k, v, dout, mask = make(seed, 1, 1, 16, 16, 8, (4,))
    right = expected(q, k, v, dout, False, mask)
    assert mismatch(expected(q, k, v, dout, False, mask, reference_mask=mask.T), right) is not None, f"seed {seed}"
    wrong = launch(q, k, v, dout, False, np.ascontiguousarray(mask.T), threads=8, forward_only=True)
    assert mismatch(wrong, right[:2]) is not None, f"seed {seed}"           # a launcher that passes mask.T


def _nan_rows(got, rows, v):                          # 0 / 0: out = acc / l and lse = m + log(l) with l = 0
    got[0][:, :, rows] = np.nan
    got[1][:, :, rows] = np.nan


def _lse_zero(got, rows, v):                         # lse = log(1): a row with no key treated as one of weight 1
    got[1][:, :, rows] = 0.0


def _mean_of_v(got, rows, v):                        # every key weighted alike: a -inf row made uniform
    got[0][:, :, rows] = v.mean(axis=2, keepdims=True)


@pytest.mark.parametrize("plant, words", [(_nan_rows, "NaN"), (_lse_zero, "lse: -inf"), (_mean_of_v, "out: max")])
def test_the_comparison_catches_wrong_rows_that_see_no_key(plant, words):
    seed = fresh_seed()
    q, k, v, dout, mask = make(seed, 1, 2, 12, 15, 8, (2, 9))
    right = expected(q, k, v, dout, False, mask)
    got = [x.copy() for x in right]
    assert mismatch(got, right) is None
    plant(got, [2, 9], v)
    problem = mismatch(got, right)
    assert problem is not None and words in problem, f"seed {seed}: {problem}"


# ---- bad arguments: an error that names the argument ----------------------------------------------------------------
def _args(Tq=5, Tk=7, hs=8):
    z = np.zeros
    return [z((1, 2, Tq, hs), np.float32), z((1, 2, Tk, hs), np.float32), z((1, 2, Tk, hs), np.float32),
            z((1, 2, Tq, hs), np.float32), z((1, 2, Tq), np.float32)]


@pytest.mark.parametrize("change, kw, exc, words", [
    (None, {"mask": np.ones((5, 7), np.float32)}, TypeError, ["mask has dtype float32", "uint8"]),
    (None, {"mask": np.ones((7, 5), np.uint8)}, ValueError, ["mask has shape (7, 5), expected (5, 7)"]),
    (None, {"mask": np.ones((5, 14), bool)[:, ::2]}, ValueError, ["mask must be C-contiguous"]),
    (None, {"mask": [[1] * 7] * 5}, TypeError, ["mask must be a (Tq, Tk) = (5, 7) uint8 or bool array"]),
    (None, {"causal": 1}, TypeError, ["causal must be True or False"]),
    (lambda a: (a.__setitem__(1, np.zeros((1, 2, 3, 8), np.float32)), a.__setitem__(2, np.zeros((1, 2, 3, 8),
     np.float32))), {}, ValueError, ["Tk=3 < Tq=5", "causal=False"]),
    (lambda a: a.__setitem__(2, np.zeros((1, 2, 6, 8), np.float32)), {}, ValueError, ["v has shape (1, 2, 6, 8)"]),
    (lambda a: a.__setitem__(1, np.zeros((1, 2, 7, 4), np.float32)), {}, ValueError,
     ["k has shape (1, 2, 7, 4)", "hs=8"]),
    (lambda a: a.__setitem__(4, np.zeros((1, 2, 7), np.float32)), {}, ValueError, ["lse has shape (1, 2, 7)"]),
    (lambda a: a.__setitem__(3, np.zeros((1, 2, 7, 8), np.float32)), {}, ValueError, ["out has shape (1, 2, 7, 8)"]),
])
def test_forward_bad_general_arguments_are_named(change, kw, exc, words):
    a = _args()
    if change:
        change(a)
    with pytest.raises(exc) as e:
        flash.flash_attention_forward(*a, **kw)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_backward_bad_general_arguments_are_named():
    q, k, v, out, lse = _args()
    with pytest.raises(ValueError, match=r"dk has shape \(1, 2, 5, 8\)"):
        flash.flash_attention_backward(q, k, v, out, out.copy(), lse, q.copy(), q.copy(), v.copy())
    with pytest.raises(ValueError, match=r"dq has shape \(1, 2, 7, 8\)"):
        flash.flash_attention_backward(q, k, v, out, out.copy(), lse, k.copy(), k.copy(), v.copy())
    with pytest.raises(ValueError, match=r"mask has shape \(7, 5\)"):
        flash.flash_attention_backward(q, k, v, out, out.copy(), lse, q.copy(), k.copy(), v.copy(),
                                       mask=np.ones((7, 5), bool))


# ---- GPU: longer rows -----------------------------------------------------------------------------------------------
@needs_numba_gpu
@pytest.mark.parametrize("B, nh, Tq, Tk, hs, causal, empty", [
    (1, 2, 1000, 1500, 64, True, None), (2, 2, 777, 1024, 64, False, (0, 5, 776)), (1, 4, 1024, 300, 128, False, None),
    (1, 2, 513, 2048, 64, True, (100,)),
])
def test_gpu_sizes_match_the_reference(B, nh, Tq, Tk, hs, causal, empty):
    seed = fresh_seed()
    q, k, v, dout, mask = make(seed, B, nh, Tq, Tk, hs, empty, np.uint8)
    problem = mismatch(launch(q, k, v, dout, causal, mask, threads=64), expected(q, k, v, dout, causal, mask), 1e-4)
    assert problem is None, f"seed {seed}: {problem}"
