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
fused softmax + cross-entropy, the embedding backward, the fused AdamW and the precision kernels.

Memory layout (DESIGN.md §3): parameters, gradients, m and v are flat fp32 buffers with named views
(params.ParamBuffer); the optimizer is one fused AdamW launch over the whole buffer.

Precision ("fp32" | "bf16" | "fp16"): fp32 master weights always. In half precision the AdamW pass also writes a half
copy of the weights, the input of every matrix product is converted to half (our conversion kernels: bf16 by
round-to-nearest-even into uint16 bits) and cuBLAS multiplies half x half with fp32 accumulation and an fp32
result. Activations between the products, LayerNorm statistics, softmax and the loss stay fp32, and the tensors
kept for backward that only feed matrix products (the LayerNorm outputs, q, k, v, the attention output, the GELU
output) are kept in half; the attention probabilities are kept twice, fp32 for the softmax backward and half for the
products (engine_memory counts both). fp16 adds dynamic loss scaling (precision.DynamicLossScaler): dlogits
is multiplied by the scale before it is rounded to fp16, the step is skipped when the one-pass non-finite count of
the gradient buffer is not 0, and AdamW divides by the scale in its gradient read (grad_scale).

Activation checkpointing (policy, as checkpointing.py): "none" keeps every block's cache; "selective" drops the
LayerNorm outputs and the GELU output and recomputes them (one LayerNorm forward / one GELU forward) in backward;
"full" keeps only each block's input and reruns the block's forward just before its backward.

One training step: forward (loss), backward (every gradient written, none accumulated), the global gradient norm
(one reduction over the flat gradient buffer), clipping and 1/loss-scale folded into AdamW's grad_scale, AdamW.
"""
from __future__ import annotations

import math

import numpy as np

from .params import GPTConfig, ParamBuffer, init_params, num_params

BACKENDS = ("numpy", "numba", "hip")
PRECISIONS = ("fp32", "bf16", "fp16")
POLICIES = ("none", "selective", "full")
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
          versions=None):
    """An engine for cfg on `backend` (see the module docstring), initialised with init_params(cfg, seed)."""
    backend = check_backend(backend)
    if precision not in PRECISIONS:
        raise EngineError(f"unknown precision {precision!r}: choose one of {', '.join(PRECISIONS)}")
    if policy not in POLICIES:
        raise EngineError(f"unknown checkpointing policy {policy!r}: choose one of {', '.join(POLICIES)}")
    if backend == "numpy":
        if precision != "fp32":
            raise EngineError(f"precision {precision!r} needs a kernel backend (--backend hip or numba); the NumPy "
                              f"reference trains in fp32 (lesson 07 emulates half-precision matmuls on the CPU)")
        return NumpyEngine(cfg, policy, seed, betas, eps)
    return GPUEngine(cfg, backend, precision, policy, seed, betas, eps, versions)


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
        self._params_changed()

    def _host(self, a):
        return np.array(a, dtype=np.float32, copy=True)

    def _dev(self, a):
        return a

    def _params_changed(self):
        pass


class NumpyEngine(Engine):
    """The NumPy reference on the CPU (fp32)."""

    backend = "numpy"

    def __init__(self, cfg, policy, seed, betas, eps):
        from .optim import AdamW, decay_mask_for

        super().__init__(cfg, "fp32", policy, seed, betas, eps)
        self.params = init_params(cfg, seed=seed, dtype=np.float32)
        self.grads = ParamBuffer(cfg, dtype=np.float32)
        self.opt = AdamW(self.params.flat, lr=1.0, betas=self.betas, eps=self.eps, weight_decay=0.0,
                         decay_mask=decay_mask_for(cfg))
        self.m, self.v = self.opt.m, self.opt.v

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

    def train_step(self, x, y, lr, weight_decay=0.0, grad_clip=0.0) -> dict:
        loss = self.forward(x, y)[1]      # the logits are not kept: (B, T, V) would stay alive through backward
        self.backward()
        return {"loss": loss, **self.optimizer_step(lr, weight_decay, grad_clip)}

    def grad_norm(self) -> float:
        return float(np.sqrt(np.sum(np.square(self.grads.flat, dtype=np.float64))))

    def optimizer_step(self, lr, weight_decay=0.0, grad_clip=0.0, grad_norm=None) -> dict:
        """Clip (global norm; `grad_norm` given: use it, e.g. after an all-reduce) and one AdamW step."""
        norm = self.grad_norm() if grad_norm is None else float(grad_norm)
        coef = grad_clip / (norm + 1e-6)                   # as torch.nn.utils.clip_grad_norm_ and optim.clip_grad_norm
        if grad_clip > 0 and coef < 1.0:
            self.grads.flat *= np.float32(coef)
        self.opt.weight_decay = float(weight_decay)
        self.opt.t = self.t
        self.opt.step(self.grads.flat, lr=lr)
        self.t = self.opt.t
        return {"grad_norm": norm, "skipped": False}

    def eval_loss(self, x, y) -> float:
        from .reference import gpt_forward

        x, y = self._check_batch("eval_loss", x, y)
        return float(gpt_forward(self.params.views, self.cfg, x, y)[1])

    def next_logits(self, context) -> np.ndarray:
        from .reference import gpt_forward

        x, _ = self._check_batch("next_logits", np.asarray(context)[None, :])
        return gpt_forward(self.params.views, self.cfg, x, None)[0][0, -1].astype(np.float64)

    def _params_changed(self):
        self.opt.t = self.t


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

    # the kernel version each op runs with (the fastest simulator-safe one for numba, the fastest for hip)
    DEFAULT_VERSIONS = {
        "hip": {"layernorm_forward": "v2", "layernorm_backward": "v5", "gelu": "v1", "crossentropy": "v2",
                "encoder": "v2", "adamw": "v3", "convert": "v1"},
        "numba": {"layernorm_forward": "v2", "layernorm_backward": "v2", "gelu": "v1", "crossentropy": "v2",
                  "encoder": "v2", "adamw": "v2", "convert": "v1"},
        # the CUDA simulator runs one Python thread per CUDA thread and makes every barrier expensive: the
        # one-thread-per-row versions are ~50x faster there than the block-per-row ones
        "numba-sim": {"layernorm_forward": "v1", "layernorm_backward": "v1", "gelu": "v1", "crossentropy": "v2",
                      "encoder": "v2", "adamw": "v2", "convert": "v1"},
    }

    def __init__(self, cfg, backend, precision, policy, seed, betas, eps, versions=None):
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
            self._params_changed()
        if precision == "fp16":
            from .precision import DynamicLossScaler

            self.scaler = DynamicLossScaler()
        self._count = xp.zeros(1, xp.int32)
        self._cache = None
        self.profiler = None

    # ---- helpers ----------------------------------------------------------------------------------------------
    def _host(self, a):
        return np.array(self.xp.asnumpy(a) if self.on_gpu else a, dtype=np.float32, copy=True)

    def _dev(self, a):
        return self.xp.asarray(a)

    def _params_changed(self):
        """Refresh the half copy of the weights from the fp32 master (after init or a load)."""
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

    def _mm_in(self, a):
        """A matmul input in the run's format: the fp32 array itself, or its half bits."""
        return a if self.half is None else self._to_half(a)

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

    def _linear(self, inp_mm, name_w, name_b, l, out_features):
        """(N, C_in) matmul input -> (N, C_out) fp32 = inp @ W + b."""
        out = self.xp.empty((inp_mm.shape[0], out_features), self.xp.float32)
        self._gemm(inp_mm, self._w(name_w, l), out)
        out += self.params[name_b][l]
        return out

    def _linear_backward(self, dout_mm, dout_f32, inp_mm, name_w, name_b, l, in_features):
        """dinp (N, C_in) fp32; writes grads[name_w][l] (C_in, C_out) and grads[name_b][l] (C_out,)."""
        xp = self.xp
        dinp = xp.empty((dout_mm.shape[0], in_features), xp.float32)
        self._gemm(dout_mm, self._w(name_w, l), dinp, trans_b=True)       # dinp = dout @ W.T
        self._gemm(inp_mm, dout_mm, self.grads[name_w][l], trans_a=True)  # dW = inp.T @ dout
        self.grads[name_b][l][...] = dout_f32.sum(axis=0)
        return dinp

    def _layernorm(self, x, name_w, name_b, l):
        xp, N = self.xp, x.shape[0]
        C = self.cfg.d_model
        w = self.params[name_w] if l is None else self.params[name_w][l]
        b = self.params[name_b] if l is None else self.params[name_b][l]
        out, mean, rstd = xp.empty((N, C), xp.float32), xp.empty(N, xp.float32), xp.empty(N, xp.float32)
        self.K.layernorm_forward(x, w, b, out, mean, rstd, version=self.ver["layernorm_forward"])
        return out, mean, rstd

    def _layernorm_backward(self, dout, x, mean, rstd, name_w, name_b, l):
        xp = self.xp
        w = self.params[name_w] if l is None else self.params[name_w][l]
        dw = self.grads[name_w] if l is None else self.grads[name_w][l]
        db = self.grads[name_b] if l is None else self.grads[name_b][l]
        dx = xp.empty_like(x)
        self.K.layernorm_backward(dout, x, w, mean, rstd, dx, dw, db, version=self.ver["layernorm_backward"])
        return dx

    def _heads(self, a, B, T):
        """(B*T, C) fp32 -> (B*nh, T, hs) contiguous (fp32)."""
        nh, C = self.cfg.n_head, self.cfg.d_model
        return self.xp.ascontiguousarray(a.reshape(B, T, nh, C // nh).transpose(0, 2, 1, 3)).reshape(B * nh, T, C // nh)

    def _merge(self, a, B, T):
        """(B*nh, T, hs) -> (B*T, C) contiguous."""
        nh, C = self.cfg.n_head, self.cfg.d_model
        return self.xp.ascontiguousarray(a.reshape(B, nh, T, C // nh).transpose(0, 2, 1, 3)).reshape(B * T, C)

    # ---- one block ----------------------------------------------------------------------------------------------
    def _block_forward(self, x, l, B, T, keep):
        """x (B*T, C) -> x_out, cache dict; keep: which policy decides what the cache holds."""
        xp, cfg = self.xp, self.cfg
        C, nh = cfg.d_model, cfg.n_head
        hs = C // nh
        c = {"x": x}
        ln1, c["mean1"], c["rstd1"] = self._layernorm(x, "ln1w", "ln1b", l)
        ln1_mm = self._mm_in(ln1)
        qkv = self._linear(ln1_mm, "qkvw", "qkvb", l, 3 * C)                      # (B*T, 3C)
        q, k, v = (self._mm_in(self._heads(qkv[:, i * C:(i + 1) * C], B, T)) for i in range(3))
        att = xp.empty((B * nh, T, T), xp.float32)
        self._gemm(q, k, att, trans_b=True)                                       # raw scores q @ k.T
        self.K.attention_softmax_forward(att.reshape(-1, T), att.reshape(-1, T), 1.0 / math.sqrt(hs))
        att_mm = self._mm_in(att)
        y = xp.empty((B * nh, T, hs), xp.float32)
        self._gemm(att_mm, v, y)                                                  # att @ v
        atty_mm = self._mm_in(self._merge(y, B, T))
        x1 = x + self._linear(atty_mm, "attprojw", "attprojb", l, C)
        ln2, c["mean2"], c["rstd2"] = self._layernorm(x1, "ln2w", "ln2b", l)
        ln2_mm = self._mm_in(ln2)
        fc = self._linear(ln2_mm, "fcw", "fcb", l, 4 * C)
        gelu = xp.empty_like(fc)
        self.K.gelu_forward(fc.reshape(-1), gelu.reshape(-1), version=self.ver["gelu"])
        gelu_mm = self._mm_in(gelu)
        x2 = x1 + self._linear(gelu_mm, "fcprojw", "fcprojb", l, C)
        if keep == "none":
            c.update(ln1_mm=ln1_mm, q=q, k=k, v=v, att=att, att_mm=att_mm, atty_mm=atty_mm, x1=x1,
                     ln2_mm=ln2_mm, fc=fc, gelu_mm=gelu_mm)
        elif keep == "selective":     # LayerNorm and GELU outputs are rebuilt in backward
            c.update(q=q, k=k, v=v, att=att, att_mm=att_mm, atty_mm=atty_mm, x1=x1, fc=fc)
        # "full": only x (the caller keeps it; the rest is recomputed)
        return x2, c

    def _rebuild(self, c, l):
        """Selective recompute: the LayerNorm outputs from x / x1 and the GELU output from fc."""
        xp = self.xp
        c["ln1_mm"] = self._mm_in(self._layernorm(c["x"], "ln1w", "ln1b", l)[0])
        c["ln2_mm"] = self._mm_in(self._layernorm(c["x1"], "ln2w", "ln2b", l)[0])
        gelu = xp.empty_like(c["fc"])
        self.K.gelu_forward(c["fc"].reshape(-1), gelu.reshape(-1), version=self.ver["gelu"])
        c["gelu_mm"] = self._mm_in(gelu)

    def _block_backward(self, dx, c, l, B, T):
        """d(block output) (B*T, C) -> d(block input); writes layer l's gradients.

        Temporaries are dropped (del) as soon as they are used up, so that the backward's working set stays one
        or two (B, T, 4C) tensors plus one (B, nh, T, T): engine_memory() counts the same live sets."""
        xp, cfg = self.xp, self.cfg
        C, nh = cfg.d_model, cfg.n_head
        hs = C // nh
        # MLP: x2 = x1 + fcproj(gelu(fc(ln2(x1))))
        dx_mm = self._mm_in(dx)
        dgelu = self._linear_backward(dx_mm, dx, c["gelu_mm"], "fcprojw", "fcprojb", l, 4 * C)
        del dx_mm
        dfc = xp.empty_like(dgelu)
        self.K.gelu_backward(dgelu.reshape(-1), c["fc"].reshape(-1), dfc.reshape(-1), version=self.ver["gelu"])
        del dgelu
        dln2 = self._linear_backward(self._mm_in(dfc), dfc, c["ln2_mm"], "fcw", "fcb", l, C)
        del dfc
        dx1 = self._layernorm_backward(dln2, c["x1"], c["mean2"], c["rstd2"], "ln2w", "ln2b", l)
        del dln2
        dx1 += dx
        # attention: x1 = x + attproj(attention(qkv(ln1(x))))
        dx1_mm = self._mm_in(dx1)
        datty = self._linear_backward(dx1_mm, dx1, c["atty_mm"], "attprojw", "attprojb", l, C)
        del dx1_mm
        dy = self._mm_in(self._heads(datty, B, T))                                # (B*nh, T, hs)
        del datty
        dv = xp.empty((B * nh, T, hs), xp.float32)
        self._gemm(c["att_mm"], dy, dv, trans_a=True)                             # dv = att.T @ dy
        datt = xp.empty((B * nh, T, T), xp.float32)
        self._gemm(dy, c["v"], datt, trans_b=True)                                # datt = dy @ v.T
        del dy
        self.K.attention_softmax_backward(c["att"].reshape(-1, T), datt.reshape(-1, T), datt.reshape(-1, T),
                                          1.0 / math.sqrt(hs))                    # dpre, in place, scale folded in
        dpre_mm = self._mm_in(datt)
        del datt
        dqkv = xp.empty((B * T, 3 * C), xp.float32)
        dqkv[:, 2 * C:] = self._merge(dv, B, T)
        del dv
        for i, (b, ta) in enumerate(((c["k"], False), (c["q"], True))):
            part = xp.empty((B * nh, T, hs), xp.float32)
            self._gemm(dpre_mm, b, part, trans_a=ta)                              # dq = dpre @ k, dk = dpre.T @ q
            dqkv[:, i * C:(i + 1) * C] = self._merge(part, B, T)
            del part
        del dpre_mm
        dln1 = self._linear_backward(self._mm_in(dqkv), dqkv, c["ln1_mm"], "qkvw", "qkvb", l, C)
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

    def _forward(self, x, y, keep):
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
        lnf, meanf, rstdf = self._layernorm(h, "lnfw", "lnfb", None)
        lnf_mm = self._mm_in(lnf)
        logits = xp.empty((B * T, V), xp.float32)
        self._gemm(lnf_mm, self._w("wte"), logits, trans_b=True)                  # tied head: lnf @ wte.T
        loss = None
        if y is not None:
            targets = xp.asarray(y).reshape(-1)
            losses = xp.empty(B * T, xp.float32)
            dlogits = xp.empty_like(logits)
            self.K.crossentropy_forward_backward(logits, targets, losses, dlogits, version=self.ver["crossentropy"])
            loss = float(losses.mean())
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
        else:
            dl_mm, alpha = self._mm_in(dlogits), loss_scale
        del dlogits, c["dlogits"]
        dlnf = xp.empty((B * T, cfg.d_model), xp.float32)
        self._gemm(dl_mm, self._w("wte"), dlnf, alpha=alpha)                      # dlnf = dlogits @ wte
        self._gemm(dl_mm, c["lnf_mm"], self.grads["wte"], trans_a=True, alpha=alpha)  # dwte (head) = dlogits.T @ lnf
        del dl_mm
        dx = self._layernorm_backward(dlnf, c["h"], c["meanf"], c["rstdf"], "lnfw", "lnfb", None)
        for l in reversed(range(cfg.n_layer)):
            blk = c["blocks"][l]
            if self.policy == "full":
                _, blk = self._block_forward(blk["x"], l, B, T, "none")
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

    def grad_norm(self) -> float:
        """The global L2 norm of the flat gradient buffer (one reduction over it)."""
        g = self.grads.flat
        return float(math.sqrt(float(self.xp.dot(g, g))))

    def train_step(self, x, y, lr, weight_decay=0.0, grad_clip=0.0) -> dict:
        """Forward, backward, clip, AdamW. fp16: a step with an inf/NaN gradient is skipped and the scale backs off."""
        scale = self.scaler.scale if self.scaler is not None else 1.0
        loss = self.forward(x, y)[1]      # the logits are not kept: (B, T, V) would stay alive through backward
        self.backward(loss_scale=scale)
        return {"loss": loss, **self.optimizer_step(lr, weight_decay, grad_clip)}

    def optimizer_step(self, lr, weight_decay=0.0, grad_clip=0.0, grad_norm=None) -> dict:
        """After backward(loss_scale=self.scaler.scale or 1): the overflow check (fp16), clipping, fused AdamW.

        grad_norm: the norm of the scaled gradients when the caller already has it (data parallel: after the
        all-reduce); None computes it here. Returns {"grad_norm" (unscaled), "skipped", "scale" (fp16)}."""
        scale = self.scaler.scale if self.scaler is not None else 1.0
        if self.scaler is not None:
            self.K.nonfinite_count(self.grads.flat, self._count)                 # one pass over the gradients
            skipped = self.scaler.update(int(self._count[0]) > 0)
            if skipped:
                self.grads.flat[...] = 0
                return {"grad_norm": float("nan"), "skipped": True, "scale": scale}
        norm = (self.grad_norm() if grad_norm is None else float(grad_norm)) / scale
        coef = grad_clip / (norm + 1e-6) if grad_clip > 0 and grad_clip / (norm + 1e-6) < 1.0 else 1.0
        self.t += 1
        self.K.adamw_step(self.params.flat, self.grads.flat, self.m, self.v, lr, self.betas[0], self.betas[1],
                          self.eps, weight_decay, self.t, decay_bounds=self.decay,
                          grad_scale=float(np.float32(coef) / np.float32(scale)) if scale != 1.0 else float(coef),
                          half_out=self.half if self.half is not None else None,
                          half_dtype={"bf16": "bfloat16", "fp16": "float16"}.get(self.precision),
                          version=self.ver["adamw"])
        out = {"grad_norm": norm, "skipped": False}
        if self.scaler is not None:
            out["scale"] = scale
        return out

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


def engine_memory(cfg: GPTConfig, B: int, T: int, precision="fp32", policy="none") -> dict:
    """Predicted peak GPU memory (bytes) of GPUEngine.train_step on a (B, T) batch: what this engine allocates.

    checkpointing.memory_model describes the NumPy reference's cache (every tensor in one precision); this function
    follows the engine's own choices, tensor by tensor (module docstring): fp32 master weights, grads, m, v and the
    half copy; per block the kept tensors of the policy (fp32 residual stream, LayerNorm statistics, attention
    probabilities and GELU input; half copies of the matmul inputs); the tensors kept outside the blocks (last
    block output, lnf statistics and output, dlogits (B*T, V) fp32, token ids); and the largest working set of any
    phase of the step: the forward of a block (its locals live until it returns), the head (logits + dlogits), the
    start of backward (dlogits, its half copy, dlnf), a block's backward (the stages of _block_backward, with its
    recompute under "full" / "selective"). Returns the terms and "total" = model + activations + peak working set.
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
    model = {"params": P * f, "params_half": P * h, "grads": P * f, "adamw": 2 * P * f}
    # what one block keeps, per policy
    base = N * C * f + 4 * N * f                                        # x, mean1, rstd1, mean2, rstd2
    sel = 3 * N * C * e + TT * f + TT * h + N * C * e + N * C * f + 4 * N * C * f   # q,k,v att att_mm atty x1 fc
    rebuilt = N * C * e + N * C * e + 4 * N * C * e                     # ln1_mm, ln2_mm, gelu_mm
    full_cache = base + sel + rebuilt
    kept_block = {"none": full_cache, "selective": base + sel, "full": N * C * f}[policy]
    top = N * C * f + 2 * N * f + N * C * e + N * V * f + N * 4            # h, meanf, rstdf, lnf_mm, dlogits, idx
    activations = L * kept_block + top
    # forward: a block's locals beyond its cache (qkv, y, merged y, fp32 LayerNorm/GELU outputs in half, a linear
    # output before its residual add), and under selective the half inputs that are not kept
    fwd_block = (3 * N * C * f + N * C * f + N * C * f * half + (N * C * f + N * C * f + 4 * N * C * f) * half
                 + N * C * f + (rebuilt if policy == "selective" else 0))
    if policy == "full":                     # the whole cache is a local of the forward, dropped on return
        fwd_block += full_cache - N * C * f
    head = N * V * f + N * f + N * 4 + N * C * f * half                # logits, losses, targets, fp32 lnf
    # backward: the stages of _block_backward on top of the incoming dx (N*C f)
    stages = [N * C * h + 4 * N * C * f,
              8 * N * C * f,
              4 * N * C * f + 4 * N * C * h + N * C * f,
              2 * N * C * f,
              N * C * f + N * C * h + N * C * f,
              3 * N * C * f + N * C * h,
              N * C * f + N * C * e + N * C * f + TT * f,
              N * C * f + N * C * f + TT * f + TT * h,
              N * C * f + 3 * N * C * f + N * C * f + N * C * f + TT * e,
              N * C * f + 3 * N * C * f + TT * e + 2 * N * C * f,
              N * C * f + 3 * N * C * f + 3 * N * C * h + N * C * f,
              3 * N * C * f]
    recompute = {"none": 0, "selective": rebuilt, "full": full_cache - N * C * f}[policy]
    bwd_block = N * C * f + max(stages) + recompute
    if policy == "full":                     # the recompute's own forward locals, before the backward stages
        bwd_block = max(bwd_block, N * C * f + fwd_block)
    scale_tmp = N * V * f if precision == "fp16" else 0                   # dlogits * scale before the fp16 cast
    bwd_head = N * V * h + scale_tmp + N * C * f
    peak_set = max(fwd_block, head, bwd_head, bwd_block)
    out = {**model, "activations": activations, "activations_per_block": kept_block, "working_set": peak_set}
    out["total"] = sum(model.values()) + activations + peak_set
    return out
