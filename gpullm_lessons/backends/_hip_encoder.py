"""Launch wrapper for kernels/hip/encoder.cu (CuPy arrays; NVIDIA through NVRTC, AMD through hiprtc).

Same name, signature and versions as kernels/numba/encoder.py (its docstring explains them):
    encoder_backward(dout (B,T,C), idx (B,T) int32, dwte (V,C), dwpe (maxT,C), version="v2")
v1: zero, then atomicAdd per (b, t, c) (not deterministic). v2: host-side bucketing of positions by token, then
one thread per (v, c) / (t, c) summing in a fixed order (deterministic, no atomics).
"""
from __future__ import annotations

import numpy as np

# the shape/dtype checks and v2's host-side bucketing are the Numba wrapper's (cupy=True: CuPy arrays only)
from ..kernels.numba.encoder import check_inputs
from ..kernels.numba.encoder import token_buckets as _token_buckets

VERSIONS = ("v1", "v2")
MAX_THREADS = 1024


def encoder_backward(dout, idx, dwte, dwpe, version="v2", threads=256):
    """dwte = 0, dwpe = 0, then dwte[idx[b, t]] += dout[b, t] and dwpe[t] += dout[b, t] for every (b, t).
    v1 does not check that idx is in [0, V) (that would need a copy to the host); v2 does."""
    B, T, C, V, maxT = check_inputs(dout, idx, dwte, dwpe, cupy=True)
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
