"""No lesson shows the answer to its exercise: solution regions against what the lessons show (gpullm_lessons.classroom.leaks)."""
from pathlib import Path

import nbformat
import pytest

from gpullm_lessons.classroom import leaks

ROOT = Path(__file__).resolve().parents[1]


def test_no_solution_region_is_shown_by_its_lesson_or_its_exercise():
    rows = leaks.scan(ROOT / "solutions", ROOT / "notebooks")
    assert len(rows) >= 30  # every region was compared
    print("\n".join(str(r) for r in rows[:8]))  # the closest ones, for whoever tunes LEAK_THRESHOLD
    bad = [str(r) for r in rows if r.score > leaks.LEAK_THRESHOLD]
    assert not bad, "lessons or exercise texts that show an answer:\n" + "\n".join(bad)


def _course(tmp_path, lesson_cells, region, exercise_md="Write the kernel."):
    C, M = nbformat.v4.new_code_cell, nbformat.v4.new_markdown_cell
    sol = nbformat.v4.new_notebook(cells=[M(exercise_md), C("def f(dout, out, dinp):\n    ### BEGIN SOLUTION\n"
                                                             "    # TODO: the row sum, then the product\n"
                                                             + "\n".join("    " + ln for ln in region.split("\n"))
                                                             + "\n    ### END SOLUTION")])
    lesson = nbformat.v4.new_notebook(cells=lesson_cells)
    (tmp_path / "solutions").mkdir()
    (tmp_path / "notebooks").mkdir()
    nbformat.write(sol, str(tmp_path / "solutions" / "03_x.ipynb"))
    nbformat.write(lesson, str(tmp_path / "notebooks" / "03_x.ipynb"))
    return leaks.scan(tmp_path / "solutions", tmp_path / "notebooks")


REGION = ("row_dot = (out * dout).sum(axis=-1, keepdims=True)\n"
          "dinp[...] = out * (dout - row_dot)\n"
          "for j in range(n):\n    acc[j] = out[j] * dout[j]")


def test_a_planted_copy_is_caught_whatever_its_names_comments_and_layout(tmp_path):
    C = nbformat.v4.new_code_cell
    renamed = ("# the lesson's version\ns = (y * g).sum(axis=-1,\n              keepdims=True)  # row sums\n"
               "dx[...] = y * (g - s)\nfor k in range(n):\n    tmp[k] = y[k] * g[k]")
    rows = _course(tmp_path, [C("import numpy as np"), C(renamed)], REGION)
    assert rows[0].score > leaks.LEAK_THRESHOLD and rows[0].where == "code cell 1"


def test_a_copy_in_markdown_or_the_exercise_text_is_caught(tmp_path):
    M = nbformat.v4.new_markdown_cell
    rows = _course(tmp_path, [M("The answer:\n```python\n" + REGION + "\n```")], REGION)
    assert rows[0].score > leaks.LEAK_THRESHOLD
    (tmp_path / "b").mkdir()
    rows = _course(tmp_path / "b", [M("nothing")], REGION,
                   exercise_md="Hint: `dinp[...] = out * (dout - row_dot)` after `row_dot = (out * dout).sum("
                               "axis=-1, keepdims=True)`, then `for j in range(n): acc[j] = out[j] * dout[j]`")
    assert rows[0].score > leaks.LEAK_THRESHOLD and rows[0].where == "the exercise's contract"


def test_a_printed_module_source_is_resolved_through_the_lessons_imports(tmp_path):
    import inspect
    from gpullm_lessons.reference import softmax
    C = nbformat.v4.new_code_cell
    body = inspect.getsource(softmax.softmax_backward).split('"""')[-1]
    region = "\n".join(ln[4:] for ln in body.strip("\n").split("\n"))
    rows = _course(tmp_path, [C("import inspect\nfrom gpullm_lessons import reference as ref\n"
                                "print(inspect.getsource(ref.softmax.softmax_backward))")], region)
    assert rows[0].score > leaks.LEAK_THRESHOLD and "getsource" in rows[0].where


def test_an_excerpt_shown_with_show_source_is_counted(tmp_path):
    from gpullm_lessons.viz import show
    from gpullm_lessons.reference import softmax
    C = nbformat.v4.new_code_cell
    _, _, lines = show.excerpt(softmax.softmax_backward, start="=")
    region = "\n".join(ln[4:] for ln in lines)
    rows = _course(tmp_path, [C("from gpullm_lessons.viz import show\nfrom gpullm_lessons import reference as ref\n"
                                "show.source(ref.softmax.softmax_backward, start='=')")], region)
    assert rows[0].score > leaks.LEAK_THRESHOLD and "show.source" in rows[0].where
    (tmp_path / "b").mkdir()                       # the same cell showing a part without the region: not counted
    rows = _course(tmp_path / "b", [C("from gpullm_lessons.viz import show\nfrom gpullm_lessons import reference as ref\n"
                                      "show.source(ref.softmax.softmax_backward, stop='=')")], region)
    assert rows[0].score < leaks.LEAK_THRESHOLD


def test_a_variant_is_not_flagged(tmp_path):
    C = nbformat.v4.new_code_cell
    other = ("m = x.max(axis=-1, keepdims=True)\ne = np.exp(x - m)\nout[...] = e / e.sum(axis=-1, keepdims=True)")
    rows = _course(tmp_path, [C(other)], REGION)
    assert rows[0].score < leaks.LEAK_THRESHOLD / 2


@pytest.mark.parametrize("text, expected", [
    ("a = b  # comment", ["_", "=", "_"]),
    ("x.grid(1) // c++ comment\n/* block */ y", ["_", ".", "grid", "(", "1", ")", "_"]),
    ('for i in range(n): s += 1.5f', ["for", "_", "in", "range", "(", "_", ")", ":", "_", "+", "=", "1.5f"]),
])
def test_tokens_drop_comments_and_normalise_names(text, expected):
    assert leaks.tokens(text) == expected


def test_outside_a_checkout_it_says_so_instead_of_printing_nothing(tmp_path, capsys, monkeypatch):
    from gpullm_lessons.classroom import leaks

    monkeypatch.chdir(tmp_path)
    assert leaks.main([]) == 2
    err = capsys.readouterr().err
    assert "no solution notebooks" in err and str(tmp_path / "solutions") in err and "--solutions DIR" in err
