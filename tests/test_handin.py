"""Hand-in and collection (gpullm_lessons/classroom/handin.py): `submit` copies a learner's notebooks into the drop box with
the time, never over an earlier hand-in; `grade --class DROPBOX --dropbox --deadline T` grades each learner's latest
hand-in and marks the late ones. A class of four on lesson 01: ada hands in twice (the fresh exercises, then the
solutions: the second is graded), ben once after the deadline, cy once, dee made a folder and never handed in."""

import csv
import datetime as dt
import json

import nbformat
import pytest
from test_class import NB01, ROOT, TASKS01, run_cli
from test_grading import needs_kernel

from gpullm_lessons.classroom import gradebook as classroom, handin

UTC = dt.timezone.utc
DEADLINE = "2026-12-20T23:59:00+00:00"


def test_submit_names_what_is_wrong(tmp_path, monkeypatch):
    monkeypatch.delenv(handin.DROPBOX_ENV, raising=False)
    (tmp_path / "work").mkdir()
    (tmp_path / "box").mkdir()
    cases = [
        ([str(tmp_path / "work")], "no drop box: pass --to DROPBOX or set GPULLM_DROPBOX"),
        ([str(tmp_path / "work"), "--to", str(tmp_path / "nowhere")], "does not exist"),
        ([str(tmp_path / "work"), "--to", str(tmp_path / "box"), "--name", "../eve"], "use letters, digits"),
        ([str(tmp_path / "work"), "--to", str(tmp_path / "box"), "--name", "ada"], "no notebooks (*.ipynb)"),
    ]
    for argv, needle in cases:
        rc, _, err = run_cli("submit", *argv)
        assert rc == 2 and needle in err, (argv, err)
    assert list((tmp_path / "box").iterdir()) == []


def test_a_hand_in_is_a_new_timed_folder_with_checksums(tmp_path, monkeypatch):
    (tmp_path / "box").mkdir()
    assert run_cli("start", str(tmp_path / "me"))[0] == 0
    monkeypatch.setenv(handin.DROPBOX_ENV, str(tmp_path / "box"))
    rc, out, err = run_cli("submit", str(tmp_path / "me"), "--name", "ada")
    assert rc == 0, err
    (first,) = (tmp_path / "box" / "ada").iterdir()
    manifest = json.loads((first / "handin.json").read_text())
    assert manifest["learner"] == "ada" and NB01 in manifest["files"] and str(first) in out
    assert (first / NB01).read_bytes() == (tmp_path / "me" / NB01).read_bytes()
    assert run_cli("submit", str(tmp_path / "me"), "--name", "ada")[0] == 0
    assert len(list((tmp_path / "box" / "ada").iterdir())) == 2  # the first is kept as it was
    assert json.loads((first / "handin.json").read_text()) == manifest


@pytest.mark.slow
@needs_kernel
def test_grade_class_from_the_drop_box_takes_the_latest_and_marks_late(tmp_path):
    box = tmp_path / "box"
    box.mkdir()
    solution = nbformat.read(str(ROOT / "solutions" / NB01), as_version=4)
    for learner in ("ada", "ben", "cy"):
        assert run_cli("start", str(tmp_path / learner))[0] == 0
    t0 = dt.datetime(2026, 12, 19, 12, 0, tzinfo=UTC)
    handin.submit(tmp_path / "ada", box, "ada", now=t0)  # the fresh exercises ...
    nbformat.write(solution, str(tmp_path / "ada" / NB01))
    handin.submit(tmp_path / "ada", box, "ada", now=t0 + dt.timedelta(hours=2))  # ... then the solutions
    nbformat.write(solution, str(tmp_path / "ben" / NB01))
    handin.submit(tmp_path / "ben", box, "ben", now=dt.datetime(2026, 12, 21, 9, 0, tzinfo=UTC))  # late
    handin.submit(tmp_path / "cy", box, "cy", now=t0)
    (box / "dee").mkdir()
    out = tmp_path / "book"
    rc, text, err = run_cli("grade", "--class", str(box), "--dropbox", "--deadline", DEADLINE, "--notebooks", "01_*",
                            "--timeout", "60", "--out", str(out))  # fmt: skip
    assert rc == 0, err
    with open(out / "gradebook.csv", newline="") as f:
        rows = {(r["learner"], r["task"]): r["status"] for r in csv.DictReader(f)}
    assert [rows["ada", t] for t in TASKS01] == ["correct"] * 3  # the latest hand-in, not the first
    assert [rows["ben", t] for t in TASKS01] == ["correct"] * 3  # late is marked, still graded
    assert [rows["cy", t] for t in TASKS01] == ["not attempted"] * 3
    assert [rows["dee", t] for t in TASKS01] == [classroom.NO_NOTEBOOKS] * 3
    with open(out / "handins.csv", newline="") as f:
        hand = {r["learner"]: r for r in csv.DictReader(f)}
    assert (hand["ada"]["handins"], hand["ada"]["late"]) == ("2", "no")
    assert hand["ada"]["graded_handin_time"] == (t0 + dt.timedelta(hours=2)).isoformat()
    assert (hand["ben"]["late"], hand["cy"]["late"], hand["dee"]["handins"]) == ("yes", "no", "0")
    assert (
        "late: ben" in text
        and "none: dee" in text
        and str(box) in json.loads((out / "gradebook.json").read_text())["root"]
    )


def test_deadline_needs_the_drop_box_and_an_iso_time(tmp_path):
    (tmp_path / "box" / "ada").mkdir(parents=True)
    rc, _, err = run_cli("grade", "--class", str(tmp_path / "box"), "--deadline", DEADLINE)
    assert rc == 2 and "--deadline needs --dropbox" in err
    rc, _, err = run_cli("grade", "--class", str(tmp_path / "box"), "--dropbox", "--deadline", "friday")
    assert rc == 2 and "give an ISO date and time" in err
