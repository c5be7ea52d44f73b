"""Encoder: token embedding plus position embedding.

Forward
    out[b, t, :] = wte[idx[b, t], :] + wpe[t, :]                      # (B, T, C)

Backward
    out is a sum of two table lookups, so each looked-up row receives dout unchanged:
    dwte[v, :] = sum over all (b, t) with idx[b, t] == v of dout[b, t, :]   (a scatter-add: a token that
                 appears several times collects several contributions, hence np.add.at, not dwte[idx] = ...)
    dwpe[t, :] = sum over b of dout[b, t, :]   for t < T, and 0 for the unused positions t >= T.
    idx is an integer input: it has no gradient.
"""
import numpy as np

from ._validate import _float_array


def encoder_forward(idx, wte, wpe):
    """out = wte[idx] + wpe[:T].  idx (B, T) int, wte (V, C), wpe (maxT, C) -> out (B, T, C), cache."""
    idx = np.asarray(idx)
    wte = _float_array("encoder_forward", "wte", wte)
    wpe = _float_array("encoder_forward", "wpe", wpe)
    if not np.issubdtype(idx.dtype, np.integer):
        raise TypeError(f"encoder_forward: idx must be an integer array of token ids, got dtype {idx.dtype}")
    if idx.ndim != 2:
        raise ValueError(f"encoder_forward: idx must be (B, T), got shape {idx.shape}")
    if wte.ndim != 2 or wpe.ndim != 2 or wte.shape[1] != wpe.shape[1]:
        raise ValueError(f"encoder_forward: wte must be (V, C) and wpe (maxT, C) with the same C; "
                         f"got wte {wte.shape} and wpe {wpe.shape}")
    if wte.dtype != wpe.dtype:
        raise TypeError(f"encoder_forward: wte is {wte.dtype} but wpe is {wpe.dtype}; pass arrays of one dtype")
    B, T = idx.shape
    V, C = wte.shape
    maxT = wpe.shape[0]
    if T > maxT:
        raise ValueError(f"encoder_forward: T={T} is longer than wpe's maxT={maxT} positions")
    if idx.size and (idx.min() < 0 or idx.max() >= V):
        raise ValueError(f"encoder_forward: idx must be in [0, V={V}); got min {idx.min()}, max {idx.max()}")

    out = wte[idx] + wpe[:T]                            # (B, T, C) + (T, C) broadcasts over B
    cache = {"idx": idx, "V": V, "maxT": maxT, "dtype": wte.dtype}
    return out, cache


def encoder_backward(dout, cache):
    """dout (B, T, C) -> (dwte (V, C), dwpe (maxT, C))."""
    idx, V, maxT, dtype = cache["idx"], cache["V"], cache["maxT"], cache["dtype"]
    dout = np.asarray(dout)
    B, T = idx.shape
    if dout.ndim != 3 or dout.shape[:2] != (B, T):
        raise ValueError(f"encoder_backward: dout must be (B, T, C) with B={B}, T={T}; got {dout.shape}")
    C = dout.shape[2]
    dwte = np.zeros((V, C), dtype=dtype)                # (V, C)
    np.add.at(dwte, idx, dout.astype(dtype, copy=False))  # scatter-add: repeated tokens accumulate
    dwpe = np.zeros((maxT, C), dtype=dtype)             # (maxT, C); rows >= T stay zero
    dwpe[:T] = dout.sum(axis=0)                         # (T, C): sum over the batch
    return dwte, dwpe
