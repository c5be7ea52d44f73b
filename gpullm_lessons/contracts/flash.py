"""flash attention's contract: the arguments of flash_attention_forward / flash_attention_backward, shared by
kernels/numba/flash.py and gpullm_lessons/backends/hip/flash.py (the Numba module's docstring has the math).

Layout: q, k, v, out, dout, dq, dk, dv are (B, nh, T, hs), one head's rows contiguous; lse and delta are (B, nh, T).
The scale is 1/sqrt(hs) and the mask causal (query t sees keys s <= t), as in reference.attention_forward.

The general form (check_flash_qk_args, check_attention_mask; reference.sdpa_forward is its oracle; the Numba
launchers and the HIP launchers' version "v3" run it): q, out, dout, dq
are (B, nh, Tq, hs), k, v, dk, dv (B, nh, Tk, hs), lse and delta (B, nh, Tq). causal (a bool, default True) means
query t sees keys s <= t + (Tk - Tq) (bottom-right aligned, causal_offset; causal with Tk < Tq is refused); mask is
None or a (Tq, Tk) array, uint8 (nonzero = allowed) or bool, C-contiguous, the same for every batch and head, ANDed
with causal. A query that sees no key gets out = 0 and lse = -inf, and no gradient flows through it.
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


def check_flash_qk_args(fn, queries, keys, rows, cupy=False, dtypes=("float32",), q_outs=(), k_outs=()):
    """The general form's arrays, Tq queries and Tk keys. queries: (name, array) pairs (B, nh, Tq, hs), q first;
    keys: (name, array) pairs (B, nh, Tk, hs), k first; all of them one dtype in `dtypes`; rows: (name, array) pairs
    (B, nh, Tq) float32 (lse); q_outs / k_outs: (name, array) pairs of the queries' / the keys' shape, float32 whatever
    the inputs' dtype (out, dq / dk, dv where the inputs are bf16 bits). Raises naming the argument. Returns
    (B, nh, Tq, Tk, hs)."""
    B, nh, Tq, hs = check_flash_args(fn, queries, rows, cupy=cupy, dtypes=dtypes, outs=q_outs)
    kname, k = keys[0]
    shape = _check_4d(fn, kname, k)
    Tk = shape[2]
    if shape != (B, nh, Tk, hs):
        raise ValueError(
            f"{fn}: {kname} has shape {shape}, expected (B, nh, Tk, hs) with {queries[0][0]}'s B={B}, "
            f"nh={nh} and hs={hs}"
        )
    if Tk < 1:
        raise ValueError(f"{fn}: {kname} has no keys (Tk = 0): every query would see nothing")
    dtype = str(queries[0][1].dtype)
    for (name, a), dt in [(pair, dtype) for pair in keys] + [(pair, "float32") for pair in k_outs]:
        if _check_4d(fn, name, a) != (B, nh, Tk, hs):
            raise ValueError(
                f"{fn}: {name} has shape {shape_of(a)}, expected {(B, nh, Tk, hs)}, the shape of "
                f"{kname} (Tk = {Tk} keys)"
            )
        check_array(fn, name, a, (B, nh, Tk, hs), dt, cupy=cupy)
    return B, nh, Tq, Tk, hs


def check_attention_mask(fn, causal, mask, Tq, Tk, cupy=False) -> bool:
    """causal: True or False; causal with Tk < Tq is refused (bottom-right alignment would leave the first Tq - Tk
    queries with no key). mask: None or a (Tq, Tk) C-contiguous array, uint8 (nonzero = allowed) or bool (a CuPy
    array with cupy=True). Raises TypeError / ValueError naming the argument. Returns whether there is a mask."""
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"{fn}: causal must be True or False, got {causal!r}")
    if causal and Tk < Tq:
        raise ValueError(
            f"{fn}: causal with fewer keys than queries (Tk={Tk} < Tq={Tq}): bottom-right alignment (query t sees keys "
            f"s <= t + Tk - Tq) would leave the first {Tq - Tk} queries with no key. Swapped q and k? For that "
            f"pattern, pass causal=False and a mask"
        )
    if mask is None:
        return False
    if not (hasattr(mask, "shape") and hasattr(mask, "dtype")):
        raise TypeError(
            f"{fn}: mask must be a (Tq, Tk) = ({Tq}, {Tk}) uint8 or bool array or None, got {type(mask).__name__}"
        )
    if str(mask.dtype) not in ("uint8", "bool"):
        raise TypeError(f"{fn}: mask has dtype {mask.dtype}, expected uint8 (nonzero = allowed) or bool")
    check_array(fn, "mask", mask, (Tq, Tk), str(mask.dtype), cupy=cupy)
    return True


def causal_offset(Tq, Tk) -> int:
    """Tk - Tq: with causal, query t sees the keys s <= t + causal_offset(Tq, Tk) (bottom-right aligned)."""
    return int(Tk) - int(Tq)
