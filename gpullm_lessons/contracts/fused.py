"""fused's contract: the checks of the engine's glue launchers' arguments (bias_add, bias_gelu_forward, split_heads,
merge_heads, colsum_convert, layernorm_forward_half) and their half-output modes, shared by kernels/numba/fused.py and
gpullm_lessons/backends/hip/fused.py (check= a flavour of gpullm_lessons.contracts.check_array: cupy=True there)."""

import numpy as np

from gpullm_lessons.contracts import check_array

HALF_MODES = {None: 0, "bf16": 1, "fp16": 2}  # the kernels' `mode` argument


def _array(fn, name, a, ndim, what):
    """An array object with `ndim` dimensions (what: its shape in words, for the message)."""
    if not (hasattr(a, "shape") and hasattr(a, "dtype")):
        raise TypeError(f"{fn}: {name} must be an array (NumPy, CuPy or Numba device array), got {type(a).__name__}")
    if len(a.shape) != ndim:
        raise ValueError(f"{fn}: {name} must be {ndim}-D {what}, got shape {tuple(a.shape)}")
    return tuple(int(s) for s in a.shape)


def half_mode(fn, half, out, name="out"):
    """(mode, dtype out must have) for half in None / 'bf16' / 'fp16'; clear errors for a mismatch with out."""
    if not (isinstance(half, str) or half is None) or half not in HALF_MODES:
        raise ValueError(f"{fn}: half={half!r} is not one of None (float32 output), 'bf16', 'fp16'")
    dtype = str(getattr(out, "dtype", ""))
    if half is None and dtype == "uint16":
        raise ValueError(f"{fn}: {name} is uint16 (16-bit bits) but half=None: pass half='bf16' or half='fp16'")
    if half is not None and dtype == "float32":
        raise ValueError(
            f"{fn}: half={half!r} writes 16-bit bits: {name} must be uint16, got float32 (or pass half=None)"
        )
    return HALF_MODES[half], ("float32" if half is None else "uint16")


def _int(fn, name, v, low):
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{fn}: {name} must be an int, got {type(v).__name__}")
    if int(v) < low:
        raise ValueError(f"{fn}: {name}={int(v)} must be >= {low}")
    return int(v)


def check_bias_add(fn, inp, bias, out, res, check=check_array):
    N, C = _array(fn, "inp", inp, 2, "(N, C)")
    check(fn, "inp", inp, (N, C), "float32")
    check(fn, "bias", bias, (C,), "float32")
    if res is not None:
        check(fn, "res", res, (N, C), "float32")
    check(fn, "out", out, (N, C), "float32")
    return N, C


def check_bias_gelu(fn, inp, bias, pre, out, half, check=check_array):
    """pre may be None (not written), float32, or uint16 with half (GELU's input kept as half bits of half's format:
    the _hpre kernels). Returns (N, C, mode)."""
    mode, odt = half_mode(fn, half, out)
    N, C = _array(fn, "inp", inp, 2, "(N, C)")
    check(fn, "inp", inp, (N, C), "float32")
    check(fn, "bias", bias, (C,), "float32")
    if pre is not None:
        if half_pre(pre) and half is None:
            raise ValueError(
                f"{fn}: pre is uint16 (GELU's input as half bits) but half=None: a half pre needs half='bf16' or "
                "'fp16' (the format of both pre and out)"
            )
        check(fn, "pre", pre, (N, C), "uint16" if half_pre(pre) else "float32")
    check(fn, "out", out, (N, C), odt)
    return N, C, mode


def half_pre(pre) -> bool:
    """True when bias_gelu_forward's pre / colsum_convert's gelu_of holds half bits (uint16), not float32."""
    return pre is not None and str(getattr(pre, "dtype", "")) == "uint16"


def check_gelu_half(fn, inp, out, half, check=check_array):
    """gelu_half: inp and out (N, C) uint16, half bits of half ('bf16' / 'fp16'). Returns (N, C, mode)."""
    if half not in ("bf16", "fp16"):
        raise ValueError(f"{fn}: half={half!r} must be 'bf16' or 'fp16' (inp and out are half bits of that format)")
    mode, _ = half_mode(fn, half, out)
    N, C = _array(fn, "inp", inp, 2, "(N, C)")
    check(fn, "inp", inp, (N, C), "uint16")
    check(fn, "out", out, (N, C), "uint16")
    return N, C, mode


def _check_heads(fn, col0, B, T, nh, hs, ld):
    C = nh * hs
    if col0 + C > ld:
        raise ValueError(
            f"{fn}: col0 + C = {col0} + {C} = {col0 + C} is past the row width ld = {ld} (C = nh*hs = {nh}*{hs})"
        )


def check_split(fn, inp, col0, out, B, T, nh, bias, half, check=check_array):
    """Returns (N, ld, hs, mode)."""
    B, T, nh, col0 = _int(fn, "B", B, 0), _int(fn, "T", T, 1), _int(fn, "nh", nh, 1), _int(fn, "col0", col0, 0)
    mode, odt = half_mode(fn, half, out)
    _, ld = _array(fn, "inp", inp, 2, "(B*T, ld)")
    hs = _array(fn, "out", out, 3, "(B*nh, T, hs)")[2]
    check(fn, "inp", inp, (B * T, ld), "float32")
    check(fn, "out", out, (B * nh, T, hs), odt)
    if bias is not None:
        check(fn, "bias", bias, (nh * hs,), "float32")
    _check_heads(fn, col0, B, T, nh, hs, ld)
    return B * T, ld, hs, mode


def check_merge(fn, inp, out, col0, B, T, nh, half, check=check_array):
    """Returns (N, ld, hs, mode)."""
    B, T, nh, col0 = _int(fn, "B", B, 0), _int(fn, "T", T, 1), _int(fn, "nh", nh, 1), _int(fn, "col0", col0, 0)
    mode, odt = half_mode(fn, half, out)
    hs = _array(fn, "inp", inp, 3, "(B*nh, T, hs)")[2]
    _, ld = _array(fn, "out", out, 2, "(B*T, ld)")
    check(fn, "inp", inp, (B * nh, T, hs), "float32")
    check(fn, "out", out, (B * T, ld), odt)
    _check_heads(fn, col0, B, T, nh, hs, ld)
    return B * T, ld, hs, mode


def check_colsum(fn, inp, colsum, out, half, check=check_array, gelu_of=None, gelu_bias=None):
    """Returns (N, C, mode); mode 0 when out is None. GELU's input is gelu_of (N, C) + gelu_bias (C,), float32, given
    together, or gelu_of alone as uint16, the half bits of GELU's input with its bias in (bias_gelu_forward's half
    pre), in half's format; they need out. inp is float32, or uint16 (half bits of half's format) with a uint16
    gelu_of: GELU's output gradient as its product rounded it."""
    if half_pre(gelu_of):
        if gelu_bias is not None:
            raise ValueError(
                f"{fn}: gelu_of is uint16 (GELU's input as half bits, its bias already in): leave gelu_bias=None"
            )
    elif (gelu_of is None) != (gelu_bias is None):
        raise ValueError(f"{fn}: give gelu_of and gelu_bias together (GELU's input is gelu_of + gelu_bias[col])")
    if gelu_of is not None and out is None:
        raise ValueError(
            f"{fn}: gelu_of is given but out is None: the fused GELU backward writes dfc only as the half copy "
            "(give out and half; in float32 run gelu_backward, then colsum_convert)"
        )
    if out is None:
        if half is not None:
            raise ValueError(
                f"{fn}: half={half!r} but out is None: give out (N, C) uint16 for the converted copy, "
                f"or leave half=None"
            )
        mode = 0
    else:
        if half is None:
            raise ValueError(f"{fn}: out is given: pass half='bf16' or half='fp16' (the format of its bits)")
        mode, _ = half_mode(fn, half, out)
    N, C = _array(fn, "inp", inp, 2, "(N, C)")
    if str(getattr(inp, "dtype", "")) == "uint16":  # half inp: only as GELU's output gradient beside a half pre
        if not half_pre(gelu_of):
            raise ValueError(
                f"{fn}: inp is uint16 (half bits): it is read only as GELU's output gradient, with gelu_of uint16 "
                "(GELU's input as half bits) and out; otherwise give inp float32"
            )
        check(fn, "inp", inp, (N, C), "uint16")
    else:
        check(fn, "inp", inp, (N, C), "float32")
    check(fn, "colsum", colsum, (C,), "float32")
    if out is not None:
        check(fn, "out", out, (N, C), "uint16")
    if half_pre(gelu_of):
        check(fn, "gelu_of", gelu_of, (N, C), "uint16")
    elif gelu_of is not None:
        check(fn, "gelu_of", gelu_of, (N, C), "float32")
        check(fn, "gelu_bias", gelu_bias, (C,), "float32")
    return N, C, mode


def check_layernorm_half(fn, inp, weight, bias, out, mean, rstd, half, check=check_array):
    """Returns (N, C, mode)."""
    if half is None or half not in ("bf16", "fp16"):
        raise ValueError(f"{fn}: half={half!r} must be 'bf16' or 'fp16' (float32 output: layernorm_forward)")
    mode, _ = half_mode(fn, half, out)
    N, C = _array(fn, "inp", inp, 2, "(N, C)")
    check(fn, "inp", inp, (N, C), "float32")
    check(fn, "weight", weight, (C,), "float32")
    check(fn, "bias", bias, (C,), "float32")
    check(fn, "out", out, (N, C), "uint16")
    check(fn, "mean", mean, (N,), "float32")
    check(fn, "rstd", rstd, (N,), "float32")
    return N, C, mode
