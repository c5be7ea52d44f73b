"""Flash attention v2, v3 and v4, the HIP kernels on the matrix units (kernels/hip/flash.cu, backends/hip/flash.py).

On a GPU: forward (out, lse) and backward (dq, dk, dv) against lesson 01's reference attention in float64 on the same
half-rounded q, k, v, dout, at T = 1, 7 (one partial tile), 65 (past one block of 64 rows), 130 and 192 (past v4's
block of 128 rows), 1000 (not a multiple of any tile), 1024, 4096, every compiled head size, bf16 and fp16, and
B * nh = 192 heads; each output is written into a view of a larger buffer whose guard zones must stay untouched; the
backward twice gives the same bits. The tolerance is shown to reject the plausible mistakes (no 1/sqrt(hs), the mask
off by one, dk and dv swapped) on the same inputs. Without a GPU: the argument errors (they need no device) and the
launcher's block shapes against flash.cu.
"""

import math
import re

import numpy as np
import pytest

from gpullm_lessons import device
from gpullm_lessons.backends.hip import flash as hflash
from gpullm_lessons.checks_flash import reference

needs_gpu = pytest.mark.skipif(not device.has_gpu(), reason=f"needs a GPU (this machine: {device.kind()})")
GUARD = 64  # elements of poison before and after each output


def _rounded(rng, shape, half):
    """(float64 values exactly representable in `half`, their 16-bit bits as uint16)."""
    import ml_dtypes

    dt = ml_dtypes.bfloat16 if half == "bf16" else np.float16
    h = (rng.standard_normal(shape) * rng.uniform(0.5, 1.5)).astype(dt)
    return h.astype(np.float64), h.view(np.uint16)


def oracle(q, k, v, dout, shift=0, scale=True):
    """(out, lse, dq, dk, dv) float64: out and the gradients from reference.attention_forward/backward (lesson 01);
    lse from the masked scores. shift / scale=False: the mistakes (mask s <= t + shift, no 1/sqrt(hs))."""
    if shift == 0 and scale:
        return reference(q, k, v, dout)
    T, hs = q.shape[2], q.shape[3]
    S = q @ k.swapaxes(-1, -2) / (math.sqrt(hs) if scale else 1.0)
    S = np.where(np.arange(T)[None, :] <= np.arange(T)[:, None] + shift, S, -np.inf)
    m = S.max(-1, keepdims=True)
    e = np.exp(S - m)
    lse = (m + np.log(e.sum(-1, keepdims=True)))[..., 0]
    P = e / e.sum(-1, keepdims=True)
    o = P @ v
    dS = P * (dout @ v.swapaxes(-1, -2) - (dout * o).sum(-1, keepdims=True))
    c = 1 / math.sqrt(hs) if scale else 1.0
    return o, lse, dS @ k * c, dS.swapaxes(-1, -2) @ q * c, P.swapaxes(-1, -2) @ dout


TOL = {"bf16": 2e-2, "fp16": 4e-3}  # max |error| / max |expected|: P and dS are rounded to the format for the products


def rel_err(got, want):
    """max |error| over max |expected|, the latter at least 0.1 (dq and dk at T = 1 are 0 up to rounding)."""
    return float(np.abs(got - want).max() / max(float(np.abs(want).max()), 0.1))


def _guarded(cp, shape):
    n = int(np.prod(shape))
    buf = cp.full(n + 2 * GUARD, np.nan, cp.float32)
    return buf, buf[GUARD : GUARD + n].reshape(shape)


def _guards_intact(buf):
    g = buf.get()
    return np.isnan(g[:GUARD]).all() and np.isnan(g[-GUARD:]).all()


def run(shape, half, seed, version=hflash.DEFAULT):
    import cupy as cp

    rng = np.random.default_rng(seed)
    B, nh, T, hs = shape
    (q, qb), (k, kb), (v, vb), (do, dob) = (_rounded(rng, shape, half) for _ in range(4))
    dq_, dk_, dv_, ddo = (cp.asarray(x) for x in (qb, kb, vb, dob))
    bufs, views = zip(*(_guarded(cp, s) for s in (shape, (B, nh, T), shape, shape, shape)))
    out, lse, dq, dk, dv = views
    hflash.flash_attention_forward(dq_, dk_, dv_, out, lse, half=half, version=version)
    hflash.flash_attention_backward(dq_, dk_, dv_, out, ddo, lse, dq, dk, dv, half=half, version=version)
    first = [x.get() for x in (dq, dk, dv)]
    for x in (dq, dk, dv):
        x.fill(np.nan)
    hflash.flash_attention_backward(dq_, dk_, dv_, out, ddo, lse, dq, dk, dv, half=half, version=version)
    again = [x.get() for x in (dq, dk, dv)]
    got = [out.get(), lse.get(), *first]
    return got, again, [_guards_intact(b) for b in bufs], (q, k, v, do)


SHAPES = [
    (1, 1, 1, 64),
    (1, 2, 7, 64),
    (2, 3, 65, 64),
    (1, 2, 1000, 64),
    (2, 2, 1024, 64),
    (1, 1, 4096, 64),
    (16, 12, 256, 64),
    (2, 2, 192, 64),
    (1, 2, 130, 16),
    (1, 2, 130, 32),
    (1, 2, 130, 48),
]


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("version", hflash.VERSIONS)
@pytest.mark.parametrize("half", ["bf16", "fp16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_flash_matches_the_reference(shape, half, version):
    seed = int(np.random.default_rng().integers(1 << 30))
    got, again, guards, inputs = run(shape, half, seed, version)
    want = oracle(*inputs)
    names = ("out", "lse", "dq", "dk", "dv")
    assert all(guards), f"an output's guard zone changed (a write outside it): {dict(zip(names, guards))}"
    for name, g, w in zip(names, got, want):
        assert np.isfinite(g).all(), f"{name}: non-finite elements (never written?), seed {seed}"
        err = rel_err(g, w)
        assert err < TOL[half], f"{name}: max error {err:.3g} of its magnitude (tolerance {TOL[half]}), seed {seed}"
    for name, a, b in zip(("dq", "dk", "dv"), got[2:], again):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), f"{name}: a second run gave other bits"
    # the tolerance rejects the plausible mistakes on these inputs (where they differ from the right answer at all)
    T = shape[2]
    if T > 1:
        for wrong, label in ((oracle(*inputs, shift=1), "mask off by one"), (oracle(*inputs, scale=False), "no scale")):
            for name, w, bad in zip(names, want, wrong):
                if name != "lse" or label == "no scale":
                    assert rel_err(bad, w) > 3 * TOL[half] or rel_err(bad, w) == 0, (label, name)
        assert rel_err(want[4], want[3]) > 3 * TOL[half]  # dk and dv swapped would fail


def test_flash_refuses_what_it_has_no_kernel_for():
    """Argument errors name the problem before anything touches a GPU (NumPy arrays are refused as not CuPy)."""
    q = np.zeros((1, 1, 4, 64), np.uint16)
    lse = np.zeros((1, 1, 4), np.float32)
    out = np.zeros((1, 1, 4, 64), np.float32)
    with pytest.raises(ValueError, match="half='fp8' is not one of bf16, fp16"):
        hflash.flash_attention_forward(q, q, q, out, lse, half="fp8")
    with pytest.raises(ValueError, match="version='v1' is not one of v2, v3, v4"):
        hflash.flash_attention_forward(q, q, q, out, lse, version="v1")
    with pytest.raises(TypeError, match="q must be a CuPy array"):
        hflash.flash_attention_forward(q, q, q, out, lse)
    assert hflash.supports(64, "bf16") and hflash.supports(16, "fp16")
    assert not hflash.supports(128, "bf16") and not hflash.supports(24, "bf16") and not hflash.supports(64, None)


def test_launch_geometry_matches_the_kernels():
    """The launcher's rows and warps per block are flash.cu's: v4's entry points declare their block size
    (__launch_bounds__), and a block of other rows would leave rows unwritten or written twice."""
    from gpullm_lessons import hip

    text = hip.source_path("flash").read_text()
    defs = {k: int(v) for k, v in re.findall(r"^#define (FLASH4?_\w+)\s+(\d+)", text, re.M)}
    old = (defs["FLASH_ROWS"], defs["FLASH_WARPS"])
    assert (hflash.ROWS, hflash.WARPS) == old
    assert hflash.GEOMETRY["v2"] == hflash.GEOMETRY["v3"] == {"forward": old, "dkdv": old, "dq": old}
    rows, warps, dkdv_warps = defs["FLASH4_ROWS"], defs["FLASH4_WARPS"], defs["FLASH4_DKDV_WARPS"]
    assert hflash.GEOMETRY["v4"] == {"forward": (rows, warps), "dkdv": (rows, dkdv_warps), "dq": (rows, warps)}
    assert set(hflash.GEOMETRY) == set(hflash.VERSIONS)
    assert min(r for g in hflash.GEOMETRY.values() for r, _ in g.values()) == hflash.ROWS  # _check's grid bound


@needs_gpu
@pytest.mark.gpu
def test_flash_names_a_head_size_without_a_kernel():
    import cupy as cp

    q = cp.zeros((1, 1, 4, 128), cp.uint16)
    with pytest.raises(ValueError, match=r"head size hs = 128 has no kernel"):
        hflash.flash_attention_forward(
            q, q, q, cp.zeros((1, 1, 4, 128), cp.float32), cp.zeros((1, 1, 4), cp.float32)
        )
    with pytest.raises(TypeError, match="q must be uint16"):
        f = cp.zeros((1, 1, 4, 64), cp.float32)
        hflash.flash_attention_forward(f, f, f, f, cp.zeros((1, 1, 4), cp.float32))
