"""GELU, tanh approximation (as in GPT-2), elementwise.

Forward, with s = sqrt(2/pi) and u = s * (x + 0.044715 x^3):
    out = 0.5 x (1 + tanh(u))

Backward (product rule, tanh' = 1 - tanh^2, du/dx = s (1 + 3 * 0.044715 x^2)):
    dout/dx = 0.5 (1 + tanh(u)) + 0.5 x (1 - tanh(u)^2) * s (1 + 3 * 0.044715 x^2)
    dinp = dout * dout/dx
"""
import math

import numpy as np

from ._validate import _dout_shaped, _float_array

GELU_SCALE = math.sqrt(2.0 / math.pi)  # a python float: multiplying keeps float32 arrays float32
GELU_CUBE = 0.044715




def gelu_forward(inp):
    """inp (any shape) -> out (same shape), cache {inp}."""
    inp = _float_array("gelu_forward", "inp", inp)
    u = GELU_SCALE * (inp + GELU_CUBE * inp ** 3)
    out = 0.5 * inp * (1.0 + np.tanh(u))
    return out, {"inp": inp}


def gelu_backward(dout, cache):
    """dout (same shape as inp) -> dinp."""
    x = cache["inp"]
    dout = _dout_shaped("gelu_backward", dout, "inp", x.shape)
    u = GELU_SCALE * (x + GELU_CUBE * x ** 3)
    tanh_u = np.tanh(u)
    dudx = GELU_SCALE * (1.0 + 3.0 * GELU_CUBE * x ** 2)
    local = 0.5 * (1.0 + tanh_u) + 0.5 * x * (1.0 - tanh_u ** 2) * dudx   # d out / d inp
    return (dout * local).astype(x.dtype, copy=False)
