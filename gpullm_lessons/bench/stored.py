"""The course's stored measurements: runs on a reference GPU, shipped with the package for machines without one.

Each stored result is one JSON file in ``gpullm_lessons/results/``, named after what was measured and on which card
(``kernels_h100``, ``allreduce_h200x2``), and says itself where and when it was measured: ``"card"`` (the name the
driver reported) and ``"date"`` (ISO). Lessons show a stored result beside, or instead of, a live measurement, and
always say which one they show (``describe``).

Files are read through importlib.resources, so the package finds them wherever it is installed (a checkout, a
wheel, a zip).

    load(name)        the result stored as results/<name>.json (a dict), or None when the package has no such file
    require(name)     load, for a result that must be there (FileNotFoundError when it is not)
    names()           the names of the stored results, sorted
    describe(result)  one line naming the card and the date of a stored result
"""
from __future__ import annotations

import json
from importlib import resources
from typing import Optional

PACKAGE = "gpullm_lessons"
FOLDER = "results"


def _folder():
    """The results folder of the installed package (a Traversable: a directory, or a folder inside a zip)."""
    return resources.files(PACKAGE).joinpath(FOLDER)


def _check_name(name: str) -> str:
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or ".." in name:
        raise ValueError(f"not a stored result name: {name!r} (a bare name such as 'kernels_h100', "
                         f"without a folder or '..')")
    return name[:-len(".json")] if name.endswith(".json") else name


def load(name: str) -> Optional[dict]:
    """The result stored as results/<name>.json, a dict with at least "card" and "date"; None when there is no such
    file. A name with a folder in it, or "..", raises ValueError; so does a file that is not valid JSON."""
    name = _check_name(name)
    path = _folder().joinpath(f"{name}.json")
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"stored result {FOLDER}/{name}.json is not valid JSON: {e}") from e


def require(name: str) -> dict:
    """load(name) for a result the lessons cannot do without: a missing file is an incomplete installation and raises
    FileNotFoundError naming it."""
    result = load(name)
    if result is None:
        raise FileNotFoundError(f"gpullm_lessons/{FOLDER}/{_check_name(name)}.json is not in this installation")
    return result


def names() -> list[str]:
    """The names of the stored results (what load accepts), sorted."""
    folder = _folder()
    if not folder.is_dir():
        return []
    return sorted(p.name[:-len(".json")] for p in folder.iterdir() if p.is_file() and p.name.endswith(".json"))


def describe(result: dict) -> str:
    """One line saying which stored run `result` is: "the course's stored run on <card>, <date>"."""
    return f"the course's stored run on {result['card']}, {result['date']}"
