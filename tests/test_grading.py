"""The grader: record() protocol, static task discovery, merging verdicts, and running notebooks in kernels.

Fixture notebooks are built here with nbformat in tmp_path. They define their own tiny checker,
``check_double(fn, task=None)``, which talks to the grader through ``gpullm_lessons.grading.record`` exactly as
the real checkers in gpullm_lessons.checks do. Tests that start kernels are marked slow (about 5 s a kernel).
"""
import json
import os
import time
from pathlib import Path

import nbformat
import pytest

from gpullm_lessons import grading
from gpullm_lessons.exercises import generate
from gpullm_lessons.grading import Report, Task, TaskResult, find_tasks, grade, merge, record

C = nbformat.v4.new_code_cell
M = nbformat.v4.new_markdown_cell

CHECKER = '''\
from gpullm_lessons.grading import record

def check_double(fn, task=None):
    """Fixture checker: same protocol as gpullm_lessons.checks."""
    try:
        ok = fn(3) == 6 and fn(-1.5) == -3.0
    except NotImplementedError:
        return record(check="check_double", task=task, status="not attempted", message="not implemented yet")
    except Exception as e:
        return record(check="check_double", task=task, status="error", message=f"{type(e).__name__}: {e}")
    record(check="check_double", task=task, status="correct" if ok else "wrong", message="fn(3) == 6")
'''
DOUBLE = "def double(x):\n    ### BEGIN SOLUTION\n    # TODO: return two times x\n    return 2 * x\n    ### END SOLUTION"
TWICE = "def twice(x):\n    ### BEGIN SOLUTION\n    return x + x\n    ### END SOLUTION"


def write_nb(path: Path, *sources) -> Path:
    """A notebook from cell sources; strings starting with '#md ' become markdown cells."""
    cells = [M(s[4:]) if s.startswith("#md ") else C(s) for s in sources]
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nbformat.v4.new_notebook(cells=cells), str(path))
    return path


def _has_python3_kernel() -> bool:
    try:
        from jupyter_client.kernelspec import KernelSpecManager
        KernelSpecManager().get_kernel_spec("python3")
        return True
    except Exception:
        return False


needs_kernel = pytest.mark.skipif(not _has_python3_kernel(),
                                  reason="no 'python3' Jupyter kernel: python -m ipykernel install --sys-prefix")


def statuses(report, notebook):
    return {t.task: (t.status, t.message) for t in report.tasks if t.notebook == notebook}


# ---------------------------------------------------------------------------------------------- record
def test_record_is_a_noop_without_the_env_var(monkeypatch, tmp_path):
    monkeypatch.delenv(grading.LOG_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    assert record(check="check_x", task=None, status="correct", message="ok") is None
    assert list(tmp_path.iterdir()) == []


def test_record_appends_one_json_line_per_verdict(monkeypatch, tmp_path):
    log = tmp_path / "grade.jsonl"
    monkeypatch.setenv(grading.LOG_ENV, str(log))
    monkeypatch.setenv(grading.NOTEBOOK_ENV, "02_linear.ipynb")
    record(check="check_linear_backward", task=None, status="correct", message="max err\n3e-7")
    record(check="check_softmax_backward", task="03.2 softmax backward (Numba)", status="wrong", message=1.5)
    lines = log.read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"check": "check_linear_backward", "task": None, "status": "correct", "message": "max err 3e-7",
         "notebook": "02_linear.ipynb"},
        {"check": "check_softmax_backward", "task": "03.2 softmax backward (Numba)", "status": "wrong",
         "message": "1.5", "notebook": "02_linear.ipynb"},
    ]


def test_record_never_raises(monkeypatch, tmp_path):
    monkeypatch.setenv(grading.LOG_ENV, str(tmp_path))  # a directory: open() fails

    class Evil:
        def __str__(self):
            raise RuntimeError("no str for you")

    record(check="check_x", task=None, status="correct", message="ok")
    record(check=Evil(), task=Evil(), status=Evil(), message=Evil())


# ---------------------------------------------------------------------------------------------- find_tasks
def test_find_tasks_labels_magics_duplicates_and_unparseable_cells(tmp_path):
    nb = write_nb(
        tmp_path / "03_softmax.ipynb",
        "#md check_not_a_task(markdown)",
        "%matplotlib inline\n!pip list\nimport numpy as np",
        "check_softmax_backward(softmax_backward)\n"
        "check_softmax_backward(softmax_backward_numba, arrays='numba', task='03.2 softmax backward (Numba)')",
        "%time check_gelu_backward(gelu_backward)\nfor _ in range(1):\n    !echo hi\n    checks.check_linear_backward(f)",
        "%%bash\necho this is not python; check_ignored(x)",  # cell magic: does not parse, skipped
        "def check_helper(fn):\n    check_inner(fn)  # inside a def: not a task\n"
        "check_softmax_backward(softmax_backward)",  # same label again -> ' #2'
        "check_softmax_backward(f, task=name)",  # non-literal task= -> the checker name
    )
    tasks = find_tasks(nb)
    assert [(t.label, t.check, t.cell) for t in tasks] == [
        ("softmax_backward", "check_softmax_backward", 2),
        ("03.2 softmax backward (Numba)", "check_softmax_backward", 2),
        ("gelu_backward", "check_gelu_backward", 3),
        ("linear_backward", "check_linear_backward", 3),
        ("softmax_backward #2", "check_softmax_backward", 5),
        ("softmax_backward #3", "check_softmax_backward", 6),
    ]
    assert all(t.notebook == "03_softmax.ipynb" for t in tasks)
    assert tasks[1].key == "03.2 softmax backward (Numba)" and tasks[4].key == "softmax_backward"
    assert (tasks[0].line, tasks[1].line) == (1, 2)


# ---------------------------------------------------------------------------------------------- merge
def _v(check, status, task=None, message=""):
    return {"check": check, "task": task, "status": status, "message": message}


def test_merge_matches_verdicts_by_cell_and_label():
    t = [Task("a.ipynb", "double", "check_double", "double", 1, 1),
         Task("a.ipynb", "double #2", "check_double", "double", 1, 2),
         Task("a.ipynb", "named", "check_double", "named", 2, 1),
         Task("a.ipynb", "double #3", "check_double", "double", 3, 1),
         Task("a.ipynb", "late", "check_double", "late", 4, 1),
         Task("a.ipynb", "helper", "check_helper", "helper", 5, 1)]
    log = [{"_event": "cell", "cell": 1},
           _v("check_double", "correct"), _v("double", "wrong"),  # two calls in one cell, in order
           {"_event": "cell", "cell": 2},
           _v("check_double", "wrong", task="named"), _v("check_double", "correct", task="named"),  # last wins
           {"_event": "cell", "cell": 3},
           {"_event": "cell_error", "cell": 3, "ename": "ZeroDivisionError", "evalue": "division by zero"},
           {"_event": "cell", "cell": 4}, {"_event": "cell", "cell": 6},
           _v("check_helper", "correct"),  # called from another cell than the static call: matched by label
           _v("check_extra", "wrong", task="bonus task")]  # not found statically: added
    results, errors = merge(t, log, "a.ipynb")
    got = [(r.task, r.status, r.points, r.message) for r in results]
    assert got == [
        ("double", "correct", 1, ""),
        ("double #2", "wrong", 0, ""),
        ("named", "correct", 1, ""),
        ("double #3", "not run", 0, "cell error: ZeroDivisionError: division by zero (cell 3)"),
        ("late", "not run", 0, "no verdict recorded (the checker did not run)"),
        ("helper", "correct", 1, ""),
        ("bonus task", "wrong", 0, ""),
    ]
    assert errors == ["cell 3: ZeroDivisionError: division by zero"]

    # killed from outside while cell 3 ran: tasks from cell 3 on are lost to the timeout, earlier ones kept
    results, _ = merge(t[:5], log[:6], "a.ipynb", stop_reason="timeout after 20s")
    assert [(r.task, r.status, r.message) for r in results] == [
        ("double", "correct", ""), ("double #2", "wrong", ""), ("named", "correct", ""),
        ("double #3", "not run", "timeout after 20s"), ("late", "not run", "timeout after 20s")]


def test_merge_accepts_a_label_chosen_by_the_checker_itself():
    # check_gelu_backward(gelu_backward) without task=, but the checker records its own default label
    t = [Task("a.ipynb", "gelu_backward", "check_gelu_backward", "gelu_backward", 2, 1)]
    log = [{"_event": "cell", "cell": 2}, _v("check_gelu_backward", "wrong", task="04.1 GELU backward")]
    results, _ = merge(t, log, "a.ipynb")
    assert [(r.task, r.status) for r in results] == [("gelu_backward", "wrong")]


def test_report_table_and_json(tmp_path):
    rows = [TaskResult("01_a.ipynb", "double", "correct", 1, "ok", "check_double"),
            TaskResult("01_a.ipynb", "03.2 softmax backward (Numba)", "wrong", 0, "max err 0.5", "check_x"),
            TaskResult("02_b.ipynb", "twice", "not run", 0, "timeout after 20s", "check_double")]
    nbs = [grading.NotebookResult("01_a.ipynb", 1, 2, None, 3.0),
           grading.NotebookResult("02_b.ipynb", 0, 1, "timeout after 20s", 20.0)]
    report = Report(rows, nbs, "exercises")
    assert (report.score, report.total) == (1, 3)
    text = report.format()
    lines = text.splitlines()
    assert lines[0].split() == ["notebook", "task", "status", "pts", "message"]
    assert lines[0].index("task") == lines[2].index("double")  # fixed-width columns
    assert lines[0].index("status") == lines[2].index("correct") == lines[3].index("wrong")
    assert "01_a.ipynb: 1/2 (50%)" in text and "02_b.ipynb: 0/1 (0%)  [timeout after 20s]" in text
    assert lines[-1] == "score: 1/3 (33%)"
    report.to_json(tmp_path / "out" / "report.json")
    data = json.loads((tmp_path / "out" / "report.json").read_text())
    assert (data["score"], data["total"]) == (1, 3)
    assert data["tasks"][1] == {"notebook": "01_a.ipynb", "task": "03.2 softmax backward (Numba)",
                                "status": "wrong", "points": 0, "message": "max err 0.5", "check": "check_x"}
    assert data["notebooks"][1]["failure"] == "timeout after 20s"


# ---------------------------------------------------------------------------------------------- CLI args
@pytest.mark.parametrize("argv, needle", [
    (["grade", "no/such/dir"], "no such directory"),
    (["grade", ".", "--timeout", "0"], "--timeout must be a positive"),
    (["grade", ".", "--timeout", "soon"], "invalid float value"),
    (["grade", ".", "--bogus"], "unrecognized arguments"),
])
def test_main_rejects_bad_arguments_with_exit_2(argv, needle, capsys):
    assert grading.main(argv) == 2
    assert needle in capsys.readouterr().err


def test_grade_missing_directory_raises():
    with pytest.raises(FileNotFoundError, match="no such directory"):
        grade("no/such/dir")


# ---------------------------------------------------------------------------------------------- kernels
@pytest.fixture(scope="module")
def course(tmp_path_factory):
    """solutions/01_double.ipynb (two tasks) and its generated exercises/01_double.ipynb."""
    root = tmp_path_factory.mktemp("course")
    write_nb(root / "solutions" / "01_double.ipynb",
             "#md # Doubling", CHECKER, DOUBLE, "check_double(double)",
             TWICE, "check_double(twice, task='01.2 twice')")
    generate(root / "solutions", root / "exercises")
    return root


@pytest.mark.slow
@needs_kernel
def test_solution_scores_100_through_the_cli(course, tmp_path, capsys):
    out = tmp_path / "report.json"
    assert grading.main(["grade", str(course / "solutions"), "--json", str(out), "--timeout", "120"]) == 0
    captured = capsys.readouterr()
    assert captured.out.rstrip().splitlines()[-1] == "score: 2/2 (100%)"
    data = json.loads(out.read_text())
    assert [(t["task"], t["status"], t["points"]) for t in data["tasks"]] == [
        ("double", "correct", 1), ("01.2 twice", "correct", 1)]
    assert data["notebooks"][0]["failure"] is None


@pytest.mark.slow
@needs_kernel
def test_generated_exercise_scores_0_with_every_task_not_attempted(course):
    report = grade(course / "exercises", timeout=120)
    assert (report.score, report.total) == (0, 2)
    assert statuses(report, "01_double.ipynb") == {
        "double": ("not attempted", "not implemented yet"), "01.2 twice": ("not attempted", "not implemented yet")}
    assert report.notebooks[0].failure is None


@pytest.mark.slow
@needs_kernel
def test_cell_error_costs_only_the_tasks_that_depend_on_it(tmp_path):
    write_nb(tmp_path / "01_err.ipynb",
             CHECKER, DOUBLE, "check_double(double, task='first')",
             "ratio = 1 / 0  # raises before the second task\ncheck_double(double, task='second')",
             "import sys; sys.exit(3)  # IPython turns SystemExit into a cell error: the kernel lives on",
             "check_double(double, task='third')")  # errors are allowed: the next cells still run
    report = grade(tmp_path, timeout=120)
    got = statuses(report, "01_err.ipynb")
    assert got["first"] == ("correct", "fn(3) == 6")
    assert got["second"][0] == "not run"
    assert got["second"][1].startswith("cell error: ZeroDivisionError: division by zero")
    assert got["third"][0] == "correct"
    assert (report.score, report.total) == (2, 3)
    assert report.notebooks[0].cell_errors == ["cell 3: ZeroDivisionError: division by zero", "cell 4: SystemExit: 3"]
    assert report.notebooks[0].failure is None


def _gone(pid: int) -> bool:
    """The process no longer runs (absent, or a zombie nobody reaped yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


@pytest.mark.slow
@needs_kernel
def test_hanging_and_dying_notebooks_cost_only_their_own_tasks(tmp_path):
    write_nb(tmp_path / "01_good.ipynb", CHECKER, DOUBLE, "check_double(double)")
    write_nb(tmp_path / "02_hang.ipynb", CHECKER, DOUBLE, "check_double(double, task='before hang')",
             "import os, subprocess, time\n"
             "child = subprocess.Popen(['sleep', '1000'])  # a grandchild of the kernel: must die too\n"
             "open('pids.txt', 'w').write(f'{os.getpid()} {child.pid}')\n"
             "time.sleep(1000)",
             "check_double(double, task='after hang')")
    write_nb(tmp_path / "03_exit.ipynb", CHECKER, DOUBLE, "check_double(double, task='before exit')",
             "import os; os._exit(1)", "check_double(double, task='after exit')")
    start = time.monotonic()
    report = grade(tmp_path, timeout=20, workers=3)
    elapsed = time.monotonic() - start
    assert elapsed < 60, f"grading took {elapsed:.0f}s: the hanging notebook was not killed at its timeout"

    assert statuses(report, "01_good.ipynb") == {"double": ("correct", "fn(3) == 6")}
    assert statuses(report, "02_hang.ipynb") == {"before hang": ("correct", "fn(3) == 6"),
                                                 "after hang": ("not run", "timeout after 20s")}
    assert statuses(report, "03_exit.ipynb") == {"before exit": ("correct", "fn(3) == 6"),
                                                 "after exit": ("not run", "kernel died")}
    assert [(n.notebook, n.score, n.total, n.failure) for n in report.notebooks] == [
        ("01_good.ipynb", 1, 1, None), ("02_hang.ipynb", 1, 2, "timeout after 20s"),
        ("03_exit.ipynb", 1, 2, "kernel died")]
    assert (report.score, report.total) == (3, 5)

    kernel_pid, sleep_pid = map(int, (tmp_path / "pids.txt").read_text().split())
    deadline = time.monotonic() + 5
    while not (_gone(kernel_pid) and _gone(sleep_pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(kernel_pid), "the hanging kernel outlived the timeout"
    assert _gone(sleep_pid), "the kernel's child process outlived the timeout"


def test_skipped_tasks_are_listed_but_not_scored():
    rows = [TaskResult("03_a.ipynb", "numba", "correct", 1, "ok", "check_x"),
            TaskResult("03_a.ipynb", "hip", "skipped", 0, "skipped - needs a GPU", "check_x")]
    report = Report(rows, [grading.NotebookResult("03_a.ipynb", 1, 1, None, 1.0)], "solutions")
    assert (report.score, report.total) == (1, 1)
    assert report.format().splitlines()[-1] == "score: 1/1 (100%)  (1 task skipped: need a GPU)"
    tasks = [grading.Task("03_a.ipynb", "hip", "check_x", "hip", 0, 1, True)] if hasattr(grading, "Task") else []
    if tasks:
        results, _ = grading.merge(tasks, [{"check": "check_x", "task": "hip", "status": "skipped", "message": "m"}],
                                   "03_a.ipynb")
        assert results[0].status == "skipped" and results[0].points == 0
