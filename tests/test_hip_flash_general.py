"""Flash attention in general, the HIP kernels (kernels/hip/flash.cu's FLASH_ENTRIES_V3_GENERAL: v3's code with the
general tests compiled in; backends/hip/flash.py's causal= and mask= with version="v3"): not causal, masked (rows that
see no key), rectangular causal (bottom-right aligned), not causal with more and with fewer keys than queries.

On a GPU: forward (out, lse) and backward (dq, dk, dv) against the NumPy reference (reference.sdpa_forward /
sdpa_backward in float64) on the same half-rounded inputs, fresh random ones each run (the seed is in every failure
message), with the comparison of tests/test_kernels_flash_general.py (NaN, -inf where the reference has it, the error
against each output's magnitude); past one block of 64 rows, T not a multiple of the key tile, T in the thousands,
every compiled head size, bf16 and fp16; outputs written into views of guarded buffers; the same bits on a second
backward; and the general kernels on causal, square, unmasked inputs (an all-True mask) against the reference there.
The same comparison is shown failing on plausible wrong answers (a top-left aligned causal, the mask transposed, rows
that see no key given NaN) in tests/test_kernels_flash_general.py; here, on the GPU, a launch with the mask transposed
must fail it. Without a GPU: the argument errors (they need no device).
"""

import numpy as np
import pytest
from test_hip_flash import TOL, _guarded, _guards_intact, _rounded
from test_kernels_flash_general import expected, fresh_seed, mismatch, random_mask

from gpullm_lessons import device
from gpullm_lessons.backends.hip import flash as hflash

needs_gpu = pytest.mark.skipif(not device.has_gpu(), reason=f"needs a GPU (this machine: {device.kind()})")


def make(seed, B, nh, Tq, Tk, hs, half, empty_rows=None, mask_dtype=bool):
    """(float64 values, uint16 bits) of q, k, v, dout rounded to `half`, and a (Tq, Tk) mask (None when empty_rows is
    None) whose given rows are all False."""
    rng = np.random.default_rng(seed)
    q, k, v, dout = (_rounded(rng, (B, nh, T, hs), half) for T in (Tq, Tk, Tk, Tq))
    return q, k, v, dout, random_mask(rng, Tq, Tk, empty_rows, mask_dtype)


def launch(bits, causal, mask, half, backward=True):
    """The launchers on the GPU (v3), outputs in guarded views starting as NaN: ([out, lse, dq, dk, dv] as NumPy,
    whether every guard zone is intact, the backward's dq, dk, dv of a second run)."""
    import cupy as cp

    qb, kb, vb, dob = (cp.asarray(x) for x in bits)
    B, nh, Tq, hs = qb.shape
    Tk = kb.shape[2]
    dm = None if mask is None else cp.asarray(mask)
    bufs, views = zip(*(_guarded(cp, s) for s in ((B, nh, Tq, hs), (B, nh, Tq), (B, nh, Tq, hs), (B, nh, Tk, hs),
                                                (B, nh, Tk, hs))))
    out, lse, dq, dk, dv = views
    hflash.flash_attention_forward(qb, kb, vb, out, lse, version="v3", half=half, causal=causal, mask=dm)
    if not backward:
        return [out.get(), lse.get()], all(_guards_intact(b) for b in bufs[:2]), None
    hflash.flash_attention_backward(qb, kb, vb, out, dob, lse, dq, dk, dv, version="v3", half=half, causal=causal,
                                    mask=dm)
    first = [x.get() for x in (dq, dk, dv)]
    for x in (dq, dk, dv):
        x.fill(np.nan)
    hflash.flash_attention_backward(qb, kb, vb, out, dob, lse, dq, dk, dv, version="v3", half=half, causal=causal,
                                    mask=dm)
    again = [x.get() for x in (dq, dk, dv)]
    return [out.get(), lse.get(), *first], all(_guards_intact(b) for b in bufs), again


# (B, nh, Tq, Tk, hs, causal, rows that see no key or None for no mask, mask dtype)
CASES = {
    "not causal, square": (1, 2, 19, 19, 64, False, None, bool),
    "not causal, past one block": (2, 2, 130, 130, 64, False, None, bool),
    "causal, more keys": (1, 2, 9, 37, 64, True, None, bool),
    "causal, more keys, tiles skipped": (1, 2, 100, 300, 32, True, None, bool),   # dK dV start past query 0
    "not causal, more keys": (2, 1, 70, 200, 48, False, None, bool),
    "not causal, fewer keys": (1, 2, 150, 40, 16, False, None, bool),
    "mask, not causal": (2, 1, 77, 131, 64, False, (3, 70, 76), bool),
    "mask, causal, more keys, uint8": (2, 2, 65, 129, 64, True, (0, 64), np.uint8),
    "causal, square, all-True mask": (1, 2, 200, 200, 64, True, (), bool),
    "long, mask, causal": (1, 2, 1000, 1500, 64, True, (5, 999), np.uint8),
    "long, not causal, fewer keys": (1, 2, 1024, 300, 64, False, None, bool),
}


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("half", ["bf16", "fp16"])
@pytest.mark.parametrize("name", list(CASES))
def test_general_kernels_match_the_reference(name, half):
    B, nh, Tq, Tk, hs, causal, empty, dtype = CASES[name]
    seed = fresh_seed()
    (q, qb), (k, kb), (v, vb), (do, dob), mask = make(seed, B, nh, Tq, Tk, hs, half, empty, dtype)
    if empty == ():
        mask = np.ones((Tq, Tk), dtype)
    got, guards, again = launch((qb, kb, vb, dob), causal, mask, half)
    assert guards, f"{name} (seed {seed}): an output's guard zone changed (a write outside it)"
    problem = mismatch(got, expected(q, k, v, do, causal, mask), tol=TOL[half])
    assert problem is None, f"{name}, {half} (seed {seed}): {problem}"
    for label, a, b in zip(("dq", "dk", "dv"), got[2:], again):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), f"{name}: {label} other bits on a second run"
    if empty:                                               # a row that sees no key: 0, -inf, no gradient
        rows = list(empty)
        assert (got[0][:, :, rows] == 0).all() and np.isneginf(got[1][:, :, rows]).all() and \
            (got[2][:, :, rows] == 0).all(), f"{name} (seed {seed})"


@needs_gpu
@pytest.mark.gpu
def test_a_transposed_mask_fails_the_comparison():
    seed = fresh_seed()
    (q, qb), (k, kb), (v, vb), (do, dob), mask = make(seed, 1, 2, 80, 80, 64, "bf16", (4,))
    right = expected(q, k, v, do, False, mask)
    got, _, _ = launch((qb, kb, vb, dob), False, np.ascontiguousarray(mask.T), "bf16", backward=False)
    assert mismatch(got, right[:2], tol=TOL["bf16"]) is not None, f"seed {seed}"


@needs_gpu
@pytest.mark.gpu
def test_the_causal_square_call_still_runs_the_causal_kernels():
    """Without a mask, causal over Tq == Tk runs the version asked for (v6's kernels), not the general ones; the two
    agree with the reference."""
    seed = fresh_seed()
    (q, qb), (k, kb), (v, vb), (do, dob), _ = make(seed, 1, 2, 130, 130, 64, "bf16")
    want = expected(q, k, v, do, True, None)
    import cupy as cp

    out, lse = cp.full((1, 2, 130, 64), np.nan, cp.float32), cp.full((1, 2, 130), np.nan, cp.float32)
    hflash.flash_attention_forward(*(cp.asarray(x) for x in (qb, kb, vb)), out, lse)
    assert mismatch([out.get(), lse.get()], want[:2], tol=TOL["bf16"]) is None, f"seed {seed}"


# ---- bad arguments: an error that names the argument (no GPU needed) -----------------------------------------------
def _np_args(Tq=5, Tk=7, hs=64):
    z = np.zeros
    return [z((1, 2, Tq, hs), np.uint16), z((1, 2, Tk, hs), np.uint16), z((1, 2, Tk, hs), np.uint16),
            z((1, 2, Tq, hs), np.float32), z((1, 2, Tq), np.float32)]


def test_general_calls_name_the_version_that_runs_them():
    a = _np_args()
    for kw in ({"causal": False}, {"mask": np.ones((5, 7), bool)}, {}):   # {}: Tq = 5 != Tk = 7
        with pytest.raises(ValueError, match="version v6 runs causal attention with as many keys as queries"):
            hflash.flash_attention_forward(*a, **kw)
        with pytest.raises(ValueError, match="pass version='v3'"):
            hflash.flash_attention_forward(*a, version="v4", **kw)
    q, k, v, out, lse = a
    with pytest.raises(ValueError, match="the general backward has no fused kernel"):
        hflash.flash_attention_backward(q, k, v, out, q, lse, out, k, v, version="v5", fused=True, causal=False)
    assert hflash.GENERAL == ("v3",)


def test_general_arguments_are_checked_before_the_gpu():
    q, k, v, out, lse = _np_args()
    with pytest.raises(TypeError, match="causal must be True or False, got 1"):   # whatever the version
        hflash.flash_attention_forward(q, k, v, out, lse, causal=1)
    with pytest.raises(TypeError, match="q must be a CuPy array"):
        hflash.flash_attention_forward(q, k, v, out, lse, version="v3", causal=False)
    with pytest.raises(ValueError, match="half='fp8' is not one of bf16, fp16"):
        hflash.flash_attention_forward(q, k, v, out, lse, version="v3", causal=False, half="fp8")


@needs_gpu
@pytest.mark.gpu
def test_general_arguments_are_named_on_the_gpu():
    import cupy as cp

    q, k, v, out, lse = (cp.asarray(x) for x in _np_args())
    cases = [
        ({"mask": cp.ones((5, 7), cp.float32)}, TypeError, "mask has dtype float32"),
        ({"mask": cp.ones((7, 5), cp.uint8)}, ValueError, r"mask has shape \(7, 5\), expected \(5, 7\)"),
        ({"causal": 1, "mask": cp.ones((5, 7), bool)}, TypeError, "causal must be True or False"),
    ]
    for kw, exc, words in cases:
        with pytest.raises(exc, match=words):
            hflash.flash_attention_forward(q, k, v, out, lse, version="v3", **kw)
    with pytest.raises(ValueError, match=r"Tk=5 < Tq=7"):                  # causal, fewer keys than queries
        hflash.flash_attention_forward(k, q, q, cp.zeros((1, 2, 7, 64), cp.float32), cp.zeros((1, 2, 7), cp.float32),
                                       version="v3")
    with pytest.raises(ValueError, match=r"dk has shape \(1, 2, 5, 64\)"):
        hflash.flash_attention_backward(q, k, v, out, q, lse, out, out, v.astype(cp.float32), version="v3",
                                        causal=False)
    bad = cp.zeros((1, 2, 7, 128), cp.uint16)
    with pytest.raises(ValueError, match="head size hs = 128 has no kernel"):
        hflash.flash_attention_forward(cp.zeros((1, 2, 5, 128), cp.uint16), bad, bad,
                                       cp.zeros((1, 2, 5, 128), cp.float32), lse, version="v3", causal=False)
