"""HIP launchers for causal attention backward (kernels/hip/attention.cu). CuPy arrays in, written in place.

v1      three portable kernels: datt, causal softmax backward (scaled), and dq/dk/dv by loops (naive).
cublas  the matmul path: the four products as batched matmuls through CuPy (cuBLAS / hipBLAS), with the causal
        softmax backward kernel between them. This is how the training loop runs attention backward.
"""
import math

import numpy as np

from .. import hip
from ..kernels.numba.attention import check_attention_args, check_softmax_rows

VERSIONS = ("v1", "cublas")


def attention_backward(dout, qkv, att, dqkv, n_head, version="cublas"):
    """dout (B,T,C), qkv (B,T,3C), att (B,nh,T,T) -> dqkv (B,T,3C)."""
    import cupy as cp
    if version not in VERSIONS:
        raise ValueError(f"attention_backward: version {version!r} unknown; HIP versions: {', '.join(VERSIONS)}")
    B, T, C, nh = check_attention_args("attention_backward", dout, qkv, att, dqkv, n_head)
    hs = C // nh
    scale = np.float32(1.0 / math.sqrt(hs))
    ints = (np.int32(B), np.int32(T), np.int32(C), np.int32(nh))
    threads = 256
    if version == "v1":
        datt = cp.empty((B, nh, T, T), cp.float32)
        hip.kernel("attention", "attention_datt_v1")((B * nh, T), (min(threads, max(32, T)),), (dout, qkv, datt) + ints)
        dpre = cp.empty_like(datt)
        hip.kernel("attention", "attention_dpre")((B * nh * T,), (threads,), (att, datt, dpre, np.int32(T), scale))
        n = B * T * 3 * C
        hip.kernel("attention", "attention_dqkv_v1")(((n + threads - 1) // threads,), (threads,),
                                                     (dout, qkv, att, dpre, dqkv) + ints)
        return
    # cublas: split heads with views (B, nh, T, hs); matmuls batched over (B, nh)
    q, k, v = (qkv[:, :, i * C:(i + 1) * C].reshape(B, T, nh, hs).transpose(0, 2, 1, 3) for i in range(3))
    dy = dout.reshape(B, T, nh, hs).transpose(0, 2, 1, 3)
    datt = cp.matmul(dy, v.transpose(0, 1, 3, 2))                       # (B, nh, T, T)
    dpre = cp.empty_like(datt)
    hip.kernel("attention", "attention_dpre")((B * nh * T,), (threads,), (att, datt, dpre, np.int32(T), scale))
    dq = cp.matmul(dpre, k)                                              # (B, nh, T, hs), already scaled
    dk = cp.matmul(dpre.transpose(0, 1, 3, 2), q)
    dv = cp.matmul(att.transpose(0, 1, 3, 2), dy)
    for i, part in enumerate((dq, dk, dv)):
        dqkv[:, :, i * C:(i + 1) * C] = part.transpose(0, 2, 1, 3).reshape(B, T, C)


def _check_cupy(fn, arrays):
    import cupy as cp
    for name, a in arrays:
        if not isinstance(a, cp.ndarray):
            raise TypeError(f"{fn}: {name} must be a CuPy array (HIP backend), got {type(a).__module__}."
                            f"{type(a).__name__}")
        if not a.flags.c_contiguous:
            raise ValueError(f"{fn}: {name} must be C-contiguous")


def attention_softmax_forward(pre, att, scale, threads=256):
    """att (rows, T) = causal softmax of scale * pre (rows, T), rows = B*nh*T; att may be pre (in place)."""
    pairs = (("pre", pre), ("att", att))
    rows, T = check_softmax_rows("attention_softmax_forward", pairs)
    _check_cupy("attention_softmax_forward", pairs)
    if rows:
        hip.kernel("attention", "attention_softmax_fwd")((rows,), (min(threads, max(32, T)),),
                                                          (pre, att, np.int32(T), np.float32(scale)))


def attention_softmax_backward(att, datt, dpre, scale, threads=256):
    """dpre = scale * causal softmax backward of datt through att, all (rows, T) with rows = B*nh*T."""
    triples = (("att", att), ("datt", datt), ("dpre", dpre))
    rows, T = check_softmax_rows("attention_softmax_backward", triples)
    _check_cupy("attention_softmax_backward", triples)
    if rows:
        hip.kernel("attention", "attention_dpre")((rows,), (min(threads, max(32, T)),),
                                                   (att, datt, dpre, np.int32(T), np.float32(scale)))
