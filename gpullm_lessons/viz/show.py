"""What a lesson prints of the course's own code: source excerpts, and the compile check of a HIP source.

``source(obj)`` prints the source of a Python function, class or method (a Numba kernel too: its Python function),
``source("adamw")`` the HIP source ``kernels/hip/adamw.cu``, ``source("flash_common.h")`` a header of ``kernels/hip``
(named with its ``.h``: what flash.cu's versions share). ``start=`` / ``stop=`` pick an excerpt by substrings: it
begins at the first line containing ``start`` and ends before the first later line containing ``stop``. A string
that is not there raises ValueError naming it and the file, so an edited source never makes a lesson print the
whole file instead. The excerpt comes under a header saying where it is (the path from the repository root and the
line numbers, e.g. ``kernels/numba/softmax.py, lines 40-62``); past ``max_lines`` lines it is cut, and one last line
says how many lines were left out and where they are (``... 20 more lines (kernels/hip/adamw.cu:71-90)``).

``compile_report("gelu")`` compiles ``kernels/hip/gelu.cu`` with NVRTC for NVIDIA sm_90 without a GPU (see
``hip.compile_nvrtc``) and prints one line: it compiles, or it fails with the compiler's log. ``options=`` and
``part=`` compile one part of a file and name it (flash.cu's versions: ``backends.hip.flash.part_options``).

Lessons call these instead of defining helpers of their own (``from gpullm_lessons import show``).
"""

from __future__ import annotations

import inspect
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parents[1]  # the gpullm_lessons package


def _display_path(path) -> str:
    """A source file's path as the repository spells it: kernels/... or gpullm_lessons/..., else the path as is.
    (An install puts kernels/ inside the package; the checkout has it beside the package.)"""
    from ..runtime import hip  # here, not at the top: viz modules import only each other at module level

    path = Path(path).resolve()
    for folder, name in ((hip.kernel_dir().resolve().parent, "kernels"), (_PACKAGE, "gpullm_lessons")):
        try:
            return f"{name}/{path.relative_to(folder).as_posix()}"
        except ValueError:
            pass
    return str(path)


def _lines_of(obj) -> tuple[str, int, list[str], str]:
    """(display path, line number of the first line, the lines, what they are) for a HIP name (a source, or a header
    named with its .h) or a Python object."""
    if isinstance(obj, str):
        from ..runtime import hip

        path = hip.kernel_dir() / obj if obj.endswith(".h") else hip.source_path(obj)
        if not path.exists():
            headers = ", ".join(sorted(p.name for p in hip.kernel_dir().glob("*.h")))
            raise FileNotFoundError(f"no HIP header {obj} in {hip.kernel_dir()} (headers: {headers})")
        return _display_path(path), 1, path.read_text(encoding="utf-8").splitlines(), _display_path(path)
    obj = inspect.unwrap(getattr(obj, "py_func", obj))  # a Numba kernel: its Python function
    lines, first = inspect.getsourcelines(obj)
    where = _display_path(inspect.getsourcefile(obj))
    name = getattr(obj, "__qualname__", getattr(obj, "__name__", repr(obj)))
    return where, max(first, 1), [line.rstrip("\n") for line in lines], f"the source of {name} ({where})"


def excerpt(obj, start: str | None = None, stop: str | None = None) -> tuple[str, int, list[str]]:
    """(display path, number of the first line, the lines) that ``source`` prints, before any cut at max_lines."""
    where, first, lines, what = _lines_of(obj)
    i, j = 0, len(lines)
    if start is not None:
        i = next((k for k, line in enumerate(lines) if start in line), None)
        if i is None:
            raise ValueError(f"{start!r} is not in {what}: no excerpt starts there")
    if stop is not None:
        j = next((k for k in range(i + 1, len(lines)) if stop in lines[k]), None)
        if j is None:
            raise ValueError(f"{stop!r} is not in {what} after line {first + i}: no excerpt stops there")
    while j > i + 1 and not lines[j - 1].strip():  # no trailing blank lines
        j -= 1
    return where, first + i, lines[i:j]


def source(obj, start: str | None = None, stop: str | None = None, max_lines: int = 30) -> None:
    """Print an excerpt of a Python object's source, of ``kernels/hip/<obj>.cu`` (obj a str) or of the header
    ``kernels/hip/<obj>`` (obj a str ending in .h) under a header."""
    where, first, lines = excerpt(obj, start, stop)
    last = first + len(lines) - 1
    print(f"{where}, lines {first}-{last}")
    print("\n".join(lines[:max_lines]))
    if len(lines) > max_lines:
        print(f"... {len(lines) - max_lines} more lines ({where}:{first + max_lines}-{last})")
    print()


def compile_report(name: str, arch: str = "sm_90", options=(), part: str = "") -> None:
    """Compile kernels/hip/<name>.cu for NVIDIA (NVRTC, sm_90) without running it. options: more compiler options,
    e.g. flash.cu's part_options (one version's entry points: the whole file takes minutes), named by `part`."""
    from ..runtime import hip

    what = f"{name}.cu" + (f" ({part})" if part else "")
    try:
        ok, log = hip.compile_nvrtc(name, arch, options)
        print(f"{what} for NVIDIA {arch} (NVRTC): " + ("compiles" if ok else "FAILS\n" + log))
    except ImportError:
        print(f"{what}: NVRTC bindings not installed (pip install -e '.[dev]'), compile check skipped")
