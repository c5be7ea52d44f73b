"""Test setup: the package is imported first, so with no GPU the CUDA simulator is on before numba loads."""
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import gpullm_lessons  # noqa: E402,F401  (must precede any numba import)
from gpullm_lessons import device  # noqa: E402

if os.environ.get("GPULLM_CUPY_POOL") == "off" and device.has_gpu():
    # make sanitize (gpullm_lessons/bench/sanitize.py): one cudaMalloc per CuPy array instead of the memory pool, so that
    # compute-sanitizer's memcheck sees a read past an array's end
    import cupy as _cp

    _cp.cuda.set_allocator(None)


# `make test` runs on 2 pytest-xdist workers with --dist loadfile: each test file, and each notebook (nbval runs a
# notebook's cells in order in one kernel), is one unit of work that one worker runs all of, in order, as a serial
# run does. The MPI tests (mpirun -n 2 on 2 cores), the browser test (JupyterLab + Chromium; lesson 10 starts
# mpirun) and the lessons of notebooks/ when nbval runs them instead (lesson 10 again) count as one file here: one
# at a time, never side by side, and first (the longest unit: the other worker runs the rest meanwhile). A new test
# file that starts mpirun, or a server that needs a CPU of its own to answer in time, belongs in ONE_AT_A_TIME
# (tests/test_jupyterhub.py: its hub and learner servers start in seconds and are given 60 to 90: it runs beside).
ONE_AT_A_TIME = ("tests/test_browser.py", "tests/test_comm.py", "tests/test_parallel.py", "tests/test_train_ranks.py",
                 "tests/test_grad_accum.py", "tests/test_slurm.py", "tests/test_pipeline_ranks.py",
                 "tests/test_ring_attention_ranks.py", "tests/test_zero3_ranks.py", "tests/test_zeropp_ranks.py",
                 "tests/test_tensor_parallel_ranks.py", "tests/test_ulysses_ranks.py", "tests/test_course_check.py",
                 "notebooks/")


def _one_at_a_time(nodeid: str) -> bool:
    return nodeid.startswith(ONE_AT_A_TIME)


@pytest.hookimpl(tryfirst=True, optionalhook=True)   # an xdist hook: before xdist's own; no xdist, never called
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile, with the files of ONE_AT_A_TIME as one unit (the unit is a test's node id up to the first
    '::', its file; pytest-xdist's loadgroup would need the node ids rewritten, which pytest 9.2 no longer allows)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class LoadFileOneAtATime(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "one-at-a-time" if _one_at_a_time(nodeid) else super()._split_scope(nodeid)

    return LoadFileOneAtATime(config, log)


def pytest_collection_modifyitems(config, items):
    """On an xdist worker, the one-at-a-time unit first (make test passes --no-loadscope-reorder: the units go out in
    collection order). Tests marked `gpu` skip, with the reason, without a GPU (`make gpu-test` refuses to start
    without one)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: not _one_at_a_time(item.nodeid))   # stable: each file's order kept
    if device.has_gpu():
        return
    skip = pytest.mark.skip(reason=f"needs a real GPU; this machine runs as '{device.kind()}' ({device.info().reason})")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def require_tool(name: str):
    """Skip when a compiler is missing, unless GPULLM_REQUIRE_COMPILERS=1 (CI), where it fails."""
    import shutil
    if shutil.which(name):
        return
    msg = f"{name} not found (install it: see `python -m gpullm_lessons doctor`)"
    if os.environ.get("GPULLM_REQUIRE_COMPILERS") == "1":
        pytest.fail("GPULLM_REQUIRE_COMPILERS=1 but " + msg)
    pytest.skip(msg)


def solution_cells(nb):
    """(index, source) of the code cells a test runs to get a solution notebook's functions: not the checker
    cells (the tests make their own calls) and not the `viz.show_kernel` cells (drawing is not under test there)."""
    from gpullm_lessons.classroom.grading import checker_only_cells
    skip = checker_only_cells(nb)
    return [(i, c.source) for i, c in enumerate(nb.cells)
            if c.cell_type == "code" and i not in skip and "show_kernel(" not in c.source]


def solution_namespace(name: str, edits=()) -> dict:
    """The namespace of solutions/<name>.ipynb after running solution_cells (cache it in the caller). edits: (cell id,
    old text, new text), each old text found exactly once in that cell, so that a changed solution fails loudly
    instead of testing nothing: a plausible wrong answer is the solution with one edit."""
    import linecache

    import nbformat
    nb = nbformat.read(ROOT / "solutions" / f"{name}.ipynb", as_version=4)
    todo = list(edits)
    ns: dict = {"__name__": f"solution_{name}"}
    for i, src in solution_cells(nb):
        cid = nb.cells[i].get("id")
        for e in [e for e in todo if e[0] == cid]:
            assert src.count(e[1]) == 1, f"edit not found once in cell {cid}: {e[1]!r}"
            src = src.replace(e[1], e[2])
            todo.remove(e)
        filename = f"<solution {name} cell {i}>"
        linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)   # as IPython does for a cell
        exec(compile(src, filename, "exec"), ns)
    assert not todo, f"cells not found for edits: {todo}"
    return ns


def quiet_solution_namespace(name: str, cell: str, *edits) -> dict:
    """solution_namespace(name) with edits (old, new) in one cell, the notebook's prints and warnings kept quiet."""
    import contextlib
    import io
    import warnings

    import numpy as np

    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        return solution_namespace(name, [(cell, old, new) for old, new in edits])


def wrong(result, *words):
    """The verdict is wrong (or an error) and its message or hint says every one of `words` (case-insensitive)."""
    assert result.status in ("wrong", "error"), result.message
    text = (result.message + " " + (result.hint or "")).lower()
    missing = [w for w in words if w.lower() not in text]
    assert not missing, f"the hint does not say {missing}: {result.message}"
