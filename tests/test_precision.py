"""Mixed precision: the NumPy reference (gpullm_lessons/model/precision.py) and the conversion / inf-count kernels
(kernels/numba/convert.py, kernels/hip/convert.cu through gpullm_lessons/backends/hip/convert.py).

Conversions must be bit-exact with ml_dtypes.bfloat16 / NumPy's float16 cast on fresh random bit patterns plus the
edge cases of rounding; the loss scaler must back off on inf and NaN, skip, and grow after N clean steps; a skipped
step must leave master weights, m, v and the step count untouched. Simulator (CI): a few hundred elements on a
capped grid. GPU (`make gpu-test`): both backends, ~10M elements, awkward sizes.
"""
import ml_dtypes
import numpy as np
import pytest

from gpullm_lessons import device
from gpullm_lessons.runtime.arrays import to_backend, to_numpy
from gpullm_lessons.kernels.numba import convert as nb
from gpullm_lessons.model.optim import AdamW
from gpullm_lessons.model.precision import (DynamicLossScaler, bf16_bits_to_f32, f32_to_bf16_bits, grads_finite,
                                      nonfinite_count, scaled_step)

needs_numba_gpu = pytest.mark.skipif(not device.numba_on_gpu(),
                                     reason=f"needs Numba on an NVIDIA GPU (this machine: {device.kind()})")

# float32 bit patterns at the edges of rounding (bf16: the low 16 bits; f16: 13 mantissa bits and the range)
SPECIAL_BITS = np.array([
    0x3F808000, 0x3F818000, 0x3F80C000, 0x3F807FFF, 0xBF808000, 0xBF818000,   # bf16 ties (even, odd), near ties
    0x7FC00000, 0xFFC00000, 0x7FC00001, 0xFFFFFFFF, 0x7F800001, 0xFF800001,   # NaN: quiet/signalling, both signs
    0x7FA00000, 0x7F800000, 0xFF800000,                                       # NaN with payload, +inf, -inf
    0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x7F7F7FFF,                           # max float (-> inf), tie at the top
    0x00000001, 0x80000001, 0x00400000, 0x007FFFFF, 0x807FFFFF, 0x00008000,   # subnormals (some round up)
    0x00000000, 0x80000000, 0x3F800000,                                       # zeros, 1.0
    0x477FE000, 0x477FEFFF, 0x477FF000, 0xC77FF000,                           # f16: max 65504, below/at the tie
    0x33800000, 0x33000000, 0x33000001, 0x387FC000, 0x38800000, 0x3F801000,   # f16: subnormal edges, 1+2^-11 tie
    0x3F803000,
], np.uint32)


def fresh_floats(rng, n):
    """n float32: uniformly random bit patterns (every class: NaN, inf, subnormal, huge) and normal-ish values,
    with the special values at random places."""
    bits = rng.integers(0, 2 ** 32, n, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    half = n // 2
    x[:half] = (rng.standard_normal(half) * 10.0 ** rng.uniform(-8, 8, half)).astype(np.float32)
    k = min(n, len(SPECIAL_BITS))
    x[rng.choice(n, k, replace=False)] = SPECIAL_BITS[:k].view(np.float32)
    return x


def want_bf16(x):
    with np.errstate(invalid="ignore", over="ignore"):
        return x.astype(ml_dtypes.bfloat16).view(np.uint16)


def want_f16(x):
    with np.errstate(invalid="ignore", over="ignore"):
        return x.astype(np.float16).view(np.uint16)


def assert_f16_equal(got, x):
    """Bit-exact with NumPy's float16 cast; signalling NaNs (quieted by F16C-built NumPys) only NaN with the sign."""
    bits = x.view(np.uint32)
    snan = ((bits & 0x7FFFFFFF) > 0x7F800000) & ((bits & 0x00400000) == 0)
    want = want_f16(x)
    np.testing.assert_array_equal(got[~snan], want[~snan])
    g = got[snan]
    assert np.all((g & 0x7C00) == 0x7C00) and np.all((g & 0x3FF) != 0)         # NaN
    np.testing.assert_array_equal(g >> 15, (bits[snan] >> 31).astype(np.uint16))   # sign kept


# ---- the NumPy reference --------------------------------------------------------------------------------------------

def test_f32_to_bf16_bits_is_bit_exact():
    rng = np.random.default_rng()
    x = fresh_floats(rng, 2_000_000)
    np.testing.assert_array_equal(f32_to_bf16_bits(x), want_bf16(x))
    s = SPECIAL_BITS.view(np.float32)
    np.testing.assert_array_equal(f32_to_bf16_bits(s), want_bf16(s))
    # spelled out: ties to even, max float to inf, NaN quiet with its sign
    got = f32_to_bf16_bits(np.array([0x3F808000, 0x3F818000, 0x7F7FFFFF, 0xFFC00001, 0x7F800001], np.uint32)
                           .view(np.float32))
    assert got.tolist() == [0x3F80, 0x3F82, 0x7F80, 0xFFC0, 0x7FC0]
    assert f32_to_bf16_bits(x.reshape(1000, 2000)).shape == (1000, 2000)


def test_bf16_bits_to_f32_every_pattern():
    bits = np.arange(2 ** 16, dtype=np.uint32).astype(np.uint16)   # all 65536 bfloat16 values
    want = bits.view(ml_dtypes.bfloat16).astype(np.float32).view(np.uint32)
    np.testing.assert_array_equal(bf16_bits_to_f32(bits).view(np.uint32), want)
    # round trip: bf16 -> f32 -> bf16 is the identity (NaNs become the quiet NaN with their sign)
    back = f32_to_bf16_bits(bf16_bits_to_f32(bits))
    nan = np.isnan(bits.view(ml_dtypes.bfloat16).astype(np.float32))
    np.testing.assert_array_equal(back[~nan], bits[~nan])


def test_truncation_is_not_rounding():
    # the comparison above can fail: dropping the low 16 bits (round toward zero) differs on ~half the values
    x = fresh_floats(np.random.default_rng(), 10_000)
    truncated = (x.view(np.uint32) >> 16).astype(np.uint16)
    assert np.mean(truncated != want_bf16(x)) > 0.2


def test_reference_validation():
    with pytest.raises(TypeError, match="x has dtype float64, expected float32"):
        f32_to_bf16_bits(np.zeros(3))
    with pytest.raises(TypeError, match="bits has dtype int32, expected uint16"):
        bf16_bits_to_f32(np.zeros(3, np.int32))


def test_grads_finite_and_count():
    g = np.ones(10, np.float32)
    assert grads_finite(g) and nonfinite_count(g) == 0
    for bad in (np.inf, -np.inf, np.nan):
        h = g.copy()
        h[3] = bad
        assert not grads_finite(h) and nonfinite_count(h) == 1


# ---- the loss scaler ------------------------------------------------------------------------------------------------

def test_loss_scaler_backs_off_on_inf_and_nan_and_skips():
    s = DynamicLossScaler(init_scale=1024.0, growth_interval=3)
    assert s.update(found_inf=True) is True and s.scale == 512.0
    assert s.update(found_inf=False) is False and s.scale == 512.0
    g = np.array([1.0, np.nan], np.float32)
    assert s.update(found_inf=not grads_finite(g)) is True and s.scale == 256.0
    assert s.skipped_steps == 2


def test_loss_scaler_grows_after_n_clean_steps_in_a_row():
    s = DynamicLossScaler(init_scale=8.0, growth_factor=2.0, growth_interval=3)
    assert [s.update(False) for _ in range(2)] == [False, False] and s.scale == 8.0
    assert s.update(False) is False and s.scale == 16.0             # the 3rd clean step in a row doubles it
    s.update(False), s.update(False)
    s.update(True)                                                   # an overflow halves and restarts the count
    assert s.scale == 8.0
    s.update(False), s.update(False)
    assert s.scale == 8.0                                            # 2 clean steps since the overflow, not 4
    s.update(False)
    assert s.scale == 16.0


def test_loss_scaler_min_scale_and_state_dict():
    s = DynamicLossScaler(init_scale=4.0, min_scale=1.0, growth_interval=5)
    for _ in range(5):
        assert s.update(True)
    assert s.scale == 1.0                                            # never below min_scale
    s.update(False)
    state = s.state_dict()
    t = DynamicLossScaler()
    t.load_state_dict(state)
    assert t.state_dict() == state
    for _ in range(4):
        s.update(False), t.update(False)
    assert s.scale == t.scale == 2.0


@pytest.mark.parametrize("kwargs, match", [
    (dict(init_scale=0.5), "init_scale must be >= min_scale"),
    (dict(growth_factor=1.0), "growth_factor must be > 1"),
    (dict(backoff_factor=1.0), r"backoff_factor must be in \(0, 1\)"),
    (dict(growth_interval=0), "growth_interval must be an int >= 1"),
    (dict(min_scale=0.0), "min_scale must be > 0"),
    (dict(init_scale=float("inf")), "init_scale must be a finite number"),
])
def test_loss_scaler_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DynamicLossScaler(**kwargs)


# ---- one mixed-precision step ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_skipped_step_leaves_everything_untouched_then_a_clean_step_updates(bad):
    rng = np.random.default_rng()
    n = 1000
    p0 = rng.standard_normal(n, dtype=np.float32)
    opt = AdamW(p0.copy(), lr=1e-2, weight_decay=0.1)
    scaler = DynamicLossScaler(init_scale=2.0 ** 10, growth_interval=2)
    opt.step(rng.standard_normal(n, dtype=np.float32))               # m, v, t not trivially zero
    before = (opt.params.copy(), opt.m.copy(), opt.v.copy(), opt.t)
    grads = rng.standard_normal(n, dtype=np.float32) * np.float32(scaler.scale)
    bf16 = np.full(n, 0xAAAA, np.uint16)
    for where in (0, n // 2, n - 1):                                 # one bad element, anywhere
        g = grads.copy()
        g[where] = bad
        scale = scaler.scale
        assert scaled_step(opt, g, scaler, bf16_out=bf16) is True
        assert scaler.scale == scale / 2
        np.testing.assert_array_equal(opt.params, before[0])
        np.testing.assert_array_equal(opt.m, before[1])
        np.testing.assert_array_equal(opt.v, before[2])
        assert opt.t == before[3]
        assert np.all(bf16 == 0xAAAA)
    # a clean step: exactly the AdamW step on the unscaled gradient
    ref = AdamW(before[0].copy(), lr=1e-2, weight_decay=0.1)
    ref.load_state_dict(dict(opt.state_dict()))
    g = grads * np.float32(scaler.scale / 2.0 ** 10)                 # scaled with the current scale
    assert scaled_step(opt, g, scaler, bf16_out=bf16) is False
    ref.step(g * np.float32(1.0 / scaler.scale))
    assert opt.t == before[3] + 1
    assert not np.array_equal(opt.params, before[0])
    np.testing.assert_array_equal(opt.params, ref.params)
    np.testing.assert_array_equal(opt.m, ref.m)
    np.testing.assert_array_equal(opt.v, ref.v)
    np.testing.assert_array_equal(bf16, want_bf16(opt.params))


def test_scaled_step_grows_the_scale_after_clean_steps():
    n = 10
    opt = AdamW(np.ones(n, np.float32), lr=1e-3)
    scaler = DynamicLossScaler(init_scale=2.0, growth_interval=2)
    for _ in range(2):
        assert scaled_step(opt, np.full(n, 0.5, np.float32), scaler) is False
    assert scaler.scale == 4.0 and opt.t == 2
    with pytest.raises(ValueError, match=r"scaled_grads has shape \(3,\), expected \(10,\)"):
        scaled_step(opt, np.zeros(3, np.float32), scaler)


# ---- the Numba kernels in the simulator -----------------------------------------------------------------------------

@pytest.fixture
def small_grid(monkeypatch):
    """The simulator runs every thread in Python: cap the grid at 2 blocks (the grid-stride loop covers the rest)."""
    monkeypatch.setattr(nb, "MAX_BLOCKS", 2)


def run_conversions(mod, arrays, n, rng, threads):
    """f32_to_bf16, f32_to_f16 (float16 and uint16 dst), bf16_to_f32 of `mod` on `arrays` arrays: bit-exact."""
    x = fresh_floats(rng, n)
    src = to_backend(x, arrays)
    dst = to_backend(np.full(n, 0xAAAA, np.uint16), arrays)
    mod.f32_to_bf16(src, dst, version="v1", threads=threads)
    np.testing.assert_array_equal(to_numpy(dst), want_bf16(x))
    for dtype in (np.float16, np.uint16):
        dst = to_backend(np.full(n, 0xAAAA, np.uint16).view(dtype), arrays)
        mod.f32_to_f16(src, dst, version="v1", threads=threads)
        assert_f16_equal(to_numpy(dst).view(np.uint16), x)
    bits = np.resize(rng.permutation(2 ** 16).astype(np.uint16), n)   # every bf16 pattern when n >= 65536
    dst = to_backend(np.full(n, np.nan, np.float32), arrays)
    mod.bf16_to_f32(to_backend(bits, arrays), dst, version="v1", threads=threads)
    np.testing.assert_array_equal(to_numpy(dst).view(np.uint32), bits.astype(np.uint32) << 16)


def run_counts(mod, arrays, n, rng, threads):
    """nonfinite_count finds a single inf/NaN at the first, middle and last element; 0 on finite data."""
    x = rng.standard_normal(n, dtype=np.float32)
    x[rng.random(n) < 0.1] = np.float32(3e38)                 # huge but finite
    out = to_backend(np.full(1, 12345, np.int32), arrays)     # poisoned: the launcher must zero it
    flat = to_backend(x, arrays)
    mod.nonfinite_count(flat, out, version="v1", threads=threads)
    assert int(to_numpy(out)[0]) == 0
    for where in sorted({0, n // 2, n - 1}):
        for bad in (np.inf, -np.inf, np.nan, -np.nan):
            y = x.copy()
            y[where] = bad
            mod.nonfinite_count(to_backend(y, arrays), out, version="v1", threads=threads)
            assert int(to_numpy(out)[0]) == 1, (where, bad)
    y = x.copy()
    y[rng.random(n) < 0.3] = np.nan
    y[rng.random(n) < 0.1] = -np.inf
    mod.nonfinite_count(to_backend(y, arrays), out, version="v1", threads=threads)
    assert int(to_numpy(out)[0]) == nonfinite_count(y)


@pytest.mark.parametrize("n, threads", [(1, 32), (333, 32), (3001, 64)])
def test_numba_conversions_bit_exact(n, threads, small_grid):
    run_conversions(nb, "numba", n, np.random.default_rng(), threads)


@pytest.mark.parametrize("n, threads", [(1, 32), (257, 32), (1000, 64)])
def test_numba_nonfinite_count(n, threads, small_grid):
    run_counts(nb, "numba", n, np.random.default_rng(), threads)


def test_numba_on_numpy_arrays_and_bfloat16_dtype(small_grid):
    x = fresh_floats(np.random.default_rng(), 100)
    dst = np.zeros(100, ml_dtypes.bfloat16)
    nb.f32_to_bf16(x, dst, threads=32)
    np.testing.assert_array_equal(dst.view(np.uint16), want_bf16(x))
    back = np.zeros(100, np.float32)
    nb.bf16_to_f32(dst, back, threads=32)
    np.testing.assert_array_equal(back.view(np.uint32), dst.view(np.uint16).astype(np.uint32) << 16)
    nb.f32_to_bf16(np.zeros(0, np.float32), np.zeros(0, np.uint16))   # empty: nothing to do
    out = np.full(1, 5, np.int32)
    nb.nonfinite_count(np.zeros(0, np.float32), out)
    assert out[0] == 0


def test_count_without_zeroing_is_caught():
    # the kernel only adds: launched twice without the zeroing kernel, the count doubles
    x = np.array([1.0, np.inf, 2.0], np.float32)
    out = np.zeros(1, np.int32)
    for _ in range(2):
        nb.KERNELS["nonfinite_count_v1"][1, 32](x, out)
    assert out[0] == 2
    nb.nonfinite_count(x, out, threads=32)
    assert out[0] == 1


def test_count_with_nan_test_only_misses_inf():
    # a plausible wrong check, x != x, sees NaN but not inf: the exponent test sees both
    x = np.array([1.0, np.inf], np.float32)
    assert np.count_nonzero(x != x) == 0 and nonfinite_count(x) == 1


# ---- wrapper validation ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("call, exc, match", [
    (lambda: nb.f32_to_bf16(np.zeros(4), np.zeros(4, np.uint16)), TypeError,
     "f32_to_bf16: src has dtype float64, expected float32"),
    (lambda: nb.f32_to_bf16(np.zeros(4, np.float32), np.zeros(4, np.int16)), TypeError,
     "dst has dtype int16, expected uint16 or bfloat16"),
    (lambda: nb.f32_to_bf16(np.zeros(4, np.float32), np.zeros(5, np.uint16)), ValueError,
     r"dst has shape \(5,\), expected \(4,\)"),
    (lambda: nb.f32_to_bf16(np.zeros((2, 2), np.float32), np.zeros(4, np.uint16)), ValueError,
     r"src must be 1-D \(n,\), got shape \(2, 2\)"),
    (lambda: nb.bf16_to_f32(np.zeros(4, np.float32), np.zeros(4, np.float32)), TypeError,
     "bf16_to_f32: src has dtype float32, expected uint16 or bfloat16"),
    (lambda: nb.f32_to_f16(np.zeros(4, np.float32), np.zeros(4, np.float32)), TypeError,
     "dst has dtype float32, expected float16 or uint16"),
    (lambda: nb.f32_to_f16(np.zeros(8, np.float32)[::2], np.zeros(4, np.float16)), ValueError,
     "src must be C-contiguous"),
    (lambda: nb.f32_to_f16([0.0], np.zeros(1, np.float16)), TypeError, "src must be an array"),
    (lambda: nb.f32_to_f16(np.zeros(4, np.float32), np.zeros(4, np.float16), version="v2"), ValueError,
     "version='v2' is not one of v1"),
    (lambda: nb.f32_to_f16(np.zeros(4, np.float32), np.zeros(4, np.float16), threads=2048), ValueError,
     r"threads=2048 must be in \[1, 1024\]"),
    (lambda: nb.nonfinite_count(np.zeros(4, np.float32), np.zeros(1, np.int64)), TypeError,
     "nonfinite_count: out has dtype int64, expected int32"),
    (lambda: nb.nonfinite_count(np.zeros(4, np.float32), np.zeros(2, np.int32)), ValueError,
     r"out has shape \(2,\), expected \(1,\)"),
    (lambda: nb.nonfinite_count(np.zeros((2, 2), np.float32), np.zeros(1, np.int32)), ValueError,
     "flat must be 1-D"),
    (lambda: nb.nonfinite_count(np.zeros(4, np.float16), np.zeros(1, np.int32)), TypeError,
     "flat has dtype float16, expected float32"),
])
def test_wrapper_validation(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


# ---- GPU: both backends, large and awkward sizes --------------------------------------------------------------------

def hip_module():
    pytest.importorskip("cupy")
    from gpullm_lessons.backends.hip import convert as hip_convert
    return hip_convert


def backend(name):
    return (nb, "numba") if name == "numba" else (hip_module(), "cupy")


GPU_BACKENDS = [pytest.param("numba", marks=needs_numba_gpu), "hip"]


@pytest.mark.gpu
@pytest.mark.parametrize("name", GPU_BACKENDS)
@pytest.mark.parametrize("n, threads", [(10_000_019, 256), (1, 256), (255, 64), (4096 * 256 * 3 + 7, 1024)])
def test_gpu_conversions_bit_exact(name, n, threads):
    mod, arrays = backend(name)
    run_conversions(mod, arrays, n, np.random.default_rng(n), threads)


@pytest.mark.gpu
@pytest.mark.parametrize("name", GPU_BACKENDS)
@pytest.mark.parametrize("n, threads", [(10_000_019, 256), (1, 256), (4096 * 256 * 3 + 7, 128)])
def test_gpu_nonfinite_count(name, n, threads):
    mod, arrays = backend(name)
    run_counts(mod, arrays, n, np.random.default_rng(n), threads)


@pytest.mark.gpu
def test_gpu_hip_validation():
    import cupy as cp
    mod = hip_module()
    with pytest.raises(TypeError, match="src must be a CuPy array"):
        mod.f32_to_bf16(np.zeros(4, np.float32), cp.zeros(4, cp.uint16))
    with pytest.raises(ValueError, match=r"dst has shape \(5,\), expected \(4,\)"):
        mod.f32_to_f16(cp.zeros(4, cp.float32), cp.zeros(5, cp.float16))
    with pytest.raises(TypeError, match="out has dtype int64, expected int32"):
        mod.nonfinite_count(cp.zeros(4, cp.float32), cp.zeros(1, cp.int64))
