"""attention's contract: the checks of attention_backward's and the causal softmax launchers' arguments (shapes,
float32 or half bits, in place or apart) and the element formats of the half-precision paths, shared by
kernels/numba/attention.py and gpullm_lessons/backends/hip/attention.py (the Numba module's docstring has the math)."""

import numpy as np


FMT_F32, FMT_BF16, FMT_F16 = 0, 1, 2  # element formats (the kernels' mode arguments)
HALF_FORMATS = {"bf16": FMT_BF16, "fp16": FMT_F16}


def _shape(x):
    return tuple(int(n) for n in x.shape)


def check_attention_args(fn, dout, qkv, att, dqkv, n_head):
    """Shapes and dtypes of attention_backward's arguments; raises naming the argument. Returns (B, T, C, nh)."""
    if not isinstance(n_head, (int, np.integer)) or n_head < 1:
        raise ValueError(f"{fn}: n_head must be a positive int, got {n_head!r}")
    if len(_shape(qkv)) != 3 or _shape(qkv)[2] % 3:
        raise ValueError(f"{fn}: qkv must be (B, T, 3C), got {_shape(qkv)}")
    B, T, C3 = _shape(qkv)
    C = C3 // 3
    if C % n_head:
        raise ValueError(f"{fn}: C = {C} is not divisible by n_head = {n_head}")
    expected = {"dout": (B, T, C), "att": (B, n_head, T, T), "dqkv": (B, T, C3)}
    for name, arr in (("dout", dout), ("att", att), ("dqkv", dqkv)):
        if _shape(arr) != expected[name]:
            raise ValueError(
                f"{fn}: {name} is {_shape(arr)}, expected {expected[name]} (from qkv {(B, T, C3)}, n_head {n_head})"
            )
    for name, arr in (("dout", dout), ("qkv", qkv), ("att", att), ("dqkv", dqkv)):
        if np.dtype(arr.dtype) != np.float32:
            raise TypeError(f"{fn}: {name} must be float32, got {np.dtype(arr.dtype)}")
    return B, T, C, int(n_head)


def check_softmax_rows(fn, arrays, T=None):
    """(name, array) pairs: float32, 2-D (rows, T), all the same shape, rows a multiple of T. Returns (rows, T)."""
    return check_softmax_formats(fn, [(name, a, False) for name, a in arrays], None)[:2]


def half_format(fn, half):
    """half= as a format code: None -> FMT_F32, "bf16" -> FMT_BF16, "fp16" -> FMT_F16; ValueError otherwise."""
    if half is None:
        return FMT_F32
    if not isinstance(half, str) or half not in HALF_FORMATS:
        raise ValueError(
            f"{fn}: half={half!r} is not a half format; use half='bf16' or half='fp16' (or leave it None: float32 only)"
        )
    return HALF_FORMATS[half]


def check_softmax_formats(fn, arrays, half):
    """(name, array, may_be_half) triples, None arrays skipped: 2-D (rows, T), all the same shape, rows a multiple
    of T; dtype float32, or uint16 (half bits of format `half`) where may_be_half is True, only uint16 where it is
    "half". A uint16 array without half=, an unknown half name, or half= with no uint16 array is an error naming
    the argument.
    Returns (rows, T, {name: FMT_F32 | FMT_BF16 | FMT_F16}) for the arrays given."""
    hf = half_format(fn, half)
    shape, first, formats = None, None, {}
    for name, a, may_be_half in arrays:
        if a is None:
            continue
        if not (hasattr(a, "shape") and hasattr(a, "dtype")):
            raise TypeError(f"{fn}: {name} must be an array, got {type(a).__name__}")
        if len(_shape(a)) != 2:
            raise ValueError(f"{fn}: {name} must be 2-D (B*nh*T, T), got shape {_shape(a)}")
        dtype = np.dtype(a.dtype)
        if may_be_half == "half" and dtype != np.uint16:
            raise TypeError(f"{fn}: {name} must be uint16 (half bits, with half=), got {dtype}")
        if dtype == np.uint16 and may_be_half:
            if half is None:
                raise TypeError(
                    f"{fn}: {name} is uint16 (half bits) but half= is not given: say half='bf16' or half='fp16'"
                )
            formats[name] = hf
        elif dtype == np.float32:
            formats[name] = FMT_F32
        else:
            allowed = "float32 or uint16 (half bits, with half=)" if may_be_half else "float32"
            raise TypeError(f"{fn}: {name} must be {allowed}, got {dtype}")
        if shape is not None and _shape(a) != shape:
            raise ValueError(f"{fn}: {name} is {_shape(a)} but {first} is {shape}")
        shape, first = shape or _shape(a), first or name
    if half is not None and all(f == FMT_F32 for f in formats.values()):
        names = ", ".join(name for name, _, may_be_half in arrays if may_be_half)
        raise ValueError(f"{fn}: half={half!r} given but no half array ({names}) is uint16 half bits")
    rows, T = shape
    if T == 0 or rows % T:
        raise ValueError(f"{fn}: rows = {rows} must be a multiple of T = {T} (B*nh blocks of T query rows)")
    return rows, T, formats


def _is_uint16(a):
    return hasattr(a, "dtype") and np.dtype(a.dtype) == np.uint16


def _extent(a):
    """(address of a's first byte, address past its last byte), or None where the memory cannot be told."""
    if (type(a).__module__ or "").startswith("cupy"):
        ptr = int(a.data.ptr)
    else:
        iface = getattr(a, "__cuda_array_interface__", None) or getattr(a, "__array_interface__", None)
        if iface is None:
            return None
        ptr = int(iface["data"][0])
    shape, itemsize = _shape(a), np.dtype(a.dtype).itemsize
    if 0 in shape:
        return None
    strides = tuple(int(st) for st in a.strides) if getattr(a, "strides", None) else None
    if strides is None:
        return ptr, ptr + int(np.prod(shape)) * itemsize
    lo = ptr + sum((n - 1) * st for n, st in zip(shape, strides) if st < 0)
    hi = ptr + sum((n - 1) * st for n, st in zip(shape, strides) if st > 0) + itemsize
    return lo, hi


def check_in_place(fn, out_name, out, in_name, inp):
    """out may be inp itself (the same memory, shape, strides and dtype: in place) or memory apart from it; a partial
    overlap is a ValueError naming both (the kernels read each element before they write it, nothing more)."""
    a, b = _extent(out), _extent(inp)
    if a is None or b is None or a[1] <= b[0] or b[1] <= a[0]:
        return
    same = (
        a == b
        and _shape(out) == _shape(inp)
        and np.dtype(out.dtype) == np.dtype(inp.dtype)
        and tuple(getattr(out, "strides", ())) == tuple(getattr(inp, "strides", ()))
    )
    if not same:
        raise ValueError(
            f"{fn}: {out_name} overlaps {in_name} but is not the same array: write {out_name} in place "
            f"of {in_name} ({out_name} = {in_name}, the same buffer) or to memory apart from it"
        )


def check_softmax_forward_args(fn, pre, att, att_half, half):
    """attention_softmax_forward's arguments: pre float32, or uint16 half bits (format half) when att is None and
    att_half is given (half in, half out; att_half may then be pre, in place); att float32 or None; att_half uint16 or
    None (not both None). Returns (rows, T, att_half format or FMT_F32, pre format)."""
    if att is None and att_half is None:
        raise ValueError(
            f"{fn}: att and att_half are both None: give att (float32) and/or att_half (uint16 half "
            f"bits, with half='bf16' or 'fp16')"
        )
    if att_half is None and half is not None:
        half_format(fn, half)
        raise ValueError(f"{fn}: half={half!r} given but att_half is None: pass att_half (uint16) to write half bits")
    pre_half = _is_uint16(pre)
    if pre_half and att is not None:
        raise TypeError(
            f"{fn}: pre must be float32, got uint16: half-bit pre (half in, half out) needs att=None "
            f"and att_half= (uint16) with half='bf16' or 'fp16'"
        )
    rows, T, formats = check_softmax_formats(
        fn, (("pre", pre, pre_half), ("att", att, False), ("att_half", att_half, "half")), half
    )
    if pre_half:
        check_in_place(fn, "att_half", att_half, "pre", pre)
    return rows, T, formats.get("att_half", FMT_F32), formats["pre"]


def check_softmax_backward_args(fn, att, datt, dpre, half):
    """attention_softmax_backward's arguments: att and dpre float32 or uint16 half bits (format half); datt float32,
    or uint16 half bits when att and dpre are half bits too (all one format; dpre may then be datt, in place).
    Returns (rows, T, att format, dpre format, datt format)."""
    datt_half = _is_uint16(datt)
    rows, T, formats = check_softmax_formats(
        fn, (("att", att, True), ("datt", datt, datt_half), ("dpre", dpre, True)), half
    )
    if datt_half:
        f32 = [name for name in ("att", "dpre") if formats[name] == FMT_F32]
        if f32:
            raise TypeError(
                f"{fn}: datt must be float32, got uint16: half-bit datt needs att and dpre as uint16 half "
                f"bits of the same format too, but {' and '.join(f32)} {'is' if len(f32) == 1 else 'are'}"
                f" float32"
            )
        check_in_place(fn, "dpre", dpre, "datt", datt)
    return rows, T, formats["att"], formats["dpre"], formats["datt"]
