"""Activation checkpointing: trade compute for memory by recomputing activations during backward.

The backward of every op needs some of its forward inputs (linear needs ``inp`` for ``dweight = inp.T @ dout``,
attention needs ``qkv`` and ``att``, ...). The reference GPT (reference/gpt.py) keeps all of them, for every block,
from the forward until that block's backward: that is the *activation memory*, and it grows with B * T * L (and
with T * T for attention). Checkpointing keeps less and recomputes the rest just before it is needed:

    policy="none"       the plain reference: keep everything (reference gpt_forward / gpt_backward).
    policy="selective"  drop the tensors that are cheap to recompute: the LayerNorm outputs ln1, ln2 (B, T, C)
                        and the GELU output (B, T, 4C). Backward rebuilds them with elementwise / per-row ops from
                        what is kept (the block input x, the LayerNorms' per-row mean and rstd, the fc output).
                        The matmul outputs and attention (qkv, att) stay: they are the expensive ones.
    policy="full"       keep only each block's input x (B, T, C). Just before a block's backward, run that
                        block's whole forward again from x, then its backward, then drop the recomputed cache.
                        Costs about one extra forward; activation memory is L * (B, T, C) plus ONE block's cache.
    policy="sqrt"       the sqrt(n) schedule (Chen et al. 2016, "Training deep nets with sublinear memory cost"): the
    policy="sqrt:K"     blocks are cut into segments of k consecutive blocks (k = round(sqrt(L)), or K), and only each
                        segment's input x (B, T, C) is kept. Backward reaches a segment at its last block: it runs
                        the whole segment's forward again from that input, holds the k block caches, and drops each
                        one after its block's backward. Activation memory: ceil(L / k) inputs plus k block caches,
                        while "full" is the same schedule with k = 1. Also about one extra forward.

Recomputation uses exactly the same reference ops, in the same order and dtype, on the same inputs, so the
recomputed tensors are bitwise equal to the forward's and the gradients are bitwise equal to the reference.
The GPT itself is the reference's: a policy is a `keep` for reference gpt_forward (what to keep of each block's
cache) and a `recompute` for reference gpt_backward (how to rebuild that cache before the block's backward).

Also here: ``cache_bytes`` measures the activation memory a cache holds, and ``memory_model`` predicts the
training memory (parameters, gradients, AdamW state, activations) of a GPT for a policy and precision.
"""
import math

import numpy as np

from .params import GPTConfig, num_params
from ..reference.gelu import gelu_forward
from ..reference.gpt import _check_tensors, block_forward, check_inputs, gpt_backward, gpt_forward

POLICIES = ("none", "selective", "full", "sqrt")   # "sqrt" also as "sqrt:K", K blocks per segment
BLOCK_POLICIES = ("none", "selective", "full")    # the ones that keep the same for every block
PRECISIONS = {"fp32": 4, "fp16": 2, "bf16": 2}   # bytes per element of the compute precision
INDEX_BYTES = 8                                  # token ids idx, targets: NumPy's default int64


def parse_policy(policy, n_layer=None, fn="policy"):
    """A checkpointing policy -> (name, k): name one of POLICIES; k the segment length of the sqrt schedule (blocks
    per segment: round(sqrt(n_layer)), at least 1, for "sqrt"; K for "sqrt:K"), None for the other policies.
    ValueError naming the problem for anything else (K not a whole number >= 1, or more than n_layer blocks).
    Without n_layer only the spelling is checked and k of a plain "sqrt" is None."""
    known = f"{', '.join(repr(p) for p in POLICIES)} (or 'sqrt:K', K blocks per segment)"
    if not isinstance(policy, str):
        raise ValueError(f"{fn}: policy must be one of {known}; got {policy!r}")
    name, sep, k_text = policy.partition(":")
    if name not in POLICIES or (sep and name != "sqrt"):
        raise ValueError(f"{fn}: policy must be one of {known}; got {policy!r}")
    if name != "sqrt":
        return name, None
    if sep:
        if not (k_text.isascii() and k_text.isdigit()) or int(k_text) < 1:
            raise ValueError(f"{fn}: the segment length K of {policy!r} must be a whole number of blocks, 1 or "
                             f"more (as in 'sqrt:4'); got {k_text!r}")
        k = int(k_text)
    else:
        k = None if n_layer is None else max(1, round(math.sqrt(n_layer)))
    if n_layer is not None and k > n_layer:
        raise ValueError(f"{fn}: the segment length of {policy!r} is {k} blocks but the model has only "
                         f"{n_layer} (n_layer); choose K from 1 to {n_layer}")
    return name, k


def segments(n_layer, k) -> list:
    """The sqrt schedule's segments: (start, stop) block ranges of k consecutive blocks from block 0 (the last one
    shorter when k does not divide n_layer). Block `start` of each keeps its input; backward recomputes the rest."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= n_layer:
        raise ValueError(f"segments: k must be a whole number of blocks from 1 to n_layer={n_layer}, got {k!r}")
    return [(a, min(a + k, n_layer)) for a in range(0, n_layer, k)]


def _check_policy(fn, policy, n_layer=None):
    return parse_policy(policy, n_layer, fn)


# ----------------------------------------------------------------------------------------------------------------
# "selective": what is dropped from a block's cache, and how backward rebuilds it
# ----------------------------------------------------------------------------------------------------------------

def _drop_selective(c, ln1_bias, ln2_bias):
    """The reference block cache minus ln1 out, ln2 out (B, T, C) and gelu out (B, T, 4C).

    Those three are the `inp` of the qkv, fc and fcproj linears. Everything else stays: the LayerNorm caches
    (their inp is the residual stream x, kept anyway, plus per-row mean, rstd (B, T)), the fc output (the GELU's
    inp), qkv and att (attention), the attention output (attproj's inp).
    """
    kept = {name: c[name] for name in ("ln1", "attention", "attproj", "ln2", "gelu")}
    for name in ("qkv", "fc", "fcproj"):                 # the linear caches without their inp
        kept[name] = {"weight": c[name]["weight"], "has_bias": c[name]["has_bias"]}
    kept["ln1_bias"], kept["ln2_bias"] = ln1_bias, ln2_bias  # parameters (views), to recompute the outputs
    return kept


def _layernorm_out(ln_cache, bias):
    """LayerNorm output from its cache (inp, weight, mean, rstd): the same two lines as layernorm_forward."""
    inp, weight, mean, rstd = ln_cache["inp"], ln_cache["weight"], ln_cache["mean"], ln_cache["rstd"]
    xhat = (inp - mean[..., None]) * rstd[..., None]    # (B, T, C)
    return xhat * weight + bias                         # (B, T, C)


def _rebuild_selective(s):
    """The full reference block cache from a selective one: recompute ln1, ln2 (per-row) and gelu (elementwise)."""
    c = dict(s)
    ln1 = _layernorm_out(s["ln1"], s["ln1_bias"])        # (B, T, C)
    ln2 = _layernorm_out(s["ln2"], s["ln2_bias"])        # (B, T, C)
    fch_gelu, _ = gelu_forward(s["gelu"]["inp"])         # (B, T, 4C) from the kept fc output
    c["qkv"] = dict(s["qkv"], inp=ln1)
    c["fc"] = dict(s["fc"], inp=ln2)
    c["fcproj"] = dict(s["fcproj"], inp=fch_gelu)
    return c


# ----------------------------------------------------------------------------------------------------------------
# The GPT with checkpointing
# ----------------------------------------------------------------------------------------------------------------

def gpt_forward_ckpt(params, cfg, idx, targets=None, policy="none", ce_chunks=1):
    """Like reference gpt_forward, keeping only what `policy` says -> (logits (B, T, V), loss or None, cache).
    ce_chunks: as gpt_forward's (the head and the loss in chunks of rows; logits None with targets).

    cache["policy"] says which; cache["params"] refers to the parameters (needed to recompute, and so that
    cache_bytes does not count them as activations).
    """
    idx = check_inputs("gpt_forward_ckpt", params, cfg, idx)
    name, k = _check_policy("gpt_forward_ckpt", policy, cfg.n_layer)
    p = params
    starts = {a for a, _ in segments(cfg.n_layer, k)} if name == "sqrt" else ()
    keep = {"none": None,                                                     # the plain reference: all of it
            "selective": lambda l, c: _drop_selective(c, p["ln1b"][l], p["ln2b"][l]),
            "full": lambda l, c: c["ln1"]["inp"],           # only the block input x (B, T, C): ln1's inp
            "sqrt": lambda l, c: c["ln1"]["inp"] if l in starts else None}[name]   # a segment's input x only
    logits, loss, cache = gpt_forward(params, cfg, idx, targets, keep=keep, ce_chunks=ce_chunks)
    return logits, loss, dict(cache, policy=policy, params=params)


def gpt_backward_ckpt(cache, grads, ready=None):
    """Gradients of the loss into grads (overwritten), bitwise equal to reference gpt_backward. Returns None.
    ready(k): as gpt_backward's, called when layer k's gradients are final."""
    policy = cache.get("policy")
    _check_policy("gpt_backward_ckpt", policy)
    cfg, p = cache["cfg"], cache["params"]
    name, k = _check_policy("gpt_backward_ckpt", policy, cfg.n_layer)
    if cache["crossentropy"] is None:
        raise ValueError("gpt_backward_ckpt: the cache has no loss; call gpt_forward_ckpt with targets first")
    _check_tensors("gpt_backward_ckpt", "grads", grads, cfg)
    recompute = {"none": lambda: None,                                        # everything was kept
                 "selective": lambda: lambda l, kept: _rebuild_selective(kept),   # recompute ln1, ln2, gelu
                 "full": lambda: lambda l, x_in: block_forward(p, l, x_in, cfg.n_head)[1],  # the whole block
                 "sqrt": lambda: _segment_recompute(p, cfg, cache["layers"], k)}[name]()  # a whole segment
    return gpt_backward(cache, grads, recompute=recompute, ready=ready)


def _segment_recompute(p, cfg, layers, k):
    """recompute(l, kept) for gpt_backward under the sqrt schedule. Backward reaches a segment at its last block: the
    segment's forward runs again from its saved input layers[start] (the same block_forward, so the same bits), and
    its block caches are held here; each block's backward takes its own out (held.pop), so it is freed when
    gpt_backward moves on to the block below."""
    segment_of = {l: (a, b) for a, b in segments(cfg.n_layer, k) for l in range(a, b)}
    held = {}                                          # block -> its recomputed cache, for this segment only

    def recompute(l, kept):
        if l not in held:                              # l is the last block of its segment (backward runs down)
            a, b = segment_of[l]
            x = layers[a]                              # the segment's saved input (B, T, C)
            for j in range(a, b):
                x, held[j] = block_forward(p, j, x, cfg.n_head)   # x: block j's output, block j + 1's input
        return held.pop(l)
    return recompute


# ----------------------------------------------------------------------------------------------------------------
# Measuring and predicting memory
# ----------------------------------------------------------------------------------------------------------------

def _param_arrays(params):
    if params is None:
        return []
    if isinstance(params, np.ndarray):
        return [params]
    if hasattr(params, "flat") and isinstance(getattr(params, "flat"), np.ndarray):   # ParamBuffer
        return [params.flat]
    if hasattr(params, "values"):                                                     # dict name -> array
        return [a for a in params.values() if isinstance(a, np.ndarray)]
    return [a for a in params if isinstance(a, np.ndarray)]


def cache_bytes(cache, params=None) -> int:
    """Bytes of activation memory held by the arrays in `cache` (dicts / lists / tuples walked recursively).

    Each ndarray counts its nbytes once (by id: the same array cached by two ops is one allocation).
    Parameters are not activations: arrays sharing memory with `params` (default: cache["params"], which
    gpt_forward_ckpt stores) are skipped, e.g. the weight views the linear and LayerNorm caches hold.
    A plain reference cache has no "params": pass them, or the weights are counted too.
    """
    if params is None and isinstance(cache, dict):
        params = cache.get("params")
    weights = _param_arrays(params)
    seen, total = set(), 0
    stack = [cache]
    while stack:
        obj = stack.pop()
        if isinstance(obj, np.ndarray):
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            if not any(np.may_share_memory(obj, w) for w in weights):
                total += int(obj.nbytes)
        elif isinstance(obj, dict):
            stack.extend(v for k, v in obj.items() if k != "params")
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
    return total


def _kept_per_block(cfg, B, T, policy):
    """(name, shape) of every activation one block keeps for backward under `policy` (not counting what the
    next block or the final LayerNorm keeps anyway: block l's output is block l+1's input)."""
    C, nh = cfg.d_model, cfg.n_head
    x_in = ("x: block input, ln1 inp (residual stream)", (B, T, C))
    if policy in ("full", "sqrt"):                      # sqrt: what the first block of a segment keeps
        return [x_in]
    ln_stats = [("ln1 mean", (B, T)), ("ln1 rstd", (B, T))]
    selective = [x_in, *ln_stats,
                 ("qkv (attention inp)", (B, T, 3 * C)),
                 ("att (softmax probabilities)", (B, nh, T, T)),
                 ("attention out (attproj inp)", (B, T, C)),
                 ("x_mid: residual after attention, ln2 inp", (B, T, C)),
                 ("ln2 mean", (B, T)), ("ln2 rstd", (B, T)),
                 ("fc out (gelu inp)", (B, T, 4 * C))]
    if policy == "selective":
        return selective
    return selective + [("ln1 out (qkv inp)", (B, T, C)),
                        ("ln2 out (fc inp)", (B, T, C)),
                        ("gelu out (fcproj inp)", (B, T, 4 * C))]


def memory_model(cfg, B, T, precision="fp32", policy="none") -> dict:
    """Predicted training memory in bytes of a GPT with config `cfg` on a (B, T) batch.

    Terms (P = num_params(cfg), e = bytes per element of the compute precision: 4 fp32, 2 fp16 / bf16):

    params         P * 4   the fp32 master parameters (the flat ParamBuffer the optimizer updates).
    params_half    P * e   the half-precision copy the forward/backward compute with (0 for fp32).
    grads          P * 4   one fp32 gradient per parameter (the gradient flat buffer the optimizer reads).
    adamw          P * 8   AdamW's m and v, fp32 each.
    activations    what the forward keeps for the backward, under `policy`, each tensor e bytes per element:
                   L * (the per-block list in `kept_per_block`) + the tensors outside the blocks (`kept_top`):
                   the final block's output (lnf inp), lnf mean / rstd, lnf out (the head's inp), the logits and
                   the softmax probabilities (B, T, V) of the cross-entropy, and the token ids idx and targets
                   (counted as int64, 8 bytes, as NumPy creates them; on a GPU they would be int32).
                   The per-row LayerNorm stats (mean, rstd) are counted in the compute precision, as the NumPy
                   reference keeps them (mixed-precision kernels usually keep them fp32: a (B, T) difference).
    recompute_peak the extra bytes alive during backward while one block is recomputed: under "full" that
                   block's whole dropped cache (everything in the "none" list but x); under "selective" its
                   ln1, ln2 and gelu outputs. 0 for "none". (Only one block at a time: it is dropped after its
                   backward.) Under "sqrt" the caches of a whole segment (its longest, k blocks) minus its kept x:
                   they all exist when the segment's recomputed forward ends, before the first of its backwards.
    kept_blocks    how many blocks keep `kept_per_block`: n_layer, or under "sqrt" the number of segments
                   ceil(L / k) (segment: k, the blocks per segment; None for the other policies).
    total          the sum of all the above.

    Not counted: the gradient activations of the backward (dx, dlogits, ...: transient, about one block's
    worth), temporaries inside ops, and allocator overhead. For fp32 `activations` equals cache_bytes of the
    actual gpt_forward_ckpt cache (with int64 token ids); tests check within 10%.
    """
    if not isinstance(cfg, GPTConfig):
        raise TypeError(f"memory_model: cfg must be a GPTConfig, got {type(cfg).__name__}")
    pol, k = _check_policy("memory_model", policy, cfg.n_layer)
    if precision not in PRECISIONS:
        raise ValueError(f"memory_model: precision must be one of {', '.join(repr(p) for p in PRECISIONS)}; "
                         f"got {precision!r}")
    for name, value in (("B", B), ("T", T)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"memory_model: {name} must be a positive int, got {value!r}")
    if T > cfg.block_size:
        raise ValueError(f"memory_model: T={T} is longer than block_size={cfg.block_size}")
    e = PRECISIONS[precision]
    C, V, L = cfg.d_model, cfg.vocab_size, cfg.n_layer
    P = num_params(cfg)

    per_block = _kept_per_block(cfg, B, T, pol)
    top = [("x: last block output, lnf inp", (B, T, C)), ("lnf mean", (B, T)), ("lnf rstd", (B, T)),
           ("lnf out (head inp)", (B, T, C)), ("logits", (B, T, V)), ("probs (crossentropy)", (B, T, V))]
    ids = [("idx", (B, T)), ("targets", (B, T))]
    block_bytes = sum(math.prod(shape) for _, shape in per_block) * e
    kept_blocks = len(segments(L, k)) if pol == "sqrt" else L
    activations = (kept_blocks * block_bytes + sum(math.prod(shape) for _, shape in top) * e
                   + sum(math.prod(shape) for _, shape in ids) * INDEX_BYTES)

    full_block = sum(math.prod(shape) for _, shape in _kept_per_block(cfg, B, T, "none")) * e
    if pol == "full":
        recompute_peak = full_block - B * T * C * e           # everything but the kept x
    elif pol == "sqrt":                                      # the longest segment's caches but its kept x
        recompute_peak = max(b - a for a, b in segments(L, k)) * full_block - B * T * C * e
    elif pol == "selective":
        recompute_peak = full_block - block_bytes             # ln1, ln2, gelu outputs
    else:
        recompute_peak = 0

    out = {
        "params": P * 4,
        "params_half": P * e if e != 4 else 0,
        "grads": P * 4,
        "adamw": P * 8,
        "activations": activations,
        "activations_per_block": block_bytes,
        "recompute_peak": recompute_peak,
        "kept_per_block": per_block,
        "kept_blocks": kept_blocks,
        "segment": k,
        "kept_top": top + ids,
    }
    out["total"] = (out["params"] + out["params_half"] + out["grads"] + out["adamw"]
                    + activations + recompute_peak)
    return out


# ----------------------------------------------------------------------------------------------------------------
# For lesson 08: the per-tensor breakdown, the live-memory timeline, CPU measurements, what fits on a card
# ----------------------------------------------------------------------------------------------------------------

RESULTS_H200 = "checkpointing_h200"   # the stored checkpointing benchmark on an H200: stored.load(RESULTS_H200)


def activation_breakdown(cfg, B, T, precision="fp32") -> list:
    """One row per activation tensor the forward can keep for the backward, for a (B, T) batch:
    {"where": "per block" | "top", "tensor", "shape", "bytes", "none", "selective", "full"} (the last three: does
    that policy keep it). Per-block bytes are for ONE block (memory_model multiplies by n_layer); token ids count
    8 bytes per element (int64), everything else the precision's element size."""
    e = PRECISIONS[precision]
    kept = {policy: {name for name, _ in _kept_per_block(cfg, B, T, policy)} for policy in BLOCK_POLICIES}
    rows = []
    for name, shape in _kept_per_block(cfg, B, T, "none"):
        rows.append({"where": "per block", "tensor": name, "shape": shape, "bytes": math.prod(shape) * e,
                     **{policy: name in kept[policy] for policy in BLOCK_POLICIES}})
    for name, shape in memory_model(cfg, B, T, precision, "none")["kept_top"]:
        size = INDEX_BYTES if name in ("idx", "targets") else e
        rows.append({"where": "top", "tensor": name, "shape": shape, "bytes": math.prod(shape) * size,
                     **{policy: True for policy in BLOCK_POLICIES}})
    return rows


def format_breakdown(cfg, B, T, precision="fp32") -> str:
    """activation_breakdown as a text table, with per-policy totals (n_layer blocks + the top tensors)."""
    rows = activation_breakdown(cfg, B, T, precision)
    mark = {True: "kept", False: "recomp."}
    totals = {p: memory_model(cfg, B, T, precision, p) for p in BLOCK_POLICIES}
    sums = [("one block keeps", "activations_per_block"),
            (f"all activations (x {cfg.n_layer} blocks + top)", "activations"),
            ("+ one block recomputed in backward", "recompute_peak")]
    # columns as wide as their widest entry, so the course model's table stays within 100 characters a line
    wt = max(len(s) for s in [r["tensor"] for r in rows] + [label for label, _ in sums])
    ws = max(len("shape"), *(len(str(r["shape"])) for r in rows))
    wb = max(len("bytes"), *(len(f"{r['bytes']:,}") for r in rows))
    widths = (7, 9, 7)
    lines = [f"{'tensor':{wt}s} {'shape':>{ws}s} {'bytes':>{wb}s} {'none':>7s} {'selective':>9s} {'full':>7s}"]
    for r in rows:
        lines.append(f"{r['tensor']:{wt}s} {str(r['shape']):>{ws}s} {r['bytes']:>{wb},} {mark[r['none']]:>7s} "
                     f"{mark[r['selective']]:>9s} {mark[r['full']]:>7s}")
    for label, key in sums:
        lines.append(f"{label:{wt}s} {'':>{ws}s} {'':>{wb}s} "
                     + " ".join(f"{_mib(totals[p][key]):>{w}s}" for p, w in zip(BLOCK_POLICIES, widths)))
    return "\n".join(lines)


def _mib(n) -> str:
    return f"{n / 2**20:.1f}M" if n >= 2**20 else f"{n / 2**10:.1f}K"


def activation_timeline(cfg, B, T, precision="fp32", policy="none") -> list:
    """Live activation bytes through one forward + backward, block by block: a list of (label, bytes).

    This is what an engine holds that frees every tensor after its last use (a GPU engine; the NumPy reference
    keeps its whole cache dict until gpt_backward returns). Points: the token ids; during and after each block's
    forward (during: the block's whole cache exists while it is built, and under selective/full the dropped part
    is freed at the block's end); after the head (+ lnf, logits, probabilities); after the head's backward (those
    freed); during and after each block's backward (during: + the recomputed part, recompute_peak; after: that
    block's kept tensors freed). Gradient activations (dx, dlogits) and op temporaries are not counted, as in
    memory_model. The maximum is <= memory_model's activations + recompute_peak (which also counts the top
    tensors during the first block's recompute: an upper bound).
    "sqrt": the forward keeps a segment's input only; backward's "bwd l" of a segment's last block is the end of its
    recomputed forward (all its caches alive), and each block's cache is freed after its backward, the segment's
    input with its first block's."""
    name, _ = _check_policy("activation_timeline", policy, cfg.n_layer)
    m = memory_model(cfg, B, T, precision, policy)
    none_block = memory_model(cfg, B, T, precision, "none")["activations_per_block"]
    per_block, L = m["activations_per_block"], cfg.n_layer
    ids = 2 * B * T * INDEX_BYTES
    top = m["activations"] - m["kept_blocks"] * per_block - ids  # lnf inp/out, stats, logits, probs
    points = [("start", ids)]
    if name == "sqrt":
        return points + _sqrt_timeline(segments(L, m["segment"]), ids, top, per_block, none_block)
    for l in range(L):
        points.append((f"fwd {l}", ids + l * per_block + none_block))
        points.append((f"fwd {l} end", ids + (l + 1) * per_block))
    points.append(("head + loss", ids + L * per_block + top))
    points.append(("bwd head", ids + L * per_block))
    for l in reversed(range(L)):
        points.append((f"bwd {l}", ids + (l + 1) * per_block + m["recompute_peak"]))
        points.append((f"bwd {l} end", ids + l * per_block))
    return points


def _sqrt_timeline(segs, ids, top, x, none_block):
    """activation_timeline's points after "start" under the sqrt schedule (x: the bytes of one kept input)."""
    points, kept = [], 0                                         # kept: the segment inputs held so far
    for a, b in segs:
        for l in range(a, b):
            points.append((f"fwd {l}", ids + kept * x + none_block))   # block l's whole cache, its input in it
            kept += l == a
            points.append((f"fwd {l} end", ids + kept * x))
    points.append(("head + loss", ids + kept * x + top))
    points.append(("bwd head", ids + kept * x))
    for a, b in reversed(segs):
        for l in reversed(range(a, b)):                          # blocks a..l still hold their recomputed caches
            points.append((f"bwd {l}", ids + kept * x + (l - a + 1) * none_block - x))
            kept -= l == a
            points.append((f"bwd {l} end", ids + kept * x + max(l - a, 0) * none_block - (x if l > a else 0)))
    return points


def measure_policies(cfg, B, T, repeats=5, seed=0, dtype=np.float32, policies=POLICIES) -> list:
    """CPU measurement with the NumPy reference: per policy, the median time of forward + backward
    (gpt_forward_ckpt + gpt_backward_ckpt, no optimizer) over `repeats` runs after one warm-up, and the activation
    bytes its cache holds (cache_bytes) beside memory_model's prediction. The policies take turns (one run of each
    per round), so a busy machine slows them alike. Rows shaped like the H200 file's:
    {"preset": "cpu", "policy", "batch", "T", "precision", "step_ms", "activation_bytes_measured",
    "activation_bytes_model"}."""
    import time
    from .params import init_params
    params = init_params(cfg, seed=seed, dtype=dtype)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, cfg.vocab_size, (B, T))
    targets = rng.integers(0, cfg.vocab_size, (B, T))
    grads = params.zeros_like()
    precision = "fp32" if np.dtype(dtype) == np.float32 else np.dtype(dtype).name

    def step(policy):
        cache = gpt_forward_ckpt(params, cfg, idx, targets, policy=policy)[2]
        gpt_backward_ckpt(cache, grads)

    measured, times = {}, {policy: [] for policy in policies}
    for policy in policies:
        step(policy)                                                          # warm-up
        measured[policy] = cache_bytes(gpt_forward_ckpt(params, cfg, idx, targets, policy=policy)[2])
    for _ in range(repeats):
        for policy in policies:
            t0 = time.perf_counter()
            step(policy)
            times[policy].append((time.perf_counter() - t0) * 1e3)
    return [{"preset": "cpu", "policy": policy, "batch": B, "T": T, "precision": precision,
             "step_ms": float(np.median(times[policy])), "activation_bytes_measured": measured[policy],
             "activation_bytes_model": memory_model(cfg, B, T, "fp32", policy)["activations"]}
            for policy in policies]


def tradeoff_points(rows) -> dict:
    """{group: {policy: (activation bytes / none's, step time / none's)}} for rows shaped like measure_policies' or
    bench_train.bench_checkpointing's. Where each policy also ran replayed as a CUDA graph (the GPU benchmark), the
    memory comes from the eager rows (the live peak of the pool) and the time from the graph rows (no launch
    overhead: what is left of a policy's cost is its recompute on the GPU); otherwise both from the eager rows.
    Group: "preset precision"; groups without a "none" row are left out."""
    out = {}
    for r in rows:
        if r.get("graphs", "off") == "off":
            out.setdefault(f"{r['preset']} {r['precision']}", {})[r["policy"]] = {"eager": r}
    for r in rows:
        if r.get("graphs") == "on":
            out.get(f"{r['preset']} {r['precision']}", {}).setdefault(r["policy"], {})["graph"] = r
    points = {}
    for key, by_policy in out.items():
        base = by_policy.get("none")
        if base is None:
            continue
        timed = "graph" if all("graph" in v for v in by_policy.values()) else "eager"
        points[key] = {p: (v["eager"]["activation_bytes_measured"] / base["eager"]["activation_bytes_measured"],
                           v[timed]["step_ms"] / base[timed]["step_ms"]) for p, v in by_policy.items() if "eager" in v}
    return points


def load_h200(path=None):
    """The stored H200 checkpointing benchmark (dict with "card", "date", "rows"): stored.load(RESULTS_H200), or the
    JSON file at `path` when one is given (a run of python -m gpullm_lessons.bench checkpointing --json PATH).
    None when the file is not there."""
    import json
    from pathlib import Path

    from ..bench import stored
    if path is None:
        return stored.load(RESULTS_H200)
    path = Path(path)
    if not path.exists():
        return None
    return json.loads(path.read_text())


def segment_peaks(cfg, B, T, precision="fp32", ks=None, model=None) -> list:
    """The sqrt schedule's predicted activation peak for each segment length k (default every k from 1 to n_layer):
    rows {"k", "segments", "kept" (bytes the forward keeps), "recomputed" (the extra while backward holds one
    segment's caches), "peak" (their sum)}. model: memory_model (default: the reference's cache, "recomputed" its
    recompute_peak) or engine.engine_memory (the GPU engine, "recomputed" its largest working set)."""
    model = memory_model if model is None else model
    rows = []
    for k in (range(1, cfg.n_layer + 1) if ks is None else ks):
        m = model(cfg, B, T, precision, f"sqrt:{k}")
        extra = m["recompute_peak"] if "recompute_peak" in m else m["working_set"]
        rows.append({"k": k, "segments": len(segments(cfg.n_layer, k)), "kept": m["activations"],
                     "recomputed": extra, "peak": m["activations"] + extra})
    return rows


def best_segment(cfg, B, T, precision="fp32", model=None) -> int:
    """The segment length k (1..n_layer) with the lowest predicted peak (segment_peaks); the shortest of ties."""
    rows = segment_peaks(cfg, B, T, precision, model=model)
    return min(rows, key=lambda r: (r["peak"], r["k"]))["k"]


def max_batch(cfg, T, capacity_bytes, precision="fp32", policy="none", limit=1 << 20, model=None) -> int:
    """The largest batch size B whose predicted total fits in capacity_bytes (0 if not even B = 1 fits).
    model: the memory model, (cfg, B, T, precision, policy) -> {"total": bytes, ...}; memory_model (the reference's
    cache) by default, engine.engine_memory for the GPU engine. The total grows linearly with B, so a doubling then
    a bisection finds it."""
    model = memory_model if model is None else model

    def fits(B):
        return model(cfg, B, T, precision, policy)["total"] <= capacity_bytes
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    if hi > limit:
        return lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
