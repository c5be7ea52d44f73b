"""The course as a lab installs it: a wheel in a fresh virtual environment, away from any checkout, runs `start`,
`grade`, `grade --class` and `--strict` for a small class with the same results as the checkout.

The wheel is built from this checkout and installed (no dependencies: those come from the test's own environment
through a .pth line, so nothing is downloaded) into a new venv; every command runs with that venv's python from a
folder outside the checkout, so the package can only find what the wheel carries. The class, on lesson 01 (three
NumPy tasks): ada the solutions; ben one right answer, one wrong; cy one right answer and the checker cells of the
two tasks left undone deleted (the grader must still ask for all three); dee forged verdicts. Each is graded from
the wheel and from the checkout, plain and --strict, and the gradebooks must agree; in the plain run the learners
hand in with the wheel's `submit` and the wheel grades the drop box (`grade --class BOX --dropbox --deadline T`).
"""

import csv
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import nbformat
import pytest
from test_class import FORGERIES, FORGETS_DOUT, NB01, TASKS01
from test_grading import needs_kernel
from test_packaging import build_wheel

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 60


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    """A fresh venv with the course installed from its wheel: its python."""
    tmp = tmp_path_factory.mktemp("wheel-venv")
    whl = build_wheel(tmp)  # from a copy of the checkout
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp / "venv")], check=True, timeout=120)
    py = tmp / "venv" / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True, env=_env()).stdout.strip())  # fmt: skip
    # without PYTHONPATH: where it names the checkout (a GPU machine's setup does), pip would find the checkout's
    # metadata, say the course is already installed and install nothing
    p = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", str(whl)],
                       capture_output=True, text=True, timeout=600, env=_env())  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    # the dependencies from this environment, after the venv's own site-packages so that the wheel's package wins:
    # every folder of this process's sys.path except the checkout and what lies inside it (PYTHONPATH's folders
    # first, as here, then site-packages)
    deps = [e for e in sys.path if e and os.path.isdir(e) and not Path(e).resolve().is_relative_to(ROOT)]
    (site / "zz_dependencies.pth").write_text(
        "\n".join(dict.fromkeys(deps + [sysconfig.get_paths()["purelib"]])) + "\n"
    )
    where = subprocess.run([str(py), "-c", "import gpullm_lessons; print(gpullm_lessons.__file__)"],
                           capture_output=True, text=True, cwd=tmp, env=_env())  # fmt: skip
    assert where.returncode == 0 and where.stdout.startswith(str(site)), (where.stdout, where.stderr)
    return py


def _env(py=None):
    """The environment of a command run with `py`: the wheel's venv gets no PYTHONPATH (which may name the checkout);
    this test's own python (the checkout's side) keeps it (on a machine where the checkout is importable only
    through PYTHONPATH)."""
    if py is not None and Path(py) == Path(sys.executable):
        return dict(os.environ, GPULLM_DEVICE="sim")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return dict(env, GPULLM_DEVICE="sim")


def cli(py, cwd, *argv):
    return subprocess.run([str(py), "-m", "gpullm_lessons", *argv], cwd=cwd, capture_output=True, text=True,
                          env=_env(py), timeout=900)  # fmt: skip


def make_class(py, root: Path):
    """The four learners, each started with `start` from the installation that `py` runs."""
    solution = nbformat.read(str(ROOT / "solutions" / NB01), as_version=4)
    root.mkdir(parents=True)
    for learner in ("ada", "ben", "cy", "dee"):
        r = cli(py, root.parent, "start", str(root / learner))
        assert r.returncode == 0, r.stderr
        assert (root / learner / NB01).is_file()

    def write(learner, nb):
        nbformat.write(nb, str(root / learner / NB01))

    write("ada", solution)
    ben = nbformat.read(str(root / "ben" / NB01), as_version=4)
    right_gelu = next(c for c in solution.cells if c.get("id") == FORGETS_DOUT[0])
    for cell in ben.cells:  # 01.1 right, 01.2 wrong (its solution with one mistake), 01.3 untouched
        if cell.get("id") == FORGETS_DOUT[0]:
            cell.source = right_gelu.source
    ln_cell = next(c for c in solution.cells if "def layernorm_backward" in c.source)
    for cell in ben.cells:  # the rstd path left out
        if cell.get("id") == ln_cell.get("id"):
            cell.source = ln_cell.source.replace("(dnorm - row_a - norm * row_b) * r", "(dnorm - row_a) * r")
            assert cell.source != ln_cell.source
    write("ben", ben)
    cy = nbformat.read(str(root / "cy" / NB01), as_version=4)
    for cell in cy.cells:
        if cell.get("id") == FORGETS_DOUT[0]:
            cell.source = right_gelu.source
    cy.cells = [c for c in cy.cells if not ("check_" in c.source and "gelu" not in c.source)]
    write("cy", cy)
    dee = nbformat.read(str(root / "dee" / NB01), as_version=4)
    dee.cells += [nbformat.v4.new_code_cell(src) for src in FORGERIES]
    write("dee", dee)


def gradebook(py, root: Path, *extra):
    out = root.parent / (root.name + "-book" + ("strict" if "--strict" in extra else ""))
    r = cli(py, root.parent, "grade", "--class", str(root), "--notebooks", "01_*", "--timeout", str(TIMEOUT),
            "--workers", "2", "--out", str(out), *extra)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    with open(out / "gradebook.csv", newline="", encoding="utf-8") as f:
        return {(row["learner"], row["task"]): row["status"] for row in csv.DictReader(f)}


@pytest.mark.slow
@needs_kernel
@pytest.mark.parametrize("strict", [False, True], ids=["plain", "strict"])
def test_a_class_graded_from_the_wheel_as_from_the_checkout(venv, tmp_path, strict):
    extra = ("--strict",) if strict else ()
    wheel_root, checkout_root = tmp_path / "wheel" / "class", tmp_path / "checkout" / "class"
    make_class(venv, wheel_root)
    make_class(Path(sys.executable), checkout_root)
    from_checkout = gradebook(sys.executable, checkout_root, *extra)
    if strict:
        from_wheel = gradebook(venv, wheel_root, *extra)
    else:  # plain: the learners hand in with the wheel's `submit`, and the wheel grades the drop box
        box = tmp_path / "wheel" / "dropbox"
        box.mkdir()  # the lab makes it once for the class
        for learner in ("ada", "ben", "cy", "dee"):
            r = cli(venv, wheel_root, "submit", str(wheel_root / learner), "--to", str(box), "--name", learner)
            assert r.returncode == 0, r.stderr
        from_wheel = gradebook(venv, box, "--dropbox", "--deadline", "2099-01-01T00:00+00:00")
        with open(box.parent / "dropbox-book" / "handins.csv", newline="", encoding="utf-8") as f:
            handins = list(csv.DictReader(f))
        assert sorted(row["learner"] for row in handins) == ["ada", "ben", "cy", "dee"], handins
    assert from_wheel == from_checkout
    got = {learner: [from_wheel[(learner, t)] for t in TASKS01] for learner in ("ada", "ben", "cy", "dee")}
    assert got["ada"] == ["correct"] * 3
    assert got["ben"][0] == "correct" and got["ben"][1] in ("wrong", "error") and got["ben"][2] == "not attempted"
    assert got["cy"] == ["correct", "not attempted", "not attempted"]  # the deleted checker cells still count
    assert "correct" not in got["dee"]  # forged verdicts count for nothing


@needs_kernel
def test_one_learner_graded_from_the_wheel_outside_any_checkout(venv, tmp_path):
    """`grade DIR` (one learner) from the wheel, in a folder named solutions/ (the name once made the grader take
    the task list from the folder itself): the course's three tasks, the deleted ones included."""
    me = tmp_path / "solutions"
    r = cli(venv, tmp_path, "start", str(me))
    assert r.returncode == 0, r.stderr
    nb = nbformat.read(str(me / NB01), as_version=4)
    nb.cells = [c for c in nb.cells if "check_" not in c.source]
    nbformat.write(nb, str(me / NB01))
    r = cli(venv, tmp_path, "grade", str(me), "--notebooks", "01_*", "--timeout", str(TIMEOUT), "--json",
            str(tmp_path / "report.json"))  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert [t["task"] for t in report["tasks"]] == TASKS01 and report["score"] == 0


def test_the_exercises_send_learners_to_the_grader_of_their_own_folder():
    """`make grade` grades the course's own exercises/ from the checkout's root (a shared install's untouched copy):
    the closing text of every exercise names the command for the folder the learner works in instead."""
    for path in sorted((ROOT / "exercises").glob("*.ipynb")):
        text = "".join(c.source for c in nbformat.read(str(path), as_version=4).cells if c.cell_type == "markdown")
        assert "make grade" not in text, path.name
        assert "python -m gpullm_lessons grade ." in " ".join(text.split()), path.name
