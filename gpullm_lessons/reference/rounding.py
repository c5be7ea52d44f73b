"""Half-precision formats for the reference: bfloat16 bits, rounding to bf16 / fp16 / fp8, and emulated half-precision
matmuls (``with matmul_precision("bf16"):`` rounds the inputs of every reference matmul, which accumulate in float32).

The reference ops (linear, attention) call ``mm_round`` on their matmul inputs; outside a ``matmul_precision`` block
it returns its argument unchanged, so the fp32 reference is bit-identical to plain float32 code. Lesson 07 teaches
the formats and the loss scaling built on them (gpullm_lessons.model.precision, which re-exports these names).
"""
from __future__ import annotations

import contextlib
import dataclasses

import numpy as np


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


# ---- emulated half-precision matmuls ------------------------------------------------------------------------------

def _round_bf16(x: np.ndarray) -> np.ndarray:
    return bf16_bits_to_f32(f32_to_bf16_bits(x))


def _round_fp16(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):                        # |x| > 65504 -> inf: fp16's overflow, on purpose
        return x.astype(np.float16).astype(np.float32)


def _round_ml_dtype(name):
    def rnd(x):
        import ml_dtypes
        with np.errstate(over="ignore", invalid="ignore"):
            return x.astype(getattr(ml_dtypes, name)).astype(np.float32)
    return rnd


def _round_tf32(x):
    """float32 -> the TF32 value tensor cores read of it (cuBLAS's TF32 mode): 10 mantissa bits, to nearest even;
    inf and NaN kept."""
    bits = x.view(np.uint32)
    finite = (bits & 0x7F800000) != 0x7F800000
    rounded = (bits + np.uint32(0xFFF) + ((bits >> np.uint32(13)) & np.uint32(1))) & np.uint32(0xFFFFE000)
    return np.where(finite, rounded, bits).astype(np.uint32).view(np.float32)


# name -> rounding of a float32 array to that format (values kept as float32). The fp8 formats are here to show
# what does NOT track without per-tensor scaling (3 and 2 mantissa bits, 2^-9 and 2^-16 the smallest values).
_ROUNDERS = {"fp32": None, "tf32": _round_tf32, "bf16": _round_bf16, "fp16": _round_fp16,
             "fp8_e4m3": _round_ml_dtype("float8_e4m3fn"), "fp8_e5m2": _round_ml_dtype("float8_e5m2")}
MATMUL_PRECISIONS = ("fp32", "bf16", "fp16")      # the course's formats (the fp8 ones are accepted too)


def round_to(x, name: str) -> np.ndarray:
    """x rounded to the format `name` (round to nearest even), returned as float32 values. "fp32": a float32 copy."""
    if name not in _ROUNDERS:
        raise ValueError(f"round_to: unknown format {name!r}; use one of {', '.join(_ROUNDERS)}")
    x = np.ascontiguousarray(x, dtype=np.float32)
    return x.copy() if _ROUNDERS[name] is None else _ROUNDERS[name](x)


@dataclasses.dataclass
class RoundingStats:
    """What the rounding of matmul inputs did inside one `with matmul_precision(...)` block."""
    precision: str
    values: int = 0        # matmul input elements rounded
    nonzero: int = 0       # of those, nonzero before rounding
    flushed: int = 0       # nonzero before, exactly 0 after: underflow
    overflowed: int = 0    # finite before, inf (or NaN) after: overflow

    @property
    def flushed_fraction(self) -> float:
        """flushed / nonzero: the fraction of nonzero inputs that underflowed to zero."""
        return self.flushed / self.nonzero if self.nonzero else 0.0


_STATE = {"name": "fp32", "stats": None}   # the only state: set by matmul_precision, read by mm_round


@contextlib.contextmanager
def matmul_precision(name: str = "fp32"):
    """Inside the block, the reference matmuls round their inputs to `name` ("fp32", "bf16", "fp16"; also
    "fp8_e4m3", "fp8_e5m2") and accumulate in float32. Yields a RoundingStats that counts underflows and
    overflows of the rounded inputs. Blocks nest; the previous precision is restored on exit.

        with matmul_precision("bf16") as stats:
            logits, loss, cache = gpt_forward(params, cfg, x, y)
        print(stats.flushed_fraction)
    """
    if name not in _ROUNDERS:
        raise ValueError(f"matmul_precision: unknown precision {name!r}; use one of {', '.join(_ROUNDERS)}")
    saved = dict(_STATE)
    stats = RoundingStats(name)
    _STATE.update(name=name, stats=stats)
    try:
        yield stats
    finally:
        _STATE.update(saved)


def mm_round(x):
    """A matmul input as the current matmul_precision sees it: x itself under "fp32" (the default: no copy, no
    change), else x rounded to the half format (in x's dtype, float32 values), counted in the block's stats."""
    name = _STATE["name"]
    if name == "fp32":
        return x
    x = np.asarray(x)
    r = _ROUNDERS[name](x.astype(np.float32))
    stats = _STATE["stats"]
    if stats is not None:
        nz = x != 0
        stats.values += x.size
        stats.nonzero += int(np.count_nonzero(nz))
        stats.flushed += int(np.count_nonzero(nz & (r == 0)))
        stats.overflowed += int(np.count_nonzero(np.isfinite(x) & ~np.isfinite(r)))
    return r.astype(x.dtype, copy=False)
