"""convert's contract: the checks of the conversion launchers' arguments (f32_to_bf16, bf16_to_f32, f32_to_f16) and of
nonfinite_count's, shared by kernels/numba/convert.py and gpullm_lessons/backends/hip/convert.py (check= a flavour of
gpullm_lessons.contracts.check_array: cupy=True for the HIP launchers)."""

from gpullm_lessons.contracts import check_array


def check_pair(fn, src, dst, src_dtypes, dst_dtypes, check=check_array):
    """src 1-D of one of src_dtypes, dst of src's shape and one of dst_dtypes, both C-contiguous; returns n.

    The first dtype of each tuple is the one the kernel takes; the others (float16, ml_dtypes' bfloat16) have the
    same 16 bits and are viewed as uint16. `check` is _args.check_array (cupy=True for the HIP wrappers)."""
    for name, a, dtypes in (("src", src, src_dtypes), ("dst", dst, dst_dtypes)):
        if not (hasattr(a, "shape") and hasattr(a, "dtype")):
            raise TypeError(
                f"{fn}: {name} must be an array (NumPy, CuPy or Numba device array), got {type(a).__name__}"
            )
        if str(a.dtype) not in dtypes:
            raise TypeError(f"{fn}: {name} has dtype {a.dtype}, expected {' or '.join(dtypes)}")
    if len(src.shape) != 1:
        raise ValueError(f"{fn}: src must be 1-D (n,), got shape {tuple(src.shape)}; flatten it first")
    n = int(src.shape[0])
    check(fn, "src", src, (n,), str(src.dtype))
    check(fn, "dst", dst, (n,), str(dst.dtype))
    return n


def check_count_args(fn, flat, out, check=check_array):
    """flat float32 1-D, out int32 (1,); errors name the argument."""
    if not (hasattr(flat, "shape") and hasattr(flat, "dtype")):
        raise TypeError(f"{fn}: flat must be an array (NumPy, CuPy or Numba device array), got {type(flat).__name__}")
    if len(flat.shape) != 1:
        raise ValueError(f"{fn}: flat must be 1-D (n,), got shape {tuple(flat.shape)}; use the flat gradient buffer")
    check(fn, "flat", flat, (int(flat.shape[0]),), "float32")
    check(fn, "out", out, (1,), "int32")
    return int(flat.shape[0])
