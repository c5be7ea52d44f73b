"""Softmax over the last axis.

Forward, one row x of length n:
    out_i = exp(x_i - max(x)) / sum_j exp(x_j - max(x))
    (subtracting the max changes nothing mathematically and keeps exp from overflowing)

Backward: the Jacobian is d out_i / d x_j = out_i (delta_ij - out_j), so
    dinp_j = sum_i dout_i out_i (delta_ij - out_j) = out_j (dout_j - sum_i out_i dout_i)
    dinp   = out * (dout - sum(out * dout, axis=-1, keepdims=True))
    Only out is needed, not the input.
"""
import numpy as np

from ._validate import _dout_shaped, _float_array


def softmax_forward(inp):
    """inp (..., n) -> out (..., n), each row sums to 1; cache {out}. -inf entries get probability 0."""
    inp = _float_array("softmax_forward", "inp", inp)
    if inp.ndim < 1 or inp.shape[-1] == 0:
        raise ValueError(f"softmax_forward: inp must be (..., n) with n >= 1, got shape {inp.shape}")
    e = np.exp(inp - inp.max(axis=-1, keepdims=True))   # (..., n) all <= 1
    out = e / e.sum(axis=-1, keepdims=True)             # (..., n)
    return out, {"out": out}


def softmax_backward(dout, cache):
    """dout (..., n) -> dinp (..., n)."""
    out = cache["out"]
    dout = _dout_shaped("softmax_backward", dout, "out", out.shape).astype(out.dtype, copy=False)
    return out * (dout - (out * dout).sum(axis=-1, keepdims=True))   # (..., n)
