"""The repository's own notebooks: stored clean, the course's task ladder, solutions score 100%, fresh exercises 0."""
from collections import Counter
from pathlib import Path

import pytest

from gpullm_lessons import device
from gpullm_lessons.classroom.exercises import is_clean
from gpullm_lessons.classroom.grading import LEVELS, find_tasks, grade, task_kind

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted(p for d in ("notebooks", "solutions", "exercises") for p in (ROOT / d).glob("*.ipynb"))
KERNEL_KINDS = ("Numba", "HIP")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_stored_without_outputs_and_with_canonical_metadata(path):
    assert is_clean(path), f"{path.relative_to(ROOT)} has outputs or odd metadata: run `make clean-notebooks`"


def course_tasks():
    return [t for nb in sorted((ROOT / "solutions").glob("*.ipynb")) for t in find_tasks(nb)]


def test_every_solution_notebook_has_a_ladder_of_labelled_tasks():
    solutions = sorted((ROOT / "solutions").glob("*.ipynb"))
    assert solutions
    for nb in solutions:
        tasks = find_tasks(nb)
        assert tasks, f"{nb.name} calls no checker"
        for t in tasks:
            assert t.named and t.key[:2] == nb.name[:2], f"{nb.name}: {t.label!r} needs task='{nb.name[:2]}.k ...'"
            assert t.level in LEVELS, f"{nb.name}: no '### Task {t.key.split()[0]} · level — title' line"
            assert task_kind(t.title), f"{nb.name}: {t.key}'s title does not end with what is written, e.g. (Numba)"
            assert t.module.startswith("gpullm_lessons"), f"{nb.name}: {t.check} is not a course checker"


def test_the_course_has_the_task_counts_it_promises():
    """At least 32 graded tasks, 16 of them GPU kernels the learner writes (Numba or HIP), 5 in HIP C++; every
    difficulty level used."""
    tasks = course_tasks()
    kinds = Counter(task_kind(t.title) for t in tasks)
    assert len(tasks) >= 32, kinds
    assert sum(kinds[k] for k in KERNEL_KINDS) >= 16, kinds
    assert kinds["HIP"] >= 5, kinds
    assert {t.level for t in tasks} == set(LEVELS)
    assert len({t.key for t in tasks}) == len(tasks), "task ids repeat"


def test_solutions_score_full_and_fresh_exercises_score_zero():
    """Every task of the instructor's notebooks gets a verdict. Without a GPU, CuPy tasks are 'skipped' and HIP
    tasks 'compiled' (both left out of the total); on a GPU every task is scored. This is also where `make test`
    runs the solutions: the grader runs every cell of each (its checker cells through the grader's own calls), and
    none may end in an error or a timeout."""
    expected = len(course_tasks())
    allowed = {"correct"} | (set() if device.has_gpu() else {"skipped", "compiled"})
    solved = grade(ROOT / "solutions", timeout=900, workers=2)     # two notebooks at a time (also tests workers=)
    assert sorted(nb.notebook for nb in solved.notebooks) == sorted(p.name for p in (ROOT / "solutions").glob("*.ipynb"))
    ran_badly = {nb.notebook: (nb.failure, nb.cell_errors) for nb in solved.notebooks if nb.failure or nb.cell_errors}
    assert not ran_badly, ran_badly
    assert len(solved.tasks) == expected and solved.score == solved.total > 0, solved.format()
    assert {row.status for row in solved.tasks} <= allowed, solved.format()
    print(solved.format())
    fresh = grade(ROOT / "exercises", timeout=900, workers=2)
    assert len(fresh.tasks) == expected and fresh.score == 0, fresh.format()
    # a blank HIP task is "not attempted" (scored), a written one "compiled" (counted apart) without a GPU
    assert {row.status for row in fresh.tasks} <= {"not attempted", "skipped"}, fresh.format()
    assert [(t.notebook, t.task) for t in fresh.tasks] == [(t.notebook, t.task) for t in solved.tasks]
    assert fresh.total == solved.total + sum(row.status == "compiled" for row in solved.tasks), fresh.format()


def test_readme_lists_every_task():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    missing = [t.key.split()[0] for t in course_tasks() if t.key.split()[0] not in readme]
    assert not missing, f"README's exercise table does not list {missing}"


def test_every_test_file_that_starts_mpirun_runs_one_at_a_time():
    """make test runs 2 xdist workers; two mpirun -n 2 jobs side by side would oversubscribe the 2 cores of CI."""
    from conftest import ONE_AT_A_TIME

    tests = ROOT / "tests"
    starts = sorted(f"tests/{p.name}" for p in tests.glob("test_*.py")
                    if p.name != "test_repo_notebooks.py" and ("job(2" in p.read_text() or "mpirun_command(" in p.read_text()))
    assert starts, "no test starts mpirun"
    assert [s for s in starts if not s.startswith(ONE_AT_A_TIME)] == []
