"""Checkers: does your backward op compute the right gradients?

Every ``check_<op>_backward(fn, ...)`` calls your destination-passing function the way a kernel is called
(inputs first, then the pre-allocated outputs it must fill, then int scalars; see SPEC/lessons for each
signature) and compares what it wrote with the NumPy reference (``gpullm_lessons.reference``).

How a check works
-----------------
1. Every checker calls your function on a fixed list of cases (``CASE_DIMS``: shapes are deterministic, values
   are fresh random numbers from the seed), chosen so that size cannot fool it: a first case where the shapes
   are square where that helps (N = C = OC: a transpose or an axis mix-up gives wrong numbers the checker can
   recognize); the same shapes again with new values (a function that keeps state between calls, a cached
   result, fails there and is told so); sizes spanning several 16 x 16 tiles along every GEMM axis, several
   blocks of 32 threads and several warps, never a multiple of 16, so there is a partial last tile / block;
   more elements (or rows) than the grid the exercises' launchers cap at (MAX_BLOCKS x THREADS: 2 x 32 in the
   simulator, 4096 x 256 on a GPU), so a kernel without a grid-stride loop fails; awkward shapes (one row,
   n = 1, T = 1, odd and prime sizes, C != OC so a missing transpose fails on shape); rows of very different
   scales. size="small" keeps the simulator cheap; size="large" has GPU sizes; size=None picks "large" when the
   arrays live on a real GPU. The seed is printed when something is wrong: pass ``seed=...`` to get the same
   inputs again.
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
   op (each computed from the same inputs: a missing transpose, a K loop that stops after the first tile, the
   right answer for an earlier call's inputs, ...) and with generic patterns that say where (elements never
   written; everything past the capped grid G = blocks x threads; the last partial block; only the first block
   or tile; a range of rows; every k-th element; a constant factor or flipped sign; a transposed result) and
   prints the matching hint. An exception raised inside your kernel in the CUDA simulator is reported with the
   thread and block that raised it and the likely cause.

HIP tasks: with arrays="cupy" on a machine without a GPU, a checker given ``source=`` (your kernel source) and
``entries=`` grades the source with ``hip_compile_only``: it must compile for NVIDIA (NVRTC, sm_90) and AMD
(hipcc, gfx90a) and pass the portability lint (``hip.lint_source``); status "compiled" (not run).

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
import inspect
import math
import re
import secrets
from typing import Callable, Optional

import numpy as np

from . import arrays as _arrays
from . import device as _device
from . import reference as ref
from . import verdict
from .verdict import STATUSES  # noqa: F401  (checks.STATUSES, as before the core moved out)
from .verdict import DTYPE_SHORT, CheckResult, close, compare, fmt, fmt_index, mistake_slack, where_raised

__all__ = [
    "CheckResult", "TOLERANCES", "CHECKERS",
    "check_linear_backward", "check_softmax_backward", "check_layernorm_backward", "check_gelu_backward",
    "check_crossentropy_backward", "check_attention_backward", "check_encoder_backward",
    "check_residual_backward", "hip_compile_only",
]

SIZES = ("small", "large")

# Relative tolerance per dtype; the absolute floor is tol * M, M the output's magnitude (see the docstring).
TOLERANCES = {"float64": 1e-9, "float32": 1e-5, "float16": 1e-2, "bfloat16": 5e-2}
_ALIASES = {"fp64": "float64", "fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "half": "float16",
            "float": "float32", "double": "float64"}

# The poison: a quiet NaN with a recognizable payload, so "never written" can be told apart from a NaN that
# your arithmetic produced (NumPy on the CPU carries the payload through x + NaN, GPUs do not).
_POISON = {"float64": (np.uint64, 0x7FF80000DEADBEEF), "float32": (np.uint32, 0x7FC0DEAD),
           "float16": (np.uint16, 0x7E5A), "bfloat16": (np.uint16, 0x7FD5)}

# The verdict (CheckResult, STATUSES), how it is recorded and printed, how your function is called, and how numbers
# and indices are written in the messages: gpullm_lessons/verdict.py, the core every checker module shares.


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
    test: Optional[Callable] = None     # (case, name, ours, expected, bad) -> bool, or the hint itself (a str)


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
    terms: Optional[Callable] = None  # case -> {output: size of the terms it is computed from}, see verdict.compare
    parts: Optional[dict] = None      # {output: blocks along the last axis judged separately}, see verdict.compare


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
# The cases, per size: shapes are fixed (values come from the seed). Case 0 is square (N = C = OC), so transposes
# and axis mix-ups give wrong numbers the checker recognizes, not shape errors; case 1 repeats its shapes with new
# values (a function that keeps state between calls fails there); case 2 spans several 16 x 16 tiles along every
# GEMM axis (K, M, P > 16, none a multiple of 16: a partial last tile) with C != OC; case 3 is a single row.
CASE_DIMS = {}
CASE_DIMS["linear_backward"] = {
    "small": [dict(N=7, C=7, OC=7), dict(N=7, C=7, OC=7), dict(N=37, C=20, OC=18), dict(N=1, C=7, OC=3)],
    "large": [dict(N=777, C=777, OC=777), dict(N=777, C=777, OC=777), dict(N=2053, C=771, OC=2309),
              dict(N=1, C=37, OC=19)],
}


def _dims(op_name, size, k) -> dict:
    return dict(CASE_DIMS[op_name][size][k])


def _make_linear(rng, dt, size, k):
    d = _dims("linear_backward", size, k)
    N, C, OC = d["N"], d["C"], d["OC"]
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


def _linear_partial_k(c, name, kept):
    """dinp or dweight summed over the first `kept` of its K products only (K = OC for dinp, N for dweight)."""
    x = c.x
    if name == "dinp":
        return x["dout"][:, :kept] @ x["weight"][:, :kept].T
    return x["inp"][:kept].T @ x["dout"][:kept]


_K_LOOP = ("loop over every tile along K, k0 = 0, TILE, 2 TILE, ... while k0 < K (range(0, K, TILE): ceil(K / TILE) "
           "tiles), accumulating into the same sum, with 0 loaded into the tile for elements past K")


def _linear_k_tiles_test(c, name, ours, expected, bad):
    """A tiled GEMM whose loop over K stops early: after the first tile, or before the partial last one. Returns
    the hint naming how many of the K products were summed and why, or None."""
    if name not in ("dinp", "dweight") or not np.isfinite(ours).all():
        return None
    K = c.dims["OC"] if name == "dinp" else c.dims["N"]
    which = "OC" if name == "dinp" else "N"
    tol = TOLERANCES[c.dtype.name]
    tiles = (16, 32, 64)
    for kept in sorted({min(K, t) for t in tiles} | {(K // t) * t for t in tiles}):
        if not 0 < kept < K:
            continue
        cand = _linear_partial_k(c, name, kept)
        if close(cand, expected, tol) or not close(ours, cand, mistake_slack(tol)):
            continue
        first = [t for t in tiles if kept == min(K, t)]
        floor = [t for t in tiles if kept == (K // t) * t]
        if first and floor:
            why = (f"only the first tile along K is summed ({first[0]} wide), or the partial last tile is skipped "
                   f"(K = {K} is not a multiple of {floor[0]})")
        elif first:
            why = f"only the first tile along K is summed (a {first[0]}-wide tile; K = {K} needs several)"
        else:
            why = (f"the last partial tile along K is skipped (K = {K} is not a multiple of the {floor[0]}-wide "
                   f"tile: range(K // TILE) drops it)")
        return (f"{why}: your {name} equals the sum over the first {kept} of its K = {which} = {K} products. "
                f"In a tiled GEMM, " + _K_LOOP)
    return None


def _k_tile_hints():
    return [
        _Mistake("", test=_linear_k_tiles_test),
        _Mistake("all zeros, as a loop over K // TILE tiles gives when K < TILE (K = OC for dinp, K = N for dweight; "
                 "here K < 16): the partial tile is skipped, and here it is the only one. In a tiled GEMM, " + _K_LOOP,
                 lambda c: {name: np.zeros(c.outputs[name]) for name, K in (("dinp", c.dims["OC"]),
                                                                            ("dweight", c.dims["N"])) if K < 16}),
    ]


_LINEAR = _Op(
    "linear_backward", _make_linear, _expected_linear, n_cases=4,
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
        *_k_tile_hints(),
    ])


# ------------------------------------------------------------------------------------------------------------
# softmax_backward(dout (N,n), out (N,n), dinp (N,n))
# ------------------------------------------------------------------------------------------------------------
# square (axis mix-ups show), the same again, more rows than a capped grid has threads (2 x 32 in the simulator,
# 4096 blocks on a GPU) with rows longer than a warp, one long row
CASE_DIMS["softmax_backward"] = {
    "small": [dict(N=19, n=19), dict(N=19, n=19), dict(N=67, n=45), dict(N=1, n=131)],
    "large": [dict(N=1023, n=1023), dict(N=1023, n=1023), dict(N=4099, n=771), dict(N=1, n=50257)],
}


def _make_softmax(rng, dt, size, k):
    d = _dims("softmax_backward", size, k)
    N, n = d["N"], d["n"]
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
    "softmax_backward", _make_softmax, _expected_softmax, n_cases=4,
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
CASE_DIMS["layernorm_backward"] = {
    "small": [dict(N=19, C=19), dict(N=19, C=19), dict(N=67, C=45), dict(N=1, C=33)],
    "large": [dict(N=768, C=768), dict(N=768, C=768), dict(N=4099, C=771), dict(N=1, C=768)],
}


def _make_layernorm(rng, dt, size, k):
    d = _dims("layernorm_backward", size, k)
    N, C = d["N"], d["C"]
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
    "layernorm_backward", _make_layernorm, _expected_layernorm, n_cases=4,
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


# elementwise: more elements than the capped grid (2 x 32 = 64 in the simulator, 4096 x 256 = 1,048,576 on a GPU),
# the same again, several blocks with a partial last one under the cap, one element
CASE_DIMS["gelu_backward"] = CASE_DIMS["residual_backward"] = {
    "small": [dict(n=97), dict(n=97), dict(n=37), dict(n=1)],
    "large": [dict(n=2_097_189), dict(n=2_097_189), dict(n=1_000_003), dict(n=1)],
}


def _make_gelu(rng, dt, size, k):
    n = _dims("gelu_backward", size, k)["n"]
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
    "gelu_backward", _make_gelu, _expected_gelu, terms=_gelu_terms, n_cases=4,
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
# rows longer than several warps, the same again, more rows than a capped grid (2 x 32 threads / 4096 blocks), one row
CASE_DIMS["crossentropy_backward"] = {
    "small": [dict(N=5, V=131), dict(N=5, V=131), dict(N=67, V=37), dict(N=1, V=33)],
    "large": [dict(N=257, V=50257), dict(N=257, V=50257), dict(N=4099, V=771), dict(N=1, V=50257)],
}


def _make_crossentropy(rng, dt, size, k):
    d = _dims("crossentropy_backward", size, k)
    N, V = d["N"], d["V"]
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
    "crossentropy_backward", _make_crossentropy, _expected_crossentropy, n_cases=4,
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
# a few heads, the same again, T longer than a warp (B * nh * T rows > 64: more than a capped simulator grid; on a
# GPU > 4096 rows), T = 1
CASE_DIMS["attention_backward"] = {
    "small": [dict(B=2, T=7, nh=3, hs=4), dict(B=2, T=7, nh=3, hs=4), dict(B=1, T=37, nh=2, hs=5),
              dict(B=2, T=1, nh=2, hs=3)],
    "large": [dict(B=2, T=257, nh=12, hs=64), dict(B=2, T=257, nh=12, hs=64), dict(B=1, T=1023, nh=12, hs=64),
              dict(B=3, T=1, nh=12, hs=64)],
}


def _make_attention(rng, dt, size, k):
    d = _dims("attention_backward", size, k)
    B, T, nh, hs = d["B"], d["T"], d["nh"], d["hs"]
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
    "attention_backward", _make_attention, _expected_attention, parts={"dqkv": 3}, terms=_attention_terms, n_cases=4,
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
# B * T * C > 64 (the capped simulator grid), the same again, > 1,048,576 / several blocks of rows, T = 1 (B = 1)
CASE_DIMS["encoder_backward"] = {
    "small": [dict(B=2, T=5, C=7, V=11, maxT=8), dict(B=2, T=5, C=7, V=11, maxT=8),
              dict(B=3, T=13, C=37, V=29, maxT=16), dict(B=1, T=1, C=3, V=5, maxT=4)],
    "large": [dict(B=4, T=257, C=768, V=50257, maxT=1024), dict(B=4, T=257, C=768, V=50257, maxT=1024),
              dict(B=8, T=1023, C=768, V=50257, maxT=1024), dict(B=1, T=1, C=768, V=50257, maxT=1024)],
}


def _make_encoder(rng, dt, size, k):
    d = _dims("encoder_backward", size, k)
    B, T, C, V, maxT = d["B"], d["T"], d["C"], d["V"], d["maxT"]
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
    "encoder_backward", _make_encoder, _expected_encoder, accumulates=True, n_cases=4,
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
    n = _dims("residual_backward", size, k)["n"]
    c = _Case(dt, {"n": n})
    c.add_float("dout", ("n",), rng.standard_normal(n) * _scales(rng, n))
    c.add_output("da", ("n",))
    c.add_output("db", ("n",))
    return c


def _expected_residual(c):
    da, db = ref.residual_backward(c.x["dout"], None)
    return {"da": da, "db": db}


_RESIDUAL = _Op(
    "residual_backward", _make_residual, _expected_residual, n_cases=4,
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
def normalize_dtype(dtype) -> np.dtype:
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


# Guard zones: on a real GPU nothing traps a write past the end of an array (the simulator raises IndexError and
# the checker names the thread), so there each output is a view into a larger buffer with a zone of poison before
# and after it. A zone that changed is an out-of-bounds write. 256 bytes keep the view on the 256-byte alignment
# of a fresh allocation, so vector (float4) loads and stores stay legal. GUARDS: None = on a real GPU only,
# True / False to force (the tests exercise the zones with NumPy arrays).
GUARD_BYTES = 256
GUARDS: Optional[bool] = None


def _guards_on(arrays: str) -> bool:
    if GUARDS is not None:
        return bool(GUARDS)
    return arrays == "cupy" or (arrays == "numba" and _device.numba_on_gpu())


def _guarded_outputs(shapes, dt, arrays, guards: bool):
    """(output arrays to pass, their guarded buffers or None) for the output shapes, all filled with the poison."""
    outs, bufs = [], []
    for shape in shapes:
        if not guards:
            outs.append(_arrays.to_backend(_poison(shape, dt), arrays))
            bufs.append(None)
            continue
        g, n = GUARD_BYTES // dt.itemsize, int(np.prod(shape, dtype=np.int64))
        big = _arrays.to_backend(_poison((g + n + g,), dt), arrays)
        outs.append(big[g:g + n].reshape(shape))
        bufs.append(big)
    return outs, bufs


def _guard_breach(names, shapes, bufs, dt):
    """(output name, elements written before its start, after its end, first flat index past the end or None) for
    the first output whose guard zones changed, else None."""
    for name, shape, big in zip(names, shapes, bufs):
        if big is None:
            continue
        host = np.asarray(_arrays.to_numpy(big))
        g, n = GUARD_BYTES // dt.itemsize, int(np.prod(shape, dtype=np.int64))
        before, after = ~_is_poison(host[:g]), ~_is_poison(host[g + n:])
        if before.any() or after.any():
            first = n + int(np.argmax(after)) if after.any() else None
            return name, int(before.sum()), int(after.sum()), first
    return None


def guard_verdict(op, case, k, guard_bufs, dt, seed, info) -> Optional["CheckResult"]:
    """'wrong' when case k's call wrote into a guard zone around one of its outputs (see _guarded_outputs)."""
    breach = _guard_breach(case.outputs, case.outputs.values(), guard_bufs, dt)
    if breach is None:
        return None
    name, n_before, n_after, first = breach
    n = int(np.prod(case.outputs[name], dtype=np.int64))
    where = []
    if n_after:
        where.append(f"{n_after} element{'s' if n_after > 1 else ''} past its end (its last is flat index "
                     f"{n - 1}; the first written past it: {first})")
    if n_before:
        where.append(f"{n_before} element{'s' if n_before > 1 else ''} before its start (a negative index)")
    sizes = ", ".join(f"{k2}={v}" for k2, v in case.dims.items() if k2.isidentifier())
    hint = (f"an out-of-bounds write: a thread whose index lies outside {name} still wrote. Every thread must test "
            f"its index against the size before it writes (if i < n, not i <= n; with a grid-stride loop, the "
            f"loop's condition is that guard). On a GPU nothing stops such a write: it lands in whatever memory "
            f"lies there (seed {seed})")
    msg = (f"{op.name}: wrong - your kernel wrote outside {name}: {' and '.join(where)} (case {k + 1} of "
           f"{op.n_cases}: {sizes}; seed {seed})")
    return verdict.build_result("wrong", msg, hint, output=name, **info)


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


def _ranges(idx) -> str:
    """'3, 17' / '4..9' / '4..9, 12' for sorted indices (at most 4 ranges, then '...')."""
    runs, start, prev = [], None, None
    for i in (int(v) for v in idx):
        if start is None:
            start = prev = i
        elif i == prev + 1:
            prev = i
        else:
            runs.append((start, prev))
            start = prev = i
    if start is not None:
        runs.append((start, prev))
    text = ", ".join(f"{a}..{b}" if b > a else f"{a}" for a, b in runs[:4])
    return text + (", ..." if len(runs) > 4 else "")


def _rows_text(bad: np.ndarray) -> str:
    """Where the wrong elements are: 'only the last 2 rows (35..36)', 'rows 3, 17', 'rows 4..9', '' (all or none)."""
    if bad.ndim == 0:
        return ""
    lead = bad.reshape(bad.shape[0], -1).any(axis=1) if bad.ndim > 1 else bad
    k, n = int(lead.sum()), lead.size
    if k == n or k == 0:
        return ""
    unit = "row" if bad.ndim > 1 else "element"
    idx = np.flatnonzero(lead)
    first = int(idx[0])
    if lead[first:].all():
        return f"only the last {unit} ({first})" if k == 1 else f"only the last {k} {unit}s ({first}..{n - 1})"
    if k <= 5 or len(_ranges(idx).split(", ")) <= 2:
        return f"only {unit}s " + _ranges(idx)
    return ""


# The grids the exercises' launchers cap at (MAX_BLOCKS x THREADS): 2 x 32 in the simulator, 4096 x 256 on a GPU;
# row kernels launch a block (or a warp, or a thread) per row: at most 2 / 4096 blocks, 64 / 1,048,576 threads.
_GRID_CAPS = (2 * 32, 4096 * 256)
_ROW_CAPS = (2, 2 * 32, 4096, 4096 * 256 // 32)


def _ordinal(k: int) -> str:
    return f"{k}{'th' if 10 <= k % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(k % 10, 'th')}"


def _stride_pattern(idx, n) -> Optional[tuple]:
    """(k, j) when the indices are exactly every k-th index from j (k > 1, at least 3 of them), else None."""
    if idx.size < 3 or n < 6:
        return None
    d = np.diff(idx)
    k, j = int(d[0]), int(idx[0])
    if k <= 1 or not (d == k).all() or j >= k or idx[-1] + k < n:
        return None
    return k, j


def _where_pattern(name, mask, what) -> Optional[str]:
    """A sentence naming the pattern of `mask` (the wrong or unwritten elements of `name`), or None.

    Patterns: a suffix past the (capped) grid, the last partial block, everything past the first block, a range of
    rows, every k-th element. `what` is 'never written' or 'wrong'."""
    if mask.ndim == 0 or not mask.any() or mask.all():
        return None
    flat = mask.reshape(-1)
    n = flat.size
    idx = np.flatnonzero(flat)
    s = int(idx[0])
    row_len = int(np.prod(mask.shape[1:])) if mask.ndim > 1 else 1
    if mask.ndim == 2 and not flat[s:].all():            # only a top-left r0 x c0 block right: tiles / blocks
        good = ~mask
        r0 = int(good[:, 0].argmin()) if not good[:, 0].all() else mask.shape[0]
        c0 = int(good[0].argmin()) if not good[0].all() else mask.shape[1]
        if 0 < r0 and 0 < c0 and good[:r0, :c0].all() and mask[r0:].all() and mask[:, c0:].all():
            R, C = mask.shape
            part = (f"columns {c0}..{C - 1} of every row" if r0 == R else
                    f"rows {r0}..{R - 1} and columns {c0}..{C - 1}")
            return (f"only the top-left {r0} x {c0} block of {name} ({name}[:{r0}, :{c0}]) is right; {part} are "
                    f"{what}: the grid covers only the first tile(s) / block(s) along "
                    f"{'the columns' if r0 == R else 'both axes'}. Launch ceil(rows / TILE) x ceil(cols / TILE) "
                    f"blocks (blockIdx.y for rows, blockIdx.x for columns), or loop over the rest")
    if flat[s:].all():                                   # a suffix: everything from s on
        if mask.ndim > 1 and s % row_len == 0 and row_len > 1:
            unit, start, total, caps = "row", s // row_len, mask.shape[0], _ROW_CAPS
        else:
            unit, start, total, caps = "element", s, n, _GRID_CAPS
        at = ("" if unit == "row" or mask.ndim == 1 else
              f" (flat index; {name}{fmt_index(np.unravel_index(s, mask.shape))})")
        span = f"{unit}s {start}..{total - 1}" if total - start > 1 else f"{unit} {start}"
        partial = [b for b in (32, 64, 128, 256, 512, 1024) if total % b and start == total - total % b]
        if start in caps:
            text = (f"every {unit} past index G = {start} is {what} ({span}{at}): only the first G = blocks x threads "
                    f"{unit}s are covered. A launcher that caps the grid (MAX_BLOCKS x THREADS) needs a grid-stride "
                    f"loop in the kernel (for i in range(cuda.grid(1), n, cuda.gridsize(1)), or i += gridDim.x * "
                    f"blockDim.x in C++); without a cap, launch blocks = (n + threads - 1) // threads")
            if partial:
                text += " (the last partial block)"
            return text
        if partial:
            return (f"the last partial block is {what} ({span}{at}: {total} {unit}s is not a multiple of the "
                    f"{partial[0]}-thread block): launch blocks = (n + threads - 1) // threads, rounding up, and "
                    f"guard i < n in the kernel")
        if start % 32 == 0:
            return (f"only the first {start} {unit}s are right, {span} are {what}: the grid covers {start} threads "
                    f"(only the first block?); launch blocks = (n + threads - 1) // threads, or loop (grid-stride) "
                    f"over the rest")
        return f"{span} are {what}{at}: a loop bound or grid size stops at {start} instead of {total}"
    pattern = _stride_pattern(idx, n)
    if pattern is not None:
        k, j = pattern
        return (f"every {_ordinal(k)} element of {name} is {what} (flat indices {j}, {j + k}, {j + 2 * k}, ...): "
                f"an index mapping or stride bug (a step of {k}, or i * {k} where i is meant)")
    good = np.flatnonzero(~flat)
    pattern = _stride_pattern(good, n)
    if pattern is not None:
        k, j = pattern
        return (f"only every {_ordinal(k)} element of {name} is right (flat indices {j}, {j + k}, {j + 2 * k}, "
                f"...), the others are {what}: an index mapping or stride bug (a step of {k}, or each thread "
                f"handling one element of every {k})")
    if mask.ndim > 1:
        rows = np.flatnonzero(mask.reshape(mask.shape[0], -1).any(axis=1))
        if 0 < rows.size < mask.shape[0] and len(_ranges(rows).split(", ")) <= 2:
            return f"rows {_ranges(rows)} of {name} are {what} (the other rows are right)"
    return None


def _factor_hint(name, c, dims, formula) -> str:
    if abs(c + 1) < 1e-3:
        return f"the sign of {name} is flipped (x-1): check the sign. {formula}"
    return f"{name} is off by a constant factor ({_factor_name(c, dims)}): check the scale. {formula}"


def _generic_hint(op, case, name, raw, o, e, bad, tol, returned) -> str:
    """A hint from the pattern of the wrong elements, when no known mistake matches."""
    poison = _is_poison(raw)
    n = o.size
    kernel = getattr(case, "arrays", "numpy") in ("numba", "cupy")
    if poison.all():
        extra = (" Your function returned a value: the checker ignores it, it reads the output arrays."
                 if returned is not None else "")
        if kernel:
            return (f"{name} was never written (it still holds the NaN we filled it with): no thread of your kernel "
                    f"wrote it. A launch of 0 blocks (blocks = n // threads is 0 when n < threads: use "
                    f"(n + threads - 1) // threads), a guard that is never true, or a kernel given other arrays than "
                    f"the outputs (pass the very array you were given to the kernel)? If you accumulate (+=), zero it "
                    f"first.{extra}")
        return (f"{name} was never written (it still holds the NaN we filled it with): write into the array you "
                f"were given ({name}[...] = ... or in a kernel {name}[i] = ...); {name} = ... only rebinds the "
                f"name to a new array the checker never sees. If you accumulate (+=), zero it first.{extra}")
    if poison.any():
        k = int(poison.sum())
        pattern = _where_pattern(name, poison, "never written")
        if pattern is None:
            where = _rows_text(poison)
            pattern = ("does your grid (or loop) cover every element, including the last partial block "
                       "(blocks = ceil(n / threads))?" + (f" ({where})" if where else ""))
        return (f"{k} of {n} elements of {name} were never written (still NaN; first at "
                f"{fmt_index(np.argwhere(poison)[0])}): {pattern}. Did you write into the output ({name}[...] = ...) "
                f"rather than rebinding the name?")
    nonfinite = ~np.isfinite(o)
    if nonfinite.any():
        k = int(nonfinite.sum())
        return (f"{k} of {n} elements of {name} are NaN/inf (first at {fmt_index(np.argwhere(nonfinite)[0])}): they "
                f"come from reading an output before writing it (outputs start as NaN: zero before +=), 0/0, inf - "
                f"inf, or exp overflow (subtract the row max)")
    # a constant factor?
    ee = float((e * e).sum())
    if ee > 0:
        c = float((o * e).sum()) / ee
        if abs(c - 1) > mistake_slack(tol) and c != 0 and close(o, c * e, mistake_slack(tol)):
            return _factor_hint(name, c, case.dims, op.formula)
    if o.ndim == 2 and o.shape[0] == o.shape[1] and close(o, e.T, mistake_slack(tol)):
        return f"{name} looks transposed: it should be laid out {case.sym[name]}. {op.formula}"
    if not o.any():
        return f"{name} is all zeros. {op.formula}"
    if o.size > 1 and (o == o.flat[0]).all() and not (e == e.flat[0]).all():
        return (f"every element of {name} has the same value ({fmt(float(o.flat[0]))}): a scalar broadcast into "
                f"the array (a reduction over all axes?) where each element needs its own value. {op.formula}")
    pattern = _where_pattern(name, bad, "wrong")
    if pattern is not None:
        return f"{pattern}. {op.formula}"
    where = _rows_text(bad)
    if where.startswith("only the last"):
        return f"{name} is right except {where[5:]}: check your loop bound / grid size (the last partial block)."
    count = f"{int(bad.sum())} of {n} elements of {name} are wrong" + (f" ({where})" if where else "")
    return f"{count}. {op.formula}"


def compare_outputs(op, case, ours_raw: dict, expected: dict, tol: float):
    """Every output of one case against its float64 reference (the tolerance rule of verdict.compare, with the op's
    extra terms and parts): (ours in float64, bad masks, (max abs, max rel) per output (NaN where the output is not
    finite), atol per output, the names of the wrong outputs in order, (max abs, max rel) over the right ones)."""
    ours = {name: r.astype(np.float64) for name, r in ours_raw.items()}
    bads, stats, atols, wrong = {}, {}, {}, []
    terms = op.terms(case) if op.terms is not None else {}
    for name in case.outputs:
        bad, err, rel, atol = compare(ours[name], expected[name], tol, terms.get(name, 0.0),
                                       (op.parts or {}).get(name, 1))
        bads[name], atols[name] = bad, atol
        finite = bool(np.isfinite(ours[name]).all())
        stats[name] = (float(err.max()) if finite and err.size else (math.nan if not finite else 0.0),
                       float(rel.max()) if finite and rel.size else (math.nan if not finite else 0.0))
        if bad.any():
            wrong.append(name)
    right = [stats[n] for n in case.outputs if n not in wrong and not math.isnan(stats[n][0])]
    best = (max((a for a, _ in right), default=0.0), max((r for _, r in right), default=0.0))
    return ours, bads, stats, atols, wrong, best


def changed_inputs_note(case, dev_in) -> str:
    """" (Note: your function changed its input ...)" when the learner's function wrote into an input, else ""."""
    changed = [n for n, d in zip(case.inputs, dev_in)
               if not np.array_equal(np.asarray(_arrays.to_numpy(d)), case.inputs[n], equal_nan=True)]
    if not changed:
        return ""
    return (f" (Note: your function changed its input{'s' if len(changed) > 1 else ''} "
            f"{', '.join(changed)}; inputs are read-only.)")


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

    previous = getattr(case, "previous", None)   # {output: expected of an earlier call with the same shapes}
    if previous and all(name in previous and previous[name].shape == ours[name].shape
                        and not close(previous[name], expected[name], tol)
                        and close(ours[name], previous[name], mistake_slack(tol)) for name in wrong):
        return (f"your {', '.join(wrong)} equal{'s' if len(wrong) == 1 else ''} the right answer for the inputs of an "
                f"EARLIER call, not this one: your function keeps state between calls (a cached result, a global, "
                f"a buffer filled once and reused). Compute everything from this call's inputs; the checker calls "
                f"it several times with different inputs")

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
                if not close(wrong_out, expected[name], tol) and close(ours[name], wrong_out, mistake_slack(tol)):
                    return m.hint
        for m in op.mistakes:
            try:
                found = m.test(case, name, ours[name], expected[name], bads[name]) if m.test is not None else None
                if found:
                    return found if isinstance(found, str) else m.hint
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


_SHAPE_WORDS = ("shape", "broadcast", "mismatch", "dimension", "matmul", "out of bounds", "index", "size",
                "aligned")


# An exception raised inside a kernel in Numba's CUDA simulator starts with the thread and block that raised it.
_SIM_THREAD = re.compile(r"tid=\[(\d+),\s*(\d+),\s*(\d+)\]\s*ctaid=\[(\d+),\s*(\d+),\s*(\d+)\]:?\s*(.*)", re.S)


def kernel_error(exc) -> Optional[tuple]:
    """(thread (x, y, z), block (x, y, z), message) when exc was raised inside a kernel in the CUDA simulator."""
    m = _SIM_THREAD.search(str(exc))
    if m is None:
        return None
    g = [int(v) for v in m.groups()[:6]]
    return tuple(g[:3]), tuple(g[3:]), " ".join(m.group(7).split())


def _kernel_error_hint(exc, where, shapes) -> Optional[str]:
    """The hint for an error raised inside a simulated kernel: which thread, which block, the likely cause."""
    parsed = kernel_error(exc)
    if parsed is None:
        return None
    tid, ctaid, text = parsed
    at = f" at {where}" if where else ""
    who = f"thread {tid} of block {ctaid} raised {type(exc).__name__}{at}: {text}"
    low = text.lower()
    if isinstance(exc, IndexError):
        why = ("likely an index past the end of an array: guard it (if i < n:), since the last block has threads "
               "past the end; check the index arithmetic (row * width + col, tile offsets k0 + kk) and loop bounds")
    elif isinstance(exc, ZeroDivisionError):
        why = "a division by zero in that thread: a count, size or stride that is 0 there?"
    elif "math domain" in low:
        why = ("a math domain error: sqrt or log of a negative number (a variance that rounding made slightly "
               "negative? a value read from outside the array?)")
    elif isinstance(exc, OverflowError) or "range" in low:
        why = "a math range error: exp of a large number overflows (subtract the row max first)"
    elif isinstance(exc, TypeError):
        why = "a type problem inside the kernel (an argument of the wrong kind: pass arrays and int scalars)"
    else:
        why = "the error is in your kernel"
    return f"{who} - {why}; {shapes}"


def _error_hint(op, case, exc) -> str:
    text = f"{type(exc).__name__}: {exc}".lower()
    where = where_raised(exc)
    at = f" (at {where})" if where else ""
    shapes = f"shapes here: {case.describe_shapes()}"
    in_kernel = _kernel_error_hint(exc, where, shapes)
    if in_kernel is not None:
        return in_kernel
    if "grid" in text or "launch" in text:
        return (f"check your kernel launch{at}: blocks = (n + threads - 1) // threads covers n elements with at "
                f"least one block; {shapes}")
    if isinstance(exc, (ValueError, IndexError, TypeError)) and any(w in text for w in _SHAPE_WORDS):
        return f"a shape or index problem{at}: check your transposes and axes. {shapes}. {op.shape_hint}"
    return verdict.error_hint(exc, shapes)


def op_error(op, case, exc, seed, info) -> CheckResult:
    """The "error" verdict (not yet recorded) for an exception raised by the call on `case`: the thread and block
    when it was raised inside a kernel in the simulator, the hint of _error_hint, the seed. info: CheckResult
    fields (name, task, dims, ...)."""
    msg = verdict.error_message(op.name, exc)
    parsed = kernel_error(exc)
    if parsed is not None:
        tid, ctaid, text = parsed
        text = verdict.error_text(text)
        msg = (f"{op.name}: error - your kernel raised {type(exc).__name__} in thread {tid} of block {ctaid}"
               + (f": {text}" if text else ""))
    return verdict.build_result("error", msg, _error_hint(op, case, exc) + f" (seed {seed})", **info)


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
    dt = normalize_dtype(dtype)
    size = default_size(arrays, size)
    if size not in SIZES:
        raise ValueError(f"size={size!r}: use one of {', '.join(repr(s) for s in SIZES)} (or None: 'large' when the "
                         f"arrays live on a GPU, else 'small')")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0):
        raise TypeError(f"seed={seed!r}: use a non-negative int, or None for fresh random inputs")
    return dt, size


def default_size(arrays, size=None) -> str:
    """size=None means "large" when the arrays live on a real GPU (arrays="cupy", or "numba" when Numba runs on the
    GPU) and "small" otherwise (NumPy, the CUDA simulator). Any other size is returned as given."""
    if size is not None:
        return size
    on_gpu = arrays == "cupy" or (arrays == "numba" and _device.numba_on_gpu())
    return "large" if on_gpu else "small"


def learner_fn_and_seed(name, fn, seed, what="inputs") -> int:
    """The checks every checker starts with: fn is the learner's callable (not its result), seed a non-negative int
    or None. Returns the seed to use (a fresh one for None); raises naming the mistake."""
    if not callable(fn):
        raise TypeError(f"check_{name}(fn): fn must be your function, got {type(fn).__name__} {fn!r:.60}: pass "
                        f"the function itself, without calling it")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0):
        raise TypeError(f"seed={seed!r}: use a non-negative int, or None for fresh random {what}")
    return secrets.randbelow(1_000_000) if seed is None else int(seed)


def source_text(source):
    """(text, None) or (None, (status, why)) from a HIP source given as a str or a zero-argument callable."""
    if isinstance(source, str):
        return source, None
    try:
        text = source()
    except NotImplementedError:
        return None, ("not attempted", "your source function raised NotImplementedError")
    except Exception as exc:  # the learner's error is reported, never raised
        where = where_raised(exc)
        return None, ("error", verdict.what_raised(exc, "source function") + (f" (at {where})" if where else ""))
    if not isinstance(text, str):
        return None, ("error", f"your source function returned {type(text).__name__}, not the kernel source "
                               f"as a str")
    return text, None


def hip_compile_only(name, source, entries, *, task=None, quiet=False) -> "CheckResult":
    """Grade a HIP/CUDA C++ kernel source without a GPU: it must compile for NVIDIA (NVRTC, sm_90) and AMD (hipcc,
    gfx90a, when installed), define every entry point in `entries` as ``extern "C" __global__``, and pass the
    course's portability lint (``hip.lint_source``). It is not run: status "compiled" (counted apart from
    correct/wrong), or "wrong" naming the compiler error, the lint finding or the missing entry point.

    source: the source str, or a zero-argument function returning it (NotImplementedError: "not attempted").
    entries: an entry point name or a list of them. Records the verdict for grading like every checker.
    """
    from . import hip
    if not (isinstance(source, str) or callable(source)):
        raise TypeError(f"hip_compile_only(source): pass the kernel source as a str, or a function returning it; "
                        f"got {type(source).__name__}")
    entries = (entries,) if isinstance(entries, str) else tuple(entries or ())
    if not all(isinstance(e, str) and e for e in entries):
        raise TypeError(f"hip_compile_only(entries): entry point names must be non-empty str, got {entries!r}")
    text, failed = source_text(source)
    if failed is not None:
        status, why = failed
        if status == "not attempted":
            return verdict.record(verdict.not_attempted(name, who="source function", task=task, arrays="cupy",
                                                        hint="replace the `raise NotImplementedError` with your "
                                                             "kernel source"), quiet=quiet)
        return verdict.verdict(name, task, "error", f"{name}: error - {why}", quiet=quiet, arrays="cupy")
    ok, report = hip.grade_source(text, entries)
    if ok:
        return verdict.verdict(name, task, "compiled", f"{name}: compiled - {report}; not run: no GPU (it is run and "
                               f"checked on a GPU server)", quiet=quiet, arrays="cupy")
    return verdict.verdict(name, task, "wrong", f"{name}: wrong - your kernel source does not pass the checks without "
                           f"a GPU", report, quiet=quiet, arrays="cupy")


def unfinished_kernel(fn) -> Optional[str]:
    """The name of a Numba kernel that the launcher ``fn`` refers to (a global name in its code, nested code
    included, or a variable of an enclosing function) whose source still raises NotImplementedError, else None.

    Needed on a GPU: there Numba compiles a ``raise`` inside a kernel away (it only raises with debug=True), so an
    untouched exercise kernel runs, writes nothing and would read as "wrong" instead of "not attempted"."""
    import inspect
    code, glob = getattr(fn, "__code__", None), getattr(fn, "__globals__", None)
    if code is None or glob is None:
        return None
    cells = dict(zip(code.co_freevars, getattr(fn, "__closure__", None) or ()))
    names, todo = set(code.co_freevars), [code]
    while todo:
        co = todo.pop()
        names.update(co.co_names)
        todo.extend(c for c in co.co_consts if hasattr(c, "co_names"))
    for name in sorted(names):
        try:
            obj = cells[name].cell_contents if name in cells else glob.get(name)
        except ValueError:  # an empty closure cell
            continue
        if type(obj).__name__ not in ("CUDADispatcher", "FakeCUDAKernel"):
            continue
        py = getattr(obj, "py_func", None) or getattr(obj, "fn", None)
        try:
            if "raise NotImplementedError" in inspect.getsource(py):
                return name
        except (OSError, TypeError):
            continue
    return None


def _run(op: _Op, fn, *, arrays="numpy", dtype=np.float32, size=None, seed=None, task=None, quiet=False,
         source=None, entries=None):
    if arrays == "cupy" and callable(fn) and not _device.has_gpu():
        if source is not None:
            return hip_compile_only(op.name, source, entries, task=task, quiet=quiet)
        return verdict.skipped(op.name, task, quiet=quiet)
    dt, size = _validate(op.name, fn, arrays, dtype, size, seed)
    seed = secrets.randbelow(1_000_000) if seed is None else int(seed)
    rng = np.random.default_rng(seed)
    tol = TOLERANCES[dt.name]
    short = DTYPE_SHORT[dt.name]
    base = dict(name=op.name, task=task, tol=tol, seed=seed, dtype=dt.name, arrays=arrays)
    stub = unfinished_kernel(inspect.unwrap(fn)) if arrays != "numpy" else None
    if stub is not None:
        return verdict.record(verdict.unfinished(**base, kernel=stub), quiet=quiet)
    max_rel_all, max_abs_all = 0.0, 0.0
    result = None

    history = []   # (output shapes, expected) of the earlier cases: a stale answer matches one of them
    for k in range(op.n_cases):
        case = op.make(rng, dt, size, k)
        case.arrays = arrays
        expected = {name: np.asarray(v, dtype=np.float64) for name, v in op.expected(case).items()}
        shapes = {name: np.shape(v) for name, v in expected.items()}
        case.previous = next((prev for prev_shapes, prev in reversed(history) if prev_shapes == shapes), None)
        history.append((shapes, expected))
        try:
            dev_in = [_arrays.to_backend(a, arrays) for a in case.inputs.values()]
            dev_out, guard_bufs = _guarded_outputs(case.outputs.values(), dt, arrays, _guards_on(arrays))
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
            result = verdict.not_attempted(**info)
            break
        except Exception as exc:  # the learner's error is reported, never raised: the notebook goes on
            result = op_error(op, case, exc, seed, info)
            break

        result = guard_verdict(op, case, k, guard_bufs, dt, seed, info)
        if result is not None:
            break
        ours, bads, stats, atols, wrong, (case_abs, case_rel) = compare_outputs(op, case, ours_raw, expected, tol)
        max_abs_all, max_rel_all = max(max_abs_all, case_abs), max(max_rel_all, case_rel)
        info["atol"] = atols

        if wrong:
            name = wrong[0]
            index = tuple(int(i) for i in np.argwhere(bads[name])[0])
            mine, exp = float(ours[name][index]), float(expected[name][index])
            max_abs, max_rel = stats[name]
            hint = _diagnose(op, case, ours_raw, ours, expected, bads, wrong, tol, returned)
            hint += changed_inputs_note(case, dev_in)
            sizes = ", ".join(f"{k2}={v}" for k2, v in case.dims.items() if k2.isidentifier())
            msg = (f"{op.name}: wrong - {name} at {fmt_index(index)} (case {k + 1} of {op.n_cases}: {sizes}): "
                   f"yours {fmt(mine, exp)}, expected {fmt(exp, mine)} "
                   f"(max abs err {max_abs:.2g}, max rel {max_rel:.2g}, tol {tol:g}; seed {seed})")
            result = verdict.build_result("wrong", msg, hint, output=name, max_abs=max_abs, max_rel=max_rel,
                                          first_bad=index, ours=mine, expected=exp, **info)
            break

    if result is None:
        n_out = len(case.outputs)
        msg = (f"{op.name}: correct (max rel err {max_rel_all:.2g}, tol {tol:g}, {short}, "
               f"{n_out} output{'s' if n_out > 1 else ''})")
        result = verdict.build_result("correct", msg, max_abs=max_abs_all, max_rel=max_rel_all, **info)
    return verdict.record(result, quiet=quiet)


# ------------------------------------------------------------------------------------------------------------
# The public checkers
# ------------------------------------------------------------------------------------------------------------
_SIGNATURE_DOC = """
    fn is called as fn(*inputs, *outputs, *ints) with arrays on the backend `arrays` ("numpy", "cupy", "numba");
    the outputs start filled with NaN and fn must write every element. dtype: np.float32 (default), np.float64,
    np.float16 or "bfloat16". size: "small" (simulator-friendly), "large" (GPU sizes: past the capped grid of
    4096 x 256 threads, more than 4096 rows) or None (default: "large" when the arrays live on a real GPU, else
    "small"); CASE_DIMS lists the shapes of each case. seed: None for fresh random inputs, or the seed printed by
    a failed check to reproduce it.
    task: a label recorded for grading. quiet: do not print. Returns a CheckResult (truthy when correct);
    errors raised by fn are reported in it, never raised.
    source, entries: for a HIP task, the kernel source (a str or a zero-argument function returning it) and its
    entry point names: with arrays="cupy" on a machine without a GPU the checker grades the source with
    hip_compile_only (compiles for both vendors, portability lint; status "compiled") instead of "skipped".
    On a GPU they are ignored: fn (which launches the kernel) is run and checked.
"""


def check_linear_backward(fn, *, arrays="numpy", dtype=np.float32, size=None, seed=None, task=None,
                          quiet=False, source=None, entries=None) -> CheckResult:
    """Check fn(dout (N,OC), inp (N,C), weight (C,OC), dinp (N,C), dweight (C,OC), dbias (OC,))."""
    return _run(_LINEAR, fn, arrays=arrays, dtype=dtype, size=size, seed=seed, task=task, quiet=quiet,
                source=source, entries=entries)


def check_softmax_backward(fn, *, arrays="numpy", dtype=np.float32, size=None, seed=None, task=None,
                           quiet=False, source=None, entries=None) -> CheckResult:
    """Check fn(dout (N,n), out (N,n), dinp (N,n)); out is softmax's output (rows sum to 1)."""
    return _run(_SOFTMAX, fn, arrays=arrays, dtype=dtype, size=size, seed=seed, task=task, quiet=quiet,
                source=source, entries=entries)


def check_layernorm_backward(fn, *, arrays="numpy", dtype=np.float32, size=None, seed=None, task=None,
                             quiet=False, source=None, entries=None) -> CheckResult:
    """Check fn(dout (N,C), inp (N,C), weight (C,), mean (N,), rstd (N,), dinp (N,C), dweight (C,), dbias (C,))."""
    return _run(_LAYERNORM, fn, arrays=arrays, dtype=dtype, size=size, seed=seed, task=task, quiet=quiet,
                source=source, entries=entries)


def check_gelu_backward(fn, *, arrays="numpy", dtype=np.float32, size=None, seed=None, task=None,
                        quiet=False, source=None, entries=None) -> CheckResult:
    """Check fn(dout (n,), inp (n,), dinp (n,)) for the tanh-form GELU."""
    return _run(_GELU, fn, arrays=arrays, dtype=dtype, size=size, seed=seed, task=task, quiet=quiet,
                source=source, entries=entries)


def check_crossentropy_backward(fn, *, arrays="numpy", dtype=np.float32, size=None, seed=None, task=None,
                                quiet=False, source=None, entries=None) -> CheckResult:
    """Check fn(logits (N,V), targets (N,) int32, dlogits (N,V)) with dloss = 1 and the loss a mean over N rows."""
    return _run(_CROSSENTROPY, fn, arrays=arrays, dtype=dtype, size=size, seed=seed, task=task, quiet=quiet,
                source=source, entries=entries)


def check_attention_backward(fn, *, arrays="numpy", dtype=np.float32, size=None, seed=None, task=None,
                             quiet=False, source=None, entries=None) -> CheckResult:
    """Check fn(dout (B,T,C), qkv (B,T,3C), att (B,nh,T,T), dqkv (B,T,3C), n_head) (causal attention)."""
    return _run(_ATTENTION, fn, arrays=arrays, dtype=dtype, size=size, seed=seed, task=task, quiet=quiet,
                source=source, entries=entries)


def check_encoder_backward(fn, *, arrays="numpy", dtype=np.float32, size=None, seed=None, task=None,
                           quiet=False, source=None, entries=None) -> CheckResult:
    """Check fn(dout (B,T,C), idx (B,T) int32, dwte (V,C), dwpe (maxT,C)): zero both, then scatter-add."""
    return _run(_ENCODER, fn, arrays=arrays, dtype=dtype, size=size, seed=seed, task=task, quiet=quiet,
                source=source, entries=entries)


def check_residual_backward(fn, *, arrays="numpy", dtype=np.float32, size=None, seed=None, task=None,
                            quiet=False, source=None, entries=None) -> CheckResult:
    """Check fn(dout (n,), da (n,), db (n,))."""
    return _run(_RESIDUAL, fn, arrays=arrays, dtype=dtype, size=size, seed=seed, task=task, quiet=quiet,
                source=source, entries=entries)


for _f in (check_linear_backward, check_softmax_backward, check_layernorm_backward, check_gelu_backward,
           check_crossentropy_backward, check_attention_backward, check_encoder_backward, check_residual_backward):
    _f.__doc__ += _SIGNATURE_DOC

# name -> checker, e.g. CHECKERS["linear_backward"]
CHECKERS = {name: globals()[f"check_{name}"] for name in _OPS}
