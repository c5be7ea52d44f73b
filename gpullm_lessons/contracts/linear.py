"""linear's contract: the checks of linear_backward's arguments (shapes, dtypes, version), shared by
kernels/numba/linear.py and gpullm_lessons/backends/hip/linear.py (which passes its own versions and xp="cupy")."""

import numpy as np

from gpullm_lessons.contracts import shape_of as _shape_of

VERSIONS = ("v1", "v2", "v3")  # the GEMM kernels both backends have (the HIP launcher adds "cublas")


def validate(dout, inp, weight, dinp, dweight, dbias, version, fn="linear_backward", versions=VERSIONS, xp="np"):
    """Shapes, dtypes and version; raises ValueError / TypeError naming the argument. Returns (N, C, OC).

    versions: what version= accepts; xp: the array module named in hints ("cupy" from the HIP wrapper)."""
    if version not in versions:
        raise ValueError(f"{fn}: unknown version={version!r}; use one of {', '.join(repr(v) for v in versions)}")
    args = {"dout": dout, "inp": inp, "weight": weight, "dinp": dinp, "dweight": dweight, "dbias": dbias}
    for name, x in args.items():
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{fn}: {name} must be an array, got {type(x).__name__}")
        if np.dtype(x.dtype) != np.float32:
            raise TypeError(
                f"{fn}: {name} must be float32, got dtype {np.dtype(x.dtype)} (these kernels compute in "
                f"float32; convert with .astype({xp}.float32))"
            )
    for name in ("dout", "inp", "weight"):
        if len(args[name].shape) != 2:
            raise ValueError(f"{fn}: {name} must be 2-D, got shape {_shape_of(args[name])} (flatten the rows: N = B*T)")
    N, OC = _shape_of(dout)
    C = _shape_of(inp)[1]
    expected = {"inp": (N, C), "weight": (C, OC), "dinp": (N, C), "dweight": (C, OC), "dbias": (OC,)}
    for name, shape in expected.items():
        if _shape_of(args[name]) != shape:
            raise ValueError(
                f"{fn}: {name} has shape {_shape_of(args[name])}, expected {shape} "
                f"(from dout (N, OC) = {(N, OC)} and inp (N, C) = {(N, C)}; weight is stored (C, OC))"
            )
    return N, C, OC
