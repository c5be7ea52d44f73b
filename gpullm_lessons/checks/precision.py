"""Checkers for lesson 07 (mixed precision): your float32 -> bfloat16 rounding, and your loss-scaler update rule.

They follow the conventions of ``gpullm_lessons.checks.backward``: fresh random inputs on every call (``seed=`` repeats a
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

from ..runtime import arrays as _arrays
from . import borrowed, opcheck
from .. import device as _device
from . import verdict
from .verdict import CheckResult

# the course's own implementations of the tasks (checks/borrowed.py): an answer that is, wraps or calls one is not correct
_BF16_OWN = (
    "gpullm_lessons.reference.rounding:f32_to_bf16_bits",
    "gpullm_lessons.kernels.numba.convert:f32_to_bf16",
    "gpullm_lessons.kernels.numba.convert:f32_to_bf16_v1",
)
OWN = {"bf16_rne": _BF16_OWN, "loss_scaler_update": ("gpullm_lessons.model.precision:DynamicLossScaler",),
       "bf16_kernel": _BF16_OWN}

__all__ = ["check_bf16_rne", "check_loss_scaler_update", "check_bf16_kernel", "check_bf16_hip", "check_unscale_hip",
           "bf16_special_cases", "bf16_mistakes", "SCALER_HINTS"]


def _record(result, quiet):
    return verdict.record(result, quiet=quiet)


def _not_attempted(name, task, quiet):
    return _record(verdict.not_attempted(name, task=task), quiet)


def _error(name, task, quiet, exc, context, seed):
    return _record(verdict.raised(name, exc, context, task=task, seed=seed), quiet)


def stub_kernel(fn):
    """See checks.unfinished_kernel (kept under this name for the precision and optimizer checkers)."""
    return opcheck.unfinished_kernel(fn)


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
        ("truncation: you dropped the low 16 bits (round toward zero). Round to nearest instead: the 16 bits you "
         "drop decide (below half: down, above half: up, exactly half: to the even neighbour)", trunc),
        ("ties round away from zero (you added 0x8000): an exact tie (low 16 bits = 0x8000) must go to the EVEN "
         "neighbour, the one whose lowest kept bit is 0",
         lambda b: ((b.astype(np.uint64) + 0x8000) >> 16).astype(np.uint16)),
        ("ties round toward zero (you added 0x7FFF only): an exact tie must go to the EVEN neighbour, so it "
         "rounds up exactly when the lowest kept bit is 1",
         lambda b: ((b.astype(np.uint64) + 0x7FFF) >> 16).astype(np.uint16)),
        ("ties round to odd (you added 0x8000 - lowest kept bit, or flipped the parity test): the tie goes to "
         "the EVEN neighbour, the one whose lowest kept bit is 0",
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
         "0x7F80 = inf; 0xFFFFFFFF wraps to 0). Test for NaN first (exponent bits all ones and a nonzero "
         "mantissa) and return the quiet NaN 0x7FC0 with the sign bit kept", rne),
        ("NaN not special-cased (truncated): a NaN whose payload is only in the low 16 bits becomes inf "
         "(0x7F800001 -> 0x7F80). Return the quiet NaN 0x7FC0 with the sign bit kept for every NaN", trunc),
        ("a NaN's sign was lost: NaN must become the quiet NaN 0x7FC0 with the float32's sign bit as bit 15",
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


def check_bf16_rne(fn, seed=None, n=200_000, task=None, quiet=False) -> "CheckResult":
    """Check fn(x float32 array) -> uint16 bfloat16 bits, round to nearest even, bit for bit against ml_dtypes
    (see the module docstring). seed: None for fresh inputs, or the seed a failed check printed. n: how many
    random floats. task: label for grading. quiet: do not print. Errors raised by fn are reported, never raised."""
    _check_fn("check_bf16_rne", fn)
    seed = secrets.randbelow(1_000_000) if seed is None else int(seed)
    taken = borrowed.borrowed_verdict(NAME_BF16, [fn], OWN[NAME_BF16], task=task, seed=seed, quiet=quiet,
                                      check="check_bf16_rne")
    if taken is not None:
        return taken
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
            return _record(CheckResult(status="wrong", passed=False, message=msg, hint=problem, **base),
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
        return _record(verdict.build_result("wrong", msg, hint, first_bad=(i,), ours=float(o),
                                            expected=float(e), dims={"n": int(bad.size)}, **base), quiet)
    msg = (f"{NAME_BF16}: correct (bit-exact with ml_dtypes.bfloat16 on {sbits.size} special cases and {n:,} "
           f"random floats)")
    return _record(CheckResult(status="correct", passed=True, max_abs=0.0, max_rel=0.0, tol=0.0,
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
            hints.append("no common mistake matches the wrong NaNs: test for NaN first and return the quiet NaN "
                         "0x7FC0 with the sign bit kept" if mistakes is nan_mistakes else
                         "no common mistake matches: work on the float32 bits as unsigned integers; the 16 bits "
                         "you drop decide (below half: down, above half: up, exactly half: to the even "
                         "neighbour); NaN first")
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
    "floor": "the scale fell below min_scale = 1: halve it on an overflow, but never below 1",
    "backoff": "on an overflow the scale is halved (never below min_scale = 1)",
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
    from ..model.precision import DynamicLossScaler
    s = DynamicLossScaler(init_scale=scale, growth_factor=2.0, backoff_factor=0.5, growth_interval=interval,
                          min_scale=MIN_SCALE)
    out = []
    for found in seq:
        skip = s.update(found)
        out.append((s.scale, s.clean_steps, skip))
    return out


def check_loss_scaler_update(fn, seed=None, task=None, quiet=False) -> "CheckResult":
    """Check fn(scale, found_inf, clean_steps, growth_interval) -> (new_scale, new_clean_steps, skip) against
    DynamicLossScaler.update (growth_factor 2, backoff_factor 0.5, min_scale 1) on scripted and random sequences
    (see the module docstring). Errors raised by fn are reported, never raised."""
    _check_fn("check_loss_scaler_update", fn)
    seed = secrets.randbelow(1_000_000) if seed is None else int(seed)
    taken = borrowed.borrowed_verdict(NAME_SCALER, [fn], OWN[NAME_SCALER], task=task, seed=seed, quiet=quiet,
                                      check="check_loss_scaler_update")
    if taken is not None:
        return taken
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
                return _record(verdict.build_result("wrong", msg, hint, **base), quiet)
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
                return _record(verdict.build_result("wrong", msg, hint, first_bad=(k, step), **base), quiet)
            scale, clean = float(new_scale), int(new_clean)
    steps = sum(len(s[2]) for s in scripts)
    msg = f"{NAME_SCALER}: correct ({len(scripts)} sequences, {steps} steps, same as DynamicLossScaler)"
    return _record(CheckResult(status="correct", passed=True, message=msg, **base), quiet)



# ================================================================================================================
# Kernels with bf16 output: 07.4 (Numba, grid-stride) and 07.3 (HIP, float4 loads, scalar head and tail)
# ================================================================================================================
NAME_BF16_KERNEL = "bf16_kernel"
NAME_BF16_HIP = "bf16_hip"
BF16_HIP_ENTRY = "f32_to_bf16_vec4"
OUT_POISON = 0x7FD5       # what an output holds before the call: a bf16 NaN pattern no correct rounding produces
HIP_THREADS, HIP_MAX_BLOCKS = 256, 64   # how the HIP checkers launch: at most 64 blocks of 256 threads


def _kernel_bits(rng, n, specials=True):
    """n float32 bit patterns for a kernel case: fresh random ones (a third exact ties, NaNs included), with the
    special cases written over the first and the last elements; never a pattern whose truncation is the poison."""
    bits = _fresh_bits(rng, n)
    if specials and n:
        s = np.concatenate(list(bf16_special_cases().values()))
        k = min(n, s.size)
        bits[:k // 2 + k % 2] = s[:k // 2 + k % 2]
        if k // 2:
            bits[n - k // 2:] = s[s.size - k // 2:]
    clash = (bits >> np.uint32(16)) & np.uint32(0x7FFF) == np.uint32(OUT_POISON & 0x7FFF)
    bits[clash] ^= np.uint32(0x00010000)
    return bits


def _bf16_out_hint(bits, ours, want, grid_note=""):
    """Where and why a kernel's bf16 output is wrong: elements never written (which ones: the tail, past the grid,
    the head), else the rounding / NaN mistake that matches (check_bf16_rne's table)."""
    bad = ours != want
    untouched = bad & (ours == np.uint16(OUT_POISON))
    n = bits.size
    if untouched.any() and untouched.sum() * 2 >= bad.sum():
        idx = np.flatnonzero(untouched)
        if idx.size == n:
            return "out was never written: write out[i] for every element i < n"
        if idx[0] > 0 and idx.size == n - idx[0]:
            return (f"every element from index {idx[0]} on was never written{grid_note}: the grid is capped, so each "
                    f"thread must loop (a grid-stride loop) until it has covered all n = {n} elements")
        return f"{idx.size} of {n} elements were never written, first at index {idx[0]}{grid_note}"
    return _bf16_hint(bits, ours, want)


def check_bf16_kernel(fn, arrays="numba", size=None, seed=None, task=None, quiet=False) -> "CheckResult":
    """Check a launcher fn(x, out): x float32 (n,) and out uint16 (n,) on the backend `arrays` ("numba": Numba device
    arrays, the default; "numpy"; "cupy"); fn must write out[i] = the bfloat16 bits of x[i], round to nearest even,
    NaN -> the quiet NaN 0x7FC0 with its sign, bit for bit as ml_dtypes (check_bf16_rne's rule).

    fn is called several times: the special cases (ties both ways, NaN payloads, inf, the largest float32,
    subnormals, -0.0), n = 1, a partial last block of random floats, and more elements than the capped grid of the
    exercise's launcher covers (MAX_BLOCKS x THREADS: 2 x 32 in the simulator; 4096 x 256 on a GPU, where this
    case has over a million elements; size="small" leaves it out, "large" forces it). out starts as 0x7FD5 in every
    element, so an element never written shows. Errors raised by fn are reported, never raised."""
    name = NAME_BF16_KERNEL
    seed = opcheck.learner_fn_and_seed(name, fn, seed)
    taken = borrowed.borrowed_verdict(NAME_BF16_KERNEL, [fn], OWN[NAME_BF16_KERNEL], task=task, seed=seed, quiet=quiet,
                                      check="check_bf16_kernel")
    if taken is not None:
        return taken
    if type(fn).__name__ in ("CUDADispatcher", "FakeCUDAKernel"):
        raise TypeError(f"check_{name}(fn): fn is a Numba kernel; pass the launcher that calls it, fn(x, out)")
    if arrays == "cupy" and not _device.has_gpu():
        return verdict.skipped(name, task, quiet=quiet, arrays=arrays)
    _arrays.require(arrays)
    if size not in (None, "small", "large"):
        raise ValueError(f"size={size!r}: use 'small', 'large' or None (large on a GPU)")
    stub = stub_kernel(fn)
    if stub:
        return _record(verdict.unfinished(name, stub, task=task, seed=seed, arrays=arrays), quiet)
    on_gpu = arrays == "cupy" or (arrays == "numba" and _device.numba_on_gpu())
    rng = np.random.default_rng(seed)
    specials = np.concatenate(list(bf16_special_cases().values()))
    if size == "large" or (size is None and on_gpu):
        big = 4096 * 256 + int(rng.integers(1, 30_000)) * 2 + 1      # past 4096 blocks x 256 threads
    else:
        big = int(rng.integers(300, 700)) * 2 + 1                     # past the simulator's 2 blocks x 32 threads
    cases = [("the special cases", specials), ("n = 1", _kernel_bits(rng, 1, specials=False)),
             ("random floats, a partial last block", _kernel_bits(rng, int(rng.integers(33, 63)) * 2 + 1))]
    cases.append((f"n = {big:,}, more than the capped grid covers", _kernel_bits(rng, big)))
    base = dict(name=name, task=task, seed=seed, dtype="float32", arrays=arrays)
    for label, bits in cases:
        x = bits.view(np.float32)
        dx = _arrays.to_backend(x.copy(), arrays)
        dout = _arrays.to_backend(np.full(x.size, OUT_POISON, np.uint16), arrays)
        try:
            fn(dx, dout)
            ours = np.asarray(_arrays.to_numpy(dout))
            after = np.asarray(_arrays.to_numpy(dx))
        except NotImplementedError:
            return _not_attempted(name, task, quiet)
        except Exception as exc:   # the learner's error is reported, never raised
            return _error(name, task, quiet, exc, f"{label}: x float32 ({x.size},), out uint16 ({x.size},) "
                          f"(seed {seed})", seed)
        if not np.array_equal(after.view(np.uint32), bits):
            hint = "your kernel changed its input x: read x, write only out"
            msg = f"{name}: wrong - {label}: x was modified"
            return _record(verdict.build_result("wrong", msg, hint, **base), quiet)
        want = _expected_bf16(x)
        if ours.dtype != np.uint16 or ours.shape != want.shape or not np.array_equal(ours, want):
            i = int(np.flatnonzero(ours != want)[0])
            grid = " (past the grid of MAX_BLOCKS x THREADS threads)" if label.startswith("n =") else ""
            hint = _bf16_out_hint(bits, ours, want, grid)
            msg = (f"{name}: wrong - {label}: {int((ours != want).sum())} of {x.size} wrong; first at index {i}: "
                   f"x = {float(x[i])!r} (bits 0x{int(bits[i]):08X}): yours 0x{int(ours[i]):04X}, expected "
                   f"0x{int(want[i]):04X} (seed {seed})")
            return _record(verdict.build_result("wrong", msg, hint, first_bad=(i,), ours=float(ours[i]),
                                                expected=float(want[i]), dims={"n": int(x.size)},
                                                **base), quiet)
    ns = ", ".join(f"{bits.size:,}" for _, bits in cases)
    msg = f"{name}: correct (bit-exact with ml_dtypes.bfloat16 in {len(cases)} calls, n = {ns})"
    return _record(CheckResult(status="correct", passed=True, max_abs=0.0, max_rel=0.0, tol=0.0, message=msg,
                                       **base), quiet)


def _hip_source(name, source, task, quiet, banned=(), required=()):
    """(text, None), or (None, the recorded verdict) when the source is missing, raised, or fails a task rule
    checked on the text: banned = ((regex, hint), ...) that must not match, required = ((regex, hint), ...) that
    must (comments ignored)."""
    if not (isinstance(source, str) or callable(source)):
        raise TypeError(f"check_{name}(source): pass your kernel source as a str, or the function that returns it "
                        f"(without calling it); got {type(source).__name__}")
    text, failed = opcheck.source_text(source)
    base = dict(name=name, task=task, arrays="cupy")
    if failed is not None:
        status, why = failed
        if status == "not attempted":
            return None, _not_attempted(name, task, quiet)
        msg = f"{name}: error - {why}"
        return None, _record(CheckResult(status="error", passed=False, message=msg, hint=why, **base), quiet)
    import re
    from ..runtime.hip import _blank_comments
    code = _blank_comments(text)
    for pattern, hint in banned:
        m = re.search(pattern, code)
        if m:
            line = code.count("\n", 0, m.start()) + 1
            msg = f"{name}: wrong - line {line}: {m.group(0).strip()}\n  hint: {hint}"
            return None, _record(CheckResult(status="wrong", passed=False, hint=hint, message=msg, **base),
                                 quiet)
    for pattern, hint in required:
        if not re.search(pattern, code):
            what = pattern.replace("\\b", "")
            msg = f"{name}: wrong - your source has no {what}\n  hint: {hint}"
            return None, _record(CheckResult(status="wrong", passed=False, hint=hint, message=msg, **base),
                                 quiet)
    return text, None


def _hip_kernel(name, text, entry, task, quiet):
    """(kernel, None) compiled on this GPU, or (None, the recorded 'wrong' verdict with the compiler's words)."""
    from ..runtime import hip
    try:
        return hip.kernel_from_source(text, entry), None
    except Exception as exc:   # CuPy's CompileException or the missing entry point
        first = " | ".join(line.strip() for line in str(exc).splitlines() if "error" in line.lower())[:400] or \
            " ".join(str(exc).split())[:400]
        hint = f"your source does not compile here: {first}"
        msg = f"{name}: wrong - compile error\n  hint: {hint}"
        return None, _record(CheckResult(name=name, task=task, status="wrong", passed=False, hint=hint,
                                                 message=msg, arrays="cupy"), quiet)


def _hip_start(name, source, entry, seed, task, quiet, banned=(), required=()):
    """The start of a HIP checker: (kernel, seed, None) with the source compiled on this GPU and the seed drawn when
    None, or (None, None, the recorded verdict) when it ends there: the source refused (_hip_source, banned and
    required as there), compiled and linted only (no GPU), or a compile error (_hip_kernel)."""
    text, refused = _hip_source(name, source, task, quiet, banned=banned, required=required)
    if refused is not None:
        return None, None, refused
    if not _device.has_gpu():
        return None, None, opcheck.hip_compile_only(name, text, [entry], task=task, quiet=quiet)
    seed = secrets.randbelow(1_000_000) if seed is None else int(seed)
    kernel, refused = _hip_kernel(name, text, entry, task, quiet)
    if refused is not None:
        return None, None, refused
    return kernel, seed, None


def _hip_blocks(n, per_thread=1):
    return max(1, min(-(-n // (HIP_THREADS * per_thread)), HIP_MAX_BLOCKS))


_HALF_H = (r'#\s*include\s*"half\.h"', "write the conversion yourself: include only \"portable.h\" (half.h holds the "
           "course's own rounding)")
_FLOAT4 = (r"\bfloat4\b", "the task is float4 loads: read src 16 bytes (a float4) at a time where src is 16-byte "
           "aligned, with scalar code for the elements before that and for the last n % 4")


def check_bf16_hip(source, seed=None, task=None, quiet=False) -> "CheckResult":
    """Check a portable HIP/CUDA C++ kernel (a str, or a zero-argument function returning it) defining

        extern "C" __global__ void f32_to_bf16_vec4(const float* src, unsigned short* dst, long long n)

    dst[i] = the bfloat16 bits of src[i], round to nearest even, NaN -> 0x7FC0 with its sign (bit for bit as
    ml_dtypes), reading src with float4 loads where it is 16-byte aligned and scalar loads elsewhere. On a GPU it is
    compiled and launched with at most 64 blocks of 256 threads (so a grid-stride loop is needed) on: the special
    cases, n = 1..7, a size past the grid, then src and dst offset by one and by three elements (a start that is
    not 16-byte aligned, with and without a size past the grid); dst elements outside [0, n) must stay untouched.
    Without a GPU it is compiled for NVIDIA and AMD and linted (status "compiled"). The source must include only
    "portable.h" and use float4."""
    name = NAME_BF16_HIP
    kernel, seed, done = _hip_start(name, source, BF16_HIP_ENTRY, seed, task, quiet, banned=(_HALF_H,),
                                    required=(_FLOAT4,))
    if done is not None:
        return done
    import cupy as cp
    rng = np.random.default_rng(seed)
    past = HIP_MAX_BLOCKS * HIP_THREADS * 4
    specials = np.concatenate(list(bf16_special_cases().values()))
    cases = [("the special cases", 0, specials)]
    cases += [(f"n = {n}", 0, _kernel_bits(rng, n)) for n in (1, 2, 3, 4, 5, 7)]
    cases += [(f"n = {past * 2 + 7:,}, past a grid of 64 x 256 threads", 0, _kernel_bits(rng, past * 2 + 7)),
              ("src + 1 (not 16-byte aligned), n = 1001", 1, _kernel_bits(rng, 1001)),
              ("src + 3 (not 16-byte aligned), n = 6", 3, _kernel_bits(rng, 6)),
              ("src + 1, n = 2", 1, _kernel_bits(rng, 2)),
              (f"src + 1 (not 16-byte aligned), n = {past * 2 + 5:,}, past the grid", 1,
               _kernel_bits(rng, past * 2 + 5))]
    base = dict(name=name, task=task, seed=seed, dtype="float32", arrays="cupy")
    for label, off, bits in cases:
        n = bits.size
        src_all = np.zeros(n + off + 4, np.uint32)
        src_all[off:off + n] = bits
        d_src = cp.asarray(src_all.view(np.float32))
        d_dst = cp.full(n + off + 4, OUT_POISON, cp.uint16)
        try:
            kernel((_hip_blocks(n, 4),), (HIP_THREADS,), (d_src[off:], d_dst[off:], np.int64(n)))
            cp.cuda.get_current_stream().synchronize()
            got = cp.asnumpy(d_dst)
        except Exception as exc:   # e.g. a misaligned float4 load: the launch fails
            text_exc = verdict.error_text(exc)
            hint = (f"the launch failed ({text_exc}) on {label}: "
                    + ("a float4 load from an address that is not a multiple of 16 faults; convert the elements "
                       "before the first 16-byte boundary with scalar loads, then use float4. (A failed launch can "
                       "leave the GPU context unusable: restart the notebook kernel before running GPU code again.)"
                       if off else "an out-of-bounds access? check every index against n"))
            msg = f"{name}: error - {label}: the kernel failed (seed {seed})"
            return _record(verdict.build_result("error", msg, hint, **base), quiet)
        ours = got[off:off + n]
        outside = np.concatenate([got[:off], got[off + n:]])
        if (outside != np.uint16(OUT_POISON)).any():
            k = int(np.flatnonzero(got != np.uint16(OUT_POISON))[0] if (got[:off] != OUT_POISON).any() else
                    off + n + np.flatnonzero(got[off + n:] != OUT_POISON)[0])
            hint = (f"your kernel wrote outside dst[0 .. n-1] (at dst[{k - off}]): the last float4 may only be used "
                    f"when all 4 of its elements are < n, the rest is the scalar tail")
            msg = f"{name}: wrong - {label}: a write past the end of dst (seed {seed})"
            return _record(verdict.build_result("wrong", msg, hint, **base), quiet)
        want = _expected_bf16(bits.view(np.float32))
        if not np.array_equal(ours, want):
            bad = np.flatnonzero(ours != want)
            i = int(bad[0])
            hint = _bf16_out_hint(bits, ours, want, " (past the 64 x 256 threads of the grid)" if "past" in label
                                  else "")
            untouched = (ours == np.uint16(OUT_POISON)) & (ours != want)
            if untouched.any() and untouched.sum() * 2 >= bad.size:
                idx = np.flatnonzero(untouched)
                if off and idx.max() < 4:
                    hint = (f"the first {idx.size} element(s) were never written: src + {off} is not 16-byte aligned, "
                            f"so the elements before the first 16-byte boundary need scalar code (a head)")
                elif idx.min() >= n - (n % 4 or 4) and "past" not in label:
                    hint = (f"the last {idx.size} element(s) (n = {n}, n % 4 = {n % 4}) were never written: after the "
                            f"float4 part, convert the remaining elements one by one (a scalar tail)")
            msg = (f"{name}: wrong - {label}: {bad.size} of {n} wrong; first at index {i}: x = "
                   f"{float(bits[i:i + 1].view(np.float32)[0])!r} (bits 0x{int(bits[i]):08X}): yours "
                   f"0x{int(ours[i]):04X}, expected 0x{int(want[i]):04X} (seed {seed})")
            return _record(verdict.build_result("wrong", msg, hint, first_bad=(i,), ours=float(ours[i]),
                                                expected=float(want[i]), dims={"n": n, "offset": off},
                                                **base), quiet)
    msg = (f"{name}: correct (bit-exact with ml_dtypes.bfloat16 in {len(cases)} launches: n = 1..7, past the grid, "
           f"src + 1 and src + 3 not 16-byte aligned; nothing written outside dst)")
    return _record(CheckResult(status="correct", passed=True, max_abs=0.0, max_rel=0.0, tol=0.0, message=msg,
                                       **base), quiet)


# ================================================================================================================
# 06.2 the loss-scale unscale and the inf/NaN count, in one pass (HIP)
# ================================================================================================================
NAME_UNSCALE = "unscale_nonfinite"
UNSCALE_ENTRY = "unscale_nonfinite"


def _unscale_case(rng, n, log2_scale):
    """Scaled gradients float32 (n,) with up to 80 infs and NaNs (4 infs for 3 NaNs, of every sign and payload)
    spread evenly over the whole buffer: the first and last elements, every block, warps past the first, past the
    grid. Spread over every block in those proportions, the counting mistakes give different numbers (only inf, only
    NaN, one block's total, the first warp of each block)."""
    g = (rng.standard_normal(n) * 10.0 ** rng.uniform(-6, 0, n) * 2.0 ** log2_scale).astype(np.float32)
    if n == 0:
        return g
    k = max(1, min(n // 4, 40))
    spots = np.unique(np.linspace(0, n - 1, 2 * k).round().astype(np.int64))
    bits = np.array([0x7F800000, 0x7FC00000, 0xFF800000, 0xFFC00000, 0x7F800000, 0x7F800001, 0xFF800000],
                    dtype=np.uint32)                   # 4 infs for 3 NaNs: + inf, NaN, - inf, - NaN, ...
    g.view(np.uint32)[spots] = bits[np.arange(spots.size) % bits.size]
    return g


def _count_hint(g, got, want, blocks, threads=HIP_THREADS):
    """Which counting mistake gives `got` for the scaled gradient g (want = the right count)."""
    bits = g.view(np.uint32)
    inf = (bits & np.uint32(0x7FFFFFFF)) == np.uint32(0x7F800000)
    nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    bad = inf | nan
    n = g.size
    stride = blocks * threads
    i = np.arange(n)
    lane = (i % stride) % threads
    block_of = (i % stride) // threads
    per_block = np.bincount(block_of[bad], minlength=blocks)
    if got == 0 and want > 0:
        return ("count stayed 0: each block must add its total to count[0] (one atomicAdd per block, from one "
                "thread, after the block's reduction)")
    if got == int(inf.sum()) and nan.any():
        return "NaN was not counted: a float whose exponent bits are all ones is inf OR NaN (x != x for NaN)"
    if got == int(nan.sum()) and inf.any():
        return "inf was not counted: count every float whose exponent bits are all ones (inf and NaN)"
    if got == int(bad[:stride].sum()) and n > stride:
        return (f"only the first {stride} elements were counted (one per thread of the grid): loop over i, "
                f"i + stride, ... (grid-stride) and count every element")
    for width in (32, 64):
        if width < threads and got == int((bad & (lane < width)).sum()):
            return ("only the first warp of each block reached the count: after the warp reductions, combine the "
                    "partials of all blockDim.x / warpSize warps (shared memory) before the atomicAdd")
        if width < threads and got == int((bad & (lane % width == 0)).sum()):
            return ("only lane 0 of each warp was counted: reduce over every lane of the warp (shfl_down / shfl_xor "
                    "with offsets from warpSize / 2 down to 1)")
    if got in set(int(t) for t in per_block if t > 0):
        return ("count holds one block's total: blocks must ADD (atomicAdd) their totals; a plain store keeps "
                "whichever block wrote last")
    if got == int((per_block > 0).sum()):
        return "count counts blocks that saw an inf/NaN; it must count the elements"
    if want and got % want == 0 and got // want in (threads, threads // 32, threads // 64, 2):
        return (f"count is {got // want} x too large: the block total was added more than once; add it from one "
                f"thread only (threadIdx.x == 0)")
    return f"count is {got}, expected {want}: every inf or NaN element must be counted exactly once"


def check_unscale_hip(source, seed=None, task=None, quiet=False) -> "CheckResult":
    """Check a portable HIP/CUDA C++ kernel (a str, or a zero-argument function returning it) defining

        extern "C" __global__ void unscale_nonfinite(float* grads, long long n, float inv_scale, int* count)

    which multiplies every grads[i] by inv_scale in place and adds to count[0] (zeroed by the caller) the number of
    elements that are inf or NaN, with one atomicAdd per block after a reduction across the block. On a GPU it is
    launched with at most 64 blocks of 256 threads on n = 0, 1, a partial block, several blocks, a size past the
    grid and ~1M elements, inf / -inf / NaN placed in the first and last elements, in warps past the first, past
    the grid; grads must equal float32 g * inv_scale bit for bit (NaN stays NaN) and count must be exact. Without a
    GPU it is compiled for NVIDIA and AMD and linted (status "compiled")."""
    name = NAME_UNSCALE
    kernel, seed, done = _hip_start(name, source, UNSCALE_ENTRY, seed, task, quiet,
                                    required=((r"\batomicAdd\b", "add each block's total to count[0] with atomicAdd "
                                               "(blocks run in any order)"),))
    if done is not None:
        return done
    import cupy as cp
    rng = np.random.default_rng(seed)
    past = HIP_MAX_BLOCKS * HIP_THREADS
    plan = [0, 1, 255, 257 * 3, past * 3 + 101, 1_000_003]
    base = dict(name=name, task=task, seed=seed, dtype="float32", arrays="cupy")
    for n in plan:
        log2s = int(rng.integers(4, 17))
        g = _unscale_case(rng, n, log2s)
        inv = np.float32(2.0 ** -log2s)
        d_g = cp.asarray(g)
        d_count = cp.zeros(1, cp.int32)
        blocks = _hip_blocks(n)
        label = f"n = {n:,}, loss scale 2^{log2s}, {blocks} block{'s' if blocks > 1 else ''} of {HIP_THREADS}"
        try:
            kernel((blocks,), (HIP_THREADS,), (d_g, np.int64(n), inv, d_count))
            cp.cuda.get_current_stream().synchronize()
            got_g, got_count = cp.asnumpy(d_g), int(cp.asnumpy(d_count)[0])
        except Exception as exc:
            hint = f"the launch failed ({verdict.error_text(exc)}): check every index against n"
            msg = f"{name}: error - {label}: the kernel failed (seed {seed})"
            return _record(verdict.build_result("error", msg, hint, **base), quiet)
        with np.errstate(invalid="ignore"):
            want_g = g * inv
        same = (got_g.view(np.uint32) == want_g.view(np.uint32)) | (np.isnan(got_g) & np.isnan(want_g))
        want_count = int((~np.isfinite(g)).sum())
        if not same.all():
            bad = np.flatnonzero(~same)
            i = int(bad[0])
            if np.array_equal(got_g.view(np.uint32), g.view(np.uint32)):
                hint = "grads were not changed: multiply every grads[i] by inv_scale and store it back"
            elif np.allclose(got_g[np.isfinite(g)], (g.astype(np.float64) / inv)[np.isfinite(g)]):
                hint = "grads were divided by inv_scale: multiply by it (inv_scale = 1 / loss_scale)"
            elif (got_g.view(np.uint32)[bad] == g.view(np.uint32)[bad]).all():
                kept = got_g.view(np.uint32) == g.view(np.uint32)
                hint = (f"{bad.size} of {n} elements were not unscaled, first at index {i}"
                        + (f" (every element from there on: past the grid of {blocks} x {HIP_THREADS} threads; each "
                           f"thread must loop over i, i + stride, ... (a grid-stride loop))" if kept[i:].all() else ""))
            else:
                hint = f"grads[{i}] should be grads[{i}] * inv_scale = {float(want_g[i])!r} (float32)"
            msg = (f"{name}: wrong - {label}: grads at [{i}]: yours {float(got_g[i])!r}, expected {float(want_g[i])!r} "
                   f"({bad.size} of {n} wrong; seed {seed})")
            return _record(verdict.build_result("wrong", msg, hint, first_bad=(i,), output="grads",
                                                ours=float(got_g[i]), expected=float(want_g[i]), **base), quiet)
        if got_count != want_count:
            hint = _count_hint(g, got_count, want_count, blocks)
            msg = (f"{name}: wrong - {label}: count is {got_count}, expected {want_count} inf/NaN elements "
                   f"(seed {seed})")
            return _record(verdict.build_result("wrong", msg, hint, output="count", ours=float(got_count),
                                                expected=float(want_count), **base), quiet)
    msg = (f"{name}: correct ({len(plan)} launches, n = 0 .. {plan[-1]:,}; grads unscaled bit for bit, every inf/NaN "
           f"counted once)")
    return _record(CheckResult(status="correct", passed=True, message=msg, **base), quiet)
