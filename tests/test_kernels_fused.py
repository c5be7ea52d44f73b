"""The engine's glue kernels (kernels/numba/fused.py, kernels/hip/fused.cu + backends/hip/fused.py) against NumPy.

Simulator (CI): every launcher of the Numba twins on fresh random inputs at toy, awkward sizes (not multiples of 32),
outputs poisoned (NaN / 0xFFFF) so unwritten elements show: float32 outputs within 1e-6 relative (GELU: the gelu
tests' tolerance against float64), half outputs bit-equal to NumPy's rounding of the float32 values (bf16:
gpullm_lessons.model.precision, fp16: astype(float16)), colsum within 1e-5 relative and the same bits on a second call;
in-place calls; merge_heads leaving the other columns alone; every bad argument caught with a message naming it.
GPU (`make gpu-test`): both backends at N = 16384, C = 768 (split/merge from/into ld = 3C, nh = 12), plus awkward
sizes and block shapes for the HIP kernels.
"""
import numpy as np
import pytest

from gpullm_lessons import device
from gpullm_lessons.runtime.arrays import to_backend, to_numpy
from gpullm_lessons.kernels.numba import fused as nb
from gpullm_lessons.model.precision import f32_to_bf16_bits

HALVES = [None, "bf16", "fp16"]
POISON16 = 0xFFFF
GELU_SCALE = np.sqrt(2.0 / np.pi)

needs_numba_gpu = pytest.mark.skipif(not device.numba_on_gpu(),
                                     reason=f"needs Numba on an NVIDIA GPU (this machine: {device.kind()})")


def hip_module():
    pytest.importorskip("cupy")
    from gpullm_lessons.backends.hip import fused as hip_fused
    return hip_fused


# ---- NumPy references -------------------------------------------------------------------------------------------

def to_half(x, half):
    """float32 array -> its 16-bit bits (uint16), round to nearest even; half=None returns x."""
    x = np.asarray(x, np.float32)
    if half is None:
        return x
    if half == "bf16":
        return f32_to_bf16_bits(x)
    with np.errstate(over="ignore"):
        return x.astype(np.float16).view(np.uint16)


def gelu64(x):
    x = np.asarray(x, np.float64)
    return 0.5 * x * (1.0 + np.tanh(GELU_SCALE * (x + 0.044715 * x ** 3)))


def heads(a, B, T, nh):
    """(B*T, C) -> (B*nh, T, hs)."""
    C = a.shape[1]
    return np.ascontiguousarray(a.reshape(B, T, nh, C // nh).transpose(0, 2, 1, 3)).reshape(B * nh, T, C // nh)


def layernorm64(x, w, b, eps=1e-5):
    x = np.asarray(x, np.float64)
    m = x.mean(axis=1)
    v = ((x - m[:, None]) ** 2).mean(axis=1)
    r = 1.0 / np.sqrt(v + eps)
    return (x - m[:, None]) * r[:, None] * w + b, m, r


def empty_out(shape, half, arrays="numpy"):
    """A poisoned output: NaN (float32) or 0xFFFF (half bits)."""
    a = np.full(shape, np.nan, np.float32) if half is None else np.full(shape, POISON16, np.uint16)
    return to_backend(a, arrays)


def _ordered(bits):
    """Sign-magnitude half bits -> a signed scale on which one step is one ulp."""
    mag = (bits & 0x7FFF).astype(np.int64)
    return np.where(bits & 0x8000, -mag, mag)


def assert_half_close(got, want):
    """GPU half outputs: the rounding of the float32 result, except that a GPU's fp32 math (FMA contraction, its
    tanhf) can differ from NumPy's by an ulp of fp32, which moves a value next to a half rounding boundary by one half
    ulp: at most one step, on at most 0.1% of the elements (a truncating or wrongly rounding kernel is off on ~half)."""
    steps = np.abs(_ordered(got) - _ordered(want))
    assert steps.max() <= 1 and (steps > 0).mean() <= 1e-3, (int(steps.max()), float((steps > 0).mean()))


def assert_out(got, expected_f32, half, rtol=1e-6):
    """half=None: float32 within rtol; else the rounding of expected_f32: bit-equal in the simulator (NumPy's float32
    math), assert_half_close on a GPU."""
    on_gpu = not isinstance(got, np.ndarray)
    got = to_numpy(got)
    if half is None:
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, expected_f32, rtol=rtol, atol=rtol * 1e-3)
    else:
        assert got.dtype == np.uint16
        want = to_half(expected_f32, half)
        if on_gpu:
            assert_half_close(got, want)
        else:
            np.testing.assert_array_equal(got, want)


def test_gpu_half_tolerance_still_catches_truncation():
    """The GPU rule above fails a kernel that truncates to bf16 instead of rounding to nearest even."""
    x = rand(np.random.default_rng(9), 4096)
    truncated = (x.view(np.uint32) >> 16).astype(np.uint16)
    with pytest.raises(AssertionError):
        assert_half_close(truncated, to_half(x, "bf16"))
    assert_half_close(to_half(x, "bf16"), to_half(x, "bf16"))


def rand(rng, *shape):
    return rng.standard_normal(shape, dtype=np.float32)


# ---- (a) simulator: every launcher against NumPy ------------------------------------------------------------------

@pytest.mark.parametrize("N, C, threads", [(1, 1, 256), (19, 23, 32), (7, 45, 7)])
@pytest.mark.parametrize("with_res", [False, True])
def test_bias_add(N, C, threads, with_res):
    rng = np.random.default_rng()
    inp, bias, res = rand(rng, N, C), rand(rng, C), rand(rng, N, C)
    out = empty_out((N, C), None)
    nb.bias_add(inp, bias, out, res=res if with_res else None, threads=threads)
    expected = inp + bias + (res if with_res else 0)
    assert_out(out, expected, None)


def test_bias_add_in_place_on_inp_and_on_res():
    rng = np.random.default_rng()
    inp, bias, res = rand(rng, 13, 37), rand(rng, 37), rand(rng, 13, 37)
    expected = inp + bias + res
    a = inp.copy()
    nb.bias_add(a, bias, a, res=res, threads=32)          # out is inp
    assert_out(a, expected, None)
    r = res.copy()
    nb.bias_add(inp, bias, r, res=r, threads=32)          # out is res (the residual stream updated in place)
    assert_out(r, expected, None)


@pytest.mark.parametrize("half", HALVES)
@pytest.mark.parametrize("N, C", [(1, 3), (11, 37)])
def test_bias_gelu_forward(half, N, C):
    rng = np.random.default_rng()
    inp = (rand(rng, N, C) * 3).astype(np.float32)
    bias = rand(rng, C)
    pre = empty_out((N, C), None)
    out = empty_out((N, C), half)
    nb.bias_gelu_forward(inp, bias, pre, out, half=half, threads=32)
    np.testing.assert_array_equal(pre, inp + bias)       # the float32 sum, bit for bit
    if half is None:
        # the gelu tests' tolerance: 0.5 x (1 + tanh(u)) cancels for negative x, so an absolute floor too
        np.testing.assert_allclose(out, gelu64(inp + bias), rtol=1e-5,
                                   atol=1e-6 * max(1.0, float(np.abs(inp + bias).max())))
    else:
        f32 = empty_out((N, C), None)                     # the same kernel's float32 output, then NumPy's rounding
        nb.bias_gelu_forward(inp, bias, empty_out((N, C), None), f32, threads=32)
        assert_out(out, f32, half)


@pytest.mark.parametrize("half", HALVES)
def test_bias_gelu_forward_without_pre_leaves_inp_alone(half):
    """pre=None: the same out, inp not rewritten (the engine's half runs keep fc without its bias)."""
    rng = np.random.default_rng()
    inp, bias = (rand(rng, 9, 29) * 3).astype(np.float32), rand(rng, 29)
    a = inp.copy()
    out, want = empty_out((9, 29), half), empty_out((9, 29), half)
    nb.bias_gelu_forward(a, bias, None, out, half=half, threads=32)
    nb.bias_gelu_forward(inp, bias, empty_out((9, 29), None), want, half=half, threads=32)
    np.testing.assert_array_equal(a, inp)
    np.testing.assert_array_equal(out, want)


def from_half(bits, half):
    """uint16 half bits -> float32, exact."""
    bits = np.asarray(bits, np.uint16)
    if half == "bf16":
        return (bits.astype(np.uint32) << 16).view(np.float32)
    return bits.view(np.float16).astype(np.float32)


@pytest.mark.parametrize("half", ["bf16", "fp16"])
@pytest.mark.parametrize("N, C", [(1, 3), (11, 37), (70, 45)])
def test_bias_gelu_forward_keeps_a_half_pre_and_gelu_half_rebuilds_out(half, N, C):
    """pre uint16: GELU's input kept as the half bits of inp + bias, and out = half(gelu(that rounded value)), so that
    gelu_half(pre) (the selective recompute) gives out's bits again. A kernel that takes GELU of the unrounded sum,
    or a recompute that rounds differently, is caught here (a second call must agree bit for bit)."""
    rng = np.random.default_rng()
    inp, bias = (rand(rng, N, C) * 3).astype(np.float32), rand(rng, C)
    pre, out = empty_out((N, C), half), empty_out((N, C), half)
    nb.bias_gelu_forward(inp, bias, pre, out, half=half, threads=32)
    np.testing.assert_array_equal(pre, to_half(inp + bias, half))      # the float32 sum, rounded to nearest even
    x = from_half(pre, half)
    f32 = empty_out((N, C), None)                                      # this backend's float32 GELU of the rounded x
    nb.bias_gelu_forward(x, np.zeros(C, np.float32), empty_out((N, C), None), f32, threads=32)
    assert_out(out, f32, half)
    np.testing.assert_allclose(from_half(out, half), gelu64(x), rtol=2 ** -7 if half == "bf16" else 2 ** -10,
                               atol=1e-6 * max(1.0, float(np.abs(x).max())))
    again = empty_out((N, C), half)
    nb.gelu_half(pre, again, half, threads=32)
    np.testing.assert_array_equal(again, out)
    if N * C >= 1000:   # GELU of the unrounded sum: other bits on many elements
        unrounded = empty_out((N, C), half)
        nb.bias_gelu_forward(inp, bias, None, unrounded, half=half, threads=32)
        assert not np.array_equal(unrounded, out)


@pytest.mark.parametrize("half", ["bf16", "fp16"])
@pytest.mark.parametrize("N, C", [(1, 1), (70, 23)])
def test_colsum_convert_with_a_half_gelu_input(half, N, C):
    """gelu_of uint16 alone (the half pre, its bias in): the bits of the float32 path given the same rounded values
    and a zero bias, and the float64 chain rule; forgetting the GELU factor is caught."""
    rng = np.random.default_rng()
    dgelu, fc, b = rand(rng, N, C), (rand(rng, N, C) * 3).astype(np.float32), rand(rng, C)
    pre = to_half(fc + b, half)
    colsum, out = empty_out((C,), None), empty_out((N, C), half)
    nb.colsum_convert(dgelu, colsum, out=out, half=half, threads=32, gelu_of=pre)
    colsum2, out2 = empty_out((C,), None), empty_out((N, C), half)
    nb.colsum_convert(dgelu, colsum2, out=out2, half=half, threads=32, gelu_of=from_half(pre, half),
                      gelu_bias=np.zeros(C, np.float32))
    np.testing.assert_array_equal(out, out2)
    np.testing.assert_array_equal(colsum.view(np.uint32), colsum2.view(np.uint32))
    want = dgelu.astype(np.float64) * gelu_grad64(from_half(pre, half))
    scale = np.abs(want).sum(axis=0) + 0.1 * np.abs(dgelu).sum(axis=0)
    assert np.all(np.abs(colsum - want.sum(axis=0)) <= 1e-5 * scale + 1e-30)
    if N * C >= 100:
        assert not np.all(np.abs(dgelu.sum(axis=0) - want.sum(axis=0)) <= 1e-5 * scale + 1e-30)


@pytest.mark.parametrize("half", ["bf16", "fp16"])
@pytest.mark.parametrize("N, C", [(1, 1), (70, 23)])
def test_colsum_convert_reads_a_half_gelu_gradient_as_its_values(half, N, C):
    """inp uint16 (GELU's output gradient as its product rounded it) with the half pre: the bits of the float32 call
    on the same values; the values, not the unrounded float32 ones, are what it reads."""
    rng = np.random.default_rng()
    dgelu, pre = rand(rng, N, C), to_half((rand(rng, N, C) * 3).astype(np.float32), half)
    bits = to_half(dgelu, half)
    colsum, out = empty_out((C,), None), empty_out((N, C), half)
    nb.colsum_convert(bits, colsum, out=out, half=half, threads=32, gelu_of=pre)
    colsum2, out2 = empty_out((C,), None), empty_out((N, C), half)
    nb.colsum_convert(from_half(bits, half), colsum2, out=out2, half=half, threads=32, gelu_of=pre)
    np.testing.assert_array_equal(out, out2)
    np.testing.assert_array_equal(colsum.view(np.uint32), colsum2.view(np.uint32))
    if N * C >= 100:  # the unrounded gradient gives other sums
        colsum3 = empty_out((C,), None)
        nb.colsum_convert(dgelu, colsum3, out=empty_out((N, C), half), half=half, threads=32, gelu_of=pre)
        assert not np.array_equal(colsum3, colsum)


def test_half_gelu_input_arguments_are_checked():
    x, b6, u = np.zeros((4, 6), np.float32), np.zeros(6, np.float32), np.zeros((4, 6), np.uint16)
    with pytest.raises(ValueError, match="bias_gelu_forward: pre is uint16 .* but half=None"):
        nb.bias_gelu_forward(x, b6, u.copy(), x.copy())
    with pytest.raises(ValueError, match=r"bias_gelu_forward: pre has shape \(4, 5\), expected \(4, 6\)"):
        nb.bias_gelu_forward(x, b6, np.zeros((4, 5), np.uint16), u.copy(), half="bf16")
    with pytest.raises(ValueError, match="colsum_convert: gelu_of is uint16 .* leave gelu_bias=None"):
        nb.colsum_convert(x, b6.copy(), out=u.copy(), half="bf16", gelu_of=u, gelu_bias=b6)
    with pytest.raises(ValueError, match="colsum_convert: gelu_of is given but out is None"):
        nb.colsum_convert(x, b6.copy(), gelu_of=u)
    with pytest.raises(ValueError, match="colsum_convert: inp is uint16 .* with gelu_of uint16"):
        nb.colsum_convert(u, b6.copy(), out=u.copy(), half="bf16")
    with pytest.raises(ValueError, match="colsum_convert: inp is uint16 .* with gelu_of uint16"):
        nb.colsum_convert(u, b6.copy(), out=u.copy(), half="bf16", gelu_of=x, gelu_bias=b6)
    with pytest.raises(ValueError, match="gelu_half: half=None must be 'bf16' or 'fp16'"):
        nb.gelu_half(u, u.copy(), None)
    with pytest.raises(TypeError, match="gelu_half: inp has dtype float32, expected uint16"):
        nb.gelu_half(x, u.copy(), "bf16")
    with pytest.raises(ValueError, match=r"gelu_half: out has shape \(4, 5\), expected \(4, 6\)"):
        nb.gelu_half(u, np.zeros((4, 5), np.uint16), "fp16")


def test_bias_gelu_forward_in_place_pre_is_inp():
    rng = np.random.default_rng()
    inp, bias = rand(rng, 9, 29), rand(rng, 29)
    a = inp.copy()
    out = empty_out((9, 29), "bf16")
    nb.bias_gelu_forward(a, bias, a, out, half="bf16", threads=32)
    np.testing.assert_array_equal(a, inp + bias)
    f32 = empty_out((9, 29), None)
    nb.bias_gelu_forward(inp, bias, empty_out((9, 29), None), f32, threads=32)
    assert_out(out, f32, "bf16")


@pytest.mark.parametrize("half", HALVES)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("which", [0, 1, 2])
def test_split_heads(half, with_bias, which):
    rng = np.random.default_rng()
    B, T, nh, hs = 2, 3, 3, 5                              # C = 15, ld = 3C + 2 (nothing a multiple of 32)
    C = nh * hs
    ld = 3 * C + 2
    inp, bias = rand(rng, B * T, ld), rand(rng, C)
    out = empty_out((B * nh, T, hs), half)
    nb.split_heads(inp, which * C, out, B, T, nh, bias=bias if with_bias else None, half=half, threads=32)
    part = inp[:, which * C:(which + 1) * C] + bias if with_bias else inp[:, which * C:(which + 1) * C].copy()
    assert_out(out, heads(part, B, T, nh), half, rtol=0)


@pytest.mark.parametrize("half", HALVES)
@pytest.mark.parametrize("col0", [0, 7, 30])
def test_merge_heads_leaves_the_other_columns_alone(half, col0):
    rng = np.random.default_rng()
    B, T, nh, hs = 2, 3, 3, 5
    C = nh * hs
    ld = 3 * C + 2
    inp = rand(rng, B * nh, T, hs)
    before = to_half(rand(rng, B * T, ld), half)          # the columns that must survive: known random values
    out = before.copy()
    nb.merge_heads(inp, out, col0, B, T, nh, half=half, threads=32)
    merged = inp.reshape(B, nh, T, hs).transpose(0, 2, 1, 3).reshape(B * T, C)
    assert_out(out[:, col0:col0 + C], merged, half, rtol=0)
    np.testing.assert_array_equal(out[:, :col0], before[:, :col0])
    np.testing.assert_array_equal(out[:, col0 + C:], before[:, col0 + C:])


def test_split_then_merge_round_trips():
    rng = np.random.default_rng()
    B, T, nh, hs = 1, 4, 2, 3
    qkv = rand(rng, B * T, 3 * nh * hs)
    back = np.full_like(qkv, np.nan)
    for i in range(3):
        h = empty_out((B * nh, T, hs), None)
        nb.split_heads(qkv, i * nh * hs, h, B, T, nh, threads=32)
        nb.merge_heads(h, back, i * nh * hs, B, T, nh, threads=32)
    np.testing.assert_array_equal(back, qkv)


@pytest.mark.parametrize("half", HALVES)
@pytest.mark.parametrize("N, C", [(1, 1), (70, 23)])   # 70 rows: three chunks of ROWS_PER_CHUNK, the last partial
def test_colsum_convert(half, N, C):
    rng = np.random.default_rng()
    inp = (rand(rng, N, C) * 10 ** rng.uniform(-1, 1, (N, C))).astype(np.float32)
    colsum = empty_out((C,), None)
    out = None if half is None else empty_out((N, C), half)
    nb.colsum_convert(inp, colsum, out=out, half=half, threads=32)
    expected = inp.astype(np.float64).sum(axis=0)
    scale = np.abs(inp).astype(np.float64).sum(axis=0)    # a sum's rounding error grows with the sum of |terms|
    assert np.all(np.abs(colsum - expected) <= 1e-5 * scale + 1e-30), (colsum, expected)
    if out is not None:
        assert_out(out, inp, half)
    again = empty_out((C,), None)
    nb.colsum_convert(inp, again, out=None if half is None else empty_out((N, C), half), half=half, threads=32)
    np.testing.assert_array_equal(again.view(np.uint32), colsum.view(np.uint32))   # deterministic: same bits


def gelu_grad64(x):
    """d gelu_tanh(x) / dx in float64."""
    x = x.astype(np.float64)
    t = np.tanh(GELU_SCALE * (x + 0.044715 * x ** 3))
    return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * GELU_SCALE * (1 + 3 * 0.044715 * x * x)


@pytest.mark.parametrize("half", ["bf16", "fp16"])
@pytest.mark.parametrize("N, C", [(1, 1), (70, 23)])
def test_colsum_convert_with_gelu_is_gelu_backward_then_colsum(half, N, C):
    """gelu_of + gelu_bias fuse GELU's backward into the pass: the same bits as gelu_backward of fc + b, then
    colsum_convert, and the float64 chain rule within the usual bounds; a pass that forgets the GELU factor, or the
    bias inside it, is caught."""
    from gpullm_lessons.kernels.numba import gelu as nb_gelu
    rng = np.random.default_rng()
    dgelu, fc, b = rand(rng, N, C), (rand(rng, N, C) * 3).astype(np.float32), rand(rng, C)
    pre = fc + b  # GELU's input, as bias_gelu_forward computes it
    colsum, out = empty_out((C,), None), empty_out((N, C), half)
    nb.colsum_convert(dgelu, colsum, out=out, half=half, threads=32, gelu_of=fc, gelu_bias=b)
    dfc = empty_out((N, C), None)
    nb_gelu.gelu_backward(dgelu.reshape(-1), pre.reshape(-1), dfc.reshape(-1))
    colsum2, out2 = empty_out((C,), None), empty_out((N, C), half)
    nb.colsum_convert(dfc, colsum2, out=out2, half=half, threads=32)
    np.testing.assert_array_equal(out, out2)
    np.testing.assert_array_equal(colsum.view(np.uint32), colsum2.view(np.uint32))
    want = dgelu.astype(np.float64) * gelu_grad64(pre)
    scale = np.abs(want).sum(axis=0) + 0.1 * np.abs(dgelu).sum(axis=0)  # float32 gelu' is within ~1e-6 absolute
    assert np.all(np.abs(colsum - want.sum(axis=0)) <= 1e-5 * scale + 1e-30)
    if N * C < 100:
        return  # the wrong answers below are told apart by many columns; one element can sit where gelu' = 1
    plain = empty_out((C,), None)
    nb.colsum_convert(dgelu, plain, out=empty_out((N, C), half), half=half, threads=32)
    assert not np.all(np.abs(plain - want.sum(axis=0)) <= 1e-5 * scale + 1e-30)  # no GELU factor: caught
    no_bias = (dgelu.astype(np.float64) * gelu_grad64(fc)).sum(axis=0)
    assert not np.all(np.abs(no_bias - want.sum(axis=0)) <= 1e-5 * scale + 1e-30)  # gelu'(fc) without b: caught


def test_colsum_of_no_rows_is_zero():
    colsum = empty_out((5,), None)
    nb.colsum_convert(np.zeros((0, 5), np.float32), colsum)
    np.testing.assert_array_equal(colsum, np.zeros(5, np.float32))


@pytest.mark.parametrize("half", ["bf16", "fp16"])
@pytest.mark.parametrize("N, C", [(1, 7), (9, 45)])
def test_layernorm_forward_half(half, N, C):
    rng = np.random.default_rng()
    inp = (rand(rng, N, C) * 2 + 0.5).astype(np.float32)
    w, b = rand(rng, C), rand(rng, C)
    out = empty_out((N, C), half)
    mean, rstd = empty_out((N,), None), empty_out((N,), None)
    nb.layernorm_forward_half(inp, w, b, out, mean, rstd, half, threads=32)
    ref, m, r = layernorm64(inp, w, b)
    np.testing.assert_allclose(mean, m, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(rstd, r, rtol=1e-5)
    check_half_close(out, ref, half)


def check_half_close(bits, ref64, half):
    """The half values within one rounding (half an ulp) plus a float32 error of the float64 reference: the float32
    result may sit on the other side of a rounding boundary, so bits may differ from NumPy's by one step."""
    bits = to_numpy(bits)
    assert bits.dtype == np.uint16 and not np.any(bits == POISON16)
    if half == "bf16":
        got = (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        rel = 2.0 ** -8
    else:
        got = bits.view(np.float16).astype(np.float64)
        rel = 2.0 ** -11
    np.testing.assert_allclose(got, ref64, rtol=rel * 1.01, atol=1e-5)


# ---- (b) argument checks ----------------------------------------------------------------------------------------

def test_bad_arguments_are_named():
    f32, u16 = np.float32, np.uint16
    x = np.zeros((4, 6), f32)
    b6 = np.zeros(6, f32)
    with pytest.raises(ValueError, match=r"bias_add: bias has shape \(5,\), expected \(6,\)"):
        nb.bias_add(x, np.zeros(5, f32), x.copy())
    with pytest.raises(ValueError, match=r"bias_add: res has shape \(3, 6\), expected \(4, 6\)"):
        nb.bias_add(x, b6, x.copy(), res=np.zeros((3, 6), f32))
    with pytest.raises(TypeError, match="bias_add: inp has dtype float64, expected float32"):
        nb.bias_add(x.astype(np.float64), b6, x.copy())
    with pytest.raises(ValueError, match=r"bias_add: inp must be 2-D \(N, C\), got shape \(24,\)"):
        nb.bias_add(x.reshape(-1), b6, x.copy())
    with pytest.raises(TypeError, match="bias_add: bias must be an array"):
        nb.bias_add(x, [0.0] * 6, x.copy())
    with pytest.raises(ValueError, match="bias_add: out must be C-contiguous"):
        nb.bias_add(x, b6, np.zeros((6, 4), f32).T)
    # half
    with pytest.raises(ValueError, match="bias_gelu_forward: out is uint16 .* but half=None"):
        nb.bias_gelu_forward(x, b6, x.copy(), np.zeros((4, 6), u16))
    with pytest.raises(ValueError, match=r"bias_gelu_forward: half='bf8' is not one of None"):
        nb.bias_gelu_forward(x, b6, x.copy(), np.zeros((4, 6), u16), half="bf8")
    with pytest.raises(ValueError, match="bias_gelu_forward: half='fp16' writes 16-bit bits: out must be uint16"):
        nb.bias_gelu_forward(x, b6, x.copy(), x.copy(), half="fp16")
    with pytest.raises(TypeError, match="bias_gelu_forward: out has dtype float16, expected uint16"):
        nb.bias_gelu_forward(x, b6, x.copy(), np.zeros((4, 6), np.float16), half="fp16")
    with pytest.raises(ValueError, match=r"bias_gelu_forward: pre has shape \(4, 5\), expected \(4, 6\)"):
        nb.bias_gelu_forward(x, b6, np.zeros((4, 5), f32), x.copy())
    # split / merge
    qkv = np.zeros((2 * 3, 3 * 8), f32)                    # B=2, T=3, nh=2, hs=4: C = 8, ld = 24
    with pytest.raises(ValueError, match=r"split_heads: col0 \+ C = 17 \+ 8 = 25 is past the row width ld = 24"):
        nb.split_heads(qkv, 17, np.zeros((4, 3, 4), f32), 2, 3, 2)
    with pytest.raises(ValueError, match=r"split_heads: out has shape \(4, 2, 4\), expected \(4, 3, 4\)"):
        nb.split_heads(qkv, 0, np.zeros((4, 2, 4), f32), 2, 3, 2)
    with pytest.raises(ValueError, match=r"split_heads: inp has shape \(6, 24\), expected \(8, 24\)"):
        nb.split_heads(qkv, 0, np.zeros((4, 4, 4), f32), 2, 4, 2)
    with pytest.raises(ValueError, match=r"split_heads: bias has shape \(24,\), expected \(8,\)"):
        nb.split_heads(qkv, 0, np.zeros((4, 3, 4), f32), 2, 3, 2, bias=np.zeros(24, f32))
    with pytest.raises(ValueError, match="split_heads: out is uint16 .* but half=None"):
        nb.split_heads(qkv, 0, np.zeros((4, 3, 4), u16), 2, 3, 2)
    with pytest.raises(ValueError, match=r"split_heads: out must be 3-D \(B\*nh, T, hs\)"):
        nb.split_heads(qkv, 0, np.zeros((4, 12), f32), 2, 3, 2)
    with pytest.raises(ValueError, match="split_heads: col0=-1 must be >= 0"):
        nb.split_heads(qkv, -1, np.zeros((4, 3, 4), f32), 2, 3, 2)
    with pytest.raises(TypeError, match="split_heads: nh must be an int"):
        nb.split_heads(qkv, 0, np.zeros((4, 3, 4), f32), 2, 3, 2.0)
    with pytest.raises(ValueError, match=r"merge_heads: col0 \+ C = 20 \+ 8 = 28 is past the row width ld = 24"):
        nb.merge_heads(np.zeros((4, 3, 4), f32), qkv, 20, 2, 3, 2)
    with pytest.raises(ValueError, match=r"merge_heads: half='half' is not one of"):
        nb.merge_heads(np.zeros((4, 3, 4), f32), qkv, 0, 2, 3, 2, half="half")
    with pytest.raises(TypeError, match="merge_heads: inp has dtype uint16, expected float32"):
        nb.merge_heads(np.zeros((4, 3, 4), u16), qkv, 0, 2, 3, 2)
    # colsum
    with pytest.raises(ValueError, match="colsum_convert: out is given: pass half='bf16' or half='fp16'"):
        nb.colsum_convert(x, b6.copy(), out=np.zeros((4, 6), u16))
    with pytest.raises(ValueError, match="colsum_convert: half='bf16' but out is None"):
        nb.colsum_convert(x, b6.copy(), half="bf16")
    with pytest.raises(ValueError, match=r"colsum_convert: colsum has shape \(4,\), expected \(6,\)"):
        nb.colsum_convert(x, np.zeros(4, f32))
    with pytest.raises(ValueError, match="colsum_convert: half='fp16' writes 16-bit bits: out must be uint16"):
        nb.colsum_convert(x, b6.copy(), out=x.copy(), half="fp16")
    # layernorm_forward_half
    m = np.zeros(4, f32)
    with pytest.raises(ValueError, match="layernorm_forward_half: half=None must be 'bf16' or 'fp16'"):
        nb.layernorm_forward_half(x, b6, b6, np.zeros((4, 6), u16), m, m.copy(), None)
    with pytest.raises(TypeError, match="layernorm_forward_half: out has dtype int16, expected uint16"):
        nb.layernorm_forward_half(x, b6, b6, np.zeros((4, 6), np.int16), m, m.copy(), "bf16")
    with pytest.raises(ValueError, match=r"layernorm_forward_half: rstd has shape \(3,\), expected \(4,\)"):
        nb.layernorm_forward_half(x, b6, b6, np.zeros((4, 6), u16), m, np.zeros(3, f32), "bf16")
    # launch settings
    with pytest.raises(ValueError, match="bias_add: version='v2' is not one of v1"):
        nb.bias_add(x, b6, x.copy(), version="v2")
    with pytest.raises(ValueError, match="colsum_convert: gelu_of is given but out is None"):
        nb.colsum_convert(x, b6.copy(), gelu_of=x, gelu_bias=b6)
    with pytest.raises(ValueError, match="colsum_convert: give gelu_of and gelu_bias together"):
        nb.colsum_convert(x, b6.copy(), out=np.zeros((4, 6), u16), half="bf16", gelu_of=x)
    with pytest.raises(ValueError, match=r"colsum_convert: gelu_of has shape \(4, 5\), expected \(4, 6\)"):
        nb.colsum_convert(x, b6.copy(), out=np.zeros((4, 6), u16), half="bf16", gelu_of=np.zeros((4, 5), f32),
                          gelu_bias=b6)
    with pytest.raises(ValueError, match=r"colsum_convert: gelu_bias has shape \(5,\), expected \(6,\)"):
        nb.colsum_convert(x, b6.copy(), out=np.zeros((4, 6), u16), half="bf16", gelu_of=x, gelu_bias=b6[:5])
    with pytest.raises(ValueError, match=r"colsum_convert: threads=0 must be in \[1, 1024\]"):
        nb.colsum_convert(x, b6.copy(), threads=0)


def test_hip_launchers_check_arguments_without_a_gpu():
    """The HIP launchers share the checks (cupy=True): NumPy arrays are refused before any import of cupy."""
    from gpullm_lessons.backends.hip import fused as hf
    x = np.zeros((4, 6), np.float32)
    b6 = np.zeros(6, np.float32)
    with pytest.raises(TypeError, match="bias_add: inp must be a CuPy array"):
        hf.bias_add(x, b6, x.copy())
    with pytest.raises(ValueError, match="colsum_convert: out is given: pass half="):
        hf.colsum_convert(x, b6, out=np.zeros((4, 6), np.uint16))
    with pytest.raises(ValueError, match="bias_gelu_forward: half='bf8' is not one of"):
        hf.bias_gelu_forward(x, b6, x, np.zeros((4, 6), np.uint16), half="bf8")
    with pytest.raises(TypeError, match="split_heads: inp must be a CuPy array"):
        hf.split_heads(np.zeros((6, 24), np.float32), 0, np.zeros((4, 3, 4), np.float32), 2, 3, 2)
    with pytest.raises(ValueError, match="layernorm_forward_half: half=None must be 'bf16' or 'fp16'"):
        hf.layernorm_forward_half(x, b6, b6, np.zeros((4, 6), np.uint16), b6[:4], b6[:4], None)


def test_empty_inputs_launch_nothing():
    e = np.zeros((0, 6), np.float32)
    nb.bias_add(e, np.zeros(6, np.float32), e.copy())
    nb.bias_gelu_forward(e, np.zeros(6, np.float32), e.copy(), e.copy())
    nb.split_heads(np.zeros((0, 12), np.float32), 0, np.zeros((0, 3, 2), np.float32), 0, 3, 2)
    nb.merge_heads(np.zeros((0, 3, 2), np.float32), np.zeros((0, 12), np.float32), 0, 0, 3, 2)
    nb.layernorm_forward_half(e, np.zeros(6, np.float32), np.zeros(6, np.float32), np.zeros((0, 6), np.uint16),
                              np.zeros(0, np.float32), np.zeros(0, np.float32), "fp16")


# ---- (c) registration and sources -------------------------------------------------------------------------------

def test_modules_list_their_launchers_and_backends_gather_them():
    from gpullm_lessons.backends import hip, numba
    from gpullm_lessons.backends.hip import fused as hip_fused
    names = {"bias_add", "bias_gelu_forward", "gelu_half", "split_heads", "merge_heads", "colsum_convert",
             "layernorm_forward_half"}
    assert set(nb.LAUNCHERS) == names == set(hip_fused.LAUNCHERS)
    assert names <= set(numba.__all__) and names <= set(hip.__all__)
    import inspect
    for name in names:   # identical signatures in both backends
        assert inspect.signature(getattr(nb, name)) == inspect.signature(getattr(hip_fused, name)), name
    assert set(nb.KERNELS) == set(nb.SIGNATURES) and not nb.GPU_ONLY
    assert all(k in nb.__doc__ for k in nb.KERNELS)


def test_rounding_is_shared_not_copied():
    """fused.cu takes the rounding from half.h (as convert.cu), fused.py from convert.py's device functions."""
    from gpullm_lessons.runtime import hip
    from gpullm_lessons.kernels.numba import convert
    src = hip.source_path("fused").read_text()
    assert '#include "half.h"' in src and "0x7FC0" not in src
    assert '#include "half.h"' in hip.source_path("convert").read_text()
    assert nb.f32_to_half_bits is convert.f32_to_half_bits
    text = hip.expanded_source("fused")
    assert text.count("f32_to_bf16_bits(float x)") == 1


def test_hip_entry_points_exist_for_every_launch():
    """Every kernel name the HIP launchers build is an extern "C" entry point of fused.cu."""
    import re

    from gpullm_lessons.runtime import hip
    from gpullm_lessons.backends.hip import fused as hf
    entries = set(re.findall(r'extern "C" __global__ void (\w+)', hip.expanded_source("fused")))
    entries |= set(re.findall(r'extern "C" __global__ void (\w+)', hip.expand_macros(hip.expanded_source("fused"))))
    macro = hip.source_path("fused").read_text()
    for op in ("bias_gelu_forward_v1", "split_heads_v1", "split_heads_bias_v1", "merge_heads_v1"):
        assert f"{op}_##SUFFIX" in macro, op
        entries |= {f"{op}_{s}" for s in hf.SUFFIX.values()}
    for op in ("bias_gelu_forward_v1_hpre", "gelu_half_v1"):   # half formats only
        assert f"{op}_##SUFFIX" in macro, op
        entries |= {f"{op}_{s}" for s in ("bf16", "f16")}
    needed = {"bias_add_v1", "bias_add_res_v1", "colsum_partials_v1", "colsum_reduce_v1", "colsum_partials_v1_bf16",
              "colsum_partials_v1_f16", "colsum_partials_v1_gelu_bf16", "colsum_partials_v1_gelu_f16",
              "layernorm_forward_half_v1_bf16", "layernorm_forward_half_v1_f16"}
    needed |= {f"colsum_partials_v1{x4}_gelu_hpre_{h}{s}" for x4 in ("", "_x4") for h in ("", "hin_")
               for s in ("bf16", "f16")}
    assert needed <= entries, needed - entries


def test_hip_colsum_chunking_depends_on_the_size_only():
    from gpullm_lessons.backends.hip.fused import colsum_chunking
    for N, C in ((16384, 768), (1, 1), (0, 5), (100_003, 3072), (7, 50257)):
        chunks, rows = colsum_chunking(N, C)
        assert chunks >= 1 and rows >= 1 and chunks * rows >= N and (chunks - 1) * rows < max(N, 1)
        assert chunks <= 65535


# ---- (d) GPU: both backends at the engine's sizes ----------------------------------------------------------------

def gpu_backends():
    pytest.importorskip("cupy")
    out = [("hip", hip_module())]
    if device.numba_on_gpu():
        out.append(("numba", nb))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("half", HALVES)
def test_gpu_bias_add_and_gelu_at_engine_size(half):
    import cupy as cp
    rng = np.random.default_rng()
    N, C = 16384, 768
    inp, bias, res = rand(rng, N, C), rand(rng, C), rand(rng, N, C)
    for name, mod in gpu_backends():
        out = cp.full((N, C), cp.nan, cp.float32)
        mod.bias_add(cp.asarray(inp), cp.asarray(bias), out, res=cp.asarray(res))
        assert_out(out, inp + bias + res, None)
        a = cp.asarray(inp)
        mod.bias_add(a, cp.asarray(bias), a)                  # in place
        assert_out(a, inp + bias, None)
        pre = cp.asarray(inp)
        got = empty_out((N, C), half, "cupy")
        mod.bias_gelu_forward(pre, cp.asarray(bias), pre, got, half=half)   # in place: pre is inp
        np.testing.assert_array_equal(pre.get(), inp + bias, err_msg=name)
        f32 = cp.full((N, C), cp.nan, cp.float32)
        mod.bias_gelu_forward(cp.asarray(inp), cp.asarray(bias), cp.empty((N, C), cp.float32), f32)
        np.testing.assert_allclose(f32.get(), gelu64(inp + bias), rtol=1e-5,
                                   atol=1e-6 * float(np.abs(inp + bias).max()), err_msg=name)
        if half is not None:
            assert_out(got, f32.get(), half)
        a = cp.asarray(inp)
        nopre = empty_out((N, C), half, "cupy")
        mod.bias_gelu_forward(a, cp.asarray(bias), None, nopre, half=half)  # pre not written: inp unchanged
        np.testing.assert_array_equal(a.get(), inp, err_msg=name)
        np.testing.assert_array_equal(nopre.get(), (got if half is not None else f32).get(), err_msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("half", HALVES)
def test_gpu_split_and_merge_at_engine_size(half):
    import cupy as cp
    rng = np.random.default_rng()
    B, T, nh, C = 8, 2048, 12, 768
    hs = C // nh
    qkv, bias = rand(rng, B * T, 3 * C), rand(rng, C)
    for name, mod in gpu_backends():
        d_qkv = cp.asarray(qkv)
        for i in range(3):
            out = empty_out((B * nh, T, hs), half, "cupy")
            mod.split_heads(d_qkv, i * C, out, B, T, nh, bias=cp.asarray(bias) if i == 0 else None, half=half)
            part = qkv[:, i * C:(i + 1) * C] + bias if i == 0 else qkv[:, i * C:(i + 1) * C].copy()
            assert_out(out, heads(part, B, T, nh), half, rtol=0)
        y = rand(rng, B * nh, T, hs)
        before = to_half(rand(rng, B * T, 3 * C), half)
        out = cp.asarray(before)
        mod.merge_heads(cp.asarray(y), out, C, B, T, nh, half=half)
        got = out.get()
        merged = y.reshape(B, nh, T, hs).transpose(0, 2, 1, 3).reshape(B * T, C)
        assert_out(got[:, C:2 * C], merged, half, rtol=0)
        np.testing.assert_array_equal(got[:, :C], before[:, :C], err_msg=name)
        np.testing.assert_array_equal(got[:, 2 * C:], before[:, 2 * C:], err_msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("threads", [32, 256, 1024])
@pytest.mark.parametrize("half", HALVES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_gpu_hip_split_one_head_x4_is_v1(threads, half, with_bias):
    """split_heads with nh = 1 (the engine's bias + rounding pass over qkv before flash) takes four columns per thread
    where the rows allow it: the same values as the one-column kernel (rows 4 bytes off a boundary) and NumPy's;
    awkward widths (hs = 1156 is not a multiple of the block's 4 * 32 columns), a column offset, every row written."""
    import cupy as cp
    hf = hip_module()
    rng = np.random.default_rng()
    B, T, hs, col0, ld = 3, 67, 1156, 8, 1180
    inp, bias = rand(rng, B * T, ld), rand(rng, hs)
    # no bias: a copy (adding 0.0 would turn an input's -0.0 into +0.0, which the kernel rightly keeps as -0.0)
    want = inp[:, col0:col0 + hs] + bias if with_bias else inp[:, col0:col0 + hs].copy()

    def call(offset):
        buf = cp.zeros(B * T * ld + 4, cp.float32)
        x = buf[offset:offset + B * T * ld].reshape(B * T, ld)
        x[...] = cp.asarray(inp)
        out = empty_out((B, T, hs), half, "cupy")
        hf.split_heads(x, col0, out, B, T, 1, bias=cp.asarray(bias) if with_bias else None, half=half,
                       threads=threads)
        return out.get()

    x4, v1 = call(0), call(1)
    np.testing.assert_array_equal(x4, v1)
    assert_out(x4.reshape(B * T, hs), want, half, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("threads", [32, 96, 256, 1024])
@pytest.mark.parametrize("half", [None, "bf16"])
def test_gpu_hip_split_merge_awkward_sizes_and_blocks(threads, half):
    import cupy as cp
    hf = hip_module()
    rng = np.random.default_rng()
    B, T, nh, hs = 5, 201, 5, 20                 # C = 100: block columns wrap across heads at every block shape
    C, ld = nh * hs, 3 * nh * hs + 7
    inp = rand(rng, B * T, ld)
    out = empty_out((B * nh, T, hs), half, "cupy")
    hf.split_heads(cp.asarray(inp), 2 * C + 3, out, B, T, nh, half=half, threads=threads)
    assert_out(out, heads(inp[:, 2 * C + 3:3 * C + 3], B, T, nh), half, rtol=0)
    y = rand(rng, B * nh, T, hs)
    before = to_half(rand(rng, B * T, ld), half)
    o = cp.asarray(before)
    hf.merge_heads(cp.asarray(y), o, 5, B, T, nh, half=half, threads=threads)
    got = o.get()
    assert_out(got[:, 5:5 + C], y.reshape(B, nh, T, hs).transpose(0, 2, 1, 3).reshape(B * T, C), half, rtol=0)
    np.testing.assert_array_equal(got[:, :5], before[:, :5])
    np.testing.assert_array_equal(got[:, 5 + C:], before[:, 5 + C:])


@pytest.mark.gpu
@pytest.mark.parametrize("half", HALVES)
@pytest.mark.parametrize("N, C", [(16384, 768), (16384, 3072), (1001, 33)])
def test_gpu_colsum_convert(half, N, C):
    import cupy as cp
    rng = np.random.default_rng()
    inp = rand(rng, N, C)
    expected = inp.astype(np.float64).sum(axis=0)
    scale = np.abs(inp).astype(np.float64).sum(axis=0)
    for name, mod in gpu_backends():
        d = cp.asarray(inp)
        sums = []
        for _ in range(2):
            colsum = cp.full(C, cp.nan, cp.float32)
            out = None if half is None else empty_out((N, C), half, "cupy")
            mod.colsum_convert(d, colsum, out=out, half=half)
            sums.append(colsum.get())
            if out is not None:
                assert_out(out, inp, half)
        assert np.all(np.abs(sums[0] - expected) <= 1e-5 * scale), name
        np.testing.assert_array_equal(sums[0].view(np.uint32), sums[1].view(np.uint32), err_msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("half", HALVES)
@pytest.mark.parametrize("gelu", [False, True])
def test_gpu_hip_colsum_x4_is_v1_bit_for_bit(half, gelu):
    """HIP's colsum_convert takes four columns per thread where C % 4 == 0 and the rows are 16-byte aligned; the
    same call on rows 4 bytes off a boundary runs the one-column kernel: the sums and the half copy are the same
    bits."""
    import cupy as cp
    if gelu and half is None:
        pytest.skip("the fused GELU backward writes half only")
    hf = hip_module()
    rng = np.random.default_rng()
    N, C = 1003, 772
    dgelu, pre, b = rand(rng, N, C), (rand(rng, N, C) * 3).astype(np.float32), rand(rng, C)

    def call(offset):
        bufs = [cp.zeros(N * C + 4, cp.float32) for _ in range(2)]
        d, p = (b[offset:offset + N * C].reshape(N, C) for b in bufs)
        d[...], p[...] = cp.asarray(dgelu), cp.asarray(pre)
        colsum = cp.full(C, cp.nan, cp.float32)
        out = None if half is None else empty_out((N, C), half, "cupy")
        gb = cp.asarray(b) if gelu else None
        hf.colsum_convert(d, colsum, out=out, half=half, gelu_of=p if gelu else None, gelu_bias=gb)
        return colsum.get(), None if out is None else out.get()

    (s4, o4), (s1, o1) = call(0), call(1)
    np.testing.assert_array_equal(s4.view(np.uint32), s1.view(np.uint32))
    if half is not None:
        np.testing.assert_array_equal(o4, o1)
    want = dgelu.astype(np.float64) * (gelu_grad64(pre + b) if gelu else 1.0)
    scale = np.abs(want).sum(axis=0) + 0.1 * np.abs(dgelu).sum(axis=0)
    assert np.all(np.abs(s4 - want.sum(axis=0)) <= 1e-5 * scale)


@pytest.mark.gpu
@pytest.mark.parametrize("half", ["bf16", "fp16"])
@pytest.mark.parametrize("N, C", [(16384, 3072), (1001, 33)])
def test_gpu_colsum_convert_with_gelu(half, N, C):
    """The fused GELU backward on each GPU backend: the bits of that backend's gelu_backward then colsum_convert."""
    import cupy as cp
    rng = np.random.default_rng()
    dgelu, fc, b = rand(rng, N, C), (rand(rng, N, C) * 3).astype(np.float32), rand(rng, C)
    pre = fc + b
    want = dgelu.astype(np.float64) * gelu_grad64(pre)
    scale = np.abs(want).sum(axis=0) + 0.1 * np.abs(dgelu).sum(axis=0)  # float32 gelu' is within ~1e-6 absolute
    from gpullm_lessons.backends import hip as hip_backend, numba as numba_backend
    for name, mod in gpu_backends():
        gelu_backward = (hip_backend if name == "hip" else numba_backend).gelu_backward
        d, p = cp.asarray(dgelu), cp.asarray(pre)
        colsum, out = cp.full(C, cp.nan, cp.float32), empty_out((N, C), half, "cupy")
        mod.colsum_convert(d, colsum, out=out, half=half, gelu_of=cp.asarray(fc), gelu_bias=cp.asarray(b))
        dfc = cp.full((N, C), cp.nan, cp.float32)
        gelu_backward(d.reshape(-1), p.reshape(-1), dfc.reshape(-1))
        colsum2, out2 = cp.full(C, cp.nan, cp.float32), empty_out((N, C), half, "cupy")
        mod.colsum_convert(dfc, colsum2, out=out2, half=half)
        np.testing.assert_array_equal(out.get(), out2.get(), err_msg=name)
        np.testing.assert_array_equal(colsum.get().view(np.uint32), colsum2.get().view(np.uint32), err_msg=name)
        assert np.all(np.abs(colsum.get() - want.sum(axis=0)) <= 1e-5 * scale), name


@pytest.mark.gpu
@pytest.mark.parametrize("half", ["bf16", "fp16"])
@pytest.mark.parametrize("N, C, offset", [(16384, 3072, 0), (1003, 772, 1), (1001, 33, 0)],
                         ids=["x4", "x4-odd", "C33"])
def test_gpu_colsum_convert_reads_a_half_gelu_gradient(half, N, C, offset):
    """inp uint16 with the half pre on each GPU backend: the bits of that backend's float32 call on the same values
    (HIP: the _hin entry points, x4 on 8-byte rows, the one-column kernel 2 bytes off), and the float64 chain rule."""
    import cupy as cp
    rng = np.random.default_rng()
    dgelu, fc = rand(rng, N, C), (rand(rng, N, C) * 3).astype(np.float32)
    bits, pre = to_half(dgelu, half), to_half(fc, half)
    values = from_half(bits, half)
    want = values.astype(np.float64) * gelu_grad64(from_half(pre, half))
    scale = np.abs(want).sum(axis=0) + 0.1 * np.abs(values).sum(axis=0)
    for name, mod in gpu_backends():
        buf = cp.zeros(N * C + offset, cp.uint16)
        d = buf[offset:].reshape(N, C)
        d[...] = cp.asarray(bits)
        colsum, out = cp.full(C, cp.nan, cp.float32), empty_out((N, C), half, "cupy")
        mod.colsum_convert(d, colsum, out=out, half=half, gelu_of=cp.asarray(pre))
        colsum2, out2 = cp.full(C, cp.nan, cp.float32), empty_out((N, C), half, "cupy")
        mod.colsum_convert(cp.asarray(values), colsum2, out=out2, half=half, gelu_of=cp.asarray(pre))
        np.testing.assert_array_equal(out.get(), out2.get(), err_msg=name)
        np.testing.assert_array_equal(colsum.get().view(np.uint32), colsum2.get().view(np.uint32), err_msg=name)
        assert np.all(np.abs(colsum.get() - want.sum(axis=0)) <= 1e-5 * scale), name


@pytest.mark.gpu
@pytest.mark.parametrize("half", ["bf16", "fp16"])
@pytest.mark.parametrize("N, C", [(16384, 3072), (1001, 33)])
def test_gpu_half_gelu_input(half, N, C):
    """The engine's half GELU input on each GPU backend: pre = the rounding of inp + bias (bit-exact: one float32 add),
    out = the half of that backend's float32 GELU of the rounded pre (one step of a half ulp at most, see
    assert_half_close), gelu_half(pre) = out bit for bit, and the fused backward from the half pre = the float32 path
    given the rounded values and a zero bias, bit for bit; HIP's x4 path (8-byte loads of pre) = its one-column one."""
    import cupy as cp
    rng = np.random.default_rng()
    inp, bias, dgelu = (rand(rng, N, C) * 3).astype(np.float32), rand(rng, C), rand(rng, N, C)
    want_pre = to_half(inp + bias, half)
    zeros = cp.zeros(C, cp.float32)
    for name, mod in gpu_backends():
        pre, out = empty_out((N, C), half, "cupy"), empty_out((N, C), half, "cupy")
        mod.bias_gelu_forward(cp.asarray(inp), cp.asarray(bias), pre, out, half=half)
        np.testing.assert_array_equal(pre.get(), want_pre, err_msg=name)
        x = cp.asarray(from_half(want_pre, half))
        f32 = cp.full((N, C), cp.nan, cp.float32)
        mod.bias_gelu_forward(x, zeros, None, f32)
        assert_out(out, f32.get(), half)
        again = empty_out((N, C), half, "cupy")
        mod.gelu_half(pre, again, half)
        np.testing.assert_array_equal(again.get(), out.get(), err_msg=name)
        d = cp.asarray(dgelu)
        colsum, dfc = cp.full(C, cp.nan, cp.float32), empty_out((N, C), half, "cupy")
        mod.colsum_convert(d, colsum, out=dfc, half=half, gelu_of=pre)
        colsum2, dfc2 = cp.full(C, cp.nan, cp.float32), empty_out((N, C), half, "cupy")
        mod.colsum_convert(d, colsum2, out=dfc2, half=half, gelu_of=x, gelu_bias=zeros)
        np.testing.assert_array_equal(dfc.get(), dfc2.get(), err_msg=name)
        np.testing.assert_array_equal(colsum.get().view(np.uint32), colsum2.get().view(np.uint32), err_msg=name)
        if name == "hip" and C % 4 == 0:   # pre one element (2 bytes) off an 8-byte boundary: the one-column kernel
            buf = cp.zeros(N * C + 4, cp.uint16)
            p1 = buf[1:1 + N * C].reshape(N, C)
            p1[...] = pre
            colsum1, dfc1 = cp.full(C, cp.nan, cp.float32), empty_out((N, C), half, "cupy")
            mod.colsum_convert(d, colsum1, out=dfc1, half=half, gelu_of=p1)
            np.testing.assert_array_equal(dfc1.get(), dfc.get())
            np.testing.assert_array_equal(colsum1.get().view(np.uint32), colsum.get().view(np.uint32))
        want = dgelu.astype(np.float64) * gelu_grad64(from_half(want_pre, half))
        scale = np.abs(want).sum(axis=0) + 0.1 * np.abs(dgelu).sum(axis=0)
        assert np.all(np.abs(colsum.get() - want.sum(axis=0)) <= 1e-5 * scale), name


@pytest.mark.gpu
@pytest.mark.parametrize("half", ["bf16", "fp16"])
@pytest.mark.parametrize("N, C", [(16384, 768), (1001, 33)])
def test_gpu_layernorm_forward_half(half, N, C):
    import cupy as cp
    rng = np.random.default_rng()
    inp = (rand(rng, N, C) * 2 + 0.5).astype(np.float32)
    w, b = rand(rng, C), rand(rng, C)
    ref, m, r = layernorm64(inp, w, b)
    for name, mod in gpu_backends():
        out = empty_out((N, C), half, "cupy")
        mean, rstd = cp.full(N, cp.nan, cp.float32), cp.full(N, cp.nan, cp.float32)
        mod.layernorm_forward_half(cp.asarray(inp), cp.asarray(w), cp.asarray(b), out, mean, rstd, half)
        np.testing.assert_allclose(mean.get(), m, rtol=1e-5, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(rstd.get(), r, rtol=1e-5, err_msg=name)
        check_half_close(out, ref, half)


@pytest.mark.gpu
def test_gpu_hip_rejects_numpy_and_bad_blocks():
    import cupy as cp
    hf = hip_module()
    x = cp.zeros((4, 64), cp.float32)
    with pytest.raises(TypeError, match="bias_add: bias must be a CuPy array"):
        hf.bias_add(x, np.zeros(64, np.float32), x)
    m = cp.zeros(4, cp.float32)
    with pytest.raises(ValueError, match="threads=96 must be a multiple of 64"):
        hf.layernorm_forward_half(x, x[0], x[0], cp.zeros((4, 64), cp.uint16), m, m, "bf16", threads=96)
