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

import math
from typing import Optional

import numpy as np

from .. import reference as ref
from .opcheck import (GUARD_BYTES, SIZES, TOLERANCES, Case, Mistake, Op, Rules, awkward_size,  # noqa: F401
                      compare_outputs, default_size, guard_verdict, hip_compile_only, if_square, learner_fn_and_seed,
                      normalize_dtype, op_error, random_rows, row_scales, run, source_text, unfinished_kernel)
from .verdict import STATUSES  # noqa: F401  (checks.STATUSES, as before the core moved out)
from .verdict import CheckResult, close, mistake_slack

__all__ = [
    "CheckResult", "TOLERANCES", "CHECKERS",
    "check_linear_backward", "check_softmax_backward", "check_layernorm_backward", "check_gelu_backward",
    "check_crossentropy_backward", "check_attention_backward", "check_encoder_backward",
    "check_residual_backward", "hip_compile_only",
]

# How a check runs (cases, poison, guards, comparing, hints, the loop): gpullm_lessons/checks/opcheck.py. The verdict and
# its number formats: gpullm_lessons/checks/verdict.py. This module holds the ops of lessons 02-07 and their checkers.


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


def _case(op_name, dt, size, k) -> Case:
    """An empty case with the dims of CASE_DIMS[op_name][size][k]."""
    return Case(dt, _dims(op_name, size, k))


def _make_linear(rng, dt, size, k):
    c = _case("linear_backward", dt, size, k)
    N, C, OC = c.dims["N"], c.dims["C"], c.dims["OC"]
    c.add_float("dout", ("N", "OC"), random_rows(rng, (N, OC)))
    c.add_float("inp", ("N", "C"), random_rows(rng, (N, C)))
    c.add_float("weight", ("C", "OC"), rng.standard_normal((C, OC)))
    for name, sym in (("dinp", ("N", "C")), ("dweight", ("C", "OC")), ("dbias", ("OC",))):
        c.add_output(name, sym)
    return c


def _expected_linear(c):
    x = c.x
    _, cache = ref.linear_forward(x["inp"], x["weight"], np.zeros(c.dims["OC"]))
    dinp, dweight, dbias = ref.linear_backward(x["dout"], cache)
    return {"dinp": dinp, "dweight": dweight, "dbias": dbias}


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
        Mistake("", test=_linear_k_tiles_test),
        Mistake("all zeros, as a loop over K // TILE tiles gives when K < TILE (K = OC for dinp, K = N for dweight; "
                 "here K < 16): the partial tile is skipped, and here it is the only one. In a tiled GEMM, " + _K_LOOP,
                 lambda c: {name: np.zeros(c.outputs[name]) for name, K in (("dinp", c.dims["OC"]),
                                                                            ("dweight", c.dims["N"])) if K < 16}),
    ]


_LINEAR = Op(
    "linear_backward", _make_linear, _expected_linear, n_cases=4,
    formula="dinp = dout @ weight.T (N, C); dweight = inp.T @ dout (C, OC); dbias = dout.sum(axis=0) (OC,)",
    shape_hint="weight is stored (C, OC) (in, out): dinp = dout @ weight.T, dweight = inp.T @ dout, "
               "dbias = dout.sum(axis=0). Each gradient has the shape of its input.",
    mistakes=[
        Mistake("missing transpose: dinp looks like dout @ weight. weight is stored (C, OC), so "
                 "dinp = dout @ weight.T: (N, OC) @ (OC, C) -> (N, C)",
                 if_square(lambda c: {"dinp": c.x["dout"] @ c.x["weight"]})),
        Mistake("dweight is transposed: it must have weight's layout (C, OC), dweight[c, o] = sum_n inp[n, c] "
                 "dout[n, o], i.e. dweight = inp.T @ dout (not dout.T @ inp)",
                 if_square(lambda c: {"dweight": c.x["dout"].T @ c.x["inp"]})),
        Mistake("missing transpose in dweight: dweight = inp.T @ dout, (C, N) @ (N, OC); the sum runs over "
                 "the N rows",
                 if_square(lambda c: {"dweight": c.x["inp"] @ c.x["dout"]})),
        Mistake("dbias is summed over the wrong axis: dbias[o] sums dout[n, o] over the N rows, "
                 "dbias = dout.sum(axis=0), one value per output channel",
                 if_square(lambda c: {"dbias": c.x["dout"].sum(axis=1)})),
        Mistake("dbias is not computed: the bias is added to every row, so dbias = dout.sum(axis=0) "
                 "(sum over the N rows)",
                 lambda c: {"dbias": np.zeros(c.dims["OC"])}),
        Mistake("dbias was never written (it still holds the NaN it started with): dbias = dout.sum(axis=0) "
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
    c = _case("softmax_backward", dt, size, k)
    N, n = c.dims["N"], c.dims["n"]
    logits = random_rows(rng, (N, n), -1.0, 1.0)              # some rows flat, some peaky
    out, _ = ref.softmax_forward(logits)
    c.add_float("dout", ("N", "n"), random_rows(rng, (N, n)))
    c.add_float("out", ("N", "n"), out)                 # the forward's output, rounded to dtype
    c.add_output("dinp", ("N", "n"))
    return c


def _expected_softmax(c):
    return {"dinp": ref.softmax_backward(c.x["dout"], {"out": c.x["out"]})}


def _softmax_with(c, s):
    return {"dinp": c.x["out"] * (c.x["dout"] - s)}


_SOFTMAX = Op(
    "softmax_backward", _make_softmax, _expected_softmax, n_cases=4,
    terms=lambda c: {"dinp": float(np.abs(c.x["out"] * c.x["dout"]).max())},
    formula="dinp = out * (dout - (out * dout).sum(axis=-1, keepdims=True)), the sum over each row",
    shape_hint="the row sum must keep its axis: s = (out * dout).sum(axis=-1, keepdims=True) is (N, 1)",
    mistakes=[
        Mistake("dinp = out * dout is missing the row-sum term: every out_j depends on every input of the row, "
                 "dinp = out * (dout - sum(out * dout) over the row)",
                 lambda c: {"dinp": c.x["out"] * c.x["dout"]}),
        Mistake("the row sum runs over the wrong axis: sum(out * dout) is over each row's n entries "
                 "(axis=-1, keepdims=True), not down the columns (axis=0)",
                 lambda c: _softmax_with(c, (c.x["out"] * c.x["dout"]).sum(axis=0))),
        Mistake("the row sums are broadcast across the columns: sum(axis=-1) without keepdims=True gives shape "
                 "(N,), which lines up with the last axis; use keepdims=True (or s[:, None])",
                 if_square(lambda c: _softmax_with(c, (c.x["out"] * c.x["dout"]).sum(axis=-1)[None, :]))),
        Mistake("out * (1 - out) * dout keeps only the diagonal of the softmax Jacobian; the off-diagonal "
                 "terms give dinp = out * (dout - sum(out * dout) over the row)",
                 lambda c: {"dinp": c.x["out"] * (1 - c.x["out"]) * c.x["dout"]}),
        Mistake("the row sum is sum(out * dout), weighted by out, not sum(dout)",
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
    c = _case("layernorm_backward", dt, size, k)
    N, C = c.dims["N"], c.dims["C"]
    c.add_float("dout", ("N", "C"), random_rows(rng, (N, C)))
    inp = c.add_float("inp", ("N", "C"), random_rows(rng, (N, C)) + rng.standard_normal((N, 1)))  # rows: own scale, offset
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


_LAYERNORM = Op(
    "layernorm_backward", _make_layernorm, _expected_layernorm, n_cases=4,
    terms=lambda c: {"dinp": float(np.abs(c.x["g"] * c.x["rstd"][:, None]).max())},
    formula="xhat = (inp - mean) * rstd, g = dout * weight; dinp = rstd * (g - mean(g) - xhat * mean(g * xhat)) "
            "(means over the C channels of a row); dweight = (dout * xhat).sum(axis=0); dbias = dout.sum(axis=0)",
    shape_hint="dweight and dbias are (C,): sum over the N rows (axis=0); per-row means (over C) need "
               "keepdims=True (or [:, None]) to broadcast against (N, C); mean and rstd are (N,): use "
               "mean[:, None]",
    mistakes=[
        Mistake("dinp is missing the mean term: subtract mean(g) over the row's C channels (g = dout * weight); "
                 "it comes from mean depending on every x: dinp = rstd * (g - mean(g) - xhat * mean(g * xhat))",
                 lambda c: _ln_dinp(c, mean_term=False)),
        Mistake("dinp is missing the xhat * mean(g * xhat) term (from rstd depending on every x): "
                 "dinp = rstd * (g - mean(g) - xhat * mean(g * xhat))",
                 lambda c: _ln_dinp(c, xhat_term=False)),
        Mistake("dinp = rstd * dout * weight treats mean and rstd as constants, but they depend on x too: "
                 "dinp = rstd * (g - mean(g) - xhat * mean(g * xhat))",
                 lambda c: _ln_dinp(c, mean_term=False, xhat_term=False)),
        Mistake("dinp ignores weight: the gradient reaching xhat is g = dout * weight (out = xhat * weight + "
                 "bias); use g in all three terms",
                 lambda c: _ln_dinp(c, g=c.x["dout"])),
        Mistake("dinp is missing the final factor rstd: dinp = rstd * (g - mean(g) - xhat * mean(g * xhat))",
                 lambda c: _ln_dinp(c, rstd=False)),
        Mistake("dweight and dbias are reduced over the wrong axis: they sum over the N rows (axis=0), one value "
                 "per channel: dweight = (dout * xhat).sum(axis=0), dbias = dout.sum(axis=0)",
                 if_square(lambda c: {"dweight": (c.x["dout"] * c.x["xhat"]).sum(axis=1),
                                       "dbias": c.x["dout"].sum(axis=1)})),
        Mistake("dweight sums dout * xhat (the normalized input), not dout * inp",
                 lambda c: {"dweight": (c.x["dout"] * c.x["inp"]).sum(axis=0)}),
        Mistake("dweight is not multiplied by xhat: dweight = (dout * xhat).sum(axis=0); dbias = dout.sum(axis=0)",
                 lambda c: {"dweight": c.x["dout"].sum(axis=0)}),
        Mistake("dbias is not computed: dbias = dout.sum(axis=0) (sum over the N rows)",
                 lambda c: {"dbias": np.zeros(c.dims["C"])}),
        Mistake("dbias was never written (it still holds the NaN it started with): dbias = dout.sum(axis=0), "
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
    c = _case("gelu_backward", dt, size, k)
    n = c.dims["n"]
    c.add_float("dout", ("n",), rng.standard_normal(n) * row_scales(rng, n))
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


_GELU = Op(
    "gelu_backward", _make_gelu, _expected_gelu, terms=_gelu_terms, n_cases=4,
    formula="u = sqrt(2/pi) (x + 0.044715 x^3), t = tanh(u); dinp = dout * (0.5 (1 + t) + 0.5 x (1 - t^2) "
            "sqrt(2/pi) (1 + 3 * 0.044715 x^2))",
    shape_hint="gelu_backward is elementwise on 1-D arrays of length n: dinp[i] depends on dout[i], inp[i] only",
    mistakes=[
        Mistake("this is the derivative of the exact (erf) GELU; GPT-2 uses the tanh approximation: "
                 "dinp = dout * (0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2))",
                 _gelu_erf),
        Mistake("du/dx is missing the 3 * 0.044715 x^2 term: u = sqrt(2/pi) (x + 0.044715 x^3), so "
                 "du/dx = sqrt(2/pi) (1 + 3 * 0.044715 x^2)",
                 lambda c: {"dinp": c.x["dout"] * _gelu_local(c.x["inp"], dudx=_S)}),
        Mistake("du/dx: the derivative of 0.044715 x^3 is 3 * 0.044715 x^2 (the factor 3 is missing)",
                 lambda c: {"dinp": c.x["dout"] * _gelu_local(c.x["inp"], dudx=_S * (1 + _K * c.x["inp"] ** 2))}),
        Mistake("the chain rule: multiply the local derivative by dout (dinp = dout * gelu'(x))",
                 lambda c: {"dinp": _gelu_local(c.x["inp"])}),
        Mistake("product rule: out = 0.5 x (1 + tanh(u)) gives two terms, 0.5 (1 + tanh(u)) is missing",
                 lambda c: {"dinp": c.x["dout"] * _gelu_local(c.x["inp"], first=False)}),
        Mistake("product rule: the 0.5 x (1 - tanh(u)^2) du/dx term is missing",
                 lambda c: {"dinp": c.x["dout"] * _gelu_local(c.x["inp"], second=False)}),
        Mistake("tanh'(u) = 1 - tanh(u)^2 (squared)",
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
    c = _case("crossentropy_backward", dt, size, k)
    N, V = c.dims["N"], c.dims["V"]
    c.add_float("logits", ("N", "V"), random_rows(rng, (N, V), -1.0, 0.7))
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


_CROSSENTROPY = Op(
    "crossentropy_backward", _make_crossentropy, _expected_crossentropy, n_cases=4,
    terms=lambda c: {"dlogits": 1.0 / c.dims["N"]},         # probs - onehot: 1 - p cancels when p is near 1
    formula="probs = softmax(logits) over each row; dlogits = (probs - onehot(targets)) / N",
    shape_hint="logits and dlogits are (N, V), targets (N,): probs = softmax over axis=-1 (keepdims=True for "
               "the max and the sum), then dlogits[np.arange(N), targets] -= 1, and divide by N",
    mistakes=[
        Mistake("the loss is the mean over the N rows, so every gradient is divided by N: "
                 "dlogits = (probs - onehot) / N",
                 lambda c: {"dlogits": c.x["probs"] - c.x["onehot"]}),
        Mistake("subtract 1 at each row's target: dlogits = (probs - onehot(targets)) / N",
                 lambda c: {"dlogits": c.x["probs"] / c.dims["N"]}),
        Mistake("subtract 1 only at each row's own target: d[np.arange(N), targets] -= 1, not d[:, targets] "
                 "(that subtracts every row's target in every row)",
                 _ce_broadcast_onehot),
        Mistake("use probs = softmax(logits) (over each row, max subtracted), not the raw logits",
                 lambda c: {"dlogits": (c.x["logits"] - c.x["onehot"]) / c.dims["N"]}),
        Mistake("the softmax runs over each row's V logits (axis=-1, keepdims=True), not over axis 0",
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
    c = Case(dt, {"B": B, "T": T, "C": C, "3C": 3 * C, "nh": nh, "hs": hs})
    c.add_float("dout", ("B", "T", "C"), random_rows(rng, (B, T, C)))
    qkv = c.add_float("qkv", ("B", "T", "3C"), random_rows(rng, (B, T, 3 * C), -0.3, 0.3))
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


_ATTENTION = Op(
    "attention_backward", _make_attention, _expected_attention, parts={"dqkv": 3}, terms=_attention_terms, n_cases=4,
    formula="per head: datt = dy @ v^T, dv = att^T @ dy, dpreatt = att * (datt - sum(att * datt, -1)), "
            "dq = dpreatt @ k / sqrt(hs), dk = dpreatt^T @ q / sqrt(hs); dqkv = [dq | dk | dv] on the last axis",
    shape_hint="qkv and dqkv are (B, T, 3C) = [q | k | v] along the last axis; per head q, k, v, dy are (B, nh, T, "
               "hs) (reshape (B, T, nh, hs), then transpose), att is (B, nh, T, T)",
    mistakes=[
        Mistake("your gradient matches attention without the causal mask: position t gets no gradient from "
                 "t2 > t (att is 0 there; use the att you are given, or mask before the softmax if you recompute it)",
                 lambda c: _attention_variant(c, mask=False)),
        Mistake("dq and dk are missing the 1/sqrt(hs) scale: preatt = q @ k^T / sqrt(hs), so "
                 "dq = dpreatt @ k / sqrt(hs) and dk = dpreatt^T @ q / sqrt(hs)",
                 lambda c: _attention_variant(c, scale=False)),
        Mistake("the softmax backward is missing its row-sum term: dpreatt = att * (datt - sum(att * datt, "
                 "axis=-1, keepdims=True))",
                 lambda c: _attention_variant(c, rowsum=False)),
        Mistake("missing transpose in dk: dk = dpreatt^T @ q (sum over the query positions t), not dpreatt @ q",
                 lambda c: _attention_variant(c, dk_t=False)),
        Mistake("missing transpose in dv: dv = att^T @ dy (sum over the query positions t), not att @ dy",
                 lambda c: _attention_variant(c, dv_t=False)),
        Mistake("the heads are split wrong: channel c of head h is at h*hs + c, so reshape (B, T, C) -> "
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
    c = _case("encoder_backward", dt, size, k)
    B, T, C, V = c.dims["B"], c.dims["T"], c.dims["C"], c.dims["V"]
    c.add_float("dout", ("B", "T", "C"), random_rows(rng, (B, T, C)))
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


_ENCODER = Op(
    "encoder_backward", _make_encoder, _expected_encoder, accumulates=True, n_cases=4,
    formula="dwte = 0, dwpe = 0; then for every (b, t): dwte[idx[b, t]] += dout[b, t] and dwpe[t] += dout[b, t]",
    shape_hint="dout is (B, T, C), idx (B, T), dwte (V, C), dwpe (maxT, C) with maxT >= T: only dwpe[:T] gets "
               "gradient; np.add.at(dwte, idx, dout) scatter-adds, dwpe[:T] = dout.sum(axis=0)",
    mistakes=[
        Mistake("the output still holds the NaN it started with: outputs arrive filled with garbage (here NaN), "
                 "so set dwte and dwpe to 0 first (dwte[...] = 0), then add dout into them (and write into the "
                 "arrays you were given: dwte = ... only rebinds the name)",
                 lambda c: {"dwte": np.full(c.outputs["dwte"], np.nan), "dwpe": np.full(c.outputs["dwpe"], np.nan)}),
        Mistake("rows that get no gradient must be 0, not left as they came (NaN here): zero all of dwte "
                 "(tokens that never appear in idx) and all of dwpe (positions t >= T), then add",
                 _encoder_unused_nan),
        Mistake("tokens that appear several times must collect every contribution: dwte[idx] += dout (and "
                 "dwte[idx] = dout) keeps only one of them; use np.add.at(dwte, idx, dout) in NumPy, "
                 "cuda.atomic.add in a kernel. dwpe[t] sums dout[b, t] over the whole batch",
                 _encoder_overwrite, _encoder_lost_repeats),
        Mistake("dwpe[t] sums dout[b, t] over the whole batch b: dwpe[:T] = dout.sum(axis=0)",
                 lambda c: {"dwpe": np.concatenate([c.x["dout"][0], np.zeros((c.dims["maxT"] - c.dims["T"],
                                                                              c.dims["C"]))])}),
    ])


# ------------------------------------------------------------------------------------------------------------
# residual_backward(dout (n,), da (n,), db (n,))
# ------------------------------------------------------------------------------------------------------------
def _make_residual(rng, dt, size, k):
    c = _case("residual_backward", dt, size, k)
    n = c.dims["n"]
    c.add_float("dout", ("n",), rng.standard_normal(n) * row_scales(rng, n))
    c.add_output("da", ("n",))
    c.add_output("db", ("n",))
    return c


def _expected_residual(c):
    da, db = ref.residual_backward(c.x["dout"], None)
    return {"da": da, "db": db}


_RESIDUAL = Op(
    "residual_backward", _make_residual, _expected_residual, n_cases=4,
    formula="out = a + b, so da = dout and db = dout (copied into both outputs)",
    shape_hint="dout, da and db are all 1-D of length n",
    mistakes=[
        Mistake("db was never written: out = a + b sends the gradient to both branches, write da = dout AND "
                 "db = dout", lambda c: {"db": np.full(c.dims["n"], np.nan)}),
        Mistake("da was never written: out = a + b sends the gradient to both branches, write da = dout AND "
                 "db = dout", lambda c: {"da": np.full(c.dims["n"], np.nan)}),
        Mistake("the gradient is copied to both branches, not split between them: da = dout and db = dout",
                 lambda c: {"da": 0.5 * c.x["dout"], "db": 0.5 * c.x["dout"]}),
        Mistake("db = dout too: out = a + b depends on b with slope 1",
                 lambda c: {"db": np.zeros(c.dims["n"])}),
        Mistake("da = dout too: out = a + b depends on a with slope 1",
                 lambda c: {"da": np.zeros(c.dims["n"])}),
    ])


_OPS = {op.name: op for op in (_LINEAR, _SOFTMAX, _LAYERNORM, _GELU, _CROSSENTROPY, _ATTENTION, _ENCODER, _RESIDUAL)}


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


def _checker(op: Op, signature: str, rules: Optional[Rules] = None):
    """check_<op>(fn, ...): run op's cases on fn (opcheck.run, with `rules`) and return the recorded verdict."""

    def check(fn, *, arrays="numpy", dtype=np.float32, size=None, seed=None, task=None, quiet=False, source=None,
              entries=None) -> CheckResult:
        return run(op, fn, rules=rules, arrays=arrays, dtype=dtype, size=size, seed=seed, task=task, quiet=quiet,
                   source=source, entries=entries)

    check.__name__ = check.__qualname__ = f"check_{op.name}"
    check.__doc__ = f"Check {signature}." + _SIGNATURE_DOC
    return check


check_linear_backward = _checker(_LINEAR, "fn(dout (N,OC), inp (N,C), weight (C,OC), dinp (N,C), dweight (C,OC), "
                                          "dbias (OC,))")
check_softmax_backward = _checker(_SOFTMAX, "fn(dout (N,n), out (N,n), dinp (N,n)); out is softmax's output (rows "
                                            "sum to 1)")
# a Numba kernel for it (04.1) reduces each row in shared memory: in the simulator the first call is traced for a
# missing barrier
check_layernorm_backward = _checker(_LAYERNORM, "fn(dout (N,C), inp (N,C), weight (C,), mean (N,), rstd (N,), "
                                                "dinp (N,C), dweight (C,), dbias (C,))", Rules(barriers=True))
check_gelu_backward = _checker(_GELU, "fn(dout (n,), inp (n,), dinp (n,)) for the tanh-form GELU")
check_crossentropy_backward = _checker(_CROSSENTROPY, "fn(logits (N,V), targets (N,) int32, dlogits (N,V)) with "
                                                      "dloss = 1 and the loss a mean over N rows")
check_attention_backward = _checker(_ATTENTION, "fn(dout (B,T,C), qkv (B,T,3C), att (B,nh,T,T), dqkv (B,T,3C), "
                                                "n_head) (causal attention)")
check_encoder_backward = _checker(_ENCODER, "fn(dout (B,T,C), idx (B,T) int32, dwte (V,C), dwpe (maxT,C)): zero "
                                            "both, then scatter-add")
check_residual_backward = _checker(_RESIDUAL, "fn(dout (n,), da (n,), db (n,))")

# name -> checker, e.g. CHECKERS["linear_backward"]
CHECKERS = {name: globals()[f"check_{name}"] for name in _OPS}
