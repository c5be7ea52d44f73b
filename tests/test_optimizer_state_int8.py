"""AdamW's moments block-wise in 8 bits on the kernel backends (optimizer_state="int8", --optimizer-state int8).

The format is gpullm_lessons.model.quant's: m as int8 codes round(m / a * 127) with a the block's max |m|, v as uint8 codes
of sqrt(v) scaled by the block's max sqrt(v), one float32 scale per block of 256 values and moment. Each step the
kernel (kernels/numba/adamw.py int8_moments_v2 / int8_moments_device_v2, kernels/hip/adamw.cu twins) reads a block
back with its old scales, updates p, m, v in float32 and quantises the new moments with the block's new absmax. The
reference is the NumPy engine's step: quant.dequantize_moments -> optim.adamw_update -> quant.quantize_moments.

(a) one format: the kernels' block size is quant.BLOCK;
(b) the Numba kernel in the simulator against the reference, step by step from the kernel's own state, on fresh
    random inputs: sizes that are not a multiple of the block, more blocks than the (capped) grid, several steps,
    decay-table boundaries inside a block, grad_scale, the half copy, an all-zero block, parameters with no
    gradient whose sqrt(v) code is 0; in the simulator the kernel's float32 arithmetic is NumPy's, so everything is
    bit for bit. The checks allowed on a GPU (int8_moments_wrong) fail on plausible wrong kernels (the scale from
    the old absmax, truncation instead of rounding, v quantised without the square root, the last partial block
    skipped, a code 0 read as 0), each planted in the kernel's source;
(c) the engines: GPUEngine(numba) with int8 moments against the NumPy engine with int8 moments; its update from its
    own gradient is the reference's; checkpoints hold the codes and scales and resume exactly; the CLI flag;
(d) on a GPU (marked gpu): both backends against the same reference, at large and awkward sizes, the device step, the
    engines and the CUDA-graph step.
"""

import inspect
import math
import re
import textwrap

import ml_dtypes
import numpy as np
import pytest

from gpullm_lessons import device, engine, train
from gpullm_lessons.runtime import hip
from gpullm_lessons.model import quant
from gpullm_lessons.runtime.arrays import to_backend, to_numpy
from gpullm_lessons.contracts import adamw as contract
from gpullm_lessons.kernels.numba import adamw as nb
from gpullm_lessons.model.optim import adamw_update, decay_mask_for
from gpullm_lessons.model.params import GPTConfig, ParamBuffer, num_params

from test_optimizer_state_bf16 import (
    B1,
    B2,
    EPS,
    GPU_BACKENDS,
    TINY,
    TOY,
    WD,
    _gpu_launcher,
    _learnable_batches,
    needs_numba_gpu,
    numba_step,
    random_table,
)

BLOCK = quant.BLOCK
SCALE_RTOL = 1e-5  # int8_moments_wrong's bound on a block scale (its docstring says why)
# in the CUDA simulator the kernel's float32 arithmetic is NumPy's: bit for bit; Numba on a GPU (make gpu-test runs
# these tests there too) fuses multiply-adds: held to the GPU checks
EXACT = not device.numba_on_gpu()
sim_only = pytest.mark.skipif(
    device.numba_on_gpu(),
    reason="plants mistakes in the kernel's Python source, which only the CUDA simulator runs as Python",
)


@pytest.fixture
def small_grid(monkeypatch):
    """The simulator runs every thread in Python: a grid of 2 blocks (the grid-stride loop covers the rest)."""
    monkeypatch.setattr(nb, "MAX_BLOCKS", 2)
    monkeypatch.setattr(nb, "SIM_MAX_BLOCKS", 2)


# ---- (a) one format -------------------------------------------------------------------------------------------------


def test_the_kernels_quantise_in_blocks_of_quant_block():
    assert contract.INT8_BLOCK == nb.Q8 == quant.BLOCK
    src = (hip.kernel_dir() / "adamw.cu").read_text()
    assert int(re.search(r"#define ADAMW_Q8_BLOCK (\d+)", src).group(1)) == quant.BLOCK
    assert contract.int8_blocks(0) == 0 and contract.int8_blocks(BLOCK) == 1 and contract.int8_blocks(BLOCK + 1) == 2


# ---- (b) the kernels against the reference ------------------------------------------------------------------------


def int8_moments_wrong(got, ref, where):
    """None when the int8 state `got` ({"m", "m_scale", "v", "v_scale"}, host arrays) is the reference's `ref`
    (quant.quantize_moments of the reference's float32 moments), up to what a GPU's float32 arithmetic may change;
    else what is wrong. Scales within SCALE_RTOL of the reference's, every code within one level of the reference's
    and at least 99.9% of the codes equal. Why: a fused multiply-add moves an updated moment by an ulp or a few ulps of
    its two terms (test_optimizer_state_bf16's update_terms); a block's scale is its largest value, so it moves by
    ~1e-7 relative, and a code moves only where m / a * 127 lies at a half-level boundary: one level, at a few
    elements in 10^5. The scale of the old absmax is off by whole factors; truncation moves about half the codes;
    codes of v instead of sqrt(v) are far off."""
    for name in ("m_scale", "v_scale"):
        g, r = np.asarray(got[name], np.float64), np.asarray(ref[name], np.float64)
        if g.shape != r.shape:
            return f"{where}: {name} has shape {g.shape}, the reference {r.shape}"
        bad = np.abs(g - r) > SCALE_RTOL * np.abs(r)
        if bad.any():
            b = int(np.flatnonzero(bad)[0])
            return (
                f"{where}: {name}: {int(bad.sum())} of {r.size} block scales differ from the reference's absmax "
                f"(rtol {SCALE_RTOL}); first block {b}: got {g[b]!r}, reference {r[b]!r}"
            )
    for name in ("m", "v"):
        g, r = np.asarray(got[name]).astype(np.int64), np.asarray(ref[name]).astype(np.int64)
        off = np.abs(g - r)
        if (off > 1).any():
            i = int(np.flatnonzero(off > 1)[0])
            return (
                f"{where}: {name}: {int((off > 1).sum())} of {r.size} codes more than one level from the reference; "
                f"first at {i} (block {i // BLOCK}): got {g[i]}, reference {r[i]}"
            )
        same = float(np.mean(off == 0)) if r.size else 1.0
        if same < 0.999:
            return (
                f"{where}: {name}: only {same:.2%} of the codes equal the reference's (round to nearest, ties to even)"
            )
    return None


def run_int8_against_reference(step_fn, arrays, n, table, mask, steps, seed=0, grad_scale=0.25, half=None, exact=False):
    """`steps` AdamW steps of step_fn(params, grads, m, v, lr, b1, b2, eps, wd, t, decay_bounds=, grad_scale=,
    m_scale=, v_scale=, half_out=, half_dtype=) with int8 moments on `arrays` arrays; before each, the reference (the
    NumPy engine's int8 step) runs from the kernel's own state, so no difference can accumulate. Returns None when
    every step matches, else what is wrong. exact: params, codes and scales bit for bit (the simulator); else
    params to 1e-6 and the moments within int8_moments_wrong.

    Planted: parameters that get no gradient at step 1 and whose sqrt(v) has code 0 (every 50th: the half level
    keeps their step finite), and for n >= 4 blocks an all-zero block (block 1: moments and gradients zero, its scales
    stay 0)."""
    rng = np.random.default_rng(seed)
    p = rng.standard_normal(n, dtype=np.float32)
    m0 = (rng.standard_normal(n) * 1e-2).astype(np.float32)
    v0 = (rng.standard_normal(n) ** 2 * 1e-4).astype(np.float32)
    quiet = np.zeros(n, bool)
    quiet[3::50] = True
    v0[quiet] = 0.0
    zero = slice(BLOCK, 2 * BLOCK) if n >= 4 * BLOCK else slice(0, 0)
    m0[zero], v0[zero] = 0.0, 0.0
    state = {k: to_backend(a, arrays) for k, a in quant.quantize_moments(m0, v0).items()}
    p = to_backend(p, arrays)
    half_out = to_backend(np.full(n, 0xAAAA, np.uint16), arrays) if half else None
    for t in range(1, steps + 1):
        lr = 1e-2 * (0.5 + 0.5 * math.cos(math.pi * t / steps))  # a new lr every step
        g = (rng.standard_normal(n, dtype=np.float32) * np.float32(2.0)).astype(np.float32)
        g[rng.random(n) < 0.01] = 0.0  # some exact zeros
        g[zero] = 0.0
        if t == 1:
            g[quiet] = 0.0
        own = {k: to_numpy(a).copy() for k, a in state.items()}  # the kernel's state before the step
        p_ref = to_numpy(p).copy()
        m_ref, v_ref = quant.dequantize_moments(own)
        adamw_update(p_ref, g * np.float32(grad_scale), m_ref, v_ref, t, lr, (B1, B2), EPS, WD, mask)
        ref = quant.quantize_moments(m_ref, v_ref)
        gd = to_backend(g, arrays)
        step_fn(p, gd, state["m"], state["v"], lr, B1, B2, EPS, WD, t, decay_bounds=table, grad_scale=grad_scale,
                m_scale=state["m_scale"], v_scale=state["v_scale"], half_out=half_out, half_dtype=half)  # fmt: skip
        if np.any(to_numpy(gd) != 0):
            return f"step {t}: the gradient was not zeroed"
        pg = to_numpy(p)
        if exact and not np.array_equal(pg, p_ref):
            i = int(np.flatnonzero(pg != p_ref)[0])
            return f"step {t}: params differ from the reference at {np.sum(pg != p_ref)} elements; first {i}"
        if not np.allclose(pg, p_ref, rtol=1e-6, atol=1e-6 * float(np.abs(p_ref).max())):
            return f"step {t}: params differ from the reference by up to {np.abs(pg - p_ref).max():.3g}"
        if half:
            want = pg.astype(ml_dtypes.bfloat16 if half == "bfloat16" else np.float16).view(np.uint16)
            if not np.array_equal(to_numpy(half_out), want):
                return f"step {t}: the {half} copy is not the updated params rounded to nearest even"
        got = {k: to_numpy(a) for k, a in state.items()}
        if exact:
            for k in ref:
                if not np.array_equal(got[k], ref[k]):
                    return f"step {t}: {k}: {np.sum(got[k] != ref[k])} of {ref[k].size} differ (exact run)"
        why = int8_moments_wrong(got, ref, f"step {t}")
        if why:
            return why
        if zero.stop and (got["m_scale"][1] != 0 or got["v_scale"][1] != 0):
            return f"step {t}: the all-zero block 1 got scales {got['m_scale'][1]}, {got['v_scale'][1]}"
    return None


def table_inside_blocks(n, seed):
    """random_table's (bounds, flags, mask) over n, with at least one tensor boundary strictly inside a block."""
    bounds, flags, mask = random_table(np.random.default_rng(seed), n)
    inner = bounds[1:-1]
    assert n < BLOCK or np.any((inner % BLOCK != 0) & (inner > 0) & (inner < n)), "no boundary inside a block"
    return bounds, flags, mask


def test_numba_kernel_matches_the_reference(small_grid):
    """The model's own decay table (16 tensors) over 5 blocks of 256 (~1100 parameters: the last block partial), 3
    steps (bit for bit in the simulator: EXACT); then awkward sizes with random tables: 1 value, one block less one,
    one block plus one, 6 blocks (3 per thread block of the grid of 2), and a bf16 and an fp16 half copy; threads 64
    and 128."""
    table, mask = nb.decay_table(ParamBuffer(TINY), arrays="numba"), decay_mask_for(TINY)
    assert mask.size % BLOCK and mask.size > 4 * BLOCK
    assert run_int8_against_reference(numba_step(), "numba", mask.size, table, mask, steps=3, exact=EXACT) is None
    for n, threads, half in ((1, 64, None), (BLOCK - 1, 128, "bfloat16"), (BLOCK + 1, 64, None),
                             (6 * BLOCK - 5, 64, "float16")):  # fmt: skip
        bounds, flags, mask = table_inside_blocks(n, n)
        why = run_int8_against_reference(numba_step(threads), "numba", n, (bounds, flags), mask, steps=2, seed=n,
                                          half=half, exact=EXACT)  # fmt: skip
        assert why is None, (n, why)


def test_no_grad_scale_and_no_weight_decay_table(small_grid):
    """grad_scale 1 and decay_bounds None (decay everything): the same reference."""
    n = 3 * BLOCK + 17
    assert (
        run_int8_against_reference(numba_step(), "numpy", n, None, None, steps=2, grad_scale=1.0, exact=EXACT) is None
    )


# plausible wrong kernels, planted in the source of the kernel's loop (the simulator runs it as Python)
MUTANTS = {
    "scale from the old absmax": ("        a_m = red_m[0]\n", "        a_m = m_scale[b]\n", "m_scale"),
    "truncation instead of rounding": ("libdevice.rintf(", "_trunc(", "codes equal the reference's"),
    "v quantised without the sqrt": ("ri = numba.float32(math.sqrt(vi))", "ri = vi", "v_scale"),
    "the last partial block skipped": ("m_scale.shape[0], cuda.gridDim.x", "n // Q8, cuda.gridDim.x", "not zeroed"),
    "a code 0 read as 0": ("r = Q8_HALF_LEVEL", "r = ZERO", "params differ"),
}


def mutant_loop(old, new):
    """nb._int8_moments_loop with every `old` in its source replaced by `new`."""
    src = textwrap.dedent(inspect.getsource(nb._int8_moments_loop.py_func))
    assert old in src, f"the kernel's source no longer holds {old!r}: update the mutant"
    ns = dict(vars(nb), _trunc=lambda x: np.float32(np.trunc(x)))
    exec(compile(src.replace(old, new), nb.__file__, "exec"), ns)  # the decorator makes it a (simulated) kernel
    return ns["_int8_moments_loop"]


@sim_only
@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_a_wrong_kernel_fails_the_check(small_grid, monkeypatch, mutant):
    """Each planted mistake fails the checks a GPU run is held to (exact=False), with the matching words."""
    old, new, words = MUTANTS[mutant]
    n = 4 * BLOCK + 37  # a partial last block, an all-zero block, more blocks than the grid
    bounds, flags, mask = table_inside_blocks(n, 5)
    assert run_int8_against_reference(numba_step(), "numpy", n, (bounds, flags), mask, steps=2) is None
    monkeypatch.setattr(nb, "_int8_moments_loop", mutant_loop(old, new))
    why = run_int8_against_reference(numba_step(), "numpy", n, (bounds, flags), mask, steps=2)
    assert why is not None and words in why, why


def test_the_check_sees_truncation_on_its_own():
    """int8_moments_wrong on codes rounded toward zero: caught (no kernel involved); one level off at a few elements
    (a fused multiply-add at a half-level boundary): passes."""
    rng = np.random.default_rng(3)
    n = 10_000
    m, v = (rng.standard_normal(n) * 1e-2).astype(np.float32), (rng.random(n) * 1e-4).astype(np.float32)
    ref = quant.quantize_moments(m, v)
    assert int8_moments_wrong(ref, ref, "x") is None
    bumped = {**ref, "v": ref["v"].copy()}
    bumped["v"][::2000] = np.minimum(bumped["v"][::2000], 254) + 1  # 5 of 10,000 codes one level up
    assert int8_moments_wrong(bumped, ref, "x") is None
    a = np.repeat(ref["v_scale"], BLOCK)[:n]
    truncated = {**ref, "v": np.trunc(np.sqrt(v) / a * np.float32(255)).astype(np.uint8)}
    assert "v: only" in int8_moments_wrong(truncated, ref, "x")


@pytest.mark.parametrize("clip, loss_scale", [(0.0, 1.0), (0.5, 1024.0)])
def test_device_step_equals_the_host_step(small_grid, clip, loss_scale):
    """adamw_step_device with int8 moments (the CUDA-graph step's kernel, scalars in device memory) = adamw_step with
    the host's clip factor and 1 / loss scale: bit for bit without clipping, within the GPU checks with it."""
    rng = np.random.default_rng(7)
    n = 2 * BLOCK + 100
    bounds, flags, _ = random_table(rng, n)
    p = rng.standard_normal(n).astype(np.float32)
    g = (rng.standard_normal(n) * loss_scale).astype(np.float32)
    st = quant.quantize_moments((rng.standard_normal(n) * 1e-2).astype(np.float32), rng.random(n).astype(np.float32))
    keys = ("m", "v", "m_scale", "v_scale")
    dev, ref = ([to_backend(a.copy(), "numba") for a in (p, g, *(st[k] for k in keys))] for _ in range(2))
    sumsq = to_backend(np.zeros(1, np.float32), "numba")
    nb.grad_sumsq(dev[1], sumsq)
    norm = math.sqrt(float(to_numpy(sumsq)[0])) / loss_scale
    coef = min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0
    hyper = to_backend(nb.adamw_hyper(3e-3, WD, 5, B1, B2, clip=clip, loss_scale=loss_scale), "numba")
    nb.adamw_step_device(*dev[:4], hyper, sumsq, B1, B2, EPS, decay_bounds=(bounds, flags), m_scale=dev[4],
                         v_scale=dev[5], threads=128)  # fmt: skip
    nb.adamw_step(*ref[:4], 3e-3, B1, B2, EPS, WD, 5, decay_bounds=(bounds, flags), m_scale=ref[4], v_scale=ref[5],
                  grad_scale=float(np.float32(coef) / np.float32(loss_scale)), threads=128)  # fmt: skip
    got, want = [to_numpy(a) for a in dev], [to_numpy(a) for a in ref]
    assert (clip > 0) == (coef < 1.0)  # the clipping case really clips
    if coef == 1.0:
        assert all(np.array_equal(a, b) for a, b in zip(got, want))
    else:
        assert np.allclose(got[0], want[0], rtol=1e-6, atol=1e-7)
        assert int8_moments_wrong(dict(zip(keys, got[2:])), dict(zip(keys, want[2:])), "device") is None


def test_launcher_errors_name_the_problem():
    n = 300
    p, g = np.zeros(n, np.float32), np.zeros(n, np.float32)
    m8, v8 = np.zeros(n, np.int8), np.zeros(n, np.uint8)
    sm, sv = np.zeros(2, np.float32), np.zeros(2, np.float32)
    args = (1e-3, B1, B2, EPS, WD, 1)
    with pytest.raises(ValueError, match=r"pass their per-block scales \(missing v_scale: float32 \(2,\)"):
        nb.adamw_step(p, g, m8, v8, *args, m_scale=sm)
    with pytest.raises(ValueError, match=r"m_scale has shape \(3,\), expected \(2,\)"):
        nb.adamw_step(p, g, m8, v8, *args, m_scale=np.zeros(3, np.float32), v_scale=sv)
    with pytest.raises(TypeError, match="v_scale has dtype float16, expected float32"):
        nb.adamw_step(p, g, m8, v8, *args, m_scale=sm, v_scale=sv.astype(np.float16))
    with pytest.raises(TypeError, match="v has dtype int8, expected uint8"):
        nb.adamw_step(p, g, m8, m8, *args, m_scale=sm, v_scale=sv)
    with pytest.raises(ValueError, match=r"block-wise 8-bit moments .* version='v2' \(got version='v1'\)"):
        nb.adamw_step(p, g, m8, v8, *args, m_scale=sm, v_scale=sv, version="v1")
    with pytest.raises(ValueError, match="threads=32: .* threads must be one of 64, 128, 256"):
        nb.adamw_step(p, g, m8, v8, *args, m_scale=sm, v_scale=sv, threads=32)
    with pytest.raises(ValueError, match="m_scale / v_scale belong to block-wise 8-bit moments"):
        nb.adamw_step(p, g, np.zeros(n, np.float32), np.zeros(n, np.float32), *args, m_scale=sm, v_scale=sv)
    with pytest.raises(TypeError, match=r"m has dtype uint8, expected .* or int8 with v uint8"):
        nb.adamw_step(p, g, v8, v8, *args)
    hyper, sumsq = nb.adamw_hyper(1e-3, WD, 1, B1, B2), np.zeros(1, np.float32)
    with pytest.raises(ValueError, match="adamw_step_device: m int8 and v uint8 .*missing m_scale and v_scale"):
        nb.adamw_step_device(p, g, m8, v8, hyper, sumsq, B1, B2, EPS)


# ---- (c) the engines ------------------------------------------------------------------------------------------------


def engine_update_wrong(eng, cfg, batches, lr=3e-3):
    """None when the engine's int8 update of its own gradient is the reference's (the NumPy engine's int8 step on
    the same state and gradient), else what is wrong. A training step on each batch but the last first (a state with
    history), then forward and backward on the last, then the update without clipping (grad_scale 1)."""
    for x, y in batches[:-1]:
        eng.train_step(x, y, lr=lr, weight_decay=WD, grad_clip=1.0)
    x, y = batches[-1]
    eng.forward_backward(x, y)
    before, g = eng.state_dict(), to_numpy(eng.grads.flat).copy()
    eng.optimizer_step(lr, WD, 0.0)
    after = eng.state_dict()
    p, (m, v) = before["params"].copy(), quant.dequantize_moments(before)
    adamw_update(p, g, m, v, after["t"], lr, eng.betas, eng.eps, WD, decay_mask_for(cfg))
    if not np.allclose(after["params"], p, rtol=1e-6, atol=1e-6 * float(np.abs(p).max())):
        return f"engine: params differ from the reference update by up to {np.abs(after['params'] - p).max():.3g}"
    return int8_moments_wrong(after, quant.quantize_moments(m, v), "engine")


def test_numba_engine_update_is_the_reference_update():
    eng = engine.build(TOY, "numba", optimizer_state="int8")
    assert engine_update_wrong(eng, TOY, _learnable_batches(TOY, 2, B=2)) is None


def test_numba_engine_int8_matches_the_numpy_engine_and_resumes_exactly(tmp_path):
    """The Numba engine (simulator) with int8 moments against the NumPy engine with int8 moments, 2 steps: losses and
    gradient norms to 1e-4 (test_optimizer_state_bf16's bounds), params normwise to 1e-4, the moments within the GPU
    checks (int8_moments_wrong). Why not bit for bit: the kernels' gradients differ from the NumPy reference's by
    float32 rounding (gradient norms by ~1e-8 relative), so the moments, and a block's absmax with them, differ in
    their last bits, and a moment at a half-level boundary may round to the neighbouring code (a / 127 of its block),
    which moves that parameter's next update. Measured: losses equal to 7 digits, params 1.1e-6 normwise, scales
    3.5e-7 relative, every code equal (after 4 steps: one code of 3952 one level off, params 2.2e-5 normwise).
    The checkpoint holds int8 / uint8 codes and fp32 scales; a resumed Numba engine continues bit for bit, and the
    NumPy engine's checkpoint loads into it unchanged."""
    rng = np.random.default_rng(5)
    x = rng.integers(0, TOY.vocab_size, (2, 8)).astype(np.int32)
    y = np.roll(x, -1, axis=1)
    ref, eng = engine.build(TOY, "numpy", optimizer_state="int8"), engine.build(TOY, "numba", optimizer_state="int8")
    assert eng.ver["adamw"] == "v2" and eng.m.dtype == np.int8 and eng.v.dtype == np.uint8
    assert eng.optimizer_bytes() == ref.optimizer_bytes() == quant.moment_bytes(num_params(TOY))
    for step in range(2):
        a = ref.train_step(x, y, lr=1e-2, weight_decay=WD, grad_clip=1.0)
        b = eng.train_step(x, y, lr=1e-2, weight_decay=WD, grad_clip=1.0)
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * a["loss"], step
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * a["grad_norm"], step
    p = to_numpy(eng.params.flat)
    assert np.linalg.norm(p - ref.params.flat) <= 1e-4 * np.linalg.norm(ref.params.flat)
    st = eng.state_dict()
    assert {k: st[k].dtype for k in ("m", "v", "m_scale", "v_scale")} == {
        "m": np.int8, "v": np.uint8, "m_scale": np.float32, "v_scale": np.float32}  # fmt: skip
    assert int8_moments_wrong(st, ref.state_dict(), "numba vs numpy engine") is None
    # a resume continues bit for bit, through a checkpoint file
    train.save_checkpoint(tmp_path / "ckpt.npz", eng, {"model": {}}, {"step": 2})
    other = engine.build(TOY, "numba", optimizer_state="int8", seed=9)
    other.load_state_dict(train.load_checkpoint(tmp_path / "ckpt.npz")["engine"])
    la = eng.train_step(x, y, lr=1e-2, weight_decay=WD, grad_clip=1.0)["loss"]
    lb = other.train_step(x, y, lr=1e-2, weight_decay=WD, grad_clip=1.0)["loss"]
    sa, sb = eng.state_dict(), other.state_dict()
    assert la == lb and all(np.array_equal(sa[k], sb[k]) for k in ("params", "m", "v", "m_scale", "v_scale"))
    # the NumPy engine's state loads into the Numba engine as it is stored
    from_numpy = engine.build(TOY, "numba", optimizer_state="int8", seed=9)
    from_numpy.load_state_dict(ref.state_dict())
    sn, sr = from_numpy.state_dict(), ref.state_dict()
    assert all(np.array_equal(sn[k], sr[k]) for k in ("params", "m", "v", "m_scale", "v_scale"))
    bad = {**ref.state_dict(), "m_scale": np.zeros(3, np.float32)}
    with pytest.raises(ValueError, match=r"m_scale has shape \(3,\), this model needs"):
        from_numpy.load_state_dict(bad)


def test_fp32_moments_load_into_an_int8_numba_engine():
    """A state of another optimizer_state is quantised on load (moments_from_f32), as on the NumPy engine."""
    fp32 = engine.build(TOY, "numpy")
    for x, y in _learnable_batches(TOY, 2, B=2):
        fp32.train_step(x, y, lr=1e-2, weight_decay=WD, grad_clip=1.0)
    eng = engine.build(TOY, "numba", optimizer_state="int8")
    eng.load_state_dict(fp32.state_dict())
    want = quant.quantize_moments(fp32.m, fp32.v)
    st = eng.state_dict()
    assert all(np.array_equal(st[k], want[k]) for k in want)


def test_the_cli_trains_with_int8_moments_on_the_numba_backend(tmp_path):
    from test_train_ranks import TINY as JOB

    job = [a if a != "numpy" else "numba" for a in JOB] + ["--d-model", "16", "--block-size", "8", "--batch-size", "2"]
    summary = train.main(job + ["--steps", "1", "--optimizer-state", "int8", "--out", str(tmp_path)])
    assert summary is not None
    st = train.load_checkpoint(tmp_path / "ckpt.npz")["engine"]
    assert st["optimizer_state"] == "int8" and st["m"].dtype == np.int8 and st["v"].dtype == np.uint8
    assert st["m_scale"].shape == (contract.int8_blocks(st["params"].size),) and np.any(st["m_scale"] > 0)


# ---- (d) on a GPU: both backends, large and awkward sizes -----------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize(
    "n, threads, half",
    [(1, 64, None), (BLOCK - 1, 64, "bfloat16"), (2_000_003, 256, "float16"), (4096 * BLOCK * 3 + 7, 128, None)],
)
def test_gpu_kernels_match_the_reference(backend, n, threads, half):
    """The last size needs more than 3 passes of the grid (capped at 4096 blocks) and ends in a block of 7."""
    fn, arrays = _gpu_launcher(backend, threads)
    bounds, flags, mask = random_table(np.random.default_rng(n), n)
    table = (to_backend(bounds, arrays), to_backend(flags, arrays))
    steps = 10 if n < 10**6 else 4
    assert run_int8_against_reference(fn, arrays, n, table, mask, steps=steps, half=half) is None


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_device_step_equals_the_host_step(backend):
    """adamw_int8_moments_device_v2 = adamw_int8_moments_v2 with the host's clip factor, a bf16 half copy beside."""
    _, arrays = _gpu_launcher(backend)
    if backend == "hip":
        from gpullm_lessons.backends.hip import adamw as K
    else:
        K = nb
    rng = np.random.default_rng(11)
    n = 2_000_003
    bounds, flags, _ = random_table(rng, n)
    table = (to_backend(bounds, arrays), to_backend(flags, arrays))
    p = rng.standard_normal(n).astype(np.float32)
    g = rng.standard_normal(n).astype(np.float32)
    st = quant.quantize_moments((rng.standard_normal(n) * 1e-2).astype(np.float32), rng.random(n).astype(np.float32))
    keys = ("m", "v", "m_scale", "v_scale")
    for clip in (0.0, 1.0):
        dev, ref = ([to_backend(a.copy(), arrays) for a in (p, g, *(st[k] for k in keys))] for _ in range(2))
        sumsq, half = to_backend(np.zeros(1, np.float32), arrays), to_backend(np.zeros(n, np.uint16), arrays)
        K.grad_sumsq(dev[1], sumsq)
        norm = math.sqrt(float(to_numpy(sumsq)[0]))
        coef = min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0
        hyper = to_backend(nb.adamw_hyper(1e-3, WD, 3, B1, B2, clip=clip), arrays)
        K.adamw_step_device(*dev[:4], hyper, sumsq, B1, B2, EPS, decay_bounds=table, half_out=half,
                            half_dtype="bfloat16", m_scale=dev[4], v_scale=dev[5])  # fmt: skip
        K.adamw_step(*ref[:4], 1e-3, B1, B2, EPS, WD, 3, decay_bounds=table, grad_scale=coef, version="v2",
                     m_scale=ref[4], v_scale=ref[5])  # fmt: skip
        got, want = [to_numpy(a) for a in dev], [to_numpy(a) for a in ref]
        assert np.allclose(got[0], want[0], rtol=1e-6, atol=1e-7)
        assert int8_moments_wrong(dict(zip(keys, got[2:])), dict(zip(keys, want[2:])), f"clip {clip}") is None
        assert np.array_equal(to_numpy(half), got[0].astype(ml_dtypes.bfloat16).view(np.uint16))


GPU_CFG = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, d_model=128)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["hip", pytest.param("numba", marks=needs_numba_gpu)])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_gpu_engine_update_is_the_reference_update(backend, precision):
    """The engine's int8 update of its own gradient (whatever the products' precision made it) = the reference's."""
    eng = engine.build(GPU_CFG, backend, precision, optimizer_state="int8", graphs="off")
    assert engine_update_wrong(eng, GPU_CFG, _learnable_batches(GPU_CFG, 3)) is None


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["hip", pytest.param("numba", marks=needs_numba_gpu)])
def test_gpu_engine_int8_state_tracks_fp32_and_its_graph_replays_the_eager_step(backend):
    """The kernel engines with int8 moments (bf16 matrix products in every run): the losses of 10 steps within 3e-3 of
    the fp32-moment run's. Why that bound: the NumPy engine's int8 run of this model on these batches is 4.3e-4
    (relative) from its fp32 run (its bf16 run: 2.3e-5), and test_optimizer_state_bf16's GPU test allows 2e-3 for bf16
    moments with the half-precision products' own noise. On HIP the CUDA-graph step (adamw_int8_moments_device_v2)
    ran; after one step its state is the eager step's (within the GPU checks: the capture's warm-up step restored the
    scales too), and 10 steps give the eager losses (test_engine's graph-vs-eager tolerance)."""
    batches = _learnable_batches(GPU_CFG, 10, B=4)
    runs = {}
    for state, graphs in (("fp32", "off"), ("int8", "off"), ("int8", "auto")):
        eng = engine.build(GPU_CFG, backend, "bf16", optimizer_state=state, graphs=graphs)
        losses = [eng.train_step(*batches[0], lr=3e-3, weight_decay=WD, grad_clip=1.0)["loss"]]
        first = eng.state_dict()
        losses += [eng.train_step(x, y, lr=3e-3, weight_decay=WD, grad_clip=1.0)["loss"] for x, y in batches[1:]]
        runs[state, graphs] = (np.array(losses), first, eng.graphs)
    a, b = runs["fp32", "off"][0], runs["int8", "off"][0]
    assert np.all(np.abs(a - b) <= 3e-3 * a), np.abs(a - b) / a
    assert runs["int8", "off"][1]["m"].dtype == np.int8
    if backend == "hip":
        assert runs["int8", "auto"][2]  # the graph step ran
        eager, graph = runs["int8", "off"][1], runs["int8", "auto"][1]
        assert np.allclose(graph["params"], eager["params"], rtol=1e-5, atol=1e-6)
        assert int8_moments_wrong(graph, eager, "graph vs eager, step 1") is None
        assert np.allclose(runs["int8", "auto"][0], b, rtol=1e-3)
