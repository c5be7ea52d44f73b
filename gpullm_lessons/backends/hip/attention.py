"""HIP launchers for causal attention backward (kernels/hip/attention.cu). CuPy arrays in, written in place.

v1      three portable kernels: datt, causal softmax backward (scaled), and dq/dk/dv by loops (naive).
cublas  the matmul path: the four products as batched matmuls through CuPy (cuBLAS / hipBLAS), with the causal
        softmax backward kernel between them. This is how the training loop runs attention backward.

The training loop's causal softmax launchers (attention_softmax_forward / _backward) also read and write half
precision (bf16 / fp16 bits in uint16 arrays, keyword arguments att_half= and half=): each format pair is its own
entry point of attention.cu, instantiated from one template (attention_softmax_fwd[_f32]_<bf16|f16>,
attention_dpre_<att format>_<dpre format>). Same signatures and checks as the Numba twins.
When T <= 32 * warp size the launchers run the warp-per-row entry points (attention_softmax_fwd_w{K}_<out>,
attention_dpre_w{K}_<att>_<dpre>): one warp per row, the row in registers, no barrier; the block-per-row kernels
serve longer rows and the two-output / mixed-format calls.
Half inputs (half in, half out, one format): pre as half bits with att=None and att_half= runs
attention_softmax_fwd_w{K}_<bf16|f16>_in (block per row: attention_softmax_fwd_<bf16|f16>_in); datt as half bits with
att and dpre half bits of the same format runs attention_dpre_w{K}_<fmt>_<fmt>_<fmt> (block per row:
attention_dpre_<fmt>_<fmt>_<fmt>; the three formats are att, datt, dpre). Every sum fp32.
Those two half-in calls take the vectorised entry points attention_softmax_fwd_v{C}_<fmt>_in and
attention_dpre_v{C}_<fmt>_<fmt>_<fmt> when T % 8 == 0, T <= 8 * C * warp size and every row starts on 16 bytes: 8
elements per 16-byte load or store per lane (the GPT-2 step's scores; _w{K} otherwise).
"""

import math

import numpy as np

from gpullm_lessons.runtime import hip
from gpullm_lessons.contracts.attention import (
    FMT_BF16,
    FMT_F32,
    check_attention_args,
    check_softmax_backward_args,
    check_softmax_forward_args,
)

VERSIONS = ("v1", "cublas")


def attention_backward(dout, qkv, att, dqkv, n_head, version="cublas"):
    """dout (B,T,C), qkv (B,T,3C), att (B,nh,T,T) -> dqkv (B,T,3C)."""
    import cupy as cp

    if version not in VERSIONS:
        raise ValueError(f"attention_backward: version {version!r} unknown; HIP versions: {', '.join(VERSIONS)}")
    B, T, C, nh = check_attention_args("attention_backward", dout, qkv, att, dqkv, n_head)
    hs = C // nh
    scale = np.float32(1.0 / math.sqrt(hs))
    ints = (np.int32(B), np.int32(T), np.int32(C), np.int32(nh))
    threads = 256
    if version == "v1":
        datt = cp.empty((B, nh, T, T), cp.float32)
        hip.kernel("attention", "attention_datt_v1")((B * nh, T), (min(threads, max(32, T)),), (dout, qkv, datt) + ints)
        dpre = cp.empty_like(datt)
        hip.kernel("attention", "attention_dpre")((B * nh * T,), (threads,), (att, datt, dpre, np.int32(T), scale))
        n = B * T * 3 * C
        hip.kernel("attention", "attention_dqkv_v1")(
            ((n + threads - 1) // threads,), (threads,), (dout, qkv, att, dpre, dqkv) + ints
        )
        return
    # cublas: split heads with views (B, nh, T, hs); matmuls batched over (B, nh)
    q, k, v = (qkv[:, :, i * C : (i + 1) * C].reshape(B, T, nh, hs).transpose(0, 2, 1, 3) for i in range(3))
    dy = dout.reshape(B, T, nh, hs).transpose(0, 2, 1, 3)
    datt = cp.matmul(dy, v.transpose(0, 1, 3, 2))  # (B, nh, T, T)
    dpre = cp.empty_like(datt)
    hip.kernel("attention", "attention_dpre")((B * nh * T,), (threads,), (att, datt, dpre, np.int32(T), scale))
    dq = cp.matmul(dpre, k)  # (B, nh, T, hs), already scaled
    dk = cp.matmul(dpre.transpose(0, 1, 3, 2), q)
    dv = cp.matmul(att.transpose(0, 1, 3, 2), dy)
    for i, part in enumerate((dq, dk, dv)):
        dqkv[:, :, i * C : (i + 1) * C] = part.transpose(0, 2, 1, 3).reshape(B, T, C)


def _check_cupy(fn, arrays):
    import cupy as cp

    for name, a in arrays:
        if not isinstance(a, cp.ndarray):
            raise TypeError(
                f"{fn}: {name} must be a CuPy array (HIP backend), got {type(a).__module__}.{type(a).__name__}"
            )
        if not a.flags.c_contiguous:
            raise ValueError(f"{fn}: {name} must be C-contiguous")


_FMT_NAME = {FMT_F32: "f32", FMT_BF16: "bf16"}  # kernel-name suffix per format; fp16 is "f16"


def _fmt(code):
    return _FMT_NAME.get(code, "f16")


WARP_K = (1, 2, 4, 8, 16, 32)  # the warp-per-row entry points: row elements per lane (T <= K * warp size)
WARP_BLOCK = 256  # threads per block of the warp-per-row kernels (8 rows on NVIDIA, 4 on AMD CDNA)


def _warp_size(x) -> int:
    return hip.warp_size(int(x.device.id))  # read from the device once, cached


def _warp_k(x, T):
    """The smallest K of WARP_K with T <= K * warp size (the warp-per-row kernels), or None (block-per-row)."""
    ws = _warp_size(x)
    return next((k for k in WARP_K if T <= k * ws), None)


VEC_C = (1, 2, 4, 8)  # the vectorised half-in entry points: 8-element chunks per lane, T <= 8 * C * warp size


def _vec_c(T, arrays):
    """The smallest C of VEC_C with T <= 8 * C * warp size, when T % 8 == 0 and every array's rows start on 16 bytes
    (16-byte loads of 8 half elements), or None."""
    if T % 8 or any(a.data.ptr % 16 for a in arrays):
        return None
    ws = _warp_size(arrays[0])
    return next((c for c in VEC_C if T <= 8 * c * ws), None)


def _warp_grid(x, rows):
    per_block = WARP_BLOCK // _warp_size(x)
    return ((rows + per_block - 1) // per_block,), (WARP_BLOCK,)


def attention_softmax_forward(pre, att, scale, att_half=None, half=None, threads=256):
    """att (rows, T) = causal softmax of scale * pre (rows, T), rows = B*nh*T; att may be pre (in place).

    att_half: None, or uint16 (rows, T): the same probabilities rounded to half bits of format half ("bf16" |
    "fp16"). att may be None when att_half is given (then only the half bits are written).
    pre may be uint16 half bits of format half when att is None (half in, half out; att_half may be pre)."""
    fn = "attention_softmax_forward"
    rows, T, hf, pf = check_softmax_forward_args(fn, pre, att, att_half, half)
    given = [(n, a) for n, a in (("pre", pre), ("att", att), ("att_half", att_half)) if a is not None]
    _check_cupy(fn, given)
    if not rows:
        return
    K = _warp_k(pre, T)
    if pf != FMT_F32:  # half in, half out (att None)
        C = _vec_c(T, (pre, att_half))
        if C:  # 16-byte chunks per lane
            grid, block = _warp_grid(pre, rows)
            hip.kernel("attention", f"attention_softmax_fwd_v{C}_{_fmt(pf)}_in")(
                grid, block, (pre, att_half, np.int64(rows), np.int32(T), np.float32(scale))
            )
        elif K:
            grid, block = _warp_grid(pre, rows)
            hip.kernel("attention", f"attention_softmax_fwd_w{K}_{_fmt(pf)}_in")(
                grid, block, (pre, att_half, np.int64(rows), np.int32(T), np.float32(scale))
            )
        else:
            hip.kernel("attention", f"attention_softmax_fwd_{_fmt(pf)}_in")(
                (rows,), (min(threads, max(32, T)),), (pre, att_half, np.int32(T), np.float32(scale))
            )
        return
    if K and (att is None or hf == FMT_F32):  # one warp per row (the engine's calls: one output)
        out = att if hf == FMT_F32 else att_half
        grid, block = _warp_grid(pre, rows)
        hip.kernel("attention", f"attention_softmax_fwd_w{K}_{_fmt(hf)}")(
            grid, block, (pre, out, np.int64(rows), np.int32(T), np.float32(scale))
        )
        return
    block, args = (min(threads, max(32, T)),), (np.int32(T), np.float32(scale))
    if hf == FMT_F32:
        hip.kernel("attention", "attention_softmax_fwd")((rows,), block, (pre, att) + args)
    elif att is None:
        hip.kernel("attention", f"attention_softmax_fwd_{_fmt(hf)}")((rows,), block, (pre, att_half) + args)
    else:
        hip.kernel("attention", f"attention_softmax_fwd_f32_{_fmt(hf)}")((rows,), block, (pre, att, att_half) + args)


def attention_softmax_backward(att, datt, dpre, scale, half=None, threads=256):
    """dpre = scale * causal softmax backward of datt through att, all (rows, T) with rows = B*nh*T.

    att and dpre: float32, or uint16 half bits of format half ("bf16" | "fp16"), converted in registers; datt is
    float32, or half bits too when att and dpre are (all one format); dpre may be datt (in place) when both are float32
    or both half bits (the same array)."""
    fn = "attention_softmax_backward"
    rows, T, af, of, df = check_softmax_backward_args(fn, att, datt, dpre, half)
    triples = (("att", att), ("datt", datt), ("dpre", dpre))
    _check_cupy(fn, triples)
    if not rows:
        return
    K = _warp_k(att, T)
    if df != FMT_F32:  # att, datt, dpre: half bits of one format
        f = _fmt(df)
        C = _vec_c(T, (att, datt, dpre))
        if C:  # 16-byte chunks per lane
            grid, block = _warp_grid(att, rows)
            hip.kernel("attention", f"attention_dpre_v{C}_{f}_{f}_{f}")(
                grid, block, (att, datt, dpre, np.int64(rows), np.int32(T), np.float32(scale))
            )
        elif K:
            grid, block = _warp_grid(att, rows)
            hip.kernel("attention", f"attention_dpre_w{K}_{f}_{f}_{f}")(
                grid, block, (att, datt, dpre, np.int64(rows), np.int32(T), np.float32(scale))
            )
        else:
            hip.kernel("attention", f"attention_dpre_{f}_{f}_{f}")(
                (rows,), (min(threads, max(32, T)),), (att, datt, dpre, np.int32(T), np.float32(scale))
            )
        return
    if K and af == of:  # one warp per row (f32 -> f32, half -> the same half)
        grid, block = _warp_grid(att, rows)
        hip.kernel("attention", f"attention_dpre_w{K}_{_fmt(af)}_{_fmt(of)}")(
            grid, block, (att, datt, dpre, np.int64(rows), np.int32(T), np.float32(scale))
        )
        return
    name = "attention_dpre" if af == of == FMT_F32 else f"attention_dpre_{_fmt(af)}_{_fmt(of)}"
    hip.kernel("attention", name)(
        (rows,), (min(threads, max(32, T)),), (att, datt, dpre, np.int32(T), np.float32(scale))
    )
