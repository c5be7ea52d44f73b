# The part of the course's JupyterHub that the single-server and the SLURM configs share (lab/jupyterhub/README.md):
# where the hub listens, the learners' folders and JupyterLab, the idle culler, who may log in. Not started by itself:
#     jupyterhub -f lab/jupyterhub/config_gpu_server.py      # one server with several GPUs, one per learner
#     jupyterhub -f lab/jupyterhub/config_slurm.py           # a SLURM cluster, one GPU job per learner
# To change a setting without editing the course's files (a shared install may be read-only), keep a config of your
# own that loads one of those, then sets what differs:
#     c = get_config()
#     load_subconfig("/opt/gpullm-lessons/lab/jupyterhub/config_gpu_server.py")
#     c.CourseSpawner.gpus = ["0", "1", "2", "3"]
import os
import sys

c = get_config()  # noqa: F821  (the hub's config loader defines get_config and load_subconfig)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # gpullm_hub.py, beside this file

# ---- where the hub listens ----------------------------------------------------------------------------------------
# The address learners open (the proxy's): this machine only unless GPULLM_HUB_URL says otherwise, e.g.
# GPULLM_HUB_URL=http://:8000 for every interface (put TLS in front: a reverse proxy, or an https:// address with
# c.JupyterHub.ssl_cert and ssl_key). The hub's own API and the proxy's API stay on 127.0.0.1 (config_slurm.py opens
# the hub's API to the compute nodes).
c.JupyterHub.bind_url = os.environ.get("GPULLM_HUB_URL", "http://127.0.0.1:8000")
c.JupyterHub.hub_bind_url = "http://127.0.0.1:8081"
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:8001"

# ---- who may log in -----------------------------------------------------------------------------------------------
# PAM, the hub's default: learners log in with their account on this machine (the login node of a cluster), and
# their servers run as them. Every member of the Unix group gpullm may (groupadd gpullm; usermod -aG gpullm NAME);
# instructors as admins see and stop every server: c.Authenticator.admin_users = {"instructor"}.
c.PAMAuthenticator.allowed_groups = {"gpullm"}

# ---- the learners' servers ----------------------------------------------------------------------------------------
# Each in the learner's folder (made with `python -m gpullm_lessons start` on their first spawn), JupyterLab first.
# A learner's idle kernels are shut down after IDLE seconds, so a forgotten notebook gives its GPU memory back.
IDLE = int(os.environ.get("GPULLM_HUB_IDLE_TIMEOUT", "3600"))
c.Spawner.default_url = "/lab"
c.Spawner.args = [
    f"--MappingKernelManager.cull_idle_timeout={IDLE}",
    "--MappingKernelManager.cull_interval=300",
]
# Both spawners (CourseSpawner, CourseSlurmSpawner) take these from c.LearnerServer:
# c.LearnerServer.learner_folder = "~/gpullm-work"        # ~ is the learner's home, {username} their name
# c.LearnerServer.course_python = "/opt/gpullm-lessons/.venv/bin/python"   # default: the course's .venv
c.JupyterHub.allow_named_servers = False  # one server per learner: one GPU each

# ---- the idle culler ----------------------------------------------------------------------------------------------
# jupyterhub-idle-culler, a service the hub starts and keeps running: a server without activity for IDLE seconds
# (GPULLM_HUB_IDLE_TIMEOUT, default 3600) is stopped, and with it its GPU is given back. Checked every 5 minutes.
c.JupyterHub.services = [
    {
        "name": "idle-culler",
        "command": [sys.executable, "-m", "jupyterhub_idle_culler", f"--timeout={IDLE}", "--cull-every=300"],
    }
]
c.JupyterHub.load_roles = [
    {
        "name": "idle-culler",
        "scopes": ["list:users", "read:users:activity", "read:servers", "delete:servers"],
        "services": ["idle-culler"],
    }
]
