"""Causal attention backward: Numba v1 in the simulator (and on a GPU), HIP v1 and cuBLAS path on a GPU."""
import numpy as np
import pytest

from gpullm_lessons.checks import backward as checks
from gpullm_lessons import device
from gpullm_lessons.kernels.numba import attention as nb_attention


def test_numba_v1_passes_the_checker():
    r = checks.check_attention_backward(nb_attention.attention_backward, arrays="numba", quiet=True)
    assert r.status == "correct", r.message


def test_a_grid_one_block_short_is_caught():
    """The dq/dk/dv kernel launched one block short leaves the tail of dqkv unwritten (still poisoned)."""
    from numba import cuda

    def short(dout, qkv, att, dqkv, n_head):
        B, T, C3 = qkv.shape
        nh, C = n_head, C3 // 3
        datt = cuda.device_array((B, nh, T, T), np.float32)
        dpre = cuda.device_array((B, nh, T, T), np.float32)
        nb_attention.attention_datt_v1[(B * nh, T), 32](dout, qkv, datt, nh)
        nb_attention.attention_dpre_v1[(B * nh * T + 31) // 32, 32](att, datt, dpre, np.float32((C // nh) ** -0.5))
        n = B * T * C3
        nb_attention.attention_dqkv_v1[max((n + 63) // 64 - 1, 1), 64](dout, qkv, att, dpre, dqkv, nh)

    r = checks.check_attention_backward(short, arrays="numba", quiet=True)
    assert r.status == "wrong" and "never written" in r.hint, r.message


def test_bad_arguments_are_named():
    qkv = np.zeros((2, 5, 12), np.float32)
    with pytest.raises(ValueError, match="C = 4 is not divisible by n_head = 3"):
        nb_attention.attention_backward(np.zeros((2, 5, 4), np.float32), qkv, np.zeros((2, 3, 5, 5), np.float32),
                                        np.zeros_like(qkv), 3)
    with pytest.raises(ValueError, match=r"att is \(2, 2, 5, 4\), expected \(2, 2, 5, 5\)"):
        nb_attention.attention_backward(np.zeros((2, 5, 4), np.float32), qkv, np.zeros((2, 2, 5, 4), np.float32),
                                        np.zeros_like(qkv), 2)
    with pytest.raises(TypeError, match="qkv must be float32, got float64"):
        nb_attention.attention_backward(np.zeros((2, 5, 4), np.float32), qkv.astype(np.float64),
                                        np.zeros((2, 2, 5, 5), np.float32), np.zeros_like(qkv), 2)
    with pytest.raises(ValueError, match="version 'v9' unknown"):
        nb_attention.attention_backward(None, qkv, None, None, 2, version="v9")


@pytest.mark.gpu
@pytest.mark.parametrize("backend,version", [("numba", "v1"), ("hip", "v1"), ("hip", "cublas")])
def test_every_version_on_gpu_at_large_size(backend, version):
    if backend == "numba":
        fn, arrays = nb_attention.attention_backward, "numba"
    else:
        from gpullm_lessons.backends.hip import attention as hip_attention
        fn, arrays = hip_attention.attention_backward, "cupy"
    r = checks.check_attention_backward(lambda *a: fn(*a, version=version), arrays=arrays, size="large", quiet=True)
    assert r.status == "correct", r.message


# ---- the training loop's causal softmax forward / backward launchers (engine/gpu.py) ------------------------------
def _causal_rows(rng, G, T):
    pre = rng.standard_normal((G * T, T), dtype=np.float32) * 3
    t = np.arange(G * T) % T
    mask = np.arange(T)[None, :] <= t[:, None]
    return pre, mask


def _reference_softmax(pre, mask, scale):
    z = np.where(mask, pre.astype(np.float64) * scale, -np.inf)
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def _launchers():
    """(name, launcher module, to device, to host) for every backend this machine runs."""
    dev = host = np.asarray
    if device.has_gpu():
        import cupy as cp
        from gpullm_lessons.backends import hip
        dev, host = cp.asarray, cp.asnumpy
        yield "hip", hip, dev, host
    if device.numba_available():
        yield "numba", nb_attention, dev, host


@pytest.mark.parametrize("G, T", [(3, 5), (2, 33)])
def test_causal_softmax_forward_and_backward_match_numpy(G, T):
    rng = np.random.default_rng()
    pre, mask = _causal_rows(rng, G, T)
    scale = 0.37
    att = _reference_softmax(pre, mask, scale)
    datt = rng.standard_normal(pre.shape)
    dpre = scale * att * (datt - (att * datt).sum(axis=1, keepdims=True))
    for name, K, dev, host in _launchers():
        out = dev(np.full_like(pre, np.nan))
        K.attention_softmax_forward(dev(pre), out, scale)
        np.testing.assert_allclose(host(out), att, rtol=1e-5, atol=1e-6, err_msg=name)
        got = dev(np.full_like(pre, np.nan))
        K.attention_softmax_backward(dev(att.astype(np.float32)), dev(datt.astype(np.float32)), got, scale)
        np.testing.assert_allclose(host(got), dpre, rtol=1e-4, atol=1e-5, err_msg=name)


def test_causal_softmax_reference_would_catch_a_missing_mask():
    """The comparison above can fail: a softmax over the whole row (no causal mask) is far from it."""
    pre, mask = _causal_rows(np.random.default_rng(0), 2, 6)
    assert not np.allclose(_reference_softmax(pre, np.ones_like(mask), 0.37), _reference_softmax(pre, mask, 0.37),
                           atol=1e-3)


def test_causal_softmax_bad_shapes_are_named():
    with pytest.raises(ValueError, match="multiple of T"):
        nb_attention.attention_softmax_forward(np.zeros((5, 4), np.float32), np.zeros((5, 4), np.float32), 1.0)
    with pytest.raises(TypeError, match="float32"):
        nb_attention.attention_softmax_forward(np.zeros((8, 4)), np.zeros((8, 4), np.float32), 1.0)


# ---- half precision: att_half= / half= ("bf16" | "fp16"), uint16 bits in and out -----------------------------------
from numba import cuda  # noqa: E402  (gpullm_lessons chose simulator or GPU before: conftest imports it first)

from gpullm_lessons.model import precision  # noqa: E402
from gpullm_lessons.backends.hip import attention as hip_attention  # noqa: E402  (importable without cupy)

HALVES = ("bf16", "fp16")
POISON16 = 0xFFFF                          # a NaN in both formats: an unwritten element shows


def _to_half(x, half):
    """float32 array -> its half bits (uint16): bf16 by precision.f32_to_bf16_bits (= ml_dtypes), fp16 by NumPy."""
    x = np.asarray(x, np.float32)
    if half == "bf16":
        return precision.f32_to_bf16_bits(x)
    with np.errstate(over="ignore"):
        return x.astype(np.float16).view(np.uint16)


def _from_half(bits, half):
    """Half bits (uint16) -> float32, exact."""
    bits = np.asarray(bits)
    return precision.bf16_bits_to_f32(bits) if half == "bf16" else bits.view(np.float16).astype(np.float32)


def _ulps(a, b):
    """|a - b| in units in the last place of the 16-bit format (sign-magnitude bits mapped to a signed scale)."""
    def ordered(bits):
        mag = (bits & 0x7FFF).astype(np.int64)
        return np.where(bits & 0x8000, -mag, mag)
    return np.abs(ordered(np.asarray(a)) - ordered(np.asarray(b)))


def _assert_half_within_one_ulp(got_bits, ref64, half, err_msg="", slack=None):
    """got (half bits) equals the float32 reference rounded to half within 1 ulp of half. `slack` (float64, like
    ref64): where the float32 arithmetic itself may be off by more than that (the cancellation in datt - dot of the
    backward), an element may instead be within slack + 1 half ulp of the float64 reference."""
    got_bits = np.asarray(got_bits)
    assert got_bits.dtype == np.uint16
    ref_bits = _to_half(ref64.astype(np.float32), half)
    far = _ulps(got_bits, ref_bits) > 1
    if slack is not None and far.any():
        got = _from_half(got_bits, half).astype(np.float64)
        one_ulp = np.abs(_from_half(ref_bits ^ 1, half).astype(np.float64) - _from_half(ref_bits, half))
        far &= ~(np.abs(got - ref64) <= slack + one_ulp)
    if far.any():
        i = tuple(int(k[0]) for k in np.nonzero(far))
        raise AssertionError(f"{err_msg}: {int(far.sum())} of {far.size} half values more than 1 ulp from the "
                             f"reference; first at {i}: got {_from_half(got_bits[i], half)} (bits {got_bits[i]:#06x}),"
                             f" expected {ref64[i]} (bits {ref_bits[i]:#06x})")


def _reference_backward(att64, datt64, scale):
    """dpre (float64) and slack: a bound on the float32 kernel's error (the fp32 row sum, then datt - dot)."""
    dot = (att64 * datt64).sum(axis=1, keepdims=True)
    dpre = scale * att64 * (datt64 - dot)
    T = att64.shape[1]
    err = 4 * T * np.finfo(np.float32).eps * ((np.abs(att64 * datt64)).sum(axis=1, keepdims=True) + np.abs(datt64))
    return dpre, scale * att64 * err


def _half_launchers():
    """(name, module, to device, to host): the Numba twins here (simulator or GPU), the HIP ones on a GPU."""
    yield from _launchers()


@pytest.mark.parametrize("half", HALVES)
@pytest.mark.parametrize("G, T", [(3, 5), (2, 33)])
@pytest.mark.parametrize("with_f32", [True, False], ids=["att+att_half", "att_half only"])
def test_causal_softmax_forward_writes_half_bits(half, G, T, with_f32):
    rng = np.random.default_rng()
    pre, mask = _causal_rows(rng, G, T)
    scale = 0.37
    ref = _reference_softmax(pre, mask, scale)
    for name, K, dev, host in _half_launchers():
        att = dev(np.full_like(pre, np.nan)) if with_f32 else None
        att_half = dev(np.full(pre.shape, POISON16, np.uint16))
        K.attention_softmax_forward(dev(pre), att, scale, att_half=att_half, half=half)
        got = host(att_half)
        _assert_half_within_one_ulp(got, ref, half, err_msg=f"{name} {half}")
        assert (got[~mask] == 0).all(), f"{name}: masked entries must be +0 bits"
        if with_f32:
            got32 = host(att)
            np.testing.assert_allclose(got32, ref, rtol=1e-5, atol=1e-6, err_msg=name)
            # the half bits are the float32 output rounded (same values, one rounding)
            np.testing.assert_array_equal(got, _to_half(got32, half), err_msg=name)


@pytest.mark.parametrize("half", HALVES)
def test_causal_softmax_forward_in_place_with_half_bits(half):
    """att = pre (in place) and att_half together, as the engine calls it."""
    rng = np.random.default_rng()
    pre, mask = _causal_rows(rng, 2, 9)
    ref = _reference_softmax(pre, mask, 0.5)
    for name, K, dev, host in _half_launchers():
        buf = dev(pre)
        att_half = dev(np.full(pre.shape, POISON16, np.uint16))
        K.attention_softmax_forward(buf, buf, 0.5, att_half=att_half, half=half)
        np.testing.assert_allclose(host(buf), ref, rtol=1e-5, atol=1e-6, err_msg=name)
        _assert_half_within_one_ulp(host(att_half), ref, half, err_msg=f"{name} {half}")


def test_causal_softmax_forward_f32_unchanged_by_keywords():
    """The float32 call with the new keywords at their defaults is the old call."""
    rng = np.random.default_rng()
    pre, mask = _causal_rows(rng, 2, 7)
    for name, K, dev, host in _half_launchers():
        a, b = dev(np.full_like(pre, np.nan)), dev(np.full_like(pre, np.nan))
        K.attention_softmax_forward(dev(pre), a, 0.37)
        K.attention_softmax_forward(dev(pre), b, 0.37, att_half=None, half=None)
        np.testing.assert_array_equal(host(a), host(b), err_msg=name)


@pytest.mark.parametrize("half", HALVES)
@pytest.mark.parametrize("G, T", [(3, 5), (2, 33)])
@pytest.mark.parametrize("att_fmt, dpre_fmt", [("half", "f32"), ("f32", "half"), ("half", "half")])
def test_causal_softmax_backward_half_formats(half, G, T, att_fmt, dpre_fmt):
    rng = np.random.default_rng()
    pre, mask = _causal_rows(rng, G, T)
    scale = 0.37
    att32 = _reference_softmax(pre, mask, scale).astype(np.float32)
    att_half = _to_half(att32, half)
    # the reference reads the att the kernel reads: the half values converted to float, or the float32 att
    att64 = (_from_half(att_half, half) if att_fmt == "half" else att32).astype(np.float64)
    datt = rng.standard_normal(pre.shape, dtype=np.float32)
    ref, slack = _reference_backward(att64, datt.astype(np.float64), scale)
    for name, K, dev, host in _half_launchers():
        att_in = dev(att_half if att_fmt == "half" else att32)
        dpre = dev(np.full(pre.shape, POISON16, np.uint16) if dpre_fmt == "half" else np.full_like(pre, np.nan))
        K.attention_softmax_backward(att_in, dev(datt), dpre, scale, half=half)
        got = host(dpre)
        if dpre_fmt == "half":
            _assert_half_within_one_ulp(got, ref, half, err_msg=f"{name} {half}", slack=slack)
            assert (got[~mask] == 0).all(), f"{name}: masked entries must be +0 bits"
            if not device.has_gpu():   # the simulator: the half bits are exactly the float32 result rounded
                f32 = dev(np.full_like(pre, np.nan))
                K.attention_softmax_backward(att_in, dev(datt), f32, scale, half=half if att_fmt == "half" else None)
                np.testing.assert_array_equal(got, _to_half(host(f32), half), err_msg=f"{name}: not rounded as "
                                              f"convert.py rounds")
        else:
            np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5, err_msg=f"{name} {half}")
            assert (got[~mask] == 0).all()


@pytest.mark.parametrize("half", HALVES)
def test_causal_softmax_backward_half_att_in_place(half):
    """att as half bits, dpre = datt (float32, in place): the engine's backward in half precision."""
    rng = np.random.default_rng()
    pre, mask = _causal_rows(rng, 2, 9)
    att_half = _to_half(_reference_softmax(pre, mask, 0.5).astype(np.float32), half)
    datt = rng.standard_normal(pre.shape, dtype=np.float32)
    ref, _ = _reference_backward(_from_half(att_half, half).astype(np.float64), datt.astype(np.float64), 0.5)
    for name, K, dev, host in _half_launchers():
        buf = dev(datt)
        K.attention_softmax_backward(dev(att_half), buf, buf, 0.5, half=half)
        np.testing.assert_allclose(host(buf), ref, rtol=1e-4, atol=1e-5, err_msg=name)


def test_half_comparison_would_catch_a_wrong_rounding():
    """The 1-ulp check can fail: off by two ulps, or fp16 bits where bf16 was asked, is caught. (Truncating instead
    of rounding is within one ulp: the tests catch it by comparing the half bits with the float32 output rounded.)"""
    rng = np.random.default_rng(0)
    ref = rng.uniform(0.01, 1, 1000)
    truncated = (ref.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    _assert_half_within_one_ulp(truncated, ref, "bf16")          # within one ulp: passes
    with pytest.raises(AssertionError, match="more than 1 ulp"):
        _assert_half_within_one_ulp(truncated - np.uint16(1), ref, "bf16")
    with pytest.raises(AssertionError, match="more than 1 ulp"):
        _assert_half_within_one_ulp(_to_half(ref, "fp16"), ref, "bf16")


@cuda.jit
def _decode_half_bits(bits, out16, outbf):
    """One thread: out16[i], outbf[i] = bits[i] read as fp16 / bf16 through the kernels' device functions."""
    if cuda.grid(1) == 0:
        for i in range(bits.shape[0]):
            out16[i] = nb_attention.f16_bits_to_f32(bits[i])
            outbf[i] = nb_attention.bf16_bits_to_f32(bits[i])


def test_numba_half_bits_to_float_is_exact_for_every_pattern():
    """f16_bits_to_f32 / bf16_bits_to_f32 (the backward's reads) against NumPy on all 65536 bit patterns of a stride
    (subnormals, zeros, inf and NaN included); one thread, so it runs in the simulator."""
    step = 1 if device.numba_on_gpu() else 7         # every 7th pattern in the simulator (< 2 s); all on a GPU
    bits = np.concatenate([np.arange(0, 65536, step), [0, 1, 0x3FF, 0x400, 0x7C00, 0x7C01, 0x7E00, 0x8000, 0x8001,
                                                       0xFBFF, 0xFC00, 0xFFFF]]).astype(np.uint16)
    out16, outbf = np.full(bits.shape, np.nan, np.float32), np.full(bits.shape, np.nan, np.float32)
    _decode_half_bits[1, 1](bits, out16, outbf)
    np.testing.assert_array_equal(out16.view(np.uint32), bits.view(np.float16).astype(np.float32).view(np.uint32))
    np.testing.assert_array_equal(outbf.view(np.uint32), precision.bf16_bits_to_f32(bits).view(np.uint32))


_F = np.zeros((6, 3), np.float32)
_H = np.zeros((6, 3), np.uint16)
BAD_FORWARD = [
    (dict(pre=_F, att=_F, att_half=_H), TypeError, "att_half is uint16 .half bits. but half= is not given"),
    (dict(pre=_F, att=None, att_half=_H, half="bf8"), ValueError, "half='bf8' is not a half format"),
    (dict(pre=_F, att=_F, half="bf16"), ValueError, "half='bf16' given but att_half is None"),
    (dict(pre=_F, att=_F, half="f16"), ValueError, "half='f16' is not a half format"),
    (dict(pre=_F, att=None), ValueError, "att and att_half are both None"),
    (dict(pre=_F, att=None, att_half=_F, half="fp16"), TypeError, "att_half must be uint16 .half bits"),
    (dict(pre=_F, att=_H, att_half=_H, half="fp16"), TypeError, "att must be float32, got uint16"),
    (dict(pre=_H, att=_F), TypeError, "pre must be float32, got uint16"),
    (dict(pre=_F, att=None, att_half=np.zeros((6, 2), np.uint16), half="bf16"), ValueError,
     r"att_half is \(6, 2\) but pre is \(6, 3\)"),
    (dict(pre=np.zeros((5, 3), np.float32), att=None, att_half=np.zeros((5, 3), np.uint16), half="bf16"), ValueError,
     r"rows = 5 must be a multiple of T = 3"),
]
BAD_BACKWARD = [
    (dict(att=_H, datt=_F, dpre=_F), TypeError, "att is uint16 .half bits. but half= is not given"),
    (dict(att=_F, datt=_F, dpre=_H), TypeError, "dpre is uint16 .half bits. but half= is not given"),
    (dict(att=_F, datt=_F, dpre=_F, half="bf16"), ValueError, r"half='bf16' given but no half array \(att, dpre\)"),
    (dict(att=_H, datt=_F, dpre=_F, half="float16"), ValueError, "half='float16' is not a half format"),
    (dict(att=_H, datt=_H, dpre=_F, half="fp16"), TypeError, "datt must be float32, got uint16"),
    (dict(att=np.zeros((6, 3), np.float16), datt=_F, dpre=_F, half="fp16"), TypeError,
     r"att must be float32 or uint16 \(half bits, with half=\), got float16"),
    (dict(att=_H, datt=_F, dpre=np.zeros((3, 3), np.uint16), half="bf16"), ValueError,
     r"dpre is \(3, 3\) but att is \(6, 3\)"),
]


@pytest.mark.parametrize("module", [nb_attention, hip_attention], ids=["numba", "hip"])
@pytest.mark.parametrize("kw, err, match", BAD_FORWARD, ids=[f"fwd{i}" for i in range(len(BAD_FORWARD))])
def test_causal_softmax_forward_bad_half_arguments_are_named(module, kw, err, match):
    with pytest.raises(err, match=f"attention_softmax_forward: {match}"):
        module.attention_softmax_forward(scale=1.0, **kw)


@pytest.mark.parametrize("module", [nb_attention, hip_attention], ids=["numba", "hip"])
@pytest.mark.parametrize("kw, err, match", BAD_BACKWARD, ids=[f"bwd{i}" for i in range(len(BAD_BACKWARD))])
def test_causal_softmax_backward_bad_half_arguments_are_named(module, kw, err, match):
    with pytest.raises(err, match=f"attention_softmax_backward: {match}"):
        module.attention_softmax_backward(scale=1.0, **kw)


# ---- GPU: both backends at the training loop's sizes -----------------------------------------------------------
GPU_SIZES = [(64 * 6, 256), (4 * 12, 1024)]           # (B*nh, T): rows = B*nh*T


def _gpu_backends():
    import cupy as cp
    from gpullm_lessons.backends import hip
    out = [("hip", hip)]
    if device.numba_on_gpu():
        out.append(("numba", nb_attention))
    return cp, out


@pytest.mark.gpu
@pytest.mark.parametrize("half", HALVES)
@pytest.mark.parametrize("G, T", GPU_SIZES, ids=["256", "1024"])
def test_causal_softmax_half_on_gpu(half, G, T):
    cp, backends = _gpu_backends()
    rng = np.random.default_rng()
    pre, mask = _causal_rows(rng, G, T)
    scale = 1 / 8
    ref = _reference_softmax(pre, mask, scale)                               # float64 (rows, T)
    datt = rng.standard_normal(pre.shape, dtype=np.float32)
    ref_half = _to_half(ref.astype(np.float32), half)
    att64_half = _from_half(ref_half, half).astype(np.float64)
    dpre_ref_h, slack_h = _reference_backward(att64_half, datt.astype(np.float64), scale)
    dpre_ref_f, slack_f = _reference_backward(ref.astype(np.float32).astype(np.float64), datt.astype(np.float64),
                                              scale)
    d_pre, d_datt = cp.asarray(pre), cp.asarray(datt)
    for name, K in backends:
        # forward: float32 and half together (att = pre, in place), then half only
        att = d_pre.copy()
        att_half = cp.full(pre.shape, POISON16, cp.uint16)
        K.attention_softmax_forward(att, att, scale, att_half=att_half, half=half)
        np.testing.assert_allclose(cp.asnumpy(att), ref, rtol=1e-5, atol=1e-6, err_msg=name)
        _assert_half_within_one_ulp(cp.asnumpy(att_half), ref, half, err_msg=f"{name} {half} forward")
        np.testing.assert_array_equal(cp.asnumpy(att_half), _to_half(cp.asnumpy(att), half), err_msg=name)
        only_half = cp.full(pre.shape, POISON16, cp.uint16)
        K.attention_softmax_forward(d_pre, None, scale, att_half=only_half, half=half)
        # the half-only call runs the warp-per-row kernel, the two-output one the block-per-row kernel: their fp32
        # sums are added in different orders, so a value next to a rounding boundary may round the other way (1 ulp)
        diff = _ulps(cp.asnumpy(only_half), cp.asnumpy(att_half))
        assert diff.max() <= 1 and (diff > 0).mean() <= 1e-3, f"{name}: half-only forward differs from the two-output one"
        _assert_half_within_one_ulp(cp.asnumpy(only_half), ref, half, err_msg=f"{name} {half} half-only forward")
        del att
        # backward: half att -> float32 dpre in place of datt (the engine's call)
        d_att_half = cp.asarray(ref_half)
        buf = d_datt.copy()
        K.attention_softmax_backward(d_att_half, buf, buf, scale, half=half)
        np.testing.assert_allclose(cp.asnumpy(buf), dpre_ref_h, rtol=1e-4, atol=1e-5, err_msg=f"{name} {half}")
        # half att -> half dpre; float32 att -> half dpre
        out = cp.full(pre.shape, POISON16, cp.uint16)
        K.attention_softmax_backward(d_att_half, d_datt, out, scale, half=half)
        _assert_half_within_one_ulp(cp.asnumpy(out), dpre_ref_h, half, err_msg=f"{name} {half} bwd h->h",
                                    slack=slack_h)
        out.fill(POISON16)
        K.attention_softmax_backward(cp.asarray(ref.astype(np.float32)), d_datt, out, scale, half=half)
        _assert_half_within_one_ulp(cp.asnumpy(out), dpre_ref_f, half, err_msg=f"{name} {half} bwd f->h",
                                    slack=slack_f)
        del buf, out
        cp.get_default_memory_pool().free_all_blocks()


@pytest.mark.gpu
@pytest.mark.parametrize("G, T", GPU_SIZES, ids=["256", "1024"])
def test_causal_softmax_f32_on_gpu(G, T):
    """The float32 path at the same sizes (unchanged by the half versions)."""
    cp, backends = _gpu_backends()
    rng = np.random.default_rng()
    pre, mask = _causal_rows(rng, G, T)
    scale = 1 / 8
    ref = _reference_softmax(pre, mask, scale)
    att32 = ref.astype(np.float32)
    datt = rng.standard_normal(pre.shape, dtype=np.float32)
    dpre_ref, _ = _reference_backward(att32.astype(np.float64), datt.astype(np.float64), scale)
    for name, K in backends:
        att = cp.full(pre.shape, cp.nan, cp.float32)
        K.attention_softmax_forward(cp.asarray(pre), att, scale)
        np.testing.assert_allclose(cp.asnumpy(att), ref, rtol=1e-5, atol=1e-6, err_msg=name)
        buf = cp.asarray(datt)
        K.attention_softmax_backward(cp.asarray(att32), buf, buf, scale)
        np.testing.assert_allclose(cp.asnumpy(buf), dpre_ref, rtol=1e-4, atol=1e-5, err_msg=name)
        del att, buf
        cp.get_default_memory_pool().free_all_blocks()


# ---- half inputs: pre (forward) and datt (backward) as half bits, half in -> half out of the same format ------------
HALF_IN_SIZES = [(3, 5), (2, 33), (4, 1)]             # (B*nh, T): T not a multiple of 32, and T = 1


def _half_pre(rng, G, T, half):
    """Raw scores as half bits, and the float64 values they hold (the reference's input)."""
    pre, mask = _causal_rows(rng, G, T)
    bits = _to_half(pre, half)
    return bits, _from_half(bits, half).astype(np.float64), mask


@pytest.mark.parametrize("half", HALVES)
@pytest.mark.parametrize("G, T", HALF_IN_SIZES)
def test_causal_softmax_forward_half_in(half, G, T):
    rng = np.random.default_rng()
    bits, pre64, mask = _half_pre(rng, G, T, half)
    scale = 0.37
    ref = _reference_softmax(pre64, mask, scale)           # from the half values, in float64
    for name, K, dev, host in _half_launchers():
        out = dev(np.full(bits.shape, POISON16, np.uint16))
        K.attention_softmax_forward(dev(bits), None, scale, att_half=out, half=half)
        got = host(out)
        _assert_half_within_one_ulp(got, ref, half, err_msg=f"{name} {half} half in")
        assert (got[~mask] == 0).all(), f"{name}: masked entries must be +0 bits"
        # the same as the float32-in kernel on the converted values (the same fp32 arithmetic, one rounding)
        f32_in = dev(np.full(bits.shape, POISON16, np.uint16))
        K.attention_softmax_forward(dev(pre64.astype(np.float32)), None, scale, att_half=f32_in, half=half)
        if device.has_gpu():   # compiled kernels: allow the odd rounding-boundary case
            _within_one_ulp_mostly(got, host(f32_in), f"{name}: half in vs float32 in")
        else:
            np.testing.assert_array_equal(got, host(f32_in), err_msg=f"{name}: half in differs from float32 in")


@pytest.mark.parametrize("half", HALVES)
def test_causal_softmax_forward_half_in_in_place(half):
    """att_half = pre (the same half buffer, through two reshaped views as the engine passes it)."""
    rng = np.random.default_rng()
    bits, pre64, mask = _half_pre(rng, 3, 9, half)
    ref = _reference_softmax(pre64, mask, 0.5)
    for name, K, dev, host in _half_launchers():
        apart = dev(np.full(bits.shape, POISON16, np.uint16))
        K.attention_softmax_forward(dev(bits), None, 0.5, att_half=apart, half=half)
        buf = dev(bits.reshape(3, 9, 9))
        K.attention_softmax_forward(buf.reshape(-1, 9), None, 0.5, att_half=buf.reshape(-1, 9), half=half)
        np.testing.assert_array_equal(host(buf).reshape(-1, 9), host(apart), err_msg=name)
        _assert_half_within_one_ulp(host(buf).reshape(-1, 9), ref, half, err_msg=f"{name} {half} in place")


def _half_backward_inputs(rng, G, T, half, scale):
    """att and datt as half bits, and the float64 reference dpre (with its slack) from the half values."""
    pre, mask = _causal_rows(rng, G, T)
    att_bits = _to_half(_reference_softmax(pre, mask, scale).astype(np.float32), half)
    datt_bits = _to_half(rng.standard_normal(pre.shape, dtype=np.float32), half)
    ref, slack = _reference_backward(_from_half(att_bits, half).astype(np.float64),
                                     _from_half(datt_bits, half).astype(np.float64), scale)
    return att_bits, datt_bits, ref, slack, mask


@pytest.mark.parametrize("half", HALVES)
@pytest.mark.parametrize("G, T", HALF_IN_SIZES)
def test_causal_softmax_backward_half_datt(half, G, T):
    rng = np.random.default_rng()
    scale = 0.37
    att_bits, datt_bits, ref, slack, mask = _half_backward_inputs(rng, G, T, half, scale)
    for name, K, dev, host in _half_launchers():
        out = dev(np.full(att_bits.shape, POISON16, np.uint16))
        K.attention_softmax_backward(dev(att_bits), dev(datt_bits), out, scale, half=half)
        got = host(out)
        _assert_half_within_one_ulp(got, ref, half, err_msg=f"{name} {half} half datt", slack=slack)
        assert (got[~mask] == 0).all(), f"{name}: masked entries must be +0 bits"
        # the same as the float32-datt kernel on the converted values
        f32_in = dev(np.full(att_bits.shape, POISON16, np.uint16))
        K.attention_softmax_backward(dev(att_bits), dev(_from_half(datt_bits, half)), f32_in, scale, half=half)
        if device.has_gpu():
            _within_one_ulp_mostly(got, host(f32_in), f"{name}: half datt vs float32 datt", half, slack)
        else:
            np.testing.assert_array_equal(got, host(f32_in), err_msg=f"{name}: half datt differs from float32 datt")


@pytest.mark.parametrize("half", HALVES)
def test_causal_softmax_backward_half_datt_in_place(half):
    """dpre = datt, both half bits (the same buffer, two reshaped views): the same bits as a separate dpre."""
    rng = np.random.default_rng()
    att_bits, datt_bits, ref, slack, _ = _half_backward_inputs(rng, 2, 9, half, 0.5)
    for name, K, dev, host in _half_launchers():
        apart = dev(np.full(att_bits.shape, POISON16, np.uint16))
        K.attention_softmax_backward(dev(att_bits), dev(datt_bits), apart, 0.5, half=half)
        buf = dev(datt_bits.reshape(2, 9, 9))
        K.attention_softmax_backward(dev(att_bits), buf.reshape(-1, 9), buf.reshape(-1, 9), 0.5, half=half)
        np.testing.assert_array_equal(host(buf).reshape(-1, 9), host(apart), err_msg=name)
        _assert_half_within_one_ulp(host(apart), ref, half, err_msg=f"{name} {half} in place", slack=slack)


_SHARED = np.zeros((7, 3), np.uint16)                 # two (6, 3) views one row apart: a partial overlap
BAD_HALF_IN_FORWARD = [
    (dict(pre=_H, att=None, att_half=_H), TypeError, "pre is uint16 .half bits. but half= is not given"),
    (dict(pre=_H, att=_F, att_half=_H, half="bf16"), TypeError,
     "pre must be float32, got uint16: half-bit pre .half in, half out. needs att=None"),
    (dict(pre=_H, att=None, att_half=_F, half="fp16"), TypeError, "att_half must be uint16 .half bits"),
    (dict(pre=_H, att=None, att_half=_H, half="bf8"), ValueError, "half='bf8' is not a half format"),
    (dict(pre=_SHARED[:6], att=None, att_half=_SHARED[1:], half="bf16"), ValueError,
     "att_half overlaps pre but is not the same array"),
]
BAD_HALF_IN_BACKWARD = [
    (dict(att=_H, datt=_H, dpre=_H), TypeError, "att is uint16 .half bits. but half= is not given"),
    (dict(att=_F, datt=_H, dpre=_F), TypeError, "datt is uint16 .half bits. but half= is not given"),
    (dict(att=_F, datt=_H, dpre=_H, half="bf16"), TypeError,
     "datt must be float32, got uint16: half-bit datt needs att and dpre .* but att is float32"),
    (dict(att=_H, datt=_H, dpre=_F, half="fp16"), TypeError,
     "datt must be float32, got uint16: .* but dpre is float32"),
    (dict(att=_F, datt=_H, dpre=_F, half="fp16"), TypeError,
     "datt must be float32, got uint16: .* but att and dpre are float32"),
    (dict(att=_H, datt=_SHARED[:6], dpre=_SHARED[1:], half="fp16"), ValueError,
     "dpre overlaps datt but is not the same array"),
    (dict(att=_H, datt=_H, dpre=np.zeros((6, 4), np.uint16), half="bf16"), ValueError,
     r"dpre is \(6, 4\) but att is \(6, 3\)"),
]


@pytest.mark.parametrize("module", [nb_attention, hip_attention], ids=["numba", "hip"])
@pytest.mark.parametrize("kw, err, match", BAD_HALF_IN_FORWARD,
                         ids=[f"fwd{i}" for i in range(len(BAD_HALF_IN_FORWARD))])
def test_causal_softmax_forward_bad_half_in_arguments_are_named(module, kw, err, match):
    with pytest.raises(err, match=f"attention_softmax_forward: {match}"):
        module.attention_softmax_forward(scale=1.0, **kw)


@pytest.mark.parametrize("module", [nb_attention, hip_attention], ids=["numba", "hip"])
@pytest.mark.parametrize("kw, err, match", BAD_HALF_IN_BACKWARD,
                         ids=[f"bwd{i}" for i in range(len(BAD_HALF_IN_BACKWARD))])
def test_causal_softmax_backward_bad_half_in_arguments_are_named(module, kw, err, match):
    with pytest.raises(err, match=f"attention_softmax_backward: {match}"):
        module.attention_softmax_backward(scale=1.0, **kw)


def test_in_place_check_tells_apart_same_overlapping_and_separate_buffers():
    buf = np.zeros((4, 4, 4), np.uint16)
    nb_attention.check_in_place("f", "dpre", buf.reshape(-1, 4), "datt", buf.reshape(-1, 4))      # the same: fine
    nb_attention.check_in_place("f", "dpre", buf[:2].reshape(-1, 4), "datt", buf[2:].reshape(-1, 4))  # apart
    with pytest.raises(ValueError, match="f: dpre overlaps datt"):
        nb_attention.check_in_place("f", "dpre", buf.reshape(-1, 4)[1:9], "datt", buf.reshape(-1, 4)[0:8])


def _within_one_ulp_mostly(a, b, err_msg, half=None, slack=None):
    """Two kernels' half bits: at most 1 ulp apart, and apart at all on at most 0.1% of the elements (fp32 sums added
    in different orders may round the other way next to a rounding boundary). With `slack` (the backward's bound on
    the fp32 error of each kernel, float64) an element may be further apart where the cancellation in datt - dot
    explains it: |a - b| <= 2 * slack + 1 ulp."""
    diff = _ulps(a, b)
    far = diff > 1
    if slack is not None and far.any():
        fa, fb = (_from_half(x, half).astype(np.float64) for x in (a, b))
        one_ulp = np.abs(_from_half(b ^ np.uint16(1), half).astype(np.float64) - fb)
        far &= ~(np.abs(fa - fb) <= 2 * slack + one_ulp)
    assert not far.any() and (diff > 0).mean() <= 1e-3, (
        f"{err_msg}: {int(far.sum())} elements more than 1 ulp apart, {int((diff > 0).sum())} of {diff.size} differ")


# HIP's half-in paths: T % 8 == 0 up to 8 * 8 * warpSize: 16-byte chunks per lane (_v{C}); T = 1001: one element per
# lane (_w{K}); T = 2100 > 32 * warpSize: block per row
GPU_HALF_IN_SIZES = GPU_SIZES + [(3, 1001), (2, 2048), (2, 2100)]


@pytest.mark.gpu
@pytest.mark.parametrize("half", HALVES)
@pytest.mark.parametrize("G, T", GPU_HALF_IN_SIZES, ids=["256", "1024", "1001", "2048", "2100"])
def test_causal_softmax_half_in_on_gpu(half, G, T):
    cp, backends = _gpu_backends()
    rng = np.random.default_rng()
    scale = 1 / 8
    bits, pre64, mask = _half_pre(rng, G, T, half)
    ref = _reference_softmax(pre64, mask, scale)
    att_bits, datt_bits, dref, slack, _ = _half_backward_inputs(rng, G, T, half, scale)
    d_bits, d_att, d_datt = cp.asarray(bits), cp.asarray(att_bits), cp.asarray(datt_bits)
    fwd, bwd = {}, {}
    for name, K in backends:
        # forward: half in -> half out, against the reference and against the float32-in kernel on the same values
        out = cp.full(bits.shape, POISON16, cp.uint16)
        K.attention_softmax_forward(d_bits, None, scale, att_half=out, half=half)
        fwd[name] = cp.asnumpy(out)
        _assert_half_within_one_ulp(fwd[name], ref, half, err_msg=f"{name} {half} forward, half in")
        assert (fwd[name][~mask] == 0).all(), f"{name}: masked entries must be +0 bits"
        out.fill(POISON16)
        K.attention_softmax_forward(cp.asarray(pre64.astype(np.float32)), None, scale, att_half=out, half=half)
        _within_one_ulp_mostly(fwd[name], cp.asnumpy(out), f"{name} {half} forward: half in vs float32 in")
        # in place: att_half = pre
        buf = d_bits.copy()
        K.attention_softmax_forward(buf, None, scale, att_half=buf, half=half)
        np.testing.assert_array_equal(cp.asnumpy(buf), fwd[name], err_msg=f"{name} forward in place")
        del out, buf
        # backward: half att, half datt -> half dpre; then dpre = datt in place
        out = cp.full(att_bits.shape, POISON16, cp.uint16)
        K.attention_softmax_backward(d_att, d_datt, out, scale, half=half)
        bwd[name] = cp.asnumpy(out)
        _assert_half_within_one_ulp(bwd[name], dref, half, err_msg=f"{name} {half} backward, half datt", slack=slack)
        out.fill(POISON16)
        K.attention_softmax_backward(d_att, cp.asarray(_from_half(datt_bits, half)), out, scale, half=half)
        _within_one_ulp_mostly(bwd[name], cp.asnumpy(out), f"{name} {half} backward: half datt vs float32 datt",
                               half, slack)
        buf = d_datt.copy()
        K.attention_softmax_backward(d_att, buf, buf, scale, half=half)
        np.testing.assert_array_equal(cp.asnumpy(buf), bwd[name], err_msg=f"{name} backward in place")
        del out, buf
        cp.get_default_memory_pool().free_all_blocks()
    if len(fwd) == 2:                                  # HIP (warp or block per row) vs Numba (thread per row)
        _within_one_ulp_mostly(fwd["hip"], fwd["numba"], f"{half} forward: hip vs numba")
        _within_one_ulp_mostly(bwd["hip"], bwd["numba"], f"{half} backward: hip vs numba", half, slack)


@pytest.mark.gpu
@pytest.mark.parametrize("half", HALVES)
def test_hip_half_in_rows_off_16_bytes_take_the_scalar_kernels(half):
    """The vectorised kernels need rows on 16 bytes: arrays 8 bytes off it (contiguous views into a larger buffer)
    run the one-element-per-lane kernels, whose results agree with the vectorised ones to one ulp (exp vs exp2)."""
    cp, backends = _gpu_backends()
    K = dict(backends)["hip"]
    rng = np.random.default_rng()
    G, T, scale = 4, 256, 1 / 8
    bits, pre64, mask = _half_pre(rng, G, T, half)
    att_bits, datt_bits, dref, slack, _ = _half_backward_inputs(rng, G, T, half, scale)
    results = []
    for off in (0, 4):                                   # elements: 0 or 8 bytes off the 256-byte allocation start
        def put(a, off=off):
            big = cp.full(a.size + off, POISON16, cp.uint16)
            big[off:] = cp.asarray(a).ravel()
            return big[off:].reshape(a.shape)
        pre, att, datt = put(bits), put(att_bits), put(datt_bits)
        out, dpre = put(np.full(bits.shape, POISON16, np.uint16)), put(np.full(bits.shape, POISON16, np.uint16))
        assert (out.data.ptr % 16 == 0) == (off == 0)
        K.attention_softmax_forward(pre, None, scale, att_half=out, half=half)
        K.attention_softmax_backward(att, datt, dpre, scale, half=half)
        fwd, bwd = cp.asnumpy(out), cp.asnumpy(dpre)
        _assert_half_within_one_ulp(fwd, _reference_softmax(pre64, mask, scale), half, err_msg=f"forward, offset {off}")
        _assert_half_within_one_ulp(bwd, dref, half, err_msg=f"backward, offset {off}", slack=slack)
        results.append((fwd, bwd))
    _within_one_ulp_mostly(results[0][0], results[1][0], f"{half} forward: 16-byte rows vs 8-byte rows")
    _within_one_ulp_mostly(results[0][1], results[1][1], f"{half} backward: 16-byte rows vs 8-byte rows", half, slack)
