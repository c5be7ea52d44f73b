"""The AdamW step kernels (kernels/numba/adamw.py, kernels/hip/adamw.cu) against the reference optim.AdamW.

Every version runs 100 steps on fresh random gradients (a new lr each step, grad_scale, a decay table where some
tensors skip decay) and must match the reference to 1e-6 relative in float32 (params, m, v), with the gradient
zeroed after every step. Wrong variants (bias correction forgotten, decay on every tensor, grad_scale ignored,
gradient not zeroed) fail the same comparison. half_out must equal the float32 params rounded to float16 / bfloat16
bit-exactly (ml_dtypes). Simulator (CI): ~1100 parameters, a capped grid. GPU (`make gpu-test`): both backends,
10M parameters, awkward sizes.
"""
import math

import ml_dtypes
import numpy as np
import pytest

from gpullm_lessons import device
from gpullm_lessons.runtime.arrays import to_backend, to_numpy
from gpullm_lessons.kernels.numba import adamw as nb
from gpullm_lessons.model.optim import DECAY_NAMES, AdamW, decay_mask_for
from gpullm_lessons.model.params import GPTConfig, ParamBuffer

needs_numba_gpu = pytest.mark.skipif(not device.numba_on_gpu(),
                                     reason=f"needs Numba on an NVIDIA GPU (this machine: {device.kind()})")
TINY = GPTConfig(vocab_size=17, block_size=8, n_layer=1, n_head=2, d_model=8)   # ~1100 parameters, 16 tensors
HYPER = dict(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def hip_module():
    pytest.importorskip("cupy")
    from gpullm_lessons.backends.hip import adamw as hip_adamw
    return hip_adamw


@pytest.fixture
def small_grid(monkeypatch):
    """The simulator runs every thread in Python: cap the grid at 2 blocks (the grid-stride loop covers the rest)."""
    monkeypatch.setattr(nb, "MAX_BLOCKS", 2)
    monkeypatch.setattr(nb, "SIM_MAX_BLOCKS", 2)


def random_table(rng, n, k=16):
    """(bounds, flags, mask): k tensors of random lengths (some empty) over n elements, about half decaying."""
    cuts = np.sort(rng.integers(0, n + 1, k - 1))
    bounds = np.concatenate([[0], cuts, [n]]).astype(np.int64)
    flags = (np.arange(k) % 2 == 0).astype(np.uint8)
    rng.shuffle(flags)
    flags[0], flags[-1] = 1, 0   # both kinds present
    return bounds, flags, np.repeat(flags.astype(bool), np.diff(bounds))


def close(got, ref) -> bool:
    """1e-6 relative, with an absolute floor of 1e-6 x the tensor's largest |value|.

    The floor is needed on a GPU: the compiler contracts m = b1*m + (1-b1)*g into one FMA (one rounding where NumPy
    rounds twice). Where m cancels toward 0 after sign changes of g, that 1-ulp difference of the terms (~0.5) is a
    large relative error of the small result (measured on the H200: 2 of 10M elements of m at 1.3e-5 relative after
    100 steps, 7.5e-8 absolute). A wrong kernel (no bias correction, coupled decay, eps inside the sqrt) is off by
    1e-3..1e-1 of the largest value, far above this floor (tests below show each one caught)."""
    return bool(np.allclose(got, ref, rtol=1e-6, atol=1e-6 * max(float(np.abs(ref).max()), 1e-30)))


def run_against_reference(step_fn, arrays, n, table, mask, steps, seed=0, grad_scale=0.25, ref_scale=None,
                          ref_mask="same", expect_zeroed=True):
    """`steps` AdamW steps of step_fn(params, grads, m, v, lr, b1, b2, eps, wd, t, decay_bounds=, grad_scale=) on
    `arrays` arrays beside the reference; returns whether params, m, v all stay close (and grads are zeroed)."""
    rng = np.random.default_rng(seed)
    p0 = rng.standard_normal(n, dtype=np.float32)
    ref = AdamW(p0.copy(), lr=1e-2, betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                weight_decay=HYPER["weight_decay"], decay_mask=mask if ref_mask == "same" else ref_mask)
    p, m, v = (to_backend(a, arrays) for a in (p0, np.zeros(n, np.float32), np.zeros(n, np.float32)))
    ref_scale = grad_scale if ref_scale is None else ref_scale
    for t in range(1, steps + 1):
        lr = 1e-2 * (0.5 + 0.5 * math.cos(math.pi * t / steps))   # a new lr every step
        g = (rng.standard_normal(n, dtype=np.float32) * np.float32(2.0)).astype(np.float32)
        g[rng.random(n) < 0.01] = 0.0                              # some exact zeros (v stays tiny there)
        gd = to_backend(g, arrays)
        step_fn(p, gd, m, v, lr, HYPER["beta1"], HYPER["beta2"], HYPER["eps"], HYPER["weight_decay"], t,
                decay_bounds=table, grad_scale=grad_scale)
        ref.step(g * np.float32(ref_scale), lr=lr)
        if expect_zeroed and np.any(to_numpy(gd) != 0):
            return False
    return close(to_numpy(p), ref.params) and close(to_numpy(m), ref.m) and close(to_numpy(v), ref.v)


def tiny_table(arrays="numpy"):
    return nb.decay_table(ParamBuffer(TINY), arrays=arrays), decay_mask_for(TINY)


# ---- the decay table ---------------------------------------------------------------------------------------------

def test_decay_table_matches_decay_mask_for():
    (bounds, flags), mask = tiny_table()
    pb = ParamBuffer(TINY)
    assert bounds.dtype == np.int64 and flags.dtype == np.uint8
    assert len(bounds) == len(pb.names) + 1 and bounds[0] == 0 and bounds[-1] == pb.flat.size
    np.testing.assert_array_equal(np.repeat(flags.astype(bool), np.diff(bounds)), mask)
    assert {name for name, f in zip(pb.names, flags) if f} == set(DECAY_NAMES)
    b2, f2 = nb.decay_table(pb, decay_names=["wte"])
    assert f2.sum() == 1 and f2[pb.names.index("wte")] == 1
    with pytest.raises(ValueError, match="decay_names has names the buffer does not"):
        nb.decay_table(pb, decay_names=["nope"])


# ---- (a) simulator: every version matches the reference over 100 steps -------------------------------------------

@pytest.mark.parametrize("version", ["v1", "v2"])
def test_matches_reference_100_steps(version, small_grid):
    table, mask = tiny_table("numba")
    n = mask.size
    fn = lambda *a, **k: nb.adamw_step(*a, **k, version=version, threads=64)  # noqa: E731
    assert run_against_reference(fn, "numba", n, table, mask, steps=100)


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_random_table_no_table_and_awkward_n(version, small_grid):
    rng = np.random.default_rng(1)
    fn = lambda *a, **k: nb.adamw_step(*a, **k, version=version, threads=32)  # noqa: E731
    for n in (1, 37, 333):
        bounds, flags, mask = random_table(rng, n)
        assert run_against_reference(fn, "numba", n, (bounds, flags), mask, steps=5, seed=n)
    # decay_bounds=None: every element decays
    assert run_against_reference(fn, "numba", 100, None, None, steps=5, grad_scale=1.0)


def test_one_thread_covers_everything():
    # the grid-stride loop (and the table walk) of a single thread visits every element and every tensor
    table, mask = tiny_table()
    n = mask.size

    def one_thread(p, g, m, v, lr, b1, b2, eps, wd, t, decay_bounds, grad_scale):
        s = nb.host_scalars(lr, b1, b2, eps, wd, t, grad_scale)
        nb.KERNELS["v2"][1, 1](p, g, m, v, decay_bounds[0], decay_bounds[1], np.zeros(1, np.uint16), np.int32(0),
                               s["lr"], s["lr_wd"], s["beta1"], s["one_minus_beta1"], s["beta2"],
                               s["one_minus_beta2"], s["bias1"], s["bias2"], s["eps"], s["grad_scale"])
    assert run_against_reference(one_thread, "numpy", n, table, mask, steps=3)


# ---- (a) the comparison can fail: plausible wrong AdamWs are caught ---------------------------------------------

def _v2_with(**override):
    """The v2 kernel with some host scalars replaced (a plausible mistake in the launcher)."""
    def fn(p, g, m, v, lr, b1, b2, eps, wd, t, decay_bounds, grad_scale):
        s = dict(nb.host_scalars(lr, b1, b2, eps, wd, t, grad_scale), **override)
        nb.KERNELS["v2"][2, 64](p, g, m, v, decay_bounds[0], decay_bounds[1], np.zeros(1, np.uint16), np.int32(0),
                                s["lr"], s["lr_wd"], s["beta1"], s["one_minus_beta1"], s["beta2"],
                                s["one_minus_beta2"], s["bias1"], s["bias2"], s["eps"], s["grad_scale"])
    return fn


def test_forgotten_bias_correction_is_caught():
    table, mask = tiny_table()
    assert not run_against_reference(_v2_with(bias1=np.float32(1), bias2=np.float32(1)), "numpy", mask.size,
                                     table, mask, steps=10)


def test_decay_on_every_tensor_is_caught(small_grid):
    table, mask = tiny_table()
    fn = lambda *a, **k: nb.adamw_step(*a, **dict(k, decay_bounds=None), version="v2", threads=64)  # noqa: E731
    assert not run_against_reference(fn, "numpy", mask.size, table, mask, steps=10)


def test_ignored_grad_scale_is_caught(small_grid):
    table, mask = tiny_table()
    fn = lambda *a, **k: nb.adamw_step(*a, **dict(k, grad_scale=1.0), version="v2", threads=64)  # noqa: E731
    assert not run_against_reference(fn, "numpy", mask.size, table, mask, steps=10, grad_scale=1e-3)


def test_gradient_not_zeroed_is_caught(small_grid):
    table, mask = tiny_table()

    def no_zero(p, g, *rest, **k):
        g_copy = g.copy()
        nb.adamw_step(p, g_copy, *rest, **k, version="v2", threads=64)
    assert not run_against_reference(no_zero, "numpy", mask.size, table, mask, steps=2)


def test_the_same_run_passes_with_the_right_kernel():
    # the wrong-variant tests above differ from this one only in the mistake
    table, mask = tiny_table()
    assert run_against_reference(_v2_with(), "numpy", mask.size, table, mask, steps=10)


# ---- half-precision copy -------------------------------------------------------------------------------------------

def special_values(rng, n):
    """Random float32 plus the edge cases of rounding: ties (odd and even), NaN of both signs, infinities, the
    largest finite value (rounds to inf in bf16 and fp16), subnormals, zeros of both signs."""
    x = (rng.standard_normal(n) * 10.0 ** rng.uniform(-6, 6, n)).astype(np.float32)
    bits = np.array([0x3F808000, 0x3F818000, 0x3F80C000, 0xBF808000, 0x7FC00001, 0xFFC00000, 0x7F800000,
                     0xFF800000, 0x7F7FFFFF, 0x00000001, 0x00400000, 0x80000000, 0x00000000, 0x477FF000,
                     0x477FE000, 0x33800000, 0x33000000, 0x387FC000], np.uint32)
    x[:len(bits)] = bits.view(np.float32)
    return x


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")   # inf - inf on purpose
@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("half_dtype", ["float16", "bfloat16"])
def test_half_out_is_bit_exact(version, half_dtype, small_grid):
    rng = np.random.default_rng(2)
    n = 300
    run_half(lambda *a, **k: nb.adamw_step(*a, **k, version=version, threads=64), "numba", n, half_dtype, rng)


def run_half(fn, arrays, n, half_dtype, rng):
    """lr = 0, wd = 0, g = 0 keeps the special values; then 3 real steps; half_out checked after each."""
    p = to_backend(special_values(rng, n), arrays)
    m, v = to_backend(np.zeros(n, np.float32), arrays), to_backend(np.zeros(n, np.float32), arrays)
    for t, lr, wd in ((1, 0.0, 0.0), (2, 1e-2, 0.1), (3, 1e-2, 0.1), (4, 1e-2, 0.1)):
        g = to_backend(rng.standard_normal(n, dtype=np.float32) * np.float32(lr != 0), arrays)
        half = to_backend(np.full(n, 0xAAAA, np.uint16), arrays)
        if half_dtype == "float16" and arrays != "cupy":
            half = half.view(np.float16)   # a float16 array (uint16 works as well)
        fn(p, g, m, v, lr, 0.9, 0.999, 1e-8, wd, t, half_out=half, half_dtype=half_dtype)
        got = to_numpy(half).view(np.uint16)
        pf = to_numpy(p)
        if half_dtype == "bfloat16":
            want = pf.astype(ml_dtypes.bfloat16).view(np.uint16)
            np.testing.assert_array_equal(got, want)   # NaN too: the same quiet NaN with its sign
        else:
            with np.errstate(over="ignore"):
                want = pf.astype(np.float16).view(np.uint16)
            nan = np.isnan(pf)
            np.testing.assert_array_equal(got[~nan], want[~nan])
            assert np.all(np.isnan(got[nan].view(np.float16)))   # the GPU's NaN payload may differ from NumPy's


def test_half_out_ml_dtypes_array_is_accepted(small_grid):
    n = 50
    p = np.random.default_rng(3).standard_normal(n, dtype=np.float32)
    g, m, v = np.ones(n, np.float32), np.zeros(n, np.float32), np.zeros(n, np.float32)
    half = np.zeros(n, ml_dtypes.bfloat16)
    nb.adamw_step(p, g, m, v, 1e-3, 0.9, 0.999, 1e-8, 0.0, 1, half_out=half)   # half_dtype inferred
    np.testing.assert_array_equal(half.view(np.uint16), p.astype(ml_dtypes.bfloat16).view(np.uint16))


# ---- (b) validation ----------------------------------------------------------------------------------------------

def _args(n=10):
    return [np.zeros(n, np.float32) for _ in range(4)] + [1e-3, 0.9, 0.999, 1e-8, 0.1, 1]


@pytest.mark.parametrize("change, exc, match", [
    (lambda a: a.__setitem__(1, np.zeros(10, np.float64)), TypeError, "grads has dtype float64, expected float32"),
    (lambda a: a.__setitem__(2, np.zeros(11, np.float32)), ValueError, r"m has shape \(11,\), expected \(10,\)"),
    (lambda a: a.__setitem__(0, np.zeros((2, 5), np.float32)), ValueError, "params must be 1-D"),
    (lambda a: a.__setitem__(3, [0.0] * 10), TypeError, "v must be an array"),
    (lambda a: a.__setitem__(9, 0), ValueError, "step must be >= 1"),
    (lambda a: a.__setitem__(9, 1.0), TypeError, "step must be an int"),
    (lambda a: a.__setitem__(5, 1.0), ValueError, r"beta1 must be in \[0, 1\)"),
    (lambda a: a.__setitem__(4, -1.0), ValueError, "lr must be >= 0"),
    (lambda a: a.__setitem__(7, float("nan")), ValueError, "eps must be finite"),
])
def test_validation(change, exc, match):
    a = _args()
    change(a)
    with pytest.raises(exc, match=match):
        nb.adamw_step(*a)


def test_validation_of_keywords():
    a = _args()
    with pytest.raises(ValueError, match="version='v9' is not one of v1, v2"):
        nb.adamw_step(*a, version="v9")
    with pytest.raises(ValueError, match="half_dtype must be 'float16' or 'bfloat16'"):
        nb.adamw_step(*a, half_out=np.zeros(10, np.uint16), half_dtype="fp8")
    with pytest.raises(ValueError, match="pass half_dtype"):
        nb.adamw_step(*a, half_out=np.zeros(10, np.uint16))
    with pytest.raises(ValueError, match=r"half_out has shape \(9,\), expected \(10,\)"):
        nb.adamw_step(*a, half_out=np.zeros(9, np.float16), half_dtype="float16")
    with pytest.raises(TypeError, match="half_out has dtype float32"):
        nb.adamw_step(*a, half_out=np.zeros(10, np.float32), half_dtype="bfloat16")
    with pytest.raises(ValueError, match="half_dtype='float16' given without half_out"):
        nb.adamw_step(*a, half_dtype="float16")
    with pytest.raises(TypeError, match="decay_bounds must be None or a pair"):
        nb.adamw_step(*a, decay_bounds=np.array([0, 10]))
    with pytest.raises(ValueError, match=r"bounds has shape \(3,\), expected \(2,\)"):
        nb.adamw_step(*a, decay_bounds=(np.array([0, 5, 10]), np.array([1], np.uint8)))
    with pytest.raises(ValueError, match="bounds must rise from 0 to n=10"):
        nb.adamw_step(*a, decay_bounds=(np.array([0, 5, 9]), np.array([1, 0], np.uint8)))


def test_empty_buffer_is_a_no_op():
    nb.adamw_step(*_args(0))


# ---- (c) GPU: both backends, large and awkward sizes ------------------------------------------------------------

def _launcher(backend, version, threads=256):
    if backend == "numba":
        return (lambda *a, **k: nb.adamw_step(*a, **k, version=version, threads=threads)), "numba"
    hip_mod = hip_module()
    return (lambda *a, **k: hip_mod.adamw_step(*a, **k, version=version, threads=threads)), "cupy"


# (backend, version): every Numba and HIP version; v3 is HIP only (float4; n % 4 != 0 runs v2)
GPU_RUNS = [pytest.param("numba", v, marks=needs_numba_gpu) for v in ("v1", "v2")] + \
    [("hip", v) for v in ("v1", "v2", "v3")]


@pytest.mark.gpu
@pytest.mark.parametrize("backend, version", GPU_RUNS)
def test_gpu_large_100_steps(backend, version):
    fn, arrays = _launcher(backend, version)
    rng = np.random.default_rng(4)
    n = 2_000_020    # not a multiple of the block (256) or of the grid (4096 x 256, so the grid-stride loop wraps); a multiple of 4 for v3
    bounds, flags, mask = random_table(rng, n)
    table = (to_backend(bounds, arrays), to_backend(flags, arrays))
    assert run_against_reference(fn, arrays, n, table, mask, steps=100)


@pytest.mark.gpu
@pytest.mark.parametrize("backend, version", GPU_RUNS)
@pytest.mark.parametrize("n, threads", [(1, 256), (255, 64), (100_003, 1024), (4096 * 256 * 3 + 7, 256),
                                        (4096 * 256 * 4 * 3 + 8, 128)])
def test_gpu_awkward_sizes(backend, version, n, threads):
    fn, arrays = _launcher(backend, version, threads)
    bounds, flags, mask = random_table(np.random.default_rng(n), n)
    assert run_against_reference(fn, arrays, n, (to_backend(bounds, arrays), to_backend(flags, arrays)), mask,
                                 steps=10)
    assert run_against_reference(fn, arrays, n, None, None, steps=3)


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("backend, version", GPU_RUNS)
@pytest.mark.parametrize("half_dtype", ["float16", "bfloat16"])
def test_gpu_half_out(backend, version, half_dtype):
    fn, arrays = _launcher(backend, version)
    run_half(fn, arrays, 1_000_004, half_dtype, np.random.default_rng(5))   # a multiple of 4: v3 runs float4


@pytest.mark.gpu
def test_gpu_tiny_model_table_on_both_backends():
    for backend in ("numba", "hip") if device.numba_on_gpu() else ("hip",):
        fn, arrays = _launcher(backend, "v2")
        table, mask = tiny_table(arrays)
        assert run_against_reference(fn, arrays, mask.size, table, mask, steps=100)


@pytest.mark.gpu
def test_gpu_hip_validation():
    import cupy as cp
    hip_mod = hip_module()
    a = [cp.zeros(10, cp.float32) for _ in range(4)] + [1e-3, 0.9, 0.999, 1e-8, 0.1, 1]
    a[1] = np.zeros(10, np.float32)
    with pytest.raises(TypeError, match="grads must be a CuPy array"):
        hip_mod.adamw_step(*a)
    a[1] = cp.zeros(11, cp.float32)
    with pytest.raises(ValueError, match=r"grads has shape \(11,\), expected \(10,\)"):
        hip_mod.adamw_step(*a)
    a[1] = cp.zeros(10, cp.float32)
    a[9] = 0
    with pytest.raises(ValueError, match="step must be >= 1"):
        hip_mod.adamw_step(*a)


# ---- the graph-friendly step: scalars in GPU memory (adamw_step_device) and the gradient norm (grad_sumsq) --------
def _device_case(rng, n, to):
    p, g, m, v = (rng.standard_normal(n).astype(np.float32) for _ in range(4))
    v = np.abs(v)
    return [to(a.copy()) for a in (p, g, m, v)], (p, g, m, v)


@pytest.mark.parametrize("clip, loss_scale", [(0.0, 1.0), (0.5, 1.0), (0.5, 1024.0), (1e6, 1024.0)])
def test_step_device_matches_host_step(small_grid, monkeypatch, clip, loss_scale):
    """Same update as adamw_step with the host's clip coefficient / loss scale folded into grad_scale: bit for bit
    when nothing clips (grad_scale 1 / loss_scale is exact), to float32 rounding when the device computes coef."""
    rng = np.random.default_rng(7)
    n = 1000
    bounds, flags, _ = random_table(rng, n)
    _, host = _device_case(rng, n, lambda a: a)
    host[1][...] *= np.float32(loss_scale)              # a scaled gradient, as backward(loss_scale) leaves it
    dev, ref = ([to_backend(a.copy(), "numba") for a in host] for _ in range(2))
    sumsq = to_backend(np.zeros(1, np.float32), "numba")
    nb.grad_sumsq(dev[1], sumsq)
    sq = float(to_numpy(sumsq)[0])
    norm = math.sqrt(sq) / loss_scale
    coef = clip / (norm + 1e-6) if clip > 0 and clip / (norm + 1e-6) < 1 else 1.0
    hyper = to_backend(nb.adamw_hyper(3e-3, 0.1, 5, 0.9, 0.95, clip=clip, loss_scale=loss_scale), "numba")
    nb.adamw_step_device(*dev, hyper, sumsq, 0.9, 0.95, 1e-8, decay_bounds=(bounds, flags))
    nb.adamw_step(*ref, 3e-3, 0.9, 0.95, 1e-8, 0.1, 5, decay_bounds=(bounds, flags),
                  grad_scale=float(np.float32(coef) / np.float32(loss_scale)))
    for got, want in zip(dev, ref):
        got, want = to_numpy(got), to_numpy(want)
        if coef == 1.0:
            assert np.array_equal(got, want)
        else:
            assert close(got, want)
    assert (clip == 0.5) == (coef < 1.0)                # the clipping case really clips, the others do not


def test_grad_sumsq_is_the_squared_norm_and_deterministic():
    rng = np.random.default_rng(3)
    for n in (1, 129, 1000):
        g = rng.standard_normal(n).astype(np.float32) * 3
        out1, out2 = (to_backend(np.full(1, np.nan, np.float32), "numba") for _ in range(2))
        dg = to_backend(g, "numba")
        nb.grad_sumsq(dg, out1, blocks=3)
        nb.grad_sumsq(dg, out2, blocks=3)
        want = float(np.sum(g.astype(np.float64) ** 2))
        assert abs(float(to_numpy(out1)[0]) - want) <= 1e-5 * want
        assert to_numpy(out1)[0] == to_numpy(out2)[0]
    wrong = to_backend(np.zeros(1, np.float32), "numba")
    nb.grad_sumsq(to_backend(np.ones(10, np.float32), "numba"), wrong)
    assert float(to_numpy(wrong)[0]) == 10.0


def test_device_step_errors():
    rng = np.random.default_rng(0)
    bufs, _ = _device_case(rng, 8, lambda a: a)
    hyper = nb.adamw_hyper(1e-3, 0.0, 1, 0.9, 0.95)
    with pytest.raises(ValueError, match="hyper has shape"):
        nb.adamw_step_device(*bufs, hyper[:5].copy(), np.zeros(1, np.float32), 0.9, 0.95, 1e-8)
    with pytest.raises(TypeError, match="sumsq has dtype float64"):
        nb.adamw_step_device(*bufs, hyper, np.zeros(1), 0.9, 0.95, 1e-8)
    with pytest.raises(ValueError, match="clip must be >= 0"):
        nb.adamw_hyper(1e-3, 0.0, 1, 0.9, 0.95, clip=-1.0)
    with pytest.raises(ValueError, match="loss_scale must be > 0"):
        nb.adamw_hyper(1e-3, 0.0, 1, 0.9, 0.95, loss_scale=0.0)
    with pytest.raises(TypeError, match="out has dtype"):
        nb.grad_sumsq(np.ones(4, np.float32), np.zeros(1, np.float64))


@pytest.mark.gpu
def test_gpu_hip_step_device_and_sumsq():
    """HIP: adamw_step_device = adamw_step v3 with the host's factor; grad_sumsq = the float64 sum, deterministic."""
    import cupy as cp
    hip = hip_module()
    rng = np.random.default_rng(11)
    n = 2_000_004
    bounds, flags, _ = random_table(rng, n)
    table = (cp.asarray(bounds), cp.asarray(flags))
    for clip in (0.0, 1.0):
        dev, host = _device_case(np.random.default_rng(5), n, cp.asarray)
        ref, _ = _device_case(np.random.default_rng(5), n, cp.asarray)
        sumsq, again = cp.zeros(1, cp.float32), cp.zeros(1, cp.float32)
        hip.grad_sumsq(dev[1], sumsq)
        hip.grad_sumsq(dev[1], again)
        want = float(np.sum(host[1].astype(np.float64) ** 2))
        assert abs(float(sumsq[0]) - want) <= 1e-5 * want and float(sumsq[0]) == float(again[0])
        norm = math.sqrt(float(sumsq[0]))
        coef = clip / (norm + 1e-6) if clip > 0 and clip / (norm + 1e-6) < 1 else 1.0
        half = cp.zeros(n, cp.uint16)
        hyper = cp.asarray(nb.adamw_hyper(1e-3, 0.1, 3, 0.9, 0.95, clip=clip))
        hip.adamw_step_device(*dev, hyper, sumsq, 0.9, 0.95, 1e-8, decay_bounds=table, half_out=half,
                              half_dtype="bfloat16")
        hip.adamw_step(*ref, 1e-3, 0.9, 0.95, 1e-8, 0.1, 3, decay_bounds=table, grad_scale=coef, version="v3")
        for got, w in zip(dev, ref):
            assert close(cp.asnumpy(got), cp.asnumpy(w))
        want_half = cp.asnumpy(dev[0]).astype(ml_dtypes.bfloat16).view(np.uint16)
        assert np.array_equal(cp.asnumpy(half), want_half)
