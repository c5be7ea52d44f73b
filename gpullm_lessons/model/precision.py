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

Half-precision matmuls, emulated: `with matmul_precision("bf16"):` (or "fp16") makes every matmul of the reference
ops (reference/linear.py, reference/attention.py, forward and backward) round its two INPUTS to that format and
multiply them in float32. The product of two bf16 (8-bit significand) or two fp16 (11-bit) numbers is exact in
float32 (24 bits), so this is what a GPU GEMM with half inputs and fp32 accumulation computes, up to the order of
the additions. The default, "fp32", rounds nothing: the reference is bit-identical to the plain float32 code.
`compare_precisions` trains the reference GPT from one init on the same batches under each precision (fp16 with
the dynamic loss scaler) and returns the per-step losses: the measure of "half precision tracks fp32".
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

# the formats and the emulated half-precision matmuls live with the reference ops that use them
from ..reference.rounding import (MATMUL_PRECISIONS, RoundingStats, _ROUNDERS, bf16_bits_to_f32,  # noqa: F401
                                  f32_to_bf16_bits, matmul_precision, mm_round, round_to)

__all__ = ["f32_to_bf16_bits", "bf16_bits_to_f32", "grads_finite", "nonfinite_count", "DynamicLossScaler",
           "scaled_step", "MATMUL_PRECISIONS", "matmul_precision", "round_to", "RoundingStats", "format_rows",
           "compare_precisions", "TRACK_RTOL", "tracks", "format_table", "FORMATS"]


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

    opt: a gpullm_lessons.model.optim.AdamW over the fp32 master weights. scaled_grads: the flat gradient of
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


# ---- the three formats, bit by bit ----------------------------------------------------------------------------------

FORMATS = {  # name: (exponent bits, mantissa bits, total bits)
    "fp32": (8, 23, 32), "fp16": (5, 10, 16), "bf16": (8, 7, 16)}


def relative_error(value: float, stored: float) -> float:
    """|stored - value| / |value| for a value and what a format stored of it: 0 for an exact value (and for NaN
    kept as NaN), inf where a finite value overflowed, NaN where a number became NaN."""
    v, stored = float(value), float(stored)
    if math.isnan(v) or math.isnan(stored):
        return 0.0 if (math.isnan(v) and math.isnan(stored)) else math.nan
    if math.isinf(stored) and not math.isinf(v):
        return math.inf
    return 0.0 if v == 0 or stored == v else abs(stored - v) / abs(v)


def format_rows(value: float) -> list:
    """How `value` (a Python float) is stored in fp32, fp16 and bf16, each rounded to nearest even from the
    float32 value: a list of dicts with name, bits (str 'sign exponent mantissa'), hex, stored (the value the
    format holds, as a float), rel_err (|stored - value| / |value|; 0 for value 0; inf on overflow)."""
    x = np.float32(value)
    rows = []
    for name, (e, m, n) in FORMATS.items():
        if name == "fp32":
            bits = int(np.array(x).view(np.uint32))
            stored = float(x)
        elif name == "fp16":
            with np.errstate(over="ignore"):
                h = np.array(x, np.float16)
            bits = int(h.view(np.uint16))
            stored = float(h)
        else:
            b = f32_to_bf16_bits(np.array([x]))
            bits = int(b[0])
            stored = float(bf16_bits_to_f32(b)[0])
        s = format(bits, f"0{n}b")
        rel = relative_error(value, stored)
        rows.append({"name": name, "bits": f"{s[0]} {s[1:1 + e]} {s[1 + e:]}", "hex": f"0x{bits:0{n // 4}X}",
                     "stored": stored, "rel_err": rel})
    return rows


def tf32_row(value: float) -> dict:
    """How `value` is stored as TF32, what tensor cores read of an fp32 input in an fp32 matmul (cuBLAS's TF32
    mode): the float32 value rounded to 10 mantissa bits (to nearest, ties to even), in a 32-bit word whose low 13
    bits are zero. Keys as format_rows."""
    with np.errstate(over="ignore"):                     # past fp32's range: inf, as a cast gives
        bits = int(np.array(np.float32(value)).view(np.uint32))
    if (bits >> 23) & 0xFF == 0xFF:                      # inf stays inf; NaN stays a (quiet) NaN
        bits = (bits | (0x400000 if bits & 0x7FFFFF else 0)) & 0xFFFFE000
    else:
        bits = (bits + 0xFFF + ((bits >> 13) & 1)) & 0xFFFFE000
    stored = float(np.array(bits, np.uint32).view(np.float32))
    s = format(bits, "032b")
    return {"name": "tf32", "bits": f"{s[0]} {s[1:9]} {s[9:19]}", "hex": f"0x{bits:08X}", "stored": stored,
            "rel_err": relative_error(value, stored)}


def format_table(value: float) -> str:
    """format_rows(value) as a text table (one line per format), the sign, exponent and mantissa bits each in a
    column under its header."""
    lines = [f"value {float(value)!r}", f"{'format':6s} {'s':1s} {'exponent':8s} {'mantissa':23s} {'hex':10s} "
             f"{'stored value':>18s} {'rel. error':>10s}"]
    for r in format_rows(value):
        sign, exponent, mantissa = r["bits"].split()
        lines.append(f"{r['name']:6s} {sign:1s} {exponent:8s} {mantissa:23s} {r['hex']:10s} {r['stored']:18.10g} "
                     f"{r['rel_err']:10.2e}")
    return "\n".join(lines)


# ---- training under each precision --------------------------------------------------------------------------------

# A half-precision run tracks fp32 when |loss_half - loss_fp32| <= TRACK_RTOL * loss_fp32 at every step. Measured on
# small reference GPTs (L 1-2, C 32-64, T 16-32, B 8-16, 60-150 steps, seed 0): bf16 at most 1e-4 .. 7e-4; fp16 with
# loss scaling ~2e-5 without skipped steps, up to 0.8% when an overflow skips a step mid-run; fp8 e4m3 (no per-tensor
# scaling) 16% .. 36%: it fails. 2% leaves a wide margin on both sides.
TRACK_RTOL = 0.02


def compare_precisions(cfg, steps: int = 60, batch: int = 8, precisions=("fp32", "bf16", "fp16"), seed: int = 0,
                       loss_scale: bool = True, lr: float = 1e-3, warmup: Optional[int] = None,
                       weight_decay: float = 0.1, init_scale: float = 2.0 ** 16, growth_interval: int = 2000,
                       data=None, dloss: float = 1.0) -> dict:
    """Train the reference GPT `cfg` for `steps` steps under each matmul precision, from the same init
    (init_params(cfg, seed)) on the same batches (BatchSampler(corpus.train, batch, cfg.block_size, seed)).

    Every run keeps fp32 master weights and an fp32 AdamW (betas 0.9, 0.95; weight decay on the matrices;
    warmup then cosine learning rate, no gradient clipping); only the matmuls see half-precision inputs (see
    matmul_precision). fp16 with loss_scale=True: the backward starts from dloss = scale (DynamicLossScaler(
    init_scale, growth_interval)) and the step is scaled_step (unscale, skip on inf/NaN, back off / grow).
    fp16 with loss_scale=False, and bf16: dloss = 1 and a plain step.
    dloss: what the backward starts from (times the loss scale), divided back out of the fp32 gradients before the
    step. Below 1 it gives this small model's gradients the size a larger run's have: the loss is a mean over
    N = B*T tokens, so a dlogits element is about 1 / (N * V), 3e-5 here and 1e-9 for GPT-2 (B*T = 16384,
    V = 50257), below fp16's smallest subnormal. A power of two leaves the fp32 run bit for bit unchanged.

    Returns {precision: {"loss": [per-step loss of the batch before its update], "scale": [scale used per step],
    "skipped": [steps skipped, 1-based], "flushed": fraction of nonzero backward-matmul inputs that underflowed to
    0, "flushed_forward": the same in the forward, "overflowed": backward-matmul inputs that overflowed}}.
    The loss of a skipped step is the loss its batch had (the step itself changed nothing).
    """
    from ..data import BatchSampler, load_corpus
    from .optim import AdamW, decay_mask_for, lr_schedule
    from .params import ParamBuffer, init_params
    from ..reference import gpt_backward, gpt_forward

    corpus = load_corpus(data, block_size=cfg.block_size)
    warmup = max(1, steps // 10) if warmup is None else warmup
    decay = decay_mask_for(cfg)
    out = {}
    for name in precisions:
        if name not in _ROUNDERS:
            raise ValueError(f"compare_precisions: unknown precision {name!r}; use one of {', '.join(_ROUNDERS)}")
        params = init_params(cfg, seed=seed, dtype=np.float32)
        grads = ParamBuffer(cfg, dtype=np.float32)
        opt = AdamW(params.flat, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay, decay_mask=decay)
        sampler = BatchSampler(corpus.train, batch, cfg.block_size, seed=seed)
        scaled = name == "fp16" and loss_scale
        scaler = DynamicLossScaler(init_scale=init_scale, growth_interval=growth_interval) if scaled else None
        run = {"loss": [], "scale": [], "skipped": []}
        fwd_total, bwd_total = RoundingStats(name), RoundingStats(name)
        for step in range(1, steps + 1):
            x, y = next(sampler)                                        # (B, T) int32 each
            with matmul_precision(name) as fs:
                _, loss, cache = gpt_forward(params.views, cfg, x, y)
            scale = scaler.scale if scaled else 1.0
            with np.errstate(over="ignore", invalid="ignore"), matmul_precision(name) as bs:
                gpt_backward(cache, grads.views, dloss=scale * dloss)   # as (loss * scale * dloss).backward()
            if dloss != 1.0:
                grads.flat /= np.float32(dloss)
            for total, s in ((fwd_total, fs), (bwd_total, bs)):
                total.values += s.values
                total.nonzero += s.nonzero
                total.flushed += s.flushed
                total.overflowed += s.overflowed
            step_lr = lr_schedule(step - 1, lr, warmup, steps, lr / 10)
            if scaled:
                if scaled_step(opt, grads.flat, scaler, lr=step_lr):
                    run["skipped"].append(step)
            else:
                opt.step(grads.flat, lr=step_lr)
            run["loss"].append(float(loss))
            run["scale"].append(scale)
        run["flushed"] = bwd_total.flushed_fraction
        run["flushed_forward"] = fwd_total.flushed_fraction
        run["overflowed"] = bwd_total.overflowed
        out[name] = run
    return out


def tracks(losses, reference, rtol: float = TRACK_RTOL) -> bool:
    """True when every step's loss is within rtol * reference loss of the reference run's (and finite)."""
    a, b = np.asarray(losses, dtype=np.float64), np.asarray(reference, dtype=np.float64)
    return bool(a.shape == b.shape and np.all(np.isfinite(a)) and np.all(np.abs(a - b) <= rtol * np.abs(b)))
