"""Checkers for lesson 07 (mixed precision): your float32 -> bfloat16 rounding, and your loss-scaler update rule.

They follow the conventions of ``gpullm_lessons.checks``: fresh random inputs on every call (``seed=`` repeats a
case), one verdict printed (not attempted / wrong with where and a hint / correct), errors raised by your function
reported and never raised, ``task=`` for grading, ``quiet=True`` to print nothing. Both return a
``checks.CheckResult`` (truthy when correct).

check_bf16_rne(fn)
    fn(x) takes a float32 array (any shape) and returns the bfloat16 BITS as a uint16 array of the same shape,
    rounded to nearest, ties to even, NaN kept as the quiet NaN 0x7FC0 with its sign (= ml_dtypes.bfloat16's
    cast). Compared bit for bit with ``x.astype(ml_dtypes.bfloat16).view(np.uint16)`` on fresh random floats
    (every exponent, both signs, many exact ties) and on every special case: ties that round down and up, NaN
    with payloads and either sign, +-inf, the largest float32 (-> inf), values that round up to inf, subnormals,
    +-0.0. A wrong answer is compared with the usual mistakes: truncation, ties away from zero, ties toward zero,
    NaN turned into inf, NaN sign lost, NaN payload not quieted, subnormals flushed, the sign of -0.0 lost.

check_loss_scaler_update(fn)
    fn(scale, found_inf, clean_steps, growth_interval) -> (new_scale, new_clean_steps, skip): one step of
    ``precision.DynamicLossScaler.update`` (growth_factor 2, backoff_factor 0.5, min_scale 1) as a pure function.
    Scripted sequences of clean and overflowing steps (and random ones) are run through fn and through
    DynamicLossScaler side by side; the first step where they differ is reported, and the whole trajectory is
    first wrong step is explained (SCALER_HINTS): counter not reset on overflow, growing before the count is
    reached (every clean step), not skipping, skipping clean steps, growing one step late, counter not reset
    after growing, no floor at min_scale.
"""
from __future__ import annotations

import secrets

import numpy as np

from . import checks as _checks

__all__ = ["check_bf16_rne", "check_loss_scaler_update", "bf16_special_cases", "bf16_mistakes",
           "SCALER_HINTS"]


def _record(result, quiet):
    from . import grading
    grading.record(check=f"check_{result.name}", task=result.task, status=result.status,
                   message=result.message.splitlines()[0])
    if not quiet:
        print(result.message)
    return result


def _not_attempted(name, task, quiet):
    msg = f"{name}: not attempted (your function raised NotImplementedError)"
    return _record(_checks.CheckResult(name=name, task=task, status="not attempted", passed=False, message=msg,
                                       hint="replace the `raise NotImplementedError` with your code"), quiet)


def _error(name, task, quiet, exc, context, seed):
    first = " ".join(str(exc).split())
    first = first if len(first) <= 200 else first[:197] + "..."
    where = _checks._where_raised(exc)
    msg = f"{name}: error - your function raised {type(exc).__name__}" + (f": {first}" if first else "")
    hint = f"the error is in your code{' (at ' + where + ')' if where else ''}; {context}"
    return _record(_checks.CheckResult(name=name, task=task, status="error", passed=False, seed=seed,
                                       message=msg + "\n  hint: " + hint, hint=hint), quiet)


def _check_fn(checker, fn):
    if not callable(fn):
        raise TypeError(f"{checker}(fn): fn must be your function, got {type(fn).__name__} {fn!r:.60}: pass the "
                        f"function itself, without calling it")


# ================================================================================================================
# 07.1 float32 -> bfloat16 bits, round to nearest even
# ================================================================================================================
NAME_BF16 = "bf16_rne"


def bf16_special_cases() -> dict:
    """name -> float32 bit patterns (uint32) of the special cases every correct rounding must get right."""
    u = lambda *v: np.array(v, dtype=np.uint32)   # noqa: E731
    return {
        "a tie, kept part even: rounds down": u(0x3F808000, 0x40008000, 0xBF808000, 0x00008000, 0x7F008000),
        "a tie, kept part odd: rounds up": u(0x3F818000, 0x3F838000, 0xBF818000, 0x00018000, 0x7E7F8000),
        "just below a tie: rounds down": u(0x3F807FFF, 0x3F817FFF, 0xBF817FFF),
        "just above a tie: rounds up": u(0x3F808001, 0x3F818001, 0xBF808001),
        "exact bfloat16 values": u(0x3F800000, 0x40490000, 0xC2C80000, 0x00010000, 0x7F7F0000),
        "rounding carries into the exponent": u(0x3FFF8000, 0x3FFFFFFF, 0x407FC000, 0xBFFFFFFF),
        "the largest float32 rounds to inf": u(0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x7F7F8001),
        "infinity": u(0x7F800000, 0xFF800000),
        "NaN (payloads, both signs)": u(0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF, 0xFFFFFFFF,
                                        0x7F80FFFF, 0x7FA00000, 0xFF812345, 0x7FC08000),
        "subnormals": u(0x00000001, 0x00007FFF, 0x00008001, 0x0000C000, 0x00018000, 0x007FFFFF, 0x807FFFFF,
                        0x80008001, 0x00400000),
        "zeros": u(0x00000000, 0x80000000),
    }


def _fresh_bits(rng, n):
    """n float32 bit patterns: uniform over all 2^32 (every exponent, NaNs included), a third of them exact ties."""
    bits = rng.integers(0, 2 ** 32, size=n, dtype=np.uint64).astype(np.uint32)
    ties = rng.random(n) < 0.33
    bits[ties] = (bits[ties] & np.uint32(0xFFFF0000)) | np.uint32(0x8000)
    return bits


def _expected_bf16(x):
    import ml_dtypes
    with np.errstate(invalid="ignore", over="ignore"):
        return x.astype(ml_dtypes.bfloat16).view(np.uint16)


def _is_nan_bits(b):
    return (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)


def _rne_bits(b):
    """The integer rounding without the NaN test (computed in 64 bits, so nothing wraps)."""
    return ((b.astype(np.uint64) + 0x7FFF + ((b >> np.uint32(16)) & np.uint32(1))) >> 16).astype(np.uint16)


def bf16_mistakes() -> tuple:
    """(rounding, nan): two lists of (hint, fn); fn maps float32 bits (uint32) to the bf16 bits the mistake gives.
    `rounding` mistakes are judged on the non-NaN elements, `nan` mistakes on the NaNs."""
    U = np.uint32
    trunc = lambda b: (b >> U(16)).astype(np.uint16)                                        # noqa: E731
    rne = _rne_bits
    rounding = [
        ("truncation: you dropped the low 16 bits (round toward zero). Round to nearest: add 0x7FFF plus the "
         "lowest kept bit ((bits >> 16) & 1) before the shift", trunc),
        ("ties round away from zero (you added 0x8000): an exact tie (low 16 bits = 0x8000) must go to the EVEN "
         "neighbour: add 0x7FFF + ((bits >> 16) & 1)",
         lambda b: ((b.astype(np.uint64) + 0x8000) >> 16).astype(np.uint16)),
        ("ties round toward zero (you added 0x7FFF only): an exact tie must go to the EVEN neighbour, so add the "
         "lowest kept bit too: 0x7FFF + ((bits >> 16) & 1)",
         lambda b: ((b.astype(np.uint64) + 0x7FFF) >> 16).astype(np.uint16)),
        ("ties round to odd (you added 0x8000 - lowest kept bit, or flipped the parity test): the tie goes to "
         "the EVEN neighbour: add 0x7FFF + ((bits >> 16) & 1)",
         lambda b: ((b.astype(np.uint64) + 0x8000 - ((b >> U(16)) & U(1))) >> 16).astype(np.uint16)),
        ("subnormals were flushed to zero: bfloat16 keeps subnormals (exponent bits 0), and the same integer "
         "rounding works for them; do not special-case them",
         lambda b: np.where((b & U(0x7F800000)) == 0, (b >> U(16)) & U(0x8000), rne(b)).astype(np.uint16)),
        ("the sign of -0.0 was lost (or of a small negative that rounds to zero): keep bit 15 = the float32's "
         "bit 31", lambda b: np.where((rne(b) & np.uint16(0x7FFF)) == 0, np.uint16(0), rne(b)).astype(np.uint16)),
        ("the largest finite values were clamped instead of rounding to inf: a carry out of the mantissa into an "
         "all-ones exponent gives inf (0x7F80), as ml_dtypes does", lambda b: np.where(
             ((rne(b) & np.uint16(0x7FFF)) == 0x7F80) & ((b & U(0x7FFFFFFF)) != U(0x7F800000)),
             rne(b) - np.uint16(1), rne(b)).astype(np.uint16)),
    ]
    nan = [
        ("NaN turned into inf (or 0): adding 0x7FFF to a NaN's bits carries its payload away (0x7F800001 -> "
         "0x7F80 = inf; 0xFFFFFFFF wraps to 0). Test for NaN first (x != x, or (bits & 0x7FFFFFFF) > 0x7F800000) "
         "and return the quiet NaN ((bits >> 16) & 0x8000) | 0x7FC0", rne),
        ("NaN not special-cased (truncated): a NaN whose payload is only in the low 16 bits becomes inf "
         "(0x7F800001 -> 0x7F80). Return the quiet NaN ((bits >> 16) & 0x8000) | 0x7FC0 for every NaN", trunc),
        ("a NaN's sign was lost: NaN must become 0x7FC0 with the sign bit kept: ((bits >> 16) & 0x8000) | 0x7FC0",
         lambda b: np.full(b.shape, 0x7FC0, np.uint16)),
        ("NaN payload kept: ml_dtypes (and the GPU kernels) return the quiet NaN 0x7FC0 with the sign kept for "
         "every NaN, whatever its payload", lambda b: (trunc(b) | np.uint16(0x0040)).astype(np.uint16)),
    ]
    return rounding, nan


def _call_bf16(fn, x):
    before = x.copy()
    out = fn(x)
    if not np.array_equal(before.view(np.uint32), x.view(np.uint32)):
        return None, "your function changed its input x: return a new array, leave x as it is"
    if out is None:
        return None, "your function returned None: return the uint16 array of bfloat16 bits"
    out = np.asarray(out)
    if out.shape != x.shape:
        return None, f"the result has shape {out.shape}, x has {x.shape}: return one uint16 per element, same shape"
    if out.dtype != np.uint16:
        kind = ("the rounded values as floats" if np.issubdtype(out.dtype, np.floating) else
                f"dtype {out.dtype}")
        return None, (f"the result has dtype {out.dtype}: return the bfloat16 BITS as uint16 (you returned "
                      f"{kind}); e.g. (rounded >> 16).astype(np.uint16)")
    return out, None


def check_bf16_rne(fn, seed=None, n=200_000, task=None, quiet=False) -> "_checks.CheckResult":
    """Check fn(x float32 array) -> uint16 bfloat16 bits, round to nearest even, bit for bit against ml_dtypes
    (see the module docstring). seed: None for fresh inputs, or the seed a failed check printed. n: how many
    random floats. task: label for grading. quiet: do not print. Errors raised by fn are reported, never raised."""
    _check_fn("check_bf16_rne", fn)
    seed = secrets.randbelow(1_000_000) if seed is None else int(seed)
    rng = np.random.default_rng(seed)
    specials = bf16_special_cases()
    names = np.concatenate([[k] * len(v) for k, v in specials.items()])
    sbits = np.concatenate(list(specials.values()))
    rbits = _fresh_bits(rng, n)
    cases = [("special cases", sbits, names), ("random floats", rbits.reshape(-1, 100)
                                               if n % 100 == 0 else rbits, None)]
    base = dict(name=NAME_BF16, task=task, seed=seed, dtype="float32", arrays="numpy")
    for label, bits, kinds in cases:
        x = bits.view(np.float32)
        try:
            with np.errstate(all="ignore"):
                ours, problem = _call_bf16(fn, x)
        except NotImplementedError:
            return _not_attempted(NAME_BF16, task, quiet)
        except Exception as exc:   # the learner's error is reported, never raised
            return _error(NAME_BF16, task, quiet, exc, f"x was float32 {x.shape} ({label}; seed {seed})", seed)
        if problem:
            msg = f"{NAME_BF16}: wrong - {problem}"
            return _record(_checks.CheckResult(status="wrong", passed=False, message=msg, hint=problem, **base),
                           quiet)
        want = _expected_bf16(x)
        bad = ours != want
        if not bad.any():
            continue
        flat_bad = np.flatnonzero(bad.reshape(-1))
        i = int(flat_bad[0])
        b = int(bits.reshape(-1)[i])
        o, e = int(ours.reshape(-1)[i]), int(want.reshape(-1)[i])
        what = f" ({kinds[i]})" if kinds is not None else ""
        hint = _bf16_hint(bits.reshape(-1), ours.reshape(-1), want.reshape(-1))
        msg = (f"{NAME_BF16}: wrong - {label}: {flat_bad.size} of {bad.size} wrong; first x = "
               f"{float(np.uint32(b).view(np.float32))!r} (bits 0x{b:08X}){what}: yours 0x{o:04X}, expected "
               f"0x{e:04X} (seed {seed})")
        return _record(_checks.CheckResult(status="wrong", passed=False, first_bad=(i,), ours=float(o),
                                           expected=float(e), hint=hint, message=msg + "\n  hint: " + hint,
                                           dims={"n": int(bad.size)}, **base), quiet)
    msg = (f"{NAME_BF16}: correct (bit-exact with ml_dtypes.bfloat16 on {sbits.size} special cases and {n:,} "
           f"random floats)")
    return _record(_checks.CheckResult(status="correct", passed=True, max_abs=0.0, max_rel=0.0, tol=0.0,
                                       message=msg, dims={"n": int(n + sbits.size)}, **base), quiet)


def _bf16_hint(bits, ours, want):
    """Hints for the wrong non-NaN elements and for the wrong NaNs, from the mistakes that match them."""
    bad = ours != want
    nan = _is_nan_bits(bits)
    rounding, nan_mistakes = bf16_mistakes()
    hints = []
    for domain, mistakes in ((~nan, rounding), (nan, nan_mistakes)):
        part = bad & domain
        if not part.any():
            continue
        with np.errstate(all="ignore"):
            made = [(hint, mistake(bits)) for hint, mistake in mistakes]
        # a mistake that gives exactly your bits on every element of the domain; else one that explains the
        # wrong elements only (two mistakes at once)
        found = next((h for h, m in made if np.array_equal(ours[domain], m[domain])), None) or \
            next((h for h, m in made if np.array_equal(ours[part], m[part])), None)
        if found:
            hints.append(found)
        else:
            hints.append("no common mistake matches the wrong NaNs: test for NaN first and return "
                         "((bits >> 16) & 0x8000) | 0x7FC0" if mistakes is nan_mistakes else
                         "no common mistake matches: compute in uint32 on x.view(np.uint32): (bits + 0x7FFF + "
                         "((bits >> 16) & 1)) >> 16, as uint16 (NaN handled first)")
    return ". Also: ".join(hints)


# ================================================================================================================
# 07.2 the loss-scaler update rule
# ================================================================================================================
NAME_SCALER = "loss_scaler_update"
MIN_SCALE = 1.0


SCALER_HINTS = {
    "no_skip": "an overflowing step was not skipped: when found_inf, return skip=True (the gradients hold inf/NaN; "
               "the optimizer must not see them)",
    "skip_clean": "a clean step was skipped: skip only when found_inf",
    "no_reset_inf": "on an overflow the clean-step counter must restart at 0: growth needs growth_interval clean "
                    "steps IN A ROW since the last overflow",
    "floor": "the scale fell below min_scale = 1: back off with max(scale * 0.5, 1.0)",
    "backoff": "on an overflow the scale is halved: max(scale * 0.5, 1.0)",
    "grow_every": "the scale grew on a clean step before the count reached growth_interval: count clean steps and "
                  "double the scale only when the count reaches growth_interval (then restart the count)",
    "late": "the scale grew one step late (or not at all): grow when the count REACHES growth_interval "
            "(clean_steps + 1 >= growth_interval, counting this step)",
    "no_reset_grow": "after growing, the counter must restart at 0 (the next growth needs another "
                     "growth_interval clean steps)",
    "count": "a clean step adds 1 to clean_steps (and the scale stays, unless the count reaches growth_interval)",
}


def _scaler_hint(state, yours, expected):
    """The hint for the first wrong step, from what it was called with, what it returned and what was due."""
    scale, found, clean, interval = state
    ys, yc, yk = yours
    es, ec, ek = expected
    if found:
        if not yk:
            return SCALER_HINTS["no_skip"]
        if yc != 0:
            return SCALER_HINTS["no_reset_inf"]
        return SCALER_HINTS["floor"] if ys < es else SCALER_HINTS["backoff"]
    if yk:
        return SCALER_HINTS["skip_clean"]
    if ys > es:
        return SCALER_HINTS["grow_every"]
    if ys < es:
        return SCALER_HINTS["late"]
    if es != scale and yc != 0:
        return SCALER_HINTS["no_reset_grow"]
    return SCALER_HINTS["count"]


def _scripts(rng):
    """Sequences of (init scale, growth_interval, [found_inf per step]): scripted, then random."""
    F, T = False, True
    scripts = [
        (1024.0, 3, [T, F, T, F, F, F, F, F, F, F]),          # skip and back off; grow after 3 in a row
        (8.0, 2, [F, F, F, T, F, F, F, F]),                   # growth, overflow, count restarts
        (16.0, 4, [F, F, F, T, F, F, F, F, F, F, F, F]),      # overflow just before growth: count must restart
        (4.0, 3, [T, T, T, T, F, F, F]),                      # down to min_scale 1 and no further
        (2.0 ** 16, 1, [F, F, T, F, T, T, F]),                # interval 1: grow on every clean step
    ]
    for _ in range(6):
        interval = int(rng.integers(1, 6))
        seq = list(rng.random(int(rng.integers(12, 30))) < rng.uniform(0.1, 0.5))
        scripts.append((float(2.0 ** int(rng.integers(0, 20))), interval, seq))
    return scripts


def _reference_run(scale, interval, seq):
    from .precision import DynamicLossScaler
    s = DynamicLossScaler(init_scale=scale, growth_factor=2.0, backoff_factor=0.5, growth_interval=interval,
                          min_scale=MIN_SCALE)
    out = []
    for found in seq:
        skip = s.update(found)
        out.append((s.scale, s.clean_steps, skip))
    return out


def check_loss_scaler_update(fn, seed=None, task=None, quiet=False) -> "_checks.CheckResult":
    """Check fn(scale, found_inf, clean_steps, growth_interval) -> (new_scale, new_clean_steps, skip) against
    DynamicLossScaler.update (growth_factor 2, backoff_factor 0.5, min_scale 1) on scripted and random sequences
    (see the module docstring). Errors raised by fn are reported, never raised."""
    _check_fn("check_loss_scaler_update", fn)
    seed = secrets.randbelow(1_000_000) if seed is None else int(seed)
    scripts = _scripts(np.random.default_rng(seed))
    base = dict(name=NAME_SCALER, task=task, seed=seed)
    for k, (scale0, interval, seq) in enumerate(scripts):
        want = _reference_run(scale0, interval, seq)
        scale, clean = scale0, 0
        for step, found in enumerate(seq):
            state = f"scale={scale:g}, found_inf={found}, clean_steps={clean}, growth_interval={interval}"
            try:
                got = fn(scale, bool(found), clean, interval)
            except NotImplementedError:
                return _not_attempted(NAME_SCALER, task, quiet)
            except Exception as exc:   # the learner's error is reported, never raised
                return _error(NAME_SCALER, task, quiet, exc, f"it was called with {state}", seed)
            if not (isinstance(got, tuple) and len(got) == 3):
                hint = "return a tuple of three: (new_scale, new_clean_steps, skip)"
                msg = f"{NAME_SCALER}: wrong - with {state} your function returned {got!r:.80}"
                return _record(_checks.CheckResult(status="wrong", passed=False, hint=hint,
                                                   message=msg + "\n  hint: " + hint, **base), quiet)
            new_scale, new_clean, skip = got
            exp = want[step]
            if (float(new_scale), int(new_clean), bool(skip)) != (exp[0], exp[1], exp[2]):
                history = "".join("I" if f else "." for f in seq[:step + 1])
                hint = _scaler_hint((scale, bool(found), clean, interval),
                                    (float(new_scale), int(new_clean), bool(skip)), exp)
                msg = (f"{NAME_SCALER}: wrong - sequence {k + 1} (steps so far: {history}, I = overflow), step "
                       f"{step + 1}: called with {state}: yours (scale={float(new_scale):g}, clean_steps="
                       f"{new_clean}, skip={bool(skip)}), expected (scale={exp[0]:g}, clean_steps={exp[1]}, "
                       f"skip={exp[2]}) (seed {seed})")
                return _record(_checks.CheckResult(status="wrong", passed=False, first_bad=(k, step), hint=hint,
                                                   message=msg + "\n  hint: " + hint, **base), quiet)
            scale, clean = float(new_scale), int(new_clean)
    steps = sum(len(s[2]) for s in scripts)
    msg = f"{NAME_SCALER}: correct ({len(scripts)} sequences, {steps} steps, same as DynamicLossScaler)"
    return _record(_checks.CheckResult(status="correct", passed=True, message=msg, **base), quiet)

