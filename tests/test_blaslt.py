"""runtime/blaslt.py: matrix products with their epilogues (bias; bias + GELU keeping GELU's input; GELU's derivative
with the bias gradient; the bias gradient of the weight-gradient product).

CPU: the NumPy path against float64 arithmetic on the same half inputs, for every epilogue and both transposes,
the timing of cuBLASLt's candidates (with stand-ins for CuPy and cuBLASLt: the fastest kept, scratch outputs only), and
the argument errors. GPU (`make gpu-test`, NVIDIA with nvmath-python): cuBLASLt against the NumPy path on fresh random
inputs at GPT-2's fc shape and at awkward ones, a second call with other bias and aux arrays (the cached plan must
read the new pointers), operands at offsets that are not 256-byte aligned; and the comparison shown to fail on the
planted wrong answers (no bias, GELU of the wrong value, the bias gradient of the other operand); every candidate
cuBLASLt offers against the reference, the tuning's in-place residual and its choice, and none inside a capture."""

import numpy as np
import pytest

from gpullm_lessons import device
from gpullm_lessons.model.precision import f32_to_bf16_bits
from gpullm_lessons.reference.gelu import gelu_backward, gelu_forward
from gpullm_lessons.runtime import blaslt
from gpullm_lessons.runtime.blaslt import EpilogueError, matmul_epilogue


def bits(x):
    return f32_to_bf16_bits(np.asarray(x, np.float32))


def wide(b):
    return (np.asarray(b).astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def case(M, K, N, trans_a=False, trans_b=False, seed=0):
    rng = np.random.default_rng(seed)
    a = bits(rng.standard_normal((K, M) if trans_a else (M, K)))
    b = bits(rng.standard_normal((N, K) if trans_b else (K, N)) / np.sqrt(K))
    bias = rng.standard_normal(N).astype(np.float32)
    aux = bits(rng.standard_normal((M, N)))
    pa, pb = wide(a), wide(b)
    p = (pa.T if trans_a else pa) @ (pb.T if trans_b else pb)
    return a, b, bias, aux, p, (pb.T if trans_b else pb)


def expected(epilogue, p, bias, aux, opb):
    """float64: (out, aux written or None, bias written or None)."""
    if epilogue == "bias":
        return p + bias, None, None
    if epilogue == "gelu_aux_bias":
        pre = p + bias
        return gelu_forward(pre)[0], pre, None
    if epilogue == "dgelu_bgrad":
        g = gelu_backward(p, {"inp": wide(aux)})
        return g, None, g.sum(0)
    return p, None, opb.sum(0)


def half_close(got_bits, want, what, roundings=1):
    """Each half result within `roundings` bf16 roundings (2^-8 relative each) of the float64 value, plus the float32
    sum's slack."""
    got = wide(got_bits)
    err = np.abs(got - want) / (np.abs(want) + 1e-3 * np.abs(want).max())
    assert err.max() <= roundings * 2.0**-8 + 1e-5, (what, float(err.max()))


def bias_grad_close(got_bits, want, what):
    """A bias gradient written in half: one bf16 rounding of the float64 column sum, plus the float32 sum's error
    (its order is the library's: up to 1e-3 of the largest sum over thousands of rows)."""
    got = wide(got_bits)
    assert np.all(np.abs(got - want) <= 2.0**-8 * np.abs(want) + 1e-3 * np.abs(want).max()), (what, got, want)


def partial_sums_close(got_bits, terms, what):
    """cuBLASLt's DGELU_BGRAD bias gradient: the column sums of the half dgelu it writes (terms, float64), summed
    with partial sums rounded to bf16 along the way. Measured on an H100 at 33 rows: up to 0.009 from the float64 sum
    of the half values where the total's own rounding is 0.0004 (a partial of ~5 rounded: 2^-9 x 8 = 0.016 at most).
    Each rounding moves the sum by at most 2^-9 of a partial, and the partials' magnitudes add up to at most the
    column's sum of |terms|: within 2^-8 of that sum (two levels of partials) plus one rounding of the total. At a few
    dozen rows that still rejects a sum one row short (a row's |term| is ~7 times the bound there); at thousands of
    rows it rejects only wrong terms (gelu' at the product, another column)."""
    got, want = wide(got_bits), terms.sum(0)
    tol = 2.0**-8 * (np.abs(terms).sum(0) + np.abs(want))
    assert np.all(np.abs(got - want) <= tol), (what, float((np.abs(got - want) / tol).max()))


@pytest.mark.parametrize("epilogue", blaslt.EPILOGUES)
@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (True, False), (False, True)])
def test_numpy_path_is_the_epilogue_in_float32_rounded_to_half(epilogue, trans_a, trans_b):
    """A half out: the bias read in half (the rounded copy) or the bias gradient written in half, as cuBLASLt does."""
    M, K, N = 37, 24, 40
    a, b, bias, aux, p, opb = case(M, K, N, trans_a, trans_b)
    if epilogue == "bgrad_b" and trans_b:
        with pytest.raises(EpilogueError, match="trans_b must be False"):
            matmul_epilogue(a, b, np.zeros((M, N), np.uint16), epilogue, bias=np.zeros(N, np.uint16), trans_b=True)
        return
    out = np.zeros((M, N), np.uint16)
    bias_arg = bits(bias) if epilogue in ("bias", "gelu_aux_bias") else np.zeros(N, np.uint16)
    aux_arg = (
        (np.zeros((M, N), np.uint16) if epilogue == "gelu_aux_bias" else aux.copy())
        if epilogue in ("gelu_aux_bias", "dgelu_bgrad")
        else None
    )
    matmul_epilogue(a, b, out, epilogue, bias=bias_arg, aux=aux_arg, trans_a=trans_a, trans_b=trans_b)
    want, want_aux, want_bias = expected(epilogue, p, wide(bits(bias)), aux, opb)
    half_close(out, want, "out")
    if want_aux is not None:
        half_close(aux_arg, want_aux, "aux")
    if epilogue == "dgelu_bgrad":  # the column sums of the half out, as cuBLASLt's (the NumPy twin rounds once)
        bias_grad_close(bias_arg, wide(out).sum(0), "bias gradient of the half out")
        partial_sums_close(bias_arg, wide(out), "bias gradient of the half out")
        for planted in (wide(out)[:-1].sum(0), gelu_backward(p, {"inp": p}).sum(0)):  # one row short; gelu' at p
            with pytest.raises(AssertionError):
                partial_sums_close(bits(planted), wide(out), "planted")
    elif want_bias is not None:
        bias_grad_close(bias_arg, want_bias, "bias gradient")
    else:
        assert np.array_equal(bias_arg, bits(bias))  # read, not written
    # the comparison tells the plausible wrong answers apart: no bias; GELU of the product alone; GELU's derivative
    # at the product instead of at aux; the bias gradient one row of op(b) short
    with pytest.raises(AssertionError):
        if epilogue == "bgrad_b":
            bias_grad_close(bias_arg, opb[:-1].sum(0), "planted")
        else:
            planted = {"bias": p, "gelu_aux_bias": gelu_forward(p)[0], "dgelu_bgrad": gelu_backward(p, {"inp": p})}
            half_close(out, planted[epilogue], "planted")
    out32 = np.zeros((M, N), np.float32)  # a float32 out: no rounding, a float32 bias
    if epilogue in ("gelu_aux_bias", "dgelu_bgrad"):  # aux has out's type in cuBLASLt: these need a half out
        with pytest.raises(EpilogueError, match="got a float32 out"):
            matmul_epilogue(a, b, out32, epilogue, bias=bias, aux=aux_arg, trans_a=trans_a, trans_b=trans_b)
        return
    bias32 = bias.copy() if want_bias is None else np.zeros(N, np.float32)
    matmul_epilogue(a, b, out32, epilogue, bias=bias32, trans_a=trans_a, trans_b=trans_b)
    want32, _, want_bias32 = expected(epilogue, p, bias, aux, opb)
    np.testing.assert_allclose(out32, want32, rtol=1e-5, atol=1e-5 * np.abs(want32).max())
    if want_bias32 is not None:
        np.testing.assert_allclose(bias32, want_bias32, rtol=1e-5, atol=1e-5 * np.abs(want_bias32).max())


def test_the_bias_epilogue_adds_the_residual_c_into_a_float32_out():
    a, b, bias, aux, p, opb = case(37, 24, 40)
    res = np.random.default_rng(5).standard_normal((37, 40)).astype(np.float32)
    out = np.zeros((37, 40), np.float32)
    matmul_epilogue(a, b, out, "bias", bias=bias, c=res)
    np.testing.assert_allclose(out, p + bias + res, rtol=1e-5, atol=1e-5)
    with pytest.raises(AssertionError):  # without the residual: told apart
        np.testing.assert_allclose(out, p + bias, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "call, said",
    [
        (dict(epilogue="relu"), "epilogue must be one of bias, gelu_aux_bias, dgelu_bgrad, bgrad_b"),
        (dict(fmt="fp32"), "fmt must be one of bf16, fp16"),
        (dict(b=np.zeros((7, 40), np.uint16)), r"shapes do not chain: op\(a\) \(37, 24\), op\(b\) \(7, 40\)"),
        (dict(bias=None), r"bias needs bias, the bias: float32, out's format \(float32\) of shape \(40,\), got None"),
        (dict(bias=np.zeros(39, np.float32)), r"of shape \(40,\), got float32 \(39,\)"),
        (dict(epilogue="bgrad_b", bias=np.zeros(40, np.float64)), "where the bias gradient goes"),
        (dict(out=np.zeros((37, 40), np.uint16)), r"the bias: the bf16 format, out's \(uint16\) .* got float32"),
        (dict(epilogue="bgrad_b", b=np.zeros((40, 24), np.uint16), trans_b=True), "trans_b must be False"),
        (dict(epilogue="gelu_aux_bias"), "gelu_aux_bias writes out in the bf16 format .* got a float32 out"),
        (
            dict(epilogue="gelu_aux_bias", out=np.zeros((37, 40), np.uint16), bias=np.zeros(40, np.uint16)),
            r"needs aux, GELU's input in bf16 of out's shape \(37, 40\), got None",
        ),
        (dict(aux=np.zeros((37, 40), np.uint16)), "bias takes no aux"),
        (dict(a=np.zeros((37, 24), np.float32)), "a is float32; fmt='bf16' needs uint16"),
        (dict(out=np.zeros((37, 40), np.float16)), "out is float16; it must be float32 or the bf16 format"),
        (dict(out=np.zeros((40, 37), np.float32).T), "out must be C-contiguous"),
        (dict(c=np.zeros((37, 40), np.float32), out=np.zeros((37, 40), np.uint16)), "goes with epilogue 'bias' and a"),
        (dict(c=np.zeros((37, 41), np.float32)), r"c must be float32 of out's shape \(37, 40\)"),
    ],
)
def test_bad_arguments_are_named(call, said):
    args = dict(
        a=np.zeros((37, 24), np.uint16),
        b=np.zeros((24, 40), np.uint16),
        out=np.zeros((37, 40), np.float32),
        epilogue="bias",
        bias=np.zeros(40, np.float32),
        aux=None,
        c=None,
        fmt="bf16",
    )
    args.update(call)
    with pytest.raises(EpilogueError, match=said):
        matmul_epilogue(**args)


# ---- GPU: cuBLASLt against the NumPy path -----------------------------------------------------------------------

needs_nvidia = pytest.mark.skipif(
    device.kind() != "cuda", reason=f"cuBLASLt runs on NVIDIA GPUs (this machine: {device.kind()})"
)


def _gpu_run(epilogue, a, b, bias, aux, trans_a, trans_b, offset=0):
    """The cuBLASLt call on copies of the inputs (placed `offset` elements into larger arrays when asked)."""
    import cupy as cp

    def place(x):
        if not offset:
            return cp.asarray(x)
        big = cp.empty(x.size + offset, x.dtype)
        view = big[offset:].reshape(x.shape)
        view[...] = cp.asarray(x)
        return view

    M, N = (a.shape[1] if trans_a else a.shape[0]), (b.shape[0] if trans_b else b.shape[1])
    out = place(np.zeros((M, N), np.uint16))
    gb = place(bits(bias) if epilogue in ("bias", "gelu_aux_bias") else np.zeros(bias.shape, np.uint16))  # half
    gx = (
        None
        if epilogue not in ("gelu_aux_bias", "dgelu_bgrad")
        else place(np.zeros_like(aux) if epilogue == "gelu_aux_bias" else aux)
    )
    matmul_epilogue(place(a), place(b), out, epilogue, bias=gb, aux=gx, trans_a=trans_a, trans_b=trans_b)
    cp.cuda.Device().synchronize()
    return out.get(), gb.get(), None if gx is None else gx.get()


@pytest.mark.gpu
@needs_nvidia
@pytest.mark.parametrize("epilogue", blaslt.EPILOGUES)
@pytest.mark.parametrize(
    "M,K,N,trans_a,trans_b",
    [
        (4096, 768, 3072, False, False),
        (1000, 3072, 768, False, True),
        (768, 1000, 2304, True, False),
        (33, 40, 72, False, False),
    ],
)
def test_gpu_cublaslt_epilogues_match_the_reference(epilogue, M, K, N, trans_a, trans_b):
    if epilogue == "bgrad_b" and not trans_a:
        pytest.skip("the bias gradient's product is the weight gradient's: a = inp, transposed")
    if epilogue != "bgrad_b" and trans_a:
        pytest.skip("the forward and the input gradient's products do not transpose a")
    for seed, offset in ((1, 0), (2, 8)):  # a second call, fresh arrays at offsets not 256-byte aligned
        a, b, bias, aux, p, opb = case(M, K, N, trans_a, trans_b, seed=seed)
        out, gb, gx = _gpu_run(epilogue, a, b, bias, aux, trans_a, trans_b, offset)
        want, want_aux, want_bias = expected(epilogue, p, wide(bits(bias)), aux, opb)
        # cuBLASLt's DGELU comes out within two bf16 roundings of the float64 value (measured on an H100: up to
        # 0.0076 relative; one rounding is 0.0039), as if the product were rounded to bf16 before gelu' multiplies it
        half_close(out, want, ("out", seed), roundings=2 if epilogue == "dgelu_bgrad" else 1)
        if want_aux is not None:
            half_close(gx, want_aux, ("aux", seed))
        if epilogue == "dgelu_bgrad":
            # cuBLASLt sums the rounded half dgelu it writes, with partial sums rounded to bf16 (measured on an H100:
            # the float64 sum of the float32 values is farther than one bf16 rounding, 17.625 against 17.704 over
            # 4096 rows; the sum of the half values is too, by up to 0.009 at 33 rows): partial_sums_close
            partial_sums_close(gb, wide(out), ("bias gradient of the half out", seed))
        elif want_bias is not None:
            bias_grad_close(gb, want_bias, ("bias gradient", seed))
        # the comparison fails on the planted wrong answers: no bias; GELU of the product without the bias; the
        # bias gradient summed over the other operand
        if epilogue in ("bias", "gelu_aux_bias"):
            wrong = p if epilogue == "bias" else gelu_forward(p)[0]
            with pytest.raises(AssertionError):
                half_close(out, wrong, "planted")
        if epilogue == "dgelu_bgrad":  # gelu' at the product instead of at aux: caught at two roundings too
            with pytest.raises(AssertionError):
                half_close(out, gelu_backward(p, {"inp": p}), "planted", roundings=2)
            if M <= 64:  # a bias gradient one row short: told apart at a few dozen rows (partial_sums_close)
                with pytest.raises(AssertionError):
                    partial_sums_close(bits(wide(out)[:-1].sum(0)), wide(out), "planted")
        if epilogue == "bgrad_b":  # the sum stopped one row of op(b) short
            with pytest.raises(AssertionError):
                bias_grad_close(gb, opb[:-1].sum(0), "planted")


@pytest.mark.gpu
@needs_nvidia
@pytest.mark.parametrize("M,K,N", [(4096, 768, 768), (1000, 3072, 768), (33, 40, 72)])
def test_gpu_bias_epilogue_with_the_residual_matches_the_reference(M, K, N):
    import cupy as cp

    for seed in (3, 4):  # a second call: new arrays, the cached plan
        a, b, bias, aux, p, opb = case(M, K, N, seed=seed)
        res = np.random.default_rng(seed).standard_normal((M, N)).astype(np.float32)
        out = cp.empty((M, N), cp.float32)
        matmul_epilogue(cp.asarray(a), cp.asarray(b), out, "bias", bias=cp.asarray(bias), c=cp.asarray(res))
        want = p + bias + res
        np.testing.assert_allclose(out.get(), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
        with pytest.raises(AssertionError):
            np.testing.assert_allclose(out.get(), p + bias, rtol=1e-4, atol=1e-4 * np.abs(want).max())


# ---- cuBLASLt's candidates, timed on the first call of each plan ------------------------------------------------


def test_tuning_is_on_unless_gpullm_blaslt_tune_is_0(monkeypatch):
    monkeypatch.delenv("GPULLM_BLASLT_TUNE", raising=False)
    assert blaslt.tuning()
    monkeypatch.setenv("GPULLM_BLASLT_TUNE", "0")
    assert not blaslt.tuning()
    monkeypatch.setenv("GPULLM_BLASLT_TUNE", "1")
    assert blaslt.tuning()


def _new_plan(call):
    """Run call() and return the plan key it added to blaslt._PLANS (the shapes below are used by no other test)."""
    before = set(blaslt._PLANS)
    call()
    added = set(blaslt._PLANS) - before
    assert len(added) == 1, added
    return added.pop()


@pytest.mark.gpu
@needs_nvidia
@pytest.mark.parametrize("epilogue", blaslt.EPILOGUES)
def test_gpu_every_candidate_cublaslt_offers_matches_the_reference(epilogue):
    """Tuning may keep any of cuBLASLt's candidates: each one, run on its own, gives the reference's answer."""
    import cupy as cp

    trans_a = epilogue == "bgrad_b"
    M, K, N = (1000, 704, 2112) if not trans_a else (704, 1000, 2112)
    a, b, bias, aux, p, opb = case(M, K, N, trans_a, False, seed=5)
    want, want_aux, want_bias = expected(epilogue, p, wide(bits(bias)), aux, opb)
    gb_in = bits(bias) if epilogue in ("bias", "gelu_aux_bias") else np.zeros(bias.shape, np.uint16)
    ga, gbm = cp.asarray(a), cp.asarray(b)
    key = _new_plan(lambda: _gpu_run(epilogue, a, b, bias, aux, trans_a, False))
    plan = blaslt._PLANS[key]
    lt, (handle, workspace) = blaslt._lt(), blaslt._STATE[cp.cuda.Device().id]
    assert len(plan[4]) >= 1
    for i in range(len(plan[4])):
        out, gb = cp.zeros((M, N), cp.uint16), cp.asarray(gb_in)
        gx = cp.asarray(np.zeros_like(aux) if epilogue == "gelu_aux_bias" else aux) if epilogue in blaslt._AUX else None
        ptrs = (ga.data.ptr, gbm.data.ptr, out.data.ptr, out.data.ptr, gb.data.ptr, None if gx is None else gx.data.ptr)
        blaslt._launch(lt, handle, workspace, plan, i, *ptrs)
        cp.cuda.Device().synchronize()
        half_close(out.get(), want, ("out", epilogue, i), roundings=2 if epilogue == "dgelu_bgrad" else 1)
        if want_aux is not None:
            half_close(gx.get(), want_aux, ("aux", i))
        if epilogue == "dgelu_bgrad":
            partial_sums_close(gb.get(), wide(out.get()), ("bias gradient", i))
        elif want_bias is not None:
            bias_grad_close(gb.get(), want_bias, ("bias gradient", i))


@pytest.mark.gpu
@needs_nvidia
def test_gpu_tuning_keeps_the_fastest_and_writes_only_its_scratch(monkeypatch):
    """The first call of a plan times the candidates on scratch outputs: with the residual read from out itself
    (c is out, the engine's in-place residual) the result is still P + bias + the residual, once (a tuning that wrote
    out would have added the product once per timed launch), and the kept candidate is the fastest timed."""
    import cupy as cp

    monkeypatch.setenv("GPULLM_BLASLT_TUNE", "1")
    M, K, N = 2000, 704, 704
    a, b, bias, aux, p, opb = case(M, K, N, seed=6)
    res = np.random.default_rng(6).standard_normal((M, N)).astype(np.float32)
    out = cp.asarray(res)
    key = _new_plan(lambda: matmul_epilogue(cp.asarray(a), cp.asarray(b), out, "bias", bias=cp.asarray(bias), c=out))
    want = p + bias + res
    np.testing.assert_allclose(out.get(), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    tuned = blaslt.TUNED.get(key)
    if len(blaslt._PLANS[key][4]) > 1:
        assert tuned is not None and tuned["candidates"] == len(blaslt._PLANS[key][4])
        timed = [(t, i) for i, t in enumerate(tuned["us"]) if t is not None]
        assert timed and tuned["chosen"] == min(timed)[1] == blaslt._PLANS[key][7]
    print("candidates and their µs:", tuned)


@pytest.mark.gpu
@needs_nvidia
def test_gpu_no_tuning_inside_a_graph_capture(monkeypatch):
    """A plan first met while a CUDA graph is being captured keeps the heuristic's first candidate (timing would
    need events synchronised mid-capture); the captured product replays the right answer."""
    import cupy as cp

    monkeypatch.setenv("GPULLM_BLASLT_TUNE", "1")
    M, K, N = 3000, 704, 704
    a, b, bias, aux, p, opb = case(M, K, N, seed=7)
    ga, gbm, gbias = cp.asarray(a), cp.asarray(b), cp.asarray(bias)
    out = cp.zeros((M, N), cp.float32)
    stream = cp.cuda.Stream()
    with stream:
        stream.begin_capture(mode=cp.cuda.runtime.streamCaptureModeRelaxed)
        try:
            key = _new_plan(lambda: matmul_epilogue(ga, gbm, out, "bias", bias=gbias))
        finally:
            graph = stream.end_capture()
    assert key not in blaslt.TUNED and blaslt._PLANS[key][7] == 0
    graph.launch(stream)
    stream.synchronize()
    want = p + bias
    np.testing.assert_allclose(out.get(), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


class _FakeCuda:
    """Just enough of CuPy (memory, events, the current stream) and of cuBLASLt's bindings for _tune on a CPU: each
    launch is recorded with its pointers, and "candidate i" takes times[i] µs between two events."""

    def __init__(self, times, refuses=()):
        import types

        self.times, self.refuses, self.launches, self.set = times, set(refuses), [], {}
        self.next_ptr, self.clock, self.last = 1 << 40, 0.0, None
        fake = self

        class Memory:
            def __init__(self, n):
                self.ptr, fake.next_ptr = fake.next_ptr, fake.next_ptr + ((n + 255) // 256 + 1) * 256

        class Event:
            def record(self, stream=None):
                self.at = fake.clock

            def synchronize(self):
                pass

        stream = types.SimpleNamespace(ptr=0, synchronize=lambda: None)
        cuda = types.SimpleNamespace(
            memory=types.SimpleNamespace(Memory=Memory),
            Event=Event,
            get_current_stream=lambda: stream,
            get_elapsed_time=lambda s, e: (e.at - s.at) / 1e3,
        )
        self.cupy = types.SimpleNamespace(cuda=cuda)
        self.lt = types.SimpleNamespace(
            MatmulDescAttribute=types.SimpleNamespace(BIAS_POINTER="bias", EPILOGUE_AUX_POINTER="aux"),
            get_matmul_desc_attribute_dtype=lambda attr: np.uint64,
            matmul_desc_set_attribute=self._set_attr,
            matmul=self._matmul,
        )

    def _set_attr(self, desc, attr, ptr, size):  # the value, read from the host buffer _set passes
        import ctypes

        self.set[attr] = int(np.frombuffer(ctypes.string_at(ptr, size), np.uint64)[0])

    def _matmul(self, handle, desc, alpha, b, la, a, lb, beta, src, ldc, out, ldd, algo, ws, wsize, stream):
        i = (algo - self.found_base) // self.itemsize
        if i in self.refuses:
            raise RuntimeError(f"CUBLAS_STATUS_NOT_SUPPORTED (candidate {i})")
        self.launches.append({"i": i, "a": a, "b": b, "src": src, "out": out, **self.set})
        self.clock += self.times[i]


class _Arr:
    """A stand-in device array: a pointer and a size."""

    def __init__(self, ptr, nbytes):
        import types

        self.data, self.nbytes = types.SimpleNamespace(ptr=ptr), nbytes


@pytest.mark.parametrize("epilogue", blaslt.EPILOGUES)
@pytest.mark.parametrize("residual", [False, True])
def test_tuning_times_every_candidate_on_scratch_and_keeps_the_fastest(epilogue, residual, monkeypatch):
    """_tune (CPU, with stand-ins for CuPy and cuBLASLt): every candidate is launched, the fastest that launches is
    kept (candidate 2 would be faster but is refused), and no launch writes the caller's out, nor the bias or aux that
    the epilogue writes; the inputs, and the residual c read in place of out's old value, are the caller's."""
    import sys

    if residual and epilogue != "bias":
        pytest.skip("the residual goes with the bias epilogue")
    fake = _FakeCuda(times=[9.0, 7.0, 1.0, 5.0, 8.0], refuses=[2])
    monkeypatch.setitem(sys.modules, "cupy", fake.cupy)
    found = np.zeros(5, dtype=[("algo", np.uint8, 64), ("workspace", np.uint64)])
    fake.found_base = found.ctypes.data + found.dtype.fields["algo"][1]
    fake.itemsize = found.itemsize
    plan = ("desc", "la", "lb", "ld", found, np.array(1.0, np.float32), np.array(0.0, np.float32), 0)
    a, b, out, bias = _Arr(0x1000, 64), _Arr(0x2000, 64), _Arr(0x3000, 4096), _Arr(0x4000, 128)
    aux = _Arr(0x5000, 4096) if epilogue in blaslt._AUX else None
    c = out if residual else None  # the engine's in-place residual: c is out
    key = ("test", epilogue, residual)
    pick = blaslt._tune(fake.lt, "handle", _Arr(0x6000, 1).data, plan, key, a, b, out, epilogue, bias, aux, c)
    assert pick == 3 and blaslt.TUNED.pop(key) == {"candidates": 5, "chosen": 3, "us": [9.0, 7.0, None, 5.0, 8.0]}
    assert sorted({x["i"] for x in fake.launches}) == [0, 1, 3, 4]
    assert all(x["a"] == a.data.ptr and x["b"] == b.data.ptr for x in fake.launches)
    assert not any(x["out"] == out.data.ptr for x in fake.launches)  # out: scratch only
    assert all(x["src"] == (c.data.ptr if residual else x["out"]) for x in fake.launches)
    if epilogue in blaslt._WRITES_BIAS:
        assert not any(x["bias"] == bias.data.ptr for x in fake.launches)
    else:
        assert all(x["bias"] == bias.data.ptr for x in fake.launches)
    if epilogue == "gelu_aux_bias":
        assert not any(x["aux"] == aux.data.ptr for x in fake.launches)
    elif epilogue == "dgelu_bgrad":
        assert all(x["aux"] == aux.data.ptr for x in fake.launches)  # read: the caller's GELU input


def test_tuning_with_every_candidate_refused_keeps_the_first(monkeypatch):
    import sys

    fake = _FakeCuda(times=[1.0, 1.0], refuses=[0, 1])
    monkeypatch.setitem(sys.modules, "cupy", fake.cupy)
    found = np.zeros(2, dtype=[("algo", np.uint8, 64)])
    fake.found_base, fake.itemsize = found.ctypes.data, found.itemsize
    plan = ("desc", "la", "lb", "ld", found, np.array(1.0, np.float32), np.array(0.0, np.float32), 0)
    arrs = [_Arr(0x1000 * (i + 1), 64) for i in range(4)]
    assert blaslt._tune(fake.lt, "h", arrs[0].data, plan, "k", *arrs[:3], "bias", arrs[3], None, None) == 0
    assert blaslt.TUNED.pop("k")["us"] == [None, None]
