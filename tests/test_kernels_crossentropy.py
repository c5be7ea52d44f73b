"""Fused softmax + cross-entropy kernels: kernels/numba/crossentropy.py and kernels/hip/crossentropy.cu.

In the simulator: v1 and v2 (and v2_fused) against check_crossentropy_backward, the forward against the reference
loss, v3 the same way with the wrappers' GPU guard lifted (simwarp's shuffles), broken launches caught, wrapper
validation. On a GPU (`pytest -m gpu`): every version, Numba and HIP, at the checker's large size (V = 50257) and
awkward block sizes. PTX for every KERNELS entry: tests/test_kernels_numba.py.
"""
import types

import numpy as np
import pytest

from gpullm_lessons import device, reference
from gpullm_lessons.runtime.arrays import to_backend, to_numpy
from gpullm_lessons.checks.backward import check_crossentropy_backward
from gpullm_lessons.kernels.numba import crossentropy as ce

SIM_VERSIONS = [v for v in ce.VERSIONS if v not in ce.GPU_ONLY]


def _inputs(N, V, seed, offset=0.0):
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((N, V)) * 10.0 ** rng.uniform(-1, 0.7, (N, 1)) + offset).astype(np.float32)
    targets = rng.integers(0, V, N).astype(np.int32)
    return logits, targets


def _row_losses(logits, targets):
    """float64 per-row -log softmax[target] (the reference op returns only the mean)."""
    x = logits.astype(np.float64)
    m = x.max(axis=1)
    lse = m + np.log(np.exp(x - m[:, None]).sum(axis=1))
    return lse - x[np.arange(len(targets)), targets]


# ---- (a) the simulator: every simulator-capable version passes its checker ---------------------------------------------
@pytest.mark.parametrize("version", SIM_VERSIONS)
def test_backward_passes_checker(version):
    r = check_crossentropy_backward(lambda *a: ce.crossentropy_backward(*a, version=version), arrays="numba",
                                    quiet=True)
    assert r.passed, r.message


@pytest.mark.parametrize("version", SIM_VERSIONS)
def test_forward_matches_reference(version):
    logits, targets = _inputs(13, 37, seed=1)
    losses = to_backend(np.full(13, np.nan, np.float32), "numba")
    ce.crossentropy_forward(to_backend(logits, "numba"), to_backend(targets, "numba"), losses, version=version)
    ours = to_numpy(losses)
    loss, _ = reference.crossentropy_forward(logits.astype(np.float64), targets)
    assert abs(ours.mean() - loss) <= 1e-5 * abs(loss)                  # the mean is the reference loss
    np.testing.assert_allclose(ours, _row_losses(logits, targets), rtol=1e-5, atol=1e-6)


def test_online_softmax_does_not_overflow():
    """Logits around 500: exp(500) overflows float32; the running max keeps every exponent <= 0."""
    logits, targets = _inputs(5, 41, seed=2, offset=500.0)
    losses = np.full(5, np.nan, np.float32)
    dlogits = np.full((5, 41), np.nan, np.float32)
    ce.crossentropy_forward_backward(logits, targets, losses, dlogits, threads=32)   # NumPy arrays: simulator
    np.testing.assert_allclose(losses, _row_losses(logits, targets), rtol=1e-4)
    _, cache = reference.crossentropy_forward(logits.astype(np.float64), targets)
    np.testing.assert_allclose(dlogits, reference.crossentropy_backward(1.0, cache), atol=1e-7)


def test_fused_passes_checker_and_writes_losses():
    seen = {}

    def fused(logits, targets, dlogits):
        losses = to_backend(np.full(logits.shape[0], np.nan, np.float32), "numba")
        ce.crossentropy_forward_backward(logits, targets, losses, dlogits)
        seen["losses"], seen["logits"], seen["targets"] = to_numpy(losses), to_numpy(logits), to_numpy(targets)

    r = check_crossentropy_backward(fused, arrays="numba", quiet=True)
    assert r.passed, r.message
    np.testing.assert_allclose(seen["losses"], _row_losses(seen["logits"], seen["targets"]), rtol=1e-5, atol=1e-6)


def test_broken_launches_are_caught():
    def too_few_threads(logits, targets, dlogits):        # v1 with one block of 2 threads: rows 2.. never written
        ce.KERNELS["v1"][1, 2](logits, targets, dlogits)

    r = check_crossentropy_backward(too_few_threads, arrays="numba", quiet=True)
    assert not r.passed and "never written" in r.hint

    def last_row_missing(logits, targets, dlogits):       # v2 with a block too few: the last row stays NaN
        ce.KERNELS["v2"][logits.shape[0] - 1, 32](logits, targets, dlogits)

    r = check_crossentropy_backward(last_row_missing, arrays="numba", quiet=True)
    assert not r.passed and "never written" in r.hint


# ---- (b) wrapper validation --------------------------------------------------------------------------------------------
def _arrays(N=4, V=6):
    return np.zeros((N, V), np.float32), np.zeros(N, np.int32), np.zeros((N, V), np.float32)


def test_validation_errors():
    logits, targets, dlogits = _arrays()
    with pytest.raises(ValueError, match=r"dlogits has shape \(4, 5\), expected \(4, 6\)"):
        ce.crossentropy_backward(logits, targets, np.zeros((4, 5), np.float32))
    with pytest.raises(ValueError, match=r"targets has shape \(3,\), expected \(4,\)"):
        ce.crossentropy_backward(logits, np.zeros(3, np.int32), dlogits)
    with pytest.raises(TypeError, match="targets has dtype int64, expected int32"):
        ce.crossentropy_backward(logits, targets.astype(np.int64), dlogits)
    with pytest.raises(TypeError, match="logits has dtype float64, expected float32"):
        ce.crossentropy_backward(logits.astype(np.float64), targets, dlogits)
    with pytest.raises(ValueError, match="logits must be 2-D"):
        ce.crossentropy_backward(logits.ravel(), targets, dlogits)
    with pytest.raises(ValueError, match=r"losses has shape \(5,\), expected \(4,\)"):
        ce.crossentropy_forward(logits, targets, np.zeros(5, np.float32))
    with pytest.raises(ValueError, match="must be C-contiguous"):
        ce.crossentropy_backward(logits, targets, np.zeros((6, 4), np.float32).T)
    with pytest.raises(ValueError, match="version='v9'"):
        ce.crossentropy_backward(logits, targets, dlogits, version="v9")
    with pytest.raises(ValueError, match="threads=48: v2 needs a power of 2"):
        ce.crossentropy_backward(logits, targets, dlogits, version="v2", threads=48)
    with pytest.raises(ValueError, match="version='v1'"):
        ce.crossentropy_forward_backward(logits, targets, np.zeros(4, np.float32), dlogits, version="v1")


@pytest.mark.skipif(device.numba_on_gpu(), reason="the GPU runs v3")
def test_gpu_only_version_refused_in_simulator():
    with pytest.raises(RuntimeError, match="simulator does not support"):
        ce.crossentropy_backward(*_arrays(), version="v3")


@pytest.mark.skipif(device.numba_on_gpu(), reason="the GPU runs v3 in test_numba_on_gpu")
def test_v3_passes_in_the_simulator_with_the_guard_lifted(monkeypatch):
    """The wrappers keep v3 (warp shuffles) for a GPU; with that guard lifted its backward passes the checker and
    its forward gives the reference's row losses here, on simwarp's shuffles, at 64 threads (two warps a block)."""
    monkeypatch.setattr(ce, "GPU_ONLY", set())
    r = check_crossentropy_backward(lambda *a: ce.crossentropy_backward(*a, version="v3", threads=64),
                                    arrays="numba", quiet=True)
    assert r.passed, r.message
    logits, targets = _inputs(13, 37, seed=2)
    losses = to_backend(np.full(13, np.nan, np.float32), "numba")
    ce.crossentropy_forward(to_backend(logits, "numba"), to_backend(targets, "numba"), losses, version="v3",
                            threads=64)
    np.testing.assert_allclose(to_numpy(losses), _row_losses(logits, targets), rtol=1e-5, atol=1e-6)


def test_hip_wrapper_validation_without_gpu():
    from gpullm_lessons.backends.hip import crossentropy as hce
    with pytest.raises(TypeError, match="logits must be a CuPy array"):
        hce.crossentropy_backward(*_arrays())
    with pytest.raises(ValueError, match="logits must be 2-D"):
        hce.crossentropy_forward(np.zeros(3, np.float32), np.zeros(3, np.int32), np.zeros(3, np.float32))


# ---- (c) on a GPU: every version, both backends, large and awkward sizes ------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("size", ["small", "large"])
@pytest.mark.parametrize("version", ce.VERSIONS)
def test_numba_on_gpu(version, size):
    for threads in (None, 32, 1024):
        r = check_crossentropy_backward(lambda *a: ce.crossentropy_backward(*a, version=version, threads=threads),
                                        arrays="numba", size=size, quiet=True)
        assert r.passed, (threads, r.message)


@pytest.mark.gpu
@pytest.mark.parametrize("size", ["small", "large"])
@pytest.mark.parametrize("version", list(ce.VERSIONS) + ["v4"])   # v4: HIP only
def test_hip_on_gpu(version, size):
    from gpullm_lessons.backends.hip import crossentropy as hce
    for threads in (64, 256, 1024):
        r = check_crossentropy_backward(lambda *a: hce.crossentropy_backward(*a, version=version, threads=threads),
                                        arrays="cupy", size=size, quiet=True)
        assert r.passed, (threads, r.message)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["numba", "hip"])
@pytest.mark.parametrize("version", ["v1", "v2", "v3", "fused"])
def test_forward_on_gpu(backend, version):
    """Per-row losses at GPT-2 size (V = 50257, N awkward), and the fused kernel's dlogits, against float64."""
    if backend == "hip":
        from gpullm_lessons.backends.hip import crossentropy as mod
        arrays = "cupy"
    else:
        mod, arrays = ce, "numba"
    N, V = 1000, 50257
    logits, targets = _inputs(N, V, seed=3)
    d_logits, d_targets = to_backend(logits, arrays), to_backend(targets, arrays)
    losses = to_backend(np.full(N, np.nan, np.float32), arrays)
    if version == "fused":
        dlogits = to_backend(np.full((N, V), np.nan, np.float32), arrays)
        mod.crossentropy_forward_backward(d_logits, d_targets, losses, dlogits)
        _, cache = reference.crossentropy_forward(logits.astype(np.float64), targets)
        expected = reference.crossentropy_backward(1.0, cache)
        assert np.abs(to_numpy(dlogits) - expected).max() <= 1e-5 / N
    else:
        mod.crossentropy_forward(d_logits, d_targets, losses, version=version)
    ours = to_numpy(losses)
    np.testing.assert_allclose(ours, _row_losses(logits, targets), rtol=1e-5, atol=1e-5)
    loss, _ = reference.crossentropy_forward(logits.astype(np.float64), targets)
    assert abs(ours.astype(np.float64).mean() - loss) <= 1e-5 * abs(loss)


@pytest.mark.gpu
@pytest.mark.parametrize("N,V,offset", [(300, 50304, 0), (7, 4, 0), (9, 1000, 0), (100, 50304, 1), (5, 50257, 0)])
@pytest.mark.parametrize("threads", [64, 256, 1024])
def test_hip_v4_float4_path_on_gpu(N, V, offset, threads):
    """v4's float4 path (V % 4 == 0: GPT-2's padded vocabulary 50304), targets at both ends of a row; arrays starting
    4 * offset bytes past 16-byte alignment, or V % 4 != 0, take the scalar path. Against float64."""
    cp = pytest.importorskip("cupy")
    from gpullm_lessons.backends.hip import crossentropy as hce
    logits, targets = _inputs(N, V, seed=N + V)
    targets[0] = V - 1
    targets[-1] = 0

    def placed(a):   # a C-contiguous view that starts `offset` floats into its buffer
        buf = cp.full(a.size + offset, cp.nan, cp.float32)
        view = buf[offset:].reshape(a.shape)
        view[...] = cp.asarray(a)
        return view
    dlogits = placed(np.full((N, V), np.nan, np.float32))
    hce.crossentropy_backward(placed(logits), cp.asarray(targets), dlogits, version="v4", threads=threads)
    _, cache = reference.crossentropy_forward(logits.astype(np.float64), targets)
    expected = reference.crossentropy_backward(1.0, cache)
    got = dlogits.get()
    assert np.isfinite(got).all()
    assert np.abs(got - expected).max() <= 1e-5 / N


@pytest.mark.gpu
def test_hip_v4_is_backward_only():
    cp = pytest.importorskip("cupy")
    from gpullm_lessons.backends.hip import crossentropy as hce
    logits = cp.zeros((3, 8), cp.float32)
    with pytest.raises(ValueError, match="version='v4', expected one of v1, v2, v3"):
        hce.crossentropy_forward(logits, cp.zeros(3, cp.int32), cp.zeros(3, cp.float32), version="v4")


# ---- dlogits written as half bits (crossentropy_forward_backward_half: the bf16 engine's loss) ------------------------
def _half_expected(logits, targets, half):
    _, cache = reference.crossentropy_forward(logits.astype(np.float64), targets)
    d = reference.crossentropy_backward(1.0, cache).astype(np.float32)
    if half == "bf16":
        import ml_dtypes
        return d.astype(ml_dtypes.bfloat16).astype(np.float64)
    return d.astype(np.float16).astype(np.float64)


def _half_values(bits, half):
    if half == "bf16":
        return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return bits.view(np.float16).astype(np.float64)


def _check_half(mod, arrays, N, V, half, seed):
    logits, targets = _inputs(N, V, seed=seed)
    targets[0], targets[-1] = V - 1, 0                        # the one-hot at both ends of a row (the float4 path)
    losses = to_backend(np.full(N, np.nan, np.float32), arrays)
    dl = to_backend(np.full((N, V), 0xFFFF, np.uint16), arrays)
    mod.crossentropy_forward_backward_half(to_backend(logits, arrays), to_backend(targets, arrays), losses, dl,
                                           half=half)
    got, want = _half_values(to_numpy(dl), half), _half_expected(logits, targets, half)
    # one unit in the half's last place (relative spacing up to 2^-7 in bf16, 2^-10 in fp16; fp16's subnormals below
    # 2^-14 are 2^-24 apart): the kernel's fp32 value and NumPy's may sit on two sides of a rounding boundary
    ulp, floor = (2.0 ** -7, 0.0) if half == "bf16" else (2.0 ** -10, 2.0 ** -24)
    err = np.abs(got - want)
    assert np.all(err <= ulp * np.abs(want) + floor), err.max()
    assert (err > 0).mean() <= 1e-2                           # rare, not the rule (a truncating kernel fails this)
    np.testing.assert_allclose(to_numpy(losses), _row_losses(logits, targets), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("half", ["bf16", "fp16"])
def test_half_dlogits_in_simulator(half):
    _check_half(ce, "numba", 5, 33, half, seed=1)


def test_half_dlogits_errors():
    logits, targets = _inputs(3, 8, seed=0)
    losses = np.zeros(3, np.float32)
    with pytest.raises(TypeError, match="dlogits must be a uint16 array"):
        ce.crossentropy_forward_backward_half(logits, targets, losses, np.zeros((3, 8), np.float32), half="bf16")
    with pytest.raises(ValueError, match="half must be one of"):
        ce.crossentropy_forward_backward_half(logits, targets, losses, np.zeros((3, 8), np.uint16), half="fp8")
    with pytest.raises(ValueError, match=r"dlogits has shape \(3, 7\)"):
        ce.crossentropy_forward_backward_half(logits, targets, losses, np.zeros((3, 7), np.uint16), half="bf16")


def _gpu_module(backend):
    """The launchers module and array kind of a GPU test's backend (Numba's skipped where it has no NVIDIA GPU)."""
    if backend == "numba" and not device.numba_on_gpu():
        pytest.skip("Numba on an NVIDIA GPU only")
    if backend == "hip":
        from gpullm_lessons.backends.hip import crossentropy as mod
        return mod, "cupy"
    return ce, "numba"


# ---- logits in half too (the head's product rounds them on the way out), dlogits beside them or over them ------------
def _to_half_bits(x, half):
    if half == "bf16":
        from gpullm_lessons.model.precision import f32_to_bf16_bits
        return f32_to_bf16_bits(x)
    return x.astype(np.float16).view(np.uint16)


def _check_half_logits(mod, arrays, N, V, half, seed, in_place, offset=0):
    """The kernel against the float64 reference on the half logits' own values (what it was given), the losses and
    dlogits both. in_place: dlogits is the logits array (the engine's use). offset: the arrays start `offset`
    elements into a buffer (offset 1: rows on 2 bytes, the launcher's scalar entry point)."""
    logits32, targets = _inputs(N, V, seed=seed)
    targets[0], targets[-1] = V - 1, 0                        # the one-hot at both ends of a row
    targets[N // 2] = min(V - 1, 4 * 37 + 1)                  # a target past the first few warps' elements
    bits = _to_half_bits(logits32, half)
    values = _half_values(bits, half).astype(np.float32)      # exactly the values the kernel reads
    buf = np.zeros(N * V + offset, np.uint16)
    buf[offset:] = bits.reshape(-1)
    buf = to_backend(buf, arrays)
    logits = buf[offset:].reshape(N, V)
    losses = to_backend(np.full(N, np.nan, np.float32), arrays)
    dl = logits if in_place else to_backend(np.full((N, V), 0xFFFF, np.uint16), arrays)
    mod.crossentropy_forward_backward_half(logits, to_backend(targets, arrays), losses, dl, half=half)
    got, want = _half_values(to_numpy(dl), half), _half_expected(values, targets, half)
    ulp, floor = (2.0 ** -7, 0.0) if half == "bf16" else (2.0 ** -10, 2.0 ** -24)
    err = np.abs(got - want)
    assert np.all(err <= ulp * np.abs(want) + floor), (err.max(), np.unravel_index(err.argmax(), err.shape))
    assert (err > 0).mean() <= 1e-2
    np.testing.assert_allclose(to_numpy(losses), _row_losses(values, targets), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("half", ["bf16", "fp16"])
@pytest.mark.parametrize("in_place", [False, True], ids=["beside", "in_place"])
def test_half_logits_in_simulator(half, in_place):
    _check_half_logits(ce, "numba", 5, 33, half, seed=2, in_place=in_place)


def _planted(mistake):
    """A stand-in launcher with one plausible mistake of a half-logits loss kernel, on top of the real one."""
    def launch(logits, targets, losses, dlogits, half):
        x = np.asarray(logits)
        if mistake == "wrong_format":  # the bits read as the other half format
            ce.crossentropy_forward_backward_half(x, targets, losses, dlogits, half="fp16" if half == "bf16" else "bf16")
            return
        x = x.copy()  # the logits as given (dlogits may be the same array)
        ce.crossentropy_forward_backward_half(x.copy(), targets, losses, dlogits, half=half)
        N = x.shape[0]
        if mistake == "target_after_overwrite":  # the loss's logits[target] read after dlogits were written over it
            rows = np.arange(N)
            losses += (_half_values(x[rows, targets], half) - _half_values(dlogits[rows, targets], half)).astype(np.float32)
        elif mistake == "no_onehot":  # the target's 1 never subtracted
            rows = np.arange(N)
            d = _half_values(dlogits[rows, targets], half) + 1.0 / N
            dlogits[rows, targets] = _to_half_bits(d.astype(np.float32), half)
        elif mistake == "first_row_only":  # the grid covers one row
            dlogits[1:] = 0xFFFF
            losses[1:] = np.nan
    return types.SimpleNamespace(crossentropy_forward_backward_half=launch)


@pytest.mark.parametrize("mistake", ["wrong_format", "target_after_overwrite", "no_onehot", "first_row_only"])
def test_half_logits_check_catches_planted_mistakes(mistake):
    """_check_half_logits (the simulator's and the GPU's check of the half-logits kernels) fails each mistake, in
    place and beside; the real launcher passes the same calls."""
    _check_half_logits(ce, "numpy", 5, 33, "bf16", seed=2, in_place=True)
    for in_place in (False, True):
        with pytest.raises(AssertionError):
            _check_half_logits(_planted(mistake), "numpy", 5, 33, "bf16", seed=2, in_place=in_place)


def test_half_logits_errors():
    logits, targets = _inputs(3, 8, seed=0)
    losses = np.zeros(3, np.float32)
    dl = np.zeros((3, 8), np.uint16)
    with pytest.raises(TypeError, match=r"logits has dtype float64, expected float32 or uint16 \(the bf16 bits"):
        ce.crossentropy_forward_backward_half(logits.astype(np.float64), targets, losses, dl, half="bf16")
    with pytest.raises(ValueError, match=r"logits must be 2-D"):
        ce.crossentropy_forward_backward_half(dl.reshape(-1), targets, losses, dl, half="bf16")
    with pytest.raises(ValueError, match=r"dlogits has shape \(3, 7\)"):
        ce.crossentropy_forward_backward_half(dl, targets, losses, np.zeros((3, 7), np.uint16), half="bf16")
    with pytest.raises(TypeError, match="targets has dtype int64"):
        ce.crossentropy_forward_backward_half(dl, targets.astype(np.int64), losses, dl, half="bf16")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["hip", "numba"])
@pytest.mark.parametrize("half", ["bf16", "fp16"])
@pytest.mark.parametrize("in_place", [False, True], ids=["beside", "in_place"])
@pytest.mark.parametrize("N, V, offset", [(257, 50304, 0), (33, 50304, 4), (33, 50300, 0), (33, 50304, 1),
                                          (33, 50257, 0), (7, 4, 0)],
                         ids=["50304", "50304-8B", "50300", "50304-odd", "50257", "4"])
def test_half_logits_on_gpu(backend, half, in_place, N, V, offset):
    """HIP: V % 8 == 0 on 16-byte rows runs hh8 (8 logits per load); V % 4 == 0 on 8-byte rows hh4 (an 8-byte
    offset, or V = 50300); V = 50257 or a 2-byte offset the scalar hh."""
    mod, arrays = _gpu_module(backend)
    _check_half_logits(mod, arrays, N, V, half, seed=11, in_place=in_place, offset=offset)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["hip", "numba"])
@pytest.mark.parametrize("half", ["bf16", "fp16"])
@pytest.mark.parametrize("N, V", [(257, 50304), (33, 50257), (7, 4)], ids=["50304", "50257", "4"])
def test_half_dlogits_on_gpu(backend, half, N, V):
    """HIP: V % 4 == 0 runs the float4 entry point (half4), V = 50257 the scalar one."""
    mod, arrays = _gpu_module(backend)
    _check_half(mod, arrays, N, V, half, seed=7)
