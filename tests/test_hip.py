"""Every kernels/hip source: compiled for NVIDIA (NVRTC, sm_90) and AMD (hipcc, gfx90a) without a GPU; portability lint;
and run through CuPy against NumPy where a GPU exists."""
import re

import numpy as np
import pytest

from conftest import require_tool
from gpullm_lessons import hip

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


@pytest.mark.parametrize("name", SOURCES)
def test_compiles_for_amd_with_hipcc(name):
    require_tool("hipcc")
    ok, log = hip.compile_hipcc(name, "gfx90a")
    assert ok, log


# Constructs that break on the other vendor or under NVRTC. Only portable.h may hold platform specifics.
NON_PORTABLE = [
    (r"0xffffffff", "hard-coded 32-lane mask: use FULL_MASK / lanemask_t"),
    (r"&\s*31\b", "lane index via & 31 assumes 32 lanes: use % warpSize"),
    (r"__shfl\w*\(", "raw shuffle: use shfl_xor / shfl_down / shfl from portable.h"),
    (r"\bstd::", "no C++ standard library under NVRTC"),
    (r"#\s*include\s*<", "include only \"portable.h\""),
    (r"\basm\s*(volatile\s*)?\(", "no inline PTX/assembly"),
    (r"cooperative_groups", "no cooperative groups"),
    (r"\bwarpSize\s*=\s*32|\b32\s*\*\s*32\b", "do not assume 32 lanes"),
]


def lint(text: str) -> list[str]:
    code = re.sub(r"//[^\n]*|/\*.*?\*/", "", text, flags=re.S)
    problems = [why for pat, why in NON_PORTABLE if re.search(pat, code)]
    includes = re.findall(r'#\s*include\s*"([^"]+)"', code)
    # portable.h first; after it only shared headers of kernels/hip (half.h: the bf16/fp16 rounding), linted below
    if includes[:1] != ["portable.h"] or not set(includes[1:]) <= set(SHARED_HEADERS):
        problems.append(f'include "portable.h" first, then only {", ".join(SHARED_HEADERS)} (found {includes})')
    if re.search(r"__global__", code) and not re.search(r'extern\s+"C"\s+__global__', code):
        problems.append('entry points must be extern "C" __global__')
    return problems


@pytest.mark.parametrize("name", SOURCES)
def test_portability_lint(name):
    assert lint(hip.source_path(name).read_text()) == []


@pytest.mark.parametrize("header", SHARED_HEADERS)
def test_shared_headers_lint(header):
    assert lint((hip.kernel_dir() / header).read_text()) == []


def test_lint_catches_non_portable_code():
    bad = ('#include <cstdint>\n__global__ void k(float* x) { int lane = threadIdx.x & 31; '
           'x[0] = __shfl_xor_sync(0xffffffff, x[0], 16); std::max(1, 2); }')
    problems = lint(bad)
    assert len(problems) >= 5, problems


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
