"""The NumPy backend: the reference ops (gpullm_lessons.reference) in the kernels' destination-passing form.

Same names and signatures as the Numba and HIP launchers, so a model or a benchmark can take any backend.
Each function writes every element of its outputs and returns nothing. Rows are flattened: N = B*T.
"""

from .. import reference as ref


def linear_backward(dout, inp, weight, dinp, dweight, dbias):
    """dout (N,OC), inp (N,C), weight (C,OC) -> dinp (N,C), dweight (C,OC), dbias (OC,)."""
    dinp[...], dweight[...], dbias[...] = ref.linear_backward(dout, {"inp": inp, "weight": weight, "has_bias": True})


def softmax_backward(dout, out, dinp):
    """dout, out (N,n) -> dinp (N,n)."""
    dinp[...] = ref.softmax_backward(dout, {"out": out})


def layernorm_backward(dout, inp, weight, mean, rstd, dinp, dweight, dbias, residual=None, dinp_half=None, half=None):
    """dout, inp (N,C), weight (C,), mean, rstd (N,) -> dinp (N,C), dweight (C,), dbias (C,); residual (N,C): added
    into dinp (the gradient that reaches the input past the sublayer); dinp_half (N,C) uint16: dinp's bits in
    `half` ("bf16" | "fp16"), rounded to nearest even."""
    cache = {"inp": inp, "weight": weight, "mean": mean, "rstd": rstd}
    dinp[...], dweight[...], dbias[...] = ref.layernorm_backward(dout, cache)
    if residual is not None:
        dinp += residual
    if dinp_half is not None:
        from ..model.precision import f32_to_bf16_bits

        bits = f32_to_bf16_bits(dinp) if half == "bf16" else dinp.astype("float16").view("uint16")
        dinp_half[...] = bits


def gelu_backward(dout, inp, dinp):
    """dout, inp (n,) -> dinp (n,)."""
    dinp[...] = ref.gelu_backward(dout, {"inp": inp})


def crossentropy_backward(logits, targets, dlogits):
    """logits (N,V), targets (N,) -> dlogits (N,V) for the mean loss over the N rows."""
    _, cache = ref.crossentropy_forward(logits, targets)
    dlogits[...] = ref.crossentropy_backward(1.0, cache)


def attention_backward(dout, qkv, att, dqkv, n_head):
    """dout (B,T,C), qkv (B,T,3C), att (B,nh,T,T) -> dqkv (B,T,3C)."""
    dqkv[...] = ref.attention_backward(dout, {"qkv": qkv, "att": att, "n_head": n_head})


def encoder_backward(dout, idx, dwte, dwpe, accumulate=False):
    """dout (B,T,C), idx (B,T) -> dwte (V,C), dwpe (maxT,C): zeroed, then scatter-added (accumulate=True: dwte's
    sums added to what it holds)."""
    cache = {"idx": idx, "V": dwte.shape[0], "maxT": dwpe.shape[0], "dtype": dwte.dtype}
    g_wte, dwpe[...] = ref.encoder_backward(dout, cache)
    if accumulate:
        dwte += g_wte
    else:
        dwte[...] = g_wte


def residual_backward(dout, da, db):
    """dout -> da = db = dout."""
    da[...], db[...] = ref.residual_backward(dout, None)
