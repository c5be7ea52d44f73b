"""Start N ranks of a module: one process per GPU (NCCL) or per CPU rank (MPI).

    python -m gpullm_lessons.parallel.launch --nproc 2 -- --steps 100                  # python -m gpullm_lessons.train ...
    python -m gpullm_lessons.parallel.launch --nproc 2 --module gpullm_lessons.parallel -- selftest
    python -m gpullm_lessons.parallel.launch --nproc 2 --backend mpi -- --backend numpy --steps 20

--backend auto (the default): nccl when this machine has a GPU, CuPy and NCCL; mpi otherwise.

nccl  N child processes `python -m MODULE ARGS`, each with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
      GPULLM_COMM=nccl and GPULLM_NCCL_ID (the NCCL unique id, made here, as hex). Every rank sees every GPU and
      picks GPU LOCAL_RANK itself (comm.from_env), so NCCL can use NVLink / P2P between them. The launcher waits;
      when a rank fails it stops the others and exits with that rank's status.
mpi   mpirun -n N python -m MODULE ARGS (the ranks read OMPI_COMM_WORLD_*). As root it sets OMPI_ALLOW_RUN_AS_ROOT
      (and _CONFIRM); with more ranks than cores it adds --oversubscribe; ranks are not bound to cores.

srun  inside a SLURM allocation (an sbatch script, an salloc shell; --via auto picks it there, --via srun forces it):
      srun --mpi=pmix --ntasks N --kill-on-bad-exit=1 python -m MODULE ARGS, with GPULLM_COMM=nccl|mpi. The tasks
      go where the allocation has room, on one node or several; they find each other through SLURM's PMIx (MPI_Init;
      under NCCL rank 0 makes the unique id and broadcasts it over that MPI: see parallel/comm.py), so mpi4py is needed for
      both backends. A failing task makes srun stop the others (--kill-on-bad-exit) and exit non-zero. The PMI type
      comes from SLURM_MPI_TYPE when set (e.g. pmi2 for an MPICH-based mpi4py), else pmix.

mpirun directly works as well, on one node or several:
    mpirun -n 2 python -m gpullm_lessons.train --backend numpy ...
    mpirun -n 8 --hostfile hosts python -m gpullm_lessons.parallel train --backend hip --preset gpt2
(a hostfile lists `node slots=GPUs` per line; on GPU nodes rank 0 makes the NCCL id and broadcasts it over MPI.)
and so does srun in an sbatch script (lab/slurm/ has templates):
    srun --mpi=pmix --kill-on-bad-exit=1 -n 2 python -m gpullm_lessons.parallel train --backend hip ...
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time

DEFAULT_MODULE = "gpullm_lessons.train"


class LaunchError(RuntimeError):
    """The ranks cannot be started; the message says why and what to install or change."""


def mpi_env(base=None) -> dict:
    """The environment mpirun needs here: running as root allowed (containers, CI), no core binding warnings."""
    env = dict(os.environ if base is None else base)
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    # containers often forbid the cross-memory attach that Open MPI's shared-memory transport tries first
    env.setdefault("OMPI_MCA_btl_vader_single_copy_mechanism", "none")
    env.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")
    for var in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "OMP_NUM_THREADS"):
        env.setdefault(var, "1")  # N ranks share the cores: one BLAS thread each
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GPULLM_NCCL_ID"):
        env.pop(var, None)  # mpirun's variables rule under mpirun
    return env


def mpirun_command(nproc: int, argv, module=DEFAULT_MODULE, python=None) -> list:
    """The mpirun command line that starts nproc ranks of `python -m module argv` on this machine."""
    mpirun = shutil.which("mpirun") or shutil.which("mpiexec")
    if mpirun is None:
        raise LaunchError(
            "mpirun not found: install an MPI (Debian/Ubuntu: apt-get install openmpi-bin "
            "libopenmpi-dev; conda: conda install -c conda-forge openmpi) and pip install mpi4py"
        )
    cmd = [mpirun, "-n", str(nproc)]
    if nproc > (os.cpu_count() or 1):
        cmd.append("--oversubscribe")
    cmd += ["--bind-to", "none", python or sys.executable, "-m", module, *argv]
    return cmd


def in_slurm_allocation() -> bool:
    """True in a SLURM job outside any step's tasks (an sbatch script, an salloc shell): srun starts the ranks."""
    from .comm import under_srun

    return "SLURM_JOB_ID" in os.environ and not under_srun()


def srun_command(nproc: int, argv, module=DEFAULT_MODULE, python=None) -> list:
    """The srun command line that starts nproc ranks of `python -m module argv` in this SLURM allocation."""
    srun = shutil.which("srun")
    if srun is None:
        raise LaunchError(
            "srun not found: --via srun needs SLURM's client commands (Debian/Ubuntu: apt-get install "
            "slurm-client), and a SLURM allocation to run in (sbatch / salloc)"
        )
    mpi = os.environ.get("SLURM_MPI_TYPE") or "pmix"
    return [
        srun,
        f"--mpi={mpi}",
        "--ntasks",
        str(nproc),
        "--kill-on-bad-exit=1",
        python or sys.executable,
        "-m",
        module,
        *argv,
    ]


def _has_mpi4py() -> bool:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return True


def gpu_count() -> int:
    from .. import device

    if not device.has_gpu():
        return 0
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


def choose_backend(backend: str, nproc: int, via="local") -> str:
    """auto -> nccl or mpi (module docstring); errors say what is missing. via="srun": the ranks may run on other
    nodes (each checks its own GPU), and find each other over MPI whatever the backend, so mpi4py is needed."""
    from .comm import nccl_module

    if backend not in ("auto", "mpi", "nccl"):
        raise LaunchError(f"--backend must be auto, mpi or nccl, got {backend!r}")
    n_gpu = gpu_count()
    if backend == "auto":
        backend = "nccl" if n_gpu > 0 and nccl_module() is not None else "mpi"
    if backend == "nccl":
        if n_gpu == 0:
            raise LaunchError(
                "--backend nccl needs GPUs and this machine has none (or CuPy is missing): use "
                "--backend mpi for CPU ranks"
            )
        if nproc > n_gpu and via != "srun":
            raise LaunchError(
                f"--nproc {nproc} is larger than the {n_gpu} GPU(s) of this machine: one rank per GPU "
                f"(for more ranks than GPUs use --backend mpi; several nodes: mpirun --hostfile)"
            )
        if nccl_module() is None:
            raise LaunchError(
                "--backend nccl: CuPy found no NCCL library (pip install nvidia-nccl-cu13, or cu12, "
                "to match cupy-cuda13x / 12x), or use --backend mpi"
            )
    if (backend == "mpi" or via == "srun") and not _has_mpi4py():
        raise LaunchError(
            f"--backend {backend}{' under srun' if via == 'srun' else ''}: mpi4py is not installed: "
            f"pip install mpi4py (or pip install -e '.[mpi]'), with an MPI library (apt-get install "
            f"openmpi-bin libopenmpi-dev)"
        )
    return backend


def launch_nccl(nproc: int, argv, module=DEFAULT_MODULE, env=None) -> int:
    """Start nproc ranks with the NCCL variables (module docstring); returns the first failing rank's status or 0."""
    from .comm import nccl_id_hex

    base = dict(os.environ if env is None else env)
    uid = nccl_id_hex()  # NCCL's bootstrap root lives in this process until they join
    envs = [
        dict(
            base,
            RANK=str(r),
            WORLD_SIZE=str(nproc),
            LOCAL_RANK=str(r),
            LOCAL_WORLD_SIZE=str(nproc),
            GPULLM_COMM="nccl",
            GPULLM_NCCL_ID=uid,
        )
        for r in range(nproc)
    ]
    return run_ranks([[sys.executable, "-m", module, *argv]] * nproc, envs)


def run_ranks(commands, envs, poll_s=0.05, grace_s=10.0) -> int:
    """Start one process per (command, env); wait. When one exits non-zero, the others get SIGTERM (SIGKILL after
    grace_s) and that status is returned; 0 when all succeed."""
    procs = [subprocess.Popen(cmd, env=env) for cmd, env in zip(commands, envs)]
    status = 0
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                r, status = failed[0]
                status = 128 - status if status < 0 else status  # killed by signal k: 128 + k, as a shell says
                print(f"launch: rank {r} exited with status {status}; stopping the other ranks", file=sys.stderr)
                break
            if all(c == 0 for c in codes):
                return 0
            time.sleep(poll_s)
    except KeyboardInterrupt:
        status = 130
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.time() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return status


def launch(nproc: int, argv, module=DEFAULT_MODULE, backend="auto", via="auto") -> int:
    """Start nproc ranks of `python -m module argv` (module docstring); returns the exit status.
    via: "local" (child processes or mpirun on this machine), "srun" (in a SLURM allocation) or "auto" (srun inside
    an allocation, local elsewhere)."""
    if nproc < 1:
        raise LaunchError(f"--nproc must be >= 1, got {nproc}")
    if via not in ("auto", "local", "srun"):
        raise LaunchError(f"--via must be auto, local or srun, got {via!r}")
    if via == "auto":
        via = "srun" if in_slurm_allocation() else "local"
    backend = choose_backend(backend, nproc, via)
    if via == "srun":
        if "SLURM_JOB_ID" not in os.environ:
            raise LaunchError(
                "--via srun outside a SLURM job: submit with sbatch (lab/slurm/ has templates) or "
                "start an allocation with salloc first"
            )
        return subprocess.call(srun_command(nproc, argv, module), env=dict(mpi_env(), GPULLM_COMM=backend))
    if backend == "nccl":
        return launch_nccl(nproc, argv, module)
    cmd = mpirun_command(nproc, argv, module)
    return subprocess.call(cmd, env=dict(mpi_env(), GPULLM_COMM="mpi"))


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest = []
    if "--" in argv:
        i = argv.index("--")
        argv, rest = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(
        prog="python -m gpullm_lessons.parallel.launch",
        description=__doc__.split("\n")[0],
        epilog="everything after -- goes to the module, e.g. -- --steps 100",
    )
    p.add_argument("--nproc", type=int, required=True, help="number of ranks (one per GPU, or CPU ranks)")
    p.add_argument(
        "--backend",
        default="auto",
        choices=("auto", "mpi", "nccl"),
        help="nccl: one process per GPU; mpi: mpirun (CPU ranks); auto: nccl with GPUs, else mpi",
    )
    p.add_argument("--module", default=DEFAULT_MODULE, help="the module each rank runs (python -m MODULE)")
    p.add_argument(
        "--via",
        default="auto",
        choices=("auto", "local", "srun"),
        help="srun: srun --mpi=pmix in this SLURM allocation (several nodes); local: this machine; "
        "auto: srun inside a SLURM job, local elsewhere",
    )
    args = p.parse_args(argv)
    try:
        return launch(args.nproc, rest, args.module, args.backend, args.via)
    except LaunchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
