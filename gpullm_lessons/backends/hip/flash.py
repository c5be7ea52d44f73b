"""Flash attention (causal) forward and backward through kernels/hip/flash.cu, launched with CuPy (NVIDIA or AMD CDNA).

The same names as kernels/numba/flash.py; the inputs are half precision: q, k, v and dout are bfloat16 or float16
bits (uint16, ``half="bf16"`` or ``"fp16"``), out, lse, dq, dk, dv float32; every product of two tiles runs on the
matrix units (tensor cores, MFMA) with fp32 accumulation. Versions: v2 passes each product's result through shared
memory (portable.h's load / run / store tiles) for the softmax; v3 keeps S, P, dP and dS in the
registers the matrix units wrote (portable.h's register tiles); v4 (the default) is v3 reorganised as
FlashAttention-2 (128 rows per block, two 16-row tiles per warp in the forward and dQ, 8 warps in dK dV, the tiles
walked double-buffered with asynchronous copies; GEOMETRY has each kernel's block). The head size must be one the source is compiled for
(HEAD_SIZES). Shapes (B, nh, T, hs), lse (B, nh, T), C-contiguous CuPy arrays.

The packed launchers (flash_attention_forward_packed / _backward_packed) run v4 on the engine's layout: q, k, v read
straight out of the qkv product's rows (B, T, 3C), y written in format H into the (B, T, C) rows the attention
projection reads, dq, dk, dv written into the (B, T, 3C) float32 rows of dqkv; the head split and merge passes
around the heads layout disappear, and so does y's float32 copy (the backward's delta is taken from y in format H).
"""

from __future__ import annotations

import math

import numpy as np

from gpullm_lessons.contracts import check_version
from gpullm_lessons.contracts.flash import check_flash_args, scale_of

VERSIONS = ("v2", "v3", "v4")
DEFAULT = "v4"
HEAD_SIZES = (16, 32, 48, 64)  # flash.cu's FLASH_ENTRIES
HALF_FORMATS = ("bf16", "fp16")  # the engine's names; flash.cu's entry points end in _bf16 / _f16
_SUFFIX = {"bf16": "bf16", "fp16": "f16"}
WARPS = 4  # warps per block (flash.cu's FLASH_WARPS), v2 and v3
ROWS = 64  # rows a block owns (FLASH_ROWS), v2 and v3: the most row blocks of any version
# (rows a block owns, warps per block) of each kernel: v4's are flash.cu's FLASH4_ROWS, FLASH4_WARPS and
# FLASH4_DKDV_WARPS (the entry points' __launch_bounds__: a launch with more threads fails)
GEOMETRY = {
    "v2": {"forward": (ROWS, WARPS), "dkdv": (ROWS, WARPS), "dq": (ROWS, WARPS)},
    "v3": {"forward": (ROWS, WARPS), "dkdv": (ROWS, WARPS), "dq": (ROWS, WARPS)},
    "v4": {"forward": (128, 4), "dkdv": (128, 8), "dq": (128, 4)},
}
LAUNCHERS = ("flash_attention_forward_packed", "flash_attention_backward_packed")  # the engine's (backends/_collect.py)
MAX_GRID_Y = 65535
DELTA_BLOCKS = 4096  # the delta kernel's grid cap (grid-stride over rows)


def supports(hs: int, half) -> bool:
    """Whether flash.cu has kernels for this head size and half format (the engine's choice of attention path)."""
    return hs in HEAD_SIZES and half in HALF_FORMATS


def _check(fn, version, half, heads, rows, outs):
    check_version(fn, version, VERSIONS)
    if half not in HALF_FORMATS:
        raise ValueError(
            f"{fn}: half={half!r} is not one of {', '.join(HALF_FORMATS)} (the HIP flash kernels read q, k, v as "
            "16-bit floats; fp32 attention runs on kernels/numba/flash.py or the cuBLAS path)"
        )
    B, nh, T, hs = check_flash_args(fn, heads, rows, cupy=True, dtypes=("uint16",), outs=outs)
    if hs not in HEAD_SIZES:
        raise ValueError(
            f"{fn}: head size hs = {hs} has no kernel: flash.cu is compiled for hs in {HEAD_SIZES} (multiples of 16, "
            "the matrix units' tile)"
        )
    blocks = math.ceil(T / ROWS)
    if blocks > MAX_GRID_Y:
        raise ValueError(f"{fn}: T = {T} needs {blocks} row blocks, more than the grid's {MAX_GRID_Y}")
    if B * nh > 2**31 - 1:
        raise ValueError(f"{fn}: B * nh = {B * nh} heads exceed the grid's x dimension")
    return B, nh, T, hs


def _kernel(name):
    """flash.cu's entry point `name`; a CUDA install without the crt/ headers that <mma.h> includes is named."""
    from gpullm_lessons import hip

    try:
        return hip.kernel("flash", name)
    except Exception as e:  # noqa: BLE001 - CuPy's CompileException; anything else is raised as it is
        if "crt/mma.h" in str(e):
            raise RuntimeError(
                f"{name}: NVRTC cannot find crt/mma.h (NVIDIA's tensor-core header <mma.h> includes it): install the "
                "CUDA headers' crt folder: `pip install nvidia-cuda-crt` on CUDA 13 (in the course's cuda13 extra: "
                "make setup GPU=cuda13) or `pip install nvidia-cuda-nvcc-cu12` on CUDA 12 (in the cuda12 extra), or "
                "point CUDA_PATH to a CUDA toolkit"
            ) from None
        raise


def _launch(version, kernel, heads, T):
    """(grid, block) of one of `version`'s kernels ("forward", "dkdv", "dq") over `heads` heads of T rows."""
    from gpullm_lessons import hip

    rows, warps = GEOMETRY[version][kernel]
    return (heads, math.ceil(T / rows)), (warps * hip.warp_size(),)


def flash_attention_forward(q, k, v, out, lse, version=DEFAULT, half="bf16"):
    """out = causal softmax(q k^T / sqrt(hs)) v (float32) and lse = each row's log-sum-exp (float32), from q, k, v
    in half precision (bits), without the (T, T) scores. q, k, v uint16 (B, nh, T, hs); out float32 (B, nh, T, hs);
    lse float32 (B, nh, T)."""
    fn = "flash_attention_forward"
    B, nh, T, hs = _check(fn, version, half, [("q", q), ("k", k), ("v", v)], [("lse", lse)], [("out", out)])
    if B * nh * T == 0:
        return
    kern = _kernel(f"flash_attention_forward_{version}_hs{hs}_{_SUFFIX[half]}")
    kern(*_launch(version, "forward", B * nh, T), (q, k, v, out, lse, np.int32(T), scale_of(hs)))


def flash_attention_backward(q, k, v, out, dout, lse, dq, dk, dv, version=DEFAULT, half="bf16"):
    """dq, dk, dv (float32) of the causal attention out = flash_attention_forward(q, k, v), from the saved out and
    lse; q, k, v, dout uint16 half bits (B, nh, T, hs). The probabilities are recomputed from lse; each element of
    dq, dk, dv is summed in a fixed order (no atomics): the same bits on every run."""
    import cupy as cp

    from gpullm_lessons import hip

    fn = "flash_attention_backward"
    heads = [("q", q), ("k", k), ("v", v), ("dout", dout)]
    outs = [("out", out), ("dq", dq), ("dk", dk), ("dv", dv)]
    B, nh, T, hs = _check(fn, version, half, heads, [("lse", lse)], outs)
    if B * nh * T == 0:
        return
    rows = B * nh * T
    delta = cp.empty((B, nh, T), cp.float32)
    warps = 256 // hip.warp_size()
    _kernel(f"flash_attention_backward_v2_delta_{_SUFFIX[half]}")(  # every version: one warp per row
        (min(math.ceil(rows / warps), DELTA_BLOCKS),), (256,), (out, dout, delta, np.int64(rows), np.int32(hs))
    )
    scale = scale_of(hs)
    _kernel(f"flash_attention_backward_{version}_dkdv_hs{hs}_{_SUFFIX[half]}")(
        *_launch(version, "dkdv", B * nh, T), (q, k, v, dout, lse, delta, dk, dv, np.int32(T), scale)
    )
    _kernel(f"flash_attention_backward_{version}_dq_hs{hs}_{_SUFFIX[half]}")(
        *_launch(version, "dq", B * nh, T), (q, k, v, dout, lse, delta, dq, np.int32(T), scale)
    )


def _check_packed(fn, half, nh, pairs):
    """pairs: (name, array, columns as a multiple of C, dtype); every array (B, T, cols * C), C-contiguous, 16-byte
    aligned (the kernels copy rows 16 bytes at a time). Returns (B, T, nh, hs)."""
    from gpullm_lessons.contracts import check_array, is_cupy, shape_of

    for name, a, _, _ in pairs:
        if not is_cupy(a):
            raise TypeError(
                f"{fn}: {name} must be a CuPy array (the HIP kernels run on the GPU), got {type(a).__name__}"
            )
    if half not in HALF_FORMATS:
        raise ValueError(f"{fn}: half={half!r} is not one of {', '.join(HALF_FORMATS)}")
    if isinstance(nh, bool) or not isinstance(nh, (int, np.integer)) or nh < 1:
        raise ValueError(f"{fn}: nh must be a positive int (the number of heads), got {nh!r}")
    name0, a0, cols0, _ = pairs[0]
    shape = shape_of(a0)
    if len(shape) != 3 or shape[2] % (cols0 * nh):
        raise ValueError(f"{fn}: {name0} must be (B, T, {cols0}C) with C = nh * hs, nh = {nh}, got shape {shape}")
    B, T, C = shape[0], shape[1], shape[2] // cols0
    hs = C // nh
    for name, a, cols, dtype in pairs:
        check_array(fn, name, a, (B, T, cols * C) if cols else (B, nh, T), dtype, cupy=True)
        if a.data.ptr % 16:
            raise ValueError(f"{fn}: {name} must start on a 16-byte boundary (the kernels copy 16 bytes at a time)")
    if hs not in HEAD_SIZES:
        raise ValueError(
            f"{fn}: head size hs = C / nh = {hs} has no kernel: flash.cu is compiled for hs in {HEAD_SIZES}"
        )
    if math.ceil(T / ROWS) > MAX_GRID_Y:
        raise ValueError(f"{fn}: T = {T} needs more row blocks than the grid's {MAX_GRID_Y}")
    return B, T, nh, hs


def flash_attention_forward_packed(qkv, out, lse, nh, half="bf16"):
    """v4 on the engine's layout: out (B, T, C) uint16 in format `half` = y with its heads side by side, lse (B, nh, T)
    float32, from qkv (B, T, 3C) uint16 (q, k, v side by side in each row, the bias already added); C = nh * hs."""
    fn = "flash_attention_forward_packed"
    B, T, nh, hs = _check_packed(
        fn, half, nh, [("qkv", qkv, 3, "uint16"), ("out", out, 1, "uint16"), ("lse", lse, 0, "float32")]
    )
    if B * T == 0:
        return
    kern = _kernel(f"flash_attention_forward_v4_packed_hs{hs}_{_SUFFIX[half]}")
    kern(*_launch("v4", "forward", B * nh, T), (qkv, out, lse, np.int32(T), np.int32(nh), scale_of(hs)))


def flash_attention_backward_packed(qkv, out, dout, lse, dqkv, nh, half="bf16"):
    """dqkv (B, T, 3C) float32: dq, dk, dv side by side in each row, of out = flash_attention_forward_packed(qkv),
    from qkv, out and dout (B, T, C) uint16 in format `half`, and lse; summed in a fixed order (the same bits on every
    run). Every element of dqkv is written."""
    fn = "flash_attention_backward_packed"
    pairs = [("qkv", qkv, 3, "uint16"), ("out", out, 1, "uint16"), ("dout", dout, 1, "uint16")]
    pairs += [("lse", lse, 0, "float32"), ("dqkv", dqkv, 3, "float32")]
    B, T, nh, hs = _check_packed(fn, half, nh, pairs)
    if B * T == 0:
        return
    import cupy as cp

    from gpullm_lessons import hip

    rows = B * T * nh
    delta = cp.empty((B, nh, T), cp.float32)
    warps = 256 // hip.warp_size()
    _kernel(f"flash_attention_backward_v4_packed_delta_{_SUFFIX[half]}")(
        (min(math.ceil(rows / warps), DELTA_BLOCKS),),
        (256,),
        (out, dout, delta, np.int64(rows), np.int32(hs), np.int32(T), np.int32(nh)),
    )
    args = (qkv, dout, lse, delta, dqkv, np.int32(T), np.int32(nh), scale_of(hs))
    suffix = f"hs{hs}_{_SUFFIX[half]}"
    _kernel(f"flash_attention_backward_v4_packed_dkdv_{suffix}")(*_launch("v4", "dkdv", B * nh, T), args)
    _kernel(f"flash_attention_backward_v4_packed_dq_{suffix}")(*_launch("v4", "dq", B * nh, T), args)
