"""Flash attention v2 to v6, the HIP kernels on the matrix units (kernels/hip/flash.cu, backends/hip/flash.py).

On a GPU: forward (out, lse) and backward (dq, dk, dv) against lesson 01's reference attention in float64 on the same
half-rounded q, k, v, dout, at T = 1, 7 (one partial tile), 65 (past one block of 64 rows), 130 and 192 (past v4's
block of 128 rows), 1000 (not a multiple of any tile), 1024, 4096, every compiled head size, bf16 and fp16, and
B * nh = 192 heads; each output is written into a view of a larger buffer whose guard zones must stay untouched; the
backward twice gives the same bits (v5's one-kernel backward has its key blocks add into dq in turns: a wrong order
shows as other bits on the second run). The tolerance is shown to reject the plausible mistakes (no 1/sqrt(hs), the mask
off by one, dk and dv swapped) on the same inputs. Without a GPU: the argument errors (they need no device) and the
launcher's block shapes against flash.cu.
"""

import math
import re

import numpy as np
import pytest

from gpullm_lessons import device
from gpullm_lessons.backends.hip import flash as hflash
from gpullm_lessons.checks.flash import reference

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


def run(shape, half, seed, version=hflash.DEFAULT, fused=False):
    import cupy as cp

    rng = np.random.default_rng(seed)
    B, nh, T, hs = shape
    (q, qb), (k, kb), (v, vb), (do, dob) = (_rounded(rng, shape, half) for _ in range(4))
    dq_, dk_, dv_, ddo = (cp.asarray(x) for x in (qb, kb, vb, dob))
    bufs, views = zip(*(_guarded(cp, s) for s in (shape, (B, nh, T), shape, shape, shape)))
    out, lse, dq, dk, dv = views
    hflash.flash_attention_forward(dq_, dk_, dv_, out, lse, half=half, version=version)
    hflash.flash_attention_backward(dq_, dk_, dv_, out, ddo, lse, dq, dk, dv, half=half, version=version, fused=fused)
    first = [x.get() for x in (dq, dk, dv)]
    for x in (dq, dk, dv):
        x.fill(np.nan)
    hflash.flash_attention_backward(dq_, dk_, dv_, out, ddo, lse, dq, dk, dv, half=half, version=version, fused=fused)
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
    _matches_the_reference(shape, half, version, False)


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("half", ["bf16", "fp16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fused_backward_matches_the_reference(shape, half):
    """v5's one-kernel backward: the key blocks' dQ sums in turns are the reference's, and the same bits twice (at
    T = 4096 the last query tiles' rows get the sums of 32 key blocks; at B * nh = 192, 192 heads take turns at once)."""
    _matches_the_reference(shape, half, "v5", True)


def _matches_the_reference(shape, half, version, fused):
    seed = int(np.random.default_rng().integers(1 << 30))
    got, again, guards, inputs = run(shape, half, seed, version, fused)
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
    with pytest.raises(ValueError, match="version='v1' is not one of v2, v3, v4, v5, v6"):
        hflash.flash_attention_forward(q, q, q, out, lse, version="v1")
    with pytest.raises(TypeError, match="q must be a CuPy array"):
        hflash.flash_attention_forward(q, q, q, out, lse)
    with pytest.raises(ValueError, match="fused=True is v5's one-kernel backward; version='v4' has none"):
        hflash.flash_attention_backward(q, q, q, out, q, lse, out, out, out, version="v4", fused=True)
    with pytest.raises(ValueError, match="fused=True is v5's one-kernel backward; version='v6' has none"):
        hflash.flash_attention_backward(q, q, q, out, q, lse, out, out, out, fused=True)  # the default is v6
    assert hflash.supports(64, "bf16") and hflash.supports(16, "fp16")
    assert not hflash.supports(128, "bf16") and not hflash.supports(24, "bf16") and not hflash.supports(64, None)


def test_launch_geometry_matches_the_kernels():
    """The launcher's rows and warps per block are flash.cu's: v4's entry points declare their block size
    (__launch_bounds__), and a block of other rows would leave rows unwritten or written twice."""
    from gpullm_lessons.runtime import hip

    text = hip.expanded_source("flash")  # flash.cu with flash_common.h (FLASH_ROWS, FLASH_WARPS, FLASH_PAD) inlined
    defs = {k: int(v) for k, v in re.findall(r"^#define (FLASH[45]?_\w+)\s+(\d+)", text, re.M)}
    old = (defs["FLASH_ROWS"], defs["FLASH_WARPS"])
    assert (hflash.ROWS, hflash.WARPS) == old
    assert hflash.GEOMETRY["v2"] == hflash.GEOMETRY["v3"] == {"forward": old, "dkdv": old, "dq": old}
    rows, warps, dkdv_warps = defs["FLASH4_ROWS"], defs["FLASH4_WARPS"], defs["FLASH4_DKDV_WARPS"]
    assert hflash.GEOMETRY["v4"] == {"forward": (rows, warps), "dkdv": (rows, dkdv_warps), "dq": (rows, warps)}
    assert hflash.GEOMETRY["v5"] == dict(hflash.GEOMETRY["v4"], fused=(rows, dkdv_warps))
    assert hflash.GEOMETRY["v6"] == hflash.GEOMETRY["v4"]
    assert hflash.V5_QUERY_TILE == defs["FLASH5_QT"]
    # v5's one-kernel backward's dynamic shared memory (two buffers of Q and dO tiles on NVIDIA)
    pad, qt = defs["FLASH_PAD"], defs["FLASH5_QT"]
    for hs in hflash.HEAD_SIZES:
        want = 2 * 2 * qt * (hs + pad) * 2 + rows * (hs + pad) * 2 + rows * (qt + pad) * 2 + 2 * 2 * qt * 4
        assert device.kind() == "rocm" or hflash._fused_smem(hs) == want, hs
    assert set(hflash.GEOMETRY) == set(hflash.VERSIONS)
    assert min(r for g in hflash.GEOMETRY.values() for r, _ in g.values()) == hflash.ROWS  # _check's grid bound


@needs_gpu
@pytest.mark.gpu
def test_flash_names_a_head_size_without_a_kernel():
    import cupy as cp

    q = cp.zeros((1, 1, 4, 128), cp.uint16)
    with pytest.raises(ValueError, match=r"head size hs = 128 has no kernel"):
        hflash.flash_attention_forward(q, q, q, cp.zeros((1, 1, 4, 128), cp.float32), cp.zeros((1, 1, 4), cp.float32))
    with pytest.raises(TypeError, match="q must be uint16"):
        f = cp.zeros((1, 1, 4, 64), cp.float32)
        hflash.flash_attention_forward(f, f, f, f, cp.zeros((1, 1, 4), cp.float32))


# ---- the packed layout: the engine's (B, T, 3C) qkv rows, y and dout (B, T, C) in the half format, dqkv float32 ----
def _pack(heads):
    """(B, nh, T, hs) -> (B, T, nh * hs): the heads side by side in each row."""
    B, nh, T, hs = heads.shape
    return heads.transpose(0, 2, 1, 3).reshape(B, T, nh * hs)


def _unpack(rows, nh):
    """(B, T, nh * hs) -> (B, nh, T, hs), C-contiguous."""
    B, T, C = rows.shape
    return np.ascontiguousarray(rows.reshape(B, T, nh, C // nh).transpose(0, 2, 1, 3))


def _half_bits(x, half):
    """float32 -> the bits of `half`, rounded to nearest even (as half.h)."""
    from gpullm_lessons.model.precision import f32_to_bf16_bits

    return f32_to_bf16_bits(x) if half == "bf16" else x.astype(np.float16).view(np.uint16)


def _half_values(bits, half):
    import ml_dtypes

    return bits.view(ml_dtypes.bfloat16 if half == "bf16" else np.float16).astype(np.float32)


def _guarded_like(cp, shape, dtype, fill):
    n = int(np.prod(shape))
    buf = cp.full(n + 2 * GUARD, fill, dtype)
    return buf, buf[GUARD : GUARD + n].reshape(shape)


def _guards_equal(buf, fill):
    g = buf.get()
    same = (lambda x: np.isnan(x)) if isinstance(fill, float) and np.isnan(fill) else (lambda x: x == fill)
    return bool(same(g[:GUARD]).all() and same(g[-GUARD:]).all())


PACKED_SHAPES = [
    (1, 1, 1, 64),
    (2, 3, 7, 64),
    (2, 3, 130, 64),
    (1, 2, 1000, 64),
    (4, 12, 256, 64),
    (1, 2, 130, 16),
    (1, 3, 65, 32),
    (2, 2, 192, 48),
]


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize(
    "version, fused", [("v4", False), ("v5", False), ("v5", True), ("v6", False)], ids=["v4", "v5", "v5-fused", "v6"]
)
@pytest.mark.parametrize("half", ["bf16", "fp16"])
@pytest.mark.parametrize("shape", PACKED_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_packed_layout_matches_the_heads_layout_bit_for_bit(shape, half, version, fused):
    """The packed launchers compute what the same version computes on the heads layout, to the bit: out is its float32
    out rounded to the half format, lse the same; dq, dk, dv are its dq, dk, dv from that rounded out. Every element of out and dqkv is
    written and nothing beside them; the backward gives the same bits twice; and the result is the reference's."""
    import cupy as cp

    seed = int(np.random.default_rng().integers(1 << 30))
    rng = np.random.default_rng(seed)
    B, nh, T, hs = shape
    C = nh * hs
    (q, qb), (k, kb), (v, vb), (do, dob) = (_rounded(rng, shape, half) for _ in range(4))
    qkv = cp.asarray(np.concatenate([_pack(qb), _pack(kb), _pack(vb)], axis=2))
    dout = cp.asarray(_pack(dob))
    obuf, out = _guarded_like(cp, (B, T, C), cp.uint16, 0xFFFF)
    lbuf, lse = _guarded(cp, (B, nh, T))
    hflash.flash_attention_forward_packed(qkv, out, lse, nh, half=half, version=version)
    gbuf, dqkv = _guarded(cp, (B, T, 3 * C))
    hflash.flash_attention_backward_packed(qkv, out, dout, lse, dqkv, nh, half=half, version=version, fused=fused)
    first = dqkv.get()
    dqkv.fill(np.nan)
    hflash.flash_attention_backward_packed(qkv, out, dout, lse, dqkv, nh, half=half, version=version, fused=fused)
    assert np.array_equal(first.view(np.uint32), dqkv.get().view(np.uint32)), "a second backward gave other bits"
    assert _guards_equal(obuf, 0xFFFF) and _guards_equal(lbuf, np.nan) and _guards_equal(gbuf, np.nan)
    assert np.isfinite(first).all(), f"dqkv: elements never written, seed {seed}"
    out_bits, lse_p = out.get(), lse.get()
    assert np.isfinite(_half_values(out_bits, half)).all(), f"out: elements never written, seed {seed}"
    # the heads layout, same inputs
    heads = [cp.asarray(x) for x in (qb, kb, vb, dob)]
    out_h, lse_h = cp.empty(shape, cp.float32), cp.empty((B, nh, T), cp.float32)
    hflash.flash_attention_forward(*heads[:3], out_h, lse_h, half=half, version=version)
    assert np.array_equal(lse_p.view(np.uint32), lse_h.get().view(np.uint32)), f"lse differs, seed {seed}"
    assert np.array_equal(_unpack(out_bits, nh), _half_bits(out_h.get(), half)), f"out differs, seed {seed}"
    y = cp.asarray(_unpack(_half_values(out_bits, half), nh))  # the rounded out the packed backward reads
    grads = [cp.empty(shape, cp.float32) for _ in range(3)]
    hflash.flash_attention_backward(*heads[:3], y, heads[3], lse_h, *grads, half=half, version=version, fused=fused)
    for i, (name, g) in enumerate(zip(("dq", "dk", "dv"), grads)):
        got = _unpack(first[:, :, i * C : (i + 1) * C], nh)
        assert np.array_equal(got.view(np.uint32), g.get().view(np.uint32)), f"{name} differs, seed {seed}"
    want = oracle(q, k, v, do)
    got = [_unpack(_half_values(out_bits, half), nh), lse_p]
    got += [_unpack(first[:, :, i * C : (i + 1) * C], nh) for i in range(3)]
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        err = rel_err(g, w)
        assert err < TOL[half], f"{name}: max error {err:.3g} of its magnitude (tolerance {TOL[half]}), seed {seed}"


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("half", ["bf16", "fp16"])
@pytest.mark.parametrize("shape", PACKED_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_packed_half_gradients_are_the_float32_ones_rounded(shape, half):
    """v6's backward with dqkv in the half format (the _hg entry points): every element is the float32 backward's,
    rounded to nearest even, bit for bit; nothing beside dqkv is written; a second call gives the same bits. The bit
    comparison is shown to reject a plausible mistake on the same inputs (dk and dv swapped; for bf16 also rounding
    toward zero, the upper 16 bits of the float32)."""
    import cupy as cp

    seed = int(np.random.default_rng().integers(1 << 30))
    rng = np.random.default_rng(seed)
    B, nh, T, hs = shape
    C = nh * hs
    (_, qb), (_, kb), (_, vb), (_, dob) = (_rounded(rng, shape, half) for _ in range(4))
    qkv = cp.asarray(np.concatenate([_pack(qb), _pack(kb), _pack(vb)], axis=2))
    dout = cp.asarray(_pack(dob))
    out, lse = cp.empty((B, T, C), cp.uint16), cp.empty((B, nh, T), cp.float32)
    hflash.flash_attention_forward_packed(qkv, out, lse, nh, half=half, version="v6")
    d32 = cp.empty((B, T, 3 * C), cp.float32)
    hflash.flash_attention_backward_packed(qkv, out, dout, lse, d32, nh, half=half, version="v6")
    want = _half_bits(d32.get(), half)
    hbuf, dh = _guarded_like(cp, (B, T, 3 * C), cp.uint16, 0xFFFF)
    hflash.flash_attention_backward_packed(qkv, out, dout, lse, dh, nh, half=half, version="v6")
    got = dh.get()
    assert _guards_equal(hbuf, 0xFFFF), f"written beside dqkv, seed {seed}"
    assert np.array_equal(got, want), f"{int((got != want).sum())} of {got.size} elements differ, seed {seed}"
    dh.fill(0xFFFF)
    hflash.flash_attention_backward_packed(qkv, out, dout, lse, dh, nh, half=half, version="v6")
    assert np.array_equal(dh.get(), got), f"a second backward gave other bits, seed {seed}"
    swapped = np.concatenate([want[:, :, :C], want[:, :, 2 * C :], want[:, :, C : 2 * C]], axis=2)
    assert not np.array_equal(swapped, got)
    if half == "bf16" and T > 1:
        truncated = (d32.get().view(np.uint32) >> 16).astype(np.uint16)
        assert not np.array_equal(truncated, got)


def test_packed_launchers_refuse_bad_arguments():
    """Argument errors name the problem before anything touches a GPU; the HIP backend (the engine's kernels) has
    both launchers."""
    from gpullm_lessons.backends import hip as hip_backend

    qkv = np.zeros((1, 4, 3 * 128), np.uint16)
    out = np.zeros((1, 4, 128), np.uint16)
    lse = np.zeros((1, 2, 4), np.float32)
    with pytest.raises(TypeError, match="qkv must be a CuPy array"):
        hip_backend.flash_attention_forward_packed(qkv, out, lse, 2)
    with pytest.raises(TypeError, match="qkv must be a CuPy array"):
        hip_backend.flash_attention_backward_packed(qkv, out, out, lse, np.zeros((1, 4, 384), np.float32), 2)
    ((label, kw),) = hip_backend.variants("flash_attention_backward")  # the kernel benchmark's extra row
    assert label == "v5-fused" and kw == {"version": "v5", "fused": True}
    with pytest.raises(TypeError, match="qkv must be a CuPy array"):
        hip_backend.flash_attention_backward_packed(qkv, out, out, lse, np.zeros((1, 4, 384), np.float32), 2, **kw)
    with pytest.raises(ValueError, match="version='v3' is not one of v4, v5, v6"):
        hip_backend.flash_attention_backward_packed(qkv, out, out, lse, out, 2, version="v3")
    for version in ("v4", "v5"):  # a half dqkv (uint16): only v6 writes one
        with pytest.raises(ValueError, match=r"dqkv in the half format \(uint16\) is written by version v6"):
            hip_backend.flash_attention_backward_packed(qkv, out, out, lse, out, 2, version=version)


@needs_gpu
@pytest.mark.gpu
def test_packed_launchers_name_shapes_they_cannot_run():
    import cupy as cp

    qkv, out, lse = cp.zeros((1, 4, 384), cp.uint16), cp.zeros((1, 4, 128), cp.uint16), cp.zeros((1, 2, 4), cp.float32)
    with pytest.raises(ValueError, match="half='fp8' is not one of bf16, fp16"):
        hflash.flash_attention_forward_packed(qkv, out, lse, 2, half="fp8")
    with pytest.raises(ValueError, match="nh must be a positive int"):
        hflash.flash_attention_forward_packed(qkv, out, lse, 0)
    with pytest.raises(ValueError, match=r"qkv must be \(B, T, 3C\)"):
        hflash.flash_attention_forward_packed(qkv, out, lse, 5)
    with pytest.raises(ValueError, match=r"lse"):
        hflash.flash_attention_forward_packed(qkv, out, cp.zeros((1, 4, 2), cp.float32), 2)
    with pytest.raises(ValueError, match=r"hs = C / nh = 128 has no kernel"):
        hflash.flash_attention_forward_packed(qkv, out, cp.zeros((1, 1, 4), cp.float32), 1)
    with pytest.raises(ValueError, match="16-byte boundary"):
        shifted = cp.zeros(4 * 384 + 2, cp.uint16)[2:].reshape(1, 4, 384)  # C-contiguous, 4 bytes past a boundary
        hflash.flash_attention_forward_packed(shifted, out, lse, 2)
