"""softmax_backward kernels (kernels/numba/softmax.py, kernels/hip/softmax.cu) against check_softmax_backward.

Simulator (CI): v1 and v2 with toy block sizes (the simulator runs every CUDA thread in Python), v3 and v4 with the
launcher's GPU guard lifted (simwarp's shuffles), broken launches
the checker must catch, wrapper validation. GPU (`make gpu-test`): every version on both backends at the checker's
large sizes and at awkward ones (n not a multiple of the block, n much longer than the block, one row).
"""
import numpy as np
import pytest

from gpullm_lessons import device
from gpullm_lessons.checks.backward import check_softmax_backward
from gpullm_lessons.kernels.numba import softmax as nb
from gpullm_lessons.reference import softmax_backward as ref_softmax_backward, softmax_forward

SIM_VERSIONS = [v for v in nb.KERNELS if v not in nb.GPU_ONLY]
# the HIP launcher's versions (importing it needs neither cupy nor a GPU)
from gpullm_lessons.backends.hip.softmax import VERSIONS as HIP_VERSIONS  # noqa: E402
needs_numba_gpu = pytest.mark.skipif(not device.numba_on_gpu(),
                                     reason=f"needs Numba on an NVIDIA GPU (this machine: {device.kind()})")


def inputs(N, n, seed=0):
    """dout (N, n), out = softmax of random logits (N, n), and the float64 reference dinp."""
    rng = np.random.default_rng(seed)
    out = softmax_forward(rng.standard_normal((N, n)) * 3)[0].astype(np.float32)
    dout = rng.standard_normal((N, n)).astype(np.float32)
    expected = ref_softmax_backward(dout.astype(np.float64), {"out": out.astype(np.float64)})
    return dout, out, expected


# ---- (a) the simulator-capable versions pass their checker; broken launches are caught ------------------------------

@pytest.mark.parametrize("threads", [None, 1, 8])
@pytest.mark.parametrize("version", SIM_VERSIONS)
def test_numba_versions_pass_the_checker(version, threads):
    if version == "v2" and threads is None and not device.numba_on_gpu():
        threads = 4   # the default 256 threads per row is slow in the simulator
    r = check_softmax_backward(lambda *a: nb.softmax_backward(*a, version=version, threads=threads),
                               arrays="numba", quiet=True)
    assert r.passed, r.message


def test_default_version_and_threads_run_here():
    # no version=: v3 on a GPU, v2 (32 threads per row) in the simulator
    from gpullm_lessons.runtime.arrays import to_backend, to_numpy
    dout, out, expected = inputs(3, 45)
    arrays = "numba"
    dinp = to_backend(np.full_like(out, np.nan), arrays)
    nb.softmax_backward(to_backend(dout, arrays), to_backend(out, arrays), dinp)
    terms = np.abs(out.astype(np.float64) * dout).max()
    np.testing.assert_allclose(to_numpy(dinp), expected, rtol=1e-5, atol=1e-5 * terms)


def test_v1_with_too_few_blocks_is_caught():
    # one block of 2 threads: only rows 0 and 1 are written (the checker's N is at least 3)
    r = check_softmax_backward(lambda d, o, di: nb.KERNELS["v1"][1, 2](d, o, di), arrays="numba", quiet=True)
    assert r.status == "wrong" and "never written" in r.hint, r.message


def test_v2_missing_the_last_row_is_caught():
    r = check_softmax_backward(lambda d, o, di: nb.KERNELS["v2"][d.shape[0] - 1, 4](d, o, di),
                               arrays="numba", quiet=True)
    assert r.status == "wrong", r.message


def test_v2_tree_with_a_non_power_of_two_block_is_caught():
    # 6 threads: the tree adds 3 + 3, then 1 + 1, and partial[2] is never added: wrong row sums
    r = check_softmax_backward(lambda d, o, di: nb.KERNELS["v2"][d.shape[0], 6](d, o, di),
                               arrays="numba", quiet=True, seed=3)
    assert r.status == "wrong", r.message


@pytest.mark.skipif(device.numba_on_gpu(), reason="on a GPU the warp versions run")
@pytest.mark.parametrize("version", sorted(nb.GPU_ONLY))
def test_gpu_only_versions_refuse_the_simulator(version):
    dout, out, _ = inputs(3, 5)
    with pytest.raises(RuntimeError, match="simulator"):
        nb.softmax_backward(dout, out, np.empty_like(out), version=version)


@pytest.mark.skipif(device.numba_on_gpu(), reason="on a GPU test_numba_on_gpu runs them")
@pytest.mark.parametrize("version", sorted(nb.GPU_ONLY))
def test_warp_versions_pass_the_checker_in_the_simulator(version, monkeypatch):
    """The launcher keeps v3 and v4 for a GPU; with that guard lifted they run here on simwarp's shuffles, through
    the checker, at 64 threads (two warps a block)."""
    monkeypatch.setattr(nb, "GPU_ONLY", set())
    r = check_softmax_backward(lambda *a: nb.softmax_backward(*a, version=version, threads=64), arrays="numba",
                               quiet=True)
    assert r.passed, r.message


def test_docstring_names_every_version_and_gpu_only_ones():
    assert set(nb.GPU_ONLY) <= set(nb.KERNELS) and set(nb.KERNELS) == set(nb.SIGNATURES)
    assert "GPU-only" in nb.__doc__


# ---- (b) wrapper input validation --------------------------------------------------------------------------------

def test_numba_wrapper_validates_inputs():
    dout, out, _ = inputs(4, 6)
    dinp = np.empty_like(out)
    with pytest.raises(ValueError, match=r"dinp has shape \(4, 5\), expected \(4, 6\)"):
        nb.softmax_backward(dout, out, dinp[:, :5].copy(), version="v1")
    with pytest.raises(ValueError, match=r"out has shape \(6, 4\), expected \(4, 6\)"):
        nb.softmax_backward(dout, out.T.copy(), dinp, version="v1")
    with pytest.raises(TypeError, match="out must be float32, got dtype float64"):
        nb.softmax_backward(dout, out.astype(np.float64), dinp, version="v1")
    with pytest.raises(ValueError, match=r"dout must be 2-D, got shape \(24,\)"):
        nb.softmax_backward(dout.ravel(), out.ravel(), dinp.ravel(), version="v1")
    with pytest.raises(TypeError, match="dinp must be an array"):
        nb.softmax_backward(dout, out, dinp.tolist(), version="v1")
    with pytest.raises(ValueError, match="version='v9' is not one of v1, v2, v3, v4"):
        nb.softmax_backward(dout, out, dinp, version="v9")
    with pytest.raises(ValueError, match="power-of-two threads, got 48"):
        nb.softmax_backward(dout, out, dinp, version="v2", threads=48)
    with pytest.raises(ValueError, match=r"threads=2048 must be in \[1, 1024\]"):
        nb.softmax_backward(dout, out, dinp, version="v1", threads=2048)


def test_hip_wrapper_rejects_unknown_versions_without_a_gpu():
    from gpullm_lessons.backends.hip import softmax as hip_softmax
    dout, out, _ = inputs(2, 3)
    with pytest.raises(ValueError, match="version='v0' is not one of v1, v2, v3, v4, v5"):
        hip_softmax.softmax_backward(dout, out, np.empty_like(out), version="v0")


def test_hip_v6_v7_settings_validated_without_a_gpu():
    from gpullm_lessons.backends.hip import softmax as hs
    dout, out, _ = inputs(2, 4)
    with pytest.raises(ValueError, match="rows_per_block= is a v6 setting; version 'v5'"):
        hs.softmax_backward(dout, out, np.empty_like(out), version="v5", rows_per_block=2)
    with pytest.raises(ValueError, match="blocks_per_sm= is a v6/v7 setting; version 'v4'"):
        hs.softmax_backward(dout, out, np.empty_like(out), version="v4", blocks_per_sm=2)
    with pytest.raises(ValueError, match=r"blocks_per_sm=-1, expected an int >= 0"):
        hs.softmax_backward(dout, out, np.empty_like(out), version="v7", blocks_per_sm=-1)
    with pytest.raises(ValueError, match=r"blocks_per_sm=True"):
        hs.softmax_backward(dout, out, np.empty_like(out), version="v6", blocks_per_sm=True)


def test_hip_v6_v7_plans():
    """Which entry point (K float4 per thread), block and rows per block v6/v7 launch, computed without a GPU."""
    from gpullm_lessons.backends.hip.softmax import v6_plan, v7_plan
    fn = "softmax_backward"
    assert v6_plan(fn, 1024, 32) == (4, 256, 4)             # default: 2 warps per row, 4 rows per block
    assert v6_plan(fn, 1024, 64) == (4, 256, 4)             # AMD: one wavefront per row
    assert v6_plan(fn, 1024, 32, threads=512) == (4, 512, 8)
    assert v6_plan(fn, 1024, 32, threads=64) == (4, 64, 1)
    assert v6_plan(fn, 1024, 32, threads=256, rows_per_block=8) == (8, 256, 8)    # one warp per row
    assert v6_plan(fn, 1024, 32, threads=256, rows_per_block=1) == (1, 256, 1)    # 8 warps per row
    assert v6_plan(fn, 1024, 32, rows_per_block=2) == (4, 128, 2)
    assert v6_plan(fn, 768, 32) == (4, 256, 4)              # 768 <= 4 * 4 * 64
    assert v6_plan(fn, 4, 32) == (1, 256, 8)
    assert v6_plan(fn, 16384, 32) == (4, 1024, 1)
    assert v6_plan(fn, 16388, 32) is None                   # longer rows: the launcher runs v5
    with pytest.raises(ValueError, match="whole warps"):
        v6_plan(fn, 1024, 32, threads=256, rows_per_block=3)
    with pytest.raises(ValueError, match="at most 32 floats per thread"):
        v6_plan(fn, 2048, 32, threads=256, rows_per_block=8)
    with pytest.raises(ValueError, match="at most 512 threads"):
        v6_plan(fn, 1024, 32, threads=1024, rows_per_block=32)
    with pytest.raises(ValueError, match="rows_per_block=0"):
        v6_plan(fn, 1024, 32, rows_per_block=0)
    assert v7_plan(fn, 1024, 32) == (8, 128)
    assert v7_plan(fn, 1024, 64) == (4, 128)
    assert v7_plan(fn, 1028, 32) is None and v7_plan(fn, 100, 32) == (1, 128)
    with pytest.raises(ValueError, match="at most 256 threads"):
        v7_plan(fn, 1024, 32, threads=512)
    # every entry point a plan can name exists in softmax.cu, with the block limit the launcher assumes
    from gpullm_lessons.runtime import hip
    from gpullm_lessons.backends.hip.softmax import V6_MAX_THREADS, V7_MAX_THREADS
    src = hip.source_path("softmax").read_text()
    for k, lb in V6_MAX_THREADS.items():
        assert f"SMX_V6_ENTRY({k}, {lb})" in src
    for k, lb in V7_MAX_THREADS.items():
        assert f"SMX_V7_ENTRY({k}, {lb})" in src


# ---- (c) GPU: every version, both backends, large and awkward sizes ------------------------------------------------

@needs_numba_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("size", ["small", "large"])
@pytest.mark.parametrize("version", list(nb.KERNELS))
def test_numba_on_gpu(version, size):
    r = check_softmax_backward(lambda *a: nb.softmax_backward(*a, version=version), arrays="numba", size=size)
    assert r.passed, r.message


@needs_numba_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("version,threads", [("v1", 32), ("v1", 1024), ("v2", 32), ("v2", 1024), ("v3", 32),
                                             ("v3", 1024), ("v4", 32), ("v4", 1024)])
def test_numba_on_gpu_other_block_sizes_and_cupy_arrays(version, threads):
    pytest.importorskip("cupy")
    r = check_softmax_backward(lambda *a: nb.softmax_backward(*a, version=version, threads=threads),
                               arrays="cupy", size="large")
    assert r.passed, r.message


@pytest.mark.gpu
@pytest.mark.parametrize("size", ["small", "large"])
@pytest.mark.parametrize("version", HIP_VERSIONS)
def test_hip_on_gpu(version, size):
    pytest.importorskip("cupy")
    from gpullm_lessons.backends.hip.softmax import softmax_backward
    r = check_softmax_backward(lambda *a: softmax_backward(*a, version=version), arrays="cupy", size=size)
    assert r.passed, r.message


@pytest.mark.gpu
@pytest.mark.parametrize("version,threads", [("v1", 1), ("v2", 64), ("v2", 1024), ("v3", 64), ("v3", 1024),
                                             ("v4", 64), ("v4", 1024), ("v5", 64), ("v5", 1024), ("v6", 64),
                                             ("v6", 1024), ("v7", 64), ("v7", 256)])
def test_hip_on_gpu_other_block_sizes(version, threads):
    pytest.importorskip("cupy")
    from gpullm_lessons.backends.hip.softmax import softmax_backward
    fn = lambda *a: softmax_backward(*a, version=version, threads=threads)  # noqa: E731
    if version == "v6":
        # v6 keeps a row in registers (at most 32 floats a thread): the large cases' vocabulary row (n = 50257)
        # does not fit any block, and the launcher says so instead of computing it wrong
        r = check_softmax_backward(fn, arrays="cupy", size="large")
        assert r.status == "error" and "holds at most 32 floats per thread" in r.message, r.message
        r = check_softmax_backward(fn, arrays="cupy", size="small")
    else:
        r = check_softmax_backward(fn, arrays="cupy", size="large")
    assert r.passed, r.message


@pytest.mark.gpu
@pytest.mark.parametrize("N,n", [(1, 1), (3, 50_001), (1025, 33), (70, 1)])
@pytest.mark.parametrize("backend", ["numba", "hip"])
@pytest.mark.parametrize("version", HIP_VERSIONS)
def test_awkward_shapes_on_gpu(version, backend, N, n):
    """A single element, rows far longer than a block, a row count just past a block, rows of length 1."""
    cp = pytest.importorskip("cupy")
    if backend == "numba":
        if version not in nb.KERNELS:
            pytest.skip(f"{version} is a HIP-only version")
        if not device.numba_on_gpu():
            pytest.skip("Numba kernels run on NVIDIA GPUs only")
        fn = nb.softmax_backward
    else:
        from gpullm_lessons.backends.hip.softmax import softmax_backward as fn
    dout, out, expected = inputs(N, n, seed=N + n)
    dinp = cp.full((N, n), cp.nan, cp.float32)
    fn(cp.asarray(dout), cp.asarray(out), dinp, version=version)
    terms = np.abs(out.astype(np.float64) * dout).max()
    np.testing.assert_allclose(dinp.get(), expected, rtol=1e-5, atol=1e-5 * max(terms, np.abs(expected).max()))


@pytest.mark.gpu
@pytest.mark.parametrize("N,n,offset", [(1000, 1024, 0), (33, 2052, 0), (5, 4, 0), (70, 1024, 1), (9, 64, 3)])
@pytest.mark.parametrize("threads", [64, 256, 1024])
def test_hip_v5_float4_path_on_gpu(N, n, offset, threads):
    """v5's float4 path (n % 4 == 0): rows of exactly the register cache on 32-lane warps (1024), rows longer than
    it (2052: a tail read again), tiny rows; offset > 0 starts the arrays 4 * offset bytes past 16-byte alignment,
    which must take the scalar path and still be right."""
    cp = pytest.importorskip("cupy")
    from gpullm_lessons.backends.hip.softmax import softmax_backward
    dout, out, expected = inputs(N, n, seed=N + n)

    def placed(a):   # a C-contiguous (N, n) view that starts `offset` floats into its buffer
        buf = cp.full(a.size + offset, cp.nan, cp.float32)
        view = buf[offset:].reshape(a.shape)
        view[...] = cp.asarray(a)
        return view
    dinp = placed(np.full((N, n), np.nan, np.float32))
    softmax_backward(placed(dout), placed(out), dinp, version="v5", threads=threads)
    terms = np.abs(out.astype(np.float64) * dout).max()
    np.testing.assert_allclose(dinp.get(), expected, rtol=1e-5, atol=1e-5 * max(terms, np.abs(expected).max()))


@pytest.mark.gpu
def test_hip_wrapper_validates_inputs_on_gpu():
    cp = pytest.importorskip("cupy")
    from gpullm_lessons.backends.hip.softmax import softmax_backward
    from gpullm_lessons.runtime.hip import warp_size
    dout, out, _ = inputs(4, 6)
    d, o, di = cp.asarray(dout), cp.asarray(out), cp.empty((4, 6), cp.float32)
    with pytest.raises(TypeError, match="dout must be a CuPy array"):
        softmax_backward(dout, o, di)
    with pytest.raises(TypeError, match="out must be float32, got dtype float64"):
        softmax_backward(d, o.astype(cp.float64), di)
    with pytest.raises(ValueError, match=r"dinp has shape \(4, 5\), expected \(4, 6\)"):
        softmax_backward(d, o, cp.empty((4, 5), cp.float32))
    with pytest.raises(ValueError, match="dinp must be C-contiguous"):
        softmax_backward(d, o, cp.empty((6, 4), cp.float32).T)
    with pytest.raises(ValueError, match="power-of-two threads, got 96"):
        softmax_backward(d, o, di, version="v2", threads=96)
    with pytest.raises(ValueError, match="needs whole warps"):
        softmax_backward(d, o, di, version="v3", threads=warp_size() + 1)


V6_V7_SHAPES = [(16384, 1024, 0), (1000, 1024, 0), (4099, 768, 0), (33, 2052, 0), (5, 4, 0), (70, 1024, 1),
                (9, 64, 3), (3, 16384, 0), (2, 20000, 0), (31, 1028, 0), (7, 1030, 0), (1, 8, 0)]


def _check_placed(N, n, offset, runs_kwargs):
    """softmax_backward with each kwargs on (N, n) arrays starting `offset` floats into their buffers (offset > 0:
    not 16-byte aligned), dinp NaN-filled, against float64."""
    cp = pytest.importorskip("cupy")
    from gpullm_lessons.backends.hip.softmax import softmax_backward
    dout, out, expected = inputs(N, n, seed=N + n)

    def placed(a):
        buf = cp.full(a.size + offset, cp.nan, cp.float32)
        view = buf[offset:].reshape(a.shape)
        view[...] = cp.asarray(a)
        return view
    d, o = placed(dout), placed(out)
    atol = 1e-5 * max(np.abs(out.astype(np.float64) * dout).max(), np.abs(expected).max())
    exp_gpu = cp.asarray(expected)
    for kwargs in runs_kwargs:
        dinp = placed(np.full((N, n), np.nan, np.float32))
        softmax_backward(d, o, dinp, **kwargs)
        # on the GPU first (fast for many settings); NaN (unwritten) fails the <= test
        ok = bool((cp.abs(dinp.astype(cp.float64) - exp_gpu) <= 1e-5 * cp.abs(exp_gpu) + atol).all())
        if not ok:
            np.testing.assert_allclose(dinp.get(), expected, rtol=1e-5, atol=atol, err_msg=str(kwargs))
            raise AssertionError(f"{kwargs}: wrong on the GPU check")


@pytest.mark.gpu
@pytest.mark.parametrize("N,n,offset", V6_V7_SHAPES)
@pytest.mark.parametrize("version", ["v6", "v7"])
def test_hip_v6_v7_paths_on_gpu(version, N, n, offset):
    """v6/v7 default settings: the GPT-2 size, N not a multiple of the rows per block, rows longer than v7's
    registers (1028, 2052 on NVIDIA) or v6's (20000: both run v5), n % 4 != 0 (1030) and unaligned arrays (v5),
    tiny rows, one row."""
    _check_placed(N, n, offset, [dict(version=version)])


@pytest.mark.gpu
@pytest.mark.parametrize("N,n", [(16384, 1024), (4099, 1024), (37, 768), (1000, 2048)])
def test_hip_v6_v7_tunables_on_gpu(N, n):
    """The sweep's settings: threads 64..1024, 1..16 rows per block (1..8 warps per row, or one warp per row with
    K = 8), persistent grids of 1..8 blocks per SM and one row tile per block (blocks_per_sm=0)."""
    from gpullm_lessons.backends.hip.softmax import v6_plan
    from gpullm_lessons.runtime.hip import warp_size
    ws = warp_size()
    settings = []
    for threads in (64, 128, 256, 512, 1024):
        for rows in (1, 2, 4, 8, 16):
            try:
                v6_plan("t", n, ws, threads, rows)
            except ValueError:
                continue    # not a valid v6 shape for this n and warp size
            settings += [dict(version="v6", threads=threads, rows_per_block=rows, blocks_per_sm=b)
                         for b in (None, 0, 1, 8)]
    assert settings
    for threads in (ws, 2 * ws, 4 * ws):
        settings += [dict(version="v7", threads=threads, blocks_per_sm=b) for b in (None, 0, 1, 8)]
    _check_placed(N, n, 0, settings)
