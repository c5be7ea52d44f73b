"""Flash attention (causal) forward and backward through kernels/hip/flash.cu, launched with CuPy (NVIDIA or AMD CDNA).

The same names as kernels/numba/flash.py; the inputs are half precision: q, k, v and dout are bfloat16 or float16
bits (uint16, ``half="bf16"`` or ``"fp16"``), out, lse, dq, dk, dv float32; every product of two tiles runs on the
matrix units (tensor cores, MFMA) with fp32 accumulation. Versions: v2 passes each product's result through shared
memory (portable.h's load / run / store tiles) for the softmax; v3 keeps S, P, dP and dS in the registers the matrix
units wrote (portable.h's register tiles); v4 is v3 reorganised as FlashAttention-2 (128 rows per block, two 16-row
tiles per warp in the forward and dQ, 8 warps in dK dV, the tiles walked double-buffered with asynchronous copies);
v5 is v4 with less work between the products: only the tiles on the diagonal masked, the scale folded into the
exponent's fma, the exponential and the rounding to 16 bits one instruction each on NVIDIA; v6 (the default) is v5
with fewer instructions around the products (copies unrolled, results stored in pairs, independent products issued
back to back, row max and sum as trees, one reciprocal per row, the backward's delta inside the dQ kernel). v5 also
has a backward in one kernel (fused=True): the dK dV kernel computes dQ too, and the key blocks of a head add their
dQ into the same rows in a fixed order (turn counters), so S and dP are computed once and the bits are the same on
every run; on the H200 it is slower than the two kernels (lesson 11). GEOMETRY has each kernel's block.
flash.cu has one section per version (its kernels, then its entry points and their FLASH_PART blocks: v2, v3, v4 with
v5 and v6 as its LV levels, v5's fused backward, the delta pass); kernels/hip/flash_common.h holds what several share.
The head size must be one the source is compiled for (HEAD_SIZES). Shapes (B, nh, T, hs), lse (B, nh, T),
C-contiguous CuPy arrays.

Attention in general (causal=False, a (Tq, Tk) mask, Tq != Tk; contracts/flash.py's form, the math of
kernels/numba/flash.py's general kernels) runs on v3's general entry points (GENERAL: version="v3"), v3's code with the
general tests compiled in; a causal call over Tq == Tk without a mask runs the version asked for, as before.

The packed launchers (flash_attention_forward_packed / _backward_packed) run v6 (or v5, v4; or v7 on an H100 / H200,
runtime/sm90.py) on the engine's layout: q,
k, v read straight out of the qkv product's rows (B, T, 3C), y written in format H into the (B, T, C) rows the attention
projection reads, dq, dk, dv written into the (B, T, 3C) float32 rows of dqkv (v6: or its rows in format H, HALF_GRADS'
_hg entry points); the head split and merge passes around the heads layout disappear, and so does y's float32 copy
(the backward's delta is taken from y in format H).
"""

from __future__ import annotations

import math

import numpy as np

from gpullm_lessons.contracts import check_version
from gpullm_lessons.contracts.flash import check_attention_mask, check_flash_args, check_flash_qk_args, scale_of

VERSIONS = ("v2", "v3", "v4", "v5", "v6")
DEFAULT = "v6"
HEAD_SIZES = (16, 32, 48, 64)  # the head sizes of flash.cu's entry points (each section's FLASH_ENTRIES_* lines)
HALF_FORMATS = ("bf16", "fp16")  # the engine's names; flash.cu's entry points end in _bf16 / _f16
_SUFFIX = {"bf16": "bf16", "fp16": "f16"}
WARPS = 4  # warps per block (FLASH_WARPS, kernels/hip/flash_common.h), v2 and v3
ROWS = 64  # rows a block owns (FLASH_ROWS, flash_common.h), v2 and v3: the most row blocks of any version
# (rows a block owns, warps per block) of each kernel: v4's are flash.cu's FLASH4_ROWS, FLASH4_WARPS and
# FLASH4_DKDV_WARPS (the entry points' __launch_bounds__: a launch with more threads fails)
GEOMETRY = {
    "v2": {"forward": (ROWS, WARPS), "dkdv": (ROWS, WARPS), "dq": (ROWS, WARPS)},
    "v3": {"forward": (ROWS, WARPS), "dkdv": (ROWS, WARPS), "dq": (ROWS, WARPS)},
    "v4": {"forward": (128, 4), "dkdv": (128, 8), "dq": (128, 4)},
    "v5": {"forward": (128, 4), "dkdv": (128, 8), "dq": (128, 4), "fused": (128, 8)},  # fused: one-kernel backward
    "v6": {"forward": (128, 4), "dkdv": (128, 8), "dq": (128, 4)},
}
PACKED = ("v4", "v5", "v6")  # the versions with entry points on the engine's packed layout
HALF_GRADS = ("v6",)  # the packed versions whose backward can write dqkv in the half format (_hg entry points)
# v7: Hopper's warpgroup products (kernels/sm90/flash_v7.cu through runtime/sm90.py), NVIDIA H100 / H200 only, on the
# packed layout alone, bf16, head size 64, T a multiple of 64; not a version of flash.cu (no AMD form)
SM90 = ("v7",)
# the versions with entry points for attention in general (causal=False, a mask, Tq != Tk): v3's code with the
# general tests compiled in (flash.cu's FLASH_ENTRIES_V3_GENERAL); the others run causal attention with Tq == Tk only
GENERAL = ("v3",)
DQ_DELTA = ("v6",)  # versions whose dQ kernel computes delta itself (it runs first; no delta pass)
# other ways to run beside the versions (bench kernels times them as rows of their own): v5's one-kernel backward
VARIANTS = {"flash_attention_backward": [("v5-fused", {"version": "v5", "fused": True})]}
V5_QUERY_TILE = 64  # flash.cu's FLASH5_QT: the query rows of the tiles v5's backward walks (one turn counter each)
LAUNCHERS = ("flash_attention_forward_packed", "flash_attention_backward_packed")  # the engine's (backends/_collect.py)
MAX_GRID_Y = 65535
DELTA_BLOCKS = 4096  # the delta kernel's grid cap (grid-stride over rows)
DELTA_THREADS = 256  # the delta kernel's block


def _delta_launch(rows: int, hs: int):
    """(grid, block) of the delta kernels: a row of hs elements is shared by flash_delta's lpr lanes (flash_common.h:
    the largest power of two up to 8 dividing its hs / 8 chunks of 16 bytes); the kernels index rows in 32 bits."""
    if rows >= 2**31:
        raise ValueError(
            f"the flash backward's delta pass indexes rows in 32 bits: {rows} rows (B * nh * T) are too many"
        )
    chunks = hs // 8
    lpr = min(chunks & -chunks, 8)
    return (max(1, min(math.ceil(rows / (DELTA_THREADS // lpr)), DELTA_BLOCKS)),), (DELTA_THREADS,)


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


# flash.cu's FLASH_PART parts: each version's section ends with its blocks; v2 and v3 share part 2, and v5's fused
# backward's blocks are part 5 as v5's
PARTS = {"v2": 2, "v3": 2, "v4": 4, "v5": 5, "v6": 6}


def part_options(version, half) -> tuple:
    """The compile options that keep only `version`'s part of flash.cu in `half` (its FLASH_PART guards): each
    process compiles the entry points it launches, not all 212."""
    return (f"-DFLASH_PART_V={PARTS[version]}", f"-DFLASH_PART_H={1 if half == 'bf16' else 2}")


def _kernel(name, version, half):
    """flash.cu's entry point `name`, from the module of `version`'s part in `half`; a CUDA install without the crt/
    headers that <mma.h> includes is named."""
    from gpullm_lessons.runtime import hip

    try:
        return hip.kernel("flash", name, part_options(version, half))
    except Exception as e:  # noqa: BLE001 - CuPy's CompileException; anything else is raised as it is
        if "crt/mma.h" in str(e):
            raise RuntimeError(
                f"{name}: NVRTC cannot find crt/mma.h (NVIDIA's tensor-core header <mma.h> includes it): install the "
                "CUDA headers' crt folder: `pip install nvidia-cuda-crt` on CUDA 13 (in the course's cuda13 extra: "
                "make setup GPU=cuda13) or `pip install nvidia-cuda-nvcc-cu12` on CUDA 12 (in the cuda12 extra), or "
                "point CUDA_PATH to a CUDA toolkit"
            ) from None
        raise


def _fused_smem(hs: int) -> int:
    """Bytes of dynamic shared memory v5's one-kernel backward takes (flash_bwd_fused_v5's layout): Q and dO tiles in
    FLASH5_BUFS buffers (two on NVIDIA, one on AMD), K's 128 rows, dS^T (128 x 64), lse and delta."""
    from gpullm_lessons import device

    bufs = 1 if device.kind() == "rocm" else 2
    pad = 8
    return (
        bufs * 2 * V5_QUERY_TILE * (hs + pad) * 2
        + 128 * (hs + pad) * 2
        + 128 * (V5_QUERY_TILE + pad) * 2
        + bufs * 2 * V5_QUERY_TILE * 4
    )


_SMEM_SET: dict = {}


def _run(function, values, version, half, role, heads, T, hs):
    """Launch flash.cu's entry point `function` with its arguments taken by name from `values` (hip.launch_args: the
    kernel's own parameter list, read from flash.cu, is the one place the order is written). role: "delta" (grid-stride
    over rows), "fused" (v5's one-kernel backward: turn counters zeroed first, dynamic shared memory past the 48 KiB
    default where it needs it) or the GEOMETRY kernel ("forward", "dkdv", "dq") of `version`."""
    from gpullm_lessons.runtime import hip

    kern = _kernel(function, version, half)
    if role == "delta":
        kern(*_delta_launch(heads * T, hs), hip.launch_args("flash", function, values))
        return
    if role != "fused":
        kern(*_launch(version, role, heads, T), hip.launch_args("flash", function, values))
        return
    import cupy as cp

    smem = _fused_smem(hs)
    if smem > 48 * 1024 and _SMEM_SET.get(function) is not kern:
        kern.max_dynamic_shared_size_bytes = smem
        _SMEM_SET[function] = kern
    values = dict(values, sem=cp.zeros(heads * math.ceil(T / V5_QUERY_TILE), cp.int32))
    kern(*_launch("v5", "fused", heads, T), hip.launch_args("flash", function, values), shared_mem=smem)


def backward_plan(version, half, hs, packed=False, fused=False, half_grads=False) -> list:
    """The kernels one backward launches, in order: [(entry point, role)] (role as _run's). v6: dQ first (it computes
    delta and writes it for dK dV), then dK dV; v2-v5: the delta pass, dK dV, then dQ; fused (v5): the delta pass and
    the one-kernel backward. half_grads (v6, packed): the entry points that write dqkv in the half format (_hg)."""
    if half_grads and not (packed and version in HALF_GRADS):
        raise ValueError(f"backward_plan: half gradients are written by {', '.join(HALF_GRADS)} on the packed layout")
    sfx, layout = _SUFFIX[half], ("_packed" if packed else "") + ("_hg" if half_grads else "")
    name = f"flash_attention_backward_{version}{layout}_{{}}_hs{hs}_{sfx}".format
    delta = f"flash_attention_backward_{'v4_packed' if packed else 'v2'}_delta_{sfx}"
    if version in DQ_DELTA:
        return [(name("dq"), "dq"), (name("dkdv"), "dkdv")]
    if fused:
        return [(delta, "delta"), (f"flash_attention_backward_v5_fused{layout}_hs{hs}_{sfx}", "fused")]
    return [(delta, "delta"), (name("dkdv"), "dkdv"), (name("dq"), "dq")]


def forward_entry(version, half, hs, packed=False) -> str:
    """The forward's entry point in flash.cu."""
    return f"flash_attention_forward_{version}{'_packed' if packed else ''}_hs{hs}_{_SUFFIX[half]}"


def _check_fused(fn, version, fused):
    if not isinstance(fused, bool):
        raise TypeError(f"{fn}: fused must be True or False, got {fused!r}")
    if fused and version != "v5":
        raise ValueError(f"{fn}: fused=True is v5's one-kernel backward; version={version!r} has none")


def _launch(version, kernel, heads, T):
    """(grid, block) of one of `version`'s kernels ("forward", "dkdv", "dq") over `heads` heads of T rows."""
    from gpullm_lessons.runtime import hip

    rows, warps = GEOMETRY[version][kernel]
    return (heads, math.ceil(T / rows)), (warps * hip.warp_size(),)


def _is_general(fn, causal, mask, q, k) -> bool:
    """Whether a call needs the general kernels: not causal, a mask, or Tq != Tk (the arrays' third dimension;
    shapes that are not 4-D are left to the checks). causal must be a bool, whatever the version."""
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"{fn}: causal must be True or False, got {causal!r}")
    tq = getattr(q, "shape", (0,) * 4)
    tk = getattr(k, "shape", (0,) * 4)
    return not (bool(causal) and mask is None and len(tq) == 4 and len(tk) == 4 and tq[2] == tk[2])


def _check_general(fn, version, half, causal, mask, queries, keys, rows, q_outs, k_outs):
    """The general form's checks (contracts/flash.py's): returns (B, nh, Tq, Tk, hs) and the mask as uint8 (a one-byte
    stand-in where there is none: the kernels read it only where has_mask is 1)."""
    check_version(fn, version, VERSIONS)
    if version not in GENERAL:
        raise ValueError(
            f"{fn}: version {version} runs causal attention with as many keys as queries and no mask; causal=False, "
            f"a mask or Tq != Tk runs on the general kernels of {' or '.join(GENERAL)}: pass version={GENERAL[0]!r}"
        )
    if half not in HALF_FORMATS:
        raise ValueError(f"{fn}: half={half!r} is not one of {', '.join(HALF_FORMATS)}")
    B, nh, Tq, Tk, hs = check_flash_qk_args(
        fn, queries, keys, rows, cupy=True, dtypes=("uint16",), q_outs=q_outs, k_outs=k_outs
    )
    has_mask = check_attention_mask(fn, causal, mask, Tq, Tk, cupy=True)
    if hs not in HEAD_SIZES:
        raise ValueError(f"{fn}: head size hs = {hs} has no kernel: flash.cu is compiled for hs in {HEAD_SIZES}")
    if math.ceil(max(Tq, Tk) / ROWS) > MAX_GRID_Y:
        raise ValueError(f"{fn}: Tq = {Tq}, Tk = {Tk} need more row blocks than the grid's {MAX_GRID_Y}")
    if B * nh > 2**31 - 1:
        raise ValueError(f"{fn}: B * nh = {B * nh} heads exceed the grid's x dimension")
    import cupy as cp

    m = (mask if str(mask.dtype) == "uint8" else mask.view(cp.uint8)) if has_mask else cp.zeros(1, cp.uint8)
    return (B, nh, Tq, Tk, hs), {
        "Tq": np.int32(Tq),
        "Tk": np.int32(Tk),
        "causal": np.int32(bool(causal)),
        "mask": m,
        "has_mask": np.int32(has_mask),
        "scale": scale_of(hs),
    }


def _general_entry(kind, half, hs) -> str:
    """v3's general entry point: kind "forward", "dkdv" or "dq"."""
    what = "forward_v3_general" if kind == "forward" else f"backward_v3_general_{kind}"
    return f"flash_attention_{what}_hs{hs}_{_SUFFIX[half]}"


def flash_attention_forward(q, k, v, out, lse, version=DEFAULT, half="bf16", *, causal=True, mask=None):
    """out = causal softmax(q k^T / sqrt(hs)) v (float32) and lse = each row's log-sum-exp (float32), from q, k, v
    in half precision (bits), without the (T, T) scores. q, k, v uint16 (B, nh, T, hs); out float32 (B, nh, T, hs);
    lse float32 (B, nh, T).

    In general (version="v3", contracts/flash.py's form): q (B, nh, Tq, hs), k and v (B, nh, Tk, hs); causal=False,
    or causal bottom-right aligned (query t sees keys s <= t + Tk - Tq); mask None or a (Tq, Tk) uint8 / bool CuPy
    array (nonzero = allowed). A query that sees no key gets out = 0 and lse = -inf."""
    fn = "flash_attention_forward"
    if _is_general(fn, causal, mask, q, k):
        (B, nh, Tq, Tk, hs), values = _check_general(
            fn, version, half, causal, mask, [("q", q)], [("k", k), ("v", v)], [("lse", lse)], [("out", out)], []
        )
        if B * nh * Tq == 0:
            return
        values.update(q=q, k=k, v=v, out=out, lse=lse)
        _run(_general_entry("forward", half, hs), values, version, half, "forward", B * nh, Tq, hs)
        return
    B, nh, T, hs = _check(fn, version, half, [("q", q), ("k", k), ("v", v)], [("lse", lse)], [("out", out)])
    if B * nh * T == 0:
        return
    values = {"q": q, "k": k, "v": v, "out": out, "lse": lse, "T": np.int32(T), "scale": scale_of(hs)}
    _run(forward_entry(version, half, hs), values, version, half, "forward", B * nh, T, hs)


def flash_attention_backward(
    q, k, v, out, dout, lse, dq, dk, dv, version=DEFAULT, half="bf16", fused=False, *, causal=True, mask=None
):
    """dq, dk, dv (float32) of the causal attention out = flash_attention_forward(q, k, v), from the saved out and
    lse; q, k, v, dout uint16 half bits (B, nh, T, hs). The probabilities are recomputed from lse; each element of
    dq, dk, dv is summed in a fixed order: the same bits on every run. fused=True (v5 only): the backward in one
    kernel, the key blocks adding their dQ in turns (slower than the two kernels on the H200, see lesson 11).
    causal=False, a mask or Tq != Tk: the general kernels (version="v3"), as flash_attention_forward; dq, dout, out
    are (B, nh, Tq, hs), dk, dv (B, nh, Tk, hs); a query that sees no key gives no gradient."""
    fn = "flash_attention_backward"
    _check_fused(fn, version, fused)
    if _is_general(fn, causal, mask, q, k):
        if fused:
            raise ValueError(f"{fn}: fused=True is v5's causal backward; the general backward has no fused kernel")
        (B, nh, Tq, Tk, hs), values = _check_general(
            fn,
            version,
            half,
            causal,
            mask,
            [("q", q), ("dout", dout)],
            [("k", k), ("v", v)],
            [("lse", lse)],
            [("out", out), ("dq", dq)],
            [("dk", dk), ("dv", dv)],
        )
        if B * nh * Tq == 0:
            return
        import cupy as cp

        for name, a in (("out", out), ("dout", dout)):
            if a.data.ptr % 16:
                raise ValueError(f"{fn}: {name} must start on a 16-byte boundary (delta is summed from 16-byte loads)")
        values.update(
            q=q,
            k=k,
            v=v,
            out=out,
            dout=dout,
            lse=lse,
            dq=dq,
            dk=dk,
            dv=dv,
            hs=np.int32(hs),
            delta=cp.empty((B, nh, Tq), cp.float32),
            rows=np.int64(B * nh * Tq),
        )
        _run(f"flash_attention_backward_v2_delta_{_SUFFIX[half]}", values, version, half, "delta", B * nh, Tq, hs)
        _run(_general_entry("dkdv", half, hs), values, version, half, "dkdv", B * nh, Tk, hs)
        _run(_general_entry("dq", half, hs), values, version, half, "dq", B * nh, Tq, hs)
        return
    heads = [("q", q), ("k", k), ("v", v), ("dout", dout)]
    outs = [("out", out), ("dq", dq), ("dk", dk), ("dv", dv)]
    B, nh, T, hs = _check(fn, version, half, heads, [("lse", lse)], outs)
    if B * nh * T == 0:
        return
    import cupy as cp

    for name, a in (("out", out), ("dout", dout)):
        if a.data.ptr % 16:
            raise ValueError(f"{fn}: {name} must start on a 16-byte boundary (delta is summed from 16-byte loads)")
    values = {
        "q": q,
        "k": k,
        "v": v,
        "out": out,
        "dout": dout,
        "lse": lse,
        "delta": cp.empty((B, nh, T), cp.float32),
        "dq": dq,
        "dk": dk,
        "dv": dv,
        "T": np.int32(T),
        "scale": scale_of(hs),
        "rows": np.int64(B * nh * T),
        "hs": np.int32(hs),
    }
    for function, role in backward_plan(version, half, hs, fused=fused):
        _run(function, values, version, half, role, B * nh, T, hs)


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


def _check_v7(fn, half):
    if half != "bf16":
        raise ValueError(f"{fn}: version='v7' is written for bf16 (Hopper's wgmma kernels), got half={half!r}")


def flash_attention_forward_packed(qkv, out, lse, nh, half="bf16", version=DEFAULT):
    """The forward on the engine's layout (version v6, v5 or v4): out (B, T, C) uint16 in format `half` = y with its heads
    side by side, lse (B, nh, T) float32, from qkv (B, T, 3C) uint16 (q, k, v side by side in each row, the bias
    already added); C = nh * hs."""
    fn = "flash_attention_forward_packed"
    check_version(fn, version, PACKED + SM90)
    B, T, nh, hs = _check_packed(
        fn, half, nh, [("qkv", qkv, 3, "uint16"), ("out", out, 1, "uint16"), ("lse", lse, 0, "float32")]
    )
    if B * T == 0:
        return
    if version in SM90:
        from gpullm_lessons.runtime import sm90

        _check_v7(fn, half)
        sm90.flash_forward_v7(qkv, out, lse, nh)
        return
    values = {"qkv": qkv, "out": out, "lse": lse, "T": np.int32(T), "nh": np.int32(nh), "scale": scale_of(hs)}
    _run(forward_entry(version, half, hs, packed=True), values, version, half, "forward", B * nh, T, hs)


def flash_attention_backward_packed(qkv, out, dout, lse, dqkv, nh, half="bf16", version=DEFAULT, fused=False):
    """dqkv (B, T, 3C) float32: dq, dk, dv side by side in each row, of out = flash_attention_forward_packed(qkv),
    from qkv, out and dout (B, T, C) uint16 in format `half`, and lse; summed in a fixed order (the same bits on every
    run). Every element of dqkv is written. version: v6 (dQ computing delta, then dK dV), v5 or v4 (the delta pass, dK
    dV, then dQ); fused=True: v5's one-kernel backward (with version="v5").
    dqkv uint16 (version v6): the same gradients written in format `half`, each rounded once from the float32 result
    (the bits of the float32 call's dqkv rounded to nearest even), for the products that read dqkv in that format."""
    fn = "flash_attention_backward_packed"
    check_version(fn, version, PACKED + SM90)
    _check_fused(fn, version, fused)
    half_grads = str(getattr(dqkv, "dtype", "")) == "uint16"
    if half_grads and version not in HALF_GRADS:
        raise ValueError(
            f"{fn}: dqkv in the half format (uint16) is written by version {' or '.join(HALF_GRADS)}; "
            f"version={version!r} writes float32 dqkv"
        )
    pairs = [("qkv", qkv, 3, "uint16"), ("out", out, 1, "uint16"), ("dout", dout, 1, "uint16")]
    pairs += [("lse", lse, 0, "float32"), ("dqkv", dqkv, 3, "uint16" if half_grads else "float32")]
    B, T, nh, hs = _check_packed(fn, half, nh, pairs)
    if B * T == 0:
        return
    import cupy as cp

    if version in SM90:
        from gpullm_lessons.runtime import sm90

        _check_v7(fn, half)
        sm90.flash_backward_v7(qkv, out, dout, lse, cp.empty((B, nh, T), cp.float32), dqkv, nh)
        return
    values = {
        "qkv": qkv,
        "out": out,
        "dout": dout,
        "lse": lse,
        "delta": cp.empty((B, nh, T), cp.float32),
        "dqkv": dqkv,
        "T": np.int32(T),
        "nh": np.int32(nh),
        "scale": scale_of(hs),
        "rows": np.int64(B * T * nh),
        "hs": np.int32(hs),
    }
    for function, role in backward_plan(version, half, hs, packed=True, fused=fused, half_grads=half_grads):
        _run(function, values, version, half, role, B * nh, T, hs)
