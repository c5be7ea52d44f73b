"""LayerNorm kernels: Numba (kernels/numba/layernorm.py) and HIP (kernels/hip/layernorm.cu via
gpullm_lessons.backends.hip.layernorm).

Backward: check_layernorm_backward (fresh random inputs, NaN-poisoned outputs). Forward: compared here with
gpullm_lessons.reference.layernorm_forward in float64, outputs NaN-poisoned. Simulator runs keep sizes toy (v3 with
the wrappers' GPU guard lifted: simwarp's shuffles);
@pytest.mark.gpu tests (every version, both backends, large and awkward sizes) run on a GPU.
"""
import secrets

import numpy as np
import pytest

from gpullm_lessons import device, reference
from gpullm_lessons.runtime.arrays import to_backend, to_numpy
from gpullm_lessons.checks.backward import check_layernorm_backward
from gpullm_lessons.kernels.numba import layernorm as nb

SIM_VERSIONS = sorted(set(nb.VERSIONS) - nb.GPU_ONLY)   # v1, v2
needs_numba_gpu = pytest.mark.skipif(not device.numba_on_gpu(), reason="Numba kernels run on NVIDIA GPUs only")


# Forward tolerance, same rule as the checkers (|yours - expected| <= tol * (|expected| + max|expected|)) but 3x the
# checkers' fp32 1e-5: a row with a small spread and a large offset turns the mean's rounding error into an error
# of xhat |mean| / std times larger. A sequential fp32 loop (v1) reached 7.4e-6 at N=4097, C=1023; missing terms
# fail by orders of magnitude.
FORWARD_TOL = 3e-5


def check_forward(fn, arrays, N, C, tol=FORWARD_TOL, seed=None):
    """fn(inp, weight, bias, out, mean, rstd) against the float64 reference; outputs start as NaN."""
    seed = secrets.randbelow(1_000_000) if seed is None else seed
    rng = np.random.default_rng(seed)
    scale = 10.0 ** rng.uniform(-1.0, 0.5, (N, 1))                      # rows of very different scales
    inp = (rng.standard_normal((N, C)) * scale + rng.standard_normal((N, 1))).astype(np.float32)
    weight = rng.normal(1.0, 0.5, C).astype(np.float32)
    bias = rng.standard_normal(C).astype(np.float32)
    out_ref, cache = reference.layernorm_forward(*(x.astype(np.float64) for x in (inp, weight, bias)))
    expected = {"out": out_ref, "mean": cache["mean"], "rstd": cache["rstd"]}
    outs = {"out": np.full((N, C), np.nan, np.float32), "mean": np.full(N, np.nan, np.float32),
            "rstd": np.full(N, np.nan, np.float32)}
    dev = {k: to_backend(v, arrays) for k, v in outs.items()}
    fn(*(to_backend(x, arrays) for x in (inp, weight, bias)), dev["out"], dev["mean"], dev["rstd"])
    for name, e in expected.items():
        got = to_numpy(dev[name]).astype(np.float64)
        assert np.isfinite(got).all(), f"{name}: {int((~np.isfinite(got)).sum())} elements NaN/unwritten " \
                                       f"(N={N}, C={C}, seed {seed})"
        err = np.abs(got - e) / (np.abs(e) + np.abs(e).max())
        assert err.max() <= tol, f"{name}: max rel err {err.max():.2g} > {tol} (N={N}, C={C}, seed {seed})"


# ---- (a) simulator-capable versions, toy sizes ----------------------------------------------------------------------

@pytest.mark.parametrize("version", SIM_VERSIONS)
def test_numba_backward_passes_checker(version):
    threads = 128 if device.numba_on_gpu() else 32
    r = check_layernorm_backward(lambda *a: nb.layernorm_backward(*a, version=version, threads=threads),
                                 arrays="numba", quiet=True)
    assert r.passed, r.message


def test_numba_backward_v2_many_chunks_and_column_blocks():
    """Small blocks and chunks: several column blocks and row chunks, the last of each partial."""
    r = check_layernorm_backward(lambda *a: nb.layernorm_backward(*a, version="v2", threads=8, rows_per_chunk=3),
                                 arrays="numba", quiet=True)
    assert r.passed, r.message


@pytest.mark.parametrize("version", SIM_VERSIONS)
def test_numba_forward_matches_reference(version):
    rng = np.random.default_rng()
    N, C = int(rng.integers(3, 30)), int(rng.integers(4, 50))
    check_forward(lambda *a: nb.layernorm_forward(*a, version=version, threads=16), "numba", N, C)


def test_too_few_blocks_is_caught():
    """v1 launched with one block of N - 1 threads: the last row of dinp is never written."""
    def broken(dout, inp, weight, mean, rstd, dinp, dweight, dbias):
        N, C = inp.shape
        nb.KERNELS["v1"][1, N - 1](dout, inp, weight, mean, rstd, dinp)
        nb.KERNELS["v1_dparams"][1, C](dout, inp, mean, rstd, dweight, dbias)
    r = check_layernorm_backward(broken, arrays="numba", quiet=True)
    assert r.status == "wrong" and r.output == "dinp"
    assert "never written" in r.hint


def test_missing_stage_two_is_caught():
    """v2 stage 1 only, with dweight/dbias taken from the first chunk's partials: rows past the chunk are lost."""
    from numba import cuda

    def broken(dout, inp, weight, mean, rstd, dinp, dweight, dbias):
        N, C = inp.shape
        nb.KERNELS["v2"][N, 8](dout, inp, weight, mean, rstd, dinp)
        part_w, part_b = cuda.device_array((N, C), np.float32), cuda.device_array((N, C), np.float32)
        nb.KERNELS["v2_partials"][(C + 7) // 8, N](dout, inp, mean, rstd, part_w, part_b, np.int64(1))
        nb.KERNELS["v2_reduce"][(C + 7) // 8, 8](part_w[:1], part_b[:1], dweight, dbias)
    r = check_layernorm_backward(broken, arrays="numba", quiet=True)
    assert r.status == "wrong" and r.output in ("dweight", "dbias")


def test_check_forward_catches_a_wrong_forward():
    def no_bias(inp, weight, bias, out, mean, rstd):          # NumPy, forgets the bias
        mean[:], rstd[:] = reference.layernorm_stats(inp)
        out[:] = (inp - mean[:, None]) * rstd[:, None] * weight

    def last_row_missing(inp, weight, bias, out, mean, rstd):   # NumPy, skips the last row
        y, cache = reference.layernorm_forward(inp[:-1], weight, bias)
        out[:-1], mean[:-1], rstd[:-1] = y, cache["mean"], cache["rstd"]
    with pytest.raises(AssertionError, match="out: max rel err"):
        check_forward(no_bias, "numpy", 7, 9)
    with pytest.raises(AssertionError, match="out: 9 elements NaN/unwritten"):
        check_forward(last_row_missing, "numpy", 7, 9)


@pytest.mark.skipif(device.numba_on_gpu(), reason="on a GPU v3 runs")
def test_gpu_only_version_refused_in_simulator():
    from gpullm_lessons.device import NoGPUError
    a = np.zeros((3, 4), np.float32)
    v = np.zeros(4, np.float32)
    s = np.zeros(3, np.float32)
    with pytest.raises(NoGPUError, match="warp shuffles"):
        nb.layernorm_backward(a, a, v, s, s, a.copy(), v.copy(), v.copy(), version="v3")
    with pytest.raises(NoGPUError, match="simulator"):
        nb.layernorm_forward(a, v, v, a.copy(), s, s.copy(), version="v3")


@pytest.mark.skipif(device.numba_on_gpu(), reason="on a GPU v3 runs in the gpu tests")
def test_v3_passes_in_the_simulator_with_the_guard_lifted(monkeypatch):
    """The wrappers keep v3 (warp shuffles) for a GPU; with that guard lifted its forward and backward run here on
    simwarp's shuffles, at 64 threads (two warps a block), against the reference."""
    monkeypatch.setattr(nb, "GPU_ONLY", set())
    r = check_layernorm_backward(lambda *a: nb.layernorm_backward(*a, version="v3", threads=64), arrays="numba",
                                 quiet=True)
    assert r.passed, r.message
    rng = np.random.default_rng()
    N, C = int(rng.integers(3, 30)), int(rng.integers(33, 100))
    check_forward(lambda *a: nb.layernorm_forward(*a, version="v3", threads=64), "numba", N, C)


# ---- (b) wrapper input validation (Numba, and the HIP wrapper's checks that need no GPU) -----------------------------

def _bwd_args(N=5, C=7):
    f = np.float32
    return [np.zeros((N, C), f), np.zeros((N, C), f), np.zeros(C, f), np.zeros(N, f), np.zeros(N, f),
            np.zeros((N, C), f), np.zeros(C, f), np.zeros(C, f)]


def _fwd_args(N=5, C=7):
    f = np.float32
    return [np.zeros((N, C), f), np.zeros(C, f), np.zeros(C, f), np.zeros((N, C), f), np.zeros(N, f),
            np.zeros(N, f)]


def _hip():
    from gpullm_lessons.backends.hip import layernorm as hip_layernorm
    return hip_layernorm


@pytest.mark.parametrize("module", ["numba", "hip"])
def test_validation_errors(module):
    mod = nb if module == "numba" else _hip()
    args = _bwd_args()
    args[2] = np.zeros(6, np.float32)
    with pytest.raises(ValueError, match=r"layernorm_backward: weight has shape \(6,\), expected \(7,\)"):
        mod.layernorm_backward(*args)
    args = _bwd_args()
    args[6] = np.zeros(7, np.float64)
    with pytest.raises(TypeError, match="dweight has dtype float64, expected float32"):
        mod.layernorm_backward(*args)
    args = _bwd_args()
    args[5] = np.zeros((7, 5), np.float32).T
    with pytest.raises(ValueError, match="dinp of shape .* must be C-contiguous"):
        mod.layernorm_backward(*args)
    args = _bwd_args()
    args[1] = np.zeros((5, 7, 1), np.float32)
    with pytest.raises(ValueError, match=r"inp has shape \(5, 7, 1\), expected \(N, C\)"):
        mod.layernorm_backward(*args)
    with pytest.raises(ValueError, match="version='v9' is not one of v1, v2, v3"):
        mod.layernorm_backward(*_bwd_args(), version="v9")
    with pytest.raises(ValueError, match="threads=48 must be a power of two"):
        mod.layernorm_backward(*_bwd_args(), version="v2", threads=48)
    args = _fwd_args()
    args[4] = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match=r"layernorm_forward: mean has shape \(4,\), expected \(5,\)"):
        mod.layernorm_forward(*args)


def test_hip_v4_validation_without_gpu():
    """v4 is backward-only, and its blocks are whole warps on either vendor (a multiple of 64 threads)."""
    with pytest.raises(ValueError, match="version='v4' is not one of v1, v2, v3"):
        _hip().layernorm_forward(*_fwd_args(), version="v4")
    with pytest.raises(ValueError, match="threads=96 must be a multiple of 64 for v4"):
        _hip().layernorm_backward(*_bwd_args(), version="v4", threads=96)


def test_hip_v5_validation_without_gpu():
    """v5 is backward-only, whole warps on either vendor; its grid settings are checked before any GPU work."""
    with pytest.raises(ValueError, match="version='v5' is not one of v1, v2, v3"):
        _hip().layernorm_forward(*_fwd_args(), version="v5")
    with pytest.raises(ValueError, match="threads=96 must be a multiple of 64 for v5"):
        _hip().layernorm_backward(*_bwd_args(), version="v5", threads=96)
    with pytest.raises(ValueError, match="blocks_per_sm= sets v5's grid; version 'v3' does not take it"):
        _hip().layernorm_backward(*_bwd_args(), version="v3", blocks_per_sm=2)
    with pytest.raises(ValueError, match="grid=0, expected a positive int"):
        _hip().layernorm_backward(*_bwd_args(), version="v5", grid=0)
    with pytest.raises(ValueError, match="blocks_per_sm=1.5, expected a positive int"):
        _hip().layernorm_backward(*_bwd_args(), version="v5", blocks_per_sm=1.5)
    with pytest.raises(ValueError, match="not both"):
        _hip().layernorm_backward(*_bwd_args(), version="v5", blocks_per_sm=2, grid=10)
    with pytest.raises(TypeError, match="dout must be a CuPy array"):   # valid settings: on to the GPU checks
        _hip().layernorm_backward(*_bwd_args(), version="v5", blocks_per_sm=2)


def test_hip_v5_entry_point_choice():
    """The smallest register budget that covers C; float4 only for C % 4 == 0 and aligned arrays; None above
    32 floats per lane (the launcher runs v3 then)."""
    pick = _hip().v5_entry_point
    assert pick(768, 32, True) == "layernorm_backward_v5_w4_k6"       # GPT-2 small on NVIDIA: 6 float4 per lane
    assert pick(768, 64, True) == "layernorm_backward_v5_w4_k3"       # ... on AMD CDNA (64 lanes)
    assert pick(1024, 32, True) == "layernorm_backward_v5_w4_k8"
    assert pick(1028, 32, True) is None and pick(2052, 64, True) is None
    assert pick(1028, 64, True) == "layernorm_backward_v5_w4_k6"
    assert pick(4, 32, True) == "layernorm_backward_v5_w4_k1"
    assert pick(768, 32, False) == "layernorm_backward_v5_w1_k32"     # misaligned: scalar loads
    assert pick(771, 32, True) == "layernorm_backward_v5_w1_k32"      # C % 4 != 0: scalar loads
    assert pick(1, 32, True) == "layernorm_backward_v5_w1_k1"
    assert pick(100, 32, False) == "layernorm_backward_v5_w1_k4"
    assert pick(1025, 32, False) is None and pick(2048, 64, False) == "layernorm_backward_v5_w1_k32"
    # every name it can return is an entry point of layernorm.cu
    from gpullm_lessons.runtime import hip
    src = hip.source_path("layernorm").read_text()
    for k in _hip().V5_F4_K:
        assert f"LN_V5_ENTRY(4, {k}," in src
    for k in _hip().V5_F1_K:
        assert f"LN_V5_ENTRY(1, {k}," in src


def test_hip_v4_grid_heuristic():
    """v4's grid: as many blocks as fit at once by register count (H200: 132 SMs, 170 registers, 256 threads: one
    block per SM); a kernel without num_regs keeps the guess of 2 per SM."""
    from types import SimpleNamespace

    from gpullm_lessons.runtime import hip
    props = {"multiProcessorCount": 132, "warpSize": 32, "regsPerMultiprocessor": 65536,
             "maxThreadsPerMultiProcessor": 2048}
    assert hip.resident_blocks(SimpleNamespace(num_regs=170), 256, props) == 132
    assert hip.resident_blocks(SimpleNamespace(num_regs=32), 256, props) == 132 * 8
    assert hip.resident_blocks(object(), 256, props) == 264


def test_hip_wrapper_wants_cupy_arrays():
    with pytest.raises(TypeError, match="dout must be a CuPy array"):
        _hip().layernorm_backward(*_bwd_args())
    with pytest.raises(TypeError, match="inp must be a CuPy array"):
        _hip().layernorm_forward(*_fwd_args())


# ---- (c) on a GPU: every version, both backends, large and awkward sizes ---------------------------------------------

def _hip_or_skip():
    pytest.importorskip("cupy", reason="HIP kernels are launched through CuPy")
    return _hip()


@pytest.mark.gpu
@needs_numba_gpu
@pytest.mark.parametrize("size", ["small", "large"])
@pytest.mark.parametrize("version", nb.VERSIONS)
def test_numba_backward_on_gpu(version, size):
    for threads in ((64, 256) if version != "v1" else (32, 128)):
        r = check_layernorm_backward(lambda *a: nb.layernorm_backward(*a, version=version, threads=threads),
                                     arrays="numba", size=size, quiet=True)
        assert r.passed, f"threads={threads}: {r.message}"


@pytest.mark.gpu
@pytest.mark.parametrize("size", ["small", "large"])
@pytest.mark.parametrize("version", _hip().VERSIONS)
def test_hip_backward_on_gpu(version, size):
    hipln = _hip_or_skip()
    for threads in (64, 256):
        r = check_layernorm_backward(lambda *a: hipln.layernorm_backward(*a, version=version, threads=threads),
                                     arrays="cupy", size=size, quiet=True)
        assert r.passed, f"threads={threads}: {r.message}"


AWKWARD = [(1, 1), (3, 5), (37, 771), (1000, 768), (4097, 1023)]


@pytest.mark.gpu
@needs_numba_gpu
@pytest.mark.parametrize("version", nb.VERSIONS)
def test_numba_forward_on_gpu(version):
    for N, C in AWKWARD:
        check_forward(lambda *a: nb.layernorm_forward(*a, version=version, threads=128), "numba", N, C)


@pytest.mark.gpu
@pytest.mark.parametrize("version", _hip().FORWARD_VERSIONS)
def test_hip_forward_on_gpu(version):
    hipln = _hip_or_skip()
    for N, C in AWKWARD:
        check_forward(lambda *a: hipln.layernorm_forward(*a, version=version, threads=128), "cupy", N, C)


@pytest.mark.gpu
@pytest.mark.parametrize("backend,version", [("numba", "v3")] + [("hip", v) for v in _hip().VERSIONS])
def test_backward_dparams_deterministic_on_gpu(backend, version):
    """The two-stage reductions (no atomics) give bit-identical dweight/dbias run after run, every HIP version."""
    if backend == "numba" and not device.numba_on_gpu():
        pytest.skip("Numba kernels run on NVIDIA GPUs only")
    mod, arrays = (nb, "numba") if backend == "numba" else (_hip_or_skip(), "cupy")
    rng = np.random.default_rng(0)
    N, C = 4099, 768
    inp = rng.standard_normal((N, C)).astype(np.float32)
    mean, rstd = (x.astype(np.float32) for x in reference.layernorm_stats(inp))
    host = [rng.standard_normal((N, C)).astype(np.float32), inp, rng.standard_normal(C).astype(np.float32),
            mean, rstd]
    results = []
    for _ in range(3):
        outs = [to_backend(np.full(s, np.nan, np.float32), arrays) for s in ((N, C), (C,), (C,))]
        mod.layernorm_backward(*(to_backend(x, arrays) for x in host), *outs, version=version)
        results.append([to_numpy(o) for o in outs])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            np.testing.assert_array_equal(a, b)


def _check_v4_v5(N, C, offset, runs_kwargs):
    """Run the HIP backward with each kwargs of runs_kwargs three times on one input (arrays starting `offset`
    floats into their buffers, outputs NaN-filled); each must match float64 and give bit-identical results."""
    cp = pytest.importorskip("cupy")
    hipln = _hip_or_skip()
    rng = np.random.default_rng(N + C)
    inp = (rng.standard_normal((N, C)) + rng.standard_normal((N, 1))).astype(np.float32)
    mean, rstd = (x.astype(np.float32) for x in reference.layernorm_stats(inp))
    dout = rng.standard_normal((N, C)).astype(np.float32)
    weight = rng.normal(1.0, 0.5, C).astype(np.float32)
    _, cache = reference.layernorm_forward(inp.astype(np.float64), weight.astype(np.float64), np.zeros(C))
    cache["mean"], cache["rstd"] = mean.astype(np.float64), rstd.astype(np.float64)
    expected = reference.layernorm_backward(dout.astype(np.float64), cache)

    def placed(a):   # a C-contiguous view that starts `offset` floats into its buffer
        buf = cp.full(a.size + offset, cp.nan, cp.float32)
        view = buf[offset:].reshape(a.shape)
        view[...] = cp.asarray(a)
        return view
    args = [placed(x) for x in (dout, inp, weight)] + [cp.asarray(mean), cp.asarray(rstd)]
    for kwargs in runs_kwargs:
        runs = []
        for _ in range(3):
            outs = [placed(np.full(s, np.nan, np.float32)) for s in ((N, C), (C,), (C,))]
            hipln.layernorm_backward(*args, *outs, **kwargs)
            runs.append([o.get() for o in outs])
        for name, got, e in zip(("dinp", "dweight", "dbias"), runs[0], expected):
            assert np.isfinite(got).all(), f"{kwargs}: {name}: NaN/unwritten elements"
            # judged against the size of the terms: dinp's rstd * dout * weight, the sums' dout * sqrt(N)
            terms = (np.abs(rstd).max() * np.abs(dout * weight).max() if name == "dinp"
                     else np.abs(dout).max() * np.sqrt(N))
            scale = max(np.abs(e).max(), terms)
            assert np.abs(got - e).max() <= 2e-5 * scale, \
                f"{kwargs}: {name}: max err {np.abs(got - e).max():.3g}, scale {scale:.3g}"
        for other in runs[1:]:
            for a, b in zip(runs[0], other):
                np.testing.assert_array_equal(a, b, err_msg=f"{kwargs}: not bit-identical run to run")


V4_V5_SHAPES = [(4099, 768, 0), (1000, 1024, 0), (37, 771, 0), (300, 768, 1), (5, 4, 0), (1, 1, 0), (64, 2052, 0),
                (33, 1028, 0), (129, 4, 0), (70, 100, 0), (17, 2048, 0)]


@pytest.mark.gpu
@pytest.mark.parametrize("N,C,offset", V4_V5_SHAPES)
@pytest.mark.parametrize("threads", [64, 256, 1024])
@pytest.mark.parametrize("version", ["v4", "v5"])
def test_hip_v4_v5_paths_and_determinism_on_gpu(version, N, C, offset, threads):
    """v4/v5's float4 path (C % 4 == 0, aligned; C = 100: lanes past the row's end), their scalar path (C = 771,
    or arrays starting 4 * offset bytes past 16-byte alignment), rows too wide for them (C = 2052 > 32 * 32 on
    NVIDIA, > 32 * 64 on AMD: v3; C = 1028 and 2048: v3 on NVIDIA, float4 on AMD), N not a multiple of the block's
    rows; against float64, and bit-identical dweight/dbias over three runs (no atomics). threads=1024 is lowered to
    what the kernel allows."""
    _check_v4_v5(N, C, offset, [dict(version=version, threads=threads)])


@pytest.mark.gpu
@pytest.mark.parametrize("N,C,offset", [(16384, 768, 0), (4099, 768, 0), (1000, 1024, 0), (37, 771, 0),
                                        (300, 768, 1), (3, 8, 0)])
def test_hip_v5_tunables_on_gpu(N, C, offset):
    """v5 over the sweep's grid of settings: a single block doing every row, a few blocks (rows per warp not a
    whole number), more blocks than rows (capped), 1..8 blocks per SM, 64..512 threads; each right and
    deterministic."""
    settings = [dict(grid=1), dict(grid=7), dict(grid=100_000)]
    settings += [dict(threads=t, blocks_per_sm=b) for t in (64, 128, 256, 512) for b in (1, 3, 8)]
    settings += [dict(threads=t) for t in (128, 512)]
    _check_v4_v5(N, C, offset, [dict(version="v5", **s) for s in settings])


# ---- residual=: the gradient past the sublayer added into dinp (the engine's residual stream) -----------------------

def _residual_case(N, C, seed):
    rng = np.random.default_rng(seed)
    inp = (rng.standard_normal((N, C)) + rng.standard_normal((N, 1))).astype(np.float32)
    mean, rstd = (x.astype(np.float32) for x in reference.layernorm_stats(inp))
    dout = rng.standard_normal((N, C)).astype(np.float32)
    weight = rng.normal(1.0, 0.5, C).astype(np.float32)
    residual = (rng.standard_normal((N, C)) * 3).astype(np.float32)
    return [dout, inp, weight, mean, rstd], residual


@pytest.mark.parametrize("module", ["numba", "numpy"])
def test_residual_is_added_into_dinp(module):
    """residual=: dinp = the launcher's dinp without it + residual, bit for bit (the add after the kernels), and the
    parameter gradients unchanged; the residual is refused when it is dinp itself or of another shape."""
    from gpullm_lessons.backends import numpy as np_backend

    mod = nb if module == "numba" else np_backend
    kw = {"version": "v1"} if module == "numba" else {}
    args, residual = _residual_case(6, 40, seed=secrets.randbelow(1_000_000))
    plain = [np.full(s, np.nan, np.float32) for s in ((6, 40), (40,), (40,))]
    mod.layernorm_backward(*args, *plain, **kw)
    outs = [np.full(s, np.nan, np.float32) for s in ((6, 40), (40,), (40,))]
    kept = residual.copy()
    mod.layernorm_backward(*args, *outs, residual=residual, **kw)
    np.testing.assert_array_equal(outs[0], plain[0] + residual)
    np.testing.assert_array_equal(outs[1], plain[1])
    np.testing.assert_array_equal(outs[2], plain[2])
    np.testing.assert_array_equal(residual, kept)  # read, not written
    assert not np.array_equal(outs[0], plain[0])
    if module == "numba":
        with pytest.raises(ValueError, match="residual must be another array than dinp"):
            nb.layernorm_backward(*args, outs[0], outs[1], outs[2], residual=outs[0], version="v1")
        with pytest.raises(ValueError, match="residual"):
            nb.layernorm_backward(*args, *outs, residual=residual[:5], version="v1")


@pytest.mark.gpu
@pytest.mark.parametrize("N,C,offset", [(16384, 768, 0), (4099, 768, 0), (37, 771, 0), (300, 768, 1), (70, 100, 0),
                                        (64, 2052, 0), (1, 1, 0)])
@pytest.mark.parametrize("version", ["v5", "v3"])
def test_hip_residual_on_gpu(version, N, C, offset):
    """residual= on the GPU: v5 adds it in its own pass (the _res entry points, float4 and scalar; C = 2052: v3 and
    the add), the others after the kernel. dinp within one float32 rounding of (the same call's dinp without the
    residual) + residual (the kernel may fuse the add into an fma), dweight and dbias the same bits, the residual
    untouched; shown failing on the residual left out and on it added twice."""
    cp = pytest.importorskip("cupy")
    hipln = _hip_or_skip()
    host, residual = _residual_case(N, C, seed=N * 7 + C)

    def placed(a):  # a C-contiguous view that starts `offset` floats into its buffer
        buf = cp.full(a.size + offset, cp.nan, cp.float32)
        view = buf[offset:].reshape(a.shape)
        view[...] = cp.asarray(a)
        return view

    args = [placed(x) for x in host[:3]] + [cp.asarray(x) for x in host[3:]]
    plain = [placed(np.full(s, np.nan, np.float32)) for s in ((N, C), (C,), (C,))]
    hipln.layernorm_backward(*args, *plain, version=version)
    res = placed(residual)
    outs = [placed(np.full(s, np.nan, np.float32)) for s in ((N, C), (C,), (C,))]
    hipln.layernorm_backward(*args, *outs, version=version, residual=res)
    got, base = outs[0].get().astype(np.float64), plain[0].get().astype(np.float64)
    want = base + residual
    tol = 2.0**-23 * (np.abs(base) + np.abs(residual) + np.abs(want)) + 1e-30
    assert np.all(np.abs(got - want) <= tol), float(np.max(np.abs(got - want) / tol))
    np.testing.assert_array_equal(outs[1].get(), plain[1].get())
    np.testing.assert_array_equal(outs[2].get(), plain[2].get())
    np.testing.assert_array_equal(res.get(), residual)
    for wrong in (base, base + 2 * residual):
        assert not np.all(np.abs(got - wrong) <= tol)
    with pytest.raises(ValueError, match="residual must be another array than dinp"):
        hipln.layernorm_backward(*args, *outs, version=version, residual=outs[0])


@pytest.mark.parametrize("half", ["bf16", "fp16"])
@pytest.mark.parametrize("module", ["numba", "numpy"])
def test_half_copy_is_dinp_rounded(module, half):
    """dinp_half= (with residual): the half bits of the very dinp written, rounded to nearest even; refused without
    a residual or a format, or of another shape or type."""
    from gpullm_lessons.backends import numpy as np_backend
    from gpullm_lessons.model.precision import f32_to_bf16_bits

    mod = nb if module == "numba" else np_backend
    kw = {"version": "v1"} if module == "numba" else {}
    args, residual = _residual_case(5, 24, seed=secrets.randbelow(1_000_000))
    outs = [np.full(s, np.nan, np.float32) for s in ((5, 24), (24,), (24,))]
    bits = np.zeros((5, 24), np.uint16)
    mod.layernorm_backward(*args, *outs, residual=residual, dinp_half=bits, half=half, **kw)
    want = f32_to_bf16_bits(outs[0]) if half == "bf16" else outs[0].astype(np.float16).view(np.uint16)
    np.testing.assert_array_equal(bits, want)
    assert np.isfinite(outs[0]).all()
    truncated = (outs[0].view(np.uint32) >> 16).astype(np.uint16)
    assert half == "fp16" or not np.array_equal(bits, truncated)  # the rounding, not the top 16 bits
    if module == "numba":
        with pytest.raises(ValueError, match="dinp_half is written with a residual"):
            nb.layernorm_backward(*args, *outs, dinp_half=bits, half=half, version="v1")
        with pytest.raises(ValueError, match="dinp_half needs half='bf16' or 'fp16'"):
            nb.layernorm_backward(*args, *outs, residual=residual, dinp_half=bits, half="bf8", version="v1")
        with pytest.raises(ValueError, match=r"dinp_half has shape \(4, 24\), expected \(5, 24\)"):
            nb.layernorm_backward(*args, *outs, residual=residual, dinp_half=bits[:4], half=half, version="v1")
        with pytest.raises((TypeError, ValueError), match="dinp_half.*uint16"):
            nb.layernorm_backward(*args, *outs, residual=residual, dinp_half=outs[0].copy(), half=half, version="v1")


@pytest.mark.gpu
@pytest.mark.parametrize("N,C,offset", [(16384, 768, 0), (37, 771, 0), (300, 768, 1), (70, 100, 0), (64, 2052, 0)])
@pytest.mark.parametrize("half", ["bf16", "fp16"])
def test_hip_half_copy_on_gpu(half, N, C, offset):
    """dinp_half= on the GPU: v5's _res_half entry points (float4 with 8-byte half stores, scalar) and, for C = 2052,
    v3 and the conversion kernel: the half bits are dinp's own values rounded to nearest even, bit for bit, and dinp,
    dweight, dbias are the residual call's without a copy, bit for bit."""
    cp = pytest.importorskip("cupy")
    hipln = _hip_or_skip()
    from gpullm_lessons.model.precision import f32_to_bf16_bits

    host, residual = _residual_case(N, C, seed=N + 3 * C)

    def placed(a, dtype=cp.float32, fill=cp.nan):
        buf = cp.full(a.size + offset, fill, dtype)
        view = buf[offset:].reshape(a.shape)
        view[...] = cp.asarray(a)
        return view

    args = [placed(x) for x in host[:3]] + [cp.asarray(x) for x in host[3:]]
    res = placed(residual)
    plain = [placed(np.full(s, np.nan, np.float32)) for s in ((N, C), (C,), (C,))]
    hipln.layernorm_backward(*args, *plain, version="v5", residual=res)
    outs = [placed(np.full(s, np.nan, np.float32)) for s in ((N, C), (C,), (C,))]
    bits = placed(np.zeros((N, C), np.uint16), cp.uint16, 0)
    hipln.layernorm_backward(*args, *outs, version="v5", residual=res, dinp_half=bits, half=half)
    for got, want in zip(outs, plain):
        np.testing.assert_array_equal(got.get(), want.get())
    d = outs[0].get()
    want = f32_to_bf16_bits(d) if half == "bf16" else d.astype(np.float16).view(np.uint16)
    np.testing.assert_array_equal(bits.get(), want)
