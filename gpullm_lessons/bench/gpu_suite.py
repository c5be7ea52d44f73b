"""`make gpu-test`: the whole GPU suite in one run, in parallel processes over one GPU, with a summary to keep.

    python -m gpullm_lessons.bench.gpu_suite [--workers N] [--out runs/gpu-test] [--parts tests,notebooks,solutions]
                                       [-- extra pytest arguments]

It runs pytest over tests/, notebooks/ (the lessons, under nbval) and solutions/ (every task's checker, under nbval)
on N pytest-xdist workers (default: the CPU cores, at most 16), all sharing the GPU; then writes
`<out>/summary.json` (card, driver, date, commit, passed / failed / skipped and minutes per part, one entry per
failure) and prints one line per failure. Exit status: pytest's.

How the work is split (the scheduler below): each test of tests/ is a unit of its own, so the hundred cases of one
kernel test spread over every worker; a notebook is one unit (nbval runs its cells in order in one kernel); the tests
that start mpirun or a server run one file per unit. The notebooks and the slowest units go first.

Sticky CUDA errors are contained. After an illegal address, a misaligned access or a failed launch, a CUDA context
is broken for good: every later call in that process fails with the same error. When a test fails with such an error
(or the context answers with one after any failed test), its own failure is reported as usual, and the worker process
exits before it starts another test; pytest-xdist replaces it with a fresh process (a fresh CUDA context) and the tests
it had been given run there. The unit the dead worker was about to start is reported as "rerun" (it never ran there),
not as a failure. One bad kernel costs one failure, not every test after it.

A notebook whose Jupyter kernel died before any of its cells ran (nbval: "Kernel died before replying to
kernel_info") tested nothing: it runs again alone after the suite, in place of its first result, and the summary lists
it among the reruns. Any other failure stands.

The same plugin is loaded by `pytest -p gpullm_lessons.bench.gpu_suite` for a hand-picked part of the suite.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

PARTS = ("tests", "notebooks", "solutions")
# files whose tests start mpirun or a server: one file per unit (their tests run in order, in one process)
ONE_FILE_PER_UNIT = (
    "tests/test_comm.py",
    "tests/test_parallel.py",
    "tests/test_train_ranks.py",
    "tests/test_grad_accum.py",
    "tests/test_slurm.py",
    "tests/test_browser.py",
)
# units started first: the long sequential ones (notebooks, then these files), so no worker is left with one at the end
SLOW_FIRST = (
    "notebooks/",
    "solutions/",
    "tests/test_hip.py",
    "tests/test_doctor.py",
    "tests/test_train_ranks.py",
    "tests/test_grad_accum.py",
    "tests/test_capstone.py",
    "tests/test_ce_chunks.py",
)
# what CUDA (and HIP) say when a context is broken for good: the process that saw it cannot launch again
STICKY = re.compile(
    r"cudaErrorIllegalAddress|CUDA_ERROR_ILLEGAL_ADDRESS|illegal memory access|cudaErrorLaunchFailure|"
    r"CUDA_ERROR_LAUNCH_FAILED|unspecified launch failure|cudaErrorMisalignedAddress|CUDA_ERROR_MISALIGNED_ADDRESS|"
    r"misaligned address|cudaErrorIllegalInstruction|CUDA_ERROR_ILLEGAL_INSTRUCTION|cudaErrorHardwareStackError|"
    r"CUDA_ERROR_HARDWARE_STACK_ERROR|cudaErrorAssert|CUDA_ERROR_ASSERT|device-side assert|hipErrorIllegalAddress|"
    r"hipErrorLaunchFailure"
)
STICKY_DIR = "GPULLM_STICKY_DIR"  # where a worker leaves a note before it exits (set by the controller)


def part_of(nodeid: str) -> str:
    head = nodeid.split("/", 1)[0]
    return head if head in PARTS else "tests"


def unit_of(nodeid: str) -> str:
    """The scheduling unit of a test: its file for notebooks and ONE_FILE_PER_UNIT, else the test itself."""
    path = nodeid.split("::", 1)[0]
    if nodeid.startswith(("notebooks/", "solutions/")) or path in ONE_FILE_PER_UNIT:
        return path
    return nodeid


# ---- the plugin: loaded in the controller and in every worker (-p gpullm_lessons.bench.gpu_suite) -----------------------


def pytest_configure(config):
    if not hasattr(config, "workerinput") and not os.environ.get(STICKY_DIR):
        os.environ[STICKY_DIR] = tempfile.mkdtemp(prefix="gpullm-sticky-")  # the workers inherit it


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Slow units first (the same order in every worker: xdist compares the collections)."""
    rank = {item.nodeid: (0 if item.nodeid.startswith(SLOW_FIRST) else 1, i) for i, item in enumerate(items)}
    items.sort(key=lambda item: rank[item.nodeid])


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class OneTestPerUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

        def _reschedule(self, node) -> None:
            """Top the node up to more than two pending tests, and tell it when the queue is empty. (xdist's own gives
            one unit per call: a worker that replaces a dead one gets a single one-test unit, and a worker holds its
            last test until it knows the next one or that there is none: both would wait for ever.)"""
            if node.shutting_down:
                return
            while self.workqueue and self._pending_of(self.assigned_work[node]) <= 2:
                self._assign_work_unit(node)
            if not self.workqueue:
                node.shutdown()

    return OneTestPerUnit(config, log)


def _context_broken() -> str | None:
    """The sticky error this process's CUDA context is in, or None (only where CuPy is already in use)."""
    cp = sys.modules.get("cupy")
    if cp is None:
        return None
    try:
        cp.cuda.runtime.deviceSynchronize()
        cp.cuda.runtime.getLastError()
    except Exception as e:  # noqa: BLE001 - CUDARuntimeError; anything here means the context cannot be trusted
        return str(e) if STICKY.search(str(e)) else None
    return None


_BROKEN: dict = {}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed and not _BROKEN and hasattr(item.config, "workerinput"):
        text = report.longreprtext or ""
        found = STICKY.search(text)
        why = found.group(0) if found else _context_broken()
        if why:
            _BROKEN.update(nodeid=item.nodeid, why=why)
    return report


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """In a worker whose CUDA context broke in an earlier test: leave a note and exit before running this one."""
    if not _BROKEN:
        return None
    config = item.config
    worker = config.workerinput.get("workerid", "gw?")
    note = Path(os.environ.get(STICKY_DIR, tempfile.gettempdir())) / f"{worker}.json"
    note.write_text(json.dumps({"broken_by": _BROKEN["nodeid"], "why": _BROKEN["why"], "next": item.nodeid}))
    sys.stdout.flush()
    sys.stderr.flush()
    time.sleep(0.2)  # the previous test's reports are on their way to the controller
    os._exit(3)


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem, report, sched):
    """A worker that exited after a sticky CUDA error: the unit it was about to start runs on its replacement (the
    scheduler requeues the dead worker's unfinished units); report it as a rerun, not a failure."""
    worker = getattr(report.node, "gateway", None)
    note = Path(os.environ.get(STICKY_DIR, tempfile.gettempdir())) / f"{getattr(worker, 'id', '?')}.json"
    if not note.exists():
        return
    info = json.loads(note.read_text())
    note.unlink()
    if info.get("next") != crashitem:
        return
    report.outcome = "rerun"
    report.longrepr = (
        f"worker {worker.id} exited after a sticky CUDA error in {info['broken_by']} ({info['why']}); "
        f"{crashitem} runs on a fresh worker (a new CUDA context)"
    )
    if not hasattr(sched, "workqueue"):  # a scheduler that does not requeue the dead worker's units by itself
        sched.mark_test_pending(crashitem)


def pytest_report_teststatus(report, config):
    if report.outcome == "rerun":
        return "rerun", "R", "RERUN"
    return None


# ---- the runner ----------------------------------------------------------------------------------------------------


class Collector:
    """Passed to pytest.main in the controller: every report, for the summary."""

    def __init__(self):
        self.rows: dict = {}
        self.reruns: list = []
        self.start = time.time()
        self.last: dict = {}

    def pytest_runtest_logreport(self, report):
        part = part_of(report.nodeid)
        self.last[part] = time.time()
        if report.outcome == "rerun":
            self.reruns.append({"nodeid": report.nodeid, "message": str(report.longrepr)})
            return
        row = self.rows.setdefault(report.nodeid, {"part": part, "outcome": "passed", "message": "", "s": 0.0})
        row["s"] += getattr(report, "duration", 0.0)
        if report.failed and row["outcome"] != "failed":
            row["outcome"], row["message"] = "failed", _first_line(report)
        elif report.skipped and row["outcome"] == "passed":
            row["outcome"] = "skipped"
            longrepr = getattr(report, "longrepr", None)
            row["message"] = str(longrepr[2] if isinstance(longrepr, tuple) else longrepr)[:200]

    def pytest_collectreport(self, report):
        if report.failed:
            self.rows[report.nodeid or "collection"] = {
                "part": part_of(report.nodeid),
                "outcome": "failed",
                "message": _first_line(report),
                "s": 0.0,
            }


def _first_line(report) -> str:
    """The failure in one line: the exception's message, or (a bare `AssertionError:`) the first `E` line under it."""
    crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
    lines = [ln.strip() for ln in (report.longreprtext or "").splitlines() if ln.strip()]
    if crash is not None and getattr(crash, "message", "").strip():
        said = [ln.strip() for ln in crash.message.splitlines() if ln.strip()]
        first = said[0]
        if first.rstrip(":").endswith("Error") and len(said) > 1:  # a bare `AssertionError:`: the line that says more
            first = f"{first.rstrip(':')}: {said[1]}"
        return first[:300]
    errors = [ln for ln in lines if re.search(r"Error|Exception|assert", ln)]
    return ((errors or lines or ["failed"])[-1])[:300]


NO_KERNEL = "Kernel died before replying to kernel_info"  # nbval: the notebook's Jupyter kernel never started


def unstarted_notebooks(collector: Collector) -> list:
    """The notebooks (lessons, solutions) whose every cell failed because their Jupyter kernel died before it
    started: no cell of theirs ran, so nothing of the course was tested (seen once on an H100, with sixteen kernels
    starting at once; the same lesson passed alone right after)."""
    rows: dict = {}
    for nodeid, r in collector.rows.items():
        if r["part"] in ("notebooks", "solutions"):
            rows.setdefault(unit_of(nodeid), []).append(r)
    return sorted(
        f for f, rs in rows.items() if all(r["outcome"] == "failed" and NO_KERNEL in r["message"] for r in rs)
    )


def rerun_unstarted(collector: Collector, pytest_args: list, run=pytest.main) -> list:
    """Run the unstarted notebooks again, one at a time after the suite, in place of their first results; each is
    listed among the summary's reruns with the reason. A notebook that fails again counts as failed, whatever the
    reason. Returns the notebooks run again."""
    again = unstarted_notebooks(collector)
    if not again:
        return []
    for f in again:
        for nodeid in [n for n in collector.rows if unit_of(n) == f]:
            del collector.rows[nodeid]
        collector.reruns.append(
            {"nodeid": f, "message": f"its Jupyter kernel died before any cell ran ({NO_KERNEL}): run again alone"}
        )
    run([*pytest_args, "-n", "0", *again], plugins=[collector])
    return again


def summarise(collector: Collector, parts, meta: dict) -> dict:
    out = dict(meta)
    out["minutes"] = round((time.time() - collector.start) / 60, 2)
    out["parts"] = {}
    for part in parts:
        rows = [r for r in collector.rows.values() if r["part"] == part]
        counts = {k: sum(r["outcome"] == k for r in rows) for k in ("passed", "failed", "skipped")}
        counts["test_minutes"] = round(sum(r["s"] for r in rows) / 60, 2)  # summed over the workers
        out["parts"][part] = counts
    out["failures"] = [
        {"nodeid": k, "message": r["message"]} for k, r in collector.rows.items() if r["outcome"] == "failed"
    ]
    reasons: dict = {}
    for r in collector.rows.values():
        if r["outcome"] == "skipped":
            reasons[r["message"]] = reasons.get(r["message"], 0) + 1
    out["skipped_because"] = dict(sorted(reasons.items(), key=lambda kv: -kv[1]))  # why, and how many tests
    out["reruns"] = collector.reruns
    out["green"] = not out["failures"] and all(out["parts"][p]["passed"] for p in parts)
    return out


def _card() -> dict:
    try:
        line = (
            subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            .stdout.strip()
            .splitlines()[0]
        )
        name, driver = (s.strip() for s in line.split(",", 1))
        return {"card": name, "driver": driver}
    except Exception:  # noqa: BLE001 - no nvidia-smi (AMD): the device layer's name
        from gpullm_lessons import device

        gpu = device.info().gpu
        return {"card": gpu.name if gpu else "none", "driver": ""}


def _commit(root: Path) -> dict:
    def git(*args):
        r = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else ""

    if os.environ.get("GPULLM_COMMIT"):  # a copy of the tree without its git history (a container build, a rsync)
        return {"commit": os.environ["GPULLM_COMMIT"], "dirty": os.environ.get("GPULLM_DIRTY", "0") == "1"}
    return {"commit": git("rev-parse", "HEAD") or "unknown", "dirty": bool(git("status", "--porcelain", "-uno"))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gpullm_lessons.bench.gpu_suite", description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=min(os.cpu_count() or 1, 16))
    ap.add_argument("--out", default="runs/gpu-test")
    ap.add_argument("--parts", default=",".join(PARTS), help="comma-separated: " + ", ".join(PARTS))
    ap.add_argument("pytest_args", nargs="*", help="after --: more pytest arguments (e.g. -k, -x)")
    args = ap.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    bad = [p for p in parts if p not in PARTS]
    if bad or args.workers < 1:
        ap.error(f"--parts takes {', '.join(PARTS)} (got {', '.join(bad)})" if bad else "--workers must be >= 1")
    root = Path.cwd()
    missing = [p for p in parts if not (root / p).is_dir()]
    if missing:
        ap.error(f"no {', '.join(missing)}/ here: run it from the course's folder (where the Makefile is)")
    from gpullm_lessons import device

    device.require_gpu("the GPU suite (make gpu-test)")
    meta = {
        "what": "make gpu-test",
        **_card(),
        "date": _dt.date.today().isoformat(),
        "started": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        **_commit(root),
        "workers": args.workers,
        "command": " ".join(["python -m gpullm_lessons.bench.gpu_suite", *(argv or sys.argv[1:])]),
    }
    collector = Collector()
    pytest_args = [
        "-p",
        "gpullm_lessons.bench.gpu_suite",
        "-p",
        "no:cacheprovider",
        "-q",
        "-m",
        "not browser",
        "--nbval-lax",
        "--nbval-current-env",
        "--nbval-cell-timeout=900",
        *args.pytest_args,
    ]
    rc = pytest.main(
        [*pytest_args, "-n", str(args.workers), "--dist", "loadscope", "--no-loadscope-reorder", *parts],
        plugins=[collector],
    )
    if rerun_unstarted(collector, pytest_args) and rc in (0, 1):
        rc = 1 if any(r["outcome"] == "failed" for r in collector.rows.values()) else 0
    summary = summarise(collector, parts, meta)
    summary["exit_status"] = int(rc)
    out = root / args.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"\ngpu-test on {summary['card']}: {summary['minutes']} min, {args.workers} workers")
    for part in parts:
        c = summary["parts"][part]
        print(f"  {part:10s} {c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped")
    for f in summary["failures"]:
        print(f"FAILED {f['nodeid']}: {f['message']}")
    for r in summary["reruns"]:
        print(f"RERUN  {r['nodeid']}: {r['message']}")
    print(f"summary: {out / 'summary.json'}")
    return int(rc)


if __name__ == "__main__":
    sys.exit(main())
