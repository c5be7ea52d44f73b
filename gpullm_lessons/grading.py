"""Grading: checkers record verdicts, the grader runs each notebook in a fresh kernel and collects them.

The protocol
------------
Every checker in ``gpullm_lessons.checks`` ends with::

    record(check="check_linear_backward", task="02.1 linear backward", status="correct", message="max err 3e-7")

``record`` appends one JSON line to the file named by the environment variable ``GPULLM_GRADE_LOG``. In a
learner's own Jupyter session that variable is unset and ``record`` does nothing; it never raises.

The grader
----------
``grade("exercises")`` runs every ``*.ipynb`` of a folder, each in a fresh kernel inside its own subprocess
(``python -m gpullm_lessons.grading _run NB LOG``), with ``GPULLM_GRADE_LOG`` pointing to a per-notebook log.
Cells run with errors allowed, so a failing cell only costs the tasks that depend on it. A notebook that hangs
is killed (subprocess and kernel) after ``timeout`` seconds; one that kills its kernel (``os._exit``) stops
there. Either way only that notebook's remaining tasks are lost.

Which tasks a notebook has is found statically (``find_tasks``): every top-level call ``check_xxx(...)`` in a
code cell is a task, labelled by its ``task="..."`` keyword or else by ``xxx``. Each task gets the verdict its
checker recorded, or "not run" with the reason (timeout, kernel died, the cell's error).

CLI: ``python -m gpullm_lessons grade [DIR] [--json PATH] [--timeout S] [--workers N]``.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Optional

LOG_ENV = "GPULLM_GRADE_LOG"
NOTEBOOK_ENV = "GPULLM_GRADE_NOTEBOOK"
STATUSES = ("correct", "wrong", "not attempted", "error", "skipped")
# "skipped": the task needs a GPU and this machine has none. It is listed but left out of the total.
UNSCORED = ("skipped",)
NOT_RUN = "not run"
REPO_ROOT = Path(__file__).resolve().parents[1]  # the folder that holds the gpullm_lessons package


# --------------------------------------------------------------------------------------------------
# record: called by checkers inside the learner's kernel
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


def verdict_key(entry: dict) -> str:
    """What a recorded verdict matches against a task: its task label, else the checker name without check_."""
    task = entry.get("task")
    return str(task) if task not in (None, "") else _strip_check(str(entry.get("check", "")))


# --------------------------------------------------------------------------------------------------
# Static task discovery
# --------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Task:
    notebook: str  # file name, e.g. "02_linear.ipynb"
    label: str  # unique within the notebook ("softmax_backward", "softmax_backward #2", "03.2 ...")
    check: str  # the checker called, e.g. "check_softmax_backward"
    key: str  # what a recorded verdict must carry to match (task= literal, else check name without check_)
    cell: int  # index of the cell in the notebook (markdown cells count)
    line: int  # 1-based line of the call in the cell
    named: bool = False  # the label came from a task="..." literal


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


def _checker_calls(tree: ast.AST) -> list[ast.Call]:
    """Calls to ``check_*`` (plain or attribute) that run when the cell runs: calls inside function or class
    bodies are skipped (a checker defined in a notebook may call helpers named check_*)."""
    calls = []

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                continue
            if isinstance(child, ast.Call):
                func = child.func
                name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
                if name.startswith("check_"):
                    calls.append(child)
            visit(child)

    visit(tree)
    return sorted(calls, key=lambda c: (c.lineno, c.col_offset))


def find_tasks(nb_path) -> list[Task]:
    """The graded tasks of a notebook, in order, found by parsing its code cells (nothing is executed).

    A task is a call ``check_xxx(...)``; its label is the ``task="..."`` string literal if given, else ``xxx``.
    Cells that do not parse are skipped. A label seen again gets " #2", " #3", ... so labels are unique.
    """
    import nbformat

    nb_path = Path(nb_path)
    nb = nbformat.read(str(nb_path), as_version=4)
    tasks: list[Task] = []
    seen: dict[str, int] = {}
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        source = cell.source if isinstance(cell.source, str) else "".join(cell.source)
        try:
            tree = ast.parse(_strip_magics(source))
        except SyntaxError:
            continue
        for call in _checker_calls(tree):
            check = call.func.id if isinstance(call.func, ast.Name) else call.func.attr
            key, named = _strip_check(check), False
            for kw in call.keywords:
                if kw.arg == "task" and isinstance(kw.value, ast.Constant) and isinstance(kw.value.value, str):
                    key, named = kw.value.value, True
            seen[key] = seen.get(key, 0) + 1
            label = key if seen[key] == 1 else f"{key} #{seen[key]}"
            tasks.append(Task(nb_path.name, label, check, key, index, call.lineno, named))
    return tasks


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

    def format(self) -> str:
        """Fixed-width table: one row per task, then a line per notebook and the total line."""
        nb_w = min(max([len("notebook")] + [len(t.notebook) for t in self.tasks]), 48)
        task_w = min(max([len("task")] + [len(t.task) for t in self.tasks]), 40)
        st_w = max([len("status")] + [len(s) for s in STATUSES + (NOT_RUN,)])
        header = f"{'notebook':<{nb_w}}  {'task':<{task_w}}  {'status':<{st_w}}  pts  message"
        lines = [header, "-" * len(header)]
        for t in self.tasks:
            lines.append(f"{_fit(t.notebook, nb_w):<{nb_w}}  {_fit(t.task, task_w):<{task_w}}  "
                         f"{t.status:<{st_w}}  {t.points:>3}  {_fit(t.message, 100)}".rstrip())
        lines.append("")
        for n in self.notebooks:
            note = f"  [{n.failure}]" if n.failure else ""
            lines.append(f"{n.notebook}: {n.score}/{n.total} ({_pct(n.score, n.total)}){note}")
        skipped = len(self.tasks) - self.total
        note = f"  ({skipped} task{'s' if skipped != 1 else ''} skipped: need a GPU)" if skipped else ""
        lines.append(f"score: {self.score}/{self.total} ({_pct(self.score, self.total)}){note}")
        return "\n".join(lines)

    __str__ = format

    def to_dict(self) -> dict:
        return {
            "directory": self.directory,
            "score": self.score,
            "total": self.total,
            "percent": round(self.percent, 1),
            "notebooks": [dataclasses.asdict(n) for n in self.notebooks],
            "tasks": [dataclasses.asdict(t) for t in self.tasks],
        }

    def to_json(self, path) -> None:
        path = Path(path)
        if path.parent != Path(""):
            path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


# --------------------------------------------------------------------------------------------------
# Merging a run's log with the static tasks
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


def merge(tasks: list[Task], entries: list[dict], notebook: str, *, stop_reason: Optional[str] = None
          ) -> tuple[list[TaskResult], list[str]]:
    """Give each static task its verdict from a run log (verdicts and runner events, in order).

    A verdict belongs to the cell that was running when it was recorded. Within a cell, a task takes the
    LAST verdict with its key (the n-th of n duplicate calls takes the last, earlier ones take theirs in
    order). A call without ``task=`` whose checker recorded a label of its own takes the verdict its checker
    recorded in that cell. A task still without a verdict takes the last unclaimed verdict with its key from
    anywhere (a checker called through a helper). Tasks left over are "not run" with the reason.
    Verdicts matching no task at all are added as extra tasks. Returns (results, cell errors).
    """
    verdicts = []  # (cell or None, key, entry)
    cell_errors: dict[int, str] = {}
    started: set[int] = set()
    stop_cell: Optional[int] = None
    current: Optional[int] = None
    for e in entries:
        event = e.get("_event")
        if event is None:
            if "status" in e:
                verdicts.append((current, verdict_key(e), e))
        elif event == "cell":
            current = e.get("cell")
            started.add(current)
        elif event == "cell_error":
            cell_errors.setdefault(e.get("cell"), f"{e.get('ename')}: {' '.join(str(e.get('evalue')).split())}")
        elif event in ("kernel_died", "cell_timeout"):
            stop_cell = e.get("cell")
    if stop_reason is not None and stop_cell is None:
        stop_cell = current  # killed from outside while this cell ran (None: before any cell started)

    assigned: dict[int, dict] = {}  # task index -> verdict entry
    claimed: set[int] = set()  # verdict indices

    def assign(task_ids: list[int], verdict_ids: list[int]):
        m, r = len(task_ids), len(verdict_ids)
        for j, ti in enumerate(task_ids):
            if j < m - 1:
                vi = verdict_ids[j] if j < r else None
            else:
                vi = verdict_ids[-1] if r >= m else None
            if vi is not None:
                assigned[ti] = verdicts[vi][2]
        claimed.update(verdict_ids)

    # 1. by (cell, key)
    groups: dict[tuple, list[int]] = {}
    for ti, t in enumerate(tasks):
        groups.setdefault((t.cell, t.key), []).append(ti)
    for (cell, key), task_ids in groups.items():
        vids = [vi for vi, (vc, vk, _) in enumerate(verdicts) if vc == cell and vk == key]
        if vids:
            assign(task_ids, vids)
    # 1b. a call without task= whose checker recorded a label of its own: match by (cell, checker name)
    groups = {}
    for ti, t in enumerate(tasks):
        if ti not in assigned and not t.named:
            groups.setdefault((t.cell, _strip_check(t.check)), []).append(ti)
    for (cell, name), task_ids in groups.items():
        vids = [vi for vi, (vc, _, e) in enumerate(verdicts)
                if vc == cell and vi not in claimed and _strip_check(str(e.get("check", ""))) == name]
        if vids:
            assign(task_ids, vids)
    # 2. by key alone, for tasks still without a verdict
    by_key: dict[str, list[int]] = {}
    for ti, t in enumerate(tasks):
        if ti not in assigned:
            by_key.setdefault(t.key, []).append(ti)
    for key, task_ids in by_key.items():
        vids = [vi for vi, (_, vk, _) in enumerate(verdicts) if vk == key and vi not in claimed]
        if vids:
            assign(task_ids, vids)

    results = []
    for ti, t in enumerate(tasks):
        if ti in assigned:
            v = assigned[ti]
            status = str(v.get("status"))
            results.append(TaskResult(notebook, t.label, status, int(status == "correct"),
                                      str(v.get("message", "")), str(v.get("check", t.check))))
            continue
        if stop_reason is not None and (stop_cell is None or t.cell >= stop_cell):
            reason = stop_reason
        elif t.cell in cell_errors:
            reason = f"cell error: {cell_errors[t.cell]} (cell {t.cell})"
        elif t.cell not in started:
            reason = "cell not run"
        else:
            reason = "no verdict recorded (the checker did not run)"
        results.append(TaskResult(notebook, t.label, NOT_RUN, 0, reason, t.check))

    # 3. verdicts for tasks not found statically (checker called with a computed task label, ...)
    static_keys = {t.key for t in tasks}
    labels = {t.label for t in tasks}
    extra: dict[str, dict] = {}
    for vi, (_, key, entry) in enumerate(verdicts):
        if key not in static_keys and vi not in claimed:
            extra[key] = entry  # last one wins; dict keeps first-seen order
    for key, v in extra.items():
        label, k = key, 1
        while label in labels:
            k += 1
            label = f"{key} #{k}"
        labels.add(label)
        status = str(v.get("status"))
        results.append(TaskResult(notebook, label, status, int(status == "correct"),
                                  str(v.get("message", "")), str(v.get("check", ""))))
    errors = [f"cell {c}: {msg}" for c, msg in sorted(cell_errors.items(), key=lambda kv: (kv[0] is None, kv[0]))]
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


def _child_env(nb_name: str, log: Path) -> dict:
    env = os.environ.copy()
    env[LOG_ENV] = str(log)
    env[NOTEBOOK_ENV] = nb_name
    # the runner and the kernel import gpullm_lessons from this very tree
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")  # quiet debugpy warning in the kernel's stderr
    return env


def _grade_notebook(nb_path: Path, workdir: Path, timeout: float, kernel_name: str,
                    cell_timeout: Optional[float]) -> tuple[list[TaskResult], NotebookResult]:
    name = nb_path.name
    start = time.monotonic()
    try:
        tasks = find_tasks(nb_path)
    except Exception as e:  # not a readable notebook: nothing to run
        msg = f"unreadable notebook: {type(e).__name__}: {e}"
        return [], NotebookResult(name, 0, 0, msg, 0.0)
    log = workdir / (nb_path.stem + ".jsonl")
    errfile = workdir / (nb_path.stem + ".stderr")
    cmd = [sys.executable, "-m", "gpullm_lessons.grading", "_run", str(nb_path.resolve()), str(log),
           "--kernel", kernel_name, "--cell-timeout", str(cell_timeout if cell_timeout else timeout)]
    stop_reason = None
    with open(errfile, "wb") as err:
        proc = subprocess.Popen(cmd, cwd=str(nb_path.resolve().parent), env=_child_env(name, log),
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
        # the runner stopped early: make sure no kernel outlives it
        _kill(_kernel_pids(entries))
        if "kernel_died" in events:
            stop_reason = "kernel died"
        elif "cell_timeout" in events:
            stop_reason = f"timeout after {cell_timeout if cell_timeout else timeout:g}s"
        else:
            msgs = [e.get("message") for e in entries if e.get("_event") == "runner_error"]
            if not msgs:
                tail = errfile.read_text(errors="replace").strip().splitlines()
                msgs = [tail[-1] if tail else f"exit code {rc}"]
            stop_reason = f"grader failed: {msgs[-1]}"
    results, errors = merge(tasks, entries, name, stop_reason=stop_reason)
    score = sum(r.points for r in results)
    total = sum(1 for r in results if r.status not in UNSCORED)
    return results, NotebookResult(name, score, total, stop_reason, round(time.monotonic() - start, 2),
                                   errors)


def grade(directory="exercises", timeout: float = 600, kernel_name: str = "python3", workers: int = 1,
          cell_timeout: Optional[float] = None, progress: Optional[Callable[[str], None]] = None) -> Report:
    """Run every ``*.ipynb`` in ``directory`` (sorted) in a fresh kernel and collect the checkers' verdicts.

    timeout: wall-clock seconds per notebook (kernel start included); on expiry the notebook's subprocess
    and kernel are killed. cell_timeout: seconds per cell (default: timeout). workers: notebooks run at once.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"no such directory: {directory}")
    notebooks = sorted(directory.glob("*.ipynb"))
    with tempfile.TemporaryDirectory(prefix="gpullm-grade-") as tmp:
        def one(nb_path):
            out = _grade_notebook(nb_path, Path(tmp), timeout, kernel_name, cell_timeout)
            if progress is not None:
                n = out[1]
                note = f" [{n.failure}]" if n.failure else ""
                progress(f"graded {n.notebook}: {n.score}/{n.total} in {n.seconds:.1f}s{note}")
            return out

        if workers > 1 and len(notebooks) > 1:
            with ThreadPoolExecutor(max_workers=workers) as pool:
                outs = list(pool.map(one, notebooks))
        else:
            outs = [one(nb) for nb in notebooks]
    tasks = [r for results, _ in outs for r in results]
    return Report(tasks, [n for _, n in outs], str(directory))


# --------------------------------------------------------------------------------------------------
# The runner: executes one notebook (inside the subprocess that grade() starts)
# --------------------------------------------------------------------------------------------------
def _run(nb_path: str, log_path: str, kernel_name: str = "python3", cell_timeout: Optional[float] = None) -> int:
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    def event(kind: str, **fields) -> None:
        with open(log_path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"_event": kind, **fields, "t": round(time.time(), 3)}, ensure_ascii=False) + "\n")

    nb_path = Path(nb_path).resolve()
    try:
        nb = nbformat.read(str(nb_path), as_version=4)
        client = NotebookClient(nb, timeout=max(1, math.ceil(cell_timeout)) if cell_timeout else None, kernel_name=kernel_name,
                                allow_errors=True, interrupt_on_timeout=False, record_timing=False,
                                shutdown_kernel="immediate", resources={"metadata": {"path": str(nb_path.parent)}})
        finished = True
        with client.setup_kernel():
            event("kernel", pid=getattr(getattr(client.km, "provisioner", None), "pid", None))
            for index, cell in enumerate(nb.cells):
                if cell.cell_type != "code" or not cell.source.strip():
                    continue
                event("cell", cell=index)
                try:
                    client.execute_cell(cell, index)
                except DeadKernelError:
                    event("kernel_died", cell=index)
                    finished = False
                    break
                except CellTimeoutError:
                    event("cell_timeout", cell=index)
                    finished = False
                    break
                for out in cell.get("outputs", []):
                    if out.get("output_type") == "error":
                        event("cell_error", cell=index, ename=out.get("ename"), evalue=str(out.get("evalue"))[:500])
                        break
    except Exception as e:  # kernel failed to start, unreadable notebook, ...
        event("runner_error", message=f"{type(e).__name__}: {' '.join(str(e).split())[:500]}")
        return 1
    if finished:
        event("done")
    return 0


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    """``grade [DIR] [--json PATH] [--timeout S] [--workers N] [--kernel NAME]``.

    Exit 0 whenever a report is produced (whatever the score), 2 for bad arguments or a missing directory.
    A leading "grade" word is accepted, so both ``main(["grade", "exercises"])`` and ``main(["exercises"])`` work.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "grade":
        argv = argv[1:]
    parser = argparse.ArgumentParser(
        prog="python -m gpullm_lessons grade",
        description="Run each notebook of DIR in a fresh kernel and report the checkers' verdicts.")
    parser.add_argument("directory", nargs="?", default="exercises", help="folder of notebooks (default: exercises)")
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH")
    parser.add_argument("--timeout", type=float, default=600.0, metavar="S",
                        help="wall-clock seconds per notebook (default: 600)")
    parser.add_argument("--workers", type=int, default=1, metavar="N", help="notebooks graded at once (default: 1)")
    parser.add_argument("--kernel", default="python3", metavar="NAME", help="Jupyter kernel (default: python3)")
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse already printed the usage and the problem
        return 0 if e.code in (0, None) else 2
    if not args.timeout > 0:
        print(f"error: --timeout must be a positive number of seconds, got {args.timeout:g}", file=sys.stderr)
        return 2
    if args.workers < 1:
        print(f"error: --workers must be at least 1, got {args.workers}", file=sys.stderr)
        return 2
    directory = Path(args.directory)
    if not directory.is_dir():
        print(f"error: no such directory: {directory} (give the folder of notebooks to grade, e.g. exercises)",
              file=sys.stderr)
        return 2
    if not any(directory.glob("*.ipynb")):
        print(f"warning: no notebooks (*.ipynb) in {directory}", file=sys.stderr)
    report = grade(directory, timeout=args.timeout, kernel_name=args.kernel, workers=args.workers,
                   progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(report.format())
    if args.json:
        report.to_json(args.json)
        print(f"report written to {args.json}", file=sys.stderr)
    return 0


def _run_main(argv) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpullm_lessons.grading _run")
    parser.add_argument("notebook")
    parser.add_argument("log")
    parser.add_argument("--kernel", default="python3")
    parser.add_argument("--cell-timeout", type=float, default=None)
    args = parser.parse_args(argv)
    return _run(args.notebook, args.log, args.kernel, args.cell_timeout)


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
