"""LayerNorm over the last axis (channels C).

Forward, per row (one (b, t) position), with mean m, variance v and rstd = 1/sqrt(v + eps):
    xhat = (x - m) * rstd                 (C,)   the normalized row
    out  = xhat * weight + bias           (C,)

Backward, dout = dL/dout, g = dout * weight = dL/dxhat:
    dbias   = sum over rows of dout
    dweight = sum over rows of dout * xhat
    dxhat_i/dx_j = rstd * (delta_ij - 1/C - xhat_i xhat_j / C)  (differentiating m and rstd too), so
    dinp = rstd * (g - mean(g) - xhat * mean(g * xhat))      means over the C channels of the row.
    The mean(g) term comes from m depending on every x_j, the xhat*mean(g*xhat) term from rstd.
"""
import numpy as np

from ._validate import _float_array


def layernorm_stats(inp, eps=1e-5):
    """Per-row statistics: (mean (...,), rstd (...,)) over the last axis, in inp's dtype."""
    inp = _float_array("layernorm_stats", "inp", inp)
    mean = inp.mean(axis=-1)                            # (...,)
    var = ((inp - mean[..., None]) ** 2).mean(axis=-1)  # (...,) biased variance, as in PyTorch
    rstd = 1.0 / np.sqrt(var + float(eps))              # (...,) python float eps keeps the dtype
    return mean, rstd


def layernorm_forward(inp, weight, bias, eps=1e-5):
    """inp (..., C), weight (C,), bias (C,) -> out (..., C), cache {inp, weight, mean, rstd}."""
    inp = _float_array("layernorm_forward", "inp", inp)
    weight = _float_array("layernorm_forward", "weight", weight)
    bias = _float_array("layernorm_forward", "bias", bias)
    if inp.ndim < 1:
        raise ValueError("layernorm_forward: inp must have a channel axis (..., C)")
    C = inp.shape[-1]
    if weight.shape != (C,) or bias.shape != (C,):
        raise ValueError(f"layernorm_forward: inp has C={C} channels but weight is {weight.shape} and bias is "
                         f"{bias.shape}; both must be (C,)")
    if weight.dtype != inp.dtype or bias.dtype != inp.dtype:
        raise TypeError(f"layernorm_forward: inp is {inp.dtype} but weight is {weight.dtype} and bias is "
                        f"{bias.dtype}; pass arrays of one dtype")

    mean, rstd = layernorm_stats(inp, eps)              # (...,), (...,)
    xhat = (inp - mean[..., None]) * rstd[..., None]    # (..., C)
    out = xhat * weight + bias                          # (..., C)
    cache = {"inp": inp, "weight": weight, "mean": mean, "rstd": rstd}
    return out, cache


def layernorm_backward(dout, cache):
    """dout (..., C) -> (dinp (..., C), dweight (C,), dbias (C,))."""
    inp, weight, mean, rstd = cache["inp"], cache["weight"], cache["mean"], cache["rstd"]
    dout = np.asarray(dout)
    if dout.shape != inp.shape:
        raise ValueError(f"layernorm_backward: dout is {dout.shape} but inp was {inp.shape}")
    dout = dout.astype(inp.dtype, copy=False)
    C = inp.shape[-1]
    xhat = (inp - mean[..., None]) * rstd[..., None]    # (..., C) recomputed, cheaper than caching it
    dout2, xhat2 = dout.reshape(-1, C), xhat.reshape(-1, C)
    dbias = dout2.sum(axis=0)                           # (C,)
    dweight = (dout2 * xhat2).sum(axis=0)               # (C,)
    g = dout * weight                                   # (..., C) dL/dxhat
    dinp = rstd[..., None] * (g - g.mean(axis=-1, keepdims=True)
                              - xhat * (g * xhat).mean(axis=-1, keepdims=True))  # (..., C)
    return dinp, dweight, dbias
