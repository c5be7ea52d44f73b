"""Launch wrapper for kernels/hip/encoder.cu (CuPy arrays; NVIDIA through NVRTC, AMD through hiprtc).

Same name, signature and versions as kernels/numba/encoder.py (its docstring explains them):
    encoder_backward(dout (B,T,C), idx (B,T) int32, dwte (V,C), dwpe (maxT,C), version="v2")
v1: zero, then atomicAdd per (b, t, c) (not deterministic). v2: host-side bucketing of positions by token, then
one thread per (v, c) / (t, c) summing in a fixed order (deterministic, no atomics).
v3: fixed-point integer atomics (deterministic, all on the GPU: no host copy or sync, so a CUDA graph captures it):
max |dout| and a power-of-two scale on the device, int64 atomicAdd of rint(dout * 2^e), then dwte = acc * 2^-e.
"""

from __future__ import annotations

import numpy as np

# the shape/dtype checks and v2's host-side bucketing are the Numba wrapper's too (cupy=True: CuPy arrays only)
from gpullm_lessons.contracts.encoder import check_inputs
from gpullm_lessons.contracts.encoder import token_buckets as _token_buckets

VERSIONS = ("v1", "v2", "v3")
MAX_THREADS = 1024
AMAX_BLOCKS = 1024  # v3: at most this many partial maxima (the amax kernel is grid-stride)
MAX_BLOCKS = 65535  # v3: grid-stride kernels launch at most this many blocks


def encoder_backward(dout, idx, dwte, dwpe, version="v2", threads=256, accumulate=False):
    """dwte = 0, dwpe = 0, then dwte[idx[b, t]] += dout[b, t] and dwpe[t] += dout[b, t] for every (b, t).
    accumulate=True: dwte is not zeroed first: the sums are added to what it holds (the tied head's share of the
    embedding's gradient); v1 adds into it, v3 in its last pass (v3_finish_add: no (V, C) float32 scratch and no
    pass of its own), v2 into a scratch array then added.
    v1 and v3 do not check that idx is in [0, V) (that would need a copy to the host); v2 does.
    v3 reads nothing back to the host: its scratch (partial maxima, scale [2^e, 2^-e], acc (V, C) int64) comes from
    cupy.empty on the current stream, so it can be captured in a CUDA graph (keep the pool private, as the engine
    does, so the captured addresses stay valid)."""
    B, T, C, V, maxT = check_inputs(dout, idx, dwte, dwpe, cupy=True)
    if version not in VERSIONS:
        raise ValueError(f"encoder_backward: version={version!r}, expected one of {', '.join(VERSIONS)}")
    if not 1 <= threads <= MAX_THREADS:
        raise ValueError(f"encoder_backward: threads={threads}, expected 1..{MAX_THREADS}")
    if not isinstance(accumulate, bool):
        raise TypeError(f"encoder_backward: accumulate must be True or False, got {accumulate!r}")
    import cupy  # lazy: an optional extra
    from gpullm_lessons.runtime import hip

    if accumulate and version == "v2":  # v2 writes each element once: into scratch, then added
        tmp = cupy.empty_like(dwte)
        encoder_backward(dout, idx, tmp, dwpe, version, threads)
        dwte += tmp
        return dwte, dwpe

    def blocks(n):
        return (max((n + threads - 1) // threads, 1),)

    if version == "v1":
        zero = hip.kernel("encoder", "encoder_backward_v1_zero")
        if not accumulate:
            zero(blocks(V * C), (threads,), (dwte, np.int64(V * C)))
        zero(blocks(maxT * C), (threads,), (dwpe, np.int64(maxT * C)))
        if B * T * C:
            hip.kernel("encoder", "encoder_backward_v1")(
                blocks(B * T * C), (threads,), (dout, idx, dwte, dwpe, np.int32(B), np.int32(T), np.int32(C))
            )
    elif version == "v3":
        n = B * T * C
        n_partial = min(blocks(n)[0], AMAX_BLOCKS)
        partial = cupy.empty(n_partial, cupy.float32)  # every element written by v3_amax
        scale = cupy.empty(2, cupy.float32)  # [2^e, 2^-e], written by v3_scale
        acc = cupy.empty((V, C), cupy.int64)  # zeroed by v3_zero
        hip.kernel("encoder", "encoder_backward_v3_amax")((n_partial,), (threads,), (dout, partial, np.int64(n)))
        hip.kernel("encoder", "encoder_backward_v3_scale")(
            (1,), (threads,), (partial, np.int32(n_partial), np.int64(B * T), scale)
        )
        grid = (min(blocks(V * C)[0], MAX_BLOCKS),)
        hip.kernel("encoder", "encoder_backward_v3_zero")(grid, (threads,), (acc, np.int64(V * C)))
        hip.kernel("encoder", "encoder_backward_v3_add")(
            (min(blocks(n)[0], MAX_BLOCKS),), (threads,), (dout, idx, scale, acc, np.int64(n), np.int32(C))
        )
        finish = "encoder_backward_v3_finish_add" if accumulate else "encoder_backward_v3_finish"
        hip.kernel("encoder", finish)(grid, (threads,), (acc, scale, dwte, np.int64(V * C)))
        hip.kernel("encoder", "encoder_backward_v2_dwpe")(
            blocks(maxT * C), (threads,), (dout, dwpe, np.int32(B), np.int32(T), np.int32(maxT), np.int32(C))
        )
    else:
        order, starts = (cupy.asarray(a) for a in _token_buckets(idx.get(), V))
        hip.kernel("encoder", "encoder_backward_v2")(
            blocks(V * C), (threads,), (dout, order, starts, dwte, np.int32(V), np.int32(C))
        )
        hip.kernel("encoder", "encoder_backward_v2_dwpe")(
            blocks(maxT * C), (threads,), (dout, dwpe, np.int32(B), np.int32(T), np.int32(maxT), np.int32(C))
        )
    return dwte, dwpe
