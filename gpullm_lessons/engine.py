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
products go through cuBLAS / hipBLAS (gpullm_lessons.blas.gemm), as lesson 02 concludes; everything else is the
course's own kernels: LayerNorm forward/backward, GELU forward/backward, causal softmax forward/backward, the
fused softmax + cross-entropy, the embedding backward, the fused AdamW and the precision kernels, and the glue
kernels between the products (kernels/hip/fused.cu: bias + residual, bias + GELU, head split / merge, bias gradient
+ half copy, LayerNorm with a half output). The only CuPy elementwise operations inside a block are the two
residual-gradient additions of the backward (dx1 += dx, dx0 += dx1 in _block_backward).

CUDA graphs (hip backend, fp32 / bf16, on by default): train_step captures the whole step once per batch shape and
replays it (_StepGraph); see GPUEngine.train_step.

Memory layout (DESIGN.md §3): parameters, gradients, m and v are flat fp32 buffers with named views
(params.ParamBuffer); the optimizer is one fused AdamW launch over the whole buffer.

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

Activation checkpointing (policy, as checkpointing.py): "none" keeps every block's cache; "selective" drops the
LayerNorm outputs and the GELU output and recomputes them (one LayerNorm forward / one GELU forward) in backward;
"full" keeps only each block's input and reruns the block's forward just before its backward.

One training step: forward (loss), backward (every gradient written, none accumulated), the global gradient norm
(one reduction over the flat gradient buffer), clipping and 1/loss-scale folded into AdamW's grad_scale, AdamW.
"""
from __future__ import annotations

import math

import numpy as np

from .optim import clip_coefficient
from .params import GPTConfig, ParamBuffer, init_params, num_params
from .profiling import nvtx_range

BACKENDS = ("numpy", "numba", "hip")
PRECISIONS = ("fp32", "bf16", "fp16")
POLICIES = ("none", "selective", "full")
GRAPH_PRECISIONS = ("fp32", "bf16")   # train_step replayed as a CUDA graph (fp16's overflow skip is a host decision)
BETAS = (0.9, 0.95)
EPS = 1e-8


class EngineError(ValueError):
    """A backend / precision / policy / machine combination that cannot run; the message names the problem."""


def check_backend(backend: str) -> str:
    """The backend name to use ("auto": hip on a GPU, else numpy); raises EngineError when the machine lacks it."""
    from . import device

    if backend == "auto":
        return "hip" if device.has_gpu() and _has_cupy() else "numpy"
    if backend not in BACKENDS:
        raise EngineError(f"unknown backend {backend!r}: choose one of auto, {', '.join(BACKENDS)}")
    if backend == "hip":
        if not device.has_gpu():
            raise EngineError(f"backend 'hip' needs a GPU and this machine has none ({device.describe()}); "
                              f"use --backend numpy (or numba, in the CUDA simulator, for tiny models)")
        if not _has_cupy():
            raise EngineError("backend 'hip' launches its kernels through CuPy, which is not installed: "
                              "make setup GPU=cuda13 (or cuda12 / rocm)")
    if backend == "numba" and device.kind() == "rocm":
        raise EngineError("backend 'numba' needs an NVIDIA GPU or the CUDA simulator: Numba CUDA does not run on "
                          "AMD GPUs; use --backend hip (the same kernels' HIP twins)")
    if backend == "numba" and not device.has_gpu() and not device.numba_available():
        raise EngineError(f"backend 'numba' needs a GPU or the CUDA simulator, and this machine has neither "
                          f"({device.describe()}); unset NUMBA_ENABLE_CUDASIM=0 or use --backend numpy")
    if backend == "numba" and device.has_gpu() and not _has_cupy():
        raise EngineError("backend 'numba' on a GPU keeps its arrays in CuPy, which is not installed: "
                          "make setup GPU=cuda13 (or cuda12 / rocm)")
    return backend


def _has_cupy() -> bool:
    try:
        import cupy  # noqa: F401
    except Exception:
        return False
    return True


def build(cfg: GPTConfig, backend="auto", precision="fp32", policy="none", seed=0, betas=BETAS, eps=EPS,
          versions=None, graphs="auto"):
    """An engine for cfg on `backend` (see the module docstring), initialised with init_params(cfg, seed).

    graphs: "auto" (CUDA graphs for train_step where they apply: backend hip on a GPU, fp32 or bf16), "off", or "on"
    (EngineError where they cannot apply). See GPUEngine.train_step."""
    backend = check_backend(backend)
    if precision not in PRECISIONS:
        raise EngineError(f"unknown precision {precision!r}: choose one of {', '.join(PRECISIONS)}")
    if policy not in POLICIES:
        raise EngineError(f"unknown checkpointing policy {policy!r}: choose one of {', '.join(POLICIES)}")
    if graphs not in ("auto", "on", "off", True, False):
        raise EngineError(f"graphs must be 'auto', 'on' or 'off', got {graphs!r}")
    graphs = {True: "on", False: "off"}.get(graphs, graphs)
    if graphs == "on" and not (backend == "hip" and precision in GRAPH_PRECISIONS):
        raise EngineError(f"graphs='on': CUDA graphs replay the hip backend's step in {' or '.join(GRAPH_PRECISIONS)} "
                          f"(fp16 decides on the host whether to skip a step); got backend {backend!r}, "
                          f"precision {precision!r}")
    if backend == "numpy":
        if precision != "fp32":
            raise EngineError(f"precision {precision!r} needs a kernel backend (--backend hip or numba); the NumPy "
                              f"reference trains in fp32 (lesson 07 emulates half-precision matmuls on the CPU)")
        return NumpyEngine(cfg, policy, seed, betas, eps)
    return GPUEngine(cfg, backend, precision, policy, seed, betas, eps, versions,
                     graphs=graphs if backend == "hip" and precision in GRAPH_PRECISIONS else "off")


class Engine:
    """What every backend provides. Buffers: params (ParamBuffer, fp32 master), grads, m, v (flat); t = steps taken."""

    backend = "?"

    def __init__(self, cfg, precision, policy, seed, betas, eps):
        if not isinstance(cfg, GPTConfig):
            raise TypeError(f"engine: cfg must be a GPTConfig, got {type(cfg).__name__}")
        self.cfg, self.precision, self.policy, self.seed = cfg, precision, policy, seed
        self.betas, self.eps = tuple(float(b) for b in betas), float(eps)
        self.t = 0
        self.scaler = None

    # ---- checks shared by all backends --------------------------------------------------------------------------
    def _check_batch(self, fn, x, y=None):
        x = np.asarray(x)
        if x.ndim != 2 or x.shape[0] < 1 or x.shape[1] < 1:
            raise ValueError(f"{fn}: x must be a (B, T) array of token ids, got shape {x.shape}")
        if x.shape[1] > self.cfg.block_size:
            raise ValueError(f"{fn}: sequence length T={x.shape[1]} is longer than block_size={self.cfg.block_size}")
        if not np.issubdtype(x.dtype, np.integer):
            raise TypeError(f"{fn}: x must hold integer token ids, got dtype {x.dtype}")
        if x.size and (x.min() < 0 or x.max() >= self.cfg.vocab_size):
            raise ValueError(f"{fn}: token ids must be in [0, {self.cfg.vocab_size}), got {x.min()}..{x.max()}")
        if y is not None:
            y = np.asarray(y)
            if y.shape != x.shape:
                raise ValueError(f"{fn}: targets y {y.shape} must have the shape of x {x.shape}")
            if y.size and (y.min() < 0 or y.max() >= self.cfg.vocab_size):
                raise ValueError(f"{fn}: targets must be in [0, {self.cfg.vocab_size}), got {y.min()}..{y.max()}")
            y = y.astype(np.int32)
        return x.astype(np.int32), y

    # ---- state ----------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Host copies of everything a resumed run needs: params, m, v (flat fp32), t, the loss scaler."""
        out = {"params": self._host(self.params.flat), "m": self._host(self.m), "v": self._host(self.v),
               "t": self.t, "precision": self.precision}
        if self.scaler is not None:
            out["scaler"] = self.scaler.state_dict()
        return out

    def load_state_dict(self, state: dict) -> None:
        n = num_params(self.cfg)
        for key in ("params", "m", "v"):
            if key not in state:
                raise ValueError(f"load_state_dict: the state has no {key!r}")
            if np.asarray(state[key]).shape != (n,):
                raise ValueError(f"load_state_dict: {key} has shape {np.asarray(state[key]).shape}, this model "
                                 f"needs ({n},): the checkpoint is from a different model config")
        self.params.flat[...] = self._dev(np.asarray(state["params"], np.float32))
        self.m[...] = self._dev(np.asarray(state["m"], np.float32))
        self.v[...] = self._dev(np.asarray(state["v"], np.float32))
        self.t = int(state["t"])
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
        self.params_changed()

    def _host(self, a):
        return np.array(a, dtype=np.float32, copy=True)

    def _dev(self, a):
        return a

    def params_changed(self):
        """Call after writing self.params.flat from outside (a load, a broadcast, an all-gather): the engine refreshes
        what it derives from the fp32 master weights (the half copy)."""

    # ---- the optimizer update: one policy for the whole buffer, the graph step, data parallel and a ZeRO shard ------
    def optimizer_state(self) -> "OptimizerShard":
        """The whole flat buffer as the one shard optimizer_step updates."""
        return OptimizerShard(self.params.flat, self.grads.flat, self.m, self.v, self.decay, half=self._half_copy())

    def optimizer_shard(self, lo: int, hi: int, params, grads) -> "OptimizerShard":
        """AdamW over elements [lo, hi) of a buffer padded with zeros past the n parameters (ZeRO-1: one rank's shard).

        params, grads: the caller's views of that slice (params a view into the padded parameter storage, so the
        update lands there); m and v start from this engine's moments over the slice (zero in the padding), so a
        loaded checkpoint carries over; the decay rule is the slice's (no decay in the padding)."""
        n = num_params(self.cfg)
        xp = getattr(self, "xp", np)
        m, v = xp.zeros(hi - lo, xp.float32), xp.zeros(hi - lo, xp.float32)
        top = max(lo, min(hi, n))
        if self.m.size == n:
            m[:top - lo], v[:top - lo] = self.m[lo:top], self.v[lo:top]
        return OptimizerShard(params, grads, m, v, self._decay_of(lo, hi))

    def release_optimizer_state(self) -> None:
        """Drop the full-size m and v (ZeRO: each rank keeps only its shard's); state_dict then has none of them."""
        xp = getattr(self, "xp", np)
        self.m = self.v = xp.zeros(0, xp.float32)

    def update(self, lr, weight_decay, grad_clip, sumsq, nonfinite=0, shard=None) -> dict:
        """After backward(loss_scale=S): the step's policy, then AdamW over `shard` (default: the whole buffer).

        sumsq: the squared norm of the (scaled) gradient, over the whole model (data parallel: summed over the ranks'
        shards); nonfinite: how many of its values are inf/NaN (fp16 only: a step with any is skipped and the loss
        scale backs off; the scaler's decision must be the same on every rank, so the caller passes the global
        count). Then the clip factor (optim.clip_coefficient of the unscaled norm) and 1/S are folded into one
        grad_scale that AdamW applies as it reads the gradient. Returns {"grad_norm" (unscaled), "skipped", "scale"
        (fp16)}."""
        st = self.optimizer_state() if shard is None else shard
        scale = self.scaler.scale if self.scaler is not None else 1.0
        out = {"scale": scale} if self.scaler is not None else {}
        if self.scaler is not None and self.scaler.update(nonfinite > 0):
            st.grads[...] = 0
            return {"grad_norm": float("nan"), "skipped": True, **out}
        norm = math.sqrt(max(float(sumsq), 0.0)) / scale
        coef = clip_coefficient(norm, grad_clip)
        self.t += 1
        self._adamw(st, lr, weight_decay, float(np.float32(coef) / np.float32(scale)) if scale != 1.0 else float(coef))
        return {"grad_norm": norm, "skipped": False, **out}

    def optimizer_step(self, lr, weight_decay=0.0, grad_clip=0.0, grad_norm=None) -> dict:
        """After backward(loss_scale=self.scaler.scale or 1): update() with this engine's own gradient norm (or
        `grad_norm`, the scaled buffer's, when the caller already computed it: lesson 09's loop prints it) and
        non-finite count. Returns {"grad_norm" (unscaled), "skipped", "scale" (fp16)}."""
        bad = self.count_nonfinite() if self.scaler is not None else 0
        sumsq = self.grad_sumsq() if grad_norm is None else float(grad_norm) ** 2
        return self.update(lr, weight_decay, grad_clip, sumsq, bad)

    def grad_norm(self) -> float:
        """The global L2 norm of the flat gradient buffer."""
        return math.sqrt(self.grad_sumsq())

    def _half_copy(self):
        return None


class OptimizerShard:
    """What one AdamW update runs over: flat params, grads, m and v of the same elements, and their decay rule
    (the NumPy engine: a boolean mask; the kernel engines: the fused kernels' (bounds, flags) table); half: the
    half copy of the weights the update also writes (the whole buffer in half precision), else None."""

    def __init__(self, params, grads, m, v, decay, half=None):
        self.params, self.grads, self.m, self.v, self.decay, self.half = params, grads, m, v, decay, half


class NumpyEngine(Engine):
    """The NumPy reference on the CPU (fp32)."""

    backend = "numpy"

    def __init__(self, cfg, policy, seed, betas, eps):
        from .optim import decay_mask_for

        super().__init__(cfg, "fp32", policy, seed, betas, eps)
        self.params = init_params(cfg, seed=seed, dtype=np.float32)
        self.grads = ParamBuffer(cfg, dtype=np.float32)
        n = num_params(cfg)
        self.m, self.v = np.zeros(n, np.float32), np.zeros(n, np.float32)   # AdamW's moments (optim.AdamW's)
        self.decay = decay_mask_for(cfg)                                      # True where weight decay applies

    def forward(self, x, y=None):
        from .checkpointing import gpt_forward_ckpt

        x, y = self._check_batch("forward", x, y)
        logits, loss, self._cache = gpt_forward_ckpt(self.params.views, self.cfg, x, y, policy=self.policy)
        return logits, (float(loss) if loss is not None else None)

    def backward(self, loss_scale=1.0):
        from .checkpointing import gpt_backward_ckpt

        gpt_backward_ckpt(self._cache, self.grads.views)
        if loss_scale != 1.0:
            self.grads.flat *= np.float32(loss_scale)
        self._cache = None

    def train_step(self, x, y, lr, weight_decay=0.0, grad_clip=0.0, reduce_grads=None) -> dict:
        """Forward, backward, reduce_grads(grads_flat) if given (data parallel: the mean over ranks), clip, AdamW."""
        loss = self.forward(x, y)[1]      # the logits are not kept: (B, T, V) would stay alive through backward
        self.backward()
        if reduce_grads is not None:
            reduce_grads(self.grads.flat)
        return {"loss": loss, **self.optimizer_step(lr, weight_decay, grad_clip)}

    def grad_sumsq(self, g=None) -> float:
        """The squared L2 norm of `g` (default: the whole gradient buffer), summed in float64."""
        g = self.grads.flat if g is None else g
        return float(np.sum(np.square(g, dtype=np.float64)))

    def count_nonfinite(self, g=None) -> int:
        return int(np.count_nonzero(~np.isfinite(self.grads.flat if g is None else g)))

    def _decay_of(self, lo, hi):
        mask = np.zeros(hi - lo, bool)
        top = max(lo, min(hi, self.decay.size))
        mask[:top - lo] = self.decay[lo:top]
        return mask

    def _adamw(self, st, lr, weight_decay, grad_scale):
        from .optim import adamw_update

        if grad_scale != 1.0:                              # the clip factor, applied to the gradient (as the kernels do)
            st.grads *= np.float32(grad_scale)
        adamw_update(st.params, st.grads, st.m, st.v, self.t, lr, self.betas, self.eps, float(weight_decay), st.decay)

    def eval_loss(self, x, y) -> float:
        from .reference import gpt_forward

        x, y = self._check_batch("eval_loss", x, y)
        return float(gpt_forward(self.params.views, self.cfg, x, y)[1])

    def next_logits(self, context) -> np.ndarray:
        from .reference import gpt_forward

        x, _ = self._check_batch("next_logits", np.asarray(context)[None, :])
        return gpt_forward(self.params.views, self.cfg, x, None)[0][0, -1].astype(np.float64)


class OpProfiler:
    """Time every launcher call and matrix product of a GPUEngine: CUDA events on a GPU, wall clock in the simulator.

    eng.enable_profiling(); eng.train_step(...); rows = eng.profiler.report()  -> per op: calls, ms, share of the
    step. What no event covers (CuPy's own elementwise kernels, copies, Python between launches) is the row
    "other (CuPy ops, copies, Python)" = wall time of the profiled steps minus the sum of the timed ops.
    """

    def __init__(self, on_gpu):
        self.on_gpu = on_gpu
        self.records = []          # (name, start, stop): events or perf_counter floats
        self.wall = 0.0

    def wrap(self, name, fn):
        import time

        def timed(*args, **kwargs):
            if self.on_gpu:
                import cupy as cp
                start, stop = cp.cuda.Event(), cp.cuda.Event()
                start.record()
                out = fn(*args, **kwargs)
                stop.record()
            else:
                start = time.perf_counter()
                out = fn(*args, **kwargs)
                stop = time.perf_counter()
            self.records.append((name, start, stop))
            return out
        return timed

    def step(self, fn, *args, **kwargs):
        """Run fn (e.g. eng.train_step) and add its wall time (synchronised on a GPU)."""
        import time

        if self.on_gpu:
            import cupy as cp
            cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        if self.on_gpu:
            cp.cuda.Device().synchronize()
        self.wall += time.perf_counter() - t0
        return out

    def report(self) -> list:
        """[{"op", "calls", "ms", "share"}] sorted by time, plus the "other" row; ms summed over the profiled steps."""
        totals, calls = {}, {}
        for name, start, stop in self.records:
            if self.on_gpu:
                import cupy as cp
                stop.synchronize()
                ms = cp.cuda.get_elapsed_time(start, stop)
            else:
                ms = 1e3 * (stop - start)
            totals[name] = totals.get(name, 0.0) + ms
            calls[name] = calls.get(name, 0) + 1
        wall_ms = 1e3 * self.wall
        rows = [{"op": k, "calls": calls[k], "ms": v} for k, v in sorted(totals.items(), key=lambda kv: -kv[1])]
        if wall_ms:
            rows.append({"op": "other (CuPy ops, copies, Python)", "calls": 0,
                         "ms": max(wall_ms - sum(totals.values()), 0.0)})
        for r in rows:
            r["share"] = r["ms"] / wall_ms if wall_ms else float("nan")
        return rows


class _TimedLaunchers:
    """The launcher module with every call timed by an OpProfiler."""

    def __init__(self, module, profiler):
        self._module, self._profiler = module, profiler

    def __getattr__(self, name):
        fn = getattr(self._module, name)
        return self._profiler.wrap(name, fn) if callable(fn) else fn


class GPUEngine(Engine):
    """The course's kernels (backend "hip" or "numba") composed into the GPT; see the module docstring."""

    # the kernel version each op runs with (the fastest simulator-safe one for numba, the fastest for hip);
    # "scores": the format of the attention scores and their gradient between cuBLAS and the softmax kernels in a
    # half-precision run: "half" (cuBLAS rounds them to the run's half format: half the bytes of the largest
    # activation; GPT-2 bf16 on the H200: 64.2 -> 60.6 ms per step) or "f32" (fp32 products, as before 2026-11-30)
    DEFAULT_VERSIONS = {
        "hip": {"layernorm_forward": "v2", "layernorm_backward": "v5", "gelu": "v1", "crossentropy": "v2",
                "encoder": "v3", "adamw": "v3", "convert": "v1", "scores": "half"},
        "numba": {"layernorm_forward": "v2", "layernorm_backward": "v2", "gelu": "v1", "crossentropy": "v2",
                  "encoder": "v2", "adamw": "v2", "convert": "v1", "scores": "half"},
        # the CUDA simulator runs one Python thread per CUDA thread and makes every barrier expensive: the
        # one-thread-per-row versions are ~50x faster there than the block-per-row ones
        "numba-sim": {"layernorm_forward": "v1", "layernorm_backward": "v1", "gelu": "v1", "crossentropy": "v2",
                      "encoder": "v2", "adamw": "v2", "convert": "v1", "scores": "half"},
    }

    def __init__(self, cfg, backend, precision, policy, seed, betas, eps, versions=None, graphs="off"):
        from . import device

        super().__init__(cfg, precision, policy, seed, betas, eps)
        self.backend = backend
        if backend == "hip":
            from .backends import hip as K
        else:
            from .backends import numba as K
        self.K = K
        self.on_gpu = device.has_gpu()
        if self.on_gpu:
            import cupy as xp
        else:
            xp = np                      # numba in the CUDA simulator: NumPy arrays
        self.xp = xp
        self.ver = dict(self.DEFAULT_VERSIONS[backend if self.on_gpu else "numba-sim"])
        if versions:
            unknown = set(versions) - set(self.ver)
            if unknown:
                raise EngineError(f"versions: unknown op(s) {sorted(unknown)}; known: {sorted(self.ver)}")
            self.ver.update(versions)
        if self.ver["scores"] not in ("f32", "half"):
            raise EngineError(f"versions: scores must be 'f32' or 'half', got {self.ver['scores']!r}")
        if backend == "hip" and self.ver["adamw"] == "v3" and num_params(cfg) % 4:
            self.ver["adamw"] = "v2"     # v3 reads float4: the buffer length must be a multiple of 4
        host = init_params(cfg, seed=seed, dtype=np.float32)
        self.params = ParamBuffer(cfg, np.float32, xp)
        self.params.flat[...] = xp.asarray(host.flat)
        self.grads = ParamBuffer(cfg, np.float32, xp)
        n = num_params(cfg)
        self.m, self.v = xp.zeros(n, xp.float32), xp.zeros(n, xp.float32)
        from .kernels.numba.adamw import decay_table

        self.decay = decay_table(self.params, arrays="cupy" if self.on_gpu else "numpy")
        self.fmt = precision                                           # gemm input format
        self.half = None
        if precision != "fp32":
            self.half = xp.zeros(n, xp.uint16)                         # the half copy of the weights (bits)
            self.half_views = {k: self.half[a:b].reshape(self.params.shapes[k])
                               for k, (a, b) in self.params.offsets.items()}
            self.params_changed()
        if precision == "fp16":
            from .precision import DynamicLossScaler

            self.scaler = DynamicLossScaler()
        self._count = xp.zeros(1, xp.int32)
        self._sumsq = xp.zeros(1, xp.float32)                         # the squared gradient norm (grad_sumsq)
        self._cache = None
        self.profiler = None
        # train_step replays a CUDA graph ("auto" | "on" | "off", build() passes "off" where graphs cannot apply):
        # it needs AdamW's float4 kernel (n % 4 == 0) and an embedding backward without host work (v2 sorts the
        # tokens on the host: a graph would replay the capture batch's order; v3, the hip default, does not)
        why_not = ("the parameter count is not a multiple of 4 (AdamW's float4 kernel)" if n % 4 else
                   "embedding backward v2 sorts tokens on the host" if self.ver["encoder"] == "v2" else None)
        if graphs == "on" and why_not:
            raise EngineError(f"graphs='on': this engine's step cannot be captured: {why_not}")
        self.graphs = graphs in ("auto", "on") and self.on_gpu and why_not is None
        self._graphs = {}                                              # (B, T, split) -> _StepGraph
        self._graphs_required = graphs == "on"

    # ---- helpers ----------------------------------------------------------------------------------------------
    def _host(self, a):
        return np.array(self.xp.asnumpy(a) if self.on_gpu else a, dtype=np.float32, copy=True)

    def _dev(self, a):
        return self.xp.asarray(a)

    def params_changed(self):
        """Refresh the half copy of the weights from the fp32 master (after init, a load, a broadcast, a gather)."""
        if self.half is not None:
            self._to_half(self.params.flat, self.half)

    def _to_half(self, src, dst=None):
        """src float32 (contiguous) -> its half bits (uint16, same shape) through our conversion kernels."""
        xp = self.xp
        src = xp.ascontiguousarray(src)
        if dst is None:
            dst = xp.empty(src.shape, xp.uint16)
        fn = self.K.f32_to_bf16 if self.precision == "bf16" else self.K.f32_to_f16
        fn(src.reshape(-1), dst.reshape(-1), version=self.ver["convert"])
        return dst

    def _w(self, name, l=None):
        """A weight in the gemm format (fp32 master view, or the half copy's view)."""
        src = self.params.views if self.half is None else self.half_views
        return src[name] if l is None else src[name][l]

    def enable_profiling(self) -> OpProfiler:
        """Time every launcher and matrix product from now on (see OpProfiler); returns the profiler."""
        self.profiler = OpProfiler(self.on_gpu)
        self.K = _TimedLaunchers(self.K if not isinstance(self.K, _TimedLaunchers) else self.K._module, self.profiler)
        return self.profiler

    def _gemm(self, a, b, out, trans_a=False, trans_b=False, alpha=1.0, beta=0.0):
        from .blas import gemm

        fmt = self.fmt
        if fmt == "fp16":
            a, b = a.view(self.xp.float16), b.view(self.xp.float16)
        if self.profiler is not None:
            return self.profiler.wrap(f"gemm {fmt} (cuBLAS)", gemm)(a, b, out, trans_a, trans_b, alpha, beta, fmt)
        return gemm(a, b, out, trans_a, trans_b, alpha, beta, fmt)

    @property
    def _half(self):
        """The fused kernels' output format: None (float32) or "bf16" / "fp16" (uint16 bits)."""
        return None if self.half is None else self.precision

    def _mm_empty(self, shape):
        """An uninitialised matmul input in the run's format (float32, or uint16 half bits)."""
        return self.xp.empty(shape, self.xp.float32 if self.half is None else self.xp.uint16)

    def _matmul(self, inp_mm, name_w, l, out_features):
        """(N, C_in) matmul input -> (N, C_out) fp32 = inp @ W (the bias is added by the fused kernel after it)."""
        out = self.xp.empty((inp_mm.shape[0], out_features), self.xp.float32)
        self._gemm(inp_mm, self._w(name_w, l), out)
        return out

    def _linear_backward(self, dout, inp_mm, name_w, name_b, l, in_features):
        """dout (N, C_out) fp32 -> dinp (N, C_in) fp32; writes grads[name_w][l] and grads[name_b][l].

        One fused pass over dout (colsum_convert) gives the bias gradient (its column sums, deterministic) and the
        half copy the two products read."""
        xp = self.xp
        if self.half is None:
            self.K.colsum_convert(dout, self.grads[name_b][l])
            dout_mm = dout
        else:
            dout_mm = self._mm_empty(dout.shape)
            self.K.colsum_convert(dout, self.grads[name_b][l], out=dout_mm, half=self._half)
        dinp = xp.empty((dout.shape[0], in_features), xp.float32)
        self._gemm(dout_mm, self._w(name_w, l), dinp, trans_b=True)       # dinp = dout @ W.T
        self._gemm(inp_mm, dout_mm, self.grads[name_w][l], trans_a=True)  # dW = inp.T @ dout
        return dinp

    def _layernorm(self, x, name_w, name_b, l):
        """LayerNorm of x (N, C) fp32 -> (out in the matmul format, mean, rstd): fp32 runs write float32, half
        precision runs write the half bits directly (layernorm_forward_half: no fp32 copy, no conversion pass)."""
        xp, N = self.xp, x.shape[0]
        C = self.cfg.d_model
        w = self.params[name_w] if l is None else self.params[name_w][l]
        b = self.params[name_b] if l is None else self.params[name_b][l]
        out, mean, rstd = self._mm_empty((N, C)), xp.empty(N, xp.float32), xp.empty(N, xp.float32)
        if self.half is None:
            self.K.layernorm_forward(x, w, b, out, mean, rstd, version=self.ver["layernorm_forward"])
        else:
            self.K.layernorm_forward_half(x, w, b, out, mean, rstd, half=self._half)
        return out, mean, rstd

    def _layernorm_backward(self, dout, x, mean, rstd, name_w, name_b, l):
        xp = self.xp
        w = self.params[name_w] if l is None else self.params[name_w][l]
        dw = self.grads[name_w] if l is None else self.grads[name_w][l]
        db = self.grads[name_b] if l is None else self.grads[name_b][l]
        dx = xp.empty_like(x)
        self.K.layernorm_backward(dout, x, w, mean, rstd, dx, dw, db, version=self.ver["layernorm_backward"])
        return dx

    def _gelu_mm(self, fc):
        """GELU of fc (N, 4C) fp32 (bias already in) -> the matmul input (bias_gelu_forward with a zero bias)."""
        zero = self._zeros(fc.shape[1])
        out = self._mm_empty(fc.shape)
        self.K.bias_gelu_forward(fc, zero, fc, out, half=self._half)   # fc + 0 = fc: rewritten unchanged
        return out

    def _zeros(self, n):
        z = getattr(self, "_zero_vec", None)
        if z is None or z.shape[0] < n:
            z = self._zero_vec = self.xp.zeros(n, self.xp.float32)
        return z[:n]

    # ---- one block ----------------------------------------------------------------------------------------------
    def _block_forward(self, x, l, B, T, keep):
        """x (B*T, C) -> x_out, cache dict; keep: which policy decides what the cache holds.

        Between the matrix products only fused kernels run (kernels/hip/fused.cu and its Numba twin): LayerNorm
        writes the matmul input directly; split_heads adds the qkv bias while it moves q, k, v into (B*nh, T, hs)
        in the matmul format; the causal softmax writes the probabilities in the matmul format (half runs keep no
        fp32 copy: the softmax backward reads the half one); merge_heads brings the heads back; bias_add adds each
        projection's bias and the residual in one pass; bias_gelu_forward adds the fc bias (fc is kept for the GELU
        backward) and writes GELU's output in the matmul format."""
        xp, cfg = self.xp, self.cfg
        C, nh = cfg.d_model, cfg.n_head
        hs = C // nh
        half = self._half
        c = {"x": x}
        ln1_mm, c["mean1"], c["rstd1"] = self._layernorm(x, "ln1w", "ln1b", l)
        qkv = self._matmul(ln1_mm, "qkvw", l, 3 * C)                               # (B*T, 3C), no bias yet
        qkvb = self.params["qkvb"][l]
        q, k, v = (self._mm_empty((B * nh, T, hs)) for _ in range(3))
        for i, dst in enumerate((q, k, v)):
            self.K.split_heads(qkv, i * C, dst, B, T, nh, bias=qkvb[i * C:(i + 1) * C], half=half)
        del qkv
        half_scores = half is not None and self.ver["scores"] == "half"
        att = self._mm_empty((B * nh, T, T)) if half_scores else xp.empty((B * nh, T, T), xp.float32)
        self._gemm(q, k, att, trans_b=True)                                       # raw scores q @ k.T
        scale = 1.0 / math.sqrt(hs)
        if half is None:
            self.K.attention_softmax_forward(att.reshape(-1, T), att.reshape(-1, T), scale)
            att_mm = att
        else:
            att_mm = self._mm_empty((B * nh, T, T))
            self.K.attention_softmax_forward(att.reshape(-1, T), None, scale, att_half=att_mm.reshape(-1, T),
                                             half=half)
            del att
        y = xp.empty((B * nh, T, hs), xp.float32)
        self._gemm(att_mm, v, y)                                                  # att @ v
        atty_mm = self._mm_empty((B * T, C))
        self.K.merge_heads(y, atty_mm, 0, B, T, nh, half=half)
        del y
        x1 = self._matmul(atty_mm, "attprojw", l, C)
        self.K.bias_add(x1, self.params["attprojb"][l], x1, res=x)                # x1 = x + atty @ W + b
        ln2_mm, c["mean2"], c["rstd2"] = self._layernorm(x1, "ln2w", "ln2b", l)
        fc = self._matmul(ln2_mm, "fcw", l, 4 * C)
        gelu_mm = self._mm_empty(fc.shape)
        self.K.bias_gelu_forward(fc, self.params["fcb"][l], fc, gelu_mm, half=half)   # fc += b; gelu(fc)
        x2 = self._matmul(gelu_mm, "fcprojw", l, C)
        self.K.bias_add(x2, self.params["fcprojb"][l], x2, res=x1)                # x2 = x1 + gelu @ W + b
        if keep == "none":
            c.update(ln1_mm=ln1_mm, q=q, k=k, v=v, att_mm=att_mm, atty_mm=atty_mm, x1=x1, ln2_mm=ln2_mm, fc=fc,
                     gelu_mm=gelu_mm)
        elif keep == "selective":     # LayerNorm and GELU outputs are rebuilt in backward
            c.update(q=q, k=k, v=v, att_mm=att_mm, atty_mm=atty_mm, x1=x1, fc=fc)
        # "full": only x (the caller keeps it; the rest is recomputed)
        return x2, c

    def _rebuild(self, c, l):
        """Selective recompute: the LayerNorm outputs from x / x1 and the GELU output from fc."""
        c["ln1_mm"] = self._layernorm(c["x"], "ln1w", "ln1b", l)[0]
        c["ln2_mm"] = self._layernorm(c["x1"], "ln2w", "ln2b", l)[0]
        c["gelu_mm"] = self._gelu_mm(c["fc"])

    def _block_backward(self, dx, c, l, B, T):
        """d(block output) (B*T, C) -> d(block input); writes layer l's gradients.

        Temporaries are dropped (del) as soon as they are used up, so that the backward's working set stays one
        or two (B, T, 4C) tensors plus one (B, nh, T, T): engine_memory() counts the same live sets."""
        xp, cfg = self.xp, self.cfg
        C, nh = cfg.d_model, cfg.n_head
        hs = C // nh
        half = self._half
        # MLP: x2 = x1 + fcproj(gelu(fc(ln2(x1))))
        dgelu = self._linear_backward(dx, c["gelu_mm"], "fcprojw", "fcprojb", l, 4 * C)
        dfc = xp.empty_like(dgelu)
        self.K.gelu_backward(dgelu.reshape(-1), c["fc"].reshape(-1), dfc.reshape(-1), version=self.ver["gelu"])
        del dgelu
        dln2 = self._linear_backward(dfc, c["ln2_mm"], "fcw", "fcb", l, C)
        del dfc
        dx1 = self._layernorm_backward(dln2, c["x1"], c["mean2"], c["rstd2"], "ln2w", "ln2b", l)
        del dln2
        dx1 += dx
        # attention: x1 = x + attproj(attention(qkv(ln1(x))))
        datty = self._linear_backward(dx1, c["atty_mm"], "attprojw", "attprojb", l, C)
        dy = self._mm_empty((B * nh, T, hs))
        self.K.split_heads(datty, 0, dy, B, T, nh, half=half)                     # (B*nh, T, hs)
        del datty
        dv = xp.empty((B * nh, T, hs), xp.float32)
        self._gemm(c["att_mm"], dy, dv, trans_a=True)                             # dv = att.T @ dy
        half_scores = half is not None and self.ver["scores"] == "half"
        datt = self._mm_empty((B * nh, T, T)) if half_scores else xp.empty((B * nh, T, T), xp.float32)
        self._gemm(dy, c["v"], datt, trans_b=True)                                # datt = dy @ v.T
        del dy
        scale = 1.0 / math.sqrt(hs)
        if half is None:                                                          # dpre, in place, scale folded in
            self.K.attention_softmax_backward(c["att_mm"].reshape(-1, T), datt.reshape(-1, T), datt.reshape(-1, T),
                                              scale)
            dpre_mm = datt
        else:                                                                     # half probabilities in, half dpre out
            dpre_mm = self._mm_empty((B * nh, T, T))
            self.K.attention_softmax_backward(c["att_mm"].reshape(-1, T), datt.reshape(-1, T),
                                              dpre_mm.reshape(-1, T), scale, half=half)
        del datt
        dqkv = xp.empty((B * T, 3 * C), xp.float32)
        self.K.merge_heads(dv, dqkv, 2 * C, B, T, nh)
        del dv
        for i, (b, ta) in enumerate(((c["k"], False), (c["q"], True))):
            part = xp.empty((B * nh, T, hs), xp.float32)
            self._gemm(dpre_mm, b, part, trans_a=ta)                              # dq = dpre @ k, dk = dpre.T @ q
            self.K.merge_heads(part, dqkv, i * C, B, T, nh)
            del part
        del dpre_mm
        dln1 = self._linear_backward(dqkv, c["ln1_mm"], "qkvw", "qkvb", l, C)
        del dqkv
        dx0 = self._layernorm_backward(dln1, c["x"], c["mean1"], c["rstd1"], "ln1w", "ln1b", l)
        del dln1
        dx0 += dx1
        return dx0

    # ---- the model ----------------------------------------------------------------------------------------------
    def _embed(self, x):
        xp = self.xp
        B, T = x.shape
        idx = xp.asarray(x)
        return (self.params["wte"][idx] + self.params["wpe"][:T]).reshape(B * T, self.cfg.d_model), idx

    def forward(self, x, y=None):
        """Logits (B, T, V) fp32 and, with targets, the mean loss; keeps what backward needs (the policy's cache)."""
        x, y = self._check_batch("forward", x, y)
        return self._forward(x, y, keep=self.policy)

    def _forward(self, x, y, keep, device_loss=False):
        xp, cfg = self.xp, self.cfg
        B, T = x.shape
        V, C = cfg.vocab_size, cfg.d_model
        h, idx = self._embed(x)
        blocks = []
        for l in range(cfg.n_layer):
            x_in = h
            h, c = self._block_forward(h, l, B, T, "none" if keep == "none" else
                                       ("selective" if keep == "selective" else "full"))
            blocks.append(c if keep != "full" else {"x": x_in})
        lnf_mm, meanf, rstdf = self._layernorm(h, "lnfw", "lnfb", None)
        logits = xp.empty((B * T, V), xp.float32)
        self._gemm(lnf_mm, self._w("wte"), logits, trans_b=True)                  # tied head: lnf @ wte.T
        loss = None
        if y is not None:
            targets = xp.asarray(y).reshape(-1)
            losses = xp.empty(B * T, xp.float32)
            if self.precision == "bf16":     # dlogits written in bf16 by the loss kernel: the head products' input
                dlogits = xp.empty((B * T, V), xp.uint16)
                self.K.crossentropy_forward_backward_half(logits, targets, losses, dlogits, half="bf16")
            else:                            # fp32; fp16 scales dlogits by the loss scale before rounding (backward)
                dlogits = xp.empty_like(logits)
                self.K.crossentropy_forward_backward(logits, targets, losses, dlogits,
                                                     version=self.ver["crossentropy"])
            loss = losses.mean() if device_loss else float(losses.mean())
            self._cache = dict(B=B, T=T, idx=idx, blocks=blocks, h=h, meanf=meanf, rstdf=rstdf, lnf_mm=lnf_mm,
                               dlogits=dlogits)
        return logits.reshape(B, T, V), loss

    def backward(self, loss_scale=1.0):
        """Every gradient of the last forward's loss (times loss_scale) written into self.grads."""
        xp, cfg = self.xp, self.cfg
        c = self._cache
        if c is None:
            raise RuntimeError("backward: call forward(x, y) with targets first")
        self._cache = None
        B, T = c["B"], c["T"]
        dlogits = c["dlogits"]
        if self.precision == "fp16":      # scale before rounding to fp16: that is what keeps small values alive
            dl_mm = (dlogits * np.float32(loss_scale)).astype(xp.float16).view(xp.uint16)
            alpha = 1.0
        else:                             # fp32: dlogits itself; bf16: already bf16 bits
            dl_mm, alpha = dlogits, loss_scale
        del dlogits, c["dlogits"]
        dlnf = xp.empty((B * T, cfg.d_model), xp.float32)
        self._gemm(dl_mm, self._w("wte"), dlnf, alpha=alpha)                      # dlnf = dlogits @ wte
        self._gemm(dl_mm, c["lnf_mm"], self.grads["wte"], trans_a=True, alpha=alpha)  # dwte (head) = dlogits.T @ lnf
        del dl_mm
        dx = self._layernorm_backward(dlnf, c["h"], c["meanf"], c["rstdf"], "lnfw", "lnfb", None)
        for l in reversed(range(cfg.n_layer)):
            blk = c["blocks"][l]
            if self.policy == "full":
                blk = self._block_forward(blk["x"], l, B, T, "none")[1]    # the recomputed output is not kept
            elif self.policy == "selective":
                self._rebuild(blk, l)
            dx = self._block_backward(dx, blk, l, B, T)
            c["blocks"][l] = None                                                 # free the block's cache
            del blk                                                               # (before the next recompute)
        dwte_enc = xp.empty_like(self.grads["wte"])
        self.K.encoder_backward(dx.reshape(B, T, cfg.d_model), c["idx"], dwte_enc, self.grads["wpe"][:T],
                                version=self.ver["encoder"])
        if T < cfg.block_size:
            self.grads["wpe"][T:] = 0
        self.grads["wte"] += dwte_enc

    def grad_sumsq(self, g=None) -> float:
        """The squared L2 norm of `g` (default: the flat gradient buffer): one kernel over it (deterministic)."""
        self.K.grad_sumsq(self.grads.flat if g is None else g, self._sumsq)
        return float(self._sumsq[0])

    def count_nonfinite(self, g=None) -> int:
        """How many values of `g` (default: the gradient buffer) are inf or NaN: one pass (nonfinite_count)."""
        self.K.nonfinite_count(self.grads.flat if g is None else g, self._count)
        return int(self._count[0])

    def _half_copy(self):
        return self.half

    def _decay_of(self, lo, hi):
        from .arrays import to_backend
        from .kernels.numba.adamw import decay_table
        from .optim import shard_decay_table

        b, f = shard_decay_table(*decay_table(self.params, arrays="numpy"), lo, hi)
        where = "cupy" if self.on_gpu else "numpy"
        return to_backend(b, where), to_backend(f, where)

    def _adamw(self, st, lr, weight_decay, grad_scale):
        self.K.adamw_step(st.params, st.grads, st.m, st.v, lr, self.betas[0], self.betas[1], self.eps, weight_decay,
                          self.t, decay_bounds=st.decay, grad_scale=grad_scale, half_out=st.half,
                          half_dtype={"bf16": "bfloat16", "fp16": "float16"}.get(self.precision)
                          if st.half is not None else None, version=self.ver["adamw"])

    def _hyper(self, lr, weight_decay, grad_clip):
        """The graph step's update policy on the host: the step count advances and AdamW's scalars (lr, lr * wd, bias
        corrections, clip threshold) go to adamw_step_device through GPU memory (_StepGraph replays fixed launches)."""
        from .kernels.numba.adamw import adamw_hyper

        self.t += 1
        return adamw_hyper(lr, weight_decay, self.t, *self.betas, clip=float(grad_clip) if grad_clip > 0 else 0.0)

    def _update_on_device(self, hyper):
        """The update of _hyper's scalars, all on the GPU: the squared norm into _sumsq, the clip factor computed by
        AdamW from it (the same clip_coefficient), AdamW over the whole buffer (the graph step: fp32 / bf16, no scaler)."""
        st = self.optimizer_state()
        self.K.grad_sumsq(st.grads, self._sumsq)
        self.K.adamw_step_device(st.params, st.grads, st.m, st.v, hyper, self._sumsq, self.betas[0], self.betas[1],
                                 self.eps, decay_bounds=st.decay, half_out=st.half,
                                 half_dtype="bfloat16" if self.precision == "bf16" else None)

    def train_step(self, x, y, lr, weight_decay=0.0, grad_clip=0.0, reduce_grads=None) -> dict:
        """Forward, backward, clip, AdamW. fp16: a step with an inf/NaN gradient is skipped and the scale backs off.

        reduce_grads(grads_flat): called between backward and the update (data parallel: the all-reduce and the 1/N
        that turn this rank's gradient into the mean over ranks); the norm, clipping and AdamW then see its result.
        With graphs on (build(graphs=...)), the first step of each batch shape (B, T) captures the whole step as a
        CUDA graph (_StepGraph) and every step replays it: one launch instead of a few hundred from Python (with
        reduce_grads: two graphs, backward's and the update's, with reduce_grads run between them). Results equal
        the eager step's (the same kernels; lr, the step count and the clip threshold are read by AdamW from GPU
        memory, adamw_step_device). Profiling turns graphs off (every launch is timed from Python)."""
        if self.graphs and self.profiler is None:
            x, y = self._check_batch("train_step", x, y)
            key = (*x.shape, reduce_grads is not None)
            graph = self._graphs.get(key)
            if graph is None:
                try:
                    graph = self._graphs[key] = _StepGraph(self, *x.shape, split=reduce_grads is not None)
                except Exception as e:  # noqa: BLE001 - a platform without stream capture: say so, run eagerly
                    if self._graphs_required:
                        raise EngineError(f"capturing the training step as a CUDA graph failed: {e}") from e
                    import warnings
                    warnings.warn(f"CUDA graph capture failed ({type(e).__name__}: {e}); training step by step "
                                  f"from Python instead", RuntimeWarning, stacklevel=2)
                    self.graphs = False
                    graph = None
            if graph is not None:
                return graph.step(x, y, lr, weight_decay, grad_clip, reduce_grads)
        scale = self.scaler.scale if self.scaler is not None else 1.0
        with nvtx_range("forward"):
            loss = self.forward(x, y)[1]  # the logits are not kept: (B, T, V) would stay alive through backward
        with nvtx_range("backward"):
            self.backward(loss_scale=scale)
        if reduce_grads is not None:
            reduce_grads(self.grads.flat)
        with nvtx_range("optimizer"):
            return {"loss": loss, **self.optimizer_step(lr, weight_decay, grad_clip)}

    def graph_pool_bytes(self) -> int:
        """Bytes the captured steps' private memory pools hold (0 without graphs)."""
        return sum(g.pool_bytes() for g in self._graphs.values())

    def eval_loss(self, x, y) -> float:
        x, y = self._check_batch("eval_loss", x, y)
        _, loss = self._forward(x, y, keep="full")
        self._cache = None
        return loss

    def next_logits(self, context) -> np.ndarray:
        x, _ = self._check_batch("next_logits", np.asarray(context)[None, :])
        logits, _ = self._forward(x, None, keep="full")
        last = logits[0, -1]
        return np.asarray(self.xp.asnumpy(last) if self.on_gpu else last, dtype=np.float64)


class _StepGraph:
    """One training step of a GPUEngine (hip backend, fp32 / bf16) for one batch shape, as a CUDA graph.

    Capture (once per shape): static device buffers for the tokens, the targets, AdamW's scalars (hyper) and the
    result (loss, squared gradient norm); a private CuPy memory pool for everything the step allocates; one eager
    warm-up step (it compiles every kernel and fills the private pool with the blocks the step needs; the model and
    optimizer state are saved before it and restored after it, so it leaves no trace); then the same step captured
    on a side stream (cudaStreamBeginCapture, relaxed mode) and instantiated. The step calls the same launchers as
    the eager path; only AdamW differs: adamw_step_device reads lr, lr * wd, the bias corrections and the clip
    threshold from `hyper` and the gradient norm from the grad_sumsq output, because a replay re-runs every launch
    with the arguments it was captured with.
    Replay (every step): copy x, y and hyper into the static buffers, launch the graph, read back (loss, sumsq).
    The private pool is never used by anything else, so the addresses baked into the graph stay valid."""

    def __init__(self, eng, B, T, split=False):
        import cupy as cp

        from .kernels.numba.adamw import adamw_hyper

        self.eng, self.B, self.T, self.split = eng, B, T, bool(split)
        self.x = cp.zeros((B, T), cp.int32)
        self.y = cp.zeros((B, T), cp.int32)
        self.hyper = cp.asarray(adamw_hyper(0.0, 0.0, 1, *eng.betas))
        self.result = cp.zeros(2, cp.float32)
        self.pool = cp.cuda.MemoryPool()
        self.stream = cp.cuda.Stream()           # a blocking stream: ordered with work on the default stream
        from .blas import prepare_capture

        prepare_capture()                        # cuBLAS handle + workspace for captured matrix products
        state = [eng.params.flat, eng.grads.flat, eng.m, eng.v] + ([eng.half] if eng.half is not None else [])
        saved = [a.copy() for a in state]
        parts = [self._grads, self._update] if self.split else [self._whole]
        self.graphs = []
        try:
            with cp.cuda.using_allocator(self.pool.malloc), self.stream:
                for part in parts:               # warm-up: compiles kernels, fills the private pool
                    part()
                self.stream.synchronize()
                for part in parts:               # split: the update's graph reuses backward's freed blocks, safely:
                    self.stream.begin_capture(mode=cp.cuda.runtime.streamCaptureModeRelaxed)   # one stream, in order
                    try:
                        part()
                    finally:
                        self.graphs.append(self.stream.end_capture())
        finally:
            eng._cache = None
            cp.cuda.Device().synchronize()
            for dst, src in zip(state, saved):   # neither run leaves a trace in the model or the optimizer
                dst[...] = src
            cp.cuda.Device().synchronize()

    def _grads(self):
        eng = self.eng
        _, loss = eng._forward(self.x, self.y, keep=eng.policy, device_loss=True)
        eng.backward()
        self.result[0:1] = loss

    def _update(self):
        self.eng._update_on_device(self.hyper)
        self.result[1:2] = self.eng._sumsq

    def _whole(self):
        self._grads()
        self._update()

    def step(self, x, y, lr, weight_decay, grad_clip, reduce_grads=None) -> dict:
        if self.split != (reduce_grads is not None):
            raise RuntimeError("_StepGraph.step: a split graph needs reduce_grads, a whole one takes none")
        hyper = self.eng._hyper(lr, weight_decay, grad_clip)
        with self.stream:
            self.x.set(x)
            self.y.set(y)
            self.hyper.set(hyper)
            self.graphs[0].launch(self.stream)
            if self.split:
                reduce_grads(self.eng.grads.flat)  # eager, on this stream, between backward's graph and the update's
                self.graphs[1].launch(self.stream)
            loss, sumsq = (float(v) for v in self.result.get(stream=self.stream))
        return {"loss": loss, "grad_norm": math.sqrt(max(sumsq, 0.0)), "skipped": False}

    def pool_bytes(self) -> int:
        """Bytes the step's private pool holds: its working set (activations and temporaries)."""
        return int(self.pool.total_bytes())


def engine_memory(cfg: GPTConfig, B: int, T: int, precision="fp32", policy="none", half_scores=True) -> dict:
    """Predicted peak GPU memory (bytes) of GPUEngine.train_step on a (B, T) batch: what this engine allocates.

    checkpointing.memory_model describes the NumPy reference's cache (every tensor in one precision); this function
    follows the engine's own choices, tensor by tensor (module docstring): fp32 master weights, grads, m, v and the
    half copy; per block the kept tensors of the policy (fp32 residual stream, LayerNorm statistics and GELU input;
    the matmul inputs, the attention probabilities among them, in the run's format); the tensors kept outside the
    blocks (last block output, lnf statistics and output, dlogits (B*T, V) fp32, token ids); and the largest working
    set of any phase of the step: the forward of a block (one temporary at a time), the head (logits + dlogits), the
    start of backward (dlogits, its half copy, dlnf), a block's backward (the stages of _block_backward, with its
    recompute under "full" / "selective"), the embedding backward (v3's 64-bit accumulator). half_scores: the
    engine's versions["scores"] == "half" (the default: the attention scores and their gradient in half; only in half
    precision). Returns the terms and "total" = model + activations +
    peak working set.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"engine_memory: precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if policy not in POLICIES:
        raise ValueError(f"engine_memory: policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    f, e = 4, (4 if precision == "fp32" else 2)
    half = e == 2
    h = e if half else 0                       # bytes of a half copy that exists only in half precision
    C, nh, L, V = cfg.d_model, cfg.n_head, cfg.n_layer, cfg.vocab_size
    N, P, TT = B * T, num_params(cfg), B * nh * T * T
    NC = N * C
    model = {"params": P * f, "params_half": P * h, "grads": P * f, "adamw": 2 * P * f}
    # what one block keeps, per policy (GPUEngine._block_forward)
    base = NC * f + 4 * N * f                                           # x, mean1, rstd1, mean2, rstd2
    sel = 3 * NC * e + TT * e + NC * e + NC * f + 4 * NC * f            # q, k, v, att_mm, atty_mm, x1, fc
    rebuilt = NC * e + NC * e + 4 * NC * e                              # ln1_mm, ln2_mm, gelu_mm
    full_cache = base + sel + rebuilt
    kept_block = {"none": full_cache, "selective": base + sel, "full": NC * f}[policy]
    dl = 2 if precision == "bf16" else 4                                  # dlogits: bf16 from the loss kernel
    top = NC * f + 2 * N * f + NC * e + N * V * dl + N * 4                # h, meanf, rstdf, lnf_mm, dlogits, idx
    activations = L * kept_block + top
    # forward: one temporary at a time beside the growing cache: qkv before the head split, the scores (half or
    # fp32: half_scores) before the half softmax output (half runs), y before merge_heads, the block output; under
    # selective the matmul inputs that are not kept, under full the whole cache (a local of the forward, dropped on
    # return)
    ts = e if (half and half_scores) else f                              # bytes of a score / its gradient
    fwd_block = max(3 * NC * f, TT * ts * half, NC * f)
    if policy == "selective":
        fwd_block += rebuilt
    elif policy == "full":
        fwd_block += full_cache - NC * f
    head = N * V * f + N * f + N * 4                                     # logits, losses, targets
    # backward: the stages of _block_backward on top of the incoming dx (NC f)
    stages = [NC * h + 4 * NC * f,                                       # fcproj: dx_mm, dgelu
              8 * NC * f,                                                # dgelu, dfc
              4 * NC * f + 4 * NC * h + NC * f,                          # fc: dfc, dfc_mm, dln2
              2 * NC * f,                                                # dln2, dx1
              2 * NC * f + NC * h,                                       # attproj: dx1, dx1_mm, datty
              2 * NC * f + NC * e,                                       # dx1, datty, dy
              2 * NC * f + NC * e + TT * ts,                             # dx1, dy, dv, datt
              2 * NC * f + TT * ts + TT * h,                             # dx1, dv, datt, dpre (half)
              5 * NC * f + TT * e,                                       # dx1, dqkv, dv / part, dpre
              5 * NC * f + 3 * NC * h,                                   # qkv: dx1, dqkv, dqkv_mm, dln1
              3 * NC * f]                                                # dx1, dln1, dx0
    recompute = {"none": 0, "selective": rebuilt, "full": full_cache - NC * f}[policy]
    bwd_block = NC * f + max(stages) + recompute
    if policy == "full":                     # the recompute's own forward locals, before the backward stages
        bwd_block = max(bwd_block, NC * f + fwd_block)
    fp16_copy = N * V * (f + 2) if precision == "fp16" else 0             # dlogits * scale, then its fp16 cast
    bwd_head = fp16_copy + NC * f
    embed_bwd = NC * f + V * C * (f + 8)              # dx, the embedding's dwte, v3's int64 accumulator (V, C)
    peak_set = max(fwd_block, head, bwd_head, bwd_block, embed_bwd)
    out = {**model, "activations": activations, "activations_per_block": kept_block, "working_set": peak_set}
    out["total"] = sum(model.values()) + activations + peak_set
    return out
