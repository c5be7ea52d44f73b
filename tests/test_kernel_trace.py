"""kernel_trace: known answers for who wrote what, loads per thread, coalescing and shared memory (simulator)."""
import numpy as np
import pytest

from gpullm_lessons import device, viz
from gpullm_lessons.checks import kernel_trace

sim_only = pytest.mark.skipif(not device.info().simulator, reason="kernel tracing runs in the CUDA simulator only")

from numba import cuda  # noqa: E402  (after gpullm_lessons: the simulator is on)


def _hooks():
    """The simulator attributes the tracer patches while it records."""
    from numba.cuda.simulator.cudadrv.devicearray import FakeWithinKernelCUDAArray
    from numba.cuda.simulator.kernel import FakeCUDAKernel
    from numba.cuda.simulator.kernelapi import FakeCUDAAtomic, FakeCUDAModule, FakeCUDAShared
    return {(c.__name__, n): c.__dict__[n] for c, names in (
        (FakeWithinKernelCUDAArray, ("__getitem__", "__setitem__")), (FakeCUDAKernel, ("__call__",)),
        (FakeCUDAShared, ("array",)), (FakeCUDAAtomic, ("add", "max", "cas", "compare_and_swap")),
        (FakeCUDAModule, ("syncwarp",)))
        for n in names}


@sim_only
def test_thread_per_row_read_is_uncoalesced_32_sectors():
    @cuda.jit
    def row_sums(x, out):                  # lane i walks row i: neighbouring lanes are a row (32 bytes) apart
        i = cuda.grid(1)
        if i < x.shape[0]:
            s = 0.0
            for j in range(x.shape[1]):
                s += x[i, j]
            out[i] = s

    x = np.random.default_rng(0).standard_normal((64, 8)).astype(np.float32)
    out = np.zeros(64, np.float32)
    t = kernel_trace.trace(lambda x, out: row_sums[2, 32](x, out), x, out)
    np.testing.assert_allclose(out, x.sum(1), rtol=1e-5)          # the kernel really ran
    st = t.sectors_per_warp_load()
    assert st.histogram == {32: 16}                             # 2 blocks x 1 warp x 8 loads, 32 sectors each
    assert st.mean == 32.0 and st.full_warp_ideal == 4.0
    assert t.reads_per_thread[(0, 5)] == 8 and len(t.reads_per_thread) == 64
    s = t.summary()
    assert "each thread wrote 1 element of out" in s
    assert "32.0 sectors on average (ideal for fp32: 4 = 128 bytes / 32-byte sectors)" in s
    assert "uncoalesced" in s


@sim_only
def test_lane_per_column_read_is_coalesced_4_sectors():
    @cuda.jit
    def scale(x, out):                     # block r owns row r, lane j reads element j: 128 contiguous bytes
        r, j = cuda.blockIdx.x, cuda.threadIdx.x
        out[r, j] = 2 * x[r, j]

    x = np.ones((4, 32), np.float32)
    out = np.zeros_like(x)
    t = kernel_trace.trace(scale[4, 32], x, out)                 # a configured kernel works as fn too
    assert (out == 2).all()
    st = t.sectors_per_warp_load()
    assert st.histogram == {4: 4} and st.mean == 4.0 and st.ideal == 4.0
    assert t.sectors_per_warp_load("store").histogram == {4: 4}
    assert t.writer["out"][2, 7] == (2, 7)                       # (block, thread)
    assert not t.unwritten and not t.multiple_writers
    assert "warp loads touch 4.0 sectors on average (ideal for fp32: 4 = 128 bytes / 32-byte sectors)" in t.summary()
    assert "uncoalesced" not in t.summary()


@sim_only
def test_unwritten_elements_are_reported():
    @cuda.jit
    def copy_short(x, out):                # bug: the last row stops at column 7
        r, j = cuda.blockIdx.x, cuda.threadIdx.x
        if j < x.shape[1] and not (r == x.shape[0] - 1 and j >= 7):
            out[r, j] = x[r, j]

    x = np.ones((6, 10), np.float32)
    out = np.zeros_like(x)
    t = kernel_trace.trace(copy_short[6, 32], x, out)
    assert t.unwritten == {"out": [(5, 7), (5, 8), (5, 9)]}
    assert t.writer["out"][5, 7] is None and t.writer["out"][5, 6] == (5, 6)
    assert "3 of 60 elements of out never written: (5, 7), (5, 8), (5, 9)" in t.summary()


@sim_only
def test_two_threads_writing_one_element_are_flagged():
    @cuda.jit
    def halve(x, out):                     # bug: threads 2k and 2k + 1 both store out[k]
        i = cuda.grid(1)
        if i < x.shape[0]:
            out[i // 2] = x[i]

    x = np.arange(64, dtype=np.float32)
    out = np.zeros(32, np.float32)

    def launcher(x, out):                  # as a learner writes it: a launcher around the kernel
        halve[2, 32](x, out)

    t = kernel_trace.trace(launcher, x, out)
    rows = t.multiple_writers["out"]
    assert len(rows) == 32 and rows[0] == (0, [(0, 0), (0, 1)]) and rows[20] == (20, [(1, 8), (1, 9)])
    assert t.writer["out"][0] == [(0, 0), (0, 1)]
    s = t.summary()
    assert "32 elements of out written by several threads (a race)" in s
    assert "0 by block 0 thread 0, block 0 thread 1" in s


@sim_only
def test_atomics_are_not_a_race():
    @cuda.jit
    def bucket_sum(x, out):
        i = cuda.grid(1)
        if i < x.shape[0]:
            cuda.atomic.add(out, i % 4, x[i])

    x = np.ones(64, np.float32)
    out = np.zeros(4, np.float32)
    t = kernel_trace.trace(bucket_sum[2, 32], x, out)
    assert (out == 16).all()
    assert not t.multiple_writers and t.atomic_outputs == {"out": 16}
    assert t.reads_per_thread[(1, 3)] == 1                       # the load of x; the atomic is counted apart
    assert "updated with atomics, up to 16 threads per element" in t.summary()


@sim_only
def test_shared_memory_tile_counts_loads_stores_and_bank_conflicts():
    @cuda.jit
    def reverse_tile(x, out):              # stage 32 values in shared memory, write them back reversed
        tile = cuda.shared.array(32, np.float32)
        t = cuda.threadIdx.x
        i = cuda.blockIdx.x * 32 + t
        tile[t] = x[i]
        cuda.syncthreads()
        out[i] = tile[31 - t]

    @cuda.jit
    def strided_tile(x, out):              # word 2t: lanes t and t + 16 hit the same bank (2-way conflict)
        buf = cuda.shared.array(64, np.float32)
        t = cuda.threadIdx.x
        i = cuda.blockIdx.x * 32 + t
        buf[2 * t] = x[i]
        cuda.syncthreads()
        out[i] = buf[2 * t]

    x = np.arange(96, dtype=np.float32)
    out = np.zeros_like(x)
    t = kernel_trace.trace(reverse_tile[3, 32], x, out)
    assert (out.reshape(3, 32) == x.reshape(3, 32)[:, ::-1]).all()
    sh = t.shared_traffic
    assert set(sh) == {0, 1, 2}
    assert all(d["loads"] == 32 and d["stores"] == 32 and d["conflicted"] == 0 and d["max_ways"] == 1
               for d in sh.values())
    assert "tile" in {a.name for a in t.arrays.values() if a.space == "shared"}   # named after the variable
    assert "shared memory per block: 32 loads, 32 stores; no bank conflicts" in t.summary()

    t2 = kernel_trace.trace(strided_tile[3, 32], x, out)
    assert all(d["warp_accesses"] == 2 and d["conflicted"] == 2 and d["max_ways"] == 2
               for d in t2.shared_traffic.values())
    assert "6 of 6 warp accesses have bank conflicts (up to 2-way" in t2.summary()


def test_gpu_session_says_simulator_only_without_running(monkeypatch, capsys):
    monkeypatch.setattr(device, "numba_on_gpu", lambda: True)
    called = []
    t = kernel_trace.trace(lambda *a: called.append(1), np.zeros(4, np.float32))
    assert not called and not t.available
    assert "simulator only" in t.summary() and t.plot() is None
    viz.show_kernel(lambda *a: called.append(1), np.zeros(4, np.float32))
    printed = capsys.readouterr().out
    assert not called and len(printed.strip().splitlines()) == 1
    assert "simulator only" in printed and "GPULLM_DEVICE=sim" in printed


@sim_only
def test_hooks_are_removed_even_when_the_kernel_raises():
    @cuda.jit
    def off_by_one(x, out):
        i = cuda.grid(1)
        out[i] = x[i + 1]                  # the last thread reads past the end

    before = _hooks()
    x = np.ones(32, np.float32)
    out = np.zeros(32, np.float32)
    t = kernel_trace.trace(off_by_one[1, 32], x, out)
    assert _hooks() == before and kernel_trace._REC is None
    assert isinstance(t.error, IndexError) and "raised IndexError" in t.summary()
    with pytest.raises(IndexError):
        kernel_trace.trace(off_by_one[1, 32], x, out, raise_errors=True)
    assert _hooks() == before

    def not_written(x, out):
        raise NotImplementedError
    assert "not attempted" in kernel_trace.trace(not_written, x, out).summary()
    assert _hooks() == before


@sim_only
def test_course_softmax_kernels_v1_uncoalesced_v2_coalesced():
    from gpullm_lessons.kernels.numba import softmax

    dout, out, dinp = kernel_trace.example_args("softmax_backward", N=32, n=64)
    v1 = kernel_trace.trace(lambda *a: softmax.softmax_backward(*a, version="v1"), dout, out, dinp)
    expected = out * (dout - (out * dout).sum(1, keepdims=True))
    np.testing.assert_allclose(dinp, expected, rtol=1e-4, atol=1e-5)
    assert v1.sectors_per_warp_load().histogram == {32: 256}     # 64 columns x 2 arrays x 2 passes, 32 sectors
    assert "each thread wrote 64 elements of dinp" in v1.summary()

    dout, out, dinp = kernel_trace.example_args("softmax_backward", N=2, n=64)
    v2 = kernel_trace.trace(softmax.softmax_backward, dout, out, dinp)          # one block per row, shared tree
    assert v2.launches[0].kernel == "softmax_backward_v2"
    assert v2.sectors_per_warp_load().histogram == {4: 16}
    assert not v2.unwritten and not v2.multiple_writers
    assert set(v2.shared_traffic) == {0, 1} and v2.shared_traffic[0]["stores"] > 32
    assert {a.name for a in v2.arrays.values()} >= {"dout", "out", "dinp", "partial"}


@sim_only
def test_course_gelu_launcher_and_show_kernel(capsys):
    from gpullm_lessons.kernels.numba import gelu

    t = viz.show_kernel(gelu.gelu_backward, op="gelu_backward")   # 70 elements, one block of 256 threads
    printed = capsys.readouterr().out
    assert "70 of 256 threads wrote 1 element of dinp each, 186 wrote nothing" in printed
    assert t.unwritten == {} and t.writer["dinp"][69] == (0, 69)
    fig = t.plot()
    assert len(fig.axes) == 4
    import matplotlib.pyplot as plt
    plt.close("all")


@sim_only
def test_device_arrays_keep_the_argument_names():
    @cuda.jit
    def add_one(a, b):
        i = cuda.grid(1)
        if i < a.shape[0]:
            b[i] = a[i] + 1

    src = cuda.to_device(np.arange(40, dtype=np.float32))
    dst = cuda.device_array(40, np.float32)

    def run(src_values, result):
        add_one[2, 32](src_values, result)

    t = kernel_trace.trace(run, src, dst)
    assert (dst.copy_to_host() == np.arange(40) + 1).all()
    assert t.outputs == ["result"] and "src_values" in {a.name for a in t.arrays.values()}
    assert "40 of 64 threads wrote 1 element of result each, 24 wrote nothing" in t.summary()


@sim_only
def test_args_like_takes_the_checkers_first_case_and_records_no_verdict(tmp_path, monkeypatch, capsys):
    from gpullm_lessons.classroom import grading
    from gpullm_lessons.checks.backward import check_softmax_backward
    from gpullm_lessons.kernels.numba import softmax

    log = tmp_path / "grade.jsonl"
    monkeypatch.setenv(grading.LOG_ENV, str(log))
    dout, out, dinp = kernel_trace.args_like(check_softmax_backward, softmax.softmax_backward)
    assert dout.shape == out.shape == dinp.shape and dout.shape[0] * dout.shape[1] < 1000   # the small case
    assert not log.exists() and capsys.readouterr().out == ""      # not an attempt: nothing printed or recorded
    t = viz.show_kernel(softmax.softmax_backward, like=check_softmax_backward)
    assert t.launches[0].kernel == "softmax_backward_v2" and not t.unwritten
    assert "softmax_backward_v2[" in capsys.readouterr().out and not log.exists()
    import matplotlib.pyplot as plt
    plt.close("all")

    ran = []

    def fake_check(fn, *, quiet=False, seed=None):   # three cases of growing size, stops at the first failure
        for n in (1, 5, 9):
            out = np.zeros(n, np.float32)
            fn(np.ones(n, np.float32), out)
            if not (out == 1).all():
                return "wrong"

    def copy(x, out):
        ran.append(len(x))
        out[:] = x
    (x, out) = kernel_trace.args_like(fake_check, copy, case=1)
    assert len(x) == 5 and ran == [1]                  # case 0 ran the function, case 1 was captured
    ran.clear()
    assert len(kernel_trace.args_like(fake_check, lambda x, out: None, case=2)[0]) == 1   # stopped: the last call

    def never_calls(fn, **kw):
        return None
    with pytest.raises(RuntimeError, match="never called the function"):
        kernel_trace.args_like(never_calls, softmax.softmax_backward)


def test_bad_arguments():
    with pytest.raises(TypeError, match="fn must be your launcher"):
        kernel_trace.trace(np.zeros(3))
    with pytest.raises(ValueError, match="not one of"):
        kernel_trace.example_args("softmax")
    with pytest.raises(TypeError, match="only one of them"):
        viz.show_kernel(print, np.zeros(3), op="gelu_backward")


@cuda.jit
def _warp_pairs_synced(x, out):
    s = cuda.shared.array(64, np.float32)
    t = cuda.threadIdx.x
    s[t] = x[t]
    cuda.syncwarp()                      # a barrier for the lanes of one warp: enough for lane t + 16's value
    if t % 32 < 16:
        s[t] += s[t + 16]
    cuda.syncwarp()
    if t % 32 == 0:
        out[t // 32] = s[t]


@cuda.jit
def _warp_pairs_unsynced(x, out):
    s = cuda.shared.array(64, np.float32)
    t = cuda.threadIdx.x
    s[t] = x[t]
    if t % 32 < 16:
        s[t] += s[t + 16]
    if t % 32 == 0:
        out[t // 32] = s[t]


@cuda.jit
def _other_warp_after_syncwarp(x, out):
    s = cuda.shared.array(64, np.float32)
    t = cuda.threadIdx.x
    s[t] = x[t]
    cuda.syncwarp()                      # not a barrier between warps: that needs cuda.syncthreads()
    if t < 32:
        out[t] = s[t + 32]


@sim_only
def test_a_shared_hazard_is_a_write_and_a_read_with_no_barrier_between_the_two_threads():
    x, out = np.arange(64, dtype=np.float32), np.zeros(64, np.float32)
    synced = kernel_trace.trace(lambda: _warp_pairs_synced[1, 64](x, out))
    assert synced.shared_hazards == []                                  # syncwarp orders the lanes of a warp
    h = kernel_trace.trace(lambda: _warp_pairs_unsynced[1, 64](x, out)).shared_hazards
    assert len(h) == 32 and h[0]["array"] == "s" and h[0]["writer"][1] // 32 == h[0]["reader"][1] // 32
    h = kernel_trace.trace(lambda: _other_warp_after_syncwarp[1, 64](x, out)).shared_hazards
    assert len(h) == 32 and h[0]["writer"][1] // 32 != h[0]["reader"][1] // 32
