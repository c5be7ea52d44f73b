"""`make gpu-test` (gpullm_lessons/bench/gpu_suite.py): the scheduling units, the summary, and sticky CUDA errors contained.

A broken CUDA context (after an illegal address) fails every later call in its process. Without a GPU that is
played by a stand-in: a test "breaks" its process (a module global that every later test of that process trips
over, with CUDA's own message) and the suite runs on 2 pytest-xdist workers. Under the plugin: one failure (the
breaking test), every other test passes, and the tests after the break ran in another process. Without the plugin the
same files fail many times: the stand-in is one the plugin must beat. On a GPU the same with a real illegal access.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpullm_lessons.bench import gpu_suite

ROOT = Path(__file__).resolve().parents[1]
N_AFTER = 40


def test_units_split_tests_but_keep_notebooks_and_mpi_files_whole():
    assert (
        gpu_suite.unit_of("tests/test_hip_flash.py::test_flash[1x1-v2]")
        == "tests/test_hip_flash.py::test_flash[1x1-v2]"
    )
    assert gpu_suite.unit_of("notebooks/03_softmax_backward.ipynb::Cell 4") == "notebooks/03_softmax_backward.ipynb"
    assert gpu_suite.unit_of("solutions/11_flash_attention.ipynb::Cell 0") == "solutions/11_flash_attention.ipynb"
    assert gpu_suite.unit_of("tests/test_comm.py::test_ring[2]") == "tests/test_comm.py"
    assert [gpu_suite.part_of(n) for n in ("tests/a.py::t", "notebooks/x.ipynb::Cell 1", "solutions/y.ipynb")] == [
        "tests",
        "notebooks",
        "solutions",
    ]
    assert gpu_suite.STICKY.search(
        "CUDARuntimeError: cudaErrorIllegalAddress: an illegal memory access was encountered"
    )
    assert not gpu_suite.STICKY.search("CUDARuntimeError: cudaErrorMemoryAllocation: out of memory")  # not sticky


STAND_IN = """
import os
import pytest

BROKEN = []  # this process's "CUDA context": broken once a test breaks it


def _launch():
    if BROKEN:
        raise RuntimeError("cudaErrorIllegalAddress: an illegal memory access was encountered")


def test_a_fine():
    _launch()


def test_b_breaks_the_context():
    BROKEN.append(os.getpid())
    (Path := __import__("pathlib").Path)("broken_pid").write_text(str(os.getpid()))
    _launch()


@pytest.mark.parametrize("i", range({n}))
def test_c_after(i):
    _launch()
    __import__("pathlib").Path(f"ran_{{i}}").write_text(str(os.getpid()))
"""


def run_two_workers(tmp_path, test_file: str, plugin: bool = True):
    """pytest on 2 xdist workers over `test_file` in tmp_path, with the gpu_suite plugin or without: (result, output)."""
    plugin_args = ["-p", "gpullm_lessons.bench.gpu_suite"] if plugin else []
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugin_args, "-n", "2", "--dist",
            "loadscope", "--no-loadscope-reorder", test_file]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT), GPULLM_STICKY_DIR=str(tmp_path / "notes"))
    (tmp_path / "notes").mkdir(exist_ok=True)
    r = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)
    return r, r.stdout + r.stderr


def run_suite(tmp_path, plugin: bool):
    (tmp_path / "test_stand_in.py").write_text(STAND_IN.format(n=N_AFTER))
    return run_two_workers(tmp_path, "test_stand_in.py", plugin)


def test_a_sticky_error_costs_one_failure_and_the_rest_run_in_a_fresh_process(tmp_path):
    r, out = run_suite(tmp_path, plugin=True)
    assert r.returncode == 1, out
    assert "1 failed" in out and f"{N_AFTER + 1} passed" in out, out
    assert "FAILED test_stand_in.py::test_b_breaks_the_context" in out, out
    broken = (tmp_path / "broken_pid").read_text()
    pids = {(tmp_path / f"ran_{i}").read_text() for i in range(N_AFTER)}
    assert len(pids) >= 2 and broken not in pids, (broken, pids)  # nothing ran after the break in that process


def test_without_the_plugin_the_same_break_fails_many(tmp_path):
    r, out = run_suite(tmp_path, plugin=False)
    failed = int(out.split(" failed")[0].split()[-1])
    assert r.returncode == 1 and failed > 5, out


def test_the_summary_counts_each_part_and_names_each_failure(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text(
        textwrap.dedent("""
        import pytest
        def test_ok(): pass
        def test_bad(): assert 1 == 2, "one is not two"
        def test_bare():
            import numpy as np
            np.testing.assert_array_equal(np.zeros(3), np.ones(3))
        @pytest.mark.skip(reason="no")
        def test_skip(): pass
    """)
    )
    script = textwrap.dedent("""
        import json, pytest
        from gpullm_lessons.bench import gpu_suite
        c = gpu_suite.Collector()
        pytest.main(["-q", "-p", "no:cacheprovider", "tests"], plugins=[c])
        print("SUMMARY" + json.dumps(gpu_suite.summarise(c, ["tests"], {"card": "stand-in"})))
    """)
    r = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    s = json.loads(r.stdout.split("SUMMARY", 1)[1])
    assert s["parts"]["tests"] | {"test_minutes": 0} == {"passed": 1, "failed": 2, "skipped": 1, "test_minutes": 0}
    assert s["failures"] == [
        {"nodeid": "tests/test_x.py::test_bad", "message": "AssertionError: one is not two"},
        {"nodeid": "tests/test_x.py::test_bare", "message": "AssertionError: Arrays are not equal"},
    ]
    assert s["green"] is False and s["card"] == "stand-in"
    assert s["skipped_because"] == {"Skipped: no": 1}


STORED = {"h100": "H100", "h200": "H200"}  # gpullm_lessons/results/gpu_test_<key>.json: the card it names


def test_the_stored_summaries_are_whole_runs_within_nine_minutes_and_the_readme_tells_them():
    """gpullm_lessons/results/gpu_test_h100.json and _h200.json: each a whole run (every part) of `make gpu-test` on
    the card its name says, within 9 minutes, of a commit of this repository, not of a changed tree; the README's
    table gives each one's card, minutes, counts and failures as the file has them (green or not)."""
    readme = (ROOT / "README.md").read_text()
    for key, card in STORED.items():
        path = ROOT / "gpullm_lessons" / "results" / f"gpu_test_{key}.json"
        s = json.loads(path.read_text())
        assert set(s["parts"]) == set(gpu_suite.PARTS) and card in s["card"], path.name
        assert s["minutes"] <= 9 and not s["dirty"] and len(s["commit"]) == 40 and s["date"], path.name
        known = subprocess.run(["git", "cat-file", "-e", s["commit"] + "^{commit}"], cwd=ROOT, capture_output=True)
        if (ROOT / ".git").exists():
            assert known.returncode == 0, f"{path.name}: commit {s['commit']} is not in this repository"
        p = s["parts"]
        row = (
            f"| {s['card']} | {s['minutes']} | {p['tests']['passed']} passed, {p['tests']['skipped']} skipped | "
            f"{p['notebooks']['passed']} passed | {p['solutions']['passed']} passed | "
        )
        assert row in readme, f"README's row for {path.name} should start: {row}"
        line = readme[readme.index(row) + len(row) :].split("\n", 1)[0]
        fails = s["failures"]
        assert line.startswith(f"{len(fails)}" if fails else "0"), line
        assert all(f["nodeid"].split("/", 1)[1] in line for f in fails), line
        assert (f"{s['date'][:10]}") in readme


@pytest.mark.gpu
def test_a_real_illegal_access_costs_one_failure(tmp_path):
    (tmp_path / "test_planted.py").write_text(
        textwrap.dedent(f"""
        import cupy as cp
        import pytest

        BAD = cp.RawKernel(r'extern "C" __global__ void bad(float* p) {{ p[1ll << 40] = 1.0f; }}', "bad")

        def test_a_illegal_access():
            x = cp.zeros(4, cp.float32)
            BAD((1,), (1,), (x,))
            cp.cuda.runtime.deviceSynchronize()

        @pytest.mark.parametrize("i", range({N_AFTER}))
        def test_b_after(i):
            assert float(cp.arange(10, dtype=cp.float32).sum()) == 45.0
    """)
    )
    _, out = run_two_workers(tmp_path, "test_planted.py")
    assert "1 failed" in out and f"{N_AFTER} passed" in out, out


def test_a_notebook_whose_kernel_never_started_runs_again_and_only_that():
    """nbval's "Kernel died before replying to kernel_info" on every cell: the notebook tested nothing, so it runs
    again alone and its second result replaces the first; a notebook with any other failure, or with a cell that ran,
    is not run again (a stand-in runner plays pytest)."""

    class Report:
        def __init__(self, nodeid, outcome, message=""):
            self.nodeid, self.outcome, self.duration = nodeid, outcome, 0.1
            self.failed, self.skipped = outcome == "failed", outcome == "skipped"
            self.longreprtext, self.longrepr = message, None

    died = f"RuntimeError: {gpu_suite.NO_KERNEL}"
    c = gpu_suite.Collector()
    first = [
        Report("notebooks/08_a.ipynb::Cell 0", "failed", died),
        Report("notebooks/08_a.ipynb::Cell 1", "failed", died),
        Report("notebooks/09_b.ipynb::Cell 0", "passed"),
        Report("notebooks/09_b.ipynb::Cell 1", "failed", died),  # a cell ran: its kernel died later, a real failure
        Report("solutions/10_c.ipynb::Cell 0", "failed", "AssertionError: wrong"),
        Report("solutions/11_d.ipynb::Cell 0", "failed", died),
        Report("tests/test_x.py::test_y", "failed", died),  # not a notebook
    ]
    for r in first:
        c.pytest_runtest_logreport(r)
    assert gpu_suite.unstarted_notebooks(c) == ["notebooks/08_a.ipynb", "solutions/11_d.ipynb"]
    calls = []

    def runner(args, plugins):
        calls.append(args)
        (collector,) = plugins
        collector.pytest_runtest_logreport(Report("notebooks/08_a.ipynb::Cell 0", "passed"))
        collector.pytest_runtest_logreport(Report("notebooks/08_a.ipynb::Cell 1", "passed"))
        collector.pytest_runtest_logreport(Report("solutions/11_d.ipynb::Cell 0", "failed", died))  # again: it stands
        return 1

    again = gpu_suite.rerun_unstarted(c, ["-q"], run=runner)
    assert again == ["notebooks/08_a.ipynb", "solutions/11_d.ipynb"]
    assert calls == [["-q", "-n", "0", "notebooks/08_a.ipynb", "solutions/11_d.ipynb"]]
    s = gpu_suite.summarise(c, ["tests", "notebooks", "solutions"], {})
    failed = {f["nodeid"] for f in s["failures"]}
    assert failed == {
        "notebooks/09_b.ipynb::Cell 1",
        "solutions/10_c.ipynb::Cell 0",
        "solutions/11_d.ipynb::Cell 0",
        "tests/test_x.py::test_y",
    }
    assert s["parts"]["notebooks"]["passed"] == 3 and [r["nodeid"] for r in s["reruns"]] == again
    assert gpu_suite.rerun_unstarted(gpu_suite.Collector(), ["-q"], run=runner) == [] and len(calls) == 1
