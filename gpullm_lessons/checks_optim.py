"""Checker for the optimizer step: does your AdamW kernel update the flat buffers as torch.optim.AdamW does?

``check_adamw_step(fn, ...)`` follows the conventions of ``gpullm_lessons.checks`` (fresh random inputs, three
verdicts printed, a hint for the common mistakes, ``grading.record``; arrays="cupy" without a GPU is "skipped").

fn is called the way ``gpullm_lessons.backends.numba.adamw_step`` is (so that launcher passes as it is):

    fn(params, grads, m, v, lr, beta1, beta2, eps, weight_decay, step, decay_bounds)

params, grads, m, v: (n,) arrays on the backend `arrays`, updated IN PLACE: params, m, v get the new values and
grads must be exactly 0 afterwards. lr, beta1, beta2, eps, weight_decay: Python floats; step: int, the step count
after increment (1 on the first step). decay_bounds = (bounds int64 (k+1,), flags uint8 (k,)), the decay table of
``kernels.numba.adamw.decay_table``: tensor j is elements bounds[j] .. bounds[j+1]-1 and decays when flags[j] = 1.

The inputs are a small GPT's parameter buffer (random sizes, a real ParamBuffer layout, nanoGPT's decay rule) in
the middle of training (m, v not zero, step 1..5 so the bias corrections matter), with some elements whose
gradient and v are tiny (there eps matters: eps inside the sqrt shows). Expected values come from the reference
``gpullm_lessons.optim.AdamW`` run in float64 on the same (rounded) inputs. params, m, v pass with the rule of
``checks`` (|yours - expected| <= tol * (|expected| + M), M = max|expected| of that buffer); grads must be 0.
Nothing is poisoned: every buffer is read before it is written, so an element your grid misses keeps its old
value, and the checker says so.
"""
from __future__ import annotations

import math
import secrets

import numpy as np

from . import arrays as _arrays
from . import checks as _checks
from . import device as _device

__all__ = ["check_adamw_step", "adamw_expected"]

NAME = "adamw_step"
OUTPUTS = ("params", "m", "v", "grads")


def adamw_expected(p, g, m, v, lr, beta1, beta2, eps, weight_decay, step, decay_mask):
    """The reference step in float64: (params, m, v) after optim.AdamW.step at step count `step` (copies)."""
    from .optim import AdamW
    p = np.array(p, dtype=np.float64)
    opt = AdamW(p, lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay,
                decay_mask=np.asarray(decay_mask, dtype=bool))
    opt.m[...] = m
    opt.v[...] = v
    opt.t = step - 1                      # step() increments it to `step`
    opt.step(np.array(g, dtype=np.float64))
    return {"params": p, "m": opt.m.copy(), "v": opt.v.copy()}


def _variant(c, *, bias1=True, bias2=True, coupled=False, eps_inside=False, mask="table", lr_in_decay=True,
             t_offset=0):
    """One common mistake (or the correct step with the defaults), float64, from the case's inputs."""
    p, g, m, v = (c[k].astype(np.float64) for k in ("params", "grads", "m", "v"))
    lr, b1, b2, eps, wd, t = c["lr"], c["beta1"], c["beta2"], c["eps"], c["weight_decay"], c["step"] + t_offset
    dm = {"table": c["mask"], "all": np.ones_like(c["mask"]), "none": np.zeros_like(c["mask"])}[mask]
    if coupled:                           # Adam + L2: the decay goes into the gradient, m and v see it
        g = g + wd * p * dm
    else:
        p = p - (lr * wd if lr_in_decay else wd) * p * dm
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    with np.errstate(divide="ignore", invalid="ignore"):   # step - 1 = 0 divides by 1 - beta**0 = 0
        mhat = m / (1 - b1 ** t) if bias1 else m
        vhat = v / (1 - b2 ** t) if bias2 else v
        denom = np.sqrt(vhat + eps) if eps_inside else np.sqrt(vhat) + eps
        return {"params": p - lr * mhat / denom, "m": m, "v": v}


_MISTAKES = (
    (dict(bias1=False, bias2=False), "the bias corrections are missing: divide m by (1 - beta1**step) and v by "
     "(1 - beta2**step) before the update (mhat, vhat); m and v themselves are stored WITHOUT the correction"),
    (dict(bias1=False), "the bias correction of m is missing: mhat = m / (1 - beta1**step)"),
    (dict(bias2=False), "the bias correction of v is missing: vhat = v / (1 - beta2**step)"),
    (dict(t_offset=1), "the bias corrections use step + 1: `step` is already the count after increment "
     "(1 on the first step), use beta**step"),
    (dict(t_offset=-1), "the bias corrections use step - 1: `step` is already the count after increment "
     "(1 on the first step), use beta**step"),
    (dict(coupled=True), "weight decay is coupled: you added weight_decay * p to the gradient (Adam + L2), so m "
     "and v see it. AdamW decouples it: p = p - lr * weight_decay * p, and m, v use the plain gradient"),
    (dict(eps_inside=True), "eps is inside the square root: the denominator is sqrt(vhat) + eps, eps added AFTER "
     "the sqrt (as PyTorch does)"),
    (dict(mask="all"), "weight decay was applied to every tensor: only tensors whose flag is 1 in the decay table "
     "decay (biases and LayerNorm parameters do not); find the tensor j of element i (bounds[j] <= i < bounds[j+1]) "
     "and use flags[j]"),
    (dict(mask="none"), "no weight decay at all: tensors with flags[j] = 1 must shrink by lr * weight_decay * p"),
    (dict(lr_in_decay=False), "the weight decay is not multiplied by lr: p = p - lr * weight_decay * p"),
)


def _make_case(rng, dt, size):
    """A small GPT's flat buffers mid-training, and the scalars. size 'small': n ~ 300..1500; 'large': ~3M."""
    from .optim import DECAY_NAMES
    from .params import GPTConfig, ParamBuffer
    if size == "small":
        cfg = GPTConfig(vocab_size=int(rng.integers(5, 14)), block_size=int(rng.integers(3, 10)),
                        n_layer=int(rng.integers(1, 3)), n_head=2, d_model=int(rng.choice([4, 6, 8])))
    else:
        cfg = GPTConfig(vocab_size=int(rng.integers(8000, 8200)), block_size=256, n_layer=2, n_head=4, d_model=256)
    buf = ParamBuffer(cfg)
    bounds = np.array([0] + [buf.offsets[k][1] for k in buf.names], dtype=np.int64)   # as decay_table() builds it
    flags = np.array([k in DECAY_NAMES for k in buf.names], dtype=np.uint8)
    n = buf.flat.size
    mask = np.repeat(flags.astype(bool), np.diff(bounds))
    g = rng.standard_normal(n) * 10.0 ** rng.uniform(-3, -1, n)          # gradients over two decades
    v = (np.abs(rng.standard_normal(n)) + 0.1) * g * g * rng.uniform(0.5, 2.0, n)  # second moment ~ g^2
    tiny = rng.random(n) < 0.1                                            # here sqrt(v) ~ eps: eps matters
    g[tiny] = rng.standard_normal(tiny.sum()) * 1e-8
    v[tiny] = rng.uniform(0.2, 2.0, tiny.sum()) * 1e-16
    c = {
        "params": rng.standard_normal(n) * 0.5,
        "grads": g,
        "m": rng.standard_normal(n) * np.sqrt(v),
        "v": v,
        "lr": float(rng.uniform(3e-3, 1e-2)), "beta1": 0.9, "beta2": float(rng.choice([0.95, 0.999])),
        "eps": 1e-8, "weight_decay": float(rng.uniform(0.1, 0.3)), "step": int(rng.integers(1, 6)),
        "bounds": bounds, "flags": flags, "mask": mask, "n": n,
    }
    for k in ("params", "grads", "m", "v"):   # rounded to dtype: the reference sees exactly what fn sees
        c[k] = np.ascontiguousarray(c[k].astype(dt))
    return c


def _skipped(task, quiet):
    msg = (f"{NAME}: skipped - arrays='cupy' runs on a GPU, and this machine runs as '{_device.kind()}' "
           f"({_device.info().reason}); it is checked on a GPU server")
    from . import grading
    grading.record(check=f"check_{NAME}", task=task, status="skipped", message=msg)
    if not quiet:
        print(msg)
    return _checks.CheckResult(name=NAME, task=task, status="skipped", passed=False, message=msg, arrays="cupy")


def _diagnose(c, ours, expected, bads, wrong, tol):
    """The hint for a wrong result: never-updated elements, the gradient, then the known mistakes."""
    first = wrong[0]
    if first != "grads":
        stale = bads[first] & (ours[first] == c[first].astype(np.float64))
        if stale.any() and stale.sum() * 2 >= bads[first].sum():   # most wrong elements kept their old value
            idx = np.flatnonzero(stale)
            if stale.all():
                return f"{first} was not updated at all: write params[i], m[i] and v[i] back in your kernel"
            return (f"{idx.size} of {c['n']} elements of {first} were never updated (first at index {idx[0]}): "
                    f"your grid must cover all n = {c['n']} elements (grid-stride loop, or enough blocks)")
    slack = _checks._slack(tol)
    for kwargs, hint in (_MISTAKES if first != "grads" else ()):
        mis = _variant(c, **kwargs)
        if all(_checks._close(ours[k], mis[k], slack) for k in ("params", "m", "v")):
            return hint
    if first == "grads":
        nz = np.flatnonzero(ours["grads"] != 0)
        if np.array_equal(ours["grads"], c["grads"].astype(np.float64)):
            return ("the gradient was not zeroed: after reading grads[i], write grads[i] = 0 (the next backward "
                    "pass accumulates into it)")
        return (f"{nz.size} of {c['n']} gradient elements are not 0 (first at index {nz[0]}): every grads[i] "
                f"must be set to exactly 0 after it is read")
    if first in ("m", "v") and not bads["params"].any():
        return f"params is right but {first} is not: store the new {first} (without the bias correction) back"
    return ("no common mistake matches: compare your update term by term with optim.AdamW.step "
            "(p = p - lr*wd*p on decaying tensors; m, v; mhat, vhat; p -= lr * mhat / (sqrt(vhat) + eps))")


def check_adamw_step(fn, arrays="numpy", dtype=np.float32, size=None, seed=None, task=None,
                     quiet=False) -> "_checks.CheckResult":
    """Check fn(params, grads, m, v, lr, beta1, beta2, eps, weight_decay, step, decay_bounds) (see the module
    docstring): params, m, v updated in place as optim.AdamW, grads zeroed. dtype: np.float32 (default) or
    np.float64. size: "small" (default; simulator-friendly) or "large" (~3M parameters, for a GPU). seed: None for
    fresh inputs, or the seed a failed check printed. task: label for grading. quiet: do not print.
    Returns a checks.CheckResult (truthy when correct); errors raised by fn are reported, never raised."""
    if arrays == "cupy" and callable(fn) and not _device.has_gpu():
        return _skipped(task, quiet)
    dt, size = _checks._validate(NAME, fn, arrays, dtype, size, seed)
    if dt.name not in ("float32", "float64"):
        raise ValueError(f"check_adamw_step: dtype={dt.name} is not supported: the optimizer state is float32 "
                         f"(or float64); use np.float32")
    seed = secrets.randbelow(1_000_000) if seed is None else int(seed)
    rng = np.random.default_rng(seed)
    tol = _checks.TOLERANCES[dt.name]
    c = _make_case(rng, dt, size)
    expected = adamw_expected(c["params"], c["grads"], c["m"], c["v"], c["lr"], c["beta1"], c["beta2"], c["eps"],
                              c["weight_decay"], c["step"], c["mask"])
    info = dict(name=NAME, task=task, tol=tol, seed=seed, dtype=dt.name, arrays=arrays,
                dims={"n": c["n"], "tensors": len(c["flags"]), "step": c["step"]},
                inputs={k: (c[k].copy() if isinstance(c[k], np.ndarray) else c[k]) for k in
                        ("params", "grads", "m", "v", "lr", "beta1", "beta2", "eps", "weight_decay", "step",
                         "bounds", "flags")})
    dev = {k: _arrays.to_backend(c[k].copy(), arrays) for k in ("params", "grads", "m", "v")}
    table = (_arrays.to_backend(c["bounds"], arrays), _arrays.to_backend(c["flags"], arrays))
    result = None
    try:
        fn(dev["params"], dev["grads"], dev["m"], dev["v"], c["lr"], c["beta1"], c["beta2"], c["eps"],
           c["weight_decay"], c["step"], table)
        ours_raw = {k: np.asarray(_arrays.to_numpy(dev[k])) for k in OUTPUTS}
    except NotImplementedError:
        msg = f"{NAME}: not attempted (your function raised NotImplementedError)"
        result = _checks.CheckResult(status="not attempted", passed=False, message=msg,
                                     hint="replace the `raise NotImplementedError` with your code", **info)
    except Exception as exc:  # the learner's error is reported, never raised
        first = " ".join(str(exc).split())
        first = first if len(first) <= 200 else first[:197] + "..."
        where = _checks._where_raised(exc)
        msg = f"{NAME}: error - your function raised {type(exc).__name__}" + (f": {first}" if first else "")
        hint = (f"the error is in your code{' (at ' + where + ')' if where else ''}; n = {c['n']} float32 "
                f"elements, decay table of {len(c['flags'])} tensors (seed {seed})")
        result = _checks.CheckResult(status="error", passed=False, message=msg + "\n  hint: " + hint, hint=hint,
                                     **info)
    if result is None:
        ours = {k: r.astype(np.float64) for k, r in ours_raw.items()}
        bads, stats, wrong = {}, {}, []
        max_abs_all = max_rel_all = 0.0
        for k in ("params", "m", "v"):
            bad, err, rel, _ = _checks._compare(ours[k], expected[k], tol)
            bads[k] = bad
            finite = bool(np.isfinite(ours[k]).all())
            stats[k] = (float(err.max()) if finite else math.nan, float(rel.max()) if finite else math.nan)
            if bad.any():
                wrong.append(k)
            else:
                max_abs_all, max_rel_all = max(max_abs_all, stats[k][0]), max(max_rel_all, stats[k][1])
        bads["grads"] = ours["grads"] != 0          # exactly zero, nothing else (NaN != 0 too)
        stats["grads"] = (float(np.nanmax(np.abs(ours["grads"]))) if ours["grads"].size else 0.0, math.nan)
        if bads["grads"].any():
            wrong.append("grads")
        if wrong:
            name = wrong[0]
            i = int(np.flatnonzero(bads[name])[0])
            exp = 0.0 if name == "grads" else float(expected[name][i])
            mine = float(ours[name][i])
            hint = _diagnose(c, ours, expected, bads, wrong, tol)
            if name == "grads":
                detail = f"(must be exactly 0; {int(bads['grads'].sum())} of {c['n']} are not; seed {seed})"
            else:
                detail = (f"(max abs err {stats[name][0]:.2g}, max rel {stats[name][1]:.2g}, tol {tol:g}; "
                          f"seed {seed})")
            msg = (f"{NAME}: wrong - {name} at [{i}]: yours {_checks._fmt(mine, exp)}, expected "
                   f"{_checks._fmt(exp, mine)} {detail}")
            result = _checks.CheckResult(status="wrong", passed=False, output=name, max_abs=stats[name][0],
                                         max_rel=stats[name][1], first_bad=(i,), ours=mine, expected=exp,
                                         hint=hint, message=msg + "\n  hint: " + hint, **info)
        else:
            msg = (f"{NAME}: correct (max rel err {max_rel_all:.2g}, tol {tol:g}, {_checks._SHORT[dt.name]}, "
                   f"params, m, v updated, grads zeroed)")
            result = _checks.CheckResult(status="correct", passed=True, max_abs=max_abs_all, max_rel=max_rel_all,
                                         message=msg, **info)
    from . import grading
    grading.record(check=f"check_{NAME}", task=task, status=result.status, message=result.message.splitlines()[0])
    if not quiet:
        print(result.message)
    return result
