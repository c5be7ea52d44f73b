"""Flash attention (causal), forward and backward, in Numba CUDA: lesson 11.

Attention per batch b and head h, q, k, v (T, hs) rows of (B, nh, T, hs), scale = 1/sqrt(hs), causal (s <= t):
    S = scale q k^T,  P = softmax(S) over s <= t,  out = P v
The (T, T) matrices S and P are never written to memory. The forward walks the keys in tiles of BC rows and keeps,
per query row t, a running max m, a running sum l of exp(S - m) and a running output acc = sum of exp(S - m) v. A
new tile with row max mt merges in with the rescale of lesson 05's one-pass softmax, applied to acc as well:
    m' = max(m, mt),  alpha = exp(m - m'),  l' = alpha l + sum_s exp(S[t, s] - m'),
    acc' = alpha acc + sum_s exp(S[t, s] - m') v[s]
and at the end out = acc / l, lse = m + log(l) (the log-sum-exp of the row, saved for the backward).

Backward, from the saved lse (P is recomputed, never stored): with delta[t] = sum_j dout[t, j] out[t, j],
    P[t, s] = exp(S[t, s] - lse[t])          dV[s] = sum_t P[t, s] dout[t]
    dP[t, s] = dout[t] . v[s]                dS[t, s] = P[t, s] (dP[t, s] - delta[t])
    dQ[t] = scale sum_s dS[t, s] k[s]        dK[s] = scale sum_t dS[t, s] q[t]
(delta[t] = sum_s P dP is softmax backward's row sum: out = P v, so dout . out = sum_s P[t, s] (dout[t] . v[s])).
Deterministic: every element of dq, dk, dv has one owner thread that adds its terms in a fixed order, no atomics.
Two kernels do it: one owns a tile of keys and walks the queries (dK, dV), one owns a tile of queries and walks the
keys (dQ); a third computes delta first.

Causal tile skipping: a block of query rows t0 .. t1 needs the key tiles that start at s0 <= t1 only; a block of key
rows s0 .. s1 needs the query tiles that end at t >= s0 only. About half the tiles are never loaded.

v1: one thread per row (a query row in the forward and dQ, a key row in dK, dV); the block's threads load each tile
of BC rows into shared memory together, then each thread works on its own row in registers (hs <= HS_MAX floats).
Every sum is fp32, in a fixed order. Runs in the simulator; the HIP version is kernels/hip/flash.cu.
The kernels: v1 the forward; v1_delta, v1_dkdv, v1_dq the backward's three launches, in that order.
"""

import math

import numpy as np
from numba import cuda, float32

from gpullm_lessons.contracts import check_threads, check_version
from gpullm_lessons.contracts.flash import HS_MAX, check_flash_args, scale_of
from gpullm_lessons.kernels.numba import device_scratch, launch_stream

BC = 16  # key (or query) rows per shared-memory tile
NEG_INF = float32(-math.inf)


@cuda.jit
def flash_attention_forward_v1(q, k, v, out, lse, scale):
    """Block (x: a tile of blockDim.x query rows, y: b * nh + h); thread = one query row t."""
    B, nh, T, hs = q.shape
    b, h = cuda.blockIdx.y // nh, cuda.blockIdx.y % nh
    tx = cuda.threadIdx.x
    t0 = cuda.blockIdx.x * cuda.blockDim.x
    t = t0 + tx
    kt = cuda.shared.array((BC, HS_MAX), float32)
    vt = cuda.shared.array((BC, HS_MAX), float32)
    qr = cuda.local.array(HS_MAX, float32)
    acc = cuda.local.array(HS_MAX, float32)
    sc = cuda.local.array(BC, float32)
    for j in range(hs):
        qr[j] = q[b, h, t, j] * scale if t < T else float32(0.0)
        acc[j] = float32(0.0)
    m = NEG_INF
    l = float32(0.0)
    t_last = min(T, t0 + cuda.blockDim.x) - 1          # the block's last query row: key tiles past it are skipped
    for s0 in range(0, t_last + 1, BC):
        for i in range(tx, BC * hs, cuda.blockDim.x):  # the block loads the tile together
            r, j = i // hs, i % hs
            s = s0 + r
            kt[r, j] = k[b, h, s, j] if s < T else float32(0.0)
            vt[r, j] = v[b, h, s, j] if s < T else float32(0.0)
        cuda.syncthreads()
        if t < T:
            mt = NEG_INF
            for r in range(BC):
                x = NEG_INF
                if s0 + r <= t:                         # causal: keys s <= t only (s <= t < T)
                    x = float32(0.0)
                    for j in range(hs):
                        x += qr[j] * kt[r, j]
                    mt = max(mt, x)
                sc[r] = x
            if mt > NEG_INF:                            # the tile has a key this row sees
                m_new = max(m, mt)
                alpha = math.exp(m - m_new)             # 0 on the first tile (m = -inf)
                l *= alpha
                for j in range(hs):
                    acc[j] *= alpha
                for r in range(BC):
                    if s0 + r <= t:
                        p = math.exp(sc[r] - m_new)
                        l += p
                        for j in range(hs):
                            acc[j] += p * vt[r, j]
                m = m_new
        cuda.syncthreads()                              # before the next tile overwrites kt, vt
    if t < T:
        for j in range(hs):
            out[b, h, t, j] = acc[j] / l
        lse[b, h, t] = m + math.log(l)


@cuda.jit
def flash_attention_backward_v1_delta(out, dout, delta):
    """delta[b, h, t] = sum_j dout * out over the row; one thread per row, grid-stride."""
    B, nh, T, hs = out.shape
    for row in range(cuda.grid(1), B * nh * T, cuda.gridsize(1)):
        b, rest = row // (nh * T), row % (nh * T)
        h, t = rest // T, rest % T
        acc = float32(0.0)
        for j in range(hs):
            acc += dout[b, h, t, j] * out[b, h, t, j]
        delta[b, h, t] = acc


@cuda.jit
def flash_attention_backward_v1_dkdv(q, k, v, dout, lse, delta, dk, dv, scale):
    """Block (x: a tile of blockDim.x key rows, y: b * nh + h); thread = one key row s, walking the query tiles."""
    B, nh, T, hs = q.shape
    b, h = cuda.blockIdx.y // nh, cuda.blockIdx.y % nh
    tx = cuda.threadIdx.x
    s_first = cuda.blockIdx.x * cuda.blockDim.x
    s = s_first + tx
    qt = cuda.shared.array((BC, HS_MAX), float32)
    dot_ = cuda.shared.array((BC, HS_MAX), float32)
    lt = cuda.shared.array(BC, float32)
    dt = cuda.shared.array(BC, float32)
    kr = cuda.local.array(HS_MAX, float32)
    vr = cuda.local.array(HS_MAX, float32)
    dkr = cuda.local.array(HS_MAX, float32)
    dvr = cuda.local.array(HS_MAX, float32)
    for j in range(hs):
        kr[j] = k[b, h, s, j] * scale if s < T else float32(0.0)
        vr[j] = v[b, h, s, j] if s < T else float32(0.0)
        dkr[j] = float32(0.0)
        dvr[j] = float32(0.0)
    for t0 in range((s_first // BC) * BC, T, BC):      # query tiles that end at t >= s_first (causal)
        for i in range(tx, BC * hs, cuda.blockDim.x):
            r, j = i // hs, i % hs
            t = t0 + r
            qt[r, j] = q[b, h, t, j] if t < T else float32(0.0)
            dot_[r, j] = dout[b, h, t, j] if t < T else float32(0.0)
        for r in range(tx, BC, cuda.blockDim.x):
            t = t0 + r
            lt[r] = lse[b, h, t] if t < T else float32(0.0)
            dt[r] = delta[b, h, t] if t < T else float32(0.0)
        cuda.syncthreads()
        if s < T:
            for r in range(BC):
                t = t0 + r
                if s <= t and t < T:
                    x = float32(0.0)
                    dp = float32(0.0)
                    for j in range(hs):
                        x += qt[r, j] * kr[j]
                        dp += dot_[r, j] * vr[j]
                    p = math.exp(x - lt[r])
                    ds = p * (dp - dt[r])
                    for j in range(hs):
                        dvr[j] += p * dot_[r, j]
                        dkr[j] += ds * qt[r, j]
        cuda.syncthreads()
    if s < T:
        for j in range(hs):
            dk[b, h, s, j] = dkr[j] * scale
            dv[b, h, s, j] = dvr[j]


@cuda.jit
def flash_attention_backward_v1_dq(q, k, v, dout, lse, delta, dq, scale):
    """Block (x: a tile of blockDim.x query rows, y: b * nh + h); thread = one query row t, walking the key tiles."""
    B, nh, T, hs = q.shape
    b, h = cuda.blockIdx.y // nh, cuda.blockIdx.y % nh
    tx = cuda.threadIdx.x
    t0 = cuda.blockIdx.x * cuda.blockDim.x
    t = t0 + tx
    kt = cuda.shared.array((BC, HS_MAX), float32)
    vt = cuda.shared.array((BC, HS_MAX), float32)
    qr = cuda.local.array(HS_MAX, float32)
    dor = cuda.local.array(HS_MAX, float32)
    dqr = cuda.local.array(HS_MAX, float32)
    for j in range(hs):
        qr[j] = q[b, h, t, j] * scale if t < T else float32(0.0)
        dor[j] = dout[b, h, t, j] if t < T else float32(0.0)
        dqr[j] = float32(0.0)
    lt = lse[b, h, t] if t < T else float32(0.0)
    dtt = delta[b, h, t] if t < T else float32(0.0)
    t_last = min(T, t0 + cuda.blockDim.x) - 1
    for s0 in range(0, t_last + 1, BC):
        for i in range(tx, BC * hs, cuda.blockDim.x):
            r, j = i // hs, i % hs
            s = s0 + r
            kt[r, j] = k[b, h, s, j] if s < T else float32(0.0)
            vt[r, j] = v[b, h, s, j] if s < T else float32(0.0)
        cuda.syncthreads()
        if t < T:
            for r in range(BC):
                if s0 + r <= t:
                    x = float32(0.0)
                    dp = float32(0.0)
                    for j in range(hs):
                        x += qr[j] * kt[r, j]
                        dp += dor[j] * vt[r, j]
                    ds = math.exp(x - lt) * (dp - dtt)
                    for j in range(hs):
                        dqr[j] += ds * kt[r, j]
        cuda.syncthreads()
    if t < T:
        for j in range(hs):
            dq[b, h, t, j] = dqr[j] * scale


KERNELS = {"v1": flash_attention_forward_v1, "v1_delta": flash_attention_backward_v1_delta,
           "v1_dkdv": flash_attention_backward_v1_dkdv, "v1_dq": flash_attention_backward_v1_dq}
_H4 = "float32[:, :, :, ::1]"  # (B, nh, T, hs) C-contiguous
_R3 = "float32[:, :, ::1]"     # (B, nh, T)
SIGNATURES = {
    "v1": f"void({_H4}, {_H4}, {_H4}, {_H4}, {_R3}, float32)",  # q, k, v, out, lse, scale
    "v1_delta": f"void({_H4}, {_H4}, {_R3})",  # out, dout, delta
    "v1_dkdv": f"void({_H4}, {_H4}, {_H4}, {_H4}, {_R3}, {_R3}, {_H4}, {_H4}, float32)",
    "v1_dq": f"void({_H4}, {_H4}, {_H4}, {_H4}, {_R3}, {_R3}, {_H4}, float32)",
}
GPU_ONLY = set()
VERSIONS = ("v1",)
MAX_BLOCKS = 4096   # the delta kernel's grid cap (grid-stride)


def _grid(fn, T, BH, threads):
    threads = check_threads(fn, threads)
    return (math.ceil(T / threads), BH), threads


def flash_attention_forward(q, k, v, out, lse, version="v1", threads=64):
    """out = causal softmax(q k^T / sqrt(hs)) v and lse = its rows' log-sum-exp, without the (T, T) scores.
    q, k, v, out float32 (B, nh, T, hs); lse float32 (B, nh, T). threads: query rows per block."""
    fn = "flash_attention_forward"
    check_version(fn, version, VERSIONS)
    B, nh, T, hs = check_flash_args(fn, [("q", q), ("k", k), ("v", v), ("out", out)], [("lse", lse)])
    if B * nh * T == 0:
        return
    grid, block = _grid(fn, T, B * nh, threads)
    flash_attention_forward_v1[grid, block, launch_stream()](q, k, v, out, lse, scale_of(hs))


def flash_attention_backward(q, k, v, out, dout, lse, dq, dk, dv, version="v1", threads=64):
    """dq, dk, dv of the causal attention out = flash_attention_forward(q, k, v), from the saved out and lse (the
    probabilities are recomputed). All (B, nh, T, hs) float32 but lse (B, nh, T). threads: rows per block."""
    fn = "flash_attention_backward"
    check_version(fn, version, VERSIONS)
    heads = [("q", q), ("k", k), ("v", v), ("out", out), ("dout", dout), ("dq", dq), ("dk", dk), ("dv", dv)]
    B, nh, T, hs = check_flash_args(fn, heads, [("lse", lse)])
    if B * nh * T == 0:
        return
    grid, block = _grid(fn, T, B * nh, threads)
    stream = launch_stream()
    delta = device_scratch((B, nh, T), np.float32)
    rows = B * nh * T
    flash_attention_backward_v1_delta[min(math.ceil(rows / 256), MAX_BLOCKS), 256, stream](out, dout, delta)
    scale = scale_of(hs)
    flash_attention_backward_v1_dkdv[grid, block, stream](q, k, v, dout, lse, delta, dk, dv, scale)
    flash_attention_backward_v1_dq[grid, block, stream](q, k, v, dout, lse, delta, dq, scale)
