"""Linear (fully connected) layer, weight stored (in, out) = (C, OC).

Forward
    out = inp @ weight + bias            inp (..., C), weight (C, OC), bias (OC,)  ->  out (..., OC)
    Component form, one row n of the flattened input (N = all leading dims):
    out[n, o] = sum_c inp[n, c] weight[c, o] + bias[o]

Backward (chain rule, L the loss, dout = dL/dout)
    dinp[n, c]    = sum_o dout[n, o] weight[c, o]   ->  dinp    = dout @ weight.T     (..., C)
    dweight[c, o] = sum_n inp[n, c] dout[n, o]      ->  dweight = inp.T @ dout        (C, OC)  (rows flattened)
    dbias[o]      = sum_n dout[n, o]                ->  dbias   = dout.sum(rows)      (OC,)
    A shape check remembers these: each gradient has the shape of its input, and there is one way to
    multiply the available matrices to get it.

Every matmul passes its inputs through rounding.mm_round: they are unchanged by default (fp32), rounded to
bf16/fp16 inside `with matmul_precision(...)` (rounding.py; also precision.matmul_precision) (half inputs, fp32 accumulation, as a GPU GEMM).
"""
import numpy as np

from .rounding import mm_round
from ._validate import _float_array


def linear_forward(inp, weight, bias=None):
    """out = inp @ weight + bias.  inp (..., C), weight (C, OC), bias (OC,) or None -> out (..., OC), cache."""
    inp = _float_array("linear_forward", "inp", inp)
    weight = _float_array("linear_forward", "weight", weight)
    if weight.ndim != 2:
        raise ValueError(f"linear_forward: weight must be 2-D (C, OC), got shape {weight.shape}")
    if inp.ndim < 1 or inp.shape[-1] != weight.shape[0]:
        C = inp.shape[-1] if inp.ndim else "?"
        raise ValueError(f"linear_forward: inp has C={C} channels but weight is {weight.shape}; "
                         f"weight must be (C, OC)")
    if weight.dtype != inp.dtype:
        raise TypeError(f"linear_forward: inp is {inp.dtype} but weight is {weight.dtype}; "
                        f"pass arrays of one dtype")
    OC = weight.shape[1]
    if bias is not None:
        bias = _float_array("linear_forward", "bias", bias)
        if bias.shape != (OC,):
            raise ValueError(f"linear_forward: bias is {bias.shape} but weight is {weight.shape}; "
                             f"bias must be (OC,) = ({OC},)")
        if bias.dtype != inp.dtype:
            raise TypeError(f"linear_forward: inp is {inp.dtype} but bias is {bias.dtype}; "
                            f"pass arrays of one dtype")

    out = mm_round(inp) @ mm_round(weight)            # (..., C) @ (C, OC) -> (..., OC)
    if bias is not None:
        out = out + bias                                # (OC,) broadcasts over the rows
    cache = {"inp": inp, "weight": weight, "has_bias": bias is not None}
    return out, cache


def linear_backward(dout, cache):
    """dout (..., OC) -> (dinp (..., C), dweight (C, OC), dbias (OC,) or None)."""
    inp, weight = cache["inp"], cache["weight"]
    C, OC = weight.shape
    dout = np.asarray(dout)
    if dout.shape != inp.shape[:-1] + (OC,):
        raise ValueError(f"linear_backward: dout is {dout.shape} but out was {inp.shape[:-1] + (OC,)}")
    dout = dout.astype(inp.dtype, copy=False)
    dout_m = mm_round(dout)                            # the matmuls' view of dout (itself in fp32)
    dinp = dout_m @ mm_round(weight).T                 # (..., OC) @ (OC, C) -> (..., C)
    inp2 = mm_round(inp).reshape(-1, C)                # (N, C)
    dweight = inp2.T @ dout_m.reshape(-1, OC)           # (C, N) @ (N, OC) -> (C, OC)
    dbias = dout.reshape(-1, OC).sum(axis=0) if cache["has_bias"] else None  # (OC,) a reduction: not rounded
    return dinp, dweight, dbias
