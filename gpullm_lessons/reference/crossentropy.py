"""Cross-entropy loss of logits against integer targets, averaged over all N = B*T positions.

Forward, one row: probs = softmax(logits), loss_row = -log probs[target]
    = -(logits[target] - max - log sum_j exp(logits_j - max))     (log-sum-exp form: never log(0))
    loss = mean over the N rows of loss_row                       (a scalar)

Backward, for dloss = dL/dloss (1 when loss is the final objective):
    d loss_row / d logits_j = probs_j - [j == target]       (softmax and log cancel neatly)
    dlogits = dloss * (probs - onehot(targets)) / N          (the 1/N comes from the mean)
"""
import numpy as np


def crossentropy_forward(logits, targets):
    """logits (B, T, V) float, targets (B, T) int -> (loss scalar in logits' dtype, cache {probs, targets, logits}).

    Any leading shape works: logits (..., V) with targets (...), e.g. (N, V) and (N,).
    """
    logits = np.asarray(logits)
    targets = np.asarray(targets)
    if not np.issubdtype(logits.dtype, np.floating):
        raise TypeError(f"crossentropy_forward: logits must be a floating-point array, got dtype {logits.dtype}")
    if not np.issubdtype(targets.dtype, np.integer):
        raise TypeError(f"crossentropy_forward: targets must be an integer array, got dtype {targets.dtype}")
    if logits.ndim < 1 or targets.shape != logits.shape[:-1]:
        raise ValueError(f"crossentropy_forward: targets are {targets.shape} but logits are {logits.shape}; "
                         f"targets must be logits.shape[:-1] = {logits.shape[:-1]}")
    V = logits.shape[-1]
    N = targets.size
    if N == 0 or V == 0:
        raise ValueError(f"crossentropy_forward: logits {logits.shape} have no rows or no classes")
    if targets.min() < 0 or targets.max() >= V:
        raise ValueError(f"crossentropy_forward: targets must be in [0, V={V}); "
                         f"got min {targets.min()}, max {targets.max()}")

    shifted = logits - logits.max(axis=-1, keepdims=True)          # (..., V) max is 0
    e = np.exp(shifted)                                           # (..., V)
    sumexp = e.sum(axis=-1, keepdims=True)                        # (..., 1)
    probs = e / sumexp                                            # (..., V)
    logp_target = np.take_along_axis(shifted, targets[..., None], axis=-1)[..., 0] - np.log(sumexp[..., 0])
    loss = -logp_target.mean()                                    # scalar, logits' dtype
    cache = {"probs": probs, "targets": targets, "logits": logits}
    return loss, cache


def crossentropy_backward(dloss, cache):
    """dloss (a float, usually 1.0) -> dlogits (..., V) = dloss * (probs - onehot) / N."""
    probs, targets = cache["probs"], cache["targets"]
    if np.ndim(dloss) != 0:
        raise ValueError(f"crossentropy_backward: dloss must be a scalar (the loss is), got shape {np.shape(dloss)}")
    N = targets.size
    V = probs.shape[-1]
    dlogits = probs.copy().reshape(-1, V)                         # (N, V)
    dlogits[np.arange(N), targets.reshape(-1)] -= 1.0             # probs - onehot
    dlogits *= float(dloss) / N                                   # python float keeps the dtype
    return dlogits.reshape(probs.shape)
