"""Gradient checking: compare a backward pass against central finite differences, in float64.

The idea: for a scalar function f and a tiny step eps,
    df/dx_i  ~=  (f(x + eps e_i) - f(x - eps e_i)) / (2 eps)
with an error of order eps^2 (truncation, from the Taylor series) plus order 1e-16 |f| / eps (round-off:
f is only known to about 16 digits in float64, and we divide by eps). eps = 1e-6 balances the two.

An op's output is a whole array, so we check the scalar loss = sum(out * R) for a fixed random R: its
gradient with respect to out is exactly R (every output element matters, each with its own weight), so
backward(R, cache) must return d loss / d inputs.

Example (in a notebook)::

    from gpullm_lessons.reference import linear_forward, linear_backward
    from gpullm_lessons.checks.gradcheck import gradcheck
    x, w, b = np.random.randn(2, 3, 5), np.random.randn(5, 4), np.random.randn(4)
    result = gradcheck(linear_forward, linear_backward, {"inp": x, "weight": w, "bias": b})
    result.report()          # a table: per input, max abs / rel error and whether it passed
    assert result.passed

forward is called with the inputs as keyword arguments (so the dict keys are forward's parameter names).
backward(R, cache) returns one gradient per floating-point input, in the dict's order (a single array when
there is one). Integer arrays (idx, targets) and Python scalars (n_head, eps) are passed through as they are
and never perturbed. An input given as None (bias=None) may take a slot in backward's tuple (returning None).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import numpy as np


# ------------------------------------------------------------------------------------------------- results

@dataclasses.dataclass
class GradRow:
    """The comparison for one input (or one parameter tensor)."""
    name: str
    shape: tuple
    n_checked: int            # how many entries were compared by finite differences
    max_abs_err: float        # max |analytic - numerical|
    max_rel_err: float        # max |analytic - numerical| / max(|analytic|, |numerical|) over entries > atol
    passed: bool              # every entry: |a - n| <= atol + rtol * max(|a|, |n|), and nothing NaN
    note: str = ""            # why it failed, when it is not just the numbers


@dataclasses.dataclass
class GradcheckResult:
    """Per-input errors of one gradient check. ``passed`` is True when every row passed."""
    title: str
    rows: list
    eps: float
    rtol: float
    atol: float

    @property
    def passed(self) -> bool:
        return bool(self.rows) and all(row.passed for row in self.rows)

    @property
    def max_abs_err(self) -> dict:
        return {row.name: row.max_abs_err for row in self.rows}

    @property
    def max_rel_err(self) -> dict:
        return {row.name: row.max_rel_err for row in self.rows}

    def __getitem__(self, name) -> GradRow:
        for row in self.rows:
            if row.name == name:
                return row
        raise KeyError(f"no row named {name!r}; rows are {[row.name for row in self.rows]}")

    def __str__(self):
        verdict = "PASSED" if self.passed else "FAILED"
        setting = f"(float64, eps={self.eps:g}, rtol={self.rtol:g}, atol={self.atol:g})"
        head = f"{self.title}: {verdict}  {setting}"
        # at most 100 characters a line: JupyterLab wraps longer output lines anywhere, even inside a number
        lines = [head] if len(head) <= 100 else [f"{self.title}: {verdict}", f"  {setting}"]
        width = max([5] + [len(row.name) for row in self.rows])
        lines.append(f"{'input':<{width}}  {'shape':<16} {'checked':>7}  {'max abs err':>11}  {'max rel err':>11}  ok")
        for row in self.rows:
            ok = "yes" if row.passed else "NO"
            lines.append(f"{row.name:<{width}}  {str(row.shape):<16} {row.n_checked:>7}  "
                         f"{row.max_abs_err:>11.2e}  {row.max_rel_err:>11.2e}  {ok}"
                         + (f"  ({row.note})" if row.note else ""))
        return "\n".join(lines)

    __repr__ = __str__

    def report(self) -> None:
        """Print the table."""
        print(self)


def compare(name, analytic, numerical, rtol=1e-5, atol=1e-7, note="") -> GradRow:
    """One GradRow from an analytic and a numerical gradient (arrays of the same shape)."""
    a = np.asarray(analytic, dtype=np.float64)
    n = np.asarray(numerical, dtype=np.float64)
    if a.size == 0:
        return GradRow(name, a.shape, 0, 0.0, 0.0, True, note)
    diff = np.abs(a - n)
    scale = np.maximum(np.abs(a), np.abs(n))
    finite = bool(np.all(np.isfinite(a)) and np.all(np.isfinite(n)))
    passed = finite and bool(np.all(diff <= atol + rtol * scale))
    big = scale > atol                                   # relative error is noise for entries near zero
    max_rel = float(np.max(diff[big] / scale[big])) if np.any(big) else 0.0
    if not finite:
        note = note or "NaN or inf in a gradient"
    return GradRow(name, tuple(a.shape), int(a.size), float(np.nanmax(diff)) if finite else float("nan"),
                   max_rel, passed, note)


# ------------------------------------------------------------------------------------ finite differences

def _partial(f, x, index, eps):
    """Central difference of f() with respect to the one entry x[index] (perturbed in place, then restored)."""
    old = x[index].copy()
    x[index] = old + eps
    hi = x[index].copy()                                 # the value actually stored (rounded to x's dtype)
    f_plus = float(f())
    x[index] = old - eps
    lo = x[index].copy()
    f_minus = float(f())
    x[index] = old                                       # restore exactly
    return (f_plus - f_minus) / float(hi - lo)


def numerical_grad(f: Callable[[], float], x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """d f() / d x by central differences, one entry at a time. f takes no arguments and reads x, which is
    perturbed in place and restored. Returns a float64 array of x's shape. Use float64 x: in float32 the
    round-off error (~1e-7 |f| / eps) swamps everything.

    >>> x = np.array([1.0, 2.0]); numerical_grad(lambda: float(np.sum(x ** 2)), x)   # ~ [2, 4]
    """
    if not isinstance(x, np.ndarray) or not np.issubdtype(x.dtype, np.floating):
        raise TypeError(f"numerical_grad: x must be a floating-point numpy array, got "
                        f"{getattr(x, 'dtype', type(x).__name__)}")
    grad = np.zeros(x.shape, dtype=np.float64)
    for index in np.ndindex(x.shape):
        grad[index] = _partial(f, x, index, eps)
    return grad


def fd_error_curve(f: Callable[[float], float], df: Callable[[float], float], x0: float = 1.0,
                   eps_values=None, method: str = "central"):
    """Error of a finite-difference derivative of a scalar function as the step shrinks, for a log-log plot.

    f, df: the function and its exact derivative (e.g. np.sin, np.cos). method "central" has truncation error
    ~ eps^2, "forward" ~ eps; both have round-off error ~ 1e-16 / eps, so the curve is a V.
    Returns (eps_values, errors), float64 arrays: errors = |estimate - df(x0)|.

    >>> eps, err = fd_error_curve(np.sin, np.cos, x0=1.0)
    >>> plt.loglog(eps, err)
    """
    if method not in ("central", "forward"):
        raise ValueError(f"fd_error_curve: method must be 'central' or 'forward', got {method!r}")
    eps_values = np.logspace(-15, 0, 61) if eps_values is None else np.asarray(eps_values, dtype=np.float64)
    exact = float(df(x0))
    errors = np.empty(len(eps_values))
    for i, eps in enumerate(eps_values):
        if method == "central":
            estimate = (float(f(x0 + eps)) - float(f(x0 - eps))) / (2 * eps)
        else:
            estimate = (float(f(x0 + eps)) - float(f(x0))) / eps
        errors[i] = abs(estimate - exact)
    return eps_values, errors


# ------------------------------------------------------------------------------------------- op gradcheck

def _is_float_array(v):
    return isinstance(v, np.ndarray) and np.issubdtype(v.dtype, np.floating)


def gradcheck(forward: Callable, backward: Callable, inputs: dict, grad_names=None, eps: float = 1e-6,
              rtol: float = 1e-5, atol: float = 1e-7, seed: int = 0) -> GradcheckResult:
    """Check backward against finite differences of forward, on float64 copies of the inputs.

    forward(**inputs) -> (out, cache); backward(dout, cache) -> one gradient per floating-point input, in
    the order of ``inputs`` (see the module docstring). The loss is sum(out * R), R fixed random (seed).
    grad_names: which float inputs to check (default: all). Your arrays are never modified.
    Returns a GradcheckResult: ``.passed``, ``.report()``, ``result["inp"].max_rel_err``...

    >>> gradcheck(attention_forward, attention_backward, {"qkv": np.random.randn(2, 4, 24), "n_head": 2}).report()
    """
    if not isinstance(inputs, dict):
        raise TypeError("gradcheck: inputs must be a dict {forward's parameter name: value}")
    # float64 copies of the float inputs; everything else (int arrays, scalars, None) as given
    x64 = {k: (np.array(v, dtype=np.float64) if _is_float_array(v) else v) for k, v in inputs.items()}
    float_names = [k for k, v in x64.items() if _is_float_array(v)]
    slot_names = [k for k, v in x64.items() if _is_float_array(v) or v is None]
    if not float_names:
        raise ValueError("gradcheck: no floating-point array among the inputs, nothing to check")
    if grad_names is None:
        grad_names = float_names
    for name in grad_names:
        if name not in float_names:
            raise ValueError(f"gradcheck: {name!r} is not a floating-point input; float inputs are {float_names}")

    out, cache = forward(**x64)
    R = np.random.default_rng(seed).standard_normal(np.shape(out))   # d loss / d out
    grads = backward(R if R.ndim else float(R), cache)
    if not isinstance(grads, (tuple, list)):
        grads = (grads,)
    if len(grads) == len(float_names):
        matched = dict(zip(float_names, grads))
    elif len(grads) == len(slot_names):
        matched = dict(zip(slot_names, grads))
    else:
        raise ValueError(f"gradcheck: backward returned {len(grads)} gradients but there are "
                         f"{len(float_names)} floating-point inputs {float_names}")
    # copy now: the finite differences below perturb the inputs, which a gradient might alias
    matched = {k: (None if g is None else np.array(g, dtype=np.float64)) for k, g in matched.items()}

    def loss():
        return float(np.sum(np.asarray(forward(**x64)[0], dtype=np.float64) * R))

    rows = []
    for name in grad_names:
        x, analytic = x64[name], matched[name]
        if analytic is None:
            rows.append(GradRow(name, x.shape, 0, float("nan"), float("nan"), False, "backward returned None"))
            continue
        if analytic.shape != x.shape:
            rows.append(GradRow(name, x.shape, 0, float("nan"), float("nan"), False,
                                f"gradient is {analytic.shape} but the input is {x.shape}"))
            continue
        rows.append(compare(name, analytic, numerical_grad(loss, x, eps), rtol, atol))
    title = f"gradcheck {getattr(forward, '__name__', 'forward')} / {getattr(backward, '__name__', 'backward')}"
    return GradcheckResult(title, rows, eps, rtol, atol)


# ------------------------------------------------------------------------------------------ GPT gradcheck

def gpt_gradcheck(cfg, seed: int = 0, n_checks: int = 6, B: int = 2, T: Optional[int] = None,
                  eps: float = 1e-6, rtol: float = 1e-5, atol: float = 1e-7, noise: float = 0.1,
                  forward: Optional[Callable] = None, backward: Optional[Callable] = None) -> GradcheckResult:
    """Check the whole GPT's backward (default: the reference gpt_forward / gpt_backward) in float64.

    Parameters: init_params(cfg, seed, float64) plus N(0, noise) on every entry, so that no LayerNorm weight
    is exactly 1 and no bias exactly 0 (such values hide bugs). Random idx and targets (B, T), T defaults
    to cfg.block_size. For every named tensor, n_checks entries are compared with central differences of
    the loss: the entry with the largest analytic gradient plus random others. One row per tensor.
    forward / backward: your own functions with gpt_forward / gpt_backward's signatures, to check them.
    """
    from ..model.params import init_params
    from ..reference.gpt import gpt_backward, gpt_forward
    forward = forward or gpt_forward
    backward = backward or gpt_backward
    T = cfg.block_size if T is None else T
    rng = np.random.default_rng(seed)
    params = init_params(cfg, seed=seed, dtype=np.float64)
    params.flat += noise * rng.standard_normal(params.flat.size)
    idx = rng.integers(0, cfg.vocab_size, size=(B, T))
    targets = rng.integers(0, cfg.vocab_size, size=(B, T))

    _, _, cache = forward(params, cfg, idx, targets)
    grads = params.zeros_like()
    grads.flat[...] = np.nan                             # whatever backward does not write shows up as NaN
    backward(cache, grads)

    def loss():
        return float(forward(params, cfg, idx, targets)[1])

    rows = []
    for name in params.names:
        x, analytic = params[name], grads[name]
        picks = {int(np.nanargmax(np.abs(analytic))) if not np.all(np.isnan(analytic)) else 0}
        others = rng.permutation(x.size)
        for i in others:
            if len(picks) >= min(n_checks, x.size):
                break
            picks.add(int(i))
        picks = sorted(picks)
        index = [np.unravel_index(i, x.shape) for i in picks]
        numerical = np.array([_partial(loss, x, ix, eps) for ix in index])
        rows.append(compare(name, np.array([analytic[ix] for ix in index]), numerical, rtol, atol))
        rows[-1].shape = tuple(x.shape)
    shape = (f"L={cfg.n_layer} nh={cfg.n_head} C={cfg.d_model} block_size={cfg.block_size} "
             f"V={cfg.vocab_size}")
    return GradcheckResult(f"gpt_gradcheck (B={B}, T={T}, {shape})", rows, eps, rtol, atol)
