"""Learner-facing text speaks about the course, never about how the course was made.

The lessons, exercises, solutions, README and CONTRIBUTING are read by learners, instructors and lab admins. Words
of the construction process (an issue or a tracker, a session, "being written", "until it is repeated", "an open
question", "the lead", "TODO later") tell the story of the project instead of teaching, and go stale the day they
are written. The verb "to issue" (a warp issues its loads) stays legal: the patterns match the noun's company."""
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

BANNED = {
    "an issue of a tracker": r"\b(?:the|this|that|an|open|closed|which|its|github)\s+issues?\b(?!\s+(?:its|their|a|one|each|the|loads?|stores?))",
    "an issue number": r"\bissues?\s*#\s*\d+",
    "the tracker": r"\btracker\b",
    "a work session": r"\b(?:this|that|the|earlier|previous|next|last|later|one|a developer's)\s+session(?:'s)?\b(?!\s+behind)",
    "work in progress": r"\b(?:being written|to be written|not yet written|work in progress|still being|coming soon)\b",
    "a pending result": r"\b(?:until (?:it is )?(?:repeated|measured|confirmed)|a hypothesis until|open question)\b",
    "who did it": r"\b(?:the lead(?:'s)?|the CEO|a developer's|the maintainers')\b",
    # "# TODO: ..." in an exercise is the learner's to-do and stays; a to-do of the authors' does not
    "a note to self": r"\b(?:TODO later|TODO \(later\)|FIXME|XXX)\b",
}
PATTERNS = {name: re.compile(rx, re.IGNORECASE) for name, rx in BANNED.items()}


def learner_files():
    files = [ROOT / "README.md", ROOT / "CONTRIBUTING.md"]
    files += sorted(p for d in ("notebooks", "solutions", "exercises") for p in (ROOT / d).glob("*.ipynb"))
    files += sorted((ROOT / "docs").rglob("*.md")) if (ROOT / "docs").is_dir() else []
    return [f for f in files if f.exists()]


def texts(path: Path):
    """(where, text) for each part of a file a reader sees: a notebook's cells (markdown and code), a page's lines."""
    if path.suffix == ".ipynb":
        nb = json.loads(path.read_text())
        for i, cell in enumerate(nb["cells"]):
            src = cell["source"]
            yield f"cell {i}", "".join(src) if isinstance(src, list) else src
    else:
        for i, line in enumerate(path.read_text().splitlines(), 1):
            yield f"line {i}", line


def findings(path: Path):
    out = []
    for where, text in texts(path):
        for name, rx in PATTERNS.items():
            for m in rx.finditer(text):
                lo, hi = max(0, m.start() - 40), m.end() + 40
                out.append(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name} {where}: "
                           f"{name}: ...{text[lo:hi]!r}...")
    return out


@pytest.mark.parametrize("path", learner_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_construction_vocabulary(path):
    found = findings(path)
    assert not found, "learner-facing text about how the course was made:\n" + "\n".join(found)


PLANTED = [
    "Lessons 09 and 10 are the newest; the issues in the tracker say what is still open.",
    "The target comes from the issue (14.1 in the issue).",
    "See issue #12 for the plan.",
    "engine.py, being written for lesson 09, will fuse these.",
    "The prediction stays a hypothesis until measured.",
    "This is missing until it is repeated on the card.",
    "Section 8's open question is answered later.",
    "From the lead's GPU engine run.",
    "Measured in an earlier session on the H200.",
    "TODO later: a faster version.",
]
LEGAL = [
    "Each warp issues its row's loads and then waits for all of them.",
    "The step takes as long as the CPU needs to **issue** it.",
    "A kernel that issues one load per thread.",
    "Start a JupyterLab session behind an SSH tunnel.",
    "The leading dimension of the matrix.",
    "    # TODO: the piece size from n and world; rank",      # an exercise's to-do for the learner
]


@pytest.mark.parametrize("line", PLANTED)
def test_a_planted_line_is_caught_in_a_notebook_and_a_page(tmp_path, line):
    nb = {"cells": [{"cell_type": "markdown", "metadata": {}, "source": ["# A lesson\n", "Some text. " + line]}],
          "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    (tmp_path / "lesson.ipynb").write_text(json.dumps(nb))
    (tmp_path / "README.md").write_text("# Course\n\n" + line + "\n")
    assert findings(tmp_path / "lesson.ipynb"), line
    assert findings(tmp_path / "README.md"), line


@pytest.mark.parametrize("line", LEGAL)
def test_the_verb_and_ordinary_words_stay_legal(tmp_path, line):
    (tmp_path / "page.md").write_text(line + "\n")
    assert not findings(tmp_path / "page.md"), line
