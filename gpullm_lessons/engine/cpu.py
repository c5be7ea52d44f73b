"""NumpyEngine: the NumPy reference GPT (through checkpointing's policies) and AdamW on the CPU, fp32 (AdamW's moments
in fp32, bf16 or block-wise 8 bits)."""

from __future__ import annotations

import numpy as np

from ..model.params import ParamBuffer, init_params, num_params
from ..reference.head import check_chunks
from .core import Engine


class NumpyEngine(Engine):
    """The NumPy reference on the CPU (fp32)."""

    backend = "numpy"

    def __init__(self, cfg, policy, seed, betas, eps, optimizer_state="fp32", ce_chunks=1):
        from ..model.optim import decay_mask_for

        super().__init__(cfg, "fp32", policy, seed, betas, eps, optimizer_state)
        self.ce_chunks = check_chunks("NumpyEngine", ce_chunks)  # the loss head in chunks of rows (reference/head.py)
        self.params = init_params(cfg, seed=seed, dtype=np.float32)
        self.grads = ParamBuffer(cfg, dtype=np.float32)
        n = num_params(cfg)
        # AdamW's moments (optim.AdamW's): fp32; "bf16": their bfloat16 bits (uint16, 4 bytes per parameter instead of
        # 8), each step reads them back to fp32, updates and rounds them to nearest even (optim.adamw_update_bf16)
        dt = np.uint16 if optimizer_state == "bf16" else np.float32
        self.m, self.v = np.zeros(n, dt), np.zeros(n, dt)
        self.decay = decay_mask_for(cfg)  # True where weight decay applies
        # optimizer_state "int8": m and v live only block-wise quantised (quant.quantize_moments: 2 bytes per
        # parameter instead of 8); each step reads them back to fp32, updates, and quantises them again
        self.moments_q = None
        if optimizer_state == "int8":
            self._quantize_moments()

    def _quantize_moments(self):
        from ..model.quant import quantize_moments

        self.moments_q = quantize_moments(self.m, self.v)
        self.m = self.v = np.zeros(0, np.float32)

    def optimizer_bytes(self) -> int:
        """Bytes of AdamW's moments as this engine stores them (fp32: 8 per parameter; bf16: 4; int8: 2, plus the
        scales)."""
        if self.moments_q is not None:
            return int(sum(a.nbytes for a in self.moments_q.values()))
        return super().optimizer_bytes()

    def _moments_state(self) -> dict:
        if self.moments_q is None:
            return super()._moments_state()
        return {k: a.copy() for k, a in self.moments_q.items()}  # int8 m, uint8 sqrt(v), their scales: as stored

    def _load_moments(self, moments: dict) -> None:
        if self.moment_format != "int8":
            return super()._load_moments(moments)
        nb = self.moments_q["m_scale"].shape
        for k in ("m_scale", "v_scale"):
            if np.shape(moments[k]) != nb:
                raise ValueError(f"load_state_dict: {k} has shape {np.shape(moments[k])}, this model needs {nb}")
        self.moments_q = {k: np.array(moments[k], copy=True) for k in ("m", "m_scale", "v", "v_scale")}

    def forward(self, x, y=None):
        from ..model.checkpointing import gpt_forward_ckpt

        x, y = self._check_batch("forward", x, y)
        logits, loss, self._cache = gpt_forward_ckpt(
            self.params.views, self.cfg, x, y, policy=self.policy, ce_chunks=self.ce_chunks
        )  # with ce_chunks > 1 and targets: the logits never exist whole (None), the head's backward already ran
        return logits, (float(loss) if loss is not None else None)

    def backward(self, loss_scale=1.0, grads_ready=None):
        """Every gradient of the last forward's loss (times loss_scale) written into self.grads; grads_ready(k) as
        soon as layer k's are final (forward_backward), each layer's scaled by loss_scale first."""
        from ..model.checkpointing import gpt_backward_ckpt
        from ..model.params import layer_segments

        scale = self.grads.flat.dtype.type(loss_scale)  # in the buffer's precision (float64 in the accumulation test)
        ready = None
        if grads_ready is not None:
            segments, g = layer_segments(self.cfg), self.grads.flat

            def ready(k):  # the same multiplication as the whole buffer's below, layer by layer
                if loss_scale != 1.0:
                    for _, lo, hi in segments[k]:
                        g[lo:hi] *= scale
                grads_ready(k)

        gpt_backward_ckpt(self._cache, self.grads.views, ready=ready)
        if loss_scale != 1.0 and grads_ready is None:
            self.grads.flat *= scale
        self._cache = None

    def train_step(self, x, y, lr, weight_decay=0.0, grad_clip=0.0, reduce_grads=None, micro_batches=1) -> dict:
        """Forward, backward (over `micro_batches` blocks of rows, gradients accumulated: forward_backward),
        reduce_grads(grads_flat) if given (data parallel: the mean over ranks), clip, AdamW."""
        loss = self.forward_backward(x, y, micro_batches)
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
        mask[: top - lo] = self.decay[lo:top]
        return mask

    def _adamw(self, st, lr, weight_decay, grad_scale):
        from ..model.optim import adamw_update

        if grad_scale != 1.0:  # the clip factor, applied to the gradient (as the kernels do)
            st.grads *= np.float32(grad_scale)
        if self.moments_q is not None:  # int8 moments: read back, update, quantise again
            from ..model.quant import dequantize_moments, quantize_moments

            m, v = dequantize_moments(self.moments_q)
            adamw_update(st.params, st.grads, m, v, self.t, lr, self.betas, self.eps, float(weight_decay), st.decay)
            self.moments_q = quantize_moments(m, v)
            return
        if self.moment_format == "bf16":  # bf16 moments: read back, update in fp32, round to nearest even
            from ..model.optim import adamw_update_bf16

            adamw_update_bf16(
                st.params, st.grads, st.m, st.v, self.t, lr, self.betas, self.eps, float(weight_decay), st.decay
            )
            return
        adamw_update(st.params, st.grads, st.m, st.v, self.t, lr, self.betas, self.eps, float(weight_decay), st.decay)

    def eval_loss(self, x, y) -> float:
        from ..reference import gpt_forward

        x, y = self._check_batch("eval_loss", x, y)
        return float(gpt_forward(self.params.views, self.cfg, x, y, ce_chunks=self.ce_chunks, head_grads=False)[1])

    def next_logits(self, context) -> np.ndarray:
        from ..reference import gpt_forward

        x, _ = self._check_batch("next_logits", np.asarray(context)[None, :])
        return gpt_forward(self.params.views, self.cfg, x, None)[0][0, -1].astype(np.float64)
