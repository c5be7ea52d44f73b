"""`make sanitize`: the GPU kernel tests under NVIDIA's compute-sanitizer, in parts, several at a time.

compute-sanitizer runs a program with every kernel launch instrumented:
  memcheck   an out-of-bounds or misaligned global or shared access, an illegal address;
  racecheck  two threads of a block that touch the same shared-memory word with no barrier between them;
  initcheck  a read of device memory that nothing wrote (cudaMalloc'd, never initialised);
  synccheck  a barrier (__syncthreads, __syncwarp) that not every thread it names reaches.
A part is one test file (or, with --chunk, a few of its tests) under one tool: `python -m pytest -m gpu FILE` started
by compute-sanitizer, with a time limit, in a process group of its own, so that the slow instrumented runs (10 to 100
times slower than plain ones) stay a few minutes each and a part that hangs does not hold up the others. A part is
clean when pytest passed and the sanitizer's "ERROR SUMMARY" counted 0 errors.

Two settings make the reports mean something:
  --report-api-errors no   numba-cuda probes driver entry points that may not exist; those failed API calls are
                           not kernel errors.
  GPULLM_CUPY_POOL=off     tests/conftest.py then gives CuPy plain cudaMalloc allocations instead of its memory
                           pool: inside a pool block, a read past the end of one array lands in the next array and
                           memcheck cannot see it; with one allocation per array it can.

CLI: ``python -m gpullm_lessons.bench.sanitize [--tools memcheck,racecheck] [--files tests/test_hip_flash.py,...]
[--select K] [--timeout S] [--jobs N] [--chunk M[,tool=K]] [--shard I/N] [--skip S,..] [--out DIR] [--list]``; it prints one line per part as
it finishes, then the table of every part in order, and exits 1 when any part is not clean, 2 on bad usage.

Fitting a run into a machine lent for a few minutes at a time:
  --jobs N     N parts at a time (default: the CPU cores, at most 8), all on the one GPU; each keeps its own time
               limit and process group.
  --chunk M    a part is at most M GPU tests of one file instead of the whole file: the file's tests are collected
               first (pytest --collect-only -m gpu FILE) and a part passes its node ids to pytest. Its name carries
               the chunk ("tests/test_hip_flash.py [2/5]"), and so does its log (test_hip_flash.2of5.memcheck.log).
               "M,tool=K" gives one tool parts of K tests: racecheck is many times slower than memcheck (an H100,
               2026-12-07: 12 flash tests under racecheck did not finish in 450 s), so "12,racecheck=2" keeps its
               parts inside a 10-minute call.
  --shard I/N  only the parts whose index (in the list of files x tools x chunks) is I-1 modulo N: the N shards
               together are the whole run, one shard per call.
  --deadline S the whole run's seconds: a part not started by then is "not run", a running one is stopped
               ("timeout"), and the summary is still written.
  --skip S,..  the parts that earlier sittings' summaries have a verdict for (clean, errors, tests failed) are not run
               again: the next sitting picks up what the last one's deadline stopped or never started.
  --out DIR    DIR/summary.json (DIR relative to the checkout, as --logs): card, driver, date, commit, settings and
               each part's status (card, driver and commit as `make gpu-test` finds them, bench/gpu_suite.py), with the
               shard and the whole run's part list (all_parts, parts_total), so that shards can be put together:

    python -m gpullm_lessons.bench.sanitize merge runs/s1/summary.json runs/s2/summary.json ... --into runs/summary.json

merge refuses (exit 2) summaries of different cards or part lists, of different commits unless git shows that the
code the parts run (CODE_PATHS and the test files) is the same at both, and a part finished in two of them (one
that a sitting stopped or never started gives way to the sitting that finished it); the
merged summary is clean only when every part of the whole run is there and clean (a part in no shard is named under
"missing"). Its exit status is 0 when clean, else 1.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime as _dt
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")
DEFAULT_TOOLS = ("memcheck", "racecheck")
# The tests that launch the course's kernels on a GPU, the flash kernels first; each is one part per tool.
DEFAULT_FILES = (
    "tests/test_hip_flash.py",
    "tests/test_kernels_softmax.py",
    "tests/test_kernels_layernorm.py",
    "tests/test_kernels_crossentropy.py",
    "tests/test_kernels_attention.py",
    "tests/test_kernels_gelu.py",
    "tests/test_kernels_encoder.py",
    "tests/test_kernels_linear.py",
    "tests/test_kernels_fused.py",
    "tests/test_kernels_adamw.py",
    "tests/test_kernels_transpose.py",
    "tests/test_hip.py",
)
# what the kernel tests run: shards of different commits merge only where none of these (nor the tests) changed
CODE_PATHS = (
    "kernels",
    "gpullm_lessons/__init__.py",
    "gpullm_lessons/device.py",
    "gpullm_lessons/backends",
    "gpullm_lessons/contracts",
    "gpullm_lessons/runtime",
    "gpullm_lessons/reference",
    "gpullm_lessons/checks",
    "gpullm_lessons/model",
    "gpullm_lessons/classroom",
    "tests/conftest.py",
    "pyproject.toml",
)
SANITIZER_ENV = "GPULLM_SANITIZER"  # the compute-sanitizer executable (default: found on PATH or in CUDA_PATH)
_SUMMARY = re.compile(r"=+\s*ERROR SUMMARY:\s*(\d+)\s+errors?")
# racecheck ends with its own line instead: "RACECHECK SUMMARY: N hazards displayed (E errors, W warnings)"
_RACE_SUMMARY = re.compile(r"=+\s*RACECHECK SUMMARY:.*?\((\d+)\s+errors?,\s*(\d+)\s+warnings?\)")


class SanitizeError(RuntimeError):
    """A part that cannot start (no compute-sanitizer, an unknown tool, a test file that does not exist or whose tests
    cannot be collected), or summaries that cannot be merged."""


@dataclasses.dataclass
class Part:
    tool: str
    file: str
    chunk: str = ""  # "2/5": the second of the file's 5 chunks of tests (--chunk); "" for the whole file
    nodeids: list = dataclasses.field(
        default_factory=list
    )  # the chunk's tests (pytest node ids); [] for the whole file
    status: str = "not run"  # clean | errors | tests failed | timeout | no summary
    errors: int = 0
    seconds: float = 0.0
    first_error: str = ""

    @property
    def clean(self) -> bool:
        return self.status == "clean"

    @property
    def name(self) -> str:
        """The file, and the chunk where there is one: "tests/test_hip.py [2/5]"."""
        return self.file + (f" [{self.chunk}]" if self.chunk else "")

    @property
    def key(self) -> str:
        """The part's name in a summary's all_parts and in merge's messages: "memcheck tests/test_hip.py [2/5]"."""
        return f"{self.tool} {self.name}"

    @property
    def log_name(self) -> str:
        chunk = f".{self.chunk.replace('/', 'of')}" if self.chunk else ""  # no "/" in a file name
        return f"{Path(self.file).stem}{chunk}.{self.tool}.log"


def find_sanitizer() -> str:
    """The compute-sanitizer executable: $GPULLM_SANITIZER, else PATH, else $CUDA_PATH/bin or /usr/local/cuda/bin."""
    explicit = os.environ.get(SANITIZER_ENV)
    if explicit:
        if not (os.path.isfile(explicit) and os.access(explicit, os.X_OK)):
            raise SanitizeError(f"{SANITIZER_ENV}={explicit!r} is not an executable file")
        return explicit
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for base in (os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if base and os.access(os.path.join(base, "bin", "compute-sanitizer"), os.X_OK):
            return os.path.join(base, "bin", "compute-sanitizer")
    raise SanitizeError(
        "compute-sanitizer not found: it comes with the CUDA toolkit (NVIDIA GPUs only; /usr/local/cuda/bin), or "
        f"point {SANITIZER_ENV} to it"
    )


def command(sanitizer: str, tool: str, file: str, python: str = sys.executable, select: str = "", nodeids=()) -> list:
    """The command line of one part (select: a pytest -k expression; nodeids: a chunk's tests, in place of the file)."""
    cmd = [sanitizer, "--tool", tool, "--report-api-errors", "no", "--target-processes", "all"]
    if tool == "racecheck":
        cmd += ["--racecheck-report", "hazard"]
    # --durations: the slowest tests of the part, in its log (for choosing --chunk and --shard)
    cmd += [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=10", "-m", "gpu", "-x"]
    cmd += list(nodeids) or [file]
    return cmd + (["-k", select] if select else [])


# a line of `pytest -q --collect-only` that is a test: "path/test_x.py::test_name[params]" (params may hold spaces)
_NODEID = re.compile(r"^(\S+?\.py)::(.+)$")


def collect(file: str, select: str = "", timeout: float = 600.0) -> list:
    """The node ids of the GPU tests of one file (those a whole-file part runs), in pytest's order.

    pytest writes a node id relative to its rootdir, which for a file outside this checkout is not where the command
    runs; the file as given (relative to ROOT, or absolute) replaces that path, so every node id can be passed back."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only", "-m", "gpu", file]
    cmd += ["-k", select] if select else []
    try:
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise SanitizeError(f"collecting the GPU tests of {file}: still running after {timeout:.0f} s") from None
    ids = [f"{file}::{m.group(2)}" for m in map(_NODEID.match, r.stdout.splitlines()) if m]
    if r.returncode != 0 or not ids:  # 5: nothing collected (no GPU test, or --select left none)
        # pytest's own last line is on stdout (stderr may end with a library's warning)
        last = (
            [ln.strip() for ln in r.stdout.splitlines() if ln.strip()]
            or [ln.strip() for ln in r.stderr.splitlines() if ln.strip()]
            or ["no output"]
        )[-1]
        raise SanitizeError(
            f"collecting the GPU tests of {file} failed: {last} (see `python -m pytest --collect-only -m gpu {file}`)"
        )
    return ids


def chunks(file: str, tool: str, nodeids: list, size: int) -> list:
    """The parts of one file under one tool: at most `size` tests each, labelled "k/n"."""
    groups = [nodeids[i : i + size] for i in range(0, len(nodeids), size)]
    return [Part(tool, file, f"{k}/{len(groups)}", group) for k, group in enumerate(groups, 1)]


def classify(output: str, returncode: int) -> tuple:
    """(status, errors, first error line) of one part from its output and exit status.

    The sanitizer prints one "ERROR SUMMARY: N errors" (racecheck: "RACECHECK SUMMARY: ... (E errors, W warnings)")
    per process it watched; the part's count is their sum. No summary at all means the sanitizer did not run the
    program to the end."""
    counts = [int(n) for n in _SUMMARY.findall(output)]
    counts += [int(e) + int(w) for e, w in _RACE_SUMMARY.findall(output)]  # a racecheck warning is a hazard too
    errors = sum(counts)
    first = next(
        (
            ln.strip()
            for ln in output.splitlines()
            if re.match(
                r"=+\s*(Invalid|Race|Uninitialized|Barrier|"
                r"Error|Program hit|Warning)",
                ln.strip(),
            )
        ),
        "",
    )
    if not counts:
        return "no summary", 0, first or "the sanitizer printed no ERROR SUMMARY"
    if errors:
        return "errors", errors, first
    if returncode != 0:
        tail = [ln for ln in output.splitlines() if ln.strip()][-1:] or [""]
        return "tests failed", 0, tail[0].strip()
    return "clean", 0, ""


# the process groups of the parts running now: a Ctrl-C in main stops them (their own sessions do not see it)
_RUNNING: set = set()


def run_part(
    part: Part, sanitizer: str, timeout: float, log_dir: Path | None = None, select: str = "", deadline: float = 0.0
) -> Part:
    """Run one part and fill in its status; safe to call from several threads at once (--jobs). deadline: a
    time.time() after which the part does not start ("not run") and by which a running one is stopped ("timeout")."""
    env = dict(os.environ, GPULLM_CUPY_POOL="off")
    why_stopped = f"still running after {timeout:.0f} s (raise --timeout)"
    if deadline:
        left = deadline - time.time()
        if left <= 0:
            part.status, part.first_error = "not run", "not started before --deadline"
            return part
        if left < timeout:
            timeout, why_stopped = left, "stopped at --deadline"
    start = time.perf_counter()
    # its own process group: a part past its time limit is stopped with the pytest process the sanitizer started
    proc = subprocess.Popen(
        command(sanitizer, part.tool, part.file, select=select, nodeids=part.nodeids),
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    _RUNNING.add(proc.pid)
    try:
        output, _ = proc.communicate(timeout=timeout)
        part.status, part.errors, part.first_error = classify(output, proc.returncode)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        part.status, part.first_error = "timeout", why_stopped
    finally:
        _RUNNING.discard(proc.pid)
    part.seconds = time.perf_counter() - start
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        (log_dir / part.log_name).write_text(output)
    return part


def run_parts(
    parts: list,
    sanitizer: str,
    timeout: float,
    jobs: int,
    log_dir: Path | None = None,
    select: str = "",
    deadline: float = 0.0,
):
    """Run the parts, `jobs` at a time, printing one line per part as it finishes (deadline: see run_part)."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(run_part, part, sanitizer, timeout, log_dir, select, deadline) for part in parts]
        try:
            for done, future in enumerate(concurrent.futures.as_completed(futures), 1):
                print(f"[{done}/{len(parts)}] {_row(future.result())}", flush=True)
        except KeyboardInterrupt:
            for future in futures:
                future.cancel()  # the parts not started yet
            for pid in list(_RUNNING):  # and the running ones, each with the pytest process it started
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            raise


def _row(part: Part) -> str:
    note = f"  {part.first_error}" if part.first_error else ""
    return f"{part.tool:<10} {part.name:<36} {part.status:<12} {part.errors:>5} errors {part.seconds:7.1f} s{note}"


def _csv(text: str, allowed=None, what="") -> list:
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        raise SanitizeError(f"--{what} is empty")
    if allowed is not None:
        bad = [s for s in items if s not in allowed]
        if bad:
            raise SanitizeError(f"--{what}: {', '.join(bad)} not one of {', '.join(allowed)}")
    return items


def _chunk_sizes(text: str, tools: list) -> dict:
    """--chunk "M" or "M,tool=K,...": tests per part for each tool (0: whole files). racecheck runs a test many times
    slower than memcheck, so it may take smaller parts ("12,racecheck=3")."""
    sizes, default = {}, 0
    for item in [s.strip() for s in str(text).split(",") if s.strip()] or ["0"]:
        tool, eq, number = item.rpartition("=")
        if not number.strip().isdigit():
            raise SanitizeError(
                f"--chunk must be 0 (whole files) or more tests per part, or tool=N for one tool "
                f"(e.g. 12,racecheck=3), got {item!r}"
            )
        if not eq:
            default = int(number)
        elif tool.strip() not in TOOLS:
            raise SanitizeError(f"--chunk {item!r}: {tool.strip()!r} not one of {', '.join(TOOLS)}")
        else:
            sizes[tool.strip()] = int(number)
    return {tool: sizes.get(tool, default) for tool in tools}


def _shard(text: str) -> tuple:
    """--shard "I/N" as (I, N), 1 <= I <= N."""
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
        raise SanitizeError(f"--shard takes I/N with 1 <= I <= N (e.g. 2/3: the second of 3 shards), got {text!r}")
    return int(m.group(1)), int(m.group(2))


def _about() -> dict:
    """Card, driver, date and commit of this run, found as `make gpu-test` finds them (GPULLM_COMMIT and
    GPULLM_DIRTY stand in for git in a copy of the tree without its history)."""
    from gpullm_lessons.bench import gpu_suite  # here, not at the top: it imports pytest

    return {
        "what": "make sanitize",
        **gpu_suite._card(),
        "date": _dt.date.today().isoformat(),
        "started": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        **gpu_suite._commit(ROOT),
    }


def _part_row(part: Part) -> dict:
    return {
        "tool": part.tool,
        "file": part.file,
        "chunk": part.chunk,
        "status": part.status,
        "errors": part.errors,
        "seconds": round(part.seconds, 1),
        "first_error": part.first_error,
    }


def _from_row(row: dict) -> Part:
    """A part back from its row in a summary (without its node ids)."""
    fields = ("status", "errors", "seconds", "first_error")
    return Part(row["tool"], row["file"], row.get("chunk", ""), **{k: row[k] for k in fields if k in row})


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["merge"]:
        return merge_main(argv[1:])
    p = argparse.ArgumentParser(prog="python -m gpullm_lessons.bench.sanitize", description=__doc__.split("\n")[0])
    p.add_argument("--tools", default=",".join(DEFAULT_TOOLS), help=f"comma-separated, from {', '.join(TOOLS)}")
    p.add_argument("--files", default=",".join(DEFAULT_FILES), help="comma-separated test files")
    p.add_argument("--select", default="", help="a pytest -k expression: only the tests it selects")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per part (default 600)")
    p.add_argument(
        "--jobs", type=int, default=min(8, os.cpu_count() or 1), help="parts at a time (default: cores, <= 8)"
    )
    p.add_argument(
        "--chunk",
        default="0",
        help="at most this many tests per part (default 0: whole files); tool=N sets one tool's (12,racecheck=3)",
    )
    p.add_argument("--shard", default="", help="I/N: run only the I-th of N shards of the parts")
    p.add_argument(
        "--deadline",
        type=float,
        default=0.0,
        help="seconds for the whole run: later parts are not started, running ones stopped, and the summary is "
        "still written (for a machine lent for a fixed time)",
    )
    p.add_argument("--logs", default="runs/sanitize", help="where each part's full output goes")
    p.add_argument(
        "--skip",
        default="",
        help="comma-separated summary.json files of earlier sittings: the parts they have a verdict for (clean or "
        "errors) are not run again",
    )
    p.add_argument("--out", default="", help="write summary.json here")
    p.add_argument("--list", action="store_true", help="print the parts' commands and stop")
    args = p.parse_args(argv)
    try:
        tools = _csv(args.tools, TOOLS, "tools")
        files = _csv(args.files, None, "files")
        missing = [f for f in files if not (ROOT / f).is_file()]  # an absolute path stays itself
        if missing:
            raise SanitizeError(f"--files: {', '.join(missing)} not found under {ROOT}")
        if not args.timeout > 0:
            raise SanitizeError(f"--timeout must be positive, got {args.timeout}")
        if args.deadline < 0:
            raise SanitizeError(f"--deadline must be 0 (none) or more seconds, got {args.deadline}")
        if args.jobs < 1:
            raise SanitizeError(f"--jobs must be at least 1, got {args.jobs}")
        size = _chunk_sizes(args.chunk, tools)
        shard, shards = _shard(args.shard) if args.shard else (1, 1)
        decided = _decided(_csv(args.skip, None, "skip")) if args.skip else set()
        sanitizer = "compute-sanitizer" if args.list else find_sanitizer()
        # the whole run's parts: files x tools (x chunks); a file's tests are collected once for all the tools
        if any(size.values()):
            with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
                ids = dict(zip(files, pool.map(lambda f: collect(f, args.select, args.timeout), files)))
        every = [
            part
            for f in files
            for tool in tools
            for part in (chunks(f, tool, ids[f], size[tool]) if size[tool] else [Part(tool, f)])
        ]
    except SanitizeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    parts = [part for i, part in enumerate(every) if i % shards == shard - 1 and part.key not in decided]
    if args.list:
        for part in parts:
            print(" ".join(command(sanitizer, part.tool, part.file, select=args.select, nodeids=part.nodeids)))
        return 0
    about = _about() if args.out else {}
    start = time.time()
    where = f"shard {shard}/{shards}: " if shards > 1 else ""
    print(
        f"{where}{len(parts)} of {len(every)} parts, {args.jobs} at a time, up to {args.timeout:.0f} s each; "
        f"logs in {args.logs}/",
        flush=True,
    )
    deadline = start + args.deadline if args.deadline else 0.0
    run_parts(parts, sanitizer, args.timeout, args.jobs, ROOT / args.logs, args.select, deadline)
    print("\n".join(_row(part) for part in parts))  # the table, in the parts' order
    dirty = [p for p in parts if not p.clean]
    print(f"{len(parts) - len(dirty)} of {len(parts)} parts clean")
    rc = 1 if dirty else 0
    if args.out:
        summary = {
            **about,
            "tools": tools,
            "shard": f"{shard}/{shards}",
            "jobs": args.jobs,
            "deadline_s": args.deadline,
            "chunk": size[tools[0]] if len(set(size.values())) == 1 else size,  # one size, or each tool's
            "command": "python -m gpullm_lessons.bench.sanitize " + shlex.join(argv),
            "minutes": round((time.time() - start) / 60, 2),
            "parts": [_part_row(part) for part in parts],
            "parts_total": len(every),  # the whole run's parts, over every shard
            "all_parts": [part.key for part in every],  # and their names, for merge to check coverage
            "clean": not dirty,  # every part of this shard (merge tells whether the shards cover the whole run)
            "exit_status": rc,
        }
        out = ROOT / args.out
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        print(f"summary: {out / 'summary.json'}")
    return rc


VERDICTS = ("clean", "errors", "tests failed")  # a finished part; "timeout", "not run", "no summary" are not


def _decided(paths) -> set:
    """The parts that the summaries at `paths` have a verdict for (--skip)."""
    keys = set()
    for name in paths:
        try:
            s = json.loads(Path(name).read_text())
        except (OSError, ValueError) as e:
            raise SanitizeError(f"--skip: cannot read {name}: {e}") from None
        if s.get("what") != "make sanitize" or "parts" not in s:
            raise SanitizeError(f"--skip: {name} is not a summary of make sanitize --out")
        keys |= {_from_row(row).key for row in s["parts"] if row.get("status") in VERDICTS}
    return keys


# ---- merge: shards' summaries into one ------------------------------------------------------------------------------


def code_changed(a: str, b: str, all_parts, root=None) -> str:
    """Why shards run at commits a and b may not be merged ("" when they may): git must know both commits, and the
    code the parts run (CODE_PATHS and the parts' test files) must be the same at both. A lab machine lent for a few
    minutes at a time runs the shards in several sittings; a commit that only adds results, lessons or text between
    them changes nothing the sanitizer looked at."""
    root = Path(root or ROOT)
    files = sorted({_part_file(key) for key in all_parts})
    for c in (a, b):
        r = subprocess.run(["git", "cat-file", "-e", f"{c}^{{commit}}"], cwd=root, capture_output=True)
        if not c or r.returncode != 0:
            return f"git does not know the commit {c!r} here, so it cannot tell whether the code differs"
    r = subprocess.run(
        ["git", "diff", "--name-only", a, b, "--", *CODE_PATHS, *files], cwd=root, capture_output=True, text=True
    )
    if r.returncode != 0:
        return f"git diff failed: {r.stderr.strip()}"
    changed = r.stdout.split()
    if changed:
        more = f" and {len(changed) - 5} more" if len(changed) > 5 else ""
        return "the code the parts run differs: " + ", ".join(changed[:5]) + more
    return ""


def _part_file(key: str) -> str:
    """The test file of a part's key ("memcheck tests/test_hip.py [2/5]" -> "tests/test_hip.py")."""
    return key.split(" ")[1]


def merge(summaries: list, names: list, root=None) -> dict:
    """One summary from the shards' (names: where each came from, for the messages).

    Refused (SanitizeError): summaries of different cards, tools, chunk sizes or part lists, or of different commits
    between which the code the parts run changed (code_changed; root: the git checkout to ask), or a part found
    twice. The result is clean when every part of the whole run is there and clean; the parts no shard ran are listed
    under "missing"."""
    if not summaries:
        raise SanitizeError("merge: no summaries given")
    for s, name in zip(summaries, names):
        if s.get("what") != "make sanitize" or "all_parts" not in s:
            raise SanitizeError(f"merge: {name} is not a summary of make sanitize --out")
    first, first_name = summaries[0], names[0]
    for field in ("card", "tools", "chunk", "all_parts"):
        for s, name in zip(summaries[1:], names[1:]):
            if s.get(field) != first.get(field):
                said = f"{first.get(field)} vs {s.get(field)}" if field != "all_parts" else "the lists differ"
                raise SanitizeError(f"merge: {first_name} and {name} are of different runs: {field} ({said})")
    for s, name in zip(summaries[1:], names[1:]):
        if s.get("commit") != first.get("commit"):
            why = code_changed(first.get("commit", ""), s.get("commit", ""), first["all_parts"], root)
            if why:
                raise SanitizeError(
                    f"merge: {first_name} and {name} are of different runs: commit "
                    f"({first.get('commit')} vs {s.get('commit')}): {why}"
                )
    rows: dict = {}  # part name -> (its row, the summary it came from)
    for s, name in zip(summaries, names):
        for row in s["parts"]:
            key = _from_row(row).key
            if key in rows:
                kept = rows[key][0]
                if row["status"] not in VERDICTS:  # stopped or never started here: the other sitting's row stays
                    continue
                if kept["status"] in VERDICTS:
                    raise SanitizeError(f"merge: the part {key} is in both {rows[key][1]} and {name}")
            if key not in first["all_parts"]:
                raise SanitizeError(f"merge: the part {key} of {name} is not in the run's all_parts")
            rows[key] = (row, name)
    missing = [key for key in first["all_parts"] if key not in rows]
    clean = not missing and all(row["status"] == "clean" for row, _ in rows.values())
    started = min(summaries, key=lambda s: s.get("started", ""))
    return {
        "what": "make sanitize",
        "card": first["card"],
        "driver": ", ".join(sorted({s.get("driver", "") for s in summaries})),
        "date": started.get("date", ""),  # of the earliest shard
        "started": started.get("started", ""),
        "commit": first["commit"],
        "commits": sorted({s.get("commit", "") for s in summaries}),  # one, or several with the same code
        "dirty": any(s.get("dirty") for s in summaries),
        "tools": first["tools"],
        "shard": ",".join(s.get("shard", "") for s in summaries),  # the shards merged
        "jobs": max(s.get("jobs", 1) for s in summaries),  # the most that any shard ran at once
        "chunk": first["chunk"],
        "command": "python -m gpullm_lessons.bench.sanitize merge " + shlex.join(names),  # merge_main adds --into
        "merged": [
            {"from": name, "shard": s.get("shard"), "command": s.get("command"), "minutes": s.get("minutes")}
            for s, name in zip(summaries, names)
        ],
        "minutes": round(sum(s.get("minutes", 0) for s in summaries), 2),
        "parts": [rows[key][0] for key in first["all_parts"] if key in rows],  # in the whole run's order
        "parts_total": first["parts_total"],
        "all_parts": first["all_parts"],
        "missing": missing,
        "clean": clean,
        "exit_status": 0 if clean else 1,
    }


def merge_main(argv) -> int:
    p = argparse.ArgumentParser(
        prog="python -m gpullm_lessons.bench.sanitize merge", description="the shards' summaries (--out) into one"
    )
    p.add_argument("summaries", nargs="+", help="summary.json files of the shards")
    p.add_argument("--into", required=True, help="the merged summary.json to write")
    args = p.parse_args(argv)
    try:
        summaries = []
        for name in args.summaries:
            try:
                summaries.append(json.loads(Path(name).read_text()))
            except (OSError, ValueError) as e:
                raise SanitizeError(f"merge: cannot read {name}: {e}") from None
        merged = merge(summaries, args.summaries)
    except SanitizeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    merged["command"] = "python -m gpullm_lessons.bench.sanitize merge " + shlex.join(argv)
    into = Path(args.into)
    into.parent.mkdir(parents=True, exist_ok=True)
    into.write_text(json.dumps(merged, indent=1) + "\n")
    for row in merged["parts"]:
        print(_row(_from_row(row)))
    for key in merged["missing"]:
        print(f"MISSING {key} (in no shard merged)")
    clean = sum(row["status"] == "clean" for row in merged["parts"])
    print(f"{clean} of {merged['parts_total']} parts clean; {len(merged['missing'])} missing; summary: {into}")
    return merged["exit_status"]


if __name__ == "__main__":
    sys.exit(main())
