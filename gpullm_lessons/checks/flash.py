"""Checkers for lesson 11: flash attention's forward and backward (causal, scale 1/sqrt(hs)).

    check_flash_attention_forward(fn)    fn(q, k, v, out, lse): q, k, v, out (B, nh, T, hs), lse (B, nh, T)
        out = softmax(q k^T / sqrt(hs), causal) v and lse = the log-sum-exp of each row of the scaled, masked scores.
    check_flash_attention_backward(fn)   fn(q, k, v, out, dout, lse, dq, dk, dv): the gradients of q, k, v, given the
        forward's out and lse; the same inputs twice must give the same bits, and in the simulator no float atomics.
    check_flash_attention_forward_packed(fn)   fn(qkv, out, lse, nh): the forward on the engine's layout: q, k, v side
        by side in each row of qkv (B, T, 3C), out (B, T, C) with the heads side by side, lse (B, nh, T), C = nh * hs.

The oracle is lesson 01's reference attention (``reference.attention_forward`` / ``attention_backward`` on q, k, v
merged into (B, T, 3C)), in float64; lse comes from the same masked scores. The cases (``CASES``) put T past one tile
of keys and past one block of query rows in the simulator (T = 37 with tiles of 8, 16 or 32 rows), repeat the first
shapes with new values (a kernel that keeps state fails there), and have T = 1; on a GPU T reaches 1000 with hs = 64.
The named mistakes are computed from the same inputs, most of them by replaying the tiled algorithm in NumPy with
one step wrong, for every tile width in ``TILES`` (a running output that is not rescaled when the max grows, a
running sum that is not, a key-tile loop that stops at the block's first query row, a mask off by one, no
1/sqrt(hs), an unnormalised output, a wrong log-sum-exp), so the hint names the step and the tile width.

Lesson 11's timing tables show a version's time only after its outputs matched the reference: ``checked(result)``
keeps the rows of a live kernel-benchmark result that the benchmark validated itself before timing them (a wrong
version is already a row with "wrong (max err ...)" and no time) and takes the time off any other; in a stored
result it does the same for the rows ``NOT_VALID`` lists. ``format_checks`` prints what was compared.
"""

from __future__ import annotations

import math

import numpy as np

from . import opcheck
from .. import reference as ref
from .opcheck import Case, Mistake, Op, Rules
from .verdict import CheckResult, close, mistake_slack

__all__ = ["check_flash_attention_forward", "check_flash_attention_backward", "check_flash_attention_forward_packed",
           "reference", "CASES", "TILES", "checked", "format_checks", "NOT_VALID"]

# (B, nh, T, hs) per case: one that fits in a tile, the same shapes again, T past one tile and one block of rows
# (not a multiple of any tile), T = 1.
CASES = {
    "small": ((1, 2, 7, 8), (1, 2, 7, 8), (2, 1, 37, 16), (1, 1, 1, 4)),
    "large": ((2, 3, 67, 64), (2, 3, 67, 64), (1, 2, 1000, 64), (1, 1, 1, 64)),
}
TILES = (8, 16, 32, 64, 128)  # the key-tile widths (and query-block heights) the tile mistakes are replayed for


def _merge(x):
    """(B, nh, T, hs) -> (B, T, nh * hs), the reference's layout."""
    B, nh, T, hs = x.shape
    return x.transpose(0, 2, 1, 3).reshape(B, T, nh * hs)


def _split(x, nh):
    B, T, C = x.shape
    return x.reshape(B, T, nh, C // nh).transpose(0, 2, 1, 3)


def reference(q, k, v, dout=None, *, causal=True, mask=None):
    """float64 (out, lse) of causal attention with scale 1/sqrt(hs) on (B, nh, T, hs) arrays, from lesson 01's
    reference attention (lse from the masked scores); with dout, (out, lse, dq, dk, dv). The checkers' oracle, for
    tests of kernels that take other formats (the HIP v2's half inputs).
    Attention in general (causal=False, a (Tq, Tk) bool mask, or k, v with Tk != Tq rows): reference.sdpa_forward /
    sdpa_backward in float64 (bottom-right aligned causal; a query that sees no key: out 0, lse -inf, no gradient)."""
    if not (causal is True and mask is None and np.shape(q)[2:3] == np.shape(k)[2:3]):
        out, cache = ref.sdpa_forward(*(np.asarray(a, np.float64) for a in (q, k, v)), causal=causal,
                                      mask=None if mask is None else np.asarray(mask))
        if dout is None:
            return out, cache["lse"]
        return (out, cache["lse"]) + tuple(ref.sdpa_backward(np.asarray(dout, np.float64), cache))
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    nh, T, hs = q.shape[1:]
    out, cache = ref.attention_forward(np.concatenate([_merge(q), _merge(k), _merge(v)], axis=-1), nh)
    S = np.where(np.arange(T)[None, :] <= np.arange(T)[:, None], q @ k.swapaxes(-1, -2) / math.sqrt(hs), -np.inf)
    result = (_split(out, nh), _softmax_rows(S)[1])
    if dout is None:
        return result
    dqkv = ref.attention_backward(_merge(np.asarray(dout, np.float64)), cache)
    return result + tuple(_split(d, nh) for d in np.split(dqkv, 3, axis=-1))


def _scores(c, scale=True, shift=0):
    """The masked scores S (B, nh, T, T) in float64: scale q k^T, -inf where s > t + shift."""
    q, k = c.x["q"], c.x["k"]
    hs, T = q.shape[-1], q.shape[-2]
    S = q @ k.swapaxes(-1, -2)
    if scale is True:
        S = S / math.sqrt(hs)
    elif scale:
        S = S * scale
    t, s = np.arange(T)[:, None], np.arange(T)[None, :]
    return np.where(s <= t + shift, S, -np.inf)


def _softmax_rows(S):
    """(P, lse) of the rows of S (rows with no finite entry: P = NaN, lse = -inf)."""
    with np.errstate(all="ignore"):
        m = S.max(axis=-1, keepdims=True)
        e = np.exp(S - m)
        l = e.sum(axis=-1, keepdims=True)
        return e / l, (m + np.log(l))[..., 0]


def _make(rng, dt, size, k, backward):
    B, nh, T, hs = CASES[size][k]
    c = Case(dt, {"B": B, "nh": nh, "T": T, "hs": hs})
    for name in ("q", "k", "v"):
        c.add_float(name, ("B", "nh", "T", "hs"), rng.standard_normal((B, nh, T, hs)) * rng.uniform(0.5, 1.5))
    if not backward:
        c.add_output("out", ("B", "nh", "T", "hs"))
        c.add_output("lse", ("B", "nh", "T"))
        return c
    out, lse = _forward(c)
    c.add_float("out", ("B", "nh", "T", "hs"), out)
    c.add_float("dout", ("B", "nh", "T", "hs"), rng.standard_normal((B, nh, T, hs)))
    c.add_float("lse", ("B", "nh", "T"), lse)
    for name in ("dq", "dk", "dv"):
        c.add_output(name, ("B", "nh", "T", "hs"))
    return c


def _forward(c):
    """(out, lse) in float64: out from the reference attention (lesson 01), lse from the masked scores."""
    nh = c.dims["nh"]
    qkv = np.concatenate([_merge(c.x[n]) for n in ("q", "k", "v")], axis=-1)
    out, _ = ref.attention_forward(qkv, nh)
    return _split(out, nh), _softmax_rows(_scores(c))[1]


def _expected_forward(c):
    out, lse = _forward(c)
    return {"out": out, "lse": lse}


def _expected_backward(c):
    nh = c.dims["nh"]
    qkv = np.concatenate([_merge(c.x[n]) for n in ("q", "k", "v")], axis=-1)
    _, cache = ref.attention_forward(qkv, nh)
    dqkv = ref.attention_backward(_merge(c.x["dout"]), cache)
    dq, dk, dv = (_split(d, nh) for d in np.split(dqkv, 3, axis=-1))
    return {"dq": dq, "dk": dk, "dv": dv}


# ---- the forward, replayed tile by tile with one step changed ------------------------------------------------------
def _tiled(c, BC, BR=None, rescale_acc=True, rescale_l=True, accumulate=True, rows=None):
    """The tiled forward in float64 over key tiles of BC rows: (out, lse). BR: the query rows of a block whose key
    loop stops at the block's FIRST row (the mistake); None: the right loop. rescale_acc / rescale_l: multiply the
    running output / sum by alpha = exp(m - m') when the max grows. accumulate: True (right), "seen" (acc = the last
    tile's p v among those the row sees), "always" (acc = the last tile's p v, 0 where the row sees none of it),
    "reset" (m, l and acc all set back to their start at every tile: the last tile alone, and l = 0 where the row sees
    none of it: out NaN, lse -inf). rows: the block of query rows whose loop runs while s0 <= its last row (the right
    causal skipping of a kernel: which tile is a row's last); None: every row visits every tile."""
    S = _scores(c)
    v = c.x["v"]
    T = S.shape[-1]
    t = np.arange(T)
    if BR is not None:
        S = np.where((t[None, :] // BC) * BC <= (t[:, None] // BR) * BR, S, -np.inf)
    t_last = np.minimum(T, (t // rows) * rows + rows) - 1 if rows else np.full(T, T - 1)
    m = np.full(S.shape[:-1], -np.inf)
    l = np.zeros(S.shape[:-1])
    acc = np.zeros(v.shape)
    with np.errstate(all="ignore"):
        for s0 in range(0, T, BC):
            visits = s0 <= t_last                                       # (T,): the rows whose loop reaches s0
            if accumulate == "reset":
                m, l, acc = (np.where(visits, -np.inf, m), np.where(visits, 0.0, l),
                             np.where(visits[:, None], 0.0, acc))
            St = S[..., s0:s0 + BC]
            mt = St.max(axis=-1)
            has = mt > -np.inf
            m_new = np.where(has, np.maximum(m, mt), m)
            alpha = np.where(has & (m > -np.inf), np.exp(m - m_new), np.where(has, 0.0, 1.0))
            p = np.where(St > -np.inf, np.exp(St - m_new[..., None]), 0.0)
            pv = p @ v[..., s0:s0 + BC, :]
            l = (alpha if rescale_l else np.where(m > -np.inf, 1.0, 0.0)) * l + p.sum(axis=-1)
            if accumulate in (True, "reset"):
                acc = (alpha if rescale_acc else np.where(m > -np.inf, 1.0, 0.0))[..., None] * acc + pv
            elif accumulate == "seen":      # replaced by the tiles the row sees (a kernel merging under a guard)
                acc = np.where(has[..., None], pv, acc)
            else:                           # replaced by every tile the row's loop visits, 0 where it sees none
                acc = np.where(visits[:, None], pv, acc)
            m = m_new
        return acc / l[..., None], m + np.log(l)


def _tile_test(hint, **wrong):
    """A pattern test: ours equals the tiled forward with `wrong` for some tile width; the hint names the width. A
    mistake in how the running state is kept (accumulate=...) is also tried with the causal tile skipping of a kernel
    whose blocks have as many query rows as a tile width (that decides which tile is a row's last)."""
    def test(c, name, ours, expected, bad):
        tol = opcheck.TOLERANCES[c.dtype.name]
        blocks = (None,) + TILES if "accumulate" in wrong else (None,)
        for BC in TILES:
            if BC >= c.dims["T"] and "BR" not in wrong:
                break
            for BR in (TILES if "BR" in wrong else (None,)):
                kw = dict(wrong, BR=BR) if "BR" in wrong else wrong
                for rows in blocks:
                    got = _tiled(c, BC, rows=rows, **kw)[0 if name == "out" else 1]
                    if _matches(ours, got, expected, tol):
                        return hint.format(BC=BC, BR=BR)
        return None
    return test


def _matches(ours, candidate, expected, tol) -> bool:
    """ours equals the candidate (NaN where it is NaN, the same infinities) that is itself not the right answer."""
    if candidate.shape != ours.shape:
        return False
    finite = np.isfinite(candidate)
    if not finite.all():
        same = np.where(np.isnan(candidate), np.isnan(ours), ours == candidate)
        if not same[~finite].all() or not finite.any():
            return False
        return close(ours[finite], candidate[finite], mistake_slack(tol))
    return not close(candidate, expected, tol) and close(ours, candidate, mistake_slack(tol))


def _diagonal_excluded(c, name, ours, expected, bad):
    """Mask s < t: row 0 sees no key (0/0: NaN), every other row misses its own key."""
    S = _scores(c, shift=-1)
    P, lse = _softmax_rows(S)
    got = (np.nan_to_num(P) @ c.x["v"]) if name == "out" else lse
    tol = opcheck.TOLERANCES[c.dtype.name]
    if c.dims["T"] < 2 or np.isfinite(ours[..., 0, :] if name == "out" else ours[..., 0]).all():
        return None
    rest = (slice(None), slice(None), slice(1, None))
    if _matches(ours[rest], got[rest], expected[rest], tol):
        return ("the causal mask is off by one: query t sees the keys s <= t, its own position included; yours "
                "takes s < t, so row 0 has no key at all (0 / 0: NaN) and every other row misses its diagonal")
    return None


def _attention_with(c, **score_kw):
    """{out, lse} of attention over _scores(c, **score_kw) (a different scale or mask)."""
    P, lse = _softmax_rows(_scores(c, **score_kw))
    return {"out": P @ c.x["v"], "lse": lse}


def _no_divide(c):
    S = _scores(c)
    with np.errstate(all="ignore"):
        e = np.exp(S - S.max(axis=-1, keepdims=True))
    return {"out": e @ c.x["v"]}


_RESCALE = ("when a tile raises a row's max from m to m', everything accumulated so far was exponentiated against "
            "the old max: multiply BOTH the running sum l and the running output acc by alpha = exp(m - m') before "
            "adding the tile (acc = alpha * acc + sum_s exp(S - m') v[s]). ")
_FORWARD = Op(
    "flash_attention_forward", lambda rng, dt, size, k: _make(rng, dt, size, k, False), _expected_forward,
    # the course's own implementations: an answer that is, wraps or calls one is not correct (checks/borrowed.py)
    own=(
        "gpullm_lessons.kernels.numba.flash:flash_attention_forward_v1",
        "gpullm_lessons.kernels.numba.flash:flash_attention_forward_v1_general",
        "gpullm_lessons.kernels.numba.flash:flash_attention_forward",
        "gpullm_lessons.checks.flash:reference",
        "gpullm_lessons.reference.attention:attention_forward",
        "gpullm_lessons.reference.attention:sdpa_forward",
    ),
    n_cases=4,
    formula="out[t] = sum_{s <= t} softmax_s(q[t] . k[s] / sqrt(hs)) v[s]; lse[t] = log sum_{s <= t} "
            "exp(q[t] . k[s] / sqrt(hs)): per key tile m' = max(m, tile max), alpha = exp(m - m'), "
            "l = alpha l + sum exp(S - m'), acc = alpha acc + sum exp(S - m') v; then out = acc / l, lse = m + log l",
    shape_hint="q, k, v, out are (B, nh, T, hs); lse is (B, nh, T): one value per query row",
    mistakes=[
        Mistake("", test=_tile_test(
            "your running output is not rescaled: " + _RESCALE + "Yours multiplies l only (it matches tiles of {BC} "
            "keys: rows whose max grows in a later tile come out wrong)", rescale_acc=False)),
        Mistake("", test=_tile_test(
            "your running sum l is not rescaled: " + _RESCALE + "Yours multiplies acc only (tiles of {BC} keys)",
            rescale_l=False)),
        Mistake("", test=_tile_test(
            "neither the running sum nor the running output is rescaled when the max grows: " + _RESCALE
            + "(tiles of {BC} keys)", rescale_acc=False, rescale_l=False)),
        *[Mistake("", test=_tile_test(
            "the output keeps only the last key tile's p v: acc is set to 0 (or replaced) at every key tile; it must "
            "start at 0 once, before the loop, and ADD each tile (acc = alpha * acc + p v) (tiles of {BC} keys)",
            accumulate=how)) for how in ("seen", "always")],
        Mistake("", test=_tile_test(
            "the running state (m, l and acc) is set back to its start at every key tile: the output keeps only the "
            "last key tile a row's loop visits, and a row that sees no key of that tile ends with l = 0 (out = 0 / 0 "
            "= NaN, lse = log 0 = -inf). Set m = -inf, l = 0, acc = 0 once per query row, before the loop over the "
            "key tiles (tiles of {BC} keys)", accumulate="reset")),
        Mistake("", test=_tile_test(
            "causal tile skipping stops too early: a block of query rows t0 .. t1 needs every key tile that starts "
            "at s0 <= t1, its LAST row; yours stops at tiles starting at s0 <= t0, its first row, so the block's "
            "later rows lose the keys of the tile that straddles the diagonal (blocks of {BR} rows, tiles of {BC} "
            "keys). Loop while s0 <= min(T, t0 + blockDim.x) - 1", BR=True)),
        Mistake("", test=_diagonal_excluded),
        Mistake("the causal mask is off by one: query t sees the keys s <= t; yours also takes s = t + 1",
                lambda c: _attention_with(c, shift=1)),
        Mistake("the 1/sqrt(hs) scale is missing: the scores are q[t] . k[s] / sqrt(hs) (scale q once as you load "
                "it, or each dot product)", lambda c: _attention_with(c, scale=False)),
        Mistake("the scale is 1/hs (1/sqrt(hs) applied twice?); it is 1/sqrt(hs), once",
                lambda c: _attention_with(c, scale=1.0 / c.dims["hs"])),
        Mistake("out is not normalised: at the end out = acc / l (acc holds sum exp(S - m) v, not the average)",
                _no_divide),
        Mistake("lse is the row max m only: it is m + log(l), the log of the whole sum sum_s exp(S[t, s])",
                lambda c: {"lse": _scores(c).max(axis=-1)}),
        Mistake("lse is log(l) without the max: l was summed relative to m, so lse = m + log(l)",
                lambda c: {"lse": _softmax_rows(_scores(c))[1] - _scores(c).max(axis=-1)}),
        Mistake("lse is m + l: it is m + log(l)",
                lambda c: {"lse": _scores(c).max(axis=-1)
                           + np.exp(_softmax_rows(_scores(c))[1] - _scores(c).max(axis=-1))}),
    ])


# ---- the backward ---------------------------------------------------------------------------------------------------
def _backward_with(c, scale_s=True, delta=True, delta_of="out", scale_dq=True, scale_dk=True, shift=0):
    """dq, dk, dv from P = exp(S - lse) with one step changed (float64)."""
    q, k, v, do = c.x["q"], c.x["k"], c.x["v"], c.x["dout"]
    hs = c.dims["hs"]
    scale = 1.0 / math.sqrt(hs)
    S = _scores(c, scale=scale_s, shift=shift)
    with np.errstate(all="ignore"):
        P = np.where(S > -np.inf, np.exp(S - c.x["lse"][..., None]), 0.0)
    dP = do @ v.swapaxes(-1, -2)
    D = (do * c.x["out"]).sum(axis=-1) if delta_of == "out" else do.sum(axis=-1)
    dS = P * (dP - D[..., None]) if delta else P * dP
    return {"dq": (scale if scale_dq else 1.0) * dS @ k, "dk": (scale if scale_dk else 1.0) * dS.swapaxes(-1, -2) @ q,
            "dv": P.swapaxes(-1, -2) @ do}


def _only(names, **wrong):
    return lambda c: {n: a for n, a in _backward_with(c, **wrong).items() if n in names}


_BACKWARD = Op(
    "flash_attention_backward", lambda rng, dt, size, k: _make(rng, dt, size, k, True), _expected_backward,
    # the course's own implementations: an answer that is, wraps or calls one is not correct (checks/borrowed.py)
    own=(
        "gpullm_lessons.kernels.numba.flash:flash_attention_backward_v1_dq",
        "gpullm_lessons.kernels.numba.flash:flash_attention_backward_v1_general_dq",
        "gpullm_lessons.kernels.numba.flash:flash_attention_backward",
        "gpullm_lessons.checks.flash:reference",
        "gpullm_lessons.reference.attention:attention_backward",
        "gpullm_lessons.reference.attention:sdpa_backward",
    ),
    n_cases=4,
    formula="P[t, s] = exp(q[t] . k[s] / sqrt(hs) - lse[t]) for s <= t; delta[t] = dout[t] . out[t]; dv[s] = sum_t "
            "P[t, s] dout[t]; dS = P (dout[t] . v[s] - delta[t]); dq[t] = sum_s dS k[s] / sqrt(hs); dk[s] = sum_t "
            "dS q[t] / sqrt(hs)",
    shape_hint="q, k, v, out, dout, dq, dk, dv are (B, nh, T, hs); lse is (B, nh, T)",
    mistakes=[
        Mistake("P is recomputed without the 1/sqrt(hs) scale: P = exp(q . k / sqrt(hs) - lse), the same scores "
                "the forward exponentiated", lambda c: _backward_with(c, scale_s=False)),
        Mistake("dS is missing softmax backward's row term: dS = P (dP - delta), delta[t] = dout[t] . out[t]",
                _only(("dq", "dk"), delta=False)),
        Mistake("delta is the row sum of dout; it is dout[t] . out[t] = sum_j dout[t, j] out[t, j]",
                _only(("dq", "dk"), delta_of="dout")),
        Mistake("dq is missing the 1/sqrt(hs) scale: dq = dS k / sqrt(hs)", _only(("dq",), scale_dq=False)),
        Mistake("dk is missing the 1/sqrt(hs) scale: dk = dS^T q / sqrt(hs)", _only(("dk",), scale_dk=False)),
        Mistake("the causal mask is off by one: s <= t; yours also takes s = t + 1",
                lambda c: _backward_with(c, shift=1)),
        Mistake("the causal mask is missing: P[t, s] = 0 for s > t (skip those keys, or those query tiles)",
                lambda c: _backward_with(c, shift=c.dims["T"])),
        Mistake("dk and dv are swapped: dv = P^T dout, dk = dS^T q / sqrt(hs)",
                lambda c: {"dk": _backward_with(c)["dv"], "dv": _backward_with(c)["dk"]}),
    ])

_BACKWARD_RULES = Rules("check_flash_attention_backward", repeat=True, no_float_atomics=True, barriers=True,
                        trace_case=2)
# the kernels share key tiles in shared memory: in the simulator the case past one tile (T = 37) is traced, and a
# missing barrier fails even where the simulator's order of threads gave the right values
_FORWARD_RULES = Rules("check_flash_attention_forward", barriers=True, trace_case=2)
_PACKED_RULES = Rules("check_flash_attention_forward_packed", barriers=True, trace_case=2)


# ---- the forward on the engine's packed layout ----------------------------------------------------------------------
# (B, nh, T, hs) per case: B and nh above 1 where the row and head offsets show, T past one tile and one block of rows
PACKED_CASES = {
    "small": ((2, 2, 7, 8), (2, 2, 7, 8), (2, 3, 37, 16), (1, 1, 1, 4)),
    "large": ((2, 3, 67, 64), (2, 3, 67, 64), (2, 4, 1000, 64), (1, 1, 1, 64)),
}


def _make_packed(rng, dt, size, k):
    B, nh, T, hs = PACKED_CASES[size][k]
    C = nh * hs
    c = Case(dt, {"B": B, "nh": nh, "T": T, "hs": hs, "C": C, "3C": 3 * C})
    qkv = c.add_float("qkv", ("B", "T", "3C"), rng.standard_normal((B, T, 3 * C)) * rng.uniform(0.5, 1.5))
    for i, name in enumerate(("q", "k", "v")):  # the heads' view, for the reference and the mistakes
        c.x[name] = np.ascontiguousarray(_split(qkv[..., i * C : (i + 1) * C], nh))
    c.add_output("out", ("B", "T", "C"))
    c.add_output("lse", ("B", "nh", "T"))
    c.scalars["nh"] = nh
    return c


def _expected_packed(c):
    out, lse = _forward(c)
    return {"out": _merge(out), "lse": lse}


def _packed_with(c, column):
    """{out, lse} when q, k, v of head h are read from the columns column(i, h, C, hs) .. + hs - 1 of each row of qkv
    (i = 0 q, 1 k, 2 v) instead of i * C + h * hs."""
    nh, hs, C = c.dims["nh"], c.dims["hs"], c.dims["C"]
    qkv = c.x["qkv"]
    wrong = Case(c.dtype, c.dims)
    for i, name in enumerate(("q", "k", "v")):
        wrong.x[name] = np.stack([qkv[..., column(i, h, C, hs) + np.arange(hs)] for h in range(nh)], axis=1)
    out, lse = _forward(wrong)
    return {"out": _merge(out), "lse": lse}


def _in_heads(test):
    """A pattern test of the heads layout applied to the packed out (B, T, C), seen as (B, nh, T, hs)."""
    def packed_test(c, name, ours, expected, bad):
        if name == "out":
            nh = c.dims["nh"]
            ours, expected = _split(ours, nh), _split(expected, nh)
            bad = _split(bad, nh) if np.shape(bad) == np.shape(ours) else bad
        return test(c, name, ours, expected, bad)
    return packed_test


_RIGHT = "q of head h at row t of sequence b starts at ((b T + t) 3C + h hs), k at + C, v at + 2C"
_PACKED = Op(
    "flash_attention_forward_packed", _make_packed, _expected_packed,
    # the course's own implementations: an answer that is, wraps or calls one is not correct (checks/borrowed.py)
    own=(
        "gpullm_lessons.kernels.numba.flash:flash_attention_forward_v1",
        "gpullm_lessons.kernels.numba.flash:flash_attention_forward_v1_general",
        "gpullm_lessons.kernels.numba.flash:flash_attention_forward",
        "gpullm_lessons.checks.flash:reference",
        "gpullm_lessons.reference.attention:attention_forward",
        "gpullm_lessons.reference.attention:sdpa_forward",
    ),
    n_cases=4,
    formula="the forward of check_flash_attention_forward, reading q, k, v of head h from the columns h*hs .. "
            "h*hs + hs - 1 of the thirds [0, C), [C, 2C), [2C, 3C) of qkv's row (b, t), writing out[b, t, h*hs + j] "
            "and lse[b, h, t]",
    shape_hint="qkv is (B, T, 3C), out (B, T, C), lse (B, nh, T), C = nh * hs; nh is the last argument",
    mistakes=[
        Mistake("every head reads head 0's columns: head h's values are at columns h*hs .. h*hs + hs - 1 of each "
                "third (" + _RIGHT + ")", lambda c: _packed_with(c, lambda i, h, C, hs: i * C)),
        Mistake("k and v are read hs columns after q instead of C and 2C: a row holds all of q (C values), then all "
                "of k, then all of v (" + _RIGHT + ")", lambda c: _packed_with(c, lambda i, h, C, hs: h * hs + i * hs)),
        Mistake("k and v are swapped: k is the middle third of the row (columns C .. 2C - 1), v the last ("
                + _RIGHT + ")", lambda c: _packed_with(c, lambda i, h, C, hs: (0, 2, 1)[i] * C + h * hs)),
        Mistake("", test=_in_heads(_tile_test(
            "causal tile skipping stops too early: a block of query rows t0 .. t1 needs every key tile that starts "
            "at s0 <= t1, its LAST row; yours stops at tiles starting at s0 <= t0 (blocks of {BR} rows, tiles of "
            "{BC} keys)", BR=True))),
        Mistake("", test=_in_heads(_tile_test(
            "your running output is not rescaled: " + _RESCALE + "(tiles of {BC} keys)", rescale_acc=False))),
        Mistake("the 1/sqrt(hs) scale is missing: the scores are q[t] . k[s] / sqrt(hs)",
                lambda c: {k: (_merge(v) if k == "out" else v) for k, v in _attention_with(c, scale=False).items()}),
        Mistake("the causal mask is off by one: query t sees the keys s <= t; yours also takes s = t + 1",
                lambda c: {k: (_merge(v) if k == "out" else v) for k, v in _attention_with(c, shift=1).items()}),
    ])


def check_flash_attention_forward(fn, *, arrays="numba", dtype=np.float32, size=None, seed=None, task=None,
                                  quiet=False) -> CheckResult:
    """Check fn(q, k, v, out, lse) (q, k, v, out (B, nh, T, hs), lse (B, nh, T)): causal attention with scale
    1/sqrt(hs) and each row's log-sum-exp, against lesson 01's reference. arrays: "numba" (simulator or GPU),
    "cupy" or "numpy"; size None: small in the simulator, large on a GPU (CASES)."""
    return opcheck.run(_FORWARD, fn, rules=_FORWARD_RULES, arrays=arrays, dtype=dtype, size=size, seed=seed,
                       task=task, quiet=quiet)


def check_flash_attention_forward_packed(fn, *, arrays="numba", dtype=np.float32, size=None, seed=None, task=None,
                                         quiet=False) -> CheckResult:
    """Check fn(qkv, out, lse, nh): the forward of check_flash_attention_forward on the engine's layout (qkv (B, T,
    3C) with q, k, v side by side in each row; out (B, T, C) with the heads side by side; lse (B, nh, T)), against
    lesson 01's reference. Named mistakes: the column and row offsets of the layout, out in the heads layout."""
    return opcheck.run(_PACKED, fn, rules=_PACKED_RULES, arrays=arrays, dtype=dtype, size=size, seed=seed,
                       task=task, quiet=quiet)


def check_flash_attention_backward(fn, *, arrays="numba", dtype=np.float32, size=None, seed=None, task=None,
                                   quiet=False) -> CheckResult:
    """Check fn(q, k, v, out, dout, lse, dq, dk, dv): the gradients of causal attention from the saved out and lse,
    against lesson 01's reference; the last case runs twice and must give the same bits; in the simulator the
    first call is traced and a float atomic fails (the result must not depend on the order threads run in)."""
    return opcheck.run(_BACKWARD, fn, rules=_BACKWARD_RULES, arrays=arrays, dtype=dtype, size=size, seed=seed,
                       task=task, quiet=quiet)


# ---- the kernel benchmark's rows, checked before a table shows them (lesson 11) -------------------------------------
# Every version a lesson times was first run by the benchmark itself on its own inputs and compared with the
# reference (bench.case_rows: validate, then time); a table shows a time only for a row that passed.
NOT_VALID = {
    # (card, date) of a stored run -> {(op, version): why}. Rows of a stored run that timed a wrong launch: v2's and
    # v3's backward launched their dQ kernel with the newer versions' argument list, one pointer (out) longer, so it
    # read every argument after v from the wrong place (NaN, or an illegal address).
    ("NVIDIA H200", "2026-12-04"): {("flash_bwd_bf16", v): "not valid: dQ launched with a wrong argument list"
                                    for v in ("v2", "v3")},
}


def checked(result: dict) -> dict:
    """A kernel_results / stored result (or a stored Nsight Compute run) whose rows a table may show as times.

    Live (measured now): a row of the course's versions (backends numba and hip) keeps its time only when the
    benchmark validated it against the reference before timing it ("validation" ok); a row the benchmark found wrong
    has no time already and keeps its "error"; any other row loses its time ("not validated"). Stored: the rows that
    NOT_VALID lists for the run's card and date lose theirs the same way (a row without "ms", as Nsight Compute's, is
    dropped). result["checks"] lists what was compared and what has no time (format_checks)."""
    live = bool(result.get("live"))
    bad = NOT_VALID.get((result.get("card"), result.get("date")), {}) if not live else {}
    rows, checks = [], []
    for r in result["rows"]:
        version = str(r.get("version"))
        why = bad.get((r["op"], version))
        if live and r.get("backend") in ("numba", "hip"):
            v = r.get("validation") or {}
            if "error" in r:  # no time already: found wrong before it was timed, or its timing failed
                checks.append((r["op"], version, r["error"]))
            elif v.get("ok"):
                checks.append((r["op"], version, f"correct (max err {v['max_err']:.1e}, tol {v['tol']:g})"))
            else:
                why = "not validated: the benchmark did not compare it with the reference, so no time is shown"
        if why is None:
            rows.append(r)
            continue
        checks.append((r["op"], version, why))
        if "ms" in r:  # the kernel tables show the row with its verdict in place of a time
            rows.append({k: r[k] for k in ("op", "shape", "backend", "version") if k in r} | {"error": why})
    return dict(result, rows=rows, checks=checks)


def format_checks(result: dict) -> str:
    """The lines of a checked() result: each version compared with the reference (live), each row not shown as a
    time and why."""
    if result.get("live"):
        head = ["each version's outputs against lesson 01's reference attention (float64) on the same inputs, before "
                "any time is shown:"]
    elif result.get("checks"):
        head = [f"rows of this stored run ({result['card']}, {result['date']}) not shown as times:"]
    else:
        return (f"the stored run's times ({result['card']}, {result['date']}); on a GPU this cell first checks each "
                f"version against the reference")
    return "\n".join(head + [f"  {op:<16}{version:<10}{why}" for op, version, why in result["checks"]])
