"""Running the course for a class: each learner's own copy of the exercises, and one gradebook for the class.

``start DIR`` copies the course's exercise notebooks (``exercises/`` beside the installed package; it may be
read-only and shared by the whole lab) into a folder the learner owns. It never overwrites a notebook: on a folder
that already holds some of them it copies nothing, and ``--update`` copies only the exercises the folder lacks.
The copies are new files, so they get the learner's own permissions whatever the source's are.

``grade --class ROOT`` grades every learner's folder under ROOT (one subfolder per learner, named after them) with
the grader of ``classroom/grading.py``: each notebook in a fresh kernel, the tasks and checker calls from the instructor's
notebooks, a secret seed and a one-time token per call, ``--strict`` if asked. Notebooks run side by side
(``--workers``), each under its wall-clock limit (``--timeout``). The result is a gradebook (``--out``, default
``ROOT/gradebook``): ``gradebook.csv`` (one row per learner and task: status, points, the hint a wrong answer got,
the verdict), ``totals.csv`` (per learner), ``gradebook.json`` (all of it, with each notebook's run), and a summary
per task printed for the instructor: how many learners are correct, wrong, not attempted, in error, and the most
common hint of the wrong answers.

Besides the grader's statuses a row can be: "no notebooks" (the learner's folder has none), "missing" (it lacks
this notebook), "unreadable" (the notebook is not valid notebook JSON) or "timed out" (the notebook was stopped at
its timeout, or a cell ignored the interrupt, before the task's check ran). Each of these costs the task's point.
Folders whose name starts with "." or "_", and the gradebook folder, are not learners.
"""

from __future__ import annotations

import argparse
import collections
import csv
import dataclasses
import datetime
import fnmatch
import glob
import json
import os
import shlex
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Optional

from . import grading

GRADEBOOK = "gradebook"  # the default --out folder, inside ROOT
NO_NOTEBOOKS = "no notebooks"
MISSING = "missing"
UNREADABLE = "unreadable"
TIMED_OUT = "timed out"
# every status a gradebook row can have, in the order the tables list them
STATUS_ORDER = grading.STATUSES + (grading.NOT_RUN, TIMED_OUT, UNREADABLE, MISSING, NO_NOTEBOOKS)
SUMMARY_STATUSES = ("correct", "wrong", "not attempted", "error")  # always shown in the summary
# how the grader words a notebook it stopped (grading._grade_notebook and its runner's give_up)
_STOPPED = ("timeout after", "a cell ran past")
_HINT = grading.HINT


class ClassError(Exception):
    """A problem with what was asked (a folder missing or empty, a pattern matching nothing): said, not raised."""


def _fit(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


# --------------------------------------------------------------------------------------------------
# start: a learner's own copy of the exercises
# --------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class StartResult:
    directory: Path
    source: Path
    added: list  # notebook names copied now
    kept: list  # notebook names the folder already had (left as they were)


def course_exercises() -> Path:
    """The installed course's exercise notebooks (grading.course_exercises), or a ClassError naming where they were
    looked for."""
    try:
        return grading.course_exercises()
    except grading.CourseNotFound as e:
        raise ClassError(f"{e}; or name the exercises with --exercises DIR") from None


def start(directory, update: bool = False, source=None) -> StartResult:
    """Copy the exercise notebooks of ``source`` (default: the course's) into ``directory``, never over a file.

    Without ``update``, a folder that already has any of the notebooks is refused (ClassError) and nothing is
    copied. With ``update``, only the notebooks it lacks are copied; the others are kept byte for byte.
    """
    source = Path(source) if source is not None else course_exercises()
    if not source.is_dir():
        raise ClassError(f"no such directory: {source} (the exercise notebooks to copy)")
    names = sorted(p.name for p in source.glob("*.ipynb"))
    if not names:
        raise ClassError(f"no exercise notebooks (*.ipynb) in {source}")
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise ClassError(f"{directory} exists and is not a folder")
    present = [n for n in names if (directory / n).exists() or (directory / n).is_symlink()]
    if present and not update:
        shown = ", ".join(present[:3]) + (f" and {len(present) - 3} more" if len(present) > 3 else "")
        raise ClassError(
            f"{directory} already has {len(present)} of the exercise notebooks ({shown}): nothing was copied, "
            f"so no work is overwritten. To add only the exercises it does not have yet: "
            f"python -m gpullm_lessons start {shlex.quote(str(directory))} --update"
        )
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ClassError(f"cannot create {directory}: {e.strerror or e}") from None
    added, kept = [], list(present)
    for name in names:
        if name in present:
            continue
        try:
            # a new file ("x": never one that exists), written by the learner: their umask, not the source's mode
            with open(source / name, "rb") as src, open(directory / name, "xb") as dst:
                shutil.copyfileobj(src, dst)
        except FileExistsError:  # appeared since we looked: it is someone's work
            kept.append(name)
            continue
        except OSError as e:
            raise ClassError(f"cannot copy {source / name} to {directory}: {e.strerror or e}") from None
        added.append(name)
    return StartResult(directory, source, added, sorted(kept))


def start_main(argv=None) -> int:
    """``start DIR [--update] [--exercises DIR]``: exit 0 when the folder is ready, 2 (with the problem) if not."""
    parser = argparse.ArgumentParser(
        prog="python -m gpullm_lessons start",
        description="Copy the course's exercise notebooks into DIR, your own folder to work in. "
        "Never overwrites a notebook that is already there.",
    )
    parser.add_argument("directory", metavar="DIR", help="your folder for the exercises (created if missing)")
    parser.add_argument(
        "--update", action="store_true", help="copy only the exercises DIR does not have yet; keep every other one"
    )
    parser.add_argument(
        "--exercises",
        metavar="DIR",
        default=None,
        help="copy these notebooks instead (default: the course's exercise notebooks as installed)",
    )
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return 0 if e.code in (0, None) else 2
    try:
        result = start(args.directory, update=args.update, source=args.exercises)
    except ClassError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    where = shlex.quote(str(result.directory))
    if result.added:
        print(f"copied {len(result.added)} exercise notebook(s) from {result.source} to {result.directory}:")
        print("".join(f"  {n}\n" for n in result.added), end="")
    else:
        print(f"{result.directory} already has every exercise notebook of {result.source}: nothing added")
    if result.kept:
        print(f"kept {len(result.kept)} notebook(s) already there, untouched:")
        print("".join(f"  {n}\n" for n in result.kept), end="")
    print("next: open JupyterLab there and work through the notebooks")
    print(f"  {shlex.quote(sys.executable)} -m jupyter lab {where}")
    print(f"check your work any time with: python -m gpullm_lessons grade {where}")
    return 0


# --------------------------------------------------------------------------------------------------
# grade --class: the gradebook
# --------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Row:
    learner: str
    notebook: str
    task: str
    level: str
    status: str  # one of STATUS_ORDER
    points: int
    hint: str = ""  # the verdict's "hint: ..." part (what is probably wrong), if it has one
    message: str = ""  # the whole verdict, or why there is none


@dataclasses.dataclass
class Gradebook:
    root: str
    solutions: str
    learners: list  # names, sorted
    tasks: list  # (notebook, task label, level), in course order
    rows: list  # list[Row], learners in order, tasks in course order
    runs: list  # one dict per learner and notebook run: learner, notebook, seconds, failure, cell_errors
    strict: bool = False
    notebooks: Optional[list] = None  # the --notebooks patterns

    def totals(self) -> list[dict]:
        """Per learner: score, total (scored tasks), percent, and how many tasks have each status."""
        out = []
        for learner in self.learners:
            rows = [r for r in self.rows if r.learner == learner]
            score = sum(r.points for r in rows)
            total = sum(1 for r in rows if r.status not in grading.UNSCORED)
            counts = collections.Counter(r.status for r in rows)
            out.append(
                {
                    "learner": learner,
                    "score": score,
                    "total": total,
                    "percent": round(100.0 * score / total, 1) if total else 0.0,
                    **{s: counts.get(s, 0) for s in STATUS_ORDER},
                }
            )
        return out

    def summary(self) -> list[dict]:
        """Per task: how many learners have each status, and the most common hint (else verdict) of the wrong ones."""
        out = []
        for notebook, task, level in self.tasks:
            rows = [r for r in self.rows if r.notebook == notebook and r.task == task]
            counts = collections.Counter(r.status for r in rows)
            wrong = collections.Counter(r.hint or r.message for r in rows if r.status == "wrong")
            common, times = wrong.most_common(1)[0] if wrong else ("", 0)
            out.append(
                {
                    "notebook": notebook,
                    "task": task,
                    "level": level,
                    "counts": {s: counts.get(s, 0) for s in STATUS_ORDER},
                    "most_common_wrong": common,
                    "most_common_wrong_learners": times,
                }
            )
        return out

    def format(self) -> str:
        """The instructor's view: a line per task (learners per status), where wrong answers go, totals per learner."""
        summary = self.summary()
        shown = [s for s in STATUS_ORDER if s in SUMMARY_STATUSES or any(t["counts"][s] for t in summary)]
        task_w = min(max([len("task")] + [len(t["task"]) for t in summary]), 48)
        lv_w = max(len(s) for s in grading.LEVELS + ("level",))
        widths = [max(len(s), 3) for s in shown]
        header = f"{'task':<{task_w}}  {'level':<{lv_w}}  " + "  ".join(f"{s:>{w}}" for s, w in zip(shown, widths))
        n = len(self.learners)
        lines = [f"class of {n} learner{'s' if n != 1 else ''} in {self.root}: learners per status, per task", ""]
        lines += [header, "-" * len(header)]
        for t in summary:
            cells = "  ".join(f"{t['counts'][s]:>{w}}" for s, w in zip(shown, widths))
            lines.append(f"{_fit(t['task'], task_w):<{task_w}}  {t['level']:<{lv_w}}  {cells}")
        stuck = [t for t in summary if t["most_common_wrong"]]
        if stuck:
            lines += ["", "most common wrong answer per task (learners):"]
            for t in stuck:
                lines.append(f"  {t['task']} ({t['most_common_wrong_learners']}): {t['most_common_wrong'][:300]}")
        lines += ["", "per learner:"]
        name_w = min(max([len("learner")] + [len(t["learner"]) for t in self.totals()]), 40)
        for t in self.totals():
            others = ", ".join(f"{t[s]} {s}" for s in STATUS_ORDER if s != "correct" and t[s])
            lines.append(
                f"  {_fit(t['learner'], name_w):<{name_w}}  {t['score']:>3}/{t['total']:<3} "
                f"({t['percent']:.0f}%)" + (f"  {others}" if others else "")
            )
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "root": self.root,
            "solutions": self.solutions,
            "strict": self.strict,
            "notebooks": self.notebooks,
            "graded_at": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "learners": self.learners,
            "totals": self.totals(),
            "summary": self.summary(),
            "rows": [dataclasses.asdict(r) for r in self.rows],
            "runs": self.runs,
        }

    def write(self, out) -> list[Path]:
        """gradebook.csv, totals.csv and gradebook.json in ``out`` (created). Returns their paths."""
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        paths = [out / "gradebook.csv", out / "totals.csv", out / "gradebook.json"]
        fields = [f.name for f in dataclasses.fields(Row)]
        with open(paths[0], "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            writer.writerows(dataclasses.asdict(r) for r in self.rows)
        with open(paths[1], "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=["learner", "score", "total", "percent", *STATUS_ORDER])
            writer.writeheader()
            writer.writerows(self.totals())
        paths[2].write_text(json.dumps(self.to_dict(), indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        return paths


def _from_dropbox(dropbox, deadline_text):
    """(hand-ins per learner, a class folder whose learner folders are their latest hand-ins, linked)."""
    import tempfile

    from . import handin

    try:
        deadline = handin.parse_deadline(deadline_text) if deadline_text else None
        handins = handin.latest(dropbox, deadline)
    except handin.HandInError as e:
        raise ClassError(str(e)) from None
    root = Path(tempfile.mkdtemp(prefix="gpullm-handins-"))
    for learner, h in handins.items():
        if h["folder"] is None:
            (root / learner).mkdir()  # a folder with no notebooks: every task "no notebooks"
        else:
            (root / learner).symlink_to(Path(h["folder"]).resolve(), target_is_directory=True)
    return handins, root


def _write_handins(path: Path, handins: dict, deadline_text) -> Path:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["learner", "handins", "graded_handin_time", "late", "deadline"])
        for learner, h in handins.items():
            w.writerow([learner, h["handins"], h["time"] or "", "yes" if h["late"] else "no", deadline_text or ""])
    return path


def learner_dirs(root, out=None) -> list[Path]:
    """The learners' folders under ``root``: every subfolder but hidden ones, ones starting with "_" and ``out``
    (default ``root/gradebook``). Raises ClassError when ``root`` is missing or has no learner folder."""
    root = Path(root)
    if not root.is_dir():
        raise ClassError(f"no such directory: {root} (the class: one folder per learner)")
    skip = Path(out).resolve() if out is not None else (root / GRADEBOOK).resolve()
    found = sorted(
        p for p in root.iterdir() if p.is_dir() and not p.name.startswith((".", "_")) and p.resolve() != skip
    )
    if not found:
        raise ClassError(
            f"no learner folders in {root}: the class folder holds one folder per learner (its name is the "
            f"learner's), each made with python -m gpullm_lessons start {shlex.quote(str(root))}/NAME"
        )
    return found


def _row(learner: str, task: grading.Task, status: str, message: str, points: int = 0) -> Row:
    message = " ".join(str(message).split())
    hint = message.split(_HINT, 1)[1] if _HINT in message else ""
    return Row(learner, task.notebook, task.label, task.level, status, points, hint, message)


def _unreadable(path: Path) -> Optional[str]:
    """Why ``path`` cannot be read as a notebook, or None when it can."""
    import nbformat

    try:
        nbformat.read(str(path), as_version=4)
    except Exception as e:  # invalid JSON, not a notebook, undecodable bytes, unreadable file
        text = " ".join(str(e).split())[:200]
        return f"{path.name} cannot be read as a notebook ({type(e).__name__}: {text}); not graded"
    return None


def grade_class(
    root,
    *,
    out=None,
    timeout: float = 600,
    workers: int = 1,
    strict: bool = False,
    notebooks=None,
    solutions=None,
    kernel_name: str = "python3",
    progress: Optional[Callable[[str], None]] = None,
) -> Gradebook:
    """Grade every learner's folder under ``root`` against the instructor's notebooks (default: the course's
    exercise notebooks as installed, course_exercises()), ``workers`` notebooks at a time, each under ``timeout`` seconds. ``notebooks``: file-name
    patterns (fnmatch) of the notebooks to grade (default: all). Raises ClassError for a folder missing or empty,
    or patterns that match no instructor notebook. Nothing about a learner's notebooks raises: each gets a row."""
    root = Path(root)
    learners = learner_dirs(root, out)
    source = Path(solutions) if solutions is not None else course_exercises()
    if not source.is_dir():
        raise ClassError(f"no such directory: {source} (the instructor's notebooks)")
    names = [p.name for p in sorted(source.glob("*.ipynb"))]
    if notebooks:
        picked = [n for n in names if any(fnmatch.fnmatch(n, pattern) for pattern in notebooks)]
        if not picked:
            raise ClassError(f"--notebooks {' '.join(notebooks)} matches none of the notebooks in {source}")
        names = picked
    if not names:
        raise ClassError(f"no notebooks (*.ipynb) in {source} (the instructor's notebooks)")
    tasks: dict[str, list] = {}
    for name in names:
        try:
            tasks[name] = grading.find_tasks(source / name)
        except Exception as e:
            raise ClassError(
                f"cannot read the instructor's notebook {source / name}: {type(e).__name__}: {e}"
            ) from None
        unimported = [t for t in tasks[name] if not t.module]
        if unimported:
            raise ClassError(
                f"{source / name}: the checker {unimported[0].check} (cell {unimported[0].cell}) is not imported "
                "from a module; the grader calls checkers by module and name"
            )

    cells: dict[tuple, list] = {}  # (learner, notebook) -> rows
    runs: list = []
    jobs = []
    for folder in learners:
        learner = folder.name
        has_any = any(folder.glob("*.ipynb"))
        for name in names:
            path = folder / name
            if not has_any:
                why = f"no notebooks (*.ipynb) in {folder}"
                cells[learner, name] = [_row(learner, t, NO_NOTEBOOKS, why) for t in tasks[name]]
            elif not path.is_file():
                cells[learner, name] = [_row(learner, t, MISSING, f"{name} is not in {folder}") for t in tasks[name]]
            elif (why := _unreadable(path)) is not None:
                cells[learner, name] = [_row(learner, t, UNREADABLE, why) for t in tasks[name]]
                runs.append({"learner": learner, "notebook": name, "seconds": 0.0, "failure": why, "cell_errors": []})
            else:
                jobs.append((folder, name))

    def one(job):
        folder, name = job
        learner = folder.name
        try:
            report = grading.grade(
                folder,
                timeout=timeout,
                kernel_name=kernel_name,
                workers=1,
                solutions=source,
                strict=strict,
                notebooks=[glob.escape(name)],
            )
            run = report.notebook(name)
        except Exception as e:  # the grader itself failed on this notebook: the class run goes on
            why = f"the grader failed: {type(e).__name__}: {' '.join(str(e).split())[:300]}"
            rows = [_row(learner, t, grading.NOT_RUN, why) for t in tasks[name]]
            return rows, {"learner": learner, "notebook": name, "seconds": 0.0, "failure": why, "cell_errors": []}
        stopped = bool(run.failure) and run.failure.startswith(_STOPPED)
        results = {r.task: r for r in report.tasks}
        rows = []
        for t in tasks[name]:
            r = results.get(t.label)
            if r is None:  # cannot happen with the same instructor notebook; said rather than hidden
                rows.append(_row(learner, t, grading.NOT_RUN, "the grader returned no result for this task"))
                continue
            status = TIMED_OUT if stopped and r.status == grading.NOT_RUN else r.status
            rows.append(_row(learner, t, status, r.message, r.points))
        info = {
            "learner": learner,
            "notebook": name,
            "seconds": run.seconds,
            "failure": run.failure,
            "cell_errors": run.cell_errors,
        }
        if progress is not None:
            note = f" [{run.failure}]" if run.failure else ""
            progress(f"graded {learner}/{name}: {run.score}/{run.total} in {run.seconds:.1f}s{note}")
        return rows, info

    if workers > 1 and len(jobs) > 1:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            results = list(pool.map(one, jobs))
    else:
        results = [one(job) for job in jobs]
    for (folder, name), (rows, info) in zip(jobs, results):
        cells[folder.name, name] = rows
        runs.append(info)
    order = {(f.name, n): (i, j) for i, f in enumerate(learners) for j, n in enumerate(names)}
    runs.sort(key=lambda r: order[r["learner"], r["notebook"]])
    return Gradebook(
        root=str(root),
        solutions=str(source),
        learners=[f.name for f in learners],
        tasks=[(name, t.label, t.level) for name in names for t in tasks[name]],
        rows=[row for f in learners for name in names for row in cells[f.name, name]],
        runs=runs,
        strict=strict,
        notebooks=list(notebooks) if notebooks else None,
    )


def grade_main(argv=None) -> int:
    """``grade --class ROOT [--out DIR] [--workers N] [--timeout S] [--strict] [--notebooks PATTERN]
    [--solutions DIR] [--kernel NAME]``. Exit 0 when the class was graded (whatever the grades), 2 for bad usage
    (ROOT missing or without learner folders, a bad option), 1 when the gradebook could not be written."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "grade":
        argv = argv[1:]
    parser = argparse.ArgumentParser(
        prog="python -m gpullm_lessons grade",
        description="Grade every learner's folder under ROOT (one folder per learner, named after them) and write "
        "a gradebook: gradebook.csv (a row per learner and task), totals.csv, gradebook.json; then print, per "
        "task, how many learners are correct, wrong, not attempted or in error, and the most common wrong answer.",
    )
    parser.add_argument("--class", dest="root", metavar="ROOT", required=True, help="the class folder")
    parser.add_argument(
        "--out", metavar="DIR", default=None, help=f"where the gradebook goes (default: ROOT/{GRADEBOOK})"
    )
    parser.add_argument("--workers", type=int, default=1, metavar="N", help="notebooks graded at once (default: 1)")
    parser.add_argument(
        "--timeout", type=float, default=600.0, metavar="S", help="wall-clock seconds per notebook (default: 600)"
    )
    parser.add_argument(
        "--strict", action="store_true", help="run the instructor's notebook with only the learner's exercise cells"
    )
    parser.add_argument(
        "--notebooks",
        metavar="PATTERN",
        action="append",
        default=None,
        help="grade only the notebooks whose file name matches PATTERN (e.g. '03_*'; repeat for several)",
    )
    parser.add_argument(
        "--solutions",
        metavar="DIR",
        default=None,
        help="the instructor's notebooks (default: the course's exercise notebooks as installed)",
    )
    parser.add_argument(
        "--kernel",
        default="python3",
        metavar="NAME",
        help="Jupyter kernel (default: python3, the Python that runs the grader)",
    )
    parser.add_argument(
        "--dropbox",
        action="store_true",
        help="ROOT is a drop box (python -m gpullm_lessons submit): grade each learner's latest hand-in; the "
        "gradebook goes to ./gradebook unless --out says otherwise, with handins.csv",
    )
    parser.add_argument(
        "--deadline", default=None, metavar="TIME", help="with --dropbox: hand-ins after TIME (ISO) are marked late"
    )
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return 0 if e.code in (0, None) else 2
    if args.deadline and not args.dropbox:
        print("error: --deadline needs --dropbox (the times are those of the hand-ins)", file=sys.stderr)
        return 2
    bad = grading.run_options_error(args.timeout, args.workers)
    if bad:
        print(f"error: {bad}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else (Path(GRADEBOOK) if args.dropbox else Path(args.root) / GRADEBOOK)
    start_time = time.monotonic()
    handins, class_root = None, args.root
    try:
        if args.dropbox:
            handins, class_root = _from_dropbox(args.root, args.deadline)
        learner_dirs(class_root, out)  # a missing or empty class is said at once
        probe = out.resolve()  # and a gradebook that cannot be written, before an hour of grading (nothing made yet)
        while not probe.exists():
            probe = probe.parent
        if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
            raise ClassError(f"cannot write the gradebook to {out}: {probe} is not a folder you can write to")
        book = grade_class(
            class_root,
            out=out,
            timeout=args.timeout,
            workers=args.workers,
            strict=args.strict,
            notebooks=args.notebooks,
            solutions=args.solutions,
            kernel_name=args.kernel,
            progress=lambda line: print(line, file=sys.stderr, flush=True),
        )
    except ClassError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if handins is not None:
            shutil.rmtree(class_root, ignore_errors=True)  # the links to the hand-ins, not the hand-ins
    if handins is not None:
        book.root = str(args.root)
    print(book.format())
    if handins is not None:
        late = [name for name, h in handins.items() if h["late"]]
        none = [name for name, h in handins.items() if h["folder"] is None]
        print(
            f"\nhand-ins: {len(handins) - len(none)} of {len(handins)} learners"
            + (f"; late: {', '.join(late)}" if late else "")
            + (f"; none: {', '.join(none)}" if none else "")
        )
    try:
        paths = book.write(out)
        if handins is not None:
            paths.append(_write_handins(out / "handins.csv", handins, args.deadline))
    except OSError as e:
        print(f"error: cannot write the gradebook to {out}: {e.strerror or e}", file=sys.stderr)
        return 1
    print(f"\ngradebook written to {out}: " + ", ".join(p.name for p in paths))
    print(f"graded in {time.monotonic() - start_time:.0f}s", file=sys.stderr)
    return 0
