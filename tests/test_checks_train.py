"""checks_train: check_lr_schedule and check_clip_coef pass the right answer (and the library's own functions),
fail each common mistake with the hint that names it, and report not attempted / error / no return as checks/backward.py
does, printing one verdict and recording it for grading."""
import math

import numpy as np
import pytest

from gpullm_lessons.checks.train import check_clip_coef, check_lr_schedule, clip_coef_expected
from gpullm_lessons.model.optim import clip_grad_norm, lr_schedule

SEEDS = range(6)


# ---- 09.1 the learning-rate schedule -----------------------------------------------------------------------------
def lr_right(step, max_lr, warmup, total, min_lr):
    if step < warmup:
        return max_lr * (step + 1) / warmup
    r = min(1.0, (step - warmup) / max(1, total - 1 - warmup))
    return min_lr + 0.5 * (1 + math.cos(math.pi * r)) * (max_lr - min_lr)


def lr_mistake(warm_start_zero=False, warm_le=False, no_floor=False, no_hold=False, span=None, linear=False):
    def fn(step, max_lr, warmup, total, min_lr):
        if step < warmup or (warm_le and step == warmup):
            return max_lr * (step if warm_start_zero else step + 1) / warmup
        start, decay = {None: (warmup, total - 1 - warmup), "total": (warmup, total), "from0": (0, total),
                        "total-warmup": (warmup, total - warmup)}[span]
        r = (step - start) / max(1, decay)
        if not no_hold:
            r = min(1.0, r)
        low = 0.0 if no_floor else min_lr
        coeff = (1 - r) if linear else 0.5 * (1 + math.cos(math.pi * r))
        return low + coeff * (max_lr - low)
    return fn


@pytest.mark.parametrize("seed", SEEDS)
def test_lr_right_passes(seed):
    for fn in (lr_right, lr_schedule, lambda *a: np.float32(lr_right(*a))):
        r = check_lr_schedule(fn, seed=seed, quiet=True)
        assert r.status == "correct", r.message


@pytest.mark.parametrize("mistake, words", [
    (dict(warm_start_zero=True), "warmup is off by one"),
    (dict(warm_le=True), "warmup runs one step too long"),
    (dict(no_floor=True), "no floor at min_lr"),
    (dict(no_hold=True), "climbs back up"),
    (dict(span="total"), "wrong span"),
    (dict(span="from0"), "wrong span"),
    (dict(span="total-warmup"), "one step late"),
    (dict(linear=True), "linear decay instead of cosine"),
])
@pytest.mark.parametrize("seed", SEEDS)
def test_lr_mistake_fails_with_its_hint(mistake, words, seed):
    r = check_lr_schedule(lr_mistake(**mistake), seed=seed, quiet=True)
    assert r.status == "wrong", r.message
    assert words in r.hint, r.message


# wrong answers that used to pass: the old checker never ran warmup = 0 nor a decay phase of a single step
def lr_no_guard(step, max_lr, warmup, total, min_lr):         # divides by total - 1 - warmup
    if step < warmup:
        return max_lr * (step + 1) / warmup
    r = min(1.0, (step - warmup) / (total - 1 - warmup))
    return min_lr + 0.5 * (1 + math.cos(math.pi * r)) * (max_lr - min_lr)


def lr_warmup_fraction_first(step, max_lr, warmup, total, min_lr):   # divides by warmup before the branch
    frac = (step + 1) / warmup
    if step < warmup:
        return max_lr * frac
    return lr_right(step, max_lr, warmup, total, min_lr)


def lr_short_decay_to_min(step, max_lr, warmup, total, min_lr):       # a one-step decay phase jumps to min_lr
    if step >= warmup and total - 1 - warmup <= 0:
        return min_lr
    return lr_right(step, max_lr, warmup, total, min_lr)


@pytest.mark.parametrize("fn, status, words", [
    (lr_no_guard, "error", "decay phase of a single step"),
    (lr_warmup_fraction_first, "error", "warmup = 0"),
    (lr_short_decay_to_min, "wrong", "went straight to min_lr"),
])
@pytest.mark.parametrize("seed", SEEDS)
def test_lr_edge_runs_are_always_checked(fn, status, words, seed):
    r = check_lr_schedule(fn, seed=seed, quiet=True)
    assert r.status == status, r.message
    assert words in r.hint, r.message


def test_lr_runs_every_kind_and_names_the_run():
    seen = set()

    def spy(step, max_lr, warmup, total, min_lr):
        seen.add((warmup, total))
        return lr_right(step, max_lr, warmup, total, min_lr)
    assert check_lr_schedule(spy, seed=0, quiet=True).status == "correct"
    assert any(w == 0 for w, _ in seen) and any(t == w + 1 for w, t in seen) and len(seen) == 5
    r = check_lr_schedule(lr_short_decay_to_min, seed=0, quiet=True)
    assert "a decay phase of one step" in r.message and "at step" in r.message, r.message


def test_lr_unknown_mistake_gets_the_phase_hint():
    r = check_lr_schedule(lambda s, m, w, t, n: m, seed=0, quiet=True)    # constant: right only in places
    assert r.status == "wrong" and r.hint


# ---- 09.2 the clipping coefficient -------------------------------------------------------------------------------
def coef_right(grad_norm, max_norm):
    coef = max_norm / (grad_norm + 1e-6)
    return coef if coef < 1.0 else 1.0


@pytest.mark.parametrize("seed", SEEDS)
def test_clip_right_passes(seed):
    for fn in (coef_right, clip_coef_expected):
        r = check_clip_coef(fn, seed=seed, quiet=True)
        assert r.status == "correct", r.message


def test_expected_coef_is_what_clip_grad_norm_applies():
    rng = np.random.default_rng(0)
    for scale in (1e-6, 1e-3, 0.1, 1.0, 10.0):
        g = (rng.standard_normal(1000) * scale).astype(np.float64)
        before = g.copy()
        norm = clip_grad_norm(g, 1.0)
        np.testing.assert_allclose(g, before * clip_coef_expected(norm, 1.0), rtol=1e-12)


@pytest.mark.parametrize("fn, words", [
    (lambda n, m: min(1.0, m / n) if n > 0 else 1.0, "eps is missing"),
    (lambda n, m: m / (n + 1e-6), "below max_norm"),
    (lambda n, m: n * coef_right(n, m), "clipped norm"),
    (lambda n, m: min(n, m), "norm after clipping"),
    (lambda n, m: max(1.0, (n + 1e-6) / m), "upside down"),
])
@pytest.mark.parametrize("seed", SEEDS)
def test_clip_mistake_fails_with_its_hint(fn, words, seed):
    r = check_clip_coef(fn, seed=seed, quiet=True)
    assert r.status == "wrong", r.message
    assert words in r.hint, r.message


@pytest.mark.parametrize("fn, words", [
    (lambda n, m: 1.0 if n <= m else m / (n + 1e-6), "instead of the coefficient with 1"),
    (lambda n, m: min(1.0, 1.0 / (n + 1e-6)), "max_norm is not used"),
])
@pytest.mark.parametrize("seed", SEEDS)
def test_clip_edge_cases_always_checked(fn, words, seed):
    """Comparing the norms (not the coefficient) used to pass whenever max_norm > 1 was drawn."""
    r = check_clip_coef(fn, seed=seed, quiet=True)
    assert r.status == "wrong" and words in r.hint, r.message


def test_clip_calls_with_several_settings():
    seen = []
    check_clip_coef(lambda n, m: seen.append((n, m)) or coef_right(n, m), seed=0, quiet=True)
    assert len(set(seen)) == len(seen) >= 8 and (0.0, seen[-1][1]) in seen
    assert sum(n == m for n, m in seen) == 2 and len({m for _, m in seen}) == 3


def test_clip_no_eps_dividing_by_zero_names_the_eps():
    r = check_clip_coef(lambda n, m: min(1.0, m / n), seed=1, quiet=True)
    assert r.status in ("wrong", "error") and "1e-6" in r.hint, r.message


# ---- verdicts shared by both --------------------------------------------------------------------------------------
@pytest.mark.parametrize("check", [check_lr_schedule, check_clip_coef])
def test_not_attempted_error_and_no_return(check):
    def todo(*a):
        raise NotImplementedError("exercise: write this part")
    assert check(todo, quiet=True).status == "not attempted"

    def boom(*a):
        raise ValueError("oops")
    r = check(boom, quiet=True)
    assert r.status == "error" and "oops" in r.message

    def forgot(*a):
        pass
    r = check(forgot, quiet=True)
    assert r.status == "wrong" and "return" in r.hint


@pytest.mark.parametrize("check, fn, start", [(check_lr_schedule, lr_schedule, "lr_schedule: correct"),
                                              (check_clip_coef, coef_right, "clip_coef: correct")])
def test_prints_one_verdict_with_the_seed(check, fn, start, capsys):
    r = check(fn)
    out = capsys.readouterr().out
    assert out.startswith(start) and f"seed {r.seed}" in out and out.count("\n") == 1


@pytest.mark.parametrize("check", [check_lr_schedule, check_clip_coef])
def test_same_seed_same_settings_and_bad_arguments(check):
    a = check(lr_schedule if check is check_lr_schedule else coef_right, seed=7, quiet=True)
    b = check(lr_schedule if check is check_lr_schedule else coef_right, seed=7, quiet=True)
    assert a.message == b.message
    with pytest.raises(TypeError):
        check(0.5)
    with pytest.raises(TypeError):
        check(coef_right, seed=-1)


def test_records_for_grading(tmp_path, monkeypatch):
    import json
    log = tmp_path / "log.jsonl"
    from gpullm_lessons.classroom import grading
    monkeypatch.setenv(grading.LOG_ENV, str(log))
    check_clip_coef(coef_right, task="09.2 clip coefficient", quiet=True)
    check_lr_schedule(lr_mistake(linear=True), task="09.1 learning-rate schedule", quiet=True)
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(e["task"], e["status"]) for e in entries] == [("09.2 clip coefficient", "correct"),
                                                          ("09.1 learning-rate schedule", "wrong")]
