"""Checkers of lesson 14's exercise: a matrix product with its epilogue fused in (what cuBLASLt's epilogues do).

``check_matmul_bias_gelu(fn)`` (task 14.1, cuBLASLt's GELU_AUX_BIAS): fn is the learner's launcher

    fn(a, w, bias, aux, out)

a (M, K) and w (K, P) uint16 (the bfloat16 bits of the product's inputs: the LayerNorm output and the fc weight in
the run's format), bias (P,) float32; aux (M, P) float32 and out (M, P) uint16 are written: aux = a @ w + bias (the
product accumulated in float32, the pre-activation the backward needs), out = the bfloat16 bits of gelu_tanh(aux),
rounded to nearest even. One pass: the float32 product never goes to memory and comes back.

``check_matmul_dgelu_bgrad(fn)`` (task 14.2, cuBLASLt's DGELU_BGRAD): fn is the learner's launcher

    fn(dy, w, aux, dpre, dbias)

dy (M, P) and w (K, P) uint16 bf16 bits (the gradient of the next product's output, and that product's weight stored
(in, out) = (K, P), read transposed: dh = dy @ w.T is (M, K)), aux (M, K) float32 (the pre-activation 14.1 kept);
dpre (M, K) uint16 and dbias (K,) float32 are written: g = dh * gelu_tanh'(aux) (float32), dpre = the bf16 bits of g
(nearest even: the input of the two products of the fc layer's backward), dbias = the column sums of g (unrounded:
the fc layer's bias gradient), the same bits on every call.

Both checkers call fn several times with fresh random inputs (the seed is in every message): sizes never multiples
of 8 or 16 and past several tiles in every dimension (K too: a last partial tile of the reduction), then another shape
(an answer that keeps something from the call before shows). The outputs start as a poison (NaN float32, a bf16 NaN
pattern no rounding produces): an element never written is named. Expected values come from NumPy in float64 on the
same inputs. The float32 outputs pass with the rule of ``checks`` (float32 tolerance, relative to the output's size
and to the size of the product's terms); the bf16 bits must be the nearest-even rounding of a value within float32's
reach of the exact one (2^-14 relative, plus a per-element bound for the cancellations in GELU and its derivative):
where that reach is far below half a bf16 step, the nearest-even bits of the exact value, or at a midpoint either
neighbour (_bits_ok). The hints name the usual mistakes: no bias, the bias added twice, after GELU or per row, aux
holding GELU's output, GELU with erf instead of tanh, a truncated rounding, the last partial tile of K dropped, rows
never written, a derivative without its second term, dbias summed from the rounded values or added into what it held,
sums whose last bits change between calls.
"""

from __future__ import annotations

import math

import numpy as np

from .. import device as _device
from ..runtime import arrays as _arrays
from . import borrowed, opcheck, verdict
from .verdict import compare, fmt, fmt_index

__all__ = ["check_matmul_bias_gelu", "check_matmul_dgelu_bgrad", "gelu_tanh", "gelu_tanh_grad", "bf16_values"]

NAME_FWD = "matmul_bias_gelu"
NAME_BWD = "matmul_dgelu_bgrad"
BF16_POISON = 0x7FD5  # a bf16 NaN pattern no rounding produces: an element still holding it was never written
# the course's own implementations of the pieces (checks/borrowed.py): an answer that calls one is not correct
OWN = {
    NAME_FWD: (
        "gpullm_lessons.kernels.numba.fused:bias_gelu_forward",
        "gpullm_lessons.kernels.numba.fused:bias_add",
        "gpullm_lessons.kernels.numba.linear:linear_backward",
        "gpullm_lessons.kernels.numba.gelu:gelu_forward",
        "gpullm_lessons.reference.gelu:gelu_forward",
    ),
    NAME_BWD: (
        "gpullm_lessons.kernels.numba.fused:colsum_convert",
        "gpullm_lessons.kernels.numba.linear:linear_backward",
        "gpullm_lessons.kernels.numba.gelu:gelu_backward",
        "gpullm_lessons.reference.gelu:gelu_backward",
    ),
}
S2PI = math.sqrt(2.0 / math.pi)


def gelu_tanh(x):
    """GELU, tanh approximation (GPT-2's), float64."""
    return 0.5 * x * (1.0 + np.tanh(S2PI * (x + 0.044715 * x**3)))


def gelu_tanh_grad(x):
    """d gelu_tanh / dx, float64: both terms of the product rule."""
    t = np.tanh(S2PI * (x + 0.044715 * x**3))
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * S2PI * (1.0 + 3 * 0.044715 * x * x)


def _gelu_erf(x):
    from math import erf

    return 0.5 * x * (1.0 + np.vectorize(erf)(x / math.sqrt(2.0)))


def bf16_values(bits):
    """uint16 bfloat16 bits -> float64 values."""
    return (np.asarray(bits, np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32).astype(np.float64)


def _rne(x):
    """float64 values -> bfloat16 bits, nearest even (float64 -> float32 -> bf16: the float32 step is exact for the
    values compared here, or decides only elements inside the slack)."""
    import ml_dtypes

    with np.errstate(over="ignore", invalid="ignore"):
        return np.asarray(x, np.float64).astype(np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def _bits_ok(got, exact, slack=0.0):
    """Per element: the bf16 bits `got` are the nearest-even rounding of some value within err of `exact` (float64),
    err = |exact| 2^-14 + slack: float32 arithmetic may land anywhere in that interval (a few float32 ulps of every
    operation, and the absolute error of its cancellations, which `slack` bounds per element). Where err is far below
    half a bf16 step, that is the nearest-even rounding of exact, or its neighbour at a midpoint. Returns (ok, the
    nearest-even bits of exact)."""
    exact = np.asarray(exact, np.float64)
    err = np.abs(exact) * 2.0**-14 + slack
    lo, hi = bf16_values(_rne(exact - err)), bf16_values(_rne(exact + err))
    v = bf16_values(got)
    with np.errstate(invalid="ignore"):
        ok = (v >= lo) & (v <= hi)  # NaN never passes
    return ok, _rne(exact)


def _draw(rng, big, second=False):
    """(M, K, P): never multiples of 8, past two tiles of 16 in every dimension; bigger on a GPU."""

    def one(lo, hi):
        n = int(rng.integers(lo, hi))
        return n + 1 if n % 8 == 0 else n

    if big:
        return one(200, 420), one(130, 300), one(260, 520)
    if second:
        return one(17, 24), one(33, 41), one(17, 24)
    return one(33, 40), one(17, 31), one(33, 40)


def _bf16_inputs(rng, shape, scale=1.0):
    import ml_dtypes

    x = (rng.standard_normal(shape) * scale).astype(ml_dtypes.bfloat16)
    return x.view(np.uint16).copy(), x.astype(np.float64)


def _start(name, check, fn, arrays, size, seed, task, quiet):
    """The common start of both checkers: skipped without a GPU for arrays="cupy"; fn a launcher (not a Numba
    kernel), a seed, nothing borrowed, an unfinished kernel named. Returns (a recorded CheckResult to return at once,
    or None; rng; the result fields; the three shapes (M, K, P) of the calls)."""
    if arrays == "cupy" and callable(fn) and not _device.has_gpu():
        return verdict.skipped(name, task, quiet=quiet, arrays=arrays), None, None, None
    seed = opcheck.learner_fn_and_seed(name, fn, seed)
    kind = type(fn).__name__
    if kind in ("CUDADispatcher", "FakeCUDAKernel"):
        raise TypeError(f"{check}(fn): fn is a Numba kernel; pass the launcher that calls it ({name})")
    taken = borrowed.borrowed_verdict(name, [fn], OWN[name], task=task, seed=seed, quiet=quiet, check=check)
    if taken is not None:
        return taken, None, None, None
    _arrays.require(arrays)
    stub = opcheck.unfinished_kernel(fn)
    if stub:
        result = verdict.record(verdict.unfinished(name, stub, task=task, seed=seed, arrays=arrays), quiet=quiet)
        return result, None, None, None
    big = _big(size, arrays)
    rng = np.random.default_rng(seed)
    base = dict(name=name, task=task, tol=opcheck.TOLERANCES["float32"], seed=seed, dtype="float32", arrays=arrays)
    return None, rng, base, [_draw(rng, big), _draw(rng, big), _draw(rng, big, second=True)]


def _big(size, arrays):
    if size not in (None, "small", "large"):
        raise ValueError(f"size={size!r}: use 'small', 'large' or None (large on a GPU)")
    return size == "large" or (size is None and (arrays == "cupy" or (arrays == "numba" and _device.numba_on_gpu())))


def _run(fn, args, arrays, info, where, seed, name):
    """Call fn on the device copies of args; (outputs as NumPy, None) or (None, an unrecorded CheckResult)."""
    dev = [_arrays.to_backend(a, arrays) for a in args]
    try:
        fn(*dev)
        return [np.asarray(_arrays.to_numpy(d)) for d in dev], None
    except NotImplementedError:
        return None, verdict.not_attempted(**info)
    except Exception as exc:  # the learner's error is reported, never raised
        return None, verdict.raised(exc=exc, context=f"{where} (seed {seed})", **info)


def _first(mask):
    return tuple(int(i) for i in np.argwhere(mask)[0])


def _unwritten(name, out_name, got, poison_test, where, seed, info):
    miss = poison_test(got)
    if not miss.any():
        return None
    idx = _first(miss)
    rows, cols = np.nonzero(miss) if got.ndim == 2 else (np.nonzero(miss)[0], None)
    n = int(miss.sum())
    if got.ndim == 2:
        lo_r, lo_c = int(rows.min()), int(cols.min())
        hint = (f"{n} of {got.size} elements of {out_name} were never written (from row {lo_r}, column {lo_c} on): "
                f"every element needs its thread. Are there threads for the last partial tile of rows and columns "
                f"(the grid rounds up), and does each thread write its element after the K loop whatever its tile?")
    else:
        hint = (f"{n} of {got.size} elements of {out_name} were never written or were added into (it starts as NaN "
                f"here; the first at {idx[0]}): write every column's sum, those of the last partial tile too, rather "
                f"than adding to what {out_name} held")
    msg = f"{name}: wrong - {out_name} at {fmt_index(idx)} never written ({where}; seed {seed})"
    return verdict.build_result("wrong", msg, hint, output=out_name, first_bad=idx, **info)


# ================================================================================================================
# 14.1 aux = a @ w + bias, out = bf16(gelu(aux)): the forward epilogue
# ================================================================================================================
def _fwd_case(rng, M, K, P):
    a_bits, a = _bf16_inputs(rng, (M, K))
    w_bits, w = _bf16_inputs(rng, (K, P), 1.0 / math.sqrt(K))
    bias = (rng.standard_normal(P) * 0.5).astype(np.float32)
    prod = a @ w
    aux = prod + bias.astype(np.float64)
    terms = float(np.max(np.abs(a) @ np.abs(w)))  # the size of the product's terms: float32's error is relative to it
    return dict(a=a, w=w, a_bits=a_bits, w_bits=w_bits, bias=bias, prod=prod, aux=aux, out=gelu_tanh(aux),
                terms=terms, M=M, K=K, P=P)


def _fwd_aux_hint(c, got, tol):
    """The named mistake aux equals, else a generic hint."""
    prod, bias, aux = c["prod"], c["bias"].astype(np.float64), c["aux"]
    K = c["K"]
    ok = lambda v: not compare(got, v, tol * 4, terms=c["terms"])[0].any()  # noqa: E731
    kt = [t for t in (16, 8, 32, 64) if K % t]
    mistakes = [
        (prod, "aux is the product without the bias: aux = a @ w + bias[column], the pre-activation GELU is applied "
               "to (the backward's gelu' needs exactly that)"),
        (gelu_tanh(aux), "aux holds GELU's output: aux must be the pre-activation a @ w + bias, kept for the "
                         "backward's gelu'(aux); out is GELU's output"),
        (gelu_tanh(prod) + bias, "the bias was added after GELU: aux = a @ w + bias, and GELU is applied to that"),
        (prod + 2 * bias, "the bias was added twice"),
    ]
    if c["M"] <= c["P"]:
        mistakes.append((prod + bias[: c["M"]][:, None], "the bias was indexed by the row: bias has one value per "
                                                         "output column j (aux[i, j] = sum_k a[i, k] w[k, j] + bias[j])"))
    for t in kt:
        cut = (K // t) * t
        mistakes.append((c["a"][:, :cut] @ c["w"][:cut] + bias,
                         f"the last partial tile of the reduction is missing (K = {K} is not a multiple of {t}): the "
                         f"K loop must cover every k < K, the tile's elements past K loaded as 0"))
    for v, hint in mistakes:
        if v.shape == got.shape and ok(v):
            return hint
    return ("aux = sum over k of a[i, k] w[k, j], plus bias[j]: check the indexing of a (M, K) and w (K, P) in your "
            "tiles, that every tile of K is loaded before it is used (a barrier after the loads) and that no thread "
            "overwrites a tile another thread is still reading (a barrier before the next loads)")


def _fwd_out_hint(c, aux_got, got_bits):
    """The named mistake of out, else a generic hint."""
    aux = aux_got.astype(np.float64)
    v = bf16_values(got_bits)
    trunc = (aux_got.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    g32 = gelu_tanh(aux).astype(np.float32)
    # truncated: the bits of the value toward zero, for (nearly) every element (float32's last bits may differ)
    if np.mean(got_bits == (g32.view(np.uint32) >> 16).astype(np.uint16)) >= 0.97:
        return ("out is GELU's value truncated to bf16 (the low 16 bits dropped): round to nearest, ties to even "
                "(lesson 07: add 0x7FFF plus the lowest kept bit, then shift)")
    if np.mean(got_bits == trunc) >= 0.97 or np.allclose(v, aux, rtol=2**-7, atol=1e-3):
        return "out holds the pre-activation: out = bf16(gelu(aux)), GELU applied to aux before the rounding"
    if np.allclose(v, _gelu_erf(aux), rtol=2**-8, atol=2**-10) and not np.allclose(v, gelu_tanh(aux), rtol=2**-9,
                                                                                     atol=2**-12):
        return ("out follows GELU with erf (the exact GELU); the course's GELU is GPT-2's tanh approximation: "
                "0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))")
    if np.allclose(v, gelu_tanh(aux) + 0.0, rtol=2**-7, atol=2**-9):
        return ("out is GELU's value but not rounded to the nearest bf16 (ties to even) of it: compute gelu(aux) in "
                "float32 and round its bits to nearest even")
    return "out = the bf16 bits (nearest even) of gelu_tanh(aux), with aux the value you stored in aux"


def check_matmul_bias_gelu(fn, arrays="numba", size=None, seed=None, task=None, quiet=False) -> verdict.CheckResult:
    """Check fn(a, w, bias, aux, out): the product with cuBLASLt's GELU_AUX_BIAS epilogue (module docstring).

    a (M, K), w (K, P) uint16 bf16 bits; bias (P,) float32; aux (M, P) float32 = a @ w + bias (float32 accumulation);
    out (M, P) uint16 = bf16 bits of gelu_tanh(aux), nearest even. Three calls with fresh inputs (the last of another
    shape); arrays: "numba" (default) or "cupy" (a GPU). Errors raised by fn are reported, never raised."""
    name, check = NAME_FWD, "check_matmul_bias_gelu"
    early, rng, base, shapes = _start(name, check, fn, arrays, size, seed, task, quiet)
    if early is not None:
        return early
    tol, seed = base["tol"], base["seed"]
    result, max_rel = None, 0.0
    for k, (M, K, P) in enumerate(shapes):
        c = _fwd_case(rng, M, K, P)
        where = f"call {k + 1} of {len(shapes)}: M = {M}, K = {K}, P = {P}"
        info = dict(base, dims={"M": M, "K": K, "P": P})
        aux0 = np.full((M, P), np.nan, np.float32)
        out0 = np.full((M, P), BF16_POISON, np.uint16)
        got, err = _run(fn, [c["a_bits"], c["w_bits"], c["bias"].copy(), aux0, out0], arrays, info, where, seed, name)
        if err is not None:
            result = err
            break
        a_in, w_in, bias_in, aux, out = got
        if not (np.array_equal(a_in, c["a_bits"]) and np.array_equal(w_in, c["w_bits"])
                and np.array_equal(bias_in, c["bias"])):
            msg = f"{name}: wrong - an input was changed ({where}; seed {seed})"
            result = verdict.build_result("wrong", msg, "a, w and bias are inputs: leave them as they are", **info)
            break
        for out_name, arr, test in (("aux", aux, np.isnan), ("out", out, lambda o: o == BF16_POISON)):
            result = _unwritten(name, out_name, arr, test, where, seed, info)
            if result is not None:
                break
        if result is not None:
            break
        bad, _, rel, _ = compare(aux.astype(np.float64), c["aux"], tol, terms=c["terms"])
        if bad.any():
            i = _first(bad)
            msg = (f"{name}: wrong - aux at {fmt_index(i)} ({where}): yours {fmt(float(aux[i]), c['aux'][i])}, "
                   f"expected {fmt(c['aux'][i], float(aux[i]))} (tol {tol:g}; seed {seed})")
            result = verdict.build_result("wrong", msg, _fwd_aux_hint(c, aux.astype(np.float64), tol), output="aux",
                                          first_bad=i, ours=float(aux[i]), expected=float(c["aux"][i]), **info)
            break
        max_rel = max(max_rel, float(rel.max()))
        # out against the exact GELU of YOUR aux: the rounding is judged on the value it rounds. slack: float32's
        # 1 + tanh(u) cancels for large negative aux (an absolute error of about |aux| 2^-24, allowed 16x)
        ok, want = _bits_ok(out, gelu_tanh(aux.astype(np.float64)), np.abs(aux.astype(np.float64)) * 2.0**-21)
        if not ok.all():
            i = _first(~ok)
            msg = (f"{name}: wrong - out at {fmt_index(i)} ({where}): yours 0x{int(out[i]):04X} "
                   f"({fmt(float(bf16_values(out[i])))}), expected 0x{int(want[i]):04X} "
                   f"({fmt(float(bf16_values(want[i])))}) = bf16(gelu({fmt(float(aux[i]))})) (seed {seed})")
            result = verdict.build_result("wrong", msg, _fwd_out_hint(c, aux, out), output="out", first_bad=i,
                                          ours=float(bf16_values(out[i])), expected=float(bf16_values(want[i])),
                                          **info)
            break
    if result is None:
        dims = ", ".join(f"{M}x{K}x{P}" for M, K, P in shapes)
        msg = (f"{name}: correct ({len(shapes)} calls, M x K x P = {dims}; aux max rel err {max_rel:.2g}, tol {tol:g}; "
               f"out the nearest-even bf16 of gelu(aux))")
        result = verdict.build_result("correct", msg, max_rel=max_rel, dims={"shapes": shapes}, **base)
    return verdict.record(result, quiet=quiet, check=check)


# ================================================================================================================
# 14.2 g = (dy @ w.T) * gelu'(aux), dpre = bf16(g), dbias = column sums of g: the backward epilogue
# ================================================================================================================
def _bwd_case(rng, M, K, P):
    dy_bits, dy = _bf16_inputs(rng, (M, P))
    w_bits, w = _bf16_inputs(rng, (K, P), 1.0 / math.sqrt(P))
    aux = (rng.standard_normal((M, K)) * 1.5).astype(np.float32)
    dh = dy @ w.T
    gp = gelu_tanh_grad(aux.astype(np.float64))
    g = dh * gp
    terms = float(np.max(np.abs(dy) @ np.abs(w.T)) * np.max(np.abs(gp)))
    # what float32 may miss per element: dh's accumulation (relative to its terms) and gelu's cancellation
    x = aux.astype(np.float64)
    slack = np.abs(dh) * (1.0 + 0.2 * np.abs(x) ** 3) * 2.0**-21 + (np.abs(dy) @ np.abs(w.T)) * np.abs(gp) * P * 2.0**-23
    return dict(dy=dy, w=w, dy_bits=dy_bits, w_bits=w_bits, aux=aux, dh=dh, gp=gp, g=g, dbias=g.sum(axis=0),
                terms=terms, slack=slack, M=M, K=K, P=P)


def _bwd_dpre_hint(c, got_bits):
    v = bf16_values(got_bits)
    aux = c["aux"].astype(np.float64)
    t = np.tanh(S2PI * (aux + 0.044715 * aux**3))
    near = lambda x: np.allclose(v, x, rtol=2**-7, atol=2**-9 * max(1.0, float(np.abs(x).max())))  # noqa: E731
    if near(c["dh"]):
        return "dpre holds dy @ w.T alone: multiply each element by gelu'(aux) of the same element before rounding"
    if near(c["dh"] * 0.5 * (1 + t)):
        return ("gelu' is missing its second term: d/dx [0.5 x (1 + tanh u)] = 0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 "
                "u) du/dx, du/dx = sqrt(2/pi) (1 + 3 * 0.044715 x^2)")
    if near(c["dh"] * gelu_tanh(aux)):
        return "dpre was multiplied by gelu(aux); the chain rule needs its derivative gelu'(aux)"
    if near(c["g"]):
        return ("dpre is (dy @ w.T) * gelu'(aux) but not its nearest-even bf16 (truncated?): round the float32 bits to "
                "nearest, ties to even")
    return ("dpre = bf16(dh * gelu'(aux)) with dh = dy @ w.T: dh[i, k] = sum over p of dy[i, p] w[k, p] (w is (K, P): "
            "its rows are read, transposed)")


def _bwd_dbias_hint(c, got, prev):
    tol = 4 * opcheck.TOLERANCES["float32"]
    near = lambda x: x.shape == got.shape and not compare(got, x, tol, terms=c["terms"])[0].any()  # noqa: E731
    rounded = bf16_values(_rne(c["g"])).sum(axis=0)
    if prev is not None and prev.shape == got.shape and near(c["dbias"] + prev):
        return ("dbias holds this call's sums plus what dbias held before the call: write the column sums (dbias = "
                "...), do not add into it")
    if near(rounded) and not near(c["dbias"]):
        return ("dbias was summed from the bf16-rounded values: sum the float32 g = dh * gelu'(aux) before it is "
                "rounded (the bias gradient keeps float32's precision; only the products' input is bf16)")
    if near(c["dh"].sum(axis=0)):
        return "dbias sums dy @ w.T without gelu'(aux): the bias gradient of the fc layer is the sum of g over the rows"
    return ("dbias[k] = the sum over all M rows of g[i, k]: every row block's part added, each once (partial sums per "
            "block of rows, then summed in a fixed order)")


def check_matmul_dgelu_bgrad(fn, arrays="numba", size=None, seed=None, task=None, quiet=False) -> verdict.CheckResult:
    """Check fn(dy, w, aux, dpre, dbias): the product dh = dy @ w.T with cuBLASLt's DGELU_BGRAD epilogue.

    dy (M, P), w (K, P) uint16 bf16 bits; aux (M, K) float32; dpre (M, K) uint16 = bf16 bits (nearest even) of
    g = dh * gelu_tanh'(aux); dbias (K,) float32 = g summed over the M rows (unrounded); the same bits when called twice
    on the same inputs. Three calls with fresh inputs (the last of another shape), then the first inputs again;
    arrays: "numba" or "cupy". Errors raised by fn are reported, never raised."""
    name, check = NAME_BWD, "check_matmul_dgelu_bgrad"
    early, rng, base, shapes = _start(name, check, fn, arrays, size, seed, task, quiet)
    if early is not None:
        return early
    tol, seed = base["tol"], base["seed"]
    result, max_rel, first = None, 0.0, None
    cases = [_bwd_case(rng, *s) for s in shapes]
    for k, c in enumerate([*cases, cases[0]]):
        M, K, P = c["M"], c["K"], c["P"]
        again = k == len(shapes)
        where = (f"call {k + 1} of {len(shapes) + 1}: M = {M}, K = {K}, P = {P}"
                 + (", the first call's inputs again" if again else ""))
        info = dict(base, dims={"M": M, "K": K, "P": P})
        dpre0 = np.full((M, K), BF16_POISON, np.uint16)
        # the last call's dbias holds the first call's answer: an answer that adds into dbias shows
        dbias0 = first[1].copy() if again else np.full(K, np.nan, np.float32)
        held = dbias0.astype(np.float64) if again else None
        got, err = _run(fn, [c["dy_bits"], c["w_bits"], c["aux"].copy(), dpre0, dbias0], arrays, info, where, seed,
                        name)
        if err is not None:
            result = err
            break
        _, _, _, dpre, dbias = got
        for out_name, arr, test in (("dpre", dpre, lambda o: o == BF16_POISON), ("dbias", dbias, np.isnan)):
            result = _unwritten(name, out_name, arr, test, where, seed, info)
            if result is not None:
                break
        if result is not None:
            break
        ok, want = _bits_ok(dpre, c["g"], c["slack"])
        if not ok.all():
            i = _first(~ok)
            msg = (f"{name}: wrong - dpre at {fmt_index(i)} ({where}): yours 0x{int(dpre[i]):04X} "
                   f"({fmt(float(bf16_values(dpre[i])))}), expected 0x{int(want[i]):04X} "
                   f"({fmt(float(bf16_values(want[i])))}) (seed {seed})")
            result = verdict.build_result("wrong", msg, _bwd_dpre_hint(c, dpre), output="dpre", first_bad=i,
                                          ours=float(bf16_values(dpre[i])), expected=float(bf16_values(want[i])),
                                          **info)
            break
        d = dbias.astype(np.float64)
        bad, _, rel, _ = compare(d, c["dbias"], tol, terms=c["terms"] * math.sqrt(M))
        if bad.any():
            i = _first(bad)
            msg = (f"{name}: wrong - dbias at {fmt_index(i)} ({where}): yours {fmt(d[i], c['dbias'][i])}, expected "
                   f"{fmt(c['dbias'][i], d[i])} (tol {tol:g}; seed {seed})")
            result = verdict.build_result("wrong", msg, _bwd_dbias_hint(c, d, held), output="dbias", first_bad=i,
                                          ours=float(d[i]), expected=float(c["dbias"][i]), **info)
            break
        max_rel = max(max_rel, float(rel.max()))
        if k == 0:
            first = (dpre.copy(), dbias.copy())
        if again and not (np.array_equal(first[0], dpre) and np.array_equal(first[1].view(np.uint32),
                                                                             dbias.view(np.uint32))):
            msg = f"{name}: wrong - dbias differs in its last bits between two calls on the same inputs (seed {seed})"
            result = verdict.build_result(
                "wrong", msg, "sum each column in a fixed order (partial sums per block of rows, then the partials "
                "added in order), not with atomic adds whose order changes from run to run", output="dbias", **info)
            break
    if result is None:
        dims = ", ".join(f"{M}x{K}x{P}" for M, K, P in shapes)
        msg = (f"{name}: correct ({len(shapes) + 1} calls, M x K x P = {dims}; dbias max rel err {max_rel:.2g}, tol "
               f"{tol:g}; dpre the nearest-even bf16 of g; the same bits twice)")
        result = verdict.build_result("correct", msg, max_rel=max_rel, dims={"shapes": shapes}, **base)
    return verdict.record(result, quiet=quiet, check=check)
