"""One naming convention for kernel entry points, and the same name on both backends.

The entry points: in kernels/numba/<op>.py the top-level functions decorated `@cuda.jit` (not
`@cuda.jit(device=True)`: those are helpers), found with ast; in kernels/hip/<op>.cu the `extern "C" __global__`
functions (also the ones a function-like macro stamps out, e.g. SOFTMAX_FWD_WARP(8)), found with a regex after the
macros are expanded.

THE CONVENTION: `<what>_v<N>[_<part>...]`, lowercase snake_case.
  <what>  what the kernel computes, llm.c's words: `layernorm_backward`, `crossentropy_forward_backward`, `matmul`,
          `f32_to_bf16`, `colsum_partials`.
  v<N>    the version in the lesson's walk (v1 the simplest; one version token, never first).
  <part>  after the version, optional: the stage of a version that takes several kernels (`layernorm_backward_v2`
          then `_v2_partials`, `_v2_reduce`), or a compile-time specialisation (`softmax_backward_v6_k4`,
          `layernorm_backward_v5_w4_k3`).
Why this one: it is what most entry points already use (67 of the 68 Numba kernels, every versioned kernel the
lessons walk), so it needed one rename only: Numba's `encoder_zero_v1` -> `encoder_backward_v1_zero`, its HIP twin's
name. The other two styles stay as declared exceptions: no version at all (`attention_dpre`, `vector_add`,
`grad_sumsq_partials`, the HIP attention families stamped out per format and warp width), and twins whose names
differ (`adamw_v1_m` / `adamw_step_v1_m`, `sumsq_v1` / `grad_sumsq_partials`), kept because results or lessons name
them.
The check is syntactic: it cannot see that in `attention_softmax_fwd_v4_bf16_in` the 4 is a vector width (chunks of
8 elements per lane), not a version.

TWINS: a Numba kernel and its HIP twin have the same name, except that a HIP entry may end in a storage-format
suffix `_f32`, `_bf16` or `_f16` (HIP compiles one entry per format where the Numba kernel takes the format as an
argument: `bias_gelu_forward_v1` and `bias_gelu_forward_v1_bf16`).

The three lists below may only shrink: an entry that no longer matches anything it excuses fails the test, so a
renamed kernel or an added twin also deletes its exception. Never rename a kernel that a stored result
(gpullm_lessons/results/*.json: ncu and timeline kernel names), a notebook, an exercise or a test names.
"""

import ast
import fnmatch
import re
from pathlib import Path

import pytest

from gpullm_lessons.runtime.hip import expand_macros

ROOT = Path(__file__).resolve().parents[1]
NUMBA = ROOT / "kernels" / "numba"
HIP = ROOT / "kernels" / "hip"
FORMATS = ("f32", "bf16", "f16")

# (a) Entry points that do not follow the convention: fnmatch pattern -> why the name stays.
NOT_CONVENTION = {
    "transpose_tiled": "lesson 02's one transpose (both backends); notebook 02 and tests/test_kernels_transpose.py",
    "vector_add": "lesson 00's first HIP kernel; notebook 00, runtime/doctor.py, runtime/hip.py and four tests name it",
    "block_sum": "lesson 00's warpSize demo; notebook 04 and tests/test_hip.py name it",
    "grad_sumsq_partials": "stored in results/timeline_*.json",
    "grad_sumsq_reduce": "stored in results/timeline_*.json",
    "attention_softmax_fwd": "HIP's v1, one launcher string; its Numba twin is attention_softmax_fwd_v1",
    "attention_dpre": "HIP's v1, named in notebook 05; its Numba twin is attention_dpre_v1",
    "attention_softmax_fwd_[bf]*": "v1's per-format entries (_bf16, _f32_f16, _bf16_in, ...), one template",
    "attention_dpre_[bf]*": "v1's per-format entries (_bf16_f32, ..., _f16_f16_f16), ATTENTION_DPRE's output",
    "attention_softmax_fwd_w*": "warp-per-row family w{K} x format, SOFTMAX_FWD_WARP's output",
    "attention_dpre_w*": "warp-per-row family w{K} x format pair, SOFTMAX_FWD_WARP's output",
    "crossentropy_forward_backward_half_*": "the engine's half-dlogits kernel, one entry per format",
    "crossentropy_forward_backward_half4_*": "its float4 form; _half4_bf16 is stored in results/timeline_*.json",
    "crossentropy_forward_backward_hh_*": "half logits in, half dlogits out (in place allowed), one entry per format",
    "crossentropy_forward_backward_hh4_*": "its 4-per-load form, one entry per format",
    "crossentropy_forward_backward_hh8_*": "its 8-per-load form, one entry per format",
}

# (b1) Twins under two names (Numba -> HIP): the same kernel, not renamed because the names are stored or taught.
TWINS_NAMED_APART = {
    "adamw_v1_decay": ("adamw_step_v1_decay", "both names stored in results/ncu_h200.json"),
    "adamw_v1_m": ("adamw_step_v1_m", "both in results/ncu_h200.json; notebook 06 shows adamw_v1_m"),
    "adamw_v1_v": ("adamw_step_v1_v", "both in results/ncu_h200.json; notebook 06 shows adamw_v1_v"),
    "adamw_v1_update": ("adamw_step_v1_update", "both names stored in results/ncu_h200.json"),
    "adamw_v1_zero": ("adamw_step_v1_zero", "both in results/ncu_h200.json; notebook 06 shows adamw_v1_zero"),
    "adamw_v2": ("adamw_step_v2", "both in results/ncu_h200.json; notebook 06 names adamw_v2"),
    "attention_softmax_fwd_v1": ("attention_softmax_fwd", "the Numba name is in results/timeline_course_h200.json"),
    "attention_dpre_v1": ("attention_dpre", "both named in notebook 05; the Numba one in a test and a timeline"),
    "sumsq_v1": ("grad_sumsq_partials", "the HIP name is stored in results/timeline_*.json"),
    "sumsq_reduce_v1": ("grad_sumsq_reduce", "the HIP name is stored in results/timeline_*.json"),
    "dbias_v1": ("bias_backward_v1", "notebook 02 shows dbias_v1 (show.source)"),
    "vector_add_v1": ("vector_add", "notebook 00 names both; runtime/doctor.py and tests name vector_add"),
}

# (b2) Kernels of one backend only: fnmatch pattern -> why there is no twin.
SINGLE_BACKEND = {
    # Numba only
    "adamw_device_v2": "Numba's graph-replayable update (v2 + hyper); HIP's is adamw_step_v4, built on v3",
    "attention_softmax_fwd_half_v1": "one kernel, format as an argument; HIP: one entry per format pair",
    "attention_softmax_fwd_half_in_v1": "one kernel, format as an argument; HIP: attention_softmax_fwd_*_in",
    "attention_dpre_half_v1": "one kernel, formats as arguments; HIP: one entry per format pair",
    "attention_dpre_half_in_v1": "one kernel, format as an argument; HIP: attention_dpre_<fmt>_<fmt>_<fmt>",
    "nonfinite_zero_v1": "zeroes Numba's counter; the HIP launcher zeroes it with CuPy (out.fill(0))",
    "vector_add_v2": "lesson 00's grid-stride step; HIP's one vector_add is grid-stride already",
    "flash_attention_*_v1*": "lesson 11's readable v1 (fp32, one thread per row); HIP's flash.cu starts at v2",
    # HIP only
    "adamw_step_v3": "float4 loads and stores (HIP only, lesson 06's tuning)",
    "adamw_step_v4": "v3 with hyper-parameters on the device (CUDA-graph replay)",
    "bias_add_res_v1": "bias + residual in one pass; Numba's bias_add_v1 takes has_res",
    "split_heads_bias_v1_*": "Numba's split_heads_v1 takes has_bias",
    "split_heads_v1_x4_*": "one head of whole rows, four columns per thread (float4), HIP only; v1's values",
    "bias_gelu_forward_v1_nopre_*": "Numba's bias_gelu_forward_v1 takes has_pre",
    "block_sum": "lesson 00's warpSize demo, a HIP-only lesson",
    "crossentropy_backward_v4": "float4 loads (HIP only, lesson 05's tuning)",
    "crossentropy_forward_backward_half*": "half dlogits written directly; Numba converts in a second kernel",
    "crossentropy_forward_backward_hh*": "half logits read directly; Numba widens them in a kernel first",
    "layernorm_backward_v4*": "lesson 04's tuned stage-1/2 pair, HIP only",
    "colsum_partials_v1_x4*": "v1 with four columns per thread (float4 loads), HIP only; v1's sums bit for bit",
    "colsum_partials_v1_gelu_hpre_hin_*": "half GELU gradient read directly; Numba widens it to float32 first",
    "layernorm_backward_v5_*": "register-blocked family w{W}_k{K} + its reduce, HIP only",
    "softmax_backward_v5": "float4 registers (HIP only, lesson 03's tuning)",
    "softmax_backward_v6_k*": "K floats per lane in registers, one entry per K, HIP only",
    "softmax_backward_v7_k*": "v6 + next-row prefetch, one entry per K, HIP only",
    "attention_softmax_fwd_[bf]*": "per-format entries; the Numba twin is attention_softmax_fwd_half(_in)_v1",
    "attention_dpre_[bf]*": "per-format entries; the Numba twin is attention_dpre_half(_in)_v1",
    "attention_softmax_fwd_[wv]*": "warp-per-row (w{K}) and vectorised (v{C}) families, HIP only",
    "attention_dpre_[wv]*": "warp-per-row (w{K}) and vectorised (v{C}) families, HIP only",
    "flash_attention_*_v2_*": "lesson 11's v2 on the matrix units (wmma / MFMA, half inputs), one entry per hs x format",
    "flash_attention_*_v3_*": "lesson 11's v3: v2 with the softmax in the matrix units' registers, one entry per hs x format",
    "flash_attention_*_v4_*": "lesson 11's v4: v3 as FlashAttention-2 (128-row blocks, double-buffered tiles), per hs x format",
    "flash_attention_*_v5_*": "lesson 11's v5: the backward in one kernel, dQ added by the key blocks in turns, per hs x format",
    "flash_attention_*_v6_*": "lesson 11's v6: v5 with fewer instructions around the products, per hs x format",
}


# ---- collecting ----------------------------------------------------------------------------------------------------


def numba_entries(source: str) -> list[str]:
    """Top-level functions decorated @cuda.jit (bare or called), not @cuda.jit(device=True)."""
    names = []
    for node in ast.parse(source).body:
        if not isinstance(node, ast.FunctionDef):
            continue
        for d in node.decorator_list:
            call = d if isinstance(d, ast.Call) else None
            if ast.unparse(call.func if call else d) != "cuda.jit":
                continue
            device = call is not None and any(
                k.arg == "device" and isinstance(k.value, ast.Constant) and k.value.value for k in call.keywords
            )
            if not device:
                names.append(node.name)
    return names


_ENTRY = re.compile(
    r'extern\s+"C"\s+__global__\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?void\s+'
    r"(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\("
)
_EXTERN_BLOCK = re.compile(r'extern\s+"C"\s*\{')
_GLOBAL = re.compile(
    r"__global__\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?"
    r"(\w+)\s*\("
)


def hip_entries(source: str) -> list[str]:
    """extern "C" __global__ functions, single or inside extern "C" { ... }, after macro expansion."""
    code = expand_macros(re.sub(r"//[^\n]*|/\*.*?\*/", " ", source, flags=re.S))
    names = _ENTRY.findall(code)
    for m in _EXTERN_BLOCK.finditer(code):
        depth, i = 1, m.end()
        while i < len(code) and depth:
            depth += {"{": 1, "}": -1}.get(code[i], 0)
            i += 1
        names += _GLOBAL.findall(code[m.end() : i])
    return list(dict.fromkeys(names))


def convention_error(name: str):
    """None when `name` is `<what>_v<N>[_<part>...]`, else what is wrong."""
    tokens = name.split("_")
    if not re.fullmatch(r"[a-z][a-z0-9]*(_[a-z0-9]+)*", name):
        return "not lowercase snake_case"
    versions = [i for i, t in enumerate(tokens) if re.fullmatch(r"v[1-9][0-9]*", t)]
    if not versions:
        return "no version token _v<N>"
    if len(versions) > 1:
        return "more than one version token"
    if versions[0] == 0:
        return "starts with the version: the op's name comes first"
    return None


def twin_of(hip_name: str, numba_names) -> str | None:
    """The Numba kernel a HIP entry twins: the same name, or the same name plus a format suffix."""
    if hip_name in numba_names:
        return hip_name
    for fmt in FORMATS:
        if hip_name.endswith("_" + fmt) and hip_name[: -len(fmt) - 1] in numba_names:
            return hip_name[: -len(fmt) - 1]
    return None


def excused(name: str, patterns) -> list[str]:
    return [p for p in patterns if fnmatch.fnmatchcase(name, p)]


def all_entries():
    numba = {p.stem: numba_entries(p.read_text()) for p in sorted(NUMBA.glob("*.py"))}
    hip = {p.stem: hip_entries(p.read_text()) for p in sorted(HIP.glob("*.cu"))}
    return numba, hip


def flat(by_file):
    return sorted({n for names in by_file.values() for n in names})


# ---- the rules ------------------------------------------------------------------------------------------------------


def test_the_collectors_see_every_kernel_file():
    numba, hip = all_entries()
    empty = [s for s, names in numba.items() if not names and s not in ("__init__", "_libdevice")]
    assert not empty, f"kernels/numba files with no @cuda.jit kernel: {empty}"
    assert all(hip.values()), {s: v for s, v in hip.items() if not v}
    for p in sorted(HIP.glob("*.cu")):  # nothing slipped past the regex: every __global__ counted
        code = expand_macros(re.sub(r"//[^\n]*|/\*.*?\*/", " ", p.read_text(), flags=re.S))
        assert len(re.findall(r"\b__global__\b", code)) == len(hip[p.stem]), p.name


def test_every_entry_point_follows_the_convention():
    numba, hip = all_entries()
    bad = []
    for backend, names in (("numba", flat(numba)), ("hip", flat(hip))):
        for name in names:
            why = convention_error(name)
            if why and not excused(name, NOT_CONVENTION):
                bad.append(f"{backend} {name}: {why}")
    assert not bad, "kernel names off the convention <what>_v<N>[_<part>] (see this file's docstring):\n" + "\n".join(
        bad
    )


def test_every_kernel_has_its_twin():
    numba, hip = all_entries()
    N, H = set(flat(numba)), set(flat(hip))
    apart_hip = {h for h, _ in TWINS_NAMED_APART.values()}
    twinned = {twin_of(h, N) for h in H} - {None}
    bad = [
        f"numba {n}: no HIP kernel {n} (or {n}_<f32|bf16|f16>)"
        for n in sorted(N - twinned)
        if n not in TWINS_NAMED_APART and not excused(n, SINGLE_BACKEND)
    ]
    bad += [
        f"hip {h}: no Numba kernel {h}"
        for h in sorted(H)
        if twin_of(h, N) is None and h not in apart_hip and not excused(h, SINGLE_BACKEND)
    ]
    assert not bad, (
        "kernels with no twin of the same name (declare a reason in SINGLE_BACKEND or add it):\n" + "\n".join(bad)
    )
    wrong_pair = [f"{n} -> {h}" for n, (h, _) in TWINS_NAMED_APART.items() if n not in N or h not in H]
    assert not wrong_pair, f"TWINS_NAMED_APART names a kernel that does not exist: {wrong_pair}"


def test_the_exception_lists_only_shrink():
    """Each exception still excuses something; otherwise delete it (the kernel was renamed or got its twin)."""
    numba, hip = all_entries()
    N, H = set(flat(numba)), set(flat(hip))
    off = [n for n in N | H if convention_error(n)]
    stale = [f"NOT_CONVENTION {p!r}" for p in NOT_CONVENTION if not any(fnmatch.fnmatchcase(n, p) for n in off)]
    lonely = {n for n in N if n not in {twin_of(h, N) for h in H}} | {h for h in H if twin_of(h, N) is None}
    stale += [
        f"SINGLE_BACKEND {p!r}"
        for p in SINGLE_BACKEND
        if not any(
            fnmatch.fnmatchcase(n, p)
            for n in lonely - set(TWINS_NAMED_APART) - {h for h, _ in TWINS_NAMED_APART.values()}
        )
    ]
    stale += [f"TWINS_NAMED_APART {n!r}" for n, (h, _) in TWINS_NAMED_APART.items() if twin_of(h, N) == n]
    assert not stale, "exceptions no longer needed, delete them:\n" + "\n".join(stale)
    assert all(
        why.strip()
        for why in list(NOT_CONVENTION.values())
        + list(SINGLE_BACKEND.values())
        + [w for _, w in TWINS_NAMED_APART.values()]
    ), "every exception gives its reason"


# ---- the checker on planted names -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, error",
    [
        ("softmax_backward_v4", None),
        ("layernorm_backward_v2_partials", None),
        ("layernorm_backward_v5_w4_k3", None),
        ("f32_to_bf16_v1", None),
        ("softmax_backward", "no version token _v<N>"),
        ("softmaxBackward_v1", "not lowercase snake_case"),
        ("softmax_backward_v1_v2", "more than one version token"),
        ("v1_softmax_backward", "starts with the version: the op's name comes first"),
        ("softmax_backward_v0", "no version token _v<N>"),
    ],
)
def test_convention_error_on_planted_names(name, error):
    assert convention_error(name) == error


def test_the_collectors_on_planted_sources():
    py = (
        "from numba import cuda\n\n\n@cuda.jit(device=True)\ndef helper(x):\n    return x\n\n\n"
        "@cuda.jit\ndef good_v1(a):\n    pass\n\n\n@cuda.jit('void(float32[:])')\ndef Bad_Name(a):\n    pass\n\n\n"
        "def plain(a):\n    pass\n"
    )
    assert numba_entries(py) == ["good_v1", "Bad_Name"]
    cu = (
        '// extern "C" __global__ void commented_out(int n) {}\n'
        'extern "C" __global__ void good_v1(float* a) {}\n'
        'extern "C" __global__ void __launch_bounds__(256) bounded_v2(float* a) {}\n'
        "__device__ float helper(float x) { return x; }\n"
        'extern "C" {\n__global__ void in_block_v1(float* a) {}\n}\n'
        '#define ENTRY(K, LB) \\\n    extern "C" __global__ void __launch_bounds__(LB) \\\n'
        "    stamped_v3_k##K(float* a) { }\n"
        "ENTRY(4, 512)\nENTRY(8, 256)\n"
        '#define VEC(C) extern "C" __global__ void vec_v##C##_in(float* a) { }\nVEC(2)\n'
    )
    names = hip_entries(cu)
    assert names == ["good_v1", "bounded_v2", "stamped_v3_k4", "stamped_v3_k8", "vec_v2_in", "in_block_v1"]
    planted = [n for n in numba_entries(py) + names + ["wrongName", "block_reduce"] if convention_error(n)]
    assert planted == ["Bad_Name", "wrongName", "block_reduce"]


def test_twins_on_planted_names():
    numba = {"bias_gelu_forward_v1", "matmul_v1"}
    assert twin_of("bias_gelu_forward_v1_bf16", numba) == "bias_gelu_forward_v1"
    assert twin_of("matmul_v1", numba) == "matmul_v1"
    assert twin_of("matmul_v1_k4", numba) is None  # only a format suffix makes a twin
    assert twin_of("matmul_v2", numba) is None
    assert excused("softmax_backward_v6_k4", SINGLE_BACKEND) == ["softmax_backward_v6_k*"]
    assert excused("softmax_backward_v9", SINGLE_BACKEND) == []
