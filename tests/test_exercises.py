"""The exercise pipeline: solutions/*.ipynb -> exercises/*.ipynb (regions replaced, notebooks canonical)."""
from pathlib import Path

import nbformat
import pytest

from gpullm_lessons.classroom import exercises
from gpullm_lessons.classroom.exercises import (RAISE_LINE, generate, is_clean, make_exercise, stale, strip_outputs,
                                      strip_solution_regions)

ROOT = Path(__file__).resolve().parents[1]
C = nbformat.v4.new_code_cell
M = nbformat.v4.new_markdown_cell

SOLUTION_CELL = '''\
import numpy as np

def linear_backward(dout, inp, weight, dinp, dweight, dbias):
    """(N, OC) -> grads."""
    ### BEGIN SOLUTION
    # TODO: dinp = dout @ weight.T, dweight = inp.T @ dout, dbias = sum of dout over rows
    dinp[...] = dout @ weight.T
    dweight[...] = inp.T @ dout
    ### END SOLUTION
    dbias[...] = dout.sum(axis=0)  # kept: outside the region

### BEGIN SOLUTION
scale = 2.0
### END SOLUTION
print(scale)'''

EXERCISE_CELL = '''\
import numpy as np

def linear_backward(dout, inp, weight, dinp, dweight, dbias):
    """(N, OC) -> grads."""
    # TODO: dinp = dout @ weight.T, dweight = inp.T @ dout, dbias = sum of dout over rows
    raise NotImplementedError("exercise: write this part")
    dbias[...] = dout.sum(axis=0)  # kept: outside the region

# TODO: your code here
raise NotImplementedError("exercise: write this part")
print(scale)'''


def solution_notebook(body=SOLUTION_CELL, ids=True):
    """A solution notebook with editor junk: outputs, counts, widget state, UI metadata, a solution-only cell."""
    nb = nbformat.v4.new_notebook()
    nb.metadata = {
        "kernelspec": {"display_name": "venv (3.11)", "language": "python", "name": "venv"},
        "language_info": {"name": "python", "version": "3.11.7", "mimetype": "text/x-python"},
        "widgets": {"application/vnd.jupyter.widget-state+json": {"state": {}}},
        "vscode": {"interpreter": {"hash": "abc"}},
    }
    code = C(body, execution_count=7, metadata={"collapsed": True, "scrolled": True, "tags": ["nbval-skip"],
                                                 "execution": {"iopub.execute_input": "2024-01-01"}})
    code.outputs = [nbformat.v4.new_output("stream", name="stdout", text="2.0\n")]
    only = C("print('the answer key')", metadata={"tags": ["solution-only"]})
    md = M("# Linear backward\n\nWrite `### BEGIN SOLUTION` nowhere here: markdown is kept *as is*.")
    nb.cells = [md, code, only, C("check_linear_backward(linear_backward)", execution_count=8)]
    if not ids:
        nb.nbformat_minor = 4
        for cell in nb.cells:
            cell.pop("id", None)
    return nb


def write(path: Path, nb) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, str(path))
    return path


# ---------------------------------------------------------------------------------------------- regions
def test_region_replaced_at_its_indentation_keeping_todo_and_outside_code():
    assert strip_solution_regions(SOLUTION_CELL) == EXERCISE_CELL


def test_region_markers_tolerate_trailing_spaces_and_empty_regions():
    src = "def f():\n    ### BEGIN SOLUTION   \n    ### END SOLUTION\n"
    assert strip_solution_regions(src) == f"def f():\n    # TODO: your code here\n    {RAISE_LINE}\n"


def test_cell_without_markers_is_unchanged():
    src = "x = 1  # ### not a marker\n\n  y = 2\n"
    assert strip_solution_regions(src) == src


@pytest.mark.parametrize("src, line, what", [
    ("x = 1\ndef f():\n    ### BEGIN SOLUTION\n    return 1\n", 3, "without a matching '### END"),
    ("x = 1\n### END SOLUTION\n", 2, "without a matching '### BEGIN"),
    ("### BEGIN SOLUTION\na = 1\n### BEGIN SOLUTION\nb = 2\n### END SOLUTION\n", 3, "inside"),
])
def test_unbalanced_markers_raise_naming_notebook_cell_and_line(src, line, what):
    nb = nbformat.v4.new_notebook(cells=[M("intro"), C(src)])
    with pytest.raises(ValueError) as err:
        make_exercise(nb, name="solutions/07_bad.ipynb")
    msg = str(err.value)
    assert "solutions/07_bad.ipynb" in msg and "cell 1" in msg and f"line {line}" in msg and what in msg


# ---------------------------------------------------------------------------------------------- notebooks
def test_make_exercise_cleans_notebook_and_drops_solution_only_cells():
    nb = solution_notebook()
    before = nbformat.writes(nb)
    ex = make_exercise(nb, name="x.ipynb")
    assert nbformat.writes(nb) == before, "the input notebook must not be modified"

    assert ex.metadata == {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
                           "language_info": {"name": "python"}}
    assert [c.cell_type for c in ex.cells] == ["markdown", "code", "code"]  # solution-only cell dropped
    assert [c.id for c in ex.cells] == [nb.cells[i].id for i in (0, 1, 3)]  # source ids kept
    md, code, check = ex.cells
    assert md.source == nb.cells[0].source  # markdown kept as is
    assert code.source == EXERCISE_CELL
    assert check.source == "check_linear_backward(linear_backward)"
    for cell in (code, check):
        assert cell.outputs == [] and cell.execution_count is None
    assert code.metadata == {"tags": ["nbval-skip"]}  # UI junk (collapsed, scrolled, execution) removed
    nbformat.validate(ex)


def test_generate_is_byte_stable_and_removes_orphans(tmp_path):
    src, dst = tmp_path / "solutions", tmp_path / "exercises"
    write(src / "01_linear.ipynb", solution_notebook())
    write(src / "02_old_format.ipynb", solution_notebook(ids=False))  # nbformat 4.4: no cell ids
    write(dst / "09_removed.ipynb", nbformat.v4.new_notebook())  # its solution is gone
    (dst / "README.md").write_text("not a notebook: left alone\n")

    paths = generate(src, dst)
    assert [p.name for p in paths] == ["01_linear.ipynb", "02_old_format.ipynb"]
    assert sorted(p.name for p in dst.iterdir()) == ["01_linear.ipynb", "02_old_format.ipynb", "README.md"]
    first = {p.name: p.read_bytes() for p in paths}
    assert all(b.endswith(b"}\n") for b in first.values())  # trailing newline

    other = tmp_path / "again"
    generate(src, other)  # a fresh run elsewhere (ids of the 4.4 notebook must be deterministic too)
    generate(src, dst)  # and a second run in place
    assert {p.name: p.read_bytes() for p in paths} == first
    assert {p.name: p.read_bytes() for p in sorted(other.glob("*.ipynb"))} == first
    nb = nbformat.read(str(dst / "02_old_format.ipynb"), as_version=4)
    assert nb.nbformat_minor >= 5 and all(c.id for c in nb.cells)


def test_bad_marker_aborts_generation_without_touching_exercises(tmp_path):
    src, dst = tmp_path / "solutions", tmp_path / "exercises"
    write(src / "01_ok.ipynb", solution_notebook())
    write(src / "02_bad.ipynb", nbformat.v4.new_notebook(cells=[C("### BEGIN SOLUTION\nx = 1\n")]))
    with pytest.raises(ValueError, match=r"02_bad\.ipynb: cell 0, line 1"):
        generate(src, dst)
    assert not list(dst.glob("*.ipynb"))


def test_stale_detection_and_check_cli(tmp_path, capsys):
    src, dst = tmp_path / "solutions", tmp_path / "exercises"
    sol = write(src / "01_linear.ipynb", solution_notebook())
    write(src / "02_more.ipynb", solution_notebook())
    assert stale(src, dst) == [str(dst / "01_linear.ipynb"), str(dst / "02_more.ipynb")]  # missing
    generate(src, dst)
    assert stale(src, dst) == []
    argv = ["--check", "--src", str(src), "--dst", str(dst)]
    assert exercises.main(argv) == 0

    nb = nbformat.read(str(sol), as_version=4)
    nb.cells[1].source = nb.cells[1].source.replace("scale = 2.0", "scale = 3.0")  # only inside a region...
    write(sol, nb)
    assert stale(src, dst) == [], "changing solution code alone does not change the exercise"
    nb.cells[3].source = "check_linear_backward(linear_backward, task='02.1 linear backward')"
    write(sol, nb)
    write(dst / "03_orphan.ipynb", nbformat.v4.new_notebook())
    (dst / "02_more.ipynb").unlink()
    assert stale(src, dst) == [str(dst / n) for n in ("01_linear.ipynb", "02_more.ipynb", "03_orphan.ipynb")]

    capsys.readouterr()
    assert exercises.main(argv) == 1
    err = capsys.readouterr().err
    assert "01_linear.ipynb (out of date)" in err and "02_more.ipynb (missing)" in err
    assert "03_orphan.ipynb (extra)" in err and "make exercises" in err

    assert exercises.main(["--src", str(src), "--dst", str(dst)]) == 0  # regenerate
    assert stale(src, dst) == [] and exercises.main(argv) == 0


def test_strip_outputs_and_is_clean(tmp_path):
    path = write(tmp_path / "notebooks" / "01_intro.ipynb", solution_notebook())
    assert not is_clean(path)
    assert strip_outputs(path) is True
    assert is_clean(path)
    data = path.read_bytes()
    assert strip_outputs(path) is False and path.read_bytes() == data  # idempotent, untouched when clean
    nb = nbformat.read(str(path), as_version=4)
    assert len(nb.cells) == 4, "strip_outputs keeps solution-only cells"
    assert "### BEGIN SOLUTION" in nb.cells[1].source, "and solution regions"
    assert all(c.outputs == [] and c.execution_count is None for c in nb.cells if c.cell_type == "code")
    assert nb.metadata == {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
                           "language_info": {"name": "python"}}
    (tmp_path / "broken.ipynb").write_text("{not json")
    assert not is_clean(tmp_path / "broken.ipynb")


def _has_notebooks(folder: str) -> bool:
    return any((ROOT / folder).glob("*.ipynb"))


@pytest.mark.skipif(not _has_notebooks("solutions"), reason="solutions/ has no notebooks yet")
def test_repository_exercises_are_not_stale():
    out_of_date = stale(ROOT / "solutions", ROOT / "exercises")
    assert out_of_date == [], (f"exercises/ is out of sync with solutions/: {out_of_date}; "
                               "run `make exercises` and commit the result")
