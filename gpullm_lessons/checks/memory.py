"""Checkers for lesson 08 (activation checkpointing): is your recompute bitwise the same as keeping everything?

They follow the conventions of ``gpullm_lessons.checks.backward`` (fresh random inputs on every call, the seed printed, one
verdict printed: not attempted / error / wrong with a hint naming the mistake / correct; your exceptions reported,
never raised; ``task=`` for grading, ``quiet=``). Unlike the op checkers there is no tolerance: recomputation runs the
same reference ops in the same order on the same inputs, so the result must be **bitwise** equal
(``np.array_equal``). Each checker calls your function several times with different inputs (a function that keeps
something from an earlier call fails), and the cases that decide are fixed, not drawn: every layer index of a
3-layer model, a sequence of length T = 1, a single channel.

``check_block_recompute(fn)`` (exercise 08.1), fn called as

    dx_in = fn(x_in, params, l, n_head, dx_out, grads)

x_in (B, T, C): block l's saved input (the only thing policy "full" keeps for it); params: a ParamBuffer (the
stacked weights, params["qkvw"][l] is layer l's); l: the layer; n_head; dx_out (B, T, C): d(loss)/d(block l's
output); grads: a ParamBuffer holding OTHER values already (as in the middle of a backward pass). fn must give
d(x_in) (B, T, C) and WRITE (overwrite, as block_backward does) layer l's slice of the 12 per-layer gradient tensors,
leaving every other layer's slice and the global tensors (wte, wpe, lnfw, lnfb) untouched; bitwise what the reference
``block_forward`` + ``block_backward`` give on the same inputs. Called for every layer of a 3-layer model (in the
order of a backward pass, then the last layer again on new inputs) and every layer of a 2-layer model with T = 1.

``check_layernorm_rebuild(fn)`` (exercise 08.2), fn called as

    out = fn(inp, mean, rstd, weight, bias)

inp (B, T, C), mean and rstd (B, T) as layernorm_forward saved them, weight, bias (C,): the LayerNorm output
(B, T, C), rebuilt from the saved statistics (policy "selective" drops it and rebuilds it in backward), bitwise equal
to layernorm_forward's output. Called on four inputs: two of one shape, T = 1, and C = 1.

``check_selective_rebuild(fn)`` (exercise 08.3), fn called as

    cache = fn(kept)

kept: what policy "selective" keeps of one block (``checkpointing._drop_selective``): the reference block cache of
``block_forward`` without the inputs of the three linears (qkv, fc, fcproj keep only weight and has_bias), plus the
LayerNorm biases ``kept["ln1_bias"]``, ``kept["ln2_bias"]``. fn returns a NEW dict that ``block_backward`` accepts,
the block cache with the three dropped tensors (the two LayerNorm outputs and the GELU output) rebuilt, bitwise equal
to the forward's, and leaves kept as it was (the selective cache must stay small). Called for every layer of a
3-layer model and on T = 1.
"""
from __future__ import annotations

import copy
import math

import numpy as np

from . import borrowed, opcheck
from . import verdict
from .verdict import CheckResult, DTYPE_SHORT, fmt, fmt_index

# the course's own implementations of the tasks (checks/borrowed.py): an answer that is, wraps or calls one is not correct
OWN = {
    "layernorm_rebuild": (
        "gpullm_lessons.model.checkpointing:_layernorm_out",
        "gpullm_lessons.reference.layernorm:layernorm_forward",
    ),
    "selective_rebuild": ("gpullm_lessons.model.checkpointing:_rebuild_selective",),
}

__all__ = ["check_block_recompute", "check_layernorm_rebuild", "check_selective_rebuild", "LAYER_GRADS"]

LAYER_GRADS = ("ln1w", "ln1b", "qkvw", "qkvb", "attprojw", "attprojb", "ln2w", "ln2b", "fcw", "fcb", "fcprojw",
               "fcprojb")   # the per-layer tensors block_backward writes (slice [l] of each)


def _result(name, task, status, msg, hint=None, seed=None, dtype=None, dims=None, quiet=False):
    return verdict.verdict(name, task, status, msg, hint, quiet=quiet, seed=seed, dtype=dtype, arrays="numpy",
                           dims=dims)


def _dtype(name, dtype):
    dt = opcheck.normalize_dtype(dtype)
    if dt.name not in ("float32", "float64"):
        raise ValueError(f"check_{name}: dtype={dt.name} is not supported: the reference GPT runs in float32 "
                         f"(or float64); use np.float32")
    return dt


def _validate(name, fn, seed):
    return opcheck.learner_fn_and_seed(name, fn, seed, "inputs")


def _not_attempted(name, task, seed, dt, dims, quiet):
    return verdict.record(verdict.not_attempted(name, task=task, seed=seed, dtype=dt.name, arrays="numpy", dims=dims),
                          quiet=quiet)


def _error(name, exc, lead, seed, task, dt, dims, quiet, where):
    """lead: what this checker knows about the exception (None: "the error is in your code"); where: the call."""
    return verdict.record(verdict.raised(name, exc, where, lead=lead, task=task, seed=seed, dtype=dt.name,
                                         arrays="numpy", dims=dims), quiet=quiet)


def _max_rel(a, b) -> float:
    with np.errstate(invalid="ignore", over="ignore"):
        return float(np.max(np.abs(a.astype(np.float64) - b) / (np.abs(b).max() + 1e-30)))


def _first_diff(ours, expected) -> str:
    i = tuple(int(k) for k in np.argwhere(~(ours == expected))[0])
    n = int(np.count_nonzero(~(ours == expected)))
    return (f"{fmt_index(i)}: yours {fmt(float(ours[i]))}, expected {fmt(float(expected[i]))} "
            f"({n} of {ours.size} elements differ)")


def _same(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and bool(np.array_equal(a, b))


def _rebuilt_problem(got, want, *, shape, dtype, at, mistakes, rtol, atol, equal_nan=False, close, other):
    """(message, hint) of the first way a rebuilt tensor `got` (an array) differs from the forward's `want`, or None
    when they are bitwise equal. In this order: another shape, another dtype (shape, dtype: the (message, hint) to
    give); a known mistake, one of `mistakes` ((array, hint) pairs) that got equals bitwise, or within rtol / atol
    where that array is not within them of want; close (max rel err < 1e-4) but not bitwise equal (close: (message,
    hint), the message a template of {at} and {rel}, the max rel err); else `other` (a hint). at: the tensor's name in
    the messages of the last three, followed by its first difference ("[0, 2, 1]: yours ..., expected ...")."""
    if got.shape != want.shape:
        return shape
    if got.dtype != want.dtype:
        return dtype
    if np.array_equal(got, want):
        return None
    at = f"{at}{_first_diff(got, want)}"
    for mistake, hint in mistakes:
        if _same(got, mistake) or (got.shape == np.shape(mistake)
                                   and np.allclose(got, mistake, rtol=rtol, atol=atol, equal_nan=equal_nan)
                                   and not np.allclose(mistake, want, rtol=rtol, atol=atol)):
            return at, hint
    if np.all(np.isfinite(got)) and _max_rel(got, want) < 1e-4:
        message, hint = close
        return message.format(at=at, rel=_max_rel(got, want)), hint
    return at, other


# ----------------------------------------------------------------------------------------------------------------
# small GPTs: the cases every checker here draws from
# ----------------------------------------------------------------------------------------------------------------

def _model(rng, dt, n_layer, n_head, d_model, B, T):
    """A small GPT's parameters (all random, LayerNorm weights near 1)."""
    from ..model.params import GPTConfig, ParamBuffer
    cfg = GPTConfig(vocab_size=int(rng.integers(5, 12)), block_size=8, n_layer=n_layer, n_head=n_head,
                    d_model=d_model)
    params = ParamBuffer(cfg, dtype=dt)
    params.flat[...] = rng.standard_normal(params.flat.size) * 0.3
    for name in ("ln1w", "ln2w", "lnfw"):
        params[name] = 1.0 + rng.standard_normal(params[name].shape) * 0.2
    return {"cfg": cfg, "params": params, "B": B, "T": T}


def _models(rng, dt):
    """Model A: 3 layers; model B: 2 layers, one sequence of length T = 1, another head count."""
    nh = int(rng.integers(1, 3))
    a = _model(rng, dt, 3, nh, nh * int(rng.integers(2, 5)), int(rng.integers(2, 4)), int(rng.integers(2, 8)))
    nh_b = 3 - nh
    b = _model(rng, dt, 2, nh_b, nh_b * int(rng.integers(2, 4)), 1, 1)
    return a, b


def _describe(m, l=None):
    cfg = m["cfg"]
    return (f"B={m['B']}, T={m['T']}, C={cfg.d_model}, nh={cfg.n_head}, {cfg.n_layer} layers"
            + ("" if l is None else f", l={l}"))


# ----------------------------------------------------------------------------------------------------------------
# 08.1: a checkpointed block backward
# ----------------------------------------------------------------------------------------------------------------

def _block_reference(params, l, x_in, n_head, dx_out, grads, k=None):
    """d(x_in) of block l (writing layer l's gradients into grads), its forward recomputed with layer k's weights
    (k = l: the right answer). Returns (dx, cache)."""
    from ..reference.gpt import block_backward, block_forward
    _, c = block_forward(params, l if k is None else k, x_in, n_head)
    return block_backward(dx_out.copy(), c, grads, l), c


def _block_calls(rng, dt):
    """The calls: model A layers 2, 1, 0 (a backward pass) and 2 again on new inputs; model B layers 1, 0."""
    a, b = _models(rng, dt)
    calls = []
    for m, l in ((a, 2), (a, 1), (a, 0), (a, 2), (b, 1), (b, 0)):
        C = m["cfg"].d_model
        x_in = rng.standard_normal((m["B"], m["T"], C)).astype(dt)
        dx_out = (rng.standard_normal((m["B"], m["T"], C)) * 0.1).astype(dt)
        grads0 = m["params"].zeros_like()
        grads0.flat[...] = rng.standard_normal(grads0.flat.size)       # what earlier layers' backward left there
        g = grads0.copy()
        dx, c = _block_reference(m["params"], l, x_in, m["cfg"].n_head, dx_out, g)
        calls.append({"m": m, "l": l, "x_in": x_in, "dx_out": dx_out, "grads0": grads0, "dx": dx, "grads": g,
                      "cache": c})
    return calls


def _layer_used(call, ours):
    """The layer k != l whose weights reproduce your d(x_in) for this call, or None."""
    m, l = call["m"], call["l"]
    for k in range(m["cfg"].n_layer):
        if k != l:
            dx, _ = _block_reference(m["params"], l, call["x_in"], m["cfg"].n_head, call["dx_out"],
                                     call["grads0"].copy(), k=k)
            if _same(ours, dx):
                return k
    return None


def _stale(calls, i, ours):
    """'what' if your d(x_in) for call i comes from an earlier call's inputs, else None."""
    from ..reference.gpt import block_backward
    call = calls[i]
    for j in range(i):
        prev = calls[j]
        if _same(ours, prev["dx"]):
            return f"call {j + 1}'s d(x_in), returned again"
        if prev["m"] is call["m"] and prev["x_in"].shape == call["x_in"].shape:
            try:
                dx = block_backward(call["dx_out"].copy(), prev["cache"], call["grads0"].copy(), call["l"])
            except Exception:
                continue
            if _same(ours, dx):
                return f"the activations of call {j + 1} (layer {prev['l']}, other x_in) with this call's dx_out"
    return None


def _layer_pattern(calls, outs, i, k):
    """Name the layer mistake from every call of the same model: a hard-coded index, or l off by a constant."""
    m = calls[i]["m"]
    used = []
    for j, call in enumerate(calls):
        if call["m"] is not m or outs[j] is None or isinstance(outs[j], BaseException):
            continue
        ours = outs[j][0]
        used.append((call["l"], call["l"] if _same(ours, call["dx"]) else _layer_used(call, ours)))
    if used and all(u == k for _, u in used if u is not None) and len({u for _, u in used}) == 1 and \
            any(l != k for l, _ in used):
        return f"the layer index is hard-coded: every call used layer {k}'s weights, whatever l"
    L = m["cfg"].n_layer
    shifts = {(u - l) % L for l, u in used if u is not None}
    if len(shifts) == 1 and all(u is not None for _, u in used):
        d = shifts.pop()
        d = d - L if d > L // 2 else d                  # params[name][l - 1] at l = 0 is the LAST layer's
        if d:
            return (f"the layer index is off by {d:+d}: the forward ran with layer l {'+' if d > 0 else '-'} "
                    f"{abs(d)} (wrapping around)")
    return None


def check_block_recompute(fn, dtype=np.float32, seed=None, task=None, quiet=False) -> "CheckResult":
    """Check dx_in = fn(x_in, params, l, n_head, dx_out, grads) (see the module docstring): d(x_in) and layer l's
    gradients bitwise equal to block_forward + block_backward, nothing else in grads changed, for every layer of
    two small models, six calls. dtype: np.float32 (default) or np.float64. seed: None for fresh inputs, or the seed
    a check printed. task: label for grading. quiet: do not print. Returns a checks.CheckResult (truthy when
    correct); errors raised by fn are reported."""
    name = "block_recompute"
    seed = _validate(name, fn, seed)
    dt = _dtype(name, dtype)
    rng = np.random.default_rng(seed)
    calls = _block_calls(rng, dt)

    outs = []                          # per call: (ours, grads after, params changed, inputs changed) or exception
    for call in calls:
        m = call["m"]
        p_in, g_in = m["params"].copy(), call["grads0"].copy()
        x_arg, dx_arg = call["x_in"].copy(), call["dx_out"].copy()
        try:
            ours = fn(x_arg, p_in, call["l"], m["cfg"].n_head, dx_arg, g_in)
        except NotImplementedError:
            return _not_attempted(name, task, seed, dt, {"call": len(outs) + 1}, quiet)
        except Exception as exc:  # the learner's error is reported, never raised
            outs.append(exc)
            break
        changed = not np.array_equal(m["params"].flat, p_in.flat) or not np.array_equal(x_arg, call["x_in"])
        outs.append((ours, g_in, changed))

    for i, out in enumerate(outs):
        call = calls[i]
        m, l = call["m"], call["l"]
        L = m["cfg"].n_layer
        dims = {"B": m["B"], "T": m["T"], "C": m["cfg"].d_model, "nh": m["cfg"].n_head, "L": L, "l": l,
                "call": i + 1}
        where = f"call {i + 1} of {len(calls)}: {_describe(m, l)}; seed {seed}"

        def fail(msg, hint, where=where, dims=dims):
            return _result(name, task, "wrong", f"{name}: wrong - {msg} ({where})", hint=hint, seed=seed,
                           dtype=dt.name, dims=dims, quiet=quiet)
        if isinstance(out, BaseException):
            return _block_error(name, out, call, where, seed, task, dt, dims, quiet)
        ours, g_in, changed = out
        expected_dx, expected_grads, grads0 = call["dx"], call["grads"], call["grads0"]
        # --- what it returned
        if ours is None:
            return fail("your function returned None", "return d(x_in): the value block_backward returns")
        if isinstance(ours, tuple):
            return fail(f"your function returned a tuple of {len(ours)}",
                        "return only d(x_in) (B, T, C), the array block_backward returns; the gradients go into "
                        "grads")
        ours = np.asarray(ours)
        if ours.shape != expected_dx.shape:
            stale = _stale(calls, i, ours)
            if stale:
                return fail(f"d(x_in) has shape {ours.shape}, expected {expected_dx.shape}: {stale}",
                            "stale activations: your function reuses something kept from an earlier call; recompute "
                            "the block's forward from the x_in you are given, on every call")
            return fail(f"d(x_in) has shape {ours.shape}, expected {expected_dx.shape}",
                        "return d(x_in), the (B, T, C) array block_backward returns")
        if changed:
            return fail("your function changed params or x_in", "the recompute only reads params and x_in")
        if ours.dtype != expected_dx.dtype:
            return fail(f"d(x_in) is {ours.dtype}, expected {expected_dx.dtype}",
                        "run the reference ops on the arrays as given: no casts")
        if not np.array_equal(ours, expected_dx):
            at = f"d(x_in){_first_diff(ours, expected_dx)}"
            if np.array_equal(ours, call["dx_out"]):
                return fail(f"d(x_in) equals dx_out; {at}",
                            "you returned the incoming gradient unchanged (only the residual path): d(x_in) is "
                            "dx_out plus the gradient through attention and the MLP, what block_backward returns")
            stale = _stale(calls, i, ours)
            if stale:
                return fail(f"d(x_in) is {stale}; {at}",
                            "stale activations: your function reuses a cache (or a result) kept from an earlier "
                            "call; recompute the block's forward from the x_in you are given, on every call")
            k = _layer_used(call, ours)
            if k is not None:
                pattern = _layer_pattern(calls, outs, i, k)
                return fail(f"for l = {l} your d(x_in) is what layer {k}'s weights give; {at}",
                            (pattern + "; " if pattern else "") + f"recompute block l = {l} with layer l's weights "
                            "(every layer index is checked, so a fixed or shifted index fails)")
            if np.all(np.isfinite(ours)) and _max_rel(ours, expected_dx) < 1e-4:
                return fail(f"d(x_in) is close (max rel err {_max_rel(ours, expected_dx):.1g}) but not bitwise "
                            f"equal; {at}", "recompute with exactly the reference ops (block_forward, "
                            "block_backward) in the same dtype and order: then the result is bitwise the same, which "
                            "is the point of checkpointing")
            return fail(at, "rerun block l's forward from x_in (block_forward) and pass its cache to block_backward")
        # --- what it wrote into grads
        untouched = [key for key in LAYER_GRADS if np.array_equal(g_in[key][l], grads0[key][l])]
        wrong = [key for key in LAYER_GRADS if not np.array_equal(g_in[key][l], expected_grads[key][l])]
        others = [(key, j) for key in LAYER_GRADS for j in range(L)
                  if j != l and not np.array_equal(g_in[key][j], grads0[key][j])]
        others += [(key, None) for key in ("wte", "wpe", "lnfw", "lnfb") if not np.array_equal(g_in[key], grads0[key])]
        if wrong:
            key = wrong[0]
            if len(untouched) == len(LAYER_GRADS):
                moved = sorted({j for _, j in others if j is not None})
                if moved:
                    return fail(f"layer {l}'s gradients were not written; layer {moved[0]}'s were",
                                f"write into layer l = {l}: block_backward writes the slice of the layer index you "
                                f"pass it")
                return fail(f"layer {l}'s gradients were not written (grads unchanged)",
                            "pass the grads you were given to block_backward (not a copy, not a new buffer): it "
                            "writes grads[name][l] in place")
            acc = {k2: grads0[k2][l].astype(np.float64) + expected_grads[k2][l] for k2 in LAYER_GRADS}
            if all(np.allclose(g_in[k2][l], acc[k2], rtol=1e-5, atol=1e-6) for k2 in LAYER_GRADS):
                return fail(f"layer {l}'s gradients were added to what grads held",
                            "the gradients were accumulated (+=) into grads; block_backward WRITES (overwrites) "
                            "layer l's slices, as the whole backward does (gpt_backward overwrites every gradient "
                            "tensor once per step)")
            return fail(f"grads[{key!r}][{l}]{_first_diff(g_in[key][l], expected_grads[key][l])}",
                        "let block_backward write the gradients, with the cache of block l's recomputed forward")
        if others:
            key, j = others[0]
            what = f"grads[{key!r}][{j}]" if j is not None else f"grads[{key!r}]"
            return fail(f"{what} changed, but only layer {l}'s slices may",
                        "do not zero or write the whole grads buffer: the other layers' gradients are already there")
    msg = (f"{name}: correct (d(x_in) and each layer's {len(LAYER_GRADS)} gradient tensors bitwise equal to the "
           f"reference block backward, nothing else written, in {len(calls)} calls: every layer of "
           f"{_describe(calls[0]['m'])} and of {_describe(calls[-1]['m'])}; {DTYPE_SHORT[dt.name]}, seed {seed})")
    return _result(name, task, "correct", msg, seed=seed, dtype=dt.name, dims={"calls": len(calls)}, quiet=quiet)


def _block_error(name, exc, call, where, seed, task, dt, dims, quiet):
    text = f"{type(exc).__name__}: {exc}"
    hint = None
    if "NoneType" in text and ("subscriptable" in text or "not iterable" in text or "attribute" in text):
        hint = ("block_backward got None (or something empty) for the cache: the cache was not recomputed; "
                "block_forward returns two things, the block's output and its cache, and block_backward needs the "
                "cache")
    elif isinstance(exc, KeyError):
        hint = ("a cache or tensor name is missing: block_backward needs the cache that block_forward returns (its "
                "second value), and grads as given")
    elif isinstance(exc, (IndexError, ValueError)) and ("index" in text or "shape" in text or "broadcast" in text):
        hint = (f"a shape or layer-index problem: l is 0 .. {call['m']['cfg'].n_layer - 1}; x_in and dx_out are "
                f"(B, T, C) = {call['x_in'].shape} (a shape from an earlier call means something was kept between "
                f"calls)")
    return _error(name, exc, hint, seed, task, dt, dims, quiet, where=where)


# ----------------------------------------------------------------------------------------------------------------
# 08.2: the LayerNorm output rebuilt from its saved statistics
# ----------------------------------------------------------------------------------------------------------------

def _layernorm_variants(inp, mean, rstd, weight, bias):
    """Common mistakes, in the dtype of the inputs: (hint, out)."""
    from ..reference.layernorm import layernorm_stats
    m, r = mean[..., None], rstd[..., None]
    with np.errstate(all="ignore"):
        out = [
            ("the bias is missing: the output is the normalized row times the weight PLUS the bias",
             (inp - m) * r * weight),
            ("the weight is missing: the output is the normalized row times the weight plus the bias",
             (inp - m) * r + bias),
            ("you divided by rstd: rstd is already 1 / std (the reciprocal), so multiply by it",
             (inp - m) / r * weight + bias),
            ("the mean was not subtracted before scaling by rstd", inp * r * weight + bias),
            ("the row was not normalized: rstd is unused", (inp - m) * weight + bias),
            ("you used the standard deviation from NumPy (np.std, no eps) instead of the saved rstd: use the saved "
             "statistics, they are what the forward used", (inp - m) / inp.std(axis=-1, keepdims=True) * weight
             + bias),
        ]
        mu, rs = layernorm_stats(inp)
        if not (np.array_equal(mu, mean) and np.array_equal(rs, rstd)):
            out.append(("you recomputed the statistics instead of using the saved mean and rstd",
                        (inp - mu[..., None]) * rs[..., None] * weight + bias))
    return out


def _ln_case(rng, dt, B, T, C):
    from ..reference.layernorm import layernorm_forward
    inp = (rng.standard_normal((B, T, C)) * 10.0 ** rng.uniform(-1, 1, (B, T, 1))
           + rng.standard_normal((B, T, 1))).astype(dt)
    weight = (1.0 + 0.3 * rng.standard_normal(C)).astype(dt)
    bias = (0.3 * rng.standard_normal(C)).astype(dt)
    expected, cache = layernorm_forward(inp, weight, bias)
    return {"args": (inp, cache["mean"], cache["rstd"], weight, bias), "expected": expected, "dims": (B, T, C)}


def check_layernorm_rebuild(fn, dtype=np.float32, seed=None, task=None, quiet=False) -> "CheckResult":
    """Check out = fn(inp, mean, rstd, weight, bias) (see the module docstring): bitwise equal to the output of
    reference layernorm_forward(inp, weight, bias), from the statistics that forward saved, on four inputs (two of
    one shape, T = 1, C = 1)."""
    name = "layernorm_rebuild"
    seed = _validate(name, fn, seed)
    taken = borrowed.borrowed_verdict(name, [fn], OWN[name], task=task, seed=seed, quiet=quiet,
                                      check="check_layernorm_rebuild")
    if taken is not None:
        return taken
    dt = _dtype(name, dtype)
    rng = np.random.default_rng(seed)
    B, T, C = int(rng.integers(1, 4)), int(rng.integers(2, 9)), int(rng.integers(3, 40))
    shapes = [(B, T, C), (B, T, C), (int(rng.integers(1, 4)), 1, int(rng.integers(3, 40))), (2, 3, 1)]
    cases = [_ln_case(rng, dt, *s) for s in shapes]
    for i, case in enumerate(cases):
        B, T, C = case["dims"]
        dims = {"B": B, "T": T, "C": C, "call": i + 1}
        where = f"call {i + 1} of {len(cases)}: B={B}, T={T}, C={C}; seed {seed}"
        args = [a.copy() for a in case["args"]]
        expected = case["expected"]

        def fail(msg, hint, where=where, dims=dims):
            return _result(name, task, "wrong", f"{name}: wrong - {msg} ({where})", hint=hint, seed=seed,
                           dtype=dt.name, dims=dims, quiet=quiet)
        try:
            ours = fn(*args)
        except NotImplementedError:
            return _not_attempted(name, task, seed, dt, dims, quiet)
        except Exception as exc:  # the learner's error is reported, never raised
            hint = None
            if isinstance(exc, ValueError) and "broadcast" in str(exc):
                hint = ("mean and rstd are (B, T), inp is (B, T, C): give them a channel axis, mean[..., None], so "
                        "that they broadcast over C")
            return _error(name, exc, hint, seed, task, dt, dims, quiet, where=where)
        if ours is None:
            return fail("your function returned None", "return the LayerNorm output (B, T, C)")
        ours = np.asarray(ours)
        for j in range(i):
            if _same(ours, cases[j]["expected"]) and not _same(ours, expected):
                return fail(f"your output is call {j + 1}'s again",
                            "stale: your function returns something kept from an earlier call; rebuild the output "
                            "from the arguments of this call")
        problem = _rebuilt_problem(
            ours, expected,
            shape=(f"the output has shape {ours.shape}, expected {expected.shape}",
                   "mean and rstd are (B, T): broadcast them over the channels with mean[..., None]"),
            dtype=(f"the output is {ours.dtype}, expected {expected.dtype}", "compute in the inputs' dtype: no casts"),
            at="out", mistakes=[(out, hint) for hint, out in _layernorm_variants(*case["args"])],
            rtol=1e-4, atol=1e-5, equal_nan=True,
            close=("close (max rel err {rel:.1g}) but not bitwise equal; {at}",
                   "use the forward's own operations in the forward's order (see layernorm_forward in "
                   "gpullm_lessons.reference.layernorm): a different order rounds differently, and only the same "
                   "order is bitwise equal"),
            other="normalize each row with the saved mean and rstd, then scale by weight and add bias, as "
                  "layernorm_forward does")
        if problem:
            return fail(*problem)
    return _result(name, task, "correct", f"{name}: correct (bitwise equal to layernorm_forward's output on "
                   f"{len(cases)} inputs, including T = 1 and C = 1; {DTYPE_SHORT[dt.name]}, seed {seed})",
                   seed=seed, dtype=dt.name, dims={"calls": len(cases)}, quiet=quiet)


# ----------------------------------------------------------------------------------------------------------------
# 08.3: the selective policy's rebuild of a block cache
# ----------------------------------------------------------------------------------------------------------------

_REBUILT = (("qkv", "ln1 output, the qkv linear's input"), ("fc", "ln2 output, the fc linear's input"),
            ("fcproj", "GELU output, the fcproj linear's input"))


def _snapshot(obj):
    """A deep copy of a (nested dict of) arrays, to see later whether it was changed."""
    return copy.deepcopy(obj)


def _changed(before, after, path="kept"):
    """The first place where after differs from before (keys added / removed, arrays changed), or None."""
    if isinstance(before, dict):
        if not isinstance(after, dict):
            return f"{path} was replaced"
        added = [k for k in after if k not in before]
        if added:
            return f"{path}[{added[0]!r}] was added"
        for k in before:
            if k not in after:
                return f"{path}[{k!r}] was removed"
            d = _changed(before[k], after[k], f"{path}[{k!r}]")
            if d:
                return d
        return None
    if isinstance(before, np.ndarray):
        return None if _same(before, after) else f"{path} was changed"
    return None


def _selective_calls(rng, dt):
    from ..model.checkpointing import _drop_selective
    from ..reference.gpt import block_forward
    a, b = _models(rng, dt)
    calls = []
    for m, l in ((a, 2), (a, 1), (a, 0), (b, 0)):
        p = m["params"]
        x_in = rng.standard_normal((m["B"], m["T"], m["cfg"].d_model)).astype(dt)
        _, c = block_forward(p, l, x_in, m["cfg"].n_head)
        kept = _drop_selective(copy.deepcopy(c), p["ln1b"][l].copy(), p["ln2b"][l].copy())
        dx_out = (rng.standard_normal(x_in.shape) * 0.1).astype(dt)
        calls.append({"m": m, "l": l, "c": c, "kept": kept, "dx_out": dx_out,
                      "want": {k: c[k]["inp"] for k, _ in _REBUILT}})
    return calls


def _rebuild_candidates(call):
    """For each rebuilt tensor, the wrong tensors a plausible mistake puts there: [(array, hint)]."""
    from ..model.checkpointing import _layernorm_out
    from ..reference.gelu import gelu_forward
    c, kept = call["c"], call["kept"]
    ln1, ln2 = c["qkv"]["inp"], c["fc"]["inp"]
    zero = np.zeros_like(kept["ln1_bias"])
    with np.errstate(all="ignore"):
        ln1_nob, ln2_nob = _layernorm_out(c["ln1"], zero), _layernorm_out(c["ln2"], zero)
        ln1_b2, ln2_b1 = _layernorm_out(c["ln1"], kept["ln2_bias"]), _layernorm_out(c["ln2"], kept["ln1_bias"])
        gelu_of_ln2 = gelu_forward(ln2)[0]
        x = c["gelu"]["inp"]
        erf = np.vectorize(math.erf, otypes=[np.float64])
        gelu_erf = (0.5 * x.astype(np.float64) * (1.0 + erf(x.astype(np.float64) / math.sqrt(2.0)))).astype(x.dtype)
    return {
        "qkv": [(ln2, "ln1 and ln2 are swapped: the qkv linear reads the FIRST LayerNorm's output (ln1, from the "
                      "block input x), the fc linear the second's (ln2, from x_mid)"),
                (ln1_nob, "the LayerNorm bias is missing: the LayerNorm caches hold the weight but not the bias, "
                          "which is why kept carries ln1_bias and ln2_bias"),
                (ln1_b2, "ln1 was rebuilt with ln2's bias: ln1 uses kept['ln1_bias']"),
                (c["ln1"]["inp"], "the qkv linear got the LayerNorm's INPUT (x): it reads ln1's output, rebuilt "
                                  "from x with the saved mean and rstd")],
        "fc": [(ln1, "ln1 and ln2 are swapped: the fc linear reads the SECOND LayerNorm's output (ln2)"),
               (ln2_nob, "the LayerNorm bias is missing: the LayerNorm caches hold the weight but not the bias, "
                         "which is why kept carries ln1_bias and ln2_bias"),
               (ln2_b1, "ln2 was rebuilt with ln1's bias: ln2 uses kept['ln2_bias']"),
               (c["ln2"]["inp"], "the fc linear got the LayerNorm's INPUT (x_mid): it reads ln2's output")],
        "fcproj": [(c["gelu"]["inp"], "the GELU was not applied: the fcproj linear reads the GELU's OUTPUT; the "
                                      "cache keeps its input (the fc output), rebuild the output from it"),
                   (gelu_of_ln2, "the GELU was applied to the wrong tensor: its input is the fc output, which the "
                                 "GELU cache keeps"),
                   (gelu_erf, "another GELU: the course's GELU is the tanh approximation, not the exact erf form; "
                              "rebuild the output with the forward's own gelu_forward to get the same bits")],
    }


def check_selective_rebuild(fn, dtype=np.float32, seed=None, task=None, quiet=False) -> "CheckResult":
    """Check cache = fn(kept) (see the module docstring): the block cache rebuilt from what policy "selective"
    keeps, its three rebuilt tensors and block_backward's results bitwise equal to the forward's, kept unchanged;
    four calls (every layer of a 3-layer model, and T = 1)."""
    from ..reference.gpt import block_backward
    name = "selective_rebuild"
    seed = _validate(name, fn, seed)
    taken = borrowed.borrowed_verdict(name, [fn], OWN[name], task=task, seed=seed, quiet=quiet,
                                      check="check_selective_rebuild")
    if taken is not None:
        return taken
    dt = _dtype(name, dtype)
    rng = np.random.default_rng(seed)
    calls = _selective_calls(rng, dt)
    for i, call in enumerate(calls):
        m, l = call["m"], call["l"]
        dims = {"B": m["B"], "T": m["T"], "C": m["cfg"].d_model, "l": l, "call": i + 1}
        where = f"call {i + 1} of {len(calls)}: {_describe(m, l)}; seed {seed}"

        def fail(msg, hint, where=where, dims=dims):
            return _result(name, task, "wrong", f"{name}: wrong - {msg} ({where})", hint=hint, seed=seed,
                           dtype=dt.name, dims=dims, quiet=quiet)
        kept = call["kept"]
        before = _snapshot(kept)
        try:
            ours = fn(kept)
        except NotImplementedError:
            return _not_attempted(name, task, seed, dt, dims, quiet)
        except Exception as exc:  # the learner's error is reported, never raised
            hint = None
            if isinstance(exc, KeyError):
                hint = (f"kept has no {exc}: it holds {sorted(kept)}; the linear caches qkv, fc, fcproj hold only "
                        f"weight and has_bias, the LayerNorm caches inp, weight, mean, rstd, the GELU cache inp")
            return _error(name, exc, hint, seed, task, dt, dims, quiet, where=where)
        if ours is None:
            return fail("your function returned None", "return the rebuilt block cache (a dict)")
        if not isinstance(ours, dict):
            return fail(f"your function returned {type(ours).__name__}", "return the rebuilt block cache, a dict "
                        "with the same keys as block_forward's cache")
        changed = _changed(before, kept)
        if changed:
            return fail(f"{changed} by your function",
                        "you changed the selective cache: it would keep the rebuilt tensors from now on and the "
                        "memory is not saved (`dict(kept)` copies only the outer dict: kept['qkv'] is still the same "
                        "inner dict); return a new dict, with new inner dicts for qkv, fc and fcproj")
        for key, what in _REBUILT:
            sub = ours.get(key)
            if not isinstance(sub, dict) or "inp" not in sub:
                return fail(f"cache[{key!r}] has no 'inp' ({what})", f"block_backward reads cache[{key!r}]"
                            f"['inp']: put the rebuilt {what} there")
            missing = [k for k in ("weight", "has_bias") if k not in sub]
            if missing:
                return fail(f"cache[{key!r}] has no {missing[0]!r}", f"keep the linear cache's weight and has_bias "
                            f"(kept[{key!r}]) and add inp to a copy of it")
        for j in range(i):                                   # stale: a tensor from an earlier call
            for key, what in _REBUILT:
                got = np.asarray(ours[key]["inp"])
                if _same(got, calls[j]["want"][key]) and not _same(got, call["want"][key]):
                    return fail(f"cache[{key!r}]['inp'] is call {j + 1}'s {what}",
                                "stale: your function returns a tensor kept from an earlier call; rebuild every "
                                "tensor from the kept cache of this call")
        cands = _rebuild_candidates(call)
        for key, what in _REBUILT:
            got, want = np.asarray(ours[key]["inp"]), call["want"][key]
            tensor = f"cache[{key!r}]['inp']"
            problem = _rebuilt_problem(
                got, want,
                shape=(f"{tensor} ({what}) has shape {got.shape}, expected {want.shape}", "rebuild it with the shapes "
                       "of the forward: LayerNorm outputs (B, T, C), the GELU output (B, T, 4C)"),
                dtype=(f"{tensor} is {got.dtype}, expected {want.dtype}", "compute in the cache's dtype: no casts"),
                at=f"{tensor} ({what})", mistakes=cands[key], rtol=1e-5, atol=1e-6,
                close=("{at}: close but not bitwise equal", "rebuild with the forward's own operations in its order "
                       "(the LayerNorm output from the saved statistics as layernorm_forward computes it, the GELU "
                       "with gelu_forward): only the same operations give the same bits"),
                other=f"rebuild it ({what}) from what kept holds, with the forward's own operations")
            if problem:
                return fail(*problem)
        # the rest of the cache: block_backward on your cache must give the reference's results
        g_ref, g_ours = m["params"].zeros_like(), m["params"].zeros_like()
        dx_ref = block_backward(call["dx_out"].copy(), call["c"], g_ref, l)
        try:
            dx_ours = block_backward(call["dx_out"].copy(), ours, g_ours, l)
        except Exception as exc:
            return fail(f"block_backward on your cache raised {type(exc).__name__}: {str(exc)[:120]}",
                        "return every entry of the block cache (ln1, qkv, attention, attproj, ln2, fc, gelu, "
                        "fcproj), the kept ones unchanged")
        if not (np.array_equal(dx_ours, dx_ref) and np.array_equal(g_ours.flat, g_ref.flat)):
            bad = next((k for k in ("ln1", "attention", "attproj", "ln2", "gelu")
                        if _changed(call["kept"][k], ours.get(k), k)), None)
            return fail("block_backward on your cache differs from the reference"
                        + (f": cache[{bad!r}] is not what was kept" if bad else ""),
                        "keep the entries that were not dropped exactly as kept holds them; rebuild only the three "
                        "dropped tensors")
    return _result(name, task, "correct", f"{name}: correct (the LayerNorm and GELU outputs rebuilt bitwise, "
                   f"block_backward on your cache bitwise equal, the selective cache left as it was, in {len(calls)} "
                   f"calls: every layer of {_describe(calls[0]['m'])}, and T = 1; {DTYPE_SHORT[dt.name]}, "
                   f"seed {seed})", seed=seed, dtype=dt.name, dims={"calls": len(calls)}, quiet=quiet)
