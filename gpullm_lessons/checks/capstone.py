"""Checkers for lesson 09's capstone: your GPT block forward, block backward and optimizer step on the course's
GPU engine (gpullm_lessons.engine.capstone), against the NumPy reference.

    check_engine_linear_backward(linear_backward)     09.2  linear_backward(eng, dout, inp, w, b, l) -> dinp
    check_block_forward(block_forward)                09.3  block_forward(eng, x, l, B, T) -> (out, cache)
    check_block_backward(block_backward)              09.4  block_backward(eng, dout, cache, l, B, T) -> dx
    check_optimizer_step(optimizer_step)              09.5  optimizer_step(eng, lr, weight_decay, grad_clip,
                                                                          loss_scale) -> grad_norm
    check_training_step(block_forward, block_backward, optimizer_step)
                                                      09.6  the engine built from all three, step by step, against
                                                            engine.NumpyEngine

Every checker follows the conventions of gpullm_lessons.checks.backward: fresh random inputs on every call (the seed is
printed; pass seed= for the same inputs again), one verdict printed (not attempted / error / wrong with a hint that
names the mistake / correct), your exceptions reported and never raised, task= for grading, quiet=.

How they check (the same machinery for all):
- The engine is a CapstoneEngine (fp32) on the backend of this machine: "hip" on a GPU (CuPy arrays), "numba" in the
  CUDA simulator (NumPy arrays; a tiny model: L=2, nh=2, C=8, T=5, B=2). Its parameters are random (biases and
  LayerNorm parameters too, every layer different), so that a missing bias or a wrong layer's weight shows.
- Expected values: a float64 NumPy model of the block (``block_model_forward`` / ``block_model_backward``, the
  reference ops of lesson 01; tests/test_capstone.py checks it against reference.gpt), from the same float32 inputs.
- Every layer is checked, each twice with different inputs, so a hard-coded layer index and state kept between calls
  fail deterministically. An element passes when |yours - expected| <= TOL * (|expected| + max|expected|) (the max
  over that tensor: errors are judged against the tensor's size, as in checks/backward.py).
- When something is wrong, the message says which layer, which tensor (the parameter's name, or the cache key),
  the first wrong index, the expected and the got value; the hint comes from a table of named mistakes, each
  computed from the same inputs and matched against what your code produced (a mistake "matches" within
  MISTAKE_TOL), else from where the first wrong tensor sits in the block.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import numpy as np

from ..engine import capstone as _cap
from . import borrowed, opcheck
from .. import device as _device
from . import verdict
from ..model.params import GPTConfig, num_params

# the course's own implementations of the tasks (checks/borrowed.py): an answer that is, wraps or calls one is not correct.
# The launchers in eng.K (the fused AdamW kernel included) are the toolbox, not answers.
OWN = {
    "engine_linear_backward": (
        "gpullm_lessons.engine.gpu:GPUEngine._linear_backward",
        "gpullm_lessons.reference.linear:linear_backward",
    ),
    "block_forward": (
        "gpullm_lessons.engine.gpu:GPUEngine._block_forward",
        "gpullm_lessons.reference.gpt:block_forward",
    ),
    "block_backward": (
        "gpullm_lessons.engine.gpu:GPUEngine._block_backward",
        "gpullm_lessons.reference.gpt:block_backward",
    ),
    "optimizer_step": (
        "gpullm_lessons.engine.core:Engine.optimizer_step",
        "gpullm_lessons.engine.core:Engine.update",
        "gpullm_lessons.engine.gpu:GPUEngine._update_on_device",
    ),
}
# 09.6 runs the three functions of 09.3-09.5 (and 09.2 inside them): any of their implementations
OWN["training_step"] = tuple(spec for task in ("engine_linear_backward", "block_forward", "block_backward",
                                               "optimizer_step") for spec in OWN[task])

__all__ = ["check_engine_linear_backward", "check_block_forward", "check_block_backward", "check_optimizer_step",
           "check_training_step", "block_model_forward", "block_model_backward", "TOL", "MISTAKE_TOL"]

# Tolerances (relative, with the tensor's max as the floor; see _diff). Measured with the course's solution: in the
# simulator over 12 seeds the worst block forward / backward element used 5e-7 (of TOL 1e-4), an optimizer step 6e-8
# (of OPT_TOL 1e-5), a whole step's layer outputs and gradients 2e-6 (of 10 TOL). The mistakes of
# tests/test_capstone.py exceed their tolerance 5x (weight decay on the LayerNorm weights) to 10^4x.
TOL = 1e-4            # a block: a chain of fp32 kernels and products against float64
OPT_TOL = 1e-5        # one fused AdamW pass from the same gradient: a few fp32 roundings
MISTAKE_TOL = 1e-3    # "your output equals this mistake's": 10x TOL (mistakes differ by O(1e-3) and more)
LOSS_TOL = 1e-4       # the losses of your run against the NumPy engine's (ten steps on a GPU: under 1e-6 measured)
LOSS_SCALE = 1024.0   # the loss scale the checkers use (a power of two: scaling is exact)


def _sizes():
    """(cfg for the block checks, B) for this machine; the simulator's are tiny (Python per CUDA thread)."""
    if _device.has_gpu():
        return GPTConfig(vocab_size=67, block_size=37, n_layer=3, n_head=3, d_model=96), 3
    return GPTConfig(vocab_size=13, block_size=5, n_layer=2, n_head=2, d_model=8), 2


def _step_sizes():
    """(cfg, B, steps) of the whole-step check: two steps in the simulator, ten on a GPU."""
    if _device.has_gpu():
        return GPTConfig(vocab_size=96, block_size=64, n_layer=3, n_head=4, d_model=128), 4, 10
    return GPTConfig(vocab_size=13, block_size=5, n_layer=2, n_head=2, d_model=8), 2, 2


# ------------------------------------------------------------------------------------------------------------
# the float64 model of one block, with the common mistakes as flags
# ------------------------------------------------------------------------------------------------------------
_GELU_S, _GELU_C = math.sqrt(2.0 / math.pi), 0.044715


def _layernorm(x, w, b, eps=1e-5):
    mean = x.mean(axis=-1)
    rstd = 1.0 / np.sqrt(((x - mean[:, None]) ** 2).mean(axis=-1) + eps)
    return (x - mean[:, None]) * rstd[:, None] * w + b, mean, rstd


def _layernorm_backward(dout, x, w, mean, rstd):
    xhat = (x - mean[:, None]) * rstd[:, None]
    g = dout * w
    dx = rstd[:, None] * (g - g.mean(axis=-1, keepdims=True) - xhat * (g * xhat).mean(axis=-1, keepdims=True))
    return dx, (dout * xhat).sum(axis=0), dout.sum(axis=0)


def _gelu(x):
    return 0.5 * x * (1.0 + np.tanh(_GELU_S * (x + _GELU_C * x ** 3)))


def _gelu_grad(x):
    th = np.tanh(_GELU_S * (x + _GELU_C * x ** 3))
    return 0.5 * (1.0 + th) + 0.5 * x * (1.0 - th ** 2) * _GELU_S * (1.0 + 3.0 * _GELU_C * x ** 2)


def _heads(a, B, T, nh):
    """(B*T, C) -> (B*nh, T, hs), as split_heads."""
    C = a.shape[1]
    return a.reshape(B, T, nh, C // nh).transpose(0, 2, 1, 3).reshape(B * nh, T, C // nh)


def _merge(a, B, T, nh):
    """(B*nh, T, hs) -> (B*T, C), as merge_heads."""
    hs = a.shape[2]
    return a.reshape(B, nh, T, hs).transpose(0, 2, 1, 3).reshape(B * T, nh * hs)


def block_model_forward(P, l, x, B, T, n_head, bad=()):
    """Block l of the GPT on x (B*T, C), float64, -> dict of every tensor (CACHE_KEYS, "out", and a few extras the
    hints compare with). P: name -> float64 array (the parameters, with their layer axis). bad: mistake flags
    (see _FORWARD_MISTAKES); () is the right block (tests/test_capstone.py checks it against reference.gpt)."""
    bad = set(bad)
    C = x.shape[1]
    nh, hs = n_head, C // n_head
    W = lambda name: P[name][l]                                                    # noqa: E731
    t = {"x": x}
    ln1w, ln1b, ln2w, ln2b = W("ln1w"), W("ln1b"), W("ln2w"), W("ln2b")
    if "ln_swap" in bad:
        ln1w, ln1b, ln2w, ln2b = ln2w, ln2b, ln1w, ln1b
    t["ln1"], t["mean1"], t["rstd1"] = _layernorm(x, ln1w, ln1b)
    qkv = t["ln1"] @ W("qkvw") + (0.0 if "no_qkvb" in bad else W("qkvb"))
    q, k, v = qkv[:, :C], qkv[:, C:2 * C], qkv[:, 2 * C:]
    if "qk_swap" in bad:
        q, k = k, q
    if "qv_swap" in bad:
        q, v = v, q
    t["q"], t["k"], t["v"] = _heads(q, B, T, nh), _heads(k, B, T, nh), _heads(v, B, T, nh)
    scale = {"no_scale": 1.0, "scale_hs": 1.0 / hs}.get(next((f for f in ("no_scale", "scale_hs") if f in bad), ""),
                                                        1.0 / math.sqrt(hs))
    raw = t["q"] @ t["k"].transpose(0, 2, 1)                                         # (BH, T, T)
    causal = np.tril(np.ones((T, T), dtype=bool))
    s = np.where(causal, raw * scale, -np.inf)
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    t["att"] = e / e.sum(axis=-1, keepdims=True)
    t["scores"] = np.where(causal, raw * (1.0 / math.sqrt(hs)), 0.0)
    t["atty"] = _merge(t["att"] @ t["v"], B, T, nh)
    Wp = W("attprojw").T if "attprojw_T" in bad else W("attprojw")
    a = t["atty"] @ Wp + (0.0 if "no_attprojb" in bad else W("attprojb"))
    t["attn"] = a
    t["x1"] = a if "no_res_attn" in bad else x + a
    ln2_in = x if "ln2_on_x" in bad else t["x1"]
    t["ln2"], t["mean2"], t["rstd2"] = _layernorm(ln2_in, ln2w, ln2b)
    t["fc_nobias"] = t["ln2"] @ W("fcw")
    t["fc"] = t["fc_nobias"] + (0.0 if "no_fcb" in bad else W("fcb"))
    t["gelu"] = t["fc"] if "no_gelu" in bad else _gelu(t["fc"])
    m = t["gelu"] @ W("fcprojw") + (0.0 if "no_fcprojb" in bad else W("fcprojb"))
    t["mlp"] = m
    t["out"] = m if "no_res_mlp" in bad else (x + m if "res_mlp_x" in bad else t["x1"] + m)
    return t


def block_model_backward(P, l, t, dout, B, T, n_head, bad=()):
    """d(block l's output) (B*T, C) -> (dx, {name: layer l's gradient}) in float64, from the tensors t of
    block_model_forward. bad: mistake flags (see _BACKWARD_MISTAKES); () is the right backward."""
    bad = set(bad)
    nh = n_head
    hs = t["x"].shape[1] // nh
    W = lambda name: P[name][l]                                                    # noqa: E731
    g = {}
    ln1w, ln2w = (W("ln2w"), W("ln1w")) if "ln_w_swap" in bad else (W("ln1w"), W("ln2w"))
    # MLP half: out = x1 + fcproj(gelu(fc(ln2(x1))))
    g["fcprojw"], g["fcprojb"] = t["gelu"].T @ dout, dout.sum(axis=0)
    dgelu = dout @ W("fcprojw").T
    dfc = dgelu * _gelu_grad(t["gelu"] if "gelu_on_out" in bad else t["fc"])
    g["fcw"], g["fcb"] = t["ln2"].T @ dfc, dfc.sum(axis=0)
    dln2 = dfc @ W("fcw").T
    ln2_in = t["x"] if "ln2_inp_x" in bad else t["x1"]
    mean2, rstd2 = (t["mean1"], t["rstd1"]) if "ln2_stats1" in bad else (t["mean2"], t["rstd2"])
    dx1_ln, g["ln2w"], g["ln2b"] = _layernorm_backward(dln2, ln2_in, ln2w, mean2, rstd2)
    dx1 = dx1_ln if "no_res_mlp" in bad else dx1_ln + dout
    # attention half: x1 = x + attproj(attention(qkv(ln1(x))))
    g["attprojw"] = dx1.T @ t["atty"] if "dW_T" in bad else t["atty"].T @ dx1
    g["attprojb"] = dx1.sum(axis=0)
    datty = dx1 @ (W("attprojw") if "attprojw_noT" in bad else W("attprojw").T)
    dy = _heads(datty, B, T, nh)
    att = t["att"]
    dv = att.transpose(0, 2, 1) @ dy
    datt = dy @ t["v"].transpose(0, 2, 1)
    scale = 1.0 if "no_scale" in bad else 1.0 / math.sqrt(hs)
    dpre = att * (datt - (att * datt).sum(axis=-1, keepdims=True)) * scale
    dq, dk = dpre @ t["k"], dpre.transpose(0, 2, 1) @ t["q"]
    if "qk_swap" in bad:
        dq, dk = dk, dq
    dqkv = np.concatenate([_merge(dq, B, T, nh), _merge(dk, B, T, nh), _merge(dv, B, T, nh)], axis=1)
    g["qkvw"], g["qkvb"] = t["ln1"].T @ dqkv, dqkv.sum(axis=0)
    dln1 = dqkv @ W("qkvw").T
    mean1, rstd1 = (t["mean2"], t["rstd2"]) if "ln1_stats2" in bad else (t["mean1"], t["rstd1"])
    dx_ln, g["ln1w"], g["ln1b"] = _layernorm_backward(dln1, t["x"], ln1w, mean1, rstd1)
    dx = dx_ln if "no_res_attn" in bad else dx_ln + dx1
    return dx, g


_QKV_COLUMNS = "qkv's columns are [q | k | v], C each (split_heads' col0)"   # in the hints of qk_swap, qv_swap
_FORWARD_MISTAKES = (
    (("no_res_attn",), "the attention half's residual is missing: x1 is the block input x PLUS what attproj "
     "returns (bias_add adds a residual: its res= argument)"),
    (("no_res_mlp",), "the MLP half's residual is missing: the block's output is x1 PLUS what fcproj returns"),
    (("no_res_attn", "no_res_mlp"), "both residuals are missing: each half of the block adds its branch to the "
     "stream it started from (x1 = x + attention branch, out = x1 + MLP branch)"),
    (("res_mlp_x",), "the MLP half adds its branch to the block input x; it must add it to x1 (the stream after "
     "the attention half)"),
    (("attprojw_T",), "attprojw is used transposed: weights are stored (in, out), so the product is atty @ W with "
     "no transpose"),
    (("no_scale",), "the attention scores are not scaled: the softmax takes scale * q k^T with scale = "
     "1/sqrt(hs) (attention_softmax_forward's scale argument)"),
    (("scale_hs",), "the attention scores are scaled by 1/hs; the scale is 1/sqrt(hs)"),
    (("no_qkvb",), "the qkv bias is missing (split_heads can add it while it moves the heads: bias=, the slice "
     "of qkvb that belongs to q, k or v)"),
    (("no_attprojb",), "attproj's bias is missing (bias_add)"),
    (("no_fcb",), "fc's bias is missing (bias_gelu_forward adds it before the GELU)"),
    (("no_fcprojb",), "fcproj's bias is missing (bias_add)"),
    (("no_gelu",), "the GELU is missing between fc and fcproj"),
    (("ln2_on_x",), "the second LayerNorm normalises the block input x; it normalises x1, the stream after the "
     "attention half"),
    (("ln_swap",), "the two LayerNorms' parameters are swapped: ln1w / ln1b belong to the LayerNorm before "
     "attention, ln2w / ln2b to the one before the MLP"),
    (("qk_swap",), "q and k are swapped: " + _QKV_COLUMNS),
    (("qv_swap",), "q and v are swapped: " + _QKV_COLUMNS),
)

_BACKWARD_MISTAKES = (
    (("no_res_mlp",), "the MLP half's residual gradient is missing: the gradient reaching x1 is dout itself "
     "(through the residual) plus what comes back through ln2"),
    (("no_res_attn",), "the attention half's residual gradient is missing: the gradient reaching x is the "
     "gradient of x1 (through the residual) plus what comes back through ln1"),
    (("no_res_attn", "no_res_mlp"), "both residual gradients are missing: each residual passes its incoming "
     "gradient straight through, added to the branch's"),
    (("attprojw_noT",), "the gradient through attproj uses its weight untransposed: dinp takes W transposed "
     "(gemm's trans_b), since weights are stored (in, out)"),
    (("dW_T",), "attprojw's gradient is written transposed: a weight's gradient has the weight's (in, out) layout, "
     "the input's transpose times dout"),
    (("ln2_stats1",), "wrong LayerNorm saved for backward: ln2's backward uses the first LayerNorm's mean and rstd "
     "(mean1, rstd1); it needs mean2, rstd2"),
    (("ln1_stats2",), "wrong LayerNorm saved for backward: ln1's backward uses the second LayerNorm's mean and rstd "
     "(mean2, rstd2); it needs mean1, rstd1"),
    (("ln2_inp_x",), "wrong LayerNorm input for backward: ln2's backward gets the block input x; ln2 normalised "
     "x1"),
    (("ln_w_swap",), "the LayerNorm backwards use each other's weight: ln2's backward takes ln2w, ln1's ln1w"),
    (("gelu_on_out",), "gelu_backward gets GELU's output; it needs GELU's input, cache['fc']"),
    (("no_scale",), "the softmax backward leaves out the scores' scale 1/sqrt(hs) (attention_softmax_backward's "
     "scale argument)"),
    (("qk_swap",), "dq and dk are swapped in dqkv: its columns are [dq | dk | dv], as qkv's"),
)


# ------------------------------------------------------------------------------------------------------------
# plumbing: results, arrays, comparisons
# ------------------------------------------------------------------------------------------------------------
def _fields(task, seed) -> dict:
    return {"task": task, "seed": seed, "dtype": "float32", "arrays": "cupy" if _device.has_gpu() else "numpy",
            "tol": TOL}


def _result(name, task, status, msg, hint=None, seed=None, quiet=False, **extra):
    return verdict.verdict(name, status=status, msg=msg, hint=hint, quiet=quiet, **_fields(task, seed), **extra)


class _Verdict(Exception):
    """Raised inside a checker to end it with a verdict: (status, message, hint, extra), or a result built by
    gpullm_lessons.checks.verdict (not attempted, error; task=None there) that _run completes with the task and seed."""

    def __init__(self, status, msg, hint=None, result=None, **extra):
        super().__init__(msg)
        self.status, self.msg, self.hint, self.result, self.extra = status, msg, hint, result, extra


def _host(a):
    if a is None:
        return None
    if type(a).__module__.startswith("cupy"):
        return a.get()
    return np.asarray(a)


def _dev(eng, a):
    return eng.xp.asarray(np.ascontiguousarray(a, dtype=np.float32))


def _fmt(v):
    v = float(v)
    return "nan" if math.isnan(v) else f"{v:.6g}"


def _idx(index):
    return "(" + ", ".join(str(int(i)) for i in index) + ("," if len(index) == 1 else "") + ")"


def _diff(got, want, tol):
    """None when got matches want (|got - want| <= tol * (|want| + max|want|)), else what is wrong where (first wrong
    index, expected, got, how many). A non-finite value matches only where both are non-finite."""
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    if got.shape != want.shape:
        return {"shape": got.shape}
    if want.size == 0:
        return None
    finite = np.isfinite(want)
    M = float(np.max(np.abs(want[finite]))) if finite.any() else 0.0
    with np.errstate(invalid="ignore", over="ignore"):
        err = np.abs(got - want) / (np.abs(want) + M + 1e-30)
    err = np.where(np.isfinite(got) & finite, err, np.where(np.isfinite(got) | finite, np.inf, 0.0))
    bad = err > tol
    if not bad.any():
        return None
    first = np.unravel_index(int(np.argmax(bad)), bad.shape)
    return {"index": first, "expected": float(want[first]), "got": float(got[first]), "nbad": int(bad.sum()),
            "n": int(bad.size), "max_err": float(np.max(err)), "nan": int((~np.isfinite(got)).sum())}


def _where(d, tol):
    """'first wrong index (3, 1): expected 0.12, got 0.5 (7 of 40 elements wrong, max rel err 3.1e-01, tol 1e-04)'"""
    if "shape" in d:
        return f"has shape {d['shape']}"
    what = f"{d['nbad']} of {d['n']} elements wrong" + (f", {d['nan']} of them NaN or inf" if d["nan"] else "")
    return (f"first wrong index {_idx(d['index'])}: expected {_fmt(d['expected'])}, got {_fmt(d['got'])} ({what}, "
            f"max rel err {d['max_err']:.1e}, tol {tol:g})")


def _matches(got: dict, want: dict, tol=MISTAKE_TOL) -> bool:
    """Every array of `want` matches the same key of `got`."""
    return all(k in got and _diff(got[k], v, tol) is None for k, v in want.items())


def _random_params(cfg, rng) -> np.ndarray:
    """A flat float32 parameter vector: weights ~ N(0, 1/fan_in), biases ~ N(0, 0.1), LayerNorm weights 1 +
    N(0, 0.3) and biases N(0, 0.1), every layer different (so that a missing bias or another layer's weight shows)."""
    from ..model.params import param_shapes
    parts = []
    for name, shape in param_shapes(cfg).items():
        n = math.prod(shape)
        if name in ("qkvw", "attprojw", "fcw", "fcprojw"):
            parts.append(rng.normal(0.0, 1.0 / math.sqrt(shape[1]), n))
        elif name in ("wte", "wpe"):                      # logits = lnf(x) @ wte.T: a loss near ln V to start
            parts.append(rng.normal(0.0, 0.1, n))
        elif name in ("ln1w", "ln2w", "lnfw"):
            parts.append(1.0 + rng.normal(0.0, 0.3, n))
        else:
            parts.append(rng.normal(0.0, 0.1, n))
    return np.concatenate(parts).astype(np.float32)


def _views(cfg, flat) -> dict:
    from ..model.params import ParamBuffer
    buf = ParamBuffer(cfg, np.float64)
    buf.flat[...] = flat
    return {k: v for k, v in buf.items()}


def _engine(cfg, flat, seed, **fns):
    """A CapstoneEngine on this machine's backend with the parameters `flat` (float32, host)."""
    eng = _cap.CapstoneEngine(cfg, seed=seed, **fns)
    eng.params.flat[...] = eng.xp.asarray(flat)
    return eng


def _setup(seed):
    """(cfg, B, N, rng, eng, P), the start of the checks 09.2 - 09.4: this machine's sizes (_sizes; N = B*T rows),
    the generator of the seed, an engine with random parameters drawn from it first, and those parameters in float64
    (P: name -> array, see _views)."""
    cfg, B = _sizes()
    rng = np.random.default_rng(seed)
    flat = _random_params(cfg, rng)
    return cfg, B, B * cfg.block_size, rng, _engine(cfg, flat, seed), _views(cfg, flat.astype(np.float64))


def _error_lead(exc):
    """What the engine's own errors mean (None: "the error is in your code"), for the hint."""
    low = " ".join(str(exc).split()).lower()
    if "shapes do not chain" in low:
        return ("a matrix product's shapes do not fit: weights are stored (in, out), so inp (N, in) @ W (in, out) "
                "needs no transpose; a gradient through a weight takes W transposed (trans_b=True), a weight's "
                "gradient has W's shape (in, out) = inp transposed (trans_a=True) times dout")
    if "contiguous" in low:
        return ("an array is not C-contiguous: a transpose or a column slice is a strided view; gemm and the "
                "launchers want contiguous arrays (pass trans_a / trans_b instead of .T, or copy)")
    if "dtype" in low or "float32" in low or "float64" in low:
        return ("a launcher or gemm refused a dtype: every activation, gradient and buffer of the engine is float32 "
                "(eng.xp.float32); NumPy makes float64 unless told")
    if "shape" in low:
        return "a shape does not fit"
    return None


def _call(name, fn, args, what, seed):
    """fn(*args); NotImplementedError -> not attempted, any other exception -> error, both as a _Verdict."""
    try:
        return fn(*args)
    except NotImplementedError as exc:
        # a checker here calls several of your functions (through the engine): name the one that raised
        who = verdict.raised_in(exc) or getattr(fn, "__name__", "function")
        raise _Verdict("not attempted", "", result=verdict.not_attempted(name, who=who, task=None)) from None
    except _Verdict:
        raise
    except Exception as exc:  # the learner's error is reported, never raised
        raise _Verdict("error", "", result=verdict.raised(name, exc, f"{what} (seed {seed})", lead=_error_lead,
                                                          task=None)) from None


def _check_array(name, arr, shape, eng, label):
    """arr must be an array of the engine's module with `shape`, float32."""
    xp = eng.xp
    if arr is None:
        raise _Verdict("wrong", f"{name}: wrong - {label} is None", "a `return` is missing")
    if not isinstance(arr, xp.ndarray):
        raise _Verdict("wrong", f"{name}: wrong - {label} is a {type(arr).__name__}, not an array of "
                       f"{xp.__name__}", f"the engine's arrays are {xp.__name__} arrays (eng.xp)")
    if tuple(arr.shape) != tuple(shape):
        raise _Verdict("wrong", f"{name}: wrong - {label} has shape {tuple(arr.shape)}, expected {tuple(shape)}",
                       "check the shape of what you return (N = B*T rows)")
    if str(arr.dtype) != "float32":
        raise _Verdict("wrong", f"{name}: wrong - {label} is {arr.dtype}, expected float32",
                       "the engine keeps every activation and gradient in float32 (eng.xp.float32)")


def _run(name, task, seed, quiet, body):
    """Run a checker body that returns (message) when correct or raises _Verdict."""
    try:
        msg = body()
    except _Verdict as v:
        if v.result is not None:
            return verdict.record(dataclasses.replace(v.result, **_fields(task, seed)), quiet=quiet)
        return _result(name, task, v.status, v.msg, v.hint, seed, quiet, **v.extra)
    return _result(name, task, "correct", msg, None, seed, quiet)


def _seed(name, fn, seed):
    return opcheck.learner_fn_and_seed(name, fn, seed)


def _backend_words(eng):
    return (f"backend {eng.backend} on {'the GPU' if _device.has_gpu() else 'the CUDA simulator'}, "
            f"L={eng.cfg.n_layer} nh={eng.cfg.n_head} C={eng.cfg.d_model}")


# ------------------------------------------------------------------------------------------------------------
# 09.2 one linear layer's backward on the engine
# ------------------------------------------------------------------------------------------------------------
_LINEARS = (("attprojw", "attprojb"), ("qkvw", "qkvb"), ("fcw", "fcb"), ("fcprojw", "fcprojb"))


def _poison(eng):
    eng.grads.flat[...] = eng.xp.nan


def _changed_elsewhere(before, after, cfg, keep):
    """(name, layer) of the first gradient slice outside `keep` (a set of (name, layer)) that changed."""
    from ..model.params import ParamBuffer
    b, a = ParamBuffer(cfg, np.float32), ParamBuffer(cfg, np.float32)
    b.flat[...], a.flat[...] = before, after
    for name in b.names:
        vb, va = b[name], a[name]
        layers = range(cfg.n_layer) if vb.ndim >= 2 and vb.shape[0] == cfg.n_layer and name not in ("wte", "wpe") \
            else [None]
        for l in layers:
            if (name, l) in keep:
                continue
            x, y = (vb, va) if l is None else (vb[l], va[l])
            same = (x == y) | (np.isnan(x) & np.isnan(y))
            if not same.all():
                return name, l
    return None


def check_engine_linear_backward(fn, *, seed=None, task=None, quiet=False):
    """09.2: fn(eng, dout, inp, w, b, l) -> dinp, the backward of layer l's linear `w` / `b` (parameter names, e.g.
    "qkvw", "qkvb") on the engine: returns dinp (N, in) float32 and writes eng.grads[w][l] and eng.grads[b][l].
    Checked for every layer and each of the block's four linears (square and not), twice each (different inputs,
    the gradient buffer NaN-poisoned before the first), against float64 NumPy."""
    name = "engine_linear_backward"
    seed = _seed(name, fn, seed)
    taken = borrowed.borrowed_verdict(name, [fn], OWN[name], task=task, seed=seed, quiet=quiet,
                                      check="check_engine_linear_backward")
    if taken is not None:
        return taken

    def body():
        cfg, _, N, rng, eng, P = _setup(seed)
        calls = 0
        for wname, bname in _LINEARS:
            for l in range(cfg.n_layer):
                _poison(eng)
                for rep in range(2):
                    W = P[wname][l]
                    IC, OC = W.shape
                    inp = rng.normal(0.0, 1.0, (N, IC)).astype(np.float32)
                    dout = rng.normal(0.0, 1.0, (N, OC)).astype(np.float32)
                    before = _host(eng.grads.flat).copy()
                    dinp = _call(name, fn, (eng, _dev(eng, dout), _dev(eng, inp), wname, bname, l),
                                 f"called as linear_backward(eng, dout ({N}, {OC}), inp ({N}, {IC}), {wname!r}, "
                                 f"{bname!r}, l={l}); eng.params[{wname!r}][l] is ({IC}, {OC})", seed)
                    calls += 1
                    _check_array(name, dinp, (N, IC), eng, f"dinp (layer {l}, {wname})")
                    d64, i64 = dout.astype(np.float64), inp.astype(np.float64)
                    want = {"dinp": d64 @ W.T, wname: i64.T @ d64, bname: d64.sum(axis=0)}
                    after = _host(eng.grads.flat)
                    grads = _views(cfg, after.astype(np.float64))
                    got = {"dinp": _host(dinp), wname: grads[wname][l], bname: grads[bname][l]}
                    moved = _changed_elsewhere(before, after, cfg, {(wname, l), (bname, l)})
                    for key in ("dinp", wname, bname):
                        d = _diff(got[key], want[key], TOL)
                        if d is None:
                            continue
                        label = "dinp" if key == "dinp" else f"eng.grads[{key!r}][{l}]"
                        hint = _linear_hint(key, wname, got, want, d, moved, l, cfg, P, d64, i64, rep, N)
                        raise _Verdict("wrong", f"{name}: wrong - layer {l}, {wname}: {label}"
                                       f": {_where(d, TOL)} (seed {seed})", hint, output=label,
                                       first_bad=d.get("index"), ours=d.get("got"), expected=d.get("expected"))
                    if moved is not None:
                        mname, ml = moved
                        raise _Verdict("wrong", f"{name}: wrong - layer {l}, {wname}: your function also changed "
                                       f"eng.grads[{mname!r}]" + (f"[{ml}]" if ml is not None else "") +
                                       f" (seed {seed})", "write only layer l's gradients of this linear: "
                                       "eng.grads[w][l] and eng.grads[b][l]" +
                                       (f"; a hard-coded layer index? (you wrote layer {ml}, l is {l})"
                                        if mname in (wname, bname) and ml is not None else ""))
        return (f"{name}: correct ({calls} calls: every layer of {cfg.n_layer} x the block's four linears, twice "
                f"each; {_backend_words(eng)}, N={N}; dinp and both gradients within {TOL:g} of float64, nothing "
                f"else written)")

    return _run(name, task, seed, quiet, body)


def _linear_hint(key, wname, got, want, d, moved, l, cfg, P, d64, i64, rep, N):
    """The named mistake behind a wrong dinp / weight gradient / bias gradient of check_engine_linear_backward."""
    g = got[key]
    if key != "dinp" and d["nan"] == d["n"] and rep == 0:
        if moved is not None and moved[0] == key and moved[1] is not None:
            return (f"eng.grads[{key!r}][{l}] was never written (still the NaN the checker put there) and layer "
                    f"{moved[1]}'s was: a hard-coded layer index; use l")
        return (f"eng.grads[{key!r}][{l}] is all NaN: the checker filled the buffer with NaN before the call, so it "
                f"was never written, or your code adds into it (+=, or gemm with beta=1): the backward WRITES each "
                f"gradient (otherwise the previous step's gradients stay in: they are not zeroed between steps)")
    W = P[wname][l]
    if key == "dinp":
        for k in range(cfg.n_layer):
            if k != l and _diff(g, d64 @ P[wname][k].T, MISTAKE_TOL) is None:
                return f"dinp used layer {k}'s {wname}, not layer {l}'s: a hard-coded layer index; use l"
        if W.shape[0] == W.shape[1] and _diff(g, d64 @ W, MISTAKE_TOL) is None:
            return ("dinp used the weight untransposed: weights are stored (in, out), so the gradient through one "
                    "takes W transposed (gemm's trans_b=True)")
    elif key == wname:
        if W.shape[0] == W.shape[1] and _diff(g, (i64.T @ d64).T, MISTAKE_TOL) is None:
            return (f"eng.grads[{key!r}][{l}] is transposed: a weight's gradient has the weight's layout (in, out): "
                    f"the input's transpose times dout (gemm's trans_a=True)")
    else:
        if _diff(g, want[key] / N, MISTAKE_TOL) is None:
            return "the bias gradient is the mean of dout over its rows; it is their sum (colsum_convert)"
    if rep == 1:
        return ("the first call was right and this second one (new inputs, the buffer still holding the first "
                "call's gradients) is not: your function keeps state between calls, or adds into eng.grads instead "
                "of writing (gradients not zeroed between steps)")
    ratio = _constant_ratio(g, want[key])
    if ratio is not None:
        return f"off by a constant factor {verdict.fmt(ratio)} (a sign, a scale, a mean instead of a sum?)"
    return None


def _constant_ratio(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    mask = np.abs(want) > 1e-6 * np.max(np.abs(want)) if want.size else None
    if mask is None or not mask.any() or not np.all(np.isfinite(got)):
        return None
    r = got[mask] / want[mask]
    if np.allclose(r, r[0], rtol=1e-3, atol=0) and abs(r[0] - 1.0) > 1e-3:
        return float(r[0])
    return None


# ------------------------------------------------------------------------------------------------------------
# 09.3 the block forward
# ------------------------------------------------------------------------------------------------------------
def _cache_shapes(cfg, B, T):
    C, nh = cfg.d_model, cfg.n_head
    sym = {"N": B * T, "C": C, "4C": 4 * C, "BH": B * nh, "T": T, "hs": C // nh}
    return {k: tuple(sym[s] for s in v) for k, v in _cap.CACHE_SHAPES.items()}


def _forward_input(rng, N, C):
    """A block input: rows of different means and scales (LayerNorm must normalise them)."""
    return (rng.normal(0.0, 1.0, (N, C)) * rng.uniform(0.5, 2.0, (N, 1)) + rng.normal(0.0, 0.5, (N, 1))
            ).astype(np.float32)


def _forward_hint(got_out, t, P, l, x64, B, T, nh, L):
    """The named forward mistake your output matches, or None."""
    for k in range(L):
        if k != l and _diff(got_out, block_model_forward(P, k, x64, B, T, nh)["out"], MISTAKE_TOL) is None:
            return (f"layer {l}'s output is what layer {k}'s weights give: a hard-coded layer index (every "
                    f"eng.params[...] of the block must be indexed with l)")
    for flags, hint in _FORWARD_MISTAKES:
        if _diff(got_out, block_model_forward(P, l, x64, B, T, nh, flags)["out"], MISTAKE_TOL) is None:
            return hint
    return None


def _first_wrong_cache(cache, t, keys, tol=TOL):
    for key in keys:
        d = _diff(_host(cache[key]), t[key], tol)
        if d is not None:
            return key, d
    return None, None


def _cache_hint(key, got, t, others):
    """What cache[key] holds instead, named."""
    candidates = [(k, v) for k, v in t.items() if k != key and np.shape(v) == np.shape(got)]
    for k, v in candidates:
        if _diff(got, v, MISTAKE_TOL) is None:
            if key in ("mean2", "rstd2", "ln2") and k in ("mean1", "rstd1", "ln1"):
                return (f"wrong LayerNorm saved for backward: cache[{key!r}] holds the first LayerNorm's {k} "
                        f"(of x); it must be {_cap.CACHE_MEANING[key]}")
            if key in ("mean1", "rstd1", "ln1") and k in ("mean2", "rstd2", "ln2"):
                return (f"wrong LayerNorm saved for backward: cache[{key!r}] holds the second LayerNorm's {k} "
                        f"(of x1); it must be {_cap.CACHE_MEANING[key]}")
            if k == "scores":
                return (f"cache[{key!r}] holds the scaled scores before the softmax; the backward needs the "
                        f"probabilities (attention_softmax_forward's output)")
            if k == "fc_nobias":
                return f"cache[{key!r}] is fc without its bias; GELU's input (and so the cache) includes fcb"
            if k in _cap.CACHE_MEANING:
                return (f"cache[{key!r}] holds {_cap.CACHE_MEANING[k]} (what cache[{k!r}] holds); it must be "
                        f"{_cap.CACHE_MEANING[key]}")
            return f"cache[{key!r}] holds the {k} of the block; it must be {_cap.CACHE_MEANING[key]}"
    for label, v in others:
        if np.shape(v) == np.shape(got) and _diff(got, v, MISTAKE_TOL) is None:
            return f"cache[{key!r}] holds {label}"
    return None


def check_block_forward(fn, *, seed=None, task=None, quiet=False):
    """09.3: fn(eng, x, l, B, T) -> (out, cache), the GPT block l on the engine: out (B*T, C) float32, cache a dict
    with capstone.CACHE_KEYS (new arrays on every call). Checked for every layer, twice (new inputs), against the
    float64 model: the output, every cache entry, the input left unchanged, and each cache still intact after the
    later calls (the engine keeps every layer's cache until its backward)."""
    name = "block_forward"
    seed = _seed(name, fn, seed)
    taken = borrowed.borrowed_verdict(name, [fn], OWN[name], task=task, seed=seed, quiet=quiet,
                                      check="check_block_forward")
    if taken is not None:
        return taken

    def body():
        cfg, B, N, rng, eng, P = _setup(seed)
        T, C, nh, L = cfg.block_size, cfg.d_model, cfg.n_head, cfg.n_layer
        shapes = _cache_shapes(cfg, B, T)
        kept = []
        for rep in range(2):
            for l in range(L):
                x = _forward_input(rng, N, C)
                x64 = x.astype(np.float64)
                t = block_model_forward(P, l, x64, B, T, nh)
                x_dev = _dev(eng, x)
                ret = _call(name, fn, (eng, x_dev, l, B, T),
                            f"called as block_forward(eng, x ({N}, {C}), l={l}, B={B}, T={T})", seed)
                if not (isinstance(ret, tuple) and len(ret) == 2):
                    raise _Verdict("wrong", f"{name}: wrong - your function returned {type(ret).__name__}, not "
                                   f"(out, cache)", "return the block's output and its cache: return out, cache")
                out, cache = ret
                _check_array(name, out, (N, C), eng, f"out (layer {l})")
                if not isinstance(cache, dict):
                    raise _Verdict("wrong", f"{name}: wrong - the cache is a {type(cache).__name__}, not a dict",
                                   f"return a dict with the keys {', '.join(_cap.CACHE_KEYS)}")
                missing = [k for k in _cap.CACHE_KEYS if k not in cache]
                if missing:
                    raise _Verdict("wrong", f"{name}: wrong - the cache has no {', '.join(repr(k) for k in missing)}",
                                   "the backward needs every one of capstone.CACHE_KEYS: " +
                                   "; ".join(f"{k}: {_cap.CACHE_MEANING[k]}" for k in missing))
                for key in _cap.CACHE_KEYS:
                    _check_array(name, cache[key], shapes[key], eng, f"cache[{key!r}] (layer {l})")
                where = f"layer {l}" + (" (second call)" if rep else "")
                if _diff(_host(x_dev), x64, 0.0) is not None:
                    raise _Verdict("wrong", f"{name}: wrong - {where}: your function changed its input x in place "
                                   f"(seed {seed})", "the block's input must stay as it was: the cache keeps it for "
                                   "the backward (cache['x']) and it is the residual; write the residual sums into "
                                   "new arrays (bias_add's out)")
                d = _diff(_host(out), t["out"], TOL)
                if d is not None:
                    hint = _forward_hint(_host(out), t, P, l, x64, B, T, nh, L)
                    key, dk = _first_wrong_cache(cache, t, _cap.CACHE_KEYS)
                    if hint is None and key is not None:
                        hint = (f"the first wrong tensor in the block (in the order the forward makes them) is "
                                f"cache[{key!r}], {_cap.CACHE_MEANING[key]}: {_where(dk, TOL)}")
                        more = _cache_hint(key, _host(cache[key]), t, [])
                        if more:
                            hint += f"; {more}"
                    if hint is None and rep == 1:
                        hint = ("the first call of every layer was right and this one (new inputs) is not: your "
                                "function keeps state between calls")
                    raise _Verdict("wrong", f"{name}: wrong - {where}, the block's output: {_where(d, TOL)} "
                                   f"(seed {seed})", hint or "compare your block step by step with the cache keys "
                                   "in order: the first wrong cache entry is where it goes wrong",
                                   output="out", first_bad=d.get("index"), ours=d.get("got"),
                                   expected=d.get("expected"))
                key, dk = _first_wrong_cache(cache, t, _cap.CACHE_KEYS)
                if key is not None:
                    hint = _cache_hint(key, _host(cache[key]), t, [])
                    raise _Verdict("wrong", f"{name}: wrong - {where}: the output is right but cache[{key!r}] "
                                   f"({_cap.CACHE_MEANING[key]}): {_where(dk, TOL)} (seed {seed})",
                                   hint or f"the backward reads cache[{key!r}]: it must be "
                                   f"{_cap.CACHE_MEANING[key]}", output=f"cache[{key!r}]")
                kept.append((l, rep, cache, {k: t[k] for k in _cap.CACHE_KEYS}))
        for l, rep, cache, want in kept:
            key, dk = _first_wrong_cache(cache, want, _cap.CACHE_KEYS)
            if key is not None:
                raise _Verdict("wrong", f"{name}: wrong - the cache of layer {l} ({'second' if rep else 'first'} "
                               f"call) was right when returned, but cache[{key!r}] changed during the later calls "
                               f"(seed {seed})", "your function reuses arrays between calls (a buffer allocated "
                               "once, or a view of one): the engine keeps every layer's cache until its backward, so "
                               "each call must write its cache into new arrays")
        return (f"{name}: correct (every layer of {L}, twice each: {_backend_words(eng)}, B={B} T={T}; the output "
                f"and all {len(_cap.CACHE_KEYS)} cache entries within {TOL:g} of float64; the input untouched, every "
                f"cache intact after the later calls)")

    return _run(name, task, seed, quiet, body)


# ------------------------------------------------------------------------------------------------------------
# 09.4 the block backward
# ------------------------------------------------------------------------------------------------------------
def _backward_hint(got, P, l, t, dout, B, T, nh, L):
    for k in range(L):
        if k != l:
            dx, g = block_model_backward(P, k, t, dout, B, T, nh)
            if _diff(got["dx"], dx, MISTAKE_TOL) is None:
                return (f"dx is what layer {k}'s weights give: a hard-coded layer index (every eng.params[...] "
                        f"and eng.grads[...] of the block must be indexed with l)")
    for flags, hint in _BACKWARD_MISTAKES:
        dx, g = block_model_backward(P, l, t, dout, B, T, nh, flags)
        if _matches(got, {"dx": dx, **g}):
            return hint
    return None


def check_block_backward(fn, *, seed=None, task=None, quiet=False):
    """09.4: fn(eng, dout, cache, l, B, T) -> dx, the backward of GPT block l on the engine, from the cache of the
    block's forward (capstone.CACHE_KEYS, built here from the float64 model, so this check does not depend on your
    09.3): returns dx (B*T, C) float32 and WRITES layer l's twelve gradients into eng.grads. Checked for every layer,
    twice (new inputs; the gradient buffer NaN-poisoned before the first pass and not reset), against float64."""
    name = "block_backward"
    seed = _seed(name, fn, seed)
    taken = borrowed.borrowed_verdict(name, [fn], OWN[name], task=task, seed=seed, quiet=quiet,
                                      check="check_block_backward")
    if taken is not None:
        return taken

    def body():
        cfg, B, N, rng, eng, P = _setup(seed)
        T, C, nh, L = cfg.block_size, cfg.d_model, cfg.n_head, cfg.n_layer
        _poison(eng)
        for rep in range(2):
            for l in reversed(range(L)):
                x = _forward_input(rng, N, C).astype(np.float64)
                t = block_model_forward(P, l, x, B, T, nh)
                t = {k: t[k].astype(np.float32).astype(np.float64) for k in list(_cap.CACHE_KEYS) + ["out"]}
                dout = rng.normal(0.0, 1.0, (N, C)).astype(np.float32).astype(np.float64)
                dx_want, g_want = block_model_backward(P, l, t, dout, B, T, nh)
                cache = {k: _dev(eng, t[k]) for k in _cap.CACHE_KEYS}
                before = _host(eng.grads.flat).copy()
                dx = _call(name, fn, (eng, _dev(eng, dout), cache, l, B, T),
                           f"called as block_backward(eng, dout ({N}, {C}), cache, l={l}, B={B}, T={T})", seed)
                _check_array(name, dx, (N, C), eng, f"dx (layer {l})")
                after = _host(eng.grads.flat)
                grads = _views(cfg, after.astype(np.float64))
                got = {"dx": _host(dx), **{p: grads[p][l] for p in _cap.LAYER_PARAMS}}
                want = {"dx": dx_want, **g_want}
                where = f"layer {l}" + (" (second call)" if rep else "")
                moved = _changed_elsewhere(before, after, cfg, {(p, l) for p in _cap.LAYER_PARAMS})
                for key in ("dx",) + _cap.LAYER_PARAMS:
                    d = _diff(got[key], want[key], TOL)
                    if d is None:
                        continue
                    label = "dx" if key == "dx" else f"eng.grads[{key!r}][{l}]"
                    nan_all = key != "dx" and d["nan"] == d["n"]
                    if nan_all and moved is not None and moved[1] is not None:
                        hint = (f"layer {l}'s gradients were never written (still the NaN the checker put there) "
                                f"and layer {moved[1]}'s {moved[0]} gradient was: a hard-coded layer index; use l")
                    elif nan_all and rep == 0:
                        hint = (f"{label} is all NaN: the checker filled the gradient buffer with NaN before the "
                                f"call, so it was never written, or your backward adds into it (+=, gemm with "
                                f"beta=1): the backward WRITES each gradient, or the previous step's gradients stay "
                                f"in (gradients not zeroed between steps)")
                    else:
                        hint = _backward_hint(got, P, l, t, dout, B, T, nh, L)
                    if hint is None and rep == 1:
                        hint = ("the first call of every layer was right and this one (new inputs, the gradient "
                                "buffer still holding the first calls' gradients) is not: your function keeps "
                                "state between calls, or adds into eng.grads (gradients not zeroed between steps)")
                    if hint is None:
                        hint = _backward_order_hint(got, want, key)
                    raise _Verdict("wrong", f"{name}: wrong - {where}, {label}: {_where(d, TOL)} (seed {seed})", hint,
                                   output=label, first_bad=d.get("index"), ours=d.get("got"),
                                   expected=d.get("expected"))
                if moved is not None:
                    mname, ml = moved
                    raise _Verdict("wrong", f"{name}: wrong - {where}: your function also changed eng.grads"
                                   f"[{mname!r}]" + (f"[{ml}]" if ml is not None else "") + f" (seed {seed})",
                                   "the block's backward writes only layer l's twelve gradients" +
                                   (f"; a hard-coded layer index? (you wrote layer {ml}, l is {l})"
                                    if ml is not None else ""))
        return (f"{name}: correct (every layer of {L}, twice each: {_backend_words(eng)}, B={B} T={T}; dx and the "
                f"12 gradients of the layer within {TOL:g} of float64, written (not added), nothing else touched)")

    return _run(name, task, seed, quiet, body)


def _backward_order_hint(got, want, key):
    order = ("fcprojw", "fcprojb", "fcw", "fcb", "ln2w", "ln2b", "attprojw", "attprojb", "qkvw", "qkvb", "ln1w",
             "ln1b", "dx")
    first = next((k for k in order if _diff(got[k], want[k], TOL) is not None), key)
    right = [k for k in order if _diff(got[k], want[k], TOL) is None]
    return (f"the first wrong result in backward order is {first!r}" + (f" (right: {', '.join(right)})" if right
                                                                         else "") +
            "; the mistake is in the step that produces it, or just before")


# ------------------------------------------------------------------------------------------------------------
# 09.5 the optimizer step
# ------------------------------------------------------------------------------------------------------------
def _adamw(p, m, v, g_used, lr, wd, t, betas, eps, decay):
    """float64 AdamW (optim.AdamW's definition): returns new (p, m, v); decay: mask of the decayed elements."""
    b1, b2 = betas
    p = p.copy()
    p[decay] -= lr * wd * p[decay]
    m = b1 * m + (1 - b1) * g_used
    v = b2 * v + (1 - b2) * g_used ** 2
    p -= lr * (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps)
    return p, m, v


def _coef(norm, clip):
    if clip <= 0:
        return 1.0
    c = clip / (norm + 1e-6)
    return c if c < 1.0 else 1.0


# what AdamW read, per mistake: g (the true gradient), S (loss scale), n (the true norm), clip
_GRAD_MISTAKES = (
    ("no_clip", lambda g, S, n, clip: g,
     "AdamW read the unclipped gradient: clipping is missing, or comes after the update; the clip factor must "
     "scale what AdamW reads (adamw_step's grad_scale)"),
    ("no_unscale", lambda g, S, n, clip: S * g * _coef(S * n, clip),
     "the loss scale is not undone: the gradient buffer holds loss_scale x the gradient; divide the norm and what "
     "AdamW reads by loss_scale"),
    ("grad_not_unscaled", lambda g, S, n, clip: S * g * _coef(n, clip),
     "AdamW read loss_scale x the gradient: grad_scale must also divide by loss_scale"),
    ("clip_from_scaled_norm", lambda g, S, n, clip: g * _coef(S * n, clip),
     "the clip factor was computed from the scaled norm: divide the norm by loss_scale before comparing it with "
     "grad_clip"),
    ("unscaled_twice", lambda g, S, n, clip: g * _coef(n, clip) / S,
     "the loss scale is divided out twice"),
    ("clip_uncapped", lambda g, S, n, clip: g * (clip / (n + 1e-6) if clip > 0 else 1.0),
     "the clip factor is not capped at 1: a gradient whose norm is already below grad_clip is left as it is "
     "(factor 1), not scaled up"),
    ("clip_zero", lambda g, S, n, clip: g * (clip / (n + 1e-6) if clip > 0 else 0.0),
     "grad_clip = 0 means no clipping (factor 1); your factor was 0"),
    ("clip_squared", lambda g, S, n, clip: g * _coef(n * n, clip),
     "the clip factor used the squared norm (grad_sumsq's sum of squares): take its square root"),
)
_DECAY_MISTAKES = (
    ("decay_all", "weight decay was applied to every parameter: only the matrices decay (pass "
     "decay_bounds=eng.decay to adamw_step)"),
    ("no_decay", "no weight decay was applied: pass weight_decay (and decay_bounds=eng.decay) to adamw_step"),
)
_T_MISTAKES = (
    (0, "AdamW's step count was not advanced: eng.t counts the steps taken; this step is eng.t + 1 (advance it, "
        "then pass it to adamw_step: the bias corrections need it)"),
    (2, "AdamW's step count advanced by 2"),
)


def _opt_expect(state, g, S, clip, lr, wd, betas, eps, decay, grad="ok", decay_mode="ok", dt=1):
    p, m, v, t0 = state
    n = float(np.sqrt(np.sum(g * g)))
    if grad == "ok":
        gu = g * _coef(n, clip)
    else:
        gu = dict((k, f) for k, f, _ in _GRAD_MISTAKES)[grad](g, S, n, clip)
    mask = {"ok": decay, "decay_all": np.ones_like(decay), "no_decay": np.zeros_like(decay)}[decay_mode]
    return _adamw(p, m, v, gu, lr, wd, t0 + dt, betas, eps, mask)


def _opt_diagnose(got, state, g, S, clip, lr, wd, betas, eps, decay):
    """Names of the mistakes whose combination reproduces got (p, m, v), or None."""
    p0 = state[0]
    got = tuple(np.asarray(a, np.float64) for a in got)
    grads = [("ok", None)] + [(k, h) for k, _, h in _GRAD_MISTAKES]
    decays = [("ok", None)] + list(_DECAY_MISTAKES)
    ts = [(1, None)] + list(_T_MISTAKES)
    for gk, gh in grads:
        for dk, dh in decays:
            for dt, th in ts:
                if gk == "ok" and dk == "ok" and dt == 1:
                    continue
                p, m, v = _opt_expect(state, g, S, clip, lr, wd, betas, eps, decay, gk, dk, dt)
                # the update p - p0, not p itself: the parameters' own size would hide a wrong update
                if all(_diff(a, b, MISTAKE_TOL) is None
                       for a, b in zip((got[0] - p0, got[1], got[2]), (p - p0, m, v))):
                    return "; also: ".join(h for h in (gh, dh, th) if h)
    return None


def _norm_hint(got, n, S, clip):
    for value, hint in ((S * n, "the returned norm is loss_scale x the true one: the loss scale is not undone (divide "
                                "the norm by loss_scale)"),
                        (n * n, "you returned the squared norm (grad_sumsq's sum of squares): take its square root"),
                        (S * S * n * n, "you returned the squared norm of the scaled gradient: take its square root "
                                        "and divide by loss_scale"),
                        (0.0, "the returned norm is 0: computed after adamw_step, which zeroes the gradients? "
                              "compute the norm first"),
                        (n * _coef(n, clip), "you returned the norm after clipping; the engine reports the norm "
                                             "before clipping (what clip_grad_norm_ returns)")):
        if abs(got - value) <= 1e-4 * abs(value) + 1e-12:
            return hint
    return None


def check_optimizer_step(fn, *, seed=None, task=None, quiet=False):
    """09.5: fn(eng, lr, weight_decay, grad_clip, loss_scale) -> grad_norm: one optimizer step on the engine whose
    eng.grads holds loss_scale x the gradient: the global norm of the true gradient (returned), clipping to grad_clip
    as torch.nn.utils.clip_grad_norm_ (0: off), AdamW (the course's fused kernel, step count eng.t advanced, decoupled
    weight decay on the matrices only). Three calls on one engine mid-run (eng.t = 3, m and v not zero): loss scale
    1024 with the clip binding, 1024 with the clip not binding, 1 with clipping off; params, m, v, eng.t and the
    returned norm against float64 AdamW."""
    name = "optimizer_step"
    seed = _seed(name, fn, seed)
    taken = borrowed.borrowed_verdict(name, [fn], OWN[name], task=task, seed=seed, quiet=quiet,
                                      check="check_optimizer_step")
    if taken is not None:
        return taken

    def body():
        from ..model.optim import decay_mask_for
        cfg, _ = _sizes()
        rng = np.random.default_rng(seed)
        flat = _random_params(cfg, rng)
        eng = _engine(cfg, flat, seed)
        n = num_params(cfg)
        t0 = 3
        b1, b2 = eng.betas
        g0 = rng.normal(0.0, 0.05, n)
        m0 = ((1 - b1 ** t0) * g0).astype(np.float32)
        v0 = ((1 - b2 ** t0) * g0 ** 2 * rng.uniform(0.5, 2.0, n)).astype(np.float32)
        eng.m[...], eng.v[...] = eng.xp.asarray(m0), eng.xp.asarray(v0)
        eng.t = t0
        decay = decay_mask_for(cfg)
        calls = ((LOSS_SCALE, 0.4, 1e-2, 0.1), (LOSS_SCALE, 3.0, 5e-3, 0.2), (1.0, 0.0, 2e-3, 0.1))
        for i, (S, clip_ratio, lr, wd) in enumerate(calls):
            g = (rng.normal(0.0, 1.0, n) * rng.uniform(0.02, 0.2)).astype(np.float32).astype(np.float64)
            norm = float(np.sqrt(np.sum(g * g)))
            clip = clip_ratio * norm
            state = (_host(eng.params.flat).astype(np.float64), _host(eng.m).astype(np.float64),
                     _host(eng.v).astype(np.float64), eng.t)
            eng.grads.flat[...] = eng.xp.asarray((S * g).astype(np.float32))
            binding = "off" if clip == 0 else "binding" if clip < norm else "not binding"
            what = (f"loss_scale {S:g}, grad_clip {verdict.fmt(clip)} ({binding}), lr {lr:g}, weight_decay {wd:g}, "
                    f"eng.t {eng.t} before the call")
            ret = _call(name, fn, (eng, lr, wd, clip, S), f"called with {what}", seed)
            try:
                got_norm = float(ret)
                if isinstance(ret, bool) or np.ndim(ret) != 0:
                    raise TypeError
            except (TypeError, ValueError):
                raise _Verdict("wrong", f"{name}: wrong - your function returned {type(ret).__name__}, not the "
                               f"gradient norm", "return the global norm of the (unscaled) gradient, a float") from None
            want = _opt_expect(state, g, S, clip, lr, wd, eng.betas, eng.eps, decay)
            got = (_host(eng.params.flat), _host(eng.m), _host(eng.v))
            nh = _norm_hint(got_norm, norm, S, clip) if abs(got_norm - norm) > 1e-4 * norm else None
            call = f"call {i + 1} of {len(calls)} ({what})"
            for j, label in ((1, "m"), (2, "v"), (0, "params")):       # m first: it shows what AdamW read
                a, b = got[j], want[j]
                d = _diff(a, b, OPT_TOL)
                if d is None:
                    continue
                hint = _opt_diagnose(got, state, g, S, clip, lr, wd, eng.betas, eng.eps, decay)
                if hint and nh:
                    hint += f"; and {nh}"
                elif hint is None and d["nan"] == d["n"]:
                    hint = f"eng.{label} is all NaN or inf"
                elif hint is None:
                    read = (got[1].astype(np.float64) - b1 * state[1]) / (1 - b1)     # what AdamW read, from m
                    ratio = _constant_ratio(read, g * _coef(norm, clip))
                    hint = (f"the gradient AdamW read is {verdict.fmt(ratio)} x the clipped, unscaled gradient"
                            if ratio else
                            "compare with the contract: the norm of the true gradient (the buffer holds loss_scale "
                            "x it), the clip factor of torch's clip_grad_norm_ when grad_clip > 0, one adamw_step "
                            "over the flat buffers at step eng.t + 1 with that factor and 1/loss_scale in "
                            "grad_scale, decay_bounds=eng.decay")
                pname = _param_of(cfg, d.get("index")) if "index" in d else None
                raise _Verdict("wrong", f"{name}: wrong - {call}: eng.{label}" +
                               (f" (in {pname})" if pname else "") + f": {_where(d, OPT_TOL)} (seed {seed})", hint,
                               output=label)
            if eng.t != state[3] + 1:
                raise _Verdict("wrong", f"{name}: wrong - {call}: eng.t is {eng.t} after the call, expected "
                               f"{state[3] + 1}", "advance eng.t by one per step (the engine's step count; "
                               "checkpoints save it)")
            if not abs(got_norm - norm) <= 1e-4 * norm:
                raise _Verdict("wrong", f"{name}: wrong - {call}: returned grad_norm {_fmt(got_norm)}, expected "
                               f"{_fmt(norm)} (seed {seed})", nh or "return the global L2 norm of the true "
                               "(unscaled) gradient, before clipping")
        return (f"{name}: correct (3 calls mid-run: loss scale 1024 with the clip binding and not binding, 1 with "
                f"clipping off; {_backend_words(eng)}, {n:,} parameters; params, m, v within {OPT_TOL:g} of float64 "
                f"AdamW, eng.t advanced, the returned norm right)")

    return _run(name, task, seed, quiet, body)


def _param_of(cfg, index):
    from ..model.params import ParamBuffer
    if index is None:
        return None
    i = int(index[0])
    buf = ParamBuffer(cfg, np.float32)
    for name, (a, b) in buf.offsets.items():
        if a <= i < b:
            shape = buf.shapes[name]
            return f"{name}, element {_idx(np.unravel_index(i - a, shape))}"
    return None


# ------------------------------------------------------------------------------------------------------------
# 09.6 the whole step against the NumPy engine
# ------------------------------------------------------------------------------------------------------------
def _batches(rng, cfg, B, n):
    """n batches of tokens with structure the model can learn: each sequence follows t -> (a t + c) mod V with a
    little noise (random a, c per sequence)."""
    V, T = cfg.vocab_size, cfg.block_size
    out = []
    for _ in range(n):
        a = rng.integers(1, V, (B, 1))
        c = rng.integers(0, V, (B, 1))
        seq = np.empty((B, T + 1), np.int64)
        seq[:, 0] = rng.integers(0, V, B)
        for i in range(1, T + 1):
            seq[:, i] = (a[:, 0] * seq[:, i - 1] + c[:, 0]) % V
        noise = rng.random((B, T + 1)) < 0.1
        seq[noise] = rng.integers(0, V, int(noise.sum()))
        out.append((seq[:, :-1].astype(np.int32), seq[:, 1:].astype(np.int32)))
    return out


def _model_layers(P, cfg, x):
    """Each block's tensors (block_model_forward: "out" and every cache entry), float64, for tokens x (B, T): the
    reference stream."""
    B, T = x.shape
    h = (P["wte"][x] + P["wpe"][:T]).reshape(B * T, cfg.d_model)
    blocks = []
    for l in range(cfg.n_layer):
        blocks.append(block_model_forward(P, l, h, B, T, cfg.n_head))
        h = blocks[-1]["out"]
    return blocks


def _forward_cache_hint(caches, blocks, step) -> Optional[str]:
    """The hint for a wrong gradient of the whole step when the cause is on the forward side, in the caches your
    block_forward returned (each layer's, as returned and after the whole forward, before the backward), else None."""
    for l, (cache, kept) in enumerate(caches):
        t = blocks[l]
        key, d = _first_wrong_cache(kept, t, _cap.CACHE_KEYS, TOL * 10)
        if key is not None:
            more = _cache_hint(key, kept[key], t, [])
            return (f"the cause is on the forward side: every layer's output was right, but the cache your "
                    f"block_forward returned for layer {l} holds a wrong cache[{key!r}] ({_where(d, TOL * 10)}): "
                    + (more or f"it must be {_cap.CACHE_MEANING[key]}") + ". The backward reads the cache, so its "
                    "gradients come out wrong; check_block_forward (09.3) names the mistake")
        for key in _cap.CACHE_KEYS:
            now = _host(cache[key])
            if np.shape(now) == np.shape(kept[key]) and _diff(now, kept[key], 0.0) is not None:
                return (f"the cause is on the forward side: the cache your block_forward returned for layer {l} was "
                        f"right, but cache[{key!r}] had changed by the end of step {step}'s forward: "
                        f"your block_forward reuses arrays between calls (a buffer allocated once, or a view of "
                        f"one), and a later layer's call wrote over it. Each call must write its cache into new "
                        f"arrays; check_block_forward (09.3) names it")
    return None


def check_training_step(block_forward, block_backward, optimizer_step, *, seed=None, task=None, quiet=False):
    """09.6: the CapstoneEngine built from your three functions (loss scale 1024) against engine.NumpyEngine, from
    the same random parameters on the same batches: two steps in the CUDA simulator (L=2), ten of a larger model on
    a GPU (hip). Two references: the NumPy engine trained alongside yours (its losses must match yours, step by
    step, within LOSS_TOL), and, at every step, the NumPy engine loaded with YOUR engine's current state (so that
    the comparisons stay exact however far two fp32 runs drift apart): every layer's output, the loss, all sixteen
    gradient tensors (every layer), then the optimizer step from your own gradient: the returned norm, params, m, v
    and eng.t against float64 AdamW."""
    name = "training_step"
    for what, f in (("block_forward", block_forward), ("block_backward", block_backward),
                    ("optimizer_step", optimizer_step)):
        if not callable(f):
            raise TypeError(f"check_training_step: {what} must be your function, got {type(f).__name__}: pass the "
                            f"function itself, without calling it")
    seed = _seed(name, block_forward, seed)
    taken = borrowed.borrowed_verdict(name, [block_forward, block_backward, optimizer_step], OWN[name], task=task,
                                      seed=seed, quiet=quiet, check="check_training_step")
    if taken is not None:
        return taken

    def body():
        from ..engine import NumpyEngine
        from ..model.optim import decay_mask_for
        cfg, B, steps = _step_sizes()
        rng = np.random.default_rng(seed)
        flat = _random_params(cfg, rng)
        S = LOSS_SCALE
        outputs, caches = [], []

        def recording_forward(eng, x, l, B_, T_):
            ret = block_forward(eng, x, l, B_, T_)
            if isinstance(ret, tuple) and len(ret) == 2 and ret[0] is not None:
                outputs.append(_host(ret[0]).copy())
                cache = ret[1]
                if isinstance(cache, dict) and all(k in cache for k in _cap.CACHE_KEYS):
                    try:      # as returned; the dict itself too, to see what the backward found there
                        caches.append((cache, {k: np.array(_host(cache[k]), np.float64) for k in _cap.CACHE_KEYS}))
                    except Exception:  # not arrays: the backward will fail on them, and say so
                        pass
            return ret

        mine = _cap.CapstoneEngine(cfg, recording_forward, block_backward, optimizer_step, seed=seed, loss_scale=S)
        ref = NumpyEngine(cfg, "none", seed, mine.betas, mine.eps)        # trained alongside: the losses
        shadow = NumpyEngine(cfg, "none", seed, mine.betas, mine.eps)     # your state, every step: the rest
        zeros = np.zeros(num_params(cfg), np.float32)
        for e in (mine, ref):
            e.load_state_dict({"params": flat, "m": zeros, "v": zeros, "t": 0})
        decay = decay_mask_for(cfg)
        batches = _batches(rng, cfg, B, steps)
        lr, wd, clip = 3e-3, 0.1, None
        losses = []
        leftover = np.zeros(num_params(cfg))
        for s, (x, y) in enumerate(batches, 1):
            at = f"step {s} of {steps}"
            p0, m0, v0, t0 = (_host(mine.params.flat).astype(np.float64), _host(mine.m).astype(np.float64),
                              _host(mine.v).astype(np.float64), mine.t)
            shadow.load_state_dict({"params": p0.astype(np.float32), "m": zeros, "v": zeros, "t": 0})
            _, loss_want = shadow.forward(x, y)
            shadow.backward()
            g_want = shadow.grads.flat.astype(np.float64)
            _, loss_ref = ref.forward(x, y)
            ref.backward()
            if clip is None:
                clip = 0.5 * ref.grad_norm()               # binding on step 1
            ref.optimizer_step(lr, wd, clip)
            # the forward: every layer, then the loss
            outputs.clear()
            caches.clear()
            _, loss = _call(name, mine.forward, (x, y), f"{at}: the forward (your block_forward)", seed)
            if len(outputs) != cfg.n_layer:
                raise _Verdict("wrong", f"{name}: wrong - {at}: block_forward returned {len(outputs)} outputs for "
                               f"{cfg.n_layer} layers", "check_block_forward (09.3) first")
            blocks = _model_layers(_views(cfg, p0), cfg, x)
            for l, (o, w) in enumerate(zip(outputs, (b["out"] for b in blocks))):
                d = _diff(o, w, TOL * 10)
                if d is not None:
                    raise _Verdict("wrong", f"{name}: wrong - {at}, the forward: layer {l}'s output"
                                   f": {_where(d, TOL * 10)} (seed {seed})",
                                   "your block_forward; check_block_forward (09.3) names the mistake")
            if not abs(loss - loss_want) <= LOSS_TOL * abs(loss_want):
                raise _Verdict("wrong", f"{name}: wrong - {at}: loss {_fmt(loss)}, the NumPy engine's "
                               f"{_fmt(loss_want)} from the same weights (seed {seed})", "every layer's output was "
                               "right: the loss comes from the skeleton; did your block change the residual stream "
                               "after returning it?")
            # what the backward will read: the caches as your forward returned them, and still the same now
            forward_side = _forward_cache_hint(caches, blocks, s) if len(caches) == cfg.n_layer else None
            # the backward: the sixteen gradient tensors, every layer
            _call(name, mine.backward, (S,), f"{at}: the backward (your block_backward)", seed)
            g_mine = _host(mine.grads.flat).astype(np.float64)
            gm, gw, lv = _views(cfg, g_mine), _views(cfg, S * g_want), _views(cfg, leftover)
            for pname in mine.grads.names:
                for l in (range(cfg.n_layer) if pname in _cap.LAYER_PARAMS else [None]):
                    a, b, left = ((gm[pname], gw[pname], lv[pname]) if l is None else
                                  (gm[pname][l], gw[pname][l], lv[pname][l]))
                    d = _diff(a, b, TOL * 10)
                    if d is None:
                        continue
                    label = f"the gradient of {pname!r}" + (f", layer {l}" if l is not None else "")
                    hint = "your block_backward; check_block_backward (09.4) names the mistake"
                    if forward_side is not None:
                        hint = forward_side
                    elif s > 1 and np.any(left) and _diff(a, b + left, TOL * 10) is None:
                        hint = (f"step {s - 1}'s gradients were right; step {s}'s are its own plus what the buffer "
                                f"held after step {s - 1}: gradients not zeroed between steps (your backward adds "
                                f"into eng.grads, and your optimizer step left them there; the backward must write "
                                f"them)")
                    elif pname not in _cap.LAYER_PARAMS:
                        hint = ("a gradient outside the blocks is wrong: the skeleton computes it from the dx your "
                                "block_backward returns for layer 0 (check_block_backward, 09.4)")
                    raise _Verdict("wrong", f"{name}: wrong - {at}, the backward (loss scale {S:g}): {label}"
                                   f": {_where(d, TOL * 10)} (seed {seed})", hint, output=pname)
            # the optimizer step, from the gradient your backward wrote
            g = g_mine / S
            norm = float(np.sqrt(np.sum(g * g)))
            out = _call(name, mine.optimizer_step, (lr, wd, clip), f"{at}: your optimizer_step", seed)
            if not abs(out["grad_norm"] - norm) <= 1e-4 * norm:
                raise _Verdict("wrong", f"{name}: wrong - {at}: your optimizer_step returned the norm "
                               f"{_fmt(out['grad_norm'])}, expected {_fmt(norm)} (seed {seed})",
                               _norm_hint(out["grad_norm"], norm, S, clip) or "check_optimizer_step (09.5)")
            state = (p0, m0, v0, t0)
            want = _opt_expect(state, g, S, clip, lr, wd, mine.betas, mine.eps, decay)
            got = (_host(mine.params.flat), _host(mine.m), _host(mine.v))
            for j, label in ((1, "m"), (2, "v"), (0, "params")):
                d = _diff(got[j], want[j], OPT_TOL)
                if d is None:
                    continue
                hint = _opt_diagnose(got, state, g, S, clip, lr, wd, mine.betas, mine.eps, decay)
                raise _Verdict("wrong", f"{name}: wrong - {at}, your optimizer step: eng.{label} "
                               f"(in {_param_of(cfg, d.get('index'))}): {_where(d, OPT_TOL)} (seed {seed})",
                               hint or "check_optimizer_step (09.5) names the mistake", output=label)
            if mine.t != t0 + 1:
                raise _Verdict("wrong", f"{name}: wrong - {at}: eng.t is {mine.t} after the step, expected {t0 + 1}",
                               "advance eng.t by one per step")
            leftover = _host(mine.grads.flat).astype(np.float64)
            # the run: your losses against the NumPy engine trained alongside
            losses.append((loss, loss_ref))
            if not abs(loss - loss_ref) <= LOSS_TOL * abs(loss_ref):
                raise _Verdict("wrong", f"{name}: wrong - {at}: your engine's loss {_fmt(loss)}, the NumPy engine's "
                               f"{_fmt(loss_ref)} (relative difference {abs(loss - loss_ref) / abs(loss_ref):.1e}, "
                               f"tol {LOSS_TOL:g}; seed {seed})", "each step matched the NumPy engine from your own "
                               "weights, yet the two runs drifted apart: compare the losses step by step")
        worst = max(abs(a - b) / abs(b) for a, b in losses)
        table = ", ".join(f"{a:.5f}" for a, _ in losses)
        return (f"{name}: correct ({steps} steps of your engine ({_backend_words(mine)}, B={B} T={cfg.block_size}, "
                f"loss scale {S:g}, the clip binding on step 1): at every step each layer's output, the loss, the 16 "
                f"gradient tensors, the norm, params, m and v right; losses {table}, within {worst:.1e} (relative) of "
                f"the NumPy engine's run)")

    return _run(name, task, seed, quiet, body)
