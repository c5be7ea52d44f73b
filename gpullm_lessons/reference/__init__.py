"""NumPy reference implementations: the ground truth every kernel in the course is checked against.

Each op lives in its own module with ``<op>_forward(...) -> (out, cache)`` and
``<op>_backward(dout, cache) -> grads`` side by side, and a docstring deriving the backward.
Caches are plain dicts (e.g. the attention cache has ``cache["qkv"]``, ``cache["att"]``, ``cache["n_head"]``),
except residual's, which is None. Everything computes in the dtype of its inputs (float32 or float64).
sdpa_forward / sdpa_backward (attention.py): attention on q, k, v as heads, causal or not, with a mask, Tq != Tk
(the flash kernels' oracle).
"""
from .attention import attention_backward, attention_forward, attention_mask, sdpa_backward, sdpa_forward
from .crossentropy import crossentropy_backward, crossentropy_forward
from .encoder import encoder_backward, encoder_forward
from .gelu import gelu_backward, gelu_forward
from .gpt import gpt_backward, gpt_forward
from .layernorm import layernorm_backward, layernorm_forward, layernorm_stats
from .linear import linear_backward, linear_forward
from .residual import residual_backward, residual_forward
from .softmax import softmax_backward, softmax_forward

OPS = ["encoder", "linear", "layernorm", "gelu", "softmax", "attention", "crossentropy", "residual"]

__all__ = [f"{op}_{way}" for op in OPS for way in ("forward", "backward")] + \
    ["layernorm_stats", "gpt_forward", "gpt_backward", "OPS", "sdpa_forward", "sdpa_backward", "attention_mask"]
