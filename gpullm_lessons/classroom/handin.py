"""Hand-in: a learner's notebooks copied into the lab's drop box, with the time; the instructor grades the latest.

    python -m gpullm_lessons submit [DIR] [--to DROPBOX] [--name NAME]
    python -m gpullm_lessons grade --class DROPBOX --dropbox [--deadline 2026-12-20T23:59+01:00] ...

The drop box is a folder the lab sets up (``GPULLM_DROPBOX``, or ``--to``): writable by the learners, readable by the
instructor (on a shared server: ``install -d -m 1733 -o instructor /srv/dropbox`` lets everyone create folders there
and no one read or remove another's). ``submit`` copies every ``*.ipynb`` of DIR (default: the current folder) into
``DROPBOX/NAME/<UTC time>/`` with ``handin.json`` (the learner, the time, each file's SHA-256); it never writes over
an earlier hand-in. ``grade --class DROPBOX --dropbox`` grades each learner's latest hand-in and writes ``handins.csv``
beside the gradebook (hand-ins per learner, the time of the graded one, late against ``--deadline``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import getpass
import hashlib
import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Optional

DROPBOX_ENV = "GPULLM_DROPBOX"
MANIFEST = "handin.json"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class HandInError(Exception):
    """What is wrong with a hand-in or a drop box, said in one line."""


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def submit(directory=".", dropbox=None, name: Optional[str] = None, now: Optional[dt.datetime] = None) -> Path:
    """Copy the notebooks of ``directory`` into ``dropbox/name/<time>/``; returns that folder."""
    directory = Path(directory)
    box = dropbox if dropbox is not None else os.environ.get(DROPBOX_ENV)
    if not box:
        raise HandInError(f"no drop box: pass --to DROPBOX or set {DROPBOX_ENV} (your lab tells you which folder)")
    box = Path(box)
    if not box.is_dir():
        raise HandInError(f"the drop box {box} does not exist (ask your instructor: it is made once for the class)")
    name = name or getpass.getuser()
    if not _NAME.match(name):
        raise HandInError(f"--name {name!r}: use letters, digits, '.', '_' or '-' (it names your folder in the box)")
    if not directory.is_dir():
        raise HandInError(f"no such directory: {directory} (the folder with your notebooks)")
    notebooks = sorted(p for p in directory.glob("*.ipynb") if p.is_file())
    if not notebooks:
        raise HandInError(f"no notebooks (*.ipynb) in {directory}: run submit in the folder you work in")
    when = now or _now()
    target = box / name / when.strftime("%Y%m%dT%H%M%S.%fZ")
    try:
        target.mkdir(parents=True, exist_ok=False)
    except FileExistsError:
        raise HandInError(f"{target} exists already: submit again") from None
    except PermissionError as e:
        raise HandInError(f"cannot write in the drop box {box}: {e.strerror} (ask your instructor)") from None
    files = {}
    for nb in notebooks:
        shutil.copyfile(nb, target / nb.name)
        files[nb.name] = hashlib.sha256(nb.read_bytes()).hexdigest()
    manifest = {"learner": name, "time": when.isoformat(), "files": files}
    (target / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    return target


def _time_of(folder: Path) -> Optional[dt.datetime]:
    try:
        return dt.datetime.fromisoformat(json.loads((folder / MANIFEST).read_text(encoding="utf-8"))["time"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def parse_deadline(text: str) -> dt.datetime:
    """An ISO date and time; without a zone it is the machine's local time."""
    try:
        when = dt.datetime.fromisoformat(text)
    except ValueError:
        raise HandInError(
            f"--deadline {text!r}: give an ISO date and time, e.g. 2026-12-20T23:59 or 2026-12-20T23:59+01:00"
        ) from None
    return when if when.tzinfo else when.astimezone()


def latest(dropbox, deadline: Optional[dt.datetime] = None) -> dict:
    """{learner: {"folder": the latest hand-in (None: none), "time", "handins": how many, "late": bool}} of every
    learner folder in the drop box (a hand-in without a readable handin.json is not counted)."""
    box = Path(dropbox)
    if not box.is_dir():
        raise HandInError(f"no such directory: {box} (the drop box)")
    out = {}
    for learner in sorted(p for p in box.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))):
        handins = sorted(((t, f) for f in learner.iterdir() if f.is_dir() and (t := _time_of(f)) is not None),
                         key=lambda tf: tf[0])  # fmt: skip
        if not handins:
            out[learner.name] = {"folder": None, "time": None, "handins": 0, "late": False}
            continue
        when, folder = handins[-1]
        out[learner.name] = {"folder": folder, "time": when.isoformat(), "handins": len(handins),
                             "late": bool(deadline is not None and when > deadline)}  # fmt: skip
    if not out:
        raise HandInError(f"no learner folders in the drop box {box}: nobody has submitted yet")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gpullm_lessons submit",
        description="Hand in your notebooks: copy them into the class's drop box.",
    )
    parser.add_argument("directory", nargs="?", default=".", help="the folder with your notebooks (default: here)")
    parser.add_argument("--to", metavar="DROPBOX", default=None, help=f"the drop box (default: ${DROPBOX_ENV})")
    parser.add_argument("--name", default=None, help="your name in the box (default: your login)")
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return 0 if e.code in (0, None) else 2
    try:
        target = submit(args.directory, args.to, args.name)
    except HandInError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    names = sorted(p.name for p in target.glob("*.ipynb"))
    print(f"handed in {len(names)} notebook(s) at {_time_of(target).isoformat()} to {target}:")
    print("".join(f"  {n}\n" for n in names), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
