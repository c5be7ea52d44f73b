"""Grading: the grader runs each notebook in a fresh kernel, then makes its own checker calls there.

What counts
-----------
The list of tasks comes from the course's own exercise notebooks as installed with the package
(``course_exercises``: generated from ``solutions/``, the same checker calls without the answers; or the
instructor's ``--solutions DIR``), never from the notebook being graded, however the course was installed: every
top-level call ``check_xxx(...)`` in a code cell of that notebook is a task, labelled by its
``task="..."`` keyword (or ``xxx``), with the difficulty its markdown gives it (a line ``### Task 03.2 · core —
title``: ``warm-up``, ``core`` or ``stretch``).

A verdict counts only if the grader's own checker call produced it. The grader runs the learner's notebook top to
bottom in a fresh kernel (cells made only of checker calls are skipped: the grader makes those calls itself), then,
for each task, executes the course's checker call in that kernel with ``seed=`` set to a secret random number
drawn after the learner's cells ran and the checker looked up by name in its module (``gpullm_lessons.checks.backward`` ...),
not in the notebook. Its verdict comes back on the cell's output tagged with a one-time token. Whatever the
notebook printed, recorded (``record``) or defined (extra ``check_*`` calls, invented task labels) is ignored.

What it cannot stop: code that runs in the same kernel can still patch the checker module, the printing, or the
kernel itself before the grader's calls. ``strict=True`` (``--strict``) narrows that: the notebook that runs is the
instructor's, with only the cells that hold an exercise (a ``### BEGIN SOLUTION`` region in the instructor's
copy) taken from the learner's notebook, matched by cell id; every other cell the learner changed or added is
dropped. The learner's code in those cells still runs in the kernel: for a class where grades matter, run the
grader under a separate user or container per learner (see README, "Grading").

``record`` (called by every checker) appends the verdict to ``$GPULLM_GRADE_LOG`` when that is set; the grader no
longer reads it (it is kept for tools that watch a learner's own session) and never sets it for the kernel.

Failures: a cell's error costs only the tasks whose functions it should have defined; a cell that runs past the
cell timeout is interrupted and the notebook goes on; a kernel that dies is restarted and the notebook runs again
without the cell that killed it; a notebook past its total timeout is killed (subprocess and kernel) and its
tasks without a verdict are "not run".

CLI: ``python -m gpullm_lessons grade [DIR] [--solutions DIR] [--strict] [--notebooks PATTERN] [--json PATH]
[--timeout S] [--workers N]``.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import fnmatch
import json
import math
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Optional

LOG_ENV = "GPULLM_GRADE_LOG"
NOTEBOOK_ENV = "GPULLM_GRADE_NOTEBOOK"
STATUSES = ("correct", "wrong", "not attempted", "error", "skipped", "compiled")
# "skipped": the task needs a GPU and this machine has none. "compiled": a HIP task without a GPU: compiled for
# both vendors and linted, not run. Both are listed but left out of the total.
UNSCORED = ("skipped", "compiled")
NOT_RUN = "not run"
HINT = " hint: "  # a verdict's message is "...; seed S) hint: what is probably wrong", on one line
LEVELS = ("warm-up", "core", "stretch")
REPO_ROOT = Path(__file__).resolve().parents[2]  # the folder that holds the gpullm_lessons package
PACKAGED_EXERCISES = "course_exercises"  # the exercises/ folder as a wheel ships it (pyproject's package-dir)
TASK_LINE_RE = re.compile(r"^#+\s*Task\s+(?P<id>\d+\.\d+)\s*[·:\-]\s*(?P<level>warm-up|core|stretch)\b\s*[—–:-]*\s*"
                          r"(?P<title>.*)$", re.MULTILINE)
TASK_ID_RE = re.compile(r"^\s*(\d+\.\d+)\b")
_MAX_RESTARTS = 2  # a kernel that dies is restarted this often (without the cells that killed it)


# --------------------------------------------------------------------------------------------------
# record: called by checkers inside the learner's kernel (not counted by the grader)
# --------------------------------------------------------------------------------------------------
def record(check, task=None, status="error", message="") -> None:
    """Append one verdict as a JSON line to $GPULLM_GRADE_LOG; do nothing when it is unset. Never raises."""
    try:
        path = os.environ.get(LOG_ENV)
        if not path:
            return
        entry = {
            "check": str(check),
            "task": None if task is None else str(task),
            "status": str(status),
            "message": " ".join(str(message).split())[:2000],  # one line
        }
        notebook = os.environ.get(NOTEBOOK_ENV)
        if notebook:
            entry["notebook"] = notebook
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(entry, ensure_ascii=False) + "\n")
    except Exception:  # a grading hiccup must never break a learner's notebook
        pass


def _strip_check(name: str) -> str:
    return name[len("check_"):] if name.startswith("check_") else name


# --------------------------------------------------------------------------------------------------
# Static task discovery (in the instructor's notebook)
# --------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Task:
    notebook: str  # file name, e.g. "02_linear.ipynb"
    label: str  # unique within the notebook ("softmax_backward", "softmax_backward #2", "03.2 ...")
    check: str  # the checker called, e.g. "check_softmax_backward"
    key: str  # the task= literal, else the check name without check_
    cell: int  # index of the cell in the notebook (markdown cells count)
    line: int  # 1-based line of the call in the cell
    named: bool = False  # the label came from a task="..." literal
    call: str = ""  # the call's source text, as the instructor wrote it
    module: str = ""  # the module the checker is imported from ("" when the notebook does not import it)
    attr: str = ""  # the checker's name in that module
    level: str = ""  # "warm-up" | "core" | "stretch" | "" (no "### Task NN.k · level" line for it)
    title: str = ""  # the rest of that line, e.g. "warp-shuffle row reduction (HIP)"


def _strip_magics(source: str) -> str:
    """IPython magics (%, %%) and shell escapes (!) are not Python: replace those lines by ``pass``.

    ``%time STATEMENT`` keeps its statement (a checker call may be timed).
    """
    lines = []
    for line in source.split("\n"):
        stripped = line.lstrip()
        indent = line[: len(line) - len(stripped)]
        if stripped.startswith("%time ") and stripped[len("%time "):].strip():
            line = indent + stripped[len("%time "):].strip()
        elif stripped.startswith(("%", "!")):
            line = indent + "pass"
        lines.append(line)
    return "\n".join(lines)


def _call_name(call: ast.Call) -> str:
    func = call.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def _checker_calls(tree: ast.AST) -> list[ast.Call]:
    """Calls to ``check_*`` (plain or attribute) that run when the cell runs: calls inside function or class
    bodies are skipped (a checker defined in a notebook may call helpers named check_*)."""
    calls = []

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                continue
            if isinstance(child, ast.Call) and _call_name(child).startswith("check_"):
                calls.append(child)
            visit(child)

    visit(tree)
    return sorted(calls, key=lambda c: (c.lineno, c.col_offset))


def _imports(trees) -> dict[str, tuple[str, str]]:
    """name in the notebook -> (module, attribute) for ``from M import a as b`` / ``import M as m`` (attr "")."""
    names: dict[str, tuple[str, str]] = {}
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for a in node.names:
                    names[a.asname or a.name] = (node.module, a.name)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    names[a.asname or a.name.split(".")[0]] = (a.name if a.asname else a.name.split(".")[0], "")
    return names


def _resolve(call: ast.Call, names: dict) -> tuple[str, str]:
    """(module, attribute) of the checker a call refers to, or ("", "") when the notebook does not import it."""
    func = call.func
    if isinstance(func, ast.Name):
        module, attr = names.get(func.id, ("", ""))
        return (module, attr) if attr else ("", "")
    if isinstance(func, ast.Attribute):
        parts, node = [func.attr], func.value
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if isinstance(node, ast.Name) and node.id in names:
            module, attr = names[node.id]
            base = f"{module}.{attr}" if attr else module
            path = list(reversed(parts))
            return ".".join([base] + path[:-1]), path[-1]
    return "", ""


def task_kind(title: str) -> str:
    """What the learner writes, from the title's closing parentheses: "Numba", "HIP", "NumPy", ... or ""."""
    m = re.search(r"\(([^()]*)\)\s*$", title)
    return m.group(1).strip() if m else ""


def task_levels(nb) -> dict[str, tuple[str, str]]:
    """Task id ("03.2") -> (level, title), from the ``### Task 03.2 · core — title`` lines of markdown cells."""
    levels = {}
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for m in TASK_LINE_RE.finditer(cell.source):
                levels[m.group("id")] = (m.group("level"), m.group("title").strip())
    return levels


def _code_cells(nb):
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        source = cell.source if isinstance(cell.source, str) else "".join(cell.source)
        try:
            tree = ast.parse(_strip_magics(source))
        except SyntaxError:
            continue
        yield index, source, tree


def find_tasks(nb_path) -> list[Task]:
    """The graded tasks of an instructor's notebook, in order, found by parsing its code cells (nothing runs).

    A task is a call ``check_xxx(...)``; its label is the ``task="..."`` string literal if given, else ``xxx``.
    Cells that do not parse are skipped. A label seen again gets " #2", " #3", ... so labels are unique.
    """
    import nbformat

    nb_path = Path(nb_path)
    nb = nbformat.read(str(nb_path), as_version=4)
    cells = list(_code_cells(nb))
    names = _imports(tree for _, _, tree in cells)
    levels = task_levels(nb)
    tasks: list[Task] = []
    seen: dict[str, int] = {}
    for index, source, tree in cells:
        stripped = _strip_magics(source)
        for call in _checker_calls(tree):
            check = _call_name(call)
            key, named = _strip_check(check), False
            for kw in call.keywords:
                if kw.arg == "task" and isinstance(kw.value, ast.Constant) and isinstance(kw.value.value, str):
                    key, named = kw.value.value, True
            seen[key] = seen.get(key, 0) + 1
            label = key if seen[key] == 1 else f"{key} #{seen[key]}"
            module, attr = _resolve(call, names)
            m = TASK_ID_RE.match(key)
            level, title = levels.get(m.group(1), ("", "")) if m else ("", "")
            tasks.append(Task(nb_path.name, label, check, key, index, call.lineno, named,
                              ast.get_source_segment(stripped, call) or "", module, attr, level, title))
    return tasks


def checker_only_cells(nb) -> set[int]:
    """Indices of code cells made only of top-level checker calls (``check_x(...);`` lines): the grader skips
    them in the learner's notebook and makes the calls itself."""
    skip = set()
    for index, _, tree in _code_cells(nb):
        body = tree.body
        if body and all(isinstance(s, ast.Expr) and isinstance(s.value, ast.Call)
                        and _call_name(s.value).startswith("check_") for s in body):
            skip.add(index)
    return skip


def exercise_cell_ids(nb) -> set[str]:
    """Ids of the cells that hold an exercise (what --strict takes from the learner): in an instructor's notebook
    the cells with a solution region, in the course's exercise notebooks the cells where one was cut out."""
    from .exercises import BEGIN_RE, RAISE_LINE

    ids = set()
    for cell in nb.cells:
        lines = cell.source.split("\n") if cell.cell_type == "code" else []
        if any(BEGIN_RE.match(line) or line.strip() == RAISE_LINE for line in lines):
            ids.add(cell.get("id"))
    return ids - {None}


# --------------------------------------------------------------------------------------------------
# The grader's own checker calls
# --------------------------------------------------------------------------------------------------
def grader_call(task: Task, seed: int, token: str) -> str:
    """The code of the cell that makes ``task``'s checker call in the learner's kernel and prints its verdict on
    one line that starts with ``token``. The checker is taken from its module, never from the notebook's names;
    ``seed`` replaces any seed the call had, ``quiet=True`` and the task label are set."""
    tree = ast.parse(task.call, mode="eval")
    call = tree.body
    call.func = ast.Name(id="__gpullm_checker", ctx=ast.Load())
    call.keywords = [kw for kw in call.keywords if kw.arg not in ("seed", "quiet", "task")] + [
        ast.keyword(arg="seed", value=ast.Constant(seed)), ast.keyword(arg="quiet", value=ast.Constant(True)),
        ast.keyword(arg="task", value=ast.Constant(task.key))]
    expr = ast.unparse(ast.fix_missing_locations(tree))
    return f'''\
def __gpullm_grade():
    import importlib, json, sys
    out = {{"status": "error", "message": ""}}
    try:
        __gpullm_checker = getattr(importlib.import_module({task.module!r}), {task.attr!r})
    except Exception as exc:
        out["message"] = "the grader could not import its checker {task.module}.{task.attr}: " + repr(exc)
    else:
        try:
            r = {expr}
            out = {{"status": str(getattr(r, "status", "")), "message": str(getattr(r, "message", ""))}}
        except NameError as exc:
            out = {{"status": "{NOT_RUN}", "message": "the notebook does not define " + repr(getattr(exc, "name", None) or str(exc))
                   + " by the end (its cell failed, was not run, or renamed it)"}}
        except Exception as exc:
            out = {{"status": "error", "message": "the checker call failed: " + type(exc).__name__ + ": " + str(exc)}}
    print({token!r} + json.dumps(out), flush=True)
__gpullm_grade()
del __gpullm_grade
'''


# Run once before the grader's calls: drop the IPython hooks and tracers the notebook may have installed.
_CLEANUP = '''\
def __gpullm_cleanup():
    import builtins, sys
    ip = get_ipython()
    for name in ("pre_run_cell", "post_run_cell", "pre_execute", "post_execute"):
        ip.events.callbacks[name] = [f for f in ip.events.callbacks.get(name, []) if getattr(f, "__module__", "")
                                     .startswith(("IPython", "ipykernel", "matplotlib", "matplotlib_inline"))]
    ip.input_transformers_post[:] = []
    sys.settrace(None)
    sys.setprofile(None)
    sys.stdout.flush()
__gpullm_cleanup()
del __gpullm_cleanup
'''


# --------------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class TaskResult:
    notebook: str
    task: str
    status: str  # one of STATUSES, or "not run"
    points: int  # 1 if correct else 0
    message: str = ""
    check: str = ""
    level: str = ""


@dataclasses.dataclass
class NotebookResult:
    notebook: str
    score: int
    total: int
    failure: Optional[str]  # None when every cell ran; else "timeout after 600s", "kernel died", ...
    seconds: float
    cell_errors: list = dataclasses.field(default_factory=list)  # "cell 4: NameError: ..." for each error


def _pct(score: int, total: int) -> str:
    return f"{100 * score / total:.0f}%" if total else "0%"


def _fit(text: str, width: int) -> str:
    text = str(text)
    return text if len(text) <= width else text[: width - 3] + "..."


@dataclasses.dataclass
class Report:
    tasks: list  # list[TaskResult], notebooks in sorted order, tasks in notebook order
    notebooks: list  # list[NotebookResult]
    directory: str = ""

    @property
    def score(self) -> int:
        return sum(t.points for t in self.tasks)

    @property
    def total(self) -> int:
        return sum(1 for t in self.tasks if t.status not in UNSCORED)

    @property
    def percent(self) -> float:
        return 100.0 * self.score / self.total if self.total else 0.0

    def notebook(self, name: str) -> NotebookResult:
        return next(n for n in self.notebooks if n.notebook == name)

    def task(self, notebook: str, label: str) -> TaskResult:
        return next(t for t in self.tasks if t.notebook == notebook and t.task == label)

    def by_level(self) -> dict[str, tuple[int, int]]:
        """level -> (score, total), for the levels that have scored tasks."""
        out = {}
        for level in LEVELS + ("",):
            rows = [t for t in self.tasks if t.level == level and t.status not in UNSCORED]
            if rows:
                out[level or "unlevelled"] = (sum(t.points for t in rows), len(rows))
        return out

    def format(self) -> str:
        """Fixed-width table: one row per task, then a line per notebook, per difficulty, and the total."""
        nb_w = min(max([len("notebook")] + [len(t.notebook) for t in self.tasks]), 48)
        task_w = min(max([len("task")] + [len(t.task) for t in self.tasks]), 44)
        st_w = max([len("status")] + [len(s) for s in STATUSES + (NOT_RUN,)])
        lv_w = max(len(s) for s in LEVELS + ("level",))
        header = f"{'notebook':<{nb_w}}  {'task':<{task_w}}  {'level':<{lv_w}}  {'status':<{st_w}}  pts  message"
        lines = [header, "-" * len(header)]
        indent = " " * (nb_w + task_w + lv_w + st_w + 13)  # under the message column
        for t in self.tasks:
            message, _, hint = t.message.partition(HINT)
            lines.append(f"{_fit(t.notebook, nb_w):<{nb_w}}  {_fit(t.task, task_w):<{task_w}}  {t.level:<{lv_w}}  "
                         f"{t.status:<{st_w}}  {t.points:>3}  {_fit(message, 100)}".rstrip())
            if hint:  # the hint whole, under its message: it says what is probably wrong
                lines += textwrap.wrap("hint: " + hint, 100, initial_indent=indent, subsequent_indent=indent + "  ")
        lines.append("")
        for n in self.notebooks:
            note = f"  [{n.failure}]" if n.failure else ""
            lines.append(f"{n.notebook}: {n.score}/{n.total} ({_pct(n.score, n.total)}){note}")
        levels = self.by_level()
        if levels:
            lines.append("by difficulty: " + ", ".join(f"{lv} {s}/{t}" for lv, (s, t) in levels.items()))
        notes = []
        compiled = sum(1 for t in self.tasks if t.status == "compiled")
        skipped = sum(1 for t in self.tasks if t.status == "skipped")
        if compiled:
            notes.append(f"{compiled} HIP task{'s' if compiled != 1 else ''} compiled for both vendors and "
                         f"linted, not run: no GPU")
        if skipped:
            notes.append(f"{skipped} task{'s' if skipped != 1 else ''} skipped: need a GPU")
        note = f"  ({'; '.join(notes)})" if notes else ""
        lines.append(f"score: {self.score}/{self.total} ({_pct(self.score, self.total)}){note}")
        return "\n".join(lines)

    __str__ = format

    def to_dict(self) -> dict:
        return {
            "directory": self.directory,
            "score": self.score,
            "total": self.total,
            "percent": round(self.percent, 1),
            "by_level": {k: {"score": s, "total": t} for k, (s, t) in self.by_level().items()},
            "notebooks": [dataclasses.asdict(n) for n in self.notebooks],
            "tasks": [dataclasses.asdict(t) for t in self.tasks],
        }

    def to_json(self, path) -> None:
        path = Path(path)
        if path.parent != Path(""):
            path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


# --------------------------------------------------------------------------------------------------
# Reading a run's log
# --------------------------------------------------------------------------------------------------
def _read_log(path: Path) -> list[dict]:
    entries = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    entry = json.loads(line)
                except ValueError:  # a line cut short by a kill
                    continue
                if isinstance(entry, dict):
                    entries.append(entry)
    except FileNotFoundError:
        pass
    return entries


def results_from_log(tasks: list[Task], entries: list[dict], notebook: str, *, stop_reason: Optional[str] = None
                     ) -> tuple[list[TaskResult], list[str]]:
    """Each task's verdict from the runner's log: only ``verdict`` events, which the runner writes from the
    output of the grader's own calls. Tasks without one are "not run" with the reason. Returns (results, cell
    errors)."""
    verdicts: dict[str, dict] = {}
    cell_errors: dict[int, str] = {}
    for e in entries:
        event = e.get("_event")
        if event == "verdict":
            verdicts[str(e.get("task"))] = e
        elif event == "cell_error":
            cell_errors.setdefault(e.get("cell"), f"{e.get('ename')}: {' '.join(str(e.get('evalue')).split())}")
        elif event == "cell_timeout":
            cell_errors.setdefault(e.get("cell"), f"interrupted after {e.get('seconds')}s (cell timeout)")
        elif event == "kernel_died":
            cell_errors.setdefault(e.get("cell"), "the kernel died in this cell (it was skipped on the rerun)")
    errors = [f"cell {c}: {msg}" for c, msg in sorted(cell_errors.items(), key=lambda kv: (kv[0] is None, kv[0]))]
    results = []
    for t in tasks:
        v = verdicts.get(t.label)
        if v is not None:
            status = str(v.get("status"))
            message = str(v.get("message", ""))
            if status == NOT_RUN and errors:
                message += f" (cell errors: {'; '.join(errors)[:300]})"
            results.append(TaskResult(notebook, t.label, status, int(status == "correct"), message, t.check,
                                      t.level))
            continue
        reason = stop_reason or "no verdict: the grader's call did not run"
        results.append(TaskResult(notebook, t.label, NOT_RUN, 0, reason, t.check, t.level))
    return results, errors


# --------------------------------------------------------------------------------------------------
# Running one notebook in a subprocess, with a kill switch
# --------------------------------------------------------------------------------------------------
def _descendants(pid: int) -> list[int]:
    """All processes below ``pid`` (Linux /proc; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
            ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(name))
    result, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            result.append(child)
            todo.append(child)
    return result


def _kill(pids) -> None:
    """SIGKILL each process and its process group (never our own group)."""
    own = os.getpgrp()
    for pid in pids:
        if not pid:
            continue
        try:
            pgid = os.getpgid(pid)
            if pgid != own:
                os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError, OSError):
            pass
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError, OSError):
            pass


def _kernel_pids(entries: list[dict]) -> list[int]:
    return [int(e["pid"]) for e in entries if e.get("_event") == "kernel" and e.get("pid")]


def _child_env(nb_name: str) -> dict:
    env = os.environ.copy()
    env.pop(LOG_ENV, None)  # the kernel is never told where the grader's log is
    env[NOTEBOOK_ENV] = nb_name
    # the runner and the kernel import gpullm_lessons from this very tree
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")  # quiet debugpy warning in the kernel's stderr
    return env


def compose_strict(instructor_nb, learner_nb):
    """The notebook --strict runs: the instructor's cells, except that each cell holding a solution region is
    replaced by the learner's cell with the same id (kept as the instructor's when the learner has none)."""
    import copy
    ids = exercise_cell_ids(instructor_nb)
    mine = {c.get("id"): c for c in learner_nb.cells if c.cell_type == "code"}
    out = copy.deepcopy(instructor_nb)
    missing = []
    for i, cell in enumerate(out.cells):
        if cell.get("id") in ids:
            if cell.get("id") in mine:
                cell["source"] = mine[cell.get("id")].source
            else:
                missing.append(i)
                cell["source"] = "raise NotImplementedError('this exercise cell is missing from your notebook')"
    return out, missing


def _grade_notebook(nb_path: Path, tasks: list[Task], workdir: Path, timeout: float, kernel_name: str,
                    cell_timeout: Optional[float], strict_source: Optional[Path]) -> tuple[list[TaskResult], NotebookResult]:
    name = nb_path.name
    start = time.monotonic()
    log = workdir / (nb_path.stem + ".jsonl")
    plan = workdir / (nb_path.stem + ".plan.json")
    errfile = workdir / (nb_path.stem + ".stderr")
    token = "@@gpullm-verdict-" + secrets.token_hex(16) + "@@"
    plan.write_text(json.dumps({
        "token": token,
        "calls": [{"task": t.label, "module": t.module, "attr": t.attr, "call": t.call, "key": t.key,
                   "check": t.check} for t in tasks],
        "strict_source": str(strict_source) if strict_source else None,
    }), encoding="utf-8")
    cell_timeout = cell_timeout if cell_timeout else max(1.0, timeout / 2)
    cmd = [sys.executable, "-m", "gpullm_lessons.classroom.grading", "_run", str(nb_path.resolve()), str(log), str(plan),
           "--kernel", kernel_name, "--cell-timeout", str(cell_timeout)]
    stop_reason = None
    with open(errfile, "wb") as err:
        proc = subprocess.Popen(cmd, cwd=str(nb_path.resolve().parent), env=_child_env(name),
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                start_new_session=True)  # own process group: killable as a whole
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            # the kernel runs in a session of its own (jupyter_client starts it so): kill it by its pid
            victims = _descendants(proc.pid) + _kernel_pids(_read_log(log))
            _kill([proc.pid] + victims)
            proc.wait()
            rc = None
            stop_reason = f"timeout after {timeout:g}s"
    entries = _read_log(log)
    events = {e.get("_event") for e in entries}
    if rc is not None and "done" not in events:
        _kill(_kernel_pids(entries))  # the runner stopped early: make sure no kernel outlives it
        msgs = [e.get("message") for e in entries if e.get("_event") in ("runner_error", "gave_up")]
        if not msgs:
            tail = errfile.read_text(errors="replace").strip().splitlines()
            msgs = [tail[-1] if tail else f"exit code {rc}"]
        stop_reason = msgs[-1] if any(e.get("_event") == "gave_up" for e in entries) else f"grader failed: {msgs[-1]}"
    results, errors = results_from_log(tasks, entries, name, stop_reason=stop_reason)
    score = sum(r.points for r in results)
    total = sum(1 for r in results if r.status not in UNSCORED)
    if stop_reason is None and any(e.get("_event") == "kernel_died" for e in entries):
        stop_reason = "kernel died (restarted without the cell that killed it)"
    return results, NotebookResult(name, score, total, stop_reason, round(time.monotonic() - start, 2), errors)


class CourseNotFound(FileNotFoundError):
    """The course's own exercise notebooks are not installed where the package looks: said, with the fix."""


def course_exercises() -> Path:
    """The course's exercise notebooks as installed with the package: the task list of every grade (their checker
    calls are the solutions' own: exercises/ is generated from solutions/, without the answers) and what ``start``
    copies. A wheel, the container and a shared install carry them inside the package (``course_exercises/``); a
    checkout has them in ``exercises/`` beside the package. Never the folder being graded. CourseNotFound names both
    places when neither has them."""
    import importlib.resources

    packaged = Path(str(importlib.resources.files("gpullm_lessons"))) / PACKAGED_EXERCISES
    if any(packaged.glob("*.ipynb")):
        return packaged
    checkout = REPO_ROOT / "exercises"
    if (REPO_ROOT / "pyproject.toml").is_file() and any(checkout.glob("*.ipynb")):
        return checkout
    raise CourseNotFound(
        f"the course's exercise notebooks are missing from this installation: neither {packaged} nor {checkout} "
        "holds any *.ipynb. Reinstall the course (pip install gpullm-lessons from its wheel, or pip install -e . in "
        "its folder), or name the instructor's notebooks with --solutions DIR"
    )


def _instructor_dir(directory: Path, solutions) -> Path:
    """Where the task list comes from: --solutions DIR, else the course's installed exercises (never ``directory``,
    the notebooks being graded)."""
    return Path(solutions) if solutions is not None else course_exercises()


def grade(directory="exercises", timeout: float = 600, kernel_name: str = "python3", workers: int = 1,
          cell_timeout: Optional[float] = None, progress: Optional[Callable[[str], None]] = None,
          solutions=None, strict: bool = False, notebooks=None) -> Report:
    """Grade every notebook of ``directory`` against the instructor's notebooks of the same name.

    solutions: the instructor's folder (default: the course's exercise notebooks as installed with the package,
    ``course_exercises()``: the solutions' checker calls without the answers). A notebook that folder lacks is listed
    with no task; one
    the learner lacks costs its tasks. timeout: wall-clock seconds per notebook (kernel start included); on expiry
    the notebook's subprocess and kernel are killed. cell_timeout: seconds per cell before it is interrupted
    (default: timeout / 2). workers: notebooks graded at once. strict: run the instructor's notebook with only
    the learner's exercise cells (see the module docstring). notebooks: file-name patterns (``fnmatch``, e.g.
    ``["01_*", "12_*"]``); only the notebooks that match one are graded or listed (default: all).
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"no such directory: {directory}")
    source_dir = _instructor_dir(directory, solutions)
    if not source_dir.is_dir():
        raise FileNotFoundError(f"no such directory: {source_dir} (the instructor's notebooks)")
    instructor = {p.name: p for p in sorted(source_dir.glob("*.ipynb"))}
    learner = {p.name: p for p in sorted(directory.glob("*.ipynb"))}
    names = sorted(set(instructor) | set(learner))
    if notebooks is not None:
        names = [n for n in names if any(fnmatch.fnmatch(n, pattern) for pattern in notebooks)]
    with tempfile.TemporaryDirectory(prefix="gpullm-grade-") as tmp:
        def one(name):
            if name not in instructor:
                out = ([], NotebookResult(name, 0, 0, f"not a course notebook (no {name} in {source_dir}): "
                                                      "not graded", 0.0))
            else:
                try:
                    tasks = find_tasks(instructor[name])
                except Exception as e:
                    return [], NotebookResult(name, 0, 0, f"unreadable instructor notebook: {type(e).__name__}: {e}",
                                              0.0)
                bad = [t for t in tasks if not t.module]
                if bad:
                    raise ValueError(f"{instructor[name]}: the checker {bad[0].check} (cell {bad[0].cell}) is not "
                                     f"imported from a module; the grader calls checkers by module and name")
                if name not in learner:
                    rows = [TaskResult(name, t.label, NOT_RUN, 0, "notebook missing", t.check, t.level)
                            for t in tasks]
                    out = (rows, NotebookResult(name, 0, len(rows), "notebook missing", 0.0))
                else:
                    out = _grade_notebook(learner[name], tasks, Path(tmp), timeout, kernel_name, cell_timeout,
                                          instructor[name] if strict else None)
            if progress is not None:
                n = out[1]
                note = f" [{n.failure}]" if n.failure else ""
                progress(f"graded {n.notebook}: {n.score}/{n.total} in {n.seconds:.1f}s{note}")
            return out

        if workers > 1 and len(names) > 1:
            with ThreadPoolExecutor(max_workers=workers) as pool:
                outs = list(pool.map(one, names))
        else:
            outs = [one(n) for n in names]
    tasks = [r for results, _ in outs for r in results]
    return Report(tasks, [n for _, n in outs], str(directory))


# --------------------------------------------------------------------------------------------------
# The runner: executes one notebook and the grader's calls (inside the subprocess that grade() starts)
# --------------------------------------------------------------------------------------------------
def _verdict_from_outputs(outputs, token: str) -> dict:
    lines = []
    for out in outputs:
        if out.get("output_type") == "stream":
            lines += [ln for ln in out.get("text", "").splitlines() if ln.startswith(token)]
    if len(lines) != 1:
        return {"status": "error", "message": f"the grader's check printed {len(lines)} verdicts instead of one "
                                              "(the notebook changed how output is printed?)"}
    try:
        v = json.loads(lines[0][len(token):])
    except ValueError:
        return {"status": "error", "message": "the grader's verdict line was cut"}
    status = str(v.get("status"))
    if status not in STATUSES + (NOT_RUN,):
        return {"status": "error", "message": f"the checker returned status {status!r}"}
    return {"status": status, "message": " ".join(str(v.get("message", "")).split())[:2000]}


def _kernel_manager(kernel_name: str, workdir: Path):
    """The manager of one kernel. Where there are Unix sockets its channels are socket files in a folder of their
    own (zmq's ipc transport), not TCP ports: over TCP, jupyter_client picks a free port in this process and the
    kernel binds it a moment later, so kernels started side by side by separate runners (--workers) now and then get
    the same port, and one dies or hangs at startup ("Address already in use")."""
    from jupyter_client.manager import AsyncKernelManager

    own = {"kernel_spec_manager": _own_python_specs()} if kernel_name == OWN_KERNEL else {}
    if os.name == "nt":
        return AsyncKernelManager(kernel_name=kernel_name, **own)
    folder = tempfile.mkdtemp(prefix="k", dir=workdir)  # short: a socket path is limited to about 100 bytes
    return AsyncKernelManager(kernel_name=kernel_name, transport="ipc", ip=os.path.join(folder, "ipc"), **own)


OWN_KERNEL = "python3"
"""The default kernel: the Python that runs the grader (the course's own installation), not whatever kernel spec of
that name Jupyter finds first (a user's ~/.local/share/jupyter/kernels/python3 may start another Python, with
another copy of the course or none). Name any other kernel with --kernel to use its spec."""


def _own_python_specs():
    """A kernel spec manager whose "python3" is ipykernel's kernel on this interpreter (sys.executable)."""
    from ipykernel.kernelspec import get_kernel_dict
    from jupyter_client.kernelspec import KernelSpec, KernelSpecManager

    class OwnPython(KernelSpecManager):
        def get_kernel_spec(self, kernel_name):
            if kernel_name == OWN_KERNEL:
                return KernelSpec(resource_dir="", **get_kernel_dict())
            return super().get_kernel_spec(kernel_name)

    return OwnPython()


def _run(nb_path: str, log_path: str, plan_path: str, kernel_name: str = "python3",
         cell_timeout: Optional[float] = None) -> int:
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import DeadKernelError

    def event(kind: str, **fields) -> None:
        with open(log_path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"_event": kind, **fields, "t": round(time.time(), 3)}, ensure_ascii=False) + "\n")

    nb_path = Path(nb_path).resolve()
    try:
        plan = json.loads(Path(plan_path).read_text(encoding="utf-8"))
        Path(plan_path).unlink()  # the kernel never gets to read it
        token = plan["token"]
        nb = nbformat.read(str(nb_path), as_version=4)
        if plan.get("strict_source"):
            nb, missing = compose_strict(nbformat.read(plan["strict_source"], as_version=4), nb)
            for i in missing:
                event("cell_error", cell=i, ename="MissingCell", evalue="this exercise cell is not in your notebook")
        skip = checker_only_cells(nb)
        calls = plan["calls"]
        timeout = max(1, math.ceil(cell_timeout)) if cell_timeout else None
        dead: set[int] = set()
        done: set[str] = set()
        for attempt in range(_MAX_RESTARTS + 1):
            client = NotebookClient(nb, km=_kernel_manager(kernel_name, Path(log_path).parent), timeout=None,
                                    kernel_name=kernel_name, allow_errors=True,
                                    record_timing=False, shutdown_kernel="immediate",
                                    resources={"metadata": {"path": str(nb_path.parent)}})
            died = False
            with client.setup_kernel():
                kernel_pid = getattr(getattr(client.km, "provisioner", None), "pid", None)
                event("kernel", pid=kernel_pid)

                def give_up():
                    event("gave_up", message=f"a cell ran past {timeout}s and did not stop when interrupted")
                    _kill([kernel_pid] + (_descendants(kernel_pid) if kernel_pid else []))
                    os._exit(1)

                def execute(cell, index) -> str:
                    """'ok', 'died' or 'timeout' (interrupted at the cell timeout). A cell that ignores the
                    interrupt for another cell timeout ends the run (give_up). nbclient's own timeout is not used:
                    after it, the timed-out cell's output reader swallows the next cells' outputs."""
                    fired = threading.Event()

                    def interrupt():
                        fired.set()
                        try:
                            os.kill(kernel_pid, signal.SIGINT)
                        except (TypeError, OSError):
                            pass

                    timers = [threading.Timer(timeout, interrupt), threading.Timer(2 * timeout, give_up)] \
                        if timeout else []
                    for t in timers:
                        t.daemon = True
                        t.start()
                    try:
                        client.execute_cell(cell, index)
                    except DeadKernelError:
                        return "died"
                    finally:
                        for t in timers:
                            t.cancel()
                    return "timeout" if fired.is_set() else "ok"

                for index, cell in enumerate(nb.cells):
                    if cell.cell_type != "code" or not cell.source.strip() or index in skip or index in dead:
                        continue
                    if attempt == 0:
                        event("cell", cell=index)
                    state = execute(cell, index)
                    if state == "died":
                        event("kernel_died", cell=index)
                        dead.add(index)
                        died = True
                        break
                    if state == "timeout":
                        event("cell_timeout", cell=index, seconds=timeout)
                        continue
                    if attempt == 0:
                        for out in cell.get("outputs", []):
                            if out.get("output_type") == "error":
                                event("cell_error", cell=index, ename=out.get("ename"),
                                      evalue=str(out.get("evalue"))[:500])
                                break
                if not died:
                    execute(nbformat.v4.new_code_cell(_CLEANUP), -1)
                    for c in calls:
                        if c["task"] in done:
                            continue
                        task = Task("", c["task"], c["check"], c["key"], 0, 0, True, c["call"], c["module"],
                                    c["attr"])
                        cell = nbformat.v4.new_code_cell(grader_call(task, secrets.randbelow(2**31 - 1), token))
                        state = execute(cell, -1)
                        if state == "died":
                            verdict = {"status": "error", "message": "the kernel died during this check"}
                        elif state == "timeout":
                            verdict = {"status": "error", "message": f"the check did not finish in {timeout}s"}
                        else:
                            verdict = _verdict_from_outputs(cell.get("outputs", []), token)
                        event("verdict", task=c["task"], **verdict)
                        done.add(c["task"])
                        if state == "died":
                            died = True
                            break
            if not died:
                break
        else:
            event("gave_up", message="kernel died (too many times)")
            return 1
    except Exception as e:  # kernel failed to start, unreadable notebook, ...
        event("runner_error", message=f"{type(e).__name__}: {' '.join(str(e).split())[:500]}")
        return 1
    event("done")
    return 0


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------
def run_options_error(timeout: float, workers: int):
    """What is wrong with a grading run's --timeout / --workers (None when both are fine): one learner or a class."""
    if not timeout > 0:
        return f"--timeout must be a positive number of seconds, got {timeout:g}"
    if workers < 1:
        return f"--workers must be at least 1, got {workers}"
    return None


def main(argv=None) -> int:
    """``grade [DIR] [--solutions DIR] [--strict] [--notebooks PATTERN] [--json PATH] [--timeout S] [--workers N]
    [--kernel NAME]``.

    Exit 0 whenever a report is produced (whatever the score), 2 for bad arguments or a missing directory.
    A leading "grade" word is accepted, so both ``main(["grade", "exercises"])`` and ``main(["exercises"])`` work.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "grade":
        argv = argv[1:]
    parser = argparse.ArgumentParser(
        prog="python -m gpullm_lessons grade",
        description="Run each notebook of DIR in a fresh kernel, then the instructor's checker calls in it, "
                    "and report their verdicts.")
    parser.add_argument("directory", nargs="?", default="exercises", help="folder of notebooks (default: exercises)")
    parser.add_argument("--solutions", metavar="DIR", default=None,
                        help="the instructor's notebooks: the tasks and the checker calls (default: the course's "
                             "exercise notebooks as installed with the package)")
    parser.add_argument("--strict", action="store_true",
                        help="run the instructor's notebook with only the learner's exercise cells")
    parser.add_argument("--notebooks", metavar="PATTERN", action="append", default=None,
                        help="grade only the notebooks whose file name matches PATTERN (e.g. '01_*'; repeat the "
                             "option for several)")
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH")
    parser.add_argument("--timeout", type=float, default=600.0, metavar="S",
                        help="wall-clock seconds per notebook (default: 600)")
    parser.add_argument("--workers", type=int, default=1, metavar="N", help="notebooks graded at once (default: 1)")
    parser.add_argument("--kernel", default=OWN_KERNEL, metavar="NAME",
                        help="Jupyter kernel (default: python3, the Python that runs the grader)")
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse already printed the usage and the problem
        return 0 if e.code in (0, None) else 2
    bad = run_options_error(args.timeout, args.workers)
    if bad:
        print(f"error: {bad}", file=sys.stderr)
        return 2
    directory = Path(args.directory)
    for folder, what in ((directory, "give the folder of notebooks to grade, e.g. exercises"),
                         (Path(args.solutions) if args.solutions else None, "the instructor's notebooks")):
        if folder is not None and not folder.is_dir():
            print(f"error: no such directory: {folder} ({what})", file=sys.stderr)
            return 2
    if not any(directory.glob("*.ipynb")):
        print(f"warning: no notebooks (*.ipynb) in {directory}", file=sys.stderr)
    try:
        report = grade(directory, timeout=args.timeout, kernel_name=args.kernel, workers=args.workers,
                       progress=lambda line: print(line, file=sys.stderr, flush=True), solutions=args.solutions,
                       strict=args.strict, notebooks=args.notebooks)
    except (ValueError, CourseNotFound) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.notebooks and not report.notebooks:
        print(f"error: --notebooks {' '.join(args.notebooks)} matches no notebook of {directory} or of the "
              "instructor's folder", file=sys.stderr)
        return 2
    print(report.format())
    if args.json:
        report.to_json(args.json)
        print(f"report written to {args.json}", file=sys.stderr)
    return 0


def _run_main(argv) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpullm_lessons.classroom.grading _run")
    parser.add_argument("notebook")
    parser.add_argument("log")
    parser.add_argument("plan")
    parser.add_argument("--kernel", default="python3")
    parser.add_argument("--cell-timeout", type=float, default=None)
    args = parser.parse_args(argv)
    return _run(args.notebook, args.log, args.plan, args.kernel, args.cell_timeout)


if __name__ == "__main__":
    _argv = sys.argv[1:]
    if _argv and _argv[0] == "_run":
        _rc = _run_main(_argv[1:])
        # every log line is written and the kernel is shut down: skip the slow interpreter teardown
        # (zmq contexts, kernel-manager finalizers)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_rc)
    sys.exit(main(_argv))
