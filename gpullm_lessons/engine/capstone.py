"""The capstone of lesson 09: the training engine with its three central pieces left for you to write.

    eng = CapstoneEngine(cfg, block_forward, block_backward, optimizer_step, backend="auto", seed=0, loss_scale=1.0)
    eng.train_step(x, y, lr, weight_decay, grad_clip)     # -> {"loss", "grad_norm", "skipped"}
    eng.eval_loss(x, y); eng.next_logits(context)          # as every engine (gpullm_lessons.engine)

The skeleton is the course's GPU engine (``engine.GPUEngine``, fp32, backend "hip" on a GPU, "numba" in the CUDA
simulator) with the GPT block's forward, its backward and the optimizer step taken out. It keeps: the flat buffers
(params, grads, m, v), the embedding, the final LayerNorm, the tied head and the fused softmax + cross-entropy, their
backward, the layer loops that call your block functions and hand the residual stream (and its gradient) along,
evaluation and sampling. What you write, as plain functions of the engine ``eng``:

    block_forward(eng, x, l, B, T) -> (out, cache)
        x (B*T, C) float32: the input of block l (do not change it: the cache keeps it for the backward);
        out (B*T, C) float32: x1 + mlp(ln2(x1)) with x1 = x + attention(ln1(x)); cache: a dict holding at least
        CACHE_KEYS (shapes in CACHE_SHAPES), new arrays on every call (the engine keeps every layer's cache until
        its backward).
    block_backward(eng, dout, cache, l, B, T) -> dx
        dout (B*T, C) float32: the gradient of block l's output; returns the gradient of its input and WRITES
        (overwrites, never adds to) layer l's twelve gradients in eng.grads (LAYER_PARAMS).
    optimizer_step(eng, lr, weight_decay, grad_clip, loss_scale) -> grad_norm
        eng.grads holds loss_scale times the gradient of the loss. One optimizer step over the flat buffers: the
        global gradient norm (returned, of the true gradient), clipping to grad_clip (0: off; as
        torch.nn.utils.clip_grad_norm_), and the course's fused AdamW with its decoupled weight decay on the matrices.

The engine's toolbox (what your functions may use; ``print(toolbox(eng))`` lists the launchers with signatures):

    eng.K            the backend's launchers by name (gpullm_lessons.backends.hip or .numba): layernorm_forward,
                     layernorm_backward, split_heads, merge_heads, attention_softmax_forward / _backward, bias_add,
                     bias_gelu_forward, gelu_backward, colsum_convert, grad_sumsq, adamw_step, ... A launcher that
                     takes version= runs the engine's default version for this machine when you leave it out.
    eng.gemm(a, b, out, trans_a=False, trans_b=False, alpha=1.0, beta=0.0)
                     out = alpha * op(a) @ op(b) + beta * out through gpullm_lessons.runtime.blas.gemm (cuBLAS / hipBLAS;
                     NumPy in the simulator), 2-D or batched 3-D, C-contiguous float32; timed by the profiler
    eng.xp           the array module of the buffers: cupy on a GPU, numpy in the simulator
    eng.cfg          the GPTConfig (n_head, d_model, ...)
    eng.params, eng.grads   ParamBuffers: eng.params["qkvw"][l] is layer l's (C, 3C) weight, a view of params.flat;
                     weights are stored (in, out): out = inp @ W + b
    eng.m, eng.v, eng.t, eng.betas, eng.eps, eng.decay
                     AdamW's state (flat float32 moments, the step count: steps taken so far), its constants, and the
                     decay table (which tensors get weight decay) for adamw_step's decay_bounds=

The checkers of lesson 09's exercise (gpullm_lessons.checks.capstone) test each function on its own against the NumPy
reference, and then the engine built from all three against the NumPy engine (``engine.NumpyEngine``).
"""

from __future__ import annotations

import inspect

import numpy as np

from . import BETAS, EPS, EngineError, GPUEngine, check_backend
from ..model.params import GPTConfig

# what block_forward's cache must hold (the backward needs each of them), in the order the forward makes them
CACHE_KEYS = ("x", "ln1", "mean1", "rstd1", "q", "k", "v", "att", "atty", "x1", "ln2", "mean2", "rstd2", "fc", "gelu")
# their shapes, in the symbols N = B*T, C, nh, hs = C // nh, BH = B*nh
CACHE_SHAPES = {
    "x": ("N", "C"),
    "ln1": ("N", "C"),
    "mean1": ("N",),
    "rstd1": ("N",),
    "q": ("BH", "T", "hs"),
    "k": ("BH", "T", "hs"),
    "v": ("BH", "T", "hs"),
    "att": ("BH", "T", "T"),
    "atty": ("N", "C"),
    "x1": ("N", "C"),
    "ln2": ("N", "C"),
    "mean2": ("N",),
    "rstd2": ("N",),
    "fc": ("N", "4C"),
    "gelu": ("N", "4C"),
}
CACHE_MEANING = {
    "x": "the block's input x",
    "ln1": "the first LayerNorm's output ln1(x)",
    "mean1": "the first LayerNorm's row means (of x)",
    "rstd1": "the first LayerNorm's row 1/std (of x)",
    "q": "the queries, heads split, qkv bias included",
    "k": "the keys, heads split, qkv bias included",
    "v": "the values, heads split, qkv bias included",
    "att": "the attention probabilities (causal softmax of the scaled scores)",
    "atty": "the attention output att @ v, heads merged (the input of attproj)",
    "x1": "the residual stream after the attention half, x1 = x + attproj(...)",
    "ln2": "the second LayerNorm's output ln2(x1)",
    "mean2": "the second LayerNorm's row means (of x1)",
    "rstd2": "the second LayerNorm's row 1/std (of x1)",
    "fc": "the fc output with its bias (GELU's input)",
    "gelu": "the GELU output (the input of fcproj)",
}
# layer l's gradients, written by block_backward (in the order the backward writes them)
LAYER_PARAMS = (
    "fcprojw",
    "fcprojb",
    "fcw",
    "fcb",
    "ln2w",
    "ln2b",
    "attprojw",
    "attprojb",
    "qkvw",
    "qkvb",
    "ln1w",
    "ln1b",
)
# launchers that take version=, and the engine's version key for each
_VERSION_KEYS = {
    "layernorm_forward": "layernorm_forward",
    "layernorm_backward": "layernorm_backward",
    "gelu_forward": "gelu",
    "gelu_backward": "gelu",
    "adamw_step": "adamw",
    "crossentropy_forward_backward": "crossentropy",
    "encoder_backward": "encoder",
    "f32_to_bf16": "convert",
    "f32_to_f16": "convert",
}
# launchers whose block size is free (grid-stride or thread-per-row kernels): in the CUDA simulator, where every
# thread runs in Python, eng.K launches them with SIM_THREADS threads per block unless the call says otherwise
SIM_THREADS = 32
_SIM_THREADS_OK = (
    "bias_add",
    "bias_gelu_forward",
    "split_heads",
    "merge_heads",
    "colsum_convert",
    "gelu_backward",
    "gelu_forward",
    "adamw_step",
    "encoder_backward",
    "f32_to_bf16",
    "f32_to_f16",
)
# the launchers a block and an optimizer step use (toolbox() lists them first)
TOOLBOX = (
    "layernorm_forward",
    "layernorm_backward",
    "split_heads",
    "merge_heads",
    "attention_softmax_forward",
    "attention_softmax_backward",
    "bias_add",
    "bias_gelu_forward",
    "gelu_backward",
    "colsum_convert",
    "grad_sumsq",
    "adamw_step",
)


class Launchers:
    """eng.K: the backend's launcher module, with the engine's default kernel version filled in where a launcher
    takes version= and the call leaves it out (the simulator runs the one-thread-per-row versions, far fewer
    simulated threads there; a GPU the fastest ones). simulator=True: the launchers of _SIM_THREADS_OK get threads=SIM_THREADS unless
    the call passes threads (a block of 256 simulated threads runs 256 threads in Python, most of them idle at the
    simulator's sizes)."""

    def __init__(self, module, versions: dict, simulator=False):
        self._module, self._versions, self._simulator = module, dict(versions), bool(simulator)

    def __getattr__(self, name):
        fn = getattr(self._module, name)
        if not callable(fn) or name.startswith("_"):
            return fn
        key = _VERSION_KEYS.get(name)
        version = self._versions.get(key) if key is not None else None
        threads = SIM_THREADS if self._simulator and name in _SIM_THREADS_OK else None
        if version is None and threads is None:
            return fn

        def launcher(*args, **kwargs):
            if version is not None:
                kwargs.setdefault("version", version)
            if threads is not None:
                kwargs.setdefault("threads", threads)
            return fn(*args, **kwargs)

        launcher.__name__, launcher.__doc__, launcher.__wrapped__ = name, fn.__doc__, fn
        return launcher

    def __dir__(self):
        return sorted(set(getattr(self._module, "__all__", dir(self._module))))

    def __repr__(self):
        return f"<launchers of {self._module.__name__}>"


def _unset(what):
    def missing(*args, **kwargs):
        raise NotImplementedError(f"CapstoneEngine: no {what} function was given")

    missing.__name__ = what
    return missing


class CapstoneEngine(GPUEngine):
    """The course's GPU engine (fp32) with block_forward, block_backward and optimizer_step supplied by you.

    backend: "auto" (hip on a GPU, numba in the CUDA simulator), "hip" or "numba". loss_scale: the static factor the
    backward multiplies the loss's gradient by (train_step passes it to backward and to your optimizer_step, which
    must divide it out). Everything else is GPUEngine's (see gpullm_lessons.engine and this module's docstring)."""

    def __init__(
        self,
        cfg: GPTConfig,
        block_forward=None,
        block_backward=None,
        optimizer_step=None,
        backend="auto",
        seed=0,
        loss_scale=1.0,
        betas=BETAS,
        eps=EPS,
    ):
        from .. import device

        if backend == "auto":
            backend = "hip" if device.has_gpu() else "numba"
        if backend not in ("hip", "numba"):
            raise EngineError(
                f"CapstoneEngine: backend must be 'auto', 'hip' or 'numba' (the kernel backends), got "
                f"{backend!r}; the NumPy reference is engine.build(cfg, 'numpy')"
            )
        backend = check_backend(backend)
        for what, fn in (
            ("block_forward", block_forward),
            ("block_backward", block_backward),
            ("optimizer_step", optimizer_step),
        ):
            if fn is not None and not callable(fn):
                raise TypeError(f"CapstoneEngine({what}=...): pass your function itself, got {type(fn).__name__}")
        if (
            isinstance(loss_scale, bool)
            or not isinstance(loss_scale, (int, float, np.floating))
            or not np.isfinite(loss_scale)
            or loss_scale <= 0
        ):
            raise ValueError(f"CapstoneEngine: loss_scale must be a finite number > 0, got {loss_scale!r}")
        super().__init__(cfg, backend, "fp32", "none", seed, betas, eps, versions=None, graphs="off")
        self.K = Launchers(self.K, self.ver, simulator=not self.on_gpu)
        self.block_forward_fn = block_forward or _unset("block_forward")
        self.block_backward_fn = block_backward or _unset("block_backward")
        self.optimizer_step_fn = optimizer_step or _unset("optimizer_step")
        self.loss_scale = float(loss_scale)

    # ---- the toolbox ------------------------------------------------------------------------------------------
    def gemm(self, a, b, out, trans_a=False, trans_b=False, alpha=1.0, beta=0.0):
        """out = alpha * op(a) @ op(b) + beta * out (gpullm_lessons.runtime.blas.gemm, fp32); returns out."""
        return self._gemm(a, b, out, trans_a, trans_b, alpha, beta)

    # ---- the parts you write --------------------------------------------------------------------------------------
    def _block_forward(self, x, l, B, T, keep):
        return self.block_forward_fn(self, x, l, B, T)

    def _block_backward(self, dx, c, l, B, T):
        return self.block_backward_fn(self, dx, c, l, B, T)

    def optimizer_step(self, lr, weight_decay=0.0, grad_clip=0.0, grad_norm=None) -> dict:
        """Your optimizer_step(eng, lr, weight_decay, grad_clip, loss_scale) after backward(loss_scale=loss_scale)."""
        if grad_norm is not None:
            raise EngineError(
                "CapstoneEngine.optimizer_step computes the gradient norm itself (your optimizer_step); "
                "grad_norm= is for the data-parallel engine of lesson 10"
            )
        norm = self.optimizer_step_fn(self, lr, weight_decay, grad_clip, self.loss_scale)
        return {"grad_norm": float(norm), "skipped": False}

    def train_step(self, x, y, lr, weight_decay=0.0, grad_clip=0.0) -> dict:
        """Forward (your block_forward per layer), backward with self.loss_scale (your block_backward per layer, in
        reverse), your optimizer_step."""
        loss = self.forward(x, y)[1]
        self.backward(loss_scale=self.loss_scale)
        return {"loss": loss, **self.optimizer_step(lr, weight_decay, grad_clip)}


def toolbox(eng=None) -> str:
    """The launchers a block and an optimizer step use, one per line with its signature and what it does (the first
    line of its docstring), then gemm. eng: an engine (its backend), or None for the one this machine would use."""
    from .. import device

    if eng is None:
        if device.has_gpu():
            from ..backends import hip as module
        else:
            from ..backends import numba as module
    else:
        K = eng.K
        module = getattr(K, "_module", K)
    lines = [f"launchers of {module.__name__} (eng.K.<name>):"]
    for name in TOOLBOX:
        fn = getattr(module, name, None)
        if fn is None:
            continue
        doc = (inspect.getdoc(fn) or "").split("\n")[0]
        lines.append(f"  {name}{inspect.signature(fn)}")
        if doc:
            lines.append(f"      {doc}")
    lines.append("  eng.gemm(a, b, out, trans_a=False, trans_b=False, alpha=1.0, beta=0.0)")
    lines.append("      out = alpha * op(a) @ op(b) + beta * out (blas.gemm, fp32; 2-D, or 3-D batched)")
    return "\n".join(lines)
