"""Residual connection: out = a + b.

Backward: d(a + b)/da = d(a + b)/db = 1, so the gradient is copied to both branches:
    da = dout,  db = dout
(this is why residual streams carry gradients to early layers undiminished).
"""
import numpy as np

from ._validate import _float_array


def residual_forward(a, b):
    """a, b (same shape) -> out = a + b, cache None."""
    a = _float_array("residual_forward", "a", a)
    b = _float_array("residual_forward", "b", b)
    if a.shape != b.shape:
        raise ValueError(f"residual_forward: a is {a.shape} but b is {b.shape}; they must have the same shape")
    if a.dtype != b.dtype:
        raise TypeError(f"residual_forward: a is {a.dtype} but b is {b.dtype}; pass arrays of one dtype")
    return a + b, None


def residual_backward(dout, cache=None):
    """dout -> (da, db); both are dout (copies, so that updating one does not change the other)."""
    dout = np.asarray(dout)
    return dout.copy(), dout.copy()
