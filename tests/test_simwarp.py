"""gpullm_lessons.runtime.simwarp: warp shuffles and votes in Numba's CUDA simulator, checked against NumPy.

Reductions on blocks of 32, 64 and 48 threads (a partial last warp), the xor butterfly, the shfl_down tree, an
inclusive scan with shfl_up, broadcasts, 2-D blocks, votes; and the errors for what a GPU would hang on. The block
runner: greenlets, no thread started; barriers (also with threads that returned), syncthreads_count / _and / _or,
debug mode's division check, an error that ends the block's paused threads.
On a GPU these kernels are Numba's own intrinsics; the tests run where the simulator does.
"""
import threading

import numpy as np
import pytest

import gpullm_lessons  # noqa: F401  (switches the simulator on, and installs simwarp, before numba is imported)
from gpullm_lessons import device
from gpullm_lessons.runtime import simwarp

pytestmark = pytest.mark.skipif(not device.info().simulator, reason="simwarp patches Numba's CUDA simulator only")

from numba import cuda  # noqa: E402  (after gpullm_lessons)

FULL = 0xFFFFFFFF


@cuda.jit
def xor_sum(x, out):
    i = cuda.grid(1)
    v = x[i] if i < x.shape[0] else np.float32(0.0)
    off = 16
    while off > 0:
        v += cuda.shfl_xor_sync(FULL, v, off)
        off //= 2
    out[i] = v                              # every lane holds its warp's total


@cuda.jit
def down_sum(x, out):
    i = cuda.grid(1)
    v = x[i]
    off = 16
    while off > 0:
        v += cuda.shfl_down_sync(FULL, v, off)
        off //= 2
    out[i] = v                              # lane 0 holds the total; lane l past the range adds its own value


@cuda.jit
def scan_up(x, out):
    i = cuda.grid(1)
    lane = cuda.threadIdx.x % 32
    v = x[i]
    d = 1
    while d < 32:
        y = cuda.shfl_up_sync(FULL, v, d)
        if lane >= d:
            v += y
        d *= 2
    out[i] = v                              # inclusive prefix sum within the warp


@cuda.jit
def broadcast(x, src, out):
    i = cuda.grid(1)
    out[i] = cuda.shfl_sync(FULL, x[i], src)


@cuda.jit
def half_warp_sum(x, out):
    # a 48-thread block: warp 1 has lanes 0..15 only; reduce each half-warp with offsets 8, 4, 2, 1
    i = cuda.threadIdx.x
    v = x[i]
    off = 8
    while off > 0:
        v += cuda.shfl_xor_sync(FULL, v, off)
        off //= 2
    out[i] = v


def _down_reference(x):
    """What a shfl_down tree leaves in each lane of one 32-lane warp (own value past the last lane)."""
    v = x.astype(np.float64).copy()
    off = 16
    while off:
        src = np.arange(32) + off
        v = v + np.where(src < 32, v[np.minimum(src, 31)], v)
        off //= 2
    return v


def test_installed_by_import_when_simulating():
    assert simwarp.installed()
    simwarp.install()                       # idempotent
    assert simwarp.installed()


@pytest.mark.parametrize("threads", [32, 64])
def test_xor_butterfly_gives_every_lane_the_warp_total(threads):
    rng = np.random.default_rng(threads)
    x = rng.standard_normal(2 * threads).astype(np.float32)
    out = np.zeros_like(x)
    xor_sum[2, threads](x, out)
    expected = x.astype(np.float64).reshape(-1, 32).sum(axis=1).repeat(32)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_down_tree_leaves_the_total_in_lane_0_with_cuda_out_of_range_semantics():
    rng = np.random.default_rng(1)
    x = rng.standard_normal(64).astype(np.float32)
    out = np.zeros_like(x)
    down_sum[1, 64](x, out)
    for w in range(2):
        got, ref = out[32 * w:32 * (w + 1)], _down_reference(x[32 * w:32 * (w + 1)])
        assert abs(got[0] - x[32 * w:32 * (w + 1)].astype(np.float64).sum()) < 1e-4
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_shfl_up_inclusive_scan_matches_cumsum():
    x = np.arange(1, 65, dtype=np.int32)
    out = np.zeros_like(x)
    scan_up[2, 32](x, out)
    np.testing.assert_array_equal(out, np.concatenate([np.cumsum(x[:32]), np.cumsum(x[32:])]))


def test_shfl_sync_broadcasts_and_takes_the_source_lane_modulo_32():
    x = np.arange(64, dtype=np.float64)     # 64-bit values shuffle too
    out = np.zeros_like(x)
    broadcast[1, 64](x, 5, out)
    np.testing.assert_array_equal(out, np.r_[np.full(32, 5.0), np.full(32, 37.0)])
    broadcast[1, 64](x, 33, out)            # PTX uses the low 5 bits of the lane
    np.testing.assert_array_equal(out, np.r_[np.full(32, 1.0), np.full(32, 33.0)])


def test_partial_last_warp_works_for_its_lanes():
    rng = np.random.default_rng(2)
    x = rng.standard_normal(48).astype(np.float32)
    out = np.zeros_like(x)
    half_warp_sum[1, 48](x, out)
    expected = x.astype(np.float64).reshape(3, 16).sum(axis=1).repeat(16)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_reading_a_lane_that_does_not_exist_is_undefined_nan():
    x = np.ones(48, dtype=np.float32)
    out = np.zeros_like(x)
    xor_sum[1, 48](x, out)                  # warp 1 (16 lanes) reads lanes 16..31 at offset 16
    np.testing.assert_array_equal(out[:32], 32.0)
    assert np.isnan(out[32:]).all()


@cuda.jit
def sum_2d(x, out):
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    v = x[ty, tx]
    off = 16
    while off > 0:
        v += cuda.shfl_xor_sync(FULL, v, off)
        off //= 2
    out[ty, tx] = v


def test_2d_block_warps_are_linear_thread_ids():
    # a (16, 4) block: thread id = x + 16 y, so warp 0 is rows y = 0, 1 and warp 1 rows y = 2, 3
    x = np.arange(64, dtype=np.float32).reshape(4, 16)
    out = np.zeros_like(x)
    sum_2d[1, (16, 4)](x, out)
    np.testing.assert_array_equal(out[:2], x[:2].sum())
    np.testing.assert_array_equal(out[2:], x[2:].sum())


@cuda.jit
def votes(x, out):
    i = cuda.threadIdx.x
    p = x[i] > 0
    out[i, 0] = cuda.ballot_sync(FULL, p)
    out[i, 1] = cuda.any_sync(FULL, p)
    out[i, 2] = cuda.all_sync(FULL, p)
    cuda.syncwarp(FULL)
    out[i, 3] = cuda.lanemask_lt()


def test_votes_and_syncwarp():
    x = -np.ones(32, dtype=np.float32)
    x[[0, 3, 31]] = 1.0
    out = np.zeros((32, 4), dtype=np.int64)
    votes[1, 32](x, out)
    bits = (1 << 0) | (1 << 3) | (1 << 31)
    assert (out[:, 0] == bits - (1 << 32)).all()      # an int32, as Numba's ballot_sync returns
    assert (out[:, 1] == 1).all() and (out[:, 2] == 0).all()
    np.testing.assert_array_equal(out[:, 3], (1 << np.arange(32, dtype=np.int64)) - 1)


@cuda.jit
def early_exit(x, out):
    i = cuda.threadIdx.x
    if i >= x.shape[0]:
        return                              # lanes past the data leave: the shuffle below misses them
    out[i] = cuda.shfl_xor_sync(FULL, x[i], 1)


@cuda.jit
def barrier_mismatch(x, out):
    i = cuda.threadIdx.x
    if i < 16:
        out[i] = cuda.shfl_xor_sync(FULL, x[i], 1)
    else:
        cuda.syncthreads()


@cuda.jit
def not_in_mask(x, out):
    i = cuda.threadIdx.x
    out[i] = cuda.shfl_xor_sync(0x0000FFFF, x[i], 1)


def test_lanes_that_returned_make_the_shuffle_fail_naming_them():
    with pytest.raises(simwarp.WarpError, match=r"lanes 20\.\.31 returned from the kernel"):
        early_exit[1, 32](np.ones(20, np.float32), np.zeros(32, np.float32))


def test_lanes_waiting_at_syncthreads_make_the_shuffle_fail():
    with pytest.raises(simwarp.WarpError, match=r"lanes 16\.\.31 wait at cuda.syncthreads"):
        barrier_mismatch[1, 32](np.ones(32, np.float32), np.zeros(32, np.float32))


def test_a_lane_outside_its_mask_is_an_error():
    with pytest.raises(simwarp.WarpError, match="not in the mask"):
        not_in_mask[1, 32](np.ones(32, np.float32), np.zeros(32, np.float32))


@cuda.jit
def sub_masks(x, out):
    # two half-warps shuffle independently, each with its own mask
    i = cuda.threadIdx.x
    mask = 0x0000FFFF if i < 16 else 0xFFFF0000
    out[i] = cuda.shfl_sync(mask, x[i], 16 * (i // 16))


def test_disjoint_masks_shuffle_independently():
    x = np.arange(32, dtype=np.float32)
    out = np.zeros_like(x)
    sub_masks[1, 32](x, out)
    np.testing.assert_array_equal(out, np.r_[np.zeros(16), np.full(16, 16.0)])


# ---- the block runner (simwarp's BlockManager.run: the block's threads get the interpreter lock between checks) ----


@cuda.jit
def staged_tree_sum(x, out):
    """A shared-memory tree: every level reads what other threads wrote before the last syncthreads."""
    buf = cuda.shared.array(64, np.float32)
    t = cuda.threadIdx.x
    buf[t] = x[cuda.blockIdx.x * 64 + t]
    cuda.syncthreads()
    step = 32
    while step > 0:
        if t < step:
            buf[t] += buf[t + step]
        cuda.syncthreads()
        step //= 2
    if t == 0:
        out[cuda.blockIdx.x] = buf[0]


@cuda.jit
def thread_five_fails(x):
    cuda.syncthreads()
    if cuda.threadIdx.x == 5:
        x[10**6] = 1.0  # out of range: the simulator raises IndexError in this thread
    cuda.syncthreads()
    x[cuda.threadIdx.x] = 2.0


def test_the_block_runner_is_installed_and_keeps_syncthreads_and_errors():
    from numba.cuda.simulator import kernel as sim_kernel

    assert getattr(sim_kernel.BlockManager.run, "_simwarp", False)
    x = np.random.default_rng(0).standard_normal(3 * 64).astype(np.float32)
    out = np.zeros(3, np.float32)
    staged_tree_sum[3, 64](x, out)
    np.testing.assert_allclose(out, x.reshape(3, 64).sum(1), rtol=1e-5)
    with pytest.raises(IndexError, match=r"tid=\[5, 0, 0\] ctaid=\[0, 0, 0\]"):
        thread_five_fails[1, 32](np.zeros(32, np.float32))
    staged_tree_sum[3, 64](x, out)  # the next launch runs as before
    np.testing.assert_allclose(out, x.reshape(3, 64).sum(1), rtol=1e-5)


@cuda.jit
def other_warp_op(x, out):
    # lanes 0..15 shuffle with the whole warp's mask; lanes 16..31 with a mask of themselves and lane 0: neither
    # round can complete (on a GPU: a hang)
    i = cuda.threadIdx.x
    if i < 16:
        out[i] = cuda.shfl_xor_sync(FULL, x[i], 1)
    else:
        out[i] = cuda.shfl_down_sync(0xFFFF0001, x[i], 1)


def test_lanes_at_another_warp_operation_make_the_shuffle_fail_at_once():
    with pytest.raises(simwarp.WarpError, match=r"lanes 16\.\.31 wait at cuda.shfl_down_sync with mask 0xffff0001"):
        other_warp_op[1, 32](np.ones(32, np.float32), np.zeros(32, np.float32))


@cuda.jit
def barrier_votes(x, out):
    t = cuda.threadIdx.x
    if t >= 40:
        return                  # threads that return do not hold the barrier up
    p = x[t] > 0
    out[0, t] = cuda.syncthreads_count(p)
    out[1, t] = cuda.syncthreads_and(p)
    out[2, t] = cuda.syncthreads_or(p)


def test_barrier_votes_count_and_or_with_threads_that_returned():
    x = np.where(np.arange(48) % 3 == 0, 1.0, -1.0).astype(np.float32)
    out = np.full((3, 48), -7, np.int32)
    barrier_votes[1, 48](x, out)
    assert (out[0, :40] == np.count_nonzero(x[:40] > 0)).all()
    assert (out[1, :40] == 0).all() and (out[2, :40] == 1).all()
    assert (out[:, 40:] == -7).all()
    x[:] = 1.0
    barrier_votes[1, 48](x, out)
    assert (out[0, :40] == 40).all() and (out[1, :40] == 1).all()


def test_a_block_runs_without_starting_a_thread(monkeypatch):
    """The block's CUDA threads are greenlets in the launching Python thread: barriers and shuffles included."""

    def no_thread(self):
        raise AssertionError(f"the simulator started a Python thread ({self.name})")

    monkeypatch.setattr(threading.Thread, "start", no_thread)
    x = np.random.default_rng(1).standard_normal(2 * 64).astype(np.float32)
    out = np.zeros(2, np.float32)
    staged_tree_sum[2, 64](x, out)
    np.testing.assert_allclose(out, x.reshape(2, 64).sum(1), rtol=1e-5)
    sums = np.zeros(64, np.float32)
    xor_sum[1, 64](x[:64], sums)
    np.testing.assert_allclose(sums[:32], x[:32].sum(), rtol=1e-5)


@cuda.jit(debug=True, opt=False)
def divide_debug(x, y, out):
    i = cuda.threadIdx.x
    out[i] = x[i] / y[i]


@cuda.jit
def divide(x, y, out):
    i = cuda.threadIdx.x
    out[i] = x[i] / y[i]


def test_debug_mode_raises_on_a_division_by_zero_naming_the_thread():
    x, y = np.ones(4, np.float32), np.array([1, 2, 0, 4], np.float32)
    with pytest.raises(FloatingPointError, match=r"tid=\[2, 0, 0\]"):
        divide_debug[1, 4](x, y, np.zeros(4, np.float32))
    out = np.zeros(4, np.float32)
    with pytest.warns(RuntimeWarning, match="divide by zero"):   # without debug: a warning, inf, and on
        divide[1, 4](x, y, out)
    assert np.isinf(out[2]) and out[3] == 0.25


@cuda.jit
def fails_after_the_barrier(x, log):
    t = cuda.threadIdx.x
    try:
        cuda.syncthreads()
        if t == 3:
            x[10**6] = 1.0
        cuda.syncthreads()
        x[t] = 2.0
    finally:
        log[t] += 1              # every thread's frame unwinds once, the paused ones included


def test_an_error_ends_the_paused_threads_and_the_next_launch_is_clean():
    x, log = cuda.to_device(np.zeros(8, np.float32)), cuda.to_device(np.zeros(8, np.int32))  # written in place
    with pytest.raises(IndexError, match=r"tid=\[3, 0, 0\]"):
        fails_after_the_barrier[1, 8](x, log)
    assert (log.copy_to_host() == 1).all() and (x.copy_to_host() == 0).all()
    out = np.zeros(1, np.float32)
    staged_tree_sum[1, 64](np.ones(64, np.float32), out)
    assert out[0] == 64.0


def test_a_launch_without_greenlet_says_what_to_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "greenlet", None)   # as if it were not installed: `import greenlet` fails
    with pytest.raises(ImportError, match=r"needs the greenlet package .* pip install 'greenlet>=3'"):
        staged_tree_sum[1, 64](np.ones(64, np.float32), np.zeros(1, np.float32))
