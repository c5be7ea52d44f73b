"""The tied LM head and the cross-entropy loss over the N = B*T rows in chunks: the (N, V) logits never exist at once.

Unchunked (reference/gpt.py), with lnf (N, C) the final LayerNorm's output and wte (V, C) the tied embedding:
    logits = lnf @ wte.T                     (N, V)
    loss = mean over the N rows of -log softmax(logits)[target]
    dlogits = (probs - onehot) / N           (N, V)      the 1/N of the mean
    dlnf = dlogits @ wte                     (N, C)
    dwte_head = dlogits.T @ lnf              (V, C)
Row n's loss and row n of dlogits depend only on row n of the logits, and row n of dlnf only on row n of dlogits.
So the rows can go through the head in chunks, each chunk's backward done as soon as its dlogits exist:
    for each chunk c of the rows (n_c of them):
        logits_c = lnf[c] @ wte.T            (n_c, V)
        loss += (sum of the chunk's row losses) / N          the mean over ALL N rows, not the chunk's mean
        dlogits_c = (probs_c - onehot_c) / N (n_c, V)        the 1/N of the whole batch, not 1/n_c
        dlnf[c] = dlogits_c @ wte            (n_c, C)
        dwte_head += dlogits_c.T @ lnf[c]    (V, C)          summed over the chunks
Only one chunk's logits and dlogits are alive: n_c * V values instead of N * V. What is kept for the rest of the
backward is dlnf (N, C) and dwte_head (V, C), both far smaller than (N, V) when V >> C (GPT-2: V = 50257, C = 768).
The results equal the unchunked ones up to rounding (the sums over rows are split into per-chunk sums).

The head's backward runs inside the forward, for dloss = 1; head_backward later multiplies by dloss (dlnf and
dwte_head are linear in it). The chunks: ceil(N / chunks) rows each, the last one smaller (chunk_bounds).
"""

import math

import numpy as np

from .crossentropy import crossentropy_backward, crossentropy_forward
from .linear import linear_backward, linear_forward


def check_chunks(fn, chunks):
    """chunks as an int; ValueError naming `fn` unless it is a positive integer."""
    if isinstance(chunks, bool) or not isinstance(chunks, (int, np.integer)) or chunks < 1:
        raise ValueError(f"{fn}: ce_chunks must be a positive integer (1: the whole batch at once), got {chunks!r}")
    return int(chunks)


def chunk_bounds(rows, chunks):
    """[(lo, hi), ...]: `rows` rows in chunks of ceil(rows / chunks) rows, the last one smaller when they do not
    divide (10 rows in 4 chunks: 3, 3, 3, 1; in 6 chunks: five of 2, as ceil(10 / 6) = 2 rows already cover them)."""
    chunks = check_chunks("chunk_bounds", chunks)
    if chunks > rows:
        raise ValueError(
            f"ce_chunks={chunks} is more than the {rows} rows (B*T) the loss head gets: each chunk needs at least one "
            f"row; use ce_chunks <= {rows}"
        )
    size = math.ceil(rows / chunks)
    return [(lo, min(lo + size, rows)) for lo in range(0, rows, size)]


def head_forward_backward(lnf, wte, targets, chunks, grads=True):
    """lnf (B, T, C), wte (V, C), targets (B, T) int, chunks -> (loss scalar in lnf's dtype, cache).

    grads=True: the head's backward too, chunk by chunk (module docstring): cache {"chunks", "dlnf" (B, T, C),
    "dwte" (V, C)} for head_backward. grads=False (evaluation): the loss only; cache {"chunks"}."""
    chunks = check_chunks("head_forward_backward", chunks)
    lnf, targets = np.asarray(lnf), np.asarray(targets)
    if targets.shape != lnf.shape[:-1]:
        raise ValueError(f"head_forward_backward: targets are {targets.shape} but lnf is {lnf.shape}")
    C = lnf.shape[-1]
    x = lnf.reshape(-1, C)  # (N, C)
    t = targets.reshape(-1)  # (N,)
    N = t.size
    dlnf = np.empty_like(x) if grads else None  # (N, C)
    dwte = np.zeros_like(wte) if grads else None  # (V, C)
    total = 0.0
    for lo, hi in chunk_bounds(N, chunks):
        logits, head = linear_forward(x[lo:hi], wte.T)  # (n_c, V)
        loss_c, ce = crossentropy_forward(logits, t[lo:hi])  # the chunk's mean
        total += float(loss_c) * (hi - lo)  # its sum
        if grads:
            dlogits = crossentropy_backward((hi - lo) / N, ce)  # (n_c, V) = (probs - onehot) / N
            dlnf[lo:hi], dw, _ = linear_backward(dlogits, head)  # (n_c, C), (C, V)
            dwte += dw.T
        del logits, head, ce  # one chunk's logits and probabilities at a time
    loss = lnf.dtype.type(total / N)
    cache = {"chunks": chunks}
    if grads:
        cache.update(dlnf=dlnf.reshape(lnf.shape), dwte=dwte)
    return loss, cache


def head_backward(dloss, cache):
    """dloss (a float) -> (dlnf (B, T, C), dwte_head (V, C)): the gradients head_forward_backward computed for
    dloss = 1, times dloss."""
    if "dlnf" not in cache:
        raise ValueError("head_backward: the forward computed the loss only (grads=False); run it with grads=True")
    if np.ndim(dloss) != 0:
        raise ValueError(f"head_backward: dloss must be a scalar (the loss is), got shape {np.shape(dloss)}")
    if dloss == 1.0:
        return cache["dlnf"], cache["dwte"]
    return cache["dlnf"] * float(dloss), cache["dwte"] * float(dloss)  # python float keeps the dtype
