"""Checkers: does your backward op compute the right gradients?

Every ``check_<op>_backward(fn, ...)`` calls your destination-passing function the way a kernel is called
(inputs first, then the pre-allocated outputs it must fill, then int scalars; see SPEC/lessons for each
signature) and compares what it wrote with the NumPy reference (``gpullm_lessons.reference``).

How a check works
-----------------
1. Fresh random inputs on every call. Shapes are random too, and awkward on purpose: sizes that are not
   multiples of 32 (a grid that forgets the last partial block shows), C != OC (a missing transpose fails on
   shape), rows of very different scales. Some ops run two cases: a "square" one first (N = C = OC ...), where
   a transpose or an axis mix-up gives wrong numbers the checker can recognize, then a rectangular one.
   The seed is printed when something is wrong: pass ``seed=...`` to get the same inputs again.
2. The outputs are allocated on the backend you pick (``arrays="numpy" | "cupy" | "numba"``) and filled with
   NaN ("poison") before the call, so every element your function does not write shows up.
3. Expected values: the reference op in float64, from the same inputs rounded to your dtype.
4. An element passes when   |yours - expected| <= tol * (|expected| + M)
   M is the output's magnitude: max|expected| over that output, so a relative tolerance plus an absolute floor
   scaled to the output (elements that nearly cancel to 0 are judged against the output's size, not their
   own). Where a correct result is itself a near-cancellation of bigger terms (softmax backward of a peaky
   row, dout - sum(out * dout); GELU's two product-rule terms near x = -0.75; probs - 1 at a confident target;
   dq, dk through the softmax backward), M is the size of those terms instead, since that is what a correct
   implementation's rounding error is relative to. dqkv's three parts [dq | dk | dv] each have their own M.
   "max rel err" in the messages is max |yours - expected| / (|expected| + M), so it passes exactly when it
   is <= tol. NaN or inf never passes.
5. When something is wrong, the checker compares your output with the outputs of the common mistakes for that
   op (each computed from the same inputs) and with generic patterns (elements never written, a constant
   factor, a transposed result, a few wrong rows) and prints the matching hint.

Tolerances (``TOLERANCES``): float64 1e-9, float32 1e-5, float16 1e-2, bfloat16 5e-2. Chosen so that a correct
implementation passes reliably and every known mistake fails by orders of magnitude. Measured with NumPy
implementations over 1000-2000 seeds per op: the worst correct fp32 result used under 0.11 of tol (float64:
under 1e-6 of tol); at the large GPU sizes (sums over up to 4096 rows, BLAS or a sequential fp32 loop) under
0.17 of tol. float16/bfloat16 are for kernels that store low precision and accumulate in fp32: NumPy code
that also accumulates in fp16/bf16 used up to 0.5 of tol at the small sizes. Subtle mistakes (erf vs tanh
GELU) are only detectable in fp32/fp64.
"""
from __future__ import annotations

import dataclasses
import math
import os
import secrets
import sysconfig
import traceback
from typing import Callable, Optional

import numpy as np

from . import arrays as _arrays
from . import device as _device
from . import reference as ref

__all__ = [
    "CheckResult", "TOLERANCES", "CHECKERS",
    "check_linear_backward", "check_softmax_backward", "check_layernorm_backward", "check_gelu_backward",
    "check_crossentropy_backward", "check_attention_backward", "check_encoder_backward",
    "check_residual_backward",
]

STATUSES = ("correct", "wrong", "not attempted", "error", "skipped")
SIZES = ("small", "large")

# Relative tolerance per dtype; the absolute floor is tol * M, M the output's magnitude (see the docstring).
TOLERANCES = {"float64": 1e-9, "float32": 1e-5, "float16": 1e-2, "bfloat16": 5e-2}
_SHORT = {"float64": "fp64", "float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
_ALIASES = {"fp64": "float64", "fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "half": "float16",
            "float": "float32", "double": "float64"}

# The poison: a quiet NaN with a recognizable payload, so "never written" can be told apart from a NaN that
# your arithmetic produced (NumPy on the CPU carries the payload through x + NaN, GPUs do not).
_POISON = {"float64": (np.uint64, 0x7FF80000DEADBEEF), "float32": (np.uint32, 0x7FC0DEAD),
           "float16": (np.uint16, 0x7E5A), "bfloat16": (np.uint16, 0x7FD5)}

_MISTAKE_SLACK = 10.0  # a known mistake "matches" your output within 10x the tolerance (see _slack)


def _slack(tol: float) -> float:
    """Tolerance for "your output equals this mistake's": 10x tol, only 2x for fp16/bf16, whose tol is already
    loose (two different mistakes can lie within 10x of each other there)."""
    return (_MISTAKE_SLACK if tol < 1e-3 else 2.0) * tol


# ------------------------------------------------------------------------------------------------------------
# The result
# ------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(repr=False)
class CheckResult:
    """The verdict of one check. ``bool(result)`` is ``result.passed``; ``print(result)`` prints the message."""
    name: str                         # the op, e.g. "linear_backward"
    task: Optional[str]               # the task label passed to the checker (grading), or None
    status: str                       # "correct" | "wrong" | "not attempted" | "error" | "skipped" (needs a GPU)
    passed: bool
    output: Optional[str] = None      # the (first) wrong output, e.g. "dweight"
    max_abs: Optional[float] = None   # max |yours - expected| over that output (over all outputs if correct)
    max_rel: Optional[float] = None   # max |yours - expected| / (|expected| + M), compare with tol
    tol: Optional[float] = None       # the relative tolerance used (see TOLERANCES)
    first_bad: Optional[tuple] = None  # index of the first wrong element of `output`
    ours: Optional[float] = None      # your value there
    expected: Optional[float] = None  # the reference value there
    hint: Optional[str] = None        # what is probably wrong
    seed: Optional[int] = None        # pass seed=... to the checker to get the same inputs again
    message: str = ""                 # what was printed (one or two lines)
    dtype: Optional[str] = None       # "float32", ...
    arrays: Optional[str] = None      # "numpy" | "cupy" | "numba"
    dims: Optional[dict] = None       # the sizes used in the case that decided, e.g. {"N": 37, "C": 20, "OC": 12}
    atol: Optional[dict] = None       # the absolute floor used per output (tol * M, see the module docstring)
    inputs: Optional[dict] = dataclasses.field(default=None)  # the NumPy inputs of that case, to reproduce by hand

    def __bool__(self) -> bool:
        return bool(self.passed)

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:  # short: a notebook shows it right under the printed message
        return f"CheckResult({self.name}: {self.status})"


# ------------------------------------------------------------------------------------------------------------
# Cases: one set of inputs for one call of your function
# ------------------------------------------------------------------------------------------------------------
class _Case:
    """Inputs (rounded to dtype), output shapes, int scalars, and float64 copies for the reference/mistakes."""

    def __init__(self, dtype: np.dtype, dims: dict):
        self.dtype = dtype
        self.dims = dict(dims)   # symbol -> size
        self.inputs = {}         # name -> np.ndarray in call order (floats in dtype, indices int32)
        self.outputs = {}        # name -> shape, in call order
        self.scalars = {}        # name -> int, passed after the outputs
        self.sym = {}            # name -> symbolic shape, e.g. ("N", "C")
        self.x = {}              # name -> float64 array (rounded inputs, derived values) for reference/mistakes

    def shape(self, sym) -> tuple:
        return tuple(self.dims[s] for s in sym)

    def add_float(self, name, sym, values):
        """A float input: rounded to the case's dtype; the reference sees exactly the rounded values."""
        a = np.ascontiguousarray(np.asarray(values, dtype=np.float64).astype(self.dtype))
        self.inputs[name], self.sym[name], self.x[name] = a, tuple(sym), a.astype(np.float64)
        return self.x[name]

    def add_index(self, name, sym, values):
        a = np.ascontiguousarray(np.asarray(values, dtype=np.int32))
        self.inputs[name], self.sym[name], self.x[name] = a, tuple(sym), a
        return a

    def add_output(self, name, sym):
        self.outputs[name], self.sym[name] = self.shape(sym), tuple(sym)

    def describe_shapes(self) -> str:
        """'dout (N, OC) = (37, 12), inp (N, C) = (37, 20), ...' for every argument, in call order."""
        parts = []
        for name in list(self.inputs) + list(self.outputs):
            sym = self.sym[name]
            parts.append(f"{name} ({', '.join(sym)}{',' if len(sym) == 1 else ''}) = {self.shape(sym)}")
        parts += [f"{k}={v}" for k, v in self.scalars.items()]
        return ", ".join(parts)


@dataclasses.dataclass
class _Mistake:
    """A known mistake: either the wrong outputs it produces, or a pattern test on your output."""
    hint: str
    outputs: Optional[Callable] = None  # case -> {output name: wrong float64 array} for the outputs it changes
    test: Optional[Callable] = None     # (case, name, ours, expected, bad) -> bool


@dataclasses.dataclass
class _Op:
    name: str
    make: Callable       # (rng, dtype, size, k) -> _Case, k = case number
    expected: Callable   # case -> {output name: float64 array}
    formula: str         # the right formula, the fallback hint
    shape_hint: str      # for shape errors (raised by matmul/broadcasting)
    mistakes: list
    n_cases: int = 1
    accumulates: bool = False  # outputs must be zeroed first: "all NaN" is that op's own mistake, not rebinding
    terms: Optional[Callable] = None  # case -> {output: size of the terms it is computed from}, see _compare
    parts: Optional[dict] = None      # {output: blocks along the last axis judged separately}, see _compare


def _awkward(rng, lo, hi, avoid=()) -> int:
    """A random size in [lo, hi] that is not a multiple of 16 (so never of 32) and not in `avoid`."""
    for _ in range(1000):
        n = int(rng.integers(lo, hi + 1))
        if (n % 16 or lo == hi) and n not in avoid:
            return n
    return lo


def _scales(rng, n, lo=-1.0, hi=0.5):
    """Per-row scale factors 10**U(lo, hi): rows of very different magnitude."""
    return 10.0 ** rng.uniform(lo, hi, size=n)


def _rows(rng, shape, lo=-1.0, hi=0.5):
    """Standard normal values whose rows (leading axis after flattening all but the last) have random scales."""
    x = rng.standard_normal(shape)
    lead = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    s = _scales(rng, lead, lo, hi).reshape(shape[:-1] + (1,)) if len(shape) > 1 else _scales(rng, shape[0], lo, hi)
    return x * s


# ------------------------------------------------------------------------------------------------------------
# linear_backward(dout (N,OC), inp (N,C), weight (C,OC), dinp (N,C), dweight (C,OC), dbias (OC,))
# ------------------------------------------------------------------------------------------------------------
def _make_linear(rng, dt, size, k):
    if size == "small":
        if k == 0:  # square: N = C = OC, so transposes and axis mix-ups give wrong numbers, not shape errors
            N = C = OC = _awkward(rng, 5, 20)
        else:
            N, C = _awkward(rng, 3, 40), _awkward(rng, 3, 24)
            OC = _awkward(rng, 3, 24, avoid=(C, N))
    else:
        N = C = OC = 768
        if k == 1:
            N, OC = _awkward(rng, 1000, 4096), 3 * 768
    c = _Case(dt, {"N": N, "C": C, "OC": OC})
    c.add_float("dout", ("N", "OC"), _rows(rng, (N, OC)))
    c.add_float("inp", ("N", "C"), _rows(rng, (N, C)))
    c.add_float("weight", ("C", "OC"), rng.standard_normal((C, OC)))
    for name, sym in (("dinp", ("N", "C")), ("dweight", ("C", "OC")), ("dbias", ("OC",))):
        c.add_output(name, sym)
    return c


def _expected_linear(c):
    x = c.x
    _, cache = ref.linear_forward(x["inp"], x["weight"], np.zeros(c.dims["OC"]))
    dinp, dweight, dbias = ref.linear_backward(x["dout"], cache)
    return {"dinp": dinp, "dweight": dweight, "dbias": dbias}


def _if_square(fn):
    """A mistake that only exists as numbers when the shapes allow it (else it is a shape error)."""
    def wrapped(c):
        try:
            return fn(c)
        except ValueError:
            return {}
    return wrapped


_LINEAR = _Op(
    "linear_backward", _make_linear, _expected_linear, n_cases=2,
    formula="dinp = dout @ weight.T (N, C); dweight = inp.T @ dout (C, OC); dbias = dout.sum(axis=0) (OC,)",
    shape_hint="weight is stored (C, OC) (in, out): dinp = dout @ weight.T, dweight = inp.T @ dout, "
               "dbias = dout.sum(axis=0). Each gradient has the shape of its input.",
    mistakes=[
        _Mistake("missing transpose: dinp looks like dout @ weight. weight is stored (C, OC), so "
                 "dinp = dout @ weight.T: (N, OC) @ (OC, C) -> (N, C)",
                 _if_square(lambda c: {"dinp": c.x["dout"] @ c.x["weight"]})),
        _Mistake("dweight is transposed: it must have weight's layout (C, OC), dweight[c, o] = sum_n inp[n, c] "
                 "dout[n, o], i.e. dweight = inp.T @ dout (not dout.T @ inp)",
                 _if_square(lambda c: {"dweight": c.x["dout"].T @ c.x["inp"]})),
        _Mistake("missing transpose in dweight: dweight = inp.T @ dout, (C, N) @ (N, OC); the sum runs over "
                 "the N rows",
                 _if_square(lambda c: {"dweight": c.x["inp"] @ c.x["dout"]})),
        _Mistake("dbias is summed over the wrong axis: dbias[o] sums dout[n, o] over the N rows, "
                 "dbias = dout.sum(axis=0), one value per output channel",
                 _if_square(lambda c: {"dbias": c.x["dout"].sum(axis=1)})),
        _Mistake("dbias is not computed: the bias is added to every row, so dbias = dout.sum(axis=0) "
                 "(sum over the N rows)",
                 lambda c: {"dbias": np.zeros(c.dims["OC"])}),
        _Mistake("dbias was never written (it still holds the NaN it started with): dbias = dout.sum(axis=0) "
                 "(sum over the N rows), written into the array: dbias[...] = ...",
                 lambda c: {"dbias": np.full(c.dims["OC"], np.nan)}),
    ])


# ------------------------------------------------------------------------------------------------------------
# softmax_backward(dout (N,n), out (N,n), dinp (N,n))
# ------------------------------------------------------------------------------------------------------------
def _make_softmax(rng, dt, size, k):
    if size == "small":
        N = n = _awkward(rng, 5, 24)
        if k == 1:
            N, n = _awkward(rng, 3, 40), _awkward(rng, 3, 40, avoid=(N,))
    else:
        N = n = 1023
        if k == 1:
            N, n = _awkward(rng, 1000, 4096), _awkward(rng, 700, 1100)
    c = _Case(dt, {"N": N, "n": n})
    logits = _rows(rng, (N, n), -1.0, 1.0)              # some rows flat, some peaky
    out, _ = ref.softmax_forward(logits)
    c.add_float("dout", ("N", "n"), _rows(rng, (N, n)))
    c.add_float("out", ("N", "n"), out)                 # the forward's output, rounded to dtype
    c.add_output("dinp", ("N", "n"))
    return c


def _expected_softmax(c):
    return {"dinp": ref.softmax_backward(c.x["dout"], {"out": c.x["out"]})}


def _softmax_with(c, s):
    return {"dinp": c.x["out"] * (c.x["dout"] - s)}


_SOFTMAX = _Op(
    "softmax_backward", _make_softmax, _expected_softmax, n_cases=2,
    terms=lambda c: {"dinp": float(np.abs(c.x["out"] * c.x["dout"]).max())},
    formula="dinp = out * (dout - (out * dout).sum(axis=-1, keepdims=True)), the sum over each row",
    shape_hint="the row sum must keep its axis: s = (out * dout).sum(axis=-1, keepdims=True) is (N, 1)",
    mistakes=[
        _Mistake("dinp = out * dout is missing the row-sum term: every out_j depends on every input of the row, "
                 "dinp = out * (dout - sum(out * dout) over the row)",
                 lambda c: {"dinp": c.x["out"] * c.x["dout"]}),
        _Mistake("the row sum runs over the wrong axis: sum(out * dout) is over each row's n entries "
                 "(axis=-1, keepdims=True), not down the columns (axis=0)",
                 lambda c: _softmax_with(c, (c.x["out"] * c.x["dout"]).sum(axis=0))),
        _Mistake("the row sums are broadcast across the columns: sum(axis=-1) without keepdims=True gives shape "
                 "(N,), which lines up with the last axis; use keepdims=True (or s[:, None])",
                 _if_square(lambda c: _softmax_with(c, (c.x["out"] * c.x["dout"]).sum(axis=-1)[None, :]))),
        _Mistake("out * (1 - out) * dout keeps only the diagonal of the softmax Jacobian; the off-diagonal "
                 "terms give dinp = out * (dout - sum(out * dout) over the row)",
                 lambda c: {"dinp": c.x["out"] * (1 - c.x["out"]) * c.x["dout"]}),
        _Mistake("the row sum is sum(out * dout), weighted by out, not sum(dout)",
                 lambda c: _softmax_with(c, c.x["dout"].sum(axis=-1, keepdims=True))),
    ])


# ------------------------------------------------------------------------------------------------------------
# layernorm_backward(dout (N,C), inp (N,C), weight (C,), mean (N,), rstd (N,), dinp (N,C), dweight (C,), dbias (C,))
# ------------------------------------------------------------------------------------------------------------
def _make_layernorm(rng, dt, size, k):
    if size == "small":
        N = C = _awkward(rng, 5, 24)
        if k == 1:
            N, C = _awkward(rng, 3, 40), _awkward(rng, 4, 40)
            C = C if C != N else C + 1
    else:
        N, C = 768, 768
        if k == 1:
            N = _awkward(rng, 1000, 4096)
    c = _Case(dt, {"N": N, "C": C})
    c.add_float("dout", ("N", "C"), _rows(rng, (N, C)))
    inp = c.add_float("inp", ("N", "C"), _rows(rng, (N, C)) + rng.standard_normal((N, 1)))  # rows: own scale, offset
    c.add_float("weight", ("C",), rng.normal(1.0, 0.5, C))
    mean, rstd = ref.layernorm_stats(inp)
    c.add_float("mean", ("N",), mean)                   # the forward's statistics, rounded to dtype
    c.add_float("rstd", ("N",), rstd)
    for name, sym in (("dinp", ("N", "C")), ("dweight", ("C",)), ("dbias", ("C",))):
        c.add_output(name, sym)
    x = c.x
    x["xhat"] = (x["inp"] - x["mean"][:, None]) * x["rstd"][:, None]
    x["g"] = x["dout"] * x["weight"]
    return c


def _expected_layernorm(c):
    x = c.x
    _, cache = ref.layernorm_forward(x["inp"], x["weight"], np.zeros(c.dims["C"]))
    cache["mean"], cache["rstd"] = x["mean"], x["rstd"]   # the statistics your function was given
    dinp, dweight, dbias = ref.layernorm_backward(x["dout"], cache)
    return {"dinp": dinp, "dweight": dweight, "dbias": dbias}


def _ln_dinp(c, g=None, mean_term=True, xhat_term=True, rstd=True):
    x = c.x
    g = x["g"] if g is None else g
    xhat = x["xhat"]
    d = g.copy()
    if mean_term:
        d -= g.mean(axis=-1, keepdims=True)
    if xhat_term:
        d -= xhat * (g * xhat).mean(axis=-1, keepdims=True)
    return {"dinp": d * x["rstd"][:, None] if rstd else d}


_LAYERNORM = _Op(
    "layernorm_backward", _make_layernorm, _expected_layernorm, n_cases=2,
    terms=lambda c: {"dinp": float(np.abs(c.x["g"] * c.x["rstd"][:, None]).max())},
    formula="xhat = (inp - mean) * rstd, g = dout * weight; dinp = rstd * (g - mean(g) - xhat * mean(g * xhat)) "
            "(means over the C channels of a row); dweight = (dout * xhat).sum(axis=0); dbias = dout.sum(axis=0)",
    shape_hint="dweight and dbias are (C,): sum over the N rows (axis=0); per-row means (over C) need "
               "keepdims=True (or [:, None]) to broadcast against (N, C); mean and rstd are (N,): use "
               "mean[:, None]",
    mistakes=[
        _Mistake("dinp is missing the mean term: subtract mean(g) over the row's C channels (g = dout * weight); "
                 "it comes from mean depending on every x: dinp = rstd * (g - mean(g) - xhat * mean(g * xhat))",
                 lambda c: _ln_dinp(c, mean_term=False)),
        _Mistake("dinp is missing the xhat * mean(g * xhat) term (from rstd depending on every x): "
                 "dinp = rstd * (g - mean(g) - xhat * mean(g * xhat))",
                 lambda c: _ln_dinp(c, xhat_term=False)),
        _Mistake("dinp = rstd * dout * weight treats mean and rstd as constants, but they depend on x too: "
                 "dinp = rstd * (g - mean(g) - xhat * mean(g * xhat))",
                 lambda c: _ln_dinp(c, mean_term=False, xhat_term=False)),
        _Mistake("dinp ignores weight: the gradient reaching xhat is g = dout * weight (out = xhat * weight + "
                 "bias); use g in all three terms",
                 lambda c: _ln_dinp(c, g=c.x["dout"])),
        _Mistake("dinp is missing the final factor rstd: dinp = rstd * (g - mean(g) - xhat * mean(g * xhat))",
                 lambda c: _ln_dinp(c, rstd=False)),
        _Mistake("dweight and dbias are reduced over the wrong axis: they sum over the N rows (axis=0), one value "
                 "per channel: dweight = (dout * xhat).sum(axis=0), dbias = dout.sum(axis=0)",
                 _if_square(lambda c: {"dweight": (c.x["dout"] * c.x["xhat"]).sum(axis=1),
                                       "dbias": c.x["dout"].sum(axis=1)})),
        _Mistake("dweight sums dout * xhat (the normalized input), not dout * inp",
                 lambda c: {"dweight": (c.x["dout"] * c.x["inp"]).sum(axis=0)}),
        _Mistake("dweight is not multiplied by xhat: dweight = (dout * xhat).sum(axis=0); dbias = dout.sum(axis=0)",
                 lambda c: {"dweight": c.x["dout"].sum(axis=0)}),
        _Mistake("dbias is not computed: dbias = dout.sum(axis=0) (sum over the N rows)",
                 lambda c: {"dbias": np.zeros(c.dims["C"])}),
        _Mistake("dbias was never written (it still holds the NaN it started with): dbias = dout.sum(axis=0), "
                 "written into the array: dbias[...] = ...",
                 lambda c: {"dbias": np.full(c.dims["C"], np.nan)}),
    ])


# ------------------------------------------------------------------------------------------------------------
# gelu_backward(dout (n,), inp (n,), dinp (n,))
# ------------------------------------------------------------------------------------------------------------
_S = math.sqrt(2.0 / math.pi)
_K = 0.044715


def _make_gelu(rng, dt, size, k):
    n = _awkward(rng, 40, 300) if size == "small" else _awkward(rng, 1_000_000, 4096 * 3072)
    c = _Case(dt, {"n": n})
    c.add_float("dout", ("n",), rng.standard_normal(n) * _scales(rng, n))
    c.add_float("inp", ("n",), rng.standard_normal(n) * 10.0 ** rng.uniform(-0.5, 0.5, n))  # mostly in [-4, 4]
    c.add_output("dinp", ("n",))
    return c


def _expected_gelu(c):
    _, cache = ref.gelu_forward(c.x["inp"])
    return {"dinp": ref.gelu_backward(c.x["dout"], cache)}


def _gelu_local(x, dudx=None, first=True, second=True, sech2=True):
    t = np.tanh(_S * (x + _K * x ** 3))
    dudx = _S * (1 + 3 * _K * x ** 2) if dudx is None else dudx
    local = np.zeros_like(x)
    if first:
        local += 0.5 * (1 + t)
    if second:
        local += 0.5 * x * ((1 - t * t) if sech2 else (1 - t)) * dudx
    return local


def _gelu_erf(c):
    x = c.x["inp"]
    erf = np.frompyfunc(math.erf, 1, 1)
    cdf = 0.5 * (1 + erf(x / math.sqrt(2)).astype(np.float64))
    pdf = np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
    return {"dinp": c.x["dout"] * (cdf + x * pdf)}


def _gelu_terms(c):
    """dinp = dout * gelu'(x) with gelu' of order 1 (in [-0.17, 1.13]): errors scale with |dout|. (Near x = -0.75
    gelu' cancels to 0, and in fp32 1 - tanh(u)^2 loses its digits once |u| > 8: a correct kernel's error there
    is relative to dout, not to the tiny result.)"""
    return {"dinp": float(np.abs(c.x["dout"]).max())}


_GELU = _Op(
    "gelu_backward", _make_gelu, _expected_gelu, terms=_gelu_terms,
    formula="u = sqrt(2/pi) (x + 0.044715 x^3), t = tanh(u); dinp = dout * (0.5 (1 + t) + 0.5 x (1 - t^2) "
            "sqrt(2/pi) (1 + 3 * 0.044715 x^2))",
    shape_hint="gelu_backward is elementwise on 1-D arrays of length n: dinp[i] depends on dout[i], inp[i] only",
    mistakes=[
        _Mistake("this is the derivative of the exact (erf) GELU; GPT-2 uses the tanh approximation: "
                 "dinp = dout * (0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2))",
                 _gelu_erf),
        _Mistake("du/dx is missing the 3 * 0.044715 x^2 term: u = sqrt(2/pi) (x + 0.044715 x^3), so "
                 "du/dx = sqrt(2/pi) (1 + 3 * 0.044715 x^2)",
                 lambda c: {"dinp": c.x["dout"] * _gelu_local(c.x["inp"], dudx=_S)}),
        _Mistake("du/dx: the derivative of 0.044715 x^3 is 3 * 0.044715 x^2 (the factor 3 is missing)",
                 lambda c: {"dinp": c.x["dout"] * _gelu_local(c.x["inp"], dudx=_S * (1 + _K * c.x["inp"] ** 2))}),
        _Mistake("the chain rule: multiply the local derivative by dout (dinp = dout * gelu'(x))",
                 lambda c: {"dinp": _gelu_local(c.x["inp"])}),
        _Mistake("product rule: out = 0.5 x (1 + tanh(u)) gives two terms, 0.5 (1 + tanh(u)) is missing",
                 lambda c: {"dinp": c.x["dout"] * _gelu_local(c.x["inp"], first=False)}),
        _Mistake("product rule: the 0.5 x (1 - tanh(u)^2) du/dx term is missing",
                 lambda c: {"dinp": c.x["dout"] * _gelu_local(c.x["inp"], second=False)}),
        _Mistake("tanh'(u) = 1 - tanh(u)^2 (squared)",
                 lambda c: {"dinp": c.x["dout"] * _gelu_local(c.x["inp"], sech2=False)}),
    ])


# ------------------------------------------------------------------------------------------------------------
# crossentropy_backward(logits (N,V), targets (N,) int32, dlogits (N,V))   [dloss = 1, mean over N rows]
# ------------------------------------------------------------------------------------------------------------
def _make_crossentropy(rng, dt, size, k):
    if size == "small":
        N, V = _awkward(rng, 3, 40), _awkward(rng, 5, 70)
        V = V if V != N else V + 1
    else:
        N, V = _awkward(rng, 256, 1024), 50257
    c = _Case(dt, {"N": N, "V": V})
    c.add_float("logits", ("N", "V"), _rows(rng, (N, V), -1.0, 0.7))
    c.add_index("targets", ("N",), rng.integers(0, V, N))
    c.add_output("dlogits", ("N", "V"))
    c.x["probs"], _ = ref.softmax_forward(c.x["logits"])
    c.x["onehot"] = np.zeros((N, V))
    c.x["onehot"][np.arange(N), c.x["targets"]] = 1.0
    return c


def _expected_crossentropy(c):
    _, cache = ref.crossentropy_forward(c.x["logits"], c.x["targets"])
    return {"dlogits": ref.crossentropy_backward(1.0, cache)}


def _ce_broadcast_onehot(c):
    d = c.x["probs"].copy()
    d[:, c.x["targets"]] -= 1.0
    return {"dlogits": d / c.dims["N"]}


_CROSSENTROPY = _Op(
    "crossentropy_backward", _make_crossentropy, _expected_crossentropy,
    terms=lambda c: {"dlogits": 1.0 / c.dims["N"]},         # probs - onehot: 1 - p cancels when p is near 1
    formula="probs = softmax(logits) over each row; dlogits = (probs - onehot(targets)) / N",
    shape_hint="logits and dlogits are (N, V), targets (N,): probs = softmax over axis=-1 (keepdims=True for "
               "the max and the sum), then dlogits[np.arange(N), targets] -= 1, and divide by N",
    mistakes=[
        _Mistake("the loss is the mean over the N rows, so every gradient is divided by N: "
                 "dlogits = (probs - onehot) / N",
                 lambda c: {"dlogits": c.x["probs"] - c.x["onehot"]}),
        _Mistake("subtract 1 at each row's target: dlogits = (probs - onehot(targets)) / N",
                 lambda c: {"dlogits": c.x["probs"] / c.dims["N"]}),
        _Mistake("subtract 1 only at each row's own target: d[np.arange(N), targets] -= 1, not d[:, targets] "
                 "(that subtracts every row's target in every row)",
                 _ce_broadcast_onehot),
        _Mistake("use probs = softmax(logits) (over each row, max subtracted), not the raw logits",
                 lambda c: {"dlogits": (c.x["logits"] - c.x["onehot"]) / c.dims["N"]}),
        _Mistake("the softmax runs over each row's V logits (axis=-1, keepdims=True), not over axis 0",
                 lambda c: {"dlogits": (ref.softmax_forward(c.x["logits"].T)[0].T - c.x["onehot"]) / c.dims["N"]}),
    ])


# ------------------------------------------------------------------------------------------------------------
# attention_backward(dout (B,T,C), qkv (B,T,3C), att (B,nh,T,T), dqkv (B,T,3C), n_head)
# ------------------------------------------------------------------------------------------------------------
def _make_attention(rng, dt, size, k):
    if size == "small":
        B, T, nh, hs = int(rng.integers(1, 3)), int(rng.integers(3, 10)), int(rng.integers(2, 4)), int(rng.integers(3, 6))
    else:
        B, T, nh, hs = int(rng.integers(1, 3)), _awkward(rng, 200, 1024), 12, 64
    C = nh * hs
    c = _Case(dt, {"B": B, "T": T, "C": C, "3C": 3 * C, "nh": nh, "hs": hs})
    c.add_float("dout", ("B", "T", "C"), _rows(rng, (B, T, C)))
    qkv = c.add_float("qkv", ("B", "T", "3C"), _rows(rng, (B, T, 3 * C), -0.3, 0.3))
    _, cache = ref.attention_forward(qkv, nh)
    c.add_float("att", ("B", "nh", "T", "T"), cache["att"])   # the forward's attention, rounded to dtype
    c.add_output("dqkv", ("B", "T", "3C"))
    c.scalars["n_head"] = nh
    return c


def _expected_attention(c):
    _, cache = ref.attention_forward(c.x["qkv"], c.scalars["n_head"])
    cache["att"] = c.x["att"]                                  # the att your function was given
    return {"dqkv": ref.attention_backward(c.x["dout"], cache)}


def _heads(x, nh, wrong=False):
    B, T, C = x.shape
    if wrong:
        return x.reshape(B, nh, T, C // nh)
    return x.reshape(B, T, nh, C // nh).transpose(0, 2, 1, 3)


def _merge(x, wrong=False):
    B, nh, T, hs = x.shape
    if wrong:
        return x.reshape(B, T, nh * hs)
    return x.transpose(0, 2, 1, 3).reshape(B, T, nh * hs)


def _attention_terms(c):
    """Size of the terms dq, dk, dv are summed from (one value per part of dqkv = [dq | dk | dv]): the softmax
    backward dpreatt = att * (datt - sum(att * datt)) cancels, so dq and dk can be much smaller than them."""
    x, nh = c.x, c.scalars["n_head"]
    C = x["dout"].shape[-1]
    q, k, v = (_heads(x["qkv"][..., i * C:(i + 1) * C], nh) for i in range(3))
    dy, att = _heads(x["dout"], nh), x["att"]
    datt = dy @ v.swapaxes(-1, -2)                                               # (B, nh, T, T)
    D = np.abs(att * datt) + att * np.abs((att * datt).sum(-1, keepdims=True))   # >= |dpreatt| term by term
    s = 1.0 / math.sqrt(C // nh)
    return {"dqkv": [s * float((D @ np.abs(k)).max()), s * float((D.swapaxes(-1, -2) @ np.abs(q)).max()),
                     float((att.swapaxes(-1, -2) @ np.abs(dy)).max())]}


def _attention_variant(c, scale=True, rowsum=True, dk_t=True, dv_t=True, wrong_heads=False, mask=True):
    x, nh = c.x, c.scalars["n_head"]
    C = x["dout"].shape[-1]
    hs = C // nh
    q, k, v = (_heads(x["qkv"][..., i * C:(i + 1) * C], nh, wrong_heads) for i in range(3))
    dy = _heads(x["dout"], nh, wrong_heads)
    att = x["att"]
    if not mask:  # att recomputed from q, k without the causal mask
        att = ref.softmax_forward(q @ k.swapaxes(-1, -2) / math.sqrt(hs))[0]
    s = 1.0 / math.sqrt(hs) if scale else 1.0
    datt = dy @ v.swapaxes(-1, -2)                                       # (B, nh, T, T)
    dv = (att.swapaxes(-1, -2) if dv_t else att) @ dy                    # (B, nh, T, hs)
    dpre = att * (datt - (att * datt).sum(-1, keepdims=True)) if rowsum else att * datt
    dq = dpre @ k * s
    dk = (dpre.swapaxes(-1, -2) if dk_t else dpre) @ q * s
    return {"dqkv": np.concatenate([_merge(g, wrong_heads) for g in (dq, dk, dv)], axis=-1)}


_ATTENTION = _Op(
    "attention_backward", _make_attention, _expected_attention, parts={"dqkv": 3}, terms=_attention_terms,
    formula="per head: datt = dy @ v^T, dv = att^T @ dy, dpreatt = att * (datt - sum(att * datt, -1)), "
            "dq = dpreatt @ k / sqrt(hs), dk = dpreatt^T @ q / sqrt(hs); dqkv = [dq | dk | dv] on the last axis",
    shape_hint="qkv and dqkv are (B, T, 3C) = [q | k | v] along the last axis; per head q, k, v, dy are (B, nh, T, "
               "hs) (reshape (B, T, nh, hs), then transpose), att is (B, nh, T, T)",
    mistakes=[
        _Mistake("your gradient matches attention without the causal mask: position t gets no gradient from "
                 "t2 > t (att is 0 there; use the att you are given, or mask before the softmax if you recompute it)",
                 lambda c: _attention_variant(c, mask=False)),
        _Mistake("dq and dk are missing the 1/sqrt(hs) scale: preatt = q @ k^T / sqrt(hs), so "
                 "dq = dpreatt @ k / sqrt(hs) and dk = dpreatt^T @ q / sqrt(hs)",
                 lambda c: _attention_variant(c, scale=False)),
        _Mistake("the softmax backward is missing its row-sum term: dpreatt = att * (datt - sum(att * datt, "
                 "axis=-1, keepdims=True))",
                 lambda c: _attention_variant(c, rowsum=False)),
        _Mistake("missing transpose in dk: dk = dpreatt^T @ q (sum over the query positions t), not dpreatt @ q",
                 lambda c: _attention_variant(c, dk_t=False)),
        _Mistake("missing transpose in dv: dv = att^T @ dy (sum over the query positions t), not att @ dy",
                 lambda c: _attention_variant(c, dv_t=False)),
        _Mistake("the heads are split wrong: channel c of head h is at h*hs + c, so reshape (B, T, C) -> "
                 "(B, T, nh, hs) and transpose to (B, nh, T, hs) (and the reverse for dq, dk, dv), not a "
                 "direct reshape to (B, nh, T, hs)",
                 lambda c: _attention_variant(c, wrong_heads=True)),
    ])


# ------------------------------------------------------------------------------------------------------------
# encoder_backward(dout (B,T,C), idx (B,T) int32, dwte (V,C), dwpe (maxT,C))   [zero, then scatter-add]
# ------------------------------------------------------------------------------------------------------------
def _make_encoder(rng, dt, size, k):
    if size == "small":
        B, T, C, V = int(rng.integers(2, 4)), _awkward(rng, 3, 12), _awkward(rng, 3, 20), _awkward(rng, 8, 40)
        maxT = T + int(rng.integers(1, 6))
    else:
        B, T, C, V, maxT = int(rng.integers(4, 9)), _awkward(rng, 200, 1024), 768, 50257, 1024
        T = min(T, maxT - 1)
    c = _Case(dt, {"B": B, "T": T, "C": C, "V": V, "maxT": maxT})
    c.add_float("dout", ("B", "T", "C"), _rows(rng, (B, T, C)))
    used = rng.choice(V, size=max(2, min(V - 1, (B * T) // 2, V // 2)), replace=False)  # some tokens never appear
    idx = rng.choice(used, size=(B, T))
    idx[-1, -1] = idx[0, 0]                               # at least one repeated token, guaranteed
    c.add_index("idx", ("B", "T"), idx)
    c.add_output("dwte", ("V", "C"))
    c.add_output("dwpe", ("maxT", "C"))
    c.x["counts"] = np.bincount(idx.ravel(), minlength=V)  # how many times each token appears
    return c


def _expected_encoder(c):
    d = c.dims
    _, cache = ref.encoder_forward(c.x["idx"], np.zeros((d["V"], d["C"])), np.zeros((d["maxT"], d["C"])))
    dwte, dwpe = ref.encoder_backward(c.x["dout"], cache)
    return {"dwte": dwte, "dwpe": dwpe}


def _encoder_overwrite(c):
    d = c.dims
    dwte = np.zeros((d["V"], d["C"]))
    dwte[c.x["idx"]] = c.x["dout"]                        # repeated tokens: the last one wins
    dwpe = np.zeros((d["maxT"], d["C"]))
    dwpe[:d["T"]] = c.x["dout"][-1]                       # no sum over the batch: the last b wins
    return {"dwte": dwte, "dwpe": dwpe}


def _encoder_lost_repeats(c, name, ours, expected, bad):
    """Only rows that collect several contributions are wrong: an overwrite or a race (no atomic add)."""
    if name == "dwte":
        many = c.x["counts"] >= 2
    else:
        many = np.zeros(c.dims["maxT"], dtype=bool)
        many[:c.dims["T"]] = c.dims["B"] >= 2
    bad_rows = bad.any(axis=1)
    return bool(bad_rows.any()) and not (bad_rows & ~many).any() and bool(np.isfinite(ours).all())


def _encoder_unused_nan(c):
    e = _expected_encoder(c)
    e["dwte"][c.x["counts"] == 0] = np.nan
    e["dwpe"][c.dims["T"]:] = np.nan
    return e


_ENCODER = _Op(
    "encoder_backward", _make_encoder, _expected_encoder, accumulates=True,
    formula="dwte = 0, dwpe = 0; then for every (b, t): dwte[idx[b, t]] += dout[b, t] and dwpe[t] += dout[b, t]",
    shape_hint="dout is (B, T, C), idx (B, T), dwte (V, C), dwpe (maxT, C) with maxT >= T: only dwpe[:T] gets "
               "gradient; np.add.at(dwte, idx, dout) scatter-adds, dwpe[:T] = dout.sum(axis=0)",
    mistakes=[
        _Mistake("the output still holds the NaN it started with: outputs arrive filled with garbage (here NaN), "
                 "so set dwte and dwpe to 0 first (dwte[...] = 0), then add dout into them (and write into the "
                 "arrays you were given: dwte = ... only rebinds the name)",
                 lambda c: {"dwte": np.full(c.outputs["dwte"], np.nan), "dwpe": np.full(c.outputs["dwpe"], np.nan)}),
        _Mistake("rows that get no gradient must be 0, not left as they came (NaN here): zero all of dwte "
                 "(tokens that never appear in idx) and all of dwpe (positions t >= T), then add",
                 _encoder_unused_nan),
        _Mistake("tokens that appear several times must collect every contribution: dwte[idx] += dout (and "
                 "dwte[idx] = dout) keeps only one of them; use np.add.at(dwte, idx, dout) in NumPy, "
                 "cuda.atomic.add in a kernel. dwpe[t] sums dout[b, t] over the whole batch",
                 _encoder_overwrite, _encoder_lost_repeats),
        _Mistake("dwpe[t] sums dout[b, t] over the whole batch b: dwpe[:T] = dout.sum(axis=0)",
                 lambda c: {"dwpe": np.concatenate([c.x["dout"][0], np.zeros((c.dims["maxT"] - c.dims["T"],
                                                                              c.dims["C"]))])}),
    ])


# ------------------------------------------------------------------------------------------------------------
# residual_backward(dout (n,), da (n,), db (n,))
# ------------------------------------------------------------------------------------------------------------
def _make_residual(rng, dt, size, k):
    n = _awkward(rng, 40, 300) if size == "small" else _awkward(rng, 1_000_000, 4096 * 768)
    c = _Case(dt, {"n": n})
    c.add_float("dout", ("n",), rng.standard_normal(n) * _scales(rng, n))
    c.add_output("da", ("n",))
    c.add_output("db", ("n",))
    return c


def _expected_residual(c):
    da, db = ref.residual_backward(c.x["dout"], None)
    return {"da": da, "db": db}


_RESIDUAL = _Op(
    "residual_backward", _make_residual, _expected_residual,
    formula="out = a + b, so da = dout and db = dout (copied into both outputs)",
    shape_hint="dout, da and db are all 1-D of length n",
    mistakes=[
        _Mistake("db was never written: out = a + b sends the gradient to both branches, write da = dout AND "
                 "db = dout", lambda c: {"db": np.full(c.dims["n"], np.nan)}),
        _Mistake("da was never written: out = a + b sends the gradient to both branches, write da = dout AND "
                 "db = dout", lambda c: {"da": np.full(c.dims["n"], np.nan)}),
        _Mistake("the gradient is copied to both branches, not split between them: da = dout and db = dout",
                 lambda c: {"da": 0.5 * c.x["dout"], "db": 0.5 * c.x["dout"]}),
        _Mistake("db = dout too: out = a + b depends on b with slope 1",
                 lambda c: {"db": np.zeros(c.dims["n"])}),
        _Mistake("da = dout too: out = a + b depends on a with slope 1",
                 lambda c: {"da": np.zeros(c.dims["n"])}),
    ])


_OPS = {op.name: op for op in (_LINEAR, _SOFTMAX, _LAYERNORM, _GELU, _CROSSENTROPY, _ATTENTION, _ENCODER, _RESIDUAL)}


# ------------------------------------------------------------------------------------------------------------
# Comparing, diagnosing
# ------------------------------------------------------------------------------------------------------------
def _normalize_dtype(dtype) -> np.dtype:
    name = dtype.lower() if isinstance(dtype, str) else None
    name = _ALIASES.get(name, name)
    try:
        if name == "bfloat16":
            import ml_dtypes
            dt = np.dtype(ml_dtypes.bfloat16)
        else:
            dt = np.dtype(name if name is not None else dtype)
    except (TypeError, ImportError):
        dt = None
    if dt is None or dt.name not in TOLERANCES:
        raise ValueError(f"dtype={dtype!r} is not supported by the checkers; use one of: "
                         + ", ".join(TOLERANCES) + " (e.g. np.float32)")
    return dt


def _poison(shape, dt) -> np.ndarray:
    uint, bits = _POISON[dt.name]
    return np.full(shape, bits, dtype=uint).view(dt)


def _is_poison(a: np.ndarray) -> np.ndarray:
    uint, bits = _POISON[a.dtype.name] if a.dtype.name in _POISON else (None, None)
    if uint is None or a.dtype.itemsize != np.dtype(uint).itemsize:
        return np.zeros(a.shape, dtype=bool)
    return np.ascontiguousarray(a).view(uint) == bits


def _compare(o, e, tol, terms=0.0, parts=1):
    """Per-element verdict: (bad mask, |o - e|, rel err, atol).

    M = max|e| over the output, or the size of the terms it is computed from when that is larger: where a
    result is a near-cancellation of big terms (softmax backward with a peaky row: dout - sum(out * dout)), a
    correct function's rounding error is relative to the terms, not to the small result.
    parts > 1 splits the last axis into that many blocks with their own M (dqkv = [dq | dk | dv]: a small dq
    is judged against its own size, not against dv's).
    """
    e_abs = np.where(np.isfinite(e), np.abs(e), 0.0)
    floor = np.maximum(np.asarray(terms, dtype=np.float64), np.finfo(np.float64).tiny)  # scalar or (parts,)
    if parts > 1 and e.ndim and e.shape[-1] % parts == 0 and e.size:
        per = e_abs.reshape(-1, parts, e.shape[-1] // parts).max(axis=(0, 2))       # (parts,)
        M = np.repeat(np.maximum(per, floor), e.shape[-1] // parts)                 # (last axis,)
    else:
        M = max(float(e_abs.max()) if e_abs.size else 0.0, float(np.max(floor)))
    err = np.abs(o - e)
    with np.errstate(invalid="ignore"):
        ok = err <= tol * (np.abs(e) + M)          # NaN compares False: never passes
        rel = err / (np.abs(e) + M)
    return ~ok, err, rel, tol * float(np.max(M))


def _close(o, m, tol) -> bool:
    """o matches m within tol (same scaled rule), NaN where m is NaN counts as a match."""
    if o.shape != m.shape:
        return False
    nan_m = np.isnan(m)
    if (np.isnan(o) != nan_m).any():
        return False
    if nan_m.all():
        return True
    bad, _, _, _ = _compare(o[~nan_m], m[~nan_m], tol)
    return not bad.any()


def _fmt(v, other=None) -> str:
    """4 significant digits, more when needed to tell v from `other`."""
    if v is None or math.isnan(v):
        return "nan"
    for digits in (4, 6, 9):
        text = f"{v:.{digits}g}"
        if other is None or math.isnan(other) or text != f"{other:.{digits}g}":
            break
    return text


def _idx(index) -> str:
    return "[" + ", ".join(str(int(i)) for i in index) + "]"


def _factor_name(c: float, dims: dict) -> str:
    """'x0.5', 'x-1', 'x37 (= N)', 'x0.027 (= 1/N)', 'x2 (= sqrt(hs))'."""
    text = f"x{c:.3g}"
    for sym, d in dims.items():
        if d <= 1:
            continue
        for value, label in ((d, sym), (1 / d, f"1/{sym}"), (math.sqrt(d), f"sqrt({sym})"),
                             (1 / math.sqrt(d), f"1/sqrt({sym})")):
            if abs(c - value) <= 1e-3 * abs(value) and label not in ("2", "1/2"):
                return f"{text} (= {label})"
    return text


def _rows_text(bad: np.ndarray) -> str:
    """Where the wrong elements are: 'the last 2 rows (35..36)', 'rows 3, 17', 'the last 7 elements', ''."""
    if bad.ndim == 0:
        return ""
    lead = bad.reshape(bad.shape[0], -1).any(axis=1) if bad.ndim > 1 else bad
    k, n = int(lead.sum()), lead.size
    if k == n or k == 0:
        return ""
    unit = "row" if bad.ndim > 1 else "element"
    first = int(np.argmax(lead))
    if lead[first:].all():
        return f"only the last {unit} ({first})" if k == 1 else f"only the last {k} {unit}s ({first}..{n - 1})"
    if k <= 5:
        return f"only {unit}s " + ", ".join(str(int(i)) for i in np.flatnonzero(lead))
    return f"{k} of {n} {unit}s"


def _generic_hint(op, case, name, raw, o, e, bad, tol, returned) -> str:
    """A hint from the pattern of the wrong elements, when no known mistake matches."""
    poison = _is_poison(raw)
    n = o.size
    if poison.all():
        extra = (" Your function returned a value: the checker ignores it, it reads the output arrays."
                 if returned is not None else "")
        return (f"{name} was never written (it still holds the NaN we filled it with): write into the array you "
                f"were given ({name}[...] = ... or in a kernel {name}[i] = ...); {name} = ... only rebinds the "
                f"name to a new array the checker never sees. If you accumulate (+=), zero it first.{extra}")
    if poison.any():
        k = int(poison.sum())
        where = _rows_text(poison)
        return (f"{k} of {n} elements of {name} were never written (still NaN; first at "
                f"{_idx(np.argwhere(poison)[0])}{'; ' + where if where else ''}): does your grid (or loop) cover "
                f"every element, including the last partial block (blocks = ceil(n / threads))? Did you write "
                f"into the output ({name}[...] = ...) rather than rebinding the name?")
    nonfinite = ~np.isfinite(o)
    if nonfinite.any():
        k = int(nonfinite.sum())
        return (f"{k} of {n} elements of {name} are NaN/inf (first at {_idx(np.argwhere(nonfinite)[0])}): they come "
                f"from reading an output before writing it (outputs start as NaN: zero before +=), 0/0, inf - inf, "
                f"or exp overflow (subtract the row max)")
    # a constant factor?
    ee = float((e * e).sum())
    if ee > 0:
        c = float((o * e).sum()) / ee
        if abs(c - 1) > _slack(tol) and c != 0 and _close(o, c * e, _slack(tol)):
            what = "the sign is flipped" if abs(c + 1) < 1e-3 else "off by a constant factor"
            return f"{name} is {what} ({_factor_name(c, case.dims)}): check the scale. {op.formula}"
    if o.ndim == 2 and o.shape[0] == o.shape[1] and _close(o, e.T, _slack(tol)):
        return f"{name} looks transposed: it should be laid out {case.sym[name]}. {op.formula}"
    if not o.any():
        return f"{name} is all zeros. {op.formula}"
    if o.size > 1 and (o == o.flat[0]).all() and not (e == e.flat[0]).all():
        return (f"every element of {name} has the same value ({_fmt(float(o.flat[0]))}): a scalar broadcast into "
                f"the array (a reduction over all axes?) where each element needs its own value. {op.formula}")
    where = _rows_text(bad)
    if where.startswith("only the last"):
        return f"{name} is right except {where[5:]}: check your loop bound / grid size (the last partial block)."
    count = f"{int(bad.sum())} of {n} elements of {name} are wrong" + (f" ({where})" if where else "")
    return f"{count}. {op.formula}"


def _diagnose(op, case, ours_raw, ours, expected, bads, wrong, tol, returned) -> str:
    """Known mistakes first (per wrong output), then generic patterns; at most two hints."""
    cache = {}

    def mistake_outputs(i, m):
        if i not in cache:
            try:
                cache[i] = m.outputs(case) if m.outputs is not None else {}
            except Exception:  # a mistake that does not apply to these shapes
                cache[i] = {}
        return cache[i]

    if not op.accumulates and all(_is_poison(r).all() for r in ours_raw.values()):
        name = wrong[0]  # nothing at all was written: the rebinding hint, whatever the op
        hint = _generic_hint(op, case, name, ours_raw[name], ours[name], expected[name], bads[name], tol, returned)
        if len(ours_raw) > 1:
            names = ", ".join(ours_raw)
            hint = hint.replace(f"{name} was never written", f"nothing was written ({names} still hold the NaN "
                                                             f"we filled them with)", 1)
            hint = hint.replace(" (it still holds the NaN we filled it with)", "", 1)
        return hint

    def known(name):
        """The hint of the first mistake whose output equals yours; else of the first matching pattern test."""
        for i, m in enumerate(op.mistakes):
            wrong_out = mistake_outputs(i, m).get(name)
            if wrong_out is not None and np.shape(wrong_out) == ours[name].shape:
                wrong_out = np.asarray(wrong_out, dtype=np.float64)
                if not _close(wrong_out, expected[name], tol) and _close(ours[name], wrong_out, _slack(tol)):
                    return m.hint
        for m in op.mistakes:
            try:
                if m.test is not None and m.test(case, name, ours[name], expected[name], bads[name]):
                    return m.hint
            except Exception:  # a pattern test that does not apply
                pass
        return None

    hints = []
    for name in wrong:
        hint = known(name)
        if hint is None and not hints:
            hint = _generic_hint(op, case, name, ours_raw[name], ours[name], expected[name], bads[name], tol, returned)
        if hint is not None and hint not in hints:
            hints.append(hint)
        if len(hints) == 2:
            break
    return " Also: ".join(hints)


def _is_learner_code(filename: str) -> bool:
    """A notebook cell or a file of the learner's: not this package, an installed package or the stdlib."""
    if filename.startswith("<"):
        return filename.startswith(("<ipython-input", "<stdin>", "<string>"))
    if not os.path.isabs(filename):  # compiled extensions report relative .pyx paths
        return False
    f = os.path.abspath(filename)
    here = os.path.dirname(os.path.abspath(__file__))
    stdlib = os.path.abspath(sysconfig.get_paths()["stdlib"])
    return not (f.startswith(here + os.sep) or f.startswith(stdlib + os.sep) or "site-packages" in f
                or "dist-packages" in f)


def _where_raised(exc: BaseException) -> str:
    """'line 12 in my_linear_backward': the innermost frame of the learner's own code, or ''."""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if _is_learner_code(frame.filename):
            return f"line {frame.lineno} in {frame.name}"
    return ""


_SHAPE_WORDS = ("shape", "broadcast", "mismatch", "dimension", "matmul", "out of bounds", "index", "size",
                "aligned")


def _error_hint(op, case, exc) -> str:
    text = f"{type(exc).__name__}: {exc}".lower()
    where = _where_raised(exc)
    at = f" (at {where})" if where else ""
    shapes = f"shapes here: {case.describe_shapes()}"
    if "grid" in text or "launch" in text:
        return (f"check your kernel launch{at}: blocks = (n + threads - 1) // threads covers n elements with at "
                f"least one block; {shapes}")
    if isinstance(exc, (ValueError, IndexError, TypeError)) and any(w in text for w in _SHAPE_WORDS):
        return f"a shape or index problem{at}: check your transposes and axes. {shapes}. {op.shape_hint}"
    return f"the error is in your code{at}; {shapes}"


# ------------------------------------------------------------------------------------------------------------
# Running one check
# ------------------------------------------------------------------------------------------------------------
def _validate(op_name, fn, arrays, dtype, size, seed):
    checker = f"check_{op_name}"
    if not callable(fn):
        raise TypeError(f"{checker}(fn): fn must be your function, got {type(fn).__name__} {fn!r:.60}: pass the "
                        f"function itself, e.g. {checker}({op_name}), without calling it")
    kind = type(fn).__name__
    if kind in ("CUDADispatcher", "FakeCUDAKernel") and "numba" in (type(fn).__module__ or ""):
        raise TypeError(f"{checker}(fn): fn is a Numba kernel; pass a Python function that launches it with "
                        f"the same arguments, e.g. def {op_name}(...): kernel[blocks, threads](...)")
    _arrays.require(arrays)
    dt = _normalize_dtype(dtype)
    if size is None:
        size = "small"
    if size not in SIZES:
        raise ValueError(f"size={size!r}: use one of {', '.join(repr(s) for s in SIZES)} (or None for 'small')")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0):
        raise TypeError(f"seed={seed!r}: use a non-negative int, or None for fresh random inputs")
    return dt, size


def learner_fn_and_seed(name, fn, seed, what="inputs") -> int:
    """The checks every checker starts with: fn is the learner's callable (not its result), seed a non-negative int
    or None. Returns the seed to use (a fresh one for None); raises naming the mistake."""
    if not callable(fn):
        raise TypeError(f"check_{name}(fn): fn must be your function, got {type(fn).__name__} {fn!r:.60}: pass "
                        f"the function itself, without calling it")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0):
        raise TypeError(f"seed={seed!r}: use a non-negative int, or None for fresh random {what}")
    return secrets.randbelow(1_000_000) if seed is None else int(seed)


def _skipped(op: _Op, task, quiet) -> "CheckResult":
    """CuPy/HIP code cannot run without a GPU: say so, record it (the grader leaves it out of the total), go on."""
    msg = (f"{op.name}: skipped - arrays='cupy' runs on a GPU, and this machine runs as '{_device.kind()}' "
           f"({_device.info().reason}); it is checked on a GPU server")
    result = CheckResult(name=op.name, task=task, status="skipped", passed=False, message=msg, arrays="cupy")
    from . import grading
    grading.record(check=f"check_{op.name}", task=task, status="skipped", message=msg)
    if not quiet:
        print(msg)
    return result


def _run(op: _Op, fn, *, arrays="numpy", dtype=np.float32, size=None, seed=None, task=None, quiet=False):
    if arrays == "cupy" and callable(fn) and not _device.has_gpu():
        return _skipped(op, task, quiet)
    dt, size = _validate(op.name, fn, arrays, dtype, size, seed)
    seed = secrets.randbelow(1_000_000) if seed is None else int(seed)
    rng = np.random.default_rng(seed)
    tol = TOLERANCES[dt.name]
    short = _SHORT[dt.name]
    base = dict(name=op.name, task=task, tol=tol, seed=seed, dtype=dt.name, arrays=arrays)
    max_rel_all, max_abs_all = 0.0, 0.0
    result = None

    for k in range(op.n_cases):
        case = op.make(rng, dt, size, k)
        expected = {name: np.asarray(v, dtype=np.float64) for name, v in op.expected(case).items()}
        try:
            dev_in = [_arrays.to_backend(a, arrays) for a in case.inputs.values()]
            dev_out = [_arrays.to_backend(_poison(shape, dt), arrays) for shape in case.outputs.values()]
        except _arrays.BackendUnavailableError:
            raise
        except Exception as exc:  # e.g. a dtype the backend cannot hold
            raise _arrays.BackendUnavailableError(f"could not put {dt.name} arrays on arrays={arrays!r} "
                                                  f"({type(exc).__name__}: {exc}); use another dtype or "
                                                  f"backend") from exc
        info = dict(base, dims=dict(case.dims), inputs={k2: v.copy() for k2, v in case.inputs.items()})
        returned = None
        try:
            returned = fn(*dev_in, *dev_out, *case.scalars.values())
            ours_raw = {name: np.asarray(_arrays.to_numpy(d)) for name, d in zip(case.outputs, dev_out)}
        except NotImplementedError:
            msg = f"{op.name}: not attempted (your function raised NotImplementedError)"
            result = CheckResult(status="not attempted", passed=False, message=msg,
                                 hint="replace the `raise NotImplementedError` with your code", **info)
            break
        except Exception as exc:  # the learner's error is reported, never raised: the notebook goes on
            first = " ".join(str(exc).split())
            first = first if len(first) <= 200 else first[:197] + "..."
            msg = f"{op.name}: error - your function raised {type(exc).__name__}" + (f": {first}" if first else "")
            hint = _error_hint(op, case, exc) + f" (seed {seed})"
            result = CheckResult(status="error", passed=False, message=msg + "\n  hint: " + hint, hint=hint, **info)
            break

        ours = {name: r.astype(np.float64) for name, r in ours_raw.items()}
        bads, stats, atols, wrong = {}, {}, {}, []
        terms = op.terms(case) if op.terms is not None else {}
        for name in case.outputs:
            bad, err, rel, atol = _compare(ours[name], expected[name], tol, terms.get(name, 0.0),
                                           (op.parts or {}).get(name, 1))
            bads[name], atols[name] = bad, atol
            finite = bool(np.isfinite(ours[name]).all())
            stats[name] = (float(err.max()) if finite and err.size else (math.nan if not finite else 0.0),
                           float(rel.max()) if finite and rel.size else (math.nan if not finite else 0.0))
            if bad.any():
                wrong.append(name)
            elif finite:
                max_abs_all = max(max_abs_all, stats[name][0])
                max_rel_all = max(max_rel_all, stats[name][1])
        info["atol"] = atols

        if wrong:
            name = wrong[0]
            index = tuple(int(i) for i in np.argwhere(bads[name])[0])
            mine, exp = float(ours[name][index]), float(expected[name][index])
            max_abs, max_rel = stats[name]
            hint = _diagnose(op, case, ours_raw, ours, expected, bads, wrong, tol, returned)
            changed = [n for n, d in zip(case.inputs, dev_in)
                       if not np.array_equal(np.asarray(_arrays.to_numpy(d)), case.inputs[n], equal_nan=True)]
            if changed:
                hint += f" (Note: your function changed its input{'s' if len(changed) > 1 else ''} " \
                        f"{', '.join(changed)}; inputs are read-only.)"
            msg = (f"{op.name}: wrong - {name} at {_idx(index)}: yours {_fmt(mine, exp)}, expected {_fmt(exp, mine)} "
                   f"(max abs err {max_abs:.2g}, max rel {max_rel:.2g}, tol {tol:g}; seed {seed})")
            result = CheckResult(status="wrong", passed=False, output=name, max_abs=max_abs, max_rel=max_rel,
                                 first_bad=index, ours=mine, expected=exp, hint=hint,
                                 message=msg + "\n  hint: " + hint, **info)
            break

    if result is None:
        n_out = len(case.outputs)
        msg = (f"{op.name}: correct (max rel err {max_rel_all:.2g}, tol {tol:g}, {short}, "
               f"{n_out} output{'s' if n_out > 1 else ''})")
        result = CheckResult(status="correct", passed=True, max_abs=max_abs_all, max_rel=max_rel_all,
                             message=msg, **info)

    from . import grading  # lazily: grading is only needed once a verdict exists
    grading.record(check=f"check_{op.name}", task=task, status=result.status,
                   message=result.message.splitlines()[0])
    if not quiet:
        print(result.message)
    return result


# ------------------------------------------------------------------------------------------------------------
# The public checkers
# ------------------------------------------------------------------------------------------------------------
_SIGNATURE_DOC = """
    fn is called as fn(*inputs, *outputs, *ints) with arrays on the backend `arrays` ("numpy", "cupy", "numba");
    the outputs start filled with NaN and fn must write every element. dtype: np.float32 (default), np.float64,
    np.float16 or "bfloat16". size: "small" (default; simulator-friendly) or "large" (GPU sizes: N up to 4096,
    C = 768). seed: None for fresh random inputs, or the seed printed by a failed check to reproduce it.
    task: a label recorded for grading. quiet: do not print. Returns a CheckResult (truthy when correct);
    errors raised by fn are reported in it, never raised.
"""


def check_linear_backward(fn, *, arrays="numpy", dtype=np.float32, size=None, seed=None, task=None,
                          quiet=False) -> CheckResult:
    """Check fn(dout (N,OC), inp (N,C), weight (C,OC), dinp (N,C), dweight (C,OC), dbias (OC,))."""
    return _run(_LINEAR, fn, arrays=arrays, dtype=dtype, size=size, seed=seed, task=task, quiet=quiet)


def check_softmax_backward(fn, *, arrays="numpy", dtype=np.float32, size=None, seed=None, task=None,
                           quiet=False) -> CheckResult:
    """Check fn(dout (N,n), out (N,n), dinp (N,n)); out is softmax's output (rows sum to 1)."""
    return _run(_SOFTMAX, fn, arrays=arrays, dtype=dtype, size=size, seed=seed, task=task, quiet=quiet)


def check_layernorm_backward(fn, *, arrays="numpy", dtype=np.float32, size=None, seed=None, task=None,
                             quiet=False) -> CheckResult:
    """Check fn(dout (N,C), inp (N,C), weight (C,), mean (N,), rstd (N,), dinp (N,C), dweight (C,), dbias (C,))."""
    return _run(_LAYERNORM, fn, arrays=arrays, dtype=dtype, size=size, seed=seed, task=task, quiet=quiet)


def check_gelu_backward(fn, *, arrays="numpy", dtype=np.float32, size=None, seed=None, task=None,
                        quiet=False) -> CheckResult:
    """Check fn(dout (n,), inp (n,), dinp (n,)) for the tanh-form GELU."""
    return _run(_GELU, fn, arrays=arrays, dtype=dtype, size=size, seed=seed, task=task, quiet=quiet)


def check_crossentropy_backward(fn, *, arrays="numpy", dtype=np.float32, size=None, seed=None, task=None,
                                quiet=False) -> CheckResult:
    """Check fn(logits (N,V), targets (N,) int32, dlogits (N,V)) with dloss = 1 and the loss a mean over N rows."""
    return _run(_CROSSENTROPY, fn, arrays=arrays, dtype=dtype, size=size, seed=seed, task=task, quiet=quiet)


def check_attention_backward(fn, *, arrays="numpy", dtype=np.float32, size=None, seed=None, task=None,
                             quiet=False) -> CheckResult:
    """Check fn(dout (B,T,C), qkv (B,T,3C), att (B,nh,T,T), dqkv (B,T,3C), n_head) (causal attention)."""
    return _run(_ATTENTION, fn, arrays=arrays, dtype=dtype, size=size, seed=seed, task=task, quiet=quiet)


def check_encoder_backward(fn, *, arrays="numpy", dtype=np.float32, size=None, seed=None, task=None,
                           quiet=False) -> CheckResult:
    """Check fn(dout (B,T,C), idx (B,T) int32, dwte (V,C), dwpe (maxT,C)): zero both, then scatter-add."""
    return _run(_ENCODER, fn, arrays=arrays, dtype=dtype, size=size, seed=seed, task=task, quiet=quiet)


def check_residual_backward(fn, *, arrays="numpy", dtype=np.float32, size=None, seed=None, task=None,
                            quiet=False) -> CheckResult:
    """Check fn(dout (n,), da (n,), db (n,))."""
    return _run(_RESIDUAL, fn, arrays=arrays, dtype=dtype, size=size, seed=seed, task=task, quiet=quiet)


for _f in (check_linear_backward, check_softmax_backward, check_layernorm_backward, check_gelu_backward,
           check_crossentropy_backward, check_attention_backward, check_encoder_backward, check_residual_backward):
    _f.__doc__ += _SIGNATURE_DOC

# name -> checker, e.g. CHECKERS["linear_backward"]
CHECKERS = {name: globals()[f"check_{name}"] for name in _OPS}
