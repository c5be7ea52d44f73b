"""The training job and the launcher under a real SLURM: a one-node cluster started here (munged, slurmctld, slurmd in
a temporary folder, as root), the batch templates of lab/slurm/ submitted with sbatch, CPU ranks on the NumPy engine.

- the 2-GPU data-parallel template, its lab settings made this cluster's and the job given the tiny CPU config,
  trains like one process (losses to fp32 rounding), and the one-GPU template like one process exactly;
- the launcher inside an sbatch job starts its ranks with srun, and they train like one process too;
- a rank that dies mid-run fails the job (state FAILED, srun naming the task) instead of leaving rank 0 waiting;
- srun without a PMI is the training job's named error; with PMIx the NCCL id made on rank 0 reaches rank 1;
- lesson 13's NumPy strategies (ZeRO-3 as ZeRO++ with hpZ, tensor with sequence parallelism, the 1F1B pipeline,
  Ulysses, ring attention), each started by the launcher inside one job, train like one rank;
- the JupyterLab template serves the address the ssh command it prints leads to;
- the JupyterHub batch script (lab/jupyterhub/learner-server.sbatch), as the hub's SlurmSpawner renders it for a
  learner, makes the learner's folder on their first spawn and runs the server in it.

Needs Debian's slurm-wlm and munge (apt-get install slurm-wlm munge) and root (slurmd starts the tasks): skips
without them, fails instead on CI (GPULLM_REQUIRE_SLURM=1, set by .ci/run). Every daemon is stopped by its PID at the
end, also when a test fails. One at a time (tests/conftest.py ONE_AT_A_TIME): the ranks need both cores."""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from gpullm_lessons.parallel import launch as L
from gpullm_lessons import train

ROOT = Path(__file__).resolve().parents[1]
TEMPLATES = ROOT / "lab" / "slurm"
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "sinfo", "squeue", "scontrol", "scancel")
SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin"])  # the daemons live there on Debian
# the tiny CPU run of tests/test_train_ranks.py, overriding the templates' GPU settings (the last flag wins)
TINY = ["--preset", "tiny", "--backend", "numpy", "--precision", "fp32", "--n-layer", "1", "--n-head", "2",
        "--d-model", "32", "--block-size", "16", "--batch-size", "8", "--eval-every", "0", "--eval-batches", "1",
        "--sample-tokens", "0", "--no-progress", "--steps", "4"]  # fmt: skip


def _skip_or_fail(msg: str):
    """Missing SLURM pieces: a failure on CI (GPULLM_REQUIRE_SLURM=1, set by .ci/run), a skip elsewhere."""
    if os.environ.get("GPULLM_REQUIRE_SLURM") == "1":
        pytest.fail("GPULLM_REQUIRE_SLURM=1 but " + msg)
    pytest.skip(msg)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the templates, without a cluster --------------------------------------------------------------------------------


def test_templates_keep_the_lab_settings_on_top():
    """Every #SBATCH line comes before the first command (sbatch reads none after it), and the block a lab edits
    holds the partition, the GPUs, the time and the account."""
    names = sorted(p.name for p in TEMPLATES.glob("*.sbatch"))
    assert names == ["gpu-test.sbatch", "jupyter.sbatch", "train-2gpu.sbatch", "train.sbatch"]
    for name in names:
        lines = (TEMPLATES / name).read_text().splitlines()
        first_command = next(i for i, s in enumerate(lines) if s.strip() and not s.startswith("#"))
        late = [s for s in lines[first_command:] if s.startswith("#SBATCH")]
        assert not late, f"{name}: sbatch ignores {late}: they follow the command on line {first_command + 1}"
        start = next(i for i, s in enumerate(lines) if s.startswith("# ---- what a lab changes"))
        end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("# ----"))
        block = "\n".join(lines[start:end])
        for directive in ("#SBATCH --partition=", "#SBATCH --gpus-per-node=", "##SBATCH --gres=gpu:", "#SBATCH --time=",
                          "##SBATCH --account=", "#SBATCH --cpus-per-task="):  # fmt: skip
            assert directive in block, f"{name}: no {directive} in the lab's block"
        assert subprocess.run(["bash", "-n", str(TEMPLATES / name)]).returncode == 0
        text = "\n".join(lines)
        # a shared install may be read-only: the job works in the folder it was submitted from
        assert "# module load " in text and 'cd "$SLURM_SUBMIT_DIR"' in text, name
        assert 'cd "${COURSE_DIR' not in text, f"{name}: works in the course's folder"
    srun = (TEMPLATES / "train-2gpu.sbatch").read_text()
    assert '--cpus-per-task="${SLURM_CPUS_PER_TASK' in srun  # Slurm 22.05+: a step does not inherit it


def for_this_cluster(name: str, dest: Path, partition: str, templates: Path = TEMPLATES) -> Path:
    """lab/slurm/<name> with its lab block set for the test cluster: our partition, no GPUs, one CPU per task."""
    text = (templates / name).read_text()
    edits = [
        (r"^#SBATCH --partition=.*$", f"#SBATCH --partition={partition}"),
        (r"^#SBATCH --gpus-per-node=.*\n", ""),
        (r"^#SBATCH --cpus-per-task=.*$", "#SBATCH --cpus-per-task=1"),
    ]
    for pattern, new in edits:
        text, n = re.subn(pattern, new, text, count=1, flags=re.M)
        assert n == 1, f"{name}: the lab block has no line matching {pattern}"
    out = dest / name
    out.write_text(text)
    return out


# ---- the cluster ---------------------------------------------------------------------------------------------------


class Cluster:
    """A one-node SLURM in `root`: env (SLURM_CONF and the test's variables) for the client commands."""

    partition = "debug"

    def __init__(self, root: Path):
        self.root = root
        self.host = socket.gethostname().split(".")[0]
        self.procs: dict = {}
        self.env = L.mpi_env()  # as root, no core binding, one BLAS thread per rank (the ranks share 2 cores)
        self.env.update(
            GPULLM_DEVICE="sim",
            COURSE_DIR=str(ROOT),
            PY=sys.executable,
            PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        )
        for var in [v for v in self.env if v.startswith(("SLURM_", "PMI", "OMPI_COMM_WORLD"))] + ["GPULLM_COMM"]:
            self.env.pop(var, None)  # pytest itself may run in a job of another cluster (make gpu-test under sbatch)
        self.env.update(SLURM_CONF=str(root / "slurm.conf"), PATH=SEARCH_PATH)

    def write_config(self):
        r = self.root
        for d in ("state", "spool", "log", "run"):
            (r / d).mkdir()
        (r / "munge").mkdir(mode=0o700)  # the key: readable by root only, as munged insists
        (r / "sock").mkdir(mode=0o755)  # the socket's folder: every user must reach it, as munged insists
        key = r / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        (r / "slurm.conf").write_text(
            textwrap.dedent(f"""\
            ClusterName=gpullm-test
            SlurmctldHost={self.host}(127.0.0.1)
            SlurmctldPort={_free_port()}
            SlurmdPort={_free_port()}
            SlurmUser=root
            SlurmdUser=root
            AuthType=auth/munge
            CredType=cred/munge
            AuthInfo=socket={r}/sock/munge.sock
            StateSaveLocation={r}/state
            SlurmdSpoolDir={r}/spool
            SlurmctldPidFile={r}/run/slurmctld.pid
            SlurmdPidFile={r}/run/slurmd.pid
            SlurmctldLogFile={r}/log/slurmctld.log
            SlurmdLogFile={r}/log/slurmd.log
            ProctrackType=proctrack/linuxproc
            TaskPlugin=task/none
            SelectType=select/cons_tres
            SelectTypeParameters=CR_Core
            MpiDefault=none
            JobAcctGatherType=jobacct_gather/none
            AccountingStorageType=accounting_storage/none
            JobCompType=jobcomp/none
            ReturnToService=2
            InactiveLimit=0
            KillWait=5
            MinJobAge=600
            NodeName={self.host} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} State=UNKNOWN
            PartitionName={self.partition} Nodes={self.host} Default=YES MaxTime=INFINITE State=UP
            """)
        )

    def start(self):
        r = self.root
        self.write_config()
        daemons = {
            "munged": [
                "munged",
                "-F",
                f"--key-file={r}/munge/munge.key",
                f"--socket={r}/sock/munge.sock",
                f"--pid-file={r}/run/munged.pid",
                f"--log-file={r}/log/munged.log",
                f"--seed-file={r}/munge/seed",
            ],
            "slurmctld": ["slurmctld", "-D", "-i", "-f", str(r / "slurm.conf")],
            "slurmd": ["slurmd", "-D", "-N", self.host, "-f", str(r / "slurm.conf")],
        }
        for name, cmd in daemons.items():
            cmd[0] = shutil.which(cmd[0], path=SEARCH_PATH)
            with open(r / "log" / f"{name}.out", "w") as out:
                self.procs[name] = subprocess.Popen(
                    cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
                )
            if name == "munged":
                self.wait(lambda: (r / "sock" / "munge.sock").exists(), 20, "munged's socket")
        self.wait(
            lambda: self.run(["sinfo", "-h", "-N", "-o", "%T"]).stdout.strip() == "idle",
            60,
            "sinfo to show the node idle",
        )

    def wait(self, ready, timeout, what):
        deadline = time.time() + timeout
        while time.time() < deadline:
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead:
                pytest.fail(f"{dead} exited while waiting for {what}:\n{self.logs()}")
            if ready():
                return
            time.sleep(0.3)
        pytest.fail(f"no {what} after {timeout} s:\n{self.logs()}")

    def logs(self) -> str:
        parts = []
        for f in sorted((self.root / "log").glob("*")):
            parts.append(f"--- {f.name}\n" + "\n".join(f.read_text(errors="replace").splitlines()[-15:]))
        return "\n".join(parts)

    def run(self, cmd, timeout=120, **kw):
        env = kw.pop("env", None) or self.env
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=self.root, **kw)

    def sbatch(self, script, args=(), timeout=120, env=None):
        """Submit and wait for the end: (job id, the job's exit status, the job's output)."""
        out = self.root / f"job-{time.monotonic_ns()}.out"
        p = self.run(["sbatch", "--parsable", "-o", str(out), str(script), *map(str, args)], env=env)
        job = p.stdout.strip().split(";")[0]
        assert job.isdigit(), f"sbatch did not submit {script.name}: {p.stderr}"
        deadline = time.time() + timeout  # polled here: sbatch --wait checks every few seconds and up to 10 s apart
        while (state := self.job_state(job)).get("JobState") not in self.ENDED:
            if time.time() > deadline:
                self.run(["scancel", job])
                pytest.fail(f"job {job} ({script.name}) still {state} after {timeout} s")
            time.sleep(0.2)
        return job, int(state["ExitCode"].split(":")[0]), out.read_text() if out.exists() else ""

    ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")

    def job_state(self, job) -> dict:
        text = self.run(["scontrol", "show", "job", job]).stdout
        return dict(re.findall(r"\b(JobState|ExitCode)=(\S+)", text))

    def stop(self):
        """Cancel every job, then stop slurmd, slurmctld and munged (in that order), each by its PID."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            self.run(["scancel", "--full", "--quiet", f"--partition={self.partition}"], timeout=30)
            for _ in range(20):  # the steps' processes gone before slurmd, which tracks them
                if not self.run(["squeue", "-h"], timeout=30).stdout.strip():
                    break
                time.sleep(0.5)
        for name in ("slurmd", "slurmctld", "munged"):
            p = self.procs.get(name)
            if p is None or p.poll() is not None:
                continue
            os.kill(p.pid, signal.SIGTERM)
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.kill(p.pid, signal.SIGKILL)
                p.wait()


@pytest.fixture(scope="module")
def cluster():
    missing = [t for t in DAEMONS + CLIENTS if shutil.which(t, path=SEARCH_PATH) is None]
    if missing:
        _skip_or_fail(f"SLURM is not installed ({', '.join(missing)} not found): apt-get install slurm-wlm munge")
    if os.geteuid() != 0:
        _skip_or_fail("a test cluster needs root (slurmd starts the tasks as their user)")
    root = Path(tempfile.mkdtemp(prefix="gpullm-slurm-"))  # short: munged's socket path must fit in 108 bytes
    root.chmod(0o755)
    c = None
    try:
        c = Cluster(root)
        c.start()
        yield c
    finally:
        if c is not None:
            c.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The tiny run in this process: the reference every SLURM run is compared with."""
    out = tmp_path_factory.mktemp("one")
    train.main(TINY + ["--out", str(out)])
    return losses(out)


def losses(out: Path) -> np.ndarray:
    return np.array([json.loads(line)["loss"] for line in (out / "log.jsonl").read_text().splitlines()])


# ---- jobs ----------------------------------------------------------------------------------------------------------


def test_the_templates_train_like_one_process(cluster, one_process):
    two = for_this_cluster("train-2gpu.sbatch", cluster.root, cluster.partition)
    job, rc, log = cluster.sbatch(two, TINY + ["--out", cluster.root / "two"])
    assert rc == 0 and cluster.job_state(job) == {"JobState": "COMPLETED", "ExitCode": "0:0"}, log[-3000:]
    assert "data parallel: 2 rank(s) over mpi" in log and "replicas identical" in log, log[-3000:]
    np.testing.assert_allclose(losses(cluster.root / "two"), one_process, rtol=1e-5)

    one = for_this_cluster("train.sbatch", cluster.root, cluster.partition)
    before = course_files()
    job, rc, log = cluster.sbatch(one, TINY)  # no --out: the run's default folder, under the submit folder
    assert rc == 0 and cluster.job_state(job)["JobState"] == "COMPLETED", log[-3000:]
    assert f"training in {cluster.root}" in log, log[-3000:]
    (run,) = (cluster.root / "runs").glob("*/log.jsonl")
    assert list(losses(run.parent)) == list(one_process)  # the same one-rank run: the same numbers
    assert course_files() == before  # nothing written in the course's folder (a shared install may be read-only)


def course_files() -> set:
    """What the course's folder holds at its top and in runs/ (where a job that worked there would write)."""
    return {p.name for p in ROOT.iterdir()} | {f"runs/{p.name}" for p in (ROOT / "runs").glob("*")}


SHOW_RANK = (
    'import os; print("started as", *(os.environ.get(v) for v in ("SLURM_PROCID", "SLURM_STEP_ID", "PMIX_RANK")))\n'
)


def test_the_launcher_starts_ranks_with_srun_in_a_job(cluster, one_process):
    (cluster.root / "show_rank.py").write_text(SHOW_RANK)  # a module that prints how its rank was started
    script = cluster.root / "launch.sbatch"
    script.write_text(
        textwrap.dedent(f"""\
        #!/bin/bash
        #SBATCH --ntasks=2
        set -e
        "$PY" -m gpullm_lessons.parallel.launch --nproc 2 -- {" ".join(TINY)} --out {cluster.root / "launched"}
        PYTHONPATH={cluster.root}:$PYTHONPATH "$PY" -m gpullm_lessons.parallel.launch --nproc 2 --module show_rank
        """)
    )
    job, rc, log = cluster.sbatch(script)
    assert rc == 0, log[-3000:]
    assert "data parallel: 2 rank(s) over mpi" in log, log[-3000:]
    np.testing.assert_allclose(losses(cluster.root / "launched"), one_process, rtol=1e-5)
    # the launcher started a job step with srun --mpi=pmix (the second step of the job), not mpirun
    ranks = sorted(line.split()[2:] for line in log.splitlines() if line.startswith("started as "))
    assert ranks == [["0", "1", "0"], ["1", "1", "1"]], log[-3000:]


# the NumPy strategies of lesson 13, each on 2 ranks started by the launcher inside one job (srun, PMIx)
MODEL = ["--n-layer", "2", "--n-head", "2", "--d-model", "32", "--block-size", "16", "--batch-size", "8", "--steps", "2"]  # fmt: skip
STRATEGIES = {
    "zeropp-hpz": ["zero3", "--quantized", "--hpz", "1"],
    "tensor-sp": ["tensor", "--sequence-parallel"],
    "pipeline": ["pipeline", "--micro-batches", "2"],
    "ulysses": ["ulysses"],
}


def test_every_strategy_trains_under_srun_like_one_rank(cluster):
    import contextlib
    import io

    from gpullm_lessons.parallel import pipeline, tensor, ulysses, zero3
    from gpullm_lessons.parallel.comm import SingleComm

    lines = [
        f'"$PY" -m gpullm_lessons.parallel.launch --nproc 2 --module gpullm_lessons.parallel -- {" ".join(a)} '
        f"{' '.join(MODEL)} --json {cluster.root / name}.json"
        for name, a in STRATEGIES.items()
    ]
    lines.append(
        f'"$PY" -m gpullm_lessons.parallel.launch --nproc 2 --module gpullm_lessons.parallel -- ring-attention '
        f"--json {cluster.root / 'ring'}.json"
    )
    script = cluster.root / "strategies.sbatch"
    script.write_text("#!/bin/bash\n#SBATCH --ntasks=2\nset -e\n" + "\n".join(lines) + "\n")
    job, rc, log = cluster.sbatch(script, timeout=240)
    assert rc == 0 and cluster.job_state(job)["JobState"] == "COMPLETED", log[-3000:]
    modules = {"zero3": zero3, "tensor": tensor, "pipeline": pipeline, "ulysses": ulysses}
    for name, args in STRATEGIES.items():
        got = json.loads((cluster.root / f"{name}.json").read_text())
        assert got["world"] == 2 if "world" in got else got["stages"] == 2, name
        if name == "zeropp-hpz":  # the int8 gradient sums differ with the rank count: hpZ against ZeRO++ itself
            continue
        with contextlib.redirect_stdout(io.StringIO()):
            one = modules[args[0]].main([*args[1:], *MODEL], comm=SingleComm())
        np.testing.assert_allclose(got["losses"], one["losses"], rtol=0, atol=1e-5, err_msg=name)
    assert json.loads((cluster.root / "ring.json").read_text())["ok"] is True
    assert json.loads((cluster.root / "zeropp-hpz.json").read_text())["hpz_measured"]["secondary_peak_bytes"] > 0


# rank 1 dies while training step 3, after rank 0 and it have joined two all-reduces: rank 0 then waits in the next
CRASH_RANK_1 = textwrap.dedent("""\
    #!{python}
    import os
    import runpy
    import sys

    from gpullm_lessons import engine

    build = engine.build

    def crashing_build(*a, **k):
        eng = build(*a, **k)
        backward = eng.backward

        def crash(*a, **k):
            if eng.t == 2 and os.environ["SLURM_PROCID"] == "1":
                os._exit(17)
            return backward(*a, **k)

        eng.backward = crash
        return eng

    engine.build = crashing_build
    assert sys.argv[1] == "-m"  # the template runs "$PY" -m MODULE ARGS
    sys.argv = [sys.argv[2]] + sys.argv[3:]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    """)


def test_a_failing_rank_fails_the_job(cluster):
    py = cluster.root / "python-crashing-rank-1"
    py.write_text(CRASH_RANK_1.format(python=sys.executable))
    py.chmod(0o755)
    two = for_this_cluster("train-2gpu.sbatch", cluster.root, cluster.partition)
    t0 = time.time()
    job, rc, log = cluster.sbatch(
        two, TINY + ["--steps", "6", "--out", cluster.root / "crash"], env=dict(cluster.env, PY=str(py))
    )
    assert rc != 0 and cluster.job_state(job)["JobState"] == "FAILED", log[-3000:]
    assert re.search(r"task 1: Exited with exit code 17", log), log[-3000:]
    assert time.time() - t0 < 60, "the job waited for the dead rank"
    assert len(losses(cluster.root / "crash")) == 2  # rank 0 logged steps 1 and 2, then was stopped


def test_srun_without_pmi_is_a_named_error(cluster):
    p = cluster.run(
        [
            "srun",
            "--mpi=none",
            "-n",
            "2",
            sys.executable,
            "-m",
            "gpullm_lessons.parallel",
            "train",
            *TINY,
            "--out",
            str(cluster.root / "nopmi"),
        ]
    )
    assert p.returncode != 0
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    errors = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 2 and "srun --mpi=pmix" in errors[0], p.stderr[-3000:]


NCCL_ID_OVER_PMIX = textwrap.dedent("""\
    import os

    from gpullm_lessons.parallel import comm

    made = []

    def nccl_id_hex(nccl=None):  # NCCL's id is random bytes: here made without a GPU
        made.append(os.urandom(128).hex())
        return made[-1]

    class NCCLStandIn:  # records what NCCLComm would be made with
        def __init__(self, rank, world, uid, local_rank=None):
            self.args = rank, world, uid, local_rank

    comm.nccl_id_hex, comm.NCCLComm = nccl_id_hex, NCCLStandIn
    c = comm.from_env("nccl")
    print("rank", *c.args, "made", made[0] if made else None, "local", comm.MPIComm().local_rank, flush=True)
    """)


def test_the_nccl_id_travels_through_pmix(cluster):
    script = cluster.root / "nccl_id.py"
    script.write_text(NCCL_ID_OVER_PMIX)
    p = cluster.run(["srun", "--mpi=pmix", "-n", "2", "--kill-on-bad-exit=1", sys.executable, str(script)])
    assert p.returncode == 0, p.stderr[-3000:]
    # each line: rank <rank> <world> <id> <local rank> made <id made here or None> local <MPIComm's local rank>
    rows = sorted(line.split() for line in p.stdout.splitlines() if line.startswith("rank "))
    assert [[r[1], r[2], r[4], r[8]] for r in rows] == [["0", "2", "0", "0"], ["1", "2", "1", "1"]], p.stdout
    uid0, uid1 = rows[0][3], rows[1][3]
    assert len(uid0) == 256 and uid1 == uid0  # rank 1 got the id rank 0 made
    assert rows[0][6] == uid0 and rows[1][6] == "None"  # and made none of its own


def test_the_jupyter_template_serves_what_it_prints(cluster):
    """JupyterLab rooted at the submit folder, on the node's 127.0.0.1, reached through the printed ssh -J tunnel;
    the token in a file only its owner reads, not in the job's log; the idle server ends its job by itself."""
    script = for_this_cluster("jupyter.sbatch", cluster.root, cluster.partition)
    out = cluster.root / "jupyter.out"
    env = dict(cluster.env, LOGIN_HOST="login.example.org", JUPYTER_RUNTIME_DIR=str(cluster.root / "jupyter-rt"),
               IDLE_SHUTDOWN="5")  # fmt: skip
    before = course_files()
    p = cluster.run(["sbatch", "--parsable", "-o", str(out), str(script), "--allow-root"], env=env)  # CI: root
    job = p.stdout.strip()
    assert job.isdigit(), p.stderr
    try:
        deadline, m, text = time.time() + 30, None, ""
        while m is None and time.time() < deadline and cluster.job_state(job).get("JobState") in ("PENDING", "RUNNING"):
            time.sleep(0.5)
            text = out.read_text() if out.exists() else ""
            m = re.search(r"ssh -N -J (\S+)@login\.example\.org -L (\d+):localhost:(\d+) (\S+)@(\S+)", text)
        assert m, f"no ssh command in the job's output:\n{text}"
        user, port, port2, user2, node = m.groups()
        assert port == port2 and user == user2 and node == socket.gethostname()
        url_file = cluster.root / f"jupyter-{job}.url"
        assert url_file.stat().st_mode & 0o077 == 0, oct(url_file.stat().st_mode)  # its owner's alone
        url = re.fullmatch(r"http://localhost:(\d+)/lab\?token=(\w+)\n", url_file.read_text())
        assert url and url.group(1) == port and url.group(2) not in text  # the token is not in the log
        # what the tunnel reaches on the node: 127.0.0.1:PORT, with the token, rooted at the submit folder
        listing, deadline = None, time.time() + 60
        while listing is None and time.time() < deadline and cluster.job_state(job).get("JobState") == "RUNNING":
            try:
                with urllib.request.urlopen(
                    f"http://127.0.0.1:{port}/api/contents?token={url.group(2)}", timeout=5
                ) as r:
                    listing = json.loads(r.read())
            except OSError:
                time.sleep(1)
        assert listing is not None, out.read_text()[-3000:]
        assert "slurm.conf" in {item["name"] for item in listing["content"]}  # the cluster's folder: submitted there
        # idle: no request after this one; the server stops itself (checked once a minute) and the job ends
        deadline = time.time() + 150
        while cluster.job_state(job).get("JobState") in ("PENDING", "RUNNING") and time.time() < deadline:
            time.sleep(2)
        assert cluster.job_state(job).get("JobState") == "COMPLETED", out.read_text()[-3000:]
        assert course_files() == before
    finally:
        cluster.run(["scancel", job])


def test_the_hubs_batch_script_runs_in_the_learners_folder(cluster):
    """lab/jupyterhub/learner-server.sbatch rendered by the hub's SlurmSpawner for a learner (tests/test_jupyterhub.py
    starts the hub itself), its lab block made this cluster's, a probe in place of the server: the first job makes
    the learner's folder with `python -m gpullm_lessons start` and runs there; the next leaves the folder as it is."""
    from test_jupyterhub import hub_module

    hub = hub_module()
    from jupyterhub.objects import Hub

    script = for_this_cluster("learner-server.sbatch", cluster.root, cluster.partition, ROOT / "lab" / "jupyterhub")
    me = pwd.getpwuid(os.getuid()).pw_name  # the job runs as the learner: here, whoever runs the tests
    home = cluster.root / "home-of-learner"
    home.mkdir()
    spawner = hub.CourseSlurmSpawner(
        user=SimpleNamespace(name=me, url=f"/user/{me}/", escaped_name=me),
        hub=Hub(),
        batch_script_file=str(script),
        req_homedir=str(home),
        course_python=sys.executable,
    )
    probe = cluster.root / "probe.py"
    probe.write_text('import os\nprint("server runs in", os.getcwd())\n')
    rendered = cluster.root / "rendered.sbatch"
    rendered.write_text(asyncio.run(spawner.render_batch_script(cmd=f"{sys.executable} {probe}")))
    folder = home / "gpullm-work"
    before = course_files()
    job, rc, log = cluster.sbatch(rendered)
    assert rc == 0 and cluster.job_state(job)["JobState"] == "COMPLETED", log[-3000:]
    assert f"server runs in {folder}\n" in log, log[-3000:]
    exercises = sorted(p.name for p in (ROOT / "exercises").glob("*.ipynb"))
    assert sorted(p.name for p in folder.iterdir()) == exercises, log[-3000:]  # made by `start`
    (folder / exercises[0]).write_text("the learner's work")
    job, rc, log = cluster.sbatch(rendered)  # the next spawn: the folder is theirs, never copied over again
    assert rc == 0 and f"server runs in {folder}\n" in log, log[-3000:]
    assert (folder / exercises[0]).read_text() == "the learner's work"
    assert course_files() == before
