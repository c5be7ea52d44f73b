"""flash attention's contract: the arguments of flash_attention_forward / flash_attention_backward, shared by
kernels/numba/flash.py and gpullm_lessons/backends/hip/flash.py (the Numba module's docstring has the math).

Layout: q, k, v, out, dout, dq, dk, dv are (B, nh, T, hs), one head's rows contiguous; lse and delta are (B, nh, T).
The scale is 1/sqrt(hs) and the mask causal (query t sees keys s <= t), as in reference.attention_forward.
"""

import numpy as np

from . import check_array, shape_of

HS_MAX = 128  # the largest head size the kernels hold in registers (one row of q and of the running output)


def _check_4d(fn, name, a):
    if not (hasattr(a, "shape") and hasattr(a, "dtype")):
        raise TypeError(f"{fn}: {name} must be an array (B, nh, T, hs), got {type(a).__name__}")
    shape = shape_of(a)
    if len(shape) != 4:
        raise ValueError(f"{fn}: {name} must be 4-D (B, nh, T, hs), got shape {shape}")
    return shape


def check_flash_args(fn, heads, rows, cupy=False, dtypes=("float32",), outs=()):
    """heads: (name, array) pairs of shape (B, nh, T, hs), all one shape, dtype in `dtypes` (all the same);
    rows: (name, array) pairs of shape (B, nh, T), float32; outs: (name, array) pairs of the heads' shape, float32
    whatever the heads' dtype (the HIP launchers' bf16 inputs: q, k, v, dout uint16 bf16 bits, out, dq, dk, dv
    float32). Raises naming the argument. Returns (B, nh, T, hs)."""
    B, nh, T, hs = _check_4d(fn, heads[0][0], heads[0][1])
    if hs < 1 or hs > HS_MAX:
        raise ValueError(
            f"{fn}: head size hs = {hs} is not supported: the kernels hold a row of hs floats per "
            f"thread, 1 <= hs <= {HS_MAX}"
        )
    dtype = str(heads[0][1].dtype)
    if dtype not in dtypes:
        raise TypeError(f"{fn}: {heads[0][0]} must be {' or '.join(dtypes)}, got {dtype}")
    for name, a in heads:
        _check_4d(fn, name, a)
        check_array(fn, name, a, (B, nh, T, hs), dtype, cupy=cupy)
    for name, a in outs:
        _check_4d(fn, name, a)
        check_array(fn, name, a, (B, nh, T, hs), "float32", cupy=cupy)
    for name, a in rows:
        check_array(fn, name, a, (B, nh, T), "float32", cupy=cupy)
    return B, nh, T, hs


def scale_of(hs) -> np.float32:
    """The softmax scale 1/sqrt(hs), as the kernels' float32 argument."""
    return np.float32(1.0 / np.sqrt(hs))
