"""The course's JupyterHub spawners (lab/jupyterhub/README.md), which the config files of this folder load.

- Every learner's server runs in their own folder (`learner_folder`, default ~/gpullm-work), made on their first
  spawn with `python -m gpullm_lessons start FOLDER`, run as the learner; the course's install is only read.
- `CourseSpawner` (one multi-GPU server): local processes, one GPU per learner from a small allocator over the
  server's GPUs (CUDA_VISIBLE_DEVICES and HIP_VISIBLE_DEVICES name it); the GPU goes back when the server stops or
  dies, and a spawn with every GPU taken is refused with a message that says so.
- `CourseSlurmSpawner` (a SLURM cluster): batchspawner's SlurmSpawner with learner-server.sbatch, a batch script
  that asks SLURM for one GPU; SLURM hands out the GPUs.

Nothing of the course package is imported here: the hub may run from another environment than the course's
(`course_python` names the course's Python, which makes the folders and runs the learners' servers).
"""

from __future__ import annotations

import asyncio
import os
import pwd
import sys
from pathlib import Path

from jupyterhub.spawner import LocalProcessSpawner
from tornado import web
from traitlets import Integer, List, Unicode, default
from traitlets.config import Configurable

try:  # JupyterHub 6: a refused spawn, logged without a traceback, its message shown to the learner
    from jupyterhub.spawner import SpawnException
except ImportError:  # JupyterHub 5

    class SpawnException(web.HTTPError):
        def __init__(self, message, *, reason, status_code=400, **_):
            super().__init__(status_code, message, reason=reason)
            self.jupyterhub_message = message


HERE = Path(__file__).resolve().parent
COURSE_DIR = HERE.parents[1]


def default_course_python() -> str:
    """The course's Python: .venv/bin/python of the course's folder (made by `make setup`), else the hub's own."""
    venv = COURSE_DIR / ".venv" / "bin" / "python"  # not resolved: the venv's link is what makes it the venv
    return str(venv) if venv.exists() else sys.executable


def gpus_of_this_machine() -> list[str]:
    """The GPU numbers CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES take on this machine: one per NVIDIA GPU the driver
    lists (/proc/driver/nvidia/gpus, in PCI bus order), else one per AMD GPU of the ROCm driver (/sys/class/kfd)."""
    nvidia = Path("/proc/driver/nvidia/gpus")
    if nvidia.is_dir() and any(nvidia.iterdir()):
        return [str(i) for i in range(len(list(nvidia.iterdir())))]
    amd = 0
    for node in Path("/sys/class/kfd/kfd/topology/nodes").glob("*/gpu_id"):
        try:
            amd += int(node.read_text().strip() or 0) != 0  # CPU nodes have gpu_id 0
        except (OSError, ValueError):
            pass
    return [str(i) for i in range(amd)]


class GPUAllocator:
    """Which learner holds which GPU, in the hub's process (the spawners share it). Spawner state keeps each
    learner's GPU in the hub's database, so a restarted hub gets its table back from the servers still running."""

    def __init__(self):
        self.holders: dict[str, list[str]] = {}  # GPU id -> the learners on it

    def claim(self, learner: str, gpus: list[str], per_gpu: int = 1) -> str | None:
        """A GPU for `learner` (the one they hold already, else the least used one with room), or None: all full."""
        held = self.held_by(learner)
        if held is not None:
            return held
        free = [g for g in gpus if len(self.holders.get(g, [])) < per_gpu]
        if not free:
            return None
        gpu = min(free, key=lambda g: len(self.holders.get(g, [])))  # first among the least used: spread out
        self.holders.setdefault(gpu, []).append(learner)
        return gpu

    def take(self, learner: str, gpu: str):
        """Record a GPU held already (a server that outlived a hub restart)."""
        if self.held_by(learner) is None:
            self.holders.setdefault(gpu, []).append(learner)

    def release(self, learner: str):
        for users in self.holders.values():
            while learner in users:
                users.remove(learner)

    def held_by(self, learner: str) -> str | None:
        return next((g for g, users in self.holders.items() if learner in users), None)

    def table(self) -> dict[str, list[str]]:
        return {g: list(users) for g, users in self.holders.items() if users}


ALLOCATOR = GPUAllocator()


class LearnerServer(Configurable):
    """What both spawners share (c.LearnerServer in a config): each learner's server runs from the course's Python,
    in the learner's own folder, made on their first spawn by the course's `start` command."""

    course_python = Unicode(
        help="The Python of the course's environment: it makes each learner's folder and runs their server "
        "(install the hub extra there, for jupyterhub-singleuser: pip install '.[hub]'). "
        "Default: .venv/bin/python of the course's folder, or the hub's own Python."
    ).tag(config=True)

    @default("course_python")
    def _default_course_python(self):
        return default_course_python()

    learner_folder = Unicode(
        "~/gpullm-work",
        help="Each learner's folder, the root of their JupyterLab: `~` is their home, {username} their name. "
        "Made with `python -m gpullm_lessons start` on their first spawn when it does not exist; never touched after.",
    ).tag(config=True)

    @default("cmd")
    def _default_cmd(self):
        return [self.course_python, "-m", "jupyterhub.singleuser"]

    def learner_home(self) -> str:
        return pwd.getpwnam(self.user.name).pw_dir

    def get_env(self):
        """The course's environment first on PATH: the server, its kernels and what they start find its tools."""
        env = super().get_env()
        bin_dir = os.path.dirname(self.course_python)
        env["PATH"] = os.pathsep.join([bin_dir, env.get("PATH") or os.defpath])
        return env

    def learner_path(self) -> str:
        """learner_folder for this learner, as an absolute path."""
        folder = self.learner_folder.format(username=self.user.name)
        if folder == "~" or folder.startswith("~/"):
            folder = self.learner_home() + folder[1:]
        return os.path.normpath(folder)


class CourseSpawner(LearnerServer, LocalProcessSpawner):
    """One multi-GPU server: each learner's server a process of theirs, with one GPU of its own."""

    gpus = List(
        Unicode(),
        help="The GPUs learners get, one each, as CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES name them "
        "('0', '1', ... or NVIDIA UUIDs). Default: every GPU of this machine.",
    ).tag(config=True)

    @default("gpus")
    def _default_gpus(self):
        return gpus_of_this_machine()

    learners_per_gpu = Integer(
        1, help="Learners who may share one GPU (1: a GPU each; more where a GPU's memory holds several)."
    ).tag(config=True)

    gpu_env = List(
        Unicode(),
        ["CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"],
        help="The variables that show a learner's server its GPU (NVIDIA's and AMD's).",
    ).tag(config=True)

    gpu = Unicode("", help="The GPU this learner's server holds ('' when none).")

    allocator = ALLOCATOR

    def learner_home(self) -> str:
        home = getattr(self, "home_dir", "")  # a spawner that gives learners a home of its own (SimpleLocalProcess)
        return home or super().learner_home()

    def claim_gpu(self) -> str:
        gpu = self.allocator.claim(self.user.name, list(self.gpus), self.learners_per_gpu)
        if gpu is None:
            n = len(self.gpus)
            if n == 0:
                msg = (
                    "This server has no GPU for learners: the hub found none and none is configured "
                    "(the lab's admin sets c.CourseSpawner.gpus)."
                )
            else:
                msg = (
                    f"All {n} GPU(s) of this server are in use: every one is held by another learner's server. "
                    "Try again when one is stopped (idle servers are stopped after a while), or ask your instructor."
                )
            self.log.warning("refusing %s's server: %s (%s)", self.user.name, msg, self.allocator.table())
            raise SpawnException(msg, reason="no-gpu", status_code=503)
        self.gpu = gpu
        self.log.info("%s's server gets GPU %s", self.user.name, gpu)
        return gpu

    def release_gpu(self):
        if self.gpu:
            self.log.info("%s's server gives GPU %s back", self.user.name, self.gpu)
        self.allocator.release(self.user.name)
        self.gpu = ""

    def get_env(self):
        env = super().get_env()
        if self.gpu:
            for var in self.gpu_env:
                env[var] = self.gpu
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # CUDA numbers the GPUs as nvidia-smi and the driver do
        return env

    async def make_learner_folder(self) -> str:
        """The learner's folder, made by `python -m gpullm_lessons start` if it does not exist: both the check and the
        command run as the learner (a home that root may not read, as on a root-squashed NFS, is still seen)."""
        folder = self.learner_path()
        env = {k: v for k, v in self.get_env().items() if not k.startswith("JUPYTERHUB_")}
        proc = await asyncio.create_subprocess_exec(
            "/bin/sh",
            "-c",
            '[ -d "$1" ] || exec "$2" -m gpullm_lessons start "$1"',
            "sh",
            folder,
            self.course_python,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=env,
            preexec_fn=self.make_preexec_fn(self.user.name),  # as the learner, in their home
            start_new_session=True,
        )
        out, _ = await proc.communicate()
        text = out.decode(errors="replace").strip()
        if proc.returncode != 0:
            self.log.error("python -m gpullm_lessons start %s for %s failed:\n%s", folder, self.user.name, text)
            raise SpawnException(
                f"Could not make your course folder {folder}: {text.splitlines()[-1] if text else 'no output'}",
                reason="learner-folder",
                status_code=500,
            )
        if text:
            self.log.info("made %s's folder %s:\n%s", self.user.name, folder, text)
        return folder

    async def start(self):
        self.claim_gpu()
        try:
            self.notebook_dir = await self.make_learner_folder()
            return await super().start()
        except BaseException:
            self.release_gpu()
            raise

    def get_state(self):
        state = super().get_state()
        if self.gpu:
            state["gpu"] = self.gpu
        return state

    def load_state(self, state):
        super().load_state(state)
        if state.get("gpu"):  # a server that outlived a hub restart keeps its GPU
            self.gpu = state["gpu"]
            self.allocator.take(self.user.name, self.gpu)

    def clear_state(self):
        """The server is gone (stopped, or found dead by a poll): its GPU goes back."""
        super().clear_state()
        self.release_gpu()


def _course_script(name: str, python: str) -> str:
    return str(Path(python).parent / name)  # the console scripts beside the course's Python


try:
    from batchspawner import SlurmSpawner
except ImportError:  # the single-server config needs no batchspawner
    SlurmSpawner = None

if SlurmSpawner is not None:

    class CourseSlurmSpawner(LearnerServer, SlurmSpawner):
        """A SLURM cluster: each learner's server a batch job (learner-server.sbatch), which asks for one GPU."""

        batch_script_file = Unicode(
            str(HERE / "learner-server.sbatch"),
            help="The batch script's template (Jinja: {{folder}}, {{python}}, {{cmd}}, {{username}}, {{homedir}}, "
            "{{keepvars}}); its top block holds what a lab changes: partition, GPUs, CPUs, time, account, modules.",
        ).tag(config=True)

        @default("batch_script")
        def _default_batch_script(self):
            return Path(self.batch_script_file).read_text()

        # the template's {{folder}} and {{python}}: every req_* trait is one of the script's fields
        req_folder = Unicode()

        @default("req_folder")
        def _default_req_folder(self):
            return self.learner_path()

        req_python = Unicode()

        @default("req_python")
        def _default_req_python(self):
            return self.course_python

        def learner_home(self) -> str:
            return self.req_homedir

        @default("env_keep")
        def _default_env_keep(self):
            # sbatch, squeue and scancel run with the spawner's environment: the hub's PATH finds them, SLURM_CONF
            # (where set) names the cluster; the job gets these too (--export in the script)
            return ["PATH", "LANG", "LC_ALL", "SLURM_CONF"]

        @default("cmd")
        def _default_cmd(self):
            # batchspawner-singleuser runs its argument as a Python script: the console script, not the interpreter
            return [_course_script("jupyterhub-singleuser", self.course_python)]

        @default("batchspawner_singleuser_cmd")
        def _default_batchspawner_singleuser_cmd(self):
            return _course_script("batchspawner-singleuser", self.course_python)

        async def render_batch_script(self, cmd: str | None = None) -> str:
            """The script this learner's job would run (cmd: what runs in place of the server, for a check)."""
            subvars = self.get_req_subvars()
            subvars["cmd"] = self.cmd_formatted_for_batch() if cmd is None else cmd
            return await self._get_batch_script(**subvars)
