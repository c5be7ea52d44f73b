"""The course's JupyterHub (lab/jupyterhub/): the real hub started here, learners logging in over HTTP.

- the hub of config_gpu_server.py, with two fake GPUs, DummyAuthenticator and JupyterHub's SimpleLocalProcessSpawner
  under the course's spawner (every learner a process of this user, homes in a temporary folder): two learners log
  in through the login form, get their servers, each in their own folder (made by `python -m gpullm_lessons start`
  when missing, left alone when there) and each with another GPU in its environment; a third is refused with the
  message that every GPU is held; stopping a server gives its GPU back, and the third then gets it;
- the idle culler is a service of both configs, with the scopes it needs, and the running hub answers its requests;
- the GPU allocator by itself, the configs' shared base, the SLURM batch script's lab block.

tests/test_slurm.py submits the SLURM batch script, as the hub's SlurmSpawner renders it, to its one-node cluster.

Needs jupyterhub, jupyterhub-idle-culler and batchspawner (the hub extra, in the dev extra too) and
configurable-http-proxy (apt-get install node-configurable-http-proxy, or npm install -g configurable-http-proxy):
skips without them, fails instead on CI (GPULLM_REQUIRE_HUB=1, set by .ci/run). The hub, its proxy and every
learner's server are stopped by their PIDs at the end, also when a check fails. About 25 s on 2 cores, beside the
other tests (not in tests/conftest.py's ONE_AT_A_TIME): the servers only start, then wait for requests."""

from __future__ import annotations

import asyncio
import html
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HUB_DIR = ROOT / "lab" / "jupyterhub"
EXERCISES = sorted(p.name for p in (ROOT / "exercises").glob("*.ipynb"))
TOKEN = "gpullm-hub-test-token-0123456789abcdef"  # the test's own service: reads the hub's state, stops servers
CULLER_SCOPES = {"list:users", "read:users:activity", "read:servers", "delete:servers"}


def _skip_or_fail(msg: str):
    """Missing hub pieces: a failure on CI (GPULLM_REQUIRE_HUB=1, set by .ci/run), a skip elsewhere."""
    if os.environ.get("GPULLM_REQUIRE_HUB") == "1":
        pytest.fail("GPULLM_REQUIRE_HUB=1 but " + msg)
    pytest.skip(msg)


def hub_module():
    """lab/jupyterhub/gpullm_hub.py, imported as the configs import it (skips without jupyterhub)."""
    missing = []
    for module, package in (("jupyterhub", "jupyterhub"), ("jupyterhub_idle_culler", "jupyterhub-idle-culler"),
                            ("batchspawner", "batchspawner")):  # fmt: skip
        try:
            __import__(module)
        except ImportError:
            missing.append(package)
    if missing:
        _skip_or_fail(f"{', '.join(missing)} not installed: pip install -e '.[hub]'")
    if str(HUB_DIR) not in sys.path:
        sys.path.insert(0, str(HUB_DIR))
    import gpullm_hub

    return gpullm_hub


def proxy_env() -> dict:
    """The environment the hub starts configurable-http-proxy in (skips without it). Debian's package keeps its node
    modules in /usr/share/nodejs, which only Debian's own node searches: NODE_PATH names it for any other node."""
    env = dict(os.environ)
    if os.path.isdir("/usr/share/nodejs"):
        env["NODE_PATH"] = os.pathsep.join(p for p in ("/usr/share/nodejs", env.get("NODE_PATH")) if p)
    chp = shutil.which("configurable-http-proxy")
    why = "configurable-http-proxy not found"
    if chp:
        p = subprocess.run([chp, "--version"], env=env, capture_output=True, text=True, timeout=60)
        if p.returncode == 0:
            return env
        why = f"configurable-http-proxy --version failed: {p.stderr.strip()[-300:]}"
    _skip_or_fail(f"{why} (apt-get install node-configurable-http-proxy, or npm install -g configurable-http-proxy)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_config(name: str, monkeypatch, **env):
    """The hub's configuration from lab/jupyterhub/<name>, as `jupyterhub -f` loads it."""
    from traitlets.config.loader import PyFileConfigLoader

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return PyFileConfigLoader(name, path=str(HUB_DIR)).load_config()


# ---- the allocator -------------------------------------------------------------------------------------------------


def test_the_allocator_gives_each_learner_another_gpu_until_none_is_left():
    A = hub_module().GPUAllocator()
    gpus = ["0", "1", "2"]
    got = [A.claim(name, gpus) for name in ("ada", "bob", "cyd")]
    assert sorted(got) == gpus  # three learners, three GPUs: none shared
    assert A.claim("dan", gpus) is None  # the fourth: refused
    assert A.claim("bob", gpus) == got[1]  # a learner asking again keeps theirs
    A.release("bob")
    assert A.held_by("bob") is None and A.claim("dan", gpus) == got[1]  # bob's GPU went to dan
    A.release("nobody")  # releasing what is not held changes nothing
    assert A.table() == {got[0]: ["ada"], got[1]: ["dan"], got[2]: ["cyd"]}


def test_shared_gpus_fill_evenly_and_a_restarted_hub_takes_its_table_back():
    A = hub_module().GPUAllocator()
    gpus = ["0", "1"]
    got = [A.claim(n, gpus, per_gpu=2) for n in ("a", "b", "c", "d")]
    assert got == ["0", "1", "0", "1"] and A.claim("e", gpus, per_gpu=2) is None
    B = hub_module().GPUAllocator()  # a new hub: the servers' stored state says who holds what
    for name, gpu in zip("abcd", got):
        B.take(name, gpu)
    assert B.table() == A.table() and B.claim("e", gpus, per_gpu=2) is None


def test_a_learners_folder_is_in_their_home():
    hub = hub_module()
    from jupyterhub.objects import Hub

    me = pwd.getpwuid(os.getuid())
    user = types.SimpleNamespace(name=me.pw_name, url=f"/user/{me.pw_name}/", escaped_name=me.pw_name)
    spawner = hub.CourseSpawner(user=user, hub=Hub())
    assert spawner.learner_path() == os.path.join(me.pw_dir, "gpullm-work")
    spawner.learner_folder = "/srv/class/{username}"
    assert spawner.learner_path() == f"/srv/class/{me.pw_name}"
    # the server runs from the course's Python, found first on the learner's PATH
    assert spawner.cmd == [spawner.course_python, "-m", "jupyterhub.singleuser"]
    assert spawner.get_env()["PATH"].split(os.pathsep)[0] == os.path.dirname(spawner.course_python)


# ---- the configs ---------------------------------------------------------------------------------------------------


def test_both_configs_share_the_base_and_run_the_idle_culler(monkeypatch):
    hub = hub_module()
    env = dict(GPULLM_HUB_URL="http://10.1.2.3:8443", GPULLM_HUB_IDLE_TIMEOUT="1800", GPULLM_HUB_CONNECT="login1")
    single = load_config("config_gpu_server.py", monkeypatch, **env)
    slurm = load_config("config_slurm.py", monkeypatch, **env)
    assert single.JupyterHub.spawner_class is hub.CourseSpawner
    assert slurm.JupyterHub.spawner_class is hub.CourseSlurmSpawner
    for c in (single, slurm):
        assert c.JupyterHub.bind_url == "http://10.1.2.3:8443"  # the address learners open, from the environment
        assert c.JupyterHub.allow_named_servers is False  # one server, so one GPU, per learner
        assert "--MappingKernelManager.cull_idle_timeout=1800" in c.Spawner.args  # idle kernels free GPU memory
        (culler,) = [s for s in c.JupyterHub.services if s["name"] == "idle-culler"]
        cmd = culler["command"]
        assert cmd[1:3] == ["-m", "jupyterhub_idle_culler"] and "--timeout=1800" in cmd, cmd
        (role,) = [r for r in c.JupyterHub.load_roles if "idle-culler" in r.get("services", [])]
        assert CULLER_SCOPES <= set(role["scopes"]), role
    # the culler's Python has the culler
    p = subprocess.run([cmd[0], "-m", "jupyterhub_idle_culler", "--help"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "--timeout" in p.stdout, p.stderr[-2000:]
    # the hub's own API: this machine only on one server; the cluster's network under SLURM, where the nodes call it
    assert single.JupyterHub.hub_bind_url.startswith("http://127.0.0.1:")
    assert slurm.JupyterHub.hub_bind_url.startswith("http://0.0.0.0:") and slurm.JupyterHub.hub_connect_ip == "login1"
    monkeypatch.delenv("GPULLM_HUB_URL")
    assert load_config("config_gpu_server.py", monkeypatch).JupyterHub.bind_url == "http://127.0.0.1:8000"


def test_the_batch_script_keeps_the_lab_settings_on_top():
    """learner-server.sbatch as the lab/slurm templates: the block a lab edits first (partition, one GPU as
    --gpus-per-node or --gres, CPUs, time, account), a module load line, no #SBATCH after a command."""
    lines = (HUB_DIR / "learner-server.sbatch").read_text().splitlines()
    first_command = next(i for i, s in enumerate(lines) if s.strip() and not s.startswith("#"))
    assert not [s for s in lines[first_command:] if s.startswith("#SBATCH")]
    start = next(i for i, s in enumerate(lines) if s.startswith("# ---- what a lab changes"))
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("# ----"))
    block = lines[start:end]
    for line in ("#SBATCH --gpus-per-node=1", "##SBATCH --gres=gpu:1"):  # one GPU: the first form on, the second off
        assert line in block, line
    for directive in ("#SBATCH --partition=", "#SBATCH --time=", "##SBATCH --account=", "#SBATCH --cpus-per-task="):
        assert any(s.startswith(directive) for s in block), directive
    assert any(s.startswith("# module load ") for s in lines[first_command:])


def test_the_rendered_batch_script_runs_the_server_from_the_course(tmp_path):
    hub = hub_module()
    from jupyterhub.objects import Hub

    me = pwd.getpwuid(os.getuid()).pw_name
    user = types.SimpleNamespace(name=me, url=f"/user/{me}/", escaped_name=me)
    spawner = hub.CourseSlurmSpawner(user=user, hub=Hub(), req_homedir=str(tmp_path), course_python=sys.executable)
    spawner.api_token = "gpullm-hub-test-secret"
    script = asyncio.run(spawner.render_batch_script())
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    bin_dir = Path(sys.executable).parent
    # batchspawner's wrapper (it tells the hub the server's port) runs the course's jupyterhub-singleuser script
    assert f"exec {bin_dir / 'batchspawner-singleuser'} {bin_dir / 'jupyterhub-singleuser'}" in script
    assert (bin_dir / "batchspawner-singleuser").exists() and (bin_dir / "jupyterhub-singleuser").exists()
    assert f'FOLDER="{tmp_path}/gpullm-work"' in script and f"--chdir={tmp_path}" in script
    assert "#SBATCH --gpus-per-node=1" in script and "{{" not in script
    keep = re.search(r"^#SBATCH --export=(\S+)$", script, re.M).group(1).split(",")
    assert {"JUPYTERHUB_API_TOKEN", "JUPYTERHUB_API_URL", "PATH"} <= set(keep)  # what the server needs reaches it
    assert "gpullm-hub-test" not in script  # tokens travel in the environment, not in the script


# ---- the hub, running ----------------------------------------------------------------------------------------------

TEST_CONFIG = """\
c = get_config()
load_subconfig({config!r})

import gpullm_hub
from jupyterhub.spawner import SimpleLocalProcessSpawner


class LearnerSpawner(gpullm_hub.CourseSpawner, SimpleLocalProcessSpawner):
    \"\"\"The course's spawner, with every learner's home in the test's folder and every server run as this user.\"\"\"


c.JupyterHub.spawner_class = LearnerSpawner
c.SimpleLocalProcessSpawner.home_dir_template = {homes!r} + "/{{username}}"
c.CourseSpawner.gpus = ["0", "1"]  # two fake GPUs: the test machine needs none
c.CourseSpawner.course_python = {python!r}
c.JupyterHub.authenticator_class = "dummy"
c.Authenticator.allow_all = True
c.JupyterHub.hub_bind_url = "http://127.0.0.1:{hub_port}"
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:{api_port}"
c.Spawner.args = c.Spawner.args + {root_args!r}
c.LocalProcessSpawner.interrupt_timeout = 10
c.JupyterHub.services.append({{"name": "test", "api_token": {token!r}}})
c.JupyterHub.load_roles.append(
    {{"name": "test", "scopes": ["admin:users", "admin:servers", "admin:server_state"], "services": ["test"]}}
)
"""


class RunningHub:
    """The hub of config_gpu_server.py, started in `root` with TEST_CONFIG on top."""

    def __init__(self, root: Path):
        self.root = root
        self.homes = root / "homes"
        self.url = f"http://127.0.0.1:{_free_port()}"
        self.proc = None
        self.pids: set[int] = set()  # every learner's server seen, stopped by its PID at the end

    def start(self, env: dict):
        self.homes.mkdir()
        (self.root / "jupyterhub_config.py").write_text(
            TEST_CONFIG.format(
                config=str(HUB_DIR / "config_gpu_server.py"),
                homes=str(self.homes),
                python=sys.executable,
                hub_port=_free_port(),
                api_port=_free_port(),
                root_args=["--ServerApp.allow_root=True"] if os.geteuid() == 0 else [],
                token=TOKEN,
            )
        )
        env = dict(env, GPULLM_HUB_URL=self.url)  # the base config's address, from the environment
        self.log_file = self.root / "hub.log"
        with open(self.log_file, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "jupyterhub", "-f", "jupyterhub_config.py"],
                cwd=self.root, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        self.wait(lambda: self.get("/hub/api").status_code == 200, 60, "the hub to answer")

    def log(self) -> str:
        return self.log_file.read_text(errors="replace")

    def wait(self, ready, timeout, what):
        import requests

        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"the hub exited while waiting for {what}:\n{self.log()[-5000:]}")
            try:
                if ready():
                    return
            except requests.ConnectionError:
                pass
            time.sleep(0.2)
        pytest.fail(f"no {what} after {timeout} s:\n{self.log()[-5000:]}")

    def get(self, path, **kw):
        import requests

        return requests.get(self.url + path, timeout=30, **kw)

    def api(self, method, path):
        import requests

        r = requests.request(
            method, f"{self.url}/hub/api{path}", headers={"Authorization": f"token {TOKEN}"}, timeout=30
        )
        assert r.status_code < 400, f"{method} {path}: {r.status_code} {r.text[:500]}"
        return r.json() if r.content else None

    def server(self, name):
        """The learner's default server as the hub's API shows it (state included), or None."""
        return self.api("GET", f"/users/{name}")["servers"].get("")

    def login(self, name):
        """Log in through the form, as a browser does: the login page's _xsrf cookie, the form posted, redirects
        followed (to /hub/spawn, which starts the server). The session and the last response."""
        import requests

        s = requests.Session()
        assert s.get(self.url + "/hub/login", timeout=30).status_code == 200
        r = s.post(f"{self.url}/hub/login?next=", data={"username": name, "password": "any", "_xsrf": s.cookies["_xsrf"]},
                   timeout=60)  # fmt: skip
        return s, r

    def wait_ready(self, name, timeout=90):
        self.wait(lambda: (self.server(name) or {}).get("ready"), timeout, f"{name}'s server to be ready")
        state = self.server(name)["state"]
        self.pids.add(state["pid"])
        return state

    def stop(self):
        """SIGTERM: the hub stops every server, the culler and the proxy; then each is made sure of by its PID."""
        pids = set(self.pids)
        proxy = self.root / "jupyterhub-proxy.pid"
        if proxy.exists():
            pids.add(int(proxy.read_text().strip() or 0))
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pid in pids - {0}:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def environ_of(pid: int) -> dict:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()


@pytest.fixture
def hub(tmp_path):
    hub_module()
    env = proxy_env()
    h = RunningHub(tmp_path)
    try:
        h.start(env)
        yield h
    finally:
        h.stop()


@pytest.mark.slow
def test_each_learner_gets_their_folder_and_a_gpu_of_their_own(hub):
    # bob has a folder already (one file, none of the exercises): it is his, and it is left as it is
    bob_folder = hub.homes / "bob" / "gpullm-work"
    bob_folder.mkdir(parents=True)
    (bob_folder / "mine.txt").write_text("bob's notes\n")
    ada, _ = hub.login("ada")
    bob, _ = hub.login("bob")  # both servers start side by side
    states = {name: hub.wait_ready(name) for name in ("ada", "bob")}

    # each server answers its learner (the OAuth round through the hub first), rooted at the learner's own folder
    for name, session, expected in (("ada", ada, EXERCISES), ("bob", bob, ["mine.txt"])):
        r = session.get(f"{hub.url}/user/{name}/lab", timeout=60)
        assert r.status_code == 200 and r.url.startswith(f"{hub.url}/user/{name}/"), (r.status_code, r.url)
        r = session.get(f"{hub.url}/user/{name}/api/contents", timeout=60)
        assert r.status_code == 200, r.text[:500]
        assert sorted(item["name"] for item in r.json()["content"]) == expected, name
    assert sorted(p.name for p in (hub.homes / "ada" / "gpullm-work").iterdir()) == EXERCISES  # made by `start`
    assert (bob_folder / "mine.txt").read_text() == "bob's notes\n"

    # one GPU each, another for each: in the hub's state and in the server's own environment
    gpus = {name: state["gpu"] for name, state in states.items()}
    assert sorted(gpus.values()) == ["0", "1"], gpus
    for name, state in states.items():
        env = environ_of(state["pid"])
        assert env["CUDA_VISIBLE_DEVICES"] == env["HIP_VISIBLE_DEVICES"] == gpus[name], (name, env)

    # the third learner: refused, with the message that every GPU is held
    cyd, r = hub.login("cyd")
    text = html.unescape(r.text)
    assert r.status_code == 503 and "All 2 GPU(s) of this server are in use" in text, (r.status_code, text[-2000:])
    assert hub.server("cyd") is None

    # ada stops: her server is gone, her GPU goes back, and cyd now gets it
    hub.api("DELETE", "/users/ada/server")
    hub.wait(lambda: hub.server("ada") is None, 60, "ada's server to stop")
    assert not alive(states["ada"]["pid"])
    r = cyd.get(f"{hub.url}/hub/spawn", timeout=60)
    assert r.status_code == 200, (r.status_code, html.unescape(r.text)[-2000:])
    cyd_state = hub.wait_ready("cyd")
    assert cyd_state["gpu"] == gpus["ada"] and environ_of(cyd_state["pid"])["CUDA_VISIBLE_DEVICES"] == gpus["ada"]
    assert hub.server("bob")["state"]["gpu"] == gpus["bob"]  # bob kept his

    # the idle culler runs as the hub's service, and the hub answers it (its token and scopes work)
    assert re.search(r" 200 GET /hub/api/users\S* \(idle-culler@", hub.log()), hub.log()[-5000:]


def test_configs_load_without_the_slurm_spawner_for_one_server():
    """config_gpu_server.py never needs batchspawner: gpullm_hub imports it only if it is there."""
    hub_module()
    code = textwrap.dedent(f"""\
        import builtins, sys
        real = builtins.__import__
        def no_batchspawner(name, *a, **k):
            if name.startswith("batchspawner"):
                raise ImportError("no batchspawner here")
            return real(name, *a, **k)
        builtins.__import__ = no_batchspawner
        sys.path.insert(0, {str(HUB_DIR)!r})
        import gpullm_hub
        assert gpullm_hub.SlurmSpawner is None and gpullm_hub.CourseSpawner
        print("ok")
        """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-2000:]
