"""Checkers for kernel tasks that need more than an op's values: a fixed summation order, no races, one pass.

They follow ``gpullm_lessons.checks.backward`` (fresh inputs, NaN-poisoned outputs, a float64 reference, a table of named
mistakes, three verdicts printed, ``seed=`` to reproduce) and add, per task, rules about HOW the outputs were made:

    check_layernorm_dparams(fn)              fn(dout (N,C), inp (N,C), mean (N,), rstd (N,), dweight (C,), dbias (C,))
        LayerNorm's dweight / dbias with a deterministic reduction: N spans several chunks of rows with a partial last
        one, C is not a multiple of a block; the same inputs twice must give the same bits; no float atomics.
    check_crossentropy_online(fn)            fn(logits (N,V), targets (N,) int32, dlogits (N,V))
        the fused cross-entropy backward, with hints for the one-pass (max, sum) merge: a merge that forgets to
        rescale, a rescale with the wrong sign, a max that is not merged. V spans several blocks; a row with V < the
        block (threads without an element); rows whose exp would overflow without the max.
    check_attention_softmax_backward(fn)     fn(att (B,nh,T,T), datt (B,nh,T,T), dpreatt (B,nh,T,T), hs)
        the causal softmax backward inside attention, scale 1/sqrt(hs): T = 1, T = 7, T past any block (33 in the
        simulator, 1031 on a GPU), several heads and batches. att above the diagonal holds garbage (never read it).
    check_encoder_backward_atomic(fn)        fn(dout (B,T,C), idx (B,T) int32, dwte (V,C), dwpe (maxT,C))
        the embedding backward as a scatter-add: many repeats of a few tokens, drawn deterministically; in the
        simulator every store is traced and several threads storing one element in one launch without atomics (a
        race that loses updates on a GPU) is wrong.
    check_encoder_backward_deterministic(fn) the same op, deterministic: no float atomics, and the exact bits of the
        contract's order (token v's positions p = b*T + t added in increasing p, dwpe's rows over b = 0, 1, ...,
        float32 sums from 0), twice.

How determinism is checked. On a GPU, two runs of a kernel whose float additions land in scheduling order usually
differ in their last bits, so the checker runs your function twice on the same inputs and compares bits, and (for
the embedding) compares with the contract's order bit for bit. In Numba's CUDA simulator the threads of a block run
one after another, so atomics land in the same order every run: determinism there is checked by tracing your kernels
(``gpullm_lessons.checks.kernel_trace``) and failing any float atomic on any array, besides the same bit comparisons.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from . import backward as _checks
from . import opcheck
from .. import reference as ref
from . import verdict
from .opcheck import Case, Mistake, Op, Rules, matches, random_rows
from .verdict import close, mistake_slack

__all__ = ["check_layernorm_dparams", "check_crossentropy_online", "check_attention_softmax_backward",
           "check_encoder_backward_atomic", "check_encoder_backward_deterministic"]


def _tol(c) -> float:
    return opcheck.TOLERANCES[c.dtype.name]


unfinished_kernel = opcheck.unfinished_kernel  # one detector for every checker
STUB = 'raise NotImplementedError("exercise: write this part")'   # what the exercise generator leaves in


# ------------------------------------------------------------------------------------------------------------
# layernorm_dparams(dout (N,C), inp (N,C), mean (N,), rstd (N,), dweight (C,), dbias (C,))
# ------------------------------------------------------------------------------------------------------------
# (N, C) per case. N prime: a partial last chunk for every chunk size from 2 to N / 3; C prime and above 32: several
# blocks of threads with a partial last one. Case 1 has fewer rows than any chunk. The last case runs twice.
_LN_DIMS = {"small": ((37, 37), (3, 5), (61, 19)), "large": ((769, 769), (5, 771), (4099, 768))}


def _make_ln_dparams(rng, dt, size, k):
    N, C = _LN_DIMS[size][k]
    c = Case(dt, {"N": N, "C": C})
    c.add_float("dout", ("N", "C"), random_rows(rng, (N, C)))
    inp = c.add_float("inp", ("N", "C"), random_rows(rng, (N, C)) + rng.standard_normal((N, 1)))
    mean, rstd = ref.layernorm_stats(inp)
    c.add_float("mean", ("N",), mean)
    c.add_float("rstd", ("N",), rstd)
    c.add_output("dweight", ("C",))
    c.add_output("dbias", ("C",))
    x = c.x
    x["xhat"] = (x["inp"] - x["mean"][:, None]) * x["rstd"][:, None]
    x["dweight_terms"] = x["dout"] * x["xhat"]          # (N, C): the rows dweight sums
    x["dbias_terms"] = x["dout"]
    return c


def _expected_ln_dparams(c):
    return {"dweight": c.x["dweight_terms"].sum(axis=0), "dbias": c.x["dbias_terms"].sum(axis=0)}


def _ln_terms(c):
    """Column sums of N terms: a correct fp32 sum errs relative to the terms' size times sqrt(N), not to the sum."""
    N = c.dims["N"]
    return {name: float(np.abs(c.x[f"{name}_terms"]).max()) * math.sqrt(N) for name in ("dweight", "dbias")}


def _ln_rows_hint(c, name, ours, expected, bad):
    """Which rows made it into the column sums: a prefix, a suffix, or all but a periodic set of rows."""
    terms = c.x[f"{name}_terms"]
    N = c.dims["N"]
    tol = _tol(c)
    cums = np.cumsum(terms, axis=0)
    for K in range(1, N):
        if matches(ours, cums[K - 1], expected, tol):
            if 2 * K > N:
                missing = f"row {K} is" if K == N - 1 else f"rows {K}..{N - 1} are"
                return (f"{name} sums only rows 0..{K - 1} of {N}: {missing} missing, the last, partial chunk. With N "
                        f"not a multiple of your chunk size the number of chunks rounds up (ceil(N / "
                        f"rows_per_chunk)), and the last chunk's loop stops at N")
            return (f"{name} sums only rows 0..{K - 1} of {N} (the first {K} rows): if {K} is your chunk size, "
                    f"stage 2 adds only the first chunk's partials; it must add all ceil(N / rows_per_chunk) of them")
    for K in range(1, N):
        if matches(ours, cums[-1] - cums[K - 1], expected, tol):
            return (f"{name} holds only rows {K}..{N - 1} of {N} (the last chunk): stage 2 overwrites its "
                    f"running sum with each chunk's partial instead of adding it (or keeps only the last one)")
    for R in range(2, min(N, 129)):
        rows = np.arange(N)
        for label, sel, sign in (("first", (rows % R == 0) & (rows > 0), 1.0), ("last", rows % R == R - 1, -1.0)):
            if not sel.any():
                continue
            if matches(ours, expected + sign * terms[sel].sum(axis=0), expected, tol):
                if sign > 0:
                    return (f"{name} counts rows {R}, {2 * R}, ... twice: with {R} rows per chunk, each chunk's "
                            f"loop also takes the first row of the next chunk (chunk k owns rows k*{R} .. "
                            f"min(N, (k+1)*{R}) - 1)")
                return (f"{name} misses rows {R - 1}, {2 * R - 1}, ...: with {R} rows per chunk, each chunk's loop "
                        f"stops one row early (chunk k owns rows k*{R} .. min(N, (k+1)*{R}) - 1)")
    return None


_LN_DPARAMS = Op(
    "layernorm_dparams", _make_ln_dparams, _expected_ln_dparams, n_cases=3, terms=_ln_terms,
    formula="xhat = (inp - mean) * rstd per row; dweight[c] = sum over the N rows of dout * xhat; "
            "dbias[c] = sum over the N rows of dout",
    shape_hint="dout, inp (N, C); mean, rstd (N,); dweight, dbias (C,): one sum per column, over the N rows",
    mistakes=[
        Mistake("dweight and dbias are swapped: dweight sums dout * xhat, dbias sums dout",
                 lambda c: {"dweight": c.x["dout"].sum(axis=0), "dbias": c.x["dweight_terms"].sum(axis=0)}),
        Mistake("dweight sums dout * inp; it is dout * xhat, xhat = (inp - mean[row]) * rstd[row]",
                 lambda c: {"dweight": (c.x["dout"] * c.x["inp"]).sum(axis=0)}),
        Mistake("dweight is missing the factor xhat: dweight sums dout * xhat over the rows (dbias sums dout)",
                 lambda c: {"dweight": c.x["dout"].sum(axis=0)}),
        Mistake("xhat uses the row's mean but not its rstd: xhat = (inp - mean[row]) * rstd[row]",
                 lambda c: {"dweight": (c.x["dout"] * (c.x["inp"] - c.x["mean"][:, None])).sum(axis=0)}),
        Mistake("dweight and dbias are summed along a row (over C) instead of down a column (over the N rows)",
                 opcheck.if_square(lambda c: {"dweight": c.x["dweight_terms"].sum(axis=1),
                                               "dbias": c.x["dbias_terms"].sum(axis=1)})),
        Mistake("dbias is all 0: dbias[c] sums dout[row, c] over the N rows",
                 lambda c: {"dbias": np.zeros(c.dims["C"])}),
    ])

_LN_SPLIT_HINT = ("the task is the two-stage reduction: a thread walking all N rows of a column is v1 (correct, "
                  "deterministic, and slow: only C threads). Stage 1 gives each block a chunk of ROWS_PER_CHUNK rows "
                  "(blockIdx.y) and writes partial sums (n_chunks, C); stage 2 adds the partials of each column")
_LN_DPARAMS_RULES = Rules("check_layernorm_dparams", patterns=(_ln_rows_hint,), repeat=True,
                           no_float_atomics=True, split=("dout", _LN_SPLIT_HINT))


def check_layernorm_dparams(fn, *, arrays="numpy", dtype=np.float32, size=None, seed=None, task=None,
                            quiet=False) -> verdict.CheckResult:
    """Check fn(dout (N,C), inp (N,C), mean (N,), rstd (N,), dweight (C,), dbias (C,)): LayerNorm's parameter
    gradients, deterministically. Cases: N = 37, 3, 61 rows (C = 37, 5, 19) in the simulator, N up to 4099 on a GPU;
    the last case is run twice and must give the same bits; in the simulator float atomics are traced and fail."""
    return opcheck.run(_LN_DPARAMS, fn, rules=_LN_DPARAMS_RULES, arrays=arrays, dtype=dtype, size=size, seed=seed,
                       task=task, quiet=quiet)


# ------------------------------------------------------------------------------------------------------------
# crossentropy_backward(logits (N,V), targets (N,) int32, dlogits (N,V)), one pass for the statistics
# ------------------------------------------------------------------------------------------------------------
# (N, V) per case: V over three blocks of 32 (each thread folds several logits), V below any block (threads without
# an element), a partial block. Large: GPT-2's vocabulary.
_CE_DIMS = {"small": ((5, 101), (3, 7), (4, 67)), "large": ((64, 50257), (3, 7), (129, 3001))}
_EMPTY = -3.0e38   # a finite "no element yet" max, as in kernels/numba/crossentropy.py


def _make_ce(rng, dt, size, k):
    N, V = _CE_DIMS[size][k]
    c = Case(dt, {"N": N, "V": V})
    logits = random_rows(rng, (N, V), -1.0, 0.7)
    logits[0] += 100.0                     # exp(100) overflows float32: the max must be subtracted
    logits[-1] -= 100.0                    # exp(-100) underflows to 0 in float32 without it
    c.add_float("logits", ("N", "V"), logits)
    targets = rng.integers(0, V, N)
    targets[0], targets[-1] = 0, V - 1     # the first and the last logit of a row are targets
    c.add_index("targets", ("N",), targets)
    c.add_output("dlogits", ("N", "V"))
    c.x["probs"], _ = ref.softmax_forward(c.x["logits"])
    c.x["onehot"] = np.zeros((N, V))
    c.x["onehot"][np.arange(N), c.x["targets"]] = 1.0
    return c


def _ce_stats(x, P, strided, halving, variant):
    """(m, s, owner max) of each row as a block of P threads computes them: thread k folds its logits one by one into
    a running (max, sum), then a shared-memory tree merges the pairs. `variant` is a mistake (or "ok").
    x (N, V) float64. strided: thread k owns logits k, k + P, ...; else a contiguous slice of ceil(V / P).
    halving: the tree merges k + stride into k for stride = P/2, ..., 1; else stride = 1, 2, ... at k % 2stride = 0."""
    N, V = x.shape
    L = -(-V // P)
    k, l = np.meshgrid(np.arange(P), np.arange(L), indexing="ij")
    idx = k + P * l if strided else k * L + l                    # (P, L)
    valid = idx < V
    X = x[:, np.where(valid, idx, 0)]                            # (N, P, L)
    m = np.full((N, P), _EMPTY)
    s = np.zeros((N, P))
    with np.errstate(all="ignore"):
        for j in range(L):
            xv, ok = X[:, :, j], valid[None, :, j]
            grow = ok & (xv > m)
            if variant == "update_norescale":
                s_grow = s + 1.0
            elif variant == "sign":
                s_grow = s * np.exp(xv - m) + 1.0
            else:
                s_grow = s * np.exp(m - xv) + 1.0
            s = np.where(grow, s_grow, np.where(ok, s + np.exp(xv - m), s))
            m = np.where(grow, xv, m)
        own = m.copy()
        strides = []
        p = P // 2 if halving else 1
        while (p >= 1) if halving else (p < P):
            strides.append(p)
            p = p // 2 if halving else p * 2
        for st in strides:
            a = np.arange(st) if halving else np.arange(0, P, 2 * st)
            b = a + st
            m1, m2, s1, s2 = m[:, a], m[:, b], s[:, a], s[:, b]
            mm = np.maximum(m1, m2)
            if variant == "merge_norescale":
                s[:, a] = s1 + s2
            elif variant in ("sign", "merge_sign"):
                s[:, a] = s1 * np.exp(mm - m1) + s2 * np.exp(mm - m2)
            else:
                s[:, a] = s1 * np.exp(m1 - mm) + s2 * np.exp(m2 - mm)
            if variant != "stale_max":
                m[:, a] = mm
    owner = own[:, (np.arange(V) % P) if strided else (np.arange(V) // L)]   # (N, V): each logit's thread's max
    return m[:, 0], s[:, 0], owner


_CE_VARIANTS = {
    "merge_norescale": "your merge adds the two partial sums as they are, but each sum is relative to its own "
                       "thread's max: before adding, rescale each to the merged max (the larger of the two)",
    "update_norescale": "when a thread's running max grows, the sum it has so far must be rescaled to the new max "
                        "(it was a sum of exp(x - old max)); yours keeps it as it was",
    "sign": "the rescale factor has the wrong sign: moving a sum from max m_old to a larger max m_new multiplies it "
            "by exp(m_old - m_new), a number <= 1",
    "merge_sign": "in the merge the rescale factor has the wrong sign: a sum relative to max m_k moves to the merged "
                  "max m by the factor exp(m_k - m), a number <= 1",
    "stale_max": "the merged max is not stored back: after a merge both the max and the sum of the pair must be "
                 "written (sh_max[k] as well as sh_sum[k]), or the next level rescales with a stale max",
    "own_max": "the write pass uses the thread's own running max, but the row's sum is relative to the row's max: "
               "after the merge every thread must use the row's (max, sum) from shared memory",
}


def _ce_variant_outputs(c):
    """The mistake outputs of the merge, one at a time (cached): every variant for block sizes P = 2^i up to 1024
    (those where a thread folds at most 2048 logits), both partitions of the row, both tree shapes."""
    cache = c.x.setdefault("_merge_variants", [])
    yield from cache
    if c.x.get("_merge_done"):
        return
    x, onehot, N, V = c.x["logits"], c.x["onehot"], c.dims["N"], c.dims["V"]
    done = {(v, P, s, h) for v, P, s, h, _ in cache}
    for variant in _CE_VARIANTS:
        for P in (2 ** i for i in range(11)):
            if -(-V // P) > 2048:
                continue
            for strided in (True, False):
                for halving in (True, False):
                    if (variant, P, strided, halving) in done:
                        continue
                    if halving is False and variant in ("merge_norescale", "update_norescale", "own_max"):
                        continue                   # the tree's shape does not change these
                    m, s, owner = _ce_stats(x, P, strided, halving, variant)
                    with np.errstate(all="ignore"):
                        mx = owner if variant == "own_max" else m[:, None]
                        d = (np.exp(x - mx) / s[:, None] - onehot) / N
                    if not np.isfinite(d).any():
                        continue
                    entry = (variant, P, strided, halving, d)
                    cache.append(entry)
                    yield entry
    c.x["_merge_done"] = True


def _ce_merge_hint(c, name, ours, expected, bad):
    tol = _tol(c)
    for variant, P, _, _, d in _ce_variant_outputs(c):
        if matches(ours, d, expected, tol):
            rows = np.flatnonzero(bad.any(axis=1))
            return (f"{_CE_VARIANTS[variant]} (your output matches that mistake with {P} threads per row; wrong "
                    f"rows: {', '.join(map(str, rows[:6]))}{' ...' if len(rows) > 6 else ''})")
    return None


def _ce_row_hint(c, name, ours, expected, bad):
    """Only the row that needs the max subtracted (its exp overflows) or the row with V below the block is wrong."""
    rows = np.flatnonzero(bad.any(axis=1))
    if list(rows) == [0] and c.dims["N"] > 1:
        return ("only row 0 is wrong: its logits are near 100, where exp(x) overflows float32; subtract the row's max "
                "before exp (exp(x - max) <= 1)")
    if list(rows) == [c.dims["N"] - 1] and c.dims["N"] > 1:
        return ("only the last row is wrong: its logits are near -100, where exp(x) underflows to 0 in float32; "
                "subtract the row's max before exp")
    return None


def _ce_op():
    base = _checks._CROSSENTROPY
    return dataclasses.replace(base, make=_make_ce, n_cases=3)


def check_crossentropy_online(fn, *, arrays="numpy", dtype=np.float32, size=None, seed=None, task=None,
                              quiet=False) -> verdict.CheckResult:
    """Check fn(logits (N,V), targets (N,) int32, dlogits (N,V)) = (softmax(logits) - onehot(targets)) / N, the
    statistics of a row taken in one pass (a running (max, sum) per thread, pairs merged in a tree). Cases:
    V = 101, 7, 67 in the simulator (V over several blocks, V below a block, a partial block), V = 50257 on a GPU;
    row 0 overflows float32 and the last row underflows without the max subtracted; targets at 0 and V - 1."""
    op, rules = _ce_op(), Rules("check_crossentropy_online", patterns=(_ce_row_hint, _ce_merge_hint), barriers=True)
    return opcheck.run(op, fn, rules=rules, arrays=arrays, dtype=dtype, size=size, seed=seed, task=task,
                       quiet=quiet)


# ------------------------------------------------------------------------------------------------------------
# attention_softmax_backward(att (B,nh,T,T), datt (B,nh,T,T), dpreatt (B,nh,T,T), hs)
# ------------------------------------------------------------------------------------------------------------
# (B, nh, T, hs) per case: T = 1 with several heads and batches; T = 7 with several heads and batches; T past any
# block of threads the simulator is given (33 > 32) or a GPU allows (1031 > 1024), with a partial last stride.
_ATT_DIMS = {"small": ((2, 3, 1, 4), (2, 2, 7, 5), (1, 1, 33, 16)),
             "large": ((2, 12, 1, 64), (3, 4, 7, 64), (1, 4, 1031, 64))}


def _make_att_softmax(rng, dt, size, k):
    B, nh, T, hs = _ATT_DIMS[size][k]
    c = Case(dt, {"B": B, "nh": nh, "T": T, "hs": hs})
    scores = random_rows(rng, (B, nh, T, T), -0.5, 0.7)
    causal = np.tril(np.ones((T, T), dtype=bool))
    att, _ = ref.softmax_forward(np.where(causal, scores, -np.inf))
    garbage = rng.uniform(0.05, 1.0, (B, nh, T, T))               # above the diagonal: whatever memory held
    c.add_float("att", ("B", "nh", "T", "T"), np.where(causal, att, garbage))
    c.add_float("datt", ("B", "nh", "T", "T"), random_rows(rng, (B, nh, T, T)))
    c.add_output("dpreatt", ("B", "nh", "T", "T"))
    c.scalars["hs"] = hs
    c.x["causal"] = causal
    return c


def _att_dpre(c, mask_shift=0, dot_mask=None, write_mask=None, scale=None, rowsum=True, dot_att=True, t_of=None,
              fill_above=False):
    """dpreatt computed with a mistake. mask_shift: the mask is s <= t + shift. dot_mask / write_mask override the mask
    of the row sum / of the written entries (None: the same mask). t_of: (B, nh, T) -> the query position each row
    uses for its mask (a row index mix-up). fill_above: entries above the mask get the formula instead of 0."""
    B, nh, T = c.dims["B"], c.dims["nh"], c.dims["T"]
    att, datt = c.x["att"], c.x["datt"]
    sc = 1.0 / math.sqrt(c.scalars["hs"]) if scale is None else scale
    t = np.arange(T)[:, None] if t_of is None else t_of(B, nh, T)[..., None]     # (T, 1) or (B, nh, T, 1)
    s = np.arange(T)
    mask = np.broadcast_to(s <= t + mask_shift, (B, nh, T, T))
    dm = mask if dot_mask is None else np.broadcast_to(dot_mask, mask.shape)
    wm = mask if write_mask is None else np.broadcast_to(write_mask, mask.shape)
    a = np.where(dm, att, 0.0)
    dot = ((a * datt) if dot_att else np.where(dm, datt, 0.0)).sum(-1, keepdims=True)
    full = sc * att * (datt - dot) if rowsum else sc * att * datt
    return {"dpreatt": full if fill_above else np.where(wm, full, 0.0)}


def _expected_att_softmax(c):
    return _att_dpre(c)


def _att_terms(c):
    """dpreatt = scale * att * (datt - sum(att * datt)) cancels where att is large: judge it against its terms."""
    a = np.where(c.x["causal"], c.x["att"], 0.0)
    return {"dpreatt": float(np.abs(a * c.x["datt"]).max()) / math.sqrt(c.scalars["hs"])}


def _t_btn(B, nh, T):
    """Rows numbered (b, t, h), h fastest (the layout of qkv's heads), while the arrays are (b, h, t)."""
    r = np.arange(B * nh * T).reshape(B, nh, T)
    return (r // nh) % T


def _t_tmajor(B, nh, T):
    """Rows numbered (t, b, h), t slowest."""
    r = np.arange(B * nh * T).reshape(B, nh, T)
    return r // (B * nh)


def _pow2(k) -> bool:
    return k >= 4 and k & (k - 1) == 0          # a block of 4 or more threads (fewer is not a plausible block)


def _att_rows_hint(c, name, ours, expected, bad):
    """Elements never written (above the diagonal, past a column, whole rows), rows wrong past a block's length,
    or rows holding another (b, h)'s values."""
    B, nh, T = c.dims["B"], c.dims["nh"], c.dims["T"]
    tol = _tol(c)
    nan = np.isnan(ours)
    above = np.broadcast_to(~c.x["causal"], nan.shape)
    if nan.any():
        if (nan == above).all():
            return ("dpreatt above the diagonal (s > t) was never written: every element of dpreatt is an output, "
                    "write 0 where s > t (the matmuls that follow read the whole (T, T) matrix)")
        cols = nan.any(axis=(0, 1, 2))
        first = int(np.argmax(cols))
        if _pow2(first) and nan[..., first:].all() and not nan[..., :first].any():
            return (f"the columns s >= {first} were never written: T = {T} is larger than your block of {first} "
                    f"threads, so each thread must handle s, s + blockDim.x, s + 2 * blockDim.x, ... (in the row "
                    f"sum and in the write)")
        rows_nan = nan.all(axis=-1)
        if rows_nan.any() and (nan == rows_nan[..., None]).all():
            where = [tuple(int(i) for i in w) for w in np.argwhere(rows_nan)[:4]]
            return (f"{int(rows_nan.sum())} of {B * nh * T} rows (b, h, t) were never written, e.g. "
                    f"{', '.join(map(str, where))}: one block per row, row = (b * nh + h) * T + t, so "
                    f"b = row // (nh * T), h = (row // T) % nh, t = row % T, and the grid has B * nh * T blocks")
        return None
    rows_bad = bad.any(axis=-1)                                   # (B, nh, T)
    cols_bad = bad.any(axis=(0, 1, 2))
    first = int(np.argmax(cols_bad))
    if cols_bad.any() and _pow2(first) and cols_bad[first:].all() and not cols_bad[:first].any():
        return (f"only the columns s < {first} are right: T = {T} is larger than your block of {first} threads, so "
                f"each thread must handle s, s + blockDim.x, s + 2 * blockDim.x, ... (in the row sum and in the "
                f"write)")
    ts = np.argwhere(rows_bad)[:, 2]
    if len(ts):
        first = int(ts.min())
        should = np.zeros_like(rows_bad)
        should[:, :, first:] = True
        if _pow2(first) and (rows_bad == should).all():
            return (f"rows with t >= {first} are wrong, rows t < {first} are right: a row of t + 1 > {first} "
                    f"entries is longer than your block of {first} threads, so each thread must sum (and write) "
                    f"s, s + blockDim.x, ... up to t")
        exp_rows = expected.reshape(B * nh, T, T)
        b, h, t = (int(i) for i in np.argwhere(rows_bad)[0])
        for j in range(B * nh):
            if j != b * nh + h and close(ours[b, h, t], exp_rows[j, t], mistake_slack(tol)) and \
                    not close(exp_rows[j, t], expected[b, h, t], tol):
                return (f"row (b={b}, h={h}, t={t}) holds the values of (b={j // nh}, h={j % nh}, t={t}): the row "
                        f"index is split into (b, h, t) differently where you read and where you write. The arrays "
                        f"are (B, nh, T, T): row = (b * nh + h) * T + t")
    return None


_ATT_SOFTMAX = Op(
    "attention_softmax_backward", _make_att_softmax, _expected_att_softmax, n_cases=3, terms=_att_terms,
    formula="per row (b, h, t): dot = sum over s <= t of att * datt; dpreatt[s] = scale * att[s] * (datt[s] - dot) "
            "for s <= t, 0 for s > t; scale = 1 / sqrt(hs)",
    shape_hint="att, datt, dpreatt are (B, nh, T, T): one row per (b, h, t), T entries, of which s <= t count",
    mistakes=[
        Mistake("the mask is off by one: a row t has t + 1 entries, s = 0 .. t (s <= t), the diagonal included; "
                 "yours stops at s < t", lambda c: _att_dpre(c, mask_shift=-1)),
        Mistake("the mask is off by one: a row t has t + 1 entries, s = 0 .. t; yours also takes s = t + 1, where att "
                 "holds no probability (garbage above the diagonal)", lambda c: _att_dpre(c, mask_shift=1)),
        Mistake("the row sum runs over the whole row, masked entries included: att above the diagonal is not part of "
                 "the input (it holds garbage here); sum att * datt over s <= t only",
                 lambda c: _att_dpre(c, dot_mask=True)),
        Mistake("the entries above the diagonal (s > t) must be 0: you wrote the formula there too (att holds "
                 "garbage there)", lambda c: _att_dpre(c, fill_above=True)),
        Mistake("the 1/sqrt(hs) scale is missing: the scores were scale * q k^T, so dpreatt carries the factor "
                 "scale = 1 / sqrt(hs)", lambda c: _att_dpre(c, scale=1.0)),
        Mistake("the scale is 1/hs: 1/sqrt(hs) applied twice, or the sqrt forgotten; dpreatt = scale * att * "
                 "(datt - dot) with scale = 1/sqrt(hs), once", lambda c: _att_dpre(c, scale=1.0 / c.scalars["hs"])),
        Mistake("the scale is sqrt(hs); it is 1/sqrt(hs)", lambda c: _att_dpre(c, scale=math.sqrt(c.scalars["hs"]))),
        Mistake("the softmax backward is missing its row-sum term: dpreatt = scale * att * (datt - dot), "
                 "dot = sum over s <= t of att * datt", lambda c: _att_dpre(c, rowsum=False)),
        Mistake("the row sum is sum(datt); it is weighted by att: dot = sum over s <= t of att * datt",
                 lambda c: _att_dpre(c, dot_att=False)),
        Mistake("the query position t of a row comes from the wrong layout: rows are (b, h, t) with t fastest, "
                 "row = (b * nh + h) * T + t, so t = row % T (yours takes rows as (b, t, h), heads fastest)",
                 lambda c: _att_dpre(c, t_of=_t_btn)),
        Mistake("the query position t of a row comes from the wrong layout: rows are (b, h, t) with t fastest, "
                 "row = (b * nh + h) * T + t, so t = row % T (yours takes t as the slowest index)",
                 lambda c: _att_dpre(c, t_of=_t_tmajor)),
    ])


def check_attention_softmax_backward(fn, *, arrays="numpy", dtype=np.float32, size=None, seed=None, task=None,
                                     quiet=False) -> verdict.CheckResult:
    """Check fn(att (B,nh,T,T), datt (B,nh,T,T), dpreatt (B,nh,T,T), hs): the causal softmax backward inside
    attention, dpreatt = scale * att * (datt - sum_{s<=t} att * datt) for s <= t and 0 above the diagonal,
    scale = 1/sqrt(hs). att above the diagonal holds garbage. Cases: T = 1 (B = 2, nh = 3), T = 7 (B = 2, nh = 2),
    T = 33 in the simulator (1031 on a GPU)."""
    op, rules = _ATT_SOFTMAX, Rules("check_attention_softmax_backward", patterns=(_att_rows_hint,))
    return opcheck.run(op, fn, rules=rules, arrays=arrays, dtype=dtype, size=size, seed=seed, task=task,
                       quiet=quiet)


# ------------------------------------------------------------------------------------------------------------
# encoder_backward(dout (B,T,C), idx (B,T) int32, dwte (V,C), dwpe (maxT,C))   [zero, then scatter-add]
# ------------------------------------------------------------------------------------------------------------
# (B, T, C, V, maxT) per case. A few "hot" tokens fill most positions (each many times), one token appears once,
# most tokens never; token 0 and V - 1 are used; maxT > T (rows of dwpe that get no gradient) and maxT = T.
# The deterministic task's GPU sizes are smaller: an owner that scans every position for its token is a valid answer.
_ENC_DIMS = {"small": ((2, 9, 13, 11, 12), (3, 5, 7, 6, 5)),
             "large": ((8, 1024, 768, 50257, 1024), (4, 255, 769, 97, 255))}
_ENC_DET_DIMS = {"small": _ENC_DIMS["small"], "large": ((4, 256, 768, 2053, 256), (2, 127, 769, 97, 127))}


def _make_encoder(rng, dt, size, k, dims=_ENC_DIMS):
    B, T, C, V, maxT = dims[size][k]
    c = Case(dt, {"B": B, "T": T, "C": C, "V": V, "maxT": maxT})
    c.add_float("dout", ("B", "T", "C"), random_rows(rng, (B, T, C)))
    hot = np.array([0, V // 2, V - 1])
    idx = hot[(np.arange(B * T) * 7 + rng.integers(0, 3)) % 3].reshape(B, T)   # each hot token ~B*T/3 times
    cold = int(rng.integers(1, V // 2)) if V > 4 else 1
    idx[B // 2, T // 2] = cold                                                  # one token that appears once
    c.add_index("idx", ("B", "T"), idx)
    c.add_output("dwte", ("V", "C"))
    c.add_output("dwpe", ("maxT", "C"))
    c.x["counts"] = np.bincount(idx.ravel(), minlength=V)
    return c


def _enc_op(dims=_ENC_DIMS):
    make = functools.partial(_make_encoder, dims=dims)
    return dataclasses.replace(_checks._ENCODER, make=make, n_cases=2)


def check_encoder_backward_atomic(fn, *, arrays="numpy", dtype=np.float32, size=None, seed=None, task=None,
                                  quiet=False) -> verdict.CheckResult:
    """Check fn(dout (B,T,C), idx (B,T) int32, dwte (V,C), dwpe (maxT,C)): dwte and dwpe zeroed, then every
    dout[b, t] added into dwte[idx[b, t]] and dwpe[t]. Three tokens fill most positions (each many times). In the
    simulator the first call is traced: an element stored by several threads in one launch without atomics fails
    (on a GPU those updates race and get lost, which the values show)."""
    op, rules = _enc_op(), Rules("check_encoder_backward_atomic", races=True)
    return opcheck.run(op, fn, rules=rules, arrays=arrays, dtype=dtype, size=size, seed=seed, task=task,
                       quiet=quiet)


def encoder_fixed_order(dout, idx, V, maxT, dtype=np.float32):
    """dwte, dwpe summed in the deterministic contract's order, in `dtype` (float32: the bits a kernel must match):
    dwte[v] adds dout[b, t] over the positions p = b * T + t with idx[b, t] = v in increasing p, starting from 0;
    dwpe[t] adds dout[b, t] over b = 0, 1, ..., B - 1; rows that get nothing are 0."""
    B, T, C = dout.shape
    d = np.asarray(dout, dtype=dtype).reshape(B * T, C)
    dwte = np.zeros((V, C), dtype=dtype)
    for p, v in enumerate(np.asarray(idx).ravel()):
        dwte[v] = dwte[v] + d[p]                       # one rounding per addition, in position order
    dwpe = np.zeros((maxT, C), dtype=dtype)
    for b in range(B):
        dwpe[:T] = dwpe[:T] + np.asarray(dout[b], dtype=dtype)
    return dwte, dwpe


def _enc_exact(c):
    dwte, dwpe = encoder_fixed_order(c.inputs["dout"], c.inputs["idx"], c.dims["V"], c.dims["maxT"], c.dtype)
    return {"dwte": dwte, "dwpe": dwpe}


_ENC_EXACT_HINT = ("the contract fixes the order of the additions, so the result is the same bits on every GPU and "
                   "every run: dwte[v] starts at 0 and adds dout[b, t] for the positions p = b * T + t holding token "
                   "v in increasing p; dwpe[t] adds dout[0, t], dout[1, t], ... in order; one float32 accumulator per "
                   "element, nothing summed in another order (no tree, no atomics)")


def check_encoder_backward_deterministic(fn, *, arrays="numpy", dtype=np.float32, size=None, seed=None, task=None,
                                         quiet=False) -> verdict.CheckResult:
    """Check fn(dout (B,T,C), idx (B,T) int32, dwte (V,C), dwpe (maxT,C)) deterministically: the values, then the exact
    bits of the contract's order (``encoder_fixed_order``), then the same bits again on a second call; in the
    simulator any float atomic (traced) fails."""
    op, rules = _enc_op(_ENC_DET_DIMS), Rules("check_encoder_backward_deterministic", repeat=True, exact=_enc_exact,
                   exact_hint=_ENC_EXACT_HINT, no_float_atomics=True, races=True)
    return opcheck.run(op, fn, rules=rules, arrays=arrays, dtype=dtype, size=size, seed=seed, task=task,
                       quiet=quiet)
