"""The checker core: how every checker turns a call of the learner's function into one printed, recorded verdict.

Every ``check_*`` in ``checks/backward.py`` and ``checks_*.py`` ends the same way: a CheckResult with one of the STATUSES, its
message printed (unless quiet) and recorded for grading (``grading.record``). The learner's function is called so
that nothing it raises reaches the notebook: NotImplementedError is "not attempted", any other exception is "error"
with the exception's first words and the line of the learner's code that raised it. This module owns that plumbing,
the wording of those messages and hints, and the small helpers the checkers share to write numbers, indices and the
element-wise tolerance rule into their messages.

Why a module of its own and not a section of ``checks/backward.py``: checks/backward.py is the checker of the backward ops (its
cases, mistake tables, diagnosis: most of its 1700 lines). The other checker modules needed only this plumbing from
it, reached for it through underscore names, and kept copies whose wording drifted apart. Here it has public names,
depends on nothing of the course but ``device`` (the "skipped" message) and ``grading`` (imported when a verdict is
recorded), and checks/backward.py uses it like every other checker does.

Messages, one shape for all checkers (``name`` is the op, e.g. "linear_backward"):

    name: correct (...)
    name: wrong - what is wrong where (...; seed S)
      hint: what is probably wrong
    name: not attempted (your function raised NotImplementedError)
    name: error - your function raised ValueError: the exception's first 200 characters
      hint: the error is in your code (at line 12 in my_fn); what the call was given (seed S)
    name: skipped - arrays='cupy' runs on a GPU, and this machine runs as 'cpu' (why); it is checked on a GPU server
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import sysconfig
import traceback
from typing import Callable, Optional, Union

import numpy as np

__all__ = [
    "STATUSES",
    "DTYPE_SHORT",
    "NOT_ATTEMPTED_HINT",
    "ERROR_TEXT_MAX",
    "CheckResult",
    "build_result",
    "record",
    "verdict",
    "skipped",
    "call_learner",
    "not_attempted",
    "unfinished",
    "raised",
    "error_text",
    "what_raised",
    "error_message",
    "error_hint",
    "is_learner_code",
    "learner_frames",
    "where_raised",
    "raised_in",
    "fmt",
    "fmt_index",
    "compare",
    "close",
    "mistake_slack",
]

# "compiled": a HIP task checked without a GPU (compiles for both vendors, lint clean; not run), see
# checks.hip_compile_only. grading.STATUSES lists the same words (grading imports nothing of the checkers).
STATUSES = ("correct", "wrong", "not attempted", "error", "skipped", "compiled")
DTYPE_SHORT = {"float64": "fp64", "float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}  # in "correct (...)"
NOT_ATTEMPTED_HINT = "replace the `raise NotImplementedError` with your code"
ERROR_TEXT_MAX = 200  # characters of an exception's text in a message: a traceback's worth would bury the verdict


# ------------------------------------------------------------------------------------------------------------
# The result, recorded and printed
# ------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(repr=False)
class CheckResult:
    """The verdict of one check. ``bool(result)`` is ``result.passed``; ``print(result)`` prints the message."""

    name: str  # the op, e.g. "linear_backward"
    task: Optional[str]  # the task label passed to the checker (grading), or None
    status: str  # "correct" | "wrong" | "not attempted" | "error" | "skipped" (needs a GPU)
    #                                   | "compiled" (a HIP source checked without a GPU: compiles, lint clean; not run)
    passed: bool
    output: Optional[str] = None  # the (first) wrong output, e.g. "dweight"
    max_abs: Optional[float] = None  # max |yours - expected| over that output (over all outputs if correct)
    max_rel: Optional[float] = None  # max |yours - expected| / (|expected| + M), compare with tol
    tol: Optional[float] = None  # the relative tolerance used (see checks.TOLERANCES)
    first_bad: Optional[tuple] = None  # index of the first wrong element of `output`
    ours: Optional[float] = None  # your value there
    expected: Optional[float] = None  # the reference value there
    hint: Optional[str] = None  # what is probably wrong
    seed: Optional[int] = None  # pass seed=... to the checker to get the same inputs again
    message: str = ""  # what was printed (one or two lines)
    dtype: Optional[str] = None  # "float32", ...
    arrays: Optional[str] = None  # "numpy" | "cupy" | "numba"
    dims: Optional[dict] = None  # the sizes used in the case that decided, e.g. {"N": 37, "C": 20, "OC": 12}
    atol: Optional[dict] = None  # the absolute floor used per output (tol * M, see the checks docstring)
    inputs: Optional[dict] = dataclasses.field(default=None)  # the NumPy inputs of that case, to reproduce by hand

    def __bool__(self) -> bool:
        return bool(self.passed)

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:  # short: a notebook shows it right under the printed message
        return f"CheckResult({self.name}: {self.status})"


def build_result(status: str, msg: str, hint: Optional[str] = None, **fields) -> CheckResult:
    """A CheckResult (not yet recorded): the message is `msg`, plus a second line "  hint: ..." when there is a hint;
    passed exactly when status is "correct". fields: name, task and any other CheckResult field."""
    return CheckResult(
        status=status,
        passed=status == "correct",
        message=msg + (f"\n  hint: {hint}" if hint else ""),
        hint=hint,
        **fields,
    )


def record(result: CheckResult, *, quiet: bool = False, check: Optional[str] = None) -> CheckResult:
    """Record the verdict for grading (as check_<name>, or `check`) with its whole message (grading.record makes it
    one line, hint included), print the message unless quiet, and return the result."""
    from ..classroom import grading  # lazily: grading is only needed once a verdict exists

    name = str(result.name)
    grading.record(
        check=check or (name if name.startswith("check_") else f"check_{name}"),
        task=result.task,
        status=result.status,
        message=result.message,
    )
    if not quiet:
        print(result.message)
    return result


def verdict(
    name: str,
    task,
    status: str,
    msg: str,
    hint: Optional[str] = None,
    *,
    quiet: bool = False,
    check: Optional[str] = None,
    **fields,
) -> CheckResult:
    """build_result + record in one call: the way a checker ends with a verdict."""
    return record(build_result(status, msg, hint, name=name, task=task, **fields), quiet=quiet, check=check)


def skipped(name: str, task, *, quiet: bool = False, check: Optional[str] = None, **fields) -> CheckResult:
    """arrays="cupy" on a machine without a GPU: say so, record it (the grader leaves it out of the total), go on."""
    from .. import device

    msg = (
        f"{name}: skipped - arrays='cupy' runs on a GPU, and this machine runs as '{device.kind()}' "
        f"({device.info().reason}); it is checked on a GPU server"
    )
    fields.setdefault("arrays", "cupy")
    return verdict(name, task, "skipped", msg, quiet=quiet, check=check, **fields)


# ------------------------------------------------------------------------------------------------------------
# Calling the learner's function: not attempted, error
# ------------------------------------------------------------------------------------------------------------
Lead = Union[None, str, Callable[[BaseException], Optional[str]]]


def call_learner(name: str, fn, args=(), *, context: str = "", lead: Lead = None, who: str = "function", **fields):
    """(fn(*args), None), or (None, an unrecorded CheckResult) when fn raised: "not attempted" for
    NotImplementedError, "error" for any other exception (see raised; context and lead go to error_hint).
    fields: name-independent CheckResult fields (task, seed, dims, ...)."""
    try:
        return fn(*args), None
    except NotImplementedError:
        return None, not_attempted(name, who=who, **fields)
    except Exception as exc:  # the learner's error is reported, never raised: the notebook goes on
        return None, raised(name, exc, context, lead=lead, who=who, **fields)


def not_attempted(name: str, *, who: str = "function", hint: str = NOT_ATTEMPTED_HINT, **fields) -> CheckResult:
    """'name: not attempted (your function raised NotImplementedError)', unrecorded. who: "function", or the name of
    the learner's function that raised when a checker calls several. The message is that one line: the hint (what
    to do) is in result.hint only, since the line already says it."""
    msg = f"{name}: not attempted (your {who} raised NotImplementedError)"
    return CheckResult(name=name, status="not attempted", passed=False, message=msg, hint=hint, **fields)


def unfinished(name: str, kernel: str, **fields) -> CheckResult:
    """'name: not attempted (your kernel K still raises NotImplementedError)', unrecorded: a launcher whose Numba
    kernel is still the exercise's stub (checks.unfinished_kernel finds it before the call: on a GPU the stub's
    raise is compiled away and the call would only write nothing)."""
    msg = f"{name}: not attempted (your kernel {kernel} still raises NotImplementedError)"
    return CheckResult(
        name=name,
        status="not attempted",
        passed=False,
        message=msg,
        hint=f"replace the `raise NotImplementedError` in {kernel} with your code",
        **fields,
    )


def raised(
    name: str, exc: BaseException, context: str = "", *, lead: Lead = None, who: str = "function", **fields
) -> CheckResult:
    """The "error" verdict for an exception the learner's code raised, unrecorded: error_message + error_hint."""
    return build_result("error", error_message(name, exc, who), error_hint(exc, context, lead), name=name, **fields)


def error_text(exc_or_text) -> str:
    """The exception's text on one line, cut to ERROR_TEXT_MAX characters ("..." at the cut)."""
    text = " ".join(str(exc_or_text).split())
    return text if len(text) <= ERROR_TEXT_MAX else text[: ERROR_TEXT_MAX - 3] + "..."


def what_raised(exc: BaseException, who: str = "function") -> str:
    """'your function raised ValueError: its text' (no ': ...' when the exception has no text)."""
    text = error_text(exc)
    return f"your {who} raised {type(exc).__name__}" + (f": {text}" if text else "")


def error_message(name: str, exc: BaseException, who: str = "function") -> str:
    """'name: error - your function raised ValueError: its text', the first line of an "error" verdict."""
    return f"{name}: error - {what_raised(exc, who)}"


def error_hint(exc: BaseException, context: str = "", lead: Lead = None) -> str:
    """'the error is in your code (at line 12 in my_fn); context'. lead replaces "the error is in your code" (a str,
    or a function of the exception returning one or None for the default): what the checker knows about this
    exception. context: what the call was given (shapes, sizes, the call's number, the seed)."""
    if callable(lead):
        lead = lead(exc)
    where = where_raised(exc)
    return (
        (lead or "the error is in your code")
        + (f" (at {where})" if where else "")
        + (f"; {context}" if context else "")
    )


# ------------------------------------------------------------------------------------------------------------
# Where the learner's code raised
# ------------------------------------------------------------------------------------------------------------
_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the gpullm_lessons package
_STDLIB = os.path.abspath(sysconfig.get_paths()["stdlib"])


def _course_kernel_dirs() -> tuple:
    """The folders of gpullm_lessons.kernels (the course's kernels/, mounted from a checkout or installed): course
    code, though outside this folder in a checkout. Only when loaded: a kernel of it that raised was imported."""
    mod = sys.modules.get("gpullm_lessons.kernels")
    return tuple(os.path.abspath(p) + os.sep for p in getattr(mod, "__path__", ()))


def is_learner_code(filename: str) -> bool:
    """A notebook cell or a file of the learner's: not this package or its kernels/, an installed package or the
    stdlib."""
    if filename.startswith("<"):
        return filename.startswith(("<ipython-input", "<stdin>", "<string>"))
    if not os.path.isabs(filename):  # compiled extensions report relative .pyx paths
        return False
    f = os.path.abspath(filename)
    return not (
        f.startswith(_HERE + os.sep)
        or f.startswith(_STDLIB + os.sep)
        or "site-packages" in f
        or "dist-packages" in f
        or f.startswith(_course_kernel_dirs())
    )


def learner_frames(exc: BaseException) -> list:
    """The frames of exc's traceback in the learner's code, innermost first."""
    return [f for f in reversed(traceback.extract_tb(exc.__traceback__)) if is_learner_code(f.filename)]


def where_raised(exc: BaseException) -> str:
    """'line 12 in my_linear_backward': the innermost frame of the learner's own code, or ''."""
    frames = learner_frames(exc)
    return f"line {frames[0].lineno} in {frames[0].name}" if frames else ""


def raised_in(exc: BaseException) -> Optional[str]:
    """The name of the innermost function of the learner's code in exc's traceback, or None."""
    frames = learner_frames(exc)
    return frames[0].name if frames else None


# ------------------------------------------------------------------------------------------------------------
# Numbers and indices in messages; the element-wise tolerance rule
# ------------------------------------------------------------------------------------------------------------
def fmt(v, other=None) -> str:
    """4 significant digits, more when needed to tell v from `other`."""
    if v is None or math.isnan(v):
        return "nan"
    for digits in (4, 6, 9):
        text = f"{v:.{digits}g}"
        if other is None or math.isnan(other) or text != f"{other:.{digits}g}":
            break
    return text


def fmt_index(index) -> str:
    """'[3, 1]' for the index (3, 1) of an element."""
    return "[" + ", ".join(str(int(i)) for i in index) + "]"


MISTAKE_SLACK = 10.0  # a known mistake "matches" your output within 10x the tolerance (see mistake_slack)


def mistake_slack(tol: float) -> float:
    """Tolerance for "your output equals this mistake's": 10x tol, only 2x for fp16/bf16, whose tol is already
    loose (two different mistakes can lie within 10x of each other there)."""
    return (MISTAKE_SLACK if tol < 1e-3 else 2.0) * tol


def compare(o, e, tol, terms=0.0, parts=1):
    """Per-element verdict: (bad mask, |o - e|, rel err, atol). An element passes when
    |o - e| <= tol * (|e| + M); NaN or inf never passes.

    M = max|e| over the output, or the size of the terms it is computed from when that is larger: where a
    result is a near-cancellation of big terms (softmax backward with a peaky row: dout - sum(out * dout)), a
    correct function's rounding error is relative to the terms, not to the small result.
    parts > 1 splits the last axis into that many blocks with their own M (dqkv = [dq | dk | dv]: a small dq
    is judged against its own size, not against dv's).
    """
    e_abs = np.where(np.isfinite(e), np.abs(e), 0.0)
    floor = np.maximum(np.asarray(terms, dtype=np.float64), np.finfo(np.float64).tiny)  # scalar or (parts,)
    if parts > 1 and e.ndim and e.shape[-1] % parts == 0 and e.size:
        per = e_abs.reshape(-1, parts, e.shape[-1] // parts).max(axis=(0, 2))  # (parts,)
        M = np.repeat(np.maximum(per, floor), e.shape[-1] // parts)  # (last axis,)
    else:
        M = max(float(e_abs.max()) if e_abs.size else 0.0, float(np.max(floor)))
    err = np.abs(o - e)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        ok = err <= tol * (np.abs(e) + M)  # NaN compares False: never passes
        rel = err / (np.abs(e) + M)
    return ~ok, err, rel, tol * float(np.max(M))


def close(o, m, tol) -> bool:
    """o matches m within tol (the rule of compare), NaN where m is NaN counts as a match."""
    if o.shape != m.shape:
        return False
    nan_m = np.isnan(m)
    if (np.isnan(o) != nan_m).any():
        return False
    if nan_m.all():
        return True
    bad, _, _, _ = compare(o[~nan_m], m[~nan_m], tol)
    return not bad.any()
