"""The training engine (gpullm_lessons.engine): the kernel backends against the NumPy reference.

In the CUDA simulator (CI) the Numba backend runs a toy GPT; on a GPU (`make gpu-test`) both kernel backends run a
small but realistic one for 10 steps against the reference loop, in fp32, bf16 and fp16, with every policy.
"""
import numpy as np
import pytest

from gpullm_lessons import device, engine
from gpullm_lessons.runtime import sm90
from gpullm_lessons.runtime.blas import gemm
from gpullm_lessons.model.params import GPTConfig
from gpullm_lessons.model.precision import bf16_bits_to_f32, f32_to_bf16_bits

TOY = GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, d_model=16)
SMALL = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, d_model=128)


def batch(cfg, B, T, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32),
            rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32))


def host(a):
    return a.get() if hasattr(a, "get") else np.asarray(a)


def grads_of(eng, x, y, loss_scale=1.0):
    _, loss = eng.forward(x, y)
    eng.backward(loss_scale)
    return loss, {k: host(eng.grads[k]).copy() for k in eng.grads.names}


def max_rel(got, ref):
    """Largest |difference| of each tensor relative to that tensor's largest |value|, over all tensors."""
    return max(float(np.abs(got[k] - ref[k]).max() / max(float(np.abs(ref[k]).max()), 1e-30)) for k in ref)


@pytest.fixture(scope="module")
def toy_reference():
    x, y = batch(TOY, 2, 8)
    loss, g = grads_of(engine.build(TOY, "numpy"), x, y)
    return x, y, loss, g


# ---- gemm --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ta, tb", [(False, False), (True, False), (False, True), (True, True)])
def test_gemm_numpy_path_transposes_alpha_beta(ta, tb):
    rng = np.random.default_rng(1)
    A = rng.standard_normal((5, 7), dtype=np.float32)
    Bm = rng.standard_normal((7, 3), dtype=np.float32)
    a = np.ascontiguousarray(A.T) if ta else A
    b = np.ascontiguousarray(Bm.T) if tb else Bm
    out = rng.standard_normal((5, 3), dtype=np.float32)
    want = 0.5 * (A @ Bm) + 2.0 * out
    gemm(a, b, out, ta, tb, alpha=0.5, beta=2.0)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)


def test_gemm_bf16_bits_multiply_the_rounded_values():
    rng = np.random.default_rng(2)
    A, Bm = rng.standard_normal((4, 6, 5), dtype=np.float32), rng.standard_normal((4, 5, 3), dtype=np.float32)
    out = np.empty((4, 6, 3), np.float32)
    gemm(f32_to_bf16_bits(A), f32_to_bf16_bits(Bm), out, fmt="bf16")
    want = bf16_bits_to_f32(f32_to_bf16_bits(A)) @ bf16_bits_to_f32(f32_to_bf16_bits(Bm))
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
    assert not np.allclose(out, A @ Bm, rtol=1e-4, atol=0)         # the inputs really were rounded


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_gemm_half_output_is_the_rounded_fp32_product(fmt):
    rng = np.random.default_rng(3)
    A, Bm = rng.standard_normal((3, 6, 5), dtype=np.float32), rng.standard_normal((3, 5, 4), dtype=np.float32)
    if fmt == "bf16":
        a, b, half_of = f32_to_bf16_bits(A), f32_to_bf16_bits(Bm), f32_to_bf16_bits
    else:
        a, b = A.astype(np.float16), Bm.astype(np.float16)
        half_of = lambda x: x.astype(np.float16).view(np.uint16)  # noqa: E731
    f32 = np.empty((3, 6, 4), np.float32)
    gemm(a, b, f32, fmt=fmt, alpha=0.25)
    half = np.full((3, 6, 4), 0xFFFF, np.uint16)
    gemm(a, b, half, fmt=fmt, alpha=0.25)
    assert np.array_equal(half, half_of(f32))                      # fp32 accumulation, one rounding at the end
    with pytest.raises(TypeError, match="out must be float32.*or uint16"):
        gemm(f32_to_bf16_bits(A), f32_to_bf16_bits(Bm), np.empty((3, 6, 4), np.float16), fmt="bf16")


def _tf32(x):
    """x rounded to TF32 one value at a time by model.precision.tf32_row (lesson 07's table), not by the vectorised
    rounding gemm uses."""
    from gpullm_lessons.model.precision import tf32_row
    return np.array([tf32_row(float(v))["stored"] for v in np.ravel(x)], np.float32).reshape(np.shape(x))


def test_round_to_tf32_is_lesson_07_s_tf32_value_by_value():
    from gpullm_lessons.reference.rounding import round_to
    rng = np.random.default_rng(5)
    x = np.concatenate([rng.standard_normal(2000).astype(np.float32) * np.float32(1e3),
                        np.array([1 + 2**-11, 1 + 3 * 2**-11, -(1 + 2**-11), 3.4e38, 1e-40, 0.0, -0.0, np.inf,
                                  -np.inf], np.float32)])          # ties to even both ways, the top, a subnormal
    got = round_to(x, "tf32")
    assert np.array_equal(got.view(np.uint32), _tf32(x).view(np.uint32))
    assert np.isnan(round_to(np.array([np.nan], np.float32), "tf32")).all()
    assert not np.array_equal(got, x)                               # values really were rounded


def test_gemm_tf32_multiplies_the_tf32_values_with_fp32_sums():
    rng = np.random.default_rng(6)
    A, Bm = rng.standard_normal((3, 6, 40), dtype=np.float32), rng.standard_normal((3, 40, 5), dtype=np.float32)
    out = np.empty((3, 6, 5), np.float32)
    gemm(A, Bm, out, fmt="tf32")
    np.testing.assert_allclose(out, _tf32(A) @ _tf32(Bm), rtol=1e-6, atol=1e-6)
    assert not np.allclose(out, A @ Bm, rtol=1e-5, atol=0)         # not the fp32 product
    np.testing.assert_allclose(out, A @ Bm, rtol=0, atol=2e-2)      # but within TF32's 2^-11 per input
    with pytest.raises(TypeError, match="fmt='tf32' needs float32"):
        gemm(f32_to_bf16_bits(A), Bm, out, fmt="tf32")
    with pytest.raises(TypeError, match=r"out must be float32 \(fp32 accumulation\), got float16"):
        gemm(A, Bm, out.astype(np.float16), fmt="tf32")


@pytest.mark.gpu
def test_gpu_gemm_tf32_is_cublas_tf32_mode():
    """On NVIDIA, fmt="tf32" reads the inputs as TF32 (the product matches the TF32-rounded inputs' fp32 product far
    better than the fp32 product), and fmt="fp32" does not."""
    import cupy as cp
    if cp.cuda.runtime.is_hip:
        with pytest.raises(ValueError, match="cuBLAS's TF32 mode"):
            gemm(cp.ones((4, 4), cp.float32), cp.ones((4, 4), cp.float32), cp.empty((4, 4), cp.float32), fmt="tf32")
        return
    rng = np.random.default_rng(7)
    A, Bm = rng.standard_normal((512, 256), dtype=np.float32), rng.standard_normal((256, 384), dtype=np.float32)
    from gpullm_lessons.reference.rounding import round_to
    exact = A.astype(np.float64) @ Bm.astype(np.float64)
    as_tf32 = round_to(A, "tf32").astype(np.float64) @ round_to(Bm, "tf32").astype(np.float64)
    out = cp.empty((512, 384), cp.float32)
    gemm(cp.asarray(A), cp.asarray(Bm), out, fmt="tf32")
    tf = out.get()
    gemm(cp.asarray(A), cp.asarray(Bm), out, fmt="fp32")
    f32 = out.get()
    assert np.abs(tf - as_tf32).max() < 1e-3 < np.abs(tf - exact).max()
    assert np.abs(f32 - exact).max() < 1e-3 < np.abs(f32 - as_tf32).max()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_gpu_gemm_half_output_is_the_rounded_fp32_product(fmt):
    """cuBLAS with a half output (scores at GPT-2's attention shape): the fp32 product rounded once, up to its own
    choice of algorithm for each output type (one half ulp on a few elements)."""
    import cupy as cp
    rng = np.random.default_rng(4)
    q, k = rng.standard_normal((24, 256, 64), dtype=np.float32), rng.standard_normal((24, 256, 64), dtype=np.float32)
    if fmt == "bf16":
        a, b = cp.asarray(f32_to_bf16_bits(q)), cp.asarray(f32_to_bf16_bits(k))
    else:
        a, b = cp.asarray(q.astype(np.float16)), cp.asarray(k.astype(np.float16))
    f32 = cp.empty((24, 256, 256), cp.float32)
    half = cp.full((24, 256, 256), 0xFFFF, cp.uint16)
    gemm(a, b, f32, trans_b=True, fmt=fmt)
    gemm(a, b, half, trans_b=True, fmt=fmt)
    f = cp.asnumpy(f32)
    want = f32_to_bf16_bits(f) if fmt == "bf16" else f.astype(np.float16).view(np.uint16)
    got = cp.asnumpy(half)

    def ordered(bits):
        mag = (bits & 0x7FFF).astype(np.int64)
        return np.where(bits & 0x8000, -mag, mag)
    steps = np.abs(ordered(got) - ordered(want))
    assert steps.max() <= 1 and (steps > 0).mean() <= 1e-3


def test_gemm_errors_name_the_problem():
    a, b = np.zeros((2, 3), np.float32), np.zeros((4, 5), np.float32)
    with pytest.raises(ValueError, match="do not chain"):
        gemm(a, b, np.zeros((2, 5), np.float32))
    with pytest.raises(TypeError, match="fp32.*float32"):
        gemm(a.astype(np.float16), np.zeros((3, 5), np.float32), np.zeros((2, 5), np.float32))
    with pytest.raises(TypeError, match="out must be float32"):
        gemm(a, np.zeros((3, 5), np.float32), np.zeros((2, 5), np.float64))
    with pytest.raises(ValueError, match="C-contiguous"):
        gemm(np.zeros((3, 2), np.float32).T, np.zeros((3, 5), np.float32), np.zeros((2, 5), np.float32))


# ---- build errors ------------------------------------------------------------------------------------------------
def test_engine_memory_counts_half_scores():
    long_rows = GPTConfig(vocab_size=256, block_size=256, n_layer=2, n_head=8, d_model=64)   # the scores dominate
    f32 = engine.engine_memory(long_rows, 8, 256, "bf16", "none", half_scores=False)
    half = engine.engine_memory(long_rows, 8, 256, "bf16", "none")            # the engine's default: half scores
    TT = 8 * 8 * 256 * 256
    assert f32["working_set"] - half["working_set"] == 2 * TT and half["activations"] == f32["activations"]
    assert engine.engine_memory(long_rows, 8, 256, "fp32", "none", half_scores=False) == engine.engine_memory(
        long_rows, 8, 256, "fp32", "none")                        # fp32 runs keep fp32 scores


def test_engine_memory_counts_a_half_gelu_input():
    """versions gelu_in "half": each block keeps fc (B*T, 4C) in 2 bytes an element instead of 4; the forward holds
    the float32 product beside its half copy for one pass (a temporary of 4 B*T*C floats). fp32 runs ignore it."""
    cfg, B, T = SMALL, 8, 64
    f32 = engine.engine_memory(cfg, B, T, "bf16", "none")
    half = engine.engine_memory(cfg, B, T, "bf16", "none", half_gelu_in=True)
    NC = B * T * cfg.d_model
    assert f32["activations"] - half["activations"] == cfg.n_layer * 4 * NC * 2
    assert half["activations_per_block"] == f32["activations_per_block"] - 4 * NC * 2
    assert engine.engine_memory(cfg, B, T, "fp32", "none", half_gelu_in=True) == engine.engine_memory(
        cfg, B, T, "fp32", "none")
    sel = engine.engine_memory(cfg, B, T, "fp16", "selective", half_gelu_in=True)
    assert sel["activations"] < engine.engine_memory(cfg, B, T, "fp16", "selective")["activations"]


def test_engine_memory_counts_the_epilogue_products():
    """versions epilogue "cublaslt" with gelu_in "half": the fc projection's backward makes the half dfc in its
    product, so the block backward's largest stage loses the float32 dgelu beside the half dfc: 2 bytes an element of
    (B*T, C) less at the backward's peak here, where a block's backward is the largest working set (small vocabulary).
    The kept activations do not change; without the half GELU input the backward is the unfused one."""
    cfg, B, T = GPTConfig(vocab_size=64, block_size=64, n_layer=2, n_head=4, d_model=128), 8, 64
    NC = B * T * cfg.d_model
    plain = engine.engine_memory(cfg, B, T, "bf16", attention="flash", half_gelu_in=True)
    epi = engine.engine_memory(cfg, B, T, "bf16", attention="flash", half_gelu_in=True, epilogue=True)
    assert plain["working_set"] - epi["working_set"] == 2 * NC
    assert epi["activations"] == plain["activations"] and epi["total"] == plain["total"] - 2 * NC
    # the forward's float32 fc product is gone too: where a block's forward is the peak (full recompute, whose
    # backward re-runs the forward), the epilogue's peak is lower by it
    full = {e: engine.engine_memory(cfg, B, T, "bf16", "full", attention="flash", half_gelu_in=True, epilogue=e)
            for e in (False, True)}
    assert full[True]["working_set"] < full[False]["working_set"]
    # versions dgelu "kernel": dfc made as without the epilogues (the float32 dgelu is back at the backward's peak)
    kernel = engine.engine_memory(cfg, B, T, "bf16", attention="flash", half_gelu_in=True, epilogue=True,
                                  dgelu_epilogue=False)
    assert kernel["working_set"] == plain["working_set"] and kernel["activations"] == epi["activations"]
    f32_in = engine.engine_memory(cfg, B, T, "fp16", attention="cublas")
    assert engine.engine_memory(cfg, B, T, "fp16", attention="cublas", epilogue=True) == f32_in
    with pytest.raises(ValueError, match="epilogue.*fp32"):
        engine.engine_memory(cfg, B, T, "fp32", epilogue=True)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_half_gelu_input_keeps_half_bits_and_the_gradients_close(toy_reference, precision):
    """versions gelu_in "half": the cache holds fc as half bits (uint16); the gradients stay within the half run's
    bounds of fp32 and differ from the float32 GELU input's (the rounding is really used); selective recompute
    (gelu_half) gives the same bits as keeping everything."""
    x, y, loss_ref, g_ref = toy_reference
    eng = engine.build(TOY, "numba", precision=precision, versions={"gelu_in": "half"})
    loss, g = grads_of(eng, x, y)
    assert abs(loss - loss_ref) < 1e-3 * loss_ref
    assert max_rel(g, g_ref) < (3e-2 if precision == "bf16" else 5e-3)
    _, g32 = grads_of(engine.build(TOY, "numba", precision=precision), x, y)
    assert max_rel(g, g32) > 0
    _, g_sel = grads_of(engine.build(TOY, "numba", precision=precision, policy="selective",
                                     versions={"gelu_in": "half"}), x, y)
    assert all(np.array_equal(g_sel[k], g[k]) for k in g)


def test_a_half_gelu_input_is_what_the_block_keeps():
    eng = engine.build(TOY, "numba", precision="bf16", versions={"gelu_in": "half"})
    x, y = batch(TOY, 2, 8)
    eng.forward(x, y)
    kept = [c["fc"] for c in eng._cache["blocks"]]
    assert len(kept) == TOY.n_layer and all(a.dtype == np.uint16 and a.shape == (16, 4 * TOY.d_model) for a in kept)
    eng32 = engine.build(TOY, "numba", precision="bf16")
    eng32.forward(x, y)
    assert all(c["fc"].dtype == np.float32 for c in eng32._cache["blocks"])


@pytest.mark.parametrize("precision,gelu_in", [("bf16", "half"), ("fp16", "f32")])
def test_epilogues_keep_the_gradients_and_recompute_the_same_bits(toy_reference, precision, gelu_in):
    """versions epilogue "cublaslt" (here its NumPy twin, runtime/blaslt.py): each projection's bias and the residual
    are added inside its product, and with gelu_in "half" GELU's backward and the fc bias gradient inside the product
    that makes dfc; the gradients stay within the half run's bounds of fp32 and close to the unfused run's (the same
    sums in another order); selective recompute gives the bits of keeping everything."""
    x, y, loss_ref, g_ref = toy_reference
    v = {"epilogue": "cublaslt", "gelu_in": gelu_in}
    loss, g = grads_of(engine.build(TOY, "numba", precision=precision, versions=v), x, y)
    assert abs(loss - loss_ref) < 1e-3 * loss_ref
    assert max_rel(g, g_ref) < (3e-2 if precision == "bf16" else 5e-3)
    _, g_plain = grads_of(engine.build(TOY, "numba", precision=precision, versions={"gelu_in": gelu_in}), x, y)
    assert max_rel(g, g_plain) < (1e-2 if precision == "bf16" else 2e-3)
    if gelu_in == "half":  # the recompute reads the kept half input, as the fused backward does
        _, g_sel = grads_of(engine.build(TOY, "numba", precision=precision, policy="selective", versions=v), x, y)
        assert all(np.array_equal(g_sel[k], g[k]) for k in g)


def with_biases(eng, seed=3):
    """eng with every bias drawn at random (the same for every engine: a model at init has zero biases, which a
    product that drops its bias would reproduce exactly)."""
    from gpullm_lessons.runtime.arrays import backend_of, to_backend

    for name in eng.params.names:
        if name.endswith("b") and name not in ("ln1b", "ln2b", "lnfb"):
            rng = np.random.default_rng([seed, len(name), sum(map(ord, name))])
            value = 0.5 * rng.standard_normal(np.shape(eng.params[name])).astype(np.float32)
            eng.params[name] = to_backend(value, backend_of(eng.params.flat))  # a GPU engine's buffer is CuPy's
    if hasattr(eng, "params_changed"):
        eng.params_changed()
    return eng


def test_epilogues_add_nonzero_biases(monkeypatch):
    """With every bias non-zero: the epilogue run (bf16, GELU input in half: the qkv, fc and projection products add
    their biases) keeps the gradients of the fp32 reference with the same biases, and a product that drops its bias
    is caught."""
    from gpullm_lessons.runtime import blaslt

    x, y = batch(TOY, 2, 8)
    loss_ref, g_ref = grads_of(with_biases(engine.build(TOY, "numpy")), x, y)
    v = {"epilogue": "cublaslt", "gelu_in": "half"}
    loss, g = grads_of(with_biases(engine.build(TOY, "numba", precision="bf16", versions=v)), x, y)
    assert abs(loss - loss_ref) < 1e-3 * loss_ref and max_rel(g, g_ref) < 3e-2
    real = blaslt.matmul_epilogue

    def no_bias(*a, **k):  # the read bias replaced by zeros
        if a[3] == "bias":
            k = {**k, "bias": k["bias"] * 0}
        return real(*a, **k)

    monkeypatch.setattr(blaslt, "matmul_epilogue", no_bias)
    loss_w, g_w = grads_of(with_biases(engine.build(TOY, "numba", precision="bf16", versions=v)), x, y)
    assert max_rel(g_w, g_ref) > 0.1


def test_epilogues_run_the_fused_products_instead_of_the_bias_passes(monkeypatch):
    """With epilogue "cublaslt" no bias_add pass runs: both projections go through matmul_epilogue with the
    residual; a product that drops the residual is caught by the gradients."""
    from gpullm_lessons.runtime import blaslt

    calls = []
    real = blaslt.matmul_epilogue
    monkeypatch.setattr(blaslt, "matmul_epilogue", lambda *a, **k: calls.append(k.get("c") is not None) or real(*a, **k))
    eng = engine.build(TOY, "numba", precision="bf16", versions={"epilogue": "cublaslt"})
    monkeypatch.setattr(eng.K, "bias_add", lambda *a, **k: (_ for _ in ()).throw(AssertionError("bias_add ran")))
    x, y = batch(TOY, 2, 8)
    _, g = grads_of(eng, x, y)
    assert calls == [True, True] * TOY.n_layer
    eng_half = engine.build(TOY, "numba", precision="bf16", versions={"epilogue": "cublaslt", "gelu_in": "half"})
    bias_gelu = eng_half.K.bias_gelu_forward   # the launchers' module is shared: put it back after this engine
    monkeypatch.setattr(eng_half.K, "bias_gelu_forward", lambda *a, **k: (_ for _ in ()).throw(AssertionError("ran")))
    seen = []
    monkeypatch.setattr(blaslt, "matmul_epilogue", lambda *a, **k: seen.append((a[3], str(a[2].dtype))) or real(*a, **k))
    grads_of(eng_half, x, y)
    # with the GELU input in half: the fc product adds its bias and writes the half GELU input (no float32 fc, no
    # bias_gelu_forward pass), and the fc projection's backward runs DGELU_BGRAD
    assert seen.count(("dgelu_bgrad", "uint16")) == TOY.n_layer
    assert seen.count(("bias", "float32")) == 2 * TOY.n_layer and seen.count(("bias", "uint16")) == TOY.n_layer
    monkeypatch.setattr(eng_half.K, "bias_gelu_forward", bias_gelu)
    monkeypatch.setattr(blaslt, "matmul_epilogue", real)
    monkeypatch.setattr(blaslt, "matmul_epilogue", lambda *a, **k: real(*a, **{**k, "c": None}))   # residual dropped
    _, wrong = grads_of(engine.build(TOY, "numba", precision="bf16", versions={"epilogue": "cublaslt"}), x, y)
    assert max_rel(wrong, g) > 0.1


def test_dgelu_kernel_makes_dfc_in_the_pass_and_keeps_the_other_epilogues(monkeypatch):
    """versions dgelu "kernel" (with epilogue "cublaslt", gelu_in "half"): no DGELU_BGRAD product runs; the fc
    projection's backward is a plain product and colsum_convert's pass with GELU's derivative (gelu_of) makes dfc and
    the fc bias gradient, while the forward's epilogues stay; the gradients are the DGELU_BGRAD run's up to the order
    of the sums, with non-zero biases, and a pass that drops GELU's derivative is caught."""
    from gpullm_lessons.runtime import blaslt

    x, y = batch(TOY, 2, 8)
    v = {"epilogue": "cublaslt", "gelu_in": "half"}
    _, g_fused = grads_of(with_biases(engine.build(TOY, "numba", precision="bf16", versions=v)), x, y)
    seen, gelu_passes = [], []
    real = blaslt.matmul_epilogue
    monkeypatch.setattr(blaslt, "matmul_epilogue", lambda *a, **k: seen.append(a[3]) or real(*a, **k))
    eng = with_biases(engine.build(TOY, "numba", precision="bf16", versions={**v, "dgelu": "kernel"}))
    colsum = eng.K.colsum_convert
    monkeypatch.setattr(eng.K, "colsum_convert",
                        lambda *a, **k: gelu_passes.append(k.get("gelu_of") is not None) or colsum(*a, **k))
    _, g = grads_of(eng, x, y)
    assert "dgelu_bgrad" not in seen and seen.count("bias") == 3 * TOY.n_layer
    assert sum(gelu_passes) == TOY.n_layer
    assert max_rel(g, g_fused) < 1e-2
    monkeypatch.setattr(eng.K, "colsum_convert", lambda *a, **k: colsum(*a, **{**k, "gelu_of": None, "gelu_bias": None}))
    _, wrong = grads_of(eng, x, y)  # GELU's derivative dropped from the pass
    assert max_rel(wrong, g_fused) > 0.1


# ---- versions logits "half": the head's product writes bf16 logits, the loss kernel writes dlogits over them -------
def _rounded_logits_loss(eng32, x, y):
    """The mean cross-entropy (float64) of the bf16-rounded logits of a logits "f32" engine: what logits "half"
    computes, the product's fp32 result rounded on the way out."""
    logits, _ = eng32.forward(x, y)
    z = bf16_bits_to_f32(f32_to_bf16_bits(host(logits).reshape(-1, TOY.vocab_size))).astype(np.float64)
    m = z.max(axis=1, keepdims=True)
    lse = (m + np.log(np.exp(z - m).sum(axis=1, keepdims=True)))[:, 0]
    return float(np.mean(lse - z[np.arange(z.shape[0]), y.reshape(-1)]))


@pytest.mark.parametrize("ce_chunks", [1, 3])
def test_half_logits_give_the_loss_of_the_rounded_logits_and_close_gradients(toy_reference, ce_chunks):
    """versions logits "half" (bf16): forward returns no logits (the dlogits were written over them); the loss is the
    loss of the bf16-rounded logits, not the float32 ones; the gradients stay within bf16's bounds of the fp32
    reference and close to the float32-logits run, chunked (3 chunks of rows, the last one smaller) or not."""
    x, y, loss_ref, g_ref = toy_reference
    eng = engine.build(TOY, "numba", precision="bf16", versions={"logits": "half"}, ce_chunks=ce_chunks)
    logits, loss = eng.forward(x, y)
    assert logits is None
    eng32 = engine.build(TOY, "numba", precision="bf16", ce_chunks=ce_chunks)
    rounded = _rounded_logits_loss(engine.build(TOY, "numba", precision="bf16"), x, y)
    assert abs(loss - rounded) < 1e-5 * rounded
    assert loss != eng32.forward(x, y)[1]  # the rounding is really used
    eng.backward()
    g = {k: host(eng.grads[k]).copy() for k in eng.grads.names}
    _, g32 = grads_of(engine.build(TOY, "numba", precision="bf16", ce_chunks=ce_chunks), x, y)
    assert max_rel(g, g_ref) < 3e-2 and max_rel(g, g32) < 2e-2
    assert max_rel(g, g32) > 0


def test_half_logits_are_one_bf16_buffer_and_evaluation_keeps_float32():
    """The unchunked head keeps one (B*T, V) uint16 buffer (the dlogits, written over the logits); evaluation and
    next_logits still compute float32 logits (no gradients to write over them)."""
    eng = engine.build(TOY, "numba", precision="bf16", versions={"logits": "half"})
    x, y = batch(TOY, 2, 8)
    eng.forward(x, y)
    assert eng._cache["dlogits"].dtype == np.uint16 and eng._cache["dlogits"].shape == (16, TOY.vocab_size)
    eng32 = engine.build(TOY, "numba", precision="bf16")
    assert eng.eval_loss(x, y) == eng32.eval_loss(x, y)
    np.testing.assert_array_equal(eng.next_logits(x[0]), eng32.next_logits(x[0]))


def test_engine_memory_counts_half_logits():
    """logits "half": no float32 logits beside the dlogits: the head's working set loses 4 bytes per logit of the
    whole batch (unchunked) or of one chunk."""
    cfg, B, T = GPTConfig(vocab_size=4096, block_size=64, n_layer=1, n_head=4, d_model=64), 8, 64
    N, V = B * T, cfg.vocab_size
    f32 = engine.engine_memory(cfg, B, T, "bf16")
    half = engine.engine_memory(cfg, B, T, "bf16", half_logits=True)
    assert f32["head"] - half["head"] == 4 * N * V and f32["activations"] == half["activations"]
    # the head is this model's largest working set: the peak falls, to the next largest phase's
    assert 0.5 * 4 * N * V < f32["total"] - half["total"] <= 4 * N * V
    c32 = engine.engine_memory(cfg, B, T, "bf16", ce_chunks=4)
    chalf = engine.engine_memory(cfg, B, T, "bf16", ce_chunks=4, half_logits=True)
    assert c32["head"] - chalf["head"] == 4 * (N // 4) * V
    with pytest.raises(ValueError, match="half_logits=True describes bf16 logits; precision is 'fp16'"):
        engine.engine_memory(cfg, B, T, "fp16", half_logits=True)


# ---- versions dgelu_out "half": the fc projection's backward product writes GELU's output gradient in half -----------
@pytest.mark.parametrize("precision,v", [("bf16", {}), ("fp16", {}), ("bf16", {"epilogue": "cublaslt", "dgelu": "kernel"})])
def test_a_half_gelu_gradient_is_read_by_the_pass_and_keeps_the_gradients_close(monkeypatch, precision, v):
    """versions dgelu_out "half" (gelu_in "half", non-zero biases): colsum_convert's pass gets GELU's output gradient
    as uint16 bits (the product's rounding) in every layer; the gradients stay within the half run's bounds of the
    fp32 NumPy engine's and close to the float32-dgelu run's, and differ from them (the rounding is used)."""
    x, y = batch(TOY, 2, 8)
    _, g_ref = grads_of(with_biases(engine.build(TOY, "numpy")), x, y)
    base = {"gelu_in": "half", **v}
    eng = with_biases(engine.build(TOY, "numba", precision=precision, versions={**base, "dgelu_out": "half"}))
    seen = []
    colsum = eng.K.colsum_convert
    monkeypatch.setattr(eng.K, "colsum_convert",
                        lambda inp, *a, **k: (k.get("gelu_of") is not None and seen.append(str(inp.dtype)),
                                              colsum(inp, *a, **k))[1])
    loss, g = grads_of(eng, x, y)
    assert seen == ["uint16"] * TOY.n_layer
    monkeypatch.setattr(eng.K, "colsum_convert", colsum)
    _, g32 = grads_of(with_biases(engine.build(TOY, "numba", precision=precision, versions=base)), x, y)
    assert max_rel(g, g_ref) < (3e-2 if precision == "bf16" else 5e-3)
    assert 0 < max_rel(g, g32) < (2e-2 if precision == "bf16" else 3e-3)


TOY2 = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, d_model=16)  # two blocks: dx crosses one


@pytest.mark.parametrize(
    "precision,v",
    [("bf16", {}), ("bf16", {"gelu_in": "half"}), ("bf16", {"gelu_in": "half", "dgelu": "kernel"}), ("fp16", {})],
    ids=["bf16", "gelu-half", "gelu-half-kernel", "fp16"],
)
def test_the_half_residual_gradient_copy_replaces_the_projections_passes(monkeypatch, precision, v):
    """versions dres_out "half" (epilogue "cublaslt"): the LayerNorm backwards write the residual stream's gradient's
    half copy (every one but block 0's input gradient, which only the embedding reads), and the projections read it:
    of the four colsum_convert passes over an (N, C) gradient only the last block's fc projection's is left (its dx
    comes from the final LayerNorm). Every gradient but the projections' biases is the same bits as without it (the
    same half copy, the same products); those two biases, now the sums of the half values, stay within the format's
    rounding of the float32 sums and differ from them."""
    x, y = batch(TOY2, 2, 8)
    base = {"epilogue": "cublaslt", **v}
    C = TOY2.d_model

    def run(versions):
        eng = with_biases(engine.build(TOY2, "numba", precision=precision, versions=versions))
        seen = {"colsum": 0, "copies": 0}
        colsum, lnb = eng.K.colsum_convert, eng.K.layernorm_backward

        def counted_colsum(inp, *a, **k):
            seen["colsum"] += inp.shape[1] == C
            return colsum(inp, *a, **k)

        def counted_lnb(*a, **k):
            seen["copies"] += k.get("dinp_half") is not None
            return lnb(*a, **k)

        with monkeypatch.context() as m:  # eng.K is the backend's module: the counters leave with the run
            m.setattr(eng.K, "colsum_convert", counted_colsum)
            m.setattr(eng.K, "layernorm_backward", counted_lnb)
            _, g = grads_of(eng, x, y)
        return g, seen

    g32, seen32 = run(base)
    g, seen = run({**base, "dres_out": "half"})
    assert seen32 == {"colsum": 4, "copies": 0} and seen == {"colsum": 1, "copies": 3}
    biases = ("attprojb", "fcprojb")
    for k in g:
        if k not in biases:
            np.testing.assert_array_equal(g[k], g32[k], err_msg=k)
    assert 0 < max_rel({k: g[k] for k in biases}, {k: g32[k] for k in biases}) < (1e-2 if precision == "bf16" else 1e-3)


def test_dres_out_is_refused_without_the_epilogues():
    with pytest.raises(engine.EngineError, match="dres_out must be 'f32' or 'half', got 'bf16'"):
        engine.build(TOY, "numba", precision="bf16", versions={"dres_out": "bf16"})
    with pytest.raises(engine.EngineError, match="dres_out='half' .*epilogue='none', precision='bf16'"):
        engine.build(TOY, "numba", precision="bf16", versions={"dres_out": "half"})
    cfg, B, T = GPTConfig(vocab_size=64, block_size=64, n_layer=2, n_head=4, d_model=128), 8, 64
    kw = dict(attention="flash", epilogue=True)
    f32, half = (engine.engine_memory(cfg, B, T, "bf16", half_dres=h, **kw) for h in (False, True))
    assert 0 < half["working_set"] - f32["working_set"] <= 2 * B * T * cfg.d_model * 2  # at most two copies at once
    with pytest.raises(ValueError, match="half_dres=True describes the LayerNorm backward's half copy"):
        engine.engine_memory(cfg, B, T, "bf16", half_dres=True)


def test_engine_memory_counts_a_half_gelu_gradient():
    """dgelu_out "half": the fc projection's backward holds GELU's output gradient in 2 bytes an element: where a
    block's backward is the step's largest working set (a small vocabulary), the peak falls."""
    cfg, B, T = GPTConfig(vocab_size=64, block_size=64, n_layer=2, n_head=4, d_model=128), 8, 64
    NC = B * T * cfg.d_model
    f32 = engine.engine_memory(cfg, B, T, "bf16", attention="flash", half_gelu_in=True)
    half = engine.engine_memory(cfg, B, T, "bf16", attention="flash", half_gelu_in=True, half_dgelu=True)
    # the fc projection's stages lose 4 * NC * 2 bytes; the peak falls to the next largest stage's
    assert 0 < f32["working_set"] - half["working_set"] <= 4 * NC * 2 and f32["activations"] == half["activations"]
    with pytest.raises(ValueError, match="half_dgelu=True describes a half GELU gradient beside half_gelu_in=True"):
        engine.engine_memory(cfg, B, T, "bf16", half_dgelu=True)


def test_engine_memory_counts_a_half_dqkv():
    """dqkv_out "half" (flash with the epilogues): the flash backward writes dqkv in 2 bytes an element and no half
    copy of it is made: where a block's backward is the step's largest working set (a small vocabulary), its attention
    stages hold 3 NC (4 - 2) bytes less and its qkv stage 3 NC 4 bytes less (no float32 dqkv beside the half copy)."""
    cfg, B, T = GPTConfig(vocab_size=64, block_size=64, n_layer=2, n_head=4, d_model=128), 8, 64
    NC = B * T * cfg.d_model
    kw = dict(attention="flash", half_gelu_in=True, epilogue=True, dgelu_epilogue=False, half_dgelu=True)
    f32 = engine.engine_memory(cfg, B, T, "bf16", **kw)
    half = engine.engine_memory(cfg, B, T, "bf16", half_dqkv=True, **kw)
    assert 0 < f32["working_set"] - half["working_set"] <= 3 * NC * 4 and f32["activations"] == half["activations"]
    assert f32["total"] - half["total"] == f32["working_set"] - half["working_set"]
    with pytest.raises(ValueError, match="half_dqkv=True describes the flash backward's half dqkv beside epilogue"):
        engine.engine_memory(cfg, B, T, "bf16", attention="flash", half_dqkv=True)
    with pytest.raises(ValueError, match="attention 'cublas'"):
        engine.engine_memory(cfg, B, T, "bf16", attention="cublas", epilogue=True, half_dqkv=True)


def test_build_errors_name_the_problem():
    with pytest.raises(engine.EngineError, match="unknown backend 'cuda'"):
        engine.build(TOY, "cuda")
    with pytest.raises(engine.EngineError, match="unknown precision 'fp8'"):
        engine.build(TOY, "numpy", precision="fp8")
    with pytest.raises(engine.EngineError, match="unknown checkpointing policy"):
        engine.build(TOY, "numpy", policy="some")
    with pytest.raises(engine.EngineError, match="needs a kernel backend"):
        engine.build(TOY, "numpy", precision="bf16")
    with pytest.raises(TypeError, match="GPTConfig"):
        engine.build({"n_layer": 1}, "numpy")
    with pytest.raises(engine.EngineError, match="scores must be 'f32' or 'half'"):
        engine.build(TOY, "numba", versions={"scores": "fp8"})
    with pytest.raises(engine.EngineError, match="gelu_in must be 'f32' or 'half', got 'bf16'"):
        engine.build(TOY, "numba", versions={"gelu_in": "bf16"})
    with pytest.raises(engine.EngineError, match="epilogue must be 'none' or 'cublaslt', got 'lt'"):
        engine.build(TOY, "numba", precision="bf16", versions={"epilogue": "lt"})
    with pytest.raises(engine.EngineError, match="precision='fp32' has none"):
        engine.build(TOY, "numba", versions={"epilogue": "cublaslt"})
    with pytest.raises(engine.EngineError, match="dgelu must be 'cublaslt' or 'kernel', got 'numba'"):
        engine.build(TOY, "numba", precision="bf16", versions={"epilogue": "cublaslt", "gelu_in": "half",
                                                               "dgelu": "numba"})
    with pytest.raises(engine.EngineError, match="this run has epilogue='cublaslt', gelu_in='f32'"):
        engine.build(TOY, "numba", precision="bf16", versions={"epilogue": "cublaslt", "dgelu": "kernel"})
    with pytest.raises(engine.EngineError, match="this run has epilogue='none', gelu_in='half'"):
        engine.build(TOY, "numba", precision="bf16", versions={"gelu_in": "half", "dgelu": "cublaslt"})
    with pytest.raises(engine.EngineError, match="dgelu_out must be 'f32' or 'half', got 'bf16'"):
        engine.build(TOY, "numba", precision="bf16", versions={"dgelu_out": "bf16"})
    for v, why in (({"precision": "fp32", "gelu_in": "half"}, "precision='fp32'"),
                   ({"precision": "bf16"}, "gelu_in='f32'"),
                   ({"precision": "bf16", "gelu_in": "half", "epilogue": "cublaslt"}, "dgelu='cublaslt'")):
        prec = v.pop("precision")
        with pytest.raises(engine.EngineError, match=f"dgelu_out='half' .*{why}"):
            engine.build(TOY, "numba", precision=prec, versions={**v, "dgelu_out": "half"})
    with pytest.raises(engine.EngineError, match="dqkv_out must be 'f32' or 'half', got 'bf16'"):
        engine.build(TOY, "numba", precision="bf16", versions={"dqkv_out": "bf16"})
    # the simulator (and the numba backend) run the cuBLAS attention path: no flash backward to write half dqkv
    with pytest.raises(engine.EngineError, match="dqkv_out='half' .*attention='cublas', flash='v6', epilogue='cublaslt'"):
        engine.build(TOY, "numba", precision="bf16", versions={"epilogue": "cublaslt", "dqkv_out": "half"})
    with pytest.raises(engine.EngineError, match="dqkv_out='half' .*epilogue='none'"):
        engine.build(TOY, "numba", precision="bf16", versions={"dqkv_out": "half"})
    with pytest.raises(engine.EngineError, match="logits must be 'f32' or 'half', got 'bf16'"):
        engine.build(TOY, "numba", precision="bf16", versions={"logits": "bf16"})
    for precision in ("fp32", "fp16"):
        with pytest.raises(engine.EngineError, match=f"logits='half' .*precision='{precision}'"):
            engine.build(TOY, "numba", precision=precision, versions={"logits": "half"})


@pytest.mark.skipif(device.has_gpu(), reason="this machine has a GPU")
def test_hip_without_gpu_says_so():
    with pytest.raises(engine.EngineError, match="backend 'hip' needs a GPU"):
        engine.build(TOY, "hip")
    assert engine.check_backend("auto") == "numpy"


def test_bad_batches_are_refused():
    eng = engine.build(TOY, "numpy")
    x, y = batch(TOY, 2, 8)
    with pytest.raises(ValueError, match="longer than block_size"):
        eng.forward(np.zeros((2, 9), np.int32))
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 64\)"):
        eng.forward(x + 64)
    with pytest.raises(ValueError, match="shape of x"):
        eng.forward(x, y[:, :4])
    with pytest.raises(TypeError, match="integer token ids"):
        eng.forward(x.astype(np.float32))


def test_state_dict_round_trip_continues_the_same_run():
    x, y = batch(TOY, 2, 8)
    a = engine.build(TOY, "numpy", seed=3)
    for _ in range(2):
        a.train_step(x, y, lr=1e-2, weight_decay=0.1, grad_clip=1.0)
    state = a.state_dict()
    b = engine.build(TOY, "numpy", seed=99)                       # other init: everything must come from state
    b.load_state_dict(state)
    la = a.train_step(x, y, lr=1e-2, weight_decay=0.1, grad_clip=1.0)["loss"]
    lb = b.train_step(x, y, lr=1e-2, weight_decay=0.1, grad_clip=1.0)["loss"]
    assert la == lb and np.array_equal(a.params.flat, b.params.flat)
    other = engine.build(GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, d_model=16), "numpy")
    with pytest.raises(ValueError, match="different model config"):
        other.load_state_dict(state)


# ---- the Numba backend in the simulator (or on a GPU) against the reference ---------------------------------------
def test_numba_gradients_match_the_reference(toy_reference):
    x, y, loss_ref, g_ref = toy_reference
    loss, g = grads_of(engine.build(TOY, "numba"), x, y)
    assert abs(loss - loss_ref) <= 1e-5 * loss_ref
    assert max_rel(g, g_ref) < 1e-4


def test_a_wrong_gradient_would_be_caught(toy_reference):
    """The comparison above can fail: the same engine with LayerNorm's dweight left out is far off."""
    x, y, _, g_ref = toy_reference
    eng = engine.build(TOY, "numba")
    _, g = grads_of(eng, x, y)
    g["ln2w"] = np.zeros_like(g["ln2w"])
    assert max_rel(g, g_ref) > 0.5


def test_tf32_products_track_fp32_and_are_not_fp32(toy_reference):
    """versions={"tf32": "on"}: an fp32 run whose matmul inputs are TF32 (the simulator rounds them as the tensor
    cores read them): close to the fp32 gradients, not equal to them."""
    x, y, loss_ref, g_ref = toy_reference
    loss, g = grads_of(engine.build(TOY, "numba", versions={"tf32": "on"}), x, y)
    assert abs(loss - loss_ref) <= 1e-2 * loss_ref and max_rel(g, g_ref) < 2e-2
    _, g_fp32 = grads_of(engine.build(TOY, "numba"), x, y)         # fp32 products: ~1e-7 from the reference
    assert max_rel(g, g_fp32) > 1e-4                               # TF32's: ~1e-3 (2^-11 per matmul input)
    with pytest.raises(engine.EngineError, match="tf32='on' reads fp32 matmul inputs as TF32; precision='bf16'"):
        engine.build(TOY, "numba", precision="bf16", versions={"tf32": "on"})
    with pytest.raises(engine.EngineError, match="tf32 must be 'off' or 'on', got 'yes'"):
        engine.build(TOY, "numba", versions={"tf32": "yes"})


@pytest.mark.parametrize("policy", ["selective", "full"])
def test_checkpointing_policies_give_bitwise_equal_gradients(toy_reference, policy):
    x, y, _, _ = toy_reference
    _, g_none = grads_of(engine.build(TOY, "numba", policy="none"), x, y)
    _, g = grads_of(engine.build(TOY, "numba", policy=policy), x, y)
    assert all(np.array_equal(g[k], g_none[k]) for k in g)


@pytest.mark.parametrize("precision, tol, scores", [("bf16", 3e-2, "f32"), ("fp16", 5e-3, "f32"),
                                                    ("bf16", 3e-2, "half"), ("fp16", 5e-3, "half")])
def test_half_precision_gradients_are_close_but_rounded(toy_reference, precision, tol, scores):
    """Half inputs to every matmul (and, with scores="half", the attention scores and their gradient in half too):
    gradients within `tol` (relative to each tensor's largest value) of fp32, and not equal to them (the rounding
    really happens)."""
    x, y, loss_ref, g_ref = toy_reference
    loss, g = grads_of(engine.build(TOY, "numba", precision=precision, versions={"scores": scores}), x, y)
    assert abs(loss - loss_ref) < 1e-3 * loss_ref
    err = max_rel(g, g_ref)
    assert 1e-6 < err < tol


def test_train_steps_match_the_numpy_engine():
    x, y = batch(TOY, 2, 8, seed=5)
    ref, eng = engine.build(TOY, "numpy"), engine.build(TOY, "numba")
    for step in range(2):
        a = ref.train_step(x, y, lr=1e-2, weight_decay=0.1, grad_clip=1.0)
        b = eng.train_step(x, y, lr=1e-2, weight_decay=0.1, grad_clip=1.0)
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * a["loss"], step
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * a["grad_norm"]
    # normwise: the key bias gets a gradient that is 0 in exact arithmetic (softmax ignores a per-row shift) and
    # rounding noise ~1e-12 in each implementation, which AdamW's m / (sqrt(v) + eps) turns into different tiny steps
    diff = host(eng.params.flat) - ref.params.flat
    assert np.linalg.norm(diff) <= 1e-5 * np.linalg.norm(ref.params.flat)


def test_fp16_overflow_skips_the_step_and_backs_off():
    x, y = batch(TOY, 2, 8)
    eng = engine.build(TOY, "numba", precision="fp16")
    eng.scaler.scale = 2.0 ** 127                      # the scaled gradients overflow fp32 -> inf
    before = [host(a).copy() for a in (eng.params.flat, eng.m, eng.v, eng.half)]
    out = eng.train_step(x, y, lr=1e-2, weight_decay=0.1, grad_clip=1.0)
    assert out["skipped"] and eng.t == 0 and eng.scaler.scale == 2.0 ** 126
    after = [host(a) for a in (eng.params.flat, eng.m, eng.v, eng.half)]
    assert all(np.array_equal(u, w) for u, w in zip(before, after))
    assert not np.any(host(eng.grads.flat))            # the skipped step's gradients are dropped


# ---- on a GPU: both kernel backends, 10 steps, realistic-ish sizes ------------------------------------------------
def reference_losses(cfg, batches, steps):
    eng = engine.build(cfg, "numpy")
    return [eng.train_step(x, y, lr=3e-3, weight_decay=0.1, grad_clip=1.0)["loss"] for x, y in batches[:steps]]


@pytest.fixture(scope="module")
def gpu_batches():
    return [batch(SMALL, 8, 64, seed=s) for s in range(10)]


@pytest.fixture(scope="module")
def gpu_reference(gpu_batches):
    return reference_losses(SMALL, gpu_batches, 10)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["hip", "numba"])
def test_gpu_fp32_first_10_steps_match_the_reference(backend, gpu_batches, gpu_reference):
    eng = engine.build(SMALL, backend)
    losses = [eng.train_step(x, y, lr=3e-3, weight_decay=0.1, grad_clip=1.0)["loss"] for x, y in gpu_batches]
    rel = np.abs(np.array(losses) - gpu_reference) / np.array(gpu_reference)
    assert rel.max() < 1e-4, rel


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["hip", "numba"])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("scores", ["f32", "half"])
def test_gpu_half_precision_tracks_fp32(backend, precision, scores, gpu_batches, gpu_reference):
    eng = engine.build(SMALL, backend, precision=precision, versions={"scores": scores})
    losses = [eng.train_step(x, y, lr=3e-3, weight_decay=0.1, grad_clip=1.0)["loss"] for x, y in gpu_batches]
    rel = np.abs(np.array(losses) - gpu_reference) / np.array(gpu_reference)
    assert rel.max() < 2e-2, rel


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["hip", "numba"])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_gpu_half_gelu_input_tracks_fp32_and_recomputes_the_same_bits(backend, precision, gpu_batches,
                                                                      gpu_reference):
    """versions gelu_in "half" on a GPU: 10 steps track the fp32 reference like the default; selective and full
    recompute give the bits of keeping everything."""
    v = {"gelu_in": "half"}
    eng = engine.build(SMALL, backend, precision=precision, versions=v)
    losses = [eng.train_step(x, y, lr=3e-3, weight_decay=0.1, grad_clip=1.0)["loss"] for x, y in gpu_batches]
    rel = np.abs(np.array(losses) - gpu_reference) / np.array(gpu_reference)
    assert rel.max() < 2e-2, rel
    x, y = gpu_batches[0]
    _, g_none = grads_of(engine.build(SMALL, backend, precision=precision, versions=v), x, y)
    for policy in ("selective", "full"):
        _, g = grads_of(engine.build(SMALL, backend, precision=precision, policy=policy, versions=v), x, y)
        assert all(np.array_equal(g[k], g_none[k]) for k in g), policy


@pytest.mark.gpu
@pytest.mark.skipif(device.kind() != "cuda", reason="cuBLASLt's epilogues run on NVIDIA GPUs")
@pytest.mark.parametrize(
    "attention,gelu_in,dgelu",
    [("flash", "f32", None), ("flash", "half", None), ("cublas", "half", None), ("flash", "half", "kernel")],
)
def test_gpu_epilogues_track_fp32_like_the_unfused_step(attention, gelu_in, dgelu, gpu_batches, gpu_reference):
    """versions epilogue "cublaslt" on the GPU (the qkv bias in the product that writes the flash kernels' half q, k,
    v; each projection's bias and residual in its product; with gelu_in "half" GELU's backward and the fc bias
    gradient in the product that makes dfc, or with dgelu "kernel" in colsum_convert's pass after it): 10 bf16
    steps track the fp32 reference, the first step's gradients are the unfused step's up to the order of the sums,
    and selective recompute gives the same bits."""
    v = {"epilogue": "cublaslt", "attention": attention, "gelu_in": gelu_in, **({"dgelu": dgelu} if dgelu else {})}
    eng = engine.build(SMALL, "hip", precision="bf16", versions=v)
    losses = [eng.train_step(x, y, lr=3e-3, weight_decay=0.1, grad_clip=1.0)["loss"] for x, y in gpu_batches]
    rel = np.abs(np.array(losses) - gpu_reference) / np.array(gpu_reference)
    assert rel.max() < 2e-2, rel
    x, y = gpu_batches[0]
    _, g = grads_of(engine.build(SMALL, "hip", precision="bf16", versions=v), x, y)
    plain = {"attention": attention, "gelu_in": gelu_in}
    _, g_plain = grads_of(engine.build(SMALL, "hip", precision="bf16", versions=plain), x, y)
    assert max_rel(g, g_plain) < 1e-2
    _, g_sel = grads_of(engine.build(SMALL, "hip", precision="bf16", policy="selective", versions=v), x, y)
    assert all(np.array_equal(g_sel[k], g[k]) for k in g)


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["none", "selective"])
def test_gpu_engine_memory_of_a_half_gelu_input_within_10_percent_of_the_pool_peak(policy):
    from gpullm_lessons.bench.train_step import measure_engine
    cfg = GPTConfig(vocab_size=256, block_size=256, n_layer=4, n_head=6, d_model=384)
    r = measure_engine(cfg, 32, 256, "bf16", policy, steps=2, versions={"gelu_in": "half"})
    predicted = engine.engine_memory(cfg, 32, 256, "bf16", policy, half_gelu_in=True)["total"]
    assert abs(predicted - r["peak_bytes"]) <= 0.10 * r["peak_bytes"], (predicted, r["peak_bytes"])


@pytest.mark.gpu
@pytest.mark.parametrize("dgelu", ["cublaslt", "kernel"])
def test_gpu_engine_memory_of_the_epilogue_step_within_10_percent_of_the_pool_peak(dgelu):
    from gpullm_lessons import device as dev
    from gpullm_lessons.bench.train_step import measure_engine
    if dev.kind() != "cuda":
        pytest.skip("the epilogue products call NVIDIA's cuBLASLt")
    cfg = GPTConfig(vocab_size=256, block_size=256, n_layer=4, n_head=6, d_model=384)
    v = {"gelu_in": "half", "epilogue": "cublaslt", "attention": "flash", "dgelu": dgelu}
    r = measure_engine(cfg, 32, 256, "bf16", "none", steps=2, versions=v)
    predicted = engine.engine_memory(cfg, 32, 256, "bf16", attention="flash", half_gelu_in=True, epilogue=True,
                                     dgelu_epilogue=dgelu == "cublaslt")
    assert abs(predicted["total"] - r["peak_bytes"]) <= 0.10 * r["peak_bytes"], (predicted["total"], r["peak_bytes"])


@pytest.mark.gpu
@pytest.mark.parametrize("ce_chunks", [1, 3])
def test_gpu_half_logits_track_fp32_and_the_float32_logits_run(ce_chunks, gpu_batches, gpu_reference):
    """versions logits "half" on the GPU (the head's product writes bf16 logits, crossentropy_forward_backward_hh*
    writes the dlogits over them): 10 bf16 steps track the fp32 reference; the first step's gradients are the
    float32-logits run's within bf16's rounding, and not equal to them (the rounded logits are used)."""
    v = {"logits": "half"}
    eng = engine.build(SMALL, "hip", precision="bf16", versions=v, ce_chunks=ce_chunks)
    losses = [eng.train_step(x, y, lr=3e-3, weight_decay=0.1, grad_clip=1.0)["loss"] for x, y in gpu_batches]
    rel = np.abs(np.array(losses) - gpu_reference) / np.array(gpu_reference)
    assert rel.max() < 2e-2, rel
    x, y = gpu_batches[0]
    _, g = grads_of(engine.build(SMALL, "hip", precision="bf16", versions=v, ce_chunks=ce_chunks), x, y)
    _, g32 = grads_of(engine.build(SMALL, "hip", precision="bf16", ce_chunks=ce_chunks), x, y)
    assert 0 < max_rel(g, g32) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("v", [{}, {"epilogue": "cublaslt", "dgelu": "kernel"}], ids=["plain", "epilogues"])
def test_gpu_half_gelu_gradient_tracks_fp32_and_its_memory_is_predicted(v, gpu_batches, gpu_reference):
    """versions dgelu_out "half" on the GPU (gelu_in "half"; the fc projection's backward product writes bf16 dgelu,
    colsum_convert's _hin pass reads it): 10 bf16 steps track the fp32 reference, the first step's gradients are the
    float32-dgelu run's within bf16's rounding, and engine_memory(..., half_dgelu=True) is within 10% of the pool's
    peak on a model whose block backward is the largest phase."""
    from gpullm_lessons import device as dev
    from gpullm_lessons.bench.train_step import measure_engine
    if v and dev.kind() != "cuda":
        pytest.skip("the epilogue products call NVIDIA's cuBLASLt")
    base = {"gelu_in": "half", **v}
    half = {**base, "dgelu_out": "half"}
    eng = engine.build(SMALL, "hip", precision="bf16", versions=half)
    losses = [eng.train_step(x, y, lr=3e-3, weight_decay=0.1, grad_clip=1.0)["loss"] for x, y in gpu_batches]
    rel = np.abs(np.array(losses) - gpu_reference) / np.array(gpu_reference)
    assert rel.max() < 2e-2, rel
    x, y = gpu_batches[0]
    _, g = grads_of(engine.build(SMALL, "hip", precision="bf16", versions=half), x, y)
    _, g32 = grads_of(engine.build(SMALL, "hip", precision="bf16", versions=base), x, y)
    assert 0 < max_rel(g, g32) < 2e-2
    cfg = GPTConfig(vocab_size=256, block_size=256, n_layer=4, n_head=6, d_model=384)
    r = measure_engine(cfg, 32, 256, "bf16", "none", steps=2, versions={**half, "attention": "flash"})
    predicted = engine.engine_memory(cfg, 32, 256, "bf16", attention="flash", half_gelu_in=True,
                                     epilogue="epilogue" in v, dgelu_epilogue=False, half_dgelu=True)["total"]
    assert abs(predicted - r["peak_bytes"]) <= 0.10 * r["peak_bytes"], (predicted, r["peak_bytes"], r["peak_at"])


def _tracks_and_first_grads(versions, base, gpu_batches, gpu_reference):
    """SMALL in bf16 on the hip backend with `versions`: 10 steps within 2e-2 of the fp32 reference's losses; returns
    the first batch's gradients with `versions` and with `base`."""
    eng = engine.build(SMALL, "hip", precision="bf16", versions=versions)
    losses = [eng.train_step(x, y, lr=3e-3, weight_decay=0.1, grad_clip=1.0)["loss"] for x, y in gpu_batches]
    rel = np.abs(np.array(losses) - gpu_reference) / np.array(gpu_reference)
    assert rel.max() < 2e-2, rel
    x, y = gpu_batches[0]
    _, g = grads_of(engine.build(SMALL, "hip", precision="bf16", versions=versions), x, y)
    _, g_base = grads_of(engine.build(SMALL, "hip", precision="bf16", versions=base), x, y)
    return g, g_base


@pytest.mark.gpu
@pytest.mark.parametrize("v", [{}, {"gelu_in": "half"}, {"gelu_in": "half", "dgelu": "kernel", "dqkv_out": "half"}],
                         ids=["epilogue", "gelu-half", "all-half"])
def test_gpu_half_residual_gradient_copy_tracks_fp32(v, gpu_batches, gpu_reference):
    """versions dres_out "half" on the GPU (hip v5's _res_half LayerNorm backward; the projections' bias gradients
    from BGRADB): 10 bf16 steps track the fp32 reference; the first step's gradients are the run without it within
    bf16's rounding (the dW products now cuBLASLt's), the projections' biases among them."""
    from gpullm_lessons import device as dev
    if dev.kind() != "cuda":
        pytest.skip("the bias gradients come from cuBLASLt's BGRADB epilogue (NVIDIA)")
    base = {"attention": "flash", "epilogue": "cublaslt", **v}
    g, g32 = _tracks_and_first_grads({**base, "dres_out": "half"}, base, gpu_batches, gpu_reference)
    assert max_rel(g, g32) < 2e-2
    biases = ("attprojb", "fcprojb")
    assert 0 < max_rel({k: g[k] for k in biases}, {k: g32[k] for k in biases}) < 2e-2


@pytest.mark.gpu
def test_gpu_half_dqkv_tracks_fp32_and_its_memory_is_predicted(gpu_batches, gpu_reference):
    """versions dqkv_out "half" on the GPU (flash v6's _hg backward writes dqkv in bf16; the qkv bias gradient comes
    from the weight-gradient product's BGRADB epilogue): 10 bf16 steps track the fp32 reference; the first step's
    gradients, the qkv bias gradient among them, are the float32-dqkv run's within bf16's rounding and not equal to
    them; engine_memory(..., half_dqkv=True) is within 10% of the pool's peak where a block's backward is the peak."""
    from gpullm_lessons import device as dev
    from gpullm_lessons.bench.train_step import measure_engine
    if dev.kind() != "cuda":
        pytest.skip("the qkv bias gradient comes from cuBLASLt's BGRADB epilogue (NVIDIA)")
    base = {"attention": "flash", "epilogue": "cublaslt"}
    half = {**base, "dqkv_out": "half"}
    g, g32 = _tracks_and_first_grads(half, base, gpu_batches, gpu_reference)
    assert 0 < max_rel(g, g32) < 2e-2
    assert 0 < max_rel({"qkvb": g["qkvb"]}, {"qkvb": g32["qkvb"]}) < 2e-2  # BGRADB's sums, not zeros or another's
    cfg = GPTConfig(vocab_size=256, block_size=256, n_layer=4, n_head=6, d_model=384)
    r = measure_engine(cfg, 32, 256, "bf16", "none", steps=2, versions=half)
    predicted = engine.engine_memory(cfg, 32, 256, "bf16", attention="flash", epilogue=True, half_dqkv=True)["total"]
    assert abs(predicted - r["peak_bytes"]) <= 0.10 * r["peak_bytes"], (predicted, r["peak_bytes"], r["peak_at"])


@pytest.mark.gpu
@pytest.mark.parametrize(
    "logits,ce_chunks",
    [
        ("half", 1),
        pytest.param("half", 3, marks=pytest.mark.xfail(strict=True, reason=(
            "on an H100 (2026-12-07, 57010e8) the pool peaked at 348.5 MiB against 309.0 MiB predicted: the model "
            "misses a phase of the chunked step at this size (the float32-logits case beside it tells whether the "
            "gap is the half logits' own)"))),
        ("f32", 3),
    ],
)
def test_gpu_engine_memory_of_half_logits_within_10_percent_of_the_pool_peak(logits, ce_chunks):
    """engine_memory(..., half_logits=True) against CuPy's pool peak, on a model whose loss head is its largest
    phase without chunks (V = 8192, 4096 rows); the float32-logits run at the same size and chunks as a control."""
    from gpullm_lessons.bench.train_step import measure_engine
    cfg = GPTConfig(vocab_size=8192, block_size=256, n_layer=2, n_head=6, d_model=384)
    r = measure_engine(cfg, 16, 256, "bf16", "none", steps=2, versions={"logits": logits}, ce_chunks=ce_chunks)
    predicted = engine.engine_memory(cfg, 16, 256, "bf16", ce_chunks=ce_chunks, half_logits=logits == "half")["total"]
    assert abs(predicted - r["peak_bytes"]) <= 0.10 * r["peak_bytes"], (predicted, r["peak_bytes"], r["peak_at"])


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["hip", "numba"])
def test_gpu_tf32_tracks_fp32(backend, gpu_batches, gpu_reference):
    """fp32 with TF32 products (cuBLAS's TF32 mode on NVIDIA): the first 10 losses within 1e-2 of the reference."""
    from gpullm_lessons import device as dev
    if dev.kind() == "rocm":
        with pytest.raises(engine.EngineError, match="TF32 mode"):
            engine.build(SMALL, backend, versions={"tf32": "on"})
        return
    eng = engine.build(SMALL, backend, versions={"tf32": "on"})
    losses = [eng.train_step(x, y, lr=3e-3, weight_decay=0.1, grad_clip=1.0)["loss"] for x, y in gpu_batches]
    rel = np.abs(np.array(losses) - gpu_reference) / np.array(gpu_reference)
    assert rel.max() < 1e-2, rel


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["hip", "numba"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_gpu_policies_bitwise_equal(backend, precision, gpu_batches):
    x, y = gpu_batches[0]
    _, g_none = grads_of(engine.build(SMALL, backend, precision=precision), x, y)
    for policy in ("selective", "full", "sqrt:2"):
        _, g = grads_of(engine.build(SMALL, backend, precision=precision, policy=policy), x, y)
        assert all(np.array_equal(g[k], g_none[k]) for k in g), policy


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_gpu_flash_attention_agrees_with_the_cublas_path(precision, gpu_batches, gpu_reference):
    """The flash attention path (kernels/hip/flash.cu) in the engine: its gradients match the cuBLAS path's (the
    default) within the format's rounding, and 10 steps track the fp32 reference like the cuBLAS path does."""
    flash = engine.build(SMALL, "hip", precision=precision, versions={"attention": "flash"})
    cublas = engine.build(SMALL, "hip", precision=precision, versions={"attention": "cublas"})
    assert flash.ver["attention"] == "flash" and cublas.ver["attention"] == "cublas"
    assert engine.build(SMALL, "hip", precision=precision).ver["attention"] == "flash"  # the default
    assert engine.build(SMALL, "hip").ver["attention"] == "cublas"  # fp32: the default falls back
    x, y = gpu_batches[0]
    _, g_flash = grads_of(flash, x, y)
    _, g_cublas = grads_of(cublas, x, y)
    err = max_rel(g_flash, g_cublas)
    assert 0 < err < (3e-2 if precision == "bf16" else 5e-3), err  # 0 would mean the same path ran twice
    eng = engine.build(SMALL, "hip", precision=precision, versions={"attention": "flash"})
    assert eng.graphs == (precision == "bf16")  # graphs="auto": bf16 steps replayed as graphs, fp16 from Python
    losses = [eng.train_step(x, y, lr=3e-3, weight_decay=0.1, grad_clip=1.0)["loss"] for x, y in gpu_batches]
    rel = np.abs(np.array(losses) - gpu_reference) / np.array(gpu_reference)
    assert rel.max() < 2e-2, rel


@pytest.mark.gpu
@pytest.mark.parametrize("version", ["v4", "v5"])
def test_gpu_each_flash_version_the_engine_can_run_gives_the_default_s_gradients(version, gpu_batches):
    """versions={"flash": v}: the engine's flash path on another version of the packed kernels (bench train
    --flash-version): the same gradients as the default v6 within bf16's rounding."""
    x, y = gpu_batches[0]
    _, g6 = grads_of(engine.build(SMALL, "hip", precision="bf16"), x, y)
    eng = engine.build(SMALL, "hip", precision="bf16", versions={"flash": version})
    assert eng.ver["flash"] == version and eng.ver["attention"] == "flash"
    _, g = grads_of(eng, x, y)
    assert max_rel(g, g6) < 3e-2


@pytest.mark.gpu
@pytest.mark.skipif(not sm90.is_hopper(), reason=f"flash v7 runs on an H100 / H200 (this machine: {device.kind()})")
def test_gpu_flash_v7_in_the_engine_tracks_v6():
    """versions={"flash": "v7"} (kernels/sm90, Hopper's wgmma) at head size 64 and T = 128 (two tiles): the first
    step's gradients are v6's within bf16's rounding, and 10 steps give v6's losses within 2%."""
    cfg = GPTConfig(vocab_size=256, block_size=128, n_layer=2, n_head=2, d_model=128)  # hs = 64
    batches = [batch(cfg, 4, 128, seed=100 + s) for s in range(10)]
    x, y = batches[0]
    _, g6 = grads_of(engine.build(cfg, "hip", precision="bf16"), x, y)
    eng = engine.build(cfg, "hip", precision="bf16", versions={"flash": "v7"})
    assert eng.ver["flash"] == "v7" and eng.ver["attention"] == "flash"
    _, g7 = grads_of(eng, x, y)
    assert 0 < max_rel(g7, g6) < 3e-2  # 0 would mean v6 ran twice
    runs = {}
    for v in ("v6", "v7"):
        e = engine.build(cfg, "hip", precision="bf16", versions={"flash": v})
        runs[v] = [e.train_step(x, y, lr=3e-3, weight_decay=0.1, grad_clip=1.0)["loss"] for x, y in batches]
    rel = np.abs(np.array(runs["v7"]) - runs["v6"]) / np.array(runs["v6"])
    assert rel.max() < 2e-2, rel


def test_flash_attention_is_refused_by_name_where_it_cannot_run():
    from gpullm_lessons.engine.gpu import flash_unsupported

    assert "HIP kernels" in flash_unsupported(SMALL, "numba", "bf16")
    assert "precision 'fp32'" in flash_unsupported(SMALL, "hip", "fp32")
    odd = GPTConfig(vocab_size=256, block_size=64, n_layer=1, n_head=2, d_model=48)  # hs = 24
    assert "head size 24 has no kernel" in flash_unsupported(odd, "hip", "bf16")
    assert flash_unsupported(SMALL, "hip", "bf16") is None
    with pytest.raises(engine.EngineError, match="attention='flash' cannot run here: the flash kernels"):
        engine.build(TOY, "numba", precision="bf16", versions={"attention": "flash"})
    with pytest.raises(engine.EngineError, match="attention must be 'flash' or 'cublas'"):
        engine.build(TOY, "numba", versions={"attention": "sdpa"})
    with pytest.raises(engine.EngineError, match="flash must be one of v4, v5, v6, v7, got 'v2'"):
        engine.build(TOY, "numba", versions={"flash": "v2"})  # v2 and v3 have no kernels on the packed layout
    assert engine.build(TOY, "numba", precision="bf16").ver["attention"] == "cublas"  # the default


def test_flash_v7_is_refused_where_it_cannot_run():
    """v7 (kernels/sm90, Hopper's wgmma) runs the flash path in bf16 at head size 64 on an H100 / H200: anything else
    is refused by name (the rules, checked without a GPU on a stand-in engine)."""
    from types import SimpleNamespace

    from gpullm_lessons.engine.gpu import GPUEngine

    hs64 = GPTConfig(vocab_size=256, block_size=64, n_layer=1, n_head=2, d_model=128)
    hs32 = GPTConfig(vocab_size=256, block_size=64, n_layer=1, n_head=4, d_model=128)
    flash_cpu = SimpleNamespace(ver={"attention": "flash"}, on_gpu=False)
    cases = [
        (SimpleNamespace(ver={"attention": "cublas"}, on_gpu=True), hs64, "bf16", "attention is 'cublas'"),
        (flash_cpu, hs64, "fp16", r"written for bf16 \(precision='fp16'\)"),
        (flash_cpu, hs32, "bf16", r"written for head size 64 \(this model: 32\)"),
        (flash_cpu, hs64, "bf16", "NVIDIA H100 / H200 only"),
    ]
    for stand_in, cfg, precision, said in cases:
        with pytest.raises(engine.EngineError, match=f"flash='v7' cannot run here: .*{said}"):
            GPUEngine._check_v7(stand_in, cfg, precision)
    with pytest.raises(engine.EngineError, match="flash='v7' cannot run here: it is a flash kernel"):
        engine.build(hs64, "numba", precision="bf16", versions={"flash": "v7"})


def test_engine_memory_of_flash_attention_is_linear_in_T():
    """flash keeps the log-sum-exp instead of the (B, nh, T, T) probabilities (y is the kept input of the attention
    projection on both paths): the activations per block double when T doubles, and the difference to the cuBLAS
    path is exactly the probabilities minus lse."""
    cfg = GPTConfig(vocab_size=256, block_size=2048, n_layer=2, n_head=4, d_model=256)  # hs = 64
    B, T, nh = 4, 1024, 4
    fl = engine.engine_memory(cfg, B, T, "bf16", "none", attention="flash")
    cb = engine.engine_memory(cfg, B, T, "bf16", "none", attention="cublas")
    assert engine.engine_memory(cfg, B, T, "bf16", "none") == fl  # the hip engine's default in half precision
    assert engine.engine_memory(cfg, B, T, "fp32", "none") == engine.engine_memory(cfg, B, T, "fp32", attention="cublas")
    assert cb["activations_per_block"] - fl["activations_per_block"] == B * nh * T * T * 2 - B * nh * T * 4
    fl2 = engine.engine_memory(cfg, B, 2 * T, "bf16", "none", attention="flash")
    cb2 = engine.engine_memory(cfg, B, 2 * T, "bf16", "none", attention="cublas")
    assert fl2["activations_per_block"] == 2 * fl["activations_per_block"]
    assert cb2["activations_per_block"] > 2.5 * cb["activations_per_block"]
    assert fl2["working_set"] < cb2["working_set"] / 3
    with pytest.raises(ValueError, match="attention must be"):
        engine.engine_memory(cfg, B, T, "bf16", attention="sdpa")


@pytest.mark.gpu
def test_gpu_fp16_overflow_skips_on_hip():
    x, y = batch(SMALL, 8, 64)
    eng = engine.build(SMALL, "hip", precision="fp16")
    eng.scaler.scale = 2.0 ** 127
    p0 = host(eng.params.flat).copy()
    out = eng.train_step(x, y, lr=1e-2, weight_decay=0.1, grad_clip=1.0)
    assert out["skipped"] and np.array_equal(host(eng.params.flat), p0) and eng.scaler.scale == 2.0 ** 126


# ---- memory ------------------------------------------------------------------------------------------------------
def test_engine_memory_orders_the_policies_and_counts_the_weights():
    from gpullm_lessons.model.params import num_params
    m = {p: engine.engine_memory(SMALL, 8, 64, "fp32", p) for p in engine.POLICIES}
    assert m["full"]["activations"] < m["selective"]["activations"] < m["none"]["activations"]
    P = num_params(SMALL)
    assert m["none"]["params"] + m["none"]["grads"] + m["none"]["adamw"] == 16 * P
    assert engine.engine_memory(SMALL, 8, 64, "bf16")["params_half"] == 2 * P
    with pytest.raises(ValueError, match="policy"):
        engine.engine_memory(SMALL, 8, 64, "fp32", "some")


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("policy", ["none", "selective", "full", "sqrt", "sqrt:3"])  # 4 layers: segments 2+2, 3+1
def test_gpu_engine_memory_within_10_percent_of_the_pool_peak(precision, policy):
    from gpullm_lessons.bench.train_step import measure_engine
    cfg = GPTConfig(vocab_size=256, block_size=256, n_layer=4, n_head=6, d_model=384)
    r = measure_engine(cfg, 32, 256, precision, policy, steps=2)
    predicted = engine.engine_memory(cfg, 32, 256, precision, policy)["total"]
    assert abs(predicted - r["peak_bytes"]) <= 0.10 * r["peak_bytes"], (predicted, r["peak_bytes"])


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["none", "selective", "full"])
def test_gpu_engine_memory_of_flash_attention_within_10_percent_of_the_pool_peak(policy):
    from gpullm_lessons.bench.train_step import measure_engine
    cfg = GPTConfig(vocab_size=256, block_size=256, n_layer=4, n_head=6, d_model=384)
    r = measure_engine(cfg, 32, 256, "bf16", policy, steps=2, versions={"attention": "flash"})
    predicted = engine.engine_memory(cfg, 32, 256, "bf16", policy, attention="flash")["total"]
    assert abs(predicted - r["peak_bytes"]) <= 0.10 * r["peak_bytes"], (predicted, r["peak_bytes"])


def test_profiler_times_every_kernel_of_a_step():
    x, y = batch(TOY, 2, 8)
    eng = engine.build(TOY, "numba")
    prof = eng.enable_profiling()
    prof.step(eng.train_step, x, y, lr=1e-3)
    rows = {r["op"]: r for r in prof.report()}
    for op in ("layernorm_forward", "layernorm_backward", "bias_gelu_forward", "gelu_backward", "adamw_step",
               "crossentropy_forward_backward", "attention_softmax_forward", "encoder_backward", "gemm fp32 (cuBLAS)",
               "split_heads", "merge_heads", "bias_add", "colsum_convert", "grad_sumsq"):
        assert rows[op]["calls"] >= 1 and rows[op]["ms"] > 0, op
    assert rows["layernorm_forward"]["calls"] == 2 * TOY.n_layer + 1
    assert abs(sum(r["share"] for r in rows.values()) - 1.0) < 1e-6


def test_numba_without_gpu_or_simulator_is_refused(monkeypatch):
    monkeypatch.setattr(device, "has_gpu", lambda: False)
    monkeypatch.setattr(device, "numba_available", lambda: False)
    monkeypatch.setattr(device, "kind", lambda: "cpu")
    with pytest.raises(engine.EngineError, match="backend 'numba' needs a GPU or the CUDA simulator"):
        engine.check_backend("numba")


# ---- CUDA graphs (train_step replayed as one graph) ----------------------------------------------------------------
def test_graphs_on_where_they_cannot_apply_is_refused():
    with pytest.raises(engine.EngineError, match="graphs='on'"):
        engine.build(TOY, "numpy", graphs="on")
    with pytest.raises(engine.EngineError, match="graphs must be"):
        engine.build(TOY, "numpy", graphs="maybe")
    assert not engine.build(TOY, "numba").graphs            # numba (simulator or GPU): always step by step


@pytest.mark.gpu
def test_gpu_graphs_on_refuses_a_step_it_cannot_capture():
    with pytest.raises(engine.EngineError, match="embedding backward v2 sorts tokens on the host"):
        engine.build(SMALL, "hip", graphs="on", versions={"encoder": "v2"})
    assert not engine.build(SMALL, "hip", versions={"encoder": "v2"}).graphs      # auto: step by step instead
    assert engine.build(SMALL, "hip").graphs


@pytest.mark.gpu
@pytest.mark.parametrize("precision,attention", [("fp32", "cublas"), ("bf16", "cublas"), ("bf16", "flash")])
def test_gpu_graph_steps_equal_eager_steps(precision, attention, gpu_batches):
    """The replayed graph = the eager step, bit for bit: losses, gradient norms and the final state (two batch shapes,
    so two captures; an eval in between sees the updated weights). Both run the same kernels (embedding backward v3,
    the hip default) and the same clip factor (GPUEngine._grad_scale computes it in float32 as the graph's AdamW
    does: in float64 it differed in the last bit, and Adam's first steps turned that into 2e-3 of the weights)."""
    eager = engine.build(SMALL, "hip", precision=precision, graphs="off", versions={"attention": attention})
    graph = engine.build(SMALL, "hip", precision=precision, graphs="on", versions={"attention": attention})
    assert graph.graphs and not eager.graphs
    batches = gpu_batches[:4] + [(x[:4, :32].copy(), y[:4, :32].copy()) for x, y in gpu_batches[4:7]]
    for i, (x, y) in enumerate(batches):
        a = eager.train_step(x, y, lr=3e-3, weight_decay=0.1, grad_clip=0.5)
        b = graph.train_step(x, y, lr=3e-3, weight_decay=0.1, grad_clip=0.5)
        assert a == b, (i, a, b)
        if i == 3:
            assert eager.eval_loss(x, y) == graph.eval_loss(x, y)
    assert len(graph._graphs) == 2 and graph.t == eager.t == len(batches)
    sa, sb = eager.state_dict(), graph.state_dict()
    for key in ("params", "m", "v"):
        assert np.array_equal(sa[key], sb[key]), key


@pytest.mark.gpu
def test_gpu_capturing_a_step_takes_no_second_copy_of_the_model_on_the_gpu():
    """StepGraph's warm-up must leave no trace, so it keeps the model and optimizer state to put back afterwards; kept
    on the GPU that copy doubled the default pool's peak while it captured. measure_engine's graph peak is now the
    state (model_bytes, the default pool) plus the graph's private pool, and the graph run trains as the eager one."""
    from gpullm_lessons.bench.train_step import measure_engine

    cfg = GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=4, d_model=256)
    r = measure_engine(cfg, 8, 128, "bf16", graphs="on", steps=2)
    assert r["cuda_graph"] and r["graph_pool_bytes"] > 0
    default_peak = r["peak_bytes"] - r["graph_pool_bytes"]
    assert r["model_bytes"] <= default_peak <= 1.05 * r["model_bytes"] + 2**20, (default_peak, r["model_bytes"])


@pytest.mark.parametrize("sumsq", [0.0, 1e-12, 0.0625, 0.2499, 0.25, 0.2501, 0.7, 3.7, 5.3, 17.1, 98.6, 1234.5])
@pytest.mark.parametrize("grad_clip", [0.0, 0.5, 1.0])
def test_eager_clip_factor_is_the_graph_kernels(sumsq, grad_clip):
    """GPUEngine._grad_scale (the step launched from Python) = the factor adamw_step_device computes from hyper and the
    squared norm (the CUDA-graph step), bit for bit, seen through m after one step from m = 0: m = (1 - beta1) g s.
    The NumPy engine's float64 factor is not always the same float32 (why the kernel engines do not use it)."""
    from gpullm_lessons.contracts.adamw import adamw_hyper
    from gpullm_lessons.kernels.numba import adamw as K

    eng = engine.build(TOY, "numba")
    g = np.array([1.0, -3.0, 0.5, 2.0], np.float32)
    ms = []
    for on_device in (False, True):
        p, gr, m, v = np.zeros(4, np.float32), g.copy(), np.zeros(4, np.float32), np.zeros(4, np.float32)
        if on_device:
            hyper = adamw_hyper(1e-3, 0.0, 1, 0.9, 0.95, clip=grad_clip)
            K.adamw_step_device(p, gr, m, v, hyper, np.array([sumsq], np.float32), 0.9, 0.95, 1e-8)
        else:
            K.adamw_step(p, gr, m, v, 1e-3, 0.9, 0.95, 1e-8, 0.0, 1, grad_scale=eng._grad_scale(sumsq, 1.0, grad_clip))
        ms.append(m)
    assert np.array_equal(ms[0], ms[1])


@pytest.mark.gpu
def test_gpu_sqrt_graph_steps_equal_none_graph_steps(gpu_batches):
    """The sqrt schedule inside a captured step (its segment recompute replayed from the graph) trains bit for bit
    as policy none does."""
    runs = []
    for policy in ("none", "sqrt:2"):
        eng = engine.build(SMALL, "hip", precision="bf16", policy=policy, graphs="on")
        runs.append([eng.train_step(x, y, lr=3e-3, weight_decay=0.1, grad_clip=1.0)["loss"] for x, y in gpu_batches[:3]])
        runs[-1].append(eng.state_dict()["params"])
    assert runs[0][:3] == runs[1][:3] and np.array_equal(runs[0][3], runs[1][3])


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["cublas", "flash"])
def test_gpu_graph_run_is_deterministic(attention, gpu_batches):
    runs = []
    for _ in range(2):
        eng = engine.build(SMALL, "hip", precision="bf16", graphs="on", versions={"attention": attention})
        runs.append([eng.train_step(x, y, lr=3e-3, weight_decay=0.1, grad_clip=1.0)["loss"] for x, y in gpu_batches[:5]])
        runs[-1].append(eng.state_dict()["params"])
    assert runs[0][:5] == runs[1][:5] and np.array_equal(runs[0][5], runs[1][5])


def test_gpu_time_groups_put_our_ops_and_pytorchs_kernels_side_by_side():
    """bench gputime's comparison with PyTorch: our op names and PyTorch's CUDA kernel names (as torch.profiler
    reports them) fall into the same groups; the table sums each side per group and says which side has none."""
    from gpullm_lessons.bench import train_step as bt

    cases = {
        "gemm": "matrix products",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": "matrix products",
        "nvjet_tst_256x128_64x4_2x1_v_bz_coopA_NNT": "matrix products",
        "flash_attention_forward": "attention",
        "attention_softmax_backward": "attention",  # ours: the scores path's softmax, not the loss head's
        "split_heads": "attention",
        "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<64>>": "attention",
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64_1x4x1_cga1x1x1_kernel0_0": "attention",
        "void cudnn::fusion::compute_dot_do_o_specialized<true, 64>(void const*, void const*, void*)": "attention",
        "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_bias_TNT": "matrix products",
        "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>": "matrix products",
        "void at::native::reduce_kernel<128, 4, at::native::ReduceOp<c10::BFloat16, at::native::func_wrapper_t<"
        "c10::BFloat16, at::native::sum_functor<c10::BFloat16, float>>>>": "gelu, bias, residual",
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>": "gelu, bias, residual",
        "void at::native::vectorized_elementwise_kernel<8, at::native::bfloat16_copy_kernel_cuda>": "other",
        "layernorm_backward": "layernorm",
        "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float>": "layernorm",
        "void at::native::(anonymous namespace)::GammaBetaBackwardCUDAKernel<float, float>": "layernorm",
        "crossentropy_forward_backward_half": "loss head",
        "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float>": "loss head",
        "void at::native::(anonymous namespace)::nll_loss_forward_reduce_cuda_kernel_2d<float, float, long>": "loss head",
        "adamw_step": "optimizer",
        "grad_sumsq": "optimizer",
        "void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor<float, 4>>": "optimizer",
        "bias_gelu_forward": "gelu, bias, residual",
        "colsum_convert": "gelu, bias, residual",
        "void at::native::vectorized_elementwise_kernel<4, GeluCUDAKernelImpl>": "gelu, bias, residual",
        "encoder_backward": "embedding",
        "void at::native::(anonymous namespace)::embedding_backward_feature_kernel<float, float, long>": "embedding",
        "void at::native::unrolled_elementwise_kernel<direct_copy_kernel_cuda>": "other",
        "nonfinite_count": "other",
    }
    for name, group in cases.items():
        assert bt.gpu_time_group(name) == group, name
    result = {"preset": "toy", "B": 1, "T": 1, "precision": "bf16", "backend": "hip", "card": "a card", "date": "d",
              "total_ms": 3.0, "rows": [{"op": "gemm", "ms": 2.0, "calls": 3, "us_per_call": 1.0, "shapes": "[]"},
                                        {"op": "adamw_step", "ms": 1.0, "calls": 1, "us_per_call": 1.0, "shapes": "[]"}]}
    assert bt.grouped_gpu_time(result) == [("matrix products", 2.0, None), ("optimizer", 1.0, None)]
    result["rows"] += [{"op": "gemm", "ms": 0.5, "calls": 1, "us_per_call": 1.0, "shapes": "[1]"},
                       {"op": "grad_sumsq", "ms": 1.5, "calls": 1, "us_per_call": 1.0, "shapes": "[]"}]
    assert list(bt.ops_in_group(result, "optimizer").items()) == [("grad_sumsq", 1.5), ("adamw_step", 1.0)]
    assert bt.ops_in_group(result, "matrix products") == {"gemm": 2.5} and bt.ops_in_group(result, "embedding") == {}
    del result["rows"][2:]
    result["torch"] = {"version": "x", "total_ms": 5.0, "kernels": {"sm90_xmma_gemm_a": 1.5, "sm90_xmma_gemm_b": 1.5,
                                                                    "direct_copy_kernel": 2.0}}
    assert bt.grouped_gpu_time(result) == [("matrix products", 2.0, 3.0), ("optimizer", 1.0, 0.0), ("other", 0.0, 2.0)]
    text = bt.format_gpu_time(result)
    assert "beside PyTorch x eager" in text and "matrix products" in text
    # two profiles of the step side by side: the totals, our attention op by op, each group in both
    new = dict(result, total_ms=2.5, rows=[{"op": "gemm", "ms": 1.5, "calls": 3, "us_per_call": 1.0, "shapes": "[]"},
                                           {"op": "flash_attention_forward_packed", "ms": 0.75, "calls": 1,
                                            "us_per_call": 1.0, "shapes": "[]"},
                                           {"op": "split_heads", "ms": 0.25, "calls": 1, "us_per_call": 1.0,
                                            "shapes": "[]"}])
    lines = bt.format_gpu_time_change(result, new, ("v4", "v5")).splitlines()
    assert lines[0].startswith("v4 (") and "our kernels 3.0 ms per step, PyTorch's 5.0; attention 0.00 ms" in lines[0]
    assert "attention 1.00 ms: flash_attention_forward_packed 0.75, split_heads 0.25" in lines[1]
    table = {ln.split("  ")[0]: ln.split()[-3:] for ln in lines[3:]}
    assert table["matrix products"] == ["2.00", "1.50", "3.00"] and table["attention"] == ["0.00", "1.00", "0.00"]
    assert table["optimizer"] == ["1.00", "0.00", "0.00"]  # only the old step had it


def test_gpu_time_profile_records_each_distinct_call_with_its_count():
    """bench gputime's bookkeeping, in the simulator with a stand-in timer (1 us per call; the third call 'cannot be
    captured'): every op of a step appears, counted per step, the total is the sum of the timed calls."""
    from gpullm_lessons.bench import train_step as bt
    seen = []

    def timer(fn):
        seen.append(1)
        if len(seen) == 3:
            raise RuntimeError("not capturable")
        return 1e-6
    r = bt.gpu_time_profile("toy", "fp32", backend="numba", cfg=TOY, B=2, T=8, timer=timer, warmup=False)
    calls = {}
    for row in r["rows"]:
        calls[row["op"]] = calls.get(row["op"], 0) + row["calls"]
    assert {"gemm", "layernorm_forward", "split_heads", "merge_heads", "colsum_convert", "adamw_step", "grad_sumsq",
            "encoder_backward", "attention_softmax_backward"} <= set(calls)
    assert calls["layernorm_forward"] == 2 * TOY.n_layer + 1
    assert calls["split_heads"] == 4 * TOY.n_layer                 # q, k, v in forward, dy in backward
    assert calls["gemm"] == TOY.n_layer * 18 + 3    # a block: 4 linears x 3 + attention 2 + 4; the head: 1 + 2
    untimed = [row for row in r["rows"] if row["ms"] is None]
    assert len(untimed) == 1
    timed_calls = sum(row["calls"] for row in r["rows"] if row["ms"] is not None)
    assert abs(r["total_ms"] - timed_calls * 1e-3) < 1e-9
    text = bt.format_gpu_time(r)
    assert "not capturable, not timed: " + untimed[0]["op"] in text


def test_gpu_time_profile_lists_the_epilogue_products():
    """bench gputime --epilogue cublaslt: the products with an epilogue are ops of the profile ("gemm+bias" twice a
    layer, "gemm+dgelu_bgrad" once with the half GELU input), in the matrix-product group, replayed by the timer;
    no bias_add runs; the loss head's chunks reach the engine and the result says so; the recorder is taken off."""
    from gpullm_lessons.bench import train_step as bt
    from gpullm_lessons.runtime import blaslt

    real, replayed = blaslt.matmul_epilogue, []

    def timer(fn):
        fn()
        replayed.append(1)
        return 1e-6

    v = {"epilogue": "cublaslt", "gelu_in": "half"}
    r = bt.gpu_time_profile("toy", "bf16", backend="numba", cfg=TOY, B=2, T=8, timer=timer, warmup=False,
                            versions=v, ce_chunks=2)
    calls = {}
    for row in r["rows"]:
        calls[row["op"]] = calls.get(row["op"], 0) + row["calls"]
    assert calls["gemm+bias"] == 3 * TOY.n_layer and calls["gemm+dgelu_bgrad"] == TOY.n_layer  # fc, the projections
    assert "bias_add" not in calls and "bias_gelu_forward" not in calls and calls["gelu_half"] == TOY.n_layer
    assert bt.gpu_time_group("gemm+dgelu_bgrad") == "matrix products"
    assert len(replayed) == len(r["rows"]) and r["ce_chunks"] == 2 and r["versions"]["epilogue"] == "cublaslt"
    assert blaslt.matmul_epilogue is real


def test_peak_tracker_names_the_phase_and_the_site(monkeypatch):
    """measure_engine's PeakTracker: a new peak records the innermost step phase (engine.profiler's ranges, through
    range_hook) and the course function that allocated; a smaller allocation later moves nothing."""
    from gpullm_lessons.bench.train_step import PeakTracker
    from gpullm_lessons.engine.profiler import nvtx_range, range_hook

    t = PeakTracker()
    with range_hook(t.phase):
        t.note(10, 10)
        assert t.at["phase"] == "outside the step" and t.at["site"] == "elsewhere"
        with nvtx_range("backward"):
            t.note(5, 5)
            assert t.high == 10 and t.at["bytes"] == 10
        eng = engine.build(TOY, "numba", precision="bf16")
        real = eng.K.crossentropy_forward_backward_half
        monkeypatch.setattr(eng.K, "crossentropy_forward_backward_half",
                            lambda *a, **k: (t.note(10**9, 7), real(*a, **k))[1])
        x, y = batch(TOY, 2, 8)
        eng.train_step(x, y, lr=1e-3, weight_decay=0.0, grad_clip=0.0)
    assert t.high == 10**9 and t.at["phase"] == "forward" and t.at["bytes"] == 7
    assert t.at["site"].startswith("_forward (gpu.py:"), t.at
    t.note(20, 1)
    assert t.high == 10**9 and t.at["bytes"] == 7
