"""Mixed precision, the NumPy reference: bfloat16 bits, dynamic loss scaling, and one skipped-or-taken step.

bfloat16 is the top half of a float32: 1 sign bit, the same 8 exponent bits, 7 of the 23 mantissa bits. So
float32 -> bfloat16 only has to round away the low 16 bits, and bfloat16 -> float32 appends 16 zero bits:

    f32 bits  s eeeeeeee mmmmmmm|mmmmmmmmmmmmmmmm      keep the 16 bits left of |, round on the 16 bits right of it
    bf16 bits s eeeeeeee mmmmmmm

Round to nearest, ties to even (RNE, what ml_dtypes.bfloat16, PyTorch and the GPUs do), with integer arithmetic:
add 0x7FFF plus the lowest kept bit, then drop the low 16 bits. Below the halfway point (< 0x8000) nothing carries;
above it (> 0x8000) the carry rounds up; exactly halfway (0x8000) carries only when the kept part is odd, so the
result is even. A carry out of the mantissa bumps the exponent (the right thing: 1.11..1 rounds to 10.0), and the
largest float32 rounds to inf. NaN is the exception: adding could turn a NaN into inf, so NaN becomes the quiet
NaN 0x7FC0 with the sign kept (as ml_dtypes does).

Loss scaling (fp16 training; harmless with bf16): small gradients underflow in half precision, so the loss is
multiplied by `scale` before backward (every gradient grows by `scale`) and the gradients are divided by it again
before the optimizer step. Too large a scale overflows: some gradient is inf or NaN. DynamicLossScaler follows
torch.cuda.amp.GradScaler: on inf/NaN skip the step and halve the scale; after `growth_interval` clean steps in a
row double it. `scaled_step` is one optimizer step of that loop, the reference for the GPU kernels in
kernels/numba/convert.py and kernels/hip/convert.cu (conversions and the nonfinite count).
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

__all__ = ["f32_to_bf16_bits", "bf16_bits_to_f32", "grads_finite", "nonfinite_count", "DynamicLossScaler",
           "scaled_step"]


def _float32_array(fn, x):
    x = np.asarray(x)
    if x.dtype != np.float32:
        raise TypeError(f"{fn}: x has dtype {x.dtype}, expected float32")
    return x


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 array -> uint16 array of bfloat16 bits (same shape), round to nearest even, NaN kept quiet with sign.

    Bit-exact with x.astype(ml_dtypes.bfloat16).view(np.uint16).
    """
    x = _float32_array("f32_to_bf16_bits", x)
    bits = np.ascontiguousarray(x).reshape(-1).view(np.uint32)  # the float32 bits, flat (n,)
    lowest_kept = (bits >> np.uint32(16)) & np.uint32(1)        # 1 when the bf16 mantissa is odd: ties round up
    rounded = (bits + np.uint32(0x7FFF) + lowest_kept) >> np.uint32(16)   # no uint32 overflow for non-NaN bits
    quiet_nan = ((bits >> np.uint32(16)) & np.uint32(0x8000)) | np.uint32(0x7FC0)
    out = np.where(bits.view(np.float32) != bits.view(np.float32), quiet_nan, rounded)   # NaN != NaN
    return out.astype(np.uint16).reshape(x.shape)


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """uint16 array of bfloat16 bits -> float32 array (exact: 16 zero bits appended; NaN payloads kept)."""
    bits = np.asarray(bits)
    if bits.dtype != np.uint16:
        raise TypeError(f"bf16_bits_to_f32: bits has dtype {bits.dtype}, expected uint16 (the bfloat16 bits)")
    wide = bits.reshape(-1).astype(np.uint32) << np.uint32(16)    # (n,) the bf16 bits in the top half
    return wide.view(np.float32).reshape(bits.shape)


def nonfinite_count(flat_grads: np.ndarray) -> int:
    """How many elements are inf or NaN (the reference for the nonfinite_count kernels)."""
    return int(np.count_nonzero(~np.isfinite(flat_grads)))


def grads_finite(flat_grads: np.ndarray) -> bool:
    """True when every gradient is finite (no inf, no NaN): the step may be taken."""
    return nonfinite_count(flat_grads) == 0


class DynamicLossScaler:
    """The loss scale of mixed-precision training, adapted every step (torch.cuda.amp.GradScaler's rule).

        scaler = DynamicLossScaler()
        loss * scaler.scale -> backward -> scaled grads
        skip = scaler.update(found_inf=not grads_finite(scaled_grads))   # or use scaled_step()

    update(found_inf): inf/NaN found -> scale = max(scale * backoff_factor, min_scale), the clean-step count
    restarts, and the step must be skipped (returns True). Otherwise the clean-step count grows; when it reaches
    growth_interval the scale is multiplied by growth_factor and the count restarts (returns False).
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, min_scale: float = 1.0):
        for name, x in (("init_scale", init_scale), ("growth_factor", growth_factor),
                        ("backoff_factor", backoff_factor), ("min_scale", min_scale)):
            if isinstance(x, bool) or not isinstance(x, (int, float, np.integer, np.floating)) \
                    or not math.isfinite(float(x)):
                raise ValueError(f"DynamicLossScaler: {name} must be a finite number, got {x!r}")
        if min_scale <= 0:
            raise ValueError(f"DynamicLossScaler: min_scale must be > 0, got {min_scale}")
        if init_scale < min_scale:
            raise ValueError(f"DynamicLossScaler: init_scale must be >= min_scale ({min_scale}), got {init_scale}")
        if growth_factor <= 1.0:
            raise ValueError(f"DynamicLossScaler: growth_factor must be > 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"DynamicLossScaler: backoff_factor must be in (0, 1), got {backoff_factor}")
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, (int, np.integer)) \
                or growth_interval < 1:
            raise ValueError(f"DynamicLossScaler: growth_interval must be an int >= 1, got {growth_interval!r}")
        self.scale = float(init_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.min_scale = float(min_scale)
        self.clean_steps = 0       # clean steps in a row since the last change of scale
        self.skipped_steps = 0     # total steps skipped (for logging)

    def update(self, found_inf: bool) -> bool:
        """Adapt the scale after one step's gradients; return True when this step must be skipped."""
        if found_inf:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.clean_steps = 0
            self.skipped_steps += 1
            return True
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0
        return False

    def state_dict(self) -> dict:
        """Everything needed to continue a run (checkpoints)."""
        return {"scale": self.scale, "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "min_scale": self.min_scale,
                "clean_steps": self.clean_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        """Restore a state_dict()."""
        self.scale = float(state["scale"])
        self.growth_factor = float(state["growth_factor"])
        self.backoff_factor = float(state["backoff_factor"])
        self.growth_interval = int(state["growth_interval"])
        self.min_scale = float(state["min_scale"])
        self.clean_steps = int(state["clean_steps"])
        self.skipped_steps = int(state.get("skipped_steps", 0))


def scaled_step(opt, scaled_grads: np.ndarray, scaler: DynamicLossScaler, lr: Optional[float] = None,
                bf16_out: Optional[np.ndarray] = None) -> bool:
    """One mixed-precision optimizer step (NumPy reference); returns True when the step was skipped.

    opt: a gpullm_lessons.optim.AdamW over the fp32 master weights. scaled_grads: the flat gradient of
    `loss * scaler.scale` (not modified). Steps:
      1. unscale: g = scaled_grads * (1 / scale)  (a power of two: exact unless g underflows)
      2. check:   any inf/NaN in g?  -> scaler.update(found_inf) backs off (or grows) the scale
      3. skip:    on inf/NaN nothing else changes: master weights, m, v and the step count stay as they were
         or step: opt.step(g, lr), and bf16_out (uint16, same shape, optional) receives the bf16 bits of the
                  updated master weights (the copy the next forward pass would use).
    """
    if scaled_grads.shape != opt.params.shape:
        raise ValueError(f"scaled_step: scaled_grads has shape {scaled_grads.shape}, expected {opt.params.shape}")
    inv_scale = scaled_grads.dtype.type(1.0 / scaler.scale)
    with np.errstate(invalid="ignore", over="ignore"):       # inf * x and NaN are expected here
        grads = scaled_grads * inv_scale
    skip = scaler.update(found_inf=not grads_finite(grads))
    if skip:
        return True
    opt.step(grads, lr=lr)
    if bf16_out is not None:
        bf16_out[...] = f32_to_bf16_bits(opt.params)
    return False
