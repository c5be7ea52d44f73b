"""Launch wrapper for kernels/hip/encoder.cu (CuPy arrays; NVIDIA through NVRTC, AMD through hiprtc).

Same name, signature and versions as kernels/numba/encoder.py (its docstring explains them):
    encoder_backward(dout (B,T,C), idx (B,T) int32, dwte (V,C), dwpe (maxT,C), version="v2")
v1: zero, then atomicAdd per (b, t, c) (not deterministic). v2: host-side bucketing of positions by token, then
one thread per (v, c) / (t, c) summing in a fixed order (deterministic, no atomics).
"""
from __future__ import annotations

import numpy as np

VERSIONS = ("v1", "v2")
MAX_THREADS = 1024


def _check_array(name, a, shape, dtype):
    """ValueError/TypeError naming the argument, the shape/dtype it has and the one expected."""
    if not (type(a).__module__ or "").startswith("cupy"):
        raise TypeError(f"encoder_backward: {name} must be a CuPy array (the HIP kernels run on the GPU), "
                        f"got {type(a).__module__}.{type(a).__name__}")
    if tuple(a.shape) != tuple(shape):
        raise ValueError(f"encoder_backward: {name} has shape {tuple(a.shape)}, expected {tuple(shape)}")
    if str(a.dtype) != dtype:
        raise TypeError(f"encoder_backward: {name} has dtype {a.dtype}, expected {dtype}")
    if not a.flags.c_contiguous:
        raise ValueError(f"encoder_backward: {name} must be C-contiguous (cupy.ascontiguousarray)")


def _check_inputs(dout, idx, dwte, dwpe):
    if not hasattr(dout, "shape") or len(dout.shape) != 3:
        raise ValueError(f"encoder_backward: dout must be 3-D (B, T, C), got shape {getattr(dout, 'shape', None)}")
    B, T, C = dout.shape
    for name, a in (("dwte", dwte), ("dwpe", dwpe)):
        if not hasattr(a, "shape") or len(a.shape) != 2:
            raise ValueError(f"encoder_backward: {name} must be 2-D, got shape {getattr(a, 'shape', None)}")
    V, maxT = dwte.shape[0], dwpe.shape[0]
    _check_array("dout", dout, (B, T, C), "float32")
    _check_array("idx", idx, (B, T), "int32")
    _check_array("dwte", dwte, (V, C), "float32")
    _check_array("dwpe", dwpe, (maxT, C), "float32")
    if maxT < T:
        raise ValueError(f"encoder_backward: dwpe has shape {tuple(dwpe.shape)}: it needs maxT >= T = {T} rows")
    return B, T, C, V, maxT


def _token_buckets(idx_host, V):
    """(order (B*T,) int32, starts (V + 1,) int32): token v's positions, increasing, are order[starts[v]:starts[v+1]]."""
    flat = np.asarray(idx_host).ravel()
    if flat.size and (flat.min() < 0 or flat.max() >= V):
        raise ValueError(f"encoder_backward: idx must be in [0, V={V}), got min {flat.min()}, max {flat.max()}")
    order = np.argsort(flat, kind="stable").astype(np.int32)
    starts = np.zeros(V + 1, np.int32)
    starts[1:] = np.cumsum(np.bincount(flat, minlength=V))
    return order, starts


def encoder_backward(dout, idx, dwte, dwpe, version="v2", threads=256):
    """dwte = 0, dwpe = 0, then dwte[idx[b, t]] += dout[b, t] and dwpe[t] += dout[b, t] for every (b, t).
    v1 does not check that idx is in [0, V) (that would need a copy to the host); v2 does."""
    B, T, C, V, maxT = _check_inputs(dout, idx, dwte, dwpe)
    if version not in VERSIONS:
        raise ValueError(f"encoder_backward: version={version!r}, expected one of {', '.join(VERSIONS)}")
    if not 1 <= threads <= MAX_THREADS:
        raise ValueError(f"encoder_backward: threads={threads}, expected 1..{MAX_THREADS}")
    import cupy  # lazy: an optional extra
    from gpullm_lessons import hip

    def blocks(n):
        return (max((n + threads - 1) // threads, 1),)

    if version == "v1":
        zero = hip.kernel("encoder", "encoder_backward_v1_zero")
        zero(blocks(V * C), (threads,), (dwte, np.int64(V * C)))
        zero(blocks(maxT * C), (threads,), (dwpe, np.int64(maxT * C)))
        if B * T * C:
            hip.kernel("encoder", "encoder_backward_v1")(blocks(B * T * C), (threads,),
                                                         (dout, idx, dwte, dwpe, np.int32(B), np.int32(T), np.int32(C)))
    else:
        order, starts = (cupy.asarray(a) for a in _token_buckets(idx.get(), V))
        hip.kernel("encoder", "encoder_backward_v2")(blocks(V * C), (threads,),
                                                     (dout, order, starts, dwte, np.int32(V), np.int32(C)))
        hip.kernel("encoder", "encoder_backward_v2_dwpe")(blocks(maxT * C), (threads,),
                                                          (dout, dwpe, np.int32(B), np.int32(T), np.int32(maxT),
                                                           np.int32(C)))
    return dwte, dwpe
