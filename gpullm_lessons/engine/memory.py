"""engine_memory: the predicted peak GPU memory of GPUEngine.train_step, what the engine allocates."""

from __future__ import annotations

from ..model.checkpointing import parse_policy, segments
from ..model.params import GPTConfig, num_params
from .core import PRECISIONS, optimizer_state_bytes


def engine_memory(
    cfg: GPTConfig,
    B: int,
    T: int,
    precision="fp32",
    policy="none",
    half_scores=True,
    attention="auto",
    ce_chunks=1,
    optimizer_state="fp32",
    offload_optimizer=False,
    half_gelu_in=False,
    epilogue=False,
    dgelu_epilogue=True,
    half_logits=False,
    half_dgelu=False,
    half_dqkv=False,
    half_dres=False,
) -> dict:
    """Predicted peak GPU memory (bytes) of GPUEngine.train_step on a (B, T) batch: what this engine allocates.

    checkpointing.memory_model describes the NumPy reference's cache (every tensor in one precision); this function
    follows the engine's own choices, tensor by tensor (module docstring): fp32 master weights, grads, m, v and the
    half copy; per block the kept tensors of the policy (fp32 residual stream, LayerNorm statistics and GELU input;
    the matmul inputs, the attention probabilities among them, in the run's format); the tensors kept outside the
    blocks (last block output, lnf statistics and output, dlogits (B*T, V) fp32, token ids); and the largest working
    set of any phase of the step: the forward of a block (one temporary at a time), the head (logits + dlogits), the
    start of backward (dlogits, its half copy, dlnf), a block's backward (the stages of _block_backward, with its
    recompute under "full" / "selective"; under "sqrt" the whole longest segment's recomputed caches; by then the head's
    backward has freed the dlogits), the embedding backward (v3's 64-bit accumulator). half_scores: the
    engine's versions["scores"] == "half" (the default: the attention scores and their gradient in half; only in half
    precision). attention: the engine's versions["attention"], "cublas" (the probabilities (B, nh, T, T) kept),
    "flash" (the log-sum-exp kept instead: linear in T; y is the kept atty_mm) or "auto" (the hip engine's default: flash in half
    precision at the head sizes flash.cu is compiled for, else cublas).
    half_gelu_in: the engine's versions["gelu_in"] == "half" (GELU's input kept as half bits, 2 bytes an element
    instead of 4; only in half precision; the float32 product is then a temporary of the forward).
    epilogue: the engine's versions["epilogue"] == "cublaslt" (half precision only): with flash attention the qkv
    product writes the half q, k, v itself (no float32 qkv temporary in the forward); with half_gelu_in the fc product
    writes GELU's half input itself (no float32 fc temporary in the forward) and the fc projection's backward makes
    the half dfc in its product (no float32 dgelu in the backward). dgelu_epilogue: the engine's versions["dgelu"] ==
    "cublaslt" (the default); False ("kernel") makes dfc as without the epilogues (a float32 dgelu, then one pass).
    half_logits: the engine's versions["logits"] == "half" (bf16 only): the head's product writes bf16 logits and the
    loss kernel writes the bf16 dlogits over them (one (rows, V) buffer of 2 bytes an element, no float32 logits).
    half_dgelu: the engine's versions["dgelu_out"] == "half" (with half_gelu_in, where dfc is made in colsum_convert's
    pass): GELU's output gradient in the backward is half, 2 bytes an element instead of 4.
    half_dqkv: the engine's versions["dqkv_out"] == "half" (flash attention with epilogue): the flash backward writes
    dqkv (N, 3C) in half, which the products read as it is (no float32 dqkv, no half copy of it).
    half_dres: the engine's versions["dres_out"] == "half" (with epilogue): the LayerNorm backwards write the residual
    stream's gradient's half copy too, which lives from there to the projection that reads it.
    ce_chunks: the engine's ce_chunks (lesson 12): the loss head over the B*T rows in chunks of ceil(B*T / ce_chunks),
    its backward in the forward, so one chunk's logits and dlogits exist at a time and dlnf (B*T, C) fp32 is kept for
    backward instead of dlogits (B*T, V).
    optimizer_state: how AdamW's m and v are stored ("adamw": fp32 8 bytes per parameter, bf16 4, int8 2 plus the
    block scales: core.optimizer_state_bytes). offload_optimizer: m and v live in host memory (engine/offload.py):
    no GPU bytes for them; "host" then gives the host's pinned bytes (master weights, gradients, m, v: 16 per
    parameter), which are not part of "total".
    Returns the terms, "head" (the loss head's own tensors at the end of the forward: lnf's output, the logits and
    dlogits, or one chunk's and dlnf, the per-row losses and the targets) and "total" = model + activations + peak
    working set.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"engine_memory: precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if not isinstance(cfg, GPTConfig):
        raise TypeError(f"engine_memory: cfg must be a GPTConfig, got {type(cfg).__name__}")
    if epilogue and precision == "fp32":
        raise ValueError(
            "engine_memory: epilogue=True describes the half-precision epilogue products; precision is fp32"
        )
    if half_dgelu and not (half_gelu_in and precision != "fp32"):
        raise ValueError(
            "engine_memory: half_dgelu=True describes a half GELU gradient beside half_gelu_in=True in half "
            f"precision; got half_gelu_in={half_gelu_in}, precision {precision!r}"
        )
    if half_logits and precision != "bf16":
        raise ValueError(f"engine_memory: half_logits=True describes bf16 logits; precision is {precision!r}")
    if half_dres and not epilogue:
        raise ValueError(
            "engine_memory: half_dres=True describes the LayerNorm backward's half copy beside epilogue=True"
        )
    if half_dqkv and not (epilogue and attention == "flash"):
        raise ValueError(
            "engine_memory: half_dqkv=True describes the flash backward's half dqkv beside epilogue=True (its bias "
            f"gradient from the product); got epilogue={epilogue}, attention {attention!r}"
        )
    policy, k = parse_policy(policy, cfg.n_layer, "engine_memory")  # "sqrt:K" -> ("sqrt", K)
    if attention == "auto":  # the hip engine's default: flash where its kernels run, else the cuBLAS path
        from .gpu import flash_unsupported

        attention = "flash" if flash_unsupported(cfg, "hip", precision) is None else "cublas"
    if attention not in ("flash", "cublas"):
        raise ValueError(f"engine_memory: attention must be 'flash', 'cublas' or 'auto', got {attention!r}")
    from ..reference.head import chunk_bounds

    ce_rows = chunk_bounds(B * T, ce_chunks)[0][1]  # rows of the largest chunk of the loss head (ValueError if bad)
    flash = attention == "flash"
    f, e = 4, (4 if precision == "fp32" else 2)
    half = e == 2
    h = e if half else 0  # bytes of a half copy that exists only in half precision
    C, nh, L, V = cfg.d_model, cfg.n_head, cfg.n_layer, cfg.vocab_size
    N, P, TT = B * T, num_params(cfg), B * nh * T * T
    NC = N * C
    adamw = 0 if offload_optimizer else optimizer_state_bytes(P, optimizer_state)
    model = {"params": P * f, "params_half": P * h, "grads": P * f, "adamw": adamw}
    # what one block keeps, per policy (GPUEngine._block_forward)
    base = NC * f + 4 * N * f  # x, mean1, rstd1, mean2, rstd2
    att = B * nh * T * f if flash else TT * e  # flash: lse; cublas: the probabilities att_mm
    g = e if (half and half_gelu_in) else f  # bytes of the kept GELU input fc
    sel = 3 * NC * e + att + NC * e + NC * f + 4 * NC * g  # q, k, v (flash: qkv_mm), the attention's, atty_mm, x1, fc
    rebuilt = NC * e + NC * e + 4 * NC * e  # ln1_mm, ln2_mm, gelu_mm
    full_cache = base + sel + rebuilt
    kept_block = {"none": full_cache, "selective": base + sel, "full": NC * f, "sqrt": NC * f}[policy]
    # sqrt: only a segment's first block keeps (its input); m, the longest segment, is recomputed at once in backward
    n_kept, m = (len(segments(L, k)), max(b - a for a, b in segments(L, k))) if policy == "sqrt" else (L, 1)
    dl = 2 if precision == "bf16" else 4  # dlogits: bf16 from the loss kernel
    if ce_chunks == 1:
        top = NC * f + 2 * N * f + NC * e + N * V * dl + N * 4  # h, meanf, rstdf, lnf_mm, dlogits, idx
    else:  # the head's backward ran in forward: dlnf is kept instead of dlogits and lnf_mm
        top = NC * f + 2 * N * f + NC * f + N * 4  # h, meanf, rstdf, dlnf, idx
    activations = n_kept * kept_block + top
    # forward: one temporary at a time beside the growing cache: qkv before the head split, the scores (half or
    # fp32: half_scores) before the half softmax output (half runs), y before merge_heads (cublas), the block output;
    # under
    # selective the matmul inputs that are not kept, under full the whole cache (a local of the forward, dropped on
    # return)
    ts = e if (half and half_scores) else f  # bytes of a score / its gradient
    # (half_gelu_in: the float32 fc product beside its half copy, until bias_gelu_forward has read it)
    qkv_temp = 0 if (epilogue and flash) else 3 * NC * f  # the float32 qkv before split_heads
    fc_temp = 4 * NC * f if (g != f and not epilogue) else 0  # the float32 fc product (epilogue: written in half)
    temps = max(qkv_temp, 0 if flash else TT * ts * half, NC * f, fc_temp)
    fwd_block = temps
    if policy == "selective":
        fwd_block += rebuilt
    elif policy == "full" or (policy == "sqrt" and m == 1):
        fwd_block += full_cache - NC * f
    elif policy == "sqrt":  # a block inside a segment: its input (the block below's output) is not kept either
        fwd_block += full_cache
    lg = 0 if half_logits else f  # bytes of a logit beside its dlogit (half_logits: the dlogits are written over them)
    if ce_chunks == 1:
        head = N * V * lg + N * f + N * 4  # logits, losses, targets (the dlogits are in top)
        head_bytes = NC * e + N * V * (lg + dl) + N * f + N * 4  # the head's tensors: lnf_mm, logits, dlogits, ...
    else:  # one chunk's logits and dlogits (fp16: fp32 dlogits, x scale fp32, its fp16 copy) beside lnf_mm
        head = NC * e + ce_rows * V * (lg + (10 if precision == "fp16" else dl)) + N * f + N * 4
        head_bytes = head + NC * f  # and dlnf, filled chunk by chunk
    # backward: the stages of _block_backward on top of the incoming dx (NC f)
    ld = NC * h if half_dres else 0  # the half copy of the residual stream's gradient the LayerNorm backward writes
    if epilogue and g != f and dgelu_epilogue:  # the half dfc out of the fc projection's product (DGELU_BGRAD)
        stages = [
            NC * h + 4 * NC * h,  # fcproj: dx_mm, dfc_mm
            4 * NC * h + NC * f,  # fc: dfc_mm, dln2
            2 * NC * f + ld,  # dln2, dx1 (half_dres: and dx1's half copy)
        ]
    else:
        dg = h if half_dgelu else f  # bytes of an element of dgelu
        stages = [
            NC * h + 4 * NC * dg,  # fcproj: dx_mm, dgelu
            4 * NC * dg + (4 * NC * h if half else 4 * NC * f),  # dgelu, dfc (half runs: only dfc_mm, GELU fused)
            4 * NC * dg + 4 * NC * h + NC * f,  # fc: dgelu (fp32 runs: dfc), dfc_mm, dln2
            2 * NC * f + ld,  # dln2, dx1 (half_dres: and dx1's half copy)
        ]
    dq = 3 * NC * (h if half_dqkv else f)  # bytes of dqkv as the flash kernels write it
    if flash:  # the projection's product writes dy in the matmul format; the kernels write dqkv directly
        stages += [
            NC * f + NC * h + NC * e,  # attproj: dx1, dx1_mm, dy
            NC * f + dq + NC * e + B * nh * T * f,  # dx1, dqkv, dy, delta
        ]
    else:
        stages += [
            2 * NC * f + NC * h,  # attproj: dx1, dx1_mm, datty
            2 * NC * f + NC * e,  # dx1, datty, dy
            2 * NC * f + NC * e + TT * ts,  # dx1, dy, dv, datt
            2 * NC * f + TT * ts + TT * h,  # dx1, dv, datt, dpre (half)
            5 * NC * f + TT * e,  # dx1, dqkv, dv / part, dpre
        ]
    stages += [
        2 * NC * f + dq + (0 if half_dqkv else 3 * NC * h),  # qkv: dx1, dqkv, dqkv_mm (half_dqkv: dqkv itself), dln1
        3 * NC * f + ld,
    ]  # dx1, dln1, dx0 (half_dres: and dx0's half copy)
    recompute = {"none": 0, "selective": rebuilt, "full": full_cache - NC * f, "sqrt": m * full_cache - NC * f}[policy]
    bwd_block = (
        NC * f + ld + max(stages) + recompute
    )  # the incoming dx (half_dres: and its half copy, held by the loop)
    if policy in ("full", "sqrt"):  # the recompute's own forward locals (of its last block), before the stages
        bwd_block = max(bwd_block, NC * f + recompute + temps)
    fp16_copy = N * V * (f + 2) if precision == "fp16" else 0  # dlogits * scale, then its fp16 cast
    bwd_head = fp16_copy + NC * f if ce_chunks == 1 else NC * f  # chunks: dlnf kept (top), dx of lnf's backward
    embed_bwd = NC * f + V * C * 8  # dx, v3's int64 accumulator (V, C) (it adds its sums into dwte itself)
    # the blocks' backward runs after the head's: the dlogits the forward kept (ce_chunks 1) are freed by then
    freed = N * V * dl if ce_chunks == 1 else 0
    peak_set = max(fwd_block, head, bwd_head, bwd_block - freed, embed_bwd)
    out = {**model, "activations": activations, "activations_per_block": kept_block, "working_set": peak_set}
    out["head"] = head_bytes
    out["total"] = sum(model.values()) + activations + peak_set
    if offload_optimizer:
        out["host"] = 4 * P * f
    return out
