"""Multi-head attention (the core, without the input/output projections): causal self-attention on the packed qkv
(attention_forward / attention_backward, the GPT's layer) and the general form on q, k, v as heads (sdpa_forward /
sdpa_backward: scaled dot-product attention, causal or not, with an optional boolean mask, Tq queries and Tk keys).

Forward, q (B, nh, Tq, hs), k, v (B, nh, Tk, hs), scale = 1/sqrt(hs) (from qkv (B, T, 3C): q, k, v each reshaped to
(B, nh, T, hs) with hs = C / nh, Tq = Tk = T):
    preatt = q @ k^T * scale                           (B, nh, Tq, Tk)
    preatt[..., t, s] = -inf  where query t may not see key s   (attention_mask below; causal: s > t)
    att    = softmax(preatt)  over the last axis       (B, nh, Tq, Tk)
    y      = att @ v                                   (B, nh, Tq, hs) -> heads merged back to (B, T, C)
    lse    = log sum_s exp(preatt[..., t, s])          (B, nh, Tq), sdpa_forward's cache: what flash attention saves

Which keys a query sees (attention_mask(Tq, Tk, causal, mask), (Tq, Tk) bool, True = seen):
    causal  query t sees keys s <= t + (Tk - Tq): BOTTOM-RIGHT aligned, the last query sees every key. With a KV cache
            the Tq new queries are the last Tq positions of the Tk keys, and in ring attention a query block meets the
            key block of its own positions last, so a query at position t of Tk sees the keys up to position t. This is
            FlashAttention-2's convention (>= 2.1); PyTorch's scaled_dot_product_attention(is_causal=True) aligns
            TOP-LEFT instead (s <= t), which differs from this one only when Tq != Tk. Square (Tq = Tk): s <= t.
            causal with Tk < Tq is refused (ValueError): the first Tq - Tk queries would see no key, which is almost
            always q and k swapped; say it with an explicit mask if it is meant.
    mask    an optional (Tq, Tk) bool array, True = allowed, the same for every batch and head; with causal, a key must
            be allowed by both.
    A query that sees no key (a mask row of all False) gets y = 0, att = 0 and lse = -inf (no NaN), and passes no
    gradient: softmax over an empty set has no value, and 0 is what the flash kernels write (acc = 0, l = 0) and what
    a ring step that merges partial results by their lse needs (weight exp(-inf) = 0).

Backward, dy = dout reshaped to (B, nh, Tq, hs), scale = 1/sqrt(hs):
    y = att @ v              ->  datt = dy @ v^T,   dv = att^T @ dy
    att = softmax(preatt)    ->  dpreatt = att * (datt - sum(att * datt, -1))   (see softmax.py)
                                 masked entries have att = 0, so they get no gradient
    preatt = scale q @ k^T   ->  dq = scale dpreatt @ k,   dk = scale dpreatt^T @ q
    attention_backward: dqkv = the three gradients merged back into (B, T, 3C), in the order q, k, v;
    sdpa_backward: (dq, dk, dv) as heads.

The six matmuls pass their inputs through rounding.mm_round (unchanged by default; rounded to bf16/fp16 inside
`with precision.matmul_precision(...)`, fp32 accumulation).
"""
import math

import numpy as np

from ._validate import _dout_shaped, _float_array
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


def attention_mask(Tq, Tk, causal=True, mask=None, fn="attention_mask"):
    """The (Tq, Tk) bool matrix of the keys each query sees (True = seen): causal bottom-right aligned (query t sees
    keys s <= t + Tk - Tq), AND the optional (Tq, Tk) bool mask. causal with Tk < Tq is refused (module docstring).
    Raises TypeError (causal not a bool, mask not bool) or ValueError (mask's shape, Tk < Tq with causal), naming fn."""
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"{fn}: causal must be True or False, got {causal!r}")
    Tq, Tk = int(Tq), int(Tk)
    if causal and Tk < Tq:
        raise ValueError(
            f"{fn}: causal with fewer keys than queries (Tk={Tk} < Tq={Tq}): bottom-right alignment (query t sees keys "
            f"s <= t + Tk - Tq) would leave the first {Tq - Tk} queries with no key. Swapped q and k? For that "
            f"pattern, pass causal=False and a mask")
    allowed = np.ones((Tq, Tk), dtype=bool)
    if causal:
        allowed = np.tril(allowed, k=Tk - Tq)           # s <= t + (Tk - Tq); Tq = Tk: np.tril, s <= t
    if mask is not None:
        if not (hasattr(mask, "shape") and hasattr(mask, "dtype")):
            raise TypeError(f"{fn}: mask must be a NumPy bool array (Tq, Tk) = ({Tq}, {Tk}) or None, "
                            f"got {type(mask).__name__}")
        mask = np.asarray(mask)
        if mask.dtype != np.bool_:
            raise TypeError(f"{fn}: mask must be a bool array (True = the query may see the key), got dtype "
                            f"{mask.dtype}; use mask.astype(bool) if nonzero means allowed")
        if mask.shape != (Tq, Tk):
            raise ValueError(f"{fn}: mask has shape {mask.shape}, expected (Tq, Tk) = ({Tq}, {Tk}): one row per "
                             f"query, one column per key, the same for every batch and head")
        allowed = allowed & mask
    return allowed


def _attend(q, k, v, allowed, scale, want_lse=False):
    """att (B, nh, Tq, Tk), y (B, nh, Tq, hs) and, with want_lse, lse (B, nh, Tq) (else None): softmax over the keys
    `allowed` (Tq, Tk) lets each query see; a query that sees none gets att = 0, y = 0, lse = -inf."""
    preatt = (mm_round(q) @ mm_round(k).swapaxes(-1, -2)) * scale   # (B, nh, Tq, Tk)
    empty = ~allowed.any(axis=-1)                       # (Tq,) queries that see no key
    if empty.any():                                     # their rows stay finite through the softmax, then 0
        allowed = allowed | empty[:, None]
    preatt = np.where(allowed, preatt, -np.inf)         # keys not seen -> -inf -> probability 0
    att, _ = softmax_forward(preatt)                    # (B, nh, Tq, Tk)
    if empty.any():
        att = np.where(empty[:, None], 0.0, att)
    y = mm_round(att) @ mm_round(v)                    # (B, nh, Tq, hs)
    lse = None
    if want_lse:
        m = preatt.max(axis=-1, keepdims=True)
        lse = (m + np.log(np.exp(preatt - m).sum(axis=-1, keepdims=True)))[..., 0]
        lse = np.where(empty, -np.inf, lse)
    return att, y, lse


def _attend_backward(dy, q, k, v, att, scale):
    """(dq, dk, dv) as heads, from dy (B, nh, Tq, hs) and the forward's att."""
    dy_m = mm_round(dy)                                # the matmuls' view of dy (identity in fp32)
    datt = dy_m @ mm_round(v).swapaxes(-1, -2)         # (B, nh, Tq, Tk)
    dv = mm_round(att).swapaxes(-1, -2) @ dy_m         # (B, nh, Tk, hs)
    dpreatt = softmax_backward(datt, {"out": att})      # (B, nh, Tq, Tk), zero where masked
    dpreatt_m = mm_round(dpreatt)
    dq = (dpreatt_m @ mm_round(k)) * scale             # (B, nh, Tq, hs)
    dk = (dpreatt_m.swapaxes(-1, -2) @ mm_round(q)) * scale   # (B, nh, Tk, hs)
    return dq, dk, dv


def attention_forward(qkv, n_head, *, causal=True, mask=None):
    """qkv (B, T, 3C), n_head int -> out (B, T, C), cache {qkv, att, n_head}. Self-attention: causal (default) or
    not, mask an optional (T, T) bool array (True = allowed), as sdpa_forward."""
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
    allowed = attention_mask(T, T, causal, mask, fn="attention_forward")   # (T, T) True where s <= t (causal)

    q, k, v = (_split_heads(x, n_head) for x in np.split(qkv, 3, axis=-1))  # each (B, nh, T, hs)
    att, y, _ = _attend(q, k, v, allowed, scale)        # (B, nh, T, T), (B, nh, T, hs)
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
    dq, dk, dv = _attend_backward(dy, q, k, v, att, scale)
    dqkv = np.concatenate([_merge_heads(dq), _merge_heads(dk), _merge_heads(dv)], axis=-1)  # (B, T, 3C)
    return dqkv


def sdpa_forward(q, k, v, *, causal=True, mask=None):
    """Scaled dot-product attention on heads: q (B, nh, Tq, hs), k, v (B, nh, Tk, hs), one floating dtype ->
    out (B, nh, Tq, hs), cache {q, k, v, att (B, nh, Tq, Tk), lse (B, nh, Tq), allowed (Tq, Tk), scale}.

    causal: query t sees keys s <= t + (Tk - Tq) (bottom-right aligned: the last query sees every key; Tq = Tk: s <= t,
    attention_forward's mask); causal with Tk < Tq raises ValueError. mask: None or a (Tq, Tk) bool array, True = the
    query may see the key, broadcast over batch and heads; with causal both must allow. A query that sees no key gets
    out = 0 and lse = -inf (and no gradient). lse[b, h, t] = log sum_s exp(q[t] . k[s] / sqrt(hs)) over the keys t
    sees: what flash attention saves for its backward. Scores, softmax and products as attention_forward (same bits
    on the same heads with the same mask)."""
    fn = "sdpa_forward"
    q, k, v = (_float_array(fn, name, x) for name, x in (("q", q), ("k", k), ("v", v)))
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{fn}: {name} must be 4-D (B, nh, T, hs), got shape {x.shape}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"{fn}: q, k, v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    B, nh, Tq, hs = q.shape
    Tk = k.shape[2]
    if k.shape != (B, nh, Tk, hs):
        raise ValueError(f"{fn}: k has shape {k.shape} but q is {q.shape}: k must be (B, nh, Tk, hs) with q's "
                         f"B={B}, nh={nh} and hs={hs}")
    if v.shape != k.shape:
        raise ValueError(f"{fn}: v has shape {v.shape} but k is {k.shape}: v must be k's shape (B, nh, Tk, hs)")
    if hs < 1 or Tk < 1:
        raise ValueError(f"{fn}: q, k need hs >= 1 and k at least one key (Tk >= 1), got q {q.shape}, k {k.shape}")
    allowed = attention_mask(Tq, Tk, causal, mask, fn=fn)
    scale = 1.0 / math.sqrt(hs)                         # python float: keeps the dtype
    att, y, lse = _attend(q, k, v, allowed, scale, want_lse=True)
    cache = {"q": q, "k": k, "v": v, "att": att, "lse": lse, "allowed": allowed, "scale": scale}
    return y, cache


def sdpa_backward(dout, cache):
    """dout (B, nh, Tq, hs) -> (dq (B, nh, Tq, hs), dk (B, nh, Tk, hs), dv (B, nh, Tk, hs)) of sdpa_forward."""
    q, k, v, att = cache["q"], cache["k"], cache["v"], cache["att"]
    dout = _dout_shaped("sdpa_backward", dout, "out", q.shape).astype(q.dtype, copy=False)
    return _attend_backward(dout, q, k, v, att, cache["scale"])
