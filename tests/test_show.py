"""gpullm_lessons.viz.show: the source excerpts and the compile report the lessons print."""
import inspect
import re
from pathlib import Path

import pytest

from gpullm_lessons.runtime import hip
from gpullm_lessons.viz import show
from gpullm_lessons import reference as ref
from gpullm_lessons.kernels.numba import vector_add

ROOT = Path(__file__).resolve().parents[1]
HEADER = re.compile(r"^(?P<path>\S+), lines (?P<first>\d+)-(?P<last>\d+)$")
MORE = re.compile(r"^\.\.\. (?P<n>\d+) more lines \((?P<path>\S+):(?P<first>\d+)-(?P<last>\d+)\)$")


def printed(capsys, *args, **kwargs) -> list[str]:
    show.source(*args, **kwargs)
    out = capsys.readouterr().out.split("\n")
    while out and out[-1] == "":
        out.pop()
    return out


def header(line: str) -> tuple[str, int, int]:
    m = HEADER.match(line)
    assert m, f"not a header line: {line!r}"
    return m["path"], int(m["first"]), int(m["last"])


@pytest.mark.parametrize("obj", [ref.linear_backward, vector_add.vector_add_v1], ids=["python", "numba-kernel"])
def test_a_function_comes_under_its_path_from_the_root_and_its_line_numbers(capsys, obj):
    func = inspect.unwrap(getattr(obj, "py_func", obj))
    lines, first = inspect.getsourcelines(func)
    out = printed(capsys, obj, max_lines=1000)
    path, got_first, got_last = header(out[0])
    assert path == Path(inspect.getsourcefile(func)).resolve().relative_to(ROOT).as_posix()
    assert (got_first, got_last) == (first, first + len(lines) - 1)
    assert out[1:] == [line.rstrip("\n") for line in lines]


def test_start_and_stop_pick_the_lines_of_a_hip_source(capsys):
    start, stop = "// v1_m: m = b1 m", "// v1_v:"
    file_lines = hip.source_path("adamw").read_text().splitlines()
    out = printed(capsys, "adamw", start=start, stop=stop)
    path, first, last = header(out[0])
    body = out[1:]
    assert path == "kernels/hip/adamw.cu"
    assert body == file_lines[first - 1:last], "the header's line numbers are not the lines printed"
    assert start in body[0] and not any(start in line for line in file_lines[:first - 1]), "not the first match"
    assert not any(stop in line for line in body)
    assert stop in next(line for line in file_lines[last:] if line.strip()), "the excerpt does not end at `stop`"
    assert len(body) > 1


def test_a_header_of_kernels_hip_is_shown_by_its_name(capsys):
    """flash_common.h (what flash.cu's versions share) by its file name, under its path and line numbers."""
    start, stop = "// The reduction of a row's value", "// v3's register tiles"
    file_lines = (hip.kernel_dir() / "flash_common.h").read_text().splitlines()
    out = printed(capsys, "flash_common.h", start=start, stop=stop)
    path, first, last = header(out[0])
    assert path == "kernels/hip/flash_common.h"
    assert out[1:] == file_lines[first - 1:last] and start in out[1] and "row_sum" in "\n".join(out)
    with pytest.raises(FileNotFoundError, match=r"no HIP header nope\.h .*flash_common\.h"):
        show.source("nope.h")


def test_a_long_excerpt_is_cut_at_max_lines_and_says_where_the_rest_is(capsys):
    file_lines = hip.source_path("adamw").read_text().splitlines()
    while not file_lines[-1].strip():
        file_lines.pop()
    assert len(file_lines) > 12
    out = printed(capsys, "adamw", max_lines=7)
    assert header(out[0]) == ("kernels/hip/adamw.cu", 1, len(file_lines))
    assert out[1:8] == file_lines[:7]
    assert len(out) == 9
    m = MORE.match(out[8])
    assert m, f"no '... N more lines' line: {out[8]!r}"
    assert (int(m["n"]), m["path"], int(m["first"]), int(m["last"])) == \
        (len(file_lines) - 7, "kernels/hip/adamw.cu", 8, len(file_lines))


def test_an_excerpt_of_max_lines_is_not_cut(capsys):
    lines, _ = inspect.getsourcelines(ref.linear_backward)
    out = printed(capsys, ref.linear_backward, max_lines=len(lines))
    assert len(out) == 1 + len(lines) and not MORE.match(out[-1])


def test_a_start_or_stop_that_is_not_there_raises_and_names_it(capsys):
    with pytest.raises(ValueError) as e:
        show.source("adamw", start="// v9: no such kernel")
    assert "// v9: no such kernel" in str(e.value) and "kernels/hip/adamw.cu" in str(e.value)
    with pytest.raises(ValueError) as e:
        show.source(ref.linear_backward, start="no such line")
    assert "no such line" in str(e.value) and "gpullm_lessons/reference/linear.py" in str(e.value)
    with pytest.raises(ValueError, match="no such stop"):
        show.source("adamw", start="// v1_m:", stop="no such stop")
    assert capsys.readouterr().out == "", "printed something before raising"


def test_compile_report_says_compiles_fails_with_the_log_or_skipped(capsys, monkeypatch):
    monkeypatch.setattr(hip, "compile_nvrtc", lambda name, arch, options: (True, ""))
    show.compile_report("gelu")
    assert capsys.readouterr().out == "gelu.cu for NVIDIA sm_90 (NVRTC): compiles\n"
    monkeypatch.setattr(hip, "compile_nvrtc", lambda name, arch, options: (False, f"error in {name} for {arch} {options}"))
    show.compile_report("encoder", arch="sm_80")
    assert capsys.readouterr().out == "encoder.cu for NVIDIA sm_80 (NVRTC): FAILS\nerror in encoder for sm_80 ()\n"
    show.compile_report("flash", options=("-DFLASH_PART_V=2",), part="v2")     # one part, passed on and named
    out = capsys.readouterr().out
    assert out == "flash.cu (v2) for NVIDIA sm_90 (NVRTC): FAILS\nerror in flash for sm_90 ('-DFLASH_PART_V=2',)\n"

    def no_bindings(name, arch, options):
        raise ImportError("no cuda.bindings")
    monkeypatch.setattr(hip, "compile_nvrtc", no_bindings)
    show.compile_report("gelu")
    assert "compile check skipped" in capsys.readouterr().out
