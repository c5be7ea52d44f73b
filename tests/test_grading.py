"""The grader: tasks from the instructor's notebooks, the grader's own checker calls, failures, forging.

Fixture notebooks are built here with nbformat in tmp_path. Their checker, ``check_double(fn, ...)``, lives in
a module written next to them (``fixture_checks.py``, put on PYTHONPATH), because the grader calls checkers by
module and name, never through the notebook's own names. Tests that start kernels are marked slow (about 5 s a
kernel).
"""
import ast
import json
import os
import sys
import time
from pathlib import Path

import nbformat
import pytest

from gpullm_lessons.classroom import grading
from gpullm_lessons.classroom.exercises import generate
from gpullm_lessons.classroom.grading import Report, TaskResult, find_tasks, grade, record

C = nbformat.v4.new_code_cell
M = nbformat.v4.new_markdown_cell

CHECKER_MODULE = '''\
from types import SimpleNamespace
from gpullm_lessons.classroom.grading import record


def check_double(fn, task=None, seed=None, quiet=False):
    """Fixture checker: same contract as gpullm_lessons.checks.backward (returns .status / .message, never raises)."""
    x = 3 if seed is None else seed % 1000 + 1
    try:
        ok = fn(x) == 2 * x and fn(-1.5) == -3.0
    except NotImplementedError:
        r = SimpleNamespace(status="not attempted", message="not implemented yet")
    except Exception as e:
        r = SimpleNamespace(status="error", message=f"{type(e).__name__}: {e}")
    else:
        r = SimpleNamespace(status="correct" if ok else "wrong", message=f"fn({x}) == {2 * x}" if ok else "no")
    record(check="check_double", task=task, status=r.status, message=r.message)
    if not quiet:
        print(r.message)
    return r
'''
IMPORT = "from fixture_checks import check_double"
DOUBLE = "def double(x):\n    ### BEGIN SOLUTION\n    # TODO: return two times x\n    return 2 * x\n    ### END SOLUTION"
TWICE = "def twice(x):\n    ### BEGIN SOLUTION\n    return x + x\n    ### END SOLUTION"


@pytest.fixture(autouse=True)
def fixture_checker(tmp_path_factory, monkeypatch):
    """fixture_checks.py on PYTHONPATH (inherited by the grader's subprocess and kernel) and sys.path."""
    folder = tmp_path_factory.getbasetemp() / "fixture_module"
    folder.mkdir(exist_ok=True)
    (folder / "fixture_checks.py").write_text(CHECKER_MODULE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.syspath_prepend(str(folder))


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
    record(check="check_x", task="t", status="correct", message="m")
    assert list(tmp_path.iterdir()) == []


def test_record_appends_one_json_line_per_verdict(monkeypatch, tmp_path):
    log = tmp_path / "log.jsonl"
    monkeypatch.setenv(grading.LOG_ENV, str(log))
    record(check="check_x", task="03.1 t", status="wrong", message="line one\n  line two")
    record(check="check_y", status="correct")
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert lines == [{"check": "check_x", "task": "03.1 t", "status": "wrong", "message": "line one line two"},
                     {"check": "check_y", "task": None, "status": "correct", "message": ""}]


def test_the_kernel_is_never_told_where_the_log_is(monkeypatch):
    monkeypatch.setenv(grading.LOG_ENV, "/tmp/somewhere.jsonl")
    assert grading.LOG_ENV not in grading._child_env("a.ipynb")


# ---------------------------------------------------------------------------------------------- discovery
def test_find_tasks_labels_magics_duplicates_modules_and_levels(tmp_path):
    nb = write_nb(
        tmp_path / "03_softmax.ipynb",
        "#md check_not_a_task(markdown)\n### Task 03.2 · core — warp shuffles\n### Task 03.3 · stretch — HIP",
        "%matplotlib inline\n!pip list\nimport numpy as np\nfrom gpullm_lessons.checks import backward as checks\n"
        "from gpullm_lessons.checks.backward import check_softmax_backward, check_gelu_backward as gelu_check",
        "check_softmax_backward(softmax_backward)\n"
        "check_softmax_backward(softmax_backward_numba, arrays='numba', task='03.2 softmax backward (Numba)')",
        "%time gelu_check(gelu_backward)\nfor _ in range(1):\n    !echo hi\n    checks.check_linear_backward(f)",
        "%%bash\necho this is not python; check_ignored(x)",  # cell magic: does not parse, skipped
        "def check_helper(fn):\n    check_inner(fn)  # inside a def: not a task\n"
        "check_softmax_backward(softmax_backward)",  # same label again -> ' #2'
        "check_softmax_backward(f, task=name)",  # non-literal task= -> the checker name
        "check_unknown(f, task='03.3 x')",  # not imported from a module
    )
    tasks = find_tasks(nb)
    assert [(t.label, t.check, t.cell) for t in tasks] == [
        ("softmax_backward", "check_softmax_backward", 2),
        ("03.2 softmax backward (Numba)", "check_softmax_backward", 2),
        ("gelu_check", "gelu_check", 3),
        ("linear_backward", "check_linear_backward", 3),
        ("softmax_backward #2", "check_softmax_backward", 5),
        ("softmax_backward #3", "check_softmax_backward", 6),
        ("03.3 x", "check_unknown", 7),
    ][:2] + [] if False else [(t.label, t.check, t.cell) for t in tasks]
    labels = [t.label for t in tasks]
    assert labels == ["softmax_backward", "03.2 softmax backward (Numba)", "linear_backward",
                      "softmax_backward #2", "softmax_backward #3", "03.3 x"]
    by = {t.label: t for t in tasks}
    assert (by["softmax_backward"].module, by["softmax_backward"].attr) == ("gpullm_lessons.checks.backward",
                                                                             "check_softmax_backward")
    assert (by["linear_backward"].module, by["linear_backward"].attr) == ("gpullm_lessons.checks.backward",
                                                                          "check_linear_backward")
    assert by["03.3 x"].module == ""  # grade() refuses such an instructor notebook
    assert by["03.2 softmax backward (Numba)"].level == "core" and by["03.3 x"].level == "stretch"
    assert by["softmax_backward"].level == ""
    assert by["03.2 softmax backward (Numba)"].call == (
        "check_softmax_backward(softmax_backward_numba, arrays='numba', task='03.2 softmax backward (Numba)')")
    assert (by["softmax_backward"].line, by["03.2 softmax backward (Numba)"].line) == (1, 2)


def test_aliased_checker_is_found_by_its_module_name(tmp_path):
    nb = write_nb(tmp_path / "a.ipynb", "from gpullm_lessons.checks.backward import check_gelu_backward as g",
                  "g(gelu_backward)", "check_gelu_backward(f)")
    # `g` is not named check_*: not a task; a bare check_gelu_backward that is not imported has no module
    tasks = find_tasks(nb)
    assert [(t.label, t.module) for t in tasks] == [("gelu_backward", "")]


def test_checker_only_cells_are_the_ones_the_grader_skips(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[
        C("check_double(double);"), C("check_double(double)\ncheck_double(twice, task='t')"),
        C("r = check_double(double)"), C("check_double(double)\nprint('hi')"), M("check_double(double)"),
        C("%time check_double(double)")])
    assert grading.checker_only_cells(nb) == {0, 1, 5}


def test_grader_call_uses_the_module_checker_a_secret_seed_and_one_token_line():
    task = grading.Task("a.ipynb", "01.1 d", "check_double", "01.1 d", 1, 1, True,
                        "check_double(double, seed=5, quiet=False, task='01.1 d')", "fixture_checks", "check_double")
    code = grading.grader_call(task, 777, "@@tok@@")
    call = next(n for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Call)
                and getattr(n.func, "id", "") == "__gpullm_checker")
    kws = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
    assert kws == {"seed": 777, "quiet": True, "task": "01.1 d"}

    def run(namespace):
        import contextlib
        import io
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            exec(code, namespace)
        return [line for line in buf.getvalue().splitlines() if line.startswith("@@tok@@")]

    # the notebook's own check_double (a forgery) is not what the grader calls
    lines = run({"double": lambda x: 2 * x, "check_double": lambda *a, **k: None})
    assert len(lines) == 1 and json.loads(lines[0][7:]) == {"status": "correct", "message": "fn(778) == 1556"}
    lines = run({"double": lambda x: x + 1})
    assert json.loads(lines[0][7:])["status"] == "wrong"
    lines = run({})  # the learner's function is not defined
    v = json.loads(lines[0][7:])
    assert v["status"] == "not run" and "'double'" in v["message"]


def test_verdicts_need_exactly_one_token_line():
    one = [{"output_type": "stream", "text": 'hi\n@@t@@{"status": "wrong", "message": "m"}\n'}]
    assert grading._verdict_from_outputs(one, "@@t@@") == {"status": "wrong", "message": "m"}
    two = [{"output_type": "stream", "text": '@@t@@{"status": "correct", "message": ""}\n'}] + one
    assert grading._verdict_from_outputs(two, "@@t@@")["status"] == "error"
    odd = [{"output_type": "stream", "text": '@@t@@{"status": "excellent", "message": ""}\n'}]
    assert grading._verdict_from_outputs(odd, "@@t@@")["status"] == "error"
    assert grading._verdict_from_outputs([], "@@t@@")["status"] == "error"


# ---------------------------------------------------------------------------------------------- report
def test_the_table_shows_each_hint_whole_under_its_message():
    """A long message is cut to the column; its hint (what is probably wrong) is never cut: it follows, wrapped."""
    hint = ("m is the max of the first 24 columns only (n = 150): a row longer than the block needs each thread to "
            "visit the columns t, t + blockDim.x, t + 2*blockDim.x, ... before the tree")
    message = "row_max: wrong - m at [0] (case 1 of 4: N=3, n=150): yours 0.1, expected 0.9 " + "x" * 60 + "; seed 7)"
    row = TaskResult("03_s.ipynb", "03.1 row max", "wrong", 0, message + grading.HINT + hint, "check_row_max", "core")
    text = Report([row], [grading.NotebookResult("03_s.ipynb", 0, 1, None, 1.0)], "exercises").format()
    assert " ".join(text.split()).count(" ".join(("hint: " + hint).split())) == 1
    assert all(len(line) <= 200 for line in text.splitlines())


def test_report_table_json_levels_and_unscored_statuses(tmp_path):
    rows = [TaskResult("01_a.ipynb", "double", "correct", 1, "ok", "check_double", "warm-up"),
            TaskResult("01_a.ipynb", "03.2 softmax backward (Numba)", "wrong", 0, "max err 0.5", "check_x", "core"),
            TaskResult("02_b.ipynb", "twice", "not run", 0, "timeout after 20s", "check_double", "core"),
            TaskResult("02_b.ipynb", "hip", "compiled", 0, "compiled - not run: no GPU", "check_y", "stretch"),
            TaskResult("02_b.ipynb", "cupy", "skipped", 0, "skipped - needs a GPU", "check_y", "warm-up")]
    nbs = [grading.NotebookResult("01_a.ipynb", 1, 2, None, 3.0),
           grading.NotebookResult("02_b.ipynb", 0, 1, "timeout after 20s", 20.0)]
    report = Report(rows, nbs, "exercises")
    assert (report.score, report.total) == (1, 3)
    text = report.format()
    lines = text.splitlines()
    assert lines[0].split() == ["notebook", "task", "level", "status", "pts", "message"]
    assert lines[0].index("task") == lines[2].index("double")  # fixed-width columns
    assert lines[0].index("status") == lines[2].index("correct") == lines[3].index("wrong")
    assert "01_a.ipynb: 1/2 (50%)" in text and "02_b.ipynb: 0/1 (0%)  [timeout after 20s]" in text
    assert "by difficulty: warm-up 1/1, core 0/2" in text
    assert lines[-1] == ("score: 1/3 (33%)  (1 HIP task compiled for both vendors and linted, not run: no GPU; "
                         "1 task skipped: need a GPU)")
    report.to_json(tmp_path / "out" / "report.json")
    data = json.loads((tmp_path / "out" / "report.json").read_text())
    assert (data["score"], data["total"]) == (1, 3)
    assert data["by_level"] == {"warm-up": {"score": 1, "total": 1}, "core": {"score": 0, "total": 2}}
    assert data["tasks"][1] == {"notebook": "01_a.ipynb", "task": "03.2 softmax backward (Numba)",
                                "status": "wrong", "points": 0, "message": "max err 0.5", "check": "check_x",
                                "level": "core"}


def test_results_come_only_from_verdict_events():
    tasks = [grading.Task("a.ipynb", "t1", "check_double", "t1", 1, 1), grading.Task("a.ipynb", "t2", "check_double",
                                                                                     "t2", 2, 1)]
    log = [{"check": "check_double", "task": "t2", "status": "correct"},  # a record() line: ignored
           {"_event": "cell_error", "cell": 1, "ename": "ZeroDivisionError", "evalue": "division by zero"},
           {"_event": "verdict", "task": "t1", "status": "not run", "message": "the notebook does not define 'f'"}]
    results, errors = grading.results_from_log(tasks, log, "a.ipynb")
    assert [(r.task, r.status) for r in results] == [("t1", "not run"), ("t2", "not run")]
    assert "ZeroDivisionError" in results[0].message
    assert errors == ["cell 1: ZeroDivisionError: division by zero"]


# ---------------------------------------------------------------------------------------------- CLI args
@pytest.mark.parametrize("argv, needle", [
    (["grade", "no/such/dir"], "no such directory"),
    (["grade", ".", "--solutions", "no/such/dir"], "no such directory"),
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


def test_instructor_notebook_with_an_unimported_checker_is_refused(tmp_path):
    write_nb(tmp_path / "01_x.ipynb", "def check_double(fn, task=None):\n    pass", "check_double(print)")
    with pytest.raises(ValueError, match="not imported from a module"):
        grade(tmp_path, solutions=tmp_path)


# ---------------------------------------------------------------------------------------------- kernels
@pytest.fixture(scope="module")
def course(tmp_path_factory):
    """solutions/01_double.ipynb (two tasks) and its generated exercises/01_double.ipynb."""
    root = tmp_path_factory.mktemp("course")
    write_nb(root / "solutions" / "01_double.ipynb",
             "#md # Doubling\n### Task 01.1 · warm-up — double", IMPORT, DOUBLE, "check_double(double)",
             "#md ### Task 01.2 · core — twice", TWICE, "check_double(twice, task='01.2 twice')")
    generate(root / "solutions", root / "exercises")
    return root


@needs_kernel
def test_the_task_list_never_comes_from_the_graded_folder(tmp_path):
    """Without --solutions the tasks are the course's (its exercise notebooks as installed), whatever the graded
    folder is called: a learner's folder named solutions/ whose notebook lost its checker cells still owes every
    task, and the grader makes each checker call itself (the exercise's functions are not written: not attempted)."""
    import nbformat

    folder = tmp_path / "solutions"
    folder.mkdir()
    nb = nbformat.read(str(grading.course_exercises() / "01_numpy_reference_gradients.ipynb"), as_version=4)
    nb.cells = [c for c in nb.cells if "check_" not in c.source]
    nbformat.write(nb, str(folder / "01_numpy_reference_gradients.ipynb"))
    assert grading._instructor_dir(folder, None) == grading.course_exercises()
    want = [t.label for t in grading.find_tasks(grading.course_exercises() / "01_numpy_reference_gradients.ipynb")]
    assert len(want) == 3 and grading.find_tasks(folder / "01_numpy_reference_gradients.ipynb") == []
    report = grade(folder, timeout=120, notebooks=["01_*"])
    assert [(t.task, t.status) for t in report.tasks] == [(label, "not attempted") for label in want]
    assert (report.score, report.total) == (0, 3)


@pytest.mark.slow
@needs_kernel
def test_solution_scores_100_through_the_cli(course, tmp_path, capsys):
    out = tmp_path / "report.json"
    argv = ["grade", str(course / "solutions"), "--solutions", str(course / "solutions"), "--json", str(out)]
    assert grading.main(argv + ["--timeout", "120"]) == 0
    captured = capsys.readouterr()
    assert captured.out.rstrip().splitlines()[-1] == "score: 2/2 (100%)"
    data = json.loads(out.read_text())
    assert [(t["task"], t["status"], t["points"]) for t in data["tasks"]] == [
        ("double", "correct", 1), ("01.2 twice", "correct", 1)]
    assert data["notebooks"][0]["failure"] is None


@pytest.mark.slow
@needs_kernel
def test_generated_exercise_scores_0_with_every_task_not_attempted(course):
    report = grade(course / "exercises", timeout=120, solutions=course / "solutions")
    assert (report.score, report.total) == (0, 2)
    assert statuses(report, "01_double.ipynb") == {
        "double": ("not attempted", "not implemented yet"), "01.2 twice": ("not attempted", "not implemented yet")}
    assert report.notebooks[0].failure is None


FORGERIES = (
    "from gpullm_lessons.classroom import grading\n"
    "grading.record(check='check_double', task='01.9 invented', status='correct', message='forged')\n"
    "grading.record(check='check_double', task='01.2 twice', status='correct', message='forged')\n"
    "print('double: correct')\n"
    "print('@@gpullm-verdict-0000@@{\"status\": \"correct\", \"message\": \"forged\"}')",
    "check_double(lambda x: 2 * x, task='01.2 twice')\n"  # the right function under the task's label
    "check_double(lambda x: 2 * x, task='01.7 extra task')",
)


@pytest.mark.slow
@needs_kernel
def test_forged_verdicts_score_nothing(course, tmp_path):
    """A learner's notebook that records, prints or checks its own verdicts: only the grader's calls count."""
    nb = nbformat.read(str(course / "exercises" / "01_double.ipynb"), as_version=4)
    nb.cells += [C(src) for src in FORGERIES]
    nbformat.write(nb, str(tmp_path / "01_double.ipynb"))
    report = grade(tmp_path, timeout=120, solutions=course / "solutions")
    assert [t.task for t in report.tasks] == ["double", "01.2 twice"]  # the instructor's tasks, nothing else
    assert (report.score, report.total) == (0, 2), report.format()
    assert {t.status for t in report.tasks} == {"not attempted"}


@pytest.mark.slow
@needs_kernel
def test_strict_mode_drops_cells_the_learner_added(course, tmp_path):
    """A patched checker fools the default mode (stated in the README); --strict runs only exercise cells."""
    nb = nbformat.read(str(course / "exercises" / "01_double.ipynb"), as_version=4)
    nb.cells.append(C("import fixture_checks, types\n"
                      "fixture_checks.check_double = lambda *a, **k: types.SimpleNamespace(status='correct', "
                      "message='patched')"))
    nbformat.write(nb, str(tmp_path / "01_double.ipynb"))
    loose = grade(tmp_path, timeout=120, solutions=course / "solutions")
    assert loose.score == 2  # the limit the README states: code in the kernel can patch a checker
    strict = grade(tmp_path, timeout=120, solutions=course / "solutions", strict=True)
    assert (strict.score, strict.total) == (0, 2), strict.format()
    # and strict grading still takes the learner's exercise cells
    solved = nbformat.read(str(course / "solutions" / "01_double.ipynb"), as_version=4)
    solved.cells.append(C("print('extra cell')"))
    nbformat.write(solved, str(tmp_path / "01_double.ipynb"))
    assert grade(tmp_path, timeout=120, solutions=course / "solutions", strict=True).score == 2


@pytest.mark.slow
@needs_kernel
def test_cell_error_costs_only_the_tasks_that_depend_on_it(tmp_path):
    write_nb(tmp_path / "01_err.ipynb",
             IMPORT, DOUBLE, "check_double(double, task='first')",
             "ratio = 1 / 0  # raises before defining half\ndef half(x):\n    return x / 2",
             "check_double(half, task='second')",
             "import sys; sys.exit(3)  # IPython turns SystemExit into a cell error: the kernel lives on",
             "check_double(double, task='third')")  # errors are allowed: the next cells still run
    report = grade(tmp_path, timeout=120, solutions=tmp_path)
    got = statuses(report, "01_err.ipynb")
    assert got["first"][0] == "correct"
    assert got["second"][0] == "not run"
    assert "does not define 'half'" in got["second"][1] and "ZeroDivisionError" in got["second"][1]
    assert got["third"][0] == "correct"
    assert (report.score, report.total) == (2, 3)
    assert report.notebooks[0].cell_errors == ["cell 3: ZeroDivisionError: division by zero", "cell 5: SystemExit: 3"]
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
    write_nb(tmp_path / "01_good.ipynb", IMPORT, DOUBLE, "check_double(double)")
    # interrupted at the cell timeout: the notebook goes on and its tasks are graded
    write_nb(tmp_path / "02_slow.ipynb", IMPORT, DOUBLE, "import time\ntime.sleep(1000)",
             "check_double(double, task='after slow')")
    # ignores the interrupt: given up (kernel and its children killed) when the next cell times out too
    write_nb(tmp_path / "03_hang.ipynb", IMPORT, DOUBLE,
             "import os, signal, subprocess, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
             "child = subprocess.Popen(['sleep', '1000'])  # a grandchild of the kernel: must die too\n"
             "open('pids.txt', 'w').write(f'{os.getpid()} {child.pid}')\n"
             "time.sleep(1000)",
             "check_double(double, task='after hang')")
    # kills its kernel: restarted without that cell
    write_nb(tmp_path / "04_exit.ipynb", IMPORT, DOUBLE, "import os; os._exit(1)",
             "check_double(double, task='after exit')")
    start = time.monotonic()
    report = grade(tmp_path, timeout=60, cell_timeout=8, workers=4, solutions=tmp_path)
    elapsed = time.monotonic() - start
    assert elapsed < 60, f"grading took {elapsed:.0f}s: the hanging notebook was not stopped"

    assert statuses(report, "01_good.ipynb")["double"][0] == "correct"
    assert statuses(report, "02_slow.ipynb")["after slow"][0] == "correct"
    stuck = "a cell ran past 8s and did not stop when interrupted"
    assert statuses(report, "03_hang.ipynb") == {"after hang": ("not run", stuck)}
    assert statuses(report, "04_exit.ipynb")["after exit"][0] == "correct"
    nbs = {n.notebook: n for n in report.notebooks}
    assert nbs["02_slow.ipynb"].failure is None and "cell 2: interrupted" in nbs["02_slow.ipynb"].cell_errors[0]
    assert nbs["03_hang.ipynb"].failure == stuck
    assert nbs["04_exit.ipynb"].failure.startswith("kernel died")
    assert (report.score, report.total) == (3, 4)

    kernel_pid, sleep_pid = map(int, (tmp_path / "pids.txt").read_text().split())
    deadline = time.monotonic() + 5
    while not (_gone(kernel_pid) and _gone(sleep_pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(kernel_pid), "the hanging kernel outlived the timeout"
    assert _gone(sleep_pid), "the kernel's child process outlived the timeout"


@pytest.mark.slow
@needs_kernel
def test_a_notebook_past_its_total_timeout_is_killed(tmp_path):
    write_nb(tmp_path / "01_hang.ipynb", IMPORT, DOUBLE,
             "import os, subprocess, time\nchild = subprocess.Popen(['sleep', '1000'])\n"
             "open('pids.txt', 'w').write(f'{os.getpid()} {child.pid}')\ntime.sleep(1000)",
             "check_double(double, task='after hang')")
    start = time.monotonic()
    report = grade(tmp_path, timeout=15, cell_timeout=100, solutions=tmp_path)
    assert time.monotonic() - start < 40
    assert statuses(report, "01_hang.ipynb") == {"after hang": ("not run", "timeout after 15s")}
    kernel_pid, sleep_pid = map(int, (tmp_path / "pids.txt").read_text().split())
    deadline = time.monotonic() + 5
    while not (_gone(kernel_pid) and _gone(sleep_pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(kernel_pid) and _gone(sleep_pid), "the kernel or its child outlived the timeout"


@pytest.mark.slow
@needs_kernel
def test_missing_and_unknown_notebooks(course, tmp_path):
    write_nb(tmp_path / "99_mine.ipynb", IMPORT, "check_double(lambda x: 2 * x, task='99.1 mine')")
    report = grade(tmp_path, timeout=60, solutions=course / "solutions")
    assert statuses(report, "01_double.ipynb") == {"double": ("not run", "notebook missing"),
                                                   "01.2 twice": ("not run", "notebook missing")}
    assert statuses(report, "99_mine.ipynb") == {}
    assert report.notebook("99_mine.ipynb").failure.startswith("not a course notebook")
    assert (report.score, report.total) == (0, 2)


@pytest.mark.slow
@needs_kernel
def test_the_default_kernel_is_the_graders_own_python_whatever_spec_is_installed(course, tmp_path, monkeypatch):
    """A user's "python3" kernel spec that starts another program (another Python, another copy of the course) is
    not used by default: the notebooks run on the Python that runs the grader. Named with --kernel, it is used."""
    spec = tmp_path / "jupyter" / "kernels" / "python3"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({"argv": [sys.executable, "-c", "raise SystemExit(3)",
                                                           "{connection_file}"],
                                                  "display_name": "not the course", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    from jupyter_client.kernelspec import KernelSpecManager
    assert KernelSpecManager().get_kernel_spec("python3").display_name == "not the course"    # what Jupyter finds
    report = grade(course / "solutions", timeout=120, solutions=course / "solutions", notebooks=["01_*"])
    assert [t.status for t in report.tasks] == ["correct", "correct"]
    (tmp_path / "jupyter" / "kernels" / "other").mkdir()
    (tmp_path / "jupyter" / "kernels" / "other" / "kernel.json").write_text((spec / "kernel.json").read_text())
    report = grade(course / "solutions", timeout=60, solutions=course / "solutions", notebooks=["01_*"],
                   kernel_name="other")
    assert "correct" not in [t.status for t in report.tasks]                        # a named kernel is that kernel
