"""Numba launchers launch on CuPy's current stream, so a CUDA graph captured on it records their kernels."""
import numpy as np
import pytest

import gpullm_lessons  # noqa: F401 - decides GPU or simulator before numba is imported
from gpullm_lessons import device
from gpullm_lessons.kernels import numba as knumba


def test_without_a_gpu_launches_go_on_numbas_default_stream():
    if device.numba_on_gpu():
        pytest.skip("on a GPU the stream is CuPy's (the test below)")
    assert knumba.launch_stream() == 0
    a = knumba.device_scratch((3, 5), np.float32)
    assert a.shape == (3, 5) and a.dtype == np.float32


def _capture(fn):
    """fn() captured on a fresh CuPy stream (its allocations from a pool of the capture's own): (graph, stream)."""
    import cupy as cp
    fn()                                                    # compile outside the capture
    cp.cuda.Device().synchronize()
    stream = cp.cuda.Stream(non_blocking=True)
    pool = cp.cuda.MemoryPool()
    with cp.cuda.using_allocator(pool.malloc), stream:
        stream.begin_capture(mode=cp.cuda.runtime.streamCaptureModeRelaxed)
        try:
            fn()
        finally:
            graph = stream.end_capture()
    return graph, stream, pool


def _replay(captured, outs):
    """Poison every output, replay the graph, return the outputs (a kernel left out of the graph leaves NaN)."""
    import cupy as cp
    graph, stream, _pool = captured
    for o in outs:
        o.fill(cp.nan)
    cp.cuda.Device().synchronize()
    graph.launch(stream)
    stream.synchronize()
    return outs


@pytest.mark.gpu
@pytest.mark.parametrize("version", ["v2", "v4"])
def test_a_numba_softmax_is_recorded_in_a_cupy_graph(version):
    import cupy as cp
    from gpullm_lessons.backends import numba as nbk
    if not device.numba_on_gpu():
        pytest.skip("Numba kernels run on NVIDIA GPUs only")
    rng = np.random.default_rng(1)
    dout = cp.asarray(rng.standard_normal((300, 700), dtype=np.float32))
    out = cp.asarray(rng.random((300, 700), dtype=np.float32))
    dinp = cp.empty_like(dout)
    (got,) = _replay(_capture(lambda: nbk.softmax_backward(dout, out, dinp, version=version)), [dinp])
    o, d = cp.asnumpy(out).astype(np.float64), cp.asnumpy(dout).astype(np.float64)
    want = o * (d - (o * d).sum(1, keepdims=True))
    assert not bool(cp.isnan(got).any()), "the replay left the output unwritten: the kernel was not captured"
    np.testing.assert_allclose(cp.asnumpy(got), want, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_a_numba_launcher_with_scratch_is_recorded_in_a_cupy_graph():
    """layernorm v2 allocates its column partials per call (device_scratch): inside a capture they must come from
    the capture's pool and stay valid for every replay."""
    import cupy as cp
    from gpullm_lessons import reference as ref
    from gpullm_lessons.backends import numba as nbk
    if not device.numba_on_gpu():
        pytest.skip("Numba kernels run on NVIDIA GPUs only")
    rng = np.random.default_rng(2)
    N, C = 1000, 96
    x = rng.standard_normal((N, C))
    w, b = rng.normal(1, 0.5, C), rng.standard_normal(C)
    _, cache = ref.layernorm_forward(x, w, b)
    dout = rng.standard_normal((N, C))
    want = ref.layernorm_backward(dout, cache)
    mean, rstd = ref.layernorm_stats(x)
    args = [cp.asarray(a.astype(np.float32)) for a in (dout, x, w, mean, rstd)]
    outs = [cp.empty((N, C), cp.float32), cp.empty(C, cp.float32), cp.empty(C, cp.float32)]
    fn = lambda: nbk.layernorm_backward(*args, *outs, version="v2")  # noqa: E731
    captured = _capture(fn)
    for _ in range(2):                                      # a second replay: the scratch is still the graph's
        for got, ref_out in zip(_replay(captured, outs), want):
            assert not bool(cp.isnan(got).any()), "the replay left an output unwritten"
            np.testing.assert_allclose(cp.asnumpy(got), ref_out, rtol=1e-3, atol=1e-4)
