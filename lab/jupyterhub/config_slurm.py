# The course's JupyterHub on a SLURM cluster (lab/jupyterhub/README.md): the hub on the login node, each learner's
# JupyterLab a batch job of one GPU on a compute node (learner-server.sbatch: its top block is what a lab edits),
# through batchspawner's SlurmSpawner. Run as root, or as a user who may run sbatch, squeue and scancel as any
# learner through sudo (c.CourseSlurmSpawner.exec_prefix, default "sudo -E -u {username}"):
#     cd /srv/gpullm-hub && /opt/gpullm-lessons/.venv/bin/jupyterhub -f /opt/gpullm-lessons/lab/jupyterhub/config_slurm.py
import os
import socket

c = get_config()  # noqa: F821
load_subconfig(os.path.join(os.path.dirname(os.path.abspath(__file__)), "config_base.py"))  # noqa: F821

import gpullm_hub  # noqa: E402  (beside this file: config_base.py put its folder on sys.path)

if gpullm_hub.SlurmSpawner is None:
    raise SystemExit("config_slurm.py needs batchspawner in the hub's environment: pip install -e '.[hub]'")
c.JupyterHub.spawner_class = gpullm_hub.CourseSlurmSpawner

# The learners' servers on the compute nodes call the hub's API (their port, their activity): it listens on the
# cluster's network, at the name the nodes know this host by (GPULLM_HUB_CONNECT, default this host's name).
c.JupyterHub.hub_bind_url = "http://0.0.0.0:8081"
c.JupyterHub.hub_connect_ip = os.environ.get("GPULLM_HUB_CONNECT", socket.getfqdn())

# A job may wait in the queue: the hub waits this long for it to start, then this long for the server to answer.
c.CourseSlurmSpawner.start_timeout = 600
c.CourseSlurmSpawner.http_timeout = 180
# The batch script (partition, GPUs as --gpus-per-node or --gres, CPUs, time, account, module load): edit the top
# block of learner-server.sbatch, or copy it and name the copy here:
# c.CourseSlurmSpawner.batch_script_file = "/srv/gpullm-hub/learner-server.sbatch"
