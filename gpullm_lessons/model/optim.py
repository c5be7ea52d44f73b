"""The reference optimizer and its helpers, on ONE flat parameter buffer (see params.ParamBuffer.flat).

AdamW
-----
Exactly PyTorch's torch.optim.AdamW (amsgrad=False, maximize=False), for step t = 1, 2, ...:

    p = p - lr * wd * p                      # decoupled weight decay, only where decay_mask is True
    m = b1 * m + (1 - b1) * g                # first moment (running mean of the gradient)
    v = b2 * v + (1 - b2) * g^2              # second moment (running mean of its square)
    mhat = m / (1 - b1^t)                    # bias corrections: m and v start at 0
    vhat = v / (1 - b2^t)
    p = p - lr * mhat / (sqrt(vhat) + eps)

Note eps is added to sqrt(vhat), after the bias correction, as PyTorch does.

Which parameters decay (nanoGPT's rule)
---------------------------------------
nanoGPT decays every parameter tensor with dim >= 2 (the matrices: embeddings and linear weights) and not the
1-D ones (biases, LayerNorm weights and biases). Our buffer stacks the L layers along a leading axis, so the rule
is applied to one layer's tensor: qkvw (L, C, 3C) is a stack of 2-D matrices and decays, ln1w (L, C) is a stack
of 1-D vectors and does not. Decayed: wte, wpe, qkvw, attprojw, fcw, fcprojw (see `DECAY_NAMES`).

Also here: `adamw_update` (the same step as a function of the arrays: a whole buffer or one rank's shard),
`adamw_update_bf16` (the same step with m and v stored as bfloat16 bits: lesson 12),
`lr_schedule` (linear warmup then cosine decay), `clip_coefficient` and `clip_grad_norm` (global-norm clipping).
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

# Tensors that get weight decay: the matrices (one layer's tensor has dim >= 2). Everything else -- biases
# (qkvb, attprojb, fcb, fcprojb) and LayerNorm parameters (ln1w, ln1b, ln2w, ln2b, lnfw, lnfb) -- does not.
DECAY_NAMES = ("wte", "wpe", "qkvw", "attprojw", "fcw", "fcprojw")


def decay_mask_for(cfg) -> np.ndarray:
    """A boolean mask over the flat parameter buffer of `cfg`: True where weight decay applies (DECAY_NAMES)."""
    from .params import param_shapes

    parts = []
    for name, shape in param_shapes(cfg).items():
        parts.append(np.full(math.prod(shape), name in DECAY_NAMES, dtype=bool))
    return np.concatenate(parts)


class AdamW:
    """AdamW over a flat parameter array, updated in place (PyTorch semantics, see the module docstring).

        opt = AdamW(params.flat, lr=1e-3, weight_decay=0.1, decay_mask=decay_mask_for(cfg))
        opt.step(grads.flat)              # or opt.step(grads.flat, lr=lr_schedule(...))

    m and v have the dtype of the parameters. The update is computed in that dtype too.
    """

    def __init__(self, params_flat: np.ndarray, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01, decay_mask: Optional[np.ndarray] = None):
        if params_flat.ndim != 1:
            raise ValueError(f"AdamW works on a flat (1-D) parameter buffer, got shape {params_flat.shape}")
        self.params = params_flat
        self.lr = lr
        self.beta1, self.beta2 = betas
        self.eps = eps
        self.weight_decay = weight_decay
        if decay_mask is not None:
            decay_mask = np.asarray(decay_mask, dtype=bool)
            if decay_mask.shape != params_flat.shape:
                raise ValueError(f"decay_mask has shape {decay_mask.shape}, the parameters {params_flat.shape}")
        self.decay_mask = decay_mask
        self.t = 0  # steps taken
        self.m = np.zeros_like(params_flat)  # first moment
        self.v = np.zeros_like(params_flat)  # second moment

    def step(self, grads_flat: np.ndarray, lr: Optional[float] = None) -> None:
        """One update of self.params (in place) from the gradient `grads_flat` (same shape). `lr` overrides."""
        if grads_flat.shape != self.params.shape:
            raise ValueError(f"gradient shape {grads_flat.shape} != parameter shape {self.params.shape}")
        self.t += 1
        adamw_update(self.params, grads_flat, self.m, self.v, self.t, self.lr if lr is None else lr,
                     (self.beta1, self.beta2), self.eps, self.weight_decay, self.decay_mask)

    def state_dict(self) -> dict:
        """Everything needed to continue: step count, moments (copies) and hyperparameters."""
        return {"t": self.t, "m": self.m.copy(), "v": self.v.copy(), "lr": self.lr,
                "betas": (self.beta1, self.beta2), "eps": self.eps, "weight_decay": self.weight_decay}

    def load_state_dict(self, state: dict) -> None:
        """Restore a `state_dict()`; the moments are copied into the existing arrays."""
        self.t = int(state["t"])
        self.m[...] = state["m"]
        self.v[...] = state["v"]
        self.lr = state["lr"]
        self.beta1, self.beta2 = state["betas"]
        self.eps = state["eps"]
        self.weight_decay = state["weight_decay"]


def adamw_update(p, g, m, v, t: int, lr: float, betas, eps: float, weight_decay: float, decay_mask=None) -> None:
    """Step t (1, 2, ...) of AdamW on flat arrays, in place: p, m and v updated from the gradient g.

    The arithmetic of AdamW.step, as a function of the arrays, so that the same update runs over the whole buffer or
    over one rank's shard of it (ZeRO: p, g, m, v and decay_mask are that shard's slices)."""
    b1, b2 = betas
    # 1. decoupled weight decay: shrink the weights, independent of the gradient
    if weight_decay != 0.0:
        if decay_mask is None:
            p -= lr * weight_decay * p
        else:
            p[decay_mask] -= lr * weight_decay * p[decay_mask]
    # 2. update the moment estimates
    m *= b1
    m += (1 - b1) * g
    v *= b2
    v += (1 - b2) * (g * g)
    # 3. bias-corrected moments and the step
    mhat = m / (1 - b1 ** t)
    vhat = v / (1 - b2 ** t)
    p -= lr * mhat / (np.sqrt(vhat) + eps)


def adamw_update_bf16(p, g, m_bits, v_bits, t: int, lr: float, betas, eps: float, weight_decay: float,
                      decay_mask=None) -> None:
    """adamw_update with the moments stored as bfloat16 bits (uint16 (n,) each, 2 bytes per value instead of 4).

    m and v are read back to float32 (exact: 16 zero bits appended), updated and used for the step in float32 (the
    step uses this step's float32 moments, before rounding), then written back rounded to nearest even
    (reference.rounding.f32_to_bf16_bits, ml_dtypes' bits). The reference of the bf16-moment AdamW kernels."""
    from ..reference.rounding import bf16_bits_to_f32, f32_to_bf16_bits

    for name, a in (("m_bits", m_bits), ("v_bits", v_bits)):
        if not isinstance(a, np.ndarray) or a.dtype != np.uint16 or a.shape != p.shape:
            raise TypeError(f"adamw_update_bf16: {name} must be a uint16 array of bfloat16 bits with the shape of "
                            f"p {p.shape}, got {getattr(a, 'dtype', type(a).__name__)} {getattr(a, 'shape', '')}")
    m, v = bf16_bits_to_f32(m_bits), bf16_bits_to_f32(v_bits)
    adamw_update(p, g, m, v, t, lr, betas, eps, weight_decay, decay_mask)
    m_bits[...] = f32_to_bf16_bits(m)
    v_bits[...] = f32_to_bf16_bits(v)


def shard_decay_table(bounds, flags, lo: int, hi: int) -> tuple:
    """The AdamW decay table of the shard lo..hi of the flat buffer: (bounds', flags') in shard-local indices.

    bounds (k+1,), flags (k,) in the fused AdamW kernels' format (kernels.numba.adamw.decay_table) for the whole
    buffer (tensor j is elements bounds[j] .. bounds[j+1]-1). Each tensor's range is shifted by -lo and clipped to 0 .. hi-lo; tensors
    outside the shard are dropped. When hi runs past the last tensor (the zero padding), the tail is one more
    "tensor" with flag 0 (no decay). Returns int64 bounds starting at 0 and ending at hi - lo, uint8 flags."""
    b = np.asarray(bounds, dtype=np.int64)
    f = np.asarray(flags).astype(np.uint8)
    if b.ndim != 1 or f.ndim != 1 or b.size != f.size + 1:
        raise ValueError(f"shard_decay_table: bounds must be (k+1,) and flags (k,), got {b.shape} and {f.shape}")
    if not 0 <= lo <= hi:
        raise ValueError(f"shard_decay_table: need 0 <= lo <= hi, got lo={lo}, hi={hi}")
    starts = np.clip(b[:-1] - lo, 0, hi - lo)
    stops = np.clip(b[1:] - lo, 0, hi - lo)
    keep = stops > starts
    out_b, out_f = [0], []
    for s0, s1, fl in zip(starts[keep], stops[keep], f[keep]):
        out_b.append(int(s1))
        out_f.append(int(fl))
    if out_b[-1] < hi - lo:                                       # the padding past the last tensor
        out_b.append(hi - lo)
        out_f.append(0)
    if not out_f:                                                # an empty shard: one empty tensor
        out_b, out_f = [0, 0], [0]
    return np.array(out_b, np.int64), np.array(out_f, np.uint8)


def lr_schedule(step: int, max_lr: float, warmup: int, total: int, min_lr: float = 0.0) -> float:
    """Learning rate at `step` (0-based) of a run of `total` steps: linear warmup, then cosine decay.

    - steps 0 .. warmup-1:     max_lr * (step + 1) / warmup   (rises to max_lr; step 0 is not wasted at lr 0)
    - steps warmup .. total-1: cosine from max_lr (at step = warmup) down to min_lr (at the last step, total-1)
    - after the run:           min_lr
    """
    if step < warmup:
        return max_lr * (step + 1) / warmup
    decay_steps = max(1, total - 1 - warmup)
    ratio = min(1.0, (step - warmup) / decay_steps)  # 0 -> 1 over the decay phase
    coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))  # 1 -> 0
    return min_lr + coeff * (max_lr - min_lr)


def clip_coefficient(norm: float, max_norm: float) -> float:
    """The factor global-norm clipping multiplies the gradient by: max_norm / (norm + 1e-6) when that is below 1,
    else 1 (and 1 when max_norm <= 0: clipping off). As torch.nn.utils.clip_grad_norm_."""
    if max_norm <= 0:
        return 1.0
    coef = max_norm / (norm + 1e-6)
    return coef if coef < 1.0 else 1.0


def clip_grad_norm(grads_flat: np.ndarray, max_norm: float) -> float:
    """Scale the gradient (in place) so its global L2 norm is at most max_norm; return the norm before clipping.

    As torch.nn.utils.clip_grad_norm_: scale by max_norm / (norm + 1e-6) when that is below 1 (clip_coefficient).
    """
    total_norm = float(np.sqrt(np.sum(np.square(grads_flat, dtype=np.float64))))
    clip_coef = clip_coefficient(total_norm, max_norm)
    if clip_coef < 1.0:
        grads_flat *= grads_flat.dtype.type(clip_coef)
    return total_norm
