"""Exercise notebooks are generated from solution notebooks, never edited by hand.

``solutions/NN_topic.ipynb`` is the single source of every graded exercise. A solution code cell marks the
part a learner writes with nbgrader-style markers (they may be indented)::

    def linear_backward(dout, inp, weight, dinp, dweight, dbias):
        ### BEGIN SOLUTION
        # TODO: dinp = dout @ weight.T, dweight = inp.T @ dout, dbias = sum of dout over rows
        dinp[...] = dout @ weight.T
        ...
        ### END SOLUTION

``make_exercise`` replaces each region, at the marker's indentation, by::

        # TODO: dinp = dout @ weight.T, dweight = inp.T @ dout, dbias = sum of dout over rows
        raise NotImplementedError("exercise: write this part")

The TODO line is the first line of the region when that line is a ``# TODO`` comment, else
``# TODO: your code here``. Cells tagged ``solution-only`` are dropped, outputs and execution counts are
cleared and metadata is made canonical, so ``exercises/`` is a pure function of ``solutions/``:

    python -m gpullm_lessons.classroom.exercises            # (re)write exercises/ from solutions/
    python -m gpullm_lessons.classroom.exercises --check    # exit 1, listing stale files, if exercises/ is out of date

``strip_outputs`` / ``is_clean`` apply the same hygiene (no outputs, canonical metadata) to any lesson notebook.
"""
from __future__ import annotations

import argparse
import copy
import re
import sys
from pathlib import Path
from typing import Optional

import nbformat

BEGIN_RE = re.compile(r"^(?P<indent>[ \t]*)###\s*BEGIN SOLUTION\s*$")
END_RE = re.compile(r"^[ \t]*###\s*END SOLUTION\s*$")
TODO_RE = re.compile(r"^[ \t]*#\s*TODO\b")
DEFAULT_TODO = "# TODO: your code here"
RAISE_LINE = 'raise NotImplementedError("exercise: write this part")'
SOLUTION_ONLY_TAG = "solution-only"

# Canonical notebook metadata: what every lesson notebook carries, nothing else.
CANONICAL_KERNELSPEC = {"display_name": "Python 3", "language": "python", "name": "python3"}
CANONICAL_LANGUAGE_INFO = {"name": "python"}
# Notebook-level metadata keys kept besides kernelspec and language_info (everything else is editor junk).
KEEP_NB_METADATA = ("title", "authors")
# Cell metadata keys kept (tags drive nbval and solution-only; the rest is UI state: collapsed, scrolled,
# execution timings, jupyter.source_hidden, vscode, ...).
KEEP_CELL_METADATA = ("tags", "editable", "deletable", "slideshow")

_CELL_ID_RE = re.compile(r"^[a-zA-Z0-9-_]{1,64}$")


# --------------------------------------------------------------------------------------------------
# Canonical form
# --------------------------------------------------------------------------------------------------
def _source(cell) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def canonicalize(nb):
    """Return a canonical copy of ``nb``: no outputs, no execution counts, canonical metadata, stable cell ids.

    Cells that have a valid id keep it. Cells without one (notebooks older than nbformat 4.5) get a
    deterministic id from their position (``cell-<index>``), so canonicalizing twice gives the same bytes.
    """
    nb = copy.deepcopy(nb)
    if nb.get("nbformat") != 4:
        nb = nbformat.convert(nb, 4)
    nb["nbformat_minor"] = max(int(nb.get("nbformat_minor", 5)), 5)  # 4.5: cells carry ids

    meta = nb.get("metadata", {})
    new_meta = nbformat.NotebookNode()
    new_meta["kernelspec"] = nbformat.NotebookNode(CANONICAL_KERNELSPEC)
    new_meta["language_info"] = nbformat.NotebookNode(CANONICAL_LANGUAGE_INFO)
    for key in KEEP_NB_METADATA:
        if key in meta:
            new_meta[key] = meta[key]
    nb["metadata"] = new_meta

    used = {c.get("id") for c in nb.cells if isinstance(c.get("id"), str) and _CELL_ID_RE.match(c["id"])}
    for index, cell in enumerate(nb.cells):
        cell["source"] = _source(cell)
        cell_meta = nbformat.NotebookNode()
        for key in KEEP_CELL_METADATA:
            if key in cell.get("metadata", {}):
                cell_meta[key] = cell["metadata"][key]
        if "tags" in cell_meta:
            tags = list(dict.fromkeys(cell_meta["tags"]))  # dedupe, keep order
            if tags:
                cell_meta["tags"] = tags
            else:
                del cell_meta["tags"]
        cell["metadata"] = cell_meta
        if cell.cell_type == "code":
            cell["outputs"] = []
            cell["execution_count"] = None
        if not (isinstance(cell.get("id"), str) and _CELL_ID_RE.match(cell["id"])):
            new_id, k = f"cell-{index}", 0
            while new_id in used:  # never collide with an id another cell already has
                k += 1
                new_id = f"cell-{index}-{k}"
            cell["id"] = new_id
            used.add(new_id)
    return nb


def _dumps(nb) -> str:
    """The exact text written for a notebook: nbformat JSON, indent 1, sorted keys, trailing newline."""
    text = nbformat.writes(nb, version=4)
    return text if text.endswith("\n") else text + "\n"


def _read(path) -> nbformat.NotebookNode:
    return nbformat.read(str(path), as_version=4)


def _write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write(text)


def strip_outputs(path) -> bool:
    """Canonicalize a lesson notebook in place (clear outputs and execution counts, canonical metadata).

    Returns True when the file changed. Solution markers and ``solution-only`` cells are left alone.
    """
    path = Path(path)
    text = _dumps(canonicalize(_read(path)))
    if path.read_text(encoding="utf-8") == text:
        return False
    _write_text(path, text)
    return True


def is_clean(path) -> bool:
    """True when the notebook file is already in canonical form (what ``strip_outputs`` would write)."""
    path = Path(path)
    try:
        return path.read_text(encoding="utf-8") == _dumps(canonicalize(_read(path)))
    except Exception:  # unreadable / invalid JSON is not clean
        return False


# --------------------------------------------------------------------------------------------------
# Solution -> exercise
# --------------------------------------------------------------------------------------------------
def strip_solution_regions(source: str, *, name: str = "<notebook>", cell_index: int = 0) -> str:
    """Replace every ``### BEGIN SOLUTION`` ... ``### END SOLUTION`` region of one cell's source.

    Raises ValueError (naming notebook, cell index and 1-based line) for unbalanced or nested markers.
    """
    lines = source.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        begin = BEGIN_RE.match(line)
        if END_RE.match(line):
            raise ValueError(f"{name}: cell {cell_index}, line {i + 1}: '### END SOLUTION' without a matching "
                             "'### BEGIN SOLUTION'")
        if not begin:
            out.append(line)
            i += 1
            continue
        indent = begin.group("indent")
        # find the matching END; a second BEGIN before it is an error (regions do not nest)
        j = i + 1
        while j < len(lines) and not END_RE.match(lines[j]):
            if BEGIN_RE.match(lines[j]):
                raise ValueError(f"{name}: cell {cell_index}, line {j + 1}: '### BEGIN SOLUTION' inside the "
                                 f"solution region opened at line {i + 1} (missing '### END SOLUTION'?)")
            j += 1
        if j == len(lines):
            raise ValueError(f"{name}: cell {cell_index}, line {i + 1}: '### BEGIN SOLUTION' without a matching "
                             "'### END SOLUTION'")
        first = lines[i + 1] if i + 1 < j else ""
        todo = first.strip() if TODO_RE.match(first) else DEFAULT_TODO
        out.append(indent + todo)
        out.append(indent + RAISE_LINE)
        i = j + 1
    return "\n".join(out)


def make_exercise(nb, *, name: Optional[str] = None):
    """Return the exercise version of a solution notebook (the input is not modified).

    - each solution region -> ``# TODO: ...`` + ``raise NotImplementedError(...)`` at the same indentation;
    - cells tagged ``solution-only`` are dropped; markdown and raw cells are otherwise kept as is;
    - outputs, execution counts and editor metadata are removed; cell ids are kept.
    """
    name = name or "<notebook>"
    nb = canonicalize(nb)
    cells = []
    for index, cell in enumerate(nb.cells):
        if SOLUTION_ONLY_TAG in cell.metadata.get("tags", []):
            continue
        if cell.cell_type == "code":
            cell["source"] = strip_solution_regions(cell["source"], name=name, cell_index=index)
        cells.append(cell)
    nb["cells"] = cells
    return nb


def _expected(src_dir: Path) -> dict[str, str]:
    """name -> exact text of the exercise notebook that ``generate`` writes for it."""
    if not src_dir.is_dir():
        raise FileNotFoundError(f"no solutions directory: {src_dir}")
    return {p.name: _dumps(make_exercise(_read(p), name=str(p))) for p in sorted(src_dir.glob("*.ipynb"))}


def generate(src_dir="solutions", dst_dir="exercises") -> list[Path]:
    """Write ``dst_dir/NN_topic.ipynb`` for every ``src_dir/NN_topic.ipynb``; remove exercises with no source.

    Files are only rewritten when their bytes change. Returns the exercise paths, sorted.
    """
    src_dir, dst_dir = Path(src_dir), Path(dst_dir)
    expected = _expected(src_dir)  # build everything first: a bad marker leaves exercises/ untouched
    dst_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in expected.items():
        path = dst_dir / name
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            _write_text(path, text)
        written.append(path)
    for path in sorted(dst_dir.glob("*.ipynb")):
        if path.name not in expected:
            path.unlink()
    return written


def stale_details(src_dir="solutions", dst_dir="exercises") -> list[tuple[str, str]]:
    """(exercise path, reason) for every exercise file that differs from what ``generate`` would write.

    reason is 'missing' (no exercise yet), 'extra' (no solution for it) or 'out of date'.
    """
    src_dir, dst_dir = Path(src_dir), Path(dst_dir)
    expected = _expected(src_dir)
    existing = {p.name: p for p in dst_dir.glob("*.ipynb")} if dst_dir.is_dir() else {}
    result = []
    for name in sorted(set(expected) | set(existing)):
        path = str(dst_dir / name)
        if name not in existing:
            result.append((path, "missing"))
        elif name not in expected:
            result.append((path, "extra"))
        elif existing[name].read_text(encoding="utf-8") != expected[name]:
            result.append((path, "out of date"))
    return result


def stale(src_dir="solutions", dst_dir="exercises") -> list[str]:
    """Exercise paths (as strings, sorted) that are missing, extra or different from what ``generate`` writes."""
    return [path for path, _ in stale_details(src_dir, dst_dir)]


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gpullm_lessons.classroom.exercises",
        description="Generate exercises/ from solutions/ (or check that it is up to date).")
    parser.add_argument("--check", action="store_true", help="do not write; exit 1 if exercises/ is stale")
    parser.add_argument("--src", default="solutions", help="solution notebooks (default: solutions)")
    parser.add_argument("--dst", default="exercises", help="exercise notebooks (default: exercises)")
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    try:
        if args.check:
            details = stale_details(args.src, args.dst)
            if details:
                print(f"{len(details)} exercise notebook(s) out of sync with {args.src}/:", file=sys.stderr)
                for path, reason in details:
                    print(f"  {path} ({reason})", file=sys.stderr)
                print("fix: run `make exercises` (python -m gpullm_lessons.classroom.exercises) and commit the result",
                      file=sys.stderr)
                return 1
            print(f"{args.dst}/ is up to date with {args.src}/")
            return 0
        paths = generate(args.src, args.dst)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {len(paths)} exercise notebook(s) to {args.dst}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
