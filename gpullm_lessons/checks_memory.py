"""Checkers for lesson 08 (activation checkpointing): is your recompute bitwise the same as keeping everything?

They follow the conventions of ``gpullm_lessons.checks`` (fresh random inputs on every call, the seed printed, one
verdict printed: not attempted / error / wrong with a hint / correct; your exceptions reported, never raised;
``task=`` for grading, ``quiet=``). Unlike the op checkers there is no tolerance: recomputation runs the same
reference ops in the same order on the same inputs, so the result must be **bitwise** equal (``np.array_equal``).

``check_block_recompute(fn)`` (exercise 08.1), fn called as

    dx_in = fn(x_in, params, l, n_head, dx_out, grads)

x_in (B, T, C): block l's saved input (the only thing policy "full" keeps for it); params: a ParamBuffer (the
stacked weights, params["qkvw"][l] is layer l's); l: the layer; n_head; dx_out (B, T, C): d(loss)/d(block l's
output); grads: a ParamBuffer holding OTHER values already (as in the middle of a backward pass). fn must rerun block
l's forward from x_in (reference ``block_forward``), then its backward (``block_backward``), return d(x_in) (B, T, C)
and WRITE (overwrite, as block_backward does) layer l's slice of the 12 per-layer gradient tensors, leaving every
other layer's slice and the global tensors (wte, wpe, lnfw, lnfb) untouched. Compared with block_forward +
block_backward on the same inputs.

``check_layernorm_rebuild(fn)`` (exercise 08.2), fn called as

    out = fn(inp, mean, rstd, weight, bias)

inp (B, T, C), mean and rstd (B, T) as layernorm_forward saved them, weight, bias (C,): the LayerNorm output
(B, T, C), rebuilt from the saved statistics (policy "selective" drops it and rebuilds it in backward). Compared
with layernorm_forward's output.
"""
from __future__ import annotations


import numpy as np

from . import checks as _checks

__all__ = ["check_block_recompute", "check_layernorm_rebuild", "LAYER_GRADS"]

LAYER_GRADS = ("ln1w", "ln1b", "qkvw", "qkvb", "attprojw", "attprojb", "ln2w", "ln2b", "fcw", "fcb", "fcprojw",
               "fcprojb")   # the per-layer tensors block_backward writes (slice [l] of each)


def _result(name, task, status, msg, hint=None, seed=None, dtype=None, dims=None, quiet=False):
    result = _checks.CheckResult(name=name, task=task, status=status, passed=status == "correct",
                                 message=msg + (f"\n  hint: {hint}" if hint else ""), hint=hint, seed=seed,
                                 dtype=dtype, arrays="numpy", dims=dims)
    from . import grading
    grading.record(check=f"check_{name}", task=task, status=status, message=msg)
    if not quiet:
        print(result.message)
    return result


def _dtype(name, dtype):
    dt = _checks._normalize_dtype(dtype)
    if dt.name not in ("float32", "float64"):
        raise ValueError(f"check_{name}: dtype={dt.name} is not supported: the reference GPT runs in float32 "
                         f"(or float64); use np.float32")
    return dt


def _validate(name, fn, seed):
    return _checks.learner_fn_and_seed(name, fn, seed, "inputs")


def _error(name, exc, extra_hint, seed, task, dt, dims, quiet):
    first = " ".join(str(exc).split())
    first = first if len(first) <= 200 else first[:197] + "..."
    where = _checks._where_raised(exc)
    msg = f"{name}: error - your function raised {type(exc).__name__}" + (f": {first}" if first else "")
    at = f" (at {where})" if where else ""
    hint = extra_hint or f"the error is in your code{at}"
    hint = hint if "seed" in hint else hint + f" (seed {seed})"
    return _result(name, task, "error", msg, hint=hint, seed=seed, dtype=dt.name, dims=dims,
                   quiet=quiet)


def _max_rel(a, b) -> float:
    with np.errstate(invalid="ignore", over="ignore"):
        return float(np.max(np.abs(a.astype(np.float64) - b) / (np.abs(b).max() + 1e-30)))


# ----------------------------------------------------------------------------------------------------------------
# 08.1: a checkpointed block backward
# ----------------------------------------------------------------------------------------------------------------

def _block_case(rng, dt):
    """A small GPT's parameters (all random, LayerNorm weights near 1), a layer l, x_in, dx_out, prior grads."""
    from .params import GPTConfig, ParamBuffer
    nh = int(rng.integers(1, 4))
    cfg = GPTConfig(vocab_size=int(rng.integers(5, 12)), block_size=8, n_layer=int(rng.integers(2, 5)), n_head=nh,
                    d_model=nh * int(rng.integers(2, 5)))
    B, T = int(rng.integers(1, 4)), int(rng.integers(2, 8))
    params = ParamBuffer(cfg, dtype=dt)
    params.flat[...] = rng.standard_normal(params.flat.size) * 0.3
    for name in ("ln1w", "ln2w", "lnfw"):
        params[name] = 1.0 + rng.standard_normal(params[name].shape) * 0.2
    grads = params.zeros_like()
    grads.flat[...] = rng.standard_normal(grads.flat.size)       # what earlier layers' backward left there
    l = int(rng.integers(0, cfg.n_layer))
    x_in = rng.standard_normal((B, T, cfg.d_model)).astype(dt)
    dx_out = (rng.standard_normal((B, T, cfg.d_model)) * 0.1).astype(dt)
    dims = {"B": B, "T": T, "C": cfg.d_model, "nh": nh, "L": cfg.n_layer, "l": l}
    return cfg, params, grads, l, x_in, dx_out, dims


def _block_reference(params, l, x_in, n_head, dx_out, grads):
    from .reference.gpt import block_backward, block_forward
    _, c = block_forward(params, l, x_in, n_head)
    return block_backward(dx_out.copy(), c, grads, l)


def check_block_recompute(fn, dtype=np.float32, seed=None, task=None, quiet=False) -> "_checks.CheckResult":
    """Check dx_in = fn(x_in, params, l, n_head, dx_out, grads) (see the module docstring): d(x_in) and layer l's
    gradients bitwise equal to block_forward + block_backward, nothing else in grads changed. dtype: np.float32
    (default) or np.float64. seed: None for fresh inputs, or the seed a check printed. task: label for grading.
    quiet: do not print. Returns a checks.CheckResult (truthy when correct); errors raised by fn are reported."""
    name = "block_recompute"
    seed = _validate(name, fn, seed)
    dt = _dtype(name, dtype)
    rng = np.random.default_rng(seed)
    cfg, params, grads0, l, x_in, dx_out, dims = _block_case(rng, dt)
    where = (f"B={dims['B']}, T={dims['T']}, C={dims['C']}, nh={dims['nh']}, {dims['L']} layers, l={l}; "
             f"seed {seed}")
    expected_grads = grads0.copy()
    expected_dx = _block_reference(params, l, x_in, cfg.n_head, dx_out, expected_grads)

    p_in, g_in = params.copy(), grads0.copy()
    x_arg, dx_arg = x_in.copy(), dx_out.copy()
    try:
        ours = fn(x_arg, p_in, l, cfg.n_head, dx_arg, g_in)
    except NotImplementedError:
        return _result(name, task, "not attempted", f"{name}: not attempted (your function raised "
                       f"NotImplementedError)", hint="replace the `raise NotImplementedError` with your code",
                       seed=seed, dtype=dt.name, dims=dims, quiet=quiet)
    except Exception as exc:  # the learner's error is reported, never raised
        text = f"{type(exc).__name__}: {exc}"
        hint = None
        if "NoneType" in text and ("subscriptable" in text or "not iterable" in text or "attribute" in text):
            hint = ("block_backward got None (or something empty) for the cache: the cache was not recomputed. "
                    "Run `_, c = block_forward(params, l, x_in, n_head)` first and pass that c")
        elif isinstance(exc, KeyError):
            hint = ("a cache or tensor name is missing: pass block_backward the cache c that block_forward(params, "
                    "l, x_in, n_head) returns (its second value), and grads as given")
        elif isinstance(exc, (IndexError, ValueError)) and ("index" in text or "shape" in text
                                                             or "broadcast" in text):
            hint = (f"a shape or layer-index problem: l is 0 .. {dims['L'] - 1}; x_in and dx_out are (B, T, C) = "
                    f"{x_in.shape}")
        if hint:
            where_raised = _checks._where_raised(exc)
            hint = hint + (f" (at {where_raised})" if where_raised else "") + f"; {where}"
        return _error(name, exc, hint, seed, task, dt, dims, quiet)

    fail = lambda msg, hint: _result(name, task, "wrong", f"{name}: wrong - {msg} ({where})", hint=hint,  # noqa
                                     seed=seed, dtype=dt.name, dims=dims, quiet=quiet)
    # --- what it returned
    if ours is None:
        return fail("your function returned None", "return d(x_in): the value block_backward returns")
    if isinstance(ours, tuple):
        return fail(f"your function returned a tuple of {len(ours)}",
                    "return only d(x_in) (B, T, C), the array block_backward returns; the gradients go into grads")
    ours = np.asarray(ours)
    if ours.shape != expected_dx.shape:
        return fail(f"d(x_in) has shape {ours.shape}, expected {expected_dx.shape}",
                    "return d(x_in), the (B, T, C) array block_backward returns")
    if not np.array_equal(params.flat, p_in.flat) or not np.array_equal(x_arg, x_in):
        return fail("your function changed params or x_in", "the recompute only reads params and x_in")
    if ours.dtype != expected_dx.dtype:
        return fail(f"d(x_in) is {ours.dtype}, expected {expected_dx.dtype}",
                    "run the reference ops on the arrays as given: no casts")
    if not np.array_equal(ours, expected_dx):
        if np.array_equal(ours, dx_out):
            return fail("d(x_in) equals dx_out", "you returned the incoming gradient unchanged (only the residual "
                        "path): d(x_in) = dx_out + the gradient through attention and MLP; return what "
                        "block_backward(dx_out, c, grads, l) returns")
        for other in range(cfg.n_layer):
            if other != l and np.array_equal(ours, _block_reference(params, other, x_in, cfg.n_head, dx_out,
                                                                    grads0.copy())):
                return fail(f"d(x_in) is what block {other}'s weights give",
                            f"the forward was recomputed with layer {other}'s weights: use layer l = {l}, "
                            f"block_forward(params, l, x_in, n_head)")
        if np.all(np.isfinite(ours)) and _max_rel(ours, expected_dx) < 1e-4:
            return fail(f"d(x_in) is close (max rel err {_max_rel(ours, expected_dx):.1g}) but not bitwise equal",
                        "recompute with exactly the reference ops (block_forward, block_backward) in the same dtype "
                        "and order: then the result is bitwise the same, which is the point of checkpointing")
        i = tuple(int(k) for k in np.argwhere(ours != expected_dx)[0])
        return fail(f"d(x_in){_checks._idx(i)}: yours {_checks._fmt(float(ours[i]))}, expected "
                    f"{_checks._fmt(float(expected_dx[i]))}",
                    "rerun block l's forward from x_in (block_forward) and pass its cache to block_backward")
    # --- what it wrote into grads
    untouched = [k for k in LAYER_GRADS if np.array_equal(g_in[k][l], grads0[k][l])]
    wrong = [k for k in LAYER_GRADS if not np.array_equal(g_in[k][l], expected_grads[k][l])]
    others = [(k, j) for k in LAYER_GRADS for j in range(cfg.n_layer)
              if j != l and not np.array_equal(g_in[k][j], grads0[k][j])]
    others += [(k, None) for k in ("wte", "wpe", "lnfw", "lnfb") if not np.array_equal(g_in[k], grads0[k])]
    if wrong:
        k = wrong[0]
        if len(untouched) == len(LAYER_GRADS):
            moved = sorted({j for _, j in others if j is not None})
            if moved:
                return fail(f"layer {l}'s gradients were not written; layer {moved[0]}'s were",
                            f"write into layer l = {l}: block_backward(dx_out, c, grads, l)")
            return fail(f"layer {l}'s gradients were not written (grads unchanged)",
                        "pass the grads you were given to block_backward (not a copy, not a new buffer): it "
                        "writes grads[name][l] in place")
        acc = {key: grads0[key][l].astype(np.float64) + expected_grads[key][l] for key in LAYER_GRADS}
        if all(np.allclose(g_in[key][l], acc[key], rtol=1e-5, atol=1e-6) for key in LAYER_GRADS):
            return fail(f"layer {l}'s gradients were added to what grads held",
                        "the gradients were accumulated (+=) into grads; block_backward WRITES (overwrites) layer "
                        "l's slices, as the whole backward does: grads[name][l] = ..., not += (gpt_backward "
                        "overwrites every gradient tensor once per step)")
        return fail(f"grads[{k!r}][{l}] differs from the reference block backward",
                    "let block_backward write the gradients: block_backward(dx_out, c, grads, l) with the cache c "
                    "of block_forward(params, l, x_in, n_head)")
    if others:
        k, j = others[0]
        what = f"grads[{k!r}][{j}]" if j is not None else f"grads[{k!r}]"
        return fail(f"{what} changed, but only layer {l}'s slices may",
                    "do not zero or write the whole grads buffer: the other layers' gradients are already there")
    msg = (f"{name}: correct (d(x_in) and layer {l}'s {len(LAYER_GRADS)} gradient tensors bitwise equal to the "
           f"reference block backward, nothing else written; {_checks._SHORT[dt.name]}, {where})")
    return _result(name, task, "correct", msg, seed=seed, dtype=dt.name, dims=dims, quiet=quiet)


# ----------------------------------------------------------------------------------------------------------------
# 08.2: the LayerNorm output rebuilt from its saved statistics
# ----------------------------------------------------------------------------------------------------------------

def _layernorm_variants(inp, mean, rstd, weight, bias):
    """Common mistakes, in the dtype of the inputs: (hint, out)."""
    m, r = mean[..., None], rstd[..., None]
    with np.errstate(all="ignore"):
        return [
            ("the bias is missing: out = xhat * weight + bias", (inp - m) * r * weight),
            ("the weight is missing: out = xhat * weight + bias", (inp - m) * r + bias),
            ("you divided by rstd: rstd is 1 / std already, so multiply: xhat = (inp - mean) * rstd",
             (inp - m) / r * weight + bias),
            ("the mean was not subtracted: xhat = (inp - mean[..., None]) * rstd[..., None]",
             inp * r * weight + bias),
            ("xhat was not normalized (rstd unused): xhat = (inp - mean) * rstd", (inp - m) * weight + bias),
        ]


def check_layernorm_rebuild(fn, dtype=np.float32, seed=None, task=None, quiet=False) -> "_checks.CheckResult":
    """Check out = fn(inp, mean, rstd, weight, bias) (see the module docstring): bitwise equal to the output of
    reference layernorm_forward(inp, weight, bias), from the statistics that forward saved."""
    from .reference.layernorm import layernorm_forward
    name = "layernorm_rebuild"
    seed = _validate(name, fn, seed)
    dt = _dtype(name, dtype)
    rng = np.random.default_rng(seed)
    B, T, C = int(rng.integers(1, 4)), int(rng.integers(2, 9)), int(rng.integers(3, 40))
    dims = {"B": B, "T": T, "C": C}
    where = f"B={B}, T={T}, C={C}; seed {seed}"
    inp = (rng.standard_normal((B, T, C)) * 10.0 ** rng.uniform(-1, 1, (B, T, 1))
           + rng.standard_normal((B, T, 1))).astype(dt)
    weight = (1.0 + 0.3 * rng.standard_normal(C)).astype(dt)
    bias = (0.3 * rng.standard_normal(C)).astype(dt)
    expected, cache = layernorm_forward(inp, weight, bias)
    args = [a.copy() for a in (inp, cache["mean"], cache["rstd"], weight, bias)]
    try:
        ours = fn(*args)
    except NotImplementedError:
        return _result(name, task, "not attempted", f"{name}: not attempted (your function raised "
                       f"NotImplementedError)", hint="replace the `raise NotImplementedError` with your code",
                       seed=seed, dtype=dt.name, dims=dims, quiet=quiet)
    except Exception as exc:  # the learner's error is reported, never raised
        text = str(exc)
        hint = None
        if isinstance(exc, ValueError) and "broadcast" in text:
            hint = ("mean and rstd are (B, T), inp is (B, T, C): give them a channel axis, mean[..., None]; "
                    f"{where}")
        return _error(name, exc, hint, seed, task, dt, dims, quiet)
    fail = lambda msg, hint: _result(name, task, "wrong", f"{name}: wrong - {msg} ({where})", hint=hint,  # noqa
                                     seed=seed, dtype=dt.name, dims=dims, quiet=quiet)
    if ours is None:
        return fail("your function returned None", "return the LayerNorm output (B, T, C)")
    ours = np.asarray(ours)
    if ours.shape != expected.shape:
        return fail(f"the output has shape {ours.shape}, expected {expected.shape}",
                    "mean and rstd are (B, T): broadcast them over the channels with mean[..., None]")
    if ours.dtype != expected.dtype:
        return fail(f"the output is {ours.dtype}, expected {expected.dtype}", "compute in the inputs' dtype: no casts")
    if np.array_equal(ours, expected):
        return _result(name, task, "correct", f"{name}: correct (bitwise equal to layernorm_forward's output; "
                       f"{_checks._SHORT[dt.name]}, {where})", seed=seed, dtype=dt.name, dims=dims, quiet=quiet)
    for hint, out in _layernorm_variants(*args):
        if np.allclose(ours, out, rtol=1e-4, atol=1e-5, equal_nan=True):
            return fail("the output differs from layernorm_forward's", hint)
    if np.all(np.isfinite(ours)) and _max_rel(ours, expected) < 1e-4:
        return fail(f"close (max rel err {_max_rel(ours, expected):.1g}) but not bitwise equal",
                    "use the forward's exact expression and order: xhat = (inp - mean[..., None]) * "
                    "rstd[..., None]; out = xhat * weight + bias (a different order rounds differently, and only the same order is bitwise equal)")
    i = tuple(int(k) for k in np.argwhere(ours != expected)[0])
    return fail(f"out{_checks._idx(i)}: yours {_checks._fmt(float(ours[i]))}, expected "
                f"{_checks._fmt(float(expected[i]))}",
                "out = (inp - mean[..., None]) * rstd[..., None] * weight + bias")
