"""The graded tasks of lessons 01, 06 and 07: each solution passes, and plausible wrong answers fail with a hint that
names the mistake.

The solutions are the code cells of solutions/01, 06, 07 (run here without their checker cells); the wrong answers are
small variants of them, and several would pass a checker that called them once on a small case: a kernel without a
grid-stride loop (right while n fits in the capped grid), a launcher that keeps the scalars of its first call (right
on the first call), a tensor walk with `if` instead of `while` (right while no stride jumps over a small tensor), a
LayerNorm backward that keeps what it computed on its first call. Numba kernels run in the simulator; the HIP tasks
are compiled and linted without a GPU, and run by the gpu-marked tests on one.
"""
import functools
import math
import subprocess
import sys
import textwrap

import ml_dtypes
import nbformat
import numpy as np
import pytest

import gpullm_lessons  # noqa: F401  (before numba)
from gpullm_lessons import device
from gpullm_lessons.checks.backward import check_attention_backward, check_gelu_backward, check_layernorm_backward
from gpullm_lessons.checks.optim import HALF_POISON, check_adamw_mixed
from gpullm_lessons.checks.precision import (check_bf16_hip, check_bf16_kernel, check_bf16_rne,
                                             check_loss_scaler_update, check_unscale_hip)

import numba  # noqa: E402
from numba import cuda  # noqa: E402

from conftest import ROOT, solution_namespace, wrong  # noqa: E402
numba_ok = pytest.mark.skipif(not device.numba_available(), reason="Numba kernels need a GPU or the simulator")
no_gpu = pytest.mark.skipif(device.has_gpu(), reason="the no-GPU path (compile + lint) of a HIP task")


@functools.lru_cache(maxsize=None)
def solution(name: str) -> dict:
    """The namespace of solutions/<name>.ipynb (see conftest.solution_namespace)."""
    return solution_namespace(name)




def test_task_headers_and_labels():
    """Every task has its '### Task NN.k · level — title' line and one checker call labelled with the same id."""
    import re
    want = {"01_numpy_reference_gradients": {"01.1": "warm-up", "01.2": "core", "01.3": "stretch"},
            "06_fused_adamw": {"06.1": "core", "06.2": "stretch"},
            "07_mixed_precision": {"07.1": "warm-up", "07.2": "core", "07.3": "stretch", "07.4": "core"}}
    for name, tasks in want.items():
        nb = nbformat.read(ROOT / "solutions" / f"{name}.ipynb", as_version=4)
        text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
        heads = dict(re.findall(r"^### Task (\d\d\.\d) · (warm-up|core|stretch) — \S.*$", text, re.M))
        assert heads == tasks, (name, heads)
        labels = [m for c in nb.cells if c.cell_type == "code" for m in re.findall(r'task="(\d\d\.\d) ', c.source)]
        assert labels == list(tasks), (name, labels)


# ================================================================================================================
# 01: NumPy backward passes
# ================================================================================================================

@pytest.mark.parametrize("seed", range(3))
def test_01_solutions_pass(seed):
    ns = solution("01_numpy_reference_gradients")
    for check, fn in ((check_gelu_backward, "gelu_backward"), (check_layernorm_backward, "layernorm_backward"),
                      (check_attention_backward, "attention_backward")):
        r = check(ns[fn], seed=seed, quiet=True)
        assert r.status == "correct", r.message


def test_01_gelu_mistakes_are_named():
    def no_cube_factor(dout, inp, dinp):                 # d/dx of 0.044715 x^3 without the 3
        c = np.sqrt(2 / np.pi)
        th = np.tanh(c * (inp + 0.044715 * inp ** 3))
        dinp[...] = dout * (0.5 * (1 + th) + 0.5 * inp * (1 - th * th) * c * (1 + 0.044715 * inp ** 2))

    def sech_not_squared(dout, inp, dinp):
        c = np.sqrt(2 / np.pi)
        th = np.tanh(c * (inp + 0.044715 * inp ** 3))
        dinp[...] = dout * (0.5 * (1 + th) + 0.5 * inp * (1 - th) * c * (1 + 3 * 0.044715 * inp ** 2))
    wrong(check_gelu_backward(no_cube_factor, seed=1, quiet=True), "factor 3")
    wrong(check_gelu_backward(sech_not_squared, seed=1, quiet=True), "squared")


def test_01_layernorm_mistakes_are_named():
    ref = solution("01_numpy_reference_gradients")["layernorm_backward"]

    def no_mean_term(dout, inp, weight, mean, rstd, dinp, dweight, dbias):
        ref(dout, inp, weight, mean, rstd, dinp, dweight, dbias)
        xhat = (inp - mean[:, None]) * rstd[:, None]
        g = dout * weight
        dinp[...] = rstd[:, None] * (g - xhat * (g * xhat).mean(axis=1, keepdims=True))

    state = {}

    def keeps_first_dweight(dout, inp, weight, mean, rstd, dinp, dweight, dbias):   # right on its first call only
        ref(dout, inp, weight, mean, rstd, dinp, dweight, dbias)
        state.setdefault("dweight", dweight.copy())
        if state["dweight"].shape == dweight.shape:
            dweight[...] = state["dweight"]
        else:
            dweight[...] = np.resize(state["dweight"], dweight.shape)
    wrong(check_layernorm_backward(no_mean_term, seed=2, quiet=True), "mean term")
    r = check_layernorm_backward(keeps_first_dweight, seed=2, quiet=True)
    wrong(r, "dweight")


def test_01_attention_mistakes_are_named():
    ref = solution("01_numpy_reference_gradients")["attention_backward"]

    def unscaled(dout, qkv, att, dqkv, n_head):
        ref(dout, qkv, att, dqkv, n_head)
        C = dout.shape[-1]
        dqkv[..., :2 * C] *= np.sqrt(C // n_head)          # dq, dk without the 1/sqrt(hs)

    def no_rowsum(dout, qkv, att, dqkv, n_head):            # the softmax backward without its row-sum term
        B, T, C = dout.shape
        hs = C // n_head
        heads = lambda x: x.reshape(B, T, n_head, hs).transpose(0, 2, 1, 3)          # noqa: E731
        q, k, v = (heads(qkv[..., j * C:(j + 1) * C]) for j in range(3))
        dy = heads(dout)
        datt = dy @ v.swapaxes(-1, -2)
        dpre = att * datt / np.sqrt(hs)
        for j, g in enumerate((dpre @ k, dpre.swapaxes(-1, -2) @ q, att.swapaxes(-1, -2) @ dy)):
            dqkv[..., j * C:(j + 1) * C] = g.transpose(0, 2, 1, 3).reshape(B, T, C)
    wrong(check_attention_backward(unscaled, seed=3, quiet=True), "1/sqrt(hs)")
    wrong(check_attention_backward(no_rowsum, seed=3, quiet=True), "row-sum")


# ================================================================================================================
# 06.1: the fused mixed-precision AdamW kernel (Numba, simulator)
# ================================================================================================================

def mixed_kernel(mistake=None):
    """The solution's kernel with one mistake switched on (a closure constant: the kernel is compiled per variant)."""
    from gpullm_lessons.kernels.numba._libdevice import libdevice

    @cuda.jit
    def kernel(params, grads, m, v, half_out, bounds, flags, lr, lr_wd, beta1, beta2, eps, bias1, bias2, inv_scale):
        start, stride = cuda.grid(1), cuda.gridsize(1)
        if mistake == "no grid-stride":
            stride = params.shape[0]
        one = numba.float32(1.0)
        j = 0
        for i in range(start, params.shape[0], stride):
            if mistake == "if walk":
                if bounds[j + 1] <= i:
                    j += 1
            else:
                while bounds[j + 1] <= i:
                    j += 1
            g = grads[i] if mistake == "no unscale" else grads[i] * inv_scale
            if mistake == "unscale twice":
                g = g * inv_scale
            p = params[i]
            old = p
            if flags[j] != 0:
                p = p - lr_wd * p
            mi = beta1 * m[i] + (one - beta1) * g
            vi = beta2 * v[i] + (one - beta2) * g * g
            p = p - lr * (mi / bias1) / (math.sqrt(vi / bias2) + eps)
            params[i], m[i], v[i] = p, mi, vi
            if mistake != "no zero":
                grads[i] = numba.float32(0.0)
            src = old if mistake == "copy before" else p
            b = numba.uint32(libdevice.float_as_int(src))
            if mistake == "truncate":
                half_out[i] = b >> numba.uint32(16)
            elif mistake == "ties away":
                half_out[i] = (b + numba.uint32(0x8000)) >> numba.uint32(16)
            else:
                half_out[i] = (b + numba.uint32(0x7FFF) + ((b >> numba.uint32(16)) & numba.uint32(1))) >> \
                    numba.uint32(16)
    return kernel


def mixed_launcher(kernel, stale=None):
    """The exercise's launcher (capped grid) around `kernel`; stale='step' / 'scale' keeps that scalar of the first
    call (a launcher that caches)."""
    ns = solution("06_fused_adamw")
    first = {}

    def launch(params, grads, m, v, half_out, lr, beta1, beta2, eps, weight_decay, step, loss_scale, decay_bounds):
        first.setdefault("step", step)
        first.setdefault("scale", loss_scale)
        if stale == "step":
            step = first["step"]
        if stale == "scale":
            loss_scale = first["scale"]
        f = np.float32
        blocks = min((params.shape[0] + ns["THREADS"] - 1) // ns["THREADS"], ns["MAX_BLOCKS"])
        kernel[blocks, ns["THREADS"]](params, grads, m, v, half_out, *decay_bounds, f(lr), f(lr * weight_decay),
                                      f(beta1), f(beta2), f(eps), f(1 - beta1 ** step), f(1 - beta2 ** step),
                                      f(1 / loss_scale))
    return launch


@numba_ok
@pytest.mark.parametrize("seed", range(3))
def test_06_1_solution_passes(seed):
    r = check_adamw_mixed(solution("06_fused_adamw")["adamw_step_mixed"], arrays="numba", seed=seed, quiet=True)
    assert r.status == "correct", r.message


@numba_ok
@pytest.mark.parametrize("mistake, words", [
    ("no unscale", ["loss scale was not undone"]),
    ("unscale twice", ["undone twice"]),
    ("no zero", ["not zeroed"]),
    ("truncate", ["truncated"]),
    ("copy before", ["before the update"]),
    ("ties away", ["ties round away from zero"]),
])
def test_06_1_mistakes_are_named(mistake, words):
    r = check_adamw_mixed(mixed_launcher(mixed_kernel(mistake)), arrays="numba", seed=4, quiet=True)
    wrong(r, *words)


@numba_ok
@pytest.mark.parametrize("variant, stale, words", [
    ("no grid-stride", None, ["never updated", "from there on", "grid-stride"]),   # right while n fits the grid
    ("if walk", None, ["flag", "while"]),                          # right while no stride jumps over a tensor
    (None, "step", ["previous call", "step 1"]),                     # right on the first call(s)
    (None, "scale", ["previous call's loss scale"]),
])
def test_06_1_wrong_answers_that_pass_one_small_call(variant, stale, words):
    launch = mixed_launcher(mixed_kernel(variant), stale=stale)
    r = check_adamw_mixed(launch, arrays="numba", seed=5, quiet=True)
    wrong(r, *words)
    assert "call 1 of" not in r.message, r.message       # the first call (n = 1, step 1) was right


def test_06_1_stub_kernel_is_not_attempted():
    @cuda.jit
    def kernel(params, grads, m, v, half_out, bounds, flags, lr, lr_wd, beta1, beta2, eps, bias1, bias2, inv_scale):
        raise NotImplementedError("exercise: write this part")
    r = check_adamw_mixed(mixed_launcher(kernel), arrays="numba", quiet=True)
    assert r.status == "not attempted", r.message


# ================================================================================================================
# 06.2: unscale + inf/NaN count (HIP)
# ================================================================================================================

def unscale_src(change=None):
    text = solution("06_fused_adamw")["unscale_source"]()
    if change:
        old, new = change
        assert old in text, old
        text = text.replace(old, new)
    return text


@no_gpu
def test_06_2_compiles_and_lints_without_a_gpu():
    r = check_unscale_hip(solution("06_fused_adamw")["unscale_source"], task="06.2 t", quiet=True)
    assert r.status == "compiled" and "compiles for NVIDIA" in r.message, r.message
    wrong(check_unscale_hip(unscale_src(("threadIdx.x % warpSize", "threadIdx.x & 31")), quiet=True), "32 lanes")
    wrong(check_unscale_hip(unscale_src(("atomicAdd(count, (int)block_total)", "count[0] += (int)block_total")),
                            quiet=True), "atomicAdd")

    def todo():
        raise NotImplementedError
    assert check_unscale_hip(todo, quiet=True).status == "not attempted"


@pytest.mark.gpu
def test_06_2_runs_on_a_gpu():
    r = check_unscale_hip(solution("06_fused_adamw")["unscale_source"], seed=1, quiet=True)
    assert r.status == "correct", r.message
    variants = [
        (("(__float_as_uint(g) & 0x7F800000u) == 0x7F800000u", "isinf(g)"), ["NaN was not counted"]),
        (("i += step", "i += n"), ["grid-stride"]),                                   # right while n <= 64 x 256
        (("for (int w = 0; w < warps; w++)", "for (int w = 0; w < 1; w++)"), ["first warp"]),
        (("if (threadIdx.x == 0) {", "{"), ["more than once"]),
        (("if (block_total > 0.0f) atomicAdd(count, (int)block_total);",
          "atomicAdd(count, 0); if (block_total > 0.0f) count[0] = (int)block_total;"), ["one block's total"]),
        (("float g = grads[i] * inv_scale;", "float g = grads[i];"), ["not changed"]),
    ]
    for change, words in variants:
        wrong(check_unscale_hip(unscale_src(change), seed=1, quiet=True), *words)


# ================================================================================================================
# 07.1, 07.2: NumPy
# ================================================================================================================

@pytest.mark.parametrize("seed", range(2))
def test_07_1_and_07_2_solutions_pass(seed):
    ns = solution("07_mixed_precision")
    assert check_bf16_rne(ns["f32_to_bf16_bits"], seed=seed, quiet=True).status == "correct"
    assert check_loss_scaler_update(ns["update_scale"], seed=seed, quiet=True).status == "correct"


def test_07_1_wrong_answers_are_named():
    def truncates(x):
        return (x.view(np.uint32) >> 16).astype(np.uint16)

    def nan_becomes_inf(x):                            # the rounding, NaN not tested first
        u = x.view(np.uint32).astype(np.uint64)
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    wrong(check_bf16_rne(truncates, quiet=True), "truncation")
    wrong(check_bf16_rne(nan_becomes_inf, quiet=True), "NaN turned into inf")


# ================================================================================================================
# 07.4: the bf16 conversion as a Numba kernel
# ================================================================================================================

def bf16_launcher(mistake=None):
    ns = solution("07_mixed_precision")

    @cuda.jit
    def kernel(bits, out):
        start, stride = cuda.grid(1), cuda.gridsize(1)
        if mistake == "no grid-stride":
            stride = bits.shape[0]
        for i in range(start, bits.shape[0], stride):
            u = bits[i]
            if mistake != "no nan" and (u & numba.uint32(0x7FFFFFFF)) > numba.uint32(0x7F800000):
                out[i] = ((u >> numba.uint32(16)) & numba.uint32(0x8000)) | numba.uint32(0x7FC0)
            elif mistake == "ties down":
                out[i] = (u + numba.uint32(0x7FFF)) >> numba.uint32(16)
            else:
                out[i] = (u + numba.uint32(0x7FFF) + ((u >> numba.uint32(16)) & numba.uint32(1))) >> numba.uint32(16)

    def launch(x, out):
        n = x.shape[0]
        kernel[min((n + ns["THREADS"] - 1) // ns["THREADS"], ns["MAX_BLOCKS"]), ns["THREADS"]](x.view(np.uint32), out)
    return launch


@numba_ok
@pytest.mark.parametrize("seed", range(3))
def test_07_4_solution_passes(seed):
    r = check_bf16_kernel(solution("07_mixed_precision")["f32_to_bf16_gpu"], arrays="numba", seed=seed, quiet=True)
    assert r.status == "correct", r.message


@numba_ok
@pytest.mark.filterwarnings("ignore:overflow encountered")   # the NaN mistake overflows in the simulator's NumPy
def test_07_4_wrong_answers_are_named():
    r = check_bf16_kernel(bf16_launcher("no grid-stride"), arrays="numba", seed=1, quiet=True)
    wrong(r, "never written", "grid-stride")
    assert r.message.split(" - ")[1].split(":")[0] not in ("the special cases", "n = 1")   # those calls were right
    wrong(check_bf16_kernel(bf16_launcher("no nan"), arrays="numba", seed=1, quiet=True), "NaN turned into inf")
    wrong(check_bf16_kernel(bf16_launcher("ties down"), arrays="numba", seed=1, quiet=True), "ties round toward zero")


def test_07_4_stub_kernel_is_not_attempted():
    @cuda.jit
    def f32_to_bf16_kernel(bits, out):
        raise NotImplementedError("exercise: write this part")

    def launch(x, out):
        f32_to_bf16_kernel[1, 32](x.view(np.uint32), out)
    assert check_bf16_kernel(launch, arrays="numba", quiet=True).status == "not attempted"


# ================================================================================================================
# 07.3: bf16 output with float4 loads (HIP)
# ================================================================================================================

def bf16_src(*changes):
    text = solution("07_mixed_precision")["f32_to_bf16_source"]()
    for old, new in changes:
        assert old in text, old
        text = text.replace(old, new)
    return text


@no_gpu
def test_07_3_compiles_and_lints_without_a_gpu():
    r = check_bf16_hip(solution("07_mixed_precision")["f32_to_bf16_source"], task="07.3 t", quiet=True)
    assert r.status == "compiled" and "AMD" in r.message, r.message
    wrong(check_bf16_hip(bf16_src(('#include "portable.h"', '#include "portable.h"\n#include "half.h"')),
                         quiet=True), "half.h")
    no_float4 = bf16_src(("float4 f = body[q];", "float f0 = src[head + 4 * q];"))
    no_float4 = no_float4.replace("const float4* body", "const float* body").replace("float4", "float")
    wrong(check_bf16_hip(no_float4, quiet=True), "float4")


@pytest.mark.gpu
def test_07_3_runs_on_a_gpu():
    r = check_bf16_hip(solution("07_mixed_precision")["f32_to_bf16_source"], seed=2, quiet=True)
    assert r.status == "correct", r.message
    variants = [
        ((("for (long long i = head + 4 * quads + t; i < n; i += nthreads)",
           "for (long long i = n; i < n; i += nthreads)"),), ["scalar tail"]),
        ((("long long quads = (n - head) >> 2;", "long long quads = (n - head + 3) >> 2;"),), ["outside dst"]),
        ((("q += nthreads", "q += quads"),), ["never written"]),                       # no grid-stride in the body
        ((("u += 0x7FFFu + ((u >> 16) & 1u);", "u += 0x8000u;"),), ["ties round away from zero"]),
    ]
    for changes, words in variants:
        wrong(check_bf16_hip(bf16_src(*changes), seed=2, quiet=True), *words)


@pytest.mark.gpu
def test_07_3_misaligned_float4_is_reported():
    """A kernel that assumes src is 16-byte aligned faults on src + 1: reported as an error that names the cause. Run
    in a subprocess: the fault leaves that process's GPU context unusable."""
    code = textwrap.dedent(f"""
        import gpullm_lessons, sys
        sys.path.insert(0, {str(ROOT / 'tests')!r})
        from test_tasks_01_06_07 import bf16_src
        from gpullm_lessons.checks.precision import check_bf16_hip
        src = bf16_src(("long long head = (long long)(((16u - ((unsigned long long)src & 15u)) & 15u) >> 2);",
                        "long long head = 0;"))
        r = check_bf16_hip(src, seed=2, quiet=True)
        print(r.status, "|", r.hint)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert "error |" in out.stdout and "16-byte" in out.stdout, out.stdout + out.stderr


def test_poison_is_no_rounding_result():
    """The checkers' 'never written' marker is a bf16 NaN pattern that a correct rounding never produces."""
    x = np.arange(0, 2 ** 32, 2 ** 12, dtype=np.uint64).astype(np.uint32).view(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        got = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    assert not (got == HALF_POISON).any()
