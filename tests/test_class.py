"""Running the course for a class: `start` (a learner's own copy of the exercises, never over their work) and
`grade --class` (every learner's folder graded by the grader into one gradebook, with a summary per task).

The class is synthetic, built with `start` from the course's exercises/ in tmp_path, and graded on lesson 01 only
(`--notebooks 01_*`: three NumPy tasks, about 3 s a notebook), one learner per case: the solutions, fresh
exercises, a notebook that is not JSON, a cell that hangs (killed at the timeout), forged verdicts, wrong answers,
an empty folder and a missing notebook.
"""

import contextlib
import csv
import io
import json
import shutil
import stat
import time
from pathlib import Path

import nbformat
import pytest
from test_grading import needs_kernel

from gpullm_lessons.classroom import gradebook as classroom, grading
from gpullm_lessons.__main__ import main

ROOT = Path(__file__).resolve().parents[1]
NB01 = "01_numpy_reference_gradients.ipynb"
TASKS01 = ["01.1 GELU backward (NumPy)", "01.2 LayerNorm backward (NumPy)", "01.3 causal attention backward (NumPy)"]
TIMEOUT = 30  # seconds per notebook: a lesson 01 notebook needs about 3 (5 with two side by side)


def run_cli(*argv):
    """(exit status, stdout, stderr) of `python -m gpullm_lessons ARGV`, run in this process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


def edited(nb, edits):
    """nb with each (cell id, old text, new text) applied; each old text must be found once in its cell."""
    for cid, old, new in edits:
        (cell,) = [c for c in nb.cells if c.get("id") == cid]
        assert cell.source.count(old) == 1, f"{old!r} not found once in cell {cid}"
        cell.source = cell.source.replace(old, new)
    return nb


# ---------------------------------------------------------------------------------------------- start
@pytest.fixture
def source(tmp_path):
    """A small exercise folder: two of the course's exercise notebooks."""
    folder = tmp_path / "course_exercises"
    folder.mkdir()
    for name in (NB01, "12_memory.ipynb"):
        shutil.copyfile(ROOT / "exercises" / name, folder / name)
    return folder


def test_start_copies_refuses_a_second_time_and_update_adds_only_new_exercises(source, tmp_path):
    me = tmp_path / "me"
    rc, out, _ = run_cli("start", str(me), "--exercises", str(source))
    assert rc == 0
    assert sorted(p.name for p in me.iterdir()) == [NB01, "12_memory.ipynb"]
    assert all((me / p.name).read_bytes() == p.read_bytes() for p in source.iterdir())
    assert "copied 2 exercise notebook(s)" in out and f"-m jupyter lab {me}" in out

    # the learner works on lesson 01
    nb = nbformat.read(str(me / NB01), as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell("print('my own notes')"))
    nbformat.write(nb, str(me / NB01))
    mine = (me / NB01).read_bytes()

    # a second start is refused and touches nothing
    rc, _, err = run_cli("start", str(me), "--exercises", str(source))
    assert rc == 2 and "already has 2 of the exercise notebooks" in err and "--update" in err
    assert (me / NB01).read_bytes() == mine

    # a new exercise appears in the course, and lesson 01's exercise changes there: --update adds only the new one
    shutil.copyfile(ROOT / "exercises" / "08_activation_checkpointing.ipynb", source / "08_new.ipynb")
    (source / NB01).write_text((source / NB01).read_text() + "\n")
    rc, out, _ = run_cli("start", str(me), "--update", "--exercises", str(source))
    assert rc == 0
    assert "copied 1 exercise notebook(s)" in out and "  08_new.ipynb\n" in out
    assert "kept 2 notebook(s)" in out and f"  {NB01}\n" in out and "  12_memory.ipynb\n" in out
    assert (me / NB01).read_bytes() == mine  # the learner's work, byte for byte
    assert (me / "08_new.ipynb").read_bytes() == (source / "08_new.ipynb").read_bytes()

    # and once more: nothing to add
    result = classroom.start(me, update=True, source=source)
    assert result.added == [] and result.kept == [NB01, "08_new.ipynb", "12_memory.ipynb"]


def test_start_refuses_a_folder_holding_some_of_the_exercises(source, tmp_path):
    me = tmp_path / "me"
    me.mkdir()
    (me / "12_memory.ipynb").write_text("my half-done work")
    rc, _, err = run_cli("start", str(me), "--exercises", str(source))
    assert rc == 2 and "already has 1 of the exercise notebooks (12_memory.ipynb)" in err
    assert sorted(p.name for p in me.iterdir()) == ["12_memory.ipynb"]  # nothing copied beside it
    result = classroom.start(me, update=True, source=source)
    assert (result.added, result.kept) == ([NB01], ["12_memory.ipynb"])
    assert (me / "12_memory.ipynb").read_text() == "my half-done work"


def test_start_from_a_read_only_course_gives_writable_copies(source, tmp_path):
    """A lab installs the course once, read-only; each learner's copies are theirs to edit."""
    for p in source.iterdir():
        p.chmod(0o444)
    source.chmod(0o555)
    try:
        result = classroom.start(tmp_path / "me", source=source)
        assert result.added == [NB01, "12_memory.ipynb"]
        for name in result.added:
            copy = tmp_path / "me" / name
            assert copy.stat().st_mode & stat.S_IWUSR, f"{name} was copied without the owner's write permission"
            assert copy.read_bytes() == (source / name).read_bytes()
            with open(copy, "a") as f:  # and the learner can save it
                f.write("\n")
        assert sorted(p.name for p in source.iterdir()) == [NB01, "12_memory.ipynb"]  # nothing written there
    finally:
        source.chmod(0o755)
        for p in source.iterdir():
            p.chmod(0o644)


def test_start_names_what_is_wrong(source, tmp_path, monkeypatch):
    (tmp_path / "a_file").write_text("x")
    cases = [
        (["start", str(tmp_path / "a_file"), "--exercises", str(source)], "exists and is not a folder"),
        (["start", str(tmp_path / "me"), "--exercises", str(tmp_path / "nowhere")], "no such directory"),
        (["start", str(tmp_path / "me"), "--exercises", str(tmp_path)], "no exercise notebooks (*.ipynb)"),
        (["start"], "the following arguments are required: DIR"),
    ]
    for argv, needle in cases:
        rc, _, err = run_cli(*argv)
        assert rc == 2 and needle in err, (argv, err)
    # the course's exercises are found beside the package; an install without them is named, with the fix
    assert classroom.course_exercises() == ROOT / "exercises"
    monkeypatch.setattr(grading, "REPO_ROOT", tmp_path / "site-packages")  # neither a checkout nor the packaged copy
    rc, _, err = run_cli("start", str(tmp_path / "me"))
    assert rc == 2 and str(tmp_path / "site-packages" / "exercises") in err and "--exercises DIR" in err
    assert grading.PACKAGED_EXERCISES in err
    assert not (tmp_path / "me").exists()


# ---------------------------------------------------------------------------------------------- grade --class usage
def test_grade_class_names_bad_usage_and_writes_nothing(tmp_path):
    empty = tmp_path / "empty"
    (empty / ".ipynb_checkpoints").mkdir(parents=True)
    (empty / "gradebook").mkdir()
    (empty / "roster.txt").write_text("ada\n")
    one = tmp_path / "one"
    (one / "ada").mkdir(parents=True)
    cases = [
        (["--class", str(tmp_path / "nowhere")], "no such directory"),
        (["--class", str(empty)], "no learner folders"),
        (["--class", str(one), "--notebooks", "99_*"], "matches none of the notebooks"),
        (["--class", str(one), "--solutions", str(tmp_path / "nowhere")], "no such directory"),
        (["--class", str(one), "--workers", "0"], "--workers must be at least 1"),
        (["--class", str(one), "--timeout", "-1"], "--timeout must be a positive"),
        (["--class"], "expected one argument"),
    ]
    for argv, needle in cases:
        rc, out, err = run_cli("grade", *argv)
        assert rc == 2 and needle in err, (argv, err)
    assert sorted(p.name for p in empty.iterdir()) == [".ipynb_checkpoints", "gradebook", "roster.txt"]
    assert list((empty / "gradebook").iterdir()) == []


def test_the_one_learner_grader_takes_notebook_patterns_too():
    rc, _, err = run_cli("grade", str(ROOT / "exercises"), "--notebooks", "zz_*")
    assert rc == 2 and "--notebooks zz_* matches no notebook" in err


# ---------------------------------------------------------------------------------------------- the class
HANG = (
    "import os, signal, time\n"
    "signal.signal(signal.SIGINT, signal.SIG_IGN)  # ignores the grader's interrupt\n"
    "open('kernel.pid', 'w').write(str(os.getpid()))\n"
    "time.sleep(1000)"
)
FORGERIES = (
    "def check_gelu_backward(*args, **kwargs):\n"
    "    print('gelu_backward: correct')\n"
    "    return True\n"
    "check_gelu_backward(gelu_backward, task='01.1 GELU backward (NumPy)')",
    "from gpullm_lessons.classroom import grading\n"
    "grading.record(check='check_gelu_backward', task='01.1 GELU backward (NumPy)', status='correct', message='x')",
    'print(\'@@gpullm-verdict-0000@@{"status": "correct", "message": "forged"}\')',
    "check_layernorm_backward(lambda *a: None, task='01.9 a task of my own')",
)
FORGETS_DOUT = ("bad7a350", "dinp[...] = dout * slope", "dinp[...] = slope")
DROPS_A_TERM = ("bad7a350", "slope = 0.5 * (1.0 + th) + 0.5 * inp", "slope = 0.5 * (1.0 + th) + 0 * inp")
RAISES = ("37bb9ba4", "    r = rstd[:, None] ", "    raise ValueError('shapes do not match')\n    r = rstd[:, None] ")
CELL_FAILS = ("de967a98", "def attention_backward(", "1 / 0\ndef attention_backward(")


@pytest.fixture(scope="module")
def graded_class(tmp_path_factory):
    """The class folder, built with `start`, graded once through the CLI: (root, rc, stdout, gradebook folder)."""
    root = tmp_path_factory.mktemp("class")
    solution = nbformat.read(str(ROOT / "solutions" / NB01), as_version=4)
    for learner in ("ada", "ben", "cy", "dee", "eve", "fay", "gil", "hal", "ivy"):
        assert run_cli("start", str(root / learner))[0] == 0

    def write(learner, nb):
        nbformat.write(nb, str(root / learner / NB01))

    write("ada", solution)  # the solutions' code
    # ben: the fresh exercises, untouched
    (root / "cy" / NB01).write_text('{"cells": [')  # not JSON
    hang = nbformat.read(str(root / "dee" / NB01), as_version=4)
    hang.cells.insert(2, nbformat.v4.new_code_cell(HANG))
    write("dee", hang)
    forged = nbformat.read(str(root / "eve" / NB01), as_version=4)
    forged.cells += [nbformat.v4.new_code_cell(src) for src in FORGERIES]
    write("eve", forged)
    write(
        "fay", edited(nbformat.read(str(ROOT / "solutions" / NB01), as_version=4), [FORGETS_DOUT, RAISES, CELL_FAILS])
    )
    write("gil", edited(nbformat.read(str(ROOT / "solutions" / NB01), as_version=4), [FORGETS_DOUT]))
    write("hal", edited(nbformat.read(str(ROOT / "solutions" / NB01), as_version=4), [DROPS_A_TERM]))
    (root / "ivy" / NB01).unlink()  # ivy has the other lessons, not this one
    (root / "joe").mkdir()  # joe never ran start
    (root / ".ipynb_checkpoints").mkdir()  # not a learner

    book = root.parent / f"{root.name}-book"
    start = time.monotonic()
    rc, out, err = run_cli(
        "grade", "--class", str(root), "--notebooks", "01_*", "--workers", "2", "--timeout", str(TIMEOUT),
        "--out", str(book),
    )  # fmt: skip
    seconds = time.monotonic() - start
    assert rc == 0, err
    assert seconds < TIMEOUT + 60, f"the class took {seconds:.0f}s: the hanging notebook was not stopped in time"
    return root, out, book


def rows_of(book):
    with open(book / "gradebook.csv", newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def by_learner(book):
    out = {}
    for r in rows_of(book):
        out.setdefault(r["learner"], {})[r["task"]] = r
    return out


@pytest.mark.slow
@needs_kernel
def test_every_learner_gets_a_row_per_task(graded_class):
    root, _, book = graded_class
    rows = rows_of(book)
    learners = ["ada", "ben", "cy", "dee", "eve", "fay", "gil", "hal", "ivy", "joe"]
    assert [(r["learner"], r["task"]) for r in rows] == [(name, task) for name in learners for task in TASKS01]
    assert {r["notebook"] for r in rows} == {NB01}  # --notebooks 01_*: no other lesson graded
    assert {r["level"] for r in rows} == {"warm-up", "core", "stretch"}


@pytest.mark.slow
@needs_kernel
def test_statuses_per_learner(graded_class):
    _, _, book = graded_class
    got = {name: [(r["status"], int(r["points"])) for r in tasks.values()] for name, tasks in by_learner(book).items()}
    assert got["ada"] == [("correct", 1)] * 3
    assert got["ben"] == [("not attempted", 0)] * 3
    assert got["cy"] == [("unreadable", 0)] * 3
    assert got["dee"] == [("timed out", 0)] * 3
    assert got["eve"] == [("not attempted", 0)] * 3  # forged verdicts and a checker of its own: no credit
    assert got["fay"] == [("wrong", 0), ("error", 0), ("not run", 0)]
    assert got["gil"] == [("wrong", 0), ("correct", 1), ("correct", 1)]
    assert got["hal"] == [("wrong", 0), ("correct", 1), ("correct", 1)]
    assert got["ivy"] == [("missing", 0)] * 3
    assert got["joe"] == [("no notebooks", 0)] * 3


@pytest.mark.slow
@needs_kernel
def test_messages_and_hints_say_why(graded_class):
    root, _, book = graded_class
    rows = by_learner(book)
    assert "JSON" in rows["cy"][TASKS01[0]]["message"] and NB01 in rows["cy"][TASKS01[0]]["message"]
    assert rows["dee"][TASKS01[0]]["message"] == f"timeout after {TIMEOUT}s"
    assert "not in" in rows["ivy"][TASKS01[0]]["message"] and "no notebooks" in rows["joe"][TASKS01[0]]["message"]
    fay = rows["fay"]
    assert "shapes do not match" in fay[TASKS01[1]]["message"]
    assert "does not define 'attention_backward'" in fay[TASKS01[2]]["message"]
    assert "ZeroDivisionError" in fay[TASKS01[2]]["message"]
    # a wrong answer's hint is its own column, the tail of the verdict
    for name in ("fay", "gil", "hal"):
        row = rows[name][TASKS01[0]]
        assert row["hint"] and row["message"].endswith("hint: " + row["hint"])
    assert rows["fay"][TASKS01[0]]["hint"] == rows["gil"][TASKS01[0]]["hint"] != rows["hal"][TASKS01[0]]["hint"]
    assert "dout" in rows["gil"][TASKS01[0]]["hint"]  # the named mistake: the chain rule's factor dout
    assert all(r["hint"] == "" for r in rows["ada"].values())
    # the hanging kernel did not outlive its timeout
    pid = int((root / "dee" / "kernel.pid").read_text())
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            break  # a zombie: killed, not reaped yet
        time.sleep(0.2)
    else:
        assert not Path(f"/proc/{pid}").exists(), "the hanging kernel is still running"


@pytest.mark.slow
@needs_kernel
def test_totals_json_and_the_printed_summary(graded_class):
    _, out, book = graded_class
    with open(book / "totals.csv", newline="", encoding="utf-8") as f:
        totals = {r["learner"]: r for r in csv.DictReader(f)}
    assert [(k, int(t["score"]), int(t["total"])) for k, t in totals.items()] == [
        ("ada", 3, 3), ("ben", 0, 3), ("cy", 0, 3), ("dee", 0, 3), ("eve", 0, 3), ("fay", 0, 3), ("gil", 2, 3),
        ("hal", 2, 3), ("ivy", 0, 3), ("joe", 0, 3),
    ]  # fmt: skip
    assert float(totals["gil"]["percent"]) == pytest.approx(66.7)
    assert (int(totals["fay"]["wrong"]), int(totals["fay"]["error"]), int(totals["fay"]["not run"])) == (1, 1, 1)

    data = json.loads((book / "gradebook.json").read_text())
    assert data["notebooks"] == ["01_*"] and data["strict"] is False
    assert len(data["rows"]) == 30 and data["learners"][0] == "ada"
    summary = {s["task"]: s for s in data["summary"]}
    gelu = summary[TASKS01[0]]
    expected = {"correct": 1, "wrong": 3, "not attempted": 2, "error": 0, "not run": 0, "timed out": 1}
    assert {k: gelu["counts"][k] for k in expected} == expected
    assert (gelu["counts"]["unreadable"], gelu["counts"]["missing"], gelu["counts"]["no notebooks"]) == (1, 1, 1)
    gil_hint = by_learner(book)["gil"][TASKS01[0]]["hint"]
    assert (gelu["most_common_wrong"], gelu["most_common_wrong_learners"]) == (gil_hint, 2)
    assert summary[TASKS01[1]]["counts"]["error"] == 1 and summary[TASKS01[1]]["most_common_wrong"] == ""
    runs = {(r["learner"], r["notebook"]): r for r in data["runs"]}
    assert runs["dee", NB01]["failure"] == f"timeout after {TIMEOUT}s"
    assert runs["ada", NB01]["failure"] is None and ("joe", NB01) not in runs

    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("task"))
    assert header.split()[:6] == ["task", "level", "correct", "wrong", "not", "attempted"]
    gelu_line = next(line for line in lines if line.startswith(TASKS01[0]))
    columns = header[header.index("correct") :].split("  ")
    names = [c.strip() for c in columns if c.strip()]
    values = gelu_line[header.index("correct") :].split()
    assert dict(zip(names, map(int, values))) == {k: v for k, v in gelu["counts"].items() if k in names}
    assert f"  {TASKS01[0]} (2): {gil_hint}" in lines
    assert any(line.split()[:2] == ["gil", "2/3"] for line in lines)


@pytest.mark.slow
@needs_kernel
def test_strict_is_passed_to_the_grader(tmp_path):
    """A learner who patches the checker module is credited by the default mode (the limit the README states)
    and not under --strict, which runs only the learner's exercise cells."""
    root = tmp_path / "class"
    assert run_cli("start", str(root / "pat"))[0] == 0
    nb = nbformat.read(str(root / "pat" / NB01), as_version=4)
    nb.cells.append(
        nbformat.v4.new_code_cell(
            "import types, gpullm_lessons.checks.backward as c\n"
            "c.check_gelu_backward = lambda *a, **k: types.SimpleNamespace(status='correct', message='patched')"
        )
    )
    nbformat.write(nb, str(root / "pat" / NB01))
    loose = run_cli("grade", "--class", str(root), "--notebooks", "01_*", "--timeout", str(TIMEOUT))
    assert loose[0] == 0, loose[2]
    assert [r["status"] for r in rows_of(root / "gradebook")] == ["correct", "not attempted", "not attempted"]
    strict = run_cli("grade", "--class", str(root), "--notebooks", "01_*", "--timeout", str(TIMEOUT), "--strict")
    assert strict[0] == 0, strict[2]
    assert [r["status"] for r in rows_of(root / "gradebook")] == ["not attempted"] * 3
    assert json.loads((root / "gradebook" / "gradebook.json").read_text())["strict"] is True
    assert {r["learner"] for r in rows_of(root / "gradebook")} == {"pat"}  # the first run's gradebook is no learner
