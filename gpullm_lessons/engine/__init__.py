"""The training engine: one GPT, its flat buffers and one optimizer step, on a backend.

    eng = build(cfg, backend="hip", precision="bf16", policy="none", seed=0)   # or "numba", "numpy"
    out = eng.train_step(x, y, lr=1e-3, weight_decay=0.1, grad_clip=1.0)    # {"loss", "grad_norm", "skipped", ...}
    eng.eval_loss(x, y); eng.next_logits(context); eng.state_dict(); eng.load_state_dict(state)

Backends
    numpy  the NumPy reference (reference.gpt_forward / gpt_backward through checkpointing.gpt_forward_ckpt, and
           optim.AdamW) on the CPU, fp32 only.
    hip    the course's HIP kernels through CuPy (kernels/hip), a GPU required.
    numba  the course's Numba kernels (kernels/numba): on a GPU with CuPy arrays, or in the CUDA simulator with
           NumPy arrays (tiny models only: the simulator runs ~1e5 thread-steps per second).
Both kernel backends run the same Python code below (GPUEngine); only the launcher module differs. The matrix
products go through cuBLAS / hipBLAS (gpullm_lessons.runtime.blas.gemm), as lesson 02 concludes; everything else is the
course's own kernels: LayerNorm forward/backward, GELU forward/backward, causal softmax forward/backward, the
fused softmax + cross-entropy, the embedding backward, the fused AdamW and the precision kernels, and the glue
kernels between the products (kernels/hip/fused.cu: bias + residual, bias + GELU, head split / merge, bias gradient
+ half copy, LayerNorm with a half output). The two residual-gradient additions of the backward (dx1 = dLN2 + dx,
dx0 = dLN1 + dx1) are the LayerNorm backward's (layernorm_backward(..., residual=): inside the HIP v5 kernel, a pass
of their own after the other versions), and the embedding's backward adds its sums into the head's dwte
(encoder_backward(..., accumulate=True)).

CUDA graphs (hip backend, fp32 / bf16, on by default): train_step captures the whole step once per batch shape and
replays it (StepGraph, engine/graph.py); see GPUEngine.train_step.

Memory layout (model/params.py): parameters, gradients, m and v are flat fp32 buffers with named views
(params.ParamBuffer); the optimizer is one fused AdamW launch over the whole buffer. optimizer_state="bf16" keeps m and
v as bfloat16 bits (uint16) instead: the AdamW kernel reads them, computes in fp32 and writes them back rounded to
nearest even (adamw_bf16_moments_v2; in a CUDA graph adamw_bf16_moments_device_v2). optimizer_state="int8" keeps them
block-wise quantised (gpullm_lessons.model.quant's format: int8 m, uint8 sqrt(v), one fp32 scale per block of 256 values
each, GPUEngine.m_scale / v_scale): one thread block per quantisation block reads it back, updates and quantises it
again with the block's new absmax (adamw_int8_moments_v2; in a CUDA graph adamw_int8_moments_device_v2).

Precision ("fp32" | "bf16" | "fp16"): fp32 master weights always. In half precision the AdamW pass also writes a half
copy of the weights, the input of every matrix product is half (bf16 by round-to-nearest-even into uint16 bits)
and cuBLAS multiplies half x half with fp32 accumulation and an fp32 result. The residual stream, LayerNorm
statistics, the GELU input, the loss and every sum stay fp32; the tensors that only feed matrix products (the
LayerNorm outputs, q, k, v, the attention probabilities, the attention output, the GELU output, the gradients
entering a product, and in bf16 dlogits) are written in half by the kernel that produces them (no fp32 copy, no
conversion pass) and kept in half; the softmax backward reads the half probabilities and writes dpre in half.
The attention scores q @ k.T and their gradient datt (the largest tensors, (B*nh, T, T)) are rounded to half by
cuBLAS itself on the way out (versions["scores"] = "half", the default; "f32" keeps them fp32), and the softmax
kernels read them in half.
fp16 adds dynamic loss scaling (precision.DynamicLossScaler): dlogits is multiplied by the scale before it is
rounded to fp16, the step is skipped when the one-pass non-finite count of the gradient buffer is not 0, and AdamW
divides by the scale in its gradient read (grad_scale).

Activation checkpointing (policy, as model/checkpointing.py): "none" keeps every block's cache; "selective" drops the
LayerNorm outputs and the GELU output and recomputes them (one LayerNorm forward / one GELU forward) in backward;
"full" keeps only each block's input and reruns the block's forward just before its backward; "sqrt" (or "sqrt:K")
keeps only each segment's input (segments of k = round(sqrt(L)), or K, blocks) and, reaching a segment's last block,
reruns the whole segment's forward, holding its k caches until their blocks' backwards have run.

One training step: forward (loss), backward (every gradient written, none accumulated), the global gradient norm
(one reduction over the flat gradient buffer), clipping and 1/loss-scale folded into AdamW's grad_scale, AdamW.
"""

from __future__ import annotations

import numpy as np

from ..model.params import GPTConfig
from .core import (
    BACKENDS,
    BETAS,
    EPS,
    GRAPH_PRECISIONS,
    OPTIMIZER_STATES,
    POLICIES,
    PRECISIONS,
    Engine,
    EngineError,  # noqa: F401
    OptimizerShard,
    check_backend,
    check_policy,
    optimizer_state_bytes,  # noqa: F401
)
from .cpu import NumpyEngine
from .gpu import GPUEngine
from .graph import StepGraph  # noqa: F401
from .memory import engine_memory  # noqa: F401
from .profiler import OpProfiler  # noqa: F401


def build(
    cfg: GPTConfig,
    backend="auto",
    precision="fp32",
    policy="none",
    seed=0,
    betas=BETAS,
    eps=EPS,
    versions=None,
    graphs="auto",
    optimizer_state="fp32",
    ce_chunks=1,
    offload_optimizer=False,
):
    """An engine for cfg on `backend` (see the module docstring), initialised with init_params(cfg, seed).

    graphs: "auto" (CUDA graphs for train_step where they apply: backend hip on a GPU, fp32 or bf16), "off", or "on"
    (EngineError where they cannot apply). See GPUEngine.train_step.
    ce_chunks: the loss head over the B*T rows in that many chunks (ceil(B*T / ce_chunks) rows each, the last one
    smaller), each chunk's backward right after its forward, so the (B*T, V) logits never exist at once (lesson 12;
    reference/head.py, GPUEngine._head_chunked, every backend); 1: the whole batch at once. The loss and gradients
    equal the unchunked ones up to rounding; forward(x, y) then returns no logits.
    optimizer_state: AdamW's moments m and v in "fp32", "bf16" (bfloat16 bits, 2 bytes each, rounded to nearest even
    after every update: every backend, the kernel backends through the bf16-moment AdamW kernels) or "int8"
    (block-wise 8-bit, gpullm_lessons.model.quant's format: every backend, the kernel backends through the int8-moment
    AdamW kernels, one thread block per block of 256 values). Lesson 12.
    offload_optimizer: the fp32 master weights and AdamW's moments in pinned host memory and the update on the CPU
    (engine/offload.py, kernel backends, fp32 moments, steps launched from Python). Lesson 12."""
    backend = check_backend(backend)
    if optimizer_state not in OPTIMIZER_STATES:
        raise EngineError(f"unknown optimizer_state {optimizer_state!r}: choose one of {', '.join(OPTIMIZER_STATES)}")
    if precision not in PRECISIONS:
        raise EngineError(f"unknown precision {precision!r}: choose one of {', '.join(PRECISIONS)}")
    check_policy(policy, cfg)
    if isinstance(ce_chunks, bool) or not isinstance(ce_chunks, (int, np.integer)) or ce_chunks < 1:
        raise EngineError(f"ce_chunks must be a positive integer (1: the whole batch at once), got {ce_chunks!r}")
    if graphs not in ("auto", "on", "off", True, False):
        raise EngineError(f"graphs must be 'auto', 'on' or 'off', got {graphs!r}")
    graphs = {True: "on", False: "off"}.get(graphs, graphs)
    if graphs == "on" and not (backend == "hip" and precision in GRAPH_PRECISIONS):
        raise EngineError(
            f"graphs='on': CUDA graphs replay the hip backend's step in {' or '.join(GRAPH_PRECISIONS)} "
            f"(fp16 decides on the host whether to skip a step); got backend {backend!r}, "
            f"precision {precision!r}"
        )
    if offload_optimizer and backend == "numpy":
        raise EngineError(
            "offload_optimizer moves AdamW's state from the GPU to host memory; the NumPy engine already keeps "
            "everything in host memory (use --backend hip or numba)"
        )
    if backend == "numpy":
        if precision != "fp32":
            raise EngineError(
                f"precision {precision!r} needs a kernel backend (--backend hip or numba); the NumPy "
                f"reference trains in fp32 (lesson 07 emulates half-precision matmuls on the CPU)"
            )
        return NumpyEngine(cfg, policy, seed, betas, eps, optimizer_state=optimizer_state, ce_chunks=ce_chunks)
    return GPUEngine(
        cfg,
        backend,
        precision,
        policy,
        seed,
        betas,
        eps,
        versions,
        graphs=graphs if backend == "hip" and precision in GRAPH_PRECISIONS else "off",
        ce_chunks=ce_chunks,
        optimizer_state=optimizer_state,
        offload_optimizer=bool(offload_optimizer),
    )
