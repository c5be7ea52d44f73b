"""Causal multi-head self-attention backward, in Numba CUDA.

Forward (per batch b and head h, q/k/v read straight from qkv (B, T, 3C) at channel offsets 0, C, 2C + h*hs):
    att = softmax(q k^T * scale, causal)   (T, T)   scale = 1/sqrt(hs), saved by the forward
    y   = att v                            (T, hs)  written to out[b, :, h*hs:(h+1)*hs]
Backward, in five steps (each a kernel; every thread owns one output element):
    datt[t, s] = sum_d dy[t, d] v[s, d]                         s <= t   (B, nh, T, T) scratch
    dpre[t, s] = scale * att[t, s] (datt[t, s] - sum_s' att[t, s'] datt[t, s'])   (softmax backward, causal)
    dq[t, d]   = sum_{s <= t} dpre[t, s] k[s, d]
    dk[s, d]   = sum_{t >= s} dpre[t, s] q[t, d]
    dv[s, d]   = sum_{t >= s} att[t, s] dy[t, d]
Masked entries (s > t) have att = 0, so they never contribute: the loops skip them instead of multiplying by 0,
which halves the work (the causal mask is a saving in backward too).

v1: naive, one thread per output element, every sum a loop over global memory (the steps above, literally):
    kernels v1 (datt), v1_dpre (causal softmax backward) and v1_dqkv (dq, dk, dv). Runs in the simulator. The HIP backend adds a cuBLAS version (batched matmuls through CuPy) beside it.

For the training loop (gpullm_lessons.engine), which does the matmuls through cuBLAS and keeps att (B*nh*T, T):
    v1_softmax_fwd                   causal softmax of the scaled scores, one thread per row (launcher
                                     attention_softmax_forward); the HIP twin is attention_softmax_fwd (block per row)
    attention_softmax_backward       the launcher of v1_dpre on (B*nh*T, T) rows (HIP: attention_dpre)
"""
import math

import numpy as np
from numba import cuda, float32


# v1, step 1: datt[b, h, t, s] = sum_d dout[b, t, h*hs + d] * v[b, s, h*hs + d], zero above the diagonal
@cuda.jit
def attention_datt_v1(dout, qkv, datt, n_head):
    bh, t = cuda.blockIdx.x, cuda.blockIdx.y  # one block per (b*h, t) row, threads over s
    B, T, C3 = qkv.shape
    C = C3 // 3
    hs = C // n_head
    b, h = bh // n_head, bh % n_head
    for s in range(cuda.threadIdx.x, T, cuda.blockDim.x):
        acc = float32(0.0)
        if s <= t:
            for d in range(hs):
                acc += dout[b, t, h * hs + d] * qkv[b, s, 2 * C + h * hs + d]
        datt[b, h, t, s] = acc


# v1, step 2: causal softmax backward with the 1/sqrt(hs) scale folded in; one thread per (b, h, t) row
@cuda.jit
def attention_dpre_v1(att, datt, dpre, scale):
    B, nh, T, _ = att.shape
    row = cuda.grid(1)
    if row >= B * nh * T:
        return
    b, rest = row // (nh * T), row % (nh * T)
    h, t = rest // T, rest % T
    dot = float32(0.0)
    for s in range(t + 1):
        dot += att[b, h, t, s] * datt[b, h, t, s]
    for s in range(T):
        dpre[b, h, t, s] = scale * att[b, h, t, s] * (datt[b, h, t, s] - dot) if s <= t else float32(0.0)


# v1, steps 3-5: dq, dk, dv written into dqkv (B, T, 3C); one thread per element of dqkv
@cuda.jit
def attention_dqkv_v1(dout, qkv, att, dpre, dqkv, n_head):
    B, T, C3 = qkv.shape
    C = C3 // 3
    hs = C // n_head
    i = cuda.grid(1)
    if i >= B * T * C3:
        return
    b, rest = i // (T * C3), i % (T * C3)
    t, c = rest // C3, rest % C3
    part, cc = c // C, c % C  # part 0: q, 1: k, 2: v
    h, d = cc // hs, cc % hs
    acc = float32(0.0)
    if part == 0:  # dq[t, d] = sum_{s <= t} dpre[t, s] k[s, d]
        for s in range(t + 1):
            acc += dpre[b, h, t, s] * qkv[b, s, C + h * hs + d]
    elif part == 1:  # dk[t, d] = sum_{t2 >= t} dpre[t2, t] q[t2, d]
        for t2 in range(t, T):
            acc += dpre[b, h, t2, t] * qkv[b, t2, h * hs + d]
    else:  # dv[t, d] = sum_{t2 >= t} att[t2, t] dy[t2, d]
        for t2 in range(t, T):
            acc += att[b, h, t2, t] * dout[b, t2, h * hs + d]
    dqkv[b, t, c] = acc


# Forward (the training loop): causal softmax of the scaled scores; one thread per (b, h, t) row of pre (rows, T),
# query position t = row % T. att may be pre (each thread reads its row before writing it).
@cuda.jit
def attention_softmax_fwd_v1(pre, att, scale):
    rows, T = pre.shape
    row = cuda.grid(1)
    if row >= rows:
        return
    t = row % T
    mx = scale * pre[row, 0]
    for s in range(1, t + 1):
        mx = max(mx, scale * pre[row, s])
    total = float32(0.0)
    for s in range(t + 1):
        total += math.exp(scale * pre[row, s] - mx)
    inv = float32(1.0) / total
    for s in range(T):
        att[row, s] = math.exp(scale * pre[row, s] - mx) * inv if s <= t else float32(0.0)


KERNELS = {"v1": attention_datt_v1, "v1_dpre": attention_dpre_v1, "v1_dqkv": attention_dqkv_v1,
           "v1_softmax_fwd": attention_softmax_fwd_v1}
SIGNATURES = {
    "v1": "void(float32[:, :, ::1], float32[:, :, ::1], float32[:, :, :, ::1], int64)",
    "v1_dpre": "void(float32[:, :, :, ::1], float32[:, :, :, ::1], float32[:, :, :, ::1], float32)",
    "v1_dqkv": "void(float32[:, :, ::1], float32[:, :, ::1], float32[:, :, :, ::1], float32[:, :, :, ::1], "
               "float32[:, :, ::1], int64)",
    "v1_softmax_fwd": "void(float32[:, ::1], float32[:, ::1], float32)",
}
GPU_ONLY = set()
VERSIONS = ("v1",)


def _shape(x):
    return tuple(int(n) for n in x.shape)


def check_attention_args(fn, dout, qkv, att, dqkv, n_head):
    """Shapes and dtypes of attention_backward's arguments; raises naming the argument. Returns (B, T, C, nh)."""
    if not isinstance(n_head, (int, np.integer)) or n_head < 1:
        raise ValueError(f"{fn}: n_head must be a positive int, got {n_head!r}")
    if len(_shape(qkv)) != 3 or _shape(qkv)[2] % 3:
        raise ValueError(f"{fn}: qkv must be (B, T, 3C), got {_shape(qkv)}")
    B, T, C3 = _shape(qkv)
    C = C3 // 3
    if C % n_head:
        raise ValueError(f"{fn}: C = {C} is not divisible by n_head = {n_head}")
    expected = {"dout": (B, T, C), "att": (B, n_head, T, T), "dqkv": (B, T, C3)}
    for name, arr in (("dout", dout), ("att", att), ("dqkv", dqkv)):
        if _shape(arr) != expected[name]:
            raise ValueError(f"{fn}: {name} is {_shape(arr)}, expected {expected[name]} (from qkv {(B, T, C3)}, "
                             f"n_head {n_head})")
    for name, arr in (("dout", dout), ("qkv", qkv), ("att", att), ("dqkv", dqkv)):
        if np.dtype(arr.dtype) != np.float32:
            raise TypeError(f"{fn}: {name} must be float32, got {np.dtype(arr.dtype)}")
    return B, T, C, int(n_head)


def attention_backward(dout, qkv, att, dqkv, n_head, version="v1"):
    """dout (B,T,C), qkv (B,T,3C), att (B,nh,T,T) -> dqkv (B,T,3C). Scratch (B,nh,T,T) x2 allocated here."""
    if version not in VERSIONS:
        raise ValueError(f"attention_backward: version {version!r} unknown; Numba versions: {', '.join(VERSIONS)}")
    B, T, C, nh = check_attention_args("attention_backward", dout, qkv, att, dqkv, n_head)
    datt = cuda.device_array((B, nh, T, T), dtype=np.float32)
    dpre = cuda.device_array((B, nh, T, T), dtype=np.float32)
    threads = min(128, max(32, T))
    attention_datt_v1[(B * nh, T), threads](dout, qkv, datt, nh)
    rows = B * nh * T
    attention_dpre_v1[(rows + 127) // 128, 128](att, datt, dpre, np.float32(1.0 / math.sqrt(C // nh)))
    n = B * T * 3 * C
    attention_dqkv_v1[(n + 255) // 256, 256](dout, qkv, att, dpre, dqkv, nh)


def check_softmax_rows(fn, arrays, T=None):
    """(name, array) pairs: float32, 2-D (rows, T), all the same shape, rows a multiple of T. Returns (rows, T)."""
    shape = None
    for name, a in arrays:
        if not (hasattr(a, "shape") and hasattr(a, "dtype")):
            raise TypeError(f"{fn}: {name} must be an array, got {type(a).__name__}")
        if len(_shape(a)) != 2:
            raise ValueError(f"{fn}: {name} must be 2-D (B*nh*T, T), got shape {_shape(a)}")
        if np.dtype(a.dtype) != np.float32:
            raise TypeError(f"{fn}: {name} must be float32, got {np.dtype(a.dtype)}")
        if shape is not None and _shape(a) != shape:
            raise ValueError(f"{fn}: {name} is {_shape(a)} but the first array is {shape}")
        shape = _shape(a)
    rows, T = shape
    if T == 0 or rows % T:
        raise ValueError(f"{fn}: rows = {rows} must be a multiple of T = {T} (B*nh blocks of T query rows)")
    return rows, T


def attention_softmax_forward(pre, att, scale):
    """att (rows, T) = causal softmax of scale * pre (rows, T), rows = B*nh*T; att may be pre (in place)."""
    rows, T = check_softmax_rows("attention_softmax_forward", (("pre", pre), ("att", att)))
    if rows:
        attention_softmax_fwd_v1[(rows + 127) // 128, 128](pre, att, np.float32(scale))


def attention_softmax_backward(att, datt, dpre, scale):
    """dpre = scale * causal softmax backward of datt through att, all (rows, T) with rows = B*nh*T."""
    rows, T = check_softmax_rows("attention_softmax_backward", (("att", att), ("datt", datt), ("dpre", dpre)))
    if rows:
        shape4 = (1, rows // T, T, T)
        attention_dpre_v1[(rows + 127) // 128, 128](att.reshape(shape4), datt.reshape(shape4),
                                                     dpre.reshape(shape4), np.float32(scale))
