"""AdamW's moments in bf16 (optimizer_state="bf16", --optimizer-state bf16; lesson 12).

m and v are stored as bfloat16 bits (uint16): each update reads them back to float32 (exact), updates them and takes
the step in float32, and writes them back rounded to nearest even. The reference is optim.adamw_update_bf16.

(a) the reference's rounding is ml_dtypes' (an independent implementation);
(b) the kernels (kernels/numba/adamw.py bf16_moments_v2 / bf16_moments_device_v2 in the simulator here; both
    backends on a GPU, marked gpu) against the reference, step by step from the kernel's own state, on fresh random
    inputs: params to 1e-6, m and v within one bf16 step of the reference's float32 moments and 99.9% of their
    bits identical; two planted wrong roundings (truncation, the float32's low half) fail that check;
(c) the engines: the NumPy and Numba (simulator) engines train with bf16 moments, tracking the fp32-moment run;
    the Numba engine's bf16 step matches the NumPy engine's; checkpoints store the uint16 bits and resume exactly
    (int8 too: int8 / uint8 and the block scales); the bytes; the combinations that cannot work are refused by name.
"""

import math

import ml_dtypes
import numpy as np
import pytest

from gpullm_lessons import device, engine, train
from gpullm_lessons.model import quant
from gpullm_lessons.runtime.arrays import to_backend, to_numpy
from gpullm_lessons.kernels.numba import adamw as nb
from gpullm_lessons.model.optim import adamw_update, adamw_update_bf16, decay_mask_for
from gpullm_lessons.model.params import GPTConfig, ParamBuffer, num_params
from gpullm_lessons.reference.rounding import bf16_bits_to_f32, f32_to_bf16_bits

TOY = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, d_model=16)  # ~4000 parameters
TINY = GPTConfig(vocab_size=17, block_size=8, n_layer=1, n_head=2, d_model=8)  # ~1100 parameters, 16 tensors
B1, B2, EPS, WD = 0.9, 0.95, 1e-8, 0.1
needs_numba_gpu = pytest.mark.skipif(
    not device.numba_on_gpu(), reason=f"needs Numba on an NVIDIA GPU (this machine: {device.kind()})"
)


@pytest.fixture
def small_grid(monkeypatch):
    """The simulator runs every thread in Python: 2 blocks (the grid-stride loop covers the rest)."""
    monkeypatch.setattr(nb, "MAX_BLOCKS", 2)
    monkeypatch.setattr(nb, "SIM_MAX_BLOCKS", 2)


# ---- (a) the reference ---------------------------------------------------------------------------------------------


def test_reference_rounds_the_float32_update_to_nearest_even_as_ml_dtypes():
    rng = np.random.default_rng(0)
    n = 5000
    p = rng.standard_normal(n).astype(np.float32)
    g = rng.standard_normal(n).astype(np.float32)
    m32 = (rng.standard_normal(n) * 1e-2).astype(np.float32)
    v32 = (rng.standard_normal(n) ** 2 * 1e-4).astype(np.float32)
    m_bits, v_bits = f32_to_bf16_bits(m32), f32_to_bf16_bits(v32)
    p_ref, m_ref, v_ref = p.copy(), bf16_bits_to_f32(m_bits), bf16_bits_to_f32(v_bits)
    adamw_update(p_ref, g, m_ref, v_ref, 3, 1e-3, (B1, B2), EPS, WD)  # the float32 update from the stored moments
    adamw_update_bf16(p, g, m_bits, v_bits, 3, 1e-3, (B1, B2), EPS, WD)
    assert np.array_equal(p, p_ref)  # the step uses the float32 moments, before rounding
    assert np.array_equal(m_bits, m_ref.astype(ml_dtypes.bfloat16).view(np.uint16))
    assert np.array_equal(v_bits, v_ref.astype(ml_dtypes.bfloat16).view(np.uint16))
    with pytest.raises(TypeError, match="m_bits must be a uint16 array of bfloat16 bits"):
        adamw_update_bf16(p, g, m32, v_bits, 4, 1e-3, (B1, B2), EPS, WD)


# ---- (b) the kernels against the reference ------------------------------------------------------------------------


def half_bf16_step(x):
    """Half the spacing of bfloat16 numbers at |x| (8 significant bits): the most round-to-nearest may move x."""
    _, e = np.frexp(np.abs(x).astype(np.float64))
    return np.where(x == 0, 0.0, np.ldexp(1.0, e - 9))


def bf16_moments_wrong(got_bits, ref32, name, terms=None):
    """None when got_bits (uint16) hold ref32 (the reference's float32 moments) rounded to nearest even, up to the
    float32 rounding of the kernel's own arithmetic; else what is wrong. Every element must lie within one bf16
    step of ref32, and at least 99.9% must be the same bits as the reference's rounding. A GPU's fused multiply-add
    changes the float32 moment by an ulp, which flips the rounding of the few values that lie at a half-step
    boundary by one whole step (seen on the H200: 3 or 4 of 2,000,003); truncation changes the bits of about half
    the elements; a wrong half of the float32 is far off. terms: the size of the update's two terms
    (beta |old| + (1 - beta) |new|): where they cancel, the float32 result carries their rounding, a few ulps of the
    terms, not of the result (seen on the H200: m ~ 4e-9 from terms ~1e-3, 12 bf16 steps apart), so that much more
    is allowed there."""
    got = bf16_bits_to_f32(np.asarray(got_bits)).astype(np.float64)
    ref = ref32.astype(np.float64)
    err = np.abs(got - ref)
    slack = 0.0 if terms is None else 4 * 2.0**-24 * np.abs(np.asarray(terms, np.float64))
    bad = err > 2 * half_bf16_step(ref) * (1 + 2.0**-10) + 1e-6 * np.abs(ref) + slack
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        return (
            f"{name}: {int(bad.sum())} of {ref.size} values further than one bf16 step from the reference; "
            f"first at {i}: got {got[i]!r}, reference {ref[i]!r}"
        )
    same = np.mean(np.asarray(got_bits) == f32_to_bf16_bits(ref32))
    if same < 0.999:
        return f"{name}: only {same:.2%} of the bits equal the reference's round-to-nearest-even"
    return None


def update_terms(m_bits, v_bits, g):
    """The size of the two terms of each moment's update (bf16_moments_wrong's terms), from the moments' bits before
    the step and the gradient the step uses."""
    m, v = bf16_bits_to_f32(m_bits).astype(np.float64), bf16_bits_to_f32(v_bits).astype(np.float64)
    return {"m": B1 * np.abs(m) + (1 - B1) * np.abs(g), "v": B2 * np.abs(v) + (1 - B2) * g * g}


def run_bf16_against_reference(step_fn, arrays, n, table, mask, steps, seed=0, grad_scale=0.25):
    """`steps` AdamW steps of step_fn(params, grads, m, v, lr, b1, b2, eps, wd, t, decay_bounds=, grad_scale=) with m
    and v uint16 on `arrays` arrays; before each, the reference (optim.adamw_update) runs from the kernel's own state
    read back to float32, so no difference can accumulate. Returns None when every step matches, else what is wrong."""
    rng = np.random.default_rng(seed)
    p = to_backend(rng.standard_normal(n, dtype=np.float32), arrays)
    m = to_backend(f32_to_bf16_bits((rng.standard_normal(n) * 1e-2).astype(np.float32)), arrays)
    v = to_backend(f32_to_bf16_bits((rng.standard_normal(n) ** 2 * 1e-4).astype(np.float32)), arrays)
    for t in range(1, steps + 1):
        lr = 1e-2 * (0.5 + 0.5 * math.cos(math.pi * t / steps))  # a new lr every step
        g = (rng.standard_normal(n, dtype=np.float32) * np.float32(2.0)).astype(np.float32)
        g[rng.random(n) < 0.01] = 0.0  # some exact zeros
        p_ref, m_ref, v_ref = to_numpy(p).copy(), bf16_bits_to_f32(to_numpy(m)), bf16_bits_to_f32(to_numpy(v))
        terms = update_terms(to_numpy(m), to_numpy(v), g.astype(np.float64) * grad_scale)
        adamw_update(p_ref, g * np.float32(grad_scale), m_ref, v_ref, t, lr, (B1, B2), EPS, WD, mask)
        gd = to_backend(g, arrays)
        step_fn(p, gd, m, v, lr, B1, B2, EPS, WD, t, decay_bounds=table, grad_scale=grad_scale)
        if np.any(to_numpy(gd) != 0):
            return f"step {t}: the gradient was not zeroed"
        pg = to_numpy(p)
        if not np.allclose(pg, p_ref, rtol=1e-6, atol=1e-6 * float(np.abs(p_ref).max())):
            return f"step {t}: params differ from the reference by up to {np.abs(pg - p_ref).max():.3g}"
        for name, got, ref in (("m", m, m_ref), ("v", v, v_ref)):
            why = bf16_moments_wrong(to_numpy(got), ref, f"step {t}: {name}", terms[name])
            if why:
                return why
    return None


def random_table(rng, n, k=16):
    """(bounds, flags, mask): k tensors of random lengths (some empty) over n elements, both kinds of decay."""
    cuts = np.sort(rng.integers(0, n + 1, k - 1))
    bounds = np.concatenate([[0], cuts, [n]]).astype(np.int64)
    flags = (np.arange(k) % 2 == 0).astype(np.uint8)
    rng.shuffle(flags)
    flags[0], flags[-1] = 1, 0
    return bounds, flags, np.repeat(flags.astype(bool), np.diff(bounds))


def numba_step(threads=64):
    return lambda *a, **k: nb.adamw_step(*a, **k, version="v2", threads=threads)


def test_numba_kernel_matches_the_reference_step_by_step(small_grid):
    table, mask = nb.decay_table(ParamBuffer(TINY), arrays="numba"), decay_mask_for(TINY)
    assert run_bf16_against_reference(numba_step(), "numba", mask.size, table, mask, steps=20) is None
    rng = np.random.default_rng(1)
    for n in (1, 37, 333):  # awkward sizes, a random decay table
        bounds, flags, mask = random_table(rng, n)
        assert run_bf16_against_reference(numba_step(32), "numba", n, (bounds, flags), mask, steps=4, seed=n) is None


def truncating(x):
    """A plausible wrong rounding: drop the low 16 bits (round toward zero)."""
    return np.uint16(np.float32(x).view(np.uint32) >> np.uint32(16))


def low_half(x):
    """A plausible wrong store: the float32's low 16 bits instead of its high ones."""
    return np.uint16(np.float32(x).view(np.uint32) & np.uint32(0xFFFF))


@pytest.mark.skipif(
    device.numba_on_gpu(),
    reason="patches the kernel's Python rounding helper, which only the CUDA simulator runs as Python",
)
@pytest.mark.parametrize("wrong, words", [(truncating, "bits equal the reference's"), (low_half, "further")])
def test_a_wrong_rounding_in_the_kernel_is_caught(small_grid, monkeypatch, wrong, words):
    """The kernel's rounding helper replaced (the simulator runs the kernel as Python, so the patch takes effect):
    the same check as above fails, naming the moment and the step."""
    table, mask = nb.decay_table(ParamBuffer(TINY), arrays="numpy"), decay_mask_for(TINY)
    monkeypatch.setattr(nb, "f32_to_bf16_bits", wrong)
    why = run_bf16_against_reference(numba_step(), "numpy", mask.size, table, mask, steps=2)
    assert why is not None and words in why and why.startswith("step 1: m")


def test_the_check_sees_truncation_on_its_own():
    """bf16_moments_wrong on bits rounded toward zero instead of to nearest: caught (no kernel involved)."""
    ref = np.random.default_rng(3).standard_normal(10_000).astype(np.float32)
    assert bf16_moments_wrong(f32_to_bf16_bits(ref), ref, "m") is None
    truncated = (ref.view(np.uint32) >> np.uint32(16)).astype(np.uint16)
    assert "bits equal the reference's round-to-nearest-even" in bf16_moments_wrong(truncated, ref, "m")


@pytest.mark.parametrize("clip, loss_scale", [(0.0, 1.0), (0.5, 1024.0)])
def test_device_step_equals_the_host_step(small_grid, clip, loss_scale):
    """adamw_step_device with bf16 moments (the CUDA-graph step's kernel, scalars in device memory) = adamw_step with
    the host's clip factor and 1 / loss scale: bit for bit without clipping, to float32 rounding with it."""
    rng = np.random.default_rng(7)
    n = 1000
    bounds, flags, _ = random_table(rng, n)
    p = rng.standard_normal(n).astype(np.float32)
    g = (rng.standard_normal(n) * loss_scale).astype(np.float32)
    m = f32_to_bf16_bits((rng.standard_normal(n) * 1e-2).astype(np.float32))
    v = f32_to_bf16_bits((rng.standard_normal(n) ** 2 * 1e-4).astype(np.float32))
    dev, ref = ([to_backend(a.copy(), "numba") for a in (p, g, m, v)] for _ in range(2))
    sumsq = to_backend(np.zeros(1, np.float32), "numba")
    nb.grad_sumsq(dev[1], sumsq)
    norm = math.sqrt(float(to_numpy(sumsq)[0])) / loss_scale
    coef = min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0
    hyper = to_backend(nb.adamw_hyper(3e-3, WD, 5, B1, B2, clip=clip, loss_scale=loss_scale), "numba")
    nb.adamw_step_device(*dev, hyper, sumsq, B1, B2, EPS, decay_bounds=(bounds, flags))
    nb.adamw_step(*ref, 3e-3, B1, B2, EPS, WD, 5, decay_bounds=(bounds, flags),
                  grad_scale=float(np.float32(coef) / np.float32(loss_scale)))  # fmt: skip
    got, want = [to_numpy(a) for a in dev], [to_numpy(a) for a in ref]
    assert (clip > 0) == (coef < 1.0)  # the clipping case really clips
    if coef == 1.0:
        assert all(np.array_equal(a, b) for a, b in zip(got, want))
    else:
        assert np.allclose(got[0], want[0], rtol=1e-6, atol=1e-7)
        terms = update_terms(m, v, g.astype(np.float64) * coef)
        for name, k in (("m", 2), ("v", 3)):
            assert bf16_moments_wrong(got[k], bf16_bits_to_f32(want[k]), name, terms[name]) is None


def test_bf16_moments_and_a_half_copy_in_one_pass(small_grid):
    """half_out (the bf16 copy of the weights of a bf16 run) is written by the same pass, bit-exact (ml_dtypes)."""
    rng = np.random.default_rng(4)
    n = 300
    p, g = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    m, v, half = np.zeros(n, np.uint16), np.zeros(n, np.uint16), np.full(n, 0xAAAA, np.uint16)
    nb.adamw_step(p, g, m, v, 1e-2, B1, B2, EPS, WD, 1, half_out=half, half_dtype="bfloat16", threads=64)
    assert np.array_equal(half, p.astype(ml_dtypes.bfloat16).view(np.uint16))
    assert np.all(m != 0) and np.all(v != 0)


def test_launcher_errors_name_the_problem():
    n = 10
    p, g = np.zeros(n, np.float32), np.zeros(n, np.float32)
    m16, v16 = np.zeros(n, np.uint16), np.zeros(n, np.uint16)
    args = (1e-3, B1, B2, EPS, WD, 1)
    with pytest.raises(ValueError, match="bf16 moments .* version='v2' \\(got version='v1'\\)"):
        nb.adamw_step(p, g, m16, v16, *args, version="v1")
    with pytest.raises(TypeError, match="v has dtype float32, expected uint16"):
        nb.adamw_step(p, g, m16, np.zeros(n, np.float32), *args)
    with pytest.raises(TypeError, match=r"m has dtype float16, expected float32 \(fp32 moments\) or uint16"):
        nb.adamw_step(p, g, np.zeros(n, np.float16), v16, *args)
    with pytest.raises(ValueError, match=r"m has shape \(9,\), expected \(10,\)"):
        nb.adamw_step(p, g, np.zeros(9, np.uint16), v16, *args)


# ---- (b) on a GPU: both backends, large and awkward sizes -----------------------------------------------------------


def _gpu_launcher(backend, threads=256):
    if backend == "numba":
        return numba_step(threads), "numba"
    pytest.importorskip("cupy")
    from gpullm_lessons.backends.hip import adamw as hip_adamw

    return (lambda *a, **k: hip_adamw.adamw_step(*a, **k, version="v2", threads=threads)), "cupy"


GPU_BACKENDS = [pytest.param("numba", marks=needs_numba_gpu), "hip"]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("n, threads", [(1, 256), (255, 64), (2_000_003, 256), (4096 * 256 * 3 + 7, 1024)])
def test_gpu_kernels_match_the_reference(backend, n, threads):
    fn, arrays = _gpu_launcher(backend, threads)
    bounds, flags, mask = random_table(np.random.default_rng(n), n)
    table = (to_backend(bounds, arrays), to_backend(flags, arrays))
    assert run_bf16_against_reference(fn, arrays, n, table, mask, steps=10) is None


@pytest.mark.gpu
def test_gpu_hip_device_step_equals_the_host_step():
    """HIP: adamw_bf16_moments_device_v2 = adamw_bf16_moments_v2 with the host's clip factor; a half copy beside."""
    import cupy as cp

    from gpullm_lessons.backends.hip import adamw as hip

    rng = np.random.default_rng(11)
    n = 2_000_003  # not a multiple of 4: the bf16-moment kernels load one element at a time
    bounds, flags, _ = random_table(rng, n)
    table = (cp.asarray(bounds), cp.asarray(flags))
    p = rng.standard_normal(n).astype(np.float32)
    g = rng.standard_normal(n).astype(np.float32)
    m = f32_to_bf16_bits((rng.standard_normal(n) * 1e-2).astype(np.float32))
    v = f32_to_bf16_bits((rng.standard_normal(n) ** 2 * 1e-4).astype(np.float32))
    for clip in (0.0, 1.0):
        dev, ref = ([cp.asarray(a.copy()) for a in (p, g, m, v)] for _ in range(2))
        sumsq, half = cp.zeros(1, cp.float32), cp.zeros(n, cp.uint16)
        hip.grad_sumsq(dev[1], sumsq)
        norm = math.sqrt(float(sumsq[0]))
        coef = min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0
        hyper = cp.asarray(nb.adamw_hyper(1e-3, WD, 3, B1, B2, clip=clip))
        hip.adamw_step_device(*dev, hyper, sumsq, B1, B2, EPS, decay_bounds=table, half_out=half, half_dtype="bfloat16")
        hip.adamw_step(*ref, 1e-3, B1, B2, EPS, WD, 3, decay_bounds=table, grad_scale=coef, version="v2")
        got, want = [cp.asnumpy(a) for a in dev], [cp.asnumpy(a) for a in ref]
        assert np.allclose(got[0], want[0], rtol=1e-6, atol=1e-7)
        terms = update_terms(m, v, g.astype(np.float64) * coef)
        for name, k in (("m", 2), ("v", 3)):
            assert bf16_moments_wrong(got[k], bf16_bits_to_f32(want[k]), name, terms[name]) is None
        assert np.array_equal(cp.asnumpy(half), got[0].astype(ml_dtypes.bfloat16).view(np.uint16))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["hip", pytest.param("numba", marks=needs_numba_gpu)])
def test_gpu_engine_bf16_state_tracks_fp32_and_its_graph_replays_the_eager_step(backend):
    """The kernel engines with bf16 moments (bf16 matrix products in both runs): the losses of 10 steps within 2e-3 of
    the fp32-moment run's (test_numpy_engine_bf16_state_tracks_fp32's reasoning, with room for a larger model and the
    half-precision products' own noise); on HIP the CUDA-graph step (adamw_bf16_moments_device_v2) gives the
    eager step's losses and moments."""
    cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, d_model=128)
    batches = _learnable_batches(cfg, 10, B=4)
    runs = {}
    for state, graphs in (("fp32", "off"), ("bf16", "off"), ("bf16", "auto")):
        eng = engine.build(cfg, backend, "bf16", optimizer_state=state, graphs=graphs)
        losses = [eng.train_step(x, y, lr=3e-3, weight_decay=WD, grad_clip=1.0)["loss"] for x, y in batches]
        runs[state, graphs] = (np.array(losses), to_numpy(eng.m), eng.graphs)
    a, b = runs["fp32", "off"][0], runs["bf16", "off"][0]
    assert np.all(np.abs(a - b) <= 2e-3 * a)
    assert runs["bf16", "off"][1].dtype == np.uint16
    if backend == "hip":
        assert runs["bf16", "auto"][2]  # the graph step ran
        # within test_engine's graph-vs-eager tolerance for bf16: the graph's update takes its scalars from GPU memory
        # (seen on the H200: 1.7e-4 relative after 5 steps)
        assert np.allclose(runs["bf16", "auto"][0], b, rtol=1e-3)
        # (no bitwise comparison of the moments: after 10 steps the two runs' parameters differ by that much, and
        # 71% of the moments' bits differed on the H200)


# ---- (c) the engines ------------------------------------------------------------------------------------------------


def _learnable_batches(cfg, k, B=4, seed=7):
    rng = np.random.default_rng(seed)
    xs = [rng.integers(0, cfg.vocab_size, (B, cfg.block_size)).astype(np.int32) for _ in range(k)]
    return [(x, (x + 1) % cfg.vocab_size) for x in xs]  # a rule the model can learn: the next id


def test_numpy_engine_bf16_state_tracks_fp32():
    """12 steps of the NumPy engine with fp32 and with bf16 moments from one init on the same batches: every loss
    within 5e-4 (relative) of the fp32 run's. Why that bound: each rounding moves a moment by at most 2^-8 of itself
    (half a bf16 step), so a step m / sqrt(v) changes by at most ~1.5 * 2^-8 relative, a parameter by ~6e-5 per step
    at lr 1e-2, in directions that mostly cancel;
    measured on this run the losses differ by at most 7.5e-5 relative (int8's block-wise moments: 7e-4), so 5e-4
    leaves a margin of ~7 while a run whose moments are lost (zeroed after every step) is 0.11 off (checked below).
    The runs must not be identical: the rounding happens."""
    batches = _learnable_batches(TOY, 12)
    runs = {}
    for state in ("fp32", "bf16"):
        eng = engine.build(TOY, "numpy", optimizer_state=state)
        runs[state] = [eng.train_step(x, y, lr=1e-2, weight_decay=WD, grad_clip=1.0)["loss"] for x, y in batches]
        runs[state + " params"] = eng.params.flat.copy()
        if state == "bf16":
            n = num_params(TOY)
            assert eng.m.dtype == np.uint16 and eng.optimizer_bytes() == 4 * n
    a, b = np.array(runs["fp32"]), np.array(runs["bf16"])
    assert np.all(np.abs(a - b) <= 5e-4 * a), np.abs(a - b) / a
    assert b[-1] < b[0] - 0.3  # it learns
    assert not np.array_equal(runs["fp32 params"], runs["bf16 params"])
    # the bound can fail: moments forgotten after every step (AdamW becomes sign descent) leave it far behind
    lost = engine.build(TOY, "numpy", optimizer_state="bf16")
    c = []
    for x, y in batches:
        c.append(lost.train_step(x, y, lr=1e-2, weight_decay=WD, grad_clip=1.0)["loss"])
        lost.m[...] = 0
        lost.v[...] = 0
    assert np.max(np.abs(a - np.array(c)) / a) > 1e-2


def test_numba_engine_bf16_state_matches_the_numpy_engine():
    """The Numba engine (simulator) with bf16 moments against the NumPy engine with bf16 moments: 2 steps, losses
    and gradient norms to 1e-4 (the gradients differ by float32 rounding, as test_engine's fp32 comparison), params
    normwise to 1e-5, m and v normwise to 1e-3 and at least 98% of their bits equal (a gradient that differs by
    rounding may round a moment the other way, and a few gradients are pure rounding noise: the key bias's)."""
    rng = np.random.default_rng(5)
    x = rng.integers(0, TOY.vocab_size, (2, 8)).astype(np.int32)
    y = np.roll(x, -1, axis=1)
    ref, eng = engine.build(TOY, "numpy", optimizer_state="bf16"), engine.build(TOY, "numba", optimizer_state="bf16")
    assert eng.ver["adamw"] == "v2" and eng.m.dtype == np.uint16
    for step in range(2):
        a = ref.train_step(x, y, lr=1e-2, weight_decay=WD, grad_clip=1.0)
        b = eng.train_step(x, y, lr=1e-2, weight_decay=WD, grad_clip=1.0)
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * a["loss"], step
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * a["grad_norm"], step
    p = to_numpy(eng.params.flat)
    assert np.linalg.norm(p - ref.params.flat) <= 1e-5 * np.linalg.norm(ref.params.flat)
    for k in ("m", "v"):
        got, want = to_numpy(getattr(eng, k)), getattr(ref, k)
        assert np.mean(got == want) >= 0.98, k
        gf, wf = bf16_bits_to_f32(got), bf16_bits_to_f32(want)
        assert np.linalg.norm(gf - wf) <= 1e-3 * np.linalg.norm(wf), k
    # and a resume of the Numba engine continues it bit for bit
    other = engine.build(TOY, "numba", optimizer_state="bf16", seed=9)
    other.load_state_dict(eng.state_dict())
    la = eng.train_step(x, y, lr=1e-2, weight_decay=WD, grad_clip=1.0)["loss"]
    lb = other.train_step(x, y, lr=1e-2, weight_decay=WD, grad_clip=1.0)["loss"]
    assert la == lb
    assert all(np.array_equal(to_numpy(getattr(eng, k)), to_numpy(getattr(other, k))) for k in ("m", "v"))


@pytest.mark.parametrize("state", ["bf16", "int8"])
def test_a_checkpoint_stores_the_moments_as_kept_and_resumes_exactly(tmp_path, state):
    """state_dict -> save_checkpoint (npz) -> load_checkpoint -> load_state_dict: the moments in their own dtypes,
    and the next step of the resumed engine equals the original's, bit for bit."""
    batches = _learnable_batches(TOY, 3)
    a = engine.build(TOY, "numpy", optimizer_state=state)
    for x, y in batches[:2]:
        a.train_step(x, y, lr=1e-2, weight_decay=WD, grad_clip=1.0)
    train.save_checkpoint(tmp_path / "ckpt.npz", a, {"model": {}}, {"step": 2})
    st = train.load_checkpoint(tmp_path / "ckpt.npz")["engine"]
    assert st["optimizer_state"] == state
    assert (st["m"].dtype, st["v"].dtype) == {"bf16": (np.uint16, np.uint16), "int8": (np.int8, np.uint8)}[state]
    b = engine.build(TOY, "numpy", optimizer_state=state, seed=4)  # another init: everything comes from the file
    b.load_state_dict(st)
    x, y = batches[2]
    la = a.train_step(x, y, lr=1e-2, weight_decay=WD, grad_clip=1.0)["loss"]
    lb = b.train_step(x, y, lr=1e-2, weight_decay=WD, grad_clip=1.0)["loss"]
    assert la == lb and np.array_equal(a.params.flat, b.params.flat)
    sa, sb = a.state_dict(), b.state_dict()
    assert all(np.array_equal(sa[k], sb[k]) for k in sa if isinstance(sa[k], np.ndarray))


def test_moments_convert_between_formats_on_load():
    """A state of another optimizer_state is read through fp32: bf16 bits widen exactly into an fp32 engine, fp32
    moments round to nearest even into a bf16 engine; a checkpoint without the key holds fp32."""
    eng = engine.build(TOY, "numpy", optimizer_state="bf16")
    for x, y in _learnable_batches(TOY, 2):
        eng.train_step(x, y, lr=1e-2, weight_decay=WD, grad_clip=1.0)
    st = eng.state_dict()
    f32 = engine.build(TOY, "numpy")
    f32.load_state_dict(st)
    assert np.array_equal(f32.m, bf16_bits_to_f32(st["m"])) and np.array_equal(f32.v, bf16_bits_to_f32(st["v"]))
    old = {k: val for k, val in f32.state_dict().items() if k != "optimizer_state"}  # as written before bf16 existed
    back = engine.build(TOY, "numpy", optimizer_state="bf16")
    back.load_state_dict(old)
    assert np.array_equal(back.m, st["m"]) and np.array_equal(back.v, st["v"])


def test_a_state_of_the_wrong_dtype_is_named():
    eng = engine.build(TOY, "numpy", optimizer_state="bf16")
    st = eng.state_dict()
    st["m"] = st["m"].astype(np.float32)
    with pytest.raises(ValueError, match="m has dtype float32; an optimizer_state 'bf16' state stores it as uint16"):
        eng.load_state_dict(st)
    with pytest.raises(ValueError, match="optimizer_state 'fp8' is not one of fp32, bf16, int8"):
        eng.load_state_dict({**eng.state_dict(), "optimizer_state": "fp8"})
    st = engine.build(TOY, "numpy", optimizer_state="int8").state_dict()
    del st["v_scale"]
    with pytest.raises(ValueError, match="the state has no 'v_scale'"):
        eng.load_state_dict(st)


def test_the_bytes_of_each_optimizer_state():
    cfg, B, T = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, d_model=128), 4, 64
    n = num_params(cfg)
    mem = {s: engine.engine_memory(cfg, B, T, "bf16", optimizer_state=s) for s in engine.OPTIMIZER_STATES}
    assert (mem["fp32"]["adamw"], mem["bf16"]["adamw"]) == (8 * n, 4 * n)
    assert mem["int8"]["adamw"] == quant.moment_bytes(n)
    assert mem["fp32"]["total"] - mem["bf16"]["total"] == 4 * n  # nothing else changes
    for s in engine.OPTIMIZER_STATES:
        assert engine.build(TOY, "numpy", optimizer_state=s).optimizer_bytes() == engine.core.optimizer_state_bytes(
            num_params(TOY), s
        )
    assert engine.build(TOY, "numba", optimizer_state="bf16").optimizer_bytes() == 4 * num_params(TOY)


def test_combinations_that_cannot_work_are_named(tmp_path):
    from gpullm_lessons.parallel.comm import SingleComm
    from gpullm_lessons.parallel import DataParallel

    from test_train_ranks import TINY as JOB

    with pytest.raises(ValueError, match="ZeRO shards fp32 moments; this engine keeps them as bf16"):
        DataParallel(engine.build(TOY, "numpy", optimizer_state="bf16"), SingleComm(), zero=1)
    dp = DataParallel(engine.build(TOY, "numpy", optimizer_state="bf16"), SingleComm())
    assert dp.memory()["optimizer"] == dp.memory()["optimizer_full"] == 4 * num_params(TOY)
    with pytest.raises(train.ConfigError, match="--zero with --optimizer-state bf16: ZeRO shards fp32 moments"):
        train.main(JOB + ["--steps", "1", "--optimizer-state", "bf16", "--zero", "--out", str(tmp_path / "z")])
    summary = train.main(JOB + ["--steps", "2", "--optimizer-state", "bf16", "--out", str(tmp_path / "b")])
    assert summary is not None
    st = train.load_checkpoint(tmp_path / "b" / "ckpt.npz")["engine"]
    assert st["optimizer_state"] == "bf16" and st["m"].dtype == np.uint16
