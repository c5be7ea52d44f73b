"""What every engine is: the names the engine accepts (backends, precisions, checkpointing policies), the check that
this machine has the backend asked for, and the base class Engine with the state and the one optimizer update
(Engine.update) that both engines, the CUDA-graph step, data parallel and ZeRO use."""

from __future__ import annotations

import math

import numpy as np

from ..model.checkpointing import POLICIES, parse_policy  # noqa: F401 - POLICIES: the names; "sqrt" also as "sqrt:K"
from ..model.optim import clip_coefficient
from ..model.params import GPTConfig, layer_segments, num_params

BACKENDS = ("numpy", "numba", "hip")
PRECISIONS = ("fp32", "bf16", "fp16")
# AdamW's moments: fp32; bf16 (bfloat16 bits, rounded to nearest even after each update: every backend); block-wise
# 8-bit (gpullm_lessons.model.quant: the NumPy engine)
OPTIMIZER_STATES = ("fp32", "bf16", "int8")
GRAPH_PRECISIONS = ("fp32", "bf16")  # train_step replayed as a CUDA graph (fp16's overflow skip is a host decision)
BETAS = (0.9, 0.95)
EPS = 1e-8


class EngineError(ValueError):
    """A backend / precision / policy / machine combination that cannot run; the message names the problem."""


# the dtypes of m and v as each optimizer state stores them (int8: m signed, v as sqrt(v) unsigned, plus per-block
# fp32 scales m_scale, v_scale; see gpullm_lessons.model.quant)
MOMENT_DTYPES = {"fp32": ("float32", "float32"), "bf16": ("uint16", "uint16"), "int8": ("int8", "uint8")}


def optimizer_state_bytes(n: int, optimizer_state: str = "fp32") -> int:
    """Bytes of AdamW's m and v for n parameters in `optimizer_state`: fp32 8 n, bf16 4 n, int8 2 n + the scales."""
    if optimizer_state not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer_state {optimizer_state!r}: choose one of {', '.join(OPTIMIZER_STATES)}")
    if optimizer_state == "int8":
        from ..model.quant import moment_bytes

        return moment_bytes(n)
    return n * 2 * (4 if optimizer_state == "fp32" else 2)


def moments_to_f32(state: dict, optimizer_state: str) -> tuple:
    """(m, v) float32 from a state dict's moments stored in `optimizer_state` (bf16 bits widened exactly; int8
    dequantised as quant.dequantize_moments)."""
    if optimizer_state == "fp32":
        return np.asarray(state["m"], np.float32), np.asarray(state["v"], np.float32)
    if optimizer_state == "bf16":
        from ..reference.rounding import bf16_bits_to_f32

        return bf16_bits_to_f32(np.asarray(state["m"])), bf16_bits_to_f32(np.asarray(state["v"]))
    from ..model.quant import dequantize_moments

    return dequantize_moments({k: np.asarray(state[k]) for k in ("m", "m_scale", "v", "v_scale")})


def moments_from_f32(m, v, optimizer_state: str) -> dict:
    """{"m", "v"} (int8: also "m_scale", "v_scale") in `optimizer_state` from float32 m, v (bf16: round to nearest
    even; int8: quant.quantize_moments)."""
    if optimizer_state == "fp32":
        return {"m": np.asarray(m, np.float32), "v": np.asarray(v, np.float32)}
    if optimizer_state == "bf16":
        from ..reference.rounding import f32_to_bf16_bits

        return {"m": f32_to_bf16_bits(np.asarray(m, np.float32)), "v": f32_to_bf16_bits(np.asarray(v, np.float32))}
    from ..model.quant import quantize_moments

    return quantize_moments(np.asarray(m, np.float32), np.asarray(v, np.float32))


def check_policy(policy, cfg: GPTConfig) -> str:
    """The checkpointing policy, checked for this model (checkpointing.parse_policy: "sqrt:K" needs 1 <= K <= n_layer);
    EngineError naming the problem otherwise."""
    if not isinstance(cfg, GPTConfig):
        raise TypeError(f"engine: cfg must be a GPTConfig, got {type(cfg).__name__}")
    if not isinstance(policy, str) or policy.partition(":")[0] not in POLICIES:
        raise EngineError(
            f"unknown checkpointing policy {policy!r}: choose one of {', '.join(POLICIES)} "
            f"(or sqrt:K, K blocks per segment)"
        )
    try:
        parse_policy(policy, cfg.n_layer, "checkpointing")
    except ValueError as e:
        raise EngineError(str(e)) from None
    return policy


def check_backend(backend: str) -> str:
    """The backend name to use ("auto": hip on a GPU, else numpy); raises EngineError when the machine lacks it."""
    from .. import device

    if backend == "auto":
        return "hip" if device.has_gpu() and _has_cupy() else "numpy"
    if backend not in BACKENDS:
        raise EngineError(f"unknown backend {backend!r}: choose one of auto, {', '.join(BACKENDS)}")
    if backend == "hip":
        if not device.has_gpu():
            raise EngineError(
                f"backend 'hip' needs a GPU and this machine has none ({device.describe()}); "
                f"use --backend numpy (or numba, in the CUDA simulator, for tiny models)"
            )
        if not _has_cupy():
            raise EngineError(
                "backend 'hip' launches its kernels through CuPy, which is not installed: "
                "make setup GPU=cuda13 (or cuda12 / rocm)"
            )
    if backend == "numba" and device.kind() == "rocm":
        raise EngineError(
            "backend 'numba' needs an NVIDIA GPU or the CUDA simulator: Numba CUDA does not run on "
            "AMD GPUs; use --backend hip (the same kernels' HIP twins)"
        )
    if backend == "numba" and not device.has_gpu() and not device.numba_available():
        raise EngineError(
            f"backend 'numba' needs a GPU or the CUDA simulator, and this machine has neither "
            f"({device.describe()}); unset NUMBA_ENABLE_CUDASIM=0 or use --backend numpy"
        )
    if backend == "numba" and device.has_gpu() and not _has_cupy():
        raise EngineError(
            "backend 'numba' on a GPU keeps its arrays in CuPy, which is not installed: "
            "make setup GPU=cuda13 (or cuda12 / rocm)"
        )
    return backend


def _has_cupy() -> bool:
    try:
        import cupy  # noqa: F401
    except Exception:
        return False
    return True


class Engine:
    """What every backend provides. Buffers: params (ParamBuffer, fp32 master), grads, m, v (flat); t = steps taken.
    m and v are float32, or uint16 bfloat16 bits (moment_format "bf16"); the NumPy engine's "int8" keeps them
    block-wise quantised instead (NumpyEngine.moments_q)."""

    backend = "?"

    def __init__(self, cfg, precision, policy, seed, betas, eps, optimizer_state="fp32"):
        if not isinstance(cfg, GPTConfig):
            raise TypeError(f"engine: cfg must be a GPTConfig, got {type(cfg).__name__}")
        if optimizer_state not in OPTIMIZER_STATES:
            raise EngineError(
                f"unknown optimizer_state {optimizer_state!r}: choose one of {', '.join(OPTIMIZER_STATES)}"
            )
        self.moment_format = optimizer_state  # how m and v are stored: "fp32" | "bf16" | "int8"
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

    # ---- gradient accumulation ------------------------------------------------------------------------------------
    def forward_backward(self, x, y, micro_batches=1, loss_scale=1.0, grads_ready=None) -> float:
        """Forward and backward over the batch (x, y) as `micro_batches` equal blocks of rows, one after the other:
        the gradient of the batch's mean loss (times loss_scale) is left in self.grads and the mean loss returned.

        Each micro-batch's backward runs with loss_scale / K (K = micro_batches), so its gradient is its share of
        the mean over the whole batch; the shares are summed in an fp32 accumulator (the backward kernels write
        their gradient, they do not add to it) and copied into self.grads at the end. Only one micro-batch's
        activations are alive at a time: the peak memory is that of a batch of B / K rows, plus the accumulator.

        grads_ready(k): called during the (last micro-batch's) backward as soon as layer k's gradients in self.grads
        are final (k indexes params.layer_segments(cfg); backward(grads_ready=)), data parallel's cue to start
        sending them. With K > 1 the last micro-batch's share of each layer is added into the accumulator and the sum
        written into self.grads before the call: the same additions as the whole-buffer ones, so the same bits."""
        K = int(micro_batches)
        B = np.shape(x)[0] if np.ndim(x) == 2 else 0
        if K < 1 or B % K:
            raise ValueError(
                f"forward_backward: micro_batches={micro_batches} must be a positive divisor of the batch's "
                f"{B} rows (each micro-batch takes B / K of them)"
            )
        if K == 1:
            loss = self.forward(x, y)[1]  # the logits are not kept: (B, T, V) would stay alive through backward
            self.backward(loss_scale=loss_scale, **self._ready_kw(grads_ready))
            return loss
        b, acc, losses = B // K, None, []
        for i in range(K):
            losses.append(self.forward(x[i * b : (i + 1) * b], y[i * b : (i + 1) * b])[1])
            if i == K - 1 and grads_ready is not None:  # the last share, added layer by layer as backward ends each
                segments, g = layer_segments(self.cfg), self.grads.flat

                def add_last_share(k):
                    for _, lo, hi in segments[k]:
                        acc[lo:hi] += g[lo:hi]
                        g[lo:hi] = acc[lo:hi]
                    grads_ready(k)

                self.backward(loss_scale=loss_scale / K, grads_ready=add_last_share)
                return float(np.mean(losses))
            self.backward(loss_scale=loss_scale / K)
            if acc is None:
                acc = self.grads.flat.copy()
            else:
                acc += self.grads.flat
        self.grads.flat[...] = acc
        return float(np.mean(losses))

    @staticmethod
    def _ready_kw(grads_ready):
        return {} if grads_ready is None else {"grads_ready": grads_ready}

    # ---- state ----------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Host copies of everything a resumed run needs: params (flat fp32), AdamW's moments as this engine stores
        them ("optimizer_state": fp32 m, v; bf16: their uint16 bits; int8: int8 m, uint8 sqrt(v) and the per-block
        scales m_scale, v_scale), t, the loss scaler. A resume from it continues bit for bit."""
        out = {
            "params": self._host(self.params.flat),
            **self._moments_state(),
            "optimizer_state": self.moment_format,
            "t": self.t,
            "precision": self.precision,
        }
        if self.scaler is not None:
            out["scaler"] = self.scaler.state_dict()
        return out

    def _moments_state(self) -> dict:
        return {"m": self._host(self.m, self.m.dtype), "v": self._host(self.v, self.v.dtype)}

    def load_state_dict(self, state: dict) -> None:
        """Restore a state_dict(). Moments stored in another optimizer_state than this engine's (a checkpoint without
        one holds fp32) are converted through fp32 (moments_to_f32, moments_from_f32): the same run, not the same
        bits; in this engine's own format they are loaded exactly."""
        n = num_params(self.cfg)
        fmt = str(state.get("optimizer_state", "fp32"))
        if fmt not in OPTIMIZER_STATES:
            raise ValueError(f"load_state_dict: optimizer_state {fmt!r} is not one of {', '.join(OPTIMIZER_STATES)}")
        for key in ("params", "m", "v") + (("m_scale", "v_scale") if fmt == "int8" else ()):
            if key not in state:
                raise ValueError(f"load_state_dict: the state has no {key!r} (optimizer_state {fmt!r})")
            if key in ("params", "m", "v") and np.asarray(state[key]).shape != (n,):
                raise ValueError(
                    f"load_state_dict: {key} has shape {np.asarray(state[key]).shape}, this model "
                    f"needs ({n},): the checkpoint is from a different model config"
                )
        want = MOMENT_DTYPES[fmt]
        for key, dt in zip(("m", "v"), want):
            got = np.asarray(state[key]).dtype
            if got != np.dtype(dt) and not (fmt == "fp32" and np.issubdtype(got, np.floating)):
                raise ValueError(
                    f"load_state_dict: {key} has dtype {got}; an optimizer_state {fmt!r} state stores it as {dt}"
                )
        if fmt == self.moment_format:
            moments = {k: np.asarray(state[k]) for k in state if k in ("m", "v", "m_scale", "v_scale")}
            if fmt == "fp32":
                moments = {k: a.astype(np.float32) for k, a in moments.items()}
        else:
            moments = moments_from_f32(*moments_to_f32(state, fmt), self.moment_format)
        self.params.flat[...] = self._dev(np.asarray(state["params"], np.float32))
        self._load_moments(moments)
        self.t = int(state["t"])
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
        self.params_changed()

    def _load_moments(self, moments: dict) -> None:
        """m and v (already in this engine's format, host arrays) into the engine's buffers."""
        self.m[...] = self._dev(moments["m"])
        self.v[...] = self._dev(moments["v"])

    def optimizer_bytes(self) -> int:
        """Bytes of AdamW's moments as this engine holds them now (fp32: 8 per parameter, bf16: 4, int8: 2 plus the
        scales; 0 after release_optimizer_state)."""
        return int(self.m.nbytes + self.v.nbytes)

    def _host(self, a, dtype=np.float32):
        return np.array(a, dtype=dtype, copy=True)

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
        if self.moment_format != "fp32":
            raise EngineError(
                f"optimizer_shard: ZeRO shards fp32 moments; this engine stores them as {self.moment_format}"
            )
        n = num_params(self.cfg)
        xp = getattr(self, "xp", np)
        m, v = xp.zeros(hi - lo, xp.float32), xp.zeros(hi - lo, xp.float32)
        top = max(lo, min(hi, n))
        if self.m.size == n:
            m[: top - lo], v[: top - lo] = self.m[lo:top], self.v[lo:top]
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
        self.t += 1
        self._adamw(st, lr, weight_decay, self._grad_scale(sumsq, scale, grad_clip))
        return {"grad_norm": norm, "skipped": False, **out}

    def _grad_scale(self, sumsq, scale, grad_clip) -> float:
        """The factor AdamW multiplies the gradient by: the clip factor of the unscaled norm over the loss scale
        (optim.clip_coefficient, in float64; the kernel engines compute it as their graph step's kernel does)."""
        coef = clip_coefficient(math.sqrt(max(float(sumsq), 0.0)) / scale, grad_clip)
        return float(np.float32(coef) / np.float32(scale)) if scale != 1.0 else float(coef)

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
