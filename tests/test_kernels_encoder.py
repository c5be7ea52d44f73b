"""Embedding (encoder) backward kernels: kernels/numba/encoder.py and kernels/hip/encoder.cu.

In the simulator: v1 (atomics), v2 (deterministic buckets) and v3 (fixed-point integer atomics) against
check_encoder_backward, broken launches caught, the host-side bucketing, wrapper validation. v3 also: bit for bit
the NumPy model of its fixed-point arithmetic (_v3_model) and within its stated error bound of the float64 reference
on awkward sizes with repeated tokens, dout all zeros, one huge (1e30) or only tiny (1e-30) values, the scale rule
((B*T) * m * 2^e < 2^62, clamped), the same bits run to run and for permuted positions, NaN for a non-finite dout,
no host round trip. On a GPU (`pytest -m gpu`): every version, Numba and HIP, at the checker's large size
(V = 50257, C = 768) and awkward sizes; v2 and v3 give the same bits on every run; v3 at GPT-2 sizes equals the
model bit for bit in both backends, and the HIP v3 is captured in a CUDA graph and replayed.
PTX for every KERNELS entry: tests/test_kernels_numba.py.
"""
import numpy as np
import pytest

from gpullm_lessons import reference
from gpullm_lessons.runtime.arrays import to_backend, to_numpy
from gpullm_lessons.checks.backward import check_encoder_backward
from gpullm_lessons.kernels.numba import encoder as enc

SIM_VERSIONS = [v for v in enc.VERSIONS if v not in enc.GPU_ONLY]


def _inputs(B, T, C, V, maxT, seed):
    rng = np.random.default_rng(seed)
    dout = rng.standard_normal((B, T, C)).astype(np.float32)
    idx = rng.integers(0, min(V, 5), (B, T)).astype(np.int32)      # few distinct tokens: many repeats
    return dout, idx


def _expected(dout, idx, V, maxT):
    wte, wpe = np.zeros((V, dout.shape[2])), np.zeros((maxT, dout.shape[2]))
    _, cache = reference.encoder_forward(idx, wte, wpe)
    return reference.encoder_backward(dout.astype(np.float64), cache)


# ---- (a) the simulator ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arrays", ["numba", "numpy"])
@pytest.mark.parametrize("version", SIM_VERSIONS)
def test_passes_checker(version, arrays):
    r = check_encoder_backward(lambda *a: enc.encoder_backward(*a, version=version), arrays=arrays, quiet=True)
    assert r.passed, r.message


def test_broken_launches_are_caught():
    def no_zeroing(dout, idx, dwte, dwpe):               # v1 without the zeroing kernel: adds into NaN
        B, T, C = dout.shape
        enc.KERNELS["v1"][(B * T * C + 63) // 64, 64](dout, idx, dwte, dwpe)

    r = check_encoder_backward(no_zeroing, arrays="numba", quiet=True)
    assert not r.passed and "NaN" in r.hint

    def one_block(dout, idx, dwte, dwpe):                # v2 with a single block of 8 threads
        order, starts = enc.token_buckets(to_numpy(idx), dwte.shape[0])
        enc.KERNELS["v2"][1, 8](dout, to_backend(order, "numba"), to_backend(starts, "numba"), dwte)
        enc.KERNELS["v2_dwpe"][1, 8](dout, dwpe)

    r = check_encoder_backward(one_block, arrays="numba", quiet=True)
    assert not r.passed and "never written" in r.hint


def test_token_buckets():
    idx = np.array([[3, 1, 3], [0, 3, 1]], np.int32)     # positions 0..5 = b * T + t
    order, starts = enc.token_buckets(idx, V=5)
    np.testing.assert_array_equal(starts, [0, 1, 3, 3, 6, 6])       # token 2 and 4: empty buckets
    np.testing.assert_array_equal(order, [3, 1, 5, 0, 2, 4])        # each bucket in increasing position order
    with pytest.raises(ValueError, match=r"idx must be in \[0, V=3\), got min 0, max 3"):
        enc.token_buckets(idx, V=3)


@pytest.mark.parametrize("version", SIM_VERSIONS)
def test_many_repeats_and_unused_rows(version):
    """Five tokens only, V = 9 (rows 5..8 never touched, must be 0), maxT > T (rows T.. of dwpe are 0)."""
    B, T, C, V, maxT = 3, 7, 5, 9, 11
    dout, idx = _inputs(B, T, C, V, maxT, seed=4)
    dwte = np.full((V, C), np.nan, np.float32)
    dwpe = np.full((maxT, C), np.nan, np.float32)
    enc.encoder_backward(dout, idx, dwte, dwpe, version=version)
    dwte_ref, dwpe_ref = _expected(dout, idx, V, maxT)
    np.testing.assert_allclose(dwte, dwte_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dwpe, dwpe_ref, rtol=1e-5, atol=1e-6)


# ---- (a') v3: fixed-point integer atomics, in the simulator ----------------------------------------------------------
def _v3_exponent(m, N):
    """The e of v3's scale 2^e for m = max|dout| and N = B*T positions, as the kernels compute it (frexp)."""
    if m == 0:
        return 0
    k = int(np.frexp(np.float64(m))[1])                  # 2^(k-1) <= m < 2^k
    j = 0
    while j < 62 and 2 ** j < N:                         # 2^j >= N
        j += 1
    return min(max(62 - j - k, -126), 126)


def _v3_model(dout, idx, V):
    """v3's arithmetic in NumPy: (dwte, e). q = rint(dout * 2^e) (half to even), exact int64 sums per token,
    dwte = float32(float64(sum) * 2^-e). The kernels must match it bit for bit."""
    B, T, C = dout.shape
    e = _v3_exponent(float(np.abs(dout).max()) if dout.size else 0.0, B * T)
    q = np.rint(dout.astype(np.float64) * 2.0 ** e).astype(np.int64)
    acc = np.zeros((V, C), np.int64)
    np.add.at(acc, idx.ravel(), q.reshape(B * T, C))
    return (acc.astype(np.float64) * 2.0 ** -e).astype(np.float32), e


def _v3_bound(dout, idx, V, e):
    """(float64 reference, bound, floor): |dwte - float64 sum| <= bound = count(v) * 2^-e / 2 (one rint per
    position) + the final float32 rounding; floor = the largest fixed-point part (an absolute tolerance)."""
    dwte_ref, _ = _expected(dout, idx, V, dout.shape[1])
    counts = np.bincount(idx.ravel(), minlength=V)[:, None]
    floor = counts * 2.0 ** -(e + 1)
    return dwte_ref, (floor + 2.0 ** -24 * np.abs(dwte_ref)) * (1 + 1e-9), float(floor.max()) * (1 + 1e-9)


def _run_v3(mod, dout, idx, V, maxT, arrays="numpy", **kw):
    dwte = to_backend(np.full((V, dout.shape[2]), np.nan, np.float32), arrays)     # poisoned: unwritten shows
    dwpe = to_backend(np.full((maxT, dout.shape[2]), np.nan, np.float32), arrays)
    mod.encoder_backward(to_backend(dout, arrays) if arrays != "numpy" else dout,
                         to_backend(idx, arrays) if arrays != "numpy" else idx, dwte, dwpe, version="v3", **kw)
    return to_numpy(dwte), to_numpy(dwpe)


def _assert_v3(dwte, dwpe, dout, idx, V, maxT, rtol=1e-6):
    """Bit for bit v3's model; within 1e-6 relative of float64 (plus the fixed-point floor); dwpe as v2."""
    model, e = _v3_model(dout, idx, V)
    np.testing.assert_array_equal(dwte, model)
    ref, bound, floor = _v3_bound(dout, idx, V, e)
    assert np.all(np.abs(dwte - ref) <= bound), np.max(np.abs(dwte - ref) - bound)
    np.testing.assert_allclose(dwte, ref, rtol=rtol, atol=floor)
    _, dwpe_ref = _expected(dout, idx, V, maxT)
    np.testing.assert_allclose(dwpe, dwpe_ref, rtol=1e-5, atol=1e-6 * max(1.0, float(np.abs(dout).max())))
    return e


@pytest.mark.parametrize("B, T, C, V, threads", [(1, 1, 1, 1, 16), (3, 7, 5, 9, 32), (2, 13, 19, 40, 7),
                                                 (2, 5, 33, 3, 1)])
def test_v3_matches_its_model_and_float64(B, T, C, V, threads):
    """Fresh random inputs with many repeated tokens and awkward sizes (threads 7 and 1: block sizes that are not
    powers of two or whole warps)."""
    dout, idx = _inputs(B, T, C, V, T + 2, seed=None)
    dout *= np.float32(10.0) ** np.random.default_rng().uniform(-3, 3, dout.shape).astype(np.float32)
    dwte, dwpe = _run_v3(enc, dout, idx, V, T + 2, threads=threads)
    _assert_v3(dwte, dwpe, dout, idx, V, T + 2)


def test_v3_dout_all_zeros():
    B, T, C, V = 2, 5, 6, 7
    dout, idx = np.zeros((B, T, C), np.float32), np.random.default_rng().integers(0, V, (B, T)).astype(np.int32)
    dwte, dwpe = _run_v3(enc, dout, idx, V, T + 1, threads=16)
    assert np.all(dwte == 0) and np.all(dwpe == 0)             # 0, not NaN: every element written
    assert _assert_v3(dwte, dwpe, dout, idx, V, T + 1) == 0    # m == 0 -> e = 0


@pytest.mark.parametrize("case", ["huge", "tiny", "huge_and_tiny"])
def test_v3_huge_and_tiny_values(case):
    """One 1e30 among O(1) values: no overflow, the huge column right to float32, every element within the
    fixed-point bound (about max|dout| * (B*T)^2 * 2^-63: the O(1) values are below it, they vanish). Only tiny
    values (1e-30): e is clamped at 126, and the result is still within 1e-6 relative of float64."""
    rng = np.random.default_rng()
    B, T, C, V, maxT = 2, 6, 7, 5, 6
    dout, idx = _inputs(B, T, C, V, maxT, seed=None)
    if case != "huge":
        dout *= np.float32(1e-30)
    if case != "tiny":
        b, t, c = (int(rng.integers(0, n)) for n in (B, T, C))
        dout[b, t, c] = np.float32(1e30) * rng.choice([-1, 1])
    dwte, dwpe = _run_v3(enc, dout, idx, V, maxT, threads=16)
    assert np.all(np.isfinite(dwte)) and np.all(np.isfinite(dwpe))
    e = _assert_v3(dwte, dwpe, dout, idx, V, maxT)
    ref, _ = _expected(dout, idx, V, maxT)
    if case == "tiny":
        assert e == 126
        np.testing.assert_allclose(dwte, ref, rtol=1e-6, atol=1e-6 * 1e-30)
    else:
        v = idx[b, t]
        assert dwte[v, c] == np.float32(ref[v, c])                     # the huge element: float32 of the sum
        assert np.abs(dwte - ref).max() <= 1e-6 * np.abs(ref).max()    # float32 tolerance, norm-wise
    N, m = B * T, float(np.abs(dout).max())
    assert N * m * 2.0 ** e < 2.0 ** 62                                 # the scale rule: no int64 overflow
    assert e == 126 or N * m * 2.0 ** e >= 2.0 ** 60                    # and no bits wasted


@pytest.mark.parametrize("m, N, e", [(1.0, 1, 61), (1.5, 4, 59), (0.75, 5, 59), (0.0, 9, 0), (1e-30, 4, 126),
                                     (3e38, 2 ** 20, -86), (2.0 ** -149, 1, 126)])
def test_v3_scale_kernel(m, N, e):
    """v3_amax + v3_scale on the device: scale = [2^e, 2^-e], e = 62 - ceil(log2 N) - frexp exponent of m."""
    assert _v3_exponent(np.float32(m), N) == e
    dout = np.zeros((1, 3, 11), np.float32)
    dout[0, 2, 9] = -np.float32(m)                       # the max is found wherever it is, whatever its sign
    partial, scale = np.full(2, np.nan, np.float32), np.full(2, np.nan, np.float32)
    enc.KERNELS["v3_amax"][2, 5](dout, partial)
    enc.KERNELS["v3_scale"][1, 3](partial, N, scale)
    assert partial.max() == np.float32(m)
    assert scale[0] == np.float32(2.0 ** e) and scale[1] == np.float32(2.0 ** -e)


def test_v3_is_deterministic_for_any_order_of_the_positions():
    """Same bits on a second call, and when the (b, t) positions of dout and idx are permuted together: the
    integer sums do not depend on the order in which the atomics land."""
    B, T, C, V = 3, 8, 5, 4
    rng = np.random.default_rng()
    dout, idx = _inputs(B, T, C, V, T, seed=None)
    first, _ = _run_v3(enc, dout, idx, V, T, threads=16)
    again, _ = _run_v3(enc, dout, idx, V, T, threads=32)
    perm = rng.permutation(B * T)
    dout_p = dout.reshape(B * T, C)[perm].reshape(B, T, C)
    idx_p = idx.ravel()[perm].reshape(B, T)
    permuted, _ = _run_v3(enc, dout_p, idx_p, V, T, threads=16)
    np.testing.assert_array_equal(again, first)
    np.testing.assert_array_equal(permuted, first)


def test_v3_non_finite_dout_makes_dwte_nan():
    """A single inf (or NaN) in dout: all of dwte is NaN (v3_scale sees max |dout| = inf), not silent garbage."""
    dout, idx = _inputs(2, 3, 4, 6, 3, seed=1)
    for bad in (np.inf, np.nan):
        d = dout.copy()
        d[1, 2, 3] = bad
        dwte, dwpe = _run_v3(enc, d, idx, 6, 3, threads=16)
        assert np.all(np.isnan(dwte))
        assert not np.isfinite(dwpe[2, 3]) and np.all(np.isfinite(dwpe[:2]))


def test_v3_never_copies_to_the_host(monkeypatch):
    """v3 must be capturable in a CUDA graph: no copy of idx (or anything) to the host, no host-side bucketing."""
    def refuse(*a, **k):
        raise AssertionError("v3 called a host-side helper")

    monkeypatch.setattr(enc.arrays, "to_numpy", refuse)
    monkeypatch.setattr(enc, "token_buckets", refuse)
    dout, idx = _inputs(2, 3, 4, 6, 3, seed=2)
    dwte, dwpe = np.full((6, 4), np.nan, np.float32), np.full((3, 4), np.nan, np.float32)
    enc.encoder_backward(dout, idx, dwte, dwpe, version="v3", threads=16)
    assert np.all(np.isfinite(dwte)) and np.all(np.isfinite(dwpe))


# ---- (b) wrapper validation ----------------------------------------------------------------------------------------
def test_validation_errors():
    dout, idx = np.zeros((2, 3, 4), np.float32), np.zeros((2, 3), np.int32)
    dwte, dwpe = np.zeros((7, 4), np.float32), np.zeros((5, 4), np.float32)
    with pytest.raises(ValueError, match="dout must be 3-D"):
        enc.encoder_backward(dout[0], idx, dwte, dwpe)
    with pytest.raises(ValueError, match=r"idx has shape \(3, 2\), expected \(2, 3\)"):
        enc.encoder_backward(dout, idx.T.copy(), dwte, dwpe)
    with pytest.raises(TypeError, match="idx has dtype int64, expected int32"):
        enc.encoder_backward(dout, idx.astype(np.int64), dwte, dwpe)
    with pytest.raises(ValueError, match=r"dwte has shape \(7, 5\), expected \(7, 4\)"):
        enc.encoder_backward(dout, idx, np.zeros((7, 5), np.float32), dwpe)
    with pytest.raises(TypeError, match="dwpe has dtype float64, expected float32"):
        enc.encoder_backward(dout, idx, dwte, dwpe.astype(np.float64))
    with pytest.raises(ValueError, match=r"needs maxT >= T = 3 rows"):
        enc.encoder_backward(dout, idx, dwte, np.zeros((2, 4), np.float32))
    with pytest.raises(ValueError, match="version='v9'"):
        enc.encoder_backward(dout, idx, dwte, dwpe, version="v9")
    with pytest.raises(ValueError, match=r"idx must be in \[0, V=7\)"):
        enc.encoder_backward(dout, idx + 7, dwte, dwpe, version="v2")


def test_hip_wrapper_validation_without_gpu():
    from gpullm_lessons.backends.hip import encoder as henc
    dout, idx = np.zeros((2, 3, 4), np.float32), np.zeros((2, 3), np.int32)
    with pytest.raises(TypeError, match="dout must be a CuPy array"):
        henc.encoder_backward(dout, idx, np.zeros((7, 4), np.float32), np.zeros((5, 4), np.float32))
    with pytest.raises(ValueError, match="dwpe must be 2-D"):
        henc.encoder_backward(dout, idx, np.zeros((7, 4), np.float32), np.zeros(5, np.float32))
    with pytest.raises(ValueError, match=r"idx must be in \[0, V=2\), got min 0, max 4"):
        henc._token_buckets(np.array([0, 4]), V=2)


# ---- (c) on a GPU ----------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("size", ["small", "large"])
@pytest.mark.parametrize("version", enc.VERSIONS)
def test_numba_on_gpu(version, size):
    for threads in (None, 96, 1024):
        r = check_encoder_backward(lambda *a: enc.encoder_backward(*a, version=version, threads=threads),
                                   arrays="numba", size=size, quiet=True)
        assert r.passed, (threads, r.message)


@pytest.mark.gpu
@pytest.mark.parametrize("size", ["small", "large"])
@pytest.mark.parametrize("version", enc.VERSIONS)
def test_hip_on_gpu(version, size):
    from gpullm_lessons.backends.hip import encoder as henc
    for threads in (96, 256, 1024):
        r = check_encoder_backward(lambda *a: henc.encoder_backward(*a, version=version, threads=threads),
                                   arrays="cupy", size=size, quiet=True)
        assert r.passed, (threads, r.message)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["numba", "hip"])
def test_v2_is_deterministic_on_gpu(backend):
    """GPT-2 sizes with heavy token repeats: v2 gives the same bits on every run, and matches float64."""
    if backend == "hip":
        from gpullm_lessons.backends.hip import encoder as mod
        arrays = "cupy"
    else:
        mod, arrays = enc, "numba"
    B, T, C, V, maxT = 8, 1000, 768, 50257, 1024
    dout, idx = _inputs(B, T, C, V, maxT, seed=5)
    d_dout, d_idx = to_backend(dout, arrays), to_backend(idx, arrays)
    runs = []
    for _ in range(3):
        dwte = to_backend(np.full((V, C), np.nan, np.float32), arrays)
        dwpe = to_backend(np.full((maxT, C), np.nan, np.float32), arrays)
        mod.encoder_backward(d_dout, d_idx, dwte, dwpe, version="v2")
        runs.append((to_numpy(dwte), to_numpy(dwpe)))
    for dwte, dwpe in runs[1:]:
        np.testing.assert_array_equal(dwte, runs[0][0])
        np.testing.assert_array_equal(dwpe, runs[0][1])
    dwte_ref, dwpe_ref = _expected(dout, idx, V, maxT)
    np.testing.assert_allclose(runs[0][0], dwte_ref, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(runs[0][1], dwpe_ref, rtol=1e-4, atol=1e-4)


def _v3_gpu_inputs(B, T, C, V, seed):
    """Half the positions from 50 frequent tokens (heavy repeats), half uniform over V."""
    rng = np.random.default_rng(seed)
    dout = rng.standard_normal((B, T, C), dtype=np.float32)
    idx = rng.integers(0, V, (B, T)).astype(np.int32)
    frequent = rng.choice(V, size=min(V, 50), replace=False)
    mask = rng.random((B, T)) < 0.5
    idx[mask] = rng.choice(frequent, size=int(mask.sum()))
    return dout, idx


@pytest.mark.gpu
@pytest.mark.parametrize("B, T, C, V", [(16, 1024, 768, 50304), (64, 256, 384, 256)])
def test_v3_on_gpu_both_backends(B, T, C, V):
    """GPT-2 sizes, and few tokens with many repeats: both backends equal v3's NumPy model bit for bit (so each
    other), are within 1e-6 relative of float64, and give the same bits on a second run."""
    from gpullm_lessons.backends.hip import encoder as henc
    maxT = T
    dout, idx = _v3_gpu_inputs(B, T, C, V, seed=7)
    model, e = _v3_model(dout, idx, V)
    ref, bound, floor = _v3_bound(dout, idx, V, e)
    assert floor < 1e-9
    for mod, arrays in ((enc, "numba"), (henc, "cupy")):
        runs = [_run_v3(mod, dout, idx, V, maxT, arrays=arrays) for _ in range(2)]
        for dwte, dwpe in runs:
            np.testing.assert_array_equal(dwte, model, err_msg=arrays)
            np.testing.assert_array_equal(dwte, runs[0][0])
            np.testing.assert_array_equal(dwpe, runs[0][1])
        assert np.all(np.abs(runs[0][0] - ref) <= bound)
        np.testing.assert_allclose(runs[0][0], ref, rtol=1e-6, atol=1e-9)
        _, dwpe_ref = _expected(dout, idx, V, maxT)
        np.testing.assert_allclose(runs[0][1], dwpe_ref, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_v3_hip_is_captured_in_a_cuda_graph():
    """The HIP v3 launched while a stream captures (any .get() or host sync would fail the capture), then the
    graph replayed on new contents of the same input buffers: the result of the new inputs, bit for bit."""
    import cupy as cp

    from gpullm_lessons.backends.hip import encoder as henc
    B, T, C, V = 4, 64, 96, 1000
    dout, idx = _v3_gpu_inputs(B, T, C, V, seed=8)
    dout2, idx2 = _v3_gpu_inputs(B, T, C, V, seed=9)
    dout2[0, 0, 0] = 1e6                                                # a different scale 2^e as well
    d_dout, d_idx, new_dout, new_idx = (cp.asarray(a) for a in (dout, idx, dout2, idx2))
    dwte, dwpe = cp.full((V, C), cp.nan, cp.float32), cp.full((T, C), cp.nan, cp.float32)
    pool, stream = cp.cuda.MemoryPool(), cp.cuda.Stream()          # private pool: captured addresses stay valid
    with cp.cuda.using_allocator(pool.malloc), stream:
        henc.encoder_backward(d_dout, d_idx, dwte, dwpe, version="v3")   # warm-up: compiles, fills the pool
        stream.synchronize()
        stream.begin_capture(mode=cp.cuda.runtime.streamCaptureModeRelaxed)
        try:
            henc.encoder_backward(d_dout, d_idx, dwte, dwpe, version="v3")
        finally:
            graph = stream.end_capture()
    with stream:                                                    # new contents, same buffers; then replay
        d_dout[...] = new_dout
        d_idx[...] = new_idx
        dwte.fill(cp.nan)
        dwpe.fill(cp.nan)
        graph.launch(stream)
        stream.synchronize()
    np.testing.assert_array_equal(dwte.get(), _v3_model(dout2, idx2, V)[0])
    _, dwpe_ref = _expected(dout2, idx2, V, T)
    np.testing.assert_allclose(dwpe.get(), dwpe_ref, rtol=1e-4, atol=1e-4)


# ---- accumulate=True: the sums added into what dwte holds (the engine's tied head's share) -----------------------
def _accumulate_case(mod, arrays, version, B=3, T=7, C=8, V=11, maxT=9, seed=3):
    """(plain dwte, dwpe), (accumulated dwte, dwpe), the prefilled dwte: one call each on the same inputs."""
    dout, idx = _inputs(B, T, C, V, maxT, seed)
    start = np.random.default_rng(seed + 1).standard_normal((V, C)).astype(np.float32)
    outs = {}
    for acc in (False, True):
        dwte = to_backend(start.copy() if acc else np.full((V, C), np.nan, np.float32), arrays)
        dwpe = to_backend(np.full((maxT, C), np.nan, np.float32), arrays)
        kw = {"accumulate": True} if acc else {}
        mod.encoder_backward(to_backend(dout, arrays), to_backend(idx, arrays), dwte, dwpe, version=version, **kw)
        outs[acc] = (to_numpy(dwte), to_numpy(dwpe))
    return outs[False], outs[True], start


@pytest.mark.parametrize("version", SIM_VERSIONS)
def test_accumulate_adds_the_sums_into_dwte(version):
    """accumulate=True in the simulator: dwte = what it held + the sums the plain call writes (v2 and v3: that very
    float32 addition, bit for bit; v1: its atomics add into dwte in their own order), dwpe as the plain call's; shown
    failing on the sums written over dwte and on dwte left out."""
    (plain, wpe0), (acc, wpe1), start = _accumulate_case(enc, "numpy", version)
    np.testing.assert_array_equal(wpe1, wpe0)
    if version == "v1":
        np.testing.assert_allclose(acc, start + plain, rtol=1e-6, atol=1e-6)
    else:
        np.testing.assert_array_equal(acc, start + plain)
    assert not np.allclose(acc, plain) and not np.allclose(acc, start)
    with pytest.raises(TypeError, match="accumulate must be True or False"):
        enc.encoder_backward(np.zeros((1, 2, 3), np.float32), np.zeros((1, 2), np.int32), np.zeros((4, 3), np.float32),
                             np.zeros((2, 3), np.float32), version=version, accumulate=1)


def test_numpy_backend_accumulate():
    from gpullm_lessons.backends import numpy as np_backend

    dout, idx = _inputs(2, 5, 4, 6, 5, seed=1)
    start = np.ones((6, 4), np.float32)
    plain, acc = np.zeros((6, 4), np.float32), start.copy()
    np_backend.encoder_backward(dout, idx, plain, np.zeros((5, 4), np.float32))
    np_backend.encoder_backward(dout, idx, acc, np.zeros((5, 4), np.float32), accumulate=True)
    np.testing.assert_array_equal(acc, start + plain)


@pytest.mark.gpu
@pytest.mark.parametrize("version", enc.VERSIONS)
@pytest.mark.parametrize("backend", ["numba", "hip"])
def test_accumulate_on_gpu(backend, version):
    """accumulate=True on the GPU at GPT-2's vocabulary: v3 (v3_finish_add: its one pass) and v2 bit for bit the
    plain call's sums added to what dwte held, v1 within float32 rounding (atomics into dwte)."""
    if backend == "hip":
        from gpullm_lessons.backends.hip import encoder as mod
        arrays = "cupy"
    else:
        if not __import__("gpullm_lessons").device.numba_on_gpu():
            pytest.skip("Numba kernels run on NVIDIA GPUs only")
        mod, arrays = enc, "numba"
    (plain, wpe0), (acc, wpe1), start = _accumulate_case(mod, arrays, version, B=8, T=256, C=768, V=50304,
                                                         maxT=1024, seed=11)
    np.testing.assert_array_equal(wpe1, wpe0)
    if version == "v1":
        np.testing.assert_allclose(acc, start + plain, rtol=1e-5, atol=1e-5)
    else:
        np.testing.assert_array_equal(acc, start + plain)
    assert not np.allclose(acc, plain) and not np.allclose(acc, start)
