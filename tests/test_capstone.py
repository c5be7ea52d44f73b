"""The capstone of lesson 09 (gpullm_lessons.engine.capstone, gpullm_lessons.checks.capstone).

The solution's functions (read from solutions/09_full_training_loop.ipynb, so that the answer lives in one place)
pass every checker in the simulator; each named mistake (a variant of the solution: a wrapper, or its source with one
line changed) fails with a hint that names it; the fresh exercise's functions are "not attempted". The GPU test runs
the whole step on the HIP backend: ten steps' losses against the NumPy engine.
"""
import re
import json
import math
from pathlib import Path

import numpy as np
import pytest

import gpullm_lessons  # noqa: F401  (the simulator before numba)
from gpullm_lessons.engine import capstone
from gpullm_lessons.checks import capstone as cc
from gpullm_lessons.model.params import GPTConfig

ROOT = Path(__file__).resolve().parents[1]
SOLUTION = ROOT / "solutions" / "09_full_training_loop.ipynb"
EXERCISE = ROOT / "exercises" / "09_full_training_loop.ipynb"
FUNCTIONS = ("lr_at", "linear_backward", "block_forward", "block_backward", "optimizer_step")


def _functions(path=SOLUTION, patches=()):
    """The notebook's function definitions, executed; patches: (old, new) replacements, each found exactly once."""
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]      # plain JSON: no nbformat needed on a GPU box
    sources = ["".join(c["source"]) if isinstance(c["source"], list) else c["source"] for c in cells
               if c["cell_type"] == "code"]
    source = "\n\n".join(src for src in sources if src.startswith("def "))
    for old, new in patches:
        assert source.count(old) == 1, f"the solution changed: {old!r} is not there exactly once"
        source = source.replace(old, new)
    ns = {"math": math, "np": np}
    exec(compile(source, str(path), "exec"), ns)
    missing = [f for f in FUNCTIONS if f not in ns]
    assert not missing, f"{path.name} defines no {missing}"
    return ns


@pytest.fixture(scope="module")
def sol():
    return _functions()


# ---- the float64 model the checkers compare with ---------------------------------------------------------------
def test_block_model_is_the_reference_block():
    from gpullm_lessons.model.params import init_params
    from gpullm_lessons.reference.gpt import block_backward, block_forward

    cfg = GPTConfig(vocab_size=11, block_size=5, n_layer=2, n_head=2, d_model=8)
    rng = np.random.default_rng(0)
    flat = cc._random_params(cfg, rng).astype(np.float64)
    P = cc._views(cfg, flat)
    B, T = 3, 5
    for l in range(cfg.n_layer):
        x = rng.normal(size=(B, T, cfg.d_model))
        out_ref, cache = block_forward(P, l, x, cfg.n_head)
        t = cc.block_model_forward(P, l, x.reshape(B * T, -1), B, T, cfg.n_head)
        np.testing.assert_allclose(t["out"], out_ref.reshape(B * T, -1), rtol=1e-12, atol=1e-12)
        dout = rng.normal(size=(B, T, cfg.d_model))
        grads = init_params(cfg, dtype=np.float64).zeros_like()
        dx_ref = block_backward(dout, cache, grads, l)
        dx, g = cc.block_model_backward(P, l, t, dout.reshape(B * T, -1), B, T, cfg.n_head)
        np.testing.assert_allclose(dx, dx_ref.reshape(B * T, -1), rtol=1e-10, atol=1e-12)
        for name in capstone.LAYER_PARAMS:
            np.testing.assert_allclose(g[name], grads[name][l], rtol=1e-10, atol=1e-12, err_msg=name)


def test_every_mistake_flag_changes_the_model():
    """A flag that changed nothing could never be told apart from the right answer."""
    cfg = GPTConfig(vocab_size=11, block_size=5, n_layer=2, n_head=2, d_model=8)
    rng = np.random.default_rng(1)
    P = cc._views(cfg, cc._random_params(cfg, rng).astype(np.float64))
    x = rng.normal(size=(10, 8))
    right = cc.block_model_forward(P, 1, x, 2, 5, 2)
    for flags, _ in cc._FORWARD_MISTAKES:
        assert cc._diff(cc.block_model_forward(P, 1, x, 2, 5, 2, flags)["out"], right["out"], cc.MISTAKE_TOL), flags
    dout = rng.normal(size=(10, 8))
    dx, g = cc.block_model_backward(P, 1, right, dout, 2, 5, 2)
    for flags, _ in cc._BACKWARD_MISTAKES:
        dx2, g2 = cc.block_model_backward(P, 1, right, dout, 2, 5, 2, flags)
        assert not cc._matches({"dx": dx2, **g2}, {"dx": dx, **g}), flags


# ---- the solution passes ---------------------------------------------------------------------------------------
def test_solution_passes_every_checker(sol):
    results = [cc.check_engine_linear_backward(sol["linear_backward"], seed=11, quiet=True),
               cc.check_block_forward(sol["block_forward"], seed=12, quiet=True),
               cc.check_block_backward(sol["block_backward"], seed=13, quiet=True),
               cc.check_optimizer_step(sol["optimizer_step"], seed=14, quiet=True),
               cc.check_training_step(sol["block_forward"], sol["block_backward"], sol["optimizer_step"], seed=15,
                                      quiet=True)]
    for r in results:
        assert r.status == "correct", r.message


LATER_LAYER = re.compile(r"layer [1-9]")   # the first layer past 0 the case has: 1 in the simulator, 2 on a GPU


# ---- the named mistakes ----------------------------------------------------------------------------------------
def _wrong(result, *words):
    """Wrong, and the message names every one of `words` (a str, or a compiled pattern where the simulator's sizes
    and a GPU's differ: the layer a hard-coded index breaks first, the number of steps checked)."""
    assert result.status == "wrong", result.message
    text = (result.message + " " + (result.hint or "")).lower()
    for w in words:
        found = w.search(text) if isinstance(w, re.Pattern) else w.lower() in text
        assert found, f"{w!r} not in: {result.message}"


def test_hard_coded_layer_0_in_the_forward_fails_at_layer_1(sol):
    def block_forward(eng, x, l, B, T):
        return sol["block_forward"](eng, x, 0, B, T)
    _wrong(cc.check_block_forward(block_forward, seed=3, quiet=True), LATER_LAYER, "hard-coded layer index")


def test_hard_coded_layer_0_in_the_backward_fails_at_layer_1(sol):
    def block_backward(eng, dout, cache, l, B, T):
        return sol["block_backward"](eng, dout, cache, 0, B, T)
    _wrong(cc.check_block_backward(block_backward, seed=3, quiet=True), LATER_LAYER, "hard-coded layer index")


def test_hard_coded_layer_0_in_the_linear_backward(sol):
    def linear_backward(eng, dout, inp, w, b, l):
        return sol["linear_backward"](eng, dout, inp, w, b, 0)
    _wrong(cc.check_engine_linear_backward(linear_backward, seed=3, quiet=True), LATER_LAYER, "hard-coded layer index")


def test_missing_residual_in_the_forward():
    bad = _functions(patches=[('p["attprojb"][l], x1, res=x)', 'p["attprojb"][l], x1)')])
    _wrong(cc.check_block_forward(bad["block_forward"], seed=4, quiet=True), "layer 0", "residual is missing")


def test_missing_residual_gradient_in_the_backward():
    bad = _functions(patches=[("    dx1 += dout\n", "")])
    _wrong(cc.check_block_backward(bad["block_backward"], seed=4, quiet=True), "residual gradient is missing")


def test_transposed_weight_in_the_forward():
    bad = _functions(patches=[('eng.gemm(c["atty"], p["attprojw"][l], x1)',
                               'eng.gemm(c["atty"], p["attprojw"][l], x1, trans_b=True)')])
    _wrong(cc.check_block_forward(bad["block_forward"], seed=5, quiet=True), "attprojw", "transposed")


def test_untransposed_weight_in_the_linear_backward():
    bad = _functions(patches=[("eng.gemm(dout, W, dinp, trans_b=True)", "eng.gemm(dout, W, dinp)")])
    r = cc.check_engine_linear_backward(bad["linear_backward"], seed=5, quiet=True)
    # the square attprojw comes first: plausible numbers, named; the others do not chain (an error naming gemm)
    _wrong(r, "attprojw", "untransposed")


def test_wrong_layernorm_saved_for_backward(sol):
    def block_forward(eng, x, l, B, T):
        out, cache = sol["block_forward"](eng, x, l, B, T)
        cache["mean2"], cache["rstd2"] = cache["mean1"], cache["rstd1"]
        return out, cache
    _wrong(cc.check_block_forward(block_forward, seed=6, quiet=True), "cache['mean2']",
           "wrong LayerNorm saved for backward")
    bad = _functions(patches=[('c["x1"], p["ln2w"][l], c["mean2"], c["rstd2"]', 'c["x1"], p["ln2w"][l], c["mean1"], '
                                                                               'c["rstd1"]')])
    _wrong(cc.check_block_backward(bad["block_backward"], seed=6, quiet=True), "wrong LayerNorm saved for backward")


def test_stale_gradients_added_into_the_buffer(sol):
    def block_backward(eng, dout, cache, l, B, T):          # adds into eng.grads instead of writing
        old = {p: eng.grads[p][l].copy() for p in capstone.LAYER_PARAMS}
        dx = sol["block_backward"](eng, dout, cache, l, B, T)
        for p in capstone.LAYER_PARAMS:
            eng.grads[p][l] += old[p]
        return dx
    _wrong(cc.check_block_backward(block_backward, seed=7, quiet=True), "not zeroed between steps")


def test_stale_gradients_across_steps_of_the_whole_step(sol):
    """A backward that adds into eng.grads, and an optimizer step that hands AdamW a scaled copy (so the kernel zeroes
    the copy, not eng.grads): step 1 is right, step 2 carries step 1's gradients."""
    def block_backward(eng, dout, cache, l, B, T):
        old = {p: eng.grads[p][l].copy() for p in capstone.LAYER_PARAMS}
        dx = sol["block_backward"](eng, dout, cache, l, B, T)
        for p in capstone.LAYER_PARAMS:
            eng.grads[p][l] += old[p]
        return dx

    def optimizer_step(eng, lr, weight_decay, grad_clip, loss_scale):
        sumsq = eng.xp.zeros(1, eng.xp.float32)
        eng.K.grad_sumsq(eng.grads.flat, sumsq)
        norm = math.sqrt(float(sumsq[0])) / loss_scale
        coef = min(1.0, grad_clip / (norm + 1e-6)) if grad_clip > 0 else 1.0
        eng.t += 1
        eng.K.adamw_step(eng.params.flat, eng.grads.flat * (coef / loss_scale), eng.m, eng.v, lr, *eng.betas, eng.eps,
                         weight_decay, eng.t, decay_bounds=eng.decay)
        return norm
    r = cc.check_training_step(sol["block_forward"], block_backward, optimizer_step, seed=12, quiet=True)
    _wrong(r, re.compile(r"step 2 of \d+"), "not zeroed between steps")


def test_a_cache_reused_between_calls_fails(sol):
    kept = {}

    def block_forward(eng, x, l, B, T):                      # one set of cache arrays for every call
        out, cache = sol["block_forward"](eng, x, l, B, T)
        for k, v in cache.items():
            if k not in kept:
                kept[k] = v.copy()
            kept[k][...] = v
        return out, dict(kept)
    _wrong(cc.check_block_forward(block_forward, seed=8, quiet=True), "changed during the later calls",
           "new arrays")


def test_clip_after_the_update(sol):
    def optimizer_step(eng, lr, weight_decay, grad_clip, loss_scale):
        norm = sol["optimizer_step"](eng, lr, weight_decay, 0.0, loss_scale)     # AdamW on the unclipped gradient
        if grad_clip > 0:
            eng.grads.flat[...] *= min(1.0, grad_clip / (norm + 1e-6))           # ... then the clip
        return norm
    _wrong(cc.check_optimizer_step(optimizer_step, seed=9, quiet=True), "call 1", "after the update")


def test_clip_not_applied(sol):
    def optimizer_step(eng, lr, weight_decay, grad_clip, loss_scale):
        return sol["optimizer_step"](eng, lr, weight_decay, 0.0, loss_scale)
    _wrong(cc.check_optimizer_step(optimizer_step, seed=9, quiet=True), "clipping is missing")


def test_loss_scale_not_undone(sol):
    def optimizer_step(eng, lr, weight_decay, grad_clip, loss_scale):
        return sol["optimizer_step"](eng, lr, weight_decay, grad_clip, 1.0)
    _wrong(cc.check_optimizer_step(optimizer_step, seed=10, quiet=True), "loss scale is not undone")


def test_weight_decay_on_every_parameter():
    bad = _functions(patches=[("weight_decay, eng.t, decay_bounds=eng.decay, grad_scale",
                               "weight_decay, eng.t, grad_scale")])
    _wrong(cc.check_optimizer_step(bad["optimizer_step"], seed=10, quiet=True), "every parameter")


def test_step_count_not_advanced():
    bad = _functions(patches=[("    eng.t += 1\n", ""), ("weight_decay, eng.t, decay_bounds", "weight_decay, "
                                                                                                "max(eng.t, 1), "
                                                                                                "decay_bounds")])
    _wrong(cc.check_optimizer_step(bad["optimizer_step"], seed=10, quiet=True), "step count was not advanced")


# ---- the fresh exercise ----------------------------------------------------------------------------------------
def test_fresh_exercise_is_not_attempted():
    ex = _functions(EXERCISE)
    results = [cc.check_engine_linear_backward(ex["linear_backward"], seed=1, quiet=True),
               cc.check_block_forward(ex["block_forward"], seed=1, quiet=True),
               cc.check_block_backward(ex["block_backward"], seed=1, quiet=True),
               cc.check_optimizer_step(ex["optimizer_step"], seed=1, quiet=True),
               cc.check_training_step(ex["block_forward"], ex["block_backward"], ex["optimizer_step"], seed=1,
                                      quiet=True)]
    assert [r.status for r in results] == ["not attempted"] * 5, [r.message for r in results]


def test_checkers_refuse_what_is_not_a_function():
    with pytest.raises(TypeError, match="pass the function itself"):
        cc.check_block_forward(None)
    with pytest.raises(TypeError, match="block_backward must be your function"):
        cc.check_training_step(lambda *a: None, 3, lambda *a: None)


def test_errors_in_the_learners_code_are_reported_not_raised(sol):
    def block_forward(eng, x, l, B, T):
        return sol["block_forward"](eng, x.astype(np.float64), l, B, T)
    r = cc.check_block_forward(block_forward, seed=2, quiet=True)
    assert r.status == "error" and "float32" in r.hint, r.message


# ---- on a GPU: the HIP backend, ten steps ---------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_solution_passes_and_ten_steps_match_the_numpy_engine(sol):
    for check, fn in ((cc.check_engine_linear_backward, "linear_backward"), (cc.check_block_forward, "block_forward"),
                      (cc.check_block_backward, "block_backward"), (cc.check_optimizer_step, "optimizer_step")):
        r = check(sol[fn], seed=21, quiet=True)
        assert r.status == "correct" and "backend hip" in r.message, r.message
    r = cc.check_training_step(sol["block_forward"], sol["block_backward"], sol["optimizer_step"], seed=22,
                               quiet=True)
    assert r.status == "correct" and "10 steps" in r.message and "backend hip" in r.message, r.message


@pytest.mark.gpu
def test_gpu_mistakes_are_caught_on_hip(sol):
    def block_forward(eng, x, l, B, T):
        return sol["block_forward"](eng, x, 0, B, T)
    _wrong(cc.check_block_forward(block_forward, seed=23, quiet=True), LATER_LAYER, "hard-coded layer index")

    def optimizer_step(eng, lr, weight_decay, grad_clip, loss_scale):
        return sol["optimizer_step"](eng, lr, weight_decay, grad_clip, 1.0)
    _wrong(cc.check_training_step(sol["block_forward"], sol["block_backward"], optimizer_step, seed=24, quiet=True),
           "loss scale is not undone")
