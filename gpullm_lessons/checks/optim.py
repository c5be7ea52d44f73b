"""Checker for the optimizer step: does your AdamW kernel update the flat buffers as torch.optim.AdamW does?

``check_adamw_step(fn, ...)`` follows the conventions of ``gpullm_lessons.checks.backward`` (fresh random inputs, three
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
``gpullm_lessons.model.optim.AdamW`` run in float64 on the same (rounded) inputs. params, m, v pass with the rule of
``checks`` (|yours - expected| <= tol * (|expected| + M), M = max|expected| of that buffer); grads must be 0.
Nothing is poisoned: every buffer is read before it is written, so an element your grid misses keeps its old
value, and the checker says so.
"""
from __future__ import annotations

import math
import secrets

import numpy as np

from ..runtime import arrays as _arrays
from . import borrowed, opcheck
from .. import device as _device
from . import verdict
from .verdict import CheckResult, DTYPE_SHORT, close, compare, fmt, mistake_slack

# the course's own implementations of the tasks (checks/borrowed.py): an answer that is, wraps or calls one is not correct
_ADAMW_OWN = (
    "gpullm_lessons.kernels.numba.adamw:adamw_step",
    "gpullm_lessons.kernels.numba.adamw:adamw_v2",
    "gpullm_lessons.kernels.numba.adamw:adamw_step_device",
    "gpullm_lessons.kernels.numba.adamw:adamw_device_v2",
    "gpullm_lessons.model.optim:AdamW",
    "gpullm_lessons.model.optim:adamw_update",
)
OWN = {"adamw_step": _ADAMW_OWN, "adamw_mixed": _ADAMW_OWN}

__all__ = ["check_adamw_step", "adamw_expected", "check_adamw_mixed"]

NAME = "adamw_step"
OUTPUTS = ("params", "m", "v", "grads")


def adamw_expected(p, g, m, v, lr, beta1, beta2, eps, weight_decay, step, decay_mask):
    """The reference step in float64: (params, m, v) after optim.AdamW.step at step count `step` (copies)."""
    from ..model.optim import AdamW
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
     "decay (biases and LayerNorm parameters do not); find the tensor j of element i (bounds[j] <= i < bounds[j+1]), "
     "walking j forward with a while loop (one stride can pass several tensors), and use flags[j]"),
    (dict(mask="none"), "no weight decay at all: tensors with flags[j] = 1 must shrink by lr * weight_decay * p"),
    (dict(lr_in_decay=False), "the weight decay is not multiplied by lr: p = p - lr * weight_decay * p"),
)


def _make_case(rng, dt, size):
    """A small GPT's flat buffers mid-training, and the scalars. size 'small': n ~ 300..1500; 'large': ~3M."""
    from ..model.optim import DECAY_NAMES
    from ..model.params import GPTConfig, ParamBuffer
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
    slack = mistake_slack(tol)
    for kwargs, hint in (_MISTAKES if first != "grads" else ()):
        mis = _variant(c, **kwargs)
        if all(close(ours[k], mis[k], slack) for k in ("params", "m", "v")):
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
                     quiet=False) -> "CheckResult":
    """Check fn(params, grads, m, v, lr, beta1, beta2, eps, weight_decay, step, decay_bounds) (see the module
    docstring): params, m, v updated in place as optim.AdamW, grads zeroed. dtype: np.float32 (default) or
    np.float64. size: "small" (default; simulator-friendly) or "large" (~3M parameters, for a GPU). seed: None for
    fresh inputs, or the seed a failed check printed. task: label for grading. quiet: do not print.
    Returns a checks.CheckResult (truthy when correct); errors raised by fn are reported, never raised."""
    if arrays == "cupy" and callable(fn) and not _device.has_gpu():
        return verdict.skipped(NAME, task, quiet=quiet)
    dt, size = opcheck.validate(NAME, fn, arrays, dtype, size, seed)
    if dt.name not in ("float32", "float64"):
        raise ValueError(f"check_adamw_step: dtype={dt.name} is not supported: the optimizer state is float32 "
                         f"(or float64); use np.float32")
    seed = secrets.randbelow(1_000_000) if seed is None else int(seed)
    taken = borrowed.borrowed_verdict(NAME, [fn], OWN[NAME], task=task, seed=seed, quiet=quiet,
                                      check="check_adamw_step")
    if taken is not None:
        return taken
    rng = np.random.default_rng(seed)
    tol = opcheck.TOLERANCES[dt.name]
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
        result = verdict.not_attempted(**info)
    except Exception as exc:  # the learner's error is reported, never raised
        result = verdict.raised(exc=exc, context=f"n = {c['n']} float32 elements, decay table of {len(c['flags'])} "
                                f"tensors (seed {seed})", **info)
    if result is None:
        ours = {k: r.astype(np.float64) for k, r in ours_raw.items()}
        bads, stats, wrong = {}, {}, []
        max_abs_all = max_rel_all = 0.0
        for k in ("params", "m", "v"):
            bad, err, rel, _ = compare(ours[k], expected[k], tol)
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
            msg = (f"{NAME}: wrong - {name} at [{i}]: yours {fmt(mine, exp)}, expected "
                   f"{fmt(exp, mine)} {detail}")
            result = verdict.build_result("wrong", msg, hint, output=name, max_abs=stats[name][0],
                                          max_rel=stats[name][1], first_bad=(i,), ours=mine, expected=exp, **info)
        else:
            msg = (f"{NAME}: correct (max rel err {max_rel_all:.2g}, tol {tol:g}, {DTYPE_SHORT[dt.name]}, "
                   f"params, m, v updated, grads zeroed)")
            result = verdict.build_result("correct", msg, max_abs=max_abs_all, max_rel=max_rel_all, **info)
    return verdict.record(result, quiet=quiet)


# ================================================================================================================
# 06.1 the mixed-precision step: unscale the gradient, AdamW, and a bf16 copy of the new weights, in one pass
# ================================================================================================================
NAME_MIXED = "adamw_mixed"
HALF_POISON = 0x7FD5      # what half_out holds before the call: a bf16 NaN pattern no rounding ever produces
_TIES = (0x3F808000, 0x3F818000, 0xBF808000, 0xBF818000, 0x40008000, 0x40018000, 0x3E7F8000, 0xBE4C8000,
         0x3FFF8000, 0x3F807FFF, 0x3F808001, 0x3C038000)   # exact ties (both parities), a carry, next to a tie


def _bf16_rne(x32):
    """float32 array -> bfloat16 bits (uint16), round to nearest even, as ml_dtypes."""
    import ml_dtypes
    with np.errstate(invalid="ignore", over="ignore"):
        return np.asarray(x32, dtype=np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def _bf16_trunc(x32):
    return (np.asarray(x32, dtype=np.float32).view(np.uint32) >> np.uint32(16)).astype(np.uint16)


def _mixed_layout(rng, kind):
    """(tensor sizes, decay flags) for one call. kind: 'one' (n = 1), 'gpt' (a small GPT's ParamBuffer), 'tiny'
    (many tensors of 1..3 elements between larger ones: a grid stride jumps over several of them), 'big' (more
    elements than a grid of 4096 blocks x 256 threads covers)."""
    if kind == "one":
        return [1], [1]
    if kind == "gpt":
        from ..model.optim import DECAY_NAMES
        from ..model.params import GPTConfig, ParamBuffer
        cfg = GPTConfig(vocab_size=int(rng.integers(5, 12)), block_size=int(rng.integers(3, 8)),
                        n_layer=int(rng.integers(1, 3)), n_head=2, d_model=int(rng.choice([4, 6])))
        buf = ParamBuffer(cfg)
        return ([buf.offsets[k][1] - buf.offsets[k][0] for k in buf.names],
                [int(k in DECAY_NAMES) for k in buf.names])
    if kind == "tiny":
        sizes, flags = [], []
        for j in range(int(rng.integers(14, 20))):
            sizes.append(int(rng.integers(1, 4)) if j % 2 else int(rng.integers(5, 90)))
            flags.append(int(j % 3 != 1))
        return sizes, flags
    sizes = [int(rng.integers(1, 4)), 1_048_576 + int(rng.integers(1000, 60_000)) * 2 + 1,
             int(rng.integers(1, 4)), 77_777, 3]      # 'big': past 4096 x 256, tiny tensors on either side
    return sizes, [1, 1, 0, 1, 0]


def _mixed_case(rng, kind, step, log2_scale):
    """Inputs of one call: the flat buffers mid-training with the gradient multiplied by the loss scale."""
    sizes, flags = _mixed_layout(rng, kind)
    bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    flags = np.array(flags, dtype=np.uint8)
    n = int(bounds[-1])
    mask = np.repeat(flags.astype(bool), np.diff(bounds))
    g = rng.standard_normal(n) * 10.0 ** rng.uniform(-4, -1, n)                  # unscaled gradients
    v = (np.abs(rng.standard_normal(n)) + 0.1) * g * g * rng.uniform(0.5, 2.0, n)
    tiny = rng.random(n) < 0.1                                                   # sqrt(v) ~ eps here
    g[tiny] = rng.standard_normal(tiny.sum()) * 1e-8
    v[tiny] = rng.uniform(0.2, 2.0, tiny.sum()) * 1e-16
    p = rng.standard_normal(n) * 0.5
    m = rng.standard_normal(n) * np.sqrt(v)
    # parameters that do not move (g = m = v = 0, no decay) sitting exactly on bf16 ties: the copy's rounding shows
    frozen = np.flatnonzero(~mask)
    if frozen.size:
        frozen = rng.choice(frozen, size=min(frozen.size, len(_TIES)), replace=False)
        p[frozen] = np.array(_TIES[:frozen.size], dtype=np.uint32).view(np.float32)
        g[frozen] = m[frozen] = v[frozen] = 0.0
    # parameters that decay but got no gradient this step (g = 0 exactly: an embedding row no token of the batch
    # used): AdamW still moves them (m and v decay, the step from m, the weight decay)
    idle = np.flatnonzero(mask & ~tiny)
    idle = rng.choice(idle, size=max(1, idle.size // 20), replace=False) if n > 8 and idle.size else idle[:0]
    g[idle] = 0.0
    scale = 2.0 ** log2_scale
    c = {"kind": kind, "n": n, "bounds": bounds, "flags": flags, "mask": mask, "frozen": frozen, "idle": idle,
         "params": p.astype(np.float32), "m": m.astype(np.float32), "v": v.astype(np.float32),
         "scaled": (g * scale).astype(np.float32), "scale": scale, "log2_scale": log2_scale,
         "lr": float(rng.uniform(3e-3, 1e-2)), "beta1": 0.9, "beta2": float(rng.choice([0.95, 0.999])),
         "eps": 1e-8, "weight_decay": float(rng.uniform(0.1, 0.3)), "step": int(step)}
    c["grads"] = c["scaled"].astype(np.float64) / scale                          # exact: a power of two
    return c


def _mixed_expected(c, grads=None, step=None, mask=None):
    """params, m, v after the step (float64) with the gradient `grads` (default: the unscaled one)."""
    g = c["grads"] if grads is None else grads
    return adamw_expected(c["params"], g, c["m"], c["v"], c["lr"], c["beta1"], c["beta2"], c["eps"],
                          c["weight_decay"], c["step"] if step is None else step,
                          c["mask"] if mask is None else mask)


def _mixed_mistakes(c, prev):
    """(hint, params/m/v) of the mistakes of this task, from the same inputs; prev: the previous call's case."""
    S, sg = c["scale"], c["scaled"].astype(np.float64)
    out = [
        ("the loss scale was not undone: grads holds the gradient of loss * scale; multiply it by 1 / scale "
         "(inv_scale) before m and v see it", lambda: _mixed_expected(c, grads=sg)),
        ("the loss scale was undone twice (the gradient was divided by scale^2): multiply by inv_scale once",
         lambda: _mixed_expected(c, grads=sg / (S * S))),
        ("the gradient was multiplied by the loss scale instead of divided by it: use inv_scale = 1 / loss_scale",
         lambda: _mixed_expected(c, grads=sg * S)),
    ]
    if prev is not None and prev["step"] != c["step"]:
        out.append((f"the bias corrections are those of your previous call (step {prev['step']}); this call has step "
                    f"{c['step']}: compute 1 - beta1**step and 1 - beta2**step from each call's own step (nothing "
                    f"kept from an earlier call)", lambda: _mixed_expected(c, step=prev["step"])))
    if prev is not None and prev["scale"] != S:
        out.append((f"the gradient was unscaled with your previous call's loss scale (2^{prev['log2_scale']}); this "
                    f"call's is 2^{c['log2_scale']}: compute inv_scale from each call's loss_scale",
                    lambda: _mixed_expected(c, grads=sg / prev["scale"])))
    for kwargs, hint in _MISTAKES:
        out.append((hint, lambda kwargs=kwargs: _variant(dict(c, grads=c["grads"]), **kwargs)))
    return out


def _tensors_text(c, idx):
    """'tensors 3 (elements 40..41), 5 (...)' for the tensors holding the elements idx."""
    js = sorted(set(int(j) for j in np.searchsorted(c["bounds"], idx, side="right") - 1))
    parts = [f"{j} (elements {c['bounds'][j]}..{c['bounds'][j + 1] - 1}, flag {c['flags'][j]})" for j in js[:3]]
    return "tensor" + ("s " if len(js) > 1 else " ") + ", ".join(parts) + (f" and {len(js) - 3} more" if len(js) > 3
                                                                           else "")


def _mixed_param_hint(c, prev, ours, expected, bads, name, tol):
    """Why params / m / v are wrong: elements never reached, a known mistake, per-tensor decay flags, else where."""
    orig = {"params": c["params"], "m": c["m"], "v": c["v"]}
    bad = bads[name]
    stale = bad & (ours[name] == orig[name].astype(np.float64))
    idle = np.zeros(c["n"], bool)
    idle[c["idle"]] = True
    if stale.any() and not (stale & ~idle).any() and not (bad & ~stale).any():
        return (f"the {int(stale.sum())} elements whose gradient is exactly 0 (a decaying tensor's elements no token "
                f"of the batch touched, first at index {int(np.flatnonzero(stale)[0])}) were left as they were: AdamW "
                f"still moves them (m and v decay, the step uses m, the weight decay shrinks the parameter). Update "
                f"every element, whatever its gradient")
    if stale.any() and stale.sum() * 2 >= bad.sum():
        idx = np.flatnonzero(stale)
        if stale.all():
            return f"{name} was not updated at all: write params[i], m[i] and v[i] back in your kernel"
        unchanged = ours[name] == orig[name].astype(np.float64)
        tail = " (every element from there on)" if unchanged[idx[0]:].all() else ""
        return (f"{idx.size} of {c['n']} elements of {name} were never updated, first at index {idx[0]}{tail}: the "
                f"launcher's grid is capped (MAX_BLOCKS x THREADS threads), so each thread must loop over "
                f"i, i + stride, ... up to n (a grid-stride loop)")
    slack = mistake_slack(tol)
    for hint, make in _mixed_mistakes(c, prev):
        mis = make()
        if all(close(ours[k], mis[k], slack) for k in ("params", "m", "v")):
            return hint
    flipped = _mixed_expected(c, mask=~c["mask"])
    wrong_flag = bad & ~compare(ours[name], flipped[name], slack)[0]   # matches the other flag's step
    if name == "params" and wrong_flag.any() and not (bad & ~wrong_flag).any():
        return (f"the decay flag is wrong for {_tensors_text(c, np.flatnonzero(wrong_flag))}: each element must use "
                f"flags[j] of ITS tensor j (bounds[j] <= i < bounds[j+1]); walk j forward with a while loop, since "
                f"one stride can jump over several small tensors")
    if name in ("m", "v") and not bads["params"].any():
        return f"params is right but {name} is not: store the new {name} (without the bias correction) back"
    idx = np.flatnonzero(bad)
    return (f"{idx.size} of {c['n']} elements of {name} are wrong, in {_tensors_text(c, idx)}; no common mistake "
            f"matches. The step: unscale g, decay p where the tensor's flag is 1, update m and v, then "
            f"p -= lr * mhat / (sqrt(vhat) + eps) with this call's bias corrections")


def _mixed_half_hint(c, ours_p32, half, want):
    """Why the bf16 copy is wrong: never written, taken before the update, truncated, ties, float16, else where."""
    bad = half != want
    poison = half == np.uint16(HALF_POISON)
    if (poison == bad).all():
        idx = np.flatnonzero(poison)
        if idx.size == c["n"]:
            return ("half_out was never written: store the bf16 bits of each UPDATED parameter in half_out[i], in the "
                    "same pass")
        return (f"{idx.size} of {c['n']} elements of half_out were never written, first at index {idx[0]}: the copy "
                f"must be written for every element your loop updates")
    orig = c["params"]
    trunc = _bf16_trunc(ours_p32)
    candidates = [
        ("the bf16 copy was taken BEFORE the update: write it from the new value of p, after the AdamW step",
         _bf16_rne(orig)),
        ("the bf16 copy was taken before the update, and truncated: round the NEW p to nearest even",
         _bf16_trunc(orig)),
        ("the bf16 copy is truncated (the low 16 bits dropped: round toward zero); round to nearest, ties to even: "
         "look at the 16 bits you drop (see lesson 07, section 2)", trunc),
        ("half_out holds float16 bits; this task writes bfloat16 (the top half of the float32, rounded)",
         ours_p32.astype(np.float16).view(np.uint16)),
    ]
    from .precision import bf16_mistakes
    bits = np.ascontiguousarray(ours_p32, dtype=np.float32).view(np.uint32)
    with np.errstate(all="ignore"):
        candidates += [(h + " (in half_out, the copy of your updated params)", f(bits))
                       for h, f in bf16_mistakes()[0][1:4]]
    for hint, made in candidates:
        if np.array_equal(half[bad], np.asarray(made)[bad]) and not np.array_equal(np.asarray(made), want):
            return hint
    i = int(np.flatnonzero(bad)[0])
    return (f"half_out[{i}] = 0x{int(half[i]):04X}, but your params[{i}] = {float(ours_p32[i])!r} (bits "
            f"0x{int(bits[i]):08X}) rounds to bf16 0x{int(want[i]):04X} (nearest, ties to even)")


def check_adamw_mixed(fn, arrays="numba", size=None, seed=None, task=None, quiet=False) -> "CheckResult":
    """Check one mixed-precision optimizer step, fused:

        fn(params, grads, m, v, half_out, lr, beta1, beta2, eps, weight_decay, step, loss_scale, decay_bounds)

    params, m, v float32 (n,) updated in place as optim.AdamW does with the UNSCALED gradient grads / loss_scale
    (grads holds the gradient of loss * loss_scale); grads float32 (n,) exactly 0 afterwards; half_out uint16 (n,)
    receives the bfloat16 bits of the updated params, rounded to nearest even (bit for bit: ml_dtypes' rounding of
    YOUR float32 params). decay_bounds = (bounds int64 (k+1,), flags uint8 (k,)) as for check_adamw_step.

    fn is called several times with fresh inputs: n = 1; a small GPT's buffer at step 1; many tiny tensors between
    larger ones (a grid stride jumps over several tensors) at a later step and another loss scale; on a GPU (or
    size="large") a buffer larger than 4096 blocks x 256 threads. Sizes are never multiples of 32, tensor boundaries
    fall inside blocks, and some parameters sit exactly on bf16 ties. The hint names the usual mistakes: the scale
    not undone or undone twice, a stale step or scale from the previous call, the copy taken before the update or
    truncated, the gradient not zeroed, elements past the grid, decay flags of the wrong tensor.
    arrays: "numba" (default), "numpy" or "cupy". Errors raised by fn are reported, never raised."""
    name = NAME_MIXED
    if arrays == "cupy" and callable(fn) and not _device.has_gpu():
        return verdict.skipped(name, task, quiet=quiet, arrays=arrays)
    seed = opcheck.learner_fn_and_seed(name, fn, seed)
    taken = borrowed.borrowed_verdict(NAME_MIXED, [fn], OWN[NAME_MIXED], task=task, seed=seed, quiet=quiet,
                                      check="check_adamw_mixed")
    if taken is not None:
        return taken
    kind = type(fn).__name__
    if kind in ("CUDADispatcher", "FakeCUDAKernel"):
        raise TypeError(f"check_{name}(fn): fn is a Numba kernel; pass the launcher that calls it (adamw_step_mixed)")
    _arrays.require(arrays)
    if size not in (None, "small", "large"):
        raise ValueError(f"size={size!r}: use 'small', 'large' or None (large on a GPU)")
    from .precision import stub_kernel
    stub = stub_kernel(fn)
    if stub:
        return verdict.record(verdict.unfinished(name, stub, task=task, seed=seed, arrays=arrays), quiet=quiet)
    big = (size == "large") or (size is None and (arrays == "cupy" or (arrays == "numba" and
                                                                       _device.numba_on_gpu())))
    rng = np.random.default_rng(seed)
    tol = opcheck.TOLERANCES["float32"]
    t2 = int(rng.integers(2, 7))
    plan = [("one", 1, int(rng.integers(8, 13))), ("gpt", 1, int(rng.integers(14, 17))),
            ("tiny", t2, int(rng.integers(5, 11)))]
    if big:
        plan.append(("big", t2 + int(rng.integers(1, 4)), 12))
    labels = {"one": "one element", "gpt": "a small GPT's buffer", "tiny": "many tiny tensors",
              "big": "past a grid of 4096 x 256 threads"}
    base = dict(name=name, task=task, tol=tol, seed=seed, dtype="float32", arrays=arrays)
    result, prev, max_rel_all, ns = None, None, 0.0, []
    for k, (kind, step, log2s) in enumerate(plan):
        c = _mixed_case(rng, kind, step, log2s)
        where = (f"call {k + 1} of {len(plan)} ({labels[kind]}: n = {c['n']}, {len(c['flags'])} tensor"
                 f"{'s' if len(c['flags']) > 1 else ''}, step {step}, loss_scale 2^{log2s})")
        info = dict(base, dims={"n": c["n"], "tensors": len(c["flags"]), "step": step, "loss_scale": c["scale"]})
        dev = {key: _arrays.to_backend(c[src].copy(), arrays) for key, src in
               (("params", "params"), ("grads", "scaled"), ("m", "m"), ("v", "v"))}
        dev["half"] = _arrays.to_backend(np.full(c["n"], HALF_POISON, np.uint16), arrays)
        table = (_arrays.to_backend(c["bounds"], arrays), _arrays.to_backend(c["flags"], arrays))
        try:
            fn(dev["params"], dev["grads"], dev["m"], dev["v"], dev["half"], c["lr"], c["beta1"], c["beta2"],
               c["eps"], c["weight_decay"], step, c["scale"], table)
            ours_raw = {key: np.asarray(_arrays.to_numpy(d)) for key, d in dev.items()}
        except NotImplementedError:
            result = verdict.not_attempted(**info)
            break
        except Exception as exc:  # the learner's error is reported, never raised
            result = verdict.raised(exc=exc, context=f"{where}; params, grads, m, v float32 (n,), half_out uint16 "
                                    f"(n,) (seed {seed})", **info)
            break
        expected = _mixed_expected(c)
        ours = {key: ours_raw[key].astype(np.float64) for key in ("params", "m", "v", "grads")}
        bads, wrong = {}, None
        for key in ("params", "m", "v"):
            bads[key], err, rel, _ = compare(ours[key], expected[key], tol)
            if bads[key].any() and wrong is None:
                wrong = key
            elif not bads[key].any():
                max_rel_all = max(max_rel_all, float(rel.max()) if rel.size else 0.0)
        half_want = _bf16_rne(ours_raw["params"])
        detail = None
        if wrong is not None:
            i = int(np.flatnonzero(bads[wrong])[0])
            hint = _mixed_param_hint(c, prev, ours, expected, bads, wrong, tol)
            detail = (f"{wrong} at [{i}]: yours {fmt(ours[wrong][i], expected[wrong][i])}, expected "
                      f"{fmt(expected[wrong][i], ours[wrong][i])}", (i,), ours[wrong][i],
                      expected[wrong][i], wrong)
        elif (ours["grads"] != 0).any():
            nz = np.flatnonzero(ours["grads"] != 0)
            hint = ("the gradient was not zeroed: after reading grads[i], write grads[i] = 0 (the next backward pass "
                    "accumulates into it)" if nz.size == c["n"] else
                    f"{nz.size} of {c['n']} gradient elements are not 0 (first at index {nz[0]}): every grads[i] "
                    f"must be set to exactly 0 after it is read")
            detail = (f"grads at [{nz[0]}]: yours {fmt(ours['grads'][nz[0]])}, expected 0", (int(nz[0]),),
                      ours["grads"][nz[0]], 0.0, "grads")
        elif not np.array_equal(ours_raw["half"], half_want):
            hint = _mixed_half_hint(c, ours_raw["params"], ours_raw["half"], half_want)
            i = int(np.flatnonzero(ours_raw["half"] != half_want)[0])
            detail = (f"half_out at [{i}]: yours 0x{int(ours_raw['half'][i]):04X}, expected 0x{int(half_want[i]):04X}",
                      (i,), float(ours_raw["half"][i]), float(half_want[i]), "half_out")
        if detail is not None:
            text, index, mine, exp, output = detail
            msg = f"{name}: wrong - {where}: {text} (seed {seed})"
            result = verdict.build_result("wrong", msg, hint, output=output, first_bad=index, ours=mine,
                                          expected=exp, **info)
            break
        ns.append(c["n"])
        prev = c
    if result is None:
        msg = (f"{name}: correct ({len(plan)} calls, n = {', '.join(str(n) for n in ns)}; max rel err "
               f"{max_rel_all:.2g}, tol {tol:g}; bf16 copy bit-exact, grads zeroed)")
        result = verdict.build_result("correct", msg, max_rel=max_rel_all, dims={"calls": len(plan), "n": ns},
                                      **base)
    return verdict.record(result, quiet=quiet)
