"""Every kernels/hip source: compiled for NVIDIA (NVRTC, sm_90) and AMD (hipcc, gfx90a) without a GPU; portability lint;
and run through CuPy against NumPy where a GPU exists."""
import json
import re
import shutil
import sys

import numpy as np
import pytest

from conftest import require_tool
from gpullm_lessons import device
from gpullm_lessons.runtime import hip
from gpullm_lessons.checks import opcheck

SOURCES = [p.stem for p in hip.sources()]
SHARED_HEADERS = sorted(p.name for p in hip.kernel_dir().glob("*.h") if p.name != "portable.h")   # e.g. half.h


def test_sources_found_and_header_ships():
    assert SOURCES, "no .cu sources in kernels/hip"
    assert (hip.kernel_dir() / "portable.h").exists()


def test_includes_are_expanded_once():
    text = hip.expanded_source("vector_add")
    assert '#include "portable.h"' not in text
    assert text.count("// ---- begin portable.h ----") == 1
    with pytest.raises(FileNotFoundError, match="no HIP kernel source nope.cu"):
        hip.source_path("nope")


@pytest.mark.parametrize("name", SOURCES)
def test_compiles_for_nvidia_with_nvrtc(name):
    pytest.importorskip("cuda.bindings", reason="NVRTC bindings come with the [dev] extra (numba-cuda[cu13])")
    ok, log = hip.compile_nvrtc(name, "sm_90")
    assert ok, log


def test_an_empty_nvrtc_log_leaves_pythons_cached_bytes_alone():
    """NVRTC writes its log into the buffer it is given; a clean compile's log is one NUL byte. The buffer must not be
    CPython's cached one-byte b" " (that turned every space a later print wrote through a byte stream into NUL)."""
    pytest.importorskip("cuda.bindings", reason="NVRTC bindings come with the [dev] extra (numba-cuda[cu13])")
    ok, log = hip._nvrtc(b'extern "C" __global__ void k(float* x) { x[0] = 1.0f; }', "k.cu", "sm_90")
    assert ok and log == ""
    assert b" " == bytes([32]) and b" ".decode() == " "
    assert "a b".encode() == b"a" + bytes([32]) + b"b"


def test_the_fast_compile_still_checks_what_ptxas_checks():
    """The compile checks use NVRTC's fast-compile mode (hip.FAST_COMPILE): less optimisation, the same front end
    and the same ptxas for sm_90, which rejects bad inline PTX in both modes."""
    pytest.importorskip("cuda.bindings", reason="NVRTC bindings come with the [dev] extra (numba-cuda[cu13])")
    src = b'extern "C" __global__ void k(float* x) { float y; asm("bogus.op.f32 %0, %1;" : "=f"(y) : "f"(x[0])); x[0] = y; }'
    for fast in (True, False):
        ok, log = hip._nvrtc(src, "k.cu", "sm_90", fast=fast)
        assert not ok and "ptxas" in log and "bogus" in log, (fast, log)
    ok, log = hip._nvrtc(src.replace(b"bogus.op.f32", b"mov.f32"), "k.cu", "sm_90")
    assert ok, log


@pytest.mark.parametrize("name", SOURCES)
def test_compiles_for_amd_with_hipcc(name):
    require_tool("hipcc")
    ok, log = hip.compile_hipcc(name, "gfx90a")
    assert ok, log


# The portability lint lives in the library (hip.lint_source, rules in hip.LINT_RULES): the exercises grade
# learners' HIP sources with it too. Only portable.h may hold platform specifics.
def lint(text: str) -> list[str]:
    return hip.lint_source(text, require_portable_h=True)


@pytest.mark.parametrize("name", SOURCES)
def test_portability_lint(name):
    assert hip.lint_source(hip.source_path(name).read_text(), require_portable_h=True, source=name) == []


@pytest.mark.parametrize("header", SHARED_HEADERS)
def test_shared_headers_lint(header):
    assert lint((hip.kernel_dir() / header).read_text()) == []


def test_a_sources_own_header_is_included_by_that_source_alone():
    """flash_common.h holds what flash.cu's versions share (row_max and row_sum among them, the shuffle loops a task
    asks for): flash.cu may include it, another source or a learner's may not, and the message lists only the
    headers they may include."""
    src = '#include "portable.h"\n#include "flash_common.h"\n'
    assert hip.lint_source(src, source="flash") == []
    for source in (None, "softmax"):
        assert hip.lint_source(src, source=source) == [
            'line 2: #include "flash_common.h": include only "portable.h", then ' + ", ".join(hip.shared_headers())
        ]
    assert "flash_common.h" not in hip.shared_headers() and "flash_common.h" in hip.shared_headers("flash")
    assert set(hip.shared_headers("flash")) - set(hip.shared_headers()) == set(hip.OWN_HEADERS)
    assert '#include "flash_common.h"' in hip.source_path("flash").read_text()
    ok, report = hip.grade_source(src + 'extern "C" __global__ void k(float* x) { x[0] = row_sum(x[0], 2); }\n', "k")
    assert not ok and "flash_common.h" in report, report


def test_lint_catches_non_portable_code():
    bad = ('#include <cstdint>\n__global__ void k(float* x) { int lane = threadIdx.x & 31; '
           'x[0] = __shfl_xor_sync(0xffffffff, x[0], 16); std::max(1, 2); }')
    problems = lint(bad)
    assert len(problems) >= 5, problems
    assert all(p.startswith(("line 1: ", "line 2: ")) for p in problems), problems


CLEAN = """#include "portable.h"
extern "C" __global__ void k(const float* __restrict__ x, float* __restrict__ y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    float v = i < n ? x[i] : 0.0f;   // line 4: planted lines replace this one
    v = warp_sum(v);
    if (i < n && threadIdx.x % warpSize == 0) y[i / warpSize] = v;
}
"""

# (a line planted as line 4 of CLEAN, words the finding must contain): one per rule of hip.LINT_RULES, plus the
# include and extern "C" rules
PLANTED = [
    ("    unsigned m = 0xffffffff;", "hard-coded 32-lane mask 0xffffffff"),
    ("    lanemask_t m = 0xFFFFFFFFu;", "hard-coded 32-lane mask"),
    ("    int lane = threadIdx.x & 31;", "& 31 assumes 32 lanes"),
    ("    int lane = threadIdx.x % 32;", "% 32 assumes 32 lanes"),
    ("    int warp = threadIdx.x / 32;", "/ 32 assumes 32 lanes"),
    ("    int warp = threadIdx.x >> 5;", ">> 5 assumes 32 lanes"),
    ("    float v = warpSize == 32 ? 1.0f : 2.0f;", "warpSize == 32"),
    ("    const int WARP_SIZE = 32; float v = 0.0f;", "warp size constant of 32"),
    ("    __shared__ float s[32 * 32]; float v = 0.0f;", "32 * 32 assumes 32 lanes"),
    ("    float v = shfl_xor(x[0], 1, 32);", "shuffle width 32"),
    ("    float v = 0.0f; for (int o = 16; o > 0; o /= 2) v += shfl_down(v, o, warpSize);", "offset 16"),
    ("    float v = __shfl_down_sync(FULL_MASK, x[0], 1);", "raw shuffle"),
    ("    float v = __ballot_sync(FULL_MASK, 1) ? 1.0f : 0.0f;", "CUDA-only warp intrinsic"),
    ("    float v = std::max(x[0], 0.0f);", "no C++ standard library"),
    ("#include <cuda_runtime.h>\n    float v = 0.0f;", "#include <...>"),
    ('    float v = 0.0f; asm volatile("nop;");', "inline PTX"),
    ("    float v = cooperative_groups::this_grid().size();", "cooperative groups"),
    ('#include "vector_add.cu"\n    float v = 0.0f;', 'include only "portable.h"'),
]


@pytest.mark.parametrize("line,words", PLANTED, ids=[w for _, w in PLANTED])
def test_each_lint_rule_fires_on_a_planted_line(line, words):
    assert hip.lint_source(CLEAN) == []
    lines = CLEAN.split("\n")
    lines[3] = line
    found = hip.lint_source("\n".join(lines))
    assert any(f.startswith("line 4: ") and words in f for f in found), found
    # the same text in a comment is not code
    lines[3] = "    float v = 0.0f;  // " + line.replace("\n", " ")
    assert hip.lint_source("\n".join(lines)) == []


def test_every_lint_rule_has_a_planted_line():
    fired = set()
    for line, _ in PLANTED:
        lines = CLEAN.split("\n")
        lines[3] = line
        fired.update(f.split(": ", 1)[1] for f in hip.lint_source("\n".join(lines)))
    assert {why for _, why in hip.LINT_RULES} <= fired


def test_lint_include_order_and_extern_c():
    found = hip.lint_source('#include "half.h"\n#include "portable.h"\n')
    assert any('include "portable.h" first' in f for f in found), found
    assert hip.lint_source('#include "portable.h"\n#include "half.h"\n') == []
    no_include = 'extern "C" __global__ void k(float* x) { x[0] = 1.0f; }'
    assert lint(no_include) == ['line 1: include "portable.h" (the one header that knows the vendor)']
    assert hip.lint_source("extern \"C\" __global__ void k(float* x) { x[0] = 1.0f; }") == []
    found = hip.lint_source('#include "portable.h"\n\n__global__ void k(float* x) { x[0] = 1.0f; }')
    assert found == ['line 3: kernels must be extern "C" __global__ (unmangled names, so CuPy finds them by name)']
    block = '#include "portable.h"\nextern "C" {\n__global__ void a(float* x) { x[0] = 1.0f; }\n}\n'
    assert hip.lint_source(block) == [] and hip.entry_points(block) == ["a"]
    assert hip.entry_points(CLEAN) == ["k"]


# ---- grading a learner's source without a GPU (hip.grade_source, checks.hip_compile_only) ----------------------

NO_SEMICOLON = CLEAN.replace("v = warp_sum(v);", "v = warp_sum(v)")
MASK_32 = CLEAN.replace("float v = i < n ? x[i] : 0.0f;",
                        "float v = i < n ? __shfl_xor_sync(0xffffffff, x[i], 1) : 0.0f;").replace(
                        "threadIdx.x % warpSize", "threadIdx.x % 32")


def _needs_compilers():
    pytest.importorskip("cuda.bindings", reason="NVRTC bindings come with the [dev] extra (numba-cuda[cu13])")


def test_grade_source_correct_and_named_failures():
    _needs_compilers()
    ok, report = hip.grade_source(CLEAN, ["k"])
    assert ok, report
    assert "compiles for NVIDIA (sm_90)" in report and "portability lint clean" in report
    if shutil.which("hipcc"):
        assert "AMD (gfx90a)" in report
    ok, report = hip.grade_source(NO_SEMICOLON, ["k"])
    # a missing `;` is seen at the next token: NVRTC names line 6, clang line 5
    assert not ok and re.search(r"does not compile for NVIDIA \(NVRTC sm_90\): line [56]: error", report), report
    if shutil.which("hipcc"):
        assert "does not compile for AMD (hipcc gfx90a): line 5: error: expected ';'" in report, report
    ok, report = hip.grade_source(CLEAN, ["k", "k_v2"])
    assert not ok and "no extern \"C\" __global__ function named 'k_v2' (entry points found: k)" in report
    ok, report = hip.grade_source(MASK_32, ["k"])
    assert not ok and "portability lint: line 4: hard-coded 32-lane mask 0xffffffff" in report, report
    assert "line 6: lane index via % 32 assumes 32 lanes" in report, report
    ok, report = hip.grade_source('#include "cuda_fp16.h"\n' + CLEAN, ["k"])
    assert not ok and '#include "cuda_fp16.h"' in report, report


def test_grade_source_requires_compilers_when_asked(monkeypatch):
    monkeypatch.setattr(hip.shutil, "which", lambda name: None)
    source = CLEAN + "// no hipcc here\n"      # a text of its own: compile results are cached per text
    monkeypatch.delenv("GPULLM_REQUIRE_COMPILERS", raising=False)
    ok, report = hip.grade_source(source, ["k"])
    assert ok and "AMD not checked (hipcc not found)" in report, report
    monkeypatch.setenv("GPULLM_REQUIRE_COMPILERS", "1")
    ok, report = hip.grade_source(source, ["k"])
    assert not ok and "not compiled for AMD: hipcc not found (GPULLM_REQUIRE_COMPILERS=1)" in report, report
    with pytest.raises(TypeError, match="kernel source as a str"):
        hip.grade_source(None, ["k"])


def test_hip_compile_only_verdicts(tmp_path, monkeypatch, capsys):
    _needs_compilers()
    from gpullm_lessons.checks import backward as checks
    log = tmp_path / "grades.jsonl"
    monkeypatch.setenv("GPULLM_GRADE_LOG", str(log))
    assert "compiled" in checks.STATUSES
    r = checks.hip_compile_only("gelu_backward", CLEAN, ["k"], task="05.9 t")
    out = capsys.readouterr().out
    assert r.status == "compiled" and not r.passed, r.message
    assert out.strip() == r.message and r.message.startswith("gelu_backward: compiled - compiles for NVIDIA (sm_90)")
    assert r.message.endswith("; " + opcheck.NOT_RUN_HIP) and "compiled and linted only" in r.message
    if shutil.which("hipcc"):
        assert r.message == ("gelu_backward: compiled - compiles for NVIDIA (sm_90) and AMD (gfx90a), portability lint "
                             "clean; " + opcheck.NOT_RUN_HIP)
    else:
        assert "portability lint clean; AMD not checked (hipcc not found)" in r.message
    r = checks.hip_compile_only("gelu_backward", lambda: NO_SEMICOLON, "k", quiet=True)
    assert r.status == "wrong" and re.search(r"line [56]: error", r.hint) and r.hint in r.message   # the missing `;`
    r = checks.hip_compile_only("gelu_backward", MASK_32, "k", quiet=True)
    assert r.status == "wrong" and "line 4: hard-coded 32-lane mask 0xffffffff" in r.hint, r.message
    assert "line 6: lane index via % 32 assumes 32 lanes" in r.hint
    r = checks.hip_compile_only("gelu_backward", CLEAN, ["k", "k2"], quiet=True)
    assert r.status == "wrong" and "'k2'" in r.hint

    def stub():
        raise NotImplementedError

    r = checks.hip_compile_only("gelu_backward", stub, "k", quiet=True)
    assert r.status == "not attempted" and "NotImplementedError" in r.message
    r = checks.hip_compile_only("gelu_backward", lambda: None, "k", quiet=True)
    assert r.status == "error" and "returned NoneType" in r.message
    r = checks.hip_compile_only("gelu_backward", lambda: 1 / 0, "k", quiet=True)
    assert r.status == "error" and "ZeroDivisionError" in r.message
    with pytest.raises(TypeError, match="kernel source"):
        checks.hip_compile_only("gelu_backward", 3, "k")
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    assert [e["status"] for e in entries] == ["compiled", "wrong", "wrong", "wrong", "not attempted", "error", "error"]
    assert entries[0]["task"] == "05.9 t" and entries[0]["check"] == "check_gelu_backward"


@pytest.mark.skipif(device.has_gpu(), reason="what a checker does with a HIP source without a GPU")
def test_op_checker_grades_the_source_without_a_gpu():
    _needs_compilers()
    from gpullm_lessons.checks import backward as checks

    def launcher(*args):  # never called without a GPU
        raise AssertionError("launched without a GPU")

    r = checks.check_gelu_backward(launcher, arrays="cupy", source=CLEAN, entries=["k"], quiet=True)
    assert r.status == "compiled" and r.name == "gelu_backward", r.message
    r = checks.check_gelu_backward(launcher, arrays="cupy", source=lambda: CLEAN, entries="k_missing", quiet=True)
    assert r.status == "wrong" and "k_missing" in r.hint
    r = checks.check_gelu_backward(launcher, arrays="cupy", quiet=True)   # no source: nothing to compile
    assert r.status == "skipped"


@pytest.mark.gpu
def test_vector_add_and_block_sum_on_gpu():
    import cupy as cp
    n = 10_000_019
    a = cp.random.standard_normal(n, dtype=cp.float32)
    b = cp.random.standard_normal(n, dtype=cp.float32)
    out = cp.full(n, cp.nan, cp.float32)
    hip.kernel("vector_add", "vector_add")((1024,), (256,), (a, b, out, np.int64(n)))
    np.testing.assert_array_equal(out.get(), (a + b).get())
    total = cp.zeros(1, cp.float32)
    hip.kernel("vector_add", "block_sum")((1024,), (256,), (a, total, np.int64(n)))
    ref = float(a.astype(cp.float64).sum())
    assert abs(float(total[0]) - ref) <= 1e-3 * np.sqrt(n)


def test_compile_source_reports_errors_and_success():
    pytest.importorskip("cuda.bindings", reason="NVRTC bindings come with the [dev] extra (numba-cuda[cu13])")
    good = '#include "portable.h"\nextern "C" __global__ void k(float* x) { x[threadIdx.x] = warp_sum(1.0f); }\n'
    ok, log = hip.compile_source_nvrtc(good)
    assert ok, log
    ok, log = hip.compile_source_nvrtc(good.replace("warp_sum(1.0f)", "undefined_thing"))
    assert not ok and "undefined_thing" in log


@pytest.mark.gpu
def test_kernel_from_source_runs_and_names_missing_entry_points():
    import cupy as cp
    src = '#include "portable.h"\nextern "C" __global__ void twice(float* x, int n) { int i = threadIdx.x; if (i < n) x[i] *= 2.0f; }\n'
    x = cp.arange(8, dtype=cp.float32)
    hip.kernel_from_source(src, "twice")((1,), (32,), (x, np.int32(8)))
    assert x.get().tolist() == [0, 2, 4, 6, 8, 10, 12, 14]
    with pytest.raises(LookupError, match="no kernel named 'thrice'.*twice"):
        hip.kernel_from_source(src, "thrice")


def test_cuda12_wheels_crt_folder_is_added_to_the_include_path(tmp_path, monkeypatch):
    """CUDA 12's pip wheels split <mma.h> (nvidia-cuda-runtime-cu12) from the crt/ folder it includes
    (nvidia-cuda-nvcc-cu12): the compile gets -I for the latter. CUDA 13's layout (crt/ beside the headers) adds
    nothing."""
    import types

    from gpullm_lessons.runtime import hip

    runtime, nvcc = tmp_path / "cuda_runtime" / "include", tmp_path / "cuda_nvcc" / "include"
    (runtime).mkdir(parents=True)
    (runtime / "cuda_fp16.h").write_text("")
    (nvcc / "crt").mkdir(parents=True)
    (nvcc / "crt" / "mma.h").write_text("")
    monkeypatch.setitem(sys.modules, "nvidia", types.SimpleNamespace(__path__=[str(tmp_path)]))
    assert hip.nvrtc_include_dir() == runtime
    assert hip.crt_include_dir() == nvcc and hip.include_options() == (f"-I{nvcc}",)
    (runtime / "crt").mkdir()
    (runtime / "crt" / "mma.h").write_text("")  # the CUDA 13 layout: crt/ beside the headers
    assert hip.crt_include_dir() is None and hip.include_options() == ()
