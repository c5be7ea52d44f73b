"""The whole GPT-2 (pre-LN) forward and backward, composed from the reference ops.

Forward, x (B, T, C) the residual stream:
    x = wte[idx] + wpe[:T]                                               encoder
    for each layer l:
        x = x + attproj(attention(qkv(ln1(x))))                          attention block
        x = x + fcproj(gelu(fc(ln2(x))))                                 MLP block
    logits = lnf(x) @ wte.T                                              (B, T, V) tied LM head
    loss = crossentropy(logits, targets)

Backward: the same steps in reverse, each op's backward turning d(its output) into d(its inputs).
    - A residual x + f(x) sends the incoming gradient both straight down (dx) and into f; the two add up.
    - Weight tying: wte is used twice (embedding lookup and LM head), so dwte is the SUM of the encoder's
      scatter-add and the head's gradient. The head is linear with weight wte.T (C, V), so its dweight (C, V)
      is transposed back before adding.

Two variations for later lessons, off by default (then the code is the plain reference above):
    gpt_forward(..., keep=)        what the cache keeps of each block (lesson 08, activation checkpointing)
    gpt_backward(..., recompute=)  rebuilds a block's cache from what was kept, just before its backward (lesson 08)
    gpt_backward(..., dloss=)      the gradient the backward starts from: the loss scale (lesson 07, mixed precision)
    gpt_forward(..., ce_chunks=)   the head and the loss in chunks of rows, never all the logits (lesson 12, head.py)
    blocks_forward / blocks_backward   a range of blocks on a given residual stream: the middle of gpt_forward /
                                   gpt_backward, and one pipeline stage's share of them (parallel/pipeline.py)
"""
import numpy as np

from ..model.params import GPTConfig, param_shapes
from .attention import attention_backward, attention_forward
from .crossentropy import crossentropy_backward, crossentropy_forward
from .encoder import encoder_backward, encoder_forward
from .gelu import gelu_backward, gelu_forward
from .head import check_chunks, head_backward, head_forward_backward
from .layernorm import layernorm_backward, layernorm_forward
from .linear import linear_backward, linear_forward
from .residual import residual_backward, residual_forward


def _check_tensors(fn, what, tensors, cfg):
    """Every named tensor present with the shape param_shapes(cfg) says. Returns the common dtype."""
    dtype = None
    for name, shape in param_shapes(cfg).items():
        try:
            arr = tensors[name]
        except KeyError:
            raise KeyError(f"{fn}: {what} has no tensor named {name!r}") from None
        if tuple(arr.shape) != shape:
            raise ValueError(f"{fn}: {what}[{name!r}] is {tuple(arr.shape)} but cfg needs {shape}")
        if dtype is None:
            dtype = arr.dtype
        elif arr.dtype != dtype:
            raise TypeError(f"{fn}: {what}[{name!r}] is {arr.dtype} but the others are {dtype}; use one dtype")
    if not np.issubdtype(dtype, np.floating):
        raise TypeError(f"{fn}: {what} must be floating-point, got dtype {dtype}")
    return dtype


def check_inputs(fn, params, cfg, idx):
    """cfg a GPTConfig, every parameter tensor present, idx (B, T) with T <= block_size. Returns idx as an array."""
    if not isinstance(cfg, GPTConfig):
        raise TypeError(f"{fn}: cfg must be a GPTConfig, got {type(cfg).__name__}")
    _check_tensors(fn, "params", params, cfg)
    idx = np.asarray(idx)
    if idx.ndim != 2:
        raise ValueError(f"{fn}: idx must be (B, T), got shape {idx.shape}")
    if idx.shape[1] > cfg.block_size:
        raise ValueError(f"{fn}: T={idx.shape[1]} is longer than block_size={cfg.block_size}")
    return idx


def block_forward(p, l, x, n_head):
    """Transformer block l on x (B, T, C) -> (x_out (B, T, C), c): c is the block's cache for block_backward."""
    c = {}
    ln1, c["ln1"] = layernorm_forward(x, p["ln1w"][l], p["ln1b"][l])          # (B, T, C)
    qkv, c["qkv"] = linear_forward(ln1, p["qkvw"][l], p["qkvb"][l])           # (B, T, 3C)
    atty, c["attention"] = attention_forward(qkv, n_head)                     # (B, T, C)
    attproj, c["attproj"] = linear_forward(atty, p["attprojw"][l], p["attprojb"][l])  # (B, T, C)
    x, _ = residual_forward(x, attproj)                                       # (B, T, C)
    ln2, c["ln2"] = layernorm_forward(x, p["ln2w"][l], p["ln2b"][l])          # (B, T, C)
    fch, c["fc"] = linear_forward(ln2, p["fcw"][l], p["fcb"][l])              # (B, T, 4C)
    fch_gelu, c["gelu"] = gelu_forward(fch)                                   # (B, T, 4C)
    fcproj, c["fcproj"] = linear_forward(fch_gelu, p["fcprojw"][l], p["fcprojb"][l])  # (B, T, C)
    x, _ = residual_forward(x, fcproj)                                        # (B, T, C)
    return x, c


def block_backward(dx, c, grads, l):
    """d(block l's output) (B, T, C) -> d(its input); writes layer l's slice of each gradient tensor in place."""
    # MLP block: x_out = x_mid + fcproj(gelu(fc(ln2(x_mid))))
    dx_mid, dfcproj = residual_backward(dx)                                   # (B, T, C) each
    dfch_gelu, grads["fcprojw"][l], grads["fcprojb"][l] = linear_backward(dfcproj, c["fcproj"])
    dfch = gelu_backward(dfch_gelu, c["gelu"])                                # (B, T, 4C)
    dln2, grads["fcw"][l], grads["fcb"][l] = linear_backward(dfch, c["fc"])   # (B, T, C)
    dx_ln2, grads["ln2w"][l], grads["ln2b"][l] = layernorm_backward(dln2, c["ln2"])
    dx = dx_mid + dx_ln2                                                      # both paths into x_mid
    # attention block: x_mid = x_in + attproj(attention(qkv(ln1(x_in))))
    dx_in, dattproj = residual_backward(dx)
    datty, grads["attprojw"][l], grads["attprojb"][l] = linear_backward(dattproj, c["attproj"])
    dqkv = attention_backward(datty, c["attention"])                          # (B, T, 3C)
    dln1, grads["qkvw"][l], grads["qkvb"][l] = linear_backward(dqkv, c["qkv"])
    dx_ln1, grads["ln1w"][l], grads["ln1b"][l] = layernorm_backward(dln1, c["ln1"])
    return dx_in + dx_ln1                                                     # (B, T, C)


def blocks_forward(p, x, n_head, layers, keep=None):
    """Blocks `layers` (indices into p's (L, ...) tensors, in order: range(l0, l1)) on the residual stream x (B, T, C)
    -> (x after the last of them, [what each block's cache keeps]). keep(l, cache): as gpt_forward's."""
    caches = []
    for l in layers:
        x, c = block_forward(p, l, x, n_head)                                     # (B, T, C)
        caches.append(c if keep is None else keep(l, c))
    return x, caches


def blocks_backward(dx, caches, grads, layers, recompute=None, ready=None):
    """d(the output of blocks `layers`) (B, T, C) -> d(their input); caches from blocks_forward over the same layers.
    Writes block l's slice of each gradient tensor in place; recompute(l, kept) as gpt_backward's; ready(l) once
    block l's gradients are final."""
    for l, c in zip(reversed(layers), reversed(caches)):                          # what the forward kept
        if recompute is not None:
            c = recompute(l, c)                   # the whole block cache again, freed when c moves to block l - 1
        dx = block_backward(dx, c, grads, l)                                      # (B, T, C)
        if ready is not None:
            ready(l)
    return dx


def gpt_forward(params, cfg, idx, targets=None, keep=None, ce_chunks=1, head_grads=True):
    """params (ParamBuffer or dict name -> array), cfg GPTConfig, idx (B, T) int, targets (B, T) int or None
    -> (logits (B, T, V), loss (scalar) or None, cache).

    keep(l, block l's cache) -> what cache["layers"][l] holds instead of that whole cache (None: keep it all).
    ce_chunks > 1 (lesson 12, with targets): the head and the loss over the B*T rows in that many chunks, the head's
    backward with them (reference/head.py), so the logits never exist whole: logits is None; head_grads=False: the
    loss only (evaluation; such a cache cannot be backpropagated).
    """
    idx = check_inputs("gpt_forward", params, cfg, idx)
    ce_chunks = check_chunks("gpt_forward", ce_chunks)
    p = params

    x, enc_cache = encoder_forward(idx, p["wte"], p["wpe"])                       # (B, T, C)
    x, layers = blocks_forward(p, x, cfg.n_head, range(cfg.n_layer), keep)        # (B, T, C)
    lnf, lnf_cache = layernorm_forward(x, p["lnfw"], p["lnfb"])                   # (B, T, C)
    loss, ce_cache = None, None
    if targets is not None and ce_chunks > 1:     # chunk by chunk; ce_cache: dlnf, dwte of the head (dloss = 1)
        logits, head_cache = None, None
        loss, ce_cache = head_forward_backward(lnf, p["wte"], targets, ce_chunks, grads=head_grads)
    else:
        logits, head_cache = linear_forward(lnf, p["wte"].T)                      # (B, T, V) weight (C, V)
        if targets is not None:
            loss, ce_cache = crossentropy_forward(logits, targets)                # scalar
    cache = {"cfg": cfg, "encoder": enc_cache, "layers": layers, "lnf": lnf_cache,
             "head": head_cache, "crossentropy": ce_cache}
    return logits, loss, cache


def gpt_backward(cache, grads, dloss=1.0, recompute=None, ready=None):
    """Gradients of the loss (dloss = 1) into grads (ParamBuffer or dict name -> array of the parameter
    shapes). Every tensor of grads is overwritten, not accumulated. Returns None.

    dloss: the gradient of the loss itself; a loss scale there makes every gradient that many times larger.
    recompute(l, cache["layers"][l]) -> block l's whole cache, when gpt_forward's keep kept less (None: it kept all).
    ready(k): called as soon as the gradients of layer k of params.layer_segments(cfg) are final (L + 1: the final
    LayerNorm, 1 + l: block l, 0: the embeddings, last), so that data parallel can send them during the backward.
    """
    cfg = cache["cfg"]
    if cache["crossentropy"] is None:
        raise ValueError("gpt_backward: the cache has no loss; call gpt_forward with targets first")
    _check_tensors("gpt_backward", "grads", grads, cfg)

    if "chunks" in cache["crossentropy"]:         # the chunked head's backward ran with the forward (head.py)
        dlnf, dwte_head = head_backward(dloss, cache["crossentropy"])             # (B, T, C), (V, C)
    else:
        dlogits = crossentropy_backward(dloss, cache["crossentropy"])             # (B, T, V)
        dlnf, dwte_head, _ = linear_backward(dlogits, cache["head"])              # (B, T, C), (C, V)
        dwte_head = dwte_head.T                                                   # (V, C)
    # `grads[name][l], ... = op_backward(...)` writes layer l's slice of each gradient tensor in place
    dx, grads["lnfw"][...], grads["lnfb"][...] = layernorm_backward(dlnf, cache["lnf"])  # dx (B, T, C)
    ready = ready or (lambda k: None)
    ready(cfg.n_layer + 1)                                                        # lnfw, lnfb are final

    dx = blocks_backward(dx, cache["layers"], grads, range(cfg.n_layer), recompute,
                         ready=lambda l: ready(1 + l))                            # block l's slices are final

    dwte, grads["wpe"][...] = encoder_backward(dx, cache["encoder"])              # (V, C), (maxT, C)
    grads["wte"][...] = dwte + dwte_head                                          # weight tying: both uses
    ready(0)
    return None
