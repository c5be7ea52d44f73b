"""Flash attention (causal; in general also not causal, masked, Tq != Tk), forward and backward, in Numba CUDA:
lesson 11.

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

Attention in general (the launchers' causal= and mask= arguments; ring attention and cross-attention need it): Tq
queries, Tk keys (q (B, nh, Tq, hs), k, v (B, nh, Tk, hs), lse (B, nh, Tq)), and query t sees key s when
    (not causal or s <= t + Tk - Tq) and (no mask or mask[t, s] != 0)
causal is bottom-right aligned (the last query sees every key: a KV cache's Tq new queries sit after Tk - Tq cached
positions, and ring attention's block of the queries' own positions ends with them), as FlashAttention-2; causal
with Tk < Tq is refused; the mask is (Tq, Tk) uint8, the same for every batch and head.
A query that sees no key writes out = 0 and lse = -inf (l stays 0: no division), and the backward skips it.
reference.sdpa_forward / sdpa_backward are the oracle (contracts/flash.py checks the arguments). The kernels
One code serves both: the device functions _forward, _dkdv and _dq take (causal, mask, has_mask); lesson 11's
kernels v1, v1_dkdv, v1_dq call them causal with no mask (s <= t), the kernels v1_general (forward), v1_general_dkdv
and v1_general_dq (backward, after v1_delta) with the launch's arguments. The causal tile skipping stays (key tiles
up to the block's last row + Tk - Tq; query tiles from its first key row - (Tk - Tq)); masked tiles are visited (no
skipping by the mask). The launchers run v1's kernels when the call is causal, square and unmasked, the general ones
otherwise; on causal, square, unmasked inputs the general kernels give v1's bits too (tests/test_kernels_flash_general.py).
"""

import math

import numpy as np
from numba import cuda, float32, uint8

from gpullm_lessons.contracts import check_threads, check_version
from gpullm_lessons.contracts.flash import (HS_MAX, check_attention_mask, check_flash_args, check_flash_qk_args,
                                            scale_of)
from gpullm_lessons.kernels.numba import device_scratch, launch_stream

BC = 16  # key (or query) rows per shared-memory tile
NEG_INF = float32(-math.inf)


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


# ---- attention in general: causal or not, a (Tq, Tk) mask, Tq queries and Tk keys -----------------------------------
@cuda.jit(device=True, inline=True)   # inlined: a kernel calling a device function compiles to PTX without a GPU
def _sees(t, s, Tk, off, causal, mask, has_mask):
    """Whether query t sees key s (t < Tq): s < Tk, causal bottom-right aligned (s <= t + off, off = Tk - Tq), and
    the mask's (t, s) nonzero."""
    return s < Tk and (causal == 0 or s <= t + off) and (has_mask == 0 or mask[t, s] != 0)


@cuda.jit(device=True, inline=True)
def _forward(q, k, v, out, lse, scale, causal, mask, has_mask):
    """The forward over Tq queries and Tk keys (lesson 11's v1: causal, Tq = Tk, where _sees is s <= t). Block (x: a
    tile of blockDim.x query rows, y: b * nh + h); thread = one query row t. A row that sees no key: out = 0,
    lse = -inf."""
    B, nh, Tq, hs = q.shape
    Tk = k.shape[2]
    off = Tk - Tq
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
        qr[j] = q[b, h, t, j] * scale if t < Tq else float32(0.0)
        acc[j] = float32(0.0)
    m = NEG_INF
    l = float32(0.0)
    s_end = Tk                                          # causal: no key tile past the block's last row + off
    if causal != 0:
        s_end = max(0, min(Tk, min(Tq, t0 + cuda.blockDim.x) + off))
    for s0 in range(0, s_end, BC):
        for i in range(tx, BC * hs, cuda.blockDim.x):  # the block loads the tile together
            r, j = i // hs, i % hs
            s = s0 + r
            kt[r, j] = k[b, h, s, j] if s < Tk else float32(0.0)
            vt[r, j] = v[b, h, s, j] if s < Tk else float32(0.0)
        cuda.syncthreads()
        if t < Tq:
            mt = NEG_INF
            for r in range(BC):
                x = NEG_INF
                if _sees(t, s0 + r, Tk, off, causal, mask, has_mask):
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
                    if _sees(t, s0 + r, Tk, off, causal, mask, has_mask):
                        p = math.exp(sc[r] - m_new)
                        l += p
                        for j in range(hs):
                            acc[j] += p * vt[r, j]
                m = m_new
        cuda.syncthreads()                              # before the next tile overwrites kt, vt
    if t < Tq:
        if l > float32(0.0):
            for j in range(hs):
                out[b, h, t, j] = acc[j] / l
            lse[b, h, t] = m + math.log(l)
        else:                                           # no key seen: 0, not 0 / 0
            for j in range(hs):
                out[b, h, t, j] = float32(0.0)
            lse[b, h, t] = NEG_INF


@cuda.jit(device=True, inline=True)
def _dkdv(q, k, v, dout, lse, delta, dk, dv, scale, causal, mask, has_mask):
    """dK and dV over Tq queries and Tk keys, the keys each query _sees. Block (x: a tile of blockDim.x key rows, y: b * nh + h);
    thread = one key row s, walking the query tiles (causal: from the tile of query s_first - off)."""
    B, nh, Tq, hs = q.shape
    Tk = k.shape[2]
    off = Tk - Tq
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
        kr[j] = k[b, h, s, j] * scale if s < Tk else float32(0.0)
        vr[j] = v[b, h, s, j] if s < Tk else float32(0.0)
        dkr[j] = float32(0.0)
        dvr[j] = float32(0.0)
    t_start = 0                                         # causal: query tiles that end at t >= s_first - off
    if causal != 0:
        t_start = (max(0, s_first - off) // BC) * BC
    for t0 in range(t_start, Tq, BC):
        for i in range(tx, BC * hs, cuda.blockDim.x):
            r, j = i // hs, i % hs
            t = t0 + r
            qt[r, j] = q[b, h, t, j] if t < Tq else float32(0.0)
            dot_[r, j] = dout[b, h, t, j] if t < Tq else float32(0.0)
        for r in range(tx, BC, cuda.blockDim.x):
            t = t0 + r
            lt[r] = lse[b, h, t] if t < Tq else float32(0.0)
            dt[r] = delta[b, h, t] if t < Tq else float32(0.0)
        cuda.syncthreads()
        if s < Tk:
            for r in range(BC):
                t = t0 + r
                if t < Tq and _sees(t, s, Tk, off, causal, mask, has_mask):
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
    if s < Tk:
        for j in range(hs):
            dk[b, h, s, j] = dkr[j] * scale
            dv[b, h, s, j] = dvr[j]


@cuda.jit(device=True, inline=True)
def _dq(q, k, v, dout, lse, delta, dq, scale, causal, mask, has_mask):
    """dQ over Tk keys, the keys each query _sees. Block (x: a tile of blockDim.x query rows, y: b * nh + h); thread = one query
    row t, walking the key tiles (causal: up to the block's last row + off)."""
    B, nh, Tq, hs = q.shape
    Tk = k.shape[2]
    off = Tk - Tq
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
        qr[j] = q[b, h, t, j] * scale if t < Tq else float32(0.0)
        dor[j] = dout[b, h, t, j] if t < Tq else float32(0.0)
        dqr[j] = float32(0.0)
    lt = lse[b, h, t] if t < Tq else float32(0.0)
    dtt = delta[b, h, t] if t < Tq else float32(0.0)
    s_end = Tk
    if causal != 0:
        s_end = max(0, min(Tk, min(Tq, t0 + cuda.blockDim.x) + off))
    for s0 in range(0, s_end, BC):
        for i in range(tx, BC * hs, cuda.blockDim.x):
            r, j = i // hs, i % hs
            s = s0 + r
            kt[r, j] = k[b, h, s, j] if s < Tk else float32(0.0)
            vt[r, j] = v[b, h, s, j] if s < Tk else float32(0.0)
        cuda.syncthreads()
        if t < Tq:
            for r in range(BC):
                if _sees(t, s0 + r, Tk, off, causal, mask, has_mask):
                    x = float32(0.0)
                    dp = float32(0.0)
                    for j in range(hs):
                        x += qr[j] * kt[r, j]
                        dp += dor[j] * vt[r, j]
                    ds = math.exp(x - lt) * (dp - dtt)
                    for j in range(hs):
                        dqr[j] += ds * kt[r, j]
        cuda.syncthreads()
    if t < Tq:
        for j in range(hs):
            dq[b, h, t, j] = dqr[j] * scale


# ---- the kernels: lesson 11's v1 (causal, Tq = Tk: the launchers' default) and the general ones, one code each ------
@cuda.jit
def flash_attention_forward_v1(q, k, v, out, lse, scale):
    """Causal, Tq = Tk (lesson 11). Block (x: a tile of blockDim.x query rows, y: b * nh + h); thread = one query row
    t: _forward with every key s <= t seen."""
    _forward(q, k, v, out, lse, scale, 1, cuda.local.array((1, 1), uint8), 0)


@cuda.jit
def flash_attention_backward_v1_dkdv(q, k, v, dout, lse, delta, dk, dv, scale):
    """Causal, Tq = Tk. Block (x: a tile of blockDim.x key rows, y: b * nh + h); thread = one key row s, walking the
    query tiles: _dkdv."""
    _dkdv(q, k, v, dout, lse, delta, dk, dv, scale, 1, cuda.local.array((1, 1), uint8), 0)


@cuda.jit
def flash_attention_backward_v1_dq(q, k, v, dout, lse, delta, dq, scale):
    """Causal, Tq = Tk. Block (x: a tile of blockDim.x query rows, y: b * nh + h); thread = one query row t, walking
    the key tiles: _dq."""
    _dq(q, k, v, dout, lse, delta, dq, scale, 1, cuda.local.array((1, 1), uint8), 0)


@cuda.jit
def flash_attention_forward_v1_general(q, k, v, out, lse, scale, causal, mask, has_mask):
    """Causal or not, a (Tq, Tk) mask, Tq queries and Tk keys: _forward."""
    _forward(q, k, v, out, lse, scale, causal, mask, has_mask)


@cuda.jit
def flash_attention_backward_v1_general_dkdv(q, k, v, dout, lse, delta, dk, dv, scale, causal, mask, has_mask):
    """_dkdv over Tq queries and Tk keys."""
    _dkdv(q, k, v, dout, lse, delta, dk, dv, scale, causal, mask, has_mask)


@cuda.jit
def flash_attention_backward_v1_general_dq(q, k, v, dout, lse, delta, dq, scale, causal, mask, has_mask):
    """_dq over Tq queries and Tk keys."""
    _dq(q, k, v, dout, lse, delta, dq, scale, causal, mask, has_mask)


KERNELS = {"v1": flash_attention_forward_v1, "v1_delta": flash_attention_backward_v1_delta,
           "v1_dkdv": flash_attention_backward_v1_dkdv, "v1_dq": flash_attention_backward_v1_dq,
           "v1_general": flash_attention_forward_v1_general,
           "v1_general_dkdv": flash_attention_backward_v1_general_dkdv,
           "v1_general_dq": flash_attention_backward_v1_general_dq}
_H4 = "float32[:, :, :, ::1]"  # (B, nh, T, hs) C-contiguous
_R3 = "float32[:, :, ::1]"     # (B, nh, T)
_GEN = "int32, uint8[:, ::1], int32"  # the general kernels' causal, mask, has_mask
SIGNATURES = {
    "v1": f"void({_H4}, {_H4}, {_H4}, {_H4}, {_R3}, float32)",  # q, k, v, out, lse, scale
    "v1_delta": f"void({_H4}, {_H4}, {_R3})",  # out, dout, delta
    "v1_dkdv": f"void({_H4}, {_H4}, {_H4}, {_H4}, {_R3}, {_R3}, {_H4}, {_H4}, float32)",
    "v1_dq": f"void({_H4}, {_H4}, {_H4}, {_H4}, {_R3}, {_R3}, {_H4}, float32)",
    # + causal (0/1), mask (Tq, Tk) uint8 (a (1, 1) dummy without one), has_mask (0/1)
    "v1_general": f"void({_H4}, {_H4}, {_H4}, {_H4}, {_R3}, float32, {_GEN})",
    "v1_general_dkdv": f"void({_H4}, {_H4}, {_H4}, {_H4}, {_R3}, {_R3}, {_H4}, {_H4}, float32, {_GEN})",
    "v1_general_dq": f"void({_H4}, {_H4}, {_H4}, {_H4}, {_R3}, {_R3}, {_H4}, float32, {_GEN})",
}
GPU_ONLY = set()
VERSIONS = ("v1",)
MAX_BLOCKS = 4096   # the delta kernel's grid cap (grid-stride)


def _grid(fn, T, BH, threads):
    threads = check_threads(fn, threads)
    return (math.ceil(T / threads), BH), threads


def _lesson11(causal, mask, q, k):
    """Whether a call is lesson 11's case, causal with no mask and as many keys as queries: v1's kernels run it."""
    tq, tk = (tuple(getattr(a, "shape", ()))[2:3] for a in (q, k))
    return isinstance(causal, (bool, np.bool_)) and bool(causal) and mask is None and tq == tk


def _general(fn, causal, mask, Tq, Tk):
    """(causal, mask, has_mask) as the general kernels' arguments: int32 flags and the mask as a (Tq, Tk) uint8
    array (a bool one viewed as uint8; None: a (1, 1) scratch array the kernels never read)."""
    has_mask = check_attention_mask(fn, causal, mask, Tq, Tk)
    if has_mask and str(mask.dtype) == "bool":
        mask = mask.view(np.uint8)
    elif not has_mask:
        mask = device_scratch((1, 1), np.uint8)
    return np.int32(bool(causal)), mask, np.int32(has_mask)


def flash_attention_forward(q, k, v, out, lse, version="v1", threads=64, *, causal=True, mask=None):
    """out = softmax(q k^T / sqrt(hs)) v over the keys each query sees, and lse = its rows' log-sum-exp, without the
    (Tq, Tk) scores. q, out float32 (B, nh, Tq, hs); k, v float32 (B, nh, Tk, hs); lse float32 (B, nh, Tq).
    threads: query rows per block. causal (default True): query t sees keys s <= t + Tk - Tq (bottom-right aligned;
    Tk < Tq refused); mask: None or a (Tq, Tk) uint8 / bool array, nonzero = allowed, for every batch and head. A
    query that sees no key gets out = 0, lse = -inf. The default (causal, no mask, Tq = Tk) runs lesson 11's kernel,
    anything else the general one (the module docstring); reference.sdpa_forward computes the same."""
    fn = "flash_attention_forward"
    check_version(fn, version, VERSIONS)
    if _lesson11(causal, mask, q, k):
        B, nh, T, hs = check_flash_args(fn, [("q", q), ("k", k), ("v", v), ("out", out)], [("lse", lse)])
        if B * nh * T == 0:
            return
        grid, block = _grid(fn, T, B * nh, threads)
        flash_attention_forward_v1[grid, block, launch_stream()](q, k, v, out, lse, scale_of(hs))
        return
    B, nh, Tq, Tk, hs = check_flash_qk_args(fn, [("q", q), ("out", out)], [("k", k), ("v", v)], [("lse", lse)])
    flags = _general(fn, causal, mask, Tq, Tk)
    if B * nh * Tq == 0:
        return
    grid, block = _grid(fn, Tq, B * nh, threads)
    flash_attention_forward_v1_general[grid, block, launch_stream()](q, k, v, out, lse, scale_of(hs), *flags)


def flash_attention_backward(q, k, v, out, dout, lse, dq, dk, dv, version="v1", threads=64, *, causal=True,
                             mask=None):
    """dq, dk, dv of out = flash_attention_forward(q, k, v, causal=causal, mask=mask), from the saved out and lse
    (the probabilities are recomputed): pass the forward's causal and mask. q, out, dout, dq (B, nh, Tq, hs); k, v,
    dk, dv (B, nh, Tk, hs); lse (B, nh, Tq); all float32. threads: rows per block. A key no query sees gets dk = dv
    = 0, a query that sees no key dq = 0."""
    fn = "flash_attention_backward"
    check_version(fn, version, VERSIONS)
    general = not _lesson11(causal, mask, q, k)
    if general:
        B, nh, Tq, Tk, hs = check_flash_qk_args(fn, [("q", q), ("out", out), ("dout", dout), ("dq", dq)],
                                                [("k", k), ("v", v), ("dk", dk), ("dv", dv)], [("lse", lse)])
        flags = _general(fn, causal, mask, Tq, Tk)
    else:
        heads = [("q", q), ("k", k), ("v", v), ("out", out), ("dout", dout), ("dq", dq), ("dk", dk), ("dv", dv)]
        B, nh, Tq, hs = check_flash_args(fn, heads, [("lse", lse)])
        Tk = Tq
    if B * nh * Tq == 0:
        return
    stream = launch_stream()
    delta = device_scratch((B, nh, Tq), np.float32)
    rows = B * nh * Tq
    flash_attention_backward_v1_delta[min(math.ceil(rows / 256), MAX_BLOCKS), 256, stream](out, dout, delta)
    scale = scale_of(hs)
    grid_k, block = _grid(fn, Tk, B * nh, threads)
    grid_q, _ = _grid(fn, Tq, B * nh, threads)
    if general:
        flash_attention_backward_v1_general_dkdv[grid_k, block, stream](q, k, v, dout, lse, delta, dk, dv, scale,
                                                                        *flags)
        flash_attention_backward_v1_general_dq[grid_q, block, stream](q, k, v, dout, lse, delta, dq, scale, *flags)
        return
    flash_attention_backward_v1_dkdv[grid_k, block, stream](q, k, v, dout, lse, delta, dk, dv, scale)
    flash_attention_backward_v1_dq[grid_q, block, stream](q, k, v, dout, lse, delta, dq, scale)
