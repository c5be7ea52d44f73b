"""The repository's own notebooks: stored clean, solutions score 100%, fresh exercises score 0 (all not attempted)."""
from pathlib import Path

import pytest

from gpullm_lessons import device
from gpullm_lessons.exercises import is_clean
from gpullm_lessons.grading import find_tasks, grade

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted(p for d in ("notebooks", "solutions", "exercises") for p in (ROOT / d).glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_stored_without_outputs_and_with_canonical_metadata(path):
    assert is_clean(path), f"{path.relative_to(ROOT)} has outputs or odd metadata: run `make clean-notebooks`"


def test_every_solution_notebook_has_graded_tasks():
    solutions = sorted((ROOT / "solutions").glob("*.ipynb"))
    assert solutions
    for nb in solutions:
        assert find_tasks(nb), f"{nb.name} calls no checker"


def test_solutions_score_full_and_fresh_exercises_score_zero():
    """Every task found in the code gets a verdict. Tasks on CuPy/HIP code are 'skipped' (and left out of the total)
    only on a machine without a GPU; on a GPU every task is scored."""
    expected = sum(len(find_tasks(nb)) for nb in (ROOT / "solutions").glob("*.ipynb"))
    allowed = {"correct"} | (set() if device.has_gpu() else {"skipped"})
    solved = grade(ROOT / "solutions", timeout=900, workers=2)     # two notebooks at a time (also tests workers=)
    assert len(solved.tasks) == expected and solved.score == solved.total > 0, solved.format()
    assert {row.status for row in solved.tasks} <= allowed, solved.format()
    fresh = grade(ROOT / "exercises", timeout=900, workers=2)
    assert len(fresh.tasks) == expected and fresh.score == 0 and fresh.total == solved.total, fresh.format()
    assert {row.status for row in fresh.tasks} <= {"not attempted"} | (allowed - {"correct"}), fresh.format()
