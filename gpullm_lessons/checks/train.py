"""Checkers for lesson 09 (the full training loop): the learning-rate schedule and the gradient-clipping coefficient.

They follow the conventions of ``gpullm_lessons.checks.backward`` (fresh random settings on every call, the seed printed, one
verdict printed: not attempted / error / wrong with a hint naming the mistake / correct; your exceptions reported,
never raised; ``task=`` for grading, ``quiet=``). Both functions return plain Python numbers, so the comparison is
a relative tolerance of 1e-6 (float64 arithmetic; float32 arithmetic passes too, see RTOL). The settings that decide
are fixed, not drawn (only the values are random): no warmup, a decay phase of a single step, steps past the end of
the run; a zero gradient, a norm exactly at max_norm, norms so small that the eps matters.

``check_lr_schedule(fn)`` (exercise 09.1), fn called as

    lr = fn(step, max_lr, warmup, total, min_lr)

step: 0-based step of a run of `total` steps; the expected values are ``gpullm_lessons.model.optim.lr_schedule``'s:
a linear warmup over steps 0 .. warmup-1 that already trains at step 0 and reaches max_lr at step warmup-1; then a
half cosine from max_lr at step `warmup` down to min_lr at the last step, total-1 (a decay phase of a single step,
total = warmup + 1, stays at max_lr there; warmup = 0 starts the cosine at step 0); min_lr after the run. Checked on
five runs (a typical one, no warmup, a single decay step, a short one, a long warmup), every step and four past
the end.

``check_clip_coef(fn)`` (exercise 09.2), fn called as

    coef = fn(grad_norm, max_norm)

the factor the gradient is multiplied by in global-norm clipping, as ``torch.nn.utils.clip_grad_norm_`` computes it
(with its eps of 1e-6 added to the norm), never above 1 (a gradient already inside the ball is left alone).
"""
from __future__ import annotations

import math

import numpy as np

from . import borrowed, opcheck
from . import verdict
from .verdict import CheckResult

# the course's own implementations of the tasks (checks/borrowed.py): an answer that is, wraps or calls one is not correct
OWN = {
    "lr_schedule": ("gpullm_lessons.model.optim:lr_schedule",),
    "clip_coef": ("gpullm_lessons.model.optim:clip_coefficient", "gpullm_lessons.model.optim:clip_grad_norm"),
}

__all__ = ["check_lr_schedule", "check_clip_coef", "clip_coef_expected", "RTOL", "CLIP_EPS"]

RTOL = 1e-6          # |yours - expected| <= RTOL * |expected| (+ a floor of RTOL * max_lr for the schedule)
CLIP_EPS = 1e-6      # torch.nn.utils.clip_grad_norm_'s eps


# ------------------------------------------------------------------------------------------------------------
# plumbing (the verdicts themselves: gpullm_lessons.checks.verdict)
# ------------------------------------------------------------------------------------------------------------
_FIELDS = {"dtype": "float64", "arrays": "numpy", "tol": RTOL}   # plain Python numbers, compared within RTOL


def _result(name, task, status, msg, hint=None, seed=None, dims=None, quiet=False, **extra):
    return verdict.verdict(name, task, status, msg, hint, quiet=quiet, seed=seed, dims=dims, **_FIELDS, **extra)


def _validate(name, fn, seed):
    return opcheck.learner_fn_and_seed(name, fn, seed, "settings")


def _zero_division_lead(name, args):
    """What a ZeroDivisionError in fn(*args) means, for the hint (None: nothing known)."""
    def lead(exc):
        if not isinstance(exc, ZeroDivisionError):
            return None
        if name == "clip_coef":
            return ("a gradient norm of 0 (every gradient zero) divides by zero: that is what the + 1e-6 in "
                    "max_norm / (grad_norm + 1e-6) is for")
        step, _, warmup, total, _ = args
        if warmup == 0:
            return ("warmup = 0 (no warmup) divides by zero: with no warmup steps the cosine starts at step 0, so the "
                    "warmup branch must not run (nor divide by warmup)")
        if total - 1 - warmup <= 0:
            return ("a decay phase of a single step (total = warmup + 1) divides by zero: total - 1 - warmup is 0 "
                    "there; this course's schedule keeps the ratio's denominator at least 1 (max(1, ...)), so that "
                    "step stays at max_lr")
        return None
    return lead


def _call(name, fn, args, seed, what, task):
    """(value, None), or (None, an unrecorded CheckResult) for not attempted / error / not a number."""
    out, failed = verdict.call_learner(name, fn, args, context=f"called as {what} (seed {seed})",
                                       lead=_zero_division_lead(name, args), task=task, seed=seed, **_FIELDS)
    if failed is not None:
        return None, failed
    try:
        value = float(out)
        if isinstance(out, (bool, np.bool_)) or np.ndim(out) != 0:
            raise TypeError
    except (TypeError, ValueError):
        msg = f"{name}: wrong - your function returned {type(out).__name__} {out!r:.60}, not a number"
        hint = (f"return a float (called as {what}; seed {seed})" if out is not None else
                f"your function returns None: a `return` is missing (called as {what}; seed {seed})")
        return None, verdict.build_result("wrong", msg, hint, name=name, task=task, seed=seed, **_FIELDS)
    return value, None


def _close(a, b, floor=0.0):
    return bool(np.isfinite(a)) and abs(a - b) <= RTOL * abs(b) + floor


# ------------------------------------------------------------------------------------------------------------
# 09.1 the learning-rate schedule
# ------------------------------------------------------------------------------------------------------------
def _lr_variant(step, max_lr, warmup, total, min_lr, **kind):
    """optim.lr_schedule (no keywords) or one common mistake; nan where the mistake would divide by zero."""
    try:
        return _lr_variant_raw(step, max_lr, warmup, total, min_lr, **kind)
    except ZeroDivisionError:
        return math.nan


def _lr_variant_raw(step, max_lr, warmup, total, min_lr, *, warm="ref", span="ref", shape="cos", floor=True,
                    hold=True):
    in_warmup = step <= warmup if warm == "le" else step < warmup
    if in_warmup:
        if warm == "zero":                      # starts at 0
            return max_lr * step / warmup
        if warm == "plus1":
            return max_lr * (step + 1) / (warmup + 1)
        return max_lr * (step + 1) / warmup
    start, decay = {"ref": (warmup, total - 1 - warmup), "total": (warmup, total), "total-1": (warmup, total - 1),
                    "from0": (0, total), "from0-1": (0, total - 1), "total-warmup": (warmup, total - warmup),
                    "short-min": (warmup, total - 1 - warmup)}[span]
    if span == "short-min" and decay <= 0:
        ratio = 1.0                             # a one-step decay phase sent straight to min_lr
    else:
        ratio = (step - start) / max(1, decay)
    if hold:
        ratio = min(1.0, ratio)
    coeff = 0.5 * (1.0 + math.cos(math.pi * ratio)) if shape == "cos" else 1.0 - ratio
    low = min_lr if floor else 0.0
    return low + coeff * (max_lr - low)


# optim.lr_schedule's decay phase, as the hints write it
_COSINE = "min_lr + 0.5 * (1 + cos(pi * r)) * (max_lr - min_lr)"
_DECAY_RATIO = "r = (step - warmup) / (total - 1 - warmup)"

_LR_MISTAKES = (
    (dict(warm="zero"), "the warmup is off by one: it starts at 0 (max_lr * step / warmup), so step 0 trains with "
     "lr 0 and max_lr is reached one step late; this course (optim.lr_schedule) uses max_lr * (step + 1) / warmup"),
    (dict(warm="plus1"), "the warmup divides by warmup + 1: use max_lr * (step + 1) / warmup, which reaches max_lr "
     "at the last warmup step (step = warmup - 1)"),
    (dict(warm="le"), "the warmup runs one step too long (step <= warmup): at step = warmup the cosine starts, "
     "at max_lr; the warmup is steps 0 .. warmup-1 (step < warmup)"),
    (dict(floor=False), "no floor at min_lr: your cosine decays to 0; "
     f"it must go from max_lr down to min_lr: {_COSINE}"),
    (dict(hold=False), "after the run (step >= total) the cosine climbs back up: hold the decay ratio at 1 "
     "(r = min(1, ...)) so that the learning rate stays at min_lr"),
    (dict(span="total"), "the cosine runs over the wrong span: total steps instead of the decay phase's "
     f"total - 1 - warmup; {_DECAY_RATIO} goes from 0 at the end of the warmup to 1 at the last step (total - 1)"),
    (dict(span="total-1"), "the cosine runs over the wrong span: total - 1 steps instead of the decay phase's "
     f"total - 1 - warmup; {_DECAY_RATIO}"),
    (dict(span="from0"), "the cosine runs over the wrong span: over the whole run from step 0 (r = step / total) "
     f"instead of the decay phase; {_DECAY_RATIO} is 0 at the end of the warmup"),
    (dict(span="from0-1"), "the cosine runs over the wrong span: from step 0 (r = step / (total - 1)) instead of "
     f"the decay phase; {_DECAY_RATIO} is 0 at the end of the warmup"),
    (dict(span="total-warmup"), "the cosine ends one step late: it reaches min_lr at step total, one past the last "
     "step (total - 1); divide by total - 1 - warmup, not total - warmup"),
    (dict(span="short-min"), "a decay phase of a single step (total = warmup + 1) went straight to min_lr: the "
     "course's schedule keeps the ratio's denominator at least 1, so the decay starts at max_lr at step = warmup "
     "as in every other run (and reaches min_lr only after the run)"),
    (dict(shape="linear"), f"linear decay instead of cosine: the decay phase is {_COSINE}, slow at both ends, not a "
     "straight line"),
)


_RUN_KINDS = ("typical", "no-warmup", "one-decay-step", "short", "long-warmup")
_RUN_NAMES = {"typical": "a typical run", "no-warmup": "no warmup", "one-decay-step": "a decay phase of one step",
              "short": "a short run", "long-warmup": "a long warmup"}


def _lr_settings(rng):
    """Five runs, their kinds fixed (the values drawn): a typical one, no warmup, a decay phase of a single step,
    a short one with a short warmup, one with a long warmup."""
    out = []
    for kind in _RUN_KINDS:
        max_lr = float(10 ** rng.uniform(-4, -2.3))
        if kind == "typical":
            warmup = int(rng.integers(5, 40))
            total = warmup + int(rng.integers(50, 400))
        elif kind == "no-warmup":
            warmup = 0
            total = int(rng.integers(6, 20))
        elif kind == "one-decay-step":
            warmup = int(rng.integers(2, 7))
            total = warmup + 1
        elif kind == "short":
            warmup = int(rng.integers(1, 4))
            total = warmup + int(rng.integers(6, 15))
        else:
            warmup = int(rng.integers(20, 80))
            total = warmup + int(rng.integers(10, 60))
        min_lr = max_lr * float(rng.uniform(0.05, 0.3))
        out.append((max_lr, warmup, total, min_lr))
    return out


def _phase(step, warmup, total):
    return "warmup" if step < warmup else ("decay" if step < total else "after the run")


def check_lr_schedule(fn, seed=None, task=None, quiet=False) -> "CheckResult":
    """Check fn(step, max_lr, warmup, total, min_lr) -> the learning rate at 0-based `step` (see the module
    docstring) against optim.lr_schedule on five runs (a typical one, no warmup, a decay phase of a single step, a
    short one, a long warmup: every step, and four past the end). seed: None for
    fresh settings, or the seed a failed check printed. task: label for grading. quiet: do not print.
    Returns a checks.CheckResult (truthy when correct); errors raised by fn are reported, never raised."""
    from ..model.optim import lr_schedule
    name = "lr_schedule"
    seed = _validate(name, fn, seed)
    taken = borrowed.borrowed_verdict(name, [fn], OWN[name], task=task, seed=seed, quiet=quiet,
                                      check="check_lr_schedule")
    if taken is not None:
        return taken
    rng = np.random.default_rng(seed)
    runs = _lr_settings(rng)
    done = []                      # per run that ran: (settings, steps, ours, expected)
    for run, (max_lr, warmup, total, min_lr) in enumerate(runs):
        dims = {"max_lr": max_lr, "warmup": warmup, "total": total, "min_lr": min_lr, "run": _RUN_KINDS[run]}
        steps = list(range(total + 4))
        ours, expected = [], [lr_schedule(s, max_lr, warmup, total, min_lr) for s in steps]
        early = None
        for s in steps:
            what = f"fn({s}, {max_lr:.4g}, {warmup}, {total}, {min_lr:.4g}) ({_RUN_NAMES[_RUN_KINDS[run]]})"
            value, early = _call(name, fn, (s, max_lr, warmup, total, min_lr), seed, what, task)
            if early is not None:
                break
            ours.append(value)
        if early is not None:
            if any(not all(_close(a, b, RTOL * m) for a, b in zip(o, e)) for (m, *_), _, o, e in done):
                break                      # a wrong value came before the error: report that
            early.dims = dims
            return verdict.record(early, quiet=quiet)
        done.append(((max_lr, warmup, total, min_lr), steps, ours, expected))
    max_rel = 0.0
    for run, ((max_lr, warmup, total, min_lr), steps, ours, expected) in enumerate(done):
        dims = {"max_lr": max_lr, "warmup": warmup, "total": total, "min_lr": min_lr, "run": _RUN_KINDS[run]}
        floor = RTOL * max_lr
        bad = [i for i, (a, b) in enumerate(zip(ours, expected)) if not _close(a, b, floor)]
        if bad:
            s = steps[bad[0]]
            hint = None
            for kwargs, text in _LR_MISTAKES:   # the mistake that explains every run that ran
                if all(_close(a, _lr_variant(t, *st[:3], st[3], **kwargs), RTOL * st[0])
                       for st, sts, o, _ in done for t, a in zip(sts, o)):
                    hint = text
                    break
            if hint is None:
                phase = _phase(s, warmup, total)
                hint = {"warmup": "the warmup is wrong: steps 0 .. warmup-1 get max_lr * (step + 1) / warmup",
                        "decay": f"the decay phase is wrong: {_COSINE} with "
                                 "r = (step - warmup) / max(1, total - 1 - warmup)",
                        "after the run": "after the last step (step >= total) the learning rate must stay at "
                                         "min_lr"}[phase]
            msg = (f"{name}: wrong - at step {s} ({_phase(s, warmup, total)}) of run {run + 1} of {len(runs)}, "
                   f"{_RUN_NAMES[_RUN_KINDS[run]]} (max_lr {max_lr:.4g}, warmup {warmup}, total {total}, min_lr "
                   f"{min_lr:.4g}): yours {ours[bad[0]]:.9g}, expected {expected[bad[0]]:.9g} "
                   f"({len(bad)} of {len(steps)} steps wrong; seed {seed})")
            return _result(name, task, "wrong", msg, hint=hint, seed=seed, dims=dims, quiet=quiet,
                           first_bad=(s,), ours=ours[bad[0]], expected=expected[bad[0]])
        max_rel = max(max_rel, max(abs(a - b) / abs(b) for a, b in zip(ours, expected)))
    desc = ", ".join(f"warmup {w}/total {t}" for _, w, t, _ in runs)
    msg = (f"{name}: correct (every step of {len(runs)} runs ({desc}) and 4 steps past each end match "
           f"optim.lr_schedule, "
           f"max rel err {max_rel:.2g}; seed {seed})")
    return _result(name, task, "correct", msg, seed=seed, max_rel=max_rel, quiet=quiet,
                   dims={"runs": [dict(max_lr=m, warmup=w, total=t, min_lr=n) for m, w, t, n in runs]})


# ------------------------------------------------------------------------------------------------------------
# 09.2 the clipping coefficient
# ------------------------------------------------------------------------------------------------------------
def clip_coef_expected(grad_norm: float, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s factor: max_norm / (grad_norm + 1e-6), clamped at 1."""
    return min(1.0, max_norm / (grad_norm + CLIP_EPS))


def _clip_variant(norm, max_norm, kind):
    if kind == "no-eps":
        return min(1.0, max_norm / norm) if norm > 0 else 1.0
    if kind == "always":
        return max_norm / (norm + CLIP_EPS)
    if kind == "clipped-norm":
        return norm * clip_coef_expected(norm, max_norm)
    if kind == "min-norm":
        return min(norm, max_norm)
    if kind == "inverted":
        return max(1.0, (norm + CLIP_EPS) / max_norm)
    if kind == "inverted-raw":
        return (norm + CLIP_EPS) / max_norm
    if kind == "cmp-norm":
        return 1.0 if norm <= max_norm else max_norm / (norm + CLIP_EPS)
    if kind == "unit-max":
        return min(1.0, 1.0 / (norm + CLIP_EPS))
    raise ValueError(kind)


_CLIP_MISTAKES = (
    ("always", "you also scale gradients whose norm is below max_norm (the coefficient comes out above 1): clip "
     "only when max_norm / (grad_norm + 1e-6) < 1, else return 1.0"),
    ("clipped-norm", "you returned the clipped norm (grad_norm * coef, about min(grad_norm, max_norm)); return the "
     "coefficient itself, the factor every gradient is multiplied by"),
    ("min-norm", "you returned min(grad_norm, max_norm), the norm after clipping; return the factor "
     "max_norm / (grad_norm + 1e-6) (or 1.0 when that is not below 1)"),
    ("inverted", "the ratio is upside down: the factor is max_norm / (grad_norm + 1e-6), at most 1"),
    ("inverted-raw", "the ratio is upside down: the factor is max_norm / (grad_norm + 1e-6), at most 1"),
    ("cmp-norm", "you compare grad_norm with max_norm instead of the coefficient with 1: at grad_norm = max_norm "
     "(and just above it) torch still scales, by max_norm / (grad_norm + 1e-6), which is below 1"),
    ("unit-max", "max_norm is not used (taken as 1.0): the coefficient is max_norm / (grad_norm + 1e-6), capped "
     "at 1"),
    ("no-eps", "the eps is missing: torch computes max_norm / (grad_norm + 1e-6); without the + 1e-6 small norms "
     "give a different factor, and a zero gradient divides by zero"),
)


def _clip_cases(rng):
    """(grad_norm, max_norm) pairs, their kinds fixed: far above, just above, below, equal, for an ordinary max_norm
    and a large one; tiny norms (where the eps shows), tiny and equal; zero."""
    max_norm = float(rng.uniform(0.5, 2.0))
    big_max = float(rng.uniform(3.0, 8.0))
    tiny_max = float(10 ** rng.uniform(-5.5, -4.5))
    cases = [(max_norm * float(rng.uniform(3, 50)), max_norm),            # far above: clipped
             (max_norm * float(1 + rng.uniform(0.01, 0.2)), max_norm),    # just above
             (max_norm * float(rng.uniform(0.1, 0.9)), max_norm),         # below: left alone
             (max_norm, max_norm),                                        # equal: coef just below 1 (the eps)
             (big_max * float(rng.uniform(1.5, 4)), big_max),             # another max_norm, above
             (big_max * float(rng.uniform(0.2, 0.9)), big_max),           # and below
             (tiny_max * float(rng.uniform(2, 10)), tiny_max),            # tiny norms: the eps changes the factor
             (tiny_max * float(rng.uniform(0.1, 0.5)), tiny_max),         # tiny and below
             (tiny_max, tiny_max),                                        # tiny and equal: coef well below 1
             (0.0, max_norm)]                                             # no gradient at all
    return cases


def check_clip_coef(fn, seed=None, task=None, quiet=False) -> "CheckResult":
    """Check fn(grad_norm, max_norm) -> the clipping factor (see the module docstring) against
    min(1, max_norm / (grad_norm + 1e-6)) on random norms above, at, below max_norm, tiny ones and zero.
    seed: None for fresh settings, or the seed a failed check printed. task: label for grading. quiet: do not
    print. Returns a checks.CheckResult (truthy when correct); errors raised by fn are reported, never raised."""
    name = "clip_coef"
    seed = _validate(name, fn, seed)
    taken = borrowed.borrowed_verdict(name, [fn], OWN[name], task=task, seed=seed, quiet=quiet,
                                      check="check_clip_coef")
    if taken is not None:
        return taken
    rng = np.random.default_rng(seed)
    cases = _clip_cases(rng)
    ours = []
    for norm, max_norm in cases:
        value, early = _call(name, fn, (norm, max_norm), seed, f"fn({norm:.6g}, {max_norm:.6g})", task)
        if early is not None:
            done = cases[:len(ours)]
            if early.status == "error" and any(not _close(a, clip_coef_expected(n, m))
                                               for a, (n, m) in zip(ours, done)):
                cases = done                    # a wrong value came before the error: report that
                break
            early.dims = {"grad_norm": norm, "max_norm": max_norm}
            return verdict.record(early, quiet=quiet)
        ours.append(value)
    expected = [clip_coef_expected(n, m) for n, m in cases]
    bad = [i for i, (a, b) in enumerate(zip(ours, expected)) if not _close(a, b)]
    if bad:
        i = bad[0]
        norm, max_norm = cases[i]
        hint = None
        for kind, text in _CLIP_MISTAKES:
            mis = [_clip_variant(n, m, kind) for n, m in cases]
            if all(_close(a, b) for a, b in zip(ours, mis)):
                hint = text
                break
        if hint is None:
            hint = ("the factor is max_norm / (grad_norm + 1e-6) when that is below 1, else exactly 1.0 (as "
                    "torch.nn.utils.clip_grad_norm_)")
        where = "above" if norm > max_norm else ("equal to" if norm == max_norm else "below")
        msg = (f"{name}: wrong - grad_norm {norm:.6g} ({where} max_norm {max_norm:.6g}): yours {ours[i]:.9g}, "
               f"expected {expected[i]:.9g} ({len(bad)} of {len(cases)} cases wrong; seed {seed})")
        return _result(name, task, "wrong", msg, hint=hint, seed=seed, quiet=quiet,
                       dims={"grad_norm": norm, "max_norm": max_norm}, ours=ours[i], expected=expected[i])
    max_rel = max(abs(a - b) / abs(b) for a, b in zip(ours, expected))
    msg = (f"{name}: correct ({len(cases)} cases: norms above, at and below two max_norms, tiny ones and zero; "
           f"max rel err {max_rel:.2g}; seed {seed})")
    return _result(name, task, "correct", msg, seed=seed, max_rel=max_rel, quiet=quiet,
                   dims={"cases": len(cases)})
