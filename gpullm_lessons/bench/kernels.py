"""The kernel benchmark and the measured ceilings of this machine (GPU only; cupy imported lazily; the clocks and
the validate-then-time core are bench/timing.py's: `timing.time_gpu_graph`, `timing.validate_then_time` etc.).

A kernel's speed means something only beside the ceiling measured on the same card in the same run:
device-to-device copy bandwidth for memory-bound kernels, cuBLAS matmul rate for compute-bound ones.
Without a GPU, lessons show a stored measurement instead (``stored_ceilings()``, with its card and date).

    python -m gpullm_lessons.bench ceilings [--json PATH]
    python -m gpullm_lessons.bench kernels [--ops softmax,layernorm] [--json PATH] [--plot roofline.png]
    python -m gpullm_lessons.bench timeline [--presets course]   (one eager and one CUDA-graph step, CUPTI trace)
    python -m gpullm_lessons.bench ncu [--ops softmax,layernorm,crossentropy,adamw] [--json PATH]  (Nsight Compute)
    python -m gpullm_lessons.bench train | checkpointing [--presets course,gpt2]   (gpullm_lessons/bench/train_step.py)
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import json
import sys
import textwrap
import time
from typing import Callable, Optional

import numpy as np

from .. import device
from .timing import (_array_module, copy_bandwidth, matmul_rate, time_gpu, time_gpu_graph, time_host, time_torch_graph,
                     validate_then_time, wrong_message)


def ceilings(small: bool = False) -> dict:
    """Copy bandwidth and matmul rates of this GPU, with the card's name and the date."""
    info = device.require_gpu("measuring ceilings")
    n = 2048 if small else 8192
    out = {"card": info.gpu.name, "date": datetime.date.today().isoformat(),
           "copy": copy_bandwidth(256 * 2**20 if small else 2 * 2**30),
           "matmul_fp32": matmul_rate(n, "float32"),
           "matmul_fp16": matmul_rate(n, "float16")}
    try:
        out["matmul_bf16"] = matmul_rate(n, "bfloat16")
    except Exception as e:  # noqa: BLE001 - older CuPy/hipBLAS without bf16 matmul: say so, keep the rest
        out["matmul_bf16"] = {"what": "matmul bf16", "error": f"{type(e).__name__}: {e}"}
    return out


def stored_ceilings() -> dict:
    """The ceilings measured on the course's reference GPU (see the file's card and date)."""
    from . import stored
    return stored.require("ceilings_h200")


# The card makers' peak figures (dense: no 2:4 sparsity), beside which the measured ceilings are read: a kernel's
# "fraction of the measured copy rate" says how close it is to what this card achieves, "of spec" how close to
# the datasheet. Keyed by the name the driver reports.
SPEC_PEAKS = {
    "NVIDIA H200": {"source": "NVIDIA H200 SXM datasheet (dense)", "hbm_GB/s": 4800.0, "fp32_TFLOP/s": 67.0,
                    "tf32_tc_TFLOP/s": 494.5, "bf16_tc_TFLOP/s": 989.5, "fp16_tc_TFLOP/s": 989.5},
}


def spec_peaks(card: str) -> Optional[dict]:
    """The datasheet peaks of `card` (None for a card the course has no figures for)."""
    return SPEC_PEAKS.get(card)


def format_ceilings(c: dict) -> str:
    """Measured ceilings, each beside the card's datasheet peak and the fraction of it reached."""
    spec = c.get("spec") or spec_peaks(c["card"]) or {}

    def of_spec(value, key):
        peak = spec.get(key)
        return f"  spec {peak:6.0f}  ({100 * value / peak:3.0f}% of spec)" if peak else ""
    lines = [f"{c['card']} ({c['date']})" + (f"; spec: {spec['source']}" if spec else ""),
             f"  {'copy bandwidth':<24}{c['copy']['GB/s']:7.0f} GB/s   " + of_spec(c['copy']['GB/s'], "hbm_GB/s")]
    keys = {"matmul_fp32": "fp32_TFLOP/s", "matmul_fp16": "fp16_tc_TFLOP/s", "matmul_bf16": "bf16_tc_TFLOP/s"}
    for key, spec_key in keys.items():
        m = c.get(key)
        if m and "TFLOP/s" in m:
            lines.append(f"  {m['what']:<24}{m['TFLOP/s']:7.1f} TFLOP/s" + of_spec(m['TFLOP/s'], spec_key))
    if spec:
        lines.append("  (fp32: FMA units, no tensor cores; fp16/bf16: dense tensor-core peak)")
    return "\n".join(lines)


# ---- kernel benchmarks ----------------------------------------------------------------------------------------

@dataclasses.dataclass
class Case:
    """One op at one shape: how to build its arguments on the GPU, what it moves and computes, PyTorch's version."""
    op: str
    shape: str
    make: Callable  # (rng) -> tuple of CuPy arrays (+ int scalars) in the launcher's argument order
    bytes: int  # minimum bytes a kernel must read + write
    flops: int
    torch: Optional[Callable] = None  # (args as torch tensors) -> runs PyTorch's kernel for the same op
    bound: str = "memory"  # which ceiling judges it: "memory" (copy GB/s), "compute" (fp32 matmul TFLOP/s) or
    # "compute_bf16" (bf16 matmul TFLOP/s: kernels on the matrix units)
    launcher: str = ""  # the backends' launcher name; "" means f"{op}_backward" (adamw: "adamw_step")
    family: str = ""  # the op whose versions the backends list (backends.<b>.versions); "" means op
    backends: tuple = ("numba", "hip")  # the kernel backends whose launcher takes these arguments
    # validate, then time (case_rows): what a call writes, what it should write, how close it must come
    outputs: dict = dataclasses.field(default_factory=dict)  # {name: index of the argument the launcher writes}
    reference: Optional[Callable] = None  # (the arguments as NumPy arrays) -> {name: expected values, float64}
    tol: float = 1e-5  # the largest max_err a right version reaches (max_error's measure), from the op's tests
    inplace: tuple = ()  # indices of inputs the call overwrites (adamw: p, g, m, v): restored before each check
    torch_outputs: tuple = ()  # the names (of `reference`'s) of what `torch` returns, in order
    torch_why_not: str = ""  # when torch_outputs is empty: why PyTorch's row cannot be validated

    def launcher_name(self) -> str:
        return self.launcher or f"{self.op}_backward"


def _cases(small: bool, xp=None, flash_shape=None) -> list:
    """The benchmark's cases. xp: the array module the inputs are made with (default CuPy; NumPy lets the tests
    check the cases' references and outputs without a GPU). flash_shape: (B, nh, T, hs) of the flash cases in place
    of their benchmark shape (validate: a version checked at another sequence length)."""
    if xp is None:
        import cupy as xp
    cp = xp
    f32 = cp.float32

    def randn(rng, *shape):
        return cp.asarray(rng.standard_normal(shape, dtype=np.float32))

    def softmax_out(rng, N, n):
        x = randn(rng, N, n)
        e = cp.exp(x - x.max(axis=1, keepdims=True))
        return e / e.sum(axis=1, keepdims=True)

    # Tolerances (max_error: the largest |got - expected| of an output over its largest |expected|) from the op's
    # tests, widened where the benchmark's sums are longer than the tests' (16384 rows, 3072 columns): a right fp32
    # version stays near 1e-6; a wrong one (a tile skipped, a term missing, NaN) is off by orders of magnitude.
    N = 2048 if small else 16384
    n, C, V, Nce = 1024, 768, 50304, (1024 if small else 8192)
    cases = [
        Case("softmax", f"{N}x{n}", lambda r: (randn(r, N, n), softmax_out(r, N, n), cp.empty((N, n), f32)),
             3 * N * n * 4, 4 * N * n,
             torch=lambda t: __import__("torch")._softmax_backward_data(t[0], t[1], -1, t[0].dtype),
             outputs={"dinp": 2}, reference=_ref_softmax, tol=2e-5, torch_outputs=("dinp",)),
        Case("layernorm", f"{N}x{C}", lambda r: (randn(r, N, C), randn(r, N, C), randn(r, C), randn(r, N),
                                                 cp.abs(randn(r, N)) + 0.5, cp.empty((N, C), f32), cp.empty(C, f32),
                                                 cp.empty(C, f32)),
             (3 * N * C + 2 * N + 3 * C) * 4, 12 * N * C,
             torch=lambda t: __import__("torch").ops.aten.native_layer_norm_backward(
                 t[0], t[1], [t[1].shape[1]], t[3][:, None], t[4][:, None], t[2], t[2], [True, True, True]),
             outputs={"dinp": 5, "dweight": 6, "dbias": 7}, reference=_ref_layernorm, tol=1e-4,
             torch_outputs=("dinp", "dweight", "dbias")),
        Case("gelu", f"{N * 4 * C}", lambda r: (randn(r, N * 4 * C), randn(r, N * 4 * C), cp.empty(N * 4 * C, f32)),
             3 * N * 4 * C * 4, 20 * N * 4 * C,
             torch=lambda t: __import__("torch").ops.aten.gelu_backward(t[0], t[1], approximate="tanh"),
             outputs={"dinp": 2}, reference=_ref_gelu, tol=2e-5, torch_outputs=("dinp",)),
        Case("crossentropy", f"{Nce}x{V}", lambda r: (randn(r, Nce, V), cp.asarray(r.integers(0, V, Nce, dtype=np.int32)),
                                                       cp.empty((Nce, V), f32)),
             2 * Nce * V * 4 + Nce * 4, 5 * Nce * V,
             torch=_torch_crossentropy_backward,
             outputs={"dlogits": 2}, reference=_ref_crossentropy, tol=2e-5, torch_outputs=("dlogits",)),
        Case("linear", f"N{N} C{C} OC{4 * C}", lambda r: (randn(r, N, 4 * C), randn(r, N, C), randn(r, C, 4 * C),
                                                          cp.empty((N, C), f32), cp.empty((C, 4 * C), f32),
                                                          cp.empty(4 * C, f32)),
             (2 * N * C + 2 * C * 4 * C + N * 4 * C + 4 * C) * 4, 4 * N * C * 4 * C + N * 4 * C, bound="compute",
             torch=lambda t: (t[0] @ t[2].T, t[1].T @ t[0], t[0].sum(0)),
             outputs={"dinp": 3, "dweight": 4, "dbias": 5}, reference=_ref_linear, tol=1e-4,
             torch_outputs=("dinp", "dweight", "dbias")),
    ]
    Bt, T, Ve = (4, 256, V) if small else (16, 1024, V)
    cases.append(Case("encoder", f"B{Bt} T{T} C{C} V{Ve}",
                      lambda r: (randn(r, Bt, T, C), cp.asarray(r.integers(0, Ve, (Bt, T), dtype=np.int32)),
                                 cp.empty((Ve, C), f32), cp.empty((T, C), f32)),
                      (Bt * T * C + Ve * C + T * C) * 4 + Bt * T * 4, 2 * Bt * T * C,
                      torch=lambda t: (__import__("torch").ops.aten.embedding_dense_backward(t[0], t[1].long(), t[2].shape[0],
                                                                                              -1, False), t[0].sum(0)),
                      outputs={"dwte": 2, "dwpe": 3}, reference=_ref_encoder, tol=2e-5,
                      torch_outputs=("dwte", "dwpe")))
    Ba, Ta, nh = (2, 256, 12) if small else (4, 512, 12)
    hs = C // nh

    def attention_inputs(r):
        qkv = randn(r, Ba, Ta, 3 * C)
        q = qkv[:, :, :C].reshape(Ba, Ta, nh, hs).transpose(0, 2, 1, 3)
        k = qkv[:, :, C:2 * C].reshape(Ba, Ta, nh, hs).transpose(0, 2, 1, 3)
        s = cp.matmul(q, k.transpose(0, 1, 3, 2)) / np.float32(np.sqrt(hs))
        s = cp.where(cp.tri(Ta, dtype=bool), s, cp.float32(-cp.inf))
        e = cp.exp(s - s.max(axis=-1, keepdims=True))
        att = cp.ascontiguousarray(e / e.sum(axis=-1, keepdims=True))
        return randn(r, Ba, Ta, C), qkv, att, cp.empty((Ba, Ta, 3 * C), f32), nh

    # FLOPs: four (T x T x hs) products per head, counted in full (the causal kernels skip about half)
    cases.append(Case("attention", f"B{Ba} T{Ta} nh{nh} C{C}", attention_inputs,
                      (7 * Ba * Ta * C + 2 * Ba * nh * Ta * Ta) * 4, 8 * Ba * nh * Ta * Ta * hs, bound="compute",
                      outputs={"dqkv": 3}, reference=_ref_attention, tol=1e-4))

    cases += _flash_cases(small, randn, cp, flash_shape)

    # AdamW step over one flat fp32 buffer (GPT-2 124M: ~124M parameters). Bytes per parameter that the fused kernel
    # moves: reads p, g, m, v (16) + writes p, m, v (12) + writes the zeroed g (4) = 32. PyTorch's fused AdamW
    # does not zero the gradient (28 bytes; zero_grad is a separate pass), so its GB/s here counts 4 bytes it skips.
    # Hyperparameters after the buffers: lr, beta1, beta2, eps, weight_decay, step (a late step: bias corrections ~1).
    Np = 1_000_000 if small else 124_000_000
    cases.append(Case("adamw", f"{Np}", lambda r: (randn(r, Np), randn(r, Np), randn(r, Np) * 0.01,
                                                   cp.abs(randn(r, Np)) * 1e-4, 6e-4, 0.9, 0.95, 1e-8, 0.1, 1000),
                      32 * Np, 16 * Np, torch=_torch_adamw(), launcher="adamw_step",
                      outputs={"params": 0, "grads": 1, "m": 2, "v": 3}, inplace=(0, 1, 2, 3),
                      reference=_ref_adamw, tol=1e-5,
                      torch_why_not="PyTorch's AdamW keeps its own m, v and step count (bias correction of "
                                    "its step 1, not 1000): another update"))
    return cases


def _flash_cases(small: bool, randn, cp=None, shape=None) -> list:
    """Flash attention forward and backward (lesson 11) at GPT-2's head shape, float32, causal. Bytes: the minimum,
    every input read once and every output written once (the (T, T) scores never stored); FLOPs: the causal half of
    the products, 2 of them (T x T x hs, 2 FLOPs per multiply-add) in the forward, 5 in the backward (S recomputed,
    dP, dV, dQ, dK). The bf16 cases round q, k, v, dout to bf16 first, and the backward's out and lse are the
    forward of those rounded values (what a training step hands the backward)."""
    if cp is None:
        import cupy as cp

    B, nh, T, hs = shape or ((1, 12, 256, 64) if small else (4, 12, 1024, 64))
    heads, f32 = B * nh, cp.float32
    shape = (B, nh, T, hs)

    def fwd_args(r):
        return (*(randn(r, *shape) for _ in range(3)), cp.empty(shape, f32), cp.empty((B, nh, T), f32))

    def bwd_args(r, rounded=lambda x: x):
        q, k, v, out, lse = fwd_args(r)
        q, k, v = rounded(q), rounded(k), rounded(v)
        s = cp.matmul(q, k.transpose(0, 1, 3, 2)) / np.float32(np.sqrt(hs))
        s = cp.where(cp.tri(T, dtype=bool), s, cp.float32(-cp.inf))
        m = s.max(axis=-1, keepdims=True)
        e = cp.exp(s - m)
        out[...] = cp.matmul(e / e.sum(axis=-1, keepdims=True), v)
        lse[...] = (m + cp.log(e.sum(axis=-1, keepdims=True)))[..., 0]
        del s, e
        return q, k, v, out, randn(r, *shape), lse, cp.empty(shape, f32), cp.empty(shape, f32), cp.empty(shape, f32)

    def bf16(x):  # float32 -> bfloat16 bits (uint16), round to nearest even
        from gpullm_lessons.model.precision import f32_to_bf16_bits

        return cp.asarray(f32_to_bf16_bits(_to_host(x)))

    def bf16_values(x):  # float32 -> the float32 values of its bf16 rounding
        from gpullm_lessons.model.precision import bf16_bits_to_f32

        return cp.asarray(bf16_bits_to_f32(_to_host(bf16(x))))

    def fwd_bf16(r):
        q, k, v, out, lse = fwd_args(r)
        return bf16(q), bf16(k), bf16(v), out, lse

    def bwd_bf16(r):
        q, k, v, out, dout, lse, dq, dk, dv = bwd_args(r, bf16_values)
        return bf16(q), bf16(k), bf16(v), out, bf16(dout), lse, dq, dk, dv

    label = f"B{B} nh{nh} T{T} hs{hs}"
    causal = heads * T * T * hs  # multiply-adds of one causal-half T x T x hs product, x2 FLOPs
    hbytes = (3 * 2 * T * hs + 4 * T * hs + 4 * T) * heads  # q, k, v bf16 read; out fp32, lse written
    hbytes_bwd = (4 * 2 * T * hs + 4 * T * hs + 4 * T + 3 * 4 * T * hs) * heads  # + dout, out, lse; dq, dk, dv
    fwd_out, bwd_out = {"out": 3, "lse": 4}, {"dq": 6, "dk": 7, "dv": 8}
    # tolerances: tests/test_kernels_flash.py (fp32, 2e-5 of the output's magnitude at shorter rows; 1e-4 here at
    # T = 1024) and tests/test_hip_flash.py (bf16: 2e-2, P and dS rounded to bf16 for the products)
    return [
        Case("flash_fwd", label, fwd_args, (4 * T * hs + T) * heads * 4, 2 * causal * 2, bound="compute",
             torch=_torch_sdpa_forward, launcher="flash_attention_forward", family="flash_attention",
             backends=("numba",), outputs=fwd_out, reference=_ref_flash_forward, tol=1e-4, torch_outputs=("out",)),
        Case("flash_bwd", label, bwd_args, (8 * T * hs + T) * heads * 4, 5 * causal * 2, bound="compute",
             torch=_torch_sdpa_backward(), launcher="flash_attention_backward", family="flash_attention",
             backends=("numba",), outputs=bwd_out, reference=_ref_flash_backward, tol=1e-4,
             torch_outputs=("dq", "dk", "dv")),
        # bf16 inputs: HIP's versions (flash.py's VERSIONS, v2 to v6, and VARIANTS) on the matrix units beside
        # PyTorch's flash kernel (SDPA on bf16 tensors)
        Case("flash_fwd_bf16", label, fwd_bf16, hbytes, 2 * causal * 2, bound="compute_bf16",
             torch=_torch_sdpa_forward_bf16, launcher="flash_attention_forward", family="flash_attention",
             backends=("hip",), outputs=fwd_out, reference=_ref_flash_forward, tol=2e-2, torch_outputs=("out",)),
        Case("flash_bwd_bf16", label, bwd_bf16, hbytes_bwd, 5 * causal * 2, bound="compute_bf16",
             torch=_torch_sdpa_backward_bf16(), launcher="flash_attention_backward", family="flash_attention",
             backends=("hip",), outputs=bwd_out, reference=_ref_flash_backward, tol=2e-2,
             torch_outputs=("dq", "dk", "dv")),
    ]


# ---- the cases' references: the arguments as NumPy arrays -> {output name: expected values}, in float64 ----------
# Each is lesson 01's NumPy reference of the op (gpullm_lessons/reference/) on the benchmark's own inputs.

def _f64(a):
    return np.asarray(a, dtype=np.float64)


def _ref_softmax(a):
    from ..reference import softmax_backward
    return {"dinp": softmax_backward(_f64(a[0]), {"out": _f64(a[1])})}


def _ref_layernorm(a):
    from ..reference import layernorm_backward
    dinp, dweight, dbias = layernorm_backward(_f64(a[0]), {"inp": _f64(a[1]), "weight": _f64(a[2]),
                                                           "mean": _f64(a[3]), "rstd": _f64(a[4])})
    return {"dinp": dinp, "dweight": dweight, "dbias": dbias}


def _ref_gelu(a):
    from ..reference import gelu_backward
    return {"dinp": gelu_backward(_f64(a[0]), {"inp": _f64(a[1])})}


def _ref_crossentropy(a):
    from ..reference import crossentropy_backward, crossentropy_forward
    _, cache = crossentropy_forward(_f64(a[0]), np.asarray(a[1]))
    return {"dlogits": crossentropy_backward(1.0, cache)}          # the mean over the N rows, as the kernels


def _ref_linear(a):
    from ..reference import linear_backward
    dinp, dweight, dbias = linear_backward(_f64(a[0]), {"inp": _f64(a[1]), "weight": _f64(a[2]), "has_bias": True})
    return {"dinp": dinp, "dweight": dweight, "dbias": dbias}


def _ref_encoder(a):
    from ..reference import encoder_backward
    dout, idx, dwte, dwpe = a[0], np.asarray(a[1]), a[2], a[3]
    out = encoder_backward(_f64(dout), {"idx": idx, "V": dwte.shape[0], "maxT": dwpe.shape[0], "dtype": np.float64})
    return {"dwte": out[0], "dwpe": out[1]}


def _ref_attention(a):
    from ..reference import attention_backward
    return {"dqkv": attention_backward(_f64(a[0]), {"qkv": _f64(a[1]), "att": _f64(a[2]), "n_head": int(a[4])})}


def _flash_values(x):
    """q, k, v or dout as float64: bf16 bits (uint16) read as their values."""
    x = np.asarray(x)
    if x.dtype == np.uint16:
        from ..model.precision import bf16_bits_to_f32
        x = bf16_bits_to_f32(x)
    return _f64(x)


def _ref_flash_forward(a):
    from ..checks.flash import reference                 # lesson 01's attention, with lse from the masked scores
    out, lse = reference(*(_flash_values(x) for x in a[:3]))
    return {"out": out, "lse": lse}


def _ref_flash_backward(a):
    from ..checks.flash import reference
    q, k, v, dout = (_flash_values(x) for x in (a[0], a[1], a[2], a[4]))
    _, _, dq, dk, dv = reference(q, k, v, dout)
    return {"dq": dq, "dk": dk, "dv": dv}


def _ref_adamw(a):
    from ..model.optim import adamw_update
    p, g, m, v = (_f64(x).copy() for x in a[:4])
    lr, beta1, beta2, eps, weight_decay, step = a[4:10]
    adamw_update(p, g, m, v, step, lr, (beta1, beta2), eps, weight_decay)
    return {"params": p, "grads": np.zeros_like(g), "m": m, "v": v}   # the kernels zero the gradient


def _torch_sdpa_forward(t):
    """PyTorch's fused attention (scaled_dot_product_attention, causal) on the same float32 q, k, v."""
    import torch
    return torch.nn.functional.scaled_dot_product_attention(t[0], t[1], t[2], is_causal=True)


def _torch_sdpa_forward_bf16(t):
    """PyTorch's flash attention forward (SDPA, causal) on the same bf16 q, k, v (the uint16 bits viewed as bf16)."""
    import torch
    q, k, v = (x.view(torch.bfloat16) for x in t[:3])
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def _torch_sdpa_backward_bf16():
    """PyTorch's flash attention backward on the same bf16 q, k, v, dout: its own forward runs once, outside the timed
    calls, for the output and log-sum-exp it saves."""
    state = {}

    def run(t):
        import torch
        q, k, v, dout = (x.view(torch.bfloat16) for x in (t[0], t[1], t[2], t[4]))
        T = q.shape[2]
        if "fwd" not in state:
            state["fwd"] = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)
        out, lse, cq, ck, mq, mk, seed, offset, _ = state["fwd"]
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, cq, ck, T, T, 0.0, True, seed, offset)
    return run


def _torch_sdpa_backward():
    """PyTorch's fused attention backward for float32 (the memory-efficient kernel; flash needs 16-bit inputs): its
    own forward runs once, outside the timed calls, for the log-sum-exp it saves."""
    state = {}

    def run(t):
        import torch
        q, k, v, dout = t[0], t[1], t[2], t[4]
        if "fwd" not in state:
            state["fwd"] = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, True)
        out, lse, seed, offset = state["fwd"]
        return torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, None, out, lse, seed, offset, 0.0, [True, True, True, False], True)
    return run


def _torch_adamw():
    """PyTorch's fused AdamW step over one flat Parameter viewing the same CuPy buffers (built on the first call)."""
    state = {}

    def run(t):
        import torch
        if "opt" not in state:
            p = torch.nn.Parameter(t[0])          # shares memory with the CuPy params (torch.as_tensor)
            p.grad = t[1]
            opt = torch.optim.AdamW([p], lr=t[4], betas=(t[5], t[6]), eps=t[7], weight_decay=t[8], fused=True)
            opt.step()                            # creates the state (exp_avg, exp_avg_sq) on the first call
            state["opt"] = opt
        state["opt"].step()
    return run


def _torch_crossentropy_backward(t):
    """PyTorch's fused path for the same math: softmax + NLL backward without a separate probabilities tensor."""
    import torch
    logits = t[0]
    lsm = torch._log_softmax(logits, 1, False)
    # reduction 1 (the mean) divides by total_weight: the number of rows counted (no class weights, none ignored)
    total = torch.tensor(float(logits.shape[0]), device=logits.device)
    grad = torch.ops.aten.nll_loss_backward(torch.ones((), device=logits.device), lsm, t[1].long(), None, 1, -100,
                                            total)
    return torch._log_softmax_backward_data(grad, lsm, 1, logits.dtype)


# ---- validate, then time: the core (max_error, validate_then_time, wrong_message) lives in bench/timing.py, beside
# the clocks, so that both benchmarks share it; the row fields are described there --------------------------------

def _to_host(a):
    """A CuPy array as a NumPy one; anything else unchanged."""
    return a.get() if type(a).__module__.split(".")[0] == "cupy" and hasattr(a, "get") else a


def _torch_output(t):
    """What a PyTorch op returned, as an array max_error reads (a CUDA tensor: a CuPy float32 view or copy)."""
    if hasattr(t, "detach"):
        import cupy as cp
        return cp.asarray(t.detach().float().contiguous())
    return t


def case_rows(case, args, runs, timer, recover=None) -> list:
    """Validate, then time, each (backend, version, run) of `runs` (case_runs) on the case's arguments `args`: one
    row per run, {"op", "shape", "backend", "version", **validate_then_time(...)}.

    The expected outputs are case.reference on the arguments (copied to the host, float64), computed once. Before a
    kernel's check its outputs are filled with NaN (an element it never writes shows) and the inputs it overwrites
    (case.inplace) are restored; PyTorch's row is compared through what it returns (case.torch_outputs), or not at
    all (case.torch_why_not). timer(run, backend) -> the row's times. recover(): called after a row that is not ok
    (a failed launch can leave an error behind). Works on NumPy arguments as on CuPy ones."""
    arrays = [a for a in args if hasattr(a, "shape") and hasattr(a, "dtype")]
    xp = _array_module(arrays[0]) if arrays else np
    expected = None
    if case.reference is not None:
        expected = {k: xp.asarray(v) for k, v in case.reference([_to_host(a) for a in args]).items()}
    saved = {i: args[i].copy() for i in case.inplace}

    def restore():
        for i, a in saved.items():
            args[i][...] = a

    def poison():
        restore()
        for i in case.outputs.values():
            if i not in saved:
                args[i].fill(np.nan)

    def written(_returned):
        return {name: args[i] for name, i in case.outputs.items()}

    def returned(value):
        value = value if isinstance(value, (tuple, list)) else (value,)
        if len(value) < len(case.torch_outputs):
            raise ValueError(f"PyTorch's op returned {len(value)} values, expected {', '.join(case.torch_outputs)}")
        return {name: _torch_output(t) for name, t in zip(case.torch_outputs, value)}

    rows = []
    for bname, version, run in runs:
        row = {"op": case.op, "shape": case.shape, "backend": bname, "version": version}
        if bname != "torch":
            checked = validate_then_time(run, written, expected, case.tol, lambda r, b=bname: timer(r, b),
                                         prepare=poison, why_not="the case has no reference")
        elif case.torch_outputs and expected is not None:
            want = {name: expected[name] for name in case.torch_outputs}
            checked = validate_then_time(run, returned, want, case.tol, lambda r: timer(r, "torch"), prepare=restore)
        else:
            checked = validate_then_time(run, None, None, case.tol, lambda r: timer(r, "torch"),
                                         why_not=case.torch_why_not or "PyTorch's op returns nothing to compare")
        if checked["status"] in ("wrong", "error") and recover is not None:
            recover()
        rows.append(dict(row, **checked))
    del expected
    return rows


def unvalidated_rows(result: dict) -> list:
    """The measurement rows of `result` (bench kernels: rows with op, shape, backend, version; bench train: rows
    with preset, precision, who) that carry no validation: no "validation" dict, or one with neither a max_err
    (or raised) nor a why_not. Each as "op backend version" / "preset precision who". Rows of other results
    (ncu, gputime, checkpointing, ...) are not measurement rows of a validated benchmark and are left out."""
    out = []
    for r in result.get("rows") or []:
        if not isinstance(r, dict):
            continue
        if all(k in r for k in ("op", "shape", "backend", "version")):
            label = f"{r['op']} {r['backend']} {r['version']}"
        elif all(k in r for k in ("preset", "precision", "who")):
            label = f"{r['preset']} {r['precision']} {r['who']}"
        else:
            continue
        v = r.get("validation")
        if not isinstance(v, dict) or not ("max_err" in v or v.get("raised") or v.get("why_not")):
            out.append(label)
    return out


def _backends():
    """(name, module) for each kernel backend that imports here."""
    out = []
    for name in ("numba", "hip"):
        if name == "numba" and not device.numba_on_gpu():
            continue  # on ROCm Numba kernels run in the simulator: nothing to time
        try:
            out.append((name, importlib.import_module(f"gpullm_lessons.backends.{name}")))
        except ImportError:
            continue
    return out


def case_runs(case, args) -> list:
    """(backend, version, call) for every kernel version of every backend that runs here, and PyTorch's op."""
    import cupy as cp
    runs = []
    for bname, mod in _backends():
        if bname not in case.backends:
            continue
        fn = getattr(mod, case.launcher_name(), None)
        for version in (mod.versions(case.family or case.op) if fn is not None else []):
            runs.append((bname, version, lambda fn=fn, version=version: fn(*args, version=version)))
        for label, kw in (getattr(mod, "variants", lambda name: [])(case.launcher_name()) if fn is not None else []):
            runs.append((bname, label, lambda fn=fn, kw=kw: fn(*args, **kw)))
    try:
        import torch
    except Exception:  # noqa: BLE001 - PyTorch is optional
        torch = None
    if torch is not None and case.torch is not None:
        targs = [torch.as_tensor(a, device="cuda") if isinstance(a, cp.ndarray) else a for a in args]
        runs.append(("torch", torch.__version__, lambda: case.torch(targs)))
    return runs


def bench_kernels(ops=None, small: bool = False, iters: int = 20, on_case: Optional[Callable] = None) -> dict:
    """Validate, then time, every version of every kernel backend on each case, beside PyTorch, against this run's
    ceilings.

    Each version first runs once on the case's inputs and its outputs are compared with the NumPy reference
    (case_rows, validate_then_time): a wrong one (an error above the case's tolerance, NaN/inf, or an exception) is a
    row with status "wrong", its validation and no time. One GPU-time measurement for every right row: `iters`
    calls captured in a CUDA graph and replayed (`time_gpu_graph` for Numba and HIP launchers, which launch on CuPy's
    current stream; `time_torch_graph` for PyTorch), marked 'graph'. A call that cannot be captured falls back to
    queued launches between events ('queued'). Beside it, host_ms: the CPU's time to issue one call from Python (the
    launch overhead a loop of eager launches pays), and ms_queued: the GPU time of the same calls queued from
    Python, which is the larger of the two.

    on_case(result): called after each case with the result so far (marked "partial": True), e.g. to write it, so that
    a run cut short keeps the cases it finished; each case's seconds go to stderr."""
    info = device.require_gpu("benchmarking kernels")
    import cupy as cp
    ceil = ceilings(small=small)
    rows = []
    rng = np.random.default_rng(0)

    def timer(run, bname):
        t_queued = time_gpu(run, warmup=3, iters=iters, reps=3)
        t_host = time_host(run, iters=iters, reps=3)
        t, timing = _graph_time(run, bname, iters), "graph"
        if t is None:                              # not capturable (e.g. a host sync inside): the queued time
            t, timing = t_queued, "queued"
        return {"ms": t * 1e3, "host_ms": t_host * 1e3, "ms_queued": t_queued * 1e3, "timing": timing}

    def result(partial: bool) -> dict:
        out = {"card": info.gpu.name, "date": datetime.date.today().isoformat(), "ceilings": ceil,
               "spec": spec_peaks(info.gpu.name), "iters": iters,
               "timing": f"ms: GPU time per call, a CUDA graph of {iters} calls replayed; host_ms: Python's time to "
                         f"issue one call; ms_queued: the same calls queued from Python between events",
               "validation_rule": "each row's outputs against the NumPy reference (float64) before timing: max_err "
                                  "= the largest |error| of an output over its largest |value|; a row above tol is "
                                  "'wrong', untimed",
               "rows": rows}
        return {**out, "partial": True} if partial else out

    for case in _cases(small):
        if ops and case.op not in ops:
            continue
        started = time.perf_counter()
        args = case.make(rng)
        for row in case_rows(case, args, case_runs(case, args), timer, recover=_recover):
            if "ms" in row:
                t = row["ms"] / 1e3
                gbs, tflops = case.bytes / t / 1e9, case.flops / t / 1e12
                frac = (gbs / ceil["copy"]["GB/s"] if case.bound == "memory"
                        else tflops / ceil[_CEILING[case.bound]]["TFLOP/s"])
                row.update(bytes=case.bytes, flops=case.flops, **{"GB/s": gbs, "TFLOP/s": tflops},
                           bound=case.bound, fraction_of_ceiling=frac)
            rows.append(row)
        del args
        cp.get_default_memory_pool().free_all_blocks()
        print(f"bench kernels: {case.op} {case.shape}: {time.perf_counter() - started:.1f} s", file=sys.stderr,
              flush=True)
        if on_case is not None:
            on_case(result(partial=True))
    return result(partial=False)


def validate(ops, versions=None, flash_shape=None, seed=0) -> list:
    """Validate only: run each kernel version of the cases `ops` once on fresh inputs and compare its outputs with
    the NumPy reference, as bench_kernels does before it times a version (case_rows), without timing anything.
    versions: only these (e.g. ["v2"]; None: every version of every backend here, PyTorch's op left out).
    flash_shape: (B, nh, T, hs) for the flash cases (e.g. a T that is not a multiple of any tile). Returns the rows
    ({"op", "shape", "backend", "version", "status": "ok" | "wrong", "validation"}, "error" when wrong)."""
    known = {c.op for c in _cases(True, np)}
    unknown = [op for op in ops if op not in known]
    if unknown:
        raise ValueError(f"no benchmark case {', '.join(map(repr, unknown))}; the cases are {', '.join(sorted(known))}")
    device.require_gpu("validating kernel versions")
    import cupy as cp

    rng, rows = np.random.default_rng(seed), []
    for case in _cases(False, flash_shape=flash_shape):
        if case.op not in ops:
            continue
        args = case.make(rng)
        runs = [r for r in case_runs(case, args) if r[0] != "torch" and (versions is None or r[1] in versions)]
        if not runs:
            raise ValueError(f"{case.op}: no version {versions} runs here")
        rows += case_rows(case, args, runs, lambda run, backend: {}, recover=_recover)
        del args
        cp.get_default_memory_pool().free_all_blocks()
    return rows


_CEILING = {"compute": "matmul_fp32", "compute_bf16": "matmul_bf16"}


def _recover():
    import cupy as cp
    try:
        cp.cuda.Device().synchronize()
    except Exception:  # noqa: BLE001 - a failed launch can leave an error behind; the next op reports it
        pass


def _graph_time(run, backend, iters):
    """GPU time per call from a CUDA graph of `iters` calls (time_gpu_graph / time_torch_graph); None when the call
    cannot be captured (a host sync or a host copy inside, an allocation PyTorch refuses)."""
    try:
        return (time_torch_graph if backend == "torch" else time_gpu_graph)(run, iters=iters, reps=3)
    except Exception:  # noqa: BLE001 - not capturable
        _recover()
        return None


def stored_kernels(name: str = "kernels_h100") -> dict:
    """The kernel benchmark measured on one of the course's GPUs, every row validated before it was timed (card and
    date inside): kernels_h100 (lessons 02-06), flash_h100 and flash_bf16_h100 (the flash kernels)."""
    from . import stored
    return stored.require(name)


def kernel_results(ops, live=None, stored: str = "kernels_h100") -> dict:
    """Benchmark rows for `ops`: measured now on a GPU (live=None means: if there is one), else the stored run
    `stored` (a results/ name, see stored_kernels)."""
    live = device.has_gpu() if live is None else live
    result = bench_kernels(ops=ops) if live else stored_kernels(stored)
    return dict(result, rows=[r for r in result["rows"] if r["op"] in ops], live=bool(live))


def kernel_row(result: dict, op: str, backend: str, version=None):
    """The fastest row of `result` (kernel_results / stored_*) for op on backend (and version, when given) that has a
    time (not wrong, no error); None when there is none. PyTorch's rows have backend "torch"."""
    rows = [r for r in result["rows"] if r["op"] == op and r["backend"] == backend and "error" not in r
            and "ms" in r and (version is None or r["version"] == version)]
    return min(rows, key=lambda r: r["ms"]) if rows else None


def format_version_table(result: dict, ops, versions, before: str, after: str) -> str:
    """The HIP rows of `versions` and PyTorch's per op of a kernel_results / stored result, ms, TFLOP/s and the share
    of the bf16 matmul rate; under each op, how much faster `after` is than `before` and its time against PyTorch's.
    A version the result lacks is left out."""
    lines = [f"{result_source(result)}; bf16 matmul rate {result['ceilings']['matmul_bf16']['TFLOP/s']:.0f} TFLOP/s",
             f"{'op':<16}{'kernel':<10}{'ms':>8}{'TFLOP/s':>9}{'% of rate':>11}"]
    for op in ops:
        rows = {v: kernel_row(result, op, "hip", v) for v in versions}
        rows["PyTorch"] = kernel_row(result, op, "torch")
        for name, r in rows.items():
            if r:
                lines.append(f"{op:<16}{name:<10}{r['ms']:8.3f}{r['TFLOP/s']:9.0f}"
                             f"{100 * r['fraction_of_ceiling']:10.0f}%")
        b, a, pt = rows.get(before), rows.get(after), rows["PyTorch"]
        if b and a and pt:
            lines.append(f"  {op}: {before} -> {after} {b['ms'] / a['ms']:.2f}x faster; {after} takes "
                         f"{a['ms'] / pt['ms']:.2f}x PyTorch's time")
        lines.append("")
    return "\n".join(lines)


def result_source(result: dict) -> str:
    """One line saying where a result of kernel_results / stored_* comes from: this machine now, or the course's
    stored run (card and date)."""
    if result.get("live"):
        return f"measured now on {result['card']} ({result['date']})"
    from . import stored
    return f"no live measurement: {stored.describe(result)}"


def format_kernels(result: dict) -> str:
    """The kernel table: GPU time per call (a CUDA graph replayed: 'g'), Python's time to issue it, rates. A version
    whose outputs did not match the reference shows "wrong (max err X > tol Y ...)" and no time; a row timed without
    a check is marked '*' and counted under the table."""
    c = result["ceilings"]
    w = max([13] + [len(r["op"]) + 1 for r in result["rows"]])  # the op column fits the longest op
    bf16 = any(r.get("bound") == "compute_bf16" for r in result["rows"]) and "TFLOP/s" in c.get("matmul_bf16", {})
    lines = [f"{result['card']} ({result['date']}): copy {c['copy']['GB/s']:.0f} GB/s, "
             f"fp32 matmul {c['matmul_fp32']['TFLOP/s']:.1f} TFLOP/s"
             + (f", bf16 matmul {c['matmul_bf16']['TFLOP/s']:.1f} TFLOP/s" if bf16 else ""),
             "ms: GPU time per call ('g': a CUDA graph of the calls, replayed; 'q': queued launches)",
             "host us: Python's time to issue one call (launch overhead; an eager loop pays the larger of the two)",
             f"{'op':<{w}}{'backend':<8}{'version':<10}{'ms':>8}{'host us':>9}{'GB/s':>7}{'TFLOP/s':>8}"
             f"{'of ceiling':>11}"]
    label = {"memory": "copy", "compute": "mm", "compute_bf16": "bf16 mm"}
    before, why_not = 0, {}
    for r in result["rows"]:
        head = f"{r['op']:<{w}}{r['backend']:<8}{str(r['version'])[:9]:<10}"
        if r.get("status") == "wrong":
            lines.append(f"{head}  {wrong_message(r['validation'])}"[:100])
            continue
        if "error" in r or "ms" not in r:
            lines.append(f"{head}  error: {r.get('error', 'no time')[:60]}")
            continue
        v = r.get("validation") or {}
        if not v:
            before += 1
        elif not v.get("ok"):
            why_not[f"{r['op']} {r['backend']}"] = v.get("why_not", "not validated")
        mark = {"graph": "g", "queued": "q"}.get(r.get("timing"), " ")
        host = f"{1e3 * r['host_ms']:9.0f}" if "host_ms" in r else f"{'-':>9}"
        lines.append(f"{head}{r['ms']:7.3f}{mark}"
                     f"{host}{r['GB/s']:7.0f}"
                     f"{r['TFLOP/s']:8.2f}{100 * r['fraction_of_ceiling']:6.0f}% "
                     f"{label.get(r['bound'], r['bound'])}" + ("" if v.get("ok") else " *"))
    if before:
        lines.append(f"* {before} rows timed before the benchmark validated each version: outputs unchecked")
    for who, why in why_not.items():
        lines += textwrap.wrap(f"* {who} not validated: {why}", 100, subsequent_indent="  ")
    return "\n".join(lines)


def ncu_target(ops, small: bool, labels_path: str) -> None:
    """Run inside ncu: every version of every case once, each after a marker kernel, between profiler start/stop."""
    import cupy as cp

    from .profiling import marker_kernel

    rng = np.random.default_rng(0)
    labels = []
    marker = marker_kernel()
    for case in _cases(small):
        if ops and case.op not in ops:
            continue
        args = case.make(rng)
        runs = case_runs(case, args)
        for _b, _v, run in runs:                          # compile and warm up outside the profiled range
            try:
                run()
            except Exception:  # noqa: BLE001 - a version that fails is left out (the timing table says why)
                pass
        cp.cuda.Device().synchronize()
        cp.cuda.profiler.start()
        for bname, version, run in runs:
            labels.append({"op": case.op, "shape": case.shape, "backend": bname, "version": version})
            marker((len(labels),), (1,), (np.int32(len(labels)),))
            try:
                run()
            except Exception:  # noqa: BLE001
                pass
            cp.cuda.Device().synchronize()
        cp.cuda.profiler.stop()
        del args, runs
        cp.get_default_memory_pool().free_all_blocks()
    with open(labels_path, "w") as f:
        json.dump(labels, f)




def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gpullm_lessons.bench", description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["ceilings", "kernels", "ncu", "timeline", "train", "long", "fits", "memory",
                                     "checkpointing", "profile", "gputime",
                                     "inductor", "ncu-target"],
                    help="what to measure (ncu-target: what `ncu` profiles for `ncu`, not for you to run)")
    ap.add_argument("--presets", default="course,gpt2", help="`train` / `checkpointing`: model presets; `profile` / `gputime`: the first one")
    ap.add_argument("--precisions", default=None,
                    help="`train`: fp32,tf32,bf16 (default; tf32: fp32 with TF32 matmuls, ours and PyTorch's); "
                         "`checkpointing`: fp32 (default)")
    ap.add_argument("--seq-len", type=int, default=4096, help="`long`: the context length T")
    ap.add_argument("--batch-size", type=int, default=32, help="`long`: sequences per step B")
    ap.add_argument("--ops", help="comma-separated ops for `kernels` (default: all)")
    ap.add_argument("--small", action="store_true", help="smaller shapes (a quick look)")
    ap.add_argument("--scores", choices=("f32", "half"), default=None,
                    help="`train` / `gputime` / `timeline`: the engine's attention-score format in half precision "
                         "(default half)")
    ap.add_argument("--attention", choices=("flash", "cublas"), default=None,
                    help="`train` / `gputime` / `timeline`: the engine's attention path in half precision (default "
                         "flash where it runs)")
    ap.add_argument("--flash-version", choices=("v4", "v5", "v6", "v7"), default=None,
                    help="`train` / `gputime` / `timeline`: the version of the flash kernels the engine's flash path "
                         "runs (default v6)")
    ap.add_argument("--gelu-in", choices=("f32", "half"), default=None,
                    help="`train` / `gputime` / `timeline`: the format the engine keeps GELU's input in, in half "
                         "precision (default f32)")
    ap.add_argument("--epilogue", choices=("none", "cublaslt"), default=None,
                    help="`train` / `gputime` / `timeline`: the engine's bias and residual adds inside cuBLASLt's "
                         "products (NVIDIA, half precision; default none)")
    ap.add_argument("--dgelu", choices=("cublaslt", "kernel"), default=None,
                    help="`train` / `gputime` / `timeline`: with --epilogue cublaslt --gelu-in half, where the fc "
                         "projection's backward makes dfc: in its product (DGELU_BGRAD, the default) or in a pass of "
                         "the course's colsum_convert after a plain product")
    ap.add_argument("--logits", choices=("f32", "half"), default=None,
                    help="`train` / `gputime` / `timeline`: the format the engine's tied head writes the logits in, "
                         "in bf16 (default f32; half: bf16 logits, the bf16 dlogits written over them)")
    ap.add_argument("--dgelu-out", choices=("f32", "half"), default=None,
                    help="`train` / `gputime` / `timeline`: with --gelu-in half, where dfc is made in colsum_convert's "
                         "pass, the format the fc projection's backward product writes GELU's output gradient in "
                         "(default f32)")
    ap.add_argument("--dqkv-out", choices=("f32", "half"), default=None,
                    help="`train` / `gputime` / `timeline`: with flash v6 and --epilogue cublaslt, the format the flash "
                         "backward writes dqkv in (default f32; half: the products read it as written and the qkv "
                         "bias gradient comes from the weight-gradient product's epilogue)")
    ap.add_argument("--dres-out", choices=("f32", "half"), default=None,
                    help="`train` / `gputime` / `timeline`: with --epilogue cublaslt, what the LayerNorm backwards write "
                         "of the residual stream's gradient (default f32; half: its half copy too, in the same pass, "
                         "and the projections' bias gradients from their weight-gradient products)")
    ap.add_argument("--ce-chunks", type=int, default=1,
                    help="`train` / `gputime` / `timeline`: our engine's loss head in that many chunks of rows "
                         "(default 1)")
    ap.add_argument("--variant", action="append", default=None, metavar="LABEL:key=value,...",
                    help="`train`, repeatable: our engine once per variant (its versions, e.g. flash=v4 or "
                         "attention=cublas, and ce_chunks over the other options) beside one PyTorch measurement")
    ap.add_argument("--compile", action="store_true", help="`train`: also PyTorch through torch.compile")
    ap.add_argument("--json", help="write the result as JSON here")
    ap.add_argument("--plot", help="`kernels`: write the roofline plot PNG here")
    ap.add_argument("--labels", help=argparse.SUPPRESS)                  # ncu-target: where the call labels go
    args = ap.parse_args(argv)
    if args.variant and args.what != "train":
        ap.error(f"--variant goes with `train`, not `{args.what}`")
    if args.variant:
        from .train_step import parse_variant
        try:
            variants = [parse_variant(v) for v in args.variant]
        except ValueError as e:
            ap.error(str(e))
        if len({label for label, _ in variants}) != len(variants):
            ap.error("--variant: each variant needs its own label")
    if args.what == "ncu-target":
        ncu_target(args.ops.split(",") if args.ops else None, args.small, args.labels)
        return 0

    def keep(partial):  # `kernels` and `train` rewrite --json as they go: a run cut short keeps what it finished
        if args.json:
            with open(args.json, "w") as f:
                json.dump({**partial, **run_metadata(args.what, argv if argv is not None else sys.argv[1:])}, f,
                          indent=1)

    try:
        if args.what == "ceilings":
            result = ceilings(small=args.small)
            print(format_ceilings(result))
        elif args.what == "fits":
            from . import train_step as bt
            result = bt.bench_fits(precision=(args.precisions or "bf16"))
            print(bt.format_fits(result))
        elif args.what == "inductor":
            from .inductor import format_anatomy, torch_compile_anatomy
            result = torch_compile_anatomy(args.presets.split(",")[0] if args.presets != "course,gpt2" else "gpt2",
                                           precision=(args.precisions or "bf16"))
            print(format_anatomy(result))
        elif args.what == "memory":
            from . import train_step as bt
            result = bt.bench_memory(args.presets.split(",")[0] if args.presets != "course,gpt2" else "gpt2",
                                     precision=(args.precisions or "bf16"), attention=args.attention)
            print(bt.format_memory(result))
        elif args.what == "long":
            from . import train_step as bt
            result = bt.bench_long(args.presets.split(",")[0] if args.presets != "course,gpt2" else "gpt2",
                                   T=args.seq_len, B=args.batch_size, precision=(args.precisions or "bf16"))
            print(bt.format_long(result))
        elif args.what in ("train", "checkpointing", "profile", "gputime"):
            from . import train_step as bt
            presets = tuple(args.presets.split(","))
            versions = engine_versions(args)
            if args.what == "gputime":
                import importlib.util
                result = bt.gpu_time_profile(presets[0], (args.precisions or "bf16").split(",")[0],
                                             versions=versions or None, ce_chunks=args.ce_chunks,
                                             with_torch=importlib.util.find_spec("torch") is not None)
                print(bt.format_gpu_time(result))
            elif args.what == "profile":
                result = bt.profile_step(presets[0], (args.precisions or "bf16").split(",")[0])
                print(bt.format_profile(result))
            elif args.what == "train":
                precs = tuple((args.precisions or "fp32,tf32,bf16").split(","))
                result = bt.bench_train(presets, precs, versions=versions or None, with_compile=args.compile,
                                        on_config=keep, ce_chunks=args.ce_chunks,
                                        variants=variants if args.variant else None)
                print(bt.format_train(result))
            else:
                precs = tuple((args.precisions or "fp32").split(","))
                result = bt.bench_checkpointing(presets, precs)
                print(bt.format_checkpointing(result))
        elif args.what == "timeline":
            from .train_step import step_timeline
            from .profiling import format_timeline
            result = step_timeline(args.presets.split(",")[0], (args.precisions or "bf16").split(",")[0],
                                   versions=engine_versions(args) or None, ce_chunks=args.ce_chunks)
            print(format_timeline(result))
        elif args.what == "ncu":
            from .profiling import format_ncu, ncu_kernels
            ops = args.ops.split(",") if args.ops else ["softmax", "layernorm", "crossentropy", "adamw"]
            result = ncu_kernels(ops=ops, small=args.small)
            print(format_ncu(result))
        else:
            result = bench_kernels(ops=args.ops.split(",") if args.ops else None, small=args.small, on_case=keep)
            print(format_kernels(result))
            if args.plot:
                from .. import viz
                viz.plot_roofline(result, path=args.plot)
    except device.NoGPUError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        result = {**result, **run_metadata(args.what, argv if argv is not None else sys.argv[1:])}
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def engine_versions(args) -> dict:
    """The engine versions the command line asks for (--scores, --attention, --flash-version, --gelu-in, --epilogue,
    --dgelu, --logits, --dgelu-out, --dqkv-out, --dres-out)."""
    return {**({"scores": args.scores} if args.scores else {}),
            **({"attention": args.attention} if args.attention else {}),
            **({"flash": args.flash_version} if args.flash_version else {}),
            **({"gelu_in": args.gelu_in} if args.gelu_in else {}),
            **({"epilogue": args.epilogue} if args.epilogue else {}),
            **({"dgelu": args.dgelu} if args.dgelu else {}),
            **({"logits": args.logits} if args.logits else {}),
            **({"dgelu_out": args.dgelu_out} if args.dgelu_out else {}),
            **({"dqkv_out": args.dqkv_out} if args.dqkv_out else {}),
            **({"dres_out": args.dres_out} if args.dres_out else {})}


def run_metadata(what: str, argv) -> dict:
    """What a stored result needs to say how it was made: the command (without --json and its path), the commit and
    whether the tree differed from it (as make gpu-test records them) and, for the
    runs of the training step with flash attention, the flash kernels' version and layout (the engine runs the packed
    launchers at their default version)."""
    args, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--json":
            skip = True
        elif not a.startswith("--json="):
            args.append(a)
    from pathlib import Path

    from .gpu_suite import _commit

    # the commit measured (GPULLM_COMMIT where the tree has no git history), as make gpu-test records it
    meta = {"command": " ".join(["python -m gpullm_lessons.bench", *args]), **_commit(Path(__file__).parents[2])}
    variant = any(a == "--variant" or a.startswith("--variant=") for a in args)  # versions per variant
    if what in ("train", "gputime", "long", "profile", "timeline") and not variant and \
            not any("cublas" in a for a in args):
        from ..backends.hip import flash

        asked = [a.split("=", 1)[1] for a in args if a.startswith("--flash-version=")]
        asked += [b for a, b in zip(args, args[1:]) if a == "--flash-version"]
        meta.update(flash_version=asked[-1] if asked else flash.DEFAULT, flash_layout="packed")
    return meta


if __name__ == "__main__":
    sys.exit(main())
