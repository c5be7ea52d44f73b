"""Starting ranks from a notebook or a test: how this machine can start N of them, and a launcher run as a
subprocess."""

from __future__ import annotations

import os
import sys


def launch_plan(nproc: int = 2) -> dict:
    """How this machine can start nproc ranks: {"comm": "nccl" | "mpi" | None, "engine": "hip" | "numpy" | None,
    "why": one line}. NCCL with the hip engine when there are nproc GPUs and NCCL, else MPI ranks on the CPU with the
    NumPy engine, else None (the line says what is missing)."""
    from . import launch as L

    errors = []
    for backend in ("auto", "mpi"):
        try:
            comm = L.choose_backend(backend, nproc)
            if comm == "mpi":
                L.mpirun_command(nproc, [])
        except L.LaunchError as e:
            errors.append(str(e))
            continue
        engine = "hip" if comm == "nccl" else "numpy"
        return {
            "comm": comm,
            "engine": engine,
            "why": f"{nproc} ranks over {comm}, one per {'GPU' if comm == 'nccl' else 'CPU process'}, engine {engine}",
        }
    return {"comm": None, "engine": None, "why": "; ".join(dict.fromkeys(errors))}


def launch_subprocess(nproc, module_args, module="gpullm_lessons.parallel", comm="auto", timeout=600):
    """Run `python -m gpullm_lessons.parallel.launch --nproc N --backend comm --module module -- module_args` and wait
    (for notebooks and tests); returns the subprocess.CompletedProcess (stdout, stderr as text)."""
    import subprocess
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [
        sys.executable,
        "-m",
        "gpullm_lessons.parallel.launch",
        "--nproc",
        str(nproc),
        "--backend",
        comm,
        "--module",
        module,
        "--",
        *[str(a) for a in module_args],
    ]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
