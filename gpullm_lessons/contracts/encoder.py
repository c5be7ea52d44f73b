"""encoder's contract: the checks of encoder_backward's arguments and v2's host-side bucketing of positions by token
(NumPy), shared by kernels/numba/encoder.py and gpullm_lessons/backends/hip/encoder.py (cupy=True: CuPy arrays only)."""

import numpy as np

from gpullm_lessons.contracts import check_array


def check_inputs(dout, idx, dwte, dwpe, cupy=False):
    """Validate shapes and dtypes; returns (B, T, C, V, maxT). cupy=True: CuPy arrays only (the HIP wrapper)."""
    if not hasattr(dout, "shape") or len(dout.shape) != 3:
        raise ValueError(f"encoder_backward: dout must be 3-D (B, T, C), got shape {getattr(dout, 'shape', None)}")
    B, T, C = dout.shape
    for name, a in (("dwte", dwte), ("dwpe", dwpe)):
        if not hasattr(a, "shape") or len(a.shape) != 2:
            raise ValueError(f"encoder_backward: {name} must be 2-D, got shape {getattr(a, 'shape', None)}")
    V, maxT = dwte.shape[0], dwpe.shape[0]
    check_array("encoder_backward", "dout", dout, (B, T, C), "float32", cupy=cupy)
    check_array("encoder_backward", "idx", idx, (B, T), "int32", cupy=cupy)
    check_array("encoder_backward", "dwte", dwte, (V, C), "float32", cupy=cupy)
    check_array("encoder_backward", "dwpe", dwpe, (maxT, C), "float32", cupy=cupy)
    if maxT < T:
        raise ValueError(f"encoder_backward: dwpe has shape {tuple(dwpe.shape)}: it needs maxT >= T = {T} rows")
    return B, T, C, V, maxT


def token_buckets(idx_host, V):
    """Host-side bucketing for v2: (order (B*T,) int32, starts (V + 1,) int32); token v's positions, in
    increasing order, are order[starts[v]:starts[v + 1]]. Raises ValueError for a token outside [0, V)."""
    flat = np.asarray(idx_host).ravel()
    if flat.size and (flat.min() < 0 or flat.max() >= V):
        raise ValueError(f"encoder_backward: idx must be in [0, V={V}), got min {flat.min()}, max {flat.max()}")
    order = np.argsort(flat, kind="stable").astype(np.int32)  # positions grouped by token
    starts = np.zeros(V + 1, np.int32)
    starts[1:] = np.cumsum(np.bincount(flat, minlength=V))  # bucket bounds
    return order, starts
