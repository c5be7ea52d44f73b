"""Causal multi-head self-attention (the core, without the input/output projections).

Forward, qkv (B, T, 3C) split into q, k, v, each reshaped to (B, nh, T, hs) with hs = C / nh:
    preatt = q @ k^T / sqrt(hs)                        (B, nh, T, T)
    preatt[..., t, s] = -inf  for s > t                causal mask: position t sees only s <= t
    att    = softmax(preatt)  over the last axis       (B, nh, T, T)
    y      = att @ v                                   (B, nh, T, hs) -> heads merged back to (B, T, C)

Backward, dy = dout reshaped to (B, nh, T, hs), scale = 1/sqrt(hs):
    y = att @ v              ->  datt = dy @ v^T,   dv = att^T @ dy
    att = softmax(preatt)    ->  dpreatt = att * (datt - sum(att * datt, -1))   (see softmax.py)
                                 masked entries have att = 0, so they get no gradient
    preatt = scale q @ k^T   ->  dq = scale dpreatt @ k,   dk = scale dpreatt^T @ q
    dqkv = the three gradients merged back into (B, T, 3C), in the order q, k, v.

The six matmuls pass their inputs through rounding.mm_round (unchanged by default; rounded to bf16/fp16 inside
`with precision.matmul_precision(...)`, fp32 accumulation).
"""
import math

import numpy as np

from .rounding import mm_round
from .softmax import softmax_backward, softmax_forward


def _split_heads(x, n_head):
    """(B, T, C) -> (B, nh, T, hs)."""
    B, T, C = x.shape
    return x.reshape(B, T, n_head, C // n_head).transpose(0, 2, 1, 3)


def _merge_heads(x):
    """(B, nh, T, hs) -> (B, T, C)."""
    B, nh, T, hs = x.shape
    return x.transpose(0, 2, 1, 3).reshape(B, T, nh * hs)


def attention_forward(qkv, n_head):
    """qkv (B, T, 3C), n_head int -> out (B, T, C), cache {qkv, att, n_head}."""
    qkv = np.asarray(qkv)
    if not np.issubdtype(qkv.dtype, np.floating):
        raise TypeError(f"attention_forward: qkv must be a floating-point array, got dtype {qkv.dtype}")
    if qkv.ndim != 3:
        raise ValueError(f"attention_forward: qkv must be (B, T, 3C), got shape {qkv.shape}")
    if isinstance(n_head, bool) or not isinstance(n_head, (int, np.integer)) or n_head < 1:
        raise ValueError(f"attention_forward: n_head must be a positive int, got {n_head!r}")
    B, T, C3 = qkv.shape
    if C3 % 3 != 0:
        raise ValueError(f"attention_forward: qkv has 3C={C3} channels, which is not divisible by 3")
    C = C3 // 3
    if C % n_head != 0:
        raise ValueError(f"attention_forward: C={C} is not divisible by n_head={n_head}")
    n_head = int(n_head)
    hs = C // n_head
    scale = 1.0 / math.sqrt(hs)                         # python float: keeps the dtype

    q, k, v = (_split_heads(x, n_head) for x in np.split(qkv, 3, axis=-1))  # each (B, nh, T, hs)
    preatt = (mm_round(q) @ mm_round(k).swapaxes(-1, -2)) * scale   # (B, nh, T, T)
    causal = np.tril(np.ones((T, T), dtype=bool))       # (T, T) True where s <= t
    preatt = np.where(causal, preatt, -np.inf)          # future positions -> -inf -> probability 0
    att, _ = softmax_forward(preatt)                    # (B, nh, T, T)
    y = mm_round(att) @ mm_round(v)                   # (B, nh, T, hs)
    out = _merge_heads(y)                               # (B, T, C)
    cache = {"qkv": qkv, "att": att, "n_head": n_head}
    return out, cache


def attention_backward(dout, cache):
    """dout (B, T, C) -> dqkv (B, T, 3C)."""
    qkv, att, n_head = cache["qkv"], cache["att"], cache["n_head"]
    B, T, C3 = qkv.shape
    C = C3 // 3
    dout = np.asarray(dout)
    if dout.shape != (B, T, C):
        raise ValueError(f"attention_backward: dout is {dout.shape} but out was {(B, T, C)}")
    dout = dout.astype(qkv.dtype, copy=False)
    scale = 1.0 / math.sqrt(C // n_head)

    q, k, v = (_split_heads(x, n_head) for x in np.split(qkv, 3, axis=-1))  # each (B, nh, T, hs)
    dy = _split_heads(dout, n_head)                     # (B, nh, T, hs)
    dy_m = mm_round(dy)                                # the matmuls' view of dy (identity in fp32)
    datt = dy_m @ mm_round(v).swapaxes(-1, -2)         # (B, nh, T, T)
    dv = mm_round(att).swapaxes(-1, -2) @ dy_m         # (B, nh, T, hs)
    dpreatt = softmax_backward(datt, {"out": att})      # (B, nh, T, T), zero where masked
    dpreatt_m = mm_round(dpreatt)
    dq = (dpreatt_m @ mm_round(k)) * scale             # (B, nh, T, hs)
    dk = (dpreatt_m.swapaxes(-1, -2) @ mm_round(q)) * scale   # (B, nh, T, hs)
    dqkv = np.concatenate([_merge_heads(dq), _merge_heads(dk), _merge_heads(dv)], axis=-1)  # (B, T, 3C)
    return dqkv
