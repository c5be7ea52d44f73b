"""Block-wise 8-bit quantisation of AdamW's moments (lesson 12): 1 byte per value plus one fp32 scale per block.

A flat float32 vector of n values is cut into blocks of `block` consecutive values (the last one may be shorter).
Each block keeps its absolute maximum a (fp32) and every value as the nearest of 255 (signed) or 256 (unsigned)
evenly spaced levels between -a and a (or 0 and a):

    signed   (the first moment m, any sign):      q = round(x / a * 127)  as int8,  x ~ q / 127 * a
    unsigned (the second moment v, never < 0):    r = round(sqrt(v) / a * 255) as uint8 with a = max sqrt(v) of the
                                                  block,  sqrt(v) ~ r / 255 * a

The block keeps the error small relative to its own largest value: one outlier spoils only its block, not the whole
tensor. v is stored as its square root because AdamW divides by sqrt(v): levels evenly spaced in sqrt(v) spread the
rounding error evenly over the denominator, and the square root halves v's span of exponents. A sqrt(v) that rounds
to level 0 is read back as half a level, never 0: m / (sqrt(0) + eps) would turn a small m into a step of lr * m / eps.
Rounding is to nearest (np.rint: ties to even); an all-zero block has scale 0 and reads back as zeros.

    quantize_blockwise(x, block, signed) -> (q, scales)      dequantize_blockwise(q, scales, block, signed) -> x
    quantize_moments(m, v, block) / dequantize_moments(...)   AdamW's pair, as the engine stores them
    moment_bytes(n, block)                                    the bytes of both moments: 2n + 2 * 4 * ceil(n / block)
"""

from __future__ import annotations

import math

import numpy as np

BLOCK = 256  # values per block (bitsandbytes' block-wise optimizers use 2048; smaller blocks, smaller errors)
LEVELS = {True: 127, False: 255}


def _check(fn, x, block):
    x = np.asarray(x)
    if x.ndim != 1:
        raise ValueError(f"{fn}: expects a flat (n,) vector, got shape {x.shape}")
    if not isinstance(block, (int, np.integer)) or block < 1:
        raise ValueError(f"{fn}: block must be a positive int, got {block!r}")
    return x


def quantize_blockwise(x, block: int = BLOCK, signed: bool = True):
    """(q, scales): q int8 (signed) or uint8 (n,), scales float32 (ceil(n / block),), each its block's absmax."""
    x = _check("quantize_blockwise", x, block).astype(np.float32, copy=False)
    if not signed and x.size and float(x.min()) < 0:
        raise ValueError("quantize_blockwise: signed=False quantises values >= 0 only (got a negative value)")
    n, nb = x.size, math.ceil(x.size / block)
    padded = np.zeros(nb * block, np.float32)
    padded[:n] = x
    blocks = padded.reshape(nb, block)
    scales = np.abs(blocks).max(axis=1) if nb else np.zeros(0, np.float32)
    safe = np.where(scales > 0, scales, 1.0).astype(np.float32)
    levels = LEVELS[bool(signed)]
    q = np.rint(blocks / safe[:, None] * levels)
    q = q.astype(np.int8 if signed else np.uint8).reshape(-1)[:n]
    return q, scales.astype(np.float32)


def dequantize_blockwise(q, scales, block: int = BLOCK, signed: bool = True) -> np.ndarray:
    """float32 (n,): each q times its block's scale / levels (the inverse of quantize_blockwise, up to rounding)."""
    q = _check("dequantize_blockwise", q, block)
    scales = np.asarray(scales, np.float32)
    if scales.shape != (math.ceil(q.size / block),):
        raise ValueError(f"dequantize_blockwise: {q.size} values in blocks of {block} need "
                         f"{math.ceil(q.size / block)} scales, got {scales.shape}")
    per = np.repeat(scales, block)[: q.size]
    return (q.astype(np.float32) * (per / np.float32(LEVELS[bool(signed)]))).astype(np.float32)


def quantize_moments(m, v, block: int = BLOCK) -> dict:
    """AdamW's moments in 8 bits: m signed; v as sqrt(v), unsigned. Returns {"m", "m_scale", "v", "v_scale"}."""
    qm, sm = quantize_blockwise(m, block, signed=True)
    qv, sv = quantize_blockwise(np.sqrt(np.maximum(np.asarray(v, np.float32), 0)), block, signed=False)
    return {"m": qm, "m_scale": sm, "v": qv, "v_scale": sv}


def dequantize_moments(state: dict, block: int = BLOCK) -> tuple:
    """(m, v) float32 from quantize_moments' dict; a sqrt(v) at level 0 reads as half a level (module docstring)."""
    m = dequantize_blockwise(state["m"], state["m_scale"], block, signed=True)
    r = state["v"].astype(np.float32)
    r = np.where(r == 0, np.float32(0.5), r)
    sqrt_v = dequantize_blockwise(r, state["v_scale"], block, signed=False)
    return m, sqrt_v * sqrt_v


def moment_bytes(n: int, block: int = BLOCK) -> int:
    """Bytes of m and v in 8 bits: one byte per value each, plus one fp32 scale per block each."""
    return 2 * n + 2 * 4 * math.ceil(n / block)
