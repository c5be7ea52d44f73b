"""The lesson 07 checkers: the right answer passes, every named wrong variant fails with its hint."""
import ml_dtypes
import numpy as np
import pytest

from gpullm_lessons.checks.precision import (check_bf16_hip, check_bf16_kernel, check_bf16_rne,
                                             check_loss_scaler_update, check_unscale_hip)
from gpullm_lessons.model.precision import f32_to_bf16_bits

U = np.uint32


def _nan(b):
    return (b & U(0x7FFFFFFF)) > U(0x7F800000)


def _qnan(b):
    return ((b >> U(16)) & U(0x8000)) | U(0x7FC0)


# ---- 07.1: learners' versions of f32 -> bf16, written as a learner would ---------------------------------------

def right_mine(x):
    b = x.view(np.uint32)
    r = (b.astype(np.uint64) + 0x7FFF + ((b >> 16) & 1)) >> 16
    return np.where(_nan(b), _qnan(b), r).astype(np.uint16)


def truncate(x):
    return (x.view(np.uint32) >> 16).astype(np.uint16)


def ties_away(x):
    b = x.view(np.uint32)
    return np.where(_nan(b), _qnan(b), (b.astype(np.uint64) + 0x8000) >> 16).astype(np.uint16)


def ties_down(x):
    b = x.view(np.uint32)
    return np.where(_nan(b), _qnan(b), (b.astype(np.uint64) + 0x7FFF) >> 16).astype(np.uint16)


def no_nan_test(x):                      # uint32 arithmetic, NaN not special-cased
    b = x.view(np.uint32)
    return ((b + U(0x7FFF) + ((b >> U(16)) & U(1))) >> U(16)).astype(np.uint16)


def nan_sign_lost(x):
    b = x.view(np.uint32)
    return np.where(_nan(b), U(0x7FC0), right_mine(x)).astype(np.uint16)


def ftz(x):
    out = right_mine(x)
    sub = (x.view(np.uint32) & U(0x7F800000)) == 0
    out[sub] = (x.view(np.uint32)[sub] >> 16) & 0x8000
    return out


def returns_floats(x):
    return x.astype(ml_dtypes.bfloat16).astype(np.float32)


def modifies_input(x):
    out = right_mine(x)
    x[...] = 0
    return out


def raises(x):
    raise IndexError("index 3 is out of bounds")


def not_attempted(x):
    raise NotImplementedError("exercise: write this part")


@pytest.mark.parametrize("fn", [f32_to_bf16_bits, right_mine, lambda x: x.astype(ml_dtypes.bfloat16).view(np.uint16)])
def test_bf16_right_answers_pass(fn, capsys):
    task = None if fn is f32_to_bf16_bits else "07.1 test"  # graded, the course's own rounding is a borrowed answer
    r = check_bf16_rne(fn, task=task)
    assert r.passed and r.status == "correct" and r.task == task
    assert "bf16_rne: correct (bit-exact" in capsys.readouterr().out


@pytest.mark.parametrize("fn, words", [
    (truncate, ["truncation", "NaN not special-cased"]),
    (ties_away, ["ties round away from zero"]),
    (ties_down, ["ties round toward zero"]),
    (no_nan_test, ["NaN turned into inf"]),
    (nan_sign_lost, ["NaN's sign was lost"]),
    (ftz, ["subnormals were flushed"]),
    (returns_floats, ["dtype float32", "BITS as uint16"]),
    (modifies_input, ["changed its input"]),
])
def test_bf16_mistakes_are_named(fn, words):
    r = check_bf16_rne(fn, quiet=True)
    assert r.status == "wrong" and not r.passed
    for w in words:
        assert w in r.message, (w, r.message)
    if fn in (ties_away, ties_down):
        assert "a tie" in r.message               # the first wrong special case is named
    assert "truncation" not in r.message or fn is truncate


def test_bf16_errors_and_not_attempted(capsys):
    r = check_bf16_rne(raises)
    assert r.status == "error" and "IndexError" in r.message and "raises" in r.hint
    r = check_bf16_rne(not_attempted)
    assert r.status == "not attempted"
    out = capsys.readouterr().out
    assert "not attempted" in out
    with pytest.raises(TypeError, match="pass the function itself"):
        check_bf16_rne(right_mine(np.zeros(2, np.float32)))


def test_bf16_seed_repeats():
    a = check_bf16_rne(ties_away, seed=7, quiet=True)
    b = check_bf16_rne(ties_away, seed=7, quiet=True)
    assert a.message == b.message and "seed 7" in a.message


# ---- 07.2: the loss-scaler update rule ---------------------------------------------------------------------------

def update_right(scale, found_inf, clean_steps, growth_interval):
    if found_inf:
        return max(scale * 0.5, 1.0), 0, True
    clean_steps += 1
    if clean_steps >= growth_interval:
        return scale * 2.0, 0, False
    return scale, clean_steps, False


def no_reset_on_inf(scale, found_inf, clean_steps, growth_interval):
    if found_inf:
        return max(scale * 0.5, 1.0), clean_steps, True
    return update_right(scale, False, clean_steps, growth_interval)


def grows_every_step(scale, found_inf, clean_steps, growth_interval):
    if found_inf:
        return max(scale / 2, 1.0), 0, True
    return scale * 2, clean_steps + 1, False


def never_skips(scale, found_inf, clean_steps, growth_interval):
    s, c, _ = update_right(scale, found_inf, clean_steps, growth_interval)
    return s, c, False


def grows_late(scale, found_inf, clean_steps, growth_interval):
    if found_inf:
        return max(scale * 0.5, 1.0), 0, True
    if clean_steps >= growth_interval:                 # tested before counting this step
        return scale * 2.0, 0, False
    return scale, clean_steps + 1, False


def no_reset_on_grow(scale, found_inf, clean_steps, growth_interval):
    if found_inf:
        return max(scale * 0.5, 1.0), 0, True
    clean_steps += 1
    if clean_steps % growth_interval == 0:
        return scale * 2.0, clean_steps, False
    return scale, clean_steps, False


def no_floor(scale, found_inf, clean_steps, growth_interval):
    if found_inf:
        return scale * 0.5, 0, True
    return update_right(scale, False, clean_steps, growth_interval)


def scaler_class_adapter(scale, found_inf, clean_steps, growth_interval):
    from gpullm_lessons.model.precision import DynamicLossScaler
    s = DynamicLossScaler(init_scale=scale, growth_interval=growth_interval)
    s.clean_steps = clean_steps
    skip = s.update(found_inf)
    return s.scale, s.clean_steps, skip


@pytest.mark.parametrize("fn", [update_right, scaler_class_adapter])
def test_scaler_right_answers_pass(fn, capsys):
    task = None if fn is scaler_class_adapter else "07.2 test"  # graded, the course's DynamicLossScaler is borrowed
    r = check_loss_scaler_update(fn, task=task)
    assert r.passed and r.status == "correct"
    assert "loss_scaler_update: correct" in capsys.readouterr().out


@pytest.mark.parametrize("fn, words", [
    (no_reset_on_inf, "counter must restart at 0"),
    (grows_every_step, "grew on a clean step before the count reached"),
    (never_skips, "was not skipped"),
    (grows_late, "one step late"),
    (no_reset_on_grow, "after growing, the counter must restart"),
    (no_floor, "fell below min_scale"),
    (lambda s, f, c, i: (s, c), "tuple of three"),
])
def test_scaler_mistakes_are_named(fn, words):
    for seed in (0, 1, 2):
        r = check_loss_scaler_update(fn, seed=seed, quiet=True)
        assert r.status == "wrong" and words in r.message, r.message
        assert "expected" in r.message or "tuple" in r.message


def test_scaler_errors_and_not_attempted():
    def boom(scale, found_inf, clean_steps, growth_interval):
        return scale / 0
    r = check_loss_scaler_update(boom, quiet=True)
    assert r.status == "error" and "ZeroDivisionError" in r.message and "scale=" in r.hint

    def todo(*a):
        raise NotImplementedError
    assert check_loss_scaler_update(todo, quiet=True).status == "not attempted"


# ---- 07.4 check_bf16_kernel: a launcher fn(x, out) writing bf16 bits ---------------------------------------------

def launcher(mistake=None, cap=None):
    """A NumPy stand-in for a kernel launcher: writes out[i] for i < cap (a grid that does not stride)."""
    def fn(x, out):
        n = x.size if cap is None else min(cap, x.size)
        got = right_mine(x)
        if mistake == "trunc":
            got = truncate(x)
        if mistake == "tail":
            n -= x.size % 4
        if mistake == "modify":
            x[...] = 0
        out[:n] = got[:n]
    return fn


def test_bf16_kernel_numpy_launcher_passes():
    r = check_bf16_kernel(launcher(), arrays="numpy", seed=3, quiet=True)
    assert r.status == "correct" and "4 calls" in r.message, r.message


@pytest.mark.parametrize("fn, words", [
    (launcher("trunc"), "truncation"),
    (launcher(cap=64), "grid-stride"),         # right on the special cases, n = 1; wrong past 64 elements
    (launcher("tail"), "never written"),
    (launcher("modify"), "changed its input"),
])
def test_bf16_kernel_mistakes_are_named(fn, words):
    r = check_bf16_kernel(fn, arrays="numpy", seed=3, quiet=True)
    assert r.status == "wrong" and words in (r.hint or ""), r.message


def test_bf16_kernel_bad_arguments():
    with pytest.raises(TypeError, match="pass the function itself"):
        check_bf16_kernel(np.zeros(3))
    with pytest.raises(ValueError, match="size="):
        check_bf16_kernel(launcher(), arrays="numpy", size="tiny")


# ---- 06.2 / 07.3: HIP sources, the parts that need no GPU --------------------------------------------------------

def test_hip_checkers_take_a_source_or_a_function_returning_it():
    with pytest.raises(TypeError, match="kernel source"):
        check_bf16_hip(42)
    with pytest.raises(TypeError, match="kernel source"):
        check_unscale_hip(None)

    def boom():
        raise KeyError("oops")
    r = check_bf16_hip(boom, quiet=True)
    assert r.status == "error" and "KeyError" in r.message

    def todo():
        raise NotImplementedError
    assert check_unscale_hip(todo, quiet=True).status == "not attempted"
    assert check_unscale_hip(lambda: 3, quiet=True).status == "error"


def test_hip_task_rules_are_checked_on_the_text():
    src = '#include "portable.h"\n#include "half.h"\nextern "C" __global__ void f32_to_bf16_vec4(const float4* s) {}\n'
    r = check_bf16_hip(src, quiet=True)
    assert r.status == "wrong" and "line 2" in r.message and "half.h" in r.hint
    r = check_bf16_hip('#include "portable.h"\n// float4 in a comment does not count\n', quiet=True)
    assert r.status == "wrong" and "float4" in r.hint
    r = check_unscale_hip('#include "portable.h"\nextern "C" __global__ void unscale_nonfinite() {}\n', quiet=True)
    assert r.status == "wrong" and "atomicAdd" in r.hint
