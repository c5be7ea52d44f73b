"""`make sanitize`: the GPU kernel tests under NVIDIA's compute-sanitizer, one part at a time.

compute-sanitizer runs a program with every kernel launch instrumented:
  memcheck   an out-of-bounds or misaligned global or shared access, an illegal address;
  racecheck  two threads of a block that touch the same shared-memory word with no barrier between them;
  initcheck  a read of device memory that nothing wrote (cudaMalloc'd, never initialised);
  synccheck  a barrier (__syncthreads, __syncwarp) that not every thread it names reaches.
A part is one test file under one tool: `python -m pytest -m gpu FILE` started by compute-sanitizer, with a time
limit, so that the slow instrumented runs (10 to 100 times slower than plain ones) stay a few minutes each and a
part that hangs does not hold up the others. A part is clean when pytest passed and the sanitizer's
"ERROR SUMMARY" counted 0 errors.

Two settings make the reports mean something:
  --report-api-errors no   numba-cuda probes driver entry points that may not exist; those failed API calls are
                           not kernel errors.
  GPULLM_CUPY_POOL=off     tests/conftest.py then gives CuPy plain cudaMalloc allocations instead of its memory
                           pool: inside a pool block, a read past the end of one array lands in the next array and
                           memcheck cannot see it; with one allocation per array it can.

CLI: ``python -m gpullm_lessons.sanitize [--tools memcheck,racecheck] [--files tests/test_hip_flash.py,...]
[--select K] [--timeout S] [--list]``; it prints one line per part and exits 1 when any part is not clean, 2 on bad usage.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
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
SANITIZER_ENV = "GPULLM_SANITIZER"  # the compute-sanitizer executable (default: found on PATH or in CUDA_PATH)
_SUMMARY = re.compile(r"=+\s*ERROR SUMMARY:\s*(\d+)\s+errors?")
# racecheck ends with its own line instead: "RACECHECK SUMMARY: N hazards displayed (E errors, W warnings)"
_RACE_SUMMARY = re.compile(r"=+\s*RACECHECK SUMMARY:.*?\((\d+)\s+errors?,\s*(\d+)\s+warnings?\)")


class SanitizeError(RuntimeError):
    """A part that cannot start: no compute-sanitizer, an unknown tool, a test file that does not exist."""


@dataclasses.dataclass
class Part:
    tool: str
    file: str
    status: str = "not run"  # clean | errors | tests failed | timeout | no summary
    errors: int = 0
    seconds: float = 0.0
    first_error: str = ""

    @property
    def clean(self) -> bool:
        return self.status == "clean"


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


def command(sanitizer: str, tool: str, file: str, python: str = sys.executable, select: str = "") -> list:
    """The command line of one part (select: a pytest -k expression)."""
    cmd = [sanitizer, "--tool", tool, "--report-api-errors", "no", "--target-processes", "all"]
    if tool == "racecheck":
        cmd += ["--racecheck-report", "hazard"]
    cmd += [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "-x", file]
    return cmd + (["-k", select] if select else [])


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


def run_part(part: Part, sanitizer: str, timeout: float, log_dir: Path | None = None, select: str = "") -> Part:
    env = dict(os.environ, GPULLM_CUPY_POOL="off")
    start = time.perf_counter()
    # its own process group: a part past its time limit is stopped with the pytest process the sanitizer started
    proc = subprocess.Popen(
        command(sanitizer, part.tool, part.file, select=select),
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
        part.status, part.errors, part.first_error = classify(output, proc.returncode)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        part.status, part.first_error = "timeout", f"still running after {timeout:.0f} s (raise --timeout)"
    part.seconds = time.perf_counter() - start
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        (log_dir / f"{Path(part.file).stem}.{part.tool}.log").write_text(output)
    return part


def _csv(text: str, allowed=None, what="") -> list:
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        raise SanitizeError(f"--{what} is empty")
    if allowed is not None:
        bad = [s for s in items if s not in allowed]
        if bad:
            raise SanitizeError(f"--{what}: {', '.join(bad)} not one of {', '.join(allowed)}")
    return items


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpullm_lessons.sanitize", description=__doc__.split("\n")[0])
    p.add_argument("--tools", default=",".join(DEFAULT_TOOLS), help=f"comma-separated, from {', '.join(TOOLS)}")
    p.add_argument("--files", default=",".join(DEFAULT_FILES), help="comma-separated test files")
    p.add_argument("--select", default="", help="a pytest -k expression: only the tests it selects")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per part (default 600)")
    p.add_argument("--logs", default="runs/sanitize", help="where each part's full output goes")
    p.add_argument("--list", action="store_true", help="print the parts' commands and stop")
    args = p.parse_args(argv)
    try:
        tools = _csv(args.tools, TOOLS, "tools")
        files = _csv(args.files, None, "files")
        missing = [f for f in files if not (ROOT / f).is_file()]
        if missing:
            raise SanitizeError(f"--files: {', '.join(missing)} not found under {ROOT}")
        if not args.timeout > 0:
            raise SanitizeError(f"--timeout must be positive, got {args.timeout}")
        sanitizer = "compute-sanitizer" if args.list else find_sanitizer()
    except SanitizeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    parts = [Part(tool, f) for f in files for tool in tools]
    if args.list:
        for part in parts:
            print(" ".join(command(sanitizer, part.tool, part.file, select=args.select)))
        return 0
    print(f"{len(parts)} parts, up to {args.timeout:.0f} s each; logs in {args.logs}/", flush=True)
    for part in parts:
        run_part(part, sanitizer, args.timeout, ROOT / args.logs, args.select)
        note = f"  {part.first_error}" if part.first_error else ""
        print(
            f"{part.tool:<10} {part.file:<36} {part.status:<12} {part.errors:>5} errors {part.seconds:7.1f} s{note}",
            flush=True,
        )
    dirty = [p for p in parts if not p.clean]
    print(f"{len(parts) - len(dirty)} of {len(parts)} parts clean")
    return 1 if dirty else 0


if __name__ == "__main__":
    sys.exit(main())
