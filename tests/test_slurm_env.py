"""SLURM's environment as the communicators and the launcher read it, in one process with fakes (tests/test_slurm.py
runs the same code under a real SLURM): the ranks of an srun step, the sbatch script that is not one, bad values,
the rendezvous (PMIx, or a named error without a PMI), the NCCL id over it, and the launcher's srun command."""

import pytest

from gpullm_lessons.parallel import comm as C
from gpullm_lessons.parallel import launch as L
from gpullm_lessons import train

RANK_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "PMI_SIZE",
    "PMI_RANK",
    "PMI_FD",
    "MPI_LOCALRANKID",
    "PMIX_RANK",
    "PMIX_NAMESPACE",
    "SLURM_JOB_ID",
    "SLURM_STEP_ID",
    "SLURM_STEPID",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "SLURM_MPI_TYPE",
    C.COMM_ENV,
    C.NCCL_ID_ENV,
)


@pytest.fixture
def env(monkeypatch):
    """A clean slate (none of the launchers' variables), then setenv(**vars)."""
    for var in RANK_VARS:
        monkeypatch.delenv(var, raising=False)

    def setenv(**values):
        for k, v in values.items():
            monkeypatch.setenv(k, str(v))

    return setenv


def srun_task(rank, ntasks, local, step=0, pmi=None):
    """The variables srun gives task `rank` of step `step` (pmi: None for --mpi=none, "pmix" or "pmi2")."""
    v = dict(
        SLURM_JOB_ID=42,
        SLURM_STEP_ID=step,
        SLURM_STEPID=step,
        SLURM_PROCID=rank,
        SLURM_NTASKS=ntasks,
        SLURM_LOCALID=local,
    )
    if pmi == "pmix":
        v.update(PMIX_RANK=rank, PMIX_NAMESPACE="slurm.pmix.42.0")
    if pmi == "pmi2":
        v.update(PMI_RANK=rank, PMI_SIZE=ntasks, PMI_FD=11)
    return v


# ---- ranks -----------------------------------------------------------------------------------------------------------


def test_an_srun_task_is_a_rank(env):
    env(**srun_task(rank=3, ntasks=4, local=1))
    assert C.under_srun()
    assert C.env_world() == (3, 4, 1)


def test_the_batch_script_and_slurms_own_steps_are_one_process(env):
    # an sbatch script sees SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID but no step id (checked on SLURM 22.05)
    env(SLURM_JOB_ID=42, SLURM_PROCID=0, SLURM_NTASKS=2, SLURM_LOCALID=0)
    assert not C.under_srun() and C.env_world() == (0, 1, 0)
    assert L.in_slurm_allocation()
    for special in (0xFFFFFFFE, 0xFFFFFFFA):  # the batch step, the interactive step
        env(SLURM_STEP_ID=special, SLURM_STEPID=special)
        assert not C.under_srun() and C.env_world() == (0, 1, 0)
    env(SLURM_STEP_ID="batch", SLURM_STEPID="batch")
    assert not C.under_srun()


def test_mpiruns_variables_win_over_the_allocations(env):
    # mpirun inside an allocation: its ranks inherit SLURM_* of the step that started Open MPI's daemons
    env(
        **srun_task(rank=0, ntasks=1, local=0),
        OMPI_COMM_WORLD_SIZE=4,
        OMPI_COMM_WORLD_RANK=2,
        OMPI_COMM_WORLD_LOCAL_RANK=0,
    )
    assert C.env_world() == (2, 4, 0)
    assert C.mpi_rendezvous() == "mpirun"


def test_the_local_rank_defaults_to_the_rank(env, monkeypatch):
    env(**srun_task(rank=1, ntasks=2, local=0))
    monkeypatch.delenv("SLURM_LOCALID")
    assert C.env_world() == (1, 2, 1)


@pytest.mark.parametrize(
    "values, words",
    [
        (dict(SLURM_NTASKS="two"), ["SLURM_NTASKS='two'", "expected integers"]),
        (dict(SLURM_PROCID=""), ["SLURM_PROCID=''", "expected integers"]),
        (dict(SLURM_LOCALID="0x1"), ["SLURM_LOCALID='0x1'", "expected integers"]),
        (dict(SLURM_PROCID=4), ["SLURM_PROCID=4 is not in 0..SLURM_NTASKS-1=3"]),
        (dict(SLURM_PROCID=-1), ["SLURM_PROCID=-1 is not in 0..SLURM_NTASKS-1=3"]),
        (dict(SLURM_NTASKS=0, SLURM_PROCID=0), ["SLURM_PROCID=0 is not in 0..SLURM_NTASKS-1=-1"]),
        (dict(SLURM_LOCALID=-1), ["SLURM_LOCALID=-1 is not in 0..SLURM_NTASKS-1=3"]),
        (dict(SLURM_LOCALID=4), ["SLURM_LOCALID=4 is not in 0..SLURM_NTASKS-1=3", "local rank"]),
    ],
)
def test_bad_values_are_named(env, values, words):
    env(**{**srun_task(rank=1, ntasks=4, local=1), **values})
    with pytest.raises(C.CommError) as e:
        C.env_world()
    for w in words:
        assert w in str(e.value)


# ---- the rendezvous ----------------------------------------------------------------------------------------------------


def test_srun_without_a_pmi_is_refused_with_the_fix(env):
    env(**srun_task(rank=0, ntasks=2, local=0))
    for backend in ("mpi", "nccl"):
        with pytest.raises(C.CommError, match=r"srun started 2 tasks \(SLURM_NTASKS=2\) without a PMI") as e:
            C.from_env(backend)
        assert "srun --mpi=pmix" in str(e.value) and "MpiDefault=pmix" in str(e.value)
    # the training job turns it into its one-line configuration error (exit status 2)
    with pytest.raises(train.ConfigError, match="srun --mpi=pmix"):
        train.communicator("numpy")


def test_one_task_needs_no_pmi(env):
    env(**srun_task(rank=0, ntasks=1, local=0))
    assert C.mpi_rendezvous() is None
    assert isinstance(C.from_env(), C.SingleComm)


@pytest.mark.parametrize("pmi", ["pmix", "pmi2"])
def test_srun_with_a_pmi_makes_mpi_ranks(env, monkeypatch, pmi):
    env(**srun_task(rank=1, ntasks=2, local=1, pmi=pmi))
    assert C.mpi_rendezvous() == f"srun --mpi={pmi}"

    class FakeMPI:  # what MPI_Init over the PMI gives: this task's place in COMM_WORLD
        world_size, rank = 2, 1

    monkeypatch.setattr(C, "MPIComm", FakeMPI)
    assert isinstance(C.from_env("mpi"), FakeMPI)
    FakeMPI.world_size = 3  # a PMI that joined other tasks than srun says: named, not trained on
    with pytest.raises(C.CommError, match="MPI has 3 ranks but the environment says WORLD_SIZE=2"):
        C.from_env("mpi")


@pytest.mark.parametrize("rank", [0, 1])
def test_the_nccl_id_travels_over_the_pmix_rendezvous(env, monkeypatch, rank):
    """Rank 0 makes the id, every rank gets rank 0's from the MPI broadcast, NCCLComm is made with it (fakes for
    NCCL and MPI; tests/test_slurm.py sends an id between two real srun tasks)."""
    env(**srun_task(rank=rank, ntasks=2, local=rank, pmi="pmix"))
    made, sent = [], "ab" * 128

    def nccl_id_hex(nccl=None):
        made.append(sent)
        return sent

    class FakeMPI:
        def __init__(self):
            self.rank = rank

        def bcast_object(self, obj, root=0):
            assert root == 0 and (obj == sent) == (rank == 0)  # only rank 0 passes a value in
            return sent

    class FakeNCCL:
        def __init__(self, r, world, uid, local_rank=None):
            self.args = (r, world, uid, local_rank)

    monkeypatch.setattr(C, "nccl_id_hex", nccl_id_hex)
    monkeypatch.setattr(C, "MPIComm", FakeMPI)
    monkeypatch.setattr(C, "NCCLComm", FakeNCCL)
    monkeypatch.setattr(C, "_use_gpu", lambda r, local, required=True: None)
    c = C.from_env("nccl")
    assert c.args == (rank, 2, sent, rank)
    assert made == ([sent] if rank == 0 else [])


# ---- the launcher --------------------------------------------------------------------------------------------------


def test_srun_command(env, monkeypatch):
    monkeypatch.setattr(L.shutil, "which", lambda name: "/usr/bin/" + name)
    cmd = L.srun_command(2, ["selftest"], module="gpullm_lessons.parallel", python="py")
    assert cmd == [
        "/usr/bin/srun",
        "--mpi=pmix",
        "--ntasks",
        "2",
        "--kill-on-bad-exit=1",
        "py",
        "-m",
        "gpullm_lessons.parallel",
        "selftest",
    ]
    env(SLURM_MPI_TYPE="pmi2")
    assert L.srun_command(2, [], python="py")[1] == "--mpi=pmi2"
    monkeypatch.setattr(L.shutil, "which", lambda name: None)
    with pytest.raises(L.LaunchError, match="srun not found"):
        L.srun_command(2, [])


def test_the_launcher_uses_srun_inside_an_allocation(env, monkeypatch):
    calls = []
    monkeypatch.setattr(L.shutil, "which", lambda name: "/usr/bin/" + name)
    monkeypatch.setattr(L.subprocess, "call", lambda cmd, env: calls.append((cmd, env)) or 0)
    monkeypatch.setattr(L, "_has_mpi4py", lambda: True)
    monkeypatch.setattr(L, "gpu_count", lambda: 0)
    env(SLURM_JOB_ID=42, SLURM_PROCID=0, SLURM_NTASKS=4, RANK=0, WORLD_SIZE=1)  # an sbatch script
    assert L.launch(4, ["--steps", "3"], backend="auto") == 0
    cmd, child = calls.pop()
    assert cmd[0] == "/usr/bin/srun" and cmd[2:4] == ["--ntasks", "4"] and cmd[-2:] == ["--steps", "3"]
    assert child["GPULLM_COMM"] == "mpi" and "RANK" not in child and "WORLD_SIZE" not in child
    # --via local keeps mpirun in an allocation too
    assert L.launch(2, [], backend="mpi", via="local") == 0
    assert calls.pop()[0][0] == "/usr/bin/mpirun"
    # NCCL through srun: ranks may sit on other nodes, so more ranks than this node's GPUs are allowed
    monkeypatch.setattr(L, "gpu_count", lambda: 1)
    monkeypatch.setattr(C, "nccl_module", lambda: object())
    assert L.launch(4, [], backend="nccl", via="srun") == 0
    assert calls.pop()[1]["GPULLM_COMM"] == "nccl"
    with pytest.raises(L.LaunchError, match="larger than the 1 GPU"):
        L.choose_backend("nccl", 4, via="local")
    # and needs mpi4py: the NCCL id travels over MPI
    monkeypatch.setattr(L, "_has_mpi4py", lambda: False)
    with pytest.raises(L.LaunchError, match="--backend nccl under srun: mpi4py is not installed"):
        L.launch(2, [], backend="nccl", via="srun")


def test_the_launcher_refuses_srun_outside_a_job(env, monkeypatch, capsys):
    monkeypatch.setattr(L, "_has_mpi4py", lambda: True)
    monkeypatch.setattr(L, "gpu_count", lambda: 0)
    assert not L.in_slurm_allocation()
    with pytest.raises(L.LaunchError, match="--via srun outside a SLURM job"):
        L.launch(2, [], backend="mpi", via="srun")
    with pytest.raises(L.LaunchError, match="--via must be auto, local or srun"):
        L.launch(2, [], backend="mpi", via="ssh")
    assert L.main(["--nproc", "2", "--backend", "mpi", "--via", "srun", "--", "x"]) == 2
    assert "error: --via srun outside a SLURM job" in capsys.readouterr().err
