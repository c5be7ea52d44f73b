"""NumpyEngine: the NumPy reference GPT (through checkpointing's policies) and AdamW on the CPU, fp32."""

from __future__ import annotations

import numpy as np

from ..params import ParamBuffer, init_params, num_params
from .core import Engine


class NumpyEngine(Engine):
    """The NumPy reference on the CPU (fp32)."""

    backend = "numpy"

    def __init__(self, cfg, policy, seed, betas, eps):
        from ..optim import decay_mask_for

        super().__init__(cfg, "fp32", policy, seed, betas, eps)
        self.params = init_params(cfg, seed=seed, dtype=np.float32)
        self.grads = ParamBuffer(cfg, dtype=np.float32)
        n = num_params(cfg)
        self.m, self.v = np.zeros(n, np.float32), np.zeros(n, np.float32)  # AdamW's moments (optim.AdamW's)
        self.decay = decay_mask_for(cfg)  # True where weight decay applies

    def forward(self, x, y=None):
        from ..checkpointing import gpt_forward_ckpt

        x, y = self._check_batch("forward", x, y)
        logits, loss, self._cache = gpt_forward_ckpt(self.params.views, self.cfg, x, y, policy=self.policy)
        return logits, (float(loss) if loss is not None else None)

    def backward(self, loss_scale=1.0):
        from ..checkpointing import gpt_backward_ckpt

        gpt_backward_ckpt(self._cache, self.grads.views)
        if loss_scale != 1.0:
            self.grads.flat *= np.float32(loss_scale)
        self._cache = None

    def train_step(self, x, y, lr, weight_decay=0.0, grad_clip=0.0, reduce_grads=None) -> dict:
        """Forward, backward, reduce_grads(grads_flat) if given (data parallel: the mean over ranks), clip, AdamW."""
        loss = self.forward(x, y)[1]  # the logits are not kept: (B, T, V) would stay alive through backward
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
        mask[: top - lo] = self.decay[lo:top]
        return mask

    def _adamw(self, st, lr, weight_decay, grad_scale):
        from ..optim import adamw_update

        if grad_scale != 1.0:  # the clip factor, applied to the gradient (as the kernels do)
            st.grads *= np.float32(grad_scale)
        adamw_update(st.params, st.grads, st.m, st.v, self.t, lr, self.betas, self.eps, float(weight_decay), st.decay)

    def eval_loss(self, x, y) -> float:
        from ..reference import gpt_forward

        x, y = self._check_batch("eval_loss", x, y)
        return float(gpt_forward(self.params.views, self.cfg, x, y)[1])

    def next_logits(self, context) -> np.ndarray:
        from ..reference import gpt_forward

        x, _ = self._check_batch("next_logits", np.asarray(context)[None, :])
        return gpt_forward(self.params.views, self.cfg, x, None)[0][0, -1].astype(np.float64)
